//! `RaftLockClient`, `AdvancedClient`, `LockHandle` and `AutoRenewer`.
//!
//! Where things live:
//! - `builder`: [`ClientBuilder`], the settings and their checks.
//! - `ids`: owner ids, request ids and numbers (acknowledgements).
//! - `handle`: [`LockHandle`], a granted lock and its fencing token.
//! - `renewer`: [`AutoRenewer`] and [`LossReason`].
//! - `advanced`: [`AdvancedClient`] and [`PendingAcquire`].
//! - here: [`RaftLockClient`]'s operations (acquire, release, renew, KV, watch).

mod advanced;
mod builder;
mod election;
mod handle;
mod ids;
mod renewer;
mod session;
mod shared;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use super::conn::{ReplyKind, Request, Session, TokenRef};
use super::error::ClientError;
use super::RetryPolicy;
use ids::RequestNumber;

pub use advanced::{AdvancedClient, PendingAcquire};
pub use builder::ClientBuilder;
pub use election::{LeaderInfo, LeaderObserver, Leadership};
pub use handle::LockHandle;
pub use renewer::{AutoRenewer, LossReason};
pub use session::{LockSession, SessionLock};
pub use shared::SharedLock;

/// What an acquire asks for: a lock, an election's leadership (showing a value), or a
/// read-write lock or semaphore in a mode (with a semaphore's size).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Grant<'a> {
    Lock,
    Campaign(&'a str),
    Shared(crate::lock::LockMode, u32),
}

/// Longest client id accepted by the builder, and longest owner id sent: the server's default
/// limit on ids (`Limits::id_bytes_max`).
const MAX_CLIENT_ID_BYTES: usize = 128;

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

    /// The id this client was built with; owner ids of its locks are derived from it.
    pub fn client_id(&self) -> &str {
        &self.inner.client_id
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
        let result = self
            .acquire_request(key, ttl, wait, &owner, &number, &policy)
            .await;
        drop(number);
        self.settle_owner(owner, &result);
        result
    }

    /// After an acquire under `owner`: the owner id is kept for reuse when the answer says for
    /// sure that it holds and waits for nothing — the wait timed out (or was cancelled), or the
    /// request was refused before or at the server. After a grant the handle gives it back on
    /// release; after an unknown outcome (no answer in time) it is never reused, since a grant
    /// whose answer was lost may still name it.
    pub(crate) fn settle_owner(&self, owner: String, result: &Result<LockHandle, ClientError>) {
        let nothing_held = match result {
            Err(ClientError::WaitTimeout { .. } | ClientError::Config(_)) => true,
            // ALREADY_HELD: the owner holds the key (a retry whose first grant was not
            // remembered); REQUEST_ID_REUSED: what the id named is not known here.
            Err(ClientError::Rejected { code, .. }) => {
                !matches!(code.as_str(), "ALREADY_HELD" | "REQUEST_ID_REUSED")
            }
            _ => false,
        };
        if nothing_held {
            self.inner.give_back_owner(owner);
        }
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
        self.grant_request(key, ttl, wait, owner, number, policy, Grant::Lock)
            .await
    }

    /// An acquire, or with `campaign` a campaign to lead the election `key` showing that
    /// value: the two are the same request but for the command and the value.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn grant_request(
        &self,
        key: &str,
        ttl: Duration,
        wait: Option<Duration>,
        owner: &str,
        number: &RequestNumber,
        policy: &RetryPolicy,
        grant: Grant<'_>,
    ) -> Result<LockHandle, ClientError> {
        check_key(key)?;
        let ttl_ms = duration_ms(ttl)?;
        let (command, value, mode, permits) = match grant {
            Grant::Lock => (3, None, None, None),
            Grant::Campaign(value) => (10, Some(value), None, None),
            Grant::Shared(mode, permits) => (
                15,
                None,
                Some(mode.as_str()),
                (mode == crate::lock::LockMode::Permit).then_some(permits),
            ),
        };
        let request = Request {
            client_id: Some(owner),
            ttl: Some(ttl_ms),
            wait_timeout: wait.map(|w| w.as_millis() as u64),
            ack_below: number.ack_below,
            value,
            mode,
            permits,
            ..Request::new(command, key, &number.id)
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
        let token_reply = reply.body.fencing_token.unwrap_or_default();
        handle.mac = token_reply.mac;
        handle.slot = token_reply.slot;
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

    /// Sets `key`'s lock-delay: after a holder's lease of `key` *expires* (not when it is
    /// released), the cluster grants the key to no one for `delay`, so that a resource that
    /// cannot check fencing tokens is not used by the next holder while the expired one may
    /// still be acting. `Duration::ZERO` removes the setting. Needs an admin identity when the
    /// cluster checks identities; refused with `INVALID_REQUEST` until every member runs a
    /// RaftLock that has lock-delay. Returns the delay now in force.
    pub async fn set_lock_delay(
        &self,
        key: &str,
        delay: Duration,
    ) -> Result<Duration, ClientError> {
        check_key(key)?;
        let delay_ms = u64::try_from(delay.as_millis())
            .map_err(|_| ClientError::Config(format!("lock-delay {delay:?} is too long")))?;
        let owner = self.inner.client_id.clone();
        let number = self.number_request(&owner);
        let request = Request {
            client_id: Some(&owner),
            lock_delay: Some(delay_ms),
            ack_below: number.ack_below,
            ..Request::new(9, key, &number.id)
        };
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
        Ok(Duration::from_millis(
            reply.body.lock_delay.unwrap_or(delay_ms),
        ))
    }

    /// Sets semaphore `key`'s size to `permits`: kept while no one uses the key, and in force
    /// over the size the first permit asked for. Raising it grants the waiters that now fit;
    /// lowering it below the holders lets them keep their permits (new grants wait until they
    /// fit); 0 forgets the setting (the size then lasts while the semaphore is in use). Needs an
    /// admin identity when the cluster checks identities. Returns the size set.
    pub async fn set_permits(&self, key: &str, permits: u32) -> Result<u32, ClientError> {
        check_key(key)?;
        let owner = self.inner.client_id.clone();
        let number = self.number_request(&owner);
        let request = Request {
            client_id: Some(&owner),
            permits: Some(permits),
            ack_below: number.ack_below,
            ..Request::new(16, key, &number.id)
        };
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
        Ok(reply.body.permits.unwrap_or(permits))
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
