//! What a peer can make of this node's Raft core: `RaftMessage`s off a `Peer.Raft` stream,
//! converted as the peer service does (`message_from_pb`), stepped into a live core between
//! ticks, elections and proposals, with every `Ready` handed back at once (`advance`) as a driver
//! whose disk is instant would. The core promises (src/raft/node/step.rs, `Raft::step`) that no
//! message, however stale, duplicated, reordered or malformed, makes it panic.
//!
//! Input: chunks, each a 2-byte little-endian length and that many bytes (the last one takes what
//! is left). A chunk's first byte is the action: 0 ticks (the next byte says how many, up to 31),
//! 1 starts an election, 2 proposes the rest of the chunk as a command, anything else steps the
//! rest of the chunk decoded as a `RaftMessage`, addressed to this node (id 1, in a cluster of
//! voters 1, 2 and 3). Checks: the term, the commit index and the hard state never go back, and
//! committed entries come out in order without gaps.

use super::common::chunks;
use bytes::Bytes;
use prost::Message as _;
use raftlock::raft::{Config, InitialState, Membership, Raft};
use raftlock::server::convert::message_from_pb;
use raftlock::server::proto::peer as pb;

struct Driver {
    raft: Raft,
    term: u64,
    commit: u64,
    applied: u64,
}

impl Driver {
    /// Carries out every `Ready` the core has, checking what it hands out.
    fn drain(&mut self) {
        for _ in 0..16 {
            if !self.raft.has_ready() {
                return;
            }
            let ready = self.raft.ready();
            if let Some(hs) = ready.hard_state {
                assert!(hs.term >= self.term, "term went back: {hs:?}");
                assert!(hs.commit >= self.commit, "commit went back: {hs:?}");
                self.term = hs.term;
                self.commit = hs.commit;
            }
            if let Some(snapshot) = &ready.snapshot {
                self.applied = self.applied.max(snapshot.meta.index);
            }
            for entry in &ready.committed_entries {
                assert_eq!(
                    entry.index,
                    self.applied + 1,
                    "committed entries out of order"
                );
                self.applied = entry.index;
            }
            self.raft.advance(ready);
        }
    }
}

/// One input, as the cargo-fuzz target and the corpus replay test (tests/fuzz_corpus.rs) give it.
pub fn run(data: &[u8]) {
    let cfg = Config::new(1, 7);
    let initial = InitialState {
        initial_membership: Membership::with_voters([1, 2, 3]),
        ..Default::default()
    };
    let raft = Raft::new(cfg, initial).expect("valid config");
    let mut driver = Driver {
        raft,
        term: 0,
        commit: 0,
        applied: 0,
    };
    driver.drain();
    for chunk in chunks(data, 128) {
        let Some((&action, rest)) = chunk.split_first() else {
            continue;
        };
        match action {
            0 => {
                let ticks = rest.first().map_or(1, |n| n % 32);
                for _ in 0..ticks {
                    driver.raft.tick();
                    driver.drain();
                }
            }
            1 => driver.raft.campaign_now(),
            2 => {
                let _ = driver.raft.propose(vec![Bytes::copy_from_slice(rest)]);
            }
            _ => {
                let Ok(raw) = pb::RaftMessage::decode(rest) else {
                    continue;
                };
                let Ok(mut msg) = message_from_pb(raw) else {
                    continue;
                };
                msg.to = 1;
                driver.raft.step(msg);
            }
        }
        driver.drain();
    }
}
