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

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

fn start_etcd(dir: &Path, procs: &mut Procs, nodes: usize) -> Result<Vec<String>, String> {
    let mut client_ports = Vec::new();
    let mut peer_ports = Vec::new();
    for _ in 0..nodes {
        client_ports.push(free_port()?);
        peer_ports.push(free_port()?);
    }
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
    let mut peer = Vec::new();
    let mut client = Vec::new();
    for _ in 0..nodes {
        peer.push(free_port()?);
        client.push(free_port()?);
    }
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

fn etcd_version() -> String {
    Command::new("etcd")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_string)
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
    let mut procs = Procs(Vec::new());
    let etcd_all = start_etcd(&args.dir, &mut procs, args.nodes)?;
    let raftlock = start_raftlock_nodes(&args.dir, &mut procs, &[], args.nodes)?;
    wait_ready(Target::Etcd, &etcd_all).await?;
    wait_ready(Target::Raftlock, &raftlock).await?;
    println!("both clusters ready: etcd {etcd_all:?}, raftlock {raftlock:?}");
    let (etcd, etcd_clients) = etcd_endpoints(&args, &etcd_all).await?;
    println!("etcd clients: {}", etcd_clients["chosen"]);
    let mut rows = Vec::new();
    let mut run = 0;
    for &workload in &args.workloads {
        for &clients in &args.clients {
            let mut results: Vec<(Target, LoadResult)> = Vec::new();
            for round in 0..args.rounds {
                for target in [Target::Raftlock, Target::Etcd] {
                    run += 1;
                    let spec = LoadSpec {
                        target,
                        endpoints: if target == Target::Etcd {
                            etcd.clone()
                        } else {
                            raftlock.clone()
                        },
                        workload,
                        clients,
                        duration: Duration::from_secs(args.seconds),
                        run_id: format!("r{run}"),
                        timeline: false,
                    };
                    let r = load::run(&spec).await?;
                    print!("round {} ", round + 1);
                    load::print_result(&spec, &r);
                    match results.iter_mut().find(|(t, _)| *t == target) {
                        Some((_, acc)) => acc.merge(&r),
                        None => results.push((target, r)),
                    }
                }
            }
            for (target, r) in &results {
                let h = r.main_hist(workload);
                rows.push(json!({
                    "workload": workload.to_string(), "clients": clients,
                    "target": target.to_string(),
                    "throughput": r.throughput(), "grants": r.grants, "errors": r.errors,
                    "latency": if workload == Workload::Contended { "hand-off" } else { "acquire" },
                    "p50_ms": ms(h.value_at_quantile(0.5)),
                    "p99_ms": ms(h.value_at_quantile(0.99)),
                    "p999_ms": ms(h.value_at_quantile(0.999)),
                }));
            }
        }
    }
    drop(procs);
    let report = json!({
        "date": today(), "machine": machine(), "etcd": etcd_version(),
        "etcd_flags": ETCD_TUNING.join(" "), "etcd_clients": etcd_clients, "nodes": args.nodes,
        "command": args.command_line, "seconds_per_run": args.seconds, "rounds": args.rounds,
        "floor": {"fsync_p50_us": fsync_p50, "fsync_p99_us": fsync_p99, "loopback_rtt_p50_us": rtt},
        "rows": rows,
    });
    write_report(&args.out, "results", &report, &markdown(&report))
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

fn markdown(report: &serde_json::Value) -> String {
    let mut s = String::new();
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    s.push_str(&format!(
        "# RaftLock vs etcd — lock benchmark\n\n{} · {} · {}\n\nCommand: `{}` ({} s per run, {} rounds alternating RaftLock and etcd; both clusters {} nodes on 127.0.0.1, data on the same disk, fsync on).\n\n",
        report["date"].as_str().unwrap_or(""),
        report["machine"].as_str().unwrap_or(""),
        report["etcd"].as_str().unwrap_or(""),
        report["command"].as_str().unwrap_or(""),
        report["seconds_per_run"],
        report["rounds"],
        report["nodes"].as_u64().unwrap_or(3),
    ));
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
        "etcd as a fair peer: its own advice for a local cluster (heartbeat 100 ms, election timeout 1000 ms, snapshot count 100,000: its defaults) plus `{}` (etcd's recommended freelist for performance, the default from 3.5 on, and warnings-only logging as the RaftLock nodes get). Each load client has its own connection and one lease. Its clients connect to: **{}**.{probe} RaftLock's clients use the SDK, which finds the leader and talks to it.\n\n",
        report["etcd_flags"].as_str().unwrap_or(""),
        ec["chosen"].as_str().unwrap_or("all members"),
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
    s.push_str("Latency is acquire sent → grant received, except *contended*, where it is the hand-off: release sent by one holder → grant received by the next.\n\n");
    s.push_str("| workload | clients | target | locks/s | p50 ms | p99 ms | p99.9 ms | throughput ratio | p99 ratio |\n|---|---:|---|---:|---:|---:|---:|---:|---:|\n");
    let rows = report["rows"].as_array().cloned().unwrap_or_default();
    for r in &rows {
        let peer = rows.iter().find(|o| {
            o["workload"] == r["workload"]
                && o["clients"] == r["clients"]
                && o["target"] != r["target"]
        });
        let (tr, pr) = match (r["target"].as_str(), peer) {
            (Some("raftlock"), Some(e)) => (
                format!(
                    "{:.1}×",
                    f(&r["throughput"]) / f(&e["throughput"]).max(1e-9)
                ),
                format!("{:.2}×", f(&r["p99_ms"]) / f(&e["p99_ms"]).max(1e-9)),
            ),
            _ => (String::new(), String::new()),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} |\n",
            r["workload"].as_str().unwrap_or(""),
            r["clients"],
            r["target"].as_str().unwrap_or(""),
            f(&r["throughput"]),
            f(&r["p50_ms"]),
            f(&r["p99_ms"]),
            f(&r["p999_ms"]),
            tr,
            pr
        ));
    }
    s.push_str(
        "\nRatios are RaftLock / etcd (throughput: higher is better; p99: lower is better).\n",
    );
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
