//! `raftlock-bench tracing`: what exporting traces costs the hot path. Two three-node RaftLock
//! clusters on loopback, one without trace export (the default) and one exporting every request's
//! spans over OTLP/gRPC (sampler `always_on`) to a receiver in this process that counts them; the
//! same uncontended workload against each in alternation (A B A B), reported as ratios.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

use crate::compare::{start_raftlock, wait_ready, Procs};
use crate::load::{self, ms, LoadResult, LoadSpec, Target, Workload};

pub struct TracingArgs {
    pub clients: Vec<usize>,
    pub seconds: u64,
    pub rounds: usize,
    pub dir: PathBuf,
}

/// An OTLP trace receiver that counts the spans it is sent and keeps nothing.
#[derive(Clone, Default)]
struct CountingReceiver {
    spans: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for CountingReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let n: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.spans.fetch_add(n as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

pub async fn tracing_cost(args: TracingArgs) -> Result<(), String> {
    let receiver = CountingReceiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("OTLP receiver: {e}"))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let off_dir = args.dir.join("tracing-off");
    let on_dir = args.dir.join("tracing-on");
    for d in [&off_dir, &on_dir] {
        let _ = std::fs::remove_dir_all(d);
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut procs = Procs(Vec::new());
    let off = start_raftlock(&off_dir, &mut procs, &[("OTEL_SDK_DISABLED", "true")])?;
    let on = start_raftlock(
        &on_dir,
        &mut procs,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_TRACES_SAMPLER", "always_on"),
        ],
    )?;
    wait_ready(Target::Raftlock, &off).await?;
    wait_ready(Target::Raftlock, &on).await?;
    println!("clusters ready: export off {off:?}, export on {on:?} (receiver {endpoint})");

    let mut rows = Vec::new();
    let mut run = 0;
    for &clients in &args.clients {
        let mut off_total: Option<LoadResult> = None;
        let mut on_total: Option<LoadResult> = None;
        let mut spans = 0;
        for round in 0..args.rounds {
            for (label, endpoints) in [("off", &off), ("on", &on)] {
                run += 1;
                let spec = LoadSpec {
                    target: Target::Raftlock,
                    endpoints: endpoints.clone(),
                    workload: Workload::Uncontended,
                    clients,
                    duration: Duration::from_secs(args.seconds),
                    run_id: format!("t{run}"),
                    timeline: false,
                    acknowledge: false,
                    connections: 0,
                };
                let before = receiver.spans.load(Ordering::Relaxed);
                let r = load::run(&spec).await?;
                print!("round {} export {label}: ", round + 1);
                load::print_result(&spec, &r);
                let total = if label == "off" {
                    &mut off_total
                } else {
                    // Spans still in the exporter's batch arrive later; count what came during
                    // the run.
                    spans += receiver.spans.load(Ordering::Relaxed) - before;
                    &mut on_total
                };
                match total {
                    Some(acc) => acc.merge(&r),
                    None => *total = Some(r),
                }
            }
        }
        let (Some(off_r), Some(on_r)) = (off_total, on_total) else {
            continue;
        };
        rows.push((clients, off_r, on_r, spans));
    }
    drop(procs);
    server.abort();

    println!(
        "\n| clients | export off cycles/s | export on cycles/s | on/off throughput | off p99 ms | on p99 ms | on/off p99 | spans received |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (clients, off_r, on_r, spans) in &rows {
        let p99 = |r: &LoadResult| ms(r.main_hist(Workload::Uncontended).value_at_quantile(0.99));
        println!(
            "| {clients} | {:.0} | {:.0} | {:.2}× | {:.2} | {:.2} | {:.2}× | {spans} |",
            off_r.throughput(),
            on_r.throughput(),
            on_r.throughput() / off_r.throughput().max(1e-9),
            p99(off_r),
            p99(on_r),
            p99(on_r) / p99(off_r).max(1e-9),
        );
    }
    if rows.iter().all(|(_, _, _, spans)| *spans == 0) {
        return Err("the exporting cluster sent no spans: export is not working".into());
    }
    Ok(())
}
