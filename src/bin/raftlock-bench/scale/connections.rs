//! Part 1, connections: N WebSocket clients on the leader, each holding and renewing its own
//! lock, measured over a window.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::client::{error_code, request, ws_connect, Errors};
use super::probes::{
    clock_ticks, cpu_of, field, find_leader, http_get, leader_slow_counts, metric, rss_of, status,
};
use crate::compare::{start_raftlock, wait_ready, Procs};
use crate::load::{new_hist, Target};

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
pub(super) const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

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

pub(super) async fn connections_part(n: usize, base: &Path, run: &str) -> Result<Value, String> {
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
            // Every connection comes from 127.0.0.1 here: the bound per source address
            // (2500 by default) would refuse the rest.
            ("RAFTLOCK_MAX_CONNECTIONS_PER_ADDRESS", limit.as_str()),
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
    let node_connections = metric(&addr, "raftlock_client_connections{protocol=\"websocket\"}")
        .await
        .ok();
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
