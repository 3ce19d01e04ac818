//! Tests of the SDK's connection: requests and replies as the protocol spells them, and a
//! connection's writes (a peer that stops reading, queued requests going out together).

use super::*;
use serde_json::json;
use serde_json::Value;

fn sent(request: &Request<'_>) -> Value {
    serde_json::from_str(request.text().as_str()).unwrap()
}

#[test]
fn requests_go_out_as_the_protocol_spells_them() {
    // What each SDK operation sent when it built a `serde_json::Value` first.
    let acquire = Request {
        client_id: Some("c#1"),
        ttl: Some(5000),
        wait_timeout: Some(0),
        ..Request::new(3, "jobs/a", "r\"1")
    };
    assert_eq!(
        sent(&acquire),
        json!({"commandType": 3, "key": "jobs/a", "clientId": "c#1", "requestId": "r\"1",
               "ttl": 5000, "waitTimeout": 0})
    );
    let release = Request {
        client_id: Some("c#1"),
        fencing_token: Some(TokenRef {
            key: "jobs/a",
            value: 7,
        }),
        ..Request::new(4, "jobs/a", "r2")
    };
    assert_eq!(
        sent(&release),
        json!({"commandType": 4, "key": "jobs/a", "clientId": "c#1", "requestId": "r2",
               "fencingToken": {"key": "jobs/a", "value": 7}})
    );
    let get = Request::new(7, "k", "r3");
    assert_eq!(
        sent(&get),
        json!({"commandType": 7, "key": "k", "requestId": "r3"})
    );
    let put = Request {
        client_id: Some("c"),
        value: Some("v\n"),
        traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ..Request::new(2, "k", "r4")
    };
    assert_eq!(
        sent(&put),
        json!({"commandType": 2, "key": "k", "clientId": "c", "requestId": "r4",
               "value": "v\n",
               "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    );
    let direct = Request {
        redirect: Some(true),
        ..get
    };
    assert_eq!(
        sent(&direct),
        json!({"commandType": 7, "key": "k", "requestId": "r3", "redirect": true})
    );
}

fn reply(text: &str) -> Option<(String, Reply)> {
    parse_reply(Utf8Bytes::from(text.to_string()))
}

#[test]
fn replies_are_read_into_the_fields_the_sdk_uses() {
    let (id, grant) = reply(
        r#"{"expiresInMs":4990,"fencingToken":{"key":"k","mac":"ab","value":12},"key":"k","requestId":"r1","success":true}"#,
    )
    .unwrap();
    assert_eq!(id, "r1");
    assert!(grant.body.success && !grant.body.malformed);
    assert_eq!(grant.body.expires_in_ms, Some(4990));
    let token = grant.body.fencing_token.as_ref().unwrap();
    assert_eq!((token.value, token.mac.as_deref()), (Some(12), Some("ab")));

    let (_, not_leader) = reply(
        r#"{"success":false,"key":"k","requestId":"r2","error":{"code":"NOT_LEADER","message":"m","leaderId":2,"leaderAddr":"127.0.0.1:2"}}"#,
    )
    .unwrap();
    assert!(!not_leader.body.success);
    assert_eq!(not_leader.body.code(), "NOT_LEADER");
    let error = not_leader.body.error.as_ref().unwrap();
    assert_eq!(error.leader_addr.as_deref(), Some("127.0.0.1:2"));

    let (_, value) = reply(r#"{"key":"k","requestId":"r3","success":true,"value":null}"#).unwrap();
    assert_eq!(value.body.value, None);
    let (_, value) = reply(r#"{"key":"k","requestId":"r3","success":true,"value":"x"}"#).unwrap();
    assert_eq!(value.body.value.as_deref(), Some("x"));
    let (_, cancelled) = reply(r#"{"cancelled":true,"requestId":"r4","success":true}"#).unwrap();
    assert_eq!(cancelled.body.cancelled, Some(true));
}

#[test]
fn a_reply_of_unknown_shape_still_answers_its_request_and_others_are_dropped() {
    // A field of another type than the SDK knows: the caller gets a protocol error, and the
    // reply's text for it, rather than waiting for a timeout.
    let (id, odd) = reply(r#"{"requestId":"r1","success":"yes","expiresInMs":-1}"#).unwrap();
    assert_eq!(id, "r1");
    assert!(odd.body.malformed && !odd.body.success);
    assert!(odd.to_string().contains("\"yes\""));
    // Nothing names a request of this connection: dropped.
    assert!(reply(r#"{"requestId":7,"success":true}"#).is_none());
    assert!(reply(r#"{"success":true}"#).is_none());
    assert!(reply("not json").is_none());
}

/// A node that accepts the connection and then reads nothing: once the socket's buffers are
/// full, a request cannot be written. The call ends with a timeout instead of waiting
/// forever, and the connection is given up so that the session opens another.
#[tokio::test]
async fn a_peer_that_stops_reading_cannot_hold_a_call() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (held_tx, held_rx) = oneshot::channel();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
        // Kept open, never read.
        let _ = held_tx.send(ws);
        std::future::pending::<()>().await;
    });
    let big = 1 << 20;
    let conn = Conn::connect(&addr, Duration::from_secs(5), 64, 2 * big, None, None, None)
        .await
        .unwrap();
    let _held = held_rx.await.unwrap();
    let text: Utf8Bytes = "x".repeat(big).into();
    let mut outcome = None;
    for i in 0..64 {
        let id = format!("r{i}");
        let started = Instant::now();
        let call = conn.call(
            &id,
            ReplyKind::Normal,
            &text,
            Some(Duration::from_millis(300)),
        );
        match tokio::time::timeout(Duration::from_secs(10), call).await {
            Err(_) => panic!("call {i} still waiting after 10 s"),
            // The request reached the socket; its reply never comes.
            Ok(Err(CallError::Timeout)) if !conn.is_closed() => continue,
            Ok(result) => {
                outcome = Some((i, result.map(|_| ()), started.elapsed()));
                break;
            }
        }
    }
    let (i, result, took) = outcome.expect("64 MB were all taken by a peer that reads nothing");
    assert!(
        matches!(result, Err(CallError::Timeout)),
        "call {i}: {result:?}"
    );
    assert!(conn.is_closed(), "the stuck connection is given up");
    assert!(took < Duration::from_secs(5), "call {i} took {took:?}");
    assert!(
        conn.pending.lock().unwrap().is_empty(),
        "nothing left waiting"
    );
}

/// A node that reports every text frame it reads (a node of an older release: it takes no
/// batches).
async fn recording_node() -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
    recording_node_with(&[]).await
}

/// A node that reports every text frame it reads and answers the upgrade with `headers`.
async fn recording_node_with(
    headers: &[(&'static str, &'static str)],
) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
    use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let headers = headers.to_vec();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        // The library's callback returns its own (large) error type.
        #[allow(clippy::result_large_err)]
        let answer = move |_: &Request, mut response: Response| {
            for (name, value) in &headers {
                response.headers_mut().insert(*name, value.parse().unwrap());
            }
            Ok(response)
        };
        let mut ws = tokio_tungstenite::accept_hdr_async(tcp, answer)
            .await
            .unwrap();
        while let Some(Ok(msg)) = ws.next().await {
            if let Message::Text(t) = msg {
                let _ = tx.send(t.to_string());
            }
        }
    });
    (addr, rx)
}

/// Requests that queue while the sink is busy are all written by whoever gets it next; a
/// caller that stops waiting before then takes its request back, so it never goes out.
#[tokio::test]
async fn queued_requests_go_out_together_and_a_caller_that_gives_up_takes_its_back() {
    let (addr, mut received) = recording_node().await;
    let conn = Arc::new(
        Conn::connect(&addr, Duration::from_secs(5), 64, 1 << 20, None, None, None)
            .await
            .unwrap(),
    );
    let busy = conn.sink.lock().await;
    // Given up while queued: the outer timeout drops the call.
    let abandoned: Utf8Bytes = r#"{"requestId":"abandoned"}"#.into();
    let gave_up = tokio::time::timeout(
        Duration::from_millis(50),
        conn.call("abandoned", ReplyKind::Normal, &abandoned, None),
    )
    .await;
    assert!(gave_up.is_err(), "the call waited for the busy sink");
    assert!(conn.outbox.lock().unwrap().is_empty(), "{:?}", conn.outbox);
    let waiting: Vec<_> = (0..5)
        .map(|i| {
            let conn = conn.clone();
            tokio::spawn(async move {
                let id = format!("q{i}");
                let text: Utf8Bytes = format!(r#"{{"requestId":"{id}"}}"#).into();
                conn.call(
                    &id,
                    ReplyKind::Normal,
                    &text,
                    Some(Duration::from_millis(300)),
                )
                .await
            })
        })
        .collect();
    // All five queue behind the busy sink.
    let queued = Instant::now();
    while conn.outbox.lock().unwrap().len() < 5 {
        assert!(
            queued.elapsed() < Duration::from_secs(5),
            "{:?}",
            conn.outbox
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(busy);
    let mut got = Vec::new();
    while got.len() < 5 {
        let frame = tokio::time::timeout(Duration::from_secs(5), received.recv())
            .await
            .expect("the queued requests reach the node")
            .unwrap();
        got.push(frame);
    }
    got.sort();
    let want: Vec<String> = (0..5)
        .map(|i| format!(r#"{{"requestId":"q{i}"}}"#))
        .collect();
    assert_eq!(
        got, want,
        "each queued request once, the abandoned one never"
    );
    for w in waiting {
        // No node answers here: each call ends in its own timeout, the connection intact.
        assert!(matches!(w.await.unwrap(), Err(CallError::Timeout)));
    }
    assert!(!conn.is_closed());
    assert!(
        tokio::time::timeout(Duration::from_millis(200), received.recv())
            .await
            .is_err(),
        "nothing else was written"
    );
}

/// Requests queued together go to a node that takes batches as JSON arrays, no more requests
/// and no more bytes in one than the node said it takes (its upgrade's answer).
#[tokio::test]
async fn queued_requests_go_out_as_batches_the_node_takes() {
    let (addr, mut received) = recording_node_with(&[
        ("raftlock-batch-max", "3"),
        ("raftlock-max-message-bytes", "1024"),
    ])
    .await;
    let conn = Arc::new(
        Conn::connect(&addr, Duration::from_secs(5), 64, 1 << 20, None, None, None)
            .await
            .unwrap(),
    );
    assert_eq!(
        conn.batch,
        BatchLimit {
            requests: 3,
            bytes: 1024
        }
    );
    let busy = conn.sink.lock().await;
    let big = "x".repeat(700);
    let waiting: Vec<_> = (0..6)
        .map(|i| {
            let conn = conn.clone();
            let pad = if i == 4 { big.clone() } else { String::new() };
            tokio::spawn(async move {
                let id = format!("q{i}");
                let text: Utf8Bytes = format!(r#"{{"requestId":"{id}","pad":"{pad}"}}"#).into();
                conn.call(
                    &id,
                    ReplyKind::Normal,
                    &text,
                    Some(Duration::from_millis(300)),
                )
                .await
            })
        })
        .collect();
    let queued = Instant::now();
    while conn.outbox.lock().unwrap().len() < 6 {
        assert!(queued.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let order: Vec<String> = conn
        .outbox
        .lock()
        .unwrap()
        .iter()
        .map(|f| serde_json::from_str::<Value>(f).unwrap()["requestId"].to_string())
        .collect();
    drop(busy);
    let mut frames = Vec::new();
    let mut requests = Vec::new();
    while requests.len() < 6 {
        let frame = tokio::time::timeout(Duration::from_secs(5), received.recv())
            .await
            .expect("the queued requests reach the node")
            .unwrap();
        assert!(frame.len() <= 1024, "{} bytes", frame.len());
        let value: Value = serde_json::from_str(&frame).unwrap();
        let ids: Vec<String> = match value {
            Value::Array(items) => items.iter().map(|r| r["requestId"].to_string()).collect(),
            one => vec![one["requestId"].to_string()],
        };
        frames.push(ids.len());
        requests.extend(ids);
    }
    assert_eq!(requests, order, "every request once, in the outbox's order");
    assert!(frames.iter().all(|&n| n <= 3), "{frames:?}");
    assert!(frames.len() < 6, "some requests shared a frame: {frames:?}");
    for w in waiting {
        assert!(matches!(w.await.unwrap(), Err(CallError::Timeout)));
    }
}

#[test]
fn batches_keep_to_the_nodes_bounds() {
    let frames: Vec<Utf8Bytes> = ["a", "bb", "ccc", "dddd", "e"]
        .iter()
        .map(|s| Utf8Bytes::from(s.to_string()))
        .collect();
    let lens = |limit| -> Vec<usize> { batches(&frames, limit).iter().map(|b| b.len()).collect() };
    let old = BatchLimit {
        requests: 1,
        bytes: 0,
    };
    assert_eq!(lens(old), [1, 1, 1, 1, 1]);
    let by_count = BatchLimit {
        requests: 2,
        bytes: 1000,
    };
    assert_eq!(lens(by_count), [2, 2, 1]);
    // "[a,bb]" is 6 bytes, "[a,bb,ccc]" 10: a limit of 9 cuts after bb, and "[ccc,dddd]" is 10.
    let by_bytes = BatchLimit {
        requests: 64,
        bytes: 9,
    };
    assert_eq!(lens(by_bytes), [2, 1, 2]);
    assert_eq!(batch_frame(&frames[..3]).as_str(), "[a,bb,ccc]");
    assert_eq!(batch_frame(&frames[..1]).as_str(), "a");
}
