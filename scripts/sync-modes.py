#!/usr/bin/env python3
"""How fast this machine's disk makes a small log write durable, by the ways a log can do it.

Each mode appends (or writes in place) a 300-byte record, the size of a small batch of lock
commands, and makes it durable before the next; the time of each write-and-sync and the
process's CPU time (user + kernel) per write are reported. Modes, in rounds, alternated:

  buffered+fdatasync        write at the end of a growing file, then fdatasync (sled's log
                            and a file without preallocation)
  buffered+fdatasync falloc the same in a file preallocated with fallocate (RaftLock's segment
                            files)
  buffered+fdatasync zeroed the same in a file written full of zeros first
  O_DSYNC zeroed            the write itself waits for the disk (no separate sync call)
  O_DIRECT|O_DSYNC zeroed   a 4 KiB block written past the page cache, waiting for the disk
  O_DIRECT|O_DSYNC falloc   the same into preallocated (unwritten) blocks

  python3 scripts/sync-modes.py [--dir DIR] [--writes N] [--rounds R]

Bounded: N writes per mode and round (default 2000), files of at most 64 MiB, removed after.
"""
import argparse
import mmap
import os
import resource
import time

RECORD = 300
BLOCK = 4096
FILE_BYTES = 64 << 20


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def prepare(fd, how):
    if how == "zeroed":
        zeros = mmap.mmap(-1, 1 << 20)  # page-aligned, so O_DIRECT accepts it too
        for i in range(FILE_BYTES >> 20):
            os.pwrite(fd, zeros, i << 20)
        os.fsync(fd)
    elif how == "falloc":
        os.posix_fallocate(fd, 0, FILE_BYTES)
        os.fsync(fd)


def run(directory, flags, direct, how, sync_call, writes):
    path = os.path.join(directory, "sync-probe")
    if os.path.exists(path):
        os.unlink(path)
    # The file is prepared with ordinary writes, then reopened with the mode's flags.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    prepare(fd, how)
    os.close(fd)
    fd = os.open(path, os.O_RDWR | flags)
    block = mmap.mmap(-1, BLOCK)
    block.write(b"x" * RECORD + b"\0" * (BLOCK - RECORD))
    record = bytes(block[:RECORD])
    times = []
    offset = 0
    start_cpu = cpu_seconds()
    for i in range(writes):
        t = time.perf_counter()
        if direct:
            os.pwrite(fd, block, (i * BLOCK) % (FILE_BYTES - BLOCK))
        else:
            os.pwrite(fd, record, offset)
            offset = (offset + RECORD) % (FILE_BYTES - RECORD)
        if sync_call:
            os.fdatasync(fd)
        times.append(time.perf_counter() - t)
    cpu = (cpu_seconds() - start_cpu) / writes
    os.close(fd)
    os.unlink(path)
    times.sort()
    return times[len(times) // 2], times[len(times) * 9 // 10], cpu


MODES = [
    ("buffered+fdatasync", 0, False, "none", True),
    ("buffered+fdatasync falloc", 0, False, "falloc", True),
    ("buffered+fdatasync zeroed", 0, False, "zeroed", True),
    ("O_DSYNC zeroed", os.O_DSYNC, False, "zeroed", False),
    ("O_DIRECT|O_DSYNC zeroed", os.O_DIRECT | os.O_DSYNC, True, "zeroed", False),
    ("O_DIRECT|O_DSYNC falloc", os.O_DIRECT | os.O_DSYNC, True, "falloc", False),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="target/bench-data/sync-probe")
    p.add_argument("--writes", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    print("| mode | round | p50 µs | p90 µs | CPU µs per write |")
    print("|---|---:|---:|---:|---:|")
    for rnd in range(1, args.rounds + 1):
        for name, flags, direct, how, sync_call in MODES:
            p50, p90, cpu = run(args.dir, flags, direct, how, sync_call, args.writes)
            print(f"| {name} | {rnd} | {p50 * 1e6:.0f} | {p90 * 1e6:.0f} | {cpu * 1e6:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
