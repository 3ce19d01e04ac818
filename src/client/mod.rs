//! The Rust SDK: [`RaftLockClient`] (acquire, try-acquire, release, renew, KV), [`AdminClient`]
//! (status, members, health), [`AdvancedClient`] (queue a waiter, cancel a wait, per-call retry
//! policy), [`LockHandle`] and [`AutoRenewer`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), raftlock::client::ClientError> {
//! use std::time::Duration;
//! use raftlock::client::RaftLockClient;
//!
//! let client = RaftLockClient::builder()
//!     .endpoints(["127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:50053"])
//!     .build()?;
//! let lock = client.acquire("orders").await?;
//! let mut renewer = lock.auto_renew();
//! tokio::select! {
//!     _ = async { /* work, sending lock.fencing_token() with every write */ } => {}
//!     reason = renewer.lost() => eprintln!("stop: {reason}"),
//! }
//! lock.release().await?;
//! # Ok(()) }
//! ```
//!
//! The client talks to any node, follows `NOT_LEADER` redirects to the leader, and retries only
//! retryable failures (`NOT_LEADER`, `NO_LEADER`, `UNAVAILABLE`, `BUSY`, a lost connection) with
//! exponential backoff and jitter, resending the same `requestId` so nothing is applied twice.
//!
//! Each acquire holds its lock under its own owner id, `{client_id}#{n}`
//! ([`LockHandle::owner_id`]), kept across the retries of that acquire: clones of one client
//! used by several tasks exclude each other like separate clients do.

pub mod admin;
mod conn;
pub mod error;
pub mod http;
pub mod lock;
pub mod watch;

use std::time::Duration;

pub use admin::AdminClient;
pub use conn::{is_traceparent, TlsConfig, TraceContext};
pub use error::ClientError;
pub use lock::{
    AdvancedClient, AutoRenewer, ClientBuilder, LeaderInfo, LeaderObserver, Leadership, LockHandle,
    LockSession, LossReason, PendingAcquire, RaftLockClient, SessionLock, SharedLock,
};
pub use watch::{Watch, WatchEvent};

/// How retryable failures are retried: exponential backoff with jitter, bounded in attempts
/// and in total time.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    pub min_delay: Duration,
    pub max_delay: Duration,
    pub factor: f32,
    pub max_attempts: usize,
    /// Give up once this much time has passed since the first attempt.
    pub max_elapsed: Duration,
    /// Each delay is multiplied by a random factor in `[1 - jitter_factor, 1 + jitter_factor]`,
    /// so clients that failed together do not retry together. 0 disables; at most 1.
    pub jitter_factor: f32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            min_delay: Duration::from_millis(20),
            max_delay: Duration::from_secs(1),
            factor: 2.0,
            max_attempts: 40,
            max_elapsed: Duration::from_secs(30),
            jitter_factor: 0.2,
        }
    }
}

impl RetryPolicy {
    /// No retries at all: the first failure is returned.
    pub fn none() -> Self {
        RetryPolicy {
            max_attempts: 0,
            ..Default::default()
        }
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.factor < 1.0 || !self.factor.is_finite() {
            return Err(format!("retry factor {} must be >= 1", self.factor));
        }
        if self.min_delay > self.max_delay {
            return Err("retry min_delay must not exceed max_delay".into());
        }
        if !(0.0..=1.0).contains(&self.jitter_factor) {
            return Err(format!(
                "retry jitter_factor {} must be within 0..=1",
                self.jitter_factor
            ));
        }
        Ok(())
    }

    pub(crate) fn builder(&self) -> backon::ExponentialBuilder {
        backon::ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(self.factor.max(1.0))
            .with_max_times(self.max_attempts)
    }

    /// `delay` scaled by a random factor in `[1 - jitter_factor, 1 + jitter_factor]`.
    pub(crate) fn jittered(&self, delay: Duration) -> Duration {
        let j = f64::from(self.jitter_factor.clamp(0.0, 1.0));
        if j == 0.0 {
            return delay;
        }
        // A uniform number in [0, 1) from 53 random bits.
        let unit = (random_u64() >> 11) as f64 / (1u64 << 53) as f64;
        delay.mul_f64(1.0 - j + 2.0 * j * unit)
    }
}

/// A value that differs between processes and calls (std's randomly keyed hasher, fed the
/// time), for client ids, request-id prefixes and jitter; not for anything secret.
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}
