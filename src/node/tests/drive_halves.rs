//! The two halves of a drive, as the driver runs them: the leader's appends leave between them,
//! before its own flush.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};

use crate::lock::Limits;
use crate::node::api::ClientOp;
use crate::node::*;
use crate::raft::{Config, InitialState, Membership, MessageBody};
use crate::storage::MemStorage;

pub(super) type Core = NodeCore<MemStorage, u64>;

pub(super) struct Cluster {
    pub(super) cores: BTreeMap<NodeId, Core>,
    pub(super) replies: Vec<(u64, ClientReply)>,
    pub(super) now: Micros,
    /// Nodes cut off: messages to or from them are lost.
    pub(super) cut: BTreeSet<NodeId>,
}

impl Cluster {
    pub(super) fn new() -> Cluster {
        Cluster::with_settings(NodeSettings::default())
    }

    pub(super) fn with_settings(settings: NodeSettings) -> Cluster {
        Cluster::with_configs(settings, |_| {})
    }

    /// As [`Cluster::with_settings`], with `raft` changing each node's Raft configuration.
    pub(super) fn with_configs(settings: NodeSettings, raft: impl Fn(&mut Config)) -> Cluster {
        let cores = (1..=3)
            .map(|id| {
                let initial = InitialState {
                    initial_membership: Membership::with_voters(1..=3),
                    ..Default::default()
                };
                let mut cfg = Config::new(id, 7 + id);
                raft(&mut cfg);
                let raft = Raft::new(cfg, initial).unwrap();
                let sm = LockStateMachine::new(Limits::default());
                (
                    id,
                    NodeCore::new(raft, MemStorage::new(), sm, settings.clone(), 0),
                )
            })
            .collect();
        Cluster {
            cores,
            replies: Vec::new(),
            now: 0,
            cut: BTreeSet::new(),
        }
    }

    /// Ticks node 1 (the leader) `times` times, 100 ms apart, delivering what follows
    /// (followers answer its heartbeats: it hears from every node not cut off).
    pub(super) fn tick_leader(&mut self, times: usize) {
        for _ in 0..times {
            self.now += 100_000;
            let now = self.now;
            self.core(1).tick(now).unwrap();
            self.settle([]);
        }
    }

    pub(super) fn core(&mut self, id: NodeId) -> &mut Core {
        self.cores.get_mut(&id).unwrap()
    }

    /// Delivers `msgs` and every message they cause until the cluster is quiet.
    pub(super) fn settle(&mut self, msgs: impl IntoIterator<Item = Message>) {
        self.try_settle(msgs).unwrap();
    }

    /// As [`Cluster::settle`], stopping at the first node whose drive fails.
    pub(super) fn try_settle(
        &mut self,
        msgs: impl IntoIterator<Item = Message>,
    ) -> Result<(), StorageError> {
        self.try_settle_until(msgs, |_| false).map(|_| ())
    }

    /// As [`Cluster::try_settle`], stopping early (with true) once `done` holds; it is
    /// asked after each message. Snapshot jobs run at once.
    pub(super) fn try_settle_until(
        &mut self,
        msgs: impl IntoIterator<Item = Message>,
        done: impl Fn(&Cluster) -> bool,
    ) -> Result<bool, StorageError> {
        let mut queue: VecDeque<Message> = msgs.into_iter().collect();
        for _ in 0..10_000 {
            let now = self.now;
            let mut jobs = Vec::new();
            for (&id, core) in self.cores.iter_mut() {
                for effect in core.take_effects() {
                    match effect {
                        Effect::Send(msg) => queue.push_back(msg),
                        Effect::Reply(to, reply) => self.replies.push((to, reply)),
                        Effect::BuildSnapshot(job) => jobs.push((id, job)),
                        Effect::Observe(_) => {}
                    }
                }
            }
            if done(self) {
                return Ok(true);
            }
            if !jobs.is_empty() {
                for (id, job) in jobs {
                    self.core(id).snapshot_built(now, job())?;
                }
                continue;
            }
            let Some(msg) = queue.pop_front() else {
                return Ok(false);
            };
            if self.cut.contains(&msg.to) || self.cut.contains(&msg.from) {
                continue;
            }
            let core = self.core(msg.to);
            core.step(now, msg);
            core.drive()?;
        }
        panic!("the cluster did not settle");
    }

    /// Ticks `id` once (time moves on by 10 ms) and delivers what follows.
    pub(super) fn tick(&mut self, id: NodeId) {
        self.now += 10_000;
        let now = self.now;
        self.core(id).tick(now).unwrap();
        self.settle([]);
    }

    /// Ticks node 1 until it leads and has committed an entry of its term.
    pub(super) fn elect_node_1(&mut self) {
        for _ in 0..1_000 {
            self.now += 10_000;
            let now = self.now;
            self.core(1).tick(now).unwrap();
            self.settle([]);
            let raft = self.core(1).raft();
            if raft.is_leader() && raft.commit_index() == raft.last_index() {
                return;
            }
        }
        panic!("node 1 never led");
    }
}

pub(super) fn acquire(key: &str) -> ClientOp {
    ClientOp::Acquire {
        key: key.into(),
        client_id: "c1".into(),
        request_id: format!("r-{key}"),
        ttl_ms: 10_000,
        wait_timeout_ms: Some(0),
    }
}

/// Node 1 elected, the appends it sends early captured, and an acquire of `key` (answered to
/// `reply`) handed to it, not yet driven; with node 1's last index before that acquire.
fn leader_with_acquire(key: &str, reply: u64) -> (Cluster, Arc<Mutex<Vec<Message>>>, Index) {
    let mut c = Cluster::new();
    c.elect_node_1();
    let early: Arc<Mutex<Vec<Message>>> = Arc::default();
    let seen = early.clone();
    c.core(1)
        .send_early_with(Box::new(move |msg: &Message, _: &Raft| {
            seen.lock().unwrap().push(msg.clone());
            true
        }));
    let before = c.core(1).raft().last_index();
    let now = c.now;
    c.core(1).client_request(now, acquire(key), 1, reply);
    (c, early, before)
}

/// The log index up to which `core`'s storage would survive a power cut now.
fn durable_last_index(core: &Core) -> Index {
    let mut disk = core.storage().clone();
    disk.crash();
    disk.last_index()
}

#[test]
fn the_leaders_appends_leave_before_its_flush_and_the_second_half_makes_them_durable() {
    let (mut c, early, before) = leader_with_acquire("a", 41);

    assert!(
        c.core(1).drive_until_flush().unwrap(),
        "a Ready waits for its flush"
    );
    let entry = c.core(1).raft().last_index();
    assert_eq!(entry, before + 1);
    let sent: Vec<Message> = std::mem::take(&mut *early.lock().unwrap());
    let mut to: Vec<NodeId> = sent.iter().map(|m| m.to).collect();
    to.sort_unstable();
    assert_eq!(
        to,
        [2, 3],
        "an append for each follower left early: {sent:?}"
    );
    for msg in &sent {
        assert!(
            matches!(&msg.body, MessageBody::Append { entries, .. }
                if entries.last().map(|e| e.index) == Some(entry)),
            "{msg:?}"
        );
    }
    // Between the halves nothing is durable yet, and nothing else has left.
    assert_eq!(durable_last_index(c.core(1)), before);
    assert!(c
        .core(1)
        .take_effects()
        .iter()
        .all(|e| !matches!(e, Effect::Send(_))));

    c.core(1).finish_drive().unwrap();
    assert_eq!(durable_last_index(c.core(1)), entry);
    assert!(
        c.core(1).finish_drive().is_ok(),
        "a second finish does nothing"
    );

    c.settle(sent);
    assert!(
        c.replies
            .iter()
            .any(|(to, r)| *to == 41 && matches!(r, ClientReply::Granted { .. })),
        "{:?}",
        c.replies
    );
}

#[test]
fn a_power_cut_in_the_flush_after_the_early_appends_stops_the_node_and_loses_the_entry() {
    let (mut c, early, before) = leader_with_acquire("b", 42);
    c.core(1).storage_mut().arm_power_cut(false);

    assert!(c.core(1).drive_until_flush().unwrap());
    assert_eq!(
        early.lock().unwrap().len(),
        2,
        "the appends left before the flush"
    );
    assert!(matches!(
        c.core(1).finish_drive(),
        Err(StorageError::SimulatedCrash)
    ));
    assert!(matches!(c.core(1).drive(), Err(StorageError::Stopped)));
    assert!(matches!(
        c.core(1).drive_until_flush(),
        Err(StorageError::Stopped)
    ));
    assert_eq!(durable_last_index(c.core(1)), before);
    // No answer: the client learns nothing of an entry the leader never made durable.
    assert!(
        !c.replies.iter().any(|(to, _)| *to == 42),
        "{:?}",
        c.replies
    );
    assert!(c
        .core(1)
        .take_effects()
        .iter()
        .all(|e| !matches!(e, Effect::Reply(..))));
}

/// A request a node answers with an error without proposing it is observed with its
/// operation and code (the server counts it in `raftlock_requests_total`).
#[test]
fn a_request_refused_before_it_is_proposed_is_observed() {
    let mut c = Cluster::new();
    c.elect_node_1();
    let now = c.now;
    c.core(2).take_effects();
    c.core(2).client_request(now, acquire("d"), 1, 44);
    let effects = c.core(2).take_effects();
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Observe(Observation::Refused {
                op: "acquire",
                result: "NOT_LEADER"
            })
        )),
        "{effects:?}"
    );
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Reply(44, ClientReply::Error(err)) if err.code == ErrorCode::NotLeader
        )),
        "{effects:?}"
    );
}

#[test]
fn drive_is_the_two_halves_and_finishes_a_waiting_ready_first() {
    let mut c = Cluster::new();
    c.elect_node_1();
    let now = c.now;
    c.core(1).client_request(now, acquire("c"), 1, 43);
    assert!(c.core(1).drive_until_flush().unwrap());
    let entry = c.core(1).raft().last_index();
    // A shell that calls `drive` instead of `finish_drive` still flushes the waiting Ready
    // before it takes another.
    c.core(1).drive().unwrap();
    assert_eq!(durable_last_index(c.core(1)), entry);
    assert!(
        !c.core(1).drive_until_flush().unwrap(),
        "nothing left to do"
    );
    c.settle([]);
    assert!(c
        .replies
        .iter()
        .any(|(to, r)| *to == 43 && matches!(r, ClientReply::Granted { .. })));
}
