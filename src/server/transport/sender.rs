//! A peer's sender task: connects, streams the peer's queue, and reconnects with backoff; the
//! `Peer.Raft` gRPC stream, for peers that take no plain streams (or `--peer-stream grpc`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tracing::{debug, info, warn};

use super::{
    PeerDialer, PeerSender, BACKOFF_MAX, BACKOFF_MIN, CLIENT_ADDR_HEADER, CLUSTER_ID_HEADER,
    INCARNATION_HEADER, NODE_ID_HEADER, PEER_ADDR_HEADER, VERSION_HEADER,
};
use crate::server::peer_stream;
use crate::server::proto::peer::peer_client::PeerClient;
use crate::server::proto::peer::RaftMessage;

/// The peer's queue, shared by the successive streams of one peer sender: each stream takes
/// messages straight from it, so a message goes from the driver to the connection's writer
/// without another task in between.
pub(super) type SharedQueue = Arc<tokio::sync::Mutex<mpsc::Receiver<RaftMessage>>>;

impl PeerSender {
    /// Connects, streams, and reconnects with exponential backoff until the queue is dropped.
    pub(super) async fn run(self, queue: mpsc::Receiver<RaftMessage>) {
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
            crate::server::probe::peer_stream_took();
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

pub(super) enum StreamEnd {
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
