//! What the core asks the driver to do: send peer messages (timing heartbeats, a span per
//! append), answer clients, build snapshots on a thread of their own, and turn observations into
//! metrics, log lines and spans.

use tokio::time::Instant;
use tracing::{error, info, warn};

use super::{Driver, HEARTBEAT_RTT_GIVE_UP};
use crate::node::api::ClientReply;
use crate::node::{Effect, Observation};
use crate::raft::{Message, MessageBody};
use crate::storage::StorageError;

/// A span per append that carries entries (field values are computed only when traced).
pub(super) fn replicate_span(
    msg: &Message,
    last_index: crate::raft::Index,
) -> Option<tracing::span::EnteredSpan> {
    match &msg.body {
        MessageBody::Append {
            entries,
            prev_log_index,
            ..
        } if !entries.is_empty() => Some(
            tracing::debug_span!(
                "raft.replicate",
                // Signed: OpenTelemetry has no unsigned integers.
                peer = msg.to as i64,
                entries = entries.len() as i64,
                bytes = entries.iter().map(|e| e.size_bytes()).sum::<usize>() as i64,
                from_index = (prev_log_index + 1) as i64,
                lag_entries = last_index.saturating_sub(*prev_log_index) as i64,
            )
            .entered(),
        ),
        _ => None,
    }
}

fn snapshot_thread_gone() -> StorageError {
    StorageError::SnapshotData {
        problem: "the snapshot thread stopped without a result".into(),
    }
}

impl Driver {
    /// Sends to a peer, timing one heartbeat per peer at a time.
    fn send_peer(&mut self, msg: &Message) {
        let _span = replicate_span(msg, self.core.raft().last_index());
        if matches!(msg.body, MessageBody::Heartbeat { .. }) {
            let now = Instant::now();
            let timed = self.heartbeat_sent.entry(msg.to).or_insert(now);
            // A heartbeat whose answer never came (peer down, message lost) stops being timed.
            if now.duration_since(*timed) > HEARTBEAT_RTT_GIVE_UP {
                *timed = now;
            }
        }
        self.transport.send(msg);
    }

    pub(super) fn handle_effects(&mut self) {
        for effect in self.core.take_effects() {
            match effect {
                Effect::Send(msg) => self.send_peer(&msg),
                Effect::Reply(tx, reply) => {
                    crate::server::probe::event("replied");
                    self.arrival.answered();
                    let reply = match reply {
                        ClientReply::Error(e) => ClientReply::Error(self.with_leader_addr(e)),
                        other => other,
                    };
                    let _ = tx.send(reply);
                }
                Effect::BuildSnapshot(job) => {
                    let (tx, rx) = std::sync::mpsc::sync_channel(1);
                    let spawned = std::thread::Builder::new()
                        .name("raftlock-snapshot".into())
                        .spawn(move || {
                            let _ = tx.send(job());
                        });
                    match spawned {
                        Ok(_) => {
                            self.snapshot_job = Some(rx);
                            self.snapshot_started = Some(std::time::Instant::now());
                        }
                        Err(err) => {
                            let now = self.now();
                            let failed = Err(StorageError::Io {
                                action: "starting the snapshot thread",
                                source: err,
                            });
                            if let Err(err) = self.core.snapshot_built(now, failed) {
                                warn!(cause = %err, "snapshot not taken");
                            }
                        }
                    }
                }
                Effect::Observe(o) => self.observe(o),
            }
        }
    }

    fn observe(&mut self, o: Observation) {
        let m = &self.metrics;
        match o {
            Observation::BecameLeader { term } => {
                let voters = self.core.raft().membership().voters.len() as i64;
                tracing::debug_span!("raft.election", term = term as i64, outcome = "won", voters)
                    .in_scope(|| info!(term, "became leader"));
            }
            Observation::LostLeadership { term, leader } => {
                tracing::debug_span!(
                    "raft.leadership_lost",
                    term = term as i64,
                    new_leader = leader as i64
                )
                .in_scope(|| info!(term, leader, "no longer leader"));
            }
            Observation::LeaderChanged { leader } => {
                // A new leader counts, not the loss of one: a failover (leader, then none, then
                // the next) is one change, as etcd counts `leader_changes_seen_total`.
                if leader != 0 {
                    m.leader_changes_total.inc();
                }
                self.cfg
                    .watch
                    .leader_changed(leader, self.core.raft().term());
            }
            Observation::LockEvents(events) => self.cfg.watch.publish(events),
            Observation::Granted { waited_us } => {
                m.lock_grants_total.inc();
                if let Some(us) = waited_us {
                    m.lock_wait_seconds.observe(us as f64 / 1e6);
                }
            }
            Observation::LeaseEnded { held_us, expired } => {
                m.lock_hold_seconds.observe(held_us as f64 / 1e6);
                if expired {
                    m.lock_expirations_total.inc();
                } else {
                    m.lock_releases_total.inc();
                }
            }
            Observation::Renewed => m.lock_renewals_total.inc(),
            Observation::Answered { op, result } => {
                m.proposals_committed_total.inc();
                m.requests_total.with_label_values(&[op, result]).inc();
            }
            Observation::ProposalFailed => m.proposals_failed_total.inc(),
            Observation::Refused { op, result } => {
                m.requests_total.with_label_values(&[op, result]).inc();
            }
            Observation::LogCompacted { index } => {
                m.snapshots_total.with_label_values(&["taken"]).inc();
                tracing::debug_span!("raft.snapshot", kind = "taken", index = index as i64)
                    .in_scope(|| info!(index, "log compacted to the stored state"));
            }
            Observation::SnapshotEncoded { index, bytes } => {
                m.snapshots_total.with_label_values(&["encoded"]).inc();
                m.snapshot_bytes
                    .with_label_values(&["encoded"])
                    .set(bytes as i64);
                let took = self.snapshot_started.take().map(|at| at.elapsed());
                if let Some(took) = took {
                    m.snapshot_duration_seconds.observe(took.as_secs_f64());
                }
                let took_ms = took.map_or(0, |t| t.as_millis() as u64);
                tracing::debug_span!(
                    "raft.snapshot",
                    kind = "encoded",
                    index = index as i64,
                    bytes = bytes as i64
                )
                .in_scope(|| info!(index, bytes, took_ms, "snapshot encoded for a follower"));
            }
            Observation::SnapshotInstallStarted { index, bytes } => {
                self.install_started = Some(Instant::now());
                self.install_bytes = bytes as u64;
                info!(
                    index,
                    bytes, "installing a snapshot from the leader; votes are answered meanwhile"
                );
            }
            Observation::SnapshotInstalled { index } => {
                let took = self.install_started.take().map(|t| t.elapsed());
                if let Some(took) = took {
                    m.snapshot_install_duration_seconds
                        .observe(took.as_secs_f64());
                }
                let took_ms = took.map(|t| t.as_millis() as u64);
                m.snapshot_bytes
                    .with_label_values(&["installed"])
                    .set(self.install_bytes as i64);
                self.cfg.watch.reset(index);
                m.snapshots_total.with_label_values(&["installed"]).inc();
                tracing::debug_span!("raft.snapshot", kind = "installed", index = index as i64)
                    .in_scope(|| info!(index, took_ms, "installed snapshot from leader"));
            }
            Observation::RemovedFromCluster => info!("this node was removed from the cluster"),
            Observation::Admitted => {
                info!("admitted: the log records this incarnation; taking part in elections");
                if let Some(mark) = self.cfg.admission_mark.take() {
                    if let Err(err) = std::fs::remove_file(&mark) {
                        warn!(path = %mark.display(), %err, "cannot remove the admission mark");
                    }
                }
            }
            Observation::Undecodable { index } => {
                error!(index, "undecodable command in the log; skipped")
            }
            Observation::MemberReplaced { id } => {
                warn!(
                    node = id,
                    "removed node {id}'s old incarnation: it lost its data"
                )
            }
            Observation::LimitRefused { limit } => {
                m.limit_refusals_total.with_label_values(&[&limit]).inc();
            }
            Observation::DeadMemberRemoved { id } => warn!(
                node = id,
                "removed node {id}: not heard from for the dead-member timeout"
            ),
            Observation::Housekeeping { .. }
            | Observation::MemberRemoved { .. }
            | Observation::Persisted(_)
            | Observation::Applied { .. } => {}
        }
    }

    /// Hands a finished snapshot job's result to the core.
    pub(super) fn poll_snapshot_job(&mut self) -> Result<(), StorageError> {
        let Some(rx) = &self.snapshot_job else {
            return Ok(());
        };
        let result = match rx.try_recv() {
            Err(std::sync::mpsc::TryRecvError::Empty) => return Ok(()),
            Ok(result) => result,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => Err(snapshot_thread_gone()),
        };
        self.snapshot_job = None;
        let now = self.now();
        self.core.snapshot_built(now, result)
    }

    /// Waits for the snapshot being built, if any, and hands its result to the core.
    pub(super) fn finish_snapshot_job(&mut self) -> Result<(), StorageError> {
        let Some(rx) = self.snapshot_job.take() else {
            return Ok(());
        };
        let result = rx.recv().unwrap_or_else(|_| Err(snapshot_thread_gone()));
        let now = self.now();
        self.core.snapshot_built(now, result)
    }
}
