//! The client-facing operations and answers, shared by the WebSocket, gRPC and HTTP front ends.
//! Translation to each wire format happens at the edge (`ws.rs`, `grpc.rs`); this is the one
//! place that names the error codes.

use serde::{Deserialize, Serialize};

use crate::lock::FencingToken;
use crate::raft::NodeId;

/// The closed set of error codes a client can receive (docs/protocol.md, *Errors*).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// This node is not the leader; `leaderId`/`leaderAddr` say where to go.
    NotLeader,
    /// No leader is known right now; retry after a short backoff.
    NoLeader,
    /// Malformed JSON, unknown command type, missing or mistyped field.
    InvalidRequest,
    /// The fencing token is not the current holder's.
    StaleToken,
    /// The client does not hold the lock.
    NotHolder,
    /// The wait timeout passed before the lock was granted.
    WaitTimeout,
    /// A key, value or message exceeds its configured limit.
    TooLarge,
    /// Missing or wrong credentials.
    Unauthenticated,
    /// The request could not be completed (leadership lost, shutting down); retry with the
    /// same request id.
    Unavailable,
    /// A queue or limit is full; retry later.
    Busy,
    /// A cancel named a request that is not waiting.
    NotWaiting,
    /// The client already holds this lock (acquired under another request id); the error carries
    /// the current token. Locks are not re-entrant.
    AlreadyHeld,
    /// The request id was already used by this client for another operation or key.
    RequestIdReused,
    /// The authenticated identity may not do this operation on this key.
    PermissionDenied,
    /// A request numbered below its client's `ackBelow` whose answer is no longer kept: the
    /// client had the answer and acknowledged it, so it is not run again (a delayed copy).
    Acknowledged,
    /// The client's session ended (closed, or its lease expired) or was never opened: every
    /// lock attached to it is gone. Open a new session.
    NoSession,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NotLeader => "NOT_LEADER",
            ErrorCode::NoLeader => "NO_LEADER",
            ErrorCode::InvalidRequest => "INVALID_REQUEST",
            ErrorCode::StaleToken => "STALE_TOKEN",
            ErrorCode::NotHolder => "NOT_HOLDER",
            ErrorCode::WaitTimeout => "WAIT_TIMEOUT",
            ErrorCode::TooLarge => "TOO_LARGE",
            ErrorCode::Unauthenticated => "UNAUTHENTICATED",
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::Busy => "BUSY",
            ErrorCode::NotWaiting => "NOT_WAITING",
            ErrorCode::AlreadyHeld => "ALREADY_HELD",
            ErrorCode::RequestIdReused => "REQUEST_ID_REUSED",
            ErrorCode::PermissionDenied => "PERMISSION_DENIED",
            ErrorCode::Acknowledged => "ACKNOWLEDGED",
            ErrorCode::NoSession => "NO_SESSION",
        }
    }

    /// Whether a client should retry (possibly elsewhere) with the same request id.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::NotLeader | ErrorCode::NoLeader | ErrorCode::Unavailable | ErrorCode::Busy
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub leader_id: NodeId,
    pub leader_addr: String,
    /// For `ALREADY_HELD`: the fencing token value the caller holds.
    pub current_token: Option<u64>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            leader_id: 0,
            leader_addr: String::new(),
            current_token: None,
        }
    }
}

/// One client operation. (Serialized only between nodes, when a follower forwards a request to
/// the leader.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientOp {
    Acquire {
        key: String,
        client_id: String,
        request_id: String,
        ttl_ms: u64,
        /// `None` waits until granted (or the connection goes away); `Some(0)` never waits.
        wait_timeout_ms: Option<u64>,
    },
    Release {
        key: String,
        client_id: String,
        request_id: String,
        token: u64,
    },
    /// Release without a token: applies if `client_id` holds `key`.
    ReleaseHeld {
        key: String,
        client_id: String,
        request_id: String,
    },
    Renew {
        key: String,
        client_id: String,
        request_id: String,
        token: u64,
        ttl_ms: u64,
    },
    CancelWait {
        key: String,
        client_id: String,
        request_id: String,
    },
    Put {
        key: String,
        value: Vec<u8>,
        /// Applies only while this token holds the lock it names.
        guard: Option<FencingToken>,
        client_id: String,
        request_id: String,
    },
    Delete {
        key: String,
        /// Applies only while this token holds the lock it names.
        guard: Option<FencingToken>,
        client_id: String,
        request_id: String,
    },
    /// Linearizable read of a KV key (ReadIndex).
    Get { key: String },
    /// A request that acknowledges earlier answers (`ackBelow`): `op`'s request id is its
    /// sequence number, and the client has the answer of each of its requests numbered below
    /// `ack_below` (`Command::Sequenced`). Built only around an acquire, release, renewal, put or
    /// delete; never nested.
    Sequenced { ack_below: u64, op: Box<ClientOp> },
    /// Sets `key`'s lock-delay (0 removes it): after a holder's lease of `key` expires, no one
    /// is granted the key for `delay_ms`.
    SetLockDelay {
        key: String,
        delay_ms: u64,
        client_id: String,
        request_id: String,
    },
    /// Campaigns to lead the election `key`: an acquire of the election's lock that shows
    /// `value` once elected. Answered like an acquire (granted: elected, with the term's token).
    Campaign {
        key: String,
        client_id: String,
        request_id: String,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
        value: Vec<u8>,
    },
    /// The leader of election `key` (holder of `token`) shows `value`.
    Proclaim {
        key: String,
        client_id: String,
        request_id: String,
        token: u64,
        value: Vec<u8>,
    },
    /// Linearizable read of election `key`: its leader, term and value (ReadIndex).
    Leader { key: String },
    /// Opens (`session` 0) or keeps alive the client's session: a lease of `ttl_ms` covering
    /// every lock the client acquires with a TTL of 0.
    KeepAlive {
        client_id: String,
        session: u64,
        ttl_ms: u64,
    },
    /// Ends the client's session `session`: every attached lock is released and every attached
    /// acquire leaves its queue, in one log entry.
    EndSession { client_id: String, session: u64 },
    /// Takes read-write lock `key` as a reader or a writer, or a permit of semaphore `key`
    /// (`permits`: the size a semaphore not in use starts with; 0 for read and write).
    /// Answered like an acquire, its grant saying the mode and a permit's slot; released,
    /// renewed and cancelled by the plain operations.
    AcquireShared {
        key: String,
        client_id: String,
        request_id: String,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
        mode: crate::lock::LockMode,
        permits: u32,
    },
    /// Sets semaphore `key`'s size (0 forgets the setting).
    SetPermits {
        key: String,
        permits: u32,
        client_id: String,
        request_id: String,
    },
}

/// What a client operation does to the exactly-once table (see `node::pacing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerKind {
    /// Leaves no answer (reads, cancels, requests without a request id).
    None,
    /// New work that leaves an answer: acquire, put, delete.
    Starts,
    /// Work that ends or keeps what is held, and leaves an answer: release, renew.
    Ends,
}

impl ClientOp {
    /// The operation itself: the one a [`ClientOp::Sequenced`] carries, any other as it is.
    pub fn request(&self) -> &ClientOp {
        match self {
            ClientOp::Sequenced { op, .. } => op.request(),
            other => other,
        }
    }

    /// [`ClientOp::request`], to rewrite it.
    pub fn request_mut(&mut self) -> &mut ClientOp {
        match self {
            ClientOp::Sequenced { op, .. } => op.request_mut(),
            other => other,
        }
    }

    /// `op` acknowledging its client's answers below `ack_below`, when it can carry that: an
    /// acquire, release, renewal, put or delete. The request id must be the request's sequence
    /// number (the state machine refuses it otherwise).
    pub fn sequenced(op: ClientOp, ack_below: Option<u64>) -> Result<ClientOp, ApiError> {
        let Some(ack_below) = ack_below else {
            return Ok(op);
        };
        match op {
            ClientOp::CancelWait { .. }
            | ClientOp::Get { .. }
            | ClientOp::Leader { .. }
            | ClientOp::KeepAlive { .. }
            | ClientOp::EndSession { .. }
            | ClientOp::Sequenced { .. } => Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "ackBelow is for acquires, releases, renewals, puts and deletes",
            )),
            op if crate::lock::sequence_number(op.request_id()).is_none() => Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "with ackBelow, the request id must be the request's sequence number (decimal, \
                 from 1)",
            )),
            op => Ok(ClientOp::Sequenced {
                ack_below,
                op: Box::new(op),
            }),
        }
    }

    /// Whether the operation leaves an answer in the exactly-once table, and of which kind.
    pub fn answer_kind(&self) -> AnswerKind {
        match self.request() {
            ClientOp::Acquire { request_id, .. }
            | ClientOp::Put { request_id, .. }
            | ClientOp::Delete { request_id, .. }
            | ClientOp::SetLockDelay { request_id, .. }
            | ClientOp::Campaign { request_id, .. }
            | ClientOp::AcquireShared { request_id, .. }
            | ClientOp::SetPermits { request_id, .. }
                if !request_id.is_empty() =>
            {
                AnswerKind::Starts
            }
            ClientOp::Release { request_id, .. }
            | ClientOp::ReleaseHeld { request_id, .. }
            | ClientOp::Renew { request_id, .. }
            | ClientOp::Proclaim { request_id, .. }
                if !request_id.is_empty() =>
            {
                AnswerKind::Ends
            }
            _ => AnswerKind::None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self.request() {
            ClientOp::Acquire { .. } => "acquire",
            ClientOp::Release { .. } | ClientOp::ReleaseHeld { .. } => "release",
            ClientOp::Renew { .. } => "renew",
            ClientOp::CancelWait { .. } => "cancel_wait",
            ClientOp::Put { .. } => "put",
            ClientOp::Delete { .. } => "delete",
            ClientOp::SetLockDelay { .. } => "set_lock_delay",
            ClientOp::Campaign { .. } => "campaign",
            ClientOp::Proclaim { .. } => "proclaim",
            ClientOp::Leader { .. } => "leader",
            ClientOp::KeepAlive { .. } => "keep_alive",
            ClientOp::EndSession { .. } => "end_session",
            ClientOp::AcquireShared { .. } => "acquire_shared",
            ClientOp::SetPermits { .. } => "set_permits",
            ClientOp::Get { .. } | ClientOp::Sequenced { .. } => "get",
        }
    }

    /// The OpenTelemetry span name of this operation's request.
    pub fn span_name(&self) -> &'static str {
        match self.request() {
            ClientOp::Acquire { .. } => "lock.acquire",
            ClientOp::Release { .. } | ClientOp::ReleaseHeld { .. } => "lock.release",
            ClientOp::Renew { .. } => "lock.renew",
            ClientOp::CancelWait { .. } => "lock.cancel_wait",
            ClientOp::Put { .. } => "kv.put",
            ClientOp::Delete { .. } => "kv.delete",
            ClientOp::SetLockDelay { .. } => "lock.set_lock_delay",
            ClientOp::Campaign { .. } => "election.campaign",
            ClientOp::Proclaim { .. } => "election.proclaim",
            ClientOp::Leader { .. } => "election.leader",
            ClientOp::KeepAlive { .. } => "session.keep_alive",
            ClientOp::EndSession { .. } => "session.end",
            ClientOp::AcquireShared { .. } => "lock.acquire_shared",
            ClientOp::SetPermits { .. } => "lock.set_permits",
            ClientOp::Get { .. } | ClientOp::Sequenced { .. } => "kv.get",
        }
    }

    /// The requesting client's id (empty for reads).
    pub fn client_id(&self) -> &str {
        match self.request() {
            ClientOp::Acquire { client_id, .. }
            | ClientOp::Release { client_id, .. }
            | ClientOp::ReleaseHeld { client_id, .. }
            | ClientOp::Renew { client_id, .. }
            | ClientOp::CancelWait { client_id, .. }
            | ClientOp::Put { client_id, .. }
            | ClientOp::Delete { client_id, .. }
            | ClientOp::SetLockDelay { client_id, .. }
            | ClientOp::Campaign { client_id, .. }
            | ClientOp::Proclaim { client_id, .. }
            | ClientOp::KeepAlive { client_id, .. }
            | ClientOp::EndSession { client_id, .. }
            | ClientOp::AcquireShared { client_id, .. }
            | ClientOp::SetPermits { client_id, .. } => client_id,
            ClientOp::Get { .. } | ClientOp::Leader { .. } | ClientOp::Sequenced { .. } => "",
        }
    }

    /// The requesting client's id, to rewrite it (`None` for reads, which carry none).
    pub fn client_id_mut(&mut self) -> Option<&mut String> {
        match self.request_mut() {
            ClientOp::Acquire { client_id, .. }
            | ClientOp::Release { client_id, .. }
            | ClientOp::ReleaseHeld { client_id, .. }
            | ClientOp::Renew { client_id, .. }
            | ClientOp::CancelWait { client_id, .. }
            | ClientOp::Put { client_id, .. }
            | ClientOp::Delete { client_id, .. }
            | ClientOp::SetLockDelay { client_id, .. }
            | ClientOp::Campaign { client_id, .. }
            | ClientOp::Proclaim { client_id, .. }
            | ClientOp::KeepAlive { client_id, .. }
            | ClientOp::EndSession { client_id, .. }
            | ClientOp::AcquireShared { client_id, .. }
            | ClientOp::SetPermits { client_id, .. } => Some(client_id),
            ClientOp::Get { .. } | ClientOp::Leader { .. } | ClientOp::Sequenced { .. } => None,
        }
    }

    /// The request id (empty for reads).
    pub fn request_id(&self) -> &str {
        match self.request() {
            ClientOp::Acquire { request_id, .. }
            | ClientOp::Release { request_id, .. }
            | ClientOp::ReleaseHeld { request_id, .. }
            | ClientOp::Renew { request_id, .. }
            | ClientOp::CancelWait { request_id, .. }
            | ClientOp::Put { request_id, .. }
            | ClientOp::Delete { request_id, .. }
            | ClientOp::SetLockDelay { request_id, .. }
            | ClientOp::Campaign { request_id, .. }
            | ClientOp::Proclaim { request_id, .. }
            | ClientOp::AcquireShared { request_id, .. }
            | ClientOp::SetPermits { request_id, .. } => request_id,
            ClientOp::Get { .. }
            | ClientOp::Leader { .. }
            | ClientOp::KeepAlive { .. }
            | ClientOp::EndSession { .. }
            | ClientOp::Sequenced { .. } => "",
        }
    }

    pub fn key(&self) -> &str {
        match self.request() {
            ClientOp::Acquire { key, .. }
            | ClientOp::Release { key, .. }
            | ClientOp::ReleaseHeld { key, .. }
            | ClientOp::Renew { key, .. }
            | ClientOp::CancelWait { key, .. }
            | ClientOp::Put { key, .. }
            | ClientOp::Delete { key, .. }
            | ClientOp::SetLockDelay { key, .. }
            | ClientOp::Campaign { key, .. }
            | ClientOp::Proclaim { key, .. }
            | ClientOp::Get { key }
            | ClientOp::Leader { key }
            | ClientOp::AcquireShared { key, .. }
            | ClientOp::SetPermits { key, .. } => key,
            ClientOp::KeepAlive { .. }
            | ClientOp::EndSession { .. }
            | ClientOp::Sequenced { .. } => "",
        }
    }
}

/// How an acquire that was granted after waiting in the queue waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedInfo {
    /// Its place in the key's queue when it joined (1 = next in line).
    pub position: u32,
    /// From joining the queue to the grant, in milliseconds (on the node that answered).
    pub waited_ms: u64,
}

/// The answer to one [`ClientOp`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientReply {
    Granted {
        token: FencingToken,
        expires_in_ms: u64,
        /// Set when the acquire waited in the queue before this grant (traces record it; old
        /// nodes neither send nor expect it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queued: Option<QueuedInfo>,
        /// The grant makes the client an election's leader (the token is its term).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        leader: bool,
        /// A read-write lock's or semaphore's grant: its mode and (a permit's) slot.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shared: Option<SharedGrant>,
    },
    Released,
    Renewed {
        token: FencingToken,
        expires_in_ms: u64,
        /// The renewed lease is an election leader's.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        leader: bool,
        /// The renewed lease is a read-write lock's or semaphore's holder's: its mode and slot.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shared: Option<SharedGrant>,
    },
    WaitCancelled,
    Stored,
    Deleted {
        existed: bool,
    },
    Value(Option<Vec<u8>>),
    Error(ApiError),
    /// The key's lock-delay is now `delay_ms` (0: none).
    LockDelaySet {
        delay_ms: u64,
    },
    /// The election's leader (the holder of `token`) now shows the proclaimed value.
    Proclaimed {
        token: FencingToken,
    },
    /// Election `key` as of the read: its leader's client id, term (fencing token) and value;
    /// all `None` while no one leads.
    Leader {
        leader: Option<String>,
        token: Option<FencingToken>,
        value: Option<Vec<u8>>,
        candidates: u32,
    },
    /// The client's session (opened at log index `session`) lasts `expires_in_ms` from now.
    SessionKept {
        session: u64,
        expires_in_ms: u64,
    },
    /// The session ended; `locks` attached locks and acquires ended with it.
    SessionEnded {
        locks: u32,
    },
    /// The semaphore's size is now `permits` (0: the admin's setting was forgotten).
    PermitsSet {
        permits: u32,
    },
}

/// How a read-write lock or a semaphore was granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedGrant {
    pub mode: crate::lock::LockMode,
    /// A permit's slot (0 for readers and writers).
    pub slot: u32,
}

impl ClientReply {
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        ClientReply::Error(ApiError::new(code, message))
    }

    /// The label for `raftlock_requests_total{result}`.
    pub fn result_label(&self) -> &'static str {
        match self {
            ClientReply::Granted { .. } => "granted",
            ClientReply::Released => "released",
            ClientReply::Renewed { .. } => "renewed",
            ClientReply::WaitCancelled => "cancelled",
            ClientReply::Stored | ClientReply::Deleted { .. } => "stored",
            ClientReply::Value(_) => "read",
            ClientReply::LockDelaySet { .. } => "stored",
            ClientReply::Proclaimed { .. } => "proclaimed",
            ClientReply::Leader { .. } => "read",
            ClientReply::SessionKept { .. } => "kept",
            ClientReply::SessionEnded { .. } => "ended",
            ClientReply::PermitsSet { .. } => "stored",
            ClientReply::Error(e) => e.code.as_str(),
        }
    }
}
