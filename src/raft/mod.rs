//! The consensus core: a pure Raft state machine in the style of etcd/raft.
//!
//! The driver calls `tick`, `step`, `propose`, `read_index`, `propose_membership` and
//! `transfer_leader`; the core answers with a [`Ready`] describing everything that must happen
//! next — state to persist, messages to send, entries to apply — and the driver calls `advance`
//! once it has done it. The core never performs I/O, never reads a clock and draws randomness only
//! from the seeded generator it is given. Keep it that way: the simulator depends on it.

pub mod types;

#[cfg(test)]
mod tests;

pub use types::*;
pub mod config;
pub mod log;
pub mod message;
pub mod node;
pub mod progress;

pub use config::{Config, ConfigError};
pub use message::{Message, MessageBody};
pub use node::{
    CoreStats, InitialState, ProposeError, Raft, ReadState, Ready, Role, SnapshotChunk, SoftState,
};
pub use progress::ProgressState;
