//! `lock-node`: one RaftLock cluster member.
//!
//! Settings come from defaults, then `--config FILE` (TOML), then `RAFTLOCK_*` environment
//! variables (e.g. `RAFTLOCK_NODE_ID=2`), then these flags — each layer overriding the previous.
//! Durations are written like `150ms` or `10s`.

use std::process::ExitCode;

fn main() -> ExitCode {
    raftlock::server::cli::lock_node_main(std::env::args_os())
}
