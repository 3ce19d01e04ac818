//! Lock traffic in the simulator and the lock guarantees checked across all faults.
//!
//! Simulated clients issue acquire, release, renew, wait and cancel through Raft while the leader
//! proposes expiries. Every node applies the committed log to its own `LockStateMachine`; the
//! first application of each index is the reference, every later one must produce the same
//! outcome and events, and the reference sequence is checked for: at most one holder per key,
//! tokens strictly increasing per key and globally, FIFO grants in queue order, no grant lost.

use std::collections::{BTreeMap, VecDeque};

use crate::lock::{Applied, Command, Event, Outcome};
use crate::raft::{Index, NodeId};

use super::checker::Violation;

mod shared;

/// What the reference sequence says about one key.
#[derive(Default)]
struct KeyModel {
    /// (client, request) of the current holder and its token.
    holder: Option<(String, String, u64)>,
    /// Waiters in queue order.
    queue: VecDeque<(String, String)>,
    last_token: u64,
    /// The key's configured lock-delay (ms), from the `SetLockDelay`s applied.
    delay_ms: u64,
    /// The lock-delay running now: the expired token, the delay's length, and the simulated
    /// time (µs) the expiry was first applied.
    delayed: Option<(u64, u64, u64)>,
    /// The holder's lock is attached to its client's session (granted or renewed with a TTL
    /// of 0).
    holder_attached: bool,
}

/// A client's session as the applied log says it is.
struct SessionModel {
    /// The log index that opened it.
    opened: u64,
}

/// Checks lock-level invariants over the applied log.
#[derive(Default)]
pub struct LockChecker {
    /// The first outcome seen at each index: (command, applied).
    reference: BTreeMap<Index, (Command, Applied)>,
    keys: BTreeMap<String, KeyModel>,
    /// Next index the model expects (it consumes the reference strictly in log order).
    model_next: Index,
    last_global_token: u64,
    /// Every (client, request) whose outcome the state machine recorded.
    recorded: std::collections::BTreeSet<(String, String)>,
    /// Every (client, request) ever granted, with its token.
    granted: BTreeMap<(String, String), u64>,
    /// Indices of non-command entries not yet consumed by the model.
    skipped: Vec<Index>,
    pub grants: u64,
    pub expiries: u64,
    /// Lock-delays that started on an expiry, and that ended.
    pub lock_delays: u64,
    pub lock_delays_ended: u64,
    /// Candidates elected (a campaign granted at once or by a hand-off), and proclaims applied.
    pub elected: u64,
    pub proclaims: u64,
    /// Campaign values of queued candidates, by (election, client): a client waits at most
    /// once per key.
    candidates: BTreeMap<(String, String), Vec<u8>>,
    /// Simulated time (µs), set by the cluster before each apply it reports.
    pub now_us: u64,
    /// When each index was first applied anywhere (µs), until the model consumed it.
    first_applied_us: BTreeMap<Index, u64>,
    /// The largest drift of a node's clock (ppm): a leader measures a delay of `d` in no less
    /// than `d × (1 − drift)` of real time.
    pub node_drift_ppm: u64,
    /// Applied `Tick`s (the log clock moving; idle client sessions close on them).
    pub ticks: u64,
    /// Applied requests that acknowledged answers, and delayed copies refused as acknowledged.
    pub acknowledging: u64,
    pub acknowledged_refusals: u64,
    /// Open sessions by client, from the keepalives applied.
    sessions: BTreeMap<String, SessionModel>,
    /// Read-write locks and semaphores, by key.
    shared: shared::SharedModels,
    /// Grants of read-write locks and semaphores.
    pub shared_grants: u64,
    /// Sessions opened, ended by their client, and expired; locks granted attached.
    pub sessions_opened: u64,
    pub sessions_closed: u64,
    pub sessions_expired: u64,
    pub attached_grants: u64,
    /// Sessions expired: (client, session, simulated time µs the expiry was first seen applied),
    /// for the clients' check that no session expired inside a lease they were acknowledged.
    pub session_expiries: Vec<(String, u64, u64)>,
    /// Requests that acknowledged answers and ran (not answered from the table).
    ran_sequenced: std::collections::BTreeSet<(String, String)>,
    pub violations: Vec<Violation>,
}

impl LockChecker {
    /// A checker for nodes whose clocks drift at most `ppm` from real time.
    pub fn with_node_drift(ppm: u64) -> Self {
        LockChecker {
            node_drift_ppm: ppm,
            ..LockChecker::default()
        }
    }

    fn fail(&mut self, invariant: &'static str, detail: String) {
        self.violations.push(Violation { invariant, detail });
    }

    /// A node applied `command` at `index` with `applied` as the result.
    pub fn on_apply(&mut self, node: NodeId, index: Index, command: &Command, applied: &Applied) {
        match self.reference.get(&index) {
            Some((ref_cmd, ref_applied)) => {
                if ref_cmd != command || ref_applied != applied {
                    self.fail(
                        "deterministic apply",
                        format!(
                            "node {node} at index {index}: {command:?} -> {applied:?}, reference {ref_cmd:?} -> {ref_applied:?}"
                        ),
                    );
                }
            }
            None => {
                self.reference
                    .insert(index, (command.clone(), applied.clone()));
                self.first_applied_us.insert(index, self.now_us);
                self.advance_model();
            }
        }
    }

    /// Non-command entries (no-ops, membership) still occupy an index.
    pub fn on_other_entry(&mut self, index: Index) {
        if !self.reference.contains_key(&index) && index >= self.model_next {
            self.skipped.push(index);
        }
        self.advance_model();
    }

    /// Consumes the reference in index order as far as it is contiguous.
    fn advance_model(&mut self) {
        loop {
            let next = self.model_next.max(1);
            if let Some(pos) = self.skipped.iter().position(|&i| i == next) {
                self.skipped.swap_remove(pos);
                self.model_next = next + 1;
                continue;
            }
            let Some((command, applied)) = self.reference.get(&next).cloned() else {
                return;
            };
            self.model_next = next + 1;
            self.check_step(next, &command, &applied);
        }
    }

    fn check_step(&mut self, index: Index, command: &Command, applied: &Applied) {
        let applied_us = self.first_applied_us.remove(&index).unwrap_or(self.now_us);
        self.check_lock_delay(index, command.request(), applied, applied_us);
        self.check_session(index, command.request(), applied, applied_us);
        if !applied.replayed {
            self.check_election(index, command.request(), applied);
        }
        let remembered = documented_as_kept(command, &applied.outcome);
        if let Command::Sequenced {
            command: request, ..
        } = command
        {
            self.acknowledging += 1;
            let id = request
                .dedupe_id()
                .map(|(c, r)| (c.to_string(), r.to_string()));
            if let Some(id) = id.filter(|_| remembered && !applied.replayed) {
                if !self.ran_sequenced.insert(id.clone()) {
                    self.fail(
                        "exactly once",
                        format!("index {index}: acknowledging request {id:?} ran a second time"),
                    );
                }
            }
            if let Outcome::Rejected {
                code: crate::lock::RejectCode::Acknowledged,
                ..
            } = applied.outcome
            {
                self.acknowledged_refusals += 1;
            }
        }
        // The request itself; how it acknowledged answers is the state machine's affair.
        let command = command.request();
        if matches!(command, Command::Tick { .. }) {
            self.ticks += 1;
        }
        let key = command.key().to_string();
        // A retried request is answered from the exactly-once table and changes nothing.
        if let Some(id) = command
            .dedupe_id()
            .map(|(c, r)| (c.to_string(), r.to_string()))
        {
            if applied.replayed {
                if !self.recorded.contains(&id) {
                    self.fail(
                        "exactly once",
                        format!("index {index}: {id:?} answered from the dedupe table but never recorded"),
                    );
                }
                if !applied.events.is_empty() {
                    self.fail(
                        "exactly once",
                        format!("index {index}: replay of {id:?} had effects"),
                    );
                }
                return;
            }
            if remembered {
                self.recorded.insert(id);
            }
        }
        if self.check_shared(index, command, applied) {
            return;
        }
        let shared_keys = self.check_shared_session_end(index, command, applied);
        match (&command, &applied.outcome) {
            (
                Command::Acquire {
                    client_id,
                    request_id,
                    ..
                }
                | Command::Campaign {
                    client_id,
                    request_id,
                    ..
                },
                Outcome::Granted { token, .. },
            ) => {
                let id = (client_id.clone(), request_id.clone());
                match self.granted.get(&id) {
                    // A retried request answered from the exactly-once table: no new grant.
                    Some(&earlier) if earlier == token.value => {}
                    Some(&earlier) => self.fail(
                        "exactly once",
                        format!(
                            "index {index}: {id:?} granted token {} after {earlier}",
                            token.value
                        ),
                    ),
                    None => {
                        self.granted.insert(id, token.value);
                        self.grant(index, &key, client_id, request_id, token.value);
                        let attached = command.as_acquire().is_some_and(|a| a.ttl_ms == 0);
                        self.keys.entry(key.clone()).or_default().holder_attached = attached;
                        self.attached_grants += u64::from(attached);
                    }
                }
            }
            (
                Command::Acquire {
                    client_id,
                    request_id,
                    ..
                }
                | Command::Campaign {
                    client_id,
                    request_id,
                    ..
                },
                Outcome::Queued { .. },
            ) => {
                let model = self.keys.entry(key.clone()).or_default();
                if model.holder.is_none() && model.delayed.is_none() {
                    self.fail(
                        "no idle queue",
                        format!("index {index}: {client_id} queued on free key {key}"),
                    );
                    return;
                }
                model
                    .queue
                    .push_back((client_id.clone(), request_id.clone()));
            }
            (Command::Release { .. } | Command::ReleaseHeld { .. }, Outcome::Released) => {
                self.keys.entry(key.clone()).or_default().holder = None;
            }
            (Command::Renew { ttl_ms, .. }, Outcome::Renewed { .. }) => {
                self.keys.entry(key.clone()).or_default().holder_attached = *ttl_ms == 0;
            }
            // A client ending its session gives up every lock attached to it (the hand-offs
            // that follow come as events).
            (Command::EndSession { client_id, .. }, Outcome::SessionEnded { .. }) => {
                for model in self.keys.values_mut() {
                    if model.holder_attached
                        && model.holder.as_ref().is_some_and(|h| h.0 == *client_id)
                    {
                        model.holder = None;
                        model.holder_attached = false;
                    }
                }
            }
            _ => {}
        }
        for event in &applied.events {
            let shared_key = match event {
                Event::SharedGranted { token, .. } | Event::Expired { token, .. } => {
                    Some(&token.key)
                }
                Event::WaiterRemoved { key, .. } => Some(key),
                _ => None,
            };
            if let Some(key) = shared_key.filter(|k| shared_keys.contains(*k)) {
                let key = key.clone();
                self.shared_event(index, &key, event);
                continue;
            }
            match event {
                Event::Granted {
                    client_id,
                    request_id,
                    token,
                    ttl_ms,
                } => {
                    let model = self.keys.entry(token.key.clone()).or_default();
                    // FIFO: the grant goes to the earliest waiter still queued.
                    let front = model.queue.front().cloned();
                    if front.as_ref() != Some(&(client_id.clone(), request_id.clone())) {
                        self.fail(
                            "FIFO grants",
                            format!("index {index}: key {} granted to {client_id}/{request_id}, queue front is {front:?}", token.key),
                        );
                    }
                    let model = self.keys.entry(token.key.clone()).or_default();
                    model
                        .queue
                        .retain(|w| w != &(client_id.clone(), request_id.clone()));
                    // The holder must already be gone (released or expired in this entry):
                    // `grant` checks it.
                    self.granted
                        .insert((client_id.clone(), request_id.clone()), token.value);
                    let k = token.key.clone();
                    self.grant(index, &k, client_id, request_id, token.value);
                    let attached = *ttl_ms == 0;
                    self.keys.entry(k).or_default().holder_attached = attached;
                    self.attached_grants += u64::from(attached);
                }
                Event::Expired { token, client_id } => {
                    self.expiries += 1;
                    let model = self.keys.entry(token.key.clone()).or_default();
                    let attached = model.holder_attached
                        && model.holder.as_ref().map(|h| h.2) == Some(token.value);
                    if attached && !matches!(command, Command::ExpireSession { .. }) {
                        self.fail(
                            "attached locks end with their session",
                            format!(
                                "index {index}: {client_id}'s lock on {} (token {}), attached to \
                                 its session, expired by {command:?}",
                                token.key, token.value
                            ),
                        );
                    }
                    let model = self.keys.entry(token.key.clone()).or_default();
                    if model.holder.as_ref().map(|h| h.2) == Some(token.value) {
                        model.holder = None;
                    }
                }
                Event::WaiterRemoved {
                    key,
                    client_id,
                    request_id,
                } => {
                    let model = self.keys.entry(key.clone()).or_default();
                    model
                        .queue
                        .retain(|w| w != &(client_id.clone(), request_id.clone()));
                }
                // Checked by `check_lock_delay`.
                Event::LockDelayStarted { .. } | Event::LockDelayEnded { .. } => {}
                // Checked by `check_election`.
                Event::Proclaimed { .. } => {}
                // Shared keys are judged by `check_shared`, which took every step on them.
                Event::SharedGranted { token, .. } => self.fail(
                    "shared grants keep their mode",
                    format!(
                        "index {index}: a shared grant of {} on a plain key",
                        token.key
                    ),
                ),
            }
        }
        self.shared_tidy(&shared_keys);
        if let (Command::Expire { .. } | Command::ExpireLease { .. }, Outcome::Expired { .. }) =
            (&command, &applied.outcome)
        {
            let model = self.keys.entry(key).or_default();
            if !applied
                .events
                .iter()
                .any(|e| matches!(e, Event::Granted { .. }))
            {
                model.holder = None;
            }
        }
    }

    /// Lock-delay, judged from the commands and outcomes alone: an expiry on a key whose
    /// delay is set starts it (and no one is granted the key in that entry), an expiry on a key
    /// without one does not; a delay ends only by the leader's `EndLockDelay` for its token, no
    /// sooner than its length (less the largest clock drift) after the expiry was first
    /// applied. `grant` checks that no grant comes while a delay runs.
    /// Elections, judged from the commands, outcomes and events: a candidate is elected with
    /// its own campaign value (at once or when the key is handed to it), a proclaim applies only
    /// for the current leader's term, and every value shown names the leader and term just
    /// granted or proclaimed. Runs before the step's grants and releases reach the key models,
    /// so a proclaim is judged against the holder before it.
    fn check_election(&mut self, index: Index, command: &Command, applied: &Applied) {
        // (client, token, value) each Proclaimed event must carry, from this entry's grants.
        let mut expected: Vec<(String, u64, Vec<u8>)> = Vec::new();
        // Candidates elected in this entry (the others in `expected` are proclaims).
        let mut elected = 0;
        match (command, &applied.outcome) {
            (
                Command::Campaign {
                    key,
                    client_id,
                    value,
                    ..
                },
                Outcome::Queued { .. },
            ) => {
                self.candidates
                    .insert((key.clone(), client_id.clone()), value.clone());
            }
            (
                Command::Campaign {
                    client_id, value, ..
                },
                Outcome::Granted { token, .. },
            ) => {
                elected += 1;
                expected.push((client_id.clone(), token.value, value.clone()));
            }
            (
                Command::Proclaim {
                    key,
                    client_id,
                    token,
                    value,
                    ..
                },
                Outcome::Proclaimed { .. },
            ) => {
                self.proclaims += 1;
                let holder = self.keys.get(key).and_then(|m| m.holder.clone());
                if holder
                    .as_ref()
                    .is_none_or(|h| h.0 != *client_id || h.2 != token.value)
                {
                    self.fail(
                        "proclaim only by the leader",
                        format!(
                            "index {index}: {client_id} proclaimed for term {} of {key}, whose \
                             leader is {holder:?}",
                            token.value
                        ),
                    );
                }
                expected.push((client_id.clone(), token.value, value.clone()));
            }
            (Command::CancelWait { key, client_id, .. }, Outcome::WaitCancelled) => {
                self.candidates.remove(&(key.clone(), client_id.clone()));
            }
            _ => {}
        }
        for event in &applied.events {
            match event {
                Event::Granted {
                    client_id, token, ..
                } => {
                    if let Some(value) = self
                        .candidates
                        .remove(&(token.key.clone(), client_id.clone()))
                    {
                        elected += 1;
                        expected.push((client_id.clone(), token.value, value));
                    }
                }
                Event::WaiterRemoved { key, client_id, .. } => {
                    self.candidates.remove(&(key.clone(), client_id.clone()));
                }
                _ => {}
            }
        }
        let shown: Vec<(String, u64, Vec<u8>)> = applied
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Proclaimed {
                    client_id,
                    token,
                    value,
                } => Some((client_id.clone(), token.value, value.clone())),
                _ => None,
            })
            .collect();
        if shown != expected {
            let show = |list: &[(String, u64, Vec<u8>)]| {
                list.iter()
                    .map(|(c, t, v)| format!("{c} term {t} {:?}", String::from_utf8_lossy(v)))
                    .collect::<Vec<_>>()
            };
            self.fail(
                "elected with its campaign value",
                format!(
                    "index {index}: {command:?} showed {:?}, the grants and proclaims of the entry \
                     call for {:?}",
                    show(&shown),
                    show(&expected)
                ),
            );
        }
        self.elected += elected;
    }

    fn check_lock_delay(&mut self, index: Index, command: &Command, applied: &Applied, at: u64) {
        let started = applied.events.iter().find_map(|e| match e {
            Event::LockDelayStarted {
                token, delay_ms, ..
            } => Some((*token, *delay_ms)),
            _ => None,
        });
        let key = command.key().to_string();
        match (command, &applied.outcome) {
            (Command::SetLockDelay { delay_ms, .. }, Outcome::LockDelaySet { .. })
                if !applied.replayed =>
            {
                self.keys.entry(key).or_default().delay_ms = *delay_ms;
            }
            (
                Command::Expire { token, .. } | Command::ExpireLease { token, .. },
                Outcome::Expired { .. },
            ) => {
                let configured = self.keys.entry(key.clone()).or_default().delay_ms;
                let want = (configured > 0).then_some((*token, configured));
                if started != want {
                    self.fail(
                        "lock-delay starts at expiry",
                        format!(
                            "index {index}: expiry of {key} token {token} started {started:?},                              the key's delay is {configured} ms"
                        ),
                    );
                }
                if let Some((token, delay_ms)) = started {
                    self.lock_delays += 1;
                    self.keys.entry(key).or_default().delayed = Some((token, delay_ms, at));
                }
            }
            // A session's expiry is an expiry of every lock attached to it.
            (Command::ExpireSession { .. }, Outcome::SessionEnded { .. }) => {
                let started: BTreeMap<&str, (u64, u64)> = applied
                    .events
                    .iter()
                    .filter_map(|e| match e {
                        Event::LockDelayStarted {
                            key,
                            token,
                            delay_ms,
                        } => Some((key.as_str(), (*token, *delay_ms))),
                        _ => None,
                    })
                    .collect();
                let expired: Vec<(String, u64)> = applied
                    .events
                    .iter()
                    .filter_map(|e| match e {
                        Event::Expired { token, .. } => Some((token.key.clone(), token.value)),
                        _ => None,
                    })
                    .collect();
                if let Some(key) = started
                    .keys()
                    .find(|k| !expired.iter().any(|(e, _)| e == *k))
                {
                    self.fail(
                        "lock-delay starts at expiry",
                        format!("index {index}: {command:?} started a lock-delay on {key}, which did not expire"),
                    );
                }
                for (key, token) in expired {
                    let configured = self.keys.entry(key.clone()).or_default().delay_ms;
                    let want = (configured > 0).then_some((token, configured));
                    let got = started.get(key.as_str()).copied();
                    if got != want {
                        self.fail(
                            "lock-delay starts at expiry",
                            format!(
                                "index {index}: session expiry of {key} token {token} started \
                                 {got:?}, the key's delay is {configured} ms"
                            ),
                        );
                    }
                    if let Some((token, delay_ms)) = got {
                        self.lock_delays += 1;
                        self.keys.entry(key).or_default().delayed = Some((token, delay_ms, at));
                    }
                }
            }
            (Command::EndLockDelay { token, .. }, Outcome::LockDelayEnded) => {
                let delayed = self.keys.entry(key.clone()).or_default().delayed.take();
                match delayed {
                    Some((t, delay_ms, since)) if t == *token => {
                        self.lock_delays_ended += 1;
                        let shortest = delay_ms * 1_000
                            - (delay_ms * 1_000 * self.node_drift_ppm).div_ceil(1_000_000);
                        if at < since + shortest {
                            self.fail(
                                "lock-delay lasts its length",
                                format!(
                                    "index {index}: the delay of {key} (token {t}, {delay_ms} ms)                                      ended {} µs after the expiry",
                                    at - since
                                ),
                            );
                        }
                    }
                    other => self.fail(
                        "lock-delay ends once",
                        format!("index {index}: {key} ended the delay of token {token}, running {other:?}"),
                    ),
                }
            }
            _ => {
                if started.is_some() {
                    self.fail(
                        "lock-delay starts at expiry",
                        format!("index {index}: {command:?} started a lock-delay"),
                    );
                }
            }
        }
    }

    /// Sessions, judged from the commands and outcomes: a keepalive opens a session or keeps
    /// the one open, a session ends by its client or expires, one session per client at a time.
    /// The expiries are kept for the clients' check (`SimClients::check`): no session expires
    /// sooner than its TTL (less the largest clock drift) after the sending of a keepalive of it
    /// that was acknowledged. (The time an apply is seen here can lag the leader's apply, so the
    /// sending is the sound start to count from.)
    fn check_session(&mut self, index: Index, command: &Command, applied: &Applied, at: u64) {
        match (command, &applied.outcome) {
            (Command::KeepAlive { client_id, .. }, Outcome::SessionKept { session, .. }) => {
                if !self.sessions.contains_key(client_id) {
                    self.sessions_opened += 1;
                }
                let model = self
                    .sessions
                    .entry(client_id.clone())
                    .or_insert(SessionModel { opened: *session });
                if model.opened != *session {
                    let opened = model.opened;
                    self.fail(
                        "one session per client",
                        format!(
                            "index {index}: {client_id} kept session {session} alive while \
                             session {opened} is open"
                        ),
                    );
                }
            }
            (
                Command::EndSession { client_id, .. } | Command::ExpireSession { client_id, .. },
                Outcome::SessionEnded { .. },
            ) => {
                let Some(model) = self.sessions.remove(client_id) else {
                    self.fail(
                        "one session per client",
                        format!("index {index}: {client_id}'s session ended but none was open"),
                    );
                    return;
                };
                if matches!(command, Command::ExpireSession { .. }) {
                    self.sessions_expired += 1;
                    self.session_expiries
                        .push((client_id.clone(), model.opened, at));
                } else {
                    self.sessions_closed += 1;
                }
            }
            _ => {}
        }
    }

    fn grant(&mut self, index: Index, key: &str, client: &str, request: &str, token: u64) {
        self.grants += 1;
        let model = self.keys.entry(key.to_string()).or_default();
        let mut failures = Vec::new();
        if let Some((expired, delay_ms, _)) = model.delayed {
            failures.push((
                "no grant during lock-delay",
                format!(
                    "index {index}: {client} granted {key} during the {delay_ms} ms delay after \
                     token {expired} expired"
                ),
            ));
        }
        if let Some((holder, _, held)) = &model.holder {
            failures.push((
                "mutual exclusion",
                format!("index {index}: {client} granted {key} while {holder} holds token {held}"),
            ));
        }
        if token <= model.last_token {
            failures.push((
                "tokens increase per key",
                format!(
                    "index {index}: token {token} for {key} after {}",
                    model.last_token
                ),
            ));
        }
        model.last_token = token;
        model.holder = Some((client.to_string(), request.to_string(), token));
        if token <= self.last_global_token {
            failures.push((
                "tokens increase globally",
                format!(
                    "index {index}: token {token} after {} elsewhere",
                    self.last_global_token
                ),
            ));
        }
        self.last_global_token = token;
        for (invariant, detail) in failures {
            self.fail(invariant, detail);
        }
    }
}

/// The answers docs/guarantees.md says the exactly-once table keeps, written out here rather than
/// taken from the state machine, so that the history check holds the machine to the document:
/// for a request sent with `ackBelow` (`Sequenced`) every answer but a refusal of the request
/// itself; for a plain one, the answers that changed something.
fn documented_as_kept(command: &Command, outcome: &Outcome) -> bool {
    if let Command::Sequenced { .. } = command {
        return !matches!(outcome, Outcome::Rejected { .. });
    }
    matches!(
        outcome,
        Outcome::Granted { .. }
            | Outcome::Queued { .. }
            | Outcome::Released
            | Outcome::Renewed { .. }
            | Outcome::WaitCancelled
            | Outcome::Stored
            | Outcome::Deleted { .. }
            | Outcome::LockDelaySet { .. }
            | Outcome::Proclaimed { .. }
            | Outcome::SharedGranted { .. }
            | Outcome::PermitsSet { .. }
    )
}
