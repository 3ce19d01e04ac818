//! Client requests on their way in: pacing and quota checks, the command each operation
//! proposes, the batch proposed at the next drive, a client that disconnects, and the errors a
//! request is refused with (not the leader, busy, leadership lost).

use bytes::Bytes;

use super::api::{AnswerKind, ApiError, ClientOp, ErrorCode};
use super::{Micros, NodeCore, Observation, Pending, WaitDeadline};
use crate::lock::{Command, FencingToken, Outcome};
use crate::raft::ProposeError;
use crate::storage::Storage;

impl<S: Storage, R> NodeCore<S, R> {
    /// A client request. Proposals gathered between two [`NodeCore::drive`] calls are proposed
    /// together (one flush for all of them).
    pub fn client_request(&mut self, now: Micros, op: ClientOp, conn: u64, reply: R) {
        self.advance_clock(now);
        let op_name = op.name();
        if !self.raft.is_leader() {
            let err = self.not_leader_error();
            self.refuse(op_name, reply, err);
            return;
        }
        // A request that acknowledges answers is not paced while the table is below three
        // quarters of its bound: its client's answers go as it acknowledges them, so its rate
        // does not fill the table. (A client that never raises its mark does fill it, and is
        // paced with everyone once it has.) A cluster that does not know acknowledgements yet
        // takes it as the plain request it carries.
        let (ack_below, op) = match op {
            ClientOp::Sequenced { ack_below, op }
                if self.sm.cluster_version() >= crate::lock::SEQUENCED_VERSION =>
            {
                (Some(ack_below), *op)
            }
            ClientOp::Sequenced { op, .. } => (None, *op),
            op => (None, op),
        };
        let table_roomy = || {
            let max = self.sm.limits().dedupe_entries_max;
            self.sm.dedupe_len().saturating_mul(4) < max.saturating_mul(3)
        };
        match op.answer_kind() {
            _ if ack_below.is_some() && table_roomy() => {}
            AnswerKind::None => {}
            AnswerKind::Ends => self.pacer.record(self.now, self.sm.limits(), false),
            AnswerKind::Starts => match self.pacer.admit(self.now, self.sm.limits()) {
                Ok(()) => self.pacer.record(self.now, self.sm.limits(), true),
                Err(paced) => {
                    let err = ApiError::new(ErrorCode::Busy, paced.to_string());
                    self.refuse(op_name, reply, err);
                    return;
                }
            },
        }
        let pending = |reply| Pending {
            op: op_name,
            reply: Some(reply),
            conn,
            started: now,
        };
        let command = match op {
            ClientOp::Get { .. } | ClientOp::Leader { .. } => {
                self.next_read_ctx += 1;
                let ctx = self.next_read_ctx;
                match self.raft.read_index(ctx) {
                    Ok(()) => {
                        self.reads.insert(ctx, (op, reply));
                    }
                    Err(err) => {
                        let err = self.propose_error(err);
                        self.refuse(op_name, reply, err);
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
            } => Command::Acquire {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
            },
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
            ClientOp::ReleaseHeld {
                key,
                client_id,
                request_id,
            } => Command::ReleaseHeld {
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
            ClientOp::SetLockDelay {
                key,
                delay_ms,
                client_id,
                request_id,
            } => {
                let version = self.sm.cluster_version();
                if version < crate::lock::LOCK_DELAY_VERSION {
                    let err = self.version_refusal(crate::lock::LOCK_DELAY_VERSION, "lock-delay");
                    self.refuse(op_name, reply, err);
                    return;
                }
                Command::SetLockDelay {
                    key,
                    delay_ms,
                    client_id,
                    request_id,
                }
            }
            ClientOp::Campaign { .. } | ClientOp::Proclaim { .. }
                if self.sm.cluster_version() < crate::lock::ELECTION_VERSION =>
            {
                let err = self.version_refusal(crate::lock::ELECTION_VERSION, "elections");
                self.refuse(op_name, reply, err);
                return;
            }
            ClientOp::Campaign {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                value,
            } => Command::Campaign {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                value,
            },
            ClientOp::Proclaim {
                key,
                client_id,
                request_id,
                token,
                value,
            } => Command::Proclaim {
                token: FencingToken {
                    key: key.clone(),
                    value: token,
                },
                key,
                client_id,
                request_id,
                value,
            },
            ClientOp::KeepAlive { .. } | ClientOp::EndSession { .. }
                if self.sm.cluster_version() < crate::lock::SESSION_VERSION =>
            {
                let err = self.version_refusal(crate::lock::SESSION_VERSION, "sessions");
                self.refuse(op_name, reply, err);
                return;
            }
            ClientOp::KeepAlive {
                client_id,
                session,
                ttl_ms,
            } => Command::KeepAlive {
                client_id,
                session,
                ttl_ms,
            },
            ClientOp::EndSession { client_id, session } => {
                Command::EndSession { client_id, session }
            }
            ClientOp::AcquireShared { .. } | ClientOp::SetPermits { .. }
                if self.sm.cluster_version() < crate::lock::SHARED_VERSION =>
            {
                let err = self.version_refusal(
                    crate::lock::SHARED_VERSION,
                    "read-write locks and semaphores",
                );
                self.refuse(op_name, reply, err);
                return;
            }
            ClientOp::AcquireShared {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                mode,
                permits,
            } => Command::AcquireShared {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                mode,
                permits,
            },
            ClientOp::SetPermits {
                key,
                permits,
                client_id,
                request_id,
            } => Command::SetPermits {
                key,
                permits,
                client_id,
                request_id,
            },
            ClientOp::Sequenced { .. } => {
                let err = ApiError::new(ErrorCode::InvalidRequest, "ackBelow given twice");
                self.refuse(op_name, reply, err);
                return;
            }
        };
        if let Some(Outcome::Rejected { message, .. }) = self.sm.quota_precheck(&command) {
            let limit = super::observations::limit_named(&message).to_string();
            self.observe(Observation::LimitRefused { limit });
            self.refuse(op_name, reply, ApiError::new(ErrorCode::Busy, message));
            return;
        }
        let command = match ack_below {
            Some(ack_below) => Command::Sequenced {
                ack_below,
                command: Box::new(command),
            },
            None => command,
        };
        self.batch.push((command, pending(reply)));
    }

    /// A client connection closed: its queued waiters lose their answer path and become
    /// reclaimable (cancelled after the reclaim window unless the client comes back).
    pub fn disconnected(&mut self, now: Micros, conn: u64) {
        self.advance_clock(now);
        let reclaim_at = self.now + self.cfg.waiter_reclaim_us;
        let gone: Vec<(String, String)> = self
            .waiting
            .iter()
            .filter(|(_, w)| w.conn == conn)
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            let Some(w) = self.waiting.remove(&id) else {
                continue;
            };
            if !self.raft.is_leader() {
                continue;
            }
            let key = self.sm.waiter(&w.key, &id.0, &id.1).map(|w| w.key);
            if let Some(key) = key {
                if self.wait_deadlines.contains_key(&id) {
                    self.wait_deadlines
                        .update(&id, |d| d.at = d.at.min(reclaim_at));
                } else {
                    let deadline = WaitDeadline {
                        key,
                        at: reclaim_at,
                        cancel_proposed_at: None,
                    };
                    self.wait_deadlines.insert(id, deadline);
                }
            }
        }
        for p in self.pending.values_mut() {
            if p.conn == conn {
                p.reply = None;
            }
        }
    }

    pub(super) fn propose_batch(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let mut batch = std::mem::take(&mut self.batch);
        if !self.raft.is_leader() {
            let err = self.not_leader_error();
            for (_, p) in batch {
                if let Some(r) = p.reply {
                    self.refuse(p.op, r, err.clone());
                }
            }
            return;
        }
        // What the log has no room for now is refused as busy, and the rest proposed: a batch
        // larger than the room would otherwise be refused whole.
        let room = self.raft.proposal_room();
        if batch.len() > room {
            let busy = self.propose_error(ProposeError::Busy);
            for (_, p) in batch.split_off(room) {
                self.observe(Observation::ProposalFailed);
                if let Some(r) = p.reply {
                    self.refuse(p.op, r, busy.clone());
                }
            }
            if batch.is_empty() {
                return;
            }
        }
        let count = batch.len() as u64;
        let encoded: Vec<Bytes> = batch
            .iter()
            .map(|(cmd, _)| Bytes::from(cmd.encode()))
            .collect();
        match self.raft.propose(encoded) {
            Ok(last) => {
                let first = last + 1 - count;
                for (offset, (_, pending)) in batch.into_iter().enumerate() {
                    self.pending.insert(first + offset as u64, pending);
                }
            }
            Err(err) => {
                let api = self.propose_error(err);
                for (_, p) in batch {
                    self.observe(Observation::ProposalFailed);
                    if let Some(r) = p.reply {
                        self.refuse(p.op, r, api.clone());
                    }
                }
            }
        }
    }

    pub(super) fn fail_all(&mut self, code: ErrorCode, message: &str) {
        let err = ApiError::new(code, message);
        let pending = std::mem::take(&mut self.pending);
        for (_, p) in pending {
            if let Some(r) = p.reply {
                self.refuse(p.op, r, err.clone());
            }
        }
        let waiting = std::mem::take(&mut self.waiting);
        for (_, w) in waiting {
            if let Some(r) = w.reply {
                self.refuse("acquire", r, err.clone());
            }
        }
        let reads = std::mem::take(&mut self.reads);
        for (_, (_, r)) in reads {
            self.refuse("get", r, err.clone());
        }
        let batch = std::mem::take(&mut self.batch);
        for (_, p) in batch {
            if let Some(r) = p.reply {
                self.refuse(p.op, r, err.clone());
            }
        }
        self.read_indexes.clear();
    }

    /// `NOT_LEADER` with the leader's id (the shell adds its address), or `NO_LEADER`.
    pub fn not_leader_error(&self) -> ApiError {
        let leader_id = self.raft.leader_id();
        if leader_id == 0 || leader_id == self.raft.id() {
            return ApiError::new(ErrorCode::NoLeader, "no leader is known; retry shortly");
        }
        let mut err = ApiError::new(
            ErrorCode::NotLeader,
            format!(
                "node {} is not the leader; node {leader_id} is",
                self.raft.id()
            ),
        );
        err.leader_id = leader_id;
        err
    }

    fn propose_error(&self, err: ProposeError) -> ApiError {
        match err {
            ProposeError::NotLeader { .. } => self.not_leader_error(),
            ProposeError::Busy => ApiError::new(ErrorCode::Busy, "too many requests in flight"),
            other => ApiError::new(ErrorCode::Unavailable, other.to_string()),
        }
    }

    /// The refusal of an operation the cluster's version does not have yet. While this
    /// leader is about to raise the version (every member said it runs this release), it is
    /// `UNAVAILABLE`, to be retried with the same request id: a final refusal there would tell
    /// the client that nothing happened, and a delayed copy of the same request, applied once
    /// the version is raised, could still act (simulator seed 2172, 3 nodes: a campaign refused
    /// this way, then granted by its late copy). Otherwise the cluster has an older member and
    /// the refusal is final: upgrade every member first.
    fn version_refusal(&self, needed: u32, what: &str) -> ApiError {
        let version = self.sm.cluster_version();
        let me = self.raft.id();
        let raising = self.raft.is_leader()
            && self
                .raft
                .membership()
                .members()
                .filter(|id| *id != me)
                .all(|id| self.said_version(id, crate::lock::CLUSTER_VERSION));
        if raising {
            return ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "this request ({what}) needs cluster version {needed}, which this cluster (now at \
                     {version}) is raising; retry shortly with the same request id"
                ),
            );
        }
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!(
                "this request ({what}) needs cluster version {needed} and this cluster runs \
                 {version}: upgrade every member first"
            ),
        )
    }
}
