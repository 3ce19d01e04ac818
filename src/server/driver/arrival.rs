//! The commit delay: a batch of client requests may wait a few tens of microseconds, before it is
//! proposed, for the next request of the clients that the last turns answered.
//!
//! Under contention a commit answers two clients at once: the holder that released, and the
//! waiter it handed the lock to. Both usually send their next request at once (the first takes
//! the lock again, the second releases it), and the two arrive a few microseconds apart. Taken
//! one at a time, each is a batch of its own: the second waits for the first's flush on every
//! node before its own flush starts, so every hand-off costs two flushes in a row. Waiting for
//! the second puts both in one flush.
//!
//! The wait happens only while clients answered since the last batch of requests have not sent
//! their next one, and it learns: a wait that ends because they came is a hit, one that runs out
//! is a miss. While most waits miss (clients that hold their lock, or think, before their next
//! request) the node stops waiting and tries again only now and then; the window follows how
//! long the hits took. A single client is never made to wait: its own request is the one it
//! waited for.

use std::time::Duration;

/// The shortest window a wait is given, whatever the hits took.
const MIN_WINDOW: Duration = Duration::from_micros(20);
/// While most waits miss, one chance in this many is still taken, to notice a change.
const RETRY_EVERY: u32 = 16;
/// Below this share of hits (a moving average) the node stops waiting.
const MIN_HIT_RATE: f64 = 0.5;
/// Weight of the newest wait in the moving averages.
const WEIGHT: f64 = 0.1;

/// How one wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitOutcome {
    /// Every client awaited sent its request within the window.
    Arrived,
    /// The window ran out first (or the batch filled up).
    TimedOut,
}

/// The commit delay's state: the clients awaited, and what earlier waits taught.
#[derive(Debug)]
pub struct ArrivalWait {
    /// The longest a batch waits (zero: never).
    max: Duration,
    /// Clients answered that have not sent a request since the last batch of requests.
    awaited: usize,
    /// Moving share of waits that were hits.
    hit_rate: f64,
    /// Moving mean of how long the hits waited, in µs.
    typical_us: f64,
    /// Chances passed up since the last wait taken while most waits missed.
    passed: u32,
}

impl ArrivalWait {
    pub fn new(max: Duration) -> Self {
        ArrivalWait {
            max,
            awaited: 0,
            hit_rate: 1.0,
            typical_us: max.as_secs_f64() * 1e6 / 4.0,
            passed: 0,
        }
    }

    /// A client was answered (it may send its next request now).
    pub fn answered(&mut self) {
        self.awaited = self.awaited.saturating_add(1);
    }

    /// A batch holding `clients` requests was taken from the queue: how long it may wait for
    /// more (`None`: propose it now). Counts those requests against the clients awaited; a
    /// batch of requests that does not wait forgets the rest (the next batch waits only for
    /// clients answered after this one). A batch of peer messages alone changes nothing.
    pub fn window(&mut self, clients: usize) -> Option<Duration> {
        if clients == 0 {
            return None;
        }
        let awaited = self.awaited.saturating_sub(clients);
        self.awaited = 0;
        if awaited == 0 || self.max.is_zero() {
            return None;
        }
        if self.hit_rate < MIN_HIT_RATE {
            self.passed += 1;
            if self.passed < RETRY_EVERY {
                return None;
            }
        }
        self.passed = 0;
        self.awaited = awaited;
        let learned = Duration::from_secs_f64(self.typical_us * 3.0 / 1e6);
        Some(learned.clamp(MIN_WINDOW.min(self.max), self.max))
    }

    /// One more client request came while waiting; true when none is awaited any more.
    pub fn arrived(&mut self) -> bool {
        self.awaited = self.awaited.saturating_sub(1);
        self.awaited == 0
    }

    /// The wait is over after `waited`: learns from it, and forgets the clients not heard from.
    pub fn finished(&mut self, outcome: WaitOutcome, waited: Duration) {
        let hit = outcome == WaitOutcome::Arrived;
        self.hit_rate = self.hit_rate * (1.0 - WEIGHT) + if hit { WEIGHT } else { 0.0 };
        if hit {
            let us = waited.as_secs_f64() * 1e6;
            self.typical_us = self.typical_us * (1.0 - WEIGHT) + us * WEIGHT;
        }
        self.awaited = 0;
    }

    /// The label of `outcome` in `raftlock_commit_delay_waits_total`.
    pub fn label(outcome: WaitOutcome) -> &'static str {
        match outcome {
            WaitOutcome::Arrived => "arrived",
            WaitOutcome::TimedOut => "timed_out",
        }
    }

    /// Clients answered and not heard from since the last batch.
    #[cfg(test)]
    fn awaited(&self) -> usize {
        self.awaited
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(100);

    #[test]
    fn a_lone_client_never_waits_for_itself() {
        let mut w = ArrivalWait::new(MAX);
        for _ in 0..100 {
            w.answered();
            assert_eq!(w.window(1), None);
        }
    }

    #[test]
    fn a_batch_waits_for_the_other_client_answered_with_it() {
        let mut w = ArrivalWait::new(MAX);
        // One commit answered the releasing holder and the waiter it handed the lock to.
        w.answered();
        w.answered();
        let window = w.window(1).expect("one answered client has not sent yet");
        assert!(window >= MIN_WINDOW && window <= MAX, "{window:?}");
        assert!(w.arrived(), "the second client was the last one awaited");
        w.finished(WaitOutcome::Arrived, Duration::from_micros(10));
        assert_eq!(w.awaited(), 0);
    }

    #[test]
    fn peer_messages_alone_neither_wait_nor_count() {
        let mut w = ArrivalWait::new(MAX);
        w.answered();
        w.answered();
        assert_eq!(w.window(0), None);
        assert_eq!(
            w.awaited(),
            2,
            "a batch of peer messages takes no client off the count"
        );
    }

    #[test]
    fn zero_turns_the_delay_off() {
        let mut w = ArrivalWait::new(Duration::ZERO);
        w.answered();
        w.answered();
        assert_eq!(w.window(1), None);
    }

    #[test]
    fn mostly_missed_waits_stop_and_are_retried_now_and_then() {
        let mut w = ArrivalWait::new(MAX);
        let mut taken = 0;
        for _ in 0..200 {
            w.answered();
            w.answered();
            if let Some(window) = w.window(1) {
                taken += 1;
                w.finished(WaitOutcome::TimedOut, window);
            }
        }
        // Seven misses bring the hit rate below one half (0.9^7 < 0.5); after that one chance
        // in RETRY_EVERY is taken.
        assert!(
            taken < 7 + 200 / RETRY_EVERY as usize + 1,
            "{taken} waits taken"
        );
        assert!(
            taken >= 7 + 200 / RETRY_EVERY as usize - 2,
            "{taken} waits taken"
        );
    }

    #[test]
    fn hits_bring_the_delay_back_and_shape_its_window() {
        let mut w = ArrivalWait::new(MAX);
        for _ in 0..20 {
            w.answered();
            w.answered();
            if let Some(window) = w.window(1) {
                w.finished(WaitOutcome::TimedOut, window);
            }
        }
        // Clients that now answer at once: the retries hit, and the node waits every time again.
        let mut windows = Vec::new();
        for _ in 0..300 {
            w.answered();
            w.answered();
            if let Some(window) = w.window(1) {
                windows.push(window);
                w.finished(WaitOutcome::Arrived, Duration::from_micros(8));
            }
        }
        let last = &windows[windows.len() - 20..];
        assert!(windows.len() > 100, "{} waits taken", windows.len());
        // Hits after 8 µs: the window shrinks toward 3 × 8 µs, never below MIN_WINDOW.
        assert!(
            last.iter()
                .all(|w| *w >= MIN_WINDOW && *w < Duration::from_micros(30)),
            "{last:?}"
        );
    }
}
