//! One multiplexed WebSocket connection to a node, and the session that finds the leader, follows
//! redirects and retries with backoff.
//!
//! Many requests share one connection; replies are matched by `requestId`. A retried request
//! keeps its `requestId`, so the cluster's exactly-once table answers a retry of an operation that
//! was already applied with the original outcome instead of applying it twice.
//!
//! Where things live:
//! - `protocol`: requests and replies as they go on the wire.
//! - `websocket`: opening a WebSocket to a node (auth token, TLS).
//! - `session`: the session's settings, leader discovery, redirects, retries with backoff.
//! - here: one multiplexed connection ([`Conn`]), replies matched to callers by `requestId`,
//!   requests queued for the socket written together, and the keepalive.

mod protocol;
mod session;
mod websocket;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use futures::stream::SplitSink;
use futures::{SinkExt, StreamExt};
use tokio::sync::{oneshot, Mutex};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};

use super::error::ClientError;
use protocol::{parse_reply, Reply};
use websocket::WsSocket;

pub(crate) use protocol::{ReplyKind, Request, TokenRef};
pub use session::{is_traceparent, TraceContext};
pub(crate) use session::{Session, SessionConfig};
pub use websocket::TlsConfig;
pub(crate) use websocket::{open_ws, BatchLimit, OpenError};

struct Slot {
    kind: ReplyKind,
    tx: oneshot::Sender<Reply>,
}

type Pending = Arc<StdMutex<HashMap<String, Vec<Slot>>>>;

/// Why a call on one connection did not produce a reply.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The connection closed before the reply arrived (the request may or may not have been
    /// applied; resend it with the same request id).
    Lost(String),
    /// No reply within the call timeout.
    Timeout,
    /// Too many requests in flight on this connection.
    Busy,
}

/// The sending half of a connection, shared by the callers (each writes its own request) and
/// the keepalive task (pings).
type Sink = Arc<Mutex<SplitSink<WsSocket, Message>>>;

/// How long a request may take to reach the socket when its call has no timeout of its own
/// (a wait without a timeout): a peer that stops reading cannot hold the caller forever.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) struct Conn {
    pub addr: String,
    sink: Sink,
    /// Requests waiting for the sink while another caller writes: whoever holds the sink next
    /// writes them all and flushes once (see [`Conn::write_request`]).
    outbox: StdMutex<Vec<Utf8Bytes>>,
    pending: Pending,
    closed: Arc<AtomicBool>,
    max_inflight: usize,
    /// How many requests the node takes in one frame (a JSON array), in how many bytes.
    batch: BatchLimit,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Why a connection could not be had: worth another try (another node, later), or refused for
/// a reason another try will not change.
#[derive(Debug)]
pub(crate) enum ConnFailure {
    Retry(String),
    Refused(ClientError),
}

/// Read buffer of one connection (the server uses the same size): a lock request or answer is
/// a few hundred bytes, and a larger message is still read whole.
const READ_BUFFER_BYTES: usize = 1024;

/// Bytes gathered before a write reaches the socket; every send flushes anyway.
const WRITE_BUFFER_BYTES: usize = 4096;

impl Conn {
    pub async fn connect(
        addr: &str,
        timeout: Duration,
        max_inflight: usize,
        max_message_bytes: usize,
        keepalive: Option<Keepalive>,
        auth_token: Option<&str>,
        tls: Option<&TlsConfig>,
    ) -> Result<Conn, ConnFailure> {
        let mut config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default();
        config.max_message_size = Some(max_message_bytes);
        config.max_frame_size = Some(max_message_bytes);
        // The library zero-fills its whole read buffer before every socket read (128 KiB by
        // default): that was most of the SDK's CPU per lock cycle (scripts/cpu-budget.py, the
        // client's share). A small buffer still reads a large message whole; it grows as needed.
        config.read_buffer_size = READ_BUFFER_BYTES;
        config.write_buffer_size = WRITE_BUFFER_BYTES;
        let connect = open_ws(addr, auth_token, tls, Some(config));
        let (socket, batch) = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(s)) => s,
            Ok(Err(OpenError::Request(e))) => return Err(ConnFailure::Retry(e)),
            Ok(Err(OpenError::Refused(e))) => return Err(ConnFailure::Refused(e)),
            Ok(Err(OpenError::Connect(e))) => {
                return Err(ConnFailure::Retry(format!("cannot connect to {addr}: {e}")))
            }
            Err(_) => {
                return Err(ConnFailure::Retry(format!(
                    "connecting to {addr} timed out after {timeout:?}"
                )))
            }
        };
        let (sink, mut stream) = socket.split();
        // Each caller writes its request to the socket itself, behind this lock: a task between
        // the callers and the socket cost every request a hand-off to it (its wake-up was the
        // largest item of the SDK's CPU per lock cycle).
        let sink: Sink = Arc::new(Mutex::new(sink));
        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        // When anything last arrived on the connection (pongs included).
        let opened = Instant::now();
        let last_heard = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::with_capacity(2);
        if let Some(k) = keepalive {
            let (ping_sink, ping_closed) = (sink.clone(), closed.clone());
            let (ping_heard, ping_pending) = (last_heard.clone(), pending.clone());
            tasks.push(tokio::spawn(async move {
                let mut ping =
                    tokio::time::interval_at((Instant::now() + k.interval).into(), k.interval);
                ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ping.tick().await;
                    if ping_closed.load(Ordering::SeqCst) {
                        break;
                    }
                    let heard = opened + Duration::from_millis(ping_heard.load(Ordering::SeqCst));
                    if heard.elapsed() > k.timeout {
                        // Silent for too long: give up on this connection, wake every caller
                        // ("connection lost": they retry elsewhere, same request id).
                        break;
                    }
                    let sent = tokio::time::timeout(k.timeout, async {
                        ping_sink
                            .lock()
                            .await
                            .send(Message::Ping(Vec::new().into()))
                            .await
                    })
                    .await;
                    if !matches!(sent, Ok(Ok(()))) {
                        break;
                    }
                }
                ping_closed.store(true, Ordering::SeqCst);
                ping_pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clear();
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    ping_sink.lock().await.close().await
                })
                .await;
            }));
        }
        let reader_pending = pending.clone();
        let reader_closed = closed.clone();
        let reader = tokio::spawn(async move {
            while let Some(Ok(msg)) = stream.next().await {
                last_heard.store(opened.elapsed().as_millis() as u64, Ordering::SeqCst);
                let text = match msg {
                    Message::Text(t) => t,
                    Message::Binary(b) => String::from_utf8_lossy(&b).into_owned().into(),
                    Message::Close(_) => break,
                    _ => continue,
                };
                let Some((request_id, reply)) = parse_reply(text) else {
                    continue;
                };
                let request_id = request_id.as_str();
                let kind = if reply.body.cancelled.is_some() || reply.body.code() == "NOT_WAITING" {
                    ReplyKind::Cancel
                } else {
                    ReplyKind::Normal
                };
                let slot = {
                    let mut map = reader_pending.lock().unwrap_or_else(|p| p.into_inner());
                    let slot = map.get_mut(request_id).and_then(|slots| {
                        let at = slots
                            .iter()
                            .position(|s| s.kind == kind)
                            .or(if slots.is_empty() { None } else { Some(0) })?;
                        Some(slots.remove(at))
                    });
                    if map.get(request_id).is_some_and(Vec::is_empty) {
                        map.remove(request_id);
                    }
                    slot
                };
                if let Some(slot) = slot {
                    let _ = slot.tx.send(reply);
                }
            }
            reader_closed.store(true, Ordering::SeqCst);
            // Dropping the senders wakes every waiting caller with "connection lost".
            reader_pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        });
        tasks.push(reader);
        Ok(Conn {
            addr: addr.to_string(),
            sink,
            outbox: StdMutex::new(Vec::new()),
            pending,
            closed,
            max_inflight,
            batch,
            tasks,
        })
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Sends one request and waits for the reply carrying its `requestId`.
    pub async fn call(
        &self,
        request_id: &str,
        kind: ReplyKind,
        text: &Utf8Bytes,
        timeout: Option<Duration>,
    ) -> Result<Reply, CallError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let inflight: usize = map.values().map(Vec::len).sum();
            if inflight >= self.max_inflight {
                return Err(CallError::Busy);
            }
            map.entry(request_id.to_string())
                .or_default()
                .push(Slot { kind, tx });
        }
        // A closed connection, or a write that fails, loses the request; a write the socket does
        // not take within the timeout (a peer that stopped reading) gives the connection up, a
        // frame perhaps half written, and the caller retries elsewhere with the same request id.
        let sent = if self.is_closed() {
            Ok(Err(()))
        } else {
            let send = self.write_request(text);
            tokio::time::timeout(timeout.unwrap_or(SEND_TIMEOUT), send).await
        };
        if !matches!(sent, Ok(Ok(()))) {
            self.closed.store(true, Ordering::SeqCst);
            // Other callers' requests may have been in this write, or still be waiting for the
            // sink: the connection is given up, so every caller (this one's entry included)
            // hears "connection lost" now and retries elsewhere with its request id.
            self.outbox
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
            return Err(match sent {
                Err(_) => CallError::Timeout,
                _ => CallError::Lost(format!("connection to {} closed", self.addr)),
            });
        }
        let result = match timeout {
            Some(t) => match tokio::time::timeout(t, rx).await {
                Ok(r) => r,
                Err(_) => {
                    self.forget(request_id);
                    return Err(CallError::Timeout);
                }
            },
            None => rx.await,
        };
        result.map_err(|_| CallError::Lost(format!("connection to {} lost", self.addr)))
    }

    /// Writes one request to the socket, with any others that queued for the sink meanwhile.
    /// A lone request goes out at once. Otherwise it joins the outbox, and the caller waits for
    /// the sink; whoever gets it first writes every queued request and flushes once, so many
    /// callers on one connection share a system call (a later caller that finds the outbox
    /// empty has had its request written already). With other requests of this connection in
    /// flight, the caller first lets the runtime's other ready tasks run: answers arrive in
    /// bursts (one commit answers many requests), and the callers they wake then send their
    /// next requests together. Ok means written, or taken by another caller's write; a write
    /// that fails closes the connection and wakes everyone ([`Conn::call`]).
    async fn write_request(&self, text: &Utf8Bytes) -> Result<(), ()> {
        let lone = self.pending.lock().unwrap_or_else(|p| p.into_inner()).len() <= 1;
        let free = if lone {
            self.sink.try_lock().ok()
        } else {
            None
        };
        let (mut sink, own) = match free {
            Some(sink) => (sink, Some(text.clone())),
            None => {
                self.outbox
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(text.clone());
                // A caller that gives up before its request was taken (its timeout, or a
                // future dropped) takes it back out: no request goes out after its caller
                // stopped waiting.
                let queued_here = Unqueue {
                    outbox: &self.outbox,
                    frame: text.as_str().as_ptr() as usize,
                };
                if !lone {
                    tokio::task::yield_now().await;
                }
                let sink = self.sink.lock().await;
                std::mem::forget(queued_here);
                (sink, None)
            }
        };
        let frames: Vec<Utf8Bytes> = own.into_iter().chain(self.take_outbox()).collect();
        if frames.is_empty() {
            return Ok(());
        }
        // Requests ready together go out as batches: one frame for as many as the node takes
        // in one, which it reads and parses as one.
        for group in batches(&frames, self.batch) {
            sink.feed(Message::Text(batch_frame(group)))
                .await
                .map_err(drop)?;
        }
        sink.flush().await.map_err(drop)
    }

    fn take_outbox(&self) -> Vec<Utf8Bytes> {
        std::mem::take(&mut *self.outbox.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn forget(&self, request_id: &str) {
        let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(request_id);
    }
}

/// `frames` cut into runs that each fit in one batch of `limit` (a frame alone when batches
/// are not taken, or when it is too large to share a frame).
fn batches(frames: &[Utf8Bytes], limit: BatchLimit) -> Vec<&[Utf8Bytes]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 1);
    for (i, frame) in frames.iter().enumerate() {
        // With the frame and the comma or `]` after it, the batch still fits.
        let fits = i - start < limit.requests && bytes + frame.len() < limit.bytes;
        if i > start && !fits {
            out.push(&frames[start..i]);
            (start, bytes) = (i, 1);
        }
        bytes += frame.len() + 1;
    }
    if start < frames.len() {
        out.push(&frames[start..]);
    }
    out
}

/// One frame for several requests: a JSON array of their frames (a lone request stays as it is).
fn batch_frame(requests: &[Utf8Bytes]) -> Utf8Bytes {
    if let [one] = requests {
        return one.clone();
    }
    let len = requests.iter().map(|r| r.len() + 1).sum::<usize>() + 1;
    let mut text = String::with_capacity(len);
    text.push('[');
    for (i, request) in requests.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        text.push_str(request);
    }
    text.push(']');
    text.into()
}

/// Removes a caller's frame from a connection's outbox if the caller stops waiting before the
/// sink is its turn (see [`Conn::write_request`]); frames are told apart by their bytes' address.
struct Unqueue<'a> {
    outbox: &'a StdMutex<Vec<Utf8Bytes>>,
    frame: usize,
}

impl Drop for Unqueue<'_> {
    fn drop(&mut self) {
        self.outbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|f| f.as_str().as_ptr() as usize != self.frame);
    }
}

/// Pings on an idle connection, and how long a connection may stay silent before it is taken
/// for dead (a peer that vanished without closing: a partition, a paused or powered-off host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    pub interval: Duration,
    pub timeout: Duration,
}
