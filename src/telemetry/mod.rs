//! Metrics, logging and trace export shared by the binaries.
//!
//! Traces go out over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, `OTEL_SDK_DISABLED` is not `true` and
//! `OTEL_TRACES_EXPORTER` is `otlp` (the default) rather than `none`;
//! `OTEL_EXPORTER_OTLP_PROTOCOL` (or `…_TRACES_PROTOCOL`) may be `grpc` (the default) or
//! `http/protobuf`, and
//! `OTEL_PROPAGATORS` may be `tracecontext` (the default) or `none`: anything else turns trace
//! export off with a log line that says why. The OpenTelemetry SDK reads the other standard
//! variables itself (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
//! `OTEL_TRACES_SAMPLER_ARG`). Without an endpoint no span leaves the process and the node's
//! own spans are not even created: they are at `debug` level, which the log filter leaves off
//! by default. A failed export is logged (target `opentelemetry_sdk`).
//!
//! Trace context travels in the W3C `traceparent` format: a WebSocket request's `traceparent`
//! field, gRPC metadata `traceparent`, and the peer call that forwards a request to the leader.

pub mod metrics;
mod otlp_http;

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

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

/// Whether a `traceparent` is taken from callers and passed on (`OTEL_PROPAGATORS` is not
/// `none`).
static PROPAGATE: AtomicBool = AtomicBool::new(true);

/// Whether the environment asks for trace export.
pub fn otlp_configured() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled =
        std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let exporter_none =
        std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.trim().eq_ignore_ascii_case("none"));
    !disabled
        && !exporter_none
        && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Why the standard `OTEL_*` variables ask for something this build cannot do, if they do.
/// Reads `OTEL_TRACES_EXPORTER`, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (then
/// `OTEL_EXPORTER_OTLP_PROTOCOL`) and `OTEL_PROPAGATORS`.
pub fn otel_env_problem(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    let value = |name: &str| var(name).map(|v| v.trim().to_ascii_lowercase());
    if let Some(exporter) = value("OTEL_TRACES_EXPORTER") {
        if exporter != "otlp" && exporter != "none" && !exporter.is_empty() {
            return Some(format!(
                "OTEL_TRACES_EXPORTER={exporter} is not supported (otlp or none)"
            ));
        }
    }
    let protocol = value("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| value("OTEL_EXPORTER_OTLP_PROTOCOL"));
    if let Some(protocol) =
        protocol.filter(|p| !p.is_empty() && p != "grpc" && p != "http/protobuf")
    {
        return Some(format!(
            "OTLP protocol {protocol} is not supported: grpc (port 4317 on a collector) or \
             http/protobuf (port 4318)"
        ));
    }
    if let Some(propagators) = value("OTEL_PROPAGATORS") {
        for p in propagators.split(',').map(str::trim) {
            if !matches!(p, "tracecontext" | "none" | "baggage" | "") {
                return Some(format!(
                    "OTEL_PROPAGATORS names {p}: only tracecontext (W3C traceparent) is \
                     supported"
                ));
            }
        }
    }
    None
}

/// Whether `OTEL_PROPAGATORS` leaves trace context on (anything but `none` alone).
fn propagators_on(var: impl Fn(&str) -> Option<String>) -> bool {
    var("OTEL_PROPAGATORS").is_none_or(|v| !v.trim().eq_ignore_ascii_case("none"))
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
    use tracing_subscriber::filter::FilterExt;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let env = |name: &str| std::env::var(name).ok();
    PROPAGATE.store(propagators_on(env), Ordering::Relaxed);
    let problem = service.and_then(|_| otel_env_problem(env));
    let exporting = service.is_some() && otlp_configured() && problem.is_none();
    // Colour codes only on a terminal: logs sent to a file or a collector stay plain text.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let fmt = if json {
        fmt.json()
            .with_current_span(true)
            .with_span_list(false)
            .boxed()
    } else {
        fmt.boxed()
    };
    // While traces are exported, the request span (debug level) is kept for the log lines too:
    // a line logged while a request runs carries its request_id and trace_id. Without export it
    // is not made for the log alone (it cost about a seventh of the throughput with JSON logs);
    // RUST_LOG=raftlock::server::exec=debug turns it on.
    let request_spans = exporting;
    // Each filter says the most verbose level it can let through. Without that hint the
    // subscriber's level is TRACE, the bridge from the `log` crate then passes every debug and
    // trace record of the dependencies (the WebSocket library's, sled's) into the filters to be
    // dropped there: that was a third of the leader's instructions per lock cycle
    // (docs/bench/cpu-budget.md, "metrics and tracing").
    use tracing_subscriber::filter::LevelFilter;
    let span_level = if request_spans {
        LevelFilter::DEBUG
    } else {
        LevelFilter::OFF
    };
    let fmt_filter = filter.or(tracing_subscriber::filter::filter_fn(move |meta| {
        request_spans && meta.is_span() && meta.name() == "lock.request"
    })
    .with_max_level_hint(span_level));
    let mut provider = None;
    let mut otel_layer = None;
    if let Some(service) = service.filter(|_| exporting) {
        match build_provider(service) {
            Ok(p) => {
                let tracer = p.tracer("raftlock");
                // The node's spans are at debug level; the log filter does not gate them. The
                // SDK's own logs (a failed export) go to the log, never into a trace.
                let spans = EnvFilter::new(
                    "warn,raftlock=debug,opentelemetry=off,opentelemetry_sdk=off,\
                     opentelemetry_otlp=off,opentelemetry-otlp=off",
                );
                // Spans, and events from info up (a debug log line is not a span event).
                let events = tracing_subscriber::filter::filter_fn(|meta| {
                    meta.is_span() || *meta.level() <= tracing::Level::INFO
                })
                .with_max_level_hint(LevelFilter::DEBUG);
                otel_layer = Some(
                    tracing_opentelemetry::layer()
                        .with_tracer(tracer)
                        .with_filter(spans.and(events)),
                );
                opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
                provider = Some(p);
            }
            Err(err) => eprintln!("trace export is off: {err}"),
        }
    }
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(fmt_filter))
        .with(otel_layer)
        .try_init();
    if let Some(problem) = problem {
        tracing::warn!(%problem, "trace export is off");
    }
    TelemetryGuard { provider }
}

/// Whether the standard variables ask for OTLP over HTTP (`http/protobuf`) rather than gRPC.
fn http_protocol(var: impl Fn(&str) -> Option<String>) -> bool {
    var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .is_some_and(|p| p.trim().eq_ignore_ascii_case("http/protobuf"))
}

fn build_provider(service: &str) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    let exporter = if http_protocol(|name| std::env::var(name).ok()) {
        let client =
            otlp_http::RuntimeHttpClient::on_current_runtime(std::time::Duration::from_secs(10))?;
        opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_http_client(client)
            .build()
    } else {
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
    }
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
    let traceparent = traceparent.filter(|_| PROPAGATE.load(Ordering::Relaxed));
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
    if !PROPAGATE.load(Ordering::Relaxed) {
        return None;
    }
    let mut carrier: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.remove("traceparent")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(set: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            set.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn standard_variables_are_honoured_or_refused_with_a_reason() {
        assert_eq!(otel_env_problem(vars(&[])), None);
        for ok in [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "GRPC"),
            ("OTEL_TRACES_EXPORTER", "none"),
            ("OTEL_TRACES_EXPORTER", "otlp"),
            ("OTEL_PROPAGATORS", "tracecontext,baggage"),
            ("OTEL_PROPAGATORS", "none"),
        ] {
            assert_eq!(otel_env_problem(vars(&[ok])), None, "{ok:?}");
        }
        for refused in [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "udp"),
            ("OTEL_TRACES_EXPORTER", "zipkin"),
            ("OTEL_PROPAGATORS", "tracecontext,b3"),
        ] {
            let why = otel_env_problem(vars(&[refused])).expect("refused");
            assert!(
                why.contains(&refused.1.to_ascii_lowercase().replace("tracecontext,", "")),
                "{why}"
            );
        }
        // The traces-specific protocol wins over the general one.
        assert_eq!(
            otel_env_problem(vars(&[
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
            ])),
            None
        );
        assert!(http_protocol(vars(&[(
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "HTTP/protobuf"
        )])));
        assert!(!http_protocol(vars(&[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
        ])));
        assert!(!http_protocol(vars(&[])));
        assert!(propagators_on(vars(&[])));
        assert!(propagators_on(vars(&[(
            "OTEL_PROPAGATORS",
            "tracecontext"
        )])));
        assert!(!propagators_on(vars(&[("OTEL_PROPAGATORS", " None ")])));
    }
}
