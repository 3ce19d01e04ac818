//! What both ports do with a TCP connection before any protocol: caps on connections (or
//! handshakes) per source address, and liveness probes on peer connections. Used by the client
//! listener (`listener.rs`), the peer port's TLS acceptor (`tls.rs`) and the peer transport.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

/// Counts of something (open connections, handshakes in progress) per source address, each
/// under a cap: one address cannot take what the node keeps for all. Clients behind SNAT or an
/// ingress share an address, so the caps are generous by default.
#[derive(Clone)]
pub struct PerAddress {
    cap: usize,
    counts: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>,
}

/// One counted item of a [`PerAddress`]; counted until dropped.
pub struct AddressSlot {
    addr: IpAddr,
    counts: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>,
}

impl PerAddress {
    pub fn new(cap: usize) -> PerAddress {
        PerAddress {
            cap,
            counts: Arc::default(),
        }
    }

    /// A slot for `addr`, or None when it already holds `cap`.
    pub fn try_take(&self, addr: IpAddr) -> Option<AddressSlot> {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let count = counts.entry(addr).or_insert(0);
        if *count >= self.cap {
            return None;
        }
        *count += 1;
        Some(AddressSlot {
            addr,
            counts: self.counts.clone(),
        })
    }

    /// Addresses holding at least one slot (for tests and the status page).
    pub fn addresses(&self) -> usize {
        self.counts.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = counts.get_mut(&self.addr) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.addr);
            }
        }
    }
}

/// Keepalive probes on a peer connection, and a bound on how long sent bytes may go
/// unacknowledged: a peer whose host vanished is noticed within seconds, as the gRPC
/// stream's HTTP/2 keepalive does, instead of after the kernel's retransmissions give up.
pub fn watch_liveness(tcp: &TcpStream) {
    let sock = socket2::SockRef::from(tcp);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(1))
        .with_retries(5);
    let _ = sock.set_tcp_keepalive(&keepalive);
    let _ = sock.set_tcp_user_timeout(Some(Duration::from_secs(10)));
}
