//! Part 2's followers: reading a node's command line and flags, respawning it, removing a
//! member, timing a catch-up and finding the snapshot size in a node's log.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::probes::{field, status};

/// How long a wiped follower restarted with its old flags is watched for catching up.
pub(super) const WIPED_SAME_ID_WAIT: Duration = Duration::from_secs(20);

/// The value after `name` in a command line.
pub(super) fn flag(argv: &[String], name: &str) -> Option<String> {
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1).cloned())
}

/// Removes a member through a peer port (as `lockctl members remove`), following the leader.
pub(super) async fn remove_member(peer: &str, id: u64) -> Result<(), String> {
    use raftlock::server::proto::peer::peer_client::PeerClient;
    use raftlock::server::proto::peer::RemoveServerRequest;
    let mut target = peer.to_string();
    for _ in 0..5 {
        let connect = PeerClient::connect(format!("http://{target}"));
        let mut client = tokio::time::timeout(Duration::from_secs(5), connect)
            .await
            .map_err(|_| format!("peer {target}: connect timed out"))?
            .map_err(|e| format!("peer {target}: {e}"))?;
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            client.remove_server(RemoveServerRequest { server_id: id }),
        )
        .await
        .map_err(|_| format!("remove {id}: timed out"))?
        .map_err(|e| format!("remove {id}: {}", e.message()))?
        .into_inner();
        if reply.success {
            return Ok(());
        }
        if reply.leader_addr.is_empty() || reply.leader_addr == target {
            return Err(format!("remove {id} refused: {}", reply.error));
        }
        target = reply.leader_addr;
    }
    Err(format!("remove {id}: no leader found within 5 hops"))
}

/// Reads `/proc/<pid>/cmdline`, to start the same node again after killing it.
pub(super) fn cmdline_of(pid: u32) -> Result<Vec<String>, String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| format!("cmdline of {pid}: {e}"))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect())
}

pub(super) fn respawn(
    argv: &[String],
    env: &[(&str, &str)],
    log: &Path,
) -> Result<std::process::Child, String> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    Command::new(argv.first().ok_or("empty command line")?)
        .args(&argv[1..])
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot restart lock-node: {e}"))
}

/// After a (re)start at `started`: polls a node's /status until it answers (first time) and
/// until its applied index reaches `target` with a leader known and no snapshot install under
/// way (second time). A follower's applied index moves to a snapshot's index when the snapshot
/// has arrived, while its state is still being put in place a slice at a time
/// (`installingSnapshot`); until 2026-11-29 this took the arrival for the catch-up.
pub(super) async fn time_catch_up(
    addr: &str,
    started: Instant,
    target: u64,
    limit: Duration,
) -> Result<(f64, f64, Value), String> {
    let deadline = started + limit;
    let mut first_answer = None;
    let mut last = Value::Null;
    while Instant::now() < deadline {
        if let Ok(s) = status(addr).await {
            first_answer.get_or_insert_with(|| started.elapsed().as_secs_f64());
            if field(&s, "appliedIndex") >= target
                && field(&s, "leaderId") != 0
                && s["installingSnapshot"].is_null()
            {
                let caught = started.elapsed().as_secs_f64();
                return Ok((first_answer.unwrap_or(caught), caught, s));
            }
            last = s;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Err(format!(
        "{addr} did not catch up to index {target} within {} s (last status {last})",
        limit.as_secs()
    ))
}

/// The `bytes` of the last "snapshot encoded" line in a node's JSON log.
pub(super) fn last_snapshot_bytes(log: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .filter(|l| l.contains("snapshot encoded"))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["fields"]["bytes"].as_u64())
        .next_back()
}
