//! Loading the machine from stored or snapshot pairs: [`StateLoader`] (a few pairs at a time,
//! any order, every stored layout) and [`LockStateMachine::from_kv`], then checked as a whole.

use std::sync::Arc;

use super::super::command::{decode_plain, DecodeError};
use super::super::limits::Limits;
use super::lock_entry::{LockEntry, LockEntryV1};
use super::records::{DedupeRecord, DedupeRecordV1, DedupeRecordV2};
use super::{
    LockStateMachine, DATA_PREFIX, DEDUPE_BLOCK, DELAY_PREFIX, ELECTION_PREFIX, LOCK_PREFIX,
    META_ACK_PREFIX, META_APPLIED, META_CLOCK, META_CLUSTER, META_CLUSTER_VERSION,
    META_DEDUPE_BLOCK_PREFIX, META_DEDUPE_NEXT, META_DEDUPE_PREFIX, META_LIMITS, META_MEMBERS,
    META_QUOTAS, META_SEQ, SESSION_PREFIX, SHARED_PREFIX,
};

impl LockStateMachine {
    /// Rebuilds the state from the full set of persisted pairs (any order).
    pub fn from_kv<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, DecodeError> {
        Self::from_kv_with_limits(pairs, Limits::default())
    }

    /// [`LockStateMachine::from_kv`] with these limits. The pairs may be borrowed (a snapshot
    /// read in place): only what the state keeps is copied.
    pub fn from_kv_with_limits<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        pairs: impl IntoIterator<Item = (K, V)>,
        limits: Limits,
    ) -> Result<Self, DecodeError> {
        let mut loader = StateLoader::new(limits);
        for (key, value) in pairs {
            loader.add(key.as_ref(), value.as_ref())?;
        }
        loader.finish()
    }

    /// Adds record `n` read from stored state; a number seen twice is damaged state.
    fn add_loaded_record(&mut self, n: u64, mut rec: DedupeRecord) -> Result<(), DecodeError> {
        if self.dedupe.contains_key(&n) {
            return Err(DecodeError::InvalidState(format!(
                "dedupe record {n} stored twice"
            )));
        }
        self.add_to_session(n, &mut rec);
        self.dedupe.insert(n, Box::new(rec));
        Ok(())
    }
}

/// Builds a [`LockStateMachine`] from stored or snapshot pairs a few at a time, so that a large
/// state can be loaded in slices between other work (a snapshot install on the Raft thread).
/// [`LockStateMachine::from_kv_with_limits`] is one of these fed every pair at once.
#[derive(Debug)]
pub struct StateLoader {
    sm: LockStateMachine,
}

impl StateLoader {
    pub fn new(limits: Limits) -> Self {
        StateLoader {
            sm: LockStateMachine::new(limits),
        }
    }

    /// Adds one pair. An error means the pairs are damaged; the loader should be dropped.
    pub fn add(&mut self, key: &[u8], value: &[u8]) -> Result<(), DecodeError> {
        let sm = &mut self.sm;
        let key = std::str::from_utf8(key)
            .map_err(|_| DecodeError::InvalidState("state key is not UTF-8".into()))?;
        if let Some(k) = key.strip_prefix(LOCK_PREFIX) {
            let entry: LockEntry = match decode_plain(value) {
                Ok(entry) => entry,
                // Written before holders recorded their lease index.
                Err(err) => decode_plain::<LockEntryV1>(value)
                    .map(LockEntry::from)
                    .map_err(|_| err)?,
            };
            sm.locks_held += usize::from(entry.holder.is_some());
            sm.waiters += entry.waiters.len();
            sm.locks.insert(Box::from(k), Box::new(entry));
        } else if let Some(k) = key.strip_prefix(DATA_PREFIX) {
            sm.data.insert(k.to_string(), value.to_vec());
        } else if let Some(k) = key.strip_prefix(DELAY_PREFIX) {
            let delay: super::delays::LockDelay = decode_plain(value)?;
            sm.running_delays += usize::from(delay.running.is_some());
            if let Some(old) = sm.delays.insert(Box::from(k), delay) {
                sm.running_delays -= usize::from(old.running.is_some());
            }
        } else if let Some(k) = key.strip_prefix(ELECTION_PREFIX) {
            let election: super::elections::Election = decode_plain(value)?;
            sm.elections.insert(Box::from(k), election);
        } else if let Some(k) = key.strip_prefix(SHARED_PREFIX) {
            let entry: super::shared::SharedEntry = decode_plain(value)?;
            sm.locks_held += entry.holders.len();
            sm.waiters += entry.waiters.len();
            sm.shared.insert(Box::from(k), entry);
        } else if let Some(client) = key.strip_prefix(SESSION_PREFIX) {
            let lease: super::session_leases::SessionLease = decode_plain(value)?;
            sm.session_leases.insert(Box::from(client), lease);
        } else if let Some(b) = key.strip_prefix(META_DEDUPE_BLOCK_PREFIX) {
            let b: u64 = b
                .parse()
                .map_err(|_| DecodeError::InvalidState(format!("bad dedupe key {key}")))?;
            let records: Vec<(u64, DedupeRecord)> = decode_plain(value)?;
            if records.is_empty() {
                return Err(DecodeError::InvalidState(format!("empty block {key}")));
            }
            for (n, rec) in records {
                if n / DEDUPE_BLOCK != b {
                    return Err(DecodeError::InvalidState(format!(
                        "dedupe record {n} stored in block {key}"
                    )));
                }
                sm.add_loaded_record(n, rec)?;
            }
        } else if let Some(client) = key.strip_prefix(META_ACK_PREFIX) {
            let (mark, at_ms): (u64, u64) = decode_plain(value)?;
            if mark == 0 {
                return Err(DecodeError::InvalidState(format!("{key} holds no mark")));
            }
            let session = sm.sessions.entry(Arc::from(client)).or_default();
            session.mark = mark;
            session.mark_at_ms = at_ms;
        } else if let Some(n) = key.strip_prefix(META_DEDUPE_PREFIX) {
            let n: u64 = n
                .parse()
                .map_err(|_| DecodeError::InvalidState(format!("bad dedupe key {key}")))?;
            let rec: DedupeRecord = match decode_plain(value) {
                Ok(rec) => rec,
                Err(err) => decode_plain::<DedupeRecordV2>(value)
                    .map(|old| {
                        DedupeRecord::new(
                            old.client_id.into(),
                            &old.request_id,
                            old.outcome,
                            old.op.as_ref().map(|(kind, key)| (*kind, key.as_str())),
                            0,
                        )
                    })
                    .or_else(|_| {
                        decode_plain::<DedupeRecordV1>(value).map(|old| {
                            DedupeRecord::new(
                                old.client_id.into(),
                                &old.request_id,
                                old.outcome,
                                None,
                                0,
                            )
                        })
                    })
                    .map_err(|_| err)?,
            };
            sm.add_loaded_record(n, rec)?;
            sm.legacy_dedupe_keys.insert(n);
        } else {
            match key {
                META_SEQ => sm.fencing_seq = u64_of(value, "meta/seq")?,
                META_APPLIED => sm.applied_index = u64_of(value, "meta/applied")?,
                META_DEDUPE_NEXT => sm.dedupe_next = u64_of(value, "meta/dedupe_next")?,
                META_CLOCK => sm.clock_ms = u64_of(value, "meta/clock")?,
                META_CLUSTER_VERSION => {
                    let bytes: [u8; 4] = value.try_into().map_err(|_| {
                        DecodeError::InvalidState("meta/cluster_version is not 4 bytes".into())
                    })?;
                    sm.cluster_version = u32::from_be_bytes(bytes);
                }
                META_CLUSTER => sm.cluster = Some(decode_plain(value)?),
                META_MEMBERS => sm.members = decode_plain(value)?,
                META_QUOTAS => sm.quotas = Some(decode_plain(value)?),
                META_LIMITS => {
                    sm.limits = match decode_plain(value) {
                        Ok(limits) => limits,
                        // Written before client sessions existed.
                        Err(err) => decode_plain::<crate::lock::limits::LimitsV1>(value)
                            .map(Limits::from)
                            .map_err(|_| err)?,
                    };
                    sm.limits_replicated = true;
                }
                other => {
                    return Err(DecodeError::InvalidState(format!(
                        "unknown state key {other}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// The state the pairs describe, checked as a whole.
    pub fn finish(self) -> Result<LockStateMachine, DecodeError> {
        let mut sm = self.sm;
        sm.recount();
        sm.rebuild_attachments();
        if let Some(client) = sm
            .attached
            .keys()
            .find(|c| !sm.session_leases.contains_key(*c))
        {
            return Err(DecodeError::InvalidState(format!(
                "client {client:?} has locks attached to a session it does not have"
            )));
        }
        let max_token = sm
            .locks
            .values()
            .filter_map(|e| e.holder.as_ref())
            .map(|h| h.token)
            .chain(
                sm.shared
                    .values()
                    .flat_map(|e| e.holders.iter().map(|h| h.token)),
            )
            .max();
        if let Some(key) = sm.shared.keys().find(|k| sm.locks.contains_key(&***k)) {
            return Err(DecodeError::InvalidState(format!(
                "{key:?} is both an exclusive and a shared lock"
            )));
        }
        if max_token.is_some_and(|t| t > sm.fencing_seq) {
            return Err(DecodeError::InvalidState(
                "a held token is above the fencing sequence".into(),
            ));
        }
        if let Some(key) = sm.elections.keys().find(|k| !sm.locks.contains_key(&***k)) {
            return Err(DecodeError::InvalidState(format!(
                "election {key:?} has no lock entry"
            )));
        }
        Ok(sm)
    }
}

fn u64_of(v: &[u8], what: &str) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = v
        .try_into()
        .map_err(|_| DecodeError::InvalidState(format!("{what} is not 8 bytes")))?;
    Ok(u64::from_be_bytes(bytes))
}
