//! [`LockStateMachine`]: the replicated lock state, a pure and deterministic function of the
//! committed log.
//!
//! ```text
//!   committed entry ──decode──► Command ──apply(index)──► Applied { outcome, events }
//!                                              │
//!                                              └──► dirty keys ──take_changes()──► storage batch
//! ```
//! State lives in one key space: `lock/<key>` (holder, token, ttl, FIFO waiters), `data/<key>`
//! (replicated values), `meta/seq` (the one fencing sequence), `meta/applied` and
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

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::command::{decode_plain, encode_plain, Command, DecodeError, FencingToken};
use super::limits::{identity_of, Limits, Quotas, LOCK_ENTRY_OVERHEAD};
use super::outcome::{Applied, Event, Outcome, RejectCode};

const LOCK_PREFIX: &str = "lock/";
const DATA_PREFIX: &str = "data/";
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
pub const CLUSTER_VERSION: u32 = 5;

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

/// A session's answers looked at, at most, when an acknowledgement forgets those below its mark
/// (oldest first; answers not forgotten then go by age like any other).
const ACK_SCAN_MAX: usize = 256;

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
/// Longest step one `Tick` may advance the log clock by: a leader that was paused (and has not
/// noticed it lost leadership) cannot age every session at once.
pub const TICK_MAX_MS: u64 = 10_000;
/// Queued answers skipped at most while looking for the oldest finished one to forget.
const EVICT_SCAN_MAX: usize = 1024;
const SNAPSHOT_VERSION: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Holder {
    // Boxed strings: 16 bytes each instead of 24, for a million held locks.
    client_id: Box<str>,
    request_id: Box<str>,
    token: u64,
    ttl_ms: u64,
    /// Log index at which the current lease started: the grant or the latest renew.
    lease_index: u64,
}

/// The holder record written before leases carried their start index (read back only).
#[derive(Deserialize)]
struct HolderV1 {
    client_id: Box<str>,
    request_id: Box<str>,
    token: u64,
    ttl_ms: u64,
}

#[derive(Deserialize)]
struct LockEntryV1 {
    holder: Option<HolderV1>,
    waiters: VecDeque<Waiter>,
}

impl From<LockEntryV1> for LockEntry {
    fn from(old: LockEntryV1) -> Self {
        LockEntry {
            holder: old.holder.map(|h| Holder {
                client_id: h.client_id,
                request_id: h.request_id,
                token: h.token,
                ttl_ms: h.ttl_ms,
                lease_index: 0,
            }),
            waiters: old.waiters.into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Waiter {
    client_id: Box<str>,
    request_id: Box<str>,
    ttl_ms: u64,
    wait_timeout_ms: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct LockEntry {
    holder: Option<Holder>,
    waiters: Waiters,
}

/// A key's queue of waiters. Most held locks have none, so an empty queue is a null pointer
/// (8 bytes in every lock) rather than an empty `VecDeque` (32). Encoded as the sequence of its
/// waiters: the same bytes a `VecDeque` gives, so stored locks and snapshots read either way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
// The box is the point: one pointer in every lock instead of the queue's 32 bytes.
#[allow(clippy::box_collection)]
struct Waiters(Option<Box<VecDeque<Waiter>>>);

impl Waiters {
    fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.0.iter().flat_map(|queue| queue.iter())
    }

    fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |queue| queue.len())
    }

    fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    fn push_back(&mut self, waiter: Waiter) {
        self.0.get_or_insert_with(Box::default).push_back(waiter);
    }

    fn pop_front(&mut self) -> Option<Waiter> {
        self.remove(0)
    }

    fn remove(&mut self, position: usize) -> Option<Waiter> {
        let queue = self.0.as_mut()?;
        let waiter = queue.remove(position);
        if queue.is_empty() {
            self.0 = None;
        }
        waiter
    }
}

impl From<VecDeque<Waiter>> for Waiters {
    fn from(queue: VecDeque<Waiter>) -> Self {
        Waiters((!queue.is_empty()).then(|| Box::new(queue)))
    }
}

impl Serialize for Waiters {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = serializer.serialize_seq(Some(self.len()))?;
        for waiter in self.iter() {
            seq.serialize_element(waiter)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Waiters {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        VecDeque::<Waiter>::deserialize(deserializer).map(Waiters::from)
    }
}

/// One client's session: its remembered answers by insertion number (oldest first).
#[derive(Clone, Debug, Default)]
struct Session {
    records: SessionRecords,
    /// The exactly-once lookup: record numbers by the hash of their request id.
    by_request: RequestIndex,
    /// How many of them answer an acquire that is still queued.
    queued: usize,
    /// The highest `ack_below` the client sent ([`Command::Sequenced`]), 0 for none: its answers
    /// numbered below are forgotten, and a request numbered below that is not remembered is
    /// refused. A session with a mark stays open without answers until it is idle.
    mark: u64,
    /// Log clock when `mark` was last raised (the session is active then).
    mark_at_ms: u64,
}

/// A session's record numbers in ascending order. Numbers only grow, so a new answer goes at
/// the back in O(1), where the ordered set this replaced walked its tree for every answer
/// (about 2% of a follower's CPU at 32 clients). A forgotten number may stay behind as a dead
/// entry until it reaches an end: every caller can tell a live number by the table holding it
/// (numbers are never reused), and dead entries are dropped at both ends at once and swept out
/// whenever they outnumber the live ones, so the deque stays within about twice the session.
#[derive(Clone, Debug, Default)]
struct SessionRecords {
    numbers: VecDeque<u64>,
    live: usize,
}

impl SessionRecords {
    fn len(&self) -> usize {
        self.live
    }

    fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Adds `n` (not remembered now): at the back unless a reload delivers numbers out of
    /// order. A dead entry of the same number is taken as it is.
    fn insert(&mut self, n: u64) {
        match self.numbers.back() {
            Some(&last) if last >= n => {
                let at = self.numbers.partition_point(|&m| m < n);
                if self.numbers.get(at) != Some(&n) {
                    self.numbers.insert(at, n);
                }
            }
            _ => self.numbers.push_back(n),
        }
        self.live += 1;
    }

    /// `n` was forgotten (it is no longer live); `live` tells the numbers still remembered.
    fn remove(&mut self, n: u64, live: impl Fn(u64) -> bool) {
        self.live = self.live.saturating_sub(1);
        if self.numbers.front() == Some(&n) {
            self.numbers.pop_front();
        } else if self.numbers.back() == Some(&n) {
            self.numbers.pop_back();
        }
        while self.numbers.front().is_some_and(|&m| !live(m)) {
            self.numbers.pop_front();
        }
        while self.numbers.back().is_some_and(|&m| !live(m)) {
            self.numbers.pop_back();
        }
        if self.numbers.len() > 2 * self.live + 16 {
            self.numbers.retain(|&m| live(m));
            if self.numbers.capacity() > 4 * self.numbers.len() + 64 {
                self.numbers.shrink_to_fit();
            }
        }
    }

    /// The newest remembered number (the back is never dead).
    fn newest(&self) -> Option<u64> {
        self.numbers.back().copied()
    }

    /// Every number, oldest first, dead entries included (callers skip those).
    fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.numbers.iter().copied()
    }
}

/// One session's record numbers by the hash of their request id, which the lookup then checks
/// against the records' ids. Kept per client rather than in one table of every record, whose
/// resize (rehashing hundreds of thousands of keys at once, on every node at the same applied
/// index) stalled all clients for tens of milliseconds each time it doubled; by hashes rather
/// than by the ids themselves, which made each remembered answer hold its request id twice.
///
/// A hash table of `u64` to `u64` (16 bytes a slot): the lookup is one probe where the ordered
/// set it replaced walked four or five tree nodes of a large session, each a likely cache miss
/// (`perf record` at 32 clients put that walk at about 6% of the leader's driver thread). The
/// table holds the newest record of each hash; the others of the same hash, which only a
/// collision of two ids (or a damaged state holding one id twice) gives, wait in `older`.
#[derive(Clone, Debug, Default)]
struct RequestIndex {
    newest: std::collections::HashMap<u64, u64, std::hash::BuildHasherDefault<HashIsKey>>,
    older: BTreeSet<(u64, u64)>,
}

impl RequestIndex {
    fn insert(&mut self, hash: u64, n: u64) {
        match self.newest.entry(hash) {
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(n);
            }
            std::collections::hash_map::Entry::Occupied(mut slot) => {
                let kept = *slot.get();
                if n > kept {
                    slot.insert(n);
                    self.older.insert((hash, kept));
                } else if n < kept {
                    self.older.insert((hash, n));
                }
            }
        }
    }

    fn remove(&mut self, hash: u64, n: u64) {
        if self.newest.get(&hash) != Some(&n) {
            self.older.remove(&(hash, n));
            return;
        }
        match self
            .older
            .range((hash, 0)..=(hash, u64::MAX))
            .next_back()
            .copied()
        {
            Some(next) => {
                self.older.remove(&next);
                self.newest.insert(hash, next.1);
            }
            None => {
                self.newest.remove(&hash);
                // A table never gives memory back by itself: a session that once held many
                // answers and now holds few would keep its peak. Halve it once it is a quarter
                // full (a steady session, one answer in and one out, never gets there).
                let (len, capacity) = (self.newest.len(), self.newest.capacity());
                if capacity > 64 && len * 4 < capacity {
                    self.newest.shrink_to(len * 2);
                }
            }
        }
    }

    /// The record numbers filed under `hash`, newest first.
    fn under(&self, hash: u64) -> impl Iterator<Item = u64> + '_ {
        let newest = self.newest.get(&hash).copied();
        let older = newest.into_iter().flat_map(move |_| {
            self.older
                .range((hash, 0)..=(hash, u64::MAX))
                .rev()
                .map(|&(_, n)| n)
        });
        newest.into_iter().chain(older)
    }
}

/// The hasher of [`RequestIndex`]: its keys are already hashes, spread over all 64 bits.
#[derive(Default)]
struct HashIsKey(u64);

impl Hasher for HashIsKey {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used; anything else still hashes its bytes deterministically.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The lookup hash of a request id (in memory only, never stored or sent: any hash would do).
fn request_hash(request_id: &str) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    request_id.hash(&mut hasher);
    hasher.finish()
}

/// A remembered answer as the table holds it in memory: the client id shared with its session,
/// the request id and the key in one boxed string, the answer without the key its token repeats
/// ([`KeptOutcome`]), the record itself boxed in the table's map (a map node of 11 slots is about
/// half full when numbers only grow, so a slot holds a pointer, not the record). 72 bytes and
/// two allocations fewer than the plain layout of 112; `raftlock-bench lock-memory` measures
/// what one costs. Encoded as [`RecordOut`] and decoded as [`RecordIn`]: the layout every
/// RaftLock version reads.
#[derive(Clone, Debug, PartialEq, Eq)]
struct DedupeRecord {
    client_id: Arc<str>,
    /// The request id followed by the key of `op` (nothing after it when `op` is unknown).
    text: Box<str>,
    /// Where the request id ends in `text`.
    id_len: u32,
    /// What the request was: its command kind (the key is in `text`). A request id reused for
    /// another kind or key is refused instead of answered with this record. `None` in records
    /// written before this was kept.
    op_kind: Option<u8>,
    outcome: KeptOutcome,
    /// Log clock when the outcome was recorded or last changed (queued → granted / cancelled).
    at_ms: u64,
}

/// A recorded [`Outcome`] as the table keeps it: the answers it records without the key of
/// their token, which is the request's own (24 bytes instead of 48 and a string); any other
/// answer as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum KeptOutcome {
    Granted { token: u64, ttl_ms: u64 },
    Renewed { token: u64, ttl_ms: u64 },
    Queued { position: u32 },
    Released,
    WaitCancelled,
    Stored,
    Deleted { existed: bool },
    Other(Box<Outcome>),
}

impl DedupeRecord {
    fn new(
        client_id: Arc<str>,
        request_id: &str,
        outcome: Outcome,
        op: Option<(u8, &str)>,
        at_ms: u64,
    ) -> Self {
        let key = op.map_or("", |(_, key)| key);
        let mut text = String::with_capacity(request_id.len() + key.len());
        text.push_str(request_id);
        text.push_str(key);
        let mut rec = DedupeRecord {
            client_id,
            text: text.into_boxed_str(),
            id_len: u32::try_from(request_id.len()).unwrap_or(u32::MAX),
            op_kind: op.map(|(kind, _)| kind),
            outcome: KeptOutcome::Released,
            at_ms,
        };
        if rec.id_len as usize != request_id.len() {
            // Beyond any request size limit; kept whole rather than cut.
            rec.text = request_id.into();
            rec.id_len = u32::MAX;
            rec.op_kind = None;
        }
        rec.set_outcome(outcome);
        rec
    }

    fn request_id(&self) -> &str {
        if self.id_len == u32::MAX {
            return &self.text;
        }
        &self.text[..self.id_len as usize]
    }

    /// The command kind and key of the request, where known.
    fn op(&self) -> Option<(u8, &str)> {
        let kind = self.op_kind?;
        Some((kind, &self.text[self.id_len as usize..]))
    }

    fn key(&self) -> Option<&str> {
        self.op().map(|(_, key)| key)
    }

    fn is_queued(&self) -> bool {
        matches!(self.outcome, KeptOutcome::Queued { .. })
    }

    fn outcome(&self) -> Outcome {
        let token = |value: u64| FencingToken {
            key: self.key().unwrap_or_default().to_string(),
            value,
        };
        match &self.outcome {
            KeptOutcome::Granted {
                token: value,
                ttl_ms,
            } => Outcome::Granted {
                token: token(*value),
                ttl_ms: *ttl_ms,
            },
            KeptOutcome::Renewed {
                token: value,
                ttl_ms,
            } => Outcome::Renewed {
                token: token(*value),
                ttl_ms: *ttl_ms,
            },
            KeptOutcome::Queued { position } => Outcome::Queued {
                position: *position,
            },
            KeptOutcome::Released => Outcome::Released,
            KeptOutcome::WaitCancelled => Outcome::WaitCancelled,
            KeptOutcome::Stored => Outcome::Stored,
            KeptOutcome::Deleted { existed } => Outcome::Deleted { existed: *existed },
            KeptOutcome::Other(outcome) => (**outcome).clone(),
        }
    }

    fn set_outcome(&mut self, outcome: Outcome) {
        let own_key = |token: &FencingToken| self.key() == Some(token.key.as_str());
        self.outcome = match outcome {
            Outcome::Granted { token, ttl_ms } if own_key(&token) => KeptOutcome::Granted {
                token: token.value,
                ttl_ms,
            },
            Outcome::Renewed { token, ttl_ms } if own_key(&token) => KeptOutcome::Renewed {
                token: token.value,
                ttl_ms,
            },
            Outcome::Queued { position } => KeptOutcome::Queued { position },
            Outcome::Released => KeptOutcome::Released,
            Outcome::WaitCancelled => KeptOutcome::WaitCancelled,
            Outcome::Stored => KeptOutcome::Stored,
            Outcome::Deleted { existed } => KeptOutcome::Deleted { existed },
            other => KeptOutcome::Other(Box::new(other)),
        };
    }
}

/// A record as stored and as snapshots carry it (borrowed, for encoding).
#[derive(Serialize)]
struct RecordOut<'a> {
    client_id: &'a str,
    request_id: &'a str,
    outcome: &'a Outcome,
    op: Option<(u8, &'a str)>,
    at_ms: u64,
}

/// A record as stored and as snapshots carry it (owned, for decoding).
#[derive(Deserialize)]
struct RecordIn {
    client_id: String,
    request_id: String,
    outcome: Outcome,
    op: Option<(u8, String)>,
    at_ms: u64,
}

impl Serialize for DedupeRecord {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        RecordOut {
            client_id: &self.client_id,
            request_id: self.request_id(),
            outcome: &self.outcome(),
            op: self.op(),
            at_ms: self.at_ms,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for DedupeRecord {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        RecordIn::deserialize(deserializer).map(|r| {
            DedupeRecord::new(
                r.client_id.into(),
                &r.request_id,
                r.outcome,
                r.op.as_ref().map(|(kind, key)| (*kind, key.as_str())),
                r.at_ms,
            )
        })
    }
}

/// A dedupe record as written before records kept their time (read back only).
#[derive(Deserialize)]
struct DedupeRecordV2 {
    client_id: String,
    request_id: String,
    outcome: Outcome,
    op: Option<(u8, String)>,
}

/// A dedupe record as written before records kept their operation (read back only).
#[derive(Deserialize)]
struct DedupeRecordV1 {
    client_id: String,
    request_id: String,
    outcome: Outcome,
}

/// Kind and key of a command, for [`DedupeRecord::op`].
fn op_of(command: &Command) -> (u8, &str) {
    let kind = match command {
        Command::Acquire { .. } => 1,
        Command::Release { .. } | Command::ReleaseHeld { .. } => 2,
        Command::Renew { .. } => 3,
        Command::CancelWait { .. } => 4,
        Command::Put { .. } => 5,
        Command::Delete { .. } => 6,
        Command::Expire { .. }
        | Command::ExpireLease { .. }
        | Command::SetLimits { .. }
        | Command::SetLimitsV1 { .. }
        | Command::Tick { .. }
        | Command::SetClusterVersion { .. }
        | Command::SetClusterId { .. }
        | Command::SetMember { .. }
        | Command::SetQuotas { .. } => 0,
        Command::Sequenced { command, .. } => return op_of(command),
    };
    (kind, command.key())
}

/// What one identity holds and waits for (see [`Quotas`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct IdentityUse {
    held: u64,
    waiting: u64,
}

/// Bytes a held lock or a queued waiter counts against `Quotas::lock_bytes_max`.
fn lock_cost(key: &str, client_id: &str, request_id: &str) -> u64 {
    (key.len() + client_id.len() + request_id.len()) as u64 + LOCK_ENTRY_OVERHEAD
}

/// Bytes a data entry counts against `Quotas::data_bytes_max`.
fn data_cost(key: &str, value: &[u8]) -> u64 {
    (key.len() + value.len()) as u64
}

/// A refusal by a byte budget or a quota: `BUSY` on the wire, its message naming the limit
/// (`[limit: <name>]`, which the node counts by).
fn limit_refusal(limit: &str, detail: String) -> Outcome {
    Outcome::rejected(
        RejectCode::LimitReached,
        format!("{detail} [limit: {limit}]"),
    )
}

/// Adds `held` and `waiting` to the use of `client_id`'s identity (dropping identities that
/// use nothing).
fn count_use(uses: &mut BTreeMap<Box<str>, IdentityUse>, client_id: &str, held: i64, waiting: i64) {
    let identity = identity_of(client_id);
    let used = match uses.get_mut(identity) {
        Some(used) => used,
        None => uses.entry(Box::from(identity)).or_default(),
    };
    used.held = used.held.saturating_add_signed(held);
    used.waiting = used.waiting.saturating_add_signed(waiting);
    if used.held == 0 && used.waiting == 0 {
        uses.remove(identity);
    }
}

/// A held lock, as the leader needs it to rebuild lease deadlines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldLock {
    pub key: String,
    pub client_id: String,
    pub request_id: String,
    pub token: u64,
    pub ttl_ms: u64,
    /// Log index at which the current lease started (grant or latest renew).
    pub lease_index: u64,
}

/// A queued waiter, in queue order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaiterInfo {
    pub key: String,
    pub client_id: String,
    pub request_id: String,
    pub wait_timeout_ms: Option<u64>,
}

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

    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.data.get(key).map(Vec::as_slice)
    }

    pub fn holder(&self, key: &str) -> Option<HeldLock> {
        let h = self.locks.get(key)?.holder.as_ref()?;
        Some(HeldLock {
            key: key.to_string(),
            client_id: h.client_id.to_string(),
            request_id: h.request_id.to_string(),
            token: h.token,
            ttl_ms: h.ttl_ms,
            lease_index: h.lease_index,
        })
    }

    /// Every held lock, in key order.
    pub fn held_locks(&self) -> Vec<HeldLock> {
        self.locks.keys().filter_map(|k| self.holder(k)).collect()
    }

    /// Locks (held or with waiters) whose key starts with `prefix`, in key order, at most
    /// `limit`: each with its holder and its waiters in queue order. Visits only those keys.
    pub fn locks_with_prefix(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Vec<(String, Option<HeldLock>, Vec<WaiterInfo>)> {
        self.locks
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(key, _)| key.starts_with(prefix))
            .take(limit)
            .map(|(key, entry)| self.lock_view(key, entry))
            .collect()
    }

    /// One lock with its holder and its waiters in queue order.
    fn lock_view(
        &self,
        key: &str,
        entry: &LockEntry,
    ) -> (String, Option<HeldLock>, Vec<WaiterInfo>) {
        let waiters = entry
            .waiters
            .iter()
            .map(|w| WaiterInfo {
                key: key.to_string(),
                client_id: w.client_id.to_string(),
                request_id: w.request_id.to_string(),
                wait_timeout_ms: w.wait_timeout_ms,
            })
            .collect();
        (key.to_string(), self.holder(key), waiters)
    }

    /// Up to `limit` locks (held or with waiters) whose key sorts after `after` (from the first
    /// when `None`), in key order: each with its holder and its waiters in queue order. Lets a
    /// caller walk every lock a bounded step at a time.
    pub fn locks_after(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Vec<(String, Option<HeldLock>, Vec<WaiterInfo>)> {
        use std::ops::Bound;
        let lower = match after {
            Some(key) => Bound::Excluded(key),
            None => Bound::Unbounded,
        };
        self.locks
            .range::<str, _>((lower, Bound::Unbounded))
            .take(limit)
            .map(|(key, entry)| self.lock_view(key, entry))
            .collect()
    }

    /// Every waiter, by key and then queue order.
    pub fn waiters(&self) -> Vec<WaiterInfo> {
        self.locks
            .iter()
            .flat_map(|(key, entry)| {
                entry.waiters.iter().map(move |w| WaiterInfo {
                    key: key.to_string(),
                    client_id: w.client_id.to_string(),
                    request_id: w.request_id.to_string(),
                    wait_timeout_ms: w.wait_timeout_ms,
                })
            })
            .collect()
    }

    /// The queued acquire `(client_id, request_id)` of `key`, if it is still waiting.
    pub fn waiter(&self, key: &str, client_id: &str, request_id: &str) -> Option<WaiterInfo> {
        let entry = self.locks.get(key)?;
        entry
            .waiters
            .iter()
            .find(|w| *w.client_id == *client_id && *w.request_id == *request_id)
            .map(|w| WaiterInfo {
                key: key.to_string(),
                client_id: w.client_id.to_string(),
                request_id: w.request_id.to_string(),
                wait_timeout_ms: w.wait_timeout_ms,
            })
    }

    /// Waiters of one key in queue order.
    pub fn waiters_of(&self, key: &str) -> Vec<WaiterInfo> {
        self.waiters()
            .into_iter()
            .filter(|w| w.key == key)
            .collect()
    }

    // ----- apply -----------------------------------------------------------------------------

    /// Applies the command committed at `index`. Deterministic; never panics; an outcome other
    /// than a *recorded* one changed nothing but the applied index.
    pub fn apply(&mut self, index: u64, command: &Command) -> Applied {
        if index <= self.applied_index {
            let outcome = Outcome::rejected(
                RejectCode::AlreadyApplied,
                format!(
                    "index {index} is not above the applied index {}",
                    self.applied_index
                ),
            );
            return Applied {
                index,
                outcome,
                events: Vec::new(),
                replayed: false,
            };
        }
        self.applied_index = index;
        self.dirty_meta |= DIRTY_APPLIED;
        let mut events = Vec::new();
        let mut replayed = false;
        let outcome = self.apply_inner(command, &mut events, &mut replayed);
        Applied {
            index,
            outcome,
            events,
            replayed,
        }
    }

    fn apply_inner(
        &mut self,
        command: &Command,
        events: &mut Vec<Event>,
        replayed: &mut bool,
    ) -> Outcome {
        match command {
            Command::SetLimits { limits } => return self.set_replicated_limits(limits),
            Command::SetLimitsV1 { limits } => {
                return self.set_replicated_limits(&limits.clone().into())
            }
            Command::Tick { elapsed_ms } => return self.tick(*elapsed_ms),
            Command::SetClusterVersion { version } => {
                if *version > self.cluster_version() {
                    self.cluster_version = *version;
                    self.dirty_meta |= DIRTY_CLUSTER_VERSION;
                }
                return Outcome::Stored;
            }
            Command::SetClusterId { id, forced_by } => {
                if self.cluster.is_none() && *id != 0 {
                    self.cluster = Some(ClusterIdentity {
                        id: *id,
                        forced_by: forced_by.chars().take(MEMBER_ADDR_MAX).collect(),
                    });
                    self.dirty_meta |= DIRTY_CLUSTER;
                }
                return Outcome::Stored;
            }
            Command::SetQuotas { quotas } => return self.set_quotas(quotas),
            Command::SetMember { id, info } => {
                match info {
                    None => {
                        if self.members.remove(id).is_some() {
                            self.dirty_meta |= DIRTY_MEMBERS;
                        }
                    }
                    Some(info)
                        if *id != 0
                            && info.peer_addr.len() <= MEMBER_ADDR_MAX
                            && info.client_addr.len() <= MEMBER_ADDR_MAX
                            && (self.members.len() < MEMBERS_MAX
                                || self.members.contains_key(id)) =>
                    {
                        if self.members.get(id) != Some(info) {
                            self.members.insert(*id, info.clone());
                            self.dirty_meta |= DIRTY_MEMBERS;
                        }
                    }
                    // Every replica refuses the same entries (the bounds are constants).
                    Some(_) => {}
                }
                return Outcome::Stored;
            }
            Command::Sequenced {
                ack_below,
                command: inner,
            } => {
                if let Err(refusal) = self.acknowledge(*ack_below, inner) {
                    return refusal;
                }
                let outcome = self.apply_inner(inner, events, replayed);
                // An acknowledging request is answered once: its answer is kept even when it
                // changed nothing (a lock found held, a stale token), or a copy delivered after
                // that answer could act where the answer said nothing happened — a grant to a
                // client told it was not granted. Its client's acknowledgement removes it.
                // Refusals of bad input or of a full table are not kept: a retry is judged
                // again.
                // The plain request recorded what `is_recorded` keeps; the rest is kept here.
                if !*replayed && !outcome.is_recorded() && outcome.is_remembered_for(command) {
                    if let Some((client, request)) = inner.dedupe_id() {
                        self.record(client, request, outcome.clone(), op_of(inner));
                    }
                }
                return outcome;
            }
            _ => {}
        }
        if let Err(rejection) = self.validate(command) {
            return rejection;
        }
        // Exactly-once: a retried request gets its original outcome back (dissertation §6.3).
        if let Some((client, request)) = command.dedupe_id() {
            if let Some(n) = self.record_number(client, request) {
                let record = &self.dedupe[&n];
                if record.op().is_some_and(|op| op != op_of(command)) {
                    return Outcome::rejected(
                        RejectCode::RequestIdReused,
                        format!(
                            "request id {request:?} of client {client:?} was used for another \
                             operation or key; use a new request id"
                        ),
                    );
                }
                let recorded = record.outcome();
                *replayed = true;
                return match recorded {
                    Outcome::Queued { .. } => {
                        // Still waiting: answer with the current position.
                        let position = self.position_of(command.key(), client, request);
                        position.map_or(recorded, |p| Outcome::Queued { position: p })
                    }
                    other => other,
                };
            }
            if let Err(refusal) = self.make_room(client) {
                return refusal;
            }
        }
        let outcome = match command {
            Command::Acquire {
                key,
                client_id,
                request_id,
                ttl_ms,
                wait_timeout_ms,
            } => self.acquire(key, client_id, request_id, *ttl_ms, *wait_timeout_ms),
            Command::Release {
                key,
                client_id,
                token,
                ..
            } => self.release(key, client_id, token.value, events),
            Command::Renew {
                key,
                client_id,
                token,
                ttl_ms,
                ..
            } => self.renew(key, client_id, token.value, *ttl_ms),
            Command::CancelWait {
                key,
                client_id,
                request_id,
            } => self.cancel_wait(key, client_id, request_id, events),
            Command::Put {
                key, value, guard, ..
            } => self.put(key, value, guard.as_ref()),
            Command::Delete { key, guard, .. } => self.delete(key, guard.as_ref()),
            Command::SetLimits { .. }
            | Command::SetLimitsV1 { .. }
            | Command::Tick { .. }
            | Command::SetClusterVersion { .. }
            | Command::SetClusterId { .. }
            | Command::SetMember { .. }
            | Command::SetQuotas { .. }
            | Command::Sequenced { .. } => {
                Outcome::rejected(RejectCode::InvalidRequest, "unreachable")
            }
            Command::ReleaseHeld { key, client_id, .. } => {
                match self.locks.get(key.as_str()).and_then(|e| e.holder.as_ref()) {
                    Some(h) if *h.client_id == **client_id => {
                        self.vacate(key, events);
                        Outcome::Released
                    }
                    Some(_) => Outcome::NotHolder,
                    None => Outcome::StaleToken { current: None },
                }
            }
            Command::Expire { key, token } => self.expire(key, *token, None, events),
            Command::ExpireLease {
                key,
                token,
                lease_index,
            } => self.expire(key, *token, Some(*lease_index), events),
        };
        if outcome.is_recorded() {
            if let Some((client, request)) = command.dedupe_id() {
                self.record(client, request, outcome.clone(), op_of(command));
            }
        }
        outcome
    }

    fn validate(&self, command: &Command) -> Result<(), Outcome> {
        let l = &self.limits;
        let key = command.key();
        if key.is_empty() {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                "key must not be empty",
            ));
        }
        if key.len() > l.key_bytes_max {
            return Err(Outcome::rejected(
                RejectCode::TooLarge,
                format!(
                    "key is {} bytes; the limit is {}",
                    key.len(),
                    l.key_bytes_max
                ),
            ));
        }
        let ids: &[&str] = match command {
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
            | Command::CancelWait {
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
            } => &[client_id, request_id],
            Command::Expire { .. }
            | Command::ExpireLease { .. }
            | Command::SetLimits { .. }
            | Command::SetLimitsV1 { .. }
            | Command::Tick { .. }
            | Command::SetClusterVersion { .. }
            | Command::SetClusterId { .. }
            | Command::SetMember { .. }
            | Command::SetQuotas { .. }
            | Command::Sequenced { .. } => &[],
        };
        if ids.iter().any(|id| id.len() > l.id_bytes_max) {
            return Err(Outcome::rejected(
                RejectCode::TooLarge,
                format!(
                    "client and request ids are limited to {} bytes",
                    l.id_bytes_max
                ),
            ));
        }
        match command {
            Command::Acquire {
                client_id,
                ttl_ms,
                wait_timeout_ms,
                ..
            } => {
                if client_id.is_empty() {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        "clientId is required",
                    ));
                }
                check_ttl(*ttl_ms, l)?;
                if wait_timeout_ms.is_some_and(|w| w > l.wait_timeout_ms_max) {
                    return Err(Outcome::rejected(
                        RejectCode::InvalidRequest,
                        format!("wait timeout is limited to {} ms", l.wait_timeout_ms_max),
                    ));
                }
            }
            Command::Renew { ttl_ms, token, .. } => {
                check_ttl(*ttl_ms, l)?;
                check_token_key(token, key)?;
            }
            Command::Release { token, .. } => check_token_key(token, key)?,
            Command::Put { value, guard, .. } => {
                if value.len() > l.value_bytes_max {
                    return Err(Outcome::rejected(
                        RejectCode::TooLarge,
                        format!(
                            "value is {} bytes; the limit is {}",
                            value.len(),
                            l.value_bytes_max
                        ),
                    ));
                }
                check_guard(guard.as_ref(), l)?;
            }
            Command::Delete { guard, .. } => check_guard(guard.as_ref(), l)?,
            Command::CancelWait { .. }
            | Command::ReleaseHeld { .. }
            | Command::Expire { .. }
            | Command::ExpireLease { .. }
            | Command::SetLimits { .. }
            | Command::SetLimitsV1 { .. }
            | Command::Tick { .. }
            | Command::SetClusterVersion { .. }
            | Command::SetClusterId { .. }
            | Command::SetMember { .. }
            | Command::SetQuotas { .. }
            | Command::Sequenced { .. } => {}
        }
        Ok(())
    }

    fn position_of(&self, key: &str, client: &str, request: &str) -> Option<u32> {
        let entry = self.locks.get(key)?;
        entry
            .waiters
            .iter()
            .position(|w| *w.client_id == *client && *w.request_id == *request)
            .map(|p| p as u32 + 1)
    }

    fn acquire(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        ttl_ms: u64,
        wait_timeout_ms: Option<u64>,
    ) -> Outcome {
        let exists = self.locks.contains_key(key);
        if !exists && self.locks.len() >= self.limits.locks_held_max {
            return limit_refusal("locks_held", "too many locks in use".into());
        }
        if let Err(refusal) = self.check_lock_quotas(key, client_id, request_id, wait_timeout_ms) {
            return refusal;
        }
        let waiters_max = self.limits.waiters_per_key_max;
        let entry = self.locks.entry(Box::from(key)).or_default();
        match &entry.holder {
            None => {
                self.fencing_seq += 1;
                let token = self.fencing_seq;
                entry.holder = Some(Holder {
                    client_id: client_id.into(),
                    request_id: request_id.into(),
                    token,
                    ttl_ms,
                    lease_index: self.applied_index,
                });
                self.locks_held += 1;
                self.lock_bytes += lock_cost(key, client_id, request_id);
                self.count_identity(client_id, 1, 0);
                self.mark_lock(key);
                self.dirty_meta |= DIRTY_SEQ;
                Outcome::Granted {
                    token: FencingToken {
                        key: key.to_string(),
                        value: token,
                    },
                    ttl_ms,
                }
            }
            Some(holder) if *holder.client_id == *client_id => Outcome::AlreadyHeld {
                token: FencingToken {
                    key: key.to_string(),
                    value: holder.token,
                },
                ttl_ms: holder.ttl_ms,
            },
            Some(_) => {
                if let Some(p) = entry
                    .waiters
                    .iter()
                    .position(|w| *w.client_id == *client_id)
                {
                    return Outcome::AlreadyQueued {
                        position: p as u32 + 1,
                    };
                }
                if wait_timeout_ms == Some(0) {
                    return Outcome::Busy;
                }
                if entry.waiters.len() >= waiters_max {
                    return Outcome::rejected(
                        RejectCode::QueueFull,
                        format!("{waiters_max} waiters already queue for this key"),
                    );
                }
                entry.waiters.push_back(Waiter {
                    client_id: client_id.into(),
                    request_id: request_id.into(),
                    ttl_ms,
                    wait_timeout_ms,
                });
                let position = entry.waiters.len() as u32;
                self.waiters += 1;
                self.lock_bytes += lock_cost(key, client_id, request_id);
                self.count_identity(client_id, 0, 1);
                self.mark_lock(key);
                Outcome::Queued { position }
            }
        }
    }

    /// Checks that `token` holds `key` for `client_id`.
    fn check_holder(&self, key: &str, client_id: &str, token: u64) -> Result<(), Outcome> {
        let holder = self.locks.get(key).and_then(|e| e.holder.as_ref());
        match holder {
            None => Err(Outcome::StaleToken { current: None }),
            Some(h) if h.token != token => Err(Outcome::StaleToken {
                current: Some(h.token),
            }),
            Some(h) if *h.client_id != *client_id => Err(Outcome::NotHolder),
            Some(_) => Ok(()),
        }
    }

    fn release(
        &mut self,
        key: &str,
        client_id: &str,
        token: u64,
        events: &mut Vec<Event>,
    ) -> Outcome {
        if let Err(refusal) = self.check_holder(key, client_id, token) {
            return refusal;
        }
        self.vacate(key, events);
        Outcome::Released
    }

    fn renew(&mut self, key: &str, client_id: &str, token: u64, ttl_ms: u64) -> Outcome {
        if let Err(refusal) = self.check_holder(key, client_id, token) {
            return refusal;
        }
        let index = self.applied_index;
        if let Some(holder) = self.locks.get_mut(key).and_then(|e| e.holder.as_mut()) {
            holder.ttl_ms = ttl_ms;
            holder.lease_index = index;
        }
        self.mark_lock(key);
        Outcome::Renewed {
            token: FencingToken {
                key: key.to_string(),
                value: token,
            },
            ttl_ms,
        }
    }

    fn expire(
        &mut self,
        key: &str,
        token: u64,
        lease_index: Option<u64>,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let holder = self.locks.get(key).and_then(|e| e.holder.clone());
        match holder {
            // A renew restarted the lease after the leader proposed this expiry.
            Some(h) if h.token == token && lease_index.is_some_and(|i| i != h.lease_index) => {
                Outcome::LeaseRenewed {
                    lease_index: h.lease_index,
                }
            }
            Some(h) if h.token == token => {
                events.push(Event::Expired {
                    client_id: h.client_id.to_string(),
                    token: FencingToken {
                        key: key.to_string(),
                        value: token,
                    },
                });
                self.vacate(key, events);
                Outcome::Expired {
                    client_id: h.client_id.into(),
                }
            }
            Some(h) => Outcome::StaleToken {
                current: Some(h.token),
            },
            None => Outcome::StaleToken { current: None },
        }
    }

    /// The holder leaves; the next waiter (if any) is granted in the same apply.
    fn vacate(&mut self, key: &str, events: &mut Vec<Event>) {
        let Some(entry) = self.locks.get_mut(key) else {
            return;
        };
        if let Some(old) = entry.holder.take() {
            self.locks_held -= 1;
            self.lock_bytes =
                self.lock_bytes
                    .saturating_sub(lock_cost(key, &old.client_id, &old.request_id));
            if self.quotas.as_ref().is_some_and(|q| q.by_identity) {
                count_use(&mut self.identity_use, &old.client_id, -1, 0);
            }
        }
        if let Some(next) = entry.waiters.pop_front() {
            self.waiters -= 1;
            // The waiter's bytes now count as the holder's.
            if self.quotas.as_ref().is_some_and(|q| q.by_identity) {
                count_use(&mut self.identity_use, &next.client_id, 1, -1);
            }
            self.fencing_seq += 1;
            let token = self.fencing_seq;
            entry.holder = Some(Holder {
                client_id: next.client_id.clone(),
                request_id: next.request_id.clone(),
                token,
                ttl_ms: next.ttl_ms,
                lease_index: self.applied_index,
            });
            self.locks_held += 1;
            self.dirty_meta |= DIRTY_SEQ;
            let token = FencingToken {
                key: key.to_string(),
                value: token,
            };
            let granted = Outcome::Granted {
                token: token.clone(),
                ttl_ms: next.ttl_ms,
            };
            self.update_record(&next.client_id, &next.request_id, granted);
            events.push(Event::Granted {
                client_id: next.client_id.into(),
                request_id: next.request_id.into(),
                token,
                ttl_ms: next.ttl_ms,
            });
        }
        self.mark_lock(key);
    }

    fn cancel_wait(
        &mut self,
        key: &str,
        client_id: &str,
        request_id: &str,
        events: &mut Vec<Event>,
    ) -> Outcome {
        let Some(entry) = self.locks.get_mut(key) else {
            return Outcome::NotWaiting;
        };
        let Some(pos) = entry
            .waiters
            .iter()
            .position(|w| *w.client_id == *client_id && *w.request_id == *request_id)
        else {
            return Outcome::NotWaiting;
        };
        entry.waiters.remove(pos);
        self.waiters -= 1;
        self.lock_bytes = self
            .lock_bytes
            .saturating_sub(lock_cost(key, client_id, request_id));
        self.count_identity(client_id, 0, -1);
        self.mark_lock(key);
        self.update_record(client_id, request_id, Outcome::WaitCancelled);
        events.push(Event::WaiterRemoved {
            key: key.to_string(),
            client_id: client_id.to_string(),
            request_id: request_id.to_string(),
        });
        Outcome::WaitCancelled
    }

    fn guard_holds(&self, guard: Option<&FencingToken>) -> Result<(), Outcome> {
        let Some(guard) = guard else { return Ok(()) };
        let current = self
            .locks
            .get(guard.key.as_str())
            .and_then(|e| e.holder.as_ref())
            .map(|h| h.token);
        if current == Some(guard.value) {
            Ok(())
        } else {
            Err(Outcome::GuardRejected { current })
        }
    }

    fn put(&mut self, key: &str, value: &[u8], guard: Option<&FencingToken>) -> Outcome {
        if let Err(refusal) = self.guard_holds(guard) {
            return refusal;
        }
        if !self.data.contains_key(key) && self.data.len() >= self.limits.data_entries_max {
            return limit_refusal("data_entries", "too many data keys".into());
        }
        let old = self.data.get(key).map_or(0, |v| data_cost(key, v));
        let total = self.data_bytes.saturating_sub(old) + data_cost(key, value);
        if let Some(q) = self.quotas.as_ref().filter(|q| total > q.data_bytes_max) {
            return limit_refusal(
                "data_bytes",
                format!(
                    "the key-value data would pass its budget of {} bytes",
                    q.data_bytes_max
                ),
            );
        }
        self.data_bytes = total;
        self.data.insert(key.to_string(), value.to_vec());
        self.mark_dirty(DATA_PREFIX, key);
        Outcome::Stored
    }

    fn delete(&mut self, key: &str, guard: Option<&FencingToken>) -> Outcome {
        if let Err(refusal) = self.guard_holds(guard) {
            return refusal;
        }
        let removed = self.data.remove(key);
        let existed = removed.is_some();
        if let Some(value) = removed {
            self.data_bytes = self.data_bytes.saturating_sub(data_cost(key, &value));
            self.mark_dirty(DATA_PREFIX, key);
        }
        Outcome::Deleted { existed }
    }

    /// `SetQuotas`: takes the quotas (when every bound is positive) and rebuilds what the
    /// per-identity quotas count.
    fn set_quotas(&mut self, quotas: &Quotas) -> Outcome {
        if !quotas.is_sane() {
            return Outcome::rejected(RejectCode::InvalidRequest, "quotas must all be positive");
        }
        if self.quotas.as_ref() != Some(quotas) {
            self.quotas = Some(quotas.clone());
            self.dirty_meta |= DIRTY_QUOTAS;
            self.recount();
        }
        Outcome::Stored
    }

    /// What a byte budget or quota would answer `command` now, before it is proposed: the
    /// leader's fast path, so that a request sure to be refused does not take log space on
    /// every replica. Apply still decides (this state may be behind what is in flight). A
    /// request already answered (a retry) is left to apply, which answers it from the table.
    pub fn quota_precheck(&self, command: &Command) -> Option<Outcome> {
        let q = self.quotas.as_ref()?;
        match command.request() {
            Command::Put {
                key,
                value,
                client_id,
                request_id,
                ..
            } => {
                if self.record_number(client_id, request_id).is_some() {
                    return None;
                }
                let old = self.data.get(key.as_str()).map_or(0, |v| data_cost(key, v));
                let total = self.data_bytes.saturating_sub(old) + data_cost(key, value);
                (total > q.data_bytes_max).then(|| {
                    limit_refusal(
                        "data_bytes",
                        format!(
                            "the key-value data would pass its budget of {} bytes",
                            q.data_bytes_max
                        ),
                    )
                })
            }
            Command::Acquire {
                key,
                client_id,
                request_id,
                wait_timeout_ms,
                ..
            } => {
                if self.record_number(client_id, request_id).is_some() {
                    return None;
                }
                self.check_lock_quotas(key, client_id, request_id, *wait_timeout_ms)
                    .err()
            }
            _ => None,
        }
    }

    /// The quotas in force (None until a `SetQuotas` entry applied).
    pub fn quotas(&self) -> Option<&Quotas> {
        self.quotas.as_ref()
    }

    /// Bytes of key-value data and of lock state, as the byte budgets count them.
    pub fn bytes_used(&self) -> (u64, u64) {
        (self.data_bytes, self.lock_bytes)
    }

    /// What the byte counts and the per-identity use say against a recount of the state, when
    /// they differ (the simulator checks this after every applied index).
    pub fn accounting_mismatch(&self) -> Option<String> {
        let mut fresh = LockStateMachine {
            quotas: self.quotas.clone(),
            locks: self.locks.clone(),
            data: self.data.clone(),
            ..Default::default()
        };
        fresh.recount();
        let kept = (self.data_bytes, self.lock_bytes, &self.identity_use);
        let counted = (fresh.data_bytes, fresh.lock_bytes, &fresh.identity_use);
        (kept != counted).then(|| {
            format!("kept (data, lock bytes, use by identity) {kept:?}, recounted {counted:?}")
        })
    }

    /// Rebuilds the byte counts and the per-identity use from the state.
    fn recount(&mut self) {
        self.data_bytes = self.data.iter().map(|(k, v)| data_cost(k, v)).sum();
        let by_identity = self.quotas.as_ref().is_some_and(|q| q.by_identity);
        let mut lock_bytes = 0;
        let mut uses = BTreeMap::new();
        for (key, entry) in &self.locks {
            if let Some(h) = &entry.holder {
                lock_bytes += lock_cost(key, &h.client_id, &h.request_id);
                if by_identity {
                    count_use(&mut uses, &h.client_id, 1, 0);
                }
            }
            for w in entry.waiters.iter() {
                lock_bytes += lock_cost(key, &w.client_id, &w.request_id);
                if by_identity {
                    count_use(&mut uses, &w.client_id, 0, 1);
                }
            }
        }
        self.lock_bytes = lock_bytes;
        self.identity_use = uses;
    }

    /// Counts a lock taken or given back (`held`) and an acquire queued or leaving the queue
    /// (`waiting`) against `client_id`'s identity, while per-identity quotas apply.
    fn count_identity(&mut self, client_id: &str, held: i64, waiting: i64) {
        if self.quotas.as_ref().is_some_and(|q| q.by_identity) {
            count_use(&mut self.identity_use, client_id, held, waiting);
        }
    }

    /// Sessions open for `identity`, counted up to `max`.
    fn identity_sessions(&self, identity: &str, max: u64) -> u64 {
        let upper = format!("{identity}0");
        self.sessions
            .range::<str, _>((
                std::ops::Bound::Included(identity),
                std::ops::Bound::Excluded(upper.as_str()),
            ))
            .filter(|(client, _)| identity_of(client) == identity)
            .take(max as usize)
            .count() as u64
    }

    /// The byte budget and per-identity quotas for an acquire of `key` that would take the
    /// lock or join its queue (an acquire that would be answered from the state without
    /// taking anything is not checked).
    fn check_lock_quotas(
        &self,
        key: &str,
        client_id: &str,
        request_id: &str,
        wait_timeout_ms: Option<u64>,
    ) -> Result<(), Outcome> {
        let Some(q) = &self.quotas else {
            return Ok(());
        };
        let queue = match self
            .locks
            .get(key)
            .and_then(|e| e.holder.as_ref().map(|h| (e, h)))
        {
            None => false,
            Some((_, h)) if *h.client_id == *client_id => return Ok(()),
            Some(_) if wait_timeout_ms == Some(0) => return Ok(()),
            Some((e, _)) if e.waiters.iter().any(|w| *w.client_id == *client_id) => return Ok(()),
            Some(_) => true,
        };
        if self.lock_bytes + lock_cost(key, client_id, request_id) > q.lock_bytes_max {
            return Err(limit_refusal(
                "lock_bytes",
                format!(
                    "held locks and queued acquires would pass their budget of {} bytes",
                    q.lock_bytes_max
                ),
            ));
        }
        if !q.by_identity {
            return Ok(());
        }
        let identity = identity_of(client_id);
        let used = self.identity_use.get(identity).copied().unwrap_or_default();
        if used.held + used.waiting >= q.identity_locks_max {
            return Err(limit_refusal(
                "identity_locks",
                format!(
                    "identity {identity:?} holds and waits for {} locks",
                    q.identity_locks_max
                ),
            ));
        }
        if queue && used.waiting >= q.identity_waiters_max {
            return Err(limit_refusal(
                "identity_waiters",
                format!(
                    "identity {identity:?} has {} acquires queued",
                    q.identity_waiters_max
                ),
            ));
        }
        Ok(())
    }

    fn set_replicated_limits(&mut self, limits: &Limits) -> Outcome {
        let sane = limits.key_bytes_max > 0
            && limits.id_bytes_max > 0
            && limits.ttl_ms_max > 0
            && limits.waiters_per_key_max > 0
            && limits.locks_held_max > 0
            && limits.session_idle_ms > 0;
        if !sane {
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                "limits must allow keys, ids, leases, waiters and locks",
            );
        }
        if limits.session_idle_ms < limits.dedupe_retain_ms {
            // A closing session must never forget an answer younger than the retention.
            return Outcome::rejected(
                RejectCode::InvalidRequest,
                "session_idle_ms must be at least dedupe_retain_ms",
            );
        }
        self.limits = limits.clone();
        self.limits_replicated = true;
        self.dirty_meta |= DIRTY_LIMITS;
        Outcome::Stored
    }

    fn mark_lock(&mut self, key: &str) {
        if self
            .locks
            .get(key)
            .is_some_and(|e| e.holder.is_none() && e.waiters.is_empty())
        {
            self.locks.remove(key);
        }
        self.mark_dirty(LOCK_PREFIX, key);
    }

    /// Marks the state key `prefix` + `key` changed. A key already marked (a lock acquired and
    /// released within one applied-state write) costs a lookup, not a new string; a new one is
    /// built without the formatting machinery (`format!` was about 0.6% of the leader's driver
    /// thread at 32 clients).
    fn mark_dirty(&mut self, prefix: &str, key: &str) {
        let mut full = std::mem::take(&mut self.dirty_scratch);
        full.clear();
        full.push_str(prefix);
        full.push_str(key);
        if !self.dirty.contains(full.as_str()) {
            self.dirty.insert(full.as_str().to_owned());
        }
        self.dirty_scratch = full;
    }

    // ----- exactly-once table ----------------------------------------------------------------

    fn record(&mut self, client_id: &str, request_id: &str, outcome: Outcome, op: (u8, &str)) {
        if self.limits.dedupe_entries_max == 0 {
            return;
        }
        // The session's copy of the client id when it has one (no new string to drop at once).
        let client: Arc<str> = match self.sessions.get_key_value(client_id) {
            Some((client, _)) => client.clone(),
            None => client_id.into(),
        };
        self.insert_record(DedupeRecord::new(
            client,
            request_id,
            outcome,
            Some(op),
            self.clock_ms,
        ));
    }

    /// The number of the record that answers `request_id` of `client_id`, if one is kept.
    fn record_number(&self, client_id: &str, request_id: &str) -> Option<u64> {
        let hash = request_hash(request_id);
        // The newest record of that id, should a damaged state hold two.
        self.sessions
            .get(client_id)?
            .by_request
            .under(hash)
            .find(|n| {
                self.dedupe
                    .get(n)
                    .is_some_and(|r| r.request_id() == request_id)
            })
    }

    /// Files `rec` under its client's session (opened if need be), sharing the session's copy
    /// of the client id.
    fn add_to_session(&mut self, n: u64, rec: &mut DedupeRecord) {
        // One lookup: the entry's key is the session's copy when the session is open.
        let session = match self.sessions.entry(rec.client_id.clone()) {
            Entry::Occupied(open) => {
                if !Arc::ptr_eq(open.key(), &rec.client_id) {
                    rec.client_id = open.key().clone();
                }
                open.into_mut()
            }
            Entry::Vacant(new) => new.insert(Session::default()),
        };
        session.records.insert(n);
        session.by_request.insert(request_hash(rec.request_id()), n);
        session.queued += usize::from(rec.is_queued());
    }

    /// Stores `rec` as the newest record (highest insertion number) of the table and its session.
    fn insert_record(&mut self, mut rec: DedupeRecord) {
        let n = self.dedupe_next;
        self.dedupe_next += 1;
        self.add_to_session(n, &mut rec);
        self.dedupe.insert(n, Box::new(rec));
        self.dirty_blocks.insert(n / DEDUPE_BLOCK);
        self.dirty_meta |= DIRTY_DEDUPE_NEXT;
    }

    /// Forgets record `n` (and its session when it was the last one).
    fn remove_record(&mut self, n: u64) -> Option<DedupeRecord> {
        let rec = *self.dedupe.remove(&n)?;
        self.dirty_blocks.insert(n / DEDUPE_BLOCK);
        if let Some(session) = self.sessions.get_mut(&rec.client_id) {
            let dedupe = &self.dedupe;
            session.records.remove(n, |m| dedupe.contains_key(&m));
            session.by_request.remove(request_hash(rec.request_id()), n);
            if rec.is_queued() {
                session.queued = session.queued.saturating_sub(1);
            }
            if session.records.is_empty() && session.mark == 0 {
                self.sessions.remove(&rec.client_id);
            }
        }
        Some(rec)
    }

    /// A queued acquire's answer changed (granted or cancelled): a retry must now see that. The
    /// record moves to the newest position, so that its retention counts from this answer.
    fn update_record(&mut self, client_id: &str, request_id: &str, outcome: Outcome) {
        let Some(n) = self.record_number(client_id, request_id) else {
            return;
        };
        if let Some(mut rec) = self.remove_record(n) {
            rec.set_outcome(outcome);
            rec.at_ms = self.clock_ms;
            self.insert_record(rec);
        }
    }

    /// Whether record `n` may be forgotten to keep a bound: finished (not a queued acquire) and
    /// answered at least `dedupe_retain_ms` ago.
    fn evictable(&self, n: u64) -> Option<bool> {
        let rec = self.dedupe.get(&n)?;
        if rec.is_queued() {
            return Some(false);
        }
        Some(rec.at_ms.saturating_add(self.limits.dedupe_retain_ms) <= self.clock_ms)
    }

    /// The oldest record among `candidates` (in insertion order) that may be forgotten. Records
    /// are in answer order, so the first finished record that is too young ends the search.
    /// Numbers no longer in the table (a session's dead entries) are passed over.
    fn oldest_evictable(&self, candidates: impl Iterator<Item = u64>) -> Option<u64> {
        let mut skipped = 0;
        for n in candidates {
            let Some(rec) = self.dedupe.get(&n) else {
                continue;
            };
            if rec.is_queued() {
                skipped += 1;
                if skipped > EVICT_SCAN_MAX {
                    return None;
                }
                continue;
            }
            return self.evictable(n).unwrap_or(false).then_some(n);
        }
        None
    }

    /// Makes room for one more answer from `client_id` within every bound, forgetting the oldest
    /// finished answers past their retention; refuses when a bound cannot be kept that way.
    fn make_room(&mut self, client_id: &str) -> Result<(), Outcome> {
        let l = &self.limits;
        if l.dedupe_entries_max == 0 {
            return Ok(());
        }
        let (sessions_max, per_session, total) =
            (l.sessions_max, l.session_entries_max, l.dedupe_entries_max);
        let retain = l.dedupe_retain_ms;
        if !self.sessions.contains_key(client_id) {
            if let Some(q) = self.quotas.as_ref().filter(|q| q.by_identity) {
                let max = q.identity_sessions_max;
                if self.identity_sessions(identity_of(client_id), max) >= max {
                    return Err(limit_refusal(
                        "identity_sessions",
                        format!(
                            "identity {:?} has {max} client sessions open; a session closes \
                             after {} ms without requests from its client — retry later",
                            identity_of(client_id),
                            self.limits.session_idle_ms
                        ),
                    ));
                }
            }
        }
        if !self.sessions.contains_key(client_id) && self.sessions.len() >= sessions_max {
            return Err(limit_refusal(
                "sessions",
                format!(
                    "{sessions_max} client sessions are open; a session closes after {} ms \
                     without requests from its client — retry later",
                    self.limits.session_idle_ms
                ),
            ));
        }
        while self.session_len(client_id) >= per_session {
            let oldest = self
                .sessions
                .get(client_id)
                .and_then(|s| self.oldest_evictable(s.records.iter()));
            match oldest {
                Some(n) => {
                    self.remove_record(n);
                }
                None => {
                    return Err(limit_refusal(
                        "session_answers",
                        format!(
                            "client {client_id:?} has {per_session} answered requests younger \
                             than {retain} ms; retry later"
                        ),
                    ))
                }
            }
        }
        while self.dedupe.len() >= total {
            match self.oldest_evictable(self.dedupe.keys().copied()) {
                Some(n) => {
                    self.remove_record(n);
                }
                None => {
                    return Err(Outcome::rejected(
                        RejectCode::LimitReached,
                        format!(
                            "{total} answered requests are younger than {retain} ms; retry later"
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    // ----- acknowledgements ------------------------------------------------------------------

    /// What a [`Command::Sequenced`] does before its request applies. The request must be an
    /// answered-once client request numbered by its id, at or above `ack_below`. One numbered
    /// below its session's mark whose answer is no longer kept is refused: the client had its
    /// answer and said so, so this is a delayed copy, never new work. Otherwise the mark rises to
    /// `ack_below` and the session's answers numbered below it are forgotten; that stands even
    /// when the request itself is then refused (a full table is what acknowledgements relieve).
    /// Every refusal here changes nothing.
    fn acknowledge(&mut self, ack_below: u64, command: &Command) -> Result<(), Outcome> {
        let version = self.cluster_version();
        if version < SEQUENCED_VERSION {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "acknowledging answers needs cluster version {SEQUENCED_VERSION}; this \
                     cluster runs version {version}"
                ),
            ));
        }
        let ids = match command {
            Command::Sequenced { .. } | Command::CancelWait { .. } => None,
            other => other.dedupe_id(),
        };
        let Some((client, request)) = ids else {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                "only acquires, releases, renewals, puts and deletes with a client id and a \
                 request id acknowledge answers",
            ));
        };
        let Some(seq) = sequence_number(request) else {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "request id {request:?} is not a sequence number: a request that \
                     acknowledges answers (ackBelow) is numbered by its request id, in decimal \
                     from 1"
                ),
            ));
        };
        if ack_below > seq {
            return Err(Outcome::rejected(
                RejectCode::InvalidRequest,
                format!(
                    "ackBelow {ack_below} is above the request's own number {seq}: a request \
                     still waiting for its answer cannot be acknowledged"
                ),
            ));
        }
        self.validate(command)?;
        if self.limits.dedupe_entries_max == 0 || self.record_number(client, request).is_some() {
            // No table to relieve, or a retry the table answers as it stands.
            return Ok(());
        }
        let mark = self.sessions.get(client).map_or(0, |s| s.mark);
        if seq < mark {
            return Err(Outcome::rejected(
                RejectCode::Acknowledged,
                format!(
                    "request {seq} of client {client:?} was answered and acknowledged (the \
                     client has every answer below {mark}), and its answer is no longer kept; \
                     it is not run again"
                ),
            ));
        }
        if ack_below > mark {
            self.raise_mark(client, ack_below);
        }
        Ok(())
    }

    /// Raises `client_id`'s mark to `mark` (opening its session if there is room for one) and
    /// forgets the session's finished answers numbered below it, looking at its oldest
    /// [`ACK_SCAN_MAX`] answers.
    fn raise_mark(&mut self, client_id: &str, mark: u64) {
        let client: Arc<str> = match self.sessions.get_key_value(client_id) {
            Some((client, _)) => client.clone(),
            None if self.sessions.len() >= self.limits.sessions_max => return,
            None if self.quotas.as_ref().is_some_and(|q| {
                q.by_identity
                    && self.identity_sessions(identity_of(client_id), q.identity_sessions_max)
                        >= q.identity_sessions_max
            }) =>
            {
                return
            }
            None => client_id.into(),
        };
        let clock = self.clock_ms;
        let session = self.sessions.entry(client.clone()).or_default();
        session.mark = mark;
        session.mark_at_ms = clock;
        let dedupe = &self.dedupe;
        let below: Vec<u64> = session
            .records
            .iter()
            .filter_map(|n| dedupe.get(&n).map(|rec| (n, rec)))
            .take(ACK_SCAN_MAX)
            .filter(|(_, rec)| {
                !rec.is_queued() && sequence_number(rec.request_id()).is_some_and(|s| s < mark)
            })
            .map(|(n, _)| n)
            .collect();
        self.dirty_acks.insert(client);
        for n in below {
            self.remove_record(n);
        }
    }

    /// `Tick`: advances the log clock, then closes idle sessions (those with a queued acquire
    /// stay open).
    fn tick(&mut self, elapsed_ms: u64) -> Outcome {
        self.clock_ms = self.clock_ms.saturating_add(elapsed_ms.min(TICK_MAX_MS));
        self.dirty_meta |= DIRTY_CLOCK;
        let idle = self.limits.session_idle_ms;
        let clock = self.clock_ms;
        let closing: Vec<Arc<str>> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.queued == 0)
            .filter(|(_, s)| {
                let newest = s.records.newest().and_then(|n| self.dedupe.get(&n));
                let active = newest.map_or(0, |r| r.at_ms).max(s.mark_at_ms);
                active.saturating_add(idle) <= clock
            })
            .map(|(client, _)| client.clone())
            .collect();
        for client in closing {
            let Some(session) = self.sessions.remove(&client) else {
                continue;
            };
            if session.mark > 0 {
                self.dirty_acks.insert(client);
            }
            // Dead entries are no longer in the table: removing them changes nothing.
            for n in session.records.iter() {
                if self.dedupe.remove(&n).is_some() {
                    self.dirty_blocks.insert(n / DEDUPE_BLOCK);
                }
            }
        }
        Outcome::Stored
    }

    // ----- persistence -----------------------------------------------------------------------

    /// The value stored under a state key now, or None if it is absent.
    fn value_of(&self, key: &str) -> Option<Vec<u8>> {
        if let Some(k) = key.strip_prefix(LOCK_PREFIX) {
            return self.locks.get(k).map(|entry| encode_plain(&**entry));
        }
        if let Some(k) = key.strip_prefix(DATA_PREFIX) {
            return self.data.get(k).cloned();
        }
        if let Some(n) = key.strip_prefix(META_DEDUPE_PREFIX) {
            let n: u64 = n.parse().ok()?;
            return self.dedupe.get(&n).map(encode_plain);
        }
        if let Some(client) = key.strip_prefix(META_ACK_PREFIX) {
            let session = self.sessions.get(client).filter(|s| s.mark > 0)?;
            return Some(encode_plain(&(session.mark, session.mark_at_ms)));
        }
        match key {
            META_SEQ => Some(self.fencing_seq.to_be_bytes().to_vec()),
            META_APPLIED => Some(self.applied_index.to_be_bytes().to_vec()),
            META_DEDUPE_NEXT => Some(self.dedupe_next.to_be_bytes().to_vec()),
            META_CLOCK => (self.clock_ms > 0).then(|| self.clock_ms.to_be_bytes().to_vec()),
            META_CLUSTER_VERSION => {
                (self.cluster_version() > 1).then(|| self.cluster_version.to_be_bytes().to_vec())
            }
            META_LIMITS => self.limits_replicated.then(|| encode_plain(&self.limits)),
            META_CLUSTER => self.cluster.as_ref().map(encode_plain),
            META_MEMBERS => (!self.members.is_empty()).then(|| encode_plain(&self.members)),
            META_QUOTAS => self.quotas.as_ref().map(encode_plain),
            _ => None,
        }
    }

    /// State keys changed since the last [`LockStateMachine::take_changes`]: what it would
    /// return, besides the few legacy exactly-once keys it moves into blocks per call. Applying
    /// only marks keys; their values are read and encoded by `take_changes`.
    pub fn pending_changes(&self) -> usize {
        self.dirty.len()
            + self.dirty_meta.count_ones() as usize
            + self.dirty_blocks.len()
            + self.dirty_acks.len()
    }

    /// State writes since the last call: `(key, Some(value))` puts, `(key, None)` deletes.
    ///
    /// Dedupe records come as blocks (`meta/dedupe_block/<b>`, deleted when empty). Writing a
    /// block deletes the one-record keys of its records where `from_kv` found them, in the same
    /// changes, so a record is never stored twice; besides the blocks that changed, up to
    /// `LEGACY_BLOCKS_PER_WRITE` blocks still stored one key per record move each time.
    pub fn take_changes(&mut self) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let mut blocks = std::mem::take(&mut self.dirty_blocks);
        // The blocks of the lowest one-record keys, besides those that changed.
        let (mut moved, mut from) = (0, 0);
        while moved < LEGACY_BLOCKS_PER_WRITE {
            let Some(&n) = self.legacy_dedupe_keys.range(from..).next() else {
                break;
            };
            let b = n / DEDUPE_BLOCK;
            moved += usize::from(blocks.insert(b));
            from = b.saturating_add(1).saturating_mul(DEDUPE_BLOCK);
        }
        let mut changes: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
        for b in blocks {
            let first = b.saturating_mul(DEDUPE_BLOCK);
            let range = first..first.saturating_add(DEDUPE_BLOCK);
            let old: Vec<u64> = self
                .legacy_dedupe_keys
                .range(range.clone())
                .copied()
                .collect();
            for n in old {
                self.legacy_dedupe_keys.remove(&n);
                changes.push((dedupe_key(n).into_bytes(), None));
            }
            let records: Vec<(u64, &DedupeRecord)> =
                self.dedupe.range(range).map(|(&n, r)| (n, &**r)).collect();
            let value = (!records.is_empty()).then(|| encode_plain(&records));
            changes.push((dedupe_block_key(b).into_bytes(), value));
        }
        let mut dirty = std::mem::take(&mut self.dirty);
        for client in std::mem::take(&mut self.dirty_acks) {
            dirty.insert(format!("{META_ACK_PREFIX}{client}"));
        }
        for (bit, key) in DIRTY_META_KEYS {
            if self.dirty_meta & bit != 0 {
                dirty.insert(key.to_string());
            }
        }
        self.dirty_meta = 0;
        changes.extend(
            dirty
                .into_iter()
                .map(|k| (k.clone().into_bytes(), self.value_of(&k))),
        );
        changes
    }

    /// The full state as key-value pairs in key order.
    pub fn to_kv(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut keys: Vec<String> = Vec::new();
        keys.extend(self.locks.keys().map(|k| format!("{LOCK_PREFIX}{k}")));
        keys.extend(self.data.keys().map(|k| format!("{DATA_PREFIX}{k}")));
        keys.extend(self.dedupe.keys().map(|&n| dedupe_key(n)));
        keys.extend(
            self.sessions
                .iter()
                .filter(|(_, s)| s.mark > 0)
                .map(|(client, _)| format!("{META_ACK_PREFIX}{client}")),
        );
        keys.extend(
            [
                META_SEQ,
                META_APPLIED,
                META_DEDUPE_NEXT,
                META_LIMITS,
                META_CLOCK,
                META_CLUSTER_VERSION,
                META_CLUSTER,
                META_MEMBERS,
                META_QUOTAS,
            ]
            .map(String::from),
        );
        keys.sort();
        keys.into_iter()
            .filter_map(|k| self.value_of(&k).map(|v| (k.into_bytes(), v)))
            .collect()
    }

    /// Rebuilds the state from the full set of persisted pairs (any order).
    pub fn from_kv<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, DecodeError> {
        Self::from_kv_with_limits(pairs, Limits::default())
    }

    /// [`LockStateMachine::from_kv`] with these limits. The pairs may be borrowed (a snapshot
    /// read in place): only what the state keeps is copied.
    pub fn from_kv_with_limits<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        pairs: impl IntoIterator<Item = (K, V)>,
        limits: Limits,
    ) -> Result<Self, DecodeError> {
        let mut loader = StateLoader::new(limits);
        for (key, value) in pairs {
            loader.add(key.as_ref(), value.as_ref())?;
        }
        loader.finish()
    }

    /// Adds record `n` read from stored state; a number seen twice is damaged state.
    fn add_loaded_record(&mut self, n: u64, mut rec: DedupeRecord) -> Result<(), DecodeError> {
        if self.dedupe.contains_key(&n) {
            return Err(DecodeError::InvalidState(format!(
                "dedupe record {n} stored twice"
            )));
        }
        self.add_to_session(n, &mut rec);
        self.dedupe.insert(n, Box::new(rec));
        Ok(())
    }

    /// The whole state as one deterministic blob: byte-identical for identical state.
    pub fn snapshot(&self) -> Vec<u8> {
        super::command::encode_versioned(SNAPSHOT_VERSION, &self.to_kv())
    }

    pub fn restore(bytes: &[u8], limits: Limits) -> Result<Self, DecodeError> {
        let pairs: Vec<(Vec<u8>, Vec<u8>)> =
            super::command::decode_versioned(SNAPSHOT_VERSION, bytes)?;
        Self::from_kv_with_limits(pairs, limits)
    }
}

/// Key-value pairs of the state.
pub type StatePairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Stored state pairs (as `take_changes` wrote them, any order) as a snapshot carries them: the
/// dedupe blocks opened into one key per record, in key order. Snapshots keep the one layout
/// every RaftLock version reads, so nodes of different versions can send each other snapshots.
pub fn stored_to_snapshot_pairs(mut pairs: StatePairs) -> Result<StatePairs, DecodeError> {
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    StoredToSnapshot::new(pairs.into_iter().map(Ok), |e| e).collect()
}

/// [`stored_to_snapshot_pairs`] one pair at a time, over stored pairs read in key order (as
/// storage reads them for a snapshot): the snapshot of a large state is encoded as it is read,
/// without a copy of the whole state on the way. A block's records come out as they are
/// opened; one-record keys (a store that is still moving to blocks) are held back until the
/// records and keys that sort before them are out. A pair out of key order is an error.
pub struct StoredToSnapshot<I, E> {
    stored: I,
    error: fn(DecodeError) -> E,
    /// One-record keys read and not yet handed out, by key.
    legacy: BTreeMap<Vec<u8>, Vec<u8>>,
    ready: VecDeque<(Vec<u8>, Vec<u8>)>,
    last: Option<Vec<u8>>,
    done: bool,
}

impl<I, E> StoredToSnapshot<I, E>
where
    I: Iterator<Item = Result<(Vec<u8>, Vec<u8>), E>>,
{
    /// `error` turns a decoding problem into the stored pairs' error type.
    pub fn new(stored: I, error: fn(DecodeError) -> E) -> Self {
        StoredToSnapshot {
            stored,
            error,
            legacy: BTreeMap::new(),
            ready: VecDeque::new(),
            last: None,
            done: false,
        }
    }

    /// Queues the held-back one-record keys that sort before `key` (all of them for `None`).
    fn release_legacy(&mut self, key: Option<&[u8]>) {
        while let Some(entry) = self.legacy.first_entry() {
            if key.is_some_and(|k| entry.key().as_slice() >= k) {
                break;
            }
            let (k, v) = entry.remove_entry();
            self.ready.push_back((k, v));
        }
    }

    /// Takes in one stored pair.
    fn take(&mut self, key: Vec<u8>, value: Vec<u8>) -> Result<(), DecodeError> {
        if key.starts_with(META_DEDUPE_PREFIX.as_bytes()) {
            self.legacy.insert(key, value);
            return Ok(());
        }
        let Some(b) = key.strip_prefix(META_DEDUPE_BLOCK_PREFIX.as_bytes()) else {
            self.release_legacy(Some(&key));
            self.ready.push_back((key, value));
            return Ok(());
        };
        let b: u64 = std::str::from_utf8(b)
            .ok()
            .and_then(|b| b.parse().ok())
            .ok_or_else(|| DecodeError::InvalidState("bad dedupe block key".into()))?;
        let records: Vec<(u64, DedupeRecord)> = decode_plain(&value)?;
        for (n, rec) in records {
            if n / DEDUPE_BLOCK != b {
                return Err(DecodeError::InvalidState(format!(
                    "dedupe record {n} stored in block {b}"
                )));
            }
            let key = dedupe_key(n).into_bytes();
            self.release_legacy(Some(&key));
            self.ready.push_back((key, encode_plain(&rec)));
        }
        Ok(())
    }
}

impl<I, E> Iterator for StoredToSnapshot<I, E>
where
    I: Iterator<Item = Result<(Vec<u8>, Vec<u8>), E>>,
{
    type Item = Result<(Vec<u8>, Vec<u8>), E>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some((key, value)) = self.ready.pop_front() {
                if self.last.as_ref().is_some_and(|last| *last >= key) {
                    self.done = true;
                    self.ready.clear();
                    return Some(Err((self.error)(DecodeError::InvalidState(format!(
                        "state key {} out of order",
                        String::from_utf8_lossy(&key)
                    )))));
                }
                self.last = Some(key.clone());
                return Some(Ok((key, value)));
            }
            if self.done {
                return None;
            }
            match self.stored.next() {
                None => {
                    self.done = true;
                    self.release_legacy(None);
                }
                Some(Err(err)) => {
                    self.done = true;
                    return Some(Err(err));
                }
                Some(Ok((key, value))) => {
                    if let Err(err) = self.take(key, value) {
                        self.done = true;
                        self.ready.clear();
                        return Some(Err((self.error)(err)));
                    }
                }
            }
        }
    }
}

/// The key of one dedupe record as snapshots carry it (and as storage held it before blocks).
fn dedupe_key(n: u64) -> String {
    // Zero-padded so key order is insertion order.
    format!("{META_DEDUPE_PREFIX}{n:020}")
}

/// The key of the block holding records `b * DEDUPE_BLOCK ..` (zero-padded: key order is
/// insertion order).
fn dedupe_block_key(b: u64) -> String {
    format!("{META_DEDUPE_BLOCK_PREFIX}{b:020}")
}

fn check_ttl(ttl_ms: u64, l: &Limits) -> Result<(), Outcome> {
    if ttl_ms == 0 || ttl_ms > l.ttl_ms_max {
        return Err(Outcome::rejected(
            RejectCode::InvalidRequest,
            format!("ttl must be 1..={} ms", l.ttl_ms_max),
        ));
    }
    Ok(())
}

fn check_token_key(token: &FencingToken, key: &str) -> Result<(), Outcome> {
    if token.key != key {
        return Err(Outcome::rejected(
            RejectCode::InvalidRequest,
            format!("the fencing token is for key {:?}, not {key:?}", token.key),
        ));
    }
    Ok(())
}

fn check_guard(guard: Option<&FencingToken>, l: &Limits) -> Result<(), Outcome> {
    match guard {
        Some(g) if g.key.is_empty() || g.key.len() > l.key_bytes_max => Err(Outcome::rejected(
            RejectCode::InvalidRequest,
            "the guard token's key is empty or too long",
        )),
        _ => Ok(()),
    }
}

/// Builds a [`LockStateMachine`] from stored or snapshot pairs a few at a time, so that a large
/// state can be loaded in slices between other work (a snapshot install on the Raft thread).
/// [`LockStateMachine::from_kv_with_limits`] is one of these fed every pair at once.
#[derive(Debug)]
pub struct StateLoader {
    sm: LockStateMachine,
}

impl StateLoader {
    pub fn new(limits: Limits) -> Self {
        StateLoader {
            sm: LockStateMachine::new(limits),
        }
    }

    /// Adds one pair. An error means the pairs are damaged; the loader should be dropped.
    pub fn add(&mut self, key: &[u8], value: &[u8]) -> Result<(), DecodeError> {
        let sm = &mut self.sm;
        let key = std::str::from_utf8(key)
            .map_err(|_| DecodeError::InvalidState("state key is not UTF-8".into()))?;
        if let Some(k) = key.strip_prefix(LOCK_PREFIX) {
            let entry: LockEntry = match decode_plain(value) {
                Ok(entry) => entry,
                // Written before holders recorded their lease index.
                Err(err) => decode_plain::<LockEntryV1>(value)
                    .map(LockEntry::from)
                    .map_err(|_| err)?,
            };
            sm.locks_held += usize::from(entry.holder.is_some());
            sm.waiters += entry.waiters.len();
            sm.locks.insert(Box::from(k), Box::new(entry));
        } else if let Some(k) = key.strip_prefix(DATA_PREFIX) {
            sm.data.insert(k.to_string(), value.to_vec());
        } else if let Some(b) = key.strip_prefix(META_DEDUPE_BLOCK_PREFIX) {
            let b: u64 = b
                .parse()
                .map_err(|_| DecodeError::InvalidState(format!("bad dedupe key {key}")))?;
            let records: Vec<(u64, DedupeRecord)> = decode_plain(value)?;
            if records.is_empty() {
                return Err(DecodeError::InvalidState(format!("empty block {key}")));
            }
            for (n, rec) in records {
                if n / DEDUPE_BLOCK != b {
                    return Err(DecodeError::InvalidState(format!(
                        "dedupe record {n} stored in block {key}"
                    )));
                }
                sm.add_loaded_record(n, rec)?;
            }
        } else if let Some(client) = key.strip_prefix(META_ACK_PREFIX) {
            let (mark, at_ms): (u64, u64) = decode_plain(value)?;
            if mark == 0 {
                return Err(DecodeError::InvalidState(format!("{key} holds no mark")));
            }
            let session = sm.sessions.entry(Arc::from(client)).or_default();
            session.mark = mark;
            session.mark_at_ms = at_ms;
        } else if let Some(n) = key.strip_prefix(META_DEDUPE_PREFIX) {
            let n: u64 = n
                .parse()
                .map_err(|_| DecodeError::InvalidState(format!("bad dedupe key {key}")))?;
            let rec: DedupeRecord = match decode_plain(value) {
                Ok(rec) => rec,
                Err(err) => decode_plain::<DedupeRecordV2>(value)
                    .map(|old| {
                        DedupeRecord::new(
                            old.client_id.into(),
                            &old.request_id,
                            old.outcome,
                            old.op.as_ref().map(|(kind, key)| (*kind, key.as_str())),
                            0,
                        )
                    })
                    .or_else(|_| {
                        decode_plain::<DedupeRecordV1>(value).map(|old| {
                            DedupeRecord::new(
                                old.client_id.into(),
                                &old.request_id,
                                old.outcome,
                                None,
                                0,
                            )
                        })
                    })
                    .map_err(|_| err)?,
            };
            sm.add_loaded_record(n, rec)?;
            sm.legacy_dedupe_keys.insert(n);
        } else {
            match key {
                META_SEQ => sm.fencing_seq = u64_of(value, "meta/seq")?,
                META_APPLIED => sm.applied_index = u64_of(value, "meta/applied")?,
                META_DEDUPE_NEXT => sm.dedupe_next = u64_of(value, "meta/dedupe_next")?,
                META_CLOCK => sm.clock_ms = u64_of(value, "meta/clock")?,
                META_CLUSTER_VERSION => {
                    let bytes: [u8; 4] = value.try_into().map_err(|_| {
                        DecodeError::InvalidState("meta/cluster_version is not 4 bytes".into())
                    })?;
                    sm.cluster_version = u32::from_be_bytes(bytes);
                }
                META_CLUSTER => sm.cluster = Some(decode_plain(value)?),
                META_MEMBERS => sm.members = decode_plain(value)?,
                META_QUOTAS => sm.quotas = Some(decode_plain(value)?),
                META_LIMITS => {
                    sm.limits = match decode_plain(value) {
                        Ok(limits) => limits,
                        // Written before client sessions existed.
                        Err(err) => decode_plain::<crate::lock::limits::LimitsV1>(value)
                            .map(Limits::from)
                            .map_err(|_| err)?,
                    };
                    sm.limits_replicated = true;
                }
                other => {
                    return Err(DecodeError::InvalidState(format!(
                        "unknown state key {other}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// The state the pairs describe, checked as a whole.
    pub fn finish(self) -> Result<LockStateMachine, DecodeError> {
        let mut sm = self.sm;
        sm.recount();
        let max_token = sm
            .locks
            .values()
            .filter_map(|e| e.holder.as_ref())
            .map(|h| h.token)
            .max();
        if max_token.is_some_and(|t| t > sm.fencing_seq) {
            return Err(DecodeError::InvalidState(
                "a held token is above the fencing sequence".into(),
            ));
        }
        Ok(sm)
    }
}

/// The sequence number a request id names ([`Command::Sequenced`]): decimal digits without a
/// leading zero, from 1 to `u64::MAX`.
pub fn sequence_number(request_id: &str) -> Option<u64> {
    let digits = request_id.as_bytes();
    if digits.first().is_none_or(|&d| d == b'0') || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    request_id.parse().ok()
}

fn u64_of(v: &[u8], what: &str) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = v
        .try_into()
        .map_err(|_| DecodeError::InvalidState(format!("{what} is not 8 bytes")))?;
    Ok(u64::from_be_bytes(bytes))
}

#[cfg(test)]
mod dedupe_storage_tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn acquire(key: String, client: &str, request: String) -> Command {
        Command::Acquire {
            key,
            client_id: client.into(),
            request_id: request,
            ttl_ms: 10_000,
            wait_timeout_ms: None,
        }
    }

    /// A state machine that answered `n` acquires (one key each, one client) and released
    /// every other one, with the store its `take_changes` wrote.
    fn busy(n: usize) -> (LockStateMachine, BTreeMap<Vec<u8>, Vec<u8>>, usize) {
        let mut sm = LockStateMachine::new(Limits::default());
        let mut store = BTreeMap::new();
        let mut index = 0;
        for i in 0..n {
            index += 1;
            let applied = sm.apply(index, &acquire(format!("k{i}"), "c", format!("a{i}")));
            let Outcome::Granted { token, .. } = applied.outcome else {
                panic!("acquire {i}: {:?}", applied.outcome);
            };
            if i % 2 == 0 {
                index += 1;
                sm.apply(
                    index,
                    &Command::Release {
                        key: format!("k{i}"),
                        client_id: "c".into(),
                        request_id: format!("r{i}"),
                        token,
                    },
                );
            }
        }
        let changes = sm.take_changes();
        let keys_written = changes.len();
        write(&mut store, changes);
        (sm, store, keys_written)
    }

    fn write(store: &mut BTreeMap<Vec<u8>, Vec<u8>>, changes: Vec<(Vec<u8>, Option<Vec<u8>>)>) {
        for (k, v) in changes {
            match v {
                Some(v) => store.insert(k, v),
                None => store.remove(&k),
            };
        }
    }

    #[test]
    fn answers_are_written_a_block_of_records_to_a_key() {
        let (sm, store, keys_written) = busy(300);
        // 450 answers (300 acquires, 150 releases): 15 blocks, not 450 keys.
        assert_eq!(sm.dedupe.len(), 450);
        let blocks = store
            .keys()
            .filter(|k| k.starts_with(META_DEDUPE_BLOCK_PREFIX.as_bytes()))
            .count();
        assert_eq!(blocks, 450_usize.div_ceil(DEDUPE_BLOCK as usize));
        assert!(!store
            .keys()
            .any(|k| k.starts_with(META_DEDUPE_PREFIX.as_bytes())));
        // 300 lock keys (150 held, 150 released: deleted), the blocks and a few meta keys;
        // one key per answer would have been 450 more.
        assert!(
            keys_written < 300 + blocks + 8,
            "{keys_written} keys written"
        );
        // What was written reads back as the same state, and a retry is answered from it.
        let mut back = LockStateMachine::from_kv(store.clone()).expect("reads back");
        assert!(back == sm);
        let retry = back.apply(10_000, &acquire("k7".into(), "c", "a7".into()));
        assert!(retry.replayed, "a retry is answered from the table");
    }

    /// The layout records had when they were a derived struct of owned strings: what every
    /// stored block and every snapshot of earlier versions holds.
    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct OwnedLayout {
        client_id: String,
        request_id: String,
        outcome: Outcome,
        op: Option<(u8, String)>,
        at_ms: u64,
    }

    #[test]
    fn records_encode_and_decode_in_the_layout_of_owned_strings() {
        let (sm, _, _) = busy(40);
        let mut checked = 0;
        for (&n, rec) in &sm.dedupe {
            let owned = OwnedLayout {
                client_id: rec.client_id.to_string(),
                request_id: rec.request_id().to_string(),
                outcome: rec.outcome(),
                op: rec.op().map(|(k, key)| (k, key.to_string())),
                at_ms: rec.at_ms,
            };
            let bytes = encode_plain(&**rec);
            assert_eq!(bytes, encode_plain(&owned), "record {n}");
            let back: DedupeRecord = decode_plain(&encode_plain(&owned)).expect("decodes");
            assert_eq!(back, **rec, "record {n}");
            checked += 1;
        }
        assert_eq!(checked, 60);
        // A block, as a list of numbered records, too.
        let block: Vec<(u64, &DedupeRecord)> = sm.dedupe.iter().map(|(&n, r)| (n, &**r)).collect();
        let owned: Vec<(u64, OwnedLayout)> = decode_plain(&encode_plain(&block)).expect("decodes");
        assert_eq!(owned.len(), 60);
        assert_eq!(owned[0].1.client_id, "c");
    }

    #[test]
    fn records_keep_every_outcome_whatever_its_form() {
        let token = |key: &str| FencingToken {
            key: key.into(),
            value: 9,
        };
        let cases = [
            (
                Outcome::Granted {
                    token: token("jobs/a"),
                    ttl_ms: 5,
                },
                Some((1, "jobs/a")),
            ),
            // A token of another key than the request's, or no known key: kept as it is.
            (
                Outcome::Granted {
                    token: token("jobs/b"),
                    ttl_ms: 5,
                },
                Some((1, "jobs/a")),
            ),
            (
                Outcome::Granted {
                    token: token("jobs/a"),
                    ttl_ms: 5,
                },
                None,
            ),
            (
                Outcome::Renewed {
                    token: token("jobs/a"),
                    ttl_ms: 7,
                },
                Some((3, "jobs/a")),
            ),
            (Outcome::Queued { position: 4 }, Some((1, "jobs/a"))),
            (Outcome::Released, Some((2, ""))),
            (Outcome::WaitCancelled, Some((4, "jobs/a"))),
            (Outcome::Stored, Some((5, "data/x"))),
            (Outcome::Deleted { existed: true }, Some((6, "data/x"))),
            (Outcome::NotHolder, Some((2, "jobs/a"))),
            (
                Outcome::rejected(RejectCode::LimitReached, "full"),
                Some((1, "jobs/a")),
            ),
        ];
        for (outcome, op) in cases {
            let rec = DedupeRecord::new("c".into(), "req-1", outcome.clone(), op, 3);
            assert_eq!(rec.outcome(), outcome, "{op:?}");
            assert_eq!(rec.op(), op);
            assert_eq!(rec.request_id(), "req-1");
            let owned = OwnedLayout {
                client_id: "c".into(),
                request_id: "req-1".into(),
                outcome: outcome.clone(),
                op: op.map(|(k, key)| (k, key.to_string())),
                at_ms: 3,
            };
            assert_eq!(encode_plain(&rec), encode_plain(&owned), "{outcome:?}");
            let back: DedupeRecord = decode_plain(&encode_plain(&owned)).expect("decodes");
            assert_eq!(back, rec);
        }
        // The compact form is what makes a record 72 bytes instead of 112.
        assert!(std::mem::size_of::<DedupeRecord>() <= 72);
        let granted = DedupeRecord::new(
            "c".into(),
            "r",
            Outcome::Granted {
                token: token("k"),
                ttl_ms: 1,
            },
            Some((1, "k")),
            0,
        );
        assert!(matches!(granted.outcome, KeptOutcome::Granted { .. }));
    }

    #[test]
    fn a_session_shares_one_copy_of_its_client_id_also_after_a_reload() {
        let (sm, store, _) = busy(10);
        let back = LockStateMachine::from_kv(store).expect("reads back");
        for machine in [&sm, &back] {
            let (session_key, _) = machine.sessions.get_key_value("c").expect("session c");
            for rec in machine.dedupe.values() {
                assert!(Arc::ptr_eq(&rec.client_id, session_key));
            }
        }
    }

    /// The hash index answers as the ordered set of (hash, number) it replaced: the same
    /// numbers under each hash, newest first, through inserts in any order and removals, with
    /// hashes chosen from a handful so that they collide often.
    #[test]
    fn request_index_lists_what_an_ordered_set_would() {
        let mut index = RequestIndex::default();
        let mut model: BTreeSet<(u64, u64)> = BTreeSet::new();
        let mut rng = ChaCha8Rng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.random_range(0..1u64 << 31);
        for step in 0..20_000u64 {
            let hash = next() % 5;
            let n = next() % 64;
            if next() % 3 == 0 {
                index.remove(hash, n);
                model.remove(&(hash, n));
            } else if !model.contains(&(hash, n)) {
                index.insert(hash, n);
                model.insert((hash, n));
            }
            for h in 0..5 {
                let want: Vec<u64> = model
                    .range((h, 0)..=(h, u64::MAX))
                    .rev()
                    .map(|&(_, n)| n)
                    .collect();
                let got: Vec<u64> = index.under(h).collect();
                assert_eq!(got, want, "hash {h} after step {step}");
            }
        }
        assert!(index.newest.len() <= 5);
    }

    /// A session's deque of record numbers, dead entries and all, lists what the ordered set it
    /// replaced would: new numbers at the back, forgotten ones anywhere (the oldest most often,
    /// as evictions do), a few reloaded out of order; and it stays within its bound.
    #[test]
    fn session_records_list_what_an_ordered_set_would() {
        let mut records = SessionRecords::default();
        let mut model: BTreeSet<u64> = BTreeSet::new();
        let mut rng = ChaCha8Rng::seed_from_u64(0x2545_f491_4f6c_dd1d);
        let mut next = move || rng.random_range(0..1u64 << 31);
        let mut fresh = 1_000u64;
        for step in 0..20_000u64 {
            match next() % 8 {
                0..=2 => {
                    fresh += 1 + next() % 3;
                    records.insert(fresh);
                    model.insert(fresh);
                }
                3 => {
                    // A reload: an older number not held.
                    let n = next() % fresh;
                    if model.insert(n) {
                        records.insert(n);
                    }
                }
                4..=5 => {
                    if let Some(&oldest) = model.first() {
                        model.remove(&oldest);
                        records.remove(oldest, |m| model.contains(&m));
                    }
                }
                _ => {
                    let held: Vec<u64> = model.iter().copied().collect();
                    if !held.is_empty() {
                        let n = held[next() as usize % held.len()];
                        model.remove(&n);
                        records.remove(n, |m| model.contains(&m));
                    }
                }
            }
            let live: Vec<u64> = records.iter().filter(|n| model.contains(n)).collect();
            let want: Vec<u64> = model.iter().copied().collect();
            assert_eq!(live, want, "after step {step}");
            assert_eq!(records.len(), model.len());
            assert_eq!(records.newest(), model.last().copied());
            assert!(records.numbers.len() <= 2 * model.len() + 16, "step {step}");
        }
    }

    /// A session's table gives its memory back as its answers go: the index of a session that
    /// held 100,000 answers and keeps 10 is small again.
    #[test]
    fn request_index_shrinks_as_answers_go() {
        let mut index = RequestIndex::default();
        for n in 0..100_000u64 {
            index.insert(request_hash(&format!("r-{n}")), n);
        }
        let peak = index.newest.capacity();
        assert!(peak >= 100_000);
        for n in 0..99_990u64 {
            index.remove(request_hash(&format!("r-{n}")), n);
        }
        assert_eq!(index.newest.len(), 10);
        assert!(
            index.newest.capacity() <= 64,
            "capacity {} of {peak} kept for 10 answers",
            index.newest.capacity()
        );
        for n in 99_990..100_000u64 {
            let hash = request_hash(&format!("r-{n}"));
            assert_eq!(index.under(hash).collect::<Vec<_>>(), vec![n]);
        }
    }

    #[test]
    fn request_ids_under_one_hash_are_told_apart() {
        let (mut sm, _, _) = busy(4);
        let a0 = sm.record_number("c", "a0").expect("a0 is remembered");
        let a1 = sm.record_number("c", "a1").expect("a1 is remembered");
        assert_ne!(a0, a1);
        // File a1's record under a0's hash as well, as if the two ids hashed alike.
        let session = sm.sessions.get_mut("c").expect("session c");
        session.by_request.insert(request_hash("a0"), a1);
        assert_eq!(sm.record_number("c", "a0"), Some(a0));
        assert_eq!(sm.record_number("c", "a1"), Some(a1));
        assert_eq!(sm.record_number("c", "a9"), None);
        assert_eq!(sm.record_number("d", "a0"), None);
        // Forgetting a0 leaves a1 findable under its own hash, and a0 answers no more.
        sm.remove_record(a0);
        assert_eq!(sm.record_number("c", "a0"), None);
        assert_eq!(sm.record_number("c", "a1"), Some(a1));
    }

    #[test]
    fn forgetting_answers_rewrites_or_deletes_their_blocks() {
        let (mut sm, mut store, _) = busy(100);
        let before = sm.dedupe.len();
        // Forget the oldest 40 records: the first block goes, the second is rewritten.
        let oldest: Vec<u64> = sm.dedupe.keys().copied().take(40).collect();
        for n in oldest {
            sm.remove_record(n);
        }
        let changes = sm.take_changes();
        assert!(changes.contains(&(dedupe_block_key(0).into_bytes(), None)));
        assert!(changes
            .iter()
            .any(|(k, v)| k == dedupe_block_key(1).as_bytes() && v.is_some()));
        write(&mut store, changes);
        let back = LockStateMachine::from_kv(store).expect("reads back");
        assert_eq!(back.dedupe.len(), before - 40);
        assert!(back == sm);
    }

    /// The store as an older RaftLock (or a snapshot install) leaves it: one key per record.
    fn one_key_per_record(store: &BTreeMap<Vec<u8>, Vec<u8>>) -> BTreeMap<Vec<u8>, Vec<u8>> {
        let pairs: Vec<(Vec<u8>, Vec<u8>)> =
            store.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        stored_to_snapshot_pairs(pairs)
            .expect("opens")
            .into_iter()
            .collect()
    }

    #[test]
    fn a_snapshot_opened_as_read_refuses_keys_out_of_order_or_twice() {
        let (sm, store, _) = busy(100);
        let stream = |pairs: Vec<(Vec<u8>, Vec<u8>)>| -> Result<StatePairs, DecodeError> {
            StoredToSnapshot::new(pairs.into_iter().map(Ok), |e| e).collect()
        };
        let in_order: Vec<_> = store.clone().into_iter().collect();
        assert_eq!(stream(in_order.clone()).expect("opens"), sm.to_kv());
        let mut swapped = in_order.clone();
        let last = swapped.len() - 1;
        swapped.swap(0, last);
        assert!(stream(swapped).is_err(), "stored pairs out of order");
        // A record both in a block and under its one-record key.
        let (&n, rec) = sm.dedupe.iter().next().expect("a record");
        let mut twice = store;
        twice.insert(dedupe_key(n).into_bytes(), encode_plain(rec));
        let err = stream(twice.into_iter().collect()).expect_err("a record twice");
        assert!(err.to_string().contains("out of order"), "{err}");
        // A storage error ends the stream with that error.
        let failing = in_order
            .into_iter()
            .map(Ok)
            .take(3)
            .chain(std::iter::once(Err("disk")));
        let got: Result<Vec<_>, &str> = StoredToSnapshot::new(failing, |_| "decode").collect();
        assert_eq!(got, Err("disk"));
    }

    #[test]
    fn snapshots_carry_one_key_per_record() {
        let (sm, store, _) = busy(100);
        let pairs: Vec<(Vec<u8>, Vec<u8>)> = store.into_iter().collect();
        let opened = stored_to_snapshot_pairs(pairs).expect("opens");
        assert_eq!(opened, sm.to_kv(), "the snapshot layout, in key order");
        assert!(opened
            .iter()
            .all(|(k, _)| !k.starts_with(META_DEDUPE_BLOCK_PREFIX.as_bytes())));
    }

    #[test]
    fn one_key_per_record_state_reads_back_and_moves_to_blocks() {
        let (sm, store, _) = busy(100);
        let mut old = one_key_per_record(&store);
        let mut migrated = LockStateMachine::from_kv(old.clone()).expect("old layout reads");
        assert!(migrated == sm);
        assert_eq!(
            migrated.snapshot(),
            sm.snapshot(),
            "snapshots stay byte-identical"
        );
        // 150 records are 5 blocks, within one write's share: the next write moves them all.
        let changes = migrated.take_changes();
        let deleted = changes
            .iter()
            .filter(|(k, v)| k.starts_with(META_DEDUPE_PREFIX.as_bytes()) && v.is_none())
            .count();
        assert_eq!(deleted, sm.dedupe.len());
        write(&mut old, changes);
        assert_eq!(old, store, "after one write the store is the new layout");
        assert!(migrated.take_changes().is_empty());
    }

    #[test]
    fn a_large_old_table_moves_a_few_blocks_per_write_and_always_reads_back() {
        let (sm, store, _) = busy(600);
        let blocks = sm.dedupe.len().div_ceil(DEDUPE_BLOCK as usize);
        assert!(blocks > 3 * LEGACY_BLOCKS_PER_WRITE);
        let mut stored = one_key_per_record(&store);
        let mut node = LockStateMachine::from_kv(stored.clone()).expect("reads");
        let mut writes = 0;
        let mut index = 100_000;
        loop {
            // Work goes on meanwhile: a new answer, and an old one forgotten from a block that
            // has not moved yet (its block is written, and its old keys deleted, at once).
            index += 1;
            node.apply(
                index,
                &acquire(format!("new{writes}"), "d", format!("n{writes}")),
            );
            if let Some(&last_old) = node.legacy_dedupe_keys.last() {
                node.remove_record(last_old);
            }
            let changes = node.take_changes();
            if changes.is_empty() {
                break;
            }
            assert!(changes.len() < 2 * LEGACY_BLOCKS_PER_WRITE * DEDUPE_BLOCK as usize + 20);
            write(&mut stored, changes);
            writes += 1;
            // Every intermediate store holds each record exactly once and reads back.
            let back = LockStateMachine::from_kv(stored.clone())
                .unwrap_or_else(|e| panic!("after write {writes}: {e}"));
            assert!(back == node, "after write {writes}");
            // ...and its snapshot, opened as it is read (one-record keys and blocks mixed),
            // is the state's snapshot layout.
            let streamed: Result<StatePairs, DecodeError> =
                StoredToSnapshot::new(stored.clone().into_iter().map(Ok), |e| e).collect();
            assert_eq!(
                streamed.expect("opens"),
                node.to_kv(),
                "after write {writes}"
            );
            if node.legacy_dedupe_keys.is_empty() {
                break;
            }
            assert!(writes < 100, "the move does not end");
        }
        assert!(node.legacy_dedupe_keys.is_empty());
        assert!(writes > 1, "moved in several writes, not one");
        assert!(!stored
            .keys()
            .any(|k| k.starts_with(META_DEDUPE_PREFIX.as_bytes())));
    }

    #[test]
    fn damaged_blocks_are_errors() {
        let (sm, store, _) = busy(40);
        // A record in the wrong block.
        let mut wrong = store.clone();
        let block0 = wrong
            .remove(dedupe_block_key(0).as_bytes())
            .expect("block 0");
        wrong.insert(dedupe_block_key(5).into_bytes(), block0);
        assert!(LockStateMachine::from_kv(wrong).is_err());
        // A record both in a block and under its old key.
        let mut twice = store.clone();
        let (&n, rec) = sm.dedupe.iter().next().expect("a record");
        twice.insert(dedupe_key(n).into_bytes(), encode_plain(rec));
        assert!(LockStateMachine::from_kv(twice).is_err());
        // An empty block and garbage.
        let mut empty = store.clone();
        empty.insert(
            dedupe_block_key(9).into_bytes(),
            encode_plain(&Vec::<(u64, DedupeRecord)>::new()),
        );
        assert!(LockStateMachine::from_kv(empty).is_err());
        let mut garbage = store;
        garbage.insert(dedupe_block_key(0).into_bytes(), vec![0xff; 7]);
        assert!(LockStateMachine::from_kv(garbage).is_err());
    }
}

#[cfg(test)]
mod lock_entry_layout_tests {
    use super::*;

    /// The layout `LockEntry` had before its queue became [`Waiters`].
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct PlainQueueEntry {
        holder: Option<Holder>,
        waiters: VecDeque<Waiter>,
    }

    fn waiter(n: u32) -> Waiter {
        Waiter {
            client_id: format!("c{n}").into(),
            request_id: format!("r{n}").into(),
            ttl_ms: 1_000 + u64::from(n),
            wait_timeout_ms: n.is_multiple_of(2).then_some(50),
        }
    }

    #[test]
    fn a_lock_entry_encodes_as_it_did_with_a_plain_queue() {
        let holder = Holder {
            client_id: "h".into(),
            request_id: "a".into(),
            token: 7,
            ttl_ms: 500,
            lease_index: 3,
        };
        for n in [0u32, 1, 3] {
            let queue: VecDeque<Waiter> = (0..n).map(waiter).collect();
            let plain = PlainQueueEntry {
                holder: Some(holder.clone()),
                waiters: queue.clone(),
            };
            let entry = LockEntry {
                holder: Some(holder.clone()),
                waiters: queue.clone().into(),
            };
            let bytes = encode_plain(&entry);
            assert_eq!(bytes, encode_plain(&plain), "{n} waiters");
            let back: LockEntry = decode_plain(&encode_plain(&plain)).expect("decodes");
            assert_eq!(back, entry);
            assert_eq!(back.waiters.len(), n as usize);
            assert_eq!(back.waiters.is_empty(), n == 0);
            let read: PlainQueueEntry = decode_plain(&bytes).expect("decodes");
            assert_eq!(read, plain);
        }
    }

    #[test]
    fn an_emptied_queue_is_the_empty_queue() {
        let mut waiters = Waiters::default();
        waiters.push_back(waiter(1));
        waiters.push_back(waiter(2));
        waiters.push_back(waiter(3));
        assert_eq!(waiters.remove(1).map(|w| w.request_id), Some("r2".into()));
        assert_eq!(waiters.iter().count(), 2);
        assert_eq!(waiters.pop_front().map(|w| w.request_id), Some("r1".into()));
        assert_eq!(waiters.pop_front().map(|w| w.request_id), Some("r3".into()));
        assert!(waiters.is_empty());
        assert_eq!(waiters, Waiters::default());
        assert_eq!(waiters.pop_front(), None);
        assert_eq!(waiters.remove(4), None);
        assert_eq!(Waiters::from(VecDeque::new()), Waiters::default());
    }
}
