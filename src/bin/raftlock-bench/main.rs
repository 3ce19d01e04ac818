//! `raftlock-bench`: RaftLock's benchmarks. Results are reported as numbers measured in one run
//! on this machine; compare ratios, not absolute values, across machines.
//!
//! - `core`: proposals per second through three in-memory Raft cores with instant delivery and no
//!   storage — the cost of consensus bookkeeping alone.
//! - `storage`: durable appends per second through sled with one flush per batch (batches of 1,
//!   16 and 256 entries of ~100 bytes), next to the raw write+fsync latency of the same disk.
//! - `lock-memory`: resident memory per held lock and per queued waiter of the lock state machine.
//! - `load`: C concurrent clients taking locks on a running RaftLock, etcd, ZooKeeper or Redis.
//! - `compare`: RaftLock beside etcd, ZooKeeper and Redis in one run (see `scripts/bench-peers.sh`).
//! - `tracing`: RaftLock with trace export off and on side by side in one run.
//! - `latency`: where one client's lock cycle goes, from the nodes' own timings.
//! - `scale`: many connections holding and renewing locks on one node, and a million held
//!   locks (memory, snapshot, restart and catch-up), on clusters it starts itself.

mod compare;
mod install;
mod latency;
mod load;
mod peers;
mod scale;
mod tracing_cost;

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;
use clap::{Parser, Subcommand};
use raftlock::raft::{Config, InitialState, Membership, Message, Raft};

#[derive(Parser, Debug)]
#[command(version, about = "RaftLock benchmarks")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Proposals per second through a 3-node in-memory cluster of Raft cores.
    Core {
        /// Proposals per measurement.
        #[arg(long, default_value_t = 200_000)]
        proposals: u64,
        /// Batch sizes to measure (proposals per `propose` call).
        #[arg(long, value_delimiter = ',', default_values_t = vec![1, 64])]
        batch: Vec<u64>,
        /// Bytes per proposal.
        #[arg(long, default_value_t = 64)]
        payload_bytes: usize,
    },
    /// Durable sled appends per second (one flush per batch) beside raw fsync latency.
    Storage {
        /// Directory on the disk to measure; a scratch subdirectory is created and removed.
        /// Default: ./target (the build's disk, usually the data disk too).
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
        /// Seconds per case (nine cases).
        #[arg(long, default_value_t = 3)]
        seconds: u64,
    },
    /// Drive a running cluster with C clients for a duration; report throughput and latency.
    Load {
        #[arg(long, value_enum, default_value_t = load::Target::Raftlock)]
        target: load::Target,
        /// Client endpoints (RaftLock, ZooKeeper: host:port of client ports; etcd:
        /// http://host:port; Redis: host:port of one server).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "127.0.0.1:50051,127.0.0.1:50052,127.0.0.1:50053"
        )]
        endpoints: Vec<String>,
        #[arg(long, value_enum, default_value_t = load::Workload::Uncontended)]
        workload: load::Workload,
        #[arg(long, default_value_t = 1)]
        clients: usize,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: std::time::Duration,
        /// Write every acquire to this CSV file (client, sent_ms since the start, acquire_ms),
        /// to see when slow acquires happen; with `--workload contended`, every hand-off
        /// (client, sent_ms of the previous holder's release, handoff_ms).
        #[arg(long)]
        timeline: Option<std::path::PathBuf>,
        /// RaftLock clients acknowledge the answers they received (`ackBelow`), so that the
        /// cluster forgets them at once; without it every answer is kept for the retention and
        /// a sustained load is paced to the exactly-once table's rate.
        #[arg(long)]
        acknowledge: bool,
        /// Share this many connections among the clients, many requests in flight on each
        /// (clones of one SDK client, each its own owner); 0, the default, gives each client its
        /// own. RaftLock only.
        #[arg(long, default_value_t = 0)]
        connections: usize,
    },
    /// Start RaftLock and its peers (etcd; ZooKeeper and Redis with `--peers`) on loopback and
    /// compare them, each in turn (A B C … A B C …).
    Compare {
        /// Nodes in each cluster.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=7))]
        nodes: u8,
        /// Where etcd's load clients connect; `best` probes both ways and keeps the faster.
        #[arg(long, value_enum, default_value_t = compare::EtcdClients::Best)]
        etcd_clients: compare::EtcdClients,
        #[arg(long, value_delimiter = ',', default_values_t = vec![1, 8, 32, 128, 512])]
        clients: Vec<usize>,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![load::Workload::Uncontended, load::Workload::Contended, load::Workload::Mixed])]
        workloads: Vec<load::Workload>,
        /// Seconds per run.
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Rounds of A B per case.
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        /// Where both clusters keep their data (same disk for both).
        #[arg(long, default_value = "target/bench-data")]
        dir: std::path::PathBuf,
        /// Where results.md and results.json are written.
        #[arg(long, default_value = "docs/bench")]
        out: std::path::PathBuf,
        /// Where the RaftLock nodes keep their Raft log: segments (what a node gives a new
        /// data directory) or sled (`--raft-log-engine`).
        #[arg(long, default_value = "segments", value_parser = ["sled", "segments"])]
        raft_log_engine: String,
        /// The systems measured beside RaftLock, each started here on 127.0.0.1: etcd (needs
        /// the `etcd` feature), zookeeper (a three-node ensemble; the `zookeeper` feature),
        /// redis-fsync and redis-default (one Redis each, `appendfsync always` and Redis's
        /// default persistence).
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![load::Target::Etcd])]
        peers: Vec<load::Target>,
        /// Run nothing: write results.md again from this results.json (same directory).
        #[arg(long)]
        render: Option<std::path::PathBuf>,
    },
    /// Where one client's lock cycle goes: a three-node cluster, one uncontended client, and the
    /// nodes' own timings (request in the leader, commit, flushes, round trips) from /metrics.
    Latency {
        /// Seconds of load.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Where the cluster keeps its data.
        #[arg(long, default_value = "target/bench-data/latency")]
        dir: std::path::PathBuf,
        /// Concurrent uncontended clients, each on its own key (the same report for a loaded
        /// cluster; the CPU table then says where a cycle's CPU goes under load).
        #[arg(long, default_value_t = 1)]
        clients: usize,
        /// Where the RaftLock nodes keep their Raft log: segments (what a node gives a new
        /// data directory) or sled (`--raft-log-engine`).
        #[arg(long, default_value = "segments", value_parser = ["sled", "segments"])]
        raft_log_engine: String,
    },
    /// Two RaftLock clusters side by side, trace export off and on (every span sent over OTLP
    /// to a receiver in this process): what tracing costs the hot path.
    Tracing {
        #[arg(long, value_delimiter = ',', default_values_t = vec![1, 32])]
        clients: Vec<usize>,
        /// Seconds per run.
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Rounds of off/on per client count.
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        /// Where both clusters keep their data.
        #[arg(long, default_value = "target/bench-data")]
        dir: std::path::PathBuf,
    },
    /// Start RaftLock clusters and measure them at scale: N connections each holding and
    /// renewing a lock on the leader; N held locks (memory, snapshot, restart, catch-up).
    /// One SDK client doing COUNT uncontended acquire + release cycles against ENDPOINT, one
    /// after the other, then exiting: what scripts/cpu-budget.py runs under callgrind for the
    /// client's share of a cycle (run with COUNT and with 0; the difference is the cycles').
    Cycles {
        #[arg(long)]
        endpoint: String,
        #[arg(long, default_value_t = 100)]
        count: u64,
    },
    Scale {
        /// WebSocket connections to the leader, each holding and renewing its own lock.
        #[arg(long, default_value_t = 10_000)]
        connections: usize,
        /// Distinct locks held at once (the node holds at most 1,000,000).
        #[arg(long, default_value_t = 1_000_000)]
        locks: u64,
        /// Run only one of the two parts.
        #[arg(long, value_enum)]
        only: Option<scale::Part>,
        /// Where the clusters keep their data.
        #[arg(long, default_value = "target/bench-data/scale")]
        dir: std::path::PathBuf,
        /// Where scale.md and scale.json are written.
        #[arg(long, default_value = "docs/bench")]
        out: std::path::PathBuf,
        /// Keep the clusters' data directories and node logs (`raftlock-N.log`) after the run.
        #[arg(long)]
        keep_data: bool,
    },
    /// Resident memory and time of installing a snapshot of N held locks into a new sled
    /// store, as a joining member does, for each number of keys per sled batch.
    SnapshotInstall {
        #[arg(long, default_value_t = 1_000_000)]
        locks: u64,
        /// Keys per sled batch to compare (comma-separated), each with sled's page cache at
        /// the lock node's default.
        #[arg(long, value_delimiter = ',', default_value = "512,2048,16384")]
        batch_keys: Vec<usize>,
        /// Sizes of sled's page cache to compare (MiB, comma-separated), each with 512 keys
        /// per batch as the lock node writes.
        #[arg(long, value_delimiter = ',', default_value = "1024")]
        cache_mb: Vec<u64>,
        /// Where the snapshot file and the stores are written (the stores are removed after).
        #[arg(long, default_value = "target/bench-data/snapshot-install")]
        dir: std::path::PathBuf,
    },
    /// One row of `snapshot-install`, in a process of its own.
    #[command(hide = true)]
    SnapshotInstallChild {
        #[arg(long)]
        snapshot: std::path::PathBuf,
        #[arg(long)]
        batch_keys: usize,
        #[arg(long)]
        cache_mb: u64,
        #[arg(long)]
        store: std::path::PathBuf,
    },
    /// Resident memory per held lock and per waiter of the lock state machine (process RSS
    /// before and after, so allocator overhead is included; key bytes are subtracted).
    LockMemory {
        #[arg(long, default_value_t = 1_000_000)]
        locks: u64,
        /// Waiters, queued 100 per key on the first locks.
        #[arg(long, default_value_t = 1_000_000)]
        waiters: u64,
        /// Remembered answers, left by acquire + release cycles of SDK-like clients (in a
        /// state machine of their own, measured apart from the locks).
        #[arg(long, default_value_t = 1_000_000)]
        answers: u64,
    },
}

/// This invocation as written, for the reports.
fn command_line() -> String {
    std::env::args()
        .skip(1)
        .fold(String::from("raftlock-bench"), |acc, a| acc + " " + &a)
}

/// Resident set size of this process, from /proc/self/statm (pages of 4 KiB).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn bench_lock_memory(locks: u64, waiters: u64) -> raftlock::lock::LockStateMachine {
    use raftlock::lock::{Command as LockCommand, Limits, LockStateMachine};
    let limits = Limits {
        locks_held_max: locks as usize + 1,
        waiters_per_key_max: 100,
        // No request ids are used, so the exactly-once table stays empty and only lock state
        // is measured.
        dedupe_entries_max: 0,
        ..Limits::default()
    };
    let client = |i: u64| format!("c{:07}", i % 10_000_000);
    let key = |i: u64| format!("lock/{i:010}");
    let key_bytes: u64 = (0..locks).map(|i| key(i).len() as u64).sum();
    let base = rss_bytes();
    let mut sm = LockStateMachine::new(limits);
    let mut index = 0;
    let mut acquire = |sm: &mut LockStateMachine, key: String, client_id: String| {
        index += 1;
        sm.apply(
            index,
            &LockCommand::Acquire {
                key,
                client_id,
                request_id: String::new(),
                ttl_ms: 10_000,
                wait_timeout_ms: None,
            },
        );
        if index % 4096 == 0 {
            // The server drains the changed-key set after every batch; so does this loop.
            drop(sm.take_changes());
        }
    };
    for i in 0..locks {
        acquire(&mut sm, key(i), client(i));
    }
    drop(sm.take_changes());
    let after_locks = rss_bytes();
    assert_eq!(
        sm.locks_held() as u64,
        locks,
        "every acquire must be granted"
    );
    for w in 0..waiters {
        acquire(&mut sm, key((w / 100) % locks.max(1)), format!("w{w:07}"));
    }
    drop(sm.take_changes());
    let after_waiters = rss_bytes();
    let per_lock =
        (after_locks.saturating_sub(base).saturating_sub(key_bytes)) as f64 / locks as f64;
    let per_waiter = after_waiters.saturating_sub(after_locks) as f64 / waiters.max(1) as f64;
    println!("| what | count | resident bytes | bytes each |");
    println!("|---|---:|---:|---:|");
    println!(
        "| held locks (key bytes excluded: {key_bytes}; 8-byte client id and lease included) | {locks} | {} | {per_lock:.0} |",
        after_locks.saturating_sub(base)
    );
    println!(
        "| waiters (8-byte client id) | {} | {} | {per_waiter:.0} |",
        sm.waiter_count(),
        after_waiters.saturating_sub(after_locks)
    );
    sm
}

/// Resident bytes per remembered answer: `answers / 2` acquire + release cycles, each with a
/// request id as the SDK makes them, from 64 clients with SDK-like ids, one key per client.
fn bench_answer_memory(answers: u64) {
    use raftlock::lock::{Command as LockCommand, Limits, LockStateMachine, Outcome};
    let limits = Limits {
        dedupe_entries_max: answers as usize + 1,
        session_entries_max: answers as usize + 1,
        ..Limits::default()
    };
    let clients: Vec<String> = (0..64)
        .map(|i| format!("worker-7f9c{i:02}-{}-{:04x}", 4000 + i, i * 977))
        .collect();
    let base = rss_bytes();
    let mut sm = LockStateMachine::new(limits);
    let mut index = 0;
    let mut apply = |sm: &mut LockStateMachine, command: LockCommand| {
        index += 1;
        let applied = sm.apply(index, &command);
        if index % 4096 == 0 {
            drop(sm.take_changes());
        }
        applied.outcome
    };
    for cycle in 0..answers / 2 {
        let c = (cycle % 64) as usize;
        let key = format!("orders/shard-{c:03}");
        let request = |n: u64| format!("{:x}-{n}", 0x19a3_5c2e_u64 + c as u64);
        let Outcome::Granted { token, .. } = apply(
            &mut sm,
            LockCommand::Acquire {
                key: key.clone(),
                client_id: clients[c].clone(),
                request_id: request(2 * (cycle / 64)),
                ttl_ms: 10_000,
                wait_timeout_ms: None,
            },
        ) else {
            panic!("cycle {cycle}: the acquire was not granted");
        };
        apply(
            &mut sm,
            LockCommand::Release {
                key,
                client_id: clients[c].clone(),
                request_id: request(2 * (cycle / 64) + 1),
                token,
            },
        );
    }
    drop(sm.take_changes());
    let kept = sm.dedupe_len() as u64;
    assert_eq!(kept, answers / 2 * 2, "every answer must be kept");
    let used = rss_bytes().saturating_sub(base);
    println!(
        "| remembered answers (acquire + release cycles of 64 clients, SDK-like ids) | {kept} | {used} | {:.0} |",
        used as f64 / kept.max(1) as f64
    );
}

struct CoreCluster {
    nodes: Vec<Raft>,
    queue: VecDeque<Message>,
}

impl CoreCluster {
    fn new() -> Self {
        let membership = Membership::with_voters([1, 2, 3]);
        let nodes = (1..=3)
            .map(|id| {
                let initial = InitialState {
                    initial_membership: membership.clone(),
                    ..Default::default()
                };
                Raft::new(Config::new(id, 1), initial).expect("valid config")
            })
            .collect();
        let mut cluster = CoreCluster {
            nodes,
            queue: VecDeque::new(),
        };
        for i in 0..3 {
            cluster.process(i);
        }
        cluster.nodes[0].campaign_now();
        cluster.process(0);
        cluster.deliver_all();
        assert!(
            cluster.nodes[0].is_leader(),
            "node 1 must win an uncontested election"
        );
        cluster
    }

    fn process(&mut self, i: usize) {
        while self.nodes[i].has_ready() {
            let ready = self.nodes[i].ready();
            self.queue.extend(ready.messages_now.iter().cloned());
            self.queue.extend(ready.messages.iter().cloned());
            self.nodes[i].advance(ready);
        }
    }

    fn deliver_all(&mut self) {
        while let Some(msg) = self.queue.pop_front() {
            let i = (msg.to - 1) as usize;
            self.nodes[i].step(msg);
            self.process(i);
        }
    }
}

fn bench_core(proposals: u64, batch: u64, payload_bytes: usize) -> f64 {
    let mut cluster = CoreCluster::new();
    let payload = Bytes::from(vec![b'x'; payload_bytes]);
    let start_commit = cluster.nodes[0].commit_index();
    let start = Instant::now();
    let mut sent = 0;
    while sent < proposals {
        let n = batch.min(proposals - sent);
        let commands = (0..n).map(|_| payload.clone()).collect();
        cluster.nodes[0].propose(commands).expect("leader accepts");
        cluster.process(0);
        cluster.deliver_all();
        sent += n;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let committed = cluster.nodes[0].commit_index() - start_commit;
    assert_eq!(committed, proposals, "every proposal must commit");
    proposals as f64 / elapsed
}

/// `raftlock-bench storage`: runs the cases in a scratch directory and prints one table.
fn run_storage_bench(dir: Option<std::path::PathBuf>, seconds: u64) -> Result<(), String> {
    use raftlock::storage::bench;
    let base = dir.unwrap_or_else(|| std::path::PathBuf::from("target"));
    let scratch = base.join(format!("raftlock-bench-storage-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)
        .map_err(|e| format!("cannot create {}: {e}", scratch.display()))?;
    let duration = std::time::Duration::from_secs(seconds.max(1));
    let results = bench::run(&scratch, &[1, 16, 256], duration);
    let _ = std::fs::remove_dir_all(&scratch);
    let results = results.map_err(|e| e.to_string())?;
    println!(
        "storage benchmark in {} ({} s per case, entries of {} bytes, raw writes of {} bytes)",
        scratch.display(),
        duration.as_secs(),
        bench::ENTRY_BYTES,
        bench::RAW_WRITE_BYTES
    );
    println!("| case | entries/flush | flushes/s | entries/s | p50 latency | p99 latency | CPU per flush: user | kernel |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &results {
        let (user, kernel) = match r.cpu_per_sync_us() {
            Some((u, k)) => (format!("{u:.0} µs"), format!("{k:.0} µs")),
            None => ("–".to_string(), "–".to_string()),
        };
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.3} ms | {:.3} ms | {user} | {kernel} |",
            r.what,
            r.batch,
            r.syncs_per_second(),
            r.entries_per_second(),
            r.latency_p50.as_secs_f64() * 1e3,
            r.latency_p99.as_secs_f64() * 1e3
        );
    }
    println!(
        "\nCPU per flush is the whole process's (user and kernel, all threads, sled's own I/O threads included) divided by the flushes; /proc counts it in 10 ms steps."
    );
    Ok(())
}

/// `count` acquire + release cycles through the SDK, one connection, keys spread over 16 names.
async fn sdk_cycles(endpoint: &str, count: u64) -> Result<(), String> {
    let client = raftlock::client::RaftLockClient::builder()
        .endpoints([endpoint.to_string()])
        .client_id(format!("cycles-{}", std::process::id()))
        .request_timeout(std::time::Duration::from_secs(120))
        .build()
        .map_err(|e| e.to_string())?;
    // Connect (and find the leader) before the first cycle, so that COUNT = 0 pays for it too.
    client
        .get("budget-sdk/warm-up")
        .await
        .map_err(|e| format!("first request: {e}"))?;
    for i in 0..count {
        let held = client
            .acquire_with(
                &format!("budget-sdk/{}", i % 16),
                std::time::Duration::from_secs(60),
                Some(std::time::Duration::ZERO),
            )
            .await
            .map_err(|e| format!("acquire {i}: {e}"))?;
        held.release()
            .await
            .map_err(|e| format!("release {i}: {e}"))?;
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn main() {
    let args = Args::parse();
    match args.command {
        Command::Core {
            proposals,
            batch,
            payload_bytes,
        } => {
            println!("| batch | proposals | proposals/s |");
            println!("|---:|---:|---:|");
            for b in batch {
                let rate = bench_core(proposals, b.max(1), payload_bytes);
                println!("| {b} | {proposals} | {rate:.0} |");
            }
        }
        Command::LockMemory {
            locks,
            waiters,
            answers,
        } => {
            // Kept alive while the answers are measured: memory it freed would be reused
            // without growing the resident set.
            let locks = bench_lock_memory(locks, waiters);
            bench_answer_memory(answers);
            drop(locks);
        }
        Command::SnapshotInstall {
            locks,
            batch_keys,
            cache_mb,
            dir,
        } => {
            if let Err(message) = install::run(locks, &batch_keys, &cache_mb, &dir) {
                eprintln!("raftlock-bench snapshot-install: {message}");
                std::process::exit(1);
            }
        }
        Command::SnapshotInstallChild {
            snapshot,
            batch_keys,
            cache_mb,
            store,
        } => {
            if let Err(message) = install::child(&snapshot, batch_keys, cache_mb, &store) {
                eprintln!("raftlock-bench snapshot-install: {message}");
                std::process::exit(1);
            }
        }
        Command::Storage { dir, seconds } => {
            if let Err(message) = run_storage_bench(dir, seconds) {
                eprintln!("raftlock-bench storage: {message}");
                std::process::exit(1);
            }
        }
        Command::Load {
            target,
            endpoints,
            workload,
            clients,
            duration,
            timeline,
            acknowledge,
            connections,
        } => {
            let spec = load::LoadSpec {
                target,
                endpoints,
                workload,
                clients: clients.clamp(1, 10_000),
                duration,
                run_id: format!("{:x}", std::process::id()),
                timeline: timeline.is_some(),
                acknowledge,
                connections,
            };
            match runtime().block_on(load::run(&spec)) {
                Ok(r) => {
                    load::print_result(&spec, &r);
                    if let Some(path) = timeline {
                        if let Err(e) = load::write_timeline(&path, spec.workload, &r) {
                            eprintln!("raftlock-bench: cannot write {}: {e}", path.display());
                            std::process::exit(1);
                        }
                    }
                }
                Err(e) => {
                    eprintln!("raftlock-bench: {e}");
                    std::process::exit(1);
                }
            }
        }
        Command::Latency {
            seconds,
            dir,
            clients,
            raft_log_engine,
        } => {
            let args = latency::LatencyArgs {
                seconds: seconds.max(1),
                dir: dir.clone(),
                clients: clients.clamp(1, 4096),
                raft_log_engine,
            };
            let result = runtime().block_on(latency::latency(args));
            let _ = std::fs::remove_dir_all(&dir);
            if let Err(e) = result {
                eprintln!("raftlock-bench: {e}");
                std::process::exit(1);
            }
        }
        Command::Tracing {
            clients,
            seconds,
            rounds,
            dir,
        } => {
            let args = tracing_cost::TracingArgs {
                clients,
                seconds: seconds.max(1),
                rounds: rounds.max(1),
                dir: dir.clone(),
            };
            let result = runtime().block_on(tracing_cost::tracing_cost(args));
            let _ = std::fs::remove_dir_all(dir.join("tracing-off"));
            let _ = std::fs::remove_dir_all(dir.join("tracing-on"));
            if let Err(e) = result {
                eprintln!("raftlock-bench tracing: {e}");
                std::process::exit(1);
            }
        }
        Command::Cycles { endpoint, count } => {
            if let Err(e) = runtime().block_on(sdk_cycles(&endpoint, count)) {
                eprintln!("raftlock-bench cycles: {e}");
                std::process::exit(1);
            }
        }
        Command::Scale {
            connections,
            locks,
            only,
            dir,
            out,
            keep_data,
        } => {
            let command_line = command_line();
            let args = scale::ScaleArgs {
                connections,
                locks,
                only,
                dir: dir.clone(),
                out,
                command_line,
            };
            let result = runtime().block_on(scale::scale(args));
            if !keep_data {
                let _ = std::fs::remove_dir_all(&dir);
            }
            if let Err(e) = result {
                eprintln!("raftlock-bench scale: {e}");
                std::process::exit(1);
            }
        }
        Command::Compare {
            nodes,
            etcd_clients,
            clients,
            workloads,
            seconds,
            rounds,
            dir,
            out,
            raft_log_engine,
            peers,
            render,
        } => {
            if let Some(json) = render {
                if let Err(e) = compare::render(&json) {
                    eprintln!("raftlock-bench compare: {e}");
                    std::process::exit(1);
                }
                return;
            }
            let command_line = command_line();
            let _ = std::fs::remove_dir_all(&dir);
            let args = compare::CompareArgs {
                nodes: nodes.into(),
                etcd_clients,
                clients,
                workloads,
                seconds: seconds.max(1),
                rounds: rounds.max(1),
                dir: dir.clone(),
                out,
                command_line,
                raft_log_engine,
                peers,
            };
            let result = runtime().block_on(compare::compare(args));
            let _ = std::fs::remove_dir_all(&dir);
            if let Err(e) = result {
                eprintln!("raftlock-bench compare: {e}");
                std::process::exit(1);
            }
        }
    }
}
