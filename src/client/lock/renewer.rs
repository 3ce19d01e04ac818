//! Background renewal: [`AutoRenewer`] renews a lock until stopped and signals its loss
//! ([`LossReason`]) before the server could grant the lock to anyone else.

use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::super::error::ClientError;
use super::RaftLockClient;

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

/// Background renewal of one lock, with a loss signal.
pub struct AutoRenewer {
    task: JoinHandle<()>,
    lost: watch::Receiver<Option<LossReason>>,
}

impl AutoRenewer {
    pub(super) fn start(
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
