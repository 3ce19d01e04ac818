//! Plain data types shared by the consensus core, storage and the transport: log entries, hard
//! state, cluster membership and snapshot metadata.
//!
//! These types carry no behaviour beyond small, obviously-correct helpers. Storage persists them,
//! the peer transport encodes them, and the core reasons about them; none of them may depend on
//! I/O, clocks or randomness.

use std::collections::BTreeSet;

use bytes::Bytes;

/// Identifies one server for its whole life. `0` is never a valid id (it means "none").
pub type NodeId = u64;
/// A Raft term (§5.1). Terms only ever increase on a server.
pub type Term = u64;
/// A log position. The first entry has index 1; index 0 is the empty prefix.
pub type Index = u64;

/// The part of a server's state that must be on stable storage before it answers any RPC (§5.1,
/// Figure 2): the current term, the vote cast in it, and the highest index known committed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HardState {
    pub term: Term,
    /// The candidate this server voted for in `term`, or 0 for none.
    pub vote: NodeId,
    /// Highest log index known to be committed when the hard state was last handed out. It is
    /// persisted only with a change of term or vote (a restarted server starts from the larger
    /// of it and its applied index and re-learns the rest from the leader); it may lag the
    /// in-memory value.
    pub commit: Index,
}

/// What a log entry carries.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EntryPayload {
    /// Appended by every new leader at the start of its term (§5.4.2, §8) so that it can commit
    /// entries of earlier terms and serve ReadIndex reads.
    Noop,
    /// An opaque application command (a lock operation, encoded by `crate::lock`).
    Command(Bytes),
    /// The full initial configuration. Only ever entry 1, term 0: every server bootstrapped with
    /// `--initial-cluster` (or `--bootstrap`) writes the identical entry, so it is committed
    /// everywhere from the start, and a server that joins later learns the base configuration
    /// from it (or from a snapshot that covers it).
    Config(Membership),
    /// A single-server membership change (dissertation §4.1). It takes effect on each server as soon
    /// as it is appended to that server's log, committed or not.
    Membership(MembershipChange),
}

/// One log entry.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub term: Term,
    pub index: Index,
    pub payload: EntryPayload,
}

impl Entry {
    /// Approximate encoded size in bytes, used to bound batches. It need not be exact, only
    /// monotone in the payload size.
    pub fn size_bytes(&self) -> usize {
        const HEADER_BYTES: usize = 24;
        HEADER_BYTES
            + match &self.payload {
                EntryPayload::Noop => 0,
                EntryPayload::Command(data) => data.len(),
                EntryPayload::Membership(_) => 16,
                EntryPayload::Config(m) => 8 * (m.voters.len() + m.learners.len()),
            }
    }
}

/// One single-server membership step. Adding a server is two steps: it joins as a learner, catches
/// up, and is then promoted to voter (dissertation §4.2.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MembershipChange {
    AddLearner(NodeId),
    PromoteLearner(NodeId),
    /// Removes a voter or a learner.
    RemoveServer(NodeId),
}

impl MembershipChange {
    pub fn node(&self) -> NodeId {
        match *self {
            MembershipChange::AddLearner(id)
            | MembershipChange::PromoteLearner(id)
            | MembershipChange::RemoveServer(id) => id,
        }
    }
}

/// Why a membership change was refused by [`Membership::apply`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    #[error("node id 0 is reserved")]
    InvalidNodeId,
    #[error("node {0} is already a member")]
    AlreadyMember(NodeId),
    #[error("node {0} is not a learner")]
    NotLearner(NodeId),
    #[error("node {0} is not a member")]
    NotMember(NodeId),
    #[error("removing node {0} would leave no voters")]
    LastVoter(NodeId),
}

/// A cluster configuration: who votes and who only receives the log.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Membership {
    pub voters: BTreeSet<NodeId>,
    pub learners: BTreeSet<NodeId>,
}

impl Membership {
    pub fn with_voters(voters: impl IntoIterator<Item = NodeId>) -> Self {
        Membership {
            voters: voters.into_iter().collect(),
            learners: BTreeSet::new(),
        }
    }

    pub fn is_voter(&self, id: NodeId) -> bool {
        self.voters.contains(&id)
    }

    pub fn contains(&self, id: NodeId) -> bool {
        self.voters.contains(&id) || self.learners.contains(&id)
    }

    pub fn is_empty(&self) -> bool {
        self.voters.is_empty() && self.learners.is_empty()
    }

    /// Every member, voters first.
    pub fn members(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.voters.iter().chain(self.learners.iter()).copied()
    }

    /// Number of votes that make a majority of the voters.
    pub fn quorum(&self) -> usize {
        self.voters.len() / 2 + 1
    }

    /// The configuration after `change`, or why the change is not valid here.
    pub fn apply(&self, change: MembershipChange) -> Result<Membership, MembershipError> {
        let mut next = self.clone();
        match change {
            MembershipChange::AddLearner(0)
            | MembershipChange::PromoteLearner(0)
            | MembershipChange::RemoveServer(0) => return Err(MembershipError::InvalidNodeId),
            MembershipChange::AddLearner(id) => {
                if self.contains(id) {
                    return Err(MembershipError::AlreadyMember(id));
                }
                next.learners.insert(id);
            }
            MembershipChange::PromoteLearner(id) => {
                if !next.learners.remove(&id) {
                    return Err(MembershipError::NotLearner(id));
                }
                next.voters.insert(id);
            }
            MembershipChange::RemoveServer(id) => {
                if next.voters.remove(&id) {
                    if next.voters.is_empty() {
                        return Err(MembershipError::LastVoter(id));
                    }
                } else if !next.learners.remove(&id) {
                    return Err(MembershipError::NotMember(id));
                }
            }
        }
        Ok(next)
    }
}

/// Describes a snapshot: the state machine after applying every entry up to `index`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SnapshotMeta {
    pub index: Index,
    pub term: Term,
    /// The configuration in effect at `index` (the last membership entry at or before it).
    pub membership: Membership,
}

/// A snapshot with its serialized state machine. The core treats `data` as opaque bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub meta: SnapshotMeta,
    pub data: Bytes,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_changes_are_single_server_steps() {
        let m = Membership::with_voters([1, 2, 3]);
        assert_eq!(m.quorum(), 2);
        let m = m.apply(MembershipChange::AddLearner(4)).unwrap();
        assert!(m.learners.contains(&4) && !m.is_voter(4));
        assert_eq!(
            m.quorum(),
            2,
            "learners do not count toward quorum (§4.2.1)"
        );
        assert_eq!(
            m.apply(MembershipChange::AddLearner(4)),
            Err(MembershipError::AlreadyMember(4))
        );
        assert_eq!(
            m.apply(MembershipChange::PromoteLearner(3)),
            Err(MembershipError::NotLearner(3))
        );
        let m = m.apply(MembershipChange::PromoteLearner(4)).unwrap();
        assert_eq!(m.quorum(), 3);
        let m = m.apply(MembershipChange::RemoveServer(1)).unwrap();
        assert_eq!(m.voters.iter().copied().collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(
            m.apply(MembershipChange::RemoveServer(9)),
            Err(MembershipError::NotMember(9))
        );
        let single = Membership::with_voters([7]);
        assert_eq!(
            single.apply(MembershipChange::RemoveServer(7)),
            Err(MembershipError::LastVoter(7))
        );
        assert_eq!(
            single.apply(MembershipChange::AddLearner(0)),
            Err(MembershipError::InvalidNodeId)
        );
    }
}
