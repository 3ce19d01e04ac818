//! The data store as a real process: `POST /` behaves like `POST /write`, a torn last line in its
//! log (a crash mid-append) is repaired at start, and a bad line before the last refuses to start;
//! with `--lock-cluster` a forged token is refused while the real holder writes (and nothing is
//! accepted while the cluster cannot be asked); `--auth-token-file` demands a bearer token; a
//! second store on the same log refuses to start; compaction keeps the highest token of every
//! key across a restart; `GET /data` answers in bounded pages.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, http_get, ws_connect, ws_recv, ws_send, Cluster};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Store {
    addr: String,
    child: Child,
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(file: &Path) -> (String, Child) {
    spawn_with(file, &[])
}

fn spawn_with(file: &Path, extra: &[String]) -> (String, Child) {
    let addr = format!("127.0.0.1:{}", free_port());
    let stderr = std::fs::File::create(file.with_extension("stderr")).expect("stderr file");
    let child = Command::new(env!("CARGO_BIN_EXE_data-store"))
        .args(["--listen", &addr])
        .args(["--file", &file.display().to_string()])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start data-store");
    (addr, child)
}

/// Starts the store on `file` and waits until it answers `/healthz`.
async fn start(file: &Path) -> Store {
    start_with(file, &[]).await
}

/// [`start`] with extra flags.
async fn start_with(file: &Path, extra: &[String]) -> Store {
    let (addr, mut child) = spawn_with(file, extra);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if http_get(&addr, "/healthz").await.is_ok() {
            return Store { addr, child };
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "data-store exited with {status}: {}",
                stderr_of(file).trim()
            );
        }
        assert!(
            Instant::now() < deadline,
            "data-store did not start in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (at most 10 s) for `child` to exit; kills it and panics with `if_running` otherwise.
async fn exit_of(mut child: Child, if_running: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{if_running}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn stderr_of(file: &Path) -> String {
    std::fs::read_to_string(file.with_extension("stderr")).unwrap_or_default()
}

async fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    request(addr, "POST", path, Some(body), None).await
}

/// One HTTP/1.1 request (with `Authorization: Bearer <bearer>` when given): status and JSON body.
async fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    bearer: Option<&str>,
) -> (u16, Value) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let auth = bearer
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             {auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await.expect("read");
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").expect("a body");
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status");
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .expect("an answer within 5 s")
}

fn write(key: &str, token: u64, data: &str) -> Value {
    json!({"clientID": "c1", "fencingToken": {"key": key, "value": token}, "data": data})
}

async fn metric(addr: &str, name: &str) -> Option<f64> {
    let (_, body) = http_get(addr, "/metrics").await.expect("metrics");
    body.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
}

#[tokio::test]
async fn post_to_root_is_a_write() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("writes.log");
    let store = start(&file).await;
    // Every result's counter exists before the first write of that kind.
    assert_eq!(
        metric(
            &store.addr,
            "raftlock_datastore_writes_total{result=\"stale\"}"
        )
        .await,
        Some(0.0)
    );

    // Neither a fencing key nor a lock cluster: any token goes, and the store says so.
    let stderr = stderr_of(&file);
    assert!(
        stderr.contains("WARN") && stderr.contains("unprotected"),
        "{stderr}"
    );

    let (status, body) = post(&store.addr, "/", &write("orders", 5, "first")).await;
    assert_eq!((status, &body["success"]), (200, &json!(true)), "{body}");
    // Fenced exactly like /write, whichever path each write took.
    let (status, body) = post(&store.addr, "/write", &write("orders", 4, "stale")).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["current"], 5);
    let (status, body) = post(&store.addr, "/", &write("orders", 3, "stale")).await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = post(&store.addr, "/", &json!({"nonsense": true})).await;
    assert_eq!(status, 400, "{body}");
    // Fields the store does not know are ignored (a newer client, an older store).
    let mut extra = write("orders", 6, "second");
    extra["clientVersion"] = json!("2.0");
    extra["fencingToken"]["mac"] = json!("ab12");
    let (status, body) = post(&store.addr, "/write", &extra).await;
    assert_eq!(status, 200, "{body}");

    let (_, data) = http_get(&store.addr, "/data?key=orders").await.unwrap();
    let data: Value = serde_json::from_str(&data).unwrap();
    let accepted: Vec<&str> = data["writes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["data"].as_str().unwrap())
        .collect();
    assert_eq!(accepted, ["first", "second"]);
    assert_eq!(data["highest"]["orders"], 6);
    let log = std::fs::read_to_string(&file).unwrap();
    assert_eq!(log.lines().count(), 2, "{log}");
}

#[tokio::test]
async fn a_torn_last_line_is_repaired_at_start() {
    for (name, tail) in [
        ("unterminated", "orders\t9\tc1\t\"half-writ".to_string()),
        (
            "unterminated but parsable",
            "orders\t9\tc1\t\"x\"".to_string(),
        ),
        ("unparsable", "\0\0\0\0\n".to_string()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("writes.log");
        let good = "orders\t7\tc1\t\"a\"\nother\t8\tc2\t\"b\"\n";
        std::fs::write(&file, format!("{good}{tail}")).unwrap();

        let store = start(&file).await;
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            good,
            "{name}: truncated to the last complete line"
        );
        assert_eq!(
            metric(&store.addr, "raftlock_datastore_repaired_lines_total").await,
            Some(1.0),
            "{name}"
        );
        let stderr = stderr_of(&file);
        assert!(
            stderr.contains("WARN") && stderr.contains("torn last line"),
            "{name}: a warning names the repair: {stderr}"
        );
        // The complete lines were replayed: token 7 is still the highest for `orders`, the
        // torn token 9 never counted.
        let (status, body) = post(&store.addr, "/write", &write("orders", 6, "stale")).await;
        assert_eq!(
            (status, &body["current"]),
            (409, &json!(7)),
            "{name}: {body}"
        );
        let (status, _) = post(&store.addr, "/", &write("orders", 8, "next")).await;
        assert_eq!(status, 200, "{name}");
        drop(store);

        // The next write starts on its own line, and a restart finds nothing to repair.
        let log = std::fs::read_to_string(&file).unwrap();
        assert_eq!(log, format!("{good}orders\t8\tc1\t\"next\"\n"), "{name}");
        let store = start(&file).await;
        assert_eq!(
            metric(&store.addr, "raftlock_datastore_repaired_lines_total").await,
            Some(0.0),
            "{name}"
        );
        let (status, _) = post(&store.addr, "/write", &write("orders", 7, "stale")).await;
        assert_eq!(status, 409, "{name}: token 8 survived the restart");
    }
}

#[tokio::test]
async fn a_corrupt_line_before_the_last_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("writes.log");
    let content = "orders\t7\tc1\t\"a\"\norders\tseven\tc1\t\"b\"\norders\t9\tc1\t\"c\"\n";
    std::fs::write(&file, content).unwrap();

    let (_addr, child) = spawn(&file);
    let status = exit_of(child, "data-store started on a damaged log").await;
    assert!(!status.success());
    let stderr = stderr_of(&file);
    assert!(
        stderr.contains("line 2") && stderr.contains("token is not a number"),
        "the error names the line and the damage: {stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        content,
        "a damaged log is left as it is"
    );
}

/// Takes `key` for `client` the way seed 000's client does (no request id; retried while the
/// cluster has no leader yet) and returns the fencing token.
async fn seed_acquire(node: &str, key: &str, client: &str) -> u64 {
    let mut ws = ws_connect(node).await;
    let request = json!({"commandType": 3, "key": key, "clientId": client, "ttl": 60_000});
    for _ in 0..100 {
        ws_send(&mut ws, &request).await;
        let reply = ws_recv(&mut ws, Duration::from_secs(10))
            .await
            .expect("a reply");
        if reply["success"] == true {
            return reply["fencingToken"]["value"].as_u64().expect("a token");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{client} could not take {key}")
}

/// Releases `key` seed-style (fire and forget) and waits for the answer the server sends anyway.
async fn seed_release(node: &str, key: &str, client: &str) {
    let mut ws = ws_connect(node).await;
    ws_send(
        &mut ws,
        &json!({"commandType": 4, "key": key, "clientId": client}),
    )
    .await;
    let reply = ws_recv(&mut ws, Duration::from_secs(10)).await;
    assert_eq!(
        reply.as_ref().map(|r| r["success"].clone()),
        Some(json!(true)),
        "{reply:?}"
    );
}

fn lock_cluster_flag(cluster: &Cluster) -> Vec<String> {
    let urls: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("http://{}", n.client_addr()))
        .collect();
    vec!["--lock-cluster".into(), urls.join(",")]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_lock_cluster_a_forged_token_is_refused_and_the_real_holder_writes() {
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    // Seed 000's clients talk to any node; a follower forwards.
    let node = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .unwrap()
        .client_addr();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("writes.log");
    let store = start_with(&file, &lock_cluster_flag(&cluster)).await;

    let token = seed_acquire(&node, "orders", "worker-1").await;
    // The one-POST denial of service: a token far above anything issued.
    let (status, body) = post(&store.addr, "/", &write("orders", u64::MAX, "forged")).await;
    assert_eq!(status, 403, "{body}");
    let error = body["error"].as_str().unwrap_or("");
    assert!(
        error.contains("not the current holder") && error.contains(&format!("token {token}")),
        "the reason names what the lock service holds: {body}"
    );
    // A token just above the real one is refused too, and so is a token for a key nobody holds.
    let (status, body) = post(&store.addr, "/write", &write("orders", token + 1, "x")).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = post(&store.addr, "/write", &write("nobody-holds-this", 5, "x")).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("not held"),
        "{body}"
    );

    // The real holder, with seed 000's unchanged request, writes — and writes again.
    let (status, body) = post(&store.addr, "/", &write("orders", token, "real-1")).await;
    assert_eq!((status, &body), (200, &json!({"success": true})));
    let (status, _) = post(&store.addr, "/", &write("orders", token, "real-2")).await;
    assert_eq!(status, 200);
    assert_eq!(
        metric(
            &store.addr,
            "raftlock_datastore_writes_total{result=\"not_holder\"}"
        )
        .await,
        Some(3.0)
    );

    // The lock passes on: the next holder's token is confirmed, the old one is stale.
    seed_release(&node, "orders", "worker-1").await;
    let next = seed_acquire(&node, "orders", "worker-2").await;
    assert!(next > token);
    let (status, body) = post(&store.addr, "/", &write("orders", next, "next")).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = post(&store.addr, "/", &write("orders", token, "late")).await;
    assert_eq!((status, &body["current"]), (409, &json!(next)), "{body}");

    // With no lock node reachable: a token already confirmed still writes (nothing to ask), a
    // new one is refused 503 — fail closed.
    drop(cluster);
    let (status, _) = post(&store.addr, "/", &write("orders", next, "again")).await;
    assert_eq!(status, 200);
    let (status, body) = post(&store.addr, "/", &write("orders", next + 1, "unchecked")).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("cannot confirm"),
        "{body}"
    );
    let (_, data) = http_get(&store.addr, "/data?key=orders").await.unwrap();
    let data: Value = serde_json::from_str(&data).unwrap();
    let accepted: Vec<&str> = data["writes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["data"].as_str().unwrap())
        .collect();
    assert_eq!(accepted, ["real-1", "real-2", "next", "again"]);
    assert_eq!(data["highest"]["orders"], next);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_cluster_that_hides_tokens_refuses_every_new_token() {
    // The nodes authenticate clients; the store asks with a non-admin identity, which does not
    // see fencing tokens in /locks: it cannot confirm anything, so it accepts nothing new.
    let files = tempfile::tempdir().unwrap();
    let auth = files.path().join("clients.json");
    std::fs::write(
        &auth,
        json!({"identities": [
            {"name": "worker", "token": "worker-token-0123456789", "prefixes": [""],
             "operations": ["acquire", "release", "read"]},
        ]})
        .to_string(),
    )
    .unwrap();
    let auth_flag = auth.display().to_string();
    let cluster = Cluster::start_with(3, move |_| {
        vec!["--client-auth-file".into(), auth_flag.clone()]
    });
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    // The lock is held (a browser-style bearer token on the WebSocket URL).
    let url = format!(
        "ws://{}/ws?access_token=worker-token-0123456789",
        cluster.client_addr_of(leader)
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str())
        .await
        .unwrap();
    let grant = json!({"commandType": 3, "key": "orders", "clientId": "w1", "ttl": 60_000,
                       "requestId": "r1"});
    let reply = common::ws_request(&mut ws, &grant).await;
    assert_eq!(reply["success"], true, "{reply}");
    let token = reply["fencingToken"]["value"].as_u64().unwrap();
    let token_file = files.path().join("store-asks-as.token");
    std::fs::write(&token_file, "worker-token-0123456789\n").unwrap();
    let mut flags = lock_cluster_flag(&cluster);
    flags.extend([
        "--lock-cluster-token-file".into(),
        token_file.display().to_string(),
    ]);
    let file = files.path().join("writes.log");
    let store = start_with(&file, &flags).await;
    let (status, body) = post(&store.addr, "/", &write("orders", token, "x")).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("admin"),
        "the reason says which identity is needed: {body}"
    );
    assert_eq!(
        metric(
            &store.addr,
            "raftlock_datastore_writes_total{result=\"unverified\"}"
        )
        .await,
        Some(1.0)
    );
}

#[tokio::test]
async fn a_token_file_makes_writes_and_reads_need_the_bearer_token() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("store.token");
    std::fs::write(&token_file, "s3cret-store-token\n").unwrap();
    let file = dir.path().join("writes.log");
    let flags = ["--auth-token-file".into(), token_file.display().to_string()];
    let store = start_with(&file, &flags).await;
    let body = write("orders", 1, "x");
    for bearer in [None, Some("wrong"), Some("s3cret-store-token-and-more")] {
        let (status, answer) = request(&store.addr, "POST", "/write", Some(&body), bearer).await;
        assert_eq!(status, 401, "{bearer:?}: {answer}");
        let (status, _) = request(&store.addr, "GET", "/data", None, bearer).await;
        assert_eq!(status, 401, "{bearer:?}");
    }
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "",
        "nothing written"
    );
    let ok = Some("s3cret-store-token");
    let (status, answer) = request(&store.addr, "POST", "/", Some(&body), ok).await;
    assert_eq!(status, 200, "{answer}");
    let (status, data) = request(&store.addr, "GET", "/data", None, ok).await;
    assert_eq!(status, 200);
    assert_eq!(data["writes"][0]["data"], "x", "{data}");
    // Probes and Prometheus need no token.
    assert!(http_get(&store.addr, "/healthz").await.is_ok());
    assert_eq!(
        metric(
            &store.addr,
            "raftlock_datastore_writes_total{result=\"unauthenticated\"}"
        )
        .await,
        Some(3.0)
    );
}

#[tokio::test]
async fn a_second_store_on_the_same_log_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("writes.log");
    let first = start(&file).await;
    let (status, _) = post(&first.addr, "/", &write("orders", 3, "a")).await;
    assert_eq!(status, 200);

    let second_file = dir.path().join("second.log");
    let second_stderr = std::fs::File::create(&second_file).unwrap();
    let second = Command::new(env!("CARGO_BIN_EXE_data-store"))
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--file", &file.display().to_string()])
        .stdout(Stdio::null())
        .stderr(second_stderr)
        .spawn()
        .unwrap();
    let status = exit_of(second, "a second data store started on a log in use").await;
    assert!(!status.success());
    let stderr = std::fs::read_to_string(&second_file).unwrap();
    assert!(
        stderr.contains("another data store"),
        "the error says why: {stderr}"
    );
    // The first still owns the log and keeps writing.
    let (status, _) = post(&first.addr, "/", &write("orders", 4, "b")).await;
    assert_eq!(status, 200);
    // The lock dies with its process: once the first is gone, a new store starts on the log.
    drop(first);
    let again = start(&file).await;
    let (status, body) = post(&again.addr, "/", &write("orders", 3, "stale")).await;
    assert_eq!((status, &body["current"]), (409, &json!(4)));
}

#[tokio::test]
async fn compaction_keeps_the_highest_token_of_every_key_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("writes.log");
    // A log left by a long run: 3 keys, 300 writes each, tokens rising per key.
    let mut log = String::new();
    for round in 1..=300u64 {
        for (i, key) in ["a", "b", "c"].iter().enumerate() {
            let token = round * 10 + i as u64;
            log.push_str(&format!(
                "{key}\t{token}\tc1\t\"{key}-{round}-{}\"\n",
                "x".repeat(40)
            ));
        }
    }
    std::fs::write(&file, &log).unwrap();
    let flags = ["--compact-min-bytes", "4096", "--compact-ratio", "4"].map(String::from);

    // At start the log is far past 4 times its live content: compacted to one line per key.
    let store = start_with(&file, &flags).await;
    let lines: Vec<String> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (i, key) in ["a", "b", "c"].iter().enumerate() {
        assert!(
            lines[i].starts_with(&format!("{key}\t{}\t", 3000 + i)),
            "{key} keeps its highest token and last data: {}",
            lines[i]
        );
    }
    assert!(!dir.path().join("writes.log.compact").exists());

    // Writes while running: the log is compacted again once it outgrows its live content.
    for round in 301..=400u64 {
        let (status, body) =
            post(&store.addr, "/", &write("a", round * 10, &"y".repeat(100))).await;
        assert_eq!(status, 200, "{body}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(
        &store.addr,
        "raftlock_datastore_compactions_total{result=\"ok\"}",
    )
    .await
        < Some(2.0)
    {
        assert!(Instant::now() < deadline, "no compaction while running");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let size = std::fs::metadata(&file).unwrap().len();
    assert!(size < 4 * 4096, "the log stays bounded: {size} bytes");
    // The newest write's data is read back from the compacted log.
    let (_, data) = http_get(&store.addr, "/data?key=a&limit=1").await.unwrap();
    let data: Value = serde_json::from_str(&data).unwrap();
    assert_eq!(data["writes"][0]["fencingToken"], 4000, "{data}");
    assert_eq!(data["writes"][0]["data"], "y".repeat(100), "{data}");
    drop(store);

    // After a restart every key still refuses anything below its highest token.
    let store = start_with(&file, &flags).await;
    for (key, highest) in [("a", 4000u64), ("b", 3001), ("c", 3002)] {
        let (status, body) = post(&store.addr, "/", &write(key, highest - 1, "stale")).await;
        assert_eq!(
            (status, &body["current"]),
            (409, &json!(highest)),
            "{key}: {body}"
        );
        let (status, _) = post(&store.addr, "/", &write(key, highest, "same holder")).await;
        assert_eq!(status, 200, "{key}");
    }
}

#[tokio::test]
async fn get_data_answers_in_bounded_pages() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("writes.log");
    let flags = [
        "--recent-writes",
        "50",
        "--page-records-max",
        "20",
        "--page-bytes-max",
        "4000",
    ]
    .map(String::from);
    let store = start_with(&file, &flags).await;
    for token in 1..=80u64 {
        let key = if token % 2 == 0 { "even" } else { "odd" };
        let data = format!("{token:03}{}", "d".repeat(297));
        let (status, _) = post(&store.addr, "/", &write(key, token, &data)).await;
        assert_eq!(status, 200);
    }
    let get = |path: String| {
        let addr = store.addr.clone();
        async move {
            let (status, body) = http_get(&addr, &path).await.unwrap();
            assert_eq!(status, 200, "{path}: {body}");
            serde_json::from_str::<Value>(&body).unwrap()
        }
    };
    let tokens = |page: &Value| -> Vec<u64> {
        page["writes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["fencingToken"].as_u64().unwrap())
            .collect()
    };
    // The newest writes, oldest first, cut by the byte cap (300-byte writes, 4000 bytes a page).
    let page = get("/data".into()).await;
    let newest = tokens(&page);
    assert!(newest.len() < 20 && newest.len() >= 5, "{newest:?}");
    assert_eq!(newest.last(), Some(&80));
    assert!(newest.windows(2).all(|w| w[0] < w[1]), "{newest:?}");
    assert_eq!(
        (&page["more"], &page["truncated"]),
        (&json!(true), &json!(true))
    );
    let size: u64 = page["writes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["size"].as_u64().unwrap())
        .sum();
    assert!(size <= 4000, "{size}");
    assert_eq!(page["writes"][0]["data"].as_str().unwrap().len(), 300);

    // Walking back with `before` reaches every kept write, and only the last 50 are kept.
    let mut all = newest.clone();
    let mut cursor = page["before"].as_u64();
    let mut pages = 1;
    while let Some(before) = cursor {
        let page = get(format!("/data?before={before}")).await;
        let mut older = tokens(&page);
        older.extend(all);
        all = older;
        cursor = page["before"].as_u64();
        pages += 1;
        assert!(pages < 20, "the walk ends");
    }
    assert_eq!(all, (31..=80).collect::<Vec<_>>());

    // `limit` is capped; `key` filters; `after` follows newer writes.
    let page = get("/data?limit=100000&key=even".into()).await;
    assert!(tokens(&page).len() <= 20);
    assert!(tokens(&page).iter().all(|t| t % 2 == 0));
    assert_eq!(page["highest"], json!({"even": 80}));
    let page = get("/data?limit=3".into()).await;
    assert_eq!(tokens(&page), [78, 79, 80]);
    let last_seq = page["after"].as_u64().unwrap();
    let page = get(format!("/data?after={last_seq}")).await;
    assert_eq!(tokens(&page), Vec::<u64>::new());
    let (status, _) = post(&store.addr, "/", &write("odd", 81, "new")).await;
    assert_eq!(status, 200);
    let page = get(format!("/data?after={last_seq}")).await;
    assert_eq!(tokens(&page), [81]);
    assert_eq!(page["writes"][0]["data"], "new");
}
