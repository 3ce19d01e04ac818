//! Writing the answers: the JSON of a successful reply or an error, repeating the request's
//! `key` and `requestId` ([`Echo`]), with fencing tokens and their MACs.

use std::borrow::Cow;

use serde_json::{json, Value};

use super::WsRequest;
use crate::fencing::{FencingKey, TokenMode};
use crate::lock::FencingToken;
use crate::node::api::{ApiError, ClientReply, ErrorCode, SharedGrant};

/// What a reply repeats from its request: `key` and `requestId`, as the client sent them.
#[derive(Clone, Debug)]
pub struct Echo<'a> {
    key: EchoValue<'a>,
    request_id: EchoValue<'a>,
}

#[derive(Clone, Debug, serde::Serialize)]
#[serde(untagged)]
enum EchoValue<'a> {
    Json(&'a Value),
    Text(Cow<'a, str>),
}

impl<'a> Echo<'a> {
    /// The fields of a request parsed as JSON (`null` where absent).
    pub fn of(raw: &'a Value) -> Self {
        Echo {
            key: EchoValue::Json(raw.get("key").unwrap_or(&Value::Null)),
            request_id: EchoValue::Json(raw.get("requestId").unwrap_or(&Value::Null)),
        }
    }

    pub(super) fn of_request(request: &WsRequest<'a>) -> Self {
        Echo {
            key: EchoValue::Text(request.key.clone()),
            request_id: request
                .request_id
                .clone()
                .map_or(EchoValue::Json(&Value::Null), EchoValue::Text),
        }
    }
}

pub fn error_json(raw: &Value, e: &ApiError) -> String {
    error_reply(Echo::of(raw), e)
}

/// The error reply to a request whose echoed fields are `echo`.
pub(super) fn error_reply(echo: Echo<'_>, e: &ApiError) -> String {
    let Echo { key, request_id } = echo;
    let mut error = json!({"code": e.code.as_str(), "message": e.message});
    if e.leader_id != 0 {
        error["leaderId"] = json!(e.leader_id);
        error["leaderAddr"] = json!(e.leader_addr);
    }
    if let Some(token) = e.current_token {
        error["currentToken"] = json!(token);
    }
    json!({"success": false, "key": key, "requestId": request_id, "error": error}).to_string()
}

/// A fencing token as JSON, with its MAC when the node has a fencing key.
#[derive(serde::Serialize)]
struct TokenJson<'a> {
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    mac: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<&'static str>,
    /// A permit's slot.
    #[serde(skip_serializing_if = "Option::is_none")]
    slot: Option<u32>,
    value: u64,
}

impl<'a> TokenJson<'a> {
    /// A token granted in `mode`: its MAC covers the mode, and a leader's says `"mode": "leader"`.
    fn with_mode(token: &'a FencingToken, key: Option<&FencingKey>, mode: TokenMode) -> Self {
        TokenJson {
            key: &token.key,
            mac: key.map(|k| k.mac_mode(mode, &token.key, token.value)),
            mode: (mode != TokenMode::Lock).then_some(mode.as_str()),
            slot: mode.slot(),
            value: token.value,
        }
    }

    fn of(
        token: &'a FencingToken,
        key: Option<&FencingKey>,
        leader: bool,
        shared: Option<SharedGrant>,
    ) -> Self {
        let mode = match shared {
            Some(g) => TokenMode::of_shared(g.mode, g.slot),
            None if leader => TokenMode::Leader,
            None => TokenMode::Lock,
        };
        Self::with_mode(token, key, mode)
    }
}

/// A successful reply. Written straight from borrowed fields rather than built as a
/// `serde_json::Value` first (this runs for every request); fields are declared in
/// alphabetical order, the order the replies have always had.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct OkReply<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    cancelled: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    candidates: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_in_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fencing_token: Option<TokenJson<'a>>,
    key: EchoValue<'a>,
    /// A leader read: the leader's client id (`null` while no one leads).
    #[serde(skip_serializing_if = "Option::is_none")]
    leader: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lock_delay: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    permits: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    proclaimed: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    locks: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    renewed: Option<bool>,
    request_id: EchoValue<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<u64>,
    success: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<Option<std::borrow::Cow<'a, str>>>,
}

pub(super) fn reply_json(
    echo: Echo<'_>,
    reply: &ClientReply,
    release: bool,
    fencing_key: Option<&FencingKey>,
) -> String {
    let mut ok = OkReply {
        cancelled: None,
        candidates: None,
        deleted: None,
        expires_in_ms: None,
        fencing_token: None,
        key: echo.key.clone(),
        leader: None,
        lock_delay: None,
        locks: None,
        permits: None,
        proclaimed: None,
        released: None,
        renewed: None,
        request_id: echo.request_id.clone(),
        session: None,
        success: true,
        value: None,
    };
    match reply {
        ClientReply::Granted {
            token,
            expires_in_ms,
            leader,
            shared,
            ..
        } => {
            ok.fencing_token = Some(TokenJson::of(token, fencing_key, *leader, *shared));
            ok.expires_in_ms = Some(*expires_in_ms);
        }
        ClientReply::Proclaimed { token } => {
            ok.proclaimed = Some(true);
            ok.fencing_token = Some(TokenJson::with_mode(token, fencing_key, TokenMode::Leader));
        }
        ClientReply::Leader {
            leader,
            token,
            value,
            candidates,
        } => {
            ok.leader = Some(leader.as_deref());
            ok.fencing_token = token
                .as_ref()
                .map(|t| TokenJson::with_mode(t, fencing_key, TokenMode::Leader));
            ok.value = Some(value.as_deref().map(String::from_utf8_lossy));
            ok.candidates = Some(*candidates);
        }
        ClientReply::Released => ok.released = Some(true),
        ClientReply::LockDelaySet { delay_ms } => ok.lock_delay = Some(*delay_ms),
        ClientReply::Renewed {
            token,
            expires_in_ms,
            leader,
            shared,
        } => {
            ok.renewed = Some(true);
            ok.fencing_token = Some(TokenJson::of(token, fencing_key, *leader, *shared));
            ok.expires_in_ms = Some(*expires_in_ms);
        }
        ClientReply::WaitCancelled => ok.cancelled = Some(true),
        ClientReply::SessionKept {
            session,
            expires_in_ms,
        } => {
            ok.session = Some(*session);
            ok.expires_in_ms = Some(*expires_in_ms);
        }
        ClientReply::SessionEnded { locks } => ok.locks = Some(*locks),
        ClientReply::PermitsSet { permits } => ok.permits = Some(*permits),
        ClientReply::Stored => {}
        ClientReply::Deleted { existed } => ok.deleted = Some(*existed),
        ClientReply::Value(v) => ok.value = Some(v.as_deref().map(String::from_utf8_lossy)),
        ClientReply::Error(e) => {
            let mut text: Value =
                serde_json::from_str(&error_reply(echo, e)).unwrap_or(Value::Null);
            if release {
                text["released"] = json!(false);
            }
            return text.to_string();
        }
    }
    serde_json::to_string(&ok).unwrap_or_else(|e| {
        error_reply(
            echo,
            &ApiError::new(
                ErrorCode::Unavailable,
                format!("cannot write the reply: {e}"),
            ),
        )
    })
}
