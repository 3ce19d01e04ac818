//! What startup reads and writes besides the store: the data directory's incarnation, admission
//! mark and `--force-new-cluster` record, the election seed, and the lock limits and quotas the
//! configuration sets.

use tracing::info;

use super::NodeError;
use crate::lock::Limits;
use crate::server::config::NodeConfig;

/// This node's incarnation: a random id minted when its data directory is created (kept in
/// `incarnation` beside the store). A node whose data was lost comes back as a new incarnation
/// of its id, which the leader can tell from the member that acknowledged the log.
pub(super) fn load_incarnation(data_dir: &std::path::Path, fresh: bool) -> Result<u64, NodeError> {
    let path = data_dir.join("incarnation");
    if !fresh {
        if let Ok(text) = std::fs::read_to_string(&path) {
            if let Ok(v) = u64::from_str_radix(text.trim(), 16) {
                if v != 0 {
                    return Ok(v);
                }
            }
        }
    }
    let v = rand::random::<u64>().max(1);
    write_synced(&path, format!("{v:016x}\n").as_bytes())?;
    info!(incarnation = %format!("{v:016x}"), "this data directory's incarnation");
    Ok(v)
}

/// The mark (`awaiting-admission` in the data directory) of a node that started on an empty
/// directory to join a cluster, kept until its log holds the entry that admitted this
/// incarnation: across restarts until then it stays out of elections. `Some` while it exists.
pub(super) fn admission_mark(
    cfg: &NodeConfig,
    joining_fresh: bool,
) -> Result<Option<std::path::PathBuf>, NodeError> {
    let path = cfg.data_dir.join("awaiting-admission");
    if joining_fresh {
        write_synced(
            &path,
            b"this node has not been admitted to its cluster yet\n",
        )?;
    }
    Ok(path.exists().then_some(path))
}

/// Records the `--force-new-cluster` value a new cluster was started with.
pub(super) fn record_forced(data_dir: &std::path::Path, value: &str) -> Result<(), NodeError> {
    write_synced(
        &data_dir.join("forced-new-cluster"),
        format!("{value}\n").as_bytes(),
    )
}

fn write_synced(path: &std::path::Path, bytes: &[u8]) -> Result<(), NodeError> {
    let write = || -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    };
    write().map_err(|e| NodeError::Config(format!("cannot write {}: {e}", path.display())))
}

/// Election timeouts only need to differ between nodes and restarts; this is the I/O shell, so
/// it may read the clock.
pub(super) fn seed_from_clock(id: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Default lock limits derived from the node configuration.
pub fn lock_limits(cfg: &NodeConfig) -> Limits {
    Limits {
        key_bytes_max: cfg.max_key_bytes,
        value_bytes_max: cfg.max_value_bytes,
        ttl_ms_max: cfg.max_ttl.as_millis() as u64,
        waiters_per_key_max: cfg.max_waiters_per_key,
        session_idle_ms: cfg.session_idle.as_millis() as u64,
        sessions_max: cfg.max_sessions,
        dedupe_retain_ms: cfg.dedupe_retain.as_millis() as u64,
        dedupe_entries_max: cfg.max_answers,
        ..Limits::default()
    }
}

/// The byte budgets and per-identity quotas this node proposes when it leads. Per-identity
/// quotas apply only when clients authenticate: otherwise a client id proves nothing.
pub fn lock_quotas(cfg: &NodeConfig) -> crate::lock::Quotas {
    crate::lock::Quotas {
        data_bytes_max: cfg.max_data_bytes,
        lock_bytes_max: cfg.max_lock_bytes,
        by_identity: !cfg.client_auth_file.is_empty() || !cfg.client_jwt_key_file.is_empty(),
        identity_locks_max: cfg.identity_max_locks,
        identity_waiters_max: cfg.identity_max_waiters,
        identity_sessions_max: cfg.identity_max_sessions,
    }
}
