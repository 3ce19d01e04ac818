//! Translation between the core's message types and their protobuf form on the peer wire.
//! Decoding validates: a malformed message from a peer becomes an error, never a panic.

use bytes::Bytes;

use super::proto::peer as pb;
use crate::raft::{
    Entry, EntryPayload, Membership, MembershipChange, Message, MessageBody, SnapshotMeta,
};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("peer message without a body")]
    MissingBody,
    #[error("entry without a payload")]
    MissingPayload,
    #[error("unknown membership change kind {0}")]
    UnknownChangeKind(i32),
    #[error("snapshot chunk without metadata")]
    MissingSnapshotMeta,
}

fn membership_to_pb(m: &Membership) -> pb::Membership {
    pb::Membership {
        voters: m.voters.iter().copied().collect(),
        learners: m.learners.iter().copied().collect(),
    }
}

fn membership_from_pb(m: pb::Membership) -> Membership {
    Membership {
        voters: m.voters.into_iter().collect(),
        learners: m.learners.into_iter().collect(),
    }
}

fn entry_to_pb(e: &Entry) -> pb::Entry {
    use pb::entry::Payload;
    let payload = match &e.payload {
        EntryPayload::Noop => Payload::Noop(true),
        EntryPayload::Command(data) => Payload::Command(data.clone()),
        EntryPayload::Membership(change) => {
            let (kind, node_id) = match *change {
                MembershipChange::AddLearner(id) => (pb::membership_change::Kind::AddLearner, id),
                MembershipChange::PromoteLearner(id) => {
                    (pb::membership_change::Kind::PromoteLearner, id)
                }
                MembershipChange::RemoveServer(id) => {
                    (pb::membership_change::Kind::RemoveServer, id)
                }
            };
            Payload::Membership(pb::MembershipChange {
                kind: kind as i32,
                node_id,
            })
        }
        EntryPayload::Config(m) => Payload::Config(membership_to_pb(m)),
    };
    pb::Entry {
        term: e.term,
        index: e.index,
        payload: Some(payload),
    }
}

fn entry_from_pb(e: pb::Entry) -> Result<Entry, DecodeError> {
    use pb::entry::Payload;
    let payload = match e.payload.ok_or(DecodeError::MissingPayload)? {
        Payload::Noop(_) => EntryPayload::Noop,
        Payload::Command(data) => EntryPayload::Command(data),
        Payload::Membership(change) => {
            let kind = pb::membership_change::Kind::try_from(change.kind)
                .map_err(|_| DecodeError::UnknownChangeKind(change.kind))?;
            EntryPayload::Membership(match kind {
                pb::membership_change::Kind::AddLearner => {
                    MembershipChange::AddLearner(change.node_id)
                }
                pb::membership_change::Kind::PromoteLearner => {
                    MembershipChange::PromoteLearner(change.node_id)
                }
                pb::membership_change::Kind::RemoveServer => {
                    MembershipChange::RemoveServer(change.node_id)
                }
            })
        }
        Payload::Config(m) => EntryPayload::Config(membership_from_pb(m)),
    };
    Ok(Entry {
        term: e.term,
        index: e.index,
        payload,
    })
}

pub fn message_to_pb(msg: &Message) -> pb::RaftMessage {
    use pb::raft_message::Body;
    let body = match &msg.body {
        MessageBody::Vote {
            pre_vote,
            last_log_index,
            last_log_term,
            leadership_transfer,
        } => Body::Vote(pb::RequestVote {
            pre_vote: *pre_vote,
            last_log_index: *last_log_index,
            last_log_term: *last_log_term,
            leadership_transfer: *leadership_transfer,
        }),
        MessageBody::VoteResponse { pre_vote, granted } => Body::VoteReply(pb::RequestVoteReply {
            pre_vote: *pre_vote,
            granted: *granted,
        }),
        MessageBody::Append {
            prev_log_index,
            prev_log_term,
            entries,
            leader_commit,
        } => Body::Append(pb::AppendEntries {
            prev_log_index: *prev_log_index,
            prev_log_term: *prev_log_term,
            entries: entries.iter().map(entry_to_pb).collect(),
            leader_commit: *leader_commit,
        }),
        MessageBody::AppendResponse {
            success,
            match_index,
            rejected_index,
            recovery_index,
            recovery_term,
        } => Body::AppendReply(pb::AppendEntriesReply {
            success: *success,
            match_index: *match_index,
            rejected_index: *rejected_index,
            recovery_index: *recovery_index,
            recovery_term: *recovery_term,
        }),
        MessageBody::Heartbeat { commit, read_seq } => Body::Heartbeat(pb::Heartbeat {
            commit: *commit,
            read_seq: *read_seq,
        }),
        MessageBody::HeartbeatResponse { read_seq } => Body::HeartbeatReply(pb::HeartbeatReply {
            read_seq: *read_seq,
        }),
        MessageBody::InstallSnapshot {
            meta,
            offset,
            data,
            done,
            total_len,
        } => Body::InstallSnapshot(pb::InstallSnapshot {
            meta: Some(pb::SnapshotMeta {
                index: meta.index,
                term: meta.term,
                membership: Some(membership_to_pb(&meta.membership)),
            }),
            offset: *offset,
            data: data.clone(),
            done: *done,
            total_len: *total_len,
        }),
        MessageBody::InstallSnapshotResponse {
            snapshot_index,
            next_offset,
            done,
        } => Body::InstallSnapshotReply(pb::InstallSnapshotReply {
            snapshot_index: *snapshot_index,
            next_offset: *next_offset,
            done: *done,
        }),
        MessageBody::TimeoutNow => Body::TimeoutNow(pb::TimeoutNow {}),
    };
    pb::RaftMessage {
        from: msg.from,
        to: msg.to,
        term: msg.term,
        body: Some(body),
    }
}

pub fn message_from_pb(msg: pb::RaftMessage) -> Result<Message, DecodeError> {
    use pb::raft_message::Body;
    let body = match msg.body.ok_or(DecodeError::MissingBody)? {
        Body::Vote(v) => MessageBody::Vote {
            pre_vote: v.pre_vote,
            last_log_index: v.last_log_index,
            last_log_term: v.last_log_term,
            leadership_transfer: v.leadership_transfer,
        },
        Body::VoteReply(v) => MessageBody::VoteResponse {
            pre_vote: v.pre_vote,
            granted: v.granted,
        },
        Body::Append(a) => MessageBody::Append {
            prev_log_index: a.prev_log_index,
            prev_log_term: a.prev_log_term,
            entries: a
                .entries
                .into_iter()
                .map(entry_from_pb)
                .collect::<Result<_, _>>()?,
            leader_commit: a.leader_commit,
        },
        Body::AppendReply(a) => MessageBody::AppendResponse {
            success: a.success,
            match_index: a.match_index,
            rejected_index: a.rejected_index,
            recovery_index: a.recovery_index,
            recovery_term: a.recovery_term,
        },
        Body::Heartbeat(h) => MessageBody::Heartbeat {
            commit: h.commit,
            read_seq: h.read_seq,
        },
        Body::HeartbeatReply(h) => MessageBody::HeartbeatResponse {
            read_seq: h.read_seq,
        },
        Body::InstallSnapshot(s) => {
            let meta = s.meta.ok_or(DecodeError::MissingSnapshotMeta)?;
            MessageBody::InstallSnapshot {
                meta: SnapshotMeta {
                    index: meta.index,
                    term: meta.term,
                    membership: meta.membership.map(membership_from_pb).unwrap_or_default(),
                },
                offset: s.offset,
                data: s.data,
                done: s.done,
                total_len: s.total_len,
            }
        }
        Body::InstallSnapshotReply(s) => MessageBody::InstallSnapshotResponse {
            snapshot_index: s.snapshot_index,
            next_offset: s.next_offset,
            done: s.done,
        },
        Body::TimeoutNow(_) => MessageBody::TimeoutNow,
    };
    Ok(Message {
        from: msg.from,
        to: msg.to,
        term: msg.term,
        body,
    })
}

/// Bytes of a command payload, for tests and size checks.
pub fn command_bytes(entry: &Entry) -> Option<&Bytes> {
    match &entry.payload {
        EntryPayload::Command(data) => Some(data),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_kind_round_trips() {
        let entries = vec![
            Entry {
                term: 0,
                index: 1,
                payload: EntryPayload::Config(Membership::with_voters([1, 2])),
            },
            Entry {
                term: 1,
                index: 2,
                payload: EntryPayload::Noop,
            },
            Entry {
                term: 1,
                index: 3,
                payload: EntryPayload::Command(Bytes::from_static(b"x")),
            },
            Entry {
                term: 1,
                index: 4,
                payload: EntryPayload::Membership(MembershipChange::PromoteLearner(3)),
            },
        ];
        let bodies = vec![
            MessageBody::Vote {
                pre_vote: true,
                last_log_index: 4,
                last_log_term: 1,
                leadership_transfer: true,
            },
            MessageBody::VoteResponse {
                pre_vote: false,
                granted: true,
            },
            MessageBody::Append {
                prev_log_index: 0,
                prev_log_term: 0,
                entries,
                leader_commit: 2,
            },
            MessageBody::AppendResponse {
                success: false,
                match_index: 0,
                rejected_index: 9,
                recovery_index: 3,
                recovery_term: 2,
            },
            MessageBody::Heartbeat {
                commit: 3,
                read_seq: 7,
            },
            MessageBody::HeartbeatResponse { read_seq: 7 },
            MessageBody::InstallSnapshot {
                meta: SnapshotMeta {
                    index: 9,
                    term: 2,
                    membership: Membership::with_voters([1]),
                },
                offset: 10,
                data: Bytes::from_static(b"chunk"),
                done: true,
                total_len: 15,
            },
            MessageBody::InstallSnapshotResponse {
                snapshot_index: 9,
                next_offset: 15,
                done: true,
            },
            MessageBody::TimeoutNow,
        ];
        for body in bodies {
            let msg = Message {
                from: 1,
                to: 2,
                term: 5,
                body,
            };
            assert_eq!(message_from_pb(message_to_pb(&msg)), Ok(msg));
        }
    }

    #[test]
    fn malformed_messages_are_errors() {
        let empty = pb::RaftMessage {
            from: 1,
            to: 2,
            term: 1,
            body: None,
        };
        assert_eq!(message_from_pb(empty), Err(DecodeError::MissingBody));
        let bad_entry = pb::RaftMessage {
            from: 1,
            to: 2,
            term: 1,
            body: Some(pb::raft_message::Body::Append(pb::AppendEntries {
                entries: vec![pb::Entry {
                    term: 1,
                    index: 1,
                    payload: None,
                }],
                ..Default::default()
            })),
        };
        assert_eq!(message_from_pb(bad_entry), Err(DecodeError::MissingPayload));
    }
}
