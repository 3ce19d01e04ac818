//! The leader's view of one follower's log (§5.3 nextIndex/matchIndex), plus the flow control
//! that makes replication pipelined but bounded.
//!
//! ```text
//!   Probe ──(append accepted)──► Replicate ──(append rejected)──► Probe
//!     │                                                             ▲
//!     └──(needed entries compacted)──► Snapshot ──(installed)───────┘
//! ```
//! In `Probe` one append is outstanding at a time; in `Replicate` up to `max_inflight_appends`
//! are, holding at most `max_inflight_bytes` of entries between them (one append is always
//! allowed), and `next_index` advances optimistically as they are sent.

use std::collections::VecDeque;

use super::types::Index;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressState {
    Probe,
    Replicate,
    Snapshot,
}

#[derive(Clone, Debug)]
pub struct Progress {
    pub match_index: Index,
    pub next_index: Index,
    pub state: ProgressState,
    /// In `Probe`: an append is outstanding, wait for its answer (or the next heartbeat answer).
    pub probe_sent: bool,
    /// In `Replicate`: the last index and entry bytes of every append still unacknowledged,
    /// oldest first.
    inflight: VecDeque<(Index, usize)>,
    /// Sum of the entry bytes in `inflight`.
    inflight_bytes: usize,
    /// Heard from since the last CheckQuorum round (§6.2).
    pub recent_active: bool,
    /// Highest ReadIndex sequence this follower acknowledged (§6.4).
    pub read_ack: u64,
    /// In `Snapshot`: which snapshot is being sent and where the next chunk starts.
    pub snapshot_index: Index,
    pub snapshot_offset: u64,
    /// The leader's heartbeat round in which this follower's heartbeat answer last unblocked
    /// flow control (at most one per round).
    pub unblocked_round: u64,
    /// In `Snapshot`: heartbeat rounds answered since the chunk at `snapshot_offset` was sent.
    /// The chunk is sent again only when enough of them pass without its answer.
    pub snapshot_waits: u32,
    /// The highest commit index sent to this follower (in an append or a heartbeat).
    pub commit_sent: Index,
}

impl Progress {
    pub fn new(next_index: Index) -> Self {
        Progress {
            match_index: 0,
            next_index,
            state: ProgressState::Probe,
            probe_sent: false,
            inflight: VecDeque::new(),
            inflight_bytes: 0,
            unblocked_round: 0,
            recent_active: false,
            read_ack: 0,
            snapshot_index: 0,
            snapshot_offset: 0,
            snapshot_waits: 0,
            commit_sent: 0,
        }
    }

    pub fn become_probe(&mut self, next_index: Index) {
        self.state = ProgressState::Probe;
        self.next_index = next_index.max(self.match_index + 1);
        self.probe_sent = false;
        self.clear_inflight();
    }

    pub fn become_replicate(&mut self) {
        self.state = ProgressState::Replicate;
        self.next_index = self.match_index + 1;
        self.probe_sent = false;
        self.clear_inflight();
    }

    pub fn become_snapshot(&mut self, snapshot_index: Index) {
        self.state = ProgressState::Snapshot;
        self.snapshot_index = snapshot_index;
        self.snapshot_offset = 0;
        self.snapshot_waits = 0;
        self.clear_inflight();
    }

    /// Records an acknowledged match; returns true if it moved forward.
    pub fn update_match(&mut self, index: Index) -> bool {
        let advanced = index > self.match_index;
        if advanced {
            self.match_index = index;
        }
        self.next_index = self.next_index.max(index + 1);
        while self
            .inflight
            .front()
            .is_some_and(|&(last, _)| last <= index)
        {
            self.free_oldest();
        }
        advanced
    }

    /// Records an append sent in `Replicate`: its last index and its entries' bytes.
    pub fn sent(&mut self, last: Index, bytes: usize) {
        self.inflight.push_back((last, bytes));
        self.inflight_bytes += bytes;
    }

    /// Forgets the oldest append in flight (acknowledged, or taken as lost).
    pub fn free_oldest(&mut self) {
        if let Some((_, bytes)) = self.inflight.pop_front() {
            self.inflight_bytes -= bytes;
        }
    }

    fn clear_inflight(&mut self) {
        self.inflight.clear();
        self.inflight_bytes = 0;
    }

    pub fn inflight_len(&self) -> usize {
        self.inflight.len()
    }

    pub fn inflight_bytes(&self) -> usize {
        self.inflight_bytes
    }

    /// No further append may leave: `max_inflight` appends, or `max_bytes` of entries, are
    /// unacknowledged. One append is always allowed, however large.
    pub fn inflight_full(&self, max_inflight: usize, max_bytes: usize) -> bool {
        self.inflight.len() >= max_inflight
            || (!self.inflight.is_empty() && self.inflight_bytes >= max_bytes)
    }
}
