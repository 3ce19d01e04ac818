//! How a [`SledStorage`] is opened: [`SledOptions`] (sled's cache, the log engine, segment
//! size) and [`LogEngine`], where the Raft log is kept.

#[cfg(doc)]
use super::SledStorage;

/// Where a [`SledStorage`] keeps the Raft log; everything else is always in sled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogEngine {
    /// In sled's `log_runs` tree, with the rest of the store.
    #[default]
    Sled,
    /// In segment files of its own under `log/` in the store's directory: an append is one
    /// `write` and a flush one `fdatasync`, without sled's I/O thread pool in between (see
    /// `docs/bench/storage.md` for what that is worth). Hard state, membership, snapshot point
    /// and applied state stay in sled.
    Segments,
    /// The engine the store was written with, and [`LogEngine::Segments`] for a store that was
    /// never written: a store keeps its engine, so a node upgraded to this default reads the
    /// log it wrote. The lock node's default (`--raft-log-engine auto`).
    Auto,
}

impl LogEngine {
    pub fn name(self) -> &'static str {
        match self {
            LogEngine::Sled => "sled",
            LogEngine::Segments => "segments",
            LogEngine::Auto => "auto",
        }
    }
}

impl std::fmt::Display for LogEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for LogEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sled" => Ok(LogEngine::Sled),
            "segments" => Ok(LogEngine::Segments),
            "auto" => Ok(LogEngine::Auto),
            other => Err(format!(
                "unknown log engine `{other}` (auto, sled or segments)"
            )),
        }
    }
}

/// How a [`SledStorage`] is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SledOptions {
    /// The most memory sled's page cache may hold, in bytes (`sled::Config::cache_capacity`).
    /// The lock state machine keeps the whole applied state in memory and reads the store
    /// only to start, to build snapshots and to send log entries that are no longer in
    /// memory, so a large cache only keeps a second copy of the state resident.
    pub cache_bytes: u64,
    /// Where the Raft log is kept. A store keeps the engine it was written with: opening it
    /// with the other is an error while the log holds entries.
    pub log_engine: LogEngine,
    /// Size of one log segment file under [`LogEngine::Segments`] (preallocated).
    pub segment_bytes: u64,
}

impl SledOptions {
    /// The page cache a lock node gives sled unless told otherwise (`--storage-cache-mb`).
    pub const DEFAULT_CACHE_BYTES: u64 = 64 * 1024 * 1024;
    /// The size of a log segment file unless told otherwise.
    pub const DEFAULT_SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
}

impl Default for SledOptions {
    fn default() -> Self {
        SledOptions {
            cache_bytes: Self::DEFAULT_CACHE_BYTES,
            log_engine: LogEngine::Sled,
            segment_bytes: Self::DEFAULT_SEGMENT_BYTES,
        }
    }
}
