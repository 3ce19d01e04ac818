//! Lock-delay (Chubby's): a key whose holder's lease *expired* stays unavailable for the key's
//! configured delay, so that a resource that cannot check fencing tokens is not used by the next
//! holder while the expired one may still be acting. A release ends a hold without a delay: the
//! holder said it stopped.
//!
//! ```text
//!   SetLockDelay{key, delay_ms} ──► delay/<key> = { delay_ms, running: None }
//!   ExpireLease of the holder   ──► running = { token, delay_ms }: no grant, acquires queue
//!   leader, delay_ms later      ──► EndLockDelay{key, token} ──► running = None, next waiter granted
//! ```
//!
//! The delay is measured by the leader, like a lease: the machine never reads a clock. A new
//! leader starts every running delay again in full, so a delay can last longer than configured,
//! never shorter.

use serde::{Deserialize, Serialize};

use super::super::outcome::{Event, Outcome, RejectCode};
use super::{LockStateMachine, DELAY_PREFIX, LOCK_DELAY_VERSION};

/// One key's lock-delay: the configured length and the delay running now, if any.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct LockDelay {
    /// How long the key stays unavailable after its holder's lease expires, in ms. 0 once the
    /// setting was removed while a delay ran (the record goes when that delay ends).
    pub(super) delay_ms: u64,
    /// The delay running now.
    pub(super) running: Option<RunningDelay>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct RunningDelay {
    /// The fencing token whose lease expired.
    pub(super) token: u64,
    /// The length the delay started with.
    pub(super) delay_ms: u64,
}

/// A key's lock-delay as callers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockDelayInfo {
    pub key: String,
    /// The configured delay (ms).
    pub delay_ms: u64,
    /// The delay running now: the expired token and the delay's length.
    pub running: Option<(u64, u64)>,
}

impl LockStateMachine {
    /// The key's lock-delay setting and running delay (`None`: no delay configured or running).
    pub fn lock_delay(&self, key: &str) -> Option<LockDelayInfo> {
        let d = self.delays.get(key)?;
        Some(LockDelayInfo {
            key: key.to_string(),
            delay_ms: d.delay_ms,
            running: d.running.as_ref().map(|r| (r.token, r.delay_ms)),
        })
    }

    /// Every delay running now, in key order (what a new leader times again).
    pub fn running_lock_delays(&self) -> Vec<LockDelayInfo> {
        self.delays
            .iter()
            .filter(|(_, d)| d.running.is_some())
            .filter_map(|(key, _)| self.lock_delay(key))
            .collect()
    }

    /// Keys held back by a running lock-delay now.
    pub fn lock_delays_running(&self) -> usize {
        self.running_delays
    }

    /// Whether a lock-delay keeps `key` from being granted now.
    pub(super) fn delay_running(&self, key: &str) -> bool {
        self.delays.get(key).is_some_and(|d| d.running.is_some())
    }

    pub(super) fn set_lock_delay(&mut self, key: &str, delay_ms: u64) -> Outcome {
        if self.cluster_version() < LOCK_DELAY_VERSION {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "lock-delay needs cluster version {LOCK_DELAY_VERSION} (this cluster runs {}): \
                     upgrade every member first",
                    self.cluster_version()
                ),
            );
        }
        if delay_ms > self.limits.ttl_ms_max {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "lock-delay is limited to the longest ttl, {} ms",
                    self.limits.ttl_ms_max
                ),
            );
        }
        match self.delays.get_mut(key) {
            Some(d) => {
                if delay_ms == 0 && d.running.is_none() {
                    self.delays.remove(key);
                } else {
                    d.delay_ms = delay_ms;
                }
            }
            None if delay_ms == 0 => {}
            None => {
                if self.delays.len() >= self.limits.locks_held_max {
                    return Outcome::rejected(
                        RejectCode::LimitReached,
                        format!(
                            "{} keys already have a lock-delay",
                            self.limits.locks_held_max
                        ),
                    );
                }
                self.delays.insert(
                    Box::from(key),
                    LockDelay {
                        delay_ms,
                        running: None,
                    },
                );
            }
        }
        self.mark_dirty(DELAY_PREFIX, key);
        Outcome::LockDelaySet { delay_ms }
    }

    /// Called as the holder with `token` loses `key` to an expiry: starts the key's delay, if
    /// it has one, before the lock is vacated (which then grants no one).
    pub(super) fn start_lock_delay(&mut self, key: &str, token: u64, events: &mut Vec<Event>) {
        let Some(d) = self.delays.get_mut(key).filter(|d| d.delay_ms > 0) else {
            return;
        };
        let delay_ms = d.delay_ms;
        if d.running.is_none() {
            self.running_delays += 1;
        }
        d.running = Some(RunningDelay { token, delay_ms });
        self.mark_dirty(DELAY_PREFIX, key);
        events.push(Event::LockDelayStarted {
            key: key.to_string(),
            token,
            delay_ms,
        });
    }

    /// `EndLockDelay`: the leader measured the delay that started when `token` expired; the
    /// next waiter, if any, is granted in the same apply.
    pub(super) fn end_lock_delay(
        &mut self,
        key: &str,
        token: u64,
        events: &mut Vec<Event>,
    ) -> Outcome {
        if self.cluster_version() < LOCK_DELAY_VERSION {
            return Outcome::rejected(RejectCode::InvalidRequest, "needs cluster version 6");
        }
        let Some(d) = self.delays.get_mut(key) else {
            return Outcome::StaleToken { current: None };
        };
        match &d.running {
            Some(r) if r.token == token => {}
            Some(r) => {
                return Outcome::StaleToken {
                    current: Some(r.token),
                }
            }
            None => return Outcome::StaleToken { current: None },
        }
        d.running = None;
        self.running_delays = self.running_delays.saturating_sub(1);
        if d.delay_ms == 0 {
            self.delays.remove(key);
        }
        self.mark_dirty(DELAY_PREFIX, key);
        events.push(Event::LockDelayEnded {
            key: key.to_string(),
            token,
        });
        // The key has no holder while a delay runs: hand it to the first waiter (the waiters
        // that fit, on a shared lock).
        if self.is_shared(key) {
            self.grant_shared(key, events);
            self.mark_shared(key);
        } else {
            self.vacate(key, events);
        }
        Outcome::LockDelayEnded
    }
}
