//! The lock state machine: FIFO locks with TTLs, one cluster-wide fencing sequence, exactly-once
//! requests and a replicated key-value store — a pure, deterministic function of the committed
//! log (docs/guarantees.md).
//!
//! It never does I/O, never reads a clock and never draws randomness: every replica applying the
//! same log reaches byte-identical state. Leases are enforced by the leader proposing `Expire`.

mod command;
mod limits;
mod machine;
mod outcome;

#[cfg(test)]
mod shared_tests;
#[cfg(test)]
mod tests;

pub use command::{AcquireParts, Command, DecodeError, FencingToken, LockMode};
pub use limits::{identity_of, Limits, LimitsV1, Quotas};
pub use machine::{
    sequence_number, stored_to_snapshot_pairs, ClusterIdentity, ElectionInfo, HeldLock,
    LockDelayInfo, LockStateMachine, MachineBugs, MemberInfo, SessionInfo, SharedHolderInfo,
    SharedLockInfo, SharedWaiterInfo, StateLoader, StoredToSnapshot, WaiterInfo, CLUSTER_VERSION,
    DEDUPE_BLOCK, ELECTION_VERSION, LIFECYCLE_VERSION, LOCK_DELAY_VERSION, MEMBERS_MAX,
    MEMBER_ADDR_MAX, QUOTAS_VERSION, SEQUENCED_VERSION, SESSION_VERSION, SHARED_VERSION,
};
pub use outcome::{Applied, Event, Outcome, RejectCode};
