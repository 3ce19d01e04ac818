//! A client written from seed 000's design — raw WebSocket JSON, no request ids, token-less
//! release, no redirect handling — pointed at a *follower* of a real three-node cluster: the
//! follower forwards every request to the leader, so the client gets its locks, FIFO hand-offs
//! and releases right. Also: a client that asks for redirects gets `NOT_LEADER`, a request id
//! reused for another key is refused, and unknown JSON fields are ignored.
//!
//! Every wait is bounded; everything is on 127.0.0.1.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);

/// The next reply on `ws` whose `key` is `key` (seed 000's replies are matched by key).
async fn reply_for_key(ws: &mut Ws, key: &str, timeout: Duration) -> Option<Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        let reply = ws_recv(ws, left).await?;
        if reply["key"] == key {
            return Some(reply);
        }
    }
}

fn follower_of(cluster: &Cluster, leader: u64) -> String {
    cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .expect("a follower")
        .client_addr()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_000_client_through_a_follower() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let follower = follower_of(&cluster, leader);
    // Let the follower learn who leads.
    let deadline = Instant::now() + LEADER_TIMEOUT;
    loop {
        let s = http_json(&follower, "/status").await.unwrap_or(Value::Null);
        if s["leaderId"] == leader {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "follower never learned the leader"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Client A takes two locks over one connection, with no request ids.
    let mut a = ws_connect(&follower).await;
    for key in ["k1", "k2"] {
        ws_send(
            &mut a,
            &json!({"commandType": 3, "key": key, "clientId": "A", "ttl": 30000}),
        )
        .await;
        let r = reply_for_key(&mut a, key, Duration::from_secs(10))
            .await
            .expect("grant");
        assert_eq!(r["success"], true, "{r}");
    }

    // Client B waits for both keys on one connection (no request ids, an unknown field too).
    let mut b = ws_connect(&follower).await;
    for key in ["k1", "k2"] {
        ws_send(
            &mut b,
            &json!({"commandType": 3, "key": key, "clientId": "B", "ttl": 30000,
                    "waitTimeout": 20000, "clientVersion": "seed-000"}),
        )
        .await;
    }
    assert!(
        ws_recv(&mut b, Duration::from_millis(500)).await.is_none(),
        "B must wait while A holds both keys"
    );
    let locks = http_json(&follower, "/locks").await.unwrap();
    assert_eq!(locks["locks"].as_array().map(Vec::len), Some(2), "{locks}");
    // The unknown field was ignored, and counted.
    let (_, metrics) = http_get(&follower, "/metrics").await.unwrap();
    assert!(
        metrics.contains("raftlock_ignored_fields_total 2"),
        "ignored fields counted: {}",
        metrics
            .lines()
            .filter(|l| l.contains("ignored"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // A releases both without tokens (seed 000's release); B is granted each, naming the key.
    let mut tokens = Vec::new();
    for key in ["k1", "k2"] {
        ws_send(
            &mut a,
            &json!({"commandType": 4, "key": key, "clientId": "A"}),
        )
        .await;
        let r = reply_for_key(&mut a, key, Duration::from_secs(10))
            .await
            .expect("release answered");
        assert_eq!(r["success"], true, "{r}");
        let g = reply_for_key(&mut b, key, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("B not granted {key}"));
        assert_eq!(g["success"], true, "{g}");
        tokens.push(g["fencingToken"]["value"].as_u64().expect("token"));
    }
    assert!(tokens[1] > tokens[0]);

    // A token-less release by someone who does not hold the lock changes nothing.
    ws_send(
        &mut a,
        &json!({"commandType": 4, "key": "k1", "clientId": "A"}),
    )
    .await;
    let r = reply_for_key(&mut a, "k1", Duration::from_secs(10))
        .await
        .expect("answered");
    assert_eq!(r["success"], false, "{r}");
    let locks = http_json(&follower, "/locks?prefix=k1").await.unwrap();
    assert_eq!(locks["locks"][0]["holder"], "B", "{locks}");

    // A client that prefers redirects gets NOT_LEADER with the leader's address.
    let r = ws_request(
        &mut a,
        &json!({"commandType": 3, "key": "k3", "clientId": "C", "requestId": "c1",
                "ttl": 1000, "redirect": true}),
    )
    .await;
    assert_eq!(r["error"]["code"], "NOT_LEADER", "{r}");
    assert_eq!(r["error"]["leaderId"], leader, "{r}");

    // A request id used again for another key is refused, not answered with the first grant.
    let r = ws_request(
        &mut a,
        &json!({"commandType": 3, "key": "k4", "clientId": "D", "requestId": "d1", "ttl": 5000}),
    )
    .await;
    assert_eq!(r["success"], true, "{r}");
    let r = ws_request(
        &mut a,
        &json!({"commandType": 3, "key": "k5", "clientId": "D", "requestId": "d1", "ttl": 5000}),
    )
    .await;
    assert_eq!(r["error"]["code"], "REQUEST_ID_REUSED", "{r}");
    // … while the same request again gets the original answer.
    let again = ws_request(
        &mut a,
        &json!({"commandType": 3, "key": "k4", "clientId": "D", "requestId": "d1", "ttl": 5000}),
    )
    .await;
    assert_eq!(again["success"], true, "{again}");
}
