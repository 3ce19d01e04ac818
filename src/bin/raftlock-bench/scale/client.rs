//! The WebSocket client the parts use: connecting, one request and its reply, error codes
//! and the tally of errors.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;

use super::connections::REPLY_TIMEOUT;
use super::Ws;

fn ws_config() -> WebSocketConfig {
    // Small buffers: this process holds up to tens of thousands of these.
    WebSocketConfig::default()
        .read_buffer_size(4096)
        .write_buffer_size(0)
}

pub(super) async fn ws_connect(addr: &str) -> Result<Ws, String> {
    let url = format!("ws://{addr}/ws");
    let connect =
        tokio_tungstenite::connect_async_with_config(url.as_str(), Some(ws_config()), true);
    match tokio::time::timeout(REPLY_TIMEOUT, connect).await {
        Ok(Ok((ws, _))) => Ok(ws),
        Ok(Err(e)) => Err(format!("connect: {e}")),
        Err(_) => Err("connect: timed out".into()),
    }
}

/// Sends one request and waits for the next JSON reply on the connection (one request in flight).
pub(super) async fn request(ws: &mut Ws, frame: Value) -> Result<Value, String> {
    ws.send(Message::text(frame.to_string()))
        .await
        .map_err(|e| format!("send: {e}"))?;
    let reply = async {
        for _ in 0..16 {
            match ws.next().await {
                Some(Ok(Message::Text(t))) => {
                    return serde_json::from_str::<Value>(t.as_str())
                        .map_err(|e| format!("reply: {e}"))
                }
                Some(Ok(Message::Close(_))) | None => return Err("connection closed".into()),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(format!("receive: {e}")),
            }
        }
        Err("no text reply".into())
    };
    tokio::time::timeout(REPLY_TIMEOUT, reply)
        .await
        .map_err(|_| "timeout".to_string())?
}

/// The error code of a reply (`None` when it succeeded).
pub(super) fn error_code(reply: &Value) -> Option<String> {
    if reply["success"].as_bool() == Some(true) {
        None
    } else {
        Some(
            reply["error"]["code"]
                .as_str()
                .unwrap_or("UNKNOWN")
                .to_string(),
        )
    }
}

#[derive(Default)]
pub(super) struct Errors(Mutex<BTreeMap<String, u64>>);

impl Errors {
    pub(super) fn add(&self, what: &str) {
        if let Ok(mut m) = self.0.lock() {
            *m.entry(what.to_string()).or_default() += 1;
        }
    }
    pub(super) fn to_json(&self) -> Value {
        self.0
            .lock()
            .map(|m| json!(m.clone()))
            .unwrap_or(Value::Null)
    }
    pub(super) fn total(&self) -> u64 {
        self.0.lock().map(|m| m.values().sum()).unwrap_or(0)
    }
}
