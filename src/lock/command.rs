//! Lock commands as they travel through the Raft log: the [`Command`] enum, the [`FencingToken`]
//! it carries, and their byte encoding.
//!
//! ```text
//!   client request ──► server builds Command ──► encode() ──► raft log ──► decode() ──► apply()
//! ```
//!
//! The encoding is one format-version byte followed by `postcard`. Decoding garbage returns a
//! [`DecodeError`]; it must never panic, because log bytes reach it from peers and disk. New
//! variants are appended at the end of [`Command`] so that old log entries keep their meaning.

use serde::{Deserialize, Serialize};

/// The first byte of every encoded command. Bump it when the encoding changes incompatibly.
const COMMAND_FORMAT_VERSION: u8 = 1;
/// The first byte of an encoded [`Command::Sequenced`]: its `ack_below`, then the command it
/// carries in the encoding of [`COMMAND_FORMAT_VERSION`] without the version byte.
const SEQUENCED_FORMAT_VERSION: u8 = 2;

/// A fencing token: the lock key and the value of the cluster-wide fencing sequence at the grant.
/// Values strictly increase per key and across the whole cluster and are never reused.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FencingToken {
    pub key: String,
    pub value: u64,
}

/// One replicated lock-service operation. Client-originated commands carry
/// `(client_id, request_id)` for exactly-once application; `Expire` is proposed only by the leader
/// and `CancelWait` by the leader (wait timeout, disconnected client) or by the waiting client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Take the lock on `key`, or join its FIFO queue. `wait_timeout_ms`: `None` waits until
    /// granted or cancelled, `Some(0)` never waits (answered `Busy` when held), `Some(t)` waits and
    /// the leader proposes `CancelWait` after `t` ms in the queue.
    Acquire {
        key: String,
        client_id: String,
        request_id: String,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
    },
    /// Give the lock back. Applies only if `token` is the current holder's token and `client_id`
    /// is the holder; the next waiter, if any, is granted in the same apply.
    Release {
        key: String,
        client_id: String,
        request_id: String,
        token: FencingToken,
    },
    /// Set a new lease length for the held lock (the leader restarts the lease from now).
    Renew {
        key: String,
        client_id: String,
        request_id: String,
        token: FencingToken,
        ttl_ms: u64,
    },
    /// Remove the queued `Acquire` identified by `(client_id, request_id)` from `key`'s queue.
    CancelWait {
        key: String,
        client_id: String,
        request_id: String,
    },
    /// Replicated key-value write ("AppendData"). With a `guard`, it applies only if that token
    /// still holds the lock named by `guard.key`.
    Put {
        key: String,
        value: Vec<u8>,
        guard: Option<FencingToken>,
        client_id: String,
        request_id: String,
    },
    /// Replicated key-value delete ("AppendData"), guarded like `Put`.
    Delete {
        key: String,
        guard: Option<FencingToken>,
        client_id: String,
        request_id: String,
    },
    /// Proposed by the leader when a lease runs out; applies only if the lock on `key` is still
    /// held with fencing token value `token`. Kept for log entries written before
    /// [`Command::ExpireLease`]; a leader proposes only `ExpireLease`.
    Expire { key: String, token: u64 },
    /// Proposed by the leader when a lease runs out; applies only if the lock on `key` is still
    /// held with fencing token value `token` *and* its lease was last started at log index
    /// `lease_index` (the grant or the latest renew). A renew committed after the leader saw the
    /// lease run out starts a new lease, and this expiry then changes nothing.
    ExpireLease {
        key: String,
        token: u64,
        lease_index: u64,
    },
    /// Limits in the encoding used before client sessions existed (read from old logs only; a
    /// leader proposes [`Command::SetLimits`]).
    SetLimitsV1 { limits: super::limits::LimitsV1 },
    /// Give the lock back without naming the token (seed 000's release): applies only if
    /// `client_id` holds `key`. Releasing by token is safer — a client that lost its lease and
    /// got it again under the same id cannot release the newer hold by mistake with a token.
    ReleaseHeld {
        key: String,
        client_id: String,
        request_id: String,
    },
    /// Sets the limits every replica applies commands with (waiters per key, TTL bounds, sizes,
    /// table and session bounds). Proposed by the first leader of a cluster from its
    /// configuration, so that replicas never judge one entry differently because their flags
    /// differ.
    SetLimits { limits: super::Limits },
    /// Advances the log clock by `elapsed_ms`: the time the proposing leader measured on its
    /// monotonic clock since its previous tick. Client sessions idle for longer than
    /// `session_idle_ms` of log time are closed when it applies. Proposed by the leader about once
    /// a second while sessions exist; a gap between two leaders is not counted (sessions live
    /// longer, never shorter).
    Tick { elapsed_ms: u64 },
    /// Raises the cluster version: the set of log commands and state every member understands.
    /// Proposed by a leader only once every member of the configuration has said it runs a
    /// RaftLock of at least `version` (see `lock::CLUSTER_VERSION`); never lowers it.
    SetClusterVersion { version: u32 },
    // New variants go here, before `Sequenced`: serde numbers the variants it encodes by their
    // place in the enum but decodes by their place among the variants it does not skip.
    /// Names the cluster (needs cluster version 4): proposed once by a cluster's first leader
    /// (or, in a cluster from before cluster ids, by the leader once every member understands
    /// it). Applies only while the state has no cluster id: a cluster's id never changes.
    /// `forced_by`: the operator's one-shot `--force-new-cluster` value that started this
    /// cluster, empty when it formed by itself.
    SetClusterId { id: u128, forced_by: String },
    /// Records (`Some`) or forgets (`None`) where member `id` is reached and which incarnation of
    /// it (the random id its data directory was created with) is the member (needs cluster
    /// version 4). Every node reads the table from its own storage at start, so a cluster whose
    /// every node restarts at once knows where its members are.
    SetMember {
        id: u64,
        info: Option<crate::lock::MemberInfo>,
    },
    /// Sets the byte budgets and per-identity quotas every replica applies commands with
    /// (needs cluster version 5). Proposed by a leader whose configured quotas differ from the
    /// replicated ones: the leader's flags win, so a rolling restart with new flags changes them.
    SetQuotas { quotas: super::limits::Quotas },
    /// Sets `key`'s lock-delay (needs cluster version 6): after a holder's lease of `key`
    /// *expires*, the key is granted to no one for `delay_ms`, for resources that cannot check
    /// fencing tokens. 0 removes the setting (a delay already running still runs out).
    SetLockDelay {
        key: String,
        delay_ms: u64,
        client_id: String,
        request_id: String,
    },
    /// Proposed by the leader once `key`'s lock-delay, started when the lease of fencing token
    /// `token` expired, has run for its length on the leader's clock (needs cluster version 6).
    /// Applies only while that delay runs; the next waiter is granted in the same apply.
    EndLockDelay { key: String, token: u64 },
    /// Campaign to lead the election `key` (needs cluster version 7): an [`Command::Acquire`] of
    /// the election's lock that also carries the value the candidate proclaims once elected. The
    /// leader is the election lock's holder; its fencing token is the election's term. A key is
    /// either an election or a plain lock while it is in use: an `Acquire` of an election key,
    /// or a `Campaign` on a key held or awaited as a plain lock, is refused.
    Campaign {
        key: String,
        client_id: String,
        request_id: String,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
        value: Vec<u8>,
    },
    /// The elected leader of `key` (holder of `token`) sets the value the election shows
    /// (needs cluster version 7). Resigning is a [`Command::Release`] of the election's token.
    Proclaim {
        key: String,
        client_id: String,
        request_id: String,
        token: FencingToken,
        value: Vec<u8>,
    },
    /// Opens or keeps alive `client_id`'s session (needs cluster version 8): a lease of `ttl_ms`
    /// that covers every lock and candidacy the client attached to it (acquired with a TTL of
    /// 0). `session` 0 opens the client's session, or keeps alive the one it has; any other
    /// value keeps alive only the session opened at that log index, and is answered
    /// `NoSession` once it ended: its attached locks are gone.
    KeepAlive {
        client_id: String,
        session: u64,
        ttl_ms: u64,
    },
    /// Ends `client_id`'s session `session` (the log index that opened it): every lock attached
    /// to it is released and every attached acquire leaves its queue, in this one entry (needs
    /// cluster version 8). A session that already ended is answered `NoSession`.
    EndSession { client_id: String, session: u64 },
    /// Proposed by the leader when a session's lease ran out (needs cluster version 8): applies
    /// only if `client_id`'s session `session` was last kept alive at `lease_index`. Every
    /// attached lock expires (its lock-delay starts) and every attached acquire leaves its
    /// queue, in this one entry.
    ExpireSession {
        client_id: String,
        session: u64,
        lease_index: u64,
    },
    /// Takes a read-write lock in `mode` `Read` or `Write`, or one permit of a semaphore
    /// (`Permit`), on a key of its own (needs cluster version 9). Granted at once when the
    /// key's queue is empty and the mode fits beside the holders (readers beside readers; a
    /// writer alone; fewer holders than permits), queued in FIFO order across modes otherwise.
    /// `permits`: for a permit, the size a semaphore not in use yet starts with (an admin's
    /// `SetPermits`, or the size in use, wins); 0 for a read or write lock. `wait_timeout_ms`
    /// as in [`Command::Acquire`]. Released, renewed, cancelled and expired by the plain
    /// commands, each naming its holder's own token.
    AcquireShared {
        key: String,
        client_id: String,
        request_id: String,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
        mode: LockMode,
        permits: u32,
    },
    /// Sets semaphore `key`'s size to `permits` (needs cluster version 9): kept while the key
    /// is unused, until set again; 0 forgets the setting. Lowering it below the holders lets
    /// them keep their permits; new grants wait until they fit.
    SetPermits {
        key: String,
        permits: u32,
        client_id: String,
        request_id: String,
    },
    /// A client request that acknowledges earlier answers (needs cluster version 3). Its
    /// `command`'s request id is the request's sequence number in its client's session (decimal,
    /// from 1), and `ack_below` says the client has the answer of every request of its session
    /// numbered below it and sends none of them again. A replica forgets those answers, and
    /// refuses a request numbered below the highest `ack_below` it applied for the session whose
    /// answer it no longer keeps: that is a delayed copy of an answered request, never new work.
    ///
    /// Encoded in its own format ([`SEQUENCED_FORMAT_VERSION`]: `ack_below`, then the plain
    /// command), never as a variant of this enum: decoding cannot nest one inside another, so
    /// bytes from a peer cannot make decoding recurse.
    #[serde(skip)]
    Sequenced {
        ack_below: u64,
        command: Box<Command>,
    },
}

/// How a shared lock is held: a read-write lock's reader or writer, or a semaphore's permit.
/// Fencing tokens carry it (the fencing MAC covers it), so a reader's token never passes as a
/// writer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum LockMode {
    Read,
    Write,
    Permit,
}

impl LockMode {
    /// The mode's name on the wire: `read`, `write` or `permit`.
    pub fn as_str(self) -> &'static str {
        match self {
            LockMode::Read => "read",
            LockMode::Write => "write",
            LockMode::Permit => "permit",
        }
    }

    /// Parses a wire name ([`LockMode::as_str`]).
    pub fn parse(name: &str) -> Option<LockMode> {
        match name {
            "read" => Some(LockMode::Read),
            "write" => Some(LockMode::Write),
            "permit" => Some(LockMode::Permit),
            _ => None,
        }
    }
}

/// The fields of an acquire ([`Command::as_acquire`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcquireParts<'a> {
    pub key: &'a String,
    pub client_id: &'a String,
    pub request_id: &'a String,
    pub ttl_ms: u64,
    pub wait_timeout_ms: Option<u64>,
}

/// Why bytes could not be turned into a command, a snapshot or a state machine.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty input")]
    Empty,
    #[error("unknown format version {0}")]
    UnknownVersion(u8),
    #[error("malformed encoding: {0}")]
    Malformed(String),
    #[error("{0} trailing bytes after the encoded value")]
    TrailingBytes(usize),
    #[error("persisted state is inconsistent: {0}")]
    InvalidState(String),
}

impl Command {
    /// Bytes for the Raft log.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Command::Sequenced { ack_below, command } => {
                encode_versioned(SEQUENCED_FORMAT_VERSION, &(ack_below, command.request()))
            }
            plain => encode_versioned(COMMAND_FORMAT_VERSION, plain),
        }
    }

    /// Parses bytes produced by [`Command::encode`]. Never panics; trailing bytes are an error.
    pub fn decode(bytes: &[u8]) -> Result<Command, DecodeError> {
        if bytes.first() == Some(&SEQUENCED_FORMAT_VERSION) {
            let (ack_below, command): (u64, Command) =
                decode_versioned(SEQUENCED_FORMAT_VERSION, bytes)?;
            return Ok(Command::Sequenced {
                ack_below,
                command: Box::new(command),
            });
        }
        decode_versioned(COMMAND_FORMAT_VERSION, bytes)
    }

    /// The lock or data key the command addresses.
    pub fn key(&self) -> &str {
        match self {
            Command::Acquire { key, .. }
            | Command::Release { key, .. }
            | Command::ReleaseHeld { key, .. }
            | Command::Renew { key, .. }
            | Command::CancelWait { key, .. }
            | Command::Put { key, .. }
            | Command::Delete { key, .. }
            | Command::Expire { key, .. }
            | Command::ExpireLease { key, .. }
            | Command::SetLockDelay { key, .. }
            | Command::EndLockDelay { key, .. }
            | Command::Campaign { key, .. }
            | Command::Proclaim { key, .. }
            | Command::AcquireShared { key, .. }
            | Command::SetPermits { key, .. } => key,
            Command::SetLimits { .. }
            | Command::SetLimitsV1 { .. }
            | Command::Tick { .. }
            | Command::SetClusterVersion { .. }
            | Command::SetClusterId { .. }
            | Command::SetMember { .. }
            | Command::SetQuotas { .. }
            | Command::KeepAlive { .. }
            | Command::EndSession { .. }
            | Command::ExpireSession { .. } => "",
            Command::Sequenced { command, .. } => command.key(),
        }
    }

    /// The acquire this command is, if it is one (an [`Command::Acquire`] or a
    /// [`Command::Campaign`]): what waits in a key's queue and is granted a lease.
    pub fn as_acquire(&self) -> Option<AcquireParts<'_>> {
        match self {
            Command::Acquire {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
            }
            | Command::Campaign {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                ..
            }
            | Command::AcquireShared {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
                ..
            } => Some(AcquireParts {
                key,
                client_id,
                request_id,
                ttl_ms: *ttl_ms,
                wait_timeout_ms: *wait_timeout_ms,
            }),
            _ => None,
        }
    }

    /// The client request itself: the command a [`Command::Sequenced`] carries, any other as it is.
    pub fn request(&self) -> &Command {
        match self {
            Command::Sequenced { command, .. } => command.request(),
            other => other,
        }
    }

    /// `(client_id, request_id)` of a command answered exactly once (the dedupe table's key), or
    /// `None` for commands without a request id (leader-proposed expiry, cancel, empty id).
    pub fn dedupe_id(&self) -> Option<(&str, &str)> {
        match self {
            Command::Acquire {
                client_id,
                request_id,
                ..
            }
            | Command::Release {
                client_id,
                request_id,
                ..
            }
            | Command::ReleaseHeld {
                client_id,
                request_id,
                ..
            }
            | Command::Renew {
                client_id,
                request_id,
                ..
            }
            | Command::Put {
                client_id,
                request_id,
                ..
            }
            | Command::Delete {
                client_id,
                request_id,
                ..
            }
            | Command::SetLockDelay {
                client_id,
                request_id,
                ..
            }
            | Command::Campaign {
                client_id,
                request_id,
                ..
            }
            | Command::Proclaim {
                client_id,
                request_id,
                ..
            }
            | Command::AcquireShared {
                client_id,
                request_id,
                ..
            }
            | Command::SetPermits {
                client_id,
                request_id,
                ..
            } if !request_id.is_empty() => Some((client_id, request_id)),
            Command::Sequenced { command, .. } => command.dedupe_id(),
            _ => None,
        }
    }
}

/// `version` byte followed by the postcard encoding of `value`.
pub(crate) fn encode_versioned<T: Serialize>(version: u8, value: &T) -> Vec<u8> {
    // Commands (every client request) are small: encode on the stack and allocate the result
    // once, at its size, instead of growing a Vec from empty (several reallocations each).
    let mut scratch = [0u8; 256];
    scratch[0] = version;
    if let Ok(body) = postcard::to_slice(value, &mut scratch[1..]) {
        let len = 1 + body.len();
        return scratch[..len].to_vec();
    }
    // Serializing plain data into a growable Vec has no failure mode for our types.
    postcard::to_extend(value, vec![version]).expect("postcard encoding into a Vec cannot fail")
}

/// Inverse of [`encode_versioned`]: checks the version byte and that every byte is consumed.
pub(crate) fn decode_versioned<T: for<'de> Deserialize<'de>>(
    version: u8,
    bytes: &[u8],
) -> Result<T, DecodeError> {
    let (&found, body) = bytes.split_first().ok_or(DecodeError::Empty)?;
    if found != version {
        return Err(DecodeError::UnknownVersion(found));
    }
    let (value, rest) =
        postcard::take_from_bytes(body).map_err(|err| DecodeError::Malformed(err.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    Ok(value)
}

/// Postcard encoding without a version byte, for values nested inside versioned containers.
pub(crate) fn encode_plain<T: Serialize>(value: &T) -> Vec<u8> {
    postcard::to_allocvec(value).expect("postcard encoding into a Vec cannot fail")
}

/// Inverse of [`encode_plain`]; every byte must be consumed.
pub(crate) fn decode_plain<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, DecodeError> {
    let (value, rest) =
        postcard::take_from_bytes(bytes).map_err(|err| DecodeError::Malformed(err.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes(rest.len()));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Command> {
        let token = FencingToken {
            key: "orders".into(),
            value: 17,
        };
        vec![
            Command::Acquire {
                key: "orders".into(),
                client_id: "worker-7".into(),
                request_id: "r-42".into(),
                ttl_ms: 10_000,
                wait_timeout_ms: Some(30_000),
            },
            Command::Release {
                key: "orders".into(),
                client_id: "worker-7".into(),
                request_id: "r-43".into(),
                token: token.clone(),
            },
            Command::Renew {
                key: "orders".into(),
                client_id: "worker-7".into(),
                request_id: "r-44".into(),
                token: token.clone(),
                ttl_ms: 5_000,
            },
            Command::CancelWait {
                key: "orders".into(),
                client_id: "worker-8".into(),
                request_id: "r-1".into(),
            },
            Command::Put {
                key: "cfg".into(),
                value: b"v".to_vec(),
                guard: Some(token),
                client_id: "c".into(),
                request_id: "1".into(),
            },
            Command::Delete {
                key: "cfg".into(),
                guard: None,
                client_id: "c".into(),
                request_id: "2".into(),
            },
            Command::Expire {
                key: "orders".into(),
                token: 17,
            },
            Command::ExpireLease {
                key: "orders".into(),
                token: 17,
                lease_index: 40,
            },
            Command::SetLimits {
                limits: crate::lock::Limits::default(),
            },
            Command::ReleaseHeld {
                key: "orders".into(),
                client_id: "worker-7".into(),
                request_id: "r-45".into(),
            },
            Command::Tick { elapsed_ms: 1_000 },
            Command::SetClusterVersion { version: 2 },
            Command::SetQuotas {
                quotas: crate::lock::limits::Quotas::default(),
            },
            Command::SetLockDelay {
                key: "orders".into(),
                delay_ms: 5_000,
                client_id: "ops".into(),
                request_id: "d-1".into(),
            },
            Command::EndLockDelay {
                key: "orders".into(),
                token: 17,
            },
            Command::Campaign {
                key: "shard-3".into(),
                client_id: "worker-7".into(),
                request_id: "c-1".into(),
                ttl_ms: 10_000,
                wait_timeout_ms: None,
                value: b"10.0.0.7:8080".to_vec(),
            },
            Command::Proclaim {
                key: "shard-3".into(),
                client_id: "worker-7".into(),
                request_id: "c-2".into(),
                token: FencingToken {
                    key: "shard-3".into(),
                    value: 18,
                },
                value: b"10.0.0.7:9090".to_vec(),
            },
            Command::Sequenced {
                ack_below: 6,
                command: Box::new(Command::Acquire {
                    key: "orders".into(),
                    client_id: "worker-9".into(),
                    request_id: "7".into(),
                    ttl_ms: 10_000,
                    wait_timeout_ms: None,
                }),
            },
        ]
    }

    #[test]
    fn a_sequenced_command_is_format_two_its_mark_then_the_plain_command() {
        let put = Command::Put {
            key: "k".into(),
            value: b"v".to_vec(),
            guard: None,
            client_id: "c".into(),
            request_id: "1".into(),
        };
        let plain = put.encode();
        assert_eq!(plain, [1, 4, 1, b'k', 1, b'v', 0, 1, b'c', 1, b'1']);
        let sequenced = Command::Sequenced {
            ack_below: 300,
            command: Box::new(put),
        };
        let mut expected = vec![2, 0xac, 0x02];
        expected.extend(&plain[1..]);
        assert_eq!(sequenced.encode(), expected);
    }

    #[test]
    fn a_sequenced_command_never_nests_in_its_encoding() {
        let acquire = Command::Acquire {
            key: "k".into(),
            client_id: "c".into(),
            request_id: "3".into(),
            ttl_ms: 1_000,
            wait_timeout_ms: None,
        };
        let nested = Command::Sequenced {
            ack_below: 2,
            command: Box::new(Command::Sequenced {
                ack_below: 1,
                command: Box::new(acquire.clone()),
            }),
        };
        let bytes = nested.encode();
        assert_eq!(bytes[0], SEQUENCED_FORMAT_VERSION);
        assert_eq!(
            Command::decode(&bytes),
            Ok(Command::Sequenced {
                ack_below: 2,
                command: Box::new(acquire.clone()),
            })
        );
        assert_eq!(nested.request(), &acquire);
        assert_eq!(nested.dedupe_id(), Some(("c", "3")));
        // The plain format has no variant for it: a peer cannot nest one in the bytes.
        let mut plain = vec![COMMAND_FORMAT_VERSION];
        plain.extend(std::iter::repeat_n(13u8, 100_000));
        assert!(Command::decode(&plain).is_err());
    }

    #[test]
    fn every_command_round_trips() {
        for cmd in sample() {
            assert_eq!(Command::decode(&cmd.encode()), Ok(cmd));
        }
    }

    #[test]
    fn limits_written_before_sessions_still_decode() {
        // Variant 8 with the nine fields limits had before client sessions.
        let old = crate::lock::limits::LimitsV1 {
            key_bytes_max: 64,
            value_bytes_max: 128,
            id_bytes_max: 32,
            ttl_ms_max: 60_000,
            wait_timeout_ms_max: 60_000,
            waiters_per_key_max: 8,
            locks_held_max: 100,
            data_entries_max: 100,
            dedupe_entries_max: 1_000,
        };
        let bytes = Command::SetLimitsV1 {
            limits: old.clone(),
        }
        .encode();
        assert_eq!(bytes[1], 8, "the old variant keeps its index");
        match Command::decode(&bytes) {
            Ok(Command::SetLimitsV1 { limits }) => {
                let new = crate::lock::Limits::from(limits);
                assert_eq!(new.waiters_per_key_max, 8);
                assert_eq!(new.dedupe_entries_max, 1_000);
                assert_eq!(
                    new.sessions_max,
                    crate::lock::Limits::default().sessions_max
                );
            }
            other => panic!("decoded {other:?}"),
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(Command::decode(&[]), Err(DecodeError::Empty));
        assert_eq!(
            Command::decode(&[9, 0]),
            Err(DecodeError::UnknownVersion(9))
        );
        assert!(matches!(
            Command::decode(&[1, 200]),
            Err(DecodeError::Malformed(_))
        ));
        // A huge declared string length must not allocate or panic.
        assert!(Command::decode(&[1, 0, 0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
        let mut trailing = sample()[0].encode();
        trailing.push(0);
        assert_eq!(
            Command::decode(&trailing),
            Err(DecodeError::TrailingBytes(1))
        );
        // Every truncation and every single-byte corruption of valid input is handled.
        for cmd in sample() {
            let bytes = cmd.encode();
            for len in 0..bytes.len() {
                let _ = Command::decode(&bytes[..len]);
            }
            for at in 0..bytes.len() {
                for flip in [0x01u8, 0x80, 0xff] {
                    let mut corrupt = bytes.clone();
                    corrupt[at] ^= flip;
                    let _ = Command::decode(&corrupt);
                }
            }
        }
    }
}
