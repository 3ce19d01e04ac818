//! [`LockHandle`]: a granted lock with its owner id, key, fencing token (and its MAC) and
//! safety deadline; renew, guarded put, release, and the best-effort release on drop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use super::super::error::ClientError;
use super::{AutoRenewer, RaftLockClient};

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
    pub(super) mac: Option<String>,
    /// A semaphore permit's slot.
    pub(super) slot: Option<u32>,
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
    pub(super) fn new(
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
            slot: None,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub(super) fn client(&self) -> &RaftLockClient {
        &self.client
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
