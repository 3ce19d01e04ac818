//! Executing a client request, shared by every front end (WebSocket, gRPC, seed 004's gRPC,
//! HTTP, and requests other nodes forward here): the client port's state, connection and request
//! ids, the request span, handing an operation to the driver, and forwarding it to the leader
//! when this node is a follower (the forwarding call itself is `forward.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tracing::{Instrument, Span};

use super::api::{ApiError, ClientOp, ClientReply, ErrorCode};
use super::driver::{Input, NodeStatus};
use super::transport::AddressBook;
use crate::telemetry::NodeMetrics;

/// Bounds applied at the edge, before anything reaches the driver.
#[derive(Clone, Debug)]
pub struct ClientLimits {
    pub max_connections: usize,
    pub max_inflight_per_connection: usize,
    /// Requests one WebSocket frame may carry as a JSON array (1: no batches).
    pub max_batch: usize,
    pub max_message_bytes: usize,
    pub max_key_bytes: usize,
    pub max_value_bytes: usize,
    pub max_ttl_ms: u64,
    pub default_ttl_ms: u64,
}

#[derive(Clone)]
pub struct AppState {
    pub driver: mpsc::Sender<Input>,
    pub status: watch::Receiver<NodeStatus>,
    pub metrics: NodeMetrics,
    pub limits: Arc<ClientLimits>,
    pub connections: Arc<Semaphore>,
    pub addresses: AddressBook,
    pub forwarder: Arc<super::forward::Forwarder>,
    /// Turns true when the node stops: WebSocket connections finish what is in flight and close.
    pub shutdown: watch::Receiver<bool>,
    /// Client authentication and fencing-token MACs.
    pub security: Arc<super::auth::ClientSecurity>,
    /// Applied lock events for watchers.
    pub watch: Arc<super::watch::WatchHub>,
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// A fresh connection id (also used for requests forwarded from other nodes).
pub fn next_conn() -> u64 {
    NEXT_CONN.fetch_add(1, Ordering::Relaxed)
}

/// When this process first asked, in nanoseconds since the Unix epoch: the part of the request
/// ids a node generates that differs after a restart (a process id does not: in a container it
/// is 1 every time).
pub(crate) fn process_start_stamp() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    })
}

/// The span of one client request, from its arrival at this node to its answer (debug level:
/// created only when traces are exported). A child of `traceparent` when the caller sent one.
pub fn request_span(op: &ClientOp, via: &'static str, traceparent: Option<&str>) -> Span {
    let span = tracing::debug_span!(
        "lock.request",
        otel.name = op.span_name(),
        otel.kind = "server",
        op = op.name(),
        key = %op.key(),
        client_id = op.client_id(),
        request_id = op.request_id(),
        via,
        rpc.system = tracing::field::Empty,
        rpc.method = tracing::field::Empty,
        forwarded = tracing::field::Empty,
        outcome = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_message = tracing::field::Empty,
        fencing_token = tracing::field::Empty,
        queue_position = tracing::field::Empty,
        wait_ms = tracing::field::Empty,
        trace_id = tracing::field::Empty,
    );
    if !span.is_disabled() {
        if matches!(via, "grpc" | "grpc-seed" | "forwarded") {
            span.record("rpc.system", "grpc");
            span.record("rpc.method", op.name());
        }
        crate::telemetry::adopt_parent(&span, traceparent);
    }
    span
}

/// Marks `span` failed with `code` (OpenTelemetry status ERROR and `error.type`).
pub fn mark_error(span: &Span, code: &str, message: &str) {
    span.record("error.type", code);
    span.record("otel.status_code", "ERROR");
    span.record("otel.status_message", message);
}

/// The `traceparent` a gRPC caller sent in its metadata.
pub fn traceparent_header(metadata: &tonic::metadata::MetadataMap) -> Option<String> {
    metadata
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// Records a request's answer on its span.
pub fn finish_span(span: &Span, reply: &ClientReply) {
    if span.is_disabled() {
        return;
    }
    span.record("outcome", reply.result_label());
    // One log line per answer at debug level (RUST_LOG=raftlock::server::exec=debug), carrying
    // the span's request_id and trace_id.
    span.in_scope(|| tracing::debug!(outcome = reply.result_label(), "request answered"));
    if let ClientReply::Error(e) = reply {
        // Every error answer is a failed request, WAIT_TIMEOUT included: the client did not get
        // what it asked for.
        mark_error(span, e.code.as_str(), &e.message);
    }
    if let ClientReply::Granted { token, .. } | ClientReply::Renewed { token, .. } = reply {
        // As a signed integer: OpenTelemetry has no unsigned type (u64 would become a string).
        span.record(
            "fencing_token",
            i64::try_from(token.value).unwrap_or(i64::MAX),
        );
    }
    if let ClientReply::Granted {
        queued: Some(q), ..
    } = reply
    {
        span.record("queue_position", i64::from(q.position));
        span.record("wait_ms", i64::try_from(q.waited_ms).unwrap_or(i64::MAX));
    }
}

/// Executes `op` on this node, or — on a follower that knows the leader — forwards it there.
pub async fn execute(op: ClientOp, conn: u64, state: &AppState) -> ClientReply {
    execute_traced(op, conn, state, "http", None).await
}

/// Like [`execute`], in a request span that continues the caller's trace (`traceparent`).
pub async fn execute_traced(
    op: ClientOp,
    conn: u64,
    state: &AppState,
    via: &'static str,
    traceparent: Option<&str>,
) -> ClientReply {
    let span = request_span(&op, via, traceparent);
    let reply = execute_on(op, conn, state, None, true)
        .instrument(span.clone())
        .await;
    finish_span(&span, &reply);
    reply
}

/// [`execute_traced`] for one call of a request-per-call protocol (gRPC): the call gets a
/// connection id of its own, and when the call is dropped before its answer (the client
/// cancelled, or its connection closed) the driver treats its waiters like those of a closed
/// WebSocket connection: they are cancelled after `--waiter-reclaim`.
pub async fn execute_call(
    op: ClientOp,
    state: &AppState,
    via: &'static str,
    traceparent: Option<&str>,
) -> ClientReply {
    let conn = next_conn();
    let mut gone = DisconnectOnDrop::new(state.driver.clone(), conn);
    let reply = execute_traced(op, conn, state, via, traceparent).await;
    gone.disarm();
    reply
}

/// Tells the driver that a call's connection is gone when the call is dropped before its
/// answer (disarmed once it has one: a finished call leaves nothing to reclaim).
pub struct DisconnectOnDrop {
    driver: tokio::sync::mpsc::Sender<Input>,
    conn: u64,
    armed: bool,
}

impl DisconnectOnDrop {
    pub fn new(driver: tokio::sync::mpsc::Sender<Input>, conn: u64) -> DisconnectOnDrop {
        DisconnectOnDrop {
            driver,
            conn,
            armed: true,
        }
    }

    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for DisconnectOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self
                .driver
                .try_send(Input::Disconnected { conn: self.conn });
        }
    }
}

/// Like [`execute`] (in the caller's span); `closed` ends a forwarded request when the client
/// goes away, and `forward: false` answers `NOT_LEADER` (with the leader's address) instead of
/// forwarding.
pub async fn execute_on(
    op: ClientOp,
    conn: u64,
    state: &AppState,
    closed: Option<tokio::sync::watch::Receiver<bool>>,
    forward: bool,
) -> ClientReply {
    if forward {
        if let Some(peer) = forward_target(state) {
            // Boxed, here and below: the forward's future (a gRPC call) is several times the
            // size of the rest, and a request on the leader, the usual case, never runs it.
            return Box::pin(forward_to(&peer, op, state, closed)).await;
        }
    }
    Span::current().record("forwarded", false);
    if !forward {
        return execute_here(op, conn, state).await;
    }
    let reply = execute_here(op.clone(), conn, state).await;
    // This node stopped leading between the check above and its driver's answer. The driver
    // refused the request without proposing it, so sending it to the new leader now is the same
    // as sending it there first (and a client that asked for forwarding gets no redirect).
    if let ClientReply::Error(e) = &reply {
        let me = state.status.borrow().id;
        let leader = (e.code == ErrorCode::NotLeader && e.leader_id != 0 && e.leader_id != me)
            .then(|| state.addresses.get(e.leader_id))
            .flatten()
            .map(|a| a.peer)
            .filter(|p| !p.is_empty());
        if let Some(peer) = leader {
            return Box::pin(forward_to(&peer, op, state, closed)).await;
        }
    }
    reply
}

/// Forwards `op` to the leader at `peer` (one hop) and returns its answer.
async fn forward_to(
    peer: &str,
    op: ClientOp,
    state: &AppState,
    closed: Option<tokio::sync::watch::Receiver<bool>>,
) -> ClientReply {
    state
        .metrics
        .requests_forwarded_total
        .with_label_values(&[op.name()])
        .inc();
    // A leader of a release before acknowledgements could not read them, and this follower's
    // applied cluster version may be behind the leader's: rather than strip `ackBelow` (and
    // have an answer the client takes as kept go unkept), send the client to the leader, which
    // decides with its own version.
    if let ClientOp::Sequenced { .. } = op {
        let (version, leader_id) = {
            let s = state.status.borrow();
            (s.cluster_version, s.leader_id)
        };
        if version < crate::lock::SEQUENCED_VERSION {
            let mut err = ApiError::new(
                ErrorCode::NotLeader,
                format!(
                    "node {leader_id} leads; send requests with ackBelow to it directly \
                     (this node cannot tell whether it reads them)"
                ),
            );
            err.leader_id = leader_id;
            err.leader_addr = state
                .addresses
                .get(leader_id)
                .map(|a| a.client)
                .unwrap_or_default();
            return ClientReply::Error(err);
        }
    }
    let span = Span::current();
    span.record("forwarded", true);
    // The hop to the leader is a client span of its own, the parent of the leader's server
    // span: a trace shows the time spent between the two nodes.
    let hop = if span.is_disabled() {
        Span::none()
    } else {
        tracing::debug_span!(
            "lock.forward",
            otel.name = "raftlock.peer.Peer/ForwardClient",
            otel.kind = "client",
            rpc.system = "grpc",
            rpc.service = "raftlock.peer.Peer",
            rpc.method = "ForwardClient",
            server.address = peer,
            error.type = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_message = tracing::field::Empty,
        )
    };
    let traceparent = if hop.is_disabled() {
        None
    } else {
        crate::telemetry::traceparent_of(&hop)
    };
    let reply = state
        .forwarder
        .forward(peer, &op, closed, traceparent)
        .instrument(hop.clone())
        .await;
    if let ClientReply::Error(e) = &reply {
        mark_error(&hop, e.code.as_str(), &e.message);
    }
    reply
}

/// The leader's peer address, when this node is a follower that knows one.
pub(crate) fn forward_target(state: &AppState) -> Option<String> {
    let s = state.status.borrow();
    if s.role == "leader" || s.leader_id == 0 || s.leader_id == s.id {
        return None;
    }
    state
        .addresses
        .get(s.leader_id)
        .map(|a| a.peer)
        .filter(|p| !p.is_empty())
}

/// Sends `op` to this node's driver and waits for its answer.
pub async fn execute_here(op: ClientOp, conn: u64, state: &AppState) -> ClientReply {
    let (tx, rx) = oneshot::channel();
    super::probe::client_enqueued();
    let name = op.name();
    let input = Input::Client {
        op,
        conn,
        reply: tx,
        span: Span::current(),
    };
    if state.driver.try_send(input).is_err() {
        state
            .metrics
            .requests_total
            .with_label_values(&[name, "BUSY"])
            .inc();
        return ClientReply::error(ErrorCode::Busy, "the node's request queue is full");
    }
    let started = std::time::Instant::now();
    let reply = rx
        .await
        .unwrap_or_else(|_| ClientReply::error(ErrorCode::Unavailable, "node is shutting down"));
    super::probe::client_answered();
    state
        .metrics
        .request_duration_seconds
        .with_label_values(&[name])
        .observe(started.elapsed().as_secs_f64());
    reply
}
