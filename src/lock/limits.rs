//! Bounds on everything the lock state machine stores: key and value sizes, ids,
//! lease and wait lengths, waiters per key, held locks, data entries, and the dedupe table.
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
    /// Entries in the `(client_id, request_id)` dedupe table; the oldest entry is evicted first.
    /// Zero disables deduplication.
    pub dedupe_entries_max: usize,
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
            dedupe_entries_max: 100_000,
        }
    }
}
