#!/usr/bin/env bash
# Where a leader's memory goes while it holds many locks: a heap profile by allocation site.
#
#   scripts/heap-profile.sh [locks] [out-dir]        (default 100000 locks, target/heap-profile)
#
# Builds lock-node on the system allocator (feature `system-allocator`; mimalloc bypasses the
# malloc that heaptrack replaces) into target/heap-profile, runs `raftlock-bench scale --only
# locks --locks N` against three such nodes, each recorded by heaptrack's preload library, and
# prints the leader's live memory at the end of the run by allocation site
# (scripts/heap-sites.py). Needs heaptrack (apt-get install heaptrack). The recordings are large
# (about 2 GB per 100,000 locks for the leader) and the nodes run slower than usual: read the
# sites, not the benchmark's timings.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCKS=${1:-100000}
OUT=${2:-target/heap-profile}
. scripts/heaptrack-build.sh
rm -rf "$OUT" && mkdir -p "$OUT/bin" "$OUT/recordings"
OUT=$(cd "$OUT" && pwd)
cp "$BUILD/release/lock-node" "$OUT/bin/lock-node.real"
cp target/release/raftlock-bench "$OUT/bin/raftlock-bench"
# raftlock-bench starts the lock-node beside itself: this one records itself and runs the real one.
cat > "$OUT/bin/lock-node" <<WRAP
#!/bin/sh
exec env LD_PRELOAD="$PRELOAD" DUMP_HEAPTRACK_OUTPUT="$OUT/recordings/node.\$\$.raw" "$OUT/bin/lock-node.real" "\$@"
WRAP
chmod +x "$OUT/bin/lock-node"
"$OUT/bin/raftlock-bench" scale --only locks --locks "$LOCKS" --dir "$OUT/data" --out "$OUT" | tee "$OUT/scale.log"
# The leader allocated the most, so its recording is the largest.
leader=$(ls -S "$OUT"/recordings/*.raw | head -1)
"$INTERPRET" < "$leader" | gzip > "$OUT/leader.gz"
heaptrack_print -f "$OUT/leader.gz" -p 0 -a 0 -T 0 -l 1 -n 100000 -s 100000 2>/dev/null \
  | scripts/heap-sites.py --top 25 | tee "$OUT/leader-sites.md"
echo "the leader's recording: $OUT/leader.gz (heaptrack_gui or heaptrack_print read it)"
