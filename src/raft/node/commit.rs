//! The commit index: advanced by the leader once a quorum stores an entry of its term (§5.4.2),
//! and announced to idle followers on the next tick.

use super::Raft;
use crate::raft::progress::ProgressState;
use crate::raft::types::{Index, NodeId};

impl Raft {
    /// Advances the commit index to the highest index stored on a quorum of voters, but only if
    /// that entry is from the current term (§5.4.2).
    pub(super) fn maybe_commit(&mut self) {
        let self_match = self.log.stable_index();
        let match_of = |v: &NodeId| {
            if *v == self.id {
                self_match
            } else {
                self.progress.get(v).map_or(0, |p| p.match_index)
            }
        };
        // Runs on every append answer: the usual cluster sizes sort on the stack.
        let mut on_stack = [0; 9];
        let mut on_heap = Vec::new();
        let voters = self.membership.voters.len();
        let matches: &mut [Index] = if voters <= on_stack.len() {
            for (slot, v) in on_stack.iter_mut().zip(&self.membership.voters) {
                *slot = match_of(v);
            }
            &mut on_stack[..voters]
        } else {
            on_heap.extend(self.membership.voters.iter().map(match_of));
            &mut on_heap
        };
        if matches.is_empty() {
            return;
        }
        matches.sort_unstable_by(|a, b| b.cmp(a));
        let quorum_index = matches[self.membership.quorum() - 1];
        if quorum_index <= self.log.committed {
            return;
        }
        let term_ok =
            self.log.term(quorum_index) == Some(self.term) || self.bug(|b| b.commit_earlier_term);
        if !term_ok {
            return;
        }
        let was_committed_in_term = self.committed_in_current_term();
        self.log.committed = quorum_index;
        if !was_committed_in_term && self.committed_in_current_term() {
            for ctx in std::mem::take(&mut self.reads_awaiting_commit) {
                self.register_read(ctx);
            }
        }
        // A leader removed from the configuration steps down once the removal commits (§4.2.2).
        // Followers learn the new commit index with the next append, or at the latest on the
        // next tick (`announce_commit`).
        if self.membership_index <= self.log.committed && !self.membership.is_voter(self.id) {
            self.become_follower(self.term, 0);
        }
    }

    /// Sends the commit index to each caught-up follower that has not been told it yet. A new
    /// commit index travels with the next append (under load there is one at once), so it is
    /// announced on its own only when none went out by the leader's next tick: one message
    /// (and its answer) per follower per commit saved, for followers that learn it at most a
    /// tick later when the cluster goes idle.
    pub(super) fn announce_commit(&mut self) {
        let committed = self.log.committed;
        let last_index = self.log.last_index();
        let idle: Vec<NodeId> = self
            .progress
            .iter()
            .filter(|(_, p)| {
                p.state == ProgressState::Replicate
                    && p.next_index > last_index
                    && p.commit_sent < committed
            })
            .map(|(&id, _)| id)
            .collect();
        for peer in idle {
            self.send_append(peer, true);
        }
    }
}
