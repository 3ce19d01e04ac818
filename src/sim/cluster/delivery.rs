//! Delivering messages: peer messages off the simulated network, and requests and answers
//! between the clients and the nodes.

use rand::Rng;

use super::{sim_identity, ClientMsg, Cluster, MARKER_CLIENT, SCHEDULE_CLIENT};
use crate::lock::CLUSTER_VERSION;
use crate::node::api::{ClientOp, ClientReply};
use crate::raft::NodeId;
use crate::sim::clients::ReplyTo;

impl Cluster {
    pub(super) fn deliver(&mut self) {
        let Some(Some(msg)) = self.network.pop() else {
            return;
        };
        let now = self.now_us;
        let to = msg.to;
        let Some(node) = self.nodes.get_mut(&to) else {
            return;
        };
        if node.core.is_none() {
            return;
        }
        if node.paused(now) {
            node.inbox.push(msg);
            return;
        }
        if matches!(
            msg.body,
            crate::raft::MessageBody::InstallSnapshot { offset: 0, .. }
        ) {
            self.stats.snapshots_sent += 1;
        }
        let local = node.local(now);
        // What its stream's hello would say of the sender: its addresses and incarnation.
        let said = self
            .nodes
            .get(&msg.from)
            .map(|n| sim_identity(msg.from, n.incarnation));
        let node = self.nodes.get_mut(&to).expect("exists");
        let core = node.core.as_mut().expect("alive");
        if let Some(info) = said {
            core.peer_info(msg.from, info);
        }
        // Every simulated member runs this RaftLock: its stream would say so (the shell's
        // `x-raftlock-version` header), so the leader raises the cluster version early in a run.
        core.peer_version(msg.from, CLUSTER_VERSION);
        core.step(local, msg);
        let result = core.drive();
        self.after_core(to, result);
    }

    pub(super) fn client_send(&mut self, (node, op, to): (NodeId, ClientOp, ReplyTo)) {
        self.push_client_msg(ClientMsg::Request(node, op, to));
    }

    pub(super) fn push_client_msg(&mut self, msg: ClientMsg) {
        if self.healed_at.is_none() && self.rng.random_range(0..1_000_000u32) < self.client_drop_ppm
        {
            return;
        }
        let delay = self.rng.random_range(100..3_000);
        self.client_seq += 1;
        self.client_net
            .insert((self.now_us + delay, self.client_seq), msg);
    }

    pub(super) fn deliver_client_msg(&mut self) {
        let Some((_, msg)) = self.client_net.pop_first() else {
            return;
        };
        let now = self.now_us;
        match msg {
            ClientMsg::Request(id, op, to) => {
                let Some(node) = self.nodes.get_mut(&id) else {
                    return;
                };
                if node.core.is_none() {
                    return; // connection refused: the client times out
                }
                if node.paused(now) {
                    node.client_inbox.push((op, to));
                    return;
                }
                let local = node.local(now);
                let core = node.core.as_mut().expect("alive");
                core.client_request(local, op, to.client as u64, to);
                let result = core.drive();
                self.after_core(id, result);
            }
            ClientMsg::Answer(to, reply) => {
                if to.client == SCHEDULE_CLIENT {
                    return;
                }
                if to.client == MARKER_CLIENT {
                    if matches!(reply, ClientReply::Stored) {
                        self.marker_done = true;
                    }
                    return;
                }
                let nodes = self.all_ids();
                if let Some(send) = self.clients.on_reply(now, to, reply, &nodes, &mut self.rng) {
                    self.client_send(send);
                }
            }
        }
    }
}
