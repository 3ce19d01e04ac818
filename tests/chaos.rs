//! Chaos on real processes: a three-node cluster and the data store, SDK clients (which
//! acknowledge their answers) and one raw WebSocket client (seed-000 style JSON, any node, its
//! own retries) doing
//! acquire → read the data store's counter → pause → fenced write of counter + 1 → release on one
//! contended key, and a seeded nemesis that SIGKILLs and restarts nodes, SIGSTOPs them for
//! longer than the lock TTL, now and then SIGKILLs the whole cluster at once or wipes one node's
//! data directory (it comes back with --join as a new incarnation and must be a voter again
//! within 45 s), partitions the
//! network (one node from another both ways or one way, the leader from everyone, or a bridge:
//! two nodes that reach only the third) and jumps nodes' wall clocks by up to ten minutes either
//! way. Every operation is recorded; the checker then requires:
//!
//! 1. the intervals in which a client believed it held the key (from the grant's answer until it
//!    sent its release or its SDK safety deadline passed, whichever came first) never overlap;
//! 2. fencing tokens strictly increase in grant order;
//! 3. the data store's accepted writes carry 1, 2, 3, … (no lost update: nobody read a value
//!    that another holder then overwrote) with non-decreasing tokens;
//! 4. every write the data store acknowledged is in its log;
//! 5. after the nemesis stops, the cluster grants the lock again within 15 s;
//! 6. the run made progress (some increments under faults);
//! 7. acquire, renew and release are linearizable per key: separate workers take, renew and
//!    release a few `lin-*` keys (a fresh set every few seconds, so that each key's history stays
//!    small enough to search), every operation recorded with its invocation and answer times,
//!    and the simulator's checker (`raftlock::sim::linearizability`, leases that end only once
//!    their TTL has passed in real time, within 1% clock drift) must find a linearization.
//!
//! Partitions need network namespaces: run as root (CI does), each node lives in a namespace of
//! its own, joined to the others by a bridge in a hub namespace, and the test reaches them through
//! a veth of its own into the hub (addresses 10.213.S.0/24, S chosen per run); a partition is an
//! iptables DROP inside the receiving node's namespace. Without root the nodes run on 127.0.0.1
//! and the nemesis does no partitions (`RAFTLOCK_REQUIRE_NETNS=1` makes that a failure). Clock
//! jumps need libfaketime (Debian `faketime`; `RAFTLOCK_REQUIRE_FAKETIME=1` likewise): lock-node
//! runs with it preloaded and only the wall clock faked (`DONT_FAKE_MONOTONIC=1`), since leases run
//! on the monotonic clock, which a wall-clock step must not move.
//!
//! The run ends with one line, `chaos: seed=… ops=… partitions=… kills=… wipes=… pauses=…
//! clock_jumps=… violations=…`. Bounded: 20 s of faults by default. Long form:
//! `RAFTLOCK_CHAOS_SECONDS=600 RAFTLOCK_CHAOS_SEED=7 cargo test --release --test chaos -- --nocapture`.
//! The seed fixes the nemesis schedule (which node, which fault, how long); process timing is
//! not deterministic, so a seed replays the schedule, not the exact interleaving.
//!
//! Everything is on 127.0.0.1; every loop is bounded in time.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use raftlock::client::{ClientError, RaftLockClient};
use raftlock::sim::linearizability::{self, LinOp, LockOp, OpKind};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KEY: &str = "counter";
const TTL: Duration = Duration::from_millis(1500);
const WORKERS: usize = 4;

#[derive(Clone, Debug)]
struct Hold {
    worker: usize,
    token: u64,
    start: Instant,
    end: Instant,
}

#[derive(Clone, Debug)]
struct Write {
    worker: usize,
    token: u64,
    value: u64,
    acked: bool,
}

#[derive(Default)]
struct History {
    holds: Vec<Hold>,
    writes: Vec<Write>,
    acquire_errors: usize,
    late_skips: usize,
    /// Client operations invoked: acquires, counter reads, fenced writes, releases, cancels.
    ops: usize,
    /// Waits cancelled (answered `cancelled: true`).
    cancels: usize,
    /// Grants that arrived after their wait was cancelled.
    cancel_violations: Vec<String>,
    /// The linearizability workers' operations, per key (times in µs since the run began).
    lin: BTreeMap<String, Vec<LinOp>>,
}

async fn post(addr: &str, path: &str, body: &Value, timeout: Duration) -> Option<u16> {
    let body = body.to_string();
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        text.split_whitespace().nth(1)?.parse().ok()
    };
    tokio::time::timeout(timeout, fut).await.ok().flatten()
}

/// The counter's current value: the data of the last accepted write of the key (0 if none).
async fn read_counter(store: &str) -> Option<u64> {
    let (_, body) = http_get(store, &format!("/data?key={KEY}")).await.ok()?;
    let v: Value = serde_json::from_str(&body).ok()?;
    let last = v["writes"].as_array()?.last().cloned();
    Some(match last {
        None => 0,
        Some(w) => w["data"].as_str()?.parse().ok()?,
    })
}

/// The work under the lock, shared by both kinds of client: read the counter, pause, write
/// counter + 1 with `token` only while the hold is believed valid, and record the write and the
/// hold (from `start` until the release is about to be sent or the end of the belief, if
/// earlier). `valid_until` says until when the client believes it holds the lock now (the SDK
/// moves it on with each renewal). One hold in four is long — up to twice the TTL, renewed by
/// the SDK meanwhile — so leader changes often fall inside a hold.
#[allow(clippy::too_many_arguments)]
async fn increment_while_valid(
    worker: usize,
    client_id: &str,
    token: u64,
    start: Instant,
    valid_until: &(dyn Fn() -> Instant + Send + Sync),
    long_holds: bool,
    store: &str,
    history: &Mutex<History>,
    rng: &mut rand_chacha::ChaCha8Rng,
) {
    history.lock().unwrap().ops += 1;
    if let Some(value) = read_counter(store).await {
        let pause_ms = if long_holds && rng.random_range(0..4) == 0 {
            rng.random_range(300..(2 * TTL.as_millis() as u64))
        } else {
            rng.random_range(0..120)
        };
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        let now = Instant::now();
        let until = valid_until();
        if now + Duration::from_millis(20) < until {
            let body = json!({"clientID": client_id,
                              "fencingToken": {"key": KEY, "value": token},
                              "data": (value + 1).to_string()});
            let status = post(store, "/write", &body, until - now).await;
            let mut h = history.lock().unwrap();
            h.ops += 1;
            h.writes.push(Write {
                worker,
                token,
                value: value + 1,
                acked: status == Some(200),
            });
            if Instant::now() > until {
                // The client's own rule was broken by a slow write: reported, not hidden.
                h.late_skips += 1;
            }
        } else {
            history.lock().unwrap().late_skips += 1;
        }
    }
    let end = valid_until().min(Instant::now());
    history.lock().unwrap().holds.push(Hold {
        worker,
        token,
        start,
        end,
    });
}

async fn worker(
    id: usize,
    client: RaftLockClient,
    store: String,
    history: Arc<Mutex<History>>,
    stop_at: Instant,
    seed: u64,
) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ (id as u64 + 1));
    while Instant::now() < stop_at {
        history.lock().unwrap().ops += 1;
        let handle = match client
            .acquire_with(KEY, TTL, Some(Duration::from_secs(3)))
            .await
        {
            Ok(h) => h,
            Err(ClientError::WaitTimeout { .. }) => continue,
            Err(_) => {
                history.lock().unwrap().acquire_errors += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let start = Instant::now();
        let token = handle.fencing_token();
        // Renewed in the background while the work goes on (the SDK moves `valid_until` on).
        let renewer = handle.auto_renew();
        increment_while_valid(
            id,
            &format!("w{id}"),
            token,
            start,
            &|| handle.valid_until(),
            true,
            &store,
            &history,
            &mut rng,
        )
        .await;
        drop(renewer);
        history.lock().unwrap().ops += 1;
        let _ = tokio::time::timeout(Duration::from_secs(3), handle.release()).await;
    }
}

/// One raw WebSocket request, answered within `timeout` (None: no answer, connection lost).
async fn ws_once(addr: &str, msg: &Value, timeout: Duration) -> Option<Value> {
    let url = format!("ws://{addr}/ws");
    let fut = async {
        let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str()).await.ok()?;
        ws_send(&mut ws, msg).await;
        ws_recv(&mut ws, timeout).await
    };
    tokio::time::timeout(timeout, fut).await.ok().flatten()
}

/// A client without the SDK: raw JSON to any node, the same request id on every retry. It counts
/// its lease from the send of the attempt that was answered: valid until that send + the
/// answer's `expiresInMs` − TTL/5. (A retry answered from the exactly-once table gets the time
/// left on the lease, or `STALE_TOKEN` when the hold already ended.)
async fn raw_worker(
    id: usize,
    nodes: Vec<String>,
    store: String,
    history: Arc<Mutex<History>>,
    stop_at: Instant,
    seed: u64,
) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0xABCD ^ id as u64);
    let mut n = 0u64;
    while Instant::now() < stop_at {
        n += 1;
        if rng.random_range(0..5) == 0 {
            let node = &nodes[rng.random_range(0..nodes.len())];
            let cancel_after = Duration::from_millis(rng.random_range(10..200));
            cancelled_wait(id, n, node, cancel_after, &history).await;
            continue;
        }
        let request_id = format!("raw{id}-{n}");
        let msg = json!({"commandType": 3, "key": KEY, "clientId": format!("raw{id}"),
                         "requestId": request_id, "ttl": TTL.as_millis() as u64,
                         "waitTimeout": 3000});
        // Retry the same request on any node until answered (bounded).
        history.lock().unwrap().ops += 1;
        let give_up = Instant::now() + Duration::from_secs(10);
        let mut granted = None;
        while Instant::now() < give_up {
            let node = &nodes[rng.random_range(0..nodes.len())];
            let sent = Instant::now();
            match ws_once(node, &msg, Duration::from_secs(4)).await {
                Some(r) if r["success"] == true => {
                    let left = r["expiresInMs"]
                        .as_u64()
                        .unwrap_or(0)
                        .min(TTL.as_millis() as u64);
                    granted = r["fencingToken"]["value"]
                        .as_u64()
                        .map(|t| (t, sent + Duration::from_millis(left)));
                    break;
                }
                Some(r) if r["error"]["code"] == "STALE_TOKEN" => break,
                Some(r) if r["error"]["code"] == "WAIT_TIMEOUT" => break,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let Some((token, lease_end)) = granted else {
            history.lock().unwrap().acquire_errors += 1;
            continue;
        };
        let start = Instant::now();
        let valid_until = lease_end.checked_sub(TTL / 5).unwrap_or(start).max(start);
        increment_while_valid(
            100 + id,
            &format!("raw{id}"),
            token,
            start,
            &move || valid_until,
            false,
            &store,
            &history,
            &mut rng,
        )
        .await;
        let release = json!({"commandType": 4, "key": KEY, "clientId": format!("raw{id}"),
                             "requestId": format!("{request_id}-r"),
                             "fencingToken": {"key": KEY, "value": token}});
        history.lock().unwrap().ops += 1;
        for node in &nodes {
            if ws_once(node, &release, Duration::from_secs(2))
                .await
                .is_some_and(|r| r["success"] == true || r["error"]["code"] == "STALE_TOKEN")
            {
                break;
            }
        }
    }
}

/// Keys the linearizability workers use at once; a new set every [`LIN_EPOCH`], so that no key's
/// history outgrows what the checker searches.
const LIN_KEYS: u64 = 3;
const LIN_EPOCH: Duration = Duration::from_secs(4);
const LIN_TTL_MS: u64 = 1000;
/// Workers doing acquire / renew / release on the `lin-*` keys.
const LIN_WORKERS: usize = 3;
/// Clock drift the checker allows between a node's monotonic clock and real time (1%).
const LIN_DRIFT_PPM: u64 = 10_000;

/// One request, retried with the same request id on any node until a final answer or until 5 s
/// have passed; the answer (None: none final) and when it arrived (µs since `base`).
async fn lin_request(
    nodes: &[String],
    msg: &Value,
    base: Instant,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> (Option<Value>, u64) {
    let give_up = Instant::now() + Duration::from_secs(5);
    while Instant::now() < give_up {
        let node = &nodes[rng.random_range(0..nodes.len())];
        if let Some(r) = ws_once(node, msg, Duration::from_secs(3)).await {
            let transient = matches!(
                r["error"]["code"].as_str(),
                Some("NOT_LEADER" | "NO_LEADER" | "UNAVAILABLE" | "BUSY")
            );
            if !transient {
                return (Some(r), base.elapsed().as_micros() as u64);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (None, base.elapsed().as_micros() as u64)
}

/// A client whose every lock operation goes into a per-key history for the linearizability
/// checker (the simulator's, `raftlock::sim::linearizability`): acquire with or without a wait,
/// hold for a random time (sometimes past the lease), renew, release. Raw JSON to random nodes.
async fn lin_worker(
    id: usize,
    nodes: Vec<String>,
    history: Arc<Mutex<History>>,
    base: Instant,
    stop_at: Instant,
    seed: u64,
) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x11AE ^ ((id as u64) << 8));
    let client = format!("lin{id}");
    let mut n = 0u64;
    let record = |key: &str, invoke: u64, complete: Option<u64>, op: LockOp| {
        let mut h = history.lock().unwrap();
        h.ops += 1;
        h.lin.entry(key.to_string()).or_default().push(LinOp {
            client: id,
            invoke,
            complete,
            kind: OpKind::Lock(op),
        });
    };
    while Instant::now() < stop_at {
        let epoch = base.elapsed().as_millis() as u64 / LIN_EPOCH.as_millis() as u64;
        let key = format!("lin-{epoch}-{}", rng.random_range(0..LIN_KEYS));
        n += 1;
        let wait = [0, 300, 1500][rng.random_range(0..3)];
        let msg = json!({"commandType": 3, "key": key, "clientId": client,
                         "requestId": format!("{client}-{n}"), "ttl": LIN_TTL_MS,
                         "waitTimeout": wait});
        let invoke = base.elapsed().as_micros() as u64;
        let (reply, at) = lin_request(&nodes, &msg, base, &mut rng).await;
        let ttl_us = LIN_TTL_MS * 1_000;
        let code = reply
            .as_ref()
            .and_then(|r| r["error"]["code"].as_str().map(String::from));
        let mut token = None;
        let op = match (&reply, code.as_deref()) {
            // No final answer: it may have been granted, at any time after its invocation.
            (None, _) => Some(LockOp::AcquireUnknown { ttl_us }),
            (Some(r), None) if r["success"] == true => {
                token = r["fencingToken"]["value"].as_u64();
                token.map(|t| LockOp::Granted { token: t, ttl_us })
            }
            (Some(r), Some("ALREADY_HELD")) => Some(LockOp::AlreadyHeld {
                token: r["error"]["currentToken"].as_u64(),
            }),
            (Some(_), Some("WAIT_TIMEOUT")) => Some(LockOp::HeldByOther),
            // A retry told that its hold has already ended: the grant happened.
            (Some(_), Some("STALE_TOKEN")) => Some(LockOp::AcquireUnknown { ttl_us }),
            // Anything else says it had no effect.
            _ => None,
        };
        if let Some(op) = op {
            record(&key, invoke, reply.is_some().then_some(at), op);
        }
        let Some(token) = token else {
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..100))).await;
            continue;
        };
        // Hold: sometimes renew, sometimes let the lease run out before releasing.
        let mut renewals = rng.random_range(0..3);
        loop {
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..1300))).await;
            n += 1;
            let fencing = json!({"key": key, "value": token});
            let renew = renewals > 0 && Instant::now() < stop_at;
            let msg = if renew {
                json!({"commandType": 5, "key": key, "clientId": client,
                       "requestId": format!("{client}-{n}"), "ttl": LIN_TTL_MS,
                       "fencingToken": fencing})
            } else {
                json!({"commandType": 4, "key": key, "clientId": client,
                       "requestId": format!("{client}-{n}"), "fencingToken": fencing})
            };
            let invoke = base.elapsed().as_micros() as u64;
            let (reply, at) = lin_request(&nodes, &msg, base, &mut rng).await;
            let code = reply
                .as_ref()
                .and_then(|r| r["error"]["code"].as_str().map(String::from));
            let ok = reply.as_ref().is_some_and(|r| r["success"] == true);
            let op = match (reply.is_some(), ok, code.as_deref(), renew) {
                (false, _, _, true) => Some(LockOp::RenewUnknown { token, ttl_us }),
                (false, _, _, false) => Some(LockOp::ReleaseUnknown { token }),
                (true, true, _, true) => Some(LockOp::Renewed { token, ttl_us }),
                (true, true, _, false) => Some(LockOp::Released { token }),
                (true, false, Some("STALE_TOKEN"), _) => Some(LockOp::StaleToken { token }),
                (true, false, Some("NOT_HOLDER"), _) => Some(LockOp::NotHolder { token }),
                _ => None,
            };
            if let Some(op) = op {
                record(&key, invoke, reply.is_some().then_some(at), op);
            }
            if !renew || !ok {
                break;
            }
            renewals -= 1;
        }
    }
}

/// Runs `ip` or `iptables` (with `ip netns exec NS` in front when `ns` is given); the error
/// names the command.
fn run(ns: Option<&str>, args: &[&str]) -> Result<(), String> {
    let mut command = std::process::Command::new(if ns.is_some() { "ip" } else { args[0] });
    match ns {
        Some(ns) => command.args(["netns", "exec", ns]).args(args),
        None => command.args(&args[1..]),
    };
    let out = command.output().map_err(|e| format!("{args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{ns:?} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// One network namespace per node, joined by a bridge in a hub namespace, and a veth from the
/// test's own namespace into the hub (so clients reach every node whatever the partition).
/// Partitions are iptables rules inside the receiving node's namespace. Everything is deleted
/// when dropped.
struct NetLab {
    prefix: String,
    subnet: u32,
    nodes: u64,
}

impl NetLab {
    fn create(nodes: u64) -> Result<NetLab, String> {
        let pid = std::process::id();
        let lab = NetLab {
            prefix: format!("rl{pid}"),
            subnet: 16 + pid % 200,
            nodes,
        };
        lab.build().inspect_err(|_| lab.remove())?;
        Ok(lab)
    }

    fn hub(&self) -> String {
        format!("{}h", self.prefix)
    }
    fn ns(&self, id: u64) -> String {
        format!("{}n{id}", self.prefix)
    }
    fn ip(&self, id: u64) -> String {
        format!("10.213.{}.{}", self.subnet, 10 + id)
    }

    fn build(&self) -> Result<(), String> {
        let hub = self.hub();
        run(None, &["ip", "netns", "add", &hub])?;
        run(Some(&hub), &["ip", "link", "add", "br0", "type", "bridge"])?;
        run(Some(&hub), &["ip", "link", "set", "br0", "up"])?;
        // The test's own leg: `<prefix>r` here, `<prefix>q` in the hub.
        let (here, there) = (format!("{}r", self.prefix), format!("{}q", self.prefix));
        run(
            None,
            &[
                "ip", "link", "add", &here, "type", "veth", "peer", "name", &there,
            ],
        )?;
        run(None, &["ip", "link", "set", &there, "netns", &hub])?;
        run(Some(&hub), &["ip", "link", "set", &there, "master", "br0"])?;
        run(Some(&hub), &["ip", "link", "set", &there, "up"])?;
        let own = format!("10.213.{}.1/24", self.subnet);
        run(None, &["ip", "addr", "add", &own, "dev", &here])?;
        run(None, &["ip", "link", "set", &here, "up"])?;
        for id in 1..=self.nodes {
            let ns = self.ns(id);
            let (inside, outside) = (
                format!("{}v{id}", self.prefix),
                format!("{}p{id}", self.prefix),
            );
            run(None, &["ip", "netns", "add", &ns])?;
            run(
                None,
                &[
                    "ip", "link", "add", &inside, "type", "veth", "peer", "name", &outside,
                ],
            )?;
            run(None, &["ip", "link", "set", &inside, "netns", &ns])?;
            run(None, &["ip", "link", "set", &outside, "netns", &hub])?;
            run(
                Some(&hub),
                &["ip", "link", "set", &outside, "master", "br0"],
            )?;
            run(Some(&hub), &["ip", "link", "set", &outside, "up"])?;
            let addr = format!("{}/24", self.ip(id));
            run(Some(&ns), &["ip", "addr", "add", &addr, "dev", &inside])?;
            run(Some(&ns), &["ip", "link", "set", &inside, "up"])?;
            run(Some(&ns), &["ip", "link", "set", "lo", "up"])?;
            run(Some(&ns), &["iptables", "-w", "-F", "INPUT"])?;
        }
        Ok(())
    }

    /// `to` drops every packet from `from` (a one-way cut; both directions of TCP stall).
    fn cut(&self, from: u64, to: u64) -> Result<(), String> {
        let src = self.ip(from);
        run(
            Some(&self.ns(to)),
            &["iptables", "-w", "-A", "INPUT", "-s", &src, "-j", "DROP"],
        )
    }

    fn heal(&self) -> Result<(), String> {
        for id in 1..=self.nodes {
            run(Some(&self.ns(id)), &["iptables", "-w", "-F", "INPUT"])?;
        }
        Ok(())
    }

    fn remove(&self) {
        let _ = run(None, &["ip", "link", "del", &format!("{}r", self.prefix)]);
        for id in 1..=self.nodes {
            let _ = run(None, &["ip", "netns", "del", &self.ns(id)]);
        }
        let _ = run(None, &["ip", "netns", "del", &self.hub()]);
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        self.remove();
    }
}

/// libfaketime, preloaded into lock-node so the nemesis can move its wall clock: each node reads
/// its offset from a file (re-read at most once a second); the monotonic clock is left alone.
struct Clocks {
    library: String,
    dir: std::path::PathBuf,
}

impl Clocks {
    fn find(dir: &std::path::Path) -> Option<Clocks> {
        let library = [
            "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
            "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
            "/usr/lib/faketime/libfaketimeMT.so.1",
        ]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
        Some(Clocks {
            library: library.to_string(),
            dir: dir.to_path_buf(),
        })
    }

    fn file(&self, id: u64) -> std::path::PathBuf {
        self.dir.join(format!("faketime-{id}"))
    }

    /// The environment node `id` runs with; its clock starts true.
    fn env(&self, id: u64) -> Vec<(String, String)> {
        self.set(id, 0);
        vec![
            ("LD_PRELOAD".into(), self.library.clone()),
            (
                "FAKETIME_TIMESTAMP_FILE".into(),
                self.file(id).display().to_string(),
            ),
            ("FAKETIME_CACHE_DURATION".into(), "1".into()),
            ("DONT_FAKE_MONOTONIC".into(), "1".into()),
        ]
    }

    /// Node `id`'s wall clock reads true time + `offset_s` from now on.
    fn set(&self, id: u64, offset_s: i64) {
        std::fs::write(self.file(id), format!("{offset_s:+}\n")).expect("faketime file");
    }
}

/// What the nemesis did, counted for the summary line.
#[derive(Default)]
struct Faults {
    kills: usize,
    wipes: usize,
    pauses: usize,
    partitions: usize,
    clock_jumps: usize,
}

/// Kills node `id`, deletes its data directory and starts it again with `--join` the others'
/// peer addresses in place of `--initial-cluster` (a member of a static cluster that lost its
/// data comes back that way).
async fn wipe_and_rejoin(cluster: &mut Cluster, id: u64) {
    let peers: Vec<String> = cluster
        .nodes
        .iter()
        .filter(|n| n.id != id)
        .map(|n| n.peer_addr())
        .collect();
    let node = cluster.node(id);
    node.kill();
    let _ = std::fs::remove_dir_all(&node.data_dir);
    if let Some(at) = node
        .extra_args
        .iter()
        .position(|a| a == "--initial-cluster")
    {
        node.extra_args
            .splice(at..at + 2, ["--join".to_string(), peers.join(",")]);
    }
    node.start();
}

/// Whether the leader's configuration has all three nodes as voters and no learner.
async fn voters_everywhere(cluster: &Cluster) -> bool {
    let Some(leader) = current_leader(cluster).await else {
        return false;
    };
    let Ok(Ok(status)) = tokio::time::timeout(
        Duration::from_secs(1),
        http_json(&cluster.client_addr_of(leader), "/status"),
    )
    .await
    else {
        return false;
    };
    status["voters"].as_array().map_or(0, |v| v.len()) == 3
        && status["learners"].as_array().is_none_or(|l| l.is_empty())
}

/// Whether node `id` answers `/status` with itself among three voters and no learner (a new
/// incarnation answers only once it has joined, and names itself a voter once its promotion is
/// applied).
async fn sees_itself_a_voter(cluster: &Cluster, id: u64) -> bool {
    let Ok(Ok(status)) = tokio::time::timeout(
        Duration::from_secs(1),
        http_json(&cluster.client_addr_of(id), "/status"),
    )
    .await
    else {
        return false;
    };
    let voters = status["voters"].as_array().cloned().unwrap_or_default();
    voters.len() == 3
        && voters.iter().any(|v| v.as_u64() == Some(id))
        && status["learners"].as_array().is_none_or(|l| l.is_empty())
}

/// The node that says it leads, if one does within a second.
async fn current_leader(cluster: &Cluster) -> Option<u64> {
    for node in cluster.nodes.iter().filter(|n| n.child.is_some()) {
        let status = tokio::time::timeout(
            Duration::from_secs(1),
            http_json(&node.client_addr(), "/status"),
        )
        .await;
        if let Ok(Ok(status)) = status {
            if status["role"] == "leader" {
                return Some(node.id);
            }
        }
    }
    None
}

/// A wait given up: the raw client asks for the lock, then cancels the request (commandType 6)
/// `cancel_after` later on the same connection. If the grant came first, the client held the
/// lock from the grant's answer (recorded as a hold, believed until its lease minus a fifth) and
/// releases it at once; a cancelled wait must never turn into a grant afterwards.
async fn cancelled_wait(
    id: usize,
    n: u64,
    node: &str,
    cancel_after: Duration,
    history: &Mutex<History>,
) {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let client = format!("raw{id}");
    let request_id = format!("raw{id}-{n}-c");
    let url = format!("ws://{node}/ws");
    let Ok(Ok((mut ws, _))) = tokio::time::timeout(
        Duration::from_secs(2),
        tokio_tungstenite::connect_async(url),
    )
    .await
    else {
        return;
    };
    let acquire = json!({"commandType": 3, "key": KEY, "clientId": client,
                         "requestId": request_id, "ttl": TTL.as_millis() as u64,
                         "waitTimeout": 3000});
    let sent = Instant::now();
    if ws
        .send(Message::Text(acquire.to_string().into()))
        .await
        .is_err()
    {
        return;
    }
    history.lock().unwrap().ops += 1;
    let cancel = json!({"commandType": 6, "key": KEY, "clientId": client,
                        "requestId": request_id});
    let mut cancel_sent = false;
    let mut grant: Option<(u64, Instant, Instant)> = None;
    let mut cancelled = false;
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        let wait = if cancel_sent {
            give_up.saturating_duration_since(Instant::now())
        } else {
            cancel_after
        };
        match tokio::time::timeout(wait, ws.next()).await {
            Err(_) if !cancel_sent => {
                cancel_sent = ws
                    .send(Message::Text(cancel.to_string().into()))
                    .await
                    .is_ok();
                history.lock().unwrap().ops += 1;
                if !cancel_sent {
                    break;
                }
            }
            Ok(Some(Ok(frame))) => {
                let Ok(reply) = serde_json::from_str::<Value>(frame.to_text().unwrap_or("")) else {
                    continue;
                };
                if let Some(token) = reply["fencingToken"]["value"].as_u64() {
                    if reply["success"] == true && grant.is_none() {
                        if cancelled {
                            history.lock().unwrap().cancel_violations.push(format!(
                                "raw{id}: request {request_id} was granted token {token} after \
                                 its wait was cancelled"
                            ));
                        }
                        let left = reply["expiresInMs"].as_u64().unwrap_or(0);
                        let lease_end =
                            sent + Duration::from_millis(left.min(TTL.as_millis() as u64));
                        let start = Instant::now();
                        let until = lease_end.checked_sub(TTL / 5).unwrap_or(start).max(start);
                        grant = Some((token, start, until));
                        if !cancel_sent {
                            break;
                        }
                    }
                } else if reply["cancelled"] == true {
                    cancelled = true;
                    history.lock().unwrap().cancels += 1;
                }
                let both = cancel_sent
                    && (cancelled || reply["error"]["code"] == "NOT_WAITING" || grant.is_some());
                if both && (grant.is_some() || cancelled) {
                    break;
                }
            }
            _ => break,
        }
    }
    if let Some((token, start, until)) = grant {
        let end = until.min(Instant::now());
        let release = json!({"commandType": 4, "key": KEY, "clientId": client,
                             "requestId": format!("{request_id}-r"),
                             "fencingToken": {"key": KEY, "value": token}});
        history.lock().unwrap().holds.push(Hold {
            worker: 100 + id,
            token,
            start,
            end,
        });
        history.lock().unwrap().ops += 1;
        let _ = ws.send(Message::Text(release.to_string().into())).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), ws.next()).await;
    }
}

fn signal(node: &NodeProc, sig: &str) {
    if let Some(child) = &node.child {
        let _ = std::process::Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status();
    }
}

/// Faults on a seeded schedule until `stop_at`; at most one fault at a time, each healed before
/// the next. Returns the schedule as text (printed with a failure) and the counts.
async fn nemesis(
    cluster: &mut Cluster,
    lab: Option<&NetLab>,
    clocks: Option<&Clocks>,
    seed: u64,
    stop_at: Instant,
    leader_share_percent: u32,
) -> (Vec<String>, Faults) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut log = Vec::new();
    let mut faults = Faults::default();
    let started = Instant::now();
    while Instant::now() < stop_at {
        tokio::time::sleep(Duration::from_millis(rng.random_range(400..1200))).await;
        let mut id = rng.random_range(1..=3u64);
        // Kills and pauses hit the current leader this often (a leader change in the middle
        // of someone's hold is what lease bugs need); otherwise any node.
        if rng.random_range(0..100) < leader_share_percent {
            id = current_leader(cluster).await.unwrap_or(id);
        }
        let at = started.elapsed().as_millis();
        let mut dice = rng.random_range(0..100);
        // Faults this run cannot make fall back to kills and pauses.
        if (56..82).contains(&dice) && lab.is_none() || dice >= 82 && clocks.is_none() {
            dice %= 56;
        }
        if dice < 6 {
            let down = Duration::from_millis(rng.random_range(200..1000));
            log.push(format!(
                "{at}ms: SIGKILL every node, restart after {down:?}"
            ));
            for id in 1..=3 {
                cluster.node(id).kill();
            }
            faults.kills += 3;
            tokio::time::sleep(down).await;
            for id in 1..=3 {
                cluster.node(id).start();
            }
        } else if dice < 10 {
            // A lost volume: the node starts again on an empty data directory with --join, as
            // a new incarnation of its id; the leader replaces the old one and the node is a
            // voter again. One at a time: the next fault waits until it is back.
            log.push(format!(
                "{at}ms: wipe node {id}'s data directory and restart it"
            ));
            wipe_and_rejoin(cluster, id).await;
            faults.wipes += 1;
            let back = Instant::now() + Duration::from_secs(45);
            loop {
                // The new incarnation itself must see it is a voter: the leader's list alone
                // still names the old incarnation until the replacement is done.
                if voters_everywhere(cluster).await && sees_itself_a_voter(cluster, id).await {
                    log.push(format!(
                        "{}ms: node {id} is a voter again",
                        started.elapsed().as_millis()
                    ));
                    break;
                }
                assert!(
                    Instant::now() < back,
                    "node {id} did not become a voter again within 45 s after its volume was \
                     wiped; schedule so far:\n{}\nits log:\n{}",
                    log.join("\n"),
                    std::fs::read_to_string(cluster.node(id).data_dir.with_extension("log"))
                        .unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        } else if dice < 32 {
            let down = Duration::from_millis(rng.random_range(200..1500));
            log.push(format!("{at}ms: SIGKILL node {id}, restart after {down:?}"));
            cluster.node(id).kill();
            faults.kills += 1;
            tokio::time::sleep(down).await;
            cluster.node(id).start();
        } else if dice < 56 {
            let paused = TTL * 2;
            log.push(format!("{at}ms: SIGSTOP node {id} for {paused:?}"));
            signal(cluster.node(id), "-STOP");
            faults.pauses += 1;
            tokio::time::sleep(paused).await;
            signal(cluster.node(id), "-CONT");
        } else if dice < 82 {
            let lab = lab.expect("partitions only with a lab");
            let held = Duration::from_millis(rng.random_range(500..3000));
            let other = 1 + (id + rng.random_range(0..2u64)) % 3;
            let third = 6 - id - other;
            // (from, to) pairs to cut.
            let (what, cuts): (String, Vec<(u64, u64)>) = match rng.random_range(0..4) {
                0 => (
                    format!("node {id} from node {other}, both ways"),
                    vec![(id, other), (other, id)],
                ),
                1 => (format!("node {id} deaf to node {other}"), vec![(other, id)]),
                2 => {
                    let leader = current_leader(cluster).await.unwrap_or(id);
                    let others: Vec<u64> = (1..=3).filter(|&n| n != leader).collect();
                    (
                        format!("the leader (node {leader}) from everyone"),
                        others
                            .iter()
                            .flat_map(|&n| [(n, leader), (leader, n)])
                            .collect(),
                    )
                }
                _ => (
                    format!("nodes {other} and {third} from each other (node {id} bridges)"),
                    vec![(other, third), (third, other)],
                ),
            };
            log.push(format!("{at}ms: partition {what} for {held:?}"));
            for (from, to) in cuts {
                lab.cut(from, to).expect("partition");
            }
            faults.partitions += 1;
            tokio::time::sleep(held).await;
            lab.heal().expect("heal");
        } else {
            let clocks = clocks.expect("clock jumps only with faketime");
            let offset_s: i64 = rng.random_range(-600..=600);
            log.push(format!(
                "{at}ms: node {id}'s wall clock jumps to true time {offset_s:+} s"
            ));
            clocks.set(id, offset_s);
            faults.clock_jumps += 1;
        }
    }
    (log, faults)
}

fn check(history: &History, accepted: &[(u64, u64)]) -> Result<(), String> {
    if let Some(v) = history.cancel_violations.first() {
        return Err(v.clone());
    }
    // 7: acquire, renew and release are linearizable per key.
    let lin = linearizability::check_all(&history.lin, LIN_DRIFT_PPM);
    if let Some((key, detail)) = lin.violation {
        let ops: Vec<String> = history.lin[&key]
            .iter()
            .map(|op| format!("{op:?}"))
            .collect();
        return Err(format!(
            "the operations on {key} are not linearizable: {detail}; its history (µs):\n    {}",
            ops.join("\n    ")
        ));
    }
    // 1 and 2: hold intervals never overlap; tokens rise in grant order.
    // An answer that arrived after its safety deadline (a paused node delivered it late) gave
    // no belief at all: only non-empty intervals count.
    let mut holds: Vec<Hold> = history
        .holds
        .iter()
        .filter(|h| h.end > h.start)
        .cloned()
        .collect();
    holds.sort_by_key(|h| h.start);
    for pair in holds.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.start < a.end {
            return Err(format!(
                "two clients believed they held {KEY} at once: worker {} (token {}) until \
                 {:?} after worker {} (token {}) got it",
                a.worker,
                a.token,
                a.end - b.start,
                b.worker,
                b.token
            ));
        }
        if b.token <= a.token {
            return Err(format!(
                "token {} granted after token {} (workers {} then {})",
                b.token, a.token, a.worker, b.worker
            ));
        }
    }
    // 3: the accepted writes count 1, 2, 3, … with tokens that never go down.
    for (i, pair) in accepted.windows(2).enumerate() {
        let ((t1, v1), (t2, v2)) = (pair[0], pair[1]);
        if v2 != v1 + 1 || t2 < t1 {
            return Err(format!(
                "accepted write #{} is value {v2} with token {t2} after value {v1} with token \
                 {t1}: an update was lost",
                i + 2
            ));
        }
    }
    if accepted.first().is_some_and(|&(_, v)| v != 1) {
        return Err(format!(
            "the first accepted value is {:?}",
            accepted.first()
        ));
    }
    // 4: every acknowledged write is in the data store's log.
    for w in history.writes.iter().filter(|w| w.acked) {
        if !accepted.contains(&(w.token, w.value)) {
            return Err(format!(
                "worker {}'s acknowledged write of {} with token {} is missing",
                w.worker, w.value, w.token
            ));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_increments_survive_kills_and_pauses() {
    let seconds: u64 = std::env::var("RAFTLOCK_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("RAFTLOCK_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() % 10_000)
                .unwrap_or(0)
        });
    // The nodes inherit the environment: a run on the segment log says so in its replay line.
    let engine = std::env::var("RAFTLOCK_RAFT_LOG_ENGINE")
        .map(|e| format!("RAFTLOCK_RAFT_LOG_ENGINE={e} "))
        .unwrap_or_default();
    let replay = format!(
        "{engine}RAFTLOCK_CHAOS_SEED={seed} RAFTLOCK_CHAOS_SECONDS={seconds} cargo test \
         --release --test chaos -- --nocapture"
    );
    println!("chaos: seed {seed}, {seconds} s of faults (replay the schedule: {replay})");

    let required = |var: &str| std::env::var_os(var).is_some_and(|v| v == "1");
    // A deliberately broken lock-node (built with the `mutations` feature) that the checker must
    // catch: scripts/chaos-mutant.sh.
    let mutant = std::env::var("RAFTLOCK_CHAOS_MUTANT_BIN").ok();
    let mutation = std::env::var("RAFTLOCK_MUTATION").unwrap_or_default();
    if mutant.is_some() {
        println!("chaos: running lock-node with the bug {mutation:?} switched on");
    }
    let lab = match NetLab::create(3) {
        Ok(lab) => Some(lab),
        Err(e) => {
            assert!(
                !required("RAFTLOCK_REQUIRE_NETNS"),
                "network namespaces are required (run as root): {e}"
            );
            println!("chaos: no network namespaces ({e}); no partitions in this run");
            None
        }
    };
    let clock_dir = tempfile::tempdir().expect("tempdir");
    let clocks = Clocks::find(clock_dir.path());
    if clocks.is_none() {
        assert!(
            !required("RAFTLOCK_REQUIRE_FAKETIME"),
            "libfaketime is required (apt-get install faketime)"
        );
        println!("chaos: libfaketime not found (apt-get install faketime); no clock jumps");
    }
    let mut cluster = Cluster::start_custom(
        3,
        |node| {
            if let Some(lab) = &lab {
                node.host = lab.ip(node.id);
                node.wrapper = ["ip", "netns", "exec", &lab.ns(node.id)]
                    .map(String::from)
                    .to_vec();
            }
            if let Some(clocks) = &clocks {
                node.env = clocks.env(node.id);
            }
            if let Some(binary) = &mutant {
                node.binary = binary.into();
                node.env
                    .push(("RAFTLOCK_MUTATION".into(), mutation.clone()));
            }
        },
        // Beyond loopback, lock-node refuses to start without a cluster token.
        |_| vec!["--cluster-token".into(), format!("chaos-{seed}")],
    );
    cluster.wait_for_leader(Duration::from_secs(20)).await;
    let store = DataStoreProc::start().await;
    let endpoints = endpoints(&cluster);
    let history = Arc::new(Mutex::new(History::default()));
    let base = Instant::now();
    let stop_at = base + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for id in 0..WORKERS {
        let client = RaftLockClient::builder()
            .endpoints(endpoints.clone())
            .client_id(format!("chaos-w{id}"))
            // Each id is this worker's alone: its requests are numbered and acknowledge the
            // answers it received, so the faults also hit acknowledged answers.
            .acknowledge_answers(true)
            .request_timeout(Duration::from_secs(2))
            .build()
            .expect("client");
        tasks.push(tokio::spawn(worker(
            id,
            client,
            store.addr.clone(),
            history.clone(),
            stop_at,
            seed,
        )));
    }
    tasks.push(tokio::spawn(raw_worker(
        0,
        endpoints.clone(),
        store.addr.clone(),
        history.clone(),
        stop_at,
        seed,
    )));
    for id in 0..LIN_WORKERS {
        tasks.push(tokio::spawn(lin_worker(
            id,
            endpoints.clone(),
            history.clone(),
            base,
            stop_at,
            seed,
        )));
    }
    // Against a broken build, every kill and pause hits the leader.
    let leader_share_percent = if mutant.is_some() { 100 } else { 50 };
    let (schedule, faults) = nemesis(
        &mut cluster,
        lab.as_ref(),
        clocks.as_ref(),
        seed,
        stop_at,
        leader_share_percent,
    )
    .await;
    // Heal: every node running, resumed and connected (wall clocks stay where they jumped).
    if let Some(lab) = &lab {
        lab.heal().expect("heal");
    }
    for id in 1..=3 {
        signal(cluster.node(id), "-CONT");
        if cluster.node(id).child.is_none() {
            cluster.node(id).start();
        }
    }
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
    }

    // 5: the healed cluster grants again.
    let healed = Instant::now();
    let probe = RaftLockClient::builder()
        .endpoints(endpoints.clone())
        .client_id("chaos-probe")
        .build()
        .expect("client");
    let recovered = tokio::time::timeout(
        Duration::from_secs(15),
        probe.acquire_with(KEY, TTL, Some(Duration::from_secs(14))),
    )
    .await;
    let recovery = healed.elapsed();

    let log = std::fs::read_to_string(store.dir.path().join("writes.log")).unwrap_or_default();
    let accepted: Vec<(u64, u64)> = log
        .lines()
        .filter_map(|line| {
            let mut f = line.split('\t');
            let (key, token, _client, data) = (f.next()?, f.next()?, f.next()?, f.next()?);
            if key != KEY {
                return None;
            }
            let data: String = serde_json::from_str(data).ok()?;
            Some((token.parse().ok()?, data.parse().ok()?))
        })
        .collect();
    let history = history.lock().unwrap();
    println!(
        "chaos: {} holds, {} cancelled waits, {} writes ({} acknowledged, {} accepted in the \
         log), {} acquire errors, {} writes skipped or late at the safety deadline; recovery \
         after healing {:?}",
        history.holds.len(),
        history.cancels,
        history.writes.len(),
        history.writes.iter().filter(|w| w.acked).count(),
        accepted.len(),
        history.acquire_errors,
        history.late_skips,
        recovery
    );
    let lin = linearizability::check_all(&history.lin, LIN_DRIFT_PPM);
    println!(
        "chaos: linearizability: {} keys, {} operations; {} keys checked, {} too large to decide",
        history.lin.len(),
        history.lin.values().map(Vec::len).sum::<usize>(),
        lin.checked,
        lin.unchecked
    );
    let verdict = check(&history, &accepted).and_then(|()| {
        match recovered {
            Ok(Ok(_)) => {}
            other => {
                return Err(format!(
                    "no grant within 15 s of healing: {:?}",
                    other.map(|r| r.map(|_| ()))
                ))
            }
        }
        if accepted.len() < 3 {
            return Err(format!("only {} increments in {seconds} s", accepted.len()));
        }
        Ok(())
    });
    println!(
        "chaos: seed={seed} ops={} partitions={} kills={} wipes={} pauses={} clock_jumps={} violations={}",
        history.ops,
        faults.partitions,
        faults.kills,
        faults.wipes,
        faults.pauses,
        faults.clock_jumps,
        usize::from(verdict.is_err())
    );
    if mutant.is_some() {
        match verdict {
            Err(violation) => {
                println!(
                    "chaos: the checker caught the broken lock-node ({mutation}): {violation}"
                );
                return;
            }
            Ok(()) => panic!(
                "chaos: the broken lock-node ({mutation}) went unnoticed for {seconds} s \
                 (seed {seed}); schedule:\n  {}",
                schedule.join("\n  ")
            ),
        }
    }
    if let Err(violation) = verdict {
        panic!(
            "chaos violation (seed {seed}): {violation}\nnemesis schedule:\n  {}\nreplay the \
             schedule: {replay}",
            schedule.join("\n  ")
        );
    }
}

/// The checker itself: each rule rejects a history that breaks it.
#[test]
fn checker_rejects_each_kind_of_violation() {
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let hold = |worker, token, start, end| Hold {
        worker,
        token,
        start: ms(start),
        end: ms(end),
    };
    let write = |token, value| Write {
        worker: 0,
        token,
        value,
        acked: true,
    };
    let good = History {
        holds: vec![hold(0, 1, 0, 10), hold(1, 2, 10, 20)],
        writes: vec![write(1, 1), write(2, 2)],
        ..History::default()
    };
    assert_eq!(check(&good, &[(1, 1), (2, 2)]), Ok(()));
    let overlap = History {
        holds: vec![hold(0, 1, 0, 15), hold(1, 2, 10, 20)],
        ..History::default()
    };
    assert!(check(&overlap, &[]).unwrap_err().contains("at once"));
    let backwards = History {
        holds: vec![hold(0, 2, 0, 10), hold(1, 1, 10, 20)],
        ..History::default()
    };
    assert!(check(&backwards, &[])
        .unwrap_err()
        .contains("granted after"));
    assert!(check(&good, &[(1, 1), (2, 1)])
        .unwrap_err()
        .contains("lost"));
    assert!(check(&good, &[(1, 1)]).unwrap_err().contains("missing"));
    // Two grants of one key whose answers leave no room for the first lease to run out.
    let grant = |client, invoke, complete, token| LinOp {
        client,
        invoke,
        complete: Some(complete),
        kind: OpKind::Lock(LockOp::Granted {
            token,
            ttl_us: LIN_TTL_MS * 1_000,
        }),
    };
    let mut early = History::default();
    early.lin.insert(
        "lin-0-0".into(),
        vec![grant(0, 0, 1_000, 1), grant(1, 2_000, 300_000, 2)],
    );
    assert!(check(&early, &[]).unwrap_err().contains("not linearizable"));
    let mut later = History::default();
    later.lin.insert(
        "lin-0-0".into(),
        vec![grant(0, 0, 1_000, 1), grant(1, 2_000, 1_200_000, 2)],
    );
    assert_eq!(check(&later, &[]), Ok(()));
}
