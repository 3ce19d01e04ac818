//! `raftlock-bench load`: C concurrent clients take and give back locks on a target for a fixed
//! time, and report throughput and latency percentiles.
//!
//! Workloads: `uncontended` (each client its own key), `contended` (every client on one key;
//! measures hand-off), `mixed` (Zipf-distributed keys over 1000 keys).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use raftlock::client::{RaftLockClient, RetryPolicy};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Raftlock,
    Etcd,
    /// A ZooKeeper ensemble with the Curator-style lock recipe (`peers.rs`).
    Zookeeper,
    /// Redis `SET NX PX` on a server with `appendonly yes`, `appendfsync always`.
    #[value(name = "redis-fsync")]
    #[serde(rename = "redis-fsync")]
    RedisFsync,
    /// Redis `SET NX PX` on a server with Redis's default persistence (no fsync per write).
    #[value(name = "redis-default")]
    #[serde(rename = "redis-default")]
    RedisDefault,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    Uncontended,
    Contended,
    Mixed,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Target::Raftlock => "raftlock",
            Target::Etcd => "etcd",
            Target::Zookeeper => "zookeeper",
            Target::RedisFsync => "redis-fsync",
            Target::RedisDefault => "redis-default",
        })
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Workload::Uncontended => "uncontended",
            Workload::Contended => "contended",
            Workload::Mixed => "mixed",
        })
    }
}

#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub target: Target,
    pub endpoints: Vec<String>,
    pub workload: Workload,
    pub clients: usize,
    pub duration: Duration,
    /// Distinguishes the keys of one run from another's on the same cluster.
    pub run_id: String,
    /// Keep every acquire as (sent, latency) for a timeline (at most `TIMELINE_MAX` of them).
    pub timeline: bool,
    /// RaftLock clients acknowledge the answers they received (`ackBelow`).
    pub acknowledge: bool,
    /// RaftLock only: the clients share this many SDK clients, each one connection with many
    /// requests in flight (client `i` uses connection `i % connections`); 0 gives every client
    /// its own. Clients on one connection are clones of one SDK client, each its own owner.
    pub connections: usize,
}

/// Acquires kept for a timeline, in all clients together.
pub const TIMELINE_MAX: usize = 2_000_000;

/// Latencies in microseconds.
pub struct LoadResult {
    pub grants: u64,
    pub errors: u64,
    pub seconds: f64,
    /// Acquire sent → grant received.
    pub acquire: Histogram<u64>,
    /// Contended only: release sent by one holder → grant received by the next.
    pub handoff: Histogram<u64>,
    /// With `LoadSpec::timeline`: (client, µs from the start to the acquire being sent,
    /// acquire latency in µs), in send order per client; in a contended run (client, µs from
    /// the start to the previous holder's release being sent, hand-off latency in µs).
    pub timeline: Vec<(u32, u64, u64)>,
}

pub fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 3).expect("valid histogram bounds")
}

impl LoadResult {
    pub fn merge(&mut self, other: &LoadResult) {
        self.grants += other.grants;
        self.errors += other.errors;
        self.seconds += other.seconds;
        let _ = self.acquire.add(&other.acquire);
        let _ = self.handoff.add(&other.handoff);
        self.timeline.extend_from_slice(&other.timeline);
    }

    pub fn throughput(&self) -> f64 {
        if self.seconds > 0.0 {
            self.grants as f64 / self.seconds
        } else {
            0.0
        }
    }

    /// The latency that best describes the workload: hand-off when contended, else acquire.
    pub fn main_hist(&self, workload: Workload) -> &Histogram<u64> {
        if workload == Workload::Contended && !self.handoff.is_empty() {
            &self.handoff
        } else {
            &self.acquire
        }
    }
}

/// Zipf(s = 1) over `n` keys by inverse CDF.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize) -> Self {
        let mut cdf = Vec::with_capacity(n);
        let mut sum = 0.0;
        for k in 1..=n {
            sum += 1.0 / k as f64;
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Zipf { cdf }
    }
    fn sample(&self, u: f64) -> usize {
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

fn xorshift(state: &mut u64) -> f64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 11) as f64 / (1u64 << 53) as f64
}

/// One client's lock/unlock primitive for either target.
enum Locker {
    Raftlock(RaftLockClient),
    #[cfg(feature = "etcd")]
    Etcd {
        client: Box<etcd_client::Client>,
        lease: i64,
    },
    #[cfg(feature = "zookeeper")]
    Zookeeper(crate::peers::ZkLocker),
    Redis(crate::peers::RedisLocker),
}

const TTL: Duration = Duration::from_secs(30);

impl Locker {
    async fn connect(spec: &LoadSpec, i: usize) -> Result<Locker, String> {
        match spec.target {
            Target::Raftlock => RaftLockClient::builder()
                .endpoints(spec.endpoints.iter().cloned())
                .client_id(format!("bench-{}-{i}", spec.run_id))
                // The ids are this run's alone, so numbering requests is safe.
                .acknowledge_answers(spec.acknowledge)
                .default_ttl(TTL)
                .request_timeout(Duration::from_secs(10))
                .retry_policy(RetryPolicy {
                    max_elapsed: Duration::from_secs(20),
                    ..RetryPolicy::default()
                })
                .build()
                .map(Locker::Raftlock)
                .map_err(|e| e.to_string()),
            #[cfg(feature = "etcd")]
            Target::Etcd => {
                let mut client = etcd_client::Client::connect(&spec.endpoints, None)
                    .await
                    .map_err(|e| format!("etcd connect: {e}"))?;
                let lease = client
                    .lease_grant(TTL.as_secs() as i64 * 4, None)
                    .await
                    .map_err(|e| format!("etcd lease grant: {e}"))?
                    .id();
                Ok(Locker::Etcd {
                    client: Box::new(client),
                    lease,
                })
            }
            #[cfg(not(feature = "etcd"))]
            Target::Etcd => Err(
                "this raftlock-bench was built without the `etcd` feature (cargo build --release --features etcd)"
                    .into(),
            ),
            #[cfg(feature = "zookeeper")]
            Target::Zookeeper => {
                crate::peers::ZkLocker::connect(&spec.endpoints, seed(spec, i))
                    .await
                    .map(Locker::Zookeeper)
            }
            #[cfg(not(feature = "zookeeper"))]
            Target::Zookeeper => Err(
                "this raftlock-bench was built without the `zookeeper` feature (cargo build --release --features zookeeper)"
                    .into(),
            ),
            Target::RedisFsync | Target::RedisDefault => {
                let addr = spec
                    .endpoints
                    .get(i % spec.endpoints.len().max(1))
                    .ok_or("no Redis endpoint")?;
                crate::peers::RedisLocker::connect(
                    addr,
                    format!("bench-{}-{i}", spec.run_id),
                    seed(spec, i),
                )
                .await
                .map(Locker::Redis)
            }
        }
    }

    /// Takes the lock (waiting as long as needed); returns what `unlock` needs. Targets that
    /// wait in a loop of their own (ZooKeeper, Redis) give up once `stop` is set.
    async fn lock(&mut self, key: &str, stop: &AtomicBool) -> Result<Held, String> {
        match self {
            Locker::Raftlock(c) => c
                .acquire_with(key, TTL, None)
                .await
                .map(Held::Raftlock)
                .map_err(|e| e.to_string()),
            #[cfg(feature = "etcd")]
            Locker::Etcd { client, lease } => client
                .lock(
                    key,
                    Some(etcd_client::LockOptions::new().with_lease(*lease)),
                )
                .await
                .map(|r| Held::Etcd(r.key().to_vec()))
                .map_err(|e| e.to_string()),
            #[cfg(feature = "zookeeper")]
            Locker::Zookeeper(z) => z.lock(key, stop).await.map(Held::Zookeeper),
            Locker::Redis(r) => r
                .lock(key, stop)
                .await
                .map(|(key, token)| Held::Redis { key, token }),
        }
    }

    async fn unlock(&mut self, held: Held) -> Result<(), String> {
        match (self, held) {
            (Locker::Raftlock(_), Held::Raftlock(h)) => {
                h.release().await.map_err(|e| e.to_string())
            }
            #[cfg(feature = "etcd")]
            (Locker::Etcd { client, .. }, Held::Etcd(key)) => client
                .unlock(key)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[cfg(feature = "zookeeper")]
            (Locker::Zookeeper(z), Held::Zookeeper(path)) => z.unlock(&path).await,
            (Locker::Redis(r), Held::Redis { key, token }) => r.unlock(&key, &token).await,
            #[allow(unreachable_patterns)]
            _ => Err("lock handle of another target".into()),
        }
    }
}

enum Held {
    Raftlock(raftlock::client::LockHandle),
    #[cfg(feature = "etcd")]
    Etcd(Vec<u8>),
    /// The path of this client's lock node.
    #[cfg(feature = "zookeeper")]
    Zookeeper(String),
    Redis {
        key: String,
        token: String,
    },
}

/// A per-client seed (the Redis back-off's jitter, ZooKeeper's node id).
fn seed(spec: &LoadSpec, i: usize) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in spec.run_id.bytes().chain((i as u64).to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h ^ u64::from(std::process::id())
}

pub async fn run(spec: &LoadSpec) -> Result<LoadResult, String> {
    if spec.connections > 0 && spec.target != Target::Raftlock {
        return Err("--connections is for RaftLock only".into());
    }
    let mut lockers = Vec::with_capacity(spec.clients);
    for i in 0..spec.clients {
        let shared = match spec.connections {
            0 => None,
            n => lockers.get(i % n),
        };
        let locker = match shared {
            Some(Locker::Raftlock(client)) => Locker::Raftlock(client.clone()),
            _ => Locker::connect(spec, i).await?,
        };
        lockers.push(locker);
    }
    let zipf = Arc::new(Zipf::new(1000));
    let stop = Arc::new(AtomicBool::new(false));
    let epoch = Instant::now();
    // Contended: when (µs since `epoch`) the last release was sent.
    let last_release = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + spec.duration;
    let mut tasks = Vec::new();
    for (i, mut locker) in lockers.into_iter().enumerate() {
        let (stop, zipf, last_release) = (stop.clone(), zipf.clone(), last_release.clone());
        let (workload, run_id) = (spec.workload, spec.run_id.clone());
        let keep = if spec.timeline {
            TIMELINE_MAX / spec.clients.max(1)
        } else {
            0
        };
        tasks.push(tokio::spawn(async move {
            let mut timeline = Vec::new();
            let mut acquire = new_hist();
            let mut handoff = new_hist();
            let (mut grants, mut errors) = (0u64, 0u64);
            let mut rng = 0x2545_F491_4F6C_DD1D ^ ((i as u64 + 1) * 0x9E37_79B9);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                let key = match workload {
                    Workload::Uncontended => format!("bench/{run_id}/u/{i}"),
                    Workload::Contended => format!("bench/{run_id}/c"),
                    Workload::Mixed => {
                        format!("bench/{run_id}/m/{}", zipf.sample(xorshift(&mut rng)))
                    }
                };
                let sent = Instant::now();
                let sent_us = sent.duration_since(epoch).as_micros() as u64;
                let held = match locker.lock(&key, &stop).await {
                    Ok(h) => h,
                    // Given up at the end of the run: the shutdown, not the workload.
                    Err(_) if stop.load(Ordering::Relaxed) || Instant::now() >= deadline => break,
                    Err(_) => {
                        errors += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let granted = Instant::now();
                // Samples from after the deadline would measure the shutdown, not the workload.
                if granted <= deadline {
                    grants += 1;
                    let took = granted.duration_since(sent).as_micros().max(1) as u64;
                    let _ = acquire.record(took);
                    if workload == Workload::Contended {
                        let rel = last_release.load(Ordering::SeqCst);
                        let now_us = granted.duration_since(epoch).as_micros() as u64;
                        if rel > sent_us && now_us > rel {
                            let _ = handoff.record(now_us - rel);
                            // Contended: the timeline holds hand-offs (release sent, latency).
                            if timeline.len() < keep {
                                timeline.push((i as u32, rel, now_us - rel));
                            }
                        }
                    } else if timeline.len() < keep {
                        timeline.push((i as u32, sent_us, took));
                    }
                }
                last_release.store(
                    Instant::now().duration_since(epoch).as_micros() as u64,
                    Ordering::SeqCst,
                );
                if locker.unlock(held).await.is_err() {
                    errors += 1;
                }
            }
            (grants, errors, acquire, handoff, timeline)
        }));
    }
    tokio::time::sleep_until(deadline.into()).await;
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut result = LoadResult {
        grants: 0,
        errors: 0,
        seconds,
        acquire: new_hist(),
        handoff: new_hist(),
        timeline: Vec::new(),
    };
    // A contended client may be waiting in the queue: every client gets until one shared
    // deadline to finish (a wait per client, one after the other, could add up to hours when a
    // lock is stuck, e.g. an etcd lock key left behind by a failed call until its lease ends).
    let finish_by = tokio::time::Instant::now() + Duration::from_secs(30);
    for mut t in tasks {
        match tokio::time::timeout_at(finish_by, &mut t).await {
            Ok(Ok((g, e, a, h, t))) => {
                result.timeline.extend(t);
                result.grants += g;
                result.errors += e;
                let _ = result.acquire.add(&a);
                let _ = result.handoff.add(&h);
            }
            _ => {
                // Still waiting: stop it, so it does not run into the next measurement.
                t.abort();
                result.errors += 1;
            }
        }
    }
    Ok(result)
}

/// Writes the kept acquires as CSV, in the order they were sent.
///
/// In a contended run each row is a hand-off instead: when the previous holder's release was
/// sent, and how long until this client's grant arrived (column `handoff_ms`).
pub fn write_timeline(
    path: &std::path::Path,
    workload: Workload,
    r: &LoadResult,
) -> std::io::Result<()> {
    use std::io::Write;
    let mut rows = r.timeline.clone();
    rows.sort_by_key(|&(_, sent, _)| sent);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    if workload == Workload::Contended {
        writeln!(out, "client,sent_ms,handoff_ms")?;
    } else {
        writeln!(out, "client,sent_ms,acquire_ms")?;
    }
    for (client, sent, took) in rows {
        writeln!(out, "{client},{:.3},{:.3}", ms(sent), ms(took))?;
    }
    out.flush()
}

pub fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

pub fn print_result(spec: &LoadSpec, r: &LoadResult) {
    let h = &r.acquire;
    println!(
        "{} {} clients={} grants={} errors={} throughput={:.0}/s acquire p50={:.2}ms p99={:.2}ms p99.9={:.2}ms",
        spec.target,
        spec.workload,
        spec.clients,
        r.grants,
        r.errors,
        r.throughput(),
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.99)),
        ms(h.value_at_quantile(0.999)),
    );
    if spec.workload == Workload::Contended && !r.handoff.is_empty() {
        println!(
            "  hand-off (release sent -> next grant) p50={:.2}ms p99={:.2}ms p99.9={:.2}ms",
            ms(r.handoff.value_at_quantile(0.5)),
            ms(r.handoff.value_at_quantile(0.99)),
            ms(r.handoff.value_at_quantile(0.999)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_is_written_in_send_order() {
        let mut r = LoadResult {
            grants: 3,
            errors: 0,
            seconds: 1.0,
            acquire: new_hist(),
            handoff: new_hist(),
            timeline: vec![(1, 2_500, 700), (0, 1_000, 1_250), (1, 4_000, 900)],
        };
        let other = LoadResult {
            timeline: vec![(2, 3_000, 15_000)],
            ..LoadResult {
                grants: 1,
                errors: 0,
                seconds: 1.0,
                acquire: new_hist(),
                handoff: new_hist(),
                timeline: Vec::new(),
            }
        };
        r.merge(&other);
        let path = std::env::temp_dir().join(format!("timeline-{}.csv", std::process::id()));
        write_timeline(&path, Workload::Uncontended, &r).expect("written");
        let text = std::fs::read_to_string(&path).expect("read back");
        let _ = std::fs::remove_file(&path);
        assert_eq!(
            text,
            "client,sent_ms,acquire_ms\n0,1.000,1.250\n1,2.500,0.700\n2,3.000,15.000\n1,4.000,0.900\n"
        );
    }
}
