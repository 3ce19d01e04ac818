//! Locks and their FIFO queues: acquire (grant or queue), release, cancelling a wait, handing a
//! vacated lock to the next waiter, and the read-only views of holders and waiters.

use super::super::command::FencingToken;
use super::super::outcome::{Event, Outcome, RejectCode};
use super::lock_entry::{Holder, LockEntry, Waiter};
use super::quotas::{count_use, limit_refusal, lock_cost};
use super::{LockStateMachine, DIRTY_SEQ, LOCK_PREFIX};

/// A held lock, as the leader needs it to rebuild lease deadlines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldLock {
    pub key: String,
    pub client_id: String,
    pub request_id: String,
    pub token: u64,
    pub ttl_ms: u64,
    /// Log index at which the current lease started (grant or latest renew).
    pub lease_index: u64,
}

/// A queued waiter, in queue order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaiterInfo {
    pub key: String,
    pub client_id: String,
    pub request_id: String,
    pub wait_timeout_ms: Option<u64>,
}

impl LockStateMachine {
    pub fn holder(&self, key: &str) -> Option<HeldLock> {
        let h = self.locks.get(key)?.holder.as_ref()?;
        Some(HeldLock {
            key: key.to_string(),
            client_id: h.client_id.to_string(),
            request_id: h.request_id.to_string(),
            token: h.token,
            ttl_ms: h.ttl_ms,
            lease_index: h.lease_index,
        })
    }

    /// Every held lock, in key order.
    pub fn held_locks(&self) -> Vec<HeldLock> {
        self.locks.keys().filter_map(|k| self.holder(k)).collect()
    }

    /// Locks (held or with waiters) whose key starts with `prefix`, in key order, at most
    /// `limit`: each with its holder and its waiters in queue order. Visits only those keys.
    pub fn locks_with_prefix(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Vec<(String, Option<HeldLock>, Vec<WaiterInfo>)> {
        self.locks
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(key, _)| key.starts_with(prefix))
            .take(limit)
            .map(|(key, entry)| self.lock_view(key, entry))
            .collect()
    }

    /// One lock with its holder and its waiters in queue order.
    fn lock_view(
        &self,
        key: &str,
        entry: &LockEntry,
    ) -> (String, Option<HeldLock>, Vec<WaiterInfo>) {
        let waiters = entry
            .waiters
            .iter()
            .map(|w| WaiterInfo {
                key: key.to_string(),
                client_id: w.client_id.to_string(),
                request_id: w.request_id.to_string(),
                wait_timeout_ms: w.wait_timeout_ms,
            })
            .collect();
        (key.to_string(), self.holder(key), waiters)
    }

    /// Up to `limit` locks (held or with waiters) whose key sorts after `after` (from the first
    /// when `None`), in key order: each with its holder and its waiters in queue order. Lets a
    /// caller walk every lock a bounded step at a time.
    pub fn locks_after(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Vec<(String, Option<HeldLock>, Vec<WaiterInfo>)> {
        use std::ops::Bound;
        let lower = match after {
            Some(key) => Bound::Excluded(key),
            None => Bound::Unbounded,
        };
        self.locks
            .range::<str, _>((lower, Bound::Unbounded))
            .take(limit)
            .map(|(key, entry)| self.lock_view(key, entry))
            .collect()
    }

    /// Every waiter, by key and then queue order: those of plain locks, then those of shared
    /// locks.
    pub fn waiters(&self) -> Vec<WaiterInfo> {
        let plain = self.locks.iter().flat_map(|(key, entry)| {
            entry.waiters.iter().map(move |w| WaiterInfo {
                key: key.to_string(),
                client_id: w.client_id.to_string(),
                request_id: w.request_id.to_string(),
                wait_timeout_ms: w.wait_timeout_ms,
            })
        });
        let shared = self.shared.iter().flat_map(|(key, entry)| {
            entry.waiters.iter().map(move |w| WaiterInfo {
                key: key.to_string(),
                client_id: w.client_id.to_string(),
                request_id: w.request_id.to_string(),
                wait_timeout_ms: w.wait_timeout_ms,
            })
        });
        plain.chain(shared).collect()
    }

    /// The queued acquire `(client_id, request_id)` of `key`, if it is still waiting.
    pub fn waiter(&self, key: &str, client_id: &str, request_id: &str) -> Option<WaiterInfo> {
        if let Some((_, wait_timeout_ms)) = self.shared_waiter(key, client_id, request_id) {
            return Some(WaiterInfo {
                key: key.to_string(),
                client_id: client_id.to_string(),
                request_id: request_id.to_string(),
                wait_timeout_ms,
            });
        }
        let entry = self.locks.get(key)?;
        entry
            .waiters
            .iter()
            .find(|w| *w.client_id == *client_id && *w.request_id == *request_id)
            .map(|w| WaiterInfo {
                key: key.to_string(),
                client_id: w.client_id.to_string(),
                request_id: w.request_id.to_string(),
                wait_timeout_ms: w.wait_timeout_ms,
            })
    }

    /// Waiters of one key in queue order.
    pub fn waiters_of(&self, key: &str) -> Vec<WaiterInfo> {
        self.waiters()
            .into_iter()
            .filter(|w| w.key == key)
            .collect()
    }

    pub(super) fn position_of(&self, key: &str, client: &str, request: &str) -> Option<u32> {
        if let Some((position, _)) = self.shared_waiter(key, client, request) {
            return Some(position);
        }
        let entry = self.locks.get(key)?;
        entry
            .waiters
            .iter()
            .position(|w| *w.client_id == *client && *w.request_id == *request)
            .map(|p| p as u32 + 1)
    }

    pub(super) fn acquire(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
    ) -> Outcome {
        let exists = self.locks.contains_key(key);
        if !exists && self.locks.len() + self.shared.len() >= self.limits.locks_held_max {
            return limit_refusal("locks_held", "too many locks in use".into());
        }
        if let Err(refusal) = self.check_lock_quotas(key, client_id, request_id, wait_timeout_ms, 0)
        {
            return refusal;
        }
        let waiters_max = self.limits.waiters_per_key_max;
        // A running lock-delay keeps the key from everyone: acquires queue (or are told Busy).
        let delayed = self.delay_running(key);
        let entry = self.locks.entry(Box::from(key)).or_default();
        match &entry.holder {
            None if !delayed => {
                self.fencing_seq += 1;
                let token = self.fencing_seq;
                entry.holder = Some(Holder {
                    client_id: client_id.into(),
                    request_id: request_id.into(),
                    token,
                    ttl_ms,
                    lease_index: self.applied_index,
                });
                self.locks_held += 1;
                self.lock_bytes += lock_cost(key, client_id, request_id);
                self.count_identity(client_id, 1, 0);
                self.mark_lock(key);
                self.dirty_meta |= DIRTY_SEQ;
                Outcome::Granted {
                    token: FencingToken {
                        key: key.to_string(),
                        value: token,
                    },
                    ttl_ms,
                }
            }
            Some(holder) if *holder.client_id == *client_id => Outcome::AlreadyHeld {
                token: FencingToken {
                    key: key.to_string(),
                    value: holder.token,
                },
                ttl_ms: holder.ttl_ms,
            },
            _ => {
                if let Some(p) = entry
                    .waiters
                    .iter()
                    .position(|w| *w.client_id == *client_id)
                {
                    return Outcome::AlreadyQueued {
                        position: p as u32 + 1,
                    };
                }
                // Free but held back by a lock-delay, the key may have had no entry: a refusal
                // leaves none behind (state the log did not change must stay byte-identical).
                let unused = entry.holder.is_none() && entry.waiters.is_empty();
                if wait_timeout_ms == Some(0) {
                    if unused {
                        self.locks.remove(key);
                    }
                    return Outcome::Busy;
                }
                if entry.waiters.len() >= waiters_max {
                    if unused {
                        self.locks.remove(key);
                    }
                    return Outcome::rejected(
                        RejectCode::QueueFull,
                        format!("{waiters_max} waiters already queue for this key"),
                    );
                }
                entry.waiters.push_back(Waiter {
                    client_id: client_id.into(),
                    request_id: request_id.into(),
                    ttl_ms,
                    wait_timeout_ms,
                });
                let position = entry.waiters.len() as u32;
                self.waiters += 1;
                self.lock_bytes += lock_cost(key, client_id, request_id);
                self.count_identity(client_id, 0, 1);
                self.mark_lock(key);
                Outcome::Queued { position }
            }
        }
    }

    /// Checks that `token` holds `key` for `client_id`.
    pub(super) fn check_holder(
        &self,
        key: &str,
        client_id: &str,
        token: u64,
    ) -> Result<(), Outcome> {
        let holder = self.locks.get(key).and_then(|e| e.holder.as_ref());
        match holder {
            None => Err(Outcome::StaleToken { current: None }),
            Some(h) if h.token != token => Err(Outcome::StaleToken {
                current: Some(h.token),
            }),
            Some(h) if *h.client_id != *client_id => Err(Outcome::NotHolder),
            Some(_) => Ok(()),
        }
    }

    pub(super) fn release(
        &mut self,
        key: &str,
        client_id: &str,
        token: u64,
        events: &mut Vec<Event>,
    ) -> Outcome {
        if let Err(refusal) = self.check_holder(key, client_id, token) {
            return refusal;
        }
        self.vacate(key, events);
        Outcome::Released
    }

    /// The holder leaves; the next waiter (if any) is granted in the same apply, unless a
    /// lock-delay runs on the key (its end grants the next waiter).
    pub(super) fn vacate(&mut self, key: &str, events: &mut Vec<Event>) {
        let delayed = self.delay_running(key);
        let Some(entry) = self.locks.get_mut(key) else {
            return;
        };
        if let Some(old) = entry.holder.take() {
            self.locks_held -= 1;
            self.lock_bytes =
                self.lock_bytes
                    .saturating_sub(lock_cost(key, &old.client_id, &old.request_id));
            if self.quotas.as_ref().is_some_and(|q| q.by_identity) {
                count_use(&mut self.identity_use, &old.client_id, -1, 0);
            }
        }
        let next = if delayed {
            None
        } else {
            entry.waiters.pop_front()
        };
        if let Some(next) = next {
            self.waiters -= 1;
            // The waiter's bytes now count as the holder's.
            if self.quotas.as_ref().is_some_and(|q| q.by_identity) {
                count_use(&mut self.identity_use, &next.client_id, 1, -1);
            }
            self.fencing_seq += 1;
            let token = self.fencing_seq;
            entry.holder = Some(Holder {
                client_id: next.client_id.clone(),
                request_id: next.request_id.clone(),
                token,
                ttl_ms: next.ttl_ms,
                lease_index: self.applied_index,
            });
            self.locks_held += 1;
            self.dirty_meta |= DIRTY_SEQ;
            let token = FencingToken {
                key: key.to_string(),
                value: token,
            };
            let answer = Outcome::Granted {
                token: token.clone(),
                ttl_ms: next.ttl_ms,
            };
            self.update_record(&next.client_id, &next.request_id, answer);
            events.push(Event::Granted {
                client_id: next.client_id.into(),
                request_id: next.request_id.into(),
                token,
                ttl_ms: next.ttl_ms,
            });
        }
        self.elect_next(key, events);
        self.mark_lock(key);
    }

    pub(super) fn cancel_wait(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let Some(entry) = self.locks.get_mut(key) else {
            return Outcome::NotWaiting;
        };
        let Some(pos) = entry
            .waiters
            .iter()
            .position(|w| *w.client_id == *client_id && *w.request_id == *request_id)
        else {
            return Outcome::NotWaiting;
        };
        entry.waiters.remove(pos);
        self.waiter_left(key, client_id, request_id, events);
        self.forget_candidate(key, client_id, request_id);
        self.mark_lock(key);
        Outcome::WaitCancelled
    }

    /// The bookkeeping of a cancelled waiter taken out of `key`'s queue (a plain or a shared
    /// lock's): counts, byte budget, identity use, its kept answer and the event.
    pub(super) fn waiter_left(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        events: &mut Vec<Event>,
    ) {
        self.waiters -= 1;
        self.lock_bytes = self
            .lock_bytes
            .saturating_sub(lock_cost(key, client_id, request_id));
        self.count_identity(client_id, 0, -1);
        self.update_record(client_id, request_id, Outcome::WaitCancelled);
        events.push(Event::WaiterRemoved {
            key: key.to_string(),
            client_id: client_id.to_string(),
            request_id: request_id.to_string(),
        });
    }

    pub(super) fn mark_lock(&mut self, key: &str) {
        if self
            .locks
            .get(key)
            .is_some_and(|e| e.holder.is_none() && e.waiters.is_empty())
        {
            self.locks.remove(key);
            self.end_election(key);
        }
        self.follow_attachments(key);
        self.mark_dirty(LOCK_PREFIX, key);
    }
}
