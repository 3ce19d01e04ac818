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

use std::path::Path;

use bytes::Bytes;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use sled::Transactional;

use super::codec::{
    begin_run, decode_entry, decode_hard_state, decode_index_key, decode_index_term,
    decode_membership, decode_state_value, decode_u64, encode_hard_state, encode_index_term,
    encode_membership, encode_state_value, encode_u64, index_key, push_run_entry, push_run_record,
    run_last_index, run_records, state_key_name,
};
use super::flusher::{FlushJob, FlushObserver, FlushWaker, Flusher};
use super::segment_log::SegmentLog;
use super::{
    check_append, check_recovered, encode_snapshot_stream, membership_after, snapshot_pairs,
    snapshot_pairs_from, KvChange, KvPair, PairsConvert, PairsCursor, RecoveredState, SnapshotJob,
    Storage, StorageError,
};
use crate::raft::{
    Entry, EntryPayload, HardState, Index, Membership, Snapshot, SnapshotMeta, Term,
};

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

/// `staging`'s meta record for a transfer of the snapshot `meta`: its index and term (20
/// bytes), then its membership.
fn staging_meta_record(meta: &SnapshotMeta) -> Vec<u8> {
    let mut record = encode_index_term(meta.index, meta.term);
    record.extend_from_slice(&encode_membership(&meta.membership));
    record
}

/// Size of the pieces a snapshot installed in one piece is staged in.
const STAGED_CHUNK_BYTES: usize = 1 << 20;

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

/// A snapshot whose point has moved and whose state is being written; see
/// [`SledStorage::install`].
struct PendingInstall {
    meta: SnapshotMeta,
    data: Bytes,
    /// The next pair to write.
    cursor: PairsCursor,
    /// The old state is gone.
    cleared: bool,
}

/// sled 0.34 writes a value (or a tree node) larger than a quarter of its 512 KiB segment to a
/// file of its own under `blobs/`, and only its log records the pointer to that file. It never
/// syncs those files, so after a power cut the log could point at a file that never reached
/// the disk and the store would not open. Such values are not rare here: a lock with a long
/// wait queue, a data entry near its 64 KiB limit (sixteen share a node) or a snapshot chunk.
///
/// Each [`Storage::flush`] therefore first syncs every blob file it has not synced yet (and the
/// directory, so their names survive), before sled's log, which points at them, is flushed.
/// Finding new files costs one `fstat` of the directory per flush: the directory is only listed
/// when its modification time moved, or is recent enough that a file created within the same
/// clock tick as the last listing could share it. The directory stays open for that (sled
/// creates it when the store opens and never removes it): a `stat` by path walked the path on
/// every flush, about 1.6% of a follower's driver thread at 32 clients (`perf record`).
struct BlobSync {
    dir: std::path::PathBuf,
    /// The directory, open, once it exists.
    handle: Option<std::fs::File>,
    /// The directory's modification time at the last listing.
    listed_mtime: Option<std::time::SystemTime>,
    /// Names of the blob files synced so far that were still there at the last listing.
    synced: std::collections::HashSet<std::ffi::OsString>,
    /// Blob files synced since the store was opened.
    synced_total: u64,
}

impl BlobSync {
    /// A directory modified less than this long ago is listed at every flush.
    const RECENT: std::time::Duration = std::time::Duration::from_secs(2);

    fn new(store_dir: &Path) -> Self {
        BlobSync {
            dir: store_dir.join("blobs"),
            handle: None,
            listed_mtime: None,
            synced: Default::default(),
            synced_total: 0,
        }
    }

    /// Syncs the blob files not synced yet, and then the directory if there were any.
    fn sync_new(&mut self) -> Result<(), StorageError> {
        let io = |action: &'static str| move |source| StorageError::Io { action, source };
        let dir = match self.handle.take() {
            Some(dir) => dir,
            None => match std::fs::File::open(&self.dir) {
                Ok(dir) => dir,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(err) => return Err(io("opening the blob directory")(err)),
            },
        };
        let mtime = self
            .handle
            .insert(dir)
            .metadata()
            .and_then(|meta| meta.modified())
            .map_err(io("reading the blob directory's time"))?;
        let recent = std::time::SystemTime::now()
            .duration_since(mtime)
            .map_or(true, |age| age < Self::RECENT);
        if self.listed_mtime == Some(mtime) && !recent {
            return Ok(());
        }
        let mut present = std::collections::HashSet::with_capacity(self.synced.len());
        let mut new_files = false;
        for item in std::fs::read_dir(&self.dir).map_err(io("listing sled's blob files"))? {
            let item = item.map_err(io("listing sled's blob files"))?;
            let name = item.file_name();
            if !self.synced.contains(&name) {
                match std::fs::File::open(item.path()) {
                    Ok(file) => file.sync_data().map_err(io("syncing a sled blob file"))?,
                    // sled removed it since the listing: nothing left to make durable.
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(err) => return Err(io("opening a sled blob file to sync it")(err)),
                }
                new_files = true;
                self.synced_total += 1;
            }
            present.insert(name);
        }
        if new_files {
            std::fs::File::open(&self.dir)
                .and_then(|dir| dir.sync_all())
                .map_err(io("syncing the blob directory"))?;
        }
        self.synced = present;
        self.listed_mtime = Some(mtime);
        Ok(())
    }
}

/// A thread that deletes log entries at or below the snapshot point after a compaction.
///
/// A compaction first records the new snapshot point in `meta`; from then on entries at or below
/// it are never read (recovery and `entries` start after the point), so deleting them is only
/// reclaiming space and need not happen on the caller's thread. Deletes are issued after the
/// point was written, and sled recovers a prefix of its writes, so no crash can lose the point
/// but keep the deletes.
struct LogTrimmer {
    requests: Option<std::sync::mpsc::Sender<Index>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LogTrimmer {
    const BATCH_KEYS: usize = 1024;

    fn start(log: sled::Tree) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<Index>();
        let thread = std::thread::Builder::new()
            .name("raftlock-log-trim".into())
            .spawn(move || {
                while let Ok(mut upto) = rx.recv() {
                    while let Ok(more) = rx.try_recv() {
                        upto = upto.max(more);
                    }
                    if let Err(err) = Self::trim(&log, upto) {
                        tracing::warn!(upto, cause = %err, "could not delete compacted log entries; will retry at the next compaction");
                    }
                }
            })
            .ok();
        LogTrimmer {
            requests: thread.as_ref().map(|_| tx),
            thread,
        }
    }

    /// Deletes the runs whose entries are all at or below `upto`; a run that holds `upto` and
    /// entries after it stays whole (entries at or below the point are never read). A value
    /// that does not decode is left for recovery to report.
    ///
    /// Each run is its own `remove`, oldest first, not a sled batch: sled 0.34 applies a batch
    /// under a process-wide exclusive lock that every other write waits for, so a batch of a
    /// thousand deletes held the driver's log appends (and every client behind them) for the
    /// whole batch. Nothing needs the deletes to be atomic together: a crash part way leaves
    /// runs below the snapshot point, which are never read and go at the next trim.
    fn trim(log: &sled::Tree, upto: Index) -> sled::Result<()> {
        loop {
            let mut done = Vec::new();
            for item in log.range(..=index_key(upto)).take(Self::BATCH_KEYS) {
                let (k, v) = item?;
                let whole = decode_index_key(&k)
                    .ok()
                    .and_then(|first| run_last_index(first, &v).ok())
                    .is_some_and(|last| last <= upto);
                if whole {
                    done.push(k);
                }
            }
            if done.is_empty() {
                return Ok(());
            }
            for k in done {
                log.remove(k)?;
            }
        }
    }

    /// Queues the deletion of entries <= `upto`; false if the thread could not be started.
    fn request(&self, upto: Index) -> bool {
        self.requests
            .as_ref()
            .is_some_and(|tx| tx.send(upto).is_ok())
    }

    /// Finishes the queued deletions and ends the thread. Closing the channel ends the thread
    /// once the queue is drained; joining releases its handle on the database.
    fn stop(&mut self) {
        drop(self.requests.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for LogTrimmer {
    fn drop(&mut self) {
        self.stop();
    }
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

/// sled 0.34 writes its own snapshot (its page table, not ours) to `snap.<lsn>.generating`, syncs
/// it and renames it to `snap.<lsn>`, removing older ones only after the rename. A process killed
/// before the rename leaves the unfinished file behind, and sled's start-up counts it among its
/// snapshots: it sorts last, so sled reads it as the newest, finds it short or its checksum wrong,
/// and refuses to open with `Corruption`. The file is by construction a write that never took
/// effect (the previous snapshot and the log after it are intact), so it is removed before sled
/// looks. A missing directory is a new store and has nothing to remove.
///
/// Only while holding the lock sled itself takes on its `db` file: a store another process has
/// open may be writing that file at this moment. Then nothing is removed, and sled's own open
/// reports the lock.
fn remove_unfinished_sled_snapshots(dir: &Path) -> Result<(), StorageError> {
    let lock_file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("db"))
    {
        Ok(file) => file,
        // No store here yet, or one sled will report on itself.
        Err(_) => return Ok(()),
    };
    if lock_file.try_lock().is_err() {
        return Ok(());
    }
    // The directory exists: its `db` file was just opened.
    let listing = |source| StorageError::Io {
        action: "listing the store directory",
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(listing)? {
        let entry = entry.map_err(listing)?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with("snap.") && name.ends_with(".generating") {
            tracing::warn!(
                file = %entry.path().display(),
                "removing an unfinished sled snapshot left by a crash during its write"
            );
            std::fs::remove_file(entry.path()).map_err(|source| StorageError::Io {
                action: "removing an unfinished sled snapshot",
                source,
            })?;
        }
    }
    Ok(())
}

/// Where a [`SledStorage`] keeps the Raft log; everything else is always in sled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogEngine {
    /// In sled's `log_runs` tree, with the rest of the store (the default).
    #[default]
    Sled,
    /// In segment files of its own under `log/` in the store's directory: an append is one
    /// `write` and a flush one `fdatasync`, without sled's I/O thread pool in between (see
    /// `docs/bench/storage.md` for what that is worth). Hard state, membership, snapshot point
    /// and applied state stay in sled.
    Segments,
}

impl LogEngine {
    pub fn name(self) -> &'static str {
        match self {
            LogEngine::Sled => "sled",
            LogEngine::Segments => "segments",
        }
    }
}

impl std::fmt::Display for LogEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for LogEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sled" => Ok(LogEngine::Sled),
            "segments" => Ok(LogEngine::Segments),
            other => Err(format!("unknown log engine `{other}` (sled or segments)")),
        }
    }
}

/// How a [`SledStorage`] is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SledOptions {
    /// The most memory sled's page cache may hold, in bytes (`sled::Config::cache_capacity`).
    /// The lock state machine keeps the whole applied state in memory and reads the store
    /// only to start, to build snapshots and to send log entries that are no longer in
    /// memory, so a large cache only keeps a second copy of the state resident.
    pub cache_bytes: u64,
    /// Where the Raft log is kept. A store keeps the engine it was written with: opening it
    /// with the other is an error while the log holds entries.
    pub log_engine: LogEngine,
    /// Size of one log segment file under [`LogEngine::Segments`] (preallocated).
    pub segment_bytes: u64,
}

impl SledOptions {
    /// The page cache a lock node gives sled unless told otherwise (`--storage-cache-mb`).
    pub const DEFAULT_CACHE_BYTES: u64 = 64 * 1024 * 1024;
    /// The size of a log segment file unless told otherwise.
    pub const DEFAULT_SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
}

impl Default for SledOptions {
    fn default() -> Self {
        SledOptions {
            cache_bytes: Self::DEFAULT_CACHE_BYTES,
            log_engine: LogEngine::Sled,
            segment_bytes: Self::DEFAULT_SEGMENT_BYTES,
        }
    }
}

impl SledStorage {
    /// Opens (or creates) the store in `dir` with the default [`SledOptions`]. A damaged
    /// store is an error, never a panic.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, StorageError> {
        Self::open_with(dir, SledOptions::default())
    }

    /// Opens (or creates) the store in `dir`. A damaged store is an error, never a panic.
    pub fn open_with(dir: impl AsRef<Path>, options: SledOptions) -> Result<Self, StorageError> {
        let dir = dir.as_ref().to_path_buf();
        remove_unfinished_sled_snapshots(&dir)?;
        let db_path = dir.join(SLED_LOG_FILE);
        let segment_dir = dir.join(SEGMENT_DIR);
        let blobs = BlobSync::new(&dir);
        let opened = std::panic::catch_unwind(move || {
            sled::Config::new()
                .path(dir)
                .cache_capacity(options.cache_bytes)
                .open()
        });
        let db = match opened {
            Ok(Ok(db)) => db,
            Ok(Err(err)) => return Err(StorageError::sled("opening the store", err)),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                return Err(StorageError::EnginePanic {
                    action: "opening the store",
                    message,
                });
            }
        };
        let tree = |name: &'static str| {
            db.open_tree(name)
                .map_err(|e| StorageError::sled("opening a tree", e))
        };
        let log = tree(LOG_TREE)?;
        migrate_old_log(&db, &log)?;
        let segments = match options.log_engine {
            LogEngine::Sled => {
                if SegmentLog::exists_in(&segment_dir)? {
                    return Err(StorageError::LogEngineMismatch {
                        found: LogEngine::Segments.name(),
                        asked: LogEngine::Sled.name(),
                    });
                }
                None
            }
            LogEngine::Segments => {
                if !log.is_empty() {
                    return Err(StorageError::LogEngineMismatch {
                        found: LogEngine::Sled.name(),
                        asked: LogEngine::Segments.name(),
                    });
                }
                Some(SegmentLog::open(&segment_dir, options.segment_bytes)?)
            }
        };
        let db_file = std::fs::File::open(&db_path).map_err(|source| StorageError::Io {
            action: "opening sled's log file to sync it",
            source,
        })?;
        let mut storage = SledStorage {
            db_file: std::sync::Arc::new(db_file),
            flusher: None,
            trimmer: LogTrimmer::start(log.clone()),
            log,
            meta: tree("meta")?,
            state: tree("state")?,
            staging: tree("staging")?,
            db,
            snapshot_meta: SnapshotMeta::default(),
            last_index: 0,
            applied_index: 0,
            config_entries: std::sync::OnceLock::new(),
            staged_bytes: None,
            resumed_install: None,
            pending_install: None,
            staged_garbage: false,
            blobs,
            install_batch_keys: INSTALL_BATCH_KEYS,
            segments,
            sled_unsynced: false,
            hard_state_unsynced: false,
            durable_point: 0,
        };
        // Blob files an earlier process wrote may not have been synced when it stopped.
        storage.blobs.sync_new()?;
        storage.load_cache()?;
        storage.resume_install()?;
        storage.remove_staged_garbage()?;
        if storage.last_index == storage.snapshot_meta.index {
            storage.cache_config_entries(&[]);
        }
        Ok(storage)
    }

    fn load_cache(&mut self) -> Result<(), StorageError> {
        let (index, term) = match self.get_meta(SNAPSHOT_POINT)? {
            Some(v) => decode_index_term(&v).map_err(|e| e.at("meta", "snapshot_point".into()))?,
            None => (0, 0),
        };
        let membership = match self.get_meta(SNAPSHOT_MEMBERSHIP)? {
            Some(v) => {
                decode_membership(&v).map_err(|e| e.at("meta", "snapshot_membership".into()))?
            }
            None => Membership::default(),
        };
        self.snapshot_meta = SnapshotMeta {
            index,
            term,
            membership,
        };
        self.applied_index = match self.get_meta(APPLIED_INDEX)? {
            Some(v) => decode_u64(&v).map_err(|e| e.at("meta", "applied_index".into()))?,
            None => 0,
        };
        self.durable_point = index;
        if let Some(segments) = self.segments.as_mut() {
            // The snapshot point is in sled and the log in its files, flushed one after the
            // other: a crash after an install reached sled can leave the log it replaced.
            // Entries after the point belong only if the entry at the point is the snapshot's
            // (as `install` decides); otherwise the log starts over after the point, recorded
            // at once so that later appends replay after it.
            if segments.term(index).is_some_and(|t| t != term) {
                segments.reset(index, term)?;
                segments.sync()?;
            }
            segments.forget_through(index);
            if let Some(first) = segments.first_index() {
                if first > index + 1 {
                    return Err(StorageError::LogGap {
                        expected_index: index + 1,
                        found_index: first,
                    });
                }
            }
            self.last_index = segments.last_index().unwrap_or(index).max(index);
            return Ok(());
        }
        self.last_index = match self
            .log
            .last()
            .map_err(|e| StorageError::sled("reading the log", e))?
        {
            // Entries at or below the point may remain until the trimmer deleted them.
            Some((k, v)) => {
                let first = log_key(&k)?;
                run_last_index(first, &v)?.max(index)
            }
            None => index,
        };
        Ok(())
    }

    /// [`Storage::append`] into the `log_runs` tree: `entries` (checked, not empty) as runs.
    fn append_runs(&mut self, entries: &[Entry]) -> Result<(), StorageError> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        let mut runs = RunBuilder::new(entries.len() * (first.size_bytes() + 40));
        for entry in entries {
            push_run_entry(runs.run_for(entry.index), entry);
        }
        runs.close();
        if first.index > self.last_index {
            // The common case: new entries after the last. Each run is one insert, one sled log
            // record, in index order. They need not be atomic together: sled recovers a prefix
            // of its writes, and any prefix of these runs is the log with a prefix of the new
            // entries, which nothing has acknowledged before the flush. A sled batch (or
            // transaction) would cost more: sled writes its log buffer out before and after each
            // one (`pin_log`), two more writes and syncs on its I/O pool, and applies it under a
            // process-wide exclusive lock.
            for (k, v) in runs.closed.drain(..) {
                self.log
                    .insert(k, v)
                    .map_err(|e| StorageError::sled("appending entries", e))?;
            }
        } else {
            // A conflicting suffix goes: every run from `first` on, and the tail of the run that
            // holds `first` (a run is its entries' records in order, so the entries before
            // `first` are a prefix of its bytes).
            let mut batch = sled::Batch::default();
            if let Some((k, v)) = self.run_holding(first.index)? {
                let start = log_key(&k)?;
                if start < first.index {
                    let mut kept = begin_run(v.len());
                    for (_, record) in run_records(start, &v)?
                        .into_iter()
                        .take_while(|(index, _)| *index < first.index)
                    {
                        push_run_record(&mut kept, record);
                    }
                    batch.insert(k, kept);
                }
            }
            for key in self.log.range(index_key(first.index)..).keys() {
                batch.remove(key.map_err(|e| StorageError::sled("reading the log", e))?);
            }
            // After the removals: a run that starts at `first` replaces the one removed there.
            runs.move_into(&mut batch);
            self.log
                .apply_batch(batch)
                .map_err(|e| StorageError::sled("appending entries", e))?;
        }
        Ok(())
    }

    /// Makes every sled write so far durable (see [`Storage::flush`]).
    fn flush_sled(&mut self) -> Result<(), StorageError> {
        self.blobs.sync_new()?;
        self.db
            .flush()
            .map_err(|e| StorageError::sled("flushing", e))?;
        self.db_file
            .sync_data()
            .map_err(|source| StorageError::Io {
                action: "syncing sled's log file",
                source,
            })?;
        self.sled_unsynced = false;
        self.hard_state_unsynced = false;
        self.durable_point = self.snapshot_meta.index;
        Ok(())
    }

    /// From now on [`Storage::start_flush`] hands the flush to a thread of its own and returns
    /// at once; `wake` is called on that thread whenever flushes complete (or one fails), and
    /// `observe` with how long each took. Flushes queued while one runs are merged into the
    /// next.
    pub fn flush_in_background(
        &mut self,
        wake: FlushWaker,
        observe: FlushObserver,
    ) -> Result<(), StorageError> {
        if self.flusher.is_none() {
            self.flush()?;
            self.flusher = Some(Flusher::start(wake, observe)?);
        }
        Ok(())
    }

    /// Number of log segment files under [`LogEngine::Segments`].
    pub fn log_segments(&self) -> Option<usize> {
        self.segments.as_ref().map(SegmentLog::segment_count)
    }

    fn get_meta(&self, key: &[u8]) -> Result<Option<sled::IVec>, StorageError> {
        self.meta
            .get(key)
            .map_err(|e| StorageError::sled("reading meta", e))
    }

    /// The applied state in key order, checksums verified.
    fn read_state(&self) -> Result<Vec<KvPair>, StorageError> {
        read_state(&self.state)
    }

    fn read_entries(&self, lo: Index, hi: Index) -> Result<Vec<Entry>, StorageError> {
        let mut out = Vec::new();
        if lo >= hi {
            return Ok(out);
        }
        if let Some(segments) = &self.segments {
            return segments.read(lo, hi);
        }
        // From the run that holds `lo` (it may begin before it).
        let start = match self.run_holding(lo)? {
            Some((k, _)) => k,
            None => sled::IVec::from(&index_key(lo)),
        };
        for item in self.log.range(start..sled::IVec::from(&index_key(hi))) {
            let (k, v) = item.map_err(|e| StorageError::sled("reading the log", e))?;
            let first = log_key(&k)?;
            for (index, record) in run_records(first, &v)? {
                if (lo..hi).contains(&index) {
                    out.push(decode_entry(index, record)?);
                }
            }
        }
        Ok(out)
    }

    /// The run whose first index is the greatest at or below `index`: the one that holds
    /// `index` if any does.
    fn run_holding(&self, index: Index) -> Result<Option<(sled::IVec, sled::IVec)>, StorageError> {
        self.log
            .range(..=index_key(index))
            .next_back()
            .transpose()
            .map_err(|e| StorageError::sled("reading the log", e))
    }

    fn membership_at(&self, index: Index) -> Result<Membership, StorageError> {
        let entries = match self.config_entries.get() {
            _ if index <= self.snapshot_meta.index => Vec::new(),
            Some(cached) => cached
                .range(self.snapshot_meta.index + 1..=index)
                .map(|(_, e)| e.clone())
                .collect(),
            None => self.read_entries(self.snapshot_meta.index + 1, index + 1)?,
        };
        membership_after(&self.snapshot_meta.membership, &entries)
    }

    /// Leaves what a crash in the middle of a snapshot install leaves: the data staged, the point
    /// moved and the mark written, the old state cleared and only the first `keys_written`
    /// keys of the new one.
    #[cfg(test)]
    pub(crate) fn interrupt_install(
        &mut self,
        meta: &SnapshotMeta,
        data: &[u8],
        keys_written: usize,
    ) -> Result<(), StorageError> {
        self.start_install(meta, Bytes::copy_from_slice(data), false)?;
        self.pending_install = None;
        self.write_first_pairs(data, keys_written)
    }

    /// [`SledStorage::interrupt_install`] as releases before sliced installs left it: the mark
    /// `meta/installing` written before the snapshot point moved, the old log still there.
    #[cfg(test)]
    pub(crate) fn interrupt_install_of_an_older_release(
        &mut self,
        meta: &SnapshotMeta,
        data: &[u8],
        keys_written: usize,
    ) -> Result<(), StorageError> {
        self.stage_whole(meta, data)?;
        self.meta
            .insert(INSTALLING, encode_index_term(meta.index, meta.term))
            .map_err(|e| StorageError::sled("marking a snapshot install", e))?;
        self.write_first_pairs(data, keys_written)
    }

    /// The state tree cleared and the first `keys` pairs of `data` written: a crash in the middle
    /// of an install, for the two helpers above.
    #[cfg(test)]
    fn write_first_pairs(&mut self, data: &[u8], keys: usize) -> Result<(), StorageError> {
        self.state
            .clear()
            .map_err(|e| StorageError::sled("clearing the state", e))?;
        for (k, v) in snapshot_pairs(data)?.take(keys) {
            self.state
                .insert(k, encode_state_value(v))
                .map_err(|e| StorageError::sled("writing the state", e))?;
        }
        Ok(())
    }

    /// The raw log tree, for tests that stage what a crash can leave behind.
    #[cfg(test)]
    pub(crate) fn log_tree(&self) -> &sled::Tree {
        &self.log
    }

    /// The log tree of stores written before runs, for tests.
    #[cfg(test)]
    pub(crate) fn old_log_tree(&self) -> sled::Tree {
        self.db
            .open_tree(OLD_LOG_TREE)
            .expect("open the old log tree")
    }

    /// Fills [`SledStorage::config_entries`] from `entries`, all of the log after the snapshot
    /// point.
    fn cache_config_entries(&self, entries: &[Entry]) {
        let _ = self.config_entries.set(
            entries
                .iter()
                .filter(|e| changes_membership(e))
                .map(|e| (e.index, e.clone()))
                .collect(),
        );
    }

    /// Installs a snapshot without one sled transaction around the whole state: a transaction
    /// over a million keys took 2.4 times as long as batches and held about 2 GB more memory
    /// (sled buffers every write of a transaction), and it stops every other write to the store
    /// while it commits. Instead, crash-safe by redoing:
    ///
    /// 1. the data is checked, then kept in `staging` (unless it is already there) with its
    ///    meta;
    /// 2. one small transaction moves the snapshot point and membership, removes log entries
    ///    after the point that do not belong to it, and writes `meta/installing_state`, which
    ///    names the snapshot: from here on a restart finishes the install from `staging` before
    ///    anything reads the store;
    /// 3. the state tree is cleared and filled in batches ([`SledStorage::continue_install`],
    ///    a slice at a time when the node installs: its Raft thread answers votes in between);
    /// 4. one small transaction moves the applied index, clears the mark and removes
    ///    `staging`'s meta record;
    /// 5. the staged chunks are removed, a few per call (each is a file of sled's of its own,
    ///    and removing all of a million locks' 310 at once took about 0.24 s). Entries at or
    ///    below the point are left to the trimmer.
    ///
    /// sled recovers a prefix of its writes, so a crash before step 2 leaves the old state
    /// and log untouched, and one after it a mark the next open acts on. Entries appended after
    /// step 2 (the log goes on while the state is written) follow the new point and are kept.
    fn install(
        &mut self,
        meta: &SnapshotMeta,
        data: Bytes,
        staged: bool,
    ) -> Result<(), StorageError> {
        self.start_install(meta, data, staged)?;
        while !self.continue_install(usize::MAX)? {}
        Ok(())
    }

    /// Steps 1 and 2 of [`SledStorage::install`]. An install still under way is finished
    /// first (its bytes are all `staging` keeps: they may go only once its state is written),
    /// and then `data` is staged whatever `staged` says.
    fn start_install(
        &mut self,
        meta: &SnapshotMeta,
        data: Bytes,
        staged: bool,
    ) -> Result<(), StorageError> {
        let cursor = snapshot_pairs(&data)?.cursor(&data);
        let staged = staged && self.pending_install.is_none();
        self.finish_pending_install()?;
        if !staged {
            self.stage_whole(meta, &data)?;
        }
        self.move_point(meta)?;
        self.pending_install = Some(PendingInstall {
            meta: meta.clone(),
            data,
            cursor,
            cleared: false,
        });
        Ok(())
    }

    /// Writes the rest of an install under way, if any, and removes its staged bytes.
    fn finish_pending_install(&mut self) -> Result<(), StorageError> {
        if let Some(pending) = &self.pending_install {
            tracing::info!(
                index = pending.meta.index,
                "finishing the install under way before the next snapshot's"
            );
            while !self.continue_install(usize::MAX)? {}
        }
        Ok(())
    }

    /// Keeps `data` in `staging` as the chunks a transfer would have left there.
    fn stage_whole(&mut self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), StorageError> {
        self.begin_snapshot(meta)?;
        let mut offset = 0usize;
        for chunk in data.chunks(STAGED_CHUNK_BYTES) {
            self.write_snapshot_chunk(offset as u64, chunk)?;
            offset += chunk.len();
        }
        Ok(())
    }

    /// Step 2 of [`SledStorage::install`]: the snapshot point, the log and the mark. Doing it
    /// again for the same snapshot changes nothing more (the log then holds the point).
    fn move_point(&mut self, meta: &SnapshotMeta) -> Result<(), StorageError> {
        // A log that holds the snapshot's last entry is kept after it (§7: entries following
        // the snapshot are retained), and entries at or below the point are left to the
        // trimmer. Otherwise the whole log goes: entries after the point do not belong to it
        // and those at or below it are never read again.
        let keep = self.term(meta.index).ok() == Some(meta.term) && meta.index <= self.last_index;
        let log_remove: Vec<sled::IVec> = if keep {
            Vec::new()
        } else {
            self.log
                .iter()
                .keys()
                .collect::<Result<_, _>>()
                .map_err(|e| StorageError::sled("scanning the log", e))?
        };
        let point = encode_index_term(meta.index, meta.term);
        let membership = encode_membership(&meta.membership);
        (&self.log, &self.meta)
            .transaction(|(log, m)| {
                for k in &log_remove {
                    log.remove(k)?;
                }
                m.insert(SNAPSHOT_POINT, point.as_slice())?;
                m.insert(SNAPSHOT_MEMBERSHIP, membership.as_slice())?;
                m.insert(INSTALLING_STATE, point.as_slice())?;
                // The mark of an install an older release began and a crash interrupted.
                m.remove(INSTALLING)?;
                Ok::<(), ConflictableTransactionError<StorageError>>(())
            })
            .map_err(|e| tx_err("installing a snapshot", e))?;
        self.snapshot_meta = meta.clone();
        self.sled_unsynced = true;
        if self.segments.is_some() && !keep {
            // The new point must be durable before the log's reset can be: a reset on disk
            // beside the old point would lose entries the old state still needs.
            self.flush_sled()?;
        }
        if let Some(segments) = self.segments.as_mut() {
            if keep {
                segments.forget_through(meta.index);
            } else {
                segments.reset(meta.index, meta.term)?;
            }
        }
        if let Some(cached) = self.config_entries.get_mut() {
            *cached = if keep {
                cached.split_off(&(meta.index + 1))
            } else {
                Default::default()
            };
        }
        if !keep {
            self.last_index = meta.index;
        }
        self.last_index = self.last_index.max(meta.index);
        if !self.trimmer.request(meta.index) {
            LogTrimmer::trim(&self.log, meta.index)
                .map_err(|e| StorageError::sled("deleting log entries behind a snapshot", e))?;
        }
        Ok(())
    }

    /// Steps 3 and 4 of [`SledStorage::install`], at most `max_keys` keys removed or written
    /// per call. Returns whether the install is done (or none was under way).
    fn continue_install(&mut self, max_keys: usize) -> Result<bool, StorageError> {
        let Some(pending) = self.pending_install.as_mut() else {
            return self.remove_staged_chunks(max_keys);
        };
        let mut budget = max_keys.max(1);
        let batch_keys = self.install_batch_keys;
        if !pending.cleared {
            // The old state goes first, a batch at a time (what `sled::Tree::clear` does one
            // key at a time, in one call).
            loop {
                let keys: Vec<sled::IVec> = self
                    .state
                    .iter()
                    .keys()
                    .take(batch_keys.min(budget))
                    .collect::<Result<_, _>>()
                    .map_err(|e| StorageError::sled("reading the state for a snapshot", e))?;
                if keys.is_empty() {
                    pending.cleared = true;
                    break;
                }
                budget = budget.saturating_sub(keys.len());
                let mut batch = sled::Batch::default();
                for k in keys {
                    batch.remove(k);
                }
                self.state
                    .apply_batch(batch)
                    .map_err(|e| StorageError::sled("clearing the state for a snapshot", e))?;
                if budget == 0 {
                    return Ok(false);
                }
            }
        }
        let mut pairs = snapshot_pairs_from(&pending.data, pending.cursor);
        while budget > 0 {
            let mut batch = sled::Batch::default();
            let mut keys = 0;
            for (k, v) in pairs.by_ref().take(batch_keys.min(budget)) {
                batch.insert(k, encode_state_value(v));
                keys += 1;
            }
            if keys == 0 {
                break;
            }
            budget = budget.saturating_sub(keys);
            self.state
                .apply_batch(batch)
                .map_err(|e| StorageError::sled("writing a snapshot's state", e))?;
        }
        pending.cursor = pairs.cursor(&pending.data);
        if pending.cursor.left() > 0 {
            return Ok(false);
        }
        let index = pending.meta.index;
        let applied = encode_u64(index);
        (&self.meta, &self.staging)
            .transaction(|(m, staging)| {
                m.insert(APPLIED_INDEX, applied.as_slice())?;
                m.remove(INSTALLING_STATE)?;
                staging.remove(STAGING_META)?;
                Ok::<(), ConflictableTransactionError<StorageError>>(())
            })
            .map_err(|e| tx_err("finishing a snapshot install", e))?;
        self.pending_install = None;
        self.applied_index = index;
        self.sled_unsynced = true;
        self.staged_bytes = None;
        self.staged_garbage = true;
        self.remove_staged_chunks(max_keys)
    }

    /// Step 5 of [`SledStorage::install`]: removes up to `max_keys / 32` (at least one) of the
    /// chunks a finished install left in `staging` (a chunk of up to 512 KiB costs about as
    /// much to remove as 32 state keys to write). Returns whether none are left.
    fn remove_staged_chunks(&mut self, max_keys: usize) -> Result<bool, StorageError> {
        if !self.staged_garbage {
            return Ok(true);
        }
        let keys: Vec<sled::IVec> = self
            .staging
            .scan_prefix(b"chunk/")
            .keys()
            .take((max_keys / 32).max(1))
            .collect::<Result<_, _>>()
            .map_err(|e| StorageError::sled("reading staging", e))?;
        if keys.is_empty() {
            self.staged_garbage = false;
            self.staged_bytes = Some(0);
            return Ok(true);
        }
        self.sled_unsynced = true;
        for key in keys {
            self.staging
                .remove(key)
                .map_err(|e| StorageError::sled("removing a staged chunk", e))?;
        }
        Ok(false)
    }

    /// At open: chunks in `staging` without its meta record are what a finished install left
    /// (a crash came before step 5 of [`SledStorage::install`] was done); they go now.
    fn remove_staged_garbage(&mut self) -> Result<(), StorageError> {
        self.staged_garbage = self.staged_meta_record()?.is_none();
        while !self.remove_staged_chunks(usize::MAX)? {}
        Ok(())
    }

    /// An error if a snapshot's state is still being installed: `action` needs the state.
    fn check_no_install(&self, action: &'static str) -> Result<(), StorageError> {
        match &self.pending_install {
            Some(pending) => Err(StorageError::InstallInProgress {
                action,
                index: pending.meta.index,
            }),
            None => Ok(()),
        }
    }

    /// Whether `staging` holds a transfer of the snapshot `meta` with exactly `len` bytes.
    fn holds_staged(&mut self, meta: &SnapshotMeta, len: u64) -> Result<bool, StorageError> {
        let record = self.staged_meta_record()?;
        if record.as_deref() != Some(staging_meta_record(meta).as_slice()) {
            return Ok(false);
        }
        Ok(self.staged_len()? == len)
    }

    /// `staging`'s meta record, if a transfer was begun (see [`staging_meta_record`]).
    fn staged_meta_record(&self) -> Result<Option<sled::IVec>, StorageError> {
        self.staging
            .get(STAGING_META)
            .map_err(|e| StorageError::sled("reading staging", e))
    }

    /// Bytes of snapshot chunks in `staging` (counted once, then kept in `staged_bytes`).
    fn staged_len(&mut self) -> Result<u64, StorageError> {
        if let Some(staged) = self.staged_bytes {
            return Ok(staged);
        }
        let mut staged = 0u64;
        for item in self.staging.scan_prefix(b"chunk/") {
            let (_, v) = item.map_err(|e| StorageError::sled("reading staging", e))?;
            staged += v.len() as u64;
        }
        self.staged_bytes = Some(staged);
        Ok(staged)
    }

    /// The staged snapshot: its meta and data, as `begin_snapshot` and the chunks left them.
    fn read_staged(&self) -> Result<Option<(SnapshotMeta, Vec<u8>)>, StorageError> {
        let Some(meta_record) = self.staged_meta_record()? else {
            return Ok(None);
        };
        let (point, membership) = meta_record.split_at(meta_record.len().min(20));
        let (index, term) = decode_index_term(point).map_err(|e| e.at("staging", "meta".into()))?;
        let membership =
            decode_membership(membership).map_err(|e| e.at("staging", "meta".into()))?;
        let mut data = Vec::new();
        for item in self.staging.scan_prefix(b"chunk/") {
            let (_, v) = item.map_err(|e| StorageError::sled("reading staging", e))?;
            data.extend_from_slice(&v);
        }
        let meta = SnapshotMeta {
            index,
            term,
            membership,
        };
        Ok(Some((meta, data)))
    }

    /// At open: finishes a snapshot install a crash interrupted (see [`SledStorage::install`]).
    /// `meta/installing` is the mark of an older release, written before the point moved.
    fn resume_install(&mut self) -> Result<(), StorageError> {
        let (mark, point_moved) = match self.get_meta(INSTALLING_STATE)? {
            Some(mark) => (mark, true),
            None => match self.get_meta(INSTALLING)? {
                Some(mark) => (mark, false),
                None => return Ok(()),
            },
        };
        let (index, term) =
            decode_index_term(&mark).map_err(|e| e.at("meta", "installing".into()))?;
        let staged = self.read_staged()?;
        let Some((meta, data)) = staged.filter(|(m, _)| m.index == index && m.term == term) else {
            // Releases before the transfer was refused during an install let a newer
            // transfer replace the bytes an install needed. The snapshot point has moved and
            // the state is half written: nothing here can finish it.
            return Err(StorageError::Engine {
                action: "finishing an interrupted snapshot install",
                detail: format!(
                    "meta/installing names the snapshot at index {index} term {term}, but \
                     staging does not hold it, so the install cannot be finished. Rebuild the \
                     node from the cluster: remove it (`lockctl members remove --id <this \
                     node's id>`), then start it on an empty data directory with --join"
                ),
            });
        };
        tracing::warn!(
            index,
            term,
            "finishing a snapshot install interrupted by a crash"
        );
        let data = Bytes::from(data);
        if point_moved {
            let cursor = snapshot_pairs(&data)?.cursor(&data);
            self.pending_install = Some(PendingInstall {
                meta,
                data,
                cursor,
                cleared: false,
            });
            while !self.continue_install(usize::MAX)? {}
        } else {
            self.install(&meta, data, true)?;
        }
        self.resumed_install = Some(index);
        Ok(())
    }

    /// Chunks in `staging`, with or without its meta record.
    #[cfg(test)]
    pub(crate) fn staged_chunk_count(&self) -> usize {
        self.staging.scan_prefix(b"chunk/").count()
    }

    /// The index of the snapshot whose install, interrupted by a crash, this open finished.
    pub fn resumed_install(&self) -> Option<Index> {
        self.resumed_install
    }

    /// State keys written per sled batch when a snapshot is installed (at least 1). The
    /// default is what `raftlock-bench snapshot-install` found best; it compares others.
    pub fn set_install_batch_keys(&mut self, keys: usize) {
        self.install_batch_keys = keys.max(1);
    }

    /// How many of sled's blob files (see [`BlobSync`]) this open has synced.
    pub fn synced_blob_files(&self) -> u64 {
        self.blobs.synced_total
    }
}

/// The index a log key names, or an error naming the key.
fn log_key(key: &[u8]) -> Result<Index, StorageError> {
    decode_index_key(key).map_err(|e| e.at("log", format!("{key:?}")))
}

/// Groups consecutive entries into runs of about [`RUN_MAX_BYTES`], each kept as (key, value)
/// under its first index; a gap in the indexes also starts a new run.
struct RunBuilder {
    run: Vec<u8>,
    first: Index,
    next: Index,
    /// Capacity of each new run.
    capacity: usize,
    /// Runs closed and not yet taken.
    closed: Vec<(Vec<u8>, Vec<u8>)>,
}

impl RunBuilder {
    fn new(capacity: usize) -> Self {
        RunBuilder {
            run: Vec::new(),
            first: 0,
            next: 0,
            capacity: capacity.min(RUN_MAX_BYTES),
            closed: Vec::new(),
        }
    }

    /// The run that entry `index` goes into, closing the current one if it is full or `index`
    /// does not follow it.
    fn run_for(&mut self, index: Index) -> &mut Vec<u8> {
        if !self.run.is_empty() && (index != self.next || self.run.len() >= RUN_MAX_BYTES) {
            self.close();
        }
        if self.run.is_empty() {
            self.run = begin_run(self.capacity);
            self.first = index;
        }
        self.next = index + 1;
        &mut self.run
    }

    /// Closes the current run, if any.
    fn close(&mut self) {
        if !self.run.is_empty() {
            self.closed.push((
                index_key(self.first).to_vec(),
                std::mem::take(&mut self.run),
            ));
        }
    }

    /// Inserts the closed runs into `batch`.
    fn move_into(&mut self, batch: &mut sled::Batch) {
        for (k, v) in self.closed.drain(..) {
            batch.insert(k, v);
        }
    }
}

/// The only key left in the old `log` tree once its entries moved into runs. Not a log key (not
/// eight bytes) and after every log key, so a lock-node from before runs fails to open the
/// store with an error that shows this text, instead of taking the empty tree for an empty log
/// and forgetting entries it acknowledged.
const MOVED_MARKER: &[u8] =
    b"\xff\xff moved to log_runs: this data directory needs a lock-node that keeps its log in runs";

/// Moves the log of a store written before log runs (tree `log`, one entry per value) into
/// `log_runs`, consecutive entries grouped into runs, and leaves only [`MOVED_MARKER`] in the
/// old tree (one atomic batch, after the runs are flushed): a crash before that batch leaves the
/// old entries to migrate again at the next open. A new store gets the marker too.
fn migrate_old_log(db: &sled::Db, log: &sled::Tree) -> Result<(), StorageError> {
    let old = db
        .open_tree(OLD_LOG_TREE)
        .map_err(|e| StorageError::sled("opening the old log tree", e))?;
    let entries = old.len() - usize::from(old.contains_key(MOVED_MARKER).unwrap_or(false));
    if entries == 0 {
        if old.is_empty() {
            old.insert(MOVED_MARKER, &[][..])
                .map_err(|e| StorageError::sled("marking the old log tree", e))?;
        }
        return Ok(());
    }
    log.clear()
        .map_err(|e| StorageError::sled("clearing the log before migrating it", e))?;
    let mut batch = sled::Batch::default();
    let mut runs = RunBuilder::new(RUN_MAX_BYTES);
    let mut moved = sled::Batch::default();
    for item in old.iter() {
        let (k, v) = item.map_err(|e| StorageError::sled("reading the old log", e))?;
        moved.remove(k.clone());
        if k.as_ref() == MOVED_MARKER {
            continue;
        }
        let index = log_key(&k)?;
        decode_entry(index, &v)?;
        push_run_record(runs.run_for(index), &v);
        if runs.closed.len() >= LogTrimmer::BATCH_KEYS {
            runs.move_into(&mut batch);
            log.apply_batch(std::mem::take(&mut batch))
                .map_err(|e| StorageError::sled("migrating the log", e))?;
        }
    }
    runs.close();
    runs.move_into(&mut batch);
    log.apply_batch(batch)
        .map_err(|e| StorageError::sled("migrating the log", e))?;
    db.flush()
        .map_err(|e| StorageError::sled("flushing the migrated log", e))?;
    moved.insert(MOVED_MARKER, &[][..]);
    old.apply_batch(moved)
        .map_err(|e| StorageError::sled("emptying the old log tree", e))?;
    db.flush()
        .map_err(|e| StorageError::sled("flushing after the log migration", e))?;
    tracing::info!(entries, "moved the log into runs (tree log_runs)");
    Ok(())
}

fn changes_membership(entry: &Entry) -> bool {
    matches!(
        entry.payload,
        EntryPayload::Membership(_) | EntryPayload::Config(_)
    )
}

/// The applied state in `state` in key order, checksums verified.
fn read_state(state: &sled::Tree) -> Result<Vec<KvPair>, StorageError> {
    state_pairs(state).collect()
}

/// The applied state in `state` in key order, one pair at a time, checksums verified.
fn state_pairs(state: &sled::Tree) -> impl Iterator<Item = Result<KvPair, StorageError>> + '_ {
    state.iter().map(|item| {
        let (k, v) = item.map_err(|e| StorageError::sled("reading the state", e))?;
        let value = decode_state_value(&v).map_err(|e| e.at("state", state_key_name(&k)))?;
        Ok((k.to_vec(), value.to_vec()))
    })
}

impl Storage for SledStorage {
    fn recover(&self) -> Result<RecoveredState, StorageError> {
        let hard_state = match self.get_meta(HARD_STATE)? {
            Some(v) => decode_hard_state(&v).map_err(|e| e.at("meta", "hard_state".into()))?,
            None => HardState::default(),
        };
        let entries = self.read_entries(self.snapshot_meta.index + 1, Index::MAX)?;
        self.cache_config_entries(&entries);
        let membership = membership_after(&self.snapshot_meta.membership, &entries)?;
        let applied_state = self.read_state()?;
        let state = RecoveredState {
            hard_state,
            snapshot_meta: self.snapshot_meta.clone(),
            entries,
            membership,
            applied_index: self.applied_index,
            applied_state,
        };
        check_recovered(&state)?;
        Ok(state)
    }

    fn append(&mut self, entries: &[Entry]) -> Result<(), StorageError> {
        check_append(entries, self.snapshot_meta.index, self.last_index)?;
        let Some(first) = entries.first() else {
            return Ok(());
        };
        if self.segments.is_some() && self.hard_state_unsynced {
            self.flush_sled()?;
        }
        match self.segments.as_mut() {
            Some(segments) => segments.append(entries)?,
            None => self.append_runs(entries)?,
        }
        self.last_index = entries.last().map_or(self.last_index, |e| e.index);
        if let Some(cached) = self.config_entries.get_mut() {
            cached.split_off(&first.index);
            for entry in entries.iter().filter(|e| changes_membership(e)) {
                cached.insert(entry.index, entry.clone());
            }
        }
        Ok(())
    }

    fn set_hard_state(&mut self, hard_state: HardState) -> Result<(), StorageError> {
        self.meta
            .insert(HARD_STATE, encode_hard_state(&hard_state))
            .map_err(|e| StorageError::sled("writing the hard state", e))?;
        self.sled_unsynced = true;
        self.hard_state_unsynced = true;
        Ok(())
    }

    fn apply(&mut self, applied_index: Index, changes: &[KvChange]) -> Result<(), StorageError> {
        self.check_no_install("writing the applied state")?;
        if applied_index < self.applied_index {
            return Err(StorageError::AppliedIndexRegress {
                applied_index: self.applied_index,
                requested_index: applied_index,
            });
        }
        let applied = encode_u64(applied_index);
        let changes: Vec<(&[u8], Option<Vec<u8>>)> = changes
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_deref().map(encode_state_value)))
            .collect();
        (&self.state, &self.meta)
            .transaction(|(state, m)| {
                for (k, v) in &changes {
                    match v {
                        Some(v) => {
                            state.insert(*k, v.as_slice())?;
                        }
                        None => {
                            state.remove(*k)?;
                        }
                    }
                }
                m.insert(APPLIED_INDEX, applied.as_slice())?;
                Ok::<(), ConflictableTransactionError<StorageError>>(())
            })
            .map_err(|e| tx_err("applying state", e))?;
        self.applied_index = applied_index;
        self.sled_unsynced = true;
        Ok(())
    }

    fn install_snapshot(&mut self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), StorageError> {
        self.install(meta, Bytes::copy_from_slice(data), false)
    }

    fn begin_install(&mut self, meta: &SnapshotMeta, data: &Bytes) -> Result<(), StorageError> {
        self.start_install(meta, data.clone(), false)
    }

    fn begin_install_staged(
        &mut self,
        meta: &SnapshotMeta,
        data: &Bytes,
    ) -> Result<(), StorageError> {
        // An install still under way is finished first; that empties `staging`.
        self.finish_pending_install()?;
        let staged = self.holds_staged(meta, data.len() as u64)?;
        self.start_install(meta, data.clone(), staged)
    }

    fn continue_install(&mut self, max_pairs: usize) -> Result<bool, StorageError> {
        SledStorage::continue_install(self, max_pairs)
    }

    /// Refused while an install is under way: its snapshot's bytes are in `staging`, where the
    /// next open finds them if a crash interrupts it (see [`SledStorage::install`]).
    fn begin_snapshot(&mut self, meta: &SnapshotMeta) -> Result<(), StorageError> {
        self.check_no_install("staging a snapshot transfer")?;
        self.staged_bytes = None;
        self.sled_unsynced = true;
        self.staging
            .clear()
            .map_err(|e| StorageError::sled("clearing staging", e))?;
        self.staged_garbage = false;
        self.staging
            .insert(STAGING_META, staging_meta_record(meta))
            .map_err(|e| StorageError::sled("starting a snapshot", e))?;
        self.staged_bytes = Some(0);
        Ok(())
    }

    fn write_snapshot_chunk(&mut self, offset: u64, chunk: &[u8]) -> Result<(), StorageError> {
        self.check_no_install("staging a snapshot chunk")?;
        if self.staging.get(STAGING_META).ok().flatten().is_none() {
            return Err(StorageError::NoSnapshotInProgress);
        }
        let staged = self.staged_len()?;
        if offset != staged {
            return Err(StorageError::SnapshotChunkOutOfOrder {
                offset,
                expected_offset: staged,
            });
        }
        let mut key = b"chunk/".to_vec();
        key.extend_from_slice(&offset.to_be_bytes());
        self.staged_bytes = None;
        self.sled_unsynced = true;
        self.staging
            .insert(key, chunk)
            .map_err(|e| StorageError::sled("staging a chunk", e))?;
        self.staged_bytes = Some(staged + chunk.len() as u64);
        Ok(())
    }

    fn finish_snapshot(&mut self) -> Result<SnapshotMeta, StorageError> {
        self.check_no_install("finishing a snapshot transfer")?;
        let Some((meta, data)) = self.read_staged()? else {
            return Err(StorageError::NoSnapshotInProgress);
        };
        self.install(&meta, Bytes::from(data), true)?;
        Ok(meta)
    }

    /// The snapshot job, run right away: the driver calls this between applies, so the state
    /// read is exactly the state at the applied index.
    fn build_snapshot(&self) -> Result<Snapshot, StorageError> {
        self.snapshot_job()?()
    }

    fn snapshot_job(&self) -> Result<SnapshotJob, StorageError> {
        self.snapshot_job_with(Box::new(|pairs| pairs))
    }

    /// Reads the state tree, converts and encodes, on the job's thread: one pass.
    fn snapshot_job_with(&self, convert: PairsConvert) -> Result<SnapshotJob, StorageError> {
        self.check_no_install("building a snapshot")?;
        let index = self.applied_index;
        let meta = SnapshotMeta {
            index,
            term: self.term(index)?,
            membership: self.membership_at(index)?,
        };
        let state = self.state.clone();
        Ok(Box::new(move || {
            let data = encode_snapshot_stream(convert(Box::new(state_pairs(&state))))?;
            Ok(Snapshot { meta, data })
        }))
    }

    /// Records `upto` as the snapshot point; the entries at or below it are deleted by the
    /// background trimmer (see [`LogTrimmer`]), so a large compaction does not stall the caller.
    fn compact(&mut self, upto: Index) -> Result<(), StorageError> {
        if upto <= self.snapshot_meta.index {
            return Ok(());
        }
        if upto > self.applied_index {
            return Err(StorageError::CompactBeyondApplied {
                upto,
                applied_index: self.applied_index,
            });
        }
        let term = self.term(upto)?;
        let membership = self.membership_at(upto)?;
        let mut batch = sled::Batch::default();
        batch.insert(SNAPSHOT_POINT, encode_index_term(upto, term));
        batch.insert(SNAPSHOT_MEMBERSHIP, encode_membership(&membership));
        self.meta
            .apply_batch(batch)
            .map_err(|e| StorageError::sled("compacting the log", e))?;
        self.sled_unsynced = true;
        if let Some(segments) = self.segments.as_mut() {
            segments.forget_through(upto);
        } else if !self.trimmer.request(upto) {
            LogTrimmer::trim(&self.log, upto)
                .map_err(|e| StorageError::sled("deleting compacted log entries", e))?;
        }
        self.snapshot_meta = SnapshotMeta {
            index: upto,
            term,
            membership,
        };
        if let Some(cached) = self.config_entries.get_mut() {
            *cached = cached.split_off(&(upto + 1));
        }
        self.last_index = self.last_index.max(upto);
        Ok(())
    }

    fn entries(&self, lo: Index, hi: Index) -> Result<Vec<Entry>, StorageError> {
        super::check_entries_range(lo, hi, self.snapshot_meta.index, self.last_index)?;
        self.read_entries(lo, hi)
    }

    fn term(&self, index: Index) -> Result<Term, StorageError> {
        if index == self.snapshot_meta.index {
            return Ok(self.snapshot_meta.term);
        }
        if index < self.snapshot_meta.index {
            return Err(StorageError::Compacted {
                index,
                snapshot_index: self.snapshot_meta.index,
            });
        }
        if let Some(segments) = &self.segments {
            return segments.term(index).ok_or(StorageError::Unavailable {
                index,
                last_index: self.last_index,
            });
        }
        if let Some((k, v)) = self.run_holding(index)? {
            let first = log_key(&k)?;
            let records = run_records(first, &v)?;
            if let Some((_, record)) = records.get((index - first) as usize) {
                return Ok(decode_entry(index, record)?.term);
            }
        }
        Err(StorageError::Unavailable {
            index,
            last_index: self.last_index,
        })
    }

    fn first_index(&self) -> Index {
        self.snapshot_meta.index + 1
    }

    fn last_index(&self) -> Index {
        self.last_index
    }

    fn applied_index(&self) -> Index {
        self.applied_index
    }

    /// sled 0.34's own flush ends in `sync_file_range` on Linux: its log writes reach the
    /// drive, which survives the process dying, but neither the drive's write cache nor a grown
    /// file's size is flushed, so a power cut or a kernel crash could lose what was acknowledged.
    /// (sled calls `fsync` only from its background thread, every 500 ms.) So after sled's
    /// flush the log file is `fdatasync`ed as well, as etcd does with its log. Blob files that
    /// sled wrote since the last flush are synced first (see [`BlobSync`]).
    ///
    /// Under [`LogEngine::Segments`] sled is flushed only when it was written since its last
    /// flush, then the log's segment is `fdatasync`ed, and segments wholly at or below the
    /// durable snapshot point are deleted.
    fn start_flush(&mut self) -> Result<u64, StorageError> {
        if self.flusher.is_none() || self.hard_state_unsynced {
            // Without a flush thread, or for a changed term or vote, which must be durable
            // before any later log append (see `append`) and is rare: flushed here, after the
            // flushes in flight (`flush` waits for them), so every ticket handed out is done.
            self.flush()?;
            return Ok(self.flusher.as_ref().map_or(u64::MAX, Flusher::last_ticket));
        }
        self.blobs.sync_new()?;
        let sled = (self.segments.is_none() || self.sled_unsynced)
            .then(|| (self.db.clone(), std::sync::Arc::clone(&self.db_file)));
        let point = sled.as_ref().map(|_| self.snapshot_meta.index);
        self.sled_unsynced = false;
        let log = self
            .segments
            .as_mut()
            .map(SegmentLog::take_sync_job)
            .unwrap_or_default();
        self.flusher
            .as_mut()
            .ok_or(StorageError::Stopped)?
            .submit(FlushJob { sled, point, log })
    }

    fn flushed(&mut self) -> Result<u64, StorageError> {
        let Some(flusher) = self.flusher.as_ref() else {
            return Ok(u64::MAX);
        };
        let (ticket, point) = flusher.done()?;
        if let Some(point) = point.filter(|&p| p > self.durable_point) {
            self.durable_point = point;
            if let Some(segments) = self.segments.as_mut() {
                segments.remove_segments_through(point)?;
            }
        }
        Ok(ticket)
    }

    fn wait_flushed(&mut self) -> Result<(), StorageError> {
        if let Some(flusher) = self.flusher.as_ref() {
            flusher.wait()?;
        }
        self.flushed().map(|_| ())
    }

    fn flush(&mut self) -> Result<(), StorageError> {
        if let Some(flusher) = self.flusher.as_ref() {
            // What flushes in flight took off the log's books is durable only once they are.
            flusher.wait()?;
        }
        if self.segments.is_none() {
            return self.flush_sled();
        }
        if self.sled_unsynced {
            self.flush_sled()?;
        }
        let point = self.durable_point;
        if let Some(segments) = self.segments.as_mut() {
            segments.sync()?;
            segments.remove_segments_through(point)?;
        }
        Ok(())
    }
}
