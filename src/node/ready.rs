//! The Ready cycle: each Ready persisted, its early messages sent, flushed (possibly in the
//! background, several in flight), then its answers sent, its entries applied and the core
//! advanced.

use super::{Effect, NodeCore, Observation};
use crate::raft::{EntryPayload, Ready};
use crate::storage::{Storage, StorageError};

/// Readies written and waiting for background flushes at most. A leader whose own disk stalls
/// can go on committing with its followers' acknowledgements, but it applies (and answers) only
/// what it has made durable itself: beyond this many Readies it waits for its disk instead of
/// taking more work.
const MAX_READIES_IN_FLIGHT: usize = 64;

impl<S: Storage, R> NodeCore<S, R> {
    /// Proposes what the inputs gathered and processes every Ready: persist, flush, send, apply.
    /// A storage error means the node must stop (the shell exits; the simulator crashes it).
    pub fn drive(&mut self) -> Result<(), StorageError> {
        for _ in 0..self.cfg.readies_per_drive.max(1) {
            if !self.drive_until_flush()? {
                break;
            }
            self.finish_drive()?;
        }
        Ok(())
    }

    /// The first half of [`NodeCore::drive`], one Ready at a time: proposes what the inputs
    /// gathered, takes the next Ready and carries it up to its flush (the leader's early
    /// messages handed to the sender of [`NodeCore::send_early_with`], entries and hard state
    /// written, nothing made durable yet). Returns whether a Ready now waits for
    /// [`NodeCore::finish_drive`], which the shell must call before anything else of the core:
    /// in between it may only let the early messages leave (the driver yields to the streams
    /// that write them, on its own thread). `drive` is the two halves back to back.
    pub fn drive_until_flush(&mut self) -> Result<bool, StorageError> {
        self.finish_drive()?;
        self.check_admission();
        if let Err(err) = self.continue_install() {
            self.failed = true;
            return Err(err);
        }
        self.propose_batch();
        if !self.raft.has_ready() {
            return Ok(false);
        }
        let ready = self.raft.ready();
        if self.in_flight.iter().any(|(_, ticket)| ticket.is_some()) {
            self.overlapped += 1;
        }
        let written = if ready.soft_state.is_some() || ready.snapshot.is_some() {
            // A change of role fails or re-routes the requests waiting for answers, and a
            // snapshot replaces the state that earlier Readies' entries apply to: both come
            // after everything taken before them is done, as if each Ready were flushed in turn.
            self.drain_flushes()
                .and_then(|()| self.ready_until_flush(ready))
        } else {
            self.ready_until_flush(ready)
        };
        match written {
            Ok(ready) => {
                self.unflushed = Some(ready);
                Ok(true)
            }
            Err(err) => {
                self.failed = true;
                Err(err)
            }
        }
    }

    /// The second half of [`NodeCore::drive`]: starts the flush of the Ready that
    /// [`NodeCore::drive_until_flush`] left waiting, then finishes every Ready whose flush is
    /// done, in order: lets its answers leave, applies what it committed and advances. With a
    /// storage that flushes inside [`Storage::start_flush`] that is the Ready just written;
    /// with one that flushes in the background it may be none yet, and the shell calls this
    /// again when a flush completes.
    pub fn finish_drive(&mut self) -> Result<(), StorageError> {
        if self.failed {
            return Err(StorageError::Stopped);
        }
        let result = self.start_and_finish_flushes();
        if result.is_err() {
            self.failed = true;
        }
        result
    }

    fn start_and_finish_flushes(&mut self) -> Result<(), StorageError> {
        if let Some(ready) = self.unflushed.take() {
            let staged_due = self.staged_unflushed >= self.cfg.staged_bytes_per_flush;
            let ticket = if ready.must_sync() || staged_due {
                self.staged_unflushed = 0;
                Some(self.storage.start_flush()?)
            } else {
                None
            };
            self.in_flight.push_back((ready, ticket));
        }
        if self.in_flight.len() >= MAX_READIES_IN_FLIGHT {
            // The disk is behind: wait for it rather than write ever further ahead of it.
            return self.drain_flushes();
        }
        self.finish_flushed()
    }

    /// Finishes the Readies whose flushes are done, oldest first.
    fn finish_flushed(&mut self) -> Result<(), StorageError> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        let done = if self.bug(|b| b.finish_before_flush_done) {
            u64::MAX
        } else {
            self.storage.flushed()?
        };
        while self
            .in_flight
            .front()
            .is_some_and(|(_, ticket)| ticket.is_none_or(|t| t <= done))
        {
            if let Some((ready, _)) = self.in_flight.pop_front() {
                self.ready_from_flush(ready)?;
            }
        }
        Ok(())
    }

    /// Waits for every flush in flight and finishes the Readies behind them.
    pub(super) fn drain_flushes(&mut self) -> Result<(), StorageError> {
        if self.in_flight.iter().any(|(_, ticket)| ticket.is_some()) {
            self.storage.wait_flushed()?;
        }
        self.finish_flushed()
    }

    fn ready_until_flush(&mut self, mut ready: Ready) -> Result<Ready, StorageError> {
        if let Some(soft) = ready.soft_state {
            self.role_changed(soft.role, soft.leader_id);
        }
        if self.in_flight.iter().any(|(r, _)| r.hard_state.is_some()) {
            // A term or vote written by an earlier Ready is not durable yet: no message may
            // carry it before it is, so the early ones wait for this Ready's flush too.
            let mut held = std::mem::take(&mut ready.messages_now);
            held.append(&mut ready.messages);
            ready.messages = held;
        }
        for msg in &ready.messages_now {
            let sent = match self.early_sender.as_mut() {
                Some(send) => send(msg, &self.raft),
                None => false,
            };
            if !sent {
                self.effects.push(Effect::Send(msg.clone()));
            }
        }
        self.stage_chunks(&ready.snapshot_chunks)?;
        if let Some(snapshot) = &ready.snapshot {
            self.begin_install(snapshot)?;
        }
        if let Some(hs) = ready.hard_state {
            self.storage.set_hard_state(hs)?;
        }
        self.storage.append(&ready.entries)?;
        if self.cfg.observe_log && !ready.entries.is_empty() {
            self.observe(Observation::Persisted(ready.entries.clone()));
        }
        self.log_bytes_since_snapshot += ready
            .entries
            .iter()
            .map(|e| match &e.payload {
                EntryPayload::Command(bytes) => bytes.len() as u64 + 24,
                _ => 64,
            })
            .sum::<u64>();
        Ok(ready)
    }

    fn ready_from_flush(&mut self, ready: Ready) -> Result<(), StorageError> {
        for msg in &ready.messages {
            let sent = match self.flushed_sender.as_mut() {
                Some(send) => send(msg, &self.raft),
                None => false,
            };
            if !sent {
                self.effects.push(Effect::Send(msg.clone()));
            }
        }
        self.apply(&ready)?;
        let read_states = ready.read_states.clone();
        self.raft.advance(ready);
        for rs in read_states {
            self.read_indexes.push((rs.index, rs.ctx));
        }
        self.serve_reads();
        self.maybe_snapshot()
    }

    /// Whether a Ready waits for a flush still running in the background: the shell calls
    /// [`NodeCore::finish_drive`] (or drives) when it learns that one is done.
    pub fn flushes_in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// How many Readies were written while an earlier one's flush was still running.
    pub fn overlapped_readies(&self) -> u64 {
        self.overlapped
    }
}
