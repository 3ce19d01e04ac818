//! A minimal HTTP/1.1 client for RaftLock's own JSON endpoints (`/status`, `/locks`, `/write`),
//! enough for `lockctl` and tests without pulling in a general-purpose HTTP stack.

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot reach {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("I/O with {addr}: {source}")]
    Io {
        addr: String,
        source: std::io::Error,
    },
    #[error("{addr} did not answer within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("malformed HTTP response from {0}")]
    Malformed(String),
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
}

/// Largest response body accepted.
const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// Sends one request and returns (status, body).
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<(u16, String), HttpError> {
    request_as(addr, method, path, body, timeout, None).await
}

/// [`request`] with `Authorization: Bearer <auth_token>` when a token is given.
pub async fn request_as(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
    auth_token: Option<&str>,
) -> Result<(u16, String), HttpError> {
    request_with(addr, method, path, body, timeout, auth_token, None).await
}

/// [`request_as`], over TLS (`https`) when `tls` is given.
pub async fn request_with(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
    auth_token: Option<&str>,
    tls: Option<&super::conn::TlsConfig>,
) -> Result<(u16, String), HttpError> {
    // A token with a line break would smuggle headers: such a token is not sent.
    let auth = auth_token
        .filter(|t| !t.contains(['\r', '\n']))
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let fut = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|source| HttpError::Connect {
                addr: addr.into(),
                source,
            })?;
        let body = body.unwrap_or("");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let io = |source| HttpError::Io {
            addr: addr.into(),
            source,
        };
        let buf = match tls {
            None => exchange(tcp, &head, body).await.map_err(io)?,
            Some(tls) => {
                let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let name =
                    rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| {
                        HttpError::Connect {
                            addr: addr.into(),
                            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
                        }
                    })?;
                let stream = tokio_rustls::TlsConnector::from(tls.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(|source| HttpError::Connect {
                        addr: addr.into(),
                        source,
                    })?;
                exchange(stream, &head, body).await.map_err(io)?
            }
        };
        if buf.len() > MAX_RESPONSE_BYTES {
            return Err(HttpError::TooLarge(MAX_RESPONSE_BYTES));
        }
        parse_response(addr, &buf)
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| HttpError::Timeout {
            addr: addr.into(),
            timeout,
        })?
}

/// Writes the request and reads the whole answer (up to one byte past the limit).
async fn exchange<S>(mut stream: S, head: &str, body: &str) -> std::io::Result<Vec<u8>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut limited = (&mut stream).take(MAX_RESPONSE_BYTES as u64 + 1);
    limited.read_to_end(&mut buf).await?;
    Ok(buf)
}

fn parse_response(addr: &str, buf: &[u8]) -> Result<(u16, String), HttpError> {
    let text = String::from_utf8_lossy(buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| HttpError::Malformed(addr.into()))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HttpError::Malformed(addr.into()))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        // `get` refuses a length that does not end on a character boundary instead of panicking.
        let (Some(chunk), Some(tail)) = (after.get(..n), after.get(n..)) else {
            break;
        };
        if n == 0 {
            break;
        }
        out.push_str(chunk);
        rest = tail.trim_start_matches("\r\n");
    }
    out
}

/// GET returning JSON (any status; the caller checks).
pub async fn get_json(addr: &str, path: &str) -> Result<(u16, Value), HttpError> {
    get_json_as(addr, path, None).await
}

/// [`get_json`] with `Authorization: Bearer <auth_token>` when a token is given.
pub async fn get_json_as(
    addr: &str,
    path: &str,
    auth_token: Option<&str>,
) -> Result<(u16, Value), HttpError> {
    get_json_with(addr, path, auth_token, None).await
}

/// [`get_json_as`], over TLS (`https`) when `tls` is given.
pub async fn get_json_with(
    addr: &str,
    path: &str,
    auth_token: Option<&str>,
    tls: Option<&super::conn::TlsConfig>,
) -> Result<(u16, Value), HttpError> {
    let (status, body) = request_with(
        addr,
        "GET",
        path,
        None,
        Duration::from_secs(5),
        auth_token,
        tls,
    )
    .await?;
    let value = serde_json::from_str(&body).unwrap_or(Value::String(body));
    Ok((status, value))
}

/// POST a JSON body and return the JSON answer.
pub async fn post_json(addr: &str, path: &str, body: &Value) -> Result<(u16, Value), HttpError> {
    let text = body.to_string();
    let (status, body) = request(addr, "POST", path, Some(&text), Duration::from_secs(5)).await?;
    let value = serde_json::from_str(&body).unwrap_or(Value::String(body));
    Ok((status, value))
}
