//! `RaftLockClient::watch`: a stream of lock events (granted, queued, released, expired, renewed,
//! cancelled, and leader changes) under a key prefix, from any node, that resumes where it left
//! off when its connection drops.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use super::error::ClientError;

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// One event of a watch.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchEvent {
    /// `granted`, `queued`, `released`, `expired`, `renewed`, `cancelled`, `proclaimed` (an
    /// election's leader shows a value) or `leader` (the cluster's Raft leader).
    pub event: String,
    /// The log index of the command behind a lock event; for `leader`, the node's applied index.
    pub index: u64,
    #[serde(default)]
    pub key: Option<String>,
    /// The client the event is about (the holder, or the waiter).
    #[serde(default)]
    pub client: Option<String>,
    #[serde(default)]
    pub token: Option<u64>,
    /// For `queued`: the place in line (1 = next).
    #[serde(default)]
    pub position: Option<u32>,
    /// For `leader`.
    #[serde(default)]
    pub leader_id: Option<u64>,
    #[serde(default)]
    pub term: Option<u64>,
    /// For `proclaimed`: the value an election's leader shows.
    #[serde(default)]
    pub value: Option<String>,
}

/// A running watch. [`Watch::next`] yields events in log order; after a lost connection it
/// reconnects (to the next endpoint) and resumes after the last lock event it yielded, so none is
/// lost or repeated while the nodes still keep them.
pub struct Watch {
    endpoints: Vec<String>,
    auth_token: Option<String>,
    tls: Option<super::conn::TlsConfig>,
    prefix: String,
    /// The index of the last lock event yielded (or the watch's start).
    last: Option<u64>,
    /// Lock events yielded with index `last` (several events can share one index: a release and
    /// the grant it hands on).
    seen_at_last: usize,
    /// After a reconnect: events of index `last` still to skip (already yielded).
    skip_at_last: usize,
    socket: Option<Socket>,
    next_endpoint: usize,
    connect_timeout: Duration,
    seq: u64,
}

impl Watch {
    pub(crate) async fn start(
        endpoints: Vec<String>,
        auth_token: Option<String>,
        tls: Option<super::conn::TlsConfig>,
        prefix: &str,
        from_index: Option<u64>,
        connect_timeout: Duration,
    ) -> Result<Watch, ClientError> {
        let mut w = Watch {
            endpoints,
            auth_token,
            tls,
            prefix: prefix.to_string(),
            last: from_index,
            seen_at_last: 0,
            skip_at_last: 0,
            socket: None,
            next_endpoint: 0,
            connect_timeout,
            seq: 0,
        };
        w.connect().await?;
        Ok(w)
    }

    /// The index to resume from: the last lock event seen (or the watch's start).
    pub fn last_index(&self) -> Option<u64> {
        self.last
    }

    /// Opens a socket on some endpoint and starts the watch there.
    async fn connect(&mut self) -> Result<(), ClientError> {
        let mut last_error = String::from("no endpoints");
        for _ in 0..self.endpoints.len() {
            let addr = self.endpoints[self.next_endpoint % self.endpoints.len()].clone();
            self.next_endpoint += 1;
            match self.open(&addr).await {
                Ok(socket) => {
                    self.socket = Some(socket);
                    return Ok(());
                }
                Err(StartError::Refused(e)) => return Err(e),
                Err(StartError::Failed(e)) => last_error = e,
            }
        }
        Err(ClientError::Unavailable {
            attempts: self.endpoints.len() as u32,
            elapsed: Duration::ZERO,
            last: last_error,
        })
    }

    async fn open(&mut self, addr: &str) -> Result<Socket, StartError> {
        let failed = |e: String| StartError::Failed(format!("{addr}: {e}"));
        let connect =
            super::conn::open_ws(addr, self.auth_token.as_deref(), self.tls.as_ref(), None);
        let (mut socket, _) = tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| failed("connect timed out".into()))?
            .map_err(|e| match e {
                super::conn::OpenError::Request(e) => StartError::Refused(ClientError::Config(e)),
                super::conn::OpenError::Connect(e) => failed(e),
                super::conn::OpenError::Refused(e) => StartError::Refused(e),
            })?;
        self.seq += 1;
        let mut body = json!({"commandType": 8, "requestId": format!("watch-{}", self.seq),
                              "key": self.prefix});
        // Resume from just before the last index seen, so that an index whose events were only
        // partly yielded is sent again; the ones already yielded are skipped on arrival.
        self.skip_at_last = self.seen_at_last;
        if let Some(last) = self.last {
            let from = if self.seen_at_last > 0 {
                last.saturating_sub(1)
            } else {
                last
            };
            body["fromIndex"] = json!(from);
        }
        socket
            .send(Message::Text(body.to_string().into()))
            .await
            .map_err(|e| failed(e.to_string()))?;
        // The first answer says whether the watch started.
        loop {
            let frame = tokio::time::timeout(self.connect_timeout, socket.next())
                .await
                .map_err(|_| failed("no answer to the watch".into()))?;
            let Some(Ok(Message::Text(text))) = frame else {
                if matches!(frame, Some(Ok(_))) {
                    continue;
                }
                return Err(failed("connection closed".into()));
            };
            let v: Value = serde_json::from_str(&text).map_err(|e| failed(e.to_string()))?;
            if v["watching"] == true {
                if self.last.is_none() {
                    self.last = v["index"].as_u64();
                }
                return Ok(socket);
            }
            let code = v["error"]["code"].as_str().unwrap_or("").to_string();
            let message = v["error"]["message"].as_str().unwrap_or("").to_string();
            if super::error::is_retryable_code(&code) {
                return Err(failed(format!("{code}: {message}")));
            }
            return Err(StartError::Refused(ClientError::Rejected { code, message }));
        }
    }

    /// The next event; `None` never (a watch runs until dropped) unless it cannot reconnect, in
    /// which case the error says why. Reconnects at most once per endpoint before giving up.
    pub async fn next(&mut self) -> Option<Result<WatchEvent, ClientError>> {
        loop {
            if self.socket.is_none() {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if let Err(e) = self.connect().await {
                    return Some(Err(e));
                }
            }
            let socket = self.socket.as_mut()?;
            match socket.next().await {
                Some(Ok(Message::Text(text))) => {
                    let Ok(v) = serde_json::from_str::<Value>(&text) else {
                        continue;
                    };
                    if v["event"] == "lagged" {
                        // The node ended the watch: start again from what we saw.
                        self.socket = None;
                        continue;
                    }
                    match serde_json::from_value::<WatchEvent>(v.clone()) {
                        Ok(e) => {
                            if e.event != "leader" {
                                match self.last {
                                    Some(l) if e.index < l => continue,
                                    Some(l) if e.index == l => {
                                        if self.skip_at_last > 0 {
                                            // Yielded before the reconnect.
                                            self.skip_at_last -= 1;
                                            continue;
                                        }
                                        self.seen_at_last += 1;
                                    }
                                    _ => {
                                        self.last = Some(e.index);
                                        self.seen_at_last = 1;
                                        self.skip_at_last = 0;
                                    }
                                }
                            }
                            return Some(Ok(e));
                        }
                        Err(_) => continue,
                    }
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => self.socket = None,
            }
        }
    }
}

enum StartError {
    /// The node said no for a reason retrying will not change (auth, a resume point too old).
    Refused(ClientError),
    Failed(String),
}
