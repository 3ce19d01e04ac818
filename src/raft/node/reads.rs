//! ReadIndex reads (§6.4): registered once the leader committed an entry of its term, released
//! as [`ReadState`]s once a quorum answered a heartbeat sent after them.

use super::{PendingRead, ProposeError, Raft, ReadState, Role};

impl Raft {
    /// Requests a linearizable read (§6.4). A [`ReadState`] with this `ctx` appears in a later
    /// `Ready` once a quorum has confirmed this server is still leader.
    pub fn read_index(&mut self, ctx: u64) -> Result<(), ProposeError> {
        if self.role != Role::Leader {
            return Err(ProposeError::NotLeader {
                leader_id: self.leader_id,
            });
        }
        if self.pending_reads.len() + self.reads_awaiting_commit.len() >= self.cfg.max_pending_reads
        {
            return Err(ProposeError::Busy);
        }
        if !self.committed_in_current_term() {
            self.reads_awaiting_commit.push(ctx);
            return Ok(());
        }
        self.register_read(ctx);
        Ok(())
    }

    pub(super) fn register_read(&mut self, ctx: u64) {
        let index = self.log.committed;
        let alone = self.membership.voters.len() == 1 && self.membership.is_voter(self.id);
        if alone || self.bug(|b| b.read_index_without_heartbeat) {
            self.read_states.push(ReadState { ctx, index });
            return;
        }
        self.read_seq += 1;
        self.pending_reads.push_back(PendingRead {
            ctx,
            index,
            seq: self.read_seq,
        });
        self.broadcast_heartbeat();
    }

    pub(super) fn advance_reads(&mut self) {
        while let Some(front) = self.pending_reads.front() {
            let acks = self
                .membership
                .voters
                .iter()
                .filter(|&&v| {
                    v == self.id
                        || self
                            .progress
                            .get(&v)
                            .is_some_and(|p| p.read_ack >= front.seq)
                })
                .count();
            if acks < self.membership.quorum() {
                break;
            }
            let read = self.pending_reads.pop_front().expect("front exists");
            self.read_states.push(ReadState {
                ctx: read.ctx,
                index: read.index,
            });
        }
    }
}
