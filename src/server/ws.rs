//! The WebSocket client API at `/ws`: the seed design's JSON messages, unchanged, with optional
//! extensions. Many requests may be in flight on one connection; every reply carries `key` and
//! `requestId`. Bad input is answered with an error code and changes nothing; the connection
//! stays usable.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::ws::{Message as WsMessage, Utf8Bytes, WebSocket};
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

use tracing::Instrument;

use super::api::{ApiError, ClientOp, ClientReply, ErrorCode};
use super::auth::Caller;
use super::driver::Input;
use super::exec::{
    execute_on, finish_span, next_conn, process_start_stamp, request_span, AppState, ClientLimits,
};
use crate::fencing::FencingKey;
use crate::lock::FencingToken;

/// Command types of the seed design, plus extensions.
pub const APPEND_DATA: u64 = 2;
pub const LOCK_ACQUIRE: u64 = 3;
pub const LOCK_RELEASE: u64 = 4;
pub const LOCK_RENEW: u64 = 5;
pub const CANCEL_WAIT: u64 = 6;
pub const READ: u64 = 7;

/// A request's fields (the strings borrowed from the frame or the parsed JSON where they need no
/// unescaping). Unknown fields are refused here: the general path counts them and removes them
/// first, so only a frame of known fields parses straight into this.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WsRequest<'a> {
    command_type: u64,
    #[serde(borrow)]
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
}

/// The top-level fields of a request (`WsRequest`'s); others are ignored, and counted.
const KNOWN_FIELDS: &[&str] = &[
    "commandType",
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
];

/// What a reply repeats from its request: `key` and `requestId`, as the client sent them.
#[derive(Clone, Debug)]
pub struct Echo<'a> {
    key: EchoValue<'a>,
    request_id: EchoValue<'a>,
}

#[derive(Clone, Debug, serde::Serialize)]
#[serde(untagged)]
enum EchoValue<'a> {
    Json(&'a Value),
    Text(Cow<'a, str>),
}

impl<'a> Echo<'a> {
    /// The fields of a request parsed as JSON (`null` where absent).
    pub fn of(raw: &'a Value) -> Self {
        Echo {
            key: EchoValue::Json(raw.get("key").unwrap_or(&Value::Null)),
            request_id: EchoValue::Json(raw.get("requestId").unwrap_or(&Value::Null)),
        }
    }

    fn of_request(request: &WsRequest<'a>) -> Self {
        Echo {
            key: EchoValue::Text(request.key.clone()),
            request_id: request
                .request_id
                .clone()
                .map_or(EchoValue::Json(&Value::Null), EchoValue::Text),
        }
    }
}

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
    state.metrics.client_connections.inc();
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
        let Ok(permit) = inflight.clone().try_acquire_owned() else {
            let raw: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let err = ApiError::new(
                ErrorCode::Busy,
                "too many requests in flight on this connection",
            );
            let text = error_json(&raw, &err);
            let timed = Some((read_at, INVALID_OP));
            let _ = shared.out.send(Outgoing { text, timed }).await;
            continue;
        };
        let shared = shared.clone();
        // The request's future is large (parsing, the driver call, tracing; the forward is
        // boxed on its own): boxed, it is written once to the heap, where a task of that size
        // was copied whole into its slot when spawned and again when it finished (`memcpy` was
        // about 3% of the leader's instructions per lock cycle at 4 KB).
        tokio::spawn(async move {
            if let Some((text, op)) = Box::pin(handle_text(&text, conn, &shared)).await {
                let timed = Some((read_at, op));
                let _ = shared.out.send(Outgoing { text, timed }).await;
            }
            drop(permit);
        });
    }
    let _ = closed_tx.send(true);
    let _ = shared.state.driver.send(Input::Disconnected { conn }).await;
    let metrics = shared.state.metrics.client_connections.clone();
    // The writer ends once the last request in flight has dropped its reference (and with it
    // the last sender of replies).
    drop(shared);
    let _ = writer.await;
    metrics.dec();
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

/// Ends a watch's count when the watch ends, however it ends.
struct WatchSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for WatchSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one watch until the connection closes, the node stops, or the client falls too far
/// behind. Request: `{"commandType": 8, "requestId": R, "key": PREFIX, "fromIndex": N}` (`key`
/// and `fromIndex` optional). Answer: `{"success": true, "watching": true, "index": I, ...}`, then
/// one frame per event with the watch's `requestId`, in log order.
async fn run_watch(
    raw: &Value,
    state: &AppState,
    caller: &Caller,
    ctx: WatchCtx,
    mut closed: tokio::sync::watch::Receiver<bool>,
) -> Result<(), ApiError> {
    use super::watch::MAX_WATCHES_PER_CONNECTION;
    let invalid = |m: String| ApiError::new(ErrorCode::InvalidRequest, m);
    let prefix = match raw.get("key") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(k)) => k.clone(),
        Some(other) => {
            return Err(invalid(format!(
                "`key` (the prefix) must be a string, not {other}"
            )))
        }
    };
    if prefix.len() > state.limits.max_key_bytes {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            "the prefix exceeds the key limit",
        ));
    }
    let from = match raw.get("fromIndex") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| invalid(format!("`fromIndex` must be a log index, not {v}")))?,
        ),
    };
    caller.check_read(&prefix)?;
    if ctx.count.fetch_add(1, Ordering::Relaxed) >= MAX_WATCHES_PER_CONNECTION {
        ctx.count.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::new(
            ErrorCode::Busy,
            format!("at most {MAX_WATCHES_PER_CONNECTION} watches per connection"),
        ));
    }
    let _slot = WatchSlot(ctx.count.clone());
    let sub = state.watch.subscribe(&prefix, from).map_err(|too_old| {
        invalid(format!(
            "fromIndex {} is older than the events this node keeps (resume from {} or later, or \
             read /locks and watch from now)",
            from.unwrap_or(0),
            too_old.oldest
        ))
    })?;
    let request_id = raw.get("requestId").cloned().unwrap_or(Value::Null);
    // Fencing tokens only for callers who may see others' tokens (as in `GET /locks`).
    let sees_tokens = caller.sees_tokens();
    let frame = |item: &super::watch::WatchItem| {
        let mut v = serde_json::to_value(item).unwrap_or(Value::Null);
        if !sees_tokens {
            if let Some(fields) = v.as_object_mut() {
                fields.remove("token");
            }
        }
        v["requestId"] = request_id.clone();
        v.to_string()
    };
    // A watch lasts no longer than its caller's token: it then ends `UNAUTHENTICATED`.
    let expiry = caller.expires_in();
    let expired = async move {
        match expiry {
            Some(after) => tokio::time::sleep(after).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expired);
    let ack = json!({"success": true, "watching": true, "key": prefix,
                     "requestId": request_id, "index": sub.index});
    if ctx.out.send(ack.to_string().into()).await.is_err() {
        return Ok(());
    }
    let mut last = from.unwrap_or(sub.index);
    for item in &sub.backlog {
        if ctx.out.send(frame(item).into()).await.is_err() {
            return Ok(());
        }
        last = last.max(item.index());
    }
    let mut live = sub.live;
    let mut shutdown = state.shutdown.clone();
    loop {
        let next = tokio::select! {
            next = live.recv() => next,
            _ = closed.wait_for(|c| *c) => return Ok(()),
            _ = shutdown.wait_for(|s| *s) => return Ok(()),
            _ = &mut expired => {
                return Err(ApiError::new(
                    ErrorCode::Unauthenticated,
                    "the bearer token has expired: the watch ended; watch again with a fresh \
                     token (fromIndex resumes where it stopped)",
                ))
            }
        };
        match next {
            Ok(item) => {
                let is_lock = matches!(*item, super::watch::WatchItem::Lock(_));
                if is_lock && item.index() <= sub.index || !item.matches(&prefix) {
                    continue;
                }
                if ctx.out.send(frame(&item).into()).await.is_err() {
                    return Ok(());
                }
                if is_lock {
                    last = last.max(item.index());
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                // Too slow: end the watch rather than buffer without bound. Resuming from the
                // last index delivered loses nothing (while the node still keeps those events).
                let end = json!({"event": "lagged", "requestId": request_id, "resumeFrom": last,
                                 "message": "the watch fell too far behind and ended; watch again with fromIndex"});
                let _ = ctx.out.send(end.to_string().into()).await;
                return Ok(());
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return Ok(()),
        }
    }
}

/// A request id for an acquire that came without one and may wait (seed 000's client sends
/// none): unique per request, so any number of requests on one connection — queued on many
/// keys, say — are each tracked and answered. Such requests are not deduplicated across
/// retries.
fn auto_request_id(conn: u64) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let boot = process_start_stamp();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("~{boot:x}.{conn}.{n}")
}

/// What [`handle_text`] makes of a text frame before it executes anything: the operation, or
/// the JSON error reply the frame is answered with. For the fuzz targets in `fuzz/`.
#[doc(hidden)]
pub fn parse_text(text: &str, limits: &ClientLimits, conn: u64) -> Result<ClientOp, String> {
    if let Ok(request) = serde_json::from_str::<WsRequest>(text) {
        if request.command_type != WATCH_COMMAND {
            let echo = Echo::of_request(&request);
            return to_op(request, limits, conn).map_err(|e| error_reply(echo, &e));
        }
    }
    parse_general(text, limits, conn)
}

/// [`parse_text`] without the typed fast path: what every frame went through before it, and what
/// frames with unknown or repeated fields still do.
fn parse_general(text: &str, limits: &ClientLimits, conn: u64) -> Result<ClientOp, String> {
    let mut raw: Value = serde_json::from_str(text).map_err(|err| {
        let e = ApiError::new(ErrorCode::InvalidRequest, format!("malformed JSON: {err}"));
        error_json(&Value::Null, &e)
    })?;
    strip_unknown_fields(&mut raw);
    let request = WsRequest::deserialize(&raw).map_err(|err| {
        let e = ApiError::new(ErrorCode::InvalidRequest, format!("invalid request: {err}"));
        error_json(&raw, &e)
    })?;
    to_op(request, limits, conn).map_err(|e| error_json(&raw, &e))
}

fn to_op(r: WsRequest<'_>, limits: &ClientLimits, conn: u64) -> Result<ClientOp, ApiError> {
    let invalid = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m);
    if r.key.is_empty() {
        return Err(invalid("`key` must not be empty"));
    }
    if r.key.len() > limits.max_key_bytes {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            format!(
                "key is {} bytes; the limit is {}",
                r.key.len(),
                limits.max_key_bytes
            ),
        ));
    }
    let client_id = r.client_id.map(Cow::into_owned).unwrap_or_default();
    let needs_client = r.command_type != READ;
    if needs_client && client_id.is_empty() {
        return Err(invalid("`clientId` is required"));
    }
    // A request sent without an id gets one of the node's only when it needs one: an acquire
    // that may wait is answered when it is granted, and that answer finds its request by id.
    // Any other request is answered at once and goes without, so that its answer, which no
    // client could ask for again, takes no room in the exactly-once table and is not paced by
    // the table's bound.
    // (A cancel names the acquire it cancels by id: sent without one, it gets a fresh one, which
    // cancels nothing, as it always did.)
    let needs_id = match r.command_type {
        LOCK_ACQUIRE => r.wait_timeout != Some(0),
        CANCEL_WAIT => true,
        _ => false,
    };
    let request_id = match r.request_id {
        Some(id) if !id.is_empty() => id.into_owned(),
        _ if needs_id => auto_request_id(conn),
        _ => String::new(),
    };
    // A guarded write names the lock whose token guards it; other commands use the key itself.
    let guard = r.fencing_token.as_ref().map(|t| FencingToken {
        key: t.key.clone().unwrap_or_else(|| r.key.to_string()),
        value: t.value,
    });
    if guard
        .as_ref()
        .is_some_and(|g| g.key.len() > limits.max_key_bytes)
    {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            "the fencing token's key exceeds the key limit",
        ));
    }
    let token = r.fencing_token.map(|t| t.value);
    let key = r.key.into_owned();
    let ack_below = r.ack_below;
    let op = match r.command_type {
        LOCK_ACQUIRE => {
            let ttl_ms = r.ttl.unwrap_or(limits.default_ttl_ms);
            if ttl_ms == 0 || ttl_ms > limits.max_ttl_ms {
                return Err(invalid(&format!(
                    "`ttl` must be 1..={} ms",
                    limits.max_ttl_ms
                )));
            }
            ClientOp::Acquire {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms: r.wait_timeout,
            }
        }
        LOCK_RELEASE => match token {
            Some(token) => ClientOp::Release {
                key,
                client_id,
                request_id,
                token,
            },
            // Seed 000's release names no token: it releases if `clientId` holds the lock.
            None => ClientOp::ReleaseHeld {
                key,
                client_id,
                request_id,
            },
        },
        LOCK_RENEW => ClientOp::Renew {
            key,
            client_id,
            request_id,
            token: token.ok_or_else(|| invalid("`fencingToken` is required to renew"))?,
            ttl_ms: r.ttl.unwrap_or(limits.default_ttl_ms),
        },
        CANCEL_WAIT => ClientOp::CancelWait {
            key,
            client_id,
            request_id,
        },
        APPEND_DATA => {
            if r.delete.unwrap_or(false) {
                ClientOp::Delete {
                    key,
                    guard: guard.clone(),
                    client_id,
                    request_id,
                }
            } else {
                let value = r.value.ok_or_else(|| invalid("`value` is required"))?;
                if value.len() > limits.max_value_bytes {
                    return Err(ApiError::new(
                        ErrorCode::TooLarge,
                        "value exceeds the limit",
                    ));
                }
                ClientOp::Put {
                    key,
                    value: value.into_owned().into_bytes(),
                    guard: guard.clone(),
                    client_id,
                    request_id,
                }
            }
        }
        READ => ClientOp::Get { key },
        0 | 1 => {
            return Err(invalid(
                "membership commands are for peers and admins, not clients",
            ))
        }
        other => return Err(invalid(&format!("unknown commandType {other}"))),
    };
    ClientOp::sequenced(op, ack_below)
}

pub fn error_json(raw: &Value, e: &ApiError) -> String {
    error_reply(Echo::of(raw), e)
}

/// The error reply to a request whose echoed fields are `echo`.
fn error_reply(echo: Echo<'_>, e: &ApiError) -> String {
    let Echo { key, request_id } = echo;
    let mut error = json!({"code": e.code.as_str(), "message": e.message});
    if e.leader_id != 0 {
        error["leaderId"] = json!(e.leader_id);
        error["leaderAddr"] = json!(e.leader_addr);
    }
    if let Some(token) = e.current_token {
        error["currentToken"] = json!(token);
    }
    json!({"success": false, "key": key, "requestId": request_id, "error": error}).to_string()
}

/// A fencing token as JSON, with its MAC when the node has a fencing key.
#[derive(serde::Serialize)]
struct TokenJson<'a> {
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    mac: Option<String>,
    value: u64,
}

impl<'a> TokenJson<'a> {
    fn new(token: &'a FencingToken, key: Option<&FencingKey>) -> Self {
        TokenJson {
            key: &token.key,
            mac: key.map(|k| k.mac(&token.key, token.value)),
            value: token.value,
        }
    }
}

/// A successful reply. Written straight from borrowed fields rather than built as a
/// `serde_json::Value` first (this runs for every request); fields are declared in
/// alphabetical order, the order the replies have always had.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct OkReply<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    cancelled: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_in_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fencing_token: Option<TokenJson<'a>>,
    key: EchoValue<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    renewed: Option<bool>,
    request_id: EchoValue<'a>,
    success: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<Option<std::borrow::Cow<'a, str>>>,
}

fn reply_json(
    echo: Echo<'_>,
    reply: &ClientReply,
    release: bool,
    fencing_key: Option<&FencingKey>,
) -> String {
    let mut ok = OkReply {
        cancelled: None,
        deleted: None,
        expires_in_ms: None,
        fencing_token: None,
        key: echo.key.clone(),
        released: None,
        renewed: None,
        request_id: echo.request_id.clone(),
        success: true,
        value: None,
    };
    match reply {
        ClientReply::Granted {
            token,
            expires_in_ms,
            ..
        } => {
            ok.fencing_token = Some(TokenJson::new(token, fencing_key));
            ok.expires_in_ms = Some(*expires_in_ms);
        }
        ClientReply::Released => ok.released = Some(true),
        ClientReply::Renewed {
            token,
            expires_in_ms,
        } => {
            ok.renewed = Some(true);
            ok.fencing_token = Some(TokenJson::new(token, fencing_key));
            ok.expires_in_ms = Some(*expires_in_ms);
        }
        ClientReply::WaitCancelled => ok.cancelled = Some(true),
        ClientReply::Stored => {}
        ClientReply::Deleted { existed } => ok.deleted = Some(*existed),
        ClientReply::Value(v) => ok.value = Some(v.as_deref().map(String::from_utf8_lossy)),
        ClientReply::Error(e) => {
            let mut text: Value =
                serde_json::from_str(&error_reply(echo, e)).unwrap_or(Value::Null);
            if release {
                text["released"] = json!(false);
            }
            return text.to_string();
        }
    }
    serde_json::to_string(&ok).unwrap_or_else(|e| {
        error_reply(
            echo,
            &ApiError::new(
                ErrorCode::Unavailable,
                format!("cannot write the reply: {e}"),
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_fast_path_parses_and_answers_as_the_general_path() {
        let limits = ClientLimits {
            max_connections: 10,
            max_inflight_per_connection: 10,
            max_message_bytes: 65536,
            max_key_bytes: 64,
            max_value_bytes: 1024,
            max_ttl_ms: 60_000,
            default_ttl_ms: 10_000,
        };
        let frames = [
            r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r1","ttl":5000}"#,
            r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r1","waitTimeout":0,"redirect":true,"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#,
            r#"{"commandType":4,"key":"jobs/a","clientId":"c1","requestId":"r2","fencingToken":{"key":"jobs/a","value":42,"mac":"00"}}"#,
            r#"{"commandType":4,"key":"jobs/a","clientId":"c1","requestId":"r2"}"#,
            r#"{"commandType":5,"key":"jobs/a","clientId":"c1","requestId":"r3","fencingToken":{"value":42}}"#,
            r#"{"commandType":6,"key":"jobs/a","clientId":"c1","requestId":"r4"}"#,
            r#"{"commandType":2,"key":"data/x","clientId":"c1","requestId":"r5","value":"v\u00e9","fencingToken":{"key":"jobs/a","value":42}}"#,
            r#"{"commandType":2,"key":"data/x","clientId":"c1","requestId":"r6","delete":true}"#,
            r#"{"commandType":7,"key":"data/x"}"#,
            r#"{"commandType":3,"key":"jobs\/\u0061","clientId":"c\n1","requestId":"r\"7"}"#,
            // Refused, with the same error reply on both paths.
            r#"{"commandType":3,"key":"","clientId":"c1","requestId":"r8"}"#,
            r#"{"commandType":3,"key":"jobs/a","requestId":"r9"}"#,
            r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r10","ttl":0}"#,
            r#"{"commandType":5,"key":"jobs/a","clientId":"c1","requestId":"r11"}"#,
            r#"{"commandType":2,"key":"data/x","clientId":"c1","requestId":"r12"}"#,
            r#"{"commandType":99,"key":"jobs/a","clientId":"c1","requestId":"r13"}"#,
            r#"{"commandType":0,"key":"jobs/a","clientId":"c1","requestId":null}"#,
        ];
        for frame in frames {
            assert!(
                serde_json::from_str::<WsRequest>(frame).is_ok(),
                "not on the fast path: {frame}"
            );
            let fast = format!("{:?}", parse_text(frame, &limits, 1));
            let general = format!("{:?}", parse_general(frame, &limits, 1));
            assert_eq!(fast, general, "{frame}");
        }
        // Frames the fast path leaves to the general one: unknown fields (counted there),
        // repeated fields (the last one wins there), other types for the echoed fields.
        for frame in [
            r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r1","extra":1}"#,
            r#"{"commandType":3,"key":"jobs/a","key":"jobs/b","clientId":"c1","requestId":"r1"}"#,
            r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":7}"#,
            r#"{"commandType":3,"key":7,"clientId":"c1","requestId":"r1"}"#,
            r#"[1,2]"#,
            r#"{"commandType":3,"#,
        ] {
            assert!(serde_json::from_str::<WsRequest>(frame).is_err(), "{frame}");
        }
        let repeated =
            r#"{"commandType":3,"key":"jobs/a","key":"jobs/b","clientId":"c1","requestId":"r1"}"#;
        let op = format!("{:?}", parse_text(repeated, &limits, 1));
        assert!(op.contains("jobs/b"), "{op}");
        let extra =
            r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r1","x":{"y":1}}"#;
        let op = format!("{:?}", parse_text(extra, &limits, 1));
        assert!(op.starts_with("Ok(Acquire"), "{op}");
        let numeric = r#"{"commandType":3,"key":"","clientId":"c1","requestId":7}"#;
        let err = parse_text(numeric, &limits, 1).unwrap_err();
        assert!(err.contains(r#""requestId":7"#), "{err}");
    }

    fn token() -> FencingToken {
        FencingToken {
            key: "jobs/a".into(),
            value: 42,
        }
    }

    /// The replies clients parse, byte for byte: fields in alphabetical order, the echoed key
    /// and request id whatever their JSON type.
    #[test]
    fn replies_keep_their_wire_form() {
        let raw: Value =
            serde_json::from_str(r#"{"commandType":1,"key":"jobs/a","requestId":"r1"}"#).unwrap();
        let cases = [
            (
                ClientReply::Granted {
                    token: token(),
                    expires_in_ms: 5000,
                    queued: None,
                },
                r#"{"expiresInMs":5000,"fencingToken":{"key":"jobs/a","value":42},"key":"jobs/a","requestId":"r1","success":true}"#,
            ),
            (
                ClientReply::Released,
                r#"{"key":"jobs/a","released":true,"requestId":"r1","success":true}"#,
            ),
            (
                ClientReply::Renewed {
                    token: token(),
                    expires_in_ms: 7,
                },
                r#"{"expiresInMs":7,"fencingToken":{"key":"jobs/a","value":42},"key":"jobs/a","renewed":true,"requestId":"r1","success":true}"#,
            ),
            (
                ClientReply::WaitCancelled,
                r#"{"cancelled":true,"key":"jobs/a","requestId":"r1","success":true}"#,
            ),
            (
                ClientReply::Stored,
                r#"{"key":"jobs/a","requestId":"r1","success":true}"#,
            ),
            (
                ClientReply::Deleted { existed: false },
                r#"{"deleted":false,"key":"jobs/a","requestId":"r1","success":true}"#,
            ),
            (
                ClientReply::Value(Some(b"v\"1".to_vec())),
                r#"{"key":"jobs/a","requestId":"r1","success":true,"value":"v\"1"}"#,
            ),
            (
                ClientReply::Value(None),
                r#"{"key":"jobs/a","requestId":"r1","success":true,"value":null}"#,
            ),
        ];
        for (reply, want) in cases {
            assert_eq!(
                reply_json(Echo::of(&raw), &reply, false, None),
                want,
                "{reply:?}"
            );
        }
        // No key and a numeric request id (seed clients send either).
        let raw: Value = serde_json::from_str(r#"{"commandType":2,"requestId":7}"#).unwrap();
        assert_eq!(
            reply_json(Echo::of(&raw), &ClientReply::Released, true, None),
            r#"{"key":null,"released":true,"requestId":7,"success":true}"#
        );
        // With a fencing key the token carries its MAC.
        let key = FencingKey::new(&[7u8; 32]).unwrap();
        let text = reply_json(
            Echo::of(&raw),
            &ClientReply::Granted {
                token: token(),
                expires_in_ms: 1,
                queued: None,
            },
            false,
            Some(&key),
        );
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["fencingToken"]["mac"], json!(key.mac("jobs/a", 42)));
        // Errors keep their own form, with `released: false` on a failed release.
        let err = ClientReply::error(ErrorCode::NotHolder, "not yours");
        let v: Value = serde_json::from_str(&reply_json(Echo::of(&raw), &err, true, None)).unwrap();
        assert_eq!(v["success"], json!(false));
        assert_eq!(v["released"], json!(false));
        assert_eq!(v["error"]["code"], json!(ErrorCode::NotHolder.as_str()));
    }
}
