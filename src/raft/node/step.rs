//! Incoming messages: the term checks every message passes (§5.1, §4.2.3) and the dispatch to
//! the handlers of each concern.

use super::{Raft, Role};
use crate::raft::message::{Message, MessageBody};
use crate::raft::types::NodeId;

impl Raft {
    /// Handles a message from a peer. Messages that are stale, duplicated, reordered or
    /// addressed to someone else are ignored or answered harmlessly; none can make the core
    /// panic.
    pub fn step(&mut self, msg: Message) {
        if msg.to != self.id || msg.from == self.id || msg.from == 0 {
            return;
        }
        if msg.term > self.term {
            let in_lease = self.cfg.check_quorum
                && self.leader_id != 0
                && self.election_elapsed < self.cfg.election_ticks;
            // §4.2.3: a server that heard from a leader within the minimum election timeout
            // ignores vote requests, so removed or partitioned servers cannot disrupt a healthy
            // cluster. A transfer-initiated campaign (§3.10) is exempt.
            if let MessageBody::Vote {
                leadership_transfer: false,
                ..
            } = &msg.body
            {
                if in_lease {
                    return;
                }
            }
            match &msg.body {
                // A PreVote neither changes our term nor the candidate's.
                MessageBody::Vote { pre_vote: true, .. } => {}
                MessageBody::VoteResponse {
                    pre_vote: true,
                    granted: true,
                } => {}
                _ => {
                    let leader = if msg.is_from_leader() { msg.from } else { 0 };
                    self.become_follower(msg.term, leader);
                }
            }
        } else if msg.term < self.term {
            match msg.body {
                MessageBody::Append { .. } | MessageBody::Heartbeat { .. } => {
                    // A deposed leader: tell it our term so it steps down.
                    self.send(
                        msg.from,
                        MessageBody::AppendResponse {
                            success: false,
                            match_index: 0,
                            rejected_index: 0,
                            recovery_index: 0,
                            recovery_term: 0,
                        },
                    );
                }
                MessageBody::Vote { pre_vote, .. } => {
                    self.send(
                        msg.from,
                        MessageBody::VoteResponse {
                            pre_vote,
                            granted: false,
                        },
                    );
                }
                _ => {}
            }
            return;
        }

        match msg.body {
            MessageBody::Vote {
                pre_vote,
                last_log_index,
                last_log_term,
                ..
            } => self.handle_vote_request(
                msg.from,
                msg.term,
                pre_vote,
                last_log_index,
                last_log_term,
            ),
            MessageBody::VoteResponse { pre_vote, granted } => {
                self.handle_vote_response(msg.from, msg.term, pre_vote, granted)
            }
            MessageBody::Append {
                prev_log_index,
                prev_log_term,
                entries,
                leader_commit,
            } => {
                self.follow(msg.from);
                self.handle_append(
                    msg.from,
                    prev_log_index,
                    prev_log_term,
                    entries,
                    leader_commit,
                );
            }
            MessageBody::Heartbeat { commit, read_seq } => {
                self.follow(msg.from);
                if commit > self.log.committed {
                    self.log.committed = commit.min(self.log.last_index());
                }
                self.send(msg.from, MessageBody::HeartbeatResponse { read_seq });
            }
            MessageBody::InstallSnapshot {
                meta,
                offset,
                data,
                done,
                total_len,
            } => {
                self.follow(msg.from);
                self.handle_snapshot_chunk(msg.from, meta, offset, data, done, total_len);
            }
            MessageBody::TimeoutNow => {
                if self.promotable() && self.role != Role::Leader {
                    self.campaign(false, true);
                }
            }
            MessageBody::AppendResponse {
                success,
                match_index,
                rejected_index,
                recovery_index,
                recovery_term,
            } => {
                if self.role == Role::Leader {
                    self.handle_append_response(
                        msg.from,
                        success,
                        match_index,
                        rejected_index,
                        recovery_index,
                        recovery_term,
                    );
                }
            }
            MessageBody::HeartbeatResponse { read_seq } => {
                if self.role == Role::Leader {
                    self.handle_heartbeat_response(msg.from, read_seq);
                }
            }
            MessageBody::InstallSnapshotResponse {
                snapshot_index,
                next_offset,
                done,
            } => {
                if self.role == Role::Leader {
                    self.handle_snapshot_response(msg.from, snapshot_index, next_offset, done);
                }
            }
        }
    }

    /// A message from the leader of our current term.
    fn follow(&mut self, leader: NodeId) {
        if self.role != Role::Follower || self.leader_id != leader {
            self.become_follower(self.term, leader);
        }
        self.election_elapsed = 0;
    }
}
