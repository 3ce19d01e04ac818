//! [`AdvancedClient`]: queue a waiter and keep its request id ([`PendingAcquire`]), cancel the
//! wait, and choose the retry policy per call.

use std::time::Duration;

use tokio::task::JoinHandle;

use super::super::conn::{ReplyKind, Request};
use super::super::error::ClientError;
use super::super::RetryPolicy;
use super::{LockHandle, RaftLockClient};

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
        // A spare owner id of this client (a new one only when none is free), given back when
        // the wait ends without a grant: queued acquires do not each open a session.
        let owner = self.client.inner.take_owner();
        let number = self.client.number_request(&owner);
        let request_id = number.id.clone();
        let client = self.client.clone();
        let (k, o) = (key.to_string(), owner.clone());
        let task = tokio::spawn(async move {
            let result = client
                .acquire_request(&k, ttl, wait, &o, &number, &policy)
                .await;
            drop(number);
            client.settle_owner(o, &result);
            result
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
        let result = self
            .client
            .acquire_request(key, ttl, wait, &owner, &number, policy)
            .await;
        drop(number);
        self.client.settle_owner(owner, &result);
        result
    }
}
