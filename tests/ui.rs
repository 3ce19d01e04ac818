//! The status page in a real headless browser (Debian `chromium`), driven over the DevTools
//! protocol: the page served by lock-node at `/ui` loads, shows the leader, opens its live watch,
//! and shows a lock (in the locks table and the event list) moments after a client takes it. A
//! screenshot lands in `target/tmp/status-page.png`.
//!
//! Without chromium the test says so and passes, unless `RAFTLOCK_REQUIRE_CHROMIUM=1` (CI sets
//! it and installs chromium).

mod common;

use std::time::{Duration, Instant};

use base64::Engine;
use common::*;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            std::process::Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

type Cdp =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The page's DevTools session (commands go to the browser connection with this session id).
static SESSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// One DevTools call: sends `method` with `params` (to the page once attached), returns its
/// `result`.
async fn call(cdp: &mut Cdp, id: u64, method: &str, params: Value) -> Value {
    let mut msg = json!({"id": id, "method": method, "params": params});
    if let Some(session) = SESSION.get() {
        msg["sessionId"] = json!(session);
    }
    cdp.send(Message::Text(msg.to_string().into()))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let frame = tokio::time::timeout(left, cdp.next())
            .await
            .unwrap_or_else(|_| panic!("no answer to {method}"))
            .expect("DevTools connection open")
            .unwrap();
        if let Message::Text(t) = frame {
            let v: Value = serde_json::from_str(&t).unwrap();
            if v["id"] == id {
                return v["result"].clone();
            }
        }
    }
}

/// Evaluates `expr` in the page until it returns `true` (at most `within`).
async fn until_true(cdp: &mut Cdp, next_id: &mut u64, expr: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        *next_id += 1;
        let r = call(
            cdp,
            *next_id,
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true}),
        )
        .await;
        if r["result"]["value"] == true {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn page_text(cdp: &mut Cdp, next_id: &mut u64) -> String {
    *next_id += 1;
    let r = call(
        cdp,
        *next_id,
        "Runtime.evaluate",
        json!({"expression": "document.body.innerText", "returnByValue": true}),
    )
    .await;
    r["result"]["value"].as_str().unwrap_or("").to_string()
}

struct Browser(std::process::Child);

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_the_leader_and_updates_when_a_lock_is_taken() {
    let Some(browser) = chromium() else {
        assert!(
            std::env::var_os("RAFTLOCK_REQUIRE_CHROMIUM").is_none_or(|v| v != "1"),
            "chromium is required (apt-get install chromium)"
        );
        println!("ui: chromium not found (apt-get install chromium); the browser test is skipped");
        return;
    };
    let cluster = Cluster::start(3);
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    let addr = cluster.client_addr_of(leader);

    let profile = tempfile::tempdir().unwrap();
    let _browser = Browser(
        std::process::Command::new(browser)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1100,900",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(format!("http://{addr}/ui"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start chromium"),
    );
    // Chromium writes the DevTools port it picked into its profile directory.
    let port_file = profile.path().join("DevToolsActivePort");
    let deadline = Instant::now() + Duration::from_secs(30);
    let port = loop {
        if let Some(p) = std::fs::read_to_string(&port_file)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u16>().ok()))
        {
            break p;
        }
        assert!(
            Instant::now() < deadline,
            "chromium opened no DevTools port"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The second line is the browser's DevTools WebSocket path.
    let path = std::fs::read_to_string(&port_file)
        .ok()
        .and_then(|t| t.lines().nth(1).map(String::from))
        .expect("DevToolsActivePort names the browser endpoint");
    let (mut cdp, _) = tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}{path}"))
        .await
        .unwrap();
    let mut id = 100;
    let target = loop {
        id += 1;
        let targets = call(&mut cdp, id, "Target.getTargets", json!({})).await;
        if let Some(t) = targets["targetInfos"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| t["type"] == "page" && t["url"].as_str().is_some_and(|u| u.ends_with("/ui")))
        {
            break t["targetId"].as_str().unwrap().to_string();
        }
        assert!(
            Instant::now() < deadline,
            "the page never appeared: {targets}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    id += 1;
    let attached = call(
        &mut cdp,
        id,
        "Target.attachToTarget",
        json!({"targetId": target, "flatten": true}),
    )
    .await;
    SESSION
        .set(
            attached["sessionId"]
                .as_str()
                .expect("a session")
                .to_string(),
        )
        .unwrap();

    let shows_leader = format!("document.getElementById('leader').textContent === 'node {leader}'");
    assert!(
        until_true(&mut cdp, &mut id, &shows_leader, Duration::from_secs(15)).await,
        "the page does not show node {leader} as leader: {}",
        page_text(&mut cdp, &mut id).await
    );
    assert!(
        until_true(
            &mut cdp,
            &mut id,
            "document.getElementById('conn').textContent === 'live'",
            Duration::from_secs(15)
        )
        .await,
        "the page's watch never went live: {}",
        page_text(&mut cdp, &mut id).await
    );

    // A client takes a lock: the page shows it without a reload.
    let mut ws = ws_connect(&addr).await;
    let g = ws_request(
        &mut ws,
        &json!({"commandType": 3, "key": "payments/settle", "clientId": "alice",
                "requestId": "ui-1", "ttl": 60_000}),
    )
    .await;
    assert_eq!(g["success"], true, "{g}");
    let shows_lock = "document.getElementById('locks').innerText.includes('payments/settle') && \
                      document.getElementById('locks').innerText.includes('alice') && \
                      document.getElementById('events').innerText.includes('granted payments/settle alice')";
    assert!(
        until_true(&mut cdp, &mut id, shows_lock, Duration::from_secs(10)).await,
        "the page did not show the new lock: {}",
        page_text(&mut cdp, &mut id).await
    );
    let members = page_text(&mut cdp, &mut id).await;
    assert!(
        members.contains("entries"),
        "no replication lag on the leader's page: {members}"
    );

    id += 1;
    let shot = call(
        &mut cdp,
        id,
        "Page.captureScreenshot",
        json!({"format": "png"}),
    )
    .await;
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot["data"].as_str().unwrap_or(""))
        .unwrap();
    assert!(png.starts_with(b"\x89PNG"), "not a PNG screenshot");
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tmp");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("status-page.png"), png).unwrap();
}
