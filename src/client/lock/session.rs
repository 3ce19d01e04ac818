//! Sessions that cover many locks: [`RaftLockClient::open_session`] opens one lease for many
//! locks. Locks taken through the [`LockSession`] have no lease of their own: one keepalive keeps
//! them all, and when the session ends — [`LockSession::end`], or its lease running out because
//! keepalives stopped — every one of them ends in the same log entry.
//!
//! Opt-in, and a trade: one missed keepalive window ends every attached lock at once, where
//! locks renewed one by one would fail one by one.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::conn::{ReplyKind, Request};
use super::super::error::ClientError;
use super::shared::check_permits;
use super::{check_key, duration_ms, RaftLockClient};
use crate::lock::LockMode;

/// A session this client keeps: a lease covering every lock acquired through it.
#[derive(Debug)]
pub struct LockSession {
    client: RaftLockClient,
    owner: String,
    id: u64,
    ttl: Duration,
    /// Until when acting on the session's locks is safe (the latest acknowledged keepalive's
    /// send time + TTL − the safety margin).
    valid_until: Arc<Mutex<Instant>>,
    keeper: Option<tokio::task::JoinHandle<()>>,
    ended: bool,
}

/// A lock attached to a [`LockSession`]: it lasts as long as the session does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionLock {
    pub key: String,
    /// The fencing token: pass it to every resource the holder writes.
    pub token: u64,
    /// The token's MAC when the cluster has a fencing key.
    pub mac: Option<String>,
    /// How a read-write lock or semaphore is held (`None`: an exclusive lock).
    pub mode: Option<LockMode>,
    /// A permit's slot.
    pub slot: Option<u32>,
}

impl RaftLockClient {
    /// Opens a session with a lease of `ttl` under an owner id of its own. Keep it alive with
    /// [`LockSession::keep_alive`] or [`LockSession::auto_keep_alive`] at least once per `ttl`.
    pub async fn open_session(&self, ttl: Duration) -> Result<LockSession, ClientError> {
        let ttl_ms = duration_ms(ttl)?;
        let owner = format!("{}-session-{}", self.client_id(), self.next_request_id());
        let (id, valid_until) = self.keep_alive_request(&owner, 0, ttl_ms).await?;
        Ok(LockSession {
            client: self.clone(),
            owner,
            id,
            ttl,
            valid_until: Arc::new(Mutex::new(valid_until)),
            keeper: None,
            ended: false,
        })
    }

    /// One keepalive of `owner`'s session `session` (0: open one); the session's id and until
    /// when it is safe to act on its locks.
    async fn keep_alive_request(
        &self,
        owner: &str,
        session: u64,
        ttl_ms: u64,
    ) -> Result<(u64, Instant), ClientError> {
        let id = self.next_request_id();
        let request = Request {
            client_id: Some(owner),
            ttl: Some(ttl_ms),
            session: Some(session),
            ..Request::new(13, "", &id)
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
        let id = reply.body.session.ok_or_else(|| {
            ClientError::Protocol(format!("keepalive without a session: {reply}"))
        })?;
        let ttl = Duration::from_millis(ttl_ms);
        Ok((id, sent + ttl.saturating_sub(self.margin_for(ttl))))
    }
}

impl LockSession {
    /// The session's id (the log index that opened it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The owner id its locks are held under.
    pub fn owner_id(&self) -> &str {
        &self.owner
    }

    /// Whether acting on the session's locks is still safe (the lease, less the safety margin).
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until()
    }

    pub fn valid_until(&self) -> Instant {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves once acting on the session's locks may no longer be safe: the latest
    /// acknowledged keepalive, less the safety margin, has run out (keepalives failed, or the
    /// session ended). Later keepalives push it back while it waits.
    pub async fn lost(&self) {
        loop {
            let until = self.valid_until();
            let now = Instant::now();
            if now >= until {
                return;
            }
            tokio::time::sleep(until - now).await;
        }
    }

    /// Keeps the session alive once now. `NO_SESSION`: it ended, with every lock on it.
    pub async fn keep_alive(&self) -> Result<(), ClientError> {
        let ttl_ms = duration_ms(self.ttl)?;
        let (_, until) = self
            .client
            .keep_alive_request(&self.owner, self.id, ttl_ms)
            .await?;
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner()) = until;
        Ok(())
    }

    /// Keeps the session alive in the background, every third of its TTL, until it is ended,
    /// dropped, or a keepalive fails for good (then [`LockSession::is_valid`] turns false once the
    /// last acknowledged lease, less the margin, has passed).
    pub fn auto_keep_alive(&mut self) {
        if self.keeper.is_some() {
            return;
        }
        let client = self.client.clone();
        let owner = self.owner.clone();
        let (id, ttl) = (self.id, self.ttl);
        let valid_until = self.valid_until.clone();
        self.keeper = Some(tokio::spawn(async move {
            let Ok(ttl_ms) = duration_ms(ttl) else {
                return;
            };
            loop {
                tokio::time::sleep(ttl / 3).await;
                match client.keep_alive_request(&owner, id, ttl_ms).await {
                    Ok((_, until)) => {
                        *valid_until.lock().unwrap_or_else(|p| p.into_inner()) = until;
                    }
                    // NO_SESSION (or another refusal): the session is gone.
                    Err(ClientError::Rejected { .. }) => return,
                    // No answer in time, no leader: the next round tries again.
                    Err(_) => continue,
                }
            }
        }));
    }

    /// Acquires `key` attached to the session, waiting at most `wait` in the queue
    /// (`Some(ZERO)`: do not wait; `None`: until granted). `WaitTimeout` when the wait ran out.
    pub async fn acquire(
        &self,
        key: &str,
        wait: Option<Duration>,
    ) -> Result<SessionLock, ClientError> {
        self.attached_grant(key, wait, None).await
    }

    /// Takes `key` in `mode` attached to the session (a read or write lock, or — with
    /// `permits`, the size a semaphore not in use yet starts with — a permit), waiting at most
    /// `wait` in the queue (`Some(ZERO)`: do not wait; `None`: until granted). It ends with the
    /// session like every lock on it. `WaitTimeout` when the wait ran out.
    pub async fn acquire_shared(
        &self,
        key: &str,
        mode: LockMode,
        permits: u32,
        wait: Option<Duration>,
    ) -> Result<SessionLock, ClientError> {
        check_permits(mode, permits)?;
        self.attached_grant(key, wait, Some((mode, permits))).await
    }

    /// An acquire attached to the session: of a lock, or with `shared` of a read-write lock or
    /// semaphore in that mode.
    async fn attached_grant(
        &self,
        key: &str,
        wait: Option<Duration>,
        shared: Option<(LockMode, u32)>,
    ) -> Result<SessionLock, ClientError> {
        check_key(key)?;
        let number = self.client.number_request(&self.owner);
        let (command, mode, permits) = match shared {
            None => (3, None, None),
            Some((mode, permits)) => (
                15,
                Some(mode.as_str()),
                (mode == LockMode::Permit).then_some(permits),
            ),
        };
        let request = Request {
            client_id: Some(&self.owner),
            ttl: Some(0),
            wait_timeout: wait.map(|w| w.as_millis() as u64),
            ack_below: number.ack_below,
            mode,
            permits,
            ..Request::new(command, key, &number.id)
        };
        let reply = self
            .client
            .inner
            .session
            .request(
                &request,
                ReplyKind::Normal,
                wait,
                &self.client.inner.session.cfg.retry,
            )
            .await?;
        let token = reply.body.fencing_token.as_ref().and_then(|t| t.value);
        let token = token
            .ok_or_else(|| ClientError::Protocol(format!("grant without a token: {reply}")))?;
        let token_reply = reply.body.fencing_token.unwrap_or_default();
        Ok(SessionLock {
            key: key.to_string(),
            token,
            mac: token_reply.mac,
            mode: shared.map(|(mode, _)| mode),
            slot: shared.and(token_reply.slot),
        })
    }

    /// Releases one of the session's locks (the session and its other locks go on).
    pub async fn release(&self, lock: &SessionLock) -> Result<(), ClientError> {
        self.client
            .release_as(&self.owner, &lock.key, lock.token)
            .await
    }

    /// Ends the session: every lock on it is released and every acquire of it still waiting
    /// leaves its queue, in one log entry. Returns how many ended.
    pub async fn end(mut self) -> Result<u32, ClientError> {
        self.ended = true;
        if let Some(keeper) = self.keeper.take() {
            keeper.abort();
        }
        end_request(&self.client, &self.owner, self.id).await
    }
}

async fn end_request(
    client: &RaftLockClient,
    owner: &str,
    session: u64,
) -> Result<u32, ClientError> {
    let id = client.next_request_id();
    let request = Request {
        client_id: Some(owner),
        session: Some(session),
        ..Request::new(14, "", &id)
    };
    let reply = client
        .inner
        .session
        .request(
            &request,
            ReplyKind::Normal,
            None,
            &client.inner.session.cfg.retry,
        )
        .await?;
    Ok(reply.body.locks.unwrap_or(0))
}

impl Drop for LockSession {
    /// A dropped session is ended in the background (when a runtime is there to run it);
    /// otherwise its lease runs out.
    fn drop(&mut self) {
        if let Some(keeper) = self.keeper.take() {
            keeper.abort();
        }
        if self.ended {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (client, owner, id) = (self.client.clone(), self.owner.clone(), self.id);
            rt.spawn(async move {
                let _ = end_request(&client, &owner, id).await;
            });
        }
    }
}
