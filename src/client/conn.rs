//! One multiplexed WebSocket connection to a node, and the session that finds the leader, follows
//! redirects and retries with backoff.
//!
//! Many requests share one connection; replies are matched by `requestId`. A retried request
//! keeps its `requestId`, so the cluster's exactly-once table answers a retry of an operation that
//! was already applied with the original outcome instead of applying it twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use backon::BackoffBuilder;
use futures::stream::SplitSink;
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{oneshot, Mutex};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};

use super::error::{is_retryable_code, ClientError};
use super::RetryPolicy;

/// Which reply a waiting caller expects, for the one case where two replies share a
/// `requestId`: cancelling a queued acquire answers both the cancel and the acquire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReplyKind {
    Normal,
    Cancel,
}

struct Slot {
    kind: ReplyKind,
    tx: oneshot::Sender<Reply>,
}

/// One request as the SDK sends it (the WebSocket protocol's request object), written straight
/// from borrowed fields: building a `serde_json::Value` first cost every request a map and a
/// copy of each field name and value. Fields left `None` are left out.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Request<'a> {
    pub command_type: u8,
    pub key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<&'a str>,
    pub request_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_timeout: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<TokenRef<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redirect: Option<bool>,
    /// The client has the answer of each of this owner's requests numbered below this (the
    /// request id is then this request's number).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ack_below: Option<u64>,
}

impl<'a> Request<'a> {
    /// A request of `command_type` on `key` with `request_id`, every other field left out.
    pub fn new(command_type: u8, key: &'a str, request_id: &'a str) -> Self {
        Request {
            command_type,
            key,
            client_id: None,
            request_id,
            ttl: None,
            wait_timeout: None,
            fencing_token: None,
            value: None,
            traceparent: None,
            redirect: None,
            ack_below: None,
        }
    }

    /// The request as it goes on the wire.
    fn text(&self) -> Utf8Bytes {
        serde_json::to_string(self)
            .expect("a request of strings and numbers serializes")
            .into()
    }
}

/// A fencing token in a request: `{"key": …, "value": …}`.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct TokenRef<'a> {
    pub key: &'a str,
    pub value: u64,
}

/// A node's reply, as far as the SDK reads it, with the text it came in (for error messages).
/// Read into this shape once, on the connection's reader task, instead of into a
/// `serde_json::Value` whose map and strings each request then paid for.
#[derive(Debug)]
pub(crate) struct Reply {
    pub body: ReplyBody,
    pub raw: Utf8Bytes,
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.raw.as_str())
    }
}

/// The fields of a reply the SDK uses; any others are skipped.
/// Every field may be missing (its default then).
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct ReplyBody {
    pub success: bool,
    pub request_id: Option<String>,
    pub cancelled: Option<bool>,
    pub expires_in_ms: Option<u64>,
    pub fencing_token: Option<TokenReply>,
    pub value: Option<String>,
    pub error: Option<ErrorReply>,
    /// Set by the SDK, not the node: the reply carried this request's id but fields of types
    /// the SDK does not know (answered as a protocol error instead of never).
    #[serde(skip)]
    pub malformed: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct TokenReply {
    pub value: Option<u64>,
    pub mac: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct ErrorReply {
    pub code: String,
    pub message: String,
    pub leader_addr: Option<String>,
}

/// Reads a reply's text: `None` when it names no request (not JSON, or no string `requestId`).
fn parse_reply(raw: Utf8Bytes) -> Option<(String, Reply)> {
    let (id, body) = match serde_json::from_str::<ReplyBody>(raw.as_str()) {
        Ok(mut body) => (body.request_id.take()?, body),
        // A field of an unexpected type: the request it names still gets an answer, an error.
        Err(_) => {
            let value = serde_json::from_str::<Value>(raw.as_str()).ok()?;
            let id = value.get("requestId")?.as_str()?.to_string();
            let body = ReplyBody {
                malformed: true,
                ..ReplyBody::default()
            };
            (id, body)
        }
    };
    Some((id, Reply { body, raw }))
}

impl ReplyBody {
    /// The error code, `""` when there is none.
    pub fn code(&self) -> &str {
        self.error.as_ref().map_or("", |e| e.code.as_str())
    }
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
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// TLS settings for connections to nodes (`wss://`, `https`): the CAs trusted, and a client
/// certificate when the node asks for one.
pub type TlsConfig = Arc<rustls::ClientConfig>;

/// A WebSocket to a node.
pub(crate) type WsSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Opens a WebSocket to a node's `/ws`: over TLS when `tls` is given, with
/// `Authorization: Bearer <auth_token>` when a token is given.
pub(crate) async fn open_ws(
    addr: &str,
    auth_token: Option<&str>,
    tls: Option<&TlsConfig>,
    config: Option<tokio_tungstenite::tungstenite::protocol::WebSocketConfig>,
) -> Result<WsSocket, OpenError> {
    let request = ws_request(addr, auth_token, tls.is_some()).map_err(OpenError::Request)?;
    let connector = tls.map(|c| tokio_tungstenite::Connector::Rustls(c.clone()));
    tokio_tungstenite::connect_async_tls_with_config(request, config, true, connector)
        .await
        .map(|(socket, _)| socket)
        .map_err(|e| match e {
            tokio_tungstenite::tungstenite::Error::Http(response)
                if matches!(response.status().as_u16(), 401 | 403) =>
            {
                refused_upgrade(response.status().as_u16(), response.body().as_deref())
            }
            other => OpenError::Connect(other.to_string()),
        })
}

/// A node that authenticates clients answers a WebSocket upgrade without a valid token 401
/// (403 for a token without the right), with `{"error": {"code", "message"}}`.
fn refused_upgrade(status: u16, body: Option<&[u8]>) -> OpenError {
    let error = body
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
        .map(|v| v["error"].clone());
    let text = |field: &str, default: &str| {
        error
            .as_ref()
            .and_then(|e| e[field].as_str())
            .unwrap_or(default)
            .to_string()
    };
    let default_code = if status == 403 {
        "PERMISSION_DENIED"
    } else {
        "UNAUTHENTICATED"
    };
    OpenError::Refused(crate::client::ClientError::Rejected {
        code: text("code", default_code),
        message: text("message", "the node refused the connection"),
    })
}

/// Why a connection could not be had: worth another try (another node, later), or refused for
/// a reason another try will not change.
#[derive(Debug)]
pub(crate) enum ConnFailure {
    Retry(String),
    Refused(ClientError),
}

/// Why [`open_ws`] failed: a request that cannot be made (bad address or token), or a
/// connection that failed.
#[derive(Debug)]
pub(crate) enum OpenError {
    Request(String),
    Connect(String),
    /// The node answered the upgrade with a refusal that retrying will not change (a missing
    /// or wrong bearer token).
    Refused(crate::client::ClientError),
}

/// The WebSocket upgrade request for a node's `/ws`, with `Authorization: Bearer <auth_token>`
/// when a token is given.
fn ws_request(
    addr: &str,
    auth_token: Option<&str>,
    secure: bool,
) -> Result<tokio_tungstenite::tungstenite::handshake::client::Request, String> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let scheme = if secure { "wss" } else { "ws" };
    let mut request = format!("{scheme}://{addr}/ws")
        .into_client_request()
        .map_err(|e| format!("bad address {addr}: {e}"))?;
    if let Some(token) = auth_token {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| "the auth token is not a valid header value".to_string())?;
        request.headers_mut().insert("authorization", value);
    }
    Ok(request)
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
        let socket = match tokio::time::timeout(timeout, connect).await {
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
        let mut wrote = false;
        for frame in own.into_iter().chain(self.take_outbox()) {
            sink.feed(Message::Text(frame)).await.map_err(drop)?;
            wrote = true;
        }
        if wrote {
            sink.flush().await.map_err(drop)?;
        }
        Ok(())
    }

    fn take_outbox(&self) -> Vec<Utf8Bytes> {
        std::mem::take(&mut *self.outbox.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn forget(&self, request_id: &str) {
        let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(request_id);
    }
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

/// Client settings shared by every call.
#[derive(Clone, Debug)]
pub(crate) struct SessionConfig {
    pub endpoints: Vec<String>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    pub retry: RetryPolicy,
    pub max_inflight: usize,
    pub max_message_bytes: usize,
    pub keepalive: Option<Keepalive>,
    pub trace_context: Option<TraceContext>,
    /// Bearer token sent with every connection (`Authorization` header).
    pub auth_token: Option<String>,
    /// TLS for every connection (`wss://`), when the nodes' client port uses it.
    pub tls: Option<TlsConfig>,
    /// Ask followers for a redirect to the leader instead of having them forward (see
    /// [`crate::client::ClientBuilder::prefer_leader`]).
    pub prefer_leader: bool,
}

/// Where the SDK gets the W3C `traceparent` of the caller's current span, asked once per
/// operation (its retries send the same value). See [`crate::client::ClientBuilder::trace_context`].
#[derive(Clone)]
pub struct TraceContext(pub(crate) Arc<dyn Fn() -> Option<String> + Send + Sync>);

impl std::fmt::Debug for TraceContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TraceContext(..)")
    }
}

/// A `traceparent` in the W3C form `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`, with
/// ids not all zero.
pub fn is_traceparent(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit());
    let nonzero = |p: &str| p.bytes().any(|b| b != b'0');
    parts.len() == 4
        && parts[0] == "00"
        && hex(parts[1], 32)
        && nonzero(parts[1])
        && hex(parts[2], 16)
        && nonzero(parts[2])
        && hex(parts[3], 2)
}

/// Pings on an idle connection, and how long a connection may stay silent before it is taken
/// for dead (a peer that vanished without closing: a partition, a paused or powered-off host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    pub interval: Duration,
    pub timeout: Duration,
}

struct SessionState {
    leader_hint: Option<String>,
    conn: Option<Arc<Conn>>,
    next_endpoint: usize,
    /// When a leader address a follower redirected to could not be connected to: until
    /// [`DIRECT_RETRY_AFTER`] later, requests let followers forward instead.
    direct_failed_at: Option<Instant>,
}

/// Leader discovery, redirects and retries over one shared connection.
pub(crate) struct Session {
    pub cfg: SessionConfig,
    state: Mutex<SessionState>,
}

/// Most redirects followed in a row before backing off (a leader election in progress can
/// bounce a client between two nodes that each believe the other leads).
const MAX_REDIRECTS_IN_A_ROW: u32 = 3;

/// After the leader's address could not be reached, how long requests go through followers
/// (which forward them) before the client tries the leader directly again.
const DIRECT_RETRY_AFTER: Duration = Duration::from_secs(30);

impl Session {
    pub fn new(cfg: SessionConfig) -> Session {
        Session {
            cfg,
            state: Mutex::new(SessionState {
                leader_hint: None,
                conn: None,
                next_endpoint: 0,
                direct_failed_at: None,
            }),
        }
    }

    /// The open connection, or a new one: to the last known leader first, then to each
    /// configured endpoint in turn.
    async fn connection(&self) -> Result<Arc<Conn>, ConnFailure> {
        let mut st = self.state.lock().await;
        if let Some(c) = &st.conn {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        st.conn = None;
        let mut candidates = Vec::new();
        let hinted = st.leader_hint.take();
        if let Some(hint) = &hinted {
            candidates.push(hint.clone());
        }
        let n = self.cfg.endpoints.len();
        for i in 0..n {
            candidates.push(self.cfg.endpoints[(st.next_endpoint + i) % n].clone());
        }
        st.next_endpoint = (st.next_endpoint + 1) % n.max(1);
        let mut last = String::from("no endpoints");
        for (i, addr) in candidates.into_iter().enumerate() {
            if i == 1 && hinted.is_some() {
                // The leader's address did not answer (not reachable from here, say: a client
                // outside Kubernetes that reaches the cluster through one Service address).
                st.direct_failed_at = Some(Instant::now());
            }
            match Conn::connect(
                &addr,
                self.cfg.connect_timeout,
                self.cfg.max_inflight,
                self.cfg.max_message_bytes,
                self.cfg.keepalive,
                self.cfg.auth_token.as_deref(),
                self.cfg.tls.as_ref(),
            )
            .await
            {
                Ok(c) => {
                    let c = Arc::new(c);
                    st.conn = Some(c.clone());
                    return Ok(c);
                }
                Err(ConnFailure::Retry(e)) => last = e,
                Err(refused) => return Err(refused),
            }
        }
        Err(ConnFailure::Retry(last))
    }

    async fn redirect(&self, from: &Arc<Conn>, leader_addr: Option<String>) {
        let mut st = self.state.lock().await;
        if st.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, from)) {
            st.conn = None;
        }
        st.leader_hint = leader_addr;
    }

    /// Whether requests should ask a follower for a redirect (`"redirect": true`) now.
    async fn wants_redirect(&self) -> bool {
        if !self.cfg.prefer_leader {
            return false;
        }
        let st = self.state.lock().await;
        st.direct_failed_at
            .is_none_or(|at| at.elapsed() >= DIRECT_RETRY_AFTER)
    }

    /// The address of the node the session currently talks to, if connected.
    pub async fn current_addr(&self) -> Option<String> {
        let st = self.state.lock().await;
        st.conn
            .as_ref()
            .filter(|c| !c.is_closed())
            .map(|c| c.addr.clone())
    }

    /// Sends `request` until a final answer: success, or an error that retrying cannot fix.
    /// Redirects are followed at once; `NO_LEADER`, `UNAVAILABLE`, `BUSY`, lost connections and
    /// timeouts are retried after an exponential backoff with jitter, with the same request id.
    /// `wait` extends the per-attempt timeout for acquires that queue.
    pub async fn request(
        &self,
        request: &Request<'_>,
        kind: ReplyKind,
        wait: Option<Duration>,
        policy: &RetryPolicy,
    ) -> Result<Reply, ClientError> {
        let request_id = request.request_id;
        // The caller's trace, once for the operation and all its retries.
        let trace = self.cfg.trace_context.as_ref().and_then(|t| (t.0)());
        let mut request = *request;
        if request.traceparent.is_none() {
            request.traceparent = trace.as_deref().filter(|tp| is_traceparent(tp));
        }
        // The same request asking followers for a redirect to the leader instead of a forward;
        // and the request as it is, written when an attempt first sends it. Each is written
        // once for all attempts.
        let direct = self.cfg.prefer_leader.then(|| {
            Request {
                redirect: Some(true),
                ..request
            }
            .text()
        });
        let mut plain: Option<Utf8Bytes> = None;
        let started = Instant::now();
        let mut backoff = policy.builder().build();
        let mut attempts = 0u32;
        let mut redirects = 0u32;
        let timeout = match wait {
            // Waiting without a timeout: only a lost connection ends the attempt.
            None if request.command_type == 3 && request.wait_timeout.is_none() => None,
            None => Some(self.cfg.request_timeout),
            Some(w) => Some(self.cfg.request_timeout + w),
        };
        loop {
            attempts += 1;
            let sent = match &direct {
                Some(direct) if self.wants_redirect().await => direct,
                _ => &*plain.get_or_insert_with(|| request.text()),
            };
            let failure = match self.connection().await {
                Err(ConnFailure::Refused(e)) => return Err(e),
                Err(ConnFailure::Retry(e)) => e,
                Ok(conn) => match conn.call(request_id, kind, sent, timeout).await {
                    Ok(reply) => {
                        if reply.body.malformed {
                            return Err(ClientError::Protocol(format!(
                                "unexpected reply: {reply}"
                            )));
                        }
                        if reply.body.success {
                            return Ok(reply);
                        }
                        let (code, message, leader) = match reply.body.error {
                            Some(e) => (e.code, e.message, e.leader_addr),
                            None => Default::default(),
                        };
                        if code == "NOT_LEADER" && redirects < MAX_REDIRECTS_IN_A_ROW {
                            let leader = leader.filter(|a| !a.is_empty());
                            if leader.is_some() {
                                redirects += 1;
                                self.redirect(&conn, leader).await;
                                continue;
                            }
                        }
                        if code == "NOT_LEADER" {
                            self.redirect(&conn, None).await;
                        }
                        if !is_retryable_code(&code) {
                            if code == "WAIT_TIMEOUT" {
                                return Err(ClientError::WaitTimeout {
                                    key: request.key.to_string(),
                                });
                            }
                            if code.is_empty() {
                                return Err(ClientError::Protocol(format!(
                                    "unexpected reply: {}",
                                    reply.raw.as_str()
                                )));
                            }
                            return Err(ClientError::Rejected { code, message });
                        }
                        format!("{code}: {message}")
                    }
                    Err(CallError::Lost(e)) => {
                        self.redirect(&conn, None).await;
                        e
                    }
                    Err(CallError::Timeout) => {
                        self.redirect(&conn, None).await;
                        format!("no reply from {} within {timeout:?}", conn.addr)
                    }
                    Err(CallError::Busy) => "too many requests in flight".to_string(),
                },
            };
            redirects = 0;
            let give_up = |last: String| ClientError::Unavailable {
                attempts,
                elapsed: started.elapsed(),
                last,
            };
            if started.elapsed() >= policy.max_elapsed {
                return Err(give_up(failure));
            }
            match backoff.next() {
                Some(delay) => {
                    let left = policy.max_elapsed.saturating_sub(started.elapsed());
                    tokio::time::sleep(policy.jittered(delay).min(left)).await;
                }
                None => return Err(give_up(failure)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sent(request: &Request<'_>) -> Value {
        serde_json::from_str(request.text().as_str()).unwrap()
    }

    #[test]
    fn requests_go_out_as_the_protocol_spells_them() {
        // What each SDK operation sent when it built a `serde_json::Value` first.
        let acquire = Request {
            client_id: Some("c#1"),
            ttl: Some(5000),
            wait_timeout: Some(0),
            ..Request::new(3, "jobs/a", "r\"1")
        };
        assert_eq!(
            sent(&acquire),
            json!({"commandType": 3, "key": "jobs/a", "clientId": "c#1", "requestId": "r\"1",
                   "ttl": 5000, "waitTimeout": 0})
        );
        let release = Request {
            client_id: Some("c#1"),
            fencing_token: Some(TokenRef {
                key: "jobs/a",
                value: 7,
            }),
            ..Request::new(4, "jobs/a", "r2")
        };
        assert_eq!(
            sent(&release),
            json!({"commandType": 4, "key": "jobs/a", "clientId": "c#1", "requestId": "r2",
                   "fencingToken": {"key": "jobs/a", "value": 7}})
        );
        let get = Request::new(7, "k", "r3");
        assert_eq!(
            sent(&get),
            json!({"commandType": 7, "key": "k", "requestId": "r3"})
        );
        let put = Request {
            client_id: Some("c"),
            value: Some("v\n"),
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            ..Request::new(2, "k", "r4")
        };
        assert_eq!(
            sent(&put),
            json!({"commandType": 2, "key": "k", "clientId": "c", "requestId": "r4",
                   "value": "v\n",
                   "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        );
        let direct = Request {
            redirect: Some(true),
            ..get
        };
        assert_eq!(
            sent(&direct),
            json!({"commandType": 7, "key": "k", "requestId": "r3", "redirect": true})
        );
    }

    fn reply(text: &str) -> Option<(String, Reply)> {
        parse_reply(Utf8Bytes::from(text.to_string()))
    }

    #[test]
    fn replies_are_read_into_the_fields_the_sdk_uses() {
        let (id, grant) = reply(
            r#"{"expiresInMs":4990,"fencingToken":{"key":"k","mac":"ab","value":12},"key":"k","requestId":"r1","success":true}"#,
        )
        .unwrap();
        assert_eq!(id, "r1");
        assert!(grant.body.success && !grant.body.malformed);
        assert_eq!(grant.body.expires_in_ms, Some(4990));
        let token = grant.body.fencing_token.as_ref().unwrap();
        assert_eq!((token.value, token.mac.as_deref()), (Some(12), Some("ab")));

        let (_, not_leader) = reply(
            r#"{"success":false,"key":"k","requestId":"r2","error":{"code":"NOT_LEADER","message":"m","leaderId":2,"leaderAddr":"127.0.0.1:2"}}"#,
        )
        .unwrap();
        assert!(!not_leader.body.success);
        assert_eq!(not_leader.body.code(), "NOT_LEADER");
        let error = not_leader.body.error.as_ref().unwrap();
        assert_eq!(error.leader_addr.as_deref(), Some("127.0.0.1:2"));

        let (_, value) =
            reply(r#"{"key":"k","requestId":"r3","success":true,"value":null}"#).unwrap();
        assert_eq!(value.body.value, None);
        let (_, value) =
            reply(r#"{"key":"k","requestId":"r3","success":true,"value":"x"}"#).unwrap();
        assert_eq!(value.body.value.as_deref(), Some("x"));
        let (_, cancelled) =
            reply(r#"{"cancelled":true,"requestId":"r4","success":true}"#).unwrap();
        assert_eq!(cancelled.body.cancelled, Some(true));
    }

    #[test]
    fn a_reply_of_unknown_shape_still_answers_its_request_and_others_are_dropped() {
        // A field of another type than the SDK knows: the caller gets a protocol error, and the
        // reply's text for it, rather than waiting for a timeout.
        let (id, odd) = reply(r#"{"requestId":"r1","success":"yes","expiresInMs":-1}"#).unwrap();
        assert_eq!(id, "r1");
        assert!(odd.body.malformed && !odd.body.success);
        assert!(odd.to_string().contains("\"yes\""));
        // Nothing names a request of this connection: dropped.
        assert!(reply(r#"{"requestId":7,"success":true}"#).is_none());
        assert!(reply(r#"{"success":true}"#).is_none());
        assert!(reply("not json").is_none());
    }

    /// A node that accepts the connection and then reads nothing: once the socket's buffers are
    /// full, a request cannot be written. The call ends with a timeout instead of waiting
    /// forever, and the connection is given up so that the session opens another.
    #[tokio::test]
    async fn a_peer_that_stops_reading_cannot_hold_a_call() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (held_tx, held_rx) = oneshot::channel();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
            // Kept open, never read.
            let _ = held_tx.send(ws);
            std::future::pending::<()>().await;
        });
        let big = 1 << 20;
        let conn = Conn::connect(&addr, Duration::from_secs(5), 64, 2 * big, None, None, None)
            .await
            .unwrap();
        let _held = held_rx.await.unwrap();
        let text: Utf8Bytes = "x".repeat(big).into();
        let mut outcome = None;
        for i in 0..64 {
            let id = format!("r{i}");
            let started = Instant::now();
            let call = conn.call(
                &id,
                ReplyKind::Normal,
                &text,
                Some(Duration::from_millis(300)),
            );
            match tokio::time::timeout(Duration::from_secs(10), call).await {
                Err(_) => panic!("call {i} still waiting after 10 s"),
                // The request reached the socket; its reply never comes.
                Ok(Err(CallError::Timeout)) if !conn.is_closed() => continue,
                Ok(result) => {
                    outcome = Some((i, result.map(|_| ()), started.elapsed()));
                    break;
                }
            }
        }
        let (i, result, took) = outcome.expect("64 MB were all taken by a peer that reads nothing");
        assert!(
            matches!(result, Err(CallError::Timeout)),
            "call {i}: {result:?}"
        );
        assert!(conn.is_closed(), "the stuck connection is given up");
        assert!(took < Duration::from_secs(5), "call {i} took {took:?}");
        assert!(
            conn.pending.lock().unwrap().is_empty(),
            "nothing left waiting"
        );
    }

    /// A node that reports every text frame it reads.
    async fn recording_node() -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
            while let Some(Ok(msg)) = ws.next().await {
                if let Message::Text(t) = msg {
                    let _ = tx.send(t.to_string());
                }
            }
        });
        (addr, rx)
    }

    /// Requests that queue while the sink is busy are all written by whoever gets it next; a
    /// caller that stops waiting before then takes its request back, so it never goes out.
    #[tokio::test]
    async fn queued_requests_go_out_together_and_a_caller_that_gives_up_takes_its_back() {
        let (addr, mut received) = recording_node().await;
        let conn = Arc::new(
            Conn::connect(&addr, Duration::from_secs(5), 64, 1 << 20, None, None, None)
                .await
                .unwrap(),
        );
        let busy = conn.sink.lock().await;
        // Given up while queued: the outer timeout drops the call.
        let abandoned: Utf8Bytes = r#"{"requestId":"abandoned"}"#.into();
        let gave_up = tokio::time::timeout(
            Duration::from_millis(50),
            conn.call("abandoned", ReplyKind::Normal, &abandoned, None),
        )
        .await;
        assert!(gave_up.is_err(), "the call waited for the busy sink");
        assert!(conn.outbox.lock().unwrap().is_empty(), "{:?}", conn.outbox);
        let waiting: Vec<_> = (0..5)
            .map(|i| {
                let conn = conn.clone();
                tokio::spawn(async move {
                    let id = format!("q{i}");
                    let text: Utf8Bytes = format!(r#"{{"requestId":"{id}"}}"#).into();
                    conn.call(
                        &id,
                        ReplyKind::Normal,
                        &text,
                        Some(Duration::from_millis(300)),
                    )
                    .await
                })
            })
            .collect();
        // All five queue behind the busy sink.
        let queued = Instant::now();
        while conn.outbox.lock().unwrap().len() < 5 {
            assert!(
                queued.elapsed() < Duration::from_secs(5),
                "{:?}",
                conn.outbox
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(busy);
        let mut got = Vec::new();
        while got.len() < 5 {
            let frame = tokio::time::timeout(Duration::from_secs(5), received.recv())
                .await
                .expect("the queued requests reach the node")
                .unwrap();
            got.push(frame);
        }
        got.sort();
        let want: Vec<String> = (0..5)
            .map(|i| format!(r#"{{"requestId":"q{i}"}}"#))
            .collect();
        assert_eq!(
            got, want,
            "each queued request once, the abandoned one never"
        );
        for w in waiting {
            // No node answers here: each call ends in its own timeout, the connection intact.
            assert!(matches!(w.await.unwrap(), Err(CallError::Timeout)));
        }
        assert!(!conn.is_closed());
        assert!(
            tokio::time::timeout(Duration::from_millis(200), received.recv())
                .await
                .is_err(),
            "nothing else was written"
        );
    }
}
