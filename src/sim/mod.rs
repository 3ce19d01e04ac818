//! Deterministic simulation of whole RaftLock clusters.
//!
//! A run is a pure function of its [`SimConfig`] (above all its seed): the same seed replays the
//! same schedule of messages, faults and proposals, so any failure can be reproduced with
//! `raftlock-sim --seeds 1 --start-seed <seed>`. The simulator drives the real `raft` core; only
//! the network, the disk and the clock are simulated.

pub mod checker;
pub mod clients;
pub mod cluster;
pub mod linearizability;
pub mod locks;
pub mod network;

#[cfg(test)]
mod tests;

pub use checker::Violation;
pub use cluster::{Cluster, SimConfig, SimOutcome, SimStats};

/// Runs one seed.
pub fn run_seed(cfg: SimConfig) -> SimOutcome {
    Cluster::new(cfg).run()
}

/// The command that replays exactly one seed of a run configured like `cfg`.
pub fn replay_command(cfg: &SimConfig) -> String {
    let mut cmd = format!(
        "cargo run --release --bin raftlock-sim -- --seeds 1 --start-seed {} --nodes {} --steps {}",
        cfg.seed, cfg.nodes, cfg.steps
    );
    if !cfg.pre_vote {
        cmd.push_str(" --no-pre-vote");
    }
    if cfg.clients_first_on_resume {
        cmd.push_str(" --clients-first-on-resume");
    }
    if cfg.figure8 {
        cmd.push_str(" --figure8");
    }
    if !cfg.faults {
        cmd.push_str(" --no-faults");
    }
    if !cfg.membership_changes {
        cmd.push_str(" --no-membership");
    }
    if cfg.background_flushes {
        cmd.push_str(" --background-flushes");
    }
    if !cfg.lifecycle {
        cmd.push_str(" --no-lifecycle");
    }
    if cfg.segments_disk {
        cmd.push_str(" --segments-disk");
        if cfg.corrupt_sector_ppm != 400 {
            cmd.push_str(&format!(" --corrupt-sector-ppm {}", cfg.corrupt_sector_ppm));
        }
    }
    if cfg.crash_intensity != 1 {
        cmd.push_str(&format!(" --crash-intensity {}", cfg.crash_intensity));
    }
    if !cfg.client_elections {
        cmd.push_str(" --no-client-elections");
    }
    if cfg.client_elections && !cfg.client_sessions {
        cmd.push_str(" --no-client-sessions");
    }
    if cfg.client_elections && cfg.client_sessions && !cfg.client_shared {
        cmd.push_str(" --no-client-shared");
    }
    if cfg.client_elections
        && cfg.client_sessions
        && cfg.client_shared
        && !cfg.client_attached_campaigns
    {
        cmd.push_str(" --no-client-attached-campaigns");
    }
    cmd
}
