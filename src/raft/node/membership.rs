//! Membership changes (dissertation §4): single-server changes proposed by the leader, taking
//! effect when appended, and the configuration recomputed from the log when it is cut back.

use super::{ProposeError, Raft, Role};
use crate::raft::progress::Progress;
use crate::raft::types::{Entry, EntryPayload, Index, Membership, MembershipChange, NodeId};

/// The configuration after an entry, if the entry changes it. A change that does not apply
/// (impossible from a correct leader) is ignored.
fn next_membership(current: &Membership, payload: &EntryPayload) -> Option<Membership> {
    match payload {
        EntryPayload::Config(config) => Some(config.clone()),
        EntryPayload::Membership(change) => current.apply(*change).ok(),
        _ => None,
    }
}

impl Raft {
    /// Proposes one single-server membership change (dissertation §4.1). It takes effect on each
    /// server when appended. Refused until this leader has committed an entry of its own term (the
    /// fix for the single-server change bug) and while another change is uncommitted.
    pub fn propose_membership(&mut self, change: MembershipChange) -> Result<Index, ProposeError> {
        self.check_can_propose(1)?;
        let guards = !self.bug(|b| b.membership_guards_off);
        if guards && !self.committed_in_current_term() {
            return Err(ProposeError::LeaderNotReady);
        }
        if guards && self.membership_index > self.log.committed {
            return Err(ProposeError::MembershipChangePending);
        }
        let next = self.membership.apply(change)?;
        let index = self.append_entry(EntryPayload::Membership(change));
        debug_assert_eq!(self.membership, next);
        self.broadcast_append();
        Ok(index)
    }

    /// Appends one entry; a membership entry takes effect at once (dissertation §4.1).
    pub(super) fn append_to_log(&mut self, entry: Entry) {
        let index = entry.index;
        let next = next_membership(&self.membership, &entry.payload);
        self.log.append(entry);
        if let Some(next) = next {
            self.membership = next;
            self.membership_index = index;
            self.sync_progress_with_membership();
        }
    }

    pub(super) fn recompute_membership(&mut self) {
        let mut membership = self.membership_base.clone();
        let mut membership_index = 0;
        let (first, last) = (self.log.first_index(), self.log.last_index());
        for entry in self.log.slice(first, last) {
            if let Some(next) = next_membership(&membership, &entry.payload) {
                membership = next;
                membership_index = entry.index;
            }
        }
        self.membership = membership;
        self.membership_index = membership_index;
        self.sync_progress_with_membership();
    }

    /// The configuration in effect at `index` (the last membership entry at or before it).
    pub(super) fn membership_at(&self, index: Index) -> Membership {
        let mut membership = self.membership_base.clone();
        for entry in self.log.slice(self.log.first_index(), index) {
            if let Some(next) = next_membership(&membership, &entry.payload) {
                membership = next;
            }
        }
        membership
    }

    fn sync_progress_with_membership(&mut self) {
        if self.role != Role::Leader {
            return;
        }
        let next = self.log.last_index() + 1;
        let members: Vec<NodeId> = self
            .membership
            .members()
            .filter(|&m| m != self.id)
            .collect();
        self.progress.retain(|id, _| members.contains(id));
        for member in members {
            self.progress.entry(member).or_insert_with(|| {
                let mut pr = Progress::new(next);
                pr.recent_active = true;
                pr
            });
        }
        if self
            .transfer_target
            .is_some_and(|t| !self.membership.is_voter(t))
        {
            self.transfer_target = None;
        }
    }
}
