#!/usr/bin/env bash
# expect-members.sh N [POD]: waits (up to 3 minutes) until the RaftLock cluster reports exactly
# node ids 1..N, all voters, with a known leader, as seen by `lockctl members list` in POD
# (default raftlock-0).
set -euo pipefail
want="$1"
pod="${2:-raftlock-0}"
expected="$(seq 1 "$want" | paste -sd, -)"
out=""
for _ in $(seq 1 36); do
  if out="$(kubectl exec "$pod" -- lockctl --output json members list 2>&1)"; then
    ids="$(jq -r '[.members[].id] | sort | map(tostring) | join(",")' <<<"$out")"
    voters="$(jq '[.members[] | select(.voter)] | length' <<<"$out")"
    leader="$(jq '.leaderId' <<<"$out")"
    if [ "$ids" = "$expected" ] && [ "$voters" = "$want" ] && [ "$leader" != 0 ]; then
      echo "ok: members $ids, all voters, leader $leader"
      kubectl exec "$pod" -- lockctl members list
      exit 0
    fi
    echo "waiting: members [$ids], $voters voters, leader $leader (want 1..$want, all voters)"
  else
    echo "waiting: $out"
  fi
  sleep 5
done
echo "FAIL: membership did not become 1..$want voters; last answer: $out"
exit 1
