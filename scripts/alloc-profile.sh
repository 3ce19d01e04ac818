#!/usr/bin/env bash
# How many allocations one lock cycle makes on each node, and where: for finding what to cut on
# the request path (the CPU budget, docs/bench/cpu-budget.md, shows what they cost).
#
#   scripts/alloc-profile.sh [cycles] [out-dir]        (default 3000 cycles, target/alloc-profile)
#
# Builds lock-node on the system allocator (feature `system-allocator`: mimalloc bypasses the
# malloc that heaptrack replaces) into target/heap-profile-build, starts three such nodes on
# 127.0.0.1, each recorded by heaptrack's preload library, runs `raftlock-bench cycles` (one SDK
# client, uncontended acquire + release cycles one after the other, on the leader), stops the
# nodes, and prints the leader's and one follower's allocation calls per cycle by call site
# (scripts/heap-sites.py --calls). The counts include the nodes' start, election and idle time, divided
# over the cycles: run enough cycles that these vanish (3,000 makes them well under one per
# cycle). Needs heaptrack (apt-get install heaptrack).
set -euo pipefail
cd "$(dirname "$0")/.."
CYCLES=${1:-3000}
OUT=${2:-target/alloc-profile}
. scripts/heaptrack-build.sh
rm -rf "$OUT" && mkdir -p "$OUT/recordings"
OUT=$(cd "$OUT" && pwd)
cat > "$OUT/lock-node" <<WRAP
#!/bin/sh
exec env LD_PRELOAD="$PRELOAD" DUMP_HEAPTRACK_OUTPUT="$OUT/recordings/node.\$\$.raw" "$(pwd)/$BUILD/release/lock-node" "\$@"
WRAP
chmod +x "$OUT/lock-node"
. scripts/three-nodes.sh
E=$(start_three_nodes "$OUT/lock-node" "$OUT/data")
trap 'kill $(cat "$OUT/data/pids") 2>/dev/null || true' EXIT
sleep 4
# The SDK finds the leader from any member.
target/release/raftlock-bench cycles --endpoint "${E%%,*}" --count "$CYCLES"
kill $(cat "$OUT/data/pids")
for _ in $(seq 50); do
  pgrep -f "$OUT/lock-node|heap-profile-build/release/lock-node" >/dev/null || break
  sleep 0.2
done
# The leader allocated the most, so its recording is the largest.
i=0
for raw in $(ls -S "$OUT"/recordings/*.raw | head -2); do
  i=$((i + 1))
  role=$([ $i -eq 1 ] && echo leader || echo follower)
  "$INTERPRET" < "$raw" | gzip > "$OUT/$role.gz"
  echo "## $role"
  heaptrack_print -f "$OUT/$role.gz" -p 0 -a 1 -T 0 -l 0 -n 100000 -s 100000 2>/dev/null \
    | scripts/heap-sites.py --calls "$CYCLES" --top 30 | tee "$OUT/$role-sites.md"
  echo
done
echo "recordings: $OUT/leader.gz, $OUT/follower.gz (heaptrack_gui or heaptrack_print read them)"
