//! Client-side pieces: a small HTTP client for RaftLock's JSON endpoints. The full SDK
//! (`RaftLockClient`, `AdminClient`, `AdvancedClient`) is not built yet.

pub mod http;
