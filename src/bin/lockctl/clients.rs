//! Credentials and clients from the global flags: the TLS settings, HS256 tokens, and the lock
//! and admin clients.

use std::time::Duration;

use raftlock::client::{AdminClient, ClientError, RaftLockClient, TlsConfig};
use serde_json::json;

use crate::Args;

pub(super) fn make_client(args: &Args) -> Result<RaftLockClient, ClientError> {
    let mut b = RaftLockClient::builder().endpoints(args.endpoints.iter().cloned());
    let id = args.client_id.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default();
        let host = if host.is_empty() { "local" } else { &host };
        format!("lockctl-{host}-{}", std::process::id())
    });
    b = b.client_id(id);
    if let Some(token) = &args.auth_token {
        b = b.auth_token(token.clone());
    }
    if let Some(ca) = &args.tls_ca {
        b = b.tls_ca_file(ca.clone());
    }
    // OpenTelemetry's convention for passing trace context to a command: the TRACEPARENT
    // environment variable. The requests of this command then join that trace.
    if let Ok(tp) = std::env::var("TRACEPARENT") {
        if raftlock::client::is_traceparent(&tp) {
            b = b.trace_context(move || Some(tp.clone()));
        } else {
            eprintln!(
                "lockctl: ignoring TRACEPARENT {tp:?}: not a W3C traceparent \
                 (00-<32 hex trace id>-<16 hex span id>-<2 hex flags>)"
            );
        }
    }
    b.build()
}

/// An HS256 JWT for `sub` with these rights, valid for `ttl`.
pub(super) fn make_token(
    key_file: &std::path::Path,
    sub: &str,
    prefixes: &[String],
    operations: &[String],
    admin: bool,
    ttl: Duration,
) -> Result<String, String> {
    const KNOWN: [&str; 6] = ["acquire", "release", "renew", "cancel", "read", "write"];
    if let Some(op) = operations.iter().find(|o| !KNOWN.contains(&o.as_str())) {
        return Err(format!(
            "unknown operation {op:?} (known: {})",
            KNOWN.join(", ")
        ));
    }
    if !admin && (prefixes.is_empty() || operations.is_empty()) {
        return Err("give --prefixes and --operations (or --admin)".into());
    }
    let key = raftlock::server::auth::read_jwt_key(key_file)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_secs();
    let claims = json!({
        "sub": sub, "iat": now, "nbf": now, "exp": now + ttl.as_secs().max(1),
        "raftlock": {"prefixes": prefixes, "operations": operations, "admin": admin},
    });
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(&key),
    )
    .map_err(|e| e.to_string())
}

/// The TLS settings of `--tls-ca`, if given.
pub(super) fn tls_config(args: &Args) -> Result<Option<TlsConfig>, ClientError> {
    args.tls_ca
        .as_deref()
        .map(|ca| raftlock::tls::client_config(ca, None))
        .transpose()
        .map_err(|e| ClientError::Config(e.to_string()))
}

pub(super) fn admin_client(args: &Args) -> Result<AdminClient, ClientError> {
    Ok(AdminClient::new(args.endpoints.clone())?
        .with_auth_token(args.auth_token.clone())
        .with_tls(tls_config(args)?))
}
