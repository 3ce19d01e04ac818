//! The public gRPC `LockService` on the client port (the peer port's `Peer` service is
//! `peer_api.rs`).

use tonic::{Request, Response, Status};

use super::api::{ApiError, ClientOp, ClientReply, ErrorCode};
use super::exec::AppState;
use super::proto::lock as lpb;

pub struct LockApi {
    pub state: AppState,
}

/// The gRPC services of the client port and their operations, as labels of
/// `raftlock_grpc_request_duration_seconds` (`op` named as the WebSocket's). A path outside them
/// is labelled `unknown`, so a client cannot add label values.
const GRPC_OPS: &[(&str, &str, &str)] = &[
    ("raftlock.lock.v1.LockService", "AcquireLock", "acquire"),
    ("raftlock.lock.v1.LockService", "ReleaseLock", "release"),
    ("raftlock.lock.v1.LockService", "RenewLock", "renew"),
    ("raftlock.lock.v1.LockService", "GetStatus", "status"),
    ("raftlock.lock.v1.LockService", "ListMembers", "members"),
    ("raftlock.lock.v1.LockService", "Batch", "batch"),
    ("api.LockService", "AcquireLock", "acquire"),
    ("api.LockService", "ReleaseLock", "release"),
];

/// `(service, op)` labels of a gRPC request path (`/<service>/<method>`).
pub fn grpc_labels(path: &str) -> (&'static str, &'static str) {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (service, method) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    GRPC_OPS
        .iter()
        .find(|(s, m, _)| *s == service && *m == method)
        .map(|(s, _, op)| (*s, *op))
        .unwrap_or(("unknown", "unknown"))
}

/// Times each gRPC request of the client port from its arrival to its answer being ready to
/// send (`raftlock_grpc_request_duration_seconds`): the gRPC counterpart of the WebSocket's
/// timing, forwarding to the leader and waiting for a lock included.
pub fn timed(routes: axum::Router, timings: prometheus::HistogramVec) -> axum::Router {
    routes.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let timings = timings.clone();
            async move {
                let started = std::time::Instant::now();
                let (service, op) = grpc_labels(request.uri().path());
                let response = next.run(request).await;
                timings
                    .with_label_values(&[service, op])
                    .observe(started.elapsed().as_secs_f64());
                response
            }
        },
    ))
}

/// A request id no other request uses, after a restart too: the process's start stamp and a
/// counter. (The process id alone repeats: in a container it is 1 after every restart, and a
/// remembered answer to an earlier `grpc-1-1` would have answered the new one.)
fn new_request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let start = super::exec::process_start_stamp();
    format!(
        "grpc-{start:x}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A lock-service reply that carries an error code and message: refusing a request before it
/// is executed fills in both.
trait Refused {
    fn refused(self, e: ApiError) -> Self;
}

macro_rules! refused_by_code_and_message {
    ($($reply:ty),*) => {$(
        impl Refused for $reply {
            fn refused(mut self, e: ApiError) -> Self {
                self.error_code = e.code.as_str().into();
                self.error_message = e.message;
                self
            }
        }
    )*};
}

refused_by_code_and_message!(
    lpb::ReleaseLockResponse,
    lpb::RenewLockResponse,
    lpb::SetLockDelayResponse,
    lpb::CampaignResponse,
    lpb::ProclaimResponse,
    lpb::LeaderResponse,
    lpb::KeepAliveResponse,
    lpb::EndSessionResponse,
    lpb::AcquireSharedResponse,
    lpb::SetPermitsResponse
);

/// A reply's error, with where the leader is: the fields every election response has.
macro_rules! with_error {
    ($out:expr, $e:expr) => {{
        let e = $e;
        $out.error_code = e.code.as_str().into();
        $out.error_message = e.message;
        $out.leader_id = e.leader_id;
        $out.leader_addr = e.leader_addr;
    }};
}

impl LockApi {
    /// A leader's term as a token on the wire: mode "leader", its MAC covering the mode.
    fn leader_token(&self, token: crate::lock::FencingToken) -> lpb::FencingToken {
        use crate::fencing::TokenMode;
        let mac = self
            .state
            .security
            .fencing_key
            .as_ref()
            .map(|k| k.mac_mode(TokenMode::Leader, &token.key, token.value))
            .unwrap_or_default();
        lpb::FencingToken {
            key: token.key,
            value: token.value,
            mac,
            mode: TokenMode::Leader.as_str().into(),
            slot: 0,
        }
    }
}

fn check_key(state: &AppState, key: &str, owner: &str) -> Result<(), ApiError> {
    if key.is_empty() || owner.is_empty() {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "resource_name and owner_id are required",
        ));
    }
    if key.len() > state.limits.max_key_bytes {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            "resource_name exceeds the key limit",
        ));
    }
    Ok(())
}

/// The caller behind a gRPC request's `authorization` metadata.
pub fn caller_of<T>(state: &AppState, request: &Request<T>) -> super::auth::Caller {
    let authorization = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    state.security.caller(authorization, None)
}

/// The answers of a `Batch` call, each sent as soon as its operation is answered.
pub type BatchStream = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<lpb::BatchResponse, Status>> + Send + 'static>,
>;

impl LockApi {
    /// Runs one operation of a batch as the call of its own it stands for, with the batch's
    /// metadata (its bearer token and trace context).
    async fn batch_operation(
        &self,
        metadata: tonic::metadata::MetadataMap,
        op: lpb::batch_operation::Op,
    ) -> Result<lpb::batch_response::Result, Status> {
        use lpb::batch_operation::Op;
        use lpb::batch_response::Result as Answer;
        use lpb::lock_service_server::LockService;
        fn call<T>(metadata: tonic::metadata::MetadataMap, message: T) -> Request<T> {
            Request::from_parts(metadata, tonic::Extensions::default(), message)
        }
        Ok(match op {
            Op::Acquire(m) => {
                Answer::Acquire(self.acquire_lock(call(metadata, m)).await?.into_inner())
            }
            Op::Release(m) => {
                Answer::Release(self.release_lock(call(metadata, m)).await?.into_inner())
            }
            Op::Renew(m) => Answer::Renew(self.renew_lock(call(metadata, m)).await?.into_inner()),
            Op::AcquireShared(m) => {
                Answer::AcquireShared(self.acquire_shared(call(metadata, m)).await?.into_inner())
            }
            Op::KeepAlive(m) => {
                Answer::KeepAlive(self.keep_alive(call(metadata, m)).await?.into_inner())
            }
        })
    }
}

#[tonic::async_trait]
impl lpb::lock_service_server::LockService for LockApi {
    type BatchStream = BatchStream;

    async fn batch(
        &self,
        request: Request<lpb::BatchRequest>,
    ) -> Result<Response<BatchStream>, Status> {
        let max = self.state.limits.max_batch;
        let (metadata, _, batch) = request.into_parts();
        let count = batch.operations.len();
        if count == 0 || count > max {
            return Err(Status::invalid_argument(format!(
                "a batch holds 1 to {max} operations, this one {count}"
            )));
        }
        let mut ops = Vec::with_capacity(count);
        for (index, operation) in batch.operations.into_iter().enumerate() {
            let op = operation.op.ok_or_else(|| {
                Status::invalid_argument(format!("operation {index} of the batch names none"))
            })?;
            ops.push(op);
        }
        let api = std::sync::Arc::new(LockApi {
            state: self.state.clone(),
        });
        let (tx, rx) = tokio::sync::mpsc::channel(count);
        for (index, op) in ops.into_iter().enumerate() {
            let (api, tx, metadata) = (api.clone(), tx.clone(), metadata.clone());
            tokio::spawn(async move {
                let answer = Box::pin(api.batch_operation(metadata, op)).await;
                let _ = tx
                    .send(answer.map(|result| lpb::BatchResponse {
                        index: index as u32,
                        result: Some(result),
                    }))
                    .await;
            });
        }
        let answers = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(answers) as BatchStream))
    }

    async fn acquire_lock(
        &self,
        request: Request<lpb::AcquireLockRequest>,
    ) -> Result<Response<lpb::AcquireLockResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::AcquireLockResponse::default();
        let fail = |out: &mut lpb::AcquireLockResponse, e: ApiError| {
            out.error_code = e.code.as_str().into();
            out.error_message = e.message;
            out.leader_id = e.leader_id;
            out.leader_addr = e.leader_addr;
        };
        if let Err(e) = check_key(&self.state, &r.resource_name, &r.owner_id) {
            fail(&mut out, e);
            return Ok(Response::new(out));
        }
        let ttl_ms = if r.ttl_ms == 0 {
            self.state.limits.default_ttl_ms
        } else {
            r.ttl_ms
        };
        if ttl_ms > self.state.limits.max_ttl_ms || r.client_timeout_ms < 0 {
            fail(
                &mut out,
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    "ttl_ms or client_timeout_ms out of range",
                ),
            );
            return Ok(Response::new(out));
        }
        let ack_below = r.ack_below;
        let ttl_ms = if r.attach_to_session { 0 } else { ttl_ms };
        let op = ClientOp::Acquire {
            key: r.resource_name,
            client_id: r.owner_id,
            // Sent without an id, an acquire that may wait gets one of the node's: its grant
            // comes later and finds the request by id. A request answered at once goes without,
            // so that its answer, which no client could ask for again, is not kept in the
            // exactly-once table nor paced by the table's bound.
            request_id: if r.request_id.is_empty() && r.client_timeout_ms > 0 {
                new_request_id()
            } else {
                r.request_id
            },
            ttl_ms,
            wait_timeout_ms: Some(r.client_timeout_ms as u64),
        };
        let sequenced = ClientOp::sequenced(op, ack_below);
        let mut op = match sequenced {
            Ok(op) => op,
            Err(e) => {
                fail(&mut out, e);
                return Ok(Response::new(out));
            }
        };
        if let Err(e) = caller.authorize(&mut op) {
            fail(&mut out, e);
            return Ok(Response::new(out));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::Granted {
                token,
                expires_in_ms,
                ..
            } => {
                out.acquired = true;
                out.lease_id = token.value.to_string();
                out.expires_in_ms = expires_in_ms;
                let mac = self
                    .state
                    .security
                    .fencing_key
                    .as_ref()
                    .map(|k| k.mac(&token.key, token.value))
                    .unwrap_or_default();
                out.fencing_token = Some(lpb::FencingToken {
                    key: token.key,
                    value: token.value,
                    mac,
                    mode: String::new(),
                    slot: 0,
                });
            }
            ClientReply::Error(e) => fail(&mut out, e),
            other => fail(
                &mut out,
                ApiError::new(ErrorCode::Unavailable, format!("unexpected {other:?}")),
            ),
        }
        Ok(Response::new(out))
    }

    async fn release_lock(
        &self,
        request: Request<lpb::ReleaseLockRequest>,
    ) -> Result<Response<lpb::ReleaseLockResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::ReleaseLockResponse::default();
        if let Err(e) = check_key(&self.state, &r.resource_name, &r.owner_id) {
            return Ok(Response::new(out.refused(e)));
        }
        let ack_below = r.ack_below;
        let op = ClientOp::Release {
            key: r.resource_name,
            client_id: r.owner_id,
            // Sent without an id, it goes without one: answered at once, its answer is not kept
            // (see the acquire above).
            request_id: r.request_id,
            token: r.fencing_token,
        };
        let mut op = match ClientOp::sequenced(op, ack_below) {
            Ok(op) => op,
            Err(e) => return Ok(Response::new(out.refused(e))),
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::Released => out.released = true,
            ClientReply::Error(e) => {
                out.error_code = e.code.as_str().into();
                out.error_message = e.message;
                out.leader_id = e.leader_id;
                out.leader_addr = e.leader_addr;
            }
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn renew_lock(
        &self,
        request: Request<lpb::RenewLockRequest>,
    ) -> Result<Response<lpb::RenewLockResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::RenewLockResponse::default();
        if let Err(e) = check_key(&self.state, &r.resource_name, &r.owner_id) {
            return Ok(Response::new(out.refused(e)));
        }
        let ack_below = r.ack_below;
        let op = ClientOp::Renew {
            key: r.resource_name,
            client_id: r.owner_id,
            // Sent without an id, it goes without one: answered at once, its answer is not kept
            // (see the acquire above).
            request_id: r.request_id,
            token: r.fencing_token,
            ttl_ms: if r.ttl_ms == 0 {
                self.state.limits.default_ttl_ms
            } else {
                r.ttl_ms
            },
        };
        let mut op = match ClientOp::sequenced(op, ack_below) {
            Ok(op) => op,
            Err(e) => return Ok(Response::new(out.refused(e))),
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::Renewed { expires_in_ms, .. } => {
                out.renewed = true;
                out.expires_in_ms = expires_in_ms;
            }
            ClientReply::Error(e) => {
                out.error_code = e.code.as_str().into();
                out.error_message = e.message;
                out.leader_id = e.leader_id;
                out.leader_addr = e.leader_addr;
            }
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn set_lock_delay(
        &self,
        request: Request<lpb::SetLockDelayRequest>,
    ) -> Result<Response<lpb::SetLockDelayResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let out = lpb::SetLockDelayResponse::default();
        if let Err(e) = check_key(&self.state, &r.resource_name, &r.owner_id) {
            return Ok(Response::new(out.refused(e)));
        }
        let mut op = ClientOp::SetLockDelay {
            key: r.resource_name,
            delay_ms: r.delay_ms,
            client_id: r.owner_id,
            request_id: r.request_id,
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        let reply =
            super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await;
        Ok(Response::new(match reply {
            ClientReply::LockDelaySet { delay_ms } => lpb::SetLockDelayResponse { delay_ms, ..out },
            ClientReply::Error(e) => lpb::SetLockDelayResponse {
                error_code: e.code.as_str().into(),
                error_message: e.message,
                leader_id: e.leader_id,
                leader_addr: e.leader_addr,
                ..out
            },
            other => out.refused(ApiError::new(
                ErrorCode::Unavailable,
                format!("unexpected {other:?}"),
            )),
        }))
    }

    async fn acquire_shared(
        &self,
        request: Request<lpb::AcquireSharedRequest>,
    ) -> Result<Response<lpb::AcquireSharedResponse>, Status> {
        use crate::lock::LockMode;
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::AcquireSharedResponse::default();
        if let Err(e) = check_key(&self.state, &r.key, &r.owner_id) {
            return Ok(Response::new(out.refused(e)));
        }
        let limits = &self.state.limits;
        let ttl_ms = if r.ttl_ms == 0 {
            limits.default_ttl_ms
        } else {
            r.ttl_ms
        };
        let mode = LockMode::parse(&r.mode);
        let valid = match mode {
            Some(LockMode::Permit) => r.permits > 0,
            Some(_) => r.permits == 0,
            None => false,
        };
        if ttl_ms > limits.max_ttl_ms || !valid {
            let e = ApiError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "mode must be \"read\" or \"write\" (permits 0) or \"permit\" (permits 1 or \
                     more), and ttl_ms 1..={}",
                    limits.max_ttl_ms
                ),
            );
            return Ok(Response::new(out.refused(e)));
        }
        let mut op = ClientOp::AcquireShared {
            key: r.key,
            client_id: r.owner_id,
            request_id: if r.request_id.is_empty() && r.wait_timeout_ms != Some(0) {
                new_request_id()
            } else {
                r.request_id
            },
            ttl_ms: if r.attach_to_session { 0 } else { ttl_ms },
            wait_timeout_ms: r.wait_timeout_ms,
            mode: mode.unwrap_or(LockMode::Read),
            permits: r.permits,
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::Granted {
                token,
                expires_in_ms,
                shared: Some(grant),
                ..
            } => {
                let mode = crate::fencing::TokenMode::of_shared(grant.mode, grant.slot);
                let mac = self
                    .state
                    .security
                    .fencing_key
                    .as_ref()
                    .map(|k| k.mac_mode(mode, &token.key, token.value))
                    .unwrap_or_default();
                out.acquired = true;
                out.expires_in_ms = expires_in_ms;
                out.fencing_token = Some(lpb::FencingToken {
                    key: token.key,
                    value: token.value,
                    mac,
                    mode: mode.as_str().into(),
                    slot: grant.slot,
                });
            }
            ClientReply::Error(e) => with_error!(out, e),
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn set_permits(
        &self,
        request: Request<lpb::SetPermitsRequest>,
    ) -> Result<Response<lpb::SetPermitsResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::SetPermitsResponse::default();
        if let Err(e) = check_key(&self.state, &r.key, &r.owner_id) {
            return Ok(Response::new(out.refused(e)));
        }
        let mut op = ClientOp::SetPermits {
            key: r.key,
            permits: r.permits,
            client_id: r.owner_id,
            request_id: r.request_id,
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::PermitsSet { permits } => out.permits = permits,
            ClientReply::Error(e) => with_error!(out, e),
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn campaign(
        &self,
        request: Request<lpb::CampaignRequest>,
    ) -> Result<Response<lpb::CampaignResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::CampaignResponse::default();
        if let Err(e) = check_key(&self.state, &r.election, &r.candidate_id) {
            return Ok(Response::new(out.refused(e)));
        }
        let limits = &self.state.limits;
        let ttl_ms = if r.ttl_ms == 0 {
            limits.default_ttl_ms
        } else {
            r.ttl_ms
        };
        if ttl_ms > limits.max_ttl_ms || r.value.len() > limits.max_value_bytes {
            let e = ApiError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "ttl_ms must be 1..={} and the value at most {} bytes",
                    limits.max_ttl_ms, limits.max_value_bytes
                ),
            );
            return Ok(Response::new(out.refused(e)));
        }
        let mut op = ClientOp::Campaign {
            key: r.election,
            client_id: r.candidate_id,
            // A campaign that may wait needs an id its later grant can find.
            request_id: if r.request_id.is_empty() && r.wait_timeout_ms != Some(0) {
                new_request_id()
            } else {
                r.request_id
            },
            ttl_ms: if r.attach_to_session { 0 } else { ttl_ms },
            wait_timeout_ms: r.wait_timeout_ms,
            value: r.value,
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::Granted {
                token,
                expires_in_ms,
                ..
            } => {
                out.elected = true;
                out.expires_in_ms = expires_in_ms;
                out.fencing_token = Some(self.leader_token(token));
            }
            ClientReply::Error(e) => with_error!(out, e),
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn proclaim(
        &self,
        request: Request<lpb::ProclaimRequest>,
    ) -> Result<Response<lpb::ProclaimResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::ProclaimResponse::default();
        if let Err(e) = check_key(&self.state, &r.election, &r.candidate_id) {
            return Ok(Response::new(out.refused(e)));
        }
        if r.value.len() > self.state.limits.max_value_bytes {
            let e = ApiError::new(ErrorCode::TooLarge, "value exceeds the limit");
            return Ok(Response::new(out.refused(e)));
        }
        let mut op = ClientOp::Proclaim {
            key: r.election,
            client_id: r.candidate_id,
            request_id: r.request_id,
            token: r.term,
            value: r.value,
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::Proclaimed { .. } => out.proclaimed = true,
            ClientReply::Error(e) => with_error!(out, e),
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn leader(
        &self,
        request: Request<lpb::LeaderRequest>,
    ) -> Result<Response<lpb::LeaderResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::LeaderResponse::default();
        if r.election.is_empty() || r.election.len() > self.state.limits.max_key_bytes {
            let e = ApiError::new(
                ErrorCode::InvalidRequest,
                "election is required, within the key limit",
            );
            return Ok(Response::new(out.refused(e)));
        }
        let mut op = ClientOp::Leader { key: r.election };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::Leader {
                leader,
                token,
                value,
                candidates,
            } => {
                out.has_leader = leader.is_some();
                out.candidate_id = leader.unwrap_or_default();
                out.fencing_token = token.map(|t| self.leader_token(t));
                out.value = value.unwrap_or_default();
                out.candidates = candidates;
            }
            ClientReply::Error(e) => with_error!(out, e),
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn keep_alive(
        &self,
        request: Request<lpb::KeepAliveRequest>,
    ) -> Result<Response<lpb::KeepAliveResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::KeepAliveResponse::default();
        let limits = &self.state.limits;
        let ttl_ms = if r.ttl_ms == 0 {
            limits.default_ttl_ms
        } else {
            r.ttl_ms
        };
        if r.owner_id.is_empty() || ttl_ms > limits.max_ttl_ms {
            let e = ApiError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "owner_id is required and ttl_ms must be 1..={}",
                    limits.max_ttl_ms
                ),
            );
            return Ok(Response::new(out.refused(e)));
        }
        let mut op = ClientOp::KeepAlive {
            client_id: r.owner_id,
            session: r.session,
            ttl_ms,
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::SessionKept {
                session,
                expires_in_ms,
            } => {
                out.session = session;
                out.expires_in_ms = expires_in_ms;
            }
            ClientReply::Error(e) => with_error!(out, e),
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn end_session(
        &self,
        request: Request<lpb::EndSessionRequest>,
    ) -> Result<Response<lpb::EndSessionResponse>, Status> {
        let traceparent = super::exec::traceparent_header(request.metadata());
        let caller = caller_of(&self.state, &request);
        let r = request.into_inner();
        let mut out = lpb::EndSessionResponse::default();
        if r.owner_id.is_empty() || r.session == 0 {
            let e = ApiError::new(
                ErrorCode::InvalidRequest,
                "owner_id and session (the id a KeepAlive answered) are required",
            );
            return Ok(Response::new(out.refused(e)));
        }
        let mut op = ClientOp::EndSession {
            client_id: r.owner_id,
            session: r.session,
        };
        if let Err(e) = caller.authorize(&mut op) {
            return Ok(Response::new(out.refused(e)));
        }
        match super::exec::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
            ClientReply::SessionEnded { locks } => out.locks = locks,
            ClientReply::Error(e) => with_error!(out, e),
            other => out.error_message = format!("unexpected {other:?}"),
        }
        Ok(Response::new(out))
    }

    async fn get_status(
        &self,
        _request: Request<lpb::StatusRequest>,
    ) -> Result<Response<lpb::StatusResponse>, Status> {
        let s = self.state.status.borrow().clone();
        Ok(Response::new(lpb::StatusResponse {
            id: s.id,
            role: s.role,
            term: s.term,
            leader_id: s.leader_id,
            leader_addr: s.leader_addr,
            commit_index: s.commit_index,
            applied_index: s.applied_index,
            voters: s.voters,
            learners: s.learners,
        }))
    }

    async fn list_members(
        &self,
        _request: Request<lpb::MembersRequest>,
    ) -> Result<Response<lpb::MembersResponse>, Status> {
        let s = self.state.status.borrow().clone();
        let book = self.state.addresses.all();
        let member = |id: u64, voter: bool| {
            let a = book.get(&id).cloned().unwrap_or_default();
            lpb::Member {
                id,
                voter,
                peer_addr: a.peer,
                client_addr: a.client,
            }
        };
        let members = s
            .voters
            .iter()
            .map(|&id| member(id, true))
            .chain(s.learners.iter().map(|&id| member(id, false)))
            .collect();
        Ok(Response::new(lpb::MembersResponse {
            members,
            leader_id: s.leader_id,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::grpc_labels;

    #[test]
    fn grpc_paths_map_to_bounded_labels() {
        assert_eq!(
            grpc_labels("/raftlock.lock.v1.LockService/RenewLock"),
            ("raftlock.lock.v1.LockService", "renew")
        );
        assert_eq!(
            grpc_labels("/api.LockService/AcquireLock"),
            ("api.LockService", "acquire")
        );
        // Seed 004's service has no RenewLock; anything else is one label, whatever it says.
        for path in [
            "/api.LockService/RenewLock",
            "/raftlock.lock.v1.LockService/Nope",
            "/raftlock.lock.v1.LockService/RenewLock/extra",
            "/",
            "",
            "/x".repeat(1000).as_str(),
        ] {
            assert_eq!(grpc_labels(path), ("unknown", "unknown"), "{path}");
        }
    }
}
