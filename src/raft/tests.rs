//! Unit tests of the core against a tiny synchronous network. Each names the section of the Raft
//! paper or dissertation whose rule it checks.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;

use super::*;

/// A synchronous in-memory network: messages queue up and are delivered in order on demand.
struct Net {
    nodes: BTreeMap<NodeId, Raft>,
    queue: VecDeque<Message>,
    blocked: BTreeSet<NodeId>,
    applied: BTreeMap<NodeId, Vec<Entry>>,
    reads: BTreeMap<NodeId, Vec<ReadState>>,
    installed_snapshots: BTreeMap<NodeId, u64>,
    /// What a driver staging `Ready::snapshot_chunks` as they come holds: the transfer's meta
    /// and bytes.
    staged: BTreeMap<NodeId, (SnapshotMeta, Vec<u8>)>,
    /// Messages seen, for assertions.
    log: Vec<Message>,
}

fn config(id: NodeId, pre_vote: bool) -> Config {
    let mut cfg = Config::new(id, 42);
    cfg.pre_vote = pre_vote;
    cfg
}

impl Net {
    fn new(n: u64, pre_vote: bool) -> Net {
        Net::with_config(n, |cfg| cfg.pre_vote = pre_vote)
    }

    /// `n` voters whose configurations `adjust` changes from the tests' default.
    fn with_config(n: u64, adjust: impl Fn(&mut Config)) -> Net {
        let membership = Membership::with_voters(1..=n);
        let nodes = (1..=n)
            .map(|id| {
                let initial = InitialState {
                    initial_membership: membership.clone(),
                    ..Default::default()
                };
                let mut cfg = config(id, false);
                adjust(&mut cfg);
                (id, Raft::new(cfg, initial).unwrap())
            })
            .collect();
        let mut net = Net {
            nodes,
            queue: VecDeque::new(),
            blocked: BTreeSet::new(),
            applied: BTreeMap::new(),
            reads: BTreeMap::new(),
            installed_snapshots: BTreeMap::new(),
            staged: BTreeMap::new(),
            log: Vec::new(),
        };
        for id in 1..=n {
            net.process(id);
        }
        net
    }

    fn raft(&mut self, id: NodeId) -> &mut Raft {
        self.nodes.get_mut(&id).unwrap()
    }

    fn process(&mut self, id: NodeId) {
        for _ in 0..100 {
            let raft = self.nodes.get_mut(&id).unwrap();
            if !raft.has_ready() {
                return;
            }
            let ready = raft.ready();
            self.queue.extend(ready.messages_now.iter().cloned());
            self.queue.extend(ready.messages.iter().cloned());
            for chunk in &ready.snapshot_chunks {
                if chunk.offset == 0 {
                    self.staged.insert(id, (chunk.meta.clone(), Vec::new()));
                }
                let (meta, bytes) = self.staged.get_mut(&id).expect("a chunk at offset 0 first");
                assert_eq!(*meta, chunk.meta, "node {id}: a chunk of another transfer");
                assert_eq!(
                    bytes.len() as u64,
                    chunk.offset,
                    "node {id}: chunks out of order"
                );
                bytes.extend_from_slice(&chunk.data);
            }
            if let Some(s) = &ready.snapshot {
                self.installed_snapshots.insert(id, s.meta.index);
                // The chunks handed out are the snapshot handed out.
                let staged = self.staged.remove(&id);
                assert_eq!(staged, Some((s.meta.clone(), s.data.to_vec())), "node {id}");
            }
            let installed = ready.snapshot.is_some();
            self.applied
                .entry(id)
                .or_default()
                .extend(ready.committed_entries.iter().cloned());
            self.reads
                .entry(id)
                .or_default()
                .extend(ready.read_states.iter().copied());
            let raft = self.nodes.get_mut(&id).unwrap();
            raft.advance(ready);
            if installed {
                // This harness puts a snapshot's state in place at once.
                raft.state_installed();
            }
        }
    }

    fn deliver_all(&mut self) {
        for _ in 0..100_000 {
            let Some(msg) = self.queue.pop_front() else {
                return;
            };
            self.deliver(msg);
        }
        panic!("network did not quiesce");
    }

    /// Hands `msg` to its node unless either end is blocked.
    fn deliver(&mut self, msg: Message) {
        if self.blocked.contains(&msg.from) || self.blocked.contains(&msg.to) {
            return;
        }
        self.log.push(msg.clone());
        let to = msg.to;
        if let Some(raft) = self.nodes.get_mut(&to) {
            raft.step(msg);
            self.process(to);
        }
    }

    fn tick_all(&mut self, ticks: u32) {
        for _ in 0..ticks {
            let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
            for id in ids {
                self.raft(id).tick();
                self.process(id);
            }
            self.deliver_all();
        }
    }

    /// Like `tick_all`, but every message takes one tick to arrive: what a tick sends is
    /// delivered at the start of the next, so heartbeats overlap slower exchanges.
    /// `lose` picks messages the network drops.
    fn tick_with_latency(&mut self, ticks: u32, mut lose: impl FnMut(&Message) -> bool) {
        for _ in 0..ticks {
            let in_flight = self.queue.len();
            for _ in 0..in_flight {
                let msg = self.queue.pop_front().unwrap();
                if !lose(&msg) {
                    self.deliver(msg);
                }
            }
            let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
            for id in ids {
                self.raft(id).tick();
                self.process(id);
            }
        }
    }

    /// Node 1 leads with 1 KiB snapshot chunks; node 3, cut off, misses 30 entries that node 1
    /// then compacts into a snapshot holding `data`; node 3 is reachable again. Returns the
    /// snapshot's index.
    fn lagging_follower_and_snapshot(&mut self, data: &Bytes) -> Index {
        self.raft(1).set_snapshot_chunk_bytes(1024);
        self.elect(1);
        self.blocked.insert(3);
        for _ in 0..30 {
            self.propose(1, b"x");
        }
        let applied = self.raft(1).applied_index();
        assert!(self.raft(1).compact(applied, data.clone()));
        self.blocked.clear();
        applied
    }

    /// InstallSnapshot messages delivered to `to` so far.
    fn chunks_delivered_to(&self, to: NodeId) -> usize {
        self.log
            .iter()
            .filter(|m| matches!(m.body, MessageBody::InstallSnapshot { .. }) && m.to == to)
            .count()
    }

    fn elect(&mut self, id: NodeId) {
        self.raft(id).campaign_now();
        self.process(id);
        self.deliver_all();
        assert!(self.raft(id).is_leader(), "node {id} should have won");
    }

    fn propose(&mut self, id: NodeId, data: &'static [u8]) -> Index {
        let index = self
            .raft(id)
            .propose(vec![Bytes::from_static(data)])
            .unwrap();
        self.process(id);
        self.deliver_all();
        index
    }

    fn leaders(&self) -> Vec<NodeId> {
        self.nodes
            .values()
            .filter(|r| r.is_leader())
            .map(|r| r.id())
            .collect()
    }
}

fn vote_request(
    from: NodeId,
    to: NodeId,
    term: Term,
    last_index: Index,
    last_term: Term,
) -> Message {
    Message {
        from,
        to,
        term,
        body: MessageBody::Vote {
            pre_vote: false,
            last_log_index: last_index,
            last_log_term: last_term,
            leadership_transfer: false,
        },
    }
}

fn granted_votes(raft: &mut Raft) -> Vec<bool> {
    let ready = raft.ready();
    let out = ready
        .messages
        .iter()
        .filter_map(|m| match m.body {
            MessageBody::VoteResponse { granted, .. } => Some(granted),
            _ => None,
        })
        .collect();
    raft.advance(ready);
    out
}

/// A voter whose log ends at (index 3, term 2).
fn voter_with_log() -> Raft {
    let entries = (1..=3)
        .map(|i| Entry {
            term: if i == 1 { 0 } else { 2 },
            index: i,
            payload: EntryPayload::Noop,
        })
        .collect::<Vec<_>>();
    let mut entries = entries;
    entries[0].payload = EntryPayload::Config(Membership::with_voters([1, 2, 3]));
    let initial = InitialState {
        hard_state: HardState {
            term: 2,
            vote: 0,
            commit: 1,
        },
        entries,
        ..Default::default()
    };
    let mut raft = Raft::new(config(1, false), initial).unwrap();
    let ready = raft.ready();
    raft.advance(ready);
    raft
}

// Reference: §5.2 and §5.4.1 — a vote is granted only to a candidate whose log is at least as
// up-to-date (compare last term, then length), and only once per term.
#[test]
fn vote_rules() {
    // (candidate last index, candidate last term, granted?)
    let table = [
        (3, 2, true),  // identical
        (4, 2, true),  // same term, longer
        (2, 2, false), // same term, shorter
        (1, 3, true),  // later term wins even if shorter
        (9, 1, false), // earlier term loses even if longer
    ];
    for (last_index, last_term, want) in table {
        let mut voter = voter_with_log();
        voter.step(vote_request(2, 1, 3, last_index, last_term));
        assert_eq!(
            granted_votes(&mut voter),
            vec![want],
            "candidate log ({last_index}, {last_term})"
        );
    }
    // One vote per term: after voting for 2 in term 3, node 3 is refused in term 3 ...
    let mut voter = voter_with_log();
    voter.step(vote_request(2, 1, 3, 3, 2));
    assert_eq!(granted_votes(&mut voter), vec![true]);
    voter.step(vote_request(3, 1, 3, 3, 2));
    assert_eq!(granted_votes(&mut voter), vec![false]);
    // ... but a repeated request from 2 is granted again (idempotent), and so is 3 in term 4.
    voter.step(vote_request(2, 1, 3, 3, 2));
    assert_eq!(granted_votes(&mut voter), vec![true]);
    voter.step(vote_request(3, 1, 4, 3, 2));
    assert_eq!(granted_votes(&mut voter), vec![true]);
    assert_eq!(voter.hard_state().vote, 3);
    assert_eq!(voter.term(), 4);
}

#[test]
fn vote_is_persisted_before_the_reply_leaves() {
    // Figure 2: the reply must wait for the flush of the hard state that records the vote.
    let mut voter = voter_with_log();
    voter.step(vote_request(2, 1, 3, 3, 2));
    let ready = voter.ready();
    assert!(ready.must_sync());
    assert_eq!(ready.hard_state.map(|h| (h.term, h.vote)), Some((3, 2)));
    assert!(
        ready.messages_now.is_empty(),
        "no reply may leave before the flush"
    );
    assert_eq!(ready.messages.len(), 1);
}

// Reference: seed design "recovery index/term", case (i): follower log shorter.
#[test]
fn backtracking_when_follower_log_is_shorter() {
    let mut net = Net::new(3, true);
    net.elect(1);
    net.blocked.insert(3);
    for _ in 0..20 {
        net.propose(1, b"x");
    }
    net.blocked.clear();
    net.log.clear();
    net.tick_all(3); // heartbeat response from 3 triggers a probe
    let rejection = net.log.iter().find_map(|m| match m.body {
        MessageBody::AppendResponse {
            success: false,
            recovery_index,
            recovery_term,
            ..
        } if m.from == 3 => Some((recovery_index, recovery_term)),
        _ => None,
    });
    // Node 3 holds entries 1 (config) and 2 (the leader's no-op): its length is 2.
    assert_eq!(rejection, Some((2, 0)));
    // One rejection was enough: the next append starts right after the follower's log.
    let rejections = net
        .log
        .iter()
        .filter(|m| matches!(m.body, MessageBody::AppendResponse { success: false, .. }))
        .count();
    assert_eq!(rejections, 1);
    assert_eq!(net.raft(3).last_index(), net.raft(1).last_index());
}

// Reference: seed design case (ii): conflicting term; the follower reports the term and the last
// index before it, and the leader skips the whole term at once.
#[test]
fn backtracking_over_a_conflicting_term() {
    let mut net = Net::new(3, true);
    net.elect(1);
    net.propose(1, b"a"); // index 3, everyone has it
                          // Node 1 appends five entries nobody else receives, then loses leadership.
    net.blocked.insert(1);
    for _ in 0..5 {
        let _ = net.raft(1).propose(vec![Bytes::from_static(b"lost")]);
        net.process(1);
    }
    net.queue.clear();
    // The others elect a new leader among themselves once node 1's lease has run out.
    net.tick_all(60);
    let new_leader = *net
        .leaders()
        .iter()
        .find(|&&l| l != 1)
        .expect("2 or 3 leads");
    for _ in 0..3 {
        net.propose(new_leader, b"b");
    }
    // Hand leadership to the third node: its guess for node 1's next index is past the conflict.
    let third = if new_leader == 2 { 3 } else { 2 };
    net.raft(new_leader).transfer_leader(third).unwrap();
    net.process(new_leader);
    net.deliver_all();
    assert_eq!(net.leaders(), vec![third]);
    let new_leader = third;
    net.blocked.clear();
    net.log.clear();
    net.tick_all(3);
    let rejection = net.log.iter().find_map(|m| match m.body {
        MessageBody::AppendResponse {
            success: false,
            recovery_index,
            recovery_term,
            rejected_index,
            ..
        } if m.from == 1 => Some((recovery_index, recovery_term, rejected_index)),
        _ => None,
    });
    let (recovery_index, recovery_term, _) = rejection.expect("node 1 rejects once");
    let leader_term_1 = net.raft(new_leader).term_at(3).unwrap();
    assert_eq!(
        recovery_term, leader_term_1,
        "conflicting entries are from node 1's term"
    );
    assert_eq!(
        recovery_index, 3,
        "last index before the conflicting run (4..=8)"
    );
    // The conflicting suffix was replaced and logs now match.
    assert_eq!(net.raft(1).last_index(), net.raft(new_leader).last_index());
    for i in 1..=net.raft(new_leader).last_index() {
        assert_eq!(
            net.raft(1).term_at(i),
            net.raft(new_leader).term_at(i),
            "index {i}"
        );
    }
}

// Reference: §5.4.2 — a leader never commits an entry of an earlier term by counting replicas;
// it commits it only together with an entry of its own term.
#[test]
fn commit_rule_counts_only_current_term_entries() {
    // Node 1 restarts holding entry 3 from term 1 that was never committed.
    let mut entries = vec![
        Entry {
            term: 0,
            index: 1,
            payload: EntryPayload::Config(Membership::with_voters([1, 2, 3])),
        },
        Entry {
            term: 1,
            index: 2,
            payload: EntryPayload::Noop,
        },
        Entry {
            term: 1,
            index: 3,
            payload: EntryPayload::Command(Bytes::from_static(b"old")),
        },
    ];
    let initial = InitialState {
        hard_state: HardState {
            term: 1,
            vote: 1,
            commit: 2,
        },
        entries: entries.clone(),
        ..Default::default()
    };
    entries.truncate(2);
    let mut leader = Raft::new(config(1, true), initial).unwrap();
    let drain = |raft: &mut Raft| {
        let ready = raft.ready();
        raft.advance(ready);
    };
    drain(&mut leader);
    leader.campaign_now();
    let msg = |body| Message {
        from: 2,
        to: 1,
        term: 2,
        body,
    };
    leader.step(msg(MessageBody::VoteResponse {
        pre_vote: true,
        granted: true,
    }));
    leader.step(msg(MessageBody::VoteResponse {
        pre_vote: false,
        granted: true,
    }));
    assert!(leader.is_leader());
    assert_eq!(leader.term(), 2);
    drain(&mut leader); // the no-op (index 4, term 2) is now durable on the leader
    assert_eq!(leader.term_at(4), Some(2));
    let ack = |match_index| {
        msg(MessageBody::AppendResponse {
            success: true,
            match_index,
            rejected_index: 0,
            recovery_index: 0,
            recovery_term: 0,
        })
    };
    // Entry 3 (term 1) is now on a majority (nodes 1 and 2) — still not committed.
    leader.step(ack(3));
    assert_eq!(
        leader.commit_index(),
        2,
        "an earlier-term entry must not commit by counting"
    );
    // Once the term-2 no-op is on a majority, both commit.
    leader.step(ack(4));
    assert_eq!(leader.commit_index(), 4);
}

// Reference: dissertation §4.1 — one membership change at a time, and (§4.1 bug fix) not before
// the leader has committed an entry of its own term.
#[test]
fn one_membership_change_at_a_time() {
    let mut net = Net::new(3, true);
    net.raft(1).campaign_now();
    net.process(1);
    // Deliver only the votes, not the no-op acknowledgements.
    while let Some(msg) = net.queue.pop_front() {
        let to = msg.to;
        let is_vote = matches!(
            msg.body,
            MessageBody::Vote { .. } | MessageBody::VoteResponse { .. }
        );
        if is_vote {
            net.raft(to).step(msg);
            if to == 1 {
                net.process(1);
            } else {
                let ready = net.raft(to).ready();
                net.queue.extend(
                    ready
                        .messages
                        .iter()
                        .filter(|m| matches!(m.body, MessageBody::VoteResponse { .. }))
                        .cloned(),
                );
                net.raft(to).advance(ready);
            }
        }
    }
    assert!(net.raft(1).is_leader());
    assert_eq!(
        net.raft(1)
            .propose_membership(MembershipChange::AddLearner(4)),
        Err(ProposeError::LeaderNotReady)
    );
    net.tick_all(3);
    assert!(net.raft(1).committed_in_current_term());
    net.raft(1)
        .propose_membership(MembershipChange::AddLearner(4))
        .unwrap();
    assert!(
        net.raft(1).membership().learners.contains(&4),
        "takes effect when appended"
    );
    net.blocked.insert(2);
    net.blocked.insert(3);
    net.process(1);
    assert_eq!(
        net.raft(1)
            .propose_membership(MembershipChange::AddLearner(5)),
        Err(ProposeError::MembershipChangePending)
    );
    net.blocked.clear();
    net.tick_all(3);
    net.raft(1)
        .propose_membership(MembershipChange::AddLearner(5))
        .unwrap();
    assert_eq!(
        net.raft(1)
            .propose_membership(MembershipChange::RemoveServer(9)),
        Err(ProposeError::MembershipChangePending)
    );
}

// Reference: dissertation §3.10 — leadership transfer with TimeoutNow.
#[test]
fn leadership_transfer() {
    let mut net = Net::new(3, true);
    net.elect(1);
    net.propose(1, b"a");
    net.raft(1).transfer_leader(3).unwrap();
    assert_eq!(
        net.raft(1).propose(vec![Bytes::from_static(b"b")]),
        Err(ProposeError::TransferInProgress)
    );
    net.process(1);
    net.deliver_all();
    assert_eq!(net.leaders(), vec![3]);
    assert!(net
        .log
        .iter()
        .any(|m| m.body == MessageBody::TimeoutNow && m.to == 3));
    assert_eq!(net.raft(1).leader_id(), 3);
    // Transfer to a non-voter is refused.
    assert_eq!(
        net.raft(3).transfer_leader(9),
        Err(ProposeError::NotVoter(9))
    );
}

// Reference: dissertation §6.4 — ReadIndex answers only after a quorum confirms leadership, and
// never writes to the log.
#[test]
fn read_index() {
    let mut net = Net::new(3, true);
    net.elect(1);
    net.propose(1, b"a");
    let last = net.raft(1).last_index();
    net.raft(1).read_index(7).unwrap();
    assert_eq!(
        net.raft(1).last_index(),
        last,
        "reads are not written to the log"
    );
    net.process(1);
    assert!(
        net.reads.get(&1).is_none_or(|r| r.is_empty()),
        "not before a quorum answered"
    );
    net.deliver_all();
    let commit = net.raft(1).commit_index();
    assert_eq!(
        net.reads[&1],
        vec![ReadState {
            ctx: 7,
            index: commit
        }]
    );

    // A leader cut off from the quorum cannot serve a read.
    net.blocked.insert(2);
    net.blocked.insert(3);
    net.raft(1).read_index(8).unwrap();
    net.process(1);
    net.deliver_all();
    assert_eq!(net.reads[&1].len(), 1);
    // Followers refuse and name the leader.
    assert_eq!(
        net.raft(2).read_index(9),
        Err(ProposeError::NotLeader { leader_id: 1 })
    );
}

// Reference: §5.7 — a follower whose next entry was compacted away gets a snapshot, in chunks.
#[test]
fn snapshot_install_for_a_lagging_follower() {
    let mut net = Net::new(3, true);
    // Small chunks so the snapshot travels in several messages.
    let data = Bytes::from(vec![7u8; 3 * 1024 + 5]);
    let applied = net.lagging_follower_and_snapshot(&data);
    assert_eq!(net.raft(1).snapshot_index(), applied);
    net.log.clear();
    net.tick_all(4);
    let chunks = net.chunks_delivered_to(3);
    assert!(chunks >= 4, "expected at least 4 chunks, saw {chunks}");
    assert_eq!(net.installed_snapshots.get(&3), Some(&applied));
    assert_eq!(net.raft(3).snapshot_index(), applied);
    assert_eq!(net.raft(3).last_index(), net.raft(1).last_index());
    assert_eq!(net.nodes[&3].membership(), net.nodes[&1].membership());
    assert_eq!(
        net.raft(3).latest_snapshot().map(|s| s.data.clone()),
        Some(data)
    );
}

/// A follower sizes the buffer for an arriving snapshot from the sender's `total_len` once, and
/// the chunks alone decide what it installs: a total that is missing (a sender before the
/// field), past the limit, or wrong changes nothing but the buffer's first size.
#[test]
fn a_snapshots_total_len_sizes_the_buffer_and_decides_nothing_else() {
    let data: Vec<u8> = (0..20u8).collect();
    for (k, total_len) in [20, 0, u64::MAX, 7, 1 << 40].into_iter().enumerate() {
        let mut net = Net::new(3, true);
        net.elect(1);
        let term = net.raft(1).term();
        let meta = SnapshotMeta {
            index: 50 + k as u64,
            term,
            membership: Membership::with_voters([1, 2, 3]),
        };
        for (offset, done) in [(0usize, false), (10, true)] {
            net.raft(2).step(Message {
                from: 1,
                to: 2,
                term,
                body: MessageBody::InstallSnapshot {
                    meta: meta.clone(),
                    offset: offset as u64,
                    data: Bytes::copy_from_slice(&data[offset..offset + 10]),
                    done,
                    total_len,
                },
            });
            if !done {
                let capacity = net.raft(2).incoming_snapshot_capacity().unwrap();
                if total_len == 20 {
                    assert!(capacity >= 20, "sized from the total: {capacity}");
                } else if total_len > config(2, true).max_snapshot_bytes {
                    assert!(
                        capacity < 1 << 20,
                        "a total past the limit reserved {capacity}"
                    );
                }
            }
            net.process(2);
        }
        assert_eq!(
            net.installed_snapshots.get(&2),
            Some(&meta.index),
            "total_len {total_len}"
        );
        assert_eq!(
            net.raft(2).latest_snapshot().map(|s| s.data.to_vec()),
            Some(data.clone()),
            "total_len {total_len}"
        );
    }
}

// A snapshot whose bytes were let go (to spare memory) is asked for again when a follower needs
// it, and sent once provided; bytes a transfer is using are not let go.
#[test]
fn released_snapshot_bytes_are_asked_for_again_and_then_sent() {
    let mut net = Net::new(3, true);
    let data = Bytes::from(vec![9u8; 3 * 1024 + 5]);
    let applied = net.lagging_follower_and_snapshot(&data);
    // Node 3 was cut off, but the leader does not know yet that it needs the snapshot.
    assert!(net.raft(1).release_snapshot_data());
    assert!(!net.raft(1).release_snapshot_data(), "already let go");
    assert_eq!(net.raft(1).latest_snapshot().map(|s| s.data.len()), Some(0));
    assert!(!net.raft(1).snapshot_wanted());
    net.log.clear();
    net.tick_all(4);
    assert!(net.raft(1).snapshot_wanted(), "node 3 needs the snapshot");
    assert_eq!(net.chunks_delivered_to(3), 0, "nothing to send yet");
    assert!(
        !net.raft(1).release_snapshot_data(),
        "nothing left to let go while wanted"
    );
    // An older point is refused; the same point gets its bytes back.
    assert!(!net.raft(1).provide_snapshot(applied - 1, data.clone()));
    assert!(net.raft(1).provide_snapshot(applied, data.clone()));
    assert!(!net.raft(1).snapshot_wanted());
    // While node 3 is behind the log, the bytes stay.
    assert!(!net.raft(1).release_snapshot_data());
    net.tick_all(4);
    assert!(net.chunks_delivered_to(3) >= 4);
    assert_eq!(net.installed_snapshots.get(&3), Some(&applied));
    assert_eq!(net.raft(3).last_index(), net.raft(1).last_index());
    // Caught up: the leader may let go again.
    assert!(net.raft(1).release_snapshot_data());
}

// Reference: §5.7 — the log compacted without snapshot bytes (the driver's stored state is the
// snapshot): a follower whose next entry went is noticed, the bytes are asked for, and once
// provided at a newer point (the state as it is then) they are sent and installed.
#[test]
fn a_log_compacted_without_bytes_asks_for_them_when_a_follower_needs_them() {
    let mut net = Net::new(3, true);
    net.raft(1).set_snapshot_chunk_bytes(1024);
    net.elect(1);
    assert!(!net.raft(1).peers_need_snapshot());
    net.blocked.insert(3);
    for _ in 0..30 {
        net.propose(1, b"x");
    }
    let first = net.raft(1).applied_index();
    assert!(
        !net.raft(1).compact_without_data(first + 1),
        "not applied yet"
    );
    assert!(net.raft(1).compact_without_data(first));
    assert!(
        !net.raft(1).compact_without_data(first),
        "already compacted there"
    );
    assert_eq!(net.raft(1).snapshot_index(), first);
    assert_eq!(net.raft(1).latest_snapshot().map(|s| s.data.len()), Some(0));
    assert!(!net.raft(1).release_snapshot_data(), "no bytes to let go");
    assert!(
        !net.raft(1).snapshot_wanted(),
        "nobody is known to need them yet"
    );
    net.blocked.clear();
    net.log.clear();
    net.tick_all(4);
    assert!(
        net.raft(1).peers_need_snapshot(),
        "node 3's next entry was compacted away"
    );
    assert!(net.raft(1).snapshot_wanted());
    assert_eq!(net.chunks_delivered_to(3), 0, "nothing to send yet");
    // Meanwhile the log goes on; the bytes come built at the newer applied point.
    net.propose(1, b"y");
    let newer = net.raft(1).applied_index();
    assert!(newer > first);
    let data = Bytes::from(vec![7u8; 2 * 1024 + 3]);
    assert!(net.raft(1).provide_snapshot(newer, data.clone()));
    assert_eq!(net.raft(1).snapshot_index(), newer);
    assert!(!net.raft(1).snapshot_wanted());
    net.tick_all(6);
    assert_eq!(net.installed_snapshots.get(&3), Some(&newer));
    assert_eq!(net.raft(3).last_index(), net.raft(1).last_index());
    assert!(!net.raft(1).peers_need_snapshot());
    assert!(net.raft(1).release_snapshot_data());
}

// A restarted server recovers its snapshot point without bytes (`InitialState::snapshot` with
// empty data): it counts as let go, and the bytes are asked for once a follower needs them.
#[test]
fn a_recovered_snapshot_without_bytes_counts_as_let_go() {
    let meta = SnapshotMeta {
        index: 5,
        term: 2,
        membership: Membership::with_voters([1, 2, 3]),
    };
    let initial = InitialState {
        hard_state: HardState {
            term: 2,
            vote: 0,
            commit: 5,
        },
        snapshot: Some(Snapshot {
            meta: meta.clone(),
            data: Bytes::new(),
        }),
        applied: 5,
        ..Default::default()
    };
    let mut raft = Raft::new(config(1, false), initial).unwrap();
    assert_eq!(raft.snapshot_index(), 5);
    assert!(!raft.release_snapshot_data(), "nothing held to let go");
    let data = Bytes::from_static(b"RLSNAP01-state");
    assert!(
        raft.provide_snapshot(5, data.clone()),
        "the same point gets its bytes"
    );
    assert_eq!(raft.latest_snapshot().map(|s| s.data.clone()), Some(data));
    assert!(raft.release_snapshot_data());
}

// Reference: §5.7 — a snapshot of many chunks sent over a network slower than the heartbeat:
// each chunk goes out once (plus a retry when it is lost), not again with every heartbeat answer.
// Regression: every heartbeat answer used to send the current chunk once more, and each answer to
// such a copy sent the next one, so copies multiplied until the peer's queue was full and a large
// snapshot never arrived.
#[test]
fn snapshot_chunks_are_not_multiplied_by_heartbeats() {
    let mut net = Net::new(3, true);
    let chunks = 60;
    let data = Bytes::from(vec![9u8; chunks * 1024]);
    let applied = net.lagging_follower_and_snapshot(&data);
    net.log.clear();
    // One chunk per round trip (two ticks) and a heartbeat every two ticks.
    net.tick_with_latency(4 * chunks as u32, |_| false);
    assert_eq!(
        net.raft(3).snapshot_index(),
        applied,
        "snapshot not installed"
    );
    assert_eq!(
        net.raft(3).latest_snapshot().map(|s| s.data.clone()),
        Some(data)
    );
    let sent = net.chunks_delivered_to(3);
    assert!(
        sent <= chunks + chunks / 4,
        "{sent} chunk messages for a snapshot of {chunks} chunks"
    );
    assert!(net.raft(1).is_leader());
}

// Reference: §5.7 — a lost chunk, or a lost answer to one, is sent again after a few heartbeat
// rounds, and the snapshot still arrives whole.
#[test]
fn lost_snapshot_chunks_are_sent_again() {
    let mut net = Net::new(3, true);
    let chunks = 40;
    let data = Bytes::from(
        (0..chunks * 1024)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    let applied = net.lagging_follower_and_snapshot(&data);
    // Every fifth chunk and every seventh answer to one is lost.
    let (mut chunk_no, mut answer_no) = (0, 0);
    net.tick_with_latency(12 * chunks as u32, |m| match m.body {
        MessageBody::InstallSnapshot { .. } => {
            chunk_no += 1;
            chunk_no % 5 == 0
        }
        MessageBody::InstallSnapshotResponse { .. } => {
            answer_no += 1;
            answer_no % 7 == 0
        }
        _ => false,
    });
    assert_eq!(
        net.raft(3).snapshot_index(),
        applied,
        "snapshot not installed"
    );
    assert_eq!(
        net.raft(3).latest_snapshot().map(|s| s.data.clone()),
        Some(data)
    );
    assert!(net.raft(1).is_leader());
}

// Reference: dissertation §9.6 — with PreVote a node rejoining after a partition does not make a
// healthy leader step down; without PreVote it does (its term grew while it was cut off).
#[test]
fn prevote_keeps_a_rejoining_node_from_deposing_the_leader() {
    for pre_vote in [true, false] {
        let mut net = Net::new(3, pre_vote);
        net.elect(1);
        net.propose(1, b"a");
        let term = net.raft(1).term();
        net.blocked.insert(3);
        net.tick_all(100); // node 3 times out again and again while isolated
        assert!(net.raft(1).is_leader());
        net.blocked.clear();
        net.tick_all(30);
        let leader_kept = net.raft(1).is_leader() && net.raft(1).term() == term;
        if pre_vote {
            assert!(leader_kept, "with PreVote the leader keeps its term");
            assert_eq!(net.raft(3).term(), term);
        } else {
            assert!(
                !leader_kept,
                "without PreVote the rejoining node disrupts the leader"
            );
        }
    }
}

// Reference: §6.2 — CheckQuorum: a leader that cannot reach a quorum steps down within an
// election timeout.
#[test]
fn check_quorum_steps_down_isolated_leader() {
    let mut net = Net::new(3, true);
    net.elect(1);
    net.blocked.insert(1);
    net.tick_all(2 * 10 + 1);
    assert!(!net.raft(1).is_leader());
}

// Reference: dissertation §4.2.2 — a leader removed from the configuration steps down once the
// removal commits, and the rest elect a new leader.
#[test]
fn removed_leader_steps_down() {
    let mut net = Net::new(3, true);
    net.elect(1);
    net.raft(1)
        .propose_membership(MembershipChange::RemoveServer(1))
        .unwrap();
    net.process(1);
    net.deliver_all();
    assert!(!net.raft(1).is_leader());
    net.blocked.insert(1);
    net.tick_all(40);
    let leaders = net.leaders();
    assert_eq!(leaders.len(), 1);
    assert_ne!(leaders[0], 1);
    assert_eq!(
        net.raft(leaders[0]).membership().voters,
        BTreeSet::from([2, 3])
    );
}

#[test]
fn garbage_from_peers_does_not_panic() {
    let mut net = Net::new(3, true);
    net.elect(1);
    let bodies = vec![
        MessageBody::Append {
            prev_log_index: u64::MAX - 1,
            prev_log_term: 9,
            entries: vec![],
            leader_commit: u64::MAX,
        },
        MessageBody::Append {
            prev_log_index: 0,
            prev_log_term: 0,
            entries: vec![Entry {
                term: 1,
                index: 7,
                payload: EntryPayload::Noop,
            }],
            leader_commit: 5,
        },
        MessageBody::AppendResponse {
            success: true,
            match_index: u64::MAX,
            rejected_index: 0,
            recovery_index: 0,
            recovery_term: 0,
        },
        MessageBody::AppendResponse {
            success: false,
            match_index: 0,
            rejected_index: u64::MAX,
            recovery_index: u64::MAX,
            recovery_term: u64::MAX,
        },
        MessageBody::InstallSnapshotResponse {
            snapshot_index: 99,
            next_offset: u64::MAX,
            done: false,
        },
        MessageBody::Heartbeat {
            commit: u64::MAX,
            read_seq: u64::MAX,
        },
        MessageBody::InstallSnapshot {
            meta: SnapshotMeta {
                index: u64::MAX,
                term: 1,
                membership: Membership::with_voters([1, 2, 3]),
            },
            offset: 0,
            data: Bytes::from_static(b"x"),
            done: false,
            total_len: u64::MAX,
        },
    ];
    for body in bodies {
        for (from, to) in [(2, 1), (1, 2), (9, 1)] {
            let term = net.raft(to).term();
            net.raft(to).step(Message {
                from,
                to,
                term,
                body: body.clone(),
            });
            net.process(to);
        }
    }
    let last = net.raft(2).last_index();
    assert!(net.raft(2).commit_index() <= last);
}

/// Pipelined appends (§10.2.1) are bounded in bytes as well as in number: a follower that comes
/// back far behind is sent at most `max_inflight_bytes` of entries (plus the one append always
/// allowed) before it answers, not `max_inflight_appends` full appends at once.
#[test]
fn appends_in_flight_are_bounded_in_bytes() {
    const BATCH: usize = 1000;
    const BOUND: usize = 4 * BATCH;
    let peak = |max_inflight_bytes: usize| {
        let mut net = Net::with_config(3, |cfg| {
            cfg.max_batch_bytes = BATCH;
            cfg.max_inflight_appends = 64;
            cfg.max_inflight_bytes = max_inflight_bytes;
        });
        net.elect(1);
        net.blocked.insert(3);
        for _ in 0..300 {
            net.propose(1, &[b'x'; 100]);
        }
        net.blocked.clear();
        let last = net.raft(1).last_index();
        let (mut peak_bytes, mut peak_count) = (0, 0);
        for _ in 0..400 {
            net.tick_with_latency(1, |_| false);
            let (count, bytes) = net.raft(1).inflight_to(3);
            peak_bytes = peak_bytes.max(bytes);
            peak_count = peak_count.max(count);
            if net.raft(3).last_index() == last {
                break;
            }
        }
        assert_eq!(net.raft(3).last_index(), last, "node 3 caught up");
        (peak_bytes, peak_count)
    };
    let (bytes, count) = peak(BOUND);
    assert!(
        bytes < BOUND + 2 * BATCH,
        "{bytes} entry bytes in flight with a bound of {BOUND}"
    );
    assert!(
        count > 1,
        "appends are still pipelined ({count} in flight at most)"
    );
    // Without the byte bound the same catch-up puts far more in flight at once: the check above
    // can tell the two apart.
    let (unbounded_bytes, _) = peak(usize::MAX);
    assert!(
        unbounded_bytes >= 2 * (BOUND + 2 * BATCH),
        "{unbounded_bytes} bytes in flight without the bound"
    );
}

/// A follower that was stalled (a long snapshot install, a paused process) answers all the
/// heartbeats queued meanwhile at once. The leader lets such answers unblock flow control once
/// per heartbeat round: one probe goes out, not one full append per answer.
#[test]
fn a_flood_of_heartbeat_answers_sends_one_probe() {
    let mut net = Net::new(3, false);
    net.blocked.insert(3);
    net.elect(1);
    for _ in 0..20 {
        net.propose(1, b"entry");
    }
    // A heartbeat round passes; node 3's probe and heartbeats are lost.
    let heartbeat_ticks = Config::new(1, 0).heartbeat_ticks;
    net.tick_all(heartbeat_ticks);
    let term = net.raft(1).term();
    let appends_to_3 = |ready: &Ready| {
        ready
            .messages_now
            .iter()
            .chain(&ready.messages)
            .filter(|m| m.to == 3 && matches!(m.body, MessageBody::Append { .. }))
            .count()
    };
    let flood = |net: &mut Net| {
        for _ in 0..50 {
            net.raft(1).step(Message {
                from: 3,
                to: 1,
                term,
                body: MessageBody::HeartbeatResponse { read_seq: 0 },
            });
        }
        let ready = net.raft(1).ready();
        let n = appends_to_3(&ready);
        net.raft(1).advance(ready);
        n
    };
    assert_eq!(flood(&mut net), 1, "one probe for 50 answers in one round");
    assert_eq!(flood(&mut net), 0, "nothing more until the next round");
    net.tick_all(heartbeat_ticks);
    assert_eq!(flood(&mut net), 1, "the next round lets one probe go again");
}

/// A new commit index travels with the next append; only when none follows does the leader
/// announce it on its own, on its next tick. One client's lock cycle used to cost an extra
/// append (and its answer) per follower per commit.
#[test]
fn commit_index_rides_on_the_next_append_or_the_next_tick() {
    let mut net = Net::new(3, false);
    net.elect(1);
    net.tick_all(1);
    let appends_since = |net: &Net, from: usize| {
        net.log[from..]
            .iter()
            .filter(|m| matches!(m.body, MessageBody::Append { .. }))
            .count()
    };
    let before = net.log.len();
    let first = net.propose(1, b"a");
    assert_eq!(net.raft(1).commit_index(), first);
    assert_eq!(
        appends_since(&net, before),
        2,
        "one append per follower, no announcement of the commit"
    );
    assert!(net.raft(2).commit_index() < first && net.raft(3).commit_index() < first);

    let before = net.log.len();
    let second = net.propose(1, b"b");
    assert_eq!(appends_since(&net, before), 2);
    for follower in [2, 3] {
        assert_eq!(
            net.raft(follower).commit_index(),
            first,
            "the next append carried the commit index"
        );
    }

    // Nothing follows: the next tick announces the second commit.
    net.tick_all(1);
    for follower in [2, 3] {
        assert_eq!(net.raft(follower).commit_index(), second);
    }
    let before = net.log.len();
    net.tick_all(1);
    assert_eq!(appends_since(&net, before), 0, "announced once");
}
