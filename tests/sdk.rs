//! The Rust SDK against real `lock-node` processes on 127.0.0.1: failover during an acquire, the
//! loss signal of a holder cut off from the cluster, and fencing at the data store.

mod common;

use std::time::{Duration, Instant};

use common::*;
use raftlock::client::http::post_json;
use raftlock::client::{AdminClient, AdvancedClient, ClientError, RaftLockClient, RetryPolicy};
use serde_json::{json, Value};

fn client(endpoints: &[String], id: &str) -> RaftLockClient {
    RaftLockClient::builder()
        .endpoints(endpoints.iter().cloned())
        .client_id(id)
        .request_timeout(Duration::from_secs(3))
        .build()
        .expect("client")
}

async fn leader_addr(cluster: &Cluster) -> String {
    let id = cluster.wait_for_leader(Duration::from_secs(20)).await;
    cluster
        .nodes
        .iter()
        .find(|n| n.id == id)
        .expect("leader")
        .client_addr()
}

async fn lock_info(addr: &str, key: &str) -> Value {
    let v = http_json(addr, &format!("/locks?prefix={key}"))
        .await
        .expect("locks");
    v["locks"]
        .as_array()
        .and_then(|a| a.iter().find(|l| l["key"] == key).cloned())
        .unwrap_or(Value::Null)
}

#[test]
fn builder_rejects_bad_settings() {
    let err = RaftLockClient::builder().build().unwrap_err();
    assert!(matches!(err, ClientError::Config(_)), "{err}");
    let err = RaftLockClient::builder()
        .endpoint("no-port")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("host:port"), "{err}");
    let err = RaftLockClient::builder()
        .endpoint("127.0.0.1:1")
        .client_id("")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("client id"), "{err}");
    let err = RaftLockClient::builder()
        .endpoint("127.0.0.1:1")
        .default_ttl(Duration::from_secs(1))
        .safety_margin(Duration::from_secs(2))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("safety margin"), "{err}");
    let err = RaftLockClient::builder()
        .endpoint("127.0.0.1:1")
        .retry_policy(RetryPolicy {
            jitter_factor: 1.5,
            ..RetryPolicy::default()
        })
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("jitter_factor"), "{err}");
    let err = RaftLockClient::builder()
        .endpoint("127.0.0.1:1")
        .keepalive(Duration::from_secs(2), Duration::from_secs(1))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("keepalive"), "{err}");
    let err = RaftLockClient::builder()
        .endpoint("127.0.0.1:1")
        .renew_interval(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("renew interval"), "{err}");
    assert!(RaftLockClient::builder()
        .endpoint("ws://127.0.0.1:50051/ws")
        .build()
        .is_ok());
}

/// A TCP proxy that, once stalled, keeps its connections open but forwards nothing: a peer that
/// vanished without closing (a partition, a paused host). New connections are refused.
struct StallProxy {
    addr: String,
    stalled: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl StallProxy {
    async fn start(target: String) -> StallProxy {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stalled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stalled.clone();
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if flag.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                for (mut from, mut to, flag) in [
                    (
                        Box::new(ri) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                        Box::new(wo) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                        flag.clone(),
                    ),
                    (Box::new(ro), Box::new(wi), flag.clone()),
                ] {
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        let mut held = Vec::new();
                        while let Ok(n) = from.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                            if flag.load(Ordering::SeqCst) {
                                // Swallow the bytes, keep the sockets open.
                                held.push(n);
                                continue;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        drop(held);
                        // Keep the write half open while stalled, so nothing sees a close.
                        while flag.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    });
                }
            }
        });
        StallProxy {
            addr,
            stalled,
            task,
        }
    }

    fn stall(&self) {
        self.stalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_notices_a_silent_connection_and_moves_on() {
    let cluster = Cluster::start(3);
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let proxy = StallProxy::start(cluster.nodes[0].client_addr()).await;
    // The request timeout is far longer than the test allows: only the keepalive can notice
    // that the first connection went silent.
    let client = RaftLockClient::builder()
        .endpoints([proxy.addr.clone(), cluster.nodes[1].client_addr()])
        .client_id("keepalive")
        // Stay on the proxied connection even when node 1 is a follower.
        .prefer_leader(false)
        .request_timeout(Duration::from_secs(120))
        .keepalive(Duration::from_millis(200), Duration::from_millis(1000))
        .retry_policy(RetryPolicy {
            max_elapsed: Duration::from_secs(300),
            ..RetryPolicy::default()
        })
        .build()
        .unwrap();
    client
        .put("ka/k", "1", None)
        .await
        .expect("first put through the proxy");
    proxy.stall();
    let second = tokio::time::timeout(Duration::from_secs(60), client.put("ka/k", "2", None)).await;
    assert!(
        matches!(second, Ok(Ok(()))),
        "the silent connection was not given up: {second:?}"
    );
    assert_eq!(client.get("ka/k").await.unwrap().as_deref(), Some("2"));
}

/// Requests a node forwarded to the leader (`raftlock_requests_forwarded_total`).
async fn forwarded_count(addr: &str) -> f64 {
    scraped_metric(addr, "raftlock_requests_forwarded_total{", &[]).await
}

/// The client `c` still talks to `follower`, which forwarded at least an acquire and a release
/// since its count was `before`.
async fn assert_forwarded_by(c: &RaftLockClient, follower: &str, before: f64) {
    assert_eq!(c.connected_to().await.as_deref(), Some(follower));
    assert!(
        forwarded_count(follower).await >= before + 2.0,
        "the follower did not forward the acquire and the release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_prefer_leader_a_follower_forwards() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let (_, follower) = follower_knowing(&cluster, leader).await;
    let c = RaftLockClient::builder()
        .endpoint(follower.clone())
        .client_id("sdk-forwarded")
        .prefer_leader(false)
        .build()
        .expect("client");
    let before = forwarded_count(&follower).await;
    let lock = c
        .acquire("fwd")
        .await
        .expect("acquire through the follower");
    lock.release().await.expect("release");
    assert_forwarded_by(&c, &follower, before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_leader_address_falls_back_to_forwarding() {
    // Every node advertises a client address nobody listens on, as for a client outside
    // Kubernetes that reaches the cluster through one Service address: the redirect leads
    // nowhere, so the client goes on through the follower, which forwards.
    let cluster = Cluster::start_with(3, |_| {
        vec![
            "--advertise-client".into(),
            format!("127.0.0.1:{}", free_port()),
        ]
    });
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let (_, follower) = follower_knowing(&cluster, leader).await;
    let c = client(std::slice::from_ref(&follower), "sdk-fallback");
    let before = forwarded_count(&follower).await;
    let lock = tokio::time::timeout(Duration::from_secs(30), c.acquire("fallback"))
        .await
        .expect("acquire answered within 30 s")
        .expect("acquire through the follower after the redirect failed");
    lock.release().await.expect("release");
    assert_forwarded_by(&c, &follower, before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_cluster_gives_up_within_the_policy() {
    let c = RaftLockClient::builder()
        .endpoint(format!("127.0.0.1:{}", free_port()))
        .retry_policy(RetryPolicy {
            max_elapsed: Duration::from_millis(500),
            ..RetryPolicy::default()
        })
        .build()
        .expect("client");
    let started = Instant::now();
    let err = c.acquire("k").await.unwrap_err();
    assert!(matches!(err, ClientError::Unavailable { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_through_a_follower_then_release_and_kv() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    // Only a follower's address: the client must find the leader itself.
    let follower = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .expect("follower")
        .client_addr();
    let c = client(&[follower], "sdk-basic");
    let lock = c.acquire("orders").await.expect("acquire");
    assert!(lock.fencing_token() > 0);
    assert!(lock.is_valid());
    // The follower redirected the client (it asks for redirects by default): it now talks to
    // the leader itself, one hop less per request than through the follower.
    let leader_client = cluster
        .nodes
        .iter()
        .find(|n| n.id == leader)
        .expect("leader")
        .client_addr();
    assert_eq!(c.connected_to().await, Some(leader_client));
    let other = client(&endpoints(&cluster), "sdk-other");
    let none = other
        .try_acquire("orders", Duration::from_secs(5), Duration::ZERO)
        .await
        .expect("try");
    assert!(none.is_none(), "lock granted twice");
    c.put("cfg/a", "1", Some(("orders", lock.fencing_token())))
        .await
        .expect("guarded put");
    assert_eq!(c.get("cfg/a").await.expect("get").as_deref(), Some("1"));
    // A value many times the connection's 1 KiB read buffer travels whole both ways.
    let big = "v".repeat(60_000);
    c.put("cfg/big", &big, Some(("orders", lock.fencing_token())))
        .await
        .expect("large put");
    assert_eq!(
        c.get("cfg/big").await.expect("get").as_deref(),
        Some(big.as_str())
    );
    let token = lock.fencing_token();
    lock.release().await.expect("release");
    let err = c.release("orders", token).await.unwrap_err();
    assert!(err.is_not_holder(), "second release: {err}");
    let next = other
        .try_acquire("orders", Duration::from_secs(5), Duration::ZERO)
        .await
        .expect("try")
        .expect("free after release");
    assert!(next.fencing_token() > token);

    let admin = AdminClient::new(endpoints(&cluster)).expect("admin");
    let status = admin.status().await.expect("status");
    assert_eq!(status["voters"].as_array().map(Vec::len), Some(3));
    let health = admin.health().await;
    assert!(health.iter().all(|(_, alive, _)| *alive), "{health:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_a_queued_wait() {
    let cluster = Cluster::start(3);
    leader_addr(&cluster).await;
    let eps = endpoints(&cluster);
    let holder = client(&eps, "sdk-holder");
    let lock = holder.acquire("jobs").await.expect("acquire");
    let adv = AdvancedClient::new(client(&eps, "sdk-waiter"));
    let pending = adv.enqueue("jobs", Duration::from_secs(5), None, RetryPolicy::default());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let leader = leader_addr(&cluster).await;
        if lock_info(&leader, "jobs").await["waiters"]
            .as_array()
            .is_some_and(|w| w.len() == 1)
        {
            break;
        }
        assert!(Instant::now() < deadline, "waiter never queued");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    adv.cancel_wait(&pending).await.expect("cancel");
    let cancelled_owner = pending.owner_id.clone();
    let err = pending.granted().await.unwrap_err();
    assert!(matches!(err, ClientError::WaitTimeout { .. }), "{err}");
    let leader = leader_addr(&cluster).await;
    assert_eq!(lock_info(&leader, "jobs").await["waiters"], json!([]));

    // A wait that ended without a grant (cancelled, or timed out at the server) leaves its
    // owner id holding and awaiting nothing: the next acquire of this client reuses it rather
    // than opening one more session on the cluster.
    let timed_out = adv.enqueue(
        "jobs",
        Duration::from_secs(5),
        Some(Duration::from_millis(200)),
        RetryPolicy::default(),
    );
    assert_eq!(timed_out.owner_id, cancelled_owner);
    let err = timed_out.granted().await.unwrap_err();
    assert!(matches!(err, ClientError::WaitTimeout { .. }), "{err}");
    lock.release().await.expect("release");
    let granted = adv.enqueue("jobs", Duration::from_secs(5), None, RetryPolicy::default());
    assert_eq!(granted.owner_id, cancelled_owner);
    let handle = granted.granted().await.expect("granted");
    assert_eq!(handle.owner_id(), cancelled_owner);
    handle.release().await.expect("release");
    // Enqueued acquires one after another, each granted and released, keep to one owner id.
    for _ in 0..5 {
        let pending = adv.enqueue("jobs", Duration::from_secs(5), None, RetryPolicy::default());
        assert_eq!(pending.owner_id, cancelled_owner);
        pending
            .granted()
            .await
            .expect("granted")
            .release()
            .await
            .expect("release");
    }
}

/// The leader is SIGKILLed while an acquire waits in the queue: the acquire completes exactly
/// once, with one token larger than the previous holder's, and no duplicate waiter remains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_during_an_acquire() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let eps = endpoints(&cluster);
    let a = client(&eps, "sdk-a");
    let b = client(&eps, "sdk-b");
    let first = a.acquire("batch").await.expect("a acquires");
    let t1 = first.fencing_token();
    let waiting = tokio::spawn(async move { b.acquire("batch").await });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let addr = cluster.node(leader).client_addr();
        if lock_info(&addr, "batch").await["waiters"]
            .as_array()
            .is_some_and(|w| w.len() == 1)
        {
            break;
        }
        assert!(Instant::now() < deadline, "b never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.node(leader).kill();
    // The previous holder releases through the new leader; the hand-off goes to b.
    first.release().await.expect("release after failover");
    let granted = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("b granted in time")
        .expect("task")
        .expect("b acquires");
    let t2 = granted.fencing_token();
    assert!(t2 > t1, "token {t2} not above {t1}");
    let new_leader = leader_addr(&cluster).await;
    let info = lock_info(&new_leader, "batch").await;
    assert_eq!(info["holder"], granted.owner_id(), "{info}");
    assert!(granted.owner_id().starts_with("sdk-b#"), "{info}");
    assert_eq!(info["fencingToken"], t2, "{info}");
    assert_eq!(
        info["waiters"],
        json!([]),
        "a duplicate waiter remained: {info}"
    );
    granted.release().await.expect("release");
}

/// A holder cut off from the cluster is told it lost the lock before the cluster grants the
/// lock to the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loss_signal_fires_before_anyone_else_is_granted() {
    // Every node advertises a proxy as its client address, so the holder's client, including
    // after redirects, reaches the cluster only through proxies that the test can cut.
    let (cluster, proxies) = cluster_behind_proxies(3).await;
    let holder = RaftLockClient::builder()
        .endpoints(proxies.iter().map(|p| p.addr.clone()))
        .client_id("cut-off-holder")
        .default_ttl(Duration::from_secs(2))
        .request_timeout(Duration::from_millis(500))
        .build()
        .expect("client");
    let lock = holder.acquire("shard-7").await.expect("acquire");
    let mut renewer = lock.auto_renew();
    // Renewals keep the lock past its TTL while connected.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!renewer.is_lost(), "lost while connected");
    for p in &proxies {
        p.cut();
    }
    let cut_at = Instant::now();
    // The next client talks to the nodes directly and waits in the queue.
    let direct = client(&endpoints(&cluster), "next-holder");
    let next = tokio::spawn(async move {
        let h = direct.acquire("shard-7").await;
        (Instant::now(), h)
    });
    let reason = tokio::time::timeout(Duration::from_secs(10), renewer.lost())
        .await
        .expect("loss signalled");
    let lost_at = Instant::now();
    let (granted_at, next_lock) = tokio::time::timeout(Duration::from_secs(20), next)
        .await
        .expect("next holder granted")
        .expect("task");
    let next_lock = next_lock.expect("next acquires");
    assert!(
        lost_at < granted_at,
        "loss signalled {:?} after the cut, but the next holder was granted at {:?}",
        lost_at - cut_at,
        granted_at - cut_at
    );
    assert!(next_lock.fencing_token() > lock.fencing_token());
    eprintln!(
        "loss ({reason}) at +{:?}, next grant at +{:?}",
        lost_at - cut_at,
        granted_at - cut_at
    );
    std::mem::forget(lock); // its release would go nowhere
}

/// A holder whose lease lapsed still has a token; the data store refuses its write once the
/// next holder wrote with a newer one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_holder_write_is_refused_by_the_data_store() {
    let cluster = Cluster::start(3);
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let store = DataStoreProc::start().await;
    let eps = endpoints(&cluster);
    let a = client(&eps, "writer-a");
    let b = client(&eps, "writer-b");
    let stale = a
        .acquire_with("ledger", Duration::from_millis(500), None)
        .await
        .expect("a acquires");
    let write = |client: &str, token: u64, data: &str| json!({"clientID": client, "fencingToken": {"key": "ledger", "value": token}, "data": data});
    let (status, _) = post_json(
        &store.addr,
        "/write",
        &write("writer-a", stale.fencing_token(), "a1"),
    )
    .await
    .expect("write");
    assert_eq!(status, 200);
    // a pauses past its TTL (no renewal); the leader expires the lease and b gets the lock.
    let fresh = b
        .acquire_with(
            "ledger",
            Duration::from_secs(10),
            Some(Duration::from_secs(10)),
        )
        .await
        .expect("b acquires after expiry");
    assert!(fresh.fencing_token() > stale.fencing_token());
    assert!(!stale.is_valid(), "a's handle must know its lease is over");
    let (status, _) = post_json(
        &store.addr,
        "/write",
        &write("writer-b", fresh.fencing_token(), "b1"),
    )
    .await
    .expect("write");
    assert_eq!(status, 200);
    let (status, body) = post_json(
        &store.addr,
        "/write",
        &write("writer-a", stale.fencing_token(), "a2"),
    )
    .await
    .expect("write");
    assert_eq!(status, 409, "stale write accepted: {body}");
    assert_eq!(body["current"], fresh.fencing_token());
    std::mem::forget(stale);
}

/// Clones of one client are separate owners: two tasks sharing a client contend for a key like
/// two clients, each handle releases with its own owner id, and a long client id still yields
/// owner ids within the server's id limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_one_client_are_separate_owners() {
    let cluster = Cluster::start(3);
    leader_addr(&cluster).await;
    let shared = client(&endpoints(&cluster), "sdk-shared");
    let (one, two) = (shared.clone(), shared.clone());
    let ttl = Duration::from_secs(10);
    let (first, second) = tokio::join!(
        tokio::spawn(async move { one.try_acquire("shared-key", ttl, Duration::ZERO).await }),
        tokio::spawn(async move { two.try_acquire("shared-key", ttl, Duration::ZERO).await }),
    );
    let first = first.expect("task").expect("try_acquire");
    let second = second.expect("task").expect("try_acquire");
    let (holder, other) = match (first, second) {
        (Some(h), None) | (None, Some(h)) => (h, shared.clone()),
        (Some(a), Some(b)) => panic!(
            "both clones hold shared-key: {} with token {}, {} with token {}",
            a.owner_id(),
            a.fencing_token(),
            b.owner_id(),
            b.fencing_token()
        ),
        (None, None) => panic!("neither clone got the free lock"),
    };
    assert!(holder.owner_id().starts_with("sdk-shared#"), "{holder:?}");
    assert_ne!(holder.owner_id(), shared.client_id());
    let leader = leader_addr(&cluster).await;
    assert_eq!(
        lock_info(&leader, "shared-key").await["holder"],
        holder.owner_id()
    );
    // The client id itself does not hold the lock: only the handle's owner id does.
    let err = shared
        .release("shared-key", holder.fencing_token())
        .await
        .unwrap_err();
    assert!(err.is_not_holder(), "{err}");
    // A clone queues behind the holder and is granted once the holder releases.
    let waiter = tokio::spawn(async move {
        other
            .try_acquire("shared-key", ttl, Duration::from_secs(10))
            .await
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if lock_info(&leader, "shared-key").await["waiters"]
            .as_array()
            .is_some_and(|w| w.len() == 1)
        {
            break;
        }
        assert!(Instant::now() < deadline, "the clone never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first_token = holder.fencing_token();
    let first_owner = holder.owner_id().to_string();
    holder
        .renew()
        .await
        .expect("the holder renews with its owner id");
    holder.release().await.expect("release");
    let next = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("granted in time")
        .expect("task")
        .expect("try_acquire")
        .expect("granted after the release");
    assert!(next.fencing_token() > first_token);
    assert_ne!(next.owner_id(), first_owner);
    next.release().await.expect("release");

    // A client id of the longest accepted length still yields owner ids the server accepts.
    let long_id = format!("{}é", "x".repeat(126));
    assert_eq!(long_id.len(), 128);
    let long = client(&endpoints(&cluster), &long_id);
    let a = long
        .try_acquire("long-a", ttl, Duration::ZERO)
        .await
        .expect("acquire with a long client id")
        .expect("free");
    let b = long
        .try_acquire("long-b", ttl, Duration::ZERO)
        .await
        .expect("acquire with a long client id")
        .expect("free");
    assert!(a.owner_id().len() <= 128, "{}", a.owner_id());
    assert_ne!(a.owner_id(), b.owner_id());
    a.release().await.expect("release");
    b.release().await.expect("release");
}

/// Every owner id opens a session on the cluster: a client that made a new one for each
/// acquire filled the session table within `max_sessions` acquires and was refused with BUSY
/// (found by tests/tls.rs's rotation load). Released owner ids are reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sequential_acquires_do_not_fill_the_session_table() {
    let cluster = Cluster::start_with(3, |_| vec!["--max-sessions".into(), "20".into()]);
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let c = client(&endpoints(&cluster), "sdk-many");
    for i in 0..200 {
        let key = format!("many/{}", i % 5);
        let handle = c
            .acquire(&key)
            .await
            .unwrap_or_else(|e| panic!("acquire {i}: {e}"));
        handle
            .release()
            .await
            .unwrap_or_else(|e| panic!("release {i}: {e}"));
    }
    // Two locks held at once still have two owners.
    let a = c.acquire("many/a").await.unwrap();
    let b = c.acquire("many/b").await.unwrap();
    assert_ne!(a.owner_id(), b.owner_id());
}

/// With its default client id the SDK acknowledges the answers it received (`ackBelow`), so a
/// cluster whose table keeps 40 answers for a minute serves it for as long as it likes: 150
/// lock cycles and guarded writes, none refused (a client that did not acknowledge would be
/// paced to about one request a second after its first few, and its short retry budget would
/// run out). Its answers do not pile up in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_acknowledges_its_answers_and_is_not_held_to_the_tables_rate() {
    let cluster = cluster_with_a_small_table();
    let addr = leader_addr(&cluster).await;
    wait_for_cluster_version(&addr, 3).await;
    let c = RaftLockClient::builder()
        .endpoints(endpoints(&cluster))
        .retry_policy(RetryPolicy {
            max_elapsed: Duration::from_secs(2),
            ..RetryPolicy::default()
        })
        .build()
        .expect("client");
    for i in 0..150 {
        let key = format!("acked/{}", i % 3);
        let handle = c
            .acquire(&key)
            .await
            .unwrap_or_else(|e| panic!("acquire {i}: {e}"));
        if i % 10 == 0 {
            handle
                .put(&format!("acked-data/{i}"), "v")
                .await
                .unwrap_or_else(|e| panic!("put {i}: {e}"));
        }
        handle
            .release()
            .await
            .unwrap_or_else(|e| panic!("release {i}: {e}"));
    }
    let text = http_get(&addr, "/metrics").await.expect("metrics").1;
    let kept = metric_sum(&text, "raftlock_answers_remembered ", &[]);
    assert!(
        kept <= 3.0,
        "the table keeps {kept} answers after 315 acknowledged requests"
    );
}

/// Many callers on one connection at once: clones of one client share its WebSocket, and
/// requests that queue for it while another is being written go out together (as the node's
/// answers to them do). Every caller gets its own answer: 300 locks on distinct keys, each
/// granted once with its own fencing token and released, none left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_on_one_connection_each_get_their_answer() {
    let cluster = Cluster::start(3);
    let leader = leader_addr(&cluster).await;
    let shared = client(&endpoints(&cluster), "sdk-inflight");
    let ttl = Duration::from_secs(30);
    let tasks: Vec<_> = (0..300)
        .map(|i| {
            let c = shared.clone();
            tokio::spawn(async move {
                let key = format!("inflight/{i}");
                let held = c
                    .try_acquire(&key, ttl, Duration::ZERO)
                    .await
                    .unwrap_or_else(|e| panic!("acquire {key}: {e}"))
                    .unwrap_or_else(|| panic!("{key} is free, yet not granted"));
                assert_eq!(held.key(), key);
                let token = held.fencing_token();
                held.release()
                    .await
                    .unwrap_or_else(|e| panic!("release {key}: {e}"));
                token
            })
        })
        .collect();
    let mut tokens = Vec::new();
    for t in tasks {
        tokens.push(t.await.expect("task"));
    }
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 300, "every grant has its own fencing token");
    let v = http_json(&leader, "/locks?prefix=inflight/")
        .await
        .expect("locks");
    assert_eq!(v["locks"].as_array().map(Vec::len), Some(0), "{v}");
}

/// `set_lock_delay`: a lock whose holder let its lease run out is granted to the next client
/// only after the key's lock-delay; the setting is removed with `Duration::ZERO`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_delay_holds_an_expired_key_back() {
    let cluster = Cluster::start(3);
    let addr = leader_addr(&cluster).await;
    wait_for_cluster_version(&addr, 6).await;
    let ops = client(&endpoints(&cluster), "sdk-ops");
    let delay = Duration::from_millis(2_000);
    assert_eq!(
        ops.set_lock_delay("cron/nightly", delay)
            .await
            .expect("set"),
        delay
    );
    let worker = client(&endpoints(&cluster), "sdk-worker");
    let ttl = Duration::from_millis(500);
    let held = worker
        .try_acquire("cron/nightly", ttl, Duration::ZERO)
        .await
        .expect("try")
        .expect("free");
    let granted = Instant::now();
    // The worker goes silent: no renewal, no release.
    let other = client(&endpoints(&cluster), "sdk-other");
    let next = other
        .try_acquire(
            "cron/nightly",
            Duration::from_secs(5),
            Duration::from_secs(15),
        )
        .await
        .expect("try")
        .expect("granted after the TTL and the delay");
    let waited = granted.elapsed();
    assert!(next.fencing_token() > held.fencing_token());
    assert!(
        waited >= ttl + delay * 95 / 100,
        "granted {waited:?} after the silent holder's grant: within its TTL and lock-delay"
    );
    assert!(!held.is_valid());
    next.release().await.expect("release");
    assert_eq!(
        ops.set_lock_delay("cron/nightly", Duration::ZERO)
            .await
            .expect("remove"),
        Duration::ZERO
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_has_one_leader_who_proclaims_and_resigns() {
    let cluster = Cluster::start(3);
    let addr = leader_addr(&cluster).await;
    wait_for_cluster_version(&addr, 7).await;
    let a = client(&endpoints(&cluster), "sdk-cand-a");
    let b = client(&endpoints(&cluster), "sdk-cand-b");
    let watcher = client(&endpoints(&cluster), "sdk-watcher");
    let election = "shards/7";
    let mut observer = watcher.observe(election).await.expect("observe");
    let first = tokio::time::timeout(Duration::from_secs(10), observer.next())
        .await
        .expect("in time")
        .expect("open")
        .expect("read");
    assert_eq!(first, None, "no one leads yet");

    let leading = a.campaign(election, "10.0.0.1:80").await.expect("elected");
    let now = watcher
        .leader(election)
        .await
        .expect("read")
        .expect("a leads");
    assert_eq!(now.leader, leading.owner_id());
    assert_eq!(now.term, leading.term());
    assert_eq!(now.value.as_deref(), Some("10.0.0.1:80"));
    // Someone else can neither be elected at once nor take the key as a plain lock.
    let busy = b
        .campaign_with(
            election,
            "10.0.0.2:80",
            Duration::from_secs(5),
            Some(Duration::ZERO),
        )
        .await
        .unwrap_err();
    assert!(matches!(busy, ClientError::WaitTimeout { .. }), "{busy}");
    let plain = b
        .try_acquire(election, Duration::from_secs(5), Duration::ZERO)
        .await;
    assert_eq!(
        plain.unwrap_err().code(),
        Some("INVALID_REQUEST"),
        "an election's key is not a lock"
    );
    // b waits as a candidate while a proclaims a new value.
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move {
            b.campaign_with(
                election,
                "10.0.0.2:80",
                Duration::from_secs(10),
                Some(Duration::from_secs(20)),
            )
            .await
        })
    };
    leading.proclaim("10.0.0.1:81").await.expect("proclaim");
    let now = watcher
        .leader(election)
        .await
        .expect("read")
        .expect("a leads");
    assert_eq!(now.value.as_deref(), Some("10.0.0.1:81"));
    let first_term = leading.term();
    leading.resign().await.expect("resign");
    let next = waiting.await.expect("joined").expect("b elected");
    assert!(next.term() > first_term, "a new term has a larger token");
    let now = watcher
        .leader(election)
        .await
        .expect("read")
        .expect("b leads");
    assert_eq!(
        (now.leader.as_str(), now.term, now.value.as_deref()),
        (next.owner_id(), next.term(), Some("10.0.0.2:80"))
    );
    // A proclaim with the ended term is refused.
    let stale = a.proclaim(election, first_term, "late").await.unwrap_err();
    assert!(
        matches!(stale.code(), Some("STALE_TOKEN" | "NOT_HOLDER")),
        "{stale}"
    );
    // The observer saw each leader and value, in order; the resignation shows as a vacancy
    // before the next leader (both at the log index of the hand-off).
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let change = tokio::time::timeout(Duration::from_secs(10), observer.next())
            .await
            .expect("in time")
            .expect("open")
            .expect("event");
        seen.push(change.map(|c| (c.term, c.value.unwrap_or_default())));
    }
    assert_eq!(
        seen,
        [
            Some((first_term, "10.0.0.1:80".to_string())),
            Some((first_term, "10.0.0.1:81".to_string())),
            None,
            Some((next.term(), "10.0.0.2:80".to_string())),
        ]
    );
    next.resign().await.expect("resign");
    assert_eq!(watcher.leader(election).await.expect("read"), None);
}

// ----- the Rust recipes of docs/recipes.md, run as written --------------------------------------

const RECIPES_DOC: &str = include_str!("../docs/recipes.md");
const THIS_FILE: &str = include_str!("sdk.rs");

/// The code between `// recipe: NAME` and `// recipe end` in `text`, without whitespace and
/// trailing commas (so that rustfmt's line breaks do not count).
fn recipe_lines(text: &str, name: &str) -> String {
    let start = format!("// recipe: {name}");
    let code: String = text
        .lines()
        .map(str::trim)
        .skip_while(|l| *l != start)
        .skip(1)
        .take_while(|l| *l != "// recipe end")
        .collect();
    code.split_whitespace()
        .collect::<String>()
        .replace(",)", ")")
}

static SETTLED_WITH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

async fn settle(token: u64) {
    SETTLED_WITH.store(token, std::sync::atomic::Ordering::SeqCst);
}

async fn recipe_run_once(endpoints: Vec<String>) -> Result<(), Box<dyn std::error::Error>> {
    // recipe: run-once
    let client = RaftLockClient::builder().endpoints(endpoints).build()?;
    if let Some(lock) = client
        .try_acquire(
            "jobs/nightly-settlement",
            Duration::from_secs(15),
            Duration::ZERO,
        )
        .await?
    {
        let mut renewer = lock.auto_renew();
        tokio::select! {
            _ = settle(lock.fencing_token()) => {}
            reason = renewer.lost() => eprintln!("stopping: {reason}"),
        }
        lock.release().await?;
    }
    // recipe end
    Ok(())
}

async fn recipe_lock_delay(endpoints: Vec<String>) -> Result<(), Box<dyn std::error::Error>> {
    // recipe: lock-delay
    let ops = RaftLockClient::builder().endpoints(endpoints).build()?;
    ops.set_lock_delay("legacy/ledger", Duration::from_secs(10))
        .await?;
    // ... holders of "legacy/ledger" use it as usual; after an expiry, no grant for 10 s.
    ops.set_lock_delay("legacy/ledger", Duration::ZERO).await?;
    // recipe end
    Ok(())
}

static SERVED_AS_LEADER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

async fn serve_shard(term: u64) {
    SERVED_AS_LEADER.store(term, std::sync::atomic::Ordering::SeqCst);
}

async fn recipe_leader(endpoints: Vec<String>) -> Result<(), Box<dyn std::error::Error>> {
    // recipe: leader
    let client = RaftLockClient::builder().endpoints(endpoints).build()?;
    let leading = client.campaign("shards/7", "10.0.0.7:8080").await?;
    let mut renewer = leading.auto_renew();
    tokio::select! {
        _ = serve_shard(leading.term()) => {}
        reason = renewer.lost() => eprintln!("no longer the leader: {reason}"),
    }
    leading.resign().await?;
    // recipe end
    Ok(())
}

static CACHE_TOKENS: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

async fn warm_cache(token: u64) {
    CACHE_TOKENS.lock().unwrap().push(token);
}

async fn read_cache(token: u64) {
    CACHE_TOKENS.lock().unwrap().push(token);
}

async fn recipe_cache(endpoints: Vec<String>) -> Result<(), Box<dyn std::error::Error>> {
    // recipe: cache
    let client = RaftLockClient::builder().endpoints(endpoints).build()?;
    let writer = client.acquire_write("cache/prices").await?;
    warm_cache(writer.fencing_token()).await;
    writer.release().await?;
    let reader = client.acquire_read("cache/prices").await?;
    read_cache(reader.fencing_token()).await;
    reader.release().await?;
    // recipe end
    Ok(())
}

static GPU_SLOT: std::sync::Mutex<Option<(Option<u32>, u64)>> = std::sync::Mutex::new(None);

async fn run_on_gpu(slot: Option<u32>, token: u64) {
    *GPU_SLOT.lock().unwrap() = Some((slot, token));
}

async fn recipe_pool(endpoints: Vec<String>) -> Result<(), Box<dyn std::error::Error>> {
    // recipe: pool
    let client = RaftLockClient::builder().endpoints(endpoints).build()?;
    let permit = client.acquire_permit("pool/gpus", 4).await?;
    run_on_gpu(permit.slot(), permit.fencing_token()).await;
    permit.release().await?;
    // recipe end
    Ok(())
}

/// Every Rust recipe in docs/recipes.md is the code of a function here, and runs against a real
/// cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recipes_in_the_docs_run() {
    let in_doc = RECIPES_DOC
        .lines()
        .filter(|l| l.trim().starts_with("// recipe: "))
        .count();
    assert_eq!(
        in_doc, 5,
        "docs/recipes.md has recipes this test does not run"
    );
    for name in ["run-once", "lock-delay", "leader", "cache", "pool"] {
        let doc = recipe_lines(RECIPES_DOC, name);
        assert!(!doc.is_empty(), "no recipe {name} in docs/recipes.md");
        assert_eq!(
            doc,
            recipe_lines(THIS_FILE, name),
            "docs/recipes.md's {name} differs from the code this test runs"
        );
    }
    let cluster = Cluster::start(3);
    let addr = leader_addr(&cluster).await;
    wait_for_cluster_version(&addr, 9).await;
    recipe_run_once(endpoints(&cluster))
        .await
        .expect("run-once recipe");
    assert!(SETTLED_WITH.load(std::sync::atomic::Ordering::SeqCst) > 0);
    recipe_lock_delay(endpoints(&cluster))
        .await
        .expect("lock-delay recipe");
    recipe_leader(endpoints(&cluster))
        .await
        .expect("leader recipe");
    assert!(SERVED_AS_LEADER.load(std::sync::atomic::Ordering::SeqCst) > 0);
    recipe_cache(endpoints(&cluster))
        .await
        .expect("cache recipe");
    let tokens = CACHE_TOKENS.lock().unwrap().clone();
    assert!(tokens.len() == 2 && tokens[0] < tokens[1], "{tokens:?}");
    recipe_pool(endpoints(&cluster)).await.expect("pool recipe");
    let gpu = *GPU_SLOT.lock().unwrap();
    assert!(matches!(gpu, Some((Some(0), t)) if t > 0), "{gpu:?}");
}

/// A session through the SDK: locks attached to it live while it is kept alive, a second
/// client cannot take them, and ending the session frees them all at once. Then the keepalive
/// traffic the issue asks for, counted (not timed): 1,000 locks held for `HOLD` on one session
/// against 1,000 locks each renewed by its own handle, as requests the leader counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_keeps_many_locks_with_one_keepalive() {
    const LOCKS: usize = 1_000;
    const TTL: Duration = Duration::from_secs(3);
    const HOLD: Duration = Duration::from_secs(6);
    let cluster = Cluster::start(3);
    let addr = leader_addr(&cluster).await;
    wait_for_cluster_version(&addr, 8).await;
    let a = client(&endpoints(&cluster), "sdk-sess-a");
    let b = client(&endpoints(&cluster), "sdk-sess-b");

    let mut session = a.open_session(TTL).await.expect("open");
    session.auto_keep_alive();
    let first = session
        .acquire("sess/0", Some(Duration::ZERO))
        .await
        .expect("take");
    let taken = b
        .try_acquire("sess/0", Duration::from_secs(5), Duration::ZERO)
        .await
        .expect("ask");
    assert!(taken.is_none(), "a lock attached to a live session is held");
    tokio::time::sleep(TTL + TTL / 2).await;
    assert!(session.is_valid(), "kept alive in the background");
    let taken = b
        .try_acquire("sess/0", Duration::from_secs(5), Duration::ZERO)
        .await
        .expect("ask");
    assert!(
        taken.is_none(),
        "still held after one TTL: the keepalives cover it"
    );
    for i in 1..LOCKS {
        session
            .acquire(&format!("sess/{i}"), Some(Duration::ZERO))
            .await
            .expect("take");
    }

    // Traffic to keep 1,000 locks for HOLD: one session ...
    let keepalives_before = requests_counted(&addr, Some("keep_alive"), "kept").await;
    tokio::time::sleep(HOLD).await;
    let keepalives = requests_counted(&addr, Some("keep_alive"), "kept").await - keepalives_before;
    let ended = session.end().await.expect("end");
    assert_eq!(
        ended as usize, LOCKS,
        "every attached lock ended with the session"
    );
    let g = b
        .try_acquire("sess/0", Duration::from_secs(5), Duration::ZERO)
        .await
        .expect("ask")
        .expect("free once the session ended");
    assert!(g.fencing_token() > first.token);
    g.release().await.expect("release");

    // ... against 1,000 locks renewed one by one.
    let mut handles = Vec::new();
    for i in 0..LOCKS {
        let h = a
            .try_acquire(&format!("own/{i}"), TTL, Duration::ZERO)
            .await
            .expect("ask")
            .expect("free");
        handles.push(h);
    }
    let renewers: Vec<_> = handles.iter().map(|h| h.auto_renew()).collect();
    let renews_before = requests_counted(&addr, Some("renew"), "renewed").await;
    tokio::time::sleep(HOLD).await;
    let renews = requests_counted(&addr, Some("renew"), "renewed").await - renews_before;
    drop(renewers);
    println!(
        "keepalive traffic for {LOCKS} locks over {HOLD:?} (TTL {TTL:?}): one session \
         {keepalives} keepalives, {LOCKS} renewed locks {renews} renewals ({:.0}x)",
        renews / keepalives.max(1.0)
    );
    assert!(keepalives >= 1.0, "the session was kept alive");
    assert!(
        renews >= 100.0 * keepalives,
        "one session should need a small fraction of the renewals: {keepalives} keepalives, \
         {renews} renewals"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_a_writer_waits_and_a_semaphore_counts_its_permits() {
    use raftlock::client::ClientError;
    use raftlock::lock::LockMode;
    let cluster = Cluster::start(3);
    let addr = leader_addr(&cluster).await;
    wait_for_cluster_version(&addr, 9).await;
    let a = client(&endpoints(&cluster), "sdk-rw-a");
    let b = client(&endpoints(&cluster), "sdk-rw-b");
    let ttl = Duration::from_secs(10);

    // Two readers at once; the writer, asked not to wait, is refused.
    let r1 = a.acquire_read("rw/doc").await.expect("reader a");
    let r2 = b.acquire_read("rw/doc").await.expect("reader b");
    assert_eq!((r1.mode(), r1.token_mode()), (LockMode::Read, "reader"));
    assert!(r2.fencing_token() > r1.fencing_token());
    let refused = a
        .acquire_shared_with("rw/doc", LockMode::Write, 0, ttl, Some(Duration::ZERO))
        .await;
    assert!(
        matches!(refused, Err(ClientError::WaitTimeout { .. })),
        "{refused:?}"
    );
    // A waiting writer is granted once both readers are gone (one released, one dropped), and
    // a reader arriving after it waits for it.
    let writer = {
        let a = a.clone();
        tokio::spawn(async move { a.acquire_write("rw/doc").await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let late_reader = b
        .acquire_shared_with(
            "rw/doc",
            LockMode::Read,
            0,
            ttl,
            Some(Duration::from_millis(300)),
        )
        .await;
    assert!(
        matches!(late_reader, Err(ClientError::WaitTimeout { .. })),
        "a reader behind a waiting writer waits: {late_reader:?}"
    );
    let readers_max = r2.fencing_token();
    r1.release().await.expect("release");
    drop(r2);
    let w = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("writer granted in time")
        .expect("task")
        .expect("writer");
    assert_eq!(w.token_mode(), "writer");
    assert!(w.fencing_token() > readers_max);
    w.renew().await.expect("a writer renews");
    w.release().await.expect("release");

    // A semaphore of two: two permits in slots 0 and 1, a third waits until one is released.
    let p1 = a.acquire_permit("sem/pool", 2).await.expect("permit 1");
    let p2 = b.acquire_permit("sem/pool", 2).await.expect("permit 2");
    let mut slots = [p1.slot(), p2.slot()];
    slots.sort();
    assert_eq!(slots, [Some(0), Some(1)]);
    let c = client(&endpoints(&cluster), "sdk-rw-c");
    let none = c
        .acquire_shared_with("sem/pool", LockMode::Permit, 2, ttl, Some(Duration::ZERO))
        .await;
    assert!(
        matches!(none, Err(ClientError::WaitTimeout { .. })),
        "{none:?}"
    );
    let freed = p1.slot();
    p1.release().await.expect("release");
    let p3 = c.acquire_permit("sem/pool", 2).await.expect("permit 3");
    assert_eq!(p3.slot(), freed, "the freed slot is taken again");
    // Bad input is refused before it is sent.
    let bad = c
        .acquire_shared_with("sem/pool", LockMode::Permit, 0, ttl, None)
        .await;
    assert!(matches!(bad, Err(ClientError::Config(_))), "{bad:?}");
    drop((p2, p3));
}

/// A read lock and a permit taken through a session end with it, in one entry: a writer and a
/// permit waiting behind them are granted when the session ends. An admin's `set_permits`
/// raises a semaphore's size and grants the waiter that now fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_locks_and_permits_on_a_session_end_with_it_and_set_permits_grants_waiters() {
    use raftlock::lock::LockMode;
    let cluster = Cluster::start(3);
    let addr = leader_addr(&cluster).await;
    wait_for_cluster_version(&addr, 9).await;
    let a = client(&endpoints(&cluster), "sdk-ss-a");
    let b = client(&endpoints(&cluster), "sdk-ss-b");

    let session = a
        .open_session(Duration::from_secs(10))
        .await
        .expect("session");
    let read = session
        .acquire_shared("ss/doc", LockMode::Read, 0, Some(Duration::ZERO))
        .await
        .expect("reader on the session");
    assert_eq!(read.mode, Some(LockMode::Read));
    let permit = session
        .acquire_shared("ss/pool", LockMode::Permit, 1, Some(Duration::ZERO))
        .await
        .expect("permit on the session");
    assert_eq!(
        (permit.mode, permit.slot),
        (Some(LockMode::Permit), Some(0))
    );
    // Others wait behind them.
    let writer = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire_write("ss/doc").await })
    };
    let second = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire_permit("ss/pool", 1).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!writer.is_finished() && !second.is_finished());
    assert_eq!(
        session.end().await.expect("end"),
        2,
        "both ended with the session"
    );
    let w = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("writer granted in time")
        .expect("task")
        .expect("writer");
    assert!(w.fencing_token() > read.token);
    let p = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("permit granted in time")
        .expect("task")
        .expect("permit");
    assert_eq!(p.slot(), Some(0), "the session's slot is free again");

    // The semaphore is full (size 1); raising it to 2 grants the waiter at once.
    let c = client(&endpoints(&cluster), "sdk-ss-c");
    let third = {
        let c = c.clone();
        tokio::spawn(async move { c.acquire_permit("ss/pool", 1).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!third.is_finished(), "a permit past the size waits");
    assert_eq!(a.set_permits("ss/pool", 2).await.expect("set permits"), 2);
    let p3 = tokio::time::timeout(Duration::from_secs(10), third)
        .await
        .expect("granted once the size grew")
        .expect("task")
        .expect("permit");
    assert_eq!(p3.slot(), Some(1));
    drop((w, p, p3));
}
