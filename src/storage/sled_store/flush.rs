//! Durability: flushing sled and `fdatasync`ing its log file, syncing the blob files sled
//! keeps large values in, and handing flushes to a background thread.

use std::path::Path;

use super::SledStorage;
use crate::storage::flusher::{FlushObserver, FlushWaker, Flusher};
use crate::storage::{Storage, StorageError};

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
pub(super) struct BlobSync {
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

    pub(super) fn new(store_dir: &Path) -> Self {
        BlobSync {
            dir: store_dir.join("blobs"),
            handle: None,
            listed_mtime: None,
            synced: Default::default(),
            synced_total: 0,
        }
    }

    /// Syncs the blob files not synced yet, and then the directory if there were any.
    pub(super) fn sync_new(&mut self) -> Result<(), StorageError> {
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

impl SledStorage {
    /// Makes every sled write so far durable (see [`Storage::flush`]).
    pub(super) fn flush_sled(&mut self) -> Result<(), StorageError> {
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

    /// How many of sled's blob files (see [`BlobSync`]) this open has synced.
    pub fn synced_blob_files(&self) -> u64 {
        self.blobs.synced_total
    }
}
