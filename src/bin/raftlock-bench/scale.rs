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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;

use crate::compare::{machine, start_raftlock, today, wait_ready, write_report, Procs};
use crate::load::{new_hist, Target};

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

// ----- part 1: connections ------------------------------------------------------------------

/// Lease of every connection's lock; renewed every `RENEW_PERIOD`.
const CONN_TTL_MS: u64 = 30_000;
const RENEW_PERIOD: Duration = Duration::from_secs(10);
/// The measured window, after every connection holds its lock.
const WINDOW: Duration = Duration::from_secs(30);
/// Time between the last connection and the window, for the node to settle.
const SETTLE: Duration = Duration::from_secs(3);
/// Connections being opened at once, and opened per second at most.
const CONNECT_CONCURRENCY: usize = 64;
const CONNECT_RATE: f64 = 1000.0;
/// One request's answer is awaited at most this long.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

// ----- part 2: held locks -------------------------------------------------------------------

/// Lease of the filled locks: one hour, the node's default `--max-ttl`.
const FILL_TTL_MS: u64 = 3_600_000;
/// Pipelined connections filling the locks, and acquires in flight on each.
const FILL_CONNECTIONS: usize = 16;
const FILL_WINDOW: usize = 128;
/// The whole fill must end within this long; a fill cut short is reported as such.
const FILL_DEADLINE: Duration = Duration::from_secs(15 * 60);
/// How long to pause sending on a connection after a `BUSY` answer.
const BUSY_PAUSE: Duration = Duration::from_millis(250);

/// Raises this process's open-file soft limit to the hard limit; returns (soft, hard).
fn raise_nofile() -> Result<(u64, u64), String> {
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

fn clock_ticks() -> f64 {
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
fn cpu_of(pid: u32, ticks: f64) -> f64 {
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
fn dir_size(path: &Path) -> u64 {
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
async fn http_get(addr: &str, path: &str) -> Result<(u16, String), String> {
    raftlock::client::http::request(addr, "GET", path, None, Duration::from_secs(5))
        .await
        .map_err(|e| format!("GET {addr}{path}: {e}"))
}

async fn status(addr: &str) -> Result<Value, String> {
    let (code, body) = http_get(addr, "/status").await?;
    if code != 200 {
        return Err(format!("{addr}/status: HTTP {code}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("{addr}/status: {e}"))
}

/// The value of one Prometheus sample line, e.g. `raftlock_snapshots_total{kind="taken"}`.
async fn metric(addr: &str, series: &str) -> Result<f64, String> {
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
fn leader_slow_counts(start: &str, end: &str) -> [f64; 4] {
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

fn field(v: &Value, name: &str) -> u64 {
    v[name].as_u64().unwrap_or(0)
}

/// Index (into the endpoints, node id − 1) of the node that reports itself leader.
async fn find_leader(endpoints: &[String]) -> Result<usize, String> {
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

fn ws_config() -> WebSocketConfig {
    // Small buffers: this process holds up to tens of thousands of these.
    WebSocketConfig::default()
        .read_buffer_size(4096)
        .write_buffer_size(0)
}

async fn ws_connect(addr: &str) -> Result<Ws, String> {
    let url = format!("ws://{addr}/ws");
    let connect =
        tokio_tungstenite::connect_async_with_config(url.as_str(), Some(ws_config()), true);
    match tokio::time::timeout(REPLY_TIMEOUT, connect).await {
        Ok(Ok((ws, _))) => Ok(ws),
        Ok(Err(e)) => Err(format!("connect: {e}")),
        Err(_) => Err("connect: timed out".into()),
    }
}

/// Sends one request and waits for the next JSON reply on the connection (one request in flight).
async fn request(ws: &mut Ws, frame: Value) -> Result<Value, String> {
    ws.send(Message::text(frame.to_string()))
        .await
        .map_err(|e| format!("send: {e}"))?;
    let reply = async {
        for _ in 0..16 {
            match ws.next().await {
                Some(Ok(Message::Text(t))) => {
                    return serde_json::from_str::<Value>(t.as_str())
                        .map_err(|e| format!("reply: {e}"))
                }
                Some(Ok(Message::Close(_))) | None => return Err("connection closed".into()),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(format!("receive: {e}")),
            }
        }
        Err("no text reply".into())
    };
    tokio::time::timeout(REPLY_TIMEOUT, reply)
        .await
        .map_err(|_| "timeout".to_string())?
}

/// The error code of a reply (`None` when it succeeded).
fn error_code(reply: &Value) -> Option<String> {
    if reply["success"].as_bool() == Some(true) {
        None
    } else {
        Some(
            reply["error"]["code"]
                .as_str()
                .unwrap_or("UNKNOWN")
                .to_string(),
        )
    }
}

#[derive(Default)]
struct Errors(Mutex<BTreeMap<String, u64>>);

impl Errors {
    fn add(&self, what: &str) {
        if let Ok(mut m) = self.0.lock() {
            *m.entry(what.to_string()).or_default() += 1;
        }
    }
    fn to_json(&self) -> Value {
        self.0
            .lock()
            .map(|m| json!(m.clone()))
            .unwrap_or(Value::Null)
    }
    fn total(&self) -> u64 {
        self.0.lock().map(|m| m.values().sum()).unwrap_or(0)
    }
}

/// State shared by the connection tasks of part 1. Times are µs since `epoch`.
struct ConnShared {
    epoch: Instant,
    /// Renewals scheduled at or after this are not sent (u64::MAX until the window is known).
    stop_at_us: AtomicU64,
    window_start_us: AtomicU64,
    abort: AtomicBool,
    holding: AtomicU64,
    connect_failed: AtomicU64,
    renew_ok_window: AtomicU64,
    renew_failed_window: AtomicU64,
    renew_ok_total: AtomicU64,
    renew_failed_total: AtomicU64,
    latency: Mutex<Histogram<u64>>,
    /// Failures by phase and code, e.g. `connect: timeout`, `renew: STALE_TOKEN`.
    errors: Errors,
}

impl ConnShared {
    fn us(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_micros() as u64
    }
}

/// One client of part 1: connect, take its lock, renew it on its slots until told to stop.
async fn conn_task(
    i: usize,
    n: usize,
    addr: Arc<str>,
    run: Arc<str>,
    shared: Arc<ConnShared>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let key = format!("scale/{run}/conn/{i}");
    let client = format!("scale-{run}-c{i}");
    let mut ws = match ws_connect(&addr).await {
        Ok(ws) => ws,
        Err(e) => {
            shared.errors.add(&format!("connect: {e}"));
            shared.connect_failed.fetch_add(1, Ordering::SeqCst);
            return;
        }
    };
    let acquire = json!({"commandType": 3, "key": key, "clientId": client, "requestId": "a",
                         "ttl": CONN_TTL_MS, "waitTimeout": 0});
    let token = match request(&mut ws, acquire).await {
        Ok(r) => match (error_code(&r), r["fencingToken"]["value"].as_u64()) {
            (None, Some(t)) => t,
            (code, _) => {
                shared.errors.add(&format!(
                    "acquire: {}",
                    code.unwrap_or_else(|| "no token".into())
                ));
                shared.connect_failed.fetch_add(1, Ordering::SeqCst);
                return;
            }
        },
        Err(e) => {
            shared.errors.add(&format!("acquire: {e}"));
            shared.connect_failed.fetch_add(1, Ordering::SeqCst);
            return;
        }
    };
    drop(permit);
    shared.holding.fetch_add(1, Ordering::SeqCst);
    // Renewal slots: epoch + offset + k × period, offsets spread evenly over the period.
    let period_us = RENEW_PERIOD.as_micros() as u64;
    let offset_us = period_us * i as u64 / n.max(1) as u64;
    // Bounded: one slot per period, and the run is bounded by its deadlines (`abort`).
    for _ in 0..100_000u32 {
        if shared.abort.load(Ordering::SeqCst) {
            break;
        }
        let now_us = shared.us(Instant::now());
        // The first slot after now.
        let k = if now_us < offset_us {
            0
        } else {
            (now_us - offset_us) / period_us + 1
        };
        let slot_us = offset_us + k * period_us;
        if slot_us >= shared.stop_at_us.load(Ordering::SeqCst) {
            break;
        }
        let slot = shared.epoch + Duration::from_micros(slot_us);
        tokio::time::sleep_until(slot.into()).await;
        let stop_at = shared.stop_at_us.load(Ordering::SeqCst);
        if slot_us >= stop_at || shared.abort.load(Ordering::SeqCst) {
            break;
        }
        let in_window = slot_us >= shared.window_start_us.load(Ordering::SeqCst);
        let renew = json!({"commandType": 5, "key": key, "clientId": client,
                           "requestId": format!("r{k}"), "ttl": CONN_TTL_MS,
                           "fencingToken": {"value": token}});
        let sent = Instant::now();
        let result = request(&mut ws, renew).await;
        let took = sent.elapsed().as_micros().max(1) as u64;
        let failure = match &result {
            Ok(r) => error_code(r).map(|c| format!("renew: {c}")),
            Err(e) => Some(format!("renew: {e}")),
        };
        match failure {
            None => {
                shared.renew_ok_total.fetch_add(1, Ordering::Relaxed);
                if in_window {
                    shared.renew_ok_window.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut h) = shared.latency.lock() {
                        let _ = h.record(took);
                    }
                }
            }
            Some(what) => {
                shared.errors.add(&what);
                shared.renew_failed_total.fetch_add(1, Ordering::Relaxed);
                if in_window {
                    shared.renew_failed_window.fetch_add(1, Ordering::Relaxed);
                }
                if result.is_err() {
                    // The connection is unusable (timeout or closed): this client is done.
                    break;
                }
            }
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), ws.close(None)).await;
}

async fn connections_part(n: usize, base: &Path, run: &str) -> Result<Value, String> {
    let dir = base.join("connections");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let limit = (n + 1024).to_string();
    let mut procs = Procs(Vec::new());
    let endpoints = start_raftlock(
        &dir,
        &mut procs,
        &[
            ("RAFTLOCK_MAX_CONNECTIONS", limit.as_str()),
            ("RAFTLOCK_MAX_SESSIONS", limit.as_str()),
        ],
    )?;
    wait_ready(Target::Raftlock, &endpoints).await?;
    let leader = find_leader(&endpoints).await?;
    let pid = procs.0[leader].id();
    let addr: Arc<str> = endpoints[leader].clone().into();
    let ticks = clock_ticks();
    println!(
        "connections: cluster ready, leader node {} at {addr}",
        leader + 1
    );

    // Idle baseline: the leader's CPU with no clients (heartbeats, timers).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_before = rss_of(pid);
    let (idle_c0, idle_t0) = (cpu_of(pid, ticks), Instant::now());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle_cpu_per_s = (cpu_of(pid, ticks) - idle_c0) / idle_t0.elapsed().as_secs_f64();

    let shared = Arc::new(ConnShared {
        epoch: Instant::now(),
        stop_at_us: AtomicU64::new(u64::MAX),
        window_start_us: AtomicU64::new(u64::MAX),
        abort: AtomicBool::new(false),
        holding: AtomicU64::new(0),
        connect_failed: AtomicU64::new(0),
        renew_ok_window: AtomicU64::new(0),
        renew_failed_window: AtomicU64::new(0),
        renew_ok_total: AtomicU64::new(0),
        renew_failed_total: AtomicU64::new(0),
        latency: Mutex::new(new_hist()),
        errors: Errors::default(),
    });
    let run: Arc<str> = run.into();
    let sem = Arc::new(tokio::sync::Semaphore::new(CONNECT_CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    let connect_start = Instant::now();
    // Generous but bounded: three times the paced time, at least two minutes.
    let connect_deadline =
        connect_start + Duration::from_secs_f64((3.0 * n as f64 / CONNECT_RATE).max(120.0));
    let mut aborted = None;
    for i in 0..n {
        // Pace: connection i is started no earlier than i / CONNECT_RATE.
        let due = connect_start + Duration::from_secs_f64(i as f64 / CONNECT_RATE);
        tokio::time::sleep_until(due.into()).await;
        let permit =
            match tokio::time::timeout_at(connect_deadline.into(), sem.clone().acquire_owned())
                .await
            {
                Ok(Ok(p)) => p,
                _ => {
                    aborted = Some(format!(
                        "connect phase passed its deadline after starting {i} of {n} connections"
                    ));
                    break;
                }
            };
        tasks.spawn(conn_task(
            i,
            n,
            addr.clone(),
            run.clone(),
            shared.clone(),
            permit,
        ));
        if i % 1000 == 999 {
            println!(
                "  {} connections started, {} holding, {} failed ({:.1} s)",
                i + 1,
                shared.holding.load(Ordering::SeqCst),
                shared.connect_failed.load(Ordering::SeqCst),
                connect_start.elapsed().as_secs_f64()
            );
        }
    }
    while aborted.is_none() {
        let done =
            shared.holding.load(Ordering::SeqCst) + shared.connect_failed.load(Ordering::SeqCst);
        if done >= n as u64 {
            break;
        }
        if Instant::now() >= connect_deadline {
            aborted = Some(format!(
                "connect phase passed its deadline: {done} of {n} connections settled"
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if let Some(reason) = aborted {
        shared.abort.store(true, Ordering::SeqCst);
        tasks.abort_all();
        return Err(format!(
            "{reason} ({} holding, {} failed; errors {})",
            shared.holding.load(Ordering::SeqCst),
            shared.connect_failed.load(Ordering::SeqCst),
            shared.errors.to_json()
        ));
    }
    let connect_seconds = connect_start.elapsed().as_secs_f64();
    let holding = shared.holding.load(Ordering::SeqCst);
    println!(
        "connections: {holding} of {n} holding after {connect_seconds:.1} s; window of {} s starts in {} s",
        WINDOW.as_secs(),
        SETTLE.as_secs()
    );

    let window_start = Instant::now() + SETTLE;
    let window_end = window_start + WINDOW;
    shared
        .window_start_us
        .store(shared.us(window_start), Ordering::SeqCst);
    shared
        .stop_at_us
        .store(shared.us(window_end), Ordering::SeqCst);
    tokio::time::sleep_until(window_start.into()).await;
    let rss_holding = rss_of(pid);
    let cpu_start = cpu_of(pid, ticks);
    let node_connections = metric(&addr, "raftlock_client_connections").await.ok();
    let locks_held = status(&addr).await.ok().map(|s| field(&s, "locksHeld"));
    let metrics_start = http_get(&addr, "/metrics")
        .await
        .map(|(_, b)| b)
        .unwrap_or_default();
    tokio::time::sleep_until(window_end.into()).await;
    let cpu_window = cpu_of(pid, ticks) - cpu_start;
    let metrics_end = http_get(&addr, "/metrics")
        .await
        .map(|(_, b)| b)
        .unwrap_or_default();
    let [leader_renew_over, leader_renews, leader_commit_over, leader_fsync_over] =
        leader_slow_counts(&metrics_start, &metrics_end);
    let window_seconds = window_start.elapsed().as_secs_f64();
    let rss_end = rss_of(pid);
    let still_leader = status(&addr)
        .await
        .map(|s| s["role"] == "leader")
        .unwrap_or(false);
    let leader_changes = metric(&addr, "raftlock_leader_changes_total").await.ok();
    // Renewals already sent finish within their reply timeout.
    let drain = tokio::time::timeout(REPLY_TIMEOUT + Duration::from_secs(10), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drain.is_err() {
        shared.abort.store(true, Ordering::SeqCst);
        tasks.abort_all();
        shared.errors.add("client task did not finish in time");
    }
    drop(procs);

    let ok = shared.renew_ok_window.load(Ordering::SeqCst);
    let failed_window = shared.renew_failed_window.load(Ordering::SeqCst);
    let hist = shared
        .latency
        .lock()
        .map(|h| h.clone())
        .unwrap_or_else(|_| new_hist());
    let q = |p: f64| hist.value_at_quantile(p) as f64 / 1000.0;
    let per_conn = rss_holding.saturating_sub(rss_before) as f64 / holding.max(1) as f64;
    let cpu_net = (cpu_window - idle_cpu_per_s * window_seconds).max(0.0);
    Ok(json!({
        "connections": n,
        "holding": holding,
        "connect_failed": shared.connect_failed.load(Ordering::SeqCst),
        "connect_seconds": connect_seconds,
        "connect_rate_limit_per_s": CONNECT_RATE,
        "connect_concurrency": CONNECT_CONCURRENCY,
        "leader_connections_metric": node_connections,
        "leader_locks_held": locks_held,
        "ttl_ms": CONN_TTL_MS,
        "renew_period_s": RENEW_PERIOD.as_secs(),
        "window_s": window_seconds,
        "leader_rss_before_bytes": rss_before,
        "leader_rss_holding_bytes": rss_holding,
        "leader_rss_end_bytes": rss_end,
        "bytes_per_connection": per_conn,
        "renewals_ok_in_window": ok,
        "renewals_failed_in_window": failed_window,
        "renewals_per_s": ok as f64 / window_seconds,
        "renewals_target_per_s": holding as f64 / RENEW_PERIOD.as_secs_f64(),
        "leader_cpu_s_in_window": cpu_window,
        "leader_idle_cpu_s_per_s": idle_cpu_per_s,
        "cpu_us_per_renewal": cpu_window * 1e6 / ok.max(1) as f64,
        "cpu_us_per_renewal_net_of_idle": cpu_net * 1e6 / ok.max(1) as f64,
        "leader_cpu_percent_of_core": cpu_window / window_seconds * 100.0,
        "renew_p50_ms": q(0.5),
        "renew_p99_ms": q(0.99),
        "renew_p999_ms": q(0.999),
        "renew_max_ms": hist.max() as f64 / 1000.0,
        "renew_over_25ms_client": hist.count_between(25_001, u64::MAX),
        "renew_over_25ms_leader": leader_renew_over,
        "renewals_seen_by_leader": leader_renews,
        "commits_over_25ms_leader": leader_commit_over,
        "flushes_over_25ms_leader": leader_fsync_over,
        "renewals_ok_total": shared.renew_ok_total.load(Ordering::SeqCst),
        "renewals_failed_total": shared.renew_failed_total.load(Ordering::SeqCst),
        "failed_operations_total": shared.errors.total(),
        "errors": shared.errors.to_json(),
        "leader_unchanged": still_leader,
        "leader_changes_total": leader_changes,
    }))
}

// ----- part 2: held locks -------------------------------------------------------------------

struct FillShared {
    next: AtomicU64,
    n: u64,
    granted: AtomicU64,
    /// Attempts beyond the first, all connections together (bounded).
    retries: AtomicU64,
    retries_max: u64,
    gave_up: AtomicU64,
    deadline: Instant,
    latency: Mutex<Histogram<u64>>,
    /// Answers other than a grant, by code (each retried unless not retryable).
    refusals: Errors,
}

fn retryable(code: &str) -> bool {
    matches!(code, "BUSY" | "UNAVAILABLE" | "NOT_LEADER" | "NO_LEADER")
}

/// One pipelined connection of the fill: keeps up to `FILL_WINDOW` acquires in flight, taking
/// key numbers from the shared counter until all are taken.
async fn fill_conn(c: usize, addr: String, run: String, shared: Arc<FillShared>) {
    let mut ws = match ws_connect(&addr).await {
        Ok(ws) => ws,
        Err(e) => {
            shared.refusals.add(&format!("fill connection {c}: {e}"));
            return;
        }
    };
    let client = format!("scale-{run}-fill{c}");
    let mut inflight: HashMap<u64, (Instant, u32)> = HashMap::new();
    let mut retry: VecDeque<(u64, u32)> = VecDeque::new();
    let mut pause_until = Instant::now();
    let mut exhausted = false;
    let bound = shared.n * 4 + 1_000_000;
    for _ in 0..bound {
        if Instant::now() >= shared.deadline {
            break;
        }
        // Top up the window unless paused after a BUSY.
        let mut sent_any = false;
        while inflight.len() < FILL_WINDOW && Instant::now() >= pause_until {
            let (i, attempt) = match retry.pop_front() {
                Some(r) => r,
                None if exhausted => break,
                None => {
                    let i = shared.next.fetch_add(1, Ordering::Relaxed);
                    if i >= shared.n {
                        exhausted = true;
                        break;
                    }
                    (i, 0)
                }
            };
            let frame = json!({"commandType": 3, "key": format!("scale/{run}/lock/{i:08}"),
                               "clientId": client, "requestId": format!("k{i}"),
                               "ttl": FILL_TTL_MS, "waitTimeout": 0});
            if ws.feed(Message::text(frame.to_string())).await.is_err() {
                shared.refusals.add("fill: send failed");
                return;
            }
            inflight.insert(i, (Instant::now(), attempt));
            sent_any = true;
        }
        if sent_any && ws.flush().await.is_err() {
            shared.refusals.add("fill: send failed");
            return;
        }
        if inflight.is_empty() {
            if exhausted && retry.is_empty() {
                break;
            }
            // Paused with nothing in flight.
            tokio::time::sleep_until(pause_until.into()).await;
            continue;
        }
        let frame = match tokio::time::timeout(Duration::from_secs(30), ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => t,
            Ok(Some(Ok(Message::Close(_)))) | Ok(None) => {
                shared.refusals.add("fill: connection closed");
                break;
            }
            Ok(Some(Ok(_))) => continue,
            Ok(Some(Err(e))) => {
                shared.refusals.add(&format!("fill: receive: {e}"));
                break;
            }
            Err(_) => {
                shared.refusals.add("fill: no reply within 30 s");
                break;
            }
        };
        let Ok(reply) = serde_json::from_str::<Value>(frame.as_str()) else {
            shared.refusals.add("fill: malformed reply");
            continue;
        };
        let Some(i) = reply["requestId"]
            .as_str()
            .and_then(|r| r.strip_prefix('k'))
            .and_then(|r| r.parse::<u64>().ok())
        else {
            shared
                .refusals
                .add("fill: reply without a known request id");
            continue;
        };
        let Some((sent, attempt)) = inflight.remove(&i) else {
            continue;
        };
        match error_code(&reply) {
            // ALREADY_HELD: a retried acquire that had taken effect; the lock is held.
            None => {
                shared.granted.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut h) = shared.latency.lock() {
                    let _ = h.record(sent.elapsed().as_micros().max(1) as u64);
                }
            }
            Some(code) => {
                shared.refusals.add(&code);
                if code == "ALREADY_HELD" {
                    shared.granted.fetch_add(1, Ordering::Relaxed);
                } else if retryable(&code)
                    && shared.retries.fetch_add(1, Ordering::Relaxed) < shared.retries_max
                {
                    if code == "BUSY" {
                        pause_until = Instant::now() + BUSY_PAUSE;
                    }
                    retry.push_back((i, attempt + 1));
                } else {
                    shared.gave_up.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    let lost = inflight.len() + retry.len();
    shared.gave_up.fetch_add(lost as u64, Ordering::Relaxed);
    let _ = tokio::time::timeout(Duration::from_secs(2), ws.close(None)).await;
}

/// Writes padding entries (replicated KV puts on one key) until the leader's applied index
/// reaches `target` or `limit` passes; returns how many were answered successfully.
async fn pad_log(addr: &str, run: &str, target: u64, limit: Duration, errors: &Errors) -> u64 {
    let Ok(mut ws) = ws_connect(addr).await else {
        errors.add("pad: connect failed");
        return 0;
    };
    let deadline = Instant::now() + limit;
    let mut ok = 0;
    let mut n = 0u64;
    while Instant::now() < deadline {
        match status(addr).await {
            Ok(s) if field(&s, "appliedIndex") >= target => break,
            _ => {}
        }
        // A burst of 256 pipelined puts, then read their answers.
        let burst = 256;
        for _ in 0..burst {
            n += 1;
            let frame = json!({"commandType": 2, "key": format!("scale/{run}/pad"),
                               "clientId": format!("scale-{run}-pad{}", n / 50_000),
                               "requestId": format!("p{n}"), "value": "x"});
            if ws.feed(Message::text(frame.to_string())).await.is_err() {
                errors.add("pad: send failed");
                return ok;
            }
        }
        if ws.flush().await.is_err() {
            errors.add("pad: send failed");
            return ok;
        }
        let mut busy = false;
        for _ in 0..burst {
            match tokio::time::timeout(REPLY_TIMEOUT, ws.next()).await {
                Ok(Some(Ok(Message::Text(t)))) => {
                    match serde_json::from_str::<Value>(t.as_str())
                        .ok()
                        .map(|r| error_code(&r))
                    {
                        Some(None) => ok += 1,
                        Some(Some(code)) => {
                            busy |= code == "BUSY";
                            errors.add(&format!("pad: {code}"));
                        }
                        None => errors.add("pad: malformed reply"),
                    }
                }
                _ => {
                    errors.add("pad: no reply");
                    return ok;
                }
            }
        }
        if busy {
            tokio::time::sleep(BUSY_PAUSE).await;
        }
    }
    let _ = ws.close(None).await;
    ok
}

/// How long a wiped follower restarted with its old flags is watched for catching up.
const WIPED_SAME_ID_WAIT: Duration = Duration::from_secs(20);

/// The value after `name` in a command line.
fn flag(argv: &[String], name: &str) -> Option<String> {
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1).cloned())
}

/// Removes a member through a peer port (as `lockctl members remove`), following the leader.
async fn remove_member(peer: &str, id: u64) -> Result<(), String> {
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
fn cmdline_of(pid: u32) -> Result<Vec<String>, String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| format!("cmdline of {pid}: {e}"))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect())
}

fn respawn(
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
async fn time_catch_up(
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
fn last_snapshot_bytes(log: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .filter(|l| l.contains("snapshot encoded"))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["fields"]["bytes"].as_u64())
        .next_back()
}

async fn locks_part(n: u64, base: &Path, run: &str) -> Result<Value, String> {
    let dir = base.join("locks");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // One snapshot, right after the fill: the entry threshold is just above the fill's entries
    // (one per acquire, plus clock ticks, elections and refused requests, which also take log
    // entries), the byte threshold out of the way; the gap is closed with padding writes.
    let threshold = n + n / 10 + 5_000;
    let threshold_s = threshold.to_string();
    let env: Vec<(&str, &str)> = vec![
        ("RAFTLOCK_SNAPSHOT_ENTRIES", threshold_s.as_str()),
        ("RAFTLOCK_SNAPSHOT_BYTES", "1125899906842624"),
        ("RAFTLOCK_LOG_FORMAT", "json"),
        ("RUST_LOG", "warn,raftlock::server::driver=info"),
    ];
    let mut procs = Procs(Vec::new());
    let endpoints = start_raftlock(&dir, &mut procs, &env)?;
    wait_ready(Target::Raftlock, &endpoints).await?;
    let leader = find_leader(&endpoints).await?;
    let leader_pid = procs.0[leader].id();
    let addr = endpoints[leader].clone();
    let followers: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    // Each node adds its own share to the configured threshold (so members do not snapshot at
    // the same index); the leader's is the one measured.
    let threshold = raftlock::node::staggered_threshold(threshold, leader as u64 + 1);
    println!(
        "locks: cluster ready, leader node {} at {addr}; snapshot threshold {threshold} entries",
        leader + 1
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_before = rss_of(leader_pid);
    let follower_rss_before = rss_of(procs.0[followers[0]].id());
    let applied_before = field(&status(&addr).await?, "appliedIndex");

    // Fill.
    let shared = Arc::new(FillShared {
        next: AtomicU64::new(0),
        n,
        granted: AtomicU64::new(0),
        retries: AtomicU64::new(0),
        retries_max: n * 2 + 100_000,
        gave_up: AtomicU64::new(0),
        deadline: Instant::now() + FILL_DEADLINE,
        latency: Mutex::new(new_hist()),
        refusals: Errors::default(),
    });
    let fill_start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..FILL_CONNECTIONS {
        tasks.spawn(fill_conn(c, addr.clone(), run.to_string(), shared.clone()));
    }
    let mut last_print = Instant::now();
    let mut last_granted = 0;
    loop {
        let finished = tokio::time::timeout(Duration::from_millis(500), tasks.join_next()).await;
        if let Ok(None) = finished {
            break;
        }
        if last_print.elapsed() >= Duration::from_secs(10) {
            let g = shared.granted.load(Ordering::Relaxed);
            println!(
                "  {g} of {n} held ({:.0}/s over the last {:.0} s, {:.0}/s overall; refusals {})",
                (g - last_granted) as f64 / last_print.elapsed().as_secs_f64(),
                last_print.elapsed().as_secs_f64(),
                g as f64 / fill_start.elapsed().as_secs_f64(),
                shared.refusals.to_json()
            );
            last_print = Instant::now();
            last_granted = g;
        }
        if Instant::now() > shared.deadline + Duration::from_secs(60) {
            tasks.abort_all();
            shared
                .refusals
                .add("fill: connection task did not end in time");
            break;
        }
    }
    let fill_seconds = fill_start.elapsed().as_secs_f64();
    let granted = shared.granted.load(Ordering::SeqCst);
    let fill_complete = granted >= n;
    println!(
        "locks: fill done: {granted} of {n} in {fill_seconds:.1} s ({:.0}/s)",
        granted as f64 / fill_seconds
    );
    let fill_hist = shared
        .latency
        .lock()
        .map(|h| h.clone())
        .unwrap_or_else(|_| new_hist());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let st = status(&addr).await?;
    let rss_after_fill = rss_of(leader_pid);
    let follower_rss_after_fill = rss_of(procs.0[followers[0]].id());
    let locks_held = field(&st, "locksHeld");
    let applied_after_fill = field(&st, "appliedIndex");
    let data_dir_after_fill = dir_size(&dir.join(format!("raftlock-{}", leader + 1)));
    let taken = "raftlock_snapshots_total{kind=\"taken\"}";
    let installed = "raftlock_snapshots_total{kind=\"installed\"}";
    let taken_during_fill = metric(&addr, taken).await.unwrap_or(0.0);
    let changes = "raftlock_leader_changes_total";
    let leader_changes_fill = metric(&addr, changes).await.unwrap_or(0.0);

    // Compaction: pad the log up to the threshold, then time from the crossing to the counter.
    // A node compacts its log to its stored state without encoding a snapshot; one is encoded
    // when a follower needs it (timed below, when the wiped follower joins).
    let pad_errors = Errors::default();
    let pad_start = Instant::now();
    let padded = if applied_after_fill < threshold {
        pad_log(&addr, run, threshold, Duration::from_secs(300), &pad_errors).await
    } else {
        0
    };
    // The crossing is seen by polling (25 ms). If the fill itself crossed the threshold, the
    // compaction's time is not measured (reported as such).
    let compacted_during_fill = applied_after_fill >= threshold;
    let mut crossed = None;
    let mut compaction_seconds = None;
    let snap_deadline = Instant::now() + Duration::from_secs(600);
    while !compacted_during_fill && Instant::now() < snap_deadline {
        if crossed.is_none() {
            if let Ok(s) = status(&addr).await {
                if field(&s, "appliedIndex") >= threshold {
                    crossed = Some(Instant::now());
                }
            }
        }
        if metric(&addr, taken).await.unwrap_or(0.0) > taken_during_fill {
            compaction_seconds = Some(crossed.unwrap_or(pad_start).elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    println!("locks: log compacted after padding {padded} entries: {compaction_seconds:?} s");
    if compaction_seconds.is_none() && !compacted_during_fill {
        pad_errors.add("the log was not compacted within 10 minutes of the fill");
    }
    // The log trimmer deletes compacted entries in the background.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let rss_after_snapshot = rss_of(leader_pid);
    let data_dir_after_snapshot = dir_size(&dir.join(format!("raftlock-{}", leader + 1)));

    // Restart: SIGKILL a follower, start it again, time until it has caught up.
    let f1 = followers[0];
    let node_env: Vec<(&str, &str)> = env.clone();
    let restart = async {
        let argv = cmdline_of(procs.0[f1].id())?;
        let commit = field(&status(&addr).await?, "commitIndex");
        let _ = procs.0[f1].kill();
        let _ = procs.0[f1].wait();
        let started = Instant::now();
        procs.0[f1] = respawn(
            &argv,
            &node_env,
            &dir.join(format!("raftlock-{}.log", f1 + 1)),
        )?;
        let (answer, caught, s) =
            time_catch_up(&endpoints[f1], started, commit, Duration::from_secs(300)).await?;
        Ok::<_, String>(json!({"node": f1 + 1, "commit_index_at_kill": commit,
            "first_status_answer_s": answer, "caught_up_s": caught,
            "applied_index": field(&s, "appliedIndex"),
            "rss_bytes": rss_of(procs.0[f1].id())}))
    }
    .await;
    println!("locks: restart: {restart:?}");

    // The node times the snapshots it encodes (raftlock_snapshot_duration_seconds): the one the
    // joining follower below needs is the first since the fill.
    let snap_sum = "raftlock_snapshot_duration_seconds_sum";
    let snap_count = "raftlock_snapshot_duration_seconds_count";
    let (sum_before, count_before) = (
        metric(&addr, snap_sum).await.unwrap_or(0.0),
        metric(&addr, snap_count).await.unwrap_or(0.0),
    );

    // Wipe: SIGKILL the other follower and delete its data directory. First it is started
    // again as it was (same id, `--initial-cluster`), which Raft does not allow for (a voter
    // never loses its log): for a bounded time, see whether it catches up. Then the documented
    // way (docs/operations.md, start modes: a voter whose data was lost is removed before it joins again): remove it
    // through the leader's peer port and start it with `--join`; it must catch up by installing
    // a snapshot from the leader.
    let f2 = followers[1];
    let wipe = async {
        let argv = cmdline_of(procs.0[f2].id())?;
        let leader_argv = cmdline_of(leader_pid)?;
        let commit = field(&status(&addr).await?, "commitIndex");
        let _ = procs.0[f2].kill();
        let _ = procs.0[f2].wait();
        let data = dir.join(format!("raftlock-{}", f2 + 1));
        let log = dir.join(format!("raftlock-{}.log", f2 + 1));
        std::fs::remove_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
        let started = Instant::now();
        procs.0[f2] = respawn(&argv, &node_env, &log)?;
        // A lock-node that sees it lost its data refuses to start: wait for that first.
        let mut refused = None;
        while started.elapsed() < WIPED_SAME_ID_WAIT {
            if let Ok(Some(exit)) = procs.0[f2].try_wait() {
                refused = Some(exit);
                break;
            }
            if let Ok(s) = status(&endpoints[f2]).await {
                if field(&s, "appliedIndex") >= commit {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let same_id = match refused {
            Some(exit) => Ok(Err(exit)),
            None => time_catch_up(
                &endpoints[f2],
                started,
                commit,
                WIPED_SAME_ID_WAIT.saturating_sub(started.elapsed()),
            )
            .await
            .map(Ok),
        };
        let same_id = match same_id {
            Ok(Err(exit)) => {
                let said = std::fs::read_to_string(&log).ok().and_then(|text| {
                    text.lines()
                        .rev()
                        .find(|l| l.contains("lost its data"))
                        .map(str::to_string)
                });
                json!({"caught_up": false, "refused_to_start": true,
                       "after_s": started.elapsed().as_secs_f64(),
                       "exit_code": exit.code(), "message": said})
            }
            Ok(Ok((_, caught, _))) => json!({"caught_up": true, "caught_up_s": caught}),
            Err(_) => {
                let s = status(&endpoints[f2]).await.unwrap_or(Value::Null);
                let leader_view = status(&addr).await.unwrap_or(Value::Null);
                let match_index = leader_view["replication"]
                    .as_array()
                    .and_then(|r| r.iter().find(|p| field(p, "id") == f2 as u64 + 1))
                    .map(|p| field(p, "matchIndex"));
                json!({"caught_up": false, "waited_s": WIPED_SAME_ID_WAIT.as_secs(),
                       "applied_index": field(&s, "appliedIndex"),
                       "leader_match_index_for_it": match_index})
            }
        };
        println!("locks: wiped follower restarted with its old flags: {same_id}");
        let _ = procs.0[f2].kill();
        let _ = procs.0[f2].wait();
        std::fs::remove_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
        let leader_peer =
            flag(&leader_argv, "--peer-listen").ok_or("leader has no --peer-listen")?;
        remove_member(&leader_peer, f2 as u64 + 1).await?;
        let commit = field(&status(&addr).await?, "commitIndex");
        let mut join_argv = Vec::new();
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            if a == "--initial-cluster" {
                it.next();
                join_argv.push("--join".to_string());
                join_argv.push(leader_peer.clone());
            } else {
                join_argv.push(a.clone());
            }
        }
        let started = Instant::now();
        procs.0[f2] = respawn(&join_argv, &node_env, &log)?;
        let (answer, caught, s) =
            match time_catch_up(&endpoints[f2], started, commit, Duration::from_secs(600)).await {
                Ok(done) => done,
                // What the same-id restart showed is kept when the catch-up fails.
                Err(e) => {
                    return Ok(json!({"node": f2 + 1, "same_id_without_removal": same_id,
                        "commit_index_at_join": commit, "error": e}))
                }
            };
        let installs = metric(&endpoints[f2], installed).await.unwrap_or(0.0);
        Ok::<_, String>(json!({"node": f2 + 1, "same_id_without_removal": same_id,
            "commit_index_at_join": commit,
            "first_status_answer_s": answer, "caught_up_s": caught,
            "applied_index": field(&s, "appliedIndex"),
            "locks_held": field(&s, "locksHeld"),
            "snapshots_installed": installs,
            "rss_bytes": rss_of(procs.0[f2].id()),
            "peak_rss_bytes": peak_rss_of(procs.0[f2].id()),
            "data_dir_bytes": dir_size(&data)}))
    }
    .await;
    println!("locks: wipe: {wipe:?}");
    let (sum_after, count_after) = (
        metric(&addr, snap_sum).await.unwrap_or(0.0),
        metric(&addr, snap_count).await.unwrap_or(0.0),
    );
    let snapshot_seconds = (count_after > count_before)
        .then(|| (sum_after - sum_before) / (count_after - count_before));
    let leader_log = dir.join(format!("raftlock-{}.log", leader + 1));
    let snapshot_bytes = last_snapshot_bytes(&leader_log);
    println!("locks: snapshot encoded for the joining follower: {snapshot_seconds:?} s, {snapshot_bytes:?} bytes");
    let leader_still = status(&addr)
        .await
        .map(|s| s["role"] == "leader")
        .unwrap_or(false);
    let leader_changes_end = metric(&addr, changes).await.unwrap_or(0.0);
    drop(procs);

    let q = |p: f64| fill_hist.value_at_quantile(p) as f64 / 1000.0;
    let per_lock = rss_after_fill.saturating_sub(rss_before) as f64 / granted.max(1) as f64;
    let to_json = |r: Result<Value, String>| r.unwrap_or_else(|e| json!({"error": e}));
    Ok(json!({
        "locks": n,
        "granted": granted,
        "fill_complete": fill_complete,
        "gave_up": shared.gave_up.load(Ordering::SeqCst),
        "retries": shared.retries.load(Ordering::SeqCst),
        "refusals": shared.refusals.to_json(),
        "fill_connections": FILL_CONNECTIONS,
        "fill_window_per_connection": FILL_WINDOW,
        "ttl_ms": FILL_TTL_MS,
        "fill_seconds": fill_seconds,
        "acquires_per_s": granted as f64 / fill_seconds,
        "acquire_p50_ms": q(0.5),
        "acquire_p99_ms": q(0.99),
        "acquire_max_ms": fill_hist.max() as f64 / 1000.0,
        "leader_locks_held": locks_held,
        "applied_index_before_fill": applied_before,
        "applied_index_after_fill": applied_after_fill,
        "leader_rss_before_bytes": rss_before,
        "leader_rss_after_fill_bytes": rss_after_fill,
        "leader_rss_after_snapshot_bytes": rss_after_snapshot,
        "bytes_per_lock": per_lock,
        "follower_rss_before_bytes": follower_rss_before,
        "follower_rss_after_fill_bytes": follower_rss_after_fill,
        "snapshot_threshold_entries": threshold,
        "snapshots_taken_during_fill": taken_during_fill,
        "snapshot_threshold_crossed_by_fill": compacted_during_fill,
        "padding_entries": padded,
        "padding_errors": pad_errors.to_json(),
        "snapshot_seconds": snapshot_seconds,
        "compaction_seconds": compaction_seconds,
        "snapshot_bytes": snapshot_bytes,
        "leader_data_dir_after_fill_bytes": data_dir_after_fill,
        "leader_data_dir_after_snapshot_bytes": data_dir_after_snapshot,
        "restart": to_json(restart),
        "wiped_follower": to_json(wipe),
        "leader_unchanged": leader_still,
        "leader_node": leader + 1,
        "leader_changes_seen_by_fill_end": leader_changes_fill,
        "leader_changes_seen_by_end": leader_changes_end,
    }))
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

fn mib(v: &Value) -> String {
    v.as_f64()
        .map_or("–".into(), |b| format!("{:.1} MiB", b / 1048576.0))
}

fn num(v: &Value, decimals: usize) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.decimals$}"))
}

fn markdown(r: &Value) -> String {
    let mut s = format!(
        "# RaftLock at scale\n\n{} · {} · open-file limit {}\n\nCommand: `{}`\n\n\
         Three `lock-node`s on 127.0.0.1 (release build, fsync on), started by the benchmark; \
         the benchmark's own client runs on the same machine and shares its CPUs. \
         Memory is the leader's resident set (VmRSS from /proc), CPU its utime + stime.\n",
        r["date"].as_str().unwrap_or(""),
        r["machine"].as_str().unwrap_or(""),
        r["open_files_limit"],
        r["command"].as_str().unwrap_or(""),
    );
    let c = &r["connections"];
    if !c.is_null() {
        s.push_str("\n## 1. Connections holding and renewing locks\n\n");
        if let Some(e) = c["error"].as_str() {
            s.push_str(&format!("**Failed:** {e}\n"));
        } else {
            s.push_str(&format!(
                "{} WebSocket connections to the leader, each with its own lock (own key and \
                 client id, {} s lease) renewed every {} s, renewals spread evenly; measured over \
                 a {:.0} s window once all held their lock.\n\n",
                c["connections"],
                c["ttl_ms"].as_u64().unwrap_or(0) / 1000,
                c["renew_period_s"],
                c["window_s"].as_f64().unwrap_or(0.0)
            ));
            s.push_str("| measure | value | what it means |\n|---|---:|---|\n");
            let rows: Vec<(&str, String, String)> = vec![
                ("connections holding a lock", format!("{} of {}", c["holding"], c["connections"]),
                 format!("opened at most {}/s, {} at a time, in {:.1} s; the leader's connection gauge said {}", num(&c["connect_rate_limit_per_s"], 0), c["connect_concurrency"], c["connect_seconds"].as_f64().unwrap_or(0.0), num(&c["leader_connections_metric"], 0))),
                ("leader RSS before", mib(&c["leader_rss_before_bytes"]), "idle cluster, no client connected".into()),
                ("leader RSS holding", mib(&c["leader_rss_holding_bytes"]), format!("all connected and holding, at the window's start ({} at its end)", mib(&c["leader_rss_end_bytes"]))),
                ("bytes per connection + held lock", num(&c["bytes_per_connection"], 0), "(holding − before) / connections: socket, WebSocket task and buffers, client session, lock and its remembered answer".into()),
                ("renewals per second", num(&c["renewals_per_s"], 0), format!("successful renewals sent in the window / window; the schedule asks for {}/s", num(&c["renewals_target_per_s"], 0))),
                ("leader CPU in the window", format!("{} s", num(&c["leader_cpu_s_in_window"], 2)), format!("{}% of one core; idle it used {}% of a core", num(&c["leader_cpu_percent_of_core"], 1), num(&json!(c["leader_idle_cpu_s_per_s"].as_f64().unwrap_or(0.0) * 100.0), 1))),
                ("CPU per renewal", format!("{} µs", num(&c["cpu_us_per_renewal"], 0)), format!("leader CPU in the window / renewals ({} µs after subtracting the idle rate); includes the replication of each renewal to two followers and its fsync", num(&c["cpu_us_per_renewal_net_of_idle"], 0))),
                ("renewal latency p50 / p99", format!("{} / {} ms", num(&c["renew_p50_ms"], 2), num(&c["renew_p99_ms"], 2)), format!("renew sent → answer received (p99.9 {} ms, max {} ms)", num(&c["renew_p999_ms"], 2), num(&c["renew_max_ms"], 2))),
                ("renewals over 25 ms", format!("{} / {}", num(&c["renew_over_25ms_client"], 0), num(&c["renew_over_25ms_leader"], 0)),
                 format!("as the client saw them / as the leader saw them (`raftlock_request_duration_seconds{{op=\"renew\"}}`: from the driver's queue to the answer, the WebSocket read and write left out; {} renewals counted there in the window, which starts a little after the client's); the leader's commits over 25 ms: {}, its flushes: {}", num(&c["renewals_seen_by_leader"], 0), num(&c["commits_over_25ms_leader"], 0), num(&c["flushes_over_25ms_leader"], 0))),
                ("failed operations", format!("{}", c["failed_operations_total"]), format!("connects, acquires and renewals that failed, whole run ({} renewals failed in the window; {} succeeded in total): {}", c["renewals_failed_in_window"], c["renewals_ok_total"], c["errors"])),
            ];
            for (what, value, means) in rows {
                s.push_str(&format!("| {what} | {value} | {means} |\n"));
            }
            s.push_str(&format!(
                "\nLeader changes seen by the leader (`raftlock_leader_changes_total`, the first election included): {}; {}.\n",
                c["leader_changes_total"],
                if c["leader_unchanged"] == true { "it was still leader at the end" } else { "it was NOT leader at the end" }
            ));
        }
    }
    let l = &r["locks"];
    if !l.is_null() {
        s.push_str("\n## 2. Held locks\n\n");
        if let Some(e) = l["error"].as_str() {
            s.push_str(&format!("**Failed:** {e}\n"));
        } else {
            s.push_str(&format!(
                "{} distinct locks acquired ({} h lease) over {} connections to the leader with \
                 {} acquires in flight on each; snapshot threshold set to {} entries so that the \
                 log is compacted right after the fill (the gap closed with {} padding writes); \
                 a snapshot is encoded when the wiped follower joins.\n\n",
                l["locks"],
                l["ttl_ms"].as_u64().unwrap_or(0) / 3_600_000,
                l["fill_connections"],
                l["fill_window_per_connection"],
                l["snapshot_threshold_entries"],
                l["padding_entries"],
            ));
            if l["fill_complete"] != true {
                s.push_str(&format!(
                    "**The fill did not complete: {} of {} locks held.**\n\n",
                    l["granted"], l["locks"]
                ));
            }
            let rs = &l["restart"];
            let wf = &l["wiped_follower"];
            let rows: Vec<(&str, String, String)> = vec![
                ("locks held", format!("{} of {}", l["granted"], l["locks"]), format!("the leader's /status said {}; {} given up", l["leader_locks_held"], l["gave_up"])),
                ("acquire throughput", format!("{}/s", num(&l["acquires_per_s"], 0)), format!("granted / fill time ({} s); acquire latency p50 {} ms, p99 {} ms", num(&l["fill_seconds"], 1), num(&l["acquire_p50_ms"], 1), num(&l["acquire_p99_ms"], 1))),
                ("refused answers", format!("{}", l["refusals"]), format!("answers other than a grant, by code, each retried with the same request id ({} retries)", l["retries"])),
                ("leader RSS before / after fill", format!("{} / {}", mib(&l["leader_rss_before_bytes"]), mib(&l["leader_rss_after_fill_bytes"])), format!("after the compaction: {}; a follower: {} / {}", mib(&l["leader_rss_after_snapshot_bytes"]), mib(&l["follower_rss_before_bytes"]), mib(&l["follower_rss_after_fill_bytes"]))),
                ("bytes per held lock", num(&l["bytes_per_lock"], 0), "(after fill − before) / locks: the lock, its lease timer, the exactly-once answer kept for the acquire, and the log entries not yet compacted".into()),
                ("snapshot size", mib(&l["snapshot_bytes"]), "the encoded state the leader sent the joining follower (from its `snapshot encoded` log line); the state itself lives in the sled data directory, and a snapshot is encoded only when a follower needs one".into()),
                ("snapshot time", if l["snapshot_seconds"].is_null() { "not measured".into() } else { format!("{} s", num(&l["snapshot_seconds"], 2)) }, "the leader's own timing (`raftlock_snapshot_duration_seconds`) of the snapshot it encoded for the joining follower: reading the state and encoding it, on its own thread while the node goes on serving".into()),
                ("log compaction", if l["compaction_seconds"].is_null() { "not measured".into() } else { format!("{} s", num(&l["compaction_seconds"], 3)) }, "from the applied index crossing the threshold (seen by polling every 25 ms) to `raftlock_snapshots_total{kind=\"taken\"}` counting it: the applied state written and the log compacted to it, no snapshot encoded".into()),
                ("leader data directory", format!("{} / {}", mib(&l["leader_data_dir_after_fill_bytes"]), mib(&l["leader_data_dir_after_snapshot_bytes"])), "on disk (allocated blocks) after the fill / 5 s after the compaction".into()),
                ("follower restart", format!("{} s", num(&rs["caught_up_s"], 2)), format!("SIGKILL, start again → its /status shows a leader and applied index ≥ the leader's commit index at the kill ({}); first /status answer after {} s. {}", rs["commit_index_at_kill"], num(&rs["first_status_answer_s"], 2), rs["error"].as_str().unwrap_or(""))),
                ("wiped follower, same flags", if wf["same_id_without_removal"]["refused_to_start"] == true { format!("refused to start ({} s)", num(&wf["same_id_without_removal"]["after_s"], 2)) } else if wf["same_id_without_removal"]["caught_up"] == true { format!("{} s", num(&wf["same_id_without_removal"]["caught_up_s"], 2)) } else { "never caught up".into() }, format!("SIGKILL, data directory deleted, started again with its old flags (same id, --initial-cluster): a voter that forgot the entries it acknowledged must not vote, so the node refuses to start and says why: {}", wf["same_id_without_removal"])),
                ("follower catch-up from empty", format!("{} s", num(&wf["caught_up_s"], 2)), format!("the documented way: wiped node removed from the members through the leader's peer port, started again with `--join` → caught up to {} (snapshots installed: {}; locks held there: {}; its data directory then {}; its RSS then {}, at most {} since it started, the snapshot install included). {}", wf["commit_index_at_join"], wf["snapshots_installed"], wf["locks_held"], mib(&wf["data_dir_bytes"]), mib(&wf["rss_bytes"]), mib(&wf["peak_rss_bytes"]), wf["error"].as_str().unwrap_or(""))),
            ];
            s.push_str("| measure | value | what it means |\n|---|---:|---|\n");
            for (what, value, means) in rows {
                s.push_str(&format!("| {what} | {value} | {means} |\n"));
            }
            if l["padding_errors"]
                .as_object()
                .is_some_and(|m| !m.is_empty())
            {
                s.push_str(&format!(
                    "\nPadding writes refused: {}\n",
                    l["padding_errors"]
                ));
            }
            s.push_str(&format!(
                "\nLeader changes seen by the first leader (node {}'s `raftlock_leader_changes_total`, the first election included): {} by the end of the fill, {} by the end of the run; {}.\n",
                l["leader_node"], l["leader_changes_seen_by_fill_end"], l["leader_changes_seen_by_end"],
                if l["leader_unchanged"] == true { "it was leader again at the end" } else { "it was not leader at the end, so the \"leader\" memory figures above are that node's, whatever its role" }
            ));
        }
    }
    s
}
