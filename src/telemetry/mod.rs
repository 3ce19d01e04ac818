//! Metrics and logging setup shared by the binaries.

pub mod metrics;

pub use metrics::NodeMetrics;

/// Installs the `tracing` subscriber: `RUST_LOG`-style filter, text or JSON lines on stderr.
pub fn init_logging(json: bool, default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
