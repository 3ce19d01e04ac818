#!/usr/bin/env python3
"""Draws docs/bench/chart.png from results.json: throughput and p99 by client count, one panel
per workload, RaftLock against etcd."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    with open(src) as f:
        report = json.load(f)
    rows = report["rows"]
    workloads = []
    for r in rows:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 8), squeeze=False)
    colors = {"raftlock": "#1f77b4", "etcd": "#d62728"}
    for col, w in enumerate(workloads):
        for target in ("raftlock", "etcd"):
            pts = sorted((r["clients"], r) for r in rows if r["workload"] == w and r["target"] == target)
            xs = [c for c, _ in pts]
            axes[0][col].plot(xs, [r["throughput"] for _, r in pts], "o-", color=colors[target], label=target)
            axes[1][col].plot(xs, [r["p99_ms"] for _, r in pts], "o-", color=colors[target], label=target)
        latency = "hand-off" if w == "contended" else "acquire"
        axes[0][col].set_title(f"{w}: locks/s")
        axes[1][col].set_title(f"{w}: p99 {latency} latency (ms)")
        for row in (0, 1):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("clients")
            ax.grid(True, alpha=0.3)
            ax.legend()
        axes[0][col].set_ylim(bottom=0)
        axes[1][col].set_ylim(bottom=0)
    fig.suptitle(f"RaftLock vs {report.get('etcd', 'etcd')} — {report.get('date', '')}, {report.get('machine', '')}")
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
