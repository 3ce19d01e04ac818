#!/usr/bin/env python3
"""A sustained lock load from clients that send no request ids, as seed 000's clients do.

Each client has its own WebSocket connection to the leader and its own key, and runs acquire
(`"waitTimeout": 0`, no `requestId`) and release (with the fencing token, no `requestId`) in a
loop for the given time. Prints the lock cycles a second, the answers other than success by
code, and the leader's `raftlock_answers_remembered` at the end.

  python3 scripts/idless-load.py --endpoints 127.0.0.1:50051,127.0.0.1:50052,127.0.0.1:50053 \
      [--clients 32] [--seconds 60]

Needs the `websockets` package (pip). Bounded: it stops after --seconds.
"""
import argparse
import asyncio
import collections
import json
import time
import urllib.request

import websockets


def http(addr, path):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as r:
        return r.read().decode()


def find_leader(endpoints):
    deadline = time.time() + 20
    while time.time() < deadline:
        for addr in endpoints:
            try:
                if json.loads(http(addr, "/status")).get("role") == "leader":
                    return addr
            except OSError:
                pass
        time.sleep(0.2)
    raise SystemExit("no leader among " + ",".join(endpoints))


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


async def client(addr, n, stop_at, counts):
    key = f"idless-{n}"
    async with websockets.connect(f"ws://{addr}/ws", max_size=1 << 20) as ws:
        while time.monotonic() < stop_at:
            await ws.send(json.dumps({"commandType": 3, "key": key, "clientId": f"c{n}",
                                      "ttl": 10000, "waitTimeout": 0}))
            got = json.loads(await ws.recv())
            if not got.get("success"):
                counts[got.get("error", {}).get("code", "?")] += 1
                continue
            token = got["fencingToken"]["value"]
            await ws.send(json.dumps({"commandType": 4, "key": key, "clientId": f"c{n}",
                                      "fencingToken": {"key": key, "value": token}}))
            got = json.loads(await ws.recv())
            if got.get("success"):
                counts["cycles"] += 1
            else:
                counts[got.get("error", {}).get("code", "?")] += 1


async def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--endpoints", required=True)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60)
    args = p.parse_args()
    leader = find_leader(args.endpoints.split(","))
    counts = collections.Counter()
    start = time.monotonic()
    stop_at = start + args.seconds
    await asyncio.gather(*(client(leader, n, stop_at, counts) for n in range(args.clients)))
    elapsed = time.monotonic() - start
    text = http(leader, "/metrics")
    status = json.loads(http(leader, "/status"))
    refused = {k: v for k, v in counts.items() if k != "cycles"}
    print(f"clients={args.clients} seconds={elapsed:.1f} cycles={counts['cycles']} "
          f"cycles_per_s={counts['cycles'] / elapsed:.0f} refused={refused} "
          f"answers_remembered={metric(text, 'raftlock_answers_remembered')} "
          f"leader={status.get('id')}")


if __name__ == "__main__":
    asyncio.run(main())
