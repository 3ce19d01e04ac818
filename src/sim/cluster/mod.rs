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
//!
//! The cluster's code, by concern:
//! - this file: the run's configuration, statistics and outcome, the nodes and the cluster's
//!   state, and starting and crashing a node;
//! - `store.rs`: a node's disk (the in-memory store, or the segments engine on a simulated disk);
//! - `run.rs`: the event loop (`run`), node ticks, and the run's summary;
//! - `delivery.rs`: delivering peer messages and client messages;
//! - `effects.rs`: carrying out a node's effects and recording its observations after each drive;
//! - `invariants.rs`: the per-drive checks and the end-of-run checks (logs, liveness);
//! - `faults.rs`: the random fault schedule (partitions, crashes, restarts, pauses);
//! - `lifecycle.rs`: lifecycle faults (restarting every node, wiped and damaged disks, rejoining);
//! - `membership.rs`: membership changes and leadership transfers;
//! - `figure8.rs`: the targeted Figure 8 schedule.

use std::collections::{BTreeMap, BTreeSet};

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::checker::{Checker, Violation};
use super::clients::{ReplyTo, SimClients};
use super::locks::LockChecker;
use super::network::{Network, NetworkFaults};
use crate::lock::{Limits, LockStateMachine};
use crate::node::api::{ClientOp, ClientReply};
use crate::node::{NodeCore, NodeSettings};
use crate::raft::{Config, InitialState, Membership, Message, NodeId, Raft};
#[cfg(doc)]
use crate::storage::{MemStorage, SimSegmentsStorage};
use crate::storage::{SimDiskStats, Storage, StorageError};

mod delivery;
mod effects;
mod faults;
mod figure8;
mod invariants;
mod lifecycle;
mod membership;
mod run;
mod store;

use figure8::Figure8;
pub use store::SimStore;

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
    /// Clients also campaign for, proclaim in and read leader elections (`elect-*` keys), and
    /// keep sessions with locks attached. Off, the client mix (and so every seed's schedule) is
    /// the one from before elections and sessions: the regression seeds of bugs found with that
    /// mix replay as they were found.
    pub client_elections: bool,
    /// Clients also keep sessions and attach locks to them (`sess-*` keys); on by default (it
    /// needs `client_elections`). Off, the mix is the one from before sessions. With it on,
    /// seed 313 (3 nodes) lost a second disk while a wiped voter still awaited admission (a
    /// fault schedule no cluster survives; the schedule no longer makes it), and seed 867 (5
    /// nodes, with an earlier version of that schedule fix) a retried attached acquire refused
    /// once its session had ended (the session is now checked after the exactly-once table).
    pub client_sessions: bool,
    /// Clients also take read-write locks (`rw-*`) and semaphore permits (`sem-*`); on by
    /// default (it needs `client_sessions`). Off, the mix is the one from before them.
    pub client_shared: bool,
    /// Clients also attach campaigns to their sessions; on by default (it needs
    /// `client_shared`). Off, the mix is the one from before, under which seed 694 (3 nodes,
    /// segments disk) was found.
    pub client_attached_campaigns: bool,
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
            client_elections: true,
            client_sessions: true,
            client_shared: true,
            client_attached_campaigns: true,
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
    /// Lock-delays started by an expiry, and ended by the leader.
    pub lock_delays: u64,
    pub lock_delays_ended: u64,
    /// Election candidates elected (client-level elections, not Raft's), and proclaims.
    pub leaders_elected: u64,
    pub proclaims: u64,
    /// Client sessions opened, closed by their clients and expired; locks granted attached to
    /// a session.
    pub sessions_opened: u64,
    pub sessions_closed: u64,
    pub sessions_expired: u64,
    pub attached_grants: u64,
    /// Grants of read-write locks and semaphore permits.
    pub shared_grants: u64,
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
    /// Wipes of a node whose previous wipe's replacement was still in flight.
    pub rewipes: u64,
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
        self.lock_delays += other.lock_delays;
        self.lock_delays_ended += other.lock_delays_ended;
        self.leaders_elected += other.leaders_elected;
        self.proclaims += other.proclaims;
        self.sessions_opened += other.sessions_opened;
        self.sessions_closed += other.sessions_closed;
        self.sessions_expired += other.sessions_expired;
        self.attached_grants += other.attached_grants;
        self.shared_grants += other.shared_grants;
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
        self.rewipes += other.rewipes;
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
    /// Nodes whose disk was lost: each must be a voter again, as its newest incarnation, once
    /// the network is healed (unless it was removed from the cluster since).
    wiped: BTreeSet<NodeId>,
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
        clients.elections = cfg.client_elections;
        // Sessions came after elections: the mix from before elections has neither.
        clients.sessions = cfg.client_elections && cfg.client_sessions;
        // Shared locks came after sessions.
        clients.shared = clients.sessions && cfg.client_shared;
        // Attached campaigns came after shared locks.
        clients.attached_campaigns = clients.shared && cfg.client_attached_campaigns;
        let mut cluster = Cluster {
            clients,
            locks: LockChecker::with_node_drift(NODE_DRIFT_PPM.unsigned_abs()),
            lock_state_at: BTreeMap::new(),
            write_index: BTreeMap::new(),
            figure8: Figure8::Settle { since: 0 },
            figure8_rounds: 0,
            lifecycle_rng,
            cluster_ids: BTreeSet::new(),
            disk_rng,
            retired_disks: SimDiskStats::default(),
            wiped: BTreeSet::new(),
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

    /// The leader, if it runs now: a paused process answers no join request and makes no
    /// membership change or transfer (one did, on a clock 400 ms stale, and started a
    /// lock-delay that ended early in real time: simulator seed 494, 3 nodes, segments disk).
    fn running_leader(&self) -> Option<NodeId> {
        self.leader()
            .filter(|id| self.nodes.get(id).is_some_and(|n| !n.paused(self.now_us)))
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
