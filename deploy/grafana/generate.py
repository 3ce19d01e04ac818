#!/usr/bin/env python3
"""Writes deploy/grafana/raftlock.json, RaftLock's Grafana dashboard, and its copy in the Helm
chart (charts/raftlock/files/raftlock-dashboard.json, which the chart's dashboard ConfigMap loads).

    python3 deploy/grafana/generate.py          # rewrite both files
    python3 deploy/grafana/generate.py --check  # exit 1 if either file is out of date

Every query selects `job` and `namespace` through dashboard variables, so one dashboard serves
several clusters. The metrics are the ones lock-node and data-store export on /metrics.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUTPUTS = [os.path.join(HERE, "raftlock.json"),
           os.path.join(ROOT, "charts", "raftlock", "files", "raftlock-dashboard.json")]

SEL = 'job=~"$job", namespace=~"$namespace"'
# The data store is scraped as a job of its own.
DS_SEL = 'namespace=~"$namespace"'
DS = {"type": "prometheus", "uid": "${datasource}"}


class Layout:
    def __init__(self):
        self.y = 0
        self.next_id = 1
        self.panels = []

    def row(self, title):
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": self._id(),
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def line(self, *panels, h=8):
        w = 24 // len(panels)
        for i, p in enumerate(panels):
            p["id"] = self._id()
            p["gridPos"] = {"h": h, "w": w, "x": i * w, "y": self.y}
            self.panels.append(p)
        self.y += h

    def _id(self):
        self.next_id += 1
        return self.next_id - 1


def target(expr, legend, ref="A"):
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}


def stat(title, exprs, unit="none", description="", mappings=None, thresholds=None):
    return {
        "type": "stat", "title": title, "description": description, "datasource": DS,
        "targets": [target(e, l, chr(65 + i)) for i, (e, l) in enumerate(exprs)],
        "fieldConfig": {"defaults": {
            "unit": unit, "mappings": mappings or [],
            "thresholds": thresholds or {"mode": "absolute",
                                         "steps": [{"color": "green", "value": None}]},
        }, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "none", "textMode": "auto"},
    }


def series(title, exprs, unit="short", description="", stack=False):
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "targets": [target(e, l, chr(65 + i)) for i, (e, l) in enumerate(exprs)],
        "fieldConfig": {"defaults": {
            "unit": unit,
            "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
                       "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                       "showPoints": "never"},
        }, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def quantiles(metric, by=""):
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}[$__rate_interval])))",
             f"p{int(q * 100)}{suffix}") for q in (0.5, 0.9, 0.99)]


RELEASE_RENEW = ',op=~"release|renew"'


def at_client_port(extra=""):
    """Bucket rates of requests timed at the client port: WebSocket and gRPC together."""
    return " or ".join(
        f"rate({metric}_bucket{{{SEL}{extra}}}[$__rate_interval])"
        for metric in ("raftlock_websocket_request_duration_seconds",
                       "raftlock_grpc_request_duration_seconds"))


def dashboard():
    L = Layout()
    L.row("Cluster")
    L.line(
        stat("Leader", [(f"max(raftlock_is_leader{{{SEL}}} * on(instance) group_left() "
                         f"raftlock_term{{{SEL}}}) > 0 or vector(0)", "term")],
             description="Term of the current leader (0: no node leads)."),
        stat("Nodes that know a leader", [(f"sum(raftlock_has_leader{{{SEL}}})", "")],
             description="Nodes reporting a known leader; fewer than a majority means no lock "
                         "can be granted."),
        stat("Term", [(f"max(raftlock_term{{{SEL}}})", "")]),
        stat("Nodes scraped", [(f"count(up{{{SEL}}} == 1)", "")]),
        stat("Locks held", [(f"max(raftlock_locks_held{{{SEL}}} and on(instance) "
                             f"raftlock_is_leader{{{SEL}}} == 1)", "")],
             description="As the leader reports it."),
        stat("Waiters", [(f"max(raftlock_lock_waiters{{{SEL}}} and on(instance) "
                          f"raftlock_is_leader{{{SEL}}} == 1)", "")]),
        stat("Cluster version", [(f"min(raftlock_cluster_version{{{SEL}}})", "")],
             description="The lowest any node reports: the log commands every member "
                         "understands. After a rolling upgrade it rises once every node runs "
                         "the new release."),
        h=4)
    L.line(
        series("Role per node", [(f"raftlock_is_leader{{{SEL}}}", "{{instance}}")],
               description="1 while the node leads."),
        series("Elections and leader changes",
               [(f"sum by (instance) (increase(raftlock_elections_total{{{SEL}}}[$__rate_interval]))",
                 "elections started {{instance}}"),
                (f"sum(increase(raftlock_leader_changes_total{{{SEL}}}[$__rate_interval]))",
                 "leader changes seen (all nodes)")]),
    )
    L.row("Replication")
    L.line(
        series("Replication lag (entries) per follower",
               [(f"max by (peer) (raftlock_replication_lag_entries{{{SEL}}})", "node {{peer}}")],
               description="Entries the leader has that each follower has not acknowledged."),
        series("Replication lag (seconds) per follower",
               [(f"max by (peer) (raftlock_replication_lag_seconds{{{SEL}}} and on(instance) "
                 f"raftlock_is_leader{{{SEL}}} == 1)", "node {{peer}}")],
               unit="s",
               description="Age of the oldest entry each follower has not acknowledged "
                           "(0 when caught up)."),
        series("Peer round trip", quantiles("raftlock_peer_rtt_seconds", "peer"), unit="s"),
    )
    L.line(
        series("Commit and apply rate",
               [(f"max by (instance) (rate(raftlock_commit_index{{{SEL}}}[$__rate_interval]))",
                 "commit {{instance}}"),
                (f"max by (instance) (rate(raftlock_applied_index{{{SEL}}}[$__rate_interval]))",
                 "apply {{instance}}")], unit="ops"),
        series("Proposals",
               [(f"sum(rate(raftlock_proposals_committed_total{{{SEL}}}[$__rate_interval]))", "committed"),
                (f"sum(rate(raftlock_proposals_failed_total{{{SEL}}}[$__rate_interval]))", "failed"),
                (f"sum(raftlock_proposals_pending{{{SEL}}})", "pending")]),
        series("Storage flush (fsync) latency", quantiles("raftlock_fsync_duration_seconds"),
               unit="s", description="One flush covers a whole Raft Ready."),
    )
    L.line(
        series("Snapshots",
               [(f"sum by (kind) (increase(raftlock_snapshots_total{{{SEL}}}[$__rate_interval]))",
                 "{{kind}}")]),
        series("Peer messages dropped",
               [(f"sum by (peer) (rate(raftlock_peer_messages_dropped_total{{{SEL}}}[$__rate_interval]))",
                 "to node {{peer}}")]),
        series("Flushes on the flush thread",
               [(f"max by (instance) (raftlock_flush_thread_active{{{SEL}}})", "on {{instance}}"),
                (f"sum by (instance) (increase(raftlock_flush_thread_switches_total{{{SEL}}}[$__rate_interval]))",
                 "switches {{instance}}")],
               description="1 while a node's flushes run on its flush thread (--background-flush; "
                           "auto uses it while the node is busy), and how often auto switched."),
        series("Raft streams opened",
               [(f"sum by (instance, kind) (raftlock_peer_streams_opened_total{{{SEL}}})",
                 "{{kind}} from {{instance}}")],
               description="Raft message streams each node opened to its peers since it started, "
                           "by kind: plain (length-prefixed frames, the default) or grpc "
                           "(--peer-stream grpc, or the fallback for a peer that does not take "
                           "plain streams). A line that keeps climbing means streams keep "
                           "breaking; a grpc line still climbing after an upgrade means an older "
                           "node is still in the cluster."),
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
               [(f"sum by (instance) (raftlock_client_connections{{{SEL}}})", "{{instance}}")]),
        series("Unknown request fields ignored",
               [(f"sum(rate(raftlock_ignored_fields_total{{{SEL}}}[$__rate_interval]))", "fields")]),
        series("Exactly-once table",
               [(f"max(raftlock_answers_remembered{{{SEL}}} and on(instance) "
                 f"raftlock_is_leader{{{SEL}}} == 1)", "answers kept"),
                (f"max(raftlock_answers_recent{{{SEL}}} and on(instance) "
                 f"raftlock_is_leader{{{SEL}}} == 1)", "recent (within the retention)"),
                (f"max(raftlock_answers_max{{{SEL}}})", "bound")],
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
               description="stale: a write with an older token than one already accepted — a "
                           "holder that lost its lock, stopped by fencing."),
        series("Torn lines repaired at start",
               [(f"sum(raftlock_datastore_repaired_lines_total{{{DS_SEL}}})", "lines")]),
    )

    def var(name, query, label):
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": query, "refId": name}, "definition": query,
                "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}

    return {
        "title": "RaftLock", "uid": "raftlock-overview", "tags": ["raftlock", "raft", "locks"],
        "description": "RaftLock cluster: leadership, replication, storage, locks and the fenced "
                       "data store.",
        "editable": True, "schemaVersion": 39, "version": 1, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}},
            var("namespace", "label_values(raftlock_term, namespace)", "Namespace"),
            var("job", 'label_values(raftlock_term{namespace=~"$namespace"}, job)', "Job"),
        ]},
        "annotations": {"list": []},
        "panels": L.panels,
    }


def main():
    text = json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"
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
