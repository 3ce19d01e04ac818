//! The node driver: one task that owns the Raft core, the lock state machine and storage, and is
//! the only place they change.
//!
//! ```text
//!   peers ──┐                                         ┌─► peer transport (messages)
//!   clients ├─► bounded input queue ─► Driver loop ───┼─► storage (persist, flush once per Ready)
//!   ticks ──┘        (drained in batches)             └─► lock state machine ─► client replies
//! ```
//! Proposals that arrive together are proposed together, so one flush covers many operations
//! (group commit). Client answers leave only after the entry is applied — which implies it was
//! durably committed on a quorum. Leader duties (lease expiry, waiter timeouts, reclaiming waiters
//! of vanished clients, promoting caught-up learners) run on the tick.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::api::{ApiError, ClientOp, ClientReply, ErrorCode};
use super::transport::{AddressBook, PeerTransport};
use crate::lock::{Command, Event, FencingToken, LockStateMachine, Outcome, RejectCode};
use crate::raft::{
    EntryPayload, Index, MembershipChange, Message, MessageBody, NodeId, ProposeError, Raft, Ready,
    Role,
};
use crate::storage::{decode_snapshot_data, Storage, StorageError};
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
}

#[derive(Clone, Debug)]
pub struct JoinReply {
    pub success: bool,
    pub leader_id: NodeId,
    pub leader_peer_addr: String,
    pub term: u64,
    pub error: String,
}

/// One lock as the admin endpoint shows it.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LockInfo {
    pub key: String,
    pub holder: Option<String>,
    pub fencing_token: Option<u64>,
    pub ttl_ms: Option<u64>,
    pub waiters: Vec<String>,
}

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
}

impl NodeStatus {
    /// Member of a cluster with a known leader, and caught up with the commit index.
    pub fn is_ready(&self) -> bool {
        let member = self.voters.contains(&self.id) || self.learners.contains(&self.id);
        member && self.leader_id != 0 && self.applied_index + 16 >= self.commit_index
    }
}

/// How long applied state may stay only in memory before it is written to storage.
///
/// Applied state is a cache of the committed log: after a crash the node recovers the last written
/// state with its index and re-applies the committed entries after it, which the log still holds
/// (compaction never passes the written applied index). Writing it every few milliseconds instead
/// of after every apply lets a key that is acquired and released in between be written once.
const APPLIED_WRITE_INTERVAL: Duration = Duration::from_millis(100);
/// Changed keys held in memory before applied state is written regardless of the interval.
const APPLIED_WRITE_MAX_KEYS: usize = 8192;

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
}

struct PendingProposal {
    op_name: &'static str,
    reply: Option<oneshot::Sender<ClientReply>>,
    conn: u64,
    wait_timeout_ms: Option<u64>,
    started: Instant,
}

/// A queued acquire whose client is waiting for the grant.
struct Waiting {
    key: String,
    reply: Option<oneshot::Sender<ClientReply>>,
    conn: u64,
    enqueued: Instant,
}

/// Leader-side lease of one held lock.
struct Lease {
    token: u64,
    deadline: Instant,
    granted: Instant,
    expiry_proposed: bool,
}

pub struct Driver {
    raft: Raft,
    /// Bytes of log appended since the last snapshot (for `snapshot_bytes`).
    log_bytes_since_snapshot: u64,
    storage: Box<dyn Storage + Send>,
    sm: LockStateMachine,
    transport: PeerTransport,
    addresses: AddressBook,
    metrics: NodeMetrics,
    cfg: DriverConfig,
    inputs: mpsc::Receiver<Input>,
    status: watch::Sender<NodeStatus>,
    pending: HashMap<Index, PendingProposal>,
    waiting: HashMap<(String, String), Waiting>,
    /// Leader only: lease deadlines on the monotonic clock.
    leases: HashMap<String, Lease>,
    /// Leader only: waiter (client, request) -> when to cancel it (wait timeout or reclaim).
    waiter_deadlines: HashMap<(String, String), (String, Instant)>,
    reads: HashMap<u64, (String, oneshot::Sender<ClientReply>)>,
    read_indexes: Vec<(Index, u64)>,
    next_read_ctx: u64,
    /// Learners that asked to join and are promoted once caught up.
    promote_when_caught_up: Vec<NodeId>,
    was_leader: bool,
    last_leader: NodeId,
    /// Applied-state changes not yet handed to storage (key -> new value, None = deleted), and
    /// the index they bring the stored state to.
    unwritten_changes: HashMap<Vec<u8>, Option<Vec<u8>>>,
    unwritten_applied: Option<Index>,
    applied_written_at: Instant,
    /// A snapshot being built on another thread. While it runs the applied state in storage must
    /// not change, so applied-state writes wait (see [`Driver::write_applied`]).
    snapshot_job: Option<SnapshotInProgress>,
    /// Per peer: when the heartbeat being timed was sent (for `raftlock_peer_rtt_seconds`).
    heartbeat_sent: HashMap<NodeId, Instant>,
}

fn snapshot_thread_gone() -> StorageError {
    StorageError::SnapshotData {
        problem: "the snapshot thread stopped without a result".into(),
    }
}

struct SnapshotInProgress {
    result: std::sync::mpsc::Receiver<Result<crate::raft::Snapshot, StorageError>>,
    started: std::time::Instant,
    /// Time spent on the driver thread before the job was handed off.
    prepare: Duration,
}

impl Driver {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        raft: Raft,
        storage: Box<dyn Storage + Send>,
        sm: LockStateMachine,
        transport: PeerTransport,
        metrics: NodeMetrics,
        cfg: DriverConfig,
        inputs: mpsc::Receiver<Input>,
        status: watch::Sender<NodeStatus>,
    ) -> Self {
        let addresses = transport.addresses().clone();
        Driver {
            raft,
            log_bytes_since_snapshot: 0,
            storage,
            sm,
            transport,
            addresses,
            metrics,
            cfg,
            inputs,
            status,
            pending: HashMap::new(),
            waiting: HashMap::new(),
            leases: HashMap::new(),
            waiter_deadlines: HashMap::new(),
            reads: HashMap::new(),
            read_indexes: Vec::new(),
            next_read_ctx: 0,
            promote_when_caught_up: Vec::new(),
            was_leader: false,
            last_leader: 0,
            unwritten_changes: HashMap::new(),
            unwritten_applied: None,
            applied_written_at: Instant::now(),
            snapshot_job: None,
            heartbeat_sent: HashMap::new(),
        }
    }

    /// Runs until the input queue closes (every sender dropped) or a shutdown is requested.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(self.cfg.tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.publish_status();
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    self.raft.tick();
                    self.leader_duties();
                    if let Err(err) = self.write_applied(false).and_then(|()| self.maybe_snapshot()) {
                        error!(cause = %err, "storage failure; stopping the node");
                        break;
                    }
                }
                input = self.inputs.recv() => {
                    let Some(input) = input else { break };
                    let mut batch = Vec::with_capacity(64);
                    batch.push(input);
                    while batch.len() < self.cfg.max_batch_inputs {
                        match self.inputs.try_recv() {
                            Ok(more) => batch.push(more),
                            Err(_) => break,
                        }
                    }
                    self.handle_inputs(batch);
                }
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        self.graceful_shutdown().await;
                        break;
                    }
                }
            }
            if let Err(err) = self.drive_ready() {
                error!(cause = %err, "storage failure; stopping the node");
                break;
            }
        }
        self.fail_all(ErrorCode::Unavailable, "node is shutting down");
        if let Err(err) = self
            .finish_snapshot_job()
            .and_then(|()| self.write_applied(true))
        {
            error!(cause = %err, "could not write the applied state at shutdown");
        }
        let _ = self.storage.flush();
    }

    /// On SIGTERM: hand leadership to the most caught-up voter, give it a moment, flush.
    async fn graceful_shutdown(&mut self) {
        if !self.raft.is_leader() {
            return;
        }
        let target = self
            .raft
            .membership()
            .voters
            .iter()
            .copied()
            .filter(|&v| v != self.raft.id())
            .max_by_key(|&v| self.raft.progress(v).map_or(0, |p| p.0));
        let Some(target) = target else { return };
        if self.raft.transfer_leader(target).is_err() {
            return;
        }
        info!(to = target, "transferring leadership before shutdown");
        let deadline = Instant::now() + self.cfg.tick * 40;
        while Instant::now() < deadline && self.raft.is_leader() {
            if self.drive_ready().is_err() {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.tick) => self.raft.tick(),
                input = self.inputs.recv() => match input {
                    Some(Input::Peer(msg)) => self.step_peer(msg),
                    Some(other) => self.handle_inputs(vec![other]),
                    None => return,
                },
            }
        }
        let _ = self.drive_ready();
    }

    // ----- inputs ----------------------------------------------------------------------------

    fn handle_inputs(&mut self, batch: Vec<Input>) {
        let mut proposals: Vec<(Command, PendingProposal)> = Vec::new();
        for input in batch {
            match input {
                Input::Peer(msg) => self.step_peer(msg),
                Input::Client { op, conn, reply } => {
                    self.metrics
                        .requests_total
                        .with_label_values(&[op.name(), "received"])
                        .inc();
                    self.client_op(op, conn, reply, &mut proposals)
                }
                Input::Disconnected { conn } => self.client_disconnected(conn),
                Input::Join {
                    id,
                    peer_addr,
                    client_addr,
                    reply,
                } => {
                    let _ = reply.send(self.join(id, &peer_addr, &client_addr));
                }
                Input::Remove { id, reply } => {
                    let _ = reply.send(self.remove(id));
                }
                Input::Locks { prefix, reply } => {
                    let _ = reply.send(self.list_locks(&prefix));
                }
                Input::TransferLeadership { reply } => {
                    let target = self
                        .raft
                        .membership()
                        .voters
                        .iter()
                        .copied()
                        .find(|&v| v != self.raft.id());
                    let ok = target.is_some_and(|t| self.raft.transfer_leader(t).is_ok());
                    let _ = reply.send(ok);
                }
            }
        }
        self.propose_batch(proposals);
    }

    /// Sends to a peer, timing one heartbeat per peer at a time.
    fn send_peer(&mut self, msg: &Message) {
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

    fn step_peer(&mut self, msg: Message) {
        if matches!(msg.body, MessageBody::HeartbeatResponse { .. }) {
            if let Some(sent) = self.heartbeat_sent.remove(&msg.from) {
                self.metrics
                    .peer_rtt_seconds
                    .with_label_values(&[&msg.from.to_string()])
                    .observe(sent.elapsed().as_secs_f64());
            }
        }
        self.raft.step(msg);
    }

    fn not_leader_error(&self) -> ApiError {
        let leader_id = self.raft.leader_id();
        if leader_id == 0 {
            return ApiError::new(ErrorCode::NoLeader, "no leader is known; retry shortly");
        }
        ApiError {
            code: ErrorCode::NotLeader,
            message: format!(
                "node {} is not the leader; node {leader_id} is",
                self.raft.id()
            ),
            leader_id,
            leader_addr: self
                .addresses
                .get(leader_id)
                .map(|a| a.client)
                .unwrap_or_default(),
        }
    }

    fn client_op(
        &mut self,
        op: ClientOp,
        conn: u64,
        reply: oneshot::Sender<ClientReply>,
        proposals: &mut Vec<(Command, PendingProposal)>,
    ) {
        if !self.raft.is_leader() {
            let _ = reply.send(ClientReply::Error(self.not_leader_error()));
            return;
        }
        let op_name = op.name();
        let pending = |wait_timeout_ms| PendingProposal {
            op_name,
            reply: Some(reply),
            conn,
            wait_timeout_ms,
            started: Instant::now(),
        };
        let command = match op {
            ClientOp::Get { key } => {
                self.next_read_ctx += 1;
                let ctx = self.next_read_ctx;
                match self.raft.read_index(ctx) {
                    Ok(()) => {
                        self.reads
                            .insert(ctx, (key, pending(None).reply.expect("set")));
                    }
                    Err(err) => {
                        let _ = pending(None)
                            .reply
                            .expect("set")
                            .send(ClientReply::Error(self.propose_error(err)));
                    }
                }
                return;
            }
            ClientOp::Acquire {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
            } => {
                let p = pending(wait_timeout_ms);
                let cmd = Command::Acquire {
                    key,
                    client_id,
                    request_id,
                    ttl_ms,
                    wait_timeout_ms,
                };
                proposals.push((cmd, p));
                return;
            }
            ClientOp::Release {
                key,
                client_id,
                request_id,
                token,
            } => Command::Release {
                token: FencingToken {
                    key: key.clone(),
                    value: token,
                },
                key,
                client_id,
                request_id,
            },
            ClientOp::Renew {
                key,
                client_id,
                request_id,
                token,
                ttl_ms,
            } => Command::Renew {
                token: FencingToken {
                    key: key.clone(),
                    value: token,
                },
                key,
                client_id,
                request_id,
                ttl_ms,
            },
            ClientOp::CancelWait {
                key,
                client_id,
                request_id,
            } => Command::CancelWait {
                key,
                client_id,
                request_id,
            },
            ClientOp::Put {
                key,
                value,
                guard,
                client_id,
                request_id,
            } => Command::Put {
                guard,
                key,
                value,
                client_id,
                request_id,
            },
            ClientOp::Delete {
                key,
                guard,
                client_id,
                request_id,
            } => Command::Delete {
                guard,
                key,
                client_id,
                request_id,
            },
        };
        proposals.push((command, pending(None)));
    }

    fn propose_error(&self, err: ProposeError) -> ApiError {
        match err {
            ProposeError::NotLeader { .. } => self.not_leader_error(),
            ProposeError::Busy => ApiError::new(ErrorCode::Busy, "too many requests in flight"),
            other => ApiError::new(ErrorCode::Unavailable, other.to_string()),
        }
    }

    /// Proposes every command gathered in this turn in one call: one Ready, one flush.
    fn propose_batch(&mut self, proposals: Vec<(Command, PendingProposal)>) {
        if proposals.is_empty() {
            return;
        }
        let count = proposals.len() as u64;
        let encoded: Vec<Bytes> = proposals
            .iter()
            .map(|(cmd, _)| Bytes::from(cmd.encode()))
            .collect();
        match self.raft.propose(encoded) {
            Ok(last) => {
                let first = last + 1 - count;
                for (offset, (_, pending)) in proposals.into_iter().enumerate() {
                    self.pending.insert(first + offset as u64, pending);
                }
                self.metrics
                    .proposals_pending
                    .set(self.pending.len() as i64);
            }
            Err(err) => {
                let api = self.propose_error(err);
                for (_, mut pending) in proposals {
                    self.metrics.proposals_failed_total.inc();
                    if let Some(reply) = pending.reply.take() {
                        let _ = reply.send(ClientReply::Error(api.clone()));
                    }
                }
            }
        }
    }

    /// Internal proposals of the leader (expiry, cancel of timed-out waiters).
    fn propose_internal(&mut self, commands: Vec<Command>) {
        if commands.is_empty() || !self.raft.is_leader() {
            return;
        }
        let encoded = commands.iter().map(|c| Bytes::from(c.encode())).collect();
        if let Err(err) = self.raft.propose(encoded) {
            warn!(cause = %err, "could not propose leader housekeeping");
        }
    }

    fn client_disconnected(&mut self, conn: u64) {
        let reclaim_at = Instant::now() + self.cfg.waiter_reclaim;
        for ((client, request), waiting) in &mut self.waiting {
            if waiting.conn == conn {
                waiting.reply = None;
                let entry = self
                    .waiter_deadlines
                    .entry((client.clone(), request.clone()))
                    .or_insert((waiting.key.clone(), reclaim_at));
                entry.1 = entry.1.min(reclaim_at);
            }
        }
        self.waiting
            .retain(|_, w| w.reply.is_some() || w.conn != conn);
    }

    fn join(&mut self, id: NodeId, peer_addr: &str, client_addr: &str) -> JoinReply {
        let leader_id = self.raft.leader_id();
        let mut reply = JoinReply {
            success: false,
            leader_id,
            leader_peer_addr: self
                .addresses
                .get(leader_id)
                .map(|a| a.peer)
                .unwrap_or_default(),
            term: self.raft.term(),
            error: String::new(),
        };
        if !self.raft.is_leader() {
            reply.error = "not the leader".into();
            return reply;
        }
        self.addresses.learn(id, peer_addr, client_addr);
        let membership = self.raft.membership();
        if membership.contains(id) {
            if membership.learners.contains(&id) && !self.promote_when_caught_up.contains(&id) {
                self.promote_when_caught_up.push(id);
            }
            reply.success = true;
            return reply;
        }
        match self
            .raft
            .propose_membership(MembershipChange::AddLearner(id))
        {
            Ok(_) => {
                info!(node = id, addr = peer_addr, "adding learner");
                self.promote_when_caught_up.push(id);
                reply.success = true;
            }
            Err(err) => reply.error = err.to_string(),
        }
        reply
    }

    fn remove(&mut self, id: NodeId) -> Result<(), ApiError> {
        if !self.raft.is_leader() {
            return Err(self.not_leader_error());
        }
        self.promote_when_caught_up.retain(|&n| n != id);
        self.raft
            .propose_membership(MembershipChange::RemoveServer(id))
            .map(|_| ())
            .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, e.to_string()))
    }

    fn list_locks(&self, prefix: &str) -> Vec<LockInfo> {
        let mut locks: BTreeMap<String, LockInfo> = BTreeMap::new();
        for held in self.sm.held_locks() {
            if held.key.starts_with(prefix) {
                locks.insert(
                    held.key.clone(),
                    LockInfo {
                        key: held.key.clone(),
                        holder: Some(held.client_id.clone()),
                        fencing_token: Some(held.token),
                        ttl_ms: Some(held.ttl_ms),
                        waiters: Vec::new(),
                    },
                );
            }
        }
        for waiter in self.sm.waiters() {
            if waiter.key.starts_with(prefix) {
                locks
                    .entry(waiter.key.clone())
                    .or_insert_with(|| LockInfo {
                        key: waiter.key.clone(),
                        holder: None,
                        fencing_token: None,
                        ttl_ms: None,
                        waiters: Vec::new(),
                    })
                    .waiters
                    .push(waiter.client_id.clone());
            }
        }
        locks.into_values().take(10_000).collect()
    }

    // ----- leader duties ---------------------------------------------------------------------

    fn leader_duties(&mut self) {
        if !self.raft.is_leader() {
            return;
        }
        let now = Instant::now();
        let mut commands = Vec::new();
        for (key, lease) in &mut self.leases {
            if lease.deadline <= now && !lease.expiry_proposed {
                lease.expiry_proposed = true;
                commands.push(Command::Expire {
                    key: key.clone(),
                    token: lease.token,
                });
            }
        }
        let due: Vec<(String, String)> = self
            .waiter_deadlines
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for (client_id, request_id) in due {
            if let Some((key, _)) = self
                .waiter_deadlines
                .remove(&(client_id.clone(), request_id.clone()))
            {
                commands.push(Command::CancelWait {
                    key,
                    client_id,
                    request_id,
                });
            }
        }
        self.propose_internal(commands);
        // Promote learners that asked to join once they have caught up (§4.2.1).
        let commit = self.raft.commit_index();
        if let Some(&learner) = self.promote_when_caught_up.iter().find(|&&l| {
            self.raft.membership().learners.contains(&l)
                && self
                    .raft
                    .progress(l)
                    .is_some_and(|(m, _, _)| m + 8 >= commit && m > 0)
        }) {
            if self
                .raft
                .propose_membership(MembershipChange::PromoteLearner(learner))
                .is_ok()
            {
                info!(node = learner, "promoting caught-up learner to voter");
                self.promote_when_caught_up.retain(|&l| l != learner);
            }
        }
        self.promote_when_caught_up.retain(|l| {
            let m = self.raft.membership();
            m.learners.contains(l) || !m.contains(*l)
        });
    }

    /// On election: every held lock gets at least a full TTL from now, every queued waiter a
    /// reclaim window in which its client can re-attach (DESIGN.md §4).
    fn became_leader(&mut self) {
        let now = Instant::now();
        self.leases.clear();
        for held in self.sm.held_locks() {
            self.leases.insert(
                held.key.clone(),
                Lease {
                    token: held.token,
                    deadline: now + Duration::from_millis(held.ttl_ms),
                    granted: now,
                    expiry_proposed: false,
                },
            );
        }
        self.waiter_deadlines.clear();
        for waiter in self.sm.waiters() {
            let mut at = now + self.cfg.waiter_reclaim;
            if let Some(ms) = waiter.wait_timeout_ms {
                at = at.max(now + Duration::from_millis(ms));
            }
            self.waiter_deadlines.insert(
                (waiter.client_id.clone(), waiter.request_id.clone()),
                (waiter.key.clone(), at),
            );
        }
    }

    fn lost_leadership(&mut self) {
        self.leases.clear();
        self.waiter_deadlines.clear();
        self.promote_when_caught_up.clear();
        self.fail_all(
            ErrorCode::Unavailable,
            "leadership changed; retry with the same request id",
        );
    }

    fn fail_all(&mut self, code: ErrorCode, message: &str) {
        let err = ClientReply::Error(ApiError::new(code, message));
        for (_, mut p) in self.pending.drain() {
            if let Some(reply) = p.reply.take() {
                let _ = reply.send(err.clone());
            }
        }
        for (_, mut w) in self.waiting.drain() {
            if let Some(reply) = w.reply.take() {
                let _ = reply.send(err.clone());
            }
        }
        for (_, (_, reply)) in self.reads.drain() {
            let _ = reply.send(err.clone());
        }
        self.read_indexes.clear();
        self.metrics.proposals_pending.set(0);
    }

    // ----- ready -----------------------------------------------------------------------------

    fn drive_ready(&mut self) -> Result<(), StorageError> {
        for _ in 0..64 {
            if !self.raft.has_ready() {
                break;
            }
            let ready = self.raft.ready();
            self.handle_ready(ready)?;
        }
        self.publish_status();
        Ok(())
    }

    fn handle_ready(&mut self, ready: Ready) -> Result<(), StorageError> {
        if let Some(soft) = ready.soft_state {
            self.role_changed(soft.role, soft.leader_id);
        }
        for msg in &ready.messages_now {
            self.send_peer(msg);
        }
        if let Some(snapshot) = &ready.snapshot {
            // A snapshot being built and unwritten changes belong to the state this one replaces.
            if let Some(job) = self.snapshot_job.take() {
                let _ = job.result.recv();
            }
            self.unwritten_changes.clear();
            self.unwritten_applied = None;
            self.storage
                .install_snapshot(&snapshot.meta, &snapshot.data)?;
            let pairs = decode_snapshot_data(&snapshot.data)?;
            match LockStateMachine::from_kv_with_limits(pairs, self.sm.limits().clone()) {
                Ok(sm) => self.sm = sm,
                Err(err) => {
                    return Err(StorageError::SnapshotData {
                        problem: format!(
                            "snapshot at index {} does not decode: {err}",
                            snapshot.meta.index
                        ),
                    })
                }
            }
            self.metrics
                .snapshots_total
                .with_label_values(&["installed"])
                .inc();
            info!(
                index = snapshot.meta.index,
                "installed snapshot from leader"
            );
        }
        if let Some(hs) = ready.hard_state {
            self.storage.set_hard_state(hs)?;
        }
        self.storage.append(&ready.entries)?;
        self.log_bytes_since_snapshot += ready
            .entries
            .iter()
            .map(|e| match &e.payload {
                EntryPayload::Command(bytes) => bytes.len() as u64 + 24,
                _ => 64,
            })
            .sum::<u64>();
        if ready.must_sync() {
            let started = std::time::Instant::now();
            // The driver has its own thread (see `node::run`), so waiting for the disk here
            // blocks no client or peer I/O.
            self.storage.flush()?;
            self.metrics
                .fsync_duration_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        for msg in &ready.messages {
            self.send_peer(msg);
        }
        self.apply(&ready)?;
        let read_states = ready.read_states.clone();
        self.raft.advance(ready);
        for rs in read_states {
            self.read_indexes.push((rs.index, rs.ctx));
        }
        self.serve_reads();
        self.maybe_snapshot()?;
        Ok(())
    }

    fn role_changed(&mut self, role: Role, leader_id: NodeId) {
        if leader_id != self.last_leader {
            self.metrics.leader_changes_total.inc();
            self.last_leader = leader_id;
        }
        let is_leader = role == Role::Leader;
        if is_leader && !self.was_leader {
            info!(term = self.raft.term(), "became leader");
            self.became_leader();
        } else if !is_leader && self.was_leader {
            info!(
                term = self.raft.term(),
                leader = leader_id,
                "no longer leader"
            );
            self.lost_leadership();
        }
        self.was_leader = is_leader;
    }

    fn apply(&mut self, ready: &Ready) -> Result<(), StorageError> {
        let Some(last) = ready.committed_entries.last().map(|e| e.index) else {
            return Ok(());
        };
        let mut replies: Vec<(oneshot::Sender<ClientReply>, ClientReply)> = Vec::new();
        let mut removed_self = false;
        for entry in &ready.committed_entries {
            match &entry.payload {
                EntryPayload::Command(data) => {
                    let pending = self.pending.remove(&entry.index);
                    let command = match Command::decode(data) {
                        Ok(c) => c,
                        Err(err) => {
                            // Only a bug could put an undecodable command in the log; it is
                            // skipped identically on every replica.
                            error!(index = entry.index, cause = %err, "undecodable command");
                            continue;
                        }
                    };
                    let applied = self.sm.apply(entry.index, &command);
                    self.observe(&command, &applied.outcome);
                    for event in &applied.events {
                        self.on_event(event, &mut replies);
                    }
                    if let Some(pending) = pending {
                        self.answer(&command, applied.outcome, pending, &mut replies);
                    }
                }
                EntryPayload::Membership(MembershipChange::RemoveServer(id))
                    if *id == self.raft.id() =>
                {
                    removed_self = true;
                }
                _ => {}
            }
        }
        for (key, value) in self.sm.take_changes() {
            self.unwritten_changes.insert(key, value);
        }
        self.unwritten_applied = Some(last);
        if self.unwritten_changes.len() >= APPLIED_WRITE_MAX_KEYS {
            self.write_applied(true)?;
        }
        for (reply, answer) in replies {
            let _ = reply.send(answer);
        }
        self.metrics
            .proposals_pending
            .set(self.pending.len() as i64);
        if removed_self {
            info!("this node was removed from the cluster");
        }
        let members = self.raft.membership().clone();
        self.transport.retain(|id| members.contains(id));
        Ok(())
    }

    fn observe(&self, command: &Command, outcome: &Outcome) {
        match outcome {
            Outcome::Granted { .. } => self.metrics.lock_grants_total.inc(),
            Outcome::Released => self.metrics.lock_releases_total.inc(),
            Outcome::Renewed { .. } => self.metrics.lock_renewals_total.inc(),
            Outcome::Expired { .. } => self.metrics.lock_expirations_total.inc(),
            _ => {}
        }
        let _ = command;
    }

    /// Leader bookkeeping for grants, releases and expiries, and answers to waiting clients.
    fn on_event(
        &mut self,
        event: &Event,
        replies: &mut Vec<(oneshot::Sender<ClientReply>, ClientReply)>,
    ) {
        match event {
            Event::Granted {
                client_id,
                request_id,
                token,
                ttl_ms,
            } => {
                self.metrics.lock_grants_total.inc();
                let id = (client_id.clone(), request_id.clone());
                self.waiter_deadlines.remove(&id);
                self.start_lease(&token.key, token.value, *ttl_ms);
                if let Some(mut waiting) = self.waiting.remove(&id) {
                    self.metrics
                        .lock_wait_seconds
                        .observe(waiting.enqueued.elapsed().as_secs_f64());
                    if let Some(reply) = waiting.reply.take() {
                        let answer = ClientReply::Granted {
                            token: token.clone(),
                            expires_in_ms: *ttl_ms,
                        };
                        replies.push((reply, answer));
                    }
                }
            }
            Event::Expired { token, .. } => {
                self.end_lease(&token.key);
            }
            Event::WaiterRemoved {
                key: _,
                client_id,
                request_id,
            } => {
                let id = (client_id.clone(), request_id.clone());
                self.waiter_deadlines.remove(&id);
                if let Some(mut waiting) = self.waiting.remove(&id) {
                    if let Some(reply) = waiting.reply.take() {
                        let answer = ClientReply::error(
                            ErrorCode::WaitTimeout,
                            "the lock was not granted within the wait timeout",
                        );
                        replies.push((reply, answer));
                    }
                }
            }
        }
    }

    fn start_lease(&mut self, key: &str, token: u64, ttl_ms: u64) {
        if !self.raft.is_leader() {
            return;
        }
        let now = Instant::now();
        self.leases.insert(
            key.to_string(),
            Lease {
                token,
                deadline: now + Duration::from_millis(ttl_ms),
                granted: now,
                expiry_proposed: false,
            },
        );
    }

    fn end_lease(&mut self, key: &str) {
        if let Some(lease) = self.leases.remove(key) {
            self.metrics
                .lock_hold_seconds
                .observe(lease.granted.elapsed().as_secs_f64());
        }
    }

    fn answer(
        &mut self,
        command: &Command,
        outcome: Outcome,
        mut pending: PendingProposal,
        replies: &mut Vec<(oneshot::Sender<ClientReply>, ClientReply)>,
    ) {
        let reply = match outcome {
            Outcome::Granted { token, ttl_ms } | Outcome::AlreadyHeld { token, ttl_ms } => {
                if let Command::Acquire { key, .. } = command {
                    if !self.leases.contains_key(key) {
                        self.start_lease(key, token.value, ttl_ms);
                    }
                }
                self.metrics.lock_wait_seconds.observe(pending.started.elapsed().as_secs_f64());
                ClientReply::Granted { token, expires_in_ms: ttl_ms }
            }
            Outcome::Queued { .. } | Outcome::AlreadyQueued { .. } => {
                let Command::Acquire { key, client_id, request_id, .. } = command else {
                    return;
                };
                let id = (client_id.clone(), request_id.clone());
                if pending.wait_timeout_ms == Some(0) {
                    // A try-acquire: leave the queue at once.
                    self.propose_internal(vec![Command::CancelWait {
                        key: key.clone(),
                        client_id: client_id.clone(),
                        request_id: request_id.clone(),
                    }]);
                } else if let Some(ms) = pending.wait_timeout_ms {
                    let at = Instant::now() + Duration::from_millis(ms);
                    self.waiter_deadlines.insert(id.clone(), (key.clone(), at));
                } else {
                    // The client is here again: no reclaim while it waits.
                    self.waiter_deadlines.remove(&id);
                }
                self.waiting.insert(
                    id,
                    Waiting {
                        key: key.clone(),
                        reply: pending.reply.take(),
                        conn: pending.conn,
                        enqueued: pending.started,
                    },
                );
                return;
            }
            Outcome::Busy => ClientReply::error(
                ErrorCode::WaitTimeout,
                "the lock is held and the request asked not to wait",
            ),
            Outcome::Released => {
                if let Command::Release { key, .. } = command {
                    self.end_lease(key);
                }
                ClientReply::Released
            }
            Outcome::Renewed { token, ttl_ms } => {
                self.start_lease(&token.key, token.value, ttl_ms);
                ClientReply::Renewed { token, expires_in_ms: ttl_ms }
            }
            Outcome::NotHolder => {
                ClientReply::error(ErrorCode::NotHolder, "the client does not hold this lock")
            }
            Outcome::StaleToken { current } => ClientReply::error(
                ErrorCode::StaleToken,
                match current {
                    Some(c) => format!("stale fencing token; the current token is {c}"),
                    None => "stale fencing token; the lock is not held".to_string(),
                },
            ),
            Outcome::WaitCancelled => ClientReply::WaitCancelled,
            Outcome::NotWaiting => {
                ClientReply::error(ErrorCode::NotWaiting, "no such waiting request")
            }
            Outcome::Expired { .. } => return,
            Outcome::Stored => ClientReply::Stored,
            Outcome::Deleted { existed } => ClientReply::Deleted { existed },
            Outcome::GuardRejected { current } => ClientReply::error(
                ErrorCode::StaleToken,
                format!("guarded write refused: the token no longer holds the lock (current {current:?})"),
            ),
            Outcome::Rejected { code, message } => {
                let code = match code {
                    RejectCode::TooLarge => ErrorCode::TooLarge,
                    RejectCode::QueueFull | RejectCode::LimitReached => ErrorCode::Busy,
                    RejectCode::InvalidRequest | RejectCode::AlreadyApplied => {
                        ErrorCode::InvalidRequest
                    }
                };
                ClientReply::error(code, message)
            }
        };
        self.metrics.proposals_committed_total.inc();
        self.metrics
            .requests_total
            .with_label_values(&[pending.op_name, reply.result_label()])
            .inc();
        if let Some(tx) = pending.reply.take() {
            replies.push((tx, reply));
        }
    }

    fn serve_reads(&mut self) {
        let applied = self.raft.applied_index();
        let (ready, later): (Vec<_>, Vec<_>) = self
            .read_indexes
            .drain(..)
            .partition(|(index, _)| *index <= applied);
        self.read_indexes = later;
        for (_, ctx) in ready {
            if let Some((key, reply)) = self.reads.remove(&ctx) {
                let value = self.sm.get(&key).map(|v| v.to_vec());
                let _ = reply.send(ClientReply::Value(value));
            }
        }
    }

    /// Hands the unwritten applied state to storage (durable with the next flush): always when
    /// `force`, otherwise once it is older than [`APPLIED_WRITE_INTERVAL`].
    fn write_applied(&mut self, force: bool) -> Result<(), StorageError> {
        let Some(applied) = self.unwritten_applied else {
            return Ok(());
        };
        if !force && self.applied_written_at.elapsed() < APPLIED_WRITE_INTERVAL {
            return Ok(());
        }
        if self.snapshot_job.is_some() {
            if self.unwritten_changes.len() < APPLIED_WRITE_MAX_KEYS && !force {
                return Ok(());
            }
            self.finish_snapshot_job()?;
        }
        let mut changes: Vec<_> = self.unwritten_changes.drain().collect();
        changes.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        self.storage.apply(applied, &changes)?;
        self.unwritten_applied = None;
        self.applied_written_at = Instant::now();
        Ok(())
    }

    /// Starts building a snapshot on another thread once the log has grown past
    /// `snapshot_entries` entries or `snapshot_bytes` bytes, and compacts the log when it is done.
    fn maybe_snapshot(&mut self) -> Result<(), StorageError> {
        if let Some(job) = &self.snapshot_job {
            return match job.result.try_recv() {
                Err(std::sync::mpsc::TryRecvError::Empty) => Ok(()),
                Ok(result) => self.complete_snapshot(result),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    self.complete_snapshot(Err(snapshot_thread_gone()))
                }
            };
        }
        let applied = self.raft.applied_index();
        let by_count = applied >= self.raft.snapshot_index() + self.cfg.snapshot_entries;
        let by_bytes = self.log_bytes_since_snapshot >= self.cfg.snapshot_bytes
            && applied > self.raft.snapshot_index();
        if !by_count && !by_bytes {
            return Ok(());
        }
        let started = std::time::Instant::now();
        self.write_applied(true)?;
        let job = self.storage.snapshot_job()?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("raftlock-snapshot".into())
            .spawn(move || {
                let _ = tx.send(job());
            });
        if let Err(err) = spawned {
            return Err(StorageError::Io {
                action: "starting the snapshot thread",
                source: err,
            });
        }
        self.snapshot_job = Some(SnapshotInProgress {
            result: rx,
            started,
            prepare: started.elapsed(),
        });
        Ok(())
    }

    /// Waits for the snapshot being built, if any, and compacts the log behind it.
    fn finish_snapshot_job(&mut self) -> Result<(), StorageError> {
        let Some(job) = &self.snapshot_job else {
            return Ok(());
        };
        let result = job
            .result
            .recv()
            .unwrap_or_else(|_| Err(snapshot_thread_gone()));
        self.complete_snapshot(result)
    }

    /// Compacts the log behind the snapshot the job built.
    fn complete_snapshot(
        &mut self,
        result: Result<crate::raft::Snapshot, StorageError>,
    ) -> Result<(), StorageError> {
        let Some(job) = self.snapshot_job.take() else {
            return Ok(());
        };
        let snapshot = result?;
        let built = job.started.elapsed();
        let index = snapshot.meta.index;
        let bytes = snapshot.data.len();
        if self.raft.compact(index, snapshot.data) {
            let compact_started = std::time::Instant::now();
            self.storage.compact(index)?;
            self.log_bytes_since_snapshot = 0;
            self.metrics
                .snapshots_total
                .with_label_values(&["taken"])
                .inc();
            info!(
                index,
                bytes,
                driver_ms = (job.prepare + compact_started.elapsed()).as_secs_f64() * 1e3,
                build_ms = built.as_secs_f64() * 1e3,
                "snapshot taken, log compacted"
            );
        }
        Ok(())
    }

    fn publish_status(&self) {
        let membership = self.raft.membership();
        let leader_id = self.raft.leader_id();
        let status = NodeStatus {
            id: self.raft.id(),
            role: format!("{:?}", self.raft.role()).to_lowercase(),
            term: self.raft.term(),
            leader_id,
            leader_addr: self
                .addresses
                .get(leader_id)
                .map(|a| a.client)
                .unwrap_or_default(),
            commit_index: self.raft.commit_index(),
            applied_index: self.raft.applied_index(),
            last_index: self.raft.last_index(),
            voters: membership.voters.iter().copied().collect(),
            learners: membership.learners.iter().copied().collect(),
            locks_held: self.sm.locks_held() as u64,
            waiters: self.sm.waiter_count() as u64,
        };
        let m = &self.metrics;
        m.term.set(status.term as i64);
        m.is_leader.set(i64::from(self.raft.is_leader()));
        m.has_leader.set(i64::from(leader_id != 0));
        m.commit_index.set(status.commit_index as i64);
        m.applied_index.set(status.applied_index as i64);
        m.last_log_index.set(status.last_index as i64);
        m.elections_total.reset();
        m.elections_total
            .inc_by(self.raft.stats().elections_started);
        m.locks_held.set(status.locks_held as i64);
        m.lock_waiters.set(status.waiters as i64);
        if self.raft.is_leader() {
            for peer in membership.members().filter(|&p| p != self.raft.id()) {
                if let Some((matched, _, _)) = self.raft.progress(peer) {
                    m.replication_lag_entries
                        .with_label_values(&[&peer.to_string()])
                        .set(status.last_index.saturating_sub(matched) as i64);
                }
            }
        }
        self.status.send_if_modified(|old| {
            let changed = old.term != status.term
                || old.leader_id != status.leader_id
                || old.role != status.role
                || old.commit_index != status.commit_index
                || old.applied_index != status.applied_index
                || old.last_index != status.last_index
                || old.voters != status.voters
                || old.learners != status.learners
                || old.leader_addr != status.leader_addr
                || old.locks_held != status.locks_held
                || old.waiters != status.waiters;
            if changed {
                *old = status;
            }
            changed
        });
    }
}
