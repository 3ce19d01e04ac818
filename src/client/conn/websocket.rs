//! Opening a WebSocket to a node's `/ws`: the upgrade request with its bearer token, TLS
//! (`wss://`) when configured, and the refusals (401/403) that retrying will not change.

use std::sync::Arc;

/// TLS settings for connections to nodes (`wss://`, `https`): the CAs trusted, and a client
/// certificate when the node asks for one.
pub type TlsConfig = Arc<rustls::ClientConfig>;

/// A WebSocket to a node.
pub(crate) type WsSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The header of a node's answer to the upgrade that says it takes batches (several requests
/// in one frame, as a JSON array) and how many requests one may hold.
const BATCH_HEADER: &str = "raftlock-batch-max";
/// The header with the largest frame the node reads: a batch must fit in it.
const MESSAGE_BYTES_HEADER: &str = "raftlock-max-message-bytes";

/// How a node takes batches: up to `requests` requests in one frame of at most `bytes` bytes.
/// A node of an older release takes none (`requests` 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BatchLimit {
    pub requests: usize,
    pub bytes: usize,
}

/// Opens a WebSocket to a node's `/ws`: over TLS when `tls` is given, with
/// `Authorization: Bearer <auth_token>` when a token is given. Also returns how many requests
/// the node takes in one frame.
pub(crate) async fn open_ws(
    addr: &str,
    auth_token: Option<&str>,
    tls: Option<&TlsConfig>,
    config: Option<tokio_tungstenite::tungstenite::protocol::WebSocketConfig>,
) -> Result<(WsSocket, BatchLimit), OpenError> {
    let request = ws_request(addr, auth_token, tls.is_some()).map_err(OpenError::Request)?;
    let connector = tls.map(|c| tokio_tungstenite::Connector::Rustls(c.clone()));
    tokio_tungstenite::connect_async_tls_with_config(request, config, true, connector)
        .await
        .map(|(socket, response)| {
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
            };
            let limit = match (header(BATCH_HEADER), header(MESSAGE_BYTES_HEADER)) {
                (Some(requests), Some(bytes)) if requests > 1 => BatchLimit { requests, bytes },
                _ => BatchLimit {
                    requests: 1,
                    bytes: 0,
                },
            };
            (socket, limit)
        })
        .map_err(|e| match e {
            tokio_tungstenite::tungstenite::Error::Http(response)
                if matches!(response.status().as_u16(), 401 | 403) =>
            {
                refused_upgrade(response.status().as_u16(), response.body().as_deref())
            }
            other => OpenError::Connect(other.to_string()),
        })
}

/// A node that authenticates clients answers a WebSocket upgrade without a valid token 401
/// (403 for a token without the right), with `{"error": {"code", "message"}}`.
fn refused_upgrade(status: u16, body: Option<&[u8]>) -> OpenError {
    let error = body
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
        .map(|v| v["error"].clone());
    let text = |field: &str, default: &str| {
        error
            .as_ref()
            .and_then(|e| e[field].as_str())
            .unwrap_or(default)
            .to_string()
    };
    let default_code = if status == 403 {
        "PERMISSION_DENIED"
    } else {
        "UNAUTHENTICATED"
    };
    OpenError::Refused(crate::client::ClientError::Rejected {
        code: text("code", default_code),
        message: text("message", "the node refused the connection"),
    })
}

/// Why [`open_ws`] failed: a request that cannot be made (bad address or token), or a
/// connection that failed.
#[derive(Debug)]
pub(crate) enum OpenError {
    Request(String),
    Connect(String),
    /// The node answered the upgrade with a refusal that retrying will not change (a missing
    /// or wrong bearer token).
    Refused(crate::client::ClientError),
}

/// The WebSocket upgrade request for a node's `/ws`, with `Authorization: Bearer <auth_token>`
/// when a token is given.
fn ws_request(
    addr: &str,
    auth_token: Option<&str>,
    secure: bool,
) -> Result<tokio_tungstenite::tungstenite::handshake::client::Request, String> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let scheme = if secure { "wss" } else { "ws" };
    let mut request = format!("{scheme}://{addr}/ws")
        .into_client_request()
        .map_err(|e| format!("bad address {addr}: {e}"))?;
    if let Some(token) = auth_token {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| "the auth token is not a valid header value".to_string())?;
        request.headers_mut().insert("authorization", value);
    }
    Ok(request)
}
