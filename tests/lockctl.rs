//! `lockctl` end to end: `run` never lets two commands overlap on one key, a lost lock kills the
//! command's whole process group, and `demo` passes.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const LOCKCTL: &str = env!("CARGO_BIN_EXE_lockctl");

fn lockctl(endpoints: &[String]) -> Command {
    let mut c = Command::new(LOCKCTL);
    c.args(["--endpoints", &endpoints.join(",")]);
    c
}

/// Reads `start <ns>` / `stop <ns>` lines into intervals, one per run.
fn intervals(path: &Path) -> Vec<(u128, u128, String)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out = Vec::new();
    let mut open: Option<(u128, String)> = None;
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        match parts.as_slice() {
            ["start", t, token] => {
                assert!(open.is_none(), "two commands ran at once:\n{text}");
                open = Some((t.parse().expect("ns"), token.to_string()));
            }
            ["stop", t, _] => {
                let (s, token) = open.take().expect("stop without start");
                out.push((s, t.parse().expect("ns"), token));
            }
            _ => {}
        }
    }
    out
}

#[test]
fn two_runs_on_one_key_never_overlap() {
    let cluster = Cluster::start(3);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(cluster.wait_for_leader(Duration::from_secs(20)));
    let eps = endpoints(&cluster);
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("runs.log");
    // Each command appends start/stop lines with its token; overlapping runs would interleave.
    let script = format!(
        "echo start $(date +%s%N) $RAFTLOCK_FENCING_TOKEN >> {0}; sleep 0.3; echo stop $(date +%s%N) $RAFTLOCK_FENCING_TOKEN >> {0}",
        log.display()
    );
    let mut children = Vec::new();
    for _ in 0..3 {
        children.push(
            lockctl(&eps)
                .args([
                    "run",
                    "nightly-report",
                    "--ttl",
                    "5s",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ])
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn lockctl run"),
        );
    }
    for mut c in children {
        let status = c.wait().expect("wait");
        assert!(status.success(), "lockctl run failed: {status}");
    }
    let runs = intervals(&log);
    assert_eq!(runs.len(), 3, "every run must have held the lock once");
    let mut tokens: Vec<u64> = runs.iter().map(|r| r.2.parse().expect("token")).collect();
    let sorted = {
        let mut t = tokens.clone();
        t.sort_unstable();
        t
    };
    assert_eq!(
        tokens, sorted,
        "runs must hold increasing tokens in order: {runs:?}"
    );
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "tokens must differ: {runs:?}");
}

#[test]
fn exit_codes_for_not_acquired_and_child_status() {
    let cluster = Cluster::start(3);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(cluster.wait_for_leader(Duration::from_secs(20)));
    let eps = endpoints(&cluster);
    let status = lockctl(&eps)
        .args(["run", "k", "--", "sh", "-c", "exit 7"])
        .status()
        .expect("run");
    assert_eq!(
        status.code(),
        Some(7),
        "the command's exit status is passed on"
    );
    let holder = lockctl(&eps)
        .args(["--client-id", "holder", "acquire", "busy", "--ttl", "30s"])
        .output()
        .expect("acquire");
    assert!(holder.status.success());
    let status = lockctl(&eps)
        .args(["run", "busy", "--wait", "200ms", "--", "true"])
        .stderr(Stdio::null())
        .status()
        .expect("run");
    assert_eq!(status.code(), Some(75), "not acquired");
    let status = lockctl(&eps)
        .args(["run", "k", "--", "/nonexistent/command"])
        .stderr(Stdio::null())
        .status()
        .expect("run");
    assert_eq!(status.code(), Some(78), "command cannot start");
}

/// `acquire` prints the owner id the lock is held by; `release` and `renew` work with it as
/// `--client-id`, and not with the client id of the acquire.
#[test]
fn acquire_prints_the_owner_id_release_needs() {
    let cluster = Cluster::start(3);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(cluster.wait_for_leader(Duration::from_secs(20)));
    let eps = endpoints(&cluster);
    let out = lockctl(&eps)
        .args(["--client-id", "ops", "--output", "json", "acquire", "k"])
        .output()
        .expect("acquire");
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let owner = v["clientId"].as_str().expect("owner id").to_string();
    let token = v["fencingToken"].as_u64().expect("token").to_string();
    assert!(owner.starts_with("ops#"), "{v}");
    let as_client = lockctl(&eps)
        .args(["--client-id", "ops", "release", "k", "--token", &token])
        .output()
        .expect("release");
    assert!(
        !as_client.status.success(),
        "released by the bare client id"
    );
    for args in [
        vec!["renew", "k", "--token", &token, "--ttl", "20s"],
        vec!["release", "k", "--token", &token],
    ] {
        let out = lockctl(&eps)
            .args(["--client-id", &owner])
            .args(&args)
            .output()
            .expect("lockctl");
        assert!(
            out.status.success(),
            "{args:?} as {owner}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The human output names the same id.
    let out = lockctl(&eps)
        .args(["--client-id", "ops", "acquire", "k"])
        .output()
        .expect("acquire");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("client id ops#"),
        "{text}"
    );
    // A key's lock-delay, set and removed; bad input is refused with a reason.
    rt.block_on(wait_for_cluster_version(&eps[0], 6));
    let out = lockctl(&eps)
        .args(["--output", "json", "lock-delay", "k", "1500ms"])
        .output()
        .expect("lock-delay");
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["lockDelayMs"], 1500, "{v}");
    let out = lockctl(&eps)
        .args(["lock-delay", "k", "0s"])
        .output()
        .expect("lock-delay");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("no lock-delay"),
        "{text}"
    );
    let out = lockctl(&eps)
        .args(["lock-delay", "k", "30days"])
        .output()
        .expect("lock-delay");
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("lock-delay is limited"),
        "{out:?}"
    );
    // An election: campaign, a second candidate refused, proclaim as the leader, read, resign.
    rt.block_on(wait_for_cluster_version(&eps[0], 7));
    let json_of = |args: &[&str]| {
        let out = lockctl(&eps)
            .args(["--output", "json"])
            .args(args)
            .output()
            .expect("lockctl");
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        (
            out.status.code(),
            v,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, v, err) = json_of(&["campaign", "e/shard", "10.0.0.1:80", "--ttl", "20s"]);
    assert_eq!(code, Some(0), "{v} {err}");
    assert_eq!(v["mode"], "leader", "{v}");
    let term = v["term"].as_u64().expect("term").to_string();
    let owner = v["clientId"].as_str().expect("owner").to_string();
    let (code, v, _) = json_of(&["campaign", "e/shard", "10.0.0.2:80"]);
    assert_eq!(code, Some(75), "another leader: {v}");
    assert_eq!(v["elected"], false, "{v}");
    let (code, _, err) = json_of(&["acquire", "e/shard"]);
    assert_ne!(code, Some(0), "an election's key is not a lock: {err}");
    let (code, v, err) = json_of(&[
        "--client-id",
        &owner,
        "proclaim",
        "e/shard",
        "10.0.0.1:81",
        "--term",
        &term,
    ]);
    assert_eq!(code, Some(0), "{v} {err}");
    let (code, v, _) = json_of(&["leader", "e/shard"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        (
            v["leader"].as_str(),
            v["term"].to_string(),
            v["value"].as_str()
        ),
        (Some(owner.as_str()), term.clone(), Some("10.0.0.1:81")),
        "{v}"
    );
    let (code, _, err) = json_of(&["proclaim", "e/shard", "x", "--term", &term]);
    assert_ne!(code, Some(0), "only the leader proclaims: {err}");
    let (code, v, err) = json_of(&[
        "--client-id",
        &owner,
        "release",
        "e/shard",
        "--token",
        &term,
    ]);
    assert_eq!(code, Some(0), "resign: {v} {err}");
    let (_, v, _) = json_of(&["leader", "e/shard"]);
    assert_eq!(v["leader"], serde_json::Value::Null, "{v}");
    // A read-write lock: two readers, a writer refused while they hold; a semaphore of one.
    rt.block_on(wait_for_cluster_version(&eps[0], 9));
    for _ in 0..2 {
        let (code, v, err) = json_of(&["acquire", "rw/doc", "--read", "--ttl", "20s"]);
        assert_eq!(code, Some(0), "{v} {err}");
        assert_eq!(v["mode"], "reader", "{v}");
    }
    let (code, v, _) = json_of(&["acquire", "rw/doc", "--write"]);
    assert_eq!(code, Some(75), "readers hold: {v}");
    let (code, _, err) = json_of(&["acquire", "rw/doc", "--permits", "2"]);
    assert_ne!(code, Some(0), "a read-write lock has no permits: {err}");
    let (code, v, err) = json_of(&["acquire", "sem/one", "--permits", "1", "--ttl", "20s"]);
    assert_eq!(code, Some(0), "{v} {err}");
    assert_eq!(
        (v["mode"].as_str(), v["slot"].as_u64()),
        (Some("permit"), Some(0)),
        "{v}"
    );
    let (code, v, _) = json_of(&["acquire", "sem/one", "--permits", "1"]);
    assert_eq!(code, Some(75), "the one permit is taken: {v}");
    let (code, _, err) = json_of(&["acquire", "sem/one", "--permits", "0"]);
    assert_ne!(code, Some(0), "a semaphore has a size: {err}");
    // An admin raises its size: a second permit fits, in slot 1.
    let (code, v, err) = json_of(&["permits", "sem/one", "2"]);
    assert_eq!(code, Some(0), "{v} {err}");
    assert_eq!(v["permits"], 2, "{v}");
    let (code, v, err) = json_of(&["acquire", "sem/one", "--permits", "1", "--ttl", "20s"]);
    assert_eq!(code, Some(0), "the size grew: {v} {err}");
    assert_eq!(v["slot"].as_u64(), Some(1), "{v}");
    let (code, _, err) = json_of(&["permits", "rw/doc", "2"]);
    assert_ne!(code, Some(0), "a read-write lock has no size: {err}");
}

fn is_running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name; Z is a zombie (dead, not reaped).
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn lost_lock_kills_the_process_group() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (_cluster, proxies) = rt.block_on(cluster_behind_proxies(3));
    let via: Vec<String> = proxies.iter().map(|p| p.addr.clone()).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let pids = dir.path().join("pids");
    // The command starts a background grandchild in its group and records both pids.
    let script = format!(
        "sleep 300 & echo $! >> {0}; echo $$ >> {0}; wait",
        pids.display()
    );
    let mut run = lockctl(&via)
        .args(["run", "shard-1", "--ttl", "2s", "--", "sh", "-c", &script])
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::fs::read_to_string(&pids).map_or(0, |t| t.lines().count()) < 2 {
        assert!(Instant::now() < deadline, "command never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let recorded: Vec<u32> = std::fs::read_to_string(&pids)
        .expect("pids")
        .lines()
        .map(|l| l.trim().parse().expect("pid"))
        .collect();
    std::thread::sleep(Duration::from_millis(2500)); // renewals keep it alive past one TTL
    assert!(
        recorded.iter().all(|&p| is_running(p)),
        "killed while the lock was held"
    );
    for p in &proxies {
        p.cut();
    }
    let cut = Instant::now();
    let status = loop {
        if let Some(s) = run.try_wait().expect("wait") {
            break s;
        }
        assert!(
            cut.elapsed() < Duration::from_secs(10),
            "lockctl did not give up"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(76), "lock lost");
    // The TTL is 2 s; the group must be gone well before the lease could lapse on the server.
    assert!(
        cut.elapsed() < Duration::from_secs(3),
        "took {:?}",
        cut.elapsed()
    );
    std::thread::sleep(Duration::from_millis(100));
    for p in recorded {
        assert!(!is_running(p), "process {p} of the group survived");
    }
}

#[test]
fn demo_passes() {
    // Find 21 consecutive free ports for the demo's cluster and data store.
    let base = (0..50)
        .map(|_| free_port().saturating_sub(30))
        .find(|&b| {
            b > 1024 && (b..=b + 20).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        })
        .expect("free port range");
    let out = Command::new(LOCKCTL)
        .args(["demo", "--duration", "6s", "--port-base", &base.to_string()])
        .output()
        .expect("demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("stale writes accepted: 0"), "{text}");
    assert!(text.contains("failovers: 1"), "{text}");
}

/// `lockctl up` in the background; SIGTERM and a bounded wait when dropped, so a failing test
/// does not leave a cluster behind.
struct Up {
    child: std::process::Child,
}

impl Up {
    fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.terminate();
        }
    }
}

async fn leader_among(addrs: &[String], not: u64, timeout: Duration) -> u64 {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        for a in addrs {
            if let Ok(s) = http_json(a, "/status").await {
                let id = s["id"].as_u64().unwrap_or(0);
                if s["role"] == "leader" && id != not {
                    return id;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no leader (other than {not}) within {timeout:?}");
}

fn state_pids(dir: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(dir.join("lockctl-up.json")).expect("state file");
    let v: serde_json::Value = serde_json::from_str(&text).expect("state json");
    v["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .chain(std::iter::once(&v["dataStore"]))
        .filter_map(|n| n["pid"].as_u64().map(|p| p as u32))
        .collect()
}

/// `lockctl up` keeps running when a node is killed; `lockctl node kill/start` act on it; the
/// cluster elects a new leader that serves locks, the restarted node rejoins, and SIGTERM stops
/// every child.
#[test]
fn up_survives_a_killed_leader_and_restarts_it() {
    let base = (0..50)
        .map(|_| free_port().saturating_sub(30))
        .find(|&b| {
            b > 1024 && (b..=b + 20).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        })
        .expect("free port range");
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("cluster");
    let out_path = dir.path().join("up.out");
    let mut up = Up {
        child: Command::new(LOCKCTL)
            .args(["up", "--data-dir", &data.display().to_string()])
            .args(["--peer-port-base", &base.to_string()])
            .args(["--client-port-base", &(base + 10).to_string()])
            .args(["--data-store-port", &(base + 20).to_string()])
            .stdout(std::fs::File::create(&out_path).expect("out file"))
            .stderr(Stdio::null())
            .spawn()
            .expect("lockctl up"),
    };
    let clients: Vec<String> = (1..=3)
        .map(|i| format!("127.0.0.1:{}", base + 10 + i))
        .collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let leader = rt.block_on(leader_among(&clients, 0, Duration::from_secs(40)));
    let node = |action: &str, id: u64| {
        let out = Command::new(LOCKCTL)
            .args(["node", action, &id.to_string()])
            .args(["--data-dir", &data.display().to_string()])
            .output()
            .expect("lockctl node");
        assert!(
            out.status.success(),
            "lockctl node {action} {id}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };

    node("kill", leader);
    assert!(
        up.child.try_wait().expect("wait").is_none(),
        "lockctl up exited when a node was killed"
    );
    let new_leader = rt.block_on(leader_among(&clients, leader, Duration::from_secs(30)));
    // The new leader serves locks.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = lockctl(&clients)
            .args(["--output", "json", "acquire", "after-failover"])
            .output()
            .expect("acquire");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if out.status.success() && v["acquired"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "no lock after failover: {out:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    assert!(
        text.contains(&format!("lock-node {leader} exited")),
        "up did not report the exit:\n{text}"
    );

    node("start", leader);
    let rejoined = &clients[(leader - 1) as usize];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = rt.block_on(http_get(rejoined, "/readyz"));
        let status = rt.block_on(http_json(rejoined, "/status"));
        if let (Ok((200, _)), Ok(s)) = (ready, status) {
            if s["leaderId"].as_u64().is_some_and(|l| l != 0)
                && s["voters"].as_array().map_or(0, |v| v.len()) == 3
            {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "node {leader} did not rejoin (leader was {new_leader})"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        up.child.try_wait().expect("wait").is_none(),
        "up is running"
    );

    let pids = state_pids(&data);
    assert_eq!(pids.len(), 4, "three nodes and the data store: {pids:?}");
    let status = up.terminate().expect("lockctl up did not stop on SIGTERM");
    assert!(status.success(), "lockctl up: {status}");
    std::thread::sleep(Duration::from_millis(100));
    for p in pids {
        assert!(!is_running(p), "child {p} survived lockctl up");
    }
    assert!(
        !data.join("lockctl-up.json").exists(),
        "state file left behind"
    );
}

/// Shell completions and the manual page come from the CLI definition: every subcommand is in
/// both, and an unknown shell is refused with a clear error.
#[test]
fn completions_and_man_page_cover_every_subcommand() {
    let subcommands = [
        "up",
        "acquire",
        "release",
        "renew",
        "lock-delay",
        "run",
        "locks",
        "status",
        "members",
        "node",
        "kv",
        "demo",
        "simulate",
        "completions",
        "man",
    ];
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(LOCKCTL)
            .args(["completions", shell])
            .output()
            .expect("lockctl completions");
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8_lossy(&out.stdout);
        for sub in subcommands {
            assert!(script.contains(sub), "{shell} completion lacks {sub}");
        }
    }
    let out = Command::new(LOCKCTL)
        .arg("man")
        .output()
        .expect("lockctl man");
    assert!(out.status.success(), "{out:?}");
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(
        page.starts_with(".ie") || page.contains(".TH lockctl"),
        "{page}"
    );
    assert!(
        page.contains(".TH lockctl 1"),
        "not the lockctl page: {page}"
    );
    for sub in subcommands {
        // roff writes a hyphen as `\-`.
        assert!(
            page.contains(&sub.replace('-', "\\-")),
            "the man page lacks {sub}"
        );
    }
    let out = Command::new(LOCKCTL)
        .args(["completions", "cmd-exe"])
        .output()
        .expect("lockctl completions");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("possible values"),
        "{out:?}"
    );
}

/// An error says what to do next: no node answering points at `lockctl up` and the endpoints.
#[test]
fn errors_say_what_to_do_next() {
    let closed = format!("127.0.0.1:{}", common::free_port());
    let out = Command::new(LOCKCTL)
        .args(["--endpoints", &closed, "acquire", "k", "--ttl", "5s"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("hint: no node answered"), "{err}");
    assert!(err.contains("lockctl up"), "{err}");
}

/// `--output yaml` prints a YAML document of the same data `--output json` prints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yaml_output_matches_json_output() {
    let cluster = Cluster::start(1);
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let eps = endpoints(&cluster);
    let run = |format: &str| {
        let out = lockctl(&eps)
            .args(["--output", format, "members", "list"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let json: serde_json::Value = serde_json::from_str(run("json").trim()).unwrap();
    let yaml = run("yaml");
    assert!(yaml.starts_with("---\n"), "{yaml}");
    assert!(yaml.contains("leaderId: 1"), "{yaml}");
    assert!(yaml.contains("members:"), "{yaml}");
    assert_eq!(json["leaderId"], 1, "{json}");
}

/// Whether the first certificate of `cert` (a file of `dir`) verifies as a TLS client
/// certificate against the CA file `ca` of `dir`, as a port requiring client certificates checks
/// it.
fn chains_as_client(dir: &Path, cert: &str, ca: &str) -> bool {
    let roots = std::sync::Arc::new(raftlock::tls::load_roots(&dir.join(ca)).unwrap());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots,
        raftlock::tls::provider(),
    )
    .build()
    .unwrap();
    let chain = raftlock::tls::load_certs(&dir.join(cert)).unwrap();
    verifier
        .verify_client_cert(&chain[0], &chain[1..], rustls::pki_types::UnixTime::now())
        .is_ok()
}

/// Whether the first certificate of `cert` (a file of `dir`) carries the DNS name `name`.
fn names(dir: &Path, cert: &str, name: &str) -> bool {
    let chain = raftlock::tls::load_certs(&dir.join(cert)).unwrap();
    let name = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
    rustls::server::ParsedCertificate::try_from(&chain[0])
        .and_then(|parsed| rustls::client::verify_server_name(&parsed, &name))
        .is_ok()
}

fn certs(dir: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(LOCKCTL)
        .args([
            "certs",
            "--out",
            &dir.display().to_string(),
            "--nodes",
            "1,2",
        ])
        .args(extra)
        .output()
        .expect("run lockctl certs")
}

/// `lockctl certs`: node and operator certificates from the peer CA, the client certificate from
/// a separate client CA, keys readable by their owner only; both CAs kept on a second run; names
/// that would give a certificate another kind's power refused.
#[test]
fn certs_issue_node_operator_and_client_certificates_under_two_cas() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let out = certs(dir, &["--hosts", "127.0.0.1,raftlock.example.com"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "ca-key.pem",
            "ca.pem",
            "client-ca-key.pem",
            "client-ca.pem",
            "client-key.pem",
            "client-port-key.pem",
            "client-port.pem",
            "client.pem",
            "node-1-key.pem",
            "node-1.pem",
            "node-2-key.pem",
            "node-2.pem",
            "operator-key.pem",
            "operator.pem",
        ]
    );
    for file in &files {
        let mode = std::fs::metadata(dir.join(file))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        let want = if file.ends_with("-key.pem") {
            0o600
        } else {
            0o644
        };
        assert_eq!(mode, want, "{file}: mode {mode:o}");
    }

    // The peer CA signs nodes and the operator, the client CA only the client.
    for cert in ["node-1.pem", "node-2.pem", "operator.pem"] {
        assert!(chains_as_client(dir, cert, "ca.pem"), "{cert} under ca.pem");
        assert!(
            !chains_as_client(dir, cert, "client-ca.pem"),
            "{cert} under client-ca.pem"
        );
    }
    assert!(chains_as_client(dir, "client.pem", "client-ca.pem"));
    assert!(!chains_as_client(dir, "client.pem", "ca.pem"));
    // Server-auth only: not a client certificate anywhere.
    assert!(!chains_as_client(dir, "client-port.pem", "ca.pem"));

    // Names: a node's own, the operator's only on the operator certificate.
    assert!(names(dir, "node-1.pem", "node-1.raftlock"));
    assert!(names(dir, "node-1.pem", "raftlock.example.com"));
    assert!(!names(dir, "node-1.pem", "node-2.raftlock"));
    assert!(!names(dir, "node-1.pem", "operator.raftlock"));
    assert!(names(dir, "operator.pem", "operator.raftlock"));
    assert!(!names(dir, "operator.pem", "node-1.raftlock"));
    assert!(!names(dir, "operator.pem", "raftlock.example.com"));
    assert!(!names(dir, "client-port.pem", "operator.raftlock"));
    assert!(!names(dir, "client-port.pem", "node-1.raftlock"));

    // A second run keeps both CAs and issues new leaves under them (a rotation).
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let (peer_ca, client_ca, client, operator) = (
        read("ca.pem"),
        read("client-ca.pem"),
        read("client.pem"),
        read("operator.pem"),
    );
    let out = certs(dir, &["--operator-name", "ops.raftlock.example"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(read("ca.pem"), peer_ca);
    assert_eq!(read("client-ca.pem"), client_ca);
    assert_ne!(read("client.pem"), client);
    assert_ne!(read("operator.pem"), operator);
    assert!(chains_as_client(dir, "client.pem", "client-ca.pem"));
    assert!(chains_as_client(dir, "operator.pem", "ca.pem"));
    assert!(names(dir, "operator.pem", "ops.raftlock.example"));
    assert!(!names(dir, "operator.pem", "operator.raftlock"));

    // Hosts go into every node certificate: one naming the operator or a node is refused.
    for host in ["operator.raftlock", "node-7.raftlock", "*.raftlock"] {
        let out = certs(dir, &["--hosts", host]);
        assert!(!out.status.success(), "--hosts {host} was taken");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("names a node or the operator"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A CA certificate without its key is neither used nor replaced.
    std::fs::remove_file(dir.join("client-ca-key.pem")).unwrap();
    let out = certs(dir, &[]);
    assert!(!out.status.success(), "issued without the client CA's key");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("client-ca.pem exists without"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(read("client-ca.pem"), client_ca);
}

/// Every `$ lockctl …` line of docs/recipes.md runs as written against a real cluster.
#[test]
fn recipes_in_the_docs_run() {
    let doc = include_str!("../docs/recipes.md");
    let commands: Vec<Vec<&str>> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("$ lockctl "))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(commands.len() >= 3, "{commands:?}");
    let cluster = Cluster::start(3);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(cluster.wait_for_leader(Duration::from_secs(20)));
    let eps = endpoints(&cluster);
    rt.block_on(wait_for_cluster_version(&eps[0], 9));
    for args in commands {
        let out = lockctl(&eps).args(&args).output().expect("lockctl");
        assert!(
            out.status.success(),
            "lockctl {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if args[0] == "run" {
            assert!(String::from_utf8_lossy(&out.stdout).contains("settling"));
        }
    }
}

/// `lockctl run --session` holds several keys on one session while the command runs: the
/// command sees every token, the keys are held (another client cannot take them), and they are
/// all free again once the command exits. `--and` without `--session` is refused.
#[test]
fn run_on_a_session_holds_every_key_and_gives_them_back() {
    let cluster = Cluster::start(3);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(cluster.wait_for_leader(Duration::from_secs(20)));
    let eps = endpoints(&cluster);
    rt.block_on(wait_for_cluster_version(&eps[0], 8));
    let eps_arg = eps.join(",");
    // While the command runs, it asks for one of its own keys as another client: refused.
    let script = format!(
        "echo \"$RAFTLOCK_LOCKS $RAFTLOCK_SESSION\"; \
         {LOCKCTL} --endpoints {eps_arg} --client-id other run b --wait 300ms -- true; \
         echo \"other: $?\""
    );
    let out = lockctl(&eps)
        .args([
            "run",
            "a",
            "--session",
            "--and",
            "b",
            "--and",
            "c",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
        ])
        .arg(&script)
        .output()
        .expect("run --session");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = stdout.lines().next().unwrap_or_default();
    let (locks, session) = first.split_once(' ').expect("locks and session");
    let keys: Vec<&str> = locks
        .split(',')
        .map(|kv| kv.split_once('=').expect("key=token").0)
        .collect();
    assert_eq!(keys, ["a", "b", "c"], "{stdout}");
    assert!(session.parse::<u64>().is_ok_and(|s| s > 0), "{stdout}");
    assert!(
        stdout.contains("other: 75"),
        "b was held on the session: {stdout}"
    );
    // Given back: another client takes every key at once.
    for key in ["a", "b", "c"] {
        let status = lockctl(&eps)
            .args([
                "--client-id",
                "after",
                "run",
                key,
                "--wait",
                "0s",
                "--",
                "true",
            ])
            .status()
            .expect("run");
        assert!(status.success(), "{key} is free after the session ended");
    }
    let refused = lockctl(&eps)
        .args(["run", "a", "--and", "b", "--", "true"])
        .stderr(Stdio::null())
        .status()
        .expect("run");
    assert!(!refused.success(), "--and needs --session");
}
