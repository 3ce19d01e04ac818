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

/// Three nodes with the chart's flags, started at once, once they form one cluster.
async fn formed_cluster(dir: &std::path::Path) -> Vec<NodeProc> {
    let mut nodes = statefulset_nodes(dir, 3);
    for node in &mut nodes {
        node.start();
    }
    for node in &nodes {
        wait_voters(node, &[1, 2, 3], Duration::from_secs(60)).await;
    }
    nodes
}

fn acquire(key: &str, client: &str, request: &str, ttl: u64) -> Value {
    serde_json::json!({"commandType": 3, "key": key, "clientId": client, "requestId": request,
                       "ttl": ttl})
}

fn token_of(reply: &Value) -> u64 {
    reply["fencingToken"]["value"]
        .as_u64()
        .unwrap_or_else(|| panic!("no token in {reply}"))
}

/// The node that leads, once one does (and every node that answers agrees).
async fn wait_leader(nodes: &[NodeProc], timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    loop {
        for (i, node) in nodes.iter().enumerate() {
            if let Ok(s) = http_json(&node.client_addr(), "/status").await {
                if s["role"] == "leader" && s["leaderId"].as_u64() == Some(node.id) {
                    return i;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "no leader within {timeout:?}; node 1's log:\n{}",
            std::fs::read_to_string(nodes[0].data_dir.with_extension("log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The holder and token of `key` as the leader lists it.
async fn held(nodes: &[NodeProc], key: &str) -> Option<(String, u64)> {
    let leader = wait_leader(nodes, Duration::from_secs(30)).await;
    let locks = http_json(&nodes[leader].client_addr(), "/locks")
        .await
        .unwrap_or_else(|e| panic!("/locks on node {}: {e}", nodes[leader].id));
    let entry = locks["locks"]
        .as_array()?
        .iter()
        .find(|l| l["key"] == key)?;
    Some((
        entry["holder"].as_str()?.to_string(),
        entry["fencingToken"].as_u64()?,
    ))
}

async fn grant(nodes: &[NodeProc], key: &str, client: &str, request: &str) -> u64 {
    let leader = wait_leader(nodes, Duration::from_secs(30)).await;
    let mut ws = ws_connect(&nodes[leader].client_addr()).await;
    let reply = ws_request(&mut ws, &acquire(key, client, request, 300_000)).await;
    assert_eq!(reply["success"], true, "{reply}");
    token_of(&reply)
}

fn log_of(node: &NodeProc) -> String {
    std::fs::read_to_string(node.data_dir.with_extension("log")).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_killed_and_started_at_once_elects_and_keeps_its_locks() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = formed_cluster(dir.path()).await;
    // The member table (addresses and incarnations) is committed once the cluster's version
    // allows it; wait until every node has it in its storage.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut named = 0;
        for node in &nodes {
            let s = http_json(&node.client_addr(), "/status").await.unwrap();
            if s["clusterId"].as_str().is_some_and(|c| !c.is_empty()) {
                named += 1;
            }
        }
        if named == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "the cluster was never named");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let token = grant(&nodes, "batch", "settler", "r1").await;
    let ids: Vec<String> = {
        let mut v = Vec::new();
        for node in &nodes {
            let s = http_json(&node.client_addr(), "/status").await.unwrap();
            v.push(s["clusterId"].as_str().unwrap().to_string());
        }
        v
    };
    assert!(ids.iter().all(|c| *c == ids[0]), "{ids:?}");

    // A power cut: SIGKILL every node, then start them all again on their data.
    for node in &mut nodes {
        node.kill();
    }
    for node in &mut nodes {
        node.start();
    }
    let started = Instant::now();
    wait_leader(&nodes, Duration::from_secs(20)).await;
    println!("a leader {:?} after the restart", started.elapsed());
    assert_eq!(
        held(&nodes, "batch").await,
        Some(("settler".to_string(), token)),
        "the held lock did not survive the restart"
    );
    for node in &nodes {
        let s = wait_voters(node, &[1, 2, 3], Duration::from_secs(30)).await;
        assert_eq!(s["clusterId"].as_str(), Some(ids[0].as_str()), "{s}");
    }
    // New grants carry larger tokens.
    assert!(grant(&nodes, "next", "other", "r2").await > token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bootstrap_node_on_an_empty_volume_with_its_peers_down_grants_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = formed_cluster(dir.path()).await;
    let token = grant(&nodes, "batch", "settler", "r1").await;
    // Let the member table commit before the power cut.
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Every pod goes away; pod 1 comes back first, on an empty volume.
    for node in &mut nodes {
        node.kill();
    }
    std::fs::remove_dir_all(&nodes[0].data_dir).unwrap();
    let before = log_of(&nodes[0]).len();
    nodes[0].start();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let s = http_json(&nodes[0].client_addr(), "/status").await;
    assert!(
        s.is_err() || ids(s.as_ref().unwrap(), "voters").is_empty(),
        "node 1 started a cluster alone: {s:?}"
    );
    let (code, body) = http_get(&nodes[0].client_addr(), "/readyz").await.unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("not starting a new cluster"), "{body}");
    let log = log_of(&nodes[0])[before..].to_string();
    assert!(!log.contains("starting a new cluster;"), "{log}");
    assert!(!log.contains("bootstrapped"), "{log}");

    // Its peers return: one cluster again, node 1 replaced by its new incarnation, the lock
    // still held with its token, and tokens go on increasing.
    nodes[1].start();
    nodes[2].start();
    for node in &nodes {
        wait_voters(node, &[1, 2, 3], Duration::from_secs(90)).await;
    }
    assert_eq!(
        held(&nodes, "batch").await,
        Some(("settler".to_string(), token))
    );
    assert!(grant(&nodes, "next", "other", "r2").await > token);
    let log = log_of(&nodes[0]);
    assert!(log.contains("a cluster exists; joining it"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_flags_on_every_node_form_one_cluster_and_a_wiped_voter_comes_back_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    // All at once, as a Parallel StatefulSet starts its pods.
    let mut nodes = formed_cluster(dir.path()).await;
    let log1 = log_of(&nodes[0]);
    assert!(
        log1.contains("every peer answered that it has no data"),
        "{log1}"
    );
    let token = grant(&nodes, "batch", "settler", "r1").await;

    // Node 2 loses its volume and starts again with the same flags while the others run: it
    // joins, the leader replaces its old incarnation, and it is a voter again.
    nodes[1].kill();
    std::fs::remove_dir_all(&nodes[1].data_dir).unwrap();
    nodes[1].start();
    // Until its log holds the entry that admitted it, it keeps a mark and stays out of
    // elections; a voter again, it has dropped the mark.
    let mark = nodes[1].data_dir.join("awaiting-admission");
    for node in &nodes {
        wait_voters(node, &[1, 2, 3], Duration::from_secs(90)).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while mark.exists() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !mark.exists(),
        "a voter again, node 2 still awaits admission"
    );
    let log2 = log_of(&nodes[1]);
    assert!(log2.contains("admitted"), "{log2}");
    let leader = wait_leader(&nodes, Duration::from_secs(30)).await;
    let leader_log = log_of(&nodes[leader]);
    assert!(
        nodes[leader].id == 2 || leader_log.contains("old incarnation"),
        "{leader_log}"
    );
    assert_eq!(
        held(&nodes, "batch").await,
        Some(("settler".to_string(), token))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_member_is_removed_and_comes_back_with_its_data_as_a_learner() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = statefulset_nodes(dir.path(), 3);
    for node in &mut nodes {
        node.extra_args.extend([
            "--dead-member-timeout".into(),
            "3s".into(),
            "--min-voters".into(),
            "2".into(),
        ]);
        node.start();
    }
    for node in &nodes {
        wait_voters(node, &[1, 2, 3], Duration::from_secs(60)).await;
    }
    let token = grant(&nodes, "batch", "settler", "r1").await;
    // Node 3 goes away (a pod scaled down without the hook, a machine gone): the leader removes
    // it after the dead-member timeout, keeping two voters.
    let leader = wait_leader(&nodes, Duration::from_secs(30)).await;
    let victim = if leader == 2 { 1 } else { 2 };
    nodes[victim].kill();
    let survivors: Vec<u64> = (1..=3).filter(|&id| id != nodes[victim].id).collect();
    wait_voters(&nodes[leader], &survivors, Duration::from_secs(30)).await;
    // It comes back with its old data (a retained volume): it finds it was removed and joins
    // again as a learner, and is promoted once caught up.
    nodes[victim].start();
    for node in &nodes {
        wait_voters(node, &[1, 2, 3], Duration::from_secs(60)).await;
    }
    assert!(
        log_of(&nodes[victim]).contains("asking to join again"),
        "{}",
        log_of(&nodes[victim])
    );
    assert_eq!(
        held(&nodes, "batch").await,
        Some(("settler".to_string(), token))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_under_a_members_id_replaces_it_and_the_first_no_longer_counts() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = formed_cluster(dir.path()).await;
    let token = grant(&nodes, "batch", "settler", "r1").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A force-deleted pod's replacement starts on a new volume while the old process still
    // runs: node 2 again, with the same flags, its own ports and an empty data directory.
    let mut second = NodeProc::new(2, dir.path().join("node2-again"));
    second.extra_args = nodes[1].extra_args.clone();
    second.start();
    // The new incarnation becomes the member; the old process's Raft messages are refused.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = http_json(&second.client_addr(), "/status").await;
        if let Ok(s) = &s {
            if ids(s, "voters") == [1, 2, 3] && s["leaderId"].as_u64().unwrap_or(0) != 0 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the second process under id 2 did not become the member: {s:?}\n{}",
            log_of(&second)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let leader = wait_leader(&nodes, Duration::from_secs(30)).await;
    assert_ne!(leader, 1, "the old process of node 2 leads");
    // The old process, removed and replaced, keeps campaigning over the streams it opened while
    // it was the member; the others refuse what it sends as from an incarnation that is no
    // longer the member. (The new process's own streams, refused until the leader replaced the
    // old incarnation, are taken since: what is refused from here on is the old process's.)
    let refused = |text: &str| {
        metric_sum(
            text,
            "raftlock_peer_requests_refused_total",
            &["reason=\"incarnation\""],
        )
    };
    let (_, text) = http_get(&nodes[leader].client_addr(), "/metrics")
        .await
        .unwrap();
    let before = refused(&text);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (_, text) = http_get(&nodes[leader].client_addr(), "/metrics")
            .await
            .unwrap();
        if refused(&text) > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the old incarnation's messages were never refused (still {before})"
        );
    }
    let s = wait_voters(&second, &[1, 2, 3], Duration::from_secs(10)).await;
    assert_eq!(s["leaderId"].as_u64(), Some(nodes[leader].id), "{s}");
    assert_eq!(
        held(&nodes, "batch").await,
        Some(("settler".to_string(), token))
    );
    assert!(grant(&nodes, "next", "other", "r2").await > token);
    nodes[1].kill();
}
