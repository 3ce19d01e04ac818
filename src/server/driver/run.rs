//! The driver's loop: each turn takes a tick, a batch of inputs or a finished flush, drives the
//! core through its Readies within the turn budget, then carries out the effects and publishes
//! the status; on SIGTERM, leadership is handed over before the node stops.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::arrival::{ArrivalWait, WaitOutcome};
use super::{Driver, Input, SLOW_TURN, TURN_BUDGET};
use crate::storage::StorageError;

impl Driver {
    /// Runs until the input queue closes (every sender dropped) or a shutdown is requested.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(self.cfg.tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.publish_status();
        let mut inputs = 0usize;
        let mut handled = Duration::ZERO;
        let flush_done = self.flush_done.clone();
        loop {
            // Work left over from a turn that used up its budget; taken in turn with ticks
            // and inputs (select! picks among ready branches at random).
            let more = self.core.raft().has_ready() || self.core.installing_snapshot().is_some();
            let result = tokio::select! {
                _ = std::future::ready(()), if more => {
                    self.batch_started = std::time::Instant::now();
                    // This branch is ready at every turn while a snapshot is installed, and
                    // select! picks among ready branches at random: a tick that is due is
                    // taken here too, so that the election clock (by which this node grants
                    // PreVotes once its leader is gone) does not run slow meanwhile.
                    let ticked = match futures::FutureExt::now_or_never(ticker.tick()) {
                        Some(_) => self.on_tick(),
                        None => Ok(()),
                    };
                    match ticked {
                        Ok(()) => self.drive().await,
                        err => err,
                    }
                }
                // Flushes completed on the storage's thread: their Readies' answers leave,
                // what they committed applies.
                _ = flush_done.notified(), if self.core.flushes_in_flight() => {
                    self.batch_started = std::time::Instant::now();
                    self.core.finish_drive()
                }
                _ = ticker.tick() => {
                    self.batch_started = std::time::Instant::now();
                    self.on_tick()
                }
                input = self.inputs.recv() => {
                    let Some(input) = input else { break };
                    self.batch_started = std::time::Instant::now();
                    let mut batch = Vec::with_capacity(64);
                    batch.push(input);
                    while batch.len() < self.cfg.max_batch_inputs {
                        match self.inputs.try_recv() {
                            Ok(more) => batch.push(more),
                            Err(_) => break,
                        }
                    }
                    self.await_answered_clients(&mut batch).await;
                    // Traced only when it carries work: a client request, or entries from the
                    // leader. Heartbeats and their answers (tens a second on an idle cluster)
                    // make no trace.
                    let span = if batch.iter().any(carries_work) {
                        tracing::debug_span!(
                            "raft.batch",
                            inputs = batch.len() as i64,
                            commit_index = tracing::field::Empty,
                        )
                    } else {
                        tracing::Span::none()
                    };
                    let _entered = span.enter();
                    inputs = batch.len();
                    self.handle_inputs(batch);
                    handled = self.batch_started.elapsed();
                    let result = self.drive().await;
                    if !span.is_disabled() {
                        span.record("commit_index", self.core.raft().commit_index() as i64);
                    }
                    result
                }
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        self.graceful_shutdown().await;
                        break;
                    }
                    Ok(())
                }
            };
            let mut result = result;
            // One slice of a snapshot install per turn (the branch above): the ticks, votes and
            // appends waiting meanwhile are taken between slices.
            while result.is_ok()
                && self.core.raft().has_ready()
                && self.batch_started.elapsed() < TURN_BUDGET
            {
                result = self.drive().await;
            }
            let driven = self.batch_started.elapsed();
            let result = result.and_then(|()| self.after_drive());
            if let Err(err) = result {
                error!(cause = %err, "storage failure; stopping the node");
                break;
            }
            let took = self.batch_started.elapsed();
            let storage = self.core.storage_mut().take_spent();
            if took >= SLOW_TURN {
                // Peers hear nothing from this node while a turn runs: a leader's turn near the
                // election timeout costs its leadership.
                warn!(
                    took_ms = took.as_millis() as u64,
                    inputs,
                    inputs_ms = handled.as_millis() as u64,
                    drive_ms = driven.saturating_sub(handled).as_millis() as u64,
                    effects_ms = took.saturating_sub(driven).as_millis() as u64,
                    append_ms = storage.append.as_millis() as u64,
                    apply_ms = storage.apply.as_millis() as u64,
                    flush_ms = storage.flush.as_millis() as u64,
                    "slow driver turn"
                );
            }
            inputs = 0;
            handled = Duration::ZERO;
            // Answers, and appends queued by a drive that did not yield (a tick's), wait in
            // the streams that run on this thread: let them write before the next turn.
            let answers = self.answers_sent.swap(false, Ordering::Relaxed);
            let appends = self.appends_sent.swap(false, Ordering::Relaxed);
            // A snapshot being installed keeps the next turn ready at once: the streams and
            // the peer port's requests (votes) on this thread get their turn in between.
            if answers || appends || self.core.installing_snapshot().is_some() {
                tokio::task::yield_now().await;
            }
        }
        if let Err(err) = self
            .finish_snapshot_job()
            .and_then(|()| self.core.shutdown())
        {
            error!(cause = %err, "could not write the applied state at shutdown");
        }
        self.handle_effects();
    }

    /// The commit delay (`arrival`): while clients answered by the last turns have not sent
    /// their next request, a batch of client requests waits for them, up to the learned window,
    /// so that one flush covers theirs too. The wait spins (yielding to the streams on this
    /// thread): the runtime's timers are too coarse for tens of microseconds.
    async fn await_answered_clients(&mut self, batch: &mut Vec<Input>) {
        let clients = batch.iter().filter(|i| is_client(i)).count();
        let Some(window) = self.arrival.window(clients) else {
            return;
        };
        let started = std::time::Instant::now();
        let mut outcome = WaitOutcome::TimedOut;
        while batch.len() < self.cfg.max_batch_inputs && started.elapsed() < window {
            match self.inputs.try_recv() {
                Ok(more) => {
                    let client = is_client(&more);
                    batch.push(more);
                    if client && self.arrival.arrived() {
                        outcome = WaitOutcome::Arrived;
                        break;
                    }
                }
                Err(_) => tokio::task::yield_now().await,
            }
        }
        let waited = started.elapsed();
        self.arrival.finished(outcome, waited);
        self.metrics
            .commit_delay_waits_total
            .with_label_values(&[ArrivalWait::label(outcome)])
            .inc();
        self.metrics
            .commit_delay_seconds
            .observe(waited.as_secs_f64());
    }

    /// A tick: where the next flushes run, a finished snapshot job, and the core's clock.
    fn on_tick(&mut self) -> Result<(), StorageError> {
        self.core.storage_mut().choose_flush_thread();
        let now = self.now();
        self.poll_snapshot_job().and_then(|()| self.core.tick(now))
    }

    /// One Ready: up to its flush, then (when the leader queued appends for the peers) a yield
    /// to the streams on this thread so that they write them to their sockets, then the flush
    /// and the rest. The followers write the entries while the leader flushes its own copy.
    async fn drive(&mut self) -> Result<(), StorageError> {
        if self.core.drive_until_flush()? && self.appends_sent.swap(false, Ordering::Relaxed) {
            tokio::task::yield_now().await;
        }
        self.core.finish_drive()
    }

    /// Carries out what the core asked for and publishes the new status.
    fn after_drive(&mut self) -> Result<(), StorageError> {
        self.handle_effects();
        if self.core.needs_snapshot_result() {
            self.finish_snapshot_job()?;
            self.handle_effects();
        }
        self.publish_status();
        let members = self.core.raft().membership();
        self.transport.retain(|id| members.contains(id));
        self.on_thread.retain(|id| members.contains(id));
        Ok(())
    }

    /// On SIGTERM: hand leadership to the most caught-up voter, give it a moment, flush.
    async fn graceful_shutdown(&mut self) {
        let Some(target) = self.core.transfer_leadership() else {
            return;
        };
        info!(to = target, "transferring leadership before shutdown");
        let deadline = Instant::now() + self.cfg.tick * 40;
        while Instant::now() < deadline && self.core.raft().is_leader() {
            if self.core.drive().and_then(|()| self.after_drive()).is_err() {
                return;
            }
            let result = tokio::select! {
                _ = tokio::time::sleep(self.cfg.tick) => {
                    let now = self.now();
                    self.core.tick(now)
                }
                input = self.inputs.recv() => match input {
                    Some(input) => {
                        self.handle_inputs(vec![input]);
                        self.core.drive()
                    }
                    None => return,
                },
            };
            if result.and_then(|()| self.after_drive()).is_err() {
                return;
            }
        }
    }
}

fn is_client(input: &Input) -> bool {
    matches!(input, Input::Client { .. })
}

/// Whether an input is work a trace should show: a client request, or log entries to append.
fn carries_work(input: &Input) -> bool {
    match input {
        Input::Client { .. } => true,
        Input::Peer(msg) => matches!(
            &msg.body,
            crate::raft::MessageBody::Append { entries, .. } if !entries.is_empty()
        ),
        _ => false,
    }
}
