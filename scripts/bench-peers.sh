#!/usr/bin/env bash
# RaftLock beside the lock services a user would pick instead, on this machine, in one run:
# installs what is missing (etcd-server, zookeeper, redis-server, matplotlib), builds
# raftlock-bench with every peer (`--features peers`), and runs `raftlock-bench compare`, which
# starts on 127.0.0.1, with their data under --dir (target/bench-data, removed afterwards):
#   - a three-node RaftLock cluster,
#   - a three-node etcd cluster (etcd's lock API),
#   - a three-node ZooKeeper ensemble (the Curator-style lock recipe; the log fsynced),
#   - two single Redis servers (SET NX PX, compare-and-delete release; one with
#     `appendfsync always`, one with Redis's default persistence),
# runs the same workloads against each in turn, stops them all, and writes docs/bench/results.md,
# results.json and chart.png.
#
#   scripts/bench-peers.sh            # full run: 1, 8, 32, 128, 512 clients, 5 s per run, 2 rounds
#   scripts/bench-peers.sh --quick    # 1 and 32 clients, 2 s per run, 1 round
#   scripts/bench-peers.sh -- --seconds 10   # extra options for `raftlock-bench compare`
#
# scripts/bench-vs-etcd.sh runs this first and then the rest of the long form (five nodes, CPU
# budget, one client's latency, storage, scale, the segments engine).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
command -v etcd >/dev/null || missing+=(etcd-server)
[ -e /usr/share/java/zookeeper.jar ] || missing+=(zookeeper)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v java >/dev/null || missing+=(default-jre-headless)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The Debian packages may start an etcd or Redis service on their default ports; the benchmark
# uses its own free ports and data directories, so a running service does not interfere.

if ! python3 -c 'import matplotlib' 2>/dev/null; then
  echo "== installing matplotlib"
  python3 -m pip install --quiet matplotlib
fi

# etcd-client generates its gRPC code at build time and needs protoc: use one from PATH or the
# copy vendored with our own build dependencies.
if [ -z "${PROTOC:-}" ] && ! command -v protoc >/dev/null; then
  cargo fetch --quiet
  PROTOC="$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -path '*protoc-bin-vendored-linux-x86_64*/bin/protoc' | head -1)"
  export PROTOC
fi

echo "== building"
cargo build --release --features peers --bin raftlock-bench --bin lock-node
BIN="${CARGO_TARGET_DIR:-target}/release"

ARGS=()
if [ "${1:-}" = "--quick" ]; then
  ARGS=(--clients 1,32 --seconds 2 --rounds 1)
  shift
fi
if [ "${1:-}" = "--" ]; then shift; fi

echo "== running"
"$BIN/raftlock-bench" compare --peers etcd,zookeeper,redis-fsync,redis-default "${ARGS[@]}" "$@" --out docs/bench
python3 scripts/plot-bench.py docs/bench/results.json docs/bench/chart.png
echo "== done: docs/bench/results.md, results.json, chart.png"
