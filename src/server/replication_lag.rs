//! Replication lag in seconds for `raftlock_replication_lag_seconds`, computed by the driver from
//! what the Raft core already exposes (the leader's last index and each peer's matched index),
//! without touching the core.
//!
//! The leader remembers when it first saw each stretch of its log (one mark per [`GRAIN`]: "the
//! indices from `first` on were appended at `at` or later"). A peer's lag is the age of the
//! oldest entry it has not matched: `now - (when index matched + 1 was appended)`, 0 when it has
//! matched the leader's last index. The marks overestimate by at most one grain, and entries the
//! node appended before it became leader count as appended when it became leader.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::raft::Index;

/// Appends seen within this time of the newest mark share it.
pub const GRAIN: Duration = Duration::from_millis(10);
/// At most this many marks; beyond it every other mark is dropped (coarser, never younger).
pub const MAX_MARKS: usize = 8192;

/// Leader only; reset when the node stops leading.
#[derive(Debug)]
pub struct LagClock {
    /// When this node became leader: the append time of every entry older than the first mark.
    since: Instant,
    /// Highest last index seen.
    seen_upto: Index,
    /// `(first, at)`: indices from `first` on were first seen at `at`; increasing in both.
    marks: VecDeque<(Index, Instant)>,
}

impl LagClock {
    /// Starts the clock for a leader whose log ends at `last_index` at `now`.
    pub fn new(now: Instant, last_index: Index) -> Self {
        LagClock {
            since: now,
            seen_upto: last_index,
            marks: VecDeque::new(),
        }
    }

    /// Records that the leader's log ends at `last_index` at `now`.
    pub fn observe_last_index(&mut self, now: Instant, last_index: Index) {
        if last_index <= self.seen_upto {
            return;
        }
        let fresh = self
            .marks
            .back()
            .is_some_and(|&(_, at)| now.saturating_duration_since(at) < GRAIN);
        if !fresh {
            self.marks.push_back((self.seen_upto + 1, now));
            if self.marks.len() > MAX_MARKS {
                // Keep the oldest mark (a stuck peer's lag keeps growing) and every other one.
                let mut i = 0;
                self.marks.retain(|_| {
                    i += 1;
                    i % 2 == 1
                });
            }
        }
        self.seen_upto = last_index;
    }

    /// How long a peer that has matched `matched` has been behind a leader whose log ends at
    /// `last_index`: the age of the oldest entry it lacks, or zero when it lacks none.
    pub fn lag(&self, now: Instant, matched: Index, last_index: Index) -> Duration {
        if matched >= last_index {
            return Duration::ZERO;
        }
        let missing = matched + 1;
        let appended = match self.marks.partition_point(|&(first, _)| first <= missing) {
            0 => self.since,
            n => self.marks[n - 1].1,
        };
        now.saturating_duration_since(appended)
    }

    /// Forgets marks no peer needs any more: every peer has matched at least `min_matched`.
    pub fn forget_before(&mut self, min_matched: Index) {
        let missing = min_matched + 1;
        while self.marks.len() > 1 && self.marks[1].0 <= missing {
            self.marks.pop_front();
        }
    }

    pub fn marks(&self) -> usize {
        self.marks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn caught_up_is_zero_and_behind_is_the_age_of_the_oldest_missing_entry() {
        let t0 = Instant::now();
        let mut c = LagClock::new(t0, 10);
        assert_eq!(c.lag(t0 + ms(500), 10, 10), Duration::ZERO);
        // Entries from before the leadership count from when it began.
        assert_eq!(c.lag(t0 + ms(500), 7, 10), ms(500));
        c.observe_last_index(t0 + ms(100), 12);
        c.observe_last_index(t0 + ms(300), 20);
        assert_eq!(c.lag(t0 + ms(1000), 10, 20), ms(900));
        assert_eq!(c.lag(t0 + ms(1000), 11, 20), ms(900));
        assert_eq!(c.lag(t0 + ms(1000), 12, 20), ms(700));
        assert_eq!(c.lag(t0 + ms(1000), 19, 20), ms(700));
        assert_eq!(c.lag(t0 + ms(1000), 20, 20), Duration::ZERO);
    }

    #[test]
    fn appends_within_a_grain_share_a_mark() {
        let t0 = Instant::now();
        let mut c = LagClock::new(t0, 0);
        c.observe_last_index(t0 + ms(100), 1);
        c.observe_last_index(t0 + ms(101), 2);
        c.observe_last_index(t0 + ms(100) + GRAIN, 3);
        assert_eq!(c.marks(), 2);
        assert_eq!(c.lag(t0 + ms(200), 1, 3), ms(100));
    }

    #[test]
    fn forgetting_keeps_what_the_slowest_peer_needs() {
        let t0 = Instant::now();
        let mut c = LagClock::new(t0, 0);
        for i in 1..=10 {
            c.observe_last_index(t0 + ms(100 * i), i);
        }
        c.forget_before(5);
        assert_eq!(c.lag(t0 + ms(2000), 5, 10), ms(1400));
        assert_eq!(c.lag(t0 + ms(2000), 9, 10), ms(1000));
        assert!(c.marks() <= 6, "{}", c.marks());
    }

    #[test]
    fn marks_stay_bounded_and_a_stuck_peer_keeps_its_age() {
        let t0 = Instant::now();
        let mut c = LagClock::new(t0, 0);
        for i in 1..=(3 * MAX_MARKS as u64) {
            c.observe_last_index(t0 + GRAIN * i as u32, i);
        }
        assert!(c.marks() <= MAX_MARKS);
        let now = t0 + GRAIN * (3 * MAX_MARKS as u32);
        assert_eq!(c.lag(now, 0, 3 * MAX_MARKS as u64), now - (t0 + GRAIN));
    }
}
