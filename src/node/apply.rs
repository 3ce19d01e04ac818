//! Applying committed entries to the lock state machine (leases and answers follow each one),
//! and writing the applied state to storage.

use super::{events, NodeCore, Observation};
use crate::lock::{Command, CLUSTER_VERSION};
use crate::raft::{EntryPayload, MembershipChange, Ready};
use crate::storage::{Storage, StorageError};

impl<S: Storage, R> NodeCore<S, R> {
    pub(super) fn apply(&mut self, ready: &Ready) -> Result<(), StorageError> {
        let Some(last) = ready.committed_entries.last().map(|e| e.index) else {
            return Ok(());
        };
        for entry in &ready.committed_entries {
            match &entry.payload {
                EntryPayload::Command(data) => {
                    let pending = self.pending.remove(&entry.index);
                    let command = match Command::decode(data) {
                        Ok(c) => c,
                        Err(_) => {
                            self.observe(Observation::Undecodable { index: entry.index });
                            if self.cfg.observe_log {
                                self.observe(Observation::Applied {
                                    index: entry.index,
                                    term: entry.term,
                                    command: None,
                                    applied: None,
                                });
                            }
                            continue;
                        }
                    };
                    if let Command::SetClusterVersion { version } = &command {
                        if *version > CLUSTER_VERSION {
                            return Err(StorageError::NewerClusterVersion {
                                index: entry.index,
                                version: *version,
                                supported: CLUSTER_VERSION,
                            });
                        }
                    }
                    if let Command::SetMember { id, info } = &command {
                        if let Some(info) = info {
                            self.recorded_at.insert(*id, entry.index);
                            self.forget_words_older_than(*id, info.incarnation);
                        } else {
                            self.recorded_at.remove(id);
                        }
                    }
                    let applied = self.sm.apply(entry.index, &command);
                    // What follows looks at the request, not at how it acknowledged answers.
                    let request = command.request();
                    if self.raft.is_leader() {
                        let local = pending.as_ref().map(|p| (p.started, p.reply.is_some()));
                        self.follow_lease(request, &applied, local.map(|l| l.0));
                        self.follow_waiter(request, &applied, local);
                        self.follow_lock_delays(&applied);
                        self.follow_session(request);
                    }
                    self.on_events(&applied.events);
                    if self.cfg.observe_lock_events {
                        let events = events::lock_events(request, &applied);
                        if !events.is_empty() {
                            self.observe(Observation::LockEvents(events));
                        }
                    }
                    if let Some(pending) = pending {
                        let outcome = if applied.replayed {
                            self.replayed_outcome(applied.outcome.clone())
                        } else {
                            Ok(applied.outcome.clone())
                        };
                        match outcome {
                            Ok(outcome) => self.answer(command.request(), outcome, pending),
                            Err(reply) => self.send_answer(pending, reply),
                        }
                    }
                    if self.cfg.observe_log {
                        self.observe(Observation::Applied {
                            index: entry.index,
                            term: entry.term,
                            command: Some(Box::new(command)),
                            applied: Some(applied),
                        });
                    }
                }
                other => {
                    if let EntryPayload::Membership(MembershipChange::RemoveServer(id)) = other {
                        self.observe(Observation::MemberRemoved { id: *id });
                        // What it said of itself is of the incarnation removed: a new one under
                        // its id says its own (recorded from older words, a new incarnation's
                        // record went back to the lost one, simulator seed 9 on 5 nodes).
                        self.said_info.remove(id);
                        if *id == self.raft.id() {
                            self.observe(Observation::RemovedFromCluster);
                        }
                    }
                    if self.cfg.observe_log {
                        self.observe(Observation::Applied {
                            index: entry.index,
                            term: entry.term,
                            command: None,
                            applied: None,
                        });
                    }
                }
            }
        }
        // The state machine marks the keys this batch changed; their values are read and
        // encoded when they are written (`collect_changes`), once per write and not once per
        // batch: with one client that was an exactly-once block of up to 32 answers encoded
        // twice per lock cycle.
        self.unwritten_applied = Some(last);
        if self.unwritten_changes.len() + self.sm.pending_changes()
            >= self.cfg.applied_write_max_keys
        {
            if self.snapshot_in_progress || !self.held.is_empty() {
                self.seal_unwritten();
            }
            self.write_applied(true)?;
        }
        Ok(())
    }

    /// Moves the state machine's changes since the last call into `unwritten_changes`, read
    /// from the state as it is now: as of `unwritten_applied`.
    fn collect_changes(&mut self) {
        for (key, value) in self.sm.take_changes() {
            self.unwritten_changes.insert(key, value);
        }
    }

    /// Moves the unwritten changes to the end of `held`, as one write of their own.
    fn seal_unwritten(&mut self) {
        self.collect_changes();
        let Some(applied) = self.unwritten_applied.take() else {
            return;
        };
        let changes: Vec<_> = std::mem::take(&mut self.unwritten_changes)
            .into_iter()
            .collect();
        self.held_keys += changes.len();
        self.held.push_back((applied, changes));
    }

    /// Hands the unwritten applied state to storage (durable with the next flush): always when
    /// `force`, otherwise once it is older than the write interval. Waits while a snapshot job
    /// reads the stored state.
    ///
    /// Changes held back during a snapshot job go first, one held write per call.
    pub(super) fn write_applied(&mut self, force: bool) -> Result<(), StorageError> {
        if self.snapshot_in_progress {
            return Ok(());
        }
        if let Some((applied, changes)) = self.held.pop_front() {
            self.held_keys -= changes.len();
            self.storage.apply(applied, &changes)?;
            self.applied_written_at = self.now;
            return Ok(());
        }
        let Some(applied) = self.unwritten_applied else {
            return Ok(());
        };
        if !force && self.now < self.applied_written_at + self.cfg.applied_write_interval_us {
            return Ok(());
        }
        self.collect_changes();
        let changes: Vec<_> = std::mem::take(&mut self.unwritten_changes)
            .into_iter()
            .collect();
        self.storage.apply(applied, &changes)?;
        self.unwritten_applied = None;
        self.applied_written_at = self.now;
        Ok(())
    }

    /// Hands every unwritten change to storage (unless a snapshot job is reading it).
    pub(super) fn write_all_applied(&mut self) -> Result<(), StorageError> {
        while !self.snapshot_in_progress
            && (!self.held.is_empty() || self.unwritten_applied.is_some())
        {
            self.write_applied(true)?;
        }
        Ok(())
    }
}
