//! The storage benchmark behind `raftlock-bench storage`: durable appends per second through
//! [`SledStorage`] with one flush per batch, next to plain appends to a file with `sync_data`
//! on the same disk, with the CPU time (user and kernel) each flush costs the process.
//!
//! ```text
//!   for each batch size:  append(batch of ~100-byte entries) ─► flush ─► (acknowledge)   repeat
//!                         (the log in sled, then the log in segment files)
//!   raw disk:             write(batch × 100 bytes) ─► sync_data                          repeat
//! ```
//!
//! Both run in the same directory, so the ratio between them is what sled costs over the disk's
//! own sync, and the raw cases are what a log kept in a plain append-only file would cost.
//! Measures only; prints nothing (the binary prints the table).
//!
//! sled 0.34's own `flush` ends in `sync_file_range` on Linux (its log writes), not `fsync`:
//! that survives a process crash but neither flushes the drive's write cache nor file metadata.
//! [`SledStorage`]'s flush therefore also `fdatasync`s sled's log file, and the sled cases here
//! measure that whole flush, as a node runs it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{LogEngine, SledOptions, SledStorage, Storage, StorageError};
use crate::raft::{Entry, EntryPayload};

/// Approximate stored size of one benchmark entry, header included.
pub const ENTRY_BYTES: usize = 100;
/// Bytes written before each raw `sync_data`.
pub const RAW_WRITE_BYTES: usize = 100;
/// Upper bound on samples kept per case, so a very fast disk cannot exhaust memory.
const SAMPLES_MAX: usize = 10_000_000;

/// One measured case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// `sled append+flush` or `raw write+sync_data`.
    pub what: &'static str,
    /// Entries (records) per flush or sync.
    pub batch: usize,
    /// Completed flushes (one per batch) or syncs.
    pub syncs: u64,
    pub elapsed: Duration,
    /// Latency of one batch: append and flush (or write and sync).
    pub latency_p50: Duration,
    pub latency_p99: Duration,
    /// CPU time the whole process used during the case, user and kernel (all threads: sled's
    /// I/O pool and flusher too). `None` where `/proc/self/stat` cannot be read.
    pub cpu: Option<(Duration, Duration)>,
}

impl CaseResult {
    pub fn syncs_per_second(&self) -> f64 {
        self.syncs as f64 / self.elapsed.as_secs_f64()
    }

    pub fn entries_per_second(&self) -> f64 {
        self.syncs_per_second() * self.batch as f64
    }

    /// CPU time (user, kernel) per flush or sync, in microseconds.
    pub fn cpu_per_sync_us(&self) -> Option<(f64, f64)> {
        let (user, kernel) = self.cpu?;
        let n = self.syncs.max(1) as f64;
        Some((user.as_secs_f64() * 1e6 / n, kernel.as_secs_f64() * 1e6 / n))
    }
}

/// This process's CPU time so far (user, kernel), from `/proc/self/stat` (Linux).
fn process_cpu() -> Option<(Duration, Duration)> {
    let (user, kernel) = stat_ticks(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
    // USER_HZ is 100 on Linux: a tick is 10 ms.
    Some((
        Duration::from_millis(user * 10),
        Duration::from_millis(kernel * 10),
    ))
}

/// User and kernel ticks from a `/proc/…/stat` line (a process's or a thread's): after the name
/// in parentheses (which may hold spaces and parentheses) state is field 3, utime 14 and stime
/// 15 (proc(5)).
pub fn stat_ticks(stat: &str) -> Option<(u64, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some((fields.get(11)?.parse().ok()?, fields.get(12)?.parse().ok()?))
}

fn cpu_since(start: Option<(Duration, Duration)>) -> Option<(Duration, Duration)> {
    let (u0, k0) = start?;
    let (u1, k1) = process_cpu()?;
    Some((u1.saturating_sub(u0), k1.saturating_sub(k0)))
}

/// Why the benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("storage failed: {0}")]
    Storage(#[from] StorageError),
    #[error("raw disk I/O failed in {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() - 1) as f64 * fraction).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn finish(
    what: &'static str,
    batch: usize,
    elapsed: Duration,
    mut samples: Vec<Duration>,
    cpu: Option<(Duration, Duration)>,
) -> CaseResult {
    samples.sort_unstable();
    CaseResult {
        what,
        batch,
        syncs: samples.len() as u64,
        elapsed,
        latency_p50: percentile(&samples, 0.50),
        latency_p99: percentile(&samples, 0.99),
        cpu,
    }
}

/// Appends batches of `batch` entries to a fresh store in `dir` whose log is kept by `engine`,
/// flushing once per batch, for `duration`.
pub fn bench_sled_appends(
    dir: &Path,
    engine: LogEngine,
    batch: usize,
    duration: Duration,
) -> Result<CaseResult, BenchError> {
    let batch = batch.max(1);
    let mut store = SledStorage::open_with(
        dir,
        SledOptions {
            log_engine: engine,
            ..SledOptions::default()
        },
    )?;
    // Payload sized so that the encoded entry (crc, version, term, index, kind) is ENTRY_BYTES.
    let payload = Bytes::from(vec![b'x'; ENTRY_BYTES - 22]);
    let mut next_index = store.last_index() + 1;
    let mut samples = Vec::new();
    let cpu_start = process_cpu();
    let started = Instant::now();
    while started.elapsed() < duration && samples.len() < SAMPLES_MAX {
        let entries: Vec<Entry> = (next_index..next_index + batch as u64)
            .map(|index| Entry {
                term: 1,
                index,
                payload: EntryPayload::Command(payload.clone()),
            })
            .collect();
        let batch_started = Instant::now();
        store.append(&entries)?;
        store.flush()?;
        samples.push(batch_started.elapsed());
        next_index += batch as u64;
    }
    let elapsed = started.elapsed();
    Ok(finish(
        match store.log_engine() {
            LogEngine::Segments => "segments append+flush",
            _ => "sled append+flush",
        },
        batch,
        elapsed,
        samples,
        cpu_since(cpu_start),
    ))
}

/// Appends `batch` records of `RAW_WRITE_BYTES` to a file in `dir` with one `write` and calls
/// `sync_data`, repeatedly, for `duration`: the floor under any durable append on this disk,
/// and what a log kept in a plain append-only file would cost.
pub fn bench_raw_fsync(
    dir: &Path,
    batch: usize,
    duration: Duration,
) -> Result<CaseResult, BenchError> {
    let batch = batch.max(1);
    let path = dir.join("raw-fsync.dat");
    let io_error = |source| BenchError::Io {
        path: path.clone(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io_error)?;
    let record = vec![b'x'; RAW_WRITE_BYTES * batch];
    let mut samples = Vec::new();
    let cpu_start = process_cpu();
    let started = Instant::now();
    while started.elapsed() < duration && samples.len() < SAMPLES_MAX {
        let sync_started = Instant::now();
        file.write_all(&record).map_err(io_error)?;
        file.sync_data().map_err(io_error)?;
        samples.push(sync_started.elapsed());
    }
    let elapsed = started.elapsed();
    Ok(finish(
        "raw write+sync_data",
        batch,
        elapsed,
        samples,
        cpu_since(cpu_start),
    ))
}

/// Runs every case in its own subdirectory of `dir`: the log in sled with each batch size, the
/// log in segment files ([`LogEngine::Segments`]) with each, then raw writes of the same
/// batches with `sync_data`. Subdirectories are removed afterwards.
pub fn run(
    dir: &Path,
    batches: &[usize],
    duration: Duration,
) -> Result<Vec<CaseResult>, BenchError> {
    let mut results = Vec::new();
    let io_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BenchError::Io { path, source }
    };
    for engine in [LogEngine::Sled, LogEngine::Segments] {
        for &batch in batches {
            let case_dir = dir.join(format!("{engine}-batch-{batch}"));
            let _ = std::fs::remove_dir_all(&case_dir);
            std::fs::create_dir_all(&case_dir).map_err(io_error(&case_dir))?;
            let result = bench_sled_appends(&case_dir, engine, batch, duration);
            let _ = std::fs::remove_dir_all(&case_dir);
            results.push(result?);
        }
    }
    for &batch in batches {
        let raw_dir = dir.join(format!("raw-batch-{batch}"));
        std::fs::create_dir_all(&raw_dir).map_err(io_error(&raw_dir))?;
        let result = bench_raw_fsync(&raw_dir, batch, duration);
        let _ = std::fs::remove_dir_all(&raw_dir);
        results.push(result?);
    }
    Ok(results)
}
