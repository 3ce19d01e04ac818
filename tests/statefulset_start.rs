//! Starting the way the Helm chart's StatefulSet does: every node gets the same flags,
//! `--bootstrap-id 1 --join <every pod's peer address>`. Real `lock-node` processes on 127.0.0.1.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

fn ids(status: &Value, field: &str) -> Vec<u64> {
    let mut v: Vec<u64> = status[field]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    v.sort_unstable();
    v
}

/// Waits until `node` reports these voters, no learners, and a leader.
async fn wait_voters(node: &NodeProc, voters: &[u64], timeout: Duration) -> Value {
    let deadline = Instant::now() + timeout;
    let mut last = Value::Null;
    while Instant::now() < deadline {
        if let Ok(s) = http_json(&node.client_addr(), "/status").await {
            if ids(&s, "voters") == voters
                && ids(&s, "learners").is_empty()
                && s["leaderId"].as_u64().unwrap_or(0) != 0
            {
                return s;
            }
            last = s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "node {} never saw voters {voters:?}; last status {last}",
        node.id
    );
}

fn statefulset_nodes(dir: &std::path::Path, n: u64) -> Vec<NodeProc> {
    let mut nodes: Vec<NodeProc> = (1..=n)
        .map(|id| NodeProc::new(id, dir.join(format!("node{id}"))))
        .collect();
    let join = nodes
        .iter()
        .map(NodeProc::peer_addr)
        .collect::<Vec<_>>()
        .join(",");
    for node in &mut nodes {
        node.extra_args = vec![
            "--bootstrap-id".into(),
            "1".into(),
            "--join".into(),
            join.clone(),
        ];
    }
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_flags_on_every_node_form_one_cluster_and_a_wiped_voter_cannot_rejoin_unremoved() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = statefulset_nodes(dir.path(), 3);
    // All at once, as a Parallel StatefulSet starts its pods.
    for node in &mut nodes {
        node.start();
    }
    for node in &nodes {
        wait_voters(node, &[1, 2, 3], Duration::from_secs(60)).await;
    }
    let log1 = std::fs::read_to_string(nodes[0].data_dir.with_extension("log")).unwrap();
    assert!(log1.contains("bootstrapping a new one"), "{log1}");

    // Node 1 loses its volume and starts again with the same flags: it must find the running
    // cluster instead of bootstrapping a second one, and, being a voter already, be refused.
    nodes[0].kill();
    std::fs::remove_dir_all(&nodes[0].data_dir).unwrap();
    nodes[0].start();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = std::fs::read_to_string(nodes[0].data_dir.with_extension("log")).unwrap();
        if log.contains("already a voter") {
            assert!(log.contains("a cluster exists; joining it"), "{log}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the wiped voter was not refused: {log}\n--- node 2:\n{}",
            std::fs::read_to_string(nodes[1].data_dir.with_extension("log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let s = http_json(&nodes[0].client_addr(), "/status").await.unwrap();
    assert!(ids(&s, "voters").is_empty(), "it started a cluster: {s}");
    let (code, _) = http_get(&nodes[0].client_addr(), "/readyz").await.unwrap();
    assert_eq!(code, 503);
    // The others still form the cluster, with a leader among 2 and 3.
    let s = wait_voters(&nodes[1], &[1, 2, 3], Duration::from_secs(30)).await;
    assert_ne!(s["leaderId"], 1, "{s}");

    // The operator removes the lost member; the node, still retrying, then joins afresh.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockctl"))
        .args([
            "members",
            "remove",
            "--id",
            "1",
            "--via",
            &nodes[1].peer_addr(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for node in &nodes {
        wait_voters(node, &[1, 2, 3], Duration::from_secs(60)).await;
    }
}
