//! Part 2, held locks: the fill over pipelined connections, log padding, and the measurements
//! after it (memory per lock, compaction, a killed and a wiped follower catching up).

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use super::client::{error_code, ws_connect, Errors};
use super::connections::REPLY_TIMEOUT;
use super::followers::{
    cmdline_of, flag, last_snapshot_bytes, remove_member, respawn, time_catch_up,
    WIPED_SAME_ID_WAIT,
};
use super::probes::{dir_size, field, find_leader, metric, peak_rss_of, rss_of, status};
use crate::compare::{start_raftlock, wait_ready, Procs};
use crate::load::{new_hist, Target};

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

pub(super) async fn locks_part(n: u64, base: &Path, run: &str) -> Result<Value, String> {
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
