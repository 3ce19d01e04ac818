//! Tests of the sled engine's own recovery paths, beyond the shared suite: entries left behind
//! a compaction's point, installs interrupted by a crash and resumed, log runs split and
//! moved, large values moved to files, and a multi-run append cut short.

use super::*;

/// A crash after a compaction recorded its point but before the background trimmer deleted the
/// runs behind it leaves them in the log tree: they are never read back, the bounds ignore
/// them, and the next compaction deletes them. A run that holds entries on both sides of the
/// point stays whole until the point passes its last entry.
#[test]
fn sled_ignores_entries_left_behind_the_snapshot_point() {
    use crate::storage::codec::{begin_run, index_key, push_run_entry};
    let run_of = |entries: &[Entry]| {
        let mut run = begin_run(64);
        for e in entries {
            push_run_entry(&mut run, e);
        }
        run
    };
    let log_keys = |harness: &mut SledHarness| -> Vec<Vec<u8>> {
        harness
            .store()
            .log_tree()
            .iter()
            .keys()
            .map(|k| k.unwrap().to_vec())
            .collect()
    };
    let mut harness = SledHarness::default();
    let store = harness.store();
    store.append(&commands(1, 12, 1)).unwrap();
    store.append(&commands(13, 20, 1)).unwrap();
    store.apply(20, &[put("k", "v")]).unwrap();
    store.compact(12).unwrap();
    // What the trimmer deletes, put back as a crash before it ran would leave it.
    store
        .log_tree()
        .insert(index_key(1), run_of(&commands(1, 12, 1)))
        .unwrap();
    let recovered = recover_across_restart(&mut harness);
    assert_eq!(recovered.snapshot_meta.index, 12);
    assert_eq!(recovered.entries, commands(13, 20, 1));
    let store = harness.store();
    assert_eq!((store.first_index(), store.last_index()), (13, 20));
    assert!(matches!(
        store.entries(5, 6),
        Err(StorageError::Compacted { index: 5, .. })
    ));
    assert_eq!(store.entries(13, 15).unwrap(), commands(13, 14, 1));
    assert_eq!(store.term(12).unwrap(), 1);

    // Only leftovers in the tree: the log is empty and continues after the point.
    store.compact(20).unwrap();
    store
        .log_tree()
        .insert(index_key(13), run_of(&commands(13, 20, 1)))
        .unwrap();
    let recovered = recover_across_restart(&mut harness);
    assert!(recovered.entries.is_empty());
    assert_eq!(harness.store().last_index(), 20);
    harness.store().append(&commands(21, 22, 2)).unwrap();
    assert_eq!(harness.store().last_index(), 22);

    // The next compaction deletes every run behind its point, leftovers included; the run
    // that holds the point and the entry after it stays.
    harness.store().apply(22, &[]).unwrap();
    harness.store().compact(21).unwrap();
    harness.store().flush().unwrap();
    harness.restart();
    assert_eq!(log_keys(&mut harness), vec![index_key(21).to_vec()]);
    assert_eq!(
        harness.store().entries(22, 23).unwrap(),
        commands(22, 22, 2)
    );
    harness.store().apply(22, &[]).unwrap();
    harness.store().compact(22).unwrap();
    harness.store().flush().unwrap();
    harness.restart();
    assert!(log_keys(&mut harness).is_empty());
    assert_eq!(harness.store().last_index(), 22);
}

/// A crash inside a snapshot install (after its mark, with the old state cleared and part of the
/// new one written) is finished by the next open from the staged data: the store then holds
/// exactly the snapshot, its point and applied index, and no log after it.
/// A crash while a snapshot's state is written a slice at a time, with entries appended after
/// its point meanwhile: the next open finishes the install and keeps those entries.
#[test]
fn sled_finishes_a_sliced_install_after_a_crash_and_keeps_the_entries_appended_meanwhile() {
    for slices in [0, 1, 3] {
        let mut harness = SledHarness::default();
        let store = harness.store();
        store.append(&commands(1, 30, 1)).unwrap();
        store
            .apply(30, &[put("old/a", "1"), put("old/b", "2")])
            .unwrap();
        store.flush().unwrap();
        let (pairs, meta) = forty_pair_snapshot();
        store.begin_install(&meta, &snapshot_data(&pairs)).unwrap();
        store.append(&commands(51, 55, 3)).unwrap();
        for _ in 0..slices {
            assert!(!store.continue_install(9).unwrap());
        }
        assert!(matches!(
            store.apply(51, &[]),
            Err(StorageError::InstallInProgress { index: 50, .. })
        ));
        assert!(matches!(
            store.snapshot_job(),
            Err(StorageError::InstallInProgress { index: 50, .. })
        ));
        let recovered = crash_and_check_resumed_install(&mut harness, &meta, &pairs, slices);
        assert_eq!(recovered.entries, commands(51, 55, 3));
        let again = recover_across_restart(&mut harness);
        assert_eq!(again, recovered);
    }
}

/// Flushes, restarts (a crash for the install under way) and checks that the open finished the
/// install of the snapshot at index 50 (`meta`, holding `pairs`). Returns what it recovered.
fn crash_and_check_resumed_install(
    harness: &mut SledHarness,
    meta: &SnapshotMeta,
    pairs: &[KvPair],
    slices: usize,
) -> RecoveredState {
    harness.store().flush().unwrap();
    harness.restart();
    assert_eq!(
        harness.store().resumed_install(),
        Some(50),
        "slices {slices}"
    );
    let recovered = harness.store().recover().unwrap();
    assert_eq!(recovered.snapshot_meta, *meta, "slices {slices}");
    assert_eq!(recovered.applied_index, 50);
    assert_eq!(recovered.applied_state, pairs);
    recovered
}

/// A sled store with 30 entries and an old state, flushed, into which the transfer of
/// [`forty_pair_snapshot`] was then staged in `chunk`-byte chunks. Returns the snapshot's pairs,
/// meta and data.
fn sled_with_a_staged_transfer(
    harness: &mut SledHarness,
    chunk: usize,
) -> (Vec<KvPair>, SnapshotMeta, Bytes) {
    let store = harness.store();
    store.append(&commands(1, 30, 1)).unwrap();
    store.apply(30, &[put("old/a", "1")]).unwrap();
    store.flush().unwrap();
    let (pairs, meta) = forty_pair_snapshot();
    let data = snapshot_data(&pairs);
    stage_in_chunks(store, &meta, &data, chunk);
    (pairs, meta, data)
}

/// A crash after an install of chunks staged as they arrived has begun: the next open finishes
/// it from those chunks (which `begin_install_staged` did not write again).
#[test]
fn sled_finishes_an_install_of_chunks_staged_as_they_arrived_after_a_crash() {
    for slices in [0, 2] {
        let mut harness = SledHarness::default();
        let (pairs, meta, data) = sled_with_a_staged_transfer(&mut harness, 100);
        let store = harness.store();
        store.begin_install_staged(&meta, &data).unwrap();
        for _ in 0..slices {
            assert!(!store.continue_install(9).unwrap());
        }
        let recovered = crash_and_check_resumed_install(&mut harness, &meta, &pairs, slices);
        assert!(recovered.entries.is_empty());
    }
}

/// A finished install's staged chunks go a few per call once the state is in place, not all
/// in the call that moves the applied index; an open after a crash in between removes the rest.
#[test]
fn sled_removes_a_finished_installs_staged_chunks_a_few_at_a_time() {
    for crash in [false, true] {
        let mut harness = SledHarness::default();
        let (pairs, meta, data) = sled_with_a_staged_transfer(&mut harness, 16);
        let store = harness.store();
        let chunks = store.staged_chunk_count();
        assert!(chunks >= 10, "{chunks} chunks");
        store.begin_install_staged(&meta, &data).unwrap();
        // 64 keys a call: the 40 pairs and the applied index in the first, then two chunks a
        // call.
        assert!(!store.continue_install(64).unwrap());
        assert_eq!(store.applied_index(), 50);
        assert_eq!(store.staged_chunk_count(), chunks - 2);
        if crash {
            store.flush().unwrap();
            harness.restart();
            assert_eq!(harness.store().resumed_install(), None, "nothing to redo");
        } else {
            let mut calls = 1;
            while !store.continue_install(64).unwrap() {
                calls += 1;
                assert!(calls < 100, "the chunks are never all removed");
            }
            assert_eq!(calls, chunks.div_ceil(2), "{chunks} chunks");
            store.flush().unwrap();
        }
        assert_eq!(harness.store().staged_chunk_count(), 0, "crash {crash}");
        let recovered = recover_across_restart(&mut harness);
        assert_eq!(recovered.snapshot_meta, meta);
        assert_eq!(recovered.applied_index, 50);
        assert_eq!(recovered.applied_state, pairs);
        assert_eq!(harness.store().staged_chunk_count(), 0);
    }
}

#[test]
fn sled_finishes_a_snapshot_install_interrupted_by_a_crash() {
    for (keys_written, older) in [0, 7, 40].into_iter().flat_map(|k| [(k, false), (k, true)]) {
        let mut harness = SledHarness::default();
        let store = harness.store();
        store.append(&commands(1, 30, 1)).unwrap();
        store
            .apply(
                30,
                &[put("old/a", "1"), put("old/b", "2"), put("k3", "old")],
            )
            .unwrap();
        store.flush().unwrap();
        let (pairs, meta) = forty_pair_snapshot();
        let data = snapshot_data(&pairs);
        if older {
            store
                .interrupt_install_of_an_older_release(&meta, &data, keys_written)
                .unwrap();
        } else {
            store.interrupt_install(&meta, &data, keys_written).unwrap();
        }
        store.flush().unwrap();
        harness.restart();
        let recovered = harness.store().recover().unwrap();
        assert_eq!(recovered.snapshot_meta, meta, "keys_written {keys_written}");
        assert_eq!(recovered.applied_index, 50);
        assert_eq!(recovered.applied_state, pairs);
        assert!(recovered.entries.is_empty());
        assert_eq!(harness.store().last_index(), 50);
        // Finished for good: the next open finds nothing to redo and the same store.
        let again = recover_across_restart(&mut harness);
        assert_eq!(again, recovered);
        harness.store().append(&commands(51, 52, 3)).unwrap();
        assert_eq!(harness.store().last_index(), 52);
    }
}

/// Large appends are split into runs of about `RUN_MAX_BYTES`; a conflicting suffix that
/// begins inside a run cuts that run and drops every run after it, across restarts.
#[test]
fn sled_log_runs_split_and_truncate_inside_a_run() {
    let big = |index: Index, term: Term| Entry {
        term,
        index,
        payload: EntryPayload::Command(Bytes::from(vec![b'x'; 300])),
    };
    let mut harness = SledHarness::default();
    let written: Vec<Entry> = (1..=100).map(|i| big(i, 1)).collect();
    harness.store().append(&written).unwrap();
    let runs = harness.store().log_tree().len();
    assert!(
        runs >= 5,
        "300-byte entries in runs of about 4 KiB: {runs} runs"
    );
    let recovered = recover_across_restart(&mut harness);
    assert_eq!(recovered.entries, written);

    // Every cut point: inside the first run, on a run boundary, inside a later run.
    let firsts: Vec<Index> = harness
        .store()
        .log_tree()
        .iter()
        .keys()
        .map(|k| u64::from_be_bytes(k.unwrap().as_ref().try_into().unwrap()))
        .collect();
    for cut in [2, firsts[1], firsts[2] + 1, 100] {
        let mut harness = SledHarness::default();
        harness.store().append(&written).unwrap();
        let replacement: Vec<Entry> = (cut..cut + 3).map(|i| command(i, 2)).collect();
        harness.store().append(&replacement).unwrap();
        let mut expected = written[..(cut - 1) as usize].to_vec();
        expected.extend(replacement.iter().cloned());
        assert_eq!(harness.store().last_index(), cut + 2, "cut at {cut}");
        assert_eq!(harness.store().term(cut - 1).unwrap(), 1);
        assert_eq!(harness.store().term(cut).unwrap(), 2);
        let recovered = recover_across_restart(&mut harness);
        assert_eq!(recovered.entries, expected, "cut at {cut}");
        assert_eq!(
            harness.store().entries(cut - 1, cut + 1).unwrap(),
            expected[(cut - 2) as usize..cut as usize].to_vec()
        );
    }
}

/// A store written before log runs (tree `log`, one entry per value) opens with its log moved
/// into runs and the old tree gone; entries left behind its snapshot point stay ignored.
#[test]
fn sled_moves_a_log_of_single_entries_into_runs() {
    use crate::storage::codec::{
        encode_entry, encode_index_term, encode_membership, encode_u64, index_key,
    };
    let dir = tempfile::tempdir().unwrap();
    {
        let db = ::sled::Config::new().path(dir.path()).open().unwrap();
        let old = db.open_tree("log").unwrap();
        for entry in commands(3, 60, 2) {
            old.insert(index_key(entry.index), encode_entry(&entry))
                .unwrap();
        }
        let meta = db.open_tree("meta").unwrap();
        meta.insert("snapshot_point", encode_index_term(4, 2))
            .unwrap();
        meta.insert("applied_index", encode_u64(4)).unwrap();
        meta.insert(
            "snapshot_membership",
            encode_membership(&Membership::default()),
        )
        .unwrap();
        db.flush().unwrap();
    }
    let store = reopen_sled(dir.path());
    let recovered = store.recover().unwrap();
    assert_eq!(recovered.entries, commands(5, 60, 2));
    assert_eq!((store.first_index(), store.last_index()), (5, 60));
    assert_eq!(store.term(4).unwrap(), 2);
    assert!(
        store.log_tree().len() < 10,
        "{} runs",
        store.log_tree().len()
    );
    drop(store);
    let mut store = reopen_sled(dir.path());
    assert_eq!(store.recover().unwrap().entries, commands(5, 60, 2));
    store.append(&commands(61, 62, 3)).unwrap();
    store.flush().unwrap();
    drop(store);
    let store = reopen_sled(dir.path());
    assert_eq!(store.recover().unwrap().entries.len(), 58);
    // The old tree keeps one key, which an earlier lock-node cannot read as a log index: it
    // refuses the store instead of taking it for an empty log.
    let old_keys: Vec<Vec<u8>> = store
        .old_log_tree()
        .iter()
        .keys()
        .map(|k| k.unwrap().to_vec())
        .collect();
    assert_eq!(old_keys.len(), 1);
    assert_ne!(old_keys[0].len(), 8);
    assert!(String::from_utf8_lossy(&old_keys[0]).contains("log_runs"));
    drop(store);

    // A store made by this version carries the same key from its first open.
    let fresh = SledHarness::default();
    assert_eq!(fresh.store.as_ref().unwrap().old_log_tree().len(), 1);
}

/// A state value too large for sled's log goes to a file of its own under `blobs/`; the flush
/// that makes it durable syncs that file, once, and small values leave the directory alone. The
/// value reads back after a reopen, and a reopen syncs the blob files it finds.
#[test]
fn sled_syncs_the_files_it_moves_large_values_into() {
    let dir = tempfile::tempdir().unwrap();
    let blob_files = || {
        std::fs::read_dir(dir.path().join("blobs"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let mut store = reopen_sled(dir.path());
    assert_eq!(blob_files(), 0);
    store.append(&commands(1, 3, 1)).unwrap();
    store
        .apply(1, &[(b"lock/small".to_vec(), Some(vec![1u8; 100]))])
        .unwrap();
    store.flush().unwrap();
    assert_eq!((blob_files(), store.synced_blob_files()), (0, 0));

    let big = vec![7u8; 300 * 1024];
    store
        .apply(2, &[(b"lock/big".to_vec(), Some(big.clone()))])
        .unwrap();
    let written = blob_files();
    assert!(written >= 1, "a 300 KiB value should go to a blob file");
    assert_eq!(
        store.synced_blob_files(),
        0,
        "nothing synced before the flush"
    );
    store.flush().unwrap();
    assert_eq!(store.synced_blob_files(), written as u64);
    // Files already synced are not synced again.
    store
        .apply(3, &[(b"lock/small".to_vec(), Some(vec![2u8; 100]))])
        .unwrap();
    store.flush().unwrap();
    assert_eq!(store.synced_blob_files(), written as u64);
    drop(store);

    let store = reopen_sled(dir.path());
    assert_eq!(store.applied_index(), 3);
    let state = store.recover().unwrap().applied_state;
    assert!(state.contains(&(b"lock/big".to_vec(), big)));
    assert!(
        store.synced_blob_files() >= 1,
        "a reopen syncs the blob files it finds"
    );
}

/// An append after the last entry that spans several runs is one insert per run, not one
/// batch: a crash may keep any prefix of them. A log holding only the first runs of such an
/// append recovers as the log with a prefix of its entries, and takes the rest again.
#[test]
fn sled_recovers_a_prefix_of_a_multi_run_append() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = reopen_sled(dir.path());
    store.append(&commands(1, 3, 1)).unwrap();
    store.flush().unwrap();
    let runs_before = store.log_tree().len();
    let big = commands(4, 600, 1);
    store.append(&big).unwrap();
    store.flush().unwrap();
    let runs = store.log_tree().len() - runs_before;
    assert!(
        runs >= 3,
        "600 entries should take several runs, took {runs}"
    );
    let last_run = store.log_tree().last().unwrap().unwrap().0;
    let last_run_start = crate::storage::codec::decode_index_key(&last_run).unwrap();
    drop(store);
    {
        // What a crash after all but the last run reached sled's log leaves.
        let db = ::sled::Config::new().path(dir.path()).open().unwrap();
        db.open_tree("log_runs").unwrap().remove(&last_run).unwrap();
        db.flush().unwrap();
    }
    let mut store = reopen_sled(dir.path());
    let recovered = store.recover().unwrap();
    assert_eq!(recovered.entries, commands(1, last_run_start - 1, 1));
    assert_eq!(store.last_index(), last_run_start - 1);
    store.append(&commands(last_run_start, 600, 1)).unwrap();
    store.flush().unwrap();
    drop(store);
    let store = reopen_sled(dir.path());
    assert_eq!(store.recover().unwrap().entries, commands(1, 600, 1));
}
