//! Reading a request frame: JSON (a typed fast path, and the general path for frames with
//! unknown or repeated fields) into a [`ClientOp`], checked against the client port's limits.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;
use serde_json::Value;

use super::reply::{error_json, error_reply, Echo};
use super::{
    strip_unknown_fields, WsRequest, ACQUIRE_SHARED, APPEND_DATA, CAMPAIGN, CANCEL_WAIT,
    END_SESSION, KEEP_ALIVE, LEADER, LOCK_ACQUIRE, LOCK_RELEASE, LOCK_RENEW, PROCLAIM, READ,
    SET_LOCK_DELAY, SET_PERMITS, WATCH_COMMAND,
};
use crate::lock::FencingToken;
use crate::node::api::{ApiError, ClientOp, ErrorCode};
use crate::server::exec::{process_start_stamp, ClientLimits};

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

/// What [`handle_text`](super::handle_text) makes of a text frame before it executes anything:
/// the operation, or the JSON error reply the frame is answered with. For the fuzz targets in
/// `fuzz/`.
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
pub(super) fn parse_general(
    text: &str,
    limits: &ClientLimits,
    conn: u64,
) -> Result<ClientOp, String> {
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

pub(super) fn to_op(
    r: WsRequest<'_>,
    limits: &ClientLimits,
    conn: u64,
) -> Result<ClientOp, ApiError> {
    let invalid = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m);
    let session_command = matches!(r.command_type, KEEP_ALIVE | END_SESSION);
    if r.key.is_empty() && !session_command {
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
    let needs_client = r.command_type != READ && r.command_type != LEADER;
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
        LOCK_ACQUIRE | CAMPAIGN | ACQUIRE_SHARED => r.wait_timeout != Some(0),
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
    let op =
        match r.command_type {
            LOCK_ACQUIRE => {
                let ttl_ms = r.ttl.unwrap_or(limits.default_ttl_ms);
                // 0: the lock's lease is the client's session (which must be open).
                if ttl_ms > limits.max_ttl_ms {
                    return Err(invalid(&format!(
                        "`ttl` must be 1..={} ms, or 0 to attach the lock to the client's session",
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
            CAMPAIGN => {
                let ttl_ms = r.ttl.unwrap_or(limits.default_ttl_ms);
                // 0: the lock's lease is the client's session (which must be open).
                if ttl_ms > limits.max_ttl_ms {
                    return Err(invalid(&format!(
                        "`ttl` must be 1..={} ms, or 0 to attach the lock to the client's session",
                        limits.max_ttl_ms
                    )));
                }
                ClientOp::Campaign {
                    key,
                    client_id,
                    request_id,
                    ttl_ms,
                    wait_timeout_ms: r.wait_timeout,
                    value: election_value(r.value, limits)?,
                }
            }
            PROCLAIM => ClientOp::Proclaim {
                key,
                client_id,
                request_id,
                token: token
                    .ok_or_else(|| invalid("`fencingToken` (the term) is required to proclaim"))?,
                value: election_value(r.value, limits)?,
            },
            LEADER => ClientOp::Leader { key },
            KEEP_ALIVE => {
                let ttl_ms = r.ttl.unwrap_or(limits.default_ttl_ms);
                if ttl_ms == 0 || ttl_ms > limits.max_ttl_ms {
                    return Err(invalid(&format!(
                        "a session's `ttl` must be 1..={} ms",
                        limits.max_ttl_ms
                    )));
                }
                ClientOp::KeepAlive {
                    client_id,
                    session: r.session.unwrap_or(0),
                    ttl_ms,
                }
            }
            END_SESSION => ClientOp::EndSession {
                client_id,
                session: r.session.filter(|&s| s > 0).ok_or_else(|| {
                    invalid("`session` (the id a keepalive answered) is required")
                })?,
            },
            ACQUIRE_SHARED => {
                let ttl_ms = r.ttl.unwrap_or(limits.default_ttl_ms);
                // 0: the lease is the client's session (which must be open).
                if ttl_ms > limits.max_ttl_ms {
                    return Err(invalid(&format!(
                        "`ttl` must be 1..={} ms, or 0 to attach the lock or permit to the \
                         client's session",
                        limits.max_ttl_ms
                    )));
                }
                let mode = match r.mode.as_deref() {
                    Some(name) => crate::lock::LockMode::parse(name).ok_or_else(|| {
                        invalid(&format!(
                            "`mode` must be \"read\", \"write\" or \"permit\", not {name:?}"
                        ))
                    })?,
                    None => {
                        return Err(invalid(
                            "`mode` (\"read\", \"write\" or \"permit\") is required",
                        ))
                    }
                };
                let permits =
                    match (mode, r.permits) {
                        (crate::lock::LockMode::Permit, Some(n)) if n > 0 => n,
                        (crate::lock::LockMode::Permit, _) => return Err(invalid(
                            "`permits` (the semaphore's size, 1 or more) is required for a permit",
                        )),
                        (_, None | Some(0)) => 0,
                        (_, Some(_)) => {
                            return Err(invalid(
                                "`permits` is for semaphores: a read or write lock takes none",
                            ))
                        }
                    };
                ClientOp::AcquireShared {
                    key,
                    client_id,
                    request_id,
                    ttl_ms,
                    wait_timeout_ms: r.wait_timeout,
                    mode,
                    permits,
                }
            }
            SET_PERMITS => ClientOp::SetPermits {
                key,
                permits: r.permits.ok_or_else(|| {
                    invalid("`permits` (the semaphore's size; 0 forgets it) is required")
                })?,
                client_id,
                request_id,
            },
            SET_LOCK_DELAY => ClientOp::SetLockDelay {
                key,
                delay_ms: r
                    .lock_delay
                    .ok_or_else(|| invalid("`lockDelay` (ms) is required"))?,
                client_id,
                request_id,
            },
            0 | 1 => {
                return Err(invalid(
                    "membership commands are for peers and admins, not clients",
                ))
            }
            other => return Err(invalid(&format!("unknown commandType {other}"))),
        };
    ClientOp::sequenced(op, ack_below)
}

/// An election's value (`value`, a string; absent: empty), within the value limit.
fn election_value(value: Option<Cow<'_, str>>, limits: &ClientLimits) -> Result<Vec<u8>, ApiError> {
    let value = value.unwrap_or_default();
    if value.len() > limits.max_value_bytes {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            "value exceeds the limit",
        ));
    }
    Ok(value.into_owned().into_bytes())
}
