//! Tests of the lock state machine: a model-based test against a small reference model, with
//! snapshot/restore and restarts mixed in; determinism (same log, same bytes; restore from a
//! snapshot at every index); and one targeted test per guarantee docs/guarantees.md states.
//!
//! Randomness comes from a seeded splitmix64 so every failure names its seed and replays exactly.

use std::collections::{BTreeMap, VecDeque};

use super::command::{Command, FencingToken};
use super::limits::Limits;
use super::machine::LockStateMachine;
use super::outcome::{Event, Outcome, RejectCode};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

// ----- the reference model -----------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
struct MHolder {
    client: String,
    token: u64,
    ttl: u64,
    /// Index of the grant or the latest renew.
    since: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct MWaiter {
    client: String,
    request: String,
    ttl: u64,
}

/// The lock rules (docs/guarantees.md) written as plainly as possible,
/// independently of `machine.rs`.
#[derive(Clone, Debug, Default)]
struct Model {
    limits: Limits,
    seq: u64,
    holders: BTreeMap<String, MHolder>,
    queues: BTreeMap<String, VecDeque<MWaiter>>,
    data: BTreeMap<String, Vec<u8>>,
    /// Remembered outcomes with the log time they were given, oldest answer first.
    dedupe: VecDeque<((String, String), Outcome, ModelOp, u64)>,
    /// Sum of the applied ticks (each at most 10 s).
    clock: u64,
    /// Index of the command being applied (the caller counts it: one per `apply`).
    index: u64,
    /// The cluster version (lock-delay needs 6).
    version: u32,
    /// Lock-delays by key: the configured length and the token whose expiry started the delay
    /// running now.
    delays: BTreeMap<String, (u64, Option<u64>)>,
    /// Elections by key: the leader's value and the queued candidates' (client, request,
    /// value), in queue order.
    elections: BTreeMap<String, MElection>,
    /// Open sessions by client: (the index that opened it, the latest keepalive's, ttl).
    sessions: BTreeMap<String, (u64, u64, u64)>,
}

type MElection = (Option<Vec<u8>>, Vec<(String, String, Vec<u8>)>);

impl Model {
    fn new(limits: Limits) -> Self {
        Model {
            limits,
            ..Default::default()
        }
    }

    fn remembered(&self, client: &str, request: &str) -> Option<(Outcome, ModelOp)> {
        self.dedupe
            .iter()
            .find(|((c, r), _, _, _)| c == client && r == request)
            .map(|(_, o, op, _)| (o.clone(), op.clone()))
    }

    fn remember(
        &mut self,
        client: &str,
        request: &str,
        outcome: Outcome,
        op: (&'static str, String),
    ) {
        if request.is_empty() || self.limits.dedupe_entries_max == 0 {
            return;
        }
        self.dedupe
            .push_back(((client.into(), request.into()), outcome, op, self.clock));
    }

    /// A queued answer changed: it becomes the newest answer, given now.
    fn rewrite(&mut self, client: &str, request: &str, outcome: Outcome) {
        let found = self
            .dedupe
            .iter()
            .position(|((c, r), _, _, _)| c == client && r == request);
        if let Some(i) = found {
            if let Some((id, _, op, _)) = self.dedupe.remove(i) {
                self.dedupe.push_back((id, outcome, op, self.clock));
            }
        }
    }

    fn clients_with_answers(&self) -> Vec<String> {
        let mut clients: Vec<String> = self.dedupe.iter().map(|((c, _), ..)| c.clone()).collect();
        clients.sort();
        clients.dedup();
        clients
    }

    /// Forgets the oldest finished answer (of `client`, or of anyone) if it is past its
    /// retention; false when there is none.
    fn forget_oldest(&mut self, client: Option<&str>) -> bool {
        let first_finished = self.dedupe.iter().position(|((c, _), o, _, _)| {
            client.is_none_or(|want| c == want) && !matches!(o, Outcome::Queued { .. })
        });
        match first_finished {
            Some(i) if self.dedupe[i].3 + self.limits.dedupe_retain_ms <= self.clock => {
                self.dedupe.remove(i);
                true
            }
            _ => false,
        }
    }

    /// Room for one more answer of `client` within the session and table bounds.
    fn make_room(&mut self, client: &str) -> bool {
        if self.limits.dedupe_entries_max == 0 {
            return true;
        }
        let sessions = self.clients_with_answers();
        if !sessions.iter().any(|c| c == client) && sessions.len() >= self.limits.sessions_max {
            return false;
        }
        let of_client = |m: &Model| m.dedupe.iter().filter(|((c, _), ..)| c == client).count();
        while of_client(self) >= self.limits.session_entries_max {
            if !self.forget_oldest(Some(client)) {
                return false;
            }
        }
        while self.dedupe.len() >= self.limits.dedupe_entries_max {
            if !self.forget_oldest(None) {
                return false;
            }
        }
        true
    }

    /// The log clock moves; sessions idle for `session_idle_ms` without a queued acquire close.
    fn tick(&mut self, elapsed: u64) {
        self.clock += elapsed.min(10_000);
        for client in self.clients_with_answers() {
            let answers: Vec<_> = self
                .dedupe
                .iter()
                .filter(|((c, _), ..)| *c == client)
                .collect();
            let queued = answers
                .iter()
                .any(|(_, o, _, _)| matches!(o, Outcome::Queued { .. }));
            let newest = answers.last().map_or(0, |a| a.3);
            if !queued && newest + self.limits.session_idle_ms <= self.clock {
                self.dedupe.retain(|((c, _), ..)| *c != client);
            }
        }
    }

    fn position(&self, key: &str, client: &str, request: &str) -> Option<u32> {
        self.queues.get(key).and_then(|q| {
            q.iter()
                .position(|w| w.client == client && w.request == request)
                .map(|p| p as u32 + 1)
        })
    }

    fn keys_in_use(&self) -> usize {
        let mut keys: Vec<&String> = self.holders.keys().collect();
        keys.extend(
            self.queues
                .iter()
                .filter(|(_, q)| !q.is_empty())
                .map(|(k, _)| k),
        );
        keys.sort();
        keys.dedup();
        keys.len()
    }

    /// The holder leaves; the first waiter takes over with a new token.
    fn delay_running(&self, key: &str) -> Option<u64> {
        self.delays.get(key).and_then(|d| d.1)
    }

    /// The client's session ends: in key order, its attached acquires leave their queues and
    /// its attached holds end (expire, when the session did). Returns how many ended.
    fn end_session(&mut self, client: &str, expired: bool) -> u32 {
        self.sessions.remove(client);
        let mut keys: Vec<String> = self
            .holders
            .iter()
            .filter(|(_, h)| h.client == client && h.ttl == 0)
            .map(|(k, _)| k.clone())
            .collect();
        keys.extend(
            self.queues
                .iter()
                .filter(|(_, q)| q.iter().any(|w| w.client == client && w.ttl == 0))
                .map(|(k, _)| k.clone()),
        );
        keys.sort();
        keys.dedup();
        let mut ended = 0;
        for key in keys {
            let waiting: Vec<String> = self.queues.get(&key).map_or_else(Vec::new, |q| {
                q.iter()
                    .filter(|w| w.client == client && w.ttl == 0)
                    .map(|w| w.request.clone())
                    .collect()
            });
            for request in waiting {
                if let Some(q) = self.queues.get_mut(&key) {
                    q.retain(|w| !(w.client == client && w.request == request));
                }
                if let Some(e) = self.elections.get_mut(&key) {
                    e.1.retain(|c| !(c.0 == client && c.1 == request));
                }
                self.rewrite(client, &request, Outcome::WaitCancelled);
                ended += 1;
            }
            let held = self
                .holders
                .get(&key)
                .filter(|h| h.client == client && h.ttl == 0)
                .map(|h| h.token);
            if let Some(token) = held {
                if expired {
                    self.expire_holder(&key, token);
                } else {
                    self.hand_off(&key);
                }
                ended += 1;
            }
        }
        ended
    }

    /// The holder's lease expired: the key's lock-delay starts, or the next waiter is granted.
    fn expire_holder(&mut self, key: &str, token: u64) {
        match self.delays.get_mut(key) {
            Some(d) if d.0 > 0 => {
                d.1 = Some(token);
                self.holders.remove(key);
                if let Some(e) = self.elections.get_mut(key) {
                    e.0 = None;
                }
            }
            _ => self.hand_off(key),
        }
    }

    fn hand_off(&mut self, key: &str) {
        self.holders.remove(key);
        let next = self.queues.get_mut(key).and_then(VecDeque::pop_front);
        if let Some(e) = self.elections.get_mut(key) {
            e.0 = None;
            if let Some(w) = &next {
                if let Some(at) = e.1.iter().position(|c| c.0 == w.client && c.1 == w.request) {
                    e.0 = Some(e.1.remove(at).2);
                }
            }
        }
        if let Some(w) = next {
            self.seq += 1;
            self.holders.insert(
                key.into(),
                MHolder {
                    client: w.client.clone(),
                    token: self.seq,
                    ttl: w.ttl,
                    since: self.index,
                },
            );
            let granted = Outcome::Granted {
                token: FencingToken {
                    key: key.into(),
                    value: self.seq,
                },
                ttl_ms: w.ttl,
            };
            self.rewrite(&w.client, &w.request, granted);
        }
    }

    fn holder_check(&self, key: &str, client: &str, token: u64) -> Option<Outcome> {
        match self.holders.get(key) {
            None => Some(Outcome::StaleToken { current: None }),
            Some(h) if h.token != token => Some(Outcome::StaleToken {
                current: Some(h.token),
            }),
            Some(h) if h.client != client => Some(Outcome::NotHolder),
            Some(_) => None,
        }
    }

    /// An acquire of `key` (a plain one, or a campaign's).
    fn acquire(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
    ) -> Outcome {
        match self.holders.get(key) {
            None if self.delay_running(key).is_none() => {
                if self.keys_in_use() >= self.limits.locks_held_max {
                    return Outcome::Rejected {
                        code: RejectCode::LimitReached,
                        message: String::new(),
                    };
                }
                self.seq += 1;
                self.holders.insert(
                    key.to_string(),
                    MHolder {
                        client: client_id.to_string(),
                        token: self.seq,
                        ttl: ttl_ms,
                        since: self.index,
                    },
                );
                Outcome::Granted {
                    token: FencingToken {
                        key: key.to_string(),
                        value: self.seq,
                    },
                    ttl_ms,
                }
            }
            Some(h) if h.client == client_id => Outcome::AlreadyHeld {
                token: FencingToken {
                    key: key.to_string(),
                    value: h.token,
                },
                ttl_ms: h.ttl,
            },
            _ => {
                // Held, or free while its lock-delay runs.
                let idle = self.queues.get(key).is_none_or(VecDeque::is_empty);
                if !self.holders.contains_key(key)
                    && idle
                    && self.keys_in_use() >= self.limits.locks_held_max
                {
                    return Outcome::Rejected {
                        code: RejectCode::LimitReached,
                        message: String::new(),
                    };
                }
                let q = self.queues.entry(key.to_string()).or_default();
                if let Some(p) = q.iter().position(|w| w.client == client_id) {
                    return Outcome::AlreadyQueued {
                        position: p as u32 + 1,
                    };
                }
                if wait_timeout_ms == Some(0) {
                    return Outcome::Busy;
                }
                if q.len() >= self.limits.waiters_per_key_max {
                    return Outcome::Rejected {
                        code: RejectCode::QueueFull,
                        message: String::new(),
                    };
                }
                q.push_back(MWaiter {
                    client: client_id.to_string(),
                    request: request_id.to_string(),
                    ttl: ttl_ms,
                });
                Outcome::Queued {
                    position: q.len() as u32,
                }
            }
        }
    }

    fn apply(&mut self, cmd: &Command) -> Outcome {
        let out = self.apply_command(cmd);
        // An election lasts while someone leads or campaigns.
        let unused: Vec<String> = self
            .elections
            .keys()
            .filter(|k| {
                !self.holders.contains_key(*k) && self.queues.get(*k).is_none_or(VecDeque::is_empty)
            })
            .cloned()
            .collect();
        for k in unused {
            self.elections.remove(&k);
        }
        out
    }

    fn apply_command(&mut self, cmd: &Command) -> Outcome {
        self.index += 1;
        // A TTL of 0 attaches to the client's session, which must be open (checked after the
        // exactly-once lookup: a retry of an attached acquire gets its outcome back once the
        // session has ended; a TTL of 0 before sessions is refused with the request's fields).
        let attaches = match cmd {
            Command::Acquire {
                client_id, ttl_ms, ..
            }
            | Command::Campaign {
                client_id, ttl_ms, ..
            }
            | Command::Renew {
                client_id, ttl_ms, ..
            } if *ttl_ms == 0 => Some(client_id),
            _ => None,
        };
        if attaches.is_some() && self.version < 8 {
            return Outcome::Rejected {
                code: RejectCode::InvalidRequest,
                message: String::new(),
            };
        }
        let no_session = attaches.is_some_and(|c| !self.sessions.contains_key(c));
        let session_refused = || Outcome::Rejected {
            code: RejectCode::InvalidRequest,
            message: String::new(),
        };
        // Inputs in these tests are always within the size limits; see the targeted tests.
        if let Some((client, request)) = ids(cmd) {
            if let Some((o, op)) = self.remembered(client, request) {
                // A request id used again for another operation or key is refused.
                if op != model_op(cmd) {
                    return Outcome::Rejected {
                        code: RejectCode::RequestIdReused,
                        message: String::new(),
                    };
                }
                if let (Outcome::Queued { .. }, Some(pos)) =
                    (&o, self.position(cmd.key(), client, request))
                {
                    return Outcome::Queued { position: pos };
                }
                return o;
            }
            if no_session {
                return session_refused();
            }
            if !self.make_room(client) {
                return Outcome::Rejected {
                    code: RejectCode::LimitReached,
                    message: String::new(),
                };
            }
        }
        if no_session {
            return session_refused();
        }
        let out = match cmd {
            // Read-write locks and semaphores have a model of their own (`shared_tests`).
            Command::AcquireShared { .. } | Command::SetPermits { .. } => {
                unreachable!("the random commands of this model never include shared locks")
            }
            Command::Acquire {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
            } => {
                if self.elections.contains_key(key) {
                    return Outcome::Rejected {
                        code: RejectCode::InvalidRequest,
                        message: String::new(),
                    };
                }
                self.acquire(key, client_id, request_id, *ttl_ms, *wait_timeout_ms)
            }
            Command::Campaign {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                value,
            } => {
                let in_use = self.holders.contains_key(key)
                    || self.queues.get(key).is_some_and(|q| !q.is_empty());
                if self.version < 7 || (in_use && !self.elections.contains_key(key)) {
                    return Outcome::Rejected {
                        code: RejectCode::InvalidRequest,
                        message: String::new(),
                    };
                }
                let out = self.acquire(key, client_id, request_id, *ttl_ms, *wait_timeout_ms);
                match &out {
                    Outcome::Granted { .. } => {
                        self.elections.entry(key.clone()).or_default().0 = Some(value.clone());
                    }
                    Outcome::Queued { .. } => {
                        self.elections.entry(key.clone()).or_default().1.push((
                            client_id.clone(),
                            request_id.clone(),
                            value.clone(),
                        ));
                    }
                    _ => {}
                }
                out
            }
            Command::Proclaim {
                key,
                client_id,
                token,
                value,
                ..
            } => {
                if self.version < 7 || !self.elections.contains_key(key) {
                    return Outcome::Rejected {
                        code: RejectCode::InvalidRequest,
                        message: String::new(),
                    };
                }
                match self.holder_check(key, client_id, token.value) {
                    Some(refusal) => refusal,
                    None => {
                        if let Some(e) = self.elections.get_mut(key) {
                            e.0 = Some(value.clone());
                        }
                        Outcome::Proclaimed {
                            token: token.clone(),
                        }
                    }
                }
            }
            Command::Release {
                key,
                client_id,
                token,
                ..
            } => match self.holder_check(key, client_id, token.value) {
                Some(refusal) => refusal,
                None => {
                    self.hand_off(key);
                    Outcome::Released
                }
            },
            Command::Renew {
                key,
                client_id,
                token,
                ttl_ms,
                ..
            } => match self.holder_check(key, client_id, token.value) {
                Some(refusal) => refusal,
                None => {
                    let index = self.index;
                    if let Some(h) = self.holders.get_mut(key) {
                        h.ttl = *ttl_ms;
                        h.since = index;
                    }
                    Outcome::Renewed {
                        token: token.clone(),
                        ttl_ms: *ttl_ms,
                    }
                }
            },
            Command::CancelWait {
                key,
                client_id,
                request_id,
            } => {
                let Some(pos) = self.position(key, client_id, request_id) else {
                    return Outcome::NotWaiting;
                };
                if let Some(q) = self.queues.get_mut(key) {
                    q.remove(pos as usize - 1);
                }
                if let Some(e) = self.elections.get_mut(key) {
                    e.1.retain(|c| !(&c.0 == client_id && &c.1 == request_id));
                }
                self.rewrite(client_id, request_id, Outcome::WaitCancelled);
                Outcome::WaitCancelled
            }
            Command::ExpireLease {
                key,
                token,
                lease_index,
            } => match self.holders.get(key) {
                // Attached to a session: only the session's expiry ends it.
                Some(h) if h.token == *token && h.ttl == 0 => Outcome::LeaseRenewed {
                    lease_index: h.since,
                },
                Some(h) if h.token == *token && h.since != *lease_index => Outcome::LeaseRenewed {
                    lease_index: h.since,
                },
                Some(h) if h.token == *token => {
                    let client_id = h.client.clone();
                    self.expire_holder(key, *token);
                    Outcome::Expired { client_id }
                }
                Some(h) => Outcome::StaleToken {
                    current: Some(h.token),
                },
                None => Outcome::StaleToken { current: None },
            },
            Command::ReleaseHeld { key, client_id, .. } => match self.holders.get(key) {
                Some(h) if &h.client == client_id => {
                    self.hand_off(key);
                    Outcome::Released
                }
                Some(_) => Outcome::NotHolder,
                None => Outcome::StaleToken { current: None },
            },
            Command::SetLimits { limits } => {
                self.limits = limits.clone();
                Outcome::Stored
            }
            Command::SetLimitsV1 { limits } => {
                self.limits = limits.clone().into();
                Outcome::Stored
            }
            Command::Tick { elapsed_ms } => {
                self.tick(*elapsed_ms);
                Outcome::Stored
            }
            Command::SetClusterVersion { version } => {
                self.version = self.version.max(*version);
                Outcome::Stored
            }
            Command::SetLockDelay { key, delay_ms, .. } => {
                if self.version < 6 || *delay_ms > self.limits.ttl_ms_max {
                    return Outcome::Rejected {
                        code: RejectCode::InvalidRequest,
                        message: String::new(),
                    };
                }
                let count = self.delays.len();
                match self.delays.get_mut(key) {
                    Some(d) if *delay_ms == 0 && d.1.is_none() => {
                        self.delays.remove(key);
                    }
                    Some(d) => d.0 = *delay_ms,
                    None if *delay_ms == 0 => {}
                    None if count >= self.limits.locks_held_max => {
                        return Outcome::Rejected {
                            code: RejectCode::LimitReached,
                            message: String::new(),
                        }
                    }
                    None => {
                        self.delays.insert(key.clone(), (*delay_ms, None));
                    }
                }
                Outcome::LockDelaySet {
                    delay_ms: *delay_ms,
                }
            }
            Command::EndLockDelay { key, token } => {
                if self.version < 6 {
                    return Outcome::Rejected {
                        code: RejectCode::InvalidRequest,
                        message: String::new(),
                    };
                }
                match self.delay_running(key) {
                    Some(t) if t == *token => {
                        let configured = self.delays.get(key).map_or(0, |d| d.0);
                        if configured == 0 {
                            self.delays.remove(key);
                        } else if let Some(d) = self.delays.get_mut(key) {
                            d.1 = None;
                        }
                        self.hand_off(key);
                        Outcome::LockDelayEnded
                    }
                    current => Outcome::StaleToken { current },
                }
            }
            Command::KeepAlive {
                client_id,
                session,
                ttl_ms,
            } => {
                if self.version < 8 {
                    return Outcome::Rejected {
                        code: RejectCode::InvalidRequest,
                        message: String::new(),
                    };
                }
                let index = self.index;
                let count = self.sessions.len();
                match self.sessions.get_mut(client_id) {
                    Some(s) if *session == 0 || *session == s.0 => {
                        s.1 = index;
                        s.2 = *ttl_ms;
                        Outcome::SessionKept {
                            session: s.0,
                            ttl_ms: *ttl_ms,
                        }
                    }
                    Some(_) => Outcome::NoSession,
                    None if *session != 0 => Outcome::NoSession,
                    None if count >= self.limits.sessions_max => Outcome::Rejected {
                        code: RejectCode::LimitReached,
                        message: String::new(),
                    },
                    None => {
                        self.sessions
                            .insert(client_id.clone(), (index, index, *ttl_ms));
                        Outcome::SessionKept {
                            session: index,
                            ttl_ms: *ttl_ms,
                        }
                    }
                }
            }
            Command::EndSession { client_id, session } => {
                if self.version < 8 {
                    return Outcome::Rejected {
                        code: RejectCode::InvalidRequest,
                        message: String::new(),
                    };
                }
                match self.sessions.get(client_id) {
                    Some(s) if s.0 == *session => Outcome::SessionEnded {
                        locks: self.end_session(client_id, false),
                    },
                    _ => Outcome::NoSession,
                }
            }
            Command::ExpireSession {
                client_id,
                session,
                lease_index,
            } => match self.sessions.get(client_id) {
                Some(s) if s.0 == *session && s.1 != *lease_index => {
                    Outcome::LeaseRenewed { lease_index: s.1 }
                }
                Some(s) if s.0 == *session => Outcome::SessionEnded {
                    locks: self.end_session(client_id, true),
                },
                _ => Outcome::NoSession,
            },
            Command::SetClusterId { .. }
            | Command::SetMember { .. }
            | Command::SetQuotas { .. } => Outcome::Stored,
            Command::Sequenced { .. } => unreachable!("the model's commands acknowledge nothing"),
            Command::Expire { key, token } => match self.holders.get(key) {
                Some(h) if h.token == *token && h.ttl == 0 => Outcome::LeaseRenewed {
                    lease_index: h.since,
                },
                Some(h) if h.token == *token => {
                    let client_id = h.client.clone();
                    self.expire_holder(key, *token);
                    Outcome::Expired { client_id }
                }
                Some(h) => Outcome::StaleToken {
                    current: Some(h.token),
                },
                None => Outcome::StaleToken { current: None },
            },
            Command::Put {
                key, value, guard, ..
            } => {
                if let Some(g) = guard {
                    let current = self.holders.get(&g.key).map(|h| h.token);
                    if current != Some(g.value) {
                        return Outcome::GuardRejected { current };
                    }
                }
                if !self.data.contains_key(key) && self.data.len() >= self.limits.data_entries_max {
                    return Outcome::Rejected {
                        code: RejectCode::LimitReached,
                        message: String::new(),
                    };
                }
                self.data.insert(key.clone(), value.clone());
                Outcome::Stored
            }
            Command::Delete { key, guard, .. } => {
                if let Some(g) = guard {
                    let current = self.holders.get(&g.key).map(|h| h.token);
                    if current != Some(g.value) {
                        return Outcome::GuardRejected { current };
                    }
                }
                Outcome::Deleted {
                    existed: self.data.remove(key).is_some(),
                }
            }
        };
        if out.is_recorded() {
            if let Some((c, r)) = ids(cmd) {
                self.remember(c, r, out.clone(), model_op(cmd));
            }
        }
        out
    }
}

fn ids(cmd: &Command) -> Option<(&str, &str)> {
    match cmd {
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
        } if !request_id.is_empty() => Some((client_id, request_id)),
        _ => None,
    }
}

/// Rejection messages are for humans; compare codes only.
/// Kind and key of a request.
type ModelOp = (&'static str, String);

/// What kind of operation on which key a request was, as the exactly-once rule compares them.
fn model_op(cmd: &Command) -> ModelOp {
    let kind = match cmd {
        Command::Acquire { .. } => "acquire",
        Command::Release { .. } | Command::ReleaseHeld { .. } => "release",
        Command::Renew { .. } => "renew",
        Command::CancelWait { .. } => "cancel",
        Command::Put { .. } => "put",
        Command::Delete { .. } => "delete",
        Command::SetLockDelay { .. } => "lock_delay",
        Command::Campaign { .. } => "campaign",
        Command::Proclaim { .. } => "proclaim",
        Command::AcquireShared { .. } => "acquire_shared",
        Command::SetPermits { .. } => "set_permits",
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
        | Command::Sequenced { .. } => "",
    };
    (kind, cmd.key().to_string())
}

fn normalize(o: Outcome) -> Outcome {
    match o {
        Outcome::Rejected { code, .. } => Outcome::Rejected {
            code,
            message: String::new(),
        },
        other => other,
    }
}

// ----- random operations ---------------------------------------------------------------------

const KEYS: &[&str] = &["a", "b", "c"];
const CLIENTS: &[&str] = &["c1", "c2", "c3", "c4"];

/// A random command. Tokens are drawn near the current sequence so that current, stale and
/// future tokens all occur; request ids come from a small pool so retries happen often.
fn random_command(rng: &mut Rng, seq: u64) -> Command {
    let key = rng.pick(KEYS).to_string();
    let client_id = rng.pick(CLIENTS).to_string();
    let request_id = format!("r{}", rng.below(12));
    let token = |rng: &mut Rng| seq.saturating_sub(rng.below(4)) + rng.below(2);
    match rng.below(175) {
        0..=34 => Command::Acquire {
            key,
            client_id,
            request_id,
            ttl_ms: 1 + rng.below(3) * 1000,
            wait_timeout_ms: match rng.below(3) {
                0 => None,
                1 => Some(0),
                _ => Some(500),
            },
        },
        35..=54 => Command::Release {
            token: FencingToken {
                key: key.clone(),
                value: token(rng),
            },
            key,
            client_id,
            request_id,
        },
        55..=62 => Command::Renew {
            token: FencingToken {
                key: key.clone(),
                value: token(rng),
            },
            key,
            client_id,
            request_id,
            ttl_ms: 2000,
        },
        63..=72 => Command::CancelWait {
            key,
            client_id,
            request_id,
        },
        73..=78 => Command::Expire {
            key,
            token: token(rng),
        },
        79..=84 => Command::ExpireLease {
            key,
            token: token(rng),
            // Lease start indexes are small in these runs: some match, most do not.
            lease_index: rng.below(8),
        },
        85..=94 => Command::Put {
            key: format!("d{}", rng.below(3)),
            value: vec![rng.below(256) as u8; rng.below(4) as usize],
            guard: if rng.below(2) == 0 {
                None
            } else {
                Some(FencingToken {
                    key: rng.pick(KEYS).to_string(),
                    value: token(rng),
                })
            },
            client_id,
            request_id,
        },
        95..=97 => Command::Delete {
            key: format!("d{}", rng.below(3)),
            guard: None,
            client_id,
            request_id,
        },
        // Lock-delay: the cluster raised to the version that has it, a key's delay set or
        // removed, the leader ending a delay (with a token that may or may not be the one).
        100..=102 => Command::SetClusterVersion { version: 6 },
        103..=109 => Command::SetLockDelay {
            key,
            delay_ms: rng.below(2) * 1000,
            client_id,
            request_id,
        },
        110..=124 => Command::EndLockDelay {
            key,
            token: token(rng),
        },
        // Elections on the same keys as the locks: the version that has them, campaigns
        // (refused on a key in use as a lock), proclaims with current, stale and made-up terms.
        125..=126 => Command::SetClusterVersion { version: 7 },
        127..=136 => Command::Campaign {
            key,
            client_id,
            request_id,
            ttl_ms: 1 + rng.below(3) * 1000,
            wait_timeout_ms: match rng.below(3) {
                0 => None,
                1 => Some(0),
                _ => Some(500),
            },
            value: format!("v{}", rng.below(100)).into_bytes(),
        },
        137..=143 => Command::Proclaim {
            token: FencingToken {
                key: key.clone(),
                value: token(rng),
            },
            key,
            client_id,
            request_id,
            value: format!("p{}", rng.below(100)).into_bytes(),
        },
        // Sessions: the version that has them, keepalives (opening or keeping a session, or
        // naming one that is gone), acquires and campaigns attached to the session (a TTL of
        // 0), ends by the client and expiries by the leader (the caller fills in the current
        // session and lease half the time).
        145..=147 => Command::SetClusterVersion { version: 8 },
        148..=153 => Command::KeepAlive {
            client_id,
            session: if rng.below(2) == 0 { 0 } else { rng.below(40) },
            ttl_ms: 1 + rng.below(3) * 1000,
        },
        154..=162 => Command::Acquire {
            key,
            client_id,
            request_id,
            ttl_ms: 0,
            wait_timeout_ms: match rng.below(3) {
                0 => None,
                1 => Some(0),
                _ => Some(500),
            },
        },
        163..=164 => Command::Campaign {
            key,
            client_id,
            request_id,
            ttl_ms: 0,
            wait_timeout_ms: Some(500),
            value: format!("s{}", rng.below(100)).into_bytes(),
        },
        165..=167 => Command::EndSession {
            client_id,
            session: rng.below(40),
        },
        168..=171 => Command::ExpireSession {
            client_id,
            session: rng.below(40),
            lease_index: rng.below(40),
        },
        // The log clock moves (occasionally by more than one tick may carry).
        _ => Command::Tick {
            elapsed_ms: rng.below(3_000) + if rng.below(10) == 0 { 20_000 } else { 0 },
        },
    }
}

fn small_limits() -> Limits {
    Limits {
        waiters_per_key_max: 2,
        locks_held_max: 3,
        data_entries_max: 2,
        dedupe_entries_max: 12,
        sessions_max: 3,
        session_entries_max: 5,
        session_idle_ms: 5_000,
        dedupe_retain_ms: 2_000,
        ..Limits::default()
    }
}

/// Held locks as (key, holder, token, ttl) and waiters as (key, client, request), in order.
type Observed = (
    Vec<(String, String, u64, u64)>,
    Vec<(String, String, String)>,
);

/// The machine's observable lock state in model terms.
fn observe(sm: &LockStateMachine) -> Observed {
    let mut held: Vec<_> = sm
        .held_locks()
        .into_iter()
        .map(|h| (h.key, h.client_id, h.token, h.ttl_ms))
        .collect();
    held.sort();
    let waiters = sm
        .waiters()
        .into_iter()
        .map(|w| (w.key, w.client_id, w.request_id))
        .collect();
    (held, waiters)
}

fn observe_model(m: &Model) -> Observed {
    let held = m
        .holders
        .iter()
        .map(|(k, h)| (k.clone(), h.client.clone(), h.token, h.ttl))
        .collect();
    let waiters = m
        .queues
        .iter()
        .flat_map(|(k, q)| {
            q.iter()
                .map(move |w| (k.clone(), w.client.clone(), w.request.clone()))
        })
        .collect();
    (held, waiters)
}

/// Runs one random sequence against the model; returns how many requests a session or table
/// bound refused and how many sessions ticks closed (so the caller can check both happened).
fn run_model_case(seed: u64, steps: usize) -> (usize, usize, usize, usize, usize, usize) {
    let mut session_locks_ended = 0;
    let mut proclaims = 0;
    let mut led = 0;
    let mut refused = 0;
    let mut closed = 0;
    let mut delays_ended = 0;
    let mut rng = Rng(seed);
    let limits = small_limits();
    let mut sm = LockStateMachine::new(limits.clone());
    let mut model = Model::new(limits.clone());
    let mut history: Vec<String> = Vec::new();
    let mut stored: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for step in 0..steps {
        // Occasionally snapshot and restore (a follower installing a snapshot, or a restart).
        if rng.below(20) == 0 {
            let bytes = sm.snapshot();
            sm = LockStateMachine::restore(&bytes, limits.clone())
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: restore failed: {e}"));
            assert_eq!(
                sm.snapshot(),
                bytes,
                "seed {seed}: restore changed the snapshot"
            );
            history.push("-- snapshot/restore".into());
        }
        let mut cmd = random_command(&mut rng, model.seq);
        // Half the proclaims come from a leader, with its term and a new request id.
        if let Command::Proclaim {
            key,
            client_id,
            request_id,
            token,
            ..
        } = &mut cmd
        {
            let led: Vec<&String> = model
                .elections
                .keys()
                .filter(|k| model.holders.contains_key(*k))
                .collect();
            if !led.is_empty() && rng.below(2) == 0 {
                let k = led[rng.below(led.len() as u64) as usize].clone();
                let h = &model.holders[&k];
                *client_id = h.client.clone();
                *request_id = format!("p{step}");
                token.value = h.token;
                token.key = k.clone();
                *key = k;
            }
        }
        // Three session commands in four name the client's current session (and lease).
        if let Command::KeepAlive {
            client_id, session, ..
        }
        | Command::EndSession { client_id, session }
        | Command::ExpireSession {
            client_id, session, ..
        } = &mut cmd
        {
            if let Some(s) = model
                .sessions
                .get(client_id.as_str())
                .filter(|_| rng.below(4) != 0)
            {
                *session = s.0;
            }
        }
        if let Command::ExpireSession {
            client_id,
            lease_index,
            ..
        } = &mut cmd
        {
            if let Some(s) = model
                .sessions
                .get(client_id.as_str())
                .filter(|_| rng.below(4) != 0)
            {
                *lease_index = s.1;
            }
        }
        let index = step as u64 + 1;
        let sessions_before = sm.session_count();
        let got = normalize(sm.apply(index, &cmd).outcome);
        // What the machine writes to storage is its state: read back, it is the same state
        // (a node that restarts must not differ from one that did not).
        for (k, v) in sm.take_changes() {
            match v {
                Some(v) => stored.insert(k, v),
                None => stored.remove(&k),
            };
        }
        if step % 10 == 9 {
            let pairs = super::stored_to_snapshot_pairs(stored.clone().into_iter().collect())
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: stored pairs: {e}"));
            let reread = LockStateMachine::from_kv_with_limits(pairs, limits.clone())
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: stored state: {e}"));
            assert!(
                reread.snapshot() == sm.snapshot(),
                "seed {seed} step {step}: the stored state differs from the state in memory\n\
                 stored: {:?}\nmemory: {:?}",
                reread.to_kv(),
                sm.to_kv()
            );
        }
        if matches!(cmd, Command::Tick { .. }) {
            closed += sessions_before - sm.session_count();
        }
        if matches!(
            got,
            Outcome::Rejected {
                code: RejectCode::LimitReached,
                ..
            }
        ) && ids(&cmd).is_some()
        {
            refused += 1;
        }
        let want = normalize(model.apply(&cmd));
        history.push(format!("{index}: {cmd:?} -> {got:?}"));
        let tail = || history[history.len().saturating_sub(25)..].join("\n");
        assert_eq!(
            got,
            want,
            "seed {seed} step {step}: outcome differs from the model\nlast commands:\n{}",
            tail()
        );
        assert_eq!(
            observe(&sm),
            observe_model(&model),
            "seed {seed} step {step}: state differs from the model\nlast commands:\n{}",
            tail()
        );
        assert_eq!(sm.fencing_sequence(), model.seq, "seed {seed} step {step}");
        if matches!(got, Outcome::LockDelayEnded) {
            delays_ended += 1;
        }
        assert_eq!(
            sm.lock_delays_running(),
            model.delays.values().filter(|d| d.1.is_some()).count(),
            "seed {seed} step {step}: running lock-delays"
        );
        for k in KEYS {
            assert_eq!(
                sm.lock_delay(k)
                    .map(|d| (d.delay_ms, d.running.map(|r| r.0))),
                model.delays.get(*k).cloned(),
                "seed {seed} step {step}: lock-delay of {k}\nlast commands:\n{}",
                tail()
            );
        }
        for k in KEYS {
            let election = sm.election(k).map(|e| (e.value, e.candidates));
            let modelled = model.elections.get(*k).map(|e| (e.0.clone(), e.1.len()));
            assert_eq!(
                election,
                modelled,
                "seed {seed} step {step}: election {k}\nlast commands:\n{}",
                tail()
            );
            if let Some(Some((client, term))) = sm.election(k).map(|e| e.leader) {
                let holder = model.holders.get(*k).map(|h| (h.client.clone(), h.token));
                assert_eq!(Some((client, term)), holder, "seed {seed} step {step}");
            }
        }
        if matches!(got, Outcome::Proclaimed { .. }) {
            proclaims += 1;
        }
        let open: Vec<(String, u64, u64, u64)> = sm
            .session_leases()
            .into_iter()
            .map(|s| (s.client_id, s.session, s.lease_index, s.ttl_ms))
            .collect();
        let modelled: Vec<(String, u64, u64, u64)> = model
            .sessions
            .iter()
            .map(|(c, s)| (c.clone(), s.0, s.1, s.2))
            .collect();
        assert_eq!(
            open,
            modelled,
            "seed {seed} step {step}: sessions\nlast commands:\n{}",
            tail()
        );
        assert_eq!(sm.session_mismatch(), None, "seed {seed} step {step}");
        if let Outcome::SessionEnded { locks } = got {
            session_locks_ended += locks as usize;
        }
        if model.elections.values().any(|e| e.0.is_some()) {
            led += 1;
        }
        for k in ["d0", "d1", "d2"] {
            assert_eq!(
                sm.get(k),
                model.data.get(k).map(Vec::as_slice),
                "seed {seed} step {step}: data {k}"
            );
        }
    }
    (
        refused,
        closed,
        delays_ended,
        proclaims,
        led,
        session_locks_ended,
    )
}

#[test]
fn model_based_random_sequences() {
    let (mut refused, mut closed, mut delays_ended) = (0, 0, 0);
    let (mut proclaims, mut led, mut session_locks) = (0, 0, 0);
    for seed in 0..400 {
        let (r, c, d, p, l, s) = run_model_case(seed, 300);
        session_locks += s;
        refused += r;
        closed += c;
        delays_ended += d;
        proclaims += p;
        led += l;
    }
    // Elections are led (steps with a leader showing a value) and leaders proclaim.
    assert!(led > 5_000, "only {led} steps had an elected leader");
    assert!(proclaims > 100, "only {proclaims} proclaims applied");
    // Sessions end with locks and acquires attached to them (62 over these seeds: most
    // attached acquires find no open session or meet the small bounds).
    assert!(
        session_locks > 40,
        "only {session_locks} attached locks ended with their session"
    );
    // Lock-delays start on expiries and the leader's end hands the key on.
    assert!(delays_ended > 50, "only {delays_ended} lock-delays ended");
    // The runs reach the session bounds and close idle sessions (small limits make them).
    assert!(refused > 100, "only {refused} requests met a session bound");
    assert!(closed > 100, "only {closed} sessions closed");
}

// ----- determinism ---------------------------------------------------------------------------

fn random_log(seed: u64, len: usize) -> Vec<Command> {
    let mut rng = Rng(seed);
    let mut model = Model::new(small_limits());
    (0..len)
        .map(|_| {
            let c = random_command(&mut rng, model.seq);
            model.apply(&c);
            c
        })
        .collect()
}

#[test]
fn same_log_gives_identical_bytes_and_outcomes() {
    for seed in 0..50 {
        let log = random_log(seed, 200);
        let mut a = LockStateMachine::new(small_limits());
        let mut b = LockStateMachine::new(small_limits());
        for (i, c) in log.iter().enumerate() {
            let ra = a.apply(i as u64 + 1, c);
            let rb = b.apply(i as u64 + 1, c);
            assert_eq!(ra, rb, "seed {seed} index {}", i + 1);
        }
        assert_eq!(a.snapshot(), b.snapshot(), "seed {seed}");
    }
}

#[test]
fn restore_from_a_snapshot_at_every_index_converges() {
    for seed in 0..8 {
        let log = random_log(1000 + seed, 120);
        let mut reference = LockStateMachine::new(small_limits());
        let mut outcomes = Vec::new();
        let mut snapshots = vec![reference.snapshot()];
        for (i, c) in log.iter().enumerate() {
            outcomes.push(reference.apply(i as u64 + 1, c));
            snapshots.push(reference.snapshot());
        }
        let final_bytes = reference.snapshot();
        for (at, snap) in snapshots.iter().enumerate() {
            let mut sm = LockStateMachine::restore(snap, small_limits()).expect("restore");
            assert_eq!(sm.applied_index(), at as u64);
            for (i, c) in log.iter().enumerate().skip(at) {
                let got = sm.apply(i as u64 + 1, c);
                assert_eq!(
                    got,
                    outcomes[i],
                    "seed {seed}: restored at {at}, index {}",
                    i + 1
                );
            }
            assert_eq!(sm.snapshot(), final_bytes, "seed {seed}: restored at {at}");
        }
    }
}

// ----- targeted tests, one per guarantee ----------------------------------------------------

fn acquire(key: &str, client: &str, request: &str, wait: Option<u64>) -> Command {
    Command::Acquire {
        key: key.into(),
        client_id: client.into(),
        request_id: request.into(),
        ttl_ms: 1000,
        wait_timeout_ms: wait,
    }
}

fn release(key: &str, client: &str, request: &str, token: u64) -> Command {
    Command::Release {
        key: key.into(),
        client_id: client.into(),
        request_id: request.into(),
        token: FencingToken {
            key: key.into(),
            value: token,
        },
    }
}

struct Sm {
    sm: LockStateMachine,
    index: u64,
}

impl Sm {
    fn new(limits: Limits) -> Self {
        Sm {
            sm: LockStateMachine::new(limits),
            index: 0,
        }
    }
    fn apply(&mut self, c: Command) -> (Outcome, Vec<Event>) {
        self.index += 1;
        let a = self.sm.apply(self.index, &c);
        (a.outcome, a.events)
    }
    fn token(&mut self, c: Command) -> u64 {
        match self.apply(c).0 {
            Outcome::Granted { token, .. } => token.value,
            other => panic!("expected a grant, got {other:?}"),
        }
    }
}

#[test]
fn mutual_exclusion_and_fifo_hand_off_in_the_same_apply() {
    let mut s = Sm::new(Limits::default());
    let t1 = s.token(acquire("k", "a", "1", None));
    assert_eq!(
        s.apply(acquire("k", "b", "1", None)).0,
        Outcome::Queued { position: 1 }
    );
    assert_eq!(
        s.apply(acquire("k", "c", "1", None)).0,
        Outcome::Queued { position: 2 }
    );
    assert_eq!(s.apply(acquire("k", "d", "1", Some(0))).0, Outcome::Busy);
    assert_eq!(s.sm.holder("k").map(|h| h.client_id), Some("a".into()));
    // Release hands to b in the same apply, with a larger token.
    let (out, events) = s.apply(release("k", "a", "2", t1));
    assert_eq!(out, Outcome::Released);
    let Some(Event::Granted {
        client_id, token, ..
    }) = events.first()
    else {
        panic!("no hand-off event: {events:?}");
    };
    assert_eq!(client_id, "b");
    assert!(token.value > t1);
    // Expiry hands to c in the same apply.
    let t2 = token.value;
    let (out, events) = s.apply(Command::Expire {
        key: "k".into(),
        token: t2,
    });
    assert_eq!(
        out,
        Outcome::Expired {
            client_id: "b".into()
        }
    );
    assert!(
        matches!(&events[..], [Event::Expired { .. }, Event::Granted { client_id, .. }] if client_id == "c")
    );
    assert_eq!(s.sm.holder("k").map(|h| h.client_id), Some("c".into()));
}

#[test]
fn tokens_are_never_reused_across_keys_releases_and_expiries() {
    let mut s = Sm::new(Limits::default());
    let mut seen = Vec::new();
    for round in 0..20 {
        let key = ["x", "y"][round % 2];
        let t = s.token(acquire(key, "a", &format!("acq{round}"), None));
        seen.push(t);
        if round % 3 == 0 {
            s.apply(Command::Expire {
                key: key.into(),
                token: t,
            });
        } else {
            assert_eq!(
                s.apply(release(key, "a", &format!("rel{round}"), t)).0,
                Outcome::Released
            );
        }
    }
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert_eq!(s.sm.fencing_sequence(), *seen.last().expect("tokens"));
}

#[test]
fn stale_release_renew_and_expire_are_refused_with_a_reason() {
    let mut s = Sm::new(Limits::default());
    let t1 = s.token(acquire("k", "a", "1", None));
    s.apply(release("k", "a", "2", t1));
    let t2 = s.token(acquire("k", "b", "1", None));
    let before = s.sm.snapshot();
    assert_eq!(
        s.apply(release("k", "a", "3", t1)).0,
        Outcome::StaleToken { current: Some(t2) }
    );
    assert_eq!(
        s.apply(Command::Renew {
            key: "k".into(),
            client_id: "a".into(),
            request_id: "4".into(),
            token: FencingToken {
                key: "k".into(),
                value: t1
            },
            ttl_ms: 1000,
        })
        .0,
        Outcome::StaleToken { current: Some(t2) }
    );
    // The current token presented by another client.
    assert_eq!(s.apply(release("k", "a", "5", t2)).0, Outcome::NotHolder);
    // A leader's expiry for an old lease does nothing.
    assert_eq!(
        s.apply(Command::Expire {
            key: "k".into(),
            token: t1
        })
        .0,
        Outcome::StaleToken { current: Some(t2) }
    );
    let mut after =
        LockStateMachine::restore(&s.sm.snapshot(), Limits::default()).expect("restore");
    let mut expected = LockStateMachine::restore(&before, Limits::default()).expect("restore");
    assert_eq!(after.held_locks(), expected.held_locks());
    // Only the applied index moved.
    assert_eq!(after.take_changes().len(), expected.take_changes().len());
}

#[test]
fn wait_timeout_and_cancel_leave_the_queue() {
    let mut s = Sm::new(Limits::default());
    let t = s.token(acquire("k", "a", "1", None));
    assert_eq!(
        s.apply(acquire("k", "b", "w", Some(500))).0,
        Outcome::Queued { position: 1 }
    );
    assert_eq!(
        s.apply(acquire("k", "c", "w", None)).0,
        Outcome::Queued { position: 2 }
    );
    // The leader's wait-timeout CancelWait for b.
    let (out, events) = s.apply(Command::CancelWait {
        key: "k".into(),
        client_id: "b".into(),
        request_id: "w".into(),
    });
    assert_eq!(out, Outcome::WaitCancelled);
    assert!(matches!(&events[..], [Event::WaiterRemoved { client_id, .. }] if client_id == "b"));
    assert_eq!(
        s.apply(Command::CancelWait {
            key: "k".into(),
            client_id: "b".into(),
            request_id: "w".into(),
        })
        .0,
        Outcome::NotWaiting
    );
    // A retry of b's acquire learns it was cancelled rather than re-queueing.
    assert_eq!(
        s.apply(acquire("k", "b", "w", Some(500))).0,
        Outcome::WaitCancelled
    );
    s.apply(release("k", "a", "2", t));
    assert_eq!(s.sm.holder("k").map(|h| h.client_id), Some("c".into()));
}

#[test]
fn retried_requests_get_their_original_outcome() {
    let mut s = Sm::new(Limits::default());
    let t1 = s.token(acquire("k", "a", "1", None));
    // The retry of a granted acquire returns the same grant, not a new token.
    assert_eq!(s.token(acquire("k", "a", "1", None)), t1);
    assert_eq!(
        s.apply(acquire("k", "b", "q", None)).0,
        Outcome::Queued { position: 1 }
    );
    assert_eq!(s.apply(release("k", "a", "2", t1)).0, Outcome::Released);
    // A retried release is answered Released again and does not release b's grant.
    assert_eq!(s.apply(release("k", "a", "2", t1)).0, Outcome::Released);
    let holder = s.sm.holder("k").expect("b holds");
    assert_eq!(holder.client_id, "b");
    // b's acquire, retried after the hand-off (e.g. after a failover), sees its grant.
    assert_eq!(s.token(acquire("k", "b", "q", None)), holder.token);
    assert_eq!(s.sm.fencing_sequence(), holder.token);
}

fn tick(ms: u64) -> Command {
    Command::Tick { elapsed_ms: ms }
}

fn is_limit(o: &Outcome) -> bool {
    matches!(
        o,
        Outcome::Rejected {
            code: RejectCode::LimitReached,
            ..
        }
    )
}

#[test]
fn a_full_table_refuses_new_requests_instead_of_forgetting_young_answers() {
    let limits = Limits {
        dedupe_entries_max: 4,
        dedupe_retain_ms: 1_000,
        ..Limits::default()
    };
    let mut s = Sm::new(limits);
    for i in 0..2 {
        let t = s.token(acquire("k", "a", &format!("a{i}"), None));
        s.apply(release("k", "a", &format!("r{i}"), t));
    }
    assert_eq!(s.sm.dedupe_len(), 4);
    // Every answer is younger than the retention: a new request is refused and changes nothing.
    let (out, _) = s.apply(acquire("k", "a", "a2", None));
    assert!(is_limit(&out), "{out:?}");
    assert!(s.sm.holder("k").is_none());
    assert_eq!(s.sm.dedupe_len(), 4);
    // A retry of a remembered request is still answered from the table.
    assert_eq!(s.apply(release("k", "a", "r1", 2)).0, Outcome::Released);
    // Once the oldest answers are past their retention they make room, oldest first.
    s.apply(tick(1_000));
    let t = s.token(acquire("k", "a", "a2", None));
    assert_eq!(s.sm.dedupe_len(), 4);
    // "a0" was forgotten: a retry of it is a new request (the lock is held by a under "a2").
    assert!(matches!(
        s.apply(acquire("k", "a", "a0", None)).0,
        Outcome::AlreadyHeld { .. }
    ));
    assert_eq!(s.sm.holder("k").map(|h| h.token), Some(t));
}

#[test]
fn a_busy_client_cannot_push_out_another_clients_answers() {
    let limits = Limits {
        session_entries_max: 3,
        dedupe_retain_ms: 1_000,
        ..Limits::default()
    };
    let mut s = Sm::new(limits);
    let tb = s.token(acquire("kb", "b", "b1", None));
    assert_eq!(s.apply(release("kb", "b", "b2", tb)).0, Outcome::Released);
    // a fills its own session, then is refused until its own answers age.
    for i in 0..3 {
        s.apply(Command::Put {
            key: "d".into(),
            value: vec![i],
            guard: None,
            client_id: "a".into(),
            request_id: format!("p{i}"),
        });
    }
    assert_eq!(s.sm.session_len("a"), 3);
    let put = |req: &str| Command::Put {
        key: "d".into(),
        value: b"x".to_vec(),
        guard: None,
        client_id: "a".into(),
        request_id: req.into(),
    };
    assert!(is_limit(&s.apply(put("p3")).0));
    assert_eq!(s.sm.get("d"), Some(&[2u8][..]));
    s.apply(tick(1_000));
    for i in 3..20 {
        assert_eq!(s.apply(put(&format!("p{i}"))).0, Outcome::Stored, "p{i}");
        s.apply(tick(1_000));
    }
    assert_eq!(s.sm.session_len("a"), 3);
    // b's retried release is still answered Released, not STALE_TOKEN.
    assert_eq!(s.apply(release("kb", "b", "b2", tb)).0, Outcome::Released);
    assert_eq!(s.sm.session_len("b"), 2);
}

#[test]
fn idle_sessions_close_through_the_log_and_queued_ones_stay() {
    let limits = Limits {
        session_idle_ms: 10_000,
        sessions_max: 3,
        ..Limits::default()
    };
    let mut s = Sm::new(limits);
    let ta = s.token(acquire("k", "a", "a1", None));
    assert_eq!(
        s.apply(acquire("k", "b", "b1", None)).0,
        Outcome::Queued { position: 1 }
    );
    s.apply(Command::Put {
        key: "d".into(),
        value: b"v".to_vec(),
        guard: None,
        client_id: "c".into(),
        request_id: "c1".into(),
    });
    assert_eq!(s.sm.session_count(), 3);
    // A fourth client is refused while three sessions are open.
    let (out, _) = s.apply(acquire("k2", "d", "d1", None));
    assert!(is_limit(&out), "{out:?}");
    assert!(s.sm.holder("k2").is_none());
    // A tick can move the clock by at most TICK_MAX_MS.
    s.apply(tick(60_000));
    assert_eq!(s.sm.log_clock_ms(), 10_000);
    // a and c were idle for 10 s: closed. b waits in the queue: its session stays open.
    assert_eq!(s.sm.session_count(), 1);
    assert_eq!(s.sm.session_len("b"), 1);
    assert_eq!(
        s.apply(acquire("k", "b", "b1", None)).0,
        Outcome::Queued { position: 1 }
    );
    // d now gets a session.
    s.token(acquire("k2", "d", "d1", None));
    // a's lock is untouched by its session closing; the grant to b moves b's answer.
    let (out, events) = s.apply(release("k", "a", "a2", ta));
    assert_eq!(out, Outcome::Released);
    assert!(matches!(events.as_slice(), [Event::Granted { .. }]));
    s.apply(tick(9_999));
    assert_eq!(
        s.sm.session_len("b"),
        1,
        "b's grant was answered 9.999 s ago"
    );
    let tb = match s.apply(acquire("k", "b", "b1", None)).0 {
        Outcome::Granted { token, .. } => token.value,
        other => panic!("b's retry: {other:?}"),
    };
    s.apply(tick(1));
    assert_eq!(s.sm.session_len("b"), 0);
    // The state survives a snapshot with the clock and sessions intact.
    let restored = LockStateMachine::restore(&s.sm.snapshot(), Limits::default()).expect("restore");
    assert_eq!(restored.log_clock_ms(), s.sm.log_clock_ms());
    assert_eq!(restored.session_count(), s.sm.session_count());
    assert_eq!(restored.holder("k").map(|h| h.token), Some(tb));
}

#[test]
fn guarded_writes_apply_only_with_the_current_token() {
    let mut s = Sm::new(Limits::default());
    let t = s.token(acquire("lock", "a", "1", None));
    let put = |value: &str, token: u64, req: &str| Command::Put {
        key: "data".into(),
        value: value.as_bytes().to_vec(),
        guard: Some(FencingToken {
            key: "lock".into(),
            value: token,
        }),
        client_id: "a".into(),
        request_id: req.into(),
    };
    assert_eq!(s.apply(put("v1", t, "p1")).0, Outcome::Stored);
    s.apply(release("lock", "a", "2", t));
    let t2 = s.token(acquire("lock", "b", "1", None));
    assert_eq!(
        s.apply(put("v2", t, "p2")).0,
        Outcome::GuardRejected { current: Some(t2) }
    );
    assert_eq!(s.sm.get("data"), Some(&b"v1"[..]));
}

#[test]
fn limits_are_answered_with_errors_and_change_nothing() {
    let limits = Limits {
        key_bytes_max: 8,
        value_bytes_max: 4,
        id_bytes_max: 6,
        ttl_ms_max: 10_000,
        wait_timeout_ms_max: 10_000,
        waiters_per_key_max: 1,
        locks_held_max: 1,
        data_entries_max: 1,
        dedupe_entries_max: 8,
        ..Limits::default()
    };
    let mut s = Sm::new(limits.clone());
    s.token(acquire("k", "a", "1", None));
    s.apply(acquire("k", "b", "1", None));
    s.apply(Command::Put {
        key: "d".into(),
        value: b"v".to_vec(),
        guard: None,
        client_id: "a".into(),
        request_id: "p".into(),
    });
    let cases: Vec<(Command, RejectCode)> = vec![
        (acquire("", "a", "x", None), RejectCode::InvalidRequest),
        (acquire("123456789", "a", "x", None), RejectCode::TooLarge),
        (
            acquire("k", "a-long-client", "x", None),
            RejectCode::TooLarge,
        ),
        (
            Command::Acquire {
                key: "k".into(),
                client_id: "c".into(),
                request_id: "x".into(),
                ttl_ms: 0,
                wait_timeout_ms: None,
            },
            RejectCode::InvalidRequest,
        ),
        (
            Command::Acquire {
                key: "k".into(),
                client_id: "c".into(),
                request_id: "x".into(),
                ttl_ms: 10_001,
                wait_timeout_ms: None,
            },
            RejectCode::InvalidRequest,
        ),
        (
            Command::Acquire {
                key: "k".into(),
                client_id: "c".into(),
                request_id: "x".into(),
                ttl_ms: 1,
                wait_timeout_ms: Some(10_001),
            },
            RejectCode::InvalidRequest,
        ),
        (acquire("k", "c", "x", None), RejectCode::QueueFull),
        (acquire("other", "c", "x", None), RejectCode::LimitReached),
        (
            Command::Put {
                key: "d".into(),
                value: b"12345".to_vec(),
                guard: None,
                client_id: "a".into(),
                request_id: "x".into(),
            },
            RejectCode::TooLarge,
        ),
        (
            Command::Put {
                key: "e".into(),
                value: b"v".to_vec(),
                guard: None,
                client_id: "a".into(),
                request_id: "x".into(),
            },
            RejectCode::LimitReached,
        ),
        (
            Command::Release {
                key: "k".into(),
                client_id: "a".into(),
                request_id: "x".into(),
                token: FencingToken {
                    key: "other".into(),
                    value: 1,
                },
            },
            RejectCode::InvalidRequest,
        ),
    ];
    for (cmd, code) in cases {
        let before = observe(&s.sm);
        let data_before = s.sm.get("d").map(<[u8]>::to_vec);
        let seq = s.sm.fencing_sequence();
        let dedupe = s.sm.dedupe_len();
        match s.apply(cmd.clone()).0 {
            Outcome::Rejected { code: got, .. } => assert_eq!(got, code, "{cmd:?}"),
            other => panic!("{cmd:?}: expected {code:?}, got {other:?}"),
        }
        assert_eq!(observe(&s.sm), before, "{cmd:?} changed the locks");
        assert_eq!(s.sm.get("d").map(<[u8]>::to_vec), data_before);
        assert_eq!(s.sm.fencing_sequence(), seq);
        assert_eq!(s.sm.dedupe_len(), dedupe);
    }
    // Applying an index twice is refused.
    let again = s.sm.apply(1, &acquire("k", "z", "z", None));
    assert!(matches!(
        again.outcome,
        Outcome::Rejected {
            code: RejectCode::AlreadyApplied,
            ..
        }
    ));
}

#[test]
fn damaged_snapshots_are_errors_not_panics() {
    let mut s = Sm::new(Limits::default());
    for i in 0..20 {
        s.apply(acquire(&format!("k{i}"), "a", &format!("r{i}"), None));
    }
    let good = s.sm.snapshot();
    assert!(LockStateMachine::restore(&[], Limits::default()).is_err());
    for cut in [1, good.len() / 3, good.len() / 2, good.len() - 1] {
        assert!(
            LockStateMachine::restore(&good[..cut], Limits::default()).is_err(),
            "truncated to {cut} bytes was accepted"
        );
    }
    let mut rng = Rng(7);
    for _ in 0..500 {
        let mut bad = good.clone();
        let at = rng.below(bad.len() as u64) as usize;
        bad[at] ^= 1 << rng.below(8);
        // Either an error or a valid machine; never a panic.
        let _ = LockStateMachine::restore(&bad, Limits::default());
    }
}

#[test]
fn command_decoding_never_panics_on_garbage() {
    let mut rng = Rng(11);
    for _ in 0..5000 {
        let len = rng.below(64) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let _ = Command::decode(&bytes);
    }
}

#[test]
fn the_cluster_version_only_rises_and_is_stored_only_once_raised() {
    let mut sm = LockStateMachine::new(Limits::default());
    assert_eq!(sm.cluster_version(), 1);
    // Version 1 leaves no key: a RaftLock from before cluster versions reads this state.
    sm.apply(1, &Command::Tick { elapsed_ms: 10 });
    assert!(!sm.to_kv().iter().any(|(k, _)| k == b"meta/cluster_version"));
    assert!(!sm
        .take_changes()
        .iter()
        .any(|(k, _)| k == b"meta/cluster_version"));

    let raise = |v| Command::SetClusterVersion { version: v };
    assert_eq!(sm.apply(2, &raise(3)).outcome, Outcome::Stored);
    assert_eq!(sm.cluster_version(), 3);
    let changes = sm.take_changes();
    assert!(changes.iter().any(
        |(k, v)| k == b"meta/cluster_version" && v.as_deref() == Some(&3u32.to_be_bytes()[..])
    ));
    // Lower or equal versions change nothing.
    for (i, v) in [(3, 2), (4, 1), (5, 3), (6, 0)] {
        sm.apply(i, &raise(v));
        assert_eq!(sm.cluster_version(), 3);
        assert!(!sm
            .take_changes()
            .iter()
            .any(|(k, _)| k == b"meta/cluster_version"));
    }
    let reread = LockStateMachine::from_kv(sm.to_kv()).unwrap();
    assert_eq!(reread.cluster_version(), 3);
    assert_eq!(reread.to_kv(), sm.to_kv());

    // A stored version of the wrong size is refused, not guessed at.
    let mut kv = sm.to_kv();
    for (k, v) in kv.iter_mut() {
        if k == b"meta/cluster_version" {
            *v = vec![0, 3];
        }
    }
    assert!(LockStateMachine::from_kv(kv).is_err());
}

// ----- acknowledged answers (Command::Sequenced) --------------------------------------------

/// A state machine at the cluster version that knows acknowledgements, with `limits`.
fn acknowledging(limits: Limits) -> LockStateMachine {
    let mut sm = LockStateMachine::new(limits);
    sm.apply(
        1,
        &Command::SetClusterVersion {
            version: super::machine::SEQUENCED_VERSION,
        },
    );
    sm
}

fn put(client: &str, request: &str, key: &str) -> Command {
    Command::Put {
        key: key.into(),
        value: request.as_bytes().to_vec(),
        guard: None,
        client_id: client.into(),
        request_id: request.into(),
    }
}

fn sequenced(ack_below: u64, command: Command) -> Command {
    Command::Sequenced {
        ack_below,
        command: Box::new(command),
    }
}

/// The state without the applied index, which every entry moves.
fn state_but_applied(sm: &LockStateMachine) -> Vec<(Vec<u8>, Vec<u8>)> {
    sm.to_kv()
        .into_iter()
        .filter(|(k, _)| k != b"meta/applied")
        .collect()
}

fn code(o: &Outcome) -> Option<RejectCode> {
    match o {
        Outcome::Rejected { code, .. } => Some(*code),
        _ => None,
    }
}

#[test]
fn acknowledged_answers_are_forgotten_and_a_delayed_copy_is_refused_not_run() {
    let mut sm = acknowledging(Limits::default());
    let acquire = Command::Acquire {
        key: "k".into(),
        client_id: "c".into(),
        request_id: "1".into(),
        ttl_ms: 10_000,
        wait_timeout_ms: Some(0),
    };
    let granted = sm.apply(2, &sequenced(1, acquire.clone())).outcome;
    let Outcome::Granted { token, .. } = granted.clone() else {
        panic!("{granted:?}");
    };
    let release = Command::Release {
        key: "k".into(),
        client_id: "c".into(),
        request_id: "2".into(),
        token: token.clone(),
    };
    // Request 2 acknowledges request 1: its answer goes, request 2's stays.
    assert_eq!(
        sm.apply(3, &sequenced(2, release.clone())).outcome,
        Outcome::Released
    );
    assert_eq!(sm.session_len("c"), 1);
    // A delayed copy of the acquire (as first sent) would take the free lock again; it is
    // refused and changes nothing.
    let before = state_but_applied(&sm);
    let copy = sm.apply(4, &sequenced(1, acquire.clone()));
    assert_eq!(
        code(&copy.outcome),
        Some(RejectCode::Acknowledged),
        "{copy:?}"
    );
    assert!(copy.events.is_empty());
    assert_eq!(state_but_applied(&sm), before);
    assert!(sm.holder("k").is_none());
    // A retry of the request not yet acknowledged gets its answer back.
    let retry = sm.apply(5, &sequenced(2, release.clone()));
    assert!(retry.replayed);
    assert_eq!(retry.outcome, Outcome::Released);
    // The mark and the refusal outlive a reload from the stored state and from a snapshot.
    let mut store = BTreeMap::new();
    for (k, v) in sm.take_changes() {
        match v {
            Some(v) => store.insert(k, v),
            None => store.remove(&k),
        };
    }
    assert!(store.contains_key(&b"meta/ack/c"[..]));
    let snapshot = LockStateMachine::restore(&sm.snapshot(), Limits::default()).unwrap();
    for mut other in [LockStateMachine::from_kv(store.clone()).unwrap(), snapshot] {
        assert_eq!(other.to_kv(), sm.to_kv());
        let copy = other.apply(6, &sequenced(1, acquire.clone()));
        assert_eq!(code(&copy.outcome), Some(RejectCode::Acknowledged));
    }
    // Request 3 acknowledges 2: the session keeps only request 3's answer.
    let put3 = put("c", "3", "d");
    assert_eq!(sm.apply(6, &sequenced(3, put3)).outcome, Outcome::Stored);
    assert_eq!(sm.session_len("c"), 1);
    let copy = sm.apply(7, &sequenced(2, release));
    assert_eq!(code(&copy.outcome), Some(RejectCode::Acknowledged));
    // Requests without ackBelow work as before, beside the sequenced ones.
    assert_eq!(
        sm.apply(8, &put("c", "r-plain", "e")).outcome,
        Outcome::Stored
    );
    assert_eq!(sm.session_len("c"), 2);
}

#[test]
fn a_request_that_cannot_acknowledge_is_refused_and_changes_nothing() {
    let mut old = LockStateMachine::new(Limits::default());
    old.apply(1, &Command::SetClusterVersion { version: 2 });
    let before = state_but_applied(&old);
    let refused = old.apply(2, &sequenced(1, put("c", "1", "k"))).outcome;
    assert_eq!(
        code(&refused),
        Some(RejectCode::InvalidRequest),
        "{refused:?}"
    );
    assert_eq!(state_but_applied(&old), before);

    let mut sm = acknowledging(Limits::default());
    let cancel = Command::CancelWait {
        key: "k".into(),
        client_id: "c".into(),
        request_id: "4".into(),
    };
    let expire = Command::ExpireLease {
        key: "k".into(),
        token: 1,
        lease_index: 1,
    };
    let before = state_but_applied(&sm);
    for (i, bad) in [
        sequenced(1, put("c", "r1", "k")), // not a sequence number
        sequenced(1, put("c", "01", "k")), // not in its one spelling
        sequenced(1, put("c", "0", "k")),  // numbers start at 1
        sequenced(6, put("c", "5", "k")),  // acknowledges itself and more
        sequenced(1, put("c", "", "k")),   // no request id
        sequenced(1, cancel),              // leaves no answer
        sequenced(1, expire),              // not a client's request
        sequenced(1, put("c", "5", "")),   // invalid request
        sequenced(1, sequenced(1, put("c", "5", "k"))),
    ]
    .iter()
    .enumerate()
    {
        let out = sm.apply(2 + i as u64, bad).outcome;
        assert!(
            matches!(
                code(&out),
                Some(RejectCode::InvalidRequest | RejectCode::TooLarge)
            ),
            "{bad:?}: {out:?}"
        );
        assert_eq!(state_but_applied(&sm), before, "{bad:?} changed the state");
    }
}

#[test]
fn acknowledgements_keep_a_small_table_serving_a_client_that_never_pauses() {
    // A table of 8 answers kept for a long time: without acknowledgements the ninth request
    // within the retention is refused; with them one client goes on for as long as it likes.
    let limits = Limits {
        dedupe_entries_max: 8,
        dedupe_retain_ms: 3_600_000,
        session_idle_ms: 3_600_000,
        ..Limits::default()
    };
    let mut plain = acknowledging(limits.clone());
    let mut refused = 0;
    for i in 1..=20u64 {
        let out = plain.apply(1 + i, &put("c", &i.to_string(), "k")).outcome;
        refused += usize::from(code(&out) == Some(RejectCode::LimitReached));
    }
    assert_eq!(refused, 12);

    let mut sm = acknowledging(limits.clone());
    // The table is full of this client's own answers, then its acknowledgements make room.
    for i in 1..=8u64 {
        let out = sm.apply(1 + i, &sequenced(1, put("c", &i.to_string(), "k")));
        assert_eq!(out.outcome, Outcome::Stored);
    }
    assert_eq!(sm.dedupe_len(), 8);
    for i in 9..=1_000u64 {
        // Two requests in flight at a time: each acknowledges all but the one before it.
        let out = sm.apply(1 + i, &sequenced(i - 1, put("c", &i.to_string(), "k")));
        assert_eq!(out.outcome, Outcome::Stored, "request {i}");
        assert!(sm.dedupe_len() <= 2, "{} answers kept", sm.dedupe_len());
    }
    // Another client's plain requests find room too.
    assert_eq!(
        sm.apply(2_000, &put("d", "x", "k")).outcome,
        Outcome::Stored
    );
}

#[test]
fn a_session_with_only_a_mark_closes_when_idle_and_takes_its_mark_along() {
    let limits = Limits {
        dedupe_retain_ms: 1_000,
        session_idle_ms: 5_000,
        locks_held_max: 1,
        ..Limits::default()
    };
    let mut sm = acknowledging(limits);
    assert_eq!(
        sm.apply(2, &sequenced(1, put("c", "1", "k"))).outcome,
        Outcome::Stored
    );
    // An invalid request acknowledges nothing.
    let invalid = Command::Acquire {
        key: "k".into(),
        client_id: "c".into(),
        request_id: "2".into(),
        ttl_ms: 0,
        wait_timeout_ms: Some(0),
    };
    let out = sm.apply(3, &sequenced(2, invalid)).outcome;
    assert_eq!(code(&out), Some(RejectCode::InvalidRequest), "{out:?}");
    assert_eq!(sm.session_len("c"), 1);
    let held = Command::Acquire {
        key: "held".into(),
        client_id: "other".into(),
        request_id: "x".into(),
        ttl_ms: 60_000,
        wait_timeout_ms: Some(0),
    };
    assert!(matches!(
        sm.apply(4, &held).outcome,
        Outcome::Granted { .. }
    ));
    // The one lock the limits allow is held: request 2 is refused and leaves no answer, yet it
    // acknowledges request 1, whose answer goes; the session stays open for its mark.
    let another = Command::Acquire {
        key: "k2".into(),
        client_id: "c".into(),
        request_id: "2".into(),
        ttl_ms: 1_000,
        wait_timeout_ms: Some(0),
    };
    let out = sm.apply(5, &sequenced(2, another)).outcome;
    assert_eq!(code(&out), Some(RejectCode::LimitReached), "{out:?}");
    assert_eq!(sm.session_len("c"), 0);
    assert_eq!(sm.session_count(), 2, "c's session stays open for its mark");
    let copy = sm.apply(6, &sequenced(1, put("c", "1", "k"))).outcome;
    assert_eq!(code(&copy), Some(RejectCode::Acknowledged));
    sm.take_changes();
    // Idle for the session timeout: the session and its mark close.
    for i in 0..6 {
        sm.apply(7 + i, &Command::Tick { elapsed_ms: 1_000 });
    }
    assert_eq!(sm.session_count(), 0);
    let changes = sm.take_changes();
    assert!(changes
        .iter()
        .any(|(k, v)| k == b"meta/ack/c" && v.is_none()));
    assert!(!sm.to_kv().iter().any(|(k, _)| k.starts_with(b"meta/ack/")));
}

/// Clients that lose answers, retry, and have their old requests delivered again late, against
/// a state machine that is reloaded from its stored changes or from a snapshot now and then:
/// no request runs twice, every retry of an unacknowledged request gets its first answer, and
/// each client's kept answers stay within the requests it has not acknowledged.
#[test]
fn acknowledged_requests_run_at_most_once_through_losses_late_copies_and_reloads() {
    for seed in 0..40u64 {
        let mut rng = Rng(seed);
        let limits = Limits::default();
        let mut sm = acknowledging(limits.clone());
        let mut store: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        let mut index = 1u64;
        struct Client {
            next: u64,
            /// Sent, answer not received: (seq, command).
            waiting: BTreeMap<u64, Command>,
            /// Every copy ever sent (for late delivery).
            sent: Vec<Command>,
            /// `ack_below` of its latest new request.
            acked: u64,
        }
        let mut clients: Vec<Client> = (0..3)
            .map(|_| Client {
                next: 1,
                waiting: BTreeMap::new(),
                sent: Vec::new(),
                acked: 1,
            })
            .collect();
        let mut first: BTreeMap<(usize, u64), Outcome> = BTreeMap::new();
        let mut runs: BTreeMap<(usize, u64), usize> = BTreeMap::new();
        for step in 0..600 {
            let c = rng.below(3) as usize;
            let name = format!("c{c}");
            let client = &mut clients[c];
            let ack = |cl: &Client| cl.waiting.keys().next().copied().unwrap_or(cl.next);
            let (seq, cmd) = match rng.below(10) {
                0..=5 => {
                    let seq = client.next;
                    client.next += 1;
                    let key = format!("k{}", rng.below(4));
                    let cmd = put(&name, &seq.to_string(), &key);
                    client.waiting.insert(seq, cmd.clone());
                    client.acked = ack(client);
                    (seq, sequenced(client.acked, cmd))
                }
                6..=7 if !client.waiting.is_empty() => {
                    let n = rng.below(client.waiting.len() as u64) as usize;
                    let (&seq, cmd) = client.waiting.iter().nth(n).unwrap();
                    (seq, sequenced(ack(client), cmd.clone()))
                }
                _ if !client.sent.is_empty() => {
                    let n = rng.below(client.sent.len() as u64) as usize;
                    let late = client.sent[n].clone();
                    let seq: u64 = late.dedupe_id().unwrap().1.parse().unwrap();
                    (seq, late)
                }
                _ => continue,
            };
            client.sent.push(cmd.clone());
            index += 1;
            let applied = sm.apply(index, &cmd);
            let id = (c, seq);
            if applied.outcome.is_remembered_for(&cmd) && !applied.replayed {
                *runs.entry(id).or_default() += 1;
                assert_eq!(runs[&id], 1, "seed {seed} step {step}: {id:?} ran twice");
            }
            if code(&applied.outcome) == Some(RejectCode::Acknowledged) {
                assert!(
                    !client.waiting.contains_key(&seq),
                    "seed {seed} step {step}: {id:?} refused while its client waits for it"
                );
            }
            match first.get(&id) {
                Some(o) if client.waiting.contains_key(&seq) => assert_eq!(
                    &applied.outcome, o,
                    "seed {seed} step {step}: a retry of {id:?} got another answer"
                ),
                Some(_) => {}
                None => {
                    first.insert(id, applied.outcome.clone());
                }
            }
            // The answer arrives (or is lost: the client retries later).
            if rng.below(4) != 0 {
                client.waiting.remove(&seq);
            }
            // What is kept lies between the latest acknowledgement and the newest request.
            let kept = sm.session_len(&name) as u64;
            assert!(
                kept <= client.next - client.acked,
                "seed {seed} step {step}: {name} keeps {kept} answers; requests {}.. are \
                 not acknowledged, {} sent",
                client.acked,
                client.next - 1
            );
            for (k, v) in sm.take_changes() {
                match v {
                    Some(v) => store.insert(k, v),
                    None => store.remove(&k),
                };
            }
            match rng.below(50) {
                0 => {
                    sm = LockStateMachine::from_kv_with_limits(store.clone(), limits.clone())
                        .unwrap()
                }
                1 => sm = LockStateMachine::restore(&sm.snapshot(), limits.clone()).unwrap(),
                _ => {}
            }
        }
    }
}

/// The simulator's seed 69 of `healthy_core_passes_targeted_schedules` (`raftlock-sim --seeds 1
/// --start-seed 69 --nodes 5 --steps 4000 --clients-first-on-resume`): an acknowledging acquire
/// that found the lock held was answered `WAIT_TIMEOUT`; a copy of it delivered after the holder
/// released, before the client's next request acknowledged it, was granted — a lock held by a
/// client told it had not got it. An acknowledging request's answer is kept whatever it was, so
/// the copy gets the same answer.
#[test]
fn a_copy_of_an_acknowledging_request_gets_its_first_answer_even_if_nothing_changed() {
    let mut sm = acknowledging(Limits::default());
    let acquire = |client: &str, request: &str| Command::Acquire {
        key: "k".into(),
        client_id: client.into(),
        request_id: request.into(),
        ttl_ms: 10_000,
        wait_timeout_ms: Some(0),
    };
    let Outcome::Granted { token, .. } = sm.apply(2, &acquire("holder", "h")).outcome else {
        panic!("the holder's grant");
    };
    let attempt = sequenced(19, acquire("c", "19"));
    assert_eq!(sm.apply(3, &attempt).outcome, Outcome::Busy);
    let release = Command::Release {
        key: "k".into(),
        client_id: "holder".into(),
        request_id: "h2".into(),
        token,
    };
    assert_eq!(sm.apply(4, &release).outcome, Outcome::Released);
    let copy = sm.apply(5, &attempt);
    assert!(copy.replayed, "{copy:?}");
    assert_eq!(copy.outcome, Outcome::Busy);
    assert!(sm.holder("k").is_none());
    // The client's next request acknowledges it, and a later copy is refused.
    let next = sequenced(20, put("c", "20", "d"));
    assert_eq!(sm.apply(6, &next).outcome, Outcome::Stored);
    assert_eq!(
        code(&sm.apply(7, &attempt).outcome),
        Some(RejectCode::Acknowledged)
    );
    assert!(sm.holder("k").is_none());
    // Rejections are not kept: bad input is judged again, and changes nothing either way.
    let bad = sequenced(21, put("c", "21", ""));
    assert!(sm.apply(8, &bad).outcome != Outcome::Stored);
    assert!(!sm.apply(9, &bad).replayed);
}

#[test]
fn cluster_id_is_set_once_and_the_member_table_round_trips() {
    let mut sm = LockStateMachine::new(Limits::default());
    assert_eq!(sm.cluster_id(), None);
    sm.apply(
        1,
        &Command::SetClusterId {
            id: 0xabc,
            forced_by: String::new(),
        },
    );
    // A second id never replaces the first: a cluster's id never changes.
    sm.apply(
        2,
        &Command::SetClusterId {
            id: 0xdef,
            forced_by: "again".into(),
        },
    );
    assert_eq!(sm.cluster_id(), Some(0xabc));
    let info = crate::lock::MemberInfo {
        peer_addr: "node-1:7000".into(),
        client_addr: "node-1:50050".into(),
        incarnation: 42,
    };
    sm.apply(
        3,
        &Command::SetMember {
            id: 1,
            info: Some(info.clone()),
        },
    );
    // Over-long addresses are refused the same way by every replica.
    let long = crate::lock::MemberInfo {
        peer_addr: "x".repeat(crate::lock::MEMBER_ADDR_MAX + 1),
        ..info.clone()
    };
    sm.apply(
        4,
        &Command::SetMember {
            id: 2,
            info: Some(long),
        },
    );
    assert_eq!(sm.members().len(), 1);
    let changes = sm.take_changes();
    assert!(changes.iter().any(|(k, _)| k == b"meta/cluster"));
    assert!(changes.iter().any(|(k, _)| k == b"meta/members"));
    let reread = LockStateMachine::from_kv(sm.to_kv()).unwrap();
    assert_eq!(reread.cluster_id(), Some(0xabc));
    assert_eq!(reread.members().get(&1), Some(&info));
    // Forgetting a member.
    sm.apply(5, &Command::SetMember { id: 1, info: None });
    assert!(sm.members().is_empty());
    let reread = LockStateMachine::from_kv(sm.to_kv()).unwrap();
    assert!(reread.members().is_empty());
    for cmd in [
        Command::SetClusterId {
            id: 7,
            forced_by: "n".into(),
        },
        Command::SetMember {
            id: 3,
            info: Some(info),
        },
    ] {
        assert_eq!(Command::decode(&cmd.encode()).unwrap(), cmd);
    }
}

#[test]
fn election_values_count_against_the_lock_byte_budget() {
    let mut sm = LockStateMachine::new(Limits::default());
    let mut index = 0;
    let mut apply = |sm: &mut LockStateMachine, c: Command| {
        index += 1;
        let outcome = sm.apply(index, &c).outcome;
        assert_eq!(sm.accounting_mismatch(), None, "after {c:?}");
        outcome
    };
    apply(&mut sm, Command::SetClusterVersion { version: 7 });
    let quotas = crate::lock::Quotas {
        lock_bytes_max: 1_000,
        ..crate::lock::Quotas::default()
    };
    apply(&mut sm, Command::SetQuotas { quotas });
    let campaign = |client: &str, request: &str, bytes: usize| Command::Campaign {
        key: "e".into(),
        client_id: client.into(),
        request_id: request.into(),
        ttl_ms: 1_000,
        wait_timeout_ms: None,
        value: vec![b'v'; bytes],
    };
    let proclaim = |request: &str, token: u64, bytes: usize| Command::Proclaim {
        key: "e".into(),
        client_id: "a".into(),
        request_id: request.into(),
        token: FencingToken {
            key: "e".into(),
            value: token,
        },
        value: vec![b'p'; bytes],
    };
    // A value that would pass the budget is refused and changes nothing.
    assert!(is_limit(&apply(&mut sm, campaign("a", "a1", 950))));
    assert_eq!(sm.bytes_used().1, 0);
    assert!(!sm.is_election("e"));
    let Outcome::Granted { token, .. } = apply(&mut sm, campaign("a", "a2", 300)) else {
        panic!("a is elected");
    };
    let leader = sm.bytes_used().1;
    assert!(leader > 300, "{leader}");
    // A proclaim may not grow past the budget; a smaller value gives bytes back.
    assert!(is_limit(&apply(&mut sm, proclaim("a3", token.value, 950))));
    assert!(matches!(
        apply(&mut sm, proclaim("a4", token.value, 100)),
        Outcome::Proclaimed { .. }
    ));
    assert_eq!(sm.bytes_used().1, leader - 200);
    // A waiting candidate's value counts while it waits, and goes when it stops waiting.
    assert!(matches!(
        apply(&mut sm, campaign("b", "b1", 200)),
        Outcome::Queued { .. }
    ));
    let with_candidate = sm.bytes_used().1;
    assert!(with_candidate > leader - 200 + 200);
    apply(
        &mut sm,
        Command::CancelWait {
            key: "e".into(),
            client_id: "b".into(),
            request_id: "b1".into(),
        },
    );
    assert_eq!(sm.bytes_used().1, leader - 200);
    // Handed on: the candidate's value becomes the leader's; the election gone, nothing counts.
    apply(&mut sm, campaign("b", "b2", 200));
    apply(&mut sm, release("e", "a", "a5", token.value));
    assert_eq!(
        sm.election("e").and_then(|e| e.value),
        Some(vec![b'v'; 200])
    );
    let next = sm.election("e").and_then(|e| e.leader).expect("b leads").1;
    apply(&mut sm, release("e", "b", "b3", next));
    assert!(!sm.is_election("e"));
    assert_eq!(sm.bytes_used().1, 0);
    // Restored from its own snapshot, the state counts the same.
    apply(&mut sm, campaign("c", "c1", 123));
    let restored = LockStateMachine::restore(&sm.snapshot(), Limits::default()).expect("restore");
    assert_eq!(restored.bytes_used(), sm.bytes_used());
}

#[test]
fn a_retried_attached_acquire_gets_its_outcome_after_the_session_ended() {
    // Found by simulator seed 867 (5 nodes, client sessions): an acquire attached to its
    // client's session was granted, the session ended, and the client's retry with the same request id
    // was refused as sessionless (`INVALID_REQUEST`, "nothing happened"), though the lock had
    // been held and others had been refused meanwhile. The session is checked after the
    // exactly-once table.
    let mut s = Sm::new(Limits::default());
    s.apply(Command::SetClusterVersion { version: 8 });
    let session = match s
        .apply(Command::KeepAlive {
            client_id: "a".into(),
            session: 0,
            ttl_ms: 1_000,
        })
        .0
    {
        Outcome::SessionKept { session, .. } => session,
        other => panic!("expected a session, got {other:?}"),
    };
    let attached = Command::Acquire {
        key: "k".into(),
        client_id: "a".into(),
        request_id: "1".into(),
        ttl_ms: 0,
        wait_timeout_ms: None,
    };
    let token = s.token(attached.clone());
    s.apply(Command::EndSession {
        client_id: "a".into(),
        session,
    });
    let retry = s.apply(attached).0;
    assert!(
        matches!(&retry, Outcome::StaleToken { .. } | Outcome::Granted { .. }),
        "retry after the session ended (token {token}): {retry:?}"
    );
    // A new attached acquire without a session is still refused.
    let fresh = s
        .apply(Command::Acquire {
            key: "k".into(),
            client_id: "a".into(),
            request_id: "2".into(),
            ttl_ms: 0,
            wait_timeout_ms: None,
        })
        .0;
    assert_eq!(code(&fresh), Some(RejectCode::InvalidRequest), "{fresh:?}");
}
