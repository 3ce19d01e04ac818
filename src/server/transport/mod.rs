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
//!
//! Here: the [`PeerTransport`] and its per-peer queues. Its children:
//! - `addresses`: the [`AddressBook`] of members' peer and client addresses;
//! - `dialer`: [`PeerDialer`] (TLS, cluster token) and this node's [`LocalIdentity`];
//! - `sender`: a peer's sender task, reconnects and backoff, the `Peer.Raft` gRPC stream;
//! - `plain`: plain Raft streams out, and writing from the driver's thread ([`Line`]).
//!
//! The accepting side (`PeerApi`, and plain streams in) is `peer_api.rs`.

mod addresses;
mod dialer;
mod plain;
mod sender;

#[cfg(test)]
mod stream_kinds;
#[cfg(test)]
mod tests;

pub use addresses::{AddressBook, MemberAddrs};
pub use dialer::{LocalIdentity, PeerDialer};
use plain::Line;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::mpsc;

use super::convert::message_to_pb;
use super::proto::peer::RaftMessage;
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
