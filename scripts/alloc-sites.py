#!/usr/bin/env python3
"""Allocation calls of one process by call site, per lock cycle, from a heaptrack recording.

Reads `heaptrack_print --print-allocators` output (every backtrace that allocated, with its
number of calls) and adds the calls up by the first frames of each backtrace in RaftLock's or
sled's own code (frames whose file the debug info names `src/...`), labelled with the first
library frame below them, so that "serde_json building a tree for ws.rs:171" and "sled's insert
for the hard state" land on lines of their own. Divides by --cycles.

Usage: heaptrack_print -f FILE.gz -p 0 -a 1 -T 0 -l 0 -n 100000 -s 100000 \\
         | scripts/alloc-sites.py --cycles 3000 [--frames 2] [--top 40]
"""

import argparse
import collections
import re
import sys

BLOCK = re.compile(r"^\s*(\d+) calls (?:to allocation functions )?with .* from(:?)")
CRATE = re.compile(r"/registry/src/[^/]+/([A-Za-z_0-9-]+?)-\d")


def site(frames, depth):
    ours, library = [], None
    for function, where in frames:
        if where.startswith("src/"):
            ours.append(f"{function}@{where}")
            if len(ours) == depth:
                break
        elif library is None and not ours:
            m = CRATE.search(where)
            if m:
                library = f"{m.group(1)}: {function}"
    return (library or "-") + " | " + (" <- ".join(ours) if ours else "(no RaftLock or sled frame)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=float, required=True)
    ap.add_argument("--frames", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    calls = collections.Counter()
    current, frames, previous = None, [], None

    def close():
        if current is not None:
            calls[site(frames, args.frames)] += current

    for line in sys.stdin:
        m = BLOCK.match(line)
        if m:
            close()
            # Lines without a colon group the sites by allocator; the sites follow them.
            current = int(m.group(1)) if m.group(2) else None
            frames, previous = [], None
            continue
        text = line.strip()
        if text.startswith("at "):
            if previous:
                frames.append((previous, text[3:]))
        elif text and not text.startswith("in "):
            previous = text
    close()
    total = sum(calls.values())
    print(f"{total / args.cycles:.1f} allocations per cycle\n")
    print("| per cycle | first library frame | first frames in RaftLock or sled |")
    print("|---:|---|---|")
    for key, n in calls.most_common(args.top):
        library, _, ours = key.partition(" | ")
        print(f"| {n / args.cycles:.1f} | `{library}` | `{ours}` |")


if __name__ == "__main__":
    main()
