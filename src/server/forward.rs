//! Follower forwarding: a client may talk to any node. A follower that knows the leader sends the
//! client's request to it over the peer port (`Peer.ForwardClient`, one hop) and hands back the
//! leader's answer unchanged, so clients that cannot follow redirects — behind a Kubernetes
//! Service that spreads connections over all pods, say — work through any node.
//!
//! ```text
//!   client ──ws/grpc──► follower ──Peer.ForwardClient──► leader ──► Raft
//!          ◄── answer ──          ◄──── answer ──────────
//! ```
//! Exactly-once is unchanged: the request keeps its client and request ids, so a retry after a
//! leader change (through any node) gets the same outcome as a direct one. The leader never
//! forwards a forwarded request again; if it is no longer the leader it answers `NOT_LEADER`,
//! which the client sees as from a direct request. Forwards in flight are bounded per node.
//! When the client goes away (its connection closes, its gRPC call is cancelled), the forwarded
//! call is dropped and the leader treats the request's waiters as disconnected.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Semaphore};
use tonic::transport::Channel;

use super::api::{ClientOp, ClientReply, ErrorCode};
use super::proto::peer::peer_client::PeerClient;
use super::proto::peer::{FetchPeerListRequest, ForwardClientRequest};
use super::transport::PeerDialer;

/// Sends client requests to the leader's peer port.
pub struct Forwarder {
    node_id: u64,
    dialer: PeerDialer,
    permits: Arc<Semaphore>,
    max_message_bytes: usize,
    channels: Mutex<HashMap<String, PeerClient<Channel>>>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("node_id", &self.node_id)
            .finish()
    }
}

impl Forwarder {
    pub fn new(
        node_id: u64,
        dialer: PeerDialer,
        max_in_flight: usize,
        max_message_bytes: usize,
    ) -> Self {
        Forwarder {
            node_id,
            dialer,
            permits: Arc::new(Semaphore::new(max_in_flight.max(1))),
            max_message_bytes,
            channels: Mutex::new(HashMap::new()),
        }
    }

    fn client(&self, peer_addr: &str) -> Result<PeerClient<Channel>, String> {
        let mut channels = self.channels.lock().map_err(|_| "poisoned".to_string())?;
        if let Some(c) = channels.get(peer_addr) {
            return Ok(c.clone());
        }
        let endpoint = PeerDialer::endpoint(peer_addr)
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true);
        let client = PeerClient::new(self.dialer.connect_lazy(endpoint, None))
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);
        // A handful of leaders over a node's life: forget them all if the map ever grows.
        if channels.len() > 64 {
            channels.clear();
        }
        channels.insert(peer_addr.to_string(), client.clone());
        Ok(client)
    }

    /// The commit index of the node at `peer_addr` (the leader, as this node believes; a node
    /// that no longer leads answers with a commit index no higher than the leader's).
    pub async fn leader_commit(&self, peer_addr: &str) -> Result<u64, String> {
        let mut client = self.client(peer_addr)?;
        let reply = client
            .fetch_peer_list(self.dialer.request(FetchPeerListRequest { term: 0 }))
            .await
            .map_err(|status| status.message().to_string())?
            .into_inner();
        if !reply.success {
            return Err(format!("the node at {peer_addr} knows no leader"));
        }
        Ok(reply.commit_index)
    }

    /// Forwards `op` to the leader at `peer_addr` and returns its answer. Ends early (dropping the
    /// call) when `closed` turns true: the client went away.
    pub async fn forward(
        &self,
        peer_addr: &str,
        op: &ClientOp,
        closed: Option<watch::Receiver<bool>>,
        traceparent: Option<String>,
    ) -> ClientReply {
        let Ok(_permit) = self.permits.clone().try_acquire_owned() else {
            return ClientReply::error(ErrorCode::Busy, "too many requests being forwarded");
        };
        let mut client = match self.client(peer_addr) {
            Ok(c) => c,
            Err(e) => return ClientReply::error(ErrorCode::Unavailable, e),
        };
        let op_json = match serde_json::to_vec(op) {
            Ok(bytes) => bytes,
            Err(e) => return ClientReply::error(ErrorCode::InvalidRequest, e.to_string()),
        };
        let mut request = self.dialer.request(ForwardClientRequest {
            op_json,
            from_node: self.node_id,
        });
        if let Some(v) = traceparent.and_then(|t| t.parse().ok()) {
            request.metadata_mut().insert("traceparent", v);
        }
        let call = client.forward_client(request);
        let answer = match closed {
            Some(mut closed) => tokio::select! {
                answer = call => answer,
                _ = closed.wait_for(|c| *c) => {
                    return ClientReply::error(ErrorCode::Unavailable, "the client went away");
                }
            },
            None => call.await,
        };
        match answer {
            Ok(reply) => {
                serde_json::from_slice(&reply.into_inner().reply_json).unwrap_or_else(|e| {
                    ClientReply::error(
                        ErrorCode::Unavailable,
                        format!("the leader's answer does not decode: {e}"),
                    )
                })
            }
            Err(status) => ClientReply::error(
                ErrorCode::Unavailable,
                format!(
                    "could not reach the leader at {peer_addr}: {}; retry with the same request id",
                    status.message()
                ),
            ),
        }
    }
}
