//! The Prometheus metrics of a lock node (listed in docs/observability.md). Names are fixed: the Grafana
//! dashboard (`deploy/grafana`) and the chart's alert rules use exactly these. Base units, `_total` for counters, prefix
//! `raftlock_`.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric a lock node exports, registered in one registry.
#[derive(Clone)]
pub struct NodeMetrics {
    pub registry: Registry,
    pub term: IntGauge,
    pub is_leader: IntGauge,
    pub has_leader: IntGauge,
    pub leader_changes_total: IntCounter,
    pub elections_total: IntCounter,
    pub commit_index: IntGauge,
    pub applied_index: IntGauge,
    pub last_log_index: IntGauge,
    pub replication_lag_entries: IntGaugeVec,
    pub replication_lag_seconds: GaugeVec,
    pub peer_rtt_seconds: HistogramVec,
    pub proposals_committed_total: IntCounter,
    pub proposals_failed_total: IntCounter,
    pub proposals_pending: IntGauge,
    pub fsync_duration_seconds: Histogram,
    pub flush_thread_active: IntGauge,
    pub flush_thread_switches_total: IntCounter,
    pub commit_duration_seconds: Histogram,
    pub state_write_duration_seconds: Histogram,
    pub snapshot_duration_seconds: Histogram,
    pub request_duration_seconds: HistogramVec,
    pub websocket_request_duration_seconds: HistogramVec,
    pub grpc_request_duration_seconds: HistogramVec,
    pub snapshots_total: IntCounterVec,
    pub locks_held: IntGauge,
    pub lock_delays_running: IntGauge,
    pub elections_in_use: IntGauge,
    pub lock_waiters: IntGauge,
    pub answers_remembered: IntGauge,
    pub answers_max: IntGauge,
    pub cluster_version: IntGauge,
    pub answers_recent: IntGauge,
    pub client_sessions: IntGauge,
    pub lock_wait_seconds: Histogram,
    pub lock_hold_seconds: Histogram,
    pub lock_grants_total: IntCounter,
    pub lock_releases_total: IntCounter,
    pub lock_expirations_total: IntCounter,
    pub lock_renewals_total: IntCounter,
    pub client_connections: IntGaugeVec,
    pub client_connections_refused_total: IntCounterVec,
    pub tls_reloads_total: IntCounterVec,
    pub peer_connections_refused_total: IntCounterVec,
    pub limit_refusals_total: IntCounterVec,
    pub ignored_fields_total: IntCounter,
    pub websocket_batched_requests_total: IntCounter,
    pub commit_delay_waits_total: IntCounterVec,
    pub commit_delay_seconds: Histogram,
    pub requests_total: IntCounterVec,
    pub requests_received_total: IntCounterVec,
    pub requests_forwarded_total: IntCounterVec,
    pub entries_committed_total: IntCounter,
    pub entries_applied_total: IntCounter,
    pub log_entries: IntGauge,
    pub store_size_bytes: IntGauge,
    pub election_duration_seconds: Histogram,
    pub snapshot_install_duration_seconds: Histogram,
    pub snapshot_bytes: IntGaugeVec,
    pub peer_messages_dropped_total: IntCounterVec,
    pub peer_streams_opened_total: IntCounterVec,
    pub cluster_info: IntGaugeVec,
}

impl std::fmt::Debug for NodeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeMetrics")
    }
}

const SNAPSHOT_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const ELECTION_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
];
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];
const LOCK_TIME_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

impl NodeMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m.expect("metric definition is valid");
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric names are unique");
                m
            }};
        }
        let gauge = |name: &str, help: &str| IntGauge::new(name, help);
        let counter = |name: &str, help: &str| IntCounter::new(name, help);
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        };
        let latency_by = |name: &str, help: &str, labels: &[&str]| {
            HistogramVec::new(
                HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
                labels,
            )
        };
        let metrics = NodeMetrics {
            term: reg!(gauge("raftlock_term", "Current Raft term.")),
            is_leader: reg!(gauge("raftlock_is_leader", "1 if this node is the leader.")),
            has_leader: reg!(gauge(
                "raftlock_has_leader",
                "1 if this node knows a leader."
            )),
            leader_changes_total: reg!(counter(
                "raftlock_leader_changes_total",
                "Times this node saw a new leader (a change to no leader does not count)."
            )),
            elections_total: reg!(counter(
                "raftlock_elections_total",
                "Elections this node started (after a successful PreVote)."
            )),
            commit_index: reg!(gauge(
                "raftlock_commit_index",
                "Highest committed log index."
            )),
            applied_index: reg!(gauge(
                "raftlock_applied_index",
                "Highest applied log index."
            )),
            last_log_index: reg!(gauge("raftlock_last_log_index", "Last index in the log.")),
            replication_lag_entries: reg!(IntGaugeVec::new(
                Opts::new(
                    "raftlock_replication_lag_entries",
                    "Leader only: entries a peer is behind the leader's last index."
                ),
                &["peer"]
            )),
            replication_lag_seconds: reg!(GaugeVec::new(
                Opts::new(
                    "raftlock_replication_lag_seconds",
                    "Leader only: age of the oldest entry a peer has not matched (0 when caught up)."
                ),
                &["peer"]
            )),
            peer_rtt_seconds: reg!(latency_by(
                "raftlock_peer_rtt_seconds",
                "Round trip of a heartbeat to a peer and its answer.",
                &["peer"]
            )),
            proposals_committed_total: reg!(counter(
                "raftlock_proposals_committed_total",
                "Client proposals committed and applied."
            )),
            proposals_failed_total: reg!(counter(
                "raftlock_proposals_failed_total",
                "Client proposals refused or dropped (not leader, busy, leadership lost)."
            )),
            proposals_pending: reg!(gauge(
                "raftlock_proposals_pending",
                "Client proposals waiting to commit."
            )),
            fsync_duration_seconds: reg!(hist(
                "raftlock_fsync_duration_seconds",
                "Duration of one storage flush (covers a whole Raft Ready).",
                LATENCY_BUCKETS
            )),
            flush_thread_active: reg!(gauge(
                "raftlock_flush_thread_active",
                "1 while this node's flushes run on its flush thread (--background-flush), 0 while they run on the driver's thread."
            )),
            flush_thread_switches_total: reg!(counter(
                "raftlock_flush_thread_switches_total",
                "Times --background-flush auto moved flushes to the flush thread or back."
            )),
            commit_duration_seconds: reg!(hist(
                "raftlock_commit_duration_seconds",
                "Leader only: from appending entries to its log to knowing them on a majority's disks.",
                LATENCY_BUCKETS
            )),
            state_write_duration_seconds: reg!(hist(
                "raftlock_state_write_duration_seconds",
                "Writing the applied lock state to storage (the changes since the last write, at most every 100 ms), on the driver thread.",
                LATENCY_BUCKETS
            )),
            snapshot_duration_seconds: reg!(hist(
                "raftlock_snapshot_duration_seconds",
                "Encoding a snapshot for a follower: reading and encoding the stored state (on its own thread).",
                SNAPSHOT_BUCKETS
            )),
            request_duration_seconds: reg!(latency_by(
                "raftlock_request_duration_seconds",
                "From a client request entering the driver queue of the node that executes it to its answer (time queued for a lock included).",
                &["op"]
            )),
            websocket_request_duration_seconds: reg!(latency_by(
                "raftlock_websocket_request_duration_seconds",
                "From a WebSocket request's frame read on this node to its answer written to the connection (forwarding to the leader and time queued for a lock included).",
                &["op"]
            )),
            grpc_request_duration_seconds: reg!(latency_by(
                "raftlock_grpc_request_duration_seconds",
                "From a gRPC request reaching this node's client port to its answer being ready to send (forwarding to the leader and time queued for a lock included), by service and operation.",
                &["service", "op"]
            )),
            snapshots_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_snapshots_total",
                    "Snapshots taken here (the log compacted to the stored state), encoded here for a follower that needed one, and installed from the leader."
                ),
                &["kind"]
            )),
            locks_held: reg!(gauge("raftlock_locks_held", "Locks currently held.")),
            lock_delays_running: reg!(gauge(
                "raftlock_lock_delays_running",
                "Keys held back by a running lock-delay (their holder's lease expired; no one is granted them until the delay ends)."
            )),
            elections_in_use: reg!(gauge(
                "raftlock_client_elections",
                "Keys in use as leader elections (a leader or a candidate waiting)."
            )),
            answers_remembered: reg!(gauge(
                "raftlock_answers_remembered",
                "Answers the exactly-once table keeps for retries (all client sessions)."
            )),
            answers_max: reg!(gauge(
                "raftlock_answers_max",
                "The exactly-once table's bound (--max-answers, as the cluster replicated it)."
            )),
            cluster_version: reg!(gauge(
                "raftlock_cluster_version",
                "The cluster version in this node's applied state: the log commands every member understands (raised by the leader once every member runs a RaftLock that knows the new version)."
            )),
            answers_recent: reg!(gauge(
                "raftlock_answers_recent",
                "Leader: answer-leaving requests it proposed within the retention; it paces new \
                 requests (BUSY) to keep this below raftlock_answers_max."
            )),
            client_sessions: reg!(gauge(
                "raftlock_client_sessions",
                "Open client sessions of the exactly-once table."
            )),
            lock_waiters: reg!(gauge(
                "raftlock_lock_waiters",
                "Waiters queued on all keys."
            )),
            lock_wait_seconds: reg!(hist(
                "raftlock_lock_wait_seconds",
                "Time from enqueue to grant, measured on the leader.",
                LOCK_TIME_BUCKETS
            )),
            lock_hold_seconds: reg!(hist(
                "raftlock_lock_hold_seconds",
                "Time from grant to release or expiry, measured on the leader.",
                LOCK_TIME_BUCKETS
            )),
            lock_grants_total: reg!(counter("raftlock_lock_grants_total", "Locks granted.")),
            lock_releases_total: reg!(counter("raftlock_lock_releases_total", "Locks released.")),
            lock_expirations_total: reg!(counter(
                "raftlock_lock_expirations_total",
                "Locks expired because their lease ran out."
            )),
            lock_renewals_total: reg!(counter("raftlock_lock_renewals_total", "Leases renewed.")),
            client_connections: reg!(IntGaugeVec::new(
                Opts::new(
                    "raftlock_client_connections",
                    "Open client connections by protocol: websocket (upgraded), grpc (HTTP/2) \
                     and http (HTTP/1.1 not upgraded, or not yet)."
                ),
                &["protocol"]
            )),
            client_connections_refused_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_client_connections_refused_total",
                    "Client connections refused or closed: over the connection limit (limit), over \
                     the limit per source address (address_limit), no request within the deadline \
                     (no_request), a failed TLS handshake (tls_handshake), or a WebSocket \
                     upgrade without a valid bearer token (unauthenticated)."
                ),
                &["reason"]
            )),
            tls_reloads_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_tls_reloads_total",
                    "Changed TLS certificate files taken (ok) or refused as unusable (error), \
                     by port (peer, client)."
                ),
                &["port", "result"]
            )),
            cluster_info: reg!(IntGaugeVec::new(
                Opts::new(
                    "raftlock_cluster_info",
                    "1, labelled with the id of the cluster this node belongs to (once its \
                     leader named it)."
                ),
                &["cluster_id"]
            )),
            limit_refusals_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_limit_refusals_total",
                    "Client requests this leader refused BUSY at a limit or quota, by limit \
                     (waiters_per_key, locks_held, data_entries, sessions, data_bytes, \
                     lock_bytes, identity_locks, identity_waiters, identity_sessions, other)."
                ),
                &["limit"]
            )),
            peer_connections_refused_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_peer_requests_refused_total",
                    "Peer-port requests and connections refused: no or wrong cluster token \
                     (token), a certificate that does not name the node id the request speaks \
                     for or an operator (identity), a sender from another cluster (cluster_id), \
                     an incarnation of a member that is no longer the member (incarnation), or \
                     a connection over the bound on handshakes in progress, in all (limit) or \
                     from its address (address_limit)."
                ),
                &["reason"]
            )),
            ignored_fields_total: reg!(counter(
                "raftlock_ignored_fields_total",
                "Fields of client WebSocket requests that the node does not know and ignored."
            )),
            websocket_batched_requests_total: reg!(counter(
                "raftlock_websocket_batched_requests_total",
                "Client WebSocket requests that came in batches (several requests in one frame)."
            )),
            commit_delay_waits_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_commit_delay_waits_total",
                    "Batches of client requests that waited for the next request of clients just \
                     answered (--commit-delay), by outcome: arrived (every client awaited came) \
                     or timed_out."
                ),
                &["outcome"]
            )),
            commit_delay_seconds: reg!(hist(
                "raftlock_commit_delay_seconds",
                "How long each such batch waited before it was proposed (--commit-delay).",
                &[5e-6, 10e-6, 20e-6, 40e-6, 80e-6, 160e-6, 320e-6, 640e-6, 1.28e-3]
            )),
            requests_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_requests_total",
                    "Client requests answered by this node, by operation and result (granted, \
                     ok, or an error code; a request forwarded to the leader is counted there)."
                ),
                &["op", "result"]
            )),
            requests_received_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_requests_received_total",
                    "Client requests taken off this node's driver queue to be executed here."
                ),
                &["op"]
            )),
            requests_forwarded_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_requests_forwarded_total",
                    "Client requests this follower forwarded to the leader."
                ),
                &["op"]
            )),
            entries_committed_total: reg!(counter(
                "raftlock_entries_committed_total",
                "Log entries this node learned committed (the rise of raftlock_commit_index \
                 since it started)."
            )),
            entries_applied_total: reg!(counter(
                "raftlock_entries_applied_total",
                "Log entries this node applied to its lock state (snapshot installs included)."
            )),
            log_entries: reg!(gauge(
                "raftlock_log_entries",
                "Entries in this node's Raft log since its last snapshot."
            )),
            store_size_bytes: reg!(gauge(
                "raftlock_store_size_bytes",
                "Bytes of the files under the data directory (log, state and snapshots), \
                 measured every 15 s."
            )),
            election_duration_seconds: reg!(hist(
                "raftlock_election_duration_seconds",
                "From this node starting to campaign (its first PreVote after a leader was \
                 lost) to knowing a leader, whoever won.",
                ELECTION_BUCKETS
            )),
            snapshot_install_duration_seconds: reg!(hist(
                "raftlock_snapshot_install_duration_seconds",
                "Installing a snapshot from the leader, from its first chunk to the state \
                 in place.",
                SNAPSHOT_BUCKETS
            )),
            snapshot_bytes: reg!(IntGaugeVec::new(
                Opts::new(
                    "raftlock_snapshot_bytes",
                    "Size of the last snapshot this node encoded for a follower (encoded) or \
                     installed from the leader (installed)."
                ),
                &["kind"]
            )),
            peer_messages_dropped_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_peer_messages_dropped_total",
                    "Raft messages dropped because a peer's send queue was full or it was down."
                ),
                &["peer"]
            )),
            peer_streams_opened_total: reg!(IntCounterVec::new(
                Opts::new(
                    "raftlock_peer_streams_opened_total",
                    "Raft streams this node opened to a peer, by kind: plain (length-prefixed frames) or grpc (Peer.Raft, where the peer takes no plain streams or the node is set to grpc)."
                ),
                &["peer", "kind"]
            )),
            registry,
        };
        // Every label value known in advance starts at 0, so a series exists (and a dashboard
        // panel has data) before the first event.
        for kind in ["taken", "encoded", "installed"] {
            metrics.snapshots_total.with_label_values(&[kind]);
        }
        for kind in ["encoded", "installed"] {
            metrics.snapshot_bytes.with_label_values(&[kind]);
        }
        for protocol in ["websocket", "grpc", "http"] {
            metrics.client_connections.with_label_values(&[protocol]);
        }
        for outcome in ["arrived", "timed_out"] {
            metrics
                .commit_delay_waits_total
                .with_label_values(&[outcome]);
        }
        register_process_and_build(&metrics.registry);
        metrics
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let encoder = TextEncoder::new();
        if encoder.encode(&self.registry.gather(), &mut buf).is_err() {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// Registers the process metrics (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_open_fds` and the rest, read from `/proc` at each scrape) and
/// `raftlock_build_info{version}` in `registry`: the lock node and the data store export both.
pub fn register_process_and_build(registry: &Registry) {
    #[cfg(target_os = "linux")]
    {
        // Registering twice in one registry is the only way this fails; each registry is new.
        let _ = registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
    }
    let info = IntGaugeVec::new(
        Opts::new(
            "raftlock_build_info",
            "1, labelled with the RaftLock version this process runs.",
        ),
        &["version"],
    )
    .expect("metric definition is valid");
    info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
    let _ = registry.register(Box::new(info));
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_documented_names() {
        let m = NodeMetrics::new();
        m.term.set(3);
        m.requests_total
            .with_label_values(&["acquire", "granted"])
            .inc();
        m.replication_lag_entries.with_label_values(&["2"]).set(5);
        m.replication_lag_seconds.with_label_values(&["2"]).set(1.5);
        let text = m.render();
        for name in [
            "raftlock_term 3",
            "raftlock_is_leader",
            "raftlock_leader_changes_total",
            "raftlock_fsync_duration_seconds_bucket",
            "raftlock_flush_thread_active 0",
            "raftlock_flush_thread_switches_total 0",
            "raftlock_lock_wait_seconds_bucket",
            "raftlock_requests_total{op=\"acquire\",result=\"granted\"} 1",
            "raftlock_replication_lag_entries{peer=\"2\"} 5",
            "raftlock_replication_lag_seconds{peer=\"2\"} 1.5",
            "raftlock_client_connections{protocol=\"grpc\"} 0",
            "raftlock_build_info{version=",
            "process_resident_memory_bytes",
            "process_open_fds",
        ] {
            assert!(text.contains(name), "missing {name} in:\n{text}");
        }
    }
}
