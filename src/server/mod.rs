//! The I/O shell around the pure core: the node driver loop, the peer transport, the client API
//! and membership bootstrap. Everything here may do I/O; nothing here decides Raft or lock rules.
//!
//! Who uses whom (an arrow points at what a module uses; no module uses one drawn above it):
//!
//! ```text
//!   cli ─► node: startup and config checks, bootstrap/join, listeners (builds everything below)
//!   client port front ends: http ─► ws, grpc_seed ─► grpc      peer port: peer_api
//!        (each ─► exec)                                         (Peer service, plain streams in;
//!                  │                                             ─► exec, driver, peer_stream)
//!                  ▼
//!   exec: AppState, request spans, execute here or forward to the leader
//!                  │                      └─► forward (Peer.ForwardClient) ──┐
//!                  ▼                                                         │
//!   driver: the node's loop (Raft core, storage, timers)                     │
//!                  ▼                                                         │
//!   transport: peer streams out, PeerDialer, AddressBook  ◄──────────────────┘
//!                  ▼
//!   peer_stream: frames, dial, sniff
//!                  ▼
//!   listener (client port) ─► tls ─► sockets (per-address caps, TCP liveness)
//! ```
//!
//! Beside them, used from several layers: api, proto, convert, auth, watch, probe,
//! replication_lag; config (─► driver, tls) is read by cli and node.

pub mod api;
pub mod auth;
pub mod cli;
pub mod config;
pub mod convert;
pub mod driver;
pub mod exec;
pub mod forward;
pub mod grpc;
pub mod grpc_seed;
pub mod http;
pub mod listener;
pub mod node;
pub mod peer_api;
pub mod peer_stream;
pub mod probe;
pub mod proto;
pub mod replication_lag;
pub mod sockets;
pub mod tls;
pub mod transport;
pub mod watch;
pub mod ws;
