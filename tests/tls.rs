//! TLS with real processes on 127.0.0.1: a cluster whose peers speak mutual TLS and whose client
//! port speaks TLS, with certificates from `lockctl certs`. Peers without a certificate from the
//! cluster's peer CA (a client certificate from the client CA included) cannot join, talk Raft or
//! remove a member; a peer with a valid certificate cannot speak for another node id; the
//! operator certificate removes a member through `lockctl members remove`; certificates rotated
//! on disk under load are taken without a restart and without losing the cluster; a client port
//! with `--client-tls-ca client-ca.pem` takes only certificates from the client CA.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use raftlock::client::http::get_json_with;
use raftlock::client::{RaftLockClient, RetryPolicy, TlsConfig};
use raftlock::server::proto::peer::peer_client::PeerClient;
use raftlock::server::proto::peer::{JoinClusterRequest, RaftMessage, RemoveServerRequest};
use raftlock::server::tls::{PeerTls, TlsFiles, DEFAULT_NODE_NAME};
use raftlock::server::transport::PeerDialer;
use serde_json::Value;

const LEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `lockctl certs` into `dir` for `nodes` (a CA already there is kept).
fn issue(dir: &Path, nodes: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockctl"))
        .args([
            "certs",
            "--out",
            &dir.display().to_string(),
            "--nodes",
            nodes,
        ])
        .args(["--hosts", "127.0.0.1"])
        .output()
        .expect("run lockctl certs");
    assert!(
        out.status.success(),
        "lockctl certs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn path(dir: &Path, name: &str) -> String {
    dir.join(name).display().to_string()
}

/// The flags of node `id` for peer mutual TLS and client-port TLS from `dir`.
fn tls_flags(dir: &Path, id: u64) -> Vec<String> {
    vec![
        "--peer-tls-cert".into(),
        path(dir, &format!("node-{id}.pem")),
        "--peer-tls-key".into(),
        path(dir, &format!("node-{id}-key.pem")),
        "--peer-tls-ca".into(),
        path(dir, "ca.pem"),
        "--client-tls-cert".into(),
        path(dir, "client-port.pem"),
        "--client-tls-key".into(),
        path(dir, "client-port-key.pem"),
    ]
}

fn client_tls(dir: &Path) -> TlsConfig {
    raftlock::tls::client_config(&dir.join("ca.pem"), None).unwrap()
}

/// A peer-port dialer holding the certificate `cert` of `dir`.
fn dialer(dir: &Path, cert: &str) -> PeerDialer {
    dialer_with_ca(dir, cert, "ca.pem")
}

/// A peer-port dialer holding the certificate `cert` of `dir` and trusting the CA file `ca`.
fn dialer_with_ca(dir: &Path, cert: &str, ca: &str) -> PeerDialer {
    let files = TlsFiles {
        cert: dir.join(format!("{cert}.pem")),
        key: dir.join(format!("{cert}-key.pem")),
        ca: Some(dir.join(ca)),
    };
    PeerDialer {
        cluster_token: String::new(),
        tls: Some(PeerTls::load(files, DEFAULT_NODE_NAME, None).unwrap()),
        // A node's certificate speaks for that node.
        from_node: cert
            .strip_prefix("node-")
            .and_then(|id| id.parse().ok())
            .unwrap_or(0),
    }
}

async fn peer_client(
    dialer: &PeerDialer,
    addr: &str,
) -> Result<PeerClient<tonic::transport::Channel>, String> {
    let endpoint = PeerDialer::endpoint(addr)
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    dialer
        .connect(endpoint, None)
        .await
        .map(PeerClient::new)
        .map_err(|e| format!("{e:?}"))
}

async fn status(addr: &str, tls: &TlsConfig) -> Option<Value> {
    match get_json_with(addr, "/status", None, Some(tls)).await {
        Ok((200, v)) => Some(v),
        _ => None,
    }
}

async fn wait_for_leader(cluster: &Cluster, tls: &TlsConfig) -> u64 {
    let deadline = Instant::now() + LEADER_TIMEOUT;
    while Instant::now() < deadline {
        for node in cluster.nodes.iter().filter(|n| n.child.is_some()) {
            if let Some(s) = status(&node.client_addr(), tls).await {
                if s["role"] == "leader" {
                    return node.id;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no leader; logs in {}", cluster.dir.path().display());
}

/// The value of the first metric line starting with `prefix` on node `addr` (0 if absent or the
/// node does not answer, as a restarted node may not yet).
async fn metric(addr: &str, tls: &TlsConfig, prefix: &str) -> f64 {
    let Ok((_, body)) = raftlock::client::http::request_with(
        addr,
        "GET",
        "/metrics",
        None,
        Duration::from_secs(5),
        None,
        Some(tls),
    )
    .await
    else {
        return 0.0;
    };
    body.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn tls_client(cluster: &Cluster, dir: &Path, id: &str) -> RaftLockClient {
    RaftLockClient::builder()
        .endpoints(cluster.nodes.iter().map(|n| n.client_addr()))
        .client_id(id)
        .tls_ca_file(dir.join("ca.pem"))
        .request_timeout(Duration::from_secs(5))
        .retry_policy(RetryPolicy {
            max_elapsed: Duration::from_secs(30),
            ..RetryPolicy::default()
        })
        .build()
        .unwrap()
}

/// The certificate a TLS server at `addr` presents (verified against `config`'s CAs), as DER.
async fn presented_cert(addr: &str, config: Arc<rustls::ClientConfig>, name: &str) -> Vec<u8> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
    let stream = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .unwrap();
    stream.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn der_of(pem_file: &Path) -> Vec<u8> {
    raftlock::tls::load_certs(pem_file).unwrap()[0].to_vec()
}

/// A rustls client configuration presenting node `id`'s certificate (for the peer port).
fn as_node(dir: &Path, id: u64) -> Arc<rustls::ClientConfig> {
    let cert = dir.join(format!("node-{id}.pem"));
    let key = dir.join(format!("node-{id}-key.pem"));
    raftlock::tls::client_config(&dir.join("ca.pem"), Some((&cert, &key))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_need_a_certificate_from_the_cluster_ca_naming_their_node_id() {
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path().to_path_buf();
    issue(&dir, "1,2,3,5");
    let foreign = tempfile::tempdir().unwrap();
    issue(foreign.path(), "1,2,3");
    let flags_dir = dir.clone();
    let mut cluster = Cluster::start_with(3, move |n| tls_flags(&flags_dir, n.id));
    let tls = client_tls(&dir);
    let leader = wait_for_leader(&cluster, &tls).await;
    let leader_node = cluster.nodes.iter().find(|n| n.id == leader).unwrap();
    let leader_peer = leader_node.peer_addr();
    let leader_client = leader_node.client_addr();

    // Clients: TLS works, through a follower too (forwarded over the peers' mutual TLS);
    // plaintext on the TLS port gets no answer.
    let follower = cluster.nodes.iter().find(|n| n.id != leader).unwrap();
    let client = RaftLockClient::builder()
        .endpoints([follower.client_addr()])
        .client_id("tls-client")
        .tls_ca_file(dir.join("ca.pem"))
        // Through the follower, which forwards over the peers' mutual TLS.
        .prefer_leader(false)
        .build()
        .unwrap();
    let handle = client
        .acquire("tls/k")
        .await
        .expect("acquire over TLS via a follower");
    assert!(handle.fencing_token() > 0);
    handle.release().await.unwrap();
    assert!(
        raftlock::client::http::get_json(&leader_client, "/status")
            .await
            .is_err(),
        "a plaintext request on the TLS client port was answered"
    );
    // A client that trusts another CA refuses the node's certificate.
    assert!(status(&leader_client, &client_tls(foreign.path()))
        .await
        .is_none());

    // No certificate at all: plaintext HTTP/2 to the peer port gets nowhere.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{leader_peer}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect()
        .await;
    if let Ok(channel) = plain {
        let join = JoinClusterRequest {
            server_id: 9,
            server_addr: "127.0.0.1:1".into(),
            ..Default::default()
        };
        let refused = PeerClient::new(channel).join_cluster(join).await;
        assert!(
            refused.is_err(),
            "a plaintext join was answered: {refused:?}"
        );
    }

    // A certificate from another CA: the handshake fails, so no join, no Raft, no removal.
    let outsider = dialer(foreign.path(), "node-1");
    match peer_client(&outsider, &leader_peer).await {
        Err(_) => {}
        Ok(mut peer) => {
            let remove = peer
                .remove_server(RemoveServerRequest { server_id: 1 })
                .await;
            assert!(
                remove.is_err(),
                "a foreign certificate removed a member: {remove:?}"
            );
            let join = peer
                .join_cluster(JoinClusterRequest {
                    server_id: 1,
                    server_addr: "127.0.0.1:1".into(),
                    ..Default::default()
                })
                .await;
            assert!(join.is_err(), "a foreign certificate joined: {join:?}");
        }
    }

    // The client certificate is from the client CA, which the peer port does not trust.
    let client_cert = dialer_with_ca(&dir, "client", "ca.pem");
    match peer_client(&client_cert, &leader_peer).await {
        Err(_) => {}
        Ok(mut peer) => {
            let remove = peer
                .remove_server(RemoveServerRequest { server_id: 1 })
                .await;
            assert!(
                remove.is_err(),
                "the client certificate removed a member: {remove:?}"
            );
        }
    }

    // node-5's certificate is from the cluster CA, but it cannot speak for node 4 or node 2.
    let five = dialer(&dir, "node-5");
    let mut peer = peer_client(&five, &leader_peer)
        .await
        .expect("node 5's handshake");
    let status_code = peer
        .join_cluster(JoinClusterRequest {
            server_id: 4,
            server_addr: "127.0.0.1:1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err()
        .code();
    assert_eq!(status_code, tonic::Code::PermissionDenied);
    let mut request = tonic::Request::new(futures::stream::iter(Vec::<RaftMessage>::new()));
    request
        .metadata_mut()
        .insert("x-raftlock-node-id", "2".parse().unwrap());
    let status_code = peer.raft(request).await.unwrap_err().code();
    assert_eq!(status_code, tonic::Code::PermissionDenied);
    // Nor over a plain Raft stream; for its own id it is taken.
    for (id, taken) in [(2, false), (5, true)] {
        let tcp = tokio::net::TcpStream::connect(&leader_peer).await.unwrap();
        let mut io = five
            .tls
            .as_ref()
            .unwrap()
            .dial(tcp, Some(leader))
            .await
            .unwrap();
        let hello = raftlock::server::proto::peer::RaftStreamHello {
            node_id: id,
            ..Default::default()
        };
        match raftlock::server::peer_stream::dial(&mut io, &hello).await {
            Ok(()) => assert!(taken, "node 5's certificate spoke for node {id}"),
            Err(raftlock::server::peer_stream::DialError::Refused(why)) if !taken => {
                assert!(why.contains("does not name node 2"), "{why}")
            }
            other => {
                panic!("a plain raft stream for node {id} with node 5's certificate: {other:?}")
            }
        }
    }

    // A real lock-node started as node 4 with node 5's certificate never gets in.
    let mut impostor = NodeProc::new(4, cluster.dir.path().join("node4"));
    impostor.extra_args = vec!["--join".into(), leader_peer.clone()];
    impostor.extra_args.extend(tls_flags(&dir, 5));
    impostor.start();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s = status(&leader_client, &tls).await.expect("leader status");
    assert_eq!(s["voters"].as_array().unwrap().len(), 3, "{s}");
    assert!(s["learners"].as_array().is_none_or(|l| l.is_empty()), "{s}");
    let refused = metric(
        &leader_client,
        &tls,
        "raftlock_peer_requests_refused_total{reason=\"identity\"}",
    )
    .await;
    assert!(refused >= 3.0, "identity refusals counted: {refused}");
    impostor.kill();

    // The cluster still works: a lock through every node.
    for node in &cluster.nodes {
        let c = RaftLockClient::builder()
            .endpoints([node.client_addr()])
            .client_id(format!("after-{}", node.id))
            .tls_ca_file(dir.join("ca.pem"))
            .build()
            .unwrap();
        c.acquire("tls/after")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }

    // The operator certificate removes a follower with `lockctl members remove`.
    let removed = follower.id;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockctl"))
        .args(["members", "remove", "--id", &removed.to_string()])
        .args(["--via", &leader_peer])
        .args(["--peer-tls-cert", &path(&dir, "operator.pem")])
        .args(["--peer-tls-key", &path(&dir, "operator-key.pem")])
        .args(["--peer-tls-ca", &path(&dir, "ca.pem")])
        .env_remove("RAFTLOCK_CLUSTER_TOKEN")
        .output()
        .expect("run lockctl members remove");
    assert!(
        out.status.success(),
        "lockctl members remove with the operator certificate: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + LEADER_TIMEOUT;
    loop {
        let s = status(&leader_client, &tls).await.expect("leader status");
        let voters: Vec<u64> = s["voters"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_u64().or_else(|| v["id"].as_u64()))
            .collect();
        if voters.len() == 2 && !voters.contains(&removed) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {removed} still a voter: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.node(leader).kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_under_load_without_losing_the_cluster() {
    let certs = tempfile::tempdir().unwrap();
    let dir: PathBuf = certs.path().to_path_buf();
    issue(&dir, "1,2,3");
    let flags_dir = dir.clone();
    let mut cluster = Cluster::start_with(3, move |n| tls_flags(&flags_dir, n.id));
    let tls = client_tls(&dir);
    wait_for_leader(&cluster, &tls).await;
    let before_client = der_of(&dir.join("client-port.pem"));
    let before_peer = der_of(&dir.join("node-1.pem"));
    let node1_client = cluster.client_addr_of(1);
    let node1_peer = cluster.node(1).peer_addr();
    assert_eq!(
        presented_cert(&node1_client, tls.clone(), "127.0.0.1").await,
        before_client
    );

    // Load: four clients taking and releasing locks through every node until told to stop.
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let client = tls_client(&cluster, &dir, &format!("rotate-{w}"));
        let (done, stop) = (done.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            let mut i = 0u64;
            // Bounded: at most 100,000 cycles or until stopped.
            while !stop.load(Ordering::Relaxed) && i < 100_000 {
                let key = format!("rotate/{w}/{}", i % 8);
                match client.acquire(&key).await {
                    Ok(handle) => match handle.release().await {
                        Ok(()) => {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => failures.push(format!("release {key}: {e}")),
                    },
                    Err(e) => failures.push(format!("acquire {key}: {e}")),
                }
                i += 1;
            }
            failures
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before_rotation = done.load(Ordering::Relaxed);
    assert!(before_rotation > 0, "no load before the rotation");

    // Rotate: new node and client-port certificates under the same CA, written in place.
    issue(&dir, "1,2,3");
    let after_client = der_of(&dir.join("client-port.pem"));
    let after_peer = der_of(&dir.join("node-1.pem"));
    assert_ne!(after_client, before_client);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut all = true;
        for node in &cluster.nodes {
            let addr = node.client_addr();
            for port in ["peer", "client"] {
                let ok = metric(
                    &addr,
                    &tls,
                    &format!("raftlock_tls_reloads_total{{port=\"{port}\",result=\"ok\"}}"),
                )
                .await;
                all &= ok >= 1.0;
            }
        }
        if all {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every node reloaded its certificates"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // New handshakes present the new certificates on both ports.
    assert_eq!(
        presented_cert(&node1_client, tls.clone(), "127.0.0.1").await,
        after_client
    );
    assert_eq!(
        presented_cert(&node1_peer, as_node(&dir, 2), "node-1.raftlock").await,
        after_peer
    );
    assert_ne!(after_peer, before_peer);

    // Peers reconnect with the new certificates: kill the leader and bring it back.
    let leader = wait_for_leader(&cluster, &tls).await;
    cluster.node(leader).kill();
    let new_leader = wait_for_leader(&cluster, &tls).await;
    assert_ne!(new_leader, leader);
    cluster.node(leader).start();
    // Back up (with the new certificates, read at start) before the next step edits them.
    let restarted = cluster.client_addr_of(leader);
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(&restarted, &tls).await.is_none() {
        assert!(Instant::now() < deadline, "node {leader} did not restart");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A broken set (node 1's new certificate beside another key) is refused; the last good
    // certificates stay in use.
    std::fs::copy(dir.join("node-2-key.pem"), dir.join("node-1-key.pem")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(
        &node1_client,
        &tls,
        "raftlock_tls_reloads_total{port=\"peer\",result=\"error\"}",
    )
    .await
        < 1.0
    {
        assert!(Instant::now() < deadline, "the broken set was not reported");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        presented_cert(&node1_peer, as_node(&dir, 2), "node-1.raftlock").await,
        after_peer
    );

    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for w in workers {
        failures.extend(w.await.unwrap());
    }
    let total = done.load(Ordering::Relaxed);
    assert!(
        failures.is_empty(),
        "operations failed across the rotation: {failures:?}"
    );
    assert!(
        total > before_rotation,
        "no progress after the rotation ({before_rotation} then {total})"
    );
    // Every node is back in the cluster and answers over TLS.
    let deadline = Instant::now() + Duration::from_secs(20);
    for node in &cluster.nodes {
        loop {
            let s = status(&node.client_addr(), &tls).await;
            if s.as_ref()
                .is_some_and(|s| s["leaderId"].as_u64().unwrap_or(0) != 0)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node {} did not come back",
                node.id
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    println!("tls rotation: {total} lock cycles, {before_rotation} before the rotation");
}

/// `--client-tls-ca`: the client port takes only clients that present a certificate from that CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_port_with_a_ca_requires_client_certificates() {
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path().to_path_buf();
    issue(&dir, "1");
    let flags_dir = dir.clone();
    let cluster = Cluster::start_with(1, move |n| {
        let mut flags = tls_flags(&flags_dir, n.id);
        flags.extend(["--client-tls-ca".into(), path(&flags_dir, "client-ca.pem")]);
        flags
    });
    // The client port's certificate is from the peer CA (`ca.pem`), the client's from the
    // client CA.
    let with_cert = raftlock::tls::client_config(
        &dir.join("ca.pem"),
        Some((&dir.join("client.pem"), &dir.join("client-key.pem"))),
    )
    .unwrap();
    wait_for_leader(&cluster, &with_cert).await;
    let addr = cluster.client_addr_of(1);
    let client = RaftLockClient::builder()
        .endpoints([addr.clone()])
        .client_id("with-cert")
        .tls_config(with_cert.clone())
        .build()
        .unwrap();
    client
        .acquire("mtls/k")
        .await
        .expect("a client with a certificate")
        .release()
        .await
        .unwrap();
    // Without a certificate the handshake (or the first read after it) fails; so it does with
    // a certificate from the peer CA (the operator's), which the client port does not trust.
    assert!(status(&addr, &client_tls(&dir)).await.is_none());
    let with_operator_cert = raftlock::tls::client_config(
        &dir.join("ca.pem"),
        Some((&dir.join("operator.pem"), &dir.join("operator-key.pem"))),
    )
    .unwrap();
    assert!(status(&addr, &with_operator_cert).await.is_none());
    let refused = metric(
        &addr,
        &with_cert,
        "raftlock_client_connections_refused_total{reason=\"tls_handshake\"}",
    )
    .await;
    assert!(refused >= 1.0, "failed handshakes counted: {refused}");
}
