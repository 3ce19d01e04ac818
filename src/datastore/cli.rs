//! The `data-store` command line: the fenced resource. `POST /write` (or `POST /`) accepts a write
//! only with a current fencing token; every accepted write is flushed to a text file before the
//! answer.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use super::{DataStore, DataStoreLimits};
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
    /// The append-only write log.
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
    /// store then accepts only tokens whose `mac` verifies. Without it any token value is taken.
    #[arg(long, env = "RAFTLOCK_FENCING_KEY_FILE")]
    fencing_key_file: Option<PathBuf>,
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

async fn serve(args: Args) -> ExitCode {
    crate::telemetry::init_logging(false, "info");
    let limits = DataStoreLimits {
        max_data_bytes: args.max_data_bytes,
        ..Default::default()
    };
    let mut store = match DataStore::open(&args.file, limits) {
        Ok(s) => s,
        Err(err) => {
            eprintln!("data-store: {err}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &args.fencing_key_file {
        match crate::fencing::FencingKey::from_file(path) {
            Ok(key) => store = store.with_fencing_key(key),
            Err(err) => {
                eprintln!("data-store: {err}");
                return ExitCode::FAILURE;
            }
        }
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
