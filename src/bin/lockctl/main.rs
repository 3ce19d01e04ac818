//! `lockctl`: RaftLock's command-line tool — a local cluster (`up`), lock and admin commands,
//! `run` a command under a lock, a failover `demo`, and a workload `simulate`.

mod certs;
mod control;
mod local;
mod run;
mod simulate;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use raftlock::client::http::get_json_with;
use raftlock::client::{AdminClient, ClientError, RaftLockClient, TlsConfig};
use raftlock::server::proto::peer::peer_client::PeerClient;
use raftlock::server::proto::peer::{JoinClusterRequest, RemoveServerRequest};
use raftlock::server::tls::{PeerTls, TlsFiles};
use raftlock::server::transport::PeerDialer;
use serde_json::{json, Value};

use local::{LocalCluster, Ports, INTERNAL_DATA_STORE, INTERNAL_LOCK_NODE};

const DEFAULT_ENDPOINTS: &str = "127.0.0.1:50051,127.0.0.1:50052,127.0.0.1:50053";

#[derive(Parser, Debug)]
#[command(name = "lockctl", version, about = "RaftLock command-line tool")]
struct Args {
    /// Output format: table (aligned columns for people; the default), json (one JSON value per
    /// line, for scripts) or yaml (one YAML document each). `human` is another name for table.
    #[arg(long, global = true, value_parser = ["table", "json", "yaml", "human"])]
    output: Option<String>,
    /// Client addresses of the cluster (any node; the leader is found automatically).
    #[arg(long, global = true, env = "RAFTLOCK_ENDPOINTS", default_value = DEFAULT_ENDPOINTS, value_delimiter = ',')]
    endpoints: Vec<String>,
    /// Client id (default: lockctl-<hostname>-<pid>, unique per invocation). A lock taken by
    /// `acquire` is held by an owner id derived from it, which `acquire` prints: pass that as
    /// --client-id to `release` and `renew`.
    #[arg(long, global = true, env = "RAFTLOCK_CLIENT_ID")]
    client_id: Option<String>,
    /// Bearer token for a cluster that authenticates its clients (`lock-node
    /// --client-auth-file`). Prefer the environment variable: a flag shows in `ps`.
    #[arg(
        long,
        global = true,
        env = "RAFTLOCK_AUTH_TOKEN",
        hide_env_values = true
    )]
    auth_token: Option<String>,
    /// CA bundle (PEM) that signed the nodes' client-port certificates: connect with TLS
    /// (wss://, https) and trust only these CAs.
    #[arg(long, global = true, env = "RAFTLOCK_TLS_CA")]
    tls_ca: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a local cluster of N lock nodes and the data store in the foreground. Node i listens
    /// on peer port 8080+i and client port 50050+i, the data store on 8000. Starting again with
    /// the same --data-dir resumes the same cluster. A node that exits (or is killed) is
    /// reported and the others keep running; `lockctl node` stops and starts nodes from another
    /// terminal. Stops everything on Ctrl-C or SIGTERM.
    Up {
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=7))]
        nodes: u64,
        #[arg(long, default_value = "./raftlock-dev")]
        data_dir: PathBuf,
        #[arg(long, default_value_t = 8000)]
        data_store_port: u16,
        /// Node i's peer port is this plus i.
        #[arg(long, default_value_t = 8080)]
        peer_port_base: u16,
        /// Node i's client port is this plus i.
        #[arg(long, default_value_t = 50050)]
        client_port_base: u16,
    },
    /// Stop, kill, start or restart node N of the `lockctl up` running on --data-dir.
    Node {
        #[command(subcommand)]
        action: NodeCmd,
    },
    /// Acquire a lock and print its fencing token. The lock stays held until released or until
    /// its TTL passes.
    Acquire {
        key: String,
        /// Lease length, e.g. 30s.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// Wait at most this long in the queue (default: do not wait).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<Duration>,
    },
    /// Release a lock held with TOKEN (--client-id: the owner id `acquire` printed).
    Release {
        key: String,
        #[arg(long)]
        token: u64,
    },
    /// Extend a held lock's lease (--client-id: the owner id `acquire` printed).
    Renew {
        key: String,
        #[arg(long)]
        token: u64,
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        ttl: Duration,
    },
    /// Show a node's view of the cluster.
    Status {
        /// Ask this node (default: the first endpoint).
        #[arg(long)]
        endpoint: Option<String>,
    },
    /// List, add or remove cluster members.
    Members {
        #[command(subcommand)]
        action: MembersCmd,
    },
    /// List held locks and their waiters.
    Locks {
        #[arg(long, default_value = "")]
        prefix: String,
    },
    /// Follow lock events (granted, queued, released, expired, renewed, cancelled, leader
    /// changes) under a key prefix as they happen; resumes by itself after a lost connection.
    Watch {
        /// Key prefix (default: every key).
        #[arg(default_value = "")]
        prefix: String,
        /// Start after this log index (the events since, while the nodes still keep them)
        /// instead of now.
        #[arg(long)]
        from_index: Option<u64>,
        /// Stop after this many events (default: run until interrupted).
        #[arg(long)]
        count: Option<u64>,
        /// Stop after this long (e.g. `30s`).
        #[arg(long, value_parser = humantime::parse_duration)]
        timeout: Option<Duration>,
    },
    /// Read or write the replicated key-value store.
    Kv {
        #[command(subcommand)]
        action: KvCmd,
    },
    /// Run CMD while holding KEY, renewing in the background. The command gets RAFTLOCK_KEY,
    /// RAFTLOCK_FENCING_TOKEN, RAFTLOCK_FENCING_MAC and RAFTLOCK_CLIENT_ID (the lock's owner id); its whole process group is killed before
    /// the lease could lapse if the lock is lost. Exits with the command's status, 75 if the
    /// lock was not acquired within --wait, 76 if the lock was lost, 78 on other errors.
    Run {
        key: String,
        #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// Wait at most this long for the lock (default: wait indefinitely).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<Duration>,
        /// The command and its arguments (after `--`); run directly, not through a shell.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Start a throwaway 3-node cluster and data store, run contending clients that write with
    /// their tokens, SIGKILL the leader half-way, and check that no stale write was accepted.
    Demo {
        #[arg(long, default_value_t = 8)]
        clients: usize,
        #[arg(long, default_value_t = 3)]
        keys: usize,
        #[arg(long, default_value = "12s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Ports: peers base+1.., clients base+11.., data store base+20.
        #[arg(long, default_value_t = 18000)]
        port_base: u16,
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Many clients contending for a few keys against a running cluster, with a progress bar
    /// and a summary (throughput, wait-time percentiles, grants per client).
    Simulate {
        #[arg(long, default_value_t = 16)]
        clients: usize,
        #[arg(long, default_value_t = 4)]
        keys: usize,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: Duration,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// How long each client holds a lock before releasing it.
        #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
        hold: Duration,
    },
    /// Print a shell completion script, e.g. `lockctl completions bash >
    /// /etc/bash_completion.d/lockctl` or `lockctl completions zsh > "${fpath[1]}/_lockctl"`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff), e.g. `lockctl man > /usr/local/share/man/man1/lockctl.1`.
    Man,
    /// Print a signed client token (an HS256 JWT) for nodes run with --client-jwt-key-file:
    /// `RAFTLOCK_AUTH_TOKEN=$(lockctl token --key-file jwt.key --sub billing --prefixes billing/
    /// --operations acquire,release,renew --ttl 8h)`.
    Token {
        /// The nodes' JWT key file.
        #[arg(long)]
        key_file: PathBuf,
        /// The identity (the lock holder's name).
        #[arg(long)]
        sub: String,
        /// Key prefixes the token allows (`""` for every key).
        #[arg(long, value_delimiter = ',')]
        prefixes: Vec<String>,
        /// Operations it allows: acquire, release, renew, cancel, read, write.
        #[arg(long, value_delimiter = ',')]
        operations: Vec<String>,
        /// Every operation on every key, and fencing tokens in listings.
        #[arg(long)]
        admin: bool,
        /// How long the token is valid.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: Duration,
    },
    /// Write two CAs and the TLS certificates of a cluster. The peer CA (ca.pem) signs one
    /// certificate per node (peer mutual TLS, named after the node id), the operator
    /// certificate (operator.pem, for `lockctl members` and the chart's scale-down hook) and the
    /// client port's certificate; the client CA (client-ca.pem) signs the client certificate
    /// (client.pem, for a client port started with --client-tls-ca client-ca.pem). CAs already
    /// in --out are kept, so running it again rotates the other certificates under the same
    /// CAs. Keys are written mode 0600; keep ca-key.pem and client-ca-key.pem off the nodes.
    Certs {
        #[arg(long, default_value = "./raftlock-certs")]
        out: PathBuf,
        /// Node ids to issue certificates for: `1,2,3`.
        #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
        nodes: Vec<u64>,
        /// The name a node's certificate carries; must match the nodes' --peer-tls-node-name.
        #[arg(long, default_value = "node-{id}.raftlock")]
        node_name: String,
        /// The DNS name of the operator certificate; must match the nodes'
        /// --peer-tls-operator-name.
        #[arg(long, default_value = certs::DEFAULT_OPERATOR_NAME)]
        operator_name: String,
        /// Host names and IP addresses the nodes are reached at (added to every node's and the
        /// client port's certificate, never to the operator's): `127.0.0.1,raftlock.example.com`.
        /// A host that is a node name or the operator name is refused.
        #[arg(long, value_delimiter = ',', default_value = "127.0.0.1,localhost")]
        hosts: Vec<String>,
        /// Days the node, operator and client certificates stay valid (a new CA: five times as
        /// long).
        #[arg(long, default_value_t = 90)]
        valid_days: u32,
    },
}

#[derive(Subcommand, Debug)]
enum MembersCmd {
    /// List members with their roles and addresses.
    List,
    /// Add a server as a learner (it is promoted once caught up). Talks to a peer port.
    Add {
        #[arg(long)]
        id: u64,
        /// The new server's peer address.
        #[arg(long)]
        peer_addr: String,
        /// The new server's client address (for redirects).
        #[arg(long, default_value = "")]
        client_addr: String,
        /// Any member's peer address.
        #[arg(long, default_value = "127.0.0.1:8081")]
        via: String,
        #[command(flatten)]
        peer: PeerAccess,
    },
    /// Remove a server from the cluster (the leader too: it steps down). Under peer mutual TLS
    /// it needs the operator certificate (--peer-tls-cert operator.pem).
    Remove {
        #[arg(long)]
        id: u64,
        #[arg(long, default_value = "127.0.0.1:8081")]
        via: String,
        #[command(flatten)]
        peer: PeerAccess,
    },
}

/// How `lockctl members` reaches a peer port: the cluster token, and under peer mutual TLS a
/// certificate from the cluster's peer CA: the operator certificate (`operator.pem` from
/// `lockctl certs`, DNS name `operator.raftlock`), which may act for any node id. `add` may also
/// use the new node's own certificate, which names its id.
#[derive(clap::Args, Debug)]
struct PeerAccess {
    #[arg(
        long,
        env = "RAFTLOCK_CLUSTER_TOKEN",
        default_value = "",
        hide_env_values = true
    )]
    cluster_token: String,
    /// Peer mutual TLS: the operator certificate (PEM; `operator.pem` from `lockctl certs`, or
    /// any certificate from the peer CA naming the nodes' --peer-tls-operator-name). A node's
    /// certificate acts only for its own node id: enough for `add` of that node, not to remove
    /// another member.
    #[arg(long, env = "RAFTLOCK_PEER_TLS_CERT", requires_all = ["peer_tls_key", "peer_tls_ca"])]
    peer_tls_cert: Option<PathBuf>,
    /// Peer mutual TLS: the key of --peer-tls-cert (PEM; `operator-key.pem`).
    #[arg(long, env = "RAFTLOCK_PEER_TLS_KEY")]
    peer_tls_key: Option<PathBuf>,
    /// Peer mutual TLS: the peer CA bundle that signed the nodes' certificates (PEM; `ca.pem`,
    /// not `client-ca.pem`).
    #[arg(long, env = "RAFTLOCK_PEER_TLS_CA")]
    peer_tls_ca: Option<PathBuf>,
}

impl PeerAccess {
    fn dialer(&self) -> Result<PeerDialer, String> {
        let tls = match (&self.peer_tls_cert, &self.peer_tls_key, &self.peer_tls_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(
                PeerTls::load(
                    TlsFiles {
                        cert: cert.clone(),
                        key: key.clone(),
                        ca: Some(ca.clone()),
                    },
                    raftlock::server::tls::DEFAULT_NODE_NAME,
                    None,
                )
                .map_err(|e| e.to_string())?,
            ),
            (None, None, None) => None,
            _ => {
                return Err("--peer-tls-cert, --peer-tls-key and --peer-tls-ca go together".into())
            }
        };
        Ok(PeerDialer {
            cluster_token: self.cluster_token.clone(),
            tls,
            // An operator tool: under peer TLS it presents an operator's certificate.
            from_node: 0,
        })
    }
}

/// A peer-port client for `target`, through `dialer`.
async fn peer_client(
    dialer: &PeerDialer,
    target: &str,
) -> Result<PeerClient<tonic::transport::Channel>, String> {
    let endpoint = PeerDialer::endpoint(target)
        .map_err(|e| format!("bad address {target}: {e}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10));
    dialer
        .connect(endpoint, None)
        .await
        .map(PeerClient::new)
        .map_err(|e| format!("cannot reach {target}: {e}"))
}

#[derive(Subcommand, Debug)]
enum NodeCmd {
    /// SIGTERM: a clean shutdown (a leader hands over).
    Stop(NodeTarget),
    /// SIGKILL: no flush, no hand-over — to watch a failover.
    Kill(NodeTarget),
    /// Start a stopped node again with the same data directory and ports, as a child of `up`.
    Start(NodeTarget),
    /// Stop (SIGTERM), then start.
    Restart(NodeTarget),
}

#[derive(clap::Args, Debug)]
struct NodeTarget {
    /// The node id (1..=N).
    id: u64,
    /// The --data-dir `lockctl up` was started with.
    #[arg(long, default_value = "./raftlock-dev")]
    data_dir: PathBuf,
}

#[derive(Subcommand, Debug)]
enum KvCmd {
    /// Linearizable read.
    Get { key: String },
    /// Write; with --guard-key/--guard-token only while that token holds that lock.
    Put {
        key: String,
        value: String,
        #[arg(long, requires = "guard_token")]
        guard_key: Option<String>,
        #[arg(long, requires = "guard_key")]
        guard_token: Option<u64>,
    },
}

fn main() -> ExitCode {
    // `lockctl up` runs its nodes and data store as child processes of this same executable, so
    // `cargo run --bin lockctl -- up` needs no other binary built first.
    let mut argv = std::env::args_os();
    let _program = argv.next();
    match argv.next().as_ref().and_then(|a| a.to_str()) {
        Some(INTERNAL_LOCK_NODE) => {
            return raftlock::server::cli::lock_node_main(
                std::iter::once("lock-node".into()).chain(argv),
            )
        }
        Some(INTERNAL_DATA_STORE) => {
            return raftlock::datastore::cli::data_store_main(
                std::iter::once("data-store".into()).chain(argv),
            )
        }
        _ => {}
    }
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("lockctl: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(dispatch(args))
}

fn make_client(args: &Args) -> Result<RaftLockClient, ClientError> {
    let mut b = RaftLockClient::builder().endpoints(args.endpoints.iter().cloned());
    let id = args.client_id.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default();
        let host = if host.is_empty() { "local" } else { &host };
        format!("lockctl-{host}-{}", std::process::id())
    });
    b = b.client_id(id);
    if let Some(token) = &args.auth_token {
        b = b.auth_token(token.clone());
    }
    if let Some(ca) = &args.tls_ca {
        b = b.tls_ca_file(ca.clone());
    }
    // OpenTelemetry's convention for passing trace context to a command: the TRACEPARENT
    // environment variable. The requests of this command then join that trace.
    if let Ok(tp) = std::env::var("TRACEPARENT") {
        if raftlock::client::is_traceparent(&tp) {
            b = b.trace_context(move || Some(tp.clone()));
        } else {
            eprintln!(
                "lockctl: ignoring TRACEPARENT {tp:?}: not a W3C traceparent \
                 (00-<32 hex trace id>-<16 hex span id>-<2 hex flags>)"
            );
        }
    }
    b.build()
}

/// One watch event for people: `index  event  key  client  details`.
fn watch_line(e: &raftlock::client::WatchEvent) -> String {
    if e.event == "leader" && e.leader_id.unwrap_or(0) == 0 {
        return format!(
            "{:>8}  {:<9}  no leader: an election in term {}",
            e.index,
            e.event,
            e.term.unwrap_or(0)
        );
    }
    if e.event == "leader" {
        return format!(
            "{:>8}  {:<9}  node {} leads (term {})",
            e.index,
            e.event,
            e.leader_id.unwrap_or(0),
            e.term.unwrap_or(0)
        );
    }
    let mut detail = String::new();
    if let Some(t) = e.token {
        detail.push_str(&format!("token {t}"));
    }
    if let Some(p) = e.position {
        detail.push_str(&format!("position {p}"));
    }
    format!(
        "{:>8}  {:<9}  {:<24}  {:<24}  {detail}",
        e.index,
        e.event,
        e.key.as_deref().unwrap_or(""),
        e.client.as_deref().unwrap_or("")
    )
}

fn fail(e: impl std::fmt::Display) -> ExitCode {
    let message = e.to_string();
    eprintln!("lockctl: {message}");
    if let Some(hint) = hint(&message) {
        eprintln!("hint: {hint}");
    }
    ExitCode::FAILURE
}

/// What to do next about an error, when its text says enough to tell.
fn hint(message: &str) -> Option<&'static str> {
    let has = |needle: &str| message.contains(needle);
    Some(if has("UNAUTHENTICATED") {
        "this cluster authenticates clients: set RAFTLOCK_AUTH_TOKEN (or --auth-token) to a token \
         from the cluster's client auth file"
    } else if has("PERMISSION_DENIED") {
        "your identity may not do this on this key: use a key under its prefixes, or ask the \
         operator to grant the operation in the client auth file"
    } else if has("NOT_HOLDER") {
        "release and renew as the lock's owner: pass --client-id with the owner id that \
         `lockctl acquire` printed"
    } else if has("STALE_TOKEN") {
        "the token no longer holds the lock (released, expired or superseded): see \
         `lockctl locks` for the current holder and token"
    } else if has("WAIT_TIMEOUT") || has("not granted within") {
        "someone else holds the lock: wait longer with --wait, or see `lockctl locks` for the \
         holder"
    } else if has("ALREADY_HELD") {
        "this client id already holds the lock: release it first, or use another --client-id"
    } else if has("REQUEST_ID_REUSED") {
        "a request id names one operation: retry with a fresh one"
    } else if has("ACKNOWLEDGED") {
        "the cluster had already answered this request and was told so: another process is \
         probably numbering its requests under the same client id; give each its own --client-id"
    } else if has("invalid peer certificate") || has("UnknownIssuer") || has("NotValidForName") {
        "the node's TLS certificate is not trusted: pass --tls-ca (RAFTLOCK_TLS_CA) with the CA \
         that signed it, and dial a name or address the certificate carries"
    } else if has("InvalidContentType") || has("corrupt message") {
        "the node does not speak TLS on this port: drop --tls-ca (RAFTLOCK_TLS_CA)"
    } else if has("malformed HTTP response")
        || has("httparse")
        || has("Handshake not finished")
        || has("Connection reset")
    {
        "the node may speak TLS on its client port: pass --tls-ca (RAFTLOCK_TLS_CA) with the CA \
         of its certificate"
    } else if has("Connection refused")
        || has("cannot connect")
        || has("timed out")
        || has("gave up after")
    {
        "no node answered: is the cluster running (`lockctl up` starts a local one)? Point \
         --endpoints or RAFTLOCK_ENDPOINTS at its client ports (default 127.0.0.1:50051-50053)"
    } else if has("NO_LEADER") || has("UNAVAILABLE") {
        "the cluster has no leader right now (a majority of nodes must be up): check \
         `lockctl status` and retry"
    } else if has("TOO_LARGE") {
        "a key, value or id is over the node's limit (`lock-node --help` lists the limits)"
    } else {
        return None;
    })
}

/// `--output yaml`: machine output is YAML instead of JSON.
static YAML: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Prints a value for scripts: one line of JSON, or a YAML document with `--output yaml`.
fn print_machine(value: &Value) {
    if YAML.load(std::sync::atomic::Ordering::Relaxed) {
        match serde_yaml_ng::to_string(value) {
            Ok(text) => print!("---\n{text}"),
            Err(_) => println!("{value}"),
        }
    } else {
        println!("{value}");
    }
}

fn emit(json_out: bool, value: Value, human: impl FnOnce()) {
    if json_out {
        print_machine(&value);
    } else {
        human();
    }
}

async fn dispatch(args: Args) -> ExitCode {
    let json_out = matches!(args.output.as_deref(), Some("json" | "yaml"));
    if args.output.as_deref() == Some("yaml") {
        YAML.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let first = args.endpoints.first().cloned().unwrap_or_default();
    match &args.command {
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            let mut command = Args::command();
            clap_complete::generate(*shell, &mut command, "lockctl", &mut std::io::stdout());
            ExitCode::SUCCESS
        }
        Cmd::Token {
            key_file,
            sub,
            prefixes,
            operations,
            admin,
            ttl,
        } => match make_token(key_file, sub, prefixes, operations, *admin, *ttl) {
            Ok(token) => {
                println!("{token}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        Cmd::Certs {
            out,
            nodes,
            node_name,
            operator_name,
            hosts,
            valid_days,
        } => {
            let request = certs::CertsRequest {
                out,
                nodes,
                node_name,
                operator_name,
                hosts,
                valid_days: *valid_days,
            };
            match certs::generate(&request) {
                Ok(written) => {
                    for path in written {
                        println!("{}", path.display());
                    }
                    eprintln!(
                        "ca-key.pem and client-ca-key.pem only issue certificates: keep them off \
                         the nodes and out of every Secret (docs/security.md)"
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        Cmd::Man => {
            use clap::CommandFactory;
            let page = clap_mangen::Man::new(Args::command());
            match page.render(&mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("lockctl man: could not write the page: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::Up {
            nodes,
            data_dir,
            data_store_port,
            peer_port_base,
            client_port_base,
        } => {
            let ports = Ports {
                peer_base: *peer_port_base,
                client_base: *client_port_base,
                data_store: *data_store_port,
            };
            up(*nodes, data_dir, ports).await
        }
        Cmd::Node { action } => {
            let (t, a) = match action {
                NodeCmd::Stop(t) => (t, control::NodeAction::Stop),
                NodeCmd::Kill(t) => (t, control::NodeAction::Kill),
                NodeCmd::Start(t) => (t, control::NodeAction::Start),
                NodeCmd::Restart(t) => (t, control::NodeAction::Restart),
            };
            let (dir, id) = (t.data_dir.clone(), t.id);
            tokio::task::spawn_blocking(move || control::node(&dir, id, a))
                .await
                .unwrap_or(ExitCode::FAILURE)
        }
        Cmd::Status { endpoint } => match tls_config(&args) {
            Ok(tls) => {
                show(
                    endpoint.as_deref().unwrap_or(&first),
                    "/status",
                    json_out,
                    tls.as_ref(),
                )
                .await
            }
            Err(e) => fail(e),
        },
        Cmd::Watch {
            prefix,
            from_index,
            count,
            timeout,
        } => {
            let client = match make_client(&args) {
                Ok(c) => c,
                Err(e) => return fail(e),
            };
            let mut watch = match client.watch(prefix, *from_index).await {
                Ok(w) => w,
                Err(e) => return fail(e),
            };
            let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
            let mut seen = 0u64;
            while count.is_none_or(|c| seen < c) {
                let next = match deadline {
                    Some(d) => match tokio::time::timeout_at(d, watch.next()).await {
                        Ok(n) => n,
                        Err(_) => break,
                    },
                    None => watch.next().await,
                };
                match next {
                    Some(Ok(e)) => {
                        seen += 1;
                        let value = json!({"event": e.event, "index": e.index, "key": e.key,
                                           "client": e.client, "token": e.token,
                                           "position": e.position, "leaderId": e.leader_id,
                                           "term": e.term});
                        emit(json_out, value, || println!("{}", watch_line(&e)));
                    }
                    Some(Err(e)) => return fail(e),
                    None => break,
                }
            }
            ExitCode::SUCCESS
        }
        Cmd::Locks { prefix } => match admin_client(&args) {
            Ok(admin) => match admin.locks(prefix).await {
                Ok(v) => {
                    emit(json_out, v.clone(), || print_table(&locks_table(&v)));
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            },
            Err(e) => fail(e),
        },
        Cmd::Members { action } => members(&args, action, json_out).await,
        Cmd::Acquire { key, ttl, wait } => {
            let client = match make_client(&args) {
                Ok(c) => c,
                Err(e) => return fail(e),
            };
            match client
                .try_acquire(key, *ttl, wait.unwrap_or(Duration::ZERO))
                .await
            {
                Ok(Some(lock)) => {
                    let token = lock.fencing_token();
                    let mac = lock.fencing_mac().map(String::from);
                    // The holder's identity: `release` and `renew` need it as --client-id.
                    let owner = lock.owner_id().to_string();
                    std::mem::forget(lock); // stays held after lockctl exits
                    let mut out = json!({"acquired": true, "key": key, "fencingToken": token,
                                         "clientId": owner, "ttlMs": ttl.as_millis() as u64});
                    if let Some(mac) = mac {
                        out["fencingMac"] = json!(mac);
                    }
                    emit(json_out, out, || {
                        println!(
                            "acquired {key}: fencing token {token}, client id {owner}, ttl {}",
                            humantime::format_duration(*ttl)
                        )
                    });
                    ExitCode::SUCCESS
                }
                Ok(None) => {
                    emit(json_out, json!({"acquired": false, "key": key}), || {
                        println!("{key} is held by someone else")
                    });
                    ExitCode::from(run::EXIT_NOT_ACQUIRED)
                }
                Err(e) => fail(e),
            }
        }
        Cmd::Release { key, token } => match make_client(&args) {
            Ok(c) => match c.release(key, *token).await {
                Ok(()) => {
                    emit(json_out, json!({"released": true, "key": key}), || {
                        println!("released {key}")
                    });
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            },
            Err(e) => fail(e),
        },
        Cmd::Renew { key, token, ttl } => match make_client(&args) {
            Ok(c) => match c.renew(key, *token, *ttl).await {
                Ok(_) => {
                    emit(json_out, json!({"renewed": true, "key": key}), || {
                        println!("renewed {key} for {}", humantime::format_duration(*ttl))
                    });
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            },
            Err(e) => fail(e),
        },
        Cmd::Kv { action } => {
            let client = match make_client(&args) {
                Ok(c) => c,
                Err(e) => return fail(e),
            };
            match action {
                KvCmd::Get { key } => match client.get(key).await {
                    Ok(v) => {
                        emit(json_out, json!({"key": key, "value": v}), || match &v {
                            Some(v) => println!("{v}"),
                            None => println!("(not set)"),
                        });
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(e),
                },
                KvCmd::Put {
                    key,
                    value,
                    guard_key,
                    guard_token,
                } => {
                    let guard = guard_key.as_deref().zip(*guard_token);
                    match client.put(key, value, guard).await {
                        Ok(()) => {
                            emit(json_out, json!({"stored": true, "key": key}), || {
                                println!("stored {key}")
                            });
                            ExitCode::SUCCESS
                        }
                        Err(e) => fail(e),
                    }
                }
            }
        }
        Cmd::Run {
            key,
            ttl,
            wait,
            command,
        } => {
            let client = match make_client(&args) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("lockctl run: {e}");
                    return ExitCode::from(run::EXIT_ERROR);
                }
            };
            run::run(
                client,
                run::RunArgs {
                    key: key.clone(),
                    ttl: *ttl,
                    wait: *wait,
                    command: command.clone(),
                },
            )
            .await
        }
        Cmd::Demo {
            clients,
            keys,
            duration,
            port_base,
            data_dir,
        } => {
            simulate::demo(simulate::DemoArgs {
                clients: *clients,
                keys: (*keys).max(1),
                duration: *duration,
                dir: data_dir.clone(),
                port_base: *port_base,
            })
            .await
        }
        Cmd::Simulate {
            clients,
            keys,
            duration,
            ttl,
            hold,
        } => {
            simulate::simulate(simulate::SimulateArgs {
                endpoints: args.endpoints.clone(),
                clients: *clients,
                keys: *keys,
                duration: *duration,
                ttl: *ttl,
                hold: *hold,
                json: json_out,
            })
            .await
        }
    }
}

async fn members(args: &Args, action: &MembersCmd, json_out: bool) -> ExitCode {
    match action {
        MembersCmd::List => match admin_client(args) {
            Ok(admin) => match admin.members().await {
                Ok(v) => {
                    if json_out {
                        print_machine(&v);
                    } else {
                        print_table(
                            &members_table(&v, tls_config(args).ok().flatten().as_ref()).await,
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            },
            Err(e) => fail(e),
        },
        MembersCmd::Add {
            id,
            peer_addr,
            client_addr,
            via,
            peer,
        } => {
            // Certificates are read once, not on every hop to the leader.
            let dialer = match peer.dialer() {
                Ok(d) => d,
                Err(e) => return fail(e),
            };
            let mut target = via.clone();
            for _ in 0..5 {
                let req = JoinClusterRequest {
                    server_id: *id,
                    server_addr: peer_addr.clone(),
                    client_addr: client_addr.clone(),
                    // Said by the node itself when it joins; lockctl speaks for it.
                    version: 0,
                    incarnation: 0,
                    cluster_id: String::new(),
                };
                let reply = match peer_client(&dialer, &target).await {
                    Ok(mut c) => c.join_cluster(dialer.request(req)).await,
                    Err(e) => return fail(e),
                };
                match reply {
                    Ok(r) => {
                        let r = r.into_inner();
                        if r.success {
                            emit(json_out, json!({"added": id, "term": r.term}), || {
                                println!("added server {id} ({peer_addr}) as a learner; it is promoted once caught up")
                            });
                            return ExitCode::SUCCESS;
                        }
                        if !r.leader_addr.is_empty() && r.leader_addr != target {
                            target = r.leader_addr;
                            continue;
                        }
                        return fail(format!("join refused: {}", r.error));
                    }
                    Err(status) => return fail(format!("join failed: {}", status.message())),
                }
            }
            fail("no leader found within 5 hops")
        }
        MembersCmd::Remove { id, via, peer } => {
            let dialer = match peer.dialer() {
                Ok(d) => d,
                Err(e) => return fail(e),
            };
            let mut target = via.clone();
            for _ in 0..5 {
                let req = RemoveServerRequest { server_id: *id };
                let reply = match peer_client(&dialer, &target).await {
                    Ok(mut c) => c.remove_server(dialer.request(req)).await,
                    Err(e) => return fail(e),
                };
                match reply {
                    Ok(r) => {
                        let r = r.into_inner();
                        if r.success {
                            emit(json_out, json!({"removed": id}), || {
                                println!("removed server {id}")
                            });
                            return ExitCode::SUCCESS;
                        }
                        if !r.leader_addr.is_empty() && r.leader_addr != target {
                            target = r.leader_addr;
                            continue;
                        }
                        return fail(format!("remove refused: {}", r.error));
                    }
                    Err(status) => return fail(format!("remove failed: {}", status.message())),
                }
            }
            fail("no leader found within 5 hops")
        }
    }
}

async fn up(nodes: u64, data_dir: &std::path::Path, ports: Ports) -> ExitCode {
    if let Some(pid) = control::running_up(data_dir) {
        return fail(format!(
            "lockctl up (pid {pid}) is already running with --data-dir {}",
            data_dir.display()
        ));
    }
    let data_store_port = ports.data_store;
    let mut cluster = match LocalCluster::start(nodes, data_dir, ports.clone()) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    control::remove_state(data_dir);
    control::write_state(&cluster);
    println!(
        "RaftLock dev cluster ({nodes} nodes), data in {}",
        data_dir.display()
    );
    for i in 1..=nodes {
        println!(
            "  node {i}: ws://{c}/ws  gRPC/HTTP {c}  peer {p}",
            c = cluster.client_addr(i),
            p = ports.peer_addr(i)
        );
    }
    println!("  data store: http://127.0.0.1:{data_store_port}/write");
    match cluster.wait_for_leader(Duration::from_secs(30)).await {
        Some((id, term)) => println!("  leader: node {id} (term {term})"),
        None => println!(
            "  no leader yet; see the node logs in {}",
            data_dir.display()
        ),
    }
    println!(
        "State in {}; `lockctl node stop|kill|start|restart N` acts on the nodes.",
        control::state_file(data_dir).display()
    );
    println!("Press Ctrl-C to stop.");
    let code = supervise(&mut cluster).await;
    cluster.stop();
    control::remove_state(data_dir);
    println!("stopped");
    code
}

/// Until Ctrl-C / SIGTERM: reports children that exit (the others keep running), starts the
/// nodes `lockctl node start` asks for, and keeps the state file current.
async fn supervise(cluster: &mut LocalCluster) -> ExitCode {
    use std::io::Write;
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return ExitCode::FAILURE;
    };
    let mut ticker = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
            _ = term.recv() => return ExitCode::SUCCESS,
            _ = ticker.tick() => {
                let exited = cluster.reap_exited();
                for what in &exited {
                    println!("lockctl: {what}");
                }
                let started = control::take_requests(cluster);
                for what in &started {
                    println!("lockctl: {what}");
                }
                if !exited.is_empty() || !started.is_empty() {
                    control::write_state(cluster);
                    let _ = std::io::stdout().flush();
                }
            }
        }
    }
}

/// An HS256 JWT for `sub` with these rights, valid for `ttl`.
fn make_token(
    key_file: &std::path::Path,
    sub: &str,
    prefixes: &[String],
    operations: &[String],
    admin: bool,
    ttl: Duration,
) -> Result<String, String> {
    const KNOWN: [&str; 6] = ["acquire", "release", "renew", "cancel", "read", "write"];
    if let Some(op) = operations.iter().find(|o| !KNOWN.contains(&o.as_str())) {
        return Err(format!(
            "unknown operation {op:?} (known: {})",
            KNOWN.join(", ")
        ));
    }
    if !admin && (prefixes.is_empty() || operations.is_empty()) {
        return Err("give --prefixes and --operations (or --admin)".into());
    }
    let key = raftlock::server::auth::read_jwt_key(key_file)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_secs();
    let claims = json!({
        "sub": sub, "iat": now, "nbf": now, "exp": now + ttl.as_secs().max(1),
        "raftlock": {"prefixes": prefixes, "operations": operations, "admin": admin},
    });
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(&key),
    )
    .map_err(|e| e.to_string())
}

/// The TLS settings of `--tls-ca`, if given.
fn tls_config(args: &Args) -> Result<Option<TlsConfig>, ClientError> {
    args.tls_ca
        .as_deref()
        .map(|ca| raftlock::tls::client_config(ca, None))
        .transpose()
        .map_err(|e| ClientError::Config(e.to_string()))
}

fn admin_client(args: &Args) -> Result<AdminClient, ClientError> {
    Ok(AdminClient::new(args.endpoints.clone())?
        .with_auth_token(args.auth_token.clone())
        .with_tls(tls_config(args)?))
}

async fn show(endpoint: &str, path: &str, json: bool, tls: Option<&TlsConfig>) -> ExitCode {
    match get_json_with(endpoint, path, None, tls).await {
        Ok((200, value)) => {
            if json {
                print_machine(&value);
            } else if path == "/status" {
                print_table(&status_table(&value));
            } else {
                print_human(&value, 0);
            }
            ExitCode::SUCCESS
        }
        Ok((status, value)) => {
            eprintln!("lockctl: {endpoint}{path} answered {status}: {value}");
            ExitCode::FAILURE
        }
        Err(err) => fail(err),
    }
}

fn print_human(value: &Value, indent: usize) {
    let pad = " ".repeat(indent);
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                if v.is_object()
                    || (v.is_array()
                        && v.as_array()
                            .is_some_and(|a| a.iter().any(|x| x.is_object())))
                {
                    println!("{pad}{k}:");
                    print_human(v, indent + 2);
                } else {
                    println!("{pad}{k}: {}", scalar(v));
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                println!("{pad}-");
                print_human(item, indent + 2);
            }
        }
        other => println!("{pad}{}", scalar(other)),
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Prints rows (the first is the header) as columns padded to their widest cell.
fn print_table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
            }
        }
        println!("{}", line.trim_end());
    }
}

/// Milliseconds as people read them: 850ms, 12.3s, 4m05s, 2h03m.
fn human_ms(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{}m{:02}s", ms / 60_000, ms / 1000 % 60),
        _ => format!("{}h{:02}m", ms / 3_600_000, ms / 60_000 % 60),
    }
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        other => scalar(other),
    }
}

fn locks_table(v: &Value) -> Vec<Vec<String>> {
    let mut rows = vec![vec![
        "KEY".into(),
        "HOLDER".into(),
        "TOKEN".into(),
        "TIME LEFT".into(),
        "TTL".into(),
        "WAITERS".into(),
    ]];
    for l in v["locks"].as_array().into_iter().flatten() {
        let waiters: Vec<String> = l["waiters"]
            .as_array()
            .into_iter()
            .flatten()
            .map(scalar)
            .collect();
        let waiters = if waiters.is_empty() {
            "-".to_string()
        } else {
            format!("{} ({})", waiters.len(), waiters.join(", "))
        };
        rows.push(vec![
            cell(&l["key"]),
            cell(&l["holder"]),
            cell(&l["fencingToken"]),
            l["expiresInMs"].as_u64().map_or("-".into(), human_ms),
            l["ttlMs"].as_u64().map_or("-".into(), human_ms),
            waiters,
        ]);
    }
    rows
}

fn status_table(s: &Value) -> Vec<Vec<String>> {
    let list = |v: &Value| {
        let ids: Vec<String> = v.as_array().into_iter().flatten().map(scalar).collect();
        if ids.is_empty() {
            "-".to_string()
        } else {
            ids.join(",")
        }
    };
    let leader = match (s["leaderId"].as_u64(), s["leaderAddr"].as_str()) {
        (Some(0) | None, _) => "none".to_string(),
        (Some(id), Some(a)) if !a.is_empty() => format!("{id} ({a})"),
        (Some(id), _) => id.to_string(),
    };
    let mut rows = vec![vec!["FIELD".into(), "VALUE".into()]];
    for (k, v) in [
        ("node", cell(&s["id"])),
        ("role", cell(&s["role"])),
        ("term", cell(&s["term"])),
        ("leader", leader),
        ("commit index", cell(&s["commitIndex"])),
        ("applied index", cell(&s["appliedIndex"])),
        ("last index", cell(&s["lastIndex"])),
        ("voters", list(&s["voters"])),
        ("learners", list(&s["learners"])),
        ("locks held", cell(&s["locksHeld"])),
        ("waiters", cell(&s["waiters"])),
        ("cluster version", cell(&s["clusterVersion"])),
    ] {
        rows.push(vec![k.to_string(), v]);
    }
    rows
}

/// Members with the role and term each reports on its own /status ("unreachable" if it does
/// not answer).
async fn members_table(v: &Value, tls: Option<&TlsConfig>) -> Vec<Vec<String>> {
    let mut rows = vec![vec![
        "ID".into(),
        "ROLE".into(),
        "TERM".into(),
        "VOTER".into(),
        "CLIENT ADDR".into(),
        "PEER ADDR".into(),
    ]];
    for m in v["members"].as_array().into_iter().flatten() {
        let client = m["clientAddr"].as_str().unwrap_or("");
        let status = if client.is_empty() {
            None
        } else {
            tokio::time::timeout(
                Duration::from_secs(2),
                get_json_with(client, "/status", None, tls),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .filter(|(code, _)| *code == 200)
            .map(|(_, s)| s)
        };
        let (role, term) = match &status {
            Some(s) => (cell(&s["role"]), cell(&s["term"])),
            None => ("unreachable".into(), "-".into()),
        };
        rows.push(vec![
            cell(&m["id"]),
            role,
            term,
            if m["voter"] == true { "yes" } else { "learner" }.into(),
            if client.is_empty() {
                "-".into()
            } else {
                client.to_string()
            },
            cell(&m["peerAddr"]),
        ]);
    }
    rows
}
