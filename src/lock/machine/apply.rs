//! Applying a committed command: the dispatch of [`LockStateMachine::apply`], the cluster
//! commands handled in place (version, identity, members), the exactly-once replay of a retried
//! request, and the validation of a request's sizes and fields against the limits.

use super::super::command::{Command, FencingToken, LockMode};
use super::super::limits::Limits;
use super::super::outcome::{Applied, Event, Outcome, RejectCode};
use super::records::op_of;
use super::{
    ClusterIdentity, LockStateMachine, DIRTY_APPLIED, DIRTY_CLUSTER, DIRTY_CLUSTER_VERSION,
    DIRTY_MEMBERS, MEMBERS_MAX, MEMBER_ADDR_MAX, SESSION_VERSION,
};

impl LockStateMachine {
    /// Applies the command committed at `index`. Deterministic; never panics; an outcome other
    /// than a *recorded* one changed nothing but the applied index.
    pub fn apply(&mut self, index: u64, command: &Command) -> Applied {
        if index <= self.applied_index {
            let outcome = Outcome::rejected(
                RejectCode::AlreadyApplied,
                format!(
                    "index {index} is not above the applied index {}",
                    self.applied_index
                ),
            );
            return Applied {
                index,
                outcome,
                events: Vec::new(),
                replayed: false,
            };
        }
        self.applied_index = index;
        self.dirty_meta |= DIRTY_APPLIED;
        let mut events = Vec::new();
        let mut replayed = false;
        let outcome = self.apply_inner(command, &mut events, &mut replayed);
        Applied {
            index,
            outcome,
            events,
            replayed,
        }
    }

    fn apply_inner(
        &mut self,
        command: &Command,
        events: &mut Vec<Event>,
        replayed: &mut bool,
    ) -> Outcome {
        match command {
            Command::SetLimits { limits } => return self.set_replicated_limits(limits),
            Command::SetLimitsV1 { limits } => {
                return self.set_replicated_limits(&limits.clone().into())
            }
            Command::Tick { elapsed_ms } => return self.tick(*elapsed_ms),
            Command::SetClusterVersion { version } => {
                if *version > self.cluster_version() {
                    self.cluster_version = *version;
                    self.dirty_meta |= DIRTY_CLUSTER_VERSION;
                }
                return Outcome::Stored;
            }
            Command::SetClusterId { id, forced_by } => {
                if self.cluster.is_none() && *id != 0 {
                    self.cluster = Some(ClusterIdentity {
                        id: *id,
                        forced_by: forced_by.chars().take(MEMBER_ADDR_MAX).collect(),
                    });
                    self.dirty_meta |= DIRTY_CLUSTER;
                }
                return Outcome::Stored;
            }
            Command::SetQuotas { quotas } => return self.set_quotas(quotas),
            Command::KeepAlive {
                client_id,
                session,
                ttl_ms,
            } => return self.keep_alive(client_id, *session, *ttl_ms),
            Command::EndSession { client_id, session } => {
                return self.close_session(client_id, *session, events)
            }
            Command::ExpireSession {
                client_id,
                session,
                lease_index,
            } => return self.expire_session(client_id, *session, *lease_index, events),
            Command::SetMember { id, info } => {
                match info {
                    None => {
                        if self.members.remove(id).is_some() {
                            self.dirty_meta |= DIRTY_MEMBERS;
                        }
                    }
                    Some(info)
                        if *id != 0
                            && info.peer_addr.len() <= MEMBER_ADDR_MAX
                            && info.client_addr.len() <= MEMBER_ADDR_MAX
                            && (self.members.len() < MEMBERS_MAX
                                || self.members.contains_key(id)) =>
                    {
                        if self.members.get(id) != Some(info) {
                            self.members.insert(*id, info.clone());
                            self.dirty_meta |= DIRTY_MEMBERS;
                        }
                    }
                    // Every replica refuses the same entries (the bounds are constants).
                    Some(_) => {}
                }
                return Outcome::Stored;
            }
            Command::Sequenced {
                ack_below,
                command: inner,
            } => {
                if let Err(refusal) = self.acknowledge(*ack_below, inner) {
                    return refusal;
                }
                let outcome = self.apply_inner(inner, events, replayed);
                // An acknowledging request is answered once: its answer is kept even when it
                // changed nothing (a lock found held, a stale token), or a copy delivered after
                // that answer could act where the answer said nothing happened — a grant to a
                // client told it was not granted. Its client's acknowledgement removes it.
                // Refusals of bad input or of a full table are not kept: a retry is judged
                // again.
                // The plain request recorded what `is_recorded` keeps; the rest is kept here.
                if !*replayed && !outcome.is_recorded() && outcome.is_remembered_for(command) {
                    if let Some((client, request)) = inner.dedupe_id() {
                        self.record(client, request, outcome.clone(), op_of(inner));
                    }
                }
                return outcome;
            }
            _ => {}
        }
        if let Err(rejection) = self.validate(command) {
            return rejection;
        }
        // Exactly-once: a retried request gets its original outcome back (dissertation §6.3).
        if let Some((client, request)) = command.dedupe_id() {
            if let Some(n) = self.record_number(client, request) {
                let record = &self.dedupe[&n];
                if record.op().is_some_and(|op| op != op_of(command)) {
                    return Outcome::rejected(
                        RejectCode::RequestIdReused,
                        format!(
                            "request id {request:?} of client {client:?} was used for another \
                             operation or key; use a new request id"
                        ),
                    );
                }
                let recorded = record.outcome();
                *replayed = true;
                return match recorded {
                    Outcome::Queued { .. } => {
                        // Still waiting: answer with the current position.
                        let position = self.position_of(command.key(), client, request);
                        position.map_or(recorded, |p| Outcome::Queued { position: p })
                    }
                    other => other,
                };
            }
            if let Err(refusal) = self.check_session(command) {
                return refusal;
            }
            if let Err(refusal) = self.make_room(client) {
                return refusal;
            }
        } else if let Err(refusal) = self.check_session(command) {
            return refusal;
        }
        let outcome = match command {
            Command::Acquire {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
            } => match self
                .refuse_acquire_of_election(key)
                .or_else(|| self.refuse_exclusive_of_shared(key))
            {
                Some(refusal) => refusal,
                None => self.acquire(key, client_id, request_id, *ttl_ms, *wait_timeout_ms),
            },
            Command::AcquireShared {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                mode,
                permits,
            } => self.acquire_shared(
                key,
                client_id,
                request_id,
                *ttl_ms,
                *wait_timeout_ms,
                *mode,
                *permits,
            ),
            Command::SetPermits { key, permits, .. } => self.set_permits(key, *permits, events),
            Command::Campaign { key, .. } if self.is_shared(key) => self
                .refuse_exclusive_of_shared(key)
                .unwrap_or(Outcome::NotHolder),
            Command::Release {
                key,
                client_id,
                token,
                ..
            } if self.is_shared(key) => self.release_shared(key, client_id, token.value, events),
            Command::Renew {
                key,
                client_id,
                token,
                ttl_ms,
                ..
            } if self.is_shared(key) => self.renew_shared(key, client_id, token.value, *ttl_ms),
            Command::CancelWait {
                key,
                client_id,
                request_id,
            } if self.is_shared(key) => self.cancel_shared_wait(key, client_id, request_id, events),
            Command::ReleaseHeld { key, client_id, .. } if self.is_shared(key) => {
                self.release_shared_held(key, client_id, events)
            }
            Command::Expire { key, token } if self.is_shared(key) => {
                self.expire_shared(key, *token, None, events)
            }
            Command::ExpireLease {
                key,
                token,
                lease_index,
            } if self.is_shared(key) => self.expire_shared(key, *token, Some(*lease_index), events),
            Command::Campaign {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                value,
            } => self.campaign(
                key,
                client_id,
                request_id,
                *ttl_ms,
                *wait_timeout_ms,
                value,
                events,
            ),
            Command::Proclaim {
                key,
                client_id,
                token,
                value,
                ..
            } => self.proclaim(key, client_id, token.value, value, events),
            Command::Release {
                key,
                client_id,
                token,
                ..
            } => self.release(key, client_id, token.value, events),
            Command::Renew {
                key,
                client_id,
                token,
                ttl_ms,
                ..
            } => self.renew(key, client_id, token.value, *ttl_ms),
            Command::CancelWait {
                key,
                client_id,
                request_id,
            } => self.cancel_wait(key, client_id, request_id, events),
            Command::Put {
                key, value, guard, ..
            } => self.put(key, value, guard.as_ref()),
            Command::Delete { key, guard, .. } => self.delete(key, guard.as_ref()),
            Command::SetLimits { .. }
            | Command::SetLimitsV1 { .. }
            | Command::Tick { .. }
            | Command::SetClusterVersion { .. }
            | Command::SetClusterId { .. }
            | Command::SetMember { .. }
            | Command::SetQuotas { .. }
            | Command::KeepAlive { .. }
            | Command::EndSession { .. }
            | Command::ExpireSession { .. }
            | Command::Sequenced { .. } => {
                Outcome::rejected(RejectCode::InvalidRequest, "unreachable")
            }
            Command::ReleaseHeld { key, client_id, .. } => {
                match self.locks.get(key.as_str()).and_then(|e| e.holder.as_ref()) {
                    Some(h) if *h.client_id == **client_id => {
                        self.vacate(key, events);
                        Outcome::Released
                    }
                    Some(_) => Outcome::NotHolder,
                    None => Outcome::StaleToken { current: None },
                }
            }
            Command::Expire { key, token } => self.expire(key, *token, None, events),
            Command::ExpireLease {
                key,
                token,
                lease_index,
            } => self.expire(key, *token, Some(*lease_index), events),
            Command::SetLockDelay { key, delay_ms, .. } => self.set_lock_delay(key, *delay_ms),
            Command::EndLockDelay { key, token } => self.end_lock_delay(key, *token, events),
        };
        if outcome.is_recorded() {
            if let Some((client, request)) = command.dedupe_id() {
                self.record(client, request, outcome.clone(), op_of(command));
            }
        }
        outcome
    }

    pub(super) fn validate(&self, command: &Command) -> Result<(), Outcome> {
        let l = &self.limits;
        let key = command.key();
        if key.is_empty() {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                "key must not be empty",
            ));
        }
        if key.len() > l.key_bytes_max {
            return Err(Outcome::rejected(
                RejectCode::TooLarge,
                format!(
                    "key is {} bytes; the limit is {}",
                    key.len(),
                    l.key_bytes_max
                ),
            ));
        }
        let ids: &[&str] = match command {
            Command::Acquire {
                client_id,
                request_id,
                ..
            }
            | Command::Release {
                client_id,
                request_id,
                ..
            }
            | Command::ReleaseHeld {
                client_id,
                request_id,
                ..
            }
            | Command::Renew {
                client_id,
                request_id,
                ..
            }
            | Command::CancelWait {
                client_id,
                request_id,
                ..
            }
            | Command::Put {
                client_id,
                request_id,
                ..
            }
            | Command::Delete {
                client_id,
                request_id,
                ..
            }
            | Command::SetLockDelay {
                client_id,
                request_id,
                ..
            }
            | Command::Campaign {
                client_id,
                request_id,
                ..
            }
            | Command::Proclaim {
                client_id,
                request_id,
                ..
            }
            | Command::AcquireShared {
                client_id,
                request_id,
                ..
            }
            | Command::SetPermits {
                client_id,
                request_id,
                ..
            } => &[client_id, request_id],
            Command::Expire { .. }
            | Command::EndLockDelay { .. }
            | Command::ExpireLease { .. }
            | Command::SetLimits { .. }
            | Command::SetLimitsV1 { .. }
            | Command::Tick { .. }
            | Command::SetClusterVersion { .. }
            | Command::SetClusterId { .. }
            | Command::SetMember { .. }
            | Command::SetQuotas { .. }
            | Command::KeepAlive { .. }
            | Command::EndSession { .. }
            | Command::ExpireSession { .. }
            | Command::Sequenced { .. } => &[],
        };
        if ids.iter().any(|id| id.len() > l.id_bytes_max) {
            return Err(Outcome::rejected(
                RejectCode::TooLarge,
                format!(
                    "client and request ids are limited to {} bytes",
                    l.id_bytes_max
                ),
            ));
        }
        match command {
            Command::Acquire {
                client_id,
                ttl_ms,
                wait_timeout_ms,
                ..
            }
            | Command::Campaign {
                client_id,
                ttl_ms,
                wait_timeout_ms,
                ..
            } => {
                if let Command::Campaign { value, .. } = command {
                    check_value(value, l)?;
                }
                if client_id.is_empty() {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        "clientId is required",
                    ));
                }
                self.check_lease_ttl(*ttl_ms)?;
                if wait_timeout_ms.is_some_and(|w| w > l.wait_timeout_ms_max) {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        format!("wait timeout is limited to {} ms", l.wait_timeout_ms_max),
                    ));
                }
            }
            Command::AcquireShared {
                client_id,
                ttl_ms,
                wait_timeout_ms,
                mode,
                permits,
                ..
            } => {
                if client_id.is_empty() {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        "clientId is required",
                    ));
                }
                self.check_lease_ttl(*ttl_ms)?;
                if wait_timeout_ms.is_some_and(|w| w > l.wait_timeout_ms_max) {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        format!("wait timeout is limited to {} ms", l.wait_timeout_ms_max),
                    ));
                }
                match mode {
                    LockMode::Permit if *permits == 0 => {
                        return Err(Outcome::rejected(
                            RejectCode::InvalidRequest,
                            "a permit names the semaphore's size: permits must be 1 or more",
                        ))
                    }
                    LockMode::Permit if *permits as usize > l.waiters_per_key_max => {
                        return Err(Outcome::rejected(
                            RejectCode::InvalidRequest,
                            format!("a semaphore has at most {} permits", l.waiters_per_key_max),
                        ))
                    }
                    LockMode::Read | LockMode::Write if *permits != 0 => {
                        return Err(Outcome::rejected(
                            RejectCode::InvalidRequest,
                            "permits is for semaphores: a read or write lock takes none",
                        ))
                    }
                    _ => {}
                }
            }
            Command::SetPermits { client_id, .. } => {
                if client_id.is_empty() {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        "clientId is required",
                    ));
                }
            }
            Command::Renew { ttl_ms, token, .. } => {
                self.check_lease_ttl(*ttl_ms)?;
                check_token_key(token, key)?;
            }
            Command::Release { token, .. } => check_token_key(token, key)?,
            Command::Put { value, guard, .. } => {
                check_value(value, l)?;
                check_guard(guard.as_ref(), l)?;
            }
            Command::Proclaim {
                client_id,
                token,
                value,
                ..
            } => {
                if client_id.is_empty() {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        "clientId is required",
                    ));
                }
                check_value(value, l)?;
                check_token_key(token, key)?;
            }
            Command::Delete { guard, .. } => check_guard(guard.as_ref(), l)?,
            Command::SetLockDelay { client_id, .. } => {
                if client_id.is_empty() {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        "clientId is required",
                    ));
                }
            }
            Command::CancelWait { .. }
            | Command::EndLockDelay { .. }
            | Command::ReleaseHeld { .. }
            | Command::Expire { .. }
            | Command::ExpireLease { .. }
            | Command::SetLimits { .. }
            | Command::SetLimitsV1 { .. }
            | Command::Tick { .. }
            | Command::SetClusterVersion { .. }
            | Command::SetClusterId { .. }
            | Command::SetMember { .. }
            | Command::SetQuotas { .. }
            | Command::KeepAlive { .. }
            | Command::EndSession { .. }
            | Command::ExpireSession { .. }
            | Command::Sequenced { .. } => {}
        }
        Ok(())
    }
}

impl LockStateMachine {
    /// A lease of `ttl_ms`, or (0) the lease of the client's session, whose being open is
    /// checked after the exactly-once table ([`LockStateMachine::check_session`]).
    fn check_lease_ttl(&self, ttl_ms: u64) -> Result<(), Outcome> {
        if ttl_ms == 0 && self.cluster_version() >= SESSION_VERSION {
            return Ok(());
        }
        check_ttl(ttl_ms, &self.limits)
    }

    /// A lock attached to its client's session (a ttl of 0) needs the session open. Checked
    /// after the exactly-once table: an attached acquire that was applied, retried once its
    /// session has ended, gets its outcome back, not a refusal that says it never happened
    /// (simulator seed 867, 5 nodes, client sessions).
    pub(super) fn check_session(&self, command: &Command) -> Result<(), Outcome> {
        let (Command::Acquire {
            client_id, ttl_ms, ..
        }
        | Command::Campaign {
            client_id, ttl_ms, ..
        }
        | Command::AcquireShared {
            client_id, ttl_ms, ..
        }
        | Command::Renew {
            client_id, ttl_ms, ..
        }) = command
        else {
            return Ok(());
        };
        if *ttl_ms != 0 || self.cluster_version() < SESSION_VERSION || self.has_session(client_id) {
            return Ok(());
        }
        Err(Outcome::rejected(
            RejectCode::InvalidRequest,
            format!(
                "a ttl of 0 attaches the lock to the client's session, and client \
                 {client_id:?} has none open: keep one alive first"
            ),
        ))
    }
}

fn check_ttl(ttl_ms: u64, l: &Limits) -> Result<(), Outcome> {
    if ttl_ms == 0 || ttl_ms > l.ttl_ms_max {
        return Err(Outcome::rejected(
            RejectCode::InvalidRequest,
            format!("ttl must be 1..={} ms", l.ttl_ms_max),
        ));
    }
    Ok(())
}

fn check_value(value: &[u8], l: &Limits) -> Result<(), Outcome> {
    if value.len() > l.value_bytes_max {
        return Err(Outcome::rejected(
            RejectCode::TooLarge,
            format!(
                "value is {} bytes; the limit is {}",
                value.len(),
                l.value_bytes_max
            ),
        ));
    }
    Ok(())
}

fn check_token_key(token: &FencingToken, key: &str) -> Result<(), Outcome> {
    if token.key != key {
        return Err(Outcome::rejected(
            RejectCode::InvalidRequest,
            format!("the fencing token is for key {:?}, not {key:?}", token.key),
        ));
    }
    Ok(())
}

fn check_guard(guard: Option<&FencingToken>, l: &Limits) -> Result<(), Outcome> {
    match guard {
        Some(g) if g.key.is_empty() || g.key.len() > l.key_bytes_max => Err(Outcome::rejected(
            RejectCode::InvalidRequest,
            "the guard token's key is empty or too long",
        )),
        _ => Ok(()),
    }
}
