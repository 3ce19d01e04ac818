//! cargo-fuzz target `command_apply`: the body (what it feeds and what it checks) is
//! `raftlock_fuzz::bodies::command_apply` (fuzz/src/bodies/command_apply.rs), which tests/fuzz_corpus.rs also
//! runs on the committed corpus in every `cargo test`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| raftlock_fuzz::bodies::command_apply::run(data));
