//! Acknowledgements ([`Command::Sequenced`]): a client's mark below which it has every answer,
//! what a sequenced request checks before it applies, and forgetting the acknowledged answers.

use std::sync::Arc;

use super::super::command::Command;
use super::super::limits::identity_of;
use super::super::outcome::{Outcome, RejectCode};
use super::{LockStateMachine, SEQUENCED_VERSION};

/// A session's answers looked at, at most, when an acknowledgement forgets those below its mark
/// (oldest first; answers not forgotten then go by age like any other).
const ACK_SCAN_MAX: usize = 256;

impl LockStateMachine {
    /// What a [`Command::Sequenced`] does before its request applies. The request must be an
    /// answered-once client request numbered by its id, at or above `ack_below`. One numbered
    /// below its session's mark whose answer is no longer kept is refused: the client had its
    /// answer and said so, so this is a delayed copy, never new work. Otherwise the mark rises to
    /// `ack_below` and the session's answers numbered below it are forgotten; that stands even
    /// when the request itself is then refused (a full table is what acknowledgements relieve).
    /// Every refusal here changes nothing.
    pub(super) fn acknowledge(&mut self, ack_below: u64, command: &Command) -> Result<(), Outcome> {
        let version = self.cluster_version();
        if version < SEQUENCED_VERSION {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "acknowledging answers needs cluster version {SEQUENCED_VERSION}; this \
                     cluster runs version {version}"
                ),
            ));
        }
        let ids = match command {
            Command::Sequenced { .. } | Command::CancelWait { .. } => None,
            other => other.dedupe_id(),
        };
        let Some((client, request)) = ids else {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                "only acquires, releases, renewals, puts and deletes with a client id and a \
                 request id acknowledge answers",
            ));
        };
        let Some(seq) = sequence_number(request) else {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "request id {request:?} is not a sequence number: a request that \
                     acknowledges answers (ackBelow) is numbered by its request id, in decimal \
                     from 1"
                ),
            ));
        };
        if ack_below > seq {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "ackBelow {ack_below} is above the request's own number {seq}: a request \
                     still waiting for its answer cannot be acknowledged"
                ),
            ));
        }
        self.validate(command)?;
        if self.limits.dedupe_entries_max == 0 || self.record_number(client, request).is_some() {
            // No table to relieve, or a retry the table answers as it stands.
            return Ok(());
        }
        self.check_session(command)?;
        let mark = self.sessions.get(client).map_or(0, |s| s.mark);
        if seq < mark {
            return Err(Outcome::rejected(
                RejectCode::Acknowledged,
                format!(
                    "request {seq} of client {client:?} was answered and acknowledged (the \
                     client has every answer below {mark}), and its answer is no longer kept; \
                     it is not run again"
                ),
            ));
        }
        if ack_below > mark {
            self.raise_mark(client, ack_below);
        }
        Ok(())
    }

    /// Raises `client_id`'s mark to `mark` (opening its session if there is room for one) and
    /// forgets the session's finished answers numbered below it, looking at its oldest
    /// [`ACK_SCAN_MAX`] answers.
    fn raise_mark(&mut self, client_id: &str, mark: u64) {
        let client: Arc<str> = match self.sessions.get_key_value(client_id) {
            Some((client, _)) => client.clone(),
            None if self.sessions.len() >= self.limits.sessions_max => return,
            None if self.quotas.as_ref().is_some_and(|q| {
                q.by_identity
                    && self.identity_sessions(identity_of(client_id), q.identity_sessions_max)
                        >= q.identity_sessions_max
            }) =>
            {
                return
            }
            None => client_id.into(),
        };
        let clock = self.clock_ms;
        let session = self.sessions.entry(client.clone()).or_default();
        session.mark = mark;
        session.mark_at_ms = clock;
        let dedupe = &self.dedupe;
        let below: Vec<u64> = session
            .records
            .iter()
            .filter_map(|n| dedupe.get(&n).map(|rec| (n, rec)))
            .take(ACK_SCAN_MAX)
            .filter(|(_, rec)| {
                !rec.is_queued() && sequence_number(rec.request_id()).is_some_and(|s| s < mark)
            })
            .map(|(n, _)| n)
            .collect();
        self.dirty_acks.insert(client);
        for n in below {
            self.remove_record(n);
        }
    }
}

/// The sequence number a request id names ([`Command::Sequenced`]): decimal digits without a
/// leading zero, from 1 to `u64::MAX`.
pub fn sequence_number(request_id: &str) -> Option<u64> {
    let digits = request_id.as_bytes();
    if digits.first().is_none_or(|&d| d == b'0') || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    request_id.parse().ok()
}
