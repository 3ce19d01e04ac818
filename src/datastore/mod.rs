//! The data store: the resource RaftLock protects. It accepts a write only with a fencing token at
//! least as high as any it has seen for that lock key (equal = the same holder writing again), so
//! a paused or partitioned former holder cannot overwrite the work of the next one. A read-write
//! lock's reader never writes (its token is refused); its writer writes as a lock's holder does.
//! A semaphore's permit writes to the record of its slot, `<key>#<slot>`, fenced per slot.
//!
//! What makes a token believable, strongest first:
//! - a fencing key (`with_fencing_key`): the token must carry the lock service's MAC;
//! - else a lock cluster to ask (`with_lock_cluster`): a token above the highest accepted for its
//!   key must be the current holder's token there, or the write is refused — also when the
//!   cluster cannot be asked (fail closed);
//! - else nothing: any value is taken (unprotected; the binary warns at start).
//!
//! With a client token (`with_client_token`), `POST /write`, `POST /` and `GET /data` also need
//! `Authorization: Bearer <token>`.
//!
//! Every accepted write is appended to the log (`log`) and flushed before the answer; on
//! restart the log rebuilds the highest token per key. Memory holds, per key, the highest token
//! and where the key's last line is, and the metadata of a bounded number of recent writes —
//! never their data: `GET /data` reads a page of data back from the log. The log is compacted to
//! the last write of every key once it outgrows its live content.
//!
//! `POST /write` and `POST /` (seed 000's client names no path) take the same JSON body.

pub mod cli;
pub mod lock_cluster;
pub mod log;

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use serde::Deserialize;
use serde_json::{json, Map, Value};

pub use lock_cluster::{LockCluster, Verdict};
use log::Loc;

/// Limits on what one write may carry, and on what the store keeps and serves.
#[derive(Clone, Debug)]
pub struct DataStoreLimits {
    pub max_key_bytes: usize,
    pub max_client_id_bytes: usize,
    pub max_data_bytes: usize,
    pub max_keys: usize,
    /// Recent writes whose metadata (not data) is kept for `GET /data`.
    pub recent_writes: usize,
    /// Records in one `GET /data` page when `limit` is not given, and at most.
    pub page_records_default: usize,
    pub page_records_max: usize,
    /// Bytes of data (plus metadata) in one page, at most; a page holds at least one write.
    pub page_bytes_max: usize,
    /// The log is compacted once it is larger than this and than `compact_ratio` times its live
    /// content (the last line of every key).
    pub compact_min_bytes: u64,
    pub compact_ratio: u64,
}

impl Default for DataStoreLimits {
    fn default() -> Self {
        DataStoreLimits {
            max_key_bytes: 512,
            max_client_id_bytes: 256,
            max_data_bytes: 64 * 1024,
            max_keys: 1_000_000,
            recent_writes: 10_000,
            page_records_default: 100,
            page_records_max: 1_000,
            page_bytes_max: 1 << 20,
            compact_min_bytes: 64 << 20,
            compact_ratio: 4,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DataStoreError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} line {line} is malformed: {reason}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error(transparent)]
    Locked(#[from] log::LockError),
}

/// Per key: the highest token accepted and where the key's last line is (it carries that token).
struct KeyState {
    token: u64,
    loc: Loc,
}

/// What `GET /data` knows of a recent write without reading the log.
#[derive(Clone)]
struct RecentWrite {
    seq: u64,
    key: String,
    token: u64,
    client: String,
    data_bytes: usize,
    /// Unix milliseconds when accepted; unknown for writes replayed at start.
    time_ms: Option<u64>,
    /// Its line in the current log; `None` once compaction dropped it (a later write of the key
    /// superseded it).
    loc: Option<Loc>,
}

struct Inner {
    path: PathBuf,
    keys: HashMap<String, KeyState>,
    /// The log, opened for appending and reading. Shared so a page of `GET /data` can be read
    /// without the mutex; after a compaction it is a new file, and a reader holding the old one
    /// still reads the (unlinked) file its places refer to.
    file: Arc<File>,
    /// Bytes in the log.
    len: u64,
    /// Bytes of the last line of every key: what a compaction keeps.
    live: u64,
    recent: VecDeque<RecentWrite>,
    next_seq: u64,
    /// Set when the log can no longer be trusted to be in place (a failed fsync of the directory
    /// after a compaction's rename): every write is refused from then on.
    broken: Option<String>,
    _lock: log::LogLock,
}

/// Shared state of the service. The mutex is a std one: the critical section is a map lookup and
/// one append+flush, and it must not be held across an await.
#[derive(Clone)]
pub struct DataStore {
    inner: Arc<Mutex<Inner>>,
    limits: DataStoreLimits,
    /// When set, a write's token must carry a MAC made with this key (`crate::fencing`).
    fencing_key: Option<crate::fencing::FencingKey>,
    /// When set (and no fencing key), a token above the highest accepted for its key must be
    /// the current holder's token in this cluster.
    lock_cluster: Option<Arc<LockCluster>>,
    /// SHA-256 of the bearer token clients must present, when set.
    client_token_digest: Option<[u8; 32]>,
    compacting: Arc<AtomicBool>,
    writes: IntCounterVec,
    compactions: IntCounterVec,
    registry: Registry,
}

/// Every `result` label of `raftlock_datastore_writes_total`.
const WRITE_RESULTS: [&str; 7] = [
    "accepted",
    "stale",
    "invalid",
    "forged",
    "not_holder",
    "unverified",
    "unauthenticated",
];

impl DataStore {
    /// Opens (or creates) the write log at `path`, takes its lock (refusing when another process
    /// holds it), rebuilds the highest token per key, and compacts the log if it has outgrown
    /// its live content.
    pub fn open(path: &Path, limits: DataStoreLimits) -> Result<Self, DataStoreError> {
        let open_err = |source| DataStoreError::Open {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(open_err)?;
        }
        let lock = log::lock_exclusive(path)?;
        // A compaction that crashed before its rename left its temporary file: the log itself is
        // whole.
        let leftover = log::compaction_path(path);
        if leftover.exists() {
            tracing::warn!(file = %leftover.display(), "removing an unfinished compaction");
            std::fs::remove_file(&leftover).map_err(open_err)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(open_err)?;
        let mut keys: HashMap<String, KeyState> = HashMap::new();
        let mut recent = VecDeque::new();
        let mut next_seq = 1;
        let mut live = 0u64;
        let max_line = log::max_line_bytes(limits.max_data_bytes);
        let torn = log::replay(&file, max_line, |w| {
            // A key's live line is the last one with its highest token (tokens for a key only
            // go up, so that is its last line; a lower one after it would not be kept).
            match keys.get_mut(&w.key) {
                Some(state) if w.token >= state.token => {
                    live -= u64::from(state.loc.len);
                    live += u64::from(w.loc.len);
                    state.token = w.token;
                    state.loc = w.loc;
                }
                Some(_) => {}
                None => {
                    live += u64::from(w.loc.len);
                    keys.insert(
                        w.key.clone(),
                        KeyState {
                            token: w.token,
                            loc: w.loc,
                        },
                    );
                }
            }
            push_recent(
                &mut recent,
                limits.recent_writes,
                RecentWrite {
                    seq: next_seq,
                    key: w.key,
                    token: w.token,
                    client: w.client,
                    data_bytes: w.data_bytes,
                    time_ms: None,
                    loc: Some(w.loc),
                },
            );
            next_seq += 1;
        });
        let mut repaired_lines = 0;
        let len = match torn {
            Ok(None) => file.metadata().map_err(open_err)?.len(),
            Ok(Some(torn)) => {
                // Only the last line can be torn: every write is one append of a whole line
                // followed by a flush, and it is acknowledged only after the flush. A crash
                // mid-append leaves an unacknowledged partial line; drop it.
                let total = file.metadata().map_err(open_err)?.len();
                tracing::warn!(
                    file = %path.display(),
                    line = torn.line,
                    offset = torn.offset,
                    bytes = total - torn.offset,
                    reason = %torn.reason,
                    "repairing a torn last line (a write interrupted by a crash, never \
                     acknowledged): truncating the log to its last complete line"
                );
                file.set_len(torn.offset).map_err(open_err)?;
                file.sync_all().map_err(open_err)?;
                repaired_lines = 1;
                torn.offset
            }
            Err(log::ReplayError::Corrupt(line, reason)) => {
                return Err(DataStoreError::Corrupt {
                    path: path.to_path_buf(),
                    line,
                    reason: format!(
                        "{reason} (not the last line, so this is damage, not a torn write; \
                         refusing to start)"
                    ),
                })
            }
            Err(log::ReplayError::Io(reason)) => {
                return Err(open_err(std::io::Error::other(reason)));
            }
        };
        let registry = Registry::new();
        crate::telemetry::metrics::register_process_and_build(&registry);
        let writes = IntCounterVec::new(
            Opts::new(
                "raftlock_datastore_writes_total",
                "Writes by result: accepted, stale, invalid, forged (a token whose MAC does not \
                 verify), not_holder (the lock cluster says the token is not the holder's), \
                 unverified (the lock cluster could not be asked), unauthenticated.",
            ),
            &["result"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(writes.clone()))
            .expect("unique metric");
        // Every result exists from the start, so `increase()` sees the first stale write.
        for result in WRITE_RESULTS {
            writes.with_label_values(&[result]);
        }
        let repaired = IntCounter::new(
            "raftlock_datastore_repaired_lines_total",
            "Torn last lines (writes interrupted by a crash) truncated from the log at start.",
        )
        .expect("valid metric");
        repaired.inc_by(repaired_lines);
        registry
            .register(Box::new(repaired.clone()))
            .expect("unique metric");
        let compactions = IntCounterVec::new(
            Opts::new(
                "raftlock_datastore_compactions_total",
                "Log compactions (rewrites to the last write of every key) by result: ok, failed.",
            ),
            &["result"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(compactions.clone()))
            .expect("unique metric");
        for result in ["ok", "failed"] {
            compactions.with_label_values(&[result]);
        }
        let store = DataStore {
            inner: Arc::new(Mutex::new(Inner {
                path: path.to_path_buf(),
                keys,
                file: Arc::new(file),
                len,
                live,
                recent,
                next_seq,
                broken: None,
                _lock: lock,
            })),
            limits,
            fencing_key: None,
            lock_cluster: None,
            client_token_digest: None,
            compacting: Arc::new(AtomicBool::new(false)),
            writes,
            compactions,
            registry,
        };
        if store.needs_compaction() {
            store.compact_now().map_err(open_err)?;
        }
        Ok(store)
    }

    /// Accepts only tokens whose `mac` verifies with `key` (shared with the lock service).
    pub fn with_fencing_key(mut self, key: crate::fencing::FencingKey) -> Self {
        self.fencing_key = Some(key);
        self
    }

    /// Without a fencing key: a token above the highest accepted for its key is accepted only
    /// when `cluster` says it is the current holder's (fail closed when it cannot be asked).
    pub fn with_lock_cluster(mut self, cluster: LockCluster) -> Self {
        self.lock_cluster = Some(Arc::new(cluster));
        self
    }

    /// Writes and `GET /data` need `Authorization: Bearer <token>`.
    pub fn with_client_token(mut self, token: &str) -> Self {
        self.client_token_digest = Some(sha256(token.as_bytes()));
        self
    }

    pub fn router(self) -> Router {
        Router::new()
            .route("/write", post(write))
            // Seed 000's client posts to the bare address.
            .route("/", post(write))
            .route("/data", get(read_data))
            .route("/healthz", get(|| async { "ok" }))
            .route("/metrics", get(metrics))
            .with_state(self)
    }

    /// The highest token accepted for `key`.
    pub fn highest(&self, key: &str) -> Option<u64> {
        Some(self.inner.lock().ok()?.keys.get(key)?.token)
    }

    /// Bytes in the log now.
    pub fn log_bytes(&self) -> Option<u64> {
        Some(self.inner.lock().ok()?.len)
    }

    fn needs_compaction(&self) -> bool {
        let Ok(inner) = self.inner.lock() else {
            return false;
        };
        inner.len > self.limits.compact_min_bytes
            && inner.len > inner.live.saturating_mul(self.limits.compact_ratio.max(1))
    }

    /// Rewrites the log to the last line of every key, under the mutex (writes wait).
    fn compact_now(&self) -> std::io::Result<()> {
        let mut inner = self
            .inner
            .lock()
            .map_err(|_| std::io::Error::other("state poisoned"))?;
        let started = std::time::Instant::now();
        // In file order, so the compacted log keeps the order the writes were accepted in.
        let mut locs: Vec<Loc> = inner.keys.values().map(|state| state.loc).collect();
        locs.sort_unstable_by_key(|loc| loc.offset);
        let path = inner.path.clone();
        let before = inner.len;
        let compacted = match log::compact(&path, &inner.file, &locs) {
            Ok(c) => c,
            Err(e) => {
                self.compactions.with_label_values(&["failed"]).inc();
                // A failure before the rename leaves the old log in place and in use; after the
                // rename (the directory's fsync) the new log is in place but maybe not durably:
                // stop taking writes rather than acknowledge any that a crash could lose.
                if !log::compaction_path(&path).exists() && file_is_not(&path, &inner.file) {
                    inner.broken = Some(format!("a compaction could not be made durable: {e}"));
                }
                tracing::error!(file = %path.display(), error = %e, "log compaction failed");
                return Err(e);
            }
        };
        let moved: HashMap<u64, Loc> = locs
            .iter()
            .zip(&compacted.locs)
            .map(|(old, new)| (old.offset, *new))
            .collect();
        // Every key's line was kept: each moves to its new place. A recent write keeps its
        // data only if its line was one of them.
        for state in inner.keys.values_mut() {
            if let Some(new) = moved.get(&state.loc.offset) {
                state.loc = *new;
            }
        }
        for w in inner.recent.iter_mut() {
            w.loc = w.loc.and_then(|old| {
                moved
                    .get(&old.offset)
                    .copied()
                    .filter(|new| new.len == old.len)
            });
        }
        inner.file = Arc::new(compacted.file);
        inner.len = compacted.len;
        inner.live = compacted.len;
        self.compactions.with_label_values(&["ok"]).inc();
        tracing::info!(
            file = %path.display(),
            bytes_before = before,
            bytes_after = compacted.len,
            keys = locs.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "compacted the write log to the last write of every key"
        );
        Ok(())
    }

    /// Starts a compaction on a blocking thread when the log needs one and none is running.
    fn compact_in_background(&self) {
        if !self.needs_compaction() || self.compacting.swap(true, Ordering::AcqRel) {
            return;
        }
        let store = self.clone();
        tokio::task::spawn_blocking(move || {
            let _ = store.compact_now();
            store.compacting.store(false, Ordering::Release);
        });
    }

    /// `Some(answer)` when client authentication is on and `headers` lack the token.
    fn refuse_unauthenticated(&self, headers: &HeaderMap) -> Option<Response> {
        use subtle::ConstantTimeEq;
        let expected = self.client_token_digest.as_ref()?;
        let presented = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(crate::server::auth::bearer);
        // Digests of equal length, compared in constant time: neither the token's bytes nor its
        // length leak through timing.
        let ok = presented.is_some_and(|t| bool::from(sha256(t.as_bytes()).ct_eq(expected)));
        if ok {
            return None;
        }
        let error = if presented.is_none() {
            "this data store requires a bearer token: send `Authorization: Bearer <token>`"
        } else {
            "the bearer token is not this data store's"
        };
        Some(
            (
                StatusCode::UNAUTHORIZED,
                [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
                Json(json!({"success": false, "error": error})),
            )
                .into_response(),
        )
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// Whether the file now at `path` is another inode than `open` (a rename happened).
fn file_is_not(path: &Path, open: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(path), open.metadata()) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) != (b.dev(), b.ino()),
        _ => true,
    }
}

fn push_recent(recent: &mut VecDeque<RecentWrite>, max: usize, write: RecentWrite) {
    recent.push_back(write);
    while recent.len() > max {
        recent.pop_front();
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Fields the store does not know are ignored, so a newer client works with an older store.
#[derive(Deserialize)]
struct WriteRequest {
    #[serde(rename = "clientID")]
    client_id: String,
    #[serde(rename = "fencingToken")]
    fencing_token: Token,
    data: String,
}

#[derive(Deserialize)]
struct Token {
    key: String,
    value: u64,
    /// The lock service's MAC of (key, value); required when the store has a fencing key.
    #[serde(default)]
    mac: Option<String>,
    /// What the token was granted for (`"leader"`: an election's term; `"reader"`, `"writer"`:
    /// a read-write lock's; `"permit"`: a semaphore's, with its `slot`); absent: a lock. The
    /// MAC covers it.
    #[serde(default)]
    mode: Option<String>,
    /// A permit's slot.
    #[serde(default)]
    slot: Option<u32>,
}

fn bad_request(store: &DataStore, reason: String) -> Response {
    store.writes.with_label_values(&["invalid"]).inc();
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"success": false, "error": reason})),
    )
        .into_response()
}

fn refused(store: &DataStore, result: &str, status: StatusCode, error: String) -> Response {
    store.writes.with_label_values(&[result]).inc();
    (status, Json(json!({"success": false, "error": error}))).into_response()
}

fn stale(store: &DataStore, current: u64) -> Response {
    store.writes.with_label_values(&["stale"]).inc();
    (
        StatusCode::CONFLICT,
        Json(json!({"success": false, "error": "stale fencing token", "current": current})),
    )
        .into_response()
}

fn server_error(error: String) -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({"success": false, "error": error})),
    )
        .into_response()
}

async fn write(
    State(store): State<DataStore>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Some(answer) = store.refuse_unauthenticated(&headers) {
        store.writes.with_label_values(&["unauthenticated"]).inc();
        return answer;
    }
    let request: WriteRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(err) => return bad_request(&store, format!("malformed write: {err}")),
    };
    let l = &store.limits;
    let key = request.fencing_token.key;
    if key.is_empty() || key.len() > l.max_key_bytes || key.contains(['\t', '\n']) {
        return bad_request(
            &store,
            format!(
                "fencingToken.key must be 1..={} bytes without tabs or newlines",
                l.max_key_bytes
            ),
        );
    }
    if request.client_id.is_empty()
        || request.client_id.len() > l.max_client_id_bytes
        || request.client_id.contains(['\t', '\n'])
    {
        return bad_request(
            &store,
            format!(
                "clientID must be 1..={} bytes without tabs or newlines",
                l.max_client_id_bytes
            ),
        );
    }
    if request.data.len() > l.max_data_bytes {
        return bad_request(&store, format!("data exceeds {} bytes", l.max_data_bytes));
    }
    let token = request.fencing_token.value;
    let slot = request.fencing_token.slot;
    let mode = match request.fencing_token.mode.as_deref() {
        None | Some("") if slot.is_none() => crate::fencing::TokenMode::Lock,
        name => match crate::fencing::TokenMode::parse_with_slot(name.unwrap_or(""), slot) {
            Some(mode) => mode,
            None => {
                return bad_request(
                    &store,
                    format!(
                        "fencingToken.mode must be \"lock\", \"leader\", \"reader\", \"writer\" \
                         or \"permit\" (a slot only with \"permit\"), not {name:?} with slot \
                         {slot:?}"
                    ),
                )
            }
        },
    };
    if mode == crate::fencing::TokenMode::Reader {
        return refused(
            &store,
            "reader",
            StatusCode::FORBIDDEN,
            format!(
                "fencing token {token} for {key:?} is a reader's: a read-write lock's readers \
                 share the key and none of them may write; acquire it as the writer"
            ),
        );
    }
    if let Some(fencing_key) = &store.fencing_key {
        let verified = request
            .fencing_token
            .mac
            .as_deref()
            .is_some_and(|mac| fencing_key.verify_mode(mode, &key, token, mac));
        if !verified {
            let error = if request.fencing_token.mac.is_none() {
                "fencingToken.mac is required: this store accepts only tokens issued by the lock \
                 service (send the mac that came with the grant)"
            } else {
                "fencingToken.mac does not verify for this key, value and mode: not a token the \
                 lock service issued"
            };
            return refused(&store, "forged", StatusCode::FORBIDDEN, error.into());
        }
    }
    // A semaphore's permits are fenced per slot: each slot's holders hold increasing tokens,
    // and the slot's writes are kept under `<key>#<slot>`.
    let key = match mode {
        crate::fencing::TokenMode::Permit(slot) => format!("{key}#{slot}"),
        _ => key,
    };
    // A token above the highest accepted for the key is news: without a MAC to prove it, the
    // lock cluster (when configured) must confirm it is the current holder's. An equal token is
    // the same holder writing again, a lower one stale: neither needs asking.
    let current = match store.inner.lock() {
        Ok(inner) => inner.keys.get(&key).map(|s| s.token),
        Err(_) => return server_error("state poisoned".into()),
    };
    match current {
        Some(current) if token < current => return stale(&store, current),
        Some(current) if token == current => {}
        _ => {
            if let (None, Some(cluster)) = (&store.fencing_key, &store.lock_cluster) {
                match cluster.check(&key, token).await {
                    Verdict::Holder => {}
                    Verdict::NotHolder(why) => {
                        return refused(
                            &store,
                            "not_holder",
                            StatusCode::FORBIDDEN,
                            format!(
                                "fencing token {token} for {key:?} is not the current holder's: \
                                 {why} (the lock service never issued it, or its lock has \
                                 ended)"
                            ),
                        )
                    }
                    Verdict::Unavailable(why) => {
                        return refused(
                            &store,
                            "unverified",
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!(
                                "cannot confirm fencing token {token} for {key:?} with the lock \
                                 service, so the write is refused (retry later): {why}"
                            ),
                        )
                    }
                }
            }
        }
    }
    let line = log::format_line(&key, token, &request.client_id, &request.data);
    let Ok(mut inner) = store.inner.lock() else {
        return server_error("state poisoned".into());
    };
    if let Some(why) = &inner.broken {
        return server_error(format!("the write log is unusable: {why}"));
    }
    // Checked again: another write may have raised the key's highest while this one was asked
    // about.
    let previous = inner.keys.get(&key).map(|s| (s.token, s.loc));
    match previous {
        Some((current, _)) if token < current => {
            drop(inner);
            return stale(&store, current);
        }
        None if inner.keys.len() >= l.max_keys => {
            drop(inner);
            return bad_request(&store, "too many distinct keys".into());
        }
        _ => {}
    }
    let offset = inner.len;
    let durable = (&*inner.file)
        .write_all(line.as_bytes())
        .and_then(|_| inner.file.sync_data());
    if let Err(err) = durable {
        // Not acknowledged: cut off whatever part of the line reached the file, so the next
        // write starts on a line of its own.
        if let Err(cut) = inner.file.set_len(offset) {
            inner.broken = Some(format!("cannot cut a failed append off the log: {cut}"));
        }
        return server_error(format!("write failed: {err}"));
    }
    let loc = Loc {
        offset,
        len: line.len() as u32,
    };
    inner.len += u64::from(loc.len);
    inner.live += u64::from(loc.len);
    if let Some((_, old)) = previous {
        inner.live -= u64::from(old.len);
    }
    inner.keys.insert(key.clone(), KeyState { token, loc });
    let seq = inner.next_seq;
    inner.next_seq += 1;
    push_recent(
        &mut inner.recent,
        l.recent_writes,
        RecentWrite {
            seq,
            key,
            token,
            client: request.client_id,
            data_bytes: request.data.len(),
            time_ms: Some(now_ms()),
            loc: Some(loc),
        },
    );
    drop(inner);
    store.writes.with_label_values(&["accepted"]).inc();
    store.compact_in_background();
    Json(json!({"success": true})).into_response()
}

#[derive(Deserialize)]
struct DataQuery {
    key: Option<String>,
    limit: Option<usize>,
    /// Oldest writes after this sequence number (to follow new writes).
    after: Option<u64>,
    /// Newest writes before this sequence number (to walk back).
    before: Option<u64>,
}

/// One page of `GET /data`, chosen under the mutex; its data is read afterwards, without it.
struct Page {
    writes: Vec<RecentWrite>,
    highest: Map<String, Value>,
    more: bool,
    truncated: bool,
    newest_seq: u64,
    file: Arc<File>,
    limit: usize,
}

impl DataStore {
    /// The writes of one page (see [`read_data`]); `None` when the state is poisoned.
    fn select_page(&self, q: &DataQuery) -> Option<Page> {
        let l = &self.limits;
        let limit = q
            .limit
            .unwrap_or(l.page_records_default)
            .clamp(1, l.page_records_max.max(1));
        let inner = self.inner.lock().ok()?;
        let matches = |w: &&RecentWrite| q.key.as_deref().is_none_or(|k| w.key == k);
        let mut page: Vec<RecentWrite> = Vec::new();
        let mut bytes = 0usize;
        let mut more = false;
        let mut truncated = false;
        {
            let mut take = |w: &RecentWrite| -> bool {
                if page.len() == limit {
                    more = true;
                    return false;
                }
                let size = w.data_bytes + w.key.len() + w.client.len() + RECORD_OVERHEAD_BYTES;
                if !page.is_empty() && bytes + size > l.page_bytes_max {
                    more = true;
                    truncated = true;
                    return false;
                }
                bytes += size;
                page.push(w.clone());
                true
            };
            match q.after {
                Some(after) => {
                    let start = inner.recent.partition_point(|w| w.seq <= after);
                    for w in inner.recent.range(start..).filter(matches) {
                        if !take(w) {
                            break;
                        }
                    }
                }
                None => {
                    let end = match q.before {
                        Some(before) => inner.recent.partition_point(|w| w.seq < before),
                        None => inner.recent.len(),
                    };
                    for w in inner.recent.range(..end).rev().filter(matches) {
                        if !take(w) {
                            break;
                        }
                    }
                }
            }
        }
        if q.after.is_none() {
            page.reverse();
        }
        let mut highest = Map::new();
        let keys_shown = q.key.iter().chain(page.iter().map(|w| &w.key));
        for key in keys_shown {
            if let Some(state) = inner.keys.get(key) {
                highest.insert(key.clone(), json!(state.token));
            }
        }
        Some(Page {
            writes: page,
            highest,
            more,
            truncated,
            newest_seq: inner.next_seq - 1,
            file: inner.file.clone(),
            limit,
        })
    }
}

/// Metadata bytes counted per record toward the page's byte cap, besides key, client and data.
const RECORD_OVERHEAD_BYTES: usize = 128;

/// `GET /data`: one page of recent writes, oldest first. Without `after`, the newest `limit`
/// (before `before`, if given); with `after`, the oldest `limit` after it. Data is read back from
/// the log; a write a compaction dropped (a later write of its key superseded it) has
/// `"data": null`.
async fn read_data(
    State(store): State<DataStore>,
    headers: HeaderMap,
    Query(q): Query<DataQuery>,
) -> Response {
    if let Some(answer) = store.refuse_unauthenticated(&headers) {
        return answer;
    }
    if q.after.is_some() && q.before.is_some() {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"success": false, "error": "give `after` or `before`, not both"})),
        )
            .into_response();
    }
    let Some(Page {
        writes: page,
        highest,
        more,
        truncated,
        newest_seq,
        file,
        limit,
    }) = store.select_page(&q)
    else {
        return server_error("state poisoned".into());
    };
    let places: Vec<Option<Loc>> = page.iter().map(|w| w.loc).collect();
    let data = tokio::task::spawn_blocking(move || {
        places
            .into_iter()
            .map(|loc| loc.and_then(|loc| log::read_data(&file, loc).ok()))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    let first = page.first().map(|w| w.seq);
    let last = page.last().map(|w| w.seq);
    let writes: Vec<Value> = page
        .iter()
        .zip(data.into_iter().chain(std::iter::repeat(None)))
        .map(|(w, data)| {
            json!({
                "seq": w.seq,
                "key": w.key,
                "fencingToken": w.token,
                "clientID": w.client,
                "size": w.data_bytes,
                "time": w.time_ms,
                "data": data,
            })
        })
        .collect();
    // Cursors: `before` continues toward older writes, `after` toward newer ones.
    let (before, after) = match q.after {
        Some(after) => (first, Some(last.unwrap_or(after))),
        None => (
            more.then_some(first).flatten(),
            Some(last.unwrap_or(newest_seq)),
        ),
    };
    Json(json!({
        "writes": writes,
        "highest": highest,
        "more": more,
        "truncated": truncated,
        "before": before,
        "after": after,
        "limit": limit,
    }))
    .into_response()
}

async fn metrics(State(store): State<DataStore>) -> Response {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&store.registry.gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default().into_response()
}
