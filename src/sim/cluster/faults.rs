//! The random fault schedule: partitions, crashes, restarts and pauses, and restarting
//! every node that is down.

use rand::seq::IndexedRandom;
use rand::Rng;

use super::{Action, Cluster};
use crate::raft::NodeId;

impl Cluster {
    // ----- faults ----------------------------------------------------------------------------

    /// Draws at most one fault for this step. Weights are per million steps.
    pub(super) fn inject(&mut self) {
        if self.healed_at.is_some() {
            return;
        }
        if self.cfg.figure8 {
            self.figure8_step();
            return;
        }
        let faults = self.cfg.faults;
        let crash = if faults {
            2_000 * self.cfg.crash_intensity
        } else {
            0
        };
        let on = |w: u32| if faults { w } else { 0 };
        let table: [(u32, Action); 7] = [
            (on(3_000), Action::Partition),
            (on(5_000), Action::Heal),
            (crash, Action::Crash),
            (on(10_000), Action::Restart),
            (on(1_500), Action::Pause),
            (
                if self.cfg.membership_changes {
                    3_000
                } else {
                    0
                },
                Action::Membership,
            ),
            (500, Action::Transfer),
        ];
        let mut roll: u32 = self.rng.random_range(0..1_000_000);
        let action = table.iter().find_map(|&(weight, action)| {
            if roll < weight {
                Some(action)
            } else {
                roll -= weight;
                None
            }
        });
        match action {
            Some(Action::Partition) => self.start_partition(),
            Some(Action::Heal) => self.network.heal(),
            Some(Action::Crash) => self.crash_random(),
            Some(Action::Restart) => self.restart_random(),
            Some(Action::Pause) => self.pause_random(),
            Some(Action::Membership) => {
                // Sometimes a burst of changes.
                let burst = if self.rng.random_bool(0.2) { 3 } else { 1 };
                for _ in 0..burst {
                    self.change_membership();
                }
            }
            Some(Action::Transfer) => self.transfer_leadership(),
            None => {}
        }
        self.inject_lifecycle();
    }

    fn start_partition(&mut self) {
        let alive = self.alive_ids();
        if alive.len() < 2 {
            return;
        }
        self.stats.partitions += 1;
        let all: Vec<NodeId> = self.nodes.keys().copied().collect();
        // Partitions may overlap: a new one adds to whatever is cut already.
        match self.rng.random_range(0..4) {
            0 => {
                // Isolate one node (often the leader).
                let victim = match self.leader() {
                    Some(l) if self.rng.random_bool(0.5) => l,
                    _ => *alive.choose(&mut self.rng).expect("non-empty"),
                };
                let rest: Vec<NodeId> = all.iter().copied().filter(|&n| n != victim).collect();
                self.network.partition(&[victim], &rest);
            }
            1 => {
                // Split into two random groups.
                let (a, b): (Vec<NodeId>, Vec<NodeId>) =
                    all.into_iter().partition(|_| self.rng.random_bool(0.5));
                self.network.partition(&a, &b);
            }
            2 => {
                // A bridge: two groups that reach each other only through one node.
                let bridge = *alive.choose(&mut self.rng).expect("non-empty");
                let others: Vec<NodeId> = all.into_iter().filter(|&n| n != bridge).collect();
                let (a, b): (Vec<NodeId>, Vec<NodeId>) =
                    others.into_iter().partition(|_| self.rng.random_bool(0.5));
                self.network.partition(&a, &b);
            }
            _ => {
                // One-way: a node can send but not receive, or the reverse.
                let victim = *alive.choose(&mut self.rng).expect("non-empty");
                let inbound = self.rng.random_bool(0.5);
                for &other in &all {
                    if other != victim {
                        if inbound {
                            self.network.block(other, victim);
                        } else {
                            self.network.block(victim, other);
                        }
                    }
                }
            }
        }
    }

    fn crash_random(&mut self) {
        let alive = self.alive_ids();
        let Some(&victim) = alive.choose(&mut self.rng) else {
            return;
        };
        if self.rng.random_bool(0.5) {
            // A power cut inside a coming flush.
            let on_vote_only = self.rng.random_bool(0.3);
            if let Some(core) = self.nodes.get_mut(&victim).and_then(|n| n.core.as_mut()) {
                core.storage_mut().arm_power_cut(on_vote_only);
            }
        } else {
            self.crash_node(victim);
        }
    }

    fn restart_random(&mut self) {
        let down: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.core.is_none() && !n.decommissioned)
            .map(|n| n.id)
            .collect();
        if let Some(&id) = down.choose(&mut self.rng) {
            self.start_or_decide(id);
        }
    }

    /// SIGSTOP for 50 ms – 1.5 s (longer than any lease the clients take): the node runs nothing
    /// and its clock jumps forward when it resumes.
    fn pause_random(&mut self) {
        let alive = self.alive_ids();
        let victim = match self.leader() {
            Some(l) if self.rng.random_bool(0.5) => l,
            _ => match alive.choose(&mut self.rng) {
                Some(&v) => v,
                None => return,
            },
        };
        let until = self.now_us + self.rng.random_range(50_000..1_500_000);
        if let Some(node) = self.nodes.get_mut(&victim) {
            node.paused_until = node.paused_until.max(until);
            self.stats.pauses += 1;
        }
    }

    /// Starts every node that is down (crashed, not removed from the cluster).
    pub(super) fn restart_down_nodes(&mut self) {
        let mut down: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.core.is_none() && !n.decommissioned)
            .map(|n| n.id)
            .collect();
        // The bootstrap node on an empty disk decides last, once the others answer.
        down.sort_by_key(|id| self.nodes[id].undecided);
        for id in down {
            self.start_or_decide(id);
        }
    }
}
