//! The address book: where each member's peer and client ports are, and which incarnation of it
//! is the member, as learned from streams, the member table and the leader's peer list.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use crate::raft::NodeId;

/// Where each member can be reached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemberAddrs {
    pub peer: String,
    pub client: String,
    /// The member's incarnation as the member table records it (0: not known).
    pub incarnation: u64,
}

/// The addresses this node knows, learned from configuration, joins and peers' stream headers.
#[derive(Clone, Debug, Default)]
pub struct AddressBook {
    inner: Arc<RwLock<BTreeMap<NodeId, MemberAddrs>>>,
}

impl AddressBook {
    pub fn get(&self, id: NodeId) -> Option<MemberAddrs> {
        self.inner.read().ok()?.get(&id).cloned()
    }

    /// Whether `id`'s client address is `addr` (an unknown id has the empty address); reads
    /// without copying.
    pub fn client_addr_is(&self, id: NodeId, addr: &str) -> bool {
        match self.inner.read() {
            Ok(map) => map.get(&id).map_or("", |a| a.client.as_str()) == addr,
            Err(_) => addr.is_empty(),
        }
    }

    pub fn all(&self) -> BTreeMap<NodeId, MemberAddrs> {
        self.inner.read().map(|m| m.clone()).unwrap_or_default()
    }

    /// Records what is known; empty fields keep the previous value.
    pub fn learn(&self, id: NodeId, peer: &str, client: &str) {
        if id == 0 {
            return;
        }
        if let Ok(mut map) = self.inner.write() {
            let entry = map.entry(id).or_default();
            if !peer.is_empty() {
                entry.peer = peer.to_string();
            }
            if !client.is_empty() {
                entry.client = client.to_string();
            }
        }
    }

    /// Whether `id`'s recorded incarnation is `incarnation`, or none is recorded (reads without
    /// copying: asked for every message of a Raft stream).
    pub fn incarnation_is(&self, id: NodeId, incarnation: u64) -> bool {
        match self.inner.read() {
            Ok(map) => map
                .get(&id)
                .is_none_or(|a| a.incarnation == 0 || a.incarnation == incarnation),
            Err(_) => true,
        }
    }

    /// The leader replaces member `id` by a new incarnation: from now on only that one speaks
    /// for it here, whatever the member table says yet.
    pub fn set_incarnation(&self, id: NodeId, incarnation: u64) {
        if id == 0 || incarnation == 0 {
            return;
        }
        if let Ok(mut map) = self.inner.write() {
            map.entry(id).or_default().incarnation = incarnation;
        }
    }

    /// Records a member table entry: addresses as [`AddressBook::learn`], and its incarnation.
    pub fn learn_member(&self, id: NodeId, peer: &str, client: &str, incarnation: u64) {
        self.learn(id, peer, client);
        if incarnation != 0 {
            if let Ok(mut map) = self.inner.write() {
                map.entry(id).or_default().incarnation = incarnation;
            }
        }
    }
}
