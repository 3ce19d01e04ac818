//! The SDK's typed errors.

use std::time::Duration;

/// What can go wrong in a client call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The builder was given something unusable (no endpoints, an empty client id, …).
    #[error("invalid client configuration: {0}")]
    Config(String),
    /// The cluster refused the request for a reason retrying will not change.
    #[error("{code}: {message}")]
    Rejected { code: String, message: String },
    /// The lock was not granted within the wait timeout.
    #[error("the lock on {key:?} was not granted within the wait timeout")]
    WaitTimeout { key: String },
    /// The request could not be completed in the time or attempts the retry policy allows
    /// (no leader, unreachable nodes, lost connections). `last` is the last failure seen.
    #[error("gave up after {attempts} attempts over {elapsed:?}: {last}")]
    Unavailable {
        attempts: u32,
        elapsed: Duration,
        last: String,
    },
    /// The lock is no longer held: it expired, was released, or a newer holder exists.
    #[error("lock on {key:?} lost: {reason}")]
    LockLost { key: String, reason: String },
    /// The server answered something this client cannot understand.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl ClientError {
    /// The server's error code (`NOT_HOLDER`, `STALE_TOKEN`, …) when the server refused.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Rejected { code, .. } => Some(code),
            ClientError::WaitTimeout { .. } => Some("WAIT_TIMEOUT"),
            _ => None,
        }
    }

    /// True when the lock named in the request is not (or no longer) held by this client.
    pub fn is_not_holder(&self) -> bool {
        matches!(self.code(), Some("NOT_HOLDER" | "STALE_TOKEN"))
            || matches!(self, ClientError::LockLost { .. })
    }
}

/// Error codes after which the same request may be sent again (to the leader, after a pause).
pub(crate) fn is_retryable_code(code: &str) -> bool {
    matches!(code, "NOT_LEADER" | "NO_LEADER" | "UNAVAILABLE" | "BUSY")
}
