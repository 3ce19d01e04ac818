//! `lockctl certs`: a CA and the certificates a cluster's TLS needs, for a test cluster or a
//! first deployment. Production clusters usually take them from their own CA or cert-manager;
//! what matters is the names in them (see the README's Security section).
//!
//! In the output directory:
//! - `ca.pem`, `ca-key.pem`: the CA (kept and reused when the directory already has one, so
//!   running the command again issues new node certificates under the same CA: a rotation);
//! - `node-<id>.pem`, `node-<id>-key.pem` for each node: server and client certificate carrying
//!   the node's name (`node-{id}.raftlock` by default) and the given hosts;
//! - `client-port.pem`, `client-port-key.pem`: the client port's certificate for the given hosts;
//! - `client.pem`, `client-key.pem`: a client certificate, for a client port that requires one.
//!
//! Files are written to a temporary name and renamed, so a node that reloads its certificates
//! never reads half a file.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

pub struct CertsRequest<'a> {
    pub out: &'a Path,
    pub nodes: &'a [u64],
    pub node_name: &'a str,
    pub hosts: &'a [String],
    pub valid_days: u32,
}

/// Writes the files; returns the paths written.
pub fn generate(req: &CertsRequest<'_>) -> Result<Vec<PathBuf>, String> {
    if !req.node_name.contains("{id}") {
        return Err(format!(
            "--node-name `{}` must contain {{id}}",
            req.node_name
        ));
    }
    std::fs::create_dir_all(req.out)
        .map_err(|e| format!("cannot create {}: {e}", req.out.display()))?;
    let mut written = Vec::new();
    let ca_params = ca_params(req.valid_days.saturating_mul(5))?;
    let ca_cert_path = req.out.join("ca.pem");
    let ca_key_path = req.out.join("ca-key.pem");
    let ca_key = if ca_cert_path.exists() && ca_key_path.exists() {
        let pem = std::fs::read_to_string(&ca_key_path)
            .map_err(|e| format!("{}: {e}", ca_key_path.display()))?;
        KeyPair::from_pem(&pem).map_err(|e| format!("{}: {e}", ca_key_path.display()))?
    } else {
        let key = KeyPair::generate().map_err(|e| e.to_string())?;
        let cert = ca_params.self_signed(&key).map_err(|e| e.to_string())?;
        write(&ca_cert_path, &cert.pem(), false, &mut written)?;
        write(&ca_key_path, &key.serialize_pem(), true, &mut written)?;
        key
    };
    let issuer = Issuer::from_params(&ca_params, &ca_key);

    let leaf = |names: Vec<String>,
                common_name: &str,
                usages: Vec<ExtendedKeyUsagePurpose>|
     -> Result<(String, String), String> {
        let mut params = CertificateParams::new(names).map_err(|e| e.to_string())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        params.distinguished_name = dn;
        params.extended_key_usages = usages;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.not_before = now_minus_days(1);
        params.not_after = now_plus_days(req.valid_days);
        let key = KeyPair::generate().map_err(|e| e.to_string())?;
        let cert = params.signed_by(&key, &issuer).map_err(|e| e.to_string())?;
        Ok((cert.pem(), key.serialize_pem()))
    };

    for &id in req.nodes {
        let name = req.node_name.replace("{id}", &id.to_string());
        let mut names = vec![name.clone()];
        names.extend(req.hosts.iter().cloned());
        let (cert, key) = leaf(
            names,
            &name,
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )?;
        write(
            &req.out.join(format!("node-{id}.pem")),
            &cert,
            false,
            &mut written,
        )?;
        write(
            &req.out.join(format!("node-{id}-key.pem")),
            &key,
            true,
            &mut written,
        )?;
    }
    let (cert, key) = leaf(
        req.hosts.to_vec(),
        "raftlock client port",
        vec![ExtendedKeyUsagePurpose::ServerAuth],
    )?;
    write(&req.out.join("client-port.pem"), &cert, false, &mut written)?;
    write(
        &req.out.join("client-port-key.pem"),
        &key,
        true,
        &mut written,
    )?;
    let (cert, key) = leaf(
        Vec::new(),
        "raftlock client",
        vec![ExtendedKeyUsagePurpose::ClientAuth],
    )?;
    write(&req.out.join("client.pem"), &cert, false, &mut written)?;
    write(&req.out.join("client-key.pem"), &key, true, &mut written)?;
    Ok(written)
}

/// The CA's parameters: the same subject every time, so a kept CA key issues certificates
/// that chain to the kept `ca.pem`.
fn ca_params(valid_days: u32) -> Result<CertificateParams, String> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "RaftLock CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = now_minus_days(1);
    params.not_after = now_plus_days(valid_days);
    Ok(params)
}

fn now_plus_days(days: u32) -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc() + time::Duration::days(i64::from(days))
}

fn now_minus_days(days: u32) -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc() - time::Duration::days(i64::from(days))
}

fn write(path: &Path, text: &str, secret: bool, written: &mut Vec<PathBuf>) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("pem.tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    written.push(path.to_path_buf());
    Ok(())
}
