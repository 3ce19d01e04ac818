//! Snapshots (§5.7): compaction, the latest snapshot's bytes (let go and provided again), sending
//! a snapshot to a lagging follower in chunks, and receiving one.

use bytes::Bytes;

use super::{IncomingSnapshot, Raft, Role, SnapshotChunk};
use crate::raft::message::MessageBody;
use crate::raft::progress::ProgressState;
use crate::raft::types::{Index, NodeId, Snapshot, SnapshotMeta};

impl Raft {
    /// The snapshot the core sends to lagging followers (its `data` empty while released).
    pub fn latest_snapshot(&self) -> Option<&Snapshot> {
        self.snapshot.as_ref()
    }

    /// Whether a follower needs the latest snapshot's bytes, which were let go
    /// ([`Raft::release_snapshot_data`]): the driver builds a snapshot of its state and hands it
    /// over with [`Raft::provide_snapshot`].
    pub fn snapshot_wanted(&self) -> bool {
        self.snapshot_wanted
    }

    /// Lets go of the latest snapshot's bytes unless a follower is being sent them or is known
    /// to need them (its next entry was compacted away), keeping its meta (the log stays
    /// compacted to it). The driver's own state is the snapshot; the bytes are needed only to
    /// send, and a large state's bytes are a large share of a node's memory. Returns whether
    /// bytes were let go.
    pub fn release_snapshot_data(&mut self) -> bool {
        // Called on every tick: the bytes are looked at before the followers' progress.
        if self.snapshot.is_none() || self.snapshot_data_released() || self.peers_need_snapshot() {
            return false;
        }
        if let Some(snapshot) = &mut self.snapshot {
            snapshot.data = Bytes::new();
        }
        true
    }

    /// Leader only: whether a follower is being sent the latest snapshot or is known to need
    /// one (its next entry was compacted away). False on followers.
    pub fn peers_need_snapshot(&self) -> bool {
        let first = self.log.snapshot_index() + 1;
        self.role == Role::Leader
            && self.progress.iter().any(|(&id, p)| {
                id != self.id && (p.state == ProgressState::Snapshot || p.next_index < first)
            })
    }

    /// Compacts the log to `index` as [`Raft::compact`] does, without snapshot bytes: the
    /// driver's stored state is the snapshot, and its bytes are built only when a follower
    /// needs them ([`Raft::snapshot_wanted`], then [`Raft::provide_snapshot`]). Returns
    /// whether the log was compacted (as [`Raft::compact`]).
    pub fn compact_without_data(&mut self, index: Index) -> bool {
        self.compact(index, Bytes::new())
    }

    /// Whether the latest snapshot's bytes are not held (see the `snapshot` field).
    fn snapshot_data_released(&self) -> bool {
        self.snapshot.as_ref().is_some_and(|s| s.data.is_empty())
    }

    /// A snapshot the driver built of its applied state at `index` because
    /// [`Raft::snapshot_wanted`]: compacts the log to it when it is newer than the latest
    /// snapshot (as [`Raft::compact`]), or gives the latest snapshot its bytes back when it is at
    /// the same point. False (nothing changes) for an older point or one not applied.
    pub fn provide_snapshot(&mut self, index: Index, data: Bytes) -> bool {
        if index > self.log.snapshot_index() {
            return self.compact(index, data);
        }
        match &mut self.snapshot {
            Some(snapshot)
                if snapshot.meta.index == index && index == self.log.snapshot_index() =>
            {
                snapshot.data = data;
                self.snapshot_wanted = false;
                true
            }
            _ => false,
        }
    }

    #[cfg(test)]
    pub(crate) fn set_snapshot_chunk_bytes(&mut self, bytes: usize) {
        self.cfg.snapshot_chunk_bytes = bytes;
    }

    /// The capacity of the buffer an arriving snapshot is gathered in, if one is arriving.
    #[cfg(test)]
    pub(crate) fn incoming_snapshot_capacity(&self) -> Option<usize> {
        self.incoming_snapshot
            .as_ref()
            .map(|inc| inc.data.capacity())
    }

    /// Records a snapshot the driver took of the state machine at `index` (<= applied) and drops
    /// the in-memory log up to it. The driver compacts its storage the same way.
    pub fn compact(&mut self, index: Index, data: Bytes) -> bool {
        if index <= self.log.snapshot_index() || index > self.log.applied {
            return false;
        }
        let Some(term) = self.log.term(index) else {
            return false;
        };
        let meta = SnapshotMeta {
            index,
            term,
            membership: self.membership_at(index),
        };
        // Entries up to `index` are about to go: the configuration they built becomes the base.
        self.membership_base = meta.membership.clone();
        self.snapshot = Some(Snapshot { meta, data });
        self.snapshot_wanted = false;
        self.log.compact(index);
        true
    }

    pub(super) fn start_snapshot(&mut self, to: NodeId) {
        let Some(snapshot_index) = self.snapshot.as_ref().map(|s| s.meta.index) else {
            return;
        };
        if self.snapshot_data_released() {
            // Asked again on every attempt to reach `to` until the driver provides the bytes.
            self.snapshot_wanted = true;
            return;
        }
        if let Some(pr) = self.progress.get_mut(&to) {
            pr.become_snapshot(snapshot_index);
        }
        self.send_snapshot_chunk(to);
    }

    pub(super) fn send_snapshot_chunk(&mut self, to: NodeId) {
        if self.snapshot_data_released() {
            self.snapshot_wanted = true;
            return;
        }
        let Some(snapshot) = &self.snapshot else {
            return;
        };
        let Some(pr) = self.progress.get_mut(&to) else {
            return;
        };
        if pr.snapshot_index != snapshot.meta.index {
            // A newer snapshot replaced the one being sent: start over with it.
            pr.become_snapshot(snapshot.meta.index);
        }
        pr.snapshot_waits = 0;
        let len = snapshot.data.len() as u64;
        let offset = pr.snapshot_offset.min(len);
        let end = (offset + self.cfg.snapshot_chunk_bytes as u64).min(len);
        let body = MessageBody::InstallSnapshot {
            meta: snapshot.meta.clone(),
            offset,
            data: snapshot.data.slice(offset as usize..end as usize),
            done: end == len,
            total_len: len,
        };
        self.send(to, body);
    }

    pub(super) fn handle_snapshot_chunk(
        &mut self,
        from: NodeId,
        meta: SnapshotMeta,
        offset: u64,
        data: Bytes,
        done: bool,
        total_len: u64,
    ) {
        let snapshot_index = meta.index;
        if meta.index <= self.log.committed {
            // We already have everything it covers.
            self.incoming_snapshot = None;
            let body = MessageBody::InstallSnapshotResponse {
                snapshot_index,
                next_offset: 0,
                done: true,
            };
            self.send(from, body);
            return;
        }
        // A copy of the first chunk (sent again while its answer was on the way) must not throw
        // away what has arrived since.
        let resumed = self
            .incoming_snapshot
            .as_ref()
            .is_some_and(|inc| inc.meta == meta && !inc.data.is_empty());
        if offset == 0 && !resumed {
            // Sized once from the sender's total, so a large snapshot is not copied each time
            // its buffer doubles. A total past the limit is not believed (the limit below turns
            // the transfer away when the bytes get there), and memory the system will not
            // reserve leaves the buffer to grow as the chunks come.
            let mut data = Vec::new();
            if total_len <= self.cfg.max_snapshot_bytes {
                let _ = data.try_reserve_exact(usize::try_from(total_len).unwrap_or(0));
            }
            self.incoming_snapshot = Some(IncomingSnapshot {
                meta: meta.clone(),
                data,
            });
        }
        let expected = match &self.incoming_snapshot {
            Some(inc) if inc.meta == meta => inc.data.len() as u64,
            _ => 0,
        };
        if offset != expected {
            let body = MessageBody::InstallSnapshotResponse {
                snapshot_index,
                next_offset: expected,
                done: false,
            };
            self.send(from, body);
            return;
        }
        let Some(incoming) = self.incoming_snapshot.as_mut() else {
            return;
        };
        if incoming.data.len() as u64 + data.len() as u64 > self.cfg.max_snapshot_bytes {
            self.incoming_snapshot = None;
            return;
        }
        incoming.data.extend_from_slice(&data);
        self.accepted_chunks.push(SnapshotChunk {
            meta: meta.clone(),
            offset,
            data,
        });
        let next_offset = incoming.data.len() as u64;
        if !done {
            let body = MessageBody::InstallSnapshotResponse {
                snapshot_index,
                next_offset,
                done,
            };
            self.send(from, body);
            return;
        }
        let incoming = self.incoming_snapshot.take().expect("present");
        let snapshot = Snapshot {
            meta: incoming.meta,
            data: Bytes::from(incoming.data),
        };
        self.log
            .install_snapshot(snapshot.meta.index, snapshot.meta.term);
        self.membership_base = snapshot.meta.membership.clone();
        self.recompute_membership();
        self.snapshot_to_install = Some(snapshot);
        self.state_pending = true;
        let body = MessageBody::InstallSnapshotResponse {
            snapshot_index,
            next_offset,
            done: true,
        };
        self.send(from, body);
    }

    pub(super) fn handle_snapshot_response(
        &mut self,
        from: NodeId,
        snapshot_index: Index,
        next_offset: u64,
        done: bool,
    ) {
        let Some(pr) = self.progress.get_mut(&from) else {
            return;
        };
        pr.recent_active = true;
        if pr.state != ProgressState::Snapshot || pr.snapshot_index != snapshot_index {
            return; // stale or duplicated
        }
        if done {
            pr.update_match(snapshot_index);
            pr.become_probe(snapshot_index + 1);
            self.maybe_commit();
            self.send_append(from, true);
        } else if next_offset != pr.snapshot_offset {
            // Forward: the chunk in flight arrived, send the next. Backward: the follower lost
            // what it had (it restarted), go back to where it is.
            pr.snapshot_offset = next_offset;
            self.send_snapshot_chunk(from);
        }
        // Equal: the answer to a copy; the chunk at this offset is in flight already, and the
        // heartbeat rounds send it again if it was lost. Sending it here too would start a
        // second stream of chunks beside the first, and every copy would add another.
    }
}
