//! Asking the lock cluster whether a fencing token is current, for a data store without a
//! fencing key (`--lock-cluster`).
//!
//! ```text
//!   write {key, token > highest seen}
//!      │
//!      ├─► GET /status   on the last known leader, else each endpoint in turn
//!      │                 (a follower names the leader's client address: asked next)
//!      └─► GET /locks?prefix=<key>   on the leader: is <key> held, with exactly <token>?
//! ```
//!
//! Only tokens above the highest the store has accepted for a key are asked about; once accepted
//! a token is the new highest, so the same holder's further writes cost nothing. The answer is a
//! value ([`Verdict`]); anything that keeps the store from getting one (no leader, a timeout,
//! refused credentials, fencing tokens hidden from our identity) is [`Verdict::Unavailable`],
//! and the write is refused: the store fails closed.
//!
//! Plain HTTP only: a cluster whose client port speaks TLS cannot be asked (yet).

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

/// What the lock cluster says about a token.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The token is the current holder's for this key.
    Holder,
    /// It is not: the reason says what the cluster holds instead.
    NotHolder(String),
    /// The cluster could not be asked, or would not say.
    Unavailable(String),
}

/// Largest answer read from a node.
const MAX_ANSWER_BYTES: u64 = 4 << 20;
/// Token checks in flight at once; more are refused `Unavailable` (a flood of forged tokens
/// must not turn into a flood of requests to the lock cluster).
const MAX_CHECKS_IN_FLIGHT: usize = 64;

/// The lock nodes' client ports, and how to ask them.
pub struct LockCluster {
    endpoints: Vec<String>,
    auth_token: Option<String>,
    timeout: Duration,
    /// The client address of the node that last answered as leader: asked first.
    leader: std::sync::Mutex<Option<String>>,
    in_flight: Semaphore,
}

impl std::fmt::Debug for LockCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockCluster")
            .field("endpoints", &self.endpoints)
            .field("auth_token", &self.auth_token.as_ref().map(|_| "…"))
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl LockCluster {
    /// `spec`: comma-separated `http://host:port` (or bare `host:port`) client addresses.
    pub fn new(
        spec: &str,
        auth_token: Option<String>,
        timeout: Duration,
    ) -> Result<LockCluster, String> {
        let mut endpoints = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if item.starts_with("https://") {
                return Err(format!(
                    "--lock-cluster {item}: https is not supported yet; give the nodes' plain \
                     HTTP client addresses (http://host:port)"
                ));
            }
            let addr = item.strip_prefix("http://").unwrap_or(item);
            let addr = addr.trim_end_matches('/');
            if addr.is_empty() || addr.contains('/') || !addr.contains(':') {
                return Err(format!(
                    "--lock-cluster {item}: expected http://host:port (a lock node's client port)"
                ));
            }
            endpoints.push(addr.to_string());
        }
        if endpoints.is_empty() {
            return Err("--lock-cluster names no address".into());
        }
        if auth_token
            .as_deref()
            .is_some_and(|t| t.contains(['\r', '\n']))
        {
            return Err("the lock cluster token contains a line break".into());
        }
        Ok(LockCluster {
            endpoints,
            auth_token,
            timeout,
            leader: std::sync::Mutex::new(None),
            in_flight: Semaphore::new(MAX_CHECKS_IN_FLIGHT),
        })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Whether `token` is the current holder's fencing token for `key`, asked of the leader
    /// within the timeout. A token the cluster does not show as current is asked once more after
    /// a short pause, in case the node that answered had not applied the grant yet (a leader
    /// that just took over).
    pub async fn check(&self, key: &str, token: u64) -> Verdict {
        let Ok(_permit) = self.in_flight.try_acquire() else {
            return Verdict::Unavailable(format!(
                "{MAX_CHECKS_IN_FLIGHT} fencing-token checks are already in flight"
            ));
        };
        let deadline = tokio::time::Instant::now() + self.timeout;
        let first = match tokio::time::timeout_at(deadline, self.ask(key, token)).await {
            Ok(v) => v,
            Err(_) => return self.timed_out(),
        };
        let Verdict::NotHolder(_) = first else {
            return first;
        };
        let pause = Duration::from_millis(100);
        if tokio::time::Instant::now() + pause >= deadline {
            return first;
        }
        tokio::time::sleep(pause).await;
        match tokio::time::timeout_at(deadline, self.ask(key, token)).await {
            Ok(v) => v,
            Err(_) => first,
        }
    }

    fn timed_out(&self) -> Verdict {
        Verdict::Unavailable(format!(
            "the lock cluster ({}) did not answer within {:?}",
            self.endpoints.join(","),
            self.timeout
        ))
    }

    async fn ask(&self, key: &str, token: u64) -> Verdict {
        let mut last = String::from("no lock node answered");
        let cached = self.leader.lock().ok().and_then(|l| l.clone());
        let candidates = cached.iter().chain(self.endpoints.iter());
        for candidate in candidates {
            let leader = match self.leader_via(candidate).await {
                Ok(leader) => leader,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            match self.ask_leader(&leader, key, token).await {
                Ok(verdict) => {
                    if let Ok(mut l) = self.leader.lock() {
                        *l = Some(leader);
                    }
                    return verdict;
                }
                Err(e) => last = e,
            }
        }
        if let Ok(mut l) = self.leader.lock() {
            *l = None;
        }
        Verdict::Unavailable(format!("cannot ask the lock cluster: {last}"))
    }

    /// The client address of the leader, as `addr` knows it (itself, or the one it names).
    async fn leader_via(&self, addr: &str) -> Result<String, String> {
        let status = self.get_json(addr, "/status").await?;
        if status["role"] == "leader" {
            return Ok(addr.to_string());
        }
        let named = status["leaderAddr"].as_str().unwrap_or("");
        if named.is_empty() || named == addr {
            return Err(format!("{addr} knows no leader"));
        }
        let status = self.get_json(named, "/status").await?;
        if status["role"] == "leader" {
            Ok(named.to_string())
        } else {
            Err(format!(
                "{addr} names {named} as leader, which says it is not"
            ))
        }
    }

    /// `Err` means "ask elsewhere"; a verdict (also `Unavailable`) is final.
    async fn ask_leader(&self, leader: &str, key: &str, token: u64) -> Result<Verdict, String> {
        let path = format!("/locks?prefix={}", percent_encode(key));
        let (status, body) = self.get(leader, &path).await?;
        if status == 401 || status == 403 {
            return Ok(Verdict::Unavailable(format!(
                "the lock cluster refused the data store's credentials (HTTP {status}): \
                 --lock-cluster-token-file must hold an admin identity's token"
            )));
        }
        if status != 200 {
            return Err(format!("{leader}{path}: HTTP {status}"));
        }
        let answer: Value =
            serde_json::from_str(&body).map_err(|e| format!("{leader}{path}: {e}"))?;
        let Some(locks) = answer["locks"].as_array() else {
            return Err(format!("{leader}{path}: no `locks` in the answer"));
        };
        // The listing is in key order and starts at the prefix: the key itself comes first.
        let lock = locks.iter().find(|l| l["key"] == key);
        let Some(lock) = lock.filter(|l| !l["holder"].is_null()) else {
            return Ok(Verdict::NotHolder("the lock is not held".into()));
        };
        let Some(current) = lock.get("fencingToken") else {
            return Ok(Verdict::Unavailable(
                "the lock cluster hides fencing tokens from the data store's identity: \
                 --lock-cluster-token-file must hold an admin identity's token"
                    .into(),
            ));
        };
        Ok(match current.as_u64() {
            Some(current) if current == token => Verdict::Holder,
            Some(current) => {
                Verdict::NotHolder(format!("the lock is held with fencing token {current}"))
            }
            None => Verdict::NotHolder("the lock is held without a fencing token".into()),
        })
    }

    async fn get_json(&self, addr: &str, path: &str) -> Result<Value, String> {
        let (status, body) = self.get(addr, path).await?;
        if status != 200 {
            return Err(format!("{addr}{path}: HTTP {status}"));
        }
        serde_json::from_str(&body).map_err(|e| format!("{addr}{path}: {e}"))
    }

    /// One HTTP/1.1 GET with `Connection: close`: (status, body).
    async fn get(&self, addr: &str, path: &str) -> Result<(u16, String), String> {
        let auth = self
            .auth_token
            .as_deref()
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let exchange = async {
            let mut tcp = tokio::net::TcpStream::connect(addr).await?;
            let head =
                format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}\r\n");
            tcp.write_all(head.as_bytes()).await?;
            let mut buf = Vec::new();
            (&mut tcp)
                .take(MAX_ANSWER_BYTES + 1)
                .read_to_end(&mut buf)
                .await?;
            Ok::<_, std::io::Error>(buf)
        };
        let buf = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| format!("{addr} did not answer within {:?}", self.timeout))?
            .map_err(|e| format!("{addr}: {e}"))?;
        if buf.len() as u64 > MAX_ANSWER_BYTES {
            return Err(format!(
                "{addr}{path}: answer larger than {MAX_ANSWER_BYTES} bytes"
            ));
        }
        parse_answer(&buf).ok_or_else(|| format!("{addr}{path}: malformed HTTP answer"))
    }
}

fn parse_answer(buf: &[u8]) -> Option<(u16, String)> {
    let text = std::str::from_utf8(buf).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Some((
        status,
        if chunked {
            dechunk(body)?
        } else {
            body.to_string()
        },
    ))
}

fn dechunk(mut rest: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(after.get(..n)?);
        rest = after.get(n..)?.strip_prefix("\r\n")?;
    }
}

/// `key` for a query string: everything but unreserved characters percent-encoded.
fn percent_encode(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_plain_http_addresses() {
        let c =
            LockCluster::new("http://a:50051, b:50052/,,", None, Duration::from_secs(1)).unwrap();
        assert_eq!(c.endpoints(), ["a:50051", "b:50052"]);
        assert!(
            LockCluster::new("https://a:1", None, Duration::from_secs(1))
                .unwrap_err()
                .contains("https")
        );
        assert!(LockCluster::new("", None, Duration::from_secs(1)).is_err());
        assert!(LockCluster::new("http://a/x:1", None, Duration::from_secs(1)).is_err());
        assert!(LockCluster::new("a:1", Some("t\r\nX: y".into()), Duration::from_secs(1)).is_err());
    }

    #[test]
    fn keys_are_percent_encoded() {
        assert_eq!(
            percent_encode("orders/eu 1&x=%"),
            "orders%2Feu%201%26x%3D%25"
        );
        assert_eq!(percent_encode("é"), "%C3%A9");
    }

    #[test]
    fn answers_parse_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_answer(plain), Some((200, "{}".into())));
        let chunked =
            b"HTTP/1.1 401 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n1\r\nd\r\n0\r\n\r\n";
        assert_eq!(parse_answer(chunked), Some((401, "abcd".into())));
        assert_eq!(parse_answer(b"garbage"), None);
    }

    #[tokio::test]
    async fn an_unreachable_cluster_is_unavailable_within_the_timeout() {
        // A port nothing listens on (bound, then released).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let c = LockCluster::new(
            &format!("127.0.0.1:{port}"),
            None,
            Duration::from_millis(500),
        )
        .unwrap();
        let started = std::time::Instant::now();
        let verdict = c.check("k", 1).await;
        assert!(matches!(verdict, Verdict::Unavailable(_)), "{verdict:?}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
