//! Starting a lock node: open storage and recover, build the core and the state machine, start
//! the driver, serve peers and clients, join a cluster if asked, and stop cleanly.
//!
//! Here: [`run`], the startup from configuration to a serving node and its shutdown. Its
//! children:
//! - `startup`: the data directory's marks, the election seed, limits and quotas from the config;
//! - `bootstrap`: start a cluster or join one, rejoin after removal, fill the address book;
//! - `listeners`: the probe server while starting, the peer port's server, credential reloads.

mod bootstrap;
mod listeners;
mod startup;

use bootstrap::{decide_bootstrap, join_cluster, refresh_addresses, refuse_if_data_lost};
use listeners::reload_client_auth;
pub(crate) use listeners::serve_peers;
use startup::{admission_mark, load_incarnation, record_forced, seed_from_clock};
pub use startup::{lock_limits, lock_quotas};

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{info, warn};

use super::config::NodeConfig;
use super::driver::{Driver, DriverConfig, NodeStatus};
use super::grpc::LockApi;
use super::grpc_seed::SeedLockApi;
use super::http::{router, AppState, ClientLimits};
use super::peer_api::PeerApi;
use super::proto::lock::lock_service_server::LockServiceServer;
use super::proto::seed004::lock_service_server::LockServiceServer as SeedLockServiceServer;
use super::tls::{ClientTls, PeerTls, TlsFiles};
use super::transport::{AddressBook, LocalIdentity, PeerDialer, PeerTransport};
use crate::lock::{Limits, LockStateMachine};
use crate::raft::{Config, InitialState, Membership, Raft};
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
        raft_log_engine = %storage.log_engine(),
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
            commit_delay: cfg.commit_delay,
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
            max_batch: cfg.max_batch,
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
    let listener_metrics = metrics.clone();
    let max_per_address = cfg.max_connections_per_address;
    let client_task = tokio::spawn(async move {
        let client_listener = super::listener::ClientListener::new(
            client_listener,
            max_tcp_connections,
            max_per_address,
            super::listener::REQUEST_HEAD_DEADLINE,
            &listener_metrics,
            client_tls,
        );
        axum::serve(client_listener, app)
            .with_graceful_shutdown(async move {
                let _ = client_shutdown.wait_for(|s| *s).await;
            })
            .await
    });

    tokio::spawn(measure_store_size(
        cfg.data_dir.clone(),
        metrics.store_size_bytes.clone(),
        shutdown.clone(),
    ));
    tokio::spawn(refresh_addresses(
        cfg.clone(),
        incarnation,
        dialer.clone(),
        status_rx.clone(),
        addresses.clone(),
        shutdown.clone(),
    ));

    // A fresh node joins; one restarted before its log held its admission asks again too.
    let mark = cfg.data_dir.join("awaiting-admission");
    let awaiting_admission = mark.exists() && !cfg.join_peers().is_empty();
    if joining || awaiting_admission {
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
                Some(mark),
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

/// Every 15 s, the bytes of the files under the data directory into
/// `raftlock_store_size_bytes`, walked on a blocking thread (the walk is bounded: the directory
/// holds the node's own few dozen files).
async fn measure_store_size(
    dir: std::path::PathBuf,
    gauge: prometheus::IntGauge,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let walk = dir.clone();
        if let Ok(bytes) = tokio::task::spawn_blocking(move || dir_bytes(&walk, 4)).await {
            gauge.set(bytes as i64);
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(15)) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}

/// The bytes of the regular files under `dir`, `depth` directories deep at most.
fn dir_bytes(dir: &std::path::Path, depth: u32) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0;
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_file() {
            total += entry.metadata().map_or(0, |m| m.len());
        } else if kind.is_dir() && depth > 0 {
            total += dir_bytes(&entry.path(), depth - 1);
        }
    }
    total
}
