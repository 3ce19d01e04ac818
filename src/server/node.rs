//! Starting a lock node: open storage and recover, build the core and the state machine, start
//! the driver, serve peers and clients, join a cluster if asked, and stop cleanly.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_stream::wrappers::TcpListenerStream;
use tracing::{debug, error, info, warn};

use super::config::NodeConfig;
use super::driver::{Driver, DriverConfig, NodeStatus};
use super::grpc::{LockApi, PeerApi};
use super::grpc_seed::SeedLockApi;
use super::http::{router, AppState, ClientLimits};
use super::peer_stream;
use super::proto::lock::lock_service_server::LockServiceServer;
use super::proto::peer::peer_client::PeerClient;
use super::proto::peer::peer_server::PeerServer;
use super::proto::peer::{FetchPeerListReply, FetchPeerListRequest, JoinClusterRequest};
use super::proto::seed004::lock_service_server::LockServiceServer as SeedLockServiceServer;
use super::tls::{ClientTls, PeerTls, TlsFiles};
use super::transport::{AddressBook, LocalIdentity, PeerDialer, PeerTransport};
use crate::lock::{Limits, LockStateMachine};
use crate::raft::{Config, InitialState, Membership, NodeId, Raft};
use crate::storage::{SledStorage, Storage};
use crate::telemetry::NodeMetrics;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("storage: {0}")]
    Storage(#[from] crate::storage::StorageError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("state machine state does not decode: {0}")]
    State(String),
    #[error("{0}")]
    Config(String),
    #[error("server: {0}")]
    Serve(String),
}

/// Addresses a running node actually listens on (useful with port 0 in tests).
#[derive(Clone, Debug)]
pub struct BoundAddrs {
    pub peer: SocketAddr,
    pub client: SocketAddr,
}

/// Runs a node until `shutdown` turns true; returns after a graceful stop.
pub async fn run(cfg: NodeConfig, mut shutdown: watch::Receiver<bool>) -> Result<(), NodeError> {
    let peer_listener =
        TcpListener::bind(cfg.peer_listen)
            .await
            .map_err(|source| NodeError::Listen {
                addr: cfg.peer_listen,
                source,
            })?;
    let client_listener = TcpListener::bind(cfg.client_listen)
        .await
        .map_err(|source| NodeError::Listen {
            addr: cfg.client_listen,
            source,
        })?;

    let metrics = NodeMetrics::new();
    // `{id}` in a path stands for this node's id, so that every pod of a StatefulSet can run with
    // the same flags over one Secret holding every node's certificate.
    let file = |f: &str| {
        (!f.is_empty())
            .then(|| std::path::PathBuf::from(f.replace("{id}", &cfg.node_id.to_string())))
    };
    let peer_tls = match (
        file(&cfg.peer_tls_cert),
        file(&cfg.peer_tls_key),
        file(&cfg.peer_tls_ca),
    ) {
        (Some(cert), Some(key), Some(ca)) => Some(
            PeerTls::load(
                TlsFiles {
                    cert,
                    key,
                    ca: Some(ca),
                },
                &cfg.peer_tls_node_name,
                Some(metrics.tls_reloads_total.clone()),
            )
            .map_err(|e| NodeError::Config(format!("peer TLS: {e}")))?,
        ),
        _ => None,
    };
    let client_tls = match (file(&cfg.client_tls_cert), file(&cfg.client_tls_key)) {
        (Some(cert), Some(key)) => Some(
            ClientTls::load(
                TlsFiles {
                    cert,
                    key,
                    ca: file(&cfg.client_tls_ca),
                },
                Some(metrics.tls_reloads_total.clone()),
            )
            .map_err(|e| NodeError::Config(format!("client TLS: {e}")))?,
        ),
        _ => None,
    };
    let dialer = PeerDialer {
        cluster_token: cfg.cluster_token.clone(),
        tls: peer_tls.clone(),
    };
    for reason in ["token", "identity"] {
        metrics
            .peer_connections_refused_total
            .with_label_values(&[reason]);
    }

    let security = Arc::new(
        super::auth::ClientSecurity::load(
            &cfg.client_auth_file,
            &cfg.client_jwt_key_file,
            &cfg.fencing_key_file,
        )
        .map_err(NodeError::Config)?,
    );
    if cfg.cluster_token.is_empty() && peer_tls.is_none() && !cfg.peer_listen.ip().is_loopback() {
        tracing::warn!(
            peer_listen = %cfg.peer_listen,
            "--insecure: the peer port is reachable beyond this host with neither TLS nor a \
             cluster token: anyone who reaches it can join the cluster or remove members"
        );
    }
    if security.auth.is_none() && !cfg.client_listen.ip().is_loopback() {
        tracing::info!(
            client_listen = %cfg.client_listen,
            "no --client-auth-file: the client port takes requests from anyone who reaches it"
        );
    }
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|e| NodeError::Config(format!("cannot create {}: {e}", cfg.data_dir.display())))?;
    let storage = SledStorage::open_with(
        cfg.data_dir.join("raft"),
        crate::storage::SledOptions {
            cache_bytes: cfg.storage_cache_mb << 20,
            log_engine: cfg.raft_log_engine.parse().map_err(NodeError::Config)?,
            ..Default::default()
        },
    )?;
    let mut recovered = storage.recover()?;
    tracing::info!(
        raft_log_engine = %cfg.raft_log_engine,
        log_segments = storage.log_segments().unwrap_or(0),
        snapshot_index = recovered.snapshot_meta.index,
        last_index = recovered.last_index(),
        applied_index = recovered.applied_index,
        term = recovered.hard_state.term,
        "storage opened"
    );
    let fresh = recovered.last_index() == 0 && recovered.hard_state.term == 0;
    let initial_members = cfg
        .initial_members()
        .map_err(|e| NodeError::Config(e.to_string()))?;

    if fresh && !cfg.bootstrap && initial_members.len() > 1 {
        refuse_if_data_lost(&cfg, &dialer, &initial_members).await?;
    }

    // A StatefulSet runs every pod with the same flags: the pod named by `bootstrap_id` starts
    // the cluster, but only when no peer already belongs to one (its volume was lost, say).
    let bootstrap = cfg.bootstrap
        || (fresh
            && cfg.bootstrap_id == cfg.node_id
            && !cluster_exists(&cfg, &dialer, &shutdown).await);

    let addresses = AddressBook::default();
    addresses.learn(cfg.node_id, &cfg.advertise_peer, &cfg.advertise_client);
    for (id, peer) in &initial_members {
        addresses.learn(*id, peer, "");
    }
    let initial_membership = if !fresh {
        Membership::default()
    } else if bootstrap {
        Membership::with_voters([cfg.node_id])
    } else if !initial_members.is_empty() {
        Membership::with_voters(initial_members.keys().copied())
    } else {
        Membership::default()
    };

    let snapshot = crate::node::recovered_snapshot(&recovered.snapshot_meta);
    let sm =
        // Apply uses the limits replicated through the log (`SetLimits`, proposed from these
        // flags by the cluster's first leader); until then every replica uses the defaults.
        LockStateMachine::from_kv_with_limits(std::mem::take(&mut recovered.applied_state), Limits::default())
            .map_err(|e| NodeError::State(e.to_string()))?;
    let mut raft_cfg = Config::new(cfg.node_id, seed_from_clock(cfg.node_id));
    raft_cfg.election_ticks = cfg.election_ticks;
    raft_cfg.heartbeat_ticks = cfg.heartbeat_ticks;
    raft_cfg.max_batch_bytes = (cfg.max_message_bytes / 2).max(64 * 1024);
    // A follower catching up gets at most eight full appends at a time (4 MiB with the default
    // message size) instead of 64: the leader's turn that builds them stays short.
    raft_cfg.max_inflight_bytes = raft_cfg.max_batch_bytes * 8;
    raft_cfg.snapshot_chunk_bytes = (cfg.max_message_bytes / 2).max(64 * 1024);
    let initial = InitialState {
        hard_state: recovered.hard_state,
        snapshot,
        entries: recovered.entries,
        applied: recovered.applied_index,
        initial_membership,
    };
    let raft = Raft::new(raft_cfg, initial).map_err(|e| NodeError::Config(e.to_string()))?;
    info!(
        node = cfg.node_id,
        term = raft.term(),
        last_index = raft.last_index(),
        applied = raft.applied_index(),
        voters = ?raft.membership().voters,
        "recovered"
    );

    let transport = PeerTransport::new(
        LocalIdentity {
            id: cfg.node_id,
            peer_addr: cfg.advertise_peer.clone(),
            client_addr: cfg.advertise_client.clone(),
        },
        dialer.clone(),
        addresses.clone(),
        metrics.clone(),
        cfg.max_message_bytes,
    )
    .with_plain_streams(cfg.peer_stream == "plain");
    let (input_tx, input_rx) = mpsc::channel(cfg.max_pending_requests);
    let (status_tx, status_rx) = watch::channel(NodeStatus::default());
    let watch_hub = Arc::new(super::watch::WatchHub::new(raft.applied_index()));
    let driver = Driver::new(
        raft,
        storage,
        sm,
        transport,
        metrics.clone(),
        DriverConfig {
            tick: cfg.tick,
            snapshot_entries: cfg.snapshot_entries,
            snapshot_bytes: cfg.snapshot_bytes,
            waiter_reclaim: cfg.waiter_reclaim,
            max_batch_inputs: 1024,
            flush_mode: cfg.background_flush.parse().map_err(NodeError::Config)?,
            limits: lock_limits(&cfg),
            watch: watch_hub.clone(),
        },
        input_rx,
        status_tx,
    );
    let single_fresh_voter = fresh && bootstrap;

    // Peer port. A fresh node that joins takes Raft messages only once the leader accepted it.
    let joining = fresh && !bootstrap && !cfg.join_peers().is_empty();
    let admitted = Arc::new(AtomicBool::new(!joining));
    let peer_api = PeerApi {
        driver: input_tx.clone(),
        addresses: addresses.clone(),
        cluster_token: cfg.cluster_token.clone(),
        tls: peer_tls.clone(),
        refused: metrics.peer_connections_refused_total.clone(),
        status: status_rx.clone(),
        admitted: admitted.clone(),
        request_duration: metrics.request_duration_seconds.clone(),
    };
    let peer_api = Arc::new(peer_api);
    let peer_max_message_bytes = cfg.max_message_bytes;
    // The listener moves to the driver's runtime (below): its sockets must be registered there.
    let peer_listener = peer_listener
        .into_std()
        .map_err(|e| NodeError::Serve(format!("cannot hand the peer listener over: {e}")))?;
    let peer_shutdown = shutdown.clone();
    let peer_tls_for_server = peer_tls.clone();

    let driver_shutdown = shutdown.clone();
    // The Raft driver runs on its own thread with a single-threaded runtime: it waits for the
    // disk on every Ready, and doing that on an I/O worker would stall clients and peers (or,
    // with `block_in_place`, hand the worker over to a new thread on every flush). Its runtime
    // also runs the peer port's server and the streams that carry the leader's appends and a
    // follower's answers to them (see `Driver::new`): a Raft message from a peer is read by
    // the thread that handles it, woken by the socket itself, instead of by an I/O worker that
    // must then wake the driver (30-60 µs on a small VM, twice on the commit path of every
    // request). Nothing else reads the peer port's messages, so they lose nothing by waiting
    // while the driver flushes.
    let (driver_done_tx, driver_done) = tokio::sync::oneshot::channel::<()>();
    let (peer_started_tx, peer_started) = tokio::sync::oneshot::channel::<Result<(), String>>();
    let (peer_done_tx, peer_done) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("raftlock-driver".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(err) => {
                    let _ = peer_started_tx
                        .send(Err(format!("cannot start the driver runtime: {err}")));
                    return;
                }
            };
            let peer_task = {
                let _in_runtime = rt.enter();
                match serve_peers(
                    peer_listener,
                    peer_tls_for_server,
                    peer_api,
                    peer_max_message_bytes,
                    peer_shutdown,
                ) {
                    Ok(server) => {
                        let _ = peer_started_tx.send(Ok(()));
                        rt.spawn(server)
                    }
                    Err(err) => {
                        let _ = peer_started_tx.send(Err(err));
                        return;
                    }
                }
            };
            rt.block_on(driver.run(driver_shutdown));
            let _ = driver_done_tx.send(());
            // Peers keep their Raft streams open for good: once the driver has stopped there
            // is nothing left to answer on them, so do not wait long.
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(1), peer_task).await;
            });
            let _ = peer_done_tx.send(());
        })
        .map_err(|e| NodeError::Serve(format!("cannot start the driver thread: {e}")))?;
    match peer_started.await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => return Err(NodeError::Serve(err)),
        Err(_) => {
            return Err(NodeError::Serve(
                "the driver thread stopped at start".into(),
            ))
        }
    }
    if single_fresh_voter {
        info!("bootstrapped a one-node cluster");
    }

    tokio::spawn(super::tls::reload_loop(
        peer_tls.clone(),
        client_tls.clone(),
        shutdown.clone(),
    ));

    // Client port: WebSocket + HTTP + gRPC (`raftlock.lock.v1.LockService` and seed 004's
    // `api.LockService`) on one listener.
    let state = AppState {
        driver: input_tx.clone(),
        status: status_rx.clone(),
        metrics: metrics.clone(),
        limits: Arc::new(ClientLimits {
            max_connections: cfg.max_connections,
            max_inflight_per_connection: cfg.max_inflight_per_connection,
            max_message_bytes: cfg.max_message_bytes,
            max_key_bytes: cfg.max_key_bytes,
            max_value_bytes: cfg.max_value_bytes,
            max_ttl_ms: cfg.max_ttl.as_millis() as u64,
            default_ttl_ms: cfg.default_ttl.as_millis() as u64,
        }),
        connections: Arc::new(Semaphore::new(cfg.max_connections)),
        addresses: addresses.clone(),
        forwarder: Arc::new(super::forward::Forwarder::new(
            cfg.node_id,
            dialer.clone(),
            cfg.max_pending_requests,
            cfg.max_message_bytes,
        )),
        shutdown: shutdown.clone(),
        security,
        watch: watch_hub,
    };
    let lock_service = LockServiceServer::new(LockApi {
        state: state.clone(),
    })
    .max_decoding_message_size(cfg.max_message_bytes);
    let seed_lock_service = SeedLockServiceServer::new(SeedLockApi {
        state: state.clone(),
    })
    .max_decoding_message_size(cfg.max_message_bytes);
    let grpc_routes = super::grpc::timed(
        tonic::service::Routes::new(lock_service)
            .add_service(seed_lock_service)
            .into_axum_router(),
        metrics.grpc_request_duration_seconds.clone(),
    );
    let app = router(state).merge(grpc_routes);
    let mut client_shutdown = shutdown.clone();
    let max_tcp_connections = cfg.max_connections + super::listener::EXTRA_TCP_CONNECTIONS;
    let refused = metrics.client_connections_refused_total.clone();
    let client_task = tokio::spawn(async move {
        let client_listener = super::listener::ClientListener::new(
            client_listener,
            max_tcp_connections,
            super::listener::REQUEST_HEAD_DEADLINE,
            refused,
            client_tls,
        );
        axum::serve(client_listener, app)
            .with_graceful_shutdown(async move {
                let _ = client_shutdown.wait_for(|s| *s).await;
            })
            .await
    });

    tokio::spawn(refresh_addresses(
        cfg.clone(),
        dialer.clone(),
        status_rx.clone(),
        addresses.clone(),
        shutdown.clone(),
    ));

    if joining {
        let join_cfg = cfg.clone();
        let join_shutdown = shutdown.clone();
        let join_admitted = admitted.clone();
        let join_addresses = addresses.clone();
        let join_dialer = dialer.clone();
        tokio::spawn(async move {
            join_cluster(
                join_cfg,
                join_dialer,
                join_addresses,
                join_admitted,
                join_shutdown,
            )
            .await
        });
    }

    let _ = shutdown.wait_for(|s| *s).await;
    info!("shutting down");
    let _ = driver_done.await;
    drop(input_tx);
    // The peer server stops within a second on the driver's thread (see above). Client
    // connections drain for up to 2 s.
    let _ = tokio::join!(
        tokio::time::timeout(Duration::from_secs(2), peer_done),
        tokio::time::timeout(Duration::from_secs(5), client_task),
    );
    Ok(())
}

/// Asks the listed peers to add this node, hopping to the leader they name (at most five hops per
/// round), and retries rounds with backoff until it is accepted (then `admitted` turns true) or
/// the node shuts down. A pod that cannot join yet keeps trying (its peers may still be
/// starting, or an operator must first remove the member it replaces); it stays unready meanwhile.
async fn join_cluster(
    cfg: NodeConfig,
    dialer: PeerDialer,
    addresses: AddressBook,
    admitted: Arc<AtomicBool>,
    shutdown: watch::Receiver<bool>,
) {
    let peers = other_join_peers(&cfg);
    let mut backoff = Duration::from_millis(100);
    for round in 0u64.. {
        if *shutdown.borrow() {
            return;
        }
        for start in &peers {
            let mut target = start.clone();
            for hop in 0..5 {
                match ask_to_join(&cfg, &dialer, &target).await {
                    Ok(reply) if reply.success => {
                        admitted.store(true, Ordering::Release);
                        info!(via = %target, hop, "joined the cluster as a learner");
                        // Learn every member's addresses now: if the leader fails before this
                        // node hears from the others, it must still reach them to elect a new one.
                        match fetch_peer_list(&dialer, &target).await {
                            Ok(reply) => learn_peer_list(&addresses, reply),
                            Err(err) => debug!(via = %target, cause = %err, "no peer list yet"),
                        }
                        return;
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

/// Asks the `join` peers (other than this node) whether any of them belongs to a cluster, for a
/// few rounds. Unreachable peers and peers without members count as "no cluster".
async fn cluster_exists(
    cfg: &NodeConfig,
    dialer: &PeerDialer,
    shutdown: &watch::Receiver<bool>,
) -> bool {
    let peers = other_join_peers(cfg);
    for round in 0..3 {
        if *shutdown.borrow() {
            return false;
        }
        for peer in &peers {
            match fetch_peer_list(dialer, peer).await {
                Ok(reply) if !reply.peer_set.is_empty() => {
                    info!(via = %peer, members = ?reply.peer_set, "a cluster exists; joining it");
                    return true;
                }
                Ok(_) => debug!(via = %peer, "peer belongs to no cluster yet"),
                Err(err) => debug!(via = %peer, cause = %err, "peer not reachable"),
            }
        }
        if round < 2 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    info!(peers = ?peers, "no peer knows of a cluster; bootstrapping a new one");
    false
}

async fn ask_to_join(
    cfg: &NodeConfig,
    dialer: &PeerDialer,
    target: &str,
) -> Result<super::proto::peer::JoinClusterReply, Box<dyn std::error::Error + Send + Sync>> {
    let endpoint = PeerDialer::endpoint(target)?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(5));
    let mut client = PeerClient::new(dialer.connect(endpoint, None).await?);
    let request = dialer.request(JoinClusterRequest {
        server_id: cfg.node_id,
        server_addr: cfg.advertise_peer.clone(),
        client_addr: cfg.advertise_client.clone(),
        version: crate::lock::CLUSTER_VERSION,
    });
    Ok(client.join_cluster(request).await?.into_inner())
}

/// How often a node whose address book misses a member's addresses asks the leader for them.
const ADDRESS_REFRESH_INTERVAL: Duration = Duration::from_secs(2);

/// A node learns a peer's addresses when that peer opens a stream to it, so a follower may not
/// know another follower's client address (which `/members` and redirects report). While any
/// member's address is missing, this asks the leader (`FetchPeerList`) every couple of seconds.
async fn refresh_addresses(
    cfg: NodeConfig,
    dialer: PeerDialer,
    status: watch::Receiver<NodeStatus>,
    addresses: AddressBook,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(ADDRESS_REFRESH_INTERVAL) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let s = status.borrow().clone();
        if s.leader_id == 0 || s.leader_id == cfg.node_id {
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
async fn refuse_if_data_lost(
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

/// Election timeouts only need to differ between nodes and restarts; this is the I/O shell, so
/// it may read the clock.
fn seed_from_clock(id: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Default lock limits derived from the node configuration.
pub fn lock_limits(cfg: &NodeConfig) -> Limits {
    Limits {
        key_bytes_max: cfg.max_key_bytes,
        value_bytes_max: cfg.max_value_bytes,
        ttl_ms_max: cfg.max_ttl.as_millis() as u64,
        waiters_per_key_max: cfg.max_waiters_per_key,
        session_idle_ms: cfg.session_idle.as_millis() as u64,
        sessions_max: cfg.max_sessions,
        dedupe_retain_ms: cfg.dedupe_retain.as_millis() as u64,
        dedupe_entries_max: cfg.max_answers,
        ..Limits::default()
    }
}

/// The peer port's server on `listener`, to be spawned on the runtime this is called in (the
/// driver's): the listener and every connection it accepts are registered there. A connection
/// that opens with a plain Raft stream's magic is served by `peer_stream`; every other one by
/// the gRPC server.
pub(crate) fn serve_peers(
    listener: std::net::TcpListener,
    tls: Option<Arc<PeerTls>>,
    api: Arc<PeerApi>,
    max_message_bytes: usize,
    mut shutdown: watch::Receiver<bool>,
) -> Result<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>, String> {
    let listener =
        TcpListener::from_std(listener).map_err(|e| format!("cannot serve the peer port: {e}"))?;
    let stopped = async move {
        let _ = shutdown.wait_for(|s| *s).await;
    };
    let router = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(
            PeerServer::from_arc(api.clone())
                .max_decoding_message_size(max_message_bytes)
                .max_encoding_message_size(max_message_bytes),
        );
    Ok(Box::pin(async move {
        let result = match tls {
            Some(tls) => {
                let incoming =
                    sort_peer_connections(tls.incoming(listener), api, max_message_bytes);
                router.serve_with_incoming_shutdown(incoming, stopped).await
            }
            // `tcp_nodelay` above applies only to listeners tonic binds itself: accepted peer
            // sockets get it here. Without it the small HTTP/2 frames this side sends (window
            // updates, pings) waited for the other side's delayed ACK, about 40 ms, whenever
            // one was already in flight — the ~41-44 ms tail of lock requests under load.
            None => {
                let accepted =
                    tokio_stream::StreamExt::map(TcpListenerStream::new(listener), |conn| {
                        if let Ok(tcp) = &conn {
                            let _ = tcp.set_nodelay(true);
                            peer_stream::watch_liveness(tcp);
                        }
                        conn
                    });
                let incoming = sort_peer_connections(accepted, api, max_message_bytes);
                router.serve_with_incoming_shutdown(incoming, stopped).await
            }
        };
        if let Err(err) = result {
            error!(cause = %err, "the peer server stopped");
        }
    }))
}

/// Connections whose first bytes are still being read, at most.
const PEER_CONNECTIONS_SNIFFED: usize = 256;

/// Reads the first bytes of each accepted peer connection: plain Raft streams are served
/// here, every other connection is passed on (its bytes unread) to the gRPC server.
fn sort_peer_connections<S, I>(
    accepted: I,
    api: Arc<PeerApi>,
    max_message_bytes: usize,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<peer_stream::Prefixed<S>>>
where
    S: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + peer_stream::ConnectionCert
        + Unpin
        + Send
        + 'static,
    I: futures::Stream<Item = std::io::Result<S>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let slots = Arc::new(tokio::sync::Semaphore::new(PEER_CONNECTIONS_SNIFFED));
    tokio::spawn(async move {
        let mut accepted = std::pin::pin!(accepted);
        loop {
            let next = tokio::select! {
                next = futures::StreamExt::next(&mut accepted) => next,
                _ = tx.closed() => return,
            };
            let conn = match next {
                Some(Ok(conn)) => conn,
                Some(Err(err)) => {
                    warn!(cause = %err, "peer accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                None => return,
            };
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let tx = tx.clone();
            let api = api.clone();
            tokio::spawn(async move {
                let sniffed =
                    tokio::time::timeout(peer_stream::HANDSHAKE_DEADLINE, peer_stream::sniff(conn))
                        .await;
                drop(slot);
                match sniffed {
                    Ok(Ok(peer_stream::Sniffed::Plain(conn))) => {
                        peer_stream::serve(api, conn, max_message_bytes).await
                    }
                    Ok(Ok(peer_stream::Sniffed::Other(conn))) => {
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Err(err)) => debug!(cause = %err, "peer connection closed unread"),
                    Err(_) => debug!("peer connection sent nothing in time"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
