//! The client port's listener: every TCP connection a client opens — WebSocket, gRPC or plain
//! HTTP — passes through here before the HTTP server sees it.
//!
//! ```text
//!   accept ──► under the cap for its source address? ── no ──► close at once (reason="address_limit")
//!                 │ yes
//!                 ▼
//!              slot free? ── no ──► close at once (raftlock_client_connections_refused_total{reason="limit"})
//!                 │ yes
//!                 ▼
//!   GuardedStream: the connection must send a request the server answers within
//!   REQUEST_HEAD_DEADLINE, or it is closed (reason="no_request"); the slot is freed on close
//! ```
//!
//! It bounds what a client can hold without ever making a request: half-open connections and
//! connections that never finish their first request head (the HTTP server sets no such deadline
//! on a new connection by itself). With client TLS, the handshake runs in its own task under the
//! same deadline, so a slow handshake never holds up accepting others. The WebSocket limit (`max_connections`) still applies on top,
//! at the upgrade. This module decides nothing about locks or Raft.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

use super::sockets::{AddressSlot, PerAddress};

/// How long a new connection may take to send a request the server answers (a WebSocket
/// upgrade, an HTTP request, or an HTTP/2 preface).
pub const REQUEST_HEAD_DEADLINE: Duration = Duration::from_secs(10);

/// TCP connections allowed beyond the WebSocket limit, for gRPC channels, HTTP requests,
/// health probes and metric scrapes.
pub const EXTRA_TCP_CONNECTIONS: usize = 256;

/// A TCP listener with a cap on open connections and a deadline for a connection's first
/// request.
pub struct ClientListener {
    inner: TcpListener,
    tls: Option<Arc<super::tls::ClientTls>>,
    /// TLS handshakes in progress; each yields a ready connection or nothing.
    handshakes: tokio::task::JoinSet<Option<(GuardedStream, std::net::SocketAddr)>>,
    /// One permit per open connection; a permit is returned when its connection closes.
    slots: Arc<Semaphore>,
    /// Open connections per source address.
    per_address: PerAddress,
    head_deadline: Duration,
    refused: IntCounterVec,
    connections: IntGaugeVec,
}

impl ClientListener {
    /// `metrics` gives the counter of refused connections and the gauge of open ones by
    /// protocol.
    pub fn new(
        inner: TcpListener,
        max_connections: usize,
        max_per_address: usize,
        head_deadline: Duration,
        metrics: &crate::telemetry::NodeMetrics,
        tls: Option<Arc<super::tls::ClientTls>>,
    ) -> ClientListener {
        let refused = metrics.client_connections_refused_total.clone();
        for reason in [
            "limit",
            "address_limit",
            "no_request",
            "tls_handshake",
            "unauthenticated",
        ] {
            refused.with_label_values(&[reason]);
        }
        ClientListener {
            inner,
            tls,
            handshakes: tokio::task::JoinSet::new(),
            slots: Arc::new(Semaphore::new(max_connections)),
            per_address: PerAddress::new(max_per_address),
            head_deadline,
            refused,
            connections: metrics.client_connections.clone(),
        }
    }
}

impl axum::serve::Listener for ClientListener {
    type Io = GuardedStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (GuardedStream, std::net::SocketAddr) {
        loop {
            let accepted = tokio::select! {
                accepted = self.inner.accept() => accepted,
                Some(done) = self.handshakes.join_next(), if !self.handshakes.is_empty() => {
                    if let Ok(Some(ready)) = done {
                        return ready;
                    }
                    continue;
                }
            };
            let (stream, addr) = match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of file descriptors or a connection reset before accept: wait a
                    // moment instead of spinning.
                    tracing::warn!(cause = %err, "client accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(address_slot) = self.per_address.try_take(addr.ip()) else {
                self.refused.with_label_values(&["address_limit"]).inc();
                drop(stream);
                continue;
            };
            let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                self.refused.with_label_values(&["limit"]).inc();
                drop(stream);
                continue;
            };
            let slot = (slot, address_slot);
            let _ = stream.set_nodelay(true);
            let deadline = Box::pin(tokio::time::sleep(self.head_deadline));
            let Some(tls) = &self.tls else {
                return (
                    GuardedStream {
                        stream: ClientIo::Plain(stream),
                        deadline: Some(deadline),
                        refused: self.refused.clone(),
                        protocol: Protocol::Unknown(self.connections.clone()),
                        _slot: slot,
                    },
                    addr,
                );
            };
            let acceptor = tls.acceptor();
            let refused = self.refused.clone();
            let connections = self.connections.clone();
            self.handshakes.spawn(async move {
                let handshake = tokio::select! {
                    done = acceptor.accept(stream) => done,
                    _ = deadline => {
                        refused.with_label_values(&["no_request"]).inc();
                        return None;
                    }
                };
                match handshake {
                    Ok(tls_stream) => Some((
                        GuardedStream {
                            stream: ClientIo::Tls(Box::new(tls_stream)),
                            // A fresh deadline for the first request after the handshake.
                            deadline: Some(Box::pin(tokio::time::sleep(REQUEST_HEAD_DEADLINE))),
                            refused,
                            protocol: Protocol::Unknown(connections),
                            _slot: slot,
                        },
                        addr,
                    )),
                    Err(err) => {
                        tracing::debug!(client = %addr, cause = %err, "client TLS handshake failed");
                        refused.with_label_values(&["tls_handshake"]).inc();
                        None
                    }
                }
            });
        }
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }
}

/// A client connection holding one slot of the listener until it closes.
pub struct GuardedStream {
    stream: ClientIo,
    /// Armed at accept; cleared by the server's first write (its answer to a complete request
    /// head). While armed and passed, reads fail and the server closes the connection.
    deadline: Option<Pin<Box<Sleep>>>,
    refused: IntCounterVec,
    /// Counted in `raftlock_client_connections{protocol}` once its first bytes tell HTTP/2
    /// (gRPC) from HTTP/1.1.
    protocol: Protocol,
    _slot: (OwnedSemaphorePermit, AddressSlot),
}

/// Which `raftlock_client_connections{protocol}` gauge a connection counts in.
enum Protocol {
    /// Nothing read yet.
    Unknown(IntGaugeVec),
    /// Counted in this gauge until the connection is dropped.
    Counted(IntGauge),
}

/// What every HTTP/2 connection (so every gRPC channel) sends first (RFC 9113 §3.4).
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

impl GuardedStream {
    fn answered(&mut self, written: &Poll<io::Result<usize>>) {
        if matches!(written, Poll::Ready(Ok(n)) if *n > 0) {
            self.deadline = None;
        }
    }

    /// Counts the connection by the first bytes it sent: the HTTP/2 preface (gRPC), or else
    /// HTTP/1.1 (plain HTTP, and WebSocket until its upgrade moves it to `websocket`).
    fn classify(&mut self, first: &[u8]) {
        if first.is_empty() {
            return;
        }
        if let Protocol::Unknown(gauges) = &self.protocol {
            let n = first.len().min(HTTP2_PREFACE.len());
            let label = if first[..n] == HTTP2_PREFACE[..n] {
                "grpc"
            } else {
                "http"
            };
            let gauge = gauges.with_label_values(&[label]);
            gauge.inc();
            self.protocol = Protocol::Counted(gauge);
        }
    }
}

impl Drop for GuardedStream {
    fn drop(&mut self) {
        if let Protocol::Counted(gauge) = &self.protocol {
            gauge.dec();
        }
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(deadline) = this.deadline.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() {
                this.deadline = None;
                this.refused.with_label_values(&["no_request"]).inc();
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no request within the deadline",
                )));
            }
        }
        if matches!(this.protocol, Protocol::Counted(_)) {
            return Pin::new(&mut this.stream).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) {
            this.classify(&buf.filled()[before..]);
        }
        read
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.answered(&written);
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.answered(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// A client connection's transport: plain TCP, or TLS over it.
enum ClientIo {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for ClientIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ClientIo::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ClientIo::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientIo::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ClientIo::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ClientIo::Plain(s) => s.is_write_vectored(),
            ClientIo::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(s) => Pin::new(s).poll_flush(cx),
            ClientIo::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ClientIo::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}
