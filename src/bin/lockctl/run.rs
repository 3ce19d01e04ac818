//! `lockctl run KEY -- CMD ARGS…`: run a command while holding a lock.
//!
//! The command runs in its own process group with `RAFTLOCK_KEY`, `RAFTLOCK_FENCING_TOKEN`,
//! `RAFTLOCK_FENCING_MAC` and
//! `RAFTLOCK_CLIENT_ID` (the lock's owner id) in its environment. The lock is renewed in the background; if renewal
//! fails, the whole process group is killed (SIGKILL) before the lease could lapse on the
//! server, so the command never runs while someone else holds the lock.

use std::process::ExitCode;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use raftlock::client::{ClientError, RaftLockClient};

/// Exit code when the lock was not acquired within `--wait`.
pub const EXIT_NOT_ACQUIRED: u8 = 75;
/// Exit code when the lock was lost while the command ran (the command was killed).
pub const EXIT_LOCK_LOST: u8 = 76;
/// Exit code when lockctl itself failed (bad arguments, cluster unreachable, command not found).
pub const EXIT_ERROR: u8 = 78;

pub struct RunArgs {
    pub key: String,
    pub ttl: Duration,
    pub wait: Option<Duration>,
    pub command: Vec<String>,
}

pub async fn run(client: RaftLockClient, args: RunArgs) -> ExitCode {
    let Some((program, rest)) = args.command.split_first() else {
        eprintln!("lockctl run: no command given (usage: lockctl run KEY -- CMD ARGS…)");
        return ExitCode::from(EXIT_ERROR);
    };
    let acquired = match args.wait {
        Some(w) => client.try_acquire(&args.key, args.ttl, w).await,
        None => client
            .acquire_with(&args.key, args.ttl, None)
            .await
            .map(Some),
    };
    let lock = match acquired {
        Ok(Some(lock)) => lock,
        Ok(None) => {
            eprintln!(
                "lockctl run: {} not acquired within the wait timeout",
                args.key
            );
            return ExitCode::from(EXIT_NOT_ACQUIRED);
        }
        Err(ClientError::WaitTimeout { .. }) => {
            eprintln!(
                "lockctl run: {} not acquired within the wait timeout",
                args.key
            );
            return ExitCode::from(EXIT_NOT_ACQUIRED);
        }
        Err(e) => {
            eprintln!("lockctl run: cannot acquire {}: {e}", args.key);
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let mut renewer = lock.auto_renew();
    let mut child = match tokio::process::Command::new(program)
        .args(rest)
        .env("RAFTLOCK_KEY", &args.key)
        .env("RAFTLOCK_FENCING_TOKEN", lock.fencing_token().to_string())
        .env("RAFTLOCK_CLIENT_ID", lock.owner_id())
        // The token's MAC for a resource that verifies it (empty when the cluster has no
        // fencing key).
        .env("RAFTLOCK_FENCING_MAC", lock.fencing_mac().unwrap_or(""))
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockctl run: cannot start {program}: {e}");
            let _ = lock.release().await;
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let pgid = child.id().map(|id| Pid::from_raw(id as i32));
    let kill_group = |sig: Signal| {
        if let Some(pgid) = pgid {
            let _ = killpg(pgid, sig);
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let forwarded = async {
        match term.as_mut() {
            Some(t) => {
                tokio::select! { _ = t.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
            }
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    };
    tokio::pin!(forwarded);
    // Ok: the command exited; Err: the lock was lost first.
    let ended = tokio::select! {
        status = child.wait() => Ok(status),
        reason = renewer.lost() => Err(reason),
        _ = &mut forwarded => {
            // Ctrl-C or SIGTERM: pass it on to the command's group and wait for it (still
            // bounded by the lease).
            kill_group(Signal::SIGTERM);
            tokio::select! {
                status = child.wait() => Ok(status),
                reason = renewer.lost() => Err(reason),
            }
        }
    };
    let status = match ended {
        Ok(status) => status,
        Err(reason) => {
            kill_group(Signal::SIGKILL);
            let _ = child.wait().await;
            eprintln!(
                "lockctl run: lock {} lost ({reason}); killed the command",
                args.key
            );
            return ExitCode::from(EXIT_LOCK_LOST);
        }
    };
    drop(renewer);
    // Anything the command left running in its group goes with it.
    kill_group(Signal::SIGKILL);
    if let Err(e) = lock.release().await {
        eprintln!(
            "lockctl run: release of {} failed: {e} (it lapses at its TTL)",
            args.key
        );
    }
    match status {
        Ok(s) => {
            use std::os::unix::process::ExitStatusExt;
            if let Some(code) = s.code() {
                ExitCode::from(code.clamp(0, 255) as u8)
            } else {
                ExitCode::from(128u8.saturating_add(s.signal().unwrap_or(0).clamp(0, 127) as u8))
            }
        }
        Err(e) => {
            eprintln!("lockctl run: waiting for the command failed: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}
