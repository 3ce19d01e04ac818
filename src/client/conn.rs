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
use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;

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
    tx: oneshot::Sender<Value>,
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

pub(crate) struct Conn {
    pub addr: String,
    out: mpsc::Sender<String>,
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
        .map_err(|e| OpenError::Connect(e.to_string()))
}

/// Why [`open_ws`] failed: a request that cannot be made (bad address or token), or a
/// connection that failed.
#[derive(Debug)]
pub(crate) enum OpenError {
    Request(String),
    Connect(String),
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

/// Read buffer of one connection (the server uses the same size).
const READ_BUFFER_BYTES: usize = 4096;
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
    ) -> Result<Conn, String> {
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
            Ok(Err(OpenError::Request(e))) => return Err(e),
            Ok(Err(OpenError::Connect(e))) => return Err(format!("cannot connect to {addr}: {e}")),
            Err(_) => return Err(format!("connecting to {addr} timed out after {timeout:?}")),
        };
        let (mut sink, mut stream) = socket.split();
        let (out, mut out_rx) = mpsc::channel::<String>(max_inflight.max(1));
        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        let writer_closed = closed.clone();
        // When anything last arrived on the connection (pongs included).
        let opened = Instant::now();
        let last_heard = Arc::new(AtomicU64::new(0));
        let writer_heard = last_heard.clone();
        let writer_pending = pending.clone();
        let writer = tokio::spawn(async move {
            let period = keepalive.map_or(Duration::from_secs(3600), |k| k.interval);
            let mut ping = tokio::time::interval_at((Instant::now() + period).into(), period);
            ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    next = out_rx.recv() => {
                        let Some(text) = next else { break };
                        if sink.send(Message::text(text)).await.is_err() {
                            break;
                        }
                    }
                    _ = ping.tick(), if keepalive.is_some() => {
                        let Some(k) = keepalive else { continue };
                        let heard = opened + Duration::from_millis(writer_heard.load(Ordering::SeqCst));
                        if heard.elapsed() > k.timeout {
                            // Silent for too long: give up on this connection, wake every
                            // caller ("connection lost": they retry elsewhere, same request id).
                            writer_closed.store(true, Ordering::SeqCst);
                            writer_pending.lock().unwrap_or_else(|p| p.into_inner()).clear();
                            break;
                        }
                        let send = sink.send(Message::Ping(Vec::new().into()));
                        match tokio::time::timeout(k.timeout, send).await {
                            Ok(Ok(())) => {}
                            _ => break,
                        }
                    }
                }
            }
            writer_closed.store(true, Ordering::SeqCst);
            let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
        });
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
                let Ok(value) = serde_json::from_str::<Value>(text.as_str()) else {
                    continue;
                };
                let Some(request_id) = value.get("requestId").and_then(Value::as_str) else {
                    continue;
                };
                let kind = if value.get("cancelled").is_some()
                    || value["error"]["code"].as_str() == Some("NOT_WAITING")
                {
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
                    let _ = slot.tx.send(value);
                }
            }
            reader_closed.store(true, Ordering::SeqCst);
            // Dropping the senders wakes every waiting caller with "connection lost".
            reader_pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        });
        Ok(Conn {
            addr: addr.to_string(),
            out,
            pending,
            closed,
            max_inflight,
            tasks: vec![writer, reader],
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
        text: &str,
        timeout: Option<Duration>,
    ) -> Result<Value, CallError> {
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
        if self.is_closed() || self.out.send(text.to_owned()).await.is_err() {
            self.forget(request_id);
            return Err(CallError::Lost(format!(
                "connection to {} closed",
                self.addr
            )));
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

    fn forget(&self, request_id: &str) {
        let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(request_id);
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
    async fn connection(&self) -> Result<Arc<Conn>, String> {
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
                Err(e) => last = e,
            }
        }
        Err(last)
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

    /// Sends `body` (which carries `request_id`) until a final answer: success, or an error that
    /// retrying cannot fix. Redirects are followed at once; `NO_LEADER`, `UNAVAILABLE`, `BUSY`,
    /// lost connections and timeouts are retried after an exponential backoff with jitter, with
    /// the same request id. `wait` extends the per-attempt timeout for acquires that queue.
    pub async fn request(
        &self,
        request_id: &str,
        kind: ReplyKind,
        body: &Value,
        wait: Option<Duration>,
        policy: &RetryPolicy,
    ) -> Result<Value, ClientError> {
        // The caller's trace, once for the operation and all its retries.
        let traced;
        let body = match self.cfg.trace_context.as_ref().and_then(|t| (t.0)()) {
            Some(tp) if body.get("traceparent").is_none() && is_traceparent(&tp) => {
                let mut b = body.clone();
                b["traceparent"] = Value::String(tp);
                traced = b;
                &traced
            }
            _ => body,
        };
        // The same request asking followers for a redirect to the leader instead of a forward
        // (written from `body`, not a copy of it); and the request as it is, written when an
        // attempt first sends it. Each is written once for all attempts.
        let direct = self.cfg.prefer_leader.then(|| with_redirect(body));
        let mut plain: Option<String> = None;
        let started = Instant::now();
        let mut backoff = policy.builder().build();
        let mut attempts = 0u32;
        let mut redirects = 0u32;
        let timeout = match wait {
            // Waiting without a timeout: only a lost connection ends the attempt.
            None if body["commandType"] == 3 && body.get("waitTimeout").is_none() => None,
            None => Some(self.cfg.request_timeout),
            Some(w) => Some(self.cfg.request_timeout + w),
        };
        loop {
            attempts += 1;
            let sent = match &direct {
                Some(direct) if self.wants_redirect().await => direct.as_str(),
                _ => plain.get_or_insert_with(|| body.to_string()).as_str(),
            };
            let failure = match self.connection().await {
                Err(e) => e,
                Ok(conn) => match conn.call(request_id, kind, sent, timeout).await {
                    Ok(reply) => {
                        if reply["success"] == true {
                            return Ok(reply);
                        }
                        let code = reply["error"]["code"].as_str().unwrap_or("").to_string();
                        let message = reply["error"]["message"].as_str().unwrap_or("").to_string();
                        if code == "NOT_LEADER" && redirects < MAX_REDIRECTS_IN_A_ROW {
                            let leader = reply["error"]["leaderAddr"]
                                .as_str()
                                .filter(|a| !a.is_empty())
                                .map(str::to_string);
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
                                    key: body["key"].as_str().unwrap_or("").to_string(),
                                });
                            }
                            if code.is_empty() {
                                return Err(ClientError::Protocol(format!(
                                    "unexpected reply: {reply}"
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

/// `body` (a JSON object) with `"redirect": true`, serialized straight from it.
fn with_redirect(body: &Value) -> String {
    struct WithRedirect<'a>(&'a serde_json::Map<String, Value>);
    impl serde::Serialize for WithRedirect<'_> {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeMap;
            let mut map = serializer.serialize_map(Some(self.0.len() + 1))?;
            for (key, value) in self.0.iter().filter(|(key, _)| *key != "redirect") {
                map.serialize_entry(key, value)?;
            }
            map.serialize_entry("redirect", &true)?;
            map.end()
        }
    }
    match body.as_object() {
        Some(fields) => serde_json::to_string(&WithRedirect(fields)).unwrap_or_default(),
        None => body.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redirect_request_is_the_request_with_redirect_set() {
        let body = serde_json::json!({
            "commandType": 3, "key": "jobs/a", "clientId": "c", "requestId": "r\"1", "ttl": 5
        });
        let mut want = body.clone();
        want["redirect"] = Value::Bool(true);
        let text = with_redirect(&body);
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), want);
        // A redirect field already there is replaced, not repeated.
        let asked = serde_json::json!({"commandType": 7, "key": "k", "redirect": false});
        let text = with_redirect(&asked);
        assert_eq!(text.matches("redirect").count(), 1, "{text}");
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap()["redirect"],
            Value::Bool(true)
        );
    }
}
