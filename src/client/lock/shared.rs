//! Read-write locks and semaphores: [`RaftLockClient::acquire_read`],
//! [`RaftLockClient::acquire_write`] and [`RaftLockClient::acquire_permit`] wait in the key's
//! FIFO queue and return a [`SharedLock`] that renews like a lock's handle and is given back on
//! [`SharedLock::release`] or drop.
//!
//! Many readers hold a read-write lock at once, or one writer; a waiting writer holds back the
//! readers behind it, so writers do not starve. A semaphore has N permits; each permit holds a
//! *slot* below N, and each slot's holders hold increasing fencing tokens. The fencing token's
//! mode (`reader`, `writer`, `permit` and its slot) is covered by its MAC: a resource refuses a
//! reader's token for a write, and a permit's for another slot.

use std::time::{Duration, Instant};

use super::super::error::ClientError;
use super::{AutoRenewer, Grant, LockHandle, RaftLockClient};
use crate::lock::LockMode;

/// A held read lock, write lock or semaphore permit.
#[derive(Debug)]
pub struct SharedLock {
    handle: LockHandle,
    mode: LockMode,
}

impl SharedLock {
    pub fn key(&self) -> &str {
        self.handle.key()
    }

    /// `Read`, `Write` or `Permit`.
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// A permit's slot (`None` for a read or write lock).
    pub fn slot(&self) -> Option<u32> {
        self.handle.slot
    }

    /// The fencing token: pass it to the resource with its mode (`reader`, `writer`, or
    /// `permit` and the slot) and MAC.
    pub fn fencing_token(&self) -> u64 {
        self.handle.fencing_token()
    }

    /// The token's MAC, when the cluster has a fencing key (it covers the mode and slot).
    pub fn fencing_mac(&self) -> Option<&str> {
        self.handle.fencing_mac()
    }

    /// The token's mode as a resource checks it: `reader`, `writer` or `permit`.
    pub fn token_mode(&self) -> &'static str {
        match self.mode {
            LockMode::Read => "reader",
            LockMode::Write => "writer",
            LockMode::Permit => "permit",
        }
    }

    pub fn owner_id(&self) -> &str {
        self.handle.owner_id()
    }

    /// Whether holding is still safe (the lease, less the safety margin).
    pub fn is_valid(&self) -> bool {
        self.handle.is_valid()
    }

    pub fn valid_until(&self) -> Instant {
        self.handle.valid_until()
    }

    /// Renews the lease once now.
    pub async fn renew(&self) -> Result<(), ClientError> {
        self.handle.renew().await
    }

    /// Renews in the background; [`AutoRenewer::lost`] resolves before the lease could end if
    /// renewal fails.
    pub fn auto_renew(&self) -> AutoRenewer {
        self.handle.auto_renew()
    }

    /// Gives the lock (or permit) back: the waiters that now fit are granted in the same log
    /// entry.
    pub async fn release(self) -> Result<(), ClientError> {
        self.handle.release().await
    }
}

impl RaftLockClient {
    /// Takes read-write lock `key` as a reader (beside other readers), waiting until granted.
    pub async fn acquire_read(&self, key: &str) -> Result<SharedLock, ClientError> {
        self.acquire_shared_with(key, LockMode::Read, 0, self.inner.default_ttl, None)
            .await
    }

    /// Takes read-write lock `key` as its one writer, waiting until granted.
    pub async fn acquire_write(&self, key: &str) -> Result<SharedLock, ClientError> {
        self.acquire_shared_with(key, LockMode::Write, 0, self.inner.default_ttl, None)
            .await
    }

    /// Takes one permit of semaphore `key`, waiting until granted. `permits` is the size the
    /// semaphore starts with if no one uses it yet (the size in use, or an admin's, wins).
    pub async fn acquire_permit(&self, key: &str, permits: u32) -> Result<SharedLock, ClientError> {
        self.acquire_shared_with(key, LockMode::Permit, permits, self.inner.default_ttl, None)
            .await
    }

    /// Takes `key` in `mode` with the lease `ttl`, waiting at most `wait` (`Some(ZERO)`: only if
    /// it can be granted at once; `None`: until granted). A wait that runs out is
    /// `ClientError::WaitTimeout`.
    pub async fn acquire_shared_with(
        &self,
        key: &str,
        mode: LockMode,
        permits: u32,
        ttl: Duration,
        wait: Option<Duration>,
    ) -> Result<SharedLock, ClientError> {
        check_permits(mode, permits)?;
        let policy = self.inner.session.cfg.retry.clone();
        let owner = self.inner.take_owner();
        let number = self.number_request(&owner);
        let result = self
            .grant_request(
                key,
                ttl,
                wait,
                &owner,
                &number,
                &policy,
                Grant::Shared(mode, permits),
            )
            .await;
        drop(number);
        self.settle_owner(owner, &result);
        result.map(|handle| SharedLock { handle, mode })
    }
}

/// A permit names the semaphore's size (1 or more); a read or write lock none.
pub(super) fn check_permits(mode: LockMode, permits: u32) -> Result<(), ClientError> {
    if (mode == LockMode::Permit) != (permits > 0) {
        return Err(ClientError::Config(
            "a permit names the semaphore's size (1 or more); a read or write lock none".into(),
        ));
    }
    Ok(())
}
