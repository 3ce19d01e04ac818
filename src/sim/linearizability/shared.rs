//! The sequential model of a read-write lock or semaphore for the linearizability search.
//!
//! The state is the set of holders (at most one per client), each with its mode, its token
//! (unknown when the grant had no answer), its permit slot (unknown likewise) and the earliest
//! real time its lease may have run out. Operations:
//!
//! - a grant fits beside the holders — a reader beside readers only, a writer alone, a permit
//!   while fewer than the size hold one, in a slot below the size no holder has — and its token
//!   is above every earlier grant's (tokens come from one sequence);
//! - `ALREADY_HELD` needs the client to hold the key; `WAIT_TIMEOUT` needs another client to
//!   hold it (a queue is never idle: whoever waits, waits behind a holder);
//! - a release or renew succeeds only for the client's own holder of that token; `STALE_TOKEN`
//!   says no holder has the token, `NOT_HOLDER` that another client's does;
//! - each holder's lease may run out on its own between two operations, once real time may
//!   have reached its earliest end (a holder attached to a session has a lease of 0: its
//!   session may end at any time).
//!
//! The queue's order is not modelled here: FIFO is judged on the applied log
//! (`sim::locks::shared`), which sees the queue.

use super::{LinOp, OpKind, Search, State};

/// Most holders of one key the state keeps (one per client; a history with more clients is
/// not checked).
pub const HOLDERS_MAX: usize = 8;

/// An operation on a read-write lock or semaphore, as far as its answer tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedOp {
    /// Granted in `mode` with this token, lease and (for a permit) slot; `permits` is the size
    /// the request named (0 for a reader or writer).
    Granted {
        token: u64,
        ttl_us: u64,
        mode: HoldMode,
        slot: Option<u32>,
        permits: u32,
    },
    /// An acquire with no answer: it may have been granted in `mode` with some token and slot.
    AcquireUnknown {
        ttl_us: u64,
        mode: HoldMode,
        permits: u32,
    },
    /// `ALREADY_HELD`: the client holds the key, with this token if the answer says.
    AlreadyHeld {
        token: Option<u64>,
    },
    /// `WAIT_TIMEOUT`: the acquire was not granted in time, behind another client's hold.
    HeldByOther,
    Released {
        token: u64,
    },
    ReleaseUnknown {
        token: u64,
    },
    Renewed {
        token: u64,
        ttl_us: u64,
    },
    RenewUnknown {
        token: u64,
        ttl_us: u64,
    },
    /// No holder has the token.
    StaleToken {
        token: u64,
    },
    /// Another client's holder has the token.
    NotHolder {
        token: u64,
    },
}

/// How a holder holds the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HoldMode {
    Read,
    Write,
    Permit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct SharedHolder {
    client: usize,
    token: Option<u64>,
    mode: HoldMode,
    slot: Option<u32>,
    /// Real time before which the lease cannot have run out.
    expires_lb: u64,
}

/// The holders, sorted (so that equal sets are equal states), `None` after the last.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Shared {
    holders: [Option<SharedHolder>; HOLDERS_MAX],
}

impl Shared {
    fn iter(&self) -> impl Iterator<Item = &SharedHolder> {
        self.holders.iter().map_while(Option::as_ref)
    }

    fn len(&self) -> usize {
        self.iter().count()
    }

    fn mine(&self, client: usize) -> Option<&SharedHolder> {
        self.iter().find(|h| h.client == client)
    }

    fn with(&self, holder: SharedHolder) -> Option<Shared> {
        let mut all: Vec<SharedHolder> = self.iter().copied().collect();
        if all.len() >= HOLDERS_MAX {
            return None;
        }
        all.push(holder);
        Some(Shared::of(all))
    }

    fn without(&self, client: usize) -> Shared {
        Shared::of(
            self.iter()
                .copied()
                .filter(|h| h.client != client)
                .collect(),
        )
    }

    fn of(mut all: Vec<SharedHolder>) -> Shared {
        all.sort();
        let mut holders = [None; HOLDERS_MAX];
        for (slot, h) in holders.iter_mut().zip(all) {
            *slot = Some(h);
        }
        Shared { holders }
    }
}

/// The semaphore size a key's history names (the largest; 0 for a read-write lock).
pub(super) fn permits_of(ops: &[LinOp]) -> u32 {
    ops.iter()
        .filter_map(|op| match op.kind {
            OpKind::Shared(SharedOp::Granted { permits, .. })
            | OpKind::Shared(SharedOp::AcquireUnknown { permits, .. }) => Some(permits),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

impl Search<'_> {
    /// Whether a grant in `mode` (in `slot`, when known) fits beside the holders.
    fn fits(&self, shared: &Shared, mode: HoldMode, slot: Option<u32>) -> bool {
        match mode {
            HoldMode::Read => shared.iter().all(|h| h.mode == HoldMode::Read),
            HoldMode::Write => shared.len() == 0,
            HoldMode::Permit => {
                shared.len() < self.permits as usize
                    && slot.is_none_or(|s| {
                        s < self.permits && shared.iter().all(|h| h.slot != Some(s))
                    })
            }
        }
    }

    /// The state after a shared operation takes effect at `now`, if its answer is possible.
    pub(super) fn apply_shared(
        &self,
        mut next: State,
        me: usize,
        now: u64,
        op: SharedOp,
    ) -> Option<State> {
        let shared = next.shared;
        let holds = |token: u64| {
            shared
                .mine(me)
                .is_some_and(|h| h.token.is_none_or(|t| t == token))
        };
        match op {
            SharedOp::Granted {
                token,
                ttl_us,
                mode,
                slot,
                ..
            } => {
                if shared.mine(me).is_some()
                    || next.delayed_until_lb.is_some()
                    || token <= next.floor
                    || !self.fits(&shared, mode, slot)
                {
                    return None;
                }
                next.shared = shared.with(SharedHolder {
                    client: me,
                    token: Some(token),
                    mode,
                    slot,
                    expires_lb: self.lease_end(now, ttl_us),
                })?;
                next.floor = token;
            }
            SharedOp::AcquireUnknown { ttl_us, mode, .. } => {
                if shared.mine(me).is_some()
                    || next.delayed_until_lb.is_some()
                    || !self.fits(&shared, mode, None)
                {
                    return None; // refused or queued: no effect, as if never placed
                }
                next.shared = shared.with(SharedHolder {
                    client: me,
                    token: None,
                    mode,
                    slot: None,
                    expires_lb: self.lease_end(now, ttl_us),
                })?;
            }
            SharedOp::AlreadyHeld { token } => {
                let h = shared.mine(me)?;
                if let (Some(a), Some(b)) = (h.token, token) {
                    if a != b {
                        return None;
                    }
                }
            }
            SharedOp::HeldByOther => {
                if next.delayed_until_lb.is_none() && shared.iter().all(|h| h.client == me) {
                    return None;
                }
            }
            SharedOp::Released { token } | SharedOp::ReleaseUnknown { token } => {
                if !holds(token) {
                    return None;
                }
                next.shared = shared.without(me);
            }
            SharedOp::Renewed { token, ttl_us } | SharedOp::RenewUnknown { token, ttl_us } => {
                if !holds(token) {
                    return None;
                }
                let mut h = *shared.mine(me)?;
                h.token = Some(token);
                h.expires_lb = self.lease_end(now, ttl_us);
                next.shared = shared.without(me).with(h)?;
            }
            SharedOp::StaleToken { token } => {
                if shared.iter().any(|h| h.token == Some(token)) {
                    return None;
                }
            }
            SharedOp::NotHolder { token } => {
                // Another client's holder has the token (one whose token is unknown may).
                let other = shared
                    .iter()
                    .any(|h| h.client != me && h.token.is_none_or(|t| t == token));
                if !other {
                    return None;
                }
            }
        }
        Some(next)
    }

    /// The states in which one holder's lease ran out between two operations (each only once
    /// real time may have reached its earliest end, no later than `min_resp`).
    pub(super) fn expire_shared(&self, state: &State, min_resp: u64) -> Vec<State> {
        state
            .shared
            .iter()
            .filter_map(|h| {
                let at = h.expires_lb.max(state.time_lb);
                (at <= min_resp).then(|| {
                    let delayed_until_lb =
                        (state.delay_us > 0).then(|| self.lease_end(at, state.delay_us));
                    State {
                        shared: state.shared.without(h.client),
                        delayed_until_lb: delayed_until_lb.or(state.delayed_until_lb),
                        time_lb: at,
                        ..*state
                    }
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{check_key, LinOp, OpKind, Verdict, STEP_BUDGET};
    use super::{HoldMode, SharedOp};

    fn op(client: usize, invoke: u64, complete: Option<u64>, kind: SharedOp) -> LinOp {
        LinOp {
            client,
            invoke,
            complete,
            kind: OpKind::Shared(kind),
        }
    }

    fn granted(token: u64, mode: HoldMode, slot: Option<u32>, permits: u32) -> SharedOp {
        SharedOp::Granted {
            token,
            ttl_us: 400_000,
            mode,
            slot,
            permits,
        }
    }

    fn check(ops: &[LinOp]) -> Verdict {
        check_key(ops, 5_000, STEP_BUDGET)
    }

    #[test]
    fn readers_share_and_a_writer_waits_for_them() {
        let ops = [
            op(0, 0, Some(10), granted(1, HoldMode::Read, None, 0)),
            op(1, 5, Some(20), granted(2, HoldMode::Read, None, 0)),
            op(0, 30, Some(40), SharedOp::Released { token: 1 }),
            op(2, 25, Some(90), granted(3, HoldMode::Write, None, 0)),
            op(1, 50, Some(60), SharedOp::Released { token: 2 }),
        ];
        assert_eq!(check(&ops), Verdict::Linearizable);
    }

    #[test]
    fn a_reader_beside_a_writer_is_a_violation() {
        // The writer's lease (400 ms) cannot have run out within 30 µs.
        let ops = [
            op(0, 0, Some(10), granted(1, HoldMode::Write, None, 0)),
            op(1, 20, Some(30), granted(2, HoldMode::Read, None, 0)),
        ];
        assert!(matches!(check(&ops), Verdict::Violation(_)));
        // Once the writer's lease may have run out, the reader fits.
        let ops = [
            op(0, 0, Some(10), granted(1, HoldMode::Write, None, 0)),
            op(
                1,
                500_000,
                Some(500_010),
                granted(2, HoldMode::Read, None, 0),
            ),
        ];
        assert_eq!(check(&ops), Verdict::Linearizable);
    }

    #[test]
    fn a_permit_past_the_size_or_in_a_taken_slot_is_a_violation() {
        let two = [
            op(0, 0, Some(10), granted(1, HoldMode::Permit, Some(0), 2)),
            op(1, 0, Some(10), granted(2, HoldMode::Permit, Some(1), 2)),
        ];
        assert_eq!(check(&two), Verdict::Linearizable);
        let mut three = two.to_vec();
        three.push(op(
            2,
            20,
            Some(30),
            granted(3, HoldMode::Permit, Some(0), 2),
        ));
        assert!(matches!(check(&three), Verdict::Violation(_)));
        let taken = [
            op(0, 0, Some(10), granted(1, HoldMode::Permit, Some(0), 3)),
            op(1, 20, Some(30), granted(2, HoldMode::Permit, Some(0), 3)),
        ];
        assert!(matches!(check(&taken), Verdict::Violation(_)));
    }

    #[test]
    fn an_unanswered_acquire_may_hold_and_explain_a_refusal() {
        // Client 1's acquire had no answer; client 0's writer was refused while nobody else
        // is known to hold: only the unanswered reader explains it.
        let ops = [
            op(
                1,
                0,
                None,
                SharedOp::AcquireUnknown {
                    ttl_us: 400_000,
                    mode: HoldMode::Read,
                    permits: 0,
                },
            ),
            op(0, 10, Some(20), SharedOp::HeldByOther),
        ];
        assert_eq!(check(&ops), Verdict::Linearizable);
        let alone = [op(0, 10, Some(20), SharedOp::HeldByOther)];
        assert!(matches!(check(&alone), Verdict::Violation(_)));
    }

    #[test]
    fn a_stale_token_answer_while_the_token_holds_is_a_violation() {
        let ops = [
            op(0, 0, Some(10), granted(5, HoldMode::Read, None, 0)),
            op(0, 20, Some(30), SharedOp::StaleToken { token: 5 }),
        ];
        assert!(matches!(check(&ops), Verdict::Violation(_)));
        let tokens_go_back = [
            op(0, 0, Some(10), granted(5, HoldMode::Read, None, 0)),
            op(1, 20, Some(30), granted(4, HoldMode::Read, None, 0)),
        ];
        assert!(matches!(check(&tokens_go_back), Verdict::Violation(_)));
    }
}
