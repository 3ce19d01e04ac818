//! cargo-fuzz target `storage_codec`: the body (what it feeds and what it checks) is
//! `raftlock_fuzz::bodies::storage_codec` (fuzz/src/bodies/storage_codec.rs), which tests/fuzz_corpus.rs also
//! runs on the committed corpus in every `cargo test`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| raftlock_fuzz::bodies::storage_codec::run(data));
