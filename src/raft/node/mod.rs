//! [`Raft`]: one server's consensus state machine.
//!
//! ```text
//!   driver ── tick / step / propose / read_index / propose_membership / transfer_leader ──► Raft
//!   driver ◄──────────────────────────── ready() ─────────────────────────────────────────── Raft
//!     persist hard state + entries (+ snapshot) ─► flush ─► send `messages` ─► apply ─► advance()
//!     (`messages_now`, the leader's own appends, may go out before the flush: §10.2.1)
//! ```
//!
//! The core is deterministic: the same inputs in the same order give the same outputs. It never
//! does I/O, reads a clock, or draws randomness other than from its seeded generator.
//!
//! This file holds the types, the [`Raft`] struct, its constructor and accessors; the methods
//! live by concern in the children:
//!
//! - `step`: incoming messages, their term checks and dispatch;
//! - `elections`: timers, CheckQuorum, PreVote and votes, leadership transfer;
//! - `replication`: proposals, appends, heartbeats and their answers;
//! - `commit`: advancing and announcing the commit index;
//! - `reads`: ReadIndex reads;
//! - `membership`: single-server membership changes;
//! - `snapshots`: compaction, sending and receiving snapshots;
//! - `ready`: the Ready / advance cycle and outgoing messages.

mod commit;
mod elections;
mod membership;
mod reads;
mod ready;
mod replication;
mod snapshots;
mod step;

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::config::{Config, ConfigError};
use super::log::RaftLog;
use super::message::Message;
use super::progress::{Progress, ProgressState};
use super::types::{
    Entry, EntryPayload, HardState, Index, Membership, MembershipError, NodeId, Snapshot,
    SnapshotMeta, Term,
};

/// Heartbeat answers that may pass before a snapshot chunk without an answer is sent again.
const SNAPSHOT_RETRY_HEARTBEATS: u32 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Follower,
    PreCandidate,
    Candidate,
    Leader,
}

/// Volatile state the driver may want to react to (metrics, redirects, failing pending requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SoftState {
    pub leader_id: NodeId,
    pub role: Role,
}

/// A ReadIndex read (§6.4) that is now safe: once the state machine has applied `index`, a read
/// tagged `ctx` may be answered from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadState {
    pub ctx: u64,
    pub index: Index,
}

/// One chunk of an incoming snapshot that this server accepted: the bytes at `offset` of the
/// snapshot `meta` names. Chunks of one transfer are handed out in order, the first at offset
/// 0; a chunk at offset 0 starts a new transfer (whatever came before it is dropped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotChunk {
    pub meta: SnapshotMeta,
    pub offset: u64,
    pub data: Bytes,
}

/// Everything the driver must do next, in this order:
/// 1. send `messages_now` (may overlap with step 2);
/// 2. stage `snapshot_chunks` (optional: they let a driver keep an arriving snapshot on disk as
///    it arrives, instead of all at once when `snapshot` is handed out), persist `snapshot` (if
///    any), then `hard_state`, then `entries` (truncating the stored log at
///    `entries[0].index` first); flush once if [`Ready::must_sync`];
/// 3. send `messages`;
/// 4. apply `snapshot`, then `committed_entries` in order; serve `read_states` once applied;
/// 5. call [`Raft::advance`] with this `Ready`.
///
/// Steps 3–5 may wait while the driver takes and writes later Readies (a flush that completes
/// in the background): Readies are then advanced in the order they were taken, each only once
/// its flush (and every earlier one) is done, and no Ready's `messages_now` leave while a
/// `hard_state` taken before them is not yet durable.
#[derive(Debug, Default)]
pub struct Ready {
    pub soft_state: Option<SoftState>,
    pub hard_state: Option<HardState>,
    /// Chunks of an incoming snapshot accepted since the last Ready, in order. The last chunk
    /// of a transfer comes in the same Ready as the whole `snapshot`.
    pub snapshot_chunks: Vec<SnapshotChunk>,
    pub snapshot: Option<Snapshot>,
    pub entries: Vec<Entry>,
    pub messages_now: Vec<Message>,
    pub messages: Vec<Message>,
    pub committed_entries: Vec<Entry>,
    pub read_states: Vec<ReadState>,
    /// Set when term or vote changed: those must be durable before `messages` leave. A change of
    /// the persisted commit index alone need not be flushed.
    term_or_vote_changed: bool,
    /// The last of `entries`: what [`Raft::advance`] marks durable. Kept per Ready, so that a
    /// driver may take the next Ready while this one's flush still runs, and advance each in
    /// order once its flush is done.
    handed_out: Option<(Index, Term)>,
}

impl Ready {
    /// Whether the driver must flush storage before sending `messages`.
    pub fn must_sync(&self) -> bool {
        self.term_or_vote_changed || !self.entries.is_empty() || self.snapshot.is_some()
    }
}

/// The state a restarted (or brand-new) server starts from.
#[derive(Clone, Debug, Default)]
pub struct InitialState {
    pub hard_state: HardState,
    /// The latest snapshot, if the log was ever compacted; the leader sends it to lagging
    /// followers. Its `data` may be empty: the bytes are not held, and are asked for
    /// ([`Raft::snapshot_wanted`]) when a follower needs them.
    pub snapshot: Option<Snapshot>,
    /// Durable entries after the snapshot index, in order.
    pub entries: Vec<Entry>,
    /// Index up to which the state machine has already applied (persisted with the state).
    pub applied: Index,
    /// For a brand-new server (no snapshot, empty log): the `--initial-cluster` or `--bootstrap`
    /// configuration, written as entry 1 (see [`EntryPayload::Config`]); empty for a server that
    /// joins a running cluster. Ignored once the server has any log or snapshot.
    pub initial_membership: Membership,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    #[error("not the leader (leader is {leader_id}, 0 = unknown)")]
    NotLeader { leader_id: NodeId },
    #[error("a leadership transfer is in progress")]
    TransferInProgress,
    #[error("too many uncommitted entries; retry later")]
    Busy,
    #[error("the leader has not yet committed an entry of its term")]
    LeaderNotReady,
    #[error("another membership change is still uncommitted")]
    MembershipChangePending,
    #[error("invalid membership change: {0}")]
    Membership(#[from] MembershipError),
    #[error("node {0} is not a voter")]
    NotVoter(NodeId),
}

/// Counters the driver exports as metrics and the simulator summarises.
#[derive(Clone, Copy, Debug, Default)]
pub struct CoreStats {
    pub elections_started: u64,
    pub pre_votes_started: u64,
    pub terms_won: u64,
    /// Times this server stopped leading because it had not heard from a quorum within an
    /// election timeout (CheckQuorum).
    pub quorum_lost: u64,
}

struct PendingRead {
    ctx: u64,
    index: Index,
    seq: u64,
}

struct IncomingSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

/// One server's Raft state machine. See the module documentation for the driving protocol.
pub struct Raft {
    cfg: Config,
    id: NodeId,
    term: Term,
    vote: NodeId,
    role: Role,
    leader_id: NodeId,
    log: RaftLog,

    /// The configuration in effect: the latest membership entry in the log (committed or not), else
    /// `membership_base`.
    membership: Membership,
    /// Index of the entry that set `membership` (0 when it comes from the base).
    membership_index: Index,
    /// The configuration at the snapshot point (or the initial one).
    membership_base: Membership,

    /// Leader only: one entry per other member.
    progress: BTreeMap<NodeId, Progress>,
    /// Candidate / pre-candidate only: votes received in this round.
    votes: BTreeMap<NodeId, bool>,

    election_elapsed: u32,
    heartbeat_elapsed: u32,
    randomized_election_ticks: u32,
    /// Leader only: heartbeat broadcasts so far. A follower's heartbeat answers unblock flow
    /// control to it at most once per round (see `handle_heartbeat_response`).
    heartbeat_round: u64,
    rng: ChaCha8Rng,

    /// Leader only: transferring leadership to this voter (§3.10); proposals are refused meanwhile.
    transfer_target: Option<NodeId>,

    read_seq: u64,
    pending_reads: VecDeque<PendingRead>,
    /// Reads that arrived before the leader committed an entry of its term (§6.4 step 1).
    reads_awaiting_commit: Vec<u64>,
    read_states: Vec<ReadState>,

    messages_now: Vec<Message>,
    messages: Vec<Message>,

    /// The latest local snapshot, sent to followers whose next entry was compacted away. Empty
    /// `data` (an encoded snapshot never is) means its bytes are not held: let go
    /// ([`Raft::release_snapshot_data`]), never built ([`Raft::compact_without_data`]) or not
    /// recovered; its meta still holds.
    snapshot: Option<Snapshot>,
    /// A follower needs the latest snapshot's bytes, which were let go.
    snapshot_wanted: bool,
    incoming_snapshot: Option<IncomingSnapshot>,
    /// Chunks accepted since the last Ready (see [`Ready::snapshot_chunks`]).
    accepted_chunks: Vec<SnapshotChunk>,
    /// A received snapshot not yet handed to the driver.
    snapshot_to_install: Option<Snapshot>,
    /// A received snapshot's state is not in place yet (handed to the driver, which may build
    /// it over several turns; see [`Raft::state_installed`]): nothing committed after it is
    /// handed out to apply, and this server does not campaign, since it could not serve as
    /// leader. It still answers votes and takes appends.
    state_pending: bool,
    /// Whether this server takes part in elections (see [`Raft::set_in_elections`]).
    in_elections: bool,

    prev_soft: SoftState,
    prev_hard: HardState,
    /// Counts of elections, PreVotes, terms won and CheckQuorum step-downs, for metrics.
    stats: CoreStats,
    /// Test-only home of vote replies sent before their flush (the `vote_before_persist` bug).
    #[cfg(test)]
    early_vote_replies: Vec<Message>,
}

impl Raft {
    pub fn new(cfg: Config, initial: InitialState) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let (snapshot_index, snapshot_term, membership_base) = match &initial.snapshot {
            Some(s) => (s.meta.index, s.meta.term, s.meta.membership.clone()),
            None => (0, 0, Membership::default()),
        };
        let hs = initial.hard_state;
        let mut log = RaftLog::restore(
            snapshot_index,
            snapshot_term,
            initial.entries,
            hs.commit,
            initial.applied,
        );
        if log.last_index() == 0 && snapshot_index == 0 && !initial.initial_membership.is_empty() {
            // Bootstrap: the identical entry 1 on every initial server, committed by construction.
            let payload = EntryPayload::Config(initial.initial_membership.clone());
            log.append(Entry {
                term: 0,
                index: 1,
                payload,
            });
            log.committed = 1;
        }
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ cfg.id.rotate_left(32));
        let mut raft = Raft {
            id: cfg.id,
            term: hs.term,
            vote: hs.vote,
            role: Role::Follower,
            leader_id: 0,
            log,
            membership: membership_base.clone(),
            membership_index: 0,
            membership_base,
            progress: BTreeMap::new(),
            votes: BTreeMap::new(),
            election_elapsed: 0,
            heartbeat_elapsed: 0,
            randomized_election_ticks: cfg.election_ticks,
            heartbeat_round: 0,
            rng,
            transfer_target: None,
            read_seq: 0,
            pending_reads: VecDeque::new(),
            reads_awaiting_commit: Vec::new(),
            read_states: Vec::new(),
            messages_now: Vec::new(),
            messages: Vec::new(),
            snapshot: initial.snapshot,
            snapshot_wanted: false,
            incoming_snapshot: None,
            accepted_chunks: Vec::new(),
            snapshot_to_install: None,
            state_pending: false,
            in_elections: true,
            prev_soft: SoftState {
                leader_id: 0,
                role: Role::Follower,
            },
            prev_hard: HardState { commit: 0, ..hs },
            stats: CoreStats::default(),
            #[cfg(test)]
            early_vote_replies: Vec::new(),
            cfg,
        };
        raft.prev_hard.commit = raft.log.committed;
        raft.recompute_membership();
        raft.reset_election_timeout();
        Ok(raft)
    }

    // ----- accessors -------------------------------------------------------------------------

    pub fn id(&self) -> NodeId {
        self.id
    }
    pub fn term(&self) -> Term {
        self.term
    }
    pub fn vote(&self) -> NodeId {
        self.vote
    }
    pub fn role(&self) -> Role {
        self.role
    }
    pub fn leader_id(&self) -> NodeId {
        self.leader_id
    }
    pub fn is_leader(&self) -> bool {
        self.role == Role::Leader
    }
    pub fn commit_index(&self) -> Index {
        self.log.committed
    }
    pub fn applied_index(&self) -> Index {
        self.log.applied
    }
    pub fn last_index(&self) -> Index {
        self.log.last_index()
    }
    pub fn last_term(&self) -> Term {
        self.log.last_term()
    }
    pub fn first_index(&self) -> Index {
        self.log.first_index()
    }
    pub fn snapshot_index(&self) -> Index {
        self.log.snapshot_index()
    }
    pub fn term_at(&self, index: Index) -> Option<Term> {
        self.log.term(index)
    }
    pub fn entry(&self, index: Index) -> Option<&Entry> {
        self.log.entry(index)
    }
    pub fn membership(&self) -> &Membership {
        &self.membership
    }
    pub fn stats(&self) -> CoreStats {
        self.stats
    }
    pub fn hard_state(&self) -> HardState {
        HardState {
            term: self.term,
            vote: self.vote,
            commit: self.log.committed,
        }
    }
    pub fn soft_state(&self) -> SoftState {
        SoftState {
            leader_id: self.leader_id,
            role: self.role,
        }
    }
    /// Appends in flight to `id` and their entry bytes (the leader's flow control).
    #[cfg(test)]
    pub(crate) fn inflight_to(&self, id: NodeId) -> (usize, usize) {
        self.progress
            .get(&id)
            .map_or((0, 0), |pr| (pr.inflight_len(), pr.inflight_bytes()))
    }

    /// Leader only: (match_index, next_index, state) for a follower.
    pub fn progress(&self, id: NodeId) -> Option<(Index, Index, ProgressState)> {
        self.progress
            .get(&id)
            .map(|p| (p.match_index, p.next_index, p.state))
    }
    /// Leader only: whether the follower was heard from in the current CheckQuorum window.
    pub fn is_recently_active(&self, id: NodeId) -> bool {
        self.progress.get(&id).is_some_and(|p| p.recent_active)
    }
    /// Whether this leader has committed an entry of its own term (§5.4.2, §6.4).
    pub fn committed_in_current_term(&self) -> bool {
        self.log.term(self.log.committed) == Some(self.term)
    }
    /// Number of proposals appended but not yet committed.
    pub fn uncommitted_entries(&self) -> u64 {
        self.log.last_index().saturating_sub(self.log.committed)
    }
    /// How many entries one proposal may carry now without being refused as [`ProposeError::Busy`]
    /// (the `max_uncommitted_entries` bound less what is uncommitted).
    pub fn proposal_room(&self) -> usize {
        (self.cfg.max_uncommitted_entries as u64).saturating_sub(self.uncommitted_entries())
            as usize
    }

    fn bug(&self, _which: impl Fn(&super::config::Bugs) -> bool) -> bool {
        #[cfg(test)]
        {
            _which(&self.cfg.bugs)
        }
        #[cfg(not(test))]
        {
            false
        }
    }
}

impl std::fmt::Debug for Raft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Raft")
            .field("id", &self.id)
            .field("term", &self.term)
            .field("role", &self.role)
            .field("leader_id", &self.leader_id)
            .field("last_index", &self.log.last_index())
            .field("commit", &self.log.committed)
            .field("voters", &self.membership.voters)
            .field("learners", &self.membership.learners)
            .field("membership_index", &self.membership_index)
            .field("in_elections", &self.in_elections)
            .field("state_pending", &self.state_pending)
            .field("election_elapsed", &self.election_elapsed)
            .finish()
    }
}
