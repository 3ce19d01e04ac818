//! TLS on the node's two ports, with certificates read from files and reloaded when they change.
//!
//! ```text
//!   peer port (mutual TLS)                      client port (server TLS)
//!   ─────────────────────                       ────────────────────────
//!   accept ─► handshake: the peer must          accept ─► handshake ─► HTTP / WebSocket / gRPC
//!             show a certificate from the CA
//!   stream ─► its node id must be a name in     (clients authenticate with bearer tokens,
//!             the certificate: node-{id}.raftlock   server::auth)
//!   dial   ─► the peer must show a CA certificate,
//!             named for the id dialled when it is known
//! ```
//!
//! Certificates, keys and CA bundles are PEM files, as a Kubernetes Secret or cert-manager
//! mounts them. Every [`RELOAD_INTERVAL`] the files are read again; when their bytes changed and
//! they form a valid configuration, new handshakes use them (open connections keep the
//! certificates they were made with). A half-written or mismatched set is refused, counted in
//! `raftlock_tls_reloads_total{result="error"}`, and the previous configuration stays.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::IntCounterVec;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, ServerConfig, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn};

use crate::raft::NodeId;
use crate::tls::{certs_from_pem, key_from_pem, provider, read, roots_from_pem, TlsError};

/// How often certificate files are checked for changes.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// How long a new connection may take to finish its TLS handshake.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// Peer-port handshakes in progress at once; a connection beyond it is closed at once.
const MAX_PEER_HANDSHAKES: usize = 256;
/// Peer-port handshakes in progress at once from one source address (a node opens a few
/// connections to each peer).
pub const MAX_PEER_HANDSHAKES_PER_ADDRESS: usize = 16;
/// The name every node certificate must carry, with `{id}` standing for the node's id.
pub const DEFAULT_NODE_NAME: &str = "node-{id}.raftlock";
/// The name an operator's certificate carries by default.
pub const DEFAULT_OPERATOR_NAME: &str = "operator.raftlock";

/// The files of one TLS identity: a certificate chain and its key, and for mutual TLS the CA
/// bundle the other side's certificate must chain to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: Option<PathBuf>,
}

impl TlsFiles {
    fn paths(&self) -> Vec<&PathBuf> {
        let mut paths = vec![&self.cert, &self.key];
        paths.extend(self.ca.as_ref());
        paths
    }

    /// The files' bytes, in the order of [`TlsFiles::paths`].
    fn read_all(&self) -> Result<Vec<Vec<u8>>, TlsError> {
        self.paths().into_iter().map(|p| read(p)).collect()
    }
}

/// A configuration built from files and rebuilt when their bytes change: what both ports share.
struct Reloading<T> {
    files: TlsFiles,
    port: &'static str,
    build: fn(&TlsFiles, &[Vec<u8>]) -> Result<T, TlsError>,
    current: RwLock<Arc<T>>,
    loaded: Mutex<Vec<Vec<u8>>>,
    /// The bytes of the last set that could not be used (reported once, not every interval).
    refused: Mutex<Option<Vec<Vec<u8>>>>,
    reloads: Option<IntCounterVec>,
}

impl<T> Reloading<T> {
    /// Reads the files and builds the first configuration (an error stops the node at start).
    fn load(
        files: TlsFiles,
        port: &'static str,
        build: fn(&TlsFiles, &[Vec<u8>]) -> Result<T, TlsError>,
        reloads: Option<IntCounterVec>,
    ) -> Result<Reloading<T>, TlsError> {
        let bytes = files.read_all()?;
        let first = build(&files, &bytes)?;
        if let Some(r) = &reloads {
            for result in ["ok", "error"] {
                r.with_label_values(&[port, result]);
            }
        }
        Ok(Reloading {
            files,
            port,
            build,
            current: RwLock::new(Arc::new(first)),
            loaded: Mutex::new(bytes),
            refused: Mutex::new(None),
            reloads,
        })
    }

    fn current(&self) -> Arc<T> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reads the files again; true if a new configuration was taken. A set that differs from
    /// both the one loaded and the last one refused is built; if that fails it is remembered as
    /// refused and the current configuration stays.
    fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let now = self.files.read_all()?;
        {
            let loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
            let refused = self.refused.lock().unwrap_or_else(|p| p.into_inner());
            if *loaded == now || refused.as_ref() == Some(&now) {
                return Ok(false);
            }
        }
        match (self.build)(&self.files, &now) {
            Ok(config) => {
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(config);
                *self.loaded.lock().unwrap_or_else(|p| p.into_inner()) = now;
                Ok(true)
            }
            Err(e) => {
                *self.refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
                Err(e)
            }
        }
    }

    /// [`Reloading::reload_if_changed`], logged and counted.
    fn reload_and_report(&self) {
        let count = |result: &str| {
            if let Some(reloads) = &self.reloads {
                reloads.with_label_values(&[self.port, result]).inc();
            }
        };
        match self.reload_if_changed() {
            Ok(false) => {}
            Ok(true) => {
                info!(port = self.port, cert = %self.files.cert.display(), "reloaded TLS certificates");
                count("ok");
            }
            Err(err) => {
                // Mid-rotation files (a new certificate beside the old key) land here until the
                // set is complete; the previous configuration stays in use.
                warn!(port = self.port, cause = %err, "TLS files changed but cannot be used; keeping the previous ones");
                count("error");
            }
        }
    }
}

impl<T> std::fmt::Debug for Reloading<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading")
            .field("port", &self.port)
            .field("files", &self.files)
            .finish()
    }
}

// ---------------------------------------------------------------------------------------------
// Peer port: mutual TLS with node ids bound to certificates.

/// The peer port's TLS: one configuration for accepting peers and one for dialling them, both
/// from the same certificate, key and CA bundle.
#[derive(Debug)]
pub struct PeerTls {
    configs: Reloading<PeerConfigs>,
    node_name: String,
    operator_name: String,
}

struct PeerConfigs {
    accept: Arc<ServerConfig>,
    /// Dialling a known node: its certificate must carry that node's name.
    dial_member: Arc<ClientConfig>,
    /// Dialling an address whose node id is not known (joining, a configured peer list): any
    /// certificate from the CA.
    dial_any: Arc<ClientConfig>,
}

impl PeerTls {
    /// Loads the files; `node_name` is the name pattern with `{id}` (see [`DEFAULT_NODE_NAME`]).
    pub fn load(
        files: TlsFiles,
        node_name: &str,
        reloads: Option<IntCounterVec>,
    ) -> Result<Arc<PeerTls>, TlsError> {
        if files.ca.is_none() {
            return Err(TlsError::Config(
                "peer TLS needs a CA bundle (peer_tls_ca) to verify other nodes".into(),
            ));
        }
        if !node_name.contains("{id}") {
            return Err(TlsError::Config(format!(
                "peer_tls_node_name `{node_name}` must contain {{id}}"
            )));
        }
        Ok(Arc::new(PeerTls {
            configs: Reloading::load(files, "peer", peer_configs, reloads)?,
            node_name: node_name.to_string(),
            operator_name: DEFAULT_OPERATOR_NAME.to_string(),
        }))
    }

    fn configs(&self) -> Arc<PeerConfigs> {
        self.configs.current()
    }

    /// The DNS name that node `id`'s certificate carries.
    pub fn name_of(&self, id: NodeId) -> Option<ServerName<'static>> {
        ServerName::try_from(self.node_name.replace("{id}", &id.to_string())).ok()
    }

    /// The same, with operators' certificates carrying `name` (see [`DEFAULT_OPERATOR_NAME`]).
    pub fn with_operator_name(self: Arc<Self>, name: &str) -> Arc<PeerTls> {
        match Arc::try_unwrap(self) {
            Ok(mut tls) => {
                tls.operator_name = name.to_string();
                Arc::new(tls)
            }
            Err(shared) => shared,
        }
    }

    /// Whether `cert` (already verified against the CA in the handshake) is an operator's.
    pub fn cert_is_operator(&self, cert: &CertificateDer<'_>) -> bool {
        let Ok(name) = ServerName::try_from(self.operator_name.clone()) else {
            return false;
        };
        ParsedCertificate::try_from(cert)
            .and_then(|parsed| rustls::client::verify_server_name(&parsed, &name))
            .is_ok()
    }

    /// Whether `cert` (already verified against the CA in the handshake) names node `id`.
    pub fn cert_speaks_for(&self, cert: &CertificateDer<'_>, id: NodeId) -> bool {
        let Some(name) = self.name_of(id) else {
            return false;
        };
        ParsedCertificate::try_from(cert)
            .and_then(|parsed| rustls::client::verify_server_name(&parsed, &name))
            .is_ok()
    }

    /// Reads the files again; true if a new configuration was taken.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        self.configs.reload_if_changed()
    }

    /// Accepts connections on `listener` and hands the ones whose handshake succeeded to the
    /// gRPC server. Stops when the server drops the stream.
    ///
    /// Nothing is awaited between two accepts but the accept itself: a connection is refused
    /// at once (and counted in `refused`) when the handshakes in progress are at their bound,
    /// in all or from its source address, so idle sockets cannot hold up a peer's handshake.
    pub fn incoming(
        self: &Arc<Self>,
        listener: TcpListener,
        refused: prometheus::IntCounterVec,
    ) -> ReceiverStream<io::Result<PeerTlsStream>> {
        let (tx, rx) = mpsc::channel(MAX_PEER_HANDSHAKES);
        let tls = self.clone();
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_PEER_HANDSHAKES));
        let per_address = super::sockets::PerAddress::new(MAX_PEER_HANDSHAKES_PER_ADDRESS);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    _ = tx.closed() => return,
                };
                let (tcp, addr) = match accepted {
                    Ok(a) => a,
                    Err(err) => {
                        warn!(cause = %err, "peer accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Some(address_slot) = per_address.try_take(addr.ip()) else {
                    refused.with_label_values(&["address_limit"]).inc();
                    continue;
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    refused.with_label_values(&["limit"]).inc();
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                super::sockets::watch_liveness(&tcp);
                let acceptor = tokio_rustls::TlsAcceptor::from(tls.configs().accept.clone());
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _slot = (slot, address_slot);
                    match tokio::time::timeout(HANDSHAKE_DEADLINE, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send(Ok(PeerTlsStream(Box::new(stream)))).await;
                        }
                        Ok(Err(err)) => {
                            debug!(peer = %addr, cause = %err, "peer TLS handshake failed")
                        }
                        Err(_) => debug!(peer = %addr, "peer TLS handshake timed out"),
                    }
                });
            }
        });
        ReceiverStream::new(rx)
    }

    /// Opens a channel to `addr` over TLS; `expect`: the node id that must answer there.
    pub async fn connect(
        self: &Arc<Self>,
        endpoint: Endpoint,
        expect: Option<NodeId>,
    ) -> Result<Channel, tonic::transport::Error> {
        endpoint
            .connect_with_connector(self.connector(expect))
            .await
    }

    /// [`PeerTls::connect`], connecting on first use.
    pub fn connect_lazy(self: &Arc<Self>, endpoint: Endpoint, expect: Option<NodeId>) -> Channel {
        endpoint.connect_with_connector_lazy(self.connector(expect))
    }

    fn connector(
        self: &Arc<Self>,
        expect: Option<NodeId>,
    ) -> impl tower::Service<
        tonic::codegen::http::Uri,
        Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
        Error = io::Error,
        Future = impl Send,
    > + Send
           + Clone
           + 'static {
        let tls = self.clone();
        tower::service_fn(move |uri: tonic::codegen::http::Uri| {
            let tls = tls.clone();
            async move {
                let authority = uri
                    .authority()
                    .map(|a| a.as_str().to_string())
                    .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address"))?;
                let tcp = TcpStream::connect(&authority).await?;
                let _ = tcp.set_nodelay(true);
                Ok(hyper_util::rt::TokioIo::new(tls.dial(tcp, expect).await?))
            }
        })
    }

    /// The client side of the handshake on `tcp`; `expect`: the node id that must answer.
    pub async fn dial(
        &self,
        tcp: TcpStream,
        expect: Option<NodeId>,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let configs = self.configs();
        let (config, name) = match expect.and_then(|id| self.name_of(id)) {
            Some(name) => (configs.dial_member.clone(), name),
            None => (
                configs.dial_any.clone(),
                ServerName::try_from("member.raftlock.invalid")
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
            ),
        };
        tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
    }
}

fn peer_configs(files: &TlsFiles, bytes: &[Vec<u8>]) -> Result<PeerConfigs, TlsError> {
    let certs = certs_from_pem(&files.cert, &bytes[0])?;
    let key = key_from_pem(&files.key, &bytes[1])?;
    let ca_path = files
        .ca
        .as_ref()
        .ok_or_else(|| TlsError::Config("no CA".into()))?;
    let roots = Arc::new(roots_from_pem(ca_path, &bytes[2])?);
    let config_error = |e: &dyn std::fmt::Display| TlsError::Config(e.to_string());

    let client_verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .build()
        .map_err(|e| config_error(&e))?;
    let mut accept = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error(&e))?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(certs.clone(), key.clone_key())
        .map_err(|e| config_error(&e))?;
    accept.alpn_protocols = vec![b"h2".to_vec()];

    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(|e| config_error(&e))?;
    let dial = |require_name: bool| -> Result<Arc<ClientConfig>, TlsError> {
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| config_error(&e))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(MemberVerifier {
                inner: server_verifier.clone(),
                require_name,
            }))
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(|e| config_error(&e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    };
    Ok(PeerConfigs {
        accept: Arc::new(accept),
        dial_member: dial(true)?,
        dial_any: dial(false)?,
    })
}

/// Verifies a peer's certificate against the CA; when `require_name`, it must also carry the
/// name dialled (the expected node's name).
#[derive(Debug)]
struct MemberVerifier {
    inner: Arc<WebPkiServerVerifier>,
    require_name: bool,
}

impl ServerCertVerifier for MemberVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        );
        match verified {
            // The name is checked after the chain: this error means the chain verified.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.require_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// An accepted peer connection after its handshake.
pub struct PeerTlsStream(Box<tokio_rustls::server::TlsStream<TcpStream>>);

impl PeerTlsStream {
    /// The TCP connection under the TLS session.
    pub fn tcp(&self) -> &TcpStream {
        self.0.get_ref().0
    }
}

/// The certificate a peer connection presented, in each request's extensions (shared by the
/// connection's requests, not copied into each).
#[derive(Clone, Debug)]
pub struct PeerCert(Option<Arc<PresentedCert>>);

#[derive(Debug)]
struct PresentedCert {
    der: CertificateDer<'static>,
    /// The node id this certificate was found to name: a connection speaks for one node, so
    /// its later requests skip parsing the certificate again.
    proven: std::sync::OnceLock<NodeId>,
}

impl PeerCert {
    /// Whether the connection's certificate is an operator's (see [`PeerTls::cert_is_operator`]).
    pub fn is_operator(&self, tls: &PeerTls) -> bool {
        self.0
            .as_ref()
            .is_some_and(|cert| tls.cert_is_operator(&cert.der))
    }

    /// Whether the connection's certificate names node `id` (see [`PeerTls::cert_speaks_for`]).
    pub fn speaks_for(&self, tls: &PeerTls, id: NodeId) -> bool {
        let Some(cert) = &self.0 else {
            return false;
        };
        if cert.proven.get() == Some(&id) {
            return true;
        }
        let named = tls.cert_speaks_for(&cert.der, id);
        if named {
            let _ = cert.proven.set(id);
        }
        named
    }
}

impl tonic::transport::server::Connected for PeerTlsStream {
    type ConnectInfo = PeerCert;

    fn connect_info(&self) -> PeerCert {
        let (_, conn) = self.0.get_ref();
        PeerCert(
            conn.peer_certificates()
                .and_then(|certs| certs.first())
                .map(|c| {
                    Arc::new(PresentedCert {
                        der: c.clone().into_owned(),
                        proven: std::sync::OnceLock::new(),
                    })
                }),
        )
    }
}

impl AsyncRead for PeerTlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerTlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

// ---------------------------------------------------------------------------------------------
// Client port: server TLS.

/// The client port's TLS: a certificate and key (clients authenticate with bearer tokens).
#[derive(Debug)]
pub struct ClientTls {
    config: Reloading<ServerConfig>,
}

impl ClientTls {
    pub fn load(
        files: TlsFiles,
        reloads: Option<IntCounterVec>,
    ) -> Result<Arc<ClientTls>, TlsError> {
        Ok(Arc::new(ClientTls {
            config: Reloading::load(files, "client", client_port_config, reloads)?,
        }))
    }

    /// The acceptor for a new connection, with the current certificate.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config.current())
    }

    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        self.config.reload_if_changed()
    }
}

fn client_port_config(files: &TlsFiles, bytes: &[Vec<u8>]) -> Result<ServerConfig, TlsError> {
    let certs = certs_from_pem(&files.cert, &bytes[0])?;
    let key = key_from_pem(&files.key, &bytes[1])?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    // With a CA bundle, clients must also present a certificate from it.
    let builder = match (&files.ca, bytes.get(2)) {
        (Some(ca), Some(pem)) => {
            let roots = Arc::new(roots_from_pem(ca, pem)?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    // HTTP/2 for gRPC clients, HTTP/1.1 for WebSocket and plain HTTP.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

// ---------------------------------------------------------------------------------------------

/// Checks both ports' files every [`RELOAD_INTERVAL`] until shutdown.
pub async fn reload_loop(
    peer: Option<Arc<PeerTls>>,
    client: Option<Arc<ClientTls>>,
    mut shutdown: watch::Receiver<bool>,
) {
    if peer.is_none() && client.is_none() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RELOAD_INTERVAL) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        if let Some(peer) = &peer {
            peer.configs.reload_and_report();
        }
        if let Some(client) = &client {
            client.config.reload_and_report();
        }
    }
}
