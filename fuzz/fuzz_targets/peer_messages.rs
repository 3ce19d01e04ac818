//! cargo-fuzz target `peer_messages`: the body (what it feeds and what it checks) is
//! `raftlock_fuzz::bodies::peer_messages` (fuzz/src/bodies/peer_messages.rs), which tests/fuzz_corpus.rs also
//! runs on the committed corpus in every `cargo test`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| raftlock_fuzz::bodies::peer_messages::run(data));
