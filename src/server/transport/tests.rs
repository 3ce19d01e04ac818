//! A transport on the calling runtime: its streams start on that runtime, and sends from outside
//! one are dropped.

use super::*;
use crate::raft::MessageBody;

fn answer_to(to: NodeId) -> Message {
    Message {
        from: 1,
        to,
        term: 3,
        body: MessageBody::HeartbeatResponse { read_seq: 7 },
    }
}

fn dropped(metrics: &NodeMetrics, peer: &str) -> u64 {
    metrics
        .peer_messages_dropped_total
        .with_label_values(&[peer])
        .get()
}

#[test]
fn a_transport_on_the_calling_runtime_starts_streams_there_and_drops_sends_from_outside_one() {
    let io = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let metrics = NodeMetrics::new();
    let identity = LocalIdentity {
        id: 1,
        peer_addr: "127.0.0.1:1".into(),
        client_addr: String::new(),
        incarnation: 1,
        cluster_id: Default::default(),
    };
    let transport = io.block_on(async {
        PeerTransport::new(
            identity,
            PeerDialer::default(),
            AddressBook::default(),
            metrics.clone(),
            1 << 20,
        )
    });
    let answers = transport.on_calling_runtime();
    // A thread outside any runtime has nowhere to run a stream: the message is dropped and
    // counted, never a panic.
    answers.send(&answer_to(2));
    assert_eq!(dropped(&metrics, "2"), 1);
    assert!(answers.peers.read().unwrap().is_empty());
    // On another runtime (the driver's), the stream starts there and the message is queued.
    let driver = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    driver.block_on(async { answers.send(&answer_to(2)) });
    assert_eq!(dropped(&metrics, "2"), 1);
    assert!(answers.peers.read().unwrap().contains_key(&2));
    // Its streams are its own: the I/O transport has none.
    assert!(transport.peers.read().unwrap().is_empty());
}
