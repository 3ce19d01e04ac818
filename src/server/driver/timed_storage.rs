//! The driver's storage wrapper: [`TimedStorage`] times appends, applies and flushes (for the
//! metrics and the slow-turn log line) and chooses, tick by tick, whether flushes run on the
//! driver's thread or the storage's flush thread (`--background-flush`, [`FlushMode`]).

use std::time::Duration;

use crate::raft::Snapshot;
use crate::storage::{Storage, StorageError};
use crate::telemetry::NodeMetrics;

/// Storage that times its flushes for `raftlock_fsync_duration_seconds`.
pub struct TimedStorage<S> {
    inner: S,
    metrics: NodeMetrics,
    /// Time spent appending, applying and flushing since the driver last took it (for the
    /// slow-turn log line).
    spent: StorageTime,
    /// Flushes may run on the storage's own thread, which times them.
    background: bool,
    /// The flush thread is used while the node is busy (`--background-flush auto`); without
    /// it, `offload` stays as it started.
    adaptive: bool,
    /// Flushes go to the flush thread; otherwise the driver flushes on its own thread.
    offload: bool,
    /// When the last flush on the driver's thread ended.
    last_inline_end: Option<std::time::Instant>,
    /// Flushes since the last tick, and how many of them had work waiting: on the driver's
    /// thread, a flush that began sooner after the previous one ended than that one took; on
    /// the flush thread, a flush started while another was still running.
    flushes: u32,
    pressed: u32,
    /// The moving average of the share of flushes that had work waiting, in thousandths.
    pressure: u32,
    /// The newest flush handed to the flush thread.
    last_ticket: u64,
}

impl<S: Storage> TimedStorage<S> {
    /// `background`: the storage has a flush thread running. `mode` says how it is used; the
    /// flush-thread gauge starts at where the first flushes will run.
    pub(super) fn new(inner: S, metrics: NodeMetrics, background: bool, mode: FlushMode) -> Self {
        let offload = background && mode == FlushMode::Always;
        metrics.flush_thread_active.set(i64::from(offload));
        TimedStorage {
            inner,
            metrics,
            spent: StorageTime::default(),
            background,
            adaptive: mode == FlushMode::Auto,
            offload,
            last_inline_end: None,
            flushes: 0,
            pressed: 0,
            pressure: 0,
            last_ticket: 0,
        }
    }

    /// Called every tick: where the next flushes run. A flush on the flush thread costs two
    /// thread wake-ups (it, then the driver), which pays off only when the driver has other
    /// work meanwhile — under load, when flushes follow each other closely — and is pure delay
    /// for one client at a time. Each tick's share of flushes that had work waiting (none for
    /// a tick with fewer than [`MIN_FLUSHES_TO_OFFLOAD`]) goes into a moving average over about
    /// eight ticks; flushes move to the flush thread when it passes one half and back when it
    /// falls below one quarter. One tick's share alone swings across both bounds from tick to
    /// tick at every load, and switching on it moved flushes back and forth up to 50 times a
    /// second (`raftlock_flush_thread_switches_total`).
    pub(super) fn choose_flush_thread(&mut self) {
        if !self.background || !self.adaptive {
            return;
        }
        let (flushes, pressed) = (self.flushes, self.pressed);
        self.flushes = 0;
        self.pressed = 0;
        let share = if flushes < MIN_FLUSHES_TO_OFFLOAD {
            0
        } else {
            pressed * PRESSURE_SCALE / flushes
        };
        self.pressure = (self.pressure * (PRESSURE_TICKS - 1) + share) / PRESSURE_TICKS;
        let offload = if self.offload {
            self.pressure * 4 >= PRESSURE_SCALE
        } else {
            self.pressure * 2 > PRESSURE_SCALE
        };
        if offload != self.offload {
            self.offload = offload;
            self.metrics.flush_thread_active.set(i64::from(offload));
            self.metrics.flush_thread_switches_total.inc();
        }
    }

    fn start_flush_inline(&mut self) -> Result<u64, StorageError> {
        let started = std::time::Instant::now();
        self.flush()?;
        let ended = std::time::Instant::now();
        if let Some(previous) = self.last_inline_end {
            if started.duration_since(previous) < ended.duration_since(started) {
                self.pressed += 1;
            }
        }
        self.last_inline_end = Some(ended);
        self.flushes += 1;
        self.inner.flushed()
    }
}

/// Where flushes run (`--background-flush`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushMode {
    /// On the flush thread while flushes follow each other closely, on the driver's otherwise.
    Auto,
    /// Always on the flush thread.
    Always,
    /// Always on the driver's thread.
    Never,
}

impl std::str::FromStr for FlushMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(FlushMode::Auto),
            "always" => Ok(FlushMode::Always),
            "never" => Ok(FlushMode::Never),
            other => Err(format!("is {other:?}; use auto, always or never")),
        }
    }
}

/// A tick (10 ms) with fewer flushes than this counts as one with none waiting.
const MIN_FLUSHES_TO_OFFLOAD: u32 = 4;
/// `TimedStorage::pressure` is in thousandths, averaged over about this many ticks.
const PRESSURE_SCALE: u32 = 1000;
const PRESSURE_TICKS: u32 = 8;

/// Where a driver turn's storage time went.
#[derive(Clone, Copy, Debug, Default)]
pub struct StorageTime {
    pub append: Duration,
    pub apply: Duration,
    pub flush: Duration,
}

impl<S> TimedStorage<S> {
    pub(super) fn take_spent(&mut self) -> StorageTime {
        std::mem::take(&mut self.spent)
    }
}

impl<S: Storage> Storage for TimedStorage<S> {
    fn recover(&self) -> Result<crate::storage::RecoveredState, StorageError> {
        self.inner.recover()
    }
    fn append(&mut self, entries: &[crate::raft::Entry]) -> Result<(), StorageError> {
        crate::server::probe::event("append");
        let started = std::time::Instant::now();
        let result = self.inner.append(entries);
        self.spent.append += started.elapsed();
        crate::server::probe::event("appended");
        if let Some(last) = entries.last() {
            crate::server::probe::appended(last.index);
        }
        result
    }
    fn set_hard_state(&mut self, hs: crate::raft::HardState) -> Result<(), StorageError> {
        self.inner.set_hard_state(hs)
    }
    fn apply(
        &mut self,
        applied_index: crate::raft::Index,
        changes: &[crate::storage::KvChange],
    ) -> Result<(), StorageError> {
        let started = std::time::Instant::now();
        let result = self.inner.apply(applied_index, changes);
        let took = started.elapsed();
        self.spent.apply += took;
        self.metrics
            .state_write_duration_seconds
            .observe(took.as_secs_f64());
        result
    }
    fn install_snapshot(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &[u8],
    ) -> Result<(), StorageError> {
        self.inner.install_snapshot(meta, data)
    }
    fn begin_install(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        self.inner.begin_install(meta, data)
    }
    fn begin_install_staged(
        &mut self,
        meta: &crate::raft::SnapshotMeta,
        data: &bytes::Bytes,
    ) -> Result<(), StorageError> {
        self.inner.begin_install_staged(meta, data)
    }
    fn continue_install(&mut self, max_pairs: usize) -> Result<bool, StorageError> {
        self.inner.continue_install(max_pairs)
    }
    fn begin_snapshot(&mut self, meta: &crate::raft::SnapshotMeta) -> Result<(), StorageError> {
        self.inner.begin_snapshot(meta)
    }
    fn write_snapshot_chunk(&mut self, offset: u64, chunk: &[u8]) -> Result<(), StorageError> {
        self.inner.write_snapshot_chunk(offset, chunk)
    }
    fn finish_snapshot(&mut self) -> Result<crate::raft::SnapshotMeta, StorageError> {
        self.inner.finish_snapshot()
    }
    fn build_snapshot(&self) -> Result<Snapshot, StorageError> {
        self.inner.build_snapshot()
    }
    fn snapshot_job(&self) -> Result<crate::storage::SnapshotJob, StorageError> {
        self.inner.snapshot_job()
    }
    fn snapshot_job_with(
        &self,
        convert: crate::storage::PairsConvert,
    ) -> Result<crate::storage::SnapshotJob, StorageError> {
        self.inner.snapshot_job_with(convert)
    }
    fn compact(&mut self, upto: crate::raft::Index) -> Result<(), StorageError> {
        self.inner.compact(upto)
    }
    fn entries(
        &self,
        lo: crate::raft::Index,
        hi: crate::raft::Index,
    ) -> Result<Vec<crate::raft::Entry>, StorageError> {
        self.inner.entries(lo, hi)
    }
    fn term(&self, index: crate::raft::Index) -> Result<crate::raft::Term, StorageError> {
        self.inner.term(index)
    }
    fn first_index(&self) -> crate::raft::Index {
        self.inner.first_index()
    }
    fn last_index(&self) -> crate::raft::Index {
        self.inner.last_index()
    }
    fn applied_index(&self) -> crate::raft::Index {
        self.inner.applied_index()
    }
    fn start_flush(&mut self) -> Result<u64, StorageError> {
        if !self.offload {
            return self.start_flush_inline();
        }
        self.last_inline_end = None;
        self.flushes += 1;
        if self.inner.flushed()? < self.last_ticket {
            self.pressed += 1;
        }
        crate::server::probe::event("flush");
        let started = std::time::Instant::now();
        let result = self.inner.start_flush();
        self.spent.flush += started.elapsed();
        if let Ok(ticket) = result {
            self.last_ticket = ticket;
        }
        result
    }
    fn flushed(&mut self) -> Result<u64, StorageError> {
        self.inner.flushed()
    }
    fn wait_flushed(&mut self) -> Result<(), StorageError> {
        let started = std::time::Instant::now();
        let result = self.inner.wait_flushed();
        self.spent.flush += started.elapsed();
        result
    }
    fn flush(&mut self) -> Result<(), StorageError> {
        let _span = tracing::debug_span!("raft.fsync").entered();
        crate::server::probe::event("flush");
        let started = std::time::Instant::now();
        let result = self.inner.flush();
        let took = started.elapsed();
        crate::server::probe::event("flushed");
        self.spent.flush += took;
        self.metrics
            .fsync_duration_seconds
            .observe(took.as_secs_f64());
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(background: bool) -> TimedStorage<crate::storage::MemStorage> {
        TimedStorage::new(
            crate::storage::MemStorage::new(),
            NodeMetrics::new(),
            background,
            FlushMode::Auto,
        )
    }

    /// Runs `ticks` ticks, each with `flushes` flushes of which `pressed` had work waiting.
    fn ticks(
        s: &mut TimedStorage<crate::storage::MemStorage>,
        n: usize,
        flushes: u32,
        pressed: u32,
    ) {
        for _ in 0..n {
            (s.flushes, s.pressed) = (flushes, pressed);
            s.choose_flush_thread();
            assert_eq!((s.flushes, s.pressed), (0, 0));
        }
    }

    #[test]
    fn flushes_move_to_the_flush_thread_under_pressure_and_back_when_it_ends() {
        let mut s = timed(true);
        // Ticks with few flushes, or with flushes that had nothing waiting: the driver's thread.
        ticks(&mut s, 50, 3, 3);
        assert!(!s.offload);
        ticks(&mut s, 50, 10, 4);
        assert!(!s.offload);
        // One tick where most flushes had work waiting is not enough.
        ticks(&mut s, 1, 10, 10);
        assert!(!s.offload);
        assert_eq!(s.metrics.flush_thread_switches_total.get(), 0);
        // Several are: the flush thread.
        ticks(&mut s, 10, 10, 8);
        assert!(s.offload);
        assert_eq!(s.metrics.flush_thread_active.get(), 1);
        assert_eq!(s.metrics.flush_thread_switches_total.get(), 1);
        // It stays there while about a quarter of them overlap another, and through a tick or
        // two with none.
        ticks(&mut s, 50, 8, 3);
        ticks(&mut s, 2, 0, 0);
        assert!(s.offload);
        // Ticks that alternate between 60% and none waiting (each one alone across both
        // bounds) average out at 30%: no switch back and forth.
        for _ in 0..50 {
            ticks(&mut s, 1, 10, 6);
            ticks(&mut s, 1, 10, 0);
            assert!(s.offload);
        }
        assert_eq!(s.metrics.flush_thread_switches_total.get(), 1);
        // Below a quarter for a while: back to the driver's thread.
        ticks(&mut s, 20, 10, 1);
        assert!(!s.offload);
        assert_eq!(s.metrics.flush_thread_active.get(), 0);
        assert_eq!(s.metrics.flush_thread_switches_total.get(), 2);
        // Nor between 80% and none (40%) on the driver's thread.
        for _ in 0..50 {
            ticks(&mut s, 1, 10, 8);
            ticks(&mut s, 1, 10, 0);
            assert!(!s.offload);
        }
        // An idle stretch after load brings it back within about a tenth of a second.
        ticks(&mut s, 20, 10, 10);
        assert!(s.offload);
        ticks(&mut s, 12, 0, 0);
        assert!(!s.offload);
    }

    #[test]
    fn without_background_flushes_every_flush_is_inline() {
        let mut s = timed(false);
        (s.flushes, s.pressed) = (100, 100);
        s.choose_flush_thread();
        assert!(!s.offload);
        assert_eq!(s.start_flush().unwrap(), u64::MAX);
    }
}
