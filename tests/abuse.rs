//! What one client, credential or socket can make a node spend, tried against real lock-node
//! processes on 127.0.0.1 (attackers from 127.0.0.2, so that per-address caps tell them apart):
//! each attack is refused or bounded, and an honest client is still served meanwhile. Each test
//! prints the nodes' resident memory before and after its attack.

mod common;

use std::time::{Duration, Instant};

use common::*;
use raftlock::server::proto::lock::lock_service_client::LockServiceClient;
use raftlock::server::proto::lock::AcquireLockRequest;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);
/// How long an honest request may take while an attack goes on (generous: shared machines).
const SERVED_WITHIN: Duration = Duration::from_secs(5);

/// Resident memory of each running node, in MiB.
fn rss_mib(cluster: &Cluster) -> Vec<(u64, u64)> {
    cluster
        .nodes
        .iter()
        .filter_map(|n| {
            let pid = n.child.as_ref()?.id();
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let kib: u64 = status
                .lines()
                .find(|l| l.starts_with("VmRSS:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((n.id, kib / 1024))
        })
        .collect()
}

/// Waits (at most 30 s) until the node at `addr` applies byte budgets and quotas.
async fn wait_for_quotas(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_json(addr, "/status").await.unwrap()["quotasInForce"] != true {
        assert!(Instant::now() < deadline, "no quotas in force");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn put(key: &str, value: &str, client: &str, request: &str) -> Value {
    json!({"commandType": 2, "key": key, "value": value, "clientId": client, "requestId": request})
}

fn acquire(key: &str, client: &str, request: &str, wait_ms: u64) -> Value {
    json!({"commandType": 3, "key": key, "clientId": client, "requestId": request,
           "ttl": 30_000, "waitTimeout": wait_ms})
}

/// Key-value writes with no credentials stop at the byte budget, on every replica alike, and
/// a lock is still granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_value_bytes_stop_at_the_budget() {
    let cluster = Cluster::start_with(3, |_| vec!["--max-data-bytes".into(), "1048576".into()]);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    wait_for_quotas(&addr).await;
    let before = rss_mib(&cluster);
    let mut ws = ws_connect(&addr).await;
    let value = "x".repeat(60 * 1024);
    // The budget applies once the leader's `SetQuotas` entry has applied, shortly after the
    // cluster reaches version 5: until then the writes go through, and are deleted again.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut round = 0;
    let (stored, refused) = loop {
        round += 1;
        let (mut stored, mut refused) = (0, 0);
        for i in 0..200 {
            let r = ws_request(
                &mut ws,
                &put(
                    &format!("blob/{i}"),
                    &value,
                    "anon",
                    &format!("p{round}-{i}"),
                ),
            )
            .await;
            if r["success"] == true {
                stored += 1;
            } else {
                assert_eq!(error_code(&r), "BUSY", "{r}");
                let message = r["error"]["message"].as_str().unwrap_or("");
                assert!(message.contains("[limit: data_bytes]"), "{r}");
                refused += 1;
            }
        }
        if refused > 0 || Instant::now() > deadline {
            break (stored, refused);
        }
        for i in 0..200 {
            let del = json!({"commandType": 2, "key": format!("blob/{i}"), "delete": true,
                             "clientId": "anon", "requestId": format!("d{round}-{i}")});
            ws_request(&mut ws, &del).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // 1 MiB holds 17 values of 60 KiB (and their keys), not 18.
    assert_eq!(stored, 17, "stored {stored}, refused {refused}");
    assert_eq!(refused, 183);
    let counted = scraped_metric(
        &addr,
        "raftlock_limit_refusals_total",
        &["limit=\"data_bytes\""],
    )
    .await;
    assert_eq!(counted, 183.0);
    // Deleting frees the budget; an honest lock is served meanwhile.
    let del = json!({"commandType": 2, "key": "blob/0", "delete": true, "clientId": "anon",
                     "requestId": "d-last"});
    assert_eq!(ws_request(&mut ws, &del).await["success"], true);
    let r = ws_request(&mut ws, &put("blob/again", &value, "anon", "p-again")).await;
    assert_eq!(r["success"], true, "{r}");
    let started = Instant::now();
    let mut honest = ws_connect(&addr).await;
    let r = ws_request(&mut honest, &acquire("jobs/settle", "honest", "h1", 0)).await;
    assert_eq!(r["success"], true, "{r}");
    assert!(started.elapsed() < SERVED_WITHIN);
    eprintln!(
        "key-value attack: RSS MiB before {before:?}, after {:?}",
        rss_mib(&cluster)
    );
}

/// Sockets that open the peer port and never send a byte do not hold up a peer's handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_do_not_stall_the_peer_port() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let target = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .expect("a follower");
    let peer: std::net::SocketAddr = target.peer_addr().parse().unwrap();
    let before = rss_mib(&cluster);
    let mut idle = Vec::new();
    for _ in 0..300 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(2), socket.connect(peer)).await
        {
            idle.push(s);
        }
    }
    assert!(idle.len() >= 250, "only {} idle sockets opened", idle.len());
    // The honest peer-list call, from 127.0.0.1, within a second or so (it took 9.6 s when
    // the accept loop waited for a slot).
    let started = Instant::now();
    let mut client = raftlock::server::proto::peer::peer_client::PeerClient::connect(format!(
        "http://{}",
        target.peer_addr()
    ))
    .await
    .unwrap();
    let reply = client
        .fetch_peer_list(raftlock::server::proto::peer::FetchPeerListRequest { term: 0 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.leader_id, leader);
    assert!(
        started.elapsed() < SERVED_WITHIN,
        "the peer list took {:?} with idle sockets open",
        started.elapsed()
    );
    // The cluster still elects and commits through those sockets: a lock is granted.
    let mut ws = ws_connect(&cluster.client_addr_of(leader)).await;
    let r = ws_request(&mut ws, &acquire("jobs/a", "honest", "h1", 0)).await;
    assert_eq!(r["success"], true, "{r}");
    let refused = scraped_metric(
        &target.client_addr(),
        "raftlock_peer_requests_refused_total",
        &["reason=\"address_limit\""],
    )
    .await;
    assert!(refused >= 250.0, "address_limit refusals: {refused}");
    eprintln!(
        "idle peer sockets: RSS MiB before {before:?}, after {:?}",
        rss_mib(&cluster)
    );
    drop(idle);
}

/// With authentication on, anonymous WebSocket upgrades are refused before they take a slot:
/// they cannot fill `--max-connections`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_upgrades_take_no_connection_slot() {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients.json");
    let identities = json!({"identities": [
        {"name": "billing", "token": "billing-token-0c1d2e3f4a", "prefixes": [""],
         "operations": ["acquire", "release"]}]});
    std::fs::write(&auth, identities.to_string()).unwrap();
    let auth = auth.display().to_string();
    let cluster = Cluster::start_with(1, move |_| {
        vec![
            "--client-auth-file".into(),
            auth.clone(),
            "--max-connections".into(),
            "6".into(),
        ]
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    let mut anonymous = Vec::new();
    for _ in 0..12 {
        let request = format!("ws://{addr}/ws").into_client_request().unwrap();
        match tokio_tungstenite::connect_async(request).await {
            Ok(ws) => anonymous.push(ws),
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                assert_eq!(response.status().as_u16(), 401)
            }
            Err(other) => panic!("unexpected: {other}"),
        }
    }
    assert!(anonymous.is_empty(), "anonymous upgrades were accepted");
    let mut request = format!("ws://{addr}/ws").into_client_request().unwrap();
    request.headers_mut().insert(
        "authorization",
        "Bearer billing-token-0c1d2e3f4a".parse().unwrap(),
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    let r = ws_request(&mut ws, &acquire("jobs/a", "w1", "h1", 0)).await;
    assert_eq!(r["success"], true, "{r}");
    let refused = scraped_metric(
        &addr,
        "raftlock_client_connections_refused_total",
        &["reason=\"unauthenticated\""],
    )
    .await;
    assert_eq!(refused, 12.0);
}

/// gRPC acquires whose callers went away leave the queue after `--waiter-reclaim`, instead of
/// being granted, one after another, to nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_grpc_waits_leave_the_queue() {
    let cluster = Cluster::start_with(1, |_| vec!["--waiter-reclaim".into(), "1s".into()]);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    let mut holder = ws_connect(&addr).await;
    let r = ws_request(&mut holder, &acquire("jobs/busy", "holder", "h1", 0)).await;
    assert_eq!(r["success"], true, "{r}");
    let mut calls = Vec::new();
    for i in 0..50 {
        let addr = addr.clone();
        calls.push(tokio::spawn(async move {
            let mut grpc = LockServiceClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
            let _ = grpc
                .acquire_lock(AcquireLockRequest {
                    resource_name: "jobs/busy".into(),
                    owner_id: format!("g{i}"),
                    client_timeout_ms: 600_000,
                    request_id: format!("g{i}-1"),
                    ttl_ms: 30_000,
                    ack_below: None,
                    attach_to_session: false,
                })
                .await;
        }));
    }
    let waiters = |locks: &Value| {
        locks["locks"]
            .as_array()
            .and_then(|l| l.iter().find(|l| l["key"] == "jobs/busy"))
            .and_then(|l| l["waiters"].as_array().map(Vec::len))
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let locks = http_json(&addr, "/locks").await.unwrap();
        if waiters(&locks) == 50 {
            break;
        }
        assert!(Instant::now() < deadline, "not all queued: {locks}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for call in &calls {
        call.abort();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let locks = http_json(&addr, "/locks").await.unwrap();
        if waiters(&locks) == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "cancelled gRPC waits are still queued: {locks}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The lock goes to a caller who is there when the holder releases.
    let release = json!({"commandType": 4, "key": "jobs/busy", "clientId": "holder",
                         "requestId": "h2", "fencingToken": {"value": r["fencingToken"]["value"]}});
    assert_eq!(ws_request(&mut holder, &release).await["success"], true);
    let mut honest = ws_connect(&addr).await;
    let r = ws_request(&mut honest, &acquire("jobs/busy", "honest", "n1", 0)).await;
    assert_eq!(r["success"], true, "{r}");
}

/// With client authentication, one identity cannot fill the session table or the lock table
/// for the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_identity_cannot_lock_out_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients.json");
    let identities = json!({"identities": [
        {"name": "billing", "token": "billing-token-0c1d2e3f4a", "prefixes": [""],
         "operations": ["acquire", "release"]},
        {"name": "reports", "token": "reports-token-9a8b7c6d5e", "prefixes": [""],
         "operations": ["acquire", "release"]}]});
    std::fs::write(&auth, identities.to_string()).unwrap();
    let auth = auth.display().to_string();
    let cluster = Cluster::start_with(3, move |_| {
        vec![
            "--client-auth-file".into(),
            auth.clone(),
            "--max-sessions".into(),
            "8".into(),
            "--identity-max-sessions".into(),
            "3".into(),
            "--identity-max-locks".into(),
            "5".into(),
        ]
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    wait_for_quotas(&addr).await;
    let ws_as = |token: &'static str| {
        let addr = addr.clone();
        async move {
            let mut request = format!("ws://{addr}/ws").into_client_request().unwrap();
            request
                .headers_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
            tokio_tungstenite::connect_async(request).await.unwrap().0
        }
    };
    let mut billing = ws_as("billing-token-0c1d2e3f4a").await;
    // Sessions: three client ids, then the fourth is refused.
    let mut outcomes = Vec::new();
    for c in 0..6 {
        let r = ws_request(
            &mut billing,
            &acquire(&format!("b/s{c}"), &format!("c{c}"), "1", 0),
        )
        .await;
        outcomes.push(r);
    }
    let granted = outcomes.iter().filter(|r| r["success"] == true).count();
    assert_eq!(granted, 3, "{outcomes:?}");
    let refusal = outcomes.iter().find(|r| r["success"] != true).unwrap();
    assert_eq!(error_code(refusal), "BUSY", "{refusal}");
    assert!(
        refusal["error"]["message"]
            .as_str()
            .unwrap()
            .contains("[limit: identity_sessions]"),
        "{refusal}"
    );
    // Locks: one session may take up to five, not six.
    let mut held = 0;
    let mut last = Value::Null;
    for k in 0..8 {
        last = ws_request(
            &mut billing,
            &acquire(&format!("b/k{k}"), "c0", &format!("k{k}"), 0),
        )
        .await;
        held += usize::from(last["success"] == true);
    }
    // c0, c1 and c2 hold one each already: two more fit under five.
    assert_eq!(held, 2, "{last}");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("[limit: identity_locks]"),
        "{last}"
    );
    // The other identity is served.
    let mut reports = ws_as("reports-token-9a8b7c6d5e").await;
    for c in 0..3 {
        let r = ws_request(
            &mut reports,
            &acquire(&format!("r/{c}"), &format!("r{c}"), "1", 0),
        )
        .await;
        assert_eq!(r["success"], true, "{r}");
    }
}

/// One source address holds at most `--max-connections-per-address` client connections; the
/// others keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_at_most_its_share_of_connections() {
    let cluster = Cluster::start_with(1, |_| {
        vec!["--max-connections-per-address".into(), "5".into()]
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    let target: std::net::SocketAddr = addr.parse().unwrap();
    let mut open = Vec::new();
    for _ in 0..20 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        open.push(socket.connect(target).await.unwrap());
    }
    // The node closes what is over the cap at once: those reads end (EOF or reset).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut closed = 0;
    for s in &mut open {
        use tokio::io::AsyncReadExt;
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(200), s.read(&mut byte)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            _ => {}
        }
    }
    assert_eq!(closed, 15, "connections closed by the node");
    let refused = scraped_metric(
        &addr,
        "raftlock_client_connections_refused_total",
        &["reason=\"address_limit\""],
    )
    .await;
    assert_eq!(refused, 15.0);
    // Another address is served meanwhile.
    let mut ws = ws_connect(&addr).await;
    let r = ws_request(&mut ws, &acquire("jobs/a", "honest", "h1", 0)).await;
    assert_eq!(r["success"], true, "{r}");
}
