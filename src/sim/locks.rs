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

/// What the reference sequence says about one key.
#[derive(Default)]
struct KeyModel {
    /// (client, request) of the current holder and its token.
    holder: Option<(String, String, u64)>,
    /// Waiters in queue order.
    queue: VecDeque<(String, String)>,
    last_token: u64,
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
    /// Applied `Tick`s (the log clock moving; idle client sessions close on them).
    pub ticks: u64,
    /// Applied requests that acknowledged answers, and delayed copies refused as acknowledged.
    pub acknowledging: u64,
    pub acknowledged_refusals: u64,
    /// Requests that acknowledged answers and ran (not answered from the table).
    ran_sequenced: std::collections::BTreeSet<(String, String)>,
    pub violations: Vec<Violation>,
}

impl LockChecker {
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
        match (&command, &applied.outcome) {
            (
                Command::Acquire {
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
                    }
                }
            }
            (
                Command::Acquire {
                    client_id,
                    request_id,
                    ..
                },
                Outcome::Queued { .. },
            ) => {
                let model = self.keys.entry(key.clone()).or_default();
                if model.holder.is_none() {
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
            _ => {}
        }
        for event in &applied.events {
            match event {
                Event::Granted {
                    client_id,
                    request_id,
                    token,
                    ..
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
                }
                Event::Expired { token, .. } => {
                    self.expiries += 1;
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
            }
        }
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

    fn grant(&mut self, index: Index, key: &str, client: &str, request: &str, token: u64) {
        self.grants += 1;
        let model = self.keys.entry(key.to_string()).or_default();
        let mut failures = Vec::new();
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
    )
}
