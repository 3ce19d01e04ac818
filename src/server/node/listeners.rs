//! Serving: the client port's probe server while the node decides how to start, the peer port's
//! server (plain Raft streams sorted from gRPC connections), and reloading the client port's
//! credentials.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;
use tracing::{debug, error, info, warn};

use crate::server::peer_api::PeerApi;
use crate::server::peer_stream;
use crate::server::proto::peer::peer_server::PeerServer;
use crate::server::tls::{ClientTls, PeerTls};

/// While a node decides how to start, its client port answers `/healthz` (alive) and `/readyz`
/// (503 with the reason it waits) on a copy of the listener, over client TLS when it is on, as
/// the probes expect; stopped before the node serves.
pub(super) fn serve_while_starting(
    listener: &TcpListener,
    tls: Option<Arc<ClientTls>>,
    metrics: &crate::telemetry::NodeMetrics,
    waiting: Arc<std::sync::RwLock<String>>,
    mut stop: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::from_std(listener_copy(listener)?).ok()?;
    let app = axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route(
            "/readyz",
            axum::routing::get(move || {
                let why = waiting.read().map(|w| w.clone()).unwrap_or_default();
                async move {
                    (
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {why}"),
                    )
                }
            }),
        );
    let listener = crate::server::listener::ClientListener::new(
        listener,
        64,
        16,
        crate::server::listener::REQUEST_HEAD_DEADLINE,
        metrics,
        tls,
    );
    Some(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
    }))
}

/// A second handle on the same listening socket.
fn listener_copy(listener: &TcpListener) -> Option<std::net::TcpListener> {
    use std::os::fd::AsFd;
    let owned = listener.as_fd().try_clone_to_owned().ok()?;
    let std_listener = std::net::TcpListener::from(owned);
    std_listener.set_nonblocking(true).ok()?;
    Some(std_listener)
}

/// Reads the identity file and the JWT key file again every
/// [`crate::server::tls::RELOAD_INTERVAL`] until shutdown, taking a changed, valid set.
pub(super) async fn reload_client_auth(
    security: Arc<crate::server::auth::ClientSecurity>,
    mut shutdown: watch::Receiver<bool>,
) {
    if !security.authenticates() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(crate::server::tls::RELOAD_INTERVAL) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        match security.reload_if_changed() {
            Ok(true) => info!("client identities reloaded: new connections use them"),
            Ok(false) => {}
            Err(err) => warn!(
                cause = %err,
                "client identity files changed but cannot be used; keeping the last good ones"
            ),
        }
    }
}

/// The peer port's server on `listener`, to be spawned on the runtime this is called in (the
/// driver's): the listener and every connection it accepts are registered there. A connection
/// that opens with a plain Raft stream's magic is served by `peer_api::serve`; every other one by
/// the gRPC server.
pub(crate) fn serve_peers(
    listener: std::net::TcpListener,
    tls: Option<Arc<PeerTls>>,
    api: Arc<PeerApi>,
    max_message_bytes: usize,
    mut shutdown: watch::Receiver<bool>,
) -> Result<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>, String> {
    let listener =
        TcpListener::from_std(listener).map_err(|e| format!("cannot serve the peer port: {e}"))?;
    let stopped = async move {
        let _ = shutdown.wait_for(|s| *s).await;
    };
    let router = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(
            PeerServer::from_arc(api.clone())
                .max_decoding_message_size(max_message_bytes)
                .max_encoding_message_size(max_message_bytes),
        );
    Ok(Box::pin(async move {
        let result = match tls {
            Some(tls) => {
                let refused = api.refused.clone();
                let incoming = sort_peer_connections(
                    tls.incoming(listener, refused.clone()),
                    api,
                    max_message_bytes,
                    refused,
                );
                router.serve_with_incoming_shutdown(incoming, stopped).await
            }
            // `tcp_nodelay` above applies only to listeners tonic binds itself: accepted peer
            // sockets get it here. Without it the small HTTP/2 frames this side sends (window
            // updates, pings) waited for the other side's delayed ACK, about 40 ms, whenever
            // one was already in flight — the ~41-44 ms tail of lock requests under load.
            None => {
                let accepted =
                    tokio_stream::StreamExt::map(TcpListenerStream::new(listener), |conn| {
                        if let Ok(tcp) = &conn {
                            let _ = tcp.set_nodelay(true);
                            crate::server::sockets::watch_liveness(tcp);
                        }
                        conn
                    });
                let refused = api.refused.clone();
                let incoming = sort_peer_connections(accepted, api, max_message_bytes, refused);
                router.serve_with_incoming_shutdown(incoming, stopped).await
            }
        };
        if let Err(err) = result {
            error!(cause = %err, "the peer server stopped");
        }
    }))
}

/// Connections whose first bytes are still being read, at most; a connection beyond it is
/// closed at once.
const PEER_CONNECTIONS_SNIFFED: usize = 256;

/// Reads the first bytes of each accepted peer connection: plain Raft streams are served
/// here, every other connection is passed on (its bytes unread) to the gRPC server.
fn sort_peer_connections<S, I>(
    accepted: I,
    api: Arc<PeerApi>,
    max_message_bytes: usize,
    refused: prometheus::IntCounterVec,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<peer_stream::Prefixed<S>>>
where
    S: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + peer_stream::ConnectionCert
        + Unpin
        + Send
        + 'static,
    I: futures::Stream<Item = std::io::Result<S>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let slots = Arc::new(tokio::sync::Semaphore::new(PEER_CONNECTIONS_SNIFFED));
    let per_address = crate::server::sockets::PerAddress::new(
        crate::server::tls::MAX_PEER_HANDSHAKES_PER_ADDRESS,
    );
    tokio::spawn(async move {
        let mut accepted = std::pin::pin!(accepted);
        loop {
            let next = tokio::select! {
                next = futures::StreamExt::next(&mut accepted) => next,
                _ = tx.closed() => return,
            };
            let conn = match next {
                Some(Ok(conn)) => conn,
                Some(Err(err)) => {
                    warn!(cause = %err, "peer accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                None => return,
            };
            // Never awaited here: a slot is taken at once or the connection is closed, so
            // sockets that send nothing cannot hold up the next accept.
            let address_slot = match conn.source_ip() {
                Some(ip) => match per_address.try_take(ip) {
                    Some(slot) => Some(slot),
                    None => {
                        refused.with_label_values(&["address_limit"]).inc();
                        continue;
                    }
                },
                None => None,
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                refused.with_label_values(&["limit"]).inc();
                continue;
            };
            let slot = (slot, address_slot);
            let tx = tx.clone();
            let api = api.clone();
            tokio::spawn(async move {
                let sniffed =
                    tokio::time::timeout(peer_stream::HANDSHAKE_DEADLINE, peer_stream::sniff(conn))
                        .await;
                drop(slot);
                match sniffed {
                    Ok(Ok(peer_stream::Sniffed::Plain(conn))) => {
                        crate::server::peer_api::serve(api, conn, max_message_bytes).await
                    }
                    Ok(Ok(peer_stream::Sniffed::Other(conn))) => {
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Err(err)) => debug!(cause = %err, "peer connection closed unread"),
                    Err(_) => debug!("peer connection sent nothing in time"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
