//! [`SledStorage`]: the on-disk implementation on sled 0.34.
//!
//! Four trees: `log_runs` (the Raft log: runs of consecutive checksummed entries, each run one
//! value under the big-endian index of its first entry, so that the entries one `Ready` appends
//! are one sled write instead of one per entry), `meta` (hard state, snapshot point,
//! membership at the snapshot point, applied index), `state` (the applied state machine) and
//! `staging` (chunks of an incoming snapshot). Log entries, meta records and applied-state values
//! each carry a CRC-32 (see `codec`), so a damaged value is an error naming its tree and key.
//! Applying state with its index runs as one sled transaction; a snapshot install is staged,
//! marked in `meta`, written in batches and finished by one small transaction, and redone from
//! `staging` by an open that finds the mark (see [`SledStorage::install`]); an append after the
//! last entry (the common case) is one plain insert per run, in index order, and an append that
//! replaces a suffix one batch on the log tree (sled writes its buffer out before and after every
//! batch or transaction, so the hot path avoids them); a compaction records the new snapshot
//! point and leaves the deletion of the entries behind it to a background thread. Nothing is
//! durable before [`Storage::flush`], which also syncs the files sled keeps large values in
//! (see [`BlobSync`]).
//!
//! The engine's code, by concern:
//! - this file: the tree and meta key names, [`SledStorage`] itself, and closing it;
//! - [`options`]: [`SledOptions`] and [`LogEngine`], how a store is opened;
//! - [`open`]: opening a store, cleaning up what sled leaves after a kill, migrating an older
//!   log, and loading the cached bounds;
//! - [`log`]: the Raft log in runs (appending, reading, the membership at an index) and the
//!   background trimmer;
//! - [`state`]: reading `meta` records and the applied state;
//! - [`install`]: staging snapshots and the sliced, crash-safe install;
//! - [`flush`]: making writes durable (sled's log file and its blob files);
//! - [`storage_impl`]: the [`Storage`] implementation, built on the above.

use sled::transaction::TransactionError;

use super::flusher::Flusher;
use super::segment_log::SegmentLog;
#[cfg(doc)]
use super::Storage;
use super::StorageError;
use crate::raft::{Entry, Index, SnapshotMeta};

mod flush;
mod install;
mod log;
mod open;
mod options;
mod state;
mod storage_impl;

use flush::BlobSync;
use install::PendingInstall;
use log::LogTrimmer;
pub use options::{LogEngine, SledOptions};

/// The log tree: runs of entries (see `codec`).
const LOG_TREE: &str = "log_runs";
/// The log tree of stores written before runs: one entry per value. Migrated at open.
const OLD_LOG_TREE: &str = "log";
/// A run is closed once its entries take this many bytes, so sled's nodes (up to 17 values)
/// stay far below the size sled moves out to a blob file of its own. An entry larger than this
/// is a run of its own.
const RUN_MAX_BYTES: usize = 4096;
/// The file sled 0.34 keeps its log (and so every tree) in, inside the store's directory.
const SLED_LOG_FILE: &str = "db";
/// The directory, inside the store's, of the Raft log's segment files under
/// [`LogEngine::Segments`].
const SEGMENT_DIR: &str = "log";
const HARD_STATE: &[u8] = b"hard_state";
const SNAPSHOT_POINT: &[u8] = b"snapshot_point";
const SNAPSHOT_MEMBERSHIP: &[u8] = b"snapshot_membership";
const APPLIED_INDEX: &[u8] = b"applied_index";
const STAGING_META: &[u8] = b"staging_meta";
/// In `meta` while a snapshot's state is being installed: the index and term of the staged
/// snapshot. See [`SledStorage::install`].
const INSTALLING_STATE: &[u8] = b"installing_state";
/// The mark of older releases, written before the snapshot point moved (they moved it with the
/// applied index at the end); an open that finds it finishes the install as they would have.
const INSTALLING: &[u8] = b"installing";
/// State keys written per sled batch when a snapshot is installed. Small batches keep sled's
/// memory down: installing a million locks (a 106 MiB snapshot) into a new store left the
/// process at 3.3 GB resident with 16,384 keys per batch, 2.2 GB with 4,096, 1.4 GB with 2,048
/// and about 480 MiB with 128 to 512, which were also the fastest (5.6–6.9 s against 7–8 s).
/// One insert at a time was slowest and large again (15 s, 2.7 GB). `raftlock-bench
/// snapshot-install` repeats the comparison.
const INSTALL_BATCH_KEYS: usize = 512;

pub struct SledStorage {
    db: sled::Db,
    /// sled's log file, opened a second time to `fdatasync` it: see [`Storage::flush`].
    db_file: std::sync::Arc<std::fs::File>,
    log: sled::Tree,
    meta: sled::Tree,
    state: sled::Tree,
    staging: sled::Tree,
    /// Cached copies of what is in `meta` and the log's bounds.
    snapshot_meta: SnapshotMeta,
    last_index: Index,
    applied_index: Index,
    /// The entries after the snapshot point that change the membership, so the membership at an
    /// index is known without reading the log. Filled by `recover` from the entries it reads
    /// anyway (or at open when the log is empty); until then the log is read each time.
    config_entries: std::sync::OnceLock<std::collections::BTreeMap<Index, Entry>>,
    /// Removes compacted log entries in the background; see [`SledStorage::compact`].
    trimmer: LogTrimmer,
    /// Bytes of snapshot chunks in `staging`: the offset the next chunk must have. Counted from
    /// the tree once after opening, then kept here (summing the staged chunks for every chunk
    /// read the whole transfer again each time: quadratic in the snapshot's size).
    staged_bytes: Option<u64>,
    /// The index of the snapshot whose install this open finished after a crash, if any.
    resumed_install: Option<Index>,
    /// A snapshot whose state is being written; see [`Storage::begin_install`].
    pending_install: Option<PendingInstall>,
    /// An install finished and its chunks are still in `staging`, without their meta record:
    /// [`SledStorage::continue_install`] removes them a few at a time.
    staged_garbage: bool,
    /// Makes the files sled moves large values into durable; see [`BlobSync`].
    blobs: BlobSync,
    /// State keys per sled batch in a snapshot install ([`INSTALL_BATCH_KEYS`]).
    install_batch_keys: usize,
    /// The Raft log's segment files under [`LogEngine::Segments`]; `None` keeps it in `log`.
    segments: Option<SegmentLog>,
    /// sled was written since its last flush (tracked under [`LogEngine::Segments`], where a
    /// flush of the log alone does not flush sled).
    sled_unsynced: bool,
    /// The hard state was written since sled's last flush: sled is flushed before the next
    /// log append, so that a crash never keeps an append without the hard state written
    /// before it.
    hard_state_unsynced: bool,
    /// The snapshot point as of sled's last flush: log segments at or below it may go.
    durable_point: Index,
    /// Runs flushes on a thread of its own once [`SledStorage::flush_in_background`] was
    /// called; `None` flushes inside [`Storage::start_flush`].
    flusher: Option<Flusher>,
}

impl Drop for SledStorage {
    fn drop(&mut self) {
        // The trimmer may have written after the last flush; let its writes reach the disk so
        // sled holds no pending I/O (and no lock on the directory) once the store is dropped.
        self.trimmer.stop();
        let _ = self.db.flush();
    }
}

impl std::fmt::Debug for SledStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledStorage")
            .field("snapshot_index", &self.snapshot_meta.index)
            .field("last_index", &self.last_index)
            .field("applied_index", &self.applied_index)
            .finish()
    }
}

fn tx_err(action: &'static str, e: TransactionError<StorageError>) -> StorageError {
    match e {
        TransactionError::Abort(err) => err,
        TransactionError::Storage(err) => StorageError::sled(action, err),
    }
}
