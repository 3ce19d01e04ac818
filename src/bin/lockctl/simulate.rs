//! `lockctl simulate` and `lockctl demo`: many clients contending for a few keys.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use raftlock::client::http::post_json;
use raftlock::client::{RaftLockClient, RetryPolicy};
use serde_json::json;

use crate::local::{LocalCluster, Ports};

pub struct SimulateArgs {
    pub endpoints: Vec<String>,
    pub clients: usize,
    pub keys: usize,
    pub duration: Duration,
    pub ttl: Duration,
    pub hold: Duration,
    pub json: bool,
}

#[derive(Default)]
struct Totals {
    grants: AtomicU64,
    errors: AtomicU64,
}

fn client(endpoints: &[String], id: String, ttl: Duration) -> Result<RaftLockClient, String> {
    RaftLockClient::builder()
        .endpoints(endpoints.iter().cloned())
        .client_id(id)
        .default_ttl(ttl)
        .request_timeout(Duration::from_secs(3))
        .retry_policy(RetryPolicy {
            max_elapsed: Duration::from_secs(15),
            ..RetryPolicy::default()
        })
        .build()
        .map_err(|e| e.to_string())
}

pub async fn simulate(args: SimulateArgs) -> ExitCode {
    if args.clients == 0 || args.clients > 10_000 || args.keys == 0 {
        eprintln!("lockctl simulate: --clients must be 1..=10000 and --keys at least 1");
        return ExitCode::from(2);
    }
    let totals = Arc::new(Totals::default());
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let cl = match client(&args.endpoints, format!("sim-{c}"), args.ttl) {
            Ok(cl) => cl,
            Err(e) => {
                eprintln!("lockctl simulate: {e}");
                return ExitCode::from(2);
            }
        };
        let (totals, stop) = (totals.clone(), stop.clone());
        let (keys, hold, ttl) = (args.keys, args.hold, args.ttl);
        let deadline = started + args.duration;
        tasks.push(tokio::spawn(async move {
            let mut waits = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).ok();
            let mut grants = 0u64;
            let mut n = c;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                n = n
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let key = format!("sim/{}", (n >> 33) % keys);
                let left = deadline.saturating_duration_since(Instant::now());
                let t0 = Instant::now();
                match cl.try_acquire(&key, ttl, left).await {
                    Ok(Some(lock)) => {
                        if let Some(h) = waits.as_mut() {
                            let _ = h.record(t0.elapsed().as_micros().max(1) as u64);
                        }
                        grants += 1;
                        totals.grants.fetch_add(1, Ordering::Relaxed);
                        if !hold.is_zero() {
                            tokio::time::sleep(hold).await;
                        }
                        if lock.release().await.is_err() {
                            totals.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok(None) => {}
                    Err(_) => {
                        totals.errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            (grants, waits)
        }));
    }
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new(args.duration.as_secs().max(1));
        b.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len}s {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    };
    while Instant::now() < started + args.duration {
        tokio::time::sleep(Duration::from_millis(200)).await;
        bar.set_position(started.elapsed().as_secs());
        bar.set_message(format!(
            "grants {}  errors {}",
            totals.grants.load(Ordering::Relaxed),
            totals.errors.load(Ordering::Relaxed)
        ));
    }
    stop.store(true, Ordering::Relaxed);
    bar.finish_and_clear();
    let mut merged = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).ok();
    let mut per_client = Vec::new();
    for t in tasks {
        if let Ok((g, h)) = t.await {
            per_client.push(g);
            if let (Some(m), Some(h)) = (merged.as_mut(), h.as_ref()) {
                let _ = m.add(h);
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let grants = totals.grants.load(Ordering::Relaxed);
    let errors = totals.errors.load(Ordering::Relaxed);
    let q = |p: f64| {
        merged
            .as_ref()
            .map_or(0.0, |h| h.value_at_quantile(p) as f64 / 1000.0)
    };
    let (min, max) = (
        per_client.iter().copied().min().unwrap_or(0),
        per_client.iter().copied().max().unwrap_or(0),
    );
    if args.json {
        println!(
            "{}",
            json!({
                "clients": args.clients, "keys": args.keys, "seconds": elapsed,
                "grants": grants, "errors": errors, "grantsPerSecond": grants as f64 / elapsed,
                "waitMs": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": q(1.0)},
                "grantsPerClient": per_client,
            })
        );
    } else {
        println!(
            "simulate: {} clients, {} keys, {elapsed:.1}s",
            args.clients, args.keys
        );
        println!(
            "  grants: {grants} ({:.0}/s), errors: {errors}",
            grants as f64 / elapsed
        );
        println!(
            "  wait to grant: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            q(0.5),
            q(0.9),
            q(0.99),
            q(1.0)
        );
        println!(
            "  grants per client: min {min}, max {max}, mean {:.1}",
            grants as f64 / args.clients as f64
        );
    }
    if grants == 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

pub struct DemoArgs {
    pub clients: usize,
    pub keys: usize,
    pub duration: Duration,
    pub dir: Option<PathBuf>,
    pub port_base: u16,
}

/// Starts a cluster, runs contending clients writing through the data store with their tokens,
/// SIGKILLs the leader half-way, and checks that no stale write was ever accepted.
pub async fn demo(args: DemoArgs) -> ExitCode {
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("raftlock-demo-{}", std::process::id()))
    });
    let _ = std::fs::remove_dir_all(&dir);
    let ports = Ports {
        peer_base: args.port_base,
        client_base: args.port_base + 10,
        data_store: args.port_base + 20,
    };
    let mut cluster = match LocalCluster::start(3, &dir, ports) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockctl demo: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Some((leader, term)) = cluster.wait_for_leader(Duration::from_secs(30)).await else {
        eprintln!("lockctl demo: no leader elected; logs in {}", dir.display());
        return ExitCode::FAILURE;
    };
    if !cluster.wait_for_data_store(Duration::from_secs(10)).await {
        eprintln!(
            "lockctl demo: the data store did not start; logs in {}",
            dir.display()
        );
        return ExitCode::FAILURE;
    }
    println!(
        "demo: 3 nodes up, leader node {leader} (term {term}); data in {}",
        dir.display()
    );
    let endpoints = cluster.endpoints();
    let store = cluster.data_store_addr();
    let stats = Arc::new(Mutex::new(HashMap::<&'static str, u64>::new()));
    let bump = |stats: &Arc<Mutex<HashMap<&'static str, u64>>>, k: &'static str| {
        *stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(k)
            .or_default() += 1;
    };
    let started = Instant::now();
    let deadline = started + args.duration;
    let ttl = Duration::from_millis(1500);
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let cl = match client(&endpoints, format!("demo-{c}"), ttl) {
            Ok(cl) => cl,
            Err(e) => {
                eprintln!("lockctl demo: {e}");
                return ExitCode::FAILURE;
            }
        };
        let (stats, store, keys) = (stats.clone(), store.clone(), args.keys);
        tasks.push(tokio::spawn(async move {
            let mut n = (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            while Instant::now() < deadline {
                n ^= n << 13;
                n ^= n >> 7;
                n ^= n << 17;
                let key = format!("demo/{}", n % keys as u64);
                let left = deadline.saturating_duration_since(Instant::now());
                let lock = match cl.try_acquire(&key, ttl, left).await {
                    Ok(Some(l)) => l,
                    Ok(None) => continue,
                    Err(_) => {
                        bump(&stats, "acquire errors");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                bump(&stats, "grants");
                let token = lock.fencing_token();
                let write = |data: String| {
                    json!({"clientID": lock.owner_id(), "fencingToken": {"key": key, "value": token}, "data": data})
                };
                for i in 0..2 {
                    match post_json(&store, "/write", &write(format!("w{i}"))).await {
                        Ok((200, _)) => bump(&stats, "writes accepted"),
                        Ok((409, _)) => bump(&stats, "stale writes refused"),
                        _ => bump(&stats, "write errors"),
                    }
                }
                if n.is_multiple_of(5) {
                    // A long pause (a GC stall, a swapped-out VM) past the TTL without renewing:
                    // the lease lapses and someone else may hold the lock by now. Writing
                    // anyway must be refused once a newer holder wrote.
                    tokio::time::sleep(ttl + Duration::from_millis(700)).await;
                    bump(&stats, "paused holders");
                    match post_json(&store, "/write", &write("after pause".into())).await {
                        Ok((200, _)) => bump(&stats, "writes accepted"),
                        Ok((409, _)) => bump(&stats, "stale writes refused"),
                        _ => bump(&stats, "write errors"),
                    }
                    std::mem::forget(lock);
                    continue;
                }
                if lock.release().await.is_err() {
                    bump(&stats, "release errors");
                }
            }
        }));
    }
    // Half-way: SIGKILL the leader, then bring it back.
    tokio::time::sleep(args.duration / 2).await;
    let mut failovers = 0;
    if let Some((leader, _)) = cluster.wait_for_leader(Duration::from_secs(5)).await {
        println!(
            "demo: SIGKILL leader node {leader} at +{:.1}s",
            started.elapsed().as_secs_f64()
        );
        let killed_at = Instant::now();
        cluster.nodes[(leader - 1) as usize].kill();
        if let Some((new, term)) = cluster.wait_for_leader(Duration::from_secs(20)).await {
            failovers += 1;
            println!(
                "demo: node {new} leads (term {term}) {:.0} ms after the kill",
                killed_at.elapsed().as_secs_f64() * 1000.0
            );
        }
        if let Err(e) = cluster.nodes[(leader - 1) as usize].start() {
            eprintln!("lockctl demo: restart failed: {e}");
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    // Audit the data store's own durable log: per key, accepted tokens never go down.
    let log =
        std::fs::read_to_string(dir.join("data-store").join("writes.log")).unwrap_or_default();
    let mut highest: HashMap<String, u64> = HashMap::new();
    let (mut audited, mut stale_accepted) = (0u64, 0u64);
    for line in log.lines() {
        let mut parts = line.splitn(4, '\t');
        let (Some(key), Some(token)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Ok(token) = token.parse::<u64>() else {
            continue;
        };
        audited += 1;
        let h = highest.entry(key.to_string()).or_default();
        if token < *h {
            stale_accepted += 1;
        }
        *h = (*h).max(token);
    }
    let stats = stats.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let get = |k: &str| stats.get(k).copied().unwrap_or(0);
    println!(
        "demo summary ({} clients, {} keys, {:.1}s):",
        args.clients,
        args.keys,
        started.elapsed().as_secs_f64()
    );
    println!("  grants: {}", get("grants"));
    println!("  failovers: {failovers}");
    println!(
        "  writes accepted: {} (audited in the data store's log: {audited})",
        get("writes accepted")
    );
    println!("  stale writes refused: {}", get("stale writes refused"));
    println!("  paused holders: {}", get("paused holders"));
    println!(
        "  errors: acquire {}, write {}, release {}",
        get("acquire errors"),
        get("write errors"),
        get("release errors")
    );
    println!("  stale writes accepted: {stale_accepted}");
    cluster.stop();
    let ok = stale_accepted == 0 && get("grants") > 0 && failovers > 0 && audited > 0;
    if ok {
        let _ = std::fs::remove_dir_all(&dir);
        ExitCode::SUCCESS
    } else {
        eprintln!("demo FAILED; logs kept in {}", dir.display());
        ExitCode::FAILURE
    }
}
