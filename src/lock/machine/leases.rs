//! Leases: renewing a held lock's TTL (restarting its lease at the applied index) and the
//! leader-proposed expiry of a lease that ran out (`Expire` / `ExpireLease`).

use super::super::command::FencingToken;
use super::super::outcome::{Event, Outcome};
use super::LockStateMachine;

impl LockStateMachine {
    /// A holder's lease ran out (its own, or its session's): the `Expired` event, and the
    /// key's lock-delay starts.
    pub(super) fn report_expiry(
        &mut self,
        key: &str,
        client_id: &str,
        token: u64,
        events: &mut Vec<Event>,
    ) {
        events.push(Event::Expired {
            client_id: client_id.to_string(),
            token: FencingToken {
                key: key.to_string(),
                value: token,
            },
        });
        self.start_lock_delay(key, token, events);
    }

    pub(super) fn renew(&mut self, key: &str, client_id: &str, token: u64, ttl_ms: u64) -> Outcome {
        if let Err(refusal) = self.check_holder(key, client_id, token) {
            return refusal;
        }
        let index = self.applied_index;
        if let Some(holder) = self.locks.get_mut(key).and_then(|e| e.holder.as_mut()) {
            holder.ttl_ms = ttl_ms;
            holder.lease_index = index;
        }
        self.mark_lock(key);
        Outcome::Renewed {
            token: FencingToken {
                key: key.to_string(),
                value: token,
            },
            ttl_ms,
        }
    }

    pub(super) fn expire(
        &mut self,
        key: &str,
        token: u64,
        lease_index: Option<u64>,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let holder = self.locks.get(key).and_then(|e| e.holder.clone());
        match holder {
            // A renew attached the lock to its client's session after the leader proposed this
            // expiry: the session's lease is the lock's now, and only the session's expiry ends it.
            Some(h) if h.token == token && h.ttl_ms == 0 => Outcome::LeaseRenewed {
                lease_index: h.lease_index,
            },
            // A renew restarted the lease after the leader proposed this expiry.
            Some(h) if h.token == token && lease_index.is_some_and(|i| i != h.lease_index) => {
                Outcome::LeaseRenewed {
                    lease_index: h.lease_index,
                }
            }
            Some(h) if h.token == token => {
                self.report_expiry(key, &h.client_id, token, events);
                self.vacate(key, events);
                Outcome::Expired {
                    client_id: h.client_id.into(),
                }
            }
            Some(h) => Outcome::StaleToken {
                current: Some(h.token),
            },
            None => Outcome::StaleToken { current: None },
        }
    }
}
