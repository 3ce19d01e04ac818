//! Simulator tests: a healthy core passes, and each deliberately broken core is caught within a
//! bounded number of seeds — proof that the checkers can fail.

use super::{replay_command, run_seed, SimConfig, SimOutcome};
use crate::raft::config::Bugs;

use crate::node::NodeBugs;

/// Runs seeds `0..max_seeds` and returns the first seed whose first violation is one of
/// `expected`, with the invariant; seeds that broke another invariant first are printed.
fn first_violation(
    max_seeds: u64,
    nodes: usize,
    schedule: Schedule,
    bugs: Bugs,
    node_bugs: NodeBugs,
    expected: &[&str],
) -> Option<(u64, &'static str)> {
    (0..max_seeds).find_map(|seed| {
        let mut cfg = SimConfig::new(seed, nodes);
        cfg.crash_intensity = schedule.crash_intensity;
        cfg.clients_first_on_resume = schedule.clients_first_on_resume;
        cfg.figure8 = schedule.figure8;
        cfg.background_flushes = schedule.background_flushes;
        cfg.client_sessions = schedule.client_sessions;
        cfg.client_shared = schedule.client_shared;
        if let Some(steps) = schedule.steps {
            cfg.steps = steps;
        }
        cfg.bugs = bugs;
        cfg.node_bugs = node_bugs;
        let (_, v) = run_seed(cfg).violation?;
        if expected.contains(&v.invariant) {
            Some((seed, v.invariant))
        } else {
            println!(
                "  seed {seed} ({nodes} nodes) broke \"{}\" first",
                v.invariant
            );
            None
        }
    })
}

/// Fault-schedule knobs a test may turn away from the defaults.
#[derive(Clone, Copy)]
struct Schedule {
    crash_intensity: u32,
    clients_first_on_resume: bool,
    /// The targeted Figure 8 schedule ([`SimConfig::figure8`]) instead of the random faults.
    figure8: bool,
    /// Steps per seed instead of the default.
    steps: Option<u64>,
    /// Cluster sizes to try, in order.
    nodes: &'static [usize],
    /// Flushes complete in the background ([`SimConfig::background_flushes`]).
    background_flushes: bool,
    /// Clients keep sessions ([`SimConfig::client_sessions`]).
    client_sessions: bool,
    /// Clients take read-write locks and semaphores ([`SimConfig::client_shared`]).
    client_shared: bool,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            crash_intensity: 1,
            clients_first_on_resume: false,
            figure8: false,
            steps: None,
            nodes: &[3, 5],
            background_flushes: false,
            client_sessions: false,
            client_shared: false,
        }
    }
}

fn assert_caught(name: &str, max_seeds: u64, bugs: Bugs, expected: &[&str]) {
    assert_caught_with(
        name,
        max_seeds,
        Schedule::default(),
        bugs,
        NodeBugs::default(),
        expected,
    )
}

fn assert_node_bug_caught(name: &str, max_seeds: u64, node_bugs: NodeBugs, expected: &[&str]) {
    assert_caught_with(
        name,
        max_seeds,
        Schedule::default(),
        Bugs::default(),
        node_bugs,
        expected,
    )
}

/// The broken build must be caught by one of the `expected` invariants (not merely by whatever
/// check happens to trip first) within `max_seeds` seeds on one of the schedule's cluster sizes
/// (3 or 5 nodes unless it says otherwise).
fn assert_caught_with(
    name: &str,
    max_seeds: u64,
    schedule: Schedule,
    bugs: Bugs,
    node_bugs: NodeBugs,
    expected: &[&str],
) {
    let found = schedule.nodes.iter().find_map(|&nodes| {
        first_violation(max_seeds, nodes, schedule, bugs, node_bugs, expected)
            .map(|(s, i)| (s, i, nodes))
    });
    match found {
        Some((seed, invariant, nodes)) => println!(
            "{name}: caught by \"{invariant}\" at seed {seed} on {nodes} nodes ({} seeds run)",
            seed + 1
        ),
        None => panic!(
            "{name}: not caught by {expected:?} within {max_seeds} seeds on {:?} nodes",
            schedule.nodes
        ),
    }
}

/// Runs one seed that must pass; a violation fails the test with the command that replays it.
fn run_clean(cfg: &SimConfig) -> SimOutcome {
    let outcome = run_seed(cfg.clone());
    if let Some((step, v)) = &outcome.violation {
        panic!(
            "seed {} step {step}: {} — {}\nreplay: {}",
            cfg.seed,
            v.invariant,
            v.detail,
            replay_command(cfg)
        );
    }
    outcome
}

#[test]
fn healthy_core_passes_with_every_fault() {
    for nodes in [1, 3, 5, 7] {
        for seed in 0..60 {
            let cfg = SimConfig::new(seed, nodes);
            let outcome = run_clean(&cfg);
            assert!(
                outcome.stats.committed > 0,
                "seed {seed}: nothing committed"
            );
        }
    }
}

#[test]
fn healthy_core_passes_with_frequent_crashes() {
    for nodes in [3, 5] {
        for seed in 0..200 {
            let mut cfg = SimConfig::new(seed, nodes);
            cfg.crash_intensity = 3;
            run_clean(&cfg);
        }
    }
}

/// Flushes that complete in the background, some events after the Ready that started them, as
/// lock-node runs them: the node takes and writes further Readies meanwhile, and a crash loses
/// every flush not done.
#[test]
fn healthy_core_passes_with_background_flushes() {
    for (nodes, crash_intensity) in [(3, 1), (5, 1), (3, 3), (5, 3)] {
        let mut overlapped = 0;
        for seed in 0..150 {
            let mut cfg = SimConfig::new(seed, nodes);
            cfg.crash_intensity = crash_intensity;
            cfg.background_flushes = true;
            let outcome = run_clean(&cfg);
            overlapped += outcome.stats.overlapped_readies;
        }
        // The schedule must really write Readies while earlier flushes are still running.
        assert!(
            overlapped > 1000,
            "{nodes} nodes: only {overlapped} Readies overlapped a flush"
        );
    }
}

/// Every simulated member runs this RaftLock, so the leader raises the cluster version early in
/// each run: under faults, crashes, snapshots and membership changes, every member up at the end
/// that has applied all that was committed holds the raised version (the `SetClusterVersion`
/// entry applied, or installed with a snapshot, or read back from storage after a crash), and
/// no checker objects.
#[test]
fn the_cluster_version_is_raised_under_faults() {
    let (mut up, mut at_version) = (0, 0);
    for seed in 0..200 {
        let outcome = run_clean(&SimConfig::new(seed, 3));
        up += outcome.stats.nodes_up;
        at_version += outcome.stats.nodes_at_version;
    }
    assert!(up >= 300, "{up} nodes up over 100 runs");
    assert_eq!(
        at_version, up,
        "nodes up at the end without the raised version"
    );
}

#[test]
fn caught_answers_before_the_background_flush_is_done() {
    assert_caught_with(
        "finish_before_flush_done",
        100,
        Schedule {
            background_flushes: true,
            ..Schedule::default()
        },
        Bugs::default(),
        NodeBugs {
            finish_before_flush_done: true,
            ..NodeBugs::default()
        },
        &[
            "storage",
            "restart",
            "committed entries stay on a majority",
            "leader completeness",
            "state machine safety",
            "log matching",
        ],
    );
}

/// Regression: with snapshot bytes let go and built again when a follower needs them, snapshot
/// jobs became frequent, and these seeds handed a job's result into a step whose storage had just
/// lost power (the job had read writes the power cut took back), so the node compacted past
/// what its storage held. The simulator now drops such results, as the node's process would.
#[test]
fn snapshot_results_are_not_handed_into_a_crashed_step() {
    let cfg = SimConfig::new(1168, 3);
    if let Some((step, v)) = run_seed(cfg.clone()).violation {
        panic!(
            "seed 1168 step {step}: {} — {}\nreplay: {}",
            v.invariant,
            v.detail,
            replay_command(&cfg)
        );
    }
}

/// Regression: the leader proposed every due expiry and cancel in one proposal, and this seed had
/// seven due with room for six uncommitted entries (`max_uncommitted_entries` 6): the proposal
/// was refused as busy on every tick, and no lease expired again ("leases expire": client-3 still
/// held key-0 1.5 s after the clients stopped). Housekeeping now proposes what fits.
#[test]
fn housekeeping_larger_than_the_log_room_still_expires() {
    run_clean(&SimConfig::new(1_008_370, 3));
}

/// The targeted schedules of the mutation tests pass with a healthy core.
#[test]
fn healthy_core_passes_targeted_schedules() {
    for nodes in [3, 5] {
        for seed in 0..100 {
            let mut cfg = SimConfig::new(seed, nodes);
            cfg.clients_first_on_resume = true;
            run_clean(&cfg);
        }
    }
    // The Figure 8 schedule: every round's recounting leader crashes the moment it advances its
    // commit index, so the crashes count the rounds that got that far.
    let mut crashes = 0;
    for seed in 0..100 {
        let mut cfg = SimConfig::new(seed, 5);
        cfg.figure8 = true;
        let outcome = run_clean(&cfg);
        if seed < 10 {
            let again = run_seed(cfg);
            assert_eq!(
                format!("{:?}", outcome.stats),
                format!("{:?}", again.stats),
                "seed {seed} ran differently twice under the Figure 8 schedule"
            );
        }
        crashes += outcome.stats.crashes;
    }
    assert!(
        crashes >= 300,
        "the Figure 8 schedule reached its recount only {crashes} times in 100 seeds"
    );
}

#[test]
fn same_seed_same_run() {
    let a = run_seed(SimConfig::new(7, 5));
    let b = run_seed(SimConfig::new(7, 5));
    assert_eq!(format!("{:?}", a.stats), format!("{:?}", b.stats));
    assert!(a.stats.elections > 0 && a.stats.crashes > 0 && a.stats.partitions > 0);
}

// Reference: §5.4.1, the election restriction.
#[test]
fn caught_vote_without_log_check() {
    assert_caught(
        "vote_without_log_check",
        300,
        Bugs {
            vote_without_log_check: true,
            ..Bugs::default()
        },
        &[
            "leader completeness",
            "state machine safety",
            "log matching",
            "deterministic apply",
            "replica lock state",
        ],
    );
}

// Reference: §5.4.2 and Figure 8.
//
// The random fault schedules do not reach the interleaving (not within 600 seeds on 3 or 5
// nodes, nor within 1500 seeds with crashes six times as frequent): a leader must count an entry
// of an earlier term onto a majority before its own no-op gets there, crash before anyone learns
// more, and a node holding a newer-term entry at that index must then win without it. The
// targeted Figure 8 schedule (`SimConfig::figure8`) plays exactly those rounds on 5 nodes and
// catches it at seed 1 (2 seeds run, about 10 ms); `healthy_core_passes_targeted_schedules`
// runs the healthy core under it.
#[test]
fn caught_commit_of_earlier_term_entry() {
    assert_caught_with(
        "commit_earlier_term",
        // Caught at seed 1 on 5 nodes.
        20,
        Schedule {
            figure8: true,
            nodes: &[5],
            ..Schedule::default()
        },
        Bugs {
            commit_earlier_term: true,
            ..Bugs::default()
        },
        NodeBugs::default(),
        &[
            "leader completeness",
            "state machine safety",
            "deterministic apply",
            "replica lock state",
            "committed entries stay on a majority",
        ],
    );
}

// Reference: §5.3, the consistency check of AppendEntries.
#[test]
fn caught_append_without_prev_check() {
    assert_caught(
        "append_without_prev_check",
        300,
        Bugs {
            append_without_prev_check: true,
            ..Bugs::default()
        },
        &[
            "log matching",
            "leader completeness",
            "state machine safety",
            "deterministic apply",
            "replica lock state",
        ],
    );
}

// Reference: §5.1 / Figure 2, "persist currentTerm and votedFor before responding".
#[test]
fn caught_vote_reply_before_persist() {
    assert_caught(
        "vote_before_persist",
        1000,
        Bugs {
            vote_before_persist: true,
            ..Bugs::default()
        },
        &[
            "election safety",
            "term monotonicity",
            "leader completeness",
        ],
    );
}

/// A seed is a complete description of a run: running it again, in the same process or another,
/// gives the same run. (Regression: leader lease bookkeeping iterated a `HashMap`, whose order
/// changes from one map to the next, so the expiries a leader proposed — and everything after —
/// differed between runs of one seed, and a printed seed did not replay its failure.)
#[test]
fn a_seed_replays_identically() {
    for seed in 0..200 {
        let first = run_seed(SimConfig::new(seed, 3));
        let second = run_seed(SimConfig::new(seed, 3));
        assert_eq!(
            format!("{:?}", first.stats),
            format!("{:?}", second.stats),
            "seed {seed} ran differently twice"
        );
        assert_eq!(
            format!("{:?}", first.violation),
            format!("{:?}", second.violation),
            "seed {seed}"
        );
    }
}

// ----- lease bugs in the node logic (issue: a handed-off lock never expired) --------------------

#[test]
fn caught_lease_ended_after_hand_off() {
    assert_node_bug_caught(
        "lease_ended_after_hand_off",
        100,
        NodeBugs {
            lease_ended_after_hand_off: true,
            ..NodeBugs::default()
        },
        &["leases expire"],
    );
}

#[test]
fn caught_no_lease_wait_after_election() {
    // A new leader must give every inherited lease a full TTL: the old leader may have renewed it
    // just before losing office, and its client still believes it holds the lock.
    assert_node_bug_caught(
        "no_lease_wait_after_election",
        100,
        NodeBugs {
            no_lease_wait_after_election: true,
            ..NodeBugs::default()
        },
        &["one holder at a time", "linearizable"],
    );
}

// ----- lock-delay bugs in the node logic ---------------------------------------------------------

#[test]
fn caught_lock_delay_ended_at_once() {
    assert_node_bug_caught(
        "lock_delay_ended_at_once",
        100,
        NodeBugs {
            lock_delay_ended_at_once: true,
            ..NodeBugs::default()
        },
        &["lock-delay lasts its length", "linearizable"],
    );
}

#[test]
fn caught_lock_delay_not_restarted_after_election() {
    // A new leader cannot know when the old one started a running delay: it must time it again
    // in full, or the key is granted before the delay has passed.
    assert_node_bug_caught(
        "lock_delay_not_restarted_after_election",
        400,
        NodeBugs {
            lock_delay_not_restarted_after_election: true,
            ..NodeBugs::default()
        },
        &["lock-delay lasts its length", "linearizable"],
    );
}

// ----- election bugs in the state machine -----------------------------------------------------

#[test]
fn caught_election_proclaim_without_holder_check() {
    // A stale leader's proclaim (or a made-up term's) would replace the value the current
    // leader shows.
    assert_node_bug_caught(
        "proclaim_skips_holder_check",
        400,
        NodeBugs {
            proclaim_skips_holder_check: true,
            ..NodeBugs::default()
        },
        &["proclaim only by the leader", "linearizable"],
    );
}

#[test]
fn caught_election_hand_off_without_the_campaign_value() {
    assert_node_bug_caught(
        "elected_by_hand_off_without_value",
        400,
        NodeBugs {
            elected_by_hand_off_without_value: true,
            ..NodeBugs::default()
        },
        &["elected with its campaign value", "linearizable"],
    );
}

#[test]
fn caught_reader_granted_beside_a_writer() {
    assert_caught_with(
        "reader_beside_writer",
        400,
        Schedule {
            client_sessions: true,
            client_shared: true,
            ..Schedule::default()
        },
        Bugs::default(),
        NodeBugs {
            reader_beside_writer: true,
            ..NodeBugs::default()
        },
        &[
            "shared locks keep their modes and queue",
            "readers never beside a writer",
        ],
    );
}

#[test]
fn caught_semaphore_granting_a_permit_too_many() {
    assert_caught_with(
        "permit_over_size",
        400,
        Schedule {
            client_sessions: true,
            client_shared: true,
            ..Schedule::default()
        },
        Bugs::default(),
        NodeBugs {
            permit_over_size: true,
            ..NodeBugs::default()
        },
        &[
            "shared locks keep their modes and queue",
            "at most N permit holders",
        ],
    );
}

#[test]
fn caught_shared_cancel_that_leaves_fitting_waiters_queued() {
    // A writer's wait ends (its timeout, or its session's end) while readers hold the key and
    // another reader waits behind it: that reader must be granted in the same entry.
    assert_caught_with(
        "shared_cancel_skips_grant",
        400,
        Schedule {
            client_sessions: true,
            client_shared: true,
            ..Schedule::default()
        },
        Bugs::default(),
        NodeBugs {
            shared_cancel_skips_grant: true,
            ..NodeBugs::default()
        },
        &["shared locks keep their modes and queue"],
    );
}

#[test]
fn caught_session_end_that_leaves_read_write_locks_and_permits() {
    // A read lock or permit attached to a session outlives it.
    assert_caught_with(
        "session_end_skips_shared",
        400,
        Schedule {
            client_sessions: true,
            client_shared: true,
            ..Schedule::default()
        },
        Bugs::default(),
        NodeBugs {
            session_end_skips_shared: true,
            ..NodeBugs::default()
        },
        &["attached locks end with their session"],
    );
}

#[test]
fn caught_session_end_that_leaves_attached_acquires_queued() {
    // A queued acquire left behind is granted later, attached to a session that is gone.
    assert_caught_with(
        "session_end_keeps_waiters",
        400,
        Schedule {
            client_sessions: true,
            ..Schedule::default()
        },
        Bugs::default(),
        NodeBugs {
            session_end_keeps_waiters: true,
            ..NodeBugs::default()
        },
        &["attached locks end with their session"],
    );
}

#[test]
fn caught_session_expiry_that_ignores_a_keepalive() {
    assert_caught_with(
        "session_expiry_ignores_keepalive",
        400,
        Schedule {
            client_sessions: true,
            ..Schedule::default()
        },
        Bugs::default(),
        NodeBugs {
            session_expiry_ignores_keepalive: true,
            ..NodeBugs::default()
        },
        &[
            "sessions expire only after their lease",
            "one holder at a time",
        ],
    );
}

#[test]
fn caught_sessions_not_timed_again_after_an_election() {
    assert_caught_with(
        "no_session_wait_after_election",
        400,
        Schedule {
            client_sessions: true,
            ..Schedule::default()
        },
        Bugs::default(),
        NodeBugs {
            no_session_wait_after_election: true,
            ..NodeBugs::default()
        },
        &[
            "sessions expire only after their lease",
            "one holder at a time",
        ],
    );
}

#[test]
fn caught_no_lease_for_grants_without_a_local_proposal() {
    assert_node_bug_caught(
        "lease_only_for_local_grants",
        100,
        NodeBugs {
            lease_only_for_local_grants: true,
            ..NodeBugs::default()
        },
        &["leases expire"],
    );
}

#[test]
fn caught_expiry_that_checks_only_the_token() {
    assert_node_bug_caught(
        "expiry_checks_only_token",
        400,
        NodeBugs {
            expiry_checks_only_token: true,
            ..NodeBugs::default()
        },
        &["one holder at a time"],
    );
}

#[test]
fn caught_housekeeping_never_retried() {
    assert_node_bug_caught(
        // Caught at seed 835 on 3 nodes since compaction stopped encoding snapshots (the
        // runs' events changed); within 600 before.
        "housekeeping_never_retried",
        1200,
        NodeBugs {
            housekeeping_never_retried: true,
            ..NodeBugs::default()
        },
        &["leases expire", "waits end", "every request answered"],
    );
}

// ----- more Raft core bugs: reads, PreVote, membership ------------------------------------------

// Reference: §6.4, "the leader exchanges heartbeats with a majority before answering a read".
#[test]
fn caught_read_index_without_heartbeat() {
    // A deposed leader must answer a read before it learns of the new term. Under the default
    // schedules it hardly ever does (not within 400 seeds on 3 or 5 nodes, with or without
    // CheckQuorum): a partitioned leader steps down about when the others elect a new one, and
    // a paused leader handles the new leader's messages before its clients' on resuming. The
    // targeted schedule lets a resumed node handle (and answer) waiting client requests first.
    assert_caught_with(
        "read_index_without_heartbeat",
        // Caught at seed 218 on 3 nodes (at seed 85 until the leader's proposals were fitted to
        // the log's room, 2026-12-02, which changed the runs).
        400,
        Schedule {
            clients_first_on_resume: true,
            ..Schedule::default()
        },
        Bugs {
            read_index_without_heartbeat: true,
            ..Bugs::default()
        },
        NodeBugs::default(),
        &["linearizable read", "linearizable"],
    );
}

// Reference: dissertation §9.6: a PreVote grant records no vote, so it cannot elect anyone.
#[test]
fn caught_prevote_counted_as_vote() {
    assert_caught(
        "prevote_counts_as_vote",
        // Caught at seed 0 on 3 nodes.
        50,
        Bugs {
            prevote_counts_as_vote: true,
            ..Bugs::default()
        },
        &[
            "election safety",
            "log matching",
            "leader completeness",
            "state machine safety",
            "deterministic apply",
            "replica lock state",
        ],
    );
}

// Reference: §4.1 (one single-server change at a time) and §4.1's fix (a leader commits an entry
// of its term before it changes the configuration).
#[test]
fn caught_membership_guards_off() {
    assert_caught(
        "membership_guards_off",
        // Caught at seed 312 on 3 nodes (seed 39 before snapshot jobs began to finish some
        // steps late, which changed every seed's schedule).
        500,
        Bugs {
            membership_guards_off: true,
            ..Bugs::default()
        },
        &[
            "election safety",
            "leader completeness",
            "state machine safety",
            "log matching",
            "deterministic apply",
            "replica lock state",
            "committed entries stay on a majority",
        ],
    );
}

// The history check on its own: with leader expiries that check only the token, a client's
// history has no linearization (a lock granted to another client while its holder's renewed
// lease cannot have run out). Other checks may see it first on other seeds; this one asks for
// the new check by name.
#[test]
fn linearizability_check_catches_expiry_that_checks_only_the_token() {
    assert_node_bug_caught(
        "expiry_checks_only_token (linearizable)",
        // Caught at seed 45 on 3 nodes.
        150,
        NodeBugs {
            expiry_checks_only_token: true,
            ..NodeBugs::default()
        },
        &["linearizable"],
    );
}

#[test]
fn caught_bootstrap_when_peers_do_not_answer() {
    // The bootstrap node back on an empty disk while its peers are down starts a second
    // cluster: a second cluster id, a second leader of a term, a log that does not match.
    assert_node_bug_caught(
        "bootstrap_when_unreachable",
        200,
        NodeBugs {
            bootstrap_when_unreachable: true,
            ..NodeBugs::default()
        },
        &[
            "one cluster",
            "election safety",
            "log matching",
            "one holder at a time",
            "tokens grow in real time",
            "state machine safety",
        ],
    );
}

#[test]
fn caught_incarnation_ignored() {
    // A member that lost its data taken back as the voter it was: it votes with an empty log.
    // (With the admission check alone in place it is a voter that never votes again, a
    // liveness failure; both switched off is how the core was before seed 130.)
    assert_node_bug_caught(
        "incarnation_ignored",
        400,
        NodeBugs {
            incarnation_ignored: true,
            admission_ignored: true,
            ..NodeBugs::default()
        },
        &[
            "committed entries stay on a majority",
            "leader completeness",
            "state machine safety",
            "log matching",
            "one holder at a time",
            "exactly once",
        ],
    );
}

#[test]
fn lifecycle_faults_run_and_pass() {
    // Every node restarted at once, disks wiped (the bootstrap node's with its peers down
    // too): the cluster stays one cluster and available, and wiped members come back.
    let mut totals = crate::sim::SimStats::default();
    for seed in 0..60 {
        let outcome = run_clean(&SimConfig::new(seed, 3));
        totals.add(&outcome.stats);
    }
    assert!(totals.restarts_all > 0, "no whole-cluster restart ran");
    assert!(
        totals.wipes > 0 && totals.wipes_bootstrap_alone > 0,
        "no wipe ran"
    );
    assert!(
        totals.bootstrap_waits > 0,
        "the bootstrap node never had to wait"
    );
    assert!(
        totals.replacements > 0 && totals.joins > 0,
        "no member was replaced"
    );
    assert!(
        totals.rewipes > 0,
        "no member was wiped again while its replacement was in flight"
    );
}

#[test]
fn readmitted_members_do_not_vote_before_their_admission() {
    // Regression: seed 130 at crash intensity 3 and seed 1183 (3 nodes) wiped members while
    // another lagged; a readmitted member replayed a configuration that named it a voter and
    // voted a lagging node into leadership without a committed entry (leader completeness).
    // (Other changes move the schedules: these seeds are kept as cases, and still wipe.)
    let mut wipes = 0;
    for (seed, intensity) in [(130, 3), (1183, 1)] {
        let mut cfg = SimConfig::new(seed, 3);
        cfg.crash_intensity = intensity;
        wipes += run_clean(&cfg).stats.wipes;
    }
    assert!(wipes > 0, "no disk was wiped");
}

#[test]
fn a_second_wipe_while_a_member_catches_up_still_elects() {
    // Regression: seed 656 (3 nodes, background flushes) wiped a second member while the first
    // one's new incarnation was accepted but not admitted yet, and no leader was ever elected
    // again (liveness). It passes since the lifecycle fixes of seeds 22, 630 and 9 below (a
    // new leader promotes every learner that qualifies; a node waiting for admission asks
    // again); it failed before them.
    let mut cfg = SimConfig::new(656, 3);
    cfg.background_flushes = true;
    cfg.client_elections = false;
    let outcome = run_clean(&cfg);
    assert!(outcome.stats.wipes > 0, "no disk was wiped");
}

#[test]
fn wiped_again_members_become_voters_after_a_leader_change() {
    // Regression: seed 22 (3 nodes) wipes node 5 twice, the second time while its replacement
    // was in flight. Its third incarnation was accepted as a learner, and the leader lost
    // leadership before promoting it: the list of learners to promote was the accepting
    // leader's alone, the joiner does not ask again once accepted, and no later leader
    // promoted it (the chaos run whose third incarnation stayed a learner for 45 s). Every
    // new leader now promotes every learner once it qualifies.
    let outcome = run_clean(&SimConfig {
        client_elections: false,
        ..SimConfig::new(22, 3)
    });
    assert!(outcome.stats.wipes > 0, "no disk was wiped");
}

#[test]
fn member_table_larger_than_the_proposal_room_is_filled() {
    // Regression: seed 630 (5 nodes, room for six uncommitted entries) had seven members to
    // record and the leader proposed none of them, ever: the wiped member's new incarnation
    // was never recorded, so it was never admitted nor promoted. The leader now records what
    // fits and the rest on a later round.
    let outcome = run_clean(&SimConfig {
        client_elections: false,
        ..SimConfig::new(630, 5)
    });
    assert!(outcome.stats.wipes > 0, "no disk was wiped");
}

#[test]
fn a_removed_members_old_words_do_not_become_its_record() {
    // Regression: seed 9 (5 nodes) wiped node 3; a node that later led still held what the
    // lost incarnation had said of itself and recorded that incarnation again over the new
    // one's record, so the new incarnation was never promoted. A node forgets what a member
    // said once it applies the member's removal.
    let outcome = run_clean(&SimConfig {
        client_elections: false,
        ..SimConfig::new(9, 5)
    });
    assert!(outcome.stats.wipes > 0, "no disk was wiped");
}

#[test]
fn a_learners_old_words_do_not_overwrite_its_new_record() {
    // Regression: seed 644 (3 nodes, background flushes) wiped node 4 while it was a learner
    // with no record yet; its new incarnation asked leader 3, which knew no other incarnation
    // of it, accepted it and recorded the new incarnation, which was admitted. Node 2 still held
    // what the lost incarnation had said of itself (a learner speaks to the leader only, so
    // nothing had told node 2 otherwise); elected next, it recorded that old incarnation over
    // the new one's record (a learner's incarnation could change in place), promoted the
    // running node under it, and no leader ever recorded the new incarnation again (a voter's
    // incarnation changes only by replacement). A node now forgets words of another
    // incarnation heard before it applies a member's record, and a leader does not record
    // words that a record in its log, not applied yet, contradicts.
    let mut cfg = SimConfig::new(644, 3);
    cfg.background_flushes = true;
    // Found with the client mix from before sessions.
    cfg.client_sessions = false;
    let outcome = run_clean(&cfg);
    assert!(outcome.stats.wipes > 0, "no disk was wiped");
}

#[test]
fn no_second_disk_is_lost_while_a_wiped_voter_awaits_admission() {
    // Regression: seed 313 (3 nodes, client sessions) wiped voter 6; a stale leader, paused,
    // accepted it as a learner of its own outdated configuration, so the simulator took the
    // node for back while the real leader still had it as a voter under its old incarnation
    // (out of elections, awaiting admission). It then wiped node 1 too: two of four voters
    // without their data, where no leader can be elected safely, and the liveness check
    // failed. The fault schedule loses no second disk while a wiped node awaits admission and a
    // configuration still has it as a voter under its old incarnation.
    let mut cfg = SimConfig::new(313, 3);
    cfg.client_sessions = true;
    // Found with the client mix from before read-write locks and semaphores.
    cfg.client_shared = false;
    let outcome = run_clean(&cfg);
    assert!(outcome.stats.wipes > 0, "no disk was wiped");
}

#[test]
fn a_learner_with_the_newest_log_may_campaign() {
    // Regression: seed 694 (3 nodes, segments disk). Leader 3 appended the promotion of learner
    // 4 (index 75, term 5) and lost leadership before committing it; leader 2 (term 6) wrote
    // its own entries 75-76 on itself and on node 4 only, and then lost its disk. Node 3 needed
    // 3 votes of {1, 2, 3, 4}: node 2 was out of elections awaiting admission, and node 4, a
    // learner in its own log, refused every candidate (its log was the newest) and never
    // campaigned. Nobody was ever elected. A learner whose log runs past its commit index may
    // now campaign, elected by its own configuration's voters, and steps down once it has
    // committed.
    let mut cfg = SimConfig::new(694, 3);
    cfg.segments_disk = true;
    // Found with the client mix from before attached campaigns.
    cfg.client_attached_campaigns = false;
    let outcome = run_clean(&cfg);
    assert!(outcome.stats.wipes > 0, "no disk was wiped");
}

#[test]
fn a_session_end_judges_its_grants_in_the_entrys_order() {
    // Regression (the simulator's checker): seed 1795 (3 nodes) ended a session that held an
    // election (`elect-*`, handed on with token 9) and a read-write lock (`rw-*`, handed on
    // with token 10) in one entry. The checker judged the shared keys' grants before the plain
    // keys' and reported token 9 after 10; it now takes the entry's events in their order.
    let outcome = run_clean(&SimConfig::new(1795, 3));
    assert!(outcome.stats.sessions_opened > 0, "no session opened");
}

#[test]
fn caught_promoted_before_admission() {
    // A learner promoted before its log holds the record of its incarnation is a voter that
    // stays out of elections: a cluster that needs its vote never elects again.
    assert_node_bug_caught(
        "promoted_before_admission",
        800,
        NodeBugs {
            promoted_before_admission: true,
            ..NodeBugs::default()
        },
        &["liveness"],
    );
}

/// The segments engine's own code on a simulated disk: crashes are power cuts that tear
/// writes, and synced sectors go bad on members whose peers hold every committed entry (the
/// restart finds the damage below the synced mark and the node is rebuilt on an empty disk).
#[test]
fn segments_on_a_simulated_disk_survive_power_cuts_torn_writes_and_bad_sectors() {
    let mut total = crate::sim::SimStats::default();
    for seed in 0..60 {
        let mut cfg = SimConfig::new(seed, 3);
        cfg.segments_disk = true;
        let outcome = run_clean(&cfg);
        assert!(
            outcome.stats.committed > 0,
            "seed {seed}: nothing committed"
        );
        total.add(&outcome.stats);
    }
    assert!(total.power_cuts > 0, "no power cut: {total:?}");
    assert!(total.torn_writes > 0, "no torn write: {total:?}");
    assert!(total.corrupt_sectors > 0, "no corrupt sector: {total:?}");
    assert!(
        total.damaged_disks > 0,
        "no damaged disk found at a restart: {total:?}"
    );
}
