//! The watch stream on real processes: lock events arrive in log order on any node, only under
//! the watched prefix, and a watch started from an index (after a reconnect, on another node, by
//! the SDK or `lockctl watch`) gets exactly the events after it.

mod common;

use std::time::{Duration, Instant};

use common::*;
use raftlock::client::RaftLockClient;
use serde_json::{json, Value};

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);

fn acquire(key: &str, client: &str, request: &str, ttl: u64, wait: u64) -> Value {
    json!({"commandType": 3, "key": key, "clientId": client, "requestId": request,
           "ttl": ttl, "waitTimeout": wait})
}

/// Lock events (leader changes left out) from a watch socket until `want` have arrived or 20 s.
async fn collect(ws: &mut Ws, want: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    while out.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(v) = ws_recv(ws, left).await else {
            break;
        };
        if v["event"].is_string() && v["event"] != "leader" {
            out.push(v);
        }
    }
    out
}

fn summary(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            format!(
                "{} {} {}",
                e["event"].as_str().unwrap_or(""),
                e["key"].as_str().unwrap_or(""),
                e["client"].as_str().unwrap_or("")
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arrive_in_order_and_a_watch_resumes_from_an_index() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let leader_addr = cluster.client_addr_of(leader);
    let (_, follower_addr) = follower_knowing(&cluster, leader).await;

    // Watch `job/` on a follower.
    let mut watcher = ws_connect(&follower_addr).await;
    ws_send(
        &mut watcher,
        &json!({"commandType": 8, "requestId": "w1", "key": "job/"}),
    )
    .await;
    let ack = ws_recv(&mut watcher, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(ack["watching"], true, "{ack}");
    let start = ack["index"].as_u64().unwrap();

    // c1 takes job/a; c2 queues behind it; a key outside the prefix; c1 releases (hand-off to
    // c2, whose 1.5 s lease later expires); c3 queues and gives up after 300 ms.
    let mut c1 = ws_connect(&leader_addr).await;
    let g = ws_request(&mut c1, &acquire("job/a", "c1", "r1", 10_000, 0)).await;
    assert_eq!(g["success"], true, "{g}");
    let mut c2 = ws_connect(&leader_addr).await;
    ws_send(&mut c2, &acquire("job/a", "c2", "r2", 1_500, 20_000)).await;
    let mut c9 = ws_connect(&leader_addr).await;
    let g9 = ws_request(&mut c9, &acquire("other/x", "c9", "r9", 10_000, 0)).await;
    assert_eq!(g9["success"], true, "{g9}");
    // The release must come after c2 is queued: wait until the watch has shown it.
    let first = collect(&mut watcher, 2).await;
    assert_eq!(summary(&first), vec!["granted job/a c1", "queued job/a c2"]);
    let token = g["fencingToken"]["value"].as_u64().unwrap();
    let rel = json!({"commandType": 4, "key": "job/a", "clientId": "c1", "requestId": "r3",
                     "fencingToken": {"key": "job/a", "value": token}});
    let r = ws_request(&mut c1, &rel).await;
    assert_eq!(r["success"], true, "{r}");
    let handed = ws_recv(&mut c2, Duration::from_secs(10)).await.unwrap();
    assert_eq!(handed["success"], true, "{handed}");
    let mut c3 = ws_connect(&leader_addr).await;
    let r3 = ws_request(&mut c3, &acquire("job/a", "c3", "r4", 10_000, 300)).await;
    assert_eq!(r3["error"]["code"], "WAIT_TIMEOUT", "{r3}");
    let rest = collect(&mut watcher, 5).await;
    assert_eq!(
        summary(&rest),
        vec![
            "released job/a c1",
            "granted job/a c2",
            "queued job/a c3",
            "cancelled job/a c3",
            "expired job/a c2",
        ]
    );
    let all: Vec<Value> = first.iter().chain(rest.iter()).cloned().collect();
    let indexes: Vec<u64> = all.iter().map(|e| e["index"].as_u64().unwrap()).collect();
    assert!(indexes.windows(2).all(|w| w[0] <= w[1]), "{indexes:?}");
    assert!(indexes[0] > start, "{indexes:?} after {start}");
    assert!(all[3]["token"].as_u64().unwrap() > token, "{}", all[3]);
    assert!(all.iter().all(|e| e["requestId"] == "w1"));

    // A reconnect: a new watch on another node from the index of the hand-off gets exactly the
    // events after it.
    let resume_at = all[3]["index"].as_u64().unwrap();
    let mut again = ws_connect(&leader_addr).await;
    ws_send(
        &mut again,
        &json!({"commandType": 8, "requestId": "w2", "key": "job/", "fromIndex": resume_at}),
    )
    .await;
    let ack = ws_recv(&mut again, Duration::from_secs(10)).await.unwrap();
    assert_eq!(ack["watching"], true, "{ack}");
    let tail = collect(&mut again, 3).await;
    assert_eq!(summary(&tail), summary(&all[4..]));

    // The SDK: every event from the start (two of them share the hand-off's index), on any node.
    let client = RaftLockClient::builder()
        .endpoints(endpoints(&cluster))
        .build()
        .unwrap();
    let mut watch = client.watch("job/", Some(start)).await.unwrap();
    let mut sdk = Vec::new();
    while sdk.len() < 7 {
        let e = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("an event within 10 s")
            .unwrap()
            .unwrap();
        if e.event != "leader" {
            sdk.push(format!(
                "{} {} {}",
                e.event,
                e.key.unwrap_or_default(),
                e.client.unwrap_or_default()
            ));
        }
    }
    assert_eq!(sdk, summary(&all));
    assert_eq!(watch.last_index(), all[6]["index"].as_u64());

    // lockctl watch, bounded by --count.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_lockctl"))
        .args([
            "--endpoints",
            &follower_addr,
            "--output",
            "json",
            "watch",
            "job/",
        ])
        .args([
            "--from-index",
            &start.to_string(),
            "--count",
            "2",
            "--timeout",
            "20s",
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v["event"] != "leader")
        .collect();
    assert_eq!(summary(&lines), summary(&all[..lines.len()]));

    // Bad watches are refused with a reason, and change nothing.
    let mut bad = ws_connect(&leader_addr).await;
    let r = ws_request(
        &mut bad,
        &json!({"commandType": 8, "requestId": "b", "fromIndex": "yesterday"}),
    )
    .await;
    assert_eq!(r["error"]["code"], "INVALID_REQUEST", "{r}");
}

/// The SDK's watch survives the loss of the node it watches: it reconnects to another and goes
/// on from where it was, with nothing lost or repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_watch_resumes_on_another_node_when_its_node_dies() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let leader_addr = cluster.client_addr_of(leader);
    let (follower, follower_addr) = follower_knowing(&cluster, leader).await;
    let mut order = vec![follower_addr.clone()];
    order.extend(
        endpoints(&cluster)
            .into_iter()
            .filter(|a| *a != follower_addr),
    );
    let client = RaftLockClient::builder().endpoints(order).build().unwrap();
    let mut watch = client.watch("r/", None).await.unwrap();
    let mut next = async || loop {
        let e = tokio::time::timeout(Duration::from_secs(15), watch.next())
            .await
            .expect("an event within 15 s")
            .expect("the watch goes on")
            .expect("no error");
        if e.event != "leader" {
            return format!(
                "{} {} {}",
                e.event,
                e.key.unwrap_or_default(),
                e.client.unwrap_or_default()
            );
        }
    };

    let mut c1 = ws_connect(&leader_addr).await;
    let g1 = ws_request(&mut c1, &acquire("r/a", "c1", "a1", 30_000, 0)).await;
    assert_eq!(g1["success"], true, "{g1}");
    assert_eq!(next().await, "granted r/a c1");
    let mut c2 = ws_connect(&leader_addr).await;
    ws_send(&mut c2, &acquire("r/a", "c2", "a2", 30_000, 20_000)).await;
    assert_eq!(next().await, "queued r/a c2");
    let t1 = g1["fencingToken"]["value"].as_u64().unwrap();
    let rel = json!({"commandType": 4, "key": "r/a", "clientId": "c1", "requestId": "a3",
                     "fencingToken": {"key": "r/a", "value": t1}});
    assert_eq!(ws_request(&mut c1, &rel).await["success"], true);
    assert_eq!(next().await, "released r/a c1");
    assert_eq!(next().await, "granted r/a c2");
    let g2 = ws_recv(&mut c2, Duration::from_secs(10)).await.unwrap();
    let t2 = g2["fencingToken"]["value"].as_u64().unwrap();

    // The watched node dies; more happens meanwhile.
    cluster.node(follower).kill();
    let rel2 = json!({"commandType": 4, "key": "r/a", "clientId": "c2", "requestId": "a4",
                      "fencingToken": {"key": "r/a", "value": t2}});
    assert_eq!(ws_request(&mut c2, &rel2).await["success"], true);
    let g3 = ws_request(&mut c1, &acquire("r/b", "c3", "a5", 30_000, 0)).await;
    assert_eq!(g3["success"], true, "{g3}");
    assert_eq!(next().await, "released r/a c2");
    assert_eq!(next().await, "granted r/b c3");
}
