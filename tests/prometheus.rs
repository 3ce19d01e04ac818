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

/// Names every node must export (the README lists them).
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
    "raftlock_locks_held",
    "raftlock_lock_waiters",
    "raftlock_lock_grants_total",
    "raftlock_client_connections",
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
    let store = DataStoreProc::start().await;
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    // Some lock traffic so the lock metrics have values: this lock stays held.
    let addr = cluster.nodes[(leader - 1) as usize].client_addr();
    let mut ws = ws_connect(&addr).await;
    let r = ws_request(
        &mut ws,
        &serde_json::json!({"commandType": 3, "key": "m", "clientId": "c", "requestId": "r1", "ttl": 60000}),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");
    drop(ws);

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
         \x20 - job_name: raftlock-datastore\n    static_configs:\n      - targets: ['{}']\n",
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

    // Workload before the failure, and a stale fenced write: two grants of one key, the newer
    // token written first, then the older one (refused with 409).
    let workload_deadline = Instant::now() + Duration::from_secs(25);
    let before = lock_cycles(&addr, "before", 150, workload_deadline).await;
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
        let leaders = query(&prom_addr, "sum(raftlock_is_leader)").await;
        let held = query(&prom_addr, "max(raftlock_locks_held)").await;
        let lag = query(&prom_addr, "count(raftlock_replication_lag_seconds)").await;
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

    // SIGKILL the leader in the middle of the workload; a new leader takes over and the
    // workload goes on through it.
    let killed_addr = cluster.node(leader).client_addr();
    cluster.node(leader).kill();
    let new_leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    assert_ne!(new_leader, leader);
    let new_addr = cluster.node(new_leader).client_addr();
    let after = lock_cycles(&new_addr, "after", 150, workload_deadline).await;
    assert!(
        before + after >= 200,
        "only {before} + {after} lock cycles succeeded"
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
        let q = expr
            .replace("$__rate_interval", "1m")
            .replace("$namespace", ".*")
            .replace("$job", ".*");
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
    eprintln!(
        "prometheus test: {before} + {after} lock cycles, leader {leader} killed, new leader \
         {new_leader} (lag in seconds of the killed node and the live follower: {lags:?}), {} rules \
         checked, {checked} dashboard queries, {:?}",
        records.len() + alerts.len(),
        started.elapsed()
    );
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
