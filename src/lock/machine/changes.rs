//! What apply writes to the node's own storage: marking state keys changed, reading a key's
//! current value, and [`LockStateMachine::take_changes`], which writes dedupe records in blocks
//! and moves one-key-per-record storage to blocks a few at a time.

use super::super::command::encode_plain;
use super::records::DedupeRecord;
use super::{
    LockStateMachine, DATA_PREFIX, DEDUPE_BLOCK, DELAY_PREFIX, DIRTY_META_KEYS, ELECTION_PREFIX,
    LEGACY_BLOCKS_PER_WRITE, LOCK_PREFIX, META_ACK_PREFIX, META_APPLIED, META_CLOCK, META_CLUSTER,
    META_CLUSTER_VERSION, META_DEDUPE_BLOCK_PREFIX, META_DEDUPE_NEXT, META_DEDUPE_PREFIX,
    META_LIMITS, META_MEMBERS, META_QUOTAS, META_SEQ, SESSION_PREFIX, SHARED_PREFIX,
};

impl LockStateMachine {
    /// Marks the state key `prefix` + `key` changed. A key already marked (a lock acquired and
    /// released within one applied-state write) costs a lookup, not a new string; a new one is
    /// built without the formatting machinery (`format!` was about 0.6% of the leader's driver
    /// thread at 32 clients).
    pub(super) fn mark_dirty(&mut self, prefix: &str, key: &str) {
        let mut full = std::mem::take(&mut self.dirty_scratch);
        full.clear();
        full.push_str(prefix);
        full.push_str(key);
        if !self.dirty.contains(full.as_str()) {
            self.dirty.insert(full.as_str().to_owned());
        }
        self.dirty_scratch = full;
    }

    /// The value stored under a state key now, or None if it is absent.
    pub(super) fn value_of(&self, key: &str) -> Option<Vec<u8>> {
        if let Some(k) = key.strip_prefix(LOCK_PREFIX) {
            return self.locks.get(k).map(|entry| encode_plain(&**entry));
        }
        if let Some(k) = key.strip_prefix(DATA_PREFIX) {
            return self.data.get(k).cloned();
        }
        if let Some(k) = key.strip_prefix(DELAY_PREFIX) {
            return self.delays.get(k).map(encode_plain);
        }
        if let Some(k) = key.strip_prefix(ELECTION_PREFIX) {
            return self.elections.get(k).map(encode_plain);
        }
        if let Some(client) = key.strip_prefix(SESSION_PREFIX) {
            return self.session_leases.get(client).map(encode_plain);
        }
        if let Some(k) = key.strip_prefix(SHARED_PREFIX) {
            return self.shared.get(k).map(encode_plain);
        }
        if let Some(n) = key.strip_prefix(META_DEDUPE_PREFIX) {
            let n: u64 = n.parse().ok()?;
            return self.dedupe.get(&n).map(encode_plain);
        }
        if let Some(client) = key.strip_prefix(META_ACK_PREFIX) {
            let session = self.sessions.get(client).filter(|s| s.mark > 0)?;
            return Some(encode_plain(&(session.mark, session.mark_at_ms)));
        }
        match key {
            META_SEQ => Some(self.fencing_seq.to_be_bytes().to_vec()),
            META_APPLIED => Some(self.applied_index.to_be_bytes().to_vec()),
            META_DEDUPE_NEXT => Some(self.dedupe_next.to_be_bytes().to_vec()),
            META_CLOCK => (self.clock_ms > 0).then(|| self.clock_ms.to_be_bytes().to_vec()),
            META_CLUSTER_VERSION => {
                (self.cluster_version() > 1).then(|| self.cluster_version.to_be_bytes().to_vec())
            }
            META_LIMITS => self.limits_replicated.then(|| encode_plain(&self.limits)),
            META_CLUSTER => self.cluster.as_ref().map(encode_plain),
            META_MEMBERS => (!self.members.is_empty()).then(|| encode_plain(&self.members)),
            META_QUOTAS => self.quotas.as_ref().map(encode_plain),
            _ => None,
        }
    }

    /// State keys changed since the last [`LockStateMachine::take_changes`]: what it would
    /// return, besides the few legacy exactly-once keys it moves into blocks per call. Applying
    /// only marks keys; their values are read and encoded by `take_changes`.
    pub fn pending_changes(&self) -> usize {
        self.dirty.len()
            + self.dirty_meta.count_ones() as usize
            + self.dirty_blocks.len()
            + self.dirty_acks.len()
    }

    /// State writes since the last call: `(key, Some(value))` puts, `(key, None)` deletes.
    ///
    /// Dedupe records come as blocks (`meta/dedupe_block/<b>`, deleted when empty). Writing a
    /// block deletes the one-record keys of its records where `from_kv` found them, in the same
    /// changes, so a record is never stored twice; besides the blocks that changed, up to
    /// `LEGACY_BLOCKS_PER_WRITE` blocks still stored one key per record move each time.
    pub fn take_changes(&mut self) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let mut blocks = std::mem::take(&mut self.dirty_blocks);
        // The blocks of the lowest one-record keys, besides those that changed.
        let (mut moved, mut from) = (0, 0);
        while moved < LEGACY_BLOCKS_PER_WRITE {
            let Some(&n) = self.legacy_dedupe_keys.range(from..).next() else {
                break;
            };
            let b = n / DEDUPE_BLOCK;
            moved += usize::from(blocks.insert(b));
            from = b.saturating_add(1).saturating_mul(DEDUPE_BLOCK);
        }
        let mut changes: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
        for b in blocks {
            let first = b.saturating_mul(DEDUPE_BLOCK);
            let range = first..first.saturating_add(DEDUPE_BLOCK);
            let old: Vec<u64> = self
                .legacy_dedupe_keys
                .range(range.clone())
                .copied()
                .collect();
            for n in old {
                self.legacy_dedupe_keys.remove(&n);
                changes.push((dedupe_key(n).into_bytes(), None));
            }
            let records: Vec<(u64, &DedupeRecord)> =
                self.dedupe.range(range).map(|(&n, r)| (n, &**r)).collect();
            let value = (!records.is_empty()).then(|| encode_plain(&records));
            changes.push((dedupe_block_key(b).into_bytes(), value));
        }
        let mut dirty = std::mem::take(&mut self.dirty);
        for client in std::mem::take(&mut self.dirty_acks) {
            dirty.insert(format!("{META_ACK_PREFIX}{client}"));
        }
        for (bit, key) in DIRTY_META_KEYS {
            if self.dirty_meta & bit != 0 {
                dirty.insert(key.to_string());
            }
        }
        self.dirty_meta = 0;
        changes.extend(
            dirty
                .into_iter()
                .map(|k| (k.clone().into_bytes(), self.value_of(&k))),
        );
        changes
    }
}

/// The key of one dedupe record as snapshots carry it (and as storage held it before blocks).
pub(super) fn dedupe_key(n: u64) -> String {
    // Zero-padded so key order is insertion order.
    format!("{META_DEDUPE_PREFIX}{n:020}")
}

/// The key of the block holding records `b * DEDUPE_BLOCK ..` (zero-padded: key order is
/// insertion order).
pub(super) fn dedupe_block_key(b: u64) -> String {
    format!("{META_DEDUPE_BLOCK_PREFIX}{b:020}")
}
