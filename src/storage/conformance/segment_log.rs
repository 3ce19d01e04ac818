//! Tests of the log in segment files (`LogEngine::Segments`) beyond the shared suite: torn
//! tails, garbage after the synced mark, flipped bytes and cut-off records in synced data,
//! segments of an older release, compaction and a lost reset, the engine a store was written
//! with, and random damage.

use super::*;

/// The segment files of a store's log, oldest first.
fn segment_files(store_dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(store_dir.join("log"))
        .expect("list the log's segments")
        .map(|e| e.expect("segment entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    files.sort();
    files
}

/// Where a segment file's records begin: after the header of its format.
fn segment_header(bytes: &[u8]) -> usize {
    if bytes.starts_with(b"RLSEG001") {
        crate::storage::segment_log::SEGMENT_HEADER_V1 as usize
    } else {
        crate::storage::segment_log::SEGMENT_HEADER as usize
    }
}

/// Offsets and total lengths (frame included) of the records in a segment file.
fn segment_records(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut records = Vec::new();
    let mut at = segment_header(bytes);
    while at + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if len == 0 {
            break;
        }
        records.push((at, 8 + len));
        at += 8 + len;
    }
    records
}

/// Appends entries 1..=`last` of term 1, each its own append and flush (a record each).
fn append_one_at_a_time(store: &mut SledStorage, last: Index) {
    for i in 1..=last {
        store.append(&commands(i, i, 1)).unwrap();
        store.flush().unwrap();
    }
}

fn flip_byte(path: &std::path::Path, offset: usize) {
    let mut bytes = std::fs::read(path).expect("read a segment");
    bytes[offset] ^= 0x5a;
    std::fs::write(path, bytes).expect("write a segment");
}

/// Whether `err` is the error of a log damaged below its synced mark, and says how to rebuild
/// the node.
fn is_damage_below_synced(err: &StorageError) -> bool {
    matches!(err, StorageError::LogDamagedBelowSynced { .. })
        && err.to_string().contains("empty data directory with --join")
}

/// A crash can leave the newest segment with a record cut off and a whole one behind it (the
/// kernel wrote their pages out of order). Neither was synced: both are above the synced mark.
/// Opening keeps what precedes the damaged record, clears the rest so that the whole record
/// behind it can never line up behind a later append, and the log goes on from there.
#[test]
fn segments_clear_a_torn_tail_above_the_synced_mark_and_never_replay_what_followed_it() {
    let mut harness = SegmentsHarness::default();
    let store = harness.store();
    store.append(&commands(1, 3, 1)).unwrap();
    store.flush().unwrap();
    store.append(&commands(4, 5, 1)).unwrap();
    store.flush().unwrap();
    store.append(&commands(6, 7, 1)).unwrap();
    // This flush writes the mark of the one before: records 1 and 2 are below it.
    store.flush().unwrap();
    // Written, never synced (a crash before the flush).
    store.append(&commands(8, 8, 1)).unwrap();
    store.append(&commands(9, 9, 1)).unwrap();
    harness.0.close();
    let files = segment_files(harness.0.dir());
    assert_eq!(files.len(), 1, "the five appends fit one segment");
    let records = segment_records(&std::fs::read(&files[0]).unwrap());
    assert_eq!(records.len(), 5);
    let (torn_at, torn_len) = records[3];
    flip_byte(&files[0], torn_at + torn_len / 2);

    harness.0.try_open().expect("a torn tail is not an error");
    assert_eq!(
        harness.store().recover().unwrap().entries,
        commands(1, 7, 1)
    );
    let bytes = std::fs::read(&files[0]).unwrap();
    assert!(
        bytes[torn_at..].iter().all(|b| *b == 0),
        "everything after the last whole record is cleared"
    );
    // The next append lands where the torn record was; the old record behind it is gone.
    harness.store().append(&commands(8, 8, 2)).unwrap();
    let recovered = recover_across_restart(&mut harness);
    let mut expected = commands(1, 7, 1);
    expected.extend(commands(8, 8, 2));
    assert_eq!(recovered.entries, expected);
}

/// Garbage after the last whole record (a frame whose bytes never all reached the disk, then
/// stale bytes), above the synced mark, is a torn tail: dropped, and the log goes on.
#[test]
fn segments_drop_garbage_after_the_last_synced_record() {
    let mut harness = SegmentsHarness::default();
    let store = harness.store();
    store.append(&commands(1, 2, 1)).unwrap();
    store.flush().unwrap();
    store.append(&commands(3, 4, 1)).unwrap();
    store.flush().unwrap();
    harness.0.close();
    let file = &segment_files(harness.0.dir())[0];
    let mut bytes = std::fs::read(file).unwrap();
    let (at, len) = *segment_records(&bytes).last().unwrap();
    let end = at + len;
    // A frame that promises 200 bytes, a checksum that covers none of what follows.
    bytes[end..end + 4].copy_from_slice(&200u32.to_be_bytes());
    bytes[end + 4..end + 8].copy_from_slice(&0xdead_beefu32.to_be_bytes());
    for (i, b) in bytes[end + 8..end + 60].iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37) | 1;
    }
    std::fs::write(file, &bytes).unwrap();

    harness
        .0
        .try_open()
        .expect("garbage above the mark is a torn tail");
    assert_eq!(
        harness.store().recover().unwrap().entries,
        commands(1, 4, 1)
    );
    assert!(std::fs::read(file).unwrap()[end..].iter().all(|b| *b == 0));
    harness.store().append(&commands(5, 5, 1)).unwrap();
    let recovered = recover_across_restart(&mut harness);
    assert_eq!(recovered.entries, commands(1, 5, 1));
}

/// A byte flipped in a record that a completed sync made durable is damage, not a torn tail:
/// the entries in it (and after it) were acknowledged. Opening fails with an error that says
/// how to rebuild the node, and leaves the file as it found it, on every later try too.
#[test]
fn segments_report_a_flipped_byte_in_a_synced_record_as_damage() {
    let mut harness = SegmentsHarness::default();
    let store = harness.store();
    store.append(&commands(1, 3, 1)).unwrap();
    store.flush().unwrap();
    store.append(&commands(4, 5, 1)).unwrap();
    store.flush().unwrap();
    store.append(&commands(6, 6, 1)).unwrap();
    store.flush().unwrap();
    store.append(&commands(7, 7, 1)).unwrap();
    store.flush().unwrap();
    harness.0.close();
    let files = segment_files(harness.0.dir());
    assert_eq!(files.len(), 1);
    let records = segment_records(&std::fs::read(&files[0]).unwrap());
    assert_eq!(records.len(), 4);
    // The second record was synced by the second flush; the fourth flush wrote a mark past the
    // third.
    let (at, len) = records[1];
    flip_byte(&files[0], at + len / 2);
    let damaged = std::fs::read(&files[0]).unwrap();
    for attempt in 0..2 {
        let err = harness
            .0
            .try_open()
            .expect_err("a damaged synced record is an error");
        assert!(is_damage_below_synced(&err), "attempt {attempt}: {err}");
        match &err {
            StorageError::LogDamagedBelowSynced {
                offset, synced_to, ..
            } => {
                assert_eq!(*offset, at as u64, "{err}");
                assert!(*synced_to >= (records[2].0 + records[2].1) as u64, "{err}");
            }
            other => panic!("{other}"),
        }
        assert_eq!(
            std::fs::read(&files[0]).unwrap(),
            damaged,
            "a refused open changes nothing"
        );
    }
}

/// A synced record gone altogether (the file cut short below the synced mark) is damage too.
#[test]
fn segments_report_synced_records_cut_off_as_damage() {
    let mut harness = SegmentsHarness::default();
    let store = harness.store();
    for i in 1..=4 {
        store.append(&commands(i, i, 1)).unwrap();
        store.flush().unwrap();
    }
    harness.0.close();
    let file = &segment_files(harness.0.dir())[0];
    let bytes = std::fs::read(file).unwrap();
    let records = segment_records(&bytes);
    std::fs::write(file, &bytes[..records[1].0 + 3]).unwrap();
    let err = harness.0.try_open().expect_err("synced records cut off");
    assert!(is_damage_below_synced(&err), "{err}");
}

/// A store written before the synced mark (segments `RLSEG001`, records after a 16-byte header)
/// is read as before: any bad record in its newest segment is taken for a torn tail. Opening
/// then seals that segment, and the log goes on in a new one that has the mark.
#[test]
fn segments_of_an_older_release_are_read_without_a_mark_and_sealed() {
    let mut harness = SegmentsHarness::default();
    let store = harness.store();
    store.append(&commands(1, 2, 1)).unwrap();
    store.flush().unwrap();
    store.append(&commands(3, 4, 1)).unwrap();
    store.flush().unwrap();
    store.append(&commands(5, 5, 1)).unwrap();
    store.flush().unwrap();
    harness.0.close();
    let files = segment_files(harness.0.dir());
    assert_eq!(files.len(), 1);
    // The same records in the older format.
    let bytes = std::fs::read(&files[0]).unwrap();
    let header = crate::storage::segment_log::SEGMENT_HEADER as usize;
    let mut old = b"RLSEG001".to_vec();
    old.extend_from_slice(&bytes[8..16]);
    old.extend_from_slice(&bytes[header..]);
    let records = segment_records(&old);
    assert_eq!(records.len(), 3);
    let (at, len) = records[1];
    std::fs::write(&files[0], &old).unwrap();
    // Undamaged, it reads whole.
    harness.0.try_open().expect("an older store opens");
    assert_eq!(
        harness.store().recover().unwrap().entries,
        commands(1, 5, 1)
    );
    harness.0.close();
    let sealed = segment_files(harness.0.dir());
    assert_eq!(
        sealed.len(),
        2,
        "the old segment is sealed and a new one begun"
    );
    assert!(std::fs::read(&sealed[1]).unwrap().starts_with(b"RLSEG002"));

    // Damaged while it was the newest: as before, a torn tail.
    std::fs::remove_file(&sealed[1]).unwrap();
    let mut torn = old.clone();
    torn[at + len / 2] ^= 0x5a;
    std::fs::write(&files[0], &torn).unwrap();
    harness.0.try_open().expect("no mark: a possible torn tail");
    assert_eq!(
        harness.store().recover().unwrap().entries,
        commands(1, 2, 1)
    );
    harness.store().append(&commands(3, 3, 2)).unwrap();
    let recovered = recover_across_restart(&mut harness);
    let mut expected = commands(1, 2, 1);
    expected.extend(commands(3, 3, 2));
    assert_eq!(recovered.entries, expected);
    assert_eq!(harness.store().log_segments(), Some(2));
}

/// Only the newest segment may end in a torn write: older ones were synced before the next was
/// started, so damage there is corruption, reported, never skipped.
#[test]
fn segments_report_damage_in_an_older_segment() {
    let mut harness = SegmentsHarness::default();
    append_one_at_a_time(harness.store(), 40);
    let segments = harness.store().log_segments().unwrap();
    assert!(
        segments >= 2,
        "40 appends span several segments, got {segments}"
    );
    harness.0.close();
    let oldest = &segment_files(harness.0.dir())[0];
    let (at, len) = segment_records(&std::fs::read(oldest).unwrap())[0];
    flip_byte(oldest, at + len / 2);
    let err = harness
        .0
        .try_open()
        .expect_err("damage in an older segment");
    assert!(is_damage_below_synced(&err), "{err}");
}

/// Segments wholly at or below a snapshot point are deleted once the point is durable; the log
/// after the point survives them, across a restart.
#[test]
fn segments_behind_a_durable_compaction_are_deleted() {
    let mut harness = SegmentsHarness::default();
    append_one_at_a_time(harness.store(), 60);
    let before = harness.store().log_segments().unwrap();
    assert!(before >= 3, "{before} segments");
    let store = harness.store();
    store.apply(50, &[put("k", "v")]).unwrap();
    store.compact(50).unwrap();
    store.flush().unwrap();
    let after = store.log_segments().unwrap();
    assert!(after < before, "{before} segments before, {after} after");
    assert_eq!(segment_files(harness.0.dir()).len(), after);
    let recovered = recover_across_restart(&mut harness);
    assert_eq!(recovered.snapshot_meta.index, 50);
    assert_eq!(recovered.entries, commands(51, 60, 1));
    assert_eq!(harness.store().term(50).unwrap(), 1);
}

/// An install that replaces the log is durable in sled before the log's reset is written: a
/// crash in between leaves the new snapshot point beside the old log. Opening drops the old
/// entries after the point (the entry at the point has another term, so they are not the
/// snapshot's), and records that, so appends after the point replay after a restart.
#[test]
fn segments_drop_a_replaced_log_whose_reset_was_lost() {
    let mut harness = SegmentsHarness::default();
    let store = harness.store();
    store.append(&commands(1, 10, 1)).unwrap();
    store.flush().unwrap();
    harness.0.close();
    let log_dir = harness.0.dir().join("log");
    let saved: Vec<(std::path::PathBuf, Vec<u8>)> = segment_files(harness.0.dir())
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    harness.0.try_open().unwrap();
    let meta = SnapshotMeta {
        index: 8,
        term: 2,
        membership: Membership::with_voters([1, 2, 3]),
    };
    harness
        .store()
        .install_snapshot(&meta, &snapshot_data(&[pair("lock/a", "1")]))
        .unwrap();
    harness.store().flush().unwrap();
    harness.0.close();
    // The log as it was before the install: its reset never reached the disk.
    for file in segment_files(harness.0.dir()) {
        std::fs::remove_file(file).unwrap();
    }
    for (path, bytes) in &saved {
        std::fs::write(path, bytes).unwrap();
    }
    assert!(log_dir.is_dir());

    harness.0.try_open().unwrap();
    let recovered = harness.store().recover().unwrap();
    assert_eq!(recovered.snapshot_meta, meta);
    assert!(recovered.entries.is_empty(), "{:?}", recovered.entries);
    assert_eq!(harness.store().last_index(), 8);
    harness.store().append(&commands(9, 10, 2)).unwrap();
    let recovered = recover_across_restart(&mut harness);
    assert_eq!(recovered.entries, commands(9, 10, 2));
}

/// A store keeps the log engine it was written with; the other is refused with a clear error,
/// except by a store whose sled log holds nothing.
#[test]
fn a_store_is_opened_only_with_its_own_log_engine() {
    let segments = SledOptions {
        log_engine: crate::storage::LogEngine::Segments,
        ..SledOptions::default()
    };
    // A new sled store whose log is empty may move its log to segments.
    let mut harness = SledHarness::default();
    let hard_state = HardState {
        term: 1,
        vote: 1,
        commit: 0,
    };
    harness.store().set_hard_state(hard_state).unwrap();
    harness.store().flush().unwrap();
    harness.close();
    let mut store = reopen_sled_with(harness.dir(), segments).expect("an empty log may move");
    assert_eq!(store.recover().unwrap().hard_state, hard_state);
    store.append(&commands(1, 2, 1)).unwrap();
    store.flush().unwrap();
    drop(store);
    match reopen_sled_with(harness.dir(), SledOptions::default()) {
        Err(
            err @ StorageError::LogEngineMismatch {
                found: "segments", ..
            },
        ) => {
            assert!(
                err.to_string().contains("--raft-log-engine segments"),
                "{err}"
            );
        }
        other => panic!("expected a log engine mismatch, got {other:?}"),
    }

    // A sled store with entries stays on sled.
    let mut harness = SledHarness::default();
    harness.store().append(&commands(1, 2, 1)).unwrap();
    harness.store().flush().unwrap();
    harness.close();
    match reopen_sled_with(harness.dir(), segments) {
        Err(StorageError::LogEngineMismatch {
            found: "sled",
            asked: "segments",
        }) => {}
        other => panic!("expected a log engine mismatch, got {other:?}"),
    }
    let mut store = reopen_sled_with(harness.dir(), SledOptions::default()).unwrap();
    assert_eq!(store.recover().unwrap().entries, commands(1, 2, 1));
    store.flush().unwrap();
}

/// Whatever one damaged byte or a cut does to a segment file, opening never panics: damage in
/// the newest segment leaves a prefix of the log that was written, damage anywhere else is an
/// error (or, past an older segment's last record, bytes that are never read).
#[test]
fn segments_survive_random_damage_without_panic() {
    let (mut opened, mut refused, mut older_damaged) = (0, 0, 0);
    for seed in 0..40u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut harness = SegmentsHarness::default();
        let mut written = Vec::new();
        let mut next = 1;
        for _ in 0..rng.random_range(1..40) {
            let count = rng.random_range(1..4);
            let entries = commands(next, next + count - 1, 1);
            harness.store().append(&entries).unwrap();
            harness.store().flush().unwrap();
            written.extend(entries);
            next += count;
        }
        harness.0.close();
        let files = segment_files(harness.0.dir());
        let victim = rng.random_range(0..files.len());
        let newest = victim + 1 == files.len();
        if !newest {
            older_damaged += 1;
        }
        let mut bytes = std::fs::read(&files[victim]).unwrap();
        let records_end = segment_records(&bytes)
            .last()
            .map_or(segment_header(&bytes), |(at, len)| at + len);
        let cut = rng.random_bool(0.3);
        if cut {
            bytes.truncate(rng.random_range(0..=records_end));
        } else {
            let at = rng.random_range(0..(records_end + 16).min(bytes.len()));
            bytes[at] ^= 1 << rng.random_range(0..8);
        }
        std::fs::write(&files[victim], &bytes).unwrap();
        match harness.0.try_open() {
            Ok(()) => {
                opened += 1;
                let recovered = harness.store().recover().unwrap();
                assert!(
                    written.starts_with(&recovered.entries),
                    "seed {seed}: recovered entries are not a prefix of those written"
                );
                if !newest {
                    // Only bytes past the older segment's last record, which are never read,
                    // or a cut at its very end, leave it readable.
                    assert!(
                        recovered.entries == written,
                        "seed {seed}: damage in an older segment lost entries silently"
                    );
                }
            }
            Err(err) => {
                refused += 1;
                assert!(
                    matches!(
                        err,
                        StorageError::Corrupt { .. }
                            | StorageError::LogGap { .. }
                            | StorageError::LogDamagedBelowSynced { .. }
                    ),
                    "seed {seed}: unexpected error {err}"
                );
            }
        }
    }
    // The seeds reach every branch: opened, refused, and damage in an older segment.
    assert!(
        opened > 0 && refused > 0 && older_damaged > 0,
        "opened {opened}, refused {refused}, older segments damaged {older_damaged}"
    );
}
