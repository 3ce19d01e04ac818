//! The leader's duties: becoming and losing leadership, proposing expiries and waiter cancels
//! (housekeeping), promoting caught-up learners, carrying time into the log, and proposing the
//! cluster's limits, quotas and version (with what each member said it runs).

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;

use super::api::ErrorCode;
use super::{Micros, NodeCore, Observation, HOUSEKEEPING_PER_TICK, MS};
use crate::lock::{Command, CLUSTER_VERSION, LIFECYCLE_VERSION, QUOTAS_VERSION};
use crate::raft::{MembershipChange, NodeId, Role};
use crate::storage::Storage;

impl<S: Storage, R> NodeCore<S, R> {
    pub(super) fn role_changed(&mut self, role: Role, leader_id: NodeId) {
        if leader_id != self.last_leader {
            self.last_leader = leader_id;
            self.observe(Observation::LeaderChanged { leader: leader_id });
        }
        let is_leader = role == Role::Leader;
        if is_leader && !self.was_leader {
            self.observe(Observation::BecameLeader {
                term: self.raft.term(),
            });
            self.rebuild_deadlines();
            self.limits_proposed_at = None;
            self.version_proposed_at = None;
            self.lifecycle_proposed_at = None;
            self.led_since = Some(self.now);
            self.last_heard.clear();
            // Every learner asked to join (`join` is the only way in), and the leader that
            // accepted it may have lost leadership before promoting it: the joiner does not ask
            // again once accepted, so this leader promotes every learner once it qualifies.
            self.promote_when_caught_up = self.raft.membership().learners.iter().copied().collect();
            self.joined_as.clear();
            self.clock_ticked_at = Some(self.now);
            self.propose_limits_if_unset();
        } else if !is_leader && self.was_leader {
            self.observe(Observation::LostLeadership {
                term: self.raft.term(),
                leader: leader_id,
            });
            self.leases.clear();
            self.shared_leases.clear();
            self.wait_deadlines.clear();
            self.lock_delays.clear();
            self.session_deadlines.clear();
            self.rebuild = None;
            self.promote_when_caught_up.clear();
            self.joined_as.clear();
            self.clock_ticked_at = None;
            self.led_since = None;
            self.fail_all(
                ErrorCode::Unavailable,
                "leadership changed; retry with the same request id",
            );
        }
        self.was_leader = is_leader;
    }

    /// Expiries of leases that ran out and cancels of waiters past their deadline, proposed
    /// again after `housekeeping_retry_us` until applied (or superseded by a renew, a grant or a
    /// cancel); promotion of caught-up learners.
    pub(super) fn leader_duties(&mut self) {
        if !self.raft.is_leader() {
            return;
        }
        let now = self.now;
        let retry = self.cfg.housekeeping_retry_us;
        let never_retry = self.bug(|b| b.housekeeping_never_retried);
        let only_token = self.bug(|b| b.expiry_checks_only_token);
        let due = |proposed: Option<Micros>| match proposed {
            None => true,
            Some(_) if never_retry => false,
            Some(at) => now >= at + retry,
        };
        let mut commands = Vec::new();
        if self.limits_proposed_at.is_none_or(|at| now >= at + retry) {
            self.propose_limits_if_unset();
        }
        if self.version_proposed_at.is_none_or(|at| now >= at + retry) {
            self.propose_cluster_version();
        }
        if self
            .lifecycle_proposed_at
            .is_none_or(|at| now >= at + retry)
        {
            self.propose_lifecycle();
        }
        self.remove_dead_members();
        self.advance_log_clock();
        // One proposal carries no more than the log takes now: one larger than the bound on
        // uncommitted entries would be refused as busy on every tick, and nothing would expire
        // again (simulator seed 1008370: seven due with room for six). Nor more than
        // `HOUSEKEEPING_PER_TICK`, which bounds a tick's work when many leases run out at once
        // (a million locks whose clients went away). What does not fit stays due for the next
        // ticks, those that fell due first going first and expiries before cancels. Only the
        // leases and waiters that are due are read (`TimedMap::due_first`), in key order.
        let limit = self.raft.proposal_room().min(HOUSEKEEPING_PER_TICK);
        for (key, lease) in self.leases.due_first(now, limit) {
            if lease.deadline <= now && due(lease.expiry_proposed_at) {
                commands.push(if only_token {
                    Command::Expire {
                        key: key.to_string(),
                        token: lease.token,
                    }
                } else {
                    Command::ExpireLease {
                        key: key.to_string(),
                        token: lease.token,
                        lease_index: lease.lease_index,
                    }
                });
            }
        }
        let left = limit - commands.len();
        for ((key, _), lease) in self.shared_leases.due_first(now, left) {
            if lease.deadline <= now && due(lease.expiry_proposed_at) {
                commands.push(if only_token {
                    Command::Expire {
                        key: key.to_string(),
                        token: lease.token,
                    }
                } else {
                    Command::ExpireLease {
                        key: key.to_string(),
                        token: lease.token,
                        lease_index: lease.lease_index,
                    }
                });
            }
        }
        let left = limit - commands.len();
        for (key, d) in self.lock_delays.due_first(now, left) {
            if d.at <= now && due(d.end_proposed_at) {
                commands.push(Command::EndLockDelay {
                    key: key.to_string(),
                    token: d.token,
                });
            }
        }
        let left = limit - commands.len();
        for (client_id, d) in self.session_deadlines.due_first(now, left) {
            if d.at <= now && due(d.expiry_proposed_at) {
                commands.push(Command::ExpireSession {
                    client_id: client_id.to_string(),
                    session: d.session,
                    lease_index: d.lease_index,
                });
            }
        }
        let expiries = commands.len();
        let left = limit - commands.len();
        for ((client_id, request_id), d) in self.wait_deadlines.due_first(now, left) {
            if d.at <= now && due(d.cancel_proposed_at) {
                commands.push(Command::CancelWait {
                    key: d.key.clone(),
                    client_id: client_id.clone(),
                    request_id: request_id.clone(),
                });
            }
        }
        if !commands.is_empty() {
            let encoded = commands.iter().map(|c| Bytes::from(c.encode())).collect();
            // (The bug marks the work done even when the proposal was refused.)
            if self.raft.propose(encoded).is_ok() || never_retry {
                for cmd in &commands {
                    match cmd {
                        Command::Expire { key, token }
                        | Command::ExpireLease { key, token, .. } => {
                            let shared = (Arc::from(key.as_str()), *token);
                            if self.shared_leases.contains_key(&shared) {
                                self.shared_leases
                                    .update(&shared, |l| l.expiry_proposed_at = Some(now));
                            } else {
                                self.leases
                                    .update(key.as_str(), |l| l.expiry_proposed_at = Some(now));
                            }
                        }
                        Command::EndLockDelay { key, .. } => {
                            self.lock_delays
                                .update(key.as_str(), |d| d.end_proposed_at = Some(now));
                        }
                        Command::ExpireSession { client_id, .. } => {
                            self.session_deadlines
                                .update(client_id.as_str(), |d| d.expiry_proposed_at = Some(now));
                        }
                        Command::CancelWait {
                            client_id,
                            request_id,
                            ..
                        } => {
                            let id = (client_id.clone(), request_id.clone());
                            self.wait_deadlines
                                .update(&id, |d| d.cancel_proposed_at = Some(now));
                        }
                        _ => {}
                    }
                }
                self.observe(Observation::Housekeeping {
                    expiries,
                    cancels: commands.len() - expiries,
                });
            }
            // A refused proposal (busy, transfer in progress) is tried again on the next tick.
        }
        // Waiters that left the queue by a path this leader did not see (snapshot install) are
        // forgotten.
        if self.wait_deadlines.len() > self.sm.waiter_count() {
            let live: BTreeSet<(String, String)> = self
                .sm
                .waiters()
                .into_iter()
                .map(|w| (w.client_id, w.request_id))
                .collect();
            self.wait_deadlines.retain(|id, _| live.contains(id));
        }
        // Promote learners that asked to join once they have caught up (§4.2.1), and, once the
        // cluster version was raised, said they run at least that version: a learner of an
        // older RaftLock never becomes a voter in a log it cannot apply.
        let commit = self.raft.commit_index();
        let version = self.sm.cluster_version();
        // Once members have records, a learner is promoted only when its log holds the record
        // of its incarnation: a voter out of elections until then (a new data directory, see
        // `set_awaiting_admission`) could leave the voters without a majority.
        let records = version >= LIFECYCLE_VERSION && !self.bug(|b| b.promoted_before_admission);
        let candidate = self.promote_when_caught_up.iter().copied().find(|&l| {
            // The record must be of the incarnation the learner says it is.
            let said = self.said_info.get(&l).map_or(0, |i| i.incarnation);
            let recorded = self.recorded_at.get(&l).copied().filter(|_| {
                said == 0
                    || self
                        .sm
                        .members()
                        .get(&l)
                        .is_some_and(|m| m.incarnation == said)
            });
            self.raft.membership().learners.contains(&l)
                && self.raft.progress(l).is_some_and(|(m, _, _)| {
                    m + 8 >= commit && m > 0 && (!records || recorded.is_some_and(|r| m >= r))
                })
                && (version < 2 || self.said_version(l, version))
        });
        if let Some(learner) = candidate {
            if self
                .raft
                .propose_membership(MembershipChange::PromoteLearner(learner))
                .is_ok()
            {
                self.promote_when_caught_up.retain(|&l| l != learner);
            }
        }
        let membership = self.raft.membership().clone();
        self.promote_when_caught_up
            .retain(|l| membership.learners.contains(l) || !membership.contains(*l));
    }

    /// While client sessions are open, the leader carries the time it measures into the log
    /// about every `session_tick_us`, so that replicas close idle sessions at the same entry.
    /// Time before this node led is never counted.
    fn advance_log_clock(&mut self) {
        let Some(since) = self.clock_ticked_at else {
            self.clock_ticked_at = Some(self.now);
            return;
        };
        if self.now < since + self.cfg.session_tick_us {
            return;
        }
        if self.sm.session_count() == 0 {
            // Nothing ages: time without sessions need not be carried.
            self.clock_ticked_at = Some(self.now);
            return;
        }
        let elapsed_ms = (self.now - since) / MS;
        let cmd = Command::Tick { elapsed_ms };
        if self.raft.propose(vec![Bytes::from(cmd.encode())]).is_ok() {
            self.clock_ticked_at = Some(since + elapsed_ms * MS);
        }
    }

    /// A leader of a cluster whose limits were never set through the log proposes its own.
    fn propose_limits_if_unset(&mut self) {
        if !self.raft.is_leader() {
            return;
        }
        let mut commands = Vec::new();
        if let Some(limits) = &self.cfg.configured_limits {
            if !self.sm.limits_replicated() {
                commands.push(Command::SetLimits {
                    limits: limits.clone(),
                });
            }
        }
        // Quotas: the leader's configuration wins, so a rolling restart with new flags
        // changes them; only once every member applies them the same way.
        if let Some(quotas) = &self.cfg.configured_quotas {
            if self.sm.cluster_version() >= QUOTAS_VERSION && self.sm.quotas() != Some(quotas) {
                commands.push(Command::SetQuotas {
                    quotas: quotas.clone(),
                });
            }
        }
        if commands.is_empty() {
            return;
        }
        let encoded = commands.iter().map(|c| Bytes::from(c.encode())).collect();
        if self.raft.propose(encoded).is_ok() {
            self.limits_proposed_at = Some(self.now);
        }
    }

    /// Raises the cluster version to this node's [`CLUSTER_VERSION`] once every other member
    /// (voters and learners) has said it runs at least that version. A member that never said
    /// (down, or a RaftLock from before cluster versions) keeps the cluster where it is.
    fn propose_cluster_version(&mut self) {
        if !self.raft.is_leader() || self.sm.cluster_version() >= CLUSTER_VERSION {
            return;
        }
        let me = self.raft.id();
        let all_support = self
            .raft
            .membership()
            .members()
            .filter(|id| *id != me)
            .all(|id| self.said_version(id, CLUSTER_VERSION));
        if !all_support {
            return;
        }
        let cmd = Command::SetClusterVersion {
            version: CLUSTER_VERSION,
        };
        if self.raft.propose(vec![Bytes::from(cmd.encode())]).is_ok() {
            self.version_proposed_at = Some(self.now);
        }
    }

    /// What member `id` says it runs, from its latest stream (0: a RaftLock from before
    /// cluster versions). Replaces what it said before: a member rolled back to an older build
    /// is no longer taken for a current one.
    pub fn peer_version(&mut self, id: NodeId, version: u32) {
        if id != self.raft.id() {
            self.peer_versions.insert(id, version);
        }
    }

    /// Whether member `id` said it runs a version below the cluster's: it cannot apply this
    /// log (a build from before a command it would skip), so once the version is raised this
    /// node takes no Raft message from it — it is neither counted in a quorum nor promoted —
    /// until it says a current version again.
    pub fn runs_older_version(&self, id: NodeId) -> bool {
        let cluster = self.sm.cluster_version();
        cluster > 1 && self.peer_versions.get(&id).is_some_and(|v| *v < cluster)
    }

    /// Whether member `id` said it runs at least cluster version `version`.
    pub(super) fn said_version(&self, id: NodeId, version: u32) -> bool {
        self.peer_versions.get(&id).is_some_and(|v| *v >= version)
    }
}
