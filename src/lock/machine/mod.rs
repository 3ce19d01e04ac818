//! [`LockStateMachine`]: the replicated lock state, a pure and deterministic function of the
//! committed log.
//!
//! ```text
//!   committed entry ──decode──► Command ──apply(index)──► Applied { outcome, events }
//!                                              │
//!                                              └──► dirty keys ──take_changes()──► storage batch
//! ```
//! State lives in one key space: `lock/<key>` (holder, token, ttl, FIFO waiters), `data/<key>`
//! (replicated values), `delay/<key>` (lock-delay), `elect/<key>` (elections), `session/<client>` (session leases), `shared/<key>` (read-write locks and semaphores), `meta/seq` (the one fencing sequence), `meta/applied` and
//! `meta/dedupe/<n>` (the exactly-once table, grouped into client sessions), `meta/clock` (the log
//! clock). That is the state as snapshots carry it ([`LockStateMachine::to_kv`]). The changes
//! written to the node's own storage ([`LockStateMachine::take_changes`]) keep the dedupe records
//! [`DEDUPE_BLOCK`] to a key instead (`meta/dedupe_block/<b>` holds records `b * DEDUPE_BLOCK ..`):
//! every request leaves a record, so one key per record made each write of the applied state two
//! storage writes per request. [`stored_to_snapshot_pairs`] turns stored pairs back into
//! snapshot pairs, and a store written one key per record (by an older RaftLock, or by a snapshot
//! install) moves to blocks a bounded number of blocks per write. Only ordered maps are iterated, so the same log always yields byte-identical state.
//! Time never enters from outside: lease deadlines are tracked by the leader, which proposes
//! `Expire` with the token it saw, and session idleness is measured on the log clock, which only
//! `Tick` entries (proposed by the leader) advance.
//!
//! Client sessions (the Raft dissertation's §6.3 design): every remembered answer belongs to its
//! client's session. A session closes — and only then are its answers forgotten — after
//! `session_idle_ms` of log time without a new request from its client, unless one of its
//! acquires is still queued. Bounds on sessions and on answers (per session and overall) are kept
//! by forgetting the oldest *finished* answers older than `dedupe_retain_ms`; when no answer is
//! that old, the new request is refused (`LimitReached`) and changes nothing. So a retry within
//! `dedupe_retain_ms` of its answer, or from a client whose session is open and within bounds, is
//! always answered with the original outcome.
//!
//! Where things live:
//! - `apply`: [`LockStateMachine::apply`], the cluster commands, request validation.
//! - `locks` (and `lock_entry`, how one lock is kept): acquire, release, FIFO queues, views.
//! - `leases`: renew and expiry.
//! - `kv`: the replicated key-value store.
//! - `delays`: lock-delay, the time a key stays unavailable after its holder's lease expired.
//! - `elections`: leader election on a key's lock (campaign, proclaim; resign is a release).
//! - `session_leases`: sessions that cover many locks (keepalive, end, expiry).
//! - `shared`: read-write locks and counting semaphores (many holders per key).
//! - `sessions` (and `records`, one kept answer): client sessions, the exactly-once table, `Tick`.
//! - `acks`: acknowledgements of answers ([`Command::Sequenced`]).
//! - `quotas`: byte budgets, per-identity quotas, replicated limits.
//! - `changes`: writes to the node's storage; `snapshot` and `loader`: the whole state out and in.

mod acks;
mod apply;
mod changes;
mod delays;
mod elections;
mod kv;
mod leases;
mod loader;
mod lock_entry;
mod locks;
mod quotas;
mod records;
mod session_leases;
mod sessions;
mod shared;
mod snapshot;

#[cfg(test)]
mod dedupe_storage_tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::command::Command;
use super::limits::{Limits, Quotas};
use lock_entry::LockEntry;
use quotas::IdentityUse;
use records::DedupeRecord;
use sessions::Session;

pub use acks::sequence_number;
pub use delays::LockDelayInfo;
pub use elections::ElectionInfo;
pub use loader::StateLoader;
pub use locks::{HeldLock, WaiterInfo};
pub use session_leases::SessionInfo;
pub use shared::{SharedHolderInfo, SharedLockInfo, SharedWaiterInfo};
pub use snapshot::{stored_to_snapshot_pairs, StoredToSnapshot};

const LOCK_PREFIX: &str = "lock/";
const DATA_PREFIX: &str = "data/";
/// A key's lock-delay (`delays::LockDelay`); absent while the key has none.
const DELAY_PREFIX: &str = "delay/";
/// An election's leader value and queued candidates (`elections::Election`); present exactly
/// while the key's lock entry is.
const ELECTION_PREFIX: &str = "elect/";
/// A client's session lease (`session_leases::SessionLease`); absent while it has none.
const SESSION_PREFIX: &str = "session/";
/// A read-write lock or semaphore (`shared::SharedEntry`); absent while the key is unused.
const SHARED_PREFIX: &str = "shared/";
const META_SEQ: &str = "meta/seq";
const META_APPLIED: &str = "meta/applied";
/// One key per dedupe record, as written before records were stored in blocks (read back, and
/// replaced by blocks with the next write).
const META_DEDUPE_PREFIX: &str = "meta/dedupe/";
const META_DEDUPE_BLOCK_PREFIX: &str = "meta/dedupe_block/";
/// Dedupe records per stored block.
pub const DEDUPE_BLOCK: u64 = 32;
/// Blocks of one-key-per-record storage moved to block keys per `take_changes`, besides those a
/// change touches anyway: bounds the write that follows a snapshot install or an upgrade.
const LEGACY_BLOCKS_PER_WRITE: usize = 8;
const META_DEDUPE_NEXT: &str = "meta/dedupe_next";
/// A session's acknowledgement mark: `meta/ack/<client id>` holds `(mark, at_ms)` (see
/// [`Command::Sequenced`]); absent while the session has none.
const META_ACK_PREFIX: &str = "meta/ack/";
const META_LIMITS: &str = "meta/limits";
const META_CLOCK: &str = "meta/clock";
/// The cluster version (see [`CLUSTER_VERSION`]); absent while it is 1, so that a state that
/// never had it raised stays readable by a RaftLock from before cluster versions.
const META_CLUSTER_VERSION: &str = "meta/cluster_version";
/// The cluster's identity ([`ClusterIdentity`]); absent until a leader names the cluster.
const META_CLUSTER: &str = "meta/cluster";
/// The member table (`BTreeMap<node id, MemberInfo>`); absent while empty.
const META_MEMBERS: &str = "meta/members";
/// The byte budgets and per-identity quotas ([`Quotas`]); absent until a leader set them.
const META_QUOTAS: &str = "meta/quotas";

/// The cluster version this RaftLock understands: the log commands and state keys every member
/// can apply and read. 1: everything before cluster versions existed. 2: [`Command::SetClusterVersion`]
/// and the `meta/cluster_version` key. A leader raises a cluster's version (a
/// `SetClusterVersion` entry) only once every member has said it runs at least that version, and
/// a node refuses to apply an entry that raises the version above its own: a node that cannot
/// apply the log stops instead of going on with a state that differs from the others'.
/// 3: [`Command::Sequenced`] (clients acknowledging answers) and the `meta/ack/` keys.
/// 4: [`Command::SetClusterId`] and [`Command::SetMember`], the `meta/cluster` and
/// `meta/members` keys.
/// 5: [`Command::SetQuotas`] and the `meta/quotas` key.
/// 6: [`Command::SetLockDelay`] and [`Command::EndLockDelay`], the `delay/` keys.
/// 7: [`Command::Campaign`] and [`Command::Proclaim`], the `elect/` keys.
/// 8: [`Command::KeepAlive`], [`Command::EndSession`] and [`Command::ExpireSession`], locks
/// attached to a session (a TTL of 0), the `session/` keys.
/// 9: [`Command::AcquireShared`] and [`Command::SetPermits`] (read-write locks and
/// semaphores), the `shared/` keys.
pub const CLUSTER_VERSION: u32 = 9;

/// The cluster version read-write locks and semaphores need.
pub const SHARED_VERSION: u32 = 9;

/// The cluster version sessions need.
pub const SESSION_VERSION: u32 = 8;

/// The cluster version [`Command::Campaign`] and [`Command::Proclaim`] need.
pub const ELECTION_VERSION: u32 = 7;

/// The cluster version [`Command::SetLockDelay`] and [`Command::EndLockDelay`] need.
pub const LOCK_DELAY_VERSION: u32 = 6;

/// The cluster version [`Command::SetQuotas`] needs.
pub const QUOTAS_VERSION: u32 = 5;

/// The cluster version [`Command::SetClusterId`] and [`Command::SetMember`] need.
pub const LIFECYCLE_VERSION: u32 = 4;

/// Longest peer or client address a member table entry keeps (bytes).
pub const MEMBER_ADDR_MAX: usize = 256;
/// Most entries the member table keeps (a cluster has at most a few dozen members).
pub const MEMBERS_MAX: usize = 256;

/// Where a member is reached and which incarnation of it is the member.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    pub peer_addr: String,
    pub client_addr: String,
    /// The random id the member's data directory was created with (0: not known).
    pub incarnation: u64,
}

/// The cluster's identity, set once by [`Command::SetClusterId`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterIdentity {
    pub id: u128,
    /// The `--force-new-cluster` value that started the cluster (empty: formed by itself).
    pub forced_by: String,
}

/// The cluster version [`Command::Sequenced`] needs.
pub const SEQUENCED_VERSION: u32 = 3;

/// The meta keys nearly every command changes, each marked changed by one bit of
/// `LockStateMachine::dirty_meta` rather than by a string in `dirty` (an allocation and an
/// ordered insert per command, on every node).
const DIRTY_SEQ: u16 = 1;
const DIRTY_APPLIED: u16 = 2;
const DIRTY_DEDUPE_NEXT: u16 = 4;
const DIRTY_LIMITS: u16 = 8;
const DIRTY_CLOCK: u16 = 16;
const DIRTY_CLUSTER_VERSION: u16 = 32;
const DIRTY_CLUSTER: u16 = 64;
const DIRTY_MEMBERS: u16 = 128;
const DIRTY_QUOTAS: u16 = 256;
const DIRTY_META_KEYS: [(u16, &str); 9] = [
    (DIRTY_SEQ, META_SEQ),
    (DIRTY_APPLIED, META_APPLIED),
    (DIRTY_DEDUPE_NEXT, META_DEDUPE_NEXT),
    (DIRTY_LIMITS, META_LIMITS),
    (DIRTY_CLOCK, META_CLOCK),
    (DIRTY_CLUSTER_VERSION, META_CLUSTER_VERSION),
    (DIRTY_CLUSTER, META_CLUSTER),
    (DIRTY_MEMBERS, META_MEMBERS),
    (DIRTY_QUOTAS, META_QUOTAS),
];

/// The lock service's replicated state machine.
#[derive(Clone, Debug, Default)]
pub struct LockStateMachine {
    limits: Limits,
    /// Whether `limits` came through the log (`SetLimits`) rather than from the constructor.
    limits_replicated: bool,
    applied_index: u64,
    /// The one cluster-wide fencing sequence: the last token handed out.
    fencing_seq: u64,
    /// Boxed keys and entries: a map slot of 24 bytes instead of 112, for a million held locks.
    locks: BTreeMap<Box<str>, Box<LockEntry>>,
    data: BTreeMap<String, Vec<u8>>,
    /// Lock-delays by key: configured, and running after an expiry.
    delays: BTreeMap<Box<str>, delays::LockDelay>,
    /// Entries of `delays` with a delay running (derived: counted at load).
    running_delays: usize,
    /// Elections by key: the leader's value and the queued candidates' values.
    elections: BTreeMap<Box<str>, elections::Election>,
    /// Read-write locks and semaphores by key.
    shared: BTreeMap<Box<str>, shared::SharedEntry>,
    /// Session leases by client id.
    session_leases: BTreeMap<Box<str>, session_leases::SessionLease>,
    /// Keys with a holder or a waiter attached to each client's session (derived: read off
    /// the lock entries, rebuilt at load).
    attached: BTreeMap<Box<str>, BTreeSet<Box<str>>>,
    /// The same attachments by key: the clients attached on each key, sorted (derived).
    attached_by_key: BTreeMap<Box<str>, Vec<Box<str>>>,
    /// Dedupe records by insertion number (oldest first, evicted first).
    dedupe: BTreeMap<u64, Box<DedupeRecord>>,
    dedupe_next: u64,
    /// Open client sessions by client id (derived from `dedupe`, not stored on its own).
    sessions: BTreeMap<Arc<str>, Session>,
    /// The log clock in milliseconds: the sum of applied `Tick`s.
    clock_ms: u64,
    /// The cluster version as raised by `SetClusterVersion` (0 or 1: never raised, version 1).
    cluster_version: u32,
    /// The cluster's identity, once a leader named the cluster.
    cluster: Option<ClusterIdentity>,
    /// Where each member is reached, and its incarnation.
    members: BTreeMap<u64, MemberInfo>,
    locks_held: usize,
    waiters: usize,
    /// Byte budgets and per-identity quotas, once set through the log (`SetQuotas`).
    quotas: Option<Quotas>,
    /// Bytes of keys and values in `data` (what `Quotas::data_bytes_max` bounds).
    data_bytes: u64,
    /// Bytes of held locks and queued waiters (what `Quotas::lock_bytes_max` bounds).
    lock_bytes: u64,
    /// Locks held and acquires queued per identity, kept while `by_identity` quotas apply
    /// (derived: rebuilt at load and when the quotas change).
    identity_use: BTreeMap<Box<str>, IdentityUse>,
    /// State keys changed since the last `take_changes`, besides the meta keys of `dirty_meta`.
    dirty: BTreeSet<String>,
    /// Reused to build a key for `dirty` before it is known to be new (not state: empty or
    /// the last key built).
    dirty_scratch: String,
    /// The meta keys changed since the last `take_changes` (`DIRTY_META_KEYS`).
    dirty_meta: u16,
    /// Dedupe blocks changed since the last `take_changes`.
    dirty_blocks: BTreeSet<u64>,
    /// Sessions whose acknowledgement mark changed since the last `take_changes`.
    dirty_acks: BTreeSet<Arc<str>>,
    /// Records (present or since forgotten) whose storage is still one key each
    /// (`meta/dedupe/<n>`, read by `from_kv`): a write of their block deletes those keys.
    legacy_dedupe_keys: BTreeSet<u64>,
    /// Known bugs switched on (test and `mutations` builds only; see [`MachineBugs`]).
    #[cfg(any(test, feature = "mutations"))]
    bugs: MachineBugs,
}

/// State machine bugs the simulator must catch, switched on through the node's `NodeBugs` in
/// test builds and in a lock-node built with the `mutations` feature, never otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MachineBugs {
    /// A proclaim is applied without checking that its token holds the election.
    pub proclaim_skips_holder_check: bool,
    /// A candidate elected by a hand-off shows no value (until it proclaims one).
    pub elected_by_hand_off_without_value: bool,
    /// Ending a session releases its attached locks but leaves its attached acquires queued.
    pub session_end_keeps_waiters: bool,
    /// A session's expiry applies although a keepalive restarted its lease since.
    pub session_expiry_ignores_keepalive: bool,
    /// A reader is granted beside a writer (when the queue is empty).
    pub reader_beside_writer: bool,
    /// A semaphore hands out one permit more than its size (when the queue is empty).
    pub permit_over_size: bool,
    /// Cancelling a shared lock's waiter does not grant the waiters behind it that now fit.
    pub shared_cancel_skips_grant: bool,
    /// Ending a session leaves its read-write locks and permits (held and queued) in place.
    pub session_end_skips_shared: bool,
}

impl PartialEq for LockStateMachine {
    fn eq(&self, other: &Self) -> bool {
        self.to_kv() == other.to_kv()
    }
}

impl LockStateMachine {
    pub fn new(limits: Limits) -> Self {
        LockStateMachine {
            limits,
            ..Default::default()
        }
    }

    /// Switches known bugs on (test and `mutations` builds only).
    #[cfg(any(test, feature = "mutations"))]
    pub fn set_bugs(&mut self, bugs: MachineBugs) {
        self.bugs = bugs;
    }

    #[cfg(any(test, feature = "mutations"))]
    fn bug(&self, which: impl Fn(&MachineBugs) -> bool) -> bool {
        which(&self.bugs)
    }

    #[cfg(not(any(test, feature = "mutations")))]
    fn bug(&self, _which: impl Fn(&MachineBugs) -> bool) -> bool {
        false
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// Whether the limits in force were set through the log (`SetLimits`).
    pub fn limits_replicated(&self) -> bool {
        self.limits_replicated
    }

    pub fn applied_index(&self) -> u64 {
        self.applied_index
    }

    /// The last fencing token value handed out (0 before the first grant).
    pub fn fencing_sequence(&self) -> u64 {
        self.fencing_seq
    }

    pub fn locks_held(&self) -> usize {
        self.locks_held
    }

    pub fn waiter_count(&self) -> usize {
        self.waiters
    }

    pub fn dedupe_len(&self) -> usize {
        self.dedupe.len()
    }

    /// Open client sessions.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Remembered answers in `client_id`'s session (0 when it has none).
    pub fn session_len(&self, client_id: &str) -> usize {
        self.sessions.get(client_id).map_or(0, |s| s.records.len())
    }

    /// The log clock: milliseconds of leader time carried by applied `Tick`s.
    pub fn log_clock_ms(&self) -> u64 {
        self.clock_ms
    }

    /// The cluster version: what every member has said it understands (see
    /// [`CLUSTER_VERSION`]).
    pub fn cluster_version(&self) -> u32 {
        self.cluster_version.max(1)
    }

    /// The cluster's identity (`None` until a leader named the cluster).
    pub fn cluster_identity(&self) -> Option<&ClusterIdentity> {
        self.cluster.as_ref()
    }

    /// The cluster id (`None` until a leader named the cluster).
    pub fn cluster_id(&self) -> Option<u128> {
        self.cluster.as_ref().map(|c| c.id)
    }

    /// The member table: where each member is reached and its incarnation.
    pub fn members(&self) -> &BTreeMap<u64, MemberInfo> {
        &self.members
    }
}
