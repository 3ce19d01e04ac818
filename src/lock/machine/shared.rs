//! Shared locks: read-write locks (many readers or one writer) and counting semaphores (N
//! permits), on keys of their own (`shared/<key>`).
//!
//! ```text
//!   AcquireShared{mode: Read|Write|Permit} ──► granted at once when the queue is empty and the
//!                                              mode fits beside the holders; queued otherwise
//!   Release / ReleaseHeld / expiry / CancelWait ──► the queue's head is granted while it fits
//!   SetPermits{key, n} (admin) ──► a semaphore's size; lowering it below its holders leaves them
//!                                  their permits, and new grants wait until they fit
//! ```
//!
//! The queue is strictly FIFO across modes: only its head is ever granted, so a waiting writer
//! keeps every reader behind it waiting, and writers do not starve. Each holder has its own
//! fencing token (from the one cluster-wide sequence) and its own lease; a permit also has a
//! *slot*, the lowest slot below N free at its grant, and the holders of one slot over time hold
//! strictly increasing tokens — the sequence a resource checks per slot.
//!
//! A key is a plain lock (or election) or a shared lock while it is in use, never both: the
//! commands of the other kind are refused with `InvalidRequest` until the key is free.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::super::command::{FencingToken, LockMode};
use super::super::outcome::{Event, Outcome, RejectCode};
use super::quotas::{count_use, limit_refusal, lock_cost};
use super::{LockStateMachine, DIRTY_SEQ, SHARED_PREFIX, SHARED_VERSION};

/// One holder of a shared lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SharedHolder {
    pub(super) client_id: Box<str>,
    pub(super) request_id: Box<str>,
    pub(super) token: u64,
    pub(super) ttl_ms: u64,
    /// Log index at which the current lease started: the grant or the latest renew.
    pub(super) lease_index: u64,
    pub(super) mode: LockMode,
    /// A permit's slot (0 for readers and writers).
    pub(super) slot: u32,
}

/// One queued acquire of a shared lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SharedWaiter {
    pub(super) client_id: Box<str>,
    pub(super) request_id: Box<str>,
    pub(super) ttl_ms: u64,
    pub(super) wait_timeout_ms: Option<u64>,
    pub(super) mode: LockMode,
}

/// A read-write lock (`permits` 0) or a semaphore of `permits` permits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SharedEntry {
    pub(super) permits: u32,
    /// The size was set by an admin (`SetPermits`): the entry stays while the key is unused.
    pub(super) fixed: bool,
    /// In grant order (ascending tokens).
    pub(super) holders: Vec<SharedHolder>,
    pub(super) waiters: VecDeque<SharedWaiter>,
}

/// A shared lock as callers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedLockInfo {
    pub key: String,
    /// 0: a read-write lock; otherwise the semaphore's permits.
    pub permits: u32,
    /// The semaphore's size was set by an admin.
    pub fixed: bool,
    pub holders: Vec<SharedHolderInfo>,
    pub waiters: Vec<SharedWaiterInfo>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedHolderInfo {
    pub client_id: String,
    pub request_id: String,
    pub token: u64,
    pub ttl_ms: u64,
    pub lease_index: u64,
    pub mode: LockMode,
    pub slot: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedWaiterInfo {
    pub client_id: String,
    pub request_id: String,
    pub wait_timeout_ms: Option<u64>,
    pub mode: LockMode,
}

impl SharedEntry {
    fn is_semaphore(&self) -> bool {
        self.permits > 0
    }

    /// Whether a grant of `mode` fits beside the holders now, below `cap` holders in all
    /// (`loose`: the mutation switch that lets a semaphore hand out one permit too many, or a
    /// reader in beside a writer).
    fn fits(&self, mode: LockMode, loose: bool, cap: usize) -> bool {
        if self.holders.len() >= cap {
            return false;
        }
        match mode {
            LockMode::Write => self.holders.is_empty(),
            LockMode::Read => loose || self.holders.iter().all(|h| h.mode == LockMode::Read),
            LockMode::Permit => {
                let extra = usize::from(loose);
                self.holders.len() < self.permits as usize + extra
            }
        }
    }

    /// The lowest slot below the size that no holder has (a permit's grant; 0 otherwise).
    fn free_slot(&self, mode: LockMode) -> u32 {
        if mode != LockMode::Permit {
            return 0;
        }
        (0..)
            .find(|slot| !self.holders.iter().any(|h| h.slot == *slot))
            .unwrap_or(0)
    }

    fn info(&self, key: &str) -> SharedLockInfo {
        SharedLockInfo {
            key: key.to_string(),
            permits: self.permits,
            fixed: self.fixed,
            holders: self
                .holders
                .iter()
                .map(|h| SharedHolderInfo {
                    client_id: h.client_id.to_string(),
                    request_id: h.request_id.to_string(),
                    token: h.token,
                    ttl_ms: h.ttl_ms,
                    lease_index: h.lease_index,
                    mode: h.mode,
                    slot: h.slot,
                })
                .collect(),
            waiters: self
                .waiters
                .iter()
                .map(|w| SharedWaiterInfo {
                    client_id: w.client_id.to_string(),
                    request_id: w.request_id.to_string(),
                    wait_timeout_ms: w.wait_timeout_ms,
                    mode: w.mode,
                })
                .collect(),
        }
    }
}

impl LockStateMachine {
    /// Whether `key` is in use as a read-write lock or a semaphore.
    pub fn is_shared(&self, key: &str) -> bool {
        self.shared.contains_key(key)
    }

    /// The shared lock on `key`, if the key is one.
    pub fn shared_lock(&self, key: &str) -> Option<SharedLockInfo> {
        self.shared.get(key).map(|e| e.info(key))
    }

    /// Up to `limit` shared locks whose key sorts after `after` (from the first when `None`).
    pub fn shared_locks_after(&self, after: Option<&str>, limit: usize) -> Vec<SharedLockInfo> {
        use std::ops::Bound;
        let lower = match after {
            Some(key) => Bound::Excluded(key),
            None => Bound::Unbounded,
        };
        self.shared
            .range::<str, _>((lower, Bound::Unbounded))
            .take(limit)
            .map(|(key, e)| e.info(key))
            .collect()
    }

    /// Shared locks whose key starts with `prefix`, in key order, at most `limit`.
    pub fn shared_locks_with_prefix(&self, prefix: &str, limit: usize) -> Vec<SharedLockInfo> {
        self.shared
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(key, _)| key.starts_with(prefix))
            .take(limit)
            .map(|(key, e)| e.info(key))
            .collect()
    }

    /// What is wrong with the shared locks, if anything: a writer beside another holder, more
    /// permits than the size at a grant (checked as distinct slots below the size, or above it
    /// only for holders from before a lowering), a queue whose head could be granted (a grant
    /// the machine forgot), or a waiter that also holds. Checked by the simulator after every
    /// apply.
    pub fn shared_mismatch(&self) -> Option<String> {
        for (key, e) in &self.shared {
            let writers = e
                .holders
                .iter()
                .filter(|h| h.mode == LockMode::Write)
                .count();
            if writers > 0 && e.holders.len() > 1 {
                return Some(format!(
                    "{key:?}: a writer holds beside {} other holders",
                    e.holders.len() - 1
                ));
            }
            let mut slots: Vec<u32> = e.holders.iter().map(|h| h.slot).collect();
            slots.sort_unstable();
            slots.dedup();
            if e.is_semaphore() && slots.len() != e.holders.len() {
                return Some(format!("{key:?}: two permit holders share a slot"));
            }
            if e.holders
                .iter()
                .any(|h| (h.mode == LockMode::Permit) != e.is_semaphore())
                || e.waiters
                    .iter()
                    .any(|w| (w.mode == LockMode::Permit) != e.is_semaphore())
            {
                return Some(format!(
                    "{key:?}: modes of a semaphore and a read-write lock mix"
                ));
            }
            if let Some(head) = e.waiters.front() {
                let cap = self.limits.waiters_per_key_max;
                if !self.delay_running(key) && e.fits(head.mode, false, cap) {
                    return Some(format!(
                        "{key:?}: the queue's head ({:?}, {:?}) fits beside the holders but waits",
                        head.client_id, head.mode
                    ));
                }
            }
            if e.waiters
                .iter()
                .any(|w| e.holders.iter().any(|h| h.client_id == w.client_id))
            {
                return Some(format!("{key:?}: a client waits for a lock it holds"));
            }
            if e.holders.is_empty() && e.waiters.is_empty() && !e.fixed {
                return Some(format!("{key:?}: an unused shared lock is kept"));
            }
        }
        None
    }

    fn shared_version_refusal(&self) -> Option<Outcome> {
        (self.cluster_version() < SHARED_VERSION).then(|| {
            Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "read-write locks and semaphores need cluster version {SHARED_VERSION} (this \
                     cluster runs {}): upgrade every member first",
                    self.cluster_version()
                ),
            )
        })
    }

    /// A plain acquire or campaign of a key in use as a shared lock is refused.
    pub(super) fn refuse_exclusive_of_shared(&self, key: &str) -> Option<Outcome> {
        let e = self.shared.get(key)?;
        let what = if e.is_semaphore() {
            "a semaphore"
        } else {
            "a read-write lock"
        };
        Some(Outcome::rejected(
            RejectCode::InvalidRequest,
            format!("{key:?} is in use as {what}: acquire it in its mode"),
        ))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn acquire_shared(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
        mode: LockMode,
        permits: u32,
    ) -> Outcome {
        if let Some(refusal) = self.shared_version_refusal() {
            return refusal;
        }
        if self.locks.contains_key(key) {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "{key:?} is in use as an exclusive lock or an election: a read-write lock \
                     or a semaphore needs a key of its own"
                ),
            );
        }
        let holders_max = self.limits.waiters_per_key_max;
        match self.shared.get(key) {
            Some(e) if e.is_semaphore() != (mode == LockMode::Permit) => {
                let (is, asked) = if e.is_semaphore() {
                    ("a semaphore", "a read or write lock")
                } else {
                    ("a read-write lock", "a permit")
                };
                return Outcome::rejected(
                    RejectCode::InvalidRequest,
                    format!("{key:?} is in use as {is}; this request asked for {asked}"),
                );
            }
            Some(_) => {}
            None => {
                if self.locks.len() + self.shared.len() >= self.limits.locks_held_max {
                    return limit_refusal("locks_held", "too many locks in use".into());
                }
            }
        }
        if let Err(refusal) = self.check_lock_quotas(key, client_id, request_id, wait_timeout_ms, 0)
        {
            return refusal;
        }
        let loose = match mode {
            LockMode::Read => self.bug(|b| b.reader_beside_writer),
            LockMode::Permit => self.bug(|b| b.permit_over_size),
            LockMode::Write => false,
        };
        let delayed = self.delay_running(key);
        let created = !self.shared.contains_key(key);
        let entry = self
            .shared
            .entry(Box::from(key))
            .or_insert_with(|| SharedEntry {
                permits: if mode == LockMode::Permit { permits } else { 0 },
                ..SharedEntry::default()
            });
        if let Some(h) = entry.holders.iter().find(|h| *h.client_id == *client_id) {
            return Outcome::AlreadyHeld {
                token: FencingToken {
                    key: key.to_string(),
                    value: h.token,
                },
                ttl_ms: h.ttl_ms,
            };
        }
        if let Some(p) = entry
            .waiters
            .iter()
            .position(|w| *w.client_id == *client_id)
        {
            return Outcome::AlreadyQueued {
                position: p as u32 + 1,
            };
        }
        if !delayed && entry.waiters.is_empty() && entry.fits(mode, loose, holders_max) {
            let slot = entry.free_slot(mode);
            self.fencing_seq += 1;
            let token = self.fencing_seq;
            entry.holders.push(SharedHolder {
                client_id: client_id.into(),
                request_id: request_id.into(),
                token,
                ttl_ms,
                lease_index: self.applied_index,
                mode,
                slot,
            });
            self.locks_held += 1;
            self.lock_bytes += lock_cost(key, client_id, request_id);
            self.count_identity(client_id, 1, 0);
            self.dirty_meta |= DIRTY_SEQ;
            self.mark_shared(key);
            return Outcome::SharedGranted {
                token: FencingToken {
                    key: key.to_string(),
                    value: token,
                },
                ttl_ms,
                mode,
                slot,
            };
        }
        if wait_timeout_ms == Some(0) {
            if created {
                self.shared.remove(key);
            }
            return Outcome::Busy;
        }
        if entry.waiters.len() >= self.limits.waiters_per_key_max {
            if created {
                self.shared.remove(key);
            }
            return Outcome::rejected(
                RejectCode::QueueFull,
                format!(
                    "{} waiters already queue for this key",
                    self.limits.waiters_per_key_max
                ),
            );
        }
        entry.waiters.push_back(SharedWaiter {
            client_id: client_id.into(),
            request_id: request_id.into(),
            ttl_ms,
            wait_timeout_ms,
            mode,
        });
        let position = entry.waiters.len() as u32;
        self.waiters += 1;
        self.lock_bytes += lock_cost(key, client_id, request_id);
        self.count_identity(client_id, 0, 1);
        self.mark_shared(key);
        Outcome::Queued { position }
    }

    /// `SetPermits`: an admin sets a semaphore's size (0 forgets the setting: the size stays
    /// while the semaphore is in use, and goes with it). Raising it grants the waiters that now
    /// fit; lowering it below the holders lets them keep their permits.
    pub(super) fn set_permits(
        &mut self,
        key: &str,
        permits: u32,
        events: &mut Vec<Event>,
    ) -> Outcome {
        if let Some(refusal) = self.shared_version_refusal() {
            return refusal;
        }
        if self.locks.contains_key(key) {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!("{key:?} is in use as an exclusive lock or an election"),
            );
        }
        if self.shared.get(key).is_some_and(|e| !e.is_semaphore()) {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!("{key:?} is in use as a read-write lock, not a semaphore"),
            );
        }
        if permits as usize > self.limits.waiters_per_key_max {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "a semaphore has at most {} permits",
                    self.limits.waiters_per_key_max
                ),
            );
        }
        match self.shared.get_mut(key) {
            Some(e) => {
                e.fixed = permits > 0;
                if permits > 0 {
                    e.permits = permits;
                }
            }
            None if permits == 0 => {}
            None => {
                if self.locks.len() + self.shared.len() >= self.limits.locks_held_max {
                    return limit_refusal("locks_held", "too many locks in use".into());
                }
                self.shared.insert(
                    Box::from(key),
                    SharedEntry {
                        permits,
                        fixed: true,
                        ..SharedEntry::default()
                    },
                );
            }
        }
        self.grant_shared(key, events);
        self.mark_shared(key);
        Outcome::PermitsSet { permits }
    }

    /// The holder of `token` on shared `key`, checked to be `client_id`'s.
    fn shared_holder_at(&self, key: &str, client_id: &str, token: u64) -> Result<usize, Outcome> {
        let Some(e) = self.shared.get(key) else {
            return Err(Outcome::StaleToken { current: None });
        };
        match e.holders.iter().position(|h| h.token == token) {
            None => Err(Outcome::StaleToken { current: None }),
            Some(i) if *e.holders[i].client_id != *client_id => Err(Outcome::NotHolder),
            Some(i) => Ok(i),
        }
    }

    pub(super) fn release_shared(
        &mut self,
        key: &str,
        client_id: &str,
        token: u64,
        events: &mut Vec<Event>,
    ) -> Outcome {
        match self.shared_holder_at(key, client_id, token) {
            Ok(i) => {
                self.remove_shared_holder(key, i, events);
                Outcome::Released
            }
            Err(refusal) => refusal,
        }
    }

    /// A release without a token: the holder that is `client_id`.
    pub(super) fn release_shared_held(
        &mut self,
        key: &str,
        client_id: &str,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let found = self
            .shared
            .get(key)
            .and_then(|e| e.holders.iter().position(|h| *h.client_id == *client_id));
        match found {
            Some(i) => {
                self.remove_shared_holder(key, i, events);
                Outcome::Released
            }
            None if self.shared.get(key).is_some_and(|e| !e.holders.is_empty()) => {
                Outcome::NotHolder
            }
            None => Outcome::StaleToken { current: None },
        }
    }

    pub(super) fn renew_shared(
        &mut self,
        key: &str,
        client_id: &str,
        token: u64,
        ttl_ms: u64,
    ) -> Outcome {
        let i = match self.shared_holder_at(key, client_id, token) {
            Ok(i) => i,
            Err(refusal) => return refusal,
        };
        let index = self.applied_index;
        if let Some(h) = self.shared.get_mut(key).map(|e| &mut e.holders[i]) {
            h.ttl_ms = ttl_ms;
            h.lease_index = index;
        }
        self.mark_shared(key);
        Outcome::Renewed {
            token: FencingToken {
                key: key.to_string(),
                value: token,
            },
            ttl_ms,
        }
    }

    pub(super) fn expire_shared(
        &mut self,
        key: &str,
        token: u64,
        lease_index: Option<u64>,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let found = self.shared.get(key).and_then(|e| {
            e.holders
                .iter()
                .position(|h| h.token == token)
                .map(|i| (i, e.holders[i].clone()))
        });
        let Some((i, h)) = found else {
            return Outcome::StaleToken { current: None };
        };
        if lease_index.is_some_and(|l| l != h.lease_index) {
            return Outcome::LeaseRenewed {
                lease_index: h.lease_index,
            };
        }
        self.report_expiry(key, &h.client_id, token, events);
        self.remove_shared_holder(key, i, events);
        Outcome::Expired {
            client_id: h.client_id.into(),
        }
    }

    pub(super) fn cancel_shared_wait(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let Some(e) = self.shared.get_mut(key) else {
            return Outcome::NotWaiting;
        };
        let Some(pos) = e
            .waiters
            .iter()
            .position(|w| *w.client_id == *client_id && *w.request_id == *request_id)
        else {
            return Outcome::NotWaiting;
        };
        e.waiters.remove(pos);
        self.waiter_left(key, client_id, request_id, events);
        // The head may have been what kept the waiters behind it out (a writer before readers).
        if !self.bug(|b| b.shared_cancel_skips_grant) {
            self.grant_shared(key, events);
        }
        self.mark_shared(key);
        Outcome::WaitCancelled
    }

    /// Ends what `client_id`'s session holds and waits for on shared `key`: its attached
    /// waiter leaves the queue (unless `keep_waiters`, a mutation switch), its attached holder
    /// gives its lock or permit up — an expiry as a lease's would (lock-delay), a close as a
    /// release. Returns how many ended.
    pub(super) fn end_shared_attached(
        &mut self,
        key: &str,
        client_id: &str,
        expired: bool,
        keep_waiters: bool,
        events: &mut Vec<Event>,
    ) -> u32 {
        let Some(e) = self.shared.get(key) else {
            return 0;
        };
        let waiting: Vec<Box<str>> = e
            .waiters
            .iter()
            .filter(|w| *w.client_id == *client_id && w.ttl_ms == 0)
            .map(|w| w.request_id.clone())
            .collect();
        let held = e
            .holders
            .iter()
            .find(|h| *h.client_id == *client_id && h.ttl_ms == 0)
            .map(|h| h.token);
        let mut ended = 0;
        if !keep_waiters {
            for request_id in waiting {
                if self.cancel_shared_wait(key, client_id, &request_id, events)
                    == Outcome::WaitCancelled
                {
                    ended += 1;
                }
            }
        }
        if let Some(token) = held {
            if expired {
                self.report_expiry(key, client_id, token, events);
            }
            let at = self
                .shared
                .get(key)
                .and_then(|e| e.holders.iter().position(|h| h.token == token));
            if let Some(i) = at {
                self.remove_shared_holder(key, i, events);
                ended += 1;
            }
        }
        ended
    }

    /// The waiter `(client_id, request_id)` of shared `key`: its place (1-based) and timeout.
    pub(super) fn shared_waiter(
        &self,
        key: &str,
        client_id: &str,
        request_id: &str,
    ) -> Option<(u32, Option<u64>)> {
        let e = self.shared.get(key)?;
        e.waiters
            .iter()
            .position(|w| *w.client_id == *client_id && *w.request_id == *request_id)
            .map(|p| (p as u32 + 1, e.waiters[p].wait_timeout_ms))
    }

    fn remove_shared_holder(&mut self, key: &str, i: usize, events: &mut Vec<Event>) {
        let Some(e) = self.shared.get_mut(key) else {
            return;
        };
        let old = e.holders.remove(i);
        self.locks_held -= 1;
        self.lock_bytes =
            self.lock_bytes
                .saturating_sub(lock_cost(key, &old.client_id, &old.request_id));
        if self.quotas.as_ref().is_some_and(|q| q.by_identity) {
            count_use(&mut self.identity_use, &old.client_id, -1, 0);
        }
        self.grant_shared(key, events);
        self.mark_shared(key);
    }

    /// Grants the queue's head while it fits beside the holders (and no lock-delay runs).
    pub(super) fn grant_shared(&mut self, key: &str, events: &mut Vec<Event>) {
        if self.delay_running(key) {
            return;
        }
        let by_identity = self.quotas.as_ref().is_some_and(|q| q.by_identity);
        let index = self.applied_index;
        let cap = self.limits.waiters_per_key_max;
        loop {
            let Some(e) = self.shared.get_mut(key) else {
                return;
            };
            let Some(head) = e.waiters.front() else {
                return;
            };
            if !e.fits(head.mode, false, cap) {
                return;
            }
            let Some(next) = e.waiters.pop_front() else {
                return;
            };
            let slot = e.free_slot(next.mode);
            self.fencing_seq += 1;
            let token = self.fencing_seq;
            e.holders.push(SharedHolder {
                client_id: next.client_id.clone(),
                request_id: next.request_id.clone(),
                token,
                ttl_ms: next.ttl_ms,
                lease_index: index,
                mode: next.mode,
                slot,
            });
            self.waiters -= 1;
            self.locks_held += 1;
            if by_identity {
                count_use(&mut self.identity_use, &next.client_id, 1, -1);
            }
            self.dirty_meta |= DIRTY_SEQ;
            let token = FencingToken {
                key: key.to_string(),
                value: token,
            };
            let answer = Outcome::SharedGranted {
                token: token.clone(),
                ttl_ms: next.ttl_ms,
                mode: next.mode,
                slot,
            };
            self.update_record(&next.client_id, &next.request_id, answer);
            events.push(Event::SharedGranted {
                client_id: next.client_id.into(),
                request_id: next.request_id.into(),
                token,
                ttl_ms: next.ttl_ms,
                mode: next.mode,
                slot,
            });
        }
    }

    /// Whether `token` holds shared `key` in a mode that may write (a writer or a permit).
    pub(super) fn shared_guard(&self, key: &str, token: u64) -> Option<bool> {
        let e = self.shared.get(key)?;
        Some(
            e.holders
                .iter()
                .any(|h| h.token == token && h.mode != LockMode::Read),
        )
    }

    pub(super) fn mark_shared(&mut self, key: &str) {
        if self
            .shared
            .get(key)
            .is_some_and(|e| e.holders.is_empty() && e.waiters.is_empty() && !e.fixed)
        {
            self.shared.remove(key);
        }
        self.mark_dirty(SHARED_PREFIX, key);
        self.follow_attachments(key);
    }
}
