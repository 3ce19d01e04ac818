//! cargo-fuzz target `raft_step`: the body (what it feeds and what it checks) is
//! `raftlock_fuzz::bodies::raft_step` (fuzz/src/bodies/raft_step.rs), which tests/fuzz_corpus.rs also
//! runs on the committed corpus in every `cargo test`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| raftlock_fuzz::bodies::raft_step::run(data));
