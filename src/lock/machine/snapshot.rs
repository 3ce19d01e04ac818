//! Snapshot encoding of the machine: the whole state as key-value pairs in key order (one key
//! per dedupe record, the layout every RaftLock version reads), as one versioned blob, and
//! [`StoredToSnapshot`], which turns stored pairs (dedupe blocks) into snapshot pairs as read.

use std::collections::{BTreeMap, VecDeque};

use super::super::command::{decode_plain, encode_plain, DecodeError};
use super::super::limits::Limits;
use super::changes::dedupe_key;
use super::records::DedupeRecord;
use super::{
    LockStateMachine, DATA_PREFIX, DEDUPE_BLOCK, DELAY_PREFIX, ELECTION_PREFIX, LOCK_PREFIX,
    META_ACK_PREFIX, META_APPLIED, META_CLOCK, META_CLUSTER, META_CLUSTER_VERSION,
    META_DEDUPE_BLOCK_PREFIX, META_DEDUPE_NEXT, META_DEDUPE_PREFIX, META_LIMITS, META_MEMBERS,
    META_QUOTAS, META_SEQ, SESSION_PREFIX, SHARED_PREFIX,
};

const SNAPSHOT_VERSION: u8 = 1;

impl LockStateMachine {
    /// The full state as key-value pairs in key order.
    pub fn to_kv(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut keys: Vec<String> = Vec::new();
        keys.extend(self.locks.keys().map(|k| format!("{LOCK_PREFIX}{k}")));
        keys.extend(self.data.keys().map(|k| format!("{DATA_PREFIX}{k}")));
        keys.extend(self.delays.keys().map(|k| format!("{DELAY_PREFIX}{k}")));
        keys.extend(
            self.elections
                .keys()
                .map(|k| format!("{ELECTION_PREFIX}{k}")),
        );
        keys.extend(
            self.session_leases
                .keys()
                .map(|k| format!("{SESSION_PREFIX}{k}")),
        );
        keys.extend(self.shared.keys().map(|k| format!("{SHARED_PREFIX}{k}")));
        keys.extend(self.dedupe.keys().map(|&n| dedupe_key(n)));
        keys.extend(
            self.sessions
                .iter()
                .filter(|(_, s)| s.mark > 0)
                .map(|(client, _)| format!("{META_ACK_PREFIX}{client}")),
        );
        keys.extend(
            [
                META_SEQ,
                META_APPLIED,
                META_DEDUPE_NEXT,
                META_LIMITS,
                META_CLOCK,
                META_CLUSTER_VERSION,
                META_CLUSTER,
                META_MEMBERS,
                META_QUOTAS,
            ]
            .map(String::from),
        );
        keys.sort();
        keys.into_iter()
            .filter_map(|k| self.value_of(&k).map(|v| (k.into_bytes(), v)))
            .collect()
    }

    /// The whole state as one deterministic blob: byte-identical for identical state.
    pub fn snapshot(&self) -> Vec<u8> {
        super::super::command::encode_versioned(SNAPSHOT_VERSION, &self.to_kv())
    }

    pub fn restore(bytes: &[u8], limits: Limits) -> Result<Self, DecodeError> {
        let pairs: Vec<(Vec<u8>, Vec<u8>)> =
            super::super::command::decode_versioned(SNAPSHOT_VERSION, bytes)?;
        Self::from_kv_with_limits(pairs, limits)
    }
}

/// Key-value pairs of the state.
pub type StatePairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Stored state pairs (as `take_changes` wrote them, any order) as a snapshot carries them: the
/// dedupe blocks opened into one key per record, in key order. Snapshots keep the one layout
/// every RaftLock version reads, so nodes of different versions can send each other snapshots.
pub fn stored_to_snapshot_pairs(mut pairs: StatePairs) -> Result<StatePairs, DecodeError> {
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    StoredToSnapshot::new(pairs.into_iter().map(Ok), |e| e).collect()
}

/// [`stored_to_snapshot_pairs`] one pair at a time, over stored pairs read in key order (as
/// storage reads them for a snapshot): the snapshot of a large state is encoded as it is read,
/// without a copy of the whole state on the way. A block's records come out as they are
/// opened; one-record keys (a store that is still moving to blocks) are held back until the
/// records and keys that sort before them are out. A pair out of key order is an error.
pub struct StoredToSnapshot<I, E> {
    stored: I,
    error: fn(DecodeError) -> E,
    /// One-record keys read and not yet handed out, by key.
    legacy: BTreeMap<Vec<u8>, Vec<u8>>,
    ready: VecDeque<(Vec<u8>, Vec<u8>)>,
    last: Option<Vec<u8>>,
    done: bool,
}

impl<I, E> StoredToSnapshot<I, E>
where
    I: Iterator<Item = Result<(Vec<u8>, Vec<u8>), E>>,
{
    /// `error` turns a decoding problem into the stored pairs' error type.
    pub fn new(stored: I, error: fn(DecodeError) -> E) -> Self {
        StoredToSnapshot {
            stored,
            error,
            legacy: BTreeMap::new(),
            ready: VecDeque::new(),
            last: None,
            done: false,
        }
    }

    /// Queues the held-back one-record keys that sort before `key` (all of them for `None`).
    fn release_legacy(&mut self, key: Option<&[u8]>) {
        while let Some(entry) = self.legacy.first_entry() {
            if key.is_some_and(|k| entry.key().as_slice() >= k) {
                break;
            }
            let (k, v) = entry.remove_entry();
            self.ready.push_back((k, v));
        }
    }

    /// Takes in one stored pair.
    fn take(&mut self, key: Vec<u8>, value: Vec<u8>) -> Result<(), DecodeError> {
        if key.starts_with(META_DEDUPE_PREFIX.as_bytes()) {
            self.legacy.insert(key, value);
            return Ok(());
        }
        let Some(b) = key.strip_prefix(META_DEDUPE_BLOCK_PREFIX.as_bytes()) else {
            self.release_legacy(Some(&key));
            self.ready.push_back((key, value));
            return Ok(());
        };
        let b: u64 = std::str::from_utf8(b)
            .ok()
            .and_then(|b| b.parse().ok())
            .ok_or_else(|| DecodeError::InvalidState("bad dedupe block key".into()))?;
        let records: Vec<(u64, DedupeRecord)> = decode_plain(&value)?;
        for (n, rec) in records {
            if n / DEDUPE_BLOCK != b {
                return Err(DecodeError::InvalidState(format!(
                    "dedupe record {n} stored in block {b}"
                )));
            }
            let key = dedupe_key(n).into_bytes();
            self.release_legacy(Some(&key));
            self.ready.push_back((key, encode_plain(&rec)));
        }
        Ok(())
    }
}

impl<I, E> Iterator for StoredToSnapshot<I, E>
where
    I: Iterator<Item = Result<(Vec<u8>, Vec<u8>), E>>,
{
    type Item = Result<(Vec<u8>, Vec<u8>), E>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some((key, value)) = self.ready.pop_front() {
                if self.last.as_ref().is_some_and(|last| *last >= key) {
                    self.done = true;
                    self.ready.clear();
                    return Some(Err((self.error)(DecodeError::InvalidState(format!(
                        "state key {} out of order",
                        String::from_utf8_lossy(&key)
                    )))));
                }
                self.last = Some(key.clone());
                return Some(Ok((key, value)));
            }
            if self.done {
                return None;
            }
            match self.stored.next() {
                None => {
                    self.done = true;
                    self.release_legacy(None);
                }
                Some(Err(err)) => {
                    self.done = true;
                    return Some(Err(err));
                }
                Some(Ok((key, value))) => {
                    if let Err(err) = self.take(key, value) {
                        self.done = true;
                        self.ready.clear();
                        return Some(Err((self.error)(err)));
                    }
                }
            }
        }
    }
}
