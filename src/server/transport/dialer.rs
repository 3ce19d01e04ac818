//! How this node reaches other nodes' peer ports ([`PeerDialer`]: TLS and the cluster token) and
//! who it says it is there ([`LocalIdentity`]).

use std::sync::{Arc, RwLock};

use tonic::transport::{Channel, Endpoint};

use super::{FROM_NODE_HEADER, TOKEN_HEADER};
use crate::raft::NodeId;
use crate::server::tls::PeerTls;

/// How this node opens connections to other nodes' peer ports: over mutual TLS when configured,
/// and with the cluster token when one is set.
#[derive(Clone, Debug, Default)]
pub struct PeerDialer {
    pub cluster_token: String,
    pub tls: Option<Arc<PeerTls>>,
    /// The node this dialer speaks for (sent as `x-raftlock-from-node`; 0: an operator tool,
    /// which under TLS must present an operator's certificate).
    pub from_node: NodeId,
}

impl PeerDialer {
    /// The endpoint for a peer address (`host:port`); TLS, when on, is added by the connector.
    pub fn endpoint(addr: &str) -> Result<Endpoint, tonic::transport::Error> {
        Endpoint::from_shared(format!("http://{addr}"))
    }

    /// Connects; `expect`: the node id that must answer there, when known (checked against its
    /// certificate under TLS).
    pub async fn connect(
        &self,
        endpoint: Endpoint,
        expect: Option<NodeId>,
    ) -> Result<Channel, tonic::transport::Error> {
        match &self.tls {
            Some(tls) => tls.connect(endpoint, expect).await,
            None => endpoint.connect().await,
        }
    }

    /// [`PeerDialer::connect`], connecting on first use.
    pub fn connect_lazy(&self, endpoint: Endpoint, expect: Option<NodeId>) -> Channel {
        match &self.tls {
            Some(tls) => tls.connect_lazy(endpoint, expect),
            None => endpoint.connect_lazy(),
        }
    }

    /// A request carrying the cluster token, when one is set.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if self.from_node != 0 {
            if let Ok(v) = self.from_node.to_string().parse() {
                request.metadata_mut().insert(FROM_NODE_HEADER, v);
            }
        }
        if !self.cluster_token.is_empty() {
            if let Ok(v) = self.cluster_token.parse() {
                request.metadata_mut().insert(TOKEN_HEADER, v);
            }
        }
        request
    }
}

/// This node's identity, sent with every outgoing stream so peers learn its addresses.
#[derive(Clone, Debug)]
pub struct LocalIdentity {
    pub id: NodeId,
    pub peer_addr: String,
    pub client_addr: String,
    /// The random id this node's data directory was created with.
    pub incarnation: u64,
    /// The cluster id once known (32 hex digits), set by the driver.
    pub cluster_id: Arc<RwLock<String>>,
}

impl LocalIdentity {
    pub fn cluster_id(&self) -> String {
        self.cluster_id
            .read()
            .map(|c| c.clone())
            .unwrap_or_default()
    }
}
