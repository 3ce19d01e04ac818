//! The storage conformance suite: one set of checks that every [`Storage`] implementation must
//! pass, run against [`MemStorage`] and against [`SledStorage`] on a temporary directory.
//!
//! ```text
//!   check_*(harness) ──► harness.store()   (the implementation under test)
//!                    └─► harness.restart() (Mem: crash(), losing unflushed writes;
//!                                           sled: drop the handle and reopen the directory)
//! ```
//!
//! Each check writes through the trait only, reads back through the trait only, and restarts
//! after a flush to prove that `recover` returns exactly what was flushed. A seeded differential
//! test then drives both implementations with the same random operations and demands identical
//! answers. Crash-at-any-moment tests with real processes live in `tests/storage_crash.rs`.

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{
    decode_snapshot_data, encode_snapshot_data, KvChange, KvPair, MemStorage, PairsConvert,
    RecoveredState, SledOptions, SledStorage, Storage, StorageError,
};
use crate::raft::{
    Entry, EntryPayload, HardState, Index, Membership, MembershipChange, SnapshotMeta, Term,
};

/// A store under test plus the way to restart it.
pub(crate) trait Harness {
    type Store: Storage;
    fn store(&mut self) -> &mut Self::Store;
    /// Ends the current incarnation and starts a new one on the same durable data.
    fn restart(&mut self);
}

/// [`MemStorage`]; a restart is a crash.
#[derive(Default)]
pub(crate) struct MemHarness {
    store: MemStorage,
}

impl Harness for MemHarness {
    type Store = MemStorage;
    fn store(&mut self) -> &mut MemStorage {
        &mut self.store
    }
    fn restart(&mut self) {
        self.store.crash();
    }
}

/// [`SledStorage`] in a temporary directory; a restart drops the handle and reopens.
pub(crate) struct SledHarness {
    // Declared first so it is dropped before the directory is removed.
    store: Option<SledStorage>,
    dir: tempfile::TempDir,
    options: SledOptions,
    /// Every incarnation flushes on a thread of its own ([`SledStorage::flush_in_background`]).
    background: bool,
}

impl SledHarness {
    pub(crate) fn with(options: SledOptions) -> Self {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let store = SledStorage::open_with(dir.path(), options).expect("open a fresh sled store");
        SledHarness {
            store: Some(store),
            dir,
            options,
            background: false,
        }
    }

    /// Like [`SledHarness::with`], flushing in the background.
    pub(crate) fn in_background(options: SledOptions) -> Self {
        let mut harness = SledHarness::with(options);
        harness.background = true;
        harness.start_flusher();
        harness
    }

    fn start_flusher(&mut self) {
        if let (true, Some(store)) = (self.background, self.store.as_mut()) {
            store
                .flush_in_background(Box::new(|| {}), Box::new(|_| {}))
                .expect("start the flush thread");
        }
    }

    /// The store's directory.
    pub(crate) fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Drops the store without reopening it (a test then changes its files).
    pub(crate) fn close(&mut self) {
        drop(self.store.take());
    }

    /// Opens the store again, returning the error if it does not open.
    pub(crate) fn try_open(&mut self) -> Result<(), StorageError> {
        drop(self.store.take());
        self.store = Some(reopen_sled_with(self.dir.path(), self.options)?);
        self.start_flusher();
        Ok(())
    }
}

impl Default for SledHarness {
    fn default() -> Self {
        SledHarness::with(SledOptions::default())
    }
}

impl Harness for SledHarness {
    type Store = SledStorage;
    fn store(&mut self) -> &mut SledStorage {
        self.store.as_mut().expect("store is open")
    }
    fn restart(&mut self) {
        if let Err(e) = self.try_open() {
            panic!("reopen the sled store: {e}");
        }
    }
}

/// A harness that is another one started differently: it only forwards.
macro_rules! forwarding_harness {
    ($name:ident: $store:ty) => {
        impl Harness for $name {
            type Store = $store;
            fn store(&mut self) -> &mut $store {
                self.0.store()
            }
            fn restart(&mut self) {
                self.0.restart();
            }
        }
    };
}

/// [`SledStorage`] with its Raft log in segment files ([`super::LogEngine::Segments`]), small
/// ones so that the checks roll over to new segments and delete old ones.
pub(crate) struct SegmentsHarness(pub(crate) SledHarness);

/// Segment size in these tests: a few appends each.
pub(crate) const TEST_SEGMENT_BYTES: u64 = 1024;

/// The options of [`SegmentsHarness`].
fn segments_options() -> SledOptions {
    SledOptions {
        log_engine: super::LogEngine::Segments,
        segment_bytes: TEST_SEGMENT_BYTES,
        ..SledOptions::default()
    }
}

impl Default for SegmentsHarness {
    fn default() -> Self {
        SegmentsHarness(SledHarness::with(segments_options()))
    }
}

forwarding_harness!(SegmentsHarness: SledStorage);

/// [`SledHarness`] flushing in the background.
pub(crate) struct BackgroundSledHarness(SledHarness);

impl Default for BackgroundSledHarness {
    fn default() -> Self {
        BackgroundSledHarness(SledHarness::in_background(SledOptions::default()))
    }
}

forwarding_harness!(BackgroundSledHarness: SledStorage);

/// [`SegmentsHarness`] flushing in the background.
pub(crate) struct BackgroundSegmentsHarness(SledHarness);

impl Default for BackgroundSegmentsHarness {
    fn default() -> Self {
        BackgroundSegmentsHarness(SledHarness::in_background(segments_options()))
    }
}

forwarding_harness!(BackgroundSegmentsHarness: SledStorage);

/// [`MemHarness`] whose flushes complete in the background.
pub(crate) struct BackgroundMemHarness(MemHarness);

impl Default for BackgroundMemHarness {
    fn default() -> Self {
        let mut harness = MemHarness::default();
        harness.store.set_background_flushes(true);
        BackgroundMemHarness(harness)
    }
}

forwarding_harness!(BackgroundMemHarness: MemStorage);

/// [`super::SimSegmentsStorage`]: the segments engine on a simulated disk; a restart is a
/// power cut (the last unsynced write may be torn) and an open of the log. Small segments, so
/// that the checks roll over to new segments and delete old ones.
pub(crate) struct SimSegmentsHarness {
    store: super::SimSegmentsStorage,
}

impl Default for SimSegmentsHarness {
    fn default() -> Self {
        SimSegmentsHarness {
            store: super::SimSegmentsStorage::with_segment_bytes(7, TEST_SEGMENT_BYTES),
        }
    }
}

impl Harness for SimSegmentsHarness {
    type Store = super::SimSegmentsStorage;
    fn store(&mut self) -> &mut super::SimSegmentsStorage {
        &mut self.store
    }
    fn restart(&mut self) {
        self.store.crash();
    }
}

/// [`SimSegmentsHarness`] whose flushes complete in the background.
pub(crate) struct BackgroundSimSegmentsHarness(SimSegmentsHarness);

impl Default for BackgroundSimSegmentsHarness {
    fn default() -> Self {
        let mut harness = SimSegmentsHarness::default();
        harness.store.set_background_flushes(true);
        BackgroundSimSegmentsHarness(harness)
    }
}

forwarding_harness!(BackgroundSimSegmentsHarness: super::SimSegmentsStorage);

/// Reopens a sled directory in this process. sled 0.34's background flusher can still hold the
/// directory's file lock for a moment after the last handle is dropped, so "could not acquire
/// lock" is retried for a bounded time; any other error fails the test.
pub(crate) fn reopen_sled(dir: &std::path::Path) -> SledStorage {
    match reopen_sled_with(dir, SledOptions::default()) {
        Ok(store) => store,
        Err(other) => panic!("reopen the sled store: {other}"),
    }
}

/// [`reopen_sled`] with `options`, returning any error other than the lock's.
pub(crate) fn reopen_sled_with(
    dir: &std::path::Path,
    options: SledOptions,
) -> Result<SledStorage, StorageError> {
    const ATTEMPTS_MAX: u32 = 200;
    let mut attempt = 0;
    loop {
        match SledStorage::open_with(dir, options) {
            Err(StorageError::Io { source, .. })
                if attempt < ATTEMPTS_MAX
                    && source.to_string().contains("could not acquire lock") =>
            {
                attempt += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

fn command(index: Index, term: Term) -> Entry {
    Entry {
        term,
        index,
        payload: EntryPayload::Command(Bytes::from(format!("cmd-{index}-{term}"))),
    }
}

/// Entries `lo..=hi`, all in `term`.
pub(crate) fn commands(lo: Index, hi: Index, term: Term) -> Vec<Entry> {
    (lo..=hi).map(|index| command(index, term)).collect()
}

fn put(key: &str, value: &str) -> KvChange {
    (key.as_bytes().to_vec(), Some(value.as_bytes().to_vec()))
}

fn delete(key: &str) -> KvChange {
    (key.as_bytes().to_vec(), None)
}

fn pair(key: &str, value: &str) -> KvPair {
    (key.as_bytes().to_vec(), value.as_bytes().to_vec())
}

fn snapshot_data(pairs: &[KvPair]) -> Bytes {
    encode_snapshot_data(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())))
}

/// Recovers, restarts, recovers again and demands the same answer both times.
fn recover_across_restart<H: Harness>(harness: &mut H) -> RecoveredState {
    harness.store().flush().expect("flush");
    let before = harness.store().recover().expect("recover before restart");
    harness.restart();
    let after = harness.store().recover().expect("recover after restart");
    assert_eq!(before, after, "restart changed what recover returns");
    let store = harness.store();
    assert_eq!(store.last_index(), after.last_index());
    assert_eq!(store.first_index(), after.snapshot_meta.index + 1);
    assert_eq!(store.applied_index(), after.applied_index);
    after
}

pub(crate) fn check_empty_store<H: Harness>(harness: &mut H) {
    let store = harness.store();
    assert_eq!(store.recover().unwrap(), RecoveredState::default());
    assert_eq!(
        (
            store.first_index(),
            store.last_index(),
            store.applied_index()
        ),
        (1, 0, 0)
    );
    assert_eq!(store.term(0).unwrap(), 0);
    assert!(matches!(
        store.term(1),
        Err(StorageError::Unavailable {
            index: 1,
            last_index: 0
        })
    ));
    assert!(store.entries(1, 1).unwrap().is_empty());
    assert_eq!(
        recover_across_restart(harness),
        RecoveredState::default(),
        "an empty store reopens empty"
    );
}

pub(crate) fn check_append_and_read<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 3, 1)).unwrap();
    store.append(&commands(4, 6, 2)).unwrap();
    store.append(&[]).unwrap();
    assert_eq!(store.last_index(), 6);
    assert_eq!(store.entries(2, 5).unwrap(), {
        let mut expected = commands(2, 3, 1);
        expected.extend(commands(4, 4, 2));
        expected
    });
    assert_eq!(store.term(3).unwrap(), 1);
    assert_eq!(store.term(6).unwrap(), 2);
    assert!(matches!(
        store.entries(0, 2),
        Err(StorageError::Compacted { index: 0, .. })
    ));
    assert!(matches!(
        store.entries(1, 8),
        Err(StorageError::Unavailable {
            index: 7,
            last_index: 6
        })
    ));
    let recovered = recover_across_restart(harness);
    let mut expected = commands(1, 3, 1);
    expected.extend(commands(4, 6, 2));
    assert_eq!(recovered.entries, expected);
    assert_eq!(harness.store().entries(1, 7).unwrap(), expected);
}

pub(crate) fn check_append_rejects_bad_ranges<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 3, 1)).unwrap();
    assert!(matches!(
        store.append(&commands(5, 6, 1)),
        Err(StorageError::AppendOutOfRange {
            first_index: 5,
            snapshot_index: 0,
            last_index: 3
        })
    ));
    assert!(matches!(
        store.append(&commands(0, 1, 1)),
        Err(StorageError::AppendOutOfRange { first_index: 0, .. })
    ));
    let gap = vec![command(4, 1), command(6, 1)];
    assert!(matches!(
        store.append(&gap),
        Err(StorageError::AppendNotContiguous {
            previous_index: 4,
            next_index: 6
        })
    ));
    // A refused append changes nothing.
    assert_eq!(store.last_index(), 3);
    assert_eq!(recover_across_restart(harness).entries, commands(1, 3, 1));
}

/// Raft §5.3: a conflicting entry and everything after it are replaced.
pub(crate) fn check_conflicting_suffix_is_overwritten<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 6, 1)).unwrap();
    store.flush().unwrap();
    // A shorter conflicting suffix: entries 5 and 6 of term 1 must go, not only 4.
    store.append(&commands(4, 4, 2)).unwrap();
    assert_eq!(store.last_index(), 4);
    assert_eq!(store.term(4).unwrap(), 2);
    assert!(matches!(
        store.term(5),
        Err(StorageError::Unavailable { index: 5, .. })
    ));
    let mut expected = commands(1, 3, 1);
    expected.extend(commands(4, 4, 2));
    assert_eq!(recover_across_restart(harness).entries, expected);
    // Overwriting from the very first index, with a longer log.
    harness.store().append(&commands(1, 8, 3)).unwrap();
    assert_eq!(recover_across_restart(harness).entries, commands(1, 8, 3));
    // Appending right after the last entry overwrites nothing.
    harness.store().append(&commands(9, 9, 3)).unwrap();
    assert_eq!(recover_across_restart(harness).entries, commands(1, 9, 3));
}

pub(crate) fn check_hard_state<H: Harness>(harness: &mut H) {
    let first = HardState {
        term: 3,
        vote: 2,
        commit: 0,
    };
    harness.store().set_hard_state(first).unwrap();
    assert_eq!(recover_across_restart(harness).hard_state, first);
    let second = HardState {
        term: 4,
        vote: 0,
        commit: 0,
    };
    harness.store().set_hard_state(second).unwrap();
    assert_eq!(harness.store().recover().unwrap().hard_state, second);
    assert_eq!(recover_across_restart(harness).hard_state, second);
}

pub(crate) fn check_membership<H: Harness>(harness: &mut H) {
    let base = Membership::with_voters([1, 2, 3]);
    let log = vec![
        Entry {
            term: 0,
            index: 1,
            payload: EntryPayload::Config(base.clone()),
        },
        command(2, 1),
        Entry {
            term: 1,
            index: 3,
            payload: EntryPayload::Membership(MembershipChange::AddLearner(4)),
        },
        command(4, 1),
        Entry {
            term: 1,
            index: 5,
            payload: EntryPayload::Membership(MembershipChange::PromoteLearner(4)),
        },
        Entry {
            term: 1,
            index: 6,
            payload: EntryPayload::Membership(MembershipChange::RemoveServer(1)),
        },
    ];
    harness.store().append(&log).unwrap();
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.membership, Membership::with_voters([2, 3, 4]));
    assert_eq!(recovered.entries, log);

    // A change takes effect when appended, so truncating it away undoes it (dissertation §4.1).
    harness.store().append(&commands(6, 6, 2)).unwrap();
    assert_eq!(
        recover_across_restart(harness).membership,
        Membership::with_voters([1, 2, 3, 4])
    );

    // Compacting past membership entries keeps the configuration in effect at the point.
    harness.store().apply(4, &[]).unwrap();
    harness.store().compact(4).unwrap();
    let recovered = recover_across_restart(harness);
    let mut at_four = base.clone();
    at_four.learners.insert(4);
    assert_eq!(recovered.snapshot_meta.membership, at_four);
    assert_eq!(recovered.membership, Membership::with_voters([1, 2, 3, 4]));
    let snapshot = harness.store().build_snapshot().unwrap();
    assert_eq!(snapshot.meta.membership, at_four);
}

/// A membership entry that is not a valid step is reported, never silently skipped.
pub(crate) fn check_invalid_membership_entry_is_an_error<H: Harness>(harness: &mut H) {
    let log = vec![
        Entry {
            term: 0,
            index: 1,
            payload: EntryPayload::Config(Membership::with_voters([1])),
        },
        Entry {
            term: 1,
            index: 2,
            payload: EntryPayload::Membership(MembershipChange::PromoteLearner(9)),
        },
    ];
    harness.store().append(&log).unwrap();
    harness.store().flush().unwrap();
    harness.restart();
    match harness.store().recover() {
        Err(StorageError::Membership { index: 2, .. }) => {}
        other => panic!("expected a membership error at entry 2, got {other:?}"),
    }
}

pub(crate) fn check_apply<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 4, 1)).unwrap();
    store
        .apply(
            2,
            &[put("lock/a", "1"), put("lock/b", "2"), put("data/x", "x")],
        )
        .unwrap();
    store
        .apply(
            3,
            &[delete("lock/a"), put("lock/b", "3"), delete("missing")],
        )
        .unwrap();
    // Applying with no changes still moves the index (a no-op entry).
    store.apply(4, &[]).unwrap();
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.applied_index, 4);
    assert_eq!(
        recovered.applied_state,
        vec![pair("data/x", "x"), pair("lock/b", "3")],
        "applied state in key order"
    );
    // The index may repeat but never go back, and a refused apply writes nothing.
    harness.store().apply(4, &[]).unwrap();
    assert!(matches!(
        harness.store().apply(3, &[put("lock/c", "nope")]),
        Err(StorageError::AppliedIndexRegress {
            applied_index: 4,
            requested_index: 3
        })
    ));
    let again = recover_across_restart(harness);
    assert_eq!(again.applied_state, recovered.applied_state);
    assert_eq!(again.applied_index, 4);
}

/// Raft §7: build a snapshot on one store and install it in chunks on another.
pub(crate) fn check_chunked_snapshot_install<H: Harness + Default>(harness: &mut H) {
    let mut source = H::default();
    source.store().append(&commands(1, 10, 1)).unwrap();
    source
        .store()
        .apply(7, &[put("lock/a", "1"), put("lock/b", "2")])
        .unwrap();
    let snapshot = source.store().build_snapshot().unwrap();
    assert_eq!(snapshot.meta.index, 7);
    assert_eq!(snapshot.meta.term, 1);
    assert_eq!(
        decode_snapshot_data(&snapshot.data).unwrap(),
        vec![pair("lock/a", "1"), pair("lock/b", "2")]
    );

    // The receiver has a conflicting log (term 2 at index 7) and its own state.
    let store = harness.store();
    store.append(&commands(1, 3, 1)).unwrap();
    store.append(&commands(4, 9, 2)).unwrap();
    store.apply(2, &[put("lock/old", "x")]).unwrap();
    store.flush().unwrap();
    let before = store.recover().unwrap();

    assert!(matches!(
        store.write_snapshot_chunk(0, b"x"),
        Err(StorageError::NoSnapshotInProgress)
    ));
    assert!(matches!(
        store.finish_snapshot(),
        Err(StorageError::NoSnapshotInProgress)
    ));
    store.begin_snapshot(&snapshot.meta).unwrap();
    let chunks: Vec<&[u8]> = snapshot.data.chunks(7).collect();
    assert!(chunks.len() > 2, "the test needs several chunks");
    let mut offset = 0u64;
    for (i, chunk) in chunks.iter().enumerate() {
        if i == 1 {
            assert!(matches!(
                store.write_snapshot_chunk(offset + 1, chunk),
                Err(StorageError::SnapshotChunkOutOfOrder { .. })
            ));
        }
        store.write_snapshot_chunk(offset, chunk).unwrap();
        offset += chunk.len() as u64;
        // Nothing visible changes while chunks are staged.
        assert_eq!(store.recover().unwrap(), before);
    }
    store.flush().unwrap();
    harness.restart();
    assert_eq!(
        harness.store().recover().unwrap(),
        before,
        "staged chunks are invisible after a restart too"
    );

    // Restart the transfer (begin discards what was staged) and finish it.
    let store = harness.store();
    store.begin_snapshot(&snapshot.meta).unwrap();
    for (i, chunk) in chunks.iter().enumerate() {
        store.write_snapshot_chunk((i * 7) as u64, chunk).unwrap();
    }
    assert_eq!(store.finish_snapshot().unwrap(), snapshot.meta);
    assert!(matches!(
        store.finish_snapshot(),
        Err(StorageError::NoSnapshotInProgress)
    ));
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.snapshot_meta, snapshot.meta);
    assert_eq!(recovered.applied_index, 7);
    assert_eq!(
        recovered.applied_state,
        vec![pair("lock/a", "1"), pair("lock/b", "2")]
    );
    assert!(
        recovered.entries.is_empty(),
        "a conflicting log is dropped entirely"
    );
    let store = harness.store();
    assert_eq!((store.first_index(), store.last_index()), (8, 7));
    assert_eq!(store.term(7).unwrap(), 1);
    assert!(matches!(
        store.term(6),
        Err(StorageError::Compacted { index: 6, .. })
    ));
    // The log continues after the snapshot point.
    store.append(&commands(8, 8, 2)).unwrap();
    assert_eq!(recover_across_restart(harness).entries, commands(8, 8, 2));
}

/// Raft §7: a snapshot whose last entry matches the log keeps the entries after it.
pub(crate) fn check_snapshot_install_keeps_matching_suffix<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 10, 1)).unwrap();
    store.apply(3, &[put("lock/old", "x")]).unwrap();
    let meta = SnapshotMeta {
        index: 6,
        term: 1,
        membership: Membership::with_voters([1, 2, 3]),
    };
    let data = snapshot_data(&[pair("lock/new", "y")]);
    store.install_snapshot(&meta, &data).unwrap();
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.snapshot_meta, meta);
    assert_eq!(recovered.entries, commands(7, 10, 1));
    assert_eq!(recovered.applied_index, 6);
    assert_eq!(recovered.applied_state, vec![pair("lock/new", "y")]);
    assert_eq!(recovered.membership, meta.membership);

    // A snapshot beyond the end of the log replaces it.
    let far = SnapshotMeta {
        index: 20,
        term: 3,
        membership: Membership::with_voters([1, 2]),
    };
    harness
        .store()
        .install_snapshot(&far, &snapshot_data(&[]))
        .unwrap();
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.snapshot_meta, far);
    assert!(recovered.entries.is_empty());
    assert!(recovered.applied_state.is_empty());
    assert_eq!(harness.store().last_index(), 20);
}

/// The snapshot the install cases put over a store: 40 pairs `k00`..`k39` at index 50, term 3.
fn forty_pair_snapshot() -> (Vec<KvPair>, SnapshotMeta) {
    let pairs = (0..40)
        .map(|i| pair(&format!("k{i:02}"), &format!("v{i}")))
        .collect();
    let meta = SnapshotMeta {
        index: 50,
        term: 3,
        membership: Membership::with_voters([1, 2]),
    };
    (pairs, meta)
}

/// `begin_install` and `continue_install`: the point moves at once, the log goes on after it
/// while the state is written a slice at a time, and the end is what `install_snapshot` gives.
pub(crate) fn check_snapshot_install_in_slices<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 30, 1)).unwrap();
    store
        .apply(
            30,
            &[put("old/a", "1"), put("old/b", "2"), put("k03", "old")],
        )
        .unwrap();
    let (pairs, meta) = forty_pair_snapshot();
    store.begin_install(&meta, &snapshot_data(&pairs)).unwrap();
    assert_eq!(store.last_index(), 50);
    assert_eq!(store.first_index(), 51);
    assert_eq!(store.term(50).unwrap(), 3);
    store.append(&commands(51, 53, 3)).unwrap();
    let mut slices = 0;
    while !store.continue_install(7).unwrap() {
        slices += 1;
        assert!(slices < 100, "the install never ends");
        store.append(&[command(53 + slices, 3)]).unwrap();
    }
    assert!(store.continue_install(7).unwrap(), "nothing left to do");
    assert_eq!(store.applied_index(), 50);
    let last = store.last_index();
    store.apply(51, &[put("k00", "new")]).unwrap();
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.snapshot_meta, meta);
    assert_eq!(recovered.entries, commands(51, last, 3));
    assert_eq!(recovered.applied_index, 51);
    let mut expected = pairs.clone();
    expected[0] = pair("k00", "new");
    assert_eq!(recovered.applied_state, expected);
}

/// Stages `data` as a transfer of the snapshot `meta` would arrive: `chunk` bytes at a time.
fn stage_in_chunks(store: &mut dyn Storage, meta: &SnapshotMeta, data: &[u8], chunk: usize) {
    store.begin_snapshot(meta).unwrap();
    let mut offset = 0;
    for piece in data.chunks(chunk) {
        store.write_snapshot_chunk(offset as u64, piece).unwrap();
        offset += piece.len();
    }
}

/// `begin_install_staged` after the transfer's chunks were staged as they arrived: the same end
/// as `install_snapshot`, with the log kept after the point. Staged bytes that are not the whole
/// snapshot (a transfer cut short, another snapshot's) are not taken for it.
pub(crate) fn check_staged_snapshot_install<H: Harness + Default>(_harness: &mut H) {
    let (pairs, meta) = forty_pair_snapshot();
    let data = snapshot_data(&pairs);
    let other = SnapshotMeta {
        term: 2,
        ..meta.clone()
    };
    let cut = data.len() / 3;
    // (the transfer staged, how much of it)
    for (staged_meta, staged_len) in [
        (&meta, data.len()),
        (&meta, cut),
        (&other, data.len()),
        (&meta, 0),
    ] {
        let context = format!("staged {staged_len} bytes of term {}", staged_meta.term);
        let mut fresh = H::default();
        let store = fresh.store();
        store.append(&commands(1, 30, 1)).unwrap();
        store
            .apply(30, &[put("old/a", "1"), put("k03", "old")])
            .unwrap();
        stage_in_chunks(store, staged_meta, &data[..staged_len], cut.max(1) / 2 + 1);
        store.append(&commands(31, 52, 3)).unwrap();
        store.begin_install_staged(&meta, &data).unwrap();
        assert_eq!(store.first_index(), 51, "{context}");
        assert_eq!(store.term(50).unwrap(), 3, "{context}");
        let mut slices = 0;
        while !store.continue_install(11).unwrap() {
            slices += 1;
            assert!(slices < 100, "the install never ends ({context})");
        }
        assert_eq!(store.applied_index(), 50, "{context}");
        let recovered = recover_across_restart(&mut fresh);
        assert_eq!(recovered.snapshot_meta, meta, "{context}");
        assert_eq!(recovered.applied_index, 50, "{context}");
        assert_eq!(recovered.applied_state, pairs, "{context}");
        assert_eq!(recovered.entries, commands(51, 52, 3), "{context}");
    }
}

/// A snapshot newer than [`forty_pair_snapshot`]'s, for the cases where a second transfer
/// arrives while the first is installed: 25 pairs `n00`..`n24` at index 60, term 4.
fn newer_snapshot() -> (Vec<KvPair>, SnapshotMeta) {
    let pairs = (0..25)
        .map(|i| pair(&format!("n{i:02}"), &format!("w{i}")))
        .collect();
    let meta = SnapshotMeta {
        index: 60,
        term: 4,
        membership: Membership::with_voters([1, 2, 3]),
    };
    (pairs, meta)
}

/// The store the newer-transfer cases start from: an old state, the transfer of
/// [`forty_pair_snapshot`] staged as it arrived, its install begun and one slice of its state
/// written. Returns that snapshot's pairs and meta.
fn begin_staged_install_of_forty_pairs(store: &mut dyn Storage) -> (Vec<KvPair>, SnapshotMeta) {
    store.append(&commands(1, 30, 1)).unwrap();
    store
        .apply(30, &[put("old/a", "1"), put("k03", "old")])
        .unwrap();
    let (pairs, meta) = forty_pair_snapshot();
    let data = snapshot_data(&pairs);
    stage_in_chunks(store, &meta, &data, 64);
    store.begin_install_staged(&meta, &data).unwrap();
    assert!(
        !store.continue_install(7).unwrap(),
        "one slice does not finish the install"
    );
    (pairs, meta)
}

/// Begins a transfer of `meta` the way the node does while an install may be under way: the
/// store either takes it (true) or refuses it cleanly with `InstallInProgress` and changes
/// nothing (false), and the node then leaves the transfer unstaged.
fn try_begin_transfer(store: &mut dyn Storage, meta: &SnapshotMeta) -> bool {
    match store.begin_snapshot(meta) {
        Ok(()) => true,
        Err(StorageError::InstallInProgress { .. }) => false,
        Err(other) => panic!("a transfer during an install fails with {other}"),
    }
}

/// A newer snapshot's transfer begins while an earlier received snapshot is still installed a
/// slice at a time (the Raft core accepts it: it only holds back what commits after the first).
/// The store keeps that transfer or refuses it cleanly; either way the first install finishes,
/// every later chunk of a kept transfer is taken, and the newer snapshot then installs. (Sled
/// used to let the first install's last step delete the new transfer's staging, so its next
/// chunk failed with `NoSnapshotInProgress` and the node stopped.)
pub(crate) fn check_newer_transfer_during_an_install<H: Harness>(harness: &mut H) {
    let store = harness.store();
    let (_, first) = begin_staged_install_of_forty_pairs(store);
    let (pairs, meta) = newer_snapshot();
    let data = snapshot_data(&pairs);
    let chunks: Vec<&[u8]> = data.chunks(40).collect();
    assert!(chunks.len() >= 3);
    let kept = try_begin_transfer(store, &meta);
    let mut offset = 0u64;
    if kept {
        store.write_snapshot_chunk(0, chunks[0]).unwrap();
        offset = chunks[0].len() as u64;
    }
    let mut slices = 0;
    while !store.continue_install(7).unwrap() {
        slices += 1;
        assert!(slices < 100, "the first install never ends");
    }
    assert_eq!(store.applied_index(), first.index);
    if kept {
        for chunk in &chunks[1..] {
            store
                .write_snapshot_chunk(offset, chunk)
                .expect("a kept transfer takes its chunks after the install before it ends");
            offset += chunk.len() as u64;
        }
    }
    store.begin_install_staged(&meta, &data).unwrap();
    while !store.continue_install(7).unwrap() {}
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.snapshot_meta, meta);
    assert_eq!(recovered.applied_index, meta.index);
    assert_eq!(recovered.applied_state, pairs);
    // A transfer after both installs is taken as usual.
    let store = harness.store();
    stage_in_chunks(store, &meta, &data, 40);
    assert_eq!(store.finish_snapshot().unwrap(), meta);
}

/// As [`check_newer_transfer_during_an_install`], but the node crashes (everything flushed)
/// while the first install is under way and the newer transfer has begun. The store opens, the
/// first install is finished by the restart, and the newer snapshot can be received and
/// installed afterwards. (Sled used to find its install mark without the staged bytes, which
/// the newer transfer had replaced, and refuse to open on every restart.)
pub(crate) fn check_crash_during_an_install_with_a_newer_transfer<H: Harness>(harness: &mut H) {
    let store = harness.store();
    let (first_pairs, first) = begin_staged_install_of_forty_pairs(store);
    let (pairs, meta) = newer_snapshot();
    let data = snapshot_data(&pairs);
    if try_begin_transfer(store, &meta) {
        store.write_snapshot_chunk(0, &data[..40]).unwrap();
    }
    store.flush().unwrap();
    harness.restart();
    let store = harness.store();
    let recovered = store.recover().expect("the store opens and recovers");
    assert_eq!(recovered.snapshot_meta, first);
    assert_eq!(recovered.applied_index, first.index);
    assert_eq!(recovered.applied_state, first_pairs);
    assert!(
        store.continue_install(7).unwrap(),
        "no install is under way"
    );
    // The newer transfer, sent again from its start, is taken and installed.
    stage_in_chunks(store, &meta, &data, 40);
    store.begin_install_staged(&meta, &data).unwrap();
    while !store.continue_install(7).unwrap() {}
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.snapshot_meta, meta);
    assert_eq!(recovered.applied_state, pairs);
}

/// The newer snapshot's whole transfer arrives before the first install is done, and its own
/// install begins: the first is finished (or dropped) and the newer one installs, across a
/// crash right after its install began too.
pub(crate) fn check_newer_install_during_an_install<H: Harness>(harness: &mut H) {
    let store = harness.store();
    begin_staged_install_of_forty_pairs(store);
    let (pairs, meta) = newer_snapshot();
    let data = snapshot_data(&pairs);
    if try_begin_transfer(store, &meta) {
        let mut offset = 0;
        for chunk in data.chunks(40) {
            store.write_snapshot_chunk(offset, chunk).unwrap();
            offset += chunk.len() as u64;
        }
    }
    store.begin_install_staged(&meta, &data).unwrap();
    assert_eq!(store.first_index(), meta.index + 1);
    store.flush().unwrap();
    harness.restart();
    let recovered = harness
        .store()
        .recover()
        .expect("the store opens and recovers");
    assert_eq!(recovered.snapshot_meta, meta);
    assert_eq!(recovered.applied_index, meta.index);
    assert_eq!(recovered.applied_state, pairs);
}

/// Regression: reinstalling a snapshot at the current snapshot point with the same term must keep
/// the log after it on both implementations (MemStorage used to drop it, sled kept it).
pub(crate) fn check_snapshot_at_current_point_keeps_log<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 6, 1)).unwrap();
    store.apply(3, &[put("k", "v")]).unwrap();
    store.compact(3).unwrap();
    let meta = SnapshotMeta {
        index: 3,
        term: 1,
        membership: Membership::default(),
    };
    store
        .install_snapshot(&meta, &snapshot_data(&[pair("k", "w")]))
        .unwrap();
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.entries, commands(4, 6, 1));
    assert_eq!(recovered.applied_state, vec![pair("k", "w")]);
}

pub(crate) fn check_bad_snapshot_data_changes_nothing<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 4, 1)).unwrap();
    store.apply(2, &[put("k", "v")]).unwrap();
    store.flush().unwrap();
    let before = store.recover().unwrap();
    let meta = SnapshotMeta {
        index: 3,
        term: 1,
        membership: Membership::default(),
    };
    let mut data = snapshot_data(&[pair("a", "b")]).to_vec();
    data[12] ^= 0x04;
    assert!(matches!(
        store.install_snapshot(&meta, &data),
        Err(StorageError::SnapshotData { .. })
    ));
    store.begin_snapshot(&meta).unwrap();
    store.write_snapshot_chunk(0, &data).unwrap();
    assert!(matches!(
        store.finish_snapshot(),
        Err(StorageError::SnapshotData { .. })
    ));
    assert_eq!(store.recover().unwrap(), before);
    assert_eq!(recover_across_restart(harness), before);
}

/// Compaction by entry count, as the driver does it (`snapshot_entries`): after every `every`
/// applied entries the log is compacted to the applied index, so it never holds more than
/// `every` applied entries, and fewer bytes are read back.
pub(crate) fn check_compaction<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 10, 1)).unwrap();
    store.append(&commands(11, 20, 2)).unwrap();
    store.apply(12, &[put("k", "12")]).unwrap();
    assert!(matches!(
        store.compact(13),
        Err(StorageError::CompactBeyondApplied {
            upto: 13,
            applied_index: 12
        })
    ));
    store.compact(12).unwrap();
    // Compacting to or below the point does nothing.
    store.compact(12).unwrap();
    store.compact(5).unwrap();
    let recovered = recover_across_restart(harness);
    assert_eq!(
        recovered.snapshot_meta,
        SnapshotMeta {
            index: 12,
            term: 2,
            membership: Membership::default()
        }
    );
    assert_eq!(recovered.entries, commands(13, 20, 2));
    let store = harness.store();
    assert_eq!(store.first_index(), 13);
    assert_eq!(store.term(12).unwrap(), 2);
    assert!(matches!(
        store.entries(12, 14),
        Err(StorageError::Compacted {
            index: 12,
            snapshot_index: 12
        })
    ));
    assert!(matches!(
        store.append(&commands(12, 12, 2)),
        Err(StorageError::AppendOutOfRange { .. })
    ));
    // Compacting the whole log leaves an empty log that continues after the point.
    store.apply(20, &[]).unwrap();
    store.compact(20).unwrap();
    assert_eq!(store.last_index(), 20);
    assert!(recover_across_restart(harness).entries.is_empty());

    // Count-driven compaction over a long run keeps the stored log bounded.
    let every: Index = 16;
    let payload_bytes = 100;
    let mut snapshot_index = 20;
    for index in 21..=400 {
        let entry = Entry {
            term: 3,
            index,
            payload: EntryPayload::Command(Bytes::from(vec![b'x'; payload_bytes])),
        };
        let store = harness.store();
        store.append(&[entry]).unwrap();
        store.apply(index, &[put("k", &index.to_string())]).unwrap();
        if index >= snapshot_index + every {
            store.compact(index).unwrap();
            snapshot_index = index;
        }
        let held = store.entries(store.first_index(), index + 1).unwrap();
        assert!(held.len() < every as usize);
        let held_bytes: usize = held.iter().map(Entry::size_bytes).sum();
        assert!(held_bytes < every as usize * (payload_bytes + 24));
    }
    let recovered = recover_across_restart(harness);
    assert_eq!(recovered.snapshot_meta.index, snapshot_index);
    assert_eq!(recovered.last_index(), 400);
    assert_eq!(recovered.applied_state, vec![pair("k", "400")]);
}

pub(crate) fn check_build_snapshot_roundtrip<H: Harness + Default>(harness: &mut H) {
    let store = harness.store();
    store.append(&commands(1, 3, 1)).unwrap();
    store.append(&commands(4, 5, 4)).unwrap();
    store.apply(4, &[put("b", "2"), put("a", "1")]).unwrap();
    let snapshot = store.build_snapshot().unwrap();
    assert_eq!(snapshot.meta.index, 4);
    assert_eq!(
        snapshot.meta.term, 4,
        "term of the entry at the applied index"
    );
    let mut other = H::default();
    other
        .store()
        .install_snapshot(&snapshot.meta, &snapshot.data)
        .unwrap();
    let theirs = recover_across_restart(&mut other);
    let ours = recover_across_restart(harness);
    assert_eq!(theirs.applied_state, ours.applied_state);
    assert_eq!(theirs.applied_index, ours.applied_index);
    assert_eq!(other.store().build_snapshot().unwrap(), snapshot);
}

/// Everything flushed survives a restart, field by field.
pub(crate) fn check_recover_returns_what_was_flushed<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store
        .append(&[Entry {
            term: 0,
            index: 1,
            payload: EntryPayload::Config(Membership::with_voters([1, 2, 3])),
        }])
        .unwrap();
    store.append(&commands(2, 30, 2)).unwrap();
    store
        .set_hard_state(HardState {
            term: 2,
            vote: 1,
            commit: 25,
        })
        .unwrap();
    for index in 1..=25 {
        store
            .apply(
                index,
                &[put(&format!("key/{}", index % 7), &index.to_string())],
            )
            .unwrap();
    }
    store.compact(10).unwrap();
    store.flush().unwrap();
    let expected = store.recover().unwrap();
    harness.restart();
    assert_eq!(harness.store().recover().unwrap(), expected);
    harness.restart();
    assert_eq!(harness.store().recover().unwrap(), expected);
    assert_eq!(expected.entries, commands(11, 30, 2));
    assert_eq!(expected.applied_index, 25);
    assert_eq!(expected.applied_state.len(), 7);
    assert_eq!(expected.membership, Membership::with_voters([1, 2, 3]));
}

/// Flushes started with tickets: tickets do not go backwards, waiting makes every one done,
/// and what they covered survives a restart; the segments harness rolls segments and deletes
/// compacted ones while flushes run.
pub(crate) fn check_flush_tickets<H: Harness>(harness: &mut H) {
    let store = harness.store();
    store
        .append(&[Entry {
            term: 0,
            index: 1,
            payload: EntryPayload::Config(Membership::with_voters([1, 2, 3])),
        }])
        .unwrap();
    let mut last = 0;
    for round in 0..12u64 {
        let lo = 2 + round * 10;
        store.append(&commands(lo, lo + 9, 1)).unwrap();
        store
            .apply(lo, &[put(&format!("key/{}", round % 3), &lo.to_string())])
            .unwrap();
        if round == 6 {
            store.compact(lo - 5).unwrap();
        }
        let ticket = store.start_flush().unwrap();
        assert!(ticket >= last, "ticket {ticket} after {last}");
        last = ticket;
    }
    store.wait_flushed().unwrap();
    assert!(store.flushed().unwrap() >= last);
    let expected = store.recover().unwrap();
    assert_eq!(expected.last_index(), 121);
    assert_eq!(expected.applied_index, 112);
    harness.restart();
    assert_eq!(harness.store().recover().unwrap(), expected);
}

/// MemStorage in the background mode: a crash loses the flushes started and not done, keeps
/// the ones done.
#[test]
fn mem_crash_loses_background_flushes_not_done() {
    let mut store = MemStorage::new();
    store.set_background_flushes(true);
    store.append(&commands(1, 4, 1)).unwrap();
    let first = store.start_flush().unwrap();
    assert!(store.flushed().unwrap() < first);
    store.complete_flushes();
    assert_eq!(store.flushed().unwrap(), first);
    store.append(&commands(5, 8, 1)).unwrap();
    let second = store.start_flush().unwrap();
    assert!(second > first && store.has_pending_flushes());
    store.crash();
    assert_eq!(store.last_index(), 4);
    assert!(!store.has_pending_flushes());
}

/// MemStorage only: a crash loses exactly what was written since the last flush.
pub(crate) fn check_crash_loses_unflushed_writes(harness: &mut MemHarness) {
    let store = harness.store();
    store.append(&commands(1, 4, 1)).unwrap();
    store
        .set_hard_state(HardState {
            term: 1,
            vote: 1,
            commit: 2,
        })
        .unwrap();
    store.apply(2, &[put("k", "flushed")]).unwrap();
    store.flush().unwrap();
    let flushed = store.recover().unwrap();

    store.append(&commands(3, 8, 2)).unwrap();
    store
        .set_hard_state(HardState {
            term: 2,
            vote: 0,
            commit: 6,
        })
        .unwrap();
    store
        .apply(6, &[put("k", "lost"), put("j", "lost")])
        .unwrap();
    store.compact(5).unwrap();
    store.begin_snapshot(&SnapshotMeta::default()).unwrap();
    assert_ne!(store.recover().unwrap(), flushed);
    harness.restart();
    assert_eq!(harness.store().recover().unwrap(), flushed);
    assert_eq!(harness.store().last_index(), 4);
    assert!(matches!(
        harness.store().finish_snapshot(),
        Err(StorageError::NoSnapshotInProgress)
    ));
}

/// Drives `reference` and `other` with the same seeded random operations and demands identical
/// results, restarting both after a flush now and then.
pub(crate) fn check_differential<A: Harness, B: Harness>(a: &mut A, b: &mut B, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut term: Term = 1;
    let mut key_counter = 0u32;
    for step in 0..400 {
        let op = rng.random_range(0..100);
        let (first, last, applied) = {
            let s = a.store();
            (s.first_index(), s.last_index(), s.applied_index())
        };
        let context = format!("seed {seed} step {step} op {op}");
        macro_rules! both {
            ($call:expr) => {{
                let left = { $call(a.store()) }.map_err(|e: StorageError| e.to_string());
                let right = { $call(b.store()) }.map_err(|e: StorageError| e.to_string());
                assert_eq!(left, right, "{context}");
            }};
        }
        match op {
            0..=34 => {
                // Append, sometimes overwriting a suffix, sometimes in a new term.
                if rng.random_bool(0.2) {
                    term += 1;
                }
                let lo = if last >= first && rng.random_bool(0.3) {
                    rng.random_range(first..=last)
                } else {
                    last + 1
                };
                let count = rng.random_range(0..6);
                let mut entries = commands(lo, lo + count, term);
                // Sometimes a configuration entry, so the membership at the snapshot point
                // depends on what was appended, truncated and compacted since the store opened.
                if rng.random_bool(0.3) {
                    let at = rng.random_range(0..entries.len());
                    let voters: Vec<u64> = (1..=5).filter(|_| rng.random_bool(0.6)).collect();
                    entries[at].payload = EntryPayload::Config(Membership::with_voters(voters));
                }
                both!(|s: &mut dyn Storage| s.append(&entries));
            }
            35..=44 => {
                let hard_state = HardState {
                    term,
                    vote: rng.random_range(0..4),
                    commit: applied,
                };
                both!(|s: &mut dyn Storage| s.set_hard_state(hard_state));
            }
            45..=64 => {
                let target = if last > applied {
                    rng.random_range(applied..=last)
                } else {
                    applied
                };
                let mut changes = Vec::new();
                for _ in 0..rng.random_range(0..4) {
                    let key = format!("k{}", rng.random_range(0..8));
                    if rng.random_bool(0.25) {
                        changes.push(delete(&key));
                    } else {
                        key_counter += 1;
                        changes.push(put(&key, &key_counter.to_string()));
                    }
                }
                both!(|s: &mut dyn Storage| s.apply(target, &changes));
            }
            65..=72 => {
                let upto = rng.random_range(first.saturating_sub(1)..=applied.max(first));
                both!(|s: &mut dyn Storage| s.compact(upto));
            }
            73..=78 => {
                // A snapshot that sometimes matches the log and sometimes conflicts.
                let index = rng.random_range(first - 1..=last + 3);
                let meta = SnapshotMeta {
                    index,
                    term: if rng.random_bool(0.5) {
                        a.store().term(index).unwrap_or(term)
                    } else {
                        term + 1
                    },
                    membership: Membership::with_voters([1, 2, 3]),
                };
                term = term.max(meta.term);
                let data = snapshot_data(&[pair("snap", &index.to_string())]);
                if rng.random_bool(0.5) {
                    both!(|s: &mut dyn Storage| s.install_snapshot(&meta, &data));
                } else {
                    both!(|s: &mut dyn Storage| {
                        s.begin_snapshot(&meta)?;
                        let mut offset = 0;
                        for chunk in data.chunks(5) {
                            s.write_snapshot_chunk(offset, chunk)?;
                            offset += chunk.len() as u64;
                        }
                        s.finish_snapshot()
                    });
                }
            }
            79..=82 => {
                let lo = rng.random_range(first.saturating_sub(1)..=last + 1);
                let hi = rng.random_range(lo..=last + 2);
                both!(|s: &mut dyn Storage| s.entries(lo, hi));
            }
            83..=86 => {
                let index = rng.random_range(first.saturating_sub(2)..=last + 1);
                both!(|s: &mut dyn Storage| s.term(index));
            }
            87..=89 => {
                both!(|s: &mut dyn Storage| s.build_snapshot());
                // The job a background thread runs builds the same snapshot.
                both!(|s: &mut dyn Storage| s.snapshot_job().and_then(|job| job()));
                let built = a.store().build_snapshot().map_err(|e| e.to_string());
                let job = a.store().snapshot_job().and_then(|job| job());
                assert_eq!(built, job.map_err(|e| e.to_string()), "{context}");
                // A job that converts the pairs as it reads builds what converting the
                // snapshot's decoded pairs builds (the default, which MemStorage keeps).
                let convert = || -> PairsConvert {
                    Box::new(|pairs| {
                        Box::new(
                            pairs
                                .filter(|p| p.as_ref().map_or(true, |(k, _)| k.len() % 2 == 0))
                                .map(|p| {
                                    p.map(|(k, mut v): KvPair| {
                                        v.push(b'!');
                                        (k, v)
                                    })
                                }),
                        )
                    })
                };
                both!(|s: &mut dyn Storage| s.snapshot_job_with(convert()).and_then(|job| job()));
            }
            90..=96 => both!(|s: &mut dyn Storage| s.flush()),
            _ => {
                a.store().flush().unwrap();
                b.store().flush().unwrap();
                a.restart();
                b.restart();
            }
        }
        let left = a.store().recover().map_err(|e| e.to_string());
        let right = b.store().recover().map_err(|e| e.to_string());
        assert_eq!(left, right, "recover differs after {context}");
        let bounds = |s: &mut dyn Storage| (s.first_index(), s.last_index(), s.applied_index());
        assert_eq!(bounds(a.store()), bounds(b.store()), "{context}");
    }
}

macro_rules! conformance_tests {
    ($harness:ty: $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                super::$check(&mut <$harness>::default());
            }
        )*
    };
}

macro_rules! all_conformance_tests {
    ($harness:ty) => {
        conformance_tests!($harness:
            check_empty_store,
            check_append_and_read,
            check_append_rejects_bad_ranges,
            check_conflicting_suffix_is_overwritten,
            check_hard_state,
            check_membership,
            check_invalid_membership_entry_is_an_error,
            check_apply,
            check_chunked_snapshot_install,
            check_snapshot_install_keeps_matching_suffix,
            check_snapshot_install_in_slices,
            check_staged_snapshot_install,
            check_newer_transfer_during_an_install,
            check_crash_during_an_install_with_a_newer_transfer,
            check_newer_install_during_an_install,
            check_snapshot_at_current_point_keeps_log,
            check_bad_snapshot_data_changes_nothing,
            check_compaction,
            check_build_snapshot_roundtrip,
            check_recover_returns_what_was_flushed,
            check_flush_tickets,
        );
    };
}

mod mem {
    use super::MemHarness;

    all_conformance_tests!(MemHarness);

    #[test]
    fn check_crash_loses_unflushed_writes() {
        super::check_crash_loses_unflushed_writes(&mut MemHarness::default());
    }
}

mod sled {
    use super::SledHarness;

    all_conformance_tests!(SledHarness);
}

mod segments {
    use super::SegmentsHarness;

    all_conformance_tests!(SegmentsHarness);
}

mod mem_background {
    use super::BackgroundMemHarness;

    all_conformance_tests!(BackgroundMemHarness);
}

mod sled_background {
    use super::BackgroundSledHarness;

    all_conformance_tests!(BackgroundSledHarness);
}

mod segments_background {
    use super::BackgroundSegmentsHarness;

    all_conformance_tests!(BackgroundSegmentsHarness);
}

mod sim_segments {
    use super::SimSegmentsHarness;

    all_conformance_tests!(SimSegmentsHarness);
}

mod sim_segments_background {
    use super::BackgroundSimSegmentsHarness;

    all_conformance_tests!(BackgroundSimSegmentsHarness);
}

#[test]
fn mem_and_sim_segments_agree_on_random_operations() {
    for seed in 0..8 {
        super::conformance::check_differential(
            &mut MemHarness::default(),
            &mut SimSegmentsHarness::default(),
            seed,
        );
    }
}

#[test]
fn mem_and_background_segments_agree_on_random_operations() {
    for seed in 0..8 {
        super::conformance::check_differential(
            &mut MemHarness::default(),
            &mut BackgroundSegmentsHarness::default(),
            seed,
        );
    }
}

#[test]
fn mem_and_sled_agree_on_random_operations() {
    for seed in 0..8 {
        super::conformance::check_differential(
            &mut MemHarness::default(),
            &mut SledHarness::default(),
            seed,
        );
    }
}

#[test]
fn mem_and_segments_agree_on_random_operations() {
    for seed in 0..8 {
        super::conformance::check_differential(
            &mut MemHarness::default(),
            &mut SegmentsHarness::default(),
            seed,
        );
    }
}

/// A crash after a compaction recorded its point but before the background trimmer deleted the
/// runs behind it leaves them in the log tree: they are never read back, the bounds ignore
/// them, and the next compaction deletes them. A run that holds entries on both sides of the
/// point stays whole until the point passes its last entry.
#[test]
fn sled_ignores_entries_left_behind_the_snapshot_point() {
    use super::codec::{begin_run, index_key, push_run_entry};
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
    use super::codec::{encode_entry, encode_index_term, encode_membership, encode_u64, index_key};
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
    let last_run_start = super::codec::decode_index_key(&last_run).unwrap();
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

// ----- the log in segment files (`LogEngine::Segments`) --------------------------------------

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
        super::segment_log::SEGMENT_HEADER_V1 as usize
    } else {
        super::segment_log::SEGMENT_HEADER as usize
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
    let header = super::segment_log::SEGMENT_HEADER as usize;
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
        log_engine: super::LogEngine::Segments,
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
