//! Joining and bootstrap: whether to start a new cluster or join the one that exists, asking to
//! join (hopping to the leader), rejoining after a removal, refusing to start a static member
//! whose data was lost, and keeping the address book filled from the leader's peer list.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::listeners::serve_while_starting;
use super::NodeError;
use crate::node::lifecycle::{
    decide_start, rejoin_verdict, PeerAnswer, RejoinVerdict, StartDecision,
};
use crate::raft::NodeId;
use crate::server::config::NodeConfig;
use crate::server::driver::NodeStatus;
use crate::server::proto::peer::peer_client::PeerClient;
use crate::server::proto::peer::{FetchPeerListReply, FetchPeerListRequest, JoinClusterRequest};
use crate::server::tls::ClientTls;
use crate::server::transport::{AddressBook, PeerDialer};
use crate::telemetry::NodeMetrics;

/// How often a node that was accepted asks again while its log does not hold its admission
/// (the leader that accepted it may have lost office before anything it proposed committed).
const ADMISSION_REASK_INTERVAL: Duration = Duration::from_secs(5);

/// Asks the listed peers to add this node, hopping to the leader they name (at most five hops per
/// round), and retries rounds with backoff until it is accepted (then `admitted` turns true) or
/// the node shuts down. A pod that cannot join yet keeps trying (its peers may still be
/// starting, or an operator must first remove the member it replaces); it stays unready meanwhile.
/// Once accepted it asks again every few seconds for as long as the admission mark (`mark`)
/// exists, that is until its log holds the entry that admitted it: a leader deposed before its
/// proposal committed left it accepted by no one (the simulator's node asks again the same way).
#[allow(clippy::too_many_arguments)]
pub(super) async fn join_cluster(
    cfg: NodeConfig,
    incarnation: u64,
    dialer: PeerDialer,
    addresses: AddressBook,
    admitted: Arc<AtomicBool>,
    mark: Option<std::path::PathBuf>,
    driver: mpsc::Sender<crate::server::driver::Input>,
    shutdown: watch::Receiver<bool>,
) {
    let peers = other_join_peers(&cfg);
    let mut backoff = Duration::from_millis(100);
    let mut accepted = false;
    for round in 0u64.. {
        if *shutdown.borrow() {
            return;
        }
        let awaiting = mark.as_ref().is_some_and(|m| m.exists());
        if accepted && !awaiting {
            return;
        }
        'peers: for start in &peers {
            let mut target = start.clone();
            for hop in 0..5 {
                match ask_to_join(&cfg, incarnation, "", &dialer, &target).await {
                    Ok(reply) if reply.success => {
                        if !accepted {
                            admitted.store(true, Ordering::Release);
                            let _ = driver.send(crate::server::driver::Input::Admitted).await;
                            info!(via = %target, hop, "joined the cluster as a learner");
                            // Learn every member's addresses now: if the leader fails before
                            // this node hears from the others, it must still reach them to
                            // elect a new one.
                            match fetch_peer_list(&dialer, &target).await {
                                Ok(reply) => learn_peer_list(&addresses, reply),
                                Err(err) => {
                                    debug!(via = %target, cause = %err, "no peer list yet")
                                }
                            }
                            accepted = true;
                        } else {
                            debug!(via = %target, "asked again while awaiting admission");
                        }
                        break 'peers;
                    }
                    Ok(reply) if !reply.leader_addr.is_empty() && reply.leader_addr != target => {
                        info!(from = %target, to = %reply.leader_addr, "join redirected to the leader");
                        target = reply.leader_addr;
                    }
                    Ok(reply) => {
                        warn!(via = %target, error = %reply.error, "join refused");
                        break;
                    }
                    Err(err) => {
                        debug!(via = %target, cause = %err, "join attempt failed");
                        break;
                    }
                }
            }
        }
        if accepted {
            // Admitted once the log holds this incarnation's record (the driver then removes
            // the mark); until then, ask again now and then.
            let until = tokio::time::Instant::now() + ADMISSION_REASK_INTERVAL;
            while tokio::time::Instant::now() < until {
                if *shutdown.borrow() || !mark.as_ref().is_some_and(|m| m.exists()) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            continue;
        }
        if round % 10 == 0 {
            warn!(round, peers = ?peers, "could not join yet; retrying");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// The `join` peers other than this node (a StatefulSet lists every pod, itself included).
fn other_join_peers(cfg: &NodeConfig) -> Vec<String> {
    cfg.join_peers()
        .into_iter()
        .filter(|p| *p != cfg.advertise_peer)
        .collect()
}

/// Asks every other `join` peer about itself until [`decide_start`] decides: true to start a
/// new cluster, false to join the one that exists. While it waits it says why in its log and on
/// `/readyz` (a small server on the client port until the node starts), and retries every two
/// seconds until the node shuts down.
pub(super) async fn decide_bootstrap(
    cfg: &NodeConfig,
    dialer: &PeerDialer,
    client_listener: &TcpListener,
    client_tls: Option<Arc<ClientTls>>,
    metrics: &NodeMetrics,
    shutdown: &watch::Receiver<bool>,
) -> bool {
    let peers = other_join_peers(cfg);
    let force = (!cfg.force_new_cluster.is_empty()).then_some(cfg.force_new_cluster.as_str());
    let waiting = Arc::new(std::sync::RwLock::new(String::from(
        "deciding whether to start a new cluster",
    )));
    let (stop_tx, stop_rx) = watch::channel(false);
    let probe = serve_while_starting(
        client_listener,
        client_tls,
        metrics,
        waiting.clone(),
        stop_rx,
    );
    let mut round = 0u64;
    let decision = loop {
        if *shutdown.borrow() {
            break false;
        }
        let mut answers = Vec::with_capacity(peers.len());
        for peer in &peers {
            let answer = match fetch_peer_list(dialer, peer).await {
                Ok(reply) => PeerAnswer::answered(
                    reply.has_data,
                    &reply.peer_set,
                    &reply.cluster_id,
                    &reply.forced_by,
                ),
                Err(err) => {
                    debug!(via = %peer, cause = %err, "peer not reachable");
                    PeerAnswer::Unreachable
                }
            };
            answers.push((peer.clone(), answer));
        }
        match decide_start(&answers, force, false) {
            StartDecision::Bootstrap => {
                if force.is_some() {
                    warn!(answers = ?answers, "--force-new-cluster: starting a new cluster");
                } else {
                    info!(peers = ?peers, "every peer answered that it has no data; starting a new cluster");
                }
                break true;
            }
            StartDecision::Join => {
                info!(answers = ?answers, "a cluster exists; joining it");
                break false;
            }
            StartDecision::Wait(why) => {
                if round.is_multiple_of(15) {
                    warn!(round, "{why}");
                }
                if let Ok(mut w) = waiting.write() {
                    *w = why;
                }
            }
        }
        round += 1;
        let mut shutdown = shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = shutdown.wait_for(|s| *s) => {}
        }
    };
    let _ = stop_tx.send(true);
    if let Some(probe) = probe {
        let _ = probe.await;
    }
    decision
}

async fn ask_to_join(
    cfg: &NodeConfig,
    incarnation: u64,
    cluster_id: &str,
    dialer: &PeerDialer,
    target: &str,
) -> Result<crate::server::proto::peer::JoinClusterReply, Box<dyn std::error::Error + Send + Sync>>
{
    let endpoint = PeerDialer::endpoint(target)?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(5));
    let mut client = PeerClient::new(dialer.connect(endpoint, None).await?);
    let request = dialer.request(JoinClusterRequest {
        server_id: cfg.node_id,
        server_addr: cfg.advertise_peer.clone(),
        client_addr: cfg.advertise_client.clone(),
        version: crate::lock::CLUSTER_VERSION,
        incarnation,
        cluster_id: cluster_id.to_string(),
    });
    Ok(client.join_cluster(request).await?.into_inner())
}

/// How often a node whose address book misses a member's addresses asks the leader for them.
const ADDRESS_REFRESH_INTERVAL: Duration = Duration::from_secs(2);

/// A node learns a peer's addresses when that peer opens a stream to it, so a follower may not
/// know another follower's client address (which `/members` and redirects report). While any
/// member's address is missing, this asks the leader (`FetchPeerList`) every couple of seconds.
pub(super) async fn refresh_addresses(
    cfg: NodeConfig,
    incarnation: u64,
    dialer: PeerDialer,
    status: watch::Receiver<NodeStatus>,
    addresses: AddressBook,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut leaderless_since: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(ADDRESS_REFRESH_INTERVAL) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let s = status.borrow().clone();
        if s.leader_id == 0 {
            // No leader known: a member whose address this node's storage does not hold (a
            // cluster from before the member table, say) is looked up through the `--join`
            // peers, each of which says its own id.
            let book = addresses.all();
            let missing = s
                .voters
                .iter()
                .any(|id| *id != cfg.node_id && book.get(id).is_none_or(|a| a.peer.is_empty()));
            let since = *leaderless_since.get_or_insert_with(std::time::Instant::now);
            if s.has_data && since.elapsed() >= REJOIN_AFTER {
                rejoin_if_removed(&cfg, incarnation, &dialer, &s).await;
            }
            if missing {
                for peer in other_join_peers(&cfg) {
                    if let Ok(reply) = fetch_peer_list(&dialer, &peer).await {
                        if reply.node_id != 0 && reply.node_id != cfg.node_id {
                            addresses.learn(reply.node_id, &peer, "");
                        }
                        learn_peer_list(&addresses, reply);
                    }
                }
            }
            continue;
        }
        leaderless_since = None;
        if s.leader_id == cfg.node_id {
            continue;
        }
        let book = addresses.all();
        let complete = s.voters.iter().chain(&s.learners).all(|id| {
            book.get(id)
                .is_some_and(|a| !a.peer.is_empty() && !a.client.is_empty())
        });
        let Some(leader_peer) = book.get(&s.leader_id).map(|a| a.peer.clone()) else {
            continue;
        };
        if complete || leader_peer.is_empty() {
            continue;
        }
        match fetch_peer_list(&dialer, &leader_peer).await {
            Ok(reply) => learn_peer_list(&addresses, reply),
            Err(err) => {
                debug!(leader = %leader_peer, cause = %err, "could not fetch the peer list")
            }
        }
    }
}

/// How long a node with data hears from no leader before it checks whether the cluster removed
/// it.
const REJOIN_AFTER: Duration = Duration::from_secs(10);

/// A node with data that hears from no leader may have been removed while it was away (scaled
/// down, or found dead): when a `--join` peer names a leader of this node's cluster whose
/// configuration lacks this node, it asks to join again, as a learner whose stale log the
/// leader replaces (a snapshot when it is too far behind), promoted once caught up.
async fn rejoin_if_removed(
    cfg: &NodeConfig,
    incarnation: u64,
    dialer: &PeerDialer,
    s: &NodeStatus,
) {
    for peer in other_join_peers(cfg) {
        let Ok(reply) = fetch_peer_list(dialer, &peer).await else {
            continue;
        };
        let leader_known = reply.leader_id != 0 && !reply.leader_addr.is_empty();
        match rejoin_verdict(
            cfg.node_id,
            &s.cluster_id,
            leader_known,
            &reply.cluster_id,
            &reply.peer_set,
        ) {
            RejoinVerdict::AskAnother => {
                if leader_known {
                    warn!(via = %peer, theirs = %reply.cluster_id, ours = %s.cluster_id, "a peer of another cluster; not joining it");
                }
                continue;
            }
            RejoinVerdict::Member => return,
            RejoinVerdict::Removed => {}
        }
        info!(
            leader = reply.leader_id,
            "this node is not a member of the cluster (removed while away): asking to join again"
        );
        match ask_to_join(cfg, incarnation, &s.cluster_id, dialer, &reply.leader_addr).await {
            Ok(r) if r.success => info!("joined again as a learner"),
            Ok(r) => warn!(error = %r.error, "join refused"),
            Err(err) => debug!(cause = %err, "join attempt failed"),
        }
        return;
    }
}

fn learn_peer_list(addresses: &AddressBook, reply: FetchPeerListReply) {
    for id in reply.peer_set {
        let peer = reply.peer_address.get(&id).map_or("", String::as_str);
        let client = reply.client_address.get(&id).map_or("", String::as_str);
        addresses.learn(id, peer, client);
    }
}

async fn fetch_peer_list(
    dialer: &PeerDialer,
    target: &str,
) -> Result<FetchPeerListReply, Box<dyn std::error::Error + Send + Sync>> {
    let endpoint = PeerDialer::endpoint(target)?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(2));
    let channel = dialer.connect(endpoint, None).await?;
    let request = dialer.request(FetchPeerListRequest { term: 0 });
    Ok(PeerClient::new(channel)
        .fetch_peer_list(request)
        .await?
        .into_inner())
}

/// A member of a static cluster (`--initial-cluster`) whose data directory is empty, while the
/// cluster's leader has already matched its log, lost its data: started again under its old id it
/// would vote without the entries it acknowledged (which can lose committed locks), and the
/// leader, which knows it has them, would never send them again. Such a node refuses to start.
/// Peers that cannot be reached, or that know no leader, prove nothing: the first start of a
/// cluster goes on as before.
pub(super) async fn refuse_if_data_lost(
    cfg: &NodeConfig,
    dialer: &PeerDialer,
    members: &std::collections::BTreeMap<NodeId, String>,
) -> Result<(), NodeError> {
    for (id, peer) in members.iter().filter(|(id, _)| **id != cfg.node_id) {
        let Ok(reply) = fetch_peer_list(dialer, peer).await else {
            continue;
        };
        // A follower names the leader; only the leader knows how far this node's log matched.
        let reply =
            if reply.leader_id != 0 && reply.leader_id != *id && !reply.leader_addr.is_empty() {
                match fetch_peer_list(dialer, &reply.leader_addr).await {
                    Ok(from_leader) => from_leader,
                    Err(_) => reply,
                }
            } else {
                reply
            };
        let matched = reply.match_index.get(&cfg.node_id).copied().unwrap_or(0);
        if matched > 0 {
            return Err(NodeError::Config(format!(
                "node {} starts with an empty data directory ({}), but the cluster's leader (node \
                 {}) holds its log as matched up to index {matched}: this node lost its data. A \
                 voter that forgot its log must not vote. Restore the data directory, or remove \
                 the member (`lockctl members remove --id {}`) and start this node with --join",
                cfg.node_id,
                cfg.data_dir.display(),
                reply.leader_id,
                cfg.node_id,
            )));
        }
    }
    Ok(())
}
