//! Writes the seed corpora under `fuzz/corpus/<target>/`: a handful of small, valid inputs per
//! fuzz target, made with the crate's own encoders so they stay in step with the formats. Run
//! once from `fuzz/` (a plain, uninstrumented build):
//!
//! ```sh
//! cargo run --release --example gen_corpus
//! ```
//!
//! Each seed has a fixed name, so running it again rewrites the same files.

use std::path::Path;

use bytes::Bytes;
use prost::Message as _;
use raftlock::lock::{Command, FencingToken, Limits, LockStateMachine};
use raftlock::node::api::{ApiError, ClientOp, ClientReply, ErrorCode, QueuedInfo};
use raftlock::raft::{
    Config, Entry, EntryPayload, HardState, InitialState, Membership, MembershipChange, Message,
    MessageBody, Raft, Role, SnapshotMeta,
};
use raftlock::server::convert::message_to_pb;
use raftlock::server::proto::{lock as lpb, peer as ppb, seed004 as spb};
use raftlock::storage::codec_fuzzing as codec;
use raftlock::storage::encode_snapshot_data;
use raftlock_fuzz::small_limits;

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("corpus").join(target);
    std::fs::create_dir_all(&dir).expect("corpus dir");
    std::fs::write(dir.join(name), bytes).expect("write seed");
}

fn ws_request() {
    let seeds: &[(&str, &str)] = &[
        (
            "acquire",
            r#"{"commandType":3,"key":"k","clientId":"c","ttl":1000}"#,
        ),
        (
            "acquire-full",
            r#"{"commandType":3,"key":"orders","clientId":"worker-7","requestId":"r-1","ttl":30000,"waitTimeout":5000,"redirect":true,"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#,
        ),
        (
            "release",
            r#"{"commandType":4,"key":"k","clientId":"c","requestId":"r-2","fencingToken":{"key":"k","value":1}}"#,
        ),
        (
            "release-held",
            r#"{"commandType":4,"key":"k","clientId":"c"}"#,
        ),
        (
            "renew",
            r#"{"commandType":5,"key":"k","clientId":"c","requestId":"r-3","fencingToken":{"value":1},"ttl":2000}"#,
        ),
        (
            "cancel-wait",
            r#"{"commandType":6,"key":"k","clientId":"c","requestId":"r-1"}"#,
        ),
        (
            "put-guarded",
            r#"{"commandType":2,"key":"cfg","clientId":"c","requestId":"r-4","value":"v1","fencingToken":{"key":"k","value":1}}"#,
        ),
        (
            "delete",
            r#"{"commandType":2,"key":"cfg","clientId":"c","delete":true}"#,
        ),
        ("read", r#"{"commandType":7,"key":"cfg"}"#),
        (
            "membership",
            r#"{"commandType":1,"key":"k","clientId":"c"}"#,
        ),
        (
            "unknown-type",
            r#"{"commandType":99,"key":"k","clientId":"c"}"#,
        ),
        (
            "unknown-field",
            r#"{"commandType":3,"key":"k","clientId":"c","shiny":[1,2]}"#,
        ),
        (
            "ttl-zero",
            r#"{"commandType":3,"key":"k","clientId":"c","ttl":0}"#,
        ),
        ("wrong-type", r#"{"commandType":"3","key":7}"#),
        ("not-json", r#"{"commandType":3,"key":"k""#),
        (
            "acknowledging",
            r#"{"commandType":3,"key":"k","clientId":"c","requestId":"7","ackBelow":5,"ttl":1000}"#,
        ),
        (
            "escapes",
            r#"{"commandType":3,"key":"\u00e9\ud83d\ude00\n","clientId":"\"c\""}"#,
        ),
        (
            "keepalive",
            r#"{"commandType":13,"clientId":"c","session":0,"ttl":5000,"requestId":"k1"}"#,
        ),
        (
            "end-session",
            r#"{"commandType":14,"clientId":"c","session":42,"requestId":"e1"}"#,
        ),
        (
            "acquire-read",
            r#"{"commandType":15,"key":"rw/doc","clientId":"c1","requestId":"r1","ttl":5000,"mode":"read"}"#,
        ),
        (
            "acquire-permit",
            r#"{"commandType":15,"key":"sem/pool","clientId":"c1","requestId":"r2","ttl":5000,"waitTimeout":0,"mode":"permit","permits":3}"#,
        ),
        (
            "set-permits",
            r#"{"commandType":16,"key":"sem/pool","clientId":"admin","requestId":"r3","permits":2}"#,
        ),
    ];
    for (name, text) in seeds {
        write("ws_request", name, text.as_bytes());
    }
}

fn grpc_messages() {
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        (
            "acquire",
            lpb::AcquireLockRequest {
                resource_name: "orders".into(),
                owner_id: "worker-7".into(),
                client_timeout_ms: 5_000,
                request_id: "r-1".into(),
                ttl_ms: 30_000,
                ack_below: None,
            }
            .encode_to_vec(),
        ),
        (
            "acquire-acknowledging",
            lpb::AcquireLockRequest {
                resource_name: "orders".into(),
                owner_id: "worker-7".into(),
                client_timeout_ms: 5_000,
                request_id: "12".into(),
                ttl_ms: 30_000,
                ack_below: Some(11),
            }
            .encode_to_vec(),
        ),
        (
            "acquire-negative-timeout",
            lpb::AcquireLockRequest {
                resource_name: "k".into(),
                owner_id: "c".into(),
                client_timeout_ms: -1,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "release",
            lpb::ReleaseLockRequest {
                resource_name: "orders".into(),
                owner_id: "worker-7".into(),
                fencing_token: 17,
                request_id: "r-2".into(),
                ack_below: None,
            }
            .encode_to_vec(),
        ),
        (
            "renew",
            lpb::RenewLockRequest {
                resource_name: "orders".into(),
                owner_id: "worker-7".into(),
                fencing_token: 17,
                ttl_ms: 10_000,
                request_id: "r-3".into(),
                ack_below: Some(3),
            }
            .encode_to_vec(),
        ),
        (
            "seed-acquire",
            spb::AcquireLockRequest {
                resource_name: "orders".into(),
                owner_id: "svc-a".into(),
                client_timeout_ms: 250,
            }
            .encode_to_vec(),
        ),
        (
            "seed-release",
            spb::ReleaseLockRequest {
                resource_name: "orders".into(),
                lease_id: "18446744073709551615".into(),
            }
            .encode_to_vec(),
        ),
        (
            "seed-release-bad-lease",
            spb::ReleaseLockRequest {
                resource_name: "orders".into(),
                lease_id: "+0x10".into(),
            }
            .encode_to_vec(),
        ),
    ];
    for (name, bytes) in seeds {
        write("grpc_messages", name, &bytes);
    }
}

fn sample_entries() -> Vec<Entry> {
    let acquire = Command::Acquire {
        key: "k".into(),
        client_id: "c".into(),
        request_id: "r-1".into(),
        ttl_ms: 1_000,
        wait_timeout_ms: None,
    };
    vec![
        Entry {
            term: 0,
            index: 1,
            payload: EntryPayload::Config(Membership::with_voters([1, 2, 3])),
        },
        Entry {
            term: 2,
            index: 2,
            payload: EntryPayload::Noop,
        },
        Entry {
            term: 2,
            index: 3,
            payload: EntryPayload::Command(Bytes::from(acquire.encode())),
        },
        Entry {
            term: 2,
            index: 4,
            payload: EntryPayload::Membership(MembershipChange::AddLearner(4)),
        },
        Entry {
            term: 3,
            index: 5,
            payload: EntryPayload::Membership(MembershipChange::RemoveServer(2)),
        },
    ]
}

fn peer_messages() {
    let mut membership = Membership::with_voters([1, 2, 3]);
    membership.learners.insert(4);
    let bodies = vec![
        (
            "vote",
            MessageBody::Vote {
                pre_vote: true,
                last_log_index: 5,
                last_log_term: 2,
                leadership_transfer: false,
            },
        ),
        (
            "vote-reply",
            MessageBody::VoteResponse {
                pre_vote: false,
                granted: true,
            },
        ),
        (
            "append",
            MessageBody::Append {
                prev_log_index: 0,
                prev_log_term: 0,
                entries: sample_entries(),
                leader_commit: 3,
            },
        ),
        (
            "append-reply",
            MessageBody::AppendResponse {
                success: false,
                match_index: Default::default(),
                rejected_index: 9,
                recovery_index: 3,
                recovery_term: 2,
            },
        ),
        (
            "heartbeat",
            MessageBody::Heartbeat {
                commit: 3,
                read_seq: 7,
            },
        ),
        (
            "heartbeat-reply",
            MessageBody::HeartbeatResponse { read_seq: 7 },
        ),
        (
            "install-snapshot",
            MessageBody::InstallSnapshot {
                meta: SnapshotMeta {
                    index: 9,
                    term: 2,
                    membership,
                },
                offset: 0,
                data: snapshot_data(),
                done: true,
                total_len: snapshot_data().len() as u64,
            },
        ),
        (
            "install-snapshot-reply",
            MessageBody::InstallSnapshotResponse {
                snapshot_index: 9,
                next_offset: 15,
                done: true,
            },
        ),
        ("timeout-now", MessageBody::TimeoutNow),
    ];
    for (name, body) in bodies {
        let msg = Message {
            from: 1,
            to: 2,
            term: 3,
            body,
        };
        let mut bytes = vec![0];
        bytes.extend(message_to_pb(&msg).encode_to_vec());
        write("peer_messages", &format!("raft-{name}"), &bytes);
    }
    // A message without a body, and an entry without a payload: both must be errors.
    let mut bytes = vec![0];
    bytes.extend(
        ppb::RaftMessage {
            from: 1,
            to: 2,
            term: 1,
            body: Some(ppb::raft_message::Body::Append(ppb::AppendEntries {
                entries: vec![ppb::Entry {
                    term: 1,
                    index: 1,
                    payload: None,
                }],
                ..Default::default()
            })),
        }
        .encode_to_vec(),
    );
    write("peer_messages", "raft-entry-without-payload", &bytes);

    let ops = vec![
        ClientOp::Acquire {
            key: "k".into(),
            client_id: "c".into(),
            request_id: "r-1".into(),
            ttl_ms: 1_000,
            wait_timeout_ms: Some(0),
        },
        ClientOp::Release {
            key: "k".into(),
            client_id: "c".into(),
            request_id: "r-2".into(),
            token: 1,
        },
        ClientOp::ReleaseHeld {
            key: "k".into(),
            client_id: "c".into(),
            request_id: "r-3".into(),
        },
        ClientOp::Renew {
            key: "k".into(),
            client_id: "c".into(),
            request_id: "r-4".into(),
            token: 1,
            ttl_ms: 2_000,
        },
        ClientOp::CancelWait {
            key: "k".into(),
            client_id: "c".into(),
            request_id: "r-1".into(),
        },
        ClientOp::Put {
            key: "cfg".into(),
            value: b"v".to_vec(),
            guard: Some(FencingToken {
                key: "k".into(),
                value: 1,
            }),
            client_id: "c".into(),
            request_id: "r-5".into(),
        },
        ClientOp::Delete {
            key: "cfg".into(),
            guard: None,
            client_id: "c".into(),
            request_id: "r-6".into(),
        },
        ClientOp::Get { key: "cfg".into() },
    ];
    for (i, op) in ops.iter().enumerate() {
        let json = serde_json::to_vec(op).expect("op json");
        let mut forwarded = vec![1];
        forwarded.extend(
            ppb::ForwardClientRequest {
                op_json: json.clone(),
                from_node: 2,
            }
            .encode_to_vec(),
        );
        write(
            "peer_messages",
            &format!("forward-{i}-{}", op.name()),
            &forwarded,
        );
        let mut bare = vec![2];
        bare.extend(json);
        write(
            "peer_messages",
            &format!("op-json-{i}-{}", op.name()),
            &bare,
        );
    }

    let token = FencingToken {
        key: "k".into(),
        value: 7,
    };
    let mut not_leader = ApiError::new(ErrorCode::NotLeader, "not the leader");
    not_leader.leader_id = 2;
    not_leader.leader_addr = "127.0.0.1:8082".into();
    let mut held = ApiError::new(ErrorCode::AlreadyHeld, "already held");
    held.current_token = Some(7);
    let replies = vec![
        ClientReply::Granted {
            token: token.clone(),
            expires_in_ms: 1_000,
            queued: Some(QueuedInfo {
                position: 2,
                waited_ms: 30,
            }),
            leader: false,
        },
        ClientReply::Released,
        ClientReply::Renewed {
            token,
            expires_in_ms: 500,
            leader: true,
        },
        ClientReply::WaitCancelled,
        ClientReply::Deleted { existed: true },
        ClientReply::Value(Some(b"v".to_vec())),
        ClientReply::Error(not_leader),
        ClientReply::Error(held),
    ];
    for (i, reply) in replies.iter().enumerate() {
        let mut bytes = vec![3];
        bytes.extend(serde_json::to_vec(reply).expect("reply json"));
        write(
            "peer_messages",
            &format!("reply-json-{i}-{}", reply.result_label()),
            &bytes,
        );
    }

    let rpcs: Vec<(&str, Vec<u8>)> = vec![
        (
            "join",
            ppb::JoinClusterRequest {
                server_id: 4,
                server_addr: "127.0.0.1:8084".into(),
                client_addr: "127.0.0.1:50054".into(),
                // 0 (not said) leaves the field out, as before it existed.
                version: 0,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "peer-list-reply",
            ppb::FetchPeerListReply {
                success: true,
                term: 3,
                leader_id: 1,
                leader_addr: "127.0.0.1:8081".into(),
                peer_set: vec![1, 2, 3],
                peer_address: [(1, "127.0.0.1:8081".to_string())].into_iter().collect(),
                client_address: [(1, "127.0.0.1:50051".to_string())].into_iter().collect(),
                commit_index: 0,
                match_index: Default::default(),
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "append-data",
            ppb::AppendDataRequest {
                key: "cfg".into(),
                value: b"v".to_vec(),
                delete: false,
                client_id: "c".into(),
                request_id: "r-7".into(),
            }
            .encode_to_vec(),
        ),
        (
            "remove-reply",
            ppb::RemoveServerReply {
                success: false,
                leader_id: 1,
                leader_addr: "127.0.0.1:8081".into(),
                error: "not the leader".into(),
            }
            .encode_to_vec(),
        ),
    ];
    for (name, body) in rpcs {
        let mut bytes = vec![4];
        bytes.extend(body);
        write("peer_messages", &format!("rpc-{name}"), &bytes);
    }
}

fn acquire(key: &str, client: &str, request: &str, wait: Option<u64>) -> Command {
    Command::Acquire {
        key: key.into(),
        client_id: client.into(),
        request_id: request.into(),
        ttl_ms: 1_000,
        wait_timeout_ms: wait,
    }
}

fn token(key: &str, value: u64) -> FencingToken {
    FencingToken {
        key: key.into(),
        value,
    }
}

/// Sequences of commands that reach the interesting paths: hand-off, renew, expiry, guarded
/// writes, cancel, dedupe replays, reused request ids, limits, session ticks.
fn command_sequences() -> Vec<(&'static str, u8, Vec<Command>)> {
    let put = |request: &str| Command::Put {
        key: "k".into(),
        value: b"v".to_vec(),
        guard: None,
        client_id: "c".into(),
        request_id: request.into(),
    };
    let sequenced = |ack_below: u64, command: Command| Command::Sequenced {
        ack_below,
        command: Box::new(command),
    };
    vec![
        (
            "handoff",
            0,
            vec![
                acquire("k", "a", "1", None),
                acquire("k", "b", "1", Some(5_000)),
                Command::Release {
                    key: "k".into(),
                    client_id: "a".into(),
                    request_id: "2".into(),
                    token: token("k", 1),
                },
                Command::Renew {
                    key: "k".into(),
                    client_id: "b".into(),
                    request_id: "2".into(),
                    token: token("k", 2),
                    ttl_ms: 3_000,
                },
            ],
        ),
        (
            "expire",
            0,
            vec![
                acquire("k", "a", "1", None),
                acquire("k", "b", "1", None),
                Command::ExpireLease {
                    key: "k".into(),
                    token: 1,
                    lease_index: 1,
                },
                Command::Expire {
                    key: "k".into(),
                    token: 2,
                },
            ],
        ),
        (
            "guarded-writes",
            0,
            vec![
                acquire("lock", "a", "1", Some(0)),
                Command::Put {
                    key: "cfg".into(),
                    value: b"v1".to_vec(),
                    guard: Some(token("lock", 1)),
                    client_id: "a".into(),
                    request_id: "2".into(),
                },
                Command::Delete {
                    key: "cfg".into(),
                    guard: Some(token("lock", 9)),
                    client_id: "a".into(),
                    request_id: "3".into(),
                },
                Command::ReleaseHeld {
                    key: "lock".into(),
                    client_id: "a".into(),
                    request_id: "4".into(),
                },
            ],
        ),
        (
            "cancel-and-retry",
            0,
            vec![
                acquire("k", "a", "1", None),
                acquire("k", "b", "1", None),
                Command::CancelWait {
                    key: "k".into(),
                    client_id: "b".into(),
                    request_id: "1".into(),
                },
                acquire("k", "b", "1", None),
                // The same request id for another key: refused.
                acquire("other", "b", "1", None),
            ],
        ),
        (
            "sessions-small-limits",
            1,
            vec![
                Command::SetLimits {
                    limits: small_limits(),
                },
                acquire("k1", "a", "1", None),
                acquire("k2", "b", "1", None),
                acquire("k3", "c", "1", None),
                acquire("k4", "d", "1", None),
                Command::Tick { elapsed_ms: 3_000 },
                acquire("k5", "e", "1", None),
                Command::Tick { elapsed_ms: 10_000 },
                acquire("k1", "f", "1", Some(0)),
            ],
        ),
        (
            "limits-v1",
            0,
            vec![
                Command::SetLimitsV1 {
                    limits: raftlock::lock::LimitsV1 {
                        key_bytes_max: 8,
                        value_bytes_max: 8,
                        id_bytes_max: 8,
                        ttl_ms_max: 10_000,
                        wait_timeout_ms_max: 10_000,
                        waiters_per_key_max: 2,
                        locks_held_max: 2,
                        data_entries_max: 2,
                        dedupe_entries_max: 4,
                    },
                },
                acquire("k", "a", "1", None),
                acquire("k", "b", "1", None),
                acquire("k", "c", "1", None),
                acquire("k", "d", "1", None),
            ],
        ),
        (
            "acknowledged",
            0,
            vec![
                Command::SetClusterVersion { version: 3 },
                sequenced(1, put("1")),
                sequenced(2, put("2")),
                // A late copy of request 1, acknowledged by request 2.
                sequenced(1, put("1")),
            ],
        ),
    ]
}

fn command_apply() {
    for (name, flags, commands) in command_sequences() {
        let mut bytes = vec![flags];
        for command in &commands {
            let encoded = command.encode();
            bytes.extend((encoded.len() as u16).to_le_bytes());
            bytes.extend(encoded);
        }
        write("command_apply", name, &bytes);
    }
}

/// Snapshot data of a small state: a held lock, a waiter, a value, dedupe records.
fn snapshot_data() -> Bytes {
    let mut sm = LockStateMachine::new(Limits::default());
    let (_, _, commands) = command_sequences().swap_remove(0);
    for (i, command) in commands.iter().take(2).enumerate() {
        sm.apply(i as u64 + 1, command);
    }
    sm.apply(
        3,
        &Command::Put {
            key: "cfg".into(),
            value: b"v".to_vec(),
            guard: None,
            client_id: "a".into(),
            request_id: "9".into(),
        },
    );
    sm.apply(4, &Command::Tick { elapsed_ms: 1_000 });
    let pairs = sm.to_kv();
    encode_snapshot_data(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())))
}

fn storage_codec() {
    let mut seeds: Vec<(String, u8, Vec<u8>)> = Vec::new();
    for entry in sample_entries() {
        seeds.push((
            format!("entry-{}", entry.index),
            0,
            codec::encode_entry(&entry),
        ));
    }
    let hard_state = HardState {
        term: 7,
        vote: 3,
        commit: 42,
    };
    seeds.push((
        "hard-state".into(),
        1,
        codec::encode_hard_state(&hard_state),
    ));
    seeds.push(("snapshot-point".into(), 2, codec::encode_index_term(9, 4)));
    seeds.push(("u64".into(), 3, codec::encode_u64(123_456)));
    let mut membership = Membership::with_voters([1, 2, 3]);
    membership.learners.insert(9);
    seeds.push((
        "membership".into(),
        4,
        codec::encode_membership(&membership),
    ));
    seeds.push((
        "state-value".into(),
        5,
        codec::encode_state_value(b"some state"),
    ));
    seeds.push(("log-key".into(), 6, codec::index_key(42).to_vec()));
    seeds.push(("snapshot-data".into(), 7, snapshot_data().to_vec()));
    seeds.push((
        "snapshot-data-empty".into(),
        7,
        encode_snapshot_data(std::iter::empty()).to_vec(),
    ));
    for (name, which, body) in seeds {
        let mut bytes = vec![which];
        bytes.extend(&body);
        write("storage_codec", &name, &bytes);
        // The same record without its checksum, for the target to add (first byte + 8).
        let unsealed = match which {
            6 => continue,
            7 => &body[..body.len() - 4],
            _ => &body[4..],
        };
        let mut bytes = vec![which + 8];
        bytes.extend(unsealed);
        write("storage_codec", &format!("{name}-unsealed"), &bytes);
    }
}

/// One `raft_step` chunk: 2-byte length, action byte, rest.
fn step_chunk(out: &mut Vec<u8>, action: u8, rest: &[u8]) {
    out.extend(((rest.len() + 1) as u16).to_le_bytes());
    out.push(action);
    out.extend(rest);
}

fn msg(from: u64, term: u64, body: MessageBody) -> Message {
    Message {
        from,
        to: 1,
        term,
        body,
    }
}

fn raft_step() {
    let grant = |pre_vote| MessageBody::VoteResponse {
        pre_vote,
        granted: true,
    };
    let append_ok = |match_index| MessageBody::AppendResponse {
        success: true,
        match_index,
        rejected_index: 0,
        recovery_index: 0,
        recovery_term: 0,
    };
    let command = Command::Tick { elapsed_ms: 1 }.encode();
    // Node 1 becomes leader (pre-vote, vote), commits its no-op and a proposal, heartbeats,
    // and is asked to hand over leadership.
    let leader: Vec<(u8, Vec<u8>)> = vec![
        (1, vec![]),
        (3, message_to_pb(&msg(2, 1, grant(true))).encode_to_vec()),
        (3, message_to_pb(&msg(2, 1, grant(false))).encode_to_vec()),
        (3, message_to_pb(&msg(2, 1, append_ok(2))).encode_to_vec()),
        (2, command.clone()),
        (3, message_to_pb(&msg(3, 1, append_ok(3))).encode_to_vec()),
        (0, vec![5]),
        (
            3,
            message_to_pb(&msg(2, 1, MessageBody::HeartbeatResponse { read_seq: 1 }))
                .encode_to_vec(),
        ),
        (
            3,
            message_to_pb(&msg(2, 2, MessageBody::TimeoutNow)).encode_to_vec(),
        ),
    ];
    let mut entries = sample_entries();
    entries.retain(|e| e.index > 1);
    for (i, e) in entries.iter_mut().enumerate() {
        e.index = i as u64 + 2;
        e.term = 1;
    }
    let follower: Vec<(u8, Vec<u8>)> = vec![
        (
            3,
            message_to_pb(&msg(
                2,
                1,
                MessageBody::Append {
                    prev_log_index: 1,
                    prev_log_term: 0,
                    entries,
                    leader_commit: 3,
                },
            ))
            .encode_to_vec(),
        ),
        (
            3,
            message_to_pb(&msg(
                2,
                1,
                MessageBody::Heartbeat {
                    commit: 5,
                    read_seq: 4,
                },
            ))
            .encode_to_vec(),
        ),
        (0, vec![30]),
        (
            3,
            message_to_pb(&msg(
                3,
                2,
                MessageBody::Vote {
                    pre_vote: true,
                    last_log_index: 5,
                    last_log_term: 1,
                    leadership_transfer: false,
                },
            ))
            .encode_to_vec(),
        ),
    ];
    let snapshot: Vec<(u8, Vec<u8>)> = vec![(
        3,
        message_to_pb(&msg(
            2,
            3,
            MessageBody::InstallSnapshot {
                meta: SnapshotMeta {
                    index: 9,
                    term: 2,
                    membership: Membership::with_voters([1, 2, 3]),
                },
                offset: 0,
                data: snapshot_data(),
                done: true,
                total_len: snapshot_data().len() as u64,
            },
        ))
        .encode_to_vec(),
    )];
    for (name, actions) in [
        ("leader", leader),
        ("follower", follower),
        ("install-snapshot", snapshot),
    ] {
        let mut bytes = Vec::new();
        for (action, rest) in &actions {
            step_chunk(&mut bytes, *action, rest);
        }
        write("raft_step", name, &bytes);
        // Replay it the way the target does, to show where the seed leads.
        let initial = InitialState {
            initial_membership: Membership::with_voters([1, 2, 3]),
            ..Default::default()
        };
        let mut raft = Raft::new(Config::new(1, 7), initial).expect("config");
        let drain = |raft: &mut Raft| {
            while raft.has_ready() {
                let ready = raft.ready();
                raft.advance(ready);
            }
        };
        drain(&mut raft);
        let mut roles: Vec<Role> = Vec::new();
        for (action, rest) in actions {
            match action {
                0 => (0..rest[0]).for_each(|_| {
                    raft.tick();
                    drain(&mut raft);
                }),
                1 => raft.campaign_now(),
                2 => {
                    let _ = raft.propose(vec![Bytes::from(rest)]);
                }
                _ => {
                    let raw = ppb::RaftMessage::decode(rest.as_slice()).expect("decodes");
                    raft.step(raftlock::server::convert::message_from_pb(raw).expect("converts"));
                }
            }
            drain(&mut raft);
            roles.push(raft.role());
        }
        println!(
            "raft_step seed {name}: roles {roles:?}, term {}, commit {}, last index {}",
            raft.term(),
            raft.commit_index(),
            raft.last_index()
        );
    }
}

fn main() {
    raft_step();
    ws_request();
    grpc_messages();
    peer_messages();
    command_apply();
    storage_codec();
    for target in [
        "ws_request",
        "grpc_messages",
        "peer_messages",
        "command_apply",
        "storage_codec",
        "raft_step",
    ] {
        let count = std::fs::read_dir(Path::new("corpus").join(target))
            .map(|d| d.count())
            .unwrap_or(0);
        println!("corpus/{target}: {count} files");
    }
}
