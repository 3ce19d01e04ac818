//! `lock-node`: one RaftLock cluster member.
//!
//! Settings come from defaults, then `--config FILE` (TOML), then `RAFTLOCK_*` environment
//! variables (e.g. `RAFTLOCK_NODE_ID=2`), then these flags — each layer overriding the previous.
//! Durations are written like `150ms` or `10s`.

use std::process::ExitCode;

/// mimalloc instead of the system allocator: the request path allocates (messages, log entries,
/// replies), and with mimalloc allocation costs 40% fewer instructions per lock cycle than with
/// glibc's malloc, about 11% of the whole (`scripts/cpu-budget.py`, docs/bench/cpu-budget.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    raftlock::server::cli::lock_node_main(std::env::args_os())
}
