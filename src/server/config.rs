//! `lock-node` settings: defaults, then a TOML file (`--config`), then `RAFTLOCK_*` environment
//! variables, then command-line flags — each layer overriding the one before. Durations are
//! written like `150ms` or `10s`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::raft::NodeId;

/// The effective configuration of one lock node.
#[derive(Clone, Debug, Deserialize)]
pub struct NodeConfig {
    /// This node's id (>= 1). When 0, derived from a StatefulSet hostname `<name>-N` as N+1.
    pub node_id: NodeId,
    pub data_dir: PathBuf,
    /// Where to listen for peers (Raft and membership RPCs).
    pub peer_listen: SocketAddr,
    /// Where to listen for clients (WebSocket, gRPC and HTTP).
    pub client_listen: SocketAddr,
    /// Peer address other nodes use to reach this one (default: `peer_listen`).
    #[serde(default)]
    pub advertise_peer: String,
    /// Client address clients are redirected to (default: `client_listen`).
    #[serde(default)]
    pub advertise_client: String,
    /// Start a one-node cluster (only if the data directory is empty).
    #[serde(default)]
    pub bootstrap: bool,
    /// `1=host:8081,2=host:8082,...` — peer addresses of the initial voters.
    #[serde(default)]
    pub initial_cluster: String,
    /// `host:port[,host:port]` — peers to ask when joining a running cluster.
    #[serde(default)]
    pub join: String,
    /// With `join`: the node with this id bootstraps a new one-node cluster when its data
    /// directory is empty and none of the `join` peers knows of a cluster; every other node
    /// joins. Lets every pod of a StatefulSet run with the same flags. 0 disables.
    #[serde(default)]
    pub bootstrap_id: NodeId,
    /// A one-shot operator override: a node with an empty data directory starts a new cluster
    /// even though some `join` peers do not answer (never when one answers that it belongs to a
    /// cluster). The value is recorded in the new cluster; use a new value each time. Never a
    /// standing setting.
    #[serde(default)]
    pub force_new_cluster: String,
    /// A voter not heard from for this long is removed by the leader, while at least
    /// `min_voters` voters stay (`0s`: never).
    #[serde(deserialize_with = "duration")]
    pub dead_member_timeout: Duration,
    /// The leader removes dead members only while more voters than this remain.
    pub min_voters: usize,
    /// Shared secret every peer must present; empty disables the check, which is allowed only
    /// when the peer listener is on loopback or `insecure` is set.
    #[serde(default)]
    pub cluster_token: String,
    /// Allow a peer listener beyond loopback without a cluster token.
    #[serde(default)]
    pub insecure: bool,
    /// JSON file of client identities (`server::auth`); empty: the client port is open.
    #[serde(default)]
    pub client_auth_file: String,
    /// Peer-port mutual TLS: this node's certificate chain, its key and the CA bundle other
    /// nodes' certificates must chain to (PEM files, reloaded when they change). All three, or
    /// none: without them the peer port speaks plaintext HTTP/2.
    #[serde(default)]
    pub peer_tls_cert: String,
    #[serde(default)]
    pub peer_tls_key: String,
    #[serde(default)]
    pub peer_tls_ca: String,
    /// The DNS name (subject alternative name) a node's certificate carries, `{id}` standing
    /// for its node id: a peer may speak only for the ids its certificate names.
    #[serde(default = "default_node_name")]
    pub peer_tls_node_name: String,
    /// The DNS name an operator's certificate carries (the scale-down hook, `lockctl
    /// members`): under peer TLS it may change membership and read the peer list, but never
    /// speak for a node.
    #[serde(default = "default_operator_name")]
    pub peer_tls_operator_name: String,
    /// Client-port TLS: certificate chain and key (PEM, reloaded when they change); with
    /// `client_tls_ca`, clients must also present a certificate from that CA.
    #[serde(default)]
    pub client_tls_cert: String,
    #[serde(default)]
    pub client_tls_key: String,
    #[serde(default)]
    pub client_tls_ca: String,
    /// File holding the HS256 key of signed client tokens (JWTs); empty: no JWTs.
    #[serde(default)]
    pub client_jwt_key_file: String,
    /// When set, a JWT must carry this `iss`.
    #[serde(default)]
    pub client_jwt_issuer: String,
    /// When set, a JWT must carry this `aud` (among others); when not, a JWT's `aud` is not
    /// checked.
    #[serde(default)]
    pub client_jwt_audience: String,
    /// When set (`24h`), a JWT expiring further ahead than this is refused; empty: no bound.
    #[serde(default)]
    pub client_jwt_max_lifetime: String,
    /// File holding the fencing-token MAC key shared with the data store; empty: no MACs.
    #[serde(default)]
    pub fencing_key_file: String,
    #[serde(deserialize_with = "duration")]
    pub tick: Duration,
    pub election_ticks: u32,
    pub heartbeat_ticks: u32,
    /// Take a snapshot and compact the log after this many applied entries.
    pub snapshot_entries: u64,
    /// ... or after this many bytes of log entries were appended, whichever comes first.
    pub snapshot_bytes: u64,
    /// Queued waiters whose connection has been gone longer than this are cancelled.
    #[serde(deserialize_with = "duration")]
    pub waiter_reclaim: Duration,
    pub max_connections: usize,
    /// Client connections one source address may hold open (clients behind SNAT or an ingress
    /// share one address).
    pub max_connections_per_address: usize,
    /// Bytes of keys and values the replicated key-value data may hold, in all.
    pub max_data_bytes: u64,
    /// Bytes held locks and queued acquires may take in the lock state, in all.
    pub max_lock_bytes: u64,
    /// With client authentication: locks one identity may hold and wait for, together.
    pub identity_max_locks: u64,
    /// With client authentication: acquires one identity may have queued.
    pub identity_max_waiters: u64,
    /// With client authentication: client sessions one identity may have open.
    pub identity_max_sessions: u64,
    pub max_inflight_per_connection: usize,
    /// Requests one WebSocket frame may carry as a JSON array (1: no batches).
    pub max_batch: usize,
    pub max_message_bytes: usize,
    pub max_key_bytes: usize,
    pub max_value_bytes: usize,
    pub max_waiters_per_key: usize,
    #[serde(deserialize_with = "duration")]
    pub max_ttl: Duration,
    #[serde(deserialize_with = "duration")]
    pub default_ttl: Duration,
    /// Bound of the queue from the client API to the node driver.
    pub max_pending_requests: usize,
    /// A client session (the answers remembered for its request ids) closes after this long
    /// without a request from its client.
    #[serde(deserialize_with = "duration")]
    pub session_idle: Duration,
    /// Client sessions open at once.
    pub max_sessions: usize,
    /// An answer is remembered at least this long after it was given (retries within it are
    /// always answered from the table).
    #[serde(deserialize_with = "duration")]
    pub dedupe_retain: Duration,
    /// Answers kept in all (the exactly-once table's bound).
    pub max_answers: usize,
    /// Memory sled's page cache may hold, in MiB (the applied state is in memory anyway).
    pub storage_cache_mb: u64,
    /// Where the Raft log is kept: `sled` (with the rest of the store), `segments` (files
    /// of its own beside it) or `auto` (the engine a written store has, segments for a new one).
    pub raft_log_engine: String,
    /// Where flushes run: `auto` (on a thread of their own while the node is busy, so that it
    /// goes on taking and writing requests meanwhile; on the driver's thread otherwise),
    /// `always` (on their own thread) or `never` (on the driver's thread). Answers wait for the
    /// flush that covers them in every mode.
    pub background_flush: String,
    /// How long a batch of client requests may wait for the next request of the clients just
    /// answered (0: never).
    #[serde(deserialize_with = "duration")]
    pub commit_delay: Duration,
    /// How Raft messages travel to peers: `plain` (length-prefixed protobuf frames on the peer
    /// port, falling back to gRPC for a peer that does not take them) or `grpc` (the
    /// `Peer.Raft` stream only). A node takes both kinds from its peers either way.
    pub peer_stream: String,
    /// Worker threads of the runtime that serves clients (WebSocket, gRPC, HTTP); 0 for one
    /// per CPU. The Raft driver, the peer streams and the flush thread have threads of their
    /// own besides.
    pub io_threads: usize,
    /// `text` or `json`.
    pub log_format: String,
}

pub const DEFAULTS: &[(&str, &str)] = &[
    ("node_id", "0"),
    ("data_dir", "./raftlock-data"),
    ("peer_listen", "0.0.0.0:8080"),
    ("client_listen", "0.0.0.0:50050"),
    ("tick", "10ms"),
    ("election_ticks", "50"),
    ("heartbeat_ticks", "5"),
    ("snapshot_entries", "100000"),
    ("snapshot_bytes", "67108864"),
    ("waiter_reclaim", "10s"),
    ("max_connections", "10000"),
    ("max_connections_per_address", "2500"),
    ("max_data_bytes", "67108864"),
    ("max_lock_bytes", "268435456"),
    ("identity_max_locks", "250000"),
    ("identity_max_waiters", "250000"),
    ("identity_max_sessions", "2500"),
    ("max_inflight_per_connection", "1024"),
    ("max_batch", "64"),
    ("max_message_bytes", "1048576"),
    ("max_key_bytes", "512"),
    ("max_value_bytes", "65536"),
    ("max_waiters_per_key", "10000"),
    ("max_ttl", "1h"),
    ("default_ttl", "10s"),
    ("max_pending_requests", "65536"),
    ("session_idle", "5m"),
    ("max_sessions", "10000"),
    ("dedupe_retain", "1m"),
    ("max_answers", "1000000"),
    ("storage_cache_mb", "64"),
    ("raft_log_engine", "auto"),
    ("background_flush", "auto"),
    ("commit_delay", "100us"),
    ("peer_stream", "plain"),
    ("io_threads", "0"),
    ("log_format", "text"),
    ("dead_member_timeout", "60s"),
    ("min_voters", "3"),
];

fn default_operator_name() -> String {
    crate::server::tls::DEFAULT_OPERATOR_NAME.to_string()
}

fn default_node_name() -> String {
    crate::server::tls::DEFAULT_NODE_NAME.to_string()
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(serde::de::Error::custom)
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(#[from] config::ConfigError),
    #[error("invalid setting `{setting}`: {reason}")]
    Invalid {
        setting: &'static str,
        reason: String,
    },
}

impl NodeConfig {
    /// Layers defaults, the optional TOML file, `RAFTLOCK_*` environment variables and the
    /// given overrides (from flags), then validates.
    pub fn load(
        file: Option<&std::path::Path>,
        overrides: &[(&str, String)],
    ) -> Result<Self, ConfigError> {
        let mut builder = config::Config::builder();
        for (key, value) in DEFAULTS {
            builder = builder.set_default(*key, *value)?;
        }
        if let Some(file) = file {
            builder = builder.add_source(config::File::from(file.to_path_buf()));
        }
        builder =
            builder.add_source(config::Environment::with_prefix("RAFTLOCK").try_parsing(false));
        for (key, value) in overrides {
            builder = builder.set_override(*key, value.clone())?;
        }
        let mut cfg: NodeConfig = builder.build()?.try_deserialize()?;
        if cfg.node_id == 0 {
            cfg.node_id = node_id_from_hostname().ok_or(ConfigError::Invalid {
                setting: "node_id",
                reason: "not set and the hostname does not end in -<ordinal>".into(),
            })?;
        }
        if cfg.advertise_peer.is_empty() {
            cfg.advertise_peer = cfg.peer_listen.to_string();
        }
        if cfg.advertise_client.is_empty() {
            cfg.advertise_client = cfg.client_listen.to_string();
        }
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |setting, reason: &str| {
            Err(ConfigError::Invalid {
                setting,
                reason: reason.into(),
            })
        };
        if self.heartbeat_ticks == 0 || self.election_ticks <= self.heartbeat_ticks {
            return invalid(
                "election_ticks",
                "must exceed heartbeat_ticks, which must be >= 1",
            );
        }
        if self.tick.is_zero() {
            return invalid("tick", "must be positive");
        }
        let modes = [
            self.bootstrap,
            !self.initial_cluster.is_empty(),
            !self.join.is_empty(),
        ];
        if modes.iter().filter(|&&m| m).count() > 1 {
            return invalid(
                "bootstrap",
                "choose one of --bootstrap, --initial-cluster, --join",
            );
        }
        if self.bootstrap_id != 0 && self.join.is_empty() {
            return invalid(
                "bootstrap_id",
                "needs --join (the peers asked whether a cluster already exists)",
            );
        }
        self.initial_members()?;
        if self.max_answers == 0 {
            return invalid(
                "max_answers",
                "must be positive (it bounds the answers kept for retries)",
            );
        }
        if !(1..=1 << 20).contains(&self.storage_cache_mb) {
            return invalid(
                "storage_cache_mb",
                "must be between 1 and 1048576 (MiB of sled's page cache)",
            );
        }
        if let Err(problem) = self.raft_log_engine.parse::<crate::storage::LogEngine>() {
            return invalid("raft_log_engine", &problem);
        }
        if let Err(problem) = self.background_flush.parse::<super::driver::FlushMode>() {
            return invalid("background_flush", &problem);
        }
        if !matches!(self.peer_stream.as_str(), "plain" | "grpc") {
            return invalid("peer_stream", "must be plain or grpc");
        }
        if self.io_threads > 1024 {
            return invalid(
                "io_threads",
                "must be at most 1024 (0 for one worker thread per CPU)",
            );
        }
        if self.session_idle < Duration::from_secs(1) || self.max_sessions == 0 {
            return invalid(
                "session_idle",
                "session_idle must be at least 1s and max_sessions positive",
            );
        }
        if self.session_idle < self.dedupe_retain {
            return invalid(
                "session_idle",
                "must be at least dedupe_retain (a closing session would forget answers a client may still retry)",
            );
        }
        let peer_tls = [&self.peer_tls_cert, &self.peer_tls_key, &self.peer_tls_ca];
        let peer_tls_set = peer_tls.iter().filter(|f| !f.is_empty()).count();
        if peer_tls_set != 0 && peer_tls_set != 3 {
            return invalid(
                "peer_tls_cert",
                "peer TLS needs all of --peer-tls-cert, --peer-tls-key and --peer-tls-ca",
            );
        }
        if !self.peer_tls_node_name.contains("{id}") {
            return invalid("peer_tls_node_name", "must contain {id}");
        }
        if self.client_tls_cert.is_empty() != self.client_tls_key.is_empty()
            || (!self.client_tls_ca.is_empty() && self.client_tls_cert.is_empty())
        {
            return invalid(
                "client_tls_cert",
                "client TLS needs both --client-tls-cert and --client-tls-key (and --client-tls-ca only with them)",
            );
        }
        if self.cluster_token.is_empty()
            && peer_tls_set == 0
            && !self.peer_listen.ip().is_loopback()
            && !self.insecure
        {
            return invalid(
                "cluster_token",
                &format!(
                    "the peer port {} is reachable beyond this host with neither TLS nor a \
                     cluster token: anyone who reaches it could join the cluster or remove \
                     members. Set --peer-tls-cert/--peer-tls-key/--peer-tls-ca or \
                     --cluster-token (RAFTLOCK_CLUSTER_TOKEN) on every node, listen on \
                     loopback, or pass --insecure for a throwaway cluster",
                    self.peer_listen
                ),
            );
        }
        if self.max_connections_per_address == 0
            || self.max_data_bytes == 0
            || self.max_lock_bytes == 0
            || self.identity_max_locks == 0
            || self.identity_max_waiters == 0
            || self.identity_max_sessions == 0
        {
            return invalid(
                "max_connections_per_address",
                "per-address, byte and per-identity limits must be positive",
            );
        }
        if self.commit_delay > Duration::from_millis(1) {
            return invalid("commit_delay", "must be at most 1ms (0 never waits)");
        }
        if !(1..=1024).contains(&self.max_batch) {
            return invalid("max_batch", "must be 1 (no batches) to 1024");
        }
        if self.max_connections == 0 || self.max_message_bytes < 1024 {
            return invalid(
                "max_connections",
                "limits must be positive (max_message_bytes >= 1024)",
            );
        }
        Ok(())
    }

    /// The `--initial-cluster` voters: id -> peer address.
    pub fn initial_members(&self) -> Result<BTreeMap<NodeId, String>, ConfigError> {
        let mut members = BTreeMap::new();
        for part in self
            .initial_cluster
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let (id, addr) = part.split_once('=').ok_or(ConfigError::Invalid {
                setting: "initial_cluster",
                reason: format!("`{part}` is not id=host:port"),
            })?;
            let id: NodeId =
                id.trim()
                    .parse()
                    .ok()
                    .filter(|&id| id > 0)
                    .ok_or(ConfigError::Invalid {
                        setting: "initial_cluster",
                        reason: format!("`{id}` is not a node id >= 1"),
                    })?;
            members.insert(id, addr.trim().to_string());
        }
        if !members.is_empty() && !members.contains_key(&self.node_id) {
            return Err(ConfigError::Invalid {
                setting: "initial_cluster",
                reason: format!("does not include this node's id {}", self.node_id),
            });
        }
        Ok(members)
    }

    pub fn join_peers(&self) -> Vec<String> {
        self.join
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect()
    }
}

/// `raftlock-2` -> 3: a StatefulSet pod's ordinal plus one.
pub fn node_id_from_hostname() -> Option<NodeId> {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())?;
    ordinal_id(host.trim())
}

pub fn ordinal_id(host: &str) -> Option<NodeId> {
    let (_, ordinal) = host.rsplit_once('-')?;
    ordinal.parse::<NodeId>().ok().map(|n| n + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_and_durations() {
        let cfg = NodeConfig::load(
            None,
            &[
                ("node_id", "2".into()),
                ("cluster_token", "t".into()),
                ("tick", "20ms".into()),
                (
                    "initial_cluster",
                    "1=127.0.0.1:8081, 2=127.0.0.1:8082".into(),
                ),
            ],
        )
        .unwrap();
        assert_eq!(cfg.tick, Duration::from_millis(20));
        assert_eq!(cfg.default_ttl, Duration::from_secs(10));
        assert_eq!(cfg.initial_members().unwrap().len(), 2);
        assert_eq!(cfg.advertise_client, "0.0.0.0:50050");
    }

    #[test]
    fn sessions_must_outlive_the_answers_they_keep() {
        let err = NodeConfig::load(
            None,
            &[
                ("node_id", "1".into()),
                ("cluster_token", "t".into()),
                ("session_idle", "30s".into()),
                ("dedupe_retain", "1m".into()),
            ],
        )
        .unwrap_err();
        assert!(err.to_string().contains("session_idle"), "{err}");
        let cfg = NodeConfig::load(
            None,
            &[("node_id", "1".into()), ("insecure", "true".into())],
        )
        .unwrap();
        assert_eq!(cfg.session_idle, Duration::from_secs(300));
        assert_eq!(cfg.dedupe_retain, Duration::from_secs(60));
        assert_eq!(cfg.max_answers, 1_000_000);
        assert_eq!(
            crate::server::node::lock_limits(&cfg).dedupe_entries_max,
            1_000_000
        );
    }

    /// Node 1 without TLS, with the defaults and `settings` on top.
    fn load_with(settings: &[(&'static str, &str)]) -> Result<NodeConfig, ConfigError> {
        let mut args = vec![("node_id", "1".to_string()), ("insecure", "true".into())];
        args.extend(settings.iter().map(|&(k, v)| (k, v.to_string())));
        NodeConfig::load(None, &args)
    }

    #[test]
    fn the_answer_bound_is_positive_and_reaches_the_lock_limits() {
        let err = load_with(&[("max_answers", "0")]).unwrap_err();
        assert!(err.to_string().contains("max_answers"), "{err}");
        let cfg = load_with(&[("max_answers", "2000000")]).unwrap();
        assert_eq!(
            crate::server::node::lock_limits(&cfg).dedupe_entries_max,
            2_000_000
        );
    }

    #[test]
    fn the_raft_log_engine_defaults_to_auto_and_takes_sled_and_segments() {
        assert_eq!(load_with(&[]).unwrap().raft_log_engine, "auto");
        for engine in ["sled", "segments"] {
            let cfg = load_with(&[("raft_log_engine", engine)]).unwrap();
            assert_eq!(cfg.raft_log_engine, engine);
        }
        let err = load_with(&[("raft_log_engine", "rocksdb")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("raft_log_engine") && err.contains("rocksdb"),
            "{err}"
        );
    }

    #[test]
    fn max_batch_defaults_to_64_and_stays_within_1_to_1024() {
        assert_eq!(load_with(&[]).unwrap().max_batch, 64);
        assert_eq!(load_with(&[("max_batch", "1")]).unwrap().max_batch, 1);
        for bad in ["0", "1025"] {
            let err = load_with(&[("max_batch", bad)]).unwrap_err().to_string();
            assert!(err.contains("max_batch"), "{err}");
        }
    }

    #[test]
    fn peer_stream_defaults_to_plain_and_takes_grpc() {
        assert_eq!(load_with(&[]).unwrap().peer_stream, "plain");
        assert_eq!(
            load_with(&[("peer_stream", "grpc")]).unwrap().peer_stream,
            "grpc"
        );
        let err = load_with(&[("peer_stream", "udp")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("peer_stream") && err.contains("plain or grpc"),
            "{err}"
        );
    }

    #[test]
    fn io_threads_defaults_to_one_per_cpu_and_is_bounded() {
        assert_eq!(load_with(&[]).unwrap().io_threads, 0);
        assert_eq!(load_with(&[("io_threads", "3")]).unwrap().io_threads, 3);
        let err = load_with(&[("io_threads", "5000")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("io_threads"), "{err}");
    }

    #[test]
    fn commit_delay_defaults_to_100us_and_stays_within_1ms() {
        assert_eq!(
            load_with(&[]).unwrap().commit_delay,
            Duration::from_micros(100)
        );
        assert_eq!(
            load_with(&[("commit_delay", "0")]).unwrap().commit_delay,
            Duration::ZERO
        );
        let err = load_with(&[("commit_delay", "5ms")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("commit_delay"), "{err}");
        let err = load_with(&[("commit_delay", "soon")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("commit_delay") || err.contains("soon"),
            "{err}"
        );
    }

    #[test]
    fn background_flush_defaults_to_auto_and_takes_always_or_never() {
        assert_eq!(load_with(&[]).unwrap().background_flush, "auto");
        for mode in ["always", "never"] {
            let cfg = load_with(&[("background_flush", mode)]).unwrap();
            assert_eq!(cfg.background_flush, mode);
        }
        let err = load_with(&[("background_flush", "sometimes")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("background_flush") && err.contains("sometimes"),
            "{err}"
        );
    }

    #[test]
    fn the_storage_cache_defaults_to_64_mib_and_is_bounded() {
        assert_eq!(load_with(&[]).unwrap().storage_cache_mb, 64);
        for bad in ["0", "1048577", "lots"] {
            let err = load_with(&[("storage_cache_mb", bad)]).unwrap_err();
            assert!(err.to_string().contains("storage_cache_mb"), "{bad}: {err}");
        }
        let cfg = load_with(&[("storage_cache_mb", "1024")]).unwrap();
        assert_eq!(cfg.storage_cache_mb, 1024);
    }

    #[test]
    fn bad_settings_are_named() {
        let err = NodeConfig::load(None, &[("node_id", "1".into()), ("tick", "fast".into())])
            .unwrap_err();
        assert!(
            err.to_string().contains("tick") || err.to_string().contains("fast"),
            "{err}"
        );
        let err = NodeConfig::load(
            None,
            &[
                ("node_id", "3".into()),
                ("initial_cluster", "1=a:1,2=b:2".into()),
            ],
        )
        .unwrap_err();
        assert!(err.to_string().contains("initial_cluster"), "{err}");
    }

    #[test]
    fn an_open_peer_port_needs_a_token_or_insecure() {
        let err = NodeConfig::load(None, &[("node_id", "1".into())]).unwrap_err();
        assert!(err.to_string().contains("cluster token"), "{err}");
        for extra in [("cluster_token", "s3cret"), ("insecure", "true")] {
            let cfg = NodeConfig::load(None, &[("node_id", "1".into()), (extra.0, extra.1.into())]);
            assert!(cfg.is_ok(), "{extra:?}: {cfg:?}");
        }
        let loopback = NodeConfig::load(
            None,
            &[
                ("node_id", "1".into()),
                ("peer_listen", "127.0.0.1:8080".into()),
            ],
        );
        assert!(loopback.is_ok(), "{loopback:?}");
        let cfg = NodeConfig::load(
            None,
            &[("node_id", "1".into()), ("insecure", "false".into())],
        );
        assert!(cfg.is_err());
    }

    #[test]
    fn statefulset_ordinals() {
        assert_eq!(ordinal_id("raftlock-0"), Some(1));
        assert_eq!(ordinal_id("raftlock-12"), Some(13));
        assert_eq!(ordinal_id("raftlock"), None);
    }
}
