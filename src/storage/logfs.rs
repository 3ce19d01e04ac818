//! The file operations of the segments log engine ([`super::segment_log`]), behind a trait so
//! that the same engine code runs on the real filesystem ([`StdFs`], what lock-node uses) and
//! on [`SimDisk`], a deterministic model of a disk for the simulator and tests.
//!
//! [`SimDisk`] keeps, per file, the bytes a sync made durable and the file as written since;
//! its directory entries likewise (a name is durable once its directory was synced). A
//! [`SimDisk::power_cut`] keeps only what was synced, except that the last write not synced
//! may have reached the disk in part, a whole number of 512-byte sectors of it (a torn write).
//! [`SimDisk::corrupt_synced_sector`] flips bytes of a sector that was synced (a latent sector
//! error).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{self, Read};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rand::Rng;

/// One open file of a [`LogFs`].
pub(crate) trait LogFile: Send + Sync {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// The whole file.
    fn read_all(&self) -> io::Result<Vec<u8>>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Reserves `from..to` (best effort: a filesystem that cannot just grows the file later).
    fn preallocate(&self, from: u64, to: u64);
    fn sync_data(&self) -> io::Result<()>;
    fn sync_all(&self) -> io::Result<()>;
}

/// The file system operations the segments engine makes.
pub(crate) trait LogFs: Send + Sync {
    /// Creates `path`, which must not exist, for reading and writing.
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn LogFile>>;
    /// Opens an existing file for reading and writing.
    fn open(&self, path: &Path) -> io::Result<Arc<dyn LogFile>>;
    /// The names in `dir`; `None` when it does not exist.
    fn list_dir(&self, dir: &Path) -> io::Result<Option<Vec<String>>>;
    fn is_dir(&self, dir: &Path) -> bool;
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Makes `dir`'s entries durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
}

/// The real filesystem.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StdFs;

impl LogFile for File {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(self, buf, offset)
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }

    fn read_all(&self) -> io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        let mut file = self;
        file.read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }

    /// Reserves the segment's blocks up front, so that an `fdatasync` after a write has no
    /// file size or block allocation to record (about a third faster here).
    fn preallocate(&self, from: u64, to: u64) {
        if to > from {
            let _ = nix::fcntl::posix_fallocate(self, from as i64, (to - from) as i64);
        }
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn sync_all(&self) -> io::Result<()> {
        File::sync_all(self)
    }
}

impl LogFs for StdFs {
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn LogFile>> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        Ok(Arc::new(file))
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn LogFile>> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        Ok(Arc::new(file))
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Option<Vec<String>>> {
        let read = match std::fs::read_dir(dir) {
            Ok(read) => read,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut names = Vec::new();
        for item in read {
            // A name that is not UTF-8 is no segment; it is skipped as before.
            if let Ok(name) = item?.file_name().into_string() {
                names.push(name);
            }
        }
        Ok(Some(names))
    }

    fn is_dir(&self, dir: &Path) -> bool {
        dir.is_dir()
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir).and_then(|d| d.sync_all())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
}

/// Sector size of [`SimDisk`]: a torn write keeps whole sectors.
pub(crate) const SECTOR: u64 = 512;

/// One file of a [`SimDisk`] (an inode: names point to it).
#[derive(Clone, Debug, Default)]
struct SimInode {
    /// What survives a power cut.
    durable: Vec<u8>,
    /// The file as written.
    current: Vec<u8>,
}

/// What a [`SimDisk`] has counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimDiskStats {
    pub power_cuts: u64,
    /// Power cuts that left part, but not all, of the last unsynced write on the disk.
    pub torn_writes: u64,
    pub corrupt_sectors: u64,
}

#[derive(Debug, Default)]
struct SimDiskState {
    inodes: BTreeMap<u64, SimInode>,
    next_inode: u64,
    /// Names as the running system sees them, and as a power cut would leave them.
    names: BTreeMap<PathBuf, u64>,
    durable_names: BTreeMap<PathBuf, u64>,
    /// Directories (durable once created: the engine syncs a new directory's parent at once).
    dirs: BTreeSet<PathBuf>,
    /// The last write not yet synced: inode, offset, bytes.
    last_write: Option<(u64, u64, Vec<u8>)>,
    stats: SimDiskStats,
}

/// A deterministic in-memory disk (see the module documentation). Cloning shares the disk.
#[derive(Clone, Debug, Default)]
pub struct SimDisk {
    state: Arc<Mutex<SimDiskState>>,
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{}: no such file", path.display()),
    )
}

impl SimDisk {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, SimDiskState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> SimDiskStats {
        self.lock().stats
    }

    /// The power goes: every file goes back to its synced bytes and every directory to its
    /// synced entries, except that the last write not synced may have reached the disk in
    /// part (a whole number of sectors from its start, chosen by `rng`) or whole. Returns
    /// whether a write was torn.
    pub fn power_cut(&self, rng: &mut impl Rng) -> bool {
        let mut state = self.lock();
        state.stats.power_cuts += 1;
        let last_write = state.last_write.take();
        for inode in state.inodes.values_mut() {
            inode.current.clone_from(&inode.durable);
        }
        state.names = state.durable_names.clone();
        let live: BTreeSet<u64> = state.names.values().copied().collect();
        state.inodes.retain(|ino, _| live.contains(ino));
        let mut torn = false;
        if let Some((ino, offset, bytes)) = last_write {
            if let Some(inode) = state.inodes.get_mut(&ino) {
                // The sector boundaries inside the write: it can reach the disk up to any of
                // them, or not at all, or whole.
                let end = offset + bytes.len() as u64;
                let first_boundary = (offset / SECTOR + 1) * SECTOR;
                let mut cuts = vec![offset];
                cuts.extend((first_boundary..end).step_by(SECTOR as usize));
                cuts.push(end);
                let cut = cuts[rng.random_range(0..cuts.len())];
                let kept = (cut - offset) as usize;
                if kept > 0 {
                    let at = offset as usize;
                    if inode.durable.len() < at + kept {
                        inode.durable.resize(at + kept, 0);
                    }
                    inode.durable[at..at + kept].copy_from_slice(&bytes[..kept]);
                    inode.current.clone_from(&inode.durable);
                }
                if kept > 0 && kept < bytes.len() {
                    torn = true;
                    state.stats.torn_writes += 1;
                }
            }
        }
        torn
    }

    /// A latent sector error: flips bytes in one synced sector of a file, chosen by `rng`
    /// among the sectors that overlap the range `eligible` names for the file (given its path
    /// and synced bytes); only bytes inside that range change. Returns the file and offset, or
    /// `None` when no sector is eligible.
    pub fn corrupt_synced_sector(
        &self,
        rng: &mut impl Rng,
        eligible: impl Fn(&Path, &[u8]) -> Range<u64>,
    ) -> Option<(PathBuf, u64)> {
        let mut state = self.lock();
        let mut sectors = Vec::new();
        for (path, ino) in &state.durable_names {
            let Some(inode) = state.inodes.get(ino) else {
                continue;
            };
            let range = eligible(path, &inode.durable);
            let end = range.end.min(inode.durable.len() as u64);
            if range.start >= end {
                continue;
            }
            let mut sector = range.start / SECTOR;
            while sector * SECTOR < end {
                let lo = (sector * SECTOR).max(range.start);
                let hi = ((sector + 1) * SECTOR).min(end);
                sectors.push((path.clone(), *ino, lo, hi));
                sector += 1;
            }
        }
        if sectors.is_empty() {
            return None;
        }
        let (path, ino, lo, hi) = sectors.swap_remove(rng.random_range(0..sectors.len()));
        let flips = rng.random_range(1..=4u64).min(hi - lo);
        let inode = state.inodes.get_mut(&ino)?;
        let mut first = None;
        for _ in 0..flips {
            let at = rng.random_range(lo..hi);
            let mask = rng.random_range(1..=255u8);
            inode.durable[at as usize] ^= mask;
            if (at as usize) < inode.current.len() {
                inode.current[at as usize] ^= mask;
            }
            first = Some(first.map_or(at, |f: u64| f.min(at)));
        }
        state.stats.corrupt_sectors += 1;
        first.map(|at| (path, at))
    }

    /// The synced bytes of `path`, if its name is durable (for tests).
    pub fn durable_bytes(&self, path: &Path) -> Option<Vec<u8>> {
        let state = self.lock();
        let ino = state.durable_names.get(path)?;
        state.inodes.get(ino).map(|i| i.durable.clone())
    }

    /// The names in `dir` (for tests).
    pub fn files_in(&self, dir: &Path) -> Vec<PathBuf> {
        self.lock()
            .names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .cloned()
            .collect()
    }

    fn file(&self, ino: u64) -> Arc<dyn LogFile> {
        Arc::new(SimFile {
            disk: self.clone(),
            ino,
        })
    }
}

/// An open file of a [`SimDisk`].
struct SimFile {
    disk: SimDisk,
    ino: u64,
}

impl SimFile {
    fn with<T>(&self, f: impl FnOnce(&mut SimDiskState, u64) -> io::Result<T>) -> io::Result<T> {
        let mut state = self.disk.lock();
        if !state.inodes.contains_key(&self.ino) {
            return Err(io::Error::other("the file is gone (a power cut)"));
        }
        f(&mut state, self.ino)
    }

    fn sync(&self) -> io::Result<()> {
        self.with(|state, ino| {
            if let Some(inode) = state.inodes.get_mut(&ino) {
                inode.durable.clone_from(&inode.current);
            }
            if state.last_write.as_ref().is_some_and(|w| w.0 == ino) {
                state.last_write = None;
            }
            Ok(())
        })
    }
}

impl LogFile for SimFile {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.with(|state, ino| {
            let inode = state
                .inodes
                .get_mut(&ino)
                .ok_or_else(|| io::Error::other("the file is gone"))?;
            let at = offset as usize;
            if inode.current.len() < at + buf.len() {
                inode.current.resize(at + buf.len(), 0);
            }
            inode.current[at..at + buf.len()].copy_from_slice(buf);
            state.last_write = Some((ino, offset, buf.to_vec()));
            Ok(())
        })
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.with(|state, ino| {
            let inode = state
                .inodes
                .get(&ino)
                .ok_or_else(|| io::Error::other("the file is gone"))?;
            let at = offset as usize;
            match inode.current.get(at..at + buf.len()) {
                Some(bytes) => {
                    buf.copy_from_slice(bytes);
                    Ok(())
                }
                None => Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "read past the end of the file",
                )),
            }
        })
    }

    fn read_all(&self) -> io::Result<Vec<u8>> {
        self.with(|state, ino| {
            Ok(state
                .inodes
                .get(&ino)
                .map(|i| i.current.clone())
                .unwrap_or_default())
        })
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.with(|state, ino| {
            if let Some(inode) = state.inodes.get_mut(&ino) {
                inode.current.resize(len as usize, 0);
            }
            Ok(())
        })
    }

    fn preallocate(&self, _from: u64, to: u64) {
        let _ = self.with(|state, ino| {
            if let Some(inode) = state.inodes.get_mut(&ino) {
                if (inode.current.len() as u64) < to {
                    inode.current.resize(to as usize, 0);
                }
            }
            Ok(())
        });
    }

    fn sync_data(&self) -> io::Result<()> {
        self.sync()
    }

    fn sync_all(&self) -> io::Result<()> {
        self.sync()
    }
}

impl LogFs for SimDisk {
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn LogFile>> {
        let ino = {
            let mut state = self.lock();
            if state.names.contains_key(path) {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists", path.display()),
                ));
            }
            let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
            if !state.dirs.contains(&parent) {
                return Err(not_found(&parent));
            }
            state.next_inode += 1;
            let ino = state.next_inode;
            state.inodes.insert(ino, SimInode::default());
            state.names.insert(path.to_path_buf(), ino);
            ino
        };
        Ok(self.file(ino))
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn LogFile>> {
        let ino = *self.lock().names.get(path).ok_or_else(|| not_found(path))?;
        Ok(self.file(ino))
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Option<Vec<String>>> {
        let state = self.lock();
        if !state.dirs.contains(dir) {
            return Ok(None);
        }
        Ok(Some(
            state
                .names
                .keys()
                .filter(|p| p.parent() == Some(dir))
                .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
                .collect(),
        ))
    }

    fn is_dir(&self, dir: &Path) -> bool {
        self.lock().dirs.contains(dir)
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.lock();
        for ancestor in dir.ancestors() {
            state.dirs.insert(ancestor.to_path_buf());
        }
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.lock();
        if !state.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        let in_dir = |p: &PathBuf| p.parent() == Some(dir);
        state.durable_names.retain(|p, _| !in_dir(p));
        let now: Vec<(PathBuf, u64)> = state
            .names
            .iter()
            .filter(|(p, _)| in_dir(p))
            .map(|(p, i)| (p.clone(), *i))
            .collect();
        state.durable_names.extend(now);
        // Files no name points to any more, durable or not, are gone.
        let live: BTreeSet<u64> = state
            .names
            .values()
            .chain(state.durable_names.values())
            .copied()
            .collect();
        state.inodes.retain(|ino, _| live.contains(ino));
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state.names.remove(path).ok_or_else(|| not_found(path))?;
        Ok(())
    }
}
