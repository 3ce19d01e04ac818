//! One simulated cluster run: every node is the node lock-node runs ([`NodeCore`]) on
//! crash-modelling in-memory storage, with its own drifting clock, behind a faulty network, under
//! a fault schedule and client traffic, all driven from one seed.
//!
//! ```text
//!   seed ─► rng ─► fault schedule ─────────────────┐
//!                  clients (own clocks, histories) │
//!                     │ requests / answers          ▼
//!   event loop: earliest of (peer message, client message, node tick, client timer)
//!                     │
//!                     ▼
//!           NodeCore<MemStorage> (the node's own code) ─► effects ─► network, clients
//!                     │
//!                     └─► observations ─► checkers (after every step, and over histories)
//! ```
//! A crash can strike inside a flush ([`MemStorage::arm_power_cut`]): the node has sent the
//! messages that may leave before the flush and loses everything unflushed, exactly as lock-node
//! would on a power cut.

use std::collections::{BTreeMap, BTreeSet};

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::checker::{fnv, Checker, Violation};
use super::clients::{ReplyTo, SimClients};
use super::locks::LockChecker;
use super::network::{Network, NetworkFaults};
use crate::lock::{Limits, LockStateMachine, CLUSTER_VERSION};
use crate::node::api::{ClientOp, ClientReply};
use crate::node::lifecycle::{JoinOutcome, PeerAnswer, StartDecision};
use crate::node::{Effect, NodeCore, NodeSettings, Observation};
use crate::raft::{Config, Index, InitialState, Membership, Message, NodeId, Raft, Term};
use crate::storage::{MemStorage, SimDiskStats, SimSegmentsStorage, Storage, StorageError};

/// What one simulation run does.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    /// Initial voters (1–7).
    pub nodes: usize,
    /// Events (message deliveries and ticks) before the final liveness phase.
    pub steps: u64,
    pub pre_vote: bool,
    /// A node resuming from a pause handles the client requests that waited for it before the
    /// peer messages that did (a real event loop may find either socket ready first). With it,
    /// a leader deposed while it was stopped sees its clients' requests before it learns of the
    /// new term: a targeted schedule for read bugs.
    pub clients_first_on_resume: bool,
    /// Replace the random fault table with the targeted Figure 8 schedule of the Raft paper
    /// (§5.4.2), repeated for the whole run: a leader and one follower are cut off while the
    /// leader appends an entry; the other nodes elect a rival, cut off the moment it wins (its
    /// no-op stays on it alone); the stranded pair and one more node elect a third leader, which
    /// crashes — its messages in flight lost — the moment it advances its commit index; the
    /// rival, the third node and the last node may then elect a leader. The network's loss,
    /// duplication and delay stay on; no pauses, membership changes or transfers. Needs exactly
    /// 5 nodes: with any other number it injects nothing beyond the network's faults.
    pub figure8: bool,
    /// Inject partitions, crashes, loss, duplication and delay.
    pub faults: bool,
    /// Add learners, promote them, remove followers and leaders.
    pub membership_changes: bool,
    /// Take a snapshot and compact the log every this many applied entries.
    pub snapshot_every: u64,
    /// Write the applied state at most this often (simulated µs), as lock-node writes it behind
    /// the log: a crash then loses applied state that the restarted node rebuilds by
    /// re-applying committed entries.
    pub applied_write_interval_us: u64,
    /// Simulated time allowed after healing for a leader to commit a new entry.
    pub liveness_budget_us: u64,
    /// Multiplies the crash rate (1 = default).
    pub crash_intensity: u32,
    /// Print elections, votes and membership changes to stderr (for replaying one seed).
    pub trace: bool,
    /// Flushes complete in the background, as lock-node's do: a node goes on taking and
    /// writing Readies while its disk works, and its flushes complete some events later (at
    /// random after each of its steps, and at its next tick at the latest); a crash loses
    /// every flush not done.
    pub background_flushes: bool,
    /// Lifecycle faults (drawn from a stream of their own, so the other faults' schedule
    /// stays as it was up to the first of them): every node stopped and started at once, and a
    /// node's storage wiped, after which it starts as a new incarnation through the same
    /// start decision lock-node makes (node 1, the bootstrap node, asks its peers; every other
    /// node joins).
    pub lifecycle: bool,
    /// Every node keeps its Raft log in the segments engine's own code on a simulated disk
    /// ([`SimSegmentsStorage`]) instead of [`MemStorage`]: a crash is a power cut that may tear
    /// the last unsynced write, and now and then (see `corrupt_sector_ppm`) a synced sector
    /// goes bad.
    pub segments_disk: bool,
    /// With `segments_disk` and lifecycle faults: the chance per event, in parts per million,
    /// that a member whose peers hold every committed entry crashes with a damaged synced
    /// sector in its log (found at its restart, which then treats the disk as lost).
    pub corrupt_sector_ppm: u32,
    #[cfg(test)]
    pub bugs: crate::raft::config::Bugs,
    #[cfg(any(test, feature = "mutations"))]
    pub node_bugs: crate::node::NodeBugs,
}

impl SimConfig {
    pub fn new(seed: u64, nodes: usize) -> Self {
        SimConfig {
            seed,
            nodes,
            steps: 4_000,
            pre_vote: true,
            clients_first_on_resume: false,
            figure8: false,
            faults: true,
            membership_changes: true,
            snapshot_every: 48,
            applied_write_interval_us: 30_000,
            liveness_budget_us: 5_000_000,
            crash_intensity: 1,
            trace: false,
            background_flushes: false,
            lifecycle: true,
            segments_disk: false,
            corrupt_sector_ppm: 400,
            #[cfg(test)]
            bugs: Default::default(),
            #[cfg(any(test, feature = "mutations"))]
            node_bugs: Default::default(),
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
    pub transfers: u64,
    pub grants: u64,
    pub expiries: u64,
    pub pauses: u64,
    pub history_ops: u64,
    pub beliefs_checked: u64,
    pub reads_checked: u64,
    pub lin_checked: u64,
    pub lin_unchecked: u64,
    pub client_expiries: u64,
    pub redirects: u64,
    pub client_retries: u64,
    pub ticks: u64,
    pub acknowledging: u64,
    pub acknowledged_refusals: u64,
    /// Readies written while an earlier one's flush was still running (background flushes).
    pub overlapped_readies: u64,
    /// Members up at the end of a run that applied everything committed, and those of them
    /// whose applied state had the cluster version raised to `CLUSTER_VERSION` (the leader
    /// raises it once every member said it runs it, and every simulated member does).
    pub nodes_up: u64,
    pub nodes_at_version: u64,
    /// Lifecycle faults: every node stopped and started at once; a node's storage wiped (and
    /// how many of those were the bootstrap node with its peers down); the starts a node with
    /// an empty disk put off because a peer did not answer; members replaced by a new
    /// incarnation; nodes admitted after asking to join.
    pub restarts_all: u64,
    pub wipes: u64,
    pub wipes_bootstrap_alone: u64,
    pub bootstrap_waits: u64,
    pub replacements: u64,
    pub joins: u64,
    /// The simulated disks (`segments_disk`): power cuts, power cuts that tore a write, synced
    /// sectors damaged, and restarts that found the damage and took the disk for lost.
    pub power_cuts: u64,
    pub torn_writes: u64,
    pub corrupt_sectors: u64,
    pub damaged_disks: u64,
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
        self.transfers += other.transfers;
        self.grants += other.grants;
        self.expiries += other.expiries;
        self.pauses += other.pauses;
        self.history_ops += other.history_ops;
        self.beliefs_checked += other.beliefs_checked;
        self.reads_checked += other.reads_checked;
        self.lin_checked += other.lin_checked;
        self.lin_unchecked += other.lin_unchecked;
        self.client_expiries += other.client_expiries;
        self.redirects += other.redirects;
        self.client_retries += other.client_retries;
        self.ticks += other.ticks;
        self.acknowledging += other.acknowledging;
        self.acknowledged_refusals += other.acknowledged_refusals;
        self.overlapped_readies += other.overlapped_readies;
        self.nodes_up += other.nodes_up;
        self.nodes_at_version += other.nodes_at_version;
        self.restarts_all += other.restarts_all;
        self.wipes += other.wipes;
        self.wipes_bootstrap_alone += other.wipes_bootstrap_alone;
        self.bootstrap_waits += other.bootstrap_waits;
        self.replacements += other.replacements;
        self.joins += other.joins;
        self.power_cuts += other.power_cuts;
        self.torn_writes += other.torn_writes;
        self.corrupt_sectors += other.corrupt_sectors;
        self.damaged_disks += other.damaged_disks;
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

type Core = NodeCore<SimStore, ReplyTo>;

/// A node's disk: [`MemStorage`], or the segments engine on a simulated disk
/// ([`SimConfig::segments_disk`]). One per simulated node, made at its start and moved only
/// with it: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum SimStore {
    Mem(MemStorage),
    Segments(Box<SimSegmentsStorage>),
}

/// Calls the same method on whichever store it is.
macro_rules! each_store {
    ($store:expr, $s:ident => $call:expr) => {
        match $store {
            SimStore::Mem($s) => $call,
            SimStore::Segments($s) => $call,
        }
    };
}

impl SimStore {
    fn new(segments: bool, seed: u64) -> Self {
        if segments {
            SimStore::Segments(Box::new(SimSegmentsStorage::new(seed)))
        } else {
            SimStore::Mem(MemStorage::new())
        }
    }

    fn set_background_flushes(&mut self, on: bool) {
        each_store!(self, s => s.set_background_flushes(on))
    }

    fn has_pending_flushes(&self) -> bool {
        each_store!(self, s => s.has_pending_flushes())
    }

    fn complete_flushes(&mut self) {
        each_store!(self, s => s.complete_flushes())
    }

    fn arm_power_cut(&mut self, on_vote_only: bool) {
        each_store!(self, s => s.arm_power_cut(on_vote_only))
    }

    fn disarm_power_cut(&mut self) {
        each_store!(self, s => s.disarm_power_cut())
    }

    fn crash(&mut self) {
        each_store!(self, s => s.crash())
    }

    fn disk_stats(&self) -> SimDiskStats {
        match self {
            SimStore::Mem(_) => SimDiskStats::default(),
            SimStore::Segments(s) => s.disk_stats(),
        }
    }
}

impl Storage for SimStore {
    fn recover(&self) -> Result<crate::storage::RecoveredState, StorageError> {
        each_store!(self, s => s.recover())
    }
    fn append(&mut self, entries: &[crate::raft::Entry]) -> Result<(), StorageError> {
        each_store!(self, s => s.append(entries))
    }
    fn set_hard_state(&mut self, hard_state: crate::raft::HardState) -> Result<(), StorageError> {
        each_store!(self, s => s.set_hard_state(hard_state))
    }
    fn apply(
        &mut self,
        applied_index: Index,
        changes: &[crate::storage::KvChange],
    ) -> Result<(), StorageError> {
        each_store!(self, s => s.apply(applied_index, changes))
    }
    fn install_snapshot(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &[u8],
    ) -> Result<(), StorageError> {
        each_store!(self, s => s.install_snapshot(meta, data))
    }
    fn begin_install(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        each_store!(self, s => s.begin_install(meta, data))
    }
    fn begin_install_staged(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        each_store!(self, s => s.begin_install_staged(meta, data))
    }
    fn continue_install(&mut self, max_pairs: usize) -> Result<bool, StorageError> {
        each_store!(self, s => s.continue_install(max_pairs))
    }
    fn begin_snapshot(&mut self, meta: &crate::raft::SnapshotMeta) -> Result<(), StorageError> {
        each_store!(self, s => s.begin_snapshot(meta))
    }
    fn write_snapshot_chunk(&mut self, offset: u64, chunk: &[u8]) -> Result<(), StorageError> {
        each_store!(self, s => s.write_snapshot_chunk(offset, chunk))
    }
    fn finish_snapshot(&mut self) -> Result<crate::raft::SnapshotMeta, StorageError> {
        each_store!(self, s => s.finish_snapshot())
    }
    fn build_snapshot(&self) -> Result<crate::raft::Snapshot, StorageError> {
        each_store!(self, s => s.build_snapshot())
    }
    fn snapshot_job(&self) -> Result<crate::storage::SnapshotJob, StorageError> {
        each_store!(self, s => s.snapshot_job())
    }
    fn snapshot_job_with(
        &self,
        convert: crate::storage::PairsConvert,
    ) -> Result<crate::storage::SnapshotJob, StorageError> {
        each_store!(self, s => s.snapshot_job_with(convert))
    }
    fn compact(&mut self, upto: Index) -> Result<(), StorageError> {
        each_store!(self, s => s.compact(upto))
    }
    fn entries(&self, lo: Index, hi: Index) -> Result<Vec<crate::raft::Entry>, StorageError> {
        each_store!(self, s => s.entries(lo, hi))
    }
    fn term(&self, index: Index) -> Result<Term, StorageError> {
        each_store!(self, s => s.term(index))
    }
    fn first_index(&self) -> Index {
        each_store!(self, s => s.first_index())
    }
    fn last_index(&self) -> Index {
        each_store!(self, s => s.last_index())
    }
    fn applied_index(&self) -> Index {
        each_store!(self, s => s.applied_index())
    }
    fn flush(&mut self) -> Result<(), StorageError> {
        each_store!(self, s => s.flush())
    }
    fn start_flush(&mut self) -> Result<u64, StorageError> {
        each_store!(self, s => s.start_flush())
    }
    fn flushed(&mut self) -> Result<u64, StorageError> {
        each_store!(self, s => s.flushed())
    }
    fn wait_flushed(&mut self) -> Result<(), StorageError> {
        each_store!(self, s => s.wait_flushed())
    }
}

/// Largest drift of a node's clock from real time, in parts per million.
pub const NODE_DRIFT_PPM: i64 = 5_000;

#[derive(Clone, Copy, Debug)]
enum Action {
    Partition,
    Heal,
    Crash,
    Restart,
    Pause,
    Membership,
    Transfer,
}

/// A message between a client and a node.
enum ClientMsg {
    Request(NodeId, ClientOp, ReplyTo),
    Answer(ReplyTo, ClientReply),
}

/// The client id the liveness marker is answered to.
const MARKER_CLIENT: usize = usize::MAX;

/// The client id of the proposals the Figure 8 schedule makes; their answers are dropped.
const SCHEDULE_CLIENT: usize = usize::MAX - 1;

/// Simulated time a phase of the Figure 8 schedule may take before the round is given up.
const FIGURE8_PHASE_US: u64 = 1_500_000;

/// Where the Figure 8 schedule ([`SimConfig::figure8`]) stands. Node names follow the round:
/// the `leader` and its `peer` are stranded, the `rival` wins among the rest, the `third` joins
/// the stranded pair to elect the recounting leader, and the `lone` node waits apart.
#[derive(Clone, Debug)]
enum Figure8 {
    /// Everything healed and restarted: waiting for a leader whose whole log every node holds.
    Settle { since: u64 },
    /// The leader and its peer are cut off from the rest; a proposal made to the leader must
    /// reach the peer.
    Stranded {
        leader: NodeId,
        peer: NodeId,
        term: Term,
        base: Index,
        since: u64,
    },
    /// The rest elect a leader, cut off the moment it wins.
    Rival {
        pair: [NodeId; 2],
        rest: Vec<NodeId>,
        term: Term,
        since: u64,
    },
    /// The rival is cut off with its no-op; the pair and the third node elect a leader, which
    /// crashes the moment it advances its commit index.
    Recount {
        pair: [NodeId; 2],
        third: NodeId,
        rival: NodeId,
        lone: NodeId,
        rival_term: Term,
        since: u64,
    },
    /// The recounting leader is down; the rival, the third and the lone node may elect a leader
    /// while the pair's other node is cut off.
    Return {
        group: [NodeId; 3],
        term: Term,
        since: u64,
    },
}

struct SimNode {
    id: NodeId,
    core: Option<Core>,
    /// The disk while the node is down.
    disk: Option<SimStore>,
    initial_membership: Membership,
    tick_us: u64,
    next_tick_us: u64,
    drift_ppm: i64,
    /// SIGSTOP: nothing runs until then; messages wait in `inbox`.
    paused_until: u64,
    /// A snapshot job's result not handed back yet: the job "runs on another thread" for a
    /// while, so that applies go on meanwhile and the node holds its state writes back.
    snapshot_result: Option<Result<crate::raft::Snapshot, StorageError>>,
    inbox: Vec<Message>,
    client_inbox: Vec<(ClientOp, ReplyTo)>,
    /// Removed from the cluster: keeps running until then, then shut down for good.
    retire_at: Option<u64>,
    decommissioned: bool,
    last_commit: u64,
    /// Next index this node must apply (apply order check).
    next_apply: u64,
    /// Applied index at which this node's lock state was last compared with the replicas'.
    state_checked_at: u64,
    /// The random id of this node's current disk (a wiped disk gets a new one).
    incarnation: u64,
    /// A node started on a wiped disk that asked to join and was not accepted yet.
    joining: bool,
    /// Kept with the disk, as lock-node keeps its mark in the data directory: the node runs on
    /// a wiped disk and its log has not yet held the entry that admitted its new incarnation.
    awaiting_admission: bool,
    /// The bootstrap node on a wiped disk that has not decided how to start (it waits while
    /// a peer does not answer).
    undecided: bool,
}

impl SimNode {
    fn local(&self, real: u64) -> u64 {
        (real as i128 * (1_000_000 + self.drift_ppm as i128) / 1_000_000) as u64
    }

    fn paused(&self, now: u64) -> bool {
        self.paused_until > now
    }
}

pub struct Cluster {
    cfg: SimConfig,
    rng: ChaCha8Rng,
    now_us: u64,
    nodes: BTreeMap<NodeId, SimNode>,
    network: Network,
    client_net: BTreeMap<(u64, u64), ClientMsg>,
    client_seq: u64,
    client_drop_ppm: u32,
    checker: Checker,
    stats: SimStats,
    next_node_id: NodeId,
    min_voters: usize,
    max_inflight_appends: usize,
    max_batch_bytes: usize,
    /// Small in some seeds, so that a leader cut off from its quorum refuses proposals (`BUSY`),
    /// its own expiries included.
    max_uncommitted_entries: usize,
    clients: SimClients,
    locks: LockChecker,
    healed_at: Option<u64>,
    marker_done: bool,
    /// Digest of the lock state at an applied index: replicas must agree.
    lock_state_at: BTreeMap<u64, u64>,
    /// Log index each `Put` value committed at (first apply).
    write_index: BTreeMap<Vec<u8>, u64>,
    /// The Figure 8 schedule's phase (unused unless `cfg.figure8`).
    figure8: Figure8,
    figure8_rounds: u64,
    /// Draws the lifecycle faults (see [`SimConfig::lifecycle`]).
    lifecycle_rng: ChaCha8Rng,
    /// The cluster ids seen in any node's state: one per run.
    cluster_ids: BTreeSet<u128>,
    /// Seeds the simulated disks and draws their damage (`segments_disk`).
    disk_rng: ChaCha8Rng,
    /// What the disks that were replaced (wiped) had counted.
    retired_disks: SimDiskStats,
}

const MAX_MEMBERS: usize = 7;
/// The node that may start a cluster on an empty disk (lock-node's `--bootstrap-id`).
const BOOTSTRAP_ID: NodeId = 1;

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
                // Now and then longer than an election timeout.
                long_delay_us_max: 400_000,
            }
        } else {
            NetworkFaults::calm()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let max_inflight_appends = *[1, 2, 4, 16].choose(&mut rng).expect("non-empty");
        let max_batch_bytes = *[1, 100, 512, 4096].choose(&mut rng).expect("non-empty");
        let max_uncommitted_entries = *[6, 24, 100_000].choose(&mut rng).expect("non-empty");
        let lifecycle_rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x6c69_6665_6379_636c);
        let disk_rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x6469_736b_7365_6773);
        let mut clients = SimClients::new(4, 3, 1, &mut rng);
        clients.trace = cfg.trace;
        let mut cluster = Cluster {
            clients,
            locks: LockChecker::default(),
            lock_state_at: BTreeMap::new(),
            write_index: BTreeMap::new(),
            figure8: Figure8::Settle { since: 0 },
            figure8_rounds: 0,
            lifecycle_rng,
            cluster_ids: BTreeSet::new(),
            disk_rng,
            retired_disks: SimDiskStats::default(),
            healed_at: None,
            marker_done: false,
            max_inflight_appends,
            max_batch_bytes,
            max_uncommitted_entries,
            rng,
            now_us: 0,
            nodes: BTreeMap::new(),
            network: Network::new(faults),
            client_net: BTreeMap::new(),
            client_seq: 0,
            client_drop_ppm: if cfg.faults { 20_000 } else { 0 },
            checker: Checker::default(),
            stats: SimStats::default(),
            next_node_id: nodes_count + 1,
            min_voters: (nodes_count as usize).min(3),
            cfg,
        };
        let membership = Membership::with_voters(1..=nodes_count);
        for id in 1..=nodes_count {
            cluster.add_node(id, membership.clone());
        }
        cluster
    }

    /// An empty disk of the kind the run uses.
    fn new_disk(&mut self) -> SimStore {
        let seed = if self.cfg.segments_disk {
            self.disk_rng.random()
        } else {
            0
        };
        SimStore::new(self.cfg.segments_disk, seed)
    }

    fn add_node(&mut self, id: NodeId, initial_membership: Membership) {
        let disk = self.new_disk();
        let tick_us = self.rng.random_range(8_000..=12_000);
        let node = SimNode {
            id,
            core: None,
            disk: Some(disk),
            initial_membership,
            tick_us,
            next_tick_us: self.now_us + self.rng.random_range(0..tick_us),
            drift_ppm: self.rng.random_range(-NODE_DRIFT_PPM..=NODE_DRIFT_PPM),
            paused_until: 0,
            snapshot_result: None,
            inbox: Vec::new(),
            client_inbox: Vec::new(),
            retire_at: None,
            decommissioned: false,
            last_commit: 0,
            next_apply: 0,
            state_checked_at: 0,
            incarnation: self.lifecycle_rng.random::<u64>().max(1),
            joining: false,
            awaiting_admission: false,
            undecided: false,
        };
        self.nodes.insert(id, node);
        self.start_node(id);
    }

    fn raft_config(&self, id: NodeId, incarnation_seed: u64) -> Config {
        let mut cfg = Config::new(id, incarnation_seed);
        cfg.pre_vote = self.cfg.pre_vote;
        cfg.max_inflight_appends = self.max_inflight_appends;
        cfg.max_batch_bytes = self.max_batch_bytes;
        // Half of what the count bound allows, so that with full-size appends the byte bound
        // is the one that holds (derived, not drawn: the seeds' schedules stay as they were).
        cfg.max_inflight_bytes =
            (self.max_batch_bytes * self.max_inflight_appends / 2).max(self.max_batch_bytes);
        cfg.max_apply_bytes = self.max_batch_bytes * 4;
        cfg.max_uncommitted_entries = self.max_uncommitted_entries;
        cfg.snapshot_chunk_bytes = 512;
        #[cfg(test)]
        {
            cfg.bugs = self.cfg.bugs;
        }
        cfg
    }

    fn node_settings(&self, id: NodeId) -> NodeSettings {
        let incarnation = self.nodes.get(&id).map_or(0, |n| n.incarnation);
        NodeSettings {
            identity: crate::lock::MemberInfo {
                peer_addr: format!("sim-{id}:peer"),
                client_addr: format!("sim-{id}:client"),
                incarnation,
            },
            // Different for every node and disk, the same in every replay of the seed.
            new_cluster_id: (u128::from(self.cfg.seed) << 64 | u128::from(incarnation)).max(1),
            forced_by: String::new(),
            dead_member_us: None,
            min_voters: 3,
            snapshot_entries: self.cfg.snapshot_every,
            snapshot_bytes: u64::MAX,
            waiter_reclaim_us: 500_000,
            applied_write_interval_us: self.cfg.applied_write_interval_us,
            // Small, so that changes held during a (delayed) snapshot job form several segments.
            applied_write_max_keys: 8,
            // Small, so that a new leader's walk over the locks spans several ticks.
            rebuild_keys_per_tick: 4,
            snapshot_hold_max_keys: 64,
            housekeeping_retry_us: 200_000,
            session_tick_us: 1_000_000,
            readies_per_drive: 1,
            // Small, so that a snapshot's install spans several drives, with messages,
            // ticks and crashes between them.
            install_slice_keys: 2,
            // Two of the simulator's 512-byte chunks: an arriving snapshot is flushed in
            // parts during its transfer, with crashes between them.
            staged_bytes_per_flush: 1024,
            configured_limits: Some(sim_lock_limits()),
            // Per-identity quotas on (each simulated client is an identity of its own) with
            // generous bounds: the accounting runs under every fault; the checker compares it
            // with a recount of the state.
            configured_quotas: Some(crate::lock::Quotas {
                by_identity: true,
                ..crate::lock::Quotas::default()
            }),
            observe_log: true,
            observe_lock_events: true,
            #[cfg(any(test, feature = "mutations"))]
            bugs: self.cfg.node_bugs,
        }
    }

    /// Starts (or restarts) a node from its disk, as lock-node starts: recover, rebuild the
    /// state machine from the applied state, build Raft from the log.
    fn start_node(&mut self, id: NodeId) {
        let incarnation_seed = self.rng.random();
        let raft_cfg = self.raft_config(id, incarnation_seed);
        let settings = self.node_settings(id);
        let now = self.now_us;
        let node = self.nodes.get_mut(&id).expect("node exists");
        let Some(mut storage) = node.disk.take() else {
            self.checker.violations.push(Violation {
                invariant: "restart",
                detail: format!("node {id} has no disk to start from"),
            });
            return;
        };
        if matches!(&storage, SimStore::Segments(s) if s.log_damaged()) {
            // A damaged sector below the log's synced mark: the node must not open, and is
            // rebuilt from the cluster on an empty disk (a corrupt sector is only injected
            // where the other members hold every committed entry).
            node.disk = Some(storage);
            self.stats.damaged_disks += 1;
            if self.cfg.trace {
                eprintln!(
                    "t={} node {id}'s log is damaged below its synced mark: its disk is lost",
                    self.now_us
                );
            }
            let incarnation = self.disk_rng.random::<u64>().max(1);
            self.lose_disk(id, incarnation, false);
            return;
        }
        storage.set_background_flushes(self.cfg.background_flushes);
        let started = (|| -> Result<Core, String> {
            let recovered = storage.recover().map_err(|e| e.to_string())?;
            let fresh = recovered.last_index() == 0 && recovered.hard_state.term == 0;
            let snapshot = crate::node::recovered_snapshot(&recovered.snapshot_meta);
            // Until the first leader's `SetLimits` applies, every replica uses the defaults.
            let sm = LockStateMachine::from_kv_with_limits(
                recovered.applied_state.clone(),
                Limits::default(),
            )
            .map_err(|e| e.to_string())?;
            let initial = InitialState {
                hard_state: recovered.hard_state,
                snapshot,
                entries: recovered.entries,
                applied: recovered.applied_index,
                initial_membership: if fresh {
                    node.initial_membership.clone()
                } else {
                    Membership::default()
                },
            };
            let raft = Raft::new(raft_cfg, initial).map_err(|e| e.to_string())?;
            let mut core = NodeCore::new(raft, storage, sm, settings, node.local(now));
            core.set_joining(node.joining);
            core.set_awaiting_admission(node.awaiting_admission);
            Ok(core)
        })();
        match started {
            Ok(core) => {
                let term = core.raft().term();
                node.last_commit = core.raft().commit_index();
                node.next_apply = core.raft().applied_index() + 1;
                node.core = Some(core);
                node.snapshot_result = None;
                node.paused_until = 0;
                node.inbox.clear();
                node.client_inbox.clear();
                self.checker.on_restart(id, term);
            }
            Err(err) => self.checker.violations.push(Violation {
                invariant: "restart",
                detail: format!("node {id} cannot restart from its disk: {err}"),
            }),
        }
    }

    fn crash_node(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if let Some(core) = node.core.take() {
            self.stats.elections += core.raft().stats().elections_started;
            self.stats.overlapped_readies += core.overlapped_readies();
            self.stats.crashes += 1;
            let mut disk = core.into_storage();
            disk.crash();
            node.disk = Some(disk);
        }
        node.inbox.clear();
        node.client_inbox.clear();
        node.paused_until = 0;
    }

    fn alive_ids(&self) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.core.is_some())
            .map(|(&id, _)| id)
            .collect()
    }

    fn all_ids(&self) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| !n.decommissioned)
            .map(|(&id, _)| id)
            .collect()
    }

    fn leader(&self) -> Option<NodeId> {
        self.nodes
            .iter()
            .filter_map(|(&id, n)| {
                n.core
                    .as_ref()
                    .map(|c| c.raft())
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

    fn collect_violations(&mut self) {
        self.checker.violations.append(&mut self.locks.violations);
        self.checker.violations.append(&mut self.clients.violations);
    }

    /// Processes the earliest event; false if nothing can ever happen again.
    fn process_next_event(&mut self) -> bool {
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

    fn deliver(&mut self) {
        let Some(Some(msg)) = self.network.pop() else {
            return;
        };
        let now = self.now_us;
        let to = msg.to;
        let Some(node) = self.nodes.get_mut(&to) else {
            return;
        };
        if node.core.is_none() {
            return;
        }
        if node.paused(now) {
            node.inbox.push(msg);
            return;
        }
        if matches!(
            msg.body,
            crate::raft::MessageBody::InstallSnapshot { offset: 0, .. }
        ) {
            self.stats.snapshots_sent += 1;
        }
        let local = node.local(now);
        // What its stream's hello would say of the sender: its addresses and incarnation.
        let said = self
            .nodes
            .get(&msg.from)
            .map(|n| sim_identity(msg.from, n.incarnation));
        let node = self.nodes.get_mut(&to).expect("exists");
        let core = node.core.as_mut().expect("alive");
        if let Some(info) = said {
            core.peer_info(msg.from, info);
        }
        // Every simulated member runs this RaftLock: its stream would say so (the shell's
        // `x-raftlock-version` header), so the leader raises the cluster version early in a run.
        core.peer_version(msg.from, CLUSTER_VERSION);
        core.step(local, msg);
        let result = core.drive();
        self.after_core(to, result);
    }

    fn client_send(&mut self, (node, op, to): (NodeId, ClientOp, ReplyTo)) {
        self.push_client_msg(ClientMsg::Request(node, op, to));
    }

    fn push_client_msg(&mut self, msg: ClientMsg) {
        if self.healed_at.is_none() && self.rng.random_range(0..1_000_000u32) < self.client_drop_ppm
        {
            return;
        }
        let delay = self.rng.random_range(100..3_000);
        self.client_seq += 1;
        self.client_net
            .insert((self.now_us + delay, self.client_seq), msg);
    }

    fn deliver_client_msg(&mut self) {
        let Some((_, msg)) = self.client_net.pop_first() else {
            return;
        };
        let now = self.now_us;
        match msg {
            ClientMsg::Request(id, op, to) => {
                let Some(node) = self.nodes.get_mut(&id) else {
                    return;
                };
                if node.core.is_none() {
                    return; // connection refused: the client times out
                }
                if node.paused(now) {
                    node.client_inbox.push((op, to));
                    return;
                }
                let local = node.local(now);
                let core = node.core.as_mut().expect("alive");
                core.client_request(local, op, to.client as u64, to);
                let result = core.drive();
                self.after_core(id, result);
            }
            ClientMsg::Answer(to, reply) => {
                if to.client == SCHEDULE_CLIENT {
                    return;
                }
                if to.client == MARKER_CLIENT {
                    if matches!(reply, ClientReply::Stored) {
                        self.marker_done = true;
                    }
                    return;
                }
                let nodes = self.all_ids();
                if let Some(send) = self.clients.on_reply(now, to, reply, &nodes, &mut self.rng) {
                    self.client_send(send);
                }
            }
        }
    }

    /// Carries out a node's effects and runs the per-node checks, one Ready at a time, so that a
    /// crash can strike between two Readies.
    fn after_core(&mut self, id: NodeId, mut result: Result<(), StorageError>) {
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
                // Added again since (a replaced member's new incarnation): it stays.
                let again = self.nodes[&id]
                    .core
                    .as_ref()
                    .is_some_and(|c| c.raft().membership().contains(gone));
                if let Some(node) = self.nodes.get_mut(&gone).filter(|_| !again) {
                    // Not the new incarnation of a replaced member, still asking to join.
                    if node.retire_at.is_none()
                        && !node.decommissioned
                        && !node.joining
                        && !node.undecided
                    {
                        node.retire_at = Some(self.now_us + delay);
                    }
                }
            }
            _ => {}
        }
    }

    /// Commit monotonicity, commit bookkeeping, replica state, and the adversarial crash of a
    /// leader right after it advanced its commit index.
    fn after_drive_checks(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let Some(core) = node.core.as_ref() else {
            return;
        };
        let raft = core.raft();
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
        let sm = core.state_machine();
        let applied = sm.applied_index();
        // Compared once per newly reached applied index, not after every Ready.
        if applied > 0 && applied != node.state_checked_at {
            node.state_checked_at = applied;
            let digest = fnv(&sm.snapshot());
            match self.lock_state_at.get(&applied) {
                Some(&seen) if seen != digest => {
                    self.checker.violations.push(Violation {
                        invariant: "replica lock state",
                        detail: format!("node {id} lock state differs at applied index {applied}"),
                    });
                    return;
                }
                Some(_) => {}
                None => {
                    self.lock_state_at.insert(applied, digest);
                }
            }
            if let Some(detail) = sm.accounting_mismatch() {
                self.checker.violations.push(Violation {
                    invariant: "quota accounting",
                    detail: format!("node {id} at applied index {applied}: {detail}"),
                });
                return;
            }
        }
        if commit > node.last_commit {
            let from = node.last_commit + 1;
            node.last_commit = commit;
            self.checker.on_commit(id, raft, from, commit);
            // Adversarial crash point: a leader dies right after advancing its commit index,
            // before followers learn of it — where commit-rule bugs (Figure 8) do their damage.
            let is_leader = raft.is_leader();
            let term = raft.term();
            if self.cfg.figure8 && self.healed_at.is_none() && is_leader {
                self.figure8_on_commit(id, term);
            } else if self.cfg.faults
                && self.healed_at.is_none()
                && is_leader
                && self.rng.random_range(0..1_000_000u32) < 20_000 * self.cfg.crash_intensity
            {
                self.crash_node(id);
            }
        }
    }

    // ----- faults ----------------------------------------------------------------------------

    /// Draws at most one fault for this step. Weights are per million steps.
    fn inject(&mut self) {
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

    // ----- lifecycle faults --------------------------------------------------------------------

    fn inject_lifecycle(&mut self) {
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
    fn wipe_random(&mut self) {
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
    fn lose_disk(&mut self, id: NodeId, incarnation: u64, alone: bool) {
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
    fn start_or_decide(&mut self, id: NodeId) {
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
    fn ask_to_join(&mut self, id: NodeId) {
        let Some(leader) = self.leader() else { return };
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

    /// A node started on a wiped disk that is not a member again yet.
    fn volume_on_its_way_back(&self) -> bool {
        self.nodes.values().any(|n| n.joining || n.undecided)
    }

    /// The configuration as node `id` (running) sees it.
    fn membership_of(&self, id: NodeId) -> Membership {
        self.nodes[&id]
            .core
            .as_ref()
            .expect("running")
            .raft()
            .membership()
            .clone()
    }

    /// Whether `id` is a member of the current leader's configuration (`None`: no leader).
    fn member_again(&self, id: NodeId) -> Option<bool> {
        let leader = self.leader()?;
        let core = self.nodes[&leader].core.as_ref()?;
        Some(core.raft().membership().contains(id))
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

    fn leader_core(&mut self) -> Option<(NodeId, &mut Core)> {
        let leader = self.leader()?;
        let core = self.nodes.get_mut(&leader)?.core.as_mut()?;
        Some((leader, core))
    }

    fn change_membership(&mut self) {
        let Some(leader) = self.leader() else { return };
        // No operator removes members while a lost volume is still on its way back: that would
        // take the configuration below a majority of intact disks.
        let volume_lost = self.volume_on_its_way_back();
        let membership = self.membership_of(leader);
        let live_members = membership.voters.len() + membership.learners.len();
        let choice = self.rng.random_range(0..3);
        let new_id = self.next_node_id;
        let result = match choice {
            0 if live_members < MAX_MEMBERS && new_id < 64 => {
                let (_, core) = self.leader_core().expect("leader");
                core.join(new_id, sim_identity(new_id, 0))
                    .map(|_| Some(new_id))
                    .map_err(|_| ())
            }
            1 if membership.voters.len() > self.min_voters && !volume_lost => {
                let followers: Vec<NodeId> = membership
                    .voters
                    .iter()
                    .copied()
                    .filter(|&v| v != leader)
                    .collect();
                let Some(&f) = followers.choose(&mut self.rng) else {
                    return;
                };
                let (_, core) = self.leader_core().expect("leader");
                core.remove(f).map(|()| None).map_err(|_| ())
            }
            2 if membership.voters.len() > self.min_voters && !volume_lost => {
                let (_, core) = self.leader_core().expect("leader");
                core.remove(leader).map(|()| None).map_err(|_| ())
            }
            _ => return,
        };
        let Ok(added) = result else { return };
        self.stats.membership_changes += 1;
        if self.cfg.trace {
            eprintln!(
                "t={} leader {leader} changes membership (choice {choice}, added {added:?})",
                self.now_us
            );
        }
        if let Some(id) = added {
            self.next_node_id += 1;
            self.add_node(id, Membership::default());
        }
        let result = self
            .nodes
            .get_mut(&leader)
            .and_then(|n| n.core.as_mut())
            .map(|c| c.drive());
        if let Some(result) = result {
            self.after_core(leader, result);
        }
    }

    fn transfer_leadership(&mut self) {
        let Some((leader, core)) = self.leader_core() else {
            return;
        };
        if core.transfer_leadership().is_some() {
            let result = core.drive();
            self.stats.transfers += 1;
            self.after_core(leader, result);
        }
    }

    // ----- the Figure 8 schedule ------------------------------------------------------------

    /// One step of the Figure 8 schedule: starts a round once the cluster has settled, moves on
    /// once the stranded leader's entry reached its peer, and gives a phase up after
    /// [`FIGURE8_PHASE_US`]. Elections and commits move the other phases
    /// ([`Self::figure8_on_leader`], [`Self::figure8_on_commit`]).
    fn figure8_step(&mut self) {
        let now = self.now_us;
        match self.figure8.clone() {
            Figure8::Settle { since } => self.figure8_start_round(since),
            Figure8::Stranded {
                leader,
                peer,
                term,
                base,
                since,
            } => {
                let reached = self
                    .nodes
                    .get(&peer)
                    .and_then(|n| n.core.as_ref())
                    .is_some_and(|c| c.raft().term_at(base + 1) == Some(term));
                if reached {
                    let rest: Vec<NodeId> = self
                        .all_ids()
                        .into_iter()
                        .filter(|&n| n != leader && n != peer)
                        .collect();
                    self.trace_figure8(format!(
                        "entry {} of term {term} reached peer {peer}; {rest:?} elect a rival",
                        base + 1
                    ));
                    self.figure8 = Figure8::Rival {
                        pair: [leader, peer],
                        rest,
                        term,
                        since: now,
                    };
                } else if now > since + FIGURE8_PHASE_US {
                    self.figure8_settle();
                }
            }
            Figure8::Rival { since, .. }
            | Figure8::Recount { since, .. }
            | Figure8::Return { since, .. } => {
                if now > since + FIGURE8_PHASE_US {
                    self.figure8_settle();
                }
            }
        }
    }

    /// Starts every node that is down (crashed, not removed from the cluster).
    fn restart_down_nodes(&mut self) {
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

    /// Heals the network, restarts every node that is down and waits for the cluster to settle.
    fn figure8_settle(&mut self) {
        self.trace_figure8("settle".into());
        self.network.heal();
        self.restart_down_nodes();
        self.figure8 = Figure8::Settle { since: self.now_us };
    }

    /// Once a leader has led for a while and every node holds its whole, committed log (or after
    /// a second of waiting for that), cuts the leader and one random follower off from the
    /// rest and proposes an entry to the leader.
    fn figure8_start_round(&mut self, settling_since: u64) {
        let now = self.now_us;
        if now < settling_since + 200_000 {
            return;
        }
        let ids = self.all_ids();
        if ids.len() != 5 || self.alive_ids().len() != ids.len() {
            return;
        }
        let Some(leader) = self.leader() else { return };
        let raft = self.nodes[&leader].core.as_ref().expect("leader").raft();
        let (term, base) = (raft.term(), raft.last_index());
        let settled = raft.commit_index() == base
            && ids.iter().all(|id| {
                let r = self.nodes[id].core.as_ref().expect("alive").raft();
                r.last_index() == base && r.term_at(base) == raft.term_at(base)
            });
        if !settled && now < settling_since + 1_000_000 {
            return;
        }
        let followers: Vec<NodeId> = ids.iter().copied().filter(|&n| n != leader).collect();
        let peer = *followers.choose(&mut self.rng).expect("four followers");
        let rest: Vec<NodeId> = followers.into_iter().filter(|&n| n != peer).collect();
        self.network.partition(&[leader, peer], &rest);
        self.stats.partitions += 1;
        self.figure8_rounds += 1;
        let round = self.figure8_rounds;
        self.trace_figure8(format!(
            "round {round}: leader {leader} (term {term}, last index {base}, settled {settled}) stranded with {peer}"
        ));
        let op = ClientOp::Put {
            key: "figure8".into(),
            value: format!("round {round}").into_bytes(),
            guard: None,
            client_id: "simulator-figure8".into(),
            request_id: format!("round-{round}"),
        };
        let to = ReplyTo {
            client: SCHEDULE_CLIENT,
            attempt: 0,
        };
        self.client_send((leader, op, to));
        self.figure8 = Figure8::Stranded {
            leader,
            peer,
            term,
            base,
            since: now,
        };
    }

    /// A node became leader: the rival is cut off the moment it wins (its no-op reaches no one),
    /// and the pair and a random third node may elect the next leader; a leader elected in the
    /// last phase ends the round.
    fn figure8_on_leader(&mut self, id: NodeId, term: Term) {
        let now = self.now_us;
        match self.figure8.clone() {
            Figure8::Rival {
                pair,
                rest,
                term: stranded_term,
                ..
            } if rest.contains(&id) && term > stranded_term => {
                let others: Vec<NodeId> = rest.iter().copied().filter(|&n| n != id).collect();
                let Some(&third) = others.choose(&mut self.rng) else {
                    self.figure8_settle();
                    return;
                };
                let lone: Vec<NodeId> = others.into_iter().filter(|&n| n != third).collect();
                let all = self.all_ids();
                let not_rival: Vec<NodeId> = all.iter().copied().filter(|&n| n != id).collect();
                self.network.heal();
                self.network.partition(&[id], &not_rival);
                self.network.partition(&[pair[0], pair[1], third], &lone);
                self.stats.partitions += 1;
                self.trace_figure8(format!(
                    "rival {id} won term {term} and is cut off; {pair:?} and {third} elect, {lone:?} apart"
                ));
                self.figure8 = Figure8::Recount {
                    pair,
                    third,
                    rival: id,
                    lone: lone.first().copied().unwrap_or(id),
                    rival_term: term,
                    since: now,
                };
            }
            Figure8::Return {
                group,
                term: recount_term,
                ..
            } if group.contains(&id) && term > recount_term => {
                self.trace_figure8(format!("node {id} won term {term} after the recount"));
                self.figure8_settle();
            }
            _ => {}
        }
    }

    /// A leader advanced its commit index: in the recount phase it crashes at once, and the
    /// messages it has in flight are lost with it; the rival, the third and the lone node are
    /// joined, the pair's other node is kept apart.
    fn figure8_on_commit(&mut self, id: NodeId, term: Term) {
        let Figure8::Recount {
            pair,
            third,
            rival,
            lone,
            rival_term,
            ..
        } = self.figure8.clone()
        else {
            return;
        };
        if term <= rival_term || !pair.contains(&id) {
            return;
        }
        let commit = self
            .nodes
            .get(&id)
            .and_then(|n| n.core.as_ref())
            .map_or(0, |c| c.raft().commit_index());
        self.crash_node(id);
        let other = if pair[0] == id { pair[1] } else { pair[0] };
        let all = self.all_ids();
        self.network.heal();
        for cut in [id, other] {
            let rest: Vec<NodeId> = all.iter().copied().filter(|&n| n != cut).collect();
            self.network.partition(&[cut], &rest);
        }
        self.stats.partitions += 1;
        self.trace_figure8(format!(
            "leader {id} of term {term} committed up to {commit} and crashed; {rival}, {third}, {lone} may elect, {other} apart"
        ));
        self.figure8 = Figure8::Return {
            group: [rival, third, lone],
            term,
            since: self.now_us,
        };
    }

    fn trace_figure8(&self, what: String) {
        if self.cfg.trace {
            eprintln!("t={} figure8: {what}", self.now_us);
        }
    }

    // ----- end-of-run checks -----------------------------------------------------------------

    fn check_all_logs(&mut self) {
        let alive: Vec<NodeId> = self.alive_ids();
        for (i, &a) in alive.iter().enumerate() {
            for &b in &alive[i + 1..] {
                let (ra, rb) = (
                    self.nodes[&a].core.as_ref().expect("alive").raft(),
                    self.nodes[&b].core.as_ref().expect("alive").raft(),
                );
                self.checker.check_logs_match(ra, rb);
            }
        }
        // One cluster per run: a node that started a second one (on an empty disk, while its
        // peers did not answer) names it differently.
        for &id in &alive {
            if let Some(cid) = self.nodes[&id]
                .core
                .as_ref()
                .and_then(|c| c.state_machine().cluster_id())
            {
                if self.cluster_ids.insert(cid) && self.cluster_ids.len() > 1 {
                    self.checker.violations.push(Violation {
                        invariant: "one cluster",
                        detail: format!(
                            "node {id} belongs to cluster {cid:032x}; cluster ids seen: {:032x?}",
                            self.cluster_ids
                        ),
                    });
                }
            }
        }
    }

    /// After every fault heals: a leader commits a new entry within the budget; then, with the
    /// clients quiet, every lock whose holder stopped renewing is expired and every waiter past
    /// its timeout is answered within a stated bound.
    fn check_liveness(&mut self) {
        self.healed_at = Some(self.now_us);
        self.network.heal();
        self.network.faults = NetworkFaults::calm();
        self.restart_down_nodes();
        for node in self.nodes.values_mut() {
            node.paused_until = node.paused_until.min(self.now_us);
            if let Some(core) = node.core.as_mut() {
                core.storage_mut().disarm_power_cut();
            }
        }
        // 1. A leader commits a new entry.
        let deadline = self.now_us + self.cfg.liveness_budget_us;
        let mut marker_sent_to: Option<(NodeId, u64)> = None;
        let mut events = 0u64;
        while !self.marker_done && self.now_us < deadline && events < 400_000 {
            events += 1;
            if !self.process_next_event() {
                break;
            }
            self.collect_violations();
            if !self.checker.ok() {
                return;
            }
            let resend = match marker_sent_to {
                None => true,
                Some((_, at)) => self.now_us > at + 200_000,
            };
            if resend {
                if let Some(leader) = self.leader() {
                    let op = ClientOp::Put {
                        key: "liveness".into(),
                        value: b"ok".to_vec(),
                        guard: None,
                        client_id: "simulator".into(),
                        request_id: "liveness".into(),
                    };
                    let to = ReplyTo {
                        client: MARKER_CLIENT,
                        attempt: 0,
                    };
                    self.client_send((leader, op, to));
                    marker_sent_to = Some((leader, self.now_us));
                }
            }
        }
        if !self.marker_done {
            let nodes: Vec<String> = self
                .nodes
                .values()
                .filter_map(|n| n.core.as_ref().map(|c| format!("{:?}", c.raft())))
                .collect();
            self.checker.violations.push(Violation {
                invariant: "liveness",
                detail: format!(
                    "no new entry committed within {} ms after healing; nodes: {}",
                    self.cfg.liveness_budget_us / 1000,
                    nodes.join(", ")
                ),
            });
            return;
        }
        // 2. Clients stop; what they still run completes; leases and waits run out.
        self.clients.quiet = true;
        let drain_deadline = self.now_us + 10_000_000;
        while self.clients.in_flight() > 0 && self.now_us < drain_deadline {
            if !self.process_next_event() {
                break;
            }
            self.collect_violations();
            if !self.checker.ok() {
                return;
            }
        }
        // Longest lease (400 ms) and wait (600 ms) in the simulation, plus a retried expiry
        // (200 ms), plus ticks and a commit round: everything must be free after 1.5 s.
        const FREE_WITHIN_US: u64 = 1_500_000;
        let quiet_from = self.now_us;
        while self.now_us < quiet_from + FREE_WITHIN_US {
            if !self.process_next_event() {
                break;
            }
            self.collect_violations();
            if !self.checker.ok() {
                return;
            }
        }
        let Some(leader) = self.leader() else {
            self.checker.violations.push(Violation {
                invariant: "liveness",
                detail: "no leader after the quiet period".into(),
            });
            return;
        };
        let core = self.nodes[&leader].core.as_ref().expect("leader");
        let sm = core.state_machine();
        if let Some(held) = sm.held_locks().first() {
            let detail = format!(
                "{} ms after the clients stopped, {} still holds {} (token {}, ttl {} ms) on leader {leader}; its leases: {:?}",
                FREE_WITHIN_US / 1000,
                held.client_id,
                held.key,
                held.token,
                held.ttl_ms,
                core.leases()
            );
            self.checker.violations.push(Violation {
                invariant: "leases expire",
                detail,
            });
            return;
        }
        let voters: Vec<&Raft> = core
            .raft()
            .membership()
            .voters
            .iter()
            .filter_map(|v| {
                self.nodes
                    .get(v)
                    .and_then(|n| n.core.as_ref())
                    .map(|c| c.raft())
            })
            .collect();
        if voters.len() == core.raft().membership().voters.len() {
            let mut checker = std::mem::take(&mut self.checker);
            checker.check_durability(&voters);
            self.checker = checker;
        }
        let core = self.nodes[&leader].core.as_ref().expect("leader");
        let sm = core.state_machine();
        if let Some(w) = sm.waiters().first() {
            let detail = format!(
                "{} ms after the clients stopped, {} still waits for {} (timeout {:?})",
                FREE_WITHIN_US / 1000,
                w.client_id,
                w.key,
                w.wait_timeout_ms
            );
            self.checker.violations.push(Violation {
                invariant: "waits end",
                detail,
            });
        }
        self.check_all_logs();
    }
}

/// What simulated node `id` says of itself (its addresses never change in the simulator).
fn sim_identity(id: NodeId, incarnation: u64) -> crate::lock::MemberInfo {
    crate::lock::MemberInfo {
        peer_addr: format!("sim-{id}:peer"),
        client_addr: format!("sim-{id}:client"),
        incarnation,
    }
}

/// Small queues and short client sessions so the simulator exercises their bounds: sessions close
/// after 6 s of log time without a request, and answers are kept at least 5 s — longer than a
/// simulated client retries one request (`GIVE_UP_AFTER_US` plus its answer timeout), so every
/// retry must still be answered from the table.
fn sim_lock_limits() -> Limits {
    Limits {
        waiters_per_key_max: 3,
        dedupe_entries_max: 4096,
        session_entries_max: 1024,
        session_idle_ms: 6_000,
        dedupe_retain_ms: 5_000,
        ..Limits::default()
    }
}
