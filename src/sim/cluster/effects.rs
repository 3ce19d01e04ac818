//! After a node is driven: its effects carried out one Ready at a time (so a crash can
//! strike between two), and its observations recorded for the checkers.

use rand::Rng;

use super::{ClientMsg, Cluster};
use crate::node::{Effect, Observation};
use crate::raft::NodeId;
use crate::sim::checker::{fnv, Violation};
use crate::storage::StorageError;

impl Cluster {
    /// Carries out a node's effects and runs the per-node checks, one Ready at a time, so that a
    /// crash can strike between two Readies.
    pub(super) fn after_core(&mut self, id: NodeId, mut result: Result<(), StorageError>) {
        loop {
            if !self.after_one_drive(id, result) {
                return;
            }
            let background = self.cfg.background_flushes
                && self
                    .nodes
                    .get(&id)
                    .and_then(|n| n.core.as_ref())
                    .is_some_and(|c| c.storage().has_pending_flushes());
            let complete = background && self.rng.random_bool(0.3);
            let Some(core) = self.nodes.get_mut(&id).and_then(|n| n.core.as_mut()) else {
                return;
            };
            if complete {
                // The disk finishes a flush between two of the node's steps.
                core.storage_mut().complete_flushes();
            } else if !core.raft().has_ready() {
                return;
            }
            result = core.drive();
        }
    }

    /// Effects and checks after one drive; false if the node went down.
    fn after_one_drive(&mut self, id: NodeId, result: Result<(), StorageError>) -> bool {
        loop {
            // A snapshot job still "running" finishes now and then, and at once when the node
            // would wait for it; never into a step whose storage just lost power (the node is
            // going down).
            let mut rerun = None;
            let finish = result.is_ok()
                && (self.nodes.get(&id).is_some_and(|n| {
                    n.snapshot_result.is_some()
                        && n.core.as_ref().is_some_and(|c| c.needs_snapshot_result())
                }) || self.rng.random_bool(0.05));
            if finish {
                rerun = self
                    .nodes
                    .get_mut(&id)
                    .and_then(|n| n.snapshot_result.take());
            }
            let Some(core) = self.nodes.get_mut(&id).and_then(|n| n.core.as_mut()) else {
                return false;
            };
            let effects = core.take_effects();
            if effects.is_empty() && rerun.is_none() {
                break;
            }
            for effect in effects {
                match effect {
                    Effect::Send(msg) => {
                        self.checker.on_send(id, &msg);
                        self.network.send(self.now_us, msg, &mut self.rng);
                    }
                    Effect::Reply(to, reply) => self.push_client_msg(ClientMsg::Answer(to, reply)),
                    Effect::BuildSnapshot(job) => {
                        // The job runs "on another thread": it reads the state now (writes are
                        // held back until its result is handed back) and finishes at once or
                        // some steps later. A new job replaces the result of an older one not
                        // yet handed back, as the driver does (it keeps the newest job's
                        // channel): a node starts a job only when none is in progress, so an
                        // older result belongs to a job an installed snapshot superseded, and
                        // handed to the new job it would compact past the installed point.
                        // Nor is a result handed into a step whose storage just lost power
                        // (the job may have read what the power cut then took back): the node
                        // is going down, and its process with the job.
                        let built = job();
                        rerun = None;
                        let mut stored = None;
                        if result.is_ok() {
                            if self.rng.random_bool(0.5) {
                                rerun = Some(built);
                            } else {
                                stored = Some(built);
                            }
                        }
                        if let Some(node) = self.nodes.get_mut(&id) {
                            node.snapshot_result = stored;
                        }
                    }
                    Effect::Observe(o) => self.observe(id, o),
                }
            }
            if let Some(built) = rerun {
                let node = self.nodes.get_mut(&id).expect("exists");
                let local = node.local(self.now_us);
                let Some(core) = node.core.as_mut() else {
                    return false;
                };
                if let Err(err) = core.snapshot_built(local, built) {
                    self.checker.violations.push(Violation {
                        invariant: "storage",
                        detail: format!("node {id} could not compact after a snapshot: {err}"),
                    });
                }
                self.stats.compactions += 1;
            }
        }
        match result {
            Ok(()) => {}
            Err(StorageError::SimulatedCrash) => {
                let restart = self.rng.random_bool(0.5) || self.healed_at.is_some();
                self.crash_node(id);
                if restart {
                    self.start_node(id);
                }
                return false;
            }
            Err(err) => {
                self.checker.violations.push(Violation {
                    invariant: "storage",
                    detail: format!("node {id}: {err}"),
                });
                return false;
            }
        }
        self.after_drive_checks(id);
        self.nodes.get(&id).is_some_and(|n| n.core.is_some())
    }

    fn observe(&mut self, id: NodeId, o: Observation) {
        match o {
            Observation::BecameLeader { term } => {
                self.stats.leader_changes += 1;
                if let Some(core) = self.nodes.get(&id).and_then(|n| n.core.as_ref()) {
                    self.checker.on_leader(id, term, core.raft());
                }
                if self.cfg.trace {
                    eprintln!("t={} node {id} leads term {term}", self.now_us);
                }
                if self.cfg.figure8 && self.healed_at.is_none() {
                    self.figure8_on_leader(id, term);
                }
            }
            Observation::Persisted(entries) => self.checker.on_persist(id, &entries),
            Observation::Applied {
                index,
                term,
                command,
                applied,
            } => {
                let node = self.nodes.get_mut(&id).expect("exists");
                if index != node.next_apply {
                    self.checker.violations.push(Violation {
                        invariant: "apply order",
                        detail: format!(
                            "node {id} applied index {index}, expected {}",
                            node.next_apply
                        ),
                    });
                }
                node.next_apply = index + 1;
                let mut digest = fnv(&term.to_le_bytes());
                if let Some(cmd) = &command {
                    digest ^= fnv(&cmd.encode()).rotate_left(1);
                }
                self.checker.on_apply(id, index, digest);
                match (command, applied) {
                    (Some(command), Some(applied)) => {
                        if let (
                            crate::lock::Command::Put { value, .. },
                            crate::lock::Outcome::Stored,
                        ) = (command.request(), &applied.outcome)
                        {
                            self.write_index.entry(value.clone()).or_insert(index);
                        }
                        self.locks.now_us = self.now_us;
                        self.locks.on_apply(id, index, &command, &applied);
                    }
                    _ => self.locks.on_other_entry(index),
                }
            }
            Observation::SnapshotInstalled { index } => {
                if let Some(node) = self.nodes.get_mut(&id) {
                    node.next_apply = index + 1;
                }
            }
            Observation::Admitted => {
                if self.cfg.trace {
                    eprintln!(
                        "t={} node {id} is admitted: it takes part in elections",
                        self.now_us
                    );
                }
                if let Some(node) = self.nodes.get_mut(&id) {
                    node.awaiting_admission = false;
                }
            }
            Observation::MemberRemoved { id: gone } => {
                if self.cfg.trace {
                    eprintln!(
                        "t={} node {id} applied the removal of node {gone}",
                        self.now_us
                    );
                }
                let delay = self.rng.random_range(0..500_000);
                // Added again since (a replaced member's new incarnation): it stays. Judged by
                // the newest configuration any node has, not only by the node that applied the
                // removal: a learner catching up applies the removals of a replacement's history
                // long after the member was added back (simulator seed 615, 3 nodes: node 4
                // retired that way while still a voter, and a later lost disk left one voter of
                // three).
                let newest = self
                    .nodes
                    .values()
                    .filter_map(|n| n.core.as_ref())
                    .max_by_key(|c| c.raft().last_index())
                    .is_some_and(|c| c.raft().membership().contains(gone));
                let again = newest
                    || self.nodes[&id]
                        .core
                        .as_ref()
                        .is_some_and(|c| c.raft().membership().contains(gone));
                if let Some(node) = self.nodes.get_mut(&gone).filter(|_| !again) {
                    // Not the new incarnation of a replaced member, still asking to join or
                    // to be admitted.
                    if node.retire_at.is_none()
                        && !node.decommissioned
                        && !node.joining
                        && !node.awaiting_admission
                        && !node.undecided
                    {
                        node.retire_at = Some(self.now_us + delay);
                    }
                }
            }
            _ => {}
        }
    }
}
