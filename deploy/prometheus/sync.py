#!/usr/bin/env python3
"""Keeps the Helm chart's alert rules identical to deploy/prometheus/alerts.yml, their single
source, and checks the rule files against the code and the docs.

    python3 deploy/prometheus/sync.py          # copy alerts.yml to charts/raftlock/files/alerts.yml
    python3 deploy/prometheus/sync.py --check  # exit 1 if the copy is stale or a check fails

Checks (both modes; they need PyYAML, and are skipped with a note without it):
  - every RaftLock metric that alerts.yml and recording-rules.yml use is registered in the code
    (src/telemetry/metrics.rs, src/datastore/mod.rs), histograms through _bucket/_sum/_count;
  - every selector of a RaftLock metric or `up` names job="raftlock" or job="raftlock-datastore",
    the two selectors the chart's PrometheusRule template rewrites;
  - every alert has a severity label (critical, warning or info), summary and description
    annotations, and runbook_url docs/operations.md#<alert name in lower case>, a heading of
    docs/operations.md;
  - every alert has a promtool test in tests/alerts_test.yml where it fires and one where it does
    not, and every recording rule a test in tests/recording_rules_test.yml;
  - every panel of the Grafana dashboard (deploy/grafana/raftlock.json) has its line, **title**,
    in docs/operations.md's "What to watch".
"""
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCE = os.path.join(HERE, "alerts.yml")
RECORDING = os.path.join(HERE, "recording-rules.yml")
COPY = os.path.join(ROOT, "charts", "raftlock", "files", "alerts.yml")
DOCS = os.path.join(ROOT, "docs", "operations.md")
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "raftlock.json")
METRIC_SOURCES = [os.path.join(ROOT, "src", "telemetry", "metrics.rs"),
                  os.path.join(ROOT, "src", "datastore", "mod.rs")]
JOBS = ('job="raftlock"', 'job="raftlock-datastore"')
SEVERITIES = {"critical", "warning", "info"}
# A raw metric name in an expression: not part of a recorded name (level:metric:ops) or a word.
METRIC_RE = re.compile(r'(?<![\w:"])(up|raftlock_[a-z0-9_]+)\b(?![:"(])')


def rel(p):
    return os.path.relpath(p, ROOT)


def known_metrics():
    names = set()
    for path in METRIC_SOURCES:
        names.update(re.findall(r'"(raftlock_[a-z0-9_]+)"', open(path).read()))
    return names


def anchors(markdown):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).lower())
            out.add(text.replace(" ", "-"))
    return out


def lint(yaml):
    errors = []
    metrics = known_metrics()
    docs = open(DOCS).read() if os.path.exists(DOCS) else ""
    doc_anchors = anchors(docs)
    alerts, records = [], []
    for path in (SOURCE, RECORDING):
        data = yaml.safe_load(open(path))
        for group in data.get("groups", []):
            for rule in group.get("rules", []):
                name = rule.get("alert") or rule.get("record")
                where = f"{rel(path)}: {name}"
                expr = str(rule.get("expr", ""))
                for m in METRIC_RE.finditer(expr):
                    metric = m.group(1)
                    base = re.sub(r"_(bucket|sum|count)$", "", metric)
                    if metric != "up" and metric not in metrics and base not in metrics:
                        errors.append(f"{where}: {metric} is not a metric the code registers")
                    after = expr[m.end():]
                    sel = after[:after.index("}") + 1] if after.startswith("{") else ""
                    if not any(j in sel for j in JOBS):
                        errors.append(f"{where}: {metric}{sel} selects neither "
                                      f'job="raftlock" nor job="raftlock-datastore"')
                if "alert" in rule:
                    alerts.append(rule["alert"])
                    sev = (rule.get("labels") or {}).get("severity")
                    if sev not in SEVERITIES:
                        errors.append(f"{where}: severity {sev!r} is not one of {sorted(SEVERITIES)}")
                    ann = rule.get("annotations") or {}
                    for key in ("summary", "description"):
                        if not ann.get(key):
                            errors.append(f"{where}: no {key} annotation")
                    want = f"docs/operations.md#{rule['alert'].lower()}"
                    if ann.get("runbook_url") != want:
                        errors.append(f"{where}: runbook_url should be {want}")
                    elif rule["alert"].lower() not in doc_anchors:
                        errors.append(f"{where}: docs/operations.md has no heading "
                                      f"'{rule['alert']}' (anchor of runbook_url)")
                else:
                    records.append(rule["record"])
    if len(set(alerts)) != len(alerts):
        errors.append(f"{rel(SOURCE)}: an alert name is used twice")

    tests = yaml.safe_load(open(os.path.join(HERE, "tests", "alerts_test.yml")))
    fires, quiet = set(), set()
    for t in tests.get("tests", []):
        for a in t.get("alert_rule_test", []):
            (fires if a.get("exp_alerts") else quiet).add(a["alertname"])
    for a in alerts:
        if a not in fires:
            errors.append(f"tests/alerts_test.yml: no test where {a} fires")
        if a not in quiet:
            errors.append(f"tests/alerts_test.yml: no test where {a} stays quiet")
    tests = yaml.safe_load(open(os.path.join(HERE, "tests", "recording_rules_test.yml")))
    tested = {e["expr"] for t in tests.get("tests", []) for e in t.get("promql_expr_test", [])}
    for r in records:
        if r not in tested:
            errors.append(f"tests/recording_rules_test.yml: no test of {r}")

    panels = json.load(open(DASHBOARD))["panels"]
    for p in panels:
        if p.get("type") != "row" and f"**{p['title']}**" not in docs:
            errors.append(f"docs/operations.md: no line for the dashboard panel '{p['title']}'")
    return errors


def main():
    check = "--check" in sys.argv
    status = 0
    try:
        import yaml
    except ImportError:
        yaml = None
        print("note: PyYAML is not installed; only the chart's copy is checked")
    if yaml is not None:
        errors = lint(yaml)
        for e in errors:
            print(f"error: {e}")
        if errors:
            status = 1
    text = open(SOURCE).read()
    current = os.path.exists(COPY) and open(COPY).read() == text
    if check:
        if not current:
            print(f"out of date: {rel(COPY)} (run deploy/prometheus/sync.py)")
            status = 1
    elif not current:
        os.makedirs(os.path.dirname(COPY), exist_ok=True)
        with open(COPY, "w") as f:
            f.write(text)
        print(f"wrote {rel(COPY)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
