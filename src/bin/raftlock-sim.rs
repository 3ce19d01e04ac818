//! `raftlock-sim`: runs the deterministic cluster simulator over a range of seeds and checks the
//! Raft invariants after every step. Exits non-zero on any violation, printing for each failing
//! seed the exact command that replays only that seed.

use std::process::ExitCode;

use clap::Parser;
use raftlock::sim::{replay_command, run_seed, SimConfig, SimStats};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Deterministic fault-injection simulator for the RaftLock core"
)]
struct Args {
    /// Number of seeds to run.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    start_seed: u64,
    /// Initial voters per cluster (1-7).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=7))]
    nodes: u64,
    /// Simulated events per seed before the final liveness check.
    #[arg(long, default_value_t = 4_000)]
    steps: u64,
    /// Disable PreVote (to watch partitioned nodes disrupt leaders).
    #[arg(long)]
    no_pre_vote: bool,
    /// A node resuming from a pause handles waiting client requests before waiting peer messages.
    #[arg(long)]
    clients_first_on_resume: bool,
    /// Replace the random faults with the targeted Figure 8 schedule (Raft paper §5.4.2),
    /// round after round; meant for --nodes 5.
    #[arg(long)]
    figure8: bool,
    /// Disable fault injection (no partitions, crashes, loss, duplication).
    #[arg(long)]
    no_faults: bool,
    /// Disable membership changes.
    #[arg(long)]
    no_membership: bool,
    /// Multiply the crash rate (1 = default; higher values stress crash recovery).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    crash_intensity: u32,
    /// Flushes complete in the background, some events after they start (as lock-node's do),
    /// instead of inside the Ready that starts them.
    #[arg(long)]
    background_flushes: bool,
    /// Disable the lifecycle faults (every node restarted at once, a node's disk wiped).
    #[arg(long)]
    no_lifecycle: bool,
    /// Keep every node's Raft log in the segments engine on a simulated disk: crashes are
    /// power cuts that may tear the last unsynced write, and synced sectors now and then go bad.
    #[arg(long)]
    segments_disk: bool,
    /// With --segments-disk: the chance per event, in parts per million, of a damaged synced
    /// sector on a member whose peers hold every committed entry.
    #[arg(long, default_value_t = 400)]
    corrupt_sector_ppm: u32,
    /// Clients leave leader elections and sessions alone: the client mix from before them, under
    /// which the lifecycle regression seeds (22, 630, 9; 656 with --background-flushes) were
    /// found.
    #[arg(long)]
    no_client_elections: bool,
    /// Clients leave sessions alone: the client mix from before sessions.
    #[arg(long)]
    no_client_sessions: bool,
    /// Clients leave read-write locks and semaphores alone: the client mix from before them.
    #[arg(long)]
    no_client_shared: bool,
    /// Clients attach no campaigns to their sessions: the client mix from before that.
    #[arg(long)]
    no_client_attached_campaigns: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut total = SimStats::default();
    let mut violations = 0u64;
    for seed in args.start_seed..args.start_seed.saturating_add(args.seeds) {
        let mut cfg = SimConfig::new(seed, args.nodes as usize);
        cfg.steps = args.steps;
        cfg.pre_vote = !args.no_pre_vote;
        cfg.clients_first_on_resume = args.clients_first_on_resume;
        cfg.figure8 = args.figure8;
        cfg.faults = !args.no_faults;
        cfg.membership_changes = !args.no_membership;
        cfg.crash_intensity = args.crash_intensity;
        cfg.background_flushes = args.background_flushes;
        cfg.lifecycle = !args.no_lifecycle;
        cfg.segments_disk = args.segments_disk;
        cfg.corrupt_sector_ppm = args.corrupt_sector_ppm;
        cfg.client_elections = !args.no_client_elections;
        cfg.client_sessions = !args.no_client_sessions;
        cfg.client_shared = !args.no_client_shared;
        cfg.client_attached_campaigns = !args.no_client_attached_campaigns;
        cfg.trace = std::env::var_os("RAFTLOCK_SIM_TRACE").is_some();
        let outcome = run_seed(cfg.clone());
        total.add(&outcome.stats);
        if let Some((step, violation)) = outcome.violation {
            violations += 1;
            println!(
                "VIOLATION seed={seed} step={step} invariant=\"{}\": {}\n  replay: {}",
                violation.invariant,
                violation.detail,
                replay_command(&cfg)
            );
        }
    }
    println!(
        "sim: seeds={} violations={} elections={} leader_changes={} partitions={} crashes={} pauses={} membership_changes={} committed={} grants={} expiries={} lock_delays={} lock_delays_ended={} leaders_elected={} proclaims={} sessions_opened={} sessions_closed={} sessions_expired={} attached_grants={} shared_grants={} snapshots={} compactions={} transfers={} history_ops={} hold_intervals_checked={} reads_checked={} linearizability_checks={} lin_unchecked={} client_expiries={} redirects={} retries={} log_ticks={} acknowledging={} acknowledged_refusals={} overlapped_readies={} nodes_at_cluster_version={}/{} restarts_all={} wipes={} wipes_bootstrap_alone={} rewipes={} bootstrap_waits={} replacements={} joins={} power_cuts={} torn_writes={} corrupt_sectors={} damaged_disks={}",
        args.seeds,
        violations,
        total.elections,
        total.leader_changes,
        total.partitions,
        total.crashes,
        total.pauses,
        total.membership_changes,
        total.committed,
        total.grants,
        total.expiries,
        total.lock_delays,
        total.lock_delays_ended,
        total.leaders_elected,
        total.proclaims,
        total.sessions_opened,
        total.sessions_closed,
        total.sessions_expired,
        total.attached_grants,
        total.shared_grants,
        total.snapshots_sent,
        total.compactions,
        total.transfers,
        total.history_ops,
        total.beliefs_checked,
        total.reads_checked,
        total.lin_checked,
        total.lin_unchecked,
        total.client_expiries,
        total.redirects,
        total.client_retries,
        total.ticks,
        total.acknowledging,
        total.acknowledged_refusals,
        total.overlapped_readies,
        total.nodes_at_version,
        total.nodes_up,
        total.restarts_all,
        total.wipes,
        total.wipes_bootstrap_alone,
        total.rewipes,
        total.bootstrap_waits,
        total.replacements,
        total.joins,
        total.power_cuts,
        total.torn_writes,
        total.corrupt_sectors,
        total.damaged_disks,
    );
    if violations == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
