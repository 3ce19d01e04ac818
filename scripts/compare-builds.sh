#!/usr/bin/env bash
# Two builds of lock-node side by side on this machine: a three-node cluster of each on
# 127.0.0.1, the same raftlock-bench load against each in alternation (A B A B ...), so that
# whatever else the machine does falls on both. For "did this change make it faster?".
#
#   scripts/compare-builds.sh OLD_LOCK_NODE NEW_LOCK_NODE [clients] [workload] [rounds]
#
# e.g. build the old commit in a worktree first:
#   git worktree add /tmp/old <commit> && (cd /tmp/old && CARGO_TARGET_DIR=/tmp/old-target cargo build --release --bin lock-node)
#   scripts/compare-builds.sh /tmp/old-target/release/lock-node target/release/lock-node 8 contended 3
#
# Optional, from the environment: LOAD_ARGS, more arguments for every `raftlock-bench load`
# (e.g. LOAD_ARGS="--connections 4" for many clients multiplexed on a few connections), and
# OLD_BENCH, a raftlock-bench to drive the old build's cluster with (for a change in the SDK:
# each side is then loaded by its own build's client; target/release/raftlock-bench drives the
# new one).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?old lock-node}; NEW=${2:?new lock-node}
CLIENTS=${3:-1}; WORKLOAD=${4:-uncontended}; ROUNDS=${5:-3}
BENCH=target/release/raftlock-bench
[ -x "$BENCH" ] || cargo build --release --bin raftlock-bench
WORK=$(mktemp -d)
. scripts/three-nodes.sh
cleanup() {
  kill $(cat "$WORK"/*/pids 2>/dev/null) 2>/dev/null || true
  sleep 1; rm -rf "$WORK"
}
trap cleanup EXIT
A=$(start_three_nodes "$OLD" "$WORK/old"); B=$(start_three_nodes "$NEW" "$WORK/new")
sleep 5
# Each round alternates which build goes first, so that neither always runs right after the
# other's load. Which cluster is started first also matters (by up to half, either way, on the
# 2-CPU VM): run the script a second time with OLD and NEW swapped and compare both.
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    if [ $side = old ]; then E=$A; RUN=${OLD_BENCH:-$BENCH}; else E=$B; RUN=$BENCH; fi
    printf '%s round %s: ' "$side" "$r"
    # shellcheck disable=SC2086 # LOAD_ARGS is a list of arguments
    "$RUN" load --endpoints "$E" --clients "$CLIENTS" --workload "$WORKLOAD" --duration 5s ${LOAD_ARGS:-} 2>&1 \
      | grep -v hand-off | tail -1
  done
done
