//! Lifecycle faults: every node restarted at once, disks wiped or damaged, and a node on
//! an empty disk deciding how to start and asking to join again.

use rand::seq::IndexedRandom;
use rand::Rng;

use super::{sim_identity, Cluster, SimStore, BOOTSTRAP_ID};
use crate::node::lifecycle::{JoinOutcome, PeerAnswer, StartDecision};
use crate::raft::{Membership, NodeId};

impl Cluster {
    // ----- lifecycle faults --------------------------------------------------------------------

    pub(super) fn inject_lifecycle(&mut self) {
        if !self.cfg.lifecycle || !self.cfg.faults {
            return;
        }
        let roll: u32 = self.lifecycle_rng.random_range(0..1_000_000);
        if roll < 250 {
            self.restart_all();
        } else if roll < 600 {
            self.wipe_random();
        }
        if self.cfg.segments_disk
            && self.disk_rng.random_range(0..1_000_000) < self.cfg.corrupt_sector_ppm
        {
            self.corrupt_random();
        }
    }

    /// A member crashes and a synced sector of its log goes bad (found when it restarts,
    /// which takes the disk for lost). Only where losing the disk is safe, as in
    /// [`Cluster::wipe_random`], and only on a member whose peers in the leader's
    /// configuration are all up and have committed everything the leader has: they hold
    /// every committed entry.
    fn corrupt_random(&mut self) {
        if self.volume_on_its_way_back() {
            return;
        }
        let Some(leader) = self.leader() else { return };
        let membership = self.membership_of(leader);
        let leader_commit = self.nodes[&leader]
            .core
            .as_ref()
            .map_or(0, |c| c.raft().commit_index());
        let smallest = self
            .nodes
            .values()
            .filter_map(|n| n.core.as_ref())
            .map(|c| c.raft().membership().voters.len())
            .min()
            .unwrap_or(0);
        if smallest < 3 {
            return;
        }
        let members: Vec<NodeId> = membership
            .members()
            .filter(|id| {
                self.nodes
                    .get(id)
                    .is_some_and(|n| !n.decommissioned && n.retire_at.is_none())
            })
            .collect();
        let caught_up = |id: &NodeId| {
            self.nodes.get(id).is_some_and(|n| {
                n.core
                    .as_ref()
                    .is_some_and(|c| c.raft().commit_index() >= leader_commit)
            })
        };
        let candidates: Vec<NodeId> = members
            .iter()
            .copied()
            .filter(|id| members.iter().filter(|o| *o != id).all(caught_up))
            .collect();
        let Some(&id) = candidates.choose(&mut self.disk_rng) else {
            return;
        };
        self.crash_node(id);
        let damaged = match self.nodes.get_mut(&id).and_then(|n| n.disk.as_mut()) {
            Some(SimStore::Segments(store)) => store.corrupt_synced_sector(),
            _ => false,
        };
        if self.cfg.trace && damaged {
            eprintln!(
                "t={} node {id} crashes with a damaged log sector",
                self.now_us
            );
        }
        self.start_or_decide(id);
    }

    /// Every node stopped at once (a power cut, a node-pool upgrade, every pod deleted) and
    /// started again from its disk.
    fn restart_all(&mut self) {
        let ids = self.alive_ids();
        if ids.is_empty() {
            return;
        }
        self.stats.restarts_all += 1;
        if self.cfg.trace {
            eprintln!("t={} every node restarts: {ids:?}", self.now_us);
        }
        for &id in &ids {
            self.crash_node(id);
        }
        for id in ids {
            self.start_or_decide(id);
        }
    }

    /// A member's disk is lost (its volume deleted, its machine gone): it starts again on an
    /// empty disk as a new incarnation. One at a time: no other node is still on its way back,
    /// so the other members' disks hold every committed entry. The bootstrap node, half of the
    /// time, comes back while every other node is down.
    ///
    /// Now and then the node on its way back loses its new disk too, while its replacement is
    /// still in flight (a chaos run wiped a volume again before the leader had the new
    /// incarnation as a voter, its voter list still naming the old one): losing that disk
    /// loses nothing a quorum counts on, see [`Cluster::replacement_in_flight`].
    fn wipe_random(&mut self) {
        if let Some(id) = self.replacement_in_flight() {
            if self.lifecycle_rng.random_bool(0.3) {
                self.stats.wipes += 1;
                self.stats.rewipes += 1;
                self.crash_node(id);
                let incarnation = self.lifecycle_rng.random::<u64>().max(1);
                if self.cfg.trace {
                    eprintln!(
                        "t={} node {id} is wiped again while its replacement is in flight",
                        self.now_us
                    );
                }
                self.lose_disk(id, incarnation, false);
                return;
            }
        }
        if self.volume_on_its_way_back() {
            return;
        }
        let Some(leader) = self.leader() else { return };
        let membership = self.membership_of(leader);
        let members: Vec<NodeId> = membership
            .members()
            .filter(|id| {
                self.nodes
                    .get(id)
                    .is_some_and(|n| !n.decommissioned && n.retire_at.is_none())
            })
            .collect();
        // Only where the others still hold a majority of intact disks in every node's view of
        // the configuration (a two-voter configuration that loses one disk has lost its data).
        let smallest = self
            .nodes
            .values()
            .filter_map(|n| n.core.as_ref())
            .map(|c| c.raft().membership().voters.len())
            .min()
            .unwrap_or(0);
        if smallest < 3 {
            return;
        }
        let Some(&id) = members.choose(&mut self.lifecycle_rng) else {
            return;
        };
        self.stats.wipes += 1;
        self.crash_node(id);
        let incarnation = self.lifecycle_rng.random::<u64>().max(1);
        let alone = id == BOOTSTRAP_ID && self.lifecycle_rng.random_bool(0.5);
        self.lose_disk(id, incarnation, alone);
    }

    /// A member's disk is gone: it starts on an empty one as the new `incarnation` (with
    /// `alone`, the bootstrap node comes back while every other node is down).
    pub(super) fn lose_disk(&mut self, id: NodeId, incarnation: u64, alone: bool) {
        if self.cfg.trace {
            eprintln!(
                "t={} node {id}'s disk is wiped (new incarnation {incarnation:x}){}",
                self.now_us,
                if alone { ", every other node down" } else { "" }
            );
        }
        if alone {
            self.stats.wipes_bootstrap_alone += 1;
            for other in self.alive_ids() {
                self.crash_node(other);
            }
        }
        self.checker.on_wipe(id);
        self.wiped.insert(id);
        let disk = self.new_disk();
        let node = self.nodes.get_mut(&id).expect("exists");
        if let Some(old) = node.disk.replace(disk) {
            let stats = old.disk_stats();
            self.retired_disks.power_cuts += stats.power_cuts;
            self.retired_disks.torn_writes += stats.torn_writes;
            self.retired_disks.corrupt_sectors += stats.corrupt_sectors;
        }
        node.incarnation = incarnation;
        node.awaiting_admission = true;
        if id == BOOTSTRAP_ID {
            node.undecided = true;
        } else {
            node.joining = true;
            node.initial_membership = Membership::default();
        }
        self.start_or_decide(id);
    }

    /// Starts a node; the bootstrap node on an empty disk first decides how, as lock-node does
    /// (`lifecycle::decide_start` over what each other node would answer), and stays down while
    /// it must wait.
    pub(super) fn start_or_decide(&mut self, id: NodeId) {
        if self.nodes.get(&id).is_some_and(|n| n.undecided) {
            let answers = self.start_answers(id);
            #[cfg(any(test, feature = "mutations"))]
            let bug = self.cfg.node_bugs.bootstrap_when_unreachable;
            #[cfg(not(any(test, feature = "mutations")))]
            let bug = false;
            let decision = crate::node::lifecycle::decide_start(&answers, None, bug);
            if self.cfg.trace {
                eprintln!(
                    "t={} node {id} decides {decision:?} from {answers:?}",
                    self.now_us
                );
            }
            let node = self.nodes.get_mut(&id).expect("exists");
            match decision {
                StartDecision::Bootstrap => {
                    node.undecided = false;
                    node.awaiting_admission = false;
                    node.initial_membership = Membership::with_voters([id]);
                }
                StartDecision::Join => {
                    node.undecided = false;
                    node.joining = true;
                    node.initial_membership = Membership::default();
                }
                StartDecision::Wait(_) => {
                    self.stats.bootstrap_waits += 1;
                    return;
                }
            }
        }
        self.start_node(id);
    }

    /// What every other node would answer node `id` asking about itself.
    fn start_answers(&self, id: NodeId) -> Vec<(String, PeerAnswer)> {
        self.nodes
            .values()
            .filter(|n| n.id != id && !n.decommissioned)
            .map(|n| {
                let answer = match &n.core {
                    None => PeerAnswer::Unreachable,
                    Some(_)
                        if self.network.is_blocked(id, n.id)
                            || self.network.is_blocked(n.id, id) =>
                    {
                        PeerAnswer::Unreachable
                    }
                    Some(core) => {
                        let raft = core.raft();
                        let empty = raft.last_index() == 0
                            && raft.snapshot_index() == 0
                            && raft.term() == 0
                            && raft.membership().is_empty();
                        if empty {
                            PeerAnswer::Empty
                        } else {
                            PeerAnswer::Member {
                                cluster_id: core.state_machine().cluster_id(),
                                forced_by: None,
                            }
                        }
                    }
                };
                (format!("sim-{}:peer", n.id), answer)
            })
            .collect()
    }

    /// A node on a wiped disk asks the leader to join, as lock-node's join loop does.
    pub(super) fn ask_to_join(&mut self, id: NodeId) {
        let Some(leader) = self.running_leader() else {
            return;
        };
        if self.network.is_blocked(id, leader) || self.network.is_blocked(leader, id) {
            return;
        }
        if self.nodes.get(&id).is_none_or(|n| n.core.is_none()) {
            return;
        }
        let info = sim_identity(id, self.nodes[&id].incarnation);
        let Some(core) = self.nodes.get_mut(&leader).and_then(|n| n.core.as_mut()) else {
            return;
        };
        let outcome = core.join(id, info);
        let result = core.drive();
        self.after_core(leader, result);
        if self.cfg.trace {
            eprintln!(
                "t={} node {id} asks leader {leader} to join: {outcome:?}",
                self.now_us
            );
        }
        match outcome {
            Ok(JoinOutcome::Accepted) => {
                self.stats.joins += 1;
                if let Some(node) = self.nodes.get_mut(&id) {
                    node.joining = false;
                    node.retire_at = None;
                    if let Some(core) = node.core.as_mut() {
                        core.set_joining(false);
                    }
                }
            }
            Ok(JoinOutcome::Replacing) => self.stats.replacements += 1,
            Err(_) => {}
        }
    }

    /// A node started on a wiped disk that is not back yet: still asking to join, the bootstrap
    /// node deciding how to start, or awaiting admission while a running node's configuration
    /// still has it as a voter under another incarnation (not replaced yet: a voter without its
    /// data, out of elections). Seed 313 (3 nodes, client sessions): a stale, paused leader
    /// accepted wiped voter 6 as a learner of its outdated configuration, the real leader still
    /// had it as its old incarnation, and a second disk was lost then: two of four voters
    /// without their data, where no leader can be elected safely.
    pub(super) fn volume_on_its_way_back(&self) -> bool {
        self.nodes.values().any(|n| {
            n.joining
                || n.undecided
                || (n.awaiting_admission
                    && !n.decommissioned
                    && n.retire_at.is_none()
                    && self.voter_as_another_incarnation(n.id, n.incarnation))
        })
    }

    /// Whether a running node's configuration has `id` as a voter and its member records (the
    /// log's, applied or not) name an incarnation of it other than `incarnation`.
    fn voter_as_another_incarnation(&self, id: NodeId, incarnation: u64) -> bool {
        self.nodes.values().any(|o| {
            o.core.as_ref().is_some_and(|c| {
                !o.decommissioned
                    && o.retire_at.is_none()
                    && c.raft().membership().voters.contains(&id)
                    && c.known_members()
                        .get(&id)
                        .is_some_and(|m| m.incarnation != incarnation)
            })
        })
    }

    /// A node that lost its disk and is not a voter again yet, whose disk holds nothing a
    /// quorum counts on: it is still asking to join (its log is empty), the bootstrap node
    /// still deciding how to start (it is down), or no running node's configuration has it as
    /// a voter (a learner, or removed as its old incarnation and not added again yet).
    pub(super) fn replacement_in_flight(&self) -> Option<NodeId> {
        self.wiped.iter().copied().find(|id| {
            let Some(n) = self.nodes.get(id) else {
                return false;
            };
            if n.decommissioned || n.retire_at.is_some() {
                return false;
            }
            n.joining
                || n.undecided
                || !self.nodes.values().any(|o| {
                    o.core
                        .as_ref()
                        .is_some_and(|c| c.raft().membership().voters.contains(id))
                })
        })
    }

    /// The wiped members that are not back yet: a voter in the leader's configuration, the
    /// leader's member table recording its newest incarnation, and admitted (taking part in
    /// elections). Each with what the leader knows of it.
    pub(super) fn members_not_back(&self) -> Vec<String> {
        let leader = self.leader();
        let core = leader.and_then(|l| self.nodes[&l].core.as_ref());
        self.wiped
            .iter()
            .copied()
            .filter_map(|id| {
                let n = self.nodes.get(&id)?;
                if n.decommissioned || n.retire_at.is_some() {
                    return None;
                }
                let Some(core) = core else {
                    return Some(format!("node {id}: no leader"));
                };
                let membership = core.raft().membership();
                let recorded = core.state_machine().members().get(&id).map(|m| m.incarnation);
                let records = core.state_machine().cluster_version()
                    >= crate::lock::LIFECYCLE_VERSION;
                let back = membership.voters.contains(&id)
                    && (!records || recorded == Some(n.incarnation))
                    && n.core.is_some()
                    && !n.awaiting_admission
                    && !n.joining;
                (!back).then(|| {
                    format!(
                        "node {id} (incarnation {:x}; running {}, joining {}, awaiting admission {}): \
                         leader {} has voters {:?}, learners {:?}, records incarnation {:x?}, \
                         progress {:?}; cluster version {}, member table {:?}, room for {} \
                         proposals",
                        n.incarnation,
                        n.core.is_some(),
                        n.joining,
                        n.awaiting_admission,
                        leader.unwrap_or(0),
                        membership.voters,
                        membership.learners,
                        recorded,
                        core.raft().progress(id),
                        core.state_machine().cluster_version(),
                        core.state_machine().members().keys().collect::<Vec<_>>(),
                        core.raft().proposal_room(),
                    )
                })
            })
            .collect()
    }

    /// The configuration as node `id` (running) sees it.
    pub(super) fn membership_of(&self, id: NodeId) -> Membership {
        self.nodes[&id]
            .core
            .as_ref()
            .expect("running")
            .raft()
            .membership()
            .clone()
    }

    /// Whether `id` is a member of the current leader's configuration (`None`: no leader).
    pub(super) fn member_again(&self, id: NodeId) -> Option<bool> {
        let leader = self.leader()?;
        let core = self.nodes[&leader].core.as_ref()?;
        Some(core.raft().membership().contains(id))
    }
}
