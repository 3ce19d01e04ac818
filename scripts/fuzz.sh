#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of everything a client or a peer can send:
#
#   ws_request     a WebSocket text frame -> the request parser (src/server/ws/parse.rs parse_text)
#   grpc_messages  a gRPC body -> raftlock.lock.v1 and seed 004 api.LockService requests
#   peer_messages  Raft stream messages -> the core's Message (src/server/convert.rs), forwarded
#                  client operations and replies (JSON), membership and data RPC bodies, and the
#                  bytes of a peer connection read as a plain Raft stream (src/server/peer_stream.rs)
#   command_apply  log entries -> Command::decode -> sequences applied to a LockStateMachine
#   storage_codec  records read back from disk and snapshot data (src/storage/codec.rs), snapshot
#                  data rebuilt into a LockStateMachine
#   raft_step      Raft stream messages stepped into a live Raft core (follower, candidate,
#                  leader) between ticks, elections and proposals
#
# Usage:
#   scripts/fuzz.sh                 # 20 s per target: a smoke run, 2 min plus the build
#   scripts/fuzz.sh 600             # the long form: 10 min per target
#   FUZZ_TARGETS="command_apply" scripts/fuzz.sh 3600   # one target for an hour
#
# Environment:
#   FUZZ_TARGETS    targets to run (default: all six, in the order above)
#   FUZZ_MAX_LEN    largest input libFuzzer makes, in bytes (default 4096)
#   FUZZ_SANITIZER  none (default) or address; see "Stable Rust" below
#
# Prints one line per target (runs executed, runs per second, new corpus entries) and exits
# non-zero if any target crashed, timed out or ran out of memory. A crash leaves its input under
# fuzz/artifacts/<target>/; replay it with
#   cd fuzz && cargo fuzz run --sanitizer none <target> artifacts/<target>/crash-<hash>
# and turn it into a unit test beside the code that panicked (bytes inline).
#
# The seed corpora in fuzz/corpus/<target>/ are committed and never written to: each run grows
# its own working corpus in fuzz/target/corpus-work/<target>/ (ignored by git, kept between runs,
# so repeated runs start where the last one stopped; delete that directory to start over, or
# shrink it with `cargo fuzz cmin --sanitizer none <target> target/corpus-work/<target>`).
# fuzz/examples/gen_corpus.rs wrote the seeds (`cd fuzz && cargo run --release --example
# gen_corpus` rewrites them).
#
# Stable Rust. cargo fuzz defaults to AddressSanitizer, which it turns on with `-Zsanitizer`, a
# nightly-only flag; the project builds with stable only. With `--sanitizer none` every flag
# cargo fuzz passes to rustc is a stable `-C` flag (`-Cpasses=sancov-module` and the
# `-Cllvm-args=-sanitizer-coverage-*` options for libFuzzer's coverage feedback, `--cfg
# fuzzing`, `-Cdebug-assertions`, which also turns on overflow checks), so it builds on stable
# as it is, no RUSTC_BOOTSTRAP needed. Losing AddressSanitizer costs little here: RaftLock is
# `#![forbid(unsafe_code)]`, so it guards only the unsafe code inside dependencies (prost,
# serde_json, postcard, bytes); panics, overflows, failed assertions, timeouts and runaway
# memory are caught either way. FUZZ_SANITIZER=address builds with AddressSanitizer by setting
# RUSTC_BOOTSTRAP=1, which lets a stable rustc accept `-Zsanitizer=address` (a switch meant for
# building the compiler itself; it works with the sanitizer runtime the stable toolchain ships),
# into its own target directory (fuzz/target/asan) so the two builds do not evict each other.
#
# Cost on a 2-core machine: the first build takes about 6 min (10 min with AddressSanitizer,
# which also runs 5-10 times fewer inputs per second); later builds only what changed.
set -euo pipefail

seconds=${1:-20}
if ! [[ $seconds =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET]   (a positive whole number; default 20)" >&2
  exit 2
fi
max_len=${FUZZ_MAX_LEN:-4096}
targets=${FUZZ_TARGETS:-ws_request grpc_messages peer_messages command_apply storage_codec raft_step}
sanitizer=${FUZZ_SANITIZER:-none}

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

# Release optimizations with debug assertions and overflow checks (cargo fuzz's default build).
build_args=(--sanitizer "$sanitizer")
case $sanitizer in
  none) ;;
  address)
    export RUSTC_BOOTSTRAP=1
    build_args+=(--target-dir target/asan)
    ;;
  *)
    echo "FUZZ_SANITIZER must be none or address, not $sanitizer" >&2
    exit 2
    ;;
esac

echo "== building the fuzz targets (sanitizer: $sanitizer)"
start=$(date +%s)
cargo fuzz build "${build_args[@]}"
echo "== built in $(($(date +%s) - start)) s; fuzzing each target for ${seconds} s (max_len $max_len)"

mkdir -p target/fuzz-logs
failed=()
summary=()
for target in $targets; do
  if [ ! -f "fuzz_targets/$target.rs" ]; then
    echo "unknown fuzz target $target" >&2
    exit 2
  fi
  work="target/corpus-work/$target"
  log="target/fuzz-logs/$target.log"
  mkdir -p "$work" "corpus/$target"
  status=0
  # New inputs go to the first corpus directory only: the committed seeds stay as they are.
  cargo fuzz run "${build_args[@]}" "$target" "$work" "corpus/$target" -- \
    -max_total_time="$seconds" -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 >"$log" 2>&1 || status=$?
  stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -1; }
  runs=$(stat number_of_executed_units)
  per_sec=$(stat average_exec_per_sec)
  added=$(stat new_units_added)
  if [ "$status" -eq 0 ]; then
    verdict=ok
  else
    verdict="FAILED (exit $status)"
    failed+=("$target")
  fi
  line=$(printf '%-14s %-16s runs %-10s %-7s runs/s  new corpus entries %s' \
    "$target" "$verdict" "${runs:-?}" "${per_sec:-?}" "${added:-?}")
  summary+=("$line")
  echo "$line"
  if [ "$status" -ne 0 ]; then
    grep -E 'panicked at|^==[0-9]+== ERROR|SUMMARY|Test unit written to|Running:' "$log" \
      | head -8 | sed 's/^/    /' || true
    echo "    full log: fuzz/$log"
  fi
done

echo "== summary"
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzzing found problems in: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
  exit 1
fi
echo "no crashes"
