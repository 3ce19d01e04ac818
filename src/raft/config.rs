//! Tuning knobs of the consensus core. All durations are in ticks: the driver decides how long a
//! tick is (10 ms in `lock-node`), the simulator decides it per node.

use super::types::NodeId;

/// Configuration of one [`super::Raft`] instance.
#[derive(Clone, Debug)]
pub struct Config {
    pub id: NodeId,
    /// Minimum election timeout; each election picks a timeout uniformly in
    /// `[election_ticks, 2 * election_ticks)` from the seeded generator (§5.2).
    pub election_ticks: u32,
    /// A leader sends heartbeats every `heartbeat_ticks`. Must be well below `election_ticks`.
    pub heartbeat_ticks: u32,
    /// Run a PreVote round before incrementing the term (dissertation §9.6).
    pub pre_vote: bool,
    /// A leader steps down if it has not heard from a quorum within an election timeout, and a
    /// server that heard from a leader recently ignores vote requests (§6.2, §4.2.3).
    pub check_quorum: bool,
    /// Appends in flight to one follower before the leader waits for acknowledgements.
    pub max_inflight_appends: usize,
    /// Entry bytes in flight to one follower before the leader waits for acknowledgements (one
    /// append is always allowed). Bounds what a follower catching up receives in one burst,
    /// and so how long the leader spends building it.
    pub max_inflight_bytes: usize,
    /// Upper bound on the entry bytes in one Append message (at least one entry is always sent).
    pub max_batch_bytes: usize,
    /// Upper bound on the committed entry bytes handed out for applying in one `Ready` (at least
    /// one entry). Keeps each driver step short, so a backlog of committed entries does not hold
    /// up ticks, heartbeats and vote answers for longer than an election timeout.
    pub max_apply_bytes: usize,
    /// Upper bound on entries the leader holds that are not yet committed; proposals beyond it are
    /// refused with [`super::ProposeError::Busy`] so clients see back-pressure, not memory growth.
    pub max_uncommitted_entries: usize,
    /// Upper bound on ReadIndex requests waiting for confirmation.
    pub max_pending_reads: usize,
    /// Bytes per InstallSnapshot chunk.
    pub snapshot_chunk_bytes: usize,
    /// A snapshot larger than this is refused by a receiving follower.
    pub max_snapshot_bytes: u64,
    /// Seed of the only randomness the core uses (election timeouts).
    pub seed: u64,
    /// Deliberately broken behaviours, used to prove the simulator's checkers catch them.
    #[cfg(test)]
    pub bugs: Bugs,
}

impl Config {
    pub fn new(id: NodeId, seed: u64) -> Self {
        Config {
            id,
            election_ticks: 10,
            heartbeat_ticks: 2,
            pre_vote: true,
            check_quorum: true,
            max_inflight_appends: 64,
            max_inflight_bytes: 8 << 20,
            max_batch_bytes: 1 << 20,
            max_apply_bytes: 256 << 10,
            max_uncommitted_entries: 100_000,
            max_pending_reads: 10_000,
            snapshot_chunk_bytes: 1 << 20,
            max_snapshot_bytes: 4 << 30,
            seed,
            #[cfg(test)]
            bugs: Bugs::default(),
        }
    }

    /// Checks the settings that would make the core misbehave.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.id == 0 {
            return Err(ConfigError::Invalid("id must not be 0"));
        }
        if self.heartbeat_ticks == 0 {
            return Err(ConfigError::Invalid("heartbeat_ticks must be at least 1"));
        }
        if self.election_ticks <= self.heartbeat_ticks {
            return Err(ConfigError::Invalid(
                "election_ticks must exceed heartbeat_ticks",
            ));
        }
        if self.max_inflight_appends == 0
            || self.max_inflight_bytes == 0
            || self.max_batch_bytes == 0
            || self.max_apply_bytes == 0
        {
            return Err(ConfigError::Invalid(
                "max_inflight_appends, max_inflight_bytes, max_batch_bytes and max_apply_bytes must be > 0",
            ));
        }
        if self.snapshot_chunk_bytes == 0 || self.max_uncommitted_entries == 0 {
            return Err(ConfigError::Invalid(
                "snapshot_chunk_bytes and max_uncommitted_entries must be > 0",
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid raft config: {0}")]
    Invalid(&'static str),
}

/// Classic Raft bugs that tests switch on to show the simulator catches them. Only compiled into
/// test builds' `Config`: a real binary has no field to enable them with.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bugs {
    /// Grant votes without the "candidate's log is at least as up-to-date" check (§5.4.1).
    pub vote_without_log_check: bool,
    /// Commit by counting replicas of an entry from an earlier term (the Figure 8 bug, §5.4.2).
    pub commit_earlier_term: bool,
    /// A follower appends without checking the previous entry's index and term (§5.3).
    pub append_without_prev_check: bool,
    /// Send the vote reply before the hard state recording the vote is durable (§5.1, Figure 2).
    pub vote_before_persist: bool,
    /// Answer a ReadIndex read at once, without the heartbeat round that confirms a majority
    /// still follows this leader (§6.4): a deposed leader serves stale reads.
    pub read_index_without_heartbeat: bool,
    /// A won PreVote round is taken as a won election: the pre-candidate adopts the prospective
    /// term and leads it, though PreVote grants record no vote (§9.6), so two pre-candidates can
    /// both lead one term.
    pub prevote_counts_as_vote: bool,
    /// A leader proposes a membership change while another is uncommitted, or before it has
    /// committed an entry of its own term (§4.1 and its single-server-change bug fix).
    pub membership_guards_off: bool,
}
