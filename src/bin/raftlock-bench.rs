//! `raftlock-bench`: RaftLock's benchmarks. Results are reported as numbers measured in one run
//! on this machine; compare ratios, not absolute values, across machines.
//!
//! - `core`: proposals per second through three in-memory Raft cores with instant delivery and no
//!   storage — the cost of consensus bookkeeping alone.
//! - `storage`: durable appends per second through sled with one flush per batch (batches of 1,
//!   16 and 256 entries of ~100 bytes), next to the raw write+fsync latency of the same disk.

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
        /// Seconds per case (four cases).
        #[arg(long, default_value_t = 3)]
        seconds: u64,
    },
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
    println!("| case | entries/flush | flushes/s | entries/s | p50 latency | p99 latency |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &results {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.3} ms | {:.3} ms |",
            r.what,
            r.batch,
            r.syncs_per_second(),
            r.entries_per_second(),
            r.latency_p50.as_secs_f64() * 1e3,
            r.latency_p99.as_secs_f64() * 1e3
        );
    }
    Ok(())
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
        Command::Storage { dir, seconds } => {
            if let Err(message) = run_storage_bench(dir, seconds) {
                eprintln!("raftlock-bench storage: {message}");
                std::process::exit(1);
            }
        }
    }
}
