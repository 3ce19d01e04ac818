//! `raftlock-bench`: RaftLock's benchmarks. Results are reported as numbers measured in one run
//! on this machine; compare ratios, not absolute values, across machines.
//!
//! - `core`: proposals per second through three in-memory Raft cores with instant delivery and no
//!   storage — the cost of consensus bookkeeping alone.

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
    }
}
