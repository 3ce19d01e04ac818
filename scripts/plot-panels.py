#!/usr/bin/env python3
"""Draws the key panels of RaftLock's Grafana dashboard from one run of tests/prometheus.rs.

tests/prometheus.rs runs a real Prometheus against a three-node cluster and the data store, kills
the leader in the middle of a lock workload, evaluates every dashboard query over the whole run
and writes the answers to target/tmp/prometheus-panels.json (CARGO_TARGET_TMPDIR). This
script draws a chosen set of those panels, with the leader kill marked, into one PNG:

    cargo test --release --test prometheus -- --nocapture
    python3 scripts/plot-panels.py [PANELS_JSON] [OUT_PNG]

Defaults: target/tmp/prometheus-panels.json -> docs/observability/panels.png. Needs
matplotlib (pip install matplotlib).
"""

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PANELS = [
    ("Role per node", "{pod}", 1.0),
    ("Elections and leader changes", None, 1.0),
    ("Replication lag (seconds) per follower", "peer {peer}", 1.0),
    ("Commit and apply rate", None, 1.0),
    ("Storage flush (fsync) latency", "p99 {pod}", 1000.0),
    ("Lock operations", None, 1.0),
    ("Wait for a lock", None, 1000.0),
    ("Fenced writes by result", "{result}", 1.0),
]
UNITS = {
    "Storage flush (fsync) latency": "ms",
    "Wait for a lock": "ms",
    "Replication lag (seconds) per follower": "s",
    "Commit and apply rate": "entries/s",
    "Lock operations": "per s",
    "Fenced writes by result": "per s",
    "Elections and leader changes": "per 5 s",
}


def label(series, template):
    metric = series.get("metric", {})
    if template:
        try:
            return template.format(**metric)
        except KeyError:
            pass
    query = series["query"]
    if "histogram_quantile(" in query:
        return "p" + query.split("histogram_quantile(")[1].split(",")[0].lstrip("0.").ljust(2, "0")
    name = query.split("raftlock_", 1)[-1].split("{", 1)[0]
    extra = ",".join(f"{k}={v}" for k, v in metric.items() if k not in ("job", "namespace"))
    return name + (f" {extra}" if extra else "")


def main():
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target/tmp/prometheus-panels.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs/observability/panels.png"
    run = json.loads(src.read_text())
    panels = {p["title"]: p for p in run["panels"]}
    begin, killed = run["begin"], run["killed_at"]
    fig, axes = plt.subplots(4, 2, figsize=(12, 11), sharex=True)
    for ax, (title, template, scale) in zip(axes.flat, PANELS):
        panel = panels.get(title)
        if panel is None:
            ax.set_title(f"{title} (not in this run)")
            continue
        for series in panel["series"]:
            points = [
                (float(t) - begin, float(v) * scale)
                for t, v in series["values"]
                if math.isfinite(float(v))
            ]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=label(series, template), linewidth=1.2)
        ax.axvline(killed - begin, color="red", linestyle="--", linewidth=1)
        unit = UNITS.get(title)
        ax.set_title(title + (f" ({unit})" if unit else ""), fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run (red: leader SIGKILLed)")
    fig.suptitle(
        f"RaftLock dashboard panels from one run of tests/prometheus.rs "
        f"(3 nodes, leader {run['killed_leader']} killed)",
        fontsize=12,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
