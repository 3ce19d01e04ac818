//! The targeted Figure 8 schedule of the Raft paper (§5.4.2): its phases and the steps that
//! move them ([`SimConfig::figure8`]).

use rand::seq::IndexedRandom;

#[cfg(doc)]
use super::SimConfig;
use super::{Cluster, SCHEDULE_CLIENT};
use crate::node::api::ClientOp;
use crate::raft::{Index, NodeId, Term};
use crate::sim::clients::ReplyTo;

/// Simulated time a phase of the Figure 8 schedule may take before the round is given up.
const FIGURE8_PHASE_US: u64 = 1_500_000;

/// Where the Figure 8 schedule ([`SimConfig::figure8`]) stands. Node names follow the round:
/// the `leader` and its `peer` are stranded, the `rival` wins among the rest, the `third` joins
/// the stranded pair to elect the recounting leader, and the `lone` node waits apart.
#[derive(Clone, Debug)]
pub(super) enum Figure8 {
    /// Everything healed and restarted: waiting for a leader whose whole log every node holds.
    Settle { since: u64 },
    /// The leader and its peer are cut off from the rest; a proposal made to the leader must
    /// reach the peer.
    Stranded {
        leader: NodeId,
        peer: NodeId,
        term: Term,
        base: Index,
        since: u64,
    },
    /// The rest elect a leader, cut off the moment it wins.
    Rival {
        pair: [NodeId; 2],
        rest: Vec<NodeId>,
        term: Term,
        since: u64,
    },
    /// The rival is cut off with its no-op; the pair and the third node elect a leader, which
    /// crashes the moment it advances its commit index.
    Recount {
        pair: [NodeId; 2],
        third: NodeId,
        rival: NodeId,
        lone: NodeId,
        rival_term: Term,
        since: u64,
    },
    /// The recounting leader is down; the rival, the third and the lone node may elect a leader
    /// while the pair's other node is cut off.
    Return {
        group: [NodeId; 3],
        term: Term,
        since: u64,
    },
}

impl Cluster {
    // ----- the Figure 8 schedule ------------------------------------------------------------

    /// One step of the Figure 8 schedule: starts a round once the cluster has settled, moves on
    /// once the stranded leader's entry reached its peer, and gives a phase up after
    /// [`FIGURE8_PHASE_US`]. Elections and commits move the other phases
    /// ([`Self::figure8_on_leader`], [`Self::figure8_on_commit`]).
    pub(super) fn figure8_step(&mut self) {
        let now = self.now_us;
        match self.figure8.clone() {
            Figure8::Settle { since } => self.figure8_start_round(since),
            Figure8::Stranded {
                leader,
                peer,
                term,
                base,
                since,
            } => {
                let reached = self
                    .nodes
                    .get(&peer)
                    .and_then(|n| n.core.as_ref())
                    .is_some_and(|c| c.raft().term_at(base + 1) == Some(term));
                if reached {
                    let rest: Vec<NodeId> = self
                        .all_ids()
                        .into_iter()
                        .filter(|&n| n != leader && n != peer)
                        .collect();
                    self.trace_figure8(format!(
                        "entry {} of term {term} reached peer {peer}; {rest:?} elect a rival",
                        base + 1
                    ));
                    self.figure8 = Figure8::Rival {
                        pair: [leader, peer],
                        rest,
                        term,
                        since: now,
                    };
                } else if now > since + FIGURE8_PHASE_US {
                    self.figure8_settle();
                }
            }
            Figure8::Rival { since, .. }
            | Figure8::Recount { since, .. }
            | Figure8::Return { since, .. } => {
                if now > since + FIGURE8_PHASE_US {
                    self.figure8_settle();
                }
            }
        }
    }

    /// Heals the network, restarts every node that is down and waits for the cluster to settle.
    fn figure8_settle(&mut self) {
        self.trace_figure8("settle".into());
        self.network.heal();
        self.restart_down_nodes();
        self.figure8 = Figure8::Settle { since: self.now_us };
    }

    /// Once a leader has led for a while and every node holds its whole, committed log (or after
    /// a second of waiting for that), cuts the leader and one random follower off from the
    /// rest and proposes an entry to the leader.
    fn figure8_start_round(&mut self, settling_since: u64) {
        let now = self.now_us;
        if now < settling_since + 200_000 {
            return;
        }
        let ids = self.all_ids();
        if ids.len() != 5 || self.alive_ids().len() != ids.len() {
            return;
        }
        let Some(leader) = self.leader() else { return };
        let raft = self.nodes[&leader].core.as_ref().expect("leader").raft();
        let (term, base) = (raft.term(), raft.last_index());
        let settled = raft.commit_index() == base
            && ids.iter().all(|id| {
                let r = self.nodes[id].core.as_ref().expect("alive").raft();
                r.last_index() == base && r.term_at(base) == raft.term_at(base)
            });
        if !settled && now < settling_since + 1_000_000 {
            return;
        }
        let followers: Vec<NodeId> = ids.iter().copied().filter(|&n| n != leader).collect();
        let peer = *followers.choose(&mut self.rng).expect("four followers");
        let rest: Vec<NodeId> = followers.into_iter().filter(|&n| n != peer).collect();
        self.network.partition(&[leader, peer], &rest);
        self.stats.partitions += 1;
        self.figure8_rounds += 1;
        let round = self.figure8_rounds;
        self.trace_figure8(format!(
            "round {round}: leader {leader} (term {term}, last index {base}, settled {settled}) stranded with {peer}"
        ));
        let op = ClientOp::Put {
            key: "figure8".into(),
            value: format!("round {round}").into_bytes(),
            guard: None,
            client_id: "simulator-figure8".into(),
            request_id: format!("round-{round}"),
        };
        let to = ReplyTo {
            client: SCHEDULE_CLIENT,
            attempt: 0,
        };
        self.client_send((leader, op, to));
        self.figure8 = Figure8::Stranded {
            leader,
            peer,
            term,
            base,
            since: now,
        };
    }

    /// A node became leader: the rival is cut off the moment it wins (its no-op reaches no one),
    /// and the pair and a random third node may elect the next leader; a leader elected in the
    /// last phase ends the round.
    pub(super) fn figure8_on_leader(&mut self, id: NodeId, term: Term) {
        let now = self.now_us;
        match self.figure8.clone() {
            Figure8::Rival {
                pair,
                rest,
                term: stranded_term,
                ..
            } if rest.contains(&id) && term > stranded_term => {
                let others: Vec<NodeId> = rest.iter().copied().filter(|&n| n != id).collect();
                let Some(&third) = others.choose(&mut self.rng) else {
                    self.figure8_settle();
                    return;
                };
                let lone: Vec<NodeId> = others.into_iter().filter(|&n| n != third).collect();
                let all = self.all_ids();
                let not_rival: Vec<NodeId> = all.iter().copied().filter(|&n| n != id).collect();
                self.network.heal();
                self.network.partition(&[id], &not_rival);
                self.network.partition(&[pair[0], pair[1], third], &lone);
                self.stats.partitions += 1;
                self.trace_figure8(format!(
                    "rival {id} won term {term} and is cut off; {pair:?} and {third} elect, {lone:?} apart"
                ));
                self.figure8 = Figure8::Recount {
                    pair,
                    third,
                    rival: id,
                    lone: lone.first().copied().unwrap_or(id),
                    rival_term: term,
                    since: now,
                };
            }
            Figure8::Return {
                group,
                term: recount_term,
                ..
            } if group.contains(&id) && term > recount_term => {
                self.trace_figure8(format!("node {id} won term {term} after the recount"));
                self.figure8_settle();
            }
            _ => {}
        }
    }

    /// A leader advanced its commit index: in the recount phase it crashes at once, and the
    /// messages it has in flight are lost with it; the rival, the third and the lone node are
    /// joined, the pair's other node is kept apart.
    pub(super) fn figure8_on_commit(&mut self, id: NodeId, term: Term) {
        let Figure8::Recount {
            pair,
            third,
            rival,
            lone,
            rival_term,
            ..
        } = self.figure8.clone()
        else {
            return;
        };
        if term <= rival_term || !pair.contains(&id) {
            return;
        }
        let commit = self
            .nodes
            .get(&id)
            .and_then(|n| n.core.as_ref())
            .map_or(0, |c| c.raft().commit_index());
        self.crash_node(id);
        let other = if pair[0] == id { pair[1] } else { pair[0] };
        let all = self.all_ids();
        self.network.heal();
        for cut in [id, other] {
            let rest: Vec<NodeId> = all.iter().copied().filter(|&n| n != cut).collect();
            self.network.partition(&[cut], &rest);
        }
        self.stats.partitions += 1;
        self.trace_figure8(format!(
            "leader {id} of term {term} committed up to {commit} and crashed; {rival}, {third}, {lone} may elect, {other} apart"
        ));
        self.figure8 = Figure8::Return {
            group: [rival, third, lone],
            term,
            since: self.now_us,
        };
    }

    fn trace_figure8(&self, what: String) {
        if self.cfg.trace {
            eprintln!("t={} figure8: {what}", self.now_us);
        }
    }
}
