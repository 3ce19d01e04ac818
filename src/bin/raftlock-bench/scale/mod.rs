//! `raftlock-bench scale`: RaftLock at scale on this machine, with clusters it starts itself
//! (three `lock-node`s on loopback, as `compare` does).
//!
//! 1. **Connections**: N WebSocket clients on the leader, each holding its own lock (own key, own
//!    client id) with a 30 s lease and renewing it every 10 s, the renewals spread evenly; over a
//!    30 s window: the leader's resident memory per connection, renewals per second, the leader's
//!    CPU per renewal and the renewal latency.
//! 2. **Held locks**: N distinct locks acquired with a 1 h lease over a few pipelined connections;
//!    the fill rate, the leader's memory per held lock, the log compacted after the fill, the
//!    restart of a killed follower, and a follower whose data directory was wiped catching up by
//!    a snapshot the leader encodes for it (its size and how long the encoding took).
//!
//! Every loop is bounded in count and time; server errors are counted and reported, never
//! unwrapped.
//!
//! The code, by concern: this file holds the arguments and the entry point ([`scale`]), which
//! runs the parts and writes the report; [`connections`] is part 1, [`locks`] part 2 (the fill
//! and the measurements after it), [`followers`] the killed and wiped followers of part 2
//! (respawning, removing, catch-up timing), [`client`] the WebSocket client, [`probes`] what is
//! read off the processes and the nodes (memory, CPU, disk, metrics), [`report`] the Markdown.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;

use crate::compare::{machine, today, write_report};

mod client;
mod connections;
mod followers;
mod locks;
mod probes;
mod report;

use connections::connections_part;
use locks::locks_part;
use probes::raise_nofile;
pub(crate) use probes::{peak_rss_of, rss_of};
use report::markdown;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    Connections,
    Locks,
}

pub struct ScaleArgs {
    pub connections: usize,
    pub locks: u64,
    pub only: Option<Part>,
    pub dir: PathBuf,
    pub out: PathBuf,
    pub command_line: String,
}

// ----- report -------------------------------------------------------------------------------

pub async fn scale(args: ScaleArgs) -> Result<(), String> {
    let (soft, hard) = raise_nofile()?;
    println!("open files: soft limit {soft}, hard {hard}");
    let need = args.connections as u64 + 1024;
    if args.only != Some(Part::Locks) && soft < need {
        return Err(format!(
            "{} connections need about {need} open files in this process and in the leader; \
             the hard limit is {hard} (raise it with `ulimit -Hn` as root)",
            args.connections
        ));
    }
    std::fs::create_dir_all(&args.dir).map_err(|e| format!("{}: {e}", args.dir.display()))?;
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let run = format!("{:x}", std::process::id());
    let mut failed = Vec::new();
    let connections = if args.only != Some(Part::Locks) {
        let deadline = Duration::from_secs(15 * 60);
        let r = tokio::time::timeout(
            deadline,
            connections_part(args.connections.max(1), &args.dir, &run),
        )
        .await
        .unwrap_or_else(|_| Err("connections part passed its 15-minute deadline".into()));
        Some(r.unwrap_or_else(|e| {
            failed.push(format!("connections: {e}"));
            json!({"error": e})
        }))
    } else {
        None
    };
    let locks = if args.only != Some(Part::Connections) {
        let deadline = Duration::from_secs(45 * 60);
        let r = tokio::time::timeout(deadline, locks_part(args.locks.max(1), &args.dir, &run))
            .await
            .unwrap_or_else(|_| Err("held-locks part passed its 45-minute deadline".into()));
        Some(r.unwrap_or_else(|e| {
            failed.push(format!("locks: {e}"));
            json!({"error": e})
        }))
    } else {
        None
    };
    let report = json!({
        "date": today(),
        "machine": machine(),
        "command": args.command_line,
        "open_files_limit": soft,
        "connections": connections,
        "locks": locks,
    });
    write_report(&args.out, "scale", &report, &markdown(&report))?;
    // The restarts are measured inside the held-locks part; a step that failed there is a
    // failed run too, not only a cell of the report.
    if let Some(l) = &locks {
        for step in ["restart", "wiped_follower"] {
            if let Some(e) = l[step]["error"].as_str() {
                failed.push(format!("locks, {step}: {e}"));
            }
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}
