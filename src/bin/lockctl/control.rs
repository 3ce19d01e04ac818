//! Acting on a running `lockctl up` from another terminal.
//!
//! `lockctl up` keeps a state file, `<data-dir>/lockctl-up.json`, with its own pid and each
//! child's pid, ports, arguments, log file and last exit status; it rewrites the file whenever a
//! child exits or starts. `lockctl node stop|kill N` signals the pid from that file and waits for
//! `up` to record the exit. Starting must happen in `up` so the node stays its child: `lockctl
//! node start N` drops a request file `<data-dir>/lockctl-up.control/start-N`, which `up` picks
//! up within a fraction of a second, and waits for the state file to show the new pid.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};

use crate::local::{LocalCluster, Managed};

pub fn state_file(dir: &Path) -> PathBuf {
    dir.join("lockctl-up.json")
}

pub fn control_dir(dir: &Path) -> PathBuf {
    dir.join("lockctl-up.control")
}

fn describe(id: Option<u64>, m: &Managed) -> Value {
    json!({
        "id": id,
        "name": m.name,
        "pid": m.pid(),
        "running": m.child.is_some(),
        "args": m.args,
        "log": m.log.display().to_string(),
        "lastExit": m.last_exit,
    })
}

/// Writes the state file (to a temporary name, then renamed, so readers never see half of it).
pub fn write_state(cluster: &LocalCluster) {
    let nodes: Vec<Value> = cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let id = i as u64 + 1;
            let mut v = describe(Some(id), m);
            v["peerAddr"] = json!(cluster.ports.peer_addr(id));
            v["clientAddr"] = json!(cluster.client_addr(id));
            v
        })
        .collect();
    let state = json!({
        "pid": std::process::id(),
        "dataDir": cluster.dir.display().to_string(),
        "nodes": nodes,
        "dataStore": cluster.data_store.as_ref().map(|m| {
            let mut v = describe(None, m);
            v["addr"] = json!(cluster.data_store_addr());
            v
        }),
    });
    let path = state_file(&cluster.dir);
    let tmp = path.with_extension("json.tmp");
    if std::fs::write(&tmp, format!("{state:#}\n")).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}

pub fn remove_state(dir: &Path) {
    let _ = std::fs::remove_file(state_file(dir));
    let _ = std::fs::remove_dir_all(control_dir(dir));
}

/// The pid of a `lockctl up` that is running on this data directory, if any.
pub fn running_up(dir: &Path) -> Option<i32> {
    let state = read_state(dir)?;
    let pid = state["pid"].as_i64()? as i32;
    (pid != std::process::id() as i32 && alive(pid)).then_some(pid)
}

fn alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
}

fn read_state(dir: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(state_file(dir)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Called by `up` on every tick: starts the nodes that `lockctl node start` asked for.
/// Returns what it did, for `up` to print.
pub fn take_requests(cluster: &mut LocalCluster) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(control_dir(&cluster.dir)) else {
        return out;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let _ = std::fs::remove_file(entry.path());
        let Some(id) = name
            .strip_prefix("start-")
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let Some(m) = cluster.nodes.get_mut((id as usize).wrapping_sub(1)) else {
            out.push(format!("no node {id} to start"));
            continue;
        };
        if m.child.is_some() {
            continue;
        }
        match m.start() {
            Ok(()) => out.push(format!(
                "{} started again (pid {})",
                m.name,
                m.pid().unwrap_or(0)
            )),
            Err(e) => out.push(e),
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeAction {
    Stop,
    Kill,
    Start,
    Restart,
}

fn node_entry(dir: &Path, id: u64) -> Result<Value, String> {
    let state = read_state(dir).ok_or_else(|| {
        format!(
            "no lockctl up is running with --data-dir {} (no {})",
            dir.display(),
            state_file(dir).display()
        )
    })?;
    let pid = state["pid"].as_i64().unwrap_or(0) as i32;
    if pid <= 0 || !alive(pid) {
        return Err(format!(
            "lockctl up (pid {pid}) of {} is not running",
            dir.display()
        ));
    }
    state["nodes"]
        .as_array()
        .and_then(|nodes| nodes.iter().find(|n| n["id"].as_u64() == Some(id)))
        .cloned()
        .ok_or_else(|| format!("the cluster in {} has no node {id}", dir.display()))
}

/// Polls the state file until `done` holds for node `id`, for at most `timeout`.
fn wait_for(
    dir: &Path,
    id: u64,
    timeout: Duration,
    done: impl Fn(&Value) -> bool,
) -> Result<Value, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let entry = node_entry(dir, id)?;
        if done(&entry) {
            return Ok(entry);
        }
        if Instant::now() > deadline {
            return Err(format!("node {id}: lockctl up did not report it in time"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn signal_node(dir: &Path, id: u64, signal: Signal) -> Result<String, String> {
    let entry = node_entry(dir, id)?;
    let Some(pid) = entry["pid"].as_i64().filter(|_| entry["running"] == true) else {
        return Ok(format!("node {id} is not running"));
    };
    kill(Pid::from_raw(pid as i32), signal).map_err(|e| format!("cannot signal node {id}: {e}"))?;
    let timeout = if signal == Signal::SIGKILL { 10 } else { 20 };
    let entry = wait_for(dir, id, Duration::from_secs(timeout), |e| {
        e["running"] != true || e["pid"].as_i64() != Some(pid)
    })?;
    Ok(format!(
        "node {id} (pid {pid}) exited: {}",
        entry["lastExit"].as_str().unwrap_or("?")
    ))
}

fn start_node(dir: &Path, id: u64) -> Result<String, String> {
    let entry = node_entry(dir, id)?;
    if entry["running"] == true {
        return Ok(format!(
            "node {id} is already running (pid {})",
            entry["pid"]
        ));
    }
    let control = control_dir(dir);
    std::fs::create_dir_all(&control)
        .and_then(|()| std::fs::write(control.join(format!("start-{id}")), b""))
        .map_err(|e| format!("cannot write to {}: {e}", control.display()))?;
    let entry = wait_for(dir, id, Duration::from_secs(10), |e| e["running"] == true)?;
    Ok(format!(
        "node {id} started (pid {}), client {}",
        entry["pid"],
        entry["clientAddr"].as_str().unwrap_or("?")
    ))
}

pub fn node(dir: &Path, id: u64, action: NodeAction) -> ExitCode {
    let result = match action {
        NodeAction::Stop => signal_node(dir, id, Signal::SIGTERM),
        NodeAction::Kill => signal_node(dir, id, Signal::SIGKILL),
        NodeAction::Start => start_node(dir, id),
        NodeAction::Restart => signal_node(dir, id, Signal::SIGTERM).and_then(|stopped| {
            println!("{stopped}");
            start_node(dir, id)
        }),
    };
    match result {
        Ok(msg) => {
            println!("{msg}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lockctl node: {e}");
            ExitCode::FAILURE
        }
    }
}
