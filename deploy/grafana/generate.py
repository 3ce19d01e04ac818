#!/usr/bin/env python3
"""Writes deploy/grafana/raftlock.json, RaftLock's Grafana dashboard, and its copy in the Helm
chart (charts/raftlock/files/raftlock-dashboard.json, which the chart's dashboard ConfigMap loads).

    python3 deploy/grafana/generate.py          # rewrite both files
    python3 deploy/grafana/generate.py --check  # exit 1 if either file is out of date

One dashboard, one cluster at a time. The variables:

  namespace      single value, no "All": the namespace of the lock nodes (label_values of
                 raftlock_term). A Prometheus with a plain static config (deploy/prometheus/
                 prometheus.yml, tests/prometheus.rs) attaches no namespace label: the query finds
                 no values, Grafana leaves the variable empty, and `namespace=~""` matches exactly
                 the series without a namespace label. (A default of "All", `.*`, would merge
                 the clusters of every namespace: that is what the variable must not do.)
  job            single value, no "All": the lock nodes' scrape job in that namespace. Under the
                 prometheus-operator the job is the Service's name (the chart's headless Service,
                 one per release), so namespace and job together name one cluster; with a static
                 config it is the job_name (`raftlock`).
  pod            several values, default All (`.*`, which also matches no pod label): narrows the
                 per-pod panels. The chart's ServiceMonitor needs no relabelling for it: the
                 prometheus-operator adds `pod` (and `namespace`, `service`) to every target it
                 finds through a Service's endpoints; the usual kubernetes-pods scrape config of
                 the pods' prometheus.io annotations does the same. A static config has no pod
                 label: the variable then offers only All, and the per-pod panels name each node
                 by its `instance` instead (per_pod() below).
  datastore_job  single value: the data store's scrape job in the namespace (its own Service
                 under the operator, `raftlock-datastore` in the static config). The data-store
                 panels select it, not `job`.

Cluster-wide numbers (stats, totals, quantiles over every node) select the cluster and ignore
`pod`; every stat aggregates `by (namespace, job)`, so even a selection that matched two clusters
would show two values instead of adding them up. Lines drawn per node aggregate `by (pod,
instance)`, select `pod=~"$pod"` and have the legend {{pod}}. tests/prometheus.rs evaluates every
query with the variables as Grafana sets them for its one statically scraped cluster (namespace
empty, job `raftlock`, datastore_job `raftlock-datastore`, pod `.*`) and wants data in every panel.

The metrics are the ones lock-node and data-store export on /metrics.

The dashboard is built with Grafana's maintained model, the grafana-foundation-sdk package
(builders for the dashboard, its variables, stat and time series panels and Prometheus queries),
pinned to SDK_VERSION: --check compares bytes, and another SDK release may write other defaults.
scripts/check-chart.sh installs that version; by hand:

    pip install 'grafana-foundation-sdk==<SDK_VERSION below>'

(The package's versions carry an epoch, so a bare `pip install grafana-foundation-sdk` picks the
newest build of the oldest Grafana schema, not the newest schema.)
"""
import importlib.metadata
import json
import os
import sys

SDK_VERSION = "1769699379!11.6.0"
try:
    _installed = importlib.metadata.version("grafana-foundation-sdk")
except importlib.metadata.PackageNotFoundError:
    _installed = None
if _installed != SDK_VERSION:
    sys.exit(f"deploy/grafana/generate.py needs grafana-foundation-sdk {SDK_VERSION} "
             f"(installed: {_installed}): pip install 'grafana-foundation-sdk=={SDK_VERSION}'")

from grafana_foundation_sdk.builders import common as common_b  # noqa: E402
from grafana_foundation_sdk.builders import dashboard as dashboard_b  # noqa: E402
from grafana_foundation_sdk.builders import prometheus as prometheus_b  # noqa: E402
from grafana_foundation_sdk.builders import stat as stat_b  # noqa: E402
from grafana_foundation_sdk.builders import timeseries as timeseries_b  # noqa: E402
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.models import common as common_m  # noqa: E402
from grafana_foundation_sdk.models import dashboard as dashboard_m  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUTPUTS = [os.path.join(HERE, "raftlock.json"),
           os.path.join(ROOT, "charts", "raftlock", "files", "raftlock-dashboard.json")]

# The one cluster the namespace and job variables select.
SEL = 'namespace=~"$namespace", job=~"$job"'
# ... and the pods the pod variable selects in it (per-pod panels only).
POD_SEL = SEL + ', pod=~"$pod"'
# The data store is scraped as a job of its own.
DS_SEL = 'namespace=~"$namespace", job=~"$datastore_job"'
# Joins between two metrics of one node.
NODE = "on(namespace, job, instance)"
DS = dashboard_m.DataSourceRef(type_val="prometheus", uid="${datasource}")


def per_pod(expr):
    """`expr`, which keeps the labels pod and instance, with `pod` set to `instance` on series
    that have no pod label (a static scrape config), so that the legend {{pod}} names every node:
    label_join writes "<pod>@<instance>" into a scratch label, label_replace copies what follows
    the "@" into pod only when that value starts with "@" (pod empty), and the scratch label is
    dropped again (set to the empty string)."""
    return ('label_replace(label_replace(label_join('
            f'{expr}, "pod_or_instance", "@", "pod", "instance"), '
            '"pod", "$1", "pod_or_instance", "@(.+)"), '
            '"pod_or_instance", "", "pod_or_instance", ".*")')


class Layout:
    """Places rows and lines of panels on the dashboard's 24-column grid, top to bottom (every
    position is given explicitly: the SDK's automatic placement wraps only at exactly 24)."""

    def __init__(self, dashboard):
        self.dashboard = dashboard
        self.y = 0
        self.next_id = 1

    def row(self, title):
        self.dashboard.with_row(dashboard_b.Row(title).id(self._id()).grid_pos(
            dashboard_m.GridPos(h=1, w=24, x=0, y=self.y)))
        self.y += 1

    def line(self, *panels, h=8):
        w = 24 // len(panels)
        for i, p in enumerate(panels):
            self.dashboard.with_panel(p.id(self._id()).grid_pos(
                dashboard_m.GridPos(h=h, w=w, x=i * w, y=self.y)))
        self.y += h

    def _id(self):
        self.next_id += 1
        return self.next_id - 1


def with_targets(panel, exprs):
    """Adds one Prometheus query per (expression, legend), refIds A, B, ..."""
    for i, (expr, legend) in enumerate(exprs):
        panel.with_target(prometheus_b.Dataquery().expr(expr).legend_format(legend)
                          .ref_id(chr(65 + i)).datasource(DS))
    return panel


def stat(title, exprs, unit="none", description=""):
    panel = (stat_b.Panel().title(title).description(description).datasource(DS).unit(unit)
             .thresholds(dashboard_b.ThresholdsConfig().mode(dashboard_m.ThresholdsMode.ABSOLUTE)
                         .steps([dashboard_m.Threshold(color="green", value=None)]))
             .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).fields("")
                             .values(False))
             .color_mode(common_m.BigValueColorMode.VALUE)
             .graph_mode(common_m.BigValueGraphMode.NONE)
             .text_mode(common_m.BigValueTextMode.AUTO))
    return with_targets(panel, exprs)


def series(title, exprs, unit="short", description="", stack=False):
    stacking = common_m.StackingMode.NORMAL if stack else common_m.StackingMode.NONE
    panel = (timeseries_b.Panel().title(title).description(description).datasource(DS).unit(unit)
             .draw_style(common_m.GraphDrawStyle.LINE).line_width(1)
             .fill_opacity(10 if stack else 0)
             .stacking(common_b.StackingConfig().mode(stacking).group("A"))
             .show_points(common_m.VisibilityMode.NEVER)
             .legend(common_b.VizLegendOptions().display_mode(common_m.LegendDisplayMode.LIST)
                     .placement(common_m.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI)
                      .sort(common_m.SortOrder.DESCENDING)))
    return with_targets(panel, exprs)


def quantiles(metric):
    """p50, p90 and p99 over every node of the cluster."""
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}[$__rate_interval])))",
             f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


def p99_per_pod(metric, by="", legend="{{pod}}"):
    """p99 of each node (and of each `by` label value on it), so that one slow node stands out."""
    group = "le, pod, instance" + (f", {by}" if by else "")
    return (per_pod(f"histogram_quantile(0.99, sum by ({group}) "
                    f"(rate({metric}_bucket{{{POD_SEL}}}[$__rate_interval])))"), legend)


RELEASE_RENEW = ',op=~"release|renew"'


def at_client_port(extra=""):
    """Bucket rates of requests timed at the client port: WebSocket and gRPC together."""
    return " or ".join(
        f"rate({metric}_bucket{{{SEL}{extra}}}[$__rate_interval])"
        for metric in ("raftlock_websocket_request_duration_seconds",
                       "raftlock_grpc_request_duration_seconds"))


def per_cluster(agg, expr):
    """A stat's value: `agg` of `expr` for each cluster, never summed across clusters."""
    return f"{agg} by (namespace, job) ({expr})"


def from_leader(metric):
    """`metric` as the cluster's leader reports it."""
    return per_cluster("max", f"{metric}{{{SEL}}} and {NODE} raftlock_is_leader{{{SEL}}} == 1")


def dashboard():
    board = (dashboard_b.Dashboard("RaftLock").uid("raftlock-overview")
             .tags(["raftlock", "raft", "locks"])
             .description("One RaftLock cluster (the namespace and job variables): leadership, "
                          "replication, storage and locks, per pod where it matters, and the "
                          "fenced data store.")
             .editable().tooltip(dashboard_m.DashboardCursorSync.CROSSHAIR)
             .time("now-1h", "now").refresh("30s").version(1))
    L = Layout(board)
    L.row("Cluster")
    L.line(
        stat("Leader", [(per_cluster("max", f"raftlock_is_leader{{{SEL}}} * {NODE} group_left() "
                                            f"raftlock_term{{{SEL}}}")
                         + " > 0 or on() vector(0)", "term")],
             description="Term of the current leader (0: no node leads)."),
        stat("Nodes that know a leader",
             [(per_cluster("sum", f"raftlock_has_leader{{{SEL}}}"), "{{job}}")],
             description="Nodes of the selected cluster reporting a known leader; fewer than a "
                         "majority means no lock can be granted."),
        stat("Term", [(per_cluster("max", f"raftlock_term{{{SEL}}}"), "{{job}}")]),
        stat("Nodes scraped", [(per_cluster("sum", f"up{{{SEL}}}"), "{{job}}")],
             description="Lock nodes of the selected cluster whose /metrics answered the last "
                         "scrape."),
        stat("Locks held", [(from_leader("raftlock_locks_held"), "{{job}}")],
             description="As the leader reports it."),
        stat("Waiters", [(from_leader("raftlock_lock_waiters"), "{{job}}")]),
        stat("Cluster version", [(per_cluster("min", f"raftlock_cluster_version{{{SEL}}}"), "{{job}}")],
             description="The lowest any node reports: the log commands every member "
                         "understands. After a rolling upgrade it rises once every node runs "
                         "the new release."),
        h=4)
    L.line(
        series("Role per node",
               [(per_pod(f"max by (pod, instance) (raftlock_is_leader{{{POD_SEL}}})"), "{{pod}}")],
               description="1 while the pod leads."),
        series("Elections and leader changes",
               [(per_pod(f"sum by (pod, instance) (increase(raftlock_elections_total{{{POD_SEL}}}[$__rate_interval]))"),
                 "elections started {{pod}}"),
                (f"sum(increase(raftlock_leader_changes_total{{{SEL}}}[$__rate_interval]))",
                 "leader changes seen (all nodes)")]),
    )
    L.row("Replication")
    L.line(
        series("Replication lag (entries) per follower",
               [(f"max by (peer) (raftlock_replication_lag_entries{{{SEL}}})", "node {{peer}}")],
               description="Entries the leader has that each follower (by node id) has not "
                           "acknowledged."),
        series("Replication lag (seconds) per follower",
               [(f"max by (peer) (raftlock_replication_lag_seconds{{{SEL}}} and {NODE} "
                 f"raftlock_is_leader{{{SEL}}} == 1)", "node {{peer}}")],
               unit="s",
               description="Age of the oldest entry each follower has not acknowledged "
                           "(0 when caught up)."),
        series("Peer round trip",
               [p99_per_pod("raftlock_peer_rtt_seconds", "peer", "{{pod}} to node {{peer}}")],
               unit="s",
               description="p99 heartbeat round trip measured by each pod (the leader sends the "
                           "heartbeats) to each peer, by node id: one slow link or node stands "
                           "out."),
    )
    L.line(
        series("Commit and apply rate",
               [(per_pod(f"max by (pod, instance) (rate(raftlock_entries_committed_total{{{POD_SEL}}}[$__rate_interval]))"),
                 "commit {{pod}}"),
                (per_pod(f"max by (pod, instance) (rate(raftlock_entries_applied_total{{{POD_SEL}}}[$__rate_interval]))"),
                 "apply {{pod}}")], unit="ops"),
        series("Proposals",
               [(f"sum(rate(raftlock_proposals_committed_total{{{SEL}}}[$__rate_interval]))", "committed"),
                (f"sum(rate(raftlock_proposals_failed_total{{{SEL}}}[$__rate_interval]))", "failed"),
                (f"sum(raftlock_proposals_pending{{{SEL}}})", "pending")]),
        series("Storage flush (fsync) latency",
               [p99_per_pod("raftlock_fsync_duration_seconds", legend="p99 {{pod}}"),
                (f"histogram_quantile(0.5, sum by (le) (rate(raftlock_fsync_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                 "p50 all nodes")],
               unit="s",
               description="p99 of one flush on each pod, so that one slow disk stands out, and "
                           "the median over all nodes for comparison. One flush covers a whole "
                           "Raft Ready."),
    )
    L.line(
        series("Snapshots",
               [(f"sum by (kind) (increase(raftlock_snapshots_total{{{SEL}}}[$__rate_interval]))",
                 "{{kind}}")]),
        series("Peer messages dropped",
               [(f"sum by (peer) (rate(raftlock_peer_messages_dropped_total{{{SEL}}}[$__rate_interval]))",
                 "to node {{peer}}")]),
        series("Flushes on the flush thread",
               [(per_pod(f"max by (pod, instance) (raftlock_flush_thread_active{{{POD_SEL}}})"),
                 "on {{pod}}"),
                (per_pod(f"sum by (pod, instance) (increase(raftlock_flush_thread_switches_total{{{POD_SEL}}}[$__rate_interval]))"),
                 "switches {{pod}}")],
               description="1 while a node's flushes run on its flush thread (--background-flush; "
                           "auto uses it while the node is busy), and how often auto switched."),
        series("Raft streams opened",
               [(per_pod(f"sum by (pod, instance, kind) (raftlock_peer_streams_opened_total{{{POD_SEL}}})"),
                 "{{kind}} from {{pod}}")],
               description="Raft message streams each node opened to its peers since it started, "
                           "by kind: plain (length-prefixed frames, the default) or grpc "
                           "(--peer-stream grpc, or the fallback for a peer that does not take "
                           "plain streams). A line that keeps climbing means streams keep "
                           "breaking; a grpc line still climbing after an upgrade means an older "
                           "node is still in the cluster."),
    )
    L.line(
        series("Time to elect a leader",
               [p99_per_pod("raftlock_election_duration_seconds", legend="p99 {{pod}}")],
               unit="s",
               description="How long each pod went without a leader, from its first campaign "
                           "(PreVote) to knowing the winner: p99 over the elections in the "
                           "interval. Empty while no election happens."),
        series("Store on disk",
               [(per_pod(f"max by (pod, instance) (raftlock_store_size_bytes{{{POD_SEL}}})"),
                 "{{pod}}")],
               unit="bytes",
               description="Bytes of the files under each pod's data directory: the Raft log, "
                           "the applied state and snapshots, measured every 15 s."),
        series("Log entries since the last snapshot",
               [(per_pod(f"max by (pod, instance) (raftlock_log_entries{{{POD_SEL}}})"),
                 "{{pod}}")],
               description="Entries kept in each pod's Raft log; they fall back when the log is "
                           "compacted to a snapshot."),
        series("Process CPU and memory",
               [(per_pod(f"sum by (pod, instance) (rate(process_cpu_seconds_total{{{POD_SEL}}}[$__rate_interval]))"),
                 "CPU cores {{pod}}"),
                (per_pod(f"max by (pod, instance) (process_resident_memory_bytes{{{POD_SEL}}}) / 2^30"),
                 "resident GiB {{pod}}")],
               description="CPU (cores in use) and resident memory (GiB) of each lock-node "
                           "process."),
    )
    L.row("Locks")
    L.line(
        series("Lock operations",
               [(f"sum(rate(raftlock_lock_grants_total{{{SEL}}}[$__rate_interval]))", "grants"),
                (f"sum(rate(raftlock_lock_releases_total{{{SEL}}}[$__rate_interval]))", "releases"),
                (f"sum(rate(raftlock_lock_renewals_total{{{SEL}}}[$__rate_interval]))", "renewals"),
                (f"sum(rate(raftlock_lock_expirations_total{{{SEL}}}[$__rate_interval]))", "expirations")],
               unit="ops"),
        series("Wait for a lock", quantiles("raftlock_lock_wait_seconds"), unit="s",
               description="From the acquire's arrival at the leader to its grant (includes "
                           "the commit)."),
        series("Lock hold time", quantiles("raftlock_lock_hold_seconds"), unit="s"),
    )
    L.line(
        series("Requests by operation and result",
               [(f"sum by (op, result) (rate(raftlock_requests_total{{{SEL}}}[$__rate_interval]))",
                 "{{op}} {{result}}")], unit="reqps", stack=True),
        series("Client connections",
               [(per_pod(f"sum by (pod, instance, protocol) (raftlock_client_connections{{{POD_SEL}}})"),
                 "{{protocol}} {{pod}}")],
               description="Open client connections on each pod by protocol: websocket "
                           "(upgraded), grpc (HTTP/2) and http (HTTP/1.1: requests, probes and "
                           "scrapes, and WebSocket connections before their upgrade)."),
        series("Unknown request fields ignored",
               [(f"sum(rate(raftlock_ignored_fields_total{{{SEL}}}[$__rate_interval]))", "fields")]),
        series("Exactly-once table",
               [(from_leader("raftlock_answers_remembered"), "answers kept"),
                (from_leader("raftlock_answers_recent"), "recent (within the retention)"),
                (per_cluster("max", f"raftlock_answers_max{{{SEL}}}"), "bound")],
               description="Answers kept for retries, as the leader reports them. The leader "
                           "paces new acquires, puts and deletes (BUSY) to keep the recent "
                           "ones below the bound (alert RaftLockRequestsPaced)."),
    )
    L.line(
        series("Request latency at the client connection",
               [(f"histogram_quantile({q}, sum by (le, op) ({at_client_port()}))",
                 f"p{int(q * 100)} {{{{op}}}}") for q in (0.5, 0.9, 0.99)], unit="s",
               description="WebSocket and gRPC requests on the node they were sent to: over "
                           "WebSocket from the frame read to the answer written, over gRPC from "
                           "the request's arrival to its answer (lock waits and the hop to the "
                           "leader included)."),
        series("Where a request's time goes (p99)",
               [(f"histogram_quantile(0.99, sum by (le) ({at_client_port(RELEASE_RENEW)}))",
                 "release and renew at the client connection"),
                (f"histogram_quantile(0.99, sum by (le) (rate(raftlock_request_duration_seconds_bucket{{{SEL},op=~\"release|renew\"}}[$__rate_interval])))",
                 "release and renew in the executing node's driver"),
                (f"histogram_quantile(0.99, sum by (le) (rate(raftlock_commit_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                 "commit on the leader (a majority's disks)"),
                (f"histogram_quantile(0.99, sum by (le) (rate(raftlock_fsync_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                 "one flush")],
               unit="s",
               description="Releases and renewals never wait for a lock, so their time is the "
                           "service's own. Connection far above driver: the node's client I/O "
                           "(too many connections for its CPUs). Driver far above commit: the "
                           "driver thread is busy. Commit far above flush: the followers or the "
                           "network."),
    )
    L.row("Data store")
    L.line(
        series("Fenced writes by result",
               [(f"sum by (result) (rate(raftlock_datastore_writes_total{{{DS_SEL}}}[$__rate_interval]))",
                 "{{result}}")], unit="ops",
               description="The data store selected by the datastore_job variable. stale: a write "
                           "with an older token than one already accepted — a holder that lost "
                           "its lock, stopped by fencing."),
        series("Torn lines repaired at start",
               [(f"sum(raftlock_datastore_repaired_lines_total{{{DS_SEL}}})", "lines")]),
    )

    def var(name, label, query, description, multi=False):
        """A query variable. Single-valued ones have no "All" and start on the first value the
        query finds (Grafana picks it when no value is saved); multi-valued ones start on All."""
        v = (dashboard_b.QueryVariable(name).label(label).description(description).query(query)
             .datasource(DS).refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
             .sort(dashboard_m.VariableSort.ALPHABETICAL_ASC).multi(multi).include_all(multi))
        if multi:
            v.all_value(".*").current(
                dashboard_m.VariableOption(selected=True, text=["All"], value=["$__all"]))
        return v

    board.with_variable(dashboard_b.DatasourceVariable("datasource").label("Data source")
                        .type("prometheus"))
    board.with_variable(var(
        "namespace", "Namespace", "label_values(raftlock_term, namespace)",
        "Namespace of the lock nodes. Empty where the scrape adds no namespace label "
        "(a static config): then it selects the series without one."))
    board.with_variable(var(
        "job", "Cluster (job)", 'label_values(raftlock_term{namespace=~"$namespace"}, job)',
        "The lock nodes' scrape job: under the prometheus-operator the cluster's headless "
        "Service, one per release."))
    board.with_variable(var(
        "pod", "Pod", 'label_values(raftlock_term{namespace=~"$namespace", job=~"$job"}, pod)',
        "Pods drawn in the per-pod panels (All also covers a scrape without pod labels, "
        "whose nodes those panels name by instance).", multi=True))
    board.with_variable(var(
        "datastore_job", "Data store (job)",
        'label_values(raftlock_datastore_repaired_lines_total{namespace=~"$namespace"}, job)',
        "The data store's scrape job, which the data-store panels select."))
    return board.build()


def main():
    # The SDK's encoder turns the model into plain JSON; indented like before for diffs.
    text = json.dumps(json.loads(JSONEncoder().encode(dashboard())), indent=2) + "\n"
    if "--check" in sys.argv:
        stale = [p for p in OUTPUTS if not os.path.exists(p) or open(p).read() != text]
        for p in stale:
            print(f"out of date: {os.path.relpath(p, ROOT)} (run deploy/grafana/generate.py)")
        return 1 if stale else 0
    for p in OUTPUTS:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(p, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
