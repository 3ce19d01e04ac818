//! The leader's pacing of new requests against the exactly-once table's bound.
//!
//! Every answered request leaves an answer in the replicated table, and every answer is kept for
//! `dedupe_retain_ms` of log time (see `lock::machine`). When `dedupe_entries_max` answers are
//! younger than that, the state machine refuses every new request until the oldest of them age
//! out. Left to itself, a load above the table's sustainable rate (`dedupe_entries_max /
//! dedupe_retain_ms`) therefore runs at full speed until the table is full and then stops
//! altogether: at 128 clients on a 3-node cluster, 25 s of 10,000 acquires a second and then 35 s
//! in which no acquire was granted, again and again.
//!
//! The leader paces instead. It counts the answer-leaving requests it proposed in each second
//! of the last window — the retention plus a margin for the log clock, which trails the
//! leader's clock — as `recent`. New work (acquires, puts and deletes) is admitted while fewer
//! than `floor + (burst − recent) / horizon` were admitted in the current second: `floor` is 75%
//! of the sustainable rate (`max / window`, at least one a second), `burst` the part of the
//! bound a full window of `floor` leaves (a quarter), `horizon` a twentieth of the window. The
//! second's allowance is handed out as the second passes (a tenth of it at once), so that the
//! clients that retry fastest do not take all of it at the top of every second. A quiet table
//! lets bursts through untouched (about eleven seconds at 20,000 requests a second with the
//! defaults); a sustained overload settles at `floor` (about 12,000 requests, 6,000 lock cycles,
//! a second with the defaults), every second, and `recent` stays below `max`, so the table never
//! reaches its bound and nobody waits for answers to age out. Refused requests get `BUSY`, change nothing and are
//! retried by clients.
//!
//! Releases and renewals are never held back (they end work and keep leases alive); they count
//! in `recent` and in the second's allowance. A tenth of the floor is kept for new work every
//! second whatever they took, so that a load of renewals cannot shut acquires out for good, and
//! the floor is admitted whatever `recent` says (it counts proposals, retries of answered
//! requests included, so it can overstate the table): the state machine's own bound judges what
//! does not fit.
//!
//! Only counts and the node's clock are involved: nothing here is replicated, and a new leader
//! starts with an empty count (the state machine's bound still holds).

use std::collections::VecDeque;

use crate::lock::Limits;

use super::Micros;

/// Seconds of the leader's clock counted beyond the retention: the log clock, which ages the
/// answers, advances by the leader's ticks about once a second and not at all without a leader.
const LOG_CLOCK_MARGIN_S: u64 = 2;

/// The part of the sustainable rate (`max / window`) admitted whatever the recent count.
const FLOOR_PERCENT: u64 = 75;

/// Answer-leaving requests this leader proposed, per second of its clock.
#[derive(Debug, Default)]
pub struct AnswerPacer {
    /// `(second, requests, of which new work)`, oldest first, covering at most the window.
    seconds: VecDeque<(u64, u64, u64)>,
    /// The sum over `seconds`.
    recent: u64,
}

/// Why a new request was held back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paced {
    pub recent: u64,
    pub max: u64,
    pub retain_s: u64,
}

impl std::fmt::Display for Paced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the exactly-once table is pacing new requests ({} answers in the last {} s, bound {}); retry later",
            self.recent, self.retain_s, self.max
        )
    }
}

impl AnswerPacer {
    /// Requests counted in the current window.
    pub fn recent(&self) -> u64 {
        self.recent
    }

    /// Seconds counted: the retention and the margin.
    fn window_s(limits: &Limits) -> u64 {
        limits.dedupe_retain_ms.div_ceil(1000) + LOG_CLOCK_MARGIN_S
    }

    fn roll(&mut self, now: Micros, limits: &Limits) -> u64 {
        let second = now / 1_000_000;
        let window = Self::window_s(limits);
        while let Some(&(s, n, _)) = self.seconds.front() {
            if s + window > second {
                break;
            }
            self.seconds.pop_front();
            self.recent -= n;
        }
        second
    }

    /// Whether a new acquire, put or delete may be proposed at `now`.
    pub fn admit(&mut self, now: Micros, limits: &Limits) -> Result<(), Paced> {
        let max = limits.dedupe_entries_max as u64;
        if max == 0 {
            return Ok(());
        }
        let second = self.roll(now, limits);
        let (this_second, new_this_second) = match self.seconds.back() {
            Some(&(s, n, nw)) if s == second => (n, nw),
            _ => (0, 0),
        };
        let window = Self::window_s(limits);
        // A floor that a full window of it keeps below the bound (at least one a second, so that
        // a table too small for a floor still sees requests), and the rest of the bound spent in
        // bursts, paid back over `horizon` seconds. The floor does not shrink with `recent`,
        // which counts retries of answered requests too and can overstate the table; the state
        // machine's own bound refuses what does not fit.
        let floor = (max.saturating_mul(FLOOR_PERCENT) / 100 / window).max(1);
        let burst_budget = max.saturating_sub(floor.saturating_mul(window));
        let horizon_s = (window / 20).max(1);
        let allowed = floor + burst_budget.saturating_sub(self.recent) / horizon_s;
        // The second's allowance is handed out as it passes (a tenth of it at once), not all
        // at its start: otherwise the clients that retry fastest take it every second, and a
        // client that backs off longer may never get in.
        let into_second = now % 1_000_000;
        let so_far = (u128::from(allowed) * u128::from(into_second + 100_000) / 1_000_000) as u64;
        // Releases and renewals count against the allowance but are never refused; a tenth of
        // the floor is kept for new work whatever they took, so that a load of renewals cannot
        // shut acquires out for good (the state machine's own bound judges those).
        if this_second < so_far.clamp(1, allowed) || new_this_second < (floor / 10).max(1) {
            Ok(())
        } else {
            Err(Paced {
                recent: self.recent,
                max,
                retain_s: limits.dedupe_retain_ms / 1000,
            })
        }
    }

    /// Counts one proposed request that leaves an answer: new work (`admit`ted) or not.
    pub fn record(&mut self, now: Micros, limits: &Limits, new_work: bool) {
        let second = self.roll(now, limits);
        let w = u64::from(new_work);
        match self.seconds.back_mut() {
            Some((s, n, nw)) if *s == second => {
                *n += 1;
                *nw += w;
            }
            _ => self.seconds.push_back((second, 1, w)),
        }
        self.recent += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;

    fn limits(max: usize, retain_s: u64) -> Limits {
        Limits {
            dedupe_entries_max: max,
            dedupe_retain_ms: retain_s * 1000,
            ..Limits::default()
        }
    }

    /// Offers `demand` requests in each second from `from` to `to`; returns those admitted per
    /// second, and the most ever counted in a window.
    fn run(p: &mut AnswerPacer, l: &Limits, from: u64, to: u64, demand: u64) -> (Vec<u64>, u64) {
        let mut per_second = Vec::new();
        let mut peak = 0;
        for sec in from..to {
            let mut admitted = 0;
            for i in 0..demand {
                let now = sec * S + i * (S / demand);
                if p.admit(now, l).is_ok() {
                    p.record(now, l, true);
                    admitted += 1;
                }
                peak = peak.max(p.recent());
            }
            per_second.push(admitted);
        }
        (per_second, peak)
    }

    #[test]
    fn a_burst_into_an_empty_table_passes_untouched() {
        let l = limits(500_000, 60);
        let mut p = AnswerPacer::default();
        // Four seconds at 20,000 a second, about 80,000 answers, pass untouched.
        let (admitted, _) = run(&mut p, &l, 0, 4, 20_000);
        assert_eq!(admitted, vec![20_000; 4]);
    }

    #[test]
    fn a_sustained_overload_settles_below_the_bound_without_stopping() {
        // 20,000 requests a second offered for five minutes against the default bound: the
        // unpaced table fills in 25 s and then refuses everything for 35 s.
        let l = limits(500_000, 60);
        let mut p = AnswerPacer::default();
        let (admitted, peak) = run(&mut p, &l, 0, 300, 20_000);
        assert!(peak < 500_000, "the window reached the bound: {peak}");
        // Never a second below the floor (75% of 500,000 / 62 s)...
        let slowest = *admitted.iter().min().unwrap();
        assert!(slowest >= 6_000, "a second admitted only {slowest}");
        // ...and the first seconds at the full offered rate.
        assert_eq!(admitted[..4], [20_000; 4]);
        let last_minute: u64 = admitted[240..].iter().sum();
        let rate = last_minute / 60;
        assert!((6_000..=8_400).contains(&rate), "settled at {rate}/s");
    }

    #[test]
    fn a_quiet_spell_earns_a_new_burst() {
        let l = limits(500_000, 60);
        let mut p = AnswerPacer::default();
        let (_, _) = run(&mut p, &l, 0, 120, 20_000);
        // A minute with nothing, then the full rate again for a few seconds.
        let (admitted, _) = run(&mut p, &l, 180, 184, 20_000);
        assert_eq!(admitted, vec![20_000; 4]);
    }

    #[test]
    fn counts_age_out_of_the_window() {
        let l = limits(100, 10);
        let mut p = AnswerPacer::default();
        for i in 0..90 {
            p.record(i * 1_000, &l, true);
        }
        // 90 of 100 in the window, all in this second: (100 - 90) per second are allowed, and
        // this second is past that.
        assert!(p.admit(500_000, &l).is_err());
        // Within the window (10 s + the margin) they still count.
        assert!(p.admit(11 * S, &l).is_ok());
        assert_eq!(p.recent(), 90);
        // Past it, the count is empty again.
        assert!(p.admit(12 * S, &l).is_ok());
        assert_eq!(p.recent(), 0);
    }

    #[test]
    fn renewals_fill_the_window_but_not_the_seconds_allowance() {
        // 2,000 renewals a second against a table that sustains 1,000: acquires are still
        // admitted every second, at the floor (the state machine's own bound judges the rest).
        let l = limits(62_000, 60);
        let mut p = AnswerPacer::default();
        for sec in 0..120u64 {
            for i in 0..2_000 {
                p.record(sec * S + i * 500, &l, false);
            }
            let mut admitted = 0;
            for i in 0..100 {
                let now = sec * S + i * 10_000;
                if p.admit(now, &l).is_ok() {
                    p.record(now, &l, true);
                    admitted += 1;
                }
            }
            assert!(admitted >= 1, "second {sec}: no acquire admitted");
        }
    }

    #[test]
    fn a_seconds_allowance_is_handed_out_as_it_passes() {
        let l = limits(500_000, 60);
        let mut p = AnswerPacer::default();
        // A quiet table allows 6,048 + (125,024 - recent) / 3 this second (47,722 when empty);
        // at its start a tenth of that, which shrinks as `recent` grows: x = (6,048 +
        // (125,024 - x) / 3) / 10 at x = 4,618.
        let mut at_start = 0;
        while p.admit(0, &l).is_ok() {
            p.record(0, &l, true);
            at_start += 1;
        }
        assert_eq!(at_start, 4_618);
        // Half a second on, more.
        assert!(p.admit(S / 2, &l).is_ok());
    }

    #[test]
    fn no_table_no_pacing() {
        let l = limits(0, 60);
        let mut p = AnswerPacer::default();
        for _ in 0..10_000 {
            assert!(p.admit(0, &l).is_ok());
            p.record(0, &l, true);
        }
    }

    #[test]
    fn the_refusal_says_why() {
        let l = limits(10, 60);
        let mut p = AnswerPacer::default();
        for _ in 0..10 {
            p.record(0, &l, true);
        }
        let paced = p.admit(0, &l).unwrap_err();
        assert_eq!(
            paced.to_string(),
            "the exactly-once table is pacing new requests (10 answers in the last 60 s, bound 10); retry later"
        );
    }
}
