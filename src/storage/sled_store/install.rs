//! Snapshots coming in: staging their chunks in `staging`, and the sliced, crash-safe install
//! (moving the point, writing the state in batches, finishing or resuming after a crash).

use bytes::Bytes;
use sled::transaction::ConflictableTransactionError;
use sled::Transactional;

use super::log::LogTrimmer;
use super::{
    tx_err, SledStorage, APPLIED_INDEX, INSTALLING, INSTALLING_STATE, SNAPSHOT_MEMBERSHIP,
    SNAPSHOT_POINT, STAGING_META,
};
use crate::raft::{Index, SnapshotMeta};
use crate::storage::codec::{
    decode_index_term, decode_membership, encode_index_term, encode_membership, encode_state_value,
    encode_u64,
};
use crate::storage::{snapshot_pairs, snapshot_pairs_from, PairsCursor, Storage, StorageError};

/// `staging`'s meta record for a transfer of the snapshot `meta`: its index and term (20
/// bytes), then its membership.
pub(super) fn staging_meta_record(meta: &SnapshotMeta) -> Vec<u8> {
    let mut record = encode_index_term(meta.index, meta.term);
    record.extend_from_slice(&encode_membership(&meta.membership));
    record
}

/// Size of the pieces a snapshot installed in one piece is staged in.
const STAGED_CHUNK_BYTES: usize = 1 << 20;

/// A snapshot whose point has moved and whose state is being written; see
/// [`SledStorage::install`].
pub(super) struct PendingInstall {
    meta: SnapshotMeta,
    data: Bytes,
    /// The next pair to write.
    cursor: PairsCursor,
    /// The old state is gone.
    cleared: bool,
}

impl SledStorage {
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
    pub(super) fn install(
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
    pub(super) fn start_install(
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
    pub(super) fn finish_pending_install(&mut self) -> Result<(), StorageError> {
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
    pub(super) fn continue_install(&mut self, max_keys: usize) -> Result<bool, StorageError> {
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
    pub(super) fn remove_staged_garbage(&mut self) -> Result<(), StorageError> {
        self.staged_garbage = self.staged_meta_record()?.is_none();
        while !self.remove_staged_chunks(usize::MAX)? {}
        Ok(())
    }

    /// An error if a snapshot's state is still being installed: `action` needs the state.
    pub(super) fn check_no_install(&self, action: &'static str) -> Result<(), StorageError> {
        match &self.pending_install {
            Some(pending) => Err(StorageError::InstallInProgress {
                action,
                index: pending.meta.index,
            }),
            None => Ok(()),
        }
    }

    /// Whether `staging` holds a transfer of the snapshot `meta` with exactly `len` bytes.
    pub(super) fn holds_staged(
        &mut self,
        meta: &SnapshotMeta,
        len: u64,
    ) -> Result<bool, StorageError> {
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
    pub(super) fn staged_len(&mut self) -> Result<u64, StorageError> {
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
    pub(super) fn read_staged(&self) -> Result<Option<(SnapshotMeta, Vec<u8>)>, StorageError> {
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
    pub(super) fn resume_install(&mut self) -> Result<(), StorageError> {
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
}
