//! Kept answers: one remembered outcome of a client request ([`DedupeRecord`]) in its compact
//! in-memory form, its stored and snapshot encoding, and the older layouts read back.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::super::command::{Command, FencingToken};
use super::super::outcome::Outcome;

/// A remembered answer as the table holds it in memory: the client id shared with its session,
/// the request id and the key in one boxed string, the answer without the key its token repeats
/// ([`KeptOutcome`]), the record itself boxed in the table's map (a map node of 11 slots is about
/// half full when numbers only grow, so a slot holds a pointer, not the record). 72 bytes and
/// two allocations fewer than the plain layout of 112; `raftlock-bench lock-memory` measures
/// what one costs. Encoded as [`RecordOut`] and decoded as [`RecordIn`]: the layout every
/// RaftLock version reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct DedupeRecord {
    pub(super) client_id: Arc<str>,
    /// The request id followed by the key of `op` (nothing after it when `op` is unknown).
    text: Box<str>,
    /// Where the request id ends in `text`.
    id_len: u32,
    /// What the request was: its command kind (the key is in `text`). A request id reused for
    /// another kind or key is refused instead of answered with this record. `None` in records
    /// written before this was kept.
    op_kind: Option<u8>,
    pub(super) outcome: KeptOutcome,
    /// Log clock when the outcome was recorded or last changed (queued → granted / cancelled).
    pub(super) at_ms: u64,
}

/// A recorded [`Outcome`] as the table keeps it: the answers it records without the key of
/// their token, which is the request's own (24 bytes instead of 48 and a string); any other
/// answer as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum KeptOutcome {
    Granted { token: u64, ttl_ms: u64 },
    Renewed { token: u64, ttl_ms: u64 },
    Queued { position: u32 },
    Released,
    WaitCancelled,
    Stored,
    Deleted { existed: bool },
    Other(Box<Outcome>),
}

impl DedupeRecord {
    pub(super) fn new(
        client_id: Arc<str>,
        request_id: &str,
        outcome: Outcome,
        op: Option<(u8, &str)>,
        at_ms: u64,
    ) -> Self {
        let key = op.map_or("", |(_, key)| key);
        let mut text = String::with_capacity(request_id.len() + key.len());
        text.push_str(request_id);
        text.push_str(key);
        let mut rec = DedupeRecord {
            client_id,
            text: text.into_boxed_str(),
            id_len: u32::try_from(request_id.len()).unwrap_or(u32::MAX),
            op_kind: op.map(|(kind, _)| kind),
            outcome: KeptOutcome::Released,
            at_ms,
        };
        if rec.id_len as usize != request_id.len() {
            // Beyond any request size limit; kept whole rather than cut.
            rec.text = request_id.into();
            rec.id_len = u32::MAX;
            rec.op_kind = None;
        }
        rec.set_outcome(outcome);
        rec
    }

    pub(super) fn request_id(&self) -> &str {
        if self.id_len == u32::MAX {
            return &self.text;
        }
        &self.text[..self.id_len as usize]
    }

    /// The command kind and key of the request, where known.
    pub(super) fn op(&self) -> Option<(u8, &str)> {
        let kind = self.op_kind?;
        Some((kind, &self.text[self.id_len as usize..]))
    }

    fn key(&self) -> Option<&str> {
        self.op().map(|(_, key)| key)
    }

    pub(super) fn is_queued(&self) -> bool {
        matches!(self.outcome, KeptOutcome::Queued { .. })
    }

    pub(super) fn outcome(&self) -> Outcome {
        let token = |value: u64| FencingToken {
            key: self.key().unwrap_or_default().to_string(),
            value,
        };
        match &self.outcome {
            KeptOutcome::Granted {
                token: value,
                ttl_ms,
            } => Outcome::Granted {
                token: token(*value),
                ttl_ms: *ttl_ms,
            },
            KeptOutcome::Renewed {
                token: value,
                ttl_ms,
            } => Outcome::Renewed {
                token: token(*value),
                ttl_ms: *ttl_ms,
            },
            KeptOutcome::Queued { position } => Outcome::Queued {
                position: *position,
            },
            KeptOutcome::Released => Outcome::Released,
            KeptOutcome::WaitCancelled => Outcome::WaitCancelled,
            KeptOutcome::Stored => Outcome::Stored,
            KeptOutcome::Deleted { existed } => Outcome::Deleted { existed: *existed },
            KeptOutcome::Other(outcome) => (**outcome).clone(),
        }
    }

    pub(super) fn set_outcome(&mut self, outcome: Outcome) {
        let own_key = |token: &FencingToken| self.key() == Some(token.key.as_str());
        self.outcome = match outcome {
            Outcome::Granted { token, ttl_ms } if own_key(&token) => KeptOutcome::Granted {
                token: token.value,
                ttl_ms,
            },
            Outcome::Renewed { token, ttl_ms } if own_key(&token) => KeptOutcome::Renewed {
                token: token.value,
                ttl_ms,
            },
            Outcome::Queued { position } => KeptOutcome::Queued { position },
            Outcome::Released => KeptOutcome::Released,
            Outcome::WaitCancelled => KeptOutcome::WaitCancelled,
            Outcome::Stored => KeptOutcome::Stored,
            Outcome::Deleted { existed } => KeptOutcome::Deleted { existed },
            other => KeptOutcome::Other(Box::new(other)),
        };
    }
}

/// A record as stored and as snapshots carry it (borrowed, for encoding).
#[derive(Serialize)]
struct RecordOut<'a> {
    client_id: &'a str,
    request_id: &'a str,
    outcome: &'a Outcome,
    op: Option<(u8, &'a str)>,
    at_ms: u64,
}

/// A record as stored and as snapshots carry it (owned, for decoding).
#[derive(Deserialize)]
struct RecordIn {
    client_id: String,
    request_id: String,
    outcome: Outcome,
    op: Option<(u8, String)>,
    at_ms: u64,
}

impl Serialize for DedupeRecord {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        RecordOut {
            client_id: &self.client_id,
            request_id: self.request_id(),
            outcome: &self.outcome(),
            op: self.op(),
            at_ms: self.at_ms,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for DedupeRecord {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        RecordIn::deserialize(deserializer).map(|r| {
            DedupeRecord::new(
                r.client_id.into(),
                &r.request_id,
                r.outcome,
                r.op.as_ref().map(|(kind, key)| (*kind, key.as_str())),
                r.at_ms,
            )
        })
    }
}

/// A dedupe record as written before records kept their time (read back only).
#[derive(Deserialize)]
pub(super) struct DedupeRecordV2 {
    pub(super) client_id: String,
    pub(super) request_id: String,
    pub(super) outcome: Outcome,
    pub(super) op: Option<(u8, String)>,
}

/// A dedupe record as written before records kept their operation (read back only).
#[derive(Deserialize)]
pub(super) struct DedupeRecordV1 {
    pub(super) client_id: String,
    pub(super) request_id: String,
    pub(super) outcome: Outcome,
}

/// Kind and key of a command, for [`DedupeRecord::op`].
pub(super) fn op_of(command: &Command) -> (u8, &str) {
    let kind = match command {
        Command::Acquire { .. } => 1,
        Command::Release { .. } | Command::ReleaseHeld { .. } => 2,
        Command::Renew { .. } => 3,
        Command::CancelWait { .. } => 4,
        Command::Put { .. } => 5,
        Command::Delete { .. } => 6,
        Command::SetLockDelay { .. } => 7,
        Command::Campaign { .. } => 8,
        Command::Proclaim { .. } => 9,
        Command::AcquireShared { .. } => 10,
        Command::SetPermits { .. } => 11,
        Command::Expire { .. }
        | Command::ExpireLease { .. }
        | Command::SetLimits { .. }
        | Command::SetLimitsV1 { .. }
        | Command::Tick { .. }
        | Command::SetClusterVersion { .. }
        | Command::SetClusterId { .. }
        | Command::SetMember { .. }
        | Command::SetQuotas { .. }
        | Command::EndLockDelay { .. }
        | Command::KeepAlive { .. }
        | Command::EndSession { .. }
        | Command::ExpireSession { .. } => 0,
        Command::Sequenced { command, .. } => return op_of(command),
    };
    (kind, command.key())
}
