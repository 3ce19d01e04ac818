//! Three real `lock-node` processes on 127.0.0.1: locks over WebSocket and gRPC, redirects, FIFO
//! hand-off with increasing tokens, TTL expiry, SIGKILL of the leader, joining and removing a
//! node, bad input, the timing of WebSocket requests in `/metrics`, plain and gRPC Raft
//! streams in one cluster, batches, and the commit delay's waits.

mod common;

use std::time::Duration;

use common::*;
use raftlock::server::proto::lock::lock_service_client::LockServiceClient;
use raftlock::server::proto::lock::{AcquireLockRequest, ReleaseLockRequest, RenewLockRequest};
use serde_json::{json, Value};

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);

fn acquire(key: &str, client: &str, request: &str, ttl: u64) -> Value {
    json!({"commandType": 3, "key": key, "clientId": client, "requestId": request, "ttl": ttl})
}

fn release(key: &str, client: &str, request: &str, token: u64) -> Value {
    json!({"commandType": 4, "key": key, "clientId": client, "requestId": request,
           "fencingToken": {"key": key, "value": token}})
}

fn token_of(reply: &Value) -> u64 {
    reply["fencingToken"]["value"]
        .as_u64()
        .unwrap_or_else(|| panic!("no token in {reply}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_over_websocket_and_grpc_with_redirects() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let leader_addr = cluster.nodes[(leader - 1) as usize].client_addr();

    // A follower asked for a redirect answers with the leader's client address.
    let follower = cluster.nodes.iter().find(|n| n.id != leader).unwrap();
    let mut ws = ws_connect(&follower.client_addr()).await;
    let mut redirect = acquire("orders", "w1", "r1", 10_000);
    redirect["redirect"] = json!(true);
    let reply = ws_request(&mut ws, &redirect).await;
    assert_eq!(reply["success"], false, "{reply}");
    assert_eq!(reply["error"]["code"], "NOT_LEADER", "{reply}");
    assert_eq!(reply["error"]["leaderId"], leader, "{reply}");
    assert_eq!(
        reply["error"]["leaderAddr"],
        leader_addr.as_str(),
        "{reply}"
    );

    // The seed's LockRequest / LockAcquireReply, unchanged.
    let mut ws = ws_connect(&leader_addr).await;
    let granted = ws_request(&mut ws, &acquire("orders", "w1", "r1", 10_000)).await;
    assert_eq!(granted["success"], true, "{granted}");
    assert_eq!(granted["key"], "orders");
    assert_eq!(granted["requestId"], "r1");
    assert_eq!(granted["expiresInMs"], 10_000);
    let token = token_of(&granted);
    // A retry of the same request returns the same grant, not a second one.
    let again = ws_request(&mut ws, &acquire("orders", "w1", "r1", 10_000)).await;
    assert_eq!(token_of(&again), token, "{again}");
    let released = ws_request(&mut ws, &release("orders", "w1", "r2", token)).await;
    assert_eq!(released["success"], true, "{released}");
    assert_eq!(released["released"], true, "{released}");

    // gRPC LockService on the same port.
    let mut grpc = LockServiceClient::connect(format!("http://{leader_addr}"))
        .await
        .unwrap();
    let r = grpc
        .acquire_lock(AcquireLockRequest {
            resource_name: "batch".into(),
            owner_id: "g1".into(),
            client_timeout_ms: 1_000,
            request_id: "g-r1".into(),
            ttl_ms: 5_000,
            ack_below: None,
            attach_to_session: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.acquired, "{r:?}");
    let grpc_token = r.fencing_token.unwrap().value;
    assert!(
        grpc_token > token,
        "one cluster-wide sequence: {grpc_token} > {token}"
    );
    assert_eq!(r.lease_id, grpc_token.to_string());
    let rel = grpc
        .release_lock(ReleaseLockRequest {
            resource_name: "batch".into(),
            owner_id: "g1".into(),
            fencing_token: grpc_token,
            request_id: "g-r2".into(),
            ack_below: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(rel.released, "{rel:?}");
    // A stale release is refused with a reason.
    let stale = ws_request(&mut ws, &release("orders", "w1", "r3", token)).await;
    assert_eq!(stale["success"], false, "{stale}");
    assert!(
        ["NOT_HOLDER", "STALE_TOKEN"].contains(&stale["error"]["code"].as_str().unwrap_or("")),
        "{stale}"
    );

    // HTTP endpoints.
    let status = http_json(&leader_addr, "/status").await.unwrap();
    assert_eq!(status["role"], "leader");
    assert_eq!(status["voters"].as_array().unwrap().len(), 3);
    let (code, body) = http_get(&leader_addr, "/readyz").await.unwrap();
    assert_eq!(code, 200, "{body}");
    let (code, metrics) = http_get(&leader_addr, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(metrics.contains("raftlock_is_leader 1"), "{metrics}");
    assert!(metrics.contains("raftlock_lock_grants_total"), "{metrics}");
    // The leader times heartbeats per peer and reports each peer's lag.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, metrics) = http_get(&leader_addr, "/metrics").await.unwrap();
        let timed_peers = metrics
            .lines()
            .filter(|l| l.starts_with("raftlock_peer_rtt_seconds_count{peer="))
            .filter(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) > Some(0.0))
            .count();
        let lagged_peers = metrics
            .lines()
            .filter(|l| l.starts_with("raftlock_replication_lag_entries{peer="))
            .count();
        if timed_peers == 2 && lagged_peers == 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "leader reports RTT for {timed_peers} and lag for {lagged_peers} of 2 peers:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Every node, followers included, lists every member with both of its addresses.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    for node in &cluster.nodes {
        loop {
            let members = http_json(&node.client_addr(), "/members").await.unwrap();
            let expected: Vec<(u64, String, String)> = cluster
                .nodes
                .iter()
                .map(|n| (n.id, n.peer_addr(), n.client_addr()))
                .collect();
            let listed: Vec<(u64, String, String)> = members["members"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    (
                        m["id"].as_u64().unwrap(),
                        m["peerAddr"].as_str().unwrap().to_string(),
                        m["clientAddr"].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            if listed == expected {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "node {} lists {listed:?}, expected {expected:?}",
                node.id
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_waiters_and_ttl_expiry_hand_off() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.nodes[(leader - 1) as usize].client_addr();
    let mut holder = ws_connect(&addr).await;
    let first = ws_request(&mut holder, &acquire("q", "holder", "h1", 30_000)).await;
    let mut last_token = token_of(&first);

    // Three waiters queue in order.
    let mut waiters = Vec::new();
    for i in 0..3 {
        let mut ws = ws_connect(&addr).await;
        ws_send(
            &mut ws,
            &acquire("q", &format!("w{i}"), &format!("w{i}-r"), 30_000),
        )
        .await;
        // Give each request time to be queued before the next one.
        assert!(
            ws_recv(&mut ws, Duration::from_millis(300)).await.is_none(),
            "w{i} must wait"
        );
        waiters.push(ws);
    }
    // Release: w0 is granted, then w1, then w2 — strictly increasing tokens.
    let mut current_holder = ("holder".to_string(), "h2".to_string(), holder);
    for (i, mut ws) in waiters.into_iter().enumerate() {
        let (client, req, mut hws) = current_holder;
        let r = ws_request(&mut hws, &release("q", &client, &req, last_token)).await;
        assert_eq!(r["success"], true, "{r}");
        let grant = ws_recv(&mut ws, Duration::from_secs(5))
            .await
            .expect("granted in order");
        assert_eq!(grant["success"], true, "{grant}");
        assert_eq!(grant["requestId"], format!("w{i}-r"));
        let token = token_of(&grant);
        assert!(token > last_token, "token {token} must exceed {last_token}");
        last_token = token;
        current_holder = (format!("w{i}"), format!("w{i}-rel"), ws);
    }

    // TTL expiry hands the lock to the next waiter without a release.
    let mut a = ws_connect(&addr).await;
    let ga = ws_request(&mut a, &acquire("ttl", "a", "a1", 500)).await;
    let ta = token_of(&ga);
    let mut b = ws_connect(&addr).await;
    ws_send(&mut b, &acquire("ttl", "b", "b1", 5_000)).await;
    let gb = ws_recv(&mut b, Duration::from_secs(5))
        .await
        .expect("b granted after a's lease ran out");
    assert_eq!(gb["success"], true, "{gb}");
    assert!(token_of(&gb) > ta);
    // a's late release is refused.
    let late = ws_request(&mut a, &release("ttl", "a", "a2", ta)).await;
    assert_eq!(late["success"], false, "{late}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_sigkill_keeps_locks_and_queue() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.node(leader).client_addr();
    let mut holder = ws_connect(&addr).await;
    let held = ws_request(&mut holder, &acquire("k", "holder", "h1", 60_000)).await;
    let held_token = token_of(&held);
    let mut w = ws_connect(&addr).await;
    ws_send(&mut w, &acquire("k", "waiter", "w1", 60_000)).await;
    assert!(ws_recv(&mut w, Duration::from_millis(300)).await.is_none());

    cluster.node(leader).kill();
    let new_leader = {
        let deadline = std::time::Instant::now() + LEADER_TIMEOUT;
        loop {
            let l = cluster.wait_for_leader(LEADER_TIMEOUT).await;
            if l != leader {
                break l;
            }
            assert!(std::time::Instant::now() < deadline, "no new leader");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let new_addr = cluster.node(new_leader).client_addr();
    let locks = http_json(&new_addr, "/locks").await.unwrap();
    let entry = &locks["locks"][0];
    assert_eq!(entry["key"], "k", "{locks}");
    assert_eq!(entry["holder"], "holder", "{locks}");
    assert_eq!(entry["fencingToken"], held_token, "{locks}");
    assert_eq!(entry["waiters"][0], "waiter", "{locks}");

    // The waiter re-attaches with the same request id, the holder releases, the waiter is next.
    let mut w = ws_connect(&new_addr).await;
    ws_send(&mut w, &acquire("k", "waiter", "w1", 60_000)).await;
    let mut h = ws_connect(&new_addr).await;
    let r = ws_request(&mut h, &release("k", "holder", "h2", held_token)).await;
    assert_eq!(r["success"], true, "{r}");
    let g = ws_recv(&mut w, Duration::from_secs(5))
        .await
        .expect("waiter granted");
    assert_eq!(g["success"], true, "{g}");
    assert!(token_of(&g) > held_token);

    // The killed node restarts and catches up.
    cluster.node(leader).start();
    let target = http_json(&new_addr, "/status").await.unwrap()["commitIndex"]
        .as_u64()
        .unwrap();
    let old_addr = cluster.node(leader).client_addr();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(s) = http_json(&old_addr, "/status").await {
            if s["appliedIndex"].as_u64().unwrap_or(0) >= target {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "restarted node did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its lock state, rebuilt from what it had written before the SIGKILL plus the entries it
    // re-applied from its log, is the leader's.
    let restarted = http_json(&old_addr, "/locks").await.unwrap();
    let current = http_json(&new_addr, "/locks").await.unwrap();
    // Replicated state only: the time left on a lease is the leader's own view.
    let replicated = |v: &serde_json::Value| {
        let mut locks = v["locks"].clone();
        for lock in locks.as_array_mut().into_iter().flatten() {
            if let Some(obj) = lock.as_object_mut() {
                obj.remove("expiresInMs");
            }
        }
        locks
    };
    assert_eq!(replicated(&restarted), replicated(&current));
    assert_eq!(restarted["locks"][0]["holder"], "waiter", "{restarted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_through_a_follower_then_remove() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let follower = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .unwrap()
        .peer_addr();
    let mut fourth = NodeProc::new(4, cluster.dir.path().join("node4"));
    fourth.extra_args = vec!["--join".into(), follower];
    fourth.start();
    let leader_addr = cluster.node(leader).client_addr();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = http_json(&leader_addr, "/status").await.unwrap();
        let voters: Vec<u64> = s["voters"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_u64())
            .collect();
        if voters.contains(&4) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node 4 never became a voter: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Remove it through the peer RPC (what `lockctl members remove` calls).
    let mut peer = raftlock::server::proto::peer::peer_client::PeerClient::connect(format!(
        "http://{}",
        cluster.node(leader).peer_addr()
    ))
    .await
    .unwrap();
    let reply = peer
        .remove_server(raftlock::server::proto::peer::RemoveServerRequest { server_id: 4 })
        .await
        .unwrap()
        .into_inner();
    assert!(reply.success, "{reply:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = http_json(&leader_addr, "/status").await.unwrap();
        if s["voters"].as_array().unwrap().len() == 3
            && s["learners"].as_array().unwrap().is_empty()
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "cluster not back to three: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fourth.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_errors_and_changes_nothing() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.nodes[(leader - 1) as usize].client_addr();
    // One good request first: everything the new leader proposes by itself (its no-op, the
    // cluster's limits) commits before it.
    let mut warmup = ws_connect(&addr).await;
    let ok = ws_request(&mut warmup, &acquire("warmup", "c", "w", 1_000)).await;
    assert_eq!(ok["success"], true, "{ok}");
    // The leader also commits entries of its own while the test runs (the log clock's ticks), so
    // "nothing reached the log" is judged by the client proposals it committed or refused.
    let proposals = |text: String| {
        [
            "raftlock_proposals_committed_total",
            "raftlock_proposals_failed_total",
        ]
        .map(|name| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name} missing from /metrics"))
        })
    };
    let (code, text) = http_get(&addr, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    let before = proposals(text);
    let mut ws = ws_connect(&addr).await;
    let cases: Vec<(String, &str)> = vec![
        ("{not json".into(), "INVALID_REQUEST"),
        (
            json!({"commandType": 99, "key": "k", "clientId": "c"}).to_string(),
            "INVALID_REQUEST",
        ),
        (
            json!({"commandType": 3, "key": "k".repeat(100_000), "clientId": "c"}).to_string(),
            "TOO_LARGE",
        ),
        (
            json!({"commandType": "three", "key": "k", "clientId": "c"}).to_string(),
            "INVALID_REQUEST",
        ),
        (
            json!({"commandType": 3, "key": "k", "clientId": "c", "ttl": -5}).to_string(),
            "INVALID_REQUEST",
        ),
        (
            json!({"commandType": 4, "key": "k", "clientId": "c", "fencingToken": {"value": "x"}})
                .to_string(),
            "INVALID_REQUEST",
        ),
        (
            json!({"commandType": 0, "key": "k", "clientId": "c"}).to_string(),
            "INVALID_REQUEST",
        ),
    ];
    for (text, code) in &cases {
        ws_send_raw(&mut ws, text).await;
        let reply = ws_recv(&mut ws, Duration::from_secs(5))
            .await
            .expect("an error reply");
        assert_eq!(reply["success"], false, "{reply}");
        assert_eq!(
            reply["error"]["code"],
            *code,
            "for {}: {reply}",
            &text[..text.len().min(60)]
        );
    }
    // The same over gRPC: an error code each, nothing proposed.
    let mut grpc = LockServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let grpc_cases = vec![
        (String::new(), "g", 1_000u64, "INVALID_REQUEST"),
        ("k".repeat(100_000), "g", 1_000, "TOO_LARGE"),
        ("k".into(), "", 1_000, "INVALID_REQUEST"),
        ("k".into(), "g", u64::MAX, "INVALID_REQUEST"),
    ];
    for (key, owner, ttl, code) in grpc_cases {
        let r = grpc
            .acquire_lock(AcquireLockRequest {
                resource_name: key.clone(),
                owner_id: owner.into(),
                client_timeout_ms: 0,
                request_id: "bad".into(),
                ttl_ms: ttl,
                ack_below: None,
                attach_to_session: false,
            })
            .await;
        match r {
            Ok(resp) => {
                let resp = resp.into_inner();
                assert!(!resp.acquired);
                assert_eq!(
                    resp.error_code,
                    code,
                    "key {} bytes, owner {owner:?}, ttl {ttl}",
                    key.len()
                );
            }
            // A message over the transport's size limit is refused by gRPC itself.
            Err(status) => assert!(key.len() > 1000, "unexpected gRPC failure: {status}"),
        }
    }
    // Nothing was proposed.
    let (code, text) = http_get(&addr, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        proposals(text),
        before,
        "bad input must not reach the log (client proposals committed, failed)"
    );
    let locks = http_json(&addr, "/locks").await.unwrap();
    assert!(
        locks["locks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["key"] == "warmup"),
        "{locks}"
    );
    // The connection still works.
    let ok = ws_request(&mut ws, &acquire("fine", "c", "r", 1_000)).await;
    assert_eq!(ok["success"], true, "{ok}");
}

/// SIGTERM on the leader: leadership moves to another node, the process exits 0, held locks
/// keep holder and token, and the node comes back with its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_on_the_leader_hands_over_and_exits_cleanly() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.node(leader).client_addr();
    let mut ws = ws_connect(&addr).await;
    let held = ws_request(&mut ws, &acquire("kept", "holder", "h1", 60_000)).await;
    let token = token_of(&held);
    let term_before = http_json(&addr, "/status").await.unwrap()["term"]
        .as_u64()
        .unwrap();
    let status = cluster.node(leader).terminate().expect("exit status");
    assert!(status.success(), "lock-node exited with {status}");
    let new_leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    assert_ne!(new_leader, leader);
    let new_addr = cluster.node(new_leader).client_addr();
    let s = http_json(&new_addr, "/status").await.unwrap();
    assert!(s["term"].as_u64().unwrap() > term_before);
    let log = cluster.log_of(leader);
    assert!(
        log.contains("transfer"),
        "the leader should hand over before exiting; its log:\n{log}"
    );
    let locks = http_json(&new_addr, "/locks").await.unwrap();
    assert_eq!(locks["locks"][0]["holder"], "holder", "{locks}");
    assert_eq!(locks["locks"][0]["fencingToken"], token, "{locks}");
    cluster.node(leader).start();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(s) = http_json(&cluster.node(leader).client_addr(), "/locks").await {
            if s["locks"][0]["fencingToken"] == token {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "restarted node did not recover the lock"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `--snapshot-bytes` compacts the log once that many bytes were appended, even when the entry
/// count threshold is far away; a node that was down meanwhile catches up from a snapshot the
/// leader encodes for it (compaction alone encodes none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_is_compacted_by_bytes() {
    let mut cluster = Cluster::start_with(3, |_| {
        vec![
            "--snapshot-entries".into(),
            "1000000".into(),
            "--snapshot-bytes".into(),
            "1000".into(),
        ]
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let follower = cluster.nodes.iter().find(|n| n.id != leader).unwrap().id;
    cluster.node(follower).kill();
    let addr = cluster.node(leader).client_addr();
    let mut ws = ws_connect(&addr).await;
    for i in 0..60 {
        let r = ws_request(
            &mut ws,
            &acquire(&format!("key-{i:03}"), "c", &format!("r{i}"), 60_000),
        )
        .await;
        assert_eq!(r["success"], true, "{r}");
    }
    let snapshots = |metrics: &str, kind: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("raftlock_snapshots_total") && l.contains(&format!("\"{kind}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let (_, metrics) = http_get(&addr, "/metrics").await.unwrap();
    assert!(
        snapshots(&metrics, "taken") >= 1.0,
        "log not compacted:\n{metrics}"
    );
    // The follower that stayed up compacts its log too, and encodes nothing for that: no
    // follower of its own needs a snapshot.
    let other = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader && n.id != follower)
        .unwrap()
        .id;
    let (_, metrics) = http_get(&cluster.node(other).client_addr(), "/metrics")
        .await
        .unwrap();
    assert!(
        snapshots(&metrics, "taken") >= 1.0,
        "the live follower did not compact:\n{metrics}"
    );
    assert_eq!(
        snapshots(&metrics, "encoded"),
        0.0,
        "compaction encoded a snapshot:\n{metrics}"
    );
    cluster.node(follower).start();
    let f_addr = cluster.node(follower).client_addr();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(s) = http_json(&f_addr, "/status").await {
            if s["locksHeld"] == 60 {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "follower did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The leader encodes a snapshot for the stopped follower either when it compacts past it
    // (it knows that follower needs one) or when the follower comes back, depending on how far
    // its appends to the stopped follower had got: counted after the catch-up, it is one or
    // more either way. (The follower that stayed up, which compacted too and needs none, encoded
    // nothing, above.)
    let (_, metrics) = http_get(&addr, "/metrics").await.unwrap();
    assert!(
        snapshots(&metrics, "encoded") >= 1.0,
        "no snapshot encoded for the follower:\n{metrics}"
    );
    let (_, metrics) = http_get(&f_addr, "/metrics").await.unwrap();
    assert!(
        snapshots(&metrics, "installed") >= 1.0,
        "the follower installed no snapshot:\n{metrics}"
    );
}

/// With a cluster token, a peer call without it (or with a wrong one) is refused and changes
/// nothing; a Raft stream that names no sender node is refused even with the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_the_cluster_token_are_refused() {
    use raftlock::server::proto::peer::{
        peer_client::PeerClient, RaftMessage, RemoveServerRequest,
    };
    let cluster = Cluster::start_with(3, |_| vec!["--cluster-token".into(), "s3cret-token".into()]);
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let leader_node = cluster.nodes.iter().find(|n| n.id == leader).unwrap();
    let mut peer = PeerClient::connect(format!("http://{}", leader_node.peer_addr()))
        .await
        .unwrap();
    for token in [None, Some("s3cret-tokex"), Some("s3cret-token-and-more")] {
        let mut request = tonic::Request::new(RemoveServerRequest { server_id: 2 });
        if let Some(t) = token {
            request
                .metadata_mut()
                .insert("x-raftlock-cluster-token", t.parse().unwrap());
        }
        let status = peer.remove_server(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{token:?}");
    }
    // A stream with the token but without the sender's node id.
    let mut request = tonic::Request::new(futures::stream::iter(Vec::<RaftMessage>::new()));
    request
        .metadata_mut()
        .insert("x-raftlock-cluster-token", "s3cret-token".parse().unwrap());
    let status = peer.raft(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    // Nothing changed: still three voters.
    let s = http_json(&leader_node.client_addr(), "/status")
        .await
        .unwrap();
    assert_eq!(s["voters"].as_array().unwrap().len(), 3, "{s}");
}

/// A follower that lost its data directory and is started again with its old flags refuses to
/// start, saying why (it would vote without the entries it acknowledged, and the leader would
/// never resend them); the rest of the cluster goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_voter_that_lost_its_data_refuses_to_start() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.node(leader).client_addr();
    let mut ws = ws_connect(&addr).await;
    let held = ws_request(&mut ws, &acquire("k", "c", "r1", 60_000)).await;
    assert_eq!(held["success"], true, "{held}");
    let follower = (1..=3).find(|&id| id != leader).unwrap();
    // The leader must have matched the follower's log before the data goes.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = http_json(&addr, "/status").await.unwrap();
        let matched = s["replication"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["id"] == follower)
            .and_then(|r| r["matchIndex"].as_u64())
            .unwrap_or(0);
        if matched > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "follower never matched: {s}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.node(follower).kill();
    let data = cluster.node(follower).data_dir.clone();
    std::fs::remove_dir_all(&data).unwrap();
    cluster.node(follower).start();
    let status = {
        let child = cluster.node(follower).child.as_mut().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "a node that lost its data kept running"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    cluster.node(follower).child = None;
    assert!(!status.success());
    let log = cluster.log_of(follower);
    assert!(log.contains("lost its data"), "{log}");
    // Nothing changed for the others: the lock is still held, the node is still a member.
    let locks = http_json(&addr, "/locks").await.unwrap();
    assert_eq!(locks["locks"][0]["holder"], "c", "{locks}");
}

/// On the leader's `/metrics` `text`: the acquires' total time in `front` (a histogram of the
/// node's client port) is at least their total time in the driver, and not zero.
fn assert_acquires_enclose_the_driver(text: &str, front: &str) {
    let at_front = metric_sum(text, &format!("{front}_sum{{"), &["op=\"acquire\""]);
    let in_driver = metric_sum(
        text,
        "raftlock_request_duration_seconds_sum{",
        &["op=\"acquire\""],
    );
    assert!(
        in_driver > 0.0 && at_front >= in_driver,
        "leader: acquires took {at_front} s in {front} and {in_driver} s in the driver"
    );
}

fn ws_timed(op: &str) -> String {
    format!("raftlock_websocket_request_duration_seconds_count{{op=\"{op}\"")
}

/// `addr`'s `/metrics` once its WebSocket request counts reach `expected` (bounded wait: a
/// connection's writer records a request just after writing its answer, so a client may read
/// the answer a moment before the count moves), asserting that each count is exactly that.
async fn metrics_once_timed(addr: &str, who: &str, expected: &[(&str, u64)]) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = http_get(addr, "/metrics").await.expect("metrics").1;
        let reached = expected
            .iter()
            .all(|(op, n)| metric_sum(&text, &ws_timed(op), &[]) >= *n as f64);
        if reached || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for (op, n) in expected {
        assert_eq!(
            metric_sum(&text, &ws_timed(op), &[]),
            *n as f64,
            "{who}: {op} requests timed at its WebSocket"
        );
    }
    text
}

/// Acquire/release cycles on fresh keys over one WebSocket connection to `addr`, then one
/// malformed frame; each frame is answered once (errors included).
async fn cycles_on(addr: &str, name: &str, cycles: u64) {
    let mut ws = ws_connect(addr).await;
    for i in 0..cycles {
        let key = format!("timed-{name}-{i}");
        ws_send(&mut ws, &acquire(&key, name, &format!("a{i}"), 10_000)).await;
        let granted = ws_recv(&mut ws, Duration::from_secs(10))
            .await
            .expect("an answer to the acquire");
        let token = granted["fencingToken"]["value"].as_u64().unwrap_or(0);
        ws_send(&mut ws, &release(&key, name, &format!("r{i}"), token)).await;
        ws_recv(&mut ws, Duration::from_secs(10))
            .await
            .expect("an answer to the release");
    }
    ws_send_raw(&mut ws, "{not json").await;
    let reply = ws_recv(&mut ws, Duration::from_secs(10))
        .await
        .expect("an answer to the malformed frame");
    assert_eq!(reply["error"]["code"], "INVALID_REQUEST", "{reply}");
}

/// `raftlock_websocket_request_duration_seconds` counts each WebSocket request once, on the node
/// whose connection it came in on, by operation (frames it could not understand as `invalid`),
/// and its time encloses the time the executing driver spent on the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_requests_are_timed_from_frame_to_answer() {
    const CYCLES: u64 = 5;
    let expected = [("acquire", CYCLES), ("release", CYCLES), ("invalid", 1)];
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let leader_addr = cluster.nodes[(leader - 1) as usize].client_addr();
    let (_, follower_addr) = follower_knowing(&cluster, leader).await;

    cycles_on(&leader_addr, "on-leader", CYCLES).await;
    let text = metrics_once_timed(&leader_addr, "leader", &expected).await;
    // Each acquire's time at the WebSocket encloses its time in the leader's driver.
    assert_acquires_enclose_the_driver(&text, "raftlock_websocket_request_duration_seconds");

    // Requests sent to a follower are timed there, forwarding included, and not on the leader,
    // which executes them.
    cycles_on(&follower_addr, "on-follower", CYCLES).await;
    metrics_once_timed(&follower_addr, "follower", &expected).await;
    let text = http_get(&leader_addr, "/metrics").await.expect("metrics").1;
    assert_eq!(
        metric_sum(&text, &ws_timed("acquire"), &[]),
        CYCLES as f64,
        "the leader timed the follower's forwarded acquires as its own WebSocket requests"
    );
}

/// The node's count of `op` requests timed at its gRPC service `raftlock.lock.v1.LockService`.
fn grpc_count(text: &str, op: &str) -> f64 {
    let op = format!("op=\"{op}\"");
    metric_sum(
        text,
        "raftlock_grpc_request_duration_seconds_count{",
        &[&op, "service=\"raftlock.lock.v1.LockService\""],
    )
}

/// Acquire, renew and release cycles on fresh keys over gRPC to `addr`; every answer a success.
async fn grpc_cycles_on(addr: &str, name: &str, cycles: u64) {
    let mut grpc = LockServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    for i in 0..cycles {
        let key = format!("grpc-timed-{name}-{i}");
        let got = grpc
            .acquire_lock(AcquireLockRequest {
                resource_name: key.clone(),
                owner_id: name.into(),
                client_timeout_ms: 1_000,
                request_id: format!("{name}-a{i}"),
                ttl_ms: 10_000,
                ack_below: None,
                attach_to_session: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(got.acquired, "{got:?}");
        let token = got.fencing_token.unwrap().value;
        let renewed = grpc
            .renew_lock(RenewLockRequest {
                resource_name: key.clone(),
                owner_id: name.into(),
                fencing_token: token,
                ttl_ms: 10_000,
                request_id: format!("{name}-n{i}"),
                ack_below: None,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(renewed.renewed, "{renewed:?}");
        let released = grpc
            .release_lock(ReleaseLockRequest {
                resource_name: key,
                owner_id: name.into(),
                fencing_token: token,
                request_id: format!("{name}-r{i}"),
                ack_below: None,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(released.released, "{released:?}");
    }
}

/// `addr`'s gRPC request counts by operation once they reach `n` each (bounded wait), asserted
/// to be exactly `n`.
async fn grpc_counts_once_timed(addr: &str, who: &str, n: u64) -> String {
    let ops = ["acquire", "renew", "release"];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = http_get(addr, "/metrics").await.expect("metrics").1;
        let reached = ops.iter().all(|op| grpc_count(&text, op) >= n as f64);
        if reached || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for op in ops {
        assert_eq!(
            grpc_count(&text, op),
            n as f64,
            "{who}: {op} requests timed at its gRPC service"
        );
    }
    text
}

/// `raftlock_grpc_request_duration_seconds` counts each gRPC request once, on the node it was
/// sent to, by operation, and an acquire's time there encloses its time in the leader's driver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_requests_are_timed_at_the_client_port() {
    const CYCLES: u64 = 4;
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let leader_addr = cluster.nodes[(leader - 1) as usize].client_addr();
    let (_, follower_addr) = follower_knowing(&cluster, leader).await;

    grpc_cycles_on(&leader_addr, "g-leader", CYCLES).await;
    let text = grpc_counts_once_timed(&leader_addr, "leader", CYCLES).await;
    assert_acquires_enclose_the_driver(&text, "raftlock_grpc_request_duration_seconds");
    // None of these went over the WebSocket.
    assert_eq!(metric_sum(&text, &ws_timed("acquire"), &[]), 0.0);

    // A follower times what it was sent (forwarded to the leader); the leader does not count it.
    grpc_cycles_on(&follower_addr, "g-follower", CYCLES).await;
    grpc_counts_once_timed(&follower_addr, "follower", CYCLES).await;
    let text = http_get(&leader_addr, "/metrics").await.expect("metrics").1;
    assert_eq!(
        grpc_count(&text, "acquire"),
        CYCLES as f64,
        "the leader timed the follower's forwarded acquires as its own gRPC requests"
    );
}

/// Three nodes of this RaftLock say so on their peer streams; the leader then raises the
/// cluster version, and every node reports it (/status and `raftlock_cluster_version`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_version_is_raised_once_every_member_runs_it() {
    let cluster = Cluster::start(3);
    cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let expected = raftlock::lock::CLUSTER_VERSION;
    for node in &cluster.nodes {
        let addr = node.client_addr();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let status = loop {
            let status = http_json(&addr, "/status").await.unwrap();
            if status["clusterVersion"] == expected || std::time::Instant::now() > deadline {
                break status;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            status["clusterVersion"], expected,
            "node {}: {status}",
            node.id
        );
        let text = http_get(&addr, "/metrics").await.expect("metrics").1;
        assert_eq!(
            metric_sum(&text, "raftlock_cluster_version ", &[]),
            f64::from(expected),
            "node {}",
            node.id
        );
    }

    // A node that says it runs an older version is refused when it asks to join, and the
    // configuration does not change.
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let leader_node = &cluster.nodes[(leader - 1) as usize];
    let mut peer = raftlock::server::proto::peer::peer_client::PeerClient::connect(format!(
        "http://{}",
        leader_node.peer_addr()
    ))
    .await
    .unwrap();
    let reply = peer
        .join_cluster(raftlock::server::proto::peer::JoinClusterRequest {
            server_id: 9,
            server_addr: "127.0.0.1:1".into(),
            client_addr: "127.0.0.1:2".into(),
            version: expected - 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!reply.success, "{reply:?}");
    assert!(
        reply.error.contains("cluster is at version"),
        "{}",
        reply.error
    );
    let status = http_json(&leader_node.client_addr(), "/status")
        .await
        .unwrap();
    assert_eq!(status["voters"].as_array().unwrap().len(), 3, "{status}");
    assert!(
        status["learners"].as_array().unwrap().is_empty(),
        "{status}"
    );
}

/// A node set to `--peer-stream grpc` in a cluster whose other nodes use plain Raft streams (the
/// default): it sends its Raft messages over `Peer.Raft`, the others send to it and to each other
/// over plain streams on the same peer ports, and locks work through every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_grpc_raft_streams_mix_in_one_cluster() {
    let cluster = Cluster::start_with(3, |n| {
        if n.id == 2 {
            vec!["--peer-stream".into(), "grpc".into()]
        } else {
            Vec::new()
        }
    });
    cluster.wait_for_leader(LEADER_TIMEOUT).await;
    for node in &cluster.nodes {
        let client = raftlock::client::RaftLockClient::builder()
            .endpoints([node.client_addr()])
            .client_id(format!("mixed-{}", node.id))
            .prefer_leader(false)
            .build()
            .unwrap();
        let held = client.acquire("mixed/k").await.expect("acquire");
        assert!(held.fencing_token() > 0);
        held.release().await.expect("release");
    }
    for node in &cluster.nodes {
        let (_, text) = http_get(&node.client_addr(), "/metrics")
            .await
            .expect("metrics");
        let opened = |kind: &str| {
            metric_sum(
                &text,
                &format!("raftlock_peer_streams_opened_total{{kind=\"{kind}\""),
                &[],
            )
        };
        let (plain, grpc) = (opened("plain"), opened("grpc"));
        if node.id == 2 {
            assert!(
                grpc > 0.0 && plain == 0.0,
                "node 2: plain {plain}, grpc {grpc}"
            );
        } else {
            assert!(
                plain > 0.0 && grpc == 0.0,
                "node {}: plain {plain}, grpc {grpc}",
                node.id
            );
        }
    }
}

/// Several requests in one WebSocket frame (a JSON array): each runs and is answered as if it
/// had come alone, and takes one of the connection's in-flight slots; a batch that is empty,
/// too long or not a JSON array is refused whole and runs nothing. The upgrade's answer says
/// the node takes batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_requests_in_one_frame() {
    let cluster = Cluster::start_with(3, |_| {
        vec!["--max-inflight-per-connection".into(), "4".into()]
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    let (mut ws, response) = tokio_tungstenite::connect_async(format!("ws://{addr}/ws"))
        .await
        .expect("connect");
    assert_eq!(response.headers()["raftlock-batch-max"], "64");
    assert!(
        response
            .headers()
            .contains_key("raftlock-max-message-bytes"),
        "{:?}",
        response.headers()
    );
    let ok = ws_request(&mut ws, &acquire("warmup", "c", "w", 1_000)).await;
    assert_eq!(ok["success"], true, "{ok}");

    // Two acquires and a request the node does not know, in one frame.
    let batch = json!([
        acquire("batch/1", "c", "b1", 10_000),
        acquire("batch/2", "c", "b2", 10_000),
        {"commandType": 99, "key": "batch/3", "clientId": "c", "requestId": "b3"},
    ]);
    ws_send(&mut ws, &batch).await;
    let mut answers = std::collections::BTreeMap::new();
    while answers.len() < 3 {
        let r = ws_recv(&mut ws, Duration::from_secs(10))
            .await
            .expect("an answer to each request of the batch");
        answers.insert(r["requestId"].as_str().unwrap().to_string(), r);
    }
    assert_eq!(answers["b1"]["success"], true, "{}", answers["b1"]);
    assert_eq!(answers["b2"]["success"], true, "{}", answers["b2"]);
    assert_eq!(answers["b1"]["key"], "batch/1");
    assert!(token_of(&answers["b1"]) != token_of(&answers["b2"]));
    assert_eq!(
        error_code(&answers["b3"]),
        "INVALID_REQUEST",
        "{}",
        answers["b3"]
    );

    // Refused whole: one answer each, without a request id, and nothing runs.
    let too_long = Value::Array(
        (0..65)
            .map(|i| acquire("batch/long", &format!("x{i}"), &format!("l{i}"), 10_000))
            .collect(),
    );
    for bad in [
        "[]".to_string(),
        too_long.to_string(),
        "[{\"commandType\":3,".into(),
    ] {
        ws_send_raw(&mut ws, &bad).await;
        let r = ws_recv(&mut ws, Duration::from_secs(10))
            .await
            .expect("an answer");
        assert_eq!(error_code(&r), "INVALID_REQUEST", "{bad}: {r}");
        assert!(r.get("requestId").is_none_or(Value::is_null), "{r}");
    }
    let mut other = ws_connect(&addr).await;
    let free = json!({"commandType": 3, "key": "batch/long", "clientId": "y",
                      "requestId": "y1", "ttl": 10_000, "waitTimeout": 0});
    let r = ws_request(&mut other, &free).await;
    assert_eq!(
        r["success"], true,
        "no request of the refused batch ran: {r}"
    );

    // Each request takes an in-flight slot: four waiters fill the connection's four, and the
    // last two of the batch are answered BUSY at once.
    let waiters = Value::Array(
        (1..=6)
            .map(|i| {
                json!({"commandType": 3, "key": "batch/long", "clientId": format!("w{i}"),
                       "requestId": format!("q{i}"), "ttl": 10_000, "waitTimeout": 30_000})
            })
            .collect(),
    );
    ws_send(&mut ws, &waiters).await;
    let mut busy = Vec::new();
    while busy.len() < 2 {
        let r = ws_recv(&mut ws, Duration::from_secs(10))
            .await
            .expect("BUSY answers for the requests over the limit");
        assert_eq!(error_code(&r), "BUSY", "{r}");
        busy.push(r["requestId"].as_str().unwrap().to_string());
    }
    busy.sort();
    assert_eq!(busy, ["q5", "q6"]);
    // A waiter is granted once the holder releases (the requests of a batch run side by side,
    // as requests in frames of their own do: which one queued first is not fixed).
    let r = ws_request(&mut other, &release("batch/long", "y", "y2", token_of(&r))).await;
    assert_eq!(r["success"], true, "{r}");
    let granted = ws_recv(&mut ws, Duration::from_secs(10))
        .await
        .expect("the head waiter's grant");
    assert!(
        ["q1", "q2", "q3", "q4"].contains(&granted["requestId"].as_str().unwrap_or("")),
        "{granted}"
    );
    assert_eq!(granted["success"], true, "{granted}");
    let metrics = http_get(&addr, "/metrics").await.unwrap().1;
    assert!(
        metric_sum(&metrics, "raftlock_websocket_batched_requests_total", &[]) >= 9.0,
        "the three and the six batched requests are counted"
    );

    // gRPC's Batch: each operation answered on the stream with its index.
    use raftlock::server::proto::lock::{batch_operation::Op, batch_response::Result as Answer};
    use raftlock::server::proto::lock::{BatchOperation, BatchRequest};
    let mut grpc = LockServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let grpc_acquire = |key: &str, id: &str| AcquireLockRequest {
        resource_name: key.into(),
        owner_id: "g".into(),
        client_timeout_ms: 0,
        request_id: id.into(),
        ttl_ms: 10_000,
        ack_below: None,
        attach_to_session: false,
    };
    let operations = vec![
        BatchOperation {
            op: Some(Op::Acquire(grpc_acquire("grpc/1", "g1"))),
        },
        BatchOperation {
            op: Some(Op::Release(ReleaseLockRequest {
                resource_name: "grpc/none".into(),
                owner_id: "g".into(),
                fencing_token: 1,
                request_id: "g2".into(),
                ack_below: None,
            })),
        },
        BatchOperation {
            op: Some(Op::Acquire(grpc_acquire("grpc/3", "g3"))),
        },
    ];
    let mut stream = grpc
        .batch(BatchRequest { operations })
        .await
        .expect("the batch is taken")
        .into_inner();
    let mut answers = std::collections::BTreeMap::new();
    while let Some(answer) = stream.message().await.expect("the stream") {
        answers.insert(answer.index, answer.result.expect("a result"));
    }
    assert_eq!(answers.len(), 3, "{answers:?}");
    match (&answers[&0], &answers[&1], &answers[&2]) {
        (Answer::Acquire(a), Answer::Release(r), Answer::Acquire(c)) => {
            assert!(a.acquired && c.acquired, "{a:?} {c:?}");
            assert!(!r.released && !r.error_code.is_empty(), "{r:?}");
        }
        other => panic!("answers out of place: {other:?}"),
    }
    // Refused whole: empty, too long, an operation that names none.
    let too_long = (0..65)
        .map(|i| BatchOperation {
            op: Some(Op::Acquire(grpc_acquire("grpc/long", &format!("l{i}")))),
        })
        .collect();
    for operations in [vec![], too_long, vec![BatchOperation { op: None }]] {
        let err = grpc
            .batch(BatchRequest { operations })
            .await
            .expect_err("refused whole");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    }
    let other_owner = AcquireLockRequest {
        owner_id: "h".into(),
        ..grpc_acquire("grpc/long", "free")
    };
    let r = grpc.acquire_lock(other_owner).await.unwrap().into_inner();
    assert!(r.acquired, "no operation of the refused batch ran: {r:?}");
}

/// `rounds` hand-offs of one key between two WebSocket clients on `addr`: each release's commit
/// answers the holder and grants the waiter; the old holder queues again at once, the new one
/// releases only 3 ms later. Checks every grant and its token, and returns the node's metrics.
async fn hand_offs_with_a_late_release(addr: &str, rounds: usize) -> String {
    let key = "handoff/late";
    let mut holder = (ws_connect(addr).await, "a");
    let mut waiter = (ws_connect(addr).await, "b");
    let r = ws_request(&mut holder.0, &acquire(key, "a", "a0", 30_000)).await;
    assert_eq!(r["success"], true, "{r}");
    let mut token = token_of(&r);
    let queue = |client: &str, request: String| {
        json!({"commandType": 3, "key": key, "clientId": client, "requestId": request,
               "ttl": 30_000, "waitTimeout": 30_000})
    };
    ws_send(&mut waiter.0, &queue("b", "b0".into())).await;
    for i in 1..=rounds {
        let r = ws_request(
            &mut holder.0,
            &release(key, holder.1, &format!("{}r{i}", holder.1), token),
        )
        .await;
        assert_eq!(r["success"], true, "{r}");
        let granted = ws_recv(&mut waiter.0, Duration::from_secs(10))
            .await
            .expect("the waiter's grant");
        assert_eq!(granted["success"], true, "{granted}");
        let next = token_of(&granted);
        assert!(next > token, "tokens increase: {next} after {token}");
        token = next;
        ws_send(&mut holder.0, &queue(holder.1, format!("{}q{i}", holder.1))).await;
        tokio::time::sleep(Duration::from_millis(3)).await;
        std::mem::swap(&mut holder, &mut waiter);
    }
    http_get(addr, "/metrics").await.unwrap().1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commit_delay_waits_for_clients_just_answered_and_can_be_turned_off() {
    // The old holder's request comes alone while the new holder, answered by the same commit,
    // has not sent yet: the batch waits for it (and, since it comes 3 ms later, times out).
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let metrics = hand_offs_with_a_late_release(&cluster.client_addr_of(leader), 20).await;
    let timed_out = metric_sum(
        &metrics,
        "raftlock_commit_delay_waits_total",
        &["outcome=\"timed_out\""],
    );
    // Waits that time out teach the node to stop: seven of them bring the share of hits below
    // one half, then one chance in sixteen is taken.
    assert!(
        (5.0..=12.0).contains(&timed_out),
        "timed-out waits: {timed_out}"
    );
    let waits = metric_sum(&metrics, "raftlock_commit_delay_seconds_count", &[]);
    assert!(
        waits >= timed_out,
        "{waits} waits timed, {timed_out} timed out"
    );
    drop(cluster);

    let cluster = Cluster::start_with(1, |_| vec!["--commit-delay".into(), "0".into()]);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let metrics = hand_offs_with_a_late_release(&cluster.client_addr_of(leader), 10).await;
    assert_eq!(
        metric_sum(&metrics, "raftlock_commit_delay_seconds_count", &[]),
        0.0,
        "--commit-delay 0 never waits"
    );
}
