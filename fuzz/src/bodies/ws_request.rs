//! A WebSocket frame from a client, through the parser `lock-node` runs on every text frame
//! (`raftlock::server::ws::parse_text`, the parsing half of `handle_text`): JSON, then the
//! request fields, then the checks that turn it into a `ClientOp`.
//!
//! Never panics. A frame is either an operation within the edge limits, or an error reply that is
//! JSON with `success: false` and an error code. An operation survives the JSON encoding a
//! follower uses to forward it to the leader (`ForwardClientRequest.op_json`) unchanged.

use raftlock::node::api::ClientOp;
use raftlock::server::http::ClientLimits;
use raftlock::server::ws::parse_text;

/// `lock-node`'s defaults (src/server/config.rs).
const LIMITS: ClientLimits = ClientLimits {
    max_connections: 10_000,
    max_inflight_per_connection: 1024,
    max_batch: 64,
    max_message_bytes: 1 << 20,
    max_key_bytes: 512,
    max_value_bytes: 65_536,
    max_ttl_ms: 3_600_000,
    default_ttl_ms: 10_000,
};

/// One input, as the cargo-fuzz target and the corpus replay test (tests/fuzz_corpus.rs) give it.
pub fn run(data: &[u8]) {
    // Text frames are UTF-8, and so must binary frames be (anything else is refused before the
    // parser).
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse_text(text, &LIMITS, 7) {
        Ok(op) => {
            let key = op.key();
            // Session commands name no key; every other command a key within the limit.
            let session_command = matches!(
                op.request(),
                ClientOp::KeepAlive { .. } | ClientOp::EndSession { .. }
            );
            assert!(
                (session_command || !key.is_empty()) && key.len() <= LIMITS.max_key_bytes,
                "{op:?}"
            );
            if !matches!(op, ClientOp::Get { .. }) {
                assert!(!op.client_id().is_empty(), "{op:?}");
            }
            match op.request() {
                // 0: attached to the client's session.
                ClientOp::Acquire { ttl_ms, .. } | ClientOp::Campaign { ttl_ms, .. } => {
                    assert!((0..=LIMITS.max_ttl_ms).contains(ttl_ms), "{op:?}")
                }
                ClientOp::KeepAlive { ttl_ms, .. } => {
                    assert!((1..=LIMITS.max_ttl_ms).contains(ttl_ms), "{op:?}")
                }
                ClientOp::EndSession { session, .. } => assert!(*session > 0, "{op:?}"),
                // Never attached to a session; a permit names the semaphore's size, a read or
                // write lock none.
                ClientOp::AcquireShared {
                    ttl_ms,
                    mode,
                    permits,
                    ..
                } => {
                    assert!((1..=LIMITS.max_ttl_ms).contains(ttl_ms), "{op:?}");
                    assert_eq!(
                        *mode == raftlock::lock::LockMode::Permit,
                        *permits > 0,
                        "{op:?}"
                    );
                }
                ClientOp::Put { value, .. } => {
                    assert!(value.len() <= LIMITS.max_value_bytes, "{op:?}")
                }
                _ => {}
            }
            let json = serde_json::to_vec(&op).expect("a ClientOp encodes as JSON");
            let forwarded: ClientOp =
                serde_json::from_slice(&json).expect("a forwarded ClientOp decodes");
            assert_eq!(forwarded, op);
        }
        Err(reply) => {
            let reply: serde_json::Value =
                serde_json::from_str(&reply).expect("the error reply is JSON");
            assert_eq!(reply["success"], false, "{reply}");
            assert!(reply["error"]["code"].is_string(), "{reply}");
        }
    }
}
