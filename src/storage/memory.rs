//! [`MemStorage`]: an in-memory model of a disk for tests and the simulator.
//!
//! Writes land in a working copy; [`Storage::flush`] makes them durable; [`MemStorage::crash`]
//! throws away everything written since the last flush, as a power cut would. Deterministic: no
//! I/O, no clock, no randomness.
//!
//! A snapshot is installed as the sled store installs it ([`Storage::begin_install`]): its
//! bytes are staged, the snapshot point moves with an install mark, the state is replaced a
//! slice at a time, and a last step moves the applied index and clears the mark and the staged
//! bytes. A crash with the mark durable finishes the install from the staged bytes (as sled's
//! next open does), or, if they are not there, leaves a store whose `recover` fails, as sled's
//! open would.

use std::collections::{BTreeMap, VecDeque};

use super::{
    check_append, check_recovered, decode_snapshot_data, encode_snapshot_data, membership_after,
    KvChange, RecoveredState, Storage, StorageError,
};
use crate::raft::{Entry, HardState, Index, Membership, Snapshot, SnapshotMeta, Term};

#[derive(Clone, Debug, Default)]
struct DiskImage {
    hard_state: HardState,
    snapshot_meta: SnapshotMeta,
    log: BTreeMap<Index, Entry>,
    applied_index: Index,
    state: BTreeMap<Vec<u8>, Vec<u8>>,
    staging: Option<(SnapshotMeta, Vec<u8>)>,
    /// The install mark: the snapshot whose state is being put in place from `staging`.
    installing: Option<SnapshotMeta>,
}

/// A snapshot whose point has moved and whose state is being written, a slice at a time.
#[derive(Clone, Debug)]
struct PendingInstall {
    meta: SnapshotMeta,
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
    /// The next pair to write.
    next: usize,
    /// The old state is gone.
    cleared: bool,
}

/// In-memory storage that models crashes.
#[derive(Clone, Debug, Default)]
pub struct MemStorage {
    current: DiskImage,
    durable: DiskImage,
    /// A power cut armed for a coming flush: `Some(true)` strikes only at a flush that would
    /// make a new vote durable, `Some(false)` at the next flush.
    power_cut: Option<bool>,
    /// Flushes complete in the background: [`Storage::start_flush`] only records what the flush
    /// will make durable, and [`MemStorage::complete_flushes`] (the simulator's disk finishing
    /// its work) makes it so.
    background_flushes: bool,
    /// Started flushes not yet done: each ticket with the image it makes durable.
    pending: VecDeque<(u64, DiskImage)>,
    last_ticket: u64,
    done_ticket: u64,
    /// A power cut that struck a background flush, reported by the next [`Storage::flushed`].
    struck: bool,
    /// The install under way, if any (lost in a crash; the mark on the image stays).
    pending_install: Option<PendingInstall>,
    /// Why this store could not be opened after the last crash: an install mark without its
    /// staged bytes. [`Storage::recover`] reports it.
    broken: Option<String>,
}

impl MemStorage {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of a snapshot transfer staged so far: in the working copy, and made durable.
    pub fn staged_len(&self) -> (usize, usize) {
        let len = |image: &DiskImage| image.staging.as_ref().map_or(0, |(_, data)| data.len());
        (len(&self.current), len(&self.durable))
    }

    /// Loses every write since the last flush, and every flush not done. An install whose mark
    /// was durable is then finished from its staged bytes, as a restarted sled store does.
    pub fn crash(&mut self) {
        self.current = self.durable.clone();
        self.power_cut = None;
        self.pending.clear();
        self.struck = false;
        self.pending_install = None;
        self.broken = None;
        self.resume_install();
    }

    /// After a crash: finishes the install the durable mark names, from `staging`.
    fn resume_install(&mut self) {
        let Some(meta) = self.current.installing.clone() else {
            return;
        };
        let staged = match &self.current.staging {
            Some((staged_meta, data)) if *staged_meta == meta => decode_snapshot_data(data).ok(),
            _ => None,
        };
        let Some(pairs) = staged else {
            self.broken = Some(format!(
                "the install mark names the snapshot at index {} term {}, but staging does \
                 not hold it",
                meta.index, meta.term
            ));
            return;
        };
        self.pending_install = Some(PendingInstall {
            meta,
            pairs,
            next: 0,
            cleared: false,
        });
        while !self.step_install(usize::MAX) {}
    }

    /// Whether an install's state is still being written.
    pub fn install_pending(&self) -> bool {
        self.pending_install.is_some()
    }

    fn check_no_install(&self, action: &'static str) -> Result<(), StorageError> {
        match &self.pending_install {
            Some(pending) => Err(StorageError::InstallInProgress {
                action,
                index: pending.meta.index,
            }),
            None => Ok(()),
        }
    }

    /// Writes up to `max_keys` keys of the install under way (removing the old state first);
    /// the last step moves the applied index and clears the mark and the staged bytes. Returns
    /// whether none is under way any more.
    fn step_install(&mut self, max_keys: usize) -> bool {
        let Some(pending) = self.pending_install.as_mut() else {
            return true;
        };
        let img = &mut self.current;
        let mut budget = max_keys.max(1);
        while !pending.cleared && budget > 0 {
            match img.state.pop_first() {
                Some(_) => budget -= 1,
                None => pending.cleared = true,
            }
        }
        if !pending.cleared {
            return false;
        }
        while budget > 0 && pending.next < pending.pairs.len() {
            let (k, v) = std::mem::take(&mut pending.pairs[pending.next]);
            img.state.insert(k, v);
            pending.next += 1;
            budget -= 1;
        }
        if pending.next < pending.pairs.len() {
            return false;
        }
        img.applied_index = pending.meta.index;
        img.installing = None;
        img.staging = None;
        self.pending_install = None;
        true
    }

    /// Steps 1 and 2 of an install: checks `data`, finishes an install under way, stages
    /// `data` (unless `staged`: `staging` holds it), moves the snapshot point and writes the
    /// mark.
    fn start_install(
        &mut self,
        meta: &SnapshotMeta,
        data: &[u8],
        staged: bool,
    ) -> Result<(), StorageError> {
        let pairs = decode_snapshot_data(data)?;
        let staged = staged && self.pending_install.is_none();
        while !self.step_install(usize::MAX) {}
        // Raft §7: keep the log after the snapshot point if the entry there matches. `term` also
        // answers for the current snapshot point, as the sled implementation does.
        let keep = self.term(meta.index).ok() == Some(meta.term);
        let img = &mut self.current;
        if !staged {
            img.staging = Some((meta.clone(), data.to_vec()));
        }
        if keep {
            img.log = img.log.split_off(&(meta.index + 1));
        } else {
            img.log.clear();
        }
        img.snapshot_meta = meta.clone();
        img.installing = Some(meta.clone());
        self.pending_install = Some(PendingInstall {
            meta: meta.clone(),
            pairs,
            next: 0,
            cleared: false,
        });
        Ok(())
    }

    /// Makes flushes complete in the background (see [`MemStorage::complete_flushes`]) rather
    /// than inside [`Storage::start_flush`].
    pub fn set_background_flushes(&mut self, on: bool) {
        self.background_flushes = on;
    }

    /// Whether flushes complete in the background.
    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn background_flushes(&self) -> bool {
        self.background_flushes
    }

    /// Whether a background flush was started and is not done.
    pub fn has_pending_flushes(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The disk finishes the background flushes started so far, in order. An armed power cut
    /// strikes here as it would in [`Storage::flush`]: the node learns of it from its next
    /// [`Storage::flushed`].
    pub fn complete_flushes(&mut self) {
        while let Some(strikes) = self.next_flush_strikes() {
            if strikes {
                self.crash();
                self.struck = true;
                return;
            }
            self.complete_one_flush();
        }
    }

    /// Whether a background flush is waiting, and if so whether an armed power cut strikes it.
    pub(crate) fn next_flush_strikes(&self) -> Option<bool> {
        let (_, image) = self.pending.front()?;
        Some(self.power_cut.is_some_and(|on_vote_only| {
            !on_vote_only || image.hard_state.vote != self.durable.hard_state.vote
        }))
    }

    /// Completes the oldest background flush waiting (no power cut strikes it).
    pub(crate) fn complete_one_flush(&mut self) {
        if let Some((ticket, image)) = self.pending.pop_front() {
            self.durable = image;
            self.done_ticket = ticket;
        }
    }

    /// Whether an armed power cut strikes a [`Storage::flush`] made now.
    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn flush_strikes(&self) -> bool {
        self.power_cut.is_some_and(|on_vote_only| {
            !on_vote_only || self.current.hard_state.vote != self.durable.hard_state.vote
        })
    }

    /// Makes everything written durable at once, the background flushes waiting included,
    /// with no power cut (a store that composes this one syncs its own parts before).
    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn persist_all(&mut self) {
        self.durable = self.current.clone();
        self.pending.clear();
        self.done_ticket = self.last_ticket;
    }

    /// Whether the term or vote written differs from the durable one.
    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn hard_state_unsynced(&self) -> bool {
        let (now, durable) = (&self.current.hard_state, &self.durable.hard_state);
        now.term != durable.term || now.vote != durable.vote
    }

    /// The snapshot point as written, and as durable.
    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn snapshot_meta(&self) -> &SnapshotMeta {
        &self.current.snapshot_meta
    }

    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn durable_snapshot_index(&self) -> Index {
        self.durable.snapshot_meta.index
    }

    /// The snapshot a transfer staged, if any.
    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn staged_meta(&self) -> Option<SnapshotMeta> {
        self.current.staging.as_ref().map(|(meta, _)| meta.clone())
    }

    /// Moves the snapshot point to `meta` (a compaction whose term and membership a store
    /// that keeps the log elsewhere worked out), dropping the entries up to it from this log.
    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn set_snapshot_point(&mut self, meta: SnapshotMeta) {
        let img = &mut self.current;
        img.log = img.log.split_off(&(meta.index + 1));
        img.snapshot_meta = meta;
    }

    /// The applied state in the snapshot encoding.
    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn encode_state(&self) -> bytes::Bytes {
        encode_snapshot_data(
            self.current
                .state
                .iter()
                .map(|(k, v)| (k.as_slice(), v.as_slice())),
        )
    }

    #[cfg_attr(not(feature = "server"), allow(dead_code))] // for the simulated segments store
    pub(crate) fn check_no_install_for(&self, action: &'static str) -> Result<(), StorageError> {
        self.check_no_install(action)
    }

    /// [`Storage::recover`] with the log `entries` (a store that keeps the log elsewhere).
    pub(crate) fn recover_with_log(
        &self,
        entries: Vec<Entry>,
    ) -> Result<RecoveredState, StorageError> {
        if let Some(detail) = &self.broken {
            return Err(StorageError::Engine {
                action: "finishing an interrupted snapshot install",
                detail: detail.clone(),
            });
        }
        let img = &self.current;
        let membership = membership_after(&img.snapshot_meta.membership, &entries)?;
        let state = RecoveredState {
            hard_state: img.hard_state,
            snapshot_meta: img.snapshot_meta.clone(),
            entries,
            membership,
            applied_index: img.applied_index,
            applied_state: img
                .state
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
        check_recovered(&state)?;
        Ok(state)
    }

    /// Disarms a power cut armed by [`MemStorage::arm_power_cut`].
    pub fn disarm_power_cut(&mut self) {
        self.power_cut = None;
    }

    /// Arms a power cut: a coming [`Storage::flush`] (with `on_vote_only`, only one that would
    /// make a changed vote durable) loses everything unflushed and fails with
    /// [`StorageError::SimulatedCrash`].
    pub fn arm_power_cut(&mut self, on_vote_only: bool) {
        self.power_cut = Some(on_vote_only);
    }

    fn membership_at(&self, index: Index) -> Result<Membership, StorageError> {
        let img = &self.current;
        let entries: Vec<Entry> = img.log.range(..=index).map(|(_, e)| e.clone()).collect();
        membership_after(&img.snapshot_meta.membership, &entries)
    }

    fn install(&mut self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), StorageError> {
        self.start_install(meta, data, false)?;
        while !self.step_install(usize::MAX) {}
        Ok(())
    }
}

impl Storage for MemStorage {
    fn recover(&self) -> Result<RecoveredState, StorageError> {
        self.recover_with_log(self.current.log.values().cloned().collect())
    }

    fn append(&mut self, entries: &[Entry]) -> Result<(), StorageError> {
        check_append(entries, self.current.snapshot_meta.index, self.last_index())?;
        let Some(first) = entries.first() else {
            return Ok(());
        };
        self.current.log.split_off(&first.index);
        for entry in entries {
            self.current.log.insert(entry.index, entry.clone());
        }
        Ok(())
    }

    fn set_hard_state(&mut self, hard_state: HardState) -> Result<(), StorageError> {
        self.current.hard_state = hard_state;
        Ok(())
    }

    fn apply(&mut self, applied_index: Index, changes: &[KvChange]) -> Result<(), StorageError> {
        self.check_no_install("writing the applied state")?;
        if applied_index < self.current.applied_index {
            return Err(StorageError::AppliedIndexRegress {
                applied_index: self.current.applied_index,
                requested_index: applied_index,
            });
        }
        for (key, value) in changes {
            match value {
                Some(v) => self.current.state.insert(key.clone(), v.clone()),
                None => self.current.state.remove(key),
            };
        }
        self.current.applied_index = applied_index;
        Ok(())
    }

    fn install_snapshot(&mut self, meta: &SnapshotMeta, data: &[u8]) -> Result<(), StorageError> {
        self.install(meta, data)
    }

    fn begin_install(
        &mut self,
        meta: &SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        self.start_install(meta, data, false)
    }

    /// Installs from the staged bytes when they are the whole snapshot (so a driver that stages
    /// the wrong bytes installs the wrong state, which the simulator's checks catch), else from
    /// `data`, which is staged in their place.
    fn begin_install_staged(
        &mut self,
        meta: &SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        // An install under way is finished first; that empties the staging area.
        while !self.step_install(usize::MAX) {}
        match self.current.staging.clone() {
            Some((staged_meta, staged)) if staged_meta == *meta && staged.len() == data.len() => {
                self.start_install(meta, &staged, true)
            }
            _ => self.start_install(meta, data, false),
        }
    }

    fn continue_install(&mut self, max_pairs: usize) -> Result<bool, StorageError> {
        Ok(self.step_install(max_pairs))
    }

    /// Refused while an install is under way: its bytes are in the staging area.
    fn begin_snapshot(&mut self, meta: &SnapshotMeta) -> Result<(), StorageError> {
        self.check_no_install("staging a snapshot transfer")?;
        self.current.staging = Some((meta.clone(), Vec::new()));
        Ok(())
    }

    fn write_snapshot_chunk(&mut self, offset: u64, chunk: &[u8]) -> Result<(), StorageError> {
        self.check_no_install("staging a snapshot chunk")?;
        let Some((_, data)) = self.current.staging.as_mut() else {
            return Err(StorageError::NoSnapshotInProgress);
        };
        if offset != data.len() as u64 {
            return Err(StorageError::SnapshotChunkOutOfOrder {
                offset,
                expected_offset: data.len() as u64,
            });
        }
        data.extend_from_slice(chunk);
        Ok(())
    }

    fn finish_snapshot(&mut self) -> Result<SnapshotMeta, StorageError> {
        self.check_no_install("finishing a snapshot transfer")?;
        let Some((meta, data)) = self.current.staging.clone() else {
            return Err(StorageError::NoSnapshotInProgress);
        };
        self.start_install(&meta, &data, true)?;
        while !self.step_install(usize::MAX) {}
        Ok(meta)
    }

    fn build_snapshot(&self) -> Result<Snapshot, StorageError> {
        self.check_no_install("building a snapshot")?;
        let index = self.current.applied_index;
        let meta = SnapshotMeta {
            index,
            term: self.term(index)?,
            membership: self.membership_at(index)?,
        };
        let data = encode_snapshot_data(
            self.current
                .state
                .iter()
                .map(|(k, v)| (k.as_slice(), v.as_slice())),
        );
        Ok(Snapshot { meta, data })
    }

    fn compact(&mut self, upto: Index) -> Result<(), StorageError> {
        if upto <= self.current.snapshot_meta.index {
            return Ok(());
        }
        if upto > self.current.applied_index {
            return Err(StorageError::CompactBeyondApplied {
                upto,
                applied_index: self.current.applied_index,
            });
        }
        let term = self.term(upto)?;
        let membership = self.membership_at(upto)?;
        let img = &mut self.current;
        img.log = img.log.split_off(&(upto + 1));
        img.snapshot_meta = SnapshotMeta {
            index: upto,
            term,
            membership,
        };
        Ok(())
    }

    fn entries(&self, lo: Index, hi: Index) -> Result<Vec<Entry>, StorageError> {
        super::check_entries_range(lo, hi, self.current.snapshot_meta.index, self.last_index())?;
        Ok(self
            .current
            .log
            .range(lo..hi)
            .map(|(_, e)| e.clone())
            .collect())
    }

    fn term(&self, index: Index) -> Result<Term, StorageError> {
        let meta = &self.current.snapshot_meta;
        if index == meta.index {
            return Ok(meta.term);
        }
        if index < meta.index {
            return Err(StorageError::Compacted {
                index,
                snapshot_index: meta.index,
            });
        }
        self.current
            .log
            .get(&index)
            .map(|e| e.term)
            .ok_or(StorageError::Unavailable {
                index,
                last_index: self.last_index(),
            })
    }

    fn first_index(&self) -> Index {
        self.current.snapshot_meta.index + 1
    }

    fn last_index(&self) -> Index {
        self.current
            .log
            .keys()
            .next_back()
            .copied()
            .unwrap_or(self.current.snapshot_meta.index)
    }

    fn applied_index(&self) -> Index {
        self.current.applied_index
    }

    fn flush(&mut self) -> Result<(), StorageError> {
        if let Some(on_vote_only) = self.power_cut {
            if !on_vote_only || self.current.hard_state.vote != self.durable.hard_state.vote {
                self.crash();
                return Err(StorageError::SimulatedCrash);
            }
        }
        self.durable = self.current.clone();
        self.pending.clear();
        self.done_ticket = self.last_ticket;
        Ok(())
    }

    fn start_flush(&mut self) -> Result<u64, StorageError> {
        if !self.background_flushes {
            self.flush()?;
            return self.flushed();
        }
        self.last_ticket += 1;
        self.pending
            .push_back((self.last_ticket, self.current.clone()));
        Ok(self.last_ticket)
    }

    fn flushed(&mut self) -> Result<u64, StorageError> {
        if self.struck {
            return Err(StorageError::SimulatedCrash);
        }
        Ok(if self.background_flushes {
            self.done_ticket
        } else {
            u64::MAX
        })
    }

    fn wait_flushed(&mut self) -> Result<(), StorageError> {
        self.complete_flushes();
        self.flushed().map(|_| ())
    }
}
