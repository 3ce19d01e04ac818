//! What another node (or anything that reaches the peer port) can send, decoded the way the
//! `Peer` service does. The first byte chooses the message; the rest is its body:
//!
//! - 0: a `RaftMessage` from a `Peer.Raft` stream, converted into the Raft core's `Message`
//!   (`raftlock::server::convert::message_from_pb`): a malformed message must be an error, and a
//!   converted one must convert back and forth to itself;
//! - 1: a `ForwardClientRequest`, whose `op_json` the leader decodes as a `ClientOp`;
//! - 2: bare `op_json` (the JSON inside a `ForwardClientRequest`), so the fuzzer reaches the JSON
//!   decoder without going through protobuf;
//! - 3: bare `reply_json` of a `ForwardClientReply`, which the forwarding follower decodes as a
//!   `ClientReply`;
//! - 4: a membership or data RPC body (`JoinCluster`, `FetchPeerList`, `RemoveServer`,
//!   `AppendData`, requests and replies, a plain Raft stream's hello and accept), decoded as each;
//! - 5: the bytes of a connection to the peer port, read as the port reads them: its first bytes
//!   sniffed for a plain Raft stream, then (if it is one) a hello frame and `RaftMessage` frames
//!   (`raftlock::server::peer_stream`), each converted as in 0, with a 1 KiB frame limit.
//!
//! Never panics.

use std::fmt::Debug;

use raftlock::node::api::{ClientOp, ClientReply};
use raftlock::server::convert::{message_from_pb, message_to_pb};
use raftlock::server::proto::peer as pb;

fn decode<M: prost::Message + Default + PartialEq + Debug>(data: &[u8]) -> Option<M> {
    let message = M::decode(data).ok()?;
    let again = M::decode(message.encode_to_vec().as_slice()).expect("re-encoded message decodes");
    assert_eq!(again, message);
    Some(message)
}

/// The leader's decoding of a forwarded operation; a decoded one re-encodes to itself.
fn op_json(bytes: &[u8]) {
    if let Ok(op) = serde_json::from_slice::<ClientOp>(bytes) {
        let again: ClientOp = serde_json::from_slice(&serde_json::to_vec(&op).expect("encodes"))
            .expect("re-encoded op decodes");
        assert_eq!(again, op);
        // What the node reads off every operation (spans, metrics, routing).
        let _ = (
            op.name(),
            op.span_name(),
            op.key(),
            op.client_id(),
            op.request_id(),
        );
    }
}

/// Reads `bytes` as a connection to the peer port. A byte slice never makes a read wait, so each
/// future finishes on its first poll.
fn plain_stream(bytes: &[u8]) {
    use raftlock::server::peer_stream::{sniff, FrameReader, Sniffed};
    fn now<F: std::future::Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match f.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => unreachable!("a byte slice never waits"),
        }
    }
    let Ok(Sniffed::Plain(rest)) = now(sniff(bytes)) else {
        return;
    };
    let mut frames = FrameReader::new(rest, 1024);
    if !matches!(now(frames.next::<pb::RaftStreamHello>()), Ok(Some(_))) {
        return;
    }
    while let Ok(Some(raw)) = now(frames.next::<pb::RaftMessage>()) {
        if let Ok(msg) = message_from_pb(raw) {
            let again = message_from_pb(message_to_pb(&msg)).expect("converted back");
            assert_eq!(again, msg);
        }
    }
}

/// One input, as the cargo-fuzz target and the corpus replay test (tests/fuzz_corpus.rs) give it.
pub fn run(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 6 {
        0 => {
            let Some(raw) = decode::<pb::RaftMessage>(body) else {
                return;
            };
            if let Ok(msg) = message_from_pb(raw) {
                let again = message_from_pb(message_to_pb(&msg)).expect("converted back");
                assert_eq!(again, msg);
            }
        }
        1 => {
            if let Some(r) = decode::<pb::ForwardClientRequest>(body) {
                op_json(&r.op_json);
            }
        }
        2 => op_json(body),
        3 => {
            if let Ok(reply) = serde_json::from_slice::<ClientReply>(body) {
                let again: ClientReply =
                    serde_json::from_slice(&serde_json::to_vec(&reply).expect("encodes"))
                        .expect("re-encoded reply decodes");
                assert_eq!(again, reply);
                let _ = reply.result_label();
            }
            if let Some(r) = decode::<pb::ForwardClientReply>(body) {
                let _ = serde_json::from_slice::<ClientReply>(&r.reply_json);
            }
        }
        5 => plain_stream(body),
        _ => {
            decode::<pb::JoinClusterRequest>(body);
            decode::<pb::JoinClusterReply>(body);
            decode::<pb::FetchPeerListRequest>(body);
            decode::<pb::FetchPeerListReply>(body);
            decode::<pb::RemoveServerRequest>(body);
            decode::<pb::RemoveServerReply>(body);
            decode::<pb::AppendDataRequest>(body);
            decode::<pb::AppendDataReply>(body);
            decode::<pb::RaftStreamClosed>(body);
            decode::<pb::RaftStreamHello>(body);
            decode::<pb::RaftStreamAccept>(body);
        }
    }
}
