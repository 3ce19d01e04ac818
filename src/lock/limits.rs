//! Bounds on everything the lock state machine stores: key and value sizes, ids,
//! lease and wait lengths, waiters per key, held locks, data entries, client sessions and the
//! answers they remember.
//!
//! Limits are part of the replicated state (persisted under `meta/limits`), so every replica
//! judges every command the same way. Input beyond a bound is answered with
//! `Outcome::Rejected` and changes nothing; it must never panic.

use serde::{Deserialize, Serialize};

/// Upper bounds enforced by `LockStateMachine::apply`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Limits {
    /// Longest lock or data key, in bytes. Keys must also be non-empty.
    pub key_bytes_max: usize,
    /// Longest value of a `Put`, in bytes.
    pub value_bytes_max: usize,
    /// Longest client id or request id, in bytes.
    pub id_bytes_max: usize,
    /// Longest lease a client may ask for (`Acquire`, `Renew`). Zero-length leases are invalid.
    pub ttl_ms_max: u64,
    /// Longest wait timeout an `Acquire` may carry.
    pub wait_timeout_ms_max: u64,
    /// Waiters one key's FIFO queue may hold.
    pub waiters_per_key_max: usize,
    /// Locks held at once across the cluster.
    pub locks_held_max: usize,
    /// Entries in the replicated key-value data.
    pub data_entries_max: usize,
    /// Remembered answers (`(client_id, request_id)` → outcome) across all client sessions.
    /// Zero disables deduplication.
    pub dedupe_entries_max: usize,
    /// Client sessions (client ids with remembered answers) at once.
    pub sessions_max: usize,
    /// Remembered answers one client session may hold.
    pub session_entries_max: usize,
    /// A session whose client sent no request for this long (log time, see `Command::Tick`) is
    /// closed and its answers forgotten — unless one of its acquires is still queued.
    pub session_idle_ms: u64,
    /// An answer is kept at least this long (log time) after it was given, whatever the bounds:
    /// a bound that could only be kept by forgetting a younger answer refuses the new request
    /// instead. Retries within this time are always answered from the table.
    pub dedupe_retain_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            key_bytes_max: 512,
            value_bytes_max: 64 * 1024,
            id_bytes_max: 128,
            ttl_ms_max: 24 * 60 * 60 * 1000,
            wait_timeout_ms_max: 24 * 60 * 60 * 1000,
            waiters_per_key_max: 1024,
            locks_held_max: 1_000_000,
            data_entries_max: 1_000_000,
            dedupe_entries_max: 1_000_000,
            sessions_max: 10_000,
            session_entries_max: 100_000,
            session_idle_ms: 5 * 60 * 1000,
            dedupe_retain_ms: 60 * 1000,
        }
    }
}

/// Limits as encoded before client sessions existed (log entries and state written then are
/// read back through this; the session bounds take their defaults).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitsV1 {
    pub key_bytes_max: usize,
    pub value_bytes_max: usize,
    pub id_bytes_max: usize,
    pub ttl_ms_max: u64,
    pub wait_timeout_ms_max: u64,
    pub waiters_per_key_max: usize,
    pub locks_held_max: usize,
    pub data_entries_max: usize,
    pub dedupe_entries_max: usize,
}

impl From<LimitsV1> for Limits {
    fn from(old: LimitsV1) -> Self {
        Limits {
            key_bytes_max: old.key_bytes_max,
            value_bytes_max: old.value_bytes_max,
            id_bytes_max: old.id_bytes_max,
            ttl_ms_max: old.ttl_ms_max,
            wait_timeout_ms_max: old.wait_timeout_ms_max,
            waiters_per_key_max: old.waiters_per_key_max,
            locks_held_max: old.locks_held_max,
            data_entries_max: old.data_entries_max,
            dedupe_entries_max: old.dedupe_entries_max,
            ..Limits::default()
        }
    }
}

/// Byte budgets and per-identity quotas (cluster version 5, [`super::QUOTAS_VERSION`]):
/// replicated state like [`Limits`], set through the log by [`super::Command::SetQuotas`], so
/// every replica refuses the same commands. Until a `SetQuotas` entry applies none of them is
/// enforced (a cluster in the middle of a rolling upgrade has replicas that would not).
///
/// An identity is the part of a client id before its first `/`: with client authentication on,
/// a node makes every client id `<identity>` or `<identity>/<clientId>` before proposing, so
/// the identity is the authenticated one. Without authentication a client id is chosen by the
/// client and proves nothing: `by_identity` is then false and every client shares the global
/// bounds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Quotas {
    /// Bytes of keys and values in the replicated key-value data, in all.
    pub data_bytes_max: u64,
    /// Bytes of lock state in all: keys and ids of held locks and queued waiters (with
    /// [`LOCK_ENTRY_OVERHEAD`] each).
    pub lock_bytes_max: u64,
    /// Whether the per-identity quotas below apply (client authentication is on).
    pub by_identity: bool,
    /// Locks one identity may hold and wait for, together.
    pub identity_locks_max: u64,
    /// Acquires one identity may have queued.
    pub identity_waiters_max: u64,
    /// Client sessions one identity may have open.
    pub identity_sessions_max: u64,
}

/// Bytes counted for a held lock or a queued waiter besides its key and ids: about what the
/// state machine's maps and boxes take for one.
pub const LOCK_ENTRY_OVERHEAD: u64 = 96;

impl Default for Quotas {
    fn default() -> Self {
        Quotas {
            data_bytes_max: 64 << 20,
            lock_bytes_max: 256 << 20,
            by_identity: false,
            identity_locks_max: 250_000,
            identity_waiters_max: 250_000,
            identity_sessions_max: 2_500,
        }
    }
}

impl Quotas {
    /// Whether these quotas can be applied (every bound positive).
    pub fn is_sane(&self) -> bool {
        self.data_bytes_max > 0
            && self.lock_bytes_max > 0
            && self.identity_locks_max > 0
            && self.identity_waiters_max > 0
            && self.identity_sessions_max > 0
    }
}

/// The identity a client id belongs to: the part before its first `/`.
pub fn identity_of(client_id: &str) -> &str {
    client_id
        .split_once('/')
        .map_or(client_id, |(identity, _)| identity)
}
