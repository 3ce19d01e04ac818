//! Sessions that cover many locks (Chubby's session, etcd's lease): a client keeps one lease
//! alive for itself, and every lock or candidacy it attaches to that session (an acquire or a
//! campaign with a TTL of 0) lasts as long as the session does. Ending the session — closed by
//! its client, or expired by the leader when no keepalive came in time — ends every attached
//! lock and attached wait in one log entry.
//!
//! ```text
//!   KeepAlive{session: 0}   ──► session/<client> = {opened: index, lease_index: index, ttl}
//!   Acquire{ttl_ms: 0}      ──► the lock's lease is the session's (needs the session open)
//!   KeepAlive{session: n}   ──► lease_index = index (only while session n is the client's)
//!   EndSession{n}           ──► attached holders released, attached waiters cancelled
//!   ExpireSession{n, lease} ──► attached holders expire (lock-delay starts), waiters cancelled
//! ```
//!
//! The attachments are derived state: which keys have an attached holder or waiter of which
//! client is read off the lock entries whenever one changes (`follow_attachments`), and
//! rebuilt at load. Invariant: every attached holder and waiter belongs to a client whose
//! session is open ([`LockStateMachine::session_mismatch`] checks it after every apply in the
//! simulator).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::super::outcome::{Event, Outcome, RejectCode};
use super::shared::SharedEntry;
use super::{LockStateMachine, SESSION_PREFIX, SESSION_VERSION};

/// One client's session lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SessionLease {
    /// The log index of the keepalive that opened the session: its name.
    pub(super) opened: u64,
    /// The log index of the latest keepalive: the current lease started there.
    pub(super) lease_index: u64,
    pub(super) ttl_ms: u64,
}

/// A session as callers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    pub client_id: String,
    /// The log index that opened it (the session's name in `KeepAlive` and `EndSession`).
    pub session: u64,
    /// The log index of the latest keepalive.
    pub lease_index: u64,
    pub ttl_ms: u64,
    /// Keys with a lock or an acquire attached to the session.
    pub attached: usize,
}

impl LockStateMachine {
    /// `client_id`'s open session, if it has one.
    pub fn session_lease(&self, client_id: &str) -> Option<SessionInfo> {
        let lease = self.session_leases.get(client_id)?;
        Some(SessionInfo {
            client_id: client_id.to_string(),
            session: lease.opened,
            lease_index: lease.lease_index,
            ttl_ms: lease.ttl_ms,
            attached: self.attached.get(client_id).map_or(0, BTreeSet::len),
        })
    }

    /// Every open session, by client id.
    pub fn session_leases(&self) -> Vec<SessionInfo> {
        self.session_leases
            .keys()
            .filter_map(|client| self.session_lease(client))
            .collect()
    }

    /// Open sessions.
    pub fn session_lease_count(&self) -> usize {
        self.session_leases.len()
    }

    /// Whether `client_id` has an open session (a lock may be attached to it).
    pub(super) fn has_session(&self, client_id: &str) -> bool {
        self.session_leases.contains_key(client_id)
    }

    fn session_version_refusal(&self) -> Option<Outcome> {
        (self.cluster_version() < SESSION_VERSION).then(|| {
            Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "sessions need cluster version {SESSION_VERSION} (this cluster runs {}): \
                     upgrade every member first",
                    self.cluster_version()
                ),
            )
        })
    }

    /// `KeepAlive`: opens the client's session (`session` 0, when it has none) or restarts the
    /// lease of the one it has.
    pub(super) fn keep_alive(&mut self, client_id: &str, session: u64, ttl_ms: u64) -> Outcome {
        if let Some(refusal) = self.session_version_refusal() {
            return refusal;
        }
        let l = &self.limits;
        if client_id.is_empty() {
            return Outcome::rejected(RejectCode::InvalidRequest, "clientId is required");
        }
        if client_id.len() > l.id_bytes_max {
            return Outcome::rejected(
                RejectCode::TooLarge,
                format!("client ids are limited to {} bytes", l.id_bytes_max),
            );
        }
        if ttl_ms == 0 || ttl_ms > l.ttl_ms_max {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!("a session's ttl must be 1..={} ms", l.ttl_ms_max),
            );
        }
        let index = self.applied_index;
        let opened = match self.session_leases.get_mut(client_id) {
            Some(lease) if session == 0 || session == lease.opened => {
                lease.lease_index = index;
                lease.ttl_ms = ttl_ms;
                lease.opened
            }
            Some(_) => return Outcome::NoSession,
            None if session != 0 => return Outcome::NoSession,
            None => {
                if self.session_leases.len() >= self.limits.sessions_max {
                    return Outcome::rejected(
                        RejectCode::LimitReached,
                        format!(
                            "{} sessions are open, the most the cluster keeps",
                            self.session_leases.len()
                        ),
                    );
                }
                self.session_leases.insert(
                    Box::from(client_id),
                    SessionLease {
                        opened: index,
                        lease_index: index,
                        ttl_ms,
                    },
                );
                index
            }
        };
        self.mark_dirty(SESSION_PREFIX, client_id);
        Outcome::SessionKept {
            session: opened,
            ttl_ms,
        }
    }

    /// `EndSession`: the client closes its session.
    pub(super) fn close_session(
        &mut self,
        client_id: &str,
        session: u64,
        events: &mut Vec<Event>,
    ) -> Outcome {
        if let Some(refusal) = self.session_version_refusal() {
            return refusal;
        }
        match self.session_leases.get(client_id) {
            Some(lease) if lease.opened == session => Outcome::SessionEnded {
                locks: self.end_session(client_id, false, events),
            },
            _ => Outcome::NoSession,
        }
    }

    /// `ExpireSession`: the leader saw the lease that started at `lease_index` run out.
    pub(super) fn expire_session(
        &mut self,
        client_id: &str,
        session: u64,
        lease_index: u64,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let skip_check = self.bug(|b| b.session_expiry_ignores_keepalive);
        match self.session_leases.get(client_id) {
            Some(lease) if lease.opened == session => {
                if lease.lease_index != lease_index && !skip_check {
                    // A keepalive committed after the leader saw the lease run out.
                    return Outcome::LeaseRenewed {
                        lease_index: lease.lease_index,
                    };
                }
                Outcome::SessionEnded {
                    locks: self.end_session(client_id, true, events),
                }
            }
            _ => Outcome::NoSession,
        }
    }

    /// Ends `client_id`'s session: its attached waiters leave their queues and its attached
    /// holders give their locks up (to the next waiter, unless an expiry starts a lock-delay).
    /// Returns how many attached locks and acquires ended.
    fn end_session(&mut self, client_id: &str, expired: bool, events: &mut Vec<Event>) -> u32 {
        self.session_leases.remove(client_id);
        self.mark_dirty(SESSION_PREFIX, client_id);
        let keys: Vec<Box<str>> = self
            .attached
            .get(client_id)
            .map(|keys| keys.iter().cloned().collect())
            .unwrap_or_default();
        let keep_waiters = self.bug(|b| b.session_end_keeps_waiters);
        let mut ended = 0u32;
        let skip_shared = self.bug(|b| b.session_end_skips_shared);
        for key in keys {
            if self.shared.contains_key(&*key) {
                if !skip_shared {
                    ended +=
                        self.end_shared_attached(&key, client_id, expired, keep_waiters, events);
                }
                continue;
            }
            let Some(entry) = self.locks.get(&*key) else {
                continue;
            };
            let waiting: Vec<String> = entry
                .waiters
                .iter()
                .filter(|w| *w.client_id == *client_id && w.ttl_ms == 0)
                .map(|w| w.request_id.to_string())
                .collect();
            let held = entry
                .holder
                .as_ref()
                .filter(|h| *h.client_id == *client_id && h.ttl_ms == 0)
                .map(|h| h.token);
            if !keep_waiters {
                for request_id in waiting {
                    if self.cancel_wait(&key, client_id, &request_id, events)
                        == Outcome::WaitCancelled
                    {
                        ended += 1;
                    }
                }
            }
            if let Some(token) = held {
                if expired {
                    self.report_expiry(&key, client_id, token, events);
                }
                self.vacate(&key, events);
                ended += 1;
            }
        }
        ended
    }

    /// Keeps the attachments of `key` in step with its lock entry (called whenever the entry
    /// changes). Costs nothing while no session is open and none has attachments.
    pub(super) fn follow_attachments(&mut self, key: &str) {
        if self.session_leases.is_empty() && self.attached_by_key.is_empty() {
            return;
        }
        let now = match (self.locks.get(key), self.shared.get(key)) {
            (Some(e), _) => attached_clients(e),
            (None, Some(e)) => shared_attached_clients(e),
            (None, None) => Vec::new(),
        };
        let before = if now.is_empty() {
            self.attached_by_key.remove(key).unwrap_or_default()
        } else {
            self.attached_by_key
                .insert(Box::from(key), now.clone())
                .unwrap_or_default()
        };
        if before == now {
            return;
        }
        for client in before.iter().filter(|c| !now.contains(c)) {
            if let Some(keys) = self.attached.get_mut(client) {
                keys.remove(key);
                if keys.is_empty() {
                    self.attached.remove(client);
                }
            }
        }
        for client in now.iter().filter(|c| !before.contains(c)) {
            self.attached
                .entry(client.clone())
                .or_default()
                .insert(Box::from(key));
        }
    }

    /// Rebuilds the attachments from the lock entries (at load).
    pub(super) fn rebuild_attachments(&mut self) {
        let (attached, by_key) = attachments_of(&self.locks, &self.shared);
        self.attached = attached;
        self.attached_by_key = by_key;
    }

    /// What is wrong with the sessions' attachments, if anything: an attached holder or waiter
    /// of a client without an open session, or kept attachments that differ from the lock
    /// entries (the simulator checks this after every applied index).
    pub fn session_mismatch(&self) -> Option<String> {
        let (attached, by_key) = attachments_of(&self.locks, &self.shared);
        if let Some(client) = attached
            .keys()
            .find(|c| !self.session_leases.contains_key(*c))
        {
            return Some(format!(
                "client {client:?} has locks or acquires attached to a session it does not have \
                 (keys {:?})",
                attached[client]
            ));
        }
        (attached != self.attached || by_key != self.attached_by_key).then(|| {
            format!(
                "kept attachments {:?}, read off the locks {:?}",
                self.attached, attached
            )
        })
    }
}

type Attachments = (
    BTreeMap<Box<str>, BTreeSet<Box<str>>>,
    BTreeMap<Box<str>, Vec<Box<str>>>,
);

fn attachments_of(
    locks: &BTreeMap<Box<str>, Box<super::LockEntry>>,
    shared: &BTreeMap<Box<str>, SharedEntry>,
) -> Attachments {
    let mut attached: BTreeMap<Box<str>, BTreeSet<Box<str>>> = BTreeMap::new();
    let mut by_key: BTreeMap<Box<str>, Vec<Box<str>>> = BTreeMap::new();
    let plain = locks.iter().map(|(key, e)| (key, attached_clients(e)));
    let shared = shared
        .iter()
        .map(|(key, e)| (key, shared_attached_clients(e)));
    for (key, clients) in plain.chain(shared) {
        if clients.is_empty() {
            continue;
        }
        for c in &clients {
            attached.entry(c.clone()).or_default().insert(key.clone());
        }
        by_key.insert(key.clone(), clients);
    }
    (attached, by_key)
}

/// The clients with a holder or a waiter attached to their session on this entry, sorted.
fn attached_clients(e: &super::LockEntry) -> Vec<Box<str>> {
    let holder = e.holder.iter().map(|h| (&h.client_id, h.ttl_ms));
    sorted_attached(holder.chain(e.waiters.iter().map(|w| (&w.client_id, w.ttl_ms))))
}

/// The same for a read-write lock or semaphore.
fn shared_attached_clients(e: &SharedEntry) -> Vec<Box<str>> {
    let holders = e.holders.iter().map(|h| (&h.client_id, h.ttl_ms));
    sorted_attached(holders.chain(e.waiters.iter().map(|w| (&w.client_id, w.ttl_ms))))
}

/// The distinct clients among `(client, ttl)` whose TTL is 0 (attached), sorted.
fn sorted_attached<'a>(all: impl Iterator<Item = (&'a Box<str>, u64)>) -> Vec<Box<str>> {
    let mut clients: Vec<Box<str>> = all
        .filter(|(_, ttl_ms)| *ttl_ms == 0)
        .map(|(client, _)| client.clone())
        .collect();
    clients.sort();
    clients.dedup();
    clients
}
