//! `raftlock-bench compare`: an etcd cluster and a RaftLock cluster of the same size (three or
//! five nodes) on loopback, data on the same disk, fsync on; the same workloads against each in
//! alternation (A B A B) for several client counts; the disk's fsync latency and the loopback
//! round trip as the floor; results written as Markdown and JSON under `docs/bench/`.
//!
//! etcd runs at its best for this machine: the settings below, and its clients either spread
//! over all members (followers forward to the leader) or pinned to the leader, whichever a probe
//! run finds faster.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::load::{self, ms, LoadResult, LoadSpec, Target, Workload};
use crate::peers;

/// Where etcd's load clients connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EtcdClients {
    /// Every member (the etcd client balances; followers forward to the leader).
    Spread,
    /// The leader only.
    Leader,
    /// A probe run of each (32 uncontended clients) picks the faster.
    Best,
}

/// etcd's flags beyond the addresses: its defaults where they are its advice for a local
/// cluster (heartbeat 100 ms, election 1000 ms, snapshot count 100,000), the map freelist that
/// etcd recommends for performance (its default from 3.5 on), and warnings-only logging like
/// the RaftLock nodes get (`RUST_LOG=warn`).
pub const ETCD_TUNING: &[&str] = &[
    "--logger",
    "zap",
    "--log-level",
    "warn",
    "--experimental-backend-bbolt-freelist-type",
    "map",
];

pub struct CompareArgs {
    pub nodes: usize,
    pub etcd_clients: EtcdClients,
    pub clients: Vec<usize>,
    pub workloads: Vec<Workload>,
    pub seconds: u64,
    pub rounds: usize,
    pub dir: PathBuf,
    pub out: PathBuf,
    pub command_line: String,
    /// `sled` or `segments`: where the RaftLock nodes keep their Raft log.
    pub raft_log_engine: String,
    /// The systems measured beside RaftLock (etcd, zookeeper, redis-fsync, redis-default).
    pub peers: Vec<Target>,
}

/// Child processes killed when dropped, even on error.
pub struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `n` distinct ports of 127.0.0.1 that are free now. All `n` are held open until every one is
/// chosen: the kernel may hand a port it just gave out, and that was closed again, to the next
/// bind, and two nodes told to listen on one port leave a cluster without a quorum.
pub fn free_ports(n: usize) -> Result<Vec<u16>, String> {
    let held = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("no free port: {e}"))?;
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("no free port: {e}"))
}

fn start_etcd(dir: &Path, procs: &mut Procs, nodes: usize) -> Result<Vec<String>, String> {
    let ports = free_ports(2 * nodes)?;
    let (client_ports, peer_ports) = ports.split_at(nodes);
    let initial = (0..nodes)
        .map(|i| format!("e{i}=http://127.0.0.1:{}", peer_ports[i]))
        .collect::<Vec<_>>()
        .join(",");
    for i in 0..nodes {
        let log = std::fs::File::create(dir.join(format!("etcd-{i}.log")))
            .map_err(|e| format!("etcd log: {e}"))?;
        let child = Command::new("etcd")
            .args(["--name", &format!("e{i}")])
            .args([
                "--data-dir",
                &dir.join(format!("etcd-{i}")).display().to_string(),
            ])
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{}", client_ports[i]),
            ])
            .args([
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", client_ports[i]),
            ])
            .args([
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", peer_ports[i]),
            ])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", peer_ports[i]),
            ])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "raftlock-bench"])
            .args(ETCD_TUNING)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start etcd (apt-get install etcd-server): {e}"))?;
        procs.0.push(child);
    }
    Ok(client_ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect())
}

/// Starts a three-node RaftLock cluster with its data under `dir`, each node with `env` added
/// to its environment; returns the client addresses.
pub fn start_raftlock(
    dir: &Path,
    procs: &mut Procs,
    env: &[(&str, &str)],
) -> Result<Vec<String>, String> {
    start_raftlock_nodes(dir, procs, env, 3)
}

/// Like [`start_raftlock`], with `nodes` nodes.
pub fn start_raftlock_nodes(
    dir: &Path,
    procs: &mut Procs,
    env: &[(&str, &str)],
    nodes: usize,
) -> Result<Vec<String>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let node_bin = exe
        .parent()
        .map(|d| d.join("lock-node"))
        .ok_or("no binary directory")?;
    if !node_bin.exists() {
        return Err(format!(
            "{} not found: build it with `cargo build --release --bin lock-node`",
            node_bin.display()
        ));
    }
    let ports = free_ports(2 * nodes)?;
    let (peer, client) = ports.split_at(nodes);
    let initial = (0..nodes)
        .map(|i| format!("{}=127.0.0.1:{}", i + 1, peer[i]))
        .collect::<Vec<_>>()
        .join(",");
    for i in 0..nodes {
        let log = std::fs::File::create(dir.join(format!("raftlock-{}.log", i + 1)))
            .map_err(|e| format!("log: {e}"))?;
        let child = Command::new(&node_bin)
            .args(["--node-id", &(i + 1).to_string()])
            .args([
                "--data-dir",
                &dir.join(format!("raftlock-{}", i + 1))
                    .display()
                    .to_string(),
            ])
            .args(["--peer-listen", &format!("127.0.0.1:{}", peer[i])])
            .args(["--client-listen", &format!("127.0.0.1:{}", client[i])])
            .args(["--initial-cluster", &initial])
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start lock-node: {e}"))?;
        procs.0.push(child);
    }
    Ok(client.iter().map(|p| format!("127.0.0.1:{p}")).collect())
}

/// Waits until a short uncontended run succeeds against the target.
pub async fn wait_ready(target: Target, endpoints: &[String]) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline {
        let spec = LoadSpec {
            target,
            endpoints: endpoints.to_vec(),
            workload: Workload::Uncontended,
            clients: 1,
            duration: Duration::from_millis(300),
            run_id: "warmup".into(),
            timeline: false,
            acknowledge: false,
            connections: 0,
        };
        match load::run(&spec).await {
            Ok(r) if r.grants > 0 && r.errors == 0 => return Ok(()),
            Ok(r) => last = format!("{} grants, {} errors", r.grants, r.errors),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Err(format!("{target} did not become ready: {last}"))
}

/// Median of `n` write(100 bytes)+fdatasync calls on a file in `dir`, in microseconds.
pub fn fsync_floor(dir: &Path, n: usize) -> Result<(f64, f64), String> {
    let path = dir.join("fsync-probe");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| format!("fsync probe: {e}"))?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f.write_all(&[b'x'; 100]).map_err(|e| e.to_string())?;
        f.sync_data().map_err(|e| e.to_string())?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let _ = std::fs::remove_file(&path);
    samples.sort_by(f64::total_cmp);
    Ok((samples[n / 2], samples[n * 99 / 100]))
}

/// How often a thread that wants the CPU all the time does not get it, with and without
/// another thread writing and syncing a file meanwhile.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stalls {
    /// Share of the time (0..1) spent in stalls of at least [`STALL_MIN`].
    pub share: f64,
    pub count: usize,
    pub median_ms: f64,
    /// Share of the stalls that began in the busiest tenth of a 100 ms period (0.1 when they
    /// fall evenly): the period of CFS bandwidth control, which throttles a cgroup — or a
    /// virtual machine's host threads — that used up its CPU quota for the period.
    pub in_one_phase: f64,
}

/// A gap at least this long in a spinning thread's clock readings counts as a stall.
pub const STALL_MIN: Duration = Duration::from_millis(2);

/// Spins on one thread for `seconds` and records the gaps (stalls) between its clock readings;
/// with `sync`, another thread meanwhile appends 200 bytes to a file in `dir` and calls
/// `fdatasync`, over and over, as a node's log does. On a machine whose CPUs are its own the
/// two agree; on a throttled one (a container with a CPU limit, a VM whose host caps it) the
/// syncing run shows stalls of several milliseconds every 100 ms, which every latency measured
/// on that machine shares.
pub fn cpu_stalls(dir: &Path, seconds: f64, sync: bool) -> Result<Stalls, String> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let syncer = if sync {
        let path = dir.join("stall-probe");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| format!("stall probe: {e}"))?;
        let stop = stop.clone();
        Some(std::thread::spawn(move || {
            let mut written = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Bounded: the file is rewritten from the start every 4 MiB.
                if written >= 4 << 20 {
                    let _ = f.set_len(0);
                    written = 0;
                }
                if f.write_all(&[b'x'; 200]).is_err() || f.sync_data().is_err() {
                    break;
                }
                written += 200;
            }
            drop(f);
            let _ = std::fs::remove_file(&path);
        }))
    } else {
        None
    };
    let started = Instant::now();
    let end = started + Duration::from_secs_f64(seconds);
    let mut gaps: Vec<(Duration, Duration)> = Vec::new();
    let mut last = Instant::now();
    loop {
        let now = Instant::now();
        let gap = now - last;
        if gap >= STALL_MIN && gaps.len() < 100_000 {
            gaps.push((last - started, gap));
        }
        last = now;
        if now >= end {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = syncer {
        let _ = t.join();
    }
    Ok(summarize_stalls(&gaps, started.elapsed()))
}

/// [`Stalls`] from (start, length) of each stall over a run of `total`.
pub fn summarize_stalls(gaps: &[(Duration, Duration)], total: Duration) -> Stalls {
    if gaps.is_empty() {
        return Stalls::default();
    }
    let stalled: Duration = gaps.iter().map(|&(_, g)| g).sum();
    let mut lengths: Vec<f64> = gaps.iter().map(|&(_, g)| g.as_secs_f64() * 1e3).collect();
    lengths.sort_by(f64::total_cmp);
    let mut phases = [0usize; 10];
    for &(at, _) in gaps {
        phases[((at.as_micros() % 100_000) / 10_000) as usize] += 1;
    }
    Stalls {
        share: stalled.as_secs_f64() / total.as_secs_f64().max(1e-9),
        count: gaps.len(),
        median_ms: lengths[lengths.len() / 2],
        in_one_phase: *phases.iter().max().unwrap_or(&0) as f64 / gaps.len() as f64,
    }
}

impl Stalls {
    pub fn describe(&self) -> String {
        if self.count == 0 {
            return "none".into();
        }
        format!(
            "{:.1}% of the time ({} stalls, median {:.1} ms, {:.0}% of them in one tenth of a 100 ms period)",
            self.share * 100.0,
            self.count,
            self.median_ms,
            self.in_one_phase * 100.0
        )
    }

    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({
            "share": self.share, "count": self.count, "median_ms": self.median_ms,
            "in_one_phase": self.in_one_phase,
        })
    }

    pub fn from_json(v: &serde_json::Value) -> Option<Stalls> {
        Some(Stalls {
            share: v["share"].as_f64()?,
            count: v["count"].as_u64()? as usize,
            median_ms: v["median_ms"].as_f64()?,
            in_one_phase: v["in_one_phase"].as_f64()?,
        })
    }
}

/// Median TCP round trip of one byte over 127.0.0.1, in microseconds.
pub fn loopback_floor(n: usize) -> Result<f64, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = std::thread::spawn(move || {
        if let Ok((mut s, _)) = listener.accept() {
            let _ = s.set_nodelay(true);
            let mut b = [0u8; 1];
            while s.read_exact(&mut b).is_ok() {
                if s.write_all(&b).is_err() {
                    break;
                }
            }
        }
    });
    let mut c = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    c.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut samples = Vec::with_capacity(n);
    let mut b = [7u8; 1];
    for _ in 0..n {
        let t = Instant::now();
        c.write_all(&b).map_err(|e| e.to_string())?;
        c.read_exact(&mut b).map_err(|e| e.to_string())?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(c);
    let _ = server.join();
    samples.sort_by(f64::total_cmp);
    Ok(samples[n / 2])
}

pub fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024 / 1024);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpus} CPUs, {mem} GiB RAM, Linux {}", kernel.trim())
}

pub fn today() -> String {
    Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The version a running system reports (etcd: its binary's `--version`; ZooKeeper: a node's
/// `srvr` answer; Redis: `INFO server`).
async fn version_of(target: Target, endpoints: &[String]) -> String {
    let first = endpoints.first().map(String::as_str).unwrap_or("");
    let found = match target {
        Target::Raftlock => Ok(format!("RaftLock {}", env!("CARGO_PKG_VERSION"))),
        Target::Etcd => Ok(etcd_version()),
        Target::Zookeeper => peers::zookeeper_srvr(first)
            .await
            .and_then(|s| peers::zookeeper_version(&s).ok_or("no version in srvr".into())),
        Target::RedisFsync | Target::RedisDefault => peers::redis_version(first).await,
    };
    found.unwrap_or_else(|e| format!("{target} (version unknown: {e})"))
}

fn etcd_version() -> String {
    Command::new("etcd")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(|l| l.replace(" Version:", ""))
        })
        .unwrap_or_else(|| "etcd (version unknown)".into())
}

pub async fn compare(args: CompareArgs) -> Result<(), String> {
    std::fs::create_dir_all(&args.dir).map_err(|e| format!("{}: {e}", args.dir.display()))?;
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let (fsync_p50, fsync_p99) = fsync_floor(&args.dir, 300)?;
    let rtt = loopback_floor(2000)?;
    println!(
        "floor: fsync p50 {fsync_p50:.0} µs (p99 {fsync_p99:.0} µs), loopback RTT p50 {rtt:.0} µs"
    );
    let stalls_idle = cpu_stalls(&args.dir, 3.0, false)?;
    let stalls_sync = cpu_stalls(&args.dir, 3.0, true)?;
    println!(
        "CPU stalls >= 2 ms of a spinning thread: alone {}; while another thread syncs {}",
        stalls_idle.describe(),
        stalls_sync.describe()
    );
    let peers: Vec<Target> = args
        .peers
        .iter()
        .copied()
        .filter(|&t| t != Target::Raftlock)
        .fold(Vec::new(), |mut v, t| {
            if !v.contains(&t) {
                v.push(t);
            }
            v
        });
    let mut procs = Procs(Vec::new());
    // Every system is started before any is measured, so each run shares the machine with the
    // same idle processes.
    let mut endpoints: Vec<(Target, Vec<String>)> = Vec::new();
    let mut etcd_all = Vec::new();
    for &peer in &peers {
        let eps = match peer {
            Target::Etcd => {
                etcd_all = start_etcd(&args.dir, &mut procs, args.nodes)?;
                etcd_all.clone()
            }
            Target::Zookeeper => peers::start_zookeeper(&args.dir, &mut procs, args.nodes)?,
            Target::RedisFsync => vec![peers::start_redis(
                &args.dir,
                &mut procs,
                "redis-fsync",
                peers::RedisDurability::FsyncAlways,
            )?],
            Target::RedisDefault => vec![peers::start_redis(
                &args.dir,
                &mut procs,
                "redis-default",
                peers::RedisDurability::Default,
            )?],
            Target::Raftlock => continue,
        };
        endpoints.push((peer, eps));
    }
    let raftlock = start_raftlock_nodes(
        &args.dir,
        &mut procs,
        &[("RAFTLOCK_RAFT_LOG_ENGINE", &args.raft_log_engine)],
        args.nodes,
    )?;
    endpoints.insert(0, (Target::Raftlock, raftlock.clone()));
    for (target, eps) in &endpoints {
        wait_ready(*target, eps).await?;
    }
    println!("all ready: {endpoints:?}");
    let mut versions = serde_json::Map::new();
    for (target, eps) in &endpoints {
        versions.insert(target.to_string(), json!(version_of(*target, eps).await));
    }
    println!("versions: {versions:?}");
    let mut etcd_clients = json!(null);
    if peers.contains(&Target::Etcd) {
        let (etcd, chosen) = etcd_endpoints(&args, &etcd_all).await?;
        println!("etcd clients: {}", chosen["chosen"]);
        etcd_clients = chosen;
        if let Some(e) = endpoints.iter_mut().find(|(t, _)| *t == Target::Etcd) {
            e.1 = etcd;
        }
    }
    // The same warm-up for every system (the JVM's compiler above all): 8 uncontended clients
    // for as long as one measured run, not measured.
    for (target, eps) in &endpoints {
        let spec = LoadSpec {
            target: *target,
            endpoints: eps.clone(),
            workload: Workload::Uncontended,
            clients: 8,
            duration: Duration::from_secs(args.seconds),
            run_id: "warm".into(),
            timeline: false,
            acknowledge: *target == Target::Raftlock,
            connections: 0,
        };
        let r = load::run(&spec).await?;
        print!("warm-up ");
        load::print_result(&spec, &r);
    }
    let mut rows = Vec::new();
    let mut run = 0;
    for &workload in &args.workloads {
        for &clients in &args.clients {
            let mut results: Vec<(Target, LoadResult)> = Vec::new();
            let mut busy = 0.0;
            for round in 0..args.rounds {
                for (target, eps) in &endpoints {
                    let target = *target;
                    run += 1;
                    let busy_before = if target == Target::Raftlock {
                        busy_answers(&raftlock).await
                    } else {
                        0.0
                    };
                    let spec = LoadSpec {
                        target,
                        endpoints: eps.clone(),
                        workload,
                        clients,
                        duration: Duration::from_secs(args.seconds),
                        run_id: format!("r{run}"),
                        timeline: false,
                        // As the SDK does with its default client id: the cluster forgets each
                        // answer once the client has it, so the nodes run with the default
                        // bound on kept answers.
                        acknowledge: target == Target::Raftlock,
                        connections: 0,
                    };
                    let r = load::run(&spec).await?;
                    print!("round {} ", round + 1);
                    load::print_result(&spec, &r);
                    if target == Target::Raftlock {
                        let answered = busy_answers(&raftlock).await - busy_before;
                        if answered > 0.0 {
                            println!("  RaftLock answered {answered:.0} requests BUSY (retried)");
                        }
                        busy += answered;
                    }
                    match results.iter_mut().find(|(t, _)| *t == target) {
                        Some((_, acc)) => acc.merge(&r),
                        None => results.push((target, r)),
                    }
                }
            }
            for (target, r) in &results {
                let h = r.main_hist(workload);
                let mut row = json!({
                    "workload": workload.to_string(), "clients": clients,
                    "target": target.to_string(),
                    "throughput": r.throughput(), "grants": r.grants, "errors": r.errors,
                    "latency": if workload == Workload::Contended { "hand-off" } else { "acquire" },
                    "p50_ms": ms(h.value_at_quantile(0.5)),
                    "p99_ms": ms(h.value_at_quantile(0.99)),
                    "p999_ms": ms(h.value_at_quantile(0.999)),
                });
                if *target == Target::Raftlock {
                    row["busy_answers"] = json!(busy);
                }
                rows.push(row);
            }
        }
    }
    drop(procs);
    let report = json!({
        "date": today(), "machine": machine(),
        "etcd": versions.get("etcd").cloned().unwrap_or(json!(null)),
        "versions": versions,
        "peers": peers.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        "etcd_flags": ETCD_TUNING.join(" "), "etcd_clients": etcd_clients, "nodes": args.nodes,
        "zookeeper_settings": peers::ZOOKEEPER_SETTINGS.join(" "),
        "zookeeper_heap": peers::ZOOKEEPER_HEAP,
        "redis_backoff_ms": {
            "first": peers::REDIS_BACKOFF_FIRST.as_secs_f64() * 1e3,
            "max": peers::REDIS_BACKOFF_MAX.as_secs_f64() * 1e3,
        },
        "raft_log_engine": args.raft_log_engine,
        "command": args.command_line, "seconds_per_run": args.seconds, "rounds": args.rounds,
        "floor": {"fsync_p50_us": fsync_p50, "fsync_p99_us": fsync_p99, "loopback_rtt_p50_us": rtt,
                  "stalls_alone": stalls_idle.to_json(), "stalls_syncing": stalls_sync.to_json()},
        "rows": rows,
    });
    write_report(&args.out, "results", &report, &markdown(&report))
}

/// Requests the RaftLock nodes at `endpoints` have answered `BUSY` so far, summed over the nodes
/// (`raftlock_requests_total{result="BUSY"}`): paced by the exactly-once table, or refused by a
/// full queue. The SDK retries them after a back-off, so they show as latency, not as errors. A
/// node that does not answer counts 0.
async fn busy_answers(endpoints: &[String]) -> f64 {
    let mut total = 0.0;
    for addr in endpoints {
        let Ok((200, text)) =
            raftlock::client::http::request(addr, "GET", "/metrics", None, Duration::from_secs(5))
                .await
        else {
            continue;
        };
        total += text
            .lines()
            .filter(|l| l.starts_with("raftlock_requests_total{") && l.contains("result=\"BUSY\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    total
}

/// The etcd endpoints the load clients use, and what was decided and measured to pick them.
async fn etcd_endpoints(
    args: &CompareArgs,
    all: &[String],
) -> Result<(Vec<String>, serde_json::Value), String> {
    match args.etcd_clients {
        EtcdClients::Spread => Ok((all.to_vec(), json!({"chosen": "spread", "endpoints": all}))),
        EtcdClients::Leader => {
            let leader = vec![etcd_leader(all).await?];
            let v = json!({"chosen": "leader", "endpoints": leader});
            Ok((leader, v))
        }
        EtcdClients::Best => {
            let leader = vec![etcd_leader(all).await?];
            // The same probe for both: 32 uncontended clients, spread first, then pinned.
            let mut probe = serde_json::Map::new();
            let mut best: Option<(f64, &str, Vec<String>)> = None;
            for (name, endpoints) in [("spread", all.to_vec()), ("leader", leader)] {
                let spec = LoadSpec {
                    target: Target::Etcd,
                    endpoints: endpoints.clone(),
                    workload: Workload::Uncontended,
                    clients: 32,
                    duration: Duration::from_secs(args.seconds),
                    run_id: format!("probe-{name}"),
                    timeline: false,
                    acknowledge: false,
                    connections: 0,
                };
                let r = load::run(&spec).await?;
                print!("etcd probe, clients {name}: ");
                load::print_result(&spec, &r);
                probe.insert(name.into(), json!(r.throughput()));
                if best.as_ref().is_none_or(|(t, _, _)| r.throughput() > *t) {
                    best = Some((r.throughput(), name, endpoints));
                }
            }
            let (_, name, endpoints) = best.ok_or("no etcd probe ran")?;
            let v = json!({"chosen": name, "endpoints": endpoints, "probe_locks_per_s": probe});
            Ok((endpoints, v))
        }
    }
}

/// The client URL of etcd's current leader.
#[cfg(feature = "etcd")]
async fn etcd_leader(all: &[String]) -> Result<String, String> {
    for ep in all {
        let Ok(mut c) = etcd_client::Client::connect([ep.as_str()], None).await else {
            continue;
        };
        let Ok(status) = c.status().await else {
            continue;
        };
        let me = status.header().map(|h| h.member_id());
        if me == Some(status.leader()) {
            return Ok(ep.clone());
        }
    }
    Err("no etcd member says it is the leader".into())
}

#[cfg(not(feature = "etcd"))]
async fn etcd_leader(_all: &[String]) -> Result<String, String> {
    Err("this raftlock-bench was built without the `etcd` feature".into())
}

/// Writes `<stem>.json` and `<stem>.md` into `out` and prints the markdown.
pub fn write_report(
    out: &Path,
    stem: &str,
    report: &serde_json::Value,
    md: &str,
) -> Result<(), String> {
    let json_path = out.join(format!("{stem}.json"));
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(report).unwrap_or_default() + "\n",
    )
    .map_err(|e| format!("{}: {e}", json_path.display()))?;
    let md_path = out.join(format!("{stem}.md"));
    std::fs::write(&md_path, md).map_err(|e| format!("{}: {e}", md_path.display()))?;
    println!("{md}");
    println!("wrote {} and {}", md_path.display(), json_path.display());
    Ok(())
}

/// A ratio with two significant digits at least: 12×, 3.5×, 0.28×, 0.031×.
fn ratio(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.0}×")
    } else if x >= 1.0 {
        format!("{x:.1}×")
    } else if x >= 0.1 {
        format!("{x:.2}×")
    } else {
        format!("{x:.3}×")
    }
}

/// Writes `results.md` again from a `results.json` that `compare` wrote (the tables' layout
/// changed, the numbers did not).
pub fn render(json_path: &Path) -> Result<(), String> {
    let text =
        std::fs::read_to_string(json_path).map_err(|e| format!("{}: {e}", json_path.display()))?;
    let report: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", json_path.display()))?;
    let md_path = json_path.with_extension("md");
    std::fs::write(&md_path, markdown(&report))
        .map_err(|e| format!("{}: {e}", md_path.display()))?;
    println!("wrote {}", md_path.display());
    Ok(())
}

/// A peer's name as the tables show it.
fn peer_label(target: &str) -> &str {
    match target {
        "raftlock" => "RaftLock",
        "etcd" => "etcd",
        "zookeeper" => "ZooKeeper",
        "redis-fsync" => "Redis, appendfsync always",
        "redis-default" => "Redis, default (no fsync per write)",
        other => other,
    }
}

fn markdown(report: &serde_json::Value) -> String {
    let mut s = String::new();
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    let peers: Vec<String> = match report["peers"].as_array() {
        Some(p) => p
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        None => vec!["etcd".into()],
    };
    let has = |p: &str| peers.iter().any(|x| x == p);
    // The systems by name, Redis once for its two servers.
    let mut names: Vec<&str> = Vec::new();
    for p in &peers {
        let name = peer_label(p).split(',').next().unwrap_or(p);
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let names = match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.join(""),
    };
    let version = |t: &str| {
        report["versions"][t]
            .as_str()
            .or(if t == "etcd" {
                report["etcd"].as_str()
            } else {
                None
            })
            .unwrap_or("")
            // etcd's own words: "etcd Version: 3.4.23".
            .replace(" Version:", "")
    };
    let versions = std::iter::once("raftlock")
        .chain(peers.iter().map(String::as_str))
        .filter(|t| *t != "redis-default" || !has("redis-fsync"))
        .map(version)
        .filter(|v| !v.is_empty())
        .collect::<Vec<_>>()
        .join(", ");
    s.push_str(&format!(
        "# RaftLock vs {} — lock benchmark\n\n{} · {} · {}\n\nCommand: `{}` ({} s per run, {} rounds, each round running RaftLock and then each peer in turn; RaftLock, etcd and ZooKeeper {} nodes each on 127.0.0.1, Redis one server; all data on the same disk; all started by the benchmark and stopped after it).\n\n",
        names,
        report["date"].as_str().unwrap_or(""),
        report["machine"].as_str().unwrap_or(""),
        versions,
        report["command"].as_str().unwrap_or(""),
        report["seconds_per_run"],
        report["rounds"],
        report["nodes"].as_u64().unwrap_or(3),
    ));
    if has("etcd") {
        let ec = &report["etcd_clients"];
        let probe = match ec["probe_locks_per_s"].as_object() {
            Some(p) => format!(
                " A probe run (32 uncontended clients, {} s each) measured {:.0} locks/s with the clients spread over all members and {:.0} with them on the leader, so the runs below use the faster.",
                report["seconds_per_run"],
                f(&p["spread"]),
                f(&p["leader"])
            ),
            None => String::new(),
        };
        s.push_str(&format!(
            "**etcd** as a fair peer: its own advice for a local cluster (heartbeat 100 ms, election timeout 1000 ms, snapshot count 100,000: its defaults) plus `{}` (etcd's recommended freelist for performance, the default from 3.5 on, and warnings-only logging as the RaftLock nodes get); it fsyncs its WAL before answering. Each load client has its own connection and one lease, and uses etcd's lock API (`Lock`/`Unlock`: a key under the lock's prefix, wait for the keys before it to go). Its clients connect to: **{}**.{probe}\n\n",
            report["etcd_flags"].as_str().unwrap_or(""),
            ec["chosen"].as_str().unwrap_or("all members"),
        ));
    }
    if has("zookeeper") {
        s.push_str(&format!(
            "**ZooKeeper**: Debian's package, each node a JVM (`QuorumPeerMain` from Debian's jar, heap fixed at {}) with its own zoo.cfg, data and transaction log directories: `{}` — ZooKeeper's defaults for timing and the log, so every transaction log write is fsynced (`forceSync=yes`) before a write is acknowledged, no limit on connections from one address (the default 60 would refuse most of 512 clients on 127.0.0.1), no admin HTTP server; logging off (Debian's classpath has no SLF4J binding). Each load client is one session (timeout 30 s) whose connect string names all three nodes (ZooKeeper's client picks one; followers forward writes to the leader), and takes the lock with the recipe of ZooKeeper's documentation as Curator's `InterProcessMutex` does it, over the `zookeeper-client` crate: an ephemeral sequential node `_c_<id>-lock-<seq>` under the lock's path, the lowest sequence holds, each other client watches the node just before its own; release deletes the node. A cycle is two writes (create, delete) and a read (the children).\n\n",
            report["zookeeper_heap"].as_str().unwrap_or(""),
            report["zookeeper_settings"].as_str().unwrap_or(""),
        ));
    }
    if has("redis-fsync") || has("redis-default") {
        let b = &report["redis_backoff_ms"];
        s.push_str(&format!(
            "**Redis**, the fast unsafe reference: one server, no replica, so a crash or a failover can hand one lock to two holders, and a holder that pauses past the TTL loses its lock without knowing. `SET key token NX PX 30000` takes the lock; a Lua script (`EVAL`) deletes the key only if it still holds the client's token. Redis has no wait queue: a client that finds the key taken sleeps and tries again, first for {:.0}–{:.0} ms, the step doubling after each failed try up to {:.0}–{:.0} ms (each sleep drawn at random from [step, 2 × step)). Two servers: *Redis, appendfsync always* (`appendonly yes`, `appendfsync always`: each write is in the AOF and fsynced before the answer) and *Redis, default* (Redis's default persistence: no AOF, RDB snapshots now and then; a crash loses the last writes). Each load client has its own connection.\n\n",
            f(&b["first"]),
            2.0 * f(&b["first"]),
            f(&b["max"]),
            2.0 * f(&b["max"]),
        ));
    }
    s.push_str(&format!(
        "RaftLock's clients use the SDK, which finds the leader and talks to it, and acknowledge the answers they have received (`ackBelow`, as the SDK does with its default client id), so the cluster forgets each answer once its client has it. RaftLock's nodes run with `--raft-log-engine {}` and otherwise their defaults, the bound on kept answers (`--max-answers`) included (any request the leader paced, answered `BUSY`, is counted below the table). Every system gets the same unmeasured warm-up first (8 uncontended clients for one run's length).\n\n",
        report["raft_log_engine"].as_str().unwrap_or("sled"),
    ));
    let fl = &report["floor"];
    let fsync = f(&fl["fsync_p50_us"]);
    let rtt = f(&fl["loopback_rtt_p50_us"]);
    s.push_str(&format!(
        "Floor: fsync p50 {:.2} ms (p99 {:.2} ms), loopback round trip p50 {:.3} ms. One lock cycle (acquire + release) needs two commits, each at least one fsync and one round trip: {:.2} ms.\n\n",
        fsync / 1000.0,
        f(&fl["fsync_p99_us"]) / 1000.0,
        rtt / 1000.0,
        2.0 * (fsync + rtt) / 1000.0
    ));
    if let (Some(alone), Some(syncing)) = (
        Stalls::from_json(&fl["stalls_alone"]),
        Stalls::from_json(&fl["stalls_syncing"]),
    ) {
        s.push_str(&format!(
            "The machine's own stalls: a thread that spins for 3 s is kept off the CPU for 2 ms or more {} when alone, and {} while another thread writes and syncs a file. Stalls that recur every 100 ms while the disk is busy are the host throttling this VM (CFS bandwidth control has a 100 ms period); every system measured here shares them, and they, not the systems, set much of the p99 at higher loads.\n\n",
            alone.describe(),
            syncing.describe()
        ));
    }
    let rows = report["rows"].as_array().cloned().unwrap_or_default();
    let find = |workload: &str, clients: u64, target: &str| {
        rows.iter().find(|r| {
            r["workload"] == workload
                && r["clients"].as_u64() == Some(clients)
                && r["target"] == target
        })
    };
    // RaftLock ÷ peer: throughput (higher is better) and p99 (lower is better).
    let ratios = |r: &serde_json::Value, p: &serde_json::Value| {
        if f(&p["throughput"]) <= 0.0 || f(&r["throughput"]) <= 0.0 {
            return ("—".to_string(), "—".to_string());
        }
        (
            ratio(f(&r["throughput"]) / f(&p["throughput"])),
            ratio(f(&r["p99_ms"]) / f(&p["p99_ms"]).max(1e-9)),
        )
    };
    // The side-by-side summary: RaftLock against each peer at 1, 32 and 128 clients.
    let summary_clients: Vec<u64> = [1u64, 32, 128]
        .into_iter()
        .filter(|&c| rows.iter().any(|r| r["clients"].as_u64() == Some(c)))
        .collect();
    if !summary_clients.is_empty() && !peers.is_empty() {
        s.push_str("## RaftLock against each peer\n\nRaftLock's locks/s ÷ the peer's (higher: RaftLock ahead), and RaftLock's p99 ÷ the peer's (lower: RaftLock ahead), from the rows below.\n\n| workload | clients |");
        for p in &peers {
            s.push_str(&format!(" vs {} |", peer_label(p)));
        }
        s.push_str("\n|---|---:|");
        for _ in &peers {
            s.push_str("---:|");
        }
        s.push('\n');
        for workload in ["uncontended", "contended"] {
            for &c in &summary_clients {
                let Some(r) = find(workload, c, "raftlock") else {
                    continue;
                };
                s.push_str(&format!("| {workload} | {c} |"));
                for p in &peers {
                    match find(workload, c, p) {
                        Some(pr) => {
                            let (t, l) = ratios(r, pr);
                            s.push_str(&format!(" {t} locks/s, p99 {l} |"));
                        }
                        None => s.push_str(" |"),
                    }
                }
                s.push('\n');
            }
        }
        s.push('\n');
    }
    s.push_str("## All runs\n\nLatency is acquire sent → grant received, except *contended*, where it is the hand-off: release sent by one holder → grant received by the next.\n\n");
    s.push_str("| workload | clients | target | locks/s | p50 ms | p99 ms | p99.9 ms | errors | RaftLock ÷ this, locks/s | RaftLock ÷ this, p99 |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in &rows {
        let target = r["target"].as_str().unwrap_or("");
        let (tr, pr) = match (target, r["clients"].as_u64()) {
            ("raftlock", _) | (_, None) => (String::new(), String::new()),
            (_, Some(c)) => match find(r["workload"].as_str().unwrap_or(""), c, "raftlock") {
                Some(own) => ratios(own, r),
                None => (String::new(), String::new()),
            },
        };
        s.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} | {} |\n",
            r["workload"].as_str().unwrap_or(""),
            r["clients"],
            peer_label(target),
            f(&r["throughput"]),
            f(&r["p50_ms"]),
            f(&r["p99_ms"]),
            f(&r["p999_ms"]),
            r["errors"].as_u64().unwrap_or(0),
            tr,
            pr
        ));
    }
    s.push_str(
        "\nRatios are RaftLock's figure divided by the row's (throughput: above 1× RaftLock is ahead; p99: below 1× RaftLock is ahead); — where one of the two granted no lock in the run. *errors* counts failed calls and clients still waiting when the run's grace period ended.\n",
    );
    let busy: Vec<String> = rows
        .iter()
        .filter(|r| r["busy_answers"].as_f64().unwrap_or(0.0) > 0.0)
        .map(|r| {
            format!(
                "{} {} clients: {:.0}",
                r["workload"].as_str().unwrap_or(""),
                r["clients"],
                f(&r["busy_answers"])
            )
        })
        .collect();
    if rows.iter().any(|r| r.get("busy_answers").is_some()) {
        s.push_str(&if busy.is_empty() {
            "\nNo RaftLock request was answered `BUSY` in these runs (`raftlock_requests_total{result=\"BUSY\"}` summed over the nodes before and after each run).\n".to_string()
        } else {
            format!(
                "\nRequests the RaftLock nodes answered `BUSY` (`raftlock_requests_total{{result=\"BUSY\"}}` summed over the nodes before and after each run; paced by the exactly-once table or refused by a full queue; the SDK retries them after a back-off, so they show as latency, not as errors): {}.\n",
                busy.join("; ")
            )
        });
    }
    s.push_str(&goals(&rows, 2.0 * (fsync + rtt) / 1000.0));
    s
}

/// The performance goals, judged from this run's rows: at 32 clients, uncontended and
/// contended, at least 10× etcd's throughput and at most ⅕ of its p99; one client's
/// uncontended cycle (acquire + release, one after the other) within 2× the floor.
fn goals(rows: &[serde_json::Value], floor_ms: f64) -> String {
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    let find = |workload: &str, clients: u64, target: &str| {
        rows.iter().find(|r| {
            r["workload"] == workload
                && r["clients"].as_u64() == Some(clients)
                && r["target"] == target
        })
    };
    let verdict = |met: bool| if met { "met" } else { "not met" };
    let mut s = String::from("\n## Goals\n\n| goal | measured | verdict |\n|---|---:|---|\n");
    for workload in ["uncontended", "contended"] {
        if let (Some(r), Some(e)) = (find(workload, 32, "raftlock"), find(workload, 32, "etcd")) {
            let tr = f(&r["throughput"]) / f(&e["throughput"]).max(1e-9);
            let pr = f(&r["p99_ms"]) / f(&e["p99_ms"]).max(1e-9);
            s.push_str(&format!(
                "| {workload}, 32 clients: throughput ≥ 10× etcd | {tr:.1}× | {} |\n",
                verdict(tr >= 10.0)
            ));
            s.push_str(&format!(
                "| {workload}, 32 clients: p99 ≤ ⅕ of etcd's | {pr:.2}× | {} |\n",
                verdict(pr <= 0.2)
            ));
        }
    }
    for workload in ["uncontended", "contended"] {
        if let (Some(r), Some(z)) = (
            find(workload, 32, "raftlock"),
            find(workload, 32, "zookeeper"),
        ) {
            let tr = f(&r["throughput"]) / f(&z["throughput"]).max(1e-9);
            s.push_str(&format!(
                "| {workload}, 32 clients: throughput ahead of ZooKeeper | {tr:.1}× | {} |\n",
                verdict(tr > 1.0)
            ));
        }
    }
    if let Some(r) = find("uncontended", 1, "raftlock") {
        let cycle_ms = 1000.0 / f(&r["throughput"]).max(1e-9);
        s.push_str(&format!(
            "| one client: a cycle ≤ 2× the floor ({:.2} ms) | {cycle_ms:.2} ms ({:.1}× the floor) | {} |\n",
            2.0 * floor_ms,
            cycle_ms / floor_ms.max(1e-9),
            verdict(cycle_ms <= 2.0 * floor_ms)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// A cluster's ports are distinct: picked one at a time, bind-and-close, Linux handed the
    /// same port out twice in a row (two nodes on one peer port, a cluster without a quorum,
    /// and a `raftlock-bench scale` run that waited ten minutes for a node that never started).
    #[test]
    fn ports_for_a_cluster_are_distinct() {
        for _ in 0..50 {
            let mut ports = free_ports(10).expect("ports");
            ports.sort_unstable();
            ports.dedup();
            assert_eq!(ports.len(), 10, "{ports:?}");
        }
    }

    #[test]
    fn stalls_every_100_ms_fall_in_one_phase() {
        // 10 stalls of 15 ms, each 100 ms apart, in a run of 1 s.
        let gaps: Vec<_> = (0..10).map(|i| (ms(i * 100 + 42), ms(15))).collect();
        let s = summarize_stalls(&gaps, Duration::from_secs(1));
        assert_eq!(s.count, 10);
        assert!((s.share - 0.15).abs() < 1e-9, "{s:?}");
        assert!((s.median_ms - 15.0).abs() < 1e-9, "{s:?}");
        assert!((s.in_one_phase - 1.0).abs() < 1e-9, "{s:?}");
    }

    #[test]
    fn stalls_spread_over_the_period_do_not() {
        // One stall in each tenth of the 100 ms period.
        let gaps: Vec<_> = (0..10).map(|i| (ms(i * 110 + 3), ms(2 + i))).collect();
        let s = summarize_stalls(&gaps, Duration::from_secs(2));
        assert!((s.in_one_phase - 0.1).abs() < 1e-9, "{s:?}");
        assert!((s.median_ms - 7.0).abs() < 1e-9, "{s:?}");
        assert_eq!(
            summarize_stalls(&[], Duration::from_secs(1)),
            Stalls::default()
        );
        assert_eq!(Stalls::from_json(&s.to_json()), Some(s));
    }
}
