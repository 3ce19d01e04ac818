//! The `data-store` command line: the fenced resource. `POST /write` (or `POST /`) accepts a write
//! only with a current fencing token; every accepted write is flushed to a text file before the
//! answer.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::{DataStore, DataStoreLimits, LockCluster};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "data-store", version, about = "RaftLock's fenced data store")]
struct Args {
    /// Listen address.
    #[arg(
        long,
        env = "RAFTLOCK_DATASTORE_LISTEN",
        default_value = "0.0.0.0:8000"
    )]
    listen: String,
    /// The append-only write log. `<file>.lock` beside it is held while the store runs: a
    /// second data store on the same file refuses to start.
    #[arg(
        long,
        env = "RAFTLOCK_DATASTORE_FILE",
        default_value = "./data-store/writes.log"
    )]
    file: PathBuf,
    /// Largest `data` accepted, in bytes.
    #[arg(long, default_value_t = 65536)]
    max_data_bytes: usize,
    /// A file holding the fencing key shared with lock-node (`--fencing-key-file` there): the
    /// store then accepts only tokens whose `mac` verifies.
    #[arg(long, env = "RAFTLOCK_FENCING_KEY_FILE")]
    fencing_key_file: Option<PathBuf>,
    /// A file holding the bearer token clients must send (`Authorization: Bearer <token>`) to
    /// write and to read `GET /data`; 401 without it. `/healthz` and `/metrics` stay open.
    #[arg(long, env = "RAFTLOCK_DATASTORE_TOKEN_FILE")]
    auth_token_file: Option<PathBuf>,
    /// Without a fencing key: the lock nodes' client addresses (`http://host:port,...`). A token
    /// above the highest accepted for its key is accepted only if the lock cluster's leader says
    /// it is the current holder's; when the cluster cannot be asked the write gets 503 (fail
    /// closed).
    #[arg(long, env = "RAFTLOCK_DATASTORE_LOCK_CLUSTER", value_name = "URLS")]
    lock_cluster: Option<String>,
    /// A file holding a bearer token for asking the lock cluster: an admin identity's, when the
    /// nodes authenticate clients (only an admin sees fencing tokens in `/locks`).
    #[arg(long, env = "RAFTLOCK_DATASTORE_LOCK_CLUSTER_TOKEN_FILE")]
    lock_cluster_token_file: Option<PathBuf>,
    /// How long one check with the lock cluster may take before the write is refused (503).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    lock_cluster_timeout: Duration,
    /// Recent writes whose metadata (key, token, client id, size, time) is kept for
    /// `GET /data`; their data stays in the log.
    #[arg(long, default_value_t = 10_000)]
    recent_writes: usize,
    /// Most records in one `GET /data` page (`?limit=`; 100 when not given).
    #[arg(long, default_value_t = 1_000)]
    page_records_max: usize,
    /// Most bytes of data (and metadata) in one `GET /data` page.
    #[arg(long, default_value_t = 1 << 20)]
    page_bytes_max: usize,
    /// The log is compacted (rewritten to the last write of every key) once it is larger than
    /// this many bytes and than `--compact-ratio` times its live content.
    #[arg(long, default_value_t = 64 << 20)]
    compact_min_bytes: u64,
    /// How many times its live content the log may grow to before it is compacted (at least 2).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(2..))]
    compact_ratio: u64,
    /// Log lines as `text` or `json` (one object a line, for a log collector).
    #[arg(long, env = "RAFTLOCK_LOG_FORMAT", default_value = "text",
          value_parser = ["text", "json"])]
    log_format: String,
}

/// Runs the data store with the given command line (the first item is the program name).
pub fn data_store_main<I, T>(argv: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = Args::parse_from(argv);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("data-store: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(serve(args))
}

/// A secret from a file: surrounding whitespace (a trailing newline) is not part of it.
fn read_secret(path: &std::path::Path, what: &str) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the {what} file {}: {e}", path.display()))?;
    let secret = text.trim();
    if secret.is_empty() {
        return Err(format!("the {what} file {} is empty", path.display()));
    }
    Ok(secret.to_string())
}

async fn serve(args: Args) -> ExitCode {
    crate::telemetry::init_logging(args.log_format == "json", "info");
    let limits = DataStoreLimits {
        max_data_bytes: args.max_data_bytes,
        recent_writes: args.recent_writes,
        page_records_max: args.page_records_max,
        page_bytes_max: args.page_bytes_max,
        compact_min_bytes: args.compact_min_bytes,
        compact_ratio: args.compact_ratio,
        ..Default::default()
    };
    let fail = |err: &dyn std::fmt::Display| {
        eprintln!("data-store: {err}");
        ExitCode::FAILURE
    };
    // Everything read and checked before the log is opened (and locked).
    let fencing_key = args.fencing_key_file.as_deref();
    let fencing_key = match fencing_key
        .map(crate::fencing::FencingKey::from_file)
        .transpose()
    {
        Ok(key) => key,
        Err(err) => return fail(&err),
    };
    let secret = |path: &Option<PathBuf>, what| path.as_deref().map(|p| read_secret(p, what));
    let client_token = match secret(&args.auth_token_file, "client token").transpose() {
        Ok(token) => token,
        Err(err) => return fail(&err),
    };
    let cluster_token =
        match secret(&args.lock_cluster_token_file, "lock cluster token").transpose() {
            Ok(token) => token,
            Err(err) => return fail(&err),
        };
    let lock_cluster = args
        .lock_cluster
        .as_deref()
        .map(|spec| LockCluster::new(spec, cluster_token.clone(), args.lock_cluster_timeout));
    let lock_cluster = match lock_cluster.transpose() {
        Ok(cluster) => cluster,
        Err(err) => return fail(&err),
    };
    if lock_cluster.is_none() && cluster_token.is_some() {
        return fail(&"--lock-cluster-token-file needs --lock-cluster");
    }
    let mut store = match DataStore::open(&args.file, limits) {
        Ok(s) => s,
        Err(err) => return fail(&err),
    };
    match (fencing_key, lock_cluster) {
        (Some(key), cluster) => {
            if cluster.is_some() {
                tracing::warn!(
                    "--lock-cluster is not used: with a fencing key every token must carry a MAC, \
                     which proves the lock service issued it"
                );
            }
            tracing::info!("fencing tokens must carry the lock service's MAC (--fencing-key-file)");
            store = store.with_fencing_key(key);
        }
        (None, Some(cluster)) => {
            tracing::info!(
                lock_cluster = %cluster.endpoints().join(","),
                timeout = ?args.lock_cluster_timeout,
                "a fencing token above the highest accepted for its key is checked with the lock \
                 cluster's leader; writes are refused (503) while it cannot be asked"
            );
            store = store.with_lock_cluster(cluster);
        }
        (None, None) => tracing::warn!(
            "unprotected: no --fencing-key-file and no --lock-cluster, so any fencing token value \
             is accepted — anyone who reaches this port can post a huge token and block a key for \
             every real holder"
        ),
    }
    match &client_token {
        Some(token) => store = store.with_client_token(token),
        None => tracing::info!(
            "no --auth-token-file: anyone who reaches this port may write and read GET /data"
        ),
    }
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(err) => {
            eprintln!("data-store: cannot listen on {}: {err}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    tracing::info!(listen = %args.listen, file = %args.file.display(), "data store ready");
    let shutdown = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! { _ = term.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    };
    // Small request/answer exchanges: no Nagle delay on accepted connections.
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    match axum::serve(listener, store.router())
        .with_graceful_shutdown(shutdown)
        .await
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("data-store: {err}");
            ExitCode::FAILURE
        }
    }
}
