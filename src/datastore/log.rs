//! The data store's write log: one text file, one line per accepted write, appended and flushed
//! before the write is acknowledged.
//!
//! ```text
//!   <key>\t<token>\t<clientID>\t<data as a JSON string>\n
//! ```
//!
//! - **Replay** reads the file a line at a time (never the whole file into memory) and reports
//!   each write's key, token, client, data size and where its line sits in the file. A last line
//!   cut short by a crash (no newline, or unparsable) was never acknowledged: it is reported as
//!   torn and the caller truncates it. A bad line anywhere else is damage: replay refuses.
//! - **Compaction** rewrites the file to the last line of every key (which carries that key's
//!   highest token, since tokens for a key only go up): a temporary file beside the log is
//!   written, fsynced, renamed over the log, and the directory fsynced. A crash before the rename
//!   leaves the old log intact (the temporary file is removed at the next start); after it, the
//!   new log is complete.
//! - **Exclusive use**: `<file>.lock` beside the log is held with `flock(LOCK_EX | LOCK_NB)` for
//!   the process's life, so a second data store on the same file (or volume) refuses to start.
//!   The kernel drops the lock when the process dies, however it dies. A separate lock file,
//!   because compaction replaces the log's inode.
//!
//! Nothing here holds a write's data in memory beyond the line being read or copied.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Where one line sits in the current log file (newline included).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    pub offset: u64,
    pub len: u32,
}

/// One write read back from the log: everything but its data, which stays in the file.
#[derive(Debug, PartialEq)]
pub struct LoggedWrite {
    pub key: String,
    pub token: u64,
    pub client: String,
    /// Bytes of the write's data (decoded).
    pub data_bytes: usize,
    pub loc: Loc,
}

/// Where the log's torn last line starts.
#[derive(Debug, PartialEq)]
pub struct Torn {
    /// 1-based line number.
    pub line: usize,
    /// Byte offset of the line's start: the log is truncated to this length.
    pub offset: u64,
    pub reason: String,
}

/// A line longer than this is not one the store wrote (a key, a client id and data within their
/// limits, the data JSON-escaped): it is damage, or torn if it is the last.
pub fn max_line_bytes(max_data_bytes: usize) -> usize {
    // JSON escaping turns a byte into at most 6 (`\u0001`).
    (max_data_bytes.saturating_mul(6)).saturating_add(4096)
}

/// The fields of one line, and its decoded data.
pub fn parse_line(line: &[u8]) -> Result<(String, u64, String, String), &'static str> {
    let line = std::str::from_utf8(line).map_err(|_| "not UTF-8")?;
    let mut parts = line.splitn(4, '\t');
    let (Some(key), Some(token), Some(client), Some(data)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("expected 4 tab-separated fields");
    };
    let token: u64 = token.parse().map_err(|_| "token is not a number")?;
    let data: String = serde_json::from_str(data).map_err(|_| "data is not a JSON string")?;
    Ok((key.to_string(), token, client.to_string(), data))
}

/// The line that records one write.
pub fn format_line(key: &str, token: u64, client: &str, data: &str) -> String {
    let data_json = serde_json::to_string(data).unwrap_or_else(|_| "\"\"".into());
    format!("{key}\t{token}\t{client}\t{data_json}\n")
}

/// Why replay stopped.
#[derive(Debug, PartialEq)]
pub enum ReplayError {
    /// A bad line before the last: `(line number, reason)`.
    Corrupt(usize, String),
    Io(String),
}

/// Reads the log a line at a time, calling `on_write` for every complete write in order. The
/// last line is torn when it lacks its newline (an append cut short) or does not parse; any other
/// line that does not parse is [`ReplayError::Corrupt`]. Empty lines are skipped.
pub fn replay<R: Read>(
    source: R,
    max_line: usize,
    mut on_write: impl FnMut(LoggedWrite),
) -> Result<Option<Torn>, ReplayError> {
    let mut reader = BufReader::with_capacity(64 * 1024, source);
    let io = |e: std::io::Error| ReplayError::Io(e.to_string());
    let mut offset = 0u64;
    let mut number = 0usize;
    let mut line = Vec::new();
    loop {
        line.clear();
        // At most one byte past the limit is kept; the rest of an overlong line is skipped.
        let read = (&mut reader)
            .take(max_line as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(io)?;
        if read == 0 {
            return Ok(None);
        }
        number += 1;
        let mut consumed = read as u64;
        let mut terminated = line.last() == Some(&b'\n');
        let overlong = !terminated && line.len() > max_line;
        if overlong {
            // Skip to the end of the line, a bounded buffer at a time.
            let mut skip = Vec::new();
            loop {
                skip.clear();
                let n = (&mut reader)
                    .take(64 * 1024)
                    .read_until(b'\n', &mut skip)
                    .map_err(io)?;
                consumed += n as u64;
                if n == 0 {
                    break;
                }
                if skip.last() == Some(&b'\n') {
                    terminated = true;
                    break;
                }
            }
        }
        let torn = |reason: &str| Torn {
            line: number,
            offset,
            reason: reason.to_string(),
        };
        if !terminated {
            return Ok(Some(torn("no trailing newline")));
        }
        let last = reader.fill_buf().map_err(io)?.is_empty();
        let content = &line[..line.len() - usize::from(!overlong)];
        let parsed = if overlong {
            Err("line longer than any write this store accepts")
        } else if content.is_empty() {
            offset += consumed;
            continue;
        } else {
            parse_line(content)
        };
        match parsed {
            Ok((key, token, client, data)) => on_write(LoggedWrite {
                key,
                token,
                client,
                data_bytes: data.len(),
                loc: Loc {
                    offset,
                    len: consumed as u32,
                },
            }),
            Err(reason) if last => return Ok(Some(torn(reason))),
            Err(reason) => return Err(ReplayError::Corrupt(number, reason.to_string())),
        }
        offset += consumed;
    }
}

/// Reads the line at `loc` from `file` and returns the write's data.
pub fn read_data(file: &File, loc: Loc) -> std::io::Result<String> {
    let mut buf = vec![0u8; loc.len as usize];
    file.read_exact_at(&mut buf, loc.offset)?;
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    if buf.pop() != Some(b'\n') {
        return Err(bad("the log does not hold a whole line there"));
    }
    parse_line(&buf).map(|(_, _, _, data)| data).map_err(bad)
}

/// The temporary file compaction writes before renaming it over the log.
pub fn compaction_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".compact");
    path.with_file_name(name)
}

/// The file whose `flock` marks the log as in use.
pub fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    path.with_file_name(name)
}

/// The log's exclusive lock, held until dropped (or the process ends).
pub struct LogLock {
    _flock: nix::fcntl::Flock<File>,
}

impl std::fmt::Debug for LogLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogLock")
    }
}

/// Why the log's lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "{path} is locked by another process: another data store is already using this log \
         (two writers on one file would lose writes and break fencing); stop it first"
    )]
    Held { path: PathBuf },
    #[error("cannot lock {path}: {reason}")]
    Other { path: PathBuf, reason: String },
}

/// Takes `<log>.lock` exclusively without waiting.
pub fn lock_exclusive(log: &Path) -> Result<LogLock, LockError> {
    use nix::fcntl::{Flock, FlockArg};
    let path = lock_path(log);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| LockError::Other {
            path: path.clone(),
            reason: e.to_string(),
        })?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(flock) => Ok(LogLock { _flock: flock }),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(LockError::Held { path }),
        Err((_, errno)) => Err(LockError::Other {
            path,
            reason: errno.desc().to_string(),
        }),
    }
}

/// The log rewritten to `keep` (the lines to keep, in the order to keep them): the new file,
/// opened for appending and reading, and each kept line's new place (same order as `keep`).
pub struct Compacted {
    pub file: File,
    pub locs: Vec<Loc>,
    pub len: u64,
}

/// Rewrites the log at `path` to the lines at `keep` (read from `current`, the open log), crash
/// safely: temporary file, fsync, rename, fsync of the directory. Returns the new file, already
/// in place under `path`.
pub fn compact(path: &Path, current: &File, keep: &[Loc]) -> std::io::Result<Compacted> {
    let tmp = compaction_path(path);
    let result = write_compacted(&tmp, current, keep);
    let (file, locs, len) = match result {
        Ok(done) => done,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // The rename is durable only once the directory is.
    sync_dir(path)?;
    Ok(Compacted { file, locs, len })
}

fn write_compacted(
    tmp: &Path,
    current: &File,
    keep: &[Loc],
) -> std::io::Result<(File, Vec<Loc>, u64)> {
    // Opened for appending: after the rename this is the log the store appends to.
    match std::fs::remove_file(tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let file = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .append(true)
        .open(tmp)?;
    let mut out = std::io::BufWriter::with_capacity(256 * 1024, &file);
    let mut locs = Vec::with_capacity(keep.len());
    let mut offset = 0u64;
    let mut line = Vec::new();
    for loc in keep {
        line.resize(loc.len as usize, 0);
        current.read_exact_at(&mut line, loc.offset)?;
        // Assert on the way out what replay will assume on the way in: whole lines.
        if line.last() != Some(&b'\n') || parse_line(&line[..line.len() - 1]).is_err() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the log has no whole write at offset {}", loc.offset),
            ));
        }
        out.write_all(&line)?;
        locs.push(Loc {
            offset,
            len: loc.len,
        });
        offset += u64::from(loc.len);
    }
    out.flush()?;
    drop(out);
    file.sync_all()?;
    Ok((file, locs, offset))
}

/// fsyncs the directory holding `path`.
pub fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "k\t1\tc\t\"a\"\n";
    const B: &str = "k\t2\tc\t\"b\"\n";

    fn replay_bytes(bytes: &[u8]) -> Result<(Vec<LoggedWrite>, Option<Torn>), ReplayError> {
        let mut writes = Vec::new();
        let torn = replay(bytes, 1024, |w| writes.push(w))?;
        Ok((writes, torn))
    }

    #[test]
    fn a_clean_log_replays_every_line_with_its_place() {
        let (writes, torn) = replay_bytes(format!("{A}\n{B}").as_bytes()).unwrap();
        assert_eq!(torn, None);
        assert_eq!(writes.len(), 2);
        assert_eq!(writes[1].token, 2);
        assert_eq!(
            writes[0].loc,
            Loc {
                offset: 0,
                len: A.len() as u32
            }
        );
        // The empty line between them is skipped but counted in the offsets.
        assert_eq!(
            writes[1].loc,
            Loc {
                offset: A.len() as u64 + 1,
                len: B.len() as u32
            }
        );
        assert_eq!(writes[1].data_bytes, 1);
    }

    #[test]
    fn an_unterminated_last_line_is_torn() {
        let log = format!("{A}{B}k\t3\tc\t\"par");
        let (writes, torn) = replay_bytes(log.as_bytes()).unwrap();
        assert_eq!(writes.len(), 2);
        let torn = torn.unwrap();
        assert_eq!(torn.line, 3);
        assert_eq!(torn.offset as usize, A.len() + B.len());
        // Even a fragment that happens to parse was never acknowledged.
        let (writes, torn) = replay_bytes(format!("{A}{}", B.trim_end()).as_bytes()).unwrap();
        assert_eq!(writes.len(), 1);
        assert_eq!(torn.unwrap().offset as usize, A.len());
    }

    #[test]
    fn an_unparsable_last_line_is_torn() {
        let log = format!("{A}\0\0\0\n");
        let (writes, torn) = replay_bytes(log.as_bytes()).unwrap();
        assert_eq!(writes.len(), 1);
        assert_eq!(torn.unwrap().offset as usize, A.len());
    }

    #[test]
    fn a_bad_line_before_the_last_is_an_error() {
        let log = format!("{A}garbage\n{B}");
        assert_eq!(
            replay_bytes(log.as_bytes()).unwrap_err(),
            ReplayError::Corrupt(2, "expected 4 tab-separated fields".to_string())
        );
        let log = format!("{A}garbage\nk\t3\tc\t\"par");
        assert!(matches!(
            replay_bytes(log.as_bytes()).unwrap_err(),
            ReplayError::Corrupt(2, _)
        ));
    }

    #[test]
    fn an_overlong_line_is_damage_unless_it_is_the_last() {
        let long = format!("k\t3\tc\t\"{}\"\n", "x".repeat(5000));
        let (writes, torn) = replay_bytes(format!("{A}{long}").as_bytes()).unwrap();
        assert_eq!(writes.len(), 1);
        assert_eq!(torn.unwrap().offset as usize, A.len());
        assert!(matches!(
            replay_bytes(format!("{A}{long}{B}").as_bytes()).unwrap_err(),
            ReplayError::Corrupt(2, _)
        ));
    }

    #[test]
    fn compaction_keeps_the_chosen_lines_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("writes.log");
        let c = "j\t5\tc\t\"c\"\n";
        std::fs::write(&path, format!("{A}{B}{c}")).unwrap();
        let current = File::open(&path).unwrap();
        let keep = [
            Loc {
                offset: A.len() as u64,
                len: B.len() as u32,
            },
            Loc {
                offset: (A.len() + B.len()) as u64,
                len: c.len() as u32,
            },
        ];
        let done = compact(&path, &current, &keep).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{B}{c}"));
        assert_eq!(done.len, (B.len() + c.len()) as u64);
        assert_eq!(read_data(&done.file, done.locs[1]).unwrap(), "c");
        assert!(!compaction_path(&path).exists());
        // A place that is not a whole line is refused, and the log is left as it was.
        let bad = [Loc { offset: 1, len: 3 }];
        assert!(compact(&path, &done.file, &bad).is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{B}{c}"));
        assert!(!compaction_path(&path).exists());
    }

    #[test]
    fn a_second_lock_on_one_log_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("writes.log");
        let first = lock_exclusive(&path).unwrap();
        let err = lock_exclusive(&path).unwrap_err();
        assert!(matches!(err, LockError::Held { .. }), "{err}");
        assert!(err.to_string().contains("another data store"), "{err}");
        drop(first);
        lock_exclusive(&path).unwrap();
    }
}
