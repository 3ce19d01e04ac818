//! [`SimSegmentsStorage`]: the segments log engine's own code ([`super::segment_log`]) on a
//! simulated disk ([`SimDisk`]) for the Raft log, and [`MemStorage`] for everything else (hard
//! state, applied state, snapshot point, staged snapshots), for the simulator.
//!
//! The two parts are kept in step as the sled store keeps sled and its segments: a flush syncs
//! the log first, then makes the MemStorage image durable; a changed term or vote is made
//! durable before a log append; a moved snapshot point is made durable before the log's reset
//! record is written; segments are deleted only through the durable snapshot point; and an
//! open reconciles the log with the snapshot point (a reset when the entry at the point is not
//! the snapshot's). A sync of the log can make durable more than the flush that started it
//! (later writes to the same file), as a real `fdatasync` does.
//!
//! A crash is a [`SimDisk::power_cut`] (the last unsynced write may be torn) followed by an
//! open of the log, which may fail: then [`Storage::recover`] reports why (for a damaged
//! sector below the synced mark, [`StorageError::LogDamagedBelowSynced`]).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::logfs::{SimDisk, SimDiskStats};
use super::segment_log::{damage_range, segment_seq, SegmentLog, SegmentSync};
use super::{
    check_append, membership_after, KvChange, MemStorage, RecoveredState, Storage, StorageError,
};
use crate::raft::{Entry, HardState, Index, Membership, Snapshot, SnapshotMeta, Term};

/// Segment size on the simulated disk: small, so that runs roll over and delete segments.
pub const SIM_SEGMENT_BYTES: u64 = 8 * 1024;

/// Why the log did not open after the last crash.
#[derive(Clone, Debug)]
enum OpenFailure {
    Damaged {
        file: String,
        offset: u64,
        synced_to: u64,
        problem: String,
    },
    Other(String),
}

/// The real segments engine on a [`SimDisk`], with [`MemStorage`] for the rest.
pub struct SimSegmentsStorage {
    mem: MemStorage,
    disk: SimDisk,
    dir: PathBuf,
    segment_bytes: u64,
    /// `None` when it did not open (see `failure`).
    log: Option<SegmentLog>,
    failure: Option<OpenFailure>,
    /// The log's sync for each background flush waiting in `mem`, oldest first.
    syncs: VecDeque<SegmentSync>,
    /// The disk lost power inside a flush; the crash that follows is the same power cut.
    cut: bool,
    rng: ChaCha8Rng,
}

fn log_closed() -> StorageError {
    StorageError::Engine {
        action: "using the log",
        detail: "the log's segments did not open after the last crash".into(),
    }
}

impl SimSegmentsStorage {
    /// A store on an empty simulated disk; `seed` draws where power cuts tear writes and
    /// which sectors go bad.
    pub fn new(seed: u64) -> Self {
        Self::with_segment_bytes(seed, SIM_SEGMENT_BYTES)
    }

    pub fn with_segment_bytes(seed: u64, segment_bytes: u64) -> Self {
        let mut store = SimSegmentsStorage {
            mem: MemStorage::new(),
            disk: SimDisk::new(),
            dir: PathBuf::from("/sim/log"),
            segment_bytes,
            log: None,
            failure: None,
            syncs: VecDeque::new(),
            cut: false,
            rng: ChaCha8Rng::seed_from_u64(seed),
        };
        store.open_log();
        store
    }

    pub fn disk(&self) -> &SimDisk {
        &self.disk
    }

    pub fn disk_stats(&self) -> SimDiskStats {
        self.disk.stats()
    }

    /// The log's directory on the simulated disk.
    pub fn log_dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the log did not open after the last crash because of damage below its synced
    /// mark.
    pub fn log_damaged(&self) -> bool {
        matches!(self.failure, Some(OpenFailure::Damaged { .. }))
    }

    pub fn segment_count(&self) -> usize {
        self.log.as_ref().map_or(0, SegmentLog::segment_count)
    }

    /// Opens the log on the disk as a restarted node would, and reconciles it with the
    /// snapshot point (as the sled store's open does).
    fn open_log(&mut self) {
        self.log = None;
        self.failure = None;
        self.syncs.clear();
        let fs: Arc<dyn super::logfs::LogFs> = Arc::new(self.disk.clone());
        let opened = SegmentLog::open_on(fs, &self.dir, self.segment_bytes).and_then(|mut log| {
            let SnapshotMeta { index, term, .. } = *self.mem.snapshot_meta();
            if log.term(index).is_some_and(|t| t != term) {
                log.reset(index, term)?;
                log.sync()?;
            }
            log.forget_through(index);
            if let Some(first) = log.first_index() {
                if first > index + 1 {
                    return Err(StorageError::LogGap {
                        expected_index: index + 1,
                        found_index: first,
                    });
                }
            }
            Ok(log)
        });
        match opened {
            Ok(log) => self.log = Some(log),
            Err(StorageError::LogDamagedBelowSynced {
                file,
                offset,
                synced_to,
                problem,
            }) => {
                self.failure = Some(OpenFailure::Damaged {
                    file,
                    offset,
                    synced_to,
                    problem,
                })
            }
            Err(other) => self.failure = Some(OpenFailure::Other(other.to_string())),
        }
    }

    /// Loses the power: everything not synced (a torn last write aside) and every flush not
    /// done; then the log is opened again.
    pub fn crash(&mut self) {
        if !std::mem::take(&mut self.cut) {
            self.disk.power_cut(&mut self.rng);
        }
        self.mem.crash();
        self.open_log();
    }

    /// A latent sector error in the log's synced records (where the engine must find it:
    /// below the newest segment's synced mark, or anywhere in an older segment), then the log
    /// is opened again. Returns whether a sector was damaged (none is when nothing is synced
    /// there yet).
    pub fn corrupt_synced_sector(&mut self) -> bool {
        let newest = self
            .disk
            .files_in(&self.dir)
            .iter()
            .filter_map(|p| segment_seq(p))
            .max();
        let dir = self.dir.clone();
        let damaged = self
            .disk
            .corrupt_synced_sector(&mut self.rng, |path, bytes| {
                if path.parent() != Some(dir.as_path()) {
                    return 0..0;
                }
                let is_newest = segment_seq(path).is_some() && segment_seq(path) == newest;
                damage_range(path, bytes, is_newest)
            })
            .is_some();
        if damaged {
            self.open_log();
        }
        damaged
    }

    pub fn set_background_flushes(&mut self, on: bool) {
        self.mem.set_background_flushes(on);
    }

    pub fn has_pending_flushes(&self) -> bool {
        self.mem.has_pending_flushes()
    }

    pub fn arm_power_cut(&mut self, on_vote_only: bool) {
        self.mem.arm_power_cut(on_vote_only);
    }

    pub fn disarm_power_cut(&mut self) {
        self.mem.disarm_power_cut();
    }

    pub fn install_pending(&self) -> bool {
        self.mem.install_pending()
    }

    pub fn staged_len(&self) -> (usize, usize) {
        self.mem.staged_len()
    }

    fn log(&self) -> Result<&SegmentLog, StorageError> {
        self.log.as_ref().ok_or_else(log_closed)
    }

    fn log_mut(&mut self) -> Result<&mut SegmentLog, StorageError> {
        self.log.as_mut().ok_or_else(log_closed)
    }

    /// Deletes the segments wholly at or below the durable snapshot point.
    fn remove_segments(&mut self) -> Result<(), StorageError> {
        let point = self.mem.durable_snapshot_index();
        self.log_mut()?.remove_segments_through(point)?;
        Ok(())
    }

    /// Everything written made durable now, the flushes waiting included: the log, then the
    /// rest (no power cut strikes here).
    fn persist_now(&mut self) -> Result<(), StorageError> {
        for job in std::mem::take(&mut self.syncs) {
            job.run()?;
        }
        self.log_mut()?.sync()?;
        self.mem.persist_all();
        Ok(())
    }

    /// The disk finishes the background flushes started so far, in order: each one's log
    /// sync, then its image. An armed power cut strikes as in [`MemStorage`].
    pub fn complete_flushes(&mut self) {
        while let Some(strikes) = self.mem.next_flush_strikes() {
            if strikes {
                self.disk.power_cut(&mut self.rng);
                self.cut = true;
                // Crashes the image and reports the cut at the next `flushed`.
                self.mem.complete_flushes();
                self.open_log();
                return;
            }
            if let Some(job) = self.syncs.pop_front() {
                if let Err(err) = job.run() {
                    self.failure = Some(OpenFailure::Other(err.to_string()));
                    self.log = None;
                    return;
                }
            }
            self.mem.complete_one_flush();
            if self.log.is_some() && self.remove_segments().is_err() {
                self.log = None;
            }
        }
    }

    fn membership_at(&self, index: Index) -> Result<Membership, StorageError> {
        let meta = self.mem.snapshot_meta();
        let entries = if index > meta.index {
            self.log()?.read(meta.index + 1, index + 1)?
        } else {
            Vec::new()
        };
        membership_after(&meta.membership, &entries)
    }

    /// Whether an install of `meta` keeps the log after it (Raft §7).
    fn keeps_log(&self, meta: &SnapshotMeta) -> bool {
        self.term(meta.index).ok() == Some(meta.term)
    }

    /// After the snapshot point moved to `meta`: the log keeps what follows it, or starts over
    /// after it once the new point is durable.
    fn trim_log_for(&mut self, meta: &SnapshotMeta, keep: bool) -> Result<(), StorageError> {
        if keep {
            self.log_mut()?.forget_through(meta.index);
            Ok(())
        } else {
            self.persist_now()?;
            self.log_mut()?.reset(meta.index, meta.term)
        }
    }
}

impl Storage for SimSegmentsStorage {
    fn recover(&self) -> Result<RecoveredState, StorageError> {
        match &self.failure {
            Some(OpenFailure::Damaged {
                file,
                offset,
                synced_to,
                problem,
            }) => {
                return Err(StorageError::LogDamagedBelowSynced {
                    file: file.clone(),
                    offset: *offset,
                    synced_to: *synced_to,
                    problem: problem.clone(),
                })
            }
            Some(OpenFailure::Other(detail)) => {
                return Err(StorageError::Engine {
                    action: "opening the log",
                    detail: detail.clone(),
                })
            }
            None => {}
        }
        let first = self.first_index();
        let entries = self.log()?.read(first, self.last_index() + 1)?;
        self.mem.recover_with_log(entries)
    }

    fn append(&mut self, entries: &[Entry]) -> Result<(), StorageError> {
        check_append(entries, self.mem.snapshot_meta().index, self.last_index())?;
        if entries.is_empty() {
            return Ok(());
        }
        if self.mem.hard_state_unsynced() {
            // A term or vote is durable before any entry appended after it can be.
            self.persist_now()?;
        }
        self.log_mut()?.append(entries)
    }

    fn set_hard_state(&mut self, hard_state: HardState) -> Result<(), StorageError> {
        self.mem.set_hard_state(hard_state)
    }

    fn apply(&mut self, applied_index: Index, changes: &[KvChange]) -> Result<(), StorageError> {
        self.mem.apply(applied_index, changes)
    }

    fn install_snapshot(&mut self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), StorageError> {
        self.log()?;
        let keep = self.keeps_log(meta);
        self.mem.install_snapshot(meta, data)?;
        self.trim_log_for(meta, keep)
    }

    fn begin_install(&mut self, meta: &SnapshotMeta, data: &Bytes) -> Result<(), StorageError> {
        self.log()?;
        let keep = self.keeps_log(meta);
        self.mem.begin_install(meta, data)?;
        self.trim_log_for(meta, keep)
    }

    fn begin_install_staged(
        &mut self,
        meta: &SnapshotMeta,
        data: &Bytes,
    ) -> Result<(), StorageError> {
        self.log()?;
        let keep = self.keeps_log(meta);
        self.mem.begin_install_staged(meta, data)?;
        self.trim_log_for(meta, keep)
    }

    fn continue_install(&mut self, max_pairs: usize) -> Result<bool, StorageError> {
        self.mem.continue_install(max_pairs)
    }

    fn begin_snapshot(&mut self, meta: &SnapshotMeta) -> Result<(), StorageError> {
        self.mem.begin_snapshot(meta)
    }

    fn write_snapshot_chunk(&mut self, offset: u64, chunk: &[u8]) -> Result<(), StorageError> {
        self.mem.write_snapshot_chunk(offset, chunk)
    }

    fn finish_snapshot(&mut self) -> Result<SnapshotMeta, StorageError> {
        self.log()?;
        let keep = self.mem.staged_meta().is_some_and(|m| self.keeps_log(&m));
        let meta = self.mem.finish_snapshot()?;
        self.trim_log_for(&meta, keep)?;
        Ok(meta)
    }

    fn build_snapshot(&self) -> Result<Snapshot, StorageError> {
        self.mem.check_no_install_for("building a snapshot")?;
        let index = self.mem.applied_index();
        let meta = SnapshotMeta {
            index,
            term: self.term(index)?,
            membership: self.membership_at(index)?,
        };
        Ok(Snapshot {
            meta,
            data: self.mem.encode_state(),
        })
    }

    fn compact(&mut self, upto: Index) -> Result<(), StorageError> {
        if upto <= self.mem.snapshot_meta().index {
            return Ok(());
        }
        let applied_index = self.mem.applied_index();
        if upto > applied_index {
            return Err(StorageError::CompactBeyondApplied {
                upto,
                applied_index,
            });
        }
        let term = self.term(upto)?;
        let membership = self.membership_at(upto)?;
        self.mem.set_snapshot_point(SnapshotMeta {
            index: upto,
            term,
            membership,
        });
        self.log_mut()?.forget_through(upto);
        Ok(())
    }

    fn entries(&self, lo: Index, hi: Index) -> Result<Vec<Entry>, StorageError> {
        super::check_entries_range(lo, hi, self.mem.snapshot_meta().index, self.last_index())?;
        if lo >= hi {
            return Ok(Vec::new());
        }
        self.log()?.read(lo, hi)
    }

    fn term(&self, index: Index) -> Result<Term, StorageError> {
        let meta = self.mem.snapshot_meta();
        if index == meta.index {
            return Ok(meta.term);
        }
        if index < meta.index {
            return Err(StorageError::Compacted {
                index,
                snapshot_index: meta.index,
            });
        }
        self.log()?.term(index).ok_or(StorageError::Unavailable {
            index,
            last_index: self.last_index(),
        })
    }

    fn first_index(&self) -> Index {
        self.mem.first_index()
    }

    fn last_index(&self) -> Index {
        let snapshot_index = self.mem.snapshot_meta().index;
        self.log
            .as_ref()
            .and_then(SegmentLog::last_index)
            .filter(|&last| last > snapshot_index)
            .unwrap_or(snapshot_index)
    }

    fn applied_index(&self) -> Index {
        self.mem.applied_index()
    }

    fn flush(&mut self) -> Result<(), StorageError> {
        if self.mem.flush_strikes() {
            self.disk.power_cut(&mut self.rng);
            self.cut = true;
            let struck = self.mem.flush();
            self.open_log();
            return struck;
        }
        self.persist_now()?;
        self.mem.flush()?;
        self.remove_segments()
    }

    fn start_flush(&mut self) -> Result<u64, StorageError> {
        if !self.mem.background_flushes() {
            self.flush()?;
            return self.flushed();
        }
        let job = self.log_mut()?.take_sync_job();
        let ticket = self.mem.start_flush()?;
        self.syncs.push_back(job);
        Ok(ticket)
    }

    fn flushed(&mut self) -> Result<u64, StorageError> {
        self.mem.flushed()
    }

    fn wait_flushed(&mut self) -> Result<(), StorageError> {
        self.complete_flushes();
        self.flushed().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft::EntryPayload;
    use crate::storage::logfs::{LogFs, SECTOR};

    fn entry(index: Index, term: Term, len: usize) -> Entry {
        Entry {
            index,
            term,
            payload: EntryPayload::Command(Bytes::from(vec![index as u8; len])),
        }
    }

    #[test]
    fn a_power_cut_keeps_only_what_was_synced() {
        let disk = SimDisk::new();
        let dir = Path::new("/d");
        disk.create_dir_all(dir).unwrap();
        let a = disk.create_new(&dir.join("a")).unwrap();
        a.write_all_at(b"synced", 0).unwrap();
        a.sync_data().unwrap();
        disk.sync_dir(dir).unwrap();
        a.write_all_at(b"SYNCED", 0).unwrap();
        // A file whose directory entry was never synced.
        let b = disk.create_new(&dir.join("b")).unwrap();
        b.write_all_at(b"data", 0).unwrap();
        b.sync_data().unwrap();
        // The last write (to `b`) is whole or gone; `a`'s unsynced write is gone.
        disk.power_cut(&mut ChaCha8Rng::seed_from_u64(1));
        assert_eq!(disk.durable_bytes(&dir.join("a")).unwrap(), b"synced");
        let a = disk.open(&dir.join("a")).unwrap();
        assert_eq!(a.read_all().unwrap(), b"synced");
        assert!(
            disk.open(&dir.join("b")).is_err(),
            "b's entry was never synced"
        );
        assert_eq!(disk.stats().power_cuts, 1);
    }

    #[test]
    fn a_torn_write_keeps_a_sector_aligned_prefix() {
        let mut torn = 0;
        for seed in 0..64 {
            let disk = SimDisk::new();
            let dir = Path::new("/d");
            disk.create_dir_all(dir).unwrap();
            let f = disk.create_new(&dir.join("f")).unwrap();
            f.write_all_at(&[1; 100], 0).unwrap();
            f.sync_data().unwrap();
            disk.sync_dir(dir).unwrap();
            // Starts mid-sector and spans four sector boundaries.
            let start = 100u64;
            f.write_all_at(&[7; 2000], start).unwrap();
            let was_torn = disk.power_cut(&mut ChaCha8Rng::seed_from_u64(seed));
            let bytes = disk.durable_bytes(&dir.join("f")).unwrap();
            assert_eq!(&bytes[..100], &[1; 100]);
            let kept = bytes.len().saturating_sub(start as usize);
            assert!(bytes[100..].iter().all(|b| *b == 7));
            let end = start as usize + kept;
            assert!(
                kept == 0 || kept == 2000 || end.is_multiple_of(SECTOR as usize),
                "seed {seed}: kept {kept} bytes ending at {end}"
            );
            assert_eq!(was_torn, kept > 0 && kept < 2000);
            torn += usize::from(was_torn);
        }
        assert!(torn > 0);
    }

    #[test]
    fn a_torn_log_write_is_dropped_and_the_synced_entries_stay() {
        let mut torn = 0;
        for seed in 0..32 {
            let mut store = SimSegmentsStorage::with_segment_bytes(seed, 64 * 1024);
            let entries: Vec<Entry> = (1..=4).map(|i| entry(i, 1, 300)).collect();
            store.append(&entries).unwrap();
            store.flush().unwrap();
            store.append(&[entry(5, 1, 3000)]).unwrap();
            store.crash();
            let recovered = store.recover().unwrap();
            let last = recovered.last_index();
            assert!(last == 4 || last == 5, "seed {seed}: last {last}");
            assert_eq!(recovered.entries[..4], entries[..]);
            torn += store.disk_stats().torn_writes;
        }
        assert!(torn > 0);
    }

    #[test]
    fn a_corrupt_synced_sector_is_damage_below_the_mark() {
        for seed in 0..16 {
            let mut store = SimSegmentsStorage::with_segment_bytes(seed, 4 * 1024);
            for i in 1..=40 {
                store.append(&[entry(i, 1, 200)]).unwrap();
                store.flush().unwrap();
            }
            store.crash();
            assert_eq!(store.recover().unwrap().last_index(), 40);
            assert!(
                store.corrupt_synced_sector(),
                "seed {seed}: nothing to damage"
            );
            assert!(store.log_damaged(), "seed {seed}");
            assert!(
                matches!(
                    store.recover(),
                    Err(StorageError::LogDamagedBelowSynced { .. })
                ),
                "seed {seed}"
            );
            assert_eq!(store.disk_stats().corrupt_sectors, 1);
        }
    }
}
