//! `raftlock-bench latency`: where one client's lock cycle goes.
//!
//! Starts a three-node cluster, runs one uncontended client (acquire, release, one after the
//! other) and reads the nodes' own timings from `/metrics` before and after: how long each
//! request spent in the executing node (`raftlock_request_duration_seconds`), how long the
//! leader waited for a majority (`raftlock_commit_duration_seconds`), each node's flushes
//! (`raftlock_fsync_duration_seconds`) and the heartbeat round trips. What the client saw beyond
//! the node's time is the client side: its WebSocket frames, JSON, its runtime and the network.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::compare::{fsync_floor, loopback_floor, start_raftlock, wait_ready, Procs};
use super::load::{self, LoadSpec, Target, Workload};

pub struct LatencyArgs {
    pub seconds: u64,
    pub dir: PathBuf,
}

/// Sum and count of every histogram series in a Prometheus text page, by series name with its
/// labels (`name{labels}`).
fn histogram_sums(text: &str) -> BTreeMap<String, (f64, f64)> {
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.find('{') {
            Some(i) => (&series[..i], &series[i..]),
            None => (series, ""),
        };
        if let Some(base) = name.strip_suffix("_sum") {
            out.entry(format!("{base}{labels}")).or_default().0 = value;
        } else if let Some(base) = name.strip_suffix("_count") {
            out.entry(format!("{base}{labels}")).or_default().1 = value;
        }
    }
    out
}

async fn scrape(endpoints: &[String]) -> Result<Vec<BTreeMap<String, (f64, f64)>>, String> {
    let mut pages = Vec::new();
    for e in endpoints {
        let (status, body) =
            raftlock::client::http::request(e, "GET", "/metrics", None, Duration::from_secs(5))
                .await
                .map_err(|err| format!("{e}/metrics: {err}"))?;
        if status != 200 {
            return Err(format!("{e}/metrics: HTTP {status}"));
        }
        pages.push(histogram_sums(&body));
    }
    Ok(pages)
}

/// Mean in milliseconds of the observations of `series` between two scrapes, and their count.
fn mean_ms(
    before: &BTreeMap<String, (f64, f64)>,
    after: &BTreeMap<String, (f64, f64)>,
    series: &str,
) -> Option<(f64, f64)> {
    let (s1, c1) = after.get(series).copied()?;
    let (s0, c0) = before.get(series).copied().unwrap_or((0.0, 0.0));
    let n = c1 - c0;
    (n > 0.0).then(|| ((s1 - s0) / n * 1000.0, n))
}

pub async fn latency(args: LatencyArgs) -> Result<(), String> {
    std::fs::create_dir_all(&args.dir).map_err(|e| format!("{}: {e}", args.dir.display()))?;
    let (fsync_p50, _) = fsync_floor(&args.dir, 300)?;
    let rtt = loopback_floor(2000)?;
    let floor_ms = 2.0 * (fsync_p50 + rtt) / 1000.0;
    let mut procs = Procs(Vec::new());
    let endpoints = start_raftlock(&args.dir, &mut procs, &[])?;
    wait_ready(Target::Raftlock, &endpoints).await?;
    // The client talks to the leader itself, so that no forwarding hop is in the cycle.
    let mut leader_endpoint = None;
    for e in &endpoints {
        if let Ok((200, v)) = raftlock::client::http::get_json(e, "/status").await {
            if v["role"] == "leader" {
                leader_endpoint = Some(e.clone());
            }
        }
    }
    let leader_endpoint = leader_endpoint.ok_or("no node says it leads")?;
    let before = scrape(&endpoints).await?;
    let spec = LoadSpec {
        target: Target::Raftlock,
        endpoints: vec![leader_endpoint],
        workload: Workload::Uncontended,
        clients: 1,
        duration: Duration::from_secs(args.seconds),
        run_id: "latency".into(),
    };
    let r = load::run(&spec).await?;
    let after = scrape(&endpoints).await?;
    drop(procs);
    if r.grants == 0 {
        return Err("no lock was granted".into());
    }
    let cycle_ms = r.seconds * 1000.0 / r.grants as f64;
    let leader = (0..endpoints.len())
        .max_by_key(|&i| {
            mean_ms(&before[i], &after[i], "raftlock_commit_duration_seconds")
                .map_or(0, |(_, n)| n as u64)
        })
        .unwrap_or(0);
    let row = |what: &str, v: Option<(f64, f64)>| match v {
        Some((ms, n)) => println!("| {what} | {ms:.3} | {n:.0} |"),
        None => println!("| {what} | – | 0 |"),
    };
    println!(
        "One client, uncontended, {} s: {} cycles, errors {}. Floor: fsync p50 {:.3} ms, loopback RTT p50 {:.3} ms; a cycle (two commits) ≥ {floor_ms:.2} ms.\n",
        args.seconds,
        r.grants,
        r.errors,
        fsync_p50 / 1000.0,
        rtt / 1000.0
    );
    println!("| what | mean ms | count |\n|---|---:|---:|");
    println!(
        "| **one cycle, as the client sees it** (acquire + release) | **{cycle_ms:.3}** | {} |",
        r.grants
    );
    println!(
        "| acquire, as the client sees it (p50) | {:.3} | |",
        load::ms(r.acquire.value_at_quantile(0.5))
    );
    let (b, a) = (&before[leader], &after[leader]);
    let acquire = mean_ms(b, a, "raftlock_request_duration_seconds{op=\"acquire\"}");
    let release = mean_ms(b, a, "raftlock_request_duration_seconds{op=\"release\"}");
    row("acquire in the leader (driver queue to answer)", acquire);
    row("release in the leader (driver queue to answer)", release);
    row(
        "leader: batch proposed → on a majority's disks",
        mean_ms(b, a, "raftlock_commit_duration_seconds"),
    );
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        let role = if i == leader { "leader" } else { "follower" };
        row(
            &format!("node {} ({role}): one flush", i + 1),
            mean_ms(b, a, "raftlock_fsync_duration_seconds"),
        );
    }
    for series in a
        .keys()
        .filter(|k| k.starts_with("raftlock_peer_rtt_seconds{"))
    {
        row(
            &format!(
                "leader: heartbeat round trip {}",
                &series["raftlock_peer_rtt_seconds".len()..]
            ),
            mean_ms(b, a, series),
        );
    }
    if let (Some((acq, _)), Some((rel, _))) = (acquire, release) {
        println!(
            "| outside the leader's driver: cycle − acquire − release (WebSocket, JSON, both runtimes, network) | {:.3} | |",
            cycle_ms - acq - rel
        );
    }
    Ok(())
}
