//! Raft's safety invariants (election safety, log matching, leader completeness, state machine
//! safety), checked by the simulator after every step.
//!
//! Each check names the property of the Raft paper (Figure 3) it enforces. The checker only
//! observes: it is fed what nodes persisted, committed and applied, and what leaders appeared.

use std::collections::BTreeMap;

use crate::raft::{Entry, EntryPayload, Index, NodeId, Raft, Term};

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub invariant: &'static str,
    pub detail: String,
}

/// A cheap, stable fingerprint of an entry's payload.
pub fn payload_hash(payload: &EntryPayload) -> u64 {
    let mut h = Fnv::new();
    match payload {
        EntryPayload::Noop => h.write(&[0]),
        EntryPayload::Command(data) => {
            h.write(&[1]);
            h.write(data);
        }
        EntryPayload::Membership(change) => {
            h.write(&[2]);
            h.write(format!("{change:?}").as_bytes());
        }
        EntryPayload::Config(config) => {
            h.write(&[3]);
            h.write(format!("{config:?}").as_bytes());
        }
    }
    h.finish()
}

/// FNV-1a: deterministic across runs and platforms, which `DefaultHasher` does not promise.
pub struct Fnv(u64);

impl Fnv {
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    pub fn write_u64(&mut self, v: u64) {
        self.write(&v.to_le_bytes());
    }
    pub fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv {
    fn default() -> Self {
        Self::new()
    }
}

/// FNV-1a of a byte string.
pub fn fnv(bytes: &[u8]) -> u64 {
    let mut h = Fnv::new();
    h.write(bytes);
    h.finish()
}

/// The chained digest of a state machine after applying `entry` on top of `prev`.
pub fn chain(prev: u64, entry: &Entry) -> u64 {
    let mut h = Fnv::new();
    h.write_u64(prev);
    h.write_u64(entry.index);
    h.write_u64(entry.term);
    h.write_u64(payload_hash(&entry.payload));
    h.finish()
}

#[derive(Default)]
pub struct Checker {
    /// Election Safety: the leader of each term.
    leaders: BTreeMap<Term, NodeId>,
    /// Log Matching (part 1): every (index, term) ever persisted, with its payload.
    entries: BTreeMap<(Index, Term), u64>,
    /// Entries known committed, with their term (Leader Completeness, durability).
    committed: BTreeMap<Index, Term>,
    /// The lowest term of a node that saw each entry committed: the term it was committed in
    /// (the leader of that term learns it first).
    commit_term: BTreeMap<Index, Term>,
    /// State Machine Safety: the state digest after applying each index.
    applied: BTreeMap<Index, u64>,
    /// Highest term each node has put on a message: it must never restart below it.
    max_term_sent: BTreeMap<NodeId, Term>,
    pub violations: Vec<Violation>,
}

impl Checker {
    fn fail(&mut self, invariant: &'static str, detail: String) {
        self.violations.push(Violation { invariant, detail });
    }

    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    pub fn max_committed(&self) -> Index {
        self.committed.keys().next_back().copied().unwrap_or(0)
    }

    /// Election Safety (§5.2): at most one leader per term.
    pub fn on_leader(&mut self, node: NodeId, term: Term, raft: &Raft) {
        if let Some(&other) = self.leaders.get(&term) {
            if other != node {
                self.fail(
                    "election safety",
                    format!("nodes {other} and {node} both lead term {term}"),
                );
            }
        }
        self.leaders.insert(term, node);
        // Leader Completeness (§5.4): the new leader holds every committed entry.
        let snapshot_index = raft.snapshot_index();
        // Only entries committed in an earlier term bind this leader: a leader of a stale term
        // (elected while it was paused, say) may coexist with commits of later terms.
        let missing: Vec<(Index, Term)> = self
            .committed
            .range(snapshot_index + 1..)
            .filter(|(i, _)| self.commit_term.get(i).is_some_and(|&ct| ct < term))
            .filter(|(&i, &t)| raft.term_at(i) != Some(t))
            .map(|(&i, &t)| (i, t))
            .take(3)
            .collect();
        if let Some(&(i, t)) = missing.first() {
            self.fail(
                "leader completeness",
                format!(
                    "node {node} leads term {term} without committed entry {i} (term {t}); has term {:?}",
                    raft.term_at(i)
                ),
            );
        }
    }

    /// Log Matching (§5.3): two entries with the same index and term carry the same command.
    pub fn on_persist(&mut self, node: NodeId, entries: &[Entry]) {
        for entry in entries {
            let hash = payload_hash(&entry.payload);
            match self.entries.insert((entry.index, entry.term), hash) {
                Some(previous) if previous != hash => self.fail(
                    "log matching",
                    format!(
                        "node {node} persisted a different entry at index {} term {}",
                        entry.index, entry.term
                    ),
                ),
                _ => {}
            }
        }
    }

    /// Records newly committed entries and checks that no index is committed with two terms.
    pub fn on_commit(&mut self, node: NodeId, raft: &Raft, from: Index, to: Index) {
        for index in from.max(raft.snapshot_index() + 1)..=to {
            let Some(term) = raft.term_at(index) else {
                continue;
            };
            let seen_in = self.commit_term.entry(index).or_insert(raft.term());
            *seen_in = (*seen_in).min(raft.term());
            match self.committed.insert(index, term) {
                Some(previous) if previous != term => self.fail(
                    "state machine safety",
                    format!("node {node} committed index {index} with term {term}, another with {previous}"),
                ),
                _ => {}
            }
        }
    }

    /// State Machine Safety (§5.4.3): every node's state after index `i` is the same.
    pub fn on_apply(&mut self, node: NodeId, index: Index, digest: u64) {
        match self.applied.insert(index, digest) {
            Some(previous) if previous != digest => self.fail(
                "state machine safety",
                format!("node {node} applied a different entry at index {index}"),
            ),
            _ => {}
        }
    }

    pub fn on_send(&mut self, node: NodeId, msg: &crate::raft::Message) {
        use crate::raft::MessageBody;
        // PreVote messages carry a prospective term that nobody adopted (§9.6).
        if matches!(
            msg.body,
            MessageBody::Vote { pre_vote: true, .. }
                | MessageBody::VoteResponse { pre_vote: true, .. }
        ) {
            return;
        }
        let term = msg.term;
        let max = self.max_term_sent.entry(node).or_insert(0);
        *max = (*max).max(term);
    }

    /// After a restart the recovered term must not be below any term the node already used.
    /// A node's disk was wiped: its next incarnation starts at term 0 and learns the term anew
    /// (it takes no Raft message until it is a member again, so it votes in no term it saw).
    pub fn on_wipe(&mut self, node: NodeId) {
        self.max_term_sent.remove(&node);
    }

    pub fn on_restart(&mut self, node: NodeId, term: Term) {
        let sent = self.max_term_sent.get(&node).copied().unwrap_or(0);
        if term < sent {
            self.fail(
                "term monotonicity",
                format!("node {node} restarted in term {term} after sending in term {sent}"),
            );
        }
    }

    /// Log Matching (§5.3, full form): if two logs agree at an index and term, they agree on every
    /// entry before it. Checked on the entries both still hold in memory.
    pub fn check_logs_match(&mut self, a: &Raft, b: &Raft) {
        let lo = a.first_index().max(b.first_index());
        let hi = a.last_index().min(b.last_index());
        let mut agree_from: Option<Index> = None;
        for index in (lo..=hi).rev() {
            let (ta, tb) = (a.term_at(index), b.term_at(index));
            match agree_from {
                None if ta == tb => agree_from = Some(index),
                Some(at) if ta != tb => {
                    self.fail(
                        "log matching",
                        format!(
                            "nodes {} and {} agree at index {at} but differ at {index}",
                            a.id(),
                            b.id()
                        ),
                    );
                    return;
                }
                _ => {}
            }
            if let (Some(ea), Some(eb)) = (a.entry(index), b.entry(index)) {
                if ea.term == eb.term && ea.payload != eb.payload {
                    self.fail(
                        "log matching",
                        format!("different payloads at index {index}"),
                    );
                    return;
                }
            }
        }
    }

    /// Durability: every entry ever committed is held by a majority of the final voters (in
    /// their logs or covered by their snapshots). Checked once the cluster is healthy again.
    pub fn check_durability(&mut self, voters: &[&Raft]) {
        let majority = voters.len() / 2 + 1;
        let lost = self.committed.iter().find(|(&i, &t)| {
            voters
                .iter()
                .filter(|r| r.snapshot_index() >= i || r.term_at(i) == Some(t))
                .count()
                < majority
        });
        if let Some((&i, &t)) = lost {
            self.fail(
                "committed entries stay on a majority",
                format!(
                    "committed entry {i} (term {t}) is held by fewer than {majority} of {} voters",
                    voters.len()
                ),
            );
        }
    }
}
