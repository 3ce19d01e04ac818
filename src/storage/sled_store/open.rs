//! Opening a store: removing the snapshot files sled leaves unfinished after a kill, opening
//! the trees and the log engine, migrating a log written before runs, and loading the cached
//! snapshot point and log bounds.

use std::path::Path;

use super::flush::BlobSync;
use super::log::{log_key, LogTrimmer, RunBuilder};
use super::options::{LogEngine, SledOptions};
use super::{
    SledStorage, APPLIED_INDEX, INSTALL_BATCH_KEYS, LOG_TREE, OLD_LOG_TREE, RUN_MAX_BYTES,
    SEGMENT_DIR, SLED_LOG_FILE, SNAPSHOT_MEMBERSHIP, SNAPSHOT_POINT,
};
use crate::raft::{Membership, SnapshotMeta};
use crate::storage::codec::{
    decode_entry, decode_index_term, decode_membership, decode_u64, push_run_record, run_last_index,
};
use crate::storage::segment_log::SegmentLog;
use crate::storage::StorageError;

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
        let meta = tree("meta")?;
        // Auto keeps a written store's engine (sled unless it has segments) and gives a store
        // that was never written (no log, no hard state or snapshot point) segments.
        let engine = match options.log_engine {
            LogEngine::Auto
                if SegmentLog::exists_in(&segment_dir)? || (log.is_empty() && meta.is_empty()) =>
            {
                LogEngine::Segments
            }
            LogEngine::Auto => LogEngine::Sled,
            chosen => chosen,
        };
        let segments = if engine == LogEngine::Sled {
            if SegmentLog::exists_in(&segment_dir)? {
                return Err(StorageError::LogEngineMismatch {
                    found: LogEngine::Segments.name(),
                    asked: LogEngine::Sled.name(),
                });
            }
            None
        } else {
            if !log.is_empty() {
                return Err(StorageError::LogEngineMismatch {
                    found: LogEngine::Sled.name(),
                    asked: LogEngine::Segments.name(),
                });
            }
            Some(SegmentLog::open(&segment_dir, options.segment_bytes)?)
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
            meta,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::conformance::{commands, reopen_sled_with};
    use crate::storage::Storage;

    fn with(log_engine: LogEngine) -> SledOptions {
        SledOptions {
            log_engine,
            ..SledOptions::default()
        }
    }

    /// `auto` gives a new store segments and keeps every written store on its own engine, so
    /// an upgraded node whose default changed reads the log it wrote.
    #[test]
    fn auto_chooses_segments_for_a_new_store_and_keeps_a_written_ones_engine() {
        let new = tempfile::tempdir().unwrap();
        let mut store = reopen_sled_with(new.path(), with(LogEngine::Auto)).unwrap();
        assert_eq!(store.log_engine(), LogEngine::Segments);
        store.append(&commands(1, 3, 1)).unwrap();
        store.flush().unwrap();
        drop(store);
        let store = reopen_sled_with(new.path(), with(LogEngine::Auto)).unwrap();
        assert_eq!(store.log_engine(), LogEngine::Segments);
        assert_eq!(store.recover().unwrap().entries, commands(1, 3, 1));
        drop(store);

        let written = tempfile::tempdir().unwrap();
        let mut store = reopen_sled_with(written.path(), with(LogEngine::Sled)).unwrap();
        store.append(&commands(1, 2, 1)).unwrap();
        store.flush().unwrap();
        drop(store);
        let mut store = reopen_sled_with(written.path(), with(LogEngine::Auto)).unwrap();
        assert_eq!(store.log_engine(), LogEngine::Sled);
        assert_eq!(store.recover().unwrap().entries, commands(1, 2, 1));
        store.append(&commands(3, 3, 1)).unwrap();
        store.flush().unwrap();
        drop(store);
        // Still sled, and sled named explicitly opens it too.
        let mut store = reopen_sled_with(written.path(), with(LogEngine::Sled)).unwrap();
        assert_eq!(store.recover().unwrap().entries, commands(1, 3, 1));
        // Compacted to its last entry, its log tree may be empty: it stays sled all the same.
        store.apply(3, &[]).unwrap();
        store.compact(3).unwrap();
        store.flush().unwrap();
        drop(store);
        let mut store = reopen_sled_with(written.path(), with(LogEngine::Auto)).unwrap();
        assert_eq!(store.log_engine(), LogEngine::Sled);
        assert_eq!(store.last_index(), 3);
        store.append(&commands(4, 4, 1)).unwrap();
        store.flush().unwrap();
        drop(store);
        let store = reopen_sled_with(written.path(), with(LogEngine::Auto)).unwrap();
        assert_eq!(store.log_engine(), LogEngine::Sled);
        assert_eq!(store.recover().unwrap().entries, commands(4, 4, 1));
    }

    #[test]
    fn auto_parses_and_names_itself() {
        assert_eq!("auto".parse::<LogEngine>(), Ok(LogEngine::Auto));
        assert_eq!(LogEngine::Auto.to_string(), "auto");
        let err = "rocksdb".parse::<LogEngine>().unwrap_err();
        assert!(err.contains("auto, sled or segments"), "{err}");
    }
}
