//! The node driver: one task that owns the Raft core, the lock state machine and storage, and is
//! the only place they change.
//!
//! ```text
//!   peers ──┐                                         ┌─► peer transport (messages)
//!   clients ├─► bounded input queue ─► Driver loop ───┼─► storage (persist, flush once per Ready)
//!   ticks ──┘        (drained in batches)             └─► lock state machine ─► client replies
//! ```
//! Every decision is made by [`NodeCore`] (`src/node`), the same code the simulator runs; this
//! shell owns the sockets' queues, the clock, the snapshot thread and the metrics. Proposals
//! that arrive together are proposed together, so one flush covers many operations (group
//! commit). Client answers leave only after the entry is applied — which implies it was durably
//! committed on a quorum.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::api::{ApiError, ClientOp, ClientReply};
use super::replication_lag::LagClock;
use super::transport::{AddressBook, PeerTransport, Sent};
use crate::lock::LockStateMachine;
use crate::node::{Effect, Micros, NodeCore, NodeSettings, Observation};
use crate::raft::{Message, MessageBody, NodeId, Raft, Snapshot};
use crate::storage::{SledStorage, Storage, StorageError};
use crate::telemetry::NodeMetrics;

/// Inputs accepted by the driver.
#[derive(Debug)]
pub enum Input {
    Peer(Message),
    Client {
        op: ClientOp,
        conn: u64,
        reply: oneshot::Sender<ClientReply>,
    },
    /// A client connection closed; its queued waiters become reclaimable.
    Disconnected {
        conn: u64,
    },
    Join {
        id: NodeId,
        peer_addr: String,
        client_addr: String,
        /// The joiner's incarnation (0: not said, a RaftLock from before incarnations).
        incarnation: u64,
        reply: oneshot::Sender<JoinReply>,
    },
    Remove {
        id: NodeId,
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
    Locks {
        prefix: String,
        reply: oneshot::Sender<Vec<LockInfo>>,
    },
    TransferLeadership {
        reply: oneshot::Sender<bool>,
    },
    /// A peer's Raft stream said which cluster version its RaftLock runs.
    PeerVersion {
        id: NodeId,
        version: u32,
    },
    /// A peer's Raft stream said where it is reached and which incarnation it is.
    PeerInfo {
        id: NodeId,
        info: crate::lock::MemberInfo,
    },
    /// The leader accepted this node's join: it takes Raft messages from now on.
    Admitted,
}

#[derive(Clone, Debug)]
pub struct JoinReply {
    pub success: bool,
    pub leader_id: NodeId,
    pub leader_peer_addr: String,
    pub term: u64,
    pub error: String,
}

pub use crate::node::LockInfo;

/// What the client API and `/status` read without going through the driver queue.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    pub id: NodeId,
    pub role: String,
    pub term: u64,
    pub leader_id: NodeId,
    pub leader_addr: String,
    pub commit_index: u64,
    pub applied_index: u64,
    pub last_index: u64,
    pub voters: Vec<NodeId>,
    pub learners: Vec<NodeId>,
    pub locks_held: u64,
    pub waiters: u64,
    /// The cluster version in the applied state (see `lock::CLUSTER_VERSION`).
    pub cluster_version: u32,
    /// Whether byte budgets and quotas are in force (a `SetQuotas` entry applied).
    pub quotas_in_force: bool,
    /// The cluster's id (32 hex digits), once its leader named it; empty before.
    pub cluster_id: String,
    /// The `--force-new-cluster` value that started the cluster, if one did.
    pub forced_by: String,
    /// This node's data holds a log or a snapshot (it is, or was, a member of a cluster).
    pub has_data: bool,
    /// The index of the snapshot from the leader whose state is being installed, if any: the
    /// lock counts are the state before it until it is done.
    pub installing_snapshot: Option<u64>,
    /// On the leader: how far each other member's log matches its own.
    pub replication: Vec<PeerReplication>,
}

/// One follower's replication, as the leader sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerReplication {
    pub id: NodeId,
    /// The highest log index known to match the leader's.
    pub match_index: u64,
    /// Entries the follower is behind the leader's last index.
    pub lag_entries: u64,
}

impl NodeStatus {
    /// Member of a cluster with a known leader, and caught up with the commit index.
    pub fn is_ready(&self) -> bool {
        let member = self.voters.contains(&self.id) || self.learners.contains(&self.id);
        member
            && self.leader_id != 0
            && self.installing_snapshot.is_none()
            && self.applied_index + 16 >= self.commit_index
    }
}

/// Batches awaiting commit that `raftlock_commit_duration_seconds` follows at once; beyond it
/// the oldest is dropped unobserved.
const COMMIT_MARKS_MAX: usize = 4096;

/// A driver turn goes on taking Readies (persist, send, apply) while it has run less than this;
/// what is left waits for the next turn, after any tick or input that came meanwhile. Together
/// with the Raft core's bound on the entries applied per Ready, this keeps a backlog from
/// silencing a leader's heartbeats (or a follower's answers) for an election timeout.
const TURN_BUDGET: Duration = Duration::from_millis(20);

/// A driver turn (inputs, Raft, persistence, apply, sends) this long is logged as slow.
const SLOW_TURN: Duration = Duration::from_millis(100);

/// A timed heartbeat not answered within this long is forgotten and the next one is timed.
const HEARTBEAT_RTT_GIVE_UP: Duration = Duration::from_secs(2);

/// Settings the driver needs.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub tick: Duration,
    pub snapshot_entries: u64,
    pub snapshot_bytes: u64,
    pub waiter_reclaim: Duration,
    /// Inputs handled per loop turn before the resulting Ready is processed.
    pub max_batch_inputs: usize,
    /// Where flushes run ([`SledStorage::flush_in_background`]).
    pub flush_mode: FlushMode,
    /// Limits this node proposes for a cluster whose limits were never set.
    pub limits: crate::lock::Limits,
    pub quotas: crate::lock::Quotas,
    /// Where applied lock events go for watchers.
    pub watch: Arc<super::watch::WatchHub>,
    /// This node's addresses and incarnation, for the member table.
    pub identity: crate::lock::MemberInfo,
    /// The id this node gives a cluster it leads that has none (random).
    pub new_cluster_id: u128,
    /// The `--force-new-cluster` value this node started its cluster with (empty: none).
    pub forced_by: String,
    /// Dead-member removal: after how long (`None`: never), and the voters always kept.
    pub dead_member: Option<Duration>,
    pub min_voters: usize,
    /// A new node asking to join: no Raft message until the leader accepted it.
    pub joining: bool,
    /// The mark of a data directory whose node has not been admitted yet (see
    /// `NodeCore::set_awaiting_admission`): the node stays out of elections while it exists, and
    /// removes it once admitted.
    pub admission_mark: Option<std::path::PathBuf>,
}

/// Storage that times its flushes for `raftlock_fsync_duration_seconds`.
pub struct TimedStorage<S> {
    inner: S,
    metrics: NodeMetrics,
    /// Time spent appending, applying and flushing since the driver last took it (for the
    /// slow-turn log line).
    spent: StorageTime,
    /// Flushes may run on the storage's own thread, which times them.
    background: bool,
    /// The flush thread is used while the node is busy (`--background-flush auto`); without
    /// it, `offload` stays as it started.
    adaptive: bool,
    /// Flushes go to the flush thread; otherwise the driver flushes on its own thread.
    offload: bool,
    /// When the last flush on the driver's thread ended.
    last_inline_end: Option<std::time::Instant>,
    /// Flushes since the last tick, and how many of them had work waiting: on the driver's
    /// thread, a flush that began sooner after the previous one ended than that one took; on
    /// the flush thread, a flush started while another was still running.
    flushes: u32,
    pressed: u32,
    /// The moving average of the share of flushes that had work waiting, in thousandths.
    pressure: u32,
    /// The newest flush handed to the flush thread.
    last_ticket: u64,
}

impl<S: Storage> TimedStorage<S> {
    /// `background`: the storage has a flush thread running. `mode` says how it is used; the
    /// flush-thread gauge starts at where the first flushes will run.
    fn new(inner: S, metrics: NodeMetrics, background: bool, mode: FlushMode) -> Self {
        let offload = background && mode == FlushMode::Always;
        metrics.flush_thread_active.set(i64::from(offload));
        TimedStorage {
            inner,
            metrics,
            spent: StorageTime::default(),
            background,
            adaptive: mode == FlushMode::Auto,
            offload,
            last_inline_end: None,
            flushes: 0,
            pressed: 0,
            pressure: 0,
            last_ticket: 0,
        }
    }

    /// Called every tick: where the next flushes run. A flush on the flush thread costs two
    /// thread wake-ups (it, then the driver), which pays off only when the driver has other
    /// work meanwhile — under load, when flushes follow each other closely — and is pure delay
    /// for one client at a time. Each tick's share of flushes that had work waiting (none for
    /// a tick with fewer than [`MIN_FLUSHES_TO_OFFLOAD`]) goes into a moving average over about
    /// eight ticks; flushes move to the flush thread when it passes one half and back when it
    /// falls below one quarter. One tick's share alone swings across both bounds from tick to
    /// tick at every load, and switching on it moved flushes back and forth up to 50 times a
    /// second (`raftlock_flush_thread_switches_total`).
    fn choose_flush_thread(&mut self) {
        if !self.background || !self.adaptive {
            return;
        }
        let (flushes, pressed) = (self.flushes, self.pressed);
        self.flushes = 0;
        self.pressed = 0;
        let share = if flushes < MIN_FLUSHES_TO_OFFLOAD {
            0
        } else {
            pressed * PRESSURE_SCALE / flushes
        };
        self.pressure = (self.pressure * (PRESSURE_TICKS - 1) + share) / PRESSURE_TICKS;
        let offload = if self.offload {
            self.pressure * 4 >= PRESSURE_SCALE
        } else {
            self.pressure * 2 > PRESSURE_SCALE
        };
        if offload != self.offload {
            self.offload = offload;
            self.metrics.flush_thread_active.set(i64::from(offload));
            self.metrics.flush_thread_switches_total.inc();
        }
    }

    fn start_flush_inline(&mut self) -> Result<u64, StorageError> {
        let started = std::time::Instant::now();
        self.flush()?;
        let ended = std::time::Instant::now();
        if let Some(previous) = self.last_inline_end {
            if started.duration_since(previous) < ended.duration_since(started) {
                self.pressed += 1;
            }
        }
        self.last_inline_end = Some(ended);
        self.flushes += 1;
        self.inner.flushed()
    }
}

/// Where flushes run (`--background-flush`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushMode {
    /// On the flush thread while flushes follow each other closely, on the driver's otherwise.
    Auto,
    /// Always on the flush thread.
    Always,
    /// Always on the driver's thread.
    Never,
}

impl std::str::FromStr for FlushMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(FlushMode::Auto),
            "always" => Ok(FlushMode::Always),
            "never" => Ok(FlushMode::Never),
            other => Err(format!("is {other:?}; use auto, always or never")),
        }
    }
}

/// A tick (10 ms) with fewer flushes than this counts as one with none waiting.
const MIN_FLUSHES_TO_OFFLOAD: u32 = 4;
/// `TimedStorage::pressure` is in thousandths, averaged over about this many ticks.
const PRESSURE_SCALE: u32 = 1000;
const PRESSURE_TICKS: u32 = 8;

/// Where a driver turn's storage time went.
#[derive(Clone, Copy, Debug, Default)]
pub struct StorageTime {
    pub append: Duration,
    pub apply: Duration,
    pub flush: Duration,
}

impl<S> TimedStorage<S> {
    fn take_spent(&mut self) -> StorageTime {
        std::mem::take(&mut self.spent)
    }
}

impl<S: Storage> Storage for TimedStorage<S> {
    fn recover(&self) -> Result<crate::storage::RecoveredState, StorageError> {
        self.inner.recover()
    }
    fn append(&mut self, entries: &[crate::raft::Entry]) -> Result<(), StorageError> {
        super::probe::event("append");
        let started = std::time::Instant::now();
        let result = self.inner.append(entries);
        self.spent.append += started.elapsed();
        super::probe::event("appended");
        if let Some(last) = entries.last() {
            super::probe::appended(last.index);
        }
        result
    }
    fn set_hard_state(&mut self, hs: crate::raft::HardState) -> Result<(), StorageError> {
        self.inner.set_hard_state(hs)
    }
    fn apply(
        &mut self,
        applied_index: crate::raft::Index,
        changes: &[crate::storage::KvChange],
    ) -> Result<(), StorageError> {
        let started = std::time::Instant::now();
        let result = self.inner.apply(applied_index, changes);
        let took = started.elapsed();
        self.spent.apply += took;
        self.metrics
            .state_write_duration_seconds
            .observe(took.as_secs_f64());
        result
    }
    fn install_snapshot(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &[u8],
    ) -> Result<(), StorageError> {
        self.inner.install_snapshot(meta, data)
    }
    fn begin_install(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        self.inner.begin_install(meta, data)
    }
    fn begin_install_staged(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        self.inner.begin_install_staged(meta, data)
    }
    fn continue_install(&mut self, max_pairs: usize) -> Result<bool, StorageError> {
        self.inner.continue_install(max_pairs)
    }
    fn begin_snapshot(&mut self, meta: &crate::raft::SnapshotMeta) -> Result<(), StorageError> {
        self.inner.begin_snapshot(meta)
    }
    fn write_snapshot_chunk(&mut self, offset: u64, chunk: &[u8]) -> Result<(), StorageError> {
        self.inner.write_snapshot_chunk(offset, chunk)
    }
    fn finish_snapshot(&mut self) -> Result<crate::raft::SnapshotMeta, StorageError> {
        self.inner.finish_snapshot()
    }
    fn build_snapshot(&self) -> Result<Snapshot, StorageError> {
        self.inner.build_snapshot()
    }
    fn snapshot_job(&self) -> Result<crate::storage::SnapshotJob, StorageError> {
        self.inner.snapshot_job()
    }
    fn snapshot_job_with(
        &self,
        convert: crate::storage::PairsConvert,
    ) -> Result<crate::storage::SnapshotJob, StorageError> {
        self.inner.snapshot_job_with(convert)
    }
    fn compact(&mut self, upto: crate::raft::Index) -> Result<(), StorageError> {
        self.inner.compact(upto)
    }
    fn entries(
        &self,
        lo: crate::raft::Index,
        hi: crate::raft::Index,
    ) -> Result<Vec<crate::raft::Entry>, StorageError> {
        self.inner.entries(lo, hi)
    }
    fn term(&self, index: crate::raft::Index) -> Result<crate::raft::Term, StorageError> {
        self.inner.term(index)
    }
    fn first_index(&self) -> crate::raft::Index {
        self.inner.first_index()
    }
    fn last_index(&self) -> crate::raft::Index {
        self.inner.last_index()
    }
    fn applied_index(&self) -> crate::raft::Index {
        self.inner.applied_index()
    }
    fn start_flush(&mut self) -> Result<u64, StorageError> {
        if !self.offload {
            return self.start_flush_inline();
        }
        self.last_inline_end = None;
        self.flushes += 1;
        if self.inner.flushed()? < self.last_ticket {
            self.pressed += 1;
        }
        super::probe::event("flush");
        let started = std::time::Instant::now();
        let result = self.inner.start_flush();
        self.spent.flush += started.elapsed();
        if let Ok(ticket) = result {
            self.last_ticket = ticket;
        }
        result
    }
    fn flushed(&mut self) -> Result<u64, StorageError> {
        self.inner.flushed()
    }
    fn wait_flushed(&mut self) -> Result<(), StorageError> {
        let started = std::time::Instant::now();
        let result = self.inner.wait_flushed();
        self.spent.flush += started.elapsed();
        result
    }
    fn flush(&mut self) -> Result<(), StorageError> {
        let _span = tracing::debug_span!("raft.fsync").entered();
        super::probe::event("flush");
        let started = std::time::Instant::now();
        let result = self.inner.flush();
        let took = started.elapsed();
        super::probe::event("flushed");
        self.spent.flush += took;
        self.metrics
            .fsync_duration_seconds
            .observe(took.as_secs_f64());
        result
    }
}

type Reply = oneshot::Sender<ClientReply>;
type Core = NodeCore<TimedStorage<SledStorage>, Reply>;

pub struct Driver {
    core: Core,
    /// Woken by the storage's flush thread when flushes complete.
    flush_done: Arc<tokio::sync::Notify>,
    /// The zero of the core's clock.
    epoch: Instant,
    transport: PeerTransport,
    /// The leader's appends and a follower's answers to them: streams on this driver's own
    /// runtime, written by this thread when it yields.
    on_thread: PeerTransport,
    /// Set when the leader's appends were queued on `on_thread` before a flush.
    appends_sent: Arc<AtomicBool>,
    /// Set when answers were queued on `on_thread` during a turn.
    answers_sent: Arc<AtomicBool>,
    addresses: AddressBook,
    metrics: NodeMetrics,
    cfg: DriverConfig,
    inputs: mpsc::Receiver<Input>,
    status: watch::Sender<NodeStatus>,
    /// A snapshot being built on another thread.
    snapshot_job: Option<std::sync::mpsc::Receiver<Result<Snapshot, StorageError>>>,
    /// When the snapshot being installed from the leader began (for the log line at its end).
    install_started: Option<Instant>,
    /// The member table last copied into the address book.
    members_seen: std::collections::BTreeMap<NodeId, crate::lock::MemberInfo>,
    /// The cluster id last published.
    cluster_seen: Option<u128>,
    /// Where the transport reads the cluster id for its streams' hellos.
    cluster_id_cell: Arc<std::sync::RwLock<String>>,
    /// Per peer: when the heartbeat being timed was sent (for `raftlock_peer_rtt_seconds`).
    heartbeat_sent: HashMap<NodeId, Instant>,
    /// While leading: each other member's replication-lag gauges (entries, seconds).
    lag_gauges: HashMap<NodeId, (prometheus::IntGauge, prometheus::Gauge)>,
    /// While leading: `(last index, when)` after each batch that appended entries, until the
    /// entries are known committed (for `raftlock_commit_duration_seconds`); bounded.
    commit_marks: std::collections::VecDeque<(crate::raft::Index, std::time::Instant)>,
    /// When the snapshot being built was handed to its thread.
    snapshot_started: Option<std::time::Instant>,
    /// When the batch of inputs being handled was taken from the queue.
    batch_started: std::time::Instant,
    /// `publish_status`'s scratch buffer for the replication view.
    replication_buf: Vec<PeerReplication>,
    /// While leading: when the log's entries were appended (for `raftlock_replication_lag_seconds`).
    lag_clock: Option<LagClock>,
    /// When a message from the leader (or, while leading, from each follower) last arrived;
    /// logged when an election timeout or CheckQuorum ends a term's leadership.
    last_heard: HashMap<NodeId, std::time::Instant>,
    /// The core's election counters as last logged.
    logged_stats: crate::raft::CoreStats,
    /// The last leader this node knew.
    leader_seen: NodeId,
}

/// A span per append that carries entries (field values are computed only when traced).
fn replicate_span(
    msg: &Message,
    last_index: crate::raft::Index,
) -> Option<tracing::span::EnteredSpan> {
    match &msg.body {
        MessageBody::Append {
            entries,
            prev_log_index,
            ..
        } if !entries.is_empty() => Some(
            tracing::debug_span!(
                "raft.replicate",
                // Signed: OpenTelemetry has no unsigned integers.
                peer = msg.to as i64,
                entries = entries.len() as i64,
                bytes = entries.iter().map(|e| e.size_bytes()).sum::<usize>() as i64,
                from_index = (prev_log_index + 1) as i64,
                lag_entries = last_index.saturating_sub(*prev_log_index) as i64,
            )
            .entered(),
        ),
        _ => None,
    }
}

/// Drops a peer's replication-lag series (this node stopped leading or the peer left).
fn remove_lag_series(m: &NodeMetrics, peer: NodeId) {
    let label = peer.to_string();
    let _ = m.replication_lag_entries.remove_label_values(&[&label]);
    let _ = m.replication_lag_seconds.remove_label_values(&[&label]);
}

fn snapshot_thread_gone() -> StorageError {
    StorageError::SnapshotData {
        problem: "the snapshot thread stopped without a result".into(),
    }
}

impl Driver {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        raft: Raft,
        storage: SledStorage,
        sm: LockStateMachine,
        transport: PeerTransport,
        metrics: NodeMetrics,
        cfg: DriverConfig,
        inputs: mpsc::Receiver<Input>,
        status: watch::Sender<NodeStatus>,
    ) -> Self {
        let addresses = transport.addresses().clone();
        let cluster_id_cell = transport.cluster_id_cell();
        let settings = NodeSettings {
            snapshot_entries: cfg.snapshot_entries,
            snapshot_bytes: cfg.snapshot_bytes,
            waiter_reclaim_us: cfg.waiter_reclaim.as_micros() as Micros,
            configured_limits: Some(cfg.limits.clone()),
            configured_quotas: Some(cfg.quotas.clone()),
            observe_lock_events: true,
            // One Ready per drive: the loop in `run` takes more while its turn budget lasts.
            readies_per_drive: 1,
            identity: cfg.identity.clone(),
            new_cluster_id: cfg.new_cluster_id,
            forced_by: cfg.forced_by.clone(),
            dead_member_us: cfg.dead_member.map(|d| d.as_micros() as Micros),
            min_voters: cfg.min_voters,
            ..NodeSettings::default()
        };
        // A lock-node built with the `mutations` feature runs with the named bug switched on:
        // only for showing that the chaos checker catches it (scripts/chaos-mutant.sh).
        #[cfg(feature = "mutations")]
        let settings = {
            let mut settings = settings;
            if let Ok(name) = std::env::var("RAFTLOCK_MUTATION") {
                let bugs = crate::node::NodeBugs::named(&name).unwrap_or_else(|| {
                    panic!("RAFTLOCK_MUTATION={name} names no known bug");
                });
                tracing::warn!(mutation = %name, "running with a deliberate bug switched on");
                settings.bugs = bugs;
            }
            settings
        };
        let flush_done = Arc::new(tokio::sync::Notify::new());
        let mut storage = storage;
        let background = cfg.flush_mode != FlushMode::Never
            && {
                let wake = flush_done.clone();
                let fsync = metrics.fsync_duration_seconds.clone();
                let started = storage.flush_in_background(
                    Box::new(move || wake.notify_one()),
                    Box::new(move |took| {
                        super::probe::event("flushed");
                        fsync.observe(took.as_secs_f64());
                    }),
                );
                if let Err(err) = &started {
                    warn!(cause = %err, "cannot flush in the background; flushing on the driver's thread");
                }
                started.is_ok()
            };
        let storage = TimedStorage::new(storage, metrics.clone(), background, cfg.flush_mode);
        let mut core = NodeCore::new(raft, storage, sm, settings, 0);
        core.set_joining(cfg.joining);
        core.set_awaiting_admission(cfg.admission_mark.is_some());
        // Every member this node's own storage knows of, so that a node (or a whole cluster)
        // that restarts reaches its peers before it hears from any of them.
        for (id, m) in core.known_members() {
            if id != core.raft().id() {
                addresses.learn_member(id, &m.peer_addr, &m.client_addr, m.incarnation);
            }
        }
        // The leader's appends and a follower's answers to them go through streams of their own
        // that run on the driver's runtime (one more connection per pair of nodes): this thread
        // writes them to the socket when it yields, instead of handing them to an I/O worker
        // that has to be woken first (30-100 µs on a small VM, on the commit path of every
        // request). Heartbeats and everything else go through `transport`, after the flush.
        let on_thread = transport.on_calling_runtime();
        // The leader's appends leave before its own flush, so the followers write them while the
        // leader flushes its own copy (§10.2.1): one flush less on the commit path. `drive`
        // yields between the two halves of a turn to let them go.
        let appends_sent = Arc::new(AtomicBool::new(false));
        let (early, sent) = (on_thread.clone(), appends_sent.clone());
        core.send_early_with(Box::new(move |msg: &Message, raft: &Raft| {
            if !matches!(&msg.body, MessageBody::Append { entries, .. } if !entries.is_empty()) {
                return false;
            }
            let _span = replicate_span(msg, raft.last_index());
            // Written at once (a plain stream over TCP) needs no yield before the flush.
            if early.send(msg) == Sent::Queued {
                sent.store(true, Ordering::Relaxed);
            }
            true
        }));
        // A follower's acknowledgements leave as soon as its flush is done, before it applies
        // what the same append committed (the leader waits for them; it does not wait for the
        // apply). On a plain stream over TCP `send` writes them to the socket itself;
        // what it queued is written when the turn ends (`run` yields to it).
        let answers_sent = Arc::new(AtomicBool::new(false));
        let (flushed, sent) = (on_thread.clone(), answers_sent.clone());
        core.send_after_flush_with(Box::new(move |msg: &Message, _: &Raft| {
            if !matches!(msg.body, MessageBody::AppendResponse { .. }) {
                return false;
            }
            super::probe::ack_sent();
            if flushed.send(msg) == Sent::Queued {
                sent.store(true, Ordering::Relaxed);
            }
            true
        }));
        Driver {
            core,
            flush_done,
            epoch: Instant::now(),
            transport,
            on_thread,
            appends_sent,
            answers_sent,
            addresses,
            metrics,
            cfg,
            inputs,
            status,
            snapshot_job: None,
            install_started: None,
            heartbeat_sent: HashMap::new(),
            lag_gauges: HashMap::new(),
            replication_buf: Vec::new(),
            commit_marks: std::collections::VecDeque::new(),
            batch_started: std::time::Instant::now(),
            snapshot_started: None,
            lag_clock: None,
            last_heard: HashMap::new(),
            members_seen: Default::default(),
            cluster_seen: None,
            cluster_id_cell,
            logged_stats: Default::default(),
            leader_seen: 0,
        }
    }

    fn now(&self) -> Micros {
        self.epoch.elapsed().as_micros() as Micros
    }

    /// Runs until the input queue closes (every sender dropped) or a shutdown is requested.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(self.cfg.tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.publish_status();
        let mut inputs = 0usize;
        let mut handled = Duration::ZERO;
        let flush_done = self.flush_done.clone();
        loop {
            // Work left over from a turn that used up its budget; taken in turn with ticks
            // and inputs (select! picks among ready branches at random).
            let more = self.core.raft().has_ready() || self.core.installing_snapshot().is_some();
            let result = tokio::select! {
                _ = std::future::ready(()), if more => {
                    self.batch_started = std::time::Instant::now();
                    // This branch is ready at every turn while a snapshot is installed, and
                    // select! picks among ready branches at random: a tick that is due is
                    // taken here too, so that the election clock (by which this node grants
                    // PreVotes once its leader is gone) does not run slow meanwhile.
                    let ticked = match futures::FutureExt::now_or_never(ticker.tick()) {
                        Some(_) => self.on_tick(),
                        None => Ok(()),
                    };
                    match ticked {
                        Ok(()) => self.drive().await,
                        err => err,
                    }
                }
                // Flushes completed on the storage's thread: their Readies' answers leave,
                // what they committed applies.
                _ = flush_done.notified(), if self.core.flushes_in_flight() => {
                    self.batch_started = std::time::Instant::now();
                    self.core.finish_drive()
                }
                _ = ticker.tick() => {
                    self.batch_started = std::time::Instant::now();
                    self.on_tick()
                }
                input = self.inputs.recv() => {
                    let Some(input) = input else { break };
                    self.batch_started = std::time::Instant::now();
                    let mut batch = Vec::with_capacity(64);
                    batch.push(input);
                    while batch.len() < self.cfg.max_batch_inputs {
                        match self.inputs.try_recv() {
                            Ok(more) => batch.push(more),
                            Err(_) => break,
                        }
                    }
                    let span = tracing::debug_span!(
                        "raft.batch",
                        inputs = batch.len() as i64,
                        commit_index = tracing::field::Empty,
                    );
                    let _entered = span.enter();
                    inputs = batch.len();
                    self.handle_inputs(batch);
                    handled = self.batch_started.elapsed();
                    let result = self.drive().await;
                    if !span.is_disabled() {
                        span.record("commit_index", self.core.raft().commit_index() as i64);
                    }
                    result
                }
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        self.graceful_shutdown().await;
                        break;
                    }
                    Ok(())
                }
            };
            let mut result = result;
            // One slice of a snapshot install per turn (the branch above): the ticks, votes and
            // appends waiting meanwhile are taken between slices.
            while result.is_ok()
                && self.core.raft().has_ready()
                && self.batch_started.elapsed() < TURN_BUDGET
            {
                result = self.drive().await;
            }
            let driven = self.batch_started.elapsed();
            let result = result.and_then(|()| self.after_drive());
            if let Err(err) = result {
                error!(cause = %err, "storage failure; stopping the node");
                break;
            }
            let took = self.batch_started.elapsed();
            let storage = self.core.storage_mut().take_spent();
            if took >= SLOW_TURN {
                // Peers hear nothing from this node while a turn runs: a leader's turn near the
                // election timeout costs its leadership.
                warn!(
                    took_ms = took.as_millis() as u64,
                    inputs,
                    inputs_ms = handled.as_millis() as u64,
                    drive_ms = driven.saturating_sub(handled).as_millis() as u64,
                    effects_ms = took.saturating_sub(driven).as_millis() as u64,
                    append_ms = storage.append.as_millis() as u64,
                    apply_ms = storage.apply.as_millis() as u64,
                    flush_ms = storage.flush.as_millis() as u64,
                    "slow driver turn"
                );
            }
            inputs = 0;
            handled = Duration::ZERO;
            // Answers, and appends queued by a drive that did not yield (a tick's), wait in
            // the streams that run on this thread: let them write before the next turn.
            let answers = self.answers_sent.swap(false, Ordering::Relaxed);
            let appends = self.appends_sent.swap(false, Ordering::Relaxed);
            // A snapshot being installed keeps the next turn ready at once: the streams and
            // the peer port's requests (votes) on this thread get their turn in between.
            if answers || appends || self.core.installing_snapshot().is_some() {
                tokio::task::yield_now().await;
            }
        }
        if let Err(err) = self
            .finish_snapshot_job()
            .and_then(|()| self.core.shutdown())
        {
            error!(cause = %err, "could not write the applied state at shutdown");
        }
        self.handle_effects();
    }

    /// A tick: where the next flushes run, a finished snapshot job, and the core's clock.
    fn on_tick(&mut self) -> Result<(), StorageError> {
        self.core.storage_mut().choose_flush_thread();
        let now = self.now();
        self.poll_snapshot_job().and_then(|()| self.core.tick(now))
    }

    /// One Ready: up to its flush, then (when the leader queued appends for the peers) a yield
    /// to the streams on this thread so that they write them to their sockets, then the flush
    /// and the rest. The followers write the entries while the leader flushes its own copy.
    async fn drive(&mut self) -> Result<(), StorageError> {
        if self.core.drive_until_flush()? && self.appends_sent.swap(false, Ordering::Relaxed) {
            tokio::task::yield_now().await;
        }
        self.core.finish_drive()
    }

    /// Carries out what the core asked for and publishes the new status.
    fn after_drive(&mut self) -> Result<(), StorageError> {
        self.handle_effects();
        if self.core.needs_snapshot_result() {
            self.finish_snapshot_job()?;
            self.handle_effects();
        }
        self.publish_status();
        let members = self.core.raft().membership();
        self.transport.retain(|id| members.contains(id));
        self.on_thread.retain(|id| members.contains(id));
        Ok(())
    }

    /// On SIGTERM: hand leadership to the most caught-up voter, give it a moment, flush.
    async fn graceful_shutdown(&mut self) {
        let Some(target) = self.core.transfer_leadership() else {
            return;
        };
        info!(to = target, "transferring leadership before shutdown");
        let deadline = Instant::now() + self.cfg.tick * 40;
        while Instant::now() < deadline && self.core.raft().is_leader() {
            if self.core.drive().and_then(|()| self.after_drive()).is_err() {
                return;
            }
            let result = tokio::select! {
                _ = tokio::time::sleep(self.cfg.tick) => {
                    let now = self.now();
                    self.core.tick(now)
                }
                input = self.inputs.recv() => match input {
                    Some(input) => {
                        self.handle_inputs(vec![input]);
                        self.core.drive()
                    }
                    None => return,
                },
            };
            if result.and_then(|()| self.after_drive()).is_err() {
                return;
            }
        }
    }

    fn handle_inputs(&mut self, batch: Vec<Input>) {
        let now = self.now();
        for input in batch {
            match input {
                Input::Peer(msg) => self.step_peer(now, msg),
                Input::Client { op, conn, reply } => {
                    super::probe::event("picked");
                    self.metrics
                        .requests_total
                        .with_label_values(&[op.name(), "received"])
                        .inc();
                    self.core.client_request(now, op, conn, reply);
                }
                Input::Disconnected { conn } => self.core.disconnected(now, conn),
                Input::Join {
                    id,
                    peer_addr,
                    client_addr,
                    incarnation,
                    reply,
                } => {
                    let raft = self.core.raft();
                    let leader_id = raft.leader_id();
                    let mut answer = JoinReply {
                        success: false,
                        leader_id,
                        leader_peer_addr: self
                            .addresses
                            .get(leader_id)
                            .map(|a| a.peer)
                            .unwrap_or_default(),
                        term: raft.term(),
                        error: String::new(),
                    };
                    let leading = raft.is_leader();
                    let info = crate::lock::MemberInfo {
                        peer_addr: peer_addr.clone(),
                        client_addr: client_addr.clone(),
                        incarnation,
                    };
                    match self.core.join(id, info) {
                        Ok(crate::node::lifecycle::JoinOutcome::Accepted) => {
                            // Only an accepted join changes where the node is reached: a
                            // refused one leaves the address book as it was.
                            if leading {
                                self.addresses.learn(id, &peer_addr, &client_addr);
                            }
                            info!(node = id, addr = %peer_addr, "adding learner");
                            answer.success = true;
                        }
                        Ok(crate::node::lifecycle::JoinOutcome::Replacing) => {
                            self.addresses.set_incarnation(id, incarnation);
                            warn!(
                                node = id,
                                incarnation,
                                "node {id} joins with a new incarnation (its data is gone): \
                                 removing its old incarnation; it is added as a learner when it \
                                 asks again"
                            );
                            answer.error = format!(
                                "replacing node {id}'s old incarnation; ask again to be added"
                            );
                        }
                        Err(err) => answer.error = err,
                    }
                    let _ = reply.send(answer);
                }
                Input::Remove { id, reply } => {
                    let result = self.core.remove(id).map_err(|e| self.with_leader_addr(e));
                    let _ = reply.send(result);
                }
                Input::Locks { prefix, reply } => {
                    let _ = reply.send(self.core.list_locks(&prefix, 10_000));
                }
                Input::TransferLeadership { reply } => {
                    let _ = reply.send(self.core.transfer_leadership().is_some());
                }
                Input::PeerVersion { id, version } => {
                    self.core.peer_version(id, version);
                    if self.core.runs_older_version(id) {
                        warn!(
                            node = id,
                            version,
                            cluster_version = self.core.state_machine().cluster_version(),
                            "member runs an older RaftLock than the cluster's version: it cannot \
                             apply this log, so its messages are ignored until it runs a current one"
                        );
                    }
                }
                Input::PeerInfo { id, info } => self.core.peer_info(id, info),
                Input::Admitted => {
                    if self.core.is_joining() {
                        self.core.set_joining(false);
                    }
                }
            }
        }
    }

    fn step_peer(&mut self, now: Micros, msg: Message) {
        self.last_heard.insert(msg.from, std::time::Instant::now());
        super::probe::peer_message_stepped(&msg);
        if matches!(msg.body, MessageBody::HeartbeatResponse { .. }) {
            if let Some(sent) = self.heartbeat_sent.remove(&msg.from) {
                self.metrics
                    .peer_rtt_seconds
                    .with_label_values(&[&msg.from.to_string()])
                    .observe(sent.elapsed().as_secs_f64());
            }
        }
        self.core.step(now, msg);
    }

    /// Sends to a peer, timing one heartbeat per peer at a time.
    fn send_peer(&mut self, msg: &Message) {
        let _span = replicate_span(msg, self.core.raft().last_index());
        if matches!(msg.body, MessageBody::Heartbeat { .. }) {
            let now = Instant::now();
            let timed = self.heartbeat_sent.entry(msg.to).or_insert(now);
            // A heartbeat whose answer never came (peer down, message lost) stops being timed.
            if now.duration_since(*timed) > HEARTBEAT_RTT_GIVE_UP {
                *timed = now;
            }
        }
        self.transport.send(msg);
    }

    fn with_leader_addr(&self, mut err: ApiError) -> ApiError {
        if err.leader_id != 0 && err.leader_addr.is_empty() {
            err.leader_addr = self
                .addresses
                .get(err.leader_id)
                .map(|a| a.client)
                .unwrap_or_default();
        }
        err
    }

    fn handle_effects(&mut self) {
        for effect in self.core.take_effects() {
            match effect {
                Effect::Send(msg) => self.send_peer(&msg),
                Effect::Reply(tx, reply) => {
                    super::probe::event("replied");
                    let reply = match reply {
                        ClientReply::Error(e) => ClientReply::Error(self.with_leader_addr(e)),
                        other => other,
                    };
                    let _ = tx.send(reply);
                }
                Effect::BuildSnapshot(job) => {
                    let (tx, rx) = std::sync::mpsc::sync_channel(1);
                    let spawned = std::thread::Builder::new()
                        .name("raftlock-snapshot".into())
                        .spawn(move || {
                            let _ = tx.send(job());
                        });
                    match spawned {
                        Ok(_) => {
                            self.snapshot_job = Some(rx);
                            self.snapshot_started = Some(std::time::Instant::now());
                        }
                        Err(err) => {
                            let now = self.now();
                            let failed = Err(StorageError::Io {
                                action: "starting the snapshot thread",
                                source: err,
                            });
                            if let Err(err) = self.core.snapshot_built(now, failed) {
                                warn!(cause = %err, "snapshot not taken");
                            }
                        }
                    }
                }
                Effect::Observe(o) => self.observe(o),
            }
        }
    }

    fn observe(&mut self, o: Observation) {
        let m = &self.metrics;
        match o {
            Observation::BecameLeader { term } => {
                let voters = self.core.raft().membership().voters.len() as i64;
                tracing::debug_span!("raft.election", term = term as i64, outcome = "won", voters)
                    .in_scope(|| info!(term, "became leader"));
            }
            Observation::LostLeadership { term, leader } => {
                tracing::debug_span!(
                    "raft.leadership_lost",
                    term = term as i64,
                    new_leader = leader as i64
                )
                .in_scope(|| info!(term, leader, "no longer leader"));
            }
            Observation::LeaderChanged { leader } => {
                m.leader_changes_total.inc();
                self.cfg
                    .watch
                    .leader_changed(leader, self.core.raft().term());
            }
            Observation::LockEvents(events) => self.cfg.watch.publish(events),
            Observation::Granted { waited_us } => {
                m.lock_grants_total.inc();
                if let Some(us) = waited_us {
                    m.lock_wait_seconds.observe(us as f64 / 1e6);
                }
            }
            Observation::LeaseEnded { held_us, expired } => {
                m.lock_hold_seconds.observe(held_us as f64 / 1e6);
                if expired {
                    m.lock_expirations_total.inc();
                } else {
                    m.lock_releases_total.inc();
                }
            }
            Observation::Renewed => m.lock_renewals_total.inc(),
            Observation::Answered { op, result } => {
                m.proposals_committed_total.inc();
                m.requests_total.with_label_values(&[op, result]).inc();
            }
            Observation::ProposalFailed => m.proposals_failed_total.inc(),
            Observation::Refused { op, result } => {
                m.requests_total.with_label_values(&[op, result]).inc();
            }
            Observation::LogCompacted { index } => {
                m.snapshots_total.with_label_values(&["taken"]).inc();
                tracing::debug_span!("raft.snapshot", kind = "taken", index = index as i64)
                    .in_scope(|| info!(index, "log compacted to the stored state"));
            }
            Observation::SnapshotEncoded { index, bytes } => {
                m.snapshots_total.with_label_values(&["encoded"]).inc();
                let took = self.snapshot_started.take().map(|at| at.elapsed());
                if let Some(took) = took {
                    m.snapshot_duration_seconds.observe(took.as_secs_f64());
                }
                let took_ms = took.map_or(0, |t| t.as_millis() as u64);
                tracing::debug_span!(
                    "raft.snapshot",
                    kind = "encoded",
                    index = index as i64,
                    bytes = bytes as i64
                )
                .in_scope(|| info!(index, bytes, took_ms, "snapshot encoded for a follower"));
            }
            Observation::SnapshotInstallStarted { index, bytes } => {
                self.install_started = Some(Instant::now());
                info!(
                    index,
                    bytes, "installing a snapshot from the leader; votes are answered meanwhile"
                );
            }
            Observation::SnapshotInstalled { index } => {
                let took_ms = self
                    .install_started
                    .take()
                    .map(|t| t.elapsed().as_millis() as u64);
                self.cfg.watch.reset(index);
                m.snapshots_total.with_label_values(&["installed"]).inc();
                tracing::debug_span!("raft.snapshot", kind = "installed", index = index as i64)
                    .in_scope(|| info!(index, took_ms, "installed snapshot from leader"));
            }
            Observation::RemovedFromCluster => info!("this node was removed from the cluster"),
            Observation::Admitted => {
                info!("admitted: the log records this incarnation; taking part in elections");
                if let Some(mark) = self.cfg.admission_mark.take() {
                    if let Err(err) = std::fs::remove_file(&mark) {
                        warn!(path = %mark.display(), %err, "cannot remove the admission mark");
                    }
                }
            }
            Observation::Undecodable { index } => {
                error!(index, "undecodable command in the log; skipped")
            }
            Observation::MemberReplaced { id } => {
                warn!(
                    node = id,
                    "removed node {id}'s old incarnation: it lost its data"
                )
            }
            Observation::LimitRefused { limit } => {
                m.limit_refusals_total.with_label_values(&[&limit]).inc();
            }
            Observation::DeadMemberRemoved { id } => warn!(
                node = id,
                "removed node {id}: not heard from for the dead-member timeout"
            ),
            Observation::Housekeeping { .. }
            | Observation::MemberRemoved { .. }
            | Observation::Persisted(_)
            | Observation::Applied { .. } => {}
        }
    }

    /// Hands a finished snapshot job's result to the core.
    fn poll_snapshot_job(&mut self) -> Result<(), StorageError> {
        let Some(rx) = &self.snapshot_job else {
            return Ok(());
        };
        let result = match rx.try_recv() {
            Err(std::sync::mpsc::TryRecvError::Empty) => return Ok(()),
            Ok(result) => result,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => Err(snapshot_thread_gone()),
        };
        self.snapshot_job = None;
        let now = self.now();
        self.core.snapshot_built(now, result)
    }

    /// Waits for the snapshot being built, if any, and hands its result to the core.
    fn finish_snapshot_job(&mut self) -> Result<(), StorageError> {
        let Some(rx) = self.snapshot_job.take() else {
            return Ok(());
        };
        let result = rx.recv().unwrap_or_else(|_| Err(snapshot_thread_gone()));
        let now = self.now();
        self.core.snapshot_built(now, result)
    }

    fn publish_status(&mut self) {
        let raft = self.core.raft();
        let sm = self.core.state_machine();
        let membership = raft.membership();
        let leader_id = raft.leader_id();
        let role = role_name(raft.role());
        let term = raft.term();
        let commit_index = raft.commit_index();
        let applied_index = raft.applied_index();
        let last_index = raft.last_index();
        let locks_held = sm.locks_held() as u64;
        let waiters = sm.waiter_count() as u64;
        let cluster_version = sm.cluster_version();
        let quotas_in_force = sm.quotas().is_some();
        let cluster_changed = sm.cluster_id() != self.cluster_seen;
        if cluster_changed {
            self.cluster_seen = sm.cluster_id();
            if let Some(c) = sm.cluster_identity() {
                let id = format!("{:032x}", c.id);
                info!(cluster_id = %id, "this cluster's id");
                self.metrics.cluster_info.with_label_values(&[&id]).set(1);
                if let Ok(mut cell) = self.cluster_id_cell.write() {
                    *cell = id;
                }
            }
        }
        let has_data = raft.last_index() > 0 || raft.snapshot_index() > 0 || term > 0;
        if sm.members() != &self.members_seen {
            self.members_seen = sm.members().clone();
            for (id, m) in &self.members_seen {
                self.addresses
                    .learn_member(*id, &m.peer_addr, &m.client_addr, m.incarnation);
            }
        }
        let installing_snapshot = self.core.installing_snapshot();
        let m = &self.metrics;
        m.term.set(term as i64);
        m.is_leader.set(i64::from(raft.is_leader()));
        m.has_leader.set(i64::from(leader_id != 0));
        m.commit_index.set(commit_index as i64);
        m.applied_index.set(applied_index as i64);
        m.last_log_index.set(last_index as i64);
        let stats = raft.stats();
        if stats.pre_votes_started != self.logged_stats.pre_votes_started
            || stats.elections_started != self.logged_stats.elections_started
            || stats.quorum_lost != self.logged_stats.quorum_lost
        {
            let heard = |id: NodeId| {
                self.last_heard
                    .get(&id)
                    .map(|t| t.elapsed().as_millis() as i64)
                    .unwrap_or(-1)
            };
            if stats.quorum_lost != self.logged_stats.quorum_lost {
                let ms: Vec<(NodeId, i64)> = membership
                    .voters
                    .iter()
                    .filter(|&&v| v != raft.id())
                    .map(|&v| (v, heard(v)))
                    .collect();
                warn!(
                    term,
                    last_heard_ms = ?ms,
                    "stepping down: fewer than a quorum answered within an election timeout"
                );
            } else {
                let prev = self.leader_seen;
                warn!(
                    term,
                    last_leader = prev,
                    last_heard_from_it_ms = heard(prev),
                    pre_vote = stats.pre_votes_started != self.logged_stats.pre_votes_started,
                    "election timeout: no word from a leader; campaigning"
                );
            }
            self.logged_stats = stats;
        }
        if leader_id != 0 {
            self.leader_seen = leader_id;
        }
        let elections = stats.elections_started;
        let counted = m.elections_total.get();
        if elections > counted {
            m.elections_total.inc_by(elections - counted);
        }
        m.locks_held.set(locks_held as i64);
        m.lock_waiters.set(waiters as i64);
        m.answers_remembered.set(sm.dedupe_len() as i64);
        m.answers_max.set(sm.limits().dedupe_entries_max as i64);
        m.answers_recent.set(self.core.paced_recent() as i64);
        m.client_sessions.set(sm.session_count() as i64);
        m.cluster_version.set(i64::from(cluster_version));
        m.proposals_pending.set(self.core.pending_requests() as i64);
        // Runs after every batch of inputs, several times per lock cycle: the replication view
        // is kept in a reused buffer and each peer's lag gauges are looked up once, when the
        // peer first appears, so that nothing here allocates while nothing changes.
        let mut replication = std::mem::take(&mut self.replication_buf);
        replication.clear();
        if raft.is_leader() {
            let now = std::time::Instant::now();
            let clock = self
                .lag_clock
                .get_or_insert_with(|| LagClock::new(now, last_index));
            clock.observe_last_index(now, last_index);
            let mut min_matched = last_index;
            for peer in membership.members().filter(|&p| p != raft.id()) {
                if let Some((matched, _, _)) = raft.progress(peer) {
                    let gauges = self.lag_gauges.entry(peer).or_insert_with(|| {
                        let label = peer.to_string();
                        (
                            m.replication_lag_entries.with_label_values(&[&label]),
                            m.replication_lag_seconds.with_label_values(&[&label]),
                        )
                    });
                    gauges.0.set(last_index.saturating_sub(matched) as i64);
                    gauges
                        .1
                        .set(clock.lag(now, matched, last_index).as_secs_f64());
                    min_matched = min_matched.min(matched);
                    replication.push(PeerReplication {
                        id: peer,
                        match_index: matched,
                        lag_entries: last_index.saturating_sub(matched),
                    });
                }
            }
            clock.forget_before(min_matched);
            if self
                .commit_marks
                .back()
                .is_none_or(|&(i, _)| i < last_index)
            {
                if self.commit_marks.len() == COMMIT_MARKS_MAX {
                    self.commit_marks.pop_front();
                }
                // The entries were proposed by the batch or tick being finished.
                let proposed = self.batch_started.min(now);
                self.commit_marks.push_back((last_index, proposed));
            }
            while let Some(&(index, at)) = self.commit_marks.front() {
                if index > commit_index {
                    break;
                }
                m.commit_duration_seconds
                    .observe(now.saturating_duration_since(at).as_secs_f64());
                self.commit_marks.pop_front();
            }
            self.lag_gauges.retain(|peer, _| {
                let keep = replication.iter().any(|r| r.id == *peer);
                if !keep {
                    remove_lag_series(m, *peer);
                }
                keep
            });
        } else {
            self.lag_clock = None;
            self.commit_marks.clear();
            for (gone, _) in self.lag_gauges.drain() {
                remove_lag_series(m, gone);
            }
        }
        // Published after every batch, not on a timer: a follower asks the leader's peer port
        // for its commit index (from this status) and waits until it has applied that much
        // before judging a seed-004 release, so a commit index published late lets the follower
        // judge on state older than an answer the leader already gave (tests/seed004_grpc.rs
        // caught a 5 ms publishing interval doing that).
        let addresses = &self.addresses;
        self.status.send_if_modified(|old| {
            let leader_addr_same = addresses.client_addr_is(leader_id, &old.leader_addr);
            let changed = old.term != term
                || old.leader_id != leader_id
                || old.role != role
                || old.commit_index != commit_index
                || old.applied_index != applied_index
                || old.last_index != last_index
                || !old.voters.iter().eq(membership.voters.iter())
                || !old.learners.iter().eq(membership.learners.iter())
                || !leader_addr_same
                || old.locks_held != locks_held
                || old.waiters != waiters
                || old.cluster_version != cluster_version
                || old.quotas_in_force != quotas_in_force
                || cluster_changed
                || old.has_data != has_data
                || old.installing_snapshot != installing_snapshot
                || old.replication != replication;
            if changed {
                old.id = raft.id();
                old.term = term;
                old.leader_id = leader_id;
                if old.role != role {
                    old.role = role.to_string();
                }
                old.commit_index = commit_index;
                old.applied_index = applied_index;
                old.last_index = last_index;
                if !old.voters.iter().eq(membership.voters.iter()) {
                    old.voters = membership.voters.iter().copied().collect();
                }
                if !old.learners.iter().eq(membership.learners.iter()) {
                    old.learners = membership.learners.iter().copied().collect();
                }
                if !leader_addr_same {
                    old.leader_addr = addresses
                        .get(leader_id)
                        .map(|a| a.client)
                        .unwrap_or_default();
                }
                old.locks_held = locks_held;
                old.waiters = waiters;
                old.cluster_version = cluster_version;
                old.quotas_in_force = quotas_in_force;
                old.has_data = has_data;
                if cluster_changed {
                    if let Some(c) = sm.cluster_identity() {
                        old.cluster_id = format!("{:032x}", c.id);
                        old.forced_by.clone_from(&c.forced_by);
                    }
                }
                old.installing_snapshot = installing_snapshot;
                if old.replication != replication {
                    old.replication.clone_from(&replication);
                }
            }
            changed
        });
        self.replication_buf = replication;
    }
}

/// `/status`'s name for a role.
fn role_name(role: crate::raft::Role) -> &'static str {
    match role {
        crate::raft::Role::Follower => "follower",
        crate::raft::Role::PreCandidate => "precandidate",
        crate::raft::Role::Candidate => "candidate",
        crate::raft::Role::Leader => "leader",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(background: bool) -> TimedStorage<crate::storage::MemStorage> {
        TimedStorage::new(
            crate::storage::MemStorage::new(),
            NodeMetrics::new(),
            background,
            FlushMode::Auto,
        )
    }

    /// Runs `ticks` ticks, each with `flushes` flushes of which `pressed` had work waiting.
    fn ticks(
        s: &mut TimedStorage<crate::storage::MemStorage>,
        n: usize,
        flushes: u32,
        pressed: u32,
    ) {
        for _ in 0..n {
            (s.flushes, s.pressed) = (flushes, pressed);
            s.choose_flush_thread();
            assert_eq!((s.flushes, s.pressed), (0, 0));
        }
    }

    #[test]
    fn flushes_move_to_the_flush_thread_under_pressure_and_back_when_it_ends() {
        let mut s = timed(true);
        // Ticks with few flushes, or with flushes that had nothing waiting: the driver's thread.
        ticks(&mut s, 50, 3, 3);
        assert!(!s.offload);
        ticks(&mut s, 50, 10, 4);
        assert!(!s.offload);
        // One tick where most flushes had work waiting is not enough.
        ticks(&mut s, 1, 10, 10);
        assert!(!s.offload);
        assert_eq!(s.metrics.flush_thread_switches_total.get(), 0);
        // Several are: the flush thread.
        ticks(&mut s, 10, 10, 8);
        assert!(s.offload);
        assert_eq!(s.metrics.flush_thread_active.get(), 1);
        assert_eq!(s.metrics.flush_thread_switches_total.get(), 1);
        // It stays there while about a quarter of them overlap another, and through a tick or
        // two with none.
        ticks(&mut s, 50, 8, 3);
        ticks(&mut s, 2, 0, 0);
        assert!(s.offload);
        // Ticks that alternate between 60% and none waiting (each one alone across both
        // bounds) average out at 30%: no switch back and forth.
        for _ in 0..50 {
            ticks(&mut s, 1, 10, 6);
            ticks(&mut s, 1, 10, 0);
            assert!(s.offload);
        }
        assert_eq!(s.metrics.flush_thread_switches_total.get(), 1);
        // Below a quarter for a while: back to the driver's thread.
        ticks(&mut s, 20, 10, 1);
        assert!(!s.offload);
        assert_eq!(s.metrics.flush_thread_active.get(), 0);
        assert_eq!(s.metrics.flush_thread_switches_total.get(), 2);
        // Nor between 80% and none (40%) on the driver's thread.
        for _ in 0..50 {
            ticks(&mut s, 1, 10, 8);
            ticks(&mut s, 1, 10, 0);
            assert!(!s.offload);
        }
        // An idle stretch after load brings it back within about a tenth of a second.
        ticks(&mut s, 20, 10, 10);
        assert!(s.offload);
        ticks(&mut s, 12, 0, 0);
        assert!(!s.offload);
    }

    #[test]
    fn without_background_flushes_every_flush_is_inline() {
        let mut s = timed(false);
        (s.flushes, s.pressed) = (100, 100);
        s.choose_flush_thread();
        assert!(!s.offload);
        assert_eq!(s.start_flush().unwrap(), u64::MAX);
    }
}
