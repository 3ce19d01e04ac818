//! Seed 004's gRPC API (`api.LockService`, `proto/seed004/api/lock_service.proto`) against three
//! real `lock-node` processes, driven by a Python client generated from the seed's file with
//! `grpcio-tools` — a client that knows nothing of RaftLock, like the seed's C# client.
//!
//! Needs `python3` with `grpcio` and `grpcio-tools`; the test installs them with pip if missing
//! and fails (never skips) if it cannot.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

const LEADER_TIMEOUT: Duration = Duration::from_secs(20);
/// The nodes' `--default-ttl`: the seed's AcquireLock names no TTL, so every lock gets this one.
/// Long enough that nothing expires while the test runs.
const DEFAULT_TTL_MS: u64 = 45_000;

/// A long-lived Python process: one JSON request per stdin line, one JSON answer per stdout line.
const CLIENT_PY: &str = r#"
import json, sys, time
sys.path.insert(0, sys.argv[1])
import grpc
from api import lock_service_pb2 as pb, lock_service_pb2_grpc as pb_grpc

channels = {}
def stub(addr):
    if addr not in channels:
        channels[addr] = pb_grpc.LockServiceStub(grpc.insecure_channel(addr))
    return channels[addr]

for line in sys.stdin:
    req = json.loads(line)
    started = time.monotonic()
    try:
        if req["op"] == "acquire":
            r = stub(req["addr"]).AcquireLock(pb.AcquireLockRequest(
                resource_name=req["resource"], owner_id=req["owner"],
                client_timeout_ms=req["timeout_ms"]), timeout=req["timeout_ms"] / 1000 + 5)
            out = {"acquired": r.acquired, "lease_id": r.lease_id, "error_message": r.error_message}
        else:
            r = stub(req["addr"]).ReleaseLock(pb.ReleaseLockRequest(
                resource_name=req["resource"], lease_id=req["lease_id"]), timeout=15)
            out = {"released": r.released, "error_message": r.error_message}
    except grpc.RpcError as e:
        out = {"rpc_error": str(e.code()), "details": e.details()}
    out["elapsed_ms"] = (time.monotonic() - started) * 1000
    print(json.dumps(out), flush=True)
"#;

fn python_has_grpc() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import grpc, grpc_tools.protoc"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Makes sure `python3` can import grpcio and grpcio-tools, installing them from PyPI if needed.
fn ensure_python_grpc() {
    if python_has_grpc() {
        return;
    }
    let install = std::process::Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "grpcio", "grpcio-tools"])
        .output()
        .unwrap_or_else(|e| panic!("python3 is required for this test and cannot run: {e}"));
    assert!(
        python_has_grpc(),
        "this test needs python3 with grpcio and grpcio-tools; `pip install grpcio grpcio-tools` \
         failed ({}): {}",
        install.status,
        String::from_utf8_lossy(&install.stderr)
    );
}

/// Generates the Python client from the seed's proto file into `out`.
fn generate_client(out: &Path) {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("proto/seed004");
    let generated = std::process::Command::new("python3")
        .args(["-m", "grpc_tools.protoc"])
        .arg(format!("-I{}", proto_root.display()))
        .arg(format!("--python_out={}", out.display()))
        .arg(format!("--grpc_python_out={}", out.display()))
        .arg("api/lock_service.proto")
        .current_dir(&proto_root)
        .output()
        .expect("run grpc_tools.protoc");
    assert!(
        generated.status.success(),
        "grpc_tools.protoc failed on the seed's proto: {}",
        String::from_utf8_lossy(&generated.stderr)
    );
    assert!(out.join("api/lock_service_pb2_grpc.py").exists());
}

struct SeedClient {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl SeedClient {
    async fn start(dir: &Path) -> SeedClient {
        let script = dir.join("seed_client.py");
        std::fs::write(&script, CLIENT_PY).unwrap();
        let mut child = Command::new("python3")
            .arg(&script)
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the python client");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        SeedClient {
            _child: child,
            stdin,
            stdout,
        }
    }

    async fn call(&mut self, request: Value) -> Value {
        let line = format!("{request}\n");
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(30), self.stdout.read_line(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("no answer to {request} within 30 s"))
            .unwrap();
        let answer: Value = serde_json::from_str(&answer).unwrap_or_else(|_| {
            panic!("python client died or misbehaved on {request}: {answer:?}")
        });
        assert!(
            answer.get("rpc_error").is_none(),
            "the seed's calls always complete with status OK: {request} -> {answer}"
        );
        answer
    }

    async fn acquire(&mut self, addr: &str, resource: &str, owner: &str) -> Value {
        self.call(json!({"op": "acquire", "addr": addr, "resource": resource,
                         "owner": owner, "timeout_ms": 5000}))
            .await
    }

    async fn release(&mut self, addr: &str, resource: &str, lease_id: &str) -> Value {
        self.call(json!({"op": "release", "addr": addr, "resource": resource,
                         "lease_id": lease_id}))
            .await
    }
}

/// The lock as the leader's `/locks` shows it, or Null.
async fn lock_state(addr: &str, key: &str) -> Value {
    let locks = http_json(addr, &format!("/locks?prefix={key}"))
        .await
        .unwrap();
    locks["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["key"] == key)
        .cloned()
        .unwrap_or(Value::Null)
}

fn lease_of(answer: &Value) -> u64 {
    assert_eq!(answer["acquired"], true, "{answer}");
    assert_eq!(answer["error_message"], "", "{answer}");
    let lease = answer["lease_id"].as_str().unwrap();
    assert!(
        !lease.is_empty() && lease.bytes().all(|b| b.is_ascii_digit()),
        "lease_id is a decimal number: {answer}"
    );
    lease.parse().unwrap()
}

fn assert_refused(answer: &Value, flag: &str, needle: &str) {
    assert_eq!(answer[flag], false, "{answer}");
    let message = answer["error_message"].as_str().unwrap();
    assert!(
        message.contains(needle),
        "error_message names the reason ({needle:?}): {answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed004_python_client_acquires_and_releases() {
    ensure_python_grpc();
    let dir = tempfile::tempdir().unwrap();
    generate_client(dir.path());
    let mut client = SeedClient::start(dir.path()).await;

    let cluster = Cluster::start_with(3, |_| {
        vec!["--default-ttl".into(), format!("{DEFAULT_TTL_MS}ms")]
    });
    let leader = cluster.wait_for_leader(LEADER_TIMEOUT).await;
    // The seed's client knows one address and follows no redirects: point it at a follower,
    // which forwards to the leader. The lock state is read from the leader.
    let leader_addr = cluster.nodes[(leader - 1) as usize].client_addr();
    let addr = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .expect("a follower")
        .client_addr();
    let deadline = std::time::Instant::now() + LEADER_TIMEOUT;
    while http_json(&addr, "/status").await.unwrap_or(Value::Null)["leaderId"] != leader {
        assert!(
            std::time::Instant::now() < deadline,
            "follower never learned the leader"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let key = "settlement-batch-20260101";

    // Bad input is refused and changes nothing.
    let answer = client.acquire(&addr, "", "worker-a").await;
    assert_refused(&answer, "acquired", "INVALID_REQUEST");
    let answer = client.acquire(&addr, key, "").await;
    assert_refused(&answer, "acquired", "INVALID_REQUEST");
    assert_eq!(lock_state(&leader_addr, key).await, Value::Null);

    // Granted: lease_id is the fencing token in decimal, held with the default TTL.
    let answer = client.acquire(&addr, key, "worker-a").await;
    let lease_a = lease_of(&answer);
    let state = lock_state(&leader_addr, key).await;
    assert_eq!(state["holder"], "worker-a", "{state}");
    assert_eq!(state["fencingToken"], lease_a, "{state}");
    assert_eq!(state["ttlMs"], DEFAULT_TTL_MS, "{state}");

    // Contention: like the seed's `INSERT … IF NOT EXISTS`, a second owner is refused at once
    // (not queued, no waiting for the holder).
    let answer = client.acquire(&addr, key, "worker-b").await;
    assert_refused(&answer, "acquired", "held by another owner");
    assert_eq!(answer["lease_id"], "", "{answer}");
    assert!(
        answer["elapsed_ms"].as_f64().unwrap() < 3000.0,
        "AcquireLock does not wait for the holder: {answer}"
    );
    // The same owner again: not re-entrant, and the message names the lease it holds.
    let answer = client.acquire(&addr, key, "worker-a").await;
    assert_refused(&answer, "acquired", &format!("lease_id {lease_a}"));
    let state = lock_state(&leader_addr, key).await;
    assert_eq!(state["holder"], "worker-a", "{state}");
    assert_eq!(state["waiters"], json!([]), "nobody queued: {state}");

    // Releases with a wrong lease id, a lease id that is no number, or the wrong resource are
    // refused and change nothing.
    let answer = client
        .release(&addr, key, &(lease_a + 1000).to_string())
        .await;
    assert_refused(&answer, "released", "not the current lease");
    let not_numbers = ["", "abc", "-1", "+1", "99999999999999999999999"]
        .map(String::from)
        .into_iter()
        .chain([format!(" {lease_a}"), format!("{lease_a}.0")]);
    for bad in not_numbers {
        let answer = client.release(&addr, key, &bad).await;
        assert_refused(&answer, "released", "is not a lease id");
    }
    let answer = client
        .release(&addr, "another-resource", &lease_a.to_string())
        .await;
    assert_refused(&answer, "released", "not held");
    let answer = client.release(&addr, "", &lease_a.to_string()).await;
    assert_refused(&answer, "released", "INVALID_REQUEST");
    let state = lock_state(&leader_addr, key).await;
    assert_eq!(state["holder"], "worker-a", "{state}");
    assert_eq!(state["fencingToken"], lease_a, "{state}");

    // The right lease id releases.
    let answer = client.release(&addr, key, &lease_a.to_string()).await;
    assert_eq!(answer["released"], true, "{answer}");
    assert_eq!(answer["error_message"], "", "{answer}");
    assert_eq!(lock_state(&leader_addr, key).await, Value::Null);
    // Once only.
    let answer = client.release(&addr, key, &lease_a.to_string()).await;
    assert_refused(&answer, "released", "not held");

    // Now the second owner gets it, with a higher fencing token.
    let answer = client.acquire(&addr, key, "worker-b").await;
    let lease_b = lease_of(&answer);
    assert!(lease_b > lease_a, "{lease_b} > {lease_a}");
    // worker-a's old lease cannot release worker-b's lock.
    let answer = client.release(&addr, key, &lease_a.to_string()).await;
    assert_refused(&answer, "released", "not the current lease");
    let state = lock_state(&leader_addr, key).await;
    assert_eq!(state["holder"], "worker-b", "{state}");
    assert_eq!(state["fencingToken"], lease_b, "{state}");
    let answer = client.release(&addr, key, &lease_b.to_string()).await;
    assert_eq!(answer["released"], true, "{answer}");

    // The seed's calls carry no request id and are answered at once: the cluster keeps none of
    // their answers, so they take no room in the exactly-once table.
    let text = http_get(&leader_addr, "/metrics")
        .await
        .expect("/metrics")
        .1;
    assert_eq!(
        metric_sum(&text, "raftlock_answers_remembered ", &[]),
        0.0,
        "the seed's calls left answers in the table"
    );
}
