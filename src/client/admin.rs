//! `AdminClient`: cluster status, members and health over the nodes' HTTP endpoints.

use std::time::Duration;

use serde_json::Value;

use super::error::ClientError;
use super::http::{get_json_with, request_with};

/// Read-only cluster administration. Any node answers; `status` is that node's own view.
#[derive(Clone, Debug)]
pub struct AdminClient {
    endpoints: Vec<String>,
    auth_token: Option<String>,
    tls: Option<super::conn::TlsConfig>,
}

impl AdminClient {
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(
        endpoints: I,
    ) -> Result<Self, ClientError> {
        let endpoints: Vec<String> = endpoints.into_iter().map(Into::into).collect();
        if endpoints.is_empty() {
            return Err(ClientError::Config(
                "at least one endpoint is required".into(),
            ));
        }
        Ok(AdminClient {
            endpoints,
            auth_token: None,
            tls: None,
        })
    }

    /// A bearer token for a cluster that authenticates its clients: `locks` needs one there
    /// (and shows fencing tokens only to an admin identity).
    pub fn with_auth_token(mut self, token: Option<String>) -> Self {
        self.auth_token = token;
        self
    }

    /// TLS (`https`) for a cluster whose client port uses it.
    pub fn with_tls(mut self, tls: Option<super::conn::TlsConfig>) -> Self {
        self.tls = tls;
        self
    }

    async fn get(&self, path: &str) -> Result<Value, ClientError> {
        let mut last = String::new();
        for addr in &self.endpoints {
            match get_json_with(addr, path, self.auth_token.as_deref(), self.tls.as_ref()).await {
                Ok((200, v)) => return Ok(v),
                Ok((status, v)) => last = format!("{addr}{path}: HTTP {status}: {v}"),
                Err(e) => last = e.to_string(),
            }
        }
        Err(ClientError::Unavailable {
            attempts: self.endpoints.len() as u32,
            elapsed: Duration::ZERO,
            last,
        })
    }

    /// The first reachable node's view: id, role, term, leader, commit/applied index, members.
    pub async fn status(&self) -> Result<Value, ClientError> {
        self.get("/status").await
    }

    /// Members with their roles and addresses.
    pub async fn members(&self) -> Result<Value, ClientError> {
        self.get("/members").await
    }

    /// Held locks and their waiters, optionally under a key prefix.
    pub async fn locks(&self, prefix: &str) -> Result<Value, ClientError> {
        self.get(&format!("/locks?prefix={prefix}")).await
    }

    /// Health of every endpoint: (address, alive, ready).
    pub async fn health(&self) -> Vec<(String, bool, bool)> {
        let mut out = Vec::new();
        for addr in &self.endpoints {
            let t = Duration::from_secs(2);
            let alive = matches!(
                request_with(addr, "GET", "/healthz", None, t, None, self.tls.as_ref()).await,
                Ok((200, _))
            );
            let ready = matches!(
                request_with(addr, "GET", "/readyz", None, t, None, self.tls.as_ref()).await,
                Ok((200, _))
            );
            out.push((addr.clone(), alive, ready));
        }
        out
    }
}
