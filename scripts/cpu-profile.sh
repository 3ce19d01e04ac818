#!/usr/bin/env bash
# Where the machine's CPU goes under load, user and kernel together: a three-node cluster of
# one lock-node build on 127.0.0.1, `raftlock-bench load` against it, and `perf record` of every
# CPU (software clock, so it works in VMs without hardware counters) during the middle of the
# run. Prints the share of all samples by process (leader, followers, load generator, idle,
# other) and thread group, the lock cycles a second, and CPU µs per cycle for each.
#
#   scripts/cpu-profile.sh [clients] [seconds] [lock-node binary] [extra lock-node env, e.g. RAFTLOCK_RAFT_LOG_ENGINE=segments]
#   scripts/cpu-profile.sh 32 12 target/release/lock-node RAFTLOCK_RAFT_LOG_ENGINE=segments
#
# Needs perf (Debian's linux-perf; installed if missing) and permission to record every CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
CLIENTS=${1:-32}; SECS=${2:-12}; BIN=${3:-target/release/lock-node}; shift 3 2>/dev/null || shift $#
BENCH=target/release/raftlock-bench
[ -x "$BENCH" ] || cargo build --release --bin raftlock-bench
[ -x "$BIN" ] || cargo build --release --bin lock-node
command -v perf >/dev/null || { apt-get update -qq && apt-get install -y -qq linux-perf >/dev/null; }
WORK=$(mktemp -d)
. scripts/three-nodes.sh
cleanup() { kill $(cat "$WORK"/pids 2>/dev/null) 2>/dev/null || true; sleep 1; rm -rf "$WORK"; }
trap cleanup EXIT
WRAP="$WORK/lock-node"
{ echo '#!/bin/sh'; [ $# -gt 0 ] && printf 'export %s\n' "$@"; echo "RAFTLOCK_MAX_ANSWERS=\${RAFTLOCK_MAX_ANSWERS:-2000000} exec $(realpath "$BIN") \"\$@\""; } >"$WRAP"
chmod +x "$WRAP"
E=$(start_three_nodes "$WRAP" "$WORK/c")
cp "$WORK/c/pids" "$WORK/pids"
sleep 4
"$BENCH" load --endpoints "$E" --clients "$CLIENTS" --workload uncontended --duration "${SECS}s" \
  >"$WORK/load.txt" 2>&1 &
LOAD=$!
# Record the middle of the run: from a quarter in, for half of it.
sleep $((SECS / 4))
perf record -q -e cpu-clock -F 999 -a -o "$WORK/perf.data" -- sleep $((SECS / 2)) >/dev/null 2>&1
wait $LOAD
tail -1 "$WORK/load.txt"
LEADER_PID=""
i=1
for pid in $(cat "$WORK/c/pids"); do
  if grep -q "became leader" "$WORK/c/n$i.log"; then LEADER_PID=$pid; fi
  i=$((i + 1))
done
perf script -i "$WORK/perf.data" -F pid,tid,comm 2>/dev/null >"$WORK/samples.txt"
python3 - "$WORK/samples.txt" "$WORK/load.txt" "$LEADER_PID" "$LOAD" "$(cat "$WORK/c/pids" | tr '\n' ' ')" "$((SECS / 2))" <<'EOF'
import collections, re, sys
samples, load, leader, bench, nodes, window = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(), float(sys.argv[6])
m = re.search(r"throughput=(\d+)/s", open(load).read())
rate = int(m.group(1)) if m else 0
count = collections.Counter()
total = 0
for line in open(samples):
    parts = line.split()
    if len(parts) < 2:
        continue
    comm, ids = " ".join(parts[:-1]), parts[-1]
    pid = ids.split("/")[0]
    total += 1
    if pid == "0":
        who = "idle"
    elif pid == leader:
        who = "leader"
    elif pid in nodes:
        who = "follower %d" % (nodes.index(pid) + 1)
    elif pid == bench:
        who = "load generator"
    else:
        who = "other processes"
    if who in ("idle", "other processes"):
        group = ""
    elif comm.startswith("raftlock-driver"):
        group = "driver thread"
    elif comm.startswith("tokio-rt-worker"):
        group = "I/O runtime" if who != "load generator" else "SDK clients' runtime"
    elif comm.startswith("sled"):
        group = "sled's threads"
    else:
        group = "other threads"
    count[(who, group)] += 1
if not total:
    sys.exit("no samples: is perf allowed to record every CPU here?")
print(f"\n{total} samples over {window:.0f} s on every CPU; {rate} lock cycles a second\n")
print("| process | threads | share of all CPU | CPU µs per lock cycle |")
print("|---|---|---:|---:|")
cpus = total / (window * 999)  # CPUs sampled (about the machine's count)
for (who, group), n in sorted(count.items(), key=lambda kv: -kv[1]):
    per_cycle = (n / total) * cpus * 1e6 / rate if rate else 0
    print(f"| {who} | {group} | {100 * n / total:.1f}% | {per_cycle:.0f} |")
EOF
