//! The I/O shell around the pure core: the node driver loop, the peer transport, the client API
//! and membership bootstrap. Everything here may do I/O; nothing here decides Raft or lock rules.

pub mod api;
pub mod auth;
pub mod cli;
pub mod config;
pub mod convert;
pub mod driver;
pub mod forward;
pub mod grpc;
pub mod grpc_seed;
pub mod http;
pub mod listener;
pub mod node;
pub mod peer_stream;
pub mod probe;
pub mod proto;
pub mod replication_lag;
pub mod tls;
pub mod transport;
pub mod watch;
pub mod ws;
