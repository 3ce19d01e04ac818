//! Lease semantics of three real `lock-node` processes on 127.0.0.1, through the WebSocket JSON
//! API only: a lock handed to a waiter expires by the waiter's TTL, a grant made by a leader that
//! is SIGKILLed right after expires under the next leader, a TTL raised by a renewal survives a
//! failover, an acknowledged renewal is never followed by the expiry it raced, and an acquire by
//! the current holder under a new request id is refused with `ALREADY_HELD`.
//!
//! Every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);

fn acquire(key: &str, client: &str, request: &str, ttl: u64, wait: Option<u64>) -> Value {
    let mut v = json!({"commandType": 3, "key": key, "clientId": client, "requestId": request,
                       "ttl": ttl});
    if let Some(w) = wait {
        v["waitTimeout"] = json!(w);
    }
    v
}

fn release(key: &str, client: &str, request: &str, token: u64) -> Value {
    json!({"commandType": 4, "key": key, "clientId": client, "requestId": request,
           "fencingToken": {"key": key, "value": token}})
}

fn renew(key: &str, client: &str, request: &str, token: u64, ttl: u64) -> Value {
    json!({"commandType": 5, "key": key, "clientId": client, "requestId": request,
           "fencingToken": {"key": key, "value": token}, "ttl": ttl})
}

fn token_of(reply: &Value) -> u64 {
    reply["fencingToken"]["value"]
        .as_u64()
        .unwrap_or_else(|| panic!("no token in {reply}"))
}

fn addr_of(cluster: &Cluster, id: u64) -> String {
    cluster
        .nodes
        .iter()
        .find(|n| n.id == id)
        .expect("node exists")
        .client_addr()
}

/// The reply to `request_id` on `ws` within `timeout` (replies to other requests are skipped).
async fn reply_to(ws: &mut Ws, request_id: &str, timeout: Duration) -> Option<Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        let reply = ws_recv(ws, left).await?;
        if reply["requestId"] == request_id {
            return Some(reply);
        }
    }
}

/// Sends `msg` and returns its reply (within 10 s). A leader change on a busy machine answers
/// `UNAVAILABLE` or `NO_LEADER`; like a client, this retries with the same request id (at most
/// 50 times, 100 ms apart; the node forwards to the new leader).
async fn request(ws: &mut Ws, msg: &Value) -> Value {
    let id = msg["requestId"].as_str().expect("request id");
    for _ in 0..50 {
        ws_send(ws, msg).await;
        let reply = reply_to(ws, id, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("no reply within 10s to {msg}"));
        if !matches!(error_code(&reply), "UNAVAILABLE" | "NO_LEADER") {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no final answer to {msg} after 50 tries")
}

/// A WebSocket connection to `addr`, or None if none opens within 2 s (a dead node).
async fn try_connect(addr: &str) -> Option<Ws> {
    let url = format!("ws://{addr}/ws");
    match tokio::time::timeout(
        Duration::from_secs(2),
        tokio_tungstenite::connect_async(url.as_str()),
    )
    .await
    {
        Ok(Ok((ws, _))) => Some(ws),
        _ => None,
    }
}

/// Sends `msg` to `addr` as a client would: follows `NOT_LEADER` redirects (`error.leaderAddr`)
/// and retries `NO_LEADER`, `UNAVAILABLE`, `BUSY` and dead nodes with the same request id,
/// cycling through `fallback`, until a final answer. Each reply is awaited at most
/// `reply_timeout`; the whole exchange must finish within `overall`.
async fn request_following_redirects(
    addr: &str,
    fallback: &[String],
    msg: &Value,
    reply_timeout: Duration,
    overall: Duration,
) -> Value {
    let deadline = Instant::now() + overall;
    let id = msg["requestId"].as_str().expect("request id").to_string();
    let mut target = addr.to_string();
    let mut next_fallback = 0;
    let mut history = Vec::new();
    loop {
        assert!(
            Instant::now() < deadline,
            "no final answer to {msg} within {overall:?}: {history:?}"
        );
        let Some(mut ws) = try_connect(&target).await else {
            history.push(format!("{target}: cannot connect"));
            target = fallback[next_fallback % fallback.len()].clone();
            next_fallback += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        ws_send(&mut ws, msg).await;
        let reply = reply_to(&mut ws, &id, reply_timeout)
            .await
            .unwrap_or_else(|| panic!("{target} did not answer {msg} within {reply_timeout:?}"));
        let code = error_code(&reply).to_string();
        history.push(format!("{target}: {code}"));
        match code.as_str() {
            "NOT_LEADER" => {
                match reply["error"]["leaderAddr"].as_str() {
                    Some(leader) if !leader.is_empty() && leader != target => {
                        target = leader.to_string()
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
                continue;
            }
            "NO_LEADER" | "UNAVAILABLE" | "BUSY" => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            _ => return reply,
        }
    }
}

/// Waits for a leader other than `old` (which was killed).
async fn new_leader(cluster: &Cluster, old: u64) -> u64 {
    let deadline = Instant::now() + LEADER_TIMEOUT;
    loop {
        let id = cluster.wait_for_leader(LEADER_TIMEOUT).await;
        if id != old {
            return id;
        }
        assert!(Instant::now() < deadline, "no new leader after {old}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn lock_entry(addr: &str, key: &str) -> Value {
    let locks = http_json(addr, "/locks").await.expect("/locks");
    locks["locks"]
        .as_array()
        .and_then(|a| a.iter().find(|l| l["key"] == key).cloned())
        .unwrap_or(Value::Null)
}

/// A lock handed to a queued waiter by a release carries the waiter's lease: once the waiter
/// goes silent, its TTL runs out and the next client is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_off_lock_expires_by_its_ttl() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);

    let mut a = ws_connect(&addr).await;
    let ga = request(&mut a, &acquire("k", "A", "a1", 2_000, None)).await;
    assert_eq!(ga["success"], true, "{ga}");
    let ta = token_of(&ga);

    // B queues behind A.
    let mut b = ws_connect(&addr).await;
    ws_send(&mut b, &acquire("k", "B", "b1", 2_000, Some(20_000))).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let entry = lock_entry(&addr, "k").await;
        if entry["waiters"] == json!(["B"]) {
            break;
        }
        assert!(Instant::now() < deadline, "B never queued: {entry}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A releases well within its own TTL: the lock is handed to B by the release.
    let r = request(&mut a, &release("k", "A", "a2", ta)).await;
    assert_eq!(r["success"], true, "{r}");
    let gb = reply_to(&mut b, "b1", Duration::from_secs(5))
        .await
        .expect("B granted on its own connection after A's release");
    assert_eq!(gb["success"], true, "{gb}");
    let tb = token_of(&gb);
    assert!(tb > ta, "B's token {tb} must exceed A's {ta}");
    let granted_b = Instant::now();
    assert_eq!(
        lock_entry(&addr, "k").await["holder"],
        "B",
        "B holds k after the hand-off"
    );

    // B stays connected and silent. C must get the lock once B's 2 s lease has run out.
    let mut c = ws_connect(&addr).await;
    ws_send(&mut c, &acquire("k", "C", "c1", 2_000, Some(10_000))).await;
    let gc = reply_to(&mut c, "c1", Duration::from_secs(15))
        .await
        .expect("C answered within its wait timeout");
    let waited = granted_b.elapsed();
    assert_eq!(
        gc["success"],
        true,
        "C was not granted {waited:?} after B's grant, although B's TTL is 2 s and B never \
         renewed: {gc}; the lock now: {}",
        lock_entry(&addr, "k").await
    );
    assert!(
        waited < Duration::from_millis(2_000 + 3_000),
        "C was granted only {waited:?} after B's grant (B's TTL is 2 s)"
    );
    let tc = token_of(&gc);
    assert!(tc > tb, "C's token {tc} must exceed B's {tb}");
    drop(b);
}

/// A grant acknowledged by a leader that is SIGKILLed right after still expires by its TTL
/// under the next leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grant_from_old_leader_expires_under_new_leader() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);

    let mut a = ws_connect(&addr).await;
    let ga = request(&mut a, &acquire("k", "A", "a1", 1_500, None)).await;
    assert_eq!(ga["success"], true, "{ga}");
    let ta = token_of(&ga);
    cluster.node(leader).kill();
    let killed_at = Instant::now();

    let elected = new_leader(&cluster, leader).await;
    let survivors: Vec<String> = cluster
        .nodes
        .iter()
        .filter(|n| n.id != leader)
        .map(|n| n.client_addr())
        .collect();
    // Start at a surviving follower if there is one, so the redirect is exercised.
    let start = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader && n.id != elected)
        .map_or_else(|| addr_of(&cluster, elected), |n| n.client_addr());
    let gc = request_following_redirects(
        &start,
        &survivors,
        &acquire("k", "C", "c1", 5_000, Some(15_000)),
        Duration::from_secs(20),
        Duration::from_secs(40),
    )
    .await;
    let waited = killed_at.elapsed();
    assert_eq!(
        gc["success"], true,
        "C was not granted {waited:?} after the leader that granted A (TTL 1.5 s) was killed: {gc}"
    );
    let tc = token_of(&gc);
    assert!(tc > ta, "C's token {tc} must exceed A's {ta}");
    eprintln!("C granted {waited:?} after the SIGKILL");
}

/// A holder that raised its TTL with a renewal keeps the lock through a failover: the new
/// leader restarts the lease with the raised TTL, not the one of the acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raised_ttl_survives_failover() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);

    let mut a = ws_connect(&addr).await;
    let ga = request(&mut a, &acquire("k", "A", "a1", 2_000, None)).await;
    assert_eq!(ga["success"], true, "{ga}");
    let ta = token_of(&ga);
    let rn = request(&mut a, &renew("k", "A", "a2", ta, 30_000)).await;
    assert_eq!(rn["success"], true, "{rn}");
    assert_eq!(rn["expiresInMs"], 30_000, "{rn}");
    cluster.node(leader).kill();

    let elected = new_leader(&cluster, leader).await;
    // Well past the acquire's 2 s TTL, well within the renewed 30 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let survivors: Vec<String> = cluster
        .nodes
        .iter()
        .filter(|n| n.id != leader)
        .map(|n| n.client_addr())
        .collect();
    let tried = request_following_redirects(
        &addr_of(&cluster, elected),
        &survivors,
        &acquire("k", "B", "b1", 2_000, Some(0)),
        Duration::from_secs(10),
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        tried["success"], false,
        "B was granted k 5 s after the failover although A renewed it for 30 s: {tried}"
    );
    assert!(
        ["WAIT_TIMEOUT", "BUSY"].contains(&error_code(&tried)),
        "B's try-acquire must be refused as busy: {tried}"
    );
    let leader_now = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let entry = lock_entry(&addr_of(&cluster, leader_now), "k").await;
    assert_eq!(entry["holder"], "A", "{entry}");
    assert_eq!(entry["fencingToken"], ta, "{entry}");
}

/// Answers that decide nothing and ask for a retry with the same request id.
const RETRY_CODES: [&str; 3] = ["UNAVAILABLE", "NO_LEADER", "NOT_LEADER"];

#[derive(Debug, Default)]
struct RaceCounts {
    acknowledged: usize,
    refused: usize,
}

/// One race: A acquires `key` with a 400 ms TTL, renews after `delay`, and if the renewal was
/// acknowledged, B's try-acquires must fail for the next 2 s. Err describes a violation.
///
/// Request ids are unique per key: the server's exactly-once table is keyed by
/// `(clientId, requestId)` alone, so reusing one on another key would replay the old answer.
async fn renew_race(addr: String, key: String, delay: Duration) -> Result<bool, String> {
    let mut a = ws_connect(&addr).await;
    let mut b = ws_connect(&addr).await;
    let grant = acquire(&key, "A", &format!("{key}/a1"), 400, None);
    let mut ga = request(&mut a, &grant).await;
    for _ in 0..50 {
        if !RETRY_CODES.contains(&error_code(&ga)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        ga = request(&mut a, &grant).await;
    }
    assert_eq!(ga["success"], true, "{ga}");
    assert_eq!(ga["fencingToken"]["key"], key.as_str(), "{ga}");
    let ta = token_of(&ga);
    tokio::time::sleep(delay).await;
    let renewal = renew(&key, "A", &format!("{key}/a2"), ta, 3_000);
    let mut rn = request(&mut a, &renewal).await;
    // A leadership change (a loaded machine) answers "retry with the same request id": do so.
    for _ in 0..20 {
        if !RETRY_CODES.contains(&error_code(&rn)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        rn = request(&mut a, &renewal).await;
    }
    if rn["success"] != true {
        let code = error_code(&rn);
        assert!(
            ["STALE_TOKEN", "NOT_HOLDER"].contains(&code),
            "unexpected answer to the renewal of {key}: {rn}"
        );
        return Ok(false);
    }
    assert_eq!(rn["expiresInMs"], 3_000, "{rn}");
    assert_eq!(rn["fencingToken"]["value"], ta, "{rn}");
    let acked = Instant::now();
    let mut n = 0;
    while acked.elapsed() < Duration::from_secs(2) {
        n += 1;
        let id = format!("{key}/b{n}");
        let tried = request(&mut b, &acquire(&key, "B", &id, 400, Some(0))).await;
        if tried["success"] == true {
            return Err(format!(
                "{key}: renewal (ttl 3000) sent {delay:?} after the grant was acknowledged \
                 ({rn}), yet B was granted {:?} later: {tried}",
                acked.elapsed()
            ));
        }
        // Refused as busy, or not decided now (a leadership change): either way not granted.
        assert!(
            ["WAIT_TIMEOUT", "BUSY"].contains(&error_code(&tried))
                || RETRY_CODES.contains(&error_code(&tried)),
            "unexpected answer to B's try-acquire of {key}: {tried}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(true)
}

/// A renewal sent just as the 400 ms lease runs out either is refused (the expiry won) or, if
/// acknowledged, holds: the expiry it raced must not take the lock away afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_racing_expiry_is_never_acknowledged_then_expired() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);
    let mut counts = RaceCounts::default();
    let mut violations = Vec::new();
    const ROUNDS: u64 = 15;
    const PER_ROUND: u64 = 3;
    for round in 0..ROUNDS {
        // Three keys at once per round, renewing 392..=412 ms after their grants.
        let tasks: Vec<_> = (0..PER_ROUND)
            .map(|j| {
                let n = round * PER_ROUND + j;
                let delay = Duration::from_millis(392 + (n * 20) / (ROUNDS * PER_ROUND - 1));
                let key = format!("race-{round}-{j}");
                tokio::spawn(renew_race(addr.clone(), key, delay))
            })
            .collect();
        for t in tasks {
            match t.await.expect("race task") {
                Ok(true) => counts.acknowledged += 1,
                Ok(false) => counts.refused += 1,
                Err(v) => violations.push(v),
            }
        }
    }
    eprintln!(
        "renewals acknowledged: {}, refused: {}, acknowledged then expired: {}",
        counts.acknowledged,
        counts.refused,
        violations.len()
    );
    assert!(
        violations.is_empty(),
        "{} acknowledged renewal(s) lost the lock to the expiry they raced:\n{}",
        violations.len(),
        violations.join("\n")
    );
}

/// The holder acquiring its own lock again under a new request id is told `ALREADY_HELD` with
/// its current token, not granted a second time; a retry of the original request still gets the
/// original grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_by_current_holder_with_new_request_id_is_already_held() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);
    let mut a = ws_connect(&addr).await;
    let g1 = request(&mut a, &acquire("k", "A", "r1", 10_000, None)).await;
    assert_eq!(g1["success"], true, "{g1}");
    let token = token_of(&g1);

    let again = request(&mut a, &acquire("k", "A", "r2", 10_000, None)).await;
    assert_eq!(again["requestId"], "r2", "{again}");
    assert_eq!(
        again["success"], false,
        "a second acquire by the holder must not look like a new grant: {again}"
    );
    assert_eq!(error_code(&again), "ALREADY_HELD", "{again}");
    assert_eq!(again["error"]["currentToken"], token, "{again}");

    let retry = request(&mut a, &acquire("k", "A", "r1", 10_000, None)).await;
    assert_eq!(retry["success"], true, "{retry}");
    assert_eq!(token_of(&retry), token, "{retry}");
    let entry = lock_entry(&addr, "k").await;
    assert_eq!(entry["holder"], "A", "{entry}");
    assert_eq!(entry["fencingToken"], token, "{entry}");
}

/// A retried acquire answered from the exactly-once table gets the time left on the lease, not
/// the full TTL again; once the hold has ended, the retry is told so (`STALE_TOKEN`) instead of
/// receiving the old grant. (Found by `tests/chaos.rs`: a client that retried after a paused node
/// came back believed it held a lock that had expired and been granted to another client.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_grant_reports_the_time_left_and_never_an_ended_hold() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);
    let all = endpoints(&cluster);
    // A leader change in the middle (these machines are shared and busy) answers `UNAVAILABLE`;
    // a client retries with the same request id, which is what this test is about anyway.
    let ask = |msg: Value| {
        let (addr, all) = (addr.clone(), all.clone());
        async move {
            request_following_redirects(
                &addr,
                &all,
                &msg,
                Duration::from_secs(5),
                Duration::from_secs(20),
            )
            .await
        }
    };
    let g1 = ask(acquire("k", "A", "r1", 1_500, None)).await;
    assert_eq!(g1["success"], true, "{g1}");
    let token = token_of(&g1);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let retry = ask(acquire("k", "A", "r1", 1_500, None)).await;
    if retry["success"] == true {
        assert_eq!(token_of(&retry), token, "{retry}");
        let left = retry["expiresInMs"].as_u64().expect("expiresInMs");
        assert!(
            left <= 800,
            "a retry 700 ms later still got {left} ms: {retry}"
        );
    } else {
        // Only possible when retries across a leader change took the lease past its end.
        assert_eq!(error_code(&retry), "STALE_TOKEN", "{retry}");
    }
    // The lease runs out and B takes the lock; A's retry must not look like a grant.
    let gb = ask(acquire("k", "B", "b1", 10_000, Some(10_000))).await;
    assert_eq!(gb["success"], true, "{gb}");
    let late = ask(acquire("k", "A", "r1", 1_500, None)).await;
    assert_eq!(late["success"], false, "{late}");
    assert_eq!(error_code(&late), "STALE_TOKEN", "{late}");
}

fn set_lock_delay(key: &str, client: &str, request: &str, delay_ms: u64) -> Value {
    json!({"commandType": 9, "key": key, "clientId": client, "requestId": request,
           "lockDelay": delay_ms})
}

/// Lock-delay: after a holder's lease *expires*, the key is granted to no one for the key's
/// delay (a queued waiter included, an acquire that will not wait is told the lock is busy);
/// after a *release* the next waiter is granted at once. Set over WebSocket, read back over
/// gRPC's answer, and the delay still runs in full when the leader that timed it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lock_stays_unavailable_for_its_lock_delay() {
    use raftlock::server::proto::lock::lock_service_client::LockServiceClient;
    use raftlock::server::proto::lock::SetLockDelayRequest;

    const TTL_MS: u64 = 600;
    const DELAY_MS: u64 = 2_500;
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);
    wait_for_cluster_version(&addr, 6).await;
    let mut ws = ws_connect(&addr).await;

    // Bad input changes nothing: a delay above the longest TTL, and no delay at all.
    let too_long = request(&mut ws, &set_lock_delay("d", "ops", "x1", 10 * 3_600_000)).await;
    assert_eq!(error_code(&too_long), "INVALID_REQUEST", "{too_long}");
    let missing = request(
        &mut ws,
        &json!({"commandType": 9, "key": "d", "clientId": "ops", "requestId": "x2"}),
    )
    .await;
    assert_eq!(error_code(&missing), "INVALID_REQUEST", "{missing}");

    let set = request(&mut ws, &set_lock_delay("d", "ops", "s1", DELAY_MS)).await;
    assert_eq!(set["success"], true, "{set}");
    assert_eq!(set["lockDelay"], DELAY_MS, "{set}");

    // A release hands the key on at once: the delay is for expiries only.
    let a = request(&mut ws, &acquire("d", "A", "a1", 30_000, None)).await;
    let ta = token_of(&a);
    let mut b = ws_connect(&addr).await;
    ws_send(&mut b, &acquire("d", "B", "b1", 30_000, Some(20_000))).await;
    let queued = reply_to(&mut b, "b1", Duration::from_secs(10)).await;
    assert!(queued.is_none(), "B should wait, got {queued:?}");
    let released = request(&mut ws, &release("d", "A", "a2", ta)).await;
    assert_eq!(released["released"], true, "{released}");
    let gb = reply_to(&mut b, "b1", Duration::from_secs(10))
        .await
        .expect("B is granted when A releases");
    let tb = token_of(&gb);
    let released = request(&mut b, &release("d", "B", "b2", tb)).await;
    assert_eq!(released["released"], true, "{released}");

    // An expiry starts the delay: C's lease runs out, D waits through the delay.
    let gc = request(&mut ws, &acquire("d", "C", "c1", TTL_MS, None)).await;
    let tc = token_of(&gc);
    let granted_c = Instant::now();
    let mut d = ws_connect(&addr).await;
    ws_send(&mut d, &acquire("d", "D", "d1", 30_000, Some(30_000))).await;
    // Once C has expired (its entry gone from /locks or held by no one), an acquire that will
    // not wait is refused while the delay runs.
    let expired_by = Instant::now() + Duration::from_secs(10);
    loop {
        let entry = lock_entry(&addr, "d").await;
        if entry.is_null() || entry["holder"].is_null() {
            break;
        }
        assert!(Instant::now() < expired_by, "C never expired: {entry}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The listing and the metrics show the delay while it runs (D waits on the key).
    if granted_c.elapsed() < Duration::from_millis(TTL_MS + DELAY_MS - 500) {
        let entry = lock_entry(&addr, "d").await;
        assert_eq!(entry["lockDelayMs"], DELAY_MS, "{entry}");
        assert!(entry["holder"].is_null(), "{entry}");
        assert_eq!(
            scraped_metric(&addr, "raftlock_lock_delays_running", &[]).await,
            1.0
        );
    }
    let busy = request(&mut ws, &acquire("d", "E", "e1", 30_000, Some(0))).await;
    if granted_c.elapsed() < Duration::from_millis(TTL_MS + DELAY_MS - 500) {
        assert_eq!(error_code(&busy), "WAIT_TIMEOUT", "{busy}");
    }
    // The leader that timed the delay dies; the next one times it again in full.
    cluster.node(leader).kill();
    let elected = new_leader(&cluster, leader).await;
    let gd = reply_to(&mut d, "d1", Duration::from_secs(40)).await;
    let gd = match gd {
        // D's connection was to the killed leader: ask again on the new one (same request id).
        Some(reply) if reply["success"] == true => reply,
        _ => {
            let survivors: Vec<String> = cluster
                .nodes
                .iter()
                .filter(|n| n.id != leader)
                .map(|n| n.client_addr())
                .collect();
            request_following_redirects(
                &addr_of(&cluster, elected),
                &survivors,
                &acquire("d", "D", "d1", 30_000, Some(30_000)),
                Duration::from_secs(35),
                Duration::from_secs(60),
            )
            .await
        }
    };
    assert_eq!(gd["success"], true, "{gd}");
    let waited = granted_c.elapsed();
    assert!(token_of(&gd) > tc);
    // The delay is timed by nodes whose clocks may run fast by a little: allow 5%.
    let least = Duration::from_millis(TTL_MS + DELAY_MS * 95 / 100);
    assert!(
        waited >= least,
        "D was granted {waited:?} after C's grant: C's TTL ({TTL_MS} ms) and the lock-delay \
         ({DELAY_MS} ms) had not both passed"
    );
    eprintln!("D granted {waited:?} after C's grant (TTL {TTL_MS} ms + delay {DELAY_MS} ms)");

    // gRPC: the setting is removed with 0; an empty key is refused.
    let new_addr = addr_of(&cluster, elected);
    let mut grpc = LockServiceClient::connect(format!("http://{new_addr}"))
        .await
        .expect("gRPC connect");
    let removed = grpc
        .set_lock_delay(SetLockDelayRequest {
            resource_name: "d".into(),
            owner_id: "ops".into(),
            delay_ms: 0,
            request_id: "g1".into(),
        })
        .await
        .expect("gRPC answer")
        .into_inner();
    assert!(removed.error_code.is_empty(), "{removed:?}");
    assert_eq!(removed.delay_ms, 0);
    let refused = grpc
        .set_lock_delay(SetLockDelayRequest {
            resource_name: String::new(),
            owner_id: "ops".into(),
            delay_ms: 100,
            request_id: "g2".into(),
        })
        .await
        .expect("gRPC answer")
        .into_inner();
    assert_eq!(refused.error_code, "INVALID_REQUEST", "{refused:?}");
}

/// Leader election over gRPC on real processes: a leader that stops renewing is replaced by
/// the next candidate only once its lease ran out, also when the Raft leader that timed the
/// lease is SIGKILLed meanwhile; the new leader shows its own campaign value; the old term can
/// no longer proclaim; bad input is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_outlives_its_leaders_lease_and_a_killed_node() {
    use raftlock::server::proto::lock::lock_service_client::LockServiceClient;
    use raftlock::server::proto::lock::{CampaignRequest, LeaderRequest, ProclaimRequest};

    const TTL_MS: u64 = 1_500;
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);
    wait_for_cluster_version(&addr, 7).await;
    // The clients talk to a follower, which forwards: it survives the leader's death.
    let follower = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .expect("a follower")
        .client_addr();
    let connect = || async {
        LockServiceClient::connect(format!("http://{follower}"))
            .await
            .expect("gRPC connect")
    };
    let campaign = |who: &str, request_id: &str, value: &str, wait: Option<u64>| CampaignRequest {
        election: "grpc/shard".into(),
        candidate_id: who.into(),
        value: value.as_bytes().to_vec(),
        ttl_ms: TTL_MS,
        wait_timeout_ms: wait,
        request_id: request_id.into(),
        attach_to_session: false,
    };
    let mut a = connect().await;
    // Bad input: no election, a value past the limit.
    let empty = a
        .campaign(CampaignRequest {
            election: String::new(),
            ..campaign("A", "a0", "x", Some(0))
        })
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(empty.error_code, "INVALID_REQUEST", "{empty:?}");
    let huge = "v".repeat(70 * 1024);
    let too_big = a
        .campaign(campaign("A", "a0", &huge, Some(0)))
        .await
        .expect("answer")
        .into_inner();
    assert!(
        !too_big.elected && !too_big.error_code.is_empty(),
        "{too_big:?}"
    );

    let won = a
        .campaign(campaign("A", "a1", "10.0.0.1:80", Some(0)))
        .await
        .expect("answer")
        .into_inner();
    assert!(won.elected, "{won:?}");
    let elected_at = Instant::now();
    let term_a = won.fencing_token.as_ref().expect("term");
    assert_eq!(term_a.mode, "leader");
    let term_a = term_a.value;
    let read = a
        .leader(LeaderRequest {
            election: "grpc/shard".into(),
        })
        .await
        .expect("answer")
        .into_inner();
    assert!(read.has_leader, "{read:?}");
    assert_eq!(
        (read.candidate_id.as_str(), read.value.as_slice()),
        ("A", b"10.0.0.1:80".as_slice())
    );
    // B waits in line; A stops renewing; the Raft leader dies.
    let b_task = tokio::spawn(async move {
        let mut b = LockServiceClient::connect(format!("http://{follower}"))
            .await
            .expect("gRPC connect");
        // The same request again after an error (a forwarded wait cut by the leader's death):
        // answered exactly once.
        for _ in 0..20 {
            let answer = b
                .campaign(CampaignRequest {
                    election: "grpc/shard".into(),
                    candidate_id: "B".into(),
                    value: b"10.0.0.2:80".to_vec(),
                    ttl_ms: 30_000,
                    wait_timeout_ms: Some(30_000),
                    request_id: "b1".into(),
                    attach_to_session: false,
                })
                .await;
            match answer {
                Ok(r) if r.get_ref().elected => return r.into_inner(),
                Ok(r) if r.get_ref().error_code == "WAIT_TIMEOUT" => return r.into_inner(),
                _ => tokio::time::sleep(Duration::from_millis(300)).await,
            }
        }
        panic!("B's campaign was never answered");
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.node(leader).kill();
    let b_won = b_task.await.expect("joined");
    assert!(b_won.elected, "{b_won:?}");
    let survivor = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .expect("a survivor")
        .client_addr();
    assert_eq!(
        scraped_metric(&survivor, "raftlock_client_elections", &[]).await,
        1.0
    );
    let waited = elected_at.elapsed();
    let term_b = b_won.fencing_token.as_ref().expect("term").value;
    assert!(term_b > term_a);
    // Leases are timed by nodes whose clocks may run fast by a little: allow 5%.
    assert!(
        waited >= Duration::from_millis(TTL_MS * 95 / 100),
        "B was elected {waited:?} after A, within A's lease of {TTL_MS} ms"
    );
    let read = a
        .leader(LeaderRequest {
            election: "grpc/shard".into(),
        })
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(
        (read.candidate_id.as_str(), read.value.as_slice()),
        ("B", b"10.0.0.2:80".as_slice()),
        "{read:?}"
    );
    // A's term is over: its proclaim is refused; B's goes through.
    let late = a
        .proclaim(ProclaimRequest {
            election: "grpc/shard".into(),
            candidate_id: "A".into(),
            term: term_a,
            value: b"late".to_vec(),
            request_id: "a2".into(),
        })
        .await
        .expect("answer")
        .into_inner();
    assert!(!late.proclaimed, "{late:?}");
    assert!(
        matches!(late.error_code.as_str(), "STALE_TOKEN" | "NOT_HOLDER"),
        "{late:?}"
    );
    let moved = a
        .proclaim(ProclaimRequest {
            election: "grpc/shard".into(),
            candidate_id: "B".into(),
            term: term_b,
            value: b"10.0.0.2:81".to_vec(),
            request_id: "b2".into(),
        })
        .await
        .expect("answer")
        .into_inner();
    assert!(moved.proclaimed, "{moved:?}");
    let read = a
        .leader(LeaderRequest {
            election: "grpc/shard".into(),
        })
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(read.value, b"10.0.0.2:81".to_vec(), "{read:?}");
    eprintln!("B elected {waited:?} after A (A's lease {TTL_MS} ms, Raft leader killed)");
}

fn keep_alive(client: &str, session: u64, ttl: u64, request: &str) -> Value {
    json!({"commandType": 13, "clientId": client, "session": session, "ttl": ttl,
           "requestId": request})
}

fn end_session(client: &str, session: u64, request: &str) -> Value {
    json!({"commandType": 14, "clientId": client, "session": session, "requestId": request})
}

/// Sessions that cover many locks, on three real nodes: locks acquired with a TTL of 0 live
/// as long as their client's session; ending it releases them all at once (a waiter is granted
/// in the same entry), and a session whose keepalives stop expires with every lock on it, even
/// across a SIGKILL of the Raft leader. Bad input is refused and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_holds_many_locks_and_ends_them_together() {
    const SESSION_TTL_MS: u64 = 1_500;
    let mut cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = addr_of(&cluster, leader);
    wait_for_cluster_version(&addr, 8).await;
    let mut ws = ws_connect(&addr).await;

    // Without a session, a TTL of 0 is refused; so are a session TTL of 0 and an end without
    // a session id.
    let refused = request(&mut ws, &acquire("s/x", "A", "a0", 0, Some(0))).await;
    assert_eq!(error_code(&refused), "INVALID_REQUEST", "{refused}");
    let refused = request(&mut ws, &keep_alive("A", 0, 0, "k0")).await;
    assert_eq!(error_code(&refused), "INVALID_REQUEST", "{refused}");
    let refused = request(
        &mut ws,
        &json!({"commandType": 14, "clientId": "A", "requestId": "e0"}),
    )
    .await;
    assert_eq!(error_code(&refused), "INVALID_REQUEST", "{refused}");
    assert!(lock_entry(&addr, "s/x").await.is_null());

    // A opens a session and attaches three locks to it.
    let opened = request(&mut ws, &keep_alive("A", 0, 30_000, "k1")).await;
    assert_eq!(opened["success"], true, "{opened}");
    let session = opened["session"].as_u64().expect("session id");
    assert!(session > 0, "{opened}");
    let mut tokens = Vec::new();
    for (i, key) in ["s/1", "s/2", "s/3"].iter().enumerate() {
        let g = request(
            &mut ws,
            &acquire(key, "A", &format!("a{}", i + 1), 0, Some(0)),
        )
        .await;
        assert_eq!(g["success"], true, "{g}");
        tokens.push(token_of(&g));
    }
    // The listing shows them attached: the session, no TTL of their own, the session's time left.
    let listed = lock_entry(&addr, "s/1").await;
    assert_eq!(listed["session"], session, "{listed}");
    assert_eq!(listed["ttlMs"], 0, "{listed}");
    assert!(
        listed["expiresInMs"].as_u64().is_some_and(|ms| ms > 0),
        "{listed}"
    );
    // B waits for one of them.
    let mut b = ws_connect(&addr).await;
    ws_send(&mut b, &acquire("s/2", "B", "b1", 30_000, Some(20_000))).await;
    assert!(reply_to(&mut b, "b1", Duration::from_millis(500))
        .await
        .is_none());

    // Ending the session releases all three in one entry, and B is granted.
    let ended = request(&mut ws, &end_session("A", session, "e1")).await;
    assert_eq!(ended["success"], true, "{ended}");
    assert_eq!(ended["locks"], 3, "{ended}");
    let gb = reply_to(&mut b, "b1", Duration::from_secs(10))
        .await
        .expect("B is granted when A's session ends");
    assert!(token_of(&gb) > tokens[2], "{gb}");
    assert!(lock_entry(&addr, "s/1").await.is_null());
    assert!(lock_entry(&addr, "s/3").await.is_null());
    // The session is gone: keeping it alive or ending it again says so.
    let gone = request(&mut ws, &keep_alive("A", session, 30_000, "k2")).await;
    assert_eq!(error_code(&gone), "NO_SESSION", "{gone}");
    let gone = request(&mut ws, &end_session("A", session, "e2")).await;
    assert_eq!(error_code(&gone), "NO_SESSION", "{gone}");

    // C's session lasts while it keeps it alive, then expires with its locks, even though the
    // Raft leader is killed in between: the new leader times the session in full again.
    let mut c = ws_connect(&addr).await;
    let opened = request(&mut c, &keep_alive("C", 0, SESSION_TTL_MS, "k1")).await;
    let c_session = opened["session"].as_u64().expect("session id");
    for (i, key) in ["t/1", "t/2"].iter().enumerate() {
        let g = request(
            &mut c,
            &acquire(key, "C", &format!("c{}", i + 1), 0, Some(0)),
        )
        .await;
        assert_eq!(g["success"], true, "{g}");
    }
    for i in 0..4 {
        tokio::time::sleep(Duration::from_millis(SESSION_TTL_MS / 3)).await;
        let kept = request(
            &mut c,
            &keep_alive("C", c_session, SESSION_TTL_MS, &format!("kc{i}")),
        )
        .await;
        assert_eq!(kept["success"], true, "keepalive {i}: {kept}");
    }
    assert!(!lock_entry(&addr, "t/1").await["holder"].is_null());
    let last_keepalive = Instant::now();
    cluster.node(leader).kill();
    let new = new_leader(&cluster, leader).await;
    let new_addr = addr_of(&cluster, new);
    let expired_by = Instant::now() + Duration::from_secs(20);
    loop {
        let (one, two) = (
            lock_entry(&new_addr, "t/1").await,
            lock_entry(&new_addr, "t/2").await,
        );
        if one["holder"].is_null() && two["holder"].is_null() {
            break;
        }
        assert!(
            Instant::now() < expired_by,
            "C's session never expired: {one} {two}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lived = last_keepalive.elapsed();
    assert!(
        lived >= Duration::from_millis(SESSION_TTL_MS),
        "C's locks ended {lived:?} after its last keepalive, inside its session's TTL"
    );
    let mut c = ws_connect(&new_addr).await;
    let gone = request(&mut c, &keep_alive("C", c_session, SESSION_TTL_MS, "k9")).await;
    assert_eq!(error_code(&gone), "NO_SESSION", "{gone}");
}
