//! Answers on their way out: what an applied command's outcome tells the client that proposed
//! it, waiters granted or dropped by someone else's command, and replayed answers from the
//! exactly-once table.

use super::api::{ApiError, ClientReply, ErrorCode, QueuedInfo, SharedGrant};
use super::{NodeCore, Observation, Pending, Waiting, MS};
use crate::lock::{Command, Event, Outcome, RejectCode};
use crate::storage::Storage;

impl<S: Storage, R> NodeCore<S, R> {
    /// Answers for other parties: waiters granted by a hand-off or removed from a queue.
    pub(super) fn on_events(&mut self, events: &[Event]) {
        for event in events {
            match event {
                Event::Granted {
                    client_id,
                    request_id,
                    token,
                    ttl_ms,
                } => self.answer_waiter(
                    client_id,
                    request_id,
                    ClientReply::Granted {
                        token: token.clone(),
                        expires_in_ms: *ttl_ms,
                        queued: None,
                        leader: self.sm.is_election(&token.key),
                        shared: None,
                    },
                ),
                Event::SharedGranted {
                    client_id,
                    request_id,
                    token,
                    ttl_ms,
                    mode,
                    slot,
                } => self.answer_waiter(
                    client_id,
                    request_id,
                    ClientReply::Granted {
                        token: token.clone(),
                        expires_in_ms: *ttl_ms,
                        queued: None,
                        leader: false,
                        shared: Some(SharedGrant {
                            mode: *mode,
                            slot: *slot,
                        }),
                    },
                ),
                Event::Expired { .. }
                | Event::LockDelayStarted { .. }
                | Event::LockDelayEnded { .. }
                | Event::Proclaimed { .. } => {}
                Event::WaiterRemoved {
                    client_id,
                    request_id,
                    ..
                } => self.answer_waiter(
                    client_id,
                    request_id,
                    ClientReply::error(
                        ErrorCode::WaitTimeout,
                        "the lock was not granted within the wait timeout",
                    ),
                ),
            }
        }
    }

    /// The waiter `(client_id, request_id)` left the queue: its deadline goes, and its client,
    /// if attached here, gets `reply`.
    fn answer_waiter(&mut self, client_id: &str, request_id: &str, reply: ClientReply) {
        let id = (client_id.to_string(), request_id.to_string());
        self.wait_deadlines.remove(&id);
        let Some(waiting) = self.waiting.remove(&id) else {
            return;
        };
        let reply = match reply {
            ClientReply::Granted {
                token,
                expires_in_ms,
                queued: None,
                leader,
                shared,
            } => ClientReply::Granted {
                token,
                expires_in_ms,
                leader,
                shared,
                queued: Some(QueuedInfo {
                    position: waiting.position,
                    waited_ms: self.now.saturating_sub(waiting.enqueued) / MS,
                }),
            },
            other => other,
        };
        if let Some(r) = waiting.reply {
            self.observe(Observation::Answered {
                op: "acquire",
                result: reply.result_label(),
            });
            self.reply(r, reply);
        }
    }

    /// A grant or renew answered again from the exactly-once table (a retry) must not hand out a
    /// hold that has since ended, nor a full TTL for a lease that started long ago: while the
    /// hold lasts, the answer carries the time left on this leader's lease; once it ended
    /// (expired, released, handed on), a retried acquire is told so (`STALE_TOKEN`) and a
    /// retried renew gets 0 ms left.
    pub(super) fn replayed_outcome(&self, outcome: Outcome) -> Result<Outcome, ClientReply> {
        let (token, ttl_ms, renewed, shared) = match outcome {
            Outcome::Granted { token, ttl_ms } => (token, ttl_ms, false, None),
            Outcome::SharedGranted {
                token,
                ttl_ms,
                mode,
                slot,
            } => (token, ttl_ms, false, Some((mode, slot))),
            Outcome::Renewed { token, ttl_ms } => (token, ttl_ms, true, None),
            other => return Ok(other),
        };
        // The token's holder now: the plain lock's, or on a shared lock the token itself while
        // it holds (another holder's token is not this one's "current").
        let holder = match self.sm.shared_lock(&token.key) {
            Some(lock) => lock
                .holders
                .iter()
                .find(|h| h.token == token.value)
                .map(|h| h.token),
            None => self.sm.holder(&token.key).map(|h| h.token),
        };
        if renewed && holder != Some(token.value) {
            // The renew applied, and the hold has ended since: nothing is left of it.
            return Ok(Outcome::Renewed { token, ttl_ms: 0 });
        }
        if holder != Some(token.value) {
            return Err(ClientReply::error(
                ErrorCode::StaleToken,
                format!(
                    "this request was answered before with token {} for {:?}, but that hold has \
                     ended (expired, released or handed on; the current token is {}); acquire \
                     again with a new request id",
                    token.value,
                    token.key,
                    holder.map_or("none (the lock is free)".to_string(), |h| h.to_string())
                ),
            ));
        }
        let left_ms = self
            .lease_of(&token.key, token.value)
            .map_or(ttl_ms, |l| l.deadline.saturating_sub(self.now) / MS)
            .min(ttl_ms);
        if let Some((mode, slot)) = shared {
            return Ok(Outcome::SharedGranted {
                token,
                ttl_ms: left_ms,
                mode,
                slot,
            });
        }
        Ok(if renewed {
            Outcome::Renewed {
                token,
                ttl_ms: left_ms,
            }
        } else {
            Outcome::Granted {
                token,
                ttl_ms: left_ms,
            }
        })
    }

    pub(super) fn answer(&mut self, command: &Command, outcome: Outcome, mut pending: Pending<R>) {
        let reply = match outcome {
            Outcome::Granted { token, ttl_ms } => ClientReply::Granted {
                leader: matches!(command.request(), Command::Campaign { .. }),
                token,
                expires_in_ms: ttl_ms,
                queued: None,
                shared: None,
            },
            Outcome::SharedGranted {
                token,
                ttl_ms,
                mode,
                slot,
            } => ClientReply::Granted {
                leader: false,
                token,
                expires_in_ms: ttl_ms,
                queued: None,
                shared: Some(SharedGrant { mode, slot }),
            },
            Outcome::PermitsSet { permits } => ClientReply::PermitsSet { permits },
            Outcome::AlreadyHeld { token, .. } => {
                let mut err = ApiError::new(
                    ErrorCode::AlreadyHeld,
                    format!(
                        "this client already holds {:?} with token {} under another request id; \
                         locks are not re-entrant",
                        token.key, token.value
                    ),
                );
                err.current_token = Some(token.value);
                ClientReply::Error(err)
            }
            Outcome::Queued { position } | Outcome::AlreadyQueued { position } => {
                let Some(crate::lock::AcquireParts {
                    key,
                    client_id,
                    request_id,
                    ..
                }) = command.as_acquire()
                else {
                    return;
                };
                let id = (client_id.clone(), request_id.clone());
                let Some(waiter) = self.sm.waiter(key, client_id, request_id) else {
                    // Queued under another request id (AlreadyQueued): nothing to wait on here.
                    let reply = ClientReply::error(
                        ErrorCode::InvalidRequest,
                        format!("this client already waits for {key:?} under another request id"),
                    );
                    if let Some(r) = pending.reply.take() {
                        self.reply(r, reply);
                    }
                    return;
                };
                if let Some(r) = pending.reply.take() {
                    if waiter.wait_timeout_ms.is_none() && self.raft.is_leader() {
                        // The client is here again: no reclaim while it waits.
                        self.wait_deadlines.remove(&id);
                    }
                    self.waiting.insert(
                        id,
                        Waiting {
                            key: key.clone(),
                            reply: Some(r),
                            conn: pending.conn,
                            enqueued: pending.started,
                            position,
                        },
                    );
                }
                return;
            }
            Outcome::Busy => ClientReply::error(
                ErrorCode::WaitTimeout,
                "the lock is held and the request asked not to wait",
            ),
            Outcome::Released => ClientReply::Released,
            Outcome::Renewed { token, ttl_ms } => ClientReply::Renewed {
                leader: self.sm.is_election(&token.key),
                shared: self.shared_grant_of(&token),
                token,
                expires_in_ms: ttl_ms,
            },
            Outcome::NotHolder => {
                ClientReply::error(ErrorCode::NotHolder, "the client does not hold this lock")
            }
            Outcome::StaleToken { current } => ClientReply::error(
                ErrorCode::StaleToken,
                match current {
                    Some(c) => format!("stale fencing token; the current token is {c}"),
                    None => "stale fencing token; the lock is not held".to_string(),
                },
            ),
            Outcome::WaitCancelled => ClientReply::WaitCancelled,
            Outcome::NotWaiting => {
                ClientReply::error(ErrorCode::NotWaiting, "no such waiting request")
            }
            Outcome::Expired { .. } | Outcome::LeaseRenewed { .. } | Outcome::LockDelayEnded => {
                return
            }
            Outcome::LockDelaySet { delay_ms } => ClientReply::LockDelaySet { delay_ms },
            Outcome::Proclaimed { token } => ClientReply::Proclaimed { token },
            Outcome::SessionKept { session, ttl_ms } => ClientReply::SessionKept {
                session,
                expires_in_ms: ttl_ms,
            },
            Outcome::SessionEnded { locks } => ClientReply::SessionEnded { locks },
            Outcome::NoSession => ClientReply::error(
                ErrorCode::NoSession,
                "the client has no such session: it ended (closed, or its lease expired) and \
                 every lock attached to it is gone; open a new session",
            ),
            Outcome::Stored => ClientReply::Stored,
            Outcome::Deleted { existed } => ClientReply::Deleted { existed },
            Outcome::GuardRejected { current } => ClientReply::error(
                ErrorCode::StaleToken,
                format!(
                    "guarded write refused: the token no longer holds the lock (current {current:?})"
                ),
            ),
            Outcome::Rejected { code, message } => {
                if matches!(code, RejectCode::QueueFull | RejectCode::LimitReached) {
                    let limit = match code {
                        RejectCode::QueueFull => "waiters_per_key",
                        _ => super::observations::limit_named(&message),
                    };
                    self.observe(Observation::LimitRefused {
                        limit: limit.to_string(),
                    });
                }
                let code = match code {
                    RejectCode::RequestIdReused => ErrorCode::RequestIdReused,
                    RejectCode::Acknowledged => ErrorCode::Acknowledged,
                    RejectCode::TooLarge => ErrorCode::TooLarge,
                    RejectCode::QueueFull | RejectCode::LimitReached => ErrorCode::Busy,
                    RejectCode::InvalidRequest | RejectCode::AlreadyApplied => {
                        ErrorCode::InvalidRequest
                    }
                };
                ClientReply::error(code, message)
            }
        };
        self.send_answer(pending, reply);
    }

    /// The mode and slot `token` holds its read-write lock or semaphore in (`None`: a plain
    /// lock's token, or one that no longer holds).
    fn shared_grant_of(&self, token: &crate::lock::FencingToken) -> Option<SharedGrant> {
        let lock = self.sm.shared_lock(&token.key)?;
        let h = lock.holders.iter().find(|h| h.token == token.value)?;
        Some(SharedGrant {
            mode: h.mode,
            slot: h.slot,
        })
    }

    pub(super) fn send_answer(&mut self, mut pending: Pending<R>, reply: ClientReply) {
        self.observe(Observation::Answered {
            op: pending.op,
            result: reply.result_label(),
        });
        if let Some(r) = pending.reply.take() {
            self.reply(r, reply);
        }
    }
}
