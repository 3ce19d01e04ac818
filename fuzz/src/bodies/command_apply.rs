//! Log entries as the lock state machine sees them: bytes that reach `Command::decode` from
//! peers (replicated entries) and from disk, and the sequences of commands `apply` is then given.
//!
//! Input: one flag byte, then commands, each a 2-byte little-endian length and that many bytes
//! (the last one takes what is left if the length runs past the end). Flag bit 0 starts the
//! state machine with small limits, so bounds and evictions are reached quickly (a `SetLimits`
//! command in the input can change them either way). Entry `i` is applied at log index
//! `i + 1`: indexes grow monotonically; time only advances through `Tick` commands, as in the log.
//!
//! Never panics, and after the sequence:
//! - every command that decodes re-encodes to the same bytes' meaning (decode ∘ encode = id);
//! - the fencing sequence never went down and the applied index is the last index;
//! - the cached counters match the state (`locks_held`, `waiter_count`);
//! - the writes `take_changes` reported, replayed into a map, rebuild (`from_kv_with_limits`)
//!   the same state — what a restarted node reads back is what it had;
//! - `restore(snapshot())` equals the state, and a twin restored from a snapshot taken half-way
//!   and given the rest of the commands answers every one the same and ends in the same state.

use std::collections::BTreeMap;

use super::common::{chunks, small_limits};
use raftlock::lock::{Command, Limits, LockStateMachine};

fn check_counters(sm: &LockStateMachine) {
    assert_eq!(sm.locks_held(), sm.held_locks().len(), "locks_held counter");
    assert_eq!(sm.waiter_count(), sm.waiters().len(), "waiter counter");
}

/// One input, as the cargo-fuzz target and the corpus replay test (tests/fuzz_corpus.rs) give it.
pub fn run(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let limits = if flags & 1 == 1 {
        small_limits()
    } else {
        Limits::default()
    };
    let commands: Vec<Command> = chunks(rest, 64)
        .into_iter()
        .filter_map(|bytes| Command::decode(bytes).ok())
        .collect();
    for command in &commands {
        assert_eq!(Command::decode(&command.encode()).as_ref(), Ok(command));
    }
    if commands.is_empty() {
        return;
    }

    let mut sm = LockStateMachine::new(limits.clone());
    let mut persisted: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let half = commands.len() / 2;
    let mut twin: Option<LockStateMachine> = None;
    let mut last_seq = 0;
    for (i, command) in commands.iter().enumerate() {
        if i == half {
            let restored =
                LockStateMachine::restore(&sm.snapshot(), limits.clone()).expect("own snapshot");
            assert!(restored == sm, "restored snapshot differs");
            twin = Some(restored);
        }
        let index = i as u64 + 1;
        let applied = sm.apply(index, command);
        assert_eq!(applied.index, index);
        if let Some(twin) = twin.as_mut() {
            let again = twin.apply(index, command);
            assert_eq!(
                again, applied,
                "a restored state machine answered {command:?} differently"
            );
        }
        for (key, value) in sm.take_changes() {
            match value {
                Some(value) => persisted.insert(key, value),
                None => persisted.remove(&key),
            };
        }
        assert!(
            sm.fencing_sequence() >= last_seq,
            "fencing sequence went down"
        );
        last_seq = sm.fencing_sequence();
        check_counters(&sm);
    }
    assert_eq!(sm.applied_index(), commands.len() as u64);
    // Keys at their zero value (`meta/seq` before any grant) may be missing from the writes, so
    // compare the state they rebuild, as a restarting node does.
    let reread = LockStateMachine::from_kv_with_limits(persisted, limits.clone())
        .expect("persisted changes rebuild a state machine");
    assert!(reread == sm, "persisted changes rebuild another state");
    let restored = LockStateMachine::restore(&sm.snapshot(), limits).expect("own snapshot");
    assert!(restored == sm, "restored snapshot differs");
    check_counters(&restored);
    let twin = twin.expect("twin made half-way");
    assert!(twin == sm, "the twin ended in another state");
}
