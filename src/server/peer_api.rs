//! The peer port's services: the `Peer` gRPC service (Raft streams, joins, the peer list,
//! removals, key-value writes, and client requests that followers forward here) and the
//! accepting side of plain Raft streams (their framing and handshake are `peer_stream.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, Instrument};

use super::api::{ClientOp, ClientReply, ErrorCode};
use super::convert::message_from_pb;
use super::driver::Input;
use super::peer_stream::{
    put_frame, ConnectionCert, FrameReader, HANDSHAKE_DEADLINE, HANDSHAKE_FRAME_MAX,
};
use super::proto::peer as ppb;
use super::transport::{
    AddressBook, CLIENT_ADDR_HEADER, CLUSTER_ID_HEADER, FROM_NODE_HEADER, INCARNATION_HEADER,
    NODE_ID_HEADER, PEER_ADDR_HEADER, TOKEN_HEADER, VERSION_HEADER,
};

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
                span: tracing::Span::none(),
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
        let traceparent = super::exec::traceparent_header(request.metadata());
        let r = request.into_inner();
        let op: ClientOp = serde_json::from_slice(&r.op_json)
            .map_err(|e| Status::invalid_argument(format!("undecodable operation: {e}")))?;
        let span = super::exec::request_span(&op, "forwarded", traceparent.as_deref());
        let conn = super::exec::next_conn();
        // If the forwarding node drops the call (its client went away), this node treats the
        // request's waiters like those of a closed connection.
        let mut gone = super::exec::DisconnectOnDrop::new(self.driver.clone(), conn);
        let (tx, rx) = oneshot::channel();
        let name = op.name();
        let reply = match self.driver.try_send(Input::Client {
            op,
            conn,
            reply: tx,
            span: span.clone(),
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
        super::exec::finish_span(&span, &reply);
        let reply_json = serde_json::to_vec(&reply)
            .map_err(|e| Status::internal(format!("answer does not encode: {e}")))?;
        Ok(Response::new(ppb::ForwardClientReply { reply_json }))
    }
}

/// Serves one plain Raft stream (its magic already read): checks its hello as `Peer.Raft`
/// checks its metadata, answers, then hands its messages to the driver until it ends.
pub async fn serve<S>(api: Arc<PeerApi>, io: S, max_message_bytes: usize)
where
    S: AsyncRead + AsyncWrite + ConnectionCert + Unpin,
{
    let cert = io.presented_cert();
    let mut reader = FrameReader::new(io, HANDSHAKE_FRAME_MAX);
    let hello =
        match tokio::time::timeout(HANDSHAKE_DEADLINE, reader.next::<ppb::RaftStreamHello>()).await
        {
            Ok(Ok(Some(hello))) => hello,
            Ok(Ok(None)) => return,
            Ok(Err(err)) => {
                debug!(cause = %err, "dropping a plain raft stream: bad hello");
                return;
            }
            Err(_) => {
                debug!("dropping a plain raft stream: no hello in time");
                return;
            }
        };
    let verdict = api
        .check_token(Some(&hello.cluster_token))
        .and_then(|()| {
            if hello.node_id == 0 {
                Err(tonic::Status::invalid_argument(
                    "a raft stream's hello needs a node id",
                ))
            } else {
                Ok(())
            }
        })
        .and_then(|()| api.cert_speaks_for(cert.as_ref(), hello.node_id))
        .and_then(|()| api.check_sender(hello.node_id, hello.incarnation, &hello.cluster_id));
    let refused = match &verdict {
        Ok(()) => String::new(),
        Err(status) => status.message().to_string(),
    };
    let mut answer = BytesMut::new();
    put_frame(&mut answer, &ppb::RaftStreamAccept { refused });
    let answered = tokio::time::timeout(HANDSHAKE_DEADLINE, async {
        reader.get_mut().write_all(&answer).await?;
        reader.get_mut().flush().await
    })
    .await;
    if verdict.is_err() || !matches!(answered, Ok(Ok(()))) {
        return;
    }
    let version = (hello.version != 0).then_some(hello.version);
    let mut incoming = api
        .open_raft_stream(
            hello.node_id,
            hello.peer_addr,
            hello.client_addr,
            version,
            hello.incarnation,
        )
        .await;
    reader.set_max(max_message_bytes);
    loop {
        match reader.next::<ppb::RaftMessage>().await {
            Ok(Some(msg)) => incoming.deliver(msg),
            Ok(None) => return,
            Err(err) => {
                debug!(peer = hello.node_id, cause = %err, "a plain raft stream ended");
                return;
            }
        }
    }
}
