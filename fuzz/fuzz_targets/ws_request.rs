//! cargo-fuzz target `ws_request`: the body (what it feeds and what it checks) is
//! `raftlock_fuzz::bodies::ws_request` (fuzz/src/bodies/ws_request.rs), which tests/fuzz_corpus.rs also
//! runs on the committed corpus in every `cargo test`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| raftlock_fuzz::bodies::ws_request::run(data));
