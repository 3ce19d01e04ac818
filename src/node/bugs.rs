//! Known bugs the simulator and the chaos harness must catch: the switches ([`NodeBugs`]) and
//! how the node asks for one (`bug`, always false outside test and `mutations` builds).

use super::NodeCore;
use crate::storage::Storage;

/// Lease and housekeeping bugs that the simulator and the chaos harness must catch (switched on
/// in test builds and in a lock-node built with the `mutations` feature, never otherwise).
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeBugs {
    /// The lease ends when the release that handed the lock to a waiter is answered.
    pub lease_ended_after_hand_off: bool,
    /// Only grants answering a local pending proposal start a lease.
    pub lease_only_for_local_grants: bool,
    /// Expiry checks only the token (a renew racing it is acknowledged, then expired).
    pub expiry_checks_only_token: bool,
    /// A new leader ends the leases it inherits at once instead of giving each a full TTL from
    /// its election (it cannot know when the old leader last renewed them).
    pub no_lease_wait_after_election: bool,
    /// An expiry or cancel proposal is never retried.
    pub housekeeping_never_retried: bool,
    /// A Ready's answers leave, and its entries apply, as soon as its flush is started rather
    /// than done (with flushes that complete in the background).
    pub finish_before_flush_done: bool,
    /// A node with an empty data directory starts a new cluster when its peers do not answer
    /// (instead of only when every one answered that it has no data).
    pub bootstrap_when_unreachable: bool,
    /// The leader takes a voter's join as from the member it knows, whatever its incarnation
    /// (a member that lost its data goes on voting with an empty log).
    pub incarnation_ignored: bool,
    /// A node on a new data directory takes part in elections at once, before its log holds
    /// the entry that admitted it (it can vote with a log it does not have yet).
    pub admission_ignored: bool,
    /// The leader promotes a learner once caught up, before its log holds the entry that
    /// recorded its incarnation (it would be a voter that does not vote).
    pub promoted_before_admission: bool,
    /// The leader ends a lock-delay as soon as it starts (the key is granted again at once
    /// after an expiry).
    pub lock_delay_ended_at_once: bool,
    /// A new leader ends the lock-delays it inherits at once instead of timing each again in
    /// full from its election (it cannot know when the old leader started them).
    pub lock_delay_not_restarted_after_election: bool,
    /// The state machine applies a proclaim without checking that its token leads the election.
    pub proclaim_skips_holder_check: bool,
    /// A candidate elected by a hand-off shows no value until it proclaims one (its campaign
    /// value is dropped).
    pub elected_by_hand_off_without_value: bool,
    /// Ending a session releases its attached locks but leaves its attached acquires queued.
    pub session_end_keeps_waiters: bool,
    /// A session's expiry applies although a keepalive restarted its lease since.
    pub session_expiry_ignores_keepalive: bool,
    /// A new leader gives the sessions it inherits no time: they expire at once, although
    /// their clients may have kept them alive just before the election.
    pub no_session_wait_after_election: bool,
    /// The state machine grants a reader beside a writer (when the key's queue is empty).
    pub reader_beside_writer: bool,
    /// The state machine hands out one permit more than a semaphore's size.
    pub permit_over_size: bool,
    /// The state machine cancels a shared lock's waiter without granting those behind it that
    /// now fit (readers behind a cancelled writer wait on).
    pub shared_cancel_skips_grant: bool,
    /// The state machine ends a session without ending its read-write locks and permits, held
    /// or queued.
    pub session_end_skips_shared: bool,
}

impl NodeBugs {
    /// The bug named `name` switched on (the names of the fields above), for a lock-node built
    /// with the `mutations` feature to show that the chaos checker catches it.
    pub fn named(name: &str) -> Option<NodeBugs> {
        let mut bugs = NodeBugs::default();
        match name {
            "lease_ended_after_hand_off" => bugs.lease_ended_after_hand_off = true,
            "lease_only_for_local_grants" => bugs.lease_only_for_local_grants = true,
            "expiry_checks_only_token" => bugs.expiry_checks_only_token = true,
            "no_lease_wait_after_election" => bugs.no_lease_wait_after_election = true,
            "housekeeping_never_retried" => bugs.housekeeping_never_retried = true,
            "finish_before_flush_done" => bugs.finish_before_flush_done = true,
            "bootstrap_when_unreachable" => bugs.bootstrap_when_unreachable = true,
            "incarnation_ignored" => bugs.incarnation_ignored = true,
            "admission_ignored" => bugs.admission_ignored = true,
            "promoted_before_admission" => bugs.promoted_before_admission = true,
            "lock_delay_ended_at_once" => bugs.lock_delay_ended_at_once = true,
            "lock_delay_not_restarted_after_election" => {
                bugs.lock_delay_not_restarted_after_election = true
            }
            "proclaim_skips_holder_check" => bugs.proclaim_skips_holder_check = true,
            "elected_by_hand_off_without_value" => bugs.elected_by_hand_off_without_value = true,
            "session_end_keeps_waiters" => bugs.session_end_keeps_waiters = true,
            "session_expiry_ignores_keepalive" => bugs.session_expiry_ignores_keepalive = true,
            "no_session_wait_after_election" => bugs.no_session_wait_after_election = true,
            "reader_beside_writer" => bugs.reader_beside_writer = true,
            "permit_over_size" => bugs.permit_over_size = true,
            "shared_cancel_skips_grant" => bugs.shared_cancel_skips_grant = true,
            "session_end_skips_shared" => bugs.session_end_skips_shared = true,
            _ => return None,
        }
        Some(bugs)
    }
}

impl NodeBugs {
    /// The state machine's part of these bugs.
    pub fn machine(&self) -> crate::lock::MachineBugs {
        crate::lock::MachineBugs {
            proclaim_skips_holder_check: self.proclaim_skips_holder_check,
            elected_by_hand_off_without_value: self.elected_by_hand_off_without_value,
            session_end_keeps_waiters: self.session_end_keeps_waiters,
            session_expiry_ignores_keepalive: self.session_expiry_ignores_keepalive,
            reader_beside_writer: self.reader_beside_writer,
            permit_over_size: self.permit_over_size,
            shared_cancel_skips_grant: self.shared_cancel_skips_grant,
            session_end_skips_shared: self.session_end_skips_shared,
        }
    }
}

impl<S: Storage, R> NodeCore<S, R> {
    #[cfg(any(test, feature = "mutations"))]
    pub(super) fn bug(&self, which: impl Fn(&NodeBugs) -> bool) -> bool {
        which(&self.cfg.bugs)
    }

    #[cfg(not(any(test, feature = "mutations")))]
    pub(super) fn bug(&self, _which: impl Fn(&NodeBugs) -> bool) -> bool {
        false
    }
}
