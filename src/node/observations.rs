//! [`Observation`]: what a node reports of what happened, for metrics, logs and the simulator's
//! checkers (handed out as [`super::Effect::Observe`]).

use super::{events, Micros};
use crate::lock::Command;
use crate::raft::{Index, NodeId};

/// What happened, for metrics, logs and the simulator's checkers.
#[derive(Clone, Debug)]
pub enum Observation {
    /// This leader refused a client request at a limit or quota (`BUSY`), named as in the
    /// refusal's message (`waiters_per_key`, `locks_held`, `data_bytes`, `identity_locks`, …).
    LimitRefused {
        limit: String,
    },
    /// This node, on a new data directory, found the entry that admitted it in its log and
    /// takes part in elections from now on (the shell drops its on-disk mark).
    Admitted,
    /// This leader removed member `id`'s old incarnation: a new one, without its data, asked
    /// to join.
    MemberReplaced {
        id: NodeId,
    },
    /// This leader removed voter `id`, not heard from for the dead-member timeout.
    DeadMemberRemoved {
        id: NodeId,
    },
    BecameLeader {
        term: u64,
    },
    LostLeadership {
        term: u64,
        leader: NodeId,
    },
    LeaderChanged {
        leader: NodeId,
    },
    /// A lock was granted (directly or by a hand-off); `waited_us` counts from the arrival of
    /// the acquire at this node, when it arrived here.
    Granted {
        waited_us: Option<Micros>,
    },
    /// A holder's lease ended (release or expiry) after `held_us` on this leader.
    LeaseEnded {
        held_us: Micros,
        expired: bool,
    },
    Renewed,
    /// A client request was answered after it committed (`op`, result label).
    Answered {
        op: &'static str,
        result: &'static str,
    },
    ProposalFailed,
    /// A client request answered with an error instead of its outcome: refused before it was
    /// proposed (not the leader, paced by the exactly-once table, a read that cannot be served)
    /// or given up with its proposal (proposal refused, leadership lost — such an entry may
    /// still commit under the next leader, and a retry with its request id gets that outcome).
    /// `result` is the error code's label, as in [`Observation::Answered`].
    Refused {
        op: &'static str,
        result: &'static str,
    },
    /// The log was compacted to `index`: the stored state there is the new snapshot point.
    /// No bytes are built; a follower that needs the snapshot has it encoded then
    /// ([`Observation::SnapshotEncoded`]).
    LogCompacted {
        index: Index,
    },
    /// A snapshot of the state at `index` was encoded (`bytes` long) for a follower that needs
    /// it; the log is compacted to `index` if it was not already.
    SnapshotEncoded {
        index: Index,
        bytes: usize,
    },
    /// A snapshot from the leader is being installed: its point is durable with this Ready,
    /// and its state is put in place over the next drives.
    SnapshotInstallStarted {
        index: Index,
        bytes: usize,
    },
    SnapshotInstalled {
        index: Index,
    },
    RemovedFromCluster,
    /// A committed membership change removed `id` (seen on every node that applies it).
    MemberRemoved {
        id: NodeId,
    },
    /// A command whose bytes do not decode (only a bug could log one); skipped on every replica.
    Undecodable {
        index: Index,
    },
    /// Entries handed to storage (only with `observe_log`).
    Persisted(Vec<crate::raft::Entry>),
    /// One applied entry and its result (only with `observe_log`).
    Applied {
        index: Index,
        term: u64,
        command: Option<Box<Command>>,
        applied: Option<crate::lock::Applied>,
    },
    /// What an applied command did to locks (only with `observe_lock_events`).
    LockEvents(Vec<events::LockEvent>),
    /// Housekeeping the leader proposed.
    Housekeeping {
        expiries: usize,
        cancels: usize,
    },
}

/// The limit a refusal's message names (the state machine ends it with `[limit: <name>]`), for
/// [`Observation::LimitRefused`]; `other` when it names none.
pub(super) fn limit_named(message: &str) -> &str {
    message
        .rsplit_once("[limit: ")
        .and_then(|(_, rest)| rest.strip_suffix(']'))
        .unwrap_or("other")
}
