//! Generated protobuf and gRPC code for `proto/peer.proto` and `proto/lock.proto`.

#![allow(clippy::all, missing_docs)]

pub mod peer {
    tonic::include_proto!("raftlock.peer.v1");
}

pub mod lock {
    tonic::include_proto!("raftlock.lock.v1");
}
