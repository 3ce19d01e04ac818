//! One RaftLock node as a pure, deterministic state machine: the Raft core, the lock state
//! machine, storage and every decision a node makes — in what order a Ready is persisted, sent
//! and applied, who is answered what, dedupe replays, lease and wait deadlines, expiry and cancel
//! proposals (retried until applied or superseded), the waiter reclaim window, the rebuild after a
//! leader change, ReadIndex serving, snapshot and compaction decisions, joins, promotions and
//! removals.
//!
//! ```text
//!   client request ─┐                                   ┌─► Effect::Send (peer messages)
//!   peer message ───┤                                   ├─► Effect::Reply (client answers)
//!   tick(now) ──────┼─► NodeCore<S: Storage, R> ────────┼─► Effect::BuildSnapshot (a job)
//!   disconnected ───┤   (time is an input: `now` in µs) ├─► Effect::Observe (metrics, logs)
//!   snapshot built ─┘                                   └─► storage writes and flushes (S)
//! ```
//!
//! `lock-node` (`src/server/driver/`) wraps it with sockets, threads, timers and encodings;
//! the simulator (`src/sim`) runs the very same code for every simulated node on
//! [`crate::storage::MemStorage`] with simulated time. Nothing here touches the network, a
//! clock, a thread or an unseeded random source (`tests/purity.rs` enforces it).
//!
//! Leases follow the applied state, never the answers to local proposals: after every applied
//! command the leader compares the lock's holder (token and the log index its lease started at)
//! with its lease table and starts, keeps or ends the lease accordingly. So a grant handed off by
//! a release, a grant committed by an earlier leader, a renew and an expiry all move the lease,
//! whoever proposed them, and a replayed answer from the dedupe table moves nothing.
//!
//! This file holds the node's types, [`NodeCore`], its constructor, accessors and the inputs
//! every shell calls (`step`, `tick`, `shutdown`); the rest lives by concern in the children:
//!
//! - `requests`: client requests coming in, the proposal batch, refusals and their errors;
//! - `answers`: replies to clients and waiters from applied outcomes;
//! - `reads`: ReadIndex `Get`s and the `/locks` listing;
//! - `leases`: the leader's leases and waiter deadlines, and their rebuild after an election;
//! - `leader`: leadership changes and leader duties (expiry and cancel housekeeping, learner
//!   promotion, the log clock, limits, quotas and cluster version);
//! - `membership`: joining, admission, member info, joins, replacements and removals;
//! - `snapshots`: compaction, snapshot jobs and installing a snapshot from the leader;
//! - `apply`: applying committed entries and writing the applied state;
//! - `ready`: the Ready cycle (persist, flush, send, apply, advance);
//! - `observations` ([`Observation`]) and `bugs` ([`NodeBugs`], the known-bug switches);
//! - `api`, `events`, `lifecycle`, `pacing`, `timed`: the client API types, lock events, the
//!   start decision, request pacing and the leader's deadline map;
//! - `tests`: unit tests on small simulated clusters.

mod answers;
pub mod api;
mod apply;
mod bugs;
pub mod events;
mod leader;
mod leases;
pub mod lifecycle;
mod membership;
mod observations;
pub mod pacing;
mod reads;
mod ready;
mod requests;
mod snapshots;
mod timed;

pub use bugs::NodeBugs;
pub use observations::Observation;
pub use snapshots::{recovered_snapshot, snapshot_job_for_peers, staggered_threshold};

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;

use self::api::{ApiError, ClientReply, ErrorCode};
use self::timed::{Deadline, TimedMap};
use crate::lock::{Command, LockStateMachine, MemberInfo, StateLoader};
use crate::raft::{Index, Message, NodeId, Raft, Ready};
use crate::storage::{PairsCursor, SnapshotJob, Storage, StorageError};

/// Monotonic time in microseconds, as the caller measures it.
pub type Micros = u64;

const MS: Micros = 1_000;

/// A snapshot from the leader whose state is being put in place; see
/// [`NodeCore::begin_install`].
#[derive(Debug)]
struct Installing {
    index: Index,
    data: Bytes,
    /// The next pair to load into `loader`.
    cursor: PairsCursor,
    loader: StateLoader,
    /// Storage has the whole state.
    stored: bool,
}

/// Expiries and cancels the leader proposes per tick at most (see `NodeCore::leader_duties`).
pub const HOUSEKEEPING_PER_TICK: usize = 4096;

/// Settings of the node logic.
#[derive(Clone, Debug)]
pub struct NodeSettings {
    /// Take a snapshot once this many entries were applied since the last one.
    pub snapshot_entries: u64,
    /// … or once this many bytes of log were appended since the last one.
    pub snapshot_bytes: u64,
    /// How long a queued waiter without a wait timeout stays queued after its client went away
    /// (or after a leader change) before the leader cancels it.
    pub waiter_reclaim_us: Micros,
    /// Applied state is a cache of the log, written at most this often.
    pub applied_write_interval_us: Micros,
    /// … or as soon as this many state keys changed. Each write is one storage transaction on
    /// the driver's thread, so this bounds how long one write holds up the node's other work.
    pub applied_write_max_keys: usize,
    /// Locks a new leader visits per tick to give them their leases (see
    /// `NodeCore::rebuild_deadlines`).
    pub rebuild_keys_per_tick: usize,
    /// While a snapshot job reads the state, writes are held back; once this many state keys
    /// are waiting, the shell waits for the job (a memory bound: the job takes seconds for a
    /// large state, so this is far above `applied_write_max_keys`).
    pub snapshot_hold_max_keys: usize,
    /// An expiry or cancel proposal not applied within this long is proposed again.
    pub housekeeping_retry_us: Micros,
    /// While client sessions are open, the leader proposes a `Tick` (advancing the log clock
    /// that session idleness is measured on) this often.
    pub session_tick_us: Micros,
    /// The limits this node proposes for the cluster when it leads one whose limits were never
    /// set through the log (`Command::SetLimits`). Apply always uses the replicated limits.
    pub configured_limits: Option<crate::lock::Limits>,
    /// The byte budgets and per-identity quotas this node proposes when it leads a cluster of
    /// version 5 or later whose replicated quotas differ (`Command::SetQuotas`).
    pub configured_quotas: Option<crate::lock::Quotas>,
    /// Readies processed per [`NodeCore::drive`] (the simulator takes one at a time, to crash a
    /// node between two of them).
    pub readies_per_drive: usize,
    /// Keys of a snapshot from the leader written to storage and loaded into the lock state per
    /// drive: the install goes on between drives, so the node keeps answering votes and
    /// heartbeats while it installs a large snapshot. 256 keys take about 3-6 ms on the 2-CPU
    /// test machine, well under the 10 ms tick.
    pub install_slice_keys: usize,
    /// Bytes of an arriving snapshot staged between two flushes at most. The Readies that
    /// carry its chunks need no flush of their own; without these the install's first turn,
    /// whose flush covers whatever is still unsynced, would sync the whole snapshot at once
    /// (about 0.27 s for 155 MiB in sled, during which the node answered nothing).
    pub staged_bytes_per_flush: u64,
    /// Emit [`Observation::Persisted`] and [`Observation::Applied`] (the simulator's checkers
    /// use them; lock-node leaves this off).
    pub observe_log: bool,
    /// Emit [`Observation::LockEvents`] for every applied command that changed a lock (the
    /// watch stream; lock-node turns it on).
    pub observe_lock_events: bool,
    /// This node's own peer and client address and incarnation, which the leader records in
    /// the member table (`Command::SetMember`).
    pub identity: MemberInfo,
    /// The id this node gives a cluster it leads that has none yet (random, drawn by the shell).
    pub new_cluster_id: u128,
    /// The `--force-new-cluster` value this node started its cluster with (empty: none).
    pub forced_by: String,
    /// A voter not heard from for this long is removed by the leader (`None`: never), while
    /// at least `min_voters` voters stay.
    pub dead_member_us: Option<Micros>,
    /// Voters the leader never goes below when it removes dead members.
    pub min_voters: usize,
    /// Known bugs, switched on by simulator tests (and, in a lock-node built with the
    /// `mutations` feature, by `RAFTLOCK_MUTATION`) to show the checkers catch them.
    #[cfg(any(test, feature = "mutations"))]
    pub bugs: NodeBugs,
}

impl Default for NodeSettings {
    fn default() -> Self {
        NodeSettings {
            snapshot_entries: 100_000,
            snapshot_bytes: 64 << 20,
            waiter_reclaim_us: 10_000 * MS,
            applied_write_interval_us: 100 * MS,
            applied_write_max_keys: 1024,
            rebuild_keys_per_tick: 16_384,
            snapshot_hold_max_keys: 1 << 18,
            housekeeping_retry_us: 1_000 * MS,
            session_tick_us: 1_000 * MS,
            readies_per_drive: 64,
            install_slice_keys: 256,
            staged_bytes_per_flush: 16 << 20,
            configured_limits: None,
            configured_quotas: None,
            observe_log: false,
            observe_lock_events: false,
            identity: MemberInfo::default(),
            new_cluster_id: 0,
            forced_by: String::new(),
            dead_member_us: None,
            min_voters: 3,
            #[cfg(any(test, feature = "mutations"))]
            bugs: NodeBugs::default(),
        }
    }
}

/// Something the shell must do or may record.
pub enum Effect<R> {
    /// Send a message to a peer. Messages leave in the order given.
    Send(Message),
    /// Answer a client.
    Reply(R, ClientReply),
    /// Run this job (it reads the applied state in storage) off the node's path, then hand the
    /// result to [`NodeCore::snapshot_built`].
    BuildSnapshot(SnapshotJob),
    /// For metrics, logs and checkers.
    Observe(Observation),
}

impl<R> std::fmt::Debug for Effect<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Effect::Send(m) => write!(f, "Send({m:?})"),
            Effect::Reply(_, r) => write!(f, "Reply({r:?})"),
            Effect::BuildSnapshot(_) => write!(f, "BuildSnapshot"),
            Effect::Observe(o) => write!(f, "Observe({o:?})"),
        }
    }
}

/// A request from a client waiting for its entry to apply.
struct Pending<R> {
    op: &'static str,
    reply: Option<R>,
    conn: u64,
    started: Micros,
}

/// A queued acquire whose client is waiting (on this node) for the grant.
struct Waiting<R> {
    key: String,
    reply: Option<R>,
    conn: u64,
    enqueued: Micros,
    /// Its place in the queue when it was answered `Queued` (1 = next in line).
    position: u32,
}

/// Where a new leader's walk over the locks stands (see [`NodeCore::rebuild_deadlines`]).
struct Rebuild {
    /// When the walk began: deadlines count from here.
    since: Micros,
    /// The last key visited.
    after: Option<String>,
}

/// The leader's lease of one held lock.
#[derive(Clone, Debug)]
struct Lease {
    token: u64,
    lease_index: Index,
    deadline: Micros,
    started: Micros,
    expiry_proposed_at: Option<Micros>,
}

impl Deadline for Lease {
    fn deadline(&self) -> Micros {
        self.deadline
    }
    fn proposed_at(&self) -> Option<Micros> {
        self.expiry_proposed_at
    }
}

impl Deadline for WaitDeadline {
    fn deadline(&self) -> Micros {
        self.at
    }
    fn proposed_at(&self) -> Option<Micros> {
        self.cancel_proposed_at
    }
}

/// When the leader ends a running lock-delay: its full length after the expiry applied here, or
/// after this node's election when it inherited the delay.
#[derive(Clone, Debug)]
struct DelayDeadline {
    /// The fencing token whose expiry started the delay.
    token: u64,
    at: Micros,
    end_proposed_at: Option<Micros>,
}

impl Deadline for DelayDeadline {
    fn deadline(&self) -> Micros {
        self.at
    }
    fn proposed_at(&self) -> Option<Micros> {
        self.end_proposed_at
    }
}

/// The leader's lease of one client session: its TTL after the latest keepalive applied here,
/// or after this node's election when it inherited the session.
#[derive(Clone, Debug)]
struct SessionDeadline {
    /// The log index that opened the session (its name).
    session: Index,
    /// The log index of the keepalive the lease started at.
    lease_index: Index,
    at: Micros,
    expiry_proposed_at: Option<Micros>,
}

impl Deadline for SessionDeadline {
    fn deadline(&self) -> Micros {
        self.at
    }
    fn proposed_at(&self) -> Option<Micros> {
        self.expiry_proposed_at
    }
}

/// When the leader cancels a queued waiter (wait timeout or reclaim window).
#[derive(Clone, Debug)]
struct WaitDeadline {
    key: String,
    at: Micros,
    cancel_proposed_at: Option<Micros>,
}

/// One lock as `/locks` shows it.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LockInfo {
    pub key: String,
    pub holder: Option<String>,
    pub fencing_token: Option<u64>,
    pub ttl_ms: Option<u64>,
    /// Time left on the leader's lease (the leader only): the holder's session's, for a lock
    /// attached to one.
    pub expires_in_ms: Option<u64>,
    /// The holder's session (the log index that opened it), for a lock attached to one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    pub waiters: Vec<String>,
    /// The key's lock-delay (ms), if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lock_delay_ms: Option<u64>,
    /// A read-write lock's or semaphore's holders (`holder` and `fencingToken` are then absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedLockView>,
}

/// A read-write lock or semaphore as `/locks` shows it.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedLockView {
    /// 0: a read-write lock; otherwise the semaphore's size.
    pub permits: u32,
    pub holders: Vec<SharedHolderView>,
}

#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedHolderView {
    pub holder: String,
    pub fencing_token: u64,
    /// `reader`, `writer` or `permit`.
    pub mode: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<u32>,
    pub ttl_ms: u64,
    /// Time left on the leader's lease of this holder (the leader only).
    pub expires_in_ms: Option<u64>,
}

/// The deterministic node.
pub struct NodeCore<S: Storage, R> {
    raft: Raft,
    storage: S,
    sm: LockStateMachine,
    cfg: NodeSettings,
    now: Micros,
    effects: Vec<Effect<R>>,
    batch: Vec<(Command, Pending<R>)>,
    pending: BTreeMap<Index, Pending<R>>,
    waiting: BTreeMap<(String, String), Waiting<R>>,
    /// Leader only: the lease of every held lock, and when each falls due.
    /// Keyed by a shared string: the due-time index holds the same key, not a copy.
    leases: TimedMap<Arc<str>, Lease>,
    /// Leader only: the lease of every holder of a read-write lock or semaphore, by key and
    /// token.
    shared_leases: TimedMap<(Arc<str>, u64), Lease>,
    /// Leader only: when queued waiters are cancelled.
    wait_deadlines: TimedMap<(String, String), WaitDeadline>,
    /// Leader only: when each running lock-delay ends (`EndLockDelay`).
    lock_delays: TimedMap<Arc<str>, DelayDeadline>,
    /// Session leases by client id (leader only).
    session_deadlines: TimedMap<Arc<str>, SessionDeadline>,
    /// Leader only: the walk over every lock that gives each its lease and its waiters their
    /// deadlines after an election, a bounded number of keys per tick.
    rebuild: Option<Rebuild>,
    /// ReadIndex reads waiting for their index to apply: a `Get` or a `Leader`.
    reads: BTreeMap<u64, (api::ClientOp, R)>,
    read_indexes: Vec<(Index, u64)>,
    next_read_ctx: u64,
    promote_when_caught_up: Vec<NodeId>,
    was_leader: bool,
    last_leader: NodeId,
    log_bytes_since_snapshot: u64,
    unwritten_changes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    unwritten_applied: Option<Index>,
    /// Applied-state changes held back while a snapshot job read the state, in order, each the
    /// changes up to its index: written one per step afterwards, so that no single write (which
    /// stops every other write to the store while it runs) takes seconds.
    held: std::collections::VecDeque<(Index, Vec<crate::storage::KvChange>)>,
    held_keys: usize,
    applied_written_at: Micros,
    /// A snapshot job handed out and not yet returned; applied-state writes wait for it.
    snapshot_in_progress: bool,
    /// A snapshot from the leader whose state is being put in place a slice per drive.
    installing: Option<Installing>,
    /// The snapshot transfer whose chunks storage is staging as they arrive, and the bytes
    /// staged so far (see [`NodeCore::stage_chunks`]).
    staging: Option<(crate::raft::SnapshotMeta, u64)>,
    /// Bytes staged since the last flush started (see [`NodeSettings::staged_bytes_per_flush`]).
    staged_unflushed: u64,
    /// Set when storage failed: the node must stop.
    failed: bool,
    /// When this leader last proposed the cluster's limits.
    limits_proposed_at: Option<Micros>,
    /// The RaftLock cluster version each other member said it runs (its peer connection's
    /// `x-raftlock-version`), as the shell reported it ([`NodeCore::peer_version`]).
    peer_versions: BTreeMap<NodeId, u32>,
    /// When this leader last proposed raising the cluster version.
    version_proposed_at: Option<Micros>,
    /// While leading: the time the log clock was last advanced to (by a `Tick` this leader
    /// proposed, or its election).
    clock_ticked_at: Option<Micros>,
    /// Set by a shell that can send while this node flushes (see [`NodeCore::send_early_with`]).
    early_sender: Option<EarlySender>,
    /// Set by a shell that can send a Ready's answers as soon as its flush is done (see
    /// [`NodeCore::send_after_flush_with`]).
    flushed_sender: Option<EarlySender>,
    /// A Ready carried up to its flush by [`NodeCore::drive_until_flush`], waiting for
    /// [`NodeCore::finish_drive`].
    unflushed: Option<Ready>,
    /// Readies written and handed to a flush that may complete in the background
    /// ([`Storage::start_flush`]), in the order they were taken, each with its flush's ticket
    /// (none when it needed no flush). Each one's answers leave, its committed entries apply and
    /// it advances once its flush and every earlier one are done.
    in_flight: VecDeque<(Ready, Option<u64>)>,
    /// Readies written while an earlier one's flush was still running.
    overlapped: u64,
    /// Leader only: the requests it proposed that leave an answer, per second, to pace new work
    /// below the exactly-once table's bound (see [`pacing`]).
    pacer: pacing::AnswerPacer,
    /// What members (and nodes asking to join) said of themselves: addresses and incarnation
    /// (see [`NodeCore::peer_info`]); the leader records it in the member table.
    said_info: BTreeMap<NodeId, MemberInfo>,
    /// When this leader last proposed cluster id or member table changes.
    lifecycle_proposed_at: Option<Micros>,
    /// A node with an empty log that asked to join: it takes no Raft message until the leader
    /// accepted it ([`NodeCore::set_joining`]), so it never votes with a log it does not have.
    joining: bool,
    /// This node runs on a new data directory (a new incarnation of its id, or a new id) and its
    /// log does not hold the entry that admitted it yet: it stays out of elections until then
    /// ([`NodeCore::set_awaiting_admission`]).
    awaiting_admission: bool,
    /// How far the log was searched for the admitting entry: an index and its term (a log
    /// cut back below it is searched again from the applied index).
    admission_scanned: (Index, crate::raft::Term),
    /// The index at which each member's current record in the member table was applied (an
    /// upper bound, the applied index at start, for records that came with the state): the
    /// leader promotes a learner only once its log reaches its record.
    recorded_at: BTreeMap<NodeId, Index>,
    /// Leader only: when each other member was last heard from (dead member removal).
    last_heard: BTreeMap<NodeId, Micros>,
    /// Leader only: when this node became leader.
    led_since: Option<Micros>,
    /// Leader only: the incarnation each learner asked to join as, when it asked this leader.
    /// The replication progress this leader keeps for a learner is that incarnation's: another
    /// incarnation under its id (its data directory wiped again) has an empty log.
    joined_as: BTreeMap<NodeId, u64>,
}

/// Sends one of the leader's own replication messages at once, before the flush of the Ready
/// that holds it; returns false to leave the message to [`Effect::Send`] after the flush.
pub type EarlySender = Box<dyn FnMut(&Message, &Raft) -> bool + Send>;

impl<S: Storage, R> NodeCore<S, R> {
    /// A node over recovered storage: `raft` was built from `storage.recover()` and `sm` from
    /// its applied state.
    pub fn new(
        raft: Raft,
        storage: S,
        #[allow(unused_mut)] mut sm: LockStateMachine,
        cfg: NodeSettings,
        now: Micros,
    ) -> Self {
        #[cfg(any(test, feature = "mutations"))]
        sm.set_bugs(cfg.bugs.machine());
        // Only builds that can switch known bugs on have the switch (see `bug`).
        #[cfg(any(test, feature = "mutations"))]
        let never_retry = cfg.bugs.housekeeping_never_retried;
        #[cfg(not(any(test, feature = "mutations")))]
        let never_retry = false;
        let retry = cfg.housekeeping_retry_us;
        // Records that came with the state were applied at its index at the latest.
        let recorded_at = sm
            .members()
            .keys()
            .map(|id| (*id, raft.applied_index()))
            .collect();
        NodeCore {
            raft,
            storage,
            sm,
            cfg,
            now,
            effects: Vec::new(),
            batch: Vec::new(),
            pending: BTreeMap::new(),
            waiting: BTreeMap::new(),
            leases: TimedMap::new(retry, never_retry),
            shared_leases: TimedMap::new(retry, never_retry),
            wait_deadlines: TimedMap::new(retry, never_retry),
            lock_delays: TimedMap::new(retry, never_retry),
            session_deadlines: TimedMap::new(retry, never_retry),
            rebuild: None,
            reads: BTreeMap::new(),
            read_indexes: Vec::new(),
            next_read_ctx: 0,
            promote_when_caught_up: Vec::new(),
            was_leader: false,
            last_leader: 0,
            log_bytes_since_snapshot: 0,
            unwritten_changes: BTreeMap::new(),
            unwritten_applied: None,
            held: std::collections::VecDeque::new(),
            held_keys: 0,
            staging: None,
            staged_unflushed: 0,
            applied_written_at: now,
            snapshot_in_progress: false,
            installing: None,
            failed: false,
            limits_proposed_at: None,
            peer_versions: BTreeMap::new(),
            version_proposed_at: None,
            clock_ticked_at: None,
            early_sender: None,
            flushed_sender: None,
            unflushed: None,
            in_flight: VecDeque::new(),
            overlapped: 0,
            pacer: pacing::AnswerPacer::default(),
            said_info: BTreeMap::new(),
            lifecycle_proposed_at: None,
            joining: false,
            awaiting_admission: false,
            admission_scanned: (0, 0),
            recorded_at,
            last_heard: BTreeMap::new(),
            led_since: None,
            joined_as: BTreeMap::new(),
        }
    }

    // ----- accessors -------------------------------------------------------------------------

    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    pub fn state_machine(&self) -> &LockStateMachine {
        &self.sm
    }

    /// The answer-leaving requests this node proposed as leader within the retention (see
    /// [`pacing`]).
    pub fn paced_recent(&self) -> u64 {
        self.pacer.recent()
    }

    pub fn storage(&self) -> &S {
        &self.storage
    }

    pub fn storage_mut(&mut self) -> &mut S {
        &mut self.storage
    }

    /// Gives the storage back (the simulator crashes and restarts nodes this way).
    pub fn into_storage(self) -> S {
        self.storage
    }

    pub fn settings(&self) -> &NodeSettings {
        &self.cfg
    }

    /// Lets the leader's appends leave before its own flush, as the Raft dissertation allows
    /// (§10.2.1): `send` is called with each of a Ready's `messages_now` before storage flushes
    /// that Ready, and whatever it declines becomes an [`Effect::Send`] as usual. The leader still
    /// counts itself towards a commit only with entries it has flushed, and answers (a
    /// follower's acknowledgements, votes) always wait for the flush. Without it every message
    /// leaves as an effect, after the flush: the same outcome, later (the simulator runs so).
    pub fn send_early_with(&mut self, send: EarlySender) {
        self.early_sender = Some(send);
    }

    /// Lets a Ready's `messages` (answers, which wait for its flush) leave as soon as that flush
    /// is done, before the Ready's committed entries are applied: `send` is called with each of
    /// them right after the flush, and whatever it declines becomes an [`Effect::Send`] as
    /// usual, handed out after the apply. A follower's acknowledgement then does not wait for the
    /// follower to apply the entries the same append committed.
    pub fn send_after_flush_with(&mut self, send: EarlySender) {
        self.flushed_sender = Some(send);
    }

    /// Everything the shell must do, in order.
    pub fn take_effects(&mut self) -> Vec<Effect<R>> {
        std::mem::take(&mut self.effects)
    }

    /// Requests waiting for an apply (proposals, queued waiters, reads) on this node.
    pub fn pending_requests(&self) -> usize {
        self.pending.len() + self.waiting.len() + self.reads.len()
    }

    /// Leases the leader tracks (key, token, µs left): plain locks', then shared locks'.
    pub fn leases(&self) -> Vec<(String, u64, Micros)> {
        let plain = self
            .leases
            .iter()
            .map(|(k, l)| (k.to_string(), l.token, l.deadline.saturating_sub(self.now)));
        let shared = self
            .shared_leases
            .iter()
            .map(|((k, _), l)| (k.to_string(), l.token, l.deadline.saturating_sub(self.now)));
        plain.chain(shared).collect()
    }

    /// Whether a snapshot job is out; the shell must hand its result back before
    /// [`NodeCore::shutdown`].
    pub fn snapshot_in_progress(&self) -> bool {
        self.snapshot_in_progress
    }

    /// Whether applied-state changes piled up while a snapshot job runs; the shell should wait
    /// for the job and hand its result back.
    pub fn needs_snapshot_result(&self) -> bool {
        self.snapshot_in_progress
            && self.held_keys + self.unwritten_changes.len() + self.sm.pending_changes()
                >= self.cfg.snapshot_hold_max_keys
    }

    fn observe(&mut self, o: Observation) {
        self.effects.push(Effect::Observe(o));
    }

    fn reply(&mut self, to: R, reply: ClientReply) {
        self.effects.push(Effect::Reply(to, reply));
    }

    /// Answers a request of kind `op` with `err` without applying it, and says so
    /// ([`Observation::Refused`], counted in `raftlock_requests_total` by its code).
    fn refuse(&mut self, op: &'static str, to: R, err: ApiError) {
        self.observe(Observation::Refused {
            op,
            result: err.code.as_str(),
        });
        self.reply(to, ClientReply::Error(err));
    }

    // ----- inputs ----------------------------------------------------------------------------

    fn advance_clock(&mut self, now: Micros) {
        self.now = self.now.max(now);
    }

    /// A message from a peer.
    pub fn step(&mut self, now: Micros, msg: Message) {
        self.advance_clock(now);
        if self.joining || self.runs_older_version(msg.from) {
            return;
        }
        if self.cfg.dead_member_us.is_some() && self.raft.is_leader() {
            self.last_heard.insert(msg.from, now);
        }
        self.raft.step(msg);
    }

    /// One clock tick: Raft timers and the leader's lease and wait deadlines.
    pub fn tick(&mut self, now: Micros) -> Result<(), StorageError> {
        self.advance_clock(now);
        self.raft.tick();
        if self.raft.is_leader() {
            self.continue_rebuild();
        }
        self.leader_duties();
        self.write_applied(false)?;
        self.maybe_snapshot()?;
        self.raft.release_snapshot_data();
        self.drive()
    }

    /// Stopping: every request still waiting is told to retry, and the applied state written.
    /// The shell hands back any snapshot job first.
    pub fn shutdown(&mut self) -> Result<(), StorageError> {
        let drained = if self.failed {
            Ok(())
        } else {
            self.drain_flushes()
        };
        self.fail_all(ErrorCode::Unavailable, "node is shutting down");
        drained?;
        self.write_all_applied()?;
        self.storage.flush()
    }
}

#[cfg(test)]
mod tests;
