//! [`Session`] and its settings ([`SessionConfig`], the caller's [`TraceContext`]): leader
//! discovery (the last known leader first, then each endpoint in turn), `NOT_LEADER` redirects,
//! and retries with exponential backoff and jitter, resending the same request id so nothing is
//! applied twice.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::BackoffBuilder;
use tokio::sync::Mutex;
use tokio_tungstenite::tungstenite::Utf8Bytes;

use super::super::error::{is_retryable_code, ClientError};
use super::super::RetryPolicy;
use super::protocol::{Reply, ReplyKind, Request};
use super::websocket::TlsConfig;
use super::{CallError, Conn, ConnFailure, Keepalive};

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
