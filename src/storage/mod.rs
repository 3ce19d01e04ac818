//! Durable storage for one Raft node: the log, the hard state, the membership at the snapshot
//! point, and the applied state machine with its applied index.
//!
//! ```text
//!   raft core ──Ready──► node driver ──append / set_hard_state──► Storage ──flush (once per Ready)
//!                             │                                     ▲
//!                             └── apply(applied_index, changes) ────┘ (one atomic batch)
//! ```
//!
//! The node driver is the only caller. It writes a whole `Ready` (entries and hard state), calls
//! [`Storage::flush`] once (group commit), and only then lets votes and append replies leave.
//! Two implementations follow the same [`Storage`] trait and pass one conformance
//! suite: [`SledStorage`] on disk and [`MemStorage`], an in-memory model of a disk that loses
//! everything not flushed when [`MemStorage::crash`] is called (used by the simulator).
//!
//! Storage never panics on bad data read back from disk: a checksum mismatch, a gap in the log or
//! an undecodable record is a [`StorageError`] that names the tree, the key and what is wrong. It
//! never silently drops or repairs data either; repairs are for an operator to decide.

#[cfg(feature = "server")]
pub mod bench;
#[cfg_attr(not(feature = "server"), allow(dead_code))]
mod codec;
#[cfg(test)]
mod conformance;
mod error;
#[cfg(feature = "server")]
mod flusher;
#[cfg(feature = "server")]
mod logfs;
mod memory;
#[cfg(feature = "server")]
mod segment_log;
#[cfg(feature = "server")]
mod sim_segments;
#[cfg(feature = "server")]
mod sled_store;

#[doc(hidden)]
pub use codec::fuzzing as codec_fuzzing;
pub use codec::{
    decode_snapshot_data, encode_snapshot_data, encode_snapshot_stream, snapshot_pairs,
    snapshot_pairs_from, PairsCursor, SnapshotPairs,
};
pub use error::StorageError;
#[cfg(feature = "server")]
pub use flusher::{FlushObserver, FlushWaker};
#[cfg(feature = "server")]
pub use logfs::{SimDisk, SimDiskStats};
pub use memory::MemStorage;
#[cfg(feature = "server")]
pub use sim_segments::{SimSegmentsStorage, SIM_SEGMENT_BYTES};
#[cfg(feature = "server")]
pub use sled_store::{LogEngine, SledOptions, SledStorage};

use bytes::Bytes;

use crate::raft::{
    Entry, EntryPayload, HardState, Index, Membership, Snapshot, SnapshotMeta, Term,
};

/// One key-value pair of the applied state. Keys are opaque bytes (the lock state machine
/// prefixes them `lock/…`, `data/…`, `meta/…`).
pub type KvPair = (Vec<u8>, Vec<u8>);

/// One write of the state machine: `Some(value)` puts, `None` deletes.
pub type KvChange = (Vec<u8>, Option<Vec<u8>>);

/// Everything a node needs to restart, as read back from storage by [`Storage::recover`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveredState {
    pub hard_state: HardState,
    /// The point the log starts after: the last installed snapshot or the last compaction,
    /// whichever is later. `index == 0` means the log was never compacted. Its `membership` is
    /// the configuration in effect at `index`.
    pub snapshot_meta: SnapshotMeta,
    /// Every log entry after `snapshot_meta.index`, contiguous, checksums verified.
    pub entries: Vec<Entry>,
    /// The configuration in effect at the end of the log: `snapshot_meta.membership` with every
    /// membership entry of `entries` applied in order (dissertation §4.1: a change takes effect
    /// when appended).
    pub membership: Membership,
    /// Highest log index whose effects are in `applied_state`.
    pub applied_index: Index,
    /// The applied state machine, in key order.
    pub applied_state: Vec<KvPair>,
}

impl RecoveredState {
    /// Index of the last log entry, or of the snapshot point when the log is empty.
    pub fn last_index(&self) -> Index {
        self.entries
            .last()
            .map_or(self.snapshot_meta.index, |entry| entry.index)
    }
}

/// What the node driver (and the simulator) needs from durable storage.
///
/// Writes become visible to reads at once but are durable only after [`Storage::flush`]. Every
/// single write call is atomic: after a crash either all of it or none of it is there, and a
/// crash keeps a prefix of the write calls made since the last flush (never a later write
/// without an earlier one).
///
/// Object safe, so a caller can hold a `Box<dyn Storage>`.
pub trait Storage {
    /// Reads back and verifies everything durable (and everything written since). Checksums,
    /// log contiguity and the applied index are checked; any problem is an error.
    fn recover(&self) -> Result<RecoveredState, StorageError>;

    /// Removes every stored entry with index >= `entries[0].index`, then stores `entries`.
    /// `entries` must be contiguous, start after the snapshot point and at most one past the
    /// last index. An empty slice does nothing.
    fn append(&mut self, entries: &[Entry]) -> Result<(), StorageError>;

    /// Replaces the stored hard state.
    fn set_hard_state(&mut self, hard_state: HardState) -> Result<(), StorageError>;

    /// Applies state machine writes and records `applied_index`, in one atomic batch: a restart
    /// never sees the writes without the index or the index without the writes. The applied
    /// index must not go backwards.
    fn apply(&mut self, applied_index: Index, changes: &[KvChange]) -> Result<(), StorageError>;

    /// Replaces the applied state with a snapshot's, atomically: applied index becomes
    /// `meta.index`, the snapshot point becomes `meta`, and the log keeps the entries after
    /// `meta.index` only if the entry at `meta.index` has term `meta.term` (Raft §7); otherwise
    /// the whole log is dropped. `data` is the [`Snapshot::data`] encoding
    /// ([`encode_snapshot_data`]).
    fn install_snapshot(&mut self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), StorageError>;

    /// [`Storage::install_snapshot`] in steps, for a state too large to write at once without
    /// stalling the caller: this call moves the snapshot point and trims the log as
    /// `install_snapshot` does, at once, and keeps `data`; [`Storage::continue_install`] then
    /// replaces the applied state a slice at a time and finally moves the applied index. The
    /// log may be appended to meanwhile. A crash at any point after this call is durable
    /// (the next flush) leaves a store whose next open finishes the install. Until
    /// `continue_install` returns true, `apply` and the snapshot builders must not be called
    /// (they fail), and `applied_index` is the old one. The default installs everything here.
    ///
    /// While the install is under way its snapshot's bytes are what that open needs, so a new
    /// transfer is refused ([`Storage::begin_snapshot`], [`Storage::write_snapshot_chunk`] and
    /// [`Storage::finish_snapshot`] fail with [`StorageError::InstallInProgress`] and change
    /// nothing): the caller leaves that transfer unstaged, and its install stages the bytes
    /// itself. A `begin_install` (or `install_snapshot`) of the next snapshot first finishes
    /// the one under way.
    fn begin_install(&mut self, meta: &SnapshotMeta, data: &Bytes) -> Result<(), StorageError> {
        self.install_snapshot(meta, data)
    }

    /// [`Storage::begin_install`] for a snapshot whose transfer the caller staged as it arrived
    /// ([`Storage::begin_snapshot`] with `meta`, then every chunk of `data` in order with
    /// [`Storage::write_snapshot_chunk`]): the staged bytes are taken for `data` and not written
    /// again, so this call only checks `data` and moves the snapshot point. Where the staging
    /// area does not hold `meta` with exactly `data.len()` bytes, `data` is staged here as
    /// `begin_install` does. The default is `begin_install`, which ignores what is staged.
    fn begin_install_staged(
        &mut self,
        meta: &SnapshotMeta,
        data: &Bytes,
    ) -> Result<(), StorageError> {
        self.begin_install(meta, data)
    }

    /// Writes up to `max_pairs` more keys of the install [`Storage::begin_install`] began.
    /// Returns true once it is done (or when none is under way).
    fn continue_install(&mut self, _max_pairs: usize) -> Result<bool, StorageError> {
        Ok(true)
    }

    /// Starts receiving a snapshot in chunks (InstallSnapshot), discarding any transfer in
    /// progress. Nothing visible changes until [`Storage::finish_snapshot`]. Refused with
    /// [`StorageError::InstallInProgress`] while an install that [`Storage::begin_install`]
    /// began is not done (see there): a caller that stages transfers as they arrive then
    /// leaves this one to its install.
    fn begin_snapshot(&mut self, meta: &SnapshotMeta) -> Result<(), StorageError>;

    /// Stages one chunk of the snapshot data. Chunks must arrive in order: `offset` is the
    /// number of bytes staged so far.
    fn write_snapshot_chunk(&mut self, offset: u64, chunk: &[u8]) -> Result<(), StorageError>;

    /// Installs the staged snapshot exactly as [`Storage::install_snapshot`] does and clears the
    /// staging area. Returns the installed meta.
    fn finish_snapshot(&mut self) -> Result<SnapshotMeta, StorageError>;

    /// Serializes the applied state at the applied index. `meta.term` is the term of the entry at
    /// the applied index, `meta.membership` the configuration in effect there.
    fn build_snapshot(&self) -> Result<Snapshot, StorageError>;

    /// The work of [`Storage::build_snapshot`] as a job for another thread, so a large state does
    /// not stall the caller. What the job reads is fixed when it is created only as long as the
    /// caller does not change the applied state (`apply`, `install_snapshot`, `finish_snapshot`)
    /// before the job has finished. The default builds the snapshot right away.
    fn snapshot_job(&self) -> Result<SnapshotJob, StorageError> {
        let snapshot = self.build_snapshot()?;
        Ok(Box::new(move || Ok(snapshot)))
    }

    /// [`Storage::snapshot_job`] with the stored pairs handed through `convert` (in key order,
    /// as read) before they are encoded, so that a snapshot whose pairs differ from the stored
    /// ones is built in one pass. The default decodes what [`Storage::snapshot_job`] encoded.
    fn snapshot_job_with(&self, convert: PairsConvert) -> Result<SnapshotJob, StorageError> {
        let read = self.snapshot_job()?;
        Ok(Box::new(move || {
            let snapshot = read()?;
            let pairs = decode_snapshot_data(&snapshot.data)?;
            Ok(Snapshot {
                meta: snapshot.meta,
                data: encode_snapshot_stream(convert(Box::new(pairs.into_iter().map(Ok))))?,
            })
        }))
    }

    /// Drops log entries <= `upto` and makes `upto` the snapshot point, remembering its term and
    /// the membership in effect there. `upto` must not exceed the applied index (the applied
    /// state covers what is dropped). Compacting to or below the current point does nothing.
    fn compact(&mut self, upto: Index) -> Result<(), StorageError>;

    /// Log entries in `[lo, hi)`, checksums verified. `lo` must be after the snapshot point and
    /// `hi` at most `last_index() + 1`.
    fn entries(&self, lo: Index, hi: Index) -> Result<Vec<Entry>, StorageError>;

    /// Term of the entry at `index`; the snapshot point's term for `index == snapshot index`.
    fn term(&self, index: Index) -> Result<Term, StorageError>;

    /// Index of the first entry the log can hold: snapshot index + 1.
    fn first_index(&self) -> Index;

    /// Index of the last entry, or the snapshot index when the log is empty.
    fn last_index(&self) -> Index;

    /// Highest index whose effects are in the applied state.
    fn applied_index(&self) -> Index;

    /// Makes everything written so far durable. Nothing may be acknowledged before it returns.
    fn flush(&mut self) -> Result<(), StorageError>;

    /// Starts making everything written so far durable and returns at once with a ticket: the
    /// flush is done once [`Storage::flushed`] returns that ticket or a later one. Writes made
    /// after the call are not covered by it. Tickets grow by one per call. A storage that cannot
    /// flush in the background flushes here and returns a ticket that is already done (the
    /// default).
    fn start_flush(&mut self) -> Result<u64, StorageError> {
        self.flush()?;
        self.flushed()
    }

    /// The newest ticket of [`Storage::start_flush`] that is done (flushes complete in the order
    /// they were started); never blocks. An error means a flush failed: nothing written since
    /// the last completed one may be taken as durable, and the node must stop.
    fn flushed(&mut self) -> Result<u64, StorageError> {
        Ok(u64::MAX)
    }

    /// Waits until every flush started so far is done.
    fn wait_flushed(&mut self) -> Result<(), StorageError> {
        self.flushed().map(|_| ())
    }
}

/// A snapshot being built on another thread; see [`Storage::snapshot_job`].
pub type SnapshotJob = Box<dyn FnOnce() -> Result<Snapshot, StorageError> + Send>;

/// Pairs read one at a time, in key order.
pub type PairsIter<'a> = Box<dyn Iterator<Item = Result<KvPair, StorageError>> + 'a>;

/// Turns the stored state's pairs into those a snapshot carries, as they are read (so that no
/// copy of the whole state is made on the way to the snapshot's bytes); see
/// [`Storage::snapshot_job_with`].
pub type PairsConvert = Box<dyn for<'a> FnOnce(PairsIter<'a>) -> PairsIter<'a> + Send>;

/// Folds the membership entries of `entries` into `base`. Used by recovery and compaction of
/// both implementations so that they agree.
fn membership_after(base: &Membership, entries: &[Entry]) -> Result<Membership, StorageError> {
    let mut membership = base.clone();
    for entry in entries {
        match &entry.payload {
            EntryPayload::Membership(change) => {
                membership =
                    membership
                        .apply(*change)
                        .map_err(|source| StorageError::Membership {
                            index: entry.index,
                            source,
                        })?;
            }
            EntryPayload::Config(config) => membership = config.clone(),
            _ => {}
        }
    }
    Ok(membership)
}

/// Checks that `entries` are contiguous and that they can be appended to a log whose snapshot
/// point is `snapshot_index` and whose last index is `last_index`.
fn check_append(
    entries: &[Entry],
    snapshot_index: Index,
    last_index: Index,
) -> Result<(), StorageError> {
    let Some(first) = entries.first() else {
        return Ok(());
    };
    if first.index <= snapshot_index || first.index > last_index + 1 {
        return Err(StorageError::AppendOutOfRange {
            first_index: first.index,
            snapshot_index,
            last_index,
        });
    }
    for pair in entries.windows(2) {
        if pair[1].index != pair[0].index + 1 {
            return Err(StorageError::AppendNotContiguous {
                previous_index: pair[0].index,
                next_index: pair[1].index,
            });
        }
    }
    Ok(())
}

/// Checks a recovered state for the invariants both implementations guarantee.
/// The errors every engine gives `entries(lo, hi)` for a range it cannot serve: `lo` at or
/// below the snapshot point (compacted), or `hi` past the end of the log.
fn check_entries_range(
    lo: Index,
    hi: Index,
    snapshot_index: Index,
    last_index: Index,
) -> Result<(), StorageError> {
    if lo <= snapshot_index {
        return Err(StorageError::Compacted {
            index: lo,
            snapshot_index,
        });
    }
    if hi > last_index + 1 {
        return Err(StorageError::Unavailable {
            index: hi - 1,
            last_index,
        });
    }
    Ok(())
}

fn check_recovered(state: &RecoveredState) -> Result<(), StorageError> {
    let mut previous_term = state.snapshot_meta.term;
    for (expected, entry) in (state.snapshot_meta.index + 1..).zip(&state.entries) {
        if entry.index != expected {
            return Err(StorageError::LogGap {
                expected_index: expected,
                found_index: entry.index,
            });
        }
        if entry.term < previous_term {
            return Err(StorageError::Corrupt {
                tree: "log",
                key: entry.index.to_string(),
                problem: format!(
                    "term {} is lower than the previous term {previous_term}",
                    entry.term
                ),
            });
        }
        previous_term = entry.term;
    }
    let last_index = state.last_index();
    if state.applied_index < state.snapshot_meta.index || state.applied_index > last_index {
        return Err(StorageError::Corrupt {
            tree: "meta",
            key: "applied_index".to_string(),
            problem: format!(
                "applied index {} is outside the log [{}, {last_index}]",
                state.applied_index, state.snapshot_meta.index
            ),
        });
    }
    Ok(())
}
