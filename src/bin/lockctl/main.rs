//! `lockctl`: RaftLock's command-line tool — a local cluster (`up`), lock and admin commands,
//! `run` a command under a lock, a failover `demo`, and a workload `simulate`.
//!
//! This file holds the command line (clap) and the dispatch of each command; the commands'
//! code is in `members.rs` (membership changes), `up.rs` (the local cluster in the foreground),
//! `clients.rs` (clients, TLS and tokens from the global flags), `output.rs` (tables, machine
//! output, errors and hints), and `certs.rs`, `control.rs`, `local.rs`, `run.rs`, `simulate.rs`.

mod certs;
mod clients;
mod control;
mod local;
mod members;
mod output;
mod run;
mod simulate;
mod up;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use raftlock::server::proto::peer::peer_client::PeerClient;
use raftlock::server::tls::{PeerTls, TlsFiles};
use raftlock::server::transport::PeerDialer;
use serde_json::json;

use clients::{admin_client, make_client, make_token, tls_config};
use local::{Ports, INTERNAL_DATA_STORE, INTERNAL_LOCK_NODE};
use members::members;
use output::{emit, fail, locks_table, print_table, show, watch_line, YAML};
use up::up;

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
    /// its TTL passes. With --read or --write, KEY is a read-write lock (many readers or one
    /// writer); with --permits N, one permit of semaphore KEY of N permits (its slot printed).
    Acquire {
        key: String,
        /// Lease length, e.g. 30s.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// Wait at most this long in the queue (default: do not wait).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<Duration>,
        /// Take read-write lock KEY as a reader.
        #[arg(long, conflicts_with_all = ["write", "permits"])]
        read: bool,
        /// Take read-write lock KEY as its writer.
        #[arg(long, conflicts_with = "permits")]
        write: bool,
        /// Take one permit of semaphore KEY, whose size is N if no one uses it yet.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        permits: Option<u32>,
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
    /// Set a key's lock-delay: after a holder's lease of KEY expires (not when it is released),
    /// no one is granted KEY for DELAY (e.g. 10s; 0s removes it). For resources that cannot
    /// check fencing tokens. Needs an admin identity when the cluster checks identities.
    LockDelay {
        key: String,
        #[arg(value_parser = humantime::parse_duration)]
        delay: Duration,
    },
    /// Set semaphore KEY's size to N permits: kept while no one uses KEY, and in force over the
    /// size the first permit asked for. Raising it grants the waiters that now fit; lowering it
    /// lets the holders keep their permits (new grants wait until they fit); 0 forgets the
    /// setting. Needs an admin identity when the cluster checks identities.
    Permits {
        key: String,
        #[arg(value_name = "N")]
        permits: u32,
    },
    /// Campaign to lead ELECTION, showing VALUE once elected; prints the term (a fencing token
    /// with mode "leader") and the leader's owner id. The leadership lasts until resigned
    /// (`lockctl release ELECTION --token TERM --client-id OWNER`) or until its TTL passes
    /// (`lockctl renew` keeps it).
    Campaign {
        election: String,
        value: String,
        /// The leader's lease, e.g. 30s.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// Wait at most this long to be elected (default: do not wait).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<Duration>,
    },
    /// Show VALUE as ELECTION's value, as its leader (--client-id: the owner id `campaign`
    /// printed; --term: the term it printed).
    Proclaim {
        election: String,
        value: String,
        #[arg(long)]
        term: u64,
    },
    /// Show who leads ELECTION: owner id, term and value.
    Leader { election: String },
    /// Follow who leads ELECTION: the leader now, then each new term, value or vacancy.
    Observe {
        election: String,
        /// Stop after this many changes (the first line counts).
        #[arg(long)]
        count: Option<u64>,
        /// Stop after this long.
        #[arg(long, value_parser = humantime::parse_duration)]
        timeout: Option<Duration>,
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
    ///
    /// With --session, KEY and every --and KEY are held on one session (one keepalive every
    /// third of --ttl for all of them); they are all given back in one log entry when the
    /// command exits, and lost together if the keepalives fail. RAFTLOCK_LOCKS then lists
    /// `key=token` for each, comma-separated, and RAFTLOCK_SESSION is the session's id.
    Run {
        key: String,
        #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// Hold KEY and the --and keys on one session.
        #[arg(long)]
        session: bool,
        /// Another key to hold on the session (repeatable; needs --session).
        #[arg(long = "and", value_name = "KEY", requires = "session")]
        and: Vec<String>,
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
        Cmd::Acquire {
            key,
            ttl,
            wait,
            read,
            write,
            permits,
        } => {
            let client = match make_client(&args) {
                Ok(c) => c,
                Err(e) => return fail(e),
            };
            let mode = match (read, write, permits) {
                (true, _, _) => Some((raftlock::lock::LockMode::Read, 0)),
                (_, true, _) => Some((raftlock::lock::LockMode::Write, 0)),
                (_, _, Some(n)) => Some((raftlock::lock::LockMode::Permit, *n)),
                _ => None,
            };
            if let Some((mode, n)) = mode {
                let wait = wait.unwrap_or(Duration::ZERO);
                return match client
                    .acquire_shared_with(key, mode, n, *ttl, Some(wait))
                    .await
                {
                    Ok(lock) => {
                        let token = lock.fencing_token();
                        let owner = lock.owner_id().to_string();
                        let mut out = json!({"acquired": true, "key": key, "fencingToken": token,
                                             "mode": lock.token_mode(), "clientId": owner,
                                             "ttlMs": ttl.as_millis() as u64});
                        if let Some(slot) = lock.slot() {
                            out["slot"] = json!(slot);
                        }
                        if let Some(mac) = lock.fencing_mac() {
                            out["fencingMac"] = json!(mac);
                        }
                        let mode = lock.token_mode();
                        let slot = lock.slot();
                        std::mem::forget(lock); // stays held after lockctl exits
                        emit(json_out, out, || {
                            let slot = slot.map(|s| format!(" in slot {s}")).unwrap_or_default();
                            println!(
                                "acquired {key} as {mode}{slot}: fencing token {token}, client id \
                                 {owner}, ttl {}",
                                humantime::format_duration(*ttl)
                            )
                        });
                        ExitCode::SUCCESS
                    }
                    Err(raftlock::client::ClientError::WaitTimeout { .. }) => {
                        emit(json_out, json!({"acquired": false, "key": key}), || {
                            println!("{key} cannot be granted in this mode now")
                        });
                        ExitCode::from(run::EXIT_NOT_ACQUIRED)
                    }
                    Err(e) => fail(e),
                };
            }
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
        Cmd::Campaign {
            election,
            value,
            ttl,
            wait,
        } => {
            let client = match make_client(&args) {
                Ok(c) => c,
                Err(e) => return fail(e),
            };
            let wait = Some(wait.unwrap_or(Duration::ZERO));
            match client.campaign_with(election, value, *ttl, wait).await {
                Ok(leadership) => {
                    let term = leadership.term();
                    let mac = leadership.fencing_mac().map(String::from);
                    let owner = leadership.owner_id().to_string();
                    std::mem::forget(leadership); // leads on after lockctl exits
                    let mut out = json!({"elected": true, "election": election, "term": term,
                                         "clientId": owner, "ttlMs": ttl.as_millis() as u64,
                                         "mode": "leader"});
                    if let Some(mac) = mac {
                        out["fencingMac"] = json!(mac);
                    }
                    emit(json_out, out, || {
                        println!(
                            "elected leader of {election}: term {term}, client id {owner}, ttl {}",
                            humantime::format_duration(*ttl)
                        )
                    });
                    ExitCode::SUCCESS
                }
                Err(raftlock::client::ClientError::WaitTimeout { .. }) => {
                    emit(
                        json_out,
                        json!({"elected": false, "election": election}),
                        || println!("{election} has another leader"),
                    );
                    ExitCode::from(run::EXIT_NOT_ACQUIRED)
                }
                Err(e) => fail(e),
            }
        }
        Cmd::Proclaim {
            election,
            value,
            term,
        } => match make_client(&args) {
            Ok(c) => match c.proclaim(election, *term, value).await {
                Ok(()) => {
                    emit(
                        json_out,
                        json!({"proclaimed": true, "election": election, "term": term,
                               "value": value}),
                        || println!("{election}: term {term} shows {value:?}"),
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            },
            Err(e) => fail(e),
        },
        Cmd::Leader { election } => match make_client(&args) {
            Ok(c) => match c.leader(election).await {
                Ok(info) => {
                    emit(json_out, leader_json(election, info.as_ref()), || {
                        println!("{}", leader_line(election, info.as_ref()))
                    });
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            },
            Err(e) => fail(e),
        },
        Cmd::Observe {
            election,
            count,
            timeout,
        } => {
            let client = match make_client(&args) {
                Ok(c) => c,
                Err(e) => return fail(e),
            };
            let mut observer = match client.observe(election).await {
                Ok(o) => o,
                Err(e) => return fail(e),
            };
            let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
            let mut seen = 0u64;
            while count.is_none_or(|c| seen < c) {
                let next = match deadline {
                    Some(d) => match tokio::time::timeout_at(d, observer.next()).await {
                        Ok(n) => n,
                        Err(_) => break,
                    },
                    None => observer.next().await,
                };
                match next {
                    Some(Ok(info)) => {
                        seen += 1;
                        emit(json_out, leader_json(election, info.as_ref()), || {
                            println!("{}", leader_line(election, info.as_ref()))
                        });
                    }
                    Some(Err(e)) => return fail(e),
                    None => break,
                }
            }
            ExitCode::SUCCESS
        }
        Cmd::LockDelay { key, delay } => match make_client(&args) {
            Ok(c) => match c.set_lock_delay(key, *delay).await {
                Ok(now) => {
                    let ms = now.as_millis() as u64;
                    emit(json_out, json!({"key": key, "lockDelayMs": ms}), || {
                        if ms == 0 {
                            println!("{key} has no lock-delay")
                        } else {
                            println!(
                                "{key}: lock-delay {} after an expiry",
                                humantime::format_duration(now)
                            )
                        }
                    });
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            },
            Err(e) => fail(e),
        },
        Cmd::Permits { key, permits } => match make_client(&args) {
            Ok(c) => match c.set_permits(key, *permits).await {
                Ok(n) => {
                    emit(json_out, json!({"key": key, "permits": n}), || {
                        if n == 0 {
                            println!("{key}: size setting removed")
                        } else {
                            println!("{key}: {n} permits")
                        }
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
            session,
            and,
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
                    session: session.then(|| and.clone()),
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

/// An election's leader as JSON (`leader: null` while no one leads).
fn leader_json(election: &str, info: Option<&raftlock::client::LeaderInfo>) -> serde_json::Value {
    match info {
        Some(l) => json!({"election": election, "leader": l.leader, "term": l.term,
                          "value": l.value}),
        None => json!({"election": election, "leader": null}),
    }
}

/// An election's leader as a line for people.
fn leader_line(election: &str, info: Option<&raftlock::client::LeaderInfo>) -> String {
    match info {
        Some(l) => format!(
            "{election}: {} leads, term {}, value {:?}",
            l.leader,
            l.term,
            l.value.as_deref().unwrap_or("")
        ),
        None => format!("{election}: no leader"),
    }
}
