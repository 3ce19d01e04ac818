#!/usr/bin/env python3
"""When do slow acquires happen? Reads the CSV of `raftlock-bench load --timeline FILE`
(in a contended run: hand-offs, timed from the previous holder's release).

    raftlock-bench load --clients 32 --duration 10s --timeline /tmp/t.csv
    scripts/load-timeline.py /tmp/t.csv [--slow-ms X] [--periods 100,500]

Prints the latency percentiles, the stretches in which no acquire completed for longer than
--gap-ms (the whole cluster stalled, not one client), and for each period P the share of slow
acquires by phase (time of sending modulo P, in 20 slots): a node's periodic task shows as one
slot far above the rest, load that is merely high as a flat row.
"""
import argparse
import csv
import math
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--slow-ms", type=float, help="slow above this (default: 0.7 x p99)")
    ap.add_argument("--gap-ms", type=float, default=4.0)
    ap.add_argument("--periods", default="20,50,100,250,500,1000")
    a = ap.parse_args()
    rows = []
    what = "acquires"
    with open(a.csv, newline="") as f:
        reader = csv.DictReader(f)
        if "handoff_ms" in (reader.fieldnames or []):
            what = "hand-offs"
        for r in reader:
            # A contended run's timeline holds hand-offs (release sent, next grant) instead.
            rows.append((float(r["sent_ms"]), float(r.get("acquire_ms") or r["handoff_ms"])))
    if not rows:
        print(f"no {what} in", a.csv, file=sys.stderr)
        return 1
    lat = sorted(l for _, l in rows)
    q = lambda p: lat[min(len(lat) - 1, int(len(lat) * p))]
    slow_ms = a.slow_ms if a.slow_ms is not None else 0.7 * q(0.99)
    span = max(s for s, _ in rows) - min(s for s, _ in rows)
    print(f"{len(rows)} {what} over {span / 1000:.1f} s: p50 {q(0.5):.2f} ms, p99 {q(0.99):.2f} ms, "
          f"p99.9 {q(0.999):.2f} ms; slow: above {slow_ms:.2f} ms "
          f"({sum(l > slow_ms for l in lat)} {what})")

    ends = sorted(s + l for s, l in rows)
    gaps = [(ends[i - 1], ends[i] - ends[i - 1]) for i in range(1, len(ends))
            if ends[i] - ends[i - 1] > a.gap_ms]
    stalled = sum(g for _, g in gaps)
    print(f"\nno {what[:-1]} completed for more than {a.gap_ms:g} ms: {len(gaps)} times, "
          f"{stalled:.0f} ms in all ({100 * stalled / max(span, 1):.1f}% of the run); longest:")
    for at, g in sorted(gaps, key=lambda x: -x[1])[:8]:
        print(f"  at {at / 1000:8.3f} s: {g:.1f} ms")

    slots = 20
    print(f"\nshare of {what} that were slow, by phase of the sending time (20 slots per period):")
    for period in [float(p) for p in a.periods.split(",") if p]:
        total, slow = [0] * slots, [0] * slots
        for s, l in rows:
            b = int((s % period) / period * slots)
            total[b] += 1
            slow[b] += l > slow_ms
        shares = [100 * slow[i] / max(1, total[i]) for i in range(slots)]
        mean = sum(slow) * 100 / max(1, sum(total))
        peak = max(range(slots), key=lambda i: shares[i])
        print(f"  {period:6g} ms: " + " ".join(f"{v:3.0f}" for v in shares)
              + f"   (mean {mean:.1f}%, peak {shares[peak]:.0f}% at {peak * period / slots:g}"
              f"–{(peak + 1) * period / slots:g} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
