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

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::config::{Config, ConfigError};
use super::log::RaftLog;
use super::message::{Message, MessageBody};
use super::progress::{Progress, ProgressState};
use super::types::{
    Entry, EntryPayload, HardState, Index, Membership, MembershipChange, MembershipError, NodeId,
    Snapshot, SnapshotMeta, Term,
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
    /// Set between `ready()` and `advance()` for the entries handed out.
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
    /// Leader only: (match_index, next_index, state) for a follower.
    /// Appends in flight to `id` and their entry bytes (the leader's flow control).
    #[cfg(test)]
    pub(crate) fn inflight_to(&self, id: NodeId) -> (usize, usize) {
        self.progress
            .get(&id)
            .map_or((0, 0), |pr| (pr.inflight_len(), pr.inflight_bytes()))
    }

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
    /// The snapshot the core sends to lagging followers (its `data` empty while released).
    pub fn latest_snapshot(&self) -> Option<&Snapshot> {
        self.snapshot.as_ref()
    }

    /// Whether a follower needs the latest snapshot's bytes, which were let go
    /// ([`Raft::release_snapshot_data`]): the driver builds a snapshot of its state and hands it
    /// over with [`Raft::provide_snapshot`].
    pub fn snapshot_wanted(&self) -> bool {
        self.snapshot_wanted
    }

    /// Lets go of the latest snapshot's bytes unless a follower is being sent them or is known
    /// to need them (its next entry was compacted away), keeping its meta (the log stays
    /// compacted to it). The driver's own state is the snapshot; the bytes are needed only to
    /// send, and a large state's bytes are a large share of a node's memory. Returns whether
    /// bytes were let go.
    pub fn release_snapshot_data(&mut self) -> bool {
        // Called on every tick: the bytes are looked at before the followers' progress.
        if self.snapshot.is_none() || self.snapshot_data_released() || self.peers_need_snapshot() {
            return false;
        }
        if let Some(snapshot) = &mut self.snapshot {
            snapshot.data = Bytes::new();
        }
        true
    }

    /// Leader only: whether a follower is being sent the latest snapshot or is known to need
    /// one (its next entry was compacted away). False on followers.
    pub fn peers_need_snapshot(&self) -> bool {
        let first = self.log.snapshot_index() + 1;
        self.role == Role::Leader
            && self.progress.iter().any(|(&id, p)| {
                id != self.id && (p.state == ProgressState::Snapshot || p.next_index < first)
            })
    }

    /// Compacts the log to `index` as [`Raft::compact`] does, without snapshot bytes: the
    /// driver's stored state is the snapshot, and its bytes are built only when a follower
    /// needs them ([`Raft::snapshot_wanted`], then [`Raft::provide_snapshot`]). Returns
    /// whether the log was compacted (as [`Raft::compact`]).
    pub fn compact_without_data(&mut self, index: Index) -> bool {
        self.compact(index, Bytes::new())
    }

    /// Whether the latest snapshot's bytes are not held (see the `snapshot` field).
    fn snapshot_data_released(&self) -> bool {
        self.snapshot.as_ref().is_some_and(|s| s.data.is_empty())
    }

    /// A snapshot the driver built of its applied state at `index` because
    /// [`Raft::snapshot_wanted`]: compacts the log to it when it is newer than the latest
    /// snapshot (as [`Raft::compact`]), or gives the latest snapshot its bytes back when it is at
    /// the same point. False (nothing changes) for an older point or one not applied.
    pub fn provide_snapshot(&mut self, index: Index, data: Bytes) -> bool {
        if index > self.log.snapshot_index() {
            return self.compact(index, data);
        }
        match &mut self.snapshot {
            Some(snapshot)
                if snapshot.meta.index == index && index == self.log.snapshot_index() =>
            {
                snapshot.data = data;
                self.snapshot_wanted = false;
                true
            }
            _ => false,
        }
    }

    #[cfg(test)]
    pub(crate) fn set_snapshot_chunk_bytes(&mut self, bytes: usize) {
        self.cfg.snapshot_chunk_bytes = bytes;
    }

    /// The capacity of the buffer an arriving snapshot is gathered in, if one is arriving.
    #[cfg(test)]
    pub(crate) fn incoming_snapshot_capacity(&self) -> Option<usize> {
        self.incoming_snapshot
            .as_ref()
            .map(|inc| inc.data.capacity())
    }

    /// May this server start an election? Voters may. So may a server whose own removal is
    /// appended but not committed: it can hold the only up-to-date copy of that entry (a leader
    /// that removed itself and then lost contact), and without it the remaining voters could never
    /// elect anyone. Its candidacy counts only the voters of its latest configuration.
    fn promotable(&self) -> bool {
        if self.state_pending || !self.in_elections {
            return false;
        }
        if self.membership.is_voter(self.id) {
            return true;
        }
        self.membership_index > self.log.committed
            && self
                .membership_at(self.membership_index - 1)
                .is_voter(self.id)
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

    // ----- driver inputs ---------------------------------------------------------------------

    /// Advances logical time by one tick.
    pub fn tick(&mut self) {
        if self.role == Role::Leader {
            self.tick_leader();
        } else {
            self.election_elapsed += 1;
            if self.promotable() && self.election_elapsed >= self.randomized_election_ticks {
                self.election_elapsed = 0;
                self.campaign(self.cfg.pre_vote, false);
            }
        }
    }

    fn tick_leader(&mut self) {
        self.heartbeat_elapsed += 1;
        self.election_elapsed += 1;
        if self.election_elapsed >= self.cfg.election_ticks {
            self.election_elapsed = 0;
            // CheckQuorum (§6.2): step down if a quorum has not been heard from for an election
            // timeout, so a partitioned leader stops claiming leadership.
            if self.cfg.check_quorum && !self.quorum_recently_active() {
                self.stats.quorum_lost += 1;
                self.become_follower(self.term, 0);
                return;
            }
            for pr in self.progress.values_mut() {
                pr.recent_active = false;
            }
            if self.transfer_target.is_some() {
                // Abort a transfer that did not finish within an election timeout (§3.10).
                self.transfer_target = None;
            }
        }
        if self.heartbeat_elapsed >= self.cfg.heartbeat_ticks {
            self.heartbeat_elapsed = 0;
            self.broadcast_heartbeat();
        }
        self.announce_commit();
    }

    /// Sends the commit index to each caught-up follower that has not been told it yet. A new
    /// commit index travels with the next append (under load there is one at once), so it is
    /// announced on its own only when none went out by the leader's next tick: one message
    /// (and its answer) per follower per commit saved, for followers that learn it at most a
    /// tick later when the cluster goes idle.
    fn announce_commit(&mut self) {
        let committed = self.log.committed;
        let last_index = self.log.last_index();
        let idle: Vec<NodeId> = self
            .progress
            .iter()
            .filter(|(_, p)| {
                p.state == ProgressState::Replicate
                    && p.next_index > last_index
                    && p.commit_sent < committed
            })
            .map(|(&id, _)| id)
            .collect();
        for peer in idle {
            self.send_append(peer, true);
        }
    }

    fn quorum_recently_active(&self) -> bool {
        let active = self
            .membership
            .voters
            .iter()
            .filter(|&&v| v == self.id || self.progress.get(&v).is_some_and(|p| p.recent_active))
            .count();
        active >= self.membership.quorum()
    }

    /// Takes this server out of elections (`false`: it neither campaigns nor grants a vote or a
    /// PreVote) or back in. A server that lost its data and came back under its id is out
    /// until its log holds the entry that admitted it as the new incarnation: before that, a
    /// configuration in its (partial) log or in a lagging peer's may still name it a voter,
    /// and a vote from a log it does not have yet could elect a leader without a committed
    /// entry. It still takes appends and snapshots, which is how it gets that entry.
    pub fn set_in_elections(&mut self, in_elections: bool) {
        self.in_elections = in_elections;
    }

    pub fn in_elections(&self) -> bool {
        self.in_elections
    }

    /// Starts an election now (used by tests and by a single-node bootstrap).
    pub fn campaign_now(&mut self) {
        if self.role != Role::Leader && self.promotable() {
            self.campaign(self.cfg.pre_vote, false);
        }
    }

    /// Proposes application commands. Returns the index of the last one.
    pub fn propose(&mut self, commands: Vec<Bytes>) -> Result<Index, ProposeError> {
        self.check_can_propose(commands.len())?;
        for data in commands {
            self.append_entry(EntryPayload::Command(data));
        }
        self.broadcast_append();
        Ok(self.log.last_index())
    }

    fn check_can_propose(&self, count: usize) -> Result<(), ProposeError> {
        if self.role != Role::Leader {
            return Err(ProposeError::NotLeader {
                leader_id: self.leader_id,
            });
        }
        if self.transfer_target.is_some() {
            return Err(ProposeError::TransferInProgress);
        }
        if self.uncommitted_entries() + count as u64 > self.cfg.max_uncommitted_entries as u64 {
            return Err(ProposeError::Busy);
        }
        Ok(())
    }

    /// Proposes one single-server membership change (dissertation §4.1). It takes effect on each
    /// server when appended. Refused until this leader has committed an entry of its own term (the
    /// fix for the single-server change bug) and while another change is uncommitted.
    pub fn propose_membership(&mut self, change: MembershipChange) -> Result<Index, ProposeError> {
        self.check_can_propose(1)?;
        let guards = !self.bug(|b| b.membership_guards_off);
        if guards && !self.committed_in_current_term() {
            return Err(ProposeError::LeaderNotReady);
        }
        if guards && self.membership_index > self.log.committed {
            return Err(ProposeError::MembershipChangePending);
        }
        let next = self.membership.apply(change)?;
        let index = self.append_entry(EntryPayload::Membership(change));
        debug_assert_eq!(self.membership, next);
        self.broadcast_append();
        Ok(index)
    }

    /// Starts a leadership transfer to `target` (§3.10): stop accepting proposals, bring the
    /// target up to date, then tell it to campaign at once.
    pub fn transfer_leader(&mut self, target: NodeId) -> Result<(), ProposeError> {
        if self.role != Role::Leader {
            return Err(ProposeError::NotLeader {
                leader_id: self.leader_id,
            });
        }
        if target == self.id {
            return Ok(());
        }
        if !self.membership.is_voter(target) {
            return Err(ProposeError::NotVoter(target));
        }
        self.transfer_target = Some(target);
        self.election_elapsed = 0;
        let up_to_date = self
            .progress
            .get(&target)
            .is_some_and(|p| p.match_index == self.log.last_index());
        if up_to_date {
            self.send(target, MessageBody::TimeoutNow);
        } else {
            self.send_append(target, true);
        }
        Ok(())
    }

    /// Requests a linearizable read (§6.4). A [`ReadState`] with this `ctx` appears in a later
    /// `Ready` once a quorum has confirmed this server is still leader.
    pub fn read_index(&mut self, ctx: u64) -> Result<(), ProposeError> {
        if self.role != Role::Leader {
            return Err(ProposeError::NotLeader {
                leader_id: self.leader_id,
            });
        }
        if self.pending_reads.len() + self.reads_awaiting_commit.len() >= self.cfg.max_pending_reads
        {
            return Err(ProposeError::Busy);
        }
        if !self.committed_in_current_term() {
            self.reads_awaiting_commit.push(ctx);
            return Ok(());
        }
        self.register_read(ctx);
        Ok(())
    }

    fn register_read(&mut self, ctx: u64) {
        let index = self.log.committed;
        let alone = self.membership.voters.len() == 1 && self.membership.is_voter(self.id);
        if alone || self.bug(|b| b.read_index_without_heartbeat) {
            self.read_states.push(ReadState { ctx, index });
            return;
        }
        self.read_seq += 1;
        self.pending_reads.push_back(PendingRead {
            ctx,
            index,
            seq: self.read_seq,
        });
        self.broadcast_heartbeat();
    }

    /// Records a snapshot the driver took of the state machine at `index` (<= applied) and drops
    /// the in-memory log up to it. The driver compacts its storage the same way.
    pub fn compact(&mut self, index: Index, data: Bytes) -> bool {
        if index <= self.log.snapshot_index() || index > self.log.applied {
            return false;
        }
        let Some(term) = self.log.term(index) else {
            return false;
        };
        let meta = SnapshotMeta {
            index,
            term,
            membership: self.membership_at(index),
        };
        // Entries up to `index` are about to go: the configuration they built becomes the base.
        self.membership_base = meta.membership.clone();
        self.snapshot = Some(Snapshot { meta, data });
        self.snapshot_wanted = false;
        self.log.compact(index);
        true
    }

    // ----- ready / advance -------------------------------------------------------------------

    pub fn has_ready(&self) -> bool {
        self.soft_state() != self.prev_soft
            || self.term_or_vote_changed()
            || self.log.has_unstable()
            || self.snapshot_to_install.is_some()
            || !self.accepted_chunks.is_empty()
            || !self.messages_now.is_empty()
            || !self.messages.is_empty()
            || (!self.state_pending && self.log.has_next_committed())
            || !self.read_states.is_empty()
    }

    fn term_or_vote_changed(&self) -> bool {
        self.term != self.prev_hard.term || self.vote != self.prev_hard.vote
    }

    pub fn ready(&mut self) -> Ready {
        let soft = self.soft_state();
        let hard = self.hard_state();
        let entries = self.log.take_unstable();
        let handed_out = entries.last().map(|e| (e.index, e.term));
        let term_or_vote_changed = self.term_or_vote_changed();
        let mut messages_now = std::mem::take(&mut self.messages_now);
        let mut messages = std::mem::take(&mut self.messages);
        if term_or_vote_changed {
            // No message may carry a term that is not yet durable: a leader elected in this very
            // step sends its first appends only after the flush.
            messages_now.append(&mut messages);
            messages = messages_now;
            messages_now = Vec::new();
        }
        #[cfg(test)]
        messages_now.append(&mut self.early_vote_replies);
        let ready = Ready {
            soft_state: (soft != self.prev_soft).then_some(soft),
            // Written when the term or vote changes (they must be durable before any message
            // that depends on them), not for every commit: a stored commit index only spares a
            // restarted server re-learning it, and the applied index stored with the lock state
            // (every entry applied was committed) gives a restart the same start. One sled write
            // fewer per commit on every node.
            hard_state: term_or_vote_changed.then_some(hard),
            term_or_vote_changed,
            handed_out,
            snapshot_chunks: std::mem::take(&mut self.accepted_chunks),
            snapshot: self.snapshot_to_install.take(),
            entries,
            messages_now,
            messages,
            committed_entries: if self.state_pending {
                Vec::new()
            } else {
                self.log.take_committed(self.cfg.max_apply_bytes)
            },
            read_states: std::mem::take(&mut self.read_states),
        };
        self.prev_soft = soft;
        self.prev_hard = hard;
        ready
    }

    /// The driver has put in place the state of the last snapshot a Ready handed it: entries
    /// committed after it are handed out again, and this server may campaign.
    pub fn state_installed(&mut self) {
        // A newer snapshot received meanwhile is not handed out yet: its state is pending.
        if self.snapshot_to_install.is_none() {
            self.state_pending = false;
        }
    }

    /// The driver has carried out `ready`: persisted, sent and applied it.
    pub fn advance(&mut self, ready: Ready) {
        if let Some((index, term)) = ready.handed_out {
            self.log.stable_to(index, term);
        }
        if let Some(snapshot) = ready.snapshot {
            self.snapshot = Some(snapshot);
            self.snapshot_wanted = false;
        }
        if self.role == Role::Leader {
            // The leader counts itself toward a commit only once its own entries are durable.
            self.maybe_commit();
        }
    }

    // ----- message handling ------------------------------------------------------------------

    /// Handles a message from a peer. Messages that are stale, duplicated, reordered or
    /// addressed to someone else are ignored or answered harmlessly; none can make the core
    /// panic.
    pub fn step(&mut self, msg: Message) {
        if msg.to != self.id || msg.from == self.id || msg.from == 0 {
            return;
        }
        if msg.term > self.term {
            let in_lease = self.cfg.check_quorum
                && self.leader_id != 0
                && self.election_elapsed < self.cfg.election_ticks;
            // §4.2.3: a server that heard from a leader within the minimum election timeout
            // ignores vote requests, so removed or partitioned servers cannot disrupt a healthy
            // cluster. A transfer-initiated campaign (§3.10) is exempt.
            if let MessageBody::Vote {
                leadership_transfer: false,
                ..
            } = &msg.body
            {
                if in_lease {
                    return;
                }
            }
            match &msg.body {
                // A PreVote neither changes our term nor the candidate's.
                MessageBody::Vote { pre_vote: true, .. } => {}
                MessageBody::VoteResponse {
                    pre_vote: true,
                    granted: true,
                } => {}
                _ => {
                    let leader = if msg.is_from_leader() { msg.from } else { 0 };
                    self.become_follower(msg.term, leader);
                }
            }
        } else if msg.term < self.term {
            match msg.body {
                MessageBody::Append { .. } | MessageBody::Heartbeat { .. } => {
                    // A deposed leader: tell it our term so it steps down.
                    self.send(
                        msg.from,
                        MessageBody::AppendResponse {
                            success: false,
                            match_index: 0,
                            rejected_index: 0,
                            recovery_index: 0,
                            recovery_term: 0,
                        },
                    );
                }
                MessageBody::Vote { pre_vote, .. } => {
                    self.send(
                        msg.from,
                        MessageBody::VoteResponse {
                            pre_vote,
                            granted: false,
                        },
                    );
                }
                _ => {}
            }
            return;
        }

        match msg.body {
            MessageBody::Vote {
                pre_vote,
                last_log_index,
                last_log_term,
                ..
            } => self.handle_vote_request(
                msg.from,
                msg.term,
                pre_vote,
                last_log_index,
                last_log_term,
            ),
            MessageBody::VoteResponse { pre_vote, granted } => {
                self.handle_vote_response(msg.from, msg.term, pre_vote, granted)
            }
            MessageBody::Append {
                prev_log_index,
                prev_log_term,
                entries,
                leader_commit,
            } => {
                self.follow(msg.from);
                self.handle_append(
                    msg.from,
                    prev_log_index,
                    prev_log_term,
                    entries,
                    leader_commit,
                );
            }
            MessageBody::Heartbeat { commit, read_seq } => {
                self.follow(msg.from);
                if commit > self.log.committed {
                    self.log.committed = commit.min(self.log.last_index());
                }
                self.send(msg.from, MessageBody::HeartbeatResponse { read_seq });
            }
            MessageBody::InstallSnapshot {
                meta,
                offset,
                data,
                done,
                total_len,
            } => {
                self.follow(msg.from);
                self.handle_snapshot_chunk(msg.from, meta, offset, data, done, total_len);
            }
            MessageBody::TimeoutNow => {
                if self.promotable() && self.role != Role::Leader {
                    self.campaign(false, true);
                }
            }
            MessageBody::AppendResponse {
                success,
                match_index,
                rejected_index,
                recovery_index,
                recovery_term,
            } => {
                if self.role == Role::Leader {
                    self.handle_append_response(
                        msg.from,
                        success,
                        match_index,
                        rejected_index,
                        recovery_index,
                        recovery_term,
                    );
                }
            }
            MessageBody::HeartbeatResponse { read_seq } => {
                if self.role == Role::Leader {
                    self.handle_heartbeat_response(msg.from, read_seq);
                }
            }
            MessageBody::InstallSnapshotResponse {
                snapshot_index,
                next_offset,
                done,
            } => {
                if self.role == Role::Leader {
                    self.handle_snapshot_response(msg.from, snapshot_index, next_offset, done);
                }
            }
        }
    }

    /// A message from the leader of our current term.
    fn follow(&mut self, leader: NodeId) {
        if self.role != Role::Follower || self.leader_id != leader {
            self.become_follower(self.term, leader);
        }
        self.election_elapsed = 0;
    }

    // ----- elections (§5.2, §9.6) ------------------------------------------------------------

    fn campaign(&mut self, pre_vote: bool, leadership_transfer: bool) {
        let campaign_term;
        if pre_vote {
            self.role = Role::PreCandidate;
            self.leader_id = 0;
            campaign_term = self.term + 1;
            self.stats.pre_votes_started += 1;
        } else {
            self.term += 1;
            self.vote = self.id;
            self.role = Role::Candidate;
            self.leader_id = 0;
            campaign_term = self.term;
            self.stats.elections_started += 1;
        }
        self.progress.clear();
        self.reset_election_timeout();
        self.votes.clear();
        self.votes.insert(self.id, true);
        if self.tally_won() {
            if pre_vote {
                self.campaign(false, leadership_transfer);
            } else {
                self.become_leader();
            }
            return;
        }
        let (last_log_index, last_log_term) = (self.log.last_index(), self.log.last_term());
        let voters: Vec<NodeId> = self
            .membership
            .voters
            .iter()
            .copied()
            .filter(|&v| v != self.id)
            .collect();
        for voter in voters {
            self.messages.push(Message {
                from: self.id,
                to: voter,
                term: campaign_term,
                body: MessageBody::Vote {
                    pre_vote,
                    last_log_index,
                    last_log_term,
                    leadership_transfer,
                },
            });
        }
    }

    fn tally_won(&self) -> bool {
        let granted = self
            .votes
            .iter()
            .filter(|(id, granted)| **granted && self.membership.is_voter(**id))
            .count();
        granted >= self.membership.quorum()
    }

    fn tally_lost(&self) -> bool {
        let rejected = self
            .votes
            .iter()
            .filter(|(id, granted)| !**granted && self.membership.is_voter(**id))
            .count();
        rejected >= self.membership.quorum()
    }

    fn handle_vote_request(
        &mut self,
        from: NodeId,
        term: Term,
        pre_vote: bool,
        last_log_index: Index,
        last_log_term: Term,
    ) {
        // One vote per term (§5.2); a PreVote for a later term binds nothing.
        let can_vote = self.vote == from
            || (self.vote == 0 && self.leader_id == 0)
            || (pre_vote && term > self.term);
        let log_ok = self.bug(|b| b.vote_without_log_check)
            || self.log.is_up_to_date(last_log_index, last_log_term);
        let granted = can_vote && log_ok && self.in_elections;
        if granted && !pre_vote {
            self.vote = from;
            self.election_elapsed = 0;
        }
        let body = MessageBody::VoteResponse { pre_vote, granted };
        let reply_term = if pre_vote && granted { term } else { self.term };
        let msg = Message {
            from: self.id,
            to: from,
            term: reply_term,
            body,
        };
        #[cfg(test)]
        if self.cfg.bugs.vote_before_persist {
            self.early_vote_replies.push(msg);
            return;
        }
        self.messages.push(msg);
    }

    fn handle_vote_response(&mut self, from: NodeId, term: Term, pre_vote: bool, granted: bool) {
        let expected = match (pre_vote, self.role) {
            (true, Role::PreCandidate) => !granted || term == self.term + 1,
            (false, Role::Candidate) => term == self.term,
            _ => false,
        };
        if !expected {
            return;
        }
        self.votes.entry(from).or_insert(granted);
        if self.tally_won() {
            if pre_vote && self.bug(|b| b.prevote_counts_as_vote) {
                self.term += 1;
                self.vote = self.id;
                self.stats.elections_started += 1;
                self.become_leader();
            } else if pre_vote {
                self.campaign(false, false);
            } else {
                self.become_leader();
            }
        } else if self.tally_lost() {
            self.become_follower(self.term, 0);
        }
    }

    fn become_follower(&mut self, term: Term, leader_id: NodeId) {
        if term > self.term {
            self.term = term;
            self.vote = 0;
        }
        self.role = Role::Follower;
        self.leader_id = leader_id;
        self.election_elapsed = 0;
        self.heartbeat_elapsed = 0;
        self.progress.clear();
        self.votes.clear();
        self.transfer_target = None;
        self.pending_reads.clear();
        self.reads_awaiting_commit.clear();
        self.reset_election_timeout();
    }

    fn become_leader(&mut self) {
        self.role = Role::Leader;
        self.leader_id = self.id;
        self.election_elapsed = 0;
        self.heartbeat_elapsed = 0;
        self.transfer_target = None;
        self.stats.terms_won += 1;
        let next = self.log.last_index() + 1;
        self.progress = self
            .membership
            .members()
            .filter(|&m| m != self.id)
            .map(|m| (m, Progress::new(next)))
            .collect();
        // §5.4.2 / §8: a new leader commits a no-op so entries of earlier terms become committed
        // and ReadIndex becomes possible.
        self.append_entry(EntryPayload::Noop);
        self.broadcast_append();
    }

    fn reset_election_timeout(&mut self) {
        let min = self.cfg.election_ticks;
        self.randomized_election_ticks = self.rng.random_range(min..2 * min);
    }

    // ----- replication (§5.3) ----------------------------------------------------------------

    fn append_entry(&mut self, payload: EntryPayload) -> Index {
        let index = self.log.last_index() + 1;
        let entry = Entry {
            term: self.term,
            index,
            payload,
        };
        self.append_to_log(entry);
        index
    }

    fn broadcast_append(&mut self) {
        let peers: Vec<NodeId> = self.progress.keys().copied().collect();
        for peer in peers {
            self.send_append(peer, false);
        }
    }

    fn broadcast_heartbeat(&mut self) {
        self.heartbeat_round += 1;
        let peers: Vec<(NodeId, Index)> = self
            .progress
            .iter()
            .map(|(&id, p)| (id, p.match_index))
            .collect();
        for (peer, match_index) in peers {
            let commit = self.log.committed.min(match_index);
            if let Some(pr) = self.progress.get_mut(&peer) {
                pr.commit_sent = pr.commit_sent.max(commit);
            }
            self.send(
                peer,
                MessageBody::Heartbeat {
                    commit,
                    read_seq: self.read_seq,
                },
            );
        }
    }

    /// Sends as many appends to `to` as flow control allows. With `allow_empty`, sends one even if
    /// there are no new entries (to probe, or to carry the commit index).
    fn send_append(&mut self, to: NodeId, allow_empty: bool) {
        let mut allow_empty = allow_empty;
        // Bounded: each round either sends a batch (advancing next_index) or returns.
        for _ in 0..self.cfg.max_inflight_appends.max(1) {
            let Some(pr) = self.progress.get(&to) else {
                return;
            };
            match pr.state {
                ProgressState::Snapshot => return,
                ProgressState::Probe if pr.probe_sent => return,
                ProgressState::Replicate
                    if pr.inflight_full(
                        self.cfg.max_inflight_appends,
                        self.cfg.max_inflight_bytes,
                    ) =>
                {
                    return
                }
                _ => {}
            }
            let prev_log_index = pr.next_index - 1;
            let Some(prev_log_term) = self.log.term(prev_log_index) else {
                self.start_snapshot(to);
                return;
            };
            let entries = self
                .log
                .entries_from(pr.next_index, self.cfg.max_batch_bytes);
            if entries.is_empty() && !allow_empty {
                return;
            }
            allow_empty = false;
            let last = entries.last().map(|e| e.index);
            let bytes = entries.iter().map(|e| e.size_bytes()).sum::<usize>();
            let leader_commit = self.log.committed;
            let pr = self.progress.get_mut(&to).expect("checked above");
            match pr.state {
                ProgressState::Replicate => {
                    if let Some(last) = last {
                        pr.next_index = last + 1;
                        pr.sent(last, bytes);
                    }
                }
                _ => pr.probe_sent = true,
            }
            let probing = pr.state == ProgressState::Probe;
            pr.commit_sent = pr.commit_sent.max(leader_commit);
            self.send(
                to,
                MessageBody::Append {
                    prev_log_index,
                    prev_log_term,
                    entries,
                    leader_commit,
                },
            );
            if probing || last.is_none() {
                return;
            }
        }
    }

    fn handle_append(
        &mut self,
        from: NodeId,
        prev_log_index: Index,
        prev_log_term: Term,
        entries: Vec<Entry>,
        leader_commit: Index,
    ) {
        let reject = |recovery_index, recovery_term| MessageBody::AppendResponse {
            success: false,
            match_index: 0,
            rejected_index: prev_log_index,
            recovery_index,
            recovery_term,
        };
        if prev_log_index < self.log.committed {
            // Everything up to our commit index already matches the leader.
            let committed = self.log.committed;
            self.send(
                from,
                MessageBody::AppendResponse {
                    success: true,
                    match_index: committed,
                    rejected_index: 0,
                    recovery_index: 0,
                    recovery_term: 0,
                },
            );
            return;
        }
        if prev_log_index > self.log.last_index() {
            // Seed design case (i): our log is shorter; tell the leader its length.
            let last = self.log.last_index();
            self.send(from, reject(last, 0));
            return;
        }
        let skip_check = self.bug(|b| b.append_without_prev_check);
        let our_term = self.log.term(prev_log_index).unwrap_or(0);
        if our_term != prev_log_term && !skip_check {
            // Seed design case (ii): the conflicting term and the last index before it.
            let mut first_of_term = prev_log_index;
            while first_of_term > self.log.committed + 1
                && self.log.term(first_of_term - 1) == Some(our_term)
            {
                first_of_term -= 1;
            }
            self.send(from, reject(first_of_term - 1, our_term));
            return;
        }
        // Append, truncating from the first conflicting entry (§5.3 step 3).
        let mut last_new = prev_log_index;
        for entry in entries {
            if entry.index != last_new + 1 {
                break; // malformed: entries must be contiguous after prev_log_index
            }
            last_new = entry.index;
            match self.log.term(entry.index) {
                Some(t) if t == entry.term && !skip_check => continue,
                Some(_) => {
                    if entry.index <= self.log.committed {
                        // Only a broken or malicious leader asks us to overwrite committed
                        // entries; refuse instead of destroying them.
                        return;
                    }
                    self.log.truncate_from(entry.index);
                    self.recompute_membership();
                }
                None => {}
            }
            self.append_to_log(entry);
        }
        if skip_check && last_new < self.log.last_index() {
            self.log.truncate_from(last_new + 1);
            self.recompute_membership();
        }
        let commit = leader_commit.min(last_new);
        if commit > self.log.committed {
            self.log.committed = commit;
        }
        self.send(
            from,
            MessageBody::AppendResponse {
                success: true,
                match_index: last_new,
                rejected_index: 0,
                recovery_index: 0,
                recovery_term: 0,
            },
        );
    }

    fn handle_append_response(
        &mut self,
        from: NodeId,
        success: bool,
        match_index: Index,
        rejected_index: Index,
        recovery_index: Index,
        recovery_term: Term,
    ) {
        let last_index = self.log.last_index();
        let Some(pr) = self.progress.get_mut(&from) else {
            return;
        };
        pr.recent_active = true;
        if success {
            let match_index = match_index.min(last_index);
            let advanced = pr.update_match(match_index);
            if pr.state == ProgressState::Probe {
                pr.become_replicate();
            }
            if advanced {
                self.maybe_commit();
            }
            if self.transfer_target == Some(from)
                && self
                    .progress
                    .get(&from)
                    .is_some_and(|p| p.match_index == last_index)
            {
                self.send(from, MessageBody::TimeoutNow);
            }
            self.send_append(from, false);
            return;
        }
        // Rejection. Ignore stale ones: for an append at or below what is known to match, or, in
        // Probe, for anything but the probe we are waiting on.
        if rejected_index <= pr.match_index
            || (pr.state == ProgressState::Probe && rejected_index + 1 != pr.next_index)
            || pr.state == ProgressState::Snapshot
        {
            return;
        }
        // Fast backtracking with the seed design's recovery hint.
        let next = if recovery_term == 0 {
            recovery_index + 1
        } else {
            let mut search = rejected_index.min(last_index);
            let mut found = None;
            while search > self.log.snapshot_index() {
                match self.log.term(search) {
                    Some(t) if t == recovery_term => {
                        found = Some(search);
                        break;
                    }
                    Some(t) if t < recovery_term => break,
                    _ => search -= 1,
                }
            }
            match found {
                Some(index) => index + 1,
                None => recovery_index + 1,
            }
        };
        let pr = self.progress.get_mut(&from).expect("checked above");
        pr.become_probe(next.min(rejected_index));
        self.send_append(from, true);
    }

    fn handle_heartbeat_response(&mut self, from: NodeId, read_seq: u64) {
        let last_index = self.log.last_index();
        let (max_inflight, max_bytes) =
            (self.cfg.max_inflight_appends, self.cfg.max_inflight_bytes);
        let round = self.heartbeat_round;
        let Some(pr) = self.progress.get_mut(&from) else {
            return;
        };
        pr.recent_active = true;
        pr.read_ack = pr.read_ack.max(read_seq);
        // An answer to a heartbeat stands for "anything sent before may be lost": it lets a
        // probe go again, frees a slot of a full pipeline and counts towards resending a
        // snapshot chunk. Only once per heartbeat round: a follower that was stalled (a long
        // snapshot install, a paused process) answers every heartbeat queued meanwhile at
        // once, and each answer used to send another full append (hundreds of 512 KiB appends
        // built in one turn of the leader's loop).
        let fresh = pr.unblocked_round < round;
        if fresh {
            pr.unblocked_round = round;
            pr.probe_sent = false;
        }
        let state = pr.state;
        if fresh && state == ProgressState::Replicate && pr.inflight_full(max_inflight, max_bytes) {
            pr.free_oldest();
        }
        let behind = pr.match_index < last_index;
        match state {
            ProgressState::Snapshot if !fresh => {}
            ProgressState::Snapshot => {
                // The chunk in flight is answered by its own response; only when that has not
                // come for a few heartbeat rounds is it taken as lost and sent again.
                let pr = self.progress.get_mut(&from).expect("checked above");
                pr.snapshot_waits += 1;
                if pr.snapshot_waits >= SNAPSHOT_RETRY_HEARTBEATS {
                    self.send_snapshot_chunk(from);
                }
            }
            _ if behind => self.send_append(from, true),
            _ => {}
        }
        self.advance_reads();
    }

    fn advance_reads(&mut self) {
        while let Some(front) = self.pending_reads.front() {
            let acks = self
                .membership
                .voters
                .iter()
                .filter(|&&v| {
                    v == self.id
                        || self
                            .progress
                            .get(&v)
                            .is_some_and(|p| p.read_ack >= front.seq)
                })
                .count();
            if acks < self.membership.quorum() {
                break;
            }
            let read = self.pending_reads.pop_front().expect("front exists");
            self.read_states.push(ReadState {
                ctx: read.ctx,
                index: read.index,
            });
        }
    }

    /// Advances the commit index to the highest index stored on a quorum of voters, but only if
    /// that entry is from the current term (§5.4.2).
    fn maybe_commit(&mut self) {
        let self_match = self.log.stable_index();
        let match_of = |v: &NodeId| {
            if *v == self.id {
                self_match
            } else {
                self.progress.get(v).map_or(0, |p| p.match_index)
            }
        };
        // Runs on every append answer: the usual cluster sizes sort on the stack.
        let mut on_stack = [0; 9];
        let mut on_heap = Vec::new();
        let voters = self.membership.voters.len();
        let matches: &mut [Index] = if voters <= on_stack.len() {
            for (slot, v) in on_stack.iter_mut().zip(&self.membership.voters) {
                *slot = match_of(v);
            }
            &mut on_stack[..voters]
        } else {
            on_heap.extend(self.membership.voters.iter().map(match_of));
            &mut on_heap
        };
        if matches.is_empty() {
            return;
        }
        matches.sort_unstable_by(|a, b| b.cmp(a));
        let quorum_index = matches[self.membership.quorum() - 1];
        if quorum_index <= self.log.committed {
            return;
        }
        let term_ok =
            self.log.term(quorum_index) == Some(self.term) || self.bug(|b| b.commit_earlier_term);
        if !term_ok {
            return;
        }
        let was_committed_in_term = self.committed_in_current_term();
        self.log.committed = quorum_index;
        if !was_committed_in_term && self.committed_in_current_term() {
            for ctx in std::mem::take(&mut self.reads_awaiting_commit) {
                self.register_read(ctx);
            }
        }
        // A leader removed from the configuration steps down once the removal commits (§4.2.2).
        // Followers learn the new commit index with the next append, or at the latest on the
        // next tick (`announce_commit`).
        if self.membership_index <= self.log.committed && !self.membership.is_voter(self.id) {
            self.become_follower(self.term, 0);
        }
    }

    // ----- snapshots (§5.7) ------------------------------------------------------------------

    fn start_snapshot(&mut self, to: NodeId) {
        let Some(snapshot_index) = self.snapshot.as_ref().map(|s| s.meta.index) else {
            return;
        };
        if self.snapshot_data_released() {
            // Asked again on every attempt to reach `to` until the driver provides the bytes.
            self.snapshot_wanted = true;
            return;
        }
        if let Some(pr) = self.progress.get_mut(&to) {
            pr.become_snapshot(snapshot_index);
        }
        self.send_snapshot_chunk(to);
    }

    fn send_snapshot_chunk(&mut self, to: NodeId) {
        if self.snapshot_data_released() {
            self.snapshot_wanted = true;
            return;
        }
        let Some(snapshot) = &self.snapshot else {
            return;
        };
        let Some(pr) = self.progress.get_mut(&to) else {
            return;
        };
        if pr.snapshot_index != snapshot.meta.index {
            // A newer snapshot replaced the one being sent: start over with it.
            pr.become_snapshot(snapshot.meta.index);
        }
        pr.snapshot_waits = 0;
        let len = snapshot.data.len() as u64;
        let offset = pr.snapshot_offset.min(len);
        let end = (offset + self.cfg.snapshot_chunk_bytes as u64).min(len);
        let body = MessageBody::InstallSnapshot {
            meta: snapshot.meta.clone(),
            offset,
            data: snapshot.data.slice(offset as usize..end as usize),
            done: end == len,
            total_len: len,
        };
        self.send(to, body);
    }

    fn handle_snapshot_chunk(
        &mut self,
        from: NodeId,
        meta: SnapshotMeta,
        offset: u64,
        data: Bytes,
        done: bool,
        total_len: u64,
    ) {
        let snapshot_index = meta.index;
        if meta.index <= self.log.committed {
            // We already have everything it covers.
            self.incoming_snapshot = None;
            let body = MessageBody::InstallSnapshotResponse {
                snapshot_index,
                next_offset: 0,
                done: true,
            };
            self.send(from, body);
            return;
        }
        // A copy of the first chunk (sent again while its answer was on the way) must not throw
        // away what has arrived since.
        let resumed = self
            .incoming_snapshot
            .as_ref()
            .is_some_and(|inc| inc.meta == meta && !inc.data.is_empty());
        if offset == 0 && !resumed {
            // Sized once from the sender's total, so a large snapshot is not copied each time
            // its buffer doubles. A total past the limit is not believed (the limit below turns
            // the transfer away when the bytes get there), and memory the system will not
            // reserve leaves the buffer to grow as the chunks come.
            let mut data = Vec::new();
            if total_len <= self.cfg.max_snapshot_bytes {
                let _ = data.try_reserve_exact(usize::try_from(total_len).unwrap_or(0));
            }
            self.incoming_snapshot = Some(IncomingSnapshot {
                meta: meta.clone(),
                data,
            });
        }
        let expected = match &self.incoming_snapshot {
            Some(inc) if inc.meta == meta => inc.data.len() as u64,
            _ => 0,
        };
        if offset != expected {
            let body = MessageBody::InstallSnapshotResponse {
                snapshot_index,
                next_offset: expected,
                done: false,
            };
            self.send(from, body);
            return;
        }
        let Some(incoming) = self.incoming_snapshot.as_mut() else {
            return;
        };
        if incoming.data.len() as u64 + data.len() as u64 > self.cfg.max_snapshot_bytes {
            self.incoming_snapshot = None;
            return;
        }
        incoming.data.extend_from_slice(&data);
        self.accepted_chunks.push(SnapshotChunk {
            meta: meta.clone(),
            offset,
            data,
        });
        let next_offset = incoming.data.len() as u64;
        if !done {
            let body = MessageBody::InstallSnapshotResponse {
                snapshot_index,
                next_offset,
                done,
            };
            self.send(from, body);
            return;
        }
        let incoming = self.incoming_snapshot.take().expect("present");
        let snapshot = Snapshot {
            meta: incoming.meta,
            data: Bytes::from(incoming.data),
        };
        self.log
            .install_snapshot(snapshot.meta.index, snapshot.meta.term);
        self.membership_base = snapshot.meta.membership.clone();
        self.recompute_membership();
        self.snapshot_to_install = Some(snapshot);
        self.state_pending = true;
        let body = MessageBody::InstallSnapshotResponse {
            snapshot_index,
            next_offset,
            done: true,
        };
        self.send(from, body);
    }

    fn handle_snapshot_response(
        &mut self,
        from: NodeId,
        snapshot_index: Index,
        next_offset: u64,
        done: bool,
    ) {
        let Some(pr) = self.progress.get_mut(&from) else {
            return;
        };
        pr.recent_active = true;
        if pr.state != ProgressState::Snapshot || pr.snapshot_index != snapshot_index {
            return; // stale or duplicated
        }
        if done {
            pr.update_match(snapshot_index);
            pr.become_probe(snapshot_index + 1);
            self.maybe_commit();
            self.send_append(from, true);
        } else if next_offset != pr.snapshot_offset {
            // Forward: the chunk in flight arrived, send the next. Backward: the follower lost
            // what it had (it restarted), go back to where it is.
            pr.snapshot_offset = next_offset;
            self.send_snapshot_chunk(from);
        }
        // Equal: the answer to a copy; the chunk at this offset is in flight already, and the
        // heartbeat rounds send it again if it was lost. Sending it here too would start a
        // second stream of chunks beside the first, and every copy would add another.
    }

    // ----- membership (dissertation §4) ------------------------------------------------------

    /// Appends one entry; a membership entry takes effect at once (dissertation §4.1).
    fn append_to_log(&mut self, entry: Entry) {
        let index = entry.index;
        let next = next_membership(&self.membership, &entry.payload);
        self.log.append(entry);
        if let Some(next) = next {
            self.membership = next;
            self.membership_index = index;
            self.sync_progress_with_membership();
        }
    }

    fn recompute_membership(&mut self) {
        let mut membership = self.membership_base.clone();
        let mut membership_index = 0;
        let (first, last) = (self.log.first_index(), self.log.last_index());
        for entry in self.log.slice(first, last) {
            if let Some(next) = next_membership(&membership, &entry.payload) {
                membership = next;
                membership_index = entry.index;
            }
        }
        self.membership = membership;
        self.membership_index = membership_index;
        self.sync_progress_with_membership();
    }

    /// The configuration in effect at `index` (the last membership entry at or before it).
    fn membership_at(&self, index: Index) -> Membership {
        let mut membership = self.membership_base.clone();
        for entry in self.log.slice(self.log.first_index(), index) {
            if let Some(next) = next_membership(&membership, &entry.payload) {
                membership = next;
            }
        }
        membership
    }

    fn sync_progress_with_membership(&mut self) {
        if self.role != Role::Leader {
            return;
        }
        let next = self.log.last_index() + 1;
        let members: Vec<NodeId> = self
            .membership
            .members()
            .filter(|&m| m != self.id)
            .collect();
        self.progress.retain(|id, _| members.contains(id));
        for member in members {
            self.progress.entry(member).or_insert_with(|| {
                let mut pr = Progress::new(next);
                pr.recent_active = true;
                pr
            });
        }
        if self
            .transfer_target
            .is_some_and(|t| !self.membership.is_voter(t))
        {
            self.transfer_target = None;
        }
    }

    // ----- output ----------------------------------------------------------------------------

    fn send(&mut self, to: NodeId, body: MessageBody) {
        let msg = Message {
            from: self.id,
            to,
            term: self.term,
            body,
        };
        // The leader's own replication traffic may leave before its local flush (§10.2.1); every
        // answer waits for the flush that covers what it acknowledges.
        if msg.is_from_leader() || matches!(msg.body, MessageBody::TimeoutNow) {
            self.messages_now.push(msg);
        } else {
            self.messages.push(msg);
        }
    }
}

/// The configuration after an entry, if the entry changes it. A change that does not apply
/// (impossible from a correct leader) is ignored.
fn next_membership(current: &Membership, payload: &EntryPayload) -> Option<Membership> {
    match payload {
        EntryPayload::Config(config) => Some(config.clone()),
        EntryPayload::Membership(change) => current.apply(*change).ok(),
        _ => None,
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
            .field("election_elapsed", &self.election_elapsed)
            .finish()
    }
}
