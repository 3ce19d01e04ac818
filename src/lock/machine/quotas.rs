//! Limits and quotas: the byte budgets of lock state and key-value data, the per-identity
//! quotas (locks, waiters, sessions), what they count, the leader's precheck, and `SetQuotas` /
//! `SetLimits` as they apply.

use std::collections::BTreeMap;

use super::super::command::Command;
use super::super::limits::{identity_of, Limits, Quotas, LOCK_ENTRY_OVERHEAD};
use super::super::outcome::{Outcome, RejectCode};
use super::{LockStateMachine, DIRTY_LIMITS, DIRTY_QUOTAS};

/// What one identity holds and waits for (see [`Quotas`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct IdentityUse {
    held: u64,
    waiting: u64,
}

/// Bytes a held lock or a queued waiter counts against `Quotas::lock_bytes_max`.
pub(super) fn lock_cost(key: &str, client_id: &str, request_id: &str) -> u64 {
    (key.len() + client_id.len() + request_id.len()) as u64 + LOCK_ENTRY_OVERHEAD
}

/// Bytes a data entry counts against `Quotas::data_bytes_max`.
pub(super) fn data_cost(key: &str, value: &[u8]) -> u64 {
    (key.len() + value.len()) as u64
}

/// A refusal by a byte budget or a quota: `BUSY` on the wire, its message naming the limit
/// (`[limit: <name>]`, which the node counts by).
pub(super) fn limit_refusal(limit: &str, detail: String) -> Outcome {
    Outcome::rejected(
        RejectCode::LimitReached,
        format!("{detail} [limit: {limit}]"),
    )
}

/// Adds `held` and `waiting` to the use of `client_id`'s identity (dropping identities that
/// use nothing).
pub(super) fn count_use(
    uses: &mut BTreeMap<Box<str>, IdentityUse>,
    client_id: &str,
    held: i64,
    waiting: i64,
) {
    let identity = identity_of(client_id);
    let used = match uses.get_mut(identity) {
        Some(used) => used,
        None => uses.entry(Box::from(identity)).or_default(),
    };
    used.held = used.held.saturating_add_signed(held);
    used.waiting = used.waiting.saturating_add_signed(waiting);
    if used.held == 0 && used.waiting == 0 {
        uses.remove(identity);
    }
}

impl LockStateMachine {
    /// `SetQuotas`: takes the quotas (when every bound is positive) and rebuilds what the
    /// per-identity quotas count.
    pub(super) fn set_quotas(&mut self, quotas: &Quotas) -> Outcome {
        if !quotas.is_sane() {
            return Outcome::rejected(RejectCode::InvalidRequest, "quotas must all be positive");
        }
        if self.quotas.as_ref() != Some(quotas) {
            self.quotas = Some(quotas.clone());
            self.dirty_meta |= DIRTY_QUOTAS;
            self.recount();
        }
        Outcome::Stored
    }

    /// What a byte budget or quota would answer `command` now, before it is proposed: the
    /// leader's fast path, so that a request sure to be refused does not take log space on
    /// every replica. Apply still decides (this state may be behind what is in flight). A
    /// request already answered (a retry) is left to apply, which answers it from the table.
    pub fn quota_precheck(&self, command: &Command) -> Option<Outcome> {
        self.quotas.as_ref()?;
        match command.request() {
            Command::Put {
                key,
                value,
                client_id,
                request_id,
                ..
            } => {
                if self.record_number(client_id, request_id).is_some() {
                    return None;
                }
                self.data_bytes_after_put(key, value).err()
            }
            Command::Acquire {
                key,
                client_id,
                request_id,
                wait_timeout_ms,
                ..
            }
            | Command::Campaign {
                key,
                client_id,
                request_id,
                wait_timeout_ms,
                ..
            } => {
                if self.record_number(client_id, request_id).is_some() {
                    return None;
                }
                let value_bytes = match command.request() {
                    Command::Campaign { value, .. } => value.len() as u64,
                    _ => 0,
                };
                self.check_lock_quotas(key, client_id, request_id, *wait_timeout_ms, value_bytes)
                    .err()
            }
            _ => None,
        }
    }

    /// The key-value bytes once `value` is stored under `key`, or the refusal when that passes
    /// the data budget (only while quotas are in force). `put` and `quota_precheck` both ask.
    pub(super) fn data_bytes_after_put(&self, key: &str, value: &[u8]) -> Result<u64, Outcome> {
        let old = self.data.get(key).map_or(0, |v| data_cost(key, v));
        let total = self.data_bytes.saturating_sub(old) + data_cost(key, value);
        match self.quotas.as_ref() {
            Some(q) if total > q.data_bytes_max => Err(limit_refusal(
                "data_bytes",
                format!(
                    "the key-value data would pass its budget of {} bytes",
                    q.data_bytes_max
                ),
            )),
            _ => Ok(total),
        }
    }

    /// The quotas in force (None until a `SetQuotas` entry applied).
    pub fn quotas(&self) -> Option<&Quotas> {
        self.quotas.as_ref()
    }

    /// Bytes of key-value data and of lock state, as the byte budgets count them.
    pub fn bytes_used(&self) -> (u64, u64) {
        (self.data_bytes, self.lock_bytes)
    }

    /// What the byte counts and the per-identity use say against a recount of the state, when
    /// they differ (the simulator checks this after every applied index).
    pub fn accounting_mismatch(&self) -> Option<String> {
        let mut fresh = LockStateMachine {
            quotas: self.quotas.clone(),
            locks: self.locks.clone(),
            data: self.data.clone(),
            elections: self.elections.clone(),
            shared: self.shared.clone(),
            ..Default::default()
        };
        fresh.recount();
        let kept = (self.data_bytes, self.lock_bytes, &self.identity_use);
        let counted = (fresh.data_bytes, fresh.lock_bytes, &fresh.identity_use);
        (kept != counted).then(|| {
            format!("kept (data, lock bytes, use by identity) {kept:?}, recounted {counted:?}")
        })
    }

    /// Rebuilds the byte counts and the per-identity use from the state.
    pub(super) fn recount(&mut self) {
        self.data_bytes = self.data.iter().map(|(k, v)| data_cost(k, v)).sum();
        let by_identity = self.quotas.as_ref().is_some_and(|q| q.by_identity);
        let mut lock_bytes = 0;
        let mut uses = BTreeMap::new();
        for (key, entry) in &self.locks {
            if let Some(h) = &entry.holder {
                lock_bytes += lock_cost(key, &h.client_id, &h.request_id);
                if by_identity {
                    count_use(&mut uses, &h.client_id, 1, 0);
                }
            }
            for w in entry.waiters.iter() {
                lock_bytes += lock_cost(key, &w.client_id, &w.request_id);
                if by_identity {
                    count_use(&mut uses, &w.client_id, 0, 1);
                }
            }
        }
        for (key, entry) in &self.shared {
            for h in &entry.holders {
                lock_bytes += lock_cost(key, &h.client_id, &h.request_id);
                if by_identity {
                    count_use(&mut uses, &h.client_id, 1, 0);
                }
            }
            for w in &entry.waiters {
                lock_bytes += lock_cost(key, &w.client_id, &w.request_id);
                if by_identity {
                    count_use(&mut uses, &w.client_id, 0, 1);
                }
            }
        }
        lock_bytes += self
            .elections
            .values()
            .map(super::elections::election_cost)
            .sum::<u64>();
        self.lock_bytes = lock_bytes;
        self.identity_use = uses;
    }

    /// Counts a lock taken or given back (`held`) and an acquire queued or leaving the queue
    /// (`waiting`) against `client_id`'s identity, while per-identity quotas apply.
    pub(super) fn count_identity(&mut self, client_id: &str, held: i64, waiting: i64) {
        if self.quotas.as_ref().is_some_and(|q| q.by_identity) {
            count_use(&mut self.identity_use, client_id, held, waiting);
        }
    }

    /// Sessions open for `identity`, counted up to `max`.
    pub(super) fn identity_sessions(&self, identity: &str, max: u64) -> u64 {
        let upper = format!("{identity}0");
        self.sessions
            .range::<str, _>((
                std::ops::Bound::Included(identity),
                std::ops::Bound::Excluded(upper.as_str()),
            ))
            .filter(|(client, _)| identity_of(client) == identity)
            .take(max as usize)
            .count() as u64
    }

    /// The byte budget and per-identity quotas for an acquire of `key` that would take the
    /// lock or join its queue (an acquire that would be answered from the state without
    /// taking anything is not checked). `value_bytes`: a campaign's value, which the election
    /// keeps while the candidate waits or leads.
    pub(super) fn check_lock_quotas(
        &self,
        key: &str,
        client_id: &str,
        request_id: &str,
        wait_timeout_ms: Option<u64>,
        value_bytes: u64,
    ) -> Result<(), Outcome> {
        let Some(q) = &self.quotas else {
            return Ok(());
        };
        let queue = match self
            .locks
            .get(key)
            .and_then(|e| e.holder.as_ref().map(|h| (e, h)))
        {
            None => false,
            Some((_, h)) if *h.client_id == *client_id => return Ok(()),
            Some(_) if wait_timeout_ms == Some(0) => return Ok(()),
            Some((e, _)) if e.waiters.iter().any(|w| *w.client_id == *client_id) => return Ok(()),
            Some(_) => true,
        };
        if self.lock_bytes + lock_cost(key, client_id, request_id) + value_bytes > q.lock_bytes_max
        {
            return Err(limit_refusal(
                "lock_bytes",
                format!(
                    "held locks and queued acquires would pass their budget of {} bytes",
                    q.lock_bytes_max
                ),
            ));
        }
        if !q.by_identity {
            return Ok(());
        }
        let identity = identity_of(client_id);
        let used = self.identity_use.get(identity).copied().unwrap_or_default();
        if used.held + used.waiting >= q.identity_locks_max {
            return Err(limit_refusal(
                "identity_locks",
                format!(
                    "identity {identity:?} holds and waits for {} locks",
                    q.identity_locks_max
                ),
            ));
        }
        if queue && used.waiting >= q.identity_waiters_max {
            return Err(limit_refusal(
                "identity_waiters",
                format!(
                    "identity {identity:?} has {} acquires queued",
                    q.identity_waiters_max
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn set_replicated_limits(&mut self, limits: &Limits) -> Outcome {
        let sane = limits.key_bytes_max > 0
            && limits.id_bytes_max > 0
            && limits.ttl_ms_max > 0
            && limits.waiters_per_key_max > 0
            && limits.locks_held_max > 0
            && limits.session_idle_ms > 0;
        if !sane {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                "limits must allow keys, ids, leases, waiters and locks",
            );
        }
        if limits.session_idle_ms < limits.dedupe_retain_ms {
            // A closing session must never forget an answer younger than the retention.
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                "session_idle_ms must be at least dedupe_retain_ms",
            );
        }
        self.limits = limits.clone();
        self.limits_replicated = true;
        self.dirty_meta |= DIRTY_LIMITS;
        Outcome::Stored
    }
}
