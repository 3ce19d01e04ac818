//! Invariant checking: the checks after every drive (commit monotonicity, replica state)
//! and at the end of a run (logs agree, the healed cluster commits again).

use rand::Rng;

use super::{Cluster, MARKER_CLIENT};
use crate::node::api::ClientOp;
use crate::raft::{NodeId, Raft};
use crate::sim::checker::{fnv, Violation};
use crate::sim::clients::ReplyTo;
use crate::sim::network::NetworkFaults;

impl Cluster {
    /// Commit monotonicity, commit bookkeeping, replica state, and the adversarial crash of a
    /// leader right after it advanced its commit index.
    pub(super) fn after_drive_checks(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let Some(core) = node.core.as_ref() else {
            return;
        };
        let raft = core.raft();
        let commit = raft.commit_index();
        if commit < node.last_commit {
            let detail = format!(
                "node {id} commit went from {} to {commit}",
                node.last_commit
            );
            self.checker.violations.push(Violation {
                invariant: "commit monotonicity",
                detail,
            });
            return;
        }
        let sm = core.state_machine();
        let applied = sm.applied_index();
        // Compared once per newly reached applied index, not after every Ready.
        if applied > 0 && applied != node.state_checked_at {
            node.state_checked_at = applied;
            let digest = fnv(&sm.snapshot());
            match self.lock_state_at.get(&applied) {
                Some(&seen) if seen != digest => {
                    self.checker.violations.push(Violation {
                        invariant: "replica lock state",
                        detail: format!("node {id} lock state differs at applied index {applied}"),
                    });
                    return;
                }
                Some(_) => {}
                None => {
                    self.lock_state_at.insert(applied, digest);
                }
            }
            if let Some(detail) = sm.accounting_mismatch() {
                self.checker.violations.push(Violation {
                    invariant: "quota accounting",
                    detail: format!("node {id} at applied index {applied}: {detail}"),
                });
                return;
            }
            if let Some(detail) = sm.session_mismatch() {
                self.checker.violations.push(Violation {
                    invariant: "attached locks end with their session",
                    detail: format!("node {id} at applied index {applied}: {detail}"),
                });
                return;
            }
            if let Some(detail) = sm.shared_mismatch() {
                self.checker.violations.push(Violation {
                    invariant: "shared locks keep their modes and queue",
                    detail: format!("node {id} at applied index {applied}: {detail}"),
                });
                return;
            }
        }
        if commit > node.last_commit {
            let from = node.last_commit + 1;
            node.last_commit = commit;
            self.checker.on_commit(id, raft, from, commit);
            // Adversarial crash point: a leader dies right after advancing its commit index,
            // before followers learn of it — where commit-rule bugs (Figure 8) do their damage.
            let is_leader = raft.is_leader();
            let term = raft.term();
            if self.cfg.figure8 && self.healed_at.is_none() && is_leader {
                self.figure8_on_commit(id, term);
            } else if self.cfg.faults
                && self.healed_at.is_none()
                && is_leader
                && self.rng.random_range(0..1_000_000u32) < 20_000 * self.cfg.crash_intensity
            {
                self.crash_node(id);
            }
        }
    }

    // ----- end-of-run checks -----------------------------------------------------------------

    pub(super) fn check_all_logs(&mut self) {
        let alive: Vec<NodeId> = self.alive_ids();
        for (i, &a) in alive.iter().enumerate() {
            for &b in &alive[i + 1..] {
                let (ra, rb) = (
                    self.nodes[&a].core.as_ref().expect("alive").raft(),
                    self.nodes[&b].core.as_ref().expect("alive").raft(),
                );
                self.checker.check_logs_match(ra, rb);
            }
        }
        // One cluster per run: a node that started a second one (on an empty disk, while its
        // peers did not answer) names it differently.
        for &id in &alive {
            if let Some(cid) = self.nodes[&id]
                .core
                .as_ref()
                .and_then(|c| c.state_machine().cluster_id())
            {
                if self.cluster_ids.insert(cid) && self.cluster_ids.len() > 1 {
                    self.checker.violations.push(Violation {
                        invariant: "one cluster",
                        detail: format!(
                            "node {id} belongs to cluster {cid:032x}; cluster ids seen: {:032x?}",
                            self.cluster_ids
                        ),
                    });
                }
            }
        }
    }

    /// After every fault heals: a leader commits a new entry within the budget; then, with the
    /// clients quiet, every lock whose holder stopped renewing is expired and every waiter past
    /// its timeout is answered within a stated bound.
    pub(super) fn check_liveness(&mut self) {
        self.healed_at = Some(self.now_us);
        self.network.heal();
        self.network.faults = NetworkFaults::calm();
        self.restart_down_nodes();
        for node in self.nodes.values_mut() {
            node.paused_until = node.paused_until.min(self.now_us);
            if let Some(core) = node.core.as_mut() {
                core.storage_mut().disarm_power_cut();
            }
        }
        // 1. A leader commits a new entry.
        let deadline = self.now_us + self.cfg.liveness_budget_us;
        let mut marker_sent_to: Option<(NodeId, u64)> = None;
        let mut events = 0u64;
        while !self.marker_done && self.now_us < deadline && events < 400_000 {
            events += 1;
            if !self.process_next_event() {
                break;
            }
            self.collect_violations();
            if !self.checker.ok() {
                return;
            }
            let resend = match marker_sent_to {
                None => true,
                Some((_, at)) => self.now_us > at + 200_000,
            };
            if resend {
                if let Some(leader) = self.leader() {
                    let op = ClientOp::Put {
                        key: "liveness".into(),
                        value: b"ok".to_vec(),
                        guard: None,
                        client_id: "simulator".into(),
                        request_id: "liveness".into(),
                    };
                    let to = ReplyTo {
                        client: MARKER_CLIENT,
                        attempt: 0,
                    };
                    self.client_send((leader, op, to));
                    marker_sent_to = Some((leader, self.now_us));
                }
            }
        }
        if !self.marker_done {
            let nodes: Vec<String> = self
                .nodes
                .values()
                .filter_map(|n| n.core.as_ref().map(|c| format!("{:?}", c.raft())))
                .collect();
            self.checker.violations.push(Violation {
                invariant: "liveness",
                detail: format!(
                    "no new entry committed within {} ms after healing; nodes: {}",
                    self.cfg.liveness_budget_us / 1000,
                    nodes.join(", ")
                ),
            });
            return;
        }
        // 2. Every member whose disk was lost is a voter again, as its newest incarnation.
        let deadline = self.now_us + self.cfg.liveness_budget_us;
        let mut events = 0u64;
        while !self.members_not_back().is_empty() && self.now_us < deadline && events < 400_000 {
            events += 1;
            if !self.process_next_event() {
                break;
            }
            self.collect_violations();
            if !self.checker.ok() {
                return;
            }
        }
        let not_back = self.members_not_back();
        if !not_back.is_empty() {
            self.checker.violations.push(Violation {
                invariant: "liveness",
                detail: format!(
                    "wiped members not voters again within {} ms after healing: {}",
                    self.cfg.liveness_budget_us / 1000,
                    not_back.join("; ")
                ),
            });
            return;
        }
        // 3. Clients stop; what they still run completes; leases and waits run out.
        self.clients.quiet = true;
        let drain_deadline = self.now_us + 10_000_000;
        while self.clients.in_flight() > 0 && self.now_us < drain_deadline {
            if !self.process_next_event() {
                break;
            }
            self.collect_violations();
            if !self.checker.ok() {
                return;
            }
        }
        // Longest lease (400 ms) and wait (600 ms) in the simulation, plus a retried expiry
        // (200 ms), plus ticks and a commit round: everything must be free after 1.5 s.
        const FREE_WITHIN_US: u64 = 1_500_000;
        let quiet_from = self.now_us;
        while self.now_us < quiet_from + FREE_WITHIN_US {
            if !self.process_next_event() {
                break;
            }
            self.collect_violations();
            if !self.checker.ok() {
                return;
            }
        }
        let Some(leader) = self.leader() else {
            self.checker.violations.push(Violation {
                invariant: "liveness",
                detail: "no leader after the quiet period".into(),
            });
            return;
        };
        let core = self.nodes[&leader].core.as_ref().expect("leader");
        let sm = core.state_machine();
        if let Some(held) = sm.held_locks().first() {
            let detail = format!(
                "{} ms after the clients stopped, {} still holds {} (token {}, ttl {} ms) on leader {leader}; its leases: {:?}",
                FREE_WITHIN_US / 1000,
                held.client_id,
                held.key,
                held.token,
                held.ttl_ms,
                core.leases()
            );
            self.checker.violations.push(Violation {
                invariant: "leases expire",
                detail,
            });
            return;
        }
        let voters: Vec<&Raft> = core
            .raft()
            .membership()
            .voters
            .iter()
            .filter_map(|v| {
                self.nodes
                    .get(v)
                    .and_then(|n| n.core.as_ref())
                    .map(|c| c.raft())
            })
            .collect();
        if voters.len() == core.raft().membership().voters.len() {
            let mut checker = std::mem::take(&mut self.checker);
            checker.check_durability(&voters);
            self.checker = checker;
        }
        let core = self.nodes[&leader].core.as_ref().expect("leader");
        let sm = core.state_machine();
        if let Some(w) = sm.waiters().first() {
            let detail = format!(
                "{} ms after the clients stopped, {} still waits for {} (timeout {:?})",
                FREE_WITHIN_US / 1000,
                w.client_id,
                w.key,
                w.wait_timeout_ms
            );
            self.checker.violations.push(Violation {
                invariant: "waits end",
                detail,
            });
        }
        self.check_all_logs();
    }
}
