//! `lockctl`: RaftLock's command-line tool. Today it runs a local development cluster (`up`) and
//! reads cluster state (`status`, `locks`); the lock commands, `run`, `demo` and `simulate` are
//! not built yet.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use raftlock::client::http::get_json;
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(version, about = "RaftLock command-line tool")]
struct Args {
    /// Output format: human or json.
    #[arg(long, global = true, default_value = "human")]
    output: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a local cluster of N lock nodes and the data store in the foreground. Node i listens
    /// on peer port 8080+i and client port 50050+i, the data store on 8000. Starting again with
    /// the same --data-dir resumes the same cluster. Stops cleanly on Ctrl-C or SIGTERM.
    Up {
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=7))]
        nodes: u64,
        #[arg(long, default_value = "./raftlock-dev")]
        data_dir: PathBuf,
        #[arg(long, default_value_t = 8000)]
        data_store_port: u16,
    },
    /// Show a node's view of the cluster.
    Status {
        #[arg(long, default_value = "127.0.0.1:50051")]
        endpoint: String,
    },
    /// List held locks and their waiters.
    Locks {
        #[arg(long, default_value = "127.0.0.1:50051")]
        endpoint: String,
        #[arg(long, default_value = "")]
        prefix: String,
    },
}

fn main() -> ExitCode {
    // `lockctl up` runs its nodes and data store as child processes of this same executable, so
    // `cargo run --bin lockctl -- up` needs no other binary built first.
    let mut argv = std::env::args_os();
    let _program = argv.next();
    match argv.next().as_ref().and_then(|a| a.to_str()) {
        Some(INTERNAL_LOCK_NODE) => {
            return raftlock::server::cli::lock_node_main(
                std::iter::once("lock-node".into()).chain(argv),
            )
        }
        Some(INTERNAL_DATA_STORE) => {
            return raftlock::datastore::cli::data_store_main(
                std::iter::once("data-store".into()).chain(argv),
            )
        }
        _ => {}
    }
    let args = Args::parse();
    let json = args.output == "json";
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("lockctl: {err}");
            return ExitCode::FAILURE;
        }
    };
    match args.command {
        Cmd::Up {
            nodes,
            data_dir,
            data_store_port,
        } => runtime.block_on(up(nodes, &data_dir, data_store_port)),
        Cmd::Status { endpoint } => runtime.block_on(show(&endpoint, "/status", json)),
        Cmd::Locks { endpoint, prefix } => {
            runtime.block_on(show(&endpoint, &format!("/locks?prefix={prefix}"), json))
        }
    }
}

async fn show(endpoint: &str, path: &str, json: bool) -> ExitCode {
    match get_json(endpoint, path).await {
        Ok((200, value)) => {
            if json {
                println!("{value}");
            } else {
                print_human(&value, 0);
            }
            ExitCode::SUCCESS
        }
        Ok((status, value)) => {
            eprintln!("lockctl: {endpoint}{path} answered {status}: {value}");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("lockctl: {err}");
            ExitCode::FAILURE
        }
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

/// Hidden first arguments that make `lockctl` run as a lock node or as the data store.
const INTERNAL_LOCK_NODE: &str = "__lock-node";
const INTERNAL_DATA_STORE: &str = "__data-store";

fn self_exe() -> PathBuf {
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("lockctl"))
}

struct Managed {
    name: String,
    child: Child,
}

fn spawn(name: &str, program: &Path, args: &[String], log: &Path) -> Result<Managed, String> {
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("cannot open {}: {e}", log.display()))?;
    let child = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", program.display()))?;
    Ok(Managed {
        name: name.to_string(),
        child,
    })
}

async fn up(nodes: u64, data_dir: &Path, data_store_port: u16) -> ExitCode {
    if let Err(err) = std::fs::create_dir_all(data_dir) {
        eprintln!("lockctl: cannot create {}: {err}", data_dir.display());
        return ExitCode::FAILURE;
    }
    let exe = self_exe();
    let initial: Vec<String> = (1..=nodes)
        .map(|i| format!("{i}=127.0.0.1:{}", 8080 + i))
        .collect();
    let initial = initial.join(",");
    let mut children = Vec::new();
    for i in 1..=nodes {
        let args = vec![
            INTERNAL_LOCK_NODE.into(),
            "--node-id".into(),
            i.to_string(),
            "--data-dir".into(),
            data_dir.join(format!("node-{i}")).display().to_string(),
            "--peer-listen".into(),
            format!("127.0.0.1:{}", 8080 + i),
            "--client-listen".into(),
            format!("127.0.0.1:{}", 50050 + i),
            "--initial-cluster".into(),
            initial.clone(),
        ];
        match spawn(
            &format!("lock-node {i}"),
            &exe,
            &args,
            &data_dir.join(format!("node-{i}.log")),
        ) {
            Ok(c) => children.push(c),
            Err(err) => {
                eprintln!("lockctl: {err}");
                stop_all(&mut children);
                return ExitCode::FAILURE;
            }
        }
    }
    let ds_args = vec![
        INTERNAL_DATA_STORE.into(),
        "--listen".into(),
        format!("127.0.0.1:{data_store_port}"),
        "--file".into(),
        data_dir
            .join("data-store")
            .join("writes.log")
            .display()
            .to_string(),
    ];
    match spawn(
        "data-store",
        &exe,
        &ds_args,
        &data_dir.join("data-store.log"),
    ) {
        Ok(c) => children.push(c),
        Err(err) => {
            eprintln!("lockctl: {err}");
            stop_all(&mut children);
            return ExitCode::FAILURE;
        }
    }
    println!(
        "RaftLock dev cluster ({nodes} nodes), data in {}",
        data_dir.display()
    );
    for i in 1..=nodes {
        println!(
            "  node {i}: ws://127.0.0.1:{c}/ws  gRPC/HTTP 127.0.0.1:{c}  peer 127.0.0.1:{p}",
            c = 50050 + i,
            p = 8080 + i
        );
    }
    println!("  data store: http://127.0.0.1:{data_store_port}/write");
    let deadline = Instant::now() + Duration::from_secs(30);
    'wait: while Instant::now() < deadline {
        for i in 1..=nodes {
            if let Ok((200, s)) = get_json(&format!("127.0.0.1:{}", 50050 + i), "/status").await {
                if s["role"] == "leader" {
                    println!("  leader: node {i} (term {})", s["term"]);
                    break 'wait;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("Press Ctrl-C to stop.");
    let code = supervise(&mut children).await;
    stop_all(&mut children);
    println!("stopped");
    code
}

/// Waits for Ctrl-C / SIGTERM, reporting children that exit on their own.
async fn supervise(children: &mut [Managed]) -> ExitCode {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return ExitCode::FAILURE;
    };
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
            _ = term.recv() => return ExitCode::SUCCESS,
            _ = ticker.tick() => {
                for c in children.iter_mut() {
                    if let Ok(Some(status)) = c.child.try_wait() {
                        eprintln!("lockctl: {} exited ({status}); see its log in the data dir", c.name);
                        return ExitCode::FAILURE;
                    }
                }
            }
        }
    }
}

fn stop_all(children: &mut [Managed]) {
    for c in children.iter() {
        let _ = Command::new("kill")
            .args(["-TERM", &c.child.id().to_string()])
            .status();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for c in children.iter_mut() {
        loop {
            match c.child.try_wait() {
                Ok(Some(_)) => break,
                _ if Instant::now() > deadline => {
                    let _ = c.child.kill();
                    let _ = c.child.wait();
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}
