//! `data-store`: the fenced resource. `POST /write` accepts a write only with a current fencing
//! token; every accepted write is flushed to a text file before the answer.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use raftlock::datastore::{DataStore, DataStoreLimits};

#[derive(Parser, Debug)]
#[command(version, about = "RaftLock's fenced data store")]
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
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    raftlock::telemetry::init_logging(false, "info");
    let limits = DataStoreLimits {
        max_data_bytes: args.max_data_bytes,
        ..Default::default()
    };
    let store = match DataStore::open(&args.file, limits) {
        Ok(s) => s,
        Err(err) => {
            eprintln!("data-store: {err}");
            return ExitCode::FAILURE;
        }
    };
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
