//! Membership and lifecycle in the node: joining and admission of a new incarnation, what members
//! say of themselves, joins, replacements, removals (asked for or of dead members), leadership
//! hand-off, and the cluster id and member table the leader keeps in the log.

use std::collections::BTreeMap;

use bytes::Bytes;

use super::api::{ApiError, ErrorCode};
use super::lifecycle::{info_current, merged_info, JoinOutcome};
use super::{lifecycle, NodeCore, Observation};
use crate::lock::{Command, MemberInfo, LIFECYCLE_VERSION, MEMBERS_MAX, MEMBER_ADDR_MAX};
use crate::raft::{EntryPayload, MembershipChange, NodeId};
use crate::storage::Storage;

impl<S: Storage, R> NodeCore<S, R> {
    /// A node with an empty log that asks to join takes no Raft message until the leader has
    /// accepted it (`joining` false again).
    pub fn set_joining(&mut self, joining: bool) {
        self.joining = joining;
    }

    pub fn is_joining(&self) -> bool {
        self.joining
    }

    /// Marks this node as running on a new data directory under an id that may have been a
    /// member before (the shell keeps the mark on disk until [`Observation::Admitted`]): it
    /// stays out of elections until its log holds the `SetMember` entry that records its own
    /// incarnation. That entry follows the removal of any earlier incarnation, so from then on
    /// the log holds every entry that earlier incarnation acknowledged, and a vote from it
    /// cannot elect a leader without a committed entry.
    pub fn set_awaiting_admission(&mut self, awaiting: bool) {
        self.awaiting_admission = awaiting;
        self.admission_scanned = (0, 0);
        let ignore = self.bug(|b| b.admission_ignored);
        self.raft.set_in_elections(!awaiting || ignore);
        self.check_admission();
    }

    pub fn is_awaiting_admission(&self) -> bool {
        self.awaiting_admission
    }

    /// Ends [`NodeCore::set_awaiting_admission`] once the member table, or an entry of the log
    /// not applied yet, records this node's incarnation. Searches only what it has not searched.
    pub(super) fn check_admission(&mut self) {
        if !self.awaiting_admission {
            return;
        }
        let me = self.raft.id();
        let mine = self.cfg.identity.incarnation;
        let mut admitted = self
            .sm
            .members()
            .get(&me)
            .is_some_and(|m| m.incarnation == mine);
        let (scanned, scanned_term) = self.admission_scanned;
        let mut index = if scanned > self.raft.applied_index()
            && self.raft.term_at(scanned) == Some(scanned_term)
        {
            scanned + 1
        } else {
            self.raft.applied_index() + 1
        };
        while !admitted && index <= self.raft.last_index() {
            if let Some(entry) = self.raft.entry(index) {
                if let EntryPayload::Command(bytes) = &entry.payload {
                    if let Ok(Command::SetMember {
                        id,
                        info: Some(info),
                    }) = Command::decode(bytes)
                    {
                        admitted = id == me && info.incarnation == mine;
                    }
                }
            }
            index += 1;
        }
        let last = self.raft.last_index();
        self.admission_scanned = (last, self.raft.term_at(last).unwrap_or(0));
        if admitted {
            self.awaiting_admission = false;
            self.raft.set_in_elections(true);
            self.observe(Observation::Admitted);
        }
    }

    /// What member `id` says of itself (from its peer connection's hello or its join request):
    /// the leader records it in the member table. Empty fields and incarnation 0 say nothing.
    pub fn peer_info(&mut self, id: NodeId, info: MemberInfo) {
        if id == 0 || id == self.raft.id() {
            return;
        }
        if info.peer_addr.len() > MEMBER_ADDR_MAX || info.client_addr.len() > MEMBER_ADDR_MAX {
            return;
        }
        if !self.said_info.contains_key(&id) && self.said_info.len() >= MEMBERS_MAX {
            return;
        }
        let merged = merged_info(self.said_info.get(&id), &info);
        self.said_info.insert(id, merged);
    }

    /// A record of member `id` as `incarnation` (0: none said) was applied: what this node heard
    /// `id` say of itself as another incarnation was heard before the record, and is taken for
    /// an earlier incarnation's. A leader that recorded such words wrote a lost incarnation over
    /// a newer one's record, under which the running incarnation was then promoted, and no
    /// leader ever recorded it again (simulator seed 644, 3 nodes, background flushes). A
    /// process still running as that incarnation says it again (a new stream's hello).
    pub(super) fn forget_words_older_than(&mut self, id: NodeId, incarnation: u64) {
        if incarnation != 0
            && self
                .said_info
                .get(&id)
                .is_some_and(|s| s.incarnation != 0 && s.incarnation != incarnation)
        {
            self.said_info.remove(&id);
        }
    }

    /// Every member this node knows of from its own storage, with its addresses and
    /// incarnation: the applied member table, with the `SetMember` entries of the log that are
    /// not applied yet laid over it (a node that restarts knows its members before it learns
    /// the commit index). What the shell dials.
    pub fn known_members(&self) -> BTreeMap<NodeId, MemberInfo> {
        let mut members = self.sm.members().clone();
        let mut index = self.raft.applied_index() + 1;
        while index <= self.raft.last_index() {
            if let Some(entry) = self.raft.entry(index) {
                if let EntryPayload::Command(bytes) = &entry.payload {
                    if let Ok(Command::SetMember { id, info }) = Command::decode(bytes) {
                        match info {
                            Some(info) => {
                                members.insert(id, info);
                            }
                            None => {
                                members.remove(&id);
                            }
                        }
                    }
                }
            }
            index += 1;
        }
        members
    }

    /// A server asks to join (through this node), saying where it is reached and its
    /// incarnation. `Accepted` when it is, or is becoming, a member; `Replacing` when it is a
    /// new incarnation of a voter (its data is gone) whose old incarnation the leader now removes
    /// — the joiner asks again and is added as a learner, caught up from a snapshot and
    /// promoted. The removal needs every other voter healthy (heard from recently): they must
    /// form the new configuration's majority by themselves.
    pub fn join(&mut self, id: NodeId, info: MemberInfo) -> Result<JoinOutcome, String> {
        if !self.raft.is_leader() {
            return Err("not the leader".into());
        }
        let me = self.raft.id();
        if id == me {
            return Err(format!(
                "node {id} is this cluster's leader: a second process with its id cannot join"
            ));
        }
        let membership = self.raft.membership().clone();
        if membership.voters.contains(&id) {
            let recorded = self.sm.members().get(&id).map_or(0, |m| m.incarnation);
            if (recorded != 0 && recorded == info.incarnation)
                || self.bug(|b| b.incarnation_ignored)
            {
                // The incarnation that is the member asks again (its first answer was lost).
                self.peer_info(id, info);
                return Ok(JoinOutcome::Accepted);
            }
            // Only a node with an empty log asks to join: this one lost its data, and must not
            // count as the voter that acknowledged entries it no longer has.
            let unhealthy: Vec<NodeId> = membership
                .voters
                .iter()
                .copied()
                .filter(|&v| v != id && v != me && !self.recently_heard(v))
                .collect();
            if !unhealthy.is_empty() || membership.voters.len() < 2 {
                return Err(lifecycle::replacement_blocked(id, &unhealthy));
            }
            self.promote_when_caught_up.retain(|&n| n != id);
            self.raft
                .propose_membership(MembershipChange::RemoveServer(id))
                .map_err(|e| format!("cannot remove node {id}'s old incarnation yet: {e}"))?;
            self.observe(Observation::MemberReplaced { id });
            return Ok(JoinOutcome::Replacing);
        }
        if membership.contains(id) {
            // A learner: the incarnation that asked to join asks again (its answer was lost),
            // or a new incarnation whose data directory was wiped while it was still a learner.
            // The new one has an empty log, but this leader's progress for the id still says
            // how far the old one had matched: the leader would send it only what follows,
            // take its refusals for stale, and never catch it up nor promote it. Like a voter's,
            // the old incarnation is removed first; the joiner asks again and is added afresh.
            let known = self
                .joined_as
                .get(&id)
                .copied()
                .or_else(|| self.known_members().get(&id).map(|m| m.incarnation))
                .unwrap_or(0);
            if known != 0
                && info.incarnation != 0
                && known != info.incarnation
                && !self.bug(|b| b.incarnation_ignored)
            {
                // (Still to promote while the removal cannot be proposed: the joiner may not
                // ask again.)
                self.raft
                    .propose_membership(MembershipChange::RemoveServer(id))
                    .map_err(|e| {
                        format!("cannot remove learner {id}'s old incarnation yet: {e}")
                    })?;
                self.promote_when_caught_up.retain(|&n| n != id);
                self.joined_as.remove(&id);
                self.observe(Observation::MemberReplaced { id });
                return Ok(JoinOutcome::Replacing);
            }
            if membership.learners.contains(&id) && !self.promote_when_caught_up.contains(&id) {
                self.promote_when_caught_up.push(id);
            }
            if info.incarnation != 0 {
                self.joined_as.insert(id, info.incarnation);
            }
            self.peer_info(id, info);
            return Ok(JoinOutcome::Accepted);
        }
        self.raft
            .propose_membership(MembershipChange::AddLearner(id))
            .map_err(|e| e.to_string())?;
        if info.incarnation != 0 {
            self.joined_as.insert(id, info.incarnation);
        }
        self.peer_info(id, info);
        self.promote_when_caught_up.push(id);
        Ok(JoinOutcome::Accepted)
    }

    /// Leader only: whether voter `id` was heard from within the current check-quorum window
    /// (or, just elected, since the election).
    fn recently_heard(&self, id: NodeId) -> bool {
        self.raft.is_recently_active(id)
    }

    /// Removes a member (the leader may remove itself).
    pub fn remove(&mut self, id: NodeId) -> Result<(), ApiError> {
        if !self.raft.is_leader() {
            return Err(self.not_leader_error());
        }
        self.promote_when_caught_up.retain(|&n| n != id);
        self.raft
            .propose_membership(MembershipChange::RemoveServer(id))
            .map(|_| ())
            .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, e.to_string()))
    }

    /// Hands leadership to the most caught-up other voter. Returns the target.
    pub fn transfer_leadership(&mut self) -> Option<NodeId> {
        if !self.raft.is_leader() {
            return None;
        }
        let me = self.raft.id();
        let target = self
            .raft
            .membership()
            .voters
            .iter()
            .copied()
            .filter(|&v| v != me)
            .max_by_key(|&v| self.raft.progress(v).map_or(0, |p| p.0))?;
        self.raft.transfer_leader(target).ok().map(|()| target)
    }

    /// Names the cluster, and keeps the member table in step with the configuration and with
    /// what members say of themselves, once every member understands those entries (cluster
    /// version 4; until then "no id yet" is not "another cluster").
    pub(super) fn propose_lifecycle(&mut self) {
        if !self.raft.is_leader() || self.sm.cluster_version() < LIFECYCLE_VERSION {
            return;
        }
        let mut commands = Vec::new();
        if self.sm.cluster_id().is_none() && self.cfg.new_cluster_id != 0 {
            commands.push(Command::SetClusterId {
                id: self.cfg.new_cluster_id,
                forced_by: self.cfg.forced_by.clone(),
            });
        }
        let me = self.raft.id();
        let membership = self.raft.membership().clone();
        let table = self.sm.members();
        let mut in_log = None;
        for id in membership.members() {
            let said = if id == me {
                &self.cfg.identity
            } else {
                match self.said_info.get(&id) {
                    Some(said) => said,
                    None => continue,
                }
            };
            let recorded = table.get(&id).map_or(0, |m| m.incarnation);
            if membership.voters.contains(&id)
                && recorded != 0
                && said.incarnation != 0
                && said.incarnation != recorded
            {
                // A voter's incarnation changes only by replacement (`join`): another
                // incarnation under its id is not the voter that acknowledged the log.
                continue;
            }
            // Words of an incarnation that a record of the member in the log, not applied yet,
            // contradicts wait for it: applied, it makes this node forget words of another
            // incarnation heard before it (`forget_words_older_than`). A new leader's table may
            // lag its log, where a newer incarnation's record waits behind the words it still
            // holds from an earlier one.
            if said.incarnation != 0 && said.incarnation != recorded {
                let newest = in_log.get_or_insert_with(|| self.known_members()).get(&id);
                let contradicts =
                    newest.is_none_or(|m| m.incarnation != 0 && m.incarnation != said.incarnation);
                if newest != table.get(&id) && contradicts {
                    continue;
                }
            }
            if !info_current(table.get(&id), said) {
                commands.push(Command::SetMember {
                    id,
                    info: Some(merged_info(table.get(&id), said)),
                });
            }
        }
        for id in table.keys().filter(|id| !membership.contains(**id)) {
            commands.push(Command::SetMember {
                id: *id,
                info: None,
            });
        }
        // No more than the log takes now, the rest on a later round: a table to fill for more
        // members than there is room for (seven members, room for six) was never proposed at
        // all, and a learner was never admitted nor promoted (simulator seed 630, 5 nodes).
        commands.truncate(self.raft.proposal_room());
        if commands.is_empty() {
            return;
        }
        let encoded = commands.iter().map(|c| Bytes::from(c.encode())).collect();
        if self.raft.propose(encoded).is_ok() {
            self.lifecycle_proposed_at = Some(self.now);
        }
    }

    /// Removes a voter not heard from for `dead_member_us` (a pod scaled away, a machine gone
    /// for good) while at least `min_voters` voters stay, one at a time: a cluster scaled down
    /// without removing its members first keeps its failure tolerance. Never the leader itself,
    /// and only while the voters left have a healthy majority.
    pub(super) fn remove_dead_members(&mut self) {
        let Some(dead_after) = self.cfg.dead_member_us else {
            return;
        };
        if !self.raft.is_leader() {
            return;
        }
        let me = self.raft.id();
        let now = self.now;
        let led_since = self.led_since.unwrap_or(now);
        let membership = self.raft.membership().clone();
        if membership.voters.len() <= self.cfg.min_voters.max(1) {
            return;
        }
        // A voter counts as dead only after this leader has led for the whole timeout without
        // hearing from it (a new leader knows nothing older).
        let heard = |id: NodeId| self.last_heard.get(&id).copied().unwrap_or(led_since);
        let dead: Vec<NodeId> = membership
            .voters
            .iter()
            .copied()
            .filter(|&v| v != me && now >= heard(v) + dead_after)
            .collect();
        let Some(&victim) = dead.first() else {
            return;
        };
        // Only while the voters left have a healthy majority of their own configuration (with
        // two of five gone, the first removal leaves four with three healthy, the second three
        // with three).
        let left: Vec<NodeId> = membership
            .voters
            .iter()
            .copied()
            .filter(|&v| v != victim)
            .collect();
        let healthy = left
            .iter()
            .filter(|&&v| v == me || self.recently_heard(v))
            .count();
        if healthy < left.len() / 2 + 1 {
            return;
        }
        if self
            .raft
            .propose_membership(MembershipChange::RemoveServer(victim))
            .is_ok()
        {
            self.last_heard.remove(&victim);
            self.observe(Observation::DeadMemberRemoved { id: victim });
        }
    }
}
