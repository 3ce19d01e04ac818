//! The data store: the resource RaftLock protects. It accepts a write only with a fencing token at
//! least as high as any it has seen for that lock key (equal = the same holder writing again), so
//! a paused or partitioned former holder cannot overwrite the work of the next one.
//!
//! Every accepted write is appended to a text file and flushed before the answer; on restart the
//! file rebuilds the highest token per key. One line per write:
//! `<key>\t<token>\t<clientID>\t<data as JSON string>`. A last line cut short by a crash (no
//! newline, or unparsable) was never acknowledged: it is truncated at start, with a warning and
//! `raftlock_datastore_repaired_lines_total`. A bad line anywhere else refuses to start.
//!
//! `POST /write` and `POST /` (seed 000's client names no path) take the same JSON body.

pub mod cli;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use serde::Deserialize;
use serde_json::{json, Value};

/// Limits on what one write may carry.
#[derive(Clone, Debug)]
pub struct DataStoreLimits {
    pub max_key_bytes: usize,
    pub max_client_id_bytes: usize,
    pub max_data_bytes: usize,
    pub max_keys: usize,
}

impl Default for DataStoreLimits {
    fn default() -> Self {
        DataStoreLimits {
            max_key_bytes: 512,
            max_client_id_bytes: 256,
            max_data_bytes: 64 * 1024,
            max_keys: 1_000_000,
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
}

struct Inner {
    highest: HashMap<String, u64>,
    file: std::fs::File,
    /// Last `max_recent` accepted writes, for `GET /data`.
    recent: std::collections::VecDeque<Value>,
}

/// Shared state of the service. The mutex is a std one: the critical section is a map lookup and
/// one append+flush, and it must not be held across an await.
#[derive(Clone)]
pub struct DataStore {
    inner: Arc<Mutex<Inner>>,
    limits: DataStoreLimits,
    /// When set, a write's token must carry a MAC made with this key (`crate::fencing`).
    fencing_key: Option<crate::fencing::FencingKey>,
    writes: IntCounterVec,
    registry: Registry,
}

const MAX_RECENT: usize = 10_000;

impl DataStore {
    /// Opens (or creates) the write log at `path` and rebuilds the highest token per key.
    pub fn open(path: &Path, limits: DataStoreLimits) -> Result<Self, DataStoreError> {
        let open_err = |source| DataStoreError::Open {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(open_err)?;
        }
        let mut highest = HashMap::new();
        let mut recent = std::collections::VecDeque::new();
        let mut repaired_lines = 0;
        if path.exists() {
            let bytes = std::fs::read(path).map_err(open_err)?;
            let replay = replay_log(&bytes);
            let writes = match replay {
                Ok(Replay { writes, torn: None }) => writes,
                Ok(Replay {
                    writes,
                    torn: Some(torn),
                }) => {
                    // Only the last line can be torn: every write is one append of a whole line
                    // followed by a flush, and it is acknowledged only after the flush. A crash
                    // mid-append leaves an unacknowledged partial line; drop it.
                    tracing::warn!(
                        file = %path.display(),
                        line = torn.line,
                        offset = torn.offset,
                        bytes = bytes.len() as u64 - torn.offset,
                        reason = %torn.reason,
                        "repairing a torn last line (a write interrupted by a crash, never \
                         acknowledged): truncating the log to its last complete line"
                    );
                    let file = std::fs::OpenOptions::new()
                        .write(true)
                        .open(path)
                        .map_err(open_err)?;
                    file.set_len(torn.offset).map_err(open_err)?;
                    file.sync_all().map_err(open_err)?;
                    repaired_lines = 1;
                    writes
                }
                Err((line, reason)) => {
                    return Err(DataStoreError::Corrupt {
                        path: path.to_path_buf(),
                        line,
                        reason: format!(
                            "{reason} (not the last line, so this is damage, not a torn write; \
                             refusing to start)"
                        ),
                    })
                }
            };
            for w in writes {
                let entry = highest.entry(w.key.clone()).or_insert(0);
                *entry = (*entry).max(w.token);
                recent.push_back(
                    json!({"key": w.key, "fencingToken": w.token, "clientID": w.client, "data": w.data}),
                );
                if recent.len() > MAX_RECENT {
                    recent.pop_front();
                }
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(open_err)?;
        let registry = Registry::new();
        let writes = IntCounterVec::new(
            Opts::new(
                "raftlock_datastore_writes_total",
                "Writes by result: accepted, stale, invalid, forged (a token whose MAC does not verify).",
            ),
            &["result"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(writes.clone()))
            .expect("unique metric");
        // Every result exists from the start, so `increase()` sees the first stale write.
        for result in ["accepted", "stale", "invalid", "forged"] {
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
        Ok(DataStore {
            inner: Arc::new(Mutex::new(Inner {
                highest,
                file,
                recent,
            })),
            limits,
            fencing_key: None,
            writes,
            registry,
        })
    }

    /// Accepts only tokens whose `mac` verifies with `key` (shared with the lock service).
    pub fn with_fencing_key(mut self, key: crate::fencing::FencingKey) -> Self {
        self.fencing_key = Some(key);
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
        self.inner.lock().ok()?.highest.get(key).copied()
    }
}

/// One write read back from the log.
#[derive(Debug, PartialEq)]
struct LoggedWrite {
    key: String,
    token: u64,
    client: String,
    data: String,
}

/// Where the log's torn last line starts.
#[derive(Debug, PartialEq)]
struct Torn {
    /// 1-based line number.
    line: usize,
    /// Byte offset of the line's start: the log is truncated to this length.
    offset: u64,
    reason: String,
}

#[derive(Debug, PartialEq)]
struct Replay {
    writes: Vec<LoggedWrite>,
    torn: Option<Torn>,
}

fn parse_line(line: &[u8]) -> Result<LoggedWrite, &'static str> {
    let line = std::str::from_utf8(line).map_err(|_| "not UTF-8")?;
    let mut parts = line.splitn(4, '\t');
    let (Some(key), Some(token), Some(client), Some(data)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("expected 4 tab-separated fields");
    };
    let token: u64 = token.parse().map_err(|_| "token is not a number")?;
    let data: String = serde_json::from_str(data).map_err(|_| "data is not a JSON string")?;
    Ok(LoggedWrite {
        key: key.to_string(),
        token,
        client: client.to_string(),
        data,
    })
}

/// Parses the whole log. The last line is torn when it lacks its newline (an append cut short)
/// or does not parse; any other line that does not parse is an error `(line, reason)`. Empty
/// lines are skipped.
fn replay_log(bytes: &[u8]) -> Result<Replay, (usize, String)> {
    let mut writes = Vec::new();
    let mut offset = 0usize;
    let mut number = 0usize;
    while offset < bytes.len() {
        number += 1;
        let rest = &bytes[offset..];
        let (line, terminated) = match rest.iter().position(|&b| b == b'\n') {
            Some(end) => (&rest[..end], true),
            None => (rest, false),
        };
        let next = offset + line.len() + usize::from(terminated);
        let last = next >= bytes.len();
        let torn = |reason: &str| Torn {
            line: number,
            offset: offset as u64,
            reason: reason.to_string(),
        };
        if !terminated {
            let torn = Some(torn("no trailing newline"));
            return Ok(Replay { writes, torn });
        }
        if !line.is_empty() {
            match parse_line(line) {
                Ok(w) => writes.push(w),
                Err(reason) if last => {
                    let torn = Some(torn(reason));
                    return Ok(Replay { writes, torn });
                }
                Err(reason) => return Err((number, reason.to_string())),
            }
        }
        offset = next;
    }
    Ok(Replay { writes, torn: None })
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
}

fn bad_request(store: &DataStore, reason: String) -> Response {
    store.writes.with_label_values(&["invalid"]).inc();
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"success": false, "error": reason})),
    )
        .into_response()
}

async fn write(State(store): State<DataStore>, body: axum::body::Bytes) -> Response {
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
            "clientID must be 1..=256 bytes without tabs or newlines".into(),
        );
    }
    if request.data.len() > l.max_data_bytes {
        return bad_request(&store, format!("data exceeds {} bytes", l.max_data_bytes));
    }
    let token = request.fencing_token.value;
    if let Some(fencing_key) = &store.fencing_key {
        let verified = request
            .fencing_token
            .mac
            .as_deref()
            .is_some_and(|mac| fencing_key.verify(&key, token, mac));
        if !verified {
            store.writes.with_label_values(&["forged"]).inc();
            let error = if request.fencing_token.mac.is_none() {
                "fencingToken.mac is required: this store accepts only tokens issued by the lock \
                 service (send the mac that came with the grant)"
            } else {
                "fencingToken.mac does not verify for this key and value: not a token the lock \
                 service issued"
            };
            return (
                StatusCode::FORBIDDEN,
                Json(json!({"success": false, "error": error})),
            )
                .into_response();
        }
    }
    let Ok(mut inner) = store.inner.lock() else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "state poisoned").into_response();
    };
    let current = inner.highest.get(&key).copied();
    if let Some(current) = current {
        if token < current {
            drop(inner);
            store.writes.with_label_values(&["stale"]).inc();
            return (
                StatusCode::CONFLICT,
                Json(json!({"success": false, "error": "stale fencing token", "current": current})),
            )
                .into_response();
        }
    } else if inner.highest.len() >= l.max_keys {
        drop(inner);
        return bad_request(&store, "too many distinct keys".into());
    }
    let data_json = serde_json::to_string(&request.data).unwrap_or_else(|_| "\"\"".into());
    let line = format!("{key}\t{token}\t{}\t{data_json}\n", request.client_id);
    let durable = inner
        .file
        .write_all(line.as_bytes())
        .and_then(|_| inner.file.sync_data());
    if let Err(err) = durable {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"success": false, "error": format!("write failed: {err}")})),
        )
            .into_response();
    }
    inner.highest.insert(key.clone(), token);
    inner.recent.push_back(json!({"key": key, "fencingToken": token, "clientID": request.client_id, "data": request.data}));
    if inner.recent.len() > MAX_RECENT {
        inner.recent.pop_front();
    }
    drop(inner);
    store.writes.with_label_values(&["accepted"]).inc();
    Json(json!({"success": true})).into_response()
}

#[derive(Deserialize)]
struct DataQuery {
    key: Option<String>,
}

async fn read_data(State(store): State<DataStore>, Query(q): Query<DataQuery>) -> Response {
    let Ok(inner) = store.inner.lock() else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "state poisoned").into_response();
    };
    let writes: Vec<&Value> = inner
        .recent
        .iter()
        .filter(|w| q.key.as_deref().is_none_or(|k| w["key"] == k))
        .collect();
    Json(json!({"writes": writes, "highest": inner.highest})).into_response()
}

async fn metrics(State(store): State<DataStore>) -> Response {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&store.registry.gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default().into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "k\t1\tc\t\"a\"\n";
    const B: &str = "k\t2\tc\t\"b\"\n";

    #[test]
    fn a_clean_log_replays_every_line() {
        let r = replay_log(format!("{A}\n{B}").as_bytes()).unwrap();
        assert_eq!(r.torn, None);
        assert_eq!(r.writes.len(), 2);
        assert_eq!(r.writes[1].token, 2);
    }

    #[test]
    fn an_unterminated_last_line_is_torn() {
        let log = format!("{A}{B}k\t3\tc\t\"par");
        let r = replay_log(log.as_bytes()).unwrap();
        assert_eq!(r.writes.len(), 2);
        let torn = r.torn.unwrap();
        assert_eq!(torn.line, 3);
        assert_eq!(torn.offset as usize, A.len() + B.len());
        // Even a fragment that happens to parse was never acknowledged.
        let r = replay_log(format!("{A}{}", B.trim_end()).as_bytes()).unwrap();
        assert_eq!(r.writes.len(), 1);
        assert_eq!(r.torn.unwrap().offset as usize, A.len());
    }

    #[test]
    fn an_unparsable_last_line_is_torn() {
        let log = format!("{A}\0\0\0\n");
        let r = replay_log(log.as_bytes()).unwrap();
        assert_eq!(r.writes.len(), 1);
        assert_eq!(r.torn.unwrap().offset as usize, A.len());
    }

    #[test]
    fn a_bad_line_before_the_last_is_an_error() {
        let log = format!("{A}garbage\n{B}");
        assert_eq!(
            replay_log(log.as_bytes()),
            Err((2, "expected 4 tab-separated fields".to_string()))
        );
        let log = format!("{A}garbage\nk\t3\tc\t\"par");
        assert_eq!(replay_log(log.as_bytes()).unwrap_err().0, 2);
    }
}
