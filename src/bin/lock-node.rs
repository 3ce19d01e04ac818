//! `lock-node`: one RaftLock cluster member.
//!
//! Settings come from defaults, then `--config FILE` (TOML), then `RAFTLOCK_*` environment
//! variables (e.g. `RAFTLOCK_NODE_ID=2`), then these flags — each layer overriding the previous.
//! Durations are written like `150ms` or `10s`.

use std::process::ExitCode;

/// mimalloc instead of the system allocator: the request path allocates (messages, log entries,
/// replies), and with mimalloc allocation costs 40% fewer instructions per lock cycle than with
/// glibc's malloc, about 11% of the whole (`scripts/cpu-budget.py`, docs/bench/cpu-budget.md).
/// (Left out with the `system-allocator` feature, for heap profiles: scripts/heap-profile.sh.)
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    raftlock::server::cli::lock_node_main(std::env::args_os())
}

/// Turns transparent huge pages off for this process. mimalloc asks the kernel for huge pages
/// (`MADV_HUGEPAGE`), and sled allocates a fresh 8 MiB log buffer every time a flush seals one:
/// with huge pages, the first byte written to each buffer made the kernel zero a whole 2 MiB
/// page, on the thread that flushes. That was 7% of the machine's CPU time at 32 clients, and
/// with 4 KiB pages it is gone (docs/bench/cpu-budget.md, "Later steps"). A kernel that does not
/// know the setting leaves things as they were.
fn disable_transparent_huge_pages() {
    if let Err(err) = nix::sys::prctl::set_thp_disable(true) {
        eprintln!("lock-node: cannot turn transparent huge pages off ({err}); running with them");
    }
}
