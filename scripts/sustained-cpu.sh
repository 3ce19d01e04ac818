#!/usr/bin/env bash
# Two builds of lock-node under the same sustained load, one after the other (A B B A ...): for
# each run, the acquires and their latency (raftlock-bench load), the CPU time the three nodes
# used (user + kernel, from /proc) and per acquire, each node's RSS at the end and its peak,
# and how many snapshots were encoded and log compactions done (from the nodes' logs; builds
# before 2026-11-27 log every snapshot as "snapshot taken", since then "snapshot encoded").
# For "does this change cost less CPU or memory under load?"; compare-builds.sh is for
# throughput and latency in short runs.
#
#   scripts/sustained-cpu.sh OLD_LOCK_NODE NEW_LOCK_NODE [seconds 60] [clients 128] [rounds 2]
#
# OLD_LOAD_ARGS / NEW_LOAD_ARGS (environment) add arguments to each side's `raftlock-bench load`:
# `NEW_LOAD_ARGS=--acknowledge` with one build on both sides compares clients that acknowledge
# their answers with clients that do not.
#
# Each node runs with its defaults (as `lockctl up` starts them), so the exactly-once table's
# pacing applies as it does for users.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?old lock-node}; NEW=${2:?new lock-node}
SECS=${3:-60}; CLIENTS=${4:-128}; ROUNDS=${5:-2}
BENCH=target/release/raftlock-bench
[ -x "$BENCH" ] || cargo build --release --bin raftlock-bench
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  if [ ${#PIDS[@]} -gt 0 ]; then kill -9 "${PIDS[@]}" 2>/dev/null || true; fi
  sleep 1; rm -rf "$WORK"
}
trap cleanup EXIT
TICK=$(getconf CLK_TCK)
. scripts/three-nodes.sh
cpu_ticks() { local t=0 p; for p in "${PIDS[@]}"; do t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat"))); done; echo "$t"; }
mib() { local out="" p; for p in "${PIDS[@]}"; do out+="$(awk -v k="$1:" '$1==k{printf "%d ", $2/1024}' "/proc/$p/status")"; done; echo "${out% }"; }

run() { # name binary [extra load arguments]
  local name=$1 bin=$2 extra=${3:-} dir="$WORK/$1" endpoints before load
  endpoints=$(start_three_nodes "$bin" "$dir")
  mapfile -t PIDS <"$dir/pids"
  sleep 4
  before=$(cpu_ticks)
  load=$("$BENCH" load --endpoints "$endpoints" --clients "$CLIENTS" --workload uncontended \
    --duration "${SECS}s" $extra 2>&1 | grep -v hand-off | tail -1)
  local after rss peak
  after=$(cpu_ticks)
  rss=$(mib VmRSS); peak=$(mib VmHWM)
  kill -9 "${PIDS[@]}" 2>/dev/null || true
  PIDS=()
  local grants encoded compacted
  grants=$(sed -n 's/.*grants=\([0-9]*\).*/\1/p' <<<"$load")
  encoded=$(cat "$dir"/n*.log | grep -c 'snapshot taken\|snapshot encoded' || true)
  compacted=$(cat "$dir"/n*.log | grep -c 'log compacted to' || true)
  echo "$name: $load"
  python3 - "$name" "$before" "$after" "$TICK" "${grants:-0}" "$rss" "$peak" "$encoded" "$compacted" <<'PY'
import sys
name, before, after, tick, grants, rss, peak, encoded, compacted = sys.argv[1:]
cpu = (int(after) - int(before)) / int(tick)
per = cpu / int(grants) * 1e6 if int(grants) else float("nan")
print(f"{name}: cpu {cpu:.1f} s for the three nodes, {per:.0f} us per acquire; "
      f"RSS MiB [{rss}], peak [{peak}]; snapshots encoded {encoded}, log compactions {compacted}")
PY
  sleep 1; rm -rf "$dir"
}

for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    if [ "$side" = old ]; then run "old-round$r" "$OLD" "${OLD_LOAD_ARGS:-}"
    else run "new-round$r" "$NEW" "${NEW_LOAD_ARGS:-}"; fi
  done
done
