//! A gRPC request body from a client, decoded as every client request message the client port
//! serves: `raftlock.lock.v1.LockService` and seed 004's `api.LockService` (tonic decodes the
//! message bytes with prost exactly like this, after the 5-byte gRPC frame header).
//!
//! Never panics. Every message that decodes re-encodes to bytes that decode to the same message.
//! The seed API's conversions that depend on the request's content run too: the lease id parser
//! (`ReleaseLock`) and the commit wait from `client_timeout_ms` (`AcquireLock`). The
//! `raftlock.lock.v1` handlers build their `ClientOp` inline in async methods that need a running
//! node, so there is no conversion function to run for them.

use std::fmt::Debug;

use prost::Message;
use raftlock::server::grpc_seed::{commit_wait, parse_lease_id, COMMIT_WAIT_MAX};
use raftlock::server::proto::lock as lpb;
use raftlock::server::proto::seed004 as spb;

/// Decodes `data` as `M`; if it decodes, checks the round trip and returns the message.
fn decode<M: Message + Default + PartialEq + Debug>(data: &[u8]) -> Option<M> {
    let message = M::decode(data).ok()?;
    let again = M::decode(message.encode_to_vec().as_slice()).expect("re-encoded message decodes");
    assert_eq!(again, message);
    Some(message)
}

/// One input, as the cargo-fuzz target and the corpus replay test (tests/fuzz_corpus.rs) give it.
pub fn run(data: &[u8]) {
    if let Some(r) = decode::<lpb::AcquireLockRequest>(data) {
        let _ = (r.resource_name.len(), r.owner_id.len(), r.request_id.len());
    }
    decode::<lpb::ReleaseLockRequest>(data);
    decode::<lpb::RenewLockRequest>(data);
    decode::<lpb::StatusRequest>(data);
    decode::<lpb::MembersRequest>(data);

    if let Some(r) = decode::<spb::AcquireLockRequest>(data) {
        assert!(commit_wait(r.client_timeout_ms) <= COMMIT_WAIT_MAX);
    }
    if let Some(r) = decode::<spb::ReleaseLockRequest>(data) {
        if let Some(lease) = parse_lease_id(&r.lease_id) {
            // Digits only; the value it names is the one its canonical form names.
            assert!(r.lease_id.bytes().all(|b| b.is_ascii_digit()));
            assert_eq!(parse_lease_id(&lease.to_string()), Some(lease));
        }
    }
}
