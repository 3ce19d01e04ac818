//! The client port: WebSocket `/ws`, the gRPC `LockService`, and HTTP health, status, metrics
//! and admin endpoints, all on one axum router.

use axum::extract::{Path, Query, State, WebSocketUpgrade};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::oneshot;

use super::api::{ClientOp, ClientReply};
use super::driver::{Input, NodeStatus};
pub use super::exec::{AppState, ClientLimits};

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/ws", get(ws_upgrade))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/leader", get(leader))
        .route("/status", get(status))
        .route("/members", get(members))
        .route("/metrics", get(metrics))
        .route("/locks", get(locks))
        .route("/kv/{key}", get(kv_get))
        .route("/ui", get(ui))
        .with_state(state)
}

/// Bytes a WebSocket connection reads from its socket at a time. A request is a few hundred
/// bytes; the library zero-fills this much before every read and holds it for the connection's
/// life, so a small buffer spares both (a larger message is still read whole).
const WS_READ_BUFFER_BYTES: usize = 1024;
/// Bytes of answers a WebSocket connection gathers before writing them to its socket.
const WS_WRITE_BUFFER_BYTES: usize = 4096;

#[derive(Deserialize)]
struct WsQuery {
    /// A bearer token for clients that cannot set headers on a WebSocket (browsers).
    #[serde(default)]
    access_token: Option<String>,
}

/// The `Authorization` header's value, if it is text.
fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

/// An HTTP answer for a refused caller: 401 `UNAUTHENTICATED` or 403 `PERMISSION_DENIED`.
fn refused(e: &crate::node::api::ApiError) -> Response {
    let status = if e.code == crate::node::api::ErrorCode::PermissionDenied {
        StatusCode::FORBIDDEN
    } else {
        StatusCode::UNAUTHORIZED
    };
    (
        status,
        Json(json!({"error": {"code": e.code.as_str(), "message": e.message}})),
    )
        .into_response()
}

async fn ws_upgrade(
    ws: WebSocketUpgrade,
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<WsQuery>,
) -> Response {
    // The connection's identity, fixed for its life. With authentication on, a caller without
    // a valid token is refused at the upgrade (401), before it can take a connection slot.
    let caller = state
        .security
        .caller(authorization(&headers), q.access_token.as_deref());
    if let Err(e) = caller.check_authenticated() {
        state
            .metrics
            .client_connections_refused_total
            .with_label_values(&["unauthenticated"])
            .inc();
        return refused(&e);
    }
    let Ok(permit) = state.connections.clone().try_acquire_owned() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "too many connections").into_response();
    };
    let max = state.limits.max_message_bytes;
    let batch_max = state.limits.max_batch;
    // Small buffers: the library's defaults (128 KiB to read and 128 KiB to write, per
    // connection) cost a node with 10,000 clients more than a gigabyte. A message larger than
    // the read buffer is still read whole (up to `max`); the write buffer may grow past its
    // target only while a client does not read, and never past one message more than `max`.
    let response = ws
        .read_buffer_size(WS_READ_BUFFER_BYTES)
        .write_buffer_size(WS_WRITE_BUFFER_BYTES)
        .max_write_buffer_size(WS_WRITE_BUFFER_BYTES + 2 * max)
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| async move {
            super::ws::serve_socket(socket, state, caller).await;
            drop(permit);
        });
    let mut response = response;
    if batch_max > 1 {
        let headers = response.headers_mut();
        headers.insert(
            super::ws::BATCH_HEADER,
            axum::http::HeaderValue::from(batch_max),
        );
        headers.insert(
            super::ws::MESSAGE_BYTES_HEADER,
            axum::http::HeaderValue::from(max),
        );
    }
    response
}

/// The status page: members, leader, replication lag, held locks and recent events, live from
/// the watch stream (`src/server/ui/status.html`, self-contained: no external resources).
async fn ui() -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("ui/status.html"),
    )
        .into_response()
}

async fn readyz(State(state): State<AppState>) -> Response {
    let status = state.status.borrow().clone();
    if status.is_ready() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no leader, not a member, or catching up",
        )
            .into_response()
    }
}

async fn leader(State(state): State<AppState>) -> Json<serde_json::Value> {
    let status = state.status.borrow().clone();
    Json(json!({"leaderId": status.leader_id, "leaderAddr": status.leader_addr}))
}

async fn status(State(state): State<AppState>) -> Json<NodeStatus> {
    Json(state.status.borrow().clone())
}

async fn members(State(state): State<AppState>) -> Json<serde_json::Value> {
    let status = state.status.borrow().clone();
    let book = state.addresses.all();
    let describe = |id: &u64, voter: bool| {
        let addrs = book.get(id).cloned().unwrap_or_default();
        json!({"id": id, "voter": voter, "peerAddr": addrs.peer, "clientAddr": addrs.client})
    };
    let members: Vec<_> = status
        .voters
        .iter()
        .map(|id| describe(id, true))
        .chain(status.learners.iter().map(|id| describe(id, false)))
        .collect();
    Json(json!({"leaderId": status.leader_id, "members": members}))
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        state.metrics.render(),
    )
        .into_response()
}

#[derive(Deserialize)]
struct LocksQuery {
    #[serde(default)]
    prefix: String,
}

async fn locks(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<LocksQuery>,
) -> Response {
    let caller = state.security.caller(authorization(&headers), None);
    if let super::auth::Caller::Refused(reason) = &caller {
        return refused(&crate::node::api::ApiError::new(
            crate::node::api::ErrorCode::Unauthenticated,
            *reason,
        ));
    }
    let (tx, rx) = oneshot::channel();
    if state
        .driver
        .try_send(Input::Locks {
            prefix: q.prefix,
            reply: tx,
        })
        .is_err()
    {
        return (StatusCode::SERVICE_UNAVAILABLE, "busy").into_response();
    }
    match rx.await {
        Ok(locks) => {
            let mut locks = json!(locks);
            // Only an admin (or anyone, when authentication is off) sees fencing tokens, and an
            // identity sees only the locks under its prefixes.
            if !caller.sees_tokens() {
                if let Some(list) = locks.as_array_mut() {
                    list.retain(|l| caller.check_read_listing(l["key"].as_str().unwrap_or("")));
                    for l in list.iter_mut() {
                        if let Some(o) = l.as_object_mut() {
                            o.remove("fencingToken");
                            // A read-write lock's or semaphore's holders carry theirs too.
                            let holders = o
                                .get_mut("shared")
                                .and_then(|v| v.get_mut("holders"))
                                .and_then(|v| v.as_array_mut());
                            for h in holders.into_iter().flatten() {
                                if let Some(h) = h.as_object_mut() {
                                    h.remove("fencingToken");
                                }
                            }
                        }
                    }
                }
            }
            Json(json!({"locks": locks})).into_response()
        }
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response(),
    }
}

async fn kv_get(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(key): Path<String>,
) -> Response {
    if key.len() > state.limits.max_key_bytes {
        return (StatusCode::PAYLOAD_TOO_LARGE, "key too long").into_response();
    }
    let caller = state.security.caller(authorization(&headers), None);
    if let Err(e) = caller.check_read(&key) {
        return refused(&e);
    }
    match super::exec::execute(ClientOp::Get { key: key.clone() }, 0, &state).await {
        ClientReply::Value(v) => Json(json!({
            "key": key,
            "value": v.map(|b| String::from_utf8_lossy(&b).into_owned()),
        }))
        .into_response(),
        ClientReply::Error(e) => {
            let code = if e.code.is_retryable() {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::BAD_REQUEST
            };
            (code, Json(json!({"error": {"code": e.code.as_str(), "message": e.message, "leaderId": e.leader_id, "leaderAddr": e.leader_addr}}))).into_response()
        }
        other => (StatusCode::INTERNAL_SERVER_ERROR, format!("{other:?}")).into_response(),
    }
}
