//! `raftlock-bench snapshot-install`: the resident memory and time of installing a snapshot of
//! N held locks into a new sled store, as a member joining a loaded cluster does, for several
//! sizes of the sled batches the install writes and of sled's page cache. Each size runs in a child process of its own,
//! so that its peak (VmHWM) is its own.

use std::path::{Path, PathBuf};
use std::time::Instant;

use raftlock::lock::{Command as LockCommand, Limits, LockStateMachine};
use raftlock::raft::{Membership, SnapshotMeta};
use raftlock::storage::{encode_snapshot_data, snapshot_pairs, SledOptions, SledStorage, Storage};

/// (VmRSS, VmHWM) of this process in bytes.
fn memory() -> (u64, u64) {
    let pid = std::process::id();
    (crate::scale::rss_of(pid), crate::scale::peak_rss_of(pid))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The snapshot data of a state holding `locks` locks, each acquired with a request id (so
/// each has its remembered answer too, as after the `scale` fill).
fn snapshot_of(locks: u64) -> Vec<u8> {
    // Room for every acquire's answer: the log clock does not advance here, so no answer ages
    // out, and at the table's bound the rest would be refused (before this was set, the
    // default bound of 500,000 answers left half of a million acquires refused).
    let limits = Limits {
        locks_held_max: locks as usize + 1,
        dedupe_entries_max: locks as usize + 1,
        session_entries_max: locks as usize + 1,
        ..Limits::default()
    };
    let mut sm = LockStateMachine::new(limits);
    for i in 0..locks {
        sm.apply(
            i + 1,
            &LockCommand::Acquire {
                key: format!("scale/lock-{i:08}"),
                client_id: format!("scale-filler-{}", i % 16),
                request_id: format!("fill-{i}"),
                ttl_ms: 3_600_000,
                wait_timeout_ms: None,
            },
        );
        if i % 4096 == 0 {
            drop(sm.take_changes());
        }
    }
    assert_eq!(
        sm.locks_held() as u64,
        locks,
        "every acquire of the snapshot's state must be granted"
    );
    let mut pairs = sm.to_kv();
    pairs.sort();
    encode_snapshot_data(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))).to_vec()
}

pub fn run(locks: u64, batch_keys: &[usize], cache_mb: &[u64], dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let file = dir.join("snapshot.bin");
    let data = snapshot_of(locks);
    std::fs::write(&file, &data).map_err(|e| format!("writing {}: {e}", file.display()))?;
    println!(
        "Snapshot of {locks} held locks: {:.1} MiB. Each row installs it into a new sled store \
         in a child process of its own (`SledStorage::install_snapshot`, then a flush), then \
         builds the lock state from it as the node does.\n",
        mib(data.len() as u64)
    );
    drop(data);
    println!("| keys per batch | sled page cache | install | RSS after install | peak during install | RSS with lock state | store on disk |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let exe = std::env::current_exe().map_err(|e| format!("finding this program: {e}"))?;
    let default_mb = SledOptions::DEFAULT_CACHE_BYTES >> 20;
    let rows = batch_keys.iter().map(|&keys| (keys, default_mb)).chain(
        cache_mb
            .iter()
            .filter(|&&mb| mb != default_mb || !batch_keys.contains(&512))
            .map(|&mb| (512, mb)),
    );
    for (keys, mb) in rows {
        let store = dir.join(format!("store-{keys}-{mb}"));
        let _ = std::fs::remove_dir_all(&store);
        let out = std::process::Command::new(&exe)
            .arg("snapshot-install-child")
            .arg("--snapshot")
            .arg(&file)
            .arg("--batch-keys")
            .arg(keys.to_string())
            .arg("--cache-mb")
            .arg(mb.to_string())
            .arg("--store")
            .arg(&store)
            .output()
            .map_err(|e| format!("starting the child for {keys} keys per batch: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let Some(line) = stdout.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
            return Err(format!(
                "the child for {keys} keys per batch failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        };
        let v: Vec<f64> = line
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        let [secs, rss_installed, hwm_installed, rss_built] = v[..] else {
            return Err(format!("the child printed {line:?}"));
        };
        let on_disk = disk_bytes(&store);
        println!(
            "| {keys} | {mb} MiB | {secs:.2} s | {:.0} MiB | {:.0} MiB | {:.0} MiB | {:.0} MiB |",
            mib(rss_installed as u64),
            mib(hwm_installed as u64),
            mib(rss_built as u64),
            mib(on_disk)
        );
        let _ = std::fs::remove_dir_all(&store);
    }
    Ok(())
}

/// Allocated bytes of the files under `dir`.
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// The child: installs `snapshot` into a new store at `store` and prints one `RESULT` line.
pub fn child(
    snapshot: &Path,
    batch_keys: usize,
    cache_mb: u64,
    store: &PathBuf,
) -> Result<(), String> {
    let data = std::fs::read(snapshot).map_err(|e| format!("reading the snapshot: {e}"))?;
    let options = SledOptions {
        cache_bytes: cache_mb << 20,
        ..Default::default()
    };
    let mut storage = SledStorage::open_with(store, options).map_err(|e| e.to_string())?;
    storage.set_install_batch_keys(batch_keys);
    let meta = SnapshotMeta {
        index: 2_000_000,
        term: 2,
        membership: Membership::with_voters([1, 2, 3]),
    };
    let started = Instant::now();
    storage
        .install_snapshot(&meta, &data)
        .and_then(|()| storage.flush())
        .map_err(|e| e.to_string())?;
    let secs = started.elapsed().as_secs_f64();
    let (rss_installed, hwm_installed) = memory();
    let pairs = snapshot_pairs(&data).map_err(|e| e.to_string())?;
    let sm = LockStateMachine::from_kv(pairs).map_err(|e| e.to_string())?;
    let (rss_built, _) = memory();
    if sm.locks_held() == 0 {
        return Err("the installed state holds no locks".into());
    }
    println!("RESULT {secs} {rss_installed} {hwm_installed} {rss_built}");
    Ok(())
}
