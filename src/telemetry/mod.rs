//! Metrics, logging and trace export shared by the binaries.
//!
//! Traces go out over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and `OTEL_SDK_DISABLED` is not `true`; the
//! OpenTelemetry SDK reads the other standard variables itself (`OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`). Without an
//! endpoint no span leaves the process and the node's own spans are not even created: they are
//! at `debug` level, which the log filter leaves off by default.
//!
//! Trace context travels in the W3C `traceparent` format: a WebSocket request's `traceparent`
//! field, gRPC metadata `traceparent`, and the peer call that forwards a request to the leader.

pub mod metrics;

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use metrics::NodeMetrics;

/// Keeps the trace exporter alive; dropping it sends the spans still buffered.
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl std::fmt::Debug for TelemetryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetryGuard")
            .field("exporting", &self.provider.is_some())
            .finish()
    }
}

impl TelemetryGuard {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = provider.force_flush();
            let _ = provider.shutdown();
        }
    }
}

/// Whether the environment asks for trace export.
pub fn otlp_configured() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled =
        std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Installs the `tracing` subscriber (a `RUST_LOG`-style filter, text or JSON lines on stderr)
/// without trace export.
pub fn init_logging(json: bool, default_filter: &str) {
    let _ = init(json, default_filter, None);
}

/// Installs logging and, when the environment configures OTLP, trace export for `service`
/// (the default `service.name`; `OTEL_SERVICE_NAME` wins). Must run inside a Tokio runtime
/// when export is on (the gRPC exporter needs one). JSON log lines carry the fields of the spans
/// they are in, including `trace_id` on client requests.
pub fn init(json: bool, default_filter: &str, service: Option<&str>) -> TelemetryGuard {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json().with_current_span(true).boxed()
    } else {
        fmt.boxed()
    };
    let mut provider = None;
    let mut otel_layer = None;
    if let Some(service) = service.filter(|_| otlp_configured()) {
        match build_provider(service) {
            Ok(p) => {
                let tracer = p.tracer("raftlock");
                // The node's spans are at debug level; the log filter does not gate them.
                let spans = EnvFilter::new("warn,raftlock=debug");
                otel_layer = Some(
                    tracing_opentelemetry::layer()
                        .with_tracer(tracer)
                        .with_filter(spans),
                );
                opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
                provider = Some(p);
            }
            Err(err) => eprintln!("trace export is off: {err}"),
        }
    }
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel_layer)
        .try_init();
    TelemetryGuard { provider }
}

fn build_provider(service: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| e.to_string())?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(service.to_string());
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// Makes `span` a child of the W3C `traceparent` a client or peer sent (ignored when absent or
/// malformed), and records its trace id as the span's `trace_id` field (for JSON logs).
pub fn adopt_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(tp) = traceparent.filter(|t| !t.is_empty() && t.len() <= 128) {
        let carrier = HashMap::from([("traceparent".to_string(), tp.to_string())]);
        let cx = TraceContextPropagator::new().extract(&carrier);
        let _ = span.set_parent(cx);
    }
    record_trace_id(span);
}

/// Records the span's OpenTelemetry trace id in its `trace_id` field, if it has one.
pub fn record_trace_id(span: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt;
    let cx = span.context();
    let id = cx.span().span_context().trace_id();
    if id != opentelemetry::trace::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(id));
    }
}

/// The W3C `traceparent` of `span`, to send on to the next hop (None when not traced).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    let mut carrier: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.remove("traceparent")
}
