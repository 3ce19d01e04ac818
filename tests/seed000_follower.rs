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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_000_client_through_a_follower() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let (_, follower) = follower_knowing(&cluster, leader).await;

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

/// Sends `msg` through `ws` until an answer other than a retryable error arrives (a leader
/// change may need a few tries); returns it.
async fn until_answered(ws: &mut Ws, msg: &Value, id: &str) -> Value {
    let deadline = Instant::now() + LEADER_TIMEOUT;
    loop {
        ws_send(ws, msg).await;
        let reply = loop {
            let r = ws_recv(ws, Duration::from_secs(15))
                .await
                .expect("an answer within 15 s");
            if r["requestId"] == id {
                break r;
            }
        };
        let code = reply["error"]["code"].as_str().unwrap_or("");
        if !matches!(code, "UNAVAILABLE" | "NO_LEADER" | "NOT_LEADER" | "BUSY") {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "still {code} after 20 s: {reply}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A waiter queued through a follower while the leader is SIGKILLed: its forwarded request
/// ends with a retryable error, the same request id sent again through the same follower finds
/// it still queued (exactly once: not queued twice), and it is granted once the holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_wait_survives_a_leader_change() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let (_, follower) = follower_knowing(&cluster, leader).await;

    let mut h = ws_connect(&follower).await;
    let held = ws_request(
        &mut h,
        &json!({"commandType": 3, "key": "job", "clientId": "H", "requestId": "h1", "ttl": 60000}),
    )
    .await;
    assert_eq!(held["success"], true, "{held}");
    let h_token = held["fencingToken"]["value"].as_u64().expect("token");

    let mut w = ws_connect(&follower).await;
    let wait = json!({"commandType": 3, "key": "job", "clientId": "W", "requestId": "w1",
                      "ttl": 60000, "waitTimeout": 60000});
    ws_send(&mut w, &wait).await;
    assert!(ws_recv(&mut w, Duration::from_millis(500)).await.is_none());

    cluster.node(leader).kill();
    // The forwarded wait ends with a retryable error (the leader is gone) …
    let ended = ws_recv(&mut w, Duration::from_secs(15))
        .await
        .expect("the forwarded wait ends when the leader dies");
    assert_eq!(ended["success"], false, "{ended}");
    // … and the same request, sent again through the same follower, is still the one waiter.
    let new_leader = loop {
        let l = cluster.wait_for_leader(LEADER_TIMEOUT).await;
        if l != leader {
            break l;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let new_leader_addr = cluster.node(new_leader).client_addr();
    ws_send(&mut w, &wait).await;
    let release = json!({"commandType": 4, "key": "job", "clientId": "H", "requestId": "h2",
                         "fencingToken": {"key": "job", "value": h_token}});
    // The waiter must be queued again before the release (or the release finds no waiter).
    let deadline = Instant::now() + LEADER_TIMEOUT;
    loop {
        let locks = http_json(&new_leader_addr, "/locks?prefix=job")
            .await
            .unwrap();
        if locks["locks"][0]["waiters"] == json!(["W"]) {
            break;
        }
        assert!(Instant::now() < deadline, "waiter not queued: {locks}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let released = until_answered(&mut h, &release, "h2").await;
    assert_eq!(released["success"], true, "{released}");
    let granted = loop {
        let r = ws_recv(&mut w, Duration::from_secs(15))
            .await
            .expect("the waiter is granted");
        if r["success"] == true {
            break r;
        }
        let code = r["error"]["code"].as_str().unwrap_or("");
        assert!(
            matches!(code, "UNAVAILABLE" | "NO_LEADER" | "NOT_LEADER"),
            "{r}"
        );
        ws_send(&mut w, &wait).await;
    };
    let w_token = granted["fencingToken"]["value"].as_u64().expect("token");
    assert!(w_token > h_token, "{granted}");
    let locks = http_json(&new_leader_addr, "/locks?prefix=job")
        .await
        .unwrap();
    assert_eq!(locks["locks"][0]["holder"], "W", "{locks}");
    assert_eq!(locks["locks"][0]["fencingToken"], w_token, "{locks}");
    assert_eq!(
        locks["locks"][0]["waiters"],
        json!([]),
        "queued once: {locks}"
    );
}
