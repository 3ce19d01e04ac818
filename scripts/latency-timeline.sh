#!/usr/bin/env bash
# Where one client's lock request goes, step by step, from the nodes' own clocks: builds
# lock-node and raftlock-bench with the `latency-probe` feature (in target/probe, apart from the
# normal build), runs `raftlock-bench latency` (one client on the leader, three nodes on
# 127.0.0.1) and prints, for the requests sampled, the median time of each step since the
# request reached the leader's connection — on the leader and on the two followers, the one
# that answered first and the other.
#
#   scripts/latency-timeline.sh [seconds] [raftlock-bench latency options]
#   scripts/latency-timeline.sh 10 --raft-log-engine segments
# (default 10 s; the build takes a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_RUN=${1:-10}
shift || true
export CARGO_TARGET_DIR=target/probe
cargo build --release --quiet --features latency-probe --bin lock-node --bin raftlock-bench
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
RAFTLOCK_PROBE_FILE="$OUT/probe.log" target/probe/release/raftlock-bench latency \
  --seconds "$SECONDS_RUN" --dir "$OUT/data" "$@" | grep -E "cycles, errors|one cycle|Floor" || true
python3 scripts/latency-timeline.py "$OUT/probe.log"
