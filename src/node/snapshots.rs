//! Snapshots: when to compact the log and build snapshot bytes, and installing a snapshot from
//! the leader (its chunks staged as they arrive, its state put in place a slice per drive).

use super::{Effect, Installing, Micros, NodeCore, Observation};
use crate::lock::StateLoader;
use crate::raft::{Index, NodeId, Snapshot};
use crate::storage::{snapshot_pairs_from, PairsCursor, SnapshotJob, Storage, StorageError};

/// `threshold` plus an eighth of it for each step of `id % 4`: the entry (or byte) count at
/// which node `id` takes its snapshot when configured with `threshold` (see
/// `NodeCore::staggered`).
pub fn staggered_threshold(threshold: u64, id: NodeId) -> u64 {
    threshold.saturating_add(threshold / 8 * (id % 4))
}

/// The snapshot a restarted node starts from (`InitialState::snapshot`): the recovered
/// snapshot point without bytes, which are encoded only when a follower needs them. None when
/// the log was never compacted.
pub fn recovered_snapshot(meta: &crate::raft::SnapshotMeta) -> Option<crate::raft::Snapshot> {
    (meta.index > 0).then(|| crate::raft::Snapshot {
        meta: meta.clone(),
        data: bytes::Bytes::new(),
    })
}

/// A job that builds a snapshot of `storage`'s applied state in the layout snapshots carry
/// between nodes (`crate::lock::StoredToSnapshot`: the lock state machine stores its
/// dedupe records in blocks, snapshots carry one key per record, which every RaftLock version
/// reads). The blocks are opened pair by pair as the state is read, with no copy of the
/// whole state.
pub fn snapshot_job_for_peers<S: Storage + ?Sized>(
    storage: &S,
) -> Result<SnapshotJob, StorageError> {
    storage.snapshot_job_with(Box::new(|pairs| {
        Box::new(crate::lock::StoredToSnapshot::new(pairs, |err| {
            StorageError::SnapshotData {
                problem: format!("the stored state does not decode: {err}"),
            }
        }))
    }))
}

impl<S: Storage, R> NodeCore<S, R> {
    /// Compacts the log once it has grown past `snapshot_entries` entries or `snapshot_bytes`
    /// bytes: the applied state is written, and the stored state becomes the snapshot point.
    /// Snapshot bytes are encoded (a job on another thread) only when a follower needs them:
    /// when the core asks for them, or when it compacts while a follower is being sent a
    /// snapshot or is known to need one.
    pub(super) fn maybe_snapshot(&mut self) -> Result<(), StorageError> {
        if self.snapshot_in_progress || self.installing.is_some() {
            return Ok(());
        }
        // Wanted bytes are built from the state as it is now (a newer point, which compacts
        // the log further).
        let wanted = self.raft.snapshot_wanted();
        let applied = self.raft.applied_index();
        let by_count =
            applied >= self.raft.snapshot_index() + self.staggered(self.cfg.snapshot_entries);
        let by_bytes = self.log_bytes_since_snapshot >= self.staggered(self.cfg.snapshot_bytes)
            && applied > self.raft.snapshot_index();
        if !wanted && !by_count && !by_bytes {
            return Ok(());
        }
        self.write_all_applied()?;
        if !wanted && !self.raft.peers_need_snapshot() {
            // The point is what storage holds (all of it written just now), as for a job.
            let point = self.storage.applied_index().min(applied);
            if self.raft.compact_without_data(point) {
                self.storage.compact(point)?;
                self.log_bytes_since_snapshot = 0;
                self.observe(Observation::LogCompacted { index: point });
            }
            return Ok(());
        }
        let job = snapshot_job_for_peers(&self.storage)?;
        self.snapshot_in_progress = true;
        self.effects.push(Effect::BuildSnapshot(job));
        Ok(())
    }

    /// This node's snapshot threshold: `threshold` plus an eighth of it for each step of
    /// `id % 4`. Nodes that all apply the same entries would otherwise all snapshot at the
    /// same index, and with both followers of three busy building at once, commits wait for
    /// the slower of them; staggered, one of them at a time builds.
    fn staggered(&self, threshold: u64) -> u64 {
        staggered_threshold(threshold, self.raft.id())
    }

    /// The result of a [`Effect::BuildSnapshot`] job: compacts the log behind it.
    pub fn snapshot_built(
        &mut self,
        now: Micros,
        result: Result<Snapshot, StorageError>,
    ) -> Result<(), StorageError> {
        self.advance_clock(now);
        if !self.snapshot_in_progress {
            // Superseded by an installed snapshot.
            return Ok(());
        }
        self.snapshot_in_progress = false;
        let snapshot = result?;
        let index = snapshot.meta.index;
        let bytes = snapshot.data.len();
        // A compaction, or the bytes of the latest snapshot built again for a follower that
        // needs them (`Raft::snapshot_wanted`); storage compacts only past its own point.
        if index <= self.raft.applied_index() && self.raft.provide_snapshot(index, snapshot.data) {
            self.storage.compact(index)?;
            self.log_bytes_since_snapshot = 0;
            self.observe(Observation::SnapshotEncoded { index, bytes });
        }
        self.write_applied(false)
    }

    /// Hands the chunks of an arriving snapshot to storage as they come, so that the install
    /// ([`NodeCore::begin_install`]) finds its bytes already there instead of writing them all
    /// at once (about 2 s for 155 MiB in sled, during which the node answered nothing). A chunk
    /// that does not follow what is staged (which the Raft core's order rules out) is left out,
    /// and the install then stages the whole snapshot itself. So is every chunk of a transfer
    /// that begins while an earlier snapshot's state is still being installed: storage keeps
    /// that snapshot's bytes until its install is done and refuses the new transfer
    /// ([`StorageError::InstallInProgress`]).
    pub(super) fn stage_chunks(
        &mut self,
        chunks: &[crate::raft::SnapshotChunk],
    ) -> Result<(), StorageError> {
        for chunk in chunks {
            if chunk.offset == 0 {
                match self.storage.begin_snapshot(&chunk.meta) {
                    Ok(()) => self.staging = Some((chunk.meta.clone(), 0)),
                    // Staged whole by its own install, once the one under way is done.
                    Err(StorageError::InstallInProgress { .. }) => {
                        self.staging = None;
                        continue;
                    }
                    Err(err) => return Err(err),
                }
            }
            let Some((meta, staged)) = self.staging.as_mut() else {
                continue;
            };
            if *meta != chunk.meta || *staged != chunk.offset {
                self.staging = None;
                continue;
            }
            self.storage
                .write_snapshot_chunk(chunk.offset, &chunk.data)?;
            *staged += chunk.data.len() as u64;
            self.staged_unflushed += chunk.data.len() as u64;
        }
        Ok(())
    }

    /// Starts installing a snapshot from the leader: its point moves in storage now (durable
    /// with this Ready's flush, which lets the leader learn it arrived), and its state is put in
    /// place by [`NodeCore::continue_install`], a slice per drive, while the Raft core holds
    /// back what commits after it and does not campaign (until [`Raft::state_installed`]).
    pub(super) fn begin_install(&mut self, snapshot: &Snapshot) -> Result<(), StorageError> {
        // A snapshot being built and unwritten changes belong to the state this one replaces
        // (as does a state being loaded from an earlier snapshot).
        self.snapshot_in_progress = false;
        self.unwritten_changes.clear();
        self.unwritten_applied = None;
        self.held.clear();
        self.held_keys = 0;
        // Storage checks the bytes whole before it writes anything, and takes what
        // `stage_chunks` staged only if it is this snapshot, whole.
        self.staging = None;
        self.storage
            .begin_install_staged(&snapshot.meta, &snapshot.data)?;
        self.installing = Some(Installing {
            index: snapshot.meta.index,
            data: snapshot.data.clone(),
            cursor: PairsCursor::first(&snapshot.data),
            loader: StateLoader::new(self.sm.limits().clone()),
            stored: false,
        });
        self.observe(Observation::SnapshotInstallStarted {
            index: snapshot.meta.index,
            bytes: snapshot.data.len(),
        });
        Ok(())
    }

    /// One slice of the install [`NodeCore::begin_install`] started: up to
    /// `install_slice_keys` keys written to storage and loaded into the new lock state. The
    /// last slice puts the new state in place and lets the Raft core go on.
    pub(super) fn continue_install(&mut self) -> Result<(), StorageError> {
        let Some(install) = self.installing.as_mut() else {
            return Ok(());
        };
        let slice = self.cfg.install_slice_keys.max(1);
        if !install.stored {
            install.stored = self.storage.continue_install(slice)?;
        }
        let index = install.index;
        let undecodable = |err: crate::lock::DecodeError| StorageError::SnapshotData {
            problem: format!("snapshot at index {index} does not decode: {err}"),
        };
        let mut pairs = snapshot_pairs_from(&install.data, install.cursor);
        for (key, value) in pairs.by_ref().take(slice) {
            install.loader.add(key, value).map_err(undecodable)?;
        }
        install.cursor = pairs.cursor(&install.data);
        if !install.stored || install.cursor.left() > 0 {
            return Ok(());
        }
        let Some(install) = self.installing.take() else {
            return Ok(());
        };
        self.sm = install.loader.finish().map_err(undecodable)?;
        #[cfg(any(test, feature = "mutations"))]
        self.sm.set_bugs(self.cfg.bugs.machine());
        self.recorded_at = self.sm.members().keys().map(|id| (*id, index)).collect();
        let records: Vec<(NodeId, u64)> = self
            .sm
            .members()
            .iter()
            .map(|(id, m)| (*id, m.incarnation))
            .collect();
        for (id, incarnation) in records {
            self.forget_words_older_than(id, incarnation);
        }
        self.log_bytes_since_snapshot = 0;
        self.raft.state_installed();
        if self.raft.is_leader() {
            self.rebuild_deadlines();
        }
        self.observe(Observation::SnapshotInstalled { index });
        Ok(())
    }

    /// A snapshot from the leader is being installed (its index): the shell keeps driving
    /// until it is done, even with no input.
    pub fn installing_snapshot(&self) -> Option<Index> {
        self.installing.as_ref().map(|i| i.index)
    }
}
