//! Plain Raft streams on the peer port: the Raft messages of `Peer.Raft`, without HTTP/2.
//!
//! ```text
//!   dialling node                                  peer port (after TLS, under peer TLS)
//!   "RAFTLOCK-RAFT/1\n" ─────────────────────────► first bytes sniffed: anything else goes to
//!                                                  the gRPC server unchanged
//!   [len][RaftStreamHello] ──────────────────────► token, node id and certificate checked as
//!                                                  for Peer.Raft's metadata
//!   ◄────────────────────────────── [len][RaftStreamAccept]
//!   [len][RaftMessage][len][RaftMessage]… ───────► the driver's input queue
//! ```
//!
//! Each frame is a 4-byte big-endian length and that many bytes of protobuf (the messages of
//! `proto/peer.proto`). Messages flow one way; the dialler learns that the stream ended when
//! its read side ends. A node that does not take plain streams (a RaftLock from before them)
//! answers the opening bytes as a bad HTTP/2 preface, and the dialler falls back to `Peer.Raft`
//! (see `transport.rs`). The accepting side's checks and hand-off (`serve`) are in
//! `peer_api.rs`, beside the `Peer` service whose checks they share.
//!
//! Why: on the commit path every request crosses the peer port twice (the leader's append, a
//! follower's answer). Over gRPC each crossing passes through hyper's body pipe and connection
//! tasks and HTTP/2 framing on both sides; here the sender task writes the frames itself and
//! the receiver decodes them where it reads them (docs/bench/latency.md).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::proto::peer as ppb;
use super::tls::PeerCert;

/// The first bytes of a plain Raft stream.
pub const MAGIC: &[u8; 16] = b"RAFTLOCK-RAFT/1\n";
/// The largest hello or accept frame.
pub const HANDSHAKE_FRAME_MAX: usize = 16 * 1024;
/// How long a new peer connection may take to show what it is and say its hello, and a
/// dialler waits for the answer.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// Bytes of queued messages gathered into one write, at most.
pub const WRITE_BATCH_BYTES: usize = 256 * 1024;
/// How long one write may wait for the peer to take the bytes before the stream is given up.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(10);

/// Appends `msg` as one frame.
pub fn put_frame(buf: &mut BytesMut, msg: &impl prost::Message) {
    put_frame_within(buf, msg, u32::MAX as usize);
}

/// Appends `msg` as one frame if it is at most `max` bytes; false (nothing appended) if not.
pub fn put_frame_within(buf: &mut BytesMut, msg: &impl prost::Message, max: usize) -> bool {
    let len = msg.encoded_len();
    if len > max {
        return false;
    }
    buf.reserve(4 + len);
    buf.put_u32(len as u32);
    // A BytesMut grows as needed, so encoding into it cannot run out of room.
    let _ = msg.encode(buf);
    true
}

fn invalid(reason: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, reason)
}

/// Reads frames from `io`, refusing any longer than `max` bytes before reading it.
pub struct FrameReader<R> {
    io: R,
    buf: BytesMut,
    max: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(io: R, max: usize) -> Self {
        FrameReader {
            io,
            buf: BytesMut::with_capacity(8 * 1024),
            max,
        }
    }

    pub fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    /// The connection, to write to (bytes already read stay buffered here).
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.io
    }

    /// The next frame's bytes; None when the stream ended cleanly between frames.
    pub async fn next_frame(&mut self) -> io::Result<Option<BytesMut>> {
        loop {
            if self.buf.len() >= 4 {
                let len = (&self.buf[..4]).get_u32() as usize;
                if len > self.max {
                    return Err(invalid(format!(
                        "a frame of {len} bytes, over the limit of {}",
                        self.max
                    )));
                }
                if self.buf.len() >= 4 + len {
                    self.buf.advance(4);
                    return Ok(Some(self.buf.split_to(len)));
                }
                self.buf.reserve(4 + len - self.buf.len());
            } else {
                self.buf.reserve(8 * 1024);
            }
            if self.io.read_buf(&mut self.buf).await? == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
        }
    }

    /// The next frame decoded as `M`.
    pub async fn next<M: prost::Message + Default>(&mut self) -> io::Result<Option<M>> {
        match self.next_frame().await? {
            None => Ok(None),
            Some(frame) => M::decode(frame).map(Some).map_err(invalid),
        }
    }
}

/// What a dialler's handshake came to.
#[derive(Debug)]
pub enum DialError {
    /// The node answered, but not as one that takes plain streams (it closed the connection,
    /// or sent something that is not an accept frame): use `Peer.Raft` there.
    NotSpoken(io::Error),
    /// The node refused the stream, saying why (a wrong cluster token, a certificate that
    /// does not name this node).
    Refused(String),
}

impl std::fmt::Display for DialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DialError::NotSpoken(err) => write!(f, "no plain raft stream there: {err}"),
            DialError::Refused(why) => write!(f, "the peer refused the raft stream: {why}"),
        }
    }
}

impl std::error::Error for DialError {}

/// The dialler's side of the handshake on a connected `io`.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    hello: &ppb::RaftStreamHello,
) -> Result<(), DialError> {
    let exchange = async {
        let mut buf = BytesMut::with_capacity(MAGIC.len() + 256);
        buf.put_slice(MAGIC);
        put_frame(&mut buf, hello);
        io.write_all(&buf).await?;
        io.flush().await?;
        let mut reader = FrameReader::new(&mut *io, HANDSHAKE_FRAME_MAX);
        match reader.next::<ppb::RaftStreamAccept>().await? {
            Some(accept) => Ok(accept),
            None => Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
        }
    };
    match tokio::time::timeout(HANDSHAKE_DEADLINE, exchange).await {
        Ok(Ok(accept)) if accept.refused.is_empty() => Ok(()),
        Ok(Ok(accept)) => Err(DialError::Refused(accept.refused)),
        Ok(Err(err)) => Err(DialError::NotSpoken(err)),
        Err(_) => Err(DialError::NotSpoken(io::ErrorKind::TimedOut.into())),
    }
}

/// A connection whose first bytes were read to see what it is, handed on with those bytes in
/// front of the rest.
pub struct Prefixed<S> {
    prefix: Vec<u8>,
    read: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// What a new peer connection turned out to be.
pub enum Sniffed<S> {
    /// It opened with [`MAGIC`]: a plain Raft stream, the magic consumed.
    Plain(S),
    /// Anything else (HTTP/2 for the gRPC server), unread.
    Other(Prefixed<S>),
}

/// Reads as much of the connection's first bytes as it takes to tell a plain Raft stream.
pub async fn sniff<S: AsyncRead + Unpin>(mut io: S) -> io::Result<Sniffed<S>> {
    let mut got = Vec::with_capacity(MAGIC.len());
    let mut chunk = [0u8; 16];
    while got.len() < MAGIC.len() {
        let want = MAGIC.len() - got.len();
        let n = io.read(&mut chunk[..want]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got.extend_from_slice(&chunk[..n]);
        if !MAGIC.starts_with(&got) {
            return Ok(Sniffed::Other(Prefixed {
                prefix: got,
                read: 0,
                inner: io,
            }));
        }
    }
    Ok(Sniffed::Plain(io))
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.read < self.prefix.len() {
            let n = (self.prefix.len() - self.read).min(buf.remaining());
            let from = self.read;
            buf.put_slice(&self.prefix[from..from + n]);
            self.read += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Prefixed<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// A peer connection's certificate, where it has one.
pub trait ConnectionCert {
    fn presented_cert(&self) -> Option<PeerCert>;
    /// The address the connection comes from.
    fn source_ip(&self) -> Option<std::net::IpAddr>;
}

impl ConnectionCert for TcpStream {
    fn presented_cert(&self) -> Option<PeerCert> {
        None
    }

    fn source_ip(&self) -> Option<std::net::IpAddr> {
        self.peer_addr().ok().map(|a| a.ip())
    }
}

impl ConnectionCert for super::tls::PeerTlsStream {
    fn presented_cert(&self) -> Option<PeerCert> {
        Some(tonic::transport::server::Connected::connect_info(self))
    }

    fn source_ip(&self) -> Option<std::net::IpAddr> {
        self.tcp().peer_addr().ok().map(|a| a.ip())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_an_oversized_one_is_refused_before_it_is_read() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut buf = BytesMut::new();
        let hello = ppb::RaftStreamHello {
            node_id: 7,
            peer_addr: "127.0.0.1:8087".into(),
            ..Default::default()
        };
        put_frame(&mut buf, &hello);
        put_frame(
            &mut buf,
            &ppb::RaftStreamAccept {
                refused: "x".repeat(100),
            },
        );
        a.write_all(&buf).await.unwrap();
        let mut reader = FrameReader::new(b, 64);
        assert_eq!(
            reader.next::<ppb::RaftStreamHello>().await.unwrap(),
            Some(hello)
        );
        let err = reader
            .next::<ppb::RaftStreamAccept>()
            .await
            .expect_err("a 102-byte frame is over a limit of 64");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("over the limit of 64"), "{err}");
    }

    #[tokio::test]
    async fn a_stream_cut_inside_a_frame_is_an_error_and_between_frames_an_end() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut buf = BytesMut::new();
        put_frame(&mut buf, &ppb::RaftStreamAccept::default());
        a.write_all(&buf).await.unwrap();
        a.write_all(&[0, 0, 0, 9, 1]).await.unwrap();
        drop(a);
        let mut reader = FrameReader::new(b, 64);
        assert!(reader
            .next::<ppb::RaftStreamAccept>()
            .await
            .unwrap()
            .is_some());
        let err = reader.next::<ppb::RaftStreamAccept>().await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);

        let (a, b) = tokio::io::duplex(64);
        drop(a);
        let mut reader = FrameReader::new(b, 64);
        assert!(reader
            .next::<ppb::RaftStreamAccept>()
            .await
            .unwrap()
            .is_none());
    }

    #[tokio::test]
    async fn sniffing_tells_a_plain_stream_and_hands_anything_else_on_unread() {
        let (mut a, b) = tokio::io::duplex(1024);
        a.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        drop(a);
        let Sniffed::Other(mut other) = sniff(b).await.unwrap() else {
            panic!("an HTTP/2 preface is not a plain raft stream");
        };
        let mut all = Vec::new();
        other.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");

        // The magic in pieces, then a frame: the frame is left to read.
        let (mut a, b) = tokio::io::duplex(1024);
        let task = tokio::spawn(async move {
            a.write_all(&MAGIC[..5]).await.unwrap();
            tokio::task::yield_now().await;
            a.write_all(&MAGIC[5..]).await.unwrap();
            a.write_all(b"rest").await.unwrap();
        });
        let Sniffed::Plain(mut plain) = sniff(b).await.unwrap() else {
            panic!("the magic is a plain raft stream");
        };
        task.await.unwrap();
        let mut rest = [0u8; 4];
        plain.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"rest");

        // Closed before saying anything: an error, not a stream.
        let (a, b) = tokio::io::duplex(64);
        drop(a);
        assert!(sniff(b).await.is_err());
    }
}
