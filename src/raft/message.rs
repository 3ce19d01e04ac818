//! Messages exchanged between Raft servers. The core produces and consumes these as values; the
//! peer transport (`crate::server`) maps them onto `proto/peer.proto`.

use bytes::Bytes;

use super::types::{Entry, Index, NodeId, SnapshotMeta, Term};

/// One Raft message. `term` is the sender's current term, except for PreVote requests, which carry
/// the term the sender *would* campaign in (dissertation §9.6) without having adopted it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub from: NodeId,
    pub to: NodeId,
    pub term: Term,
    pub body: MessageBody,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MessageBody {
    /// RequestVote (§5.2) or PreVote (§9.6).
    Vote {
        pre_vote: bool,
        last_log_index: Index,
        last_log_term: Term,
        /// Set when the candidate campaigns because the leader told it to (TimeoutNow, §3.10);
        /// voters then ignore their leader lease (§4.2.3), which would otherwise reject it.
        leadership_transfer: bool,
    },
    VoteResponse {
        pre_vote: bool,
        granted: bool,
    },
    /// AppendEntries (§5.3). `prev_log_index`/`prev_log_term` name the entry just before `entries`.
    Append {
        prev_log_index: Index,
        prev_log_term: Term,
        entries: Vec<Entry>,
        leader_commit: Index,
    },
    /// The answer to `Append`. On success `match_index` is the last index known to match the
    /// leader. On rejection the follower returns the seed design's recovery hint:
    /// - `recovery_term == 0`: the follower's log is shorter than `prev_log_index`;
    ///   `recovery_index` is its last index (its length), so the leader continues after it;
    /// - otherwise `recovery_term` is the term of the follower's conflicting entry at
    ///   `prev_log_index`, and `recovery_index` is the last index *before* that term in the
    ///   follower's log.
    ///
    /// `rejected_index` echoes the rejected `prev_log_index` so stale rejections can be ignored.
    AppendResponse {
        success: bool,
        match_index: Index,
        rejected_index: Index,
        recovery_index: Index,
        recovery_term: Term,
    },
    /// Leader liveness and commit propagation. `commit` is never above what the follower is known
    /// to hold. `read_seq` lets ReadIndex requests (§6.4) confirm leadership with one round.
    Heartbeat {
        commit: Index,
        read_seq: u64,
    },
    HeartbeatResponse {
        read_seq: u64,
    },
    /// One chunk of a snapshot (§5.7, chunked as in Figure 5.12 of the dissertation).
    /// `total_len` is the whole snapshot's size, a hint the follower sizes its buffer by (0 when
    /// the sender did not say); the chunks themselves decide what arrives.
    InstallSnapshot {
        meta: SnapshotMeta,
        offset: u64,
        data: Bytes,
        done: bool,
        total_len: u64,
    },
    /// `next_offset` is where the follower wants the next chunk; `done` means it has installed the
    /// whole snapshot at `snapshot_index`. `rejected` asks the leader to restart from `next_offset`.
    InstallSnapshotResponse {
        snapshot_index: Index,
        next_offset: u64,
        done: bool,
    },
    /// Leadership transfer (§3.10): campaign now, skipping the election timeout and PreVote.
    TimeoutNow,
}

impl Message {
    /// A short name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match &self.body {
            MessageBody::Vote { pre_vote: true, .. } => "pre_vote",
            MessageBody::Vote { .. } => "vote",
            MessageBody::VoteResponse { pre_vote: true, .. } => "pre_vote_response",
            MessageBody::VoteResponse { .. } => "vote_response",
            MessageBody::Append { .. } => "append",
            MessageBody::AppendResponse { .. } => "append_response",
            MessageBody::Heartbeat { .. } => "heartbeat",
            MessageBody::HeartbeatResponse { .. } => "heartbeat_response",
            MessageBody::InstallSnapshot { .. } => "install_snapshot",
            MessageBody::InstallSnapshotResponse { .. } => "install_snapshot_response",
            MessageBody::TimeoutNow => "timeout_now",
        }
    }

    /// True for messages that only a leader sends (used for the leader lease and liveness).
    pub fn is_from_leader(&self) -> bool {
        matches!(
            self.body,
            MessageBody::Append { .. }
                | MessageBody::Heartbeat { .. }
                | MessageBody::InstallSnapshot { .. }
        )
    }
}
