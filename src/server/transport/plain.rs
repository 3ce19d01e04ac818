//! Plain Raft streams out (`peer_stream`'s frames): over TCP the driver's thread may write to the
//! socket itself through the stream's [`Line`]; over TLS the sender task writes every message.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::{debug, warn};

use super::sender::{SharedQueue, StreamEnd};
use super::{PeerSender, Sent};
use crate::server::peer_stream;
use crate::server::proto::peer::{RaftMessage, RaftStreamHello};

/// A plain TCP stream's socket, shared by its sender task and [`PeerTransport::send`]. Every
/// frame waiting to be written is in `pending`, in order: the task moves queued messages there
/// before writing, and `send` writes straight to the socket only when nothing is pending or
/// queued, so no message overtakes another.
#[derive(Default)]
pub(super) struct Line {
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
    pub(super) fn send(&self, msg: &RaftMessage, max_message_bytes: usize) -> Option<Sent> {
        let mut state = self.state.lock().ok()?;
        let socket = state.socket.clone()?;
        crate::server::probe::peer_stream_took();
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

impl PeerSender {
    /// One plain Raft stream (`peer_stream`): connects, says hello, then writes every message
    /// the queue gives, those already queued together in one write, until the queue closes or
    /// the connection ends. Over TLS [`PeerSender::run_plain`] writes them; over TCP
    /// [`PeerSender::run_plain_tcp`].
    pub(super) async fn stream_plain(
        &self,
        addr: &str,
        queue: &SharedQueue,
    ) -> Result<StreamEnd, Box<dyn std::error::Error + Send + Sync>> {
        let tcp = tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr))
            .await
            .map_err(|_| format!("connecting to {addr} timed out"))??;
        let _ = tcp.set_nodelay(true);
        crate::server::sockets::watch_liveness(&tcp);
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

    pub(super) fn opened(&self, kind: &str) {
        self.metrics
            .peer_streams_opened_total
            .with_label_values(&[&self.to.to_string(), kind])
            .inc();
    }

    /// Adds one message's frame, or drops it (counted) when it is over the message limit, as
    /// the gRPC stream would refuse to send it.
    fn put(&self, buf: &mut BytesMut, msg: &RaftMessage) {
        crate::server::probe::peer_stream_took();
        if !peer_stream::put_frame_within(buf, msg, self.max_message_bytes) {
            self.metrics
                .peer_messages_dropped_total
                .with_label_values(&[&self.to.to_string()])
                .inc();
        }
    }
}
