//! Test harness: real `lock-node` processes on 127.0.0.1, killed with SIGKILL when a test says so.
//! Every wait is bounded.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message as WsMessage;

pub type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A port that is free now, chosen below Linux's ephemeral range (32768 and up), so that no
/// outgoing connection can take it between this call and the moment a child process binds it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    const SPAN: u32 = 22_000;
    // Different test processes start at different places; one process walks its own sequence.
    let start = std::process::id().wrapping_mul(2_654_435_761) % SPAN;
    for _ in 0..SPAN {
        let step = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = LOW + (start + step.wrapping_mul(7_919)) % SPAN;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    panic!("no free port between {LOW} and {}", LOW + SPAN)
}

pub struct NodeProc {
    pub id: u64,
    pub peer_port: u16,
    pub client_port: u16,
    pub data_dir: PathBuf,
    pub child: Option<Child>,
    pub extra_args: Vec<String>,
    /// The address both listeners bind: 127.0.0.1, or the node's address in a network
    /// namespace the test made.
    pub host: String,
    /// A command the node runs under (e.g. `ip netns exec NS`; it execs lock-node, so the
    /// child's pid is lock-node's own and signals reach it).
    pub wrapper: Vec<String>,
    /// Environment added to the node's (e.g. libfaketime's).
    pub env: Vec<(String, String)>,
    /// The lock-node executable (this build's unless a test says otherwise).
    pub binary: PathBuf,
}

impl NodeProc {
    /// A node on 127.0.0.1 with free ports, its data in `data_dir`; not started.
    pub fn new(id: u64, data_dir: PathBuf) -> NodeProc {
        NodeProc {
            id,
            peer_port: free_port(),
            client_port: free_port(),
            data_dir,
            child: None,
            extra_args: Vec::new(),
            host: "127.0.0.1".into(),
            wrapper: Vec::new(),
            env: Vec::new(),
            binary: PathBuf::from(env!("CARGO_BIN_EXE_lock-node")),
        }
    }

    pub fn client_addr(&self) -> String {
        format!("{}:{}", self.host, self.client_port)
    }
    pub fn peer_addr(&self) -> String {
        format!("{}:{}", self.host, self.peer_port)
    }

    pub fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data_dir.with_extension("log"))
            .expect("log file");
        let mut command = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&self.binary);
                c
            }
            None => Command::new(&self.binary),
        };
        let child = command
            .args(["--node-id", &self.id.to_string()])
            .args(["--data-dir", &self.data_dir.display().to_string()])
            .args(["--peer-listen", &self.peer_addr()])
            .args(["--client-listen", &self.client_addr()])
            .args([
                "--tick",
                "10ms",
                "--election-ticks",
                "15",
                "--heartbeat-ticks",
                "3",
            ])
            .args(&self.extra_args)
            .env("RUST_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start lock-node");
        self.child = Some(child);
    }

    /// SIGKILL: no chance to flush or hand over leadership.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        child.wait().ok()
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub struct Cluster {
    pub nodes: Vec<NodeProc>,
    pub dir: tempfile::TempDir,
}

impl Cluster {
    pub fn start(n: u64) -> Cluster {
        Cluster::start_with(n, |_| Vec::new())
    }

    /// Starts `n` nodes, each with the extra flags `extra(node)` returns.
    pub fn start_with(n: u64, extra: impl Fn(&NodeProc) -> Vec<String>) -> Cluster {
        Cluster::start_custom(n, |_| {}, extra)
    }

    /// Starts `n` nodes, each first adjusted by `setup` (its host, wrapper, environment), then
    /// given the extra flags `extra(node)` returns.
    pub fn start_custom(
        n: u64,
        setup: impl Fn(&mut NodeProc),
        extra: impl Fn(&NodeProc) -> Vec<String>,
    ) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut nodes: Vec<NodeProc> = (1..=n)
            .map(|id| {
                let mut node = NodeProc::new(id, dir.path().join(format!("node{id}")));
                setup(&mut node);
                node
            })
            .collect();
        let initial = nodes
            .iter()
            .map(|n| format!("{}={}", n.id, n.peer_addr()))
            .collect::<Vec<_>>()
            .join(",");
        for node in &mut nodes {
            node.extra_args = vec!["--initial-cluster".into(), initial.clone()];
            let more = extra(node);
            node.extra_args.extend(more);
            node.start();
        }
        Cluster { nodes, dir }
    }

    /// The client address of node `id`.
    pub fn client_addr_of(&self, id: u64) -> String {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .expect("node exists")
            .client_addr()
    }

    pub fn node(&mut self, id: u64) -> &mut NodeProc {
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .expect("node exists")
    }

    /// Waits until a running node reports itself leader and the others agree; returns its id.
    pub async fn wait_for_leader(&self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            for node in self.nodes.iter().filter(|n| n.child.is_some()) {
                if let Ok(status) = http_json(&node.client_addr(), "/status").await {
                    if status["role"] == "leader" {
                        return node.id;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "no leader within {timeout:?}; logs in {}",
            self.dir.path().display()
        );
    }

    pub fn log_of(&self, id: u64) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("node{id}.log"))).unwrap_or_default()
    }
}

/// A minimal HTTP/1.1 GET returning the parsed JSON body.
pub async fn http_json(addr: &str, path: &str) -> Result<Value, String> {
    let (status, body) = http_get(addr, path).await?;
    if status != 200 {
        return Err(format!("HTTP {status}: {body}"));
    }
    serde_json::from_str(&body).map_err(|e| e.to_string())
}

/// Sum of the samples in a `/metrics` text whose lines start with `series` (a metric name with
/// its opening brace and first labels, such as
/// `raftlock_websocket_request_duration_seconds_count{op="acquire"`) and contain every one of
/// `labels`.
pub fn metric_sum(text: &str, series: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(series) && labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A WebSocket reply's error code (`error.code`, or a seed client's `errorCode`); empty for a
/// success.
pub fn error_code(reply: &Value) -> &str {
    reply["error"]["code"]
        .as_str()
        .or_else(|| reply["errorCode"].as_str())
        .unwrap_or_default()
}

/// The node at `addr`'s `/metrics`, summed over the samples of `series` that carry every one of
/// `labels` (see [`metric_sum`]).
pub async fn scraped_metric(addr: &str, series: &str, labels: &[&str]) -> f64 {
    let (_, text) = http_get(addr, "/metrics").await.expect("/metrics");
    metric_sum(&text, series, labels)
}

/// Three nodes whose exactly-once table keeps at most 40 answers, each for a minute: a client
/// that does not acknowledge its answers runs out of room within seconds.
pub fn cluster_with_a_small_table() -> Cluster {
    Cluster::start_with(3, |_| {
        [
            "--max-answers",
            "40",
            "--dedupe-retain",
            "60s",
            "--session-idle",
            "120s",
        ]
        .map(String::from)
        .to_vec()
    })
}

/// Waits (at most 30 s) until the node at `addr` says its cluster runs `version` or later.
pub async fn wait_for_cluster_version(addr: &str, version: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = http_json(addr, "/status").await.expect("/status");
        if status["clusterVersion"].as_u64() >= Some(u64::from(version)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster version stays at {}",
            status["clusterVersion"]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The node at `addr`'s `raftlock_requests_total` for `result`, summed over operations or only
/// for `op`.
pub async fn requests_counted(addr: &str, op: Option<&str>, result: &str) -> f64 {
    let (_, text) = http_get(addr, "/metrics").await.expect("metrics");
    let result_label = format!("result=\"{result}\"");
    let op_label = op.map(|op| format!("op=\"{op}\""));
    let mut labels = vec![result_label.as_str()];
    labels.extend(op_label.as_deref());
    metric_sum(&text, "raftlock_requests_total{", &labels)
}

pub async fn http_get(addr: &str, path: &str) -> Result<(u16, String), String> {
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut buf = Vec::new();
        stream
            .read_to_end(&mut buf)
            .await
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").ok_or("no body")?;
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or("no status")?;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_string()
        };
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .map_err(|_| "timeout".to_string())?
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

pub async fn ws_connect(addr: &str) -> Ws {
    let url = format!("ws://{addr}/ws");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio_tungstenite::connect_async(url.as_str()).await {
            Ok((ws, _)) => return ws,
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("cannot connect to {url}: {err}"),
        }
    }
}

pub async fn ws_send(ws: &mut Ws, value: &Value) {
    ws.send(WsMessage::Text(value.to_string().into()))
        .await
        .expect("ws send");
}

pub async fn ws_send_raw(ws: &mut Ws, text: &str) {
    ws.send(WsMessage::Text(text.to_string().into()))
        .await
        .expect("ws send");
}

/// Next JSON reply, or None after `timeout`.
pub async fn ws_recv(ws: &mut Ws, timeout: Duration) -> Option<Value> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let next = tokio::time::timeout_at(deadline, ws.next()).await.ok()??;
        match next {
            Ok(WsMessage::Text(t)) => return serde_json::from_str(&t).ok(),
            Ok(_) => continue,
            Err(_) => return None,
        }
    }
}

/// Sends `value` and returns the next reply (within 10 s). A request with a request id that is
/// answered `UNAVAILABLE` or `NO_LEADER` (a leader change on a busy machine) is retried with the
/// same id, as a client does: at most 50 times, 100 ms apart.
pub async fn ws_request(ws: &mut Ws, value: &Value) -> Value {
    for _ in 0..50 {
        ws_send(ws, value).await;
        let reply = ws_recv(ws, Duration::from_secs(10))
            .await
            .expect("a reply within 10s");
        let transient = matches!(
            reply["error"]["code"].as_str(),
            Some("UNAVAILABLE" | "NO_LEADER")
        );
        if !transient || value.get("requestId").is_none() {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no final answer to {value} after 50 tries")
}

/// A follower of `leader` once its `/status` names that leader (bounded wait): its id and
/// client address.
pub async fn follower_knowing(cluster: &Cluster, leader: u64) -> (u64, String) {
    let node = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .expect("a follower");
    let addr = node.client_addr();
    let deadline = Instant::now() + Duration::from_secs(20);
    while http_json(&addr, "/status").await.unwrap_or(Value::Null)["leaderId"] != leader {
        assert!(
            Instant::now() < deadline,
            "follower never learned the leader"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (node.id, addr)
}

/// Client addresses of all nodes.
pub fn endpoints(cluster: &Cluster) -> Vec<String> {
    cluster.nodes.iter().map(|n| n.client_addr()).collect()
}

/// Starts `n` nodes that each advertise a proxy as their client address, so a client — also
/// after redirects — reaches the cluster only through proxies the test can cut. Returns once a
/// leader is elected; proxy `i` fronts node `i + 1`.
pub async fn cluster_behind_proxies(n: u64) -> (Cluster, Vec<Proxy>) {
    let proxy_ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    let ports = proxy_ports.clone();
    let cluster = Cluster::start_with(n, move |node| {
        vec![
            "--advertise-client".into(),
            format!("127.0.0.1:{}", ports[(node.id - 1) as usize]),
        ]
    });
    let mut proxies = Vec::new();
    for (node, port) in cluster.nodes.iter().zip(&proxy_ports) {
        proxies.push(Proxy::start(*port, node.client_addr()).await);
    }
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    (cluster, proxies)
}

/// A TCP proxy on 127.0.0.1 that can cut every connection through it (a client partitioned
/// from the cluster) and stays cut until `heal`.
pub struct Proxy {
    pub addr: String,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(listen_port: u16, target: String) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", listen_port))
            .await
            .expect("bind proxy");
        let addr = format!("127.0.0.1:{listen_port}");
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = cut.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    return;
                };
                if flag.load(Ordering::SeqCst) {
                    continue;
                }
                let target = target.clone();
                let flag = flag.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    let watch = async {
                        while !flag.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    };
                    tokio::select! {
                        _ = tokio::io::copy(&mut ri, &mut wo) => {}
                        _ = tokio::io::copy(&mut ro, &mut wi) => {}
                        _ = watch => {}
                    }
                });
            }
        });
        Proxy { addr, cut, task }
    }

    /// Drops every connection through the proxy and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn heal(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The data store as a child process on a free port.
pub struct DataStoreProc {
    pub addr: String,
    child: Child,
    pub dir: tempfile::TempDir,
}

impl DataStoreProc {
    pub async fn start() -> DataStoreProc {
        DataStoreProc::start_with(&[]).await
    }

    /// Starts the data store with extra flags.
    pub async fn start_with(extra: &[String]) -> DataStoreProc {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr = format!("127.0.0.1:{}", free_port());
        let child = Command::new(env!("CARGO_BIN_EXE_data-store"))
            .args(["--listen", &addr])
            .args(extra)
            .args([
                "--file",
                &dir.path().join("writes.log").display().to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("data-store.log")).expect("log file"))
            .spawn()
            .expect("start data-store");
        let store = DataStoreProc { addr, child, dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if http_get(&store.addr, "/healthz").await.is_ok() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "data-store on {} did not answer /healthz in 20 s; its log:\n{}",
                store.addr,
                store.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        store
    }

    /// What the data store has written to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("data-store.log")).unwrap_or_default()
    }
}

impl Drop for DataStoreProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
