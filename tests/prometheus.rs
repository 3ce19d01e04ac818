//! `/metrics` checked by real Prometheus tools: `promtool check metrics` lints the exposition of
//! every node, and a Prometheus server scrapes a three-node cluster and the data store, loads the
//! repository's recording and alert rules (deploy/prometheus), and answers queries over the
//! metric names the dashboard and alerts rely on while a lock workload runs and the leader is
//! killed.
//!
//! Needs the Debian package `prometheus` (`.ci/run` installs it). Without it the test says so and
//! passes, unless `RAFTLOCK_REQUIRE_PROMETHEUS=1` (set by CI) makes that a failure.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

fn tool_available(name: &str) -> bool {
    let found = Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("RAFTLOCK_REQUIRE_PROMETHEUS").is_none(),
            "{name} is required (apt-get install prometheus)"
        );
        eprintln!("skipping: {name} is not installed (apt-get install prometheus)");
    }
    found
}

/// The scrape job of the second, one-node cluster.
const OTHER_JOB: &str = "raftlock-other";

/// Names every node must export (docs/observability.md lists them).
const REQUIRED: &[&str] = &[
    "raftlock_term",
    "raftlock_is_leader",
    "raftlock_has_leader",
    "raftlock_leader_changes_total",
    "raftlock_elections_total",
    "raftlock_commit_index",
    "raftlock_applied_index",
    "raftlock_last_log_index",
    "raftlock_proposals_committed_total",
    "raftlock_proposals_pending",
    "raftlock_fsync_duration_seconds_bucket",
    "raftlock_commit_duration_seconds_bucket",
    "raftlock_locks_held",
    "raftlock_lock_waiters",
    "raftlock_answers_remembered",
    "raftlock_answers_max",
    "raftlock_answers_recent",
    "raftlock_client_sessions",
    "raftlock_lock_grants_total",
    "raftlock_client_connections",
    "raftlock_entries_committed_total",
    "raftlock_election_duration_seconds_bucket",
    "raftlock_store_size_bytes",
    "raftlock_build_info",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
];

/// Percent-encodes a query parameter (PromQL has `+`, `&`, `#`, quotes and newlines).
fn encode(q: &str) -> String {
    let mut out = String::with_capacity(q.len() * 3);
    for b in q.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn query(prom: &str, q: &str) -> Value {
    let path = format!("/api/v1/query?query={}", encode(q));
    http_json(prom, &path).await.unwrap_or(Value::Null)
}

/// The result vector of an instant query (empty when it fails).
async fn samples(prom: &str, q: &str) -> Vec<Value> {
    query(prom, q).await["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn value_of(sample: &Value) -> Option<f64> {
    sample["value"][1].as_str().and_then(|s| s.parse().ok())
}

/// A child process killed (SIGKILL) and reaped when dropped, also when the test panics.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const RULE_FILES: [&str; 2] = [
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/prometheus/recording-rules.yml"
    ),
    concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/alerts.yml"),
];

/// `(groups, recording rules, alerts)` named in the rule files, read as plain text.
fn rules_in_files() -> (Vec<String>, Vec<String>, Vec<String>) {
    let (mut groups, mut records, mut alerts) = (Vec::new(), Vec::new(), Vec::new());
    for file in RULE_FILES {
        let text = std::fs::read_to_string(file).expect("rule file");
        for line in text.lines().map(str::trim) {
            let value = |l: &str| l.trim().trim_matches('"').to_string();
            if let Some(name) = line.strip_prefix("- name:") {
                groups.push(value(name));
            } else if let Some(name) = line.strip_prefix("- record:") {
                records.push(value(name));
            } else if let Some(name) = line.strip_prefix("- alert:") {
                alerts.push(value(name));
            }
        }
    }
    (groups, records, alerts)
}

fn acquire(key: &str, client: &str, request: &str) -> Value {
    serde_json::json!({"commandType": 3, "key": key, "clientId": client, "requestId": request, "ttl": 60000})
}

fn release(key: &str, client: &str, request: &str, token: &Value) -> Value {
    serde_json::json!({"commandType": 4, "key": key, "clientId": client, "requestId": request,
                       "fencingToken": {"key": key, "value": token}})
}

/// `cycles` acquire/release pairs on a few keys through `addr`; returns how many succeeded.
async fn lock_cycles(addr: &str, client: &str, cycles: usize, deadline: Instant) -> usize {
    let mut ws = ws_connect(addr).await;
    let mut done = 0;
    for i in 0..cycles {
        if Instant::now() > deadline {
            break;
        }
        let key = format!("load-{}", i % 8);
        let r = ws_request(&mut ws, &acquire(&key, client, &format!("{client}-a{i}"))).await;
        if r["success"] != true {
            continue;
        }
        let token = r["fencingToken"]["value"].clone();
        let r = ws_request(
            &mut ws,
            &release(&key, client, &format!("{client}-r{i}"), &token),
        )
        .await;
        if r["success"] == true {
            done += 1;
        }
    }
    done
}

/// `rounds` hand-offs on one key through `addr`: a holder renews its lease, a second client
/// queues behind it, the holder releases and the waiter is granted (the wait, hold and renewal
/// metrics get values).
async fn contended_hand_offs(addr: &str, label: &str, rounds: usize) {
    let mut holder = ws_connect(addr).await;
    let mut waiter = ws_connect(addr).await;
    for i in 0..rounds {
        let r = ws_request(
            &mut holder,
            &acquire("handoff", "holder", &format!("{label}-h{i}")),
        )
        .await;
        assert_eq!(r["success"], true, "{r}");
        let token = r["fencingToken"]["value"].clone();
        let renew = serde_json::json!({"commandType": 5, "key": "handoff", "clientId": "holder",
            "requestId": format!("{label}-hn{i}"), "ttl": 60000,
            "fencingToken": {"key": "handoff", "value": token}});
        let r = ws_request(&mut holder, &renew).await;
        assert_eq!(r["success"], true, "{r}");
        ws_send(
            &mut waiter,
            &acquire("handoff", "waiter", &format!("{label}-w{i}")),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = ws_request(
            &mut holder,
            &release("handoff", "holder", &format!("{label}-hr{i}"), &token),
        )
        .await;
        assert_eq!(r["success"], true, "{r}");
        let granted = ws_recv(&mut waiter, Duration::from_secs(10))
            .await
            .expect("the waiter's grant");
        assert_eq!(granted["success"], true, "{granted}");
        let token = granted["fencingToken"]["value"].clone();
        let r = ws_request(
            &mut waiter,
            &release("handoff", "waiter", &format!("{label}-wr{i}"), &token),
        )
        .await;
        assert_eq!(r["success"], true, "{r}");
    }
}

/// Acquire/release cycles on a client's own keys until `stop`, through the nodes in turn: on a
/// failed connection or an error answer the client moves on to the next node. Returns the
/// cycles completed.
async fn steady_cycles(
    endpoints: Vec<String>,
    client: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> usize {
    let mut done = 0;
    let mut n = 0u64;
    let mut node = client;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        node = (node + 1) % endpoints.len();
        let url = format!("ws://{}/ws", endpoints[node]);
        let Ok(Ok((mut ws, _))) = tokio::time::timeout(
            Duration::from_secs(2),
            tokio_tungstenite::connect_async(url),
        )
        .await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            n += 1;
            let key = format!("steady-{client}-{}", n % 4);
            let who = format!("steady-{client}");
            let Some(granted) = ask(&mut ws, acquire(&key, &who, &format!("{who}-a{n}"))).await
            else {
                break;
            };
            let token = granted["fencingToken"]["value"].clone();
            let released = ask(&mut ws, release(&key, &who, &format!("{who}-r{n}"), &token)).await;
            if released.is_none() {
                break;
            }
            done += 1;
            // About 20 cycles a second per client: a steady rate the panels can show.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    done
}

/// One request on `ws`; the answer if it came within 3 s and says `success`.
async fn ask(ws: &mut Ws, msg: Value) -> Option<Value> {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    ws.send(Message::Text(msg.to_string().into())).await.ok()?;
    let reply = tokio::time::timeout(Duration::from_secs(3), ws.next())
        .await
        .ok()??
        .ok()?;
    let reply: Value = serde_json::from_str(reply.to_text().ok()?).ok()?;
    (reply["success"] == true).then_some(reply)
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
}

/// POSTs a fenced write to the data store; returns the HTTP status, or what went wrong.
async fn fenced_write(store: &str, key: &str, token: &Value) -> Result<u16, String> {
    let body = serde_json::json!({"clientID": "prom-test", "fencingToken": {"key": key, "value": token}, "data": "x"})
        .to_string();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect(store)
            .await
            .map_err(|e| format!("connect {store}: {e}"))?;
        let request = format!(
            "POST /write HTTP/1.1\r\nHost: {store}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut buf = Vec::new();
        stream
            .read_to_end(&mut buf)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&buf).to_string();
        text.split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("not an HTTP answer: {text:?}"))
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .map_err(|_| "no answer in 20 s".to_string())?
}

/// A three-node cluster and the data store under a real Prometheus that loads the repository's
/// recording and alert rules: a lock workload with a leader killed (SIGKILL) in the middle and a
/// stale fenced write. Checks that `/metrics` lints, every dashboard query runs, every rule group
/// is loaded and healthy, every recording rule has data, every alert expression evaluates,
/// RaftLockNodeDown is at least pending for the killed node, the stale-write alert's expression
/// has a result, and the new leader reports the killed node's replication lag in seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_cluster() {
    if !tool_available("promtool") || !tool_available("prometheus") {
        return;
    }
    let started = Instant::now();
    let mut cluster = Cluster::start(3);
    // A second cluster of one node, scraped as a job of its own: the dashboard must show each
    // cluster apart.
    let other = Cluster::start(1);
    let store = DataStoreProc::start().await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    other.wait_for_leader(Duration::from_secs(20)).await;
    let other_addr = other.nodes[0].client_addr();
    // Some lock traffic so the lock metrics have values: this lock stays held.
    let addr = cluster.nodes[(leader - 1) as usize].client_addr();
    let mut ws = ws_connect(&addr).await;
    let r = ws_request(
        &mut ws,
        &serde_json::json!({"commandType": 3, "key": "m", "clientId": "c", "requestId": "r1", "ttl": 60000}),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");
    // Connections by protocol: this WebSocket, and a connection that sent the HTTP/2 preface
    // (as every gRPC channel does first), each counted once while open.
    let mut h2 = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    tokio::io::AsyncWriteExt::write_all(&mut h2, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("preface");
    let connections = |protocol: &'static str| {
        let addr = addr.clone();
        async move {
            let label = format!("protocol=\"{protocol}\"");
            scraped_metric(&addr, "raftlock_client_connections{", &[&label]).await
        }
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while connections("grpc").await != 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(connections("websocket").await, 1.0);
    assert_eq!(connections("grpc").await, 1.0);
    drop(h2);
    drop(ws);
    let deadline = Instant::now() + Duration::from_secs(5);
    while (connections("websocket").await, connections("grpc").await) != (0.0, 0.0)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        (connections("websocket").await, connections("grpc").await),
        (0.0, 0.0),
        "closed connections still counted"
    );

    for node in &cluster.nodes {
        let (status, body) = http_get(&node.client_addr(), "/metrics")
            .await
            .expect("metrics");
        assert_eq!(status, 200);
        for name in REQUIRED {
            assert!(body.contains(name), "node {} lacks {name}", node.id);
        }
        if node.id == leader {
            for peer in cluster.nodes.iter().filter(|n| n.id != leader) {
                for metric in [
                    "raftlock_replication_lag_entries",
                    "raftlock_replication_lag_seconds",
                ] {
                    let series = format!("{metric}{{peer=\"{}\"}}", peer.id);
                    assert!(body.contains(&series), "leader lacks {series}:\n{body}");
                }
            }
        } else {
            assert!(
                !body.contains("raftlock_replication_lag_seconds{"),
                "follower {} exports a replication lag",
                node.id
            );
        }
        let mut lint = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("promtool");
        lint.stdin
            .take()
            .expect("stdin")
            .write_all(body.as_bytes())
            .expect("write");
        let out = lint.wait_with_output().expect("promtool");
        // promtool exits 1 for lint findings (style) and 3 for exposition errors.
        assert_ne!(
            out.status.code(),
            Some(3),
            "promtool rejects node {}'s /metrics: {}{}",
            node.id,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let targets = cluster
        .nodes
        .iter()
        .map(|n| format!("'{}'", n.client_addr()))
        .collect::<Vec<_>>()
        .join(", ");
    let rule_files = RULE_FILES
        .iter()
        .map(|f| format!("  - '{f}'\n"))
        .collect::<String>();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n{rule_files}\
         scrape_configs:\n  - job_name: raftlock\n    static_configs:\n      - targets: [{targets}]\n\
         \x20 - job_name: raftlock-datastore\n    static_configs:\n      - targets: ['{}']\n\
         \x20 - job_name: {OTHER_JOB}\n    static_configs:\n      - targets: ['{other_addr}']\n",
        store.addr
    );
    let config_path = dir.path().join("prometheus.yml");
    std::fs::write(&config_path, config).expect("config");
    let prom_log = dir.path().join("prometheus.log");
    let prom_addr = format!("127.0.0.1:{}", free_port());
    let _prom = Reaped(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={prom_addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&prom_log).expect("log"))
            .spawn()
            .expect("start prometheus"),
    );
    let prom_log_text = || std::fs::read_to_string(&prom_log).unwrap_or_default();

    // Workload before Prometheus is up (the lock metrics have values from the first scrape).
    let workload_deadline = Instant::now() + Duration::from_secs(25);
    let before = lock_cycles(&addr, "before", 150, workload_deadline).await;
    // Prometheus has the whole cluster (and the lag series of the first leader) before the kill.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = Value::Null;
    let outcome = loop {
        if Instant::now() > deadline {
            break Err(format!(
                "no complete scrape in time; last answer: {last}\n{}",
                prom_log_text()
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let up = query(&prom_addr, "sum(up{job=\"raftlock\"})").await;
        let store_up = query(&prom_addr, "sum(up{job=\"raftlock-datastore\"})").await;
        let leaders = query(&prom_addr, "sum(raftlock_is_leader{job=\"raftlock\"})").await;
        let held = query(&prom_addr, "max(raftlock_locks_held{job=\"raftlock\"})").await;
        let lag = query(
            &prom_addr,
            "count(raftlock_replication_lag_seconds{job=\"raftlock\"})",
        )
        .await;
        let value = |v: &Value| value_of(&v["data"]["result"][0]);
        last = serde_json::json!({"up": up, "store_up": store_up, "leaders": leaders, "held": held, "lag": lag});
        if value(&up) == Some(3.0)
            && value(&store_up) == Some(1.0)
            && value(&leaders) == Some(1.0)
            && value(&held) == Some(1.0)
            && value(&lag) == Some(2.0)
        {
            break Ok(());
        }
    };
    if let Err(e) = outcome {
        panic!("{e}");
    }

    // A steady workload through every node (followers forward) for PHASE, then SIGKILL the
    // leader; a new leader takes over and the workload goes on through the survivors for
    // another PHASE. Prometheus scrapes every second throughout, so the dashboard's range
    // queries below see the traffic on both sides of the failure.
    const PHASE: Duration = Duration::from_secs(12);
    let endpoints: Vec<String> = cluster.nodes.iter().map(|n| n.client_addr()).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut steady = Vec::new();
    for client in 0..3 {
        steady.push(tokio::spawn(steady_cycles(
            endpoints.clone(),
            client,
            stop.clone(),
        )));
    }
    // A stale fenced write: two grants of one key, the newer token written first, then the
    // older one (refused with 409).
    let mut ws = ws_connect(&addr).await;
    let mut tokens = Vec::new();
    for i in 0..2 {
        let r = ws_request(&mut ws, &acquire("fenced", "writer", &format!("f{i}"))).await;
        assert_eq!(r["success"], true, "{r}");
        let token = r["fencingToken"]["value"].clone();
        let r = ws_request(
            &mut ws,
            &release("fenced", "writer", &format!("fr{i}"), &token),
        )
        .await;
        assert_eq!(r["success"], true, "{r}");
        tokens.push(token);
    }
    drop(ws);
    for (token, expected) in [(&tokens[1], 200), (&tokens[0], 409)] {
        let status = fenced_write(&store.addr, "fenced", token).await;
        assert_eq!(
            status,
            Ok(expected),
            "fenced write with token {token}; data-store log:\n{}",
            store.log()
        );
    }

    contended_hand_offs(&addr, "before", 3).await;
    tokio::time::sleep(PHASE).await;
    let killed_addr = cluster.node(leader).client_addr();
    // Each survivor's count of new leaders and its term, before the kill.
    let survivors: Vec<String> = cluster
        .nodes
        .iter()
        .filter(|n| n.id != leader)
        .map(|n| n.client_addr())
        .collect();
    let mut counts_before = Vec::new();
    for s in &survivors {
        counts_before.push((
            scraped_metric(s, "raftlock_leader_changes_total", &[]).await,
            scraped_metric(s, "raftlock_term ", &[]).await,
        ));
    }
    let killed_at = unix_seconds();
    cluster.node(leader).kill();
    let new_leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    assert_ne!(new_leader, leader);
    // One failover is one leader change on each survivor: exactly one where one election
    // decided it, and never more than the terms that passed (a node sees one leader a term).
    for (s, (changes, term)) in survivors.iter().zip(&counts_before) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while http_json(s, "/status")
            .await
            .map(|st| st["leaderId"].as_u64())
            != Ok(Some(new_leader))
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let changes_after = scraped_metric(s, "raftlock_leader_changes_total", &[]).await;
        let term_after = scraped_metric(s, "raftlock_term ", &[]).await;
        let (moved, terms) = (changes_after - changes, term_after - term);
        assert!(
            moved >= 1.0 && moved <= terms.max(1.0) && (terms != 1.0 || moved == 1.0),
            "survivor {s}: raftlock_leader_changes_total moved by {moved} over {terms} term(s) \
             for one leader kill"
        );
        eprintln!("survivor {s}: leader changes +{moved} over {terms} term(s)");
    }
    let new_addr = cluster.node(new_leader).client_addr();
    let after = lock_cycles(&new_addr, "after", 150, workload_deadline + PHASE * 2).await;
    contended_hand_offs(&new_addr, "after", 3).await;
    tokio::time::sleep(PHASE.saturating_sub(Duration::from_secs_f64(unix_seconds() - killed_at)))
        .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut steady_cycles_done = 0;
    for task in steady {
        steady_cycles_done += task.await.expect("workload task");
    }
    assert!(
        before + after >= 200 && steady_cycles_done > 0,
        "only {before} + {after} lock cycles (and {steady_cycles_done} steady ones) succeeded"
    );

    // Wait for the rules to see the failure: every group evaluated without error, every
    // recording rule with data, RaftLockNodeDown pending (or firing) for the killed node.
    let (groups, records, alerts) = rules_in_files();
    assert!(groups.len() >= 4 && records.len() >= 10 && alerts.len() >= 9);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut problems;
    let mut lags;
    loop {
        problems = Vec::new();
        let rules = http_json(&prom_addr, "/api/v1/rules")
            .await
            .unwrap_or(Value::Null);
        let loaded = rules["data"]["groups"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mut seen_records = Vec::new();
        let mut seen_alerts = Vec::new();
        for group in &groups {
            if !loaded.iter().any(|g| g["name"] == group.as_str()) {
                problems.push(format!("rule group {group} is not loaded"));
            }
        }
        for group in &loaded {
            for rule in group["rules"].as_array().into_iter().flatten() {
                let name = rule["name"].as_str().unwrap_or_default().to_string();
                if rule["health"] != "ok" {
                    problems.push(format!("rule {name}: health {}", rule["health"]));
                }
                if rule["lastError"].as_str().is_some_and(|e| !e.is_empty()) {
                    problems.push(format!("rule {name}: lastError {}", rule["lastError"]));
                }
                let expr = rule["query"].as_str().unwrap_or_default();
                let answer = query(&prom_addr, expr).await;
                if answer["status"] != "success" {
                    problems.push(format!("rule {name}: its expression fails: {answer}"));
                }
                if rule["type"] == "recording" {
                    if samples(&prom_addr, &name).await.is_empty() {
                        problems.push(format!("recording rule {name} has no data"));
                    }
                    seen_records.push(name);
                } else {
                    seen_alerts.push(name);
                }
            }
        }
        for (want, seen, kind) in [
            (&records, &seen_records, "recording rule"),
            (&alerts, &seen_alerts, "alert"),
        ] {
            for name in want.iter().filter(|n| !seen.contains(n)) {
                problems.push(format!("{kind} {name} is not loaded"));
            }
        }
        let active = http_json(&prom_addr, "/api/v1/alerts")
            .await
            .unwrap_or(Value::Null);
        let node_down = active["data"]["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| {
                a["labels"]["alertname"] == "RaftLockNodeDown"
                    && a["labels"]["instance"] == killed_addr.as_str()
                    && (a["state"] == "pending" || a["state"] == "firing")
            });
        if !node_down {
            problems.push(format!(
                "RaftLockNodeDown is not pending for {killed_addr}: {active}"
            ));
        }
        let stale = loaded
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .find(|r| r["name"] == "RaftLockStaleWritesRejected")
            .and_then(|r| r["query"].as_str().map(str::to_string))
            .unwrap_or_default();
        if samples(&prom_addr, &stale).await.is_empty() {
            problems.push("the stale-write alert's expression has no result".into());
        }
        // The new leader reports how long the killed node has lacked entries; the live
        // follower is not far behind.
        let lag = samples(
            &prom_addr,
            "raftlock_replication_lag_seconds and on (instance) raftlock_is_leader == 1",
        )
        .await;
        let lag_of = |peer: u64| {
            lag.iter()
                .find(|s| s["metric"]["peer"] == peer.to_string().as_str())
                .and_then(value_of)
        };
        let live = (1..=3)
            .find(|&id| id != leader && id != new_leader)
            .unwrap();
        lags = (lag_of(leader), lag_of(live));
        match lags {
            (Some(dead), Some(alive)) if dead > 0.0 && alive < 5.0 => {}
            other => problems.push(format!(
                "replication lag in seconds (killed {leader}, live {live}): {other:?}"
            )),
        }
        if problems.is_empty() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        problems.is_empty(),
        "after {:?}:\n{}\nPrometheus log:\n{}",
        started.elapsed(),
        problems.join("\n"),
        prom_log_text()
    );

    // Every query of the Grafana dashboard parses and runs on this Prometheus (its variables
    // replaced as Grafana would), and names only metrics the binaries export.
    let mut failures = Vec::new();
    let mut checked = 0;
    for expr in dashboard_queries() {
        let q = dashboard_variables(&expr, "1m");
        let answer = query(&prom_addr, &q).await;
        checked += 1;
        if answer["status"] != "success" {
            failures.push(format!("{q}\n  -> {answer}"));
        }
    }
    assert!(
        failures.is_empty(),
        "dashboard queries Prometheus refuses:\n{}",
        failures.join("\n")
    );
    assert!(checked > 20, "only {checked} dashboard queries found");

    // Every panel draws something from this run: a range query over the whole run returns at
    // least one finite point for one of the panel's queries. The answers are kept for
    // scripts/plot-panels.py, which draws docs/observability.md's picture of the key panels.
    let end = unix_seconds();
    let begin = end - started.elapsed().as_secs_f64() - 5.0;
    let mut empty = Vec::new();
    let mut drawn = Vec::new();
    for (title, exprs) in dashboard_panels() {
        let mut series = Vec::new();
        for expr in &exprs {
            let q = dashboard_variables(expr, "5s");
            let path = format!(
                "/api/v1/query_range?query={}&start={begin:.3}&end={end:.3}&step=1",
                encode(&q)
            );
            let answer = http_json(&prom_addr, &path).await.unwrap_or(Value::Null);
            for s in answer["data"]["result"].as_array().into_iter().flatten() {
                series.push(serde_json::json!({"query": expr, "metric": s["metric"], "values": s["values"]}));
            }
        }
        let finite = series.iter().any(|s| {
            s["values"].as_array().into_iter().flatten().any(|v| {
                v[1].as_str()
                    .and_then(|x| x.parse::<f64>().ok())
                    .is_some_and(f64::is_finite)
            })
        });
        if !finite {
            empty.push(title.clone());
        }
        drawn.push(serde_json::json!({"title": title, "series": series}));
    }
    let out = concat!(env!("CARGO_TARGET_TMPDIR"), "/prometheus-panels.json");
    let run = serde_json::json!({"begin": begin, "end": end, "killed_leader": leader,
                                 "killed_at": killed_at, "panels": drawn});
    std::fs::write(out, run.to_string()).expect("write the panels' data");
    assert!(
        empty.is_empty(),
        "dashboard panels with no data from this run: {empty:?}"
    );

    // Two clusters scraped: with the job variable on either, the stats count that cluster's
    // nodes only (three-node cluster: two up after the kill, both knowing the new leader; the
    // other: one), and the per-pod panels draw that cluster's nodes only.
    let panels = dashboard_panels();
    let stat_of = |title: &str| {
        panels
            .iter()
            .find(|(t, _)| t == title)
            .map(|(_, exprs)| exprs[0].clone())
            .unwrap_or_else(|| panic!("no panel {title}"))
    };
    let own: Vec<String> = cluster.nodes.iter().map(|n| n.client_addr()).collect();
    for (job, expected, instances) in [
        ("raftlock", 2.0, own.clone()),
        (OTHER_JOB, 1.0, vec![other_addr.clone()]),
    ] {
        for title in ["Nodes scraped", "Nodes that know a leader"] {
            let q = dashboard_variables_for(&stat_of(title), "1m", job);
            let deadline = Instant::now() + Duration::from_secs(10);
            let got = loop {
                let got: Vec<(Value, Option<f64>)> = samples(&prom_addr, &q)
                    .await
                    .iter()
                    .map(|s| (s["metric"]["job"].clone(), value_of(s)))
                    .collect();
                if got == vec![(Value::from(job), Some(expected))] || Instant::now() > deadline {
                    break got;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            };
            assert_eq!(
                got,
                vec![(Value::from(job), Some(expected))],
                "stat {title:?} with job {job}: {q}"
            );
        }
        let q = dashboard_variables_for(&stat_of("Role per node"), "1m", job);
        let drawn: Vec<String> = samples(&prom_addr, &q)
            .await
            .iter()
            .filter_map(|s| s["metric"]["pod"].as_str().map(str::to_string))
            .collect();
        assert!(
            !drawn.is_empty() && drawn.iter().all(|pod| instances.contains(pod)),
            "Role per node with job {job} draws {drawn:?}, not only {instances:?}"
        );
    }

    // Every node of the cluster stopped: the critical alert stands in for the nodes that can
    // no longer report (pending at once, firing after its `for`).
    for node in &mut cluster.nodes {
        node.kill();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let outage = loop {
        let active = http_json(&prom_addr, "/api/v1/alerts")
            .await
            .unwrap_or(Value::Null);
        let found = active["data"]["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| {
                a["labels"]["alertname"] == "RaftLockInsufficientMembers"
                    && a["labels"]["severity"] == "critical"
                    && a["labels"]["job"] == "raftlock"
            })
            .cloned();
        if found.is_some() || Instant::now() > deadline {
            break found;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        outage.is_some(),
        "no critical RaftLockInsufficientMembers with every node stopped"
    );
    eprintln!(
        "prometheus test: {before} + {after} lock cycles, leader {leader} killed, new leader \
         {new_leader} (lag in seconds of the killed node and the live follower: {lags:?}), {} rules \
         checked, {checked} dashboard queries, {:?}",
        records.len() + alerts.len(),
        started.elapsed()
    );
}

/// A dashboard query with its variables as Grafana sets them for this test's Prometheus, which
/// scrapes one cluster with a plain static config (no namespace or pod label): `namespace` finds
/// no values and stays empty (`namespace=~""` selects the series without the label), `job` and
/// `datastore_job` are the two scrape jobs, `pod` is All (`.*`). A variable left over (a `$`
/// before a letter; label_replace's `$1` is not one) is a variable this function does not know.
fn dashboard_variables(expr: &str, rate_interval: &str) -> String {
    dashboard_variables_for(expr, rate_interval, "raftlock")
}

/// [`dashboard_variables`] with the `job` variable set to `job`.
fn dashboard_variables_for(expr: &str, rate_interval: &str, job: &str) -> String {
    let q = expr
        .replace("$__rate_interval", rate_interval)
        .replace("$namespace", "")
        .replace("$datastore_job", "raftlock-datastore")
        .replace("$job", job)
        .replace("$pod", ".*");
    assert!(
        !q.split('$')
            .skip(1)
            .any(|rest| rest.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')),
        "a dashboard variable tests/prometheus.rs does not substitute: {q}"
    );
    q
}

/// `(title, queries)` of every panel of deploy/grafana/raftlock.json that has queries.
fn dashboard_panels() -> Vec<(String, Vec<String>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/raftlock.json");
    let text = std::fs::read_to_string(path).expect("dashboard");
    let dash: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        let exprs: Vec<String> = panel["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["expr"].as_str().map(str::to_string))
            .collect();
        if !exprs.is_empty() {
            out.push((panel["title"].as_str().unwrap_or("?").to_string(), exprs));
        }
    }
    out
}

/// The `expr` of every panel target in deploy/grafana/raftlock.json.
fn dashboard_queries() -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/raftlock.json");
    let text = std::fs::read_to_string(path).expect("dashboard");
    let dash: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for t in panel["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push(e.to_string());
            }
        }
    }
    out
}

/// Metric names exported by lock-node and data-store, as written in their sources.
fn exported_metric_names() -> Vec<String> {
    let mut names = Vec::new();
    for file in ["src/telemetry/metrics.rs", "src/datastore/mod.rs"] {
        let path = format!("{}/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).expect("source");
        for piece in text.split('"').skip(1).step_by(2) {
            if piece.starts_with("raftlock_")
                && piece.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            {
                names.push(piece.to_string());
            }
        }
    }
    names
}

#[test]
fn dashboard_and_alerts_name_only_exported_metrics() {
    let exported = exported_metric_names();
    assert!(exported.len() > 20, "{exported:?}");
    let alerts = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/charts/raftlock/templates/prometheusrule.yaml"
    ))
    .expect("alert rules");
    let mut used = Vec::new();
    for text in dashboard_queries().iter().chain([&alerts]) {
        let mut rest = text.as_str();
        while let Some(at) = rest.find("raftlock_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(tail.len());
            used.push(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    assert!(used.len() > 20, "{used:?}");
    let unknown: Vec<_> = used
        .iter()
        .filter(|name| {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            !exported.iter().any(|e| e == base || e == name.as_str())
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "the dashboard or alerts use metrics nobody exports: {unknown:?}"
    );
}

/// Span names lock-node creates, as written in its sources (`lock.*`, `kv.*`, `raft.*`,
/// `election.*`, `session.*`).
fn span_names() -> Vec<String> {
    let mut names = Vec::new();
    for file in [
        "src/node/api.rs",
        "src/server/driver/mod.rs",
        "src/server/driver/run.rs",
        "src/server/driver/inputs.rs",
        "src/server/driver/effects.rs",
        "src/server/driver/status.rs",
        "src/server/driver/timed_storage.rs",
        "src/server/exec.rs",
    ] {
        let path = format!("{}/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).expect("source");
        for piece in text.split('"').skip(1).step_by(2) {
            let named = ["lock.", "kv.", "raft.", "election.", "session."]
                .iter()
                .any(|p| piece.starts_with(p) && piece.len() > p.len());
            if named
                && piece
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_' || c == '.')
                && !names.iter().any(|n| n == piece)
                // The tracing name of the request span; it is exported as `otel.name`
                // (lock.acquire, …).
                && piece != "lock.request"
            {
                names.push(piece.to_string());
            }
        }
    }
    names
}

/// docs/observability.md has one table row per metric, span and alert.
#[test]
fn observability_doc_lists_every_metric_span_and_alert() {
    let section = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/observability.md"
    ))
    .expect("docs/observability.md");
    let rows: Vec<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    let mut metrics = exported_metric_names();
    // (Series of histograms quoted by the sources' own tests.)
    metrics.retain(|m| !m.ends_with("_bucket"));
    metrics.dedup();
    let spans = span_names();
    let (_, _, alerts) = rules_in_files();
    assert!(metrics.len() > 20 && spans.len() > 10 && alerts.len() > 5);
    let missing: Vec<&String> = metrics
        .iter()
        .chain(&spans)
        .chain(&alerts)
        .filter(|name| !rows.contains(&name.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/observability.md has no row for {missing:?}"
    );
    let unknown: Vec<&&str> = rows
        .iter()
        .filter(|row| {
            !metrics
                .iter()
                .chain(&spans)
                .chain(&alerts)
                .any(|n| n == *row)
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "docs/observability.md lists what does not exist: {unknown:?}"
    );
}
