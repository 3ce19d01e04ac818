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
use super::grpc::LockApi;
use super::grpc_seed::SeedLockApi;
use super::http::{router, AppState, ClientLimits};
use super::peer_api::PeerApi;
use super::peer_stream;
use super::proto::lock::lock_service_server::LockServiceServer;
use super::proto::peer::peer_client::PeerClient;
use super::proto::peer::peer_server::PeerServer;
use super::proto::peer::{FetchPeerListReply, FetchPeerListRequest, JoinClusterRequest};
use super::proto::seed004::lock_service_server::LockServiceServer as SeedLockServiceServer;
use super::tls::{ClientTls, PeerTls, TlsFiles};
use super::transport::{AddressBook, LocalIdentity, PeerDialer, PeerTransport};
use crate::lock::{Limits, LockStateMachine};
use crate::node::lifecycle::{
    decide_start, rejoin_verdict, PeerAnswer, RejoinVerdict, StartDecision,
};
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
            .map_err(|e| NodeError::Config(format!("peer TLS: {e}")))?
            .with_operator_name(&cfg.peer_tls_operator_name),
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
        from_node: cfg.node_id,
    };
    for reason in ["token", "identity", "limit", "address_limit"] {
        metrics
            .peer_connections_refused_total
            .with_label_values(&[reason]);
    }

    let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_string());
    let max_lifetime_s = match cfg.client_jwt_max_lifetime.as_str() {
        "" => None,
        text => Some(
            humantime::parse_duration(text)
                .map_err(|e| NodeError::Config(format!("client_jwt_max_lifetime `{text}`: {e}")))?
                .as_secs(),
        ),
    };
    let jwt_rules = super::auth::JwtRules {
        issuer: non_empty(&cfg.client_jwt_issuer),
        audience: non_empty(&cfg.client_jwt_audience),
        max_lifetime_s,
    };
    let security = Arc::new(
        super::auth::ClientSecurity::load_with(
            &cfg.client_auth_file,
            &cfg.client_jwt_key_file,
            jwt_rules,
            &cfg.fencing_key_file,
        )
        .map_err(NodeError::Config)?,
    );
    if !cfg.cluster_token.is_empty() && cfg.cluster_token.len() < 32 {
        tracing::warn!(
            length = cfg.cluster_token.len(),
            "the cluster token is shorter than 32 characters: anyone who can reach the peer \
             port may guess it; use a longer random token (the Helm chart generates one)"
        );
    }
    if cfg.cluster_token.is_empty() && peer_tls.is_none() && !cfg.peer_listen.ip().is_loopback() {
        tracing::warn!(
            peer_listen = %cfg.peer_listen,
            "--insecure: the peer port is reachable beyond this host with neither TLS nor a \
             cluster token: anyone who reaches it can join the cluster or remove members"
        );
    }
    if !security.authenticates() && !cfg.client_listen.ip().is_loopback() {
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
    let incarnation = load_incarnation(&cfg.data_dir, fresh)?;
    if !fresh && !cfg.force_new_cluster.is_empty() {
        warn!("--force-new-cluster is ignored: this node has data (it starts no new cluster)");
    }

    // A StatefulSet runs every pod with the same flags: the pod named by `bootstrap_id` starts
    // the cluster, but only once every other peer answered that it has no data (a peer that
    // does not answer may hold the cluster: its volume was lost while the others are down,
    // say), or when the operator forces it once.
    let bootstrap = cfg.bootstrap
        || (fresh
            && cfg.bootstrap_id == cfg.node_id
            && decide_bootstrap(
                &cfg,
                &dialer,
                &client_listener,
                client_tls.clone(),
                &metrics,
                &shutdown,
            )
            .await);
    let forced_by = if bootstrap && fresh && !cfg.force_new_cluster.is_empty() {
        record_forced(&cfg.data_dir, &cfg.force_new_cluster)?;
        cfg.force_new_cluster.clone()
    } else {
        String::new()
    };

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
    // Data of a cluster at a version this build does not understand (a rolled-back binary):
    // stop before applying anything, rather than skip what it cannot read.
    if sm.cluster_version() > crate::lock::CLUSTER_VERSION {
        return Err(NodeError::State(format!(
            "this data directory holds a cluster at version {}, and this RaftLock understands \
             versions up to {}: run a newer RaftLock on this node",
            sm.cluster_version(),
            crate::lock::CLUSTER_VERSION
        )));
    }
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
            incarnation,
            cluster_id: Default::default(),
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
            quotas: lock_quotas(&cfg),
            watch: watch_hub.clone(),
            identity: crate::lock::MemberInfo {
                peer_addr: cfg.advertise_peer.clone(),
                client_addr: cfg.advertise_client.clone(),
                incarnation,
            },
            new_cluster_id: rand::random::<u128>().max(1),
            forced_by,
            dead_member: (!cfg.dead_member_timeout.is_zero()).then_some(cfg.dead_member_timeout),
            min_voters: cfg.min_voters,
            joining: fresh && !bootstrap && !cfg.join_peers().is_empty(),
            admission_mark: admission_mark(
                &cfg,
                fresh && !bootstrap && !cfg.join_peers().is_empty(),
            )?,
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
        incarnation,
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
    tokio::spawn(reload_client_auth(security.clone(), shutdown.clone()));

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
    let max_per_address = cfg.max_connections_per_address;
    let client_task = tokio::spawn(async move {
        let client_listener = super::listener::ClientListener::new(
            client_listener,
            max_tcp_connections,
            max_per_address,
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
        incarnation,
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
        let join_driver = input_tx.clone();
        tokio::spawn(async move {
            join_cluster(
                join_cfg,
                incarnation,
                join_dialer,
                join_addresses,
                join_admitted,
                join_driver,
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
    incarnation: u64,
    dialer: PeerDialer,
    addresses: AddressBook,
    admitted: Arc<AtomicBool>,
    driver: mpsc::Sender<super::driver::Input>,
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
                match ask_to_join(&cfg, incarnation, "", &dialer, &target).await {
                    Ok(reply) if reply.success => {
                        admitted.store(true, Ordering::Release);
                        let _ = driver.send(super::driver::Input::Admitted).await;
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

/// Asks every other `join` peer about itself until [`decide_start`] decides: true to start a
/// new cluster, false to join the one that exists. While it waits it says why in its log and on
/// `/readyz` (a small server on the client port until the node starts), and retries every two
/// seconds until the node shuts down.
async fn decide_bootstrap(
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
        metrics.client_connections_refused_total.clone(),
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

/// While a node decides how to start, its client port answers `/healthz` (alive) and `/readyz`
/// (503 with the reason it waits) on a copy of the listener, over client TLS when it is on, as
/// the probes expect; stopped before the node serves.
fn serve_while_starting(
    listener: &TcpListener,
    tls: Option<Arc<ClientTls>>,
    refused: prometheus::IntCounterVec,
    waiting: Arc<std::sync::RwLock<String>>,
    mut stop: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::from_std(listener_copy(listener)?).ok()?;
    let app = axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route(
            "/readyz",
            axum::routing::get(move || {
                let why = waiting.read().map(|w| w.clone()).unwrap_or_default();
                async move {
                    (
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {why}"),
                    )
                }
            }),
        );
    let listener = super::listener::ClientListener::new(
        listener,
        64,
        16,
        super::listener::REQUEST_HEAD_DEADLINE,
        refused,
        tls,
    );
    Some(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
    }))
}

/// A second handle on the same listening socket.
fn listener_copy(listener: &TcpListener) -> Option<std::net::TcpListener> {
    use std::os::fd::AsFd;
    let owned = listener.as_fd().try_clone_to_owned().ok()?;
    let std_listener = std::net::TcpListener::from(owned);
    std_listener.set_nonblocking(true).ok()?;
    Some(std_listener)
}

/// This node's incarnation: a random id minted when its data directory is created (kept in
/// `incarnation` beside the store). A node whose data was lost comes back as a new incarnation
/// of its id, which the leader can tell from the member that acknowledged the log.
fn load_incarnation(data_dir: &std::path::Path, fresh: bool) -> Result<u64, NodeError> {
    let path = data_dir.join("incarnation");
    if !fresh {
        if let Ok(text) = std::fs::read_to_string(&path) {
            if let Ok(v) = u64::from_str_radix(text.trim(), 16) {
                if v != 0 {
                    return Ok(v);
                }
            }
        }
    }
    let v = rand::random::<u64>().max(1);
    write_synced(&path, format!("{v:016x}\n").as_bytes())?;
    info!(incarnation = %format!("{v:016x}"), "this data directory's incarnation");
    Ok(v)
}

/// The mark (`awaiting-admission` in the data directory) of a node that started on an empty
/// directory to join a cluster, kept until its log holds the entry that admitted this
/// incarnation: across restarts until then it stays out of elections. `Some` while it exists.
fn admission_mark(
    cfg: &NodeConfig,
    joining_fresh: bool,
) -> Result<Option<std::path::PathBuf>, NodeError> {
    let path = cfg.data_dir.join("awaiting-admission");
    if joining_fresh {
        write_synced(
            &path,
            b"this node has not been admitted to its cluster yet\n",
        )?;
    }
    Ok(path.exists().then_some(path))
}

/// Records the `--force-new-cluster` value a new cluster was started with.
fn record_forced(data_dir: &std::path::Path, value: &str) -> Result<(), NodeError> {
    write_synced(
        &data_dir.join("forced-new-cluster"),
        format!("{value}\n").as_bytes(),
    )
}

fn write_synced(path: &std::path::Path, bytes: &[u8]) -> Result<(), NodeError> {
    let write = || -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    };
    write().map_err(|e| NodeError::Config(format!("cannot write {}: {e}", path.display())))
}

async fn ask_to_join(
    cfg: &NodeConfig,
    incarnation: u64,
    cluster_id: &str,
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
async fn refresh_addresses(
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

/// Reads the identity file and the JWT key file again every [`super::tls::RELOAD_INTERVAL`]
/// until shutdown, taking a changed, valid set.
async fn reload_client_auth(
    security: Arc<super::auth::ClientSecurity>,
    mut shutdown: watch::Receiver<bool>,
) {
    if !security.authenticates() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(super::tls::RELOAD_INTERVAL) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        match security.reload_if_changed() {
            Ok(true) => info!("client identities reloaded: new connections use them"),
            Ok(false) => {}
            Err(err) => warn!(
                cause = %err,
                "client identity files changed but cannot be used; keeping the last good ones"
            ),
        }
    }
}

/// The byte budgets and per-identity quotas this node proposes when it leads. Per-identity
/// quotas apply only when clients authenticate: otherwise a client id proves nothing.
pub fn lock_quotas(cfg: &NodeConfig) -> crate::lock::Quotas {
    crate::lock::Quotas {
        data_bytes_max: cfg.max_data_bytes,
        lock_bytes_max: cfg.max_lock_bytes,
        by_identity: !cfg.client_auth_file.is_empty() || !cfg.client_jwt_key_file.is_empty(),
        identity_locks_max: cfg.identity_max_locks,
        identity_waiters_max: cfg.identity_max_waiters,
        identity_sessions_max: cfg.identity_max_sessions,
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
                let refused = api.refused.clone();
                let incoming = sort_peer_connections(
                    tls.incoming(listener, refused.clone()),
                    api,
                    max_message_bytes,
                    refused,
                );
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
                            super::sockets::watch_liveness(tcp);
                        }
                        conn
                    });
                let refused = api.refused.clone();
                let incoming = sort_peer_connections(accepted, api, max_message_bytes, refused);
                router.serve_with_incoming_shutdown(incoming, stopped).await
            }
        };
        if let Err(err) = result {
            error!(cause = %err, "the peer server stopped");
        }
    }))
}

/// Connections whose first bytes are still being read, at most; a connection beyond it is
/// closed at once.
const PEER_CONNECTIONS_SNIFFED: usize = 256;

/// Reads the first bytes of each accepted peer connection: plain Raft streams are served
/// here, every other connection is passed on (its bytes unread) to the gRPC server.
fn sort_peer_connections<S, I>(
    accepted: I,
    api: Arc<PeerApi>,
    max_message_bytes: usize,
    refused: prometheus::IntCounterVec,
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
    let per_address = super::sockets::PerAddress::new(super::tls::MAX_PEER_HANDSHAKES_PER_ADDRESS);
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
            // Never awaited here: a slot is taken at once or the connection is closed, so
            // sockets that send nothing cannot hold up the next accept.
            let address_slot = match conn.source_ip() {
                Some(ip) => match per_address.try_take(ip) {
                    Some(slot) => Some(slot),
                    None => {
                        refused.with_label_values(&["address_limit"]).inc();
                        continue;
                    }
                },
                None => None,
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                refused.with_label_values(&["limit"]).inc();
                continue;
            };
            let slot = (slot, address_slot);
            let tx = tx.clone();
            let api = api.clone();
            tokio::spawn(async move {
                let sniffed =
                    tokio::time::timeout(peer_stream::HANDSHAKE_DEADLINE, peer_stream::sniff(conn))
                        .await;
                drop(slot);
                match sniffed {
                    Ok(Ok(peer_stream::Sniffed::Plain(conn))) => {
                        super::peer_api::serve(api, conn, max_message_bytes).await
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
