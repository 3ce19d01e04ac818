//! Owner ids and request ids: each acquire's own owner id (`{client_id}#{n}`, reused once its
//! lock is released), request ids kept across retries, and request numbers with the
//! acknowledgement (`ack_below`) each request carries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Inner, RaftLockClient, MAX_CLIENT_ID_BYTES};

/// Numbers the owner ids of this process's acquires (see [`owner_id`]).
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// A fresh owner id derived from `client_id`: `{client_id}#{n}`, with `n` from a process-wide
/// counter, so no two locks this process holds or waits for at once share an identity on the
/// server (an id whose lock was released is reused: `Inner::take_owner`). A client id too
/// long for the suffix is shortened to a prefix plus a digest of the whole id, keeping the owner
/// id within [`MAX_CLIENT_ID_BYTES`].
pub(super) fn owner_id(client_id: &str) -> String {
    let n = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
    let suffix = format!("#{n}");
    if client_id.len() + suffix.len() <= MAX_CLIENT_ID_BYTES {
        return format!("{client_id}{suffix}");
    }
    let digest = format!("~{:016x}", fnv1a(client_id.as_bytes()));
    let mut keep = MAX_CLIENT_ID_BYTES - suffix.len() - digest.len();
    while !client_id.is_char_boundary(keep) {
        keep -= 1;
    }
    format!("{}{digest}{suffix}", &client_id[..keep])
}

/// FNV-1a, 64 bits: a stable digest (the same in every process and release).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The id of one request (kept by its retries), and what it acknowledges. With
/// acknowledgements on, the id is the request's number and `ack_below` the lowest number of its
/// owner's requests still awaiting an answer, this one included; dropping it (answered, failed
/// for good, or abandoned) ends the wait.
pub(crate) struct RequestNumber {
    pub id: String,
    pub ack_below: Option<u64>,
    waiting: Option<(Arc<Inner>, String, u64)>,
}

impl Drop for RequestNumber {
    fn drop(&mut self) {
        let Some((inner, owner, n)) = self.waiting.take() else {
            return;
        };
        let Some(in_flight) = &inner.in_flight else {
            return;
        };
        let mut in_flight = in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(numbers) = in_flight.get_mut(&owner) {
            numbers.remove(&n);
            if numbers.is_empty() {
                in_flight.remove(&owner);
            }
        }
    }
}

/// Spare owner ids kept per client (more concurrent locks than this make new ones).
const SPARE_OWNERS_MAX: usize = 1024;

impl Inner {
    /// A spare owner id, or a new one.
    pub(super) fn take_owner(&self) -> String {
        let spare = self
            .spare_owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        spare.unwrap_or_else(|| owner_id(&self.client_id))
    }

    /// `owner` holds nothing any more (its one lock was released): reuse it.
    pub(super) fn give_back_owner(&self, owner: String) {
        let mut spare = self.spare_owners.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < SPARE_OWNERS_MAX && !owner.is_empty() {
            spare.push(owner);
        }
    }
}

impl RaftLockClient {
    /// A fresh request id; retries of one operation reuse it.
    pub fn next_request_id(&self) -> String {
        let n = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        format!("{:x}-{n}", self.inner.run)
    }

    /// A fresh request of `owner` (see [`RequestNumber`]). Numbers come from the client's one
    /// counter, so each owner's are increasing, with gaps.
    pub(crate) fn number_request(&self, owner: &str) -> RequestNumber {
        let Some(in_flight) = &self.inner.in_flight else {
            return RequestNumber {
                id: self.next_request_id(),
                ack_below: None,
                waiting: None,
            };
        };
        let mut in_flight = in_flight.lock().unwrap_or_else(|p| p.into_inner());
        // Taken under the lock: a number is in the set before any later one is handed out, so
        // no request acknowledges one of its owner's that is still on its way.
        let n = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let numbers = in_flight.entry(owner.to_string()).or_default();
        numbers.insert(n);
        let ack_below = numbers.first().copied().unwrap_or(n);
        RequestNumber {
            id: n.to_string(),
            ack_below: Some(ack_below),
            waiting: Some((self.inner.clone(), owner.to_string(), n)),
        }
    }
}

/// The first request number of a client built now (see `seq`): microseconds since the Unix
/// epoch, at least 1.
pub(super) fn first_request_number() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
        .max(1)
}
