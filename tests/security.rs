//! Security with real processes on 127.0.0.1: client authentication and rights on every client
//! protocol, holders that only their identity can release, fencing tokens the data store can
//! verify, peers that cannot join or talk Raft without the cluster token, and a node that refuses
//! to open its peer port beyond loopback without one.

mod common;

use std::time::Duration;

use common::*;
use raftlock::client::http::{get_json_as, request_as};
use raftlock::client::RaftLockClient;
use raftlock::server::proto::lock::lock_service_client::LockServiceClient;
use raftlock::server::proto::lock::AcquireLockRequest;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);
const BILLING: &str = "billing-token-5f1d0c2a9b";
const PAYROLL: &str = "payroll-token-77ab31e0c4";
const OPS: &str = "ops-token-a0c8e2f61d93";
const FENCING_KEY: &str = "fencing-key-shared-with-the-store-0001";

/// Identities: billing may take locks under `billing/`; payroll may take, release and renew any
/// key but is no admin; ops is an admin (its token given as a SHA-256 digest).
fn auth_file(dir: &std::path::Path) -> (String, String) {
    use sha2::{Digest, Sha256};
    let ops_digest: String = Sha256::digest(OPS.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let identities = json!({"identities": [
        {"name": "billing", "token": BILLING, "prefixes": ["billing/"],
         "operations": ["acquire", "release", "renew", "cancel"]},
        {"name": "payroll", "token": PAYROLL, "prefixes": [""],
         "operations": ["acquire", "release", "renew"]},
        {"name": "ops", "tokenSha256": ops_digest, "admin": true},
    ]});
    let auth = dir.join("clients.json");
    std::fs::write(&auth, identities.to_string()).unwrap();
    let key = dir.join("fencing.key");
    std::fs::write(&key, format!("{FENCING_KEY}\n")).unwrap();
    (auth.display().to_string(), key.display().to_string())
}

fn secured_cluster(files: &tempfile::TempDir) -> Cluster {
    let (auth, key) = auth_file(files.path());
    Cluster::start_with(3, move |_| {
        vec![
            "--client-auth-file".into(),
            auth.clone(),
            "--fencing-key-file".into(),
            key.clone(),
        ]
    })
}

/// A WebSocket to `addr` presenting `token` as a bearer token (or none).
async fn ws_as(addr: &str, token: Option<&str>) -> Ws {
    let mut request = format!("ws://{addr}/ws").into_client_request().unwrap();
    if let Some(t) = token {
        request
            .headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let (ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    ws
}

/// A WebSocket upgrade the node refuses: its HTTP status and error body.
async fn ws_refused(addr: &str, token: Option<&str>) -> (u16, Value) {
    let mut request = format!("ws://{addr}/ws").into_client_request().unwrap();
    if let Some(t) = token {
        request
            .headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    match tokio_tungstenite::connect_async(request).await {
        Ok(_) => panic!("the upgrade with {token:?} was accepted"),
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            let body = response
                .body()
                .as_deref()
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or(Value::Null);
            (response.status().as_u16(), body)
        }
        Err(other) => panic!("the upgrade with {token:?} failed otherwise: {other}"),
    }
}

fn acquire(key: &str, client: &str, request: &str) -> Value {
    json!({"commandType": 3, "key": key, "clientId": client, "requestId": request,
           "ttl": 30_000, "waitTimeout": 0})
}

async fn get_as(addr: &str, path: &str, token: Option<&str>) -> (u16, Value) {
    get_json_as(addr, path, token).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_need_a_token_stay_in_their_prefixes_and_only_the_holder_releases() {
    let files = tempfile::tempdir().unwrap();
    let cluster = secured_cluster(&files);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let leader_addr = cluster.client_addr_of(leader);
    let (_, follower_addr) = follower_knowing(&cluster, leader).await;

    // No token, a wrong token: the upgrade is refused 401 UNAUTHENTICATED (before the
    // connection takes a slot), and nothing is taken.
    for token in [None, Some("billing-token-5f1d0c2a9c")] {
        let (status, body) = ws_refused(&leader_addr, token).await;
        assert_eq!(status, 401, "{token:?}: {body}");
        assert_eq!(
            body["error"]["code"], "UNAUTHENTICATED",
            "{token:?}: {body}"
        );
    }

    // billing, through a follower (forwarded to the leader): granted, held as billing/w1, and
    // the token carries a MAC.
    let mut billing = ws_as(&follower_addr, Some(BILLING)).await;
    let g = ws_request(&mut billing, &acquire("billing/run", "w1", "b1")).await;
    assert_eq!(g["success"], true, "{g}");
    let token = g["fencingToken"]["value"].as_u64().unwrap();
    let mac = g["fencingToken"]["mac"].as_str().unwrap().to_string();
    assert_eq!(mac.len(), 64, "{g}");

    // Outside its prefixes: PERMISSION_DENIED.
    let r = ws_request(&mut billing, &acquire("payroll/run", "w1", "b2")).await;
    assert_eq!(error_code(&r), "PERMISSION_DENIED", "{r}");
    // An operation it lacks (a KV write): PERMISSION_DENIED.
    let put = json!({"commandType": 2, "key": "billing/x", "value": "1", "clientId": "w1",
                     "requestId": "b3"});
    let r = ws_request(&mut billing, &put).await;
    assert_eq!(error_code(&r), "PERMISSION_DENIED", "{r}");

    // payroll may release any key, but it is not the holder, whatever client id it claims: the
    // token and the holder's name (which it could read off a listing) are not enough.
    let mut payroll = ws_as(&leader_addr, Some(PAYROLL)).await;
    for claimed in ["w1", "billing/w1", "billing"] {
        let release = json!({"commandType": 4, "key": "billing/run", "clientId": claimed,
                             "requestId": format!("p-{claimed}"),
                             "fencingToken": {"key": "billing/run", "value": token}});
        let r = ws_request(&mut payroll, &release).await;
        assert_eq!(r["success"], false, "{claimed}: {r}");
        assert_eq!(error_code(&r), "NOT_HOLDER", "{claimed}: {r}");
        let renew = json!({"commandType": 5, "key": "billing/run", "clientId": claimed,
                           "requestId": format!("pr-{claimed}"), "ttl": 60_000,
                           "fencingToken": {"key": "billing/run", "value": token}});
        let r = ws_request(&mut payroll, &renew).await;
        assert_eq!(error_code(&r), "NOT_HOLDER", "{claimed}: {r}");
    }
    // A token-less release by another identity does not release it either.
    let r = ws_request(
        &mut payroll,
        &json!({"commandType": 4, "key": "billing/run", "clientId": "billing/w1",
                "requestId": "p-held"}),
    )
    .await;
    assert_eq!(r["success"], false, "{r}");

    // Listings: no token 401; billing sees its lock without the token; payroll sees it (its
    // prefix is every key) without the token; ops (admin) sees the token.
    let (status, body) = get_as(&leader_addr, "/locks", None).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["error"]["code"], "UNAUTHENTICATED", "{body}");
    let (status, body) = get_as(&leader_addr, "/locks", Some(BILLING)).await;
    assert_eq!(status, 200, "{body}");
    let entry = &body["locks"][0];
    assert_eq!(entry["key"], "billing/run", "{body}");
    assert_eq!(entry["holder"], "billing/w1", "{body}");
    assert!(entry.get("fencingToken").is_none(), "{body}");
    let (_, body) = get_as(&leader_addr, "/locks", Some(OPS)).await;
    assert_eq!(body["locks"][0]["fencingToken"], token, "{body}");
    // A KV read outside what payroll may do: 403.
    let (status, body) = get_as(&leader_addr, "/kv/billing%2Fx", Some(PAYROLL)).await;
    assert_eq!(status, 403, "{body}");

    // gRPC: the same rules through metadata.
    let mut grpc = LockServiceClient::connect(format!("http://{leader_addr}"))
        .await
        .unwrap();
    let ask = |token: Option<&str>, key: &str| {
        let mut request = tonic::Request::new(AcquireLockRequest {
            resource_name: key.into(),
            owner_id: "g1".into(),
            client_timeout_ms: 0,
            request_id: format!("g-{key}-{}", token.unwrap_or("none").len()),
            ttl_ms: 5_000,
            ack_below: None,
            attach_to_session: false,
        });
        if let Some(t) = token {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        request
    };
    let r = grpc
        .acquire_lock(ask(None, "billing/g"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.error_code, "UNAUTHENTICATED", "{r:?}");
    let r = grpc
        .acquire_lock(ask(Some(BILLING), "other/g"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.error_code, "PERMISSION_DENIED", "{r:?}");
    let r = grpc
        .acquire_lock(ask(Some(BILLING), "billing/g"))
        .await
        .unwrap()
        .into_inner();
    assert!(r.acquired, "{r:?}");
    assert_eq!(r.fencing_token.unwrap().mac.len(), 64);

    // The SDK with a token, and the holder releasing its own lock.
    let sdk = RaftLockClient::builder()
        .endpoints(endpoints(&cluster))
        .client_id("sdk")
        .auth_token(BILLING)
        .build()
        .unwrap();
    let handle = sdk
        .acquire_with("billing/sdk", Duration::from_secs(10), None)
        .await
        .unwrap();
    assert_eq!(handle.fencing_mac().map(str::len), Some(64));
    handle.release().await.unwrap();
    let anonymous = RaftLockClient::builder()
        .endpoints(endpoints(&cluster))
        .client_id("sdk")
        .build()
        .unwrap();
    let err = anonymous
        .acquire_with("billing/sdk", Duration::from_secs(10), None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("UNAUTHENTICATED"), "{err}");

    let release = json!({"commandType": 4, "key": "billing/run", "clientId": "w1",
                         "requestId": "b9",
                         "fencingToken": {"key": "billing/run", "value": token}});
    let r = ws_request(&mut billing, &release).await;
    assert_eq!(r["success"], true, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_store_refuses_forged_and_altered_tokens() {
    let files = tempfile::tempdir().unwrap();
    let cluster = secured_cluster(&files);
    let key_file = files.path().join("fencing.key").display().to_string();
    let store = DataStoreProc::start_with(&["--fencing-key-file".into(), key_file]).await;
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    let mut ws = ws_as(&addr, Some(BILLING)).await;
    let g = ws_request(&mut ws, &acquire("billing/ledger", "w1", "f1")).await;
    assert_eq!(g["success"], true, "{g}");
    let token = g["fencingToken"]["value"].as_u64().unwrap();
    let mac = g["fencingToken"]["mac"].as_str().unwrap().to_string();

    let write = |key: &str, value: u64, mac: Option<&str>| {
        let mut t = json!({"key": key, "value": value});
        if let Some(m) = mac {
            t["mac"] = json!(m);
        }
        json!({"clientID": "w1", "fencingToken": t, "data": "x"})
    };
    let post = |body: Value| {
        let store = store.addr.clone();
        async move {
            let text = body.to_string();
            request_as(
                &store,
                "POST",
                "/write",
                Some(&text),
                Duration::from_secs(5),
                None,
            )
            .await
            .unwrap()
        }
    };
    // The one-POST denial of service: a huge token without a MAC.
    let (status, body) = post(write("billing/ledger", u64::MAX, None)).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("mac is required"), "{body}");
    // An altered MAC, a MAC moved to a higher value, a MAC moved to another key.
    let mut altered = mac.clone();
    altered.replace_range(0..1, if mac.starts_with('0') { "1" } else { "0" });
    for (key, value, m) in [
        ("billing/ledger", token, altered.as_str()),
        ("billing/ledger", token + 1000, mac.as_str()),
        ("billing/other", token, mac.as_str()),
    ] {
        let (status, body) = post(write(key, value, Some(m))).await;
        assert_eq!(status, 403, "{key} {value}: {body}");
        assert!(body.contains("does not verify"), "{body}");
    }
    // The real token still writes: nothing above was recorded.
    let (status, body) = post(write("billing/ledger", token, Some(&mac))).await;
    assert_eq!(status, 200, "{body}");
    let (_, metrics) = http_get(&store.addr, "/metrics").await.unwrap();
    assert!(
        metrics.contains("raftlock_datastore_writes_total{result=\"forged\"} 4"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaders_term_passes_the_data_store_only_as_a_leaders() {
    let files = tempfile::tempdir().unwrap();
    let cluster = secured_cluster(&files);
    let key_file = files.path().join("fencing.key").display().to_string();
    let store = DataStoreProc::start_with(&["--fencing-key-file".into(), key_file]).await;
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    common::wait_for_cluster_version(&addr, 7).await;
    let mut ws = ws_as(&addr, Some(BILLING)).await;
    let campaign = json!({"commandType": 10, "key": "billing/shard-1", "clientId": "w1",
                          "requestId": "e1", "ttl": 10_000, "value": "10.0.0.1:80"});
    let g = ws_request(&mut ws, &campaign).await;
    assert_eq!(g["success"], true, "{g}");
    assert_eq!(g["fencingToken"]["mode"], "leader", "{g}");
    let term = g["fencingToken"]["value"].as_u64().unwrap();
    let mac = g["fencingToken"]["mac"].as_str().unwrap().to_string();
    // A lock on another key, for a lock's MAC.
    let l = ws_request(&mut ws, &acquire("billing/ledger", "w1", "e2")).await;
    let lock_token = l["fencingToken"]["value"].as_u64().unwrap();
    let lock_mac = l["fencingToken"]["mac"].as_str().unwrap().to_string();
    assert!(l["fencingToken"].get("mode").is_none(), "{l}");
    let post = |key: &str, value: u64, mac: &str, mode: Option<&str>| {
        let mut t = json!({"key": key, "value": value, "mac": mac});
        if let Some(m) = mode {
            t["mode"] = json!(m);
        }
        let body = json!({"clientID": "w1", "fencingToken": t, "data": "x"}).to_string();
        let store = store.addr.clone();
        async move {
            request_as(
                &store,
                "POST",
                "/write",
                Some(&body),
                Duration::from_secs(5),
                None,
            )
            .await
            .unwrap()
        }
    };
    // The term's MAC without its mode, and a lock's MAC with the leader's mode: not verified.
    let (status, body) = post("billing/shard-1", term, &mac, None).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("does not verify"), "{body}");
    let (status, body) = post("billing/ledger", lock_token, &lock_mac, Some("leader")).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = post("billing/shard-1", term, &mac, Some("writer")).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = post("billing/shard-1", term, &mac, Some("owner")).await;
    assert_eq!(status, 400, "{body}");
    // Each with its own mode writes.
    let (status, body) = post("billing/shard-1", term, &mac, Some("leader")).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = post("billing/ledger", lock_token, &lock_mac, None).await;
    assert_eq!(status, 200, "{body}");
    // A renewal of the leadership answers with the leader's MAC too.
    let renew = json!({"commandType": 5, "key": "billing/shard-1", "clientId": "w1",
                       "requestId": "e3", "ttl": 10_000,
                       "fencingToken": {"key": "billing/shard-1", "value": term}});
    let r = ws_request(&mut ws, &renew).await;
    assert_eq!(r["fencingToken"]["mode"], "leader", "{r}");
    assert_eq!(r["fencingToken"]["mac"], json!(mac), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_writers_and_permits_pass_the_data_store_only_in_their_own_mode() {
    let files = tempfile::tempdir().unwrap();
    let cluster = secured_cluster(&files);
    let key_file = files.path().join("fencing.key").display().to_string();
    let store = DataStoreProc::start_with(&["--fencing-key-file".into(), key_file]).await;
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);
    common::wait_for_cluster_version(&addr, 9).await;
    let mut ws = ws_as(&addr, Some(BILLING)).await;
    let shared = |key: &str, client: &str, request: &str, mode: &str, permits: Option<u32>| {
        let mut r = json!({"commandType": 15, "key": key, "clientId": client,
                           "requestId": request, "ttl": 10_000, "mode": mode});
        if let Some(n) = permits {
            r["permits"] = json!(n);
        }
        r
    };
    // Two readers share the key; a writer waits for them (asked not to wait: refused at once).
    let r1 = ws_request(&mut ws, &shared("billing/doc", "r1", "a", "read", None)).await;
    let r2 = ws_request(&mut ws, &shared("billing/doc", "r2", "a", "read", None)).await;
    assert_eq!(r1["fencingToken"]["mode"], "reader", "{r1}");
    assert_eq!(r2["fencingToken"]["mode"], "reader", "{r2}");
    let mut busy = shared("billing/doc", "w", "a", "write", None);
    busy["waitTimeout"] = json!(0);
    let b = ws_request(&mut ws, &busy).await;
    assert_eq!(b["error"]["code"], "WAIT_TIMEOUT", "{b}");
    // Bad input is refused with a reason.
    for bad in [
        shared("billing/doc", "x", "b", "owner", None),
        shared("billing/doc", "x", "c", "read", Some(2)),
        shared("billing/pool", "x", "d", "permit", None),
    ] {
        let e = ws_request(&mut ws, &bad).await;
        assert_eq!(e["error"]["code"], "INVALID_REQUEST", "{bad}: {e}");
    }
    let token_of = |g: &serde_json::Value| g["fencingToken"].clone();
    let post = |token: serde_json::Value| {
        let body = json!({"clientID": "w1", "fencingToken": token, "data": "x"}).to_string();
        let store = store.addr.clone();
        async move {
            request_as(
                &store,
                "POST",
                "/write",
                Some(&body),
                Duration::from_secs(5),
                None,
            )
            .await
            .unwrap()
        }
    };
    // A reader's token never writes, and its MAC does not pass as a writer's.
    let (status, body) = post(token_of(&r1)).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("reader"), "{body}");
    let mut as_writer = token_of(&r1);
    as_writer["mode"] = json!("writer");
    let (status, body) = post(as_writer).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("does not verify"), "{body}");
    // Once both readers release, the writer is granted and writes.
    for (g, client) in [(&r1, "r1"), (&r2, "r2")] {
        let release = json!({"commandType": 4, "key": "billing/doc", "clientId": client,
                             "requestId": "rel", "fencingToken": token_of(g)});
        let out = ws_request(&mut ws, &release).await;
        assert_eq!(out["released"], true, "{out}");
    }
    let w = ws_request(&mut ws, &shared("billing/doc", "w", "e", "write", None)).await;
    assert_eq!(w["fencingToken"]["mode"], "writer", "{w}");
    let (status, body) = post(token_of(&w)).await;
    assert_eq!(status, 200, "{body}");
    // A semaphore of two: two permits in slots 0 and 1, each writing its own slot's record;
    // a third waits. A permit's MAC does not pass for another slot.
    let p1 = ws_request(
        &mut ws,
        &shared("billing/pool", "p1", "a", "permit", Some(2)),
    )
    .await;
    let p2 = ws_request(
        &mut ws,
        &shared("billing/pool", "p2", "a", "permit", Some(2)),
    )
    .await;
    assert_eq!(p1["fencingToken"]["slot"], 0, "{p1}");
    assert_eq!(p2["fencingToken"]["slot"], 1, "{p2}");
    let mut third = shared("billing/pool", "p3", "a", "permit", Some(2));
    third["waitTimeout"] = json!(0);
    let t = ws_request(&mut ws, &third).await;
    assert_eq!(t["error"]["code"], "WAIT_TIMEOUT", "{t}");
    for p in [&p1, &p2] {
        let (status, body) = post(token_of(p)).await;
        assert_eq!(status, 200, "{body}");
    }
    let mut moved = token_of(&p1);
    moved["slot"] = json!(1);
    let (status, body) = post(moved).await;
    assert_eq!(status, 403, "{body}");
    // The store keeps each slot's record apart.
    let (_, data) = http_get(&store.addr, "/data").await.unwrap();
    assert!(
        data.contains("billing/pool#0") && data.contains("billing/pool#1"),
        "{data}"
    );
    // Setting a semaphore's size needs an admin identity.
    let set = json!({"commandType": 16, "key": "billing/pool", "clientId": "w1",
                     "requestId": "s", "permits": 3});
    let e = ws_request(&mut ws, &set).await;
    assert_eq!(e["error"]["code"], "PERMISSION_DENIED", "{e}");
    // `/locks` shows the shared locks' holders with their modes, and hides their tokens from an
    // identity that is not an admin, as it hides a lock's.
    let (status, body) = get_as(&addr, "/locks", Some(BILLING)).await;
    assert_eq!(status, 200, "{body}");
    let pool = body["locks"]
        .as_array()
        .and_then(|l| l.iter().find(|l| l["key"] == "billing/pool"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(pool["shared"]["permits"], 2, "{body}");
    let holders = pool["shared"]["holders"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(holders.len(), 2, "{body}");
    assert!(
        holders
            .iter()
            .all(|h| h["mode"] == "permit" && h.get("fencingToken").is_none()),
        "{body}"
    );
    // The same through gRPC: a reader's token, its MAC covering the mode.
    let mut grpc = LockServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let mut request = tonic::Request::new(raftlock::server::proto::lock::AcquireSharedRequest {
        key: "billing/grpc-doc".into(),
        owner_id: "g1".into(),
        mode: "read".into(),
        permits: 0,
        ttl_ms: 5_000,
        wait_timeout_ms: Some(0),
        request_id: "g1".into(),
        attach_to_session: false,
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {BILLING}").parse().unwrap(),
    );
    let r = grpc.acquire_shared(request).await.unwrap().into_inner();
    assert!(r.acquired, "{r:?}");
    let t = r.fencing_token.expect("token");
    assert_eq!(t.mode, "reader", "{t:?}");
    let token = json!({"key": t.key, "value": t.value, "mac": t.mac, "mode": t.mode});
    let (status, body) = post(token).await;
    assert_eq!(
        status, 403,
        "a reader's token from gRPC does not write either: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_the_token_cannot_join_or_talk_raft() {
    use raftlock::server::proto::peer::{peer_client::PeerClient, JoinClusterRequest, RaftMessage};
    let cluster = Cluster::start_with(3, |_| vec!["--cluster-token".into(), "peer-s3cret".into()]);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let node = cluster.nodes.iter().find(|n| n.id == leader).unwrap();
    let mut peer = PeerClient::connect(format!("http://{}", node.peer_addr()))
        .await
        .unwrap();
    let join = JoinClusterRequest {
        server_id: 9,
        server_addr: "127.0.0.1:1".into(),
        ..Default::default()
    };
    let status = peer.join_cluster(join).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    let mut request = tonic::Request::new(futures::stream::iter(Vec::<RaftMessage>::new()));
    request
        .metadata_mut()
        .insert("x-raftlock-node-id", "2".parse().unwrap());
    let status = peer.raft(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    // A plain Raft stream's hello is checked the same way, and says why it was refused.
    for token in ["", "peer-guess"] {
        let mut tcp = tokio::net::TcpStream::connect(node.peer_addr())
            .await
            .unwrap();
        let hello = raftlock::server::proto::peer::RaftStreamHello {
            node_id: 2,
            cluster_token: token.into(),
            ..Default::default()
        };
        match raftlock::server::peer_stream::dial(&mut tcp, &hello).await {
            Err(raftlock::server::peer_stream::DialError::Refused(why)) => {
                assert!(why.contains("cluster token"), "{why}")
            }
            other => panic!("a plain raft stream with token {token:?}: {other:?}"),
        }
    }
    let s = http_json(&node.client_addr(), "/status").await.unwrap();
    assert_eq!(s["voters"].as_array().unwrap().len(), 3, "{s}");
    assert!(s["learners"].as_array().is_none_or(|l| l.is_empty()), "{s}");
}

/// A node whose peer port would listen beyond loopback without a cluster token does not start,
/// and says why and what to do.
#[test]
fn a_node_refuses_an_open_peer_port_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lock-node"))
        .args(["--node-id", "1", "--bootstrap"])
        .args(["--data-dir", &dir.path().display().to_string()])
        .args(["--peer-listen", &format!("0.0.0.0:{}", free_port())])
        .args(["--client-listen", &format!("127.0.0.1:{}", free_port())])
        .env_remove("RAFTLOCK_CLUSTER_TOKEN")
        .env_remove("RAFTLOCK_INSECURE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cluster token") && err.contains("--insecure"),
        "{err}"
    );
}

/// Mints a token with `lockctl token`.
fn lockctl_token(key_file: &std::path::Path, sub: &str, rights: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockctl"))
        .args(["token", "--key-file", &key_file.display().to_string()])
        .args(["--sub", sub])
        .args(rights)
        .output()
        .expect("run lockctl token");
    assert!(
        out.status.success(),
        "lockctl token: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A JWT with these claims signed with `key`, as an identity provider would make one.
fn sign(key: &[u8], claims: &Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        claims,
        &jsonwebtoken::EncodingKey::from_secret(key),
    )
    .unwrap()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Signed client tokens (HS256 JWTs) carry the identity and its rights: no identity file needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_tokens_carry_the_identity_and_its_rights_until_they_expire() {
    const KEY: &[u8] = b"jwt-signing-key-of-this-cluster-0123456789";
    let files = tempfile::tempdir().unwrap();
    let key_file = files.path().join("jwt.key");
    std::fs::write(&key_file, [KEY, b"\n"].concat()).unwrap();
    let arg = key_file.display().to_string();
    let cluster = Cluster::start_with(1, move |_| {
        vec!["--client-jwt-key-file".into(), arg.clone()]
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);

    let billing = lockctl_token(
        &key_file,
        "billing",
        &[
            "--prefixes",
            "billing/",
            "--operations",
            "acquire,release",
            "--ttl",
            "1h",
        ],
    );
    let mut ws = ws_as(&addr, Some(&billing)).await;
    let g = ws_request(&mut ws, &acquire("billing/jwt", "w1", "j1")).await;
    assert_eq!(g["success"], true, "{g}");
    let token = g["fencingToken"]["value"].as_u64().unwrap();
    let r = ws_request(&mut ws, &acquire("payroll/jwt", "w1", "j2")).await;
    assert_eq!(error_code(&r), "PERMISSION_DENIED", "{r}");

    // Another identity's token, with the same client id, is not the holder.
    let payroll = sign(
        KEY,
        &json!({"sub": "payroll", "exp": unix_now() + 600,
                "raftlock": {"prefixes": [""], "operations": ["release"]}}),
    );
    let mut other = ws_as(&addr, Some(&payroll)).await;
    let release = json!({"commandType": 4, "key": "billing/jwt", "clientId": "w1",
                         "requestId": "p1", "fencingToken": {"key": "billing/jwt", "value": token}});
    let r = ws_request(&mut other, &release).await;
    assert_eq!(error_code(&r), "NOT_HOLDER", "{r}");

    // Refused: another key, alg none, expired, granting nothing, and a made-up string.
    let claims = json!({"sub": "billing", "exp": unix_now() + 600,
                        "raftlock": {"prefixes": [""], "operations": ["acquire"]}});
    let forged = sign(b"some-other-key-that-is-long-enough-000", &claims);
    let none = {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!(
            "{}.{}.",
            b64.encode(br#"{"alg":"none","typ":"JWT"}"#),
            b64.encode(claims.to_string())
        )
    };
    let expired = sign(
        KEY,
        &json!({"sub": "billing", "exp": unix_now() - 60,
                "raftlock": {"prefixes": [""], "operations": ["acquire"]}}),
    );
    let empty = sign(KEY, &json!({"sub": "billing", "exp": unix_now() + 600}));
    for (what, bad) in [
        ("another key", forged.as_str()),
        ("alg none", none.as_str()),
        ("expired", expired.as_str()),
        ("no rights", empty.as_str()),
        ("not a JWT", "a.b.c"),
    ] {
        let (status, body) = ws_refused(&addr, Some(bad)).await;
        assert_eq!(status, 401, "{what}: {body}");
        assert_eq!(body["error"]["code"], "UNAUTHENTICATED", "{what}: {body}");
    }

    // A token that expires while its connection is open: refused from then on.
    let short = sign(
        KEY,
        &json!({"sub": "billing", "exp": unix_now() + 1,
                "raftlock": {"prefixes": ["billing/"], "operations": ["acquire"]}}),
    );
    let mut ws = ws_as(&addr, Some(&short)).await;
    let r = ws_request(&mut ws, &acquire("billing/short", "w2", "s1")).await;
    assert_eq!(r["success"], true, "{r}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = ws_request(&mut ws, &acquire("billing/short2", "w2", "s2")).await;
    assert_eq!(error_code(&r), "UNAUTHENTICATED", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("expired"),
        "{r}"
    );

    // A watch lasts no longer than its token, and shows a non-admin no fencing tokens.
    let watcher = sign(
        KEY,
        &json!({"sub": "auditor", "exp": unix_now() + 3,
                "raftlock": {"prefixes": ["billing/"], "operations": ["read"]}}),
    );
    let mut watch = ws_as(&addr, Some(&watcher)).await;
    ws_send(
        &mut watch,
        &json!({"commandType": 8, "requestId": "w1", "key": "billing/"}),
    )
    .await;
    let ack = ws_recv(&mut watch, Duration::from_secs(5)).await.unwrap();
    assert_eq!(ack["watching"], true, "{ack}");
    let mut ws = ws_as(&addr, Some(&billing)).await;
    let g = ws_request(&mut ws, &acquire("billing/watched", "w3", "x1")).await;
    assert_eq!(g["success"], true, "{g}");
    let event = ws_recv(&mut watch, Duration::from_secs(5)).await.unwrap();
    assert_eq!(event["event"], "granted", "{event}");
    assert!(
        event.get("token").is_none(),
        "a non-admin saw a token: {event}"
    );
    let end = ws_recv(&mut watch, Duration::from_secs(10)).await.unwrap();
    assert_eq!(end["requestId"], "w1", "{end}");
    assert_eq!(error_code(&end), "UNAUTHENTICATED", "{end}");
}
