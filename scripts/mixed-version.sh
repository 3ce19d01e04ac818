#!/usr/bin/env bash
# A rolling upgrade in small: a three-node cluster on 127.0.0.1 where node 1 runs OLD and nodes
# 2 and 3 run NEW, loaded for a few seconds; then node 1 is killed (SIGKILL) and restarted on
# its data with NEW, and loaded again. Prints each load's result and each node's
# raftlock_peer_streams_opened_total, and fails if a load had errors or, when OLD is a RaftLock
# without plain Raft streams, if the new nodes did not reach node 1 over gRPC before its upgrade
# and over plain streams after it. Then, with every node on NEW (so the cluster raises its
# version), node 1 is rolled back to OLD on its data: the other two must keep serving (the load
# goes to them only) and say that node 1 runs an older RaftLock, whose messages they ignore
# until it runs NEW again; last, node 1 on NEW again, loaded with all three.
#
#   scripts/mixed-version.sh OLD_LOCK_NODE [NEW_LOCK_NODE] [OLD_HAS_PLAIN_STREAMS=no]
#
# e.g. with the release before plain streams built in a worktree:
#   git worktree add /tmp/old d790ad3 && (cd /tmp/old && CARGO_TARGET_DIR=/tmp/old-target cargo build --release --bin lock-node)
#   scripts/mixed-version.sh /tmp/old-target/release/lock-node
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?old lock-node}; NEW=${2:-target/release/lock-node}; OLD_PLAIN=${3:-no}
BENCH=target/release/raftlock-bench
[ -x "$BENCH" ] || cargo build --release --bin raftlock-bench
. scripts/three-nodes.sh
D=$(mktemp -d)
trap 'kill $(cat "$D"/pid* 2>/dev/null) 2>/dev/null || true; sleep 1; rm -rf "$D"' EXIT
read -r -a P <<<"$(free_ports 6)"
INITIAL="1=127.0.0.1:${P[0]},2=127.0.0.1:${P[1]},3=127.0.0.1:${P[2]}"
E="127.0.0.1:${P[3]},127.0.0.1:${P[4]},127.0.0.1:${P[5]}"
start() { # node-id binary
  "$2" --node-id "$1" --data-dir "$D/n$1" --peer-listen "127.0.0.1:${P[$(($1 - 1))]}" \
    --client-listen "127.0.0.1:${P[$(($1 + 2))]}" --initial-cluster "$INITIAL" >>"$D/n$1.log" 2>&1 &
  echo $! >"$D/pid$1"
}
load() {
  local out
  out=$("$BENCH" load --endpoints "$E" --clients 8 --duration 3s 2>&1 | tail -1)
  echo "$out"
  case "$out" in *" errors=0 "*) ;; *) echo "FAIL: the load had errors"; exit 1 ;; esac
}
# Streams node $1 opened to node $2 of kind $3 (0 if none).
opened() {
  curl -s "127.0.0.1:${P[$(($1 + 2))]}/metrics" |
    awk -v want="raftlock_peer_streams_opened_total{kind=\"$3\",peer=\"$2\"}" '$1 == want { print $2; found = 1 } END { if (!found) print 0 }'
}
show() {
  for i in 1 2 3; do
    echo "node $i: $(curl -s "127.0.0.1:${P[$((i + 2))]}/metrics" | grep '^raftlock_peer_streams_opened_total' | tr '\n' ' ')"
  done
}
start 1 "$OLD"; start 2 "$NEW"; start 3 "$NEW"
sleep 4
echo "== node 1 runs $OLD, nodes 2 and 3 run $NEW"
load; show
if [ "$OLD_PLAIN" = no ]; then
  to_old=$(( $(opened 2 1 grpc) + $(opened 3 1 grpc) ))
  [ "$to_old" -gt 0 ] || { echo "FAIL: no gRPC stream from a new node to the old one"; exit 1; }
fi
echo "== node 1 killed and restarted with $NEW"
kill -9 "$(cat "$D/pid1")"; sleep 1
start 1 "$NEW"; sleep 4
load; show
to_new=$(( $(opened 2 1 plain) + $(opened 3 1 plain) ))
[ "$to_new" -gt 0 ] || { echo "FAIL: no plain stream to node 1 after its upgrade"; exit 1; }
version() { curl -s "127.0.0.1:${P[$(($1 + 2))]}/status" | sed -n 's/.*"clusterVersion":\([0-9]*\).*/\1/p'; }
echo "== every node on NEW: cluster version $(version 2)"
echo "== node 1 rolled back to $OLD after the version was raised"
kill -9 "$(cat "$D/pid1")"; sleep 1
start 1 "$OLD"; sleep 4
E="127.0.0.1:${P[4]},127.0.0.1:${P[5]}" load
if ! grep -q "runs an older RaftLock" "$D/n2.log" "$D/n3.log"; then
  echo "note: no node said node 1 runs an older RaftLock (OLD says the cluster's version, or it did not start: see below)"
  tail -3 "$D/n1.log"
fi
echo "== node 1 on $NEW again"
kill -9 "$(cat "$D/pid1")"; sleep 1
start 1 "$NEW"; sleep 4
load
echo "OK"
