//! How one lock is kept: its holder and its FIFO queue of waiters ([`LockEntry`]), the compact
//! queue ([`Waiters`]) and the older stored layout a lock is still read back from.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Holder {
    // Boxed strings: 16 bytes each instead of 24, for a million held locks.
    pub(super) client_id: Box<str>,
    pub(super) request_id: Box<str>,
    pub(super) token: u64,
    pub(super) ttl_ms: u64,
    /// Log index at which the current lease started: the grant or the latest renew.
    pub(super) lease_index: u64,
}

/// The holder record written before leases carried their start index (read back only).
#[derive(Deserialize)]
struct HolderV1 {
    client_id: Box<str>,
    request_id: Box<str>,
    token: u64,
    ttl_ms: u64,
}

#[derive(Deserialize)]
pub(super) struct LockEntryV1 {
    holder: Option<HolderV1>,
    waiters: VecDeque<Waiter>,
}

impl From<LockEntryV1> for LockEntry {
    fn from(old: LockEntryV1) -> Self {
        LockEntry {
            holder: old.holder.map(|h| Holder {
                client_id: h.client_id,
                request_id: h.request_id,
                token: h.token,
                ttl_ms: h.ttl_ms,
                lease_index: 0,
            }),
            waiters: old.waiters.into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Waiter {
    pub(super) client_id: Box<str>,
    pub(super) request_id: Box<str>,
    pub(super) ttl_ms: u64,
    pub(super) wait_timeout_ms: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct LockEntry {
    pub(super) holder: Option<Holder>,
    pub(super) waiters: Waiters,
}

/// A key's queue of waiters. Most held locks have none, so an empty queue is a null pointer
/// (8 bytes in every lock) rather than an empty `VecDeque` (32). Encoded as the sequence of its
/// waiters: the same bytes a `VecDeque` gives, so stored locks and snapshots read either way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
// The box is the point: one pointer in every lock instead of the queue's 32 bytes.
#[allow(clippy::box_collection)]
pub(super) struct Waiters(Option<Box<VecDeque<Waiter>>>);

impl Waiters {
    pub(super) fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.0.iter().flat_map(|queue| queue.iter())
    }

    pub(super) fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |queue| queue.len())
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub(super) fn push_back(&mut self, waiter: Waiter) {
        self.0.get_or_insert_with(Box::default).push_back(waiter);
    }

    pub(super) fn pop_front(&mut self) -> Option<Waiter> {
        self.remove(0)
    }

    pub(super) fn remove(&mut self, position: usize) -> Option<Waiter> {
        let queue = self.0.as_mut()?;
        let waiter = queue.remove(position);
        if queue.is_empty() {
            self.0 = None;
        }
        waiter
    }
}

impl From<VecDeque<Waiter>> for Waiters {
    fn from(queue: VecDeque<Waiter>) -> Self {
        Waiters((!queue.is_empty()).then(|| Box::new(queue)))
    }
}

impl Serialize for Waiters {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = serializer.serialize_seq(Some(self.len()))?;
        for waiter in self.iter() {
            seq.serialize_element(waiter)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Waiters {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        VecDeque::<Waiter>::deserialize(deserializer).map(Waiters::from)
    }
}

#[cfg(test)]
mod lock_entry_layout_tests {
    use super::*;
    use crate::lock::command::{decode_plain, encode_plain};

    /// The layout `LockEntry` had before its queue became [`Waiters`].
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct PlainQueueEntry {
        holder: Option<Holder>,
        waiters: VecDeque<Waiter>,
    }

    fn waiter(n: u32) -> Waiter {
        Waiter {
            client_id: format!("c{n}").into(),
            request_id: format!("r{n}").into(),
            ttl_ms: 1_000 + u64::from(n),
            wait_timeout_ms: n.is_multiple_of(2).then_some(50),
        }
    }

    #[test]
    fn a_lock_entry_encodes_as_it_did_with_a_plain_queue() {
        let holder = Holder {
            client_id: "h".into(),
            request_id: "a".into(),
            token: 7,
            ttl_ms: 500,
            lease_index: 3,
        };
        for n in [0u32, 1, 3] {
            let queue: VecDeque<Waiter> = (0..n).map(waiter).collect();
            let plain = PlainQueueEntry {
                holder: Some(holder.clone()),
                waiters: queue.clone(),
            };
            let entry = LockEntry {
                holder: Some(holder.clone()),
                waiters: queue.clone().into(),
            };
            let bytes = encode_plain(&entry);
            assert_eq!(bytes, encode_plain(&plain), "{n} waiters");
            let back: LockEntry = decode_plain(&encode_plain(&plain)).expect("decodes");
            assert_eq!(back, entry);
            assert_eq!(back.waiters.len(), n as usize);
            assert_eq!(back.waiters.is_empty(), n == 0);
            let read: PlainQueueEntry = decode_plain(&bytes).expect("decodes");
            assert_eq!(read, plain);
        }
    }

    #[test]
    fn an_emptied_queue_is_the_empty_queue() {
        let mut waiters = Waiters::default();
        waiters.push_back(waiter(1));
        waiters.push_back(waiter(2));
        waiters.push_back(waiter(3));
        assert_eq!(waiters.remove(1).map(|w| w.request_id), Some("r2".into()));
        assert_eq!(waiters.iter().count(), 2);
        assert_eq!(waiters.pop_front().map(|w| w.request_id), Some("r1".into()));
        assert_eq!(waiters.pop_front().map(|w| w.request_id), Some("r3".into()));
        assert!(waiters.is_empty());
        assert_eq!(waiters, Waiters::default());
        assert_eq!(waiters.pop_front(), None);
        assert_eq!(waiters.remove(4), None);
        assert_eq!(Waiters::from(VecDeque::new()), Waiters::default());
    }
}
