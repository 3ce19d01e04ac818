//! [`ClientBuilder`]: the client's settings (endpoints, ids, TTL and safety margin, timeouts,
//! retries, keepalive, tracing, auth token, TLS) with their defaults, checked by `build`.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use super::super::conn::{Keepalive, Session, SessionConfig, TraceContext};
use super::super::error::ClientError;
use super::super::{random_u64, RetryPolicy};
use super::ids::first_request_number;
use super::{Inner, RaftLockClient, MAX_CLIENT_ID_BYTES};

/// Builds a [`RaftLockClient`]; every setting has a default except the endpoints.
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    endpoints: Vec<String>,
    client_id: Option<String>,
    default_ttl: Duration,
    safety_margin: Option<Duration>,
    connect_timeout: Duration,
    request_timeout: Duration,
    retry: RetryPolicy,
    max_inflight: usize,
    max_message_bytes: usize,
    renew_interval: Option<Duration>,
    release_on_drop_timeout: Duration,
    keepalive: Option<Keepalive>,
    trace_context: Option<TraceContext>,
    auth_token: Option<String>,
    tls: Option<TlsSetting>,
    prefer_leader: bool,
    acknowledge_answers: Option<bool>,
}

/// Where the builder's TLS settings come from.
#[derive(Clone, Debug)]
enum TlsSetting {
    CaFile(std::path::PathBuf),
    Config(super::super::conn::TlsConfig),
}

impl Default for ClientBuilder {
    fn default() -> Self {
        ClientBuilder {
            endpoints: Vec::new(),
            client_id: None,
            default_ttl: Duration::from_secs(10),
            safety_margin: None,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            max_inflight: 1024,
            max_message_bytes: 1 << 20,
            renew_interval: None,
            release_on_drop_timeout: Duration::from_secs(5),
            keepalive: Some(Keepalive {
                interval: Duration::from_secs(5),
                timeout: Duration::from_secs(15),
            }),
            trace_context: None,
            auth_token: None,
            tls: None,
            prefer_leader: true,
            acknowledge_answers: None,
        }
    }
}

impl ClientBuilder {
    /// Adds a node's client address (`host:port`, `ws://host:port/ws` also accepted). Any node
    /// will do: the client finds the leader by itself.
    pub fn endpoint(mut self, addr: impl Into<String>) -> Self {
        self.endpoints.push(addr.into());
        self
    }

    pub fn endpoints<I: IntoIterator<Item = S>, S: Into<String>>(mut self, addrs: I) -> Self {
        self.endpoints.extend(addrs.into_iter().map(Into::into));
        self
    }

    /// Whether the client talks to the leader itself (default) or lets the node it is
    /// connected to forward its requests. With `true` every request asks a follower for a
    /// redirect (`"redirect": true`): the follower answers `NOT_LEADER` with the leader's client
    /// address and the client connects there, so each request takes one hop less than a
    /// forwarded one. When that address cannot be connected to (a client outside Kubernetes that
    /// reaches the cluster through one Service address, say) the client lets followers forward
    /// for 30 s and then tries the leader again. With `false` followers always forward.
    pub fn prefer_leader(mut self, prefer: bool) -> Self {
        self.prefer_leader = prefer;
        self
    }

    /// Whether the client acknowledges the answers it received (`ackBelow`), so that the
    /// cluster forgets them at once instead of keeping each for its retention (which caps a
    /// cluster's sustained request rate; docs/protocol.md, *Acknowledging answers*). Request ids are then
    /// plain numbers from one counter of this client. Default: on with the default client id,
    /// which no other process uses; off with an explicit [`ClientBuilder::client_id`], since two
    /// processes running with one client id at the same time would number their requests alike
    /// and each could be answered with the other's answer — turn it on when the id is this
    /// process's alone. A cluster that does not know acknowledgements yet (a rolling upgrade)
    /// takes the requests as plain ones.
    pub fn acknowledge_answers(mut self, on: bool) -> Self {
        self.acknowledge_answers = Some(on);
        self
    }

    /// This client's identity. Each acquire holds its lock under an owner id derived from it,
    /// `{client_id}#{n}` (see [`LockHandle::owner_id`]); [`RaftLockClient::release`] and
    /// [`RaftLockClient::renew`] act as the client id itself. Default:
    /// `<hostname>-<pid>-<random>`; at most 128 bytes.
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.client_id = Some(id.into());
        self
    }

    /// TTL used by [`RaftLockClient::acquire`]. Default 10 s.
    pub fn default_ttl(mut self, ttl: Duration) -> Self {
        self.default_ttl = ttl;
        self
    }

    /// How long before the lease could lapse on the server a holder is told it lost the lock.
    /// Default: a fifth of the TTL.
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.safety_margin = Some(margin);
        self
    }

    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// Time allowed for one attempt of one request (plus the wait timeout for acquires).
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = t;
        self
    }

    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Most requests in flight on the connection. Default 1024.
    pub fn max_inflight(mut self, n: usize) -> Self {
        self.max_inflight = n;
        self
    }

    /// How often [`LockHandle::auto_renew`] renews. Default: a third of the lock's TTL; never
    /// more than half of it (a longer interval is shortened to half the TTL).
    pub fn renew_interval(mut self, interval: Duration) -> Self {
        self.renew_interval = Some(interval);
        self
    }

    /// How long the release sent when a [`LockHandle`] is dropped unreleased may take (it runs
    /// in the background, retrying within this bound; the lock lapses at its TTL if it fails).
    /// Default 5 s.
    pub fn release_on_drop_timeout(mut self, timeout: Duration) -> Self {
        self.release_on_drop_timeout = timeout;
        self
    }

    /// Pings the node every `interval` and takes the connection for dead when nothing arrived
    /// for `timeout` (a node or network that vanished without closing it): requests waiting on
    /// it are retried on another node. Default every 5 s, dead after 15 s.
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keepalive = Some(Keepalive { interval, timeout });
        self
    }

    /// No pings: a silent connection is noticed only by request timeouts.
    pub fn without_keepalive(mut self) -> Self {
        self.keepalive = None;
        self
    }

    /// Continues the caller's traces on the server: before each operation the SDK calls `source`
    /// and, when it returns a W3C `traceparent` (`00-<trace id>-<span id>-<flags>`), sends it
    /// with the request (all retries of the operation carry the same one), so lock-node's spans
    /// of the request — on the follower that forwarded it and on the leader — join that trace.
    /// The SDK does not depend on OpenTelemetry; with it, the source is typically the current
    /// span's context injected by the W3C propagator. Values that are not a valid `traceparent`
    /// are not sent.
    pub fn trace_context<F>(mut self, source: F) -> Self
    where
        F: Fn() -> Option<String> + Send + Sync + 'static,
    {
        self.trace_context = Some(TraceContext(Arc::new(source)));
        self
    }

    /// A bearer token for a cluster that authenticates its clients (`lock-node
    /// --client-auth-file`): sent as `Authorization: Bearer <token>` on every connection. The
    /// node then holds this client's locks under its identity (`<identity>/<client id>`).
    pub fn auth_token(mut self, token: impl Into<String>) -> Self {
        self.auth_token = Some(token.into());
        self
    }

    /// Connects with TLS (`wss://`), trusting the CA certificates in this PEM file (the CA that
    /// signed the nodes' `--client-tls-cert`).
    pub fn tls_ca_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.tls = Some(TlsSetting::CaFile(path.into()));
        self
    }

    /// Connects with TLS using this rustls configuration (for client certificates or other
    /// trust settings; build it with the ring provider, as [`crate::tls::client_config`] does).
    pub fn tls_config(mut self, config: Arc<rustls::ClientConfig>) -> Self {
        self.tls = Some(TlsSetting::Config(config));
        self
    }

    pub fn build(self) -> Result<RaftLockClient, ClientError> {
        let bad = |m: String| Err(ClientError::Config(m));
        if self.endpoints.is_empty() {
            return bad("at least one endpoint is required".into());
        }
        let mut endpoints = Vec::new();
        for e in &self.endpoints {
            let addr = e
                .trim()
                .trim_start_matches("ws://")
                .trim_start_matches("http://")
                .trim_end_matches("/ws")
                .trim_end_matches('/');
            match addr.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    endpoints.push(addr.to_string())
                }
                _ => return bad(format!("endpoint {e:?} is not host:port")),
            }
        }
        let acknowledge = self.acknowledge_answers.unwrap_or(self.client_id.is_none());
        let client_id = self.client_id.clone().unwrap_or_else(default_client_id);
        if client_id.is_empty() || client_id.len() > MAX_CLIENT_ID_BYTES {
            return bad(format!("client id must be 1..={MAX_CLIENT_ID_BYTES} bytes"));
        }
        if self.default_ttl < Duration::from_millis(1) {
            return bad("the default TTL must be at least 1 ms".into());
        }
        if let Some(m) = self.safety_margin {
            if m >= self.default_ttl {
                return bad(format!(
                    "the safety margin ({m:?}) must be shorter than the TTL ({:?})",
                    self.default_ttl
                ));
            }
        }
        if self.max_inflight == 0 {
            return bad("max_inflight must be at least 1".into());
        }
        if self.renew_interval.is_some_and(|i| i.is_zero()) {
            return bad("the renew interval must be positive".into());
        }
        if let Some(k) = self.keepalive {
            if k.interval.is_zero() || k.timeout < k.interval {
                return bad(format!(
                    "keepalive interval ({:?}) must be positive and not exceed its timeout ({:?})",
                    k.interval, k.timeout
                ));
            }
        }
        self.retry.validate().map_err(ClientError::Config)?;
        let session = Session::new(SessionConfig {
            endpoints,
            connect_timeout: self.connect_timeout,
            request_timeout: self.request_timeout,
            retry: self.retry.clone(),
            max_inflight: self.max_inflight,
            max_message_bytes: self.max_message_bytes,
            keepalive: self.keepalive,
            trace_context: self.trace_context.clone(),
            auth_token: self.auth_token.clone(),
            tls: match &self.tls {
                None => None,
                Some(TlsSetting::Config(c)) => Some(c.clone()),
                Some(TlsSetting::CaFile(path)) => Some(
                    crate::tls::client_config(path, None)
                        .map_err(|e| ClientError::Config(e.to_string()))?,
                ),
            },
            prefer_leader: self.prefer_leader,
        });
        Ok(RaftLockClient {
            inner: Arc::new(Inner {
                session,
                client_id,
                default_ttl: self.default_ttl,
                safety_margin: self.safety_margin,
                // Request numbers start at the wall clock in microseconds: a process that
                // restarts under the same client id numbers above everything it sent before
                // (no client sends a request per microsecond), so its first requests are not
                // refused `ACKNOWLEDGED` by the session its previous run left open.
                seq: AtomicU64::new(first_request_number()),
                run: random_u64(),
                renew_interval: self.renew_interval,
                release_on_drop_timeout: self.release_on_drop_timeout,
                spare_owners: StdMutex::new(Vec::new()),
                in_flight: acknowledge.then(|| StdMutex::new(HashMap::new())),
            }),
        })
    }
}

fn default_client_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "client".into());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        random_u64() & 0xffff
    )
}
