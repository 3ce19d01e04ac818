//! Tests of the WebSocket API: the typed fast path answers as the general path, and replies keep
//! their wire form.

use serde_json::json;

use super::parse::parse_general;
use super::*;
use crate::fencing::FencingKey;
use crate::lock::FencingToken;
use crate::node::api::ClientReply;
use crate::server::exec::ClientLimits;

#[test]
fn typed_fast_path_parses_and_answers_as_the_general_path() {
    let limits = ClientLimits {
        max_connections: 10,
        max_inflight_per_connection: 10,
        max_batch: 64,
        max_message_bytes: 65536,
        max_key_bytes: 64,
        max_value_bytes: 1024,
        max_ttl_ms: 60_000,
        default_ttl_ms: 10_000,
    };
    let frames = [
        r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r1","ttl":5000}"#,
        r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r1","waitTimeout":0,"redirect":true,"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#,
        r#"{"commandType":4,"key":"jobs/a","clientId":"c1","requestId":"r2","fencingToken":{"key":"jobs/a","value":42,"mac":"00"}}"#,
        r#"{"commandType":4,"key":"jobs/a","clientId":"c1","requestId":"r2"}"#,
        r#"{"commandType":5,"key":"jobs/a","clientId":"c1","requestId":"r3","fencingToken":{"value":42}}"#,
        r#"{"commandType":6,"key":"jobs/a","clientId":"c1","requestId":"r4"}"#,
        r#"{"commandType":2,"key":"data/x","clientId":"c1","requestId":"r5","value":"v\u00e9","fencingToken":{"key":"jobs/a","value":42}}"#,
        r#"{"commandType":2,"key":"data/x","clientId":"c1","requestId":"r6","delete":true}"#,
        r#"{"commandType":7,"key":"data/x"}"#,
        r#"{"commandType":3,"key":"jobs\/\u0061","clientId":"c\n1","requestId":"r\"7"}"#,
        // Refused, with the same error reply on both paths.
        r#"{"commandType":3,"key":"","clientId":"c1","requestId":"r8"}"#,
        r#"{"commandType":3,"key":"jobs/a","requestId":"r9"}"#,
        r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r10","ttl":0}"#,
        r#"{"commandType":5,"key":"jobs/a","clientId":"c1","requestId":"r11"}"#,
        r#"{"commandType":2,"key":"data/x","clientId":"c1","requestId":"r12"}"#,
        r#"{"commandType":99,"key":"jobs/a","clientId":"c1","requestId":"r13"}"#,
        r#"{"commandType":0,"key":"jobs/a","clientId":"c1","requestId":null}"#,
    ];
    for frame in frames {
        assert!(
            serde_json::from_str::<WsRequest>(frame).is_ok(),
            "not on the fast path: {frame}"
        );
        let fast = format!("{:?}", parse_text(frame, &limits, 1));
        let general = format!("{:?}", parse_general(frame, &limits, 1));
        assert_eq!(fast, general, "{frame}");
    }
    // Frames the fast path leaves to the general one: unknown fields (counted there),
    // repeated fields (the last one wins there), other types for the echoed fields.
    for frame in [
        r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r1","extra":1}"#,
        r#"{"commandType":3,"key":"jobs/a","key":"jobs/b","clientId":"c1","requestId":"r1"}"#,
        r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":7}"#,
        r#"{"commandType":3,"key":7,"clientId":"c1","requestId":"r1"}"#,
        r#"[1,2]"#,
        r#"{"commandType":3,"#,
    ] {
        assert!(serde_json::from_str::<WsRequest>(frame).is_err(), "{frame}");
    }
    let repeated =
        r#"{"commandType":3,"key":"jobs/a","key":"jobs/b","clientId":"c1","requestId":"r1"}"#;
    let op = format!("{:?}", parse_text(repeated, &limits, 1));
    assert!(op.contains("jobs/b"), "{op}");
    let extra = r#"{"commandType":3,"key":"jobs/a","clientId":"c1","requestId":"r1","x":{"y":1}}"#;
    let op = format!("{:?}", parse_text(extra, &limits, 1));
    assert!(op.starts_with("Ok(Acquire"), "{op}");
    let numeric = r#"{"commandType":3,"key":"","clientId":"c1","requestId":7}"#;
    let err = parse_text(numeric, &limits, 1).unwrap_err();
    assert!(err.contains(r#""requestId":7"#), "{err}");
}

fn token() -> FencingToken {
    FencingToken {
        key: "jobs/a".into(),
        value: 42,
    }
}

/// The replies clients parse, byte for byte: fields in alphabetical order, the echoed key
/// and request id whatever their JSON type.
#[test]
fn replies_keep_their_wire_form() {
    let raw: Value =
        serde_json::from_str(r#"{"commandType":1,"key":"jobs/a","requestId":"r1"}"#).unwrap();
    let cases = [
        (
            ClientReply::Granted {
                token: token(),
                expires_in_ms: 5000,
                queued: None,
                leader: false,
                shared: None,
            },
            r#"{"expiresInMs":5000,"fencingToken":{"key":"jobs/a","value":42},"key":"jobs/a","requestId":"r1","success":true}"#,
        ),
        (
            ClientReply::Released,
            r#"{"key":"jobs/a","released":true,"requestId":"r1","success":true}"#,
        ),
        (
            ClientReply::Renewed {
                token: token(),
                expires_in_ms: 7,
                leader: false,
                shared: None,
            },
            r#"{"expiresInMs":7,"fencingToken":{"key":"jobs/a","value":42},"key":"jobs/a","renewed":true,"requestId":"r1","success":true}"#,
        ),
        (
            ClientReply::Granted {
                token: token(),
                expires_in_ms: 9,
                queued: None,
                leader: false,
                shared: Some(crate::node::api::SharedGrant {
                    mode: crate::lock::LockMode::Permit,
                    slot: 3,
                }),
            },
            r#"{"expiresInMs":9,"fencingToken":{"key":"jobs/a","mode":"permit","slot":3,"value":42},"key":"jobs/a","requestId":"r1","success":true}"#,
        ),
        (
            ClientReply::PermitsSet { permits: 4 },
            r#"{"key":"jobs/a","permits":4,"requestId":"r1","success":true}"#,
        ),
        (
            ClientReply::WaitCancelled,
            r#"{"cancelled":true,"key":"jobs/a","requestId":"r1","success":true}"#,
        ),
        (
            ClientReply::Stored,
            r#"{"key":"jobs/a","requestId":"r1","success":true}"#,
        ),
        (
            ClientReply::Deleted { existed: false },
            r#"{"deleted":false,"key":"jobs/a","requestId":"r1","success":true}"#,
        ),
        (
            ClientReply::Value(Some(b"v\"1".to_vec())),
            r#"{"key":"jobs/a","requestId":"r1","success":true,"value":"v\"1"}"#,
        ),
        (
            ClientReply::Value(None),
            r#"{"key":"jobs/a","requestId":"r1","success":true,"value":null}"#,
        ),
    ];
    for (reply, want) in cases {
        assert_eq!(
            reply_json(Echo::of(&raw), &reply, false, None),
            want,
            "{reply:?}"
        );
    }
    // No key and a numeric request id (seed clients send either).
    let raw: Value = serde_json::from_str(r#"{"commandType":2,"requestId":7}"#).unwrap();
    assert_eq!(
        reply_json(Echo::of(&raw), &ClientReply::Released, true, None),
        r#"{"key":null,"released":true,"requestId":7,"success":true}"#
    );
    // With a fencing key the token carries its MAC.
    let key = FencingKey::new(&[7u8; 32]).unwrap();
    let text = reply_json(
        Echo::of(&raw),
        &ClientReply::Granted {
            token: token(),
            expires_in_ms: 1,
            queued: None,
            leader: false,
            shared: None,
        },
        false,
        Some(&key),
    );
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["fencingToken"]["mac"], json!(key.mac("jobs/a", 42)));
    // Errors keep their own form, with `released: false` on a failed release.
    let err = ClientReply::error(ErrorCode::NotHolder, "not yours");
    let v: Value = serde_json::from_str(&reply_json(Echo::of(&raw), &err, true, None)).unwrap();
    assert_eq!(v["success"], json!(false));
    assert_eq!(v["released"], json!(false));
    assert_eq!(v["error"]["code"], json!(ErrorCode::NotHolder.as_str()));
}
