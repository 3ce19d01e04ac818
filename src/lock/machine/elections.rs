//! Leader election (etcd's `concurrency.Election`, Curator's `LeaderLatch`) on the lock: an
//! election is a key whose lock holder is the leader. A candidate campaigns with the value it
//! will show once elected; candidates wait in the key's FIFO queue like acquires; the holder's
//! fencing token is the election's term, which a resource checks like any token.
//!
//! ```text
//!   Campaign{key, value} ──► acquire(key) ──► Granted: elect/<key>.value = value
//!                                        └──► Queued:  elect/<key>.candidates += (id, value)
//!   Release / expiry of the leader ──► next candidate granted, its campaign value shown
//!   Proclaim{key, token, value}    ──► elect/<key>.value = value (the holder of token only)
//! ```
//!
//! The `elect/<key>` record exists exactly while the key's lock entry does: it is created by
//! the first campaign and removed with the entry when no leader and no candidate is left. A key
//! is either an election or a plain lock while in use, never both.

use serde::{Deserialize, Serialize};

use super::super::command::FencingToken;
use super::super::outcome::{Event, Outcome, RejectCode};
use super::{LockStateMachine, ELECTION_PREFIX, ELECTION_VERSION};

/// One election: the leader's value and the campaign values of the candidates still queued.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Election {
    /// The value the leader shows (its campaign value, then what it proclaimed); `None` while
    /// no one leads.
    pub(super) value: Option<Vec<u8>>,
    /// Queued candidates' values, in queue order (as many as the key's waiters).
    pub(super) candidates: Vec<Candidate>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Candidate {
    pub(super) client_id: Box<str>,
    pub(super) request_id: Box<str>,
    pub(super) value: Vec<u8>,
}

/// Bytes an election's values count against the lock byte budget (`Quotas::lock_bytes_max`):
/// the leader's value and each waiting candidate's.
pub(super) fn election_cost(e: &Election) -> u64 {
    let leader = e.value.as_ref().map_or(0, |v| v.len() as u64);
    leader
        + e.candidates
            .iter()
            .map(|c| c.value.len() as u64)
            .sum::<u64>()
}

/// An election as callers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElectionInfo {
    pub key: String,
    /// The leader: its client id and term (fencing token value).
    pub leader: Option<(String, u64)>,
    /// The leader's value.
    pub value: Option<Vec<u8>>,
    /// Candidates waiting.
    pub candidates: usize,
}

impl LockStateMachine {
    /// The election `key`, if the key is one.
    pub fn election(&self, key: &str) -> Option<ElectionInfo> {
        let e = self.elections.get(key)?;
        let leader = self
            .locks
            .get(key)
            .and_then(|l| l.holder.as_ref())
            .map(|h| (h.client_id.to_string(), h.token));
        Some(ElectionInfo {
            key: key.to_string(),
            leader,
            value: e.value.clone(),
            candidates: e.candidates.len(),
        })
    }

    /// Keys that are elections now.
    pub fn election_count(&self) -> usize {
        self.elections.len()
    }

    /// Whether `key` is an election now.
    pub fn is_election(&self, key: &str) -> bool {
        self.elections.contains_key(key)
    }

    /// Bytes `key`'s election counts now (0: not an election).
    fn election_bytes(&self, key: &str) -> u64 {
        self.elections.get(key).map_or(0, election_cost)
    }

    /// `key`'s election counted `before` bytes; the budget's count follows what it counts now.
    fn reaccount(&mut self, key: &str, before: u64) {
        let after = self.election_bytes(key);
        self.lock_bytes = self.lock_bytes.saturating_sub(before) + after;
    }

    fn election_version_refusal(&self) -> Option<Outcome> {
        (self.cluster_version() < ELECTION_VERSION).then(|| {
            Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "elections need cluster version {ELECTION_VERSION} (this cluster runs {}): \
                     upgrade every member first",
                    self.cluster_version()
                ),
            )
        })
    }

    /// An `Acquire` of a key that is an election is refused: its holder would be taken for the
    /// election's leader.
    pub(super) fn refuse_acquire_of_election(&self, key: &str) -> Option<Outcome> {
        self.elections.contains_key(key).then(|| {
            Outcome::rejected(
                RejectCode::InvalidRequest,
                format!("{key:?} is an election: campaign to lead it, do not acquire it"),
            )
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn campaign(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
        value: &[u8],
        events: &mut Vec<Event>,
    ) -> Outcome {
        if let Some(refusal) = self.election_version_refusal() {
            return refusal;
        }
        if !self.elections.contains_key(key) && self.locks.contains_key(key) {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!("{key:?} is in use as a lock: an election needs a key of its own"),
            );
        }
        // The budget counts the value too, for as long as the candidate waits or leads.
        let value_bytes = value.len() as u64;
        if let Err(refusal) =
            self.check_lock_quotas(key, client_id, request_id, wait_timeout_ms, value_bytes)
        {
            return refusal;
        }
        let before = self.election_bytes(key);
        let outcome = self.acquire(key, client_id, request_id, ttl_ms, wait_timeout_ms);
        match &outcome {
            Outcome::Granted { token, .. } => {
                let value = value.to_vec();
                self.elections.entry(Box::from(key)).or_default().value = Some(value.clone());
                self.mark_dirty(ELECTION_PREFIX, key);
                events.push(Event::Proclaimed {
                    client_id: client_id.to_string(),
                    token: token.clone(),
                    value,
                });
            }
            Outcome::Queued { .. } => {
                let election = self.elections.entry(Box::from(key)).or_default();
                election.candidates.push(Candidate {
                    client_id: client_id.into(),
                    request_id: request_id.into(),
                    value: value.to_vec(),
                });
                self.mark_dirty(ELECTION_PREFIX, key);
            }
            _ => {}
        }
        self.reaccount(key, before);
        outcome
    }

    pub(super) fn proclaim(
        &mut self,
        key: &str,
        client_id: &str,
        token: u64,
        value: &[u8],
        events: &mut Vec<Event>,
    ) -> Outcome {
        if let Some(refusal) = self.election_version_refusal() {
            return refusal;
        }
        if !self.elections.contains_key(key) {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                format!("{key:?} is not an election (no one campaigns for it)"),
            );
        }
        if !self.bug(|b| b.proclaim_skips_holder_check) {
            if let Err(refusal) = self.check_holder(key, client_id, token) {
                return refusal;
            }
        }
        let before = self.election_bytes(key);
        let shown = self.elections.get(key).and_then(|e| e.value.as_ref());
        let grows = (value.len() as u64).saturating_sub(shown.map_or(0, |v| v.len() as u64));
        if let Some(q) = self.quotas.as_ref().filter(|_| grows > 0) {
            if self.lock_bytes + grows > q.lock_bytes_max {
                return super::quotas::limit_refusal(
                    "lock_bytes",
                    format!(
                        "held locks, queued acquires and election values would pass their \
                         budget of {} bytes",
                        q.lock_bytes_max
                    ),
                );
            }
        }
        let token = FencingToken {
            key: key.to_string(),
            value: token,
        };
        self.elections.entry(Box::from(key)).or_default().value = Some(value.to_vec());
        self.reaccount(key, before);
        self.mark_dirty(ELECTION_PREFIX, key);
        events.push(Event::Proclaimed {
            client_id: client_id.to_string(),
            token: token.clone(),
            value: value.to_vec(),
        });
        Outcome::Proclaimed { token }
    }

    /// Called once `key`'s lock changed hands by a hand-off (or was left without a holder):
    /// the holder now, a candidate just granted, shows its campaign value.
    pub(super) fn elect_next(&mut self, key: &str, events: &mut Vec<Event>) {
        if !self.elections.contains_key(key) {
            return;
        }
        let no_value_bug = self.bug(|b| b.elected_by_hand_off_without_value);
        let before = self.election_bytes(key);
        let holder = self
            .locks
            .get(key)
            .and_then(|e| e.holder.as_ref())
            .map(|h| (h.client_id.clone(), h.request_id.clone(), h.token));
        let Some(election) = self.elections.get_mut(key) else {
            return;
        };
        election.value = None;
        if let Some((client, request, token)) = holder {
            let at = election
                .candidates
                .iter()
                .position(|c| c.client_id == client && c.request_id == request);
            if let Some(at) = at {
                let value = election.candidates.remove(at).value;
                if !no_value_bug {
                    election.value = Some(value.clone());
                    events.push(Event::Proclaimed {
                        client_id: client.into(),
                        token: FencingToken {
                            key: key.to_string(),
                            value: token,
                        },
                        value,
                    });
                }
            }
        }
        self.reaccount(key, before);
        self.mark_dirty(ELECTION_PREFIX, key);
    }

    /// A queued candidate left without being elected (cancelled, timed out).
    pub(super) fn forget_candidate(&mut self, key: &str, client_id: &str, request_id: &str) {
        let before = self.election_bytes(key);
        let Some(election) = self.elections.get_mut(key) else {
            return;
        };
        election
            .candidates
            .retain(|c| !(*c.client_id == *client_id && *c.request_id == *request_id));
        self.reaccount(key, before);
        self.mark_dirty(ELECTION_PREFIX, key);
    }

    /// The key's lock entry is gone: so is the election.
    pub(super) fn end_election(&mut self, key: &str) {
        if let Some(gone) = self.elections.remove(key) {
            self.lock_bytes = self.lock_bytes.saturating_sub(election_cost(&gone));
            self.mark_dirty(ELECTION_PREFIX, key);
        }
    }
}
