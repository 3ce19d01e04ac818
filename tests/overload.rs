//! Overload on one node, with real connections on 127.0.0.1: thousands of WebSocket clients each
//! holding a lock, one more than the limit, half-open TCP connections that never send a request,
//! TCP connections beyond the listener's cap, slow readers that never read their answers, and a
//! pipelined request flood — all against the leader of a three-node cluster, while a healthy
//! client keeps taking and releasing a lock.
//!
//! Requires: every healthy request answered; the connection over the WebSocket limit refused with
//! HTTP 503; half-open connections closed by the node after its request deadline and counted;
//! connections over the TCP cap closed at once and counted; slow readers cost bounded memory;
//! every flooded request answered, the excess with `BUSY`; the cluster still has its leader's
//! followers in touch (they know a leader and their commit index moved on). Prints the node's
//! resident memory per WebSocket connection (each holding one lock).
//!
//! `RAFTLOCK_OVERLOAD_CONNECTIONS` sets the number of WebSocket clients (default 10000, lowered
//! to fit this process's open-file limit). Every wait is bounded.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio_tungstenite::tungstenite::Message;

/// The listener's head room beyond the WebSocket limit (src/server/listener.rs).
const EXTRA_TCP_CONNECTIONS: usize = 256;
/// How long a connection may stay silent before the node closes it (src/server/listener.rs).
const REQUEST_HEAD_DEADLINE: Duration = Duration::from_secs(10);

fn open_file_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(1024)
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn metric(body: &str, series: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// One request of the healthy client: retried with the same request id while the answer says
/// to retry (`UNAVAILABLE`, as during a leader change), at most 40 times over about 10 s.
/// Returns the answer and the retries it took.
async fn healthy_request(ws: &mut Ws, msg: &Value) -> (Value, usize) {
    let mut retries = 0;
    loop {
        let r = ws_request(ws, msg).await;
        if r["error"]["code"] != "UNAVAILABLE" || retries == 40 {
            return (r, retries);
        }
        retries += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// One acquire + release on `key` through `ws`; panics unless both succeed. Returns the
/// retries needed.
async fn healthy_cycle(ws: &mut Ws, key: &str, n: usize) -> usize {
    let (r, a) = healthy_request(
        ws,
        &json!({"commandType": 3, "key": key, "clientId": "healthy",
                "requestId": format!("h-a{n}"), "ttl": 10000}),
    )
    .await;
    assert_eq!(r["success"], true, "healthy acquire {n}: {r}");
    let token = r["fencingToken"]["value"].clone();
    let (r, b) = healthy_request(
        ws,
        &json!({"commandType": 4, "key": key, "clientId": "healthy",
                "requestId": format!("h-r{n}"), "fencingToken": {"value": token}}),
    )
    .await;
    assert_eq!(r["success"], true, "healthy release {n}: {r}");
    a + b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_under_overload_keeps_serving() {
    let wanted: usize = std::env::var("RAFTLOCK_OVERLOAD_CONNECTIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    // This process holds one end of every connection; leave room for everything else.
    let connections = wanted.min(open_file_limit().saturating_sub(1_500)).max(100);
    if connections < wanted {
        println!("overload: {connections} connections (open-file limit), not {wanted}");
    }
    let limit = connections;
    let mut cluster =
        // Every client here comes from 127.0.0.1: the per-address cap is set above the
        // listener's, so that the cap this test checks is the listener's (tests/abuse.rs checks
        // the per-address one).
        Cluster::start_with(3, |_| {
            vec![
                "--max-connections".into(),
                limit.to_string(),
                "--max-connections-per-address".into(),
                (2 * (limit + EXTRA_TCP_CONNECTIONS)).to_string(),
            ]
        });
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let addr = cluster.node(leader).client_addr();
    let pid = cluster.node(leader).child.as_ref().expect("running").id();
    let followers: Vec<String> = cluster
        .nodes
        .iter()
        .filter(|n| n.id != leader)
        .map(|n| n.client_addr())
        .collect();
    let commit_before = http_json(&followers[0], "/status").await.expect("status")["commitIndex"]
        .as_u64()
        .unwrap_or(0);
    let mut healthy = ws_connect(&addr).await;
    let (mut cycles, mut retries) = (0, 0);
    retries += healthy_cycle(&mut healthy, "healthy", cycles).await;
    cycles += 1;
    let rss_before = rss_bytes(pid);

    // 1. `connections - 1` WebSocket clients (the healthy one is the last), each holding a lock.
    let started = Instant::now();
    let gate = Arc::new(tokio::sync::Semaphore::new(200));
    let mut opening = Vec::new();
    for i in 0..connections - 1 {
        let gate = gate.clone();
        let url = format!("ws://{addr}/ws");
        opening.push(tokio::spawn(async move {
            let _turn = gate.acquire().await.expect("gate");
            for _ in 0..5 {
                let attempt = async {
                    let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str()).await.ok()?;
                    let msg = json!({"commandType": 3, "key": format!("ov-{i}"),
                                     "clientId": format!("ov-{i}"), "requestId": "a",
                                     "ttl": 300000});
                    ws.send(Message::Text(msg.to_string().into())).await.ok()?;
                    let reply = ws.next().await?.ok()?;
                    let reply: Value = serde_json::from_str(reply.to_text().ok()?).ok()?;
                    (reply["success"] == true).then_some(ws)
                };
                if let Ok(Some(ws)) = tokio::time::timeout(Duration::from_secs(20), attempt).await {
                    return Some(ws);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            None
        }));
    }
    let mut held = Vec::new();
    for task in opening {
        if let Some(ws) = task.await.expect("task") {
            held.push(ws);
        }
    }
    let opened_in = started.elapsed();
    assert_eq!(
        held.len(),
        connections - 1,
        "only {} of {} clients connected and got their lock",
        held.len(),
        connections - 1
    );
    let rss_open = rss_bytes(pid);
    let per_connection = (rss_open.saturating_sub(rss_before)) as f64 / (connections - 1) as f64;
    retries += healthy_cycle(&mut healthy, "healthy", cycles).await;
    cycles += 1;

    // 2. One WebSocket more than the limit: refused with 503.
    match tokio_tungstenite::connect_async(format!("ws://{addr}/ws")).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 503, "{response:?}")
        }
        other => panic!(
            "a connection over the limit was not refused: {:?}",
            other.map(|_| ())
        ),
    }

    // 3. Half-open connections (TCP only, never a request), then more than the TCP cap allows.
    let silent = 200;
    let over_cap = 100;
    let mut quiet = Vec::new();
    for _ in 0..silent + over_cap {
        quiet.push(
            tokio::net::TcpStream::connect(&addr)
                .await
                .expect("tcp connect"),
        );
    }
    let closed_at_once = {
        let mut n = 0;
        for stream in &mut quiet {
            let mut byte = [0u8; 1];
            if let Ok(Ok(0) | Err(_)) =
                tokio::time::timeout(Duration::from_millis(20), stream.read(&mut byte)).await
            {
                n += 1;
            }
        }
        n
    };
    retries += healthy_cycle(&mut healthy, "healthy", cycles).await;
    cycles += 1;
    // Every one is closed by the node once the deadline passes.
    let deadline = Instant::now() + REQUEST_HEAD_DEADLINE + Duration::from_secs(10);
    let mut still_open = 0;
    for stream in &mut quiet {
        let mut byte = [0u8; 1];
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut byte)).await {
            Ok(Ok(0) | Err(_)) => {}
            _ => still_open += 1,
        }
    }
    drop(quiet);
    assert_eq!(still_open, 0, "silent connections the node kept open");
    let (_, metrics) = http_get(&addr, "/metrics").await.expect("metrics");
    let refused_limit = metric(
        &metrics,
        "raftlock_client_connections_refused_total{reason=\"limit\"}",
    );
    let refused_silent = metric(
        &metrics,
        "raftlock_client_connections_refused_total{reason=\"no_request\"}",
    );
    // Open before the quiet ones: the WebSocket clients and the healthy one.
    let expected_over =
        (connections + silent + over_cap).saturating_sub(limit + EXTRA_TCP_CONNECTIONS);
    assert!(
        refused_limit as usize >= expected_over && closed_at_once >= expected_over,
        "over the TCP cap: {refused_limit} refused by the listener, {closed_at_once} closed at \
         once; expected at least {expected_over}"
    );
    assert!(
        refused_silent as usize + refused_limit as usize >= silent + over_cap,
        "{refused_silent} silent connections timed out, {refused_limit} refused: fewer than \
         {}",
        silent + over_cap
    );

    // 4. Slow readers: 20 clients send reads and never read an answer.
    let rss_slow_before = rss_bytes(pid);
    let mut slow = held.split_off(held.len() - 20);
    let mut slow_sent = 0;
    for ws in &mut slow {
        for i in 0..3_000 {
            let msg = json!({"commandType": 7, "key": "slow", "requestId": format!("s{i}")});
            let send = ws.send(Message::Text(msg.to_string().into()));
            match tokio::time::timeout(Duration::from_millis(500), send).await {
                Ok(Ok(())) => slow_sent += 1,
                _ => break,
            }
        }
    }
    retries += healthy_cycle(&mut healthy, "healthy", cycles).await;
    cycles += 1;
    let slow_growth = rss_bytes(pid).saturating_sub(rss_slow_before);
    assert!(
        slow_growth < 256 << 20,
        "20 slow readers grew the node by {} MiB",
        slow_growth >> 20
    );
    drop(slow);

    // 5. A flood: one connection pipelines 20000 reads; every one is answered, the excess with
    //    BUSY.
    let flood = held.pop().expect("a connection");
    let flood_count = 20_000;
    let (mut sink, mut stream) = flood.split();
    let sender = tokio::spawn(async move {
        for i in 0..flood_count {
            let msg = json!({"commandType": 7, "key": "flood", "requestId": format!("f{i}")});
            if sink
                .send(Message::Text(msg.to_string().into()))
                .await
                .is_err()
            {
                return i;
            }
        }
        flood_count
    });
    let (mut answered, mut busy, mut other_errors) = (0, 0, Vec::new());
    let flood_deadline = Instant::now() + Duration::from_secs(120);
    while answered < flood_count && Instant::now() < flood_deadline {
        let Ok(Some(Ok(frame))) =
            tokio::time::timeout(Duration::from_secs(10), stream.next()).await
        else {
            break;
        };
        let Ok(reply) = serde_json::from_str::<Value>(frame.to_text().unwrap_or("")) else {
            continue;
        };
        answered += 1;
        if reply["success"] != true {
            match reply["error"]["code"].as_str() {
                Some("BUSY") => busy += 1,
                code => other_errors.push(format!("{code:?}")),
            }
        }
    }
    let sent = sender.await.expect("sender");
    assert_eq!(sent, flood_count, "the flood could not be sent");
    assert_eq!(answered, flood_count, "flooded requests left unanswered");
    other_errors.dedup();
    assert!(
        other_errors.is_empty(),
        "unexpected errors: {other_errors:?}"
    );
    retries += healthy_cycle(&mut healthy, "healthy", cycles).await;

    // 6. The followers are still in touch with a leader, and commits went on.
    for follower in &followers {
        let s = http_json(follower, "/status").await.expect("status");
        assert!(
            s["leaderId"].as_u64().is_some_and(|l| l > 0),
            "{follower}: {s}"
        );
    }
    let commit_after = http_json(&followers[0], "/status").await.expect("status")["commitIndex"]
        .as_u64()
        .unwrap_or(0);
    assert!(commit_after > commit_before + connections as u64 / 2);
    let term = http_json(&addr, "/status").await.expect("status")["term"].clone();
    cycles += 1;
    println!(
        "overload: {connections} WebSocket connections each holding a lock opened in {:?}; \
         node RSS {} MiB -> {} MiB: {:.0} bytes per connection (lock included); over the TCP \
         cap {refused_limit} refused, {refused_silent} silent connections closed after the \
         deadline; 20 slow readers sent {slow_sent} requests and grew the node by {} KiB; flood \
         of {flood_count}: {busy} answered BUSY; healthy client: {cycles} cycles, {retries} \
         retries; leader {leader} at the start, term now {term}",
        opened_in,
        rss_before >> 20,
        rss_open >> 20,
        per_connection,
        slow_growth >> 10
    );
    drop(held);
    drop(healthy);
}
