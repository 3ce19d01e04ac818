//! What lockctl prints: watch lines, errors and their hints, machine output (JSON or YAML),
//! and the human tables of `/status`, locks and members.

use std::process::ExitCode;
use std::time::Duration;

use raftlock::client::http::get_json_with;
use raftlock::client::TlsConfig;
use serde_json::Value;

/// One watch event for people: `index  event  key  client  details`.
pub(super) fn watch_line(e: &raftlock::client::WatchEvent) -> String {
    if e.event == "leader" && e.leader_id.unwrap_or(0) == 0 {
        return format!(
            "{:>8}  {:<9}  no leader: an election in term {}",
            e.index,
            e.event,
            e.term.unwrap_or(0)
        );
    }
    if e.event == "leader" {
        return format!(
            "{:>8}  {:<9}  node {} leads (term {})",
            e.index,
            e.event,
            e.leader_id.unwrap_or(0),
            e.term.unwrap_or(0)
        );
    }
    let mut detail = String::new();
    if let Some(t) = e.token {
        detail.push_str(&format!("token {t}"));
    }
    if let Some(p) = e.position {
        detail.push_str(&format!("position {p}"));
    }
    format!(
        "{:>8}  {:<9}  {:<24}  {:<24}  {detail}",
        e.index,
        e.event,
        e.key.as_deref().unwrap_or(""),
        e.client.as_deref().unwrap_or("")
    )
}

pub(super) fn fail(e: impl std::fmt::Display) -> ExitCode {
    let message = e.to_string();
    eprintln!("lockctl: {message}");
    if let Some(hint) = hint(&message) {
        eprintln!("hint: {hint}");
    }
    ExitCode::FAILURE
}

/// What to do next about an error, when its text says enough to tell.
fn hint(message: &str) -> Option<&'static str> {
    let has = |needle: &str| message.contains(needle);
    Some(if has("UNAUTHENTICATED") {
        "this cluster authenticates clients: set RAFTLOCK_AUTH_TOKEN (or --auth-token) to a token \
         from the cluster's client auth file"
    } else if has("PERMISSION_DENIED") {
        "your identity may not do this on this key: use a key under its prefixes, or ask the \
         operator to grant the operation in the client auth file"
    } else if has("NOT_HOLDER") {
        "release and renew as the lock's owner: pass --client-id with the owner id that \
         `lockctl acquire` printed"
    } else if has("STALE_TOKEN") {
        "the token no longer holds the lock (released, expired or superseded): see \
         `lockctl locks` for the current holder and token"
    } else if has("WAIT_TIMEOUT") || has("not granted within") {
        "someone else holds the lock: wait longer with --wait, or see `lockctl locks` for the \
         holder"
    } else if has("ALREADY_HELD") {
        "this client id already holds the lock: release it first, or use another --client-id"
    } else if has("REQUEST_ID_REUSED") {
        "a request id names one operation: retry with a fresh one"
    } else if has("ACKNOWLEDGED") {
        "the cluster had already answered this request and was told so: another process is \
         probably numbering its requests under the same client id; give each its own --client-id"
    } else if has("invalid peer certificate") || has("UnknownIssuer") || has("NotValidForName") {
        "the node's TLS certificate is not trusted: pass --tls-ca (RAFTLOCK_TLS_CA) with the CA \
         that signed it, and dial a name or address the certificate carries"
    } else if has("InvalidContentType") || has("corrupt message") {
        "the node does not speak TLS on this port: drop --tls-ca (RAFTLOCK_TLS_CA)"
    } else if has("malformed HTTP response")
        || has("httparse")
        || has("Handshake not finished")
        || has("Connection reset")
    {
        "the node may speak TLS on its client port: pass --tls-ca (RAFTLOCK_TLS_CA) with the CA \
         of its certificate"
    } else if has("Connection refused")
        || has("cannot connect")
        || has("timed out")
        || has("gave up after")
    {
        "no node answered: is the cluster running (`lockctl up` starts a local one)? Point \
         --endpoints or RAFTLOCK_ENDPOINTS at its client ports (default 127.0.0.1:50051-50053)"
    } else if has("NO_LEADER") || has("UNAVAILABLE") {
        "the cluster has no leader right now (a majority of nodes must be up): check \
         `lockctl status` and retry"
    } else if has("TOO_LARGE") {
        "a key, value or id is over the node's limit (`lock-node --help` lists the limits)"
    } else {
        return None;
    })
}

/// `--output yaml`: machine output is YAML instead of JSON.
pub(super) static YAML: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Prints a value for scripts: one line of JSON, or a YAML document with `--output yaml`.
pub(super) fn print_machine(value: &Value) {
    if YAML.load(std::sync::atomic::Ordering::Relaxed) {
        match serde_yaml_ng::to_string(value) {
            Ok(text) => print!("---\n{text}"),
            Err(_) => println!("{value}"),
        }
    } else {
        println!("{value}");
    }
}

pub(super) fn emit(json_out: bool, value: Value, human: impl FnOnce()) {
    if json_out {
        print_machine(&value);
    } else {
        human();
    }
}

pub(super) async fn show(
    endpoint: &str,
    path: &str,
    json: bool,
    tls: Option<&TlsConfig>,
) -> ExitCode {
    match get_json_with(endpoint, path, None, tls).await {
        Ok((200, value)) => {
            if json {
                print_machine(&value);
            } else if path == "/status" {
                print_table(&status_table(&value));
            } else {
                print_human(&value, 0);
            }
            ExitCode::SUCCESS
        }
        Ok((status, value)) => {
            eprintln!("lockctl: {endpoint}{path} answered {status}: {value}");
            ExitCode::FAILURE
        }
        Err(err) => fail(err),
    }
}

fn print_human(value: &Value, indent: usize) {
    let pad = " ".repeat(indent);
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                if v.is_object()
                    || (v.is_array()
                        && v.as_array()
                            .is_some_and(|a| a.iter().any(|x| x.is_object())))
                {
                    println!("{pad}{k}:");
                    print_human(v, indent + 2);
                } else {
                    println!("{pad}{k}: {}", scalar(v));
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                println!("{pad}-");
                print_human(item, indent + 2);
            }
        }
        other => println!("{pad}{}", scalar(other)),
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Prints rows (the first is the header) as columns padded to their widest cell.
pub(super) fn print_table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
            }
        }
        println!("{}", line.trim_end());
    }
}

/// Milliseconds as people read them: 850ms, 12.3s, 4m05s, 2h03m.
fn human_ms(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{}m{:02}s", ms / 60_000, ms / 1000 % 60),
        _ => format!("{}h{:02}m", ms / 3_600_000, ms / 60_000 % 60),
    }
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        other => scalar(other),
    }
}

pub(super) fn locks_table(v: &Value) -> Vec<Vec<String>> {
    let mut rows = vec![vec![
        "KEY".into(),
        "HOLDER".into(),
        "TOKEN".into(),
        "TIME LEFT".into(),
        "TTL".into(),
        "WAITERS".into(),
    ]];
    for l in v["locks"].as_array().into_iter().flatten() {
        let waiters: Vec<String> = l["waiters"]
            .as_array()
            .into_iter()
            .flatten()
            .map(scalar)
            .collect();
        let waiters = if waiters.is_empty() {
            "-".to_string()
        } else {
            format!("{} ({})", waiters.len(), waiters.join(", "))
        };
        rows.push(vec![
            cell(&l["key"]),
            cell(&l["holder"]),
            cell(&l["fencingToken"]),
            l["expiresInMs"].as_u64().map_or("-".into(), human_ms),
            l["ttlMs"].as_u64().map_or("-".into(), human_ms),
            waiters,
        ]);
    }
    rows
}

fn status_table(s: &Value) -> Vec<Vec<String>> {
    let list = |v: &Value| {
        let ids: Vec<String> = v.as_array().into_iter().flatten().map(scalar).collect();
        if ids.is_empty() {
            "-".to_string()
        } else {
            ids.join(",")
        }
    };
    let leader = match (s["leaderId"].as_u64(), s["leaderAddr"].as_str()) {
        (Some(0) | None, _) => "none".to_string(),
        (Some(id), Some(a)) if !a.is_empty() => format!("{id} ({a})"),
        (Some(id), _) => id.to_string(),
    };
    let mut rows = vec![vec!["FIELD".into(), "VALUE".into()]];
    for (k, v) in [
        ("node", cell(&s["id"])),
        ("role", cell(&s["role"])),
        ("term", cell(&s["term"])),
        ("leader", leader),
        ("commit index", cell(&s["commitIndex"])),
        ("applied index", cell(&s["appliedIndex"])),
        ("last index", cell(&s["lastIndex"])),
        ("voters", list(&s["voters"])),
        ("learners", list(&s["learners"])),
        ("locks held", cell(&s["locksHeld"])),
        ("waiters", cell(&s["waiters"])),
        ("cluster version", cell(&s["clusterVersion"])),
    ] {
        rows.push(vec![k.to_string(), v]);
    }
    rows
}

/// Members with the role and term each reports on its own /status ("unreachable" if it does
/// not answer).
pub(super) async fn members_table(v: &Value, tls: Option<&TlsConfig>) -> Vec<Vec<String>> {
    let mut rows = vec![vec![
        "ID".into(),
        "ROLE".into(),
        "TERM".into(),
        "VOTER".into(),
        "CLIENT ADDR".into(),
        "PEER ADDR".into(),
    ]];
    for m in v["members"].as_array().into_iter().flatten() {
        let client = m["clientAddr"].as_str().unwrap_or("");
        let status = if client.is_empty() {
            None
        } else {
            tokio::time::timeout(
                Duration::from_secs(2),
                get_json_with(client, "/status", None, tls),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .filter(|(code, _)| *code == 200)
            .map(|(_, s)| s)
        };
        let (role, term) = match &status {
            Some(s) => (cell(&s["role"]), cell(&s["term"])),
            None => ("unreachable".into(), "-".into()),
        };
        rows.push(vec![
            cell(&m["id"]),
            role,
            term,
            if m["voter"] == true { "yes" } else { "learner" }.into(),
            if client.is_empty() {
                "-".into()
            } else {
                client.to_string()
            },
            cell(&m["peerAddr"]),
        ]);
    }
    rows
}
