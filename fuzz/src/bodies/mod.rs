//! The bodies of the fuzz targets: for each, what an input is fed to and what is checked. Two
//! drivers share them: the cargo-fuzz targets in fuzz/fuzz_targets/ (coverage-guided, the long
//! form: `scripts/fuzz.sh 600`), and tests/fuzz_corpus.rs, which replays the committed corpus in
//! fuzz/corpus/<target>/ and deterministic mutations of it in every `cargo test`. This file is
//! compiled into both, so it names the crate only as `raftlock` and its siblings as `super::`.

pub mod command_apply;
pub mod common;
pub mod grpc_messages;
pub mod peer_messages;
pub mod raft_step;
pub mod storage_codec;
pub mod ws_request;
