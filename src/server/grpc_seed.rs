//! Seed 004's public gRPC API, `api.LockService` (`proto/seed004/api/lock_service.proto`, kept
//! verbatim), served on the client port beside `raftlock.lock.v1.LockService`, so the seed's
//! clients (its C# `LockManagerClient`, or any client generated from that file) work unchanged.
//!
//! Mapping onto RaftLock's operations:
//!
//! - `AcquireLock{resource_name, owner_id, client_timeout_ms}` → acquire `resource_name` as
//!   `owner_id` with the node's default TTL (`--default-ttl`, 10 s unless configured; the seed's
//!   request has no TTL field and the seed's API has no renew). Like the seed's state machine
//!   (`INSERT … IF NOT EXISTS`) it does **not** queue: a lock held by anyone — the same owner
//!   included, locks are not re-entrant — answers `acquired=false` at once with an
//!   `error_message`. `client_timeout_ms` (the seed's "timeout for the client waiting for the
//!   operation to complete") bounds how long the call waits for the cluster to commit: 0 means
//!   [`COMMIT_WAIT_DEFAULT`], a negative value is refused, and it is capped at
//!   [`COMMIT_WAIT_MAX`].
//!   `lease_id` is the fencing token in decimal.
//! - `ReleaseLock{resource_name, lease_id}` → release `resource_name` if `lease_id` (decimal)
//!   is its current fencing token, as whoever holds it (the seed's release names no owner: the
//!   lease id is the proof of ownership). A lease id that is not a number or not the current
//!   lease answers `released=false` and changes nothing.
//!
//! Every failure is `acquired/released = false` with an `error_message` that starts with the
//! RaftLock error code (e.g. `NOT_LEADER: … (leader 2 at 127.0.0.1:50052)`); the call itself
//! always completes with gRPC status OK. The seed has no request ids: each call gets a fresh one,
//! so a retried seed call is a new operation (an acquire retried after its grant answers
//! `acquired=false` with `ALREADY_HELD` and the lease id it holds).

use std::time::Duration;

use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use super::api::{ApiError, ClientOp, ClientReply, ErrorCode};
use super::auth::{Caller, Operation};
use super::driver::Input;
use super::exec::AppState;
use super::proto::seed004 as spb;

/// How long a follower waits to apply up to the leader's commit index before it judges a lease
/// on its own state.
const CATCH_UP_WAIT: Duration = Duration::from_secs(1);

/// How long a call waits for the cluster's answer when the client names no timeout.
pub const COMMIT_WAIT_DEFAULT: Duration = Duration::from_secs(10);
/// The longest a call waits for the cluster's answer, whatever the client asks.
pub const COMMIT_WAIT_MAX: Duration = Duration::from_secs(30);

pub struct SeedLockApi {
    pub state: AppState,
}

/// How long to wait for the cluster, from the seed's `client_timeout_ms`.
#[doc(hidden)]
pub fn commit_wait(client_timeout_ms: i64) -> Duration {
    if client_timeout_ms <= 0 {
        COMMIT_WAIT_DEFAULT
    } else {
        Duration::from_millis(client_timeout_ms as u64).min(COMMIT_WAIT_MAX)
    }
}

/// `CODE: message`, with the leader when the error names one.
fn describe(e: &ApiError) -> String {
    let mut text = format!("{}: {}", e.code.as_str(), e.message);
    if e.leader_id != 0 {
        text.push_str(&format!(" (leader {}", e.leader_id));
        if !e.leader_addr.is_empty() {
            text.push_str(&format!(" at {}", e.leader_addr));
        }
        text.push(')');
    }
    text
}

/// A lease id is the fencing token in decimal: digits only, no sign or spaces, fits in a u64.
#[doc(hidden)]
pub fn parse_lease_id(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn check_key(state: &AppState, key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("INVALID_REQUEST: resource_name is required".into());
    }
    if key.len() > state.limits.max_key_bytes {
        return Err(format!(
            "TOO_LARGE: resource_name is {} bytes; the limit is {}",
            key.len(),
            state.limits.max_key_bytes
        ));
    }
    Ok(())
}

impl SeedLockApi {
    /// Sends `op` to the driver and waits at most `wait` for its answer.
    async fn execute(&self, op: ClientOp, wait: Duration) -> Result<ClientReply, String> {
        match tokio::time::timeout(
            wait,
            super::exec::execute_call(op, &self.state, "grpc-seed", None),
        )
        .await
        {
            Ok(reply) => Ok(reply),
            Err(_) => Err(format!(
                "UNAVAILABLE: no answer from the cluster within {} ms; the operation may still \
                 take effect",
                wait.as_millis()
            )),
        }
    }

    async fn acquire(&self, r: spb::AcquireLockRequest, caller: &Caller) -> Result<u64, String> {
        check_key(&self.state, &r.resource_name)?;
        if r.owner_id.is_empty() {
            return Err("INVALID_REQUEST: owner_id is required".into());
        }
        if r.client_timeout_ms < 0 {
            return Err("INVALID_REQUEST: client_timeout_ms must not be negative".into());
        }
        let key = r.resource_name;
        let mut op = ClientOp::Acquire {
            key: key.clone(),
            client_id: r.owner_id.clone(),
            // The seed has no request ids, and this acquire never waits: answered at once, it
            // needs none, and without one its answer, which no client could ask for again, is
            // not kept in the exactly-once table nor paced by the table's bound.
            request_id: String::new(),
            ttl_ms: self.state.limits.default_ttl_ms,
            // The seed's acquire never queues behind the holder.
            wait_timeout_ms: Some(0),
        };
        caller.authorize(&mut op).map_err(|e| describe(&e))?;
        match self.execute(op, commit_wait(r.client_timeout_ms)).await? {
            ClientReply::Granted { token, .. } => Ok(token.value),
            ClientReply::Error(e) if e.code == ErrorCode::WaitTimeout => Err(format!(
                "{}: lock '{key}' is held by another owner (AcquireLock does not wait; try again \
                 later)",
                e.code.as_str()
            )),
            ClientReply::Error(e) if e.code == ErrorCode::AlreadyHeld => Err(format!(
                "{}: owner '{}' already holds lock '{key}'{} (locks are not re-entrant)",
                e.code.as_str(),
                r.owner_id,
                e.current_token
                    .map(|t| format!(" with lease_id {t}"))
                    .unwrap_or_default()
            )),
            ClientReply::Error(e) => Err(describe(&e)),
            other => Err(format!("UNAVAILABLE: unexpected answer {other:?}")),
        }
    }

    /// The holder of `key` on this node's applied state, if its token is `lease`. A follower
    /// first applies up to the leader's commit index (waiting at most `CATCH_UP_WAIT`), so the
    /// lease is judged on state at least as new as every answer the leader had given: a client
    /// that acquired through any node and releases through this one is not refused because this
    /// follower had not applied its grant yet.
    async fn holder_with_lease(&self, key: &str, lease: u64) -> Result<String, String> {
        if let Some(leader) = super::exec::forward_target(&self.state) {
            // Without an answer from the leader, judge on this node's state: the release is
            // checked again by the state machine when it applies.
            if let Ok(commit) = self.state.forwarder.leader_commit(&leader).await {
                let mut status = self.state.status.clone();
                let _ = tokio::time::timeout(
                    CATCH_UP_WAIT,
                    status.wait_for(|s| s.applied_index >= commit),
                )
                .await;
            }
        }
        let (tx, rx) = oneshot::channel();
        if self
            .state
            .driver
            .try_send(Input::Locks {
                prefix: key.to_string(),
                reply: tx,
            })
            .is_err()
        {
            return Err("BUSY: the node's request queue is full".into());
        }
        let locks = rx
            .await
            .map_err(|_| "UNAVAILABLE: node is shutting down".to_string())?;
        let info = locks.into_iter().find(|l| l.key == key);
        match info.and_then(|l| l.holder.zip(l.fencing_token)) {
            Some((holder, token)) if token == lease => Ok(holder),
            Some(_) => Err(format!(
                "STALE_TOKEN: lease_id {lease} is not the current lease of lock '{key}'"
            )),
            None => Err(format!(
                "STALE_TOKEN: lock '{key}' is not held (lease_id {lease} is not current)"
            )),
        }
    }

    async fn release(&self, r: spb::ReleaseLockRequest, caller: &Caller) -> Result<(), String> {
        check_key(&self.state, &r.resource_name)?;
        let lease = parse_lease_id(&r.lease_id).ok_or_else(|| {
            format!(
                "INVALID_REQUEST: lease_id {:?} is not a lease id (the decimal number \
                 AcquireLock returned)",
                r.lease_id
            )
        })?;
        let key = r.resource_name;
        // The seed's release names no owner; the lease id is the proof. Release as the holder
        // this node sees with that token: the state machine checks owner and token again when
        // the release applies, so a lock handed on in between is not touched.
        // With client authentication, only the identity holding the lock may release it: its
        // client ids are `<identity>` and `<identity>/…`.
        caller
            .check(Operation::Release, &key)
            .map_err(|e| describe(&e))?;
        let owner = self.holder_with_lease(&key, lease).await?;
        if !caller.holds_as(&owner) {
            return Err(format!(
                "NOT_HOLDER: lock '{key}' is held by another identity"
            ));
        }
        let op = ClientOp::Release {
            key,
            client_id: owner,
            // Answered at once: no request id, no kept answer (see the acquire above).
            request_id: String::new(),
            token: lease,
        };
        match self.execute(op, COMMIT_WAIT_DEFAULT).await? {
            ClientReply::Released => Ok(()),
            ClientReply::Error(e) => Err(describe(&e)),
            other => Err(format!("UNAVAILABLE: unexpected answer {other:?}")),
        }
    }
}

#[tonic::async_trait]
impl spb::lock_service_server::LockService for SeedLockApi {
    async fn acquire_lock(
        &self,
        request: Request<spb::AcquireLockRequest>,
    ) -> Result<Response<spb::AcquireLockResponse>, Status> {
        let caller = super::grpc::caller_of(&self.state, &request);
        let out = match self.acquire(request.into_inner(), &caller).await {
            Ok(token) => spb::AcquireLockResponse {
                acquired: true,
                lease_id: token.to_string(),
                error_message: String::new(),
            },
            Err(error_message) => spb::AcquireLockResponse {
                acquired: false,
                lease_id: String::new(),
                error_message,
            },
        };
        Ok(Response::new(out))
    }

    async fn release_lock(
        &self,
        request: Request<spb::ReleaseLockRequest>,
    ) -> Result<Response<spb::ReleaseLockResponse>, Status> {
        let caller = super::grpc::caller_of(&self.state, &request);
        let out = match self.release(request.into_inner(), &caller).await {
            Ok(()) => spb::ReleaseLockResponse {
                released: true,
                error_message: String::new(),
            },
            Err(error_message) => spb::ReleaseLockResponse {
                released: false,
                error_message,
            },
        };
        Ok(Response::new(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_wait_is_bounded() {
        assert_eq!(commit_wait(0), COMMIT_WAIT_DEFAULT);
        assert_eq!(commit_wait(-5), COMMIT_WAIT_DEFAULT);
        assert_eq!(commit_wait(250), Duration::from_millis(250));
        assert_eq!(commit_wait(i64::MAX), COMMIT_WAIT_MAX);
    }

    #[test]
    fn lease_ids_are_plain_decimal() {
        assert_eq!(parse_lease_id("42"), Some(42));
        assert_eq!(parse_lease_id("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "+5",
            "-1",
            " 5",
            "5 ",
            "0x10",
            "abc",
            "18446744073709551616",
        ] {
            assert_eq!(parse_lease_id(bad), None, "{bad:?}");
        }
    }
}
