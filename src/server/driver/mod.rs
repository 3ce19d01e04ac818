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
//!
//! Here: the driver's inputs and settings, the [`Driver`] and how it is built. Its children:
//! - `arrival`: the commit delay, a batch's short wait for the clients just answered;
//! - `run`: the loop, one turn at a time, and the graceful shutdown;
//! - `inputs`: what comes off the input queue, handed to the core;
//! - `effects`: what the core asks for (sends, answers, snapshot builds, observations);
//! - `status`: [`NodeStatus`], the gauges and the replication lag, published after each turn;
//! - `timed_storage`: storage timed for the metrics, flushing inline or on the flush thread.

mod arrival;
mod effects;
mod inputs;
mod run;
mod status;
mod timed_storage;

use effects::replicate_span;
pub use status::{NodeStatus, PeerReplication};
pub use timed_storage::{FlushMode, StorageTime, TimedStorage};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::warn;

use super::api::{ApiError, ClientOp, ClientReply};
use super::replication_lag::LagClock;
use super::transport::{AddressBook, PeerTransport, Sent};
use crate::lock::LockStateMachine;
use crate::node::{Micros, NodeCore, NodeSettings};
use crate::raft::{Message, MessageBody, NodeId, Raft, Snapshot};
use crate::storage::{SledStorage, StorageError};
use crate::telemetry::NodeMetrics;

/// Inputs accepted by the driver.
#[derive(Debug)]
pub enum Input {
    Peer(Message),
    Client {
        op: ClientOp,
        conn: u64,
        reply: oneshot::Sender<ClientReply>,
        /// The request's span (disabled when not traced): linked to the batch that carries it.
        span: tracing::Span,
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
    /// The longest a batch of client requests waits for the next request of the clients just
    /// answered (`--commit-delay`; zero: never). See `arrival`.
    pub commit_delay: Duration,
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
    /// The commit delay: the clients answered and not heard from since, what waits taught.
    arrival: arrival::ArrivalWait,
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
    /// When this node began campaigning with no leader known (for
    /// `raftlock_election_duration_seconds`).
    election_started: Option<std::time::Instant>,
    /// The commit and applied indexes last counted in `raftlock_entries_*_total` (none before
    /// the first status: what the node recovered is not counted).
    indexes_counted: Option<(crate::raft::Index, crate::raft::Index)>,
    /// The size of the snapshot being installed (for `raftlock_snapshot_bytes{kind="installed"}`).
    install_bytes: u64,
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
            arrival: arrival::ArrivalWait::new(cfg.commit_delay),
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
            election_started: None,
            indexes_counted: None,
            install_bytes: 0,
        }
    }

    fn now(&self) -> Micros {
        self.epoch.elapsed().as_micros() as Micros
    }
}
