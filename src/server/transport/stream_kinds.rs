//! Plain and gRPC Raft streams end to end against a peer port served as a node serves it: order
//! kept, both kinds taken, and the fallback to gRPC for a peer without plain streams.

use std::sync::atomic::AtomicBool;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use super::*;
use crate::raft::MessageBody;
use crate::server::driver::{Input, NodeStatus};
use crate::server::peer_api::PeerApi;
use crate::server::proto::peer::peer_server::PeerServer;

/// The peer side: node 2's peer API, its driver queue, and its peer port's address.
struct Receiver {
    addr: String,
    driver: mpsc::Receiver<Input>,
    _stop: tokio::sync::watch::Sender<bool>,
}

/// Node 2's peer port, served as a node serves it (`sniffing`: plain streams and gRPC on
/// one port) or by the gRPC server alone, as a RaftLock from before plain streams does.
async fn receiver(sniffing: bool) -> Receiver {
    let metrics = NodeMetrics::new();
    let (driver_tx, driver) = mpsc::channel(4096);
    let (_status_tx, status) = tokio::sync::watch::channel(NodeStatus::default());
    let api = Arc::new(PeerApi {
        driver: driver_tx,
        addresses: AddressBook::default(),
        cluster_token: String::new(),
        tls: None,
        refused: metrics.peer_connections_refused_total.clone(),
        status,
        admitted: Arc::new(AtomicBool::new(true)),
        incarnation: 1,
        request_duration: metrics.request_duration_seconds.clone(),
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    if sniffing {
        let server = crate::server::node::serve_peers(
            listener.into_std().unwrap(),
            None,
            api,
            1 << 20,
            stopped,
        )
        .unwrap();
        tokio::spawn(server);
    } else {
        let server = tonic::transport::Server::builder()
            .add_service(PeerServer::from_arc(api))
            .serve_with_incoming(TcpListenerStream::new(listener));
        tokio::spawn(server);
    }
    Receiver {
        addr,
        driver,
        _stop: stop,
    }
}

/// Node 1's transport to node 2 (at `addr`), and its metrics.
fn transport_to(addr: &str, plain: bool) -> (PeerTransport, NodeMetrics) {
    let metrics = NodeMetrics::new();
    let addresses = AddressBook::default();
    addresses.learn(2, addr, "");
    let transport = PeerTransport::new(
        LocalIdentity {
            id: 1,
            peer_addr: "127.0.0.1:1".into(),
            client_addr: String::new(),
            incarnation: 1,
            cluster_id: Default::default(),
        },
        PeerDialer::default(),
        addresses,
        metrics.clone(),
        1 << 20,
    )
    .with_plain_streams(plain);
    (transport, metrics)
}

/// Message `seq` of a run, with `pad` bytes of entry so that a run can fill the socket.
fn numbered(seq: u64, pad: usize) -> Message {
    Message {
        from: 1,
        to: 2,
        term: seq,
        body: MessageBody::Append {
            prev_log_index: seq,
            prev_log_term: 0,
            entries: vec![crate::raft::Entry {
                term: seq,
                index: seq + 1,
                payload: crate::raft::EntryPayload::Command(bytes::Bytes::from(vec![7u8; pad])),
            }],
            leader_commit: 0,
        },
    }
}

/// A transport on the sending thread's runtime writes straight to a plain stream's socket
/// when nothing waits ahead, and leaves the rest to the stream's task when the socket is
/// full: every message arrives once, in the order sent, or is counted as dropped.
#[tokio::test]
async fn messages_written_from_the_sending_thread_keep_their_order() {
    let mut node = receiver(true).await;
    let (io, metrics) = transport_to(&node.addr, true);
    let on_thread = io.on_calling_runtime();
    // The stream opens with the first message; until it is up, messages are queued.
    assert_eq!(on_thread.send(&numbered(1, 10)), Sent::Queued);
    let mut got = Vec::new();
    let mut written = 0;
    let mut seq = 1;
    for burst in 0..20 {
        // Small bursts go out at once; large ones fill the socket, and what does not fit
        // waits in the stream's pending bytes.
        let (pad, count) = if burst % 2 == 0 {
            (16, 16)
        } else {
            (64 * 1024, 96)
        };
        for _ in 0..count {
            seq += 1;
            if on_thread.send(&numbered(seq, pad)) == Sent::Written {
                written += 1;
            }
        }
        while let Ok(Some(Input::Peer(msg))) =
            tokio::time::timeout(Duration::from_millis(200), node.driver.recv()).await
        {
            got.push(msg.term);
        }
    }
    let dropped = metrics
        .peer_messages_dropped_total
        .with_label_values(&["2"])
        .get();
    assert!(written > 0, "nothing was written from the sending thread");
    assert!(
        got.windows(2).all(|w| w[0] < w[1]),
        "messages arrived out of order: {got:?}"
    );
    assert_eq!(
        got.len() as u64 + dropped,
        seq,
        "lost without being counted"
    );
}

/// Node 1 sends node 2 a message; returns what node 2's driver got and the kind of stream
/// node 1 opened.
async fn send_one(to: &mut Receiver, plain: bool) -> (Message, Vec<&'static str>) {
    let (transport, metrics) = transport_to(&to.addr, plain);
    let sent = Message {
        from: 1,
        to: 2,
        term: 3,
        body: MessageBody::HeartbeatResponse { read_seq: 7 },
    };
    transport.send(&sent);
    let got = loop {
        match tokio::time::timeout(Duration::from_secs(10), to.driver.recv()).await {
            Ok(Some(Input::Peer(msg))) => break msg,
            Ok(Some(_)) => continue,
            other => panic!("node 2 got no Raft message: {}", other.is_ok()),
        }
    };
    let kinds = ["plain", "grpc"]
        .into_iter()
        .filter(|kind| {
            metrics
                .peer_streams_opened_total
                .with_label_values(&["2", kind])
                .get()
                > 0
        })
        .collect();
    (got, kinds)
}

#[tokio::test]
async fn a_node_takes_plain_and_grpc_streams_on_its_peer_port() {
    let mut node = receiver(true).await;
    let (got, kinds) = send_one(&mut node, true).await;
    assert_eq!((got.from, got.term), (1, 3));
    assert_eq!(kinds, ["plain"]);
    let (got, kinds) = send_one(&mut node, false).await;
    assert_eq!((got.from, got.term), (1, 3));
    assert_eq!(kinds, ["grpc"]);
}

#[tokio::test]
async fn a_peer_without_plain_streams_is_sent_to_over_grpc() {
    let mut old = receiver(false).await;
    let (got, kinds) = send_one(&mut old, true).await;
    assert_eq!((got.from, got.term), (1, 3));
    assert_eq!(kinds, ["grpc"]);
}
