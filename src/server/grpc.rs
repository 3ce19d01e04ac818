//! gRPC services: the public `LockService` (client port) and the `Peer` service (peer port).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, Instrument};

use super::api::{ApiError, ClientOp, ClientReply, ErrorCode};
use super::convert::message_from_pb;
use super::driver::Input;
use super::http::AppState;
use super::proto::lock as lpb;
use super::proto::peer as ppb;
use super::transport::{
    AddressBook, CLIENT_ADDR_HEADER, CLUSTER_ID_HEADER, FROM_NODE_HEADER, INCARNATION_HEADER,
    NODE_ID_HEADER, PEER_ADDR_HEADER, TOKEN_HEADER, VERSION_HEADER,
};

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
    let start = super::ws::process_start_stamp();
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

refused_by_code_and_message!(lpb::ReleaseLockResponse, lpb::RenewLockResponse);

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

#[tonic::async_trait]
impl lpb::lock_service_server::LockService for LockApi {
    async fn acquire_lock(
        &self,
        request: Request<lpb::AcquireLockRequest>,
    ) -> Result<Response<lpb::AcquireLockResponse>, Status> {
        let traceparent = super::ws::traceparent_header(request.metadata());
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
        match super::ws::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
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
        let traceparent = super::ws::traceparent_header(request.metadata());
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
        match super::ws::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
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
        let traceparent = super::ws::traceparent_header(request.metadata());
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
        match super::ws::execute_call(op, &self.state, "grpc", traceparent.as_deref()).await {
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

/// The peer-port service: Raft streams and the seed design's membership RPCs.
pub struct PeerApi {
    pub driver: mpsc::Sender<Input>,
    pub addresses: AddressBook,
    pub cluster_token: String,
    /// Peer-port mutual TLS: a request's node id must be named by its connection's certificate.
    pub tls: Option<Arc<super::tls::PeerTls>>,
    /// `raftlock_peer_requests_refused_total{reason}`.
    pub refused: prometheus::IntCounterVec,
    pub status: tokio::sync::watch::Receiver<super::driver::NodeStatus>,
    /// False while a new node started with `--join` waits for the leader to accept it: until
    /// then it takes no Raft message, so a voter that lost its data and started afresh under its
    /// old id cannot be fed the log (and vote) as if it remembered its term — the leader refuses
    /// its join until an operator removes the old member.
    pub admitted: Arc<AtomicBool>,
    /// This node's incarnation (the random id its data directory was created with).
    pub incarnation: u64,
    /// `raftlock_request_duration_seconds` for requests forwarded here by other nodes.
    pub request_duration: prometheus::HistogramVec,
}

impl PeerApi {
    fn authorize<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let presented = request
            .metadata()
            .get(TOKEN_HEADER)
            .and_then(|v| v.to_str().ok());
        self.check_token(presented)
    }

    /// Whether `presented` is the cluster token (anything passes when none is set).
    pub(crate) fn check_token(&self, presented: Option<&str>) -> Result<(), Status> {
        if self.cluster_token.is_empty() {
            return Ok(());
        }
        // Constant time: the comparison takes as long however much of the token was right.
        use subtle::ConstantTimeEq;
        let matches = presented
            .is_some_and(|p| bool::from(p.as_bytes().ct_eq(self.cluster_token.as_bytes())));
        if matches {
            Ok(())
        } else {
            self.refused.with_label_values(&["token"]).inc();
            Err(Status::unauthenticated("missing or wrong cluster token"))
        }
    }

    /// Whether a Raft stream from node `from` (saying `incarnation` and `cluster_id`) may feed
    /// this node: never from another cluster, and never from an incarnation of a member that
    /// the member table no longer names (a second process under a replaced member's id).
    pub(crate) fn check_sender(
        &self,
        from: u64,
        incarnation: u64,
        cluster_id: &str,
    ) -> Result<(), Status> {
        let ours = self.status.borrow().cluster_id.clone();
        if crate::node::lifecycle::other_cluster(&ours, cluster_id) {
            self.refused.with_label_values(&["cluster_id"]).inc();
            return Err(Status::permission_denied(format!(
                "node {from} belongs to cluster {cluster_id}, this node to cluster {ours}"
            )));
        }
        let recorded = self.addresses.get(from).map_or(0, |a| a.incarnation);
        if incarnation != 0 && recorded != 0 && incarnation != recorded {
            self.refused.with_label_values(&["incarnation"]).inc();
            return Err(Status::permission_denied(format!(
                "node {from}'s incarnation {incarnation:016x} is not the member's \
                 ({recorded:016x}): its data was replaced"
            )));
        }
        Ok(())
    }

    /// Under mutual TLS: whether the request's connection presented a certificate naming node
    /// `id` (the CA was checked in the handshake). Without TLS every id passes.
    fn speaks_for<T>(&self, request: &Request<T>, id: u64) -> Result<(), Status> {
        self.cert_speaks_for(request.extensions().get::<super::tls::PeerCert>(), id)
    }

    /// Under mutual TLS: whether the request's connection presented a certificate naming the
    /// node the request says it comes from (`x-raftlock-from-node`), or an operator's. Peer
    /// list, removal and key-value writes need one of the two; a client certificate from the
    /// same CA has neither name.
    fn node_or_operator<T>(&self, request: &Request<T>, what: &str) -> Result<(), Status> {
        let Some(tls) = &self.tls else {
            return Ok(());
        };
        let cert = request.extensions().get::<super::tls::PeerCert>();
        if cert.is_some_and(|c| c.is_operator(tls)) {
            return Ok(());
        }
        let from = request
            .metadata()
            .get(FROM_NODE_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|id| *id != 0);
        match (from, cert) {
            (Some(id), Some(cert)) if cert.speaks_for(tls, id) => Ok(()),
            _ => {
                self.refused.with_label_values(&["identity"]).inc();
                Err(Status::permission_denied(format!(
                    "{what} needs a node's certificate (naming the node in \
                     {FROM_NODE_HEADER}) or an operator's"
                )))
            }
        }
    }

    /// [`PeerApi::speaks_for`] for a connection's certificate.
    pub(crate) fn cert_speaks_for(
        &self,
        cert: Option<&super::tls::PeerCert>,
        id: u64,
    ) -> Result<(), Status> {
        let Some(tls) = &self.tls else {
            return Ok(());
        };
        match cert {
            Some(cert) if cert.speaks_for(tls, id) => Ok(()),
            _ => {
                self.refused.with_label_values(&["identity"]).inc();
                Err(Status::permission_denied(format!(
                    "this connection's certificate does not name node {id}"
                )))
            }
        }
    }

    /// The start of an incoming Raft stream from node `from` (already authorized and checked
    /// against the connection's certificate), whether gRPC or plain: tells the driver the
    /// version the sender runs. Its messages then go through [`RaftStreamIn::deliver`].
    pub(crate) async fn open_raft_stream(
        &self,
        from: u64,
        peer_addr: String,
        client_addr: String,
        version: Option<u32>,
        incarnation: u64,
    ) -> RaftStreamIn<'_> {
        let mut stream = RaftStreamIn {
            api: self,
            from,
            peer_addr,
            client_addr,
            learned: false,
            incarnation,
        };
        // A stream may set only its own node's addresses, and only a member's: under TLS the
        // certificate binds it to that node; without TLS the cluster token is the guard.
        stream.learn_if_member();
        // The RaftLock cluster version the sender runs (none, 0, from a RaftLock from before
        // cluster versions), replacing what it said before: a leader raises the cluster's
        // version only once every member has said it, and takes nothing from a member that
        // says less than the cluster's (rolled back to an older build).
        let _ = self
            .driver
            .send(Input::PeerVersion {
                id: from,
                version: version.unwrap_or(0),
            })
            .await;
        let _ = self
            .driver
            .send(Input::PeerInfo {
                id: from,
                info: crate::lock::MemberInfo {
                    peer_addr: stream.peer_addr.clone(),
                    client_addr: stream.client_addr.clone(),
                    incarnation,
                },
            })
            .await;
        stream
    }
}

/// One incoming Raft stream's sender and what has been learned from it.
pub(crate) struct RaftStreamIn<'a> {
    api: &'a PeerApi,
    from: u64,
    peer_addr: String,
    client_addr: String,
    learned: bool,
    /// The incarnation the stream's hello said (0: not said).
    incarnation: u64,
}

impl RaftStreamIn<'_> {
    /// A stream can open before this node knows its sender as a member (a node that has not
    /// caught up with the configuration yet): look again with each message until it is one,
    /// or the sender's client address would stay unknown for as long as the stream lives.
    fn learn_if_member(&mut self) {
        if self.learned {
            return;
        }
        let member = {
            let s = self.api.status.borrow();
            s.voters.contains(&self.from) || s.learners.contains(&self.from)
        };
        if member {
            self.api
                .addresses
                .learn(self.from, &self.peer_addr, &self.client_addr);
            self.learned = true;
        }
    }

    /// Hands one message of the stream to the driver, if it is well formed, from the stream's
    /// node, and this node has been admitted to the cluster.
    pub(crate) fn deliver(&mut self, next: ppb::RaftMessage) {
        self.learn_if_member();
        let from = self.from;
        match message_from_pb(next) {
            Ok(_) if !self.api.admitted.load(Ordering::Acquire) => {
                debug!(
                    peer = from,
                    "dropping raft message: not admitted to the cluster yet"
                )
            }
            // Streams live long: a member replaced since this one opened (a force-deleted pod
            // still running beside its replacement) must not go on counting as the member.
            Ok(_)
                if self.incarnation != 0
                    && !self.api.addresses.incarnation_is(from, self.incarnation) =>
            {
                self.api.refused.with_label_values(&["incarnation"]).inc();
                debug!(
                    peer = from,
                    "dropping raft message: from an incarnation that is no longer the member"
                )
            }
            Ok(msg) if msg.from == from => {
                // Never block the stream on a busy driver: Raft tolerates loss.
                super::probe::peer_message_received(&msg);
                let _ = self.api.driver.try_send(Input::Peer(msg));
            }
            Ok(msg) => debug!(
                claimed = msg.from,
                stream = from,
                "dropping message with a forged sender"
            ),
            Err(err) => debug!(peer = from, cause = %err, "dropping malformed raft message"),
        }
    }
}

#[tonic::async_trait]
impl ppb::peer_server::Peer for PeerApi {
    async fn raft(
        &self,
        request: Request<Streaming<ppb::RaftMessage>>,
    ) -> Result<Response<ppb::RaftStreamClosed>, Status> {
        self.authorize(&request)?;
        let md = request.metadata();
        let header = |name: &str| {
            md.get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        let from: u64 = header(NODE_ID_HEADER).parse().unwrap_or(0);
        if from == 0 {
            // A stream must say which node it speaks for; its messages must then carry that id.
            return Err(Status::invalid_argument(format!(
                "a raft stream needs the {NODE_ID_HEADER} header with a node id"
            )));
        }
        self.speaks_for(&request, from)?;
        let incarnation: u64 = header(INCARNATION_HEADER).parse().unwrap_or(0);
        self.check_sender(from, incarnation, &header(CLUSTER_ID_HEADER))?;
        let version = header(VERSION_HEADER).parse::<u32>().ok();
        let mut incoming = self
            .open_raft_stream(
                from,
                header(PEER_ADDR_HEADER),
                header(CLIENT_ADDR_HEADER),
                version,
                incarnation,
            )
            .await;
        let mut stream = request.into_inner();
        while let Some(next) = stream.message().await? {
            incoming.deliver(next);
        }
        Ok(Response::new(ppb::RaftStreamClosed {}))
    }

    async fn join_cluster(
        &self,
        request: Request<ppb::JoinClusterRequest>,
    ) -> Result<Response<ppb::JoinClusterReply>, Status> {
        self.authorize(&request)?;
        // A node joins for itself; an operator (`lockctl members add`) for any node.
        let operator = match (
            &self.tls,
            request.extensions().get::<super::tls::PeerCert>(),
        ) {
            (Some(tls), Some(cert)) => cert.is_operator(tls),
            _ => false,
        };
        if !operator {
            self.speaks_for(&request, request.get_ref().server_id)?;
        }
        let r = request.into_inner();
        if r.server_id == 0 || r.server_addr.is_empty() {
            return Err(Status::invalid_argument(
                "server_id and server_addr are required",
            ));
        }
        // A member must be able to apply every entry of the log: a node older than the
        // cluster's version cannot. 0: not said (a RaftLock from before cluster versions, whose
        // data then stops it at the first state it cannot read; or `lockctl members add`,
        // which speaks for another node).
        let version = r.version;
        let (cluster_version, leader_id, cluster_id) = {
            let s = self.status.borrow();
            (s.cluster_version, s.leader_id, s.cluster_id.clone())
        };
        if crate::node::lifecycle::other_cluster(&cluster_id, &r.cluster_id) {
            self.refused.with_label_values(&["cluster_id"]).inc();
            return Ok(Response::new(ppb::JoinClusterReply {
                success: false,
                leader_id,
                error: format!(
                    "node {} belongs to cluster {}, this is cluster {cluster_id}",
                    r.server_id, r.cluster_id
                ),
                ..Default::default()
            }));
        }
        if version > 0 && version < cluster_version {
            return Ok(Response::new(ppb::JoinClusterReply {
                success: false,
                leader_id,
                error: format!(
                    "node {} runs cluster version {version} and the cluster is at version \
                     {cluster_version}: run a newer RaftLock on it",
                    r.server_id
                ),
                ..Default::default()
            }));
        }
        if version > 0 {
            let _ = self
                .driver
                .send(Input::PeerVersion {
                    id: r.server_id,
                    version,
                })
                .await;
        }
        let (tx, rx) = oneshot::channel();
        let input = Input::Join {
            id: r.server_id,
            peer_addr: r.server_addr,
            client_addr: r.client_addr,
            incarnation: r.incarnation,
            reply: tx,
        };
        self.driver
            .send(input)
            .await
            .map_err(|_| Status::unavailable("shutting down"))?;
        let reply = rx.await.map_err(|_| Status::unavailable("shutting down"))?;
        Ok(Response::new(ppb::JoinClusterReply {
            success: reply.success,
            leader_id: reply.leader_id,
            leader_addr: reply.leader_peer_addr,
            term: reply.term,
            error: reply.error,
        }))
    }

    async fn fetch_peer_list(
        &self,
        request: Request<ppb::FetchPeerListRequest>,
    ) -> Result<Response<ppb::FetchPeerListReply>, Status> {
        self.authorize(&request)?;
        self.node_or_operator(&request, "the peer list")?;
        let s = self.status.borrow().clone();
        let book = self.addresses.all();
        let peer_set: Vec<u64> = s.voters.iter().chain(s.learners.iter()).copied().collect();
        let peer_address = peer_set
            .iter()
            .filter_map(|id| book.get(id).map(|a| (*id, a.peer.clone())))
            .collect();
        let client_address = peer_set
            .iter()
            .filter_map(|id| book.get(id).map(|a| (*id, a.client.clone())))
            .filter(|(_, a)| !a.is_empty())
            .collect();
        Ok(Response::new(ppb::FetchPeerListReply {
            success: s.leader_id != 0,
            term: s.term,
            leader_id: s.leader_id,
            leader_addr: book
                .get(&s.leader_id)
                .map(|a| a.peer.clone())
                .unwrap_or_default(),
            peer_set,
            peer_address,
            client_address,
            match_index: s
                .replication
                .iter()
                .map(|r| (r.id, r.match_index))
                .collect(),
            commit_index: s.commit_index,
            node_id: s.id,
            has_data: s.has_data,
            cluster_id: s.cluster_id.clone(),
            forced_by: s.forced_by.clone(),
            incarnation: self.incarnation,
        }))
    }

    async fn remove_server(
        &self,
        request: Request<ppb::RemoveServerRequest>,
    ) -> Result<Response<ppb::RemoveServerReply>, Status> {
        self.authorize(&request)?;
        self.node_or_operator(&request, "removing a member")?;
        let id = request.into_inner().server_id;
        let (tx, rx) = oneshot::channel();
        self.driver
            .send(Input::Remove { id, reply: tx })
            .await
            .map_err(|_| Status::unavailable("shutting down"))?;
        let result = rx.await.map_err(|_| Status::unavailable("shutting down"))?;
        let s = self.status.borrow().clone();
        let leader_addr = self
            .addresses
            .get(s.leader_id)
            .map(|a| a.peer)
            .unwrap_or_default();
        Ok(Response::new(match result {
            Ok(()) => ppb::RemoveServerReply {
                success: true,
                leader_id: s.leader_id,
                leader_addr,
                error: String::new(),
            },
            Err(e) => ppb::RemoveServerReply {
                success: false,
                leader_id: e.leader_id,
                leader_addr,
                error: e.message,
            },
        }))
    }

    async fn append_data(
        &self,
        request: Request<ppb::AppendDataRequest>,
    ) -> Result<Response<ppb::AppendDataReply>, Status> {
        self.authorize(&request)?;
        self.node_or_operator(&request, "a key-value write on the peer port")?;
        let r = request.into_inner();
        let op = if r.delete {
            ClientOp::Delete {
                key: r.key,
                guard: None,
                client_id: r.client_id,
                request_id: r.request_id,
            }
        } else {
            ClientOp::Put {
                key: r.key,
                value: r.value,
                guard: None,
                client_id: r.client_id,
                request_id: r.request_id,
            }
        };
        let (tx, rx) = oneshot::channel();
        self.driver
            .send(Input::Client {
                op,
                conn: 0,
                reply: tx,
            })
            .await
            .map_err(|_| Status::unavailable("shutting down"))?;
        let reply = rx.await.map_err(|_| Status::unavailable("shutting down"))?;
        Ok(Response::new(match reply {
            ClientReply::Stored | ClientReply::Deleted { .. } => ppb::AppendDataReply {
                success: true,
                ..Default::default()
            },
            ClientReply::Error(e) => ppb::AppendDataReply {
                success: false,
                leader_id: e.leader_id,
                leader_addr: e.leader_addr,
                error: e.message,
            },
            other => ppb::AppendDataReply {
                success: false,
                error: format!("unexpected {other:?}"),
                ..Default::default()
            },
        }))
    }

    async fn forward_client(
        &self,
        request: Request<ppb::ForwardClientRequest>,
    ) -> Result<Response<ppb::ForwardClientReply>, Status> {
        self.authorize(&request)?;
        self.speaks_for(&request, request.get_ref().from_node)?;
        let traceparent = super::ws::traceparent_header(request.metadata());
        let r = request.into_inner();
        let op: ClientOp = serde_json::from_slice(&r.op_json)
            .map_err(|e| Status::invalid_argument(format!("undecodable operation: {e}")))?;
        let span = super::ws::request_span(&op, "forwarded", traceparent.as_deref());
        let conn = super::ws::next_conn();
        // If the forwarding node drops the call (its client went away), this node treats the
        // request's waiters like those of a closed connection.
        let mut gone = super::ws::DisconnectOnDrop::new(self.driver.clone(), conn);
        let (tx, rx) = oneshot::channel();
        let name = op.name();
        let reply = match self.driver.try_send(Input::Client {
            op,
            conn,
            reply: tx,
        }) {
            Ok(()) => {
                let started = std::time::Instant::now();
                let reply = rx.instrument(span.clone()).await.unwrap_or_else(|_| {
                    ClientReply::error(ErrorCode::Unavailable, "node is shutting down")
                });
                self.request_duration
                    .with_label_values(&[name])
                    .observe(started.elapsed().as_secs_f64());
                reply
            }
            Err(_) => ClientReply::error(ErrorCode::Busy, "the leader's request queue is full"),
        };
        gone.disarm();
        super::ws::finish_span(&span, &reply);
        let reply_json = serde_json::to_vec(&reply)
            .map_err(|e| Status::internal(format!("answer does not encode: {e}")))?;
        Ok(Response::new(ppb::ForwardClientReply { reply_json }))
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
