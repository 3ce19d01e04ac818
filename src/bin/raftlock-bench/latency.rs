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

use raftlock::storage::bench::stat_ticks;

use super::compare::{fsync_floor, loopback_floor, start_raftlock, wait_ready, Procs};
use super::load::{self, LoadSpec, Target, Workload};

pub struct LatencyArgs {
    pub seconds: u64,
    pub dir: PathBuf,
    /// Concurrent uncontended clients (1: one client's cycle).
    pub clients: usize,
    /// `sled` or `segments`: where the nodes keep their Raft log.
    pub raft_log_engine: String,
}

/// CPU time in clock ticks (user, kernel) of a process, by thread group: threads named alike
/// (`sled-io-0`, `sled-io-1`, …) are one group, and what threads that have already ended used
/// is the group `ended threads` (the process's totals include them, its live threads do not).
fn thread_cpu(pid: u32) -> BTreeMap<String, (u64, u64)> {
    let Some(total) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| stat_ticks(&s))
    else {
        return BTreeMap::new();
    };
    let mut groups = by_thread_group(pid, |dir| {
        stat_ticks(&std::fs::read_to_string(dir.join("stat")).ok()?)
    });
    let live = groups
        .values()
        .fold((0, 0), |acc, v| (acc.0 + v.0, acc.1 + v.1));
    groups.insert(
        "ended threads".into(),
        (
            total.0.saturating_sub(live.0),
            total.1.saturating_sub(live.1),
        ),
    );
    groups
}

/// A pair of counters read from each live thread of `pid` (by `read`, given the thread's
/// `/proc` directory), summed by thread group.
fn by_thread_group(
    pid: u32,
    read: impl Fn(&std::path::Path) -> Option<(u64, u64)>,
) -> BTreeMap<String, (u64, u64)> {
    let mut groups: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            let dir = task.path();
            let Some(counts) = read(&dir) else {
                continue;
            };
            let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let g = groups.entry(thread_group(&name)).or_default();
            g.0 += counts.0;
            g.1 += counts.1;
        }
    }
    groups
}

/// Context switches (voluntary: the thread waited for something; involuntary: it was
/// preempted) of a process's live threads, by thread group. Linux keeps these per thread only,
/// so what ended threads did is not counted.
fn thread_switches(pid: u32) -> BTreeMap<String, (u64, u64)> {
    by_thread_group(pid, |dir| {
        switch_counts(&std::fs::read_to_string(dir.join("status")).ok()?)
    })
}

/// (voluntary, involuntary) context switches from a `/proc/…/status` text.
fn switch_counts(status: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim_start_matches(':').trim().parse::<u64>().ok())
    };
    Some((
        field("voluntary_ctxt_switches")?,
        field("nonvoluntary_ctxt_switches")?,
    ))
}

/// A thread's group: its name without a trailing number (`sled-io-3` → `sled-io`).
fn thread_group(name: &str) -> String {
    name.trim()
        .trim_end_matches(|c: char| c.is_ascii_digit())
        .trim_end_matches('-')
        .to_string()
}

/// What each thread group of lock-node does, for the report.
fn thread_group_label(group: &str) -> String {
    match group {
        "raftlock-driver" => {
            "driver thread: Raft, apply, peer port, storage calls, flush waits".into()
        }
        "tokio-rt-worker" => {
            "I/O runtime: client connections, heartbeats and votes to peers".into()
        }
        "sled-io" => "sled's I/O pool: its log writes and syncs".into(),
        "raftlock-flush" => "flush thread: sled's flush, fdatasync (background flushes)".into(),
        "lock-node" => "main thread".into(),
        "log flusher" => "sled's periodic flusher".into(),
        // Linux keeps 15 bytes of a thread's name: `raftlock-log-trim` reads back like this.
        "raftlock-log-tr" => "log trimmer: deletes log runs behind the snapshot point".into(),
        "ended threads" => "threads that ended during the run".into(),
        other => other.to_string(),
    }
}

fn cpu_delta(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
) -> BTreeMap<String, (u64, u64)> {
    after
        .iter()
        .map(|(k, &(u, s))| {
            let (u0, s0) = before.get(k).copied().unwrap_or((0, 0));
            (k.clone(), (u.saturating_sub(u0), s.saturating_sub(s0)))
        })
        .collect()
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
    let endpoints = start_raftlock(
        &args.dir,
        &mut procs,
        &[("RAFTLOCK_RAFT_LOG_ENGINE", &args.raft_log_engine)],
    )?;
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
    let pids: Vec<u32> = procs.0.iter().map(|c| c.id()).collect();
    let before = scrape(&endpoints).await?;
    let cpu_before: Vec<_> = pids.iter().map(|&p| thread_cpu(p)).collect();
    let switches_before: Vec<_> = pids.iter().map(|&p| thread_switches(p)).collect();
    let self_before = thread_cpu(std::process::id());
    let spec = LoadSpec {
        target: Target::Raftlock,
        endpoints: vec![leader_endpoint],
        workload: Workload::Uncontended,
        clients: args.clients.max(1),
        duration: Duration::from_secs(args.seconds),
        run_id: "latency".into(),
        timeline: false,
        acknowledge: false,
        connections: 0,
    };
    let r = load::run(&spec).await?;
    let cpu: Vec<_> = pids
        .iter()
        .zip(&cpu_before)
        .map(|(&p, b)| cpu_delta(b, &thread_cpu(p)))
        .collect();
    let switches: Vec<_> = pids
        .iter()
        .zip(&switches_before)
        .map(|(&p, b)| cpu_delta(b, &thread_switches(p)))
        .collect();
    let client_cpu = cpu_delta(&self_before, &thread_cpu(std::process::id()));
    let after = scrape(&endpoints).await?;
    drop(procs);
    if r.grants == 0 {
        return Err("no lock was granted".into());
    }
    // Each client runs its cycles one after the other for the whole run: one client's cycle
    // takes clients × seconds / cycles.
    let cycle_ms = r.seconds * 1000.0 * spec.clients as f64 / r.grants as f64;
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
    let who = match args.clients.max(1) {
        1 => "One client".to_string(),
        n => format!("{n} clients"),
    };
    println!(
        "{who}, uncontended, {} s, Raft log in {}: {} cycles, errors {}. Floor: fsync p50 {:.3} ms, loopback RTT p50 {:.3} ms; a cycle (two commits) ≥ {floor_ms:.2} ms.\n",
        args.seconds,
        args.raft_log_engine,
        r.grants,
        r.errors,
        fsync_p50 / 1000.0,
        rtt / 1000.0
    );
    println!("| what | mean ms | count |\n|---|---:|---:|");
    println!(
        "| **one cycle, as a client sees it** (acquire + release) | **{cycle_ms:.3}** | {} |",
        r.grants
    );
    println!(
        "| acquire, as the client sees it (p50) | {:.3} | |",
        load::ms(r.acquire.value_at_quantile(0.5))
    );
    let (b, a) = (&before[leader], &after[leader]);
    let acquire = mean_ms(b, a, "raftlock_request_duration_seconds{op=\"acquire\"}");
    let release = mean_ms(b, a, "raftlock_request_duration_seconds{op=\"release\"}");
    let ws_acquire = mean_ms(
        b,
        a,
        "raftlock_websocket_request_duration_seconds{op=\"acquire\"}",
    );
    let ws_release = mean_ms(
        b,
        a,
        "raftlock_websocket_request_duration_seconds{op=\"release\"}",
    );
    row(
        "acquire at the leader's WebSocket (frame read to answer written)",
        ws_acquire,
    );
    row("acquire in the leader (driver queue to answer)", acquire);
    row(
        "release at the leader's WebSocket (frame read to answer written)",
        ws_release,
    );
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
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        let role = if i == leader { "leader" } else { "follower" };
        row(
            &format!(
                "node {} ({role}): one applied-state write (driver thread)",
                i + 1
            ),
            mean_ms(b, a, "raftlock_state_write_duration_seconds"),
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
    if let (Some((acq, _)), Some((rel, _)), Some((ws_acq, _)), Some((ws_rel, _))) =
        (acquire, release, ws_acquire, ws_release)
    {
        println!(
            "| the leader's connection side: its WebSocket time − its driver time, both requests (parsing, tasks, the I/O runtime's wake-ups, writing the answer) | {:.3} | |",
            ws_acq + ws_rel - acq - rel
        );
        println!(
            "| outside the leader: cycle − its WebSocket time, both requests (the client's runtime, JSON and frames, loopback, the leader's read wake-up) | {:.3} | |",
            cycle_ms - ws_acq - ws_rel
        );
    }
    print_cpu_table(&cpu, leader, &client_cpu, r.grants);
    print_switch_table(&switches, leader, r.grants);
    Ok(())
}

/// Context switches per cycle by thread group: the leader and the mean of the followers. Each
/// one is a thread going to sleep and being woken (voluntary) or being preempted (involuntary);
/// on a machine with fewer CPUs than busy threads, both cost CPU time and wait in the run queue.
fn print_switch_table(nodes: &[BTreeMap<String, (u64, u64)>], leader: usize, cycles: u64) {
    println!(
        "\nContext switches per cycle, by thread group (from /proc; live threads only; voluntary: the thread waited and was woken, involuntary: it was preempted):\n"
    );
    let per = |n: u64| n as f64 / cycles.max(1) as f64;
    print_group_table(nodes, leader, ["voluntary", "involuntary"], per, 1, 0.05);
}

/// CPU time per cycle (µs), user and kernel, by thread group: the leader, the mean of the
/// followers, and this process (the load generator: SDK clients and their runtime). Unlike the
/// instruction budget (callgrind counts user-space instructions only), this includes the
/// kernel's share: system calls, waking and switching threads.
fn print_cpu_table(
    nodes: &[BTreeMap<String, (u64, u64)>],
    leader: usize,
    client: &BTreeMap<String, (u64, u64)>,
    cycles: u64,
) {
    // /proc counts in USER_HZ ticks, 100 per second on Linux.
    let us = |ticks: u64| ticks as f64 * 10_000.0 / cycles.max(1) as f64;
    println!(
        "\nCPU time per cycle in µs, user + kernel, by thread group (from /proc; 10 ms resolution per thread group over the whole run):\n"
    );
    print_group_table(nodes, leader, ["user", "kernel"], us, 0, 0.5);
    let (cu, cs) = client
        .values()
        .fold((0, 0), |acc, v| (acc.0 + v.0, acc.1 + v.1));
    println!(
        "\nThe load generator (this process: the SDK clients, their runtime): user {:.0} µs, kernel {:.0} µs per cycle.",
        us(cu),
        us(cs)
    );
}

/// A table of a pair of per-thread-group counters, each scaled by `scale`: the leader's and
/// the mean of the followers', one row per group (groups whose four values are all below
/// `min` left out) and a total, with `decimals` places.
fn print_group_table(
    nodes: &[BTreeMap<String, (u64, u64)>],
    leader: usize,
    [a, b]: [&str; 2],
    scale: impl Fn(u64) -> f64,
    decimals: usize,
    min: f64,
) {
    let followers: Vec<&BTreeMap<String, (u64, u64)>> = nodes
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != leader)
        .map(|(_, m)| m)
        .collect();
    let mut groups: Vec<&String> = nodes.iter().flat_map(|m| m.keys()).collect();
    groups.sort();
    groups.dedup();
    println!("| thread group | leader {a} | leader {b} | follower {a} | follower {b} |");
    println!("|---|---:|---:|---:|---:|");
    let mut totals = [0.0f64; 4];
    for g in groups {
        let (la, lb) = nodes
            .get(leader)
            .and_then(|m| m.get(g))
            .copied()
            .unwrap_or((0, 0));
        let n = followers.len().max(1) as f64;
        let (fa, fb) = followers
            .iter()
            .filter_map(|m| m.get(g))
            .fold((0.0, 0.0), |(x, y), v| {
                (x + scale(v.0) / n, y + scale(v.1) / n)
            });
        let row = [scale(la), scale(lb), fa, fb];
        if row.iter().all(|&v| v < min) {
            continue;
        }
        for (t, v) in totals.iter_mut().zip(row) {
            *t += v;
        }
        println!(
            "| {} | {:.d$} | {:.d$} | {:.d$} | {:.d$} |",
            thread_group_label(g),
            row[0],
            row[1],
            row[2],
            row[3],
            d = decimals
        );
    }
    println!(
        "| **total** | **{:.d$}** | **{:.d$}** | **{:.d$}** | **{:.d$}** |",
        totals[0],
        totals[1],
        totals[2],
        totals[3],
        d = decimals
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_with_odd_names_parse() {
        let line = "4242 (tokio (rt) 1) S 1 4242 4242 0 -1 4194624 900 0 0 0 123 45 0 0 20 0 3 0";
        assert_eq!(stat_ticks(line), Some((123, 45)));
        assert_eq!(stat_ticks("4242 (short) S 1 2"), None);
        assert_eq!(stat_ticks("no parenthesis"), None);
    }

    #[test]
    fn switch_counts_come_from_the_status_text() {
        let status = "Name:\tsled-io-3\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t5123\nnonvoluntary_ctxt_switches:\t17\n";
        assert_eq!(switch_counts(status), Some((5123, 17)));
        assert_eq!(
            switch_counts("Name:\tx\nvoluntary_ctxt_switches:\t1\n"),
            None
        );
        // The real file of this thread parses.
        let own = std::fs::read_to_string("/proc/thread-self/status").expect("status");
        assert!(switch_counts(&own).is_some());
    }

    #[test]
    fn numbered_threads_share_a_group() {
        assert_eq!(thread_group("sled-io-12\n"), "sled-io");
        assert_eq!(thread_group("raftlock-driver"), "raftlock-driver");
        assert_eq!(thread_group("tokio-rt-worker"), "tokio-rt-worker");
    }

    #[test]
    fn the_log_trimmer_is_named_by_its_truncated_thread_name() {
        let group = thread_group("raftlock-log-tr\n");
        assert!(thread_group_label(&group).starts_with("log trimmer"));
    }

    #[test]
    fn deltas_subtract_per_group() {
        let before = BTreeMap::from([("a".to_string(), (5, 1))]);
        let after = BTreeMap::from([("a".to_string(), (9, 4)), ("b".to_string(), (2, 2))]);
        let d = cpu_delta(&before, &after);
        assert_eq!(d["a"], (4, 3));
        assert_eq!(d["b"], (2, 2));
    }
}
