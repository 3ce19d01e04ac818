//! Per-key linearizability of the simulated clients' histories.
//!
//! Each key's operations are checked on their own (linearizability is compositional) against a
//! sequential model, by a bounded depth-first search for a linearization in the style of Wing &
//! Gong with Lowe's just-in-time refinement: at every point the search may only linearize an
//! operation invoked before the earliest response among the operations not yet linearized, and
//! it remembers every (linearized set, model state) pair it has already explored, so a state is
//! never searched twice.
//!
//! Two models:
//! - **locks** (`key-*`): the state is the holder (client, token, earliest real time its lease
//!   may have run out) and the highest token granted so far. An acquire is granted only when the
//!   lock is free and with a token above every earlier grant's; a release or renew succeeds only
//!   for the holder with its token. Leases end by time, not by an operation: between two
//!   operations the search may let the holder's lease expire, but only once real time may have
//!   reached its earliest expiry (see [`Search::expire`]). A key's lock-delay (set by an
//!   operation like any other) holds the key back after an expiry: no grant until the delay may
//!   have run out, measured from the expiry (see [`Search::end_delay`]); meanwhile an acquire
//!   may be told the lock is busy.
//!   An election (`elect-*`) is a lock whose state also has the value its leader shows: a
//!   campaign's grant shows the campaign's value, a proclaim by the holder replaces it, a
//!   release or expiry clears it, and a leader read returns the holder's term and value.
//! - **shared locks** (`rw-*`, `sem-*`; [`shared`]): the state is the set of holders, each
//!   with its mode (reader, writer, permit and its slot), token and earliest lease end. A grant
//!   fits beside the holders (readers beside readers, a writer alone, fewer permits than the
//!   size in distinct slots) with a token above every earlier grant's; each holder's lease may
//!   run out on its own.
//! - **KV** (`data-*`): a register; puts write, gets return the latest write.
//!
//! An operation without an answer (the client gave up, or the run ended first) may take effect
//! at any time after its invocation, or never: it is never required in a linearization, and it
//! has no response time that bounds the others (as Porcupine treats pending operations).
//! An operation whose answer says it had no effect and constrains nothing (a refused guarded
//! put, an invalid request) is left out.
//!
//! The search is bounded: a key with more than [`MAX_OPS_PER_KEY`] operations, or whose search
//! explores more than [`STEP_BUDGET`] states, is counted as unchecked rather than failed.

use std::collections::{BTreeMap, BTreeSet};

mod shared;

use shared::Shared;
pub use shared::{HoldMode, SharedOp};

/// Keys with more operations than this are not checked (the set of linearized operations is a
/// fixed-width bitset).
pub const MAX_OPS_PER_KEY: usize = 64 * WORDS;
/// States one key's search may explore before it gives up and counts the key as unchecked.
pub const STEP_BUDGET: u64 = 200_000;

const WORDS: usize = 8;

/// What an operation on a lock did, as far as its answer tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockOp {
    /// Granted with this token and lease (µs).
    Granted {
        token: u64,
        ttl_us: u64,
    },
    /// `ALREADY_HELD`: the client holds the lock, with this token if the answer says.
    AlreadyHeld {
        token: Option<u64>,
    },
    /// `WAIT_TIMEOUT`: another client held the lock (the acquire did not wait, or its wait ran
    /// out while it was queued behind a holder).
    HeldByOther,
    /// An acquire with no answer: it may have been granted with some token and this lease.
    AcquireUnknown {
        ttl_us: u64,
    },
    Released {
        token: u64,
    },
    Renewed {
        token: u64,
        ttl_us: u64,
    },
    /// A release or renew with no answer.
    ReleaseUnknown {
        token: u64,
    },
    RenewUnknown {
        token: u64,
        ttl_us: u64,
    },
    /// `STALE_TOKEN` to a release or renew: the lock is free or held under another token.
    StaleToken {
        token: u64,
    },
    /// `NOT_HOLDER`: the token holds the lock, for another client.
    NotHolder {
        token: u64,
    },
    /// The key's lock-delay was set to this (0: removed), or, without an answer, may have been.
    SetDelay {
        delay_us: u64,
    },
    SetDelayUnknown {
        delay_us: u64,
    },
    /// A campaign elected its client with this token (term), lease and value (numbered per
    /// key), or, without an answer, may have.
    Elected {
        token: u64,
        ttl_us: u64,
        value: u32,
    },
    CampaignUnknown {
        ttl_us: u64,
        value: u32,
    },
    /// The leader holding `token` proclaimed `value`, or, without an answer, may have.
    Proclaimed {
        token: u64,
        value: u32,
    },
    ProclaimUnknown {
        token: u64,
        value: u32,
    },
    /// A read of the election: its leader's term and value (`None`: no one leads).
    LeaderRead {
        token: Option<u64>,
        value: Option<u32>,
    },
}

/// What an operation on a KV key did. Values are numbered per key; `None` is "absent".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvOp {
    /// A write (acknowledged, or without an answer).
    Put {
        value: u32,
    },
    Delete {
        existed: Option<bool>,
    },
    Get {
        value: Option<u32>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Lock(LockOp),
    /// An operation on a read-write lock or semaphore.
    Shared(SharedOp),
    Kv(KvOp),
}

/// One operation of one key's history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinOp {
    pub client: usize,
    /// Real time of invocation (µs).
    pub invoke: u64,
    /// Real time of the answer; `None`: no answer, so it may take effect at any later time or
    /// never.
    pub complete: Option<u64>,
    pub kind: OpKind,
}

/// The result of checking one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    /// Too many operations or too many states: not decided.
    Unchecked,
    /// No linearization exists; the detail names an operation no linearization can place.
    Violation(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Holder {
    client: usize,
    /// `None` when the grant had no answer: its token is unknown.
    token: Option<u64>,
    /// Real time before which the lease cannot have run out.
    expires_lb: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct State {
    holder: Option<Holder>,
    /// The key's lock-delay (µs).
    delay_us: u64,
    /// A lock-delay runs: the real time before which it cannot end.
    delayed_until_lb: Option<u64>,
    /// Highest token granted so far.
    floor: u64,
    value: Option<u32>,
    /// A lower bound on the real time of the current linearization point.
    time_lb: u64,
    /// A read-write lock's or semaphore's holders.
    shared: Shared,
}

type Bits = [u64; WORDS];

fn has(bits: &Bits, i: usize) -> bool {
    bits[i / 64] & (1 << (i % 64)) != 0
}

fn with(bits: &Bits, i: usize) -> Bits {
    let mut b = *bits;
    b[i / 64] |= 1 << (i % 64);
    b
}

struct Exhausted;

struct Search<'a> {
    ops: &'a [LinOp],
    /// Largest clock drift of a node, in parts per million.
    drift_ppm: u64,
    seen: BTreeSet<(Bits, State)>,
    /// A semaphore's size (0: a read-write lock, or not a shared key).
    permits: u32,
    steps: u64,
    budget: u64,
    /// The most operations any partial linearization placed, and the earliest-answered
    /// operation it could not place.
    deepest: (usize, Option<usize>),
}

/// Checks one key's history (`drift_ppm`: the largest drift of a node's clock from real time).
pub fn check_key(ops: &[LinOp], drift_ppm: u64, budget: u64) -> Verdict {
    if ops.len() > MAX_OPS_PER_KEY {
        return Verdict::Unchecked;
    }
    let clients: BTreeSet<usize> = ops.iter().map(|op| op.client).collect();
    if clients.len() > shared::HOLDERS_MAX {
        return Verdict::Unchecked;
    }
    let mut sorted = ops.to_vec();
    sorted.sort_by_key(|op| (op.invoke, op.complete.unwrap_or(u64::MAX)));
    let mut search = Search {
        ops: &sorted,
        drift_ppm,
        seen: BTreeSet::new(),
        permits: shared::permits_of(ops),
        steps: 0,
        budget,
        deepest: (0, None),
    };
    let start = State {
        holder: None,
        delay_us: 0,
        delayed_until_lb: None,
        floor: 0,
        value: None,
        time_lb: 0,
        shared: Shared::default(),
    };
    match search.dfs([0; WORDS], 0, start) {
        Err(Exhausted) => Verdict::Unchecked,
        Ok(true) => Verdict::Linearizable,
        Ok(false) => {
            let (placed, stuck) = search.deepest;
            let stuck = stuck.map(|i| sorted[i]);
            Verdict::Violation(format!(
                "no linearization of {} operations; at most {placed} placed, then {stuck:?} cannot be",
                sorted.len()
            ))
        }
    }
}

impl Search<'_> {
    fn dfs(&mut self, done: Bits, placed: usize, state: State) -> Result<bool, Exhausted> {
        // The earliest answer among the operations still to place: nothing invoked after it can
        // come first, and every remaining answered operation must be placed.
        let mut min_resp = u64::MAX;
        let mut first = None;
        for (i, op) in self.ops.iter().enumerate() {
            if let (false, Some(c)) = (has(&done, i), op.complete) {
                if c < min_resp {
                    min_resp = c;
                    first = Some(i);
                }
            }
        }
        let Some(first) = first else {
            return Ok(true);
        };
        if !self.seen.insert((done, state)) {
            return Ok(false);
        }
        self.steps += 1;
        if self.steps > self.budget {
            return Err(Exhausted);
        }
        if placed >= self.deepest.0 {
            self.deepest = (placed, Some(first));
        }
        for i in 0..self.ops.len() {
            let op = self.ops[i];
            if op.invoke > min_resp {
                break; // sorted by invocation
            }
            if has(&done, i) {
                continue;
            }
            if let Some(next) = self.apply(&state, &op) {
                if self.dfs(with(&done, i), placed + 1, next)? {
                    return Ok(true);
                }
            }
        }
        if let Some(next) = self.expire(&state, min_resp) {
            if self.dfs(done, placed, next)? {
                return Ok(true);
            }
        }
        if let Some(next) = self.end_delay(&state, min_resp) {
            if self.dfs(done, placed, next)? {
                return Ok(true);
            }
        }
        for next in self.expire_shared(&state, min_resp) {
            if self.dfs(done, placed, next)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The earliest real time a lease granted or renewed at or after `start` may run out.
    ///
    /// A leader starts a lease when it applies the grant or renew (real time ≥ the linearization
    /// point ≥ `start`), or later when a new leader rebuilds its leases, and proposes the expiry
    /// once its own clock has advanced by the TTL. A clock that runs at most `drift_ppm` fast
    /// measures a TTL in no less than TTL / (1 + drift) ≥ TTL × (1 − drift) of real time, and the
    /// expiry applies after it is proposed. So no expiry can take effect before
    /// `start + TTL × (1 − drift)`: a sound necessary condition (it never forbids a real expiry;
    /// 1 µs is taken off for the simulator's integer clock conversions).
    fn lease_end(&self, start: u64, ttl_us: u64) -> u64 {
        let shrink = ttl_us.saturating_mul(self.drift_ppm).div_ceil(1_000_000);
        (start + ttl_us.saturating_sub(shrink)).saturating_sub(1)
    }

    /// The holder's lease runs out between two operations: only if that point, which is no
    /// later than `min_resp` (every remaining answered operation comes after it), can be at or
    /// after the lease's earliest end.
    fn expire(&self, state: &State, min_resp: u64) -> Option<State> {
        let holder = state.holder?;
        let at = holder.expires_lb.max(state.time_lb);
        // With a lock-delay, the key stays unavailable: the leader times the delay from its
        // apply of the expiry (no earlier than this point) on a clock that may run fast.
        let delayed_until_lb = (state.delay_us > 0).then(|| self.lease_end(at, state.delay_us));
        (at <= min_resp).then_some(State {
            holder: None,
            delayed_until_lb,
            // An election shows no value without a leader (a lock key has none anyway).
            value: None,
            time_lb: at,
            ..*state
        })
    }

    /// A running lock-delay ends between two operations, once real time may have reached its
    /// earliest end (a new leader may time it again, so it may also end much later).
    fn end_delay(&self, state: &State, min_resp: u64) -> Option<State> {
        let at = state.delayed_until_lb?.max(state.time_lb);
        (at <= min_resp).then_some(State {
            delayed_until_lb: None,
            time_lb: at,
            ..*state
        })
    }

    /// The state after `op` takes effect at the next linearization point, if its answer is
    /// possible in `state`.
    fn apply(&self, state: &State, op: &LinOp) -> Option<State> {
        let now = state.time_lb.max(op.invoke);
        let mut next = State {
            time_lb: now,
            ..*state
        };
        let me = op.client;
        let holder = state.holder;
        let holds = |token: u64| {
            holder.is_some_and(|h| h.client == me && h.token.is_none_or(|t| t == token))
        };
        match op.kind {
            OpKind::Lock(lock) => match lock {
                LockOp::Granted { token, ttl_us } => {
                    if holder.is_some() || state.delayed_until_lb.is_some() || token <= state.floor
                    {
                        return None;
                    }
                    next.holder = Some(Holder {
                        client: me,
                        token: Some(token),
                        expires_lb: self.lease_end(now, ttl_us),
                    });
                    next.floor = token;
                }
                LockOp::AcquireUnknown { ttl_us } => {
                    if holder.is_some() || state.delayed_until_lb.is_some() {
                        return None; // refused or queued: no effect, as if never placed
                    }
                    next.holder = Some(Holder {
                        client: me,
                        token: None,
                        expires_lb: self.lease_end(now, ttl_us),
                    });
                }
                LockOp::AlreadyHeld { token } => {
                    let h = holder.filter(|h| h.client == me)?;
                    if let (Some(a), Some(b)) = (h.token, token) {
                        if a != b {
                            return None;
                        }
                    }
                }
                LockOp::HeldByOther => {
                    // Held by another, or free while a lock-delay holds it back.
                    if state.delayed_until_lb.is_none() {
                        holder.filter(|h| h.client != me)?;
                    }
                }
                LockOp::SetDelay { delay_us } | LockOp::SetDelayUnknown { delay_us } => {
                    next.delay_us = delay_us;
                }
                LockOp::Released { token } | LockOp::ReleaseUnknown { token } => {
                    if !holds(token) {
                        return None;
                    }
                    next.holder = None;
                    next.value = None;
                }
                LockOp::Elected {
                    token,
                    ttl_us,
                    value,
                } => {
                    if holder.is_some() || state.delayed_until_lb.is_some() || token <= state.floor
                    {
                        return None;
                    }
                    next.holder = Some(Holder {
                        client: me,
                        token: Some(token),
                        expires_lb: self.lease_end(now, ttl_us),
                    });
                    next.floor = token;
                    next.value = Some(value);
                }
                LockOp::CampaignUnknown { ttl_us, value } => {
                    if holder.is_some() || state.delayed_until_lb.is_some() {
                        return None;
                    }
                    next.holder = Some(Holder {
                        client: me,
                        token: None,
                        expires_lb: self.lease_end(now, ttl_us),
                    });
                    next.value = Some(value);
                }
                LockOp::Proclaimed { token, value } | LockOp::ProclaimUnknown { token, value } => {
                    if !holds(token) {
                        return None;
                    }
                    next.value = Some(value);
                }
                LockOp::LeaderRead { token, value } => {
                    match (holder, token) {
                        (None, None) => {}
                        (Some(h), Some(t)) if h.token.is_none_or(|known| known == t) => {
                            // A read names the term an unanswered campaign was granted.
                            next.holder = Some(Holder {
                                token: Some(t),
                                ..h
                            });
                            next.floor = state.floor.max(t);
                        }
                        _ => return None,
                    }
                    if value != state.value {
                        return None;
                    }
                }
                LockOp::Renewed { token, ttl_us } | LockOp::RenewUnknown { token, ttl_us } => {
                    if !holds(token) {
                        return None;
                    }
                    next.holder = Some(Holder {
                        client: me,
                        token: Some(token),
                        expires_lb: self.lease_end(now, ttl_us),
                    });
                }
                LockOp::StaleToken { token } => {
                    if holder.is_some_and(|h| h.token == Some(token)) {
                        return None;
                    }
                }
                LockOp::NotHolder { token } => {
                    let h = holder?;
                    if h.client == me || h.token.is_some_and(|t| t != token) {
                        return None;
                    }
                }
            },
            OpKind::Shared(op) => return self.apply_shared(next, me, now, op),
            OpKind::Kv(kv) => match kv {
                KvOp::Put { value, .. } => next.value = Some(value),
                KvOp::Delete { existed } => {
                    if existed.is_some_and(|e| e != state.value.is_some()) {
                        return None;
                    }
                    next.value = None;
                }
                KvOp::Get { value } => {
                    if value != state.value {
                        return None;
                    }
                }
            },
        }
        Some(next)
    }
}

/// Totals over the keys of one history.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub checked: u64,
    pub unchecked: u64,
    /// The first key without a linearization, with the detail.
    pub violation: Option<(String, String)>,
}

/// Checks every key's history; keys are visited in order, so a run is deterministic.
pub fn check_all(histories: &BTreeMap<String, Vec<LinOp>>, drift_ppm: u64) -> Report {
    let mut report = Report::default();
    for (key, ops) in histories {
        match check_key(ops, drift_ppm, STEP_BUDGET) {
            Verdict::Linearizable => report.checked += 1,
            Verdict::Unchecked => report.unchecked += 1,
            Verdict::Violation(detail) => {
                report.checked += 1;
                if report.violation.is_none() {
                    report.violation = Some((key.clone(), detail));
                }
            }
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRIFT: u64 = 5_000;

    fn op(client: usize, invoke: u64, complete: Option<u64>, kind: OpKind) -> LinOp {
        LinOp {
            client,
            invoke,
            complete,
            kind,
        }
    }

    fn granted(token: u64, ttl_ms: u64) -> OpKind {
        OpKind::Lock(LockOp::Granted {
            token,
            ttl_us: ttl_ms * 1_000,
        })
    }

    fn check(ops: &[LinOp]) -> Verdict {
        check_key(ops, DRIFT, STEP_BUDGET)
    }

    #[test]
    fn overlapping_grants_without_a_possible_expiry_are_rejected() {
        // Two clients are granted one key in overlapping windows; the first lease (400 ms)
        // cannot have run out within 50 ms, and nobody released it.
        let ops = [
            op(0, 0, Some(10_000), granted(1, 400)),
            op(1, 5_000, Some(50_000), granted(2, 400)),
        ];
        assert!(
            matches!(check(&ops), Verdict::Violation(_)),
            "{:?}",
            check(&ops)
        );
    }

    #[test]
    fn a_grant_after_the_lease_may_have_run_out_is_accepted() {
        let ops = [
            op(0, 0, Some(10_000), granted(1, 100)),
            // 100 ms × (1 − 0.5 %) = 99.5 ms after the first invocation the lease may be gone.
            op(1, 120_000, Some(130_000), granted(2, 400)),
        ];
        assert_eq!(check(&ops), Verdict::Linearizable);
        // … but not before it.
        let early = [
            op(0, 0, Some(10_000), granted(1, 100)),
            op(1, 20_000, Some(90_000), granted(2, 400)),
        ];
        assert!(matches!(check(&early), Verdict::Violation(_)));
    }

    #[test]
    fn release_then_grant_and_token_order() {
        let release = OpKind::Lock(LockOp::Released { token: 7 });
        let ok = [
            op(0, 0, Some(1_000), granted(7, 400)),
            op(0, 2_000, Some(3_000), release),
            op(1, 2_500, Some(4_000), granted(9, 400)),
        ];
        assert_eq!(check(&ok), Verdict::Linearizable);
        // A later grant with a smaller token than an earlier one.
        let bad = [
            op(0, 0, Some(1_000), granted(7, 400)),
            op(0, 2_000, Some(3_000), release),
            op(1, 4_000, Some(5_000), granted(5, 400)),
        ];
        assert!(matches!(check(&bad), Verdict::Violation(_)));
    }

    #[test]
    fn unanswered_operations_may_or_may_not_take_effect() {
        // A release that got no answer may have freed the lock for the next grant …
        let ops = [
            op(0, 0, Some(1_000), granted(3, 400)),
            op(
                0,
                2_000,
                None,
                OpKind::Lock(LockOp::ReleaseUnknown { token: 3 }),
            ),
            op(1, 3_000, Some(4_000), granted(4, 400)),
        ];
        assert_eq!(check(&ops), Verdict::Linearizable);
        // … and an acquire with no answer may have been granted, so a `WAIT_TIMEOUT` is fine.
        let ops = [
            op(
                0,
                0,
                None,
                OpKind::Lock(LockOp::AcquireUnknown { ttl_us: 400_000 }),
            ),
            op(1, 3_000, Some(4_000), OpKind::Lock(LockOp::HeldByOther)),
        ];
        assert_eq!(check(&ops), Verdict::Linearizable);
        // But a `WAIT_TIMEOUT` with nobody ever holding the lock is not.
        let ops = [op(1, 3_000, Some(4_000), OpKind::Lock(LockOp::HeldByOther))];
        assert!(matches!(check(&ops), Verdict::Violation(_)));
    }

    #[test]
    fn a_waiter_is_granted_between_its_invocation_and_its_answer() {
        // Client 1 queues at 1 ms while client 0 holds; client 0 releases at 50 ms; the grant
        // answers client 1 at 51 ms.
        let ops = [
            op(0, 0, Some(500), granted(1, 400)),
            op(1, 1_000, Some(51_000), granted(2, 400)),
            op(
                0,
                49_000,
                Some(50_000),
                OpKind::Lock(LockOp::Released { token: 1 }),
            ),
        ];
        assert_eq!(check(&ops), Verdict::Linearizable);
    }

    #[test]
    fn renew_and_stale_answers() {
        let ops = [
            op(0, 0, Some(1_000), granted(1, 100)),
            op(
                0,
                50_000,
                Some(51_000),
                OpKind::Lock(LockOp::Renewed {
                    token: 1,
                    ttl_us: 400_000,
                }),
            ),
            // 140 ms: the renewed lease (from ≥ 50 ms, 400 ms) cannot have run out.
            op(1, 140_000, Some(141_000), granted(2, 100)),
        ];
        assert!(matches!(check(&ops), Verdict::Violation(_)));
        let ops = [
            op(0, 0, Some(1_000), granted(1, 100)),
            // The lease ran out; the renew finds the lock free.
            op(
                0,
                200_000,
                Some(201_000),
                OpKind::Lock(LockOp::StaleToken { token: 1 }),
            ),
            op(
                1,
                202_000,
                Some(203_000),
                OpKind::Lock(LockOp::NotHolder { token: 1 }),
            ),
        ];
        // NOT_HOLDER needs the token to hold the lock for someone else: impossible here.
        assert!(matches!(check(&ops), Verdict::Violation(_)));
    }

    #[test]
    fn reads_of_a_register() {
        let put = |v| OpKind::Kv(KvOp::Put { value: v });
        let get = |v| OpKind::Kv(KvOp::Get { value: v });
        let ok = [
            op(0, 0, Some(1_000), put(1)),
            op(1, 500, Some(2_000), get(None)), // concurrent with the put
            op(1, 3_000, Some(4_000), get(Some(1))),
            op(0, 3_500, None, put(2)), // no answer: may or may not apply
            op(1, 5_000, Some(6_000), get(Some(2))),
            op(1, 7_000, Some(8_000), get(Some(2))),
        ];
        assert_eq!(check(&ok), Verdict::Linearizable);
        // A stale read after a newer one.
        let stale = [
            op(0, 0, Some(1_000), put(1)),
            op(0, 2_000, Some(3_000), put(2)),
            op(1, 4_000, Some(5_000), get(Some(1))),
        ];
        assert!(matches!(check(&stale), Verdict::Violation(_)));
        // A value nobody wrote.
        let invented = [
            op(0, 0, Some(1_000), put(1)),
            op(1, 2_000, Some(3_000), get(Some(9))),
        ];
        assert!(matches!(check(&invented), Verdict::Violation(_)));
    }

    #[test]
    fn a_search_over_budget_is_unchecked() {
        // Many concurrent unanswered puts and one read nobody wrote: every subset is tried.
        let mut ops: Vec<LinOp> = (0..40)
            .map(|v| op(v, 0, None, OpKind::Kv(KvOp::Put { value: v as u32 })))
            .collect();
        ops.push(op(
            99,
            1,
            Some(2),
            OpKind::Kv(KvOp::Get { value: Some(1_000) }),
        ));
        assert_eq!(check_key(&ops, DRIFT, 1_000), Verdict::Unchecked);
    }

    fn elected(token: u64, ttl_ms: u64, value: u32) -> OpKind {
        OpKind::Lock(LockOp::Elected {
            token,
            ttl_us: ttl_ms * 1_000,
            value,
        })
    }

    fn read(token: Option<u64>, value: Option<u32>) -> OpKind {
        OpKind::Lock(LockOp::LeaderRead { token, value })
    }

    #[test]
    fn an_election_shows_its_leaders_campaign_value_then_what_it_proclaimed() {
        let proclaim = OpKind::Lock(LockOp::Proclaimed { token: 3, value: 8 });
        let ok = [
            op(0, 0, Some(1_000), elected(3, 400, 7)),
            op(1, 2_000, Some(3_000), read(Some(3), Some(7))),
            op(0, 4_000, Some(5_000), proclaim),
            op(1, 6_000, Some(7_000), read(Some(3), Some(8))),
        ];
        assert_eq!(check(&ok), Verdict::Linearizable);
        // A read after the proclaim was answered cannot show the campaign's value again.
        let stale = [
            op(0, 0, Some(1_000), elected(3, 400, 7)),
            op(0, 4_000, Some(5_000), proclaim),
            op(1, 6_000, Some(7_000), read(Some(3), Some(7))),
        ];
        assert!(matches!(check(&stale), Verdict::Violation(_)));
        // Nor can another client proclaim for the leader.
        let other = [
            op(0, 0, Some(1_000), elected(3, 400, 7)),
            op(1, 2_000, Some(3_000), proclaim),
        ];
        assert!(matches!(check(&other), Verdict::Violation(_)));
    }

    #[test]
    fn an_election_without_a_leader_shows_no_value() {
        let resign = OpKind::Lock(LockOp::Released { token: 3 });
        let ok = [
            op(0, 0, Some(1_000), elected(3, 400, 7)),
            op(0, 2_000, Some(3_000), resign),
            op(1, 4_000, Some(5_000), read(None, None)),
        ];
        assert_eq!(check(&ok), Verdict::Linearizable);
        let kept = [
            op(0, 0, Some(1_000), elected(3, 400, 7)),
            op(0, 2_000, Some(3_000), resign),
            op(1, 4_000, Some(5_000), read(None, Some(7))),
        ];
        assert!(matches!(check(&kept), Verdict::Violation(_)));
        // The lease may run out: then no one leads, and the value went with the leader.
        let expired = [
            op(0, 0, Some(1_000), elected(3, 100, 7)),
            op(1, 200_000, Some(201_000), read(None, None)),
        ];
        assert_eq!(check(&expired), Verdict::Linearizable);
        // An unanswered campaign may have won: a read names its term and value.
        let unknown = [
            op(
                0,
                0,
                None,
                OpKind::Lock(LockOp::CampaignUnknown {
                    ttl_us: 400_000,
                    value: 5,
                }),
            ),
            op(1, 2_000, Some(3_000), read(Some(4), Some(5))),
            op(1, 4_000, Some(5_000), elected(2, 400, 6)),
        ];
        assert!(matches!(check(&unknown), Verdict::Violation(_)));
    }
}
