//! The core's in-memory copy of the Raft log since the last snapshot.
//!
//! The durable copy lives in `crate::storage`; this one tracks which suffix has not yet been handed
//! to the driver for persistence (`unstable_from`), what is committed and what has been handed out
//! for applying. Entries at or below the snapshot index are gone; only the snapshot's index and term
//! remain, which is all the log-matching check needs.

use super::types::{Entry, Index, Term};

#[derive(Debug, Default)]
pub struct RaftLog {
    /// Index and term of the last entry covered by the snapshot (0, 0 when there is none).
    snapshot_index: Index,
    snapshot_term: Term,
    /// `entries[i].index == snapshot_index + 1 + i`.
    entries: Vec<Entry>,
    /// First index not yet handed to the driver in a `Ready` for persisting.
    unstable_from: Index,
    /// Last index the driver has confirmed durable.
    stable: Index,
    pub(crate) committed: Index,
    /// Last index handed to the driver for applying.
    pub(crate) applied: Index,
}

impl RaftLog {
    /// A log recovered from storage: everything given here is already durable.
    pub fn restore(
        snapshot_index: Index,
        snapshot_term: Term,
        entries: Vec<Entry>,
        committed: Index,
        applied: Index,
    ) -> Self {
        let mut log = RaftLog {
            snapshot_index,
            snapshot_term,
            entries: Vec::new(),
            unstable_from: 0,
            stable: 0,
            committed: 0,
            applied: 0,
        };
        // Keep only a contiguous run starting right after the snapshot.
        for entry in entries {
            if entry.index == log.last_index() + 1 {
                log.entries.push(entry);
            } else if entry.index > log.last_index() + 1 {
                break;
            }
        }
        let last = log.last_index();
        log.unstable_from = last + 1;
        log.stable = last;
        // Every applied entry was committed: a stored commit index may lag the applied one (the
        // hard state is written when the term or vote changes, the applied index with the lock
        // state), and must not pull it back.
        log.committed = committed.max(applied).clamp(snapshot_index, last);
        log.applied = applied.clamp(snapshot_index, log.committed);
        log
    }

    pub fn snapshot_index(&self) -> Index {
        self.snapshot_index
    }

    pub fn first_index(&self) -> Index {
        self.snapshot_index + 1
    }

    pub fn last_index(&self) -> Index {
        self.snapshot_index + self.entries.len() as Index
    }

    pub fn last_term(&self) -> Term {
        self.entries.last().map_or(self.snapshot_term, |e| e.term)
    }

    pub fn stable_index(&self) -> Index {
        self.stable
    }

    /// The term of the entry at `index`: `Some(0)` for index 0, `None` if compacted or missing.
    pub fn term(&self, index: Index) -> Option<Term> {
        if index == self.snapshot_index {
            return Some(self.snapshot_term);
        }
        if index < self.snapshot_index || index > self.last_index() {
            return None;
        }
        Some(self.entries[(index - self.snapshot_index - 1) as usize].term)
    }

    pub fn entry(&self, index: Index) -> Option<&Entry> {
        if index <= self.snapshot_index || index > self.last_index() {
            return None;
        }
        Some(&self.entries[(index - self.snapshot_index - 1) as usize])
    }

    /// Entries `lo..=hi` that are still in memory (clamped).
    pub fn slice(&self, lo: Index, hi: Index) -> &[Entry] {
        let lo = lo.max(self.first_index());
        let hi = hi.min(self.last_index());
        if lo > hi {
            return &[];
        }
        let start = (lo - self.snapshot_index - 1) as usize;
        let end = (hi - self.snapshot_index) as usize;
        &self.entries[start..end]
    }

    /// Entries from `lo` up to `max_bytes` (always at least one if any exist).
    pub fn entries_from(&self, lo: Index, max_bytes: usize) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for entry in self.slice(lo, self.last_index()) {
            bytes += entry.size_bytes();
            if !out.is_empty() && bytes > max_bytes {
                break;
            }
            out.push(entry.clone());
        }
        out
    }

    /// True if the log holds an entry at `index` with `term` (or it is the snapshot point).
    pub fn matches(&self, index: Index, term: Term) -> bool {
        self.term(index) == Some(term)
    }

    /// Is a log ending at (`last_index`, `last_term`) at least as up-to-date as ours (§5.4.1)?
    pub fn is_up_to_date(&self, last_index: Index, last_term: Term) -> bool {
        last_term > self.last_term()
            || (last_term == self.last_term() && last_index >= self.last_index())
    }

    /// Appends at the end. The caller guarantees contiguity.
    pub fn append(&mut self, entry: Entry) {
        debug_assert_eq!(entry.index, self.last_index() + 1);
        self.entries.push(entry);
    }

    /// Removes every entry at or after `index`. Committed entries are never truncated; the caller
    /// checks before calling.
    pub fn truncate_from(&mut self, index: Index) {
        debug_assert!(index > self.committed, "truncating committed entries");
        if index > self.last_index() || index <= self.snapshot_index {
            return;
        }
        self.entries
            .truncate((index - self.snapshot_index - 1) as usize);
        self.unstable_from = self.unstable_from.min(index);
        self.stable = self.stable.min(index - 1);
    }

    /// Entries not yet handed out for persisting; marks them handed out.
    pub fn take_unstable(&mut self) -> Vec<Entry> {
        let out = self.slice(self.unstable_from, self.last_index()).to_vec();
        self.unstable_from = self.last_index() + 1;
        out
    }

    pub fn has_unstable(&self) -> bool {
        self.unstable_from <= self.last_index()
    }

    /// The driver has made everything up to (`index`, `term`) durable.
    pub fn stable_to(&mut self, index: Index, term: Term) {
        if self.term(index) == Some(term) && index < self.unstable_from {
            self.stable = self.stable.max(index);
        }
    }

    /// Committed entries not yet handed out for applying.
    pub fn has_next_committed(&self) -> bool {
        self.committed > self.applied
    }

    pub fn take_committed(&mut self, max_bytes: usize) -> Vec<Entry> {
        let out = self.entries_from(self.applied + 1, max_bytes);
        let out: Vec<Entry> = out
            .into_iter()
            .take_while(|e| e.index <= self.committed)
            .collect();
        if let Some(last) = out.last() {
            self.applied = last.index;
        }
        out
    }

    /// Drops entries up to `index` behind a snapshot the driver took (index <= applied).
    pub fn compact(&mut self, index: Index) {
        if index <= self.snapshot_index || index > self.applied {
            return;
        }
        let Some(term) = self.term(index) else { return };
        let drop = (index - self.snapshot_index) as usize;
        self.entries.drain(..drop);
        self.release_spare_capacity();
        self.snapshot_index = index;
        self.snapshot_term = term;
    }

    /// Gives back the room of compacted entries: a log compacted every 100,000 entries would
    /// otherwise keep the slots of the largest log it ever held (72 bytes each) for good.
    fn release_spare_capacity(&mut self) {
        let len = self.entries.len();
        if self.entries.capacity() > 2 * len + 1024 {
            self.entries.shrink_to(len + len / 2);
        }
    }

    /// Installs a snapshot received from the leader (§5.7): keep the suffix after it if our log
    /// already holds the snapshot's last entry, otherwise discard the whole log.
    pub fn install_snapshot(&mut self, index: Index, term: Term) {
        if self.matches(index, term) && index <= self.last_index() && index > self.snapshot_index {
            let drop = (index - self.snapshot_index) as usize;
            self.entries.drain(..drop);
            self.release_spare_capacity();
            self.stable = self.stable.max(index);
        } else {
            self.entries.clear();
            self.release_spare_capacity();
            self.unstable_from = index + 1;
            self.stable = index;
        }
        self.snapshot_index = index;
        self.snapshot_term = term;
        self.unstable_from = self.unstable_from.max(index + 1);
        self.committed = self.committed.max(index);
        self.applied = self.applied.max(index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft::EntryPayload;

    fn log_of(n: Index) -> RaftLog {
        let mut log = RaftLog::default();
        for index in 1..=n {
            log.append(Entry {
                term: 1,
                index,
                payload: EntryPayload::Noop,
            });
        }
        log.committed = n;
        log.applied = n;
        log
    }

    #[test]
    fn a_restart_commits_at_least_what_was_applied() {
        let entries = log_of(10).entries;
        // The hard state is written when the term or vote changes: its commit index may lag the
        // applied index stored with the lock state. Every applied entry was committed, so the
        // restored log starts with both at the applied index and applies nothing twice.
        let log = RaftLog::restore(0, 0, entries.clone(), 3, 7);
        assert_eq!((log.committed, log.applied), (7, 7));
        assert!(!log.has_next_committed());
        // A stored commit ahead of the applied index is kept (the entries between are applied).
        let log = RaftLog::restore(0, 0, entries.clone(), 9, 7);
        assert_eq!((log.committed, log.applied), (9, 7));
        assert!(log.has_next_committed());
        // Neither reaches past the stored log, nor below the snapshot.
        let log = RaftLog::restore(0, 0, entries[..5].to_vec(), 3, 7);
        assert_eq!((log.committed, log.applied), (5, 5));
        let log = RaftLog::restore(4, 1, entries[4..].to_vec(), 0, 0);
        assert_eq!((log.committed, log.applied), (4, 4));
    }

    #[test]
    fn compaction_gives_back_the_room_of_the_compacted_entries() {
        let mut log = log_of(100_000);
        assert!(log.entries.capacity() >= 100_000);
        log.compact(99_990);
        assert_eq!((log.first_index(), log.last_index()), (99_991, 100_000));
        assert_eq!(log.term(100_000), Some(1));
        assert!(
            log.entries.capacity() <= 2 * 10 + 1024,
            "{}",
            log.entries.capacity()
        );
        // A small log keeps its room: no reallocation on every compaction.
        let mut small = log_of(600);
        let room = small.entries.capacity();
        small.compact(300);
        assert_eq!(small.entries.capacity(), room);
    }

    #[test]
    fn an_installed_snapshot_gives_back_the_room_of_the_log_it_replaces() {
        let mut log = log_of(50_000);
        log.install_snapshot(80_000, 2);
        assert_eq!(log.last_index(), 80_000);
        assert!(log.entries.capacity() <= 1024, "{}", log.entries.capacity());
        let mut kept = log_of(50_000);
        kept.install_snapshot(49_000, 1);
        assert_eq!((kept.first_index(), kept.last_index()), (49_001, 50_000));
        assert!(
            kept.entries.capacity() <= 2 * 1000 + 1024,
            "{}",
            kept.entries.capacity()
        );
    }
}
