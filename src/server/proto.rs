//! Generated protobuf and gRPC code for `proto/peer.proto`, `proto/lock.proto` and seed 004's
//! `proto/seed004/api/lock_service.proto`.

#![allow(clippy::all, missing_docs)]

pub mod peer {
    tonic::include_proto!("raftlock.peer.v1");
}

pub mod lock {
    tonic::include_proto!("raftlock.lock.v1");
}

/// Seed 004's `api.LockService` (server side only).
pub mod seed004 {
    tonic::include_proto!("api");
}
