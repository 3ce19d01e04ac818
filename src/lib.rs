//! RaftLock: a distributed lock service with FIFO locks, leases and fencing tokens, built on a
//! pure Raft core.
//!
//! ```text
//!   clients ──► server (I/O shell) ──► raft (pure core) ──► storage (durable log + state)
//!                      │                      │
//!                      └──────── lock (pure state machine, applied in log order)
//! ```
//!
//! `raft` and `lock` never touch the network, the disk, the clock or an unseeded random source;
//! that is what lets `sim` run whole clusters deterministically from a seed.

#![forbid(unsafe_code)]

#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "server")]
pub mod datastore;
#[cfg(feature = "server")]
pub mod fencing;
pub mod lock;
pub mod node;
pub mod raft;
#[cfg(feature = "server")]
pub mod server;
// The simulator runs the segments engine, which lives with the server's storage.
#[cfg(feature = "server")]
pub mod sim;
pub mod storage;
#[cfg(feature = "server")]
pub mod telemetry;
#[cfg(feature = "tls")]
pub mod tls;
