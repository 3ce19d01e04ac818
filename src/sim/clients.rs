//! Simulated clients: they talk to nodes only through messages, as real clients do, and every
//! operation goes into a history that is checked at the end of a run.
//!
//! A client sends to the node it believes leads (stale leaders included), follows `NOT_LEADER`
//! redirects, times out and retries with the same request id on another node, and keeps its own
//! clock, drifting within ±[`CLIENT_DRIFT_PPM`]. It believes it holds a lock from the grant's
//! arrival until *send time + TTL − TTL/5* on its own clock (the SDK's rule; the send time is the
//! first attempt's), or until it sends the release.
//!
//! History checks:
//! - **one holder at a time**: no two clients believe they hold one key at the same real time;
//! - **tokens grow in real time**: a grant acknowledged before another acquire of the key was
//!   invoked carries a smaller token than that acquire's grant;
//! - **linearizable reads**: a read returns the value of a write that committed no earlier than
//!   every write acknowledged before the read was invoked (write order is the log order);
//! - **linearizable**: each key's history (lock operations, or KV puts and reads) has a
//!   linearization against a sequential model in which leases end only once real time may have
//!   reached them (see [`super::linearizability`]);
//! - **every request answered**: once the network is healed and a leader is stable, every
//!   operation completes with an answer (not by giving up).

use std::collections::BTreeMap;

use rand::Rng;

use super::checker::Violation;
use super::linearizability::{self, HoldMode, KvOp, LinOp, LockOp, OpKind, SharedOp};
use crate::lock::LockMode;
use crate::node::api::{ClientOp, ClientReply, ErrorCode, SharedGrant};
use crate::raft::NodeId;

/// Largest drift of a client's clock from real time, in parts per million.
pub const CLIENT_DRIFT_PPM: i64 = 5_000;
/// Attempts per operation before a client gives up on it …
const MAX_ATTEMPTS: u32 = 60;
/// … or time since its first attempt (the SDK's default retry budget is 30 s; elections after
/// heavy faults and membership changes take up to a few simulated seconds).
const GIVE_UP_AFTER_US: u64 = 4_000_000;
/// How long a client waits for an answer beyond the operation's own wait.
const ANSWER_TIMEOUT_US: u64 = 400_000;

/// Where a node sends an answer: the client and the attempt it answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReplyTo {
    pub client: usize,
    pub attempt: u64,
}

/// One operation as the history records it.
#[derive(Clone, Debug)]
pub struct HistoryOp {
    pub client: usize,
    pub op: ClientOp,
    pub invoke_us: u64,
    pub complete_us: Option<u64>,
    /// The answer, if one came (None: gave up or still running).
    pub reply: Option<ClientReply>,
    pub attempts: u32,
}

/// A held lock as its client believes it.
#[derive(Clone, Debug)]
struct Held {
    token: u64,
    /// Attached to the client's session: its lease is the session's.
    attached: bool,
}

/// Semaphores' size in the client mix (`sem-*` keys).
pub const SEM_PERMITS: u32 = 2;

/// Whether `key` is a read-write lock's or a semaphore's in the client mix.
pub fn is_shared_key(key: &str) -> bool {
    key.starts_with("rw-") || key.starts_with("sem-")
}

/// The client's session as it believes it.
#[derive(Clone, Debug)]
struct SimSession {
    /// The log index that opened it (0 until the first keepalive is answered).
    id: u64,
    ttl_ms: u64,
    /// Real time until which the client believes the session lives: the latest acknowledged
    /// keepalive's send time + TTL − TTL/5 on its own clock (the SDK's rule).
    until: u64,
}

struct InFlight {
    hist: usize,
    attempt: u64,
    attempts: u32,
    /// The first attempt's send time on the client's clock (the SDK's lease rule).
    first_sent_local: u64,
    deadline_us: u64,
    target: NodeId,
}

struct SimClient {
    name: String,
    drift_ppm: i64,
    believed_leader: NodeId,
    op: Option<InFlight>,
    held: BTreeMap<String, Held>,
    next_action_us: u64,
    next_request: u64,
    /// Numbers its requests and sends each with `ackBelow` its own number (it has one request
    /// in flight at a time, so every earlier one was answered or given up on).
    acknowledges: bool,
    /// The history entry of its latest request.
    last: Option<usize>,
    session: Option<SimSession>,
}

impl SimClient {
    fn local(&self, real: u64) -> u64 {
        (real as i128 * (1_000_000 + self.drift_ppm as i128) / 1_000_000) as u64
    }

    /// The locks it believes it holds attached to its session: (key, token).
    fn attached_locks(&self) -> Vec<(String, u64)> {
        self.held
            .iter()
            .filter(|(_, h)| h.attached)
            .map(|(k, h)| (k.clone(), h.token))
            .collect()
    }

    fn real(&self, local: u64) -> u64 {
        (local as i128 * 1_000_000 / (1_000_000 + self.drift_ppm as i128)) as u64
    }
}

/// A belief interval: `client` believed it held `key` with `token` over `[from, until)` (real µs).
#[derive(Clone, Debug)]
struct Belief {
    client: usize,
    token: u64,
    from: u64,
    until: u64,
    /// How a read-write lock or semaphore is held (`None`: exclusively).
    shared: Option<SharedGrant>,
}

/// Whether two holders may hold one key at once: readers beside readers, permits in
/// different slots.
fn may_share(a: Option<SharedGrant>, b: Option<SharedGrant>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => match (a.mode, b.mode) {
            (LockMode::Read, LockMode::Read) => true,
            (LockMode::Permit, LockMode::Permit) => a.slot != b.slot,
            _ => false,
        },
        _ => false,
    }
}

/// Counters for the summary line.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientStats {
    pub ops: u64,
    pub answered: u64,
    pub gave_up: u64,
    pub redirects: u64,
    pub retries: u64,
    pub beliefs: u64,
    pub expiries_seen: u64,
    pub reads_checked: u64,
    /// Keys whose whole history was checked for linearizability, and keys left unchecked (too
    /// long a history or too large a search).
    pub lin_checked: u64,
    pub lin_unchecked: u64,
}

pub struct SimClients {
    clients: Vec<SimClient>,
    keys: usize,
    pub history: Vec<HistoryOp>,
    beliefs: BTreeMap<String, Vec<Belief>>,
    next_attempt: u64,
    /// Attempt id -> history index, for answers.
    attempts: BTreeMap<u64, usize>,
    /// Stop issuing new operations (the end of a run).
    pub quiet: bool,
    /// Print every attempt and answer to stderr.
    pub trace: bool,
    /// Some operations are on leader elections (see `SimConfig::client_elections`).
    pub elections: bool,
    /// Some operations keep a session and attach locks to it (drawn only when on).
    pub sessions: bool,
    /// Some operations are on read-write locks and semaphores (drawn only when on).
    pub shared: bool,
    /// Campaigns may be attached to the client's session.
    pub attached_campaigns: bool,
    pub stats: ClientStats,
    pub violations: Vec<Violation>,
}

/// A message a client sends to a node.
pub type Send = (NodeId, ClientOp, ReplyTo);

impl SimClients {
    pub fn new(count: usize, keys: usize, first_node: NodeId, rng: &mut impl Rng) -> Self {
        let clients = (0..count)
            .map(|c| SimClient {
                name: format!("client-{c}"),
                drift_ppm: rng.random_range(-CLIENT_DRIFT_PPM..=CLIENT_DRIFT_PPM),
                believed_leader: first_node,
                op: None,
                held: BTreeMap::new(),
                next_action_us: rng.random_range(0..20_000),
                next_request: 0,
                acknowledges: c % 2 == 1,
                last: None,
                session: None,
            })
            .collect();
        SimClients {
            clients,
            keys,
            history: Vec::new(),
            beliefs: BTreeMap::new(),
            next_attempt: 0,
            attempts: BTreeMap::new(),
            quiet: false,
            trace: false,
            elections: true,
            sessions: true,
            shared: true,
            attached_campaigns: true,
            stats: ClientStats::default(),
            violations: Vec::new(),
        }
    }

    /// When some client next needs to act (start an operation or time out).
    pub fn next_wakeup(&self) -> Option<u64> {
        self.clients
            .iter()
            .filter_map(|c| match &c.op {
                Some(op) => Some(op.deadline_us),
                None if self.quiet => None,
                None => Some(c.next_action_us),
            })
            .min()
    }

    /// Operations still running.
    pub fn in_flight(&self) -> usize {
        self.clients.iter().filter(|c| c.op.is_some()).count()
    }

    /// Lets clients act at `now`: time out and retry, or start a new operation.
    pub fn wake(&mut self, now: u64, nodes: &[NodeId], rng: &mut impl Rng) -> Vec<Send> {
        let mut sends = Vec::new();
        for c in 0..self.clients.len() {
            let client = &self.clients[c];
            match &client.op {
                Some(op) if op.deadline_us <= now => {
                    // No answer in time, or a backoff ended: retry the same request, on the
                    // believed leader if it was not the node that just failed, else anywhere.
                    let target = if client.believed_leader != op.target {
                        client.believed_leader
                    } else {
                        *pick(nodes, rng).unwrap_or(&op.target)
                    };
                    self.stats.retries += 1;
                    if let Some(send) = self.resend(c, now, target) {
                        sends.push(send);
                    }
                }
                None if !self.quiet && client.next_action_us <= now => {
                    if let Some(copy) = self.late_copy(c, nodes, rng) {
                        sends.push(copy);
                    }
                    if let Some(send) = self.start(c, now, rng) {
                        sends.push(send);
                    }
                }
                _ => {}
            }
        }
        sends
    }

    /// Now and then, for a client that acknowledges answers: one more copy of its previous
    /// request, which it had the answer of, sent with the next one to any node (a duplicate the
    /// network delivers late). It must be answered from the table or refused as acknowledged,
    /// never run again (the lock checks see a second run); its answer goes nowhere.
    fn late_copy(&mut self, c: usize, nodes: &[NodeId], rng: &mut impl Rng) -> Option<Send> {
        let client = &self.clients[c];
        if !client.acknowledges || !rng.random_bool(0.1) {
            return None;
        }
        let last = &self.history[client.last?];
        last.reply.as_ref()?;
        let own = crate::lock::sequence_number(last.op.request_id())?;
        let copy = ClientOp::sequenced(last.op.clone(), Some(own)).ok()?;
        let target = *pick(nodes, rng)?;
        Some((
            target,
            copy,
            ReplyTo {
                client: c,
                attempt: 0,
            },
        ))
    }

    fn start(&mut self, c: usize, now: u64, rng: &mut impl Rng) -> Option<Send> {
        let client = &mut self.clients[c];
        client.next_request += 1;
        let acknowledges = client.acknowledges;
        let numbered = move |n: u64| match acknowledges {
            true => n.to_string(),
            false => format!("r{n}"),
        };
        let request_id = numbered(client.next_request);
        let client_id = client.name.clone();
        let k = rng.random_range(0..self.keys);
        // About one operation in seven keeps the client's session or attaches a lock to it.
        // (Drawn only with sessions on: off, the mix and its draws are those from before.)
        if self.sessions && rng.random_bool(0.15) {
            // Attached locks have keys of their own: the history check models an end of the
            // session as an expiry, which on a key with a lock-delay would hold the key back
            // where the end (a release) does not.
            let key = format!("sess-{k}");
            let held = client.held.contains_key(&key);
            let op = match &client.session {
                None => ClientOp::KeepAlive {
                    client_id,
                    session: 0,
                    ttl_ms: rng.random_range(100..600),
                },
                Some(s) => match rng.random_range(0..100) {
                    0..=39 => ClientOp::KeepAlive {
                        client_id,
                        session: s.id,
                        ttl_ms: s.ttl_ms,
                    },
                    40..=89 if !held => ClientOp::Acquire {
                        key,
                        client_id,
                        request_id,
                        ttl_ms: 0,
                        wait_timeout_ms: match rng.random_range(0..4) {
                            0 => Some(0),
                            _ => Some(rng.random_range(20..600)),
                        },
                    },
                    40..=89 => ClientOp::KeepAlive {
                        client_id,
                        session: s.id,
                        ttl_ms: s.ttl_ms,
                    },
                    _ => ClientOp::EndSession {
                        client_id,
                        session: s.id,
                    },
                },
            };
            // Ending the session ends the belief in every attached lock when it is sent.
            if let ClientOp::EndSession { .. } = &op {
                client.session = None;
                let attached = client.attached_locks();
                for (key, token) in attached {
                    client.held.remove(&key);
                    end_belief(&mut self.beliefs, &key, c, token, now);
                }
            }
            return self.begin(c, now, op);
        }
        // About one operation in six is on a read-write lock (`rw-*`) or a semaphore of
        // `SEM_PERMITS` permits (`sem-*`). (Drawn only with shared locks on: off, the mix and
        // its draws are those from before.)
        if self.shared && rng.random_bool(0.2) {
            // Two keys of each kind, so that holders and waiters meet (a writer queued
            // between readers, a full semaphore).
            let rw = rng.random_bool(0.5);
            let key = if rw {
                format!("rw-{}", k % 2)
            } else {
                format!("sem-{}", k % 2)
            };
            let held = client.held.get(&key).cloned();
            let roll = rng.random_range(0..100);
            // A third of the acquires of a client with a session are attached to it (drawn
            // only then: without sessions, the mix and its draws are those from before).
            let attach = self.sessions && client.session.is_some() && rng.random_bool(0.3);
            let op = match (roll, held) {
                (0..=84, None) => ClientOp::AcquireShared {
                    key,
                    client_id,
                    request_id,
                    ttl_ms: if attach { 0 } else { rng.random_range(30..400) },
                    wait_timeout_ms: match rng.random_range(0..5) {
                        0 => Some(0),
                        1 => None,
                        _ => Some(rng.random_range(20..600)),
                    },
                    mode: match (rw, rng.random_bool(0.7)) {
                        (true, true) => LockMode::Read,
                        (true, false) => LockMode::Write,
                        (false, _) => LockMode::Permit,
                    },
                    permits: if rw { 0 } else { SEM_PERMITS },
                },
                (_, None) => ClientOp::CancelWait {
                    key,
                    client_id,
                    request_id: numbered(
                        client.next_request.saturating_sub(rng.random_range(1..6)),
                    ),
                },
                (0..=49, Some(h)) => ClientOp::Release {
                    key,
                    client_id,
                    request_id,
                    token: h.token,
                },
                (50..=89, Some(h)) => ClientOp::Renew {
                    key,
                    client_id,
                    request_id,
                    token: h.token,
                    ttl_ms: rng.random_range(30..400),
                },
                (_, Some(h)) => ClientOp::Release {
                    key,
                    client_id,
                    request_id,
                    // Now and then another holder's or a made-up token.
                    token: h.token.saturating_sub(rng.random_range(0..3)),
                },
            };
            return self.start_with(c, now, op);
        }
        // One operation in five is on an election (`elect-*`) rather than a lock.
        // (Drawn only with elections on: off, the mix and its draws are those from before.)
        let election = self.elections && rng.random_bool(0.2);
        let key = if election {
            format!("elect-{k}")
        } else {
            format!("key-{k}")
        };
        let held = client.held.get(&key).cloned();
        let roll = rng.random_range(0..100);
        // A campaign's or proclaim's value: unique, so the checks can tell which one shows.
        let value = format!("{}/{}", client.name, client.next_request).into_bytes();
        let op = match (roll, held) {
            (0..=64, None) if election => ClientOp::Campaign {
                key,
                client_id,
                request_id,
                // A third of the campaigns of a client with a session are attached to it.
                ttl_ms: if self.attached_campaigns
                    && client.session.is_some()
                    && rng.random_bool(0.3)
                {
                    0
                } else {
                    rng.random_range(30..400)
                },
                wait_timeout_ms: match rng.random_range(0..5) {
                    0 => Some(0),
                    1 => None,
                    _ => Some(rng.random_range(20..600)),
                },
                value,
            },
            (_, None) if election => ClientOp::Leader { key },
            (0..=29, Some(h)) if election => ClientOp::Proclaim {
                key,
                client_id,
                request_id,
                // Now and then a stale or made-up term.
                token: if rng.random_bool(0.8) {
                    h.token
                } else {
                    rng.random_range(1..50)
                },
                value,
            },
            (30..=54, Some(h)) if election => ClientOp::Renew {
                key,
                client_id,
                request_id,
                token: h.token,
                ttl_ms: rng.random_range(30..400),
            },
            (55..=74, Some(_)) if election => ClientOp::Leader { key },
            (_, Some(h)) if election => ClientOp::Release {
                key,
                client_id,
                request_id,
                token: h.token,
            },
            (0..=44, None) => ClientOp::Acquire {
                key,
                client_id,
                request_id,
                ttl_ms: rng.random_range(30..400),
                wait_timeout_ms: match rng.random_range(0..5) {
                    0 => Some(0),
                    1 => None,
                    _ => Some(rng.random_range(20..600)),
                },
            },
            (0..=29, Some(h)) => ClientOp::Release {
                key,
                client_id,
                request_id,
                token: h.token,
            },
            (30..=54, Some(h)) => ClientOp::Renew {
                key,
                client_id,
                request_id,
                token: h.token,
                ttl_ms: rng.random_range(30..400),
            },
            (55..=74, held) => ClientOp::Put {
                key: format!("data-{k}"),
                value: format!("{c}/{}", self.history.len()).into_bytes(),
                guard: held.map(|h| crate::lock::FencingToken {
                    key: key.clone(),
                    value: h.token,
                }),
                client_id,
                request_id,
            },
            (75..=89, _) => ClientOp::Get {
                key: format!("data-{k}"),
            },
            (_, Some(h)) => ClientOp::Release {
                key,
                client_id,
                request_id,
                // Now and then a stale or made-up token.
                token: if rng.random_bool(0.5) {
                    h.token
                } else {
                    rng.random_range(1..50)
                },
            },
            // A key's lock-delay set (or removed): later expiries of the key hold it back.
            (90..=92, None) => ClientOp::SetLockDelay {
                key,
                delay_ms: [0, 40, 150, 300][rng.random_range(0..4)],
                client_id,
                request_id,
            },
            (_, None) => ClientOp::CancelWait {
                key,
                client_id,
                request_id: numbered(client.next_request.saturating_sub(rng.random_range(1..6))),
            },
        };
        self.start_with(c, now, op)
    }

    /// Sends a new operation, ending or shortening the client's beliefs first as its sending
    /// allows.
    fn start_with(&mut self, c: usize, now: u64, op: ClientOp) -> Option<Send> {
        let client = &mut self.clients[c];
        // A release ends the belief when it is sent.
        if let ClientOp::Release { key, .. } = &op {
            if let Some(h) = client.held.remove(key) {
                end_belief(&mut self.beliefs, key, c, h.token, now);
            }
        }
        // A renew may shorten the lease from the moment it applies, answered or not: from its
        // sending, the belief lasts no longer than the new TTL allows.
        if let ClientOp::Renew {
            key, token, ttl_ms, ..
        } = &op
        {
            let until = client.real(client.local(now) + (ttl_ms - ttl_ms / 5) * 1_000);
            end_belief(&mut self.beliefs, key, c, *token, until);
        }
        self.begin(c, now, op)
    }

    /// Records `op` as client `c`'s current operation and sends its first attempt.
    fn begin(&mut self, c: usize, now: u64, op: ClientOp) -> Option<Send> {
        let client = &mut self.clients[c];
        let hist = self.history.len();
        client.last = Some(hist);
        self.history.push(HistoryOp {
            client: c,
            op,
            invoke_us: now,
            complete_us: None,
            reply: None,
            attempts: 0,
        });
        self.stats.ops += 1;
        let client = &mut self.clients[c];
        let target = client.believed_leader;
        client.op = Some(InFlight {
            hist,
            attempt: 0,
            attempts: 0,
            first_sent_local: client.local(now),
            deadline_us: now,
            target,
        });
        self.resend(c, now, target)
    }

    /// Sends (again) the client's current operation to `target`.
    fn resend(&mut self, c: usize, now: u64, target: NodeId) -> Option<Send> {
        let client = &mut self.clients[c];
        let first_sent = client.real(client.op.as_ref()?.first_sent_local);
        let inflight = client.op.as_mut()?;
        if inflight.attempts >= MAX_ATTEMPTS || now >= first_sent + GIVE_UP_AFTER_US {
            let hist = inflight.hist;
            client.op = None;
            client.next_action_us = now + 1_000;
            self.history[hist].complete_us = Some(now);
            self.stats.gave_up += 1;
            return None;
        }
        self.next_attempt += 1;
        let attempt = self.next_attempt;
        if let Some(old) = Some(inflight.attempt).filter(|&a| a != 0) {
            self.attempts.remove(&old);
        }
        inflight.attempt = attempt;
        inflight.attempts += 1;
        inflight.target = target;
        let mut op = self.history[inflight.hist].op.clone();
        if client.acknowledges {
            let own = crate::lock::sequence_number(op.request_id());
            op = match ClientOp::sequenced(op.clone(), own) {
                Ok(sequenced) => sequenced,
                Err(_) => op,
            };
        }
        let wait_us = match &op.request() {
            ClientOp::Acquire {
                wait_timeout_ms: Some(ms),
                ..
            }
            | ClientOp::Campaign {
                wait_timeout_ms: Some(ms),
                ..
            } => ms * 1_000,
            ClientOp::Acquire {
                wait_timeout_ms: None,
                ..
            }
            | ClientOp::Campaign {
                wait_timeout_ms: None,
                ..
            } => 1_500_000,
            _ => 0,
        };
        inflight.deadline_us = now + wait_us + ANSWER_TIMEOUT_US;
        self.history[inflight.hist].attempts = inflight.attempts;
        if self.trace {
            eprintln!("t={now} client-{c} attempt {attempt} -> node {target}: {op:?}");
        }
        self.attempts.insert(attempt, inflight.hist);
        Some((target, op, ReplyTo { client: c, attempt }))
    }

    /// An answer arrived at a client. Returns a message to send at once (a redirect).
    pub fn on_reply(
        &mut self,
        now: u64,
        to: ReplyTo,
        reply: ClientReply,
        nodes: &[NodeId],
        rng: &mut impl Rng,
    ) -> Option<Send> {
        if self.trace {
            eprintln!(
                "t={now} client-{} answer to attempt {}: {reply:?}",
                to.client, to.attempt
            );
        }
        let Some(&hist) = self.attempts.get(&to.attempt) else {
            return None; // an answer to an attempt the client already gave up on
        };
        let c = to.client;
        let current = self.clients[c]
            .op
            .as_ref()
            .is_some_and(|op| op.attempt == to.attempt);
        if !current {
            return None;
        }
        if let ClientReply::Error(e) = &reply {
            match e.code {
                ErrorCode::Acknowledged => self.violations.push(Violation {
                    invariant: "acknowledgements",
                    detail: format!(
                        "t={now}: client-{c}'s request {:?}, which it never acknowledged, was \
                         refused as acknowledged: {}",
                        self.history[hist].op.request_id(),
                        e.message
                    ),
                }),
                ErrorCode::NotLeader if e.leader_id != 0 => {
                    self.stats.redirects += 1;
                    self.clients[c].believed_leader = e.leader_id;
                    return self.resend(c, now, e.leader_id);
                }
                code if code.is_retryable() => {
                    // Back off exponentially (with jitter), then retry on some node.
                    let client = &mut self.clients[c];
                    let op = client.op.as_mut().expect("current");
                    let backoff = (5_000u64 << op.attempts.min(6)).min(200_000);
                    op.deadline_us = now + rng.random_range(backoff / 2..=backoff);
                    if let Some(&target) = pick(nodes, rng) {
                        client.believed_leader = target;
                    }
                    self.attempts.remove(&to.attempt);
                    return None;
                }
                _ => {}
            }
        }
        // A final answer.
        self.attempts.remove(&to.attempt);
        let inflight = self.clients[c].op.take().expect("current");
        self.stats.answered += 1;
        let client = &mut self.clients[c];
        client.next_action_us = now + rng.random_range(1_000..30_000);
        let entry = &mut self.history[hist];
        entry.complete_us = Some(now);
        entry.reply = Some(reply.clone());
        let first_sent = inflight.first_sent_local;
        match (&entry.op, &reply) {
            (
                ClientOp::Acquire { key, .. }
                | ClientOp::Campaign { key, .. }
                | ClientOp::AcquireShared { key, .. },
                ClientReply::Granted {
                    token,
                    expires_in_ms,
                    shared,
                    ..
                },
            )
            | (
                ClientOp::Renew { key, .. },
                ClientReply::Renewed {
                    token,
                    expires_in_ms,
                    shared,
                    ..
                },
            ) => {
                let margin = expires_in_ms / 5;
                let until_local = first_sent + (expires_in_ms - margin) * 1_000;
                // A lock attached to the session lasts as long as the client believes the
                // session does.
                let attached = matches!(
                    &entry.op,
                    ClientOp::Acquire { ttl_ms: 0, .. }
                        | ClientOp::AcquireShared { ttl_ms: 0, .. }
                        | ClientOp::Campaign { ttl_ms: 0, .. }
                        | ClientOp::Renew { ttl_ms: 0, .. }
                );
                let until = match &client.session {
                    Some(s) if attached => s.until,
                    _ if attached => now,
                    _ => client.real(until_local),
                };
                client.held.insert(
                    key.clone(),
                    Held {
                        token: token.value,
                        attached,
                    },
                );
                self.stats.beliefs += 1;
                let beliefs = self.beliefs.entry(key.clone()).or_default();
                match beliefs
                    .iter_mut()
                    .rev()
                    .find(|b| b.client == c && b.token == token.value)
                {
                    // A renew restarts the lease with its own TTL, which may be shorter.
                    Some(b) if b.until >= now => b.until = until.max(now),
                    _ => beliefs.push(Belief {
                        client: c,
                        token: token.value,
                        from: now,
                        until: until.max(now),
                        shared: *shared,
                    }),
                }
            }
            (
                ClientOp::Renew { key, .. } | ClientOp::Proclaim { key, .. },
                ClientReply::Error(e),
            ) if matches!(e.code, ErrorCode::StaleToken | ErrorCode::NotHolder)
                && client.held.remove(key).is_some() =>
            {
                // The lease ran out before the renew: the client learns it lost the lock.
                self.stats.expiries_seen += 1;
            }
            (ClientOp::KeepAlive { ttl_ms, .. }, ClientReply::SessionKept { session, .. }) => {
                let until = client.real(first_sent + (ttl_ms - ttl_ms / 5) * 1_000);
                client.session = Some(SimSession {
                    id: *session,
                    ttl_ms: *ttl_ms,
                    until,
                });
                // Every attached lock the client still believes it holds lives on with the
                // session; one whose belief already ran out is given up.
                let attached = client.attached_locks();
                for (key, token) in attached {
                    let live = self.beliefs.get_mut(&key).and_then(|list| {
                        list.iter_mut()
                            .rev()
                            .find(|b| b.client == c && b.token == token && b.until >= now)
                    });
                    match live {
                        Some(b) => b.until = until.max(now),
                        None => {
                            client.held.remove(&key);
                        }
                    }
                }
            }
            (ClientOp::KeepAlive { .. }, ClientReply::Error(e))
                if e.code == ErrorCode::NoSession =>
            {
                // The session ended: so did every lock attached to it.
                client.session = None;
                client.held.retain(|_, h| !h.attached);
                self.stats.expiries_seen += 1;
            }
            _ => {}
        }
        None
    }

    /// The checks over the whole history. `write_index` gives the log index a `Put` value
    /// committed at (from the applied log).
    /// `lease_drift_ppm` is the largest drift of a node's clock (leases are timed by nodes).
    pub fn check(
        &mut self,
        write_index: &BTreeMap<Vec<u8>, u64>,
        healed_at: Option<u64>,
        lease_drift_ppm: u64,
        session_expiries: &[(String, u64, u64)],
    ) {
        // No session expires inside a lease its client was acknowledged: the leader starts a
        // session's lease when it applies the keepalive, after the client sent it, and times
        // the TTL on a clock at most `lease_drift_ppm` fast.
        for h in &self.history {
            let (
                ClientOp::KeepAlive {
                    client_id, ttl_ms, ..
                },
                Some(ClientReply::SessionKept { session, .. }),
            ) = (&h.op, &h.reply)
            else {
                continue;
            };
            let ttl_us = ttl_ms * 1_000;
            let earliest = (h.invoke_us + ttl_us - (ttl_us * lease_drift_ppm).div_ceil(1_000_000))
                .saturating_sub(1);
            let early = session_expiries
                .iter()
                .find(|(c, s, at)| c == client_id && s == session && *at < earliest);
            if let Some((_, _, at)) = early {
                self.violations.push(Violation {
                    invariant: "sessions expire only after their lease",
                    detail: format!(
                        "{client_id}'s session {session} expired at {at} µs, inside the lease of \
                         its keepalive sent at {} µs (TTL {ttl_ms} ms) and acknowledged",
                        h.invoke_us
                    ),
                });
                return;
            }
        }
        // One holder at a time.
        for (key, beliefs) in &self.beliefs {
            // An answer that arrived after its own deadline gives no belief at all.
            let mut sorted: Vec<Belief> = beliefs
                .iter()
                .filter(|b| b.from < b.until)
                .cloned()
                .collect();
            sorted.sort_by_key(|b| b.from);
            for (i, a) in sorted.iter().enumerate() {
                for b in &sorted[i + 1..] {
                    if b.from >= a.until {
                        continue;
                    }
                    if a.client != b.client
                        && b.from < a.until
                        && a.from < b.until
                        && !may_share(a.shared, b.shared)
                    {
                        let invariant = match (a.shared, b.shared) {
                            (Some(x), Some(_)) if x.mode == LockMode::Permit => {
                                "at most N permit holders"
                            }
                            (Some(_), Some(_)) => "readers never beside a writer",
                            _ => "one holder at a time",
                        };
                        self.violations.push(Violation {
                            invariant,
                            detail: format!(
                                "{key}: client-{} believed it held token {} over [{}, {}) µs and client-{} token {} over [{}, {})",
                                a.client, a.token, a.from, a.until, b.client, b.token, b.from, b.until
                            ),
                        });
                        return;
                    }
                }
            }
        }
        // A permit's slot is below the semaphore's size.
        for (key, beliefs) in &self.beliefs {
            let past = beliefs.iter().find(|b| {
                b.shared
                    .is_some_and(|g| g.mode == LockMode::Permit && g.slot >= SEM_PERMITS)
            });
            if let Some(b) = past {
                self.violations.push(Violation {
                    invariant: "at most N permit holders",
                    detail: format!(
                        "{key}: client-{} was granted a permit in slot {:?} of {SEM_PERMITS}",
                        b.client,
                        b.shared.map(|g| g.slot)
                    ),
                });
                return;
            }
        }
        // Tokens grow in real time.
        let mut grants: BTreeMap<&str, Vec<(u64, u64, u64)>> = BTreeMap::new();
        for h in &self.history {
            if let (
                ClientOp::Acquire { key, .. }
                | ClientOp::Campaign { key, .. }
                | ClientOp::AcquireShared { key, .. },
                Some(ClientReply::Granted { token, .. }),
                Some(done),
            ) = (&h.op, &h.reply, h.complete_us)
            {
                grants
                    .entry(key.as_str())
                    .or_default()
                    .push((h.invoke_us, done, token.value));
            }
        }
        for (key, list) in &grants {
            for a in list {
                for b in list {
                    if a.1 < b.0 && b.2 <= a.2 {
                        self.violations.push(Violation {
                            invariant: "tokens grow in real time",
                            detail: format!(
                                "{key}: a grant with token {} was acknowledged at {} µs, a later acquire (invoked {} µs) got token {}",
                                a.2, a.1, b.0, b.2
                            ),
                        });
                        return;
                    }
                }
            }
        }
        // Linearizable reads against acknowledged writes.
        for h in &self.history {
            let (ClientOp::Get { key }, Some(ClientReply::Value(value))) = (&h.op, &h.reply) else {
                continue;
            };
            self.stats.reads_checked += 1;
            let required = self
                .history
                .iter()
                .filter_map(|w| match (&w.op, &w.reply, w.complete_us) {
                    (
                        ClientOp::Put { key: k, value, .. },
                        Some(ClientReply::Stored),
                        Some(done),
                    ) if k == key && done < h.invoke_us => write_index.get(value).copied(),
                    _ => None,
                })
                .max()
                .unwrap_or(0);
            let got = value
                .as_ref()
                .map_or(Some(0), |v| write_index.get(v).copied());
            match got {
                Some(index) if index >= required => {}
                _ => {
                    self.violations.push(Violation {
                        invariant: "linearizable read",
                        detail: format!(
                            "read of {key} invoked at {} µs returned {:?} (log index {got:?}) but a write at index {required} was acknowledged before",
                            h.invoke_us,
                            value.as_ref().map(|v| String::from_utf8_lossy(v).into_owned()),
                        ),
                    });
                    return;
                }
            }
        }
        // Every request answered once the cluster is healthy again.
        if let Some(healed) = healed_at {
            if let Some(h) = self
                .history
                .iter()
                .find(|h| h.invoke_us > healed && h.reply.is_none())
            {
                self.violations.push(Violation {
                    invariant: "every request answered",
                    detail: format!(
                        "client-{} {:?} invoked at {} µs after healing got no answer ({} attempts)",
                        h.client, h.op, h.invoke_us, h.attempts
                    ),
                });
            }
        }
        // Every key's history is linearizable (after the other checks, which name a more
        // specific property when they fail).
        if !self.violations.is_empty() {
            return;
        }
        let report = linearizability::check_all(&self.lin_histories(), lease_drift_ppm);
        self.stats.lin_checked += report.checked;
        self.stats.lin_unchecked += report.unchecked;
        if let Some((key, detail)) = report.violation {
            self.violations.push(Violation {
                invariant: "linearizable",
                detail: format!("{key}: {detail}"),
            });
        }
    }

    /// Each key's history in the linearizability checker's terms. Operations whose answer says
    /// they had no effect and that constrain no state (refused writes, invalid requests, cancels)
    /// are left out; operations without an answer may have taken effect or not.
    pub fn lin_histories(&self) -> BTreeMap<String, Vec<LinOp>> {
        // Values are numbered in the order they appear (they are unique strings per write).
        let mut values: BTreeMap<(&str, &[u8]), u32> = BTreeMap::new();
        fn value_id<'a>(
            key: &'a str,
            v: &'a [u8],
            values: &mut BTreeMap<(&'a str, &'a [u8]), u32>,
        ) -> u32 {
            let next = values.len() as u32;
            *values.entry((key, v)).or_insert(next)
        }
        let mut out: BTreeMap<String, Vec<LinOp>> = BTreeMap::new();
        for h in &self.history {
            let answered = h.reply.as_ref();
            // An acquire or campaign attached to a session, retried after the session ended, is
            // refused as having no session, although an earlier attempt may have been granted:
            // its effect is unknown, as if it had no answer.
            let unknown_effect = matches!(
                (&h.op, answered),
                (
                    ClientOp::Acquire { ttl_ms: 0, .. }
                        | ClientOp::Campaign { ttl_ms: 0, .. }
                        | ClientOp::AcquireShared { ttl_ms: 0, .. },
                    Some(ClientReply::Error(e))
                ) if e.code == ErrorCode::InvalidRequest
            );
            let complete = answered.and(h.complete_us).filter(|_| !unknown_effect);
            // Read-write locks and semaphores have a model of their own.
            if is_shared_key(h.op.key()) {
                if let Some(kind) = shared_lin_op(&h.op, answered) {
                    out.entry(h.op.key().to_string()).or_default().push(LinOp {
                        client: h.client,
                        invoke: h.invoke_us,
                        complete,
                        kind: OpKind::Shared(kind),
                    });
                }
                continue;
            }
            let code = match answered {
                Some(ClientReply::Error(e)) => Some(e.code),
                _ => None,
            };
            let kind = match (&h.op, answered) {
                (ClientOp::Acquire { ttl_ms, .. }, None) => Some(LockOp::AcquireUnknown {
                    ttl_us: ttl_ms * 1_000,
                }),
                // The lease starts at the grant with the TTL asked for; a retry's answer carries
                // only the time left (`expires_in_ms`), which is not the lease's length.
                (ClientOp::Acquire { ttl_ms, .. }, Some(ClientReply::Granted { token, .. })) => {
                    Some(LockOp::Granted {
                        token: token.value,
                        ttl_us: ttl_ms * 1_000,
                    })
                }
                // An acquire attached to a session, retried after the session ended, is refused
                // as having no session, although an earlier attempt may have been granted: its
                // effect is unknown, as if it had no answer (below).
                (ClientOp::Acquire { ttl_ms: 0, .. }, Some(ClientReply::Error(e)))
                    if e.code == ErrorCode::InvalidRequest =>
                {
                    Some(LockOp::AcquireUnknown { ttl_us: 0 })
                }
                (ClientOp::Acquire { ttl_ms, .. }, Some(ClientReply::Error(e))) => match e.code {
                    ErrorCode::AlreadyHeld => Some(LockOp::AlreadyHeld {
                        token: e.current_token,
                    }),
                    ErrorCode::WaitTimeout => Some(LockOp::HeldByOther),
                    // A retry told that its grant has already ended: the grant happened.
                    ErrorCode::StaleToken => Some(LockOp::AcquireUnknown {
                        ttl_us: ttl_ms * 1_000,
                    }),
                    _ => None,
                },
                (ClientOp::Release { token, .. }, None) => {
                    Some(LockOp::ReleaseUnknown { token: *token })
                }
                (ClientOp::Release { token, .. }, Some(ClientReply::Released)) => {
                    Some(LockOp::Released { token: *token })
                }
                (ClientOp::Renew { token, ttl_ms, .. }, None) => Some(LockOp::RenewUnknown {
                    token: *token,
                    ttl_us: ttl_ms * 1_000,
                }),
                (ClientOp::Renew { token, ttl_ms, .. }, Some(ClientReply::Renewed { .. })) => {
                    Some(LockOp::Renewed {
                        token: *token,
                        ttl_us: ttl_ms * 1_000,
                    })
                }
                (
                    ClientOp::Campaign {
                        key, ttl_ms, value, ..
                    },
                    None,
                ) => Some(LockOp::CampaignUnknown {
                    ttl_us: ttl_ms * 1_000,
                    value: value_id(key, value, &mut values),
                }),
                (
                    ClientOp::Campaign {
                        key, ttl_ms, value, ..
                    },
                    Some(ClientReply::Granted { token, .. }),
                ) => Some(LockOp::Elected {
                    token: token.value,
                    ttl_us: ttl_ms * 1_000,
                    value: value_id(key, value, &mut values),
                }),
                // An attached campaign retried after its session ended: as an acquire's.
                (
                    ClientOp::Campaign {
                        ttl_ms: 0,
                        key,
                        value,
                        ..
                    },
                    Some(ClientReply::Error(e)),
                ) if e.code == ErrorCode::InvalidRequest => Some(LockOp::CampaignUnknown {
                    ttl_us: 0,
                    value: value_id(key, value, &mut values),
                }),
                (
                    ClientOp::Campaign {
                        ttl_ms, key, value, ..
                    },
                    Some(ClientReply::Error(e)),
                ) => match e.code {
                    ErrorCode::AlreadyHeld => Some(LockOp::AlreadyHeld {
                        token: e.current_token,
                    }),
                    ErrorCode::WaitTimeout => Some(LockOp::HeldByOther),
                    ErrorCode::StaleToken => Some(LockOp::CampaignUnknown {
                        ttl_us: ttl_ms * 1_000,
                        value: value_id(key, value, &mut values),
                    }),
                    _ => None,
                },
                (
                    ClientOp::Proclaim {
                        key, token, value, ..
                    },
                    None,
                ) => Some(LockOp::ProclaimUnknown {
                    token: *token,
                    value: value_id(key, value, &mut values),
                }),
                (
                    ClientOp::Proclaim {
                        key, token, value, ..
                    },
                    Some(ClientReply::Proclaimed { .. }),
                ) => Some(LockOp::Proclaimed {
                    token: *token,
                    value: value_id(key, value, &mut values),
                }),
                (ClientOp::Proclaim { token, .. }, Some(ClientReply::Error(e))) => match e.code {
                    ErrorCode::StaleToken => Some(LockOp::StaleToken { token: *token }),
                    ErrorCode::NotHolder => Some(LockOp::NotHolder { token: *token }),
                    _ => None,
                },
                (ClientOp::Leader { key }, Some(ClientReply::Leader { token, value, .. })) => {
                    Some(LockOp::LeaderRead {
                        token: token.as_ref().map(|t| t.value),
                        value: value.as_ref().map(|v| value_id(key, v, &mut values)),
                    })
                }
                (ClientOp::SetLockDelay { delay_ms, .. }, None) => Some(LockOp::SetDelayUnknown {
                    delay_us: delay_ms * 1_000,
                }),
                (ClientOp::SetLockDelay { .. }, Some(ClientReply::LockDelaySet { delay_ms })) => {
                    Some(LockOp::SetDelay {
                        delay_us: delay_ms * 1_000,
                    })
                }
                (ClientOp::Release { token, .. } | ClientOp::Renew { token, .. }, Some(_)) => {
                    match code {
                        Some(ErrorCode::StaleToken) => Some(LockOp::StaleToken { token: *token }),
                        Some(ErrorCode::NotHolder) => Some(LockOp::NotHolder { token: *token }),
                        _ => None,
                    }
                }
                _ => None,
            }
            .map(OpKind::Lock)
            .or_else(|| {
                match (&h.op, answered) {
                    (ClientOp::Put { key, value, .. }, None | Some(ClientReply::Stored)) => {
                        Some(KvOp::Put {
                            value: value_id(key, value, &mut values),
                        })
                    }
                    (ClientOp::Delete { .. }, None) => Some(KvOp::Delete { existed: None }),
                    (ClientOp::Delete { .. }, Some(ClientReply::Deleted { existed })) => {
                        Some(KvOp::Delete {
                            existed: Some(*existed),
                        })
                    }
                    (ClientOp::Get { key }, Some(ClientReply::Value(v))) => Some(KvOp::Get {
                        value: v.as_ref().map(|v| value_id(key, v, &mut values)),
                    }),
                    _ => None,
                }
                .map(OpKind::Kv)
            });
            if let Some(kind) = kind {
                out.entry(h.op.key().to_string()).or_default().push(LinOp {
                    client: h.client,
                    invoke: h.invoke_us,
                    complete,
                    kind,
                });
            }
        }
        out
    }

    /// Number of operations and belief intervals checked.
    pub fn checked(&self) -> (u64, u64) {
        (self.history.len() as u64, self.stats.beliefs)
    }
}

/// What an operation on a read-write lock or semaphore did, for the linearizability check.
fn shared_lin_op(op: &ClientOp, answered: Option<&ClientReply>) -> Option<SharedOp> {
    let mode_of = |mode: LockMode| match mode {
        LockMode::Read => HoldMode::Read,
        LockMode::Write => HoldMode::Write,
        LockMode::Permit => HoldMode::Permit,
    };
    let code = match answered {
        Some(ClientReply::Error(e)) => Some(e.code),
        _ => None,
    };
    match (op, answered) {
        (
            ClientOp::AcquireShared {
                ttl_ms,
                mode,
                permits,
                ..
            },
            _,
        ) => {
            let unknown = SharedOp::AcquireUnknown {
                ttl_us: ttl_ms * 1_000,
                mode: mode_of(*mode),
                permits: *permits,
            };
            match answered {
                None => Some(unknown),
                Some(ClientReply::Granted { token, shared, .. }) => Some(SharedOp::Granted {
                    token: token.value,
                    ttl_us: ttl_ms * 1_000,
                    mode: mode_of(*mode),
                    slot: shared
                        .filter(|g| g.mode == LockMode::Permit)
                        .map(|g| g.slot),
                    permits: *permits,
                }),
                Some(ClientReply::Error(e)) => match e.code {
                    ErrorCode::AlreadyHeld => Some(SharedOp::AlreadyHeld {
                        token: e.current_token,
                    }),
                    ErrorCode::WaitTimeout => Some(SharedOp::HeldByOther),
                    // A retry told that its grant has already ended; an attached acquire
                    // retried after its session ended (refused as having none): the grant may
                    // have happened.
                    ErrorCode::StaleToken => Some(unknown),
                    ErrorCode::InvalidRequest if *ttl_ms == 0 => Some(unknown),
                    _ => None,
                },
                Some(_) => None,
            }
        }
        (ClientOp::Release { token, .. }, None) => Some(SharedOp::ReleaseUnknown { token: *token }),
        (ClientOp::Release { token, .. }, Some(ClientReply::Released)) => {
            Some(SharedOp::Released { token: *token })
        }
        (ClientOp::Renew { token, ttl_ms, .. }, None) => Some(SharedOp::RenewUnknown {
            token: *token,
            ttl_us: ttl_ms * 1_000,
        }),
        (ClientOp::Renew { token, ttl_ms, .. }, Some(ClientReply::Renewed { .. })) => {
            Some(SharedOp::Renewed {
                token: *token,
                ttl_us: ttl_ms * 1_000,
            })
        }
        (ClientOp::Release { token, .. } | ClientOp::Renew { token, .. }, Some(_)) => match code {
            Some(ErrorCode::StaleToken) => Some(SharedOp::StaleToken { token: *token }),
            Some(ErrorCode::NotHolder) => Some(SharedOp::NotHolder { token: *token }),
            _ => None,
        },
        _ => None,
    }
}

fn end_belief(
    beliefs: &mut BTreeMap<String, Vec<Belief>>,
    key: &str,
    c: usize,
    token: u64,
    now: u64,
) {
    if let Some(list) = beliefs.get_mut(key) {
        for b in list
            .iter_mut()
            .filter(|b| b.client == c && b.token == token)
        {
            b.until = b.until.min(now).max(b.from);
        }
    }
}

fn pick<'a>(nodes: &'a [NodeId], rng: &mut impl Rng) -> Option<&'a NodeId> {
    if nodes.is_empty() {
        None
    } else {
        Some(&nodes[rng.random_range(0..nodes.len())])
    }
}
