//! Crash test with real processes: a child process writes to [`SledStorage`] the way the node
//! driver does and is killed with SIGKILL at random moments; after every kill the parent reopens
//! the directory and checks that nothing the child acknowledged was lost.
//!
//! ```text
//!   parent (this test)                         child (this test binary, re-executed)
//!   ──────────────────                         ─────────────────────────────────────
//!   spawn ───────────────────────────────────► open dir, recover, then loop:
//!                                                set hard state, append entries,
//!                                                apply (state + applied index), compact,
//!                                                now and then install a snapshot,
//!                                                flush, then print "ACK ..."
//!   read ACK lines ◄────────────────────────── stdout
//!   sleep a seeded random time, SIGKILL ─────► dies anywhere, even inside sled
//!   reopen, verify against the last ACK, spawn the next child on the same directory
//! ```
//!
//! SIGKILL loses no page cache, so this proves that sled leaves a consistent, complete prefix
//! when the process dies at any instruction; it does not simulate a power cut (MemStorage::crash
//! models that for the simulator). The child is this same test binary started with
//! `RAFTLOCK_CRASH_CHILD_DIR` set, which makes [`crash_child`] run the workload instead of
//! returning at once. Replay a run's kill schedule with `RAFTLOCK_CRASH_SEED=<seed>`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use raftlock::raft::{Entry, EntryPayload, HardState, Index, Membership, SnapshotMeta, Term};
use raftlock::storage::{
    encode_snapshot_data, LogEngine, RecoveredState, SledOptions, SledStorage, Storage,
    StorageError,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CHILD_DIR_ENV: &str = "RAFTLOCK_CRASH_CHILD_DIR";
const CHILD_SEED_ENV: &str = "RAFTLOCK_CRASH_CHILD_SEED";
const CHILD_ENGINE_ENV: &str = "RAFTLOCK_CRASH_CHILD_ENGINE";
/// Segment files this small roll over and are deleted many times in one run.
const CRASH_SEGMENT_BYTES: u64 = 64 * 1024;
const SEED_ENV: &str = "RAFTLOCK_CRASH_SEED";
const KILLS_MIN: u32 = 50;
const KILLS_MAX: u32 = 80;
const RUN_SECONDS_MAX: u64 = 60;
/// Keep at most this many applied entries in the log; older ones are compacted away.
const LOG_APPLIED_ENTRIES_MAX: Index = 200;
const PAYLOAD_BYTES: usize = 100;

/// One acknowledgement: everything up to here was flushed before the line was printed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Ack {
    last_index: Index,
    term: Term,
    applied: Index,
}

impl Ack {
    fn line(&self) -> String {
        format!(
            "ACK last_index={} term={} applied={}",
            self.last_index, self.term, self.applied
        )
    }

    fn parse(line: &str) -> Option<Ack> {
        let rest = line.strip_prefix("ACK ")?;
        let mut ack = Ack::default();
        for field in rest.split_whitespace() {
            let (name, value) = field.split_once('=')?;
            let value: u64 = value.parse().ok()?;
            match name {
                "last_index" => ack.last_index = value,
                "term" => ack.term = value,
                "applied" => ack.applied = value,
                _ => return None,
            }
        }
        Some(ack)
    }
}

/// How often the child installs a snapshot instead of only appending.
const INSTALL_PROBABILITY: f64 = 0.01;
/// Keys in an installed snapshot: enough that its install takes a while to be killed in.
const SNAPSHOT_SLOTS: u64 = 5_000;

/// The state a snapshot at `index` carries: what `verify` expects of an applied state.
fn snapshot_state(index: Index) -> Bytes {
    let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..SNAPSHOT_SLOTS)
        .map(|i| {
            (
                format!("slot/{i:05}").into_bytes(),
                format!("{index}").into_bytes(),
            )
        })
        .collect();
    pairs.push((b"applied".to_vec(), index.to_string().into_bytes()));
    pairs.sort();
    encode_snapshot_data(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())))
}

/// The payload of entry `index` in `term`: self-describing, so a misplaced entry is caught.
fn payload(index: Index, term: Term) -> Bytes {
    let mut text = format!("entry {index} term {term} ").into_bytes();
    text.resize(PAYLOAD_BYTES, b'.');
    Bytes::from(text)
}

fn entry(index: Index, term: Term) -> Entry {
    Entry {
        term,
        index,
        payload: EntryPayload::Command(payload(index, term)),
    }
}

/// Checks a recovered store for every property the workload guarantees. Returns a description
/// of the first violation.
fn verify(state: &RecoveredState, acked: Option<Ack>) -> Result<(), String> {
    let snapshot_index = state.snapshot_meta.index;
    for (expected, entry) in (snapshot_index + 1..).zip(&state.entries) {
        if entry.index != expected {
            return Err(format!(
                "log gap: expected {expected}, found {}",
                entry.index
            ));
        }
        if entry.payload != EntryPayload::Command(payload(entry.index, entry.term)) {
            return Err(format!("entry {} has the wrong payload", entry.index));
        }
    }
    let applied_in_state = state
        .applied_state
        .iter()
        .find(|(key, _)| key == b"applied")
        .map(|(_, value)| String::from_utf8_lossy(value).parse::<Index>());
    match applied_in_state {
        None if state.applied_index == 0 => {}
        Some(Ok(index)) if index == state.applied_index => {}
        other => {
            return Err(format!(
                "applied index {} does not match the applied state ({other:?}): not atomic",
                state.applied_index
            ))
        }
    }
    let applies = state
        .applied_state
        .iter()
        .filter(|(key, _)| key.starts_with(b"slot/"))
        .count();
    if state.applied_index > 0 && applies == 0 {
        return Err("applied state lost its slot keys".to_string());
    }
    if let Some(ack) = acked {
        let recovered = Ack {
            last_index: state.last_index(),
            term: state.hard_state.term,
            applied: state.applied_index,
        };
        if recovered.last_index < ack.last_index
            || recovered.term < ack.term
            || recovered.applied < ack.applied
        {
            return Err(format!(
                "acknowledged data lost: acked {ack:?}, recovered {recovered:?}"
            ));
        }
    }
    let last_term = state
        .entries
        .last()
        .map_or(state.snapshot_meta.term, |entry| entry.term);
    if last_term > state.hard_state.term {
        return Err(format!(
            "last entry has term {last_term} but the hard state only term {}: a later write \
             survived without an earlier one",
            state.hard_state.term
        ));
    }
    if state.hard_state.commit > state.applied_index.max(snapshot_index) {
        return Err(format!(
            "hard state commit {} is ahead of what was applied ({})",
            state.hard_state.commit, state.applied_index
        ));
    }
    Ok(())
}

fn options(engine: LogEngine) -> SledOptions {
    SledOptions {
        log_engine: engine,
        segment_bytes: CRASH_SEGMENT_BYTES,
        ..SledOptions::default()
    }
}

/// Opens the store once the previous holder's file lock is gone: the dead child's, or (in the
/// child) the parent's, whose check of the store ends just before the child starts.
fn open_after_child(dir: &Path, engine: LogEngine) -> Result<SledStorage, StorageError> {
    let mut attempts_left = 200;
    loop {
        match SledStorage::open_with(dir, options(engine)) {
            Err(StorageError::Io { source, .. })
                if attempts_left > 0 && source.to_string().contains("could not acquire lock") =>
            {
                attempts_left -= 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// The child's workload. Runs until killed.
fn run_child(dir: &Path, seed: u64, engine: LogEngine) -> ! {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // The parent has just checked the store and dropped it; sled's threads may hold its file
    // lock a moment longer, so the child waits for it as the parent waits for the child's.
    let mut store = open_after_child(dir, engine).expect("child: open");
    let state = store.recover().expect("child: recover");
    if let Err(problem) = verify(&state, None) {
        panic!("child: recovered state is inconsistent: {problem}");
    }
    let mut term = state.hard_state.term.max(1);
    let mut applied = state.applied_index;
    let mut stdout = std::io::stdout();
    loop {
        if rng.random_bool(0.05) {
            term += 1;
        }
        let last = store.last_index();
        // Sometimes overwrite the unapplied tail with a newer term, as a new leader would. The
        // new log is always longer, so an acknowledged last index never goes back.
        let overwrite = if last > applied.max(store.first_index()) && rng.random_bool(0.2) {
            term += 1;
            rng.random_range(applied.max(store.first_index() - 1) + 1..=last)
        } else {
            last + 1
        };
        let count = rng.random_range(1..=16);
        let entries: Vec<Entry> = (overwrite..=last + count).map(|i| entry(i, term)).collect();
        // As the node driver does: the term is written before any entry of that term, so a
        // crash that keeps a prefix of the writes never leaves entries newer than the term.
        store
            .set_hard_state(HardState {
                term,
                vote: 1,
                commit: applied,
            })
            .expect("child: hard state");
        store.append(&entries).expect("child: append");
        let mut new_last = store.last_index();
        if rng.random_bool(INSTALL_PROBABILITY) {
            // As a follower far behind does: a snapshot from the leader replaces the state and
            // the whole log, at an index past everything here.
            let index = new_last + rng.random_range(1..=50);
            let data = snapshot_state(index);
            let meta = SnapshotMeta {
                index,
                term,
                membership: Membership::with_voters([1, 2, 3]),
            };
            store
                .install_snapshot(&meta, &data)
                .expect("child: install a snapshot");
            applied = index;
            new_last = store.last_index();
        }
        let target = rng.random_range(applied..=new_last);
        let changes = vec![
            (b"applied".to_vec(), Some(target.to_string().into_bytes())),
            (
                format!("slot/{}", target % 32).into_bytes(),
                Some(format!("{target}").into_bytes()),
            ),
        ];
        store.apply(target, &changes).expect("child: apply");
        applied = target;
        if applied > store.first_index() + LOG_APPLIED_ENTRIES_MAX {
            store
                .compact(applied - LOG_APPLIED_ENTRIES_MAX / 2)
                .expect("child: compact");
        }
        store.flush().expect("child: flush");
        let ack = Ack {
            last_index: new_last,
            term,
            applied,
        };
        use std::io::Write;
        writeln!(stdout, "{}", ack.line()).expect("child: write ack");
        stdout.flush().expect("child: flush stdout");
    }
}

/// Entry point of the child process; returns at once in a normal test run.
#[test]
fn crash_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR_ENV) else {
        return;
    };
    let seed = std::env::var(CHILD_SEED_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let engine = std::env::var(CHILD_ENGINE_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_default();
    run_child(Path::new(&dir), seed, engine);
}

#[test]
fn sled_keeps_everything_acknowledged_across_sigkill() {
    keeps_everything_acknowledged_across_sigkill(LogEngine::Sled);
}

/// The same with the Raft log in segment files (`--raft-log-engine segments`).
#[test]
fn segments_keep_everything_acknowledged_across_sigkill() {
    keeps_everything_acknowledged_across_sigkill(LogEngine::Segments);
}

fn keeps_everything_acknowledged_across_sigkill(engine: LogEngine) {
    let seed: u64 = std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!(
        "storage crash test ({engine} log) seed = {seed}; replay the kill schedule with \
         {SEED_ENV}={seed} cargo test --release --test storage_crash {engine}_keep"
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let dir = tempfile::tempdir().expect("temporary directory");
    let exe = std::env::current_exe().expect("own test binary");
    let started = Instant::now();
    let mut acked: Option<Ack> = None;
    let mut kills = 0u32;
    let mut acks_total = 0u64;
    let mut kills_before_first_ack = 0u32;
    let mut installs_resumed = 0u32;

    while kills < KILLS_MAX && started.elapsed() < Duration::from_secs(RUN_SECONDS_MAX) {
        let mut child = Command::new(&exe)
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR_ENV, dir.path())
            .env(CHILD_SEED_ENV, rng.random::<u64>().to_string())
            .env(CHILD_ENGINE_ENV, engine.name())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the child");
        let stdout = child.stdout.take().expect("child stdout");
        let reader = std::thread::spawn(move || {
            let mut acks = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(ack) = Ack::parse(&line) {
                    acks.push(ack);
                }
            }
            acks
        });
        // Mostly kill while the workload runs; now and then during start-up and recovery.
        let delay_ms = if rng.random_bool(0.15) {
            rng.random_range(0..30)
        } else {
            rng.random_range(30..250)
        };
        std::thread::sleep(Duration::from_millis(delay_ms));
        let exited_early = child.try_wait().expect("poll the child");
        if let Some(status) = exited_early {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                use std::io::Read;
                let _ = pipe.read_to_string(&mut stderr);
            }
            panic!("seed {seed}: child exited by itself with {status}:\n{stderr}");
        }
        // `Child::kill` sends SIGKILL on Unix.
        child.kill().expect("SIGKILL the child");
        child.wait().expect("reap the child");
        kills += 1;
        let acks = reader.join().expect("stdout reader");
        if acks.is_empty() {
            kills_before_first_ack += 1;
        }
        acks_total += acks.len() as u64;
        for pair in acks.windows(2) {
            assert!(
                pair[1].last_index >= pair[0].last_index && pair[1].applied >= pair[0].applied,
                "seed {seed}: acks went backwards: {pair:?}"
            );
        }
        if let Some(last) = acks.last() {
            acked = Some(*last);
        }

        let store = open_after_child(dir.path(), engine)
            .unwrap_or_else(|e| panic!("seed {seed} kill {kills}: reopen failed: {e}"));
        if store.resumed_install().is_some() {
            installs_resumed += 1;
        }
        let state = store
            .recover()
            .unwrap_or_else(|e| panic!("seed {seed} kill {kills}: recover failed: {e}"));
        if let Err(problem) = verify(&state, acked) {
            panic!("seed {seed} kill {kills} after {delay_ms} ms: {problem}");
        }
        if let Some(first) = state.entries.first() {
            let reread = store
                .entries(first.index, state.last_index() + 1)
                .unwrap_or_else(|e| panic!("seed {seed} kill {kills}: read failed: {e}"));
            assert_eq!(reread, state.entries, "seed {seed} kill {kills}");
        }
        drop(store);
    }

    let elapsed = started.elapsed();
    println!(
        "storage crash test ({engine} log): seed {seed}, {kills} kills ({kills_before_first_ack} before the \
         child acknowledged anything), {installs_resumed} reopens finishing an interrupted \
         snapshot install, {acks_total} acknowledged flushes, last ack {acked:?}, {:.1} s",
        elapsed.as_secs_f64()
    );
    assert!(
        kills >= KILLS_MIN,
        "seed {seed}: only {kills} kills in {RUN_SECONDS_MAX} s"
    );
    assert!(
        acks_total > u64::from(kills),
        "seed {seed}: the child acknowledged too little ({acks_total} flushes) to test anything"
    );
}
