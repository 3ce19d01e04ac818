//! Bytes read back from disk, or received as snapshot data from a leader, through the storage
//! codec (src/storage/codec.rs) and on into the lock state machine.
//!
//! The first byte chooses the decoder; the rest is its input:
//! 0 log entry (under the index the record names, and under index 1; the same bytes also as a
//! log run of entries), 1 hard state,
//! 2 snapshot point, 3 u64 record, 4 membership, 5 sealed state value, 6 log key, 7 snapshot
//! data, which, when it decodes, is also rebuilt into a `LockStateMachine` the way a follower
//! installs a snapshot (`from_kv_with_limits`).
//!
//! Every record carries a CRC-32, which random mutations almost never get right; with bit 3 of
//! the first byte set (8..=15) the input is the record *without* its checksum and the harness
//! adds the right one, so the fuzzer also reaches the parsing behind the checksum.
//!
//! Never panics; whatever decodes encodes to bytes that decode to the same value (and, for the
//! fixed-layout records, to the very same bytes). A state machine rebuilt from snapshot data
//! rebuilds to itself from its own `to_kv()`.

use raftlock::lock::{Limits, LockStateMachine};
use raftlock::storage::codec_fuzzing as codec;
use raftlock::storage::{decode_snapshot_data, encode_snapshot_data};

/// `crc32 (u32 BE) ‖ body`, the layout of every sealed record.
fn seal(body: &[u8]) -> Vec<u8> {
    let mut record = crc32fast::hash(body).to_be_bytes().to_vec();
    record.extend_from_slice(body);
    record
}

/// One input, as the cargo-fuzz target and the corpus replay test (tests/fuzz_corpus.rs) give it.
pub fn run(data: &[u8]) {
    let Some((&which, input)) = data.split_first() else {
        return;
    };
    let kind = which % 8;
    let add_checksum = which & 8 != 0;
    let owned: Vec<u8>;
    let body: &[u8] = match (add_checksum, kind) {
        (false, _) | (true, 6) => input,
        (true, 7) => {
            // Snapshot data ends with the checksum of everything before it.
            let mut data = input.to_vec();
            data.extend_from_slice(&crc32fast::hash(input).to_be_bytes());
            owned = data;
            &owned
        }
        (true, _) => {
            owned = seal(input);
            &owned
        }
    };
    match kind {
        0 => {
            // crc32 (4) ‖ version (1) ‖ term (8) ‖ index (8) ‖ …
            let named = body
                .get(13..21)
                .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")));
            for index in named.into_iter().chain([1]) {
                if let Ok(entry) = codec::decode_entry(index, body) {
                    assert_eq!(entry.index, index);
                    let again = codec::encode_entry(&entry);
                    assert_eq!(codec::decode_entry(index, &again).ok(), Some(entry));
                }
            }
            // The same bytes as a log run (a version byte, then length-prefixed entry
            // records) stored under the index the first record names, or under 1.
            let first = input
                .get(18..26)
                .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")));
            for first in first.into_iter().chain([1]) {
                if let Ok(entries) = codec::decode_run(first, input) {
                    assert!(!entries.is_empty());
                    for (offset, entry) in entries.iter().enumerate() {
                        assert_eq!(entry.index, first + offset as u64);
                    }
                    let again = codec::encode_run(&entries);
                    assert_eq!(codec::decode_run(first, &again).ok(), Some(entries));
                }
            }
        }
        1 => {
            if let Ok(hard_state) = codec::decode_hard_state(body) {
                assert_eq!(codec::encode_hard_state(&hard_state), body);
            }
        }
        2 => {
            if let Ok((index, term)) = codec::decode_index_term(body) {
                assert_eq!(codec::encode_index_term(index, term), body);
            }
        }
        3 => {
            if let Ok(value) = codec::decode_u64(body) {
                assert_eq!(codec::encode_u64(value), body);
            }
        }
        4 => {
            if let Ok(membership) = codec::decode_membership(body) {
                let again = codec::encode_membership(&membership);
                assert_eq!(codec::decode_membership(&again), Ok(membership));
            }
        }
        5 => {
            if let Ok(value) = codec::decode_state_value(body) {
                assert_eq!(codec::encode_state_value(value), body);
            }
        }
        6 => {
            if let Ok(index) = codec::decode_index_key(body) {
                assert_eq!(codec::index_key(index).as_slice(), body);
            }
        }
        _ => {
            let Ok(pairs) = decode_snapshot_data(body) else {
                return;
            };
            let again =
                encode_snapshot_data(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
            assert_eq!(&again[..], body, "snapshot data re-encodes to other bytes");
            if let Ok(sm) = LockStateMachine::from_kv_with_limits(pairs, Limits::default()) {
                let rebuilt = LockStateMachine::from_kv_with_limits(sm.to_kv(), Limits::default())
                    .expect("a state machine's own pairs rebuild it");
                assert!(rebuilt == sm, "rebuilt state machine differs");
            }
        }
    }
}
