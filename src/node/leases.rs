//! The leader's leases and waiter deadlines: following the applied state after every command,
//! and rebuilt a bounded number of locks per tick after an election.

use std::sync::Arc;

use super::{
    DelayDeadline, Lease, Micros, NodeCore, Observation, Rebuild, SessionDeadline, WaitDeadline, MS,
};
use crate::lock::{Command, Event, Outcome};
use crate::storage::Storage;

impl<S: Storage, R> NodeCore<S, R> {
    /// Makes the leader's lease of the command's key match the applied state (of every key a
    /// session's end touched, for `EndSession` and `ExpireSession`).
    pub(super) fn follow_lease(
        &mut self,
        command: &Command,
        applied: &crate::lock::Applied,
        local_started: Option<Micros>,
    ) {
        if matches!(
            command,
            Command::EndSession { .. } | Command::ExpireSession { .. }
        ) {
            let mut keys: Vec<String> = applied
                .events
                .iter()
                .filter_map(|e| match e {
                    Event::Granted { token, .. }
                    | Event::SharedGranted { token, .. }
                    | Event::Expired { token, .. } => Some(token.key.clone()),
                    _ => None,
                })
                .collect();
            keys.sort();
            keys.dedup();
            for key in keys {
                if self.sm.is_shared(&key) || self.has_shared_leases(&key) {
                    self.follow_shared_leases(&key, applied, local_started);
                } else {
                    self.follow_lease_of(&key, command, applied, local_started);
                }
            }
            return;
        }
        let key = command.key();
        if self.sm.is_shared(key) || self.has_shared_leases(key) {
            self.follow_shared_leases(key, applied, local_started);
            return;
        }
        self.follow_lease_of(key, command, applied, local_started);
    }

    fn has_shared_leases(&self, key: &str) -> bool {
        if self.shared_leases.len() == 0 {
            return false;
        }
        let k: Arc<str> = Arc::from(key);
        !self
            .shared_leases
            .range_keys((k.clone(), 0)..=(k, u64::MAX))
            .is_empty()
    }

    /// The lease of fencing token `token` on `key`, a plain lock's or a shared lock's holder's.
    pub(super) fn lease_of(&self, key: &str, token: u64) -> Option<&Lease> {
        if let Some(lease) = self.leases.get(key).filter(|l| l.token == token) {
            return Some(lease);
        }
        self.shared_leases.get(&(Arc::from(key), token))
    }

    /// The leases of a read-write lock's or semaphore's holders follow its state after an
    /// apply: a new holder's lease starts (its full TTL from now), a renewed one restarts, a
    /// holder gone takes its lease with it.
    fn follow_shared_leases(
        &mut self,
        key: &str,
        applied: &crate::lock::Applied,
        local_started: Option<Micros>,
    ) {
        // A holder attached to its client's session has no lease of its own: the session's
        // lease covers it.
        let holders: Vec<_> = self
            .sm
            .shared_lock(key)
            .map(|lock| lock.holders)
            .unwrap_or_default()
            .into_iter()
            .filter(|h| h.ttl_ms != 0)
            .collect();
        let k: Arc<str> = Arc::from(key);
        let expired = matches!(applied.outcome, Outcome::Expired { .. });
        for id in self
            .shared_leases
            .range_keys((k.clone(), 0)..=(k.clone(), u64::MAX))
        {
            if holders.iter().any(|h| h.token == id.1) {
                continue;
            }
            if let Some(lease) = self.shared_leases.remove(&id) {
                let held_us = self.now.saturating_sub(lease.started);
                self.observe(Observation::LeaseEnded { held_us, expired });
            }
        }
        let now = self.now;
        for h in holders {
            let id = (k.clone(), h.token);
            let started = match self.shared_leases.get(&id) {
                Some(l) if l.lease_index == h.lease_index => continue,
                Some(l) => Some(l.started),
                None => None,
            };
            self.shared_leases.insert(
                id,
                Lease {
                    token: h.token,
                    lease_index: h.lease_index,
                    deadline: now + h.ttl_ms * MS,
                    started: started.unwrap_or(now),
                    expiry_proposed_at: None,
                },
            );
            if started.is_some() {
                self.observe(Observation::Renewed);
            } else {
                let waited_us = self
                    .waiting
                    .get(&(h.client_id.clone(), h.request_id.clone()))
                    .map(|w| w.enqueued)
                    .or(local_started)
                    .map(|at| now.saturating_sub(at));
                self.observe(Observation::Granted { waited_us });
            }
        }
    }

    /// On election: every holder of a read-write lock or semaphore gets a full TTL from now,
    /// every waiter its wait timeout or the reclaim window, as plain locks do (all at once:
    /// shared locks are bounded by the held-locks limit like plain ones, and few in practice).
    fn rebuild_shared(&mut self, since: Micros) {
        self.shared_leases.clear();
        let no_wait = self.bug(|b| b.no_lease_wait_after_election);
        for lock in self.sm.shared_locks_after(None, usize::MAX) {
            let k: Arc<str> = Arc::from(lock.key.as_str());
            for h in lock.holders.iter().filter(|h| h.ttl_ms != 0) {
                let full_ttl = if no_wait { 0 } else { h.ttl_ms * MS };
                self.shared_leases.insert(
                    (k.clone(), h.token),
                    Lease {
                        token: h.token,
                        lease_index: h.lease_index,
                        deadline: since + full_ttl,
                        started: since,
                        expiry_proposed_at: None,
                    },
                );
            }
            for w in lock.waiters {
                let mut at = since + self.cfg.waiter_reclaim_us;
                if let Some(ms) = w.wait_timeout_ms {
                    at = at.max(since + ms * MS);
                }
                self.wait_deadlines.insert(
                    (w.client_id, w.request_id),
                    WaitDeadline {
                        key: lock.key.clone(),
                        at,
                        cancel_proposed_at: None,
                    },
                );
            }
        }
    }

    fn follow_lease_of(
        &mut self,
        key: &str,
        command: &Command,
        applied: &crate::lock::Applied,
        local_started: Option<Micros>,
    ) {
        if matches!(command, Command::Put { .. } | Command::Delete { .. }) {
            return;
        }
        if self.bug(|b| b.lease_only_for_local_grants) {
            // Only answers to this node's own proposals move leases.
            let grant_by_event = applied
                .events
                .iter()
                .any(|e| matches!(e, Event::Granted { .. }));
            if local_started.is_none() || grant_by_event {
                return;
            }
        }
        let holder = self.sm.holder(key);
        let now = self.now;
        let lease = self.leases.get(key).cloned();
        match (holder, lease.as_ref()) {
            (None, None) => {}
            (None, Some(_)) => {
                if self.bug(|b| b.lease_ended_after_hand_off) {
                    return;
                }
                let expired = matches!(applied.outcome, Outcome::Expired { .. });
                self.end_lease(key, expired);
            }
            // A lock attached to its client's session has no lease of its own: the session's
            // lease covers it.
            (Some(h), lease) if h.ttl_ms == 0 => {
                if lease.is_some() {
                    self.end_lease(key, false);
                }
            }
            (Some(h), lease) => {
                let same =
                    lease.is_some_and(|l| l.token == h.token && l.lease_index == h.lease_index);
                if same {
                    return;
                }
                if lease.is_some_and(|l| l.token != h.token) {
                    self.end_lease(key, matches!(applied.outcome, Outcome::Expired { .. }));
                }
                if self.bug(|b| b.lease_ended_after_hand_off)
                    && matches!(
                        command,
                        Command::Release { .. } | Command::ReleaseHeld { .. }
                    )
                {
                    // The release's answer ends the lease the hand-off just started.
                    return;
                }
                // A renewal keeps the lease's key and start.
                let existing = self
                    .leases
                    .get_key_value(key)
                    .map(|(k, l)| (k.clone(), l.started));
                let new_holder = existing.is_none();
                let (lease_key, started) = existing.unwrap_or_else(|| (Arc::from(key), now));
                self.leases.insert(
                    lease_key,
                    Lease {
                        token: h.token,
                        lease_index: h.lease_index,
                        deadline: now + h.ttl_ms * MS,
                        started,
                        expiry_proposed_at: None,
                    },
                );
                if new_holder {
                    let id = (h.client_id.clone(), h.request_id.clone());
                    let waited_us = self
                        .waiting
                        .get(&id)
                        .map(|w| w.enqueued)
                        .or(local_started)
                        .map(|at| now.saturating_sub(at));
                    self.observe(Observation::Granted { waited_us });
                } else {
                    self.observe(Observation::Renewed);
                }
            }
        }
    }

    /// Gives a waiter that just joined a queue its cancel deadline, whoever proposed it: its wait
    /// timeout, or — when its client is not attached here — the reclaim window.
    pub(super) fn follow_waiter(
        &mut self,
        command: &Command,
        applied: &crate::lock::Applied,
        local: Option<(Micros, bool)>,
    ) {
        let Some(crate::lock::AcquireParts {
            key,
            client_id,
            request_id,
            wait_timeout_ms,
            ..
        }) = command.as_acquire()
        else {
            return;
        };
        if applied.replayed || !matches!(applied.outcome, Outcome::Queued { .. }) {
            return;
        }
        let at = match (wait_timeout_ms, local) {
            (Some(ms), Some((started, _))) => started + ms * MS,
            (Some(ms), None) => self.now + ms * MS,
            // Waits until granted while its client is attached here.
            (None, Some((_, true))) => return,
            (None, _) => self.now + self.cfg.waiter_reclaim_us,
        };
        self.wait_deadlines.insert(
            (client_id.clone(), request_id.clone()),
            WaitDeadline {
                key: key.clone(),
                at,
                cancel_proposed_at: None,
            },
        );
    }

    /// Times the lock-delays an applied command started, and forgets those it ended.
    pub(super) fn follow_lock_delays(&mut self, applied: &crate::lock::Applied) {
        for event in &applied.events {
            match event {
                Event::LockDelayStarted {
                    key,
                    token,
                    delay_ms,
                } => {
                    let length = if self.bug(|b| b.lock_delay_ended_at_once) {
                        0
                    } else {
                        delay_ms * MS
                    };
                    self.lock_delays.insert(
                        Arc::from(key.as_str()),
                        DelayDeadline {
                            token: *token,
                            at: self.now + length,
                            end_proposed_at: None,
                        },
                    );
                }
                Event::LockDelayEnded { key, .. } => {
                    self.lock_delays.remove(key.as_str());
                }
                _ => {}
            }
        }
    }

    /// Times the session a keepalive opened or kept alive (its full TTL from now), and forgets
    /// one that ended.
    pub(super) fn follow_session(&mut self, command: &Command) {
        let client_id = match command {
            Command::KeepAlive { client_id, .. }
            | Command::EndSession { client_id, .. }
            | Command::ExpireSession { client_id, .. } => client_id.as_str(),
            _ => return,
        };
        let Some(info) = self.sm.session_lease(client_id) else {
            self.session_deadlines.remove(client_id);
            return;
        };
        let same = self
            .session_deadlines
            .get(client_id)
            .is_some_and(|d| d.session == info.session && d.lease_index == info.lease_index);
        if !same {
            self.session_deadlines.insert(
                Arc::from(client_id),
                SessionDeadline {
                    session: info.session,
                    lease_index: info.lease_index,
                    at: self.now + info.ttl_ms * MS,
                    expiry_proposed_at: None,
                },
            );
        }
    }

    /// On election: every open session gets its full TTL from now (when its client last kept
    /// it alive under the old leader is not known here; a session may last longer, never
    /// shorter).
    fn rebuild_sessions(&mut self, since: Micros) {
        self.session_deadlines.clear();
        let no_wait = self.bug(|b| b.no_session_wait_after_election);
        for info in self.sm.session_leases() {
            let ttl = if no_wait { 0 } else { info.ttl_ms * MS };
            self.session_deadlines.insert(
                Arc::from(info.client_id.as_str()),
                SessionDeadline {
                    session: info.session,
                    lease_index: info.lease_index,
                    at: since + ttl,
                    expiry_proposed_at: None,
                },
            );
        }
    }

    /// On election: every running lock-delay is timed again in full from now (when the old
    /// leader started it is not known here; a delay may last longer, never shorter).
    fn rebuild_lock_delays(&mut self, since: Micros) {
        self.lock_delays.clear();
        let restart = !self.bug(|b| b.lock_delay_not_restarted_after_election);
        for d in self.sm.running_lock_delays() {
            let Some((token, delay_ms)) = d.running else {
                continue;
            };
            let length = if restart { delay_ms * MS } else { 0 };
            self.lock_delays.insert(
                Arc::from(d.key.as_str()),
                DelayDeadline {
                    token,
                    at: since + length,
                    end_proposed_at: None,
                },
            );
        }
    }

    fn end_lease(&mut self, key: &str, expired: bool) {
        if let Some(lease) = self.leases.remove(key) {
            let held_us = self.now.saturating_sub(lease.started);
            self.observe(Observation::LeaseEnded { held_us, expired });
        }
    }

    /// On election (or a snapshot installed while leading): every held lock gets a full TTL
    /// from now, every queued waiter its wait timeout or a reclaim window from now, whichever is
    /// longer, in which its client can re-attach (docs/guarantees.md).
    ///
    /// The locks are visited `rebuild_keys_per_tick` at a time, the rest on the following ticks,
    /// so that a leader of a million locks does not fall silent for longer than an election
    /// timeout. Deadlines count from the election whenever a lock is reached; a lock not reached
    /// yet has no lease here and so cannot expire early (it can only expire late, by at most the
    /// walk's duration). A lease or wait deadline set meanwhile by an applied command is newer
    /// and is kept.
    pub(super) fn rebuild_deadlines(&mut self) {
        self.leases.clear();
        self.wait_deadlines.clear();
        self.rebuild_lock_delays(self.now);
        self.rebuild_sessions(self.now);
        self.rebuild_shared(self.now);
        self.rebuild = Some(Rebuild {
            since: self.now,
            after: None,
        });
        self.continue_rebuild();
    }

    /// One step of the walk started by [`NodeCore::rebuild_deadlines`].
    pub(super) fn continue_rebuild(&mut self) {
        let Some(rebuild) = self.rebuild.take() else {
            return;
        };
        let since = rebuild.since;
        let limit = self.cfg.rebuild_keys_per_tick.max(1);
        let locks = self.sm.locks_after(rebuild.after.as_deref(), limit);
        let done = locks.len() < limit;
        let no_wait = self.bug(|b| b.no_lease_wait_after_election);
        let mut last = None;
        for (key, held, waiters) in locks {
            if let Some(h) = held.filter(|h| h.ttl_ms > 0) {
                if !self.leases.contains_key(key.as_str()) {
                    let full_ttl = if no_wait { 0 } else { h.ttl_ms * MS };
                    let lease = Lease {
                        token: h.token,
                        lease_index: h.lease_index,
                        deadline: since + full_ttl,
                        started: since,
                        expiry_proposed_at: None,
                    };
                    self.leases.insert(Arc::from(key.as_str()), lease);
                }
            }
            for w in waiters {
                let id = (w.client_id, w.request_id);
                if self.wait_deadlines.contains_key(&id) {
                    continue;
                }
                let mut at = since + self.cfg.waiter_reclaim_us;
                if let Some(ms) = w.wait_timeout_ms {
                    at = at.max(since + ms * MS);
                }
                self.wait_deadlines.insert(
                    id,
                    WaitDeadline {
                        key: w.key,
                        at,
                        cancel_proposed_at: None,
                    },
                );
            }
            last = Some(key);
        }
        if !done {
            self.rebuild = Some(Rebuild { since, after: last });
        }
    }
}
