#!/usr/bin/env python3
"""Live heap memory of one process by allocation site, from a heaptrack recording.

Reads `heaptrack_print --print-leaks` output (what was still allocated when the recording ended)
and adds up the bytes by the first frames of each backtrace in RaftLock or sled (frames whose file the
debug info names `src/...`; sled's frames look the same, their function names tell them apart),
so that the B-tree nodes, strings and boxes of one data structure land on the line that made
them.

Usage: heaptrack_print -f FILE.gz -p 0 -a 0 -T 0 -l 1 -n 100000 -s 100000 | scripts/heap-sites.py [--top 25]
"""

import argparse
import collections
import re
import sys

UNITS = {"K": 1e3, "M": 1e6, "G": 1e9}
BLOCK = re.compile(r"^\s*([\d.]+)([KMG]?)B? leaked over (\d+) calls from(:?)")


def site(frames):
    """The first three frames in RaftLock (`src/...`) or sled, as `function@file:line`."""
    ours = []
    for function, where in frames:
        if where.startswith("src/") or "/sled-0." in where:
            where = "sled:" + where.split("/src/")[-1] if "/sled-0." in where else where
            ours.append(f"{function}@{where}")
        if len(ours) == 3:
            break
    return " <- ".join(ours) if ours else "(not RaftLock's or sled's code)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    size = collections.Counter()
    calls = collections.Counter()
    current, frames, previous = None, [], None

    def close():
        if current is not None:
            key = site(frames)
            size[key] += current[0]
            calls[key] += current[1]

    for line in sys.stdin:
        m = BLOCK.match(line)
        if m:
            close()
            # Top-level lines (no colon) group sites by allocator; the sites follow them.
            current = (float(m.group(1)) * UNITS.get(m.group(2), 1), int(m.group(3))) if m.group(4) else None
            frames, previous = [], None
            continue
        text = line.strip()
        if text.startswith("at "):
            if previous:
                frames.append((previous, text[3:]))
        elif text and not text.startswith("in "):
            previous = text
    close()
    total = sum(size.values())
    print(f"{total / 2**20:.1f} MiB live in {sum(calls.values())} allocations\n")
    print("| MiB | allocations | where (first frames in RaftLock or sled) |")
    print("|---:|---:|---|")
    for key, value in size.most_common(args.top):
        print(f"| {value / 2**20:.2f} | {calls[key]} | `{key}` |")


if __name__ == "__main__":
    main()
