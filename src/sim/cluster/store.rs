//! A node's disk in the simulator: the in-memory store or the segments engine on a simulated
//! disk, behind one [`Storage`] implementation.

#[cfg(doc)]
use super::SimConfig;
use crate::raft::{Index, Term};
use crate::storage::{MemStorage, SimDiskStats, SimSegmentsStorage, Storage, StorageError};

/// A node's disk: [`MemStorage`], or the segments engine on a simulated disk
/// ([`SimConfig::segments_disk`]). One per simulated node, made at its start and moved only
/// with it: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum SimStore {
    Mem(MemStorage),
    Segments(Box<SimSegmentsStorage>),
}

/// Calls the same method on whichever store it is.
macro_rules! each_store {
    ($store:expr, $s:ident => $call:expr) => {
        match $store {
            SimStore::Mem($s) => $call,
            SimStore::Segments($s) => $call,
        }
    };
}

impl SimStore {
    pub(super) fn new(segments: bool, seed: u64) -> Self {
        if segments {
            SimStore::Segments(Box::new(SimSegmentsStorage::new(seed)))
        } else {
            SimStore::Mem(MemStorage::new())
        }
    }

    pub(super) fn set_background_flushes(&mut self, on: bool) {
        each_store!(self, s => s.set_background_flushes(on))
    }

    pub(super) fn has_pending_flushes(&self) -> bool {
        each_store!(self, s => s.has_pending_flushes())
    }

    pub(super) fn complete_flushes(&mut self) {
        each_store!(self, s => s.complete_flushes())
    }

    pub(super) fn arm_power_cut(&mut self, on_vote_only: bool) {
        each_store!(self, s => s.arm_power_cut(on_vote_only))
    }

    pub(super) fn disarm_power_cut(&mut self) {
        each_store!(self, s => s.disarm_power_cut())
    }

    pub(super) fn crash(&mut self) {
        each_store!(self, s => s.crash())
    }

    pub(super) fn disk_stats(&self) -> SimDiskStats {
        match self {
            SimStore::Mem(_) => SimDiskStats::default(),
            SimStore::Segments(s) => s.disk_stats(),
        }
    }
}

impl Storage for SimStore {
    fn recover(&self) -> Result<crate::storage::RecoveredState, StorageError> {
        each_store!(self, s => s.recover())
    }
    fn append(&mut self, entries: &[crate::raft::Entry]) -> Result<(), StorageError> {
        each_store!(self, s => s.append(entries))
    }
    fn set_hard_state(&mut self, hard_state: crate::raft::HardState) -> Result<(), StorageError> {
        each_store!(self, s => s.set_hard_state(hard_state))
    }
    fn apply(
        &mut self,
        applied_index: Index,
        changes: &[crate::storage::KvChange],
    ) -> Result<(), StorageError> {
        each_store!(self, s => s.apply(applied_index, changes))
    }
    fn install_snapshot(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &[u8],
    ) -> Result<(), StorageError> {
        each_store!(self, s => s.install_snapshot(meta, data))
    }
    fn begin_install(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        each_store!(self, s => s.begin_install(meta, data))
    }
    fn begin_install_staged(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        each_store!(self, s => s.begin_install_staged(meta, data))
    }
    fn continue_install(&mut self, max_pairs: usize) -> Result<bool, StorageError> {
        each_store!(self, s => s.continue_install(max_pairs))
    }
    fn begin_snapshot(&mut self, meta: &crate::raft::SnapshotMeta) -> Result<(), StorageError> {
        each_store!(self, s => s.begin_snapshot(meta))
    }
    fn write_snapshot_chunk(&mut self, offset: u64, chunk: &[u8]) -> Result<(), StorageError> {
        each_store!(self, s => s.write_snapshot_chunk(offset, chunk))
    }
    fn finish_snapshot(&mut self) -> Result<crate::raft::SnapshotMeta, StorageError> {
        each_store!(self, s => s.finish_snapshot())
    }
    fn build_snapshot(&self) -> Result<crate::raft::Snapshot, StorageError> {
        each_store!(self, s => s.build_snapshot())
    }
    fn snapshot_job(&self) -> Result<crate::storage::SnapshotJob, StorageError> {
        each_store!(self, s => s.snapshot_job())
    }
    fn snapshot_job_with(
        &self,
        convert: crate::storage::PairsConvert,
    ) -> Result<crate::storage::SnapshotJob, StorageError> {
        each_store!(self, s => s.snapshot_job_with(convert))
    }
    fn compact(&mut self, upto: Index) -> Result<(), StorageError> {
        each_store!(self, s => s.compact(upto))
    }
    fn entries(&self, lo: Index, hi: Index) -> Result<Vec<crate::raft::Entry>, StorageError> {
        each_store!(self, s => s.entries(lo, hi))
    }
    fn term(&self, index: Index) -> Result<Term, StorageError> {
        each_store!(self, s => s.term(index))
    }
    fn first_index(&self) -> Index {
        each_store!(self, s => s.first_index())
    }
    fn last_index(&self) -> Index {
        each_store!(self, s => s.last_index())
    }
    fn applied_index(&self) -> Index {
        each_store!(self, s => s.applied_index())
    }
    fn flush(&mut self) -> Result<(), StorageError> {
        each_store!(self, s => s.flush())
    }
    fn start_flush(&mut self) -> Result<u64, StorageError> {
        each_store!(self, s => s.start_flush())
    }
    fn flushed(&mut self) -> Result<u64, StorageError> {
        each_store!(self, s => s.flushed())
    }
    fn wait_flushed(&mut self) -> Result<(), StorageError> {
        each_store!(self, s => s.wait_flushed())
    }
}
