//! What the driver publishes for readers outside its queue: [`NodeStatus`] (the client API,
//! `/status`, readiness), refreshed after every turn together with the gauges, the replication
//! lag and commit durations of a leader, and the address book's member table.

use tracing::{info, warn};

use super::{Driver, COMMIT_MARKS_MAX};
use crate::raft::NodeId;
use crate::server::replication_lag::LagClock;
use crate::telemetry::NodeMetrics;

/// What the client API and `/status` read without going through the driver queue.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    pub id: NodeId,
    pub role: String,
    pub term: u64,
    pub leader_id: NodeId,
    pub leader_addr: String,
    pub commit_index: u64,
    pub applied_index: u64,
    pub last_index: u64,
    pub voters: Vec<NodeId>,
    pub learners: Vec<NodeId>,
    pub locks_held: u64,
    pub waiters: u64,
    /// The cluster version in the applied state (see `lock::CLUSTER_VERSION`).
    pub cluster_version: u32,
    /// Whether byte budgets and quotas are in force (a `SetQuotas` entry applied).
    pub quotas_in_force: bool,
    /// The cluster's id (32 hex digits), once its leader named it; empty before.
    pub cluster_id: String,
    /// The `--force-new-cluster` value that started the cluster, if one did.
    pub forced_by: String,
    /// This node's data holds a log or a snapshot (it is, or was, a member of a cluster).
    pub has_data: bool,
    /// The index of the snapshot from the leader whose state is being installed, if any: the
    /// lock counts are the state before it until it is done.
    pub installing_snapshot: Option<u64>,
    /// On the leader: how far each other member's log matches its own.
    pub replication: Vec<PeerReplication>,
}

/// One follower's replication, as the leader sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerReplication {
    pub id: NodeId,
    /// The highest log index known to match the leader's.
    pub match_index: u64,
    /// Entries the follower is behind the leader's last index.
    pub lag_entries: u64,
}

impl NodeStatus {
    /// Member of a cluster with a known leader, and caught up with the commit index.
    pub fn is_ready(&self) -> bool {
        let member = self.voters.contains(&self.id) || self.learners.contains(&self.id);
        member
            && self.leader_id != 0
            && self.installing_snapshot.is_none()
            && self.applied_index + 16 >= self.commit_index
    }
}

/// Drops a peer's replication-lag series (this node stopped leading or the peer left).
fn remove_lag_series(m: &NodeMetrics, peer: NodeId) {
    let label = peer.to_string();
    let _ = m.replication_lag_entries.remove_label_values(&[&label]);
    let _ = m.replication_lag_seconds.remove_label_values(&[&label]);
}

impl Driver {
    pub(super) fn publish_status(&mut self) {
        let raft = self.core.raft();
        let sm = self.core.state_machine();
        let membership = raft.membership();
        let leader_id = raft.leader_id();
        let role = role_name(raft.role());
        let term = raft.term();
        let commit_index = raft.commit_index();
        let applied_index = raft.applied_index();
        let last_index = raft.last_index();
        let locks_held = sm.locks_held() as u64;
        let lock_delays_running = sm.lock_delays_running() as u64;
        let client_elections = sm.election_count() as i64;
        let waiters = sm.waiter_count() as u64;
        let cluster_version = sm.cluster_version();
        let quotas_in_force = sm.quotas().is_some();
        let cluster_changed = sm.cluster_id() != self.cluster_seen;
        if cluster_changed {
            self.cluster_seen = sm.cluster_id();
            if let Some(c) = sm.cluster_identity() {
                let id = format!("{:032x}", c.id);
                info!(cluster_id = %id, "this cluster's id");
                self.metrics.cluster_info.with_label_values(&[&id]).set(1);
                if let Ok(mut cell) = self.cluster_id_cell.write() {
                    *cell = id;
                }
            }
        }
        let has_data = raft.last_index() > 0 || raft.snapshot_index() > 0 || term > 0;
        if sm.members() != &self.members_seen {
            self.members_seen = sm.members().clone();
            for (id, m) in &self.members_seen {
                self.addresses
                    .learn_member(*id, &m.peer_addr, &m.client_addr, m.incarnation);
            }
        }
        let installing_snapshot = self.core.installing_snapshot();
        let m = &self.metrics;
        m.term.set(term as i64);
        m.is_leader.set(i64::from(raft.is_leader()));
        m.has_leader.set(i64::from(leader_id != 0));
        m.commit_index.set(commit_index as i64);
        m.applied_index.set(applied_index as i64);
        m.last_log_index.set(last_index as i64);
        m.log_entries
            .set(last_index.saturating_sub(raft.snapshot_index()) as i64);
        if let Some((committed, applied)) = self.indexes_counted {
            m.entries_committed_total
                .inc_by(commit_index.saturating_sub(committed));
            m.entries_applied_total
                .inc_by(applied_index.saturating_sub(applied));
        }
        self.indexes_counted = Some((commit_index, applied_index));
        let stats = raft.stats();
        let campaigned = stats.pre_votes_started != self.logged_stats.pre_votes_started
            || stats.elections_started != self.logged_stats.elections_started;
        if campaigned && leader_id == 0 && self.election_started.is_none() {
            self.election_started = Some(std::time::Instant::now());
        }
        if leader_id != 0 {
            if let Some(started) = self.election_started.take() {
                m.election_duration_seconds
                    .observe(started.elapsed().as_secs_f64());
            }
        }
        if stats.pre_votes_started != self.logged_stats.pre_votes_started
            || stats.elections_started != self.logged_stats.elections_started
            || stats.quorum_lost != self.logged_stats.quorum_lost
        {
            let heard = |id: NodeId| {
                self.last_heard
                    .get(&id)
                    .map(|t| t.elapsed().as_millis() as i64)
                    .unwrap_or(-1)
            };
            if stats.quorum_lost != self.logged_stats.quorum_lost {
                let ms: Vec<(NodeId, i64)> = membership
                    .voters
                    .iter()
                    .filter(|&&v| v != raft.id())
                    .map(|&v| (v, heard(v)))
                    .collect();
                warn!(
                    term,
                    last_heard_ms = ?ms,
                    "stepping down: fewer than a quorum answered within an election timeout"
                );
            } else {
                let prev = self.leader_seen;
                warn!(
                    term,
                    last_leader = prev,
                    last_heard_from_it_ms = heard(prev),
                    pre_vote = stats.pre_votes_started != self.logged_stats.pre_votes_started,
                    "election timeout: no word from a leader; campaigning"
                );
            }
            self.logged_stats = stats;
        }
        if leader_id != 0 {
            self.leader_seen = leader_id;
        }
        let elections = stats.elections_started;
        let counted = m.elections_total.get();
        if elections > counted {
            m.elections_total.inc_by(elections - counted);
        }
        m.locks_held.set(locks_held as i64);
        m.lock_delays_running.set(lock_delays_running as i64);
        m.elections_in_use.set(client_elections);
        m.lock_waiters.set(waiters as i64);
        m.answers_remembered.set(sm.dedupe_len() as i64);
        m.answers_max.set(sm.limits().dedupe_entries_max as i64);
        m.answers_recent.set(self.core.paced_recent() as i64);
        m.client_sessions.set(sm.session_count() as i64);
        m.cluster_version.set(i64::from(cluster_version));
        m.proposals_pending.set(self.core.pending_requests() as i64);
        // Runs after every batch of inputs, several times per lock cycle: the replication view
        // is kept in a reused buffer and each peer's lag gauges are looked up once, when the
        // peer first appears, so that nothing here allocates while nothing changes.
        let mut replication = std::mem::take(&mut self.replication_buf);
        replication.clear();
        if raft.is_leader() {
            let now = std::time::Instant::now();
            let clock = self
                .lag_clock
                .get_or_insert_with(|| LagClock::new(now, last_index));
            clock.observe_last_index(now, last_index);
            let mut min_matched = last_index;
            for peer in membership.members().filter(|&p| p != raft.id()) {
                if let Some((matched, _, _)) = raft.progress(peer) {
                    let gauges = self.lag_gauges.entry(peer).or_insert_with(|| {
                        let label = peer.to_string();
                        (
                            m.replication_lag_entries.with_label_values(&[&label]),
                            m.replication_lag_seconds.with_label_values(&[&label]),
                        )
                    });
                    gauges.0.set(last_index.saturating_sub(matched) as i64);
                    gauges
                        .1
                        .set(clock.lag(now, matched, last_index).as_secs_f64());
                    min_matched = min_matched.min(matched);
                    replication.push(PeerReplication {
                        id: peer,
                        match_index: matched,
                        lag_entries: last_index.saturating_sub(matched),
                    });
                }
            }
            clock.forget_before(min_matched);
            if self
                .commit_marks
                .back()
                .is_none_or(|&(i, _)| i < last_index)
            {
                if self.commit_marks.len() == COMMIT_MARKS_MAX {
                    self.commit_marks.pop_front();
                }
                // The entries were proposed by the batch or tick being finished.
                let proposed = self.batch_started.min(now);
                self.commit_marks.push_back((last_index, proposed));
            }
            while let Some(&(index, at)) = self.commit_marks.front() {
                if index > commit_index {
                    break;
                }
                m.commit_duration_seconds
                    .observe(now.saturating_duration_since(at).as_secs_f64());
                self.commit_marks.pop_front();
            }
            self.lag_gauges.retain(|peer, _| {
                let keep = replication.iter().any(|r| r.id == *peer);
                if !keep {
                    remove_lag_series(m, *peer);
                }
                keep
            });
        } else {
            self.lag_clock = None;
            self.commit_marks.clear();
            for (gone, _) in self.lag_gauges.drain() {
                remove_lag_series(m, gone);
            }
        }
        // Published after every batch, not on a timer: a follower asks the leader's peer port
        // for its commit index (from this status) and waits until it has applied that much
        // before judging a seed-004 release, so a commit index published late lets the follower
        // judge on state older than an answer the leader already gave (tests/seed004_grpc.rs
        // caught a 5 ms publishing interval doing that).
        let addresses = &self.addresses;
        self.status.send_if_modified(|old| {
            let leader_addr_same = addresses.client_addr_is(leader_id, &old.leader_addr);
            let changed = old.term != term
                || old.leader_id != leader_id
                || old.role != role
                || old.commit_index != commit_index
                || old.applied_index != applied_index
                || old.last_index != last_index
                || !old.voters.iter().eq(membership.voters.iter())
                || !old.learners.iter().eq(membership.learners.iter())
                || !leader_addr_same
                || old.locks_held != locks_held
                || old.waiters != waiters
                || old.cluster_version != cluster_version
                || old.quotas_in_force != quotas_in_force
                || cluster_changed
                || old.has_data != has_data
                || old.installing_snapshot != installing_snapshot
                || old.replication != replication;
            if changed {
                old.id = raft.id();
                old.term = term;
                old.leader_id = leader_id;
                if old.role != role {
                    old.role = role.to_string();
                }
                old.commit_index = commit_index;
                old.applied_index = applied_index;
                old.last_index = last_index;
                if !old.voters.iter().eq(membership.voters.iter()) {
                    old.voters = membership.voters.iter().copied().collect();
                }
                if !old.learners.iter().eq(membership.learners.iter()) {
                    old.learners = membership.learners.iter().copied().collect();
                }
                if !leader_addr_same {
                    old.leader_addr = addresses
                        .get(leader_id)
                        .map(|a| a.client)
                        .unwrap_or_default();
                }
                old.locks_held = locks_held;
                old.waiters = waiters;
                old.cluster_version = cluster_version;
                old.quotas_in_force = quotas_in_force;
                old.has_data = has_data;
                if cluster_changed {
                    if let Some(c) = sm.cluster_identity() {
                        old.cluster_id = format!("{:032x}", c.id);
                        old.forced_by.clone_from(&c.forced_by);
                    }
                }
                old.installing_snapshot = installing_snapshot;
                if old.replication != replication {
                    old.replication.clone_from(&replication);
                }
            }
            changed
        });
        self.replication_buf = replication;
    }
}

/// `/status`'s name for a role.
fn role_name(role: crate::raft::Role) -> &'static str {
    match role {
        crate::raft::Role::Follower => "follower",
        crate::raft::Role::PreCandidate => "precandidate",
        crate::raft::Role::Candidate => "candidate",
        crate::raft::Role::Leader => "leader",
    }
}
