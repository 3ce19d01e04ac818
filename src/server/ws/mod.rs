//! The WebSocket client API at `/ws`: the seed design's JSON messages, unchanged, with optional
//! extensions. Many requests may be in flight on one connection; every reply carries `key` and
//! `requestId`. Bad input is answered with an error code and changes nothing; the connection
//! stays usable.
//!
//! Here: the request's wire fields and a connection's life (reading frames, a frame holding a
//! JSON array of requests taken as that many requests, running requests as tasks, writing the
//! answers in batches, draining at shutdown). Its children:
//! - `parse`: a text frame into a client operation, within the client port's limits;
//! - `reply`: the JSON answers, repeating the request's `key` and `requestId`;
//! - `watches`: a watch's stream of lock events on the connection.

mod parse;
mod reply;
mod watches;

pub use parse::parse_text;
use parse::to_op;
pub use reply::{error_json, Echo};
use reply::{error_reply, reply_json};
use watches::run_watch;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::ws::{Message as WsMessage, Utf8Bytes, WebSocket};
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{mpsc, Semaphore};

use tracing::Instrument;

use super::api::{ApiError, ClientOp, ErrorCode};
use super::auth::Caller;
use super::driver::Input;
use super::exec::{execute_on, finish_span, next_conn, request_span, AppState};

/// Command types of the seed design, plus extensions.
pub const APPEND_DATA: u64 = 2;
pub const LOCK_ACQUIRE: u64 = 3;
pub const LOCK_RELEASE: u64 = 4;
pub const LOCK_RENEW: u64 = 5;
pub const CANCEL_WAIT: u64 = 6;
pub const READ: u64 = 7;
/// Sets a key's lock-delay (`lockDelay` ms; 0 removes it).
pub const SET_LOCK_DELAY: u64 = 9;
/// `commandType` of a campaign to lead an election (the key).
pub const CAMPAIGN: u64 = 10;
/// `commandType` of a leader's proclaim.
pub const PROCLAIM: u64 = 11;
/// `commandType` of a read of an election's leader.
pub const LEADER: u64 = 12;
/// `commandType` of a session keepalive: opens the client's session (`session` absent or 0) or
/// keeps it alive for `ttl` ms. Names no key.
pub const KEEP_ALIVE: u64 = 13;
/// `commandType` of the end of a session (`session`): every attached lock is released.
pub const END_SESSION: u64 = 14;
/// `commandType` of an acquire of a read-write lock (`mode` `read` or `write`) or of a
/// semaphore's permit (`mode` `permit`, `permits` the size a semaphore not in use starts with).
/// Answered like an acquire; its `fencingToken` says the mode (and a permit's `slot`).
pub const ACQUIRE_SHARED: u64 = 15;
/// `commandType` of an admin's setting of a semaphore's size (`permits`; 0 forgets it).
pub const SET_PERMITS: u64 = 16;

/// A request's fields (the strings borrowed from the frame or the parsed JSON where they need no
/// unescaping). Unknown fields are refused here: the general path counts them and removes them
/// first, so only a frame of known fields parses straight into this.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WsRequest<'a> {
    command_type: u64,
    /// Required by every command but the session commands, which name none.
    #[serde(default, borrow)]
    key: Cow<'a, str>,
    #[serde(default, borrow)]
    client_id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    request_id: Option<Cow<'a, str>>,
    #[serde(default)]
    ttl: Option<u64>,
    #[serde(default)]
    wait_timeout: Option<u64>,
    #[serde(default)]
    fencing_token: Option<WsToken>,
    /// AppendData: the value to store (absent with `delete: true`).
    #[serde(default, borrow)]
    value: Option<Cow<'a, str>>,
    #[serde(default)]
    delete: Option<bool>,
    /// Answer `NOT_LEADER` with the leader's address instead of forwarding to the leader.
    #[serde(default)]
    redirect: Option<bool>,
    /// W3C trace context of the caller's span: this request's span becomes its child.
    #[serde(default, borrow)]
    traceparent: Option<Cow<'a, str>>,
    /// The client has the answer of each of its requests numbered below this (the request id is
    /// then the request's sequence number): the cluster forgets those answers.
    #[serde(default)]
    ack_below: Option<u64>,
    /// SetLockDelay: the key's lock-delay in ms.
    #[serde(default)]
    lock_delay: Option<u64>,
    /// KeepAlive and EndSession: the session (the log index that opened it; 0 opens one).
    #[serde(default)]
    session: Option<u64>,
    /// AcquireShared: `read`, `write` or `permit`.
    #[serde(default, borrow)]
    mode: Option<Cow<'a, str>>,
    /// AcquireShared of a permit, and SetPermits: a semaphore's size.
    #[serde(default)]
    permits: Option<u32>,
}

/// The top-level fields of a request (`WsRequest`'s); others are ignored, and counted.
const KNOWN_FIELDS: &[&str] = &[
    "commandType",
    "lockDelay",
    "key",
    "clientId",
    "requestId",
    "ttl",
    "waitTimeout",
    "fencingToken",
    "value",
    "delete",
    "redirect",
    "traceparent",
    "ackBelow",
    "session",
    "mode",
    "permits",
];

#[derive(Debug, Deserialize)]
struct WsToken {
    /// The lock the token belongs to (defaults to the request's key).
    #[serde(default)]
    key: Option<String>,
    value: u64,
}

/// How long a stopping node waits for a connection's requests in flight before closing it.
const SHUTDOWN_DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// What every request of one WebSocket connection shares. The connection's requests run as
/// tasks of their own, and each holds one reference to this instead of copies of its parts:
/// cloning the node's state (its metrics alone are 43 shared handles) and the connection's
/// channels for every request, and dropping them again, cost the leader about 2% of its CPU
/// at 32 clients (`perf record`, 2026-11-28).
struct Connection {
    state: AppState,
    caller: Caller,
    /// Replies go to the connection's writer task.
    out: mpsc::Sender<Outgoing>,
    /// Turns true when the connection closes: forwarded requests stop waiting for the leader.
    closed: tokio::sync::watch::Receiver<bool>,
    /// Watches open on the connection.
    watches: Arc<std::sync::atomic::AtomicUsize>,
}

/// A frame for a connection's writer task.
struct Outgoing {
    text: String,
    /// For the answer to a request: when the request's frame was read and its operation, so
    /// that the writer records the request in `raftlock_websocket_request_duration_seconds`
    /// once the answer is written.
    timed: Option<(Instant, &'static str)>,
}

impl From<String> for Outgoing {
    fn from(text: String) -> Self {
        Outgoing { text, timed: None }
    }
}

/// Answers a connection's writer gathers into one write at most (see `serve_socket`).
const WRITE_BATCH_FRAMES: usize = 64;

/// The header of the WebSocket upgrade's answer that says this node takes batches (a frame
/// that holds a JSON array of requests, each its own request with its own answer frame and
/// one of the connection's in-flight slots), and how many requests one may hold
/// (`--max-batch`): a client sends arrays only to a node that names it.
pub const BATCH_HEADER: &str = "raftlock-batch-max";

/// The header of the WebSocket upgrade's answer with the largest frame the node reads
/// (`--max-message-bytes`): a batch must fit in it whole.
pub const MESSAGE_BYTES_HEADER: &str = "raftlock-max-message-bytes";

/// A connection's handles to one histogram per operation label, looked up once each: asking the
/// labelled family for a child hashes the label and takes its lock on every call.
struct OpHistograms {
    family: prometheus::HistogramVec,
    children: Vec<(&'static str, prometheus::Histogram)>,
}

impl OpHistograms {
    fn new(family: prometheus::HistogramVec) -> Self {
        OpHistograms {
            family,
            children: Vec::new(),
        }
    }

    fn get(&mut self, op: &'static str) -> &prometheus::Histogram {
        let at = match self.children.iter().position(|(name, _)| *name == op) {
            Some(at) => at,
            None => {
                let child = self.family.with_label_values(&[op]);
                self.children.push((op, child));
                self.children.len() - 1
            }
        };
        &self.children[at].1
    }
}

/// Operation label of a request answered before it was understood (malformed, invalid, or
/// refused for a full connection).
const INVALID_OP: &str = "invalid";

/// Serves one WebSocket connection until it closes.
pub async fn serve_socket(socket: WebSocket, state: AppState, caller: Caller) {
    let conn = next_conn();
    // This connection counts as WebSocket, no longer as HTTP, until it ends (the listener
    // counted it as HTTP/1.1 and takes it off when the TCP connection closes).
    let websocket = state
        .metrics
        .client_connections
        .with_label_values(&["websocket"]);
    let http = state
        .metrics
        .client_connections
        .with_label_values(&["http"]);
    websocket.inc();
    http.dec();
    let (closed_tx, closed_rx) = tokio::sync::watch::channel(false);
    let (mut sink, mut stream) = socket.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Outgoing>(state.limits.max_inflight_per_connection);
    let timings = state.metrics.websocket_request_duration_seconds.clone();
    let inflight = Arc::new(Semaphore::new(state.limits.max_inflight_per_connection));
    let max_inflight = state.limits.max_inflight_per_connection;
    let writer_inflight = inflight.clone();
    let writer = tokio::spawn(async move {
        // Answers that are ready together go out in one write: the first is queued in the
        // sink, then whatever else is already waiting (up to `WRITE_BATCH_FRAMES`), then one
        // flush. A client with many requests in flight on one connection gets several answers
        // per system call on both ends; a client with one gets its answer as before.
        let mut timed_batch: Vec<(Instant, &'static str)> = Vec::new();
        let mut op_timings = OpHistograms::new(timings);
        'write: while let Some(first) = out_rx.recv().await {
            let mut next = Some(first);
            let mut frames = 0;
            while let Some(Outgoing { text, timed }) = next.take() {
                if sink.feed(WsMessage::Text(text.into())).await.is_err() {
                    break 'write;
                }
                timed_batch.extend(timed);
                frames += 1;
                if frames == WRITE_BATCH_FRAMES {
                    break;
                }
                next = out_rx.try_recv().ok();
                // Other requests of this connection are still being answered (a burst of
                // answers from one commit): let their tasks run first, then take what they
                // queued, instead of a write each.
                if next.is_none()
                    && frames == 1
                    && max_inflight - writer_inflight.available_permits() > 1
                {
                    tokio::task::yield_now().await;
                    next = out_rx.try_recv().ok();
                }
            }
            if sink.flush().await.is_err() {
                break;
            }
            for (read_at, op) in timed_batch.drain(..) {
                op_timings.get(op).observe(read_at.elapsed().as_secs_f64());
            }
        }
        let _ = sink.close().await;
    });
    let mut shutdown = state.shutdown.clone();
    let shared = Arc::new(Connection {
        state,
        caller,
        out: out_tx,
        closed: closed_rx,
        watches: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
    });
    loop {
        let frame = tokio::select! {
            frame = stream.next() => frame,
            _ = async { shutdown.wait_for(|s| *s).await.map(|_| ()) } => {
                // The node is stopping: take no new request, give the ones in flight a moment
                // to be answered (a queued waiter may not be), then close, so that a rolling
                // restart does not wait on open connections.
                let all = shared.state.limits.max_inflight_per_connection as u32;
                let _ = tokio::time::timeout(SHUTDOWN_DRAIN, inflight.acquire_many(all)).await;
                break;
            }
        };
        let Some(Ok(frame)) = frame else { break };
        let read_at = Instant::now();
        let text = match frame {
            WsMessage::Text(t) => t,
            WsMessage::Binary(b) => match Utf8Bytes::try_from(b) {
                Ok(t) => t,
                Err(_) => {
                    let reply = error_json(
                        &Value::Null,
                        &ApiError::new(
                            ErrorCode::InvalidRequest,
                            "binary frames must be UTF-8 JSON",
                        ),
                    );
                    let timed = Some((read_at, INVALID_OP));
                    let _ = shared.out.send(Outgoing { text: reply, timed }).await;
                    continue;
                }
            },
            WsMessage::Close(_) => break,
            _ => continue,
        };
        if text.trim_start().starts_with('[') {
            // A batch: each request in it runs as if it had come in a frame of its own.
            match batch_items(&text, shared.state.limits.max_batch) {
                Ok(items) => {
                    let batched = &shared.state.metrics.websocket_batched_requests_total;
                    batched.inc_by(items.len() as u64);
                    for range in items {
                        start_request(&shared, &inflight, conn, read_at, text.clone(), range).await;
                    }
                }
                Err(e) => {
                    let text = error_json(&Value::Null, &e);
                    let timed = Some((read_at, INVALID_OP));
                    let _ = shared.out.send(Outgoing { text, timed }).await;
                }
            }
            continue;
        }
        let whole = 0..text.len();
        start_request(&shared, &inflight, conn, read_at, text, whole).await;
    }
    let _ = closed_tx.send(true);
    let _ = shared.state.driver.send(Input::Disconnected { conn }).await;
    // The writer ends once the last request in flight has dropped its reference (and with it
    // the last sender of replies).
    drop(shared);
    let _ = writer.await;
    websocket.dec();
    http.inc();
}

/// Starts one request, `frame[range]`, as a task of its own holding one of the connection's
/// in-flight slots; a connection without a free slot is answered `BUSY` for it.
async fn start_request(
    shared: &Arc<Connection>,
    inflight: &Arc<Semaphore>,
    conn: u64,
    read_at: Instant,
    frame: Utf8Bytes,
    range: std::ops::Range<usize>,
) {
    let Ok(permit) = inflight.clone().try_acquire_owned() else {
        let raw: Value = serde_json::from_str(&frame[range]).unwrap_or(Value::Null);
        let err = ApiError::new(
            ErrorCode::Busy,
            "too many requests in flight on this connection",
        );
        let text = error_json(&raw, &err);
        let timed = Some((read_at, INVALID_OP));
        let _ = shared.out.send(Outgoing { text, timed }).await;
        return;
    };
    let shared = shared.clone();
    // The request's future is large (parsing, the driver call, tracing; the forward is
    // boxed on its own): boxed, it is written once to the heap, where a task of that size
    // was copied whole into its slot when spawned and again when it finished (`memcpy` was
    // about 3% of the leader's instructions per lock cycle at 4 KB).
    tokio::spawn(async move {
        let text = &frame[range];
        if let Some((text, op)) = Box::pin(handle_text(text, conn, &shared)).await {
            let timed = Some((read_at, op));
            let _ = shared.out.send(Outgoing { text, timed }).await;
        }
        drop(permit);
    });
}

/// Where each request of a batch frame (a JSON array of requests) lies in the frame. An array
/// that does not parse, is empty or holds more than `max` requests (`--max-batch`) is
/// refused whole, and none of its requests runs; a request in it that is not a valid request
/// is answered like a frame of its own would be.
fn batch_items(frame: &str, max: usize) -> Result<Vec<std::ops::Range<usize>>, ApiError> {
    let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(frame).map_err(|err| {
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!("malformed batch (a JSON array of requests): {err}"),
        )
    })?;
    if items.is_empty() || items.len() > max {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!(
                "a batch holds 1 to {max} requests, this one {}",
                items.len()
            ),
        ));
    }
    let base = frame.as_ptr() as usize;
    Ok(items
        .iter()
        .map(|item| {
            let start = item.get().as_ptr() as usize - base;
            start..start + item.get().len()
        })
        .collect())
}

/// Parses, validates and executes one request; returns the JSON reply and the request's
/// operation (nothing for a watch, which answers on its own).
async fn handle_text(text: &str, conn: u64, c: &Connection) -> Option<(String, &'static str)> {
    let (state, caller) = (&c.state, &c.caller);
    let closed = || Some(c.closed.clone());
    // Most frames hold only known fields with string ids: they parse straight into their typed
    // form, borrowing from the frame, without building a JSON tree first (a map, and a string
    // for every key and value). Any other frame (unknown or repeated fields, other types, a
    // watch, malformed JSON) takes the general path below, which answers as it always has.
    if let Ok(request) = serde_json::from_str::<WsRequest>(text) {
        if request.command_type != WATCH_COMMAND {
            let echo = Echo::of_request(&request);
            return Some(execute_request(request, echo, conn, state, caller, closed()).await);
        }
    }
    let mut raw: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(err) => {
            let e = ApiError::new(ErrorCode::InvalidRequest, format!("malformed JSON: {err}"));
            return Some((error_json(&Value::Null, &e), INVALID_OP));
        }
    };
    // Fields from newer clients (or other designs) are ignored, and counted.
    if let Some(fields) = raw.as_object() {
        let unknown = fields
            .keys()
            .filter(|k| !KNOWN_FIELDS.contains(&k.as_str()))
            .count();
        if unknown > 0 {
            state.metrics.ignored_fields_total.inc_by(unknown as u64);
        }
    }
    if raw.get("commandType").and_then(Value::as_u64) == Some(WATCH_COMMAND) {
        let ctx = WatchCtx {
            out: c.out.clone(),
            count: c.watches.clone(),
        };
        return match Box::pin(run_watch(&raw, state, caller, ctx, c.closed.clone())).await {
            Ok(()) => None,
            Err(e) => Some((error_json(&raw, &e), "watch")),
        };
    }
    strip_unknown_fields(&mut raw);
    let request = match WsRequest::deserialize(&raw) {
        Ok(r) => r,
        Err(err) => {
            let e = ApiError::new(ErrorCode::InvalidRequest, format!("invalid request: {err}"));
            return Some((error_json(&raw, &e), INVALID_OP));
        }
    };
    Some(execute_request(request, Echo::of(&raw), conn, state, caller, closed()).await)
}

/// Removes the fields `WsRequest` does not know (after they were counted), so that what is left
/// parses into it.
fn strip_unknown_fields(raw: &mut Value) {
    if let Some(fields) = raw.as_object_mut() {
        fields.retain(|k, _| KNOWN_FIELDS.contains(&k.as_str()));
    }
}

/// Checks, authorizes and executes one parsed request; returns the JSON reply and the request's
/// operation.
async fn execute_request(
    request: WsRequest<'_>,
    echo: Echo<'_>,
    conn: u64,
    state: &AppState,
    caller: &Caller,
    closed: Option<tokio::sync::watch::Receiver<bool>>,
) -> (String, &'static str) {
    let forward = !request.redirect.unwrap_or(false);
    let traceparent = request.traceparent.as_deref().map(str::to_owned);
    let mut op = match to_op(request, &state.limits, conn) {
        Ok(op) => op,
        Err(e) => return (error_reply(echo, &e), INVALID_OP),
    };
    let name = op.name();
    if let Err(e) = caller.authorize(&mut op) {
        return (error_reply(echo, &e), name);
    }
    let release = matches!(
        op.request(),
        ClientOp::Release { .. } | ClientOp::ReleaseHeld { .. }
    );
    let span = request_span(&op, "websocket", traceparent.as_deref());
    let reply = execute_on(op, conn, state, closed, forward)
        .instrument(span.clone())
        .await;
    finish_span(&span, &reply);
    let text = reply_json(echo, &reply, release, state.security.fencing_key.as_ref());
    (text, name)
}

/// `commandType` of a watch request.
pub const WATCH_COMMAND: u64 = 8;

/// What a watch needs from its connection.
pub struct WatchCtx {
    out: mpsc::Sender<Outgoing>,
    /// Watches open on the connection.
    count: Arc<std::sync::atomic::AtomicUsize>,
}

#[cfg(test)]
mod tests;
