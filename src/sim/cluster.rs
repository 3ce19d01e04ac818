//! One simulated cluster run: nodes with crash-modelling in-memory storage, a faulty network, a
//! fault schedule and client traffic, all driven from one seed.
//!
//! ```text
//!   seed ─► rng ─► fault schedule + client proposals
//!                    │
//!   event loop: earliest of (message delivery, node tick) ─► Raft ─► Ready ─► driver model
//!                                                                      │
//!                                       checker (after every step) ◄───┘
//! ```
//! The driver model follows the real driver's contract: `messages_now` may leave before the
//! flush, `messages` only after it; a crash can strike between the two, losing what was not
//! flushed.

use std::collections::BTreeMap;

use bytes::Bytes;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::checker::{chain, Checker, Violation};
use super::locks::{LockChecker, SimClients};
use super::network::{Network, NetworkFaults};
use crate::lock::{Command, Event, Limits, LockStateMachine, Outcome};
use crate::raft::{
    Config, Entry, EntryPayload, HardState, Index, InitialState, Membership, MembershipChange,
    NodeId, Raft, Ready, Role, Snapshot,
};

/// What one simulation run does.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    /// Initial voters (1–7).
    pub nodes: usize,
    /// Events (message deliveries and ticks) before the final liveness phase.
    pub steps: u64,
    pub pre_vote: bool,
    /// Inject partitions, crashes, loss, duplication and delay.
    pub faults: bool,
    /// Add learners, promote them, remove followers and leaders.
    pub membership_changes: bool,
    /// Take a snapshot and compact the log every this many applied entries.
    pub snapshot_every: u64,
    /// Bytes of padding in each snapshot, so snapshots travel in several chunks.
    pub snapshot_padding_bytes: usize,
    /// Write the applied state to the disk after every this many Readies that applied entries
    /// (and before every snapshot), as lock-node writes it behind the log: a crash then loses
    /// applied state that the restarted node must rebuild by re-applying committed entries.
    pub applied_write_every: u32,
    /// Simulated time allowed after healing for a leader to commit a new entry.
    pub liveness_budget_us: u64,
    /// Multiplies the crash rate (1 = default).
    pub crash_intensity: u32,
    /// Print elections, votes and membership changes to stderr (for replaying one seed).
    pub trace: bool,
    #[cfg(test)]
    pub bugs: crate::raft::config::Bugs,
}

impl SimConfig {
    pub fn new(seed: u64, nodes: usize) -> Self {
        SimConfig {
            seed,
            nodes,
            steps: 4_000,
            pre_vote: true,
            faults: true,
            membership_changes: true,
            snapshot_every: 48,
            snapshot_padding_bytes: 1_500,
            applied_write_every: 4,
            liveness_budget_us: 5_000_000,
            crash_intensity: 1,
            trace: false,
            #[cfg(test)]
            bugs: Default::default(),
        }
    }
}

/// Counters for the summary line.
#[derive(Clone, Copy, Debug, Default)]
pub struct SimStats {
    pub elections: u64,
    pub leader_changes: u64,
    pub partitions: u64,
    pub crashes: u64,
    pub membership_changes: u64,
    pub committed: u64,
    pub snapshots_sent: u64,
    pub compactions: u64,
    pub reads: u64,
    pub transfers: u64,
    pub grants: u64,
    pub expiries: u64,
}

impl SimStats {
    pub fn add(&mut self, other: &SimStats) {
        self.elections += other.elections;
        self.leader_changes += other.leader_changes;
        self.partitions += other.partitions;
        self.crashes += other.crashes;
        self.membership_changes += other.membership_changes;
        self.committed += other.committed;
        self.snapshots_sent += other.snapshots_sent;
        self.compactions += other.compactions;
        self.reads += other.reads;
        self.transfers += other.transfers;
        self.grants += other.grants;
        self.expiries += other.expiries;
    }
}

/// The result of one seed.
#[derive(Clone, Debug)]
pub struct SimOutcome {
    pub seed: u64,
    pub stats: SimStats,
    /// The first broken invariant and the step it was seen at.
    pub violation: Option<(u64, Violation)>,
}

/// What a node has written: the durable copy survives a crash, the staged one does not.
#[derive(Clone, Debug, Default)]
struct Disk {
    hard_state: HardState,
    snapshot: Option<Snapshot>,
    entries: Vec<Entry>,
    /// State machine (applied index, digest, lock state), written atomically.
    applied: Index,
    digest: u64,
    locks: Vec<u8>,
}

impl Disk {
    fn append(&mut self, entries: &[Entry]) {
        let Some(first) = entries.first() else { return };
        self.entries.retain(|e| e.index < first.index);
        self.entries.extend_from_slice(entries);
    }

    fn install_snapshot(
        &mut self,
        snapshot: &Snapshot,
        applied: Index,
        digest: u64,
        locks: Vec<u8>,
    ) {
        let meta = &snapshot.meta;
        let keep = self
            .entries
            .iter()
            .any(|e| e.index == meta.index && e.term == meta.term);
        if keep {
            self.entries.retain(|e| e.index > meta.index);
        } else {
            self.entries.clear();
        }
        self.snapshot = Some(snapshot.clone());
        self.applied = applied;
        self.digest = digest;
        self.locks = locks;
    }
}

#[derive(Clone, Copy, Debug)]
enum Action {
    Propose,
    Read,
    Partition,
    Heal,
    Crash,
    Restart,
    Membership,
    Transfer,
}

/// Where a mid-Ready crash strikes.
#[derive(Clone, Copy, Debug)]
struct CrashPoint {
    /// Only in a Ready that records a new vote (otherwise: the next one that must flush).
    on_vote_only: bool,
    /// Restart the process at once, as a supervisor would.
    restart_at_once: bool,
}

struct SimNode {
    id: NodeId,
    raft: Option<Raft>,
    initial_membership: Membership,
    staged: Disk,
    durable: Disk,
    /// In-memory state machine.
    applied: Index,
    digest: u64,
    locks: LockStateMachine,
    /// Leader only: key -> (token, lease deadline) and waiter -> (key, cancel deadline).
    leases: BTreeMap<String, (u64, u64)>,
    wait_deadlines: BTreeMap<(String, String), (String, u64)>,
    tick_us: u64,
    next_tick_us: u64,
    /// Crash inside a coming Ready, after `messages_now` left but before the flush.
    crash_mid_ready: Option<CrashPoint>,
    /// Removed from the cluster and shut down for good.
    decommissioned: bool,
    /// Readies that applied entries since the applied state was last written.
    applies_unwritten: u32,
    last_commit: Index,
    incarnation_elections: u64,
}

impl SimNode {
    /// Stages the in-memory applied state (applied index, digest, locks) as one write; it
    /// becomes durable with the next flush.
    fn write_applied(&mut self) {
        self.staged.locks = self.locks.snapshot();
        self.staged.applied = self.applied;
        self.staged.digest = self.digest;
        self.applies_unwritten = 0;
    }
}

pub struct Cluster {
    cfg: SimConfig,
    rng: ChaCha8Rng,
    now_us: u64,
    nodes: BTreeMap<NodeId, SimNode>,
    network: Network,
    checker: Checker,
    stats: SimStats,
    next_node_id: NodeId,
    next_read_ctx: u64,
    /// For each outstanding read: the highest committed index when it was requested.
    reads: BTreeMap<(NodeId, u64), Index>,
    min_voters: usize,
    /// Flow-control settings drawn per seed, so runs cover one-entry appends through large
    /// pipelined batches.
    max_inflight_appends: usize,
    max_batch_bytes: usize,
    clients: SimClients,
    locks: LockChecker,
    /// Set once every fault is healed for the final liveness check.
    healed: bool,
    /// Digest of the lock state after each (sampled) index: replicas must agree.
    lock_state_at: BTreeMap<Index, u64>,
}

const MAX_MEMBERS: usize = 7;

impl Cluster {
    pub fn new(cfg: SimConfig) -> Self {
        let nodes_count = cfg.nodes.clamp(1, MAX_MEMBERS) as NodeId;
        let faults = if cfg.faults {
            NetworkFaults {
                drop_ppm: 20_000,
                duplicate_ppm: 20_000,
                long_delay_ppm: 20_000,
                delay_us_min: 100,
                delay_us_max: 3_000,
                long_delay_us_max: 40_000,
            }
        } else {
            NetworkFaults::calm()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let max_inflight_appends = *[1, 2, 4, 16].choose(&mut rng).expect("non-empty");
        let max_batch_bytes = *[1, 100, 512, 4096].choose(&mut rng).expect("non-empty");
        let mut cluster = Cluster {
            clients: SimClients::new(4, 3),
            locks: LockChecker::default(),
            lock_state_at: BTreeMap::new(),
            healed: false,
            max_inflight_appends,
            max_batch_bytes,
            rng,
            now_us: 0,
            nodes: BTreeMap::new(),
            network: Network::new(faults),
            checker: Checker::default(),
            stats: SimStats::default(),
            next_node_id: nodes_count + 1,
            next_read_ctx: 0,
            reads: BTreeMap::new(),
            min_voters: (nodes_count as usize).min(3),
            cfg,
        };
        let membership = Membership::with_voters(1..=nodes_count);
        for id in 1..=nodes_count {
            cluster.add_node(id, membership.clone());
        }
        cluster
    }

    fn add_node(&mut self, id: NodeId, initial_membership: Membership) {
        let tick_us = self.rng.random_range(8_000..=12_000);
        let node = SimNode {
            id,
            raft: None,
            initial_membership,
            staged: Disk::default(),
            durable: Disk::default(),
            applied: 0,
            digest: 0,
            locks: LockStateMachine::new(sim_lock_limits()),
            leases: BTreeMap::new(),
            wait_deadlines: BTreeMap::new(),
            tick_us,
            next_tick_us: self.now_us + self.rng.random_range(0..tick_us),
            crash_mid_ready: None,
            decommissioned: false,
            applies_unwritten: 0,
            last_commit: 0,
            incarnation_elections: 0,
        };
        self.nodes.insert(id, node);
        self.start_node(id);
    }

    fn raft_config(&self, id: NodeId, incarnation_seed: u64) -> Config {
        let mut cfg = Config::new(id, incarnation_seed);
        cfg.pre_vote = self.cfg.pre_vote;
        cfg.max_inflight_appends = self.max_inflight_appends;
        cfg.max_batch_bytes = self.max_batch_bytes;
        cfg.snapshot_chunk_bytes = 512;
        #[cfg(test)]
        {
            cfg.bugs = self.cfg.bugs;
        }
        cfg
    }

    /// Starts (or restarts) a node from its durable state.
    fn start_node(&mut self, id: NodeId) {
        let incarnation_seed = self.rng.random();
        let cfg = self.raft_config(id, incarnation_seed);
        let node = self.nodes.get_mut(&id).expect("node exists");
        node.staged = node.durable.clone();
        let disk = &node.durable;
        let initial = InitialState {
            hard_state: disk.hard_state,
            snapshot: disk.snapshot.clone(),
            entries: disk.entries.clone(),
            applied: disk.applied,
            initial_membership: node.initial_membership.clone(),
        };
        node.applied = disk.applied;
        node.digest = disk.digest;
        node.locks = if disk.locks.is_empty() {
            LockStateMachine::new(sim_lock_limits())
        } else {
            LockStateMachine::restore(&disk.locks, sim_lock_limits()).expect("own snapshot decodes")
        };
        node.leases.clear();
        node.wait_deadlines.clear();
        node.applies_unwritten = 0;
        let raft = Raft::new(cfg, initial).expect("simulator config is valid");
        node.last_commit = raft.commit_index();
        node.incarnation_elections = 0;
        let term = raft.term();
        node.raft = Some(raft);
        node.crash_mid_ready = None;
        self.checker.on_restart(id, term);
    }

    fn crash_node(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if let Some(raft) = node.raft.take() {
            self.stats.elections += raft.stats().elections_started;
            self.stats.crashes += 1;
        }
        node.staged = node.durable.clone();
        node.crash_mid_ready = None;
    }

    fn alive_ids(&self) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.raft.is_some())
            .map(|(&id, _)| id)
            .collect()
    }

    fn leader(&self) -> Option<NodeId> {
        self.nodes
            .iter()
            .filter_map(|(&id, n)| {
                n.raft
                    .as_ref()
                    .filter(|r| r.is_leader())
                    .map(|r| (r.term(), id))
            })
            .max()
            .map(|(_, id)| id)
    }

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
            self.checker.violations.append(&mut self.locks.violations);
            if !self.checker.ok() {
                violation_step = Some(step);
                break;
            }
        }
        if self.checker.ok() {
            self.check_logs_final();
            self.check_liveness();
            if !self.checker.ok() {
                violation_step = Some(self.cfg.steps);
            }
        }
        for node in self.nodes.values() {
            if let Some(raft) = &node.raft {
                self.stats.elections += raft.stats().elections_started;
            }
        }
        self.checker.violations.append(&mut self.locks.violations);
        if violation_step.is_none() && !self.checker.ok() {
            violation_step = Some(self.cfg.steps);
        }
        self.stats.committed = self.checker.max_committed();
        self.stats.grants = self.locks.grants;
        self.stats.expiries = self.locks.expiries;
        let violation = violation_step
            .map(|step| (step, self.checker.violations.first().cloned().expect("set")));
        SimOutcome {
            seed: self.cfg.seed,
            stats: self.stats,
            violation,
        }
    }

    /// Processes the earliest event; false if nothing can ever happen again.
    fn process_next_event(&mut self) -> bool {
        let next_tick = self
            .nodes
            .values()
            .filter(|n| n.raft.is_some())
            .map(|n| (n.next_tick_us, n.id))
            .min();
        let next_msg = self.network.next_delivery_us();
        match (next_tick, next_msg) {
            (None, None) => false,
            (Some((at, _)), Some(msg_at)) if msg_at <= at => {
                self.deliver(msg_at);
                true
            }
            (None, Some(msg_at)) => {
                self.deliver(msg_at);
                true
            }
            (Some((at, id)), _) => {
                self.now_us = self.now_us.max(at);
                let node = self.nodes.get_mut(&id).expect("exists");
                node.next_tick_us = at + node.tick_us;
                if let Some(raft) = node.raft.as_mut() {
                    raft.tick();
                }
                self.handle_ready(id);
                self.leader_duties(id);
                true
            }
        }
    }

    fn deliver(&mut self, at: u64) {
        self.now_us = self.now_us.max(at);
        let Some(Some(msg)) = self.network.pop() else {
            return;
        };
        let to = msg.to;
        let Some(raft) = self.nodes.get_mut(&to).and_then(|n| n.raft.as_mut()) else {
            return;
        };
        if matches!(
            msg.body,
            crate::raft::MessageBody::InstallSnapshot { offset: 0, .. }
        ) {
            self.stats.snapshots_sent += 1;
        }
        if self.cfg.trace
            && matches!(
                msg.body,
                crate::raft::MessageBody::Vote { .. }
                    | crate::raft::MessageBody::VoteResponse { .. }
            )
        {
            eprintln!("t={} deliver {:?} to {:?}", self.now_us, msg, raft);
        }
        raft.step(msg);
        self.handle_ready(to);
    }

    /// The driver model: persist, flush, send, apply, advance — with a possible crash mid-way.
    fn handle_ready(&mut self, id: NodeId) {
        for _ in 0..16 {
            let Some(node) = self.nodes.get_mut(&id) else {
                return;
            };
            let Some(raft) = node.raft.as_mut() else {
                return;
            };
            if !raft.has_ready() {
                return;
            }
            let ready = raft.ready();
            let became_leader = ready.soft_state.is_some_and(|s| s.role == Role::Leader);
            let term = raft.term();
            if became_leader {
                if self.cfg.trace {
                    eprintln!(
                        "t={} node {id} leads term {term} membership {:?}",
                        self.now_us,
                        raft.membership()
                    );
                }
                self.stats.leader_changes += 1;
                let raft = self.nodes[&id].raft.as_ref().expect("alive");
                self.checker.on_leader(id, term, raft);
                self.rebuild_leases(id);
            }
            for msg in &ready.messages_now {
                self.checker.on_send(id, msg);
                self.network.send(self.now_us, msg.clone(), &mut self.rng);
            }
            let must_sync = ready.must_sync();
            self.checker.on_persist(id, &ready.entries);
            let node = self.nodes.get_mut(&id).expect("exists");
            if let Some(hs) = ready.hard_state {
                node.staged.hard_state = hs;
            }
            node.staged.append(&ready.entries);
            let crash_now = match node.crash_mid_ready {
                Some(CrashPoint {
                    on_vote_only: true, ..
                }) => ready
                    .hard_state
                    .is_some_and(|hs| hs.vote != node.durable.hard_state.vote),
                Some(_) => must_sync,
                None => false,
            };
            if crash_now {
                let restart = node.crash_mid_ready.is_some_and(|c| c.restart_at_once);
                self.crash_node(id);
                if restart {
                    self.start_node(id);
                }
                return;
            }
            if must_sync {
                node.durable = node.staged.clone();
            }
            for msg in &ready.messages {
                self.checker.on_send(id, msg);
                self.network.send(self.now_us, msg.clone(), &mut self.rng);
            }
            self.apply_ready(id, &ready);
            let node = self.nodes.get_mut(&id).expect("exists");
            let Some(raft) = node.raft.as_mut() else {
                return;
            }; // decommissioned while applying
            raft.advance(ready);
            self.after_advance(id);
        }
    }

    fn apply_ready(&mut self, id: NodeId, ready: &Ready) {
        let padding = self.cfg.snapshot_padding_bytes;
        let now_us = self.now_us;
        let node = self.nodes.get_mut(&id).expect("exists");
        if let Some(snapshot) = &ready.snapshot {
            let decoded =
                decode_snapshot(&snapshot.data, padding).and_then(|(index, digest, locks)| {
                    let sm = LockStateMachine::restore(&locks, sim_lock_limits()).ok()?;
                    Some((index, digest, locks, sm))
                });
            match decoded {
                Some((index, digest, locks, sm)) if index == snapshot.meta.index => {
                    node.applied = index;
                    node.digest = digest;
                    node.locks = sm;
                    node.staged.install_snapshot(snapshot, index, digest, locks);
                    node.durable = node.staged.clone();
                    self.checker.on_apply(id, index, digest);
                }
                _ => self.checker.violations.push(Violation {
                    invariant: "snapshot integrity",
                    detail: format!("node {id} received a malformed snapshot"),
                }),
            }
        }
        let is_leader = node.raft.as_ref().is_some_and(|r| r.is_leader());
        let mut removed = Vec::new();
        for entry in &ready.committed_entries {
            if entry.index != node.applied + 1 {
                self.checker.violations.push(Violation {
                    invariant: "apply order",
                    detail: format!(
                        "node {id} applied index {} after {}",
                        entry.index, node.applied
                    ),
                });
                return;
            }
            node.digest = chain(node.digest, entry);
            node.applied = entry.index;
            self.checker.on_apply(id, entry.index, node.digest);
            match &entry.payload {
                EntryPayload::Command(data) => match Command::decode(data) {
                    Ok(command) => {
                        let applied = node.locks.apply(entry.index, &command);
                        self.locks.on_apply(id, entry.index, &command, &applied);
                        if is_leader {
                            track_leases(node, now_us, &command, &applied);
                            self.clients.observe(&command, &applied);
                        }
                    }
                    Err(_) => self.locks.on_other_entry(entry.index),
                },
                EntryPayload::Membership(MembershipChange::RemoveServer(gone)) => {
                    removed.push(*gone);
                    self.locks.on_other_entry(entry.index);
                }
                _ => self.locks.on_other_entry(entry.index),
            }
            if entry.index % 8 == 0 {
                let digest = super::checker::fnv(&node.locks.snapshot());
                if let Some(&seen) = self.lock_state_at.get(&entry.index) {
                    if seen != digest {
                        self.checker.violations.push(Violation {
                            invariant: "replica lock state",
                            detail: format!(
                                "node {id} lock state differs at index {}",
                                entry.index
                            ),
                        });
                    }
                } else {
                    self.lock_state_at.insert(entry.index, digest);
                }
            }
        }
        if !ready.committed_entries.is_empty() {
            node.applies_unwritten += 1;
        }
        if node.applies_unwritten >= self.cfg.applied_write_every {
            node.write_applied();
        }
        for read in &ready.read_states {
            self.stats.reads += 1;
            if let Some(required) = self.reads.remove(&(id, read.ctx)) {
                if read.index < required {
                    self.checker.violations.push(Violation {
                        invariant: "linearizable read",
                        detail: format!(
                            "node {id} served read {} at index {} but {required} was committed before it was asked",
                            read.ctx, read.index
                        ),
                    });
                }
            }
        }
        // An operator shuts a server down once its removal has committed.
        for gone in removed {
            if let Some(node) = self.nodes.get_mut(&gone) {
                if !node.decommissioned {
                    node.decommissioned = true;
                    if let Some(raft) = node.raft.take() {
                        self.stats.elections += raft.stats().elections_started;
                    }
                }
            }
        }
    }

    fn after_advance(&mut self, id: NodeId) {
        let snapshot_every = self.cfg.snapshot_every;
        let padding = self.cfg.snapshot_padding_bytes;
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let Some(raft) = node.raft.as_mut() else {
            return;
        };
        let commit = raft.commit_index();
        if commit < node.last_commit {
            let detail = format!(
                "node {id} commit went from {} to {commit}",
                node.last_commit
            );
            self.checker.violations.push(Violation {
                invariant: "commit monotonicity",
                detail,
            });
            return;
        }
        if commit > node.last_commit {
            let from = node.last_commit + 1;
            node.last_commit = commit;
            let raft = node.raft.as_ref().expect("alive");
            self.checker.on_commit(id, raft, from, commit);
            // Adversarial crash point: a leader dies right after advancing its commit index,
            // before followers learn of it — where commit-rule bugs (Figure 8) do their damage.
            if self.cfg.faults
                && !self.healed
                && raft.is_leader()
                && self.rng.random_range(0..1_000_000u32) < 20_000 * self.cfg.crash_intensity
            {
                self.crash_node(id);
                return;
            }
        }
        let node = self.nodes.get_mut(&id).expect("exists");
        let raft = node.raft.as_mut().expect("alive");
        if node.applied >= raft.snapshot_index() + snapshot_every
            && node.applied == raft.applied_index()
        {
            let data = encode_snapshot(node.applied, node.digest, &node.locks.snapshot(), padding);
            if raft.compact(node.applied, data) {
                let snapshot = raft.latest_snapshot().cloned().expect("just taken");
                let index = snapshot.meta.index;
                node.write_applied();
                node.staged.entries.retain(|e| e.index > index);
                node.staged.snapshot = Some(snapshot);
                node.durable = node.staged.clone();
                self.stats.compactions += 1;
            }
        }
    }

    // ----- faults and clients ----------------------------------------------------------------

    /// Draws at most one fault or client action for this step. Weights are per million steps.
    fn inject(&mut self) {
        let faults = self.cfg.faults;
        let crash = if faults {
            2_000 * self.cfg.crash_intensity
        } else {
            0
        };
        let table: [(u32, Action); 8] = [
            (40_000, Action::Propose),
            (5_000, Action::Read),
            (if faults { 3_000 } else { 0 }, Action::Partition),
            (if faults { 5_000 } else { 0 }, Action::Heal),
            (crash, Action::Crash),
            (if faults { 10_000 } else { 0 }, Action::Restart),
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
            Some(Action::Propose) => self.client_propose(),
            Some(Action::Read) => self.client_read(),
            Some(Action::Partition) => self.start_partition(),
            Some(Action::Heal) => self.network.heal(),
            Some(Action::Crash) => self.crash_random(),
            Some(Action::Restart) => self.restart_random(),
            Some(Action::Membership) => self.change_membership(),
            Some(Action::Transfer) => self.transfer_leadership(),
            None => {}
        }
    }

    fn client_propose(&mut self) {
        let Some(leader) = self.leader() else { return };
        let count = self.rng.random_range(1..=3);
        let commands: Vec<Bytes> = (0..count)
            .map(|_| Bytes::from(self.clients.next(&mut self.rng).encode()))
            .collect();
        let raft = self
            .nodes
            .get_mut(&leader)
            .and_then(|n| n.raft.as_mut())
            .expect("leader");
        if raft.propose(commands).is_ok() {
            self.handle_ready(leader);
        }
    }

    /// The leader's lease and wait-timeout duties, in simulated time (DESIGN.md §4).
    fn leader_duties(&mut self, id: NodeId) {
        let now = self.now_us;
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let Some(raft) = node.raft.as_mut() else {
            return;
        };
        if !raft.is_leader() {
            node.leases.clear();
            node.wait_deadlines.clear();
            return;
        }
        let mut commands = Vec::new();
        for (key, (token, deadline)) in &node.leases {
            if *deadline <= now {
                commands.push(Command::Expire {
                    key: key.clone(),
                    token: *token,
                });
            }
        }
        for ((client_id, request_id), (key, deadline)) in &node.wait_deadlines {
            if *deadline <= now {
                commands.push(Command::CancelWait {
                    key: key.clone(),
                    client_id: client_id.clone(),
                    request_id: request_id.clone(),
                });
            }
        }
        if commands.is_empty() {
            return;
        }
        // Proposed once; re-proposed a lease later if the first proposal is lost.
        for cmd in &commands {
            match cmd {
                Command::Expire { key, .. } => {
                    if let Some(lease) = node.leases.get_mut(key) {
                        lease.1 = now + 200_000;
                    }
                }
                Command::CancelWait {
                    client_id,
                    request_id,
                    ..
                } => {
                    if let Some(w) = node
                        .wait_deadlines
                        .get_mut(&(client_id.clone(), request_id.clone()))
                    {
                        w.1 = now + 200_000;
                    }
                }
                _ => {}
            }
        }
        let encoded = commands.iter().map(|c| Bytes::from(c.encode())).collect();
        if raft.propose(encoded).is_ok() {
            self.handle_ready(id);
        }
    }

    /// A new leader gives every held lock a full TTL from its election and every waiter a
    /// reclaim window in which its client could re-attach.
    fn rebuild_leases(&mut self, id: NodeId) {
        let now = self.now_us;
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        node.leases = node
            .locks
            .held_locks()
            .into_iter()
            .map(|h| (h.key, (h.token, now + h.ttl_ms * 1000)))
            .collect();
        node.wait_deadlines = node
            .locks
            .waiters()
            .into_iter()
            .map(|w| {
                let wait_us = w.wait_timeout_ms.unwrap_or(500).max(500) * 1000;
                ((w.client_id, w.request_id), (w.key, now + wait_us))
            })
            .collect();
    }

    fn client_read(&mut self) {
        let Some(leader) = self.leader() else { return };
        self.next_read_ctx += 1;
        let ctx = self.next_read_ctx;
        let required = self.checker.max_committed();
        let raft = self
            .nodes
            .get_mut(&leader)
            .and_then(|n| n.raft.as_mut())
            .expect("leader");
        if raft.read_index(ctx).is_ok() {
            self.reads.insert((leader, ctx), required);
            self.handle_ready(leader);
        }
    }

    fn start_partition(&mut self) {
        let alive = self.alive_ids();
        if alive.len() < 2 || self.network.is_partitioned() {
            return;
        }
        self.stats.partitions += 1;
        match self.rng.random_range(0..3) {
            0 => {
                // Isolate one node (often the leader).
                let victim = match self.leader() {
                    Some(l) if self.rng.random_bool(0.5) => l,
                    _ => *alive.choose(&mut self.rng).expect("non-empty"),
                };
                let rest: Vec<NodeId> = self
                    .nodes
                    .keys()
                    .copied()
                    .filter(|&n| n != victim)
                    .collect();
                self.network.partition(&[victim], &rest);
            }
            1 => {
                // Split into two random groups.
                let all: Vec<NodeId> = self.nodes.keys().copied().collect();
                let (a, b): (Vec<NodeId>, Vec<NodeId>) =
                    all.into_iter().partition(|_| self.rng.random_bool(0.5));
                self.network.partition(&a, &b);
            }
            _ => {
                // One-way: a node can send but not receive, or the reverse.
                let victim = *alive.choose(&mut self.rng).expect("non-empty");
                let inbound = self.rng.random_bool(0.5);
                for &other in self.nodes.keys() {
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
            let point = CrashPoint {
                on_vote_only: self.rng.random_bool(0.3),
                restart_at_once: self.rng.random_bool(0.5),
            };
            self.nodes.get_mut(&victim).expect("exists").crash_mid_ready = Some(point);
        } else {
            self.crash_node(victim);
        }
    }

    fn restart_random(&mut self) {
        let down: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.raft.is_none() && !n.decommissioned)
            .map(|n| n.id)
            .collect();
        if let Some(&id) = down.choose(&mut self.rng) {
            self.start_node(id);
        }
    }

    fn change_membership(&mut self) {
        let Some(leader) = self.leader() else { return };
        let membership = self.nodes[&leader]
            .raft
            .as_ref()
            .expect("leader")
            .membership()
            .clone();
        let live_members = membership.voters.len() + membership.learners.len();
        let choice = self.rng.random_range(0..4);
        let change = match choice {
            0 if live_members < MAX_MEMBERS && self.next_node_id < 64 => {
                MembershipChange::AddLearner(self.next_node_id)
            }
            1 if !membership.learners.is_empty() => {
                let raft = self.nodes[&leader].raft.as_ref().expect("leader");
                let caught_up: Vec<NodeId> = membership
                    .learners
                    .iter()
                    .copied()
                    .filter(|&l| {
                        raft.progress(l)
                            .is_some_and(|(m, _, _)| m >= raft.commit_index())
                    })
                    .collect();
                match caught_up.choose(&mut self.rng) {
                    Some(&l) => MembershipChange::PromoteLearner(l),
                    None => return,
                }
            }
            2 if membership.voters.len() > self.min_voters => {
                let followers: Vec<NodeId> = membership
                    .voters
                    .iter()
                    .copied()
                    .filter(|&v| v != leader)
                    .collect();
                match followers.choose(&mut self.rng) {
                    Some(&f) => MembershipChange::RemoveServer(f),
                    None => return,
                }
            }
            3 if membership.voters.len() > self.min_voters => {
                MembershipChange::RemoveServer(leader)
            }
            _ => return,
        };
        let raft = self
            .nodes
            .get_mut(&leader)
            .and_then(|n| n.raft.as_mut())
            .expect("leader");
        if raft.propose_membership(change).is_err() {
            return;
        }
        self.stats.membership_changes += 1;
        if self.cfg.trace {
            eprintln!("t={} leader {leader} proposed {change:?}", self.now_us);
        }
        if let MembershipChange::AddLearner(id) = change {
            self.next_node_id += 1;
            self.add_node(id, Membership::default());
        }
        self.handle_ready(leader);
    }

    fn transfer_leadership(&mut self) {
        let Some(leader) = self.leader() else { return };
        let raft = self
            .nodes
            .get_mut(&leader)
            .and_then(|n| n.raft.as_mut())
            .expect("leader");
        let voters: Vec<NodeId> = raft
            .membership()
            .voters
            .iter()
            .copied()
            .filter(|&v| v != leader)
            .collect();
        let Some(&target) = voters.choose(&mut self.rng) else {
            return;
        };
        if raft.transfer_leader(target).is_ok() {
            self.stats.transfers += 1;
            self.handle_ready(leader);
        }
    }

    // ----- end-of-run checks -----------------------------------------------------------------

    fn check_all_logs(&mut self) {
        let alive: Vec<NodeId> = self.alive_ids();
        for (i, &a) in alive.iter().enumerate() {
            for &b in &alive[i + 1..] {
                let (ra, rb) = (
                    self.nodes[&a].raft.as_ref().expect("alive"),
                    self.nodes[&b].raft.as_ref().expect("alive"),
                );
                self.checker.check_logs_match(ra, rb);
            }
        }
    }

    fn check_logs_final(&mut self) {
        self.check_all_logs();
    }

    /// After every fault heals, a leader must emerge and commit a new entry within the budget.
    fn check_liveness(&mut self) {
        self.healed = true;
        self.network.heal();
        self.network.faults = NetworkFaults::calm();
        let down: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.raft.is_none() && !n.decommissioned)
            .map(|n| n.id)
            .collect();
        for id in down {
            self.start_node(id);
        }
        for node in self.nodes.values_mut() {
            node.crash_mid_ready = None;
        }
        let deadline = self.now_us + self.cfg.liveness_budget_us;
        let mut marker: Option<(NodeId, Index, u64)> = None;
        let mut events = 0u64;
        while self.now_us < deadline && events < 200_000 {
            events += 1;
            if !self.process_next_event() {
                break;
            }
            if !self.checker.ok() {
                return;
            }
            match marker {
                None => {
                    if let Some(leader) = self.leader() {
                        let raft = self.nodes.get_mut(&leader).and_then(|n| n.raft.as_mut());
                        let raft = raft.expect("leader");
                        if raft.committed_in_current_term() {
                            let term = raft.term();
                            if let Ok(index) =
                                raft.propose(vec![Bytes::from(liveness_marker().encode())])
                            {
                                marker = Some((leader, index, term));
                                self.handle_ready(leader);
                            }
                        }
                    }
                }
                Some((leader, index, term)) => {
                    let node = &self.nodes[&leader];
                    match &node.raft {
                        Some(r) if r.term() == term && r.is_leader() => {
                            if node.applied >= index {
                                self.check_all_logs();
                                return;
                            }
                        }
                        _ => marker = None,
                    }
                }
            }
        }
        let leaders: Vec<String> = self
            .nodes
            .values()
            .filter_map(|n| n.raft.as_ref().map(|r| format!("{r:?}")))
            .collect();
        self.checker.violations.push(Violation {
            invariant: "liveness",
            detail: format!(
                "no new entry committed within {} ms after healing; nodes: {}",
                self.cfg.liveness_budget_us / 1000,
                leaders.join(", ")
            ),
        });
    }
}

fn encode_snapshot(applied: Index, digest: u64, locks: &[u8], padding: usize) -> Bytes {
    let mut data = Vec::with_capacity(24 + locks.len() + padding);
    data.extend_from_slice(&applied.to_le_bytes());
    data.extend_from_slice(&digest.to_le_bytes());
    data.extend_from_slice(&(locks.len() as u64).to_le_bytes());
    data.extend_from_slice(locks);
    data.extend((0..padding).map(|i| (i as u64 ^ applied) as u8));
    Bytes::from(data)
}

fn decode_snapshot(data: &[u8], padding: usize) -> Option<(Index, u64, Vec<u8>)> {
    let applied = u64::from_le_bytes(data.get(0..8)?.try_into().ok()?);
    let digest = u64::from_le_bytes(data.get(8..16)?.try_into().ok()?);
    let len = u64::from_le_bytes(data.get(16..24)?.try_into().ok()?) as usize;
    let locks = data.get(24..24usize.checked_add(len)?)?.to_vec();
    let rest = &data[24 + len..];
    let padding_ok = rest.len() == padding
        && rest
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i as u64 ^ applied) as u8);
    padding_ok.then_some((applied, digest, locks))
}

fn liveness_marker() -> Command {
    Command::Put {
        key: "liveness".into(),
        value: b"ok".to_vec(),
        guard: None,
        client_id: "simulator".into(),
        request_id: String::new(),
    }
}

/// Small limits so the simulator exercises queue bounds and dedupe eviction.
fn sim_lock_limits() -> Limits {
    Limits {
        waiters_per_key_max: 3,
        dedupe_entries_max: 48,
        ..Limits::default()
    }
}

/// Leader bookkeeping in simulated time: lease deadlines and wait timeouts.
fn track_leases(
    node: &mut SimNode,
    now_us: u64,
    command: &Command,
    applied: &crate::lock::Applied,
) {
    let grant = |key: &str, token: u64, ttl_ms: u64, leases: &mut BTreeMap<String, (u64, u64)>| {
        leases.insert(key.to_string(), (token, now_us + ttl_ms * 1000));
    };
    match (command, &applied.outcome) {
        (Command::Acquire { .. }, Outcome::Granted { token, ttl_ms })
        | (Command::Renew { .. }, Outcome::Renewed { token, ttl_ms }) => {
            grant(&token.key, token.value, *ttl_ms, &mut node.leases)
        }
        (
            Command::Acquire {
                key,
                client_id,
                request_id,
                wait_timeout_ms: Some(ms),
                ..
            },
            Outcome::Queued { .. },
        ) => {
            node.wait_deadlines.insert(
                (client_id.clone(), request_id.clone()),
                (key.clone(), now_us + ms * 1000),
            );
        }
        (Command::Release { key, .. }, Outcome::Released) => {
            node.leases.remove(key);
        }
        _ => {}
    }
    for event in &applied.events {
        match event {
            Event::Granted {
                client_id,
                request_id,
                token,
                ttl_ms,
            } => {
                node.wait_deadlines
                    .remove(&(client_id.clone(), request_id.clone()));
                grant(&token.key, token.value, *ttl_ms, &mut node.leases);
            }
            Event::Expired { token, .. } => {
                node.leases.remove(&token.key);
            }
            Event::WaiterRemoved {
                client_id,
                request_id,
                ..
            } => {
                node.wait_deadlines
                    .remove(&(client_id.clone(), request_id.clone()));
            }
        }
    }
}
