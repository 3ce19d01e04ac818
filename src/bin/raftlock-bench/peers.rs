//! The peers of `raftlock-bench compare` beside etcd: a three-node ZooKeeper ensemble with the
//! Curator-style lock recipe, and a single Redis with `SET NX PX` and a compare-and-delete
//! release, each started here on 127.0.0.1 with its data under the run's scratch directory.
//!
//! ZooKeeper's lock (the recipe of ZooKeeper's documentation, as Curator's `InterProcessMutex`
//! names its nodes): an ephemeral sequential node `_c_<uuid>-lock-<sequence>` under the lock's
//! path; the client whose node has the lowest sequence holds the lock, every other one watches
//! the node just before its own and looks again when that one goes; release deletes the node.
//!
//! Redis's lock: `SET key token NX PX ttl` to take it, and a Lua script (`EVAL`) that deletes the
//! key only if it still holds this client's token to give it back. Redis has no wait queue: a
//! client that finds the key taken sleeps and tries again, [`REDIS_BACKOFF_FIRST`] at first,
//! doubling up to [`REDIS_BACKOFF_MAX`], each sleep drawn from [1×, 2×) of that step.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::compare::{free_ports, Procs};

/// How long a holder keeps a Redis lock if it never gives it back (`PX`), and the ZooKeeper
/// session timeout asked for; the same 30 s as the RaftLock and etcd clients' TTL.
pub const LOCK_TTL: Duration = Duration::from_secs(30);

/// A contended Redis client's first sleep before it tries `SET NX` again.
pub const REDIS_BACKOFF_FIRST: Duration = Duration::from_millis(1);
/// The longest step of that sleep (it doubles after each failed try, reset by a grant).
pub const REDIS_BACKOFF_MAX: Duration = Duration::from_millis(8);
/// One acquire gives up after this long (as the RaftLock SDK's retries do).
pub const GIVE_UP_AFTER: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// Redis: the server, and a small RESP client (the few commands the lock needs).

/// How a Redis server writes its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedisDurability {
    /// `appendonly yes`, `appendfsync always`: every write is in the AOF and fsynced before the
    /// answer.
    FsyncAlways,
    /// Redis's defaults: no AOF, RDB snapshots now and then (`save 3600 1 300 100 60 10000`).
    Default,
}

impl RedisDurability {
    pub fn flags(self) -> &'static [&'static str] {
        match self {
            RedisDurability::FsyncAlways => &["--appendonly", "yes", "--appendfsync", "always"],
            RedisDurability::Default => &[],
        }
    }
}

/// Starts one Redis server on 127.0.0.1 with its files in `dir`; returns its address.
pub fn start_redis(
    dir: &Path,
    procs: &mut Procs,
    name: &str,
    durability: RedisDurability,
) -> Result<String, String> {
    let port = free_ports(1)?[0];
    let data = dir.join(name);
    std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
    let log = std::fs::File::create(dir.join(format!("{name}.log")))
        .map_err(|e| format!("redis log: {e}"))?;
    let child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args(["--dir", &data.display().to_string()])
        .args(["--daemonize", "no", "--loglevel", "warning"])
        .args(durability.flags())
        .stdout(log)
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start redis-server (apt-get install redis-server): {e}"))?;
    procs.0.push(child);
    Ok(format!("127.0.0.1:{port}"))
}

/// One RESP value as Redis answers it (RESP2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Integer(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Resp>>),
}

/// A command as RESP: an array of bulk strings.
pub fn encode_command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Reads one RESP value; nested arrays at most 8 deep, bulk strings at most 64 MiB.
pub async fn read_resp<R: AsyncBufReadExt + Unpin + Send>(r: &mut R) -> Result<Resp, String> {
    read_resp_depth(r, 0).await
}

fn read_resp_depth<'a, R: AsyncBufReadExt + Unpin + Send>(
    r: &'a mut R,
    depth: usize,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Resp, String>> + Send + 'a>> {
    Box::pin(async move {
        let mut line = Vec::new();
        let n = r
            .read_until(b'\n', &mut line)
            .await
            .map_err(|e| format!("redis: {e}"))?;
        if n == 0 {
            return Err("redis closed the connection".into());
        }
        if line.len() < 3 || !line.ends_with(b"\r\n") {
            return Err(format!(
                "redis: malformed line {:?}",
                String::from_utf8_lossy(&line)
            ));
        }
        let body = std::str::from_utf8(&line[1..line.len() - 2])
            .map_err(|_| "redis: line is not UTF-8".to_string())?;
        let int = |s: &str| {
            s.parse::<i64>()
                .map_err(|_| format!("redis: bad number {s:?}"))
        };
        match line[0] {
            b'+' => Ok(Resp::Simple(body.to_string())),
            b'-' => Ok(Resp::Error(body.to_string())),
            b':' => Ok(Resp::Integer(int(body)?)),
            b'$' => {
                let len = int(body)?;
                if len < 0 {
                    return Ok(Resp::Bulk(None));
                }
                if len > 64 << 20 {
                    return Err(format!("redis: bulk string of {len} bytes"));
                }
                let mut data = vec![0u8; len as usize + 2];
                r.read_exact(&mut data)
                    .await
                    .map_err(|e| format!("redis: {e}"))?;
                if !data.ends_with(b"\r\n") {
                    return Err("redis: bulk string without CRLF".into());
                }
                data.truncate(len as usize);
                Ok(Resp::Bulk(Some(data)))
            }
            b'*' => {
                let len = int(body)?;
                if len < 0 {
                    return Ok(Resp::Array(None));
                }
                if depth >= 8 || len > 1 << 20 {
                    return Err("redis: array too deep or too long".into());
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(read_resp_depth(r, depth + 1).await?);
                }
                Ok(Resp::Array(Some(items)))
            }
            other => Err(format!("redis: unknown reply type {:?}", other as char)),
        }
    })
}

/// One connection to a Redis server, one command at a time.
pub struct RedisConn {
    stream: BufReader<TcpStream>,
}

impl RedisConn {
    pub async fn connect(addr: &str) -> Result<RedisConn, String> {
        let s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("redis connect {addr}: {e}"))?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        Ok(RedisConn {
            stream: BufReader::new(s),
        })
    }

    pub async fn command(&mut self, args: &[&[u8]]) -> Result<Resp, String> {
        self.stream
            .get_mut()
            .write_all(&encode_command(args))
            .await
            .map_err(|e| format!("redis: {e}"))?;
        match read_resp(&mut self.stream).await? {
            Resp::Error(e) => Err(format!("redis: {e}")),
            v => Ok(v),
        }
    }
}

/// Deletes the key only if it still holds this client's token: 1 if deleted, else 0.
pub const REDIS_RELEASE: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";

/// One load client's Redis lock.
pub struct RedisLocker {
    conn: RedisConn,
    /// Unique to this client; each grant's token adds a counter.
    owner: String,
    grants: u64,
    rng: u64,
}

impl RedisLocker {
    pub async fn connect(addr: &str, owner: String, seed: u64) -> Result<RedisLocker, String> {
        Ok(RedisLocker {
            conn: RedisConn::connect(addr).await?,
            owner,
            grants: 0,
            rng: seed | 1,
        })
    }

    /// Takes the lock, trying again after a back-off while another client holds it; gives up
    /// after [`GIVE_UP_AFTER`] or when `stop` is set. Returns the key and the token.
    pub async fn lock(&mut self, key: &str, stop: &AtomicBool) -> Result<(String, String), String> {
        self.grants += 1;
        let token = format!("{}-{}", self.owner, self.grants);
        let ttl = LOCK_TTL.as_millis().to_string();
        let give_up = Instant::now() + GIVE_UP_AFTER;
        let mut step = REDIS_BACKOFF_FIRST;
        loop {
            let answer = self
                .conn
                .command(&[
                    b"SET",
                    key.as_bytes(),
                    token.as_bytes(),
                    b"NX",
                    b"PX",
                    ttl.as_bytes(),
                ])
                .await?;
            match answer {
                Resp::Simple(ok) if ok == "OK" => return Ok((key.to_string(), token)),
                Resp::Bulk(None) => {}
                other => return Err(format!("redis SET NX answered {other:?}")),
            }
            if stop.load(Ordering::Relaxed) || Instant::now() >= give_up {
                return Err("redis: gave up waiting for the lock".into());
            }
            tokio::time::sleep(backoff_sleep(step, &mut self.rng)).await;
            step = (step * 2).min(REDIS_BACKOFF_MAX);
        }
    }

    pub async fn unlock(&mut self, key: &str, token: &str) -> Result<(), String> {
        match self
            .conn
            .command(&[
                b"EVAL",
                REDIS_RELEASE.as_bytes(),
                b"1",
                key.as_bytes(),
                token.as_bytes(),
            ])
            .await?
        {
            Resp::Integer(1) => Ok(()),
            other => Err(format!(
                "redis release answered {other:?} (the lock had expired)"
            )),
        }
    }
}

/// A sleep drawn from [step, 2 × step).
pub fn backoff_sleep(step: Duration, rng: &mut u64) -> Duration {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    let unit = (*rng >> 11) as f64 / (1u64 << 53) as f64;
    step.mul_f64(1.0 + unit)
}

/// `redis_version` from the server's `INFO server`.
pub async fn redis_version(addr: &str) -> Result<String, String> {
    let mut c = RedisConn::connect(addr).await?;
    let Resp::Bulk(Some(info)) = c.command(&[b"INFO", b"server"]).await? else {
        return Err("redis INFO: no text".into());
    };
    String::from_utf8_lossy(&info)
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map(|v| format!("Redis {}", v.trim()))
        .ok_or_else(|| "redis INFO: no redis_version".into())
}

// ---------------------------------------------------------------------------------------------
// ZooKeeper: the ensemble, and the lock recipe.

/// Where Debian's `zookeeper` package puts the server's jar (its manifest names the rest).
pub const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

/// The settings every node gets beyond its addresses and directories: ZooKeeper's defaults for
/// timing (tickTime 2000 ms, initLimit 10, syncLimit 5) and for the log (`forceSync=yes`: every
/// transaction log write is fsynced before the write is acknowledged; snapCount 100,000), no
/// limit on connections from one address (its default of 60 would refuse most of 512 clients on
/// 127.0.0.1), the admin HTTP server off, and the `srvr` command for the version and the mode.
pub const ZOOKEEPER_SETTINGS: &[&str] = &[
    "tickTime=2000",
    "initLimit=10",
    "syncLimit=5",
    "forceSync=yes",
    "snapCount=100000",
    "maxClientCnxns=0",
    "admin.enableServer=false",
    "4lw.commands.whitelist=srvr",
];

/// The JVM's heap per node, fixed so it is not resized under load (ZooKeeper's advice: a heap
/// that fits in memory, never swapped).
pub const ZOOKEEPER_HEAP: &str = "1g";

/// Starts a ZooKeeper ensemble of `nodes` on 127.0.0.1, each node with its own zoo.cfg, data
/// directory and transaction log directory under `dir`; returns the client addresses.
pub fn start_zookeeper(dir: &Path, procs: &mut Procs, nodes: usize) -> Result<Vec<String>, String> {
    if !Path::new(ZOOKEEPER_JAR).exists() {
        return Err(format!(
            "{ZOOKEEPER_JAR} not found (apt-get install zookeeper)"
        ));
    }
    let ports = free_ports(3 * nodes)?;
    let servers: Vec<String> = (0..nodes)
        .map(|i| {
            format!(
                "server.{}=127.0.0.1:{}:{}",
                i + 1,
                ports[nodes + i],
                ports[2 * nodes + i]
            )
        })
        .collect();
    for (i, client_port) in ports[..nodes].iter().enumerate() {
        let home = dir.join(format!("zookeeper-{}", i + 1));
        let (data, txlog) = (home.join("data"), home.join("txlog"));
        for d in [&data, &txlog] {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        std::fs::write(data.join("myid"), format!("{}\n", i + 1))
            .map_err(|e| format!("myid: {e}"))?;
        let mut cfg = ZOOKEEPER_SETTINGS.join("\n");
        cfg.push_str(&format!(
            "\ndataDir={}\ndataLogDir={}\nclientPort={}\nclientPortAddress=127.0.0.1\n{}\n",
            data.display(),
            txlog.display(),
            client_port,
            servers.join("\n")
        ));
        let cfg_path = home.join("zoo.cfg");
        std::fs::write(&cfg_path, cfg).map_err(|e| format!("zoo.cfg: {e}"))?;
        let log = std::fs::File::create(dir.join(format!("zookeeper-{}.log", i + 1)))
            .map_err(|e| format!("zookeeper log: {e}"))?;
        let child = Command::new("java")
            .arg(format!("-Xms{ZOOKEEPER_HEAP}"))
            .arg(format!("-Xmx{ZOOKEEPER_HEAP}"))
            .args(["-cp", ZOOKEEPER_JAR])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(&cfg_path)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start java for ZooKeeper: {e}"))?;
        procs.0.push(child);
    }
    Ok(ports[..nodes]
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect())
}

/// A ZooKeeper node's answer to the `srvr` four-letter command.
pub async fn zookeeper_srvr(addr: &str) -> Result<String, String> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("zookeeper {addr}: {e}"))?;
    s.write_all(b"srvr").await.map_err(|e| e.to_string())?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .map_err(|_| "zookeeper srvr: no answer".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(out)
}

/// "ZooKeeper 3.8.0" from a `srvr` answer ("Zookeeper version: 3.8.0-<commit>, built on …").
pub fn zookeeper_version(srvr: &str) -> Option<String> {
    let v = srvr
        .lines()
        .find_map(|l| l.strip_prefix("Zookeeper version:"))?
        .split(',')
        .next()?
        .trim();
    // The commit id follows a dash (Debian's build leaves it unexpanded: "-${mvngit.commit.id}").
    let v = v.split('-').next().unwrap_or(v);
    Some(format!("ZooKeeper {v}"))
}

/// The lock node names Curator uses: `_c_<uuid>-lock-<10-digit sequence>`.
// The recipe itself needs the `zookeeper` feature; its unit tests run in every build.
#[cfg_attr(not(feature = "zookeeper"), allow(dead_code))]
pub const ZK_LOCK_NAME: &str = "lock-";

/// The sequence of a lock node's name, if it is one.
#[cfg_attr(not(feature = "zookeeper"), allow(dead_code))]
fn zk_sequence(name: &str) -> Option<u64> {
    let at = name.rfind(ZK_LOCK_NAME)?;
    let seq = &name[at + ZK_LOCK_NAME.len()..];
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    seq.parse().ok()
}

/// Where `mine` stands among the lock's `children`: `Ok(None)` if it has the lowest sequence
/// (it holds the lock), else `Ok(Some(the name just before it))`, the node to watch. Names that
/// are no lock nodes are left out; `Err` if `mine` is not among them.
#[cfg_attr(not(feature = "zookeeper"), allow(dead_code))]
pub fn zk_predecessor<'a>(children: &'a [String], mine: &str) -> Result<Option<&'a str>, String> {
    let my_seq = zk_sequence(mine).ok_or_else(|| format!("{mine} is no lock node"))?;
    if !children.iter().any(|c| c == mine) {
        return Err(format!("{mine} is gone from the lock's children"));
    }
    Ok(children
        .iter()
        .filter_map(|c| Some((zk_sequence(c)?, c.as_str())))
        .filter(|&(s, _)| s < my_seq)
        .max_by_key(|&(s, _)| s)
        .map(|(_, c)| c))
}

#[cfg(feature = "zookeeper")]
pub use zk::ZkLocker;

#[cfg(feature = "zookeeper")]
mod zk {
    use super::*;
    use zookeeper_client::{Acls, Client, CreateMode, Error};

    /// One load client's ZooKeeper session and lock.
    pub struct ZkLocker {
        client: Client,
        /// This client's part of its nodes' names (Curator's protection id).
        id: String,
    }

    impl ZkLocker {
        pub async fn connect(endpoints: &[String], seed: u64) -> Result<ZkLocker, String> {
            let client = Client::connector()
                .with_session_timeout(LOCK_TTL)
                .connect(&endpoints.join(","))
                .await
                .map_err(|e| format!("zookeeper connect: {e}"))?;
            // Two 64-bit draws (splitmix64) shaped like Curator's uuid.
            let mix = |mut z: u64| {
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^ (z >> 31)
            };
            let (a, b) = (mix(seed), mix(seed.wrapping_add(0x9e37_79b9_7f4a_7c15)));
            let id = format!(
                "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                a >> 32,
                (a >> 16) & 0xffff,
                a & 0xffff,
                b >> 48,
                b & 0xffff_ffff_ffff
            );
            Ok(ZkLocker { client, id })
        }

        /// The lock's directory for a benchmark key.
        fn dir(key: &str) -> String {
            format!("/{key}")
        }

        /// Creates `dir` and its ancestors as persistent nodes where missing.
        async fn make_dirs(&self, dir: &str) -> Result<(), String> {
            let opts = CreateMode::Persistent.with_acls(Acls::anyone_all());
            let ends = dir
                .match_indices('/')
                .map(|(i, _)| i)
                .filter(|&i| i > 0)
                .chain([dir.len()]);
            for end in ends {
                match self.client.create(&dir[..end], b"", &opts).await {
                    Ok(_) | Err(Error::NodeExists) => {}
                    Err(e) => return Err(format!("zookeeper create {}: {e}", &dir[..end])),
                }
            }
            Ok(())
        }

        /// Takes the lock: an ephemeral sequential node, then wait until it is the lowest.
        /// Gives up after [`GIVE_UP_AFTER`] or when `stop` is set (deleting its node).
        pub async fn lock(&mut self, key: &str, stop: &AtomicBool) -> Result<String, String> {
            let dir = Self::dir(key);
            let prefix = format!("{dir}/_c_{}-{ZK_LOCK_NAME}", self.id);
            let opts = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
            let sequence = match self.client.create(&prefix, b"", &opts).await {
                Ok((_, seq)) => seq,
                Err(Error::NoNode) => {
                    self.make_dirs(&dir).await?;
                    self.client
                        .create(&prefix, b"", &opts)
                        .await
                        .map_err(|e| format!("zookeeper create: {e}"))?
                        .1
                }
                Err(e) => return Err(format!("zookeeper create: {e}")),
            };
            let path = format!("{prefix}{sequence}");
            let mine = path[dir.len() + 1..].to_string();
            let give_up = Instant::now() + GIVE_UP_AFTER;
            let result = async {
                loop {
                    let children = self
                        .client
                        .list_children(&dir)
                        .await
                        .map_err(|e| format!("zookeeper children: {e}"))?;
                    let Some(before) = zk_predecessor(&children, &mine)? else {
                        return Ok(());
                    };
                    let watched = format!("{dir}/{before}");
                    match self.client.check_and_watch_stat(&watched).await {
                        // Gone between the listing and the watch: look again.
                        Ok((None, _)) => continue,
                        Ok((Some(_), watcher)) => {
                            let left = give_up.saturating_duration_since(Instant::now());
                            if tokio::time::timeout(left, watcher.changed()).await.is_err()
                                || stop.load(Ordering::Relaxed)
                            {
                                return Err("zookeeper: gave up waiting for the lock".into());
                            }
                        }
                        Err(e) => return Err(format!("zookeeper watch: {e}")),
                    }
                }
            }
            .await;
            match result {
                Ok(()) => Ok(path),
                Err(e) => {
                    let _ = self.client.delete(&path, None).await;
                    Err(e)
                }
            }
        }

        pub async fn unlock(&mut self, path: &str) -> Result<(), String> {
            self.client
                .delete(path, None)
                .await
                .map_err(|e| format!("zookeeper delete {path}: {e}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn resp_replies_are_read() {
        let wire: &[u8] =
            b"+OK\r\n$-1\r\n:1\r\n-ERR wrong\r\n$5\r\nab\r\nc\r\n*2\r\n$1\r\nx\r\n:7\r\n*-1\r\n";
        let mut r = BufReader::new(wire);
        assert_eq!(read_resp(&mut r).await, Ok(Resp::Simple("OK".into())));
        assert_eq!(read_resp(&mut r).await, Ok(Resp::Bulk(None)));
        assert_eq!(read_resp(&mut r).await, Ok(Resp::Integer(1)));
        assert_eq!(read_resp(&mut r).await, Ok(Resp::Error("ERR wrong".into())));
        // A bulk string may hold CR LF itself: its length, not the line, ends it.
        assert_eq!(
            read_resp(&mut r).await,
            Ok(Resp::Bulk(Some(b"ab\r\nc".to_vec())))
        );
        assert_eq!(
            read_resp(&mut r).await,
            Ok(Resp::Array(Some(vec![
                Resp::Bulk(Some(b"x".to_vec())),
                Resp::Integer(7)
            ])))
        );
        assert_eq!(read_resp(&mut r).await, Ok(Resp::Array(None)));
        assert!(read_resp(&mut r).await.is_err(), "end of stream");
        let mut bad = BufReader::new(&b"?x\r\n"[..]);
        assert!(read_resp(&mut bad).await.is_err());
    }

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        assert_eq!(
            encode_command(&[b"SET", b"k", b"v 1", b"NX", b"PX", b"30000"]),
            b"*6\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv 1\r\n$2\r\nNX\r\n$2\r\nPX\r\n$5\r\n30000\r\n"
                .to_vec()
        );
    }

    #[test]
    fn backoff_stays_within_its_step() {
        let mut rng = 12345;
        let step = Duration::from_millis(4);
        for _ in 0..1000 {
            let d = backoff_sleep(step, &mut rng);
            assert!(d >= step && d < step * 2, "{d:?}");
        }
    }

    #[test]
    fn the_lowest_sequence_holds_and_each_other_watches_the_one_before() {
        let names: Vec<String> = [
            "_c_bbb-lock-0000000012",
            "_c_aaa-lock-0000000003",
            "unrelated",
            "_c_ccc-lock-0000000007",
            "_c_ddd-lock-0000000100",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(zk_predecessor(&names, "_c_aaa-lock-0000000003"), Ok(None));
        assert_eq!(
            zk_predecessor(&names, "_c_ccc-lock-0000000007"),
            Ok(Some("_c_aaa-lock-0000000003"))
        );
        assert_eq!(
            zk_predecessor(&names, "_c_bbb-lock-0000000012"),
            Ok(Some("_c_ccc-lock-0000000007"))
        );
        // Sequences compare as numbers, not by the uuid before them.
        assert_eq!(
            zk_predecessor(&names, "_c_ddd-lock-0000000100"),
            Ok(Some("_c_bbb-lock-0000000012"))
        );
        assert!(zk_predecessor(&names, "_c_eee-lock-0000000200").is_err());
        assert!(zk_predecessor(&names, "unrelated").is_err());
    }

    #[test]
    fn zookeeper_version_from_srvr() {
        let srvr = "Zookeeper version: 3.8.0-${mvngit.commit.id}, built on 2024-12-29 17:54 UTC\nMode: follower\n";
        assert_eq!(zookeeper_version(srvr).as_deref(), Some("ZooKeeper 3.8.0"));
        assert_eq!(
            zookeeper_version("Zookeeper version: 3.9.2-e454e8c7283100c7caec6dcae2bc82aaecb63023, built on 2024-02-12 20:59 UTC").as_deref(),
            Some("ZooKeeper 3.9.2")
        );
    }
}
