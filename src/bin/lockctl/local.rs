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
    pub args: Vec<String>,
    pub log: PathBuf,
    /// How the last run ended, once `up` has seen it exit.
    pub last_exit: Option<String>,
}

impl Managed {
    fn spawn(name: &str, args: Vec<String>, log: PathBuf) -> Result<Managed, String> {
        let mut m = Managed {
            name: name.to_string(),
            child: None,
            args,
            log,
            last_exit: None,
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

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The last `n` lines of this process's log file (its stderr).
    pub fn log_tail(&self, n: usize) -> Vec<String> {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(&self.log) else {
            return Vec::new();
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(16 * 1024)));
        let mut buf = Vec::new();
        let _ = f.read_to_end(&mut buf);
        let text = String::from_utf8_lossy(&buf);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(n)..]
            .iter()
            .map(|l| strip_ansi(l))
            .collect()
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
    pub fn peer_addr(&self, i: u64) -> String {
        format!("127.0.0.1:{}", self.peer_base + i as u16)
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

    /// Reaps the children that exited since the last call (killed, stopped or crashed) and
    /// reports each: its name, exit status and the last lines of its log.
    pub fn reap_exited(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for m in self.nodes.iter_mut().chain(self.data_store.iter_mut()) {
            if let Some(c) = m.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    m.child = None;
                    m.last_exit = Some(status.to_string());
                    let mut report = format!(
                        "{} exited ({status}); last lines of {}:",
                        m.name,
                        m.log.display()
                    );
                    for line in m.log_tail(5) {
                        report.push_str("\n    ");
                        report.push_str(&line);
                    }
                    out.push(report);
                }
            }
        }
        out
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

/// Drops terminal colour sequences (ESC [ … letter) from a log line.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
