//! Byte encodings of everything storage writes: log entries, hard state, snapshot point,
//! membership and snapshot data.
//!
//! Used by the sled implementation on the way to and from disk, and by both implementations for
//! `Snapshot::data`. Every record carries a CRC-32 over its body, checked on every read, so a
//! flipped bit is reported as corruption instead of becoming a wrong term or a wrong command.
//! Decoding never panics: short or malformed input is a [`DecodeError`].
//!
//! ```text
//!   record   = crc32 (u32 BE, over body) ‖ body
//!   state    = record whose body is the applied-state value (sled `state` tree)
//!   entry    = version 1 ‖ term u64 ‖ index u64 ‖ kind u8 ‖ payload
//!              (kind 3, the bootstrap configuration, carries a sealed membership record)
//!   run      = version 1 ‖ (record len u32 ‖ entry record)+
//!              (consecutive entries in one sled value, keyed by the first one's index)
//!   snapshot = "RLSNAP01" ‖ pair count u64 ‖ (key len u32 ‖ key ‖ value len u32 ‖ value)* ‖ crc32
//! ```
//! All integers are big-endian; log keys are the big-endian index so sled iterates in log order.
//! Each entry in a run keeps its own checksum, so damage names the entry's index.

use std::collections::BTreeSet;

use bytes::Bytes;

use super::{KvPair, StorageError};
use crate::raft::{Entry, EntryPayload, HardState, Index, Membership, MembershipChange, Term};

const ENTRY_VERSION: u8 = 1;
pub(crate) const RUN_VERSION: u8 = 1;
const KIND_NOOP: u8 = 0;
const KIND_COMMAND: u8 = 1;
const KIND_MEMBERSHIP: u8 = 2;
const KIND_CONFIG: u8 = 3;
const CHANGE_ADD_LEARNER: u8 = 0;
const CHANGE_PROMOTE_LEARNER: u8 = 1;
const CHANGE_REMOVE_SERVER: u8 = 2;
const SNAPSHOT_MAGIC: &[u8; 8] = b"RLSNAP01";

/// Why a record did not decode; the caller adds which tree and key it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeError {
    Checksum { stored_crc: u32, computed_crc: u32 },
    Malformed(String),
}

impl DecodeError {
    /// Turns this into a [`StorageError`] naming where the record was stored.
    pub(crate) fn at(self, tree: &'static str, key: String) -> StorageError {
        match self {
            DecodeError::Checksum {
                stored_crc,
                computed_crc,
            } => StorageError::Corrupt {
                tree,
                key,
                problem: format!(
                    "checksum mismatch (stored {stored_crc:#010x}, computed {computed_crc:#010x})"
                ),
            },
            DecodeError::Malformed(problem) => StorageError::Corrupt { tree, key, problem },
        }
    }

    /// Turns this into a [`StorageError`] for the log entry stored under `index`.
    pub(crate) fn at_log_index(self, index: Index) -> StorageError {
        match self {
            DecodeError::Checksum {
                stored_crc,
                computed_crc,
            } => StorageError::ChecksumMismatch {
                index,
                stored_crc,
                computed_crc,
            },
            DecodeError::Malformed(problem) => StorageError::Corrupt {
                tree: "log",
                key: index.to_string(),
                problem,
            },
        }
    }
}

/// A cursor over bytes that fails instead of panicking when input runs out.
#[derive(Debug, Clone)]
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.bytes.len() < len {
            return Err(DecodeError::Malformed(format!(
                "truncated: {what} needs {len} bytes, {} left",
                self.bytes.len()
            )));
        }
        let (head, tail) = self.bytes.split_at(len);
        self.bytes = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        let mut buf = [0u8; 4];
        buf.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_be_bytes(buf))
    }

    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        let mut buf = [0u8; 8];
        buf.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_be_bytes(buf))
    }

    fn finish(&self, what: &str) -> Result<(), DecodeError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Malformed(format!(
                "{} unexpected bytes after {what}",
                self.bytes.len()
            )))
        }
    }
}

/// Prepends the CRC-32 of `body`.
fn seal(body: Vec<u8>) -> Vec<u8> {
    let mut record = Vec::with_capacity(body.len() + 4);
    record.extend_from_slice(&crc32fast::hash(&body).to_be_bytes());
    record.extend_from_slice(&body);
    record
}

/// Checks the CRC-32 in front of a record and returns the body.
fn unseal(record: &[u8]) -> Result<&[u8], DecodeError> {
    let mut reader = Reader { bytes: record };
    let stored_crc = reader.u32("checksum")?;
    let body = reader.bytes;
    let computed_crc = crc32fast::hash(body);
    if stored_crc != computed_crc {
        return Err(DecodeError::Checksum {
            stored_crc,
            computed_crc,
        });
    }
    Ok(body)
}

/// Seals one value of the applied state so that damage to it is caught on read.
pub(crate) fn encode_state_value(value: &[u8]) -> Vec<u8> {
    seal(value.to_vec())
}

/// Checks and strips the checksum of one applied-state value.
pub(crate) fn decode_state_value(record: &[u8]) -> Result<&[u8], DecodeError> {
    unseal(record)
}

/// Names an applied-state key in an error: printable if it is text, escaped bytes otherwise.
pub(crate) fn state_key_name(key: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(key))
}

/// The sled key of log entry `index`: big-endian so byte order is index order.
pub(crate) fn index_key(index: Index) -> [u8; 8] {
    index.to_be_bytes()
}

/// Reads a log key back.
pub(crate) fn decode_index_key(key: &[u8]) -> Result<Index, DecodeError> {
    let mut reader = Reader { bytes: key };
    let index = reader.u64("log key")?;
    reader.finish("log key")?;
    Ok(index)
}

pub(crate) fn encode_entry(entry: &Entry) -> Vec<u8> {
    let mut body = Vec::with_capacity(entry.size_bytes() + 8);
    write_entry_body(&mut body, entry);
    seal(body)
}

/// Starts a log run (see the module docs): the value stored under its first entry's index.
pub(crate) fn begin_run(capacity: usize) -> Vec<u8> {
    let mut run = Vec::with_capacity(capacity);
    run.push(RUN_VERSION);
    run
}

/// Appends `entry` to `run`: the length of its record, then the record `encode_entry` makes,
/// written in place.
pub(crate) fn push_run_entry(run: &mut Vec<u8>, entry: &Entry) {
    let len_at = run.len();
    run.extend_from_slice(&[0; 8]);
    let body_at = run.len();
    write_entry_body(run, entry);
    let crc = crc32fast::hash(&run[body_at..]);
    let len = (run.len() - len_at - 4) as u32;
    run[len_at..len_at + 4].copy_from_slice(&len.to_be_bytes());
    run[len_at + 4..body_at].copy_from_slice(&crc.to_be_bytes());
}

/// Appends an entry record already encoded by `encode_entry` to `run`.
pub(crate) fn push_run_record(run: &mut Vec<u8>, record: &[u8]) {
    run.extend_from_slice(&(record.len() as u32).to_be_bytes());
    run.extend_from_slice(record);
}

/// The entry records of the run stored under `first`, with their indexes, in order. Checks the
/// run's framing only; each record is checked when it is decoded.
pub(crate) fn run_records(first: Index, run: &[u8]) -> Result<Vec<(Index, &[u8])>, StorageError> {
    run_records_inner(first, run).map_err(|error| error.at("log", format!("run at {first}")))
}

fn run_records_inner(first: Index, run: &[u8]) -> Result<Vec<(Index, &[u8])>, DecodeError> {
    let mut reader = Reader { bytes: run };
    let version = reader.u8("run version")?;
    if version != RUN_VERSION {
        return Err(DecodeError::Malformed(format!(
            "unknown log run version {version}"
        )));
    }
    let mut records = Vec::new();
    while !reader.bytes.is_empty() {
        let len = reader.u32("entry length")? as usize;
        let record = reader.take(len, "entry")?;
        let index = first
            .checked_add(records.len() as u64)
            .ok_or_else(|| DecodeError::Malformed("run runs past the last index".into()))?;
        records.push((index, record));
    }
    if records.is_empty() {
        return Err(DecodeError::Malformed("empty log run".into()));
    }
    Ok(records)
}

/// The index of the last entry in the run stored under `first`.
pub(crate) fn run_last_index(first: Index, run: &[u8]) -> Result<Index, StorageError> {
    let records = run_records(first, run)?;
    Ok(first + records.len() as u64 - 1)
}

fn write_entry_body(body: &mut Vec<u8>, entry: &Entry) {
    body.push(ENTRY_VERSION);
    body.extend_from_slice(&entry.term.to_be_bytes());
    body.extend_from_slice(&entry.index.to_be_bytes());
    match &entry.payload {
        EntryPayload::Noop => body.push(KIND_NOOP),
        EntryPayload::Command(data) => {
            body.push(KIND_COMMAND);
            body.extend_from_slice(data);
        }
        EntryPayload::Membership(change) => {
            body.push(KIND_MEMBERSHIP);
            let (kind, node) = match *change {
                MembershipChange::AddLearner(node) => (CHANGE_ADD_LEARNER, node),
                MembershipChange::PromoteLearner(node) => (CHANGE_PROMOTE_LEARNER, node),
                MembershipChange::RemoveServer(node) => (CHANGE_REMOVE_SERVER, node),
            };
            body.push(kind);
            body.extend_from_slice(&node.to_be_bytes());
        }
        EntryPayload::Config(membership) => {
            body.push(KIND_CONFIG);
            body.extend_from_slice(&encode_membership(membership));
        }
    }
}

/// Decodes a log entry and checks that it is the entry stored under `key_index`.
pub(crate) fn decode_entry(key_index: Index, record: &[u8]) -> Result<Entry, StorageError> {
    decode_entry_inner(key_index, record).map_err(|error| error.at_log_index(key_index))
}

fn decode_entry_inner(key_index: Index, record: &[u8]) -> Result<Entry, DecodeError> {
    let mut reader = Reader {
        bytes: unseal(record)?,
    };
    let version = reader.u8("version")?;
    if version != ENTRY_VERSION {
        return Err(DecodeError::Malformed(format!(
            "unknown entry version {version}"
        )));
    }
    let term = reader.u64("term")?;
    let index = reader.u64("index")?;
    if index != key_index {
        return Err(DecodeError::Malformed(format!("entry says index {index}")));
    }
    let payload = match reader.u8("payload kind")? {
        KIND_NOOP => {
            reader.finish("no-op entry")?;
            EntryPayload::Noop
        }
        KIND_COMMAND => EntryPayload::Command(Bytes::copy_from_slice(reader.bytes)),
        KIND_MEMBERSHIP => {
            let kind = reader.u8("membership change kind")?;
            let node = reader.u64("membership node id")?;
            reader.finish("membership entry")?;
            EntryPayload::Membership(match kind {
                CHANGE_ADD_LEARNER => MembershipChange::AddLearner(node),
                CHANGE_PROMOTE_LEARNER => MembershipChange::PromoteLearner(node),
                CHANGE_REMOVE_SERVER => MembershipChange::RemoveServer(node),
                other => {
                    return Err(DecodeError::Malformed(format!(
                        "unknown membership change kind {other}"
                    )))
                }
            })
        }
        KIND_CONFIG => EntryPayload::Config(decode_membership(reader.bytes)?),
        other => {
            return Err(DecodeError::Malformed(format!(
                "unknown payload kind {other}"
            )))
        }
    };
    Ok(Entry {
        term,
        index,
        payload,
    })
}

pub(crate) fn encode_hard_state(hard_state: &HardState) -> Vec<u8> {
    let mut body = Vec::with_capacity(24);
    body.extend_from_slice(&hard_state.term.to_be_bytes());
    body.extend_from_slice(&hard_state.vote.to_be_bytes());
    body.extend_from_slice(&hard_state.commit.to_be_bytes());
    seal(body)
}

pub(crate) fn decode_hard_state(record: &[u8]) -> Result<HardState, DecodeError> {
    let mut reader = Reader {
        bytes: unseal(record)?,
    };
    let hard_state = HardState {
        term: reader.u64("term")?,
        vote: reader.u64("vote")?,
        commit: reader.u64("commit")?,
    };
    reader.finish("hard state")?;
    Ok(hard_state)
}

/// Encodes an (index, term) pair: the snapshot point.
pub(crate) fn encode_index_term(index: Index, term: Term) -> Vec<u8> {
    let mut body = Vec::with_capacity(16);
    body.extend_from_slice(&index.to_be_bytes());
    body.extend_from_slice(&term.to_be_bytes());
    seal(body)
}

pub(crate) fn decode_index_term(record: &[u8]) -> Result<(Index, Term), DecodeError> {
    let mut reader = Reader {
        bytes: unseal(record)?,
    };
    let index = reader.u64("index")?;
    let term = reader.u64("term")?;
    reader.finish("snapshot point")?;
    Ok((index, term))
}

pub(crate) fn encode_u64(value: u64) -> Vec<u8> {
    seal(value.to_be_bytes().to_vec())
}

pub(crate) fn decode_u64(record: &[u8]) -> Result<u64, DecodeError> {
    let mut reader = Reader {
        bytes: unseal(record)?,
    };
    let value = reader.u64("value")?;
    reader.finish("value")?;
    Ok(value)
}

pub(crate) fn encode_membership(membership: &Membership) -> Vec<u8> {
    let mut body =
        Vec::with_capacity(16 + 8 * (membership.voters.len() + membership.learners.len()));
    for set in [&membership.voters, &membership.learners] {
        body.extend_from_slice(&(set.len() as u64).to_be_bytes());
        for node in set {
            body.extend_from_slice(&node.to_be_bytes());
        }
    }
    seal(body)
}

pub(crate) fn decode_membership(record: &[u8]) -> Result<Membership, DecodeError> {
    let mut reader = Reader {
        bytes: unseal(record)?,
    };
    let mut sets: [BTreeSet<u64>; 2] = Default::default();
    for (set, what) in sets.iter_mut().zip(["voters", "learners"]) {
        let count = reader.u64(what)?;
        // Bounded by the bytes present, so a damaged count cannot make us loop for long.
        if count > (reader.bytes.len() / 8) as u64 {
            return Err(DecodeError::Malformed(format!(
                "{what} count {count} exceeds the record"
            )));
        }
        for _ in 0..count {
            set.insert(reader.u64(what)?);
        }
    }
    reader.finish("membership")?;
    let [voters, learners] = sets;
    Ok(Membership { voters, learners })
}

/// Encodes applied state as [`crate::raft::Snapshot::data`].
pub fn encode_snapshot_data<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Bytes {
    let mut encoder = SnapshotEncoder::new();
    for (key, value) in pairs {
        encoder.push(key, value);
    }
    encoder.finish()
}

/// [`encode_snapshot_data`] of owned pairs produced one at a time (each is dropped once
/// encoded); the first error ends it.
pub fn encode_snapshot_stream<E>(
    pairs: impl IntoIterator<Item = Result<(Vec<u8>, Vec<u8>), E>>,
) -> Result<Bytes, E> {
    let mut encoder = SnapshotEncoder::new();
    for pair in pairs {
        let (key, value) = pair?;
        encoder.push(&key, &value);
    }
    Ok(encoder.finish())
}

/// Builds [`crate::raft::Snapshot::data`] one pair at a time.
struct SnapshotEncoder {
    data: Vec<u8>,
    count: u64,
}

impl SnapshotEncoder {
    fn new() -> Self {
        let mut data = Vec::new();
        data.extend_from_slice(SNAPSHOT_MAGIC);
        data.extend_from_slice(&0u64.to_be_bytes());
        SnapshotEncoder { data, count: 0 }
    }

    fn push(&mut self, key: &[u8], value: &[u8]) {
        push_chunk(&mut self.data, key);
        push_chunk(&mut self.data, value);
        self.count += 1;
    }

    fn finish(mut self) -> Bytes {
        self.data[8..16].copy_from_slice(&self.count.to_be_bytes());
        let crc = crc32fast::hash(&self.data);
        self.data.extend_from_slice(&crc.to_be_bytes());
        Bytes::from(self.data)
    }
}

fn push_chunk(data: &mut Vec<u8>, bytes: &[u8]) {
    // Keys and values are bounded far below 4 GiB by the state machine's limits.
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    data.extend_from_slice(&len.to_be_bytes());
    data.extend_from_slice(&bytes[..len as usize]);
}

/// Decodes [`crate::raft::Snapshot::data`] into key-value pairs, checking magic, checksum and
/// that keys are strictly increasing. Copies every pair: [`snapshot_pairs`] reads them in place.
pub fn decode_snapshot_data(data: &[u8]) -> Result<Vec<KvPair>, StorageError> {
    Ok(snapshot_pairs(data)?
        .map(|(key, value)| (key.to_vec(), value.to_vec()))
        .collect())
}

/// The key-value pairs of [`crate::raft::Snapshot::data`], borrowed from it in key order. The
/// whole snapshot is checked first (magic, checksum, lengths, keys strictly increasing), so a
/// caller that writes pairs as they come never stops halfway on bad data; checking allocates
/// nothing.
pub fn snapshot_pairs(data: &[u8]) -> Result<SnapshotPairs<'_>, StorageError> {
    check_snapshot(data).map_err(|error| StorageError::SnapshotData {
        problem: match error {
            DecodeError::Checksum {
                stored_crc,
                computed_crc,
            } => format!(
                "checksum mismatch (stored {stored_crc:#010x}, computed {computed_crc:#010x})"
            ),
            DecodeError::Malformed(problem) => problem,
        },
    })
}

/// Iterator over a checked snapshot's pairs; see [`snapshot_pairs`].
#[derive(Debug, Clone)]
pub struct SnapshotPairs<'a> {
    reader: Reader<'a>,
    left: u64,
}

impl<'a> SnapshotPairs<'a> {
    fn read_pair(&mut self) -> Result<(&'a [u8], &'a [u8]), DecodeError> {
        let key_len = self.reader.u32("key length")? as usize;
        let key = self.reader.take(key_len, "key")?;
        let value_len = self.reader.u32("value length")? as usize;
        let value = self.reader.take(value_len, "value")?;
        Ok((key, value))
    }
}

impl<'a> Iterator for SnapshotPairs<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // Checked by `check_snapshot`: an error cannot happen here, and would end the pairs.
        self.read_pair().ok()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::try_from(self.left).unwrap_or(usize::MAX);
        (left, Some(left))
    }
}

impl ExactSizeIterator for SnapshotPairs<'_> {}

/// A place in a checked snapshot's pairs that does not borrow the data, so that an install
/// writing the pairs a slice at a time can keep it between slices; see
/// [`SnapshotPairs::cursor`] and [`snapshot_pairs_from`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairsCursor {
    /// Bytes of the data before the next pair.
    consumed: usize,
    /// Pairs not read yet.
    left: u64,
}

impl PairsCursor {
    /// The first pair of `data`, bytes already checked (by [`snapshot_pairs`], or by a storage's
    /// install, which checks them before it writes anything): no second pass over them.
    /// Unchecked bytes give wrong pairs or none, never a panic.
    pub fn first(data: &[u8]) -> PairsCursor {
        let header = SNAPSHOT_MAGIC.len();
        let left = data
            .get(header..header + 8)
            .and_then(|count| count.try_into().ok())
            .map(u64::from_be_bytes)
            .unwrap_or(0);
        PairsCursor {
            consumed: header + 8,
            left,
        }
    }

    /// Pairs after this place.
    pub fn left(&self) -> u64 {
        self.left
    }
}

impl SnapshotPairs<'_> {
    /// Where these pairs stand in `data`, the bytes [`snapshot_pairs`] made them from.
    pub fn cursor(&self, data: &[u8]) -> PairsCursor {
        PairsCursor {
            consumed: data.len().saturating_sub(4 + self.reader.bytes.len()),
            left: self.left,
        }
    }
}

/// The pairs of `data` from `cursor` on. `data` must be the bytes [`snapshot_pairs`] checked
/// and the cursor one of theirs: other bytes give no pairs or wrong ones, never a panic.
pub fn snapshot_pairs_from(data: &[u8], cursor: PairsCursor) -> SnapshotPairs<'_> {
    let body = &data[..data.len().saturating_sub(4)];
    SnapshotPairs {
        reader: Reader {
            bytes: body.get(cursor.consumed..).unwrap_or(&[]),
        },
        left: cursor.left,
    }
}

fn check_snapshot(data: &[u8]) -> Result<SnapshotPairs<'_>, DecodeError> {
    if data.len() < SNAPSHOT_MAGIC.len() + 12 {
        return Err(DecodeError::Malformed(format!("only {} bytes", data.len())));
    }
    let (body, crc_bytes) = data.split_at(data.len() - 4);
    let mut crc_reader = Reader { bytes: crc_bytes };
    let stored_crc = crc_reader.u32("checksum")?;
    let computed_crc = crc32fast::hash(body);
    if stored_crc != computed_crc {
        return Err(DecodeError::Checksum {
            stored_crc,
            computed_crc,
        });
    }
    let mut reader = Reader { bytes: body };
    if reader.take(SNAPSHOT_MAGIC.len(), "magic")? != SNAPSHOT_MAGIC {
        return Err(DecodeError::Malformed(
            "not RaftLock snapshot data (bad magic)".to_string(),
        ));
    }
    let count = reader.u64("pair count")?;
    // Each pair takes at least 8 bytes, which bounds the loop.
    if count > (reader.bytes.len() / 8) as u64 {
        return Err(DecodeError::Malformed(format!(
            "pair count {count} exceeds the data"
        )));
    }
    let pairs = SnapshotPairs {
        reader,
        left: count,
    };
    let mut check = pairs.clone();
    let mut previous: Option<&[u8]> = None;
    for _ in 0..count {
        let (key, _) = check.read_pair()?;
        if previous.is_some_and(|previous| previous >= key) {
            return Err(DecodeError::Malformed(
                "keys are not strictly increasing".to_string(),
            ));
        }
        previous = Some(key);
    }
    check.reader.finish("snapshot pairs")?;
    Ok(pairs)
}

/// The record decoders and encoders above, public for the fuzz targets in `fuzz/` (not an API:
/// errors are their `Debug` text).
#[doc(hidden)]
pub mod fuzzing {
    use crate::raft::{Entry, HardState, Index, Membership, Term};
    use crate::storage::StorageError;

    fn text<T>(result: Result<T, super::DecodeError>) -> Result<T, String> {
        result.map_err(|error| format!("{error:?}"))
    }

    pub fn encode_entry(entry: &Entry) -> Vec<u8> {
        super::encode_entry(entry)
    }
    pub fn decode_entry(key_index: Index, record: &[u8]) -> Result<Entry, StorageError> {
        super::decode_entry(key_index, record)
    }
    /// Encodes `entries` (consecutive) as one log run.
    pub fn encode_run(entries: &[Entry]) -> Vec<u8> {
        let mut run = super::begin_run(64);
        for entry in entries {
            super::push_run_entry(&mut run, entry);
        }
        run
    }
    /// Decodes a log run stored under `first`, every entry checked.
    pub fn decode_run(first: Index, run: &[u8]) -> Result<Vec<Entry>, StorageError> {
        super::run_records(first, run)?
            .into_iter()
            .map(|(index, record)| super::decode_entry(index, record))
            .collect()
    }
    pub fn encode_hard_state(hard_state: &HardState) -> Vec<u8> {
        super::encode_hard_state(hard_state)
    }
    pub fn decode_hard_state(record: &[u8]) -> Result<HardState, String> {
        text(super::decode_hard_state(record))
    }
    pub fn encode_index_term(index: Index, term: Term) -> Vec<u8> {
        super::encode_index_term(index, term)
    }
    pub fn decode_index_term(record: &[u8]) -> Result<(Index, Term), String> {
        text(super::decode_index_term(record))
    }
    pub fn encode_u64(value: u64) -> Vec<u8> {
        super::encode_u64(value)
    }
    pub fn decode_u64(record: &[u8]) -> Result<u64, String> {
        text(super::decode_u64(record))
    }
    pub fn encode_membership(membership: &Membership) -> Vec<u8> {
        super::encode_membership(membership)
    }
    pub fn decode_membership(record: &[u8]) -> Result<Membership, String> {
        text(super::decode_membership(record))
    }
    pub fn encode_state_value(value: &[u8]) -> Vec<u8> {
        super::encode_state_value(value)
    }
    pub fn decode_state_value(record: &[u8]) -> Result<&[u8], String> {
        text(super::decode_state_value(record))
    }
    pub fn index_key(index: Index) -> [u8; 8] {
        super::index_key(index)
    }
    pub fn decode_index_key(key: &[u8]) -> Result<Index, String> {
        text(super::decode_index_key(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_entries() -> Vec<Entry> {
        vec![
            Entry {
                term: 1,
                index: 1,
                payload: EntryPayload::Noop,
            },
            Entry {
                term: 2,
                index: 2,
                payload: EntryPayload::Command(Bytes::from_static(b"x")),
            },
            Entry {
                term: 3,
                index: 3,
                payload: EntryPayload::Membership(MembershipChange::PromoteLearner(4)),
            },
        ]
    }

    #[test]
    fn entries_roundtrip_and_every_flipped_bit_is_caught() {
        for entry in sample_entries() {
            let record = encode_entry(&entry);
            assert_eq!(decode_entry(entry.index, &record).unwrap(), entry);
            for byte in 0..record.len() {
                for bit in 0..8 {
                    let mut damaged = record.clone();
                    damaged[byte] ^= 1 << bit;
                    assert!(
                        decode_entry(entry.index, &damaged).is_err(),
                        "byte {byte} bit {bit}"
                    );
                }
            }
            for len in 0..record.len() {
                assert!(decode_entry(entry.index, &record[..len]).is_err());
            }
            assert!(matches!(
                decode_entry(entry.index + 1, &record),
                Err(StorageError::Corrupt { tree: "log", .. })
            ));
        }
    }

    #[test]
    fn small_records_roundtrip() {
        let hard_state = HardState {
            term: 7,
            vote: 3,
            commit: 42,
        };
        assert_eq!(
            decode_hard_state(&encode_hard_state(&hard_state)),
            Ok(hard_state)
        );
        assert_eq!(decode_index_term(&encode_index_term(9, 4)), Ok((9, 4)));
        assert_eq!(decode_u64(&encode_u64(u64::MAX)), Ok(u64::MAX));
        let mut membership = Membership::with_voters([1, 2, 3]);
        membership.learners.insert(9);
        assert_eq!(
            decode_membership(&encode_membership(&membership)),
            Ok(membership)
        );
        assert!(decode_hard_state(&encode_u64(1)).is_err());
    }

    #[test]
    fn snapshot_data_roundtrips_and_rejects_damage() {
        let pairs: Vec<KvPair> = vec![
            (b"data/a".to_vec(), b"1".to_vec()),
            (b"lock/b".to_vec(), Vec::new()),
        ];
        let data = encode_snapshot_data(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
        assert_eq!(decode_snapshot_data(&data).unwrap(), pairs);
        let empty = encode_snapshot_data(std::iter::empty());
        assert!(decode_snapshot_data(&empty).unwrap().is_empty());
        let mut damaged = data.to_vec();
        damaged[20] ^= 0x10;
        assert!(matches!(
            decode_snapshot_data(&damaged),
            Err(StorageError::SnapshotData { .. })
        ));
        assert!(decode_snapshot_data(&data[..data.len() - 1]).is_err());
        assert!(decode_snapshot_data(b"").is_err());
    }

    /// Pairs read a slice at a time, resumed from a cursor each time, are all the pairs in
    /// order; a cursor at the end gives none.
    #[test]
    fn pairs_resumed_from_cursors_are_the_pairs() {
        let pairs: Vec<KvPair> = (0..100)
            .map(|i| (format!("lock/{i:03}").into_bytes(), vec![i as u8; i % 5]))
            .collect();
        let data = encode_snapshot_data(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
        for slice in [1, 3, 7, 100, 1000] {
            let mut cursor = snapshot_pairs(&data).unwrap().cursor(&data);
            assert_eq!(cursor, PairsCursor::first(&data));
            assert_eq!(cursor.left(), 100);
            let mut read = Vec::new();
            while cursor.left() > 0 {
                let mut resumed = snapshot_pairs_from(&data, cursor);
                for (k, v) in resumed.by_ref().take(slice) {
                    read.push((k.to_vec(), v.to_vec()));
                }
                cursor = resumed.cursor(&data);
            }
            assert_eq!(read, pairs, "slice {slice}");
            assert_eq!(snapshot_pairs_from(&data, cursor).count(), 0);
        }
    }

    /// Pairs read in place are the decoded pairs; a snapshot that is bad anywhere, even in its
    /// last pair, is refused before the first pair is handed out.
    #[test]
    fn snapshot_pairs_are_checked_whole_before_the_first() {
        let pairs: Vec<KvPair> = (0..1000)
            .map(|i| (format!("lock/{i:04}").into_bytes(), vec![i as u8; i % 7]))
            .collect();
        let data = encode_snapshot_data(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
        let read = snapshot_pairs(&data).unwrap();
        assert_eq!(read.len(), 1000);
        assert!(read
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .eq(pairs.iter().cloned()));
        // The last two keys swapped: the checksum is right, the order is not.
        let mut unordered = pairs.clone();
        unordered.swap(998, 999);
        let data =
            encode_snapshot_data(unordered.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
        match snapshot_pairs(&data) {
            Err(StorageError::SnapshotData { problem }) => {
                assert!(problem.contains("strictly increasing"), "{problem}")
            }
            other => panic!("unordered keys accepted: {other:?}"),
        }
        // A last value that claims more bytes than there are, under a recomputed checksum.
        let mut long = pairs.clone();
        long.truncate(1);
        let mut data =
            encode_snapshot_data(long.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))).to_vec();
        let body = data.len() - 4;
        data[body - 4..body].copy_from_slice(&u32::MAX.to_be_bytes());
        let crc = crc32fast::hash(&data[..body]);
        data[body..].copy_from_slice(&crc.to_be_bytes());
        assert!(snapshot_pairs(&data).is_err());
    }
}
