//! `lockctl certs`: the CAs and certificates a cluster's TLS needs, for a test cluster or a
//! first deployment. Production clusters usually take them from their own CA or cert-manager;
//! what matters is the names in them and which CA signs which (docs/security.md).
//!
//! Two CAs, so that a client certificate is never a peer certificate:
//! - `ca.pem`, `ca-key.pem`: the peer CA. It signs the node certificates, the operator
//!   certificate and the client port's server certificate. Nodes trust it with `--peer-tls-ca`;
//!   clients trust it to verify the client port (`--tls-ca`, the SDK's `tls_ca_file`).
//! - `client-ca.pem`, `client-ca-key.pem`: the client CA. It signs only client certificates;
//!   nodes trust it with `--client-tls-ca` (the client port), never with `--peer-tls-ca`.
//!
//! A CA already in the directory (certificate and key) is kept and reused, so running the command
//! again issues new leaf certificates under the same CAs: a rotation. A CA certificate without
//! its key (or the reverse) is an error: the command does not replace a CA it cannot use.
//!
//! The leaf certificates:
//! - `node-<id>.pem`, `node-<id>-key.pem` for each node (peer CA): server and client certificate
//!   carrying the node's name (`node-{id}.raftlock` by default) and the given hosts. A node
//!   certificate lets its holder act on the peer port as that node id only.
//! - `operator.pem`, `operator-key.pem` (peer CA): a client-auth certificate whose only DNS name is
//!   the operator name (`operator.raftlock` by default, lock-node's `--peer-tls-operator-name`),
//!   for `lockctl members` and the chart's scale-down hook, which act for other node ids. It
//!   carries no host and no node name.
//! - `client-port.pem`, `client-port-key.pem` (peer CA): the client port's server certificate
//!   for the given hosts. Server-auth only, and no node or operator name: on the peer port it is
//!   worth nothing.
//! - `client.pem`, `client-key.pem` (client CA): a client certificate, for a client port that
//!   requires one (`--client-tls-ca client-ca.pem`). It does not chain to `ca.pem`, so the peer
//!   port refuses it.
//!
//! Keys (`*-key.pem`) are written mode 0600, certificates 0644. Files are written to a temporary
//! name and renamed, so a node that reloads its certificates never reads half a file. The CA
//! keys are needed only to issue certificates: keep them off the nodes and out of every Secret.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// The operator identity lock-node accepts by default (`--peer-tls-operator-name`).
pub const DEFAULT_OPERATOR_NAME: &str = "operator.raftlock";

pub struct CertsRequest<'a> {
    pub out: &'a Path,
    pub nodes: &'a [u64],
    pub node_name: &'a str,
    pub operator_name: &'a str,
    pub hosts: &'a [String],
    pub valid_days: u32,
}

/// Writes the files; returns the paths written.
pub fn generate(req: &CertsRequest<'_>) -> Result<Vec<PathBuf>, String> {
    check_names(req)?;
    std::fs::create_dir_all(req.out)
        .map_err(|e| format!("cannot create {}: {e}", req.out.display()))?;
    let mut written = Vec::new();
    let ca_days = req.valid_days.saturating_mul(5);
    // The peer CA keeps its old subject, so that a CA kept from an earlier run still issues
    // certificates that chain to its `ca.pem`.
    let peer_ca_params = ca_params("RaftLock CA", ca_days)?;
    let peer_ca_key = ca(req.out, "ca", &peer_ca_params, &mut written)?;
    let peer_ca = Issuer::from_params(&peer_ca_params, &peer_ca_key);
    let client_ca_params = ca_params("RaftLock client CA", ca_days)?;
    let client_ca_key = ca(req.out, "client-ca", &client_ca_params, &mut written)?;
    let client_ca = Issuer::from_params(&client_ca_params, &client_ca_key);

    let leaf = |issuer: &Issuer<'_, &KeyPair>,
                names: Vec<String>,
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
        let cert = params.signed_by(&key, issuer).map_err(|e| e.to_string())?;
        Ok((cert.pem(), key.serialize_pem()))
    };
    let mut pair = |stem: &str, (cert, key): (String, String)| -> Result<(), String> {
        write(
            &req.out.join(format!("{stem}.pem")),
            &cert,
            false,
            &mut written,
        )?;
        write(
            &req.out.join(format!("{stem}-key.pem")),
            &key,
            true,
            &mut written,
        )
    };

    for &id in req.nodes {
        let name = req.node_name.replace("{id}", &id.to_string());
        let mut names = vec![name.clone()];
        names.extend(req.hosts.iter().cloned());
        pair(
            &format!("node-{id}"),
            leaf(
                &peer_ca,
                names,
                &name,
                vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ],
            )?,
        )?;
    }
    pair(
        "operator",
        leaf(
            &peer_ca,
            vec![req.operator_name.to_string()],
            req.operator_name,
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        )?,
    )?;
    pair(
        "client-port",
        leaf(
            &peer_ca,
            req.hosts.to_vec(),
            "raftlock client port",
            vec![ExtendedKeyUsagePurpose::ServerAuth],
        )?,
    )?;
    pair(
        "client",
        leaf(
            &client_ca,
            Vec::new(),
            "raftlock client",
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        )?,
    )?;
    Ok(written)
}

/// Refuses names that would give a certificate more power than its kind: a host that names a
/// node or the operator goes into every node certificate and the client port's, so each of
/// them would speak for that node or act as the operator.
fn check_names(req: &CertsRequest<'_>) -> Result<(), String> {
    if !req.node_name.contains("{id}") {
        return Err(format!(
            "--node-name `{}` must contain {{id}}",
            req.node_name
        ));
    }
    let operator = req.operator_name;
    if operator.is_empty() || operator.contains('{') || operator.contains('*') {
        return Err(format!(
            "--operator-name `{operator}` must be a plain DNS name (no {{id}}, no wildcard)"
        ));
    }
    if names_a_node(req.node_name, operator) {
        return Err(format!(
            "--operator-name `{operator}` is also a node name under --node-name `{}`",
            req.node_name
        ));
    }
    for host in req.hosts {
        let host = host.to_ascii_lowercase();
        let covers = |name: &str| match host.strip_prefix("*.") {
            Some(suffix) => name
                .split_once('.')
                .is_some_and(|(_, rest)| rest.eq_ignore_ascii_case(suffix)),
            None => host.eq_ignore_ascii_case(name),
        };
        let node_example = req.node_name.replace("{id}", "1");
        if covers(operator)
            || names_a_node(req.node_name, &host)
            || (host.starts_with("*.") && covers(&node_example))
        {
            return Err(format!(
                "--hosts `{host}` names a node or the operator ({}, {operator}): every node \
                 certificate and the client port's carry the hosts, so each would act for it",
                req.node_name
            ));
        }
    }
    Ok(())
}

/// Whether `name` is `pattern` with `{id}` replaced by a number.
fn names_a_node(pattern: &str, name: &str) -> bool {
    let Some((prefix, suffix)) = pattern.split_once("{id}") else {
        return false;
    };
    let name = name.to_ascii_lowercase();
    let (prefix, suffix) = (prefix.to_ascii_lowercase(), suffix.to_ascii_lowercase());
    name.len() > prefix.len() + suffix.len()
        && name.starts_with(&prefix)
        && name.ends_with(&suffix)
        && name[prefix.len()..name.len() - suffix.len()]
            .bytes()
            .all(|b| b.is_ascii_digit())
}

/// The CA `<stem>.pem` / `<stem>-key.pem` in `out`: the key of the one already there, or a new
/// CA written there.
fn ca(
    out: &Path,
    stem: &str,
    params: &CertificateParams,
    written: &mut Vec<PathBuf>,
) -> Result<KeyPair, String> {
    let cert_path = out.join(format!("{stem}.pem"));
    let key_path = out.join(format!("{stem}-key.pem"));
    match (cert_path.exists(), key_path.exists()) {
        (true, true) => {
            let pem = std::fs::read_to_string(&key_path)
                .map_err(|e| format!("{}: {e}", key_path.display()))?;
            KeyPair::from_pem(&pem).map_err(|e| format!("{}: {e}", key_path.display()))
        }
        (false, false) => {
            let key = KeyPair::generate().map_err(|e| e.to_string())?;
            let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
            write(&cert_path, &cert.pem(), false, written)?;
            write(&key_path, &key.serialize_pem(), true, written)?;
            Ok(key)
        }
        (true, false) => Err(format!(
            "{} exists without {}: put the CA's key back to issue certificates under it (or \
             move the CA away to start a new one; nodes trusting the old CA then refuse the new \
             certificates)",
            cert_path.display(),
            key_path.display()
        )),
        (false, true) => Err(format!(
            "{} exists without {}: put the CA certificate back, or remove the key",
            key_path.display(),
            cert_path.display()
        )),
    }
}

/// A CA's parameters: the same subject every time, so a kept CA key issues certificates that
/// chain to the kept CA certificate.
fn ca_params(common_name: &str, valid_days: u32) -> Result<CertificateParams, String> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
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
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mode = if secret { 0o600 } else { 0o644 };
    let tmp = path.with_extension("pem.tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    // `mode` applies only to a file the open created: a temporary file left by an interrupted
    // run keeps its own, so set it before any key byte is written.
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .and_then(|()| file.write_all(text.as_bytes()))
        .and_then(|()| file.sync_all())
        .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    written.push(path.to_path_buf());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::names_a_node;

    #[test]
    fn node_names_are_the_pattern_with_a_number() {
        assert!(names_a_node("node-{id}.raftlock", "node-12.raftlock"));
        assert!(names_a_node("node-{id}.raftlock", "NODE-1.raftlock"));
        assert!(!names_a_node("node-{id}.raftlock", "node-.raftlock"));
        assert!(!names_a_node("node-{id}.raftlock", "node-x.raftlock"));
        assert!(!names_a_node("node-{id}.raftlock", "operator.raftlock"));
    }
}
