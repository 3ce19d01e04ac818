//! The replicated key-value store (`data/<key>`): reads, and puts and deletes, optionally
//! guarded by a fencing token that must still hold its lock.

use super::super::command::FencingToken;
use super::super::outcome::Outcome;
use super::quotas::{data_cost, limit_refusal};
use super::{LockStateMachine, DATA_PREFIX};

impl LockStateMachine {
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.data.get(key).map(Vec::as_slice)
    }

    fn guard_holds(&self, guard: Option<&FencingToken>) -> Result<(), Outcome> {
        let Some(guard) = guard else { return Ok(()) };
        // A shared lock's writer or permit holder may write; a reader may not.
        if let Some(writes) = self.shared_guard(&guard.key, guard.value) {
            return if writes {
                Ok(())
            } else {
                Err(Outcome::GuardRejected { current: None })
            };
        }
        let current = self
            .locks
            .get(guard.key.as_str())
            .and_then(|e| e.holder.as_ref())
            .map(|h| h.token);
        if current == Some(guard.value) {
            Ok(())
        } else {
            Err(Outcome::GuardRejected { current })
        }
    }

    pub(super) fn put(&mut self, key: &str, value: &[u8], guard: Option<&FencingToken>) -> Outcome {
        if let Err(refusal) = self.guard_holds(guard) {
            return refusal;
        }
        if !self.data.contains_key(key) && self.data.len() >= self.limits.data_entries_max {
            return limit_refusal("data_entries", "too many data keys".into());
        }
        let total = match self.data_bytes_after_put(key, value) {
            Ok(total) => total,
            Err(refusal) => return refusal,
        };
        self.data_bytes = total;
        self.data.insert(key.to_string(), value.to_vec());
        self.mark_dirty(DATA_PREFIX, key);
        Outcome::Stored
    }

    pub(super) fn delete(&mut self, key: &str, guard: Option<&FencingToken>) -> Outcome {
        if let Err(refusal) = self.guard_holds(guard) {
            return refusal;
        }
        let removed = self.data.remove(key);
        let existed = removed.is_some();
        if let Some(value) = removed {
            self.data_bytes = self.data_bytes.saturating_sub(data_cost(key, &value));
            self.mark_dirty(DATA_PREFIX, key);
        }
        Outcome::Deleted { existed }
    }
}
