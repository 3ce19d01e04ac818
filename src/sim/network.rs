//! The simulated network: messages in flight with delivery times, and the faults the simulator
//! injects — loss, duplication, delay (which reorders), and symmetric or one-way partitions.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::raft::{Message, NodeId};

/// Fault rates in parts per million, so they stay integers and exact.
#[derive(Clone, Copy, Debug)]
pub struct NetworkFaults {
    pub drop_ppm: u32,
    pub duplicate_ppm: u32,
    /// Chance that a message takes a long detour (`long_delay_us_max`), overtaking nothing but
    /// being overtaken by everything.
    pub long_delay_ppm: u32,
    pub delay_us_min: u64,
    pub delay_us_max: u64,
    pub long_delay_us_max: u64,
}

impl NetworkFaults {
    pub fn calm() -> Self {
        NetworkFaults {
            drop_ppm: 0,
            duplicate_ppm: 0,
            long_delay_ppm: 0,
            delay_us_min: 100,
            delay_us_max: 1_000,
            long_delay_us_max: 1_000,
        }
    }
}

#[derive(Debug)]
struct InFlight {
    deliver_at_us: u64,
    seq: u64,
    msg: Message,
}

impl PartialEq for InFlight {
    fn eq(&self, other: &Self) -> bool {
        (self.deliver_at_us, self.seq) == (other.deliver_at_us, other.seq)
    }
}
impl Eq for InFlight {}
impl PartialOrd for InFlight {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for InFlight {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.deliver_at_us, self.seq).cmp(&(other.deliver_at_us, other.seq))
    }
}

#[derive(Debug)]
pub struct Network {
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    /// Directed links that currently lose every message: (from, to).
    blocked: BTreeSet<(NodeId, NodeId)>,
    pub faults: NetworkFaults,
    /// Upper bound on messages in flight; beyond it new messages are dropped (a full socket).
    pub max_in_flight: usize,
}

impl Network {
    pub fn new(faults: NetworkFaults) -> Self {
        Network {
            queue: BinaryHeap::new(),
            seq: 0,
            blocked: BTreeSet::new(),
            faults,
            max_in_flight: 20_000,
        }
    }

    pub fn send(&mut self, now_us: u64, msg: Message, rng: &mut ChaCha8Rng) {
        if self.is_blocked(msg.from, msg.to) || self.queue.len() >= self.max_in_flight {
            return;
        }
        if rng.random_range(0..1_000_000) < self.faults.drop_ppm {
            return;
        }
        let copies = if rng.random_range(0..1_000_000) < self.faults.duplicate_ppm {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let delay = if rng.random_range(0..1_000_000) < self.faults.long_delay_ppm {
                rng.random_range(self.faults.delay_us_max..=self.faults.long_delay_us_max)
            } else {
                rng.random_range(self.faults.delay_us_min..=self.faults.delay_us_max)
            };
            self.seq += 1;
            let item = InFlight {
                deliver_at_us: now_us + delay,
                seq: self.seq,
                msg: msg.clone(),
            };
            self.queue.push(Reverse(item));
        }
    }

    pub fn next_delivery_us(&self) -> Option<u64> {
        self.queue.peek().map(|Reverse(m)| m.deliver_at_us)
    }

    /// The next message due, unless its link is blocked by now (then it is lost).
    pub fn pop(&mut self) -> Option<Option<Message>> {
        let Reverse(item) = self.queue.pop()?;
        if self.is_blocked(item.msg.from, item.msg.to) {
            return Some(None);
        }
        Some(Some(item.msg))
    }

    pub fn is_blocked(&self, from: NodeId, to: NodeId) -> bool {
        self.blocked.contains(&(from, to))
    }

    pub fn block(&mut self, from: NodeId, to: NodeId) {
        self.blocked.insert((from, to));
    }

    /// Cuts every link between the two groups, both ways.
    pub fn partition(&mut self, side_a: &[NodeId], side_b: &[NodeId]) {
        for &a in side_a {
            for &b in side_b {
                self.blocked.insert((a, b));
                self.blocked.insert((b, a));
            }
        }
    }

    pub fn is_partitioned(&self) -> bool {
        !self.blocked.is_empty()
    }

    pub fn heal(&mut self) {
        self.blocked.clear();
    }

    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
}
