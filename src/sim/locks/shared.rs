//! Read-write locks and semaphores in the reference sequence: a model of each shared key's
//! holders and queue, judged at every step for readers never beside a writer, at most N permit
//! holders (distinct slots below N), FIFO grants across modes, and tokens that increase.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::lock::{Applied, Command, Event, LockMode, Outcome};
use crate::raft::Index;

use super::LockChecker;

/// One shared key as the reference sequence says it is.
#[derive(Default)]
pub(super) struct SharedModel {
    /// 0: a read-write lock; otherwise the semaphore's size.
    permits: u32,
    /// (client, request, token, mode, slot) of each holder.
    holders: Vec<(String, String, u64, LockMode, u32)>,
    /// (client, request, mode) of each waiter, in queue order.
    queue: VecDeque<(String, String, LockMode)>,
    last_token: u64,
    /// Tokens of the holders attached to their client's session (granted or renewed with a
    /// TTL of 0).
    attached: BTreeSet<u64>,
}

impl LockChecker {
    /// Judges a step on a read-write lock or semaphore; false when the step is not one (the
    /// plain lock model takes it).
    pub(super) fn check_shared(
        &mut self,
        index: Index,
        command: &Command,
        applied: &Applied,
    ) -> bool {
        let key = command.key();
        let shared_command = matches!(
            command,
            Command::AcquireShared { .. } | Command::SetPermits { .. }
        );
        if !shared_command && !self.shared.contains_key(key) {
            return false;
        }
        match (command, &applied.outcome) {
            (
                Command::AcquireShared {
                    client_id,
                    request_id,
                    mode,
                    permits,
                    ..
                },
                Outcome::SharedGranted {
                    token,
                    mode: granted,
                    slot,
                    ..
                },
            ) => {
                if granted != mode {
                    self.fail(
                        "shared grants keep their mode",
                        format!("index {index}: {client_id} asked {mode:?}, granted {granted:?}"),
                    );
                }
                let model = self.shared.entry(key.to_string()).or_default();
                if model.holders.is_empty() && model.queue.is_empty() && model.permits == 0 {
                    model.permits = *permits;
                }
                if !model.queue.is_empty() {
                    let front = model.queue.front().cloned();
                    self.fail(
                        "FIFO grants",
                        format!(
                            "index {index}: {client_id} granted {key} at once past the queue \
                             (front {front:?})"
                        ),
                    );
                }
                self.shared_grant(index, key, client_id, request_id, token.value, *mode, *slot);
                if command.as_acquire().is_some_and(|a| a.ttl_ms == 0) {
                    self.shared_attach(key, token.value, true);
                    self.attached_grants += 1;
                }
            }
            (
                Command::AcquireShared {
                    client_id,
                    request_id,
                    mode,
                    permits,
                    ..
                },
                Outcome::Queued { .. },
            ) => {
                let model = self.shared.entry(key.to_string()).or_default();
                if model.holders.is_empty() && model.queue.is_empty() && model.permits == 0 {
                    model.permits = *permits;
                }
                if model.holders.is_empty() && model.queue.is_empty() {
                    self.fail(
                        "no idle queue",
                        format!("index {index}: {client_id} queued on free shared key {key}"),
                    );
                }
                let model = self.shared.entry(key.to_string()).or_default();
                model
                    .queue
                    .push_back((client_id.clone(), request_id.clone(), *mode));
            }
            (Command::Release { token, .. }, Outcome::Released) => {
                self.shared_remove_holder(key, |h| h.2 == token.value);
            }
            (Command::ReleaseHeld { client_id, .. }, Outcome::Released) => {
                self.shared_remove_holder(key, |h| h.0 == *client_id);
            }
            (
                Command::Expire { token, .. } | Command::ExpireLease { token, .. },
                Outcome::Expired { .. },
            ) => {
                self.expiries += 1;
                self.shared_remove_holder(key, |h| h.2 == *token);
            }
            (Command::Renew { token, ttl_ms, .. }, Outcome::Renewed { .. }) => {
                self.shared_attach(key, token.value, *ttl_ms == 0);
            }
            (Command::SetPermits { permits, .. }, Outcome::PermitsSet { .. }) if *permits > 0 => {
                self.shared.entry(key.to_string()).or_default().permits = *permits;
            }
            _ => {}
        }
        // A shared command's events are all on its key.
        for event in &applied.events {
            self.shared_event(index, key, event);
        }
        if self
            .shared
            .get(key)
            .is_some_and(|m| m.holders.is_empty() && m.queue.is_empty())
        {
            self.shared.remove(key);
        }
        true
    }

    /// A session's end (by its client or by expiry) on the shared keys: every holder attached
    /// to it leaves — by expiry exactly when the session expired. Returns the shared keys the
    /// entry touched, whose events (waiters leaving, grants to those behind) the caller hands to
    /// `shared_event` in the entry's order; the plain lock model takes the others.
    pub(super) fn check_shared_session_end(
        &mut self,
        index: Index,
        command: &Command,
        applied: &Applied,
    ) -> BTreeSet<String> {
        let (Command::EndSession { client_id, .. } | Command::ExpireSession { client_id, .. }) =
            command
        else {
            return BTreeSet::new();
        };
        if !matches!(applied.outcome, Outcome::SessionEnded { .. }) {
            return BTreeSet::new();
        }
        let expiry = matches!(command, Command::ExpireSession { .. });
        let touched: BTreeSet<String> = applied
            .events
            .iter()
            .filter_map(|e| match e {
                Event::SharedGranted { token, .. } | Event::Expired { token, .. } => {
                    Some(token.key.as_str())
                }
                Event::WaiterRemoved { key, .. } => Some(key.as_str()),
                _ => None,
            })
            .filter(|key| self.shared.contains_key(*key))
            .map(str::to_string)
            .collect();
        // The attached holders of the client, each expired by an event when the session
        // expired; released otherwise.
        let mut ended: Vec<(String, u64)> = Vec::new();
        for (key, model) in &self.shared {
            for h in &model.holders {
                if h.0 == *client_id && model.attached.contains(&h.2) {
                    ended.push((key.clone(), h.2));
                }
            }
        }
        for (key, token) in &ended {
            let expired = applied.events.iter().any(|e| {
                matches!(e, Event::Expired { token: t, .. } if t.key == *key && t.value == *token)
            });
            if expired != expiry {
                self.fail(
                    "attached locks end with their session",
                    format!(
                        "index {index}: {client_id}'s {key} (token {token}), attached to its \
                         session, expired: {expired}, by {command:?}"
                    ),
                );
            }
            self.shared_remove_holder(key, |h| h.2 == *token);
        }
        let ended_keys: BTreeSet<&String> = ended.iter().map(|(k, _)| k).collect();
        if let Some(key) = touched
            .iter()
            .find(|k| !ended_keys.contains(k) && !self.shared_has_waiter_of(k, client_id))
        {
            self.fail(
                "attached locks end with their session",
                format!(
                    "index {index}: {command:?} changed {key}, which the session had nothing of"
                ),
            );
        }
        touched
    }

    /// Forgets the models of `keys` left without holders and waiters.
    pub(super) fn shared_tidy(&mut self, keys: &BTreeSet<String>) {
        for key in keys {
            if self
                .shared
                .get(key)
                .is_some_and(|m| m.holders.is_empty() && m.queue.is_empty())
            {
                self.shared.remove(key);
            }
        }
    }

    fn shared_has_waiter_of(&self, key: &str, client_id: &str) -> bool {
        self.shared
            .get(key)
            .is_some_and(|m| m.queue.iter().any(|w| w.0 == client_id))
    }

    fn shared_attach(&mut self, key: &str, token: u64, attached: bool) {
        if let Some(model) = self.shared.get_mut(key) {
            if attached {
                model.attached.insert(token);
            } else {
                model.attached.remove(&token);
            }
        }
    }

    /// One event of an entry on shared `key`, judged in the entry's order (a session's end
    /// interleaves them with the plain keys' events, and tokens must grow across both).
    pub(super) fn shared_event(&mut self, index: Index, key: &str, event: &Event) {
        match event {
            Event::SharedGranted {
                client_id,
                request_id,
                token,
                mode,
                slot,
                ttl_ms,
            } => {
                let model = self.shared.entry(key.to_string()).or_default();
                let front = model.queue.pop_front();
                if front.as_ref() != Some(&(client_id.clone(), request_id.clone(), *mode)) {
                    self.fail(
                        "FIFO grants",
                        format!(
                            "index {index}: {key} granted to {client_id}/{request_id} \
                                 ({mode:?}), queue front was {front:?}"
                        ),
                    );
                }
                self.shared_grant(index, key, client_id, request_id, token.value, *mode, *slot);
                self.shared_attach(key, token.value, *ttl_ms == 0);
                self.attached_grants += u64::from(*ttl_ms == 0);
            }
            Event::WaiterRemoved {
                client_id,
                request_id,
                ..
            } => {
                let model = self.shared.entry(key.to_string()).or_default();
                model
                    .queue
                    .retain(|w| (&w.0, &w.1) != (client_id, request_id));
            }
            Event::Granted { token, .. } => self.fail(
                "shared grants keep their mode",
                format!(
                    "index {index}: an exclusive grant of {} on a shared key",
                    token.key
                ),
            ),
            Event::Expired { .. }
            | Event::LockDelayStarted { .. }
            | Event::LockDelayEnded { .. }
            | Event::Proclaimed { .. } => {}
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn shared_grant(
        &mut self,
        index: Index,
        key: &str,
        client: &str,
        request: &str,
        token: u64,
        mode: LockMode,
        slot: u32,
    ) {
        self.grants += 1;
        self.shared_grants += 1;
        let id = (client.to_string(), request.to_string());
        if let Some(earlier) = self.granted.insert(id.clone(), token) {
            self.fail(
                "exactly once",
                format!("index {index}: {id:?} granted token {token} after {earlier}"),
            );
        }
        let global = self.last_global_token;
        let model = self.shared.entry(key.to_string()).or_default();
        let mut failures = Vec::new();
        let writer = model.holders.iter().find(|h| h.3 == LockMode::Write);
        match mode {
            LockMode::Write if !model.holders.is_empty() => failures.push((
                "readers never beside a writer",
                format!(
                    "index {index}: {client} granted {key} to write beside {} holders",
                    model.holders.len()
                ),
            )),
            LockMode::Read if writer.is_some() => failures.push((
                "readers never beside a writer",
                format!("index {index}: {client} granted {key} to read beside writer {writer:?}"),
            )),
            LockMode::Permit => {
                if model.holders.len() >= model.permits as usize {
                    failures.push((
                        "at most N permit holders",
                        format!(
                            "index {index}: {client} granted a permit of {key} beside {} holders \
                             of {} permits",
                            model.holders.len(),
                            model.permits
                        ),
                    ));
                }
                if slot >= model.permits || model.holders.iter().any(|h| h.4 == slot) {
                    failures.push((
                        "at most N permit holders",
                        format!("index {index}: {client} granted slot {slot} of {key}, taken or past the size"),
                    ));
                }
            }
            _ => {}
        }
        if token <= model.last_token {
            failures.push((
                "tokens increase per key",
                format!(
                    "index {index}: token {token} for {key} after {}",
                    model.last_token
                ),
            ));
        }
        if token <= global {
            failures.push((
                "tokens increase globally",
                format!("index {index}: token {token} after {global} elsewhere"),
            ));
        }
        model.last_token = token;
        model
            .holders
            .push((client.to_string(), request.to_string(), token, mode, slot));
        self.last_global_token = token;
        for (invariant, detail) in failures {
            self.fail(invariant, detail);
        }
    }

    fn shared_remove_holder(
        &mut self,
        key: &str,
        which: impl Fn(&(String, String, u64, LockMode, u32)) -> bool,
    ) {
        if let Some(model) = self.shared.get_mut(key) {
            if let Some(i) = model.holders.iter().position(which) {
                let gone = model.holders.remove(i);
                model.attached.remove(&gone.2);
            }
        }
    }
}

/// Shared locks by key (the checker's part).
pub(super) type SharedModels = BTreeMap<String, SharedModel>;
