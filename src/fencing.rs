//! Fencing tokens the protected resource can verify.
//!
//! A fencing token is a number; anyone who can reach the resource can send a large one and block
//! the key for every real holder after it. With a fencing key shared between the lock service and
//! the resource (`--fencing-key-file` on `lock-node` and on `data-store`), every grant and renewal
//! carries `mac`: HMAC-SHA256 over the lock key and the token value, hex-encoded. The resource
//! recomputes it and refuses a token whose MAC does not verify, so only tokens the lock service
//! issued are accepted, for the key they were issued for.
//!
//! The MAC covers `raftlock-fencing-v1`, a zero byte, the key, a zero byte and the token value in
//! decimal: keys cannot contain a zero byte, so no two (key, value) pairs share an input.
//!
//! The MAC also covers the token's *mode*, what its holder was granted: a lock's token (the
//! input above, unchanged since the first release) or an election leader's term (the input
//! above followed by a zero byte and `leader`). A value in decimal never contains a zero byte,
//! so a leader's MAC never verifies as a lock's, nor a lock's as a leader's.
//!
//! A read-write lock's tokens are `reader` or `writer` tokens (the mode's name follows the
//! value as a leader's does), and a semaphore's are `permit` tokens of a slot (`permit`, a zero
//! byte and the slot in decimal follow the value): a reader's MAC never verifies as a writer's,
//! nor one slot's as another's.

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

const DOMAIN: &[u8] = b"raftlock-fencing-v1";

/// What a fencing token was granted for; the MAC covers it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TokenMode {
    /// The holder of a lock (exclusive).
    #[default]
    Lock,
    /// The leader of an election, for the term the token numbers.
    Leader,
    /// A reader of a read-write lock (may read, never write).
    Reader,
    /// The writer of a read-write lock.
    Writer,
    /// A permit of a semaphore, in the slot it holds.
    Permit(u32),
}

impl TokenMode {
    /// The mode's name on the wire (`"lock"`, `"leader"`, `"reader"`, `"writer"`, `"permit"`;
    /// a permit's slot travels beside it).
    pub fn as_str(self) -> &'static str {
        match self {
            TokenMode::Lock => "lock",
            TokenMode::Leader => "leader",
            TokenMode::Reader => "reader",
            TokenMode::Writer => "writer",
            TokenMode::Permit(_) => "permit",
        }
    }

    /// The mode named `name` on the wire (a permit's slot is `slot`, 0 when absent).
    pub fn parse(name: &str) -> Option<TokenMode> {
        Self::parse_with_slot(name, None)
    }

    /// The mode named `name`, with a permit's `slot`; a slot is refused for any other mode.
    pub fn parse_with_slot(name: &str, slot: Option<u32>) -> Option<TokenMode> {
        match (name, slot) {
            ("lock", None) => Some(TokenMode::Lock),
            ("leader", None) => Some(TokenMode::Leader),
            ("reader", None) => Some(TokenMode::Reader),
            ("writer", None) => Some(TokenMode::Writer),
            ("permit", slot) => Some(TokenMode::Permit(slot.unwrap_or(0))),
            _ => None,
        }
    }

    /// The mode of a grant of a read-write lock or semaphore.
    pub fn of_shared(mode: crate::lock::LockMode, slot: u32) -> TokenMode {
        match mode {
            crate::lock::LockMode::Read => TokenMode::Reader,
            crate::lock::LockMode::Write => TokenMode::Writer,
            crate::lock::LockMode::Permit => TokenMode::Permit(slot),
        }
    }

    /// A permit's slot (`None` for every other mode).
    pub fn slot(self) -> Option<u32> {
        match self {
            TokenMode::Permit(slot) => Some(slot),
            _ => None,
        }
    }
}
/// Shortest secret accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 16;

/// The secret shared by the lock service and the resources it protects.
#[derive(Clone)]
pub struct FencingKey {
    secret: Vec<u8>,
}

impl std::fmt::Debug for FencingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FencingKey(…)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FencingKeyError {
    #[error("cannot read the fencing key file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the fencing key in {path} is {len} bytes; at least {MIN_KEY_BYTES} are needed \
         (e.g. `head -c 32 /dev/urandom | base64 > {path}`)"
    )]
    TooShort { path: String, len: usize },
}

impl FencingKey {
    /// A key from its bytes (at least [`MIN_KEY_BYTES`]).
    pub fn new(secret: &[u8]) -> Option<FencingKey> {
        (secret.len() >= MIN_KEY_BYTES).then(|| FencingKey {
            secret: secret.to_vec(),
        })
    }

    /// Reads the key from a file; surrounding whitespace (a trailing newline) is not part of it.
    pub fn from_file(path: &Path) -> Result<FencingKey, FencingKeyError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| FencingKeyError::Read {
            path: shown.clone(),
            source,
        })?;
        let trimmed = bytes.trim_ascii();
        FencingKey::new(trimmed).ok_or(FencingKeyError::TooShort {
            path: shown,
            len: trimmed.len(),
        })
    }

    /// The MAC of token `value` for lock `key`, as 64 lowercase hex digits.
    pub fn mac(&self, key: &str, value: u64) -> String {
        self.mac_mode(TokenMode::Lock, key, value)
    }

    /// The MAC of token `value` of `key` granted in `mode`, as 64 lowercase hex digits.
    pub fn mac_mode(&self, mode: TokenMode, key: &str, value: u64) -> String {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.secret).expect("HMAC takes any key");
        mac.update(DOMAIN);
        mac.update(&[0]);
        mac.update(key.as_bytes());
        mac.update(&[0]);
        mac.update(value.to_string().as_bytes());
        if mode != TokenMode::Lock {
            mac.update(&[0]);
            mac.update(mode.as_str().as_bytes());
        }
        if let TokenMode::Permit(slot) = mode {
            mac.update(&[0]);
            mac.update(slot.to_string().as_bytes());
        }
        let digest = mac.finalize().into_bytes();
        let mut out = String::with_capacity(64);
        for b in digest {
            use std::fmt::Write;
            let _ = write!(out, "{b:02x}");
        }
        out
    }

    /// Whether `mac` is this key's MAC of (`key`, `value`); compared in constant time.
    pub fn verify(&self, key: &str, value: u64, mac: &str) -> bool {
        self.verify_mode(TokenMode::Lock, key, value, mac)
    }

    /// Whether `mac` is this key's MAC of (`key`, `value`) granted in `mode`.
    pub fn verify_mode(&self, mode: TokenMode, key: &str, value: u64, mac: &str) -> bool {
        let expected = self.mac_mode(mode, key, value);
        let presented = mac.trim().to_ascii_lowercase();
        bool::from(expected.as_bytes().ct_eq(presented.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mac_verifies_only_for_its_key_value_and_secret() {
        let k = FencingKey::new(b"0123456789abcdef0123").unwrap();
        let mac = k.mac("orders", 42);
        assert_eq!(mac.len(), 64);
        assert!(k.verify("orders", 42, &mac));
        assert!(k.verify("orders", 42, &mac.to_uppercase()));
        assert!(!k.verify("orders", 43, &mac));
        assert!(!k.verify("orders2", 42, &mac));
        assert!(!k.verify("orders", 42, ""));
        assert!(!k.verify("orders", 42, &mac[..63]));
        let other = FencingKey::new(b"another-secret-of-20").unwrap();
        assert!(!other.verify("orders", 42, &mac));
        // The mode is covered: a leader's MAC is not a lock's, and the other way round.
        let leader = k.mac_mode(TokenMode::Leader, "orders", 42);
        assert_ne!(leader, mac);
        assert!(k.verify_mode(TokenMode::Leader, "orders", 42, &leader));
        assert!(!k.verify_mode(TokenMode::Leader, "orders", 42, &mac));
        assert!(!k.verify("orders", 42, &leader));
        assert!(!k.verify_mode(TokenMode::Leader, "orders", 43, &leader));
        assert_eq!(TokenMode::parse("leader"), Some(TokenMode::Leader));
        assert_eq!(
            TokenMode::parse(TokenMode::Lock.as_str()),
            Some(TokenMode::Lock)
        );
        assert_eq!(TokenMode::parse("writer"), Some(TokenMode::Writer));
        assert_eq!(TokenMode::parse("owner"), None);
        assert_eq!(TokenMode::parse_with_slot("lock", Some(1)), None);
        // A reader's MAC is not a writer's nor a lock's; one slot's permit is not another's.
        let reader = k.mac_mode(TokenMode::Reader, "orders", 42);
        assert!(k.verify_mode(TokenMode::Reader, "orders", 42, &reader));
        assert!(!k.verify_mode(TokenMode::Writer, "orders", 42, &reader));
        assert!(!k.verify("orders", 42, &reader));
        let permit = k.mac_mode(TokenMode::Permit(1), "orders", 42);
        assert!(k.verify_mode(TokenMode::Permit(1), "orders", 42, &permit));
        assert!(!k.verify_mode(TokenMode::Permit(0), "orders", 42, &permit));
        assert!(!k.verify_mode(TokenMode::Permit(11), "orders", 4, &permit));
        assert_eq!(
            TokenMode::parse_with_slot("permit", Some(3)),
            Some(TokenMode::Permit(3))
        );
        // Key and value are separated: ("a1", 2) and ("a", 12) differ.
        assert_ne!(k.mac("a1", 2), k.mac("a", 12));
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(FencingKey::new(b"short").is_none());
        let dir = std::env::temp_dir().join(format!("raftlock-fk-{}", std::process::id()));
        std::fs::write(&dir, "tiny\n").unwrap();
        let err = FencingKey::from_file(&dir).unwrap_err();
        assert!(err.to_string().contains("at least 16"), "{err}");
        std::fs::write(&dir, "a-long-enough-secret-value\n").unwrap();
        let k = FencingKey::from_file(&dir).unwrap();
        assert_eq!(
            k.mac("x", 1),
            FencingKey::new(b"a-long-enough-secret-value")
                .unwrap()
                .mac("x", 1)
        );
        let _ = std::fs::remove_file(&dir);
    }
}
