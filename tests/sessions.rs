//! Client sessions on a real three-node cluster: the session bound refuses a new client with
//! `BUSY` and changes nothing, an open session still answers retries from the table, and the
//! leader's `Tick` entries close idle sessions — after which a new client is admitted and the
//! old request ids are forgotten. Run with short settings (`--session-idle 2s`,
//! `--dedupe-retain 1s`, `--max-sessions 2`).
//!
//! Every wait is bounded; everything is on 127.0.0.1.

mod common;

use std::time::{Duration, Instant};

use common::*;
use raftlock::server::proto::lock::lock_service_client::LockServiceClient;
use raftlock::server::proto::lock::{AcquireLockRequest, ReleaseLockRequest};
use serde_json::{json, Value};

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);

fn acquire(key: &str, client: &str, request: &str) -> Value {
    json!({"commandType": 3, "key": key, "clientId": client, "ttl": 60000,
           "requestId": request, "waitTimeout": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_bounded_and_close_through_the_log() {
    let cluster = Cluster::start_with(3, |_| {
        [
            "--max-sessions",
            "2",
            "--session-idle",
            "2s",
            "--dedupe-retain",
            "1s",
        ]
        .map(String::from)
        .to_vec()
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.nodes[leader as usize - 1].client_addr();
    let mut ws = ws_connect(&addr).await;

    // Two clients open the two sessions the cluster allows.
    let a = ws_request(&mut ws, &acquire("k1", "a", "a1")).await;
    assert_eq!(a["success"], true, "{a}");
    let token_a = a["fencingToken"]["value"].as_u64().expect("token");
    let b = ws_request(&mut ws, &acquire("k2", "b", "b1")).await;
    assert_eq!(b["success"], true, "{b}");

    // A third client is refused with BUSY, and its lock is not taken.
    let c = ws_request(&mut ws, &acquire("k3", "c", "c1")).await;
    assert_eq!(c["success"], false, "{c}");
    assert_eq!(error_code(&c), "BUSY", "{c}");
    let locks = http_json(&addr, "/locks").await.expect("/locks");
    assert!(!locks.to_string().contains("\"k3\""), "{locks}");

    // a's retry is answered from its open session with the original grant.
    let again = ws_request(&mut ws, &acquire("k1", "a", "a1")).await;
    assert_eq!(again["success"], true, "{again}");
    assert_eq!(again["fencingToken"]["value"].as_u64(), Some(token_a));

    // Once a and b have been idle for two seconds of log time, the leader's ticks close their
    // sessions and c gets in (each attempt with a new request id).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let r = ws_request(&mut ws, &acquire("k3", "c", &format!("c{attempt}"))).await;
        if r["success"] == true {
            break;
        }
        assert_eq!(error_code(&r), "BUSY", "{r}");
        assert!(
            Instant::now() < deadline,
            "idle sessions never closed; last reply {r}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(attempt > 1, "c was admitted before any session closed");

    // a's session closed, so "a1" is a new request now: a still holds k1 (locks are not
    // sessions), and a lock is not re-entrant.
    let late = ws_request(&mut ws, &acquire("k1", "a", "a1")).await;
    assert_eq!(late["success"], false, "{late}");
    assert_eq!(error_code(&late), "ALREADY_HELD", "{late}");
    assert_eq!(
        late["error"]["currentToken"]
            .as_u64()
            .or(late["currentToken"].as_u64()),
        Some(token_a),
        "{late}"
    );
}

/// A load above the exactly-once table's sustainable rate is paced by the leader (`BUSY` with
/// the pacing message) instead of filling the table: the table's own bound is never reached, so
/// locks keep being granted every second instead of stopping until answers age out. With
/// `--max-answers 600 --dedupe-retain 5s` the table sustains 120 answers a second; one client
/// in a tight acquire/release loop asks for several times that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_above_the_tables_rate_is_paced_not_stopped() {
    let cluster = Cluster::start_with(3, |_| {
        [
            "--max-answers",
            "600",
            "--dedupe-retain",
            "5s",
            "--session-idle",
            "10s",
        ]
        .map(String::from)
        .to_vec()
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.nodes[leader as usize - 1].client_addr();
    let mut ws = ws_connect(&addr).await;

    let started = Instant::now();
    let seconds = 12;
    let mut granted = vec![0u32; seconds];
    let (mut paced, mut walled, mut n) = (0u32, Vec::new(), 0u64);
    while started.elapsed() < Duration::from_secs(seconds as u64) {
        n += 1;
        let r = ws_request(&mut ws, &acquire(&format!("k{n}"), "p", &format!("a{n}"))).await;
        if r["success"] == true {
            granted[started.elapsed().as_secs().min(seconds as u64 - 1) as usize] += 1;
            let token = r["fencingToken"]["value"].as_u64().expect("token");
            let release = json!({"commandType": 4, "key": format!("k{n}"), "clientId": "p",
                                 "requestId": format!("r{n}"),
                                 "fencingToken": {"key": format!("k{n}"), "value": token}});
            // Releases are never paced; retry one the table's own bound refused.
            loop {
                let rel = ws_request(&mut ws, &release).await;
                if rel["success"] == true {
                    break;
                }
                assert_eq!(error_code(&rel), "BUSY", "{rel}");
                walled.push(rel.to_string());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            continue;
        }
        assert_eq!(error_code(&r), "BUSY", "{r}");
        let message = r["error"]["message"].as_str().unwrap_or_default();
        if message.contains("pacing new requests") {
            paced += 1;
        } else {
            walled.push(r.to_string());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        paced > 0,
        "the load was never paced: granted per second {granted:?}"
    );
    assert!(
        walled.is_empty(),
        "the table's own bound was reached {} times (first: {})",
        walled.len(),
        walled[0]
    );
    // Grants in every second but the last (cut short by the loop's end).
    assert!(
        granted[..seconds - 1].iter().all(|&g| g > 0),
        "a second without a grant: {granted:?}"
    );
    // The leader counts every paced refusal where operators look for them.
    let counted = requests_counted(&addr, Some("acquire"), "BUSY").await;
    assert!(
        counted >= f64::from(paced),
        "{paced} acquires were paced, raftlock_requests_total{{op=\"acquire\",result=\"BUSY\"}} \
         counted {counted}"
    );
}

/// A client that acknowledges its answers (`ackBelow`, request ids numbered from 1) runs on
/// through a table that a plain client fills within seconds, through a follower too; its
/// answers do not pile up; and a late copy of a request it acknowledged is refused with
/// `ACKNOWLEDGED`, its lock not taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_acknowledges_its_answers_is_not_held_to_the_tables_rate() {
    let cluster = cluster_with_a_small_table();
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.nodes[leader as usize - 1].client_addr();
    // Acknowledgements need every member at cluster version 3.
    wait_for_cluster_version(&addr, 3).await;

    // A plain client: within the retention the table's 40 answers run out.
    let mut ws = ws_connect(&addr).await;
    let mut refused = 0;
    for n in 1..=60 {
        let r = ws_request(
            &mut ws,
            &acquire(&format!("p{n}"), "plain", &format!("a{n}")),
        )
        .await;
        if r["success"] != true {
            assert_eq!(error_code(&r), "BUSY", "{r}");
            refused += 1;
        }
    }
    assert!(
        refused > 0,
        "60 plain acquires within the retention all fitted"
    );

    // An acknowledging client, through a follower: 150 lock cycles, none refused.
    let (_, follower) = follower_knowing(&cluster, leader).await;
    let mut fws = ws_connect(&follower).await;
    let mut seq = 0u64;
    let mut first_acquire = None;
    for cycle in 0..150 {
        seq += 1;
        let key = format!("s{}", cycle % 5);
        let mut take = acquire(&key, "acker", &seq.to_string());
        take["ackBelow"] = json!(seq);
        let r = ws_request(&mut fws, &take).await;
        assert_eq!(r["success"], true, "cycle {cycle}: {r}");
        let token = r["fencingToken"]["value"].as_u64().expect("token");
        first_acquire.get_or_insert_with(|| take.clone());
        seq += 1;
        let release = json!({"commandType": 4, "key": key, "clientId": "acker",
                             "requestId": seq.to_string(), "ackBelow": seq,
                             "fencingToken": {"key": key, "value": token}});
        let r = ws_request(&mut fws, &release).await;
        assert_eq!(r["success"], true, "cycle {cycle}: {r}");
    }
    // Its answers went as it acknowledged them: the table holds the plain client's and about
    // one of its own.
    let text = http_get(&addr, "/metrics").await.expect("/metrics").1;
    let kept = metric_sum(&text, "raftlock_answers_remembered ", &[]);
    assert!(
        kept <= f64::from(60 - refused) + 2.0,
        "the table keeps {kept} answers after 300 acknowledged ones"
    );

    // A late copy of its first acquire: the lock is free, yet it is not taken again.
    let copy = ws_request(&mut ws, &first_acquire.expect("one acquire")).await;
    assert_eq!(copy["success"], false, "{copy}");
    assert_eq!(error_code(&copy), "ACKNOWLEDGED", "{copy}");
    let locks = http_json(&addr, "/locks").await.expect("/locks");
    assert!(!locks.to_string().contains("\"s0\""), "{locks}");

    // The same over gRPC, as another client: numbered acquires and releases that acknowledge,
    // then a late copy of its first acquire.
    let mut grpc = LockServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("grpc");
    let acquire_g = |n: u64, ack: u64| AcquireLockRequest {
        resource_name: "g0".into(),
        owner_id: "grpc-acker".into(),
        client_timeout_ms: 0,
        request_id: n.to_string(),
        ttl_ms: 10_000,
        ack_below: Some(ack),
        attach_to_session: false,
    };
    for n in (1..=60u64).step_by(2) {
        let got = grpc
            .acquire_lock(acquire_g(n, n))
            .await
            .unwrap()
            .into_inner();
        assert!(got.acquired, "{got:?}");
        let token = got.fencing_token.expect("token").value;
        let released = grpc
            .release_lock(ReleaseLockRequest {
                resource_name: "g0".into(),
                owner_id: "grpc-acker".into(),
                fencing_token: token,
                request_id: (n + 1).to_string(),
                ack_below: Some(n + 1),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(released.released, "{released:?}");
    }
    let copy = grpc
        .acquire_lock(acquire_g(1, 1))
        .await
        .unwrap()
        .into_inner();
    assert!(!copy.acquired, "{copy:?}");
    assert_eq!(copy.error_code, "ACKNOWLEDGED", "{copy:?}");
    let bad = AcquireLockRequest {
        request_id: "g-1".into(),
        ..acquire_g(0, 1)
    };
    let refused = grpc.acquire_lock(bad).await.unwrap().into_inner();
    assert_eq!(refused.error_code, "INVALID_REQUEST", "{refused:?}");

    // ackBelow needs a numbered request id, and cannot acknowledge the request itself.
    let mut bad = acquire("s9", "acker", "r-1");
    bad["ackBelow"] = json!(1);
    let r = ws_request(&mut ws, &bad).await;
    assert_eq!(error_code(&r), "INVALID_REQUEST", "{r}");
    let mut ahead = acquire("s9", "acker", "400");
    ahead["ackBelow"] = json!(401);
    let r = ws_request(&mut ws, &ahead).await;
    assert_eq!(error_code(&r), "INVALID_REQUEST", "{r}");
}

/// The leader's `raftlock_answers_remembered` once it reads `want` (bounded wait), or what it
/// read last.
async fn answers_remembered(addr: &str, want: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = http_get(addr, "/metrics").await.expect("/metrics").1;
        let kept = metric_sum(&text, "raftlock_answers_remembered ", &[]);
        if kept == want || Instant::now() > deadline {
            return kept;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Requests sent without a request id that are answered at once (releases, acquires that do not
/// wait, over WebSocket and gRPC) leave no answer in the exactly-once table, so a client that
/// sends them is not held to the table's rate: here five times the table's 40 answers within
/// its retention, none refused. An acquire without an id that may wait still gets one from the
/// node, and its answer is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_ids_keep_no_answers_and_are_not_paced() {
    let cluster = cluster_with_a_small_table();
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.nodes[leader as usize - 1].client_addr();
    let before = answers_remembered(&addr, 0.0).await;

    let mut ws = ws_connect(&addr).await;
    for n in 0..60 {
        let key = format!("n{}", n % 5);
        let take = json!({"commandType": 3, "key": key, "clientId": "no-ids", "ttl": 60000,
                          "waitTimeout": 0});
        let r = ws_request(&mut ws, &take).await;
        assert_eq!(r["success"], true, "acquire {n}: {r}");
        assert_eq!(r["requestId"], Value::Null, "{r}");
        let token = r["fencingToken"]["value"].as_u64().expect("token");
        let release = json!({"commandType": 4, "key": key, "clientId": "no-ids",
                             "fencingToken": {"key": key, "value": token}});
        let r = ws_request(&mut ws, &release).await;
        assert_eq!(r["success"], true, "release {n}: {r}");
    }

    let mut grpc = LockServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("grpc");
    for n in 0..40 {
        let got = grpc
            .acquire_lock(AcquireLockRequest {
                resource_name: "g-no-ids".into(),
                owner_id: "grpc-no-ids".into(),
                client_timeout_ms: 0,
                request_id: String::new(),
                ttl_ms: 10_000,
                ack_below: None,
                attach_to_session: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(got.acquired, "acquire {n}: {got:?}");
        let released = grpc
            .release_lock(ReleaseLockRequest {
                resource_name: "g-no-ids".into(),
                owner_id: "grpc-no-ids".into(),
                fencing_token: got.fencing_token.expect("token").value,
                request_id: String::new(),
                ack_below: None,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(released.released, "release {n}: {released:?}");
    }
    assert_eq!(
        answers_remembered(&addr, before).await,
        before,
        "200 requests without ids left answers in the table"
    );

    // An acquire without an id that may wait is tracked by an id the node gives it.
    let wait = json!({"commandType": 3, "key": "w", "clientId": "no-ids", "ttl": 60000});
    let r = ws_request(&mut ws, &wait).await;
    assert_eq!(r["success"], true, "{r}");
    assert_eq!(answers_remembered(&addr, before + 1.0).await, before + 1.0);
}
