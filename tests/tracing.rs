//! OpenTelemetry traces from real lock-node processes: an OTLP/gRPC receiver built from the
//! OpenTelemetry protocol crates collects what a three-node cluster exports when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` points at it. A client's acquire sent to a follower with a
//! `traceparent` shows up as one trace across both nodes — the follower's span, its client span
//! of the hop (`lock.forward`) and the leader's span (forwarded) — with the key, client, outcome
//! and fencing token as attributes, under the standard resource (`service.name`,
//! `OTEL_RESOURCE_ATTRIBUTES`). The leader's span links to the batch that carried the request,
//! whose children are the fsync that made it durable and the replication to the followers. An
//! acquire answered `WAIT_TIMEOUT` is marked failed (`error.type`). The Rust SDK (`trace_context`) and `lockctl` (the
//! `TRACEPARENT` environment variable) continue their caller's trace the same way, and an acquire
//! that waited in the queue records its place in line and its wait.
//!
//! Every wait is bounded; everything is on 127.0.0.1.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::json;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";
/// The trace of the SDK's queued acquire, and of `lockctl acquire` (TRACEPARENT).
const SDK_TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const SDK_PARENT_ID: &str = "b7ad6b7169203331";
const CLI_TRACE_ID: &str = "5e1c3f2a9b8d47e6a0b1c2d3e4f50617";
const CLI_PARENT_ID: &str = "1a2b3c4d5e6f7081";

/// A span as received, with its resource's attributes.
#[derive(Clone, Debug)]
struct Received {
    resource: Vec<KeyValue>,
    span: Span,
}

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().expect("lock");
        for rs in request.into_inner().resource_spans {
            let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push(Received {
                        resource: resource.clone(),
                        span,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn attr(attrs: &[KeyValue], key: &str) -> Option<AnyValue> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

fn attr_str(attrs: &[KeyValue], key: &str) -> Option<String> {
    match attr(attrs, key)? {
        AnyValue::StringValue(s) => Some(s),
        other => Some(format!("{other:?}")),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_arrive_over_otlp_and_one_trace_crosses_the_forward() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(collector.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    let server = tokio::spawn(server);

    // The nodes inherit these (this file holds one test, so nothing else reads the environment).
    std::env::set_var(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        format!("http://127.0.0.1:{port}"),
    );
    std::env::set_var("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci");
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "200");
    std::env::remove_var("OTEL_SERVICE_NAME");
    std::env::remove_var("OTEL_SDK_DISABLED");

    // JSON logs with each answer logged (debug, the request execution only).
    let cluster = Cluster::start_custom(
        3,
        |node| {
            node.env.extend([
                ("RAFTLOCK_LOG_FORMAT".into(), "json".into()),
                (
                    "RUST_LOG".into(),
                    "info,raftlock::server::exec=debug".into(),
                ),
            ])
        },
        |_| Vec::new(),
    );
    let leader = cluster.wait_for_leader(Duration::from_secs(20)).await;
    let (follower_id, follower) = follower_knowing(&cluster, leader).await;

    let mut ws = ws_connect(&follower).await;
    let reply = ws_request(
        &mut ws,
        &json!({"commandType": 3, "key": "traced", "clientId": "t1", "requestId": "r1",
                "ttl": 30000, "traceparent": format!("00-{TRACE_ID}-{PARENT_ID}-01")}),
    )
    .await;
    assert_eq!(reply["success"], true, "{reply}");
    let token = reply["fencingToken"]["value"].as_u64().expect("token");

    // Both nodes' spans of the request, in the client's trace; Raft's spans.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (follower_span, leader_span) = loop {
        let spans = collector.spans.lock().expect("lock").clone();
        let in_trace: Vec<&Received> = spans
            .iter()
            .filter(|r| hex(&r.span.trace_id) == TRACE_ID && r.span.name == "lock.acquire")
            .collect();
        let via = |v: &str| {
            in_trace
                .iter()
                .find(|r| attr_str(&r.span.attributes, "via").as_deref() == Some(v))
                .map(|r| (*r).clone())
        };
        let names: Vec<&str> = spans.iter().map(|r| r.span.name.as_str()).collect();
        let raft_spans = [
            "raft.election",
            "raft.batch",
            "raft.fsync",
            "raft.replicate",
        ]
        .iter()
        .all(|n| names.contains(n));
        if let (Some(f), Some(l), true) = (via("websocket"), via("forwarded"), raft_spans) {
            break (f, l);
        }
        assert!(
            Instant::now() < deadline,
            "spans missing after 30 s; received {} spans named {:?}",
            spans.len(),
            {
                let mut n = names.clone();
                n.sort();
                n.dedup();
                n
            }
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // The follower's span is the child of the client's span and is marked forwarded; the hop to
    // the leader is a client span under it, and the leader's span is the hop's child.
    assert_eq!(hex(&follower_span.span.parent_span_id), PARENT_ID);
    let spans = collector.spans.lock().expect("lock").clone();
    let hop = spans
        .iter()
        .find(|r| {
            r.span.name == "raftlock.peer.Peer/ForwardClient" && hex(&r.span.trace_id) == TRACE_ID
        })
        .unwrap_or_else(|| {
            let names: Vec<&str> = spans.iter().map(|r| r.span.name.as_str()).collect();
            panic!("no client span of the forward hop in the trace: {names:?}")
        });
    assert_eq!(hop.span.parent_span_id, follower_span.span.span_id);
    // SpanKind 3 is CLIENT in the OTLP protocol.
    assert_eq!(hop.span.kind, 3, "{:?}", hop.span);
    assert_eq!(
        attr_str(&hop.span.attributes, "rpc.system").as_deref(),
        Some("grpc")
    );
    assert_eq!(leader_span.span.parent_span_id, hop.span.span_id);
    assert_eq!(
        attr_str(&leader_span.span.attributes, "rpc.system").as_deref(),
        Some("grpc")
    );

    // The leader's span links to the batch that carried the request; the fsync that made it
    // durable and the replication to the followers are that batch's children.
    let batch_id = leader_span
        .span
        .links
        .first()
        .map(|l| l.span_id.clone())
        .expect("the leader's request span links to its batch");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let spans = collector.spans.lock().expect("lock").clone();
        let batch = spans.iter().find(|r| r.span.span_id == batch_id);
        let child = |name: &str| {
            spans
                .iter()
                .any(|r| r.span.name == name && r.span.parent_span_id == batch_id)
        };
        if batch.is_some_and(|b| b.span.name == "raft.batch")
            && child("raft.fsync")
            && child("raft.replicate")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the linked batch {} ({:?}) with an fsync and a replication under it did not \
             arrive",
            hex(&batch_id),
            batch.map(|b| &b.span.name)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (who, r) in [("follower", &follower_span), ("leader", &leader_span)] {
        let a = &r.span.attributes;
        assert_eq!(attr_str(a, "key").as_deref(), Some("traced"), "{who}");
        assert_eq!(attr_str(a, "client_id").as_deref(), Some("t1"), "{who}");
        assert_eq!(attr_str(a, "request_id").as_deref(), Some("r1"), "{who}");
        assert_eq!(attr_str(a, "outcome").as_deref(), Some("granted"), "{who}");
        assert_eq!(
            attr(a, "fencing_token"),
            Some(AnyValue::IntValue(token as i64)),
            "{who}"
        );
        assert_eq!(
            attr_str(&r.resource, "service.name").as_deref(),
            Some("lock-node"),
            "{who}"
        );
        assert_eq!(
            attr_str(&r.resource, "deployment.environment").as_deref(),
            Some("ci"),
            "{who}"
        );
        assert!(r.span.end_time_unix_nano >= r.span.start_time_unix_nano);
    }
    assert_eq!(
        attr(&follower_span.span.attributes, "forwarded"),
        Some(AnyValue::BoolValue(true))
    );

    // A log line of the request, on the follower and on the leader, carries its trace id and
    // request id.
    for (who, id) in [("follower", follower_id), ("leader", leader)] {
        let node = cluster.nodes.iter().find(|n| n.id == id).expect("node");
        let log = std::fs::read_to_string(node.data_dir.with_extension("log")).unwrap_or_default();
        let line = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|l| {
                l["fields"]["message"] == "request answered" && l["span"]["request_id"] == "r1"
            });
        let Some(line) = line else {
            panic!("no JSON log line of the request on the {who}:\n{log}");
        };
        assert_eq!(line["span"]["trace_id"], TRACE_ID, "{who}: {line}");
        assert_eq!(line["fields"]["outcome"], "granted", "{who}: {line}");
    }
    let spans = collector.spans.lock().expect("lock").clone();
    let election = spans
        .iter()
        .find(|r| r.span.name == "raft.election")
        .expect("an election span");
    assert!(matches!(
        attr(&election.span.attributes, "term"),
        Some(AnyValue::IntValue(t)) if t >= 1
    ));
    let replicate = spans
        .iter()
        .find(|r| r.span.name == "raft.replicate")
        .expect("a replication span");
    for key in ["peer", "entries", "bytes", "lag_entries"] {
        assert!(
            attr(&replicate.span.attributes, key).is_some(),
            "raft.replicate without {key}"
        );
    }

    // The SDK continues the caller's trace; its acquire waits behind a holder, and the grant's
    // span says where it stood in the queue and how long it waited.
    let leader_addr = cluster.nodes[(leader - 1) as usize].client_addr();
    let mut holder = ws_connect(&leader_addr).await;
    let held = ws_request(
        &mut holder,
        &json!({"commandType": 3, "key": "queued", "clientId": "holder", "requestId": "h1",
                "ttl": 30000}),
    )
    .await;
    assert_eq!(held["success"], true, "{held}");
    let sdk = raftlock::client::RaftLockClient::builder()
        .endpoint(follower.clone())
        .client_id("sdk")
        // Through the follower, which forwards: one trace across both nodes.
        .prefer_leader(false)
        .trace_context(|| Some(format!("00-{SDK_TRACE_ID}-{SDK_PARENT_ID}-01")))
        .build()
        .expect("client");
    let waiter = tokio::spawn(async move {
        sdk.try_acquire("queued", Duration::from_secs(30), Duration::from_secs(20))
            .await
            .map(|h| h.map(|h| h.fencing_token()))
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    let released = ws_request(
        &mut holder,
        &json!({"commandType": 4, "key": "queued", "clientId": "holder", "requestId": "h2",
                "fencingToken": held["fencingToken"]}),
    )
    .await;
    assert_eq!(released["success"], true, "{released}");
    let sdk_token = waiter
        .await
        .expect("join")
        .expect("the SDK's acquire answers")
        .expect("the SDK's acquire is granted");

    // lockctl continues the trace named by TRACEPARENT.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockctl"))
        .args([
            "--endpoints",
            &follower,
            "--output",
            "json",
            "acquire",
            "cli-key",
        ])
        .env(
            "TRACEPARENT",
            format!("00-{CLI_TRACE_ID}-{CLI_PARENT_ID}-01"),
        )
        .output()
        .expect("run lockctl");
    assert!(
        out.status.success(),
        "lockctl acquire: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let deadline = Instant::now() + Duration::from_secs(30);
    let (sdk_span, cli_span) = loop {
        let spans = collector.spans.lock().expect("lock").clone();
        let find = |trace: &str, via: &str| {
            spans
                .iter()
                .find(|r| {
                    hex(&r.span.trace_id) == trace
                        && r.span.name == "lock.acquire"
                        && attr_str(&r.span.attributes, "via").as_deref() == Some(via)
                        && attr_str(&r.span.attributes, "outcome").as_deref() == Some("granted")
                })
                .cloned()
        };
        if let (Some(s), Some(c)) = (
            find(SDK_TRACE_ID, "forwarded"),
            find(CLI_TRACE_ID, "websocket"),
        ) {
            break (s, c);
        }
        assert!(
            Instant::now() < deadline,
            "no granted acquire spans in the SDK's and lockctl's traces after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let a = &sdk_span.span.attributes;
    assert_eq!(attr_str(a, "client_id").as_deref(), Some("sdk#1"));
    assert_eq!(
        attr(a, "fencing_token"),
        Some(AnyValue::IntValue(sdk_token as i64))
    );
    assert_eq!(
        attr(a, "queue_position"),
        Some(AnyValue::IntValue(1)),
        "{a:?}"
    );
    assert!(
        matches!(attr(a, "wait_ms"), Some(AnyValue::IntValue(ms)) if ms >= 300),
        "the SDK's acquire waited about 700 ms: {a:?}"
    );
    assert_eq!(hex(&cli_span.span.parent_span_id), CLI_PARENT_ID);
    assert_eq!(attr(&cli_span.span.attributes, "queue_position"), None);

    // An acquire that does not wait for a held lock is answered WAIT_TIMEOUT: a failed span.
    let mut ws = ws_connect(&leader_addr).await;
    let refused = ws_request(
        &mut ws,
        &json!({"commandType": 3, "key": "cli-key", "clientId": "late", "requestId": "w1",
                "ttl": 30000, "waitTimeout": 0}),
    )
    .await;
    assert_eq!(refused["error"]["code"], "WAIT_TIMEOUT", "{refused}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let failed = loop {
        let spans = collector.spans.lock().expect("lock").clone();
        if let Some(r) = spans.iter().find(|r| {
            r.span.name == "lock.acquire"
                && attr_str(&r.span.attributes, "client_id").as_deref() == Some("late")
        }) {
            break r.clone();
        }
        assert!(Instant::now() < deadline, "no span of the refused acquire");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        attr_str(&failed.span.attributes, "error.type").as_deref(),
        Some("WAIT_TIMEOUT")
    );
    // Status code 2 is ERROR in the OTLP protocol.
    assert_eq!(
        failed.span.status.as_ref().map(|s| s.code),
        Some(2),
        "{:?}",
        failed.span.status
    );
    drop(cluster);
    server.abort();
}
