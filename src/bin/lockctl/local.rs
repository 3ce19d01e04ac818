//! A local cluster of lock nodes and the data store, run as child processes of this executable.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use raftlock::client::http::get_json;

/// Hidden first arguments that make `lockctl` run as a lock node or as the data store.
pub const INTERNAL_LOCK_NODE: &str = "__lock-node";
pub const INTERNAL_DATA_STORE: &str = "__data-store";

fn self_exe() -> PathBuf {
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("lockctl"))
}

pub struct Managed {
    pub name: String,
    pub child: Option<Child>,
    args: Vec<String>,
    log: PathBuf,
}

impl Managed {
    fn spawn(name: &str, args: Vec<String>, log: PathBuf) -> Result<Managed, String> {
        let mut m = Managed {
            name: name.to_string(),
            child: None,
            args,
            log,
        };
        m.start()?;
        Ok(m)
    }

    pub fn start(&mut self) -> Result<(), String> {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("cannot open {}: {e}", self.log.display()))?;
        let child = Command::new(self_exe())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.name))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no flush, no leadership hand-over.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Ports of one local cluster.
#[derive(Clone, Debug)]
pub struct Ports {
    pub peer_base: u16,
    pub client_base: u16,
    pub data_store: u16,
}

impl Ports {
    /// Node i listens on peer 8080+i and client 50050+i, the data store on 8000.
    pub fn standard(data_store: u16) -> Ports {
        Ports {
            peer_base: 8080,
            client_base: 50050,
            data_store,
        }
    }
}

pub struct LocalCluster {
    pub nodes: Vec<Managed>,
    pub data_store: Option<Managed>,
    pub ports: Ports,
    pub dir: PathBuf,
}

impl LocalCluster {
    pub fn start(n: u64, dir: &Path, ports: Ports) -> Result<LocalCluster, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let initial: Vec<String> = (1..=n)
            .map(|i| format!("{i}=127.0.0.1:{}", ports.peer_base + i as u16))
            .collect();
        let initial = initial.join(",");
        let mut cluster = LocalCluster {
            nodes: Vec::new(),
            data_store: None,
            ports: ports.clone(),
            dir: dir.to_path_buf(),
        };
        for i in 1..=n {
            let args = vec![
                INTERNAL_LOCK_NODE.into(),
                "--node-id".into(),
                i.to_string(),
                "--data-dir".into(),
                dir.join(format!("node-{i}")).display().to_string(),
                "--peer-listen".into(),
                format!("127.0.0.1:{}", ports.peer_base + i as u16),
                "--client-listen".into(),
                format!("127.0.0.1:{}", ports.client_base + i as u16),
                "--initial-cluster".into(),
                initial.clone(),
            ];
            let m = Managed::spawn(
                &format!("lock-node {i}"),
                args,
                dir.join(format!("node-{i}.log")),
            )?;
            cluster.nodes.push(m);
        }
        let ds_args = vec![
            INTERNAL_DATA_STORE.into(),
            "--listen".into(),
            format!("127.0.0.1:{}", ports.data_store),
            "--file".into(),
            dir.join("data-store")
                .join("writes.log")
                .display()
                .to_string(),
        ];
        cluster.data_store = Some(Managed::spawn(
            "data-store",
            ds_args,
            dir.join("data-store.log"),
        )?);
        Ok(cluster)
    }

    pub fn client_addr(&self, i: u64) -> String {
        format!("127.0.0.1:{}", self.ports.client_base + i as u16)
    }

    pub fn endpoints(&self) -> Vec<String> {
        (1..=self.nodes.len() as u64)
            .map(|i| self.client_addr(i))
            .collect()
    }

    pub fn data_store_addr(&self) -> String {
        format!("127.0.0.1:{}", self.ports.data_store)
    }

    /// Waits for a node that says it leads; returns (id, term).
    pub async fn wait_for_leader(&self, timeout: Duration) -> Option<(u64, u64)> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            for i in 1..=self.nodes.len() as u64 {
                if self.nodes[(i - 1) as usize].child.is_none() {
                    continue;
                }
                if let Ok((200, s)) = get_json(&self.client_addr(i), "/status").await {
                    if s["role"] == "leader" {
                        return Some((i, s["term"].as_u64().unwrap_or(0)));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Waits until the data store answers.
    pub async fn wait_for_data_store(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok((200, _)) = get_json(&self.data_store_addr(), "/healthz").await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Reports the first child that exited on its own.
    pub fn exited(&mut self) -> Option<String> {
        for m in self.nodes.iter_mut().chain(self.data_store.iter_mut()) {
            if let Some(c) = m.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    m.child = None;
                    return Some(format!("{} exited ({status})", m.name));
                }
            }
        }
        None
    }

    /// SIGTERM to every child, then SIGKILL to any still running after 10 s.
    pub fn stop(&mut self) {
        use nix::sys::signal::{kill, Signal};
        use nix::unistd::Pid;
        let all: Vec<&mut Managed> = self
            .nodes
            .iter_mut()
            .chain(self.data_store.iter_mut())
            .collect();
        for m in &all {
            if let Some(c) = &m.child {
                let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for m in all {
            let Some(mut c) = m.child.take() else {
                continue;
            };
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    _ if Instant::now() > deadline => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    _ => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.stop();
    }
}
