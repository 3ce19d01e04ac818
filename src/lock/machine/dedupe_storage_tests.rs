//! Tests of the exactly-once table as stored: records written a block to a key, their encoding,
//! the move from one key per record, snapshots of the table, and the session indexes.

use super::changes::{dedupe_block_key, dedupe_key};
use super::records::{DedupeRecord, KeptOutcome};
use super::sessions::{request_hash, RequestIndex, SessionRecords};
use super::snapshot::StatePairs;
use super::*;
use crate::lock::command::{decode_plain, encode_plain, Command, DecodeError, FencingToken};
use crate::lock::outcome::{Outcome, RejectCode};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

fn acquire(key: String, client: &str, request: String) -> Command {
    Command::Acquire {
        key,
        client_id: client.into(),
        request_id: request,
        ttl_ms: 10_000,
        wait_timeout_ms: None,
    }
}

/// A state machine that answered `n` acquires (one key each, one client) and released
/// every other one, with the store its `take_changes` wrote.
fn busy(n: usize) -> (LockStateMachine, BTreeMap<Vec<u8>, Vec<u8>>, usize) {
    let mut sm = LockStateMachine::new(Limits::default());
    let mut store = BTreeMap::new();
    let mut index = 0;
    for i in 0..n {
        index += 1;
        let applied = sm.apply(index, &acquire(format!("k{i}"), "c", format!("a{i}")));
        let Outcome::Granted { token, .. } = applied.outcome else {
            panic!("acquire {i}: {:?}", applied.outcome);
        };
        if i % 2 == 0 {
            index += 1;
            sm.apply(
                index,
                &Command::Release {
                    key: format!("k{i}"),
                    client_id: "c".into(),
                    request_id: format!("r{i}"),
                    token,
                },
            );
        }
    }
    let changes = sm.take_changes();
    let keys_written = changes.len();
    write(&mut store, changes);
    (sm, store, keys_written)
}

fn write(store: &mut BTreeMap<Vec<u8>, Vec<u8>>, changes: Vec<(Vec<u8>, Option<Vec<u8>>)>) {
    for (k, v) in changes {
        match v {
            Some(v) => store.insert(k, v),
            None => store.remove(&k),
        };
    }
}

#[test]
fn answers_are_written_a_block_of_records_to_a_key() {
    let (sm, store, keys_written) = busy(300);
    // 450 answers (300 acquires, 150 releases): 15 blocks, not 450 keys.
    assert_eq!(sm.dedupe.len(), 450);
    let blocks = store
        .keys()
        .filter(|k| k.starts_with(META_DEDUPE_BLOCK_PREFIX.as_bytes()))
        .count();
    assert_eq!(blocks, 450_usize.div_ceil(DEDUPE_BLOCK as usize));
    assert!(!store
        .keys()
        .any(|k| k.starts_with(META_DEDUPE_PREFIX.as_bytes())));
    // 300 lock keys (150 held, 150 released: deleted), the blocks and a few meta keys;
    // one key per answer would have been 450 more.
    assert!(
        keys_written < 300 + blocks + 8,
        "{keys_written} keys written"
    );
    // What was written reads back as the same state, and a retry is answered from it.
    let mut back = LockStateMachine::from_kv(store.clone()).expect("reads back");
    assert!(back == sm);
    let retry = back.apply(10_000, &acquire("k7".into(), "c", "a7".into()));
    assert!(retry.replayed, "a retry is answered from the table");
}

/// The layout records had when they were a derived struct of owned strings: what every
/// stored block and every snapshot of earlier versions holds.
#[derive(Serialize, Deserialize, PartialEq, Debug)]
struct OwnedLayout {
    client_id: String,
    request_id: String,
    outcome: Outcome,
    op: Option<(u8, String)>,
    at_ms: u64,
}

#[test]
fn records_encode_and_decode_in_the_layout_of_owned_strings() {
    let (sm, _, _) = busy(40);
    let mut checked = 0;
    for (&n, rec) in &sm.dedupe {
        let owned = OwnedLayout {
            client_id: rec.client_id.to_string(),
            request_id: rec.request_id().to_string(),
            outcome: rec.outcome(),
            op: rec.op().map(|(k, key)| (k, key.to_string())),
            at_ms: rec.at_ms,
        };
        let bytes = encode_plain(&**rec);
        assert_eq!(bytes, encode_plain(&owned), "record {n}");
        let back: DedupeRecord = decode_plain(&encode_plain(&owned)).expect("decodes");
        assert_eq!(back, **rec, "record {n}");
        checked += 1;
    }
    assert_eq!(checked, 60);
    // A block, as a list of numbered records, too.
    let block: Vec<(u64, &DedupeRecord)> = sm.dedupe.iter().map(|(&n, r)| (n, &**r)).collect();
    let owned: Vec<(u64, OwnedLayout)> = decode_plain(&encode_plain(&block)).expect("decodes");
    assert_eq!(owned.len(), 60);
    assert_eq!(owned[0].1.client_id, "c");
}

#[test]
fn records_keep_every_outcome_whatever_its_form() {
    let token = |key: &str| FencingToken {
        key: key.into(),
        value: 9,
    };
    let cases = [
        (
            Outcome::Granted {
                token: token("jobs/a"),
                ttl_ms: 5,
            },
            Some((1, "jobs/a")),
        ),
        // A token of another key than the request's, or no known key: kept as it is.
        (
            Outcome::Granted {
                token: token("jobs/b"),
                ttl_ms: 5,
            },
            Some((1, "jobs/a")),
        ),
        (
            Outcome::Granted {
                token: token("jobs/a"),
                ttl_ms: 5,
            },
            None,
        ),
        (
            Outcome::Renewed {
                token: token("jobs/a"),
                ttl_ms: 7,
            },
            Some((3, "jobs/a")),
        ),
        (Outcome::Queued { position: 4 }, Some((1, "jobs/a"))),
        (Outcome::Released, Some((2, ""))),
        (Outcome::WaitCancelled, Some((4, "jobs/a"))),
        (Outcome::Stored, Some((5, "data/x"))),
        (Outcome::Deleted { existed: true }, Some((6, "data/x"))),
        (Outcome::NotHolder, Some((2, "jobs/a"))),
        (
            Outcome::rejected(RejectCode::LimitReached, "full"),
            Some((1, "jobs/a")),
        ),
    ];
    for (outcome, op) in cases {
        let rec = DedupeRecord::new("c".into(), "req-1", outcome.clone(), op, 3);
        assert_eq!(rec.outcome(), outcome, "{op:?}");
        assert_eq!(rec.op(), op);
        assert_eq!(rec.request_id(), "req-1");
        let owned = OwnedLayout {
            client_id: "c".into(),
            request_id: "req-1".into(),
            outcome: outcome.clone(),
            op: op.map(|(k, key)| (k, key.to_string())),
            at_ms: 3,
        };
        assert_eq!(encode_plain(&rec), encode_plain(&owned), "{outcome:?}");
        let back: DedupeRecord = decode_plain(&encode_plain(&owned)).expect("decodes");
        assert_eq!(back, rec);
    }
    // The compact form is what makes a record 72 bytes instead of 112.
    assert!(std::mem::size_of::<DedupeRecord>() <= 72);
    let granted = DedupeRecord::new(
        "c".into(),
        "r",
        Outcome::Granted {
            token: token("k"),
            ttl_ms: 1,
        },
        Some((1, "k")),
        0,
    );
    assert!(matches!(granted.outcome, KeptOutcome::Granted { .. }));
}

#[test]
fn a_session_shares_one_copy_of_its_client_id_also_after_a_reload() {
    let (sm, store, _) = busy(10);
    let back = LockStateMachine::from_kv(store).expect("reads back");
    for machine in [&sm, &back] {
        let (session_key, _) = machine.sessions.get_key_value("c").expect("session c");
        for rec in machine.dedupe.values() {
            assert!(Arc::ptr_eq(&rec.client_id, session_key));
        }
    }
}

/// The hash index answers as the ordered set of (hash, number) it replaced: the same
/// numbers under each hash, newest first, through inserts in any order and removals, with
/// hashes chosen from a handful so that they collide often.
#[test]
fn request_index_lists_what_an_ordered_set_would() {
    let mut index = RequestIndex::default();
    let mut model: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut rng = ChaCha8Rng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
    let mut next = move || rng.random_range(0..1u64 << 31);
    for step in 0..20_000u64 {
        let hash = next() % 5;
        let n = next() % 64;
        if next() % 3 == 0 {
            index.remove(hash, n);
            model.remove(&(hash, n));
        } else if !model.contains(&(hash, n)) {
            index.insert(hash, n);
            model.insert((hash, n));
        }
        for h in 0..5 {
            let want: Vec<u64> = model
                .range((h, 0)..=(h, u64::MAX))
                .rev()
                .map(|&(_, n)| n)
                .collect();
            let got: Vec<u64> = index.under(h).collect();
            assert_eq!(got, want, "hash {h} after step {step}");
        }
    }
    assert!(index.newest.len() <= 5);
}

/// A session's deque of record numbers, dead entries and all, lists what the ordered set it
/// replaced would: new numbers at the back, forgotten ones anywhere (the oldest most often,
/// as evictions do), a few reloaded out of order; and it stays within its bound.
#[test]
fn session_records_list_what_an_ordered_set_would() {
    let mut records = SessionRecords::default();
    let mut model: BTreeSet<u64> = BTreeSet::new();
    let mut rng = ChaCha8Rng::seed_from_u64(0x2545_f491_4f6c_dd1d);
    let mut next = move || rng.random_range(0..1u64 << 31);
    let mut fresh = 1_000u64;
    for step in 0..20_000u64 {
        match next() % 8 {
            0..=2 => {
                fresh += 1 + next() % 3;
                records.insert(fresh);
                model.insert(fresh);
            }
            3 => {
                // A reload: an older number not held.
                let n = next() % fresh;
                if model.insert(n) {
                    records.insert(n);
                }
            }
            4..=5 => {
                if let Some(&oldest) = model.first() {
                    model.remove(&oldest);
                    records.remove(oldest, |m| model.contains(&m));
                }
            }
            _ => {
                let held: Vec<u64> = model.iter().copied().collect();
                if !held.is_empty() {
                    let n = held[next() as usize % held.len()];
                    model.remove(&n);
                    records.remove(n, |m| model.contains(&m));
                }
            }
        }
        let live: Vec<u64> = records.iter().filter(|n| model.contains(n)).collect();
        let want: Vec<u64> = model.iter().copied().collect();
        assert_eq!(live, want, "after step {step}");
        assert_eq!(records.len(), model.len());
        assert_eq!(records.newest(), model.last().copied());
        assert!(records.numbers.len() <= 2 * model.len() + 16, "step {step}");
    }
}

/// A session's table gives its memory back as its answers go: the index of a session that
/// held 100,000 answers and keeps 10 is small again.
#[test]
fn request_index_shrinks_as_answers_go() {
    let mut index = RequestIndex::default();
    for n in 0..100_000u64 {
        index.insert(request_hash(&format!("r-{n}")), n);
    }
    let peak = index.newest.capacity();
    assert!(peak >= 100_000);
    for n in 0..99_990u64 {
        index.remove(request_hash(&format!("r-{n}")), n);
    }
    assert_eq!(index.newest.len(), 10);
    assert!(
        index.newest.capacity() <= 64,
        "capacity {} of {peak} kept for 10 answers",
        index.newest.capacity()
    );
    for n in 99_990..100_000u64 {
        let hash = request_hash(&format!("r-{n}"));
        assert_eq!(index.under(hash).collect::<Vec<_>>(), vec![n]);
    }
}

#[test]
fn request_ids_under_one_hash_are_told_apart() {
    let (mut sm, _, _) = busy(4);
    let a0 = sm.record_number("c", "a0").expect("a0 is remembered");
    let a1 = sm.record_number("c", "a1").expect("a1 is remembered");
    assert_ne!(a0, a1);
    // File a1's record under a0's hash as well, as if the two ids hashed alike.
    let session = sm.sessions.get_mut("c").expect("session c");
    session.by_request.insert(request_hash("a0"), a1);
    assert_eq!(sm.record_number("c", "a0"), Some(a0));
    assert_eq!(sm.record_number("c", "a1"), Some(a1));
    assert_eq!(sm.record_number("c", "a9"), None);
    assert_eq!(sm.record_number("d", "a0"), None);
    // Forgetting a0 leaves a1 findable under its own hash, and a0 answers no more.
    sm.remove_record(a0);
    assert_eq!(sm.record_number("c", "a0"), None);
    assert_eq!(sm.record_number("c", "a1"), Some(a1));
}

#[test]
fn forgetting_answers_rewrites_or_deletes_their_blocks() {
    let (mut sm, mut store, _) = busy(100);
    let before = sm.dedupe.len();
    // Forget the oldest 40 records: the first block goes, the second is rewritten.
    let oldest: Vec<u64> = sm.dedupe.keys().copied().take(40).collect();
    for n in oldest {
        sm.remove_record(n);
    }
    let changes = sm.take_changes();
    assert!(changes.contains(&(dedupe_block_key(0).into_bytes(), None)));
    assert!(changes
        .iter()
        .any(|(k, v)| k == dedupe_block_key(1).as_bytes() && v.is_some()));
    write(&mut store, changes);
    let back = LockStateMachine::from_kv(store).expect("reads back");
    assert_eq!(back.dedupe.len(), before - 40);
    assert!(back == sm);
}

/// The store as an older RaftLock (or a snapshot install) leaves it: one key per record.
fn one_key_per_record(store: &BTreeMap<Vec<u8>, Vec<u8>>) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let pairs: Vec<(Vec<u8>, Vec<u8>)> =
        store.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    stored_to_snapshot_pairs(pairs)
        .expect("opens")
        .into_iter()
        .collect()
}

#[test]
fn a_snapshot_opened_as_read_refuses_keys_out_of_order_or_twice() {
    let (sm, store, _) = busy(100);
    let stream = |pairs: Vec<(Vec<u8>, Vec<u8>)>| -> Result<StatePairs, DecodeError> {
        StoredToSnapshot::new(pairs.into_iter().map(Ok), |e| e).collect()
    };
    let in_order: Vec<_> = store.clone().into_iter().collect();
    assert_eq!(stream(in_order.clone()).expect("opens"), sm.to_kv());
    let mut swapped = in_order.clone();
    let last = swapped.len() - 1;
    swapped.swap(0, last);
    assert!(stream(swapped).is_err(), "stored pairs out of order");
    // A record both in a block and under its one-record key.
    let (&n, rec) = sm.dedupe.iter().next().expect("a record");
    let mut twice = store;
    twice.insert(dedupe_key(n).into_bytes(), encode_plain(rec));
    let err = stream(twice.into_iter().collect()).expect_err("a record twice");
    assert!(err.to_string().contains("out of order"), "{err}");
    // A storage error ends the stream with that error.
    let failing = in_order
        .into_iter()
        .map(Ok)
        .take(3)
        .chain(std::iter::once(Err("disk")));
    let got: Result<Vec<_>, &str> = StoredToSnapshot::new(failing, |_| "decode").collect();
    assert_eq!(got, Err("disk"));
}

#[test]
fn snapshots_carry_one_key_per_record() {
    let (sm, store, _) = busy(100);
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = store.into_iter().collect();
    let opened = stored_to_snapshot_pairs(pairs).expect("opens");
    assert_eq!(opened, sm.to_kv(), "the snapshot layout, in key order");
    assert!(opened
        .iter()
        .all(|(k, _)| !k.starts_with(META_DEDUPE_BLOCK_PREFIX.as_bytes())));
}

#[test]
fn one_key_per_record_state_reads_back_and_moves_to_blocks() {
    let (sm, store, _) = busy(100);
    let mut old = one_key_per_record(&store);
    let mut migrated = LockStateMachine::from_kv(old.clone()).expect("old layout reads");
    assert!(migrated == sm);
    assert_eq!(
        migrated.snapshot(),
        sm.snapshot(),
        "snapshots stay byte-identical"
    );
    // 150 records are 5 blocks, within one write's share: the next write moves them all.
    let changes = migrated.take_changes();
    let deleted = changes
        .iter()
        .filter(|(k, v)| k.starts_with(META_DEDUPE_PREFIX.as_bytes()) && v.is_none())
        .count();
    assert_eq!(deleted, sm.dedupe.len());
    write(&mut old, changes);
    assert_eq!(old, store, "after one write the store is the new layout");
    assert!(migrated.take_changes().is_empty());
}

#[test]
fn a_large_old_table_moves_a_few_blocks_per_write_and_always_reads_back() {
    let (sm, store, _) = busy(600);
    let blocks = sm.dedupe.len().div_ceil(DEDUPE_BLOCK as usize);
    assert!(blocks > 3 * LEGACY_BLOCKS_PER_WRITE);
    let mut stored = one_key_per_record(&store);
    let mut node = LockStateMachine::from_kv(stored.clone()).expect("reads");
    let mut writes = 0;
    let mut index = 100_000;
    loop {
        // Work goes on meanwhile: a new answer, and an old one forgotten from a block that
        // has not moved yet (its block is written, and its old keys deleted, at once).
        index += 1;
        node.apply(
            index,
            &acquire(format!("new{writes}"), "d", format!("n{writes}")),
        );
        if let Some(&last_old) = node.legacy_dedupe_keys.last() {
            node.remove_record(last_old);
        }
        let changes = node.take_changes();
        if changes.is_empty() {
            break;
        }
        assert!(changes.len() < 2 * LEGACY_BLOCKS_PER_WRITE * DEDUPE_BLOCK as usize + 20);
        write(&mut stored, changes);
        writes += 1;
        // Every intermediate store holds each record exactly once and reads back.
        let back = LockStateMachine::from_kv(stored.clone())
            .unwrap_or_else(|e| panic!("after write {writes}: {e}"));
        assert!(back == node, "after write {writes}");
        // ...and its snapshot, opened as it is read (one-record keys and blocks mixed),
        // is the state's snapshot layout.
        let streamed: Result<StatePairs, DecodeError> =
            StoredToSnapshot::new(stored.clone().into_iter().map(Ok), |e| e).collect();
        assert_eq!(
            streamed.expect("opens"),
            node.to_kv(),
            "after write {writes}"
        );
        if node.legacy_dedupe_keys.is_empty() {
            break;
        }
        assert!(writes < 100, "the move does not end");
    }
    assert!(node.legacy_dedupe_keys.is_empty());
    assert!(writes > 1, "moved in several writes, not one");
    assert!(!stored
        .keys()
        .any(|k| k.starts_with(META_DEDUPE_PREFIX.as_bytes())));
}

#[test]
fn damaged_blocks_are_errors() {
    let (sm, store, _) = busy(40);
    // A record in the wrong block.
    let mut wrong = store.clone();
    let block0 = wrong
        .remove(dedupe_block_key(0).as_bytes())
        .expect("block 0");
    wrong.insert(dedupe_block_key(5).into_bytes(), block0);
    assert!(LockStateMachine::from_kv(wrong).is_err());
    // A record both in a block and under its old key.
    let mut twice = store.clone();
    let (&n, rec) = sm.dedupe.iter().next().expect("a record");
    twice.insert(dedupe_key(n).into_bytes(), encode_plain(rec));
    assert!(LockStateMachine::from_kv(twice).is_err());
    // An empty block and garbage.
    let mut empty = store.clone();
    empty.insert(
        dedupe_block_key(9).into_bytes(),
        encode_plain(&Vec::<(u64, DedupeRecord)>::new()),
    );
    assert!(LockStateMachine::from_kv(empty).is_err());
    let mut garbage = store;
    garbage.insert(dedupe_block_key(0).into_bytes(), vec![0xff; 7]);
    assert!(LockStateMachine::from_kv(garbage).is_err());
}
