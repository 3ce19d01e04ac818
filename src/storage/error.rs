//! The one error type of the storage API.
//!
//! Sits between the storage engines and the node driver. Corruption variants name the tree, the
//! key and what is wrong so an operator can act on the message alone; misuse by the caller (an
//! append with a gap, a compaction past the applied index) has its own variants so that a bug in
//! the driver is never mistaken for a bad disk. Nothing here may hide the underlying cause.

use crate::raft::{Index, MembershipError};

/// Why a storage operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// An earlier storage failure stopped the node; nothing more is written.
    #[error("the node stopped after an earlier storage failure")]
    Stopped,
    /// The simulator cut the power in the middle of a write (simulated storage only).
    #[error("simulated crash")]
    SimulatedCrash,
    /// The operating system refused a read, write or sync.
    #[error("storage I/O failed while {action}: {source}")]
    Io {
        action: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// The storage engine (sled) reported an error other than plain I/O.
    #[error("storage engine failed while {action}: {detail}")]
    Engine {
        action: &'static str,
        detail: String,
    },

    /// The storage engine panicked (sled may panic on a damaged file); caught and reported.
    #[error("storage engine panicked while {action}: {message}")]
    EnginePanic {
        action: &'static str,
        message: String,
    },

    /// The store keeps its Raft log with one engine and was opened with the other.
    #[error(
        "this store keeps its Raft log in {found}, but it was opened with the log engine \
         {asked}; open it with --raft-log-engine {found}"
    )]
    LogEngineMismatch {
        found: &'static str,
        asked: &'static str,
    },

    /// A stored record does not decode or breaks an invariant.
    #[error("corrupt record in tree `{tree}` at key {key}: {problem}")]
    Corrupt {
        tree: &'static str,
        key: String,
        problem: String,
    },

    /// A record of the Raft log that a completed sync had made durable (below the log's
    /// synced mark, or in a segment sealed before the next was begun) is cut off, fails its
    /// checksum or is gone. Not a write a crash cut short: the disk lost what this node had
    /// acknowledged, and a node that went on without it could help elect a leader that lacks a
    /// committed entry. The node must be rebuilt from the cluster.
    #[error(
        "the Raft log is damaged below what was synced: {file} at offset {offset}: {problem} \
         (synced up to offset {synced_to}). This node acknowledged entries it no longer holds, \
         so it must not start with this log. Rebuild the node from the cluster: remove it \
         (`lockctl members remove --id <this node's id>`), then start it on an empty data \
         directory with --join"
    )]
    LogDamagedBelowSynced {
        file: String,
        offset: u64,
        synced_to: u64,
        problem: String,
    },

    /// A stored log entry does not match its checksum.
    #[error(
        "log entry {index} fails its checksum (stored {stored_crc:#010x}, computed \
         {computed_crc:#010x}): the entry was damaged on disk"
    )]
    ChecksumMismatch {
        index: Index,
        stored_crc: u32,
        computed_crc: u32,
    },

    /// The stored log has a hole.
    #[error("stored log is not contiguous: expected entry {expected_index}, found {found_index}")]
    LogGap {
        expected_index: Index,
        found_index: Index,
    },

    /// A membership entry in the stored log is not a valid step from the configuration before it.
    #[error("membership entry {index} cannot be applied: {source}")]
    Membership {
        index: Index,
        #[source]
        source: MembershipError,
    },

    /// The requested entry lies at or before the snapshot point and is gone.
    #[error("entry {index} is compacted (the log starts after snapshot index {snapshot_index})")]
    Compacted { index: Index, snapshot_index: Index },

    /// The requested entry is after the last stored entry.
    #[error("entry {index} is not stored (last index is {last_index})")]
    Unavailable { index: Index, last_index: Index },

    /// `append` was asked to leave a gap or to rewrite compacted entries.
    #[error(
        "cannot append entries starting at {first_index}: the log holds ({snapshot_index}, \
         {last_index}]"
    )]
    AppendOutOfRange {
        first_index: Index,
        snapshot_index: Index,
        last_index: Index,
    },

    /// `append` was given entries that are not consecutive.
    #[error("entries to append are not contiguous: {next_index} follows {previous_index}")]
    AppendNotContiguous {
        previous_index: Index,
        next_index: Index,
    },

    /// `apply` was asked to move the applied index backwards.
    #[error("applied index cannot go back from {applied_index} to {requested_index}")]
    AppliedIndexRegress {
        applied_index: Index,
        requested_index: Index,
    },

    /// `compact` was asked to drop entries the applied state does not cover yet.
    #[error("cannot compact to {upto}: only entries up to {applied_index} are applied")]
    CompactBeyondApplied { upto: Index, applied_index: Index },

    /// A snapshot chunk arrived out of order.
    #[error(
        "snapshot chunk at offset {offset} is out of order: expected offset {expected_offset}"
    )]
    SnapshotChunkOutOfOrder { offset: u64, expected_offset: u64 },

    /// A snapshot chunk or finish arrived with no transfer begun.
    #[error("no snapshot transfer is in progress")]
    NoSnapshotInProgress,

    /// The applied state was read or written while a snapshot's state was still being put in
    /// place (see `Storage::begin_install`): a bug in the caller.
    #[error("{action} while the state of the snapshot at index {index} is still being installed")]
    InstallInProgress { action: &'static str, index: u64 },

    /// Snapshot data does not decode.
    #[error("snapshot data is invalid: {problem}")]
    SnapshotData { problem: String },

    /// A committed entry raises the cluster version above what this node's RaftLock
    /// understands: it cannot apply what follows the way the other members do, so it stops.
    #[error(
        "entry {index} raises the cluster version to {version}, and this RaftLock understands \
         versions up to {supported}: run a newer RaftLock on this node"
    )]
    NewerClusterVersion {
        index: Index,
        version: u32,
        supported: u32,
    },
}

impl StorageError {
    /// Wraps a sled error, keeping I/O errors as I/O.
    #[cfg(feature = "server")]
    pub(crate) fn sled(action: &'static str, error: sled::Error) -> StorageError {
        match error {
            sled::Error::Io(source) => StorageError::Io { action, source },
            sled::Error::Corruption { at, .. } => StorageError::Engine {
                action,
                detail: format!("sled detected corruption in its files at {at:?}"),
            },
            other => StorageError::Engine {
                action,
                detail: other.to_string(),
            },
        }
    }
}
