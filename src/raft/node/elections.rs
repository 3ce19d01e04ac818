//! Elections and leadership (§5.2, §9.6): the election and heartbeat timers, CheckQuorum, who may
//! campaign, PreVote and votes, becoming follower or leader, and leadership transfer (§3.10).

use rand::Rng;

use super::{ProposeError, Raft, Role};
use crate::raft::message::{Message, MessageBody};
use crate::raft::progress::Progress;
use crate::raft::types::{EntryPayload, Index, NodeId, Term};

impl Raft {
    /// Advances logical time by one tick.
    pub fn tick(&mut self) {
        if self.role == Role::Leader {
            self.tick_leader();
        } else {
            self.election_elapsed += 1;
            if self.promotable() && self.election_elapsed >= self.randomized_election_ticks {
                self.election_elapsed = 0;
                self.campaign(self.cfg.pre_vote, false);
            }
        }
    }

    fn tick_leader(&mut self) {
        self.heartbeat_elapsed += 1;
        self.election_elapsed += 1;
        if self.election_elapsed >= self.cfg.election_ticks {
            self.election_elapsed = 0;
            // CheckQuorum (§6.2): step down if a quorum has not been heard from for an election
            // timeout, so a partitioned leader stops claiming leadership.
            if self.cfg.check_quorum && !self.quorum_recently_active() {
                self.stats.quorum_lost += 1;
                self.become_follower(self.term, 0);
                return;
            }
            for pr in self.progress.values_mut() {
                pr.recent_active = false;
            }
            if self.transfer_target.is_some() {
                // Abort a transfer that did not finish within an election timeout (§3.10).
                self.transfer_target = None;
            }
        }
        if self.heartbeat_elapsed >= self.cfg.heartbeat_ticks {
            self.heartbeat_elapsed = 0;
            self.broadcast_heartbeat();
        }
        self.announce_commit();
    }

    fn quorum_recently_active(&self) -> bool {
        let active = self
            .membership
            .voters
            .iter()
            .filter(|&&v| v == self.id || self.progress.get(&v).is_some_and(|p| p.recent_active))
            .count();
        active >= self.membership.quorum()
    }

    /// May this server start an election? Voters may. So may a server whose own removal is
    /// appended but not committed: it can hold the only up-to-date copy of that entry (a leader
    /// that removed itself and then lost contact), and without it the remaining voters could never
    /// elect anyone. Its candidacy counts only the voters of its latest configuration.
    ///
    /// So may a learner whose log runs past its commit index. A voter's configuration can name
    /// it a voter (its promotion appended there, on another branch of the log), and then the
    /// voters can need its vote while it refuses every one of them, its log being the newest:
    /// it may hold the only copy of the last leader's entries (simulator seed 694, segments
    /// disk: that leader's disk was then lost). Elected by its own configuration's voters, it
    /// leads only until it commits those entries, then steps down (`maybe_commit`), and a
    /// learner whose log is all committed never campaigns.
    pub(super) fn promotable(&self) -> bool {
        if self.state_pending || !self.in_elections {
            return false;
        }
        if self.membership.is_voter(self.id) {
            return true;
        }
        if self.membership.learners.contains(&self.id) && self.log.last_index() > self.log.committed
        {
            return true;
        }
        self.membership_index > self.log.committed
            && self
                .membership_at(self.membership_index - 1)
                .is_voter(self.id)
    }

    /// Takes this server out of elections (`false`: it neither campaigns nor grants a vote or a
    /// PreVote) or back in. A server that lost its data and came back under its id is out
    /// until its log holds the entry that admitted it as the new incarnation: before that, a
    /// configuration in its (partial) log or in a lagging peer's may still name it a voter,
    /// and a vote from a log it does not have yet could elect a leader without a committed
    /// entry. It still takes appends and snapshots, which is how it gets that entry.
    pub fn set_in_elections(&mut self, in_elections: bool) {
        self.in_elections = in_elections;
    }

    pub fn in_elections(&self) -> bool {
        self.in_elections
    }

    /// Starts an election now (used by tests and by a single-node bootstrap).
    pub fn campaign_now(&mut self) {
        if self.role != Role::Leader && self.promotable() {
            self.campaign(self.cfg.pre_vote, false);
        }
    }

    /// Starts a leadership transfer to `target` (§3.10): stop accepting proposals, bring the
    /// target up to date, then tell it to campaign at once.
    pub fn transfer_leader(&mut self, target: NodeId) -> Result<(), ProposeError> {
        if self.role != Role::Leader {
            return Err(ProposeError::NotLeader {
                leader_id: self.leader_id,
            });
        }
        if target == self.id {
            return Ok(());
        }
        if !self.membership.is_voter(target) {
            return Err(ProposeError::NotVoter(target));
        }
        self.transfer_target = Some(target);
        self.election_elapsed = 0;
        let up_to_date = self
            .progress
            .get(&target)
            .is_some_and(|p| p.match_index == self.log.last_index());
        if up_to_date {
            self.send(target, MessageBody::TimeoutNow);
        } else {
            self.send_append(target, true);
        }
        Ok(())
    }

    pub(super) fn campaign(&mut self, pre_vote: bool, leadership_transfer: bool) {
        let campaign_term;
        if pre_vote {
            self.role = Role::PreCandidate;
            self.leader_id = 0;
            campaign_term = self.term + 1;
            self.stats.pre_votes_started += 1;
        } else {
            self.term += 1;
            self.vote = self.id;
            self.role = Role::Candidate;
            self.leader_id = 0;
            campaign_term = self.term;
            self.stats.elections_started += 1;
        }
        self.progress.clear();
        self.reset_election_timeout();
        self.votes.clear();
        self.votes.insert(self.id, true);
        if self.tally_won() {
            if pre_vote {
                self.campaign(false, leadership_transfer);
            } else {
                self.become_leader();
            }
            return;
        }
        let (last_log_index, last_log_term) = (self.log.last_index(), self.log.last_term());
        let voters: Vec<NodeId> = self
            .membership
            .voters
            .iter()
            .copied()
            .filter(|&v| v != self.id)
            .collect();
        for voter in voters {
            self.messages.push(Message {
                from: self.id,
                to: voter,
                term: campaign_term,
                body: MessageBody::Vote {
                    pre_vote,
                    last_log_index,
                    last_log_term,
                    leadership_transfer,
                },
            });
        }
    }

    fn tally_won(&self) -> bool {
        let granted = self
            .votes
            .iter()
            .filter(|(id, granted)| **granted && self.membership.is_voter(**id))
            .count();
        granted >= self.membership.quorum()
    }

    fn tally_lost(&self) -> bool {
        let rejected = self
            .votes
            .iter()
            .filter(|(id, granted)| !**granted && self.membership.is_voter(**id))
            .count();
        rejected >= self.membership.quorum()
    }

    pub(super) fn handle_vote_request(
        &mut self,
        from: NodeId,
        term: Term,
        pre_vote: bool,
        last_log_index: Index,
        last_log_term: Term,
    ) {
        // One vote per term (§5.2); a PreVote for a later term binds nothing.
        let can_vote = self.vote == from
            || (self.vote == 0 && self.leader_id == 0)
            || (pre_vote && term > self.term);
        let log_ok = self.bug(|b| b.vote_without_log_check)
            || self.log.is_up_to_date(last_log_index, last_log_term);
        let granted = can_vote && log_ok && self.in_elections;
        if granted && !pre_vote {
            self.vote = from;
            self.election_elapsed = 0;
        }
        let body = MessageBody::VoteResponse { pre_vote, granted };
        let reply_term = if pre_vote && granted { term } else { self.term };
        let msg = Message {
            from: self.id,
            to: from,
            term: reply_term,
            body,
        };
        #[cfg(test)]
        if self.cfg.bugs.vote_before_persist {
            self.early_vote_replies.push(msg);
            return;
        }
        self.messages.push(msg);
    }

    pub(super) fn handle_vote_response(
        &mut self,
        from: NodeId,
        term: Term,
        pre_vote: bool,
        granted: bool,
    ) {
        let expected = match (pre_vote, self.role) {
            (true, Role::PreCandidate) => !granted || term == self.term + 1,
            (false, Role::Candidate) => term == self.term,
            _ => false,
        };
        if !expected {
            return;
        }
        self.votes.entry(from).or_insert(granted);
        if self.tally_won() {
            if pre_vote && self.bug(|b| b.prevote_counts_as_vote) {
                self.term += 1;
                self.vote = self.id;
                self.stats.elections_started += 1;
                self.become_leader();
            } else if pre_vote {
                self.campaign(false, false);
            } else {
                self.become_leader();
            }
        } else if self.tally_lost() {
            self.become_follower(self.term, 0);
        }
    }

    pub(super) fn become_follower(&mut self, term: Term, leader_id: NodeId) {
        if term > self.term {
            self.term = term;
            self.vote = 0;
        }
        self.role = Role::Follower;
        self.leader_id = leader_id;
        self.election_elapsed = 0;
        self.heartbeat_elapsed = 0;
        self.progress.clear();
        self.votes.clear();
        self.transfer_target = None;
        self.pending_reads.clear();
        self.reads_awaiting_commit.clear();
        self.reset_election_timeout();
    }

    fn become_leader(&mut self) {
        self.role = Role::Leader;
        self.leader_id = self.id;
        self.election_elapsed = 0;
        self.heartbeat_elapsed = 0;
        self.transfer_target = None;
        self.stats.terms_won += 1;
        let next = self.log.last_index() + 1;
        self.progress = self
            .membership
            .members()
            .filter(|&m| m != self.id)
            .map(|m| (m, Progress::new(next)))
            .collect();
        // §5.4.2 / §8: a new leader commits a no-op so entries of earlier terms become committed
        // and ReadIndex becomes possible.
        self.append_entry(EntryPayload::Noop);
        self.broadcast_append();
    }

    pub(super) fn reset_election_timeout(&mut self) {
        let min = self.cfg.election_ticks;
        self.randomized_election_ticks = self.rng.random_range(min..2 * min);
    }
}
