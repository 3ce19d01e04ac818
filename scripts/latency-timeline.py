#!/usr/bin/env python3
"""Reads the lines a `latency-probe` build of lock-node writes (src/server/probe.rs) and prints
the median time of each step of a request, in microseconds since the request reached the
leader's WebSocket connection, as a Markdown table.

    scripts/latency-timeline.py PROBE_FILE

Lines are `L|F <log index> <pid> name=<ns> ...`: L from the node that answered the client, F
from each follower for the append that carried the same log index. Only the first occurrence
of a name in a record counts.
"""
import statistics
import sys
from collections import defaultdict

LEADER_STEPS = [
    ("enqueued", "leader: request handed to the driver queue"),
    ("picked", "leader: driver takes it"),
    ("append", "leader: log append starts (after the early send to the followers)"),
    ("appended", "leader: log append done (sled)"),
    ("flush", "leader: flush starts"),
    ("sent-io", "leader: a peer stream takes the append from its queue"),
    ("flushed", "leader: flush done (its own copy durable)"),
    ("ack-io", "leader: first follower answer covering the entry, read from the network"),
    ("ack", "leader: driver takes that answer"),
    ("replied", "leader: committed and applied, answer handed back"),
    ("answered", "leader: answer at the WebSocket connection"),
]
FOLLOWER_STEPS = [
    ("recv-io", "append read from the network"),
    ("recv", "driver takes the append"),
    ("append", "log append starts"),
    ("appended", "log append done (sled)"),
    ("flush", "flush starts"),
    ("flushed", "flush done"),
    ("ack-sent", "answer handed to the peer stream"),
    ("ack-taken", "the peer stream takes the answer from its queue"),
]


def parse(path):
    leaders, followers = {}, defaultdict(list)
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3 or parts[0] not in ("L", "F"):
                continue
            try:
                key = int(parts[1])
                events = {}
                for item in parts[3:]:
                    name, at = item.split("=", 1)
                    events.setdefault(name, int(at))
            except ValueError:
                continue
            if parts[0] == "L":
                leaders[key] = events
            else:
                followers[key].append(events)
    return leaders, followers


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    leaders, followers = parse(sys.argv[1])
    rows = defaultdict(list)
    for key, ev in leaders.items():
        t0 = ev.get("enqueued")
        if t0 is None:
            continue
        for name, _ in LEADER_STEPS:
            if name in ev:
                rows["L " + name].append((ev[name] - t0) / 1000)
        fs = sorted(
            (f for f in followers.get(key, []) if "ack-sent" in f and f.get("recv-io")),
            key=lambda f: f["ack-sent"],
        )
        for which, f in zip(("first", "second"), fs):
            for name, _ in FOLLOWER_STEPS:
                if name in f:
                    rows[f"{which} {name}"].append((f[name] - t0) / 1000)
    if not rows:
        sys.exit("no complete samples in " + sys.argv[1])
    print(f"{len(leaders)} requests sampled.\n")
    print("| step | median µs | p90 µs | samples |")
    print("|---|---:|---:|---:|")
    steps = [("L " + n, d) for n, d in LEADER_STEPS]
    for which in ("first", "second"):
        steps += [(f"{which} {n}", f"follower answering {which}: {d}") for n, d in FOLLOWER_STEPS]
    ordered = sorted(
        (statistics.median(rows[k]), k, d) for k, d in steps if rows.get(k)
    )
    for median, key, desc in ordered:
        v = sorted(rows[key])
        p90 = v[min(len(v) - 1, len(v) * 9 // 10)]
        print(f"| {desc} | {median:.0f} | {p90:.0f} | {len(v)} |")


if __name__ == "__main__":
    main()
