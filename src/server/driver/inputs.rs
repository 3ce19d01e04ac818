//! The driver's inputs: client requests, peer messages, joins, removals and the rest of
//! [`Input`](super::Input), handed to the core as they come off the queue.

use tracing::{info, warn};

use super::{Driver, Input, JoinReply};
use crate::node::api::ApiError;
use crate::node::Micros;
use crate::raft::{Message, MessageBody};

impl Driver {
    pub(super) fn handle_inputs(&mut self, batch: Vec<Input>) {
        let now = self.now();
        for input in batch {
            match input {
                Input::Peer(msg) => self.step_peer(now, msg),
                Input::Client {
                    op,
                    conn,
                    reply,
                    span,
                } => {
                    crate::server::probe::event("picked");
                    if !span.is_disabled() {
                        // A link from the request to the batch (and so to the fsync and the
                        // replication) that carried it; the batch, which may carry a thousand
                        // requests, links to none.
                        use opentelemetry::trace::TraceContextExt;
                        use tracing_opentelemetry::OpenTelemetrySpanExt;
                        let batch = tracing::Span::current().context();
                        span.add_link(batch.span().span_context().clone());
                    }
                    self.metrics
                        .requests_received_total
                        .with_label_values(&[op.name()])
                        .inc();
                    self.core.client_request(now, op, conn, reply);
                }
                Input::Disconnected { conn } => self.core.disconnected(now, conn),
                Input::Join {
                    id,
                    peer_addr,
                    client_addr,
                    incarnation,
                    reply,
                } => {
                    let raft = self.core.raft();
                    let leader_id = raft.leader_id();
                    let mut answer = JoinReply {
                        success: false,
                        leader_id,
                        leader_peer_addr: self
                            .addresses
                            .get(leader_id)
                            .map(|a| a.peer)
                            .unwrap_or_default(),
                        term: raft.term(),
                        error: String::new(),
                    };
                    let leading = raft.is_leader();
                    let info = crate::lock::MemberInfo {
                        peer_addr: peer_addr.clone(),
                        client_addr: client_addr.clone(),
                        incarnation,
                    };
                    match self.core.join(id, info) {
                        Ok(crate::node::lifecycle::JoinOutcome::Accepted) => {
                            // Only an accepted join changes where the node is reached: a
                            // refused one leaves the address book as it was.
                            if leading {
                                self.addresses.learn(id, &peer_addr, &client_addr);
                            }
                            info!(node = id, addr = %peer_addr, "adding learner");
                            answer.success = true;
                        }
                        Ok(crate::node::lifecycle::JoinOutcome::Replacing) => {
                            self.addresses.set_incarnation(id, incarnation);
                            warn!(
                                node = id,
                                incarnation,
                                "node {id} joins with a new incarnation (its data is gone): \
                                 removing its old incarnation; it is added as a learner when it \
                                 asks again"
                            );
                            answer.error = format!(
                                "replacing node {id}'s old incarnation; ask again to be added"
                            );
                        }
                        Err(err) => answer.error = err,
                    }
                    let _ = reply.send(answer);
                }
                Input::Remove { id, reply } => {
                    let result = self.core.remove(id).map_err(|e| self.with_leader_addr(e));
                    let _ = reply.send(result);
                }
                Input::Locks { prefix, reply } => {
                    let _ = reply.send(self.core.list_locks(&prefix, 10_000));
                }
                Input::TransferLeadership { reply } => {
                    let _ = reply.send(self.core.transfer_leadership().is_some());
                }
                Input::PeerVersion { id, version } => {
                    self.core.peer_version(id, version);
                    if self.core.runs_older_version(id) {
                        warn!(
                            node = id,
                            version,
                            cluster_version = self.core.state_machine().cluster_version(),
                            "member runs an older RaftLock than the cluster's version: it cannot \
                             apply this log, so its messages are ignored until it runs a current one"
                        );
                    }
                }
                Input::PeerInfo { id, info } => self.core.peer_info(id, info),
                Input::Admitted => {
                    if self.core.is_joining() {
                        self.core.set_joining(false);
                    }
                }
            }
        }
    }

    fn step_peer(&mut self, now: Micros, msg: Message) {
        self.last_heard.insert(msg.from, std::time::Instant::now());
        crate::server::probe::peer_message_stepped(&msg);
        if matches!(msg.body, MessageBody::HeartbeatResponse { .. }) {
            if let Some(sent) = self.heartbeat_sent.remove(&msg.from) {
                self.metrics
                    .peer_rtt_seconds
                    .with_label_values(&[&msg.from.to_string()])
                    .observe(sent.elapsed().as_secs_f64());
            }
        }
        self.core.step(now, msg);
    }

    pub(super) fn with_leader_addr(&self, mut err: ApiError) -> ApiError {
        if err.leader_id != 0 && err.leader_addr.is_empty() {
            err.leader_addr = self
                .addresses
                .get(err.leader_id)
                .map(|a| a.client)
                .unwrap_or_default();
        }
        err
    }
}
