//! `/metrics` checked by real Prometheus tools: `promtool check metrics` lints the exposition of
//! every node, and a Prometheus server scrapes a three-node cluster and answers queries over the
//! metric names the dashboard and alerts rely on.
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

async fn query(prom: &str, q: &str) -> Value {
    let path = format!("/api/v1/query?query={}", q.replace(' ', "%20"));
    http_json(prom, &path).await.unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_cluster() {
    if !tool_available("promtool") || !tool_available("prometheus") {
        return;
    }
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    // Some lock traffic so the lock metrics have values.
    let addr = cluster.nodes[(leader - 1) as usize].client_addr();
    let mut ws = ws_connect(&addr).await;
    let r = ws_request(
        &mut ws,
        &serde_json::json!({"commandType": 3, "key": "m", "clientId": "c", "requestId": "r1", "ttl": 60000}),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");

    for node in &cluster.nodes {
        let (status, body) = http_get(&node.client_addr(), "/metrics")
            .await
            .expect("metrics");
        assert_eq!(status, 200);
        for name in REQUIRED {
            assert!(body.contains(name), "node {} lacks {name}", node.id);
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
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: raftlock\n    static_configs:\n      - targets: [{targets}]\n"
    );
    let config_path = dir.path().join("prometheus.yml");
    std::fs::write(&config_path, config).expect("config");
    let prom_addr = format!("127.0.0.1:{}", free_port());
    let mut prom = Command::new("prometheus")
        .arg(format!("--config.file={}", config_path.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={prom_addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start prometheus");
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut last = Value::Null;
    let outcome = loop {
        if Instant::now() > deadline {
            break Err(format!("no complete scrape in time; last answer: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let up = query(&prom_addr, "sum(up{job=\"raftlock\"})").await;
        let leaders = query(&prom_addr, "sum(raftlock_is_leader)").await;
        let held = query(&prom_addr, "max(raftlock_locks_held)").await;
        let value = |v: &Value| {
            v["data"]["result"][0]["value"][1]
                .as_str()
                .and_then(|s| s.parse::<f64>().ok())
        };
        last = serde_json::json!({"up": up, "leaders": leaders, "held": held});
        if value(&up) == Some(3.0) && value(&leaders) == Some(1.0) && value(&held) == Some(1.0) {
            break Ok(());
        }
    };
    // Every query of the Grafana dashboard parses and runs on this Prometheus (its variables
    // replaced as Grafana would), and names only metrics the binaries export.
    let mut failures = Vec::new();
    let mut checked = 0;
    if outcome.is_ok() {
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
    }
    let _ = prom.kill();
    let _ = prom.wait();
    if let Err(e) = outcome {
        panic!("{e}");
    }
    assert!(
        failures.is_empty(),
        "dashboard queries Prometheus refuses:\n{}",
        failures.join("\n")
    );
    assert!(checked > 20, "only {checked} dashboard queries found");
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
