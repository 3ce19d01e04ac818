//! A watch on a WebSocket connection (`commandType` 8): the applied lock events under a
//! prefix, from the node's watch hub, streamed as frames until the connection closes, the node
//! stops or the watcher falls too far behind.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::{json, Value};

use super::WatchCtx;
use crate::node::api::{ApiError, ErrorCode};
use crate::server::auth::Caller;
use crate::server::exec::AppState;

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
pub(super) async fn run_watch(
    raw: &Value,
    state: &AppState,
    caller: &Caller,
    ctx: WatchCtx,
    mut closed: tokio::sync::watch::Receiver<bool>,
) -> Result<(), ApiError> {
    use crate::server::watch::MAX_WATCHES_PER_CONNECTION;
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
    let frame = |item: &crate::server::watch::WatchItem| {
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
                let is_lock = matches!(*item, crate::server::watch::WatchItem::Lock(_));
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
