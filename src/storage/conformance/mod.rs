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
//! answers. Crash-at-any-moment tests with real processes live in `tests/storage_crash.rs`;
//! each engine's own recovery and damage tests are in `sled_store` and `segment_log`.

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

// Beyond the shared suite: each engine's own recovery and damage tests.
mod segment_log;
mod sled_store;

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
