//! What the benchmark reads off the processes and nodes under test: open-file limit, resident
//! memory, CPU time, disk use, `/status` and `/metrics`, and which node leads.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Raises this process's open-file soft limit to the hard limit; returns (soft, hard).
pub(super) fn raise_nofile() -> Result<(u64, u64), String> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("getrlimit: {e}"))?;
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(|e| format!("setrlimit: {e}"))?;
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("getrlimit: {e}"))?;
    Ok((soft, hard))
}

/// VmRSS of a process, in bytes (0 if unreadable).
pub(crate) fn rss_of(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmRSS:")
}

/// The most memory the process has held at once (its resident set's high-water mark).
pub(crate) fn peak_rss_of(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmHWM:")
}

/// A `kB` line of /proc/<pid>/status, in bytes; 0 if it cannot be read.
fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

pub(super) fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<f64>()
                .ok()
        })
        .filter(|t| *t > 0.0)
        .unwrap_or(100.0)
}

/// utime + stime of a process, in seconds (0 if unreadable).
pub(super) fn cpu_of(pid: u32, ticks: f64) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name, which is in parentheses and may contain spaces.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (get(11) + get(12)) / ticks
}

/// Bytes allocated on disk under `path` (like `du`).
pub(super) fn dir_size(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![path.to_path_buf()];
    let mut visited = 0;
    while let Some(p) = stack.pop() {
        visited += 1;
        if visited > 100_000 {
            break;
        }
        let Ok(entries) = std::fs::read_dir(&p) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else {
                total += m.blocks() * 512;
            }
        }
    }
    total
}

/// A GET on the node's client port through the SDK's HTTP client; returns (status, body).
pub(super) async fn http_get(addr: &str, path: &str) -> Result<(u16, String), String> {
    raftlock::client::http::request(addr, "GET", path, None, Duration::from_secs(5))
        .await
        .map_err(|e| format!("GET {addr}{path}: {e}"))
}

pub(super) async fn status(addr: &str) -> Result<Value, String> {
    let (code, body) = http_get(addr, "/status").await?;
    if code != 200 {
        return Err(format!("{addr}/status: HTTP {code}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("{addr}/status: {e}"))
}

/// The value of one Prometheus sample line, e.g. `raftlock_snapshots_total{kind="taken"}`.
pub(super) async fn metric(addr: &str, series: &str) -> Result<f64, String> {
    let (_, body) = http_get(addr, "/metrics").await?;
    Ok(body
        .lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .filter(|r| r.starts_with(' '))
                .and_then(|r| r.trim().parse::<f64>().ok())
        })
        .unwrap_or(0.0))
}

/// Observations of one Prometheus histogram series above `bound` seconds (a bucket bound) and in
/// all, from the `/metrics` text: `series` is the bucket name with its labels before `le`, e.g.
/// `raftlock_request_duration_seconds_bucket{op="renew",` or `raftlock_fsync_duration_seconds_bucket{`.
fn over_bound(metrics: &str, series: &str, bound: &str) -> (f64, f64) {
    let count = |le: &str| {
        let prefix = format!("{series}le=\"{le}\"}}");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|r| r.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let total = count("+Inf");
    (total - count(bound), total)
}

/// The leader's own count of slow renewals, commits and flushes between two `/metrics` texts:
/// (renewals over 25 ms, renewals, commits over 25 ms, flushes over 25 ms).
pub(super) fn leader_slow_counts(start: &str, end: &str) -> [f64; 4] {
    let delta = |series: &str| {
        let (a_over, a_all) = over_bound(start, series, "0.025");
        let (b_over, b_all) = over_bound(end, series, "0.025");
        (b_over - a_over, b_all - a_all)
    };
    let (renew_over, renews) = delta("raftlock_request_duration_seconds_bucket{op=\"renew\",");
    let (commit_over, _) = delta("raftlock_commit_duration_seconds_bucket{");
    let (fsync_over, _) = delta("raftlock_fsync_duration_seconds_bucket{");
    [renew_over, renews, commit_over, fsync_over]
}

pub(super) fn field(v: &Value, name: &str) -> u64 {
    v[name].as_u64().unwrap_or(0)
}

/// Index (into the endpoints, node id − 1) of the node that reports itself leader.
pub(super) async fn find_leader(endpoints: &[String]) -> Result<usize, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        for (i, ep) in endpoints.iter().enumerate() {
            if let Ok(s) = status(ep).await {
                if s["role"] == "leader" {
                    return Ok(i);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err("no node reported itself leader within 30 s".into())
}
