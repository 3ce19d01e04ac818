//! The [`Storage`] implementation of [`SledStorage`], built on the other modules.

use bytes::Bytes;
use sled::transaction::ConflictableTransactionError;
use sled::Transactional;

#[cfg(doc)]
use super::flush::BlobSync;
use super::install::staging_meta_record;
use super::log::{changes_membership, log_key, LogTrimmer};
use super::state::state_pairs;
#[cfg(doc)]
use super::LogEngine;
use super::{
    tx_err, SledStorage, APPLIED_INDEX, HARD_STATE, SNAPSHOT_MEMBERSHIP, SNAPSHOT_POINT,
    STAGING_META,
};
use crate::raft::{Entry, HardState, Index, Snapshot, SnapshotMeta, Term};
use crate::storage::codec::{
    decode_entry, decode_hard_state, encode_hard_state, encode_index_term, encode_membership,
    encode_state_value, encode_u64, run_records,
};
use crate::storage::flusher::{FlushJob, Flusher};
use crate::storage::segment_log::SegmentLog;
use crate::storage::{
    check_append, check_recovered, encode_snapshot_stream, membership_after, KvChange,
    PairsConvert, RecoveredState, SnapshotJob, Storage, StorageError,
};

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
        crate::storage::check_entries_range(lo, hi, self.snapshot_meta.index, self.last_index)?;
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
