//! Peer transport: one long-lived stream per peer carrying Raft messages — a plain stream of
//! length-prefixed frames (`peer_stream`), or the `Peer.Raft` gRPC stream where the peer takes
//! no plain ones or `--peer-stream grpc` says so — with reconnect and backoff, plus the server
//! side that feeds incoming messages to the node driver.
//!
//! ```text
//!   driver ─send(msg)─► per-peer bounded queue ─► sender task ─► plain or Peer.Raft stream ─► peer
//!          └─(plain TCP stream on the driver's thread, nothing waiting)─► socket, at once
//!   peer ─► stream ─► PeerApi ─► driver input queue
//! ```
//! A full queue or a peer that is down drops messages: Raft retransmits what matters. Nothing here
//! blocks the driver.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn};

use super::convert::message_to_pb;
use super::peer_stream;
use super::proto::peer::peer_client::PeerClient;
use super::proto::peer::{RaftMessage, RaftStreamHello};
use super::tls::PeerTls;
use crate::raft::{Message, NodeId};
use crate::telemetry::NodeMetrics;

pub const TOKEN_HEADER: &str = "x-raftlock-cluster-token";
/// The node a membership request or peer-list request speaks for (its certificate must name
/// it under peer TLS); absent from operator tools.
pub const FROM_NODE_HEADER: &str = "x-raftlock-from-node";
pub const NODE_ID_HEADER: &str = "x-raftlock-node-id";
pub const PEER_ADDR_HEADER: &str = "x-raftlock-peer-addr";
pub const CLIENT_ADDR_HEADER: &str = "x-raftlock-client-addr";
/// The RaftLock cluster version the sending node runs (`lock::CLUSTER_VERSION`).
pub const VERSION_HEADER: &str = "x-raftlock-version";
/// The sending node's incarnation (see `RaftStreamHello.incarnation`).
pub const INCARNATION_HEADER: &str = "x-raftlock-incarnation";
/// The sending node's cluster id (see `RaftStreamHello.cluster_id`).
pub const CLUSTER_ID_HEADER: &str = "x-raftlock-cluster-id";

/// Messages queued per peer before new ones are dropped.
const PEER_QUEUE_MESSAGES: usize = 4096;
const BACKOFF_MIN: Duration = Duration::from_millis(20);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Where each member can be reached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemberAddrs {
    pub peer: String,
    pub client: String,
    /// The member's incarnation as the member table records it (0: not known).
    pub incarnation: u64,
}

/// The addresses this node knows, learned from configuration, joins and peers' stream headers.
#[derive(Clone, Debug, Default)]
pub struct AddressBook {
    inner: Arc<RwLock<BTreeMap<NodeId, MemberAddrs>>>,
}

impl AddressBook {
    pub fn get(&self, id: NodeId) -> Option<MemberAddrs> {
        self.inner.read().ok()?.get(&id).cloned()
    }

    /// Whether `id`'s client address is `addr` (an unknown id has the empty address); reads
    /// without copying.
    pub fn client_addr_is(&self, id: NodeId, addr: &str) -> bool {
        match self.inner.read() {
            Ok(map) => map.get(&id).map_or("", |a| a.client.as_str()) == addr,
            Err(_) => addr.is_empty(),
        }
    }

    pub fn all(&self) -> BTreeMap<NodeId, MemberAddrs> {
        self.inner.read().map(|m| m.clone()).unwrap_or_default()
    }

    /// Records what is known; empty fields keep the previous value.
    pub fn learn(&self, id: NodeId, peer: &str, client: &str) {
        if id == 0 {
            return;
        }
        if let Ok(mut map) = self.inner.write() {
            let entry = map.entry(id).or_default();
            if !peer.is_empty() {
                entry.peer = peer.to_string();
            }
            if !client.is_empty() {
                entry.client = client.to_string();
            }
        }
    }

    /// Whether `id`'s recorded incarnation is `incarnation`, or none is recorded (reads without
    /// copying: asked for every message of a Raft stream).
    pub fn incarnation_is(&self, id: NodeId, incarnation: u64) -> bool {
        match self.inner.read() {
            Ok(map) => map
                .get(&id)
                .is_none_or(|a| a.incarnation == 0 || a.incarnation == incarnation),
            Err(_) => true,
        }
    }

    /// The leader replaces member `id` by a new incarnation: from now on only that one speaks
    /// for it here, whatever the member table says yet.
    pub fn set_incarnation(&self, id: NodeId, incarnation: u64) {
        if id == 0 || incarnation == 0 {
            return;
        }
        if let Ok(mut map) = self.inner.write() {
            map.entry(id).or_default().incarnation = incarnation;
        }
    }

    /// Records a member table entry: addresses as [`AddressBook::learn`], and its incarnation.
    pub fn learn_member(&self, id: NodeId, peer: &str, client: &str, incarnation: u64) {
        self.learn(id, peer, client);
        if incarnation != 0 {
            if let Ok(mut map) = self.inner.write() {
                map.entry(id).or_default().incarnation = incarnation;
            }
        }
    }
}

/// How this node opens connections to other nodes' peer ports: over mutual TLS when configured,
/// and with the cluster token when one is set.
#[derive(Clone, Debug, Default)]
pub struct PeerDialer {
    pub cluster_token: String,
    pub tls: Option<Arc<PeerTls>>,
    /// The node this dialer speaks for (sent as `x-raftlock-from-node`; 0: an operator tool,
    /// which under TLS must present an operator's certificate).
    pub from_node: NodeId,
}

impl PeerDialer {
    /// The endpoint for a peer address (`host:port`); TLS, when on, is added by the connector.
    pub fn endpoint(addr: &str) -> Result<Endpoint, tonic::transport::Error> {
        Endpoint::from_shared(format!("http://{addr}"))
    }

    /// Connects; `expect`: the node id that must answer there, when known (checked against its
    /// certificate under TLS).
    pub async fn connect(
        &self,
        endpoint: Endpoint,
        expect: Option<NodeId>,
    ) -> Result<Channel, tonic::transport::Error> {
        match &self.tls {
            Some(tls) => tls.connect(endpoint, expect).await,
            None => endpoint.connect().await,
        }
    }

    /// [`PeerDialer::connect`], connecting on first use.
    pub fn connect_lazy(&self, endpoint: Endpoint, expect: Option<NodeId>) -> Channel {
        match &self.tls {
            Some(tls) => tls.connect_lazy(endpoint, expect),
            None => endpoint.connect_lazy(),
        }
    }

    /// A request carrying the cluster token, when one is set.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if self.from_node != 0 {
            if let Ok(v) = self.from_node.to_string().parse() {
                request.metadata_mut().insert(FROM_NODE_HEADER, v);
            }
        }
        if !self.cluster_token.is_empty() {
            if let Ok(v) = self.cluster_token.parse() {
                request.metadata_mut().insert(TOKEN_HEADER, v);
            }
        }
        request
    }
}

/// This node's identity, sent with every outgoing stream so peers learn its addresses.
#[derive(Clone, Debug)]
pub struct LocalIdentity {
    pub id: NodeId,
    pub peer_addr: String,
    pub client_addr: String,
    /// The random id this node's data directory was created with.
    pub incarnation: u64,
    /// The cluster id once known (32 hex digits), set by the driver.
    pub cluster_id: Arc<RwLock<String>>,
}

impl LocalIdentity {
    pub fn cluster_id(&self) -> String {
        self.cluster_id
            .read()
            .map(|c| c.clone())
            .unwrap_or_default()
    }
}

/// Sends Raft messages to peers over long-lived streams.
#[derive(Clone)]
pub struct PeerTransport {
    identity: LocalIdentity,
    dialer: PeerDialer,
    addresses: AddressBook,
    peers: Arc<RwLock<BTreeMap<NodeId, PeerQueue>>>,
    metrics: NodeMetrics,
    max_message_bytes: usize,
    /// Where peer connections run: the I/O runtime, even when `send` is called from the Raft
    /// driver's own thread; or, for [`PeerTransport::on_calling_runtime`], the runtime of the
    /// thread that sends.
    runtime: Option<tokio::runtime::Handle>,
    /// Open plain Raft streams (`peer_stream`) rather than `Peer.Raft` gRPC streams, falling
    /// back to gRPC for a peer that does not take them.
    plain_streams: bool,
}

impl std::fmt::Debug for PeerTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTransport")
            .field("id", &self.identity.id)
            .finish()
    }
}

impl PeerTransport {
    /// Where the driver writes the cluster id once the cluster has one (streams opened after
    /// that carry it in their hello).
    pub fn cluster_id_cell(&self) -> Arc<RwLock<String>> {
        self.identity.cluster_id.clone()
    }
}

impl PeerTransport {
    pub fn new(
        identity: LocalIdentity,
        dialer: PeerDialer,
        addresses: AddressBook,
        metrics: NodeMetrics,
        max_message_bytes: usize,
    ) -> Self {
        PeerTransport {
            identity,
            dialer,
            addresses,
            peers: Arc::default(),
            metrics,
            max_message_bytes,
            runtime: Some(tokio::runtime::Handle::current()),
            plain_streams: true,
        }
    }

    /// Whether to open plain Raft streams (the default) or only `Peer.Raft` gRPC streams.
    pub fn with_plain_streams(mut self, plain: bool) -> Self {
        self.plain_streams = plain;
        self
    }

    /// A transport of its own (its own streams, one more connection per peer) whose
    /// connections run on the runtime of the thread that calls `send`. The driver sends the
    /// leader's appends and a follower's answers to them through one: they leave from the
    /// driver's thread when it yields (before the leader's flush, after a follower's turn),
    /// instead of waiting for a sleeping I/O worker to wake (30-100 µs on a small VM, on the
    /// commit path of every request).
    pub fn on_calling_runtime(&self) -> PeerTransport {
        PeerTransport {
            peers: Arc::default(),
            runtime: None,
            ..self.clone()
        }
    }

    pub fn addresses(&self) -> &AddressBook {
        &self.addresses
    }

    /// Sends `msg` to its peer, starting the peer's sender task on first use: written to the
    /// peer's socket at once where it can be (a plain stream over TCP with nothing waiting
    /// ahead of it, on a transport [`on_calling_runtime`](PeerTransport::on_calling_runtime)),
    /// otherwise queued for the sender task. Never blocks.
    pub fn send(&self, msg: &Message) -> Sent {
        let to = msg.to;
        let pb = message_to_pb(msg);
        let peer = self.peers.read().ok().and_then(|p| p.get(&to).cloned());
        let peer = match peer {
            Some(p) if !p.tx.is_closed() => Some(p),
            _ => self.start_peer(to),
        };
        let sent = match peer {
            Some(peer) => match peer.line.as_ref().and_then(|line| {
                // Straight to the socket only when nothing queued could be overtaken.
                let idle = peer.tx.capacity() == peer.tx.max_capacity();
                idle.then(|| line.send(&pb, self.max_message_bytes))
                    .flatten()
            }) {
                Some(sent) => sent,
                None if peer.tx.try_send(pb).is_ok() => Sent::Queued,
                None => Sent::Dropped,
            },
            None => Sent::Dropped,
        };
        if sent == Sent::Dropped {
            self.metrics
                .peer_messages_dropped_total
                .with_label_values(&[&to.to_string()])
                .inc();
        }
        sent
    }

    /// Stops sending to peers that are no longer members.
    pub fn retain(&self, members: impl Fn(NodeId) -> bool) {
        if let Ok(mut peers) = self.peers.write() {
            peers.retain(|id, _| members(*id));
        }
    }

    /// None when there is no runtime to run the peer's connection on (only a transport
    /// [`on_calling_runtime`](PeerTransport::on_calling_runtime) called from outside one).
    fn start_peer(&self, to: NodeId) -> Option<PeerQueue> {
        let runtime = match &self.runtime {
            Some(runtime) => runtime.clone(),
            None => tokio::runtime::Handle::try_current().ok()?,
        };
        let (tx, rx) = mpsc::channel(PEER_QUEUE_MESSAGES);
        // The peer's drop counter exists (at 0) from the first message on.
        self.metrics
            .peer_messages_dropped_total
            .with_label_values(&[&to.to_string()]);
        // Writing from the sending thread needs the stream's task on that thread (so that
        // the two never write at once), and a socket it can write to without TLS.
        let line = (self.runtime.is_none() && self.plain_streams && self.dialer.tls.is_none())
            .then(Arc::default);
        let peer = PeerQueue {
            tx,
            line: line.clone(),
        };
        if let Ok(mut peers) = self.peers.write() {
            peers.insert(to, peer.clone());
        }
        let task = PeerSender {
            to,
            identity: self.identity.clone(),
            dialer: self.dialer.clone(),
            addresses: self.addresses.clone(),
            max_message_bytes: self.max_message_bytes,
            plain_streams: self.plain_streams,
            metrics: self.metrics.clone(),
            line,
        };
        runtime.spawn(task.run(rx));
        Some(peer)
    }
}

struct PeerSender {
    to: NodeId,
    identity: LocalIdentity,
    dialer: PeerDialer,
    addresses: AddressBook,
    max_message_bytes: usize,
    plain_streams: bool,
    metrics: NodeMetrics,
    /// Where `send` writes straight to the socket of this peer's plain TCP stream.
    line: Option<Arc<Line>>,
}

/// What [`PeerTransport::send`] did with a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    /// Written to the peer's socket.
    Written,
    /// Queued for the peer's sender task, which writes it when its runtime runs it.
    Queued,
    /// Dropped (counted): the queue was full, there was no runtime to run a stream on, or
    /// the message was over the size limit.
    Dropped,
}

#[derive(Clone)]
struct PeerQueue {
    tx: mpsc::Sender<RaftMessage>,
    line: Option<Arc<Line>>,
}

/// A plain TCP stream's socket, shared by its sender task and [`PeerTransport::send`]. Every
/// frame waiting to be written is in `pending`, in order: the task moves queued messages there
/// before writing, and `send` writes straight to the socket only when nothing is pending or
/// queued, so no message overtakes another.
#[derive(Default)]
struct Line {
    state: std::sync::Mutex<LineState>,
    /// Wakes the task when `send` left bytes in `pending`.
    wake: tokio::sync::Notify,
}

#[derive(Default)]
struct LineState {
    /// The stream's socket while it is up (after its handshake).
    socket: Option<Arc<TcpStream>>,
    pending: BytesMut,
}

impl Line {
    /// Writes `msg` to the socket, leaving to the task what the socket does not take at
    /// once. None when there is no stream up (queue it instead).
    fn send(&self, msg: &RaftMessage, max_message_bytes: usize) -> Option<Sent> {
        let mut state = self.state.lock().ok()?;
        let socket = state.socket.clone()?;
        super::probe::peer_stream_took();
        // With bytes already pending the task writes them, this frame after them.
        let behind = !state.pending.is_empty();
        if behind && state.pending.len() >= peer_stream::WRITE_BATCH_BYTES * 4
            || !peer_stream::put_frame_within(&mut state.pending, msg, max_message_bytes)
        {
            return Some(Sent::Dropped);
        }
        if !behind {
            // An error is left for the task to find (its read side ends, or its own write
            // fails).
            let _ = write_some(&socket, &mut state.pending);
        }
        if state.pending.is_empty() {
            Some(Sent::Written)
        } else {
            self.wake.notify_one();
            Some(Sent::Queued)
        }
    }
}

/// Writes what the socket takes without waiting; an error only for a broken connection.
fn write_some(socket: &TcpStream, pending: &mut BytesMut) -> std::io::Result<()> {
    use bytes::Buf;
    while !pending.is_empty() {
        match socket.try_write(pending) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => pending.advance(n),
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// The peer's queue, shared by the successive streams of one peer sender: each stream takes
/// messages straight from it, so a message goes from the driver to the connection's writer
/// without another task in between.
type SharedQueue = Arc<tokio::sync::Mutex<mpsc::Receiver<RaftMessage>>>;

impl PeerSender {
    /// Connects, streams, and reconnects with exponential backoff until the queue is dropped.
    async fn run(self, queue: mpsc::Receiver<RaftMessage>) {
        let queue: SharedQueue = Arc::new(tokio::sync::Mutex::new(queue));
        let mut backoff = BACKOFF_MIN;
        // Plain streams where the peer takes them; gRPC after a peer answered the plain
        // stream's opening as a RaftLock without them does, until that stream ends (the peer
        // may have been upgraded when it comes back).
        let mut plain = self.plain_streams;
        loop {
            let Some(addr) = self
                .addresses
                .get(self.to)
                .map(|a| a.peer)
                .filter(|a| !a.is_empty())
            else {
                // Unknown address: drop what is queued and wait for it to be learned.
                if !drain_for(&mut *queue.lock().await, backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            };
            let streamed = if plain {
                self.stream_plain(&addr, &queue).await
            } else {
                let streamed = self.stream_once(&addr, &queue).await;
                plain = self.plain_streams;
                streamed
            };
            match streamed {
                Ok(StreamEnd::QueueClosed) => return,
                Ok(StreamEnd::Disconnected) => backoff = BACKOFF_MIN,
                Err(err)
                    if matches!(
                        err.downcast_ref::<peer_stream::DialError>(),
                        Some(peer_stream::DialError::NotSpoken(_))
                    ) =>
                {
                    info!(peer = self.to, %addr, cause = %err, "no plain raft stream taken there (a RaftLock without them, or a node that went away while answering): trying gRPC");
                    plain = false;
                }
                Err(err) => {
                    debug!(peer = self.to, %addr, cause = %err, "peer connection failed");
                    if !drain_for(&mut *queue.lock().await, backoff).await {
                        return;
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    async fn stream_once(
        &self,
        addr: &str,
        queue: &SharedQueue,
    ) -> Result<StreamEnd, Box<dyn std::error::Error + Send + Sync>> {
        let endpoint = PeerDialer::endpoint(addr)?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5));
        // Under TLS the node that answers must hold a certificate naming the id dialled.
        let channel: Channel = self.dialer.connect(endpoint, Some(self.to)).await?;
        let mut client = PeerClient::new(channel)
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);
        // Ends when the queue is closed (the peer left the membership or the node stops). When
        // the connection fails, tonic drops the stream, and with it the lock on the queue.
        let messages = futures::stream::unfold(queue.clone(), |queue| async move {
            let next = queue.lock().await.recv().await;
            super::probe::peer_stream_took();
            next.map(|msg| (msg, queue))
        });
        let mut request = self.dialer.request(messages);
        let md = request.metadata_mut();
        md.insert(NODE_ID_HEADER, MetadataValue::from(self.identity.id));
        if let Ok(v) = self.identity.peer_addr.parse() {
            md.insert(PEER_ADDR_HEADER, v);
        }
        if let Ok(v) = self.identity.client_addr.parse() {
            md.insert(CLIENT_ADDR_HEADER, v);
        }
        md.insert(
            VERSION_HEADER,
            MetadataValue::from(crate::lock::CLUSTER_VERSION),
        );
        md.insert(
            INCARNATION_HEADER,
            MetadataValue::from(self.identity.incarnation),
        );
        if let Ok(v) = self.identity.cluster_id().parse() {
            md.insert(CLUSTER_ID_HEADER, v);
        }
        self.opened("grpc");
        let result = client.raft(request).await;
        if queue.lock().await.is_closed() {
            return Ok(StreamEnd::QueueClosed);
        }
        if let Err(status) = result {
            warn!(peer = self.to, code = ?status.code(), message = status.message(), "peer closed the raft stream");
        }
        Ok(StreamEnd::Disconnected)
    }
}

impl PeerSender {
    /// One plain Raft stream (`peer_stream`): connects, says hello, then writes every message
    /// the queue gives, those already queued together in one write, until the queue closes or
    /// the connection ends. Over TLS [`PeerSender::run_plain`] writes them; over TCP
    /// [`PeerSender::run_plain_tcp`].
    async fn stream_plain(
        &self,
        addr: &str,
        queue: &SharedQueue,
    ) -> Result<StreamEnd, Box<dyn std::error::Error + Send + Sync>> {
        let tcp = tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr))
            .await
            .map_err(|_| format!("connecting to {addr} timed out"))??;
        let _ = tcp.set_nodelay(true);
        super::sockets::watch_liveness(&tcp);
        match &self.dialer.tls {
            Some(tls) => {
                let io = tls.dial(tcp, Some(self.to)).await?;
                self.run_plain(io, queue).await
            }
            None => self.run_plain_tcp(tcp, queue).await,
        }
    }

    fn hello(&self) -> RaftStreamHello {
        RaftStreamHello {
            node_id: self.identity.id,
            peer_addr: self.identity.peer_addr.clone(),
            client_addr: self.identity.client_addr.clone(),
            version: crate::lock::CLUSTER_VERSION,
            cluster_token: self.dialer.cluster_token.clone(),
            incarnation: self.identity.incarnation,
            cluster_id: self.identity.cluster_id(),
        }
    }

    /// A plain stream over TCP: every frame goes through the line's `pending` bytes, which
    /// [`PeerTransport::send`] may also write to the socket directly (see [`Line`]).
    async fn run_plain_tcp(
        &self,
        mut tcp: TcpStream,
        queue: &SharedQueue,
    ) -> Result<StreamEnd, Box<dyn std::error::Error + Send + Sync>> {
        peer_stream::dial(&mut tcp, &self.hello()).await?;
        self.opened("plain");
        let socket = Arc::new(tcp);
        let line = self.line.clone().unwrap_or_default();
        if let Ok(mut state) = line.state.lock() {
            state.pending.clear();
            state.socket = Some(socket.clone());
        }
        // However the stream ends, `send` stops writing to its socket.
        struct Down(Arc<Line>);
        impl Drop for Down {
            fn drop(&mut self) {
                if let Ok(mut state) = self.0.state.lock() {
                    state.socket = None;
                    state.pending.clear();
                }
            }
        }
        let _down = Down(line.clone());
        let mut queue = queue.lock().await;
        let mut stray = [0u8; 1];
        let mut progress = tokio::time::Instant::now();
        loop {
            let (waiting, full) = {
                let Ok(mut state) = line.state.lock() else {
                    return Ok(StreamEnd::Disconnected);
                };
                while state.pending.len() < peer_stream::WRITE_BATCH_BYTES {
                    match queue.try_recv() {
                        Ok(next) => self.put(&mut state.pending, &next),
                        Err(_) => break,
                    }
                }
                let before = state.pending.len();
                if let Err(err) = write_some(&socket, &mut state.pending) {
                    debug!(peer = self.to, cause = %err, "plain raft stream closed");
                    return Ok(StreamEnd::Disconnected);
                }
                if state.pending.len() < before || state.pending.is_empty() {
                    progress = tokio::time::Instant::now();
                }
                (
                    !state.pending.is_empty(),
                    state.pending.len() >= peer_stream::WRITE_BATCH_BYTES,
                )
            };
            tokio::select! {
                biased;
                // While the socket is behind, messages wait in the bounded queue (which drops
                // beyond its bound), not in ever more pending bytes.
                next = queue.recv(), if !full => {
                    let Some(next) = next else {
                        return Ok(StreamEnd::QueueClosed);
                    };
                    if let Ok(mut state) = line.state.lock() {
                        self.put(&mut state.pending, &next);
                    }
                }
                _ = line.wake.notified() => {}
                _ = socket.writable(), if waiting => {}
                _ = tokio::time::sleep_until(progress + peer_stream::WRITE_DEADLINE), if waiting => {
                    warn!(peer = self.to, "the peer took no bytes for {:?}: reconnecting", peer_stream::WRITE_DEADLINE);
                    return Ok(StreamEnd::Disconnected);
                }
                // The peer sends nothing on this stream: anything read, or its end, ends it.
                _ = socket.readable() => match socket.try_read(&mut stray) {
                    Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
                    _ => return Ok(StreamEnd::Disconnected),
                },
            }
        }
    }

    /// A plain stream over TLS: the task writes every message.
    async fn run_plain<S>(
        &self,
        mut io: S,
        queue: &SharedQueue,
    ) -> Result<StreamEnd, Box<dyn std::error::Error + Send + Sync>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        peer_stream::dial(&mut io, &self.hello()).await?;
        self.opened("plain");
        let (mut read, mut write) = tokio::io::split(io);
        // Ends with the connection: the peer sends nothing on it, so anything read ends it.
        let mut stray = [0u8; 1];
        let mut queue = queue.lock().await;
        let mut buf = BytesMut::with_capacity(16 * 1024);
        loop {
            let first = tokio::select! {
                biased;
                next = queue.recv() => next,
                _ = read.read(&mut stray) => return Ok(StreamEnd::Disconnected),
            };
            let Some(first) = first else {
                return Ok(StreamEnd::QueueClosed);
            };
            buf.clear();
            self.put(&mut buf, &first);
            while buf.len() < peer_stream::WRITE_BATCH_BYTES {
                match queue.try_recv() {
                    Ok(next) => self.put(&mut buf, &next),
                    Err(_) => break,
                }
            }
            if buf.is_empty() {
                continue;
            }
            match tokio::time::timeout(peer_stream::WRITE_DEADLINE, write.write_all(&buf)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    debug!(peer = self.to, cause = %err, "plain raft stream closed");
                    return Ok(StreamEnd::Disconnected);
                }
                Err(_) => {
                    warn!(
                        peer = self.to,
                        "the peer took no bytes for {:?}: reconnecting",
                        peer_stream::WRITE_DEADLINE
                    );
                    return Ok(StreamEnd::Disconnected);
                }
            }
        }
    }

    fn opened(&self, kind: &str) {
        self.metrics
            .peer_streams_opened_total
            .with_label_values(&[&self.to.to_string(), kind])
            .inc();
    }

    /// Adds one message's frame, or drops it (counted) when it is over the message limit, as
    /// the gRPC stream would refuse to send it.
    fn put(&self, buf: &mut BytesMut, msg: &RaftMessage) {
        super::probe::peer_stream_took();
        if !peer_stream::put_frame_within(buf, msg, self.max_message_bytes) {
            self.metrics
                .peer_messages_dropped_total
                .with_label_values(&[&self.to.to_string()])
                .inc();
        }
    }
}

enum StreamEnd {
    QueueClosed,
    Disconnected,
}

/// Discards queued messages for `wait`; false if the queue was closed.
async fn drain_for(queue: &mut mpsc::Receiver<RaftMessage>, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, queue.recv()).await {
            Ok(Some(_)) => continue,
            Ok(None) => return false,
            Err(_) => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft::MessageBody;

    fn answer_to(to: NodeId) -> Message {
        Message {
            from: 1,
            to,
            term: 3,
            body: MessageBody::HeartbeatResponse { read_seq: 7 },
        }
    }

    fn dropped(metrics: &NodeMetrics, peer: &str) -> u64 {
        metrics
            .peer_messages_dropped_total
            .with_label_values(&[peer])
            .get()
    }

    #[test]
    fn a_transport_on_the_calling_runtime_starts_streams_there_and_drops_sends_from_outside_one() {
        let io = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let metrics = NodeMetrics::new();
        let identity = LocalIdentity {
            id: 1,
            peer_addr: "127.0.0.1:1".into(),
            client_addr: String::new(),
            incarnation: 1,
            cluster_id: Default::default(),
        };
        let transport = io.block_on(async {
            PeerTransport::new(
                identity,
                PeerDialer::default(),
                AddressBook::default(),
                metrics.clone(),
                1 << 20,
            )
        });
        let answers = transport.on_calling_runtime();
        // A thread outside any runtime has nowhere to run a stream: the message is dropped and
        // counted, never a panic.
        answers.send(&answer_to(2));
        assert_eq!(dropped(&metrics, "2"), 1);
        assert!(answers.peers.read().unwrap().is_empty());
        // On another runtime (the driver's), the stream starts there and the message is queued.
        let driver = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        driver.block_on(async { answers.send(&answer_to(2)) });
        assert_eq!(dropped(&metrics, "2"), 1);
        assert!(answers.peers.read().unwrap().contains_key(&2));
        // Its streams are its own: the I/O transport has none.
        assert!(transport.peers.read().unwrap().is_empty());
    }
}

#[cfg(test)]
mod stream_kinds {
    use std::sync::atomic::AtomicBool;

    use tokio::net::TcpListener;
    use tokio_stream::wrappers::TcpListenerStream;

    use super::*;
    use crate::raft::MessageBody;
    use crate::server::driver::{Input, NodeStatus};
    use crate::server::peer_api::PeerApi;
    use crate::server::proto::peer::peer_server::PeerServer;

    /// The peer side: node 2's peer API, its driver queue, and its peer port's address.
    struct Receiver {
        addr: String,
        driver: mpsc::Receiver<Input>,
        _stop: tokio::sync::watch::Sender<bool>,
    }

    /// Node 2's peer port, served as a node serves it (`sniffing`: plain streams and gRPC on
    /// one port) or by the gRPC server alone, as a RaftLock from before plain streams does.
    async fn receiver(sniffing: bool) -> Receiver {
        let metrics = NodeMetrics::new();
        let (driver_tx, driver) = mpsc::channel(4096);
        let (_status_tx, status) = tokio::sync::watch::channel(NodeStatus::default());
        let api = Arc::new(PeerApi {
            driver: driver_tx,
            addresses: AddressBook::default(),
            cluster_token: String::new(),
            tls: None,
            refused: metrics.peer_connections_refused_total.clone(),
            status,
            admitted: Arc::new(AtomicBool::new(true)),
            incarnation: 1,
            request_duration: metrics.request_duration_seconds.clone(),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        if sniffing {
            let server = crate::server::node::serve_peers(
                listener.into_std().unwrap(),
                None,
                api,
                1 << 20,
                stopped,
            )
            .unwrap();
            tokio::spawn(server);
        } else {
            let server = tonic::transport::Server::builder()
                .add_service(PeerServer::from_arc(api))
                .serve_with_incoming(TcpListenerStream::new(listener));
            tokio::spawn(server);
        }
        Receiver {
            addr,
            driver,
            _stop: stop,
        }
    }

    /// Node 1's transport to node 2 (at `addr`), and its metrics.
    fn transport_to(addr: &str, plain: bool) -> (PeerTransport, NodeMetrics) {
        let metrics = NodeMetrics::new();
        let addresses = AddressBook::default();
        addresses.learn(2, addr, "");
        let transport = PeerTransport::new(
            LocalIdentity {
                id: 1,
                peer_addr: "127.0.0.1:1".into(),
                client_addr: String::new(),
                incarnation: 1,
                cluster_id: Default::default(),
            },
            PeerDialer::default(),
            addresses,
            metrics.clone(),
            1 << 20,
        )
        .with_plain_streams(plain);
        (transport, metrics)
    }

    /// Message `seq` of a run, with `pad` bytes of entry so that a run can fill the socket.
    fn numbered(seq: u64, pad: usize) -> Message {
        Message {
            from: 1,
            to: 2,
            term: seq,
            body: MessageBody::Append {
                prev_log_index: seq,
                prev_log_term: 0,
                entries: vec![crate::raft::Entry {
                    term: seq,
                    index: seq + 1,
                    payload: crate::raft::EntryPayload::Command(bytes::Bytes::from(vec![7u8; pad])),
                }],
                leader_commit: 0,
            },
        }
    }

    /// A transport on the sending thread's runtime writes straight to a plain stream's socket
    /// when nothing waits ahead, and leaves the rest to the stream's task when the socket is
    /// full: every message arrives once, in the order sent, or is counted as dropped.
    #[tokio::test]
    async fn messages_written_from_the_sending_thread_keep_their_order() {
        let mut node = receiver(true).await;
        let (io, metrics) = transport_to(&node.addr, true);
        let on_thread = io.on_calling_runtime();
        // The stream opens with the first message; until it is up, messages are queued.
        assert_eq!(on_thread.send(&numbered(1, 10)), Sent::Queued);
        let mut got = Vec::new();
        let mut written = 0;
        let mut seq = 1;
        for burst in 0..20 {
            // Small bursts go out at once; large ones fill the socket, and what does not fit
            // waits in the stream's pending bytes.
            let (pad, count) = if burst % 2 == 0 {
                (16, 16)
            } else {
                (64 * 1024, 96)
            };
            for _ in 0..count {
                seq += 1;
                if on_thread.send(&numbered(seq, pad)) == Sent::Written {
                    written += 1;
                }
            }
            while let Ok(Some(Input::Peer(msg))) =
                tokio::time::timeout(Duration::from_millis(200), node.driver.recv()).await
            {
                got.push(msg.term);
            }
        }
        let dropped = metrics
            .peer_messages_dropped_total
            .with_label_values(&["2"])
            .get();
        assert!(written > 0, "nothing was written from the sending thread");
        assert!(
            got.windows(2).all(|w| w[0] < w[1]),
            "messages arrived out of order: {got:?}"
        );
        assert_eq!(
            got.len() as u64 + dropped,
            seq,
            "lost without being counted"
        );
    }

    /// Node 1 sends node 2 a message; returns what node 2's driver got and the kind of stream
    /// node 1 opened.
    async fn send_one(to: &mut Receiver, plain: bool) -> (Message, Vec<&'static str>) {
        let (transport, metrics) = transport_to(&to.addr, plain);
        let sent = Message {
            from: 1,
            to: 2,
            term: 3,
            body: MessageBody::HeartbeatResponse { read_seq: 7 },
        };
        transport.send(&sent);
        let got = loop {
            match tokio::time::timeout(Duration::from_secs(10), to.driver.recv()).await {
                Ok(Some(Input::Peer(msg))) => break msg,
                Ok(Some(_)) => continue,
                other => panic!("node 2 got no Raft message: {}", other.is_ok()),
            }
        };
        let kinds = ["plain", "grpc"]
            .into_iter()
            .filter(|kind| {
                metrics
                    .peer_streams_opened_total
                    .with_label_values(&["2", kind])
                    .get()
                    > 0
            })
            .collect();
        (got, kinds)
    }

    #[tokio::test]
    async fn a_node_takes_plain_and_grpc_streams_on_its_peer_port() {
        let mut node = receiver(true).await;
        let (got, kinds) = send_one(&mut node, true).await;
        assert_eq!((got.from, got.term), (1, 3));
        assert_eq!(kinds, ["plain"]);
        let (got, kinds) = send_one(&mut node, false).await;
        assert_eq!((got.from, got.term), (1, 3));
        assert_eq!(kinds, ["grpc"]);
    }

    #[tokio::test]
    async fn a_peer_without_plain_streams_is_sent_to_over_grpc() {
        let mut old = receiver(false).await;
        let (got, kinds) = send_one(&mut old, true).await;
        assert_eq!((got.from, got.term), (1, 3));
        assert_eq!(kinds, ["grpc"]);
    }
}
