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
    /// Hold `key` and these keys on one session.
    pub session: Option<Vec<String>>,
}

pub async fn run(client: RaftLockClient, args: RunArgs) -> ExitCode {
    let Some((program, rest)) = args.command.split_first() else {
        eprintln!("lockctl run: no command given (usage: lockctl run KEY -- CMD ARGS…)");
        return ExitCode::from(EXIT_ERROR);
    };
    if let Some(more) = &args.session {
        let mut keys = vec![args.key.clone()];
        keys.extend(more.iter().cloned());
        return run_on_session(client, &args, keys, program, rest).await;
    }
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
    let status = match supervise(&mut child, renewer.lost()).await {
        Ok(status) => status,
        Err(reason) => {
            eprintln!(
                "lockctl run: lock {} lost ({reason}); killed the command",
                args.key
            );
            return ExitCode::from(EXIT_LOCK_LOST);
        }
    };
    drop(renewer);
    if let Err(e) = lock.release().await {
        eprintln!(
            "lockctl run: release of {} failed: {e} (it lapses at its TTL)",
            args.key
        );
    }
    exit_code_of(status)
}

/// `lockctl run --session`: every key held on one session, the command supervised as with one
/// lock, everything given back in one entry when it exits.
async fn run_on_session(
    client: RaftLockClient,
    args: &RunArgs,
    keys: Vec<String>,
    program: &str,
    rest: &[String],
) -> ExitCode {
    let mut session = match client.open_session(args.ttl).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lockctl run: cannot open a session: {e}");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    session.auto_keep_alive();
    let mut locks = Vec::new();
    for key in &keys {
        match session.acquire(key, args.wait).await {
            Ok(lock) => locks.push(lock),
            Err(ClientError::WaitTimeout { .. }) => {
                eprintln!("lockctl run: {key} not acquired within the wait timeout");
                let _ = session.end().await;
                return ExitCode::from(EXIT_NOT_ACQUIRED);
            }
            Err(e) => {
                eprintln!("lockctl run: cannot acquire {key}: {e}");
                let _ = session.end().await;
                return ExitCode::from(EXIT_ERROR);
            }
        }
    }
    let listed: Vec<String> = locks
        .iter()
        .map(|l| format!("{}={}", l.key, l.token))
        .collect();
    let mut child = match tokio::process::Command::new(program)
        .args(rest)
        .env("RAFTLOCK_KEY", &locks[0].key)
        .env("RAFTLOCK_FENCING_TOKEN", locks[0].token.to_string())
        .env(
            "RAFTLOCK_FENCING_MAC",
            locks[0].mac.as_deref().unwrap_or(""),
        )
        .env("RAFTLOCK_CLIENT_ID", session.owner_id())
        .env("RAFTLOCK_LOCKS", listed.join(","))
        .env("RAFTLOCK_SESSION", session.id().to_string())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockctl run: cannot start {program}: {e}");
            let _ = session.end().await;
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let Ok(status) = supervise(&mut child, session.lost()).await else {
        eprintln!(
            "lockctl run: session {} lost; killed the command",
            session.id()
        );
        return ExitCode::from(EXIT_LOCK_LOST);
    };
    if let Err(e) = session.end().await {
        eprintln!("lockctl run: ending the session failed: {e} (it lapses at its TTL)");
    }
    exit_code_of(status)
}

/// lockctl's exit code for the command's exit: its status, or 128 + the signal that ended it.
fn exit_code_of(status: std::io::Result<std::process::ExitStatus>) -> ExitCode {
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

/// Waits for the command unless `lost` resolves first. Ctrl-C and SIGTERM are passed on to the
/// command's process group (the wait stays bounded by `lost`). Once the command exited, or was
/// killed (SIGKILL) because the lock was lost, anything left in its group is killed too.
/// `Ok`: the command's exit; `Err`: what `lost` resolved with.
async fn supervise<T>(
    child: &mut tokio::process::Child,
    lost: impl std::future::Future<Output = T>,
) -> Result<std::io::Result<std::process::ExitStatus>, T> {
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
    tokio::pin!(lost);
    let ended = tokio::select! {
        status = child.wait() => Ok(status),
        reason = &mut lost => Err(reason),
        _ = &mut forwarded => {
            kill_group(Signal::SIGTERM);
            tokio::select! {
                status = child.wait() => Ok(status),
                reason = &mut lost => Err(reason),
            }
        }
    };
    kill_group(Signal::SIGKILL);
    if ended.is_err() {
        let _ = child.wait().await;
    }
    ended
}
