//! The run itself: the event loop over peer messages, client messages, ticks and timers up to
//! the summary of the run, and a node's tick.

use std::collections::BTreeSet;

use rand::Rng;

use super::{sim_identity, Cluster, SimOutcome, NODE_DRIFT_PPM};
use crate::lock::CLUSTER_VERSION;
use crate::raft::NodeId;
use crate::storage::SimDiskStats;

impl Cluster {
    // ----- the run -----------------------------------------------------------------------------

    pub fn run(mut self) -> SimOutcome {
        let mut violation_step = None;
        for step in 0..self.cfg.steps {
            self.inject();
            if !self.process_next_event() {
                break;
            }
            if step % 64 == 0 {
                self.check_all_logs();
            }
            self.collect_violations();
            if !self.checker.ok() {
                violation_step = Some(step);
                break;
            }
        }
        if self.checker.ok() {
            self.check_all_logs();
            self.check_liveness();
            self.collect_violations();
            if self.checker.ok() {
                self.clients.check(
                    &self.write_index,
                    self.healed_at.filter(|_| self.marker_done),
                    NODE_DRIFT_PPM as u64,
                    &self.locks.session_expiries,
                );
                self.collect_violations();
            }
            if !self.checker.ok() {
                violation_step = Some(self.cfg.steps);
            }
        }
        let committed = self
            .nodes
            .values()
            .filter_map(|n| n.core.as_ref())
            .map(|core| core.raft().commit_index())
            .max()
            .unwrap_or(0);
        for node in self.nodes.values() {
            if let Some(core) = &node.core {
                self.stats.elections += core.raft().stats().elections_started;
                self.stats.overlapped_readies += core.overlapped_readies();
                // Members that applied everything committed (a node started to join may not
                // have been added yet, a restarted one may still be catching up, and one
                // installing a snapshot does not have its state yet).
                let raft = core.raft();
                if raft.membership().contains(raft.id())
                    && raft.applied_index() >= committed
                    && core.installing_snapshot().is_none()
                {
                    self.stats.nodes_up += 1;
                    if core.state_machine().cluster_version() == CLUSTER_VERSION {
                        self.stats.nodes_at_version += 1;
                    }
                }
            }
        }
        let mut disks = self.retired_disks;
        for node in self.nodes.values() {
            let stats = match (&node.core, &node.disk) {
                (Some(core), _) => core.storage().disk_stats(),
                (None, Some(disk)) => disk.disk_stats(),
                (None, None) => SimDiskStats::default(),
            };
            disks.power_cuts += stats.power_cuts;
            disks.torn_writes += stats.torn_writes;
            disks.corrupt_sectors += stats.corrupt_sectors;
        }
        self.stats.power_cuts = disks.power_cuts;
        self.stats.torn_writes = disks.torn_writes;
        self.stats.corrupt_sectors = disks.corrupt_sectors;
        self.stats.committed = self.checker.max_committed();
        self.stats.grants = self.locks.grants;
        self.stats.expiries = self.locks.expiries;
        self.stats.lock_delays = self.locks.lock_delays;
        self.stats.lock_delays_ended = self.locks.lock_delays_ended;
        self.stats.leaders_elected = self.locks.elected;
        self.stats.proclaims = self.locks.proclaims;
        self.stats.sessions_opened = self.locks.sessions_opened;
        self.stats.sessions_closed = self.locks.sessions_closed;
        self.stats.sessions_expired = self.locks.sessions_expired;
        self.stats.attached_grants = self.locks.attached_grants;
        self.stats.shared_grants = self.locks.shared_grants;
        self.stats.ticks = self.locks.ticks;
        self.stats.acknowledging = self.locks.acknowledging;
        self.stats.acknowledged_refusals = self.locks.acknowledged_refusals;
        let (ops, beliefs) = self.clients.checked();
        self.stats.history_ops = ops;
        self.stats.beliefs_checked = beliefs;
        self.stats.reads_checked = self.clients.stats.reads_checked;
        self.stats.lin_checked = self.clients.stats.lin_checked;
        self.stats.lin_unchecked = self.clients.stats.lin_unchecked;
        self.stats.client_expiries = self.clients.stats.expiries_seen;
        self.stats.redirects = self.clients.stats.redirects;
        self.stats.client_retries = self.clients.stats.retries;
        let violation = violation_step
            .map(|step| (step, self.checker.violations.first().cloned().expect("set")));
        SimOutcome {
            seed: self.cfg.seed,
            stats: self.stats,
            violation,
        }
    }

    pub(super) fn collect_violations(&mut self) {
        self.checker.violations.append(&mut self.locks.violations);
        self.checker.violations.append(&mut self.clients.violations);
    }

    /// Processes the earliest event; false if nothing can ever happen again.
    pub(super) fn process_next_event(&mut self) -> bool {
        let next_tick = self
            .nodes
            .values()
            .filter(|n| n.core.is_some())
            .map(|n| (n.next_tick_us.max(n.paused_until), n.id))
            .min();
        let next_msg = self.network.next_delivery_us();
        let next_client_msg = self.client_net.keys().next().map(|k| k.0);
        let next_client = self.clients.next_wakeup();
        let candidates = [
            next_tick.map(|(at, _)| (at, 0)),
            next_msg.map(|at| (at, 1)),
            next_client_msg.map(|at| (at, 2)),
            next_client.map(|at| (at.max(self.now_us), 3)),
        ];
        let Some((at, kind)) = candidates.into_iter().flatten().min() else {
            return false;
        };
        self.now_us = self.now_us.max(at);
        match kind {
            0 => {
                let (_, id) = next_tick.expect("chosen");
                self.tick_node(id);
            }
            1 => self.deliver(),
            2 => self.deliver_client_msg(),
            _ => {
                let nodes = self.all_ids();
                let sends = self.clients.wake(self.now_us, &nodes, &mut self.rng);
                for send in sends {
                    self.client_send(send);
                }
            }
        }
        true
    }

    fn tick_node(&mut self, id: NodeId) {
        let now = self.now_us;
        let node = self.nodes.get_mut(&id).expect("exists");
        node.next_tick_us = now + node.tick_us;
        if node.retire_at.is_some_and(|at| at <= now) {
            match self.member_again(id) {
                // Removed (as an old incarnation) and added again since: it stays.
                Some(true) => {
                    if let Some(node) = self.nodes.get_mut(&id) {
                        node.retire_at = None;
                    }
                }
                // No leader to ask: the operator looks again later.
                None if self.cfg.lifecycle => {
                    if let Some(node) = self.nodes.get_mut(&id) {
                        node.retire_at = Some(now + 100_000);
                    }
                }
                _ => {}
            }
        }
        let node = self.nodes.get_mut(&id).expect("exists");
        if node.retire_at.is_some_and(|at| at <= now) {
            // An operator shuts a removed server down a while after its removal committed.
            node.decommissioned = true;
            node.retire_at = None;
            if let Some(core) = node.core.take() {
                self.stats.elections += core.raft().stats().elections_started;
                self.stats.overlapped_readies += core.overlapped_readies();
            }
            return;
        }
        let local = node.local(now);
        if self.cfg.clients_first_on_resume && !node.client_inbox.is_empty() {
            // The client requests, and the Ready they make, before any waiting peer message.
            let client_inbox = std::mem::take(&mut node.client_inbox);
            let Some(core) = node.core.as_mut() else {
                return;
            };
            for (op, to) in client_inbox {
                core.client_request(local, op, to.client as u64, to);
            }
            let result = core.drive();
            self.after_core(id, result);
        }
        if self.nodes[&id].joining && self.lifecycle_rng.random_bool(0.2) {
            self.ask_to_join(id);
        } else if self.nodes[&id].awaiting_admission
            && !self.nodes[&id].undecided
            && self.lifecycle_rng.random_bool(0.02)
        {
            // Accepted, but its log does not hold its admission yet: it asks again now and
            // then, as lock-node's join loop does (the leader that accepted it may have been
            // deposed before anything it proposed committed).
            self.ask_to_join(id);
        } else if self.nodes[&id].retire_at.is_none()
            && self.nodes[&id].core.is_some()
            && self.member_again(id) == Some(false)
            && self.lifecycle_rng.random_bool(0.02)
        {
            // Not in the leader's configuration and not being shut down: the entry that added
            // it was cut back. It asks to join again, as lock-node's rejoin after a removal does.
            self.ask_to_join(id);
        }
        let senders: BTreeSet<NodeId> = self.nodes[&id].inbox.iter().map(|m| m.from).collect();
        let said: Vec<(NodeId, crate::lock::MemberInfo)> = senders
            .into_iter()
            .filter_map(|from| {
                self.nodes
                    .get(&from)
                    .map(|n| (from, sim_identity(from, n.incarnation)))
            })
            .collect();
        let node = self.nodes.get_mut(&id).expect("exists");
        let inbox = std::mem::take(&mut node.inbox);
        let client_inbox = std::mem::take(&mut node.client_inbox);
        let Some(core) = node.core.as_mut() else {
            return;
        };
        for (from, info) in said {
            core.peer_info(from, info);
        }
        for msg in inbox {
            core.peer_version(msg.from, CLUSTER_VERSION);
            core.step(local, msg);
        }
        for (op, to) in client_inbox {
            core.client_request(local, op, to.client as u64, to);
        }
        // The disk is done with everything the node asked of it before this tick.
        core.storage_mut().complete_flushes();
        let result = core.tick(local);
        self.after_core(id, result);
    }
}
