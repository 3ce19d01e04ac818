//! The `lock-node` command line: one RaftLock cluster member.
//!
//! Settings come from defaults, then `--config FILE` (TOML), then `RAFTLOCK_*` environment
//! variables (e.g. `RAFTLOCK_NODE_ID=2`), then these flags — each layer overriding the previous.
//! Durations are written like `150ms` or `10s`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::server::config::NodeConfig;
use clap::Parser;
use tokio::sync::watch;

#[derive(Parser, Debug)]
#[command(name = "lock-node", version, about = "A RaftLock cluster member", long_about = None)]
struct Args {
    /// TOML file with any of the settings below (keys in snake_case).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Node id (>= 1). Default: derived from a StatefulSet hostname `<name>-N` as N+1.
    #[arg(long)]
    node_id: Option<u64>,
    /// Directory for the Raft log, hard state and applied state (sled). Default ./raftlock-data
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Listen address for peers (Raft and membership RPCs). Default 0.0.0.0:8080
    #[arg(long)]
    peer_listen: Option<String>,
    /// Listen address for clients (WebSocket /ws, gRPC LockService, HTTP). Default 0.0.0.0:50050
    #[arg(long)]
    client_listen: Option<String>,
    /// Peer address other nodes use to reach this one. Default: --peer-listen
    #[arg(long)]
    advertise_peer: Option<String>,
    /// Client address that redirects point to. Default: --client-listen
    #[arg(long)]
    advertise_client: Option<String>,
    /// Start a one-node cluster (only when the data directory is empty).
    #[arg(long)]
    bootstrap: bool,
    /// Initial voters: `1=host:8081,2=host:8082,3=host:8083` (peer addresses).
    #[arg(long)]
    initial_cluster: Option<String>,
    /// Join a running cluster through these peers: `host:port[,host:port]`.
    #[arg(long)]
    join: Option<String>,
    /// With --join: the node with this id starts a new cluster when its data directory is empty
    /// and no --join peer knows of one; every other node joins (same flags on every pod).
    #[arg(long)]
    bootstrap_id: Option<u64>,
    /// One-shot override for a lost cluster: with an empty data directory, start a new cluster
    /// even though some --join peers do not answer (never when one belongs to a cluster). Give
    /// a new value each time; it is recorded in the new cluster. Not for a standing config.
    #[arg(long, value_name = "NONCE")]
    force_new_cluster: Option<String>,
    /// A voter not heard from for this long is removed by the leader while more than
    /// --min-voters voters remain (a pod scaled away). `0s` turns it off. Default 60s
    #[arg(long)]
    dead_member_timeout: Option<String>,
    /// The leader never removes dead members below this many voters. Default 3
    #[arg(long)]
    min_voters: Option<usize>,
    /// Shared secret peers must present (x-raftlock-cluster-token). Required when the peer
    /// listener is not on loopback, unless --insecure.
    #[arg(long)]
    cluster_token: Option<String>,
    /// Peer-port mutual TLS: this node's certificate chain (PEM). With --peer-tls-key and
    /// --peer-tls-ca; the files are reloaded when they change. `{id}` in the path stands for
    /// the node id (`/etc/raftlock/peer-tls/node-{id}.pem`).
    #[arg(long)]
    peer_tls_cert: Option<String>,
    /// Peer-port mutual TLS: the key of --peer-tls-cert (PEM).
    #[arg(long)]
    peer_tls_key: Option<String>,
    /// Peer-port mutual TLS: the CA bundle other nodes' certificates must chain to (PEM).
    #[arg(long)]
    peer_tls_ca: Option<String>,
    /// The DNS name a node's certificate carries, {id} standing for its node id. Default
    /// node-{id}.raftlock
    #[arg(long)]
    peer_tls_node_name: Option<String>,
    /// The DNS name an operator's certificate carries (membership changes and the peer list,
    /// never a node's powers). Default operator.raftlock
    #[arg(long)]
    peer_tls_operator_name: Option<String>,
    /// Client-port TLS: certificate chain (PEM), with --client-tls-key; reloaded on change.
    #[arg(long)]
    client_tls_cert: Option<String>,
    /// Client-port TLS: the key of --client-tls-cert (PEM).
    #[arg(long)]
    client_tls_key: Option<String>,
    /// Client-port TLS: require client certificates from this CA bundle (PEM).
    #[arg(long)]
    client_tls_ca: Option<String>,
    /// Run with the peer port open beyond this host and no cluster token (anyone who reaches it
    /// can join the cluster or remove members). For throwaway clusters only.
    #[arg(long)]
    insecure: bool,
    /// Accept bearer tokens that are JWTs signed (HS256) with the key in this file (at least 32
    /// bytes), carrying the identity (`sub`), `exp` and `raftlock.prefixes/operations/admin`;
    /// `lockctl token` makes them. Alone or with --client-auth-file.
    #[arg(long)]
    client_jwt_key_file: Option<String>,
    /// Signed client tokens must carry this issuer (`iss`).
    #[arg(long)]
    client_jwt_issuer: Option<String>,
    /// Signed client tokens must name this audience (`aud`); without it `aud` is not checked.
    #[arg(long)]
    client_jwt_audience: Option<String>,
    /// Refuse signed client tokens that expire further ahead than this (e.g. 24h).
    #[arg(long)]
    client_jwt_max_lifetime: Option<String>,
    /// Identities, their bearer tokens and rights on the client port (JSON; see
    /// docs/security.md). Without it the client port takes requests from anyone.
    #[arg(long)]
    client_auth_file: Option<String>,
    /// A secret shared with the data store: grants and renewals then carry a MAC of their
    /// fencing token, which the data store checks (`data-store --fencing-key-file`).
    #[arg(long)]
    fencing_key_file: Option<String>,
    /// Raft tick. Default 10ms
    #[arg(long)]
    tick: Option<String>,
    /// Minimum election timeout in ticks (randomized up to twice this). Default 50 (500 ms)
    #[arg(long)]
    election_ticks: Option<u32>,
    /// Heartbeat interval in ticks. Default 5 (50 ms)
    #[arg(long)]
    heartbeat_ticks: Option<u32>,
    /// Snapshot and compact the log every this many applied entries. Default 100000
    #[arg(long)]
    snapshot_entries: Option<u64>,
    /// ... or after this many bytes of log were appended since the last one. Default 67108864
    #[arg(long)]
    snapshot_bytes: Option<u64>,
    /// Cancel queued waiters whose client has been gone this long. Default 10s
    #[arg(long)]
    waiter_reclaim: Option<String>,
    /// Maximum client connections. Default 10000
    #[arg(long)]
    max_connections: Option<usize>,
    /// Maximum client connections from one source address. Default 2500
    #[arg(long)]
    max_connections_per_address: Option<usize>,
    /// Bytes of keys and values the key-value data may hold, in all (replicated). Default
    /// 67108864 (64 MiB)
    #[arg(long)]
    max_data_bytes: Option<u64>,
    /// Bytes held locks and queued acquires may take, in all (replicated). Default 268435456
    /// (256 MiB)
    #[arg(long)]
    max_lock_bytes: Option<u64>,
    /// With client authentication: locks one identity may hold and wait for. Default 250000
    #[arg(long)]
    identity_max_locks: Option<u64>,
    /// With client authentication: acquires one identity may have queued. Default 250000
    #[arg(long)]
    identity_max_waiters: Option<u64>,
    /// With client authentication: client sessions one identity may have open. Default 2500
    #[arg(long)]
    identity_max_sessions: Option<u64>,
    /// Maximum requests in flight per client connection. Default 1024
    #[arg(long)]
    max_inflight_per_connection: Option<usize>,
    /// Requests one WebSocket frame may carry as a JSON array, each its own request with its
    /// own answer (the SDK sends the requests that are ready together so); 1 takes no
    /// batches. Default 64
    #[arg(long)]
    max_batch: Option<usize>,
    /// Maximum bytes of one client or peer message. Default 1048576
    #[arg(long)]
    max_message_bytes: Option<usize>,
    /// Maximum key length in bytes. Default 512
    #[arg(long)]
    max_key_bytes: Option<usize>,
    /// Maximum KV value size in bytes. Default 65536
    #[arg(long)]
    max_value_bytes: Option<usize>,
    /// Maximum waiters queued on one key. Default 10000
    #[arg(long)]
    max_waiters_per_key: Option<usize>,
    /// Longest TTL a client may ask for. Default 1h
    #[arg(long)]
    max_ttl: Option<String>,
    /// TTL when a request names none. Default 10s
    #[arg(long)]
    default_ttl: Option<String>,
    /// Bound of the queue between the client API and the Raft driver. Default 65536
    #[arg(long)]
    max_pending_requests: Option<usize>,
    /// A client session (the answers kept for its request ids) closes after this long without a
    /// request from its client. Default 5m
    #[arg(long)]
    session_idle: Option<String>,
    /// Client sessions open at once. Default 10000
    #[arg(long)]
    max_sessions: Option<usize>,
    /// An answer is kept at least this long; retries within it are answered from the table.
    /// Default 1m
    #[arg(long)]
    dedupe_retain: Option<String>,
    /// Answers kept in all (the exactly-once table). Each answer is kept at least
    /// --dedupe-retain, so this caps the sustained request rate at max-answers / dedupe-retain.
    /// Default 1000000
    #[arg(long)]
    max_answers: Option<usize>,
    /// Memory sled's page cache may hold, in MiB. The node keeps its whole applied state in
    /// memory and reads the store to start, to build snapshots and to send older log entries;
    /// a larger cache keeps a second copy of the state resident. Default 64
    #[arg(long)]
    storage_cache_mb: Option<u64>,
    /// Where the Raft log is kept: sled (in the sled store with everything else) or segments
    /// (files of its own under the store's directory: an append is one write and a flush one
    /// fdatasync, without sled's I/O threads). A store keeps the engine it was written with;
    /// auto opens a store with the engine it has and gives a new one segments. Default auto
    #[arg(long)]
    raft_log_engine: Option<String>,
    /// Where storage flushes run: auto (on a thread of their own while the node is busy, so
    /// that it goes on taking, writing and replicating requests while the disk syncs; on the
    /// driver's thread when flushes do not follow each other closely), always, or never.
    /// Answers wait for the sync that covers them in every mode. Default auto
    #[arg(long)]
    background_flush: Option<String>,
    /// How long a batch of client requests may wait, before it is proposed, for the next
    /// request of the clients the node just answered, so that one flush covers theirs too (a
    /// lock's hand-off: the holder takes it again while the next holder releases it); the node
    /// learns from its waits and stops while they do not pay. 0 never waits. Default 100us
    #[arg(long)]
    commit_delay: Option<String>,
    /// How Raft messages travel to peers: plain (length-prefixed frames on the peer port; a
    /// peer that does not take them gets gRPC) or grpc. Default plain
    #[arg(long)]
    peer_stream: Option<String>,
    /// Worker threads of the runtime that serves clients; 0 for one per CPU. Default 0
    #[arg(long)]
    io_threads: Option<usize>,
    /// Log format: text or json. Default text (filter with RUST_LOG)
    #[arg(long)]
    log_format: Option<String>,
}

impl Args {
    fn overrides(&self) -> Vec<(&'static str, String)> {
        let mut o = Vec::new();
        macro_rules! put {
            ($($field:ident),*) => {$(
                if let Some(v) = &self.$field { o.push((stringify!($field), v.to_string())); }
            )*};
        }
        put!(
            node_id,
            peer_listen,
            client_listen,
            advertise_peer,
            advertise_client,
            initial_cluster,
            join,
            bootstrap_id,
            force_new_cluster,
            dead_member_timeout,
            min_voters,
            cluster_token,
            peer_tls_cert,
            peer_tls_key,
            peer_tls_ca,
            peer_tls_node_name,
            peer_tls_operator_name,
            client_tls_cert,
            client_tls_key,
            client_tls_ca,
            client_auth_file,
            client_jwt_key_file,
            client_jwt_issuer,
            client_jwt_audience,
            client_jwt_max_lifetime,
            fencing_key_file,
            tick,
            election_ticks,
            heartbeat_ticks,
            snapshot_entries,
            snapshot_bytes,
            waiter_reclaim,
            max_connections,
            max_connections_per_address,
            max_data_bytes,
            max_lock_bytes,
            identity_max_locks,
            identity_max_waiters,
            identity_max_sessions,
            max_inflight_per_connection,
            max_batch,
            max_message_bytes,
            max_key_bytes,
            max_value_bytes,
            max_waiters_per_key,
            max_ttl,
            default_ttl,
            max_pending_requests,
            session_idle,
            max_sessions,
            dedupe_retain,
            max_answers,
            storage_cache_mb,
            raft_log_engine,
            background_flush,
            commit_delay,
            peer_stream,
            io_threads,
            log_format
        );
        if let Some(dir) = &self.data_dir {
            o.push(("data_dir", dir.display().to_string()));
        }
        if self.bootstrap {
            o.push(("bootstrap", "true".into()));
        }
        if self.insecure {
            o.push(("insecure", "true".into()));
        }
        o
    }
}

/// Runs a lock node with the given command line (the first item is the program name).
pub fn lock_node_main<I, T>(argv: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = Args::parse_from(argv);
    let cfg = match NodeConfig::load(args.config.as_deref(), &args.overrides()) {
        Ok(cfg) => cfg,
        Err(err) => {
            eprintln!("lock-node: {err}");
            return ExitCode::from(2);
        }
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if cfg.io_threads > 0 {
        builder.worker_threads(cfg.io_threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("lock-node: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        // Inside the runtime: the OTLP exporter (when configured) needs it.
        let _telemetry =
            crate::telemetry::init(cfg.log_format == "json", "info", Some("lock-node"));
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        tokio::spawn(async move {
            wait_for_signal().await;
            let _ = shutdown_tx.send(true);
        });
        match crate::server::node::run(cfg, shutdown_rx).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                tracing::error!(cause = %err, "lock-node failed");
                ExitCode::FAILURE
            }
        }
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
