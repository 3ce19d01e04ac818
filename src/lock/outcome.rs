//! What applying one command produced: the [`Outcome`] for whoever proposed it and the
//! [`Event`]s for other parties (a waiter granted by a hand-off, a lease holder whose lock expired,
//! a waiter removed from a queue).
//!
//! ```text
//!   apply(index, cmd) ──► Applied { outcome ──► the proposer's pending request (by index),
//!                                   events  ──► other clients' connections (by client/request id) }
//! ```
//!
//! Expected refusals ("held by someone else", "stale token") are outcomes, not errors. The server
//! translates them to wire error codes in one place; this module never does I/O.

use serde::{Deserialize, Serialize};

use super::command::FencingToken;

/// Result of one `apply`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The log index that was applied.
    pub index: u64,
    /// The answer for the proposer of the command.
    pub outcome: Outcome,
    /// Notifications for parties other than the proposer, in the order they happened.
    pub events: Vec<Event>,
    /// The outcome was answered from the exactly-once table: a retry of a request applied
    /// earlier. Nothing changed.
    pub replayed: bool,
}

/// The answer to one command. Variants marked *recorded* changed state; they are remembered in
/// the dedupe table so that a retried request gets them back instead of acting twice. All other
/// variants changed nothing, so re-evaluating a retry of them still acts at most once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// *Recorded.* The caller holds the lock with `token` for a lease of `ttl_ms`.
    Granted { token: FencingToken, ttl_ms: u64 },
    /// *Recorded.* The caller is waiting; `position` is 1-based (1 = next in line). A retry while
    /// still waiting answers with the current position.
    Queued { position: u32 },
    /// The caller already holds this lock (acquired with another request id). Nothing changed:
    /// no new token, lease not extended (use `Renew`). Locks are not re-entrant.
    AlreadyHeld { token: FencingToken, ttl_ms: u64 },
    /// The caller already waits for this lock under another request id. Nothing changed.
    AlreadyQueued { position: u32 },
    /// The lock is held and the acquire asked not to wait (`wait_timeout_ms == Some(0)`).
    Busy,
    /// *Recorded.* The lock was released (and handed to the next waiter, if any).
    Released,
    /// *Recorded.* The lease now lasts `ttl_ms` from the leader's apply.
    Renewed { token: FencingToken, ttl_ms: u64 },
    /// The token holds the lock but the client id is not the holder's.
    NotHolder,
    /// The token does not hold the lock (released, expired, or superseded). `current` is the
    /// holder's token value, if the lock is held at all.
    StaleToken { current: Option<u64> },
    /// *Recorded* (for the cancelled acquire). The waiter left the queue.
    WaitCancelled,
    /// `CancelWait` found no such waiter (already granted, cancelled, or never queued).
    NotWaiting,
    /// The lease ran out: `client_id` no longer holds the lock.
    Expired { client_id: String },
    /// An `ExpireLease` named a lease that a later renew replaced: the lock stays held and the
    /// lease that started at `lease_index` runs on.
    LeaseRenewed { lease_index: u64 },
    /// *Recorded.* The key-value pair was written.
    Stored,
    /// *Recorded.* The key was deleted; `existed` says whether it had a value.
    Deleted { existed: bool },
    /// The guard token no longer holds the named lock; nothing was written. `current` is the
    /// guard lock's holder token value, if held.
    GuardRejected { current: Option<u64> },
    /// *Recorded.* The key's lock-delay is now `delay_ms` (0: none).
    LockDelaySet { delay_ms: u64 },
    /// The key's running lock-delay ended (and the next waiter, if any, was granted).
    LockDelayEnded,
    /// *Recorded.* The election's leader (holder of `token`) now shows the proclaimed value.
    Proclaimed { token: FencingToken },
    /// Input beyond a limit or invalid; nothing changed.
    Rejected { code: RejectCode, message: String },
    /// `client_id`'s session (opened at log index `session`) lasts `ttl_ms` from the leader's
    /// apply of this keepalive.
    SessionKept { session: u64, ttl_ms: u64 },
    /// The session ended (closed, or its lease expired): `locks` attached locks and acquires
    /// ended with it.
    SessionEnded { locks: u32 },
    /// The client has no such session: it ended (its attached locks are gone), or was never
    /// opened. Nothing changed.
    NoSession,
    /// *Recorded.* The caller holds the read-write lock or semaphore `token.key` in `mode`
    /// with `token` for a lease of `ttl_ms`; `slot` is a permit's slot (0 otherwise).
    SharedGranted {
        token: FencingToken,
        ttl_ms: u64,
        mode: super::command::LockMode,
        slot: u32,
    },
    /// *Recorded.* The semaphore's size is now `permits` (0: the setting was forgotten).
    PermitsSet { permits: u32 },
}

impl Outcome {
    /// Whether the dedupe table remembers this outcome for the request that produced it, as a
    /// plain request (an acknowledging one, `Command::Sequenced`, has every outcome but a
    /// rejection remembered: [`Outcome::is_remembered_for`]).
    pub fn is_recorded(&self) -> bool {
        matches!(
            self,
            Outcome::Granted { .. }
                | Outcome::Queued { .. }
                | Outcome::Released
                | Outcome::Renewed { .. }
                | Outcome::WaitCancelled
                | Outcome::Stored
                | Outcome::Deleted { .. }
                | Outcome::LockDelaySet { .. }
                | Outcome::Proclaimed { .. }
                | Outcome::SharedGranted { .. }
                | Outcome::PermitsSet { .. }
        )
    }

    /// Whether the table remembers this outcome of `command` (see [`Outcome::is_recorded`]).
    pub fn is_remembered_for(&self, command: &super::Command) -> bool {
        match command {
            super::Command::Sequenced { .. } => !matches!(self, Outcome::Rejected { .. }),
            _ => self.is_recorded(),
        }
    }

    pub(crate) fn rejected(code: RejectCode, message: impl Into<String>) -> Outcome {
        Outcome::Rejected {
            code,
            message: message.into(),
        }
    }
}

/// Why a command was rejected. A closed set; the server maps it to wire error codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RejectCode {
    /// Malformed or contradictory input (empty key, zero ttl, token for another key, bad bytes).
    InvalidRequest,
    /// A key, value or id is longer than its limit.
    TooLarge,
    /// The key's wait queue is full.
    QueueFull,
    /// A state-wide bound (held locks, data entries) is reached.
    LimitReached,
    /// The log index was not above the applied index; the entry was applied before.
    AlreadyApplied,
    /// The request id was already used by this client for another operation or key.
    RequestIdReused,
    /// A request numbered below its client's acknowledgement mark whose answer is no longer
    /// kept: the client already had its answer, so it is not run again.
    Acknowledged,
}

/// A notification for a party other than the proposer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A queued acquire was granted by a release or an expiry of the previous holder, in the
    /// same apply (one commit per hand-off).
    Granted {
        client_id: String,
        request_id: String,
        token: FencingToken,
        ttl_ms: u64,
    },
    /// A held lock's lease ran out (`Expire` applied); `client_id` must stop using `token`.
    Expired {
        client_id: String,
        token: FencingToken,
    },
    /// The lease of `token` expired on a key with a lock-delay: no one is granted the key
    /// until the leader's `EndLockDelay`, `delay_ms` from now on its clock.
    LockDelayStarted {
        key: String,
        token: u64,
        delay_ms: u64,
    },
    /// The lock-delay that started when `token` expired ended.
    LockDelayEnded { key: String, token: u64 },
    /// The election `token.key` shows `value` for its leader, the holder of `token`: the
    /// candidate's campaign value when it is elected (in the same apply as its grant), or the
    /// value the leader proclaimed.
    Proclaimed {
        client_id: String,
        token: FencingToken,
        value: Vec<u8>,
    },
    /// A queued acquire of a read-write lock or semaphore was granted by someone else's
    /// command (a release, an expiry, a cancel ahead of it, a larger size), in the same apply.
    SharedGranted {
        client_id: String,
        request_id: String,
        token: FencingToken,
        ttl_ms: u64,
        mode: super::command::LockMode,
        slot: u32,
    },
    /// A waiter left the queue without being granted (`CancelWait`: timeout, disconnect, or the
    /// client's own cancel).
    WaiterRemoved {
        key: String,
        client_id: String,
        request_id: String,
    },
}
