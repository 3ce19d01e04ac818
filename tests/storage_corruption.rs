//! Damaged storage is reported, never a panic and never silently dropped data.
//!
//! Two levels of damage:
//! - value level: a record inside sled is changed behind our back (a flipped bit, a truncated
//!   value, a missing entry, a junk key). Our CRC-32 and invariant checks must name the tree, the
//!   key and the problem.
//! - file level: sled's own files are truncated or have bytes flipped. Whatever sled does, our API
//!   must answer with an `Err` or with exactly the data that was written; a panic or a silently
//!   shorter log fails the test.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use bytes::Bytes;
use raftlock::raft::{Entry, EntryPayload, HardState, Index};
use raftlock::storage::{RecoveredState, SledStorage, Storage, StorageError};

/// One named way to damage a copy of a store.
type DamageCase = (String, Box<dyn Fn(&Path)>);

const ENTRIES: Index = 200;

fn entry(index: Index) -> Entry {
    Entry {
        term: 1 + index / 50,
        index,
        payload: EntryPayload::Command(Bytes::from(format!("command number {index:>6}"))),
    }
}

/// sled releases its directory lock shortly after the last handle is dropped (its I/O threads
/// finish first), so opening right after closing may briefly find it locked: retry that only.
fn retry_while_locked<T, E: std::fmt::Display>(
    mut open: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    for _ in 0..200 {
        match open() {
            Err(err) if err.to_string().contains("could not acquire lock") => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            other => return other,
        }
    }
    open()
}

fn open_sled(dir: &Path) -> sled::Db {
    retry_while_locked(|| sled::open(dir)).expect("open sled directly")
}

fn open_store(dir: &Path) -> Result<SledStorage, StorageError> {
    retry_while_locked(|| SledStorage::open(dir))
}

/// Writes a small but complete store: log, hard state, applied state and a compaction.
fn populate(dir: &Path) -> RecoveredState {
    let mut store = SledStorage::open(dir).expect("open a fresh store");
    let entries: Vec<Entry> = (1..=ENTRIES).map(entry).collect();
    for batch in entries.chunks(10) {
        store.append(batch).unwrap();
    }
    store
        .set_hard_state(HardState {
            term: 5,
            vote: 2,
            commit: 150,
        })
        .unwrap();
    for index in (10..=150).step_by(10) {
        let changes = vec![(
            format!("lock/{}", index % 40).into_bytes(),
            Some(format!("holder-{index}").into_bytes()),
        )];
        store.apply(index, &changes).unwrap();
    }
    store.compact(20).unwrap();
    store.flush().unwrap();
    let state = store.recover().unwrap();
    drop(store);
    state
}

/// Changes one stored value of `tree` through sled itself, as a bad disk would.
fn tamper(dir: &Path, tree: &str, key: &[u8], change: impl FnOnce(&mut Vec<u8>)) {
    let db = open_sled(dir);
    let tree = db.open_tree(tree).unwrap();
    let mut value = tree
        .get(key)
        .unwrap()
        .expect("value to tamper with")
        .to_vec();
    change(&mut value);
    tree.insert(key, value).unwrap();
    db.flush().unwrap();
}

/// The log tree: runs of consecutive entries, each run one value under its first index, laid
/// out as a version byte and then (record length u32 BE, entry record) per entry.
const LOG_TREE: &str = "log_runs";

fn split_run(run: &[u8]) -> Vec<Vec<u8>> {
    assert_eq!(run[0], 1, "run version");
    let (mut records, mut rest) = (Vec::new(), &run[1..]);
    while !rest.is_empty() {
        let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
        records.push(rest[4..4 + len].to_vec());
        rest = &rest[4 + len..];
    }
    records
}

fn join_run(records: &[Vec<u8>]) -> Vec<u8> {
    let mut run = vec![1u8];
    for record in records {
        run.extend_from_slice(&(record.len() as u32).to_be_bytes());
        run.extend_from_slice(record);
    }
    run
}

/// Changes the records of the run that holds log entry `index` (given with the run's first
/// index), as a bad disk would.
fn tamper_run(dir: &Path, index: Index, change: impl FnOnce(Index, &mut Vec<Vec<u8>>)) {
    with_sled(dir, |db| {
        let log = db.open_tree(LOG_TREE).unwrap();
        let (key, run) = log
            .range(..=index.to_be_bytes())
            .next_back()
            .expect("a run at or before the index")
            .unwrap();
        let first = u64::from_be_bytes(key.as_ref().try_into().unwrap());
        let mut records = split_run(&run);
        change(first, &mut records);
        log.insert(key, join_run(&records)).unwrap();
    });
}

/// Changes the stored record of log entry `index` inside its run.
fn tamper_entry(dir: &Path, index: Index, change: impl FnOnce(&mut Vec<u8>)) {
    tamper_run(dir, index, |first, records| {
        change(&mut records[(index - first) as usize])
    });
}

fn with_sled(dir: &Path, action: impl FnOnce(&sled::Db)) {
    let db = open_sled(dir);
    action(&db);
    db.flush().unwrap();
}

/// Opens and recovers, turning a panic into a test failure with its message.
fn open_and_recover(dir: &Path) -> Result<(SledStorage, RecoveredState), StorageError> {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let store = open_store(dir)?;
        let state = store.recover()?;
        Ok((store, state))
    }));
    match outcome {
        Ok(result) => result,
        Err(panic) => panic!(
            "storage panicked instead of returning an error: {:?}",
            panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
        ),
    }
}

fn expect_error(dir: &Path) -> StorageError {
    match open_and_recover(dir) {
        Ok((_, state)) => panic!(
            "damage was accepted silently: recovered {} entries, applied {}",
            state.entries.len(),
            state.applied_index
        ),
        Err(error) => error,
    }
}

#[test]
fn flipped_bit_in_a_log_entry_is_a_checksum_error_naming_the_index() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    tamper_entry(dir.path(), 77, |value| {
        let middle = value.len() / 2;
        value[middle] ^= 0x08;
    });
    let error = expect_error(dir.path());
    assert!(
        matches!(error, StorageError::ChecksumMismatch { index: 77, .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("log entry 77") && message.contains("checksum"),
        "{message}"
    );
    // Reads that touch the entry fail too; reads that do not still work.
    let store = open_store(dir.path()).unwrap();
    assert!(matches!(
        store.entries(70, 80),
        Err(StorageError::ChecksumMismatch { index: 77, .. })
    ));
    assert!(matches!(
        store.term(77),
        Err(StorageError::ChecksumMismatch { index: 77, .. })
    ));
    assert_eq!(store.entries(78, 80).unwrap(), vec![entry(78), entry(79)]);
}

#[test]
fn flipped_checksum_byte_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    tamper_entry(dir.path(), ENTRIES, |value| value[0] ^= 0x80);
    let error = expect_error(dir.path());
    assert!(
        matches!(error, StorageError::ChecksumMismatch { index: ENTRIES, .. }),
        "{error:?}"
    );
}

#[test]
fn truncated_log_entry_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    tamper_entry(dir.path(), 100, |value| value.truncate(value.len() - 3));
    let error = expect_error(dir.path());
    assert!(
        matches!(error, StorageError::ChecksumMismatch { index: 100, .. }),
        "{error:?}"
    );
    // Shorter than the checksum itself.
    tamper_entry(dir.path(), 100, |value| value.truncate(2));
    let error = expect_error(dir.path());
    assert!(
        matches!(error, StorageError::Corrupt { tree: "log", ref key, .. } if key == "100"),
        "{error:?}"
    );
    assert!(error.to_string().contains("truncated"), "{error}");
}

#[test]
fn truncated_log_run_is_an_error_naming_the_run() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    // populate appends ten entries at a time: entries 91..=100 are one run.
    tamper(dir.path(), LOG_TREE, &91u64.to_be_bytes(), |value| {
        value.truncate(value.len() - 3)
    });
    let error = expect_error(dir.path());
    assert!(
        matches!(error, StorageError::Corrupt { tree: "log", ref key, .. } if key == "run at 91"),
        "{error:?}"
    );
    assert!(error.to_string().contains("truncated"), "{error}");
    tamper(dir.path(), LOG_TREE, &91u64.to_be_bytes(), |value| {
        value[0] = 9
    });
    let error = expect_error(dir.path());
    assert!(
        error.to_string().contains("unknown log run version 9"),
        "{error}"
    );
}

#[test]
fn entry_stored_under_the_wrong_index_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    let mut moved = None;
    tamper_run(dir.path(), 41, |first, records| {
        moved = Some(records[(41 - first) as usize].clone())
    });
    tamper_entry(dir.path(), 40, |value| *value = moved.unwrap());
    let error = expect_error(dir.path());
    assert!(
        matches!(error, StorageError::Corrupt { tree: "log", ref key, ref problem } if key == "40" && problem.contains("41")),
        "{error:?}"
    );
}

#[test]
fn missing_log_entry_is_a_gap_not_a_shorter_log() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    // Entry 120 is the last of its run (populate appends ten at a time).
    tamper_run(dir.path(), 120, |first, records| {
        assert_eq!(first + records.len() as u64 - 1, 120);
        records.pop();
    });
    let error = expect_error(dir.path());
    assert!(
        matches!(
            error,
            StorageError::LogGap {
                expected_index: 120,
                found_index: 121
            }
        ),
        "{error:?}"
    );
}

#[test]
fn junk_key_in_the_log_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    with_sled(dir.path(), |db| {
        db.open_tree(LOG_TREE)
            .unwrap()
            .insert(b"\xff\xffjunk-key", b"x".to_vec())
            .unwrap();
    });
    let error = expect_error(dir.path());
    assert!(
        matches!(error, StorageError::Corrupt { tree: "log", .. }),
        "{error:?}"
    );
}

#[test]
fn damaged_meta_records_are_errors_naming_the_key() {
    for key in [
        "hard_state",
        "applied_index",
        "snapshot_point",
        "snapshot_membership",
    ] {
        let dir = tempfile::tempdir().unwrap();
        populate(dir.path());
        tamper(dir.path(), "meta", key.as_bytes(), |value| {
            let last = value.len() - 1;
            value[last] ^= 0x01;
        });
        let error = expect_error(dir.path());
        assert!(
            matches!(error, StorageError::Corrupt { tree: "meta", key: ref named, .. } if named == key),
            "{key}: {error:?}"
        );
        assert!(error.to_string().contains("checksum mismatch"), "{error}");
    }
}

#[test]
fn flipped_bit_in_applied_state_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    tamper(dir.path(), "state", b"lock/10", |value| {
        let last = value.len() - 1;
        value[last] ^= 0x02;
    });
    let error = expect_error(dir.path());
    assert!(
        matches!(error, StorageError::Corrupt { tree: "state", ref key, .. } if key.contains("lock/10")),
        "{error:?}"
    );
    let store = open_store(dir.path()).unwrap();
    assert!(matches!(
        store.build_snapshot(),
        Err(StorageError::Corrupt { tree: "state", .. })
    ));
}

/// What our API made of one file-level damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// Recovered exactly what was written.
    Intact,
    /// An error at open or at recover.
    Error,
    /// Recovered, without complaint, a consistent state that the store held earlier: sled cut its
    /// log at the damage and replayed only what came before (silent loss of later writes).
    Rollback,
    /// Recovered, without complaint, data that was never written.
    Garbled,
    /// A panic escaped from our API.
    Panic,
}

fn outcome(dir: &Path, written: &RecoveredState) -> (Outcome, String) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let store = open_store(dir)?;
        store.recover()
    }));
    match result {
        Err(_) => (Outcome::Panic, "panic".to_string()),
        Ok(Err(error)) => (Outcome::Error, error.to_string()),
        Ok(Ok(state)) if &state == written => (Outcome::Intact, String::new()),
        Ok(Ok(state)) => (
            if is_earlier_state(&state, written) {
                Outcome::Rollback
            } else {
                Outcome::Garbled
            },
            format!(
                "recovered {} entries (last {}), applied {}, {} state keys; wrote {} entries \
                 (last {}), applied {}, {} state keys",
                state.entries.len(),
                state.last_index(),
                state.applied_index,
                state.applied_state.len(),
                written.entries.len(),
                written.last_index(),
                written.applied_index,
                written.applied_state.len()
            ),
        ),
    }
}

/// Whether `state` is one the store went through while [`populate`] wrote `written`.
fn is_earlier_state(state: &RecoveredState, written: &RecoveredState) -> bool {
    let entries_written = state.entries.iter().all(|e| *e == entry(e.index));
    let state_written = state.applied_state.iter().all(|(key, value)| {
        let key = String::from_utf8_lossy(key);
        let value = String::from_utf8_lossy(value);
        match (
            key.strip_prefix("lock/")
                .and_then(|k| k.parse::<u64>().ok()),
            value
                .strip_prefix("holder-")
                .and_then(|v| v.parse::<u64>().ok()),
        ) {
            (Some(slot), Some(index)) => index % 40 == slot && index <= state.applied_index,
            _ => false,
        }
    });
    entries_written
        && state_written
        && state.last_index() <= written.last_index()
        && state.applied_index <= written.applied_index
        && [HardState::default(), written.hard_state].contains(&state.hard_state)
        && (state.snapshot_meta == written.snapshot_meta || state.snapshot_meta.index == 0)
}

fn sled_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        for item in std::fs::read_dir(&path).unwrap() {
            let item = item.unwrap().path();
            if item.is_dir() {
                stack.push(item);
            } else {
                files.push(item);
            }
        }
    }
    files.sort();
    files
}

fn copy_dir(from: &Path, to: &Path) {
    for file in sled_files(from) {
        let target = to.join(file.strip_prefix(from).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&file, &target).unwrap();
    }
}

/// Applies `damage` to a copy of a populated store for each case and tallies the outcomes.
fn sweep(
    label: &str,
    pristine: &Path,
    written: &RecoveredState,
    cases: impl IntoIterator<Item = DamageCase>,
) -> Vec<(Outcome, String, String)> {
    let mut results = Vec::new();
    for (name, damage) in cases {
        let copy = tempfile::tempdir().unwrap();
        copy_dir(pristine, copy.path());
        damage(copy.path());
        let (kind, detail) = outcome(copy.path(), written);
        results.push((kind, name, detail));
    }
    let mut counts = std::collections::BTreeMap::new();
    for (kind, _, _) in &results {
        *counts.entry(*kind).or_insert(0) += 1;
    }
    println!("{label}: {counts:?}");
    for (kind, name, detail) in &results {
        if *kind != Outcome::Intact {
            println!("  {kind:?} {name}: {detail}");
        }
    }
    results
}

#[test]
fn file_level_damage_sweep() {
    let pristine = tempfile::tempdir().unwrap();
    let written = populate(pristine.path());
    let files = sled_files(pristine.path());
    for file in &files {
        println!(
            "{} {} bytes",
            file.strip_prefix(pristine.path()).unwrap().display(),
            std::fs::metadata(file).unwrap().len()
        );
    }
    let mut all = Vec::new();
    for file in files {
        let relative = file.strip_prefix(pristine.path()).unwrap().to_path_buf();
        let len = std::fs::metadata(&file).unwrap().len();
        let mut cases: Vec<DamageCase> = Vec::new();
        for fraction in [0u64, 1, 2, 3] {
            let cut = len * fraction / 4;
            let relative = relative.clone();
            cases.push((
                format!("truncate {} to {cut}", relative.display()),
                Box::new(move |dir: &Path| {
                    let f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(dir.join(&relative))
                        .unwrap();
                    f.set_len(cut).unwrap();
                }),
            ));
        }
        let step = (len / 64).max(1);
        for offset in (0..len).step_by(step as usize) {
            let relative = relative.clone();
            cases.push((
                format!("flip byte {offset} of {}", relative.display()),
                Box::new(move |dir: &Path| {
                    let path = dir.join(&relative);
                    let mut bytes = std::fs::read(&path).unwrap();
                    bytes[offset as usize] ^= 0x5a;
                    std::fs::write(&path, bytes).unwrap();
                }),
            ));
        }
        all.extend(sweep(
            &relative.display().to_string(),
            pristine.path(),
            &written,
            cases,
        ));
    }
    let bad: Vec<_> = all
        .iter()
        .filter(|r| matches!(r.0, Outcome::Panic | Outcome::Garbled))
        .collect();
    assert!(bad.is_empty(), "panics or invented data: {bad:?}");
    // Known limitation of sled 0.34, kept visible: a checksum failure in its log file is taken
    // for a torn write at a crash, so it replays the log up to the damage and drops the rest
    // without an error. Our records are intact in what it returns, so our checks cannot see the
    // loss. If a sled upgrade starts reporting this, this count drops and the report should too.
    let rollbacks = all.iter().filter(|r| r.0 == Outcome::Rollback).count();
    println!(
        "file-level damage: {rollbacks} of {} cases rolled back silently",
        all.len()
    );
}

/// sled 0.34 writes its snapshot to `snap.<lsn>.generating`, syncs it and renames it to
/// `snap.<lsn>`. A process killed before the rename leaves the unfinished file behind, and sled's
/// own start-up takes it for the newest snapshot and reports `Corruption` (the storage crash test
/// met this as "sled detected corruption in its files at None" after a SIGKILL). The store must
/// open with everything that was flushed, and the leftover must be gone.
#[test]
fn unfinished_sled_snapshot_left_by_a_kill_is_not_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let written = populate(dir.path());
    // Names sort after every finished snapshot: with a higher LSN and with the same LSN as one.
    let finished: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with("snap.") && !name.ends_with(".generating"))
        .collect();
    let mut leftovers = vec!["snap.7FFFFFFFFFFFFFFF.generating".to_string()];
    leftovers.extend(finished.iter().map(|name| format!("{name}.generating")));
    for (i, name) in leftovers.iter().enumerate() {
        // An empty file and a cut-off one: both were being written when the process died.
        let bytes: Vec<u8> = if i % 2 == 0 {
            Vec::new()
        } else {
            vec![0x5a; 40]
        };
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    let (_store, state) = open_and_recover(dir.path())
        .unwrap_or_else(|e| panic!("an unfinished sled snapshot stopped the store opening: {e}"));
    assert_eq!(state.entries, written.entries);
    assert_eq!(state.hard_state, written.hard_state);
    assert_eq!(state.applied_index, written.applied_index);
    assert_eq!(state.applied_state, written.applied_state);
    for name in &leftovers {
        assert!(
            !dir.path().join(name).exists(),
            "{name} was left in the store directory"
        );
    }
}
