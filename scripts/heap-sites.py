#!/usr/bin/env python3
"""Live heap memory of one process by allocation site, from a heaptrack recording.

Reads `heaptrack_print --print-leaks` output (what was still allocated when the recording ended)
and adds up the bytes by the first frames of each backtrace in RaftLock or sled (frames whose file the
debug info names `src/...`; sled's frames look the same, their function names tell them apart),
so that the B-tree nodes, strings and boxes of one data structure land on the line that made
them.

Usage: heaptrack_print -f FILE.gz -p 0 -a 0 -T 0 -l 1 -n 100000 -s 100000 | scripts/heap-sites.py [--top 25]

With --calls CYCLES it reads `heaptrack_print --print-allocators` output instead (every backtrace
that allocated, with its number of calls: `-a 1 -l 0`) and prints allocation calls per lock
cycle by site, each labelled with the first library frame that allocated for it
(scripts/alloc-profile.sh).
"""

import argparse
import collections
import re
import sys

UNITS = {"K": 1e3, "M": 1e6, "G": 1e9}
BLOCK = re.compile(r"^\s*([\d.]+)([KMG]?)B? leaked over (\d+) calls from(:?)")
CALLS = re.compile(r"^\s*(\d+) calls (?:to allocation functions )?with .* from(:?)")
CRATE = re.compile(r"/registry/src/[^/]+/([A-Za-z_0-9-]+?)-\d")


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


def library_frame(frames):
    """The first frame of a library (a crate from the registry) before any of RaftLock's or sled's."""
    for function, where in frames:
        if where.startswith("src/"):
            return "-"
        m = CRATE.search(where)
        if m:
            return f"{m.group(1)}: {function}"
    return "-"


def blocks(lines, header, value):
    """(value, frames) of each site block in heaptrack_print output: `header` matches a block's
    first line; `value(match)` reads what it counts (None for the top-level lines without a
    colon, which group the sites by allocator)."""
    current, frames, previous = None, [], None
    for line in lines:
        m = header.match(line)
        if m:
            if current is not None:
                yield current, frames
            current, frames, previous = value(m), [], None
            continue
        text = line.strip()
        if text.startswith("at "):
            if previous:
                frames.append((previous, text[3:]))
        elif text and not text.startswith("in "):
            previous = text
    if current is not None:
        yield current, frames


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--calls", type=float, metavar="CYCLES",
                    help="read --print-allocators output; print allocation calls per cycle")
    args = ap.parse_args()
    if args.calls:
        per_site = collections.Counter()
        for n, frames in blocks(sys.stdin, CALLS, lambda m: int(m.group(1)) if m.group(2) else None):
            per_site[(library_frame(frames), site(frames))] += n
        print(f"{sum(per_site.values()) / args.calls:.1f} allocations per cycle\n")
        print("| per cycle | first library frame | first frames in RaftLock or sled |")
        print("|---:|---|---|")
        for (library, where), n in per_site.most_common(args.top):
            print(f"| {n / args.calls:.1f} | `{library}` | `{where}` |")
        return
    size = collections.Counter()
    calls = collections.Counter()
    leaked = lambda m: (float(m.group(1)) * UNITS.get(m.group(2), 1), int(m.group(3))) if m.group(4) else None
    for (nbytes, n), frames in blocks(sys.stdin, BLOCK, leaked):
        key = site(frames)
        size[key] += nbytes
        calls[key] += n
    total = sum(size.values())
    print(f"{total / 2**20:.1f} MiB live in {sum(calls.values())} allocations\n")
    print("| MiB | allocations | where (first frames in RaftLock or sled) |")
    print("|---:|---:|---|")
    for key, value in size.most_common(args.top):
        print(f"| {value / 2**20:.2f} | {calls[key]} | `{key}` |")


if __name__ == "__main__":
    main()
