//! The wire protocol as the SDK speaks it: requests written from borrowed fields, replies read
//! into the fields the SDK uses, and which reply a caller expects ([`ReplyKind`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_tungstenite::tungstenite::Utf8Bytes;

/// Which reply a waiting caller expects, for the one case where two replies share a
/// `requestId`: cancelling a queued acquire answers both the cancel and the acquire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReplyKind {
    Normal,
    Cancel,
}

/// One request as the SDK sends it (the WebSocket protocol's request object), written straight
/// from borrowed fields: building a `serde_json::Value` first cost every request a map and a
/// copy of each field name and value. Fields left `None` are left out.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Request<'a> {
    pub command_type: u8,
    pub key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<&'a str>,
    pub request_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_timeout: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<TokenRef<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redirect: Option<bool>,
    /// The client has the answer of each of this owner's requests numbered below this (the
    /// request id is then this request's number).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ack_below: Option<u64>,
    /// A key's lock-delay (ms), for `commandType` 9.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lock_delay: Option<u64>,
    /// A session's id, for `commandType` 13 (0: open one) and 14.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
}

impl<'a> Request<'a> {
    /// A request of `command_type` on `key` with `request_id`, every other field left out.
    pub fn new(command_type: u8, key: &'a str, request_id: &'a str) -> Self {
        Request {
            command_type,
            key,
            client_id: None,
            request_id,
            ttl: None,
            wait_timeout: None,
            fencing_token: None,
            value: None,
            traceparent: None,
            redirect: None,
            ack_below: None,
            lock_delay: None,
            session: None,
            mode: None,
            permits: None,
        }
    }

    /// The request as it goes on the wire.
    pub(super) fn text(&self) -> Utf8Bytes {
        serde_json::to_string(self)
            .expect("a request of strings and numbers serializes")
            .into()
    }
}

/// A fencing token in a request: `{"key": …, "value": …}`.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct TokenRef<'a> {
    pub key: &'a str,
    pub value: u64,
}

/// A node's reply, as far as the SDK reads it, with the text it came in (for error messages).
/// Read into this shape once, on the connection's reader task, instead of into a
/// `serde_json::Value` whose map and strings each request then paid for.
#[derive(Debug)]
pub(crate) struct Reply {
    pub body: ReplyBody,
    pub raw: Utf8Bytes,
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.raw.as_str())
    }
}

/// The fields of a reply the SDK uses; any others are skipped.
/// Every field may be missing (its default then).
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct ReplyBody {
    pub success: bool,
    pub request_id: Option<String>,
    pub cancelled: Option<bool>,
    pub expires_in_ms: Option<u64>,
    pub fencing_token: Option<TokenReply>,
    pub value: Option<String>,
    pub lock_delay: Option<u64>,
    /// A semaphore's size (the answer to setting it).
    pub permits: Option<u32>,
    /// A leader read: the leader's client id (`null`, read as `None`, while no one leads).
    pub leader: Option<String>,
    pub candidates: Option<u32>,
    /// A keepalive's session id, and the locks a session's end ended.
    pub session: Option<u64>,
    pub locks: Option<u32>,
    pub error: Option<ErrorReply>,
    /// Set by the SDK, not the node: the reply carried this request's id but fields of types
    /// the SDK does not know (answered as a protocol error instead of never).
    #[serde(skip)]
    pub malformed: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct TokenReply {
    pub value: Option<u64>,
    pub mac: Option<String>,
    /// A permit's slot.
    pub slot: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct ErrorReply {
    pub code: String,
    pub message: String,
    pub leader_addr: Option<String>,
}

/// Reads a reply's text: `None` when it names no request (not JSON, or no string `requestId`).
pub(super) fn parse_reply(raw: Utf8Bytes) -> Option<(String, Reply)> {
    let (id, body) = match serde_json::from_str::<ReplyBody>(raw.as_str()) {
        Ok(mut body) => (body.request_id.take()?, body),
        // A field of an unexpected type: the request it names still gets an answer, an error.
        Err(_) => {
            let value = serde_json::from_str::<Value>(raw.as_str()).ok()?;
            let id = value.get("requestId")?.as_str()?.to_string();
            let body = ReplyBody {
                malformed: true,
                ..ReplyBody::default()
            };
            (id, body)
        }
    };
    Some((id, Reply { body, raw }))
}

impl ReplyBody {
    /// The error code, `""` when there is none.
    pub fn code(&self) -> &str {
        self.error.as_ref().map_or("", |e| e.code.as_str())
    }
}
