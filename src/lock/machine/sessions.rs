//! Client sessions and the exactly-once table: each session's kept answers and their lookup by
//! request id, recording and updating answers, making room within the bounds (forgetting the
//! oldest finished answers past their retention), and `Tick`, which advances the log clock and
//! closes idle sessions.

use std::collections::btree_map::Entry;
use std::collections::{BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::super::limits::identity_of;
use super::super::outcome::{Outcome, RejectCode};
use super::quotas::limit_refusal;
use super::records::DedupeRecord;
use super::{LockStateMachine, DEDUPE_BLOCK, DIRTY_CLOCK, DIRTY_DEDUPE_NEXT};

/// Longest step one `Tick` may advance the log clock by: a leader that was paused (and has not
/// noticed it lost leadership) cannot age every session at once.
pub const TICK_MAX_MS: u64 = 10_000;
/// Queued answers skipped at most while looking for the oldest finished one to forget.
const EVICT_SCAN_MAX: usize = 1024;

/// One client's session: its remembered answers by insertion number (oldest first).
#[derive(Clone, Debug, Default)]
pub(super) struct Session {
    pub(super) records: SessionRecords,
    /// The exactly-once lookup: record numbers by the hash of their request id.
    pub(super) by_request: RequestIndex,
    /// How many of them answer an acquire that is still queued.
    queued: usize,
    /// The highest `ack_below` the client sent ([`Command::Sequenced`]), 0 for none: its answers
    /// numbered below are forgotten, and a request numbered below that is not remembered is
    /// refused. A session with a mark stays open without answers until it is idle.
    pub(super) mark: u64,
    /// Log clock when `mark` was last raised (the session is active then).
    pub(super) mark_at_ms: u64,
}

/// A session's record numbers in ascending order. Numbers only grow, so a new answer goes at
/// the back in O(1), where the ordered set this replaced walked its tree for every answer
/// (about 2% of a follower's CPU at 32 clients). A forgotten number may stay behind as a dead
/// entry until it reaches an end: every caller can tell a live number by the table holding it
/// (numbers are never reused), and dead entries are dropped at both ends at once and swept out
/// whenever they outnumber the live ones, so the deque stays within about twice the session.
#[derive(Clone, Debug, Default)]
pub(super) struct SessionRecords {
    pub(super) numbers: VecDeque<u64>,
    live: usize,
}

impl SessionRecords {
    pub(super) fn len(&self) -> usize {
        self.live
    }

    pub(super) fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Adds `n` (not remembered now): at the back unless a reload delivers numbers out of
    /// order. A dead entry of the same number is taken as it is.
    pub(super) fn insert(&mut self, n: u64) {
        match self.numbers.back() {
            Some(&last) if last >= n => {
                let at = self.numbers.partition_point(|&m| m < n);
                if self.numbers.get(at) != Some(&n) {
                    self.numbers.insert(at, n);
                }
            }
            _ => self.numbers.push_back(n),
        }
        self.live += 1;
    }

    /// `n` was forgotten (it is no longer live); `live` tells the numbers still remembered.
    pub(super) fn remove(&mut self, n: u64, live: impl Fn(u64) -> bool) {
        self.live = self.live.saturating_sub(1);
        if self.numbers.front() == Some(&n) {
            self.numbers.pop_front();
        } else if self.numbers.back() == Some(&n) {
            self.numbers.pop_back();
        }
        while self.numbers.front().is_some_and(|&m| !live(m)) {
            self.numbers.pop_front();
        }
        while self.numbers.back().is_some_and(|&m| !live(m)) {
            self.numbers.pop_back();
        }
        if self.numbers.len() > 2 * self.live + 16 {
            self.numbers.retain(|&m| live(m));
            if self.numbers.capacity() > 4 * self.numbers.len() + 64 {
                self.numbers.shrink_to_fit();
            }
        }
    }

    /// The newest remembered number (the back is never dead).
    pub(super) fn newest(&self) -> Option<u64> {
        self.numbers.back().copied()
    }

    /// Every number, oldest first, dead entries included (callers skip those).
    pub(super) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.numbers.iter().copied()
    }
}

/// One session's record numbers by the hash of their request id, which the lookup then checks
/// against the records' ids. Kept per client rather than in one table of every record, whose
/// resize (rehashing hundreds of thousands of keys at once, on every node at the same applied
/// index) stalled all clients for tens of milliseconds each time it doubled; by hashes rather
/// than by the ids themselves, which made each remembered answer hold its request id twice.
///
/// A hash table of `u64` to `u64` (16 bytes a slot): the lookup is one probe where the ordered
/// set it replaced walked four or five tree nodes of a large session, each a likely cache miss
/// (`perf record` at 32 clients put that walk at about 6% of the leader's driver thread). The
/// table holds the newest record of each hash; the others of the same hash, which only a
/// collision of two ids (or a damaged state holding one id twice) gives, wait in `older`.
#[derive(Clone, Debug, Default)]
pub(super) struct RequestIndex {
    pub(super) newest:
        std::collections::HashMap<u64, u64, std::hash::BuildHasherDefault<HashIsKey>>,
    older: BTreeSet<(u64, u64)>,
}

impl RequestIndex {
    pub(super) fn insert(&mut self, hash: u64, n: u64) {
        match self.newest.entry(hash) {
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(n);
            }
            std::collections::hash_map::Entry::Occupied(mut slot) => {
                let kept = *slot.get();
                if n > kept {
                    slot.insert(n);
                    self.older.insert((hash, kept));
                } else if n < kept {
                    self.older.insert((hash, n));
                }
            }
        }
    }

    pub(super) fn remove(&mut self, hash: u64, n: u64) {
        if self.newest.get(&hash) != Some(&n) {
            self.older.remove(&(hash, n));
            return;
        }
        match self
            .older
            .range((hash, 0)..=(hash, u64::MAX))
            .next_back()
            .copied()
        {
            Some(next) => {
                self.older.remove(&next);
                self.newest.insert(hash, next.1);
            }
            None => {
                self.newest.remove(&hash);
                // A table never gives memory back by itself: a session that once held many
                // answers and now holds few would keep its peak. Halve it once it is a quarter
                // full (a steady session, one answer in and one out, never gets there).
                let (len, capacity) = (self.newest.len(), self.newest.capacity());
                if capacity > 64 && len * 4 < capacity {
                    self.newest.shrink_to(len * 2);
                }
            }
        }
    }

    /// The record numbers filed under `hash`, newest first.
    pub(super) fn under(&self, hash: u64) -> impl Iterator<Item = u64> + '_ {
        let newest = self.newest.get(&hash).copied();
        let older = newest.into_iter().flat_map(move |_| {
            self.older
                .range((hash, 0)..=(hash, u64::MAX))
                .rev()
                .map(|&(_, n)| n)
        });
        newest.into_iter().chain(older)
    }
}

/// The hasher of [`RequestIndex`]: its keys are already hashes, spread over all 64 bits.
#[derive(Default)]
pub(super) struct HashIsKey(u64);

impl Hasher for HashIsKey {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used; anything else still hashes its bytes deterministically.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The lookup hash of a request id (in memory only, never stored or sent: any hash would do).
pub(super) fn request_hash(request_id: &str) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    request_id.hash(&mut hasher);
    hasher.finish()
}

impl LockStateMachine {
    pub(super) fn record(
        &mut self,
        client_id: &str,
        request_id: &str,
        outcome: Outcome,
        op: (u8, &str),
    ) {
        if self.limits.dedupe_entries_max == 0 {
            return;
        }
        // The session's copy of the client id when it has one (no new string to drop at once).
        let client: Arc<str> = match self.sessions.get_key_value(client_id) {
            Some((client, _)) => client.clone(),
            None => client_id.into(),
        };
        self.insert_record(DedupeRecord::new(
            client,
            request_id,
            outcome,
            Some(op),
            self.clock_ms,
        ));
    }

    /// The number of the record that answers `request_id` of `client_id`, if one is kept.
    pub(super) fn record_number(&self, client_id: &str, request_id: &str) -> Option<u64> {
        let hash = request_hash(request_id);
        // The newest record of that id, should a damaged state hold two.
        self.sessions
            .get(client_id)?
            .by_request
            .under(hash)
            .find(|n| {
                self.dedupe
                    .get(n)
                    .is_some_and(|r| r.request_id() == request_id)
            })
    }

    /// Files `rec` under its client's session (opened if need be), sharing the session's copy
    /// of the client id.
    pub(super) fn add_to_session(&mut self, n: u64, rec: &mut DedupeRecord) {
        // One lookup: the entry's key is the session's copy when the session is open.
        let session = match self.sessions.entry(rec.client_id.clone()) {
            Entry::Occupied(open) => {
                if !Arc::ptr_eq(open.key(), &rec.client_id) {
                    rec.client_id = open.key().clone();
                }
                open.into_mut()
            }
            Entry::Vacant(new) => new.insert(Session::default()),
        };
        session.records.insert(n);
        session.by_request.insert(request_hash(rec.request_id()), n);
        session.queued += usize::from(rec.is_queued());
    }

    /// Stores `rec` as the newest record (highest insertion number) of the table and its session.
    fn insert_record(&mut self, mut rec: DedupeRecord) {
        let n = self.dedupe_next;
        self.dedupe_next += 1;
        self.add_to_session(n, &mut rec);
        self.dedupe.insert(n, Box::new(rec));
        self.dirty_blocks.insert(n / DEDUPE_BLOCK);
        self.dirty_meta |= DIRTY_DEDUPE_NEXT;
    }

    /// Forgets record `n` (and its session when it was the last one).
    pub(super) fn remove_record(&mut self, n: u64) -> Option<DedupeRecord> {
        let rec = *self.dedupe.remove(&n)?;
        self.dirty_blocks.insert(n / DEDUPE_BLOCK);
        if let Some(session) = self.sessions.get_mut(&rec.client_id) {
            let dedupe = &self.dedupe;
            session.records.remove(n, |m| dedupe.contains_key(&m));
            session.by_request.remove(request_hash(rec.request_id()), n);
            if rec.is_queued() {
                session.queued = session.queued.saturating_sub(1);
            }
            if session.records.is_empty() && session.mark == 0 {
                self.sessions.remove(&rec.client_id);
            }
        }
        Some(rec)
    }

    /// A queued acquire's answer changed (granted or cancelled): a retry must now see that. The
    /// record moves to the newest position, so that its retention counts from this answer.
    pub(super) fn update_record(&mut self, client_id: &str, request_id: &str, outcome: Outcome) {
        let Some(n) = self.record_number(client_id, request_id) else {
            return;
        };
        if let Some(mut rec) = self.remove_record(n) {
            rec.set_outcome(outcome);
            rec.at_ms = self.clock_ms;
            self.insert_record(rec);
        }
    }

    /// Whether record `n` may be forgotten to keep a bound: finished (not a queued acquire) and
    /// answered at least `dedupe_retain_ms` ago.
    fn evictable(&self, n: u64) -> Option<bool> {
        let rec = self.dedupe.get(&n)?;
        if rec.is_queued() {
            return Some(false);
        }
        Some(rec.at_ms.saturating_add(self.limits.dedupe_retain_ms) <= self.clock_ms)
    }

    /// The oldest record among `candidates` (in insertion order) that may be forgotten. Records
    /// are in answer order, so the first finished record that is too young ends the search.
    /// Numbers no longer in the table (a session's dead entries) are passed over.
    fn oldest_evictable(&self, candidates: impl Iterator<Item = u64>) -> Option<u64> {
        let mut skipped = 0;
        for n in candidates {
            let Some(rec) = self.dedupe.get(&n) else {
                continue;
            };
            if rec.is_queued() {
                skipped += 1;
                if skipped > EVICT_SCAN_MAX {
                    return None;
                }
                continue;
            }
            return self.evictable(n).unwrap_or(false).then_some(n);
        }
        None
    }

    /// Makes room for one more answer from `client_id` within every bound, forgetting the oldest
    /// finished answers past their retention; refuses when a bound cannot be kept that way.
    pub(super) fn make_room(&mut self, client_id: &str) -> Result<(), Outcome> {
        let l = &self.limits;
        if l.dedupe_entries_max == 0 {
            return Ok(());
        }
        let (sessions_max, per_session, total) =
            (l.sessions_max, l.session_entries_max, l.dedupe_entries_max);
        let retain = l.dedupe_retain_ms;
        if !self.sessions.contains_key(client_id) {
            if let Some(q) = self.quotas.as_ref().filter(|q| q.by_identity) {
                let max = q.identity_sessions_max;
                if self.identity_sessions(identity_of(client_id), max) >= max {
                    return Err(limit_refusal(
                        "identity_sessions",
                        format!(
                            "identity {:?} has {max} client sessions open; a session closes \
                             after {} ms without requests from its client — retry later",
                            identity_of(client_id),
                            self.limits.session_idle_ms
                        ),
                    ));
                }
            }
        }
        if !self.sessions.contains_key(client_id) && self.sessions.len() >= sessions_max {
            return Err(limit_refusal(
                "sessions",
                format!(
                    "{sessions_max} client sessions are open; a session closes after {} ms \
                     without requests from its client — retry later",
                    self.limits.session_idle_ms
                ),
            ));
        }
        while self.session_len(client_id) >= per_session {
            let oldest = self
                .sessions
                .get(client_id)
                .and_then(|s| self.oldest_evictable(s.records.iter()));
            match oldest {
                Some(n) => {
                    self.remove_record(n);
                }
                None => {
                    return Err(limit_refusal(
                        "session_answers",
                        format!(
                            "client {client_id:?} has {per_session} answered requests younger \
                             than {retain} ms; retry later"
                        ),
                    ))
                }
            }
        }
        while self.dedupe.len() >= total {
            match self.oldest_evictable(self.dedupe.keys().copied()) {
                Some(n) => {
                    self.remove_record(n);
                }
                None => {
                    return Err(Outcome::rejected(
                        RejectCode::LimitReached,
                        format!(
                            "{total} answered requests are younger than {retain} ms; retry later"
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    /// `Tick`: advances the log clock, then closes idle sessions (those with a queued acquire
    /// stay open).
    pub(super) fn tick(&mut self, elapsed_ms: u64) -> Outcome {
        self.clock_ms = self.clock_ms.saturating_add(elapsed_ms.min(TICK_MAX_MS));
        self.dirty_meta |= DIRTY_CLOCK;
        let idle = self.limits.session_idle_ms;
        let clock = self.clock_ms;
        let closing: Vec<Arc<str>> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.queued == 0)
            .filter(|(_, s)| {
                let newest = s.records.newest().and_then(|n| self.dedupe.get(&n));
                let active = newest.map_or(0, |r| r.at_ms).max(s.mark_at_ms);
                active.saturating_add(idle) <= clock
            })
            .map(|(client, _)| client.clone())
            .collect();
        for client in closing {
            let Some(session) = self.sessions.remove(&client) else {
                continue;
            };
            if session.mark > 0 {
                self.dirty_acks.insert(client);
            }
            // Dead entries are no longer in the table: removing them changes nothing.
            for n in session.records.iter() {
                if self.dedupe.remove(&n).is_some() {
                    self.dirty_blocks.insert(n / DEDUPE_BLOCK);
                }
            }
        }
        Outcome::Stored
    }
}
