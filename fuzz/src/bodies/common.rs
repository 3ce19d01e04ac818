//! What the fuzz bodies and the corpus generator share.

use raftlock::lock::Limits;

/// Limits small enough that a short input reaches every bound (the corpus is generated for them).
pub fn small_limits() -> Limits {
    Limits {
        key_bytes_max: 16,
        value_bytes_max: 32,
        id_bytes_max: 16,
        ttl_ms_max: 60_000,
        wait_timeout_ms_max: 60_000,
        waiters_per_key_max: 3,
        locks_held_max: 4,
        data_entries_max: 4,
        dedupe_entries_max: 6,
        sessions_max: 3,
        session_entries_max: 3,
        session_idle_ms: 5_000,
        dedupe_retain_ms: 2_000,
    }
}

/// Splits the input into chunks, each prefixed by its length (two bytes, little-endian); at most
/// `max` chunks.
pub fn chunks(mut rest: &[u8], max: usize) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while rest.len() >= 2 && out.len() < max {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
        rest = &rest[2..];
        let len = len.min(rest.len());
        let (chunk, tail) = rest.split_at(len);
        out.push(chunk);
        rest = tail;
    }
    out
}
