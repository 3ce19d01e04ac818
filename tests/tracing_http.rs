//! Trace export over OTLP/HTTP and what a node says when export fails, with real lock-node
//! processes: a node told `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf` posts its spans to
//! `/v1/traces` of an HTTP receiver (protobuf bodies, decoded here), and a node whose collector
//! cannot be reached logs the failed export instead of staying silent.
//!
//! Every wait is bounded; everything is on 127.0.0.1.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;
use serde_json::json;

const TRACE_ID: &str = "6e0c63257de34c926f9efcd03899e1a0";
const PARENT_ID: &str = "53995c3f42cd8ad8";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A one-node cluster whose node gets `env` besides its own.
fn node_with(env: &[(&str, &str)]) -> Cluster {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Cluster::start_custom(1, |node| node.env.extend(env.clone()), |_| Vec::new())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_out_over_http_and_a_failed_export_is_logged() {
    // The receiver: POST /v1/traces with a protobuf ExportTraceServiceRequest.
    let received: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let sink = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                    return axum::http::StatusCode::BAD_REQUEST;
                };
                let mut sink = sink.lock().expect("lock");
                for rs in request.resource_spans {
                    for ss in rs.scope_spans {
                        for span in ss.spans {
                            sink.push((span.name.clone(), hex(&span.trace_id)));
                        }
                    }
                }
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let endpoint = format!("http://127.0.0.1:{port}");
    let cluster = node_with(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
    ]);
    // A second node whose collector is a port nobody listens on.
    let closed = format!("http://127.0.0.1:{}", free_port());
    let unreachable = node_with(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &closed),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
    ]);
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    unreachable.wait_for_leader(Duration::from_secs(20)).await;

    for (c, request) in [(&cluster, "h1"), (&unreachable, "u1")] {
        let mut ws = ws_connect(&c.nodes[0].client_addr()).await;
        let reply = ws_request(
            &mut ws,
            &json!({"commandType": 3, "key": "over-http", "clientId": "h", "requestId": request,
                    "ttl": 30000, "traceparent": format!("00-{TRACE_ID}-{PARENT_ID}-01")}),
        )
        .await;
        assert_eq!(reply["success"], true, "{reply}");
    }

    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let spans = received.lock().expect("lock").clone();
        if spans
            .iter()
            .any(|(name, trace)| name == "lock.acquire" && trace == TRACE_ID)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no lock.acquire span in the client's trace over HTTP after 30 s; received {spans:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let log_path = unreachable.nodes[0].data_dir.with_extension("log");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if log
            .lines()
            .any(|l| l.contains("opentelemetry") && l.contains("ExportError"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the node with an unreachable collector logged no failed export:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(cluster);
    drop(unreachable);
    server.abort();
}
