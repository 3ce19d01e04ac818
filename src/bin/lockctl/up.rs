//! `lockctl up`: a local cluster in the foreground, supervised until Ctrl-C.

use std::process::ExitCode;
use std::time::Duration;

use crate::control;
use crate::local::{LocalCluster, Ports};
use crate::output::fail;

pub(super) async fn up(nodes: u64, data_dir: &std::path::Path, ports: Ports) -> ExitCode {
    if let Some(pid) = control::running_up(data_dir) {
        return fail(format!(
            "lockctl up (pid {pid}) is already running with --data-dir {}",
            data_dir.display()
        ));
    }
    let data_store_port = ports.data_store;
    let mut cluster = match LocalCluster::start(nodes, data_dir, ports.clone()) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    control::remove_state(data_dir);
    control::write_state(&cluster);
    println!(
        "RaftLock dev cluster ({nodes} nodes), data in {}",
        data_dir.display()
    );
    for i in 1..=nodes {
        println!(
            "  node {i}: ws://{c}/ws  gRPC/HTTP {c}  peer {p}",
            c = cluster.client_addr(i),
            p = ports.peer_addr(i)
        );
    }
    println!("  data store: http://127.0.0.1:{data_store_port}/write");
    match cluster.wait_for_leader(Duration::from_secs(30)).await {
        Some((id, term)) => println!("  leader: node {id} (term {term})"),
        None => println!(
            "  no leader yet; see the node logs in {}",
            data_dir.display()
        ),
    }
    println!(
        "State in {}; `lockctl node stop|kill|start|restart N` acts on the nodes.",
        control::state_file(data_dir).display()
    );
    println!("Press Ctrl-C to stop.");
    let code = supervise(&mut cluster).await;
    cluster.stop();
    control::remove_state(data_dir);
    println!("stopped");
    code
}

/// Until Ctrl-C / SIGTERM: reports children that exit (the others keep running), starts the
/// nodes `lockctl node start` asks for, and keeps the state file current.
async fn supervise(cluster: &mut LocalCluster) -> ExitCode {
    use std::io::Write;
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return ExitCode::FAILURE;
    };
    let mut ticker = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
            _ = term.recv() => return ExitCode::SUCCESS,
            _ = ticker.tick() => {
                let exited = cluster.reap_exited();
                for what in &exited {
                    println!("lockctl: {what}");
                }
                let started = control::take_requests(cluster);
                for what in &started {
                    println!("lockctl: {what}");
                }
                if !exited.is_empty() || !started.is_empty() {
                    control::write_state(cluster);
                    let _ = std::io::stdout().flush();
                }
            }
        }
    }
}
