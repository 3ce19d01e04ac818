//! OTLP over HTTP (`OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`): the exporter's requests run on
//! the node's Tokio runtime through hyper's client, and the SDK's export thread waits for each
//! one's answer. Plain `http://` endpoints only, as for gRPC.

use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};

/// The most of a collector's answer that is read (the answer to an export is a few bytes).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// An [`HttpClient`] whose requests run on a Tokio runtime, whichever thread asks.
#[derive(Debug, Clone)]
pub struct RuntimeHttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl RuntimeHttpClient {
    /// A client on the runtime of the calling thread; each request is given `timeout`.
    pub fn on_current_runtime(timeout: Duration) -> Result<RuntimeHttpClient, String> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| "OTLP over HTTP needs a Tokio runtime".to_string())?;
        Ok(RuntimeHttpClient {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            runtime,
            timeout,
        })
    }
}

#[async_trait::async_trait]
impl HttpClient for RuntimeHttpClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let timeout = self.timeout;
        let exchange = self.runtime.spawn(async move {
            let (parts, body) = request.into_parts();
            let request = Request::from_parts(parts, Full::new(body));
            let answer = tokio::time::timeout(timeout, client.request(request))
                .await
                .map_err(|_| format!("no answer from the collector within {timeout:?}"))??;
            let (parts, body) = answer.into_parts();
            let body = Limited::new(body, MAX_ANSWER_BYTES)
                .collect()
                .await?
                .to_bytes();
            Ok::<_, HttpError>(Response::from_parts(parts, body))
        });
        exchange.await?
    }
}
