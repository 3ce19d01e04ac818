//! The Raft log in the `log_runs` tree: runs of entries (appending, reading, the membership at
//! an index), and the background thread that deletes compacted entries.

use super::LogEngine;
#[cfg(test)]
use super::OLD_LOG_TREE;
use super::{SledStorage, RUN_MAX_BYTES};
use crate::raft::{Entry, EntryPayload, Index, Membership};
use crate::storage::codec::{
    begin_run, decode_entry, decode_index_key, index_key, push_run_entry, push_run_record,
    run_last_index, run_records,
};
use crate::storage::segment_log::SegmentLog;
#[cfg(doc)]
use crate::storage::Storage;
use crate::storage::{membership_after, StorageError};

/// A thread that deletes log entries at or below the snapshot point after a compaction.
///
/// A compaction first records the new snapshot point in `meta`; from then on entries at or below
/// it are never read (recovery and `entries` start after the point), so deleting them is only
/// reclaiming space and need not happen on the caller's thread. Deletes are issued after the
/// point was written, and sled recovers a prefix of its writes, so no crash can lose the point
/// but keep the deletes.
pub(super) struct LogTrimmer {
    requests: Option<std::sync::mpsc::Sender<Index>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LogTrimmer {
    pub(super) const BATCH_KEYS: usize = 1024;

    pub(super) fn start(log: sled::Tree) -> Self {
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
    pub(super) fn trim(log: &sled::Tree, upto: Index) -> sled::Result<()> {
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
    pub(super) fn request(&self, upto: Index) -> bool {
        self.requests
            .as_ref()
            .is_some_and(|tx| tx.send(upto).is_ok())
    }

    /// Finishes the queued deletions and ends the thread. Closing the channel ends the thread
    /// once the queue is drained; joining releases its handle on the database.
    pub(super) fn stop(&mut self) {
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

impl SledStorage {
    /// [`Storage::append`] into the `log_runs` tree: `entries` (checked, not empty) as runs.
    pub(super) fn append_runs(&mut self, entries: &[Entry]) -> Result<(), StorageError> {
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

    /// Number of log segment files under [`LogEngine::Segments`].
    /// The engine this store keeps its Raft log in (never [`LogEngine::Auto`]: the one it chose).
    pub fn log_engine(&self) -> LogEngine {
        if self.segments.is_some() {
            LogEngine::Segments
        } else {
            LogEngine::Sled
        }
    }

    pub fn log_segments(&self) -> Option<usize> {
        self.segments.as_ref().map(SegmentLog::segment_count)
    }

    pub(super) fn read_entries(&self, lo: Index, hi: Index) -> Result<Vec<Entry>, StorageError> {
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
    pub(super) fn run_holding(
        &self,
        index: Index,
    ) -> Result<Option<(sled::IVec, sled::IVec)>, StorageError> {
        self.log
            .range(..=index_key(index))
            .next_back()
            .transpose()
            .map_err(|e| StorageError::sled("reading the log", e))
    }

    pub(super) fn membership_at(&self, index: Index) -> Result<Membership, StorageError> {
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
    pub(super) fn cache_config_entries(&self, entries: &[Entry]) {
        let _ = self.config_entries.set(
            entries
                .iter()
                .filter(|e| changes_membership(e))
                .map(|e| (e.index, e.clone()))
                .collect(),
        );
    }
}

/// The index a log key names, or an error naming the key.
pub(super) fn log_key(key: &[u8]) -> Result<Index, StorageError> {
    decode_index_key(key).map_err(|e| e.at("log", format!("{key:?}")))
}

/// Groups consecutive entries into runs of about [`RUN_MAX_BYTES`], each kept as (key, value)
/// under its first index; a gap in the indexes also starts a new run.
pub(super) struct RunBuilder {
    run: Vec<u8>,
    first: Index,
    next: Index,
    /// Capacity of each new run.
    capacity: usize,
    /// Runs closed and not yet taken.
    pub(super) closed: Vec<(Vec<u8>, Vec<u8>)>,
}

impl RunBuilder {
    pub(super) fn new(capacity: usize) -> Self {
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
    pub(super) fn run_for(&mut self, index: Index) -> &mut Vec<u8> {
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
    pub(super) fn close(&mut self) {
        if !self.run.is_empty() {
            self.closed.push((
                index_key(self.first).to_vec(),
                std::mem::take(&mut self.run),
            ));
        }
    }

    /// Inserts the closed runs into `batch`.
    pub(super) fn move_into(&mut self, batch: &mut sled::Batch) {
        for (k, v) in self.closed.drain(..) {
            batch.insert(k, v);
        }
    }
}

pub(super) fn changes_membership(entry: &Entry) -> bool {
    matches!(
        entry.payload,
        EntryPayload::Membership(_) | EntryPayload::Config(_)
    )
}
