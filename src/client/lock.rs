//! `RaftLockClient`, `AdvancedClient`, `LockHandle` and `AutoRenewer`.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::conn::{Keepalive, ReplyKind, Request, Session, SessionConfig, TokenRef, TraceContext};
use super::error::ClientError;
use super::{random_u64, RetryPolicy};

/// Longest client id accepted by the builder, and longest owner id sent: the server's default
/// limit on ids (`Limits::id_bytes_max`).
const MAX_CLIENT_ID_BYTES: usize = 128;

/// Numbers the owner ids of this process's acquires (see [`owner_id`]).
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// A fresh owner id derived from `client_id`: `{client_id}#{n}`, with `n` from a process-wide
/// counter, so no two locks this process holds or waits for at once share an identity on the
/// server (an id whose lock was released is reused: `Inner::take_owner`). A client id too
/// long for the suffix is shortened to a prefix plus a digest of the whole id, keeping the owner
/// id within [`MAX_CLIENT_ID_BYTES`].
fn owner_id(client_id: &str) -> String {
    let n = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
    let suffix = format!("#{n}");
    if client_id.len() + suffix.len() <= MAX_CLIENT_ID_BYTES {
        return format!("{client_id}{suffix}");
    }
    let digest = format!("~{:016x}", fnv1a(client_id.as_bytes()));
    let mut keep = MAX_CLIENT_ID_BYTES - suffix.len() - digest.len();
    while !client_id.is_char_boundary(keep) {
        keep -= 1;
    }
    format!("{}{digest}{suffix}", &client_id[..keep])
}

/// FNV-1a, 64 bits: a stable digest (the same in every process and release).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

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
    Config(super::conn::TlsConfig),
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

struct Inner {
    session: Session,
    client_id: String,
    default_ttl: Duration,
    safety_margin: Option<Duration>,
    seq: AtomicU64,
    /// Distinguishes request ids of this client instance from an earlier one with the same id.
    run: u64,
    renew_interval: Option<Duration>,
    release_on_drop_timeout: Duration,
    /// Owner ids whose lock was released and that hold nothing on the server, for the next
    /// acquires: every owner id opens a client session on the cluster (kept until it has been
    /// idle for `session_idle`), so a client that took a fresh id for every acquire would fill
    /// the cluster's session table (`max_sessions`) and be refused with BUSY.
    spare_owners: StdMutex<Vec<String>>,
    /// With acknowledgements on: the numbers of each owner's requests awaiting their answer.
    in_flight: Option<StdMutex<HashMap<String, BTreeSet<u64>>>>,
}

/// The id of one request (kept by its retries), and what it acknowledges. With
/// acknowledgements on, the id is the request's number and `ack_below` the lowest number of its
/// owner's requests still awaiting an answer, this one included; dropping it (answered, failed
/// for good, or abandoned) ends the wait.
pub(crate) struct RequestNumber {
    pub id: String,
    pub ack_below: Option<u64>,
    waiting: Option<(Arc<Inner>, String, u64)>,
}

impl Drop for RequestNumber {
    fn drop(&mut self) {
        let Some((inner, owner, n)) = self.waiting.take() else {
            return;
        };
        let Some(in_flight) = &inner.in_flight else {
            return;
        };
        let mut in_flight = in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(numbers) = in_flight.get_mut(&owner) {
            numbers.remove(&n);
            if numbers.is_empty() {
                in_flight.remove(&owner);
            }
        }
    }
}

/// Spare owner ids kept per client (more concurrent locks than this make new ones).
const SPARE_OWNERS_MAX: usize = 1024;

impl Inner {
    /// A spare owner id, or a new one.
    fn take_owner(&self) -> String {
        let spare = self
            .spare_owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        spare.unwrap_or_else(|| owner_id(&self.client_id))
    }

    /// `owner` holds nothing any more (its one lock was released): reuse it.
    fn give_back_owner(&self, owner: String) {
        let mut spare = self.spare_owners.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < SPARE_OWNERS_MAX && !owner.is_empty() {
            spare.push(owner);
        }
    }
}

/// The everyday client: acquire, try-acquire, release, renew, and replicated KV.
///
/// Cheap to clone; clones share one connection. Every acquire (from any clone) holds its lock
/// under its own owner id, `{client_id}#{n}`, so two tasks sharing a client contend for a key
/// like two clients: at most one of them holds it. The [`LockHandle`] remembers its owner id and
/// releases and renews with it.
#[derive(Clone)]
pub struct RaftLockClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RaftLockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftLockClient")
            .field("client_id", &self.inner.client_id)
            .finish()
    }
}

impl RaftLockClient {
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// The id this client was built with; owner ids of its locks are derived from it.
    /// Watches lock events under `prefix` (`""`: every key) on any node, from `from_index` (the
    /// events after that log index, while the nodes still keep them) or from now. The stream
    /// reconnects by itself and resumes without loss or repeats; see [`crate::client::Watch`].
    pub async fn watch(
        &self,
        prefix: &str,
        from_index: Option<u64>,
    ) -> Result<crate::client::Watch, ClientError> {
        let cfg = &self.inner.session.cfg;
        crate::client::Watch::start(
            cfg.endpoints.clone(),
            cfg.auth_token.clone(),
            cfg.tls.clone(),
            prefix,
            from_index,
            cfg.connect_timeout,
        )
        .await
    }

    pub fn client_id(&self) -> &str {
        &self.inner.client_id
    }

    /// A fresh request id; retries of one operation reuse it.
    pub fn next_request_id(&self) -> String {
        let n = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        format!("{:x}-{n}", self.inner.run)
    }

    /// A fresh request of `owner` (see [`RequestNumber`]). Numbers come from the client's one
    /// counter, so each owner's are increasing, with gaps.
    pub(crate) fn number_request(&self, owner: &str) -> RequestNumber {
        let Some(in_flight) = &self.inner.in_flight else {
            return RequestNumber {
                id: self.next_request_id(),
                ack_below: None,
                waiting: None,
            };
        };
        let mut in_flight = in_flight.lock().unwrap_or_else(|p| p.into_inner());
        // Taken under the lock: a number is in the set before any later one is handed out, so
        // no request acknowledges one of its owner's that is still on its way.
        let n = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let numbers = in_flight.entry(owner.to_string()).or_default();
        numbers.insert(n);
        let ack_below = numbers.first().copied().unwrap_or(n);
        RequestNumber {
            id: n.to_string(),
            ack_below: Some(ack_below),
            waiting: Some((self.inner.clone(), owner.to_string(), n)),
        }
    }

    fn margin_for(&self, ttl: Duration) -> Duration {
        self.inner.safety_margin.unwrap_or(ttl / 5).min(ttl)
    }

    /// Waits (without a time limit) until the lock is granted with the default TTL.
    pub async fn acquire(&self, key: &str) -> Result<LockHandle, ClientError> {
        self.acquire_with(key, self.inner.default_ttl, None).await
    }

    /// Acquires with `ttl`, waiting at most `wait` in the queue (`Some(ZERO)`: do not wait).
    /// `Ok(None)` when the wait timed out.
    pub async fn try_acquire(
        &self,
        key: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<LockHandle>, ClientError> {
        match self.acquire_with(key, ttl, Some(wait)).await {
            Ok(h) => Ok(Some(h)),
            Err(ClientError::WaitTimeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Acquires with an explicit TTL and optional wait timeout, using this client's retry policy.
    pub async fn acquire_with(
        &self,
        key: &str,
        ttl: Duration,
        wait: Option<Duration>,
    ) -> Result<LockHandle, ClientError> {
        let policy = self.inner.session.cfg.retry.clone();
        let owner = self.inner.take_owner();
        let number = self.number_request(&owner);
        self.acquire_request(key, ttl, wait, &owner, &number, &policy)
            .await
    }

    /// One acquire under `owner` with `request_id`; every retry resends both unchanged, so a
    /// retried acquire is answered (and granted) at most once.
    pub(crate) async fn acquire_request(
        &self,
        key: &str,
        ttl: Duration,
        wait: Option<Duration>,
        owner: &str,
        number: &RequestNumber,
        policy: &RetryPolicy,
    ) -> Result<LockHandle, ClientError> {
        check_key(key)?;
        let ttl_ms = duration_ms(ttl)?;
        let request = Request {
            client_id: Some(owner),
            ttl: Some(ttl_ms),
            wait_timeout: wait.map(|w| w.as_millis() as u64),
            ack_below: number.ack_below,
            ..Request::new(3, key, &number.id)
        };
        // The lease on the server starts when the grant is applied, which is after this point;
        // counting from here keeps the client's deadline earlier than the server's.
        let sent = Instant::now();
        let reply = self
            .inner
            .session
            .request(&request, ReplyKind::Normal, wait, policy)
            .await?;
        let token = reply
            .body
            .fencing_token
            .as_ref()
            .and_then(|t| t.value)
            .ok_or_else(|| ClientError::Protocol(format!("grant without a token: {reply}")))?;
        let expires_in = reply.body.expires_in_ms.unwrap_or(ttl_ms);
        let ttl = Duration::from_millis(expires_in.min(ttl_ms));
        let mut handle = LockHandle::new(
            self.clone(),
            owner.to_string(),
            key.to_string(),
            token,
            ttl,
            sent + ttl.saturating_sub(self.margin_for(ttl)),
        );
        handle.mac = reply.body.fencing_token.and_then(|t| t.mac);
        Ok(handle)
    }

    /// Releases the lock held with `token` by the owner id equal to this client's id — for
    /// example one that `lockctl acquire` printed, passed as this client's id. A lock acquired
    /// through this SDK is held by its handle's owner id: release it with
    /// [`LockHandle::release`] (or [`RaftLockClient::release_as`]). Refused with
    /// `NOT_HOLDER`/`STALE_TOKEN` if someone else holds the lock.
    pub async fn release(&self, key: &str, token: u64) -> Result<(), ClientError> {
        self.release_as(&self.inner.client_id, key, token).await
    }

    /// Releases the lock `owner` holds with `token`.
    pub async fn release_as(&self, owner: &str, key: &str, token: u64) -> Result<(), ClientError> {
        check_key(key)?;
        let number = self.number_request(owner);
        let request = Request {
            client_id: Some(owner),
            fencing_token: Some(TokenRef { key, value: token }),
            ack_below: number.ack_below,
            ..Request::new(4, key, &number.id)
        };
        self.inner
            .session
            .request(
                &request,
                ReplyKind::Normal,
                None,
                &self.inner.session.cfg.retry,
            )
            .await
            .map(|_| ())
    }

    /// Extends the lease of the lock held with `token` by the owner id equal to this client's
    /// id (see [`RaftLockClient::release`]) to `ttl` from now; returns the new deadline on this
    /// client's monotonic clock (already shortened by the safety margin). For a lock acquired
    /// through this SDK use [`LockHandle::renew`] or [`RaftLockClient::renew_as`].
    pub async fn renew(
        &self,
        key: &str,
        token: u64,
        ttl: Duration,
    ) -> Result<Instant, ClientError> {
        self.renew_as(&self.inner.client_id, key, token, ttl).await
    }

    /// Extends the lease of the lock `owner` holds with `token` to `ttl` from now.
    pub async fn renew_as(
        &self,
        owner: &str,
        key: &str,
        token: u64,
        ttl: Duration,
    ) -> Result<Instant, ClientError> {
        check_key(key)?;
        let ttl_ms = duration_ms(ttl)?;
        let number = self.number_request(owner);
        let request = Request {
            client_id: Some(owner),
            fencing_token: Some(TokenRef { key, value: token }),
            ttl: Some(ttl_ms),
            ack_below: number.ack_below,
            ..Request::new(5, key, &number.id)
        };
        let sent = Instant::now();
        let reply = self
            .inner
            .session
            .request(
                &request,
                ReplyKind::Normal,
                None,
                &self.inner.session.cfg.retry,
            )
            .await?;
        let expires_in = reply.body.expires_in_ms.unwrap_or(ttl_ms).min(ttl_ms);
        let ttl = Duration::from_millis(expires_in);
        Ok(sent + ttl.saturating_sub(self.margin_for(ttl)))
    }

    /// Linearizable read of a replicated KV key.
    pub async fn get(&self, key: &str) -> Result<Option<String>, ClientError> {
        check_key(key)?;
        let request_id = self.next_request_id();
        let request = Request::new(7, key, &request_id);
        let reply = self
            .inner
            .session
            .request(
                &request,
                ReplyKind::Normal,
                None,
                &self.inner.session.cfg.retry,
            )
            .await?;
        Ok(reply.body.value)
    }

    /// Writes a replicated KV key; with `guard`, only while that fencing token is current.
    /// [`LockHandle::put`] writes guarded by a handle's lock.
    pub async fn put(
        &self,
        key: &str,
        value: &str,
        guard: Option<(&str, u64)>,
    ) -> Result<(), ClientError> {
        self.put_as(&self.inner.client_id, key, value, guard).await
    }

    async fn put_as(
        &self,
        client_id: &str,
        key: &str,
        value: &str,
        guard: Option<(&str, u64)>,
    ) -> Result<(), ClientError> {
        check_key(key)?;
        let number = self.number_request(client_id);
        let request = Request {
            client_id: Some(client_id),
            value: Some(value),
            fencing_token: guard.map(|(key, value)| TokenRef { key, value }),
            ack_below: number.ack_below,
            ..Request::new(2, key, &number.id)
        };
        self.inner
            .session
            .request(
                &request,
                ReplyKind::Normal,
                None,
                &self.inner.session.cfg.retry,
            )
            .await
            .map(|_| ())
    }

    /// The node this client is connected to right now, if any.
    pub async fn connected_to(&self) -> Option<String> {
        self.inner.session.current_addr().await
    }

    pub(crate) fn session(&self) -> &Session {
        &self.inner.session
    }
}

fn check_key(key: &str) -> Result<(), ClientError> {
    if key.is_empty() {
        return Err(ClientError::Config("the key must not be empty".into()));
    }
    Ok(())
}

fn duration_ms(d: Duration) -> Result<u64, ClientError> {
    let ms = d.as_millis();
    if ms == 0 || ms > u64::MAX as u128 {
        return Err(ClientError::Config(format!(
            "TTL {d:?} must be at least 1 ms"
        )));
    }
    Ok(ms as u64)
}

/// Why a held lock was lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LossReason {
    /// No renewal succeeded before the safety deadline; the server may soon grant the lock to
    /// someone else.
    Expired,
    /// The cluster says this client no longer holds the lock.
    Revoked(String),
}

impl std::fmt::Display for LossReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LossReason::Expired => {
                write!(f, "lease could not be renewed before its safety deadline")
            }
            LossReason::Revoked(why) => write!(f, "revoked: {why}"),
        }
    }
}

/// A granted lock: its owner id, key, fencing token, and how long it is safe to act on it.
///
/// The lock is held by the handle's own owner id ([`LockHandle::owner_id`]), not by the client
/// id shared by clones of the client; release, renewal, [`AutoRenewer`] and [`LockHandle::put`]
/// use it. Dropping a handle that was not released sends a best-effort release in the
/// background.
pub struct LockHandle {
    client: RaftLockClient,
    owner: String,
    key: String,
    token: u64,
    ttl: Duration,
    valid_until: Arc<StdMutex<Instant>>,
    released: AtomicBool,
    /// The token's MAC, when the cluster has a fencing key.
    mac: Option<String>,
}

impl std::fmt::Debug for LockHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockHandle")
            .field("owner", &self.owner)
            .field("key", &self.key)
            .field("token", &self.token)
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl LockHandle {
    fn new(
        client: RaftLockClient,
        owner: String,
        key: String,
        token: u64,
        ttl: Duration,
        valid_until: Instant,
    ) -> Self {
        LockHandle {
            client,
            owner,
            key,
            token,
            ttl,
            valid_until: Arc::new(StdMutex::new(valid_until)),
            released: AtomicBool::new(false),
            mac: None,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The identity the cluster records as this lock's holder: `{client_id}#{n}`, unique to
    /// this acquire. Another process can release or renew the lock as this id (for example
    /// `lockctl --client-id <owner id> release`).
    pub fn owner_id(&self) -> &str {
        &self.owner
    }

    /// The fencing token: pass it to every resource you write while holding the lock.
    pub fn fencing_token(&self) -> u64 {
        self.token
    }

    /// The fencing token's MAC (64 hex digits) when the cluster runs with a fencing key
    /// (`lock-node --fencing-key-file`): send it with the token (`fencingToken.mac`) to a
    /// resource that checks it, such as `data-store --fencing-key-file`. `None` otherwise.
    pub fn fencing_mac(&self) -> Option<&str> {
        self.mac.as_deref()
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Until when (on this process's monotonic clock) acting on the lock is safe.
    pub fn valid_until(&self) -> Instant {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until()
    }

    /// Renews once now.
    pub async fn renew(&self) -> Result<(), ClientError> {
        let until = self
            .client
            .renew_as(&self.owner, &self.key, self.token, self.ttl)
            .await?;
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner()) = until;
        Ok(())
    }

    /// Starts renewing in the background, at a third of the TTL unless the builder's
    /// `renew_interval` says otherwise. The returned renewer's
    /// [`AutoRenewer::lost`] resolves — before the server could grant the lock to anyone
    /// else — if renewal fails.
    pub fn auto_renew(&self) -> AutoRenewer {
        AutoRenewer::start(
            self.client.clone(),
            self.owner.clone(),
            self.key.clone(),
            self.token,
            self.ttl,
            self.valid_until.clone(),
        )
    }

    /// Writes a replicated KV key, guarded by this lock: applied only while its token is
    /// current.
    pub async fn put(&self, key: &str, value: &str) -> Result<(), ClientError> {
        self.client
            .put_as(&self.owner, key, value, Some((&self.key, self.token)))
            .await
    }

    /// Releases the lock and waits for the cluster's answer.
    pub async fn release(mut self) -> Result<(), ClientError> {
        self.released.store(true, Ordering::SeqCst);
        let released = self
            .client
            .release_as(&self.owner, &self.key, self.token)
            .await;
        if released.is_ok() {
            let owner = std::mem::take(&mut self.owner);
            self.client.inner.give_back_owner(owner);
        }
        released
    }
}

impl Drop for LockHandle {
    fn drop(&mut self) {
        if self.released.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            let owner = std::mem::take(&mut self.owner);
            let key = std::mem::take(&mut self.key);
            let token = self.token;
            let bound = client.inner.release_on_drop_timeout;
            rt.spawn(async move {
                let released =
                    tokio::time::timeout(bound, client.release_as(&owner, &key, token)).await;
                if matches!(released, Ok(Ok(()))) {
                    client.inner.give_back_owner(owner);
                }
            });
        }
    }
}

/// Background renewal of one lock, with a loss signal.
pub struct AutoRenewer {
    task: JoinHandle<()>,
    lost: watch::Receiver<Option<LossReason>>,
}

impl AutoRenewer {
    fn start(
        client: RaftLockClient,
        owner: String,
        key: String,
        token: u64,
        ttl: Duration,
        valid_until: Arc<StdMutex<Instant>>,
    ) -> AutoRenewer {
        let (tx, rx) = watch::channel(None);
        let task = tokio::spawn(async move {
            let interval = client
                .inner
                .renew_interval
                .unwrap_or(ttl / 3)
                .min(ttl / 2)
                .max(Duration::from_millis(1));
            let mut last_attempt = Instant::now();
            loop {
                let deadline = *valid_until.lock().unwrap_or_else(|p| p.into_inner());
                let next = (last_attempt + interval).min(deadline);
                tokio::time::sleep_until(next.into()).await;
                if Instant::now() >= deadline {
                    let _ = tx.send(Some(LossReason::Expired));
                    return;
                }
                last_attempt = Instant::now();
                let attempt = client.renew_as(&owner, &key, token, ttl);
                match tokio::time::timeout_at(deadline.into(), attempt).await {
                    Ok(Ok(until)) => {
                        *valid_until.lock().unwrap_or_else(|p| p.into_inner()) = until;
                    }
                    Ok(Err(e))
                        if e.is_not_holder() || matches!(e, ClientError::Rejected { .. }) =>
                    {
                        let _ = tx.send(Some(LossReason::Revoked(e.to_string())));
                        return;
                    }
                    // Unavailable: try again at the next interval if time remains.
                    Ok(Err(_)) => {}
                    Err(_) => {
                        let _ = tx.send(Some(LossReason::Expired));
                        return;
                    }
                }
            }
        });
        AutoRenewer { task, lost: rx }
    }

    /// Resolves when the lock is lost (never, while renewals succeed).
    pub async fn lost(&mut self) -> LossReason {
        loop {
            if let Some(reason) = self.lost.borrow_and_update().clone() {
                return reason;
            }
            if self.lost.changed().await.is_err() {
                // The renewer stopped without a loss (cannot happen while it runs).
                std::future::pending::<()>().await;
            }
        }
    }

    pub fn is_lost(&self) -> bool {
        self.lost.borrow().is_some()
    }

    /// Stops renewing (the lock then lapses at its TTL unless released).
    pub fn stop(self) {}
}

impl Drop for AutoRenewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Lower-level operations: queue a waiter and keep its request id, cancel it, and pick the retry
/// policy per call.
#[derive(Clone, Debug)]
pub struct AdvancedClient {
    client: RaftLockClient,
}

/// A queued acquire: await it with [`PendingAcquire::granted`], or cancel it.
pub struct PendingAcquire {
    pub key: String,
    /// The owner id the lock will be held by once granted.
    pub owner_id: String,
    pub request_id: String,
    task: JoinHandle<Result<LockHandle, ClientError>>,
}

impl PendingAcquire {
    /// Waits for the grant (or the wait timeout, or a cancel: `WaitTimeout`).
    pub async fn granted(self) -> Result<LockHandle, ClientError> {
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(ClientError::Protocol(format!("acquire task failed: {e}"))),
        }
    }
}

impl AdvancedClient {
    pub fn new(client: RaftLockClient) -> Self {
        AdvancedClient { client }
    }

    pub fn client(&self) -> &RaftLockClient {
        &self.client
    }

    /// Joins the FIFO queue of `key` and returns at once; the grant arrives on the returned
    /// [`PendingAcquire`].
    pub fn enqueue(
        &self,
        key: &str,
        ttl: Duration,
        wait: Option<Duration>,
        policy: RetryPolicy,
    ) -> PendingAcquire {
        let owner = owner_id(self.client.client_id());
        let number = self.client.number_request(&owner);
        let request_id = number.id.clone();
        let client = self.client.clone();
        let (k, o) = (key.to_string(), owner.clone());
        let task = tokio::spawn(async move {
            client
                .acquire_request(&k, ttl, wait, &o, &number, &policy)
                .await
        });
        PendingAcquire {
            key: key.to_string(),
            owner_id: owner,
            request_id,
            task,
        }
    }

    /// Takes a queued acquire out of the queue. `NOT_WAITING` if it was already granted or gone.
    pub async fn cancel_wait(&self, pending: &PendingAcquire) -> Result<(), ClientError> {
        let request = Request {
            client_id: Some(&pending.owner_id),
            ..Request::new(6, &pending.key, &pending.request_id)
        };
        self.client
            .session()
            .request(
                &request,
                ReplyKind::Cancel,
                None,
                &self.client.session().cfg.retry,
            )
            .await
            .map(|_| ())
    }

    /// Acquire with a specific retry policy.
    pub async fn acquire_with_policy(
        &self,
        key: &str,
        ttl: Duration,
        wait: Option<Duration>,
        policy: &RetryPolicy,
    ) -> Result<LockHandle, ClientError> {
        let owner = self.client.inner.take_owner();
        let number = self.client.number_request(&owner);
        self.client
            .acquire_request(key, ttl, wait, &owner, &number, policy)
            .await
    }
}

/// The first request number of a client built now (see `seq`): microseconds since the Unix
/// epoch, at least 1.
fn first_request_number() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
        .max(1)
}
