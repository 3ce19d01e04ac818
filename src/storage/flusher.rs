//! Flushes that complete in the background, for [`super::SledStorage`].
//!
//! The node's driver thread writes a Ready's entries and hands the `fdatasync` (and sled's
//! flush) to a thread of its own, then goes on taking inputs and writing later Readies while
//! the disk works; it lets a Ready's answers leave only once the flush that covers it is done
//! (see `NodeCore`). Jobs that queue up while a flush runs are merged into the next one: one
//! sync covers them all, which is group commit without holding the driver.
//!
//! Flushes complete in the order they were submitted. The first failure stops the thread: that
//! flush and every later one never complete, and [`Flusher::done`] reports the error (the node
//! must stop).

use std::fs::File;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::segment_log::SegmentSync;
use super::StorageError;
use crate::raft::Index;

/// Called on the flusher thread after each flush with how long it took.
pub type FlushObserver = Box<dyn Fn(Duration) + Send + Sync>;
/// Called on the flusher thread when flushes complete (or fail): the driver wakes and finishes
/// the Readies they cover.
pub type FlushWaker = Box<dyn Fn() + Send + Sync>;

/// One flush: what was written before it was submitted.
pub(crate) struct FlushJob {
    /// sled and its log file, when sled was written since the last flush.
    pub sled: Option<(sled::Db, Arc<File>)>,
    /// The snapshot point sled holds as of the submission: made durable with sled.
    pub point: Option<Index>,
    /// The log's segment file and directory (log engine `segments`).
    pub log: SegmentSync,
}

impl FlushJob {
    fn merge(&mut self, later: FlushJob) {
        if later.sled.is_some() {
            self.sled = later.sled;
        }
        self.point = self.point.max(later.point);
        self.log.merge(later.log);
    }

    fn run(&self) -> Result<(), StorageError> {
        if let Some((db, file)) = &self.sled {
            db.flush().map_err(|e| StorageError::sled("flushing", e))?;
            file.sync_data().map_err(|source| StorageError::Io {
                action: "syncing sled's log file",
                source,
            })?;
        }
        self.log.run()
    }
}

#[derive(Default)]
struct Done {
    ticket: u64,
    /// The newest snapshot point made durable.
    point: Option<Index>,
    error: Option<StorageError>,
    failed: bool,
}

struct Shared {
    done: Mutex<Done>,
    changed: Condvar,
}

pub(crate) struct Flusher {
    jobs: Option<mpsc::Sender<(u64, FlushJob, tracing::Span)>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    last_ticket: u64,
}

impl Flusher {
    pub(crate) fn start(wake: FlushWaker, observe: FlushObserver) -> Result<Flusher, StorageError> {
        let (tx, rx) = mpsc::channel::<(u64, FlushJob, tracing::Span)>();
        let shared = Arc::new(Shared {
            done: Mutex::new(Done::default()),
            changed: Condvar::new(),
        });
        let on_thread = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("raftlock-flush".into())
            .spawn(move || run(rx, on_thread, wake, observe))
            .map_err(|source| StorageError::Io {
                action: "starting the flush thread",
                source,
            })?;
        Ok(Flusher {
            jobs: Some(tx),
            shared,
            thread: Some(thread),
            last_ticket: 0,
        })
    }

    /// Queues a flush; returns its ticket.
    pub(crate) fn submit(&mut self, job: FlushJob) -> Result<u64, StorageError> {
        self.last_ticket += 1;
        let sent = self
            .jobs
            .as_ref()
            // The submitter's span (the driver's batch, when traced) becomes the parent of the
            // sync that makes the job durable.
            .is_some_and(|jobs| {
                jobs.send((self.last_ticket, job, tracing::Span::current()))
                    .is_ok()
            });
        if !sent {
            // The thread stopped after a failure, which `done` reports.
            self.done()?;
            return Err(StorageError::Stopped);
        }
        Ok(self.last_ticket)
    }

    /// The newest ticket done and the newest snapshot point made durable; the failure that
    /// stopped the thread, once, then [`StorageError::Stopped`].
    pub(crate) fn done(&self) -> Result<(u64, Option<Index>), StorageError> {
        let mut done = lock(&self.shared.done);
        if let Some(err) = done.error.take() {
            return Err(err);
        }
        if done.failed {
            return Err(StorageError::Stopped);
        }
        Ok((done.ticket, done.point))
    }

    /// Waits until every submitted flush is done (or one failed).
    pub(crate) fn wait(&self) -> Result<(), StorageError> {
        let mut done = lock(&self.shared.done);
        while done.ticket < self.last_ticket && !done.failed {
            done = self
                .shared
                .changed
                .wait(done)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        drop(done);
        self.done().map(|_| ())
    }

    /// The newest ticket handed out.
    pub(crate) fn last_ticket(&self) -> u64 {
        self.last_ticket
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has run what is queued.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock(m: &Mutex<Done>) -> std::sync::MutexGuard<'_, Done> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn run(
    rx: mpsc::Receiver<(u64, FlushJob, tracing::Span)>,
    shared: Arc<Shared>,
    wake: FlushWaker,
    observe: FlushObserver,
) {
    while let Ok((mut ticket, mut job, parent)) = rx.recv() {
        // Everything queued meanwhile rides on this flush: a child of the first submitter's
        // batch, following from the others'.
        let mut merged = 1u64;
        let mut others = Vec::new();
        while let Ok((later_ticket, later, later_parent)) = rx.try_recv() {
            ticket = later_ticket;
            job.merge(later);
            merged += 1;
            others.push(later_parent);
        }
        let span = tracing::debug_span!(parent: &parent, "raft.fsync", flushes = merged);
        if !span.is_disabled() {
            for other in &others {
                span.follows_from(other);
            }
        }
        drop(others);
        let _entered = span.enter();
        let started = Instant::now();
        let result = job.run();
        observe(started.elapsed());
        let failed = result.is_err();
        {
            let mut done = lock(&shared.done);
            match result {
                Ok(()) => {
                    done.ticket = ticket;
                    done.point = done.point.max(job.point);
                }
                Err(err) => {
                    done.error = Some(err);
                    done.failed = true;
                }
            }
        }
        shared.changed.notify_all();
        wake();
        if failed {
            return;
        }
    }
}
