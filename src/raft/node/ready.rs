//! The Ready cycle: whether there is work for the driver, the [`Ready`] that hands it out, and
//! `advance` once it is done; plus `send`, which queues every outgoing message.

use super::{Raft, Ready, Role};
use crate::raft::message::{Message, MessageBody};
use crate::raft::types::NodeId;

impl Raft {
    pub fn has_ready(&self) -> bool {
        self.soft_state() != self.prev_soft
            || self.term_or_vote_changed()
            || self.log.has_unstable()
            || self.snapshot_to_install.is_some()
            || !self.accepted_chunks.is_empty()
            || !self.messages_now.is_empty()
            || !self.messages.is_empty()
            || (!self.state_pending && self.log.has_next_committed())
            || !self.read_states.is_empty()
    }

    fn term_or_vote_changed(&self) -> bool {
        self.term != self.prev_hard.term || self.vote != self.prev_hard.vote
    }

    pub fn ready(&mut self) -> Ready {
        let soft = self.soft_state();
        let hard = self.hard_state();
        let entries = self.log.take_unstable();
        let handed_out = entries.last().map(|e| (e.index, e.term));
        let term_or_vote_changed = self.term_or_vote_changed();
        let mut messages_now = std::mem::take(&mut self.messages_now);
        let mut messages = std::mem::take(&mut self.messages);
        if term_or_vote_changed {
            // No message may carry a term that is not yet durable: a leader elected in this very
            // step sends its first appends only after the flush.
            messages_now.append(&mut messages);
            messages = messages_now;
            messages_now = Vec::new();
        }
        #[cfg(test)]
        messages_now.append(&mut self.early_vote_replies);
        let ready = Ready {
            soft_state: (soft != self.prev_soft).then_some(soft),
            // Written when the term or vote changes (they must be durable before any message
            // that depends on them), not for every commit: a stored commit index only spares a
            // restarted server re-learning it, and the applied index stored with the lock state
            // (every entry applied was committed) gives a restart the same start. One sled write
            // fewer per commit on every node.
            hard_state: term_or_vote_changed.then_some(hard),
            term_or_vote_changed,
            handed_out,
            snapshot_chunks: std::mem::take(&mut self.accepted_chunks),
            snapshot: self.snapshot_to_install.take(),
            entries,
            messages_now,
            messages,
            committed_entries: if self.state_pending {
                Vec::new()
            } else {
                self.log.take_committed(self.cfg.max_apply_bytes)
            },
            read_states: std::mem::take(&mut self.read_states),
        };
        self.prev_soft = soft;
        self.prev_hard = hard;
        ready
    }

    /// The driver has put in place the state of the last snapshot a Ready handed it: entries
    /// committed after it are handed out again, and this server may campaign.
    pub fn state_installed(&mut self) {
        // A newer snapshot received meanwhile is not handed out yet: its state is pending.
        if self.snapshot_to_install.is_none() {
            self.state_pending = false;
        }
    }

    /// The driver has carried out `ready`: persisted, sent and applied it.
    pub fn advance(&mut self, ready: Ready) {
        if let Some((index, term)) = ready.handed_out {
            self.log.stable_to(index, term);
        }
        if let Some(snapshot) = ready.snapshot {
            self.snapshot = Some(snapshot);
            self.snapshot_wanted = false;
        }
        if self.role == Role::Leader {
            // The leader counts itself toward a commit only once its own entries are durable.
            self.maybe_commit();
        }
    }

    pub(super) fn send(&mut self, to: NodeId, body: MessageBody) {
        let msg = Message {
            from: self.id,
            to,
            term: self.term,
            body,
        };
        // The leader's own replication traffic may leave before its local flush (§10.2.1); every
        // answer waits for the flush that covers what it acknowledges.
        if msg.is_from_leader() || matches!(msg.body, MessageBody::TimeoutNow) {
            self.messages_now.push(msg);
        } else {
            self.messages.push(msg);
        }
    }
}
