# Sourced by the scripts that compare builds (compare-builds.sh, sustained-cpu.sh): a three-node
# lock-node cluster on 127.0.0.1 with free ports and the node's defaults.
#
#   E=$(start_three_nodes BINARY DIR)   # data in DIR/n1..n3, logs DIR/n1.log.., pids in DIR/pids
#   "$BENCH" load --endpoints "$E" ...  # E is the three client endpoints, comma-separated

# N distinct free ports, all held open until every one is chosen (the kernel may give a port it
# just gave out, and that was closed again, to the next bind).
free_ports() {
  python3 -c '
import socket, sys
held = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in held: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in held))
for s in held: s.close()' "$1"
}

start_three_nodes() {
  local bin=$1 dir=$2 peers=() clients=() initial="" i
  mkdir -p "$dir"
  local ports
  read -r -a ports <<<"$(free_ports 6)"
  peers=("${ports[@]:0:3}"); clients=("${ports[@]:3:3}")
  for i in 1 2 3; do initial+="${initial:+,}$i=127.0.0.1:${peers[$((i-1))]}"; done
  for i in 1 2 3; do
    "$bin" --node-id "$i" --data-dir "$dir/n$i" --peer-listen "127.0.0.1:${peers[$((i-1))]}" \
      --client-listen "127.0.0.1:${clients[$((i-1))]}" --initial-cluster "$initial" \
      >"$dir/n$i.log" 2>&1 &
    echo $! >>"$dir/pids"
  done
  echo "127.0.0.1:${clients[0]},127.0.0.1:${clients[1]},127.0.0.1:${clients[2]}"
}
