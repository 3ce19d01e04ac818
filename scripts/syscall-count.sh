#!/usr/bin/env bash
# System calls and CPU per process under a load: a three-node lock-node cluster on 127.0.0.1
# (scripts/three-nodes.sh), `raftlock-bench load` against it for 8 s, and in a 4 s window in the
# middle of it `perf stat` counts each node's and the load generator's system calls by kind
# (tracepoints: needs perf from linux-perf, run as root) while /proc gives their CPU time.
#
#   scripts/syscall-count.sh LOCK_NODE RAFTLOCK_BENCH CLIENTS [more raftlock-bench load args]
#   scripts/syscall-count.sh target/release/lock-node target/release/raftlock-bench 128 --connections 4
#
# Per lock cycle, divide by the cycles in the window (about throughput x 4; a cycle is two
# requests). The node with the most sendto calls is the leader: it writes the answers.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:?lock-node}; BENCH=${2:?raftlock-bench}; CLIENTS=${3:?clients}; shift 3
command -v perf >/dev/null || { echo "needs perf (apt-get install linux-perf)" >&2; exit 2; }
WORK=$(mktemp -d)
. scripts/three-nodes.sh
E=$(start_three_nodes "$BIN" "$WORK/c")
cleanup() { kill $(cat "$WORK/c/pids") 2>/dev/null || true; sleep 1; rm -rf "$WORK"; }
trap cleanup EXIT
sleep 4
EVENTS=raw_syscalls:sys_enter
for k in write writev sendto recvfrom read epoll_wait futex; do EVENTS+=",syscalls:sys_enter_$k"; done
"$BENCH" load --endpoints "$E" --clients "$CLIENTS" --duration 8s "$@" >"$WORK/out" 2>&1 &
LOAD=$!
sleep 3
PIDS="$(cat "$WORK/c/pids") $LOAD"
ticks() { for p in $PIDS; do awk '{printf "%d ", $14 + $15}' "/proc/$p/stat"; done; }
before=$(ticks)
for p in $PIDS; do perf stat -x, -e "$EVENTS" -p "$p" sleep 4 2>"$WORK/perf.$p" & done
sleep 4.2
after=$(ticks)
wait "$LOAD" || true
tail -1 "$WORK/out"
HZ=$(getconf CLK_TCK)
read -r -a b <<<"$before"; read -r -a a <<<"$after"
i=0
for p in $PIDS; do
  if [ "$p" = "$LOAD" ]; then who="load generator"; else who="node $((i + 1))"; fi
  cpu_ms=$(( (a[i] - b[i]) * 1000 / HZ ))
  calls=$(awk -F, '{n = $3; sub(/.*sys_enter_?/, "", n); if (n == "") n = "all"; printf "%s=%s ", n, $1}' "$WORK/perf.$p")
  echo "$who: cpu ${cpu_ms} ms in the window; syscalls: $calls"
  i=$((i + 1))
done
