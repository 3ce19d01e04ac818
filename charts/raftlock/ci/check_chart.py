#!/usr/bin/env python3
"""Offline checks of the RaftLock chart, driven by scripts/check-chart.sh.

    check_chart.py render --chart DIR --out FILE [--release R] [--namespace N] [VALUES...]
    check_chart.py check  --chart DIR --kube-versions 1.29,1.37 [--release R] [--namespace N]

`render` writes every manifest of the chart (hooks and `helm test` pods included) as one
multi-document YAML file. `check`, for the chart's default values and for every
ci/*-values.yaml: lints the chart strictly (warnings fail), validates the values against
values.schema.json, renders it as an install and as an upgrade, and validates every rendered
object strictly (unknown fields fail) against the Kubernetes OpenAPI schemas of each version
that kubernetes-validate ships; then checks that values the chart must refuse (REFUSALS: a
short cluster token, peer TLS without the operator Secret, ...) fail to render with their
message. It needs no cluster and no helm binary: Helm v4's own Go code
runs through helm-python-sdk.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import yaml

import helm_python as helm
import kubernetes_validate

# Custom resources of prometheus-operator: their schemas are CRDs, not part of Kubernetes'
# OpenAPI, so kubernetes-validate has none. They are checked for apiVersion/kind/metadata only.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}


def load_values(files: list[str]) -> dict:
    """Merges values files left to right like `helm -f a -f b` (maps deep, the rest replaced)."""

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
        return out

    values: dict = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc, dict):
            raise SystemExit(f"{path}: a values file must be a map")
        values = merge(values, doc)
    return values


def render(chart_dir: str, values: dict, release: str, namespace: str, upgrade: bool) -> list[tuple[str, str]]:
    """(template path, rendered text) of every template that rendered to something."""
    with helm.Chart.load(chart_dir) as chart:
        chart.validate_schema(values)
        if upgrade:
            out = chart.render(values, name=release, namespace=namespace, revision=2, is_upgrade=True)
        else:
            out = chart.render(values, name=release, namespace=namespace, revision=1, is_install=True)
    return [(path, text) for path, text in sorted(out.items()) if text.strip()]


def documents(rendered: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    docs = []
    for path, text in rendered:
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                docs.append((path, doc))
    return docs


def to_multidoc(rendered: list[tuple[str, str]]) -> str:
    parts = []
    for path, text in rendered:
        if path.endswith("NOTES.txt"):
            continue
        for doc in text.split("\n---"):
            if doc.strip() and yaml.safe_load(doc) is not None:
                parts.append(f"# Source: {path}\n{doc.strip()}\n")
    return "---\n" + "---\n".join(parts)


def cmd_render(args: argparse.Namespace) -> int:
    values = load_values(args.values)
    rendered = render(args.chart, values, args.release, args.namespace, upgrade=False)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(to_multidoc(rendered))
    count = len(documents(rendered))
    print(f"rendered {count} objects of {args.chart} (release {args.release}, namespace {args.namespace}) to {args.out}")
    return 0


def lint(chart_dir: str, values: dict, namespace: str, kube_version: str) -> list[str]:
    report = helm.lint(chart_dir, values, strict=True, namespace=namespace, kube_version=f"v{kube_version}.0")
    problems = [f"{m.get('path')}: {m.get('error')}" for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    problems += [str(e) for e in report.get("errors") or []]
    return problems


def check_object(path: str, doc: dict, version: str) -> str | None:
    """None if valid, else the reason."""
    kind, api = doc.get("kind"), doc.get("apiVersion")
    if not kind or not api or not isinstance(doc.get("metadata"), dict) or not doc["metadata"].get("name"):
        return f"{path}: object without apiVersion, kind or metadata.name"
    if (api, kind) in CRD_KINDS:
        return None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(str(p) for p in e.path)
        return f"{path}: {kind} {doc['metadata']['name']}: {where}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        return f"{path}: {kind} {api}: no schema in Kubernetes {version} ({e})"
    return None


# Values the chart must refuse to render (a `fail` in a template), with a part of the message.
REFUSALS = [
    ("a cluster token under 32 characters", {"clusterToken": "short-token"}, "must have at least 32"),
    (
        "peer TLS and the scale-down hook without the operator Secret",
        {"tls": {"peer": {"enabled": True, "secretName": "peer"}}},
        "needs tls.peer.operatorSecretName",
    ),
    (
        "mounted Secrets without podSecurityContext.fsGroup",
        {"fencingKeySecret": "fencing", "podSecurityContext": {"fsGroup": None}},
        "need podSecurityContext.fsGroup",
    ),
]


def check_refusals(args: argparse.Namespace) -> int:
    failures = 0
    for label, over, message in REFUSALS:
        try:
            # Over the chart's defaults, like `helm --set`; a null removes a default.
            render(args.chart, over, args.release, args.namespace, False)
        except helm.HelmError as e:
            if message in str(e):
                print(f"ok   refuses {label}")
                continue
            print(f"FAIL refuses {label}, but not with '{message}': {e}")
        else:
            print(f"FAIL renders {label}")
        failures += 1
    return failures


def cmd_check(args: argparse.Namespace) -> int:
    # major.minor: kubernetes-validate picks the schema of that minor release.
    versions = [".".join(v.strip().lstrip("v").split(".")[:2]) for v in args.kube_versions.split(",") if v.strip()]
    sets = [("defaults", [])] + [
        (os.path.relpath(p, args.chart), [p]) for p in sorted(glob.glob(os.path.join(args.chart, "ci", "*-values.yaml")))
    ]
    failures = 0
    skipped_kinds: set[str] = set()
    for label, files in sets:
        values = load_values(files)
        for version in versions:
            problems = lint(args.chart, values, args.namespace, version)
            if problems:
                failures += len(problems)
                print(f"FAIL lint --strict [{label}] (Kubernetes {version})")
                for p in problems:
                    print(f"     {p}")
            else:
                print(f"ok   lint --strict [{label}] (Kubernetes {version})")
        for upgrade in (False, True):
            mode = "upgrade" if upgrade else "install"
            try:
                docs = documents(render(args.chart, values, args.release, args.namespace, upgrade))
            except helm.HelmError as e:
                failures += 1
                detail = str(e).strip().replace("\n", "\n     ")
                print(f"FAIL render [{label}] as {mode}:\n     {detail}")
                continue
            kinds = sorted({d["kind"] for _, d in docs if isinstance(d, dict) and "kind" in d})
            for version in versions:
                bad = []
                for path, doc in docs:
                    if (doc.get("apiVersion"), doc.get("kind")) in CRD_KINDS:
                        skipped_kinds.add(doc["kind"])
                    reason = check_object(path, doc, version)
                    if reason:
                        bad.append(reason)
                if bad:
                    failures += len(bad)
                    print(f"FAIL validate [{label}] as {mode}, Kubernetes {version}: {len(bad)} of {len(docs)} objects invalid")
                    for b in bad:
                        print(f"     {b}")
                else:
                    print(f"ok   validate --strict [{label}] as {mode}, Kubernetes {version}: {len(docs)} objects ({', '.join(kinds)})")
    failures += check_refusals(args)
    if skipped_kinds:
        print(
            "note: "
            + ", ".join(sorted(skipped_kinds))
            + " (prometheus-operator CRDs) are not in Kubernetes' schemas: checked for apiVersion, kind and name only"
        )
    if failures:
        print(f"chart checks: {failures} problem(s)")
        return 1
    print(f"chart checks: all passed ({len(sets)} value sets, Kubernetes {', '.join(versions)})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("render", "check"):
        p = sub.add_parser(name)
        p.add_argument("--chart", required=True)
        p.add_argument("--release", default="raftlock")
        p.add_argument("--namespace", default="default")
        if name == "render":
            p.add_argument("--out", required=True)
            p.add_argument("values", nargs="*")
        else:
            p.add_argument("--kube-versions", required=True)
    args = parser.parse_args()
    try:
        return cmd_render(args) if args.cmd == "render" else cmd_check(args)
    except helm.HelmError as e:
        print(f"FAIL: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
