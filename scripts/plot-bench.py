#!/usr/bin/env python3
"""Draws docs/bench/chart.png from results.json: throughput and p99 by client count, one panel
per workload, RaftLock beside each peer of the run (etcd, ZooKeeper, Redis)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "raftlock": "#1f77b4",
    "etcd": "#d62728",
    "zookeeper": "#2ca02c",
    "redis-fsync": "#9467bd",
    "redis-default": "#8c564b",
}
LABELS = {
    "raftlock": "RaftLock",
    "etcd": "etcd",
    "zookeeper": "ZooKeeper",
    "redis-fsync": "Redis, appendfsync always",
    "redis-default": "Redis, default (no fsync per write)",
}


def main(src, dst):
    with open(src) as f:
        report = json.load(f)
    rows = report["rows"]
    workloads, targets = [], []
    for r in rows:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
        if r["target"] not in targets:
            targets.append(r["target"])
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 8.5), squeeze=False)
    for col, w in enumerate(workloads):
        for target in targets:
            pts = sorted((r["clients"], r) for r in rows if r["workload"] == w and r["target"] == target)
            xs = [c for c, _ in pts]
            style = dict(color=COLORS.get(target), label=LABELS.get(target, target))
            # Redis without fsync is an unsafe reference: drawn dashed.
            line = "o--" if target.startswith("redis") else "o-"
            axes[0][col].plot(xs, [r["throughput"] for _, r in pts], line, **style)
            axes[1][col].plot(xs, [r["p99_ms"] for _, r in pts], line, **style)
        latency = "hand-off" if w == "contended" else "acquire"
        axes[0][col].set_title(f"{w}: locks/s")
        axes[1][col].set_title(f"{w}: p99 {latency} latency (ms)")
        for row in (0, 1):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("clients")
            ax.grid(True, alpha=0.3, which="both")
            ax.legend(fontsize=7)
    versions = report.get("versions") or {"etcd": report.get("etcd", "etcd")}
    shown = ", ".join(v.replace(" Version:", "") for k, v in versions.items() if k not in ("raftlock", "redis-default"))
    fig.suptitle(f"RaftLock vs {shown} — {report.get('date', '')}, {report.get('machine', '')}")
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
