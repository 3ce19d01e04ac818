//! The data store as a real process: `POST /` behaves like `POST /write`, a torn last line in its
//! log (a crash mid-append) is repaired at start, and a bad line before the last refuses to start.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, http_get};
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
    let addr = format!("127.0.0.1:{}", free_port());
    let stderr = std::fs::File::create(file.with_extension("stderr")).expect("stderr file");
    let child = Command::new(env!("CARGO_BIN_EXE_data-store"))
        .args(["--listen", &addr])
        .args(["--file", &file.display().to_string()])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start data-store");
    (addr, child)
}

/// Starts the store on `file` and waits until it answers `/healthz`.
async fn start(file: &Path) -> Store {
    let (addr, mut child) = spawn(file);
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

fn stderr_of(file: &Path) -> String {
    std::fs::read_to_string(file.with_extension("stderr")).unwrap_or_default()
}

async fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
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

    let (_addr, mut child) = spawn(&file);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("data-store started on a damaged log");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
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
