//! The Raft log in segment files of its own, beside the sled store that keeps everything else
//! (`--log-engine segments`; see [`super::LogEngine`]).
//!
//! sled 0.34 hands every flush to its I/O thread pool and back (about sixteen thread
//! switches per flush on this project's benchmarks) and syncs with `sync_file_range`, which
//! is why a flush of the log through sled takes about twice a plain `write` + `fdatasync` of
//! the same bytes (`docs/bench/storage.md`). Here an append is one positional `write` into a
//! preallocated file, made by the caller's thread, and a flush one `fdatasync` of that file.
//!
//! ```text
//!   segment = header ‖ record* ‖ zeros (preallocated, not yet written)
//!   header  = "RLSEG002" ‖ sequence u64 ‖ mark ‖ mark                      (48 bytes)
//!   mark    = synced end u64 ‖ crc32 u32 (over sequence ‖ synced end) ‖ 0 u32
//!   record  = body length u32 ‖ crc32 u32 (over body) ‖ body
//!   body    = 1 ‖ first index u64 ‖ run      a run of entries (`codec`): every stored entry
//!                                             with index >= first index goes, then these follow
//!           | 2 ‖ index u64 ‖ term u64      a reset: the log is empty and starts after index
//! ```
//! All integers are big-endian. Segment files are `<sequence>.seg` (20 digits), written one
//! after the other; reading them in order and replaying their records gives the log. A run
//! that replaces a conflicting suffix is therefore one record, atomic like every record: its
//! checksum covers it whole, and a record cut short by a crash fails it.
//!
//! ## Torn tail or damage: the synced mark
//!
//! A crash can leave the end of the newest segment with a record cut off, or with records
//! whose bytes reached the disk out of order. None of them was synced, so none was
//! acknowledged, and opening drops them. A record that *was* synced and now fails its checksum
//! is another matter: the disk damaged it, the node acknowledged the entries in it, and a node
//! that restarted without them could help elect a leader that lacks a committed entry. The two
//! are told apart by the *synced mark*: the offset in the newest segment up to which a sync is
//! known to have completed (always the end of a record).
//!
//! The mark is written into the segment's own header, in one of two slots taken in turn, by
//! the flush that follows: before a flush's `fdatasync`, the end covered by the previous
//! completed sync is written to a slot, and that same `fdatasync` makes it durable. So no sync
//! is added, a mark on disk never claims bytes whose own sync had not completed (a mark written
//! with the sync that covers its bytes could reach the disk before them), and a slot torn by a
//! crash leaves the other, one flush older. The mark trails by one flush: the records of the
//! newest flush are below it only once a later flush (with later records) has written it.
//!
//! Opening the newest segment takes the higher of the valid slots as the mark. A record that
//! is cut off, fails its checksum, or is missing (zeros, a file cut short) *below* the mark is
//! [`StorageError::LogDamagedBelowSynced`], and the store does not open: the node must be
//! rebuilt from the cluster (removed, then started on an empty data directory with `--join`).
//! Only at or above the mark is it a torn tail: the records from there on are dropped with a
//! warning, the rest of the file is cleared, and the log goes on. Every segment but the newest
//! was synced whole before the next was created, so any bad record in one is damage too, with
//! the same error.
//!
//! ## Stores written before the mark
//!
//! Their segments begin `"RLSEG001" ‖ sequence u64` (16 bytes, records from there, no mark).
//! They are read as before: such a segment, if newest, has the mark 0, so any bad record in it
//! is a possible torn tail and dropped (with a warning that damage cannot be told from a torn
//! write there). Opening then seals it (synced) and starts a new segment in the format above,
//! so every record written from then on is covered by a mark. A release that does not know the
//! mark refuses the new segments ("not a log segment (bad header)") instead of misreading them.
//!
//! The `log/` directory's entry in the store's directory is synced when `log/` is created, and
//! a new segment file's entry in `log/` by the sync that follows its creation.
//!
//! A segment is deleted once every entry it holds is at or below the durable snapshot point
//! (the caller says which point is durable), oldest first.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::codec::{decode_entry, push_run_entry, run_records, RUN_VERSION};
use super::logfs::{LogFile, LogFs, StdFs};
use super::StorageError;
use crate::raft::{Entry, Index, Term};

/// The magic of segments with a synced mark (see the module documentation).
const MAGIC: &[u8; 8] = b"RLSEG002";
/// The magic of segments written before the synced mark.
const MAGIC_V1: &[u8; 8] = b"RLSEG001";
/// Where records begin in a segment: after the magic, the sequence and two mark slots.
pub(crate) const SEGMENT_HEADER: u64 = 48;
/// Where records begin in a segment written before the synced mark.
pub(crate) const SEGMENT_HEADER_V1: u64 = 16;
/// The offsets of the two slots of the synced mark in a segment's header.
const MARK_SLOTS: [u64; 2] = [16, 32];
const MARK_BYTES: usize = 16;
const FRAME: usize = 8;
const KIND_RUN: u8 = 1;
const KIND_RESET: u8 = 2;
const SUFFIX: &str = ".seg";

/// Where one entry's record lies: its segment, offset and length (the record `decode_entry`
/// reads), and its term, so that `term` needs no read.
#[derive(Clone, Copy, Debug)]
struct Loc {
    seq: u64,
    offset: u64,
    len: u32,
    term: Term,
}

struct Segment {
    seq: u64,
    /// Shared with a sync running on another thread ([`SegmentLog::take_sync_job`]).
    file: Arc<dyn LogFile>,
    /// The highest index of any entry (or reset point) written to this segment.
    max_index: Index,
    /// Where its records begin: [`SEGMENT_HEADER`], or [`SEGMENT_HEADER_V1`] for a segment
    /// written before the synced mark.
    header: u64,
    /// Its synced mark; `None` for a segment written before the mark (never written to again:
    /// opening seals it).
    mark: Option<Arc<SyncedMark>>,
}

/// The synced mark of a segment (see the module documentation): what its syncs have covered,
/// and what of that its header records. Shared with the syncs that run on another thread;
/// only one sync runs at a time.
struct SyncedMark {
    seq: u64,
    /// The end of the bytes covered by a completed sync.
    synced: AtomicU64,
    /// The highest mark written to a slot.
    written: AtomicU64,
    /// The slot the next mark goes to (0 or 1).
    next_slot: AtomicUsize,
}

impl SyncedMark {
    fn new(seq: u64, synced: u64, written: u64, next_slot: usize) -> Arc<Self> {
        Arc::new(SyncedMark {
            seq,
            synced: AtomicU64::new(synced),
            written: AtomicU64::new(written),
            next_slot: AtomicUsize::new(next_slot),
        })
    }

    /// Before a sync of `file`: writes the end that earlier syncs covered into the next slot,
    /// if it moved since the last mark written, for this sync to make durable with the rest.
    fn write_before_sync(&self, file: &dyn LogFile) -> Result<(), StorageError> {
        let synced = self.synced.load(Ordering::Acquire);
        if synced <= self.written.load(Ordering::Acquire) {
            return Ok(());
        }
        let slot = self.next_slot.load(Ordering::Acquire) % 2;
        file.write_all_at(&mark_bytes(self.seq, synced), MARK_SLOTS[slot])
            .map_err(io("writing the log's synced mark"))?;
        self.next_slot.store(1 - slot, Ordering::Release);
        self.written.store(synced, Ordering::Release);
        Ok(())
    }

    /// After a sync that covered the segment up to `end` completed.
    fn synced_to(&self, end: u64) {
        self.synced.fetch_max(end, Ordering::AcqRel);
    }
}

/// One slot of the synced mark: the end `synced`, with a checksum that also covers the
/// segment's sequence (so a slot copied from another segment does not pass).
fn mark_bytes(seq: u64, synced: u64) -> [u8; MARK_BYTES] {
    let mut slot = [0u8; MARK_BYTES];
    slot[..8].copy_from_slice(&synced.to_be_bytes());
    let crc = mark_crc(seq, synced);
    slot[8..12].copy_from_slice(&crc.to_be_bytes());
    slot
}

fn mark_crc(seq: u64, synced: u64) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq.to_be_bytes());
    hasher.update(&synced.to_be_bytes());
    hasher.finalize()
}

/// What a mark slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MarkSlot {
    /// Never written.
    Empty,
    Valid(u64),
    /// Fails its checksum: torn by a crash while it was rewritten, or damaged.
    Bad,
}

fn read_mark_slot(seq: u64, slot: &[u8]) -> MarkSlot {
    if slot.iter().all(|b| *b == 0) {
        return MarkSlot::Empty;
    }
    let synced = u64::from_be_bytes(slot[..8].try_into().unwrap_or_default());
    let crc = u32::from_be_bytes(slot[8..12].try_into().unwrap_or_default());
    if crc == mark_crc(seq, synced) && slot[12..16] == [0; 4] {
        MarkSlot::Valid(synced)
    } else {
        MarkSlot::Bad
    }
}

/// The part of a segment file's synced bytes (`bytes`, as a file system that lost power keeps
/// them) where a changed byte is damage the engine must report as
/// [`StorageError::LogDamagedBelowSynced`]: in the newest segment (`newest`), the records below
/// its synced mark; in any other, every record. Empty for a file that is not a segment. For
/// tests that damage a simulated disk ([`super::SimDisk::corrupt_synced_sector`]).
pub(crate) fn damage_range(path: &Path, bytes: &[u8], newest: bool) -> std::ops::Range<u64> {
    let seq = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(SUFFIX))
        .and_then(|stem| stem.parse::<u64>().ok());
    let Some(seq) = seq else { return 0..0 };
    if bytes.get(..8) != Some(MAGIC.as_slice()) || bytes.len() < SEGMENT_HEADER as usize {
        return 0..0;
    }
    let end = if newest {
        MARK_SLOTS
            .iter()
            .filter_map(|&at| {
                match read_mark_slot(seq, &bytes[at as usize..at as usize + MARK_BYTES]) {
                    MarkSlot::Valid(end) => Some(end),
                    _ => None,
                }
            })
            .max()
            .unwrap_or(0)
    } else {
        bytes
            .iter()
            .rposition(|b| *b != 0)
            .map_or(0, |at| at as u64 + 1)
    };
    SEGMENT_HEADER..end.min(bytes.len() as u64)
}

/// The sequence number of a segment file's name, if it is one.
pub(crate) fn segment_seq(path: &Path) -> Option<u64> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(SUFFIX)?;
    (stem.len() == 20).then(|| stem.parse().ok()).flatten()
}

/// A sync of the log taken off its owner's thread ([`SegmentLog::take_sync_job`]).
#[derive(Default)]
pub(crate) struct SegmentSync {
    file: Option<Arc<dyn LogFile>>,
    /// The file's synced mark, and the end of what was written to it when the job was taken.
    mark: Option<(Arc<SyncedMark>, u64)>,
    dir: Option<(Arc<dyn LogFs>, PathBuf)>,
}

impl SegmentSync {
    /// Adds a later job's work to this one (the newest segment's sync covers the older ones:
    /// a segment is synced when it is sealed).
    pub(crate) fn merge(&mut self, later: SegmentSync) {
        if later.file.is_some() {
            self.file = later.file;
            self.mark = later.mark;
        }
        if later.dir.is_some() {
            self.dir = later.dir;
        }
    }

    pub(crate) fn run(&self) -> Result<(), StorageError> {
        if let Some(file) = &self.file {
            if let Some((mark, _)) = &self.mark {
                mark.write_before_sync(file.as_ref())?;
            }
            file.sync_data().map_err(io("syncing the log"))?;
            if let Some((mark, end)) = &self.mark {
                mark.synced_to(*end);
            }
        }
        if let Some((fs, dir)) = &self.dir {
            fs.sync_dir(dir)
                .map_err(io("syncing the log's directory"))?;
        }
        Ok(())
    }
}

/// The log's segment files; see the module documentation.
pub(crate) struct SegmentLog {
    /// Every file operation goes through it: [`StdFs`] in lock-node.
    fs: Arc<dyn LogFs>,
    dir: PathBuf,
    segment_bytes: u64,
    /// Oldest first; the last one is written to.
    segments: VecDeque<Segment>,
    /// Where the next record goes in the last segment.
    write_offset: u64,
    /// Locations of the entries `base..base + locs.len()`.
    locs: VecDeque<Loc>,
    base: Index,
    /// A segment was created since the directory was last synced.
    dir_unsynced: bool,
    /// Bytes written since the last sync.
    unsynced: bool,
    /// Reused for encoding records.
    buf: Vec<u8>,
    /// Reused for the entries' places in `buf` while a run is encoded: offset, length, term.
    spans: Vec<(usize, usize, Term)>,
}

fn io(action: &'static str) -> impl FnOnce(std::io::Error) -> StorageError {
    move |source| StorageError::Io { action, source }
}

fn corrupt(path: &Path, offset: u64, problem: impl Into<String>) -> StorageError {
    StorageError::Corrupt {
        tree: "log segment",
        key: format!("{} offset {offset}", path.display()),
        problem: problem.into(),
    }
}

/// A record that was synced is bad: see [`StorageError::LogDamagedBelowSynced`].
fn damaged(path: &Path, offset: u64, synced_to: u64, problem: &str) -> StorageError {
    StorageError::LogDamagedBelowSynced {
        file: path.display().to_string(),
        offset,
        synced_to,
        problem: problem.to_string(),
    }
}

fn segment_name(seq: u64) -> String {
    format!("{seq:020}{SUFFIX}")
}

/// The sequence numbers of the segment files in `dir`, in order.
fn list_segments(fs: &dyn LogFs, dir: &Path) -> Result<Vec<u64>, StorageError> {
    let mut seqs = Vec::new();
    let Some(names) = fs
        .list_dir(dir)
        .map_err(io("listing the log's segment files"))?
    else {
        return Ok(seqs);
    };
    for name in &names {
        let name = name.as_str();
        let Some(stem) = name.strip_suffix(SUFFIX) else {
            continue;
        };
        match stem.parse::<u64>() {
            Ok(seq) if stem.len() == 20 => seqs.push(seq),
            _ => {
                return Err(StorageError::Corrupt {
                    tree: "log segment",
                    key: name.to_string(),
                    problem: "a segment file name is 20 digits and .seg".into(),
                })
            }
        }
    }
    seqs.sort_unstable();
    Ok(seqs)
}

/// Creates the log's directory if it is not there, and then syncs the directory that holds
/// it, so that the new directory's entry survives a power cut (its segments' entries are in
/// it and synced with it).
fn create_log_dir(fs: &dyn LogFs, dir: &Path) -> Result<(), StorageError> {
    if fs.is_dir(dir) {
        return Ok(());
    }
    fs.create_dir_all(dir)
        .map_err(io("creating the log's directory"))?;
    let parent = match dir.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    fs.sync_dir(parent)
        .map_err(io("syncing the store's directory after creating the log's"))
}

impl SegmentLog {
    /// Whether `dir` holds any segment file.
    pub(crate) fn exists_in(dir: &Path) -> Result<bool, StorageError> {
        Ok(!list_segments(&StdFs, dir)?.is_empty())
    }

    /// Opens the segments in `dir` (creating the directory and a first segment if there are
    /// none) and replays them.
    pub(crate) fn open(dir: &Path, segment_bytes: u64) -> Result<Self, StorageError> {
        Self::open_on(Arc::new(StdFs), dir, segment_bytes)
    }

    /// [`SegmentLog::open`] on the file system `fs`.
    pub(crate) fn open_on(
        fs: Arc<dyn LogFs>,
        dir: &Path,
        segment_bytes: u64,
    ) -> Result<Self, StorageError> {
        create_log_dir(fs.as_ref(), dir)?;
        let mut log = SegmentLog {
            fs,
            dir: dir.to_path_buf(),
            segment_bytes: segment_bytes.max(SEGMENT_HEADER + 64),
            segments: VecDeque::new(),
            write_offset: SEGMENT_HEADER,
            locs: VecDeque::new(),
            base: 1,
            dir_unsynced: false,
            unsynced: false,
            buf: Vec::new(),
            spans: Vec::new(),
        };
        let seqs = list_segments(log.fs.as_ref(), dir)?;
        if seqs.is_empty() {
            log.create_segment(1)?;
            log.sync()?;
            return Ok(log);
        }
        for (i, &seq) in seqs.iter().enumerate() {
            let last = i + 1 == seqs.len();
            log.replay_segment(seq, last)?;
        }
        if log.segments.back().is_some_and(|s| s.mark.is_none()) {
            // A segment written before the synced mark: sealed here, so that everything written
            // from now on goes to a segment that has one.
            tracing::info!(
                "the log's newest segment has no synced mark (written by an older release); \
                 it is sealed and the log goes on in a new segment that has one"
            );
            log.roll()?;
            log.sync()?;
        }
        Ok(log)
    }

    fn path(&self, seq: u64) -> PathBuf {
        self.dir.join(segment_name(seq))
    }

    fn create_segment(&mut self, seq: u64) -> Result<(), StorageError> {
        let path = self.path(seq);
        let file = self
            .fs
            .create_new(&path)
            .map_err(io("creating a log segment"))?;
        let mut header = MAGIC.to_vec();
        header.extend_from_slice(&seq.to_be_bytes());
        header.resize(SEGMENT_HEADER as usize, 0);
        file.write_all_at(&header, 0)
            .map_err(io("writing a log segment's header"))?;
        file.preallocate(SEGMENT_HEADER, self.segment_bytes);
        self.segments.push_back(Segment {
            seq,
            file,
            max_index: 0,
            header: SEGMENT_HEADER,
            mark: Some(SyncedMark::new(seq, SEGMENT_HEADER, SEGMENT_HEADER, 0)),
        });
        self.write_offset = SEGMENT_HEADER;
        self.dir_unsynced = true;
        self.unsynced = true;
        Ok(())
    }

    /// Reads one segment and replays its records. In the newest segment (`last`) the first
    /// record at or above its synced mark that is cut off or fails its checksum ends the log,
    /// and what follows it is cleared; below the mark, or in any other segment, it is
    /// [`StorageError::LogDamagedBelowSynced`].
    fn replay_segment(&mut self, seq: u64, last: bool) -> Result<(), StorageError> {
        let path = self.path(seq);
        let file = self.fs.open(&path).map_err(io("opening a log segment"))?;
        let bytes = file.read_all().map_err(io("reading a log segment"))?;
        let header = match bytes.get(..8) {
            Some(magic) if magic == MAGIC => SEGMENT_HEADER,
            Some(magic) if magic == MAGIC_V1 => SEGMENT_HEADER_V1,
            _ => 0,
        };
        if header == 0 || bytes.len() < header as usize || bytes[8..16] != seq.to_be_bytes() {
            if last && bytes.iter().all(|b| *b == 0) {
                // Created, but its header never reached the disk: nothing was written to it.
                drop(file);
                self.fs
                    .remove_file(&path)
                    .map_err(io("removing an empty log segment"))?;
                let next = self.segments.back().map_or(1, |s| s.seq + 1);
                return self.create_segment(next.max(seq));
            }
            return Err(corrupt(&path, 0, "not a log segment (bad header)"));
        }
        // The synced mark: below it every record was synced. Only the newest segment's
        // matters; every other one was synced whole before the next was created.
        let slots = if header == SEGMENT_HEADER {
            MARK_SLOTS.map(|at| read_mark_slot(seq, &bytes[at as usize..at as usize + MARK_BYTES]))
        } else {
            [MarkSlot::Empty; 2]
        };
        let valid = |slot: MarkSlot| match slot {
            MarkSlot::Valid(end) => Some(end),
            _ => None,
        };
        let mark_on_disk = slots.iter().filter_map(|s| valid(*s)).max().unwrap_or(0);
        if last && slots.contains(&MarkSlot::Bad) {
            tracing::warn!(
                segment = %path.display(),
                mark = mark_on_disk,
                "a slot of the log's synced mark fails its checksum (a crash while it was \
                 rewritten, or damage); the other slot is used"
            );
        }
        let mark = if last { mark_on_disk } else { 0 };
        let mut segment = Segment {
            seq,
            file,
            max_index: 0,
            header,
            mark: None,
        };
        let mut offset = header as usize;
        let end = loop {
            let rest = &bytes[offset..];
            let at = offset as u64;
            if rest.len() < FRAME {
                if at < mark {
                    return Err(damaged(
                        &path,
                        at,
                        mark,
                        "the segment ends before its synced mark",
                    ));
                }
                break offset;
            }
            let len = u32::from_be_bytes(rest[..4].try_into().unwrap_or_default()) as usize;
            let crc = u32::from_be_bytes(rest[4..8].try_into().unwrap_or_default());
            if len == 0 && crc == 0 {
                if at < mark {
                    return Err(damaged(
                        &path,
                        at,
                        mark,
                        "records below the synced mark are gone (zeros where they were)",
                    ));
                }
                break offset;
            }
            let whole = rest.len() >= FRAME + len
                && crc32fast::hash(&rest[FRAME..FRAME + len]) == crc
                && len > 0;
            if !whole {
                if !last {
                    return Err(damaged(
                        &path,
                        at,
                        bytes.len() as u64,
                        "a record is cut off or fails its checksum in a segment that is not the \
                         newest (synced whole before the next one was begun)",
                    ));
                }
                if at < mark {
                    return Err(damaged(
                        &path,
                        at,
                        mark,
                        "a record below the synced mark is cut off or fails its checksum",
                    ));
                }
                break offset;
            }
            let body = &rest[FRAME..FRAME + len];
            self.replay_record(&mut segment, at + FRAME as u64, body)
                .map_err(|problem| corrupt(&path, at, problem))?;
            offset += FRAME + len;
        };
        if last {
            let discarded = bytes[end..].iter().filter(|b| **b != 0).count();
            if discarded > 0 {
                if header == SEGMENT_HEADER {
                    tracing::warn!(
                        segment = %path.display(),
                        offset = end,
                        synced_mark = mark,
                        "the log's newest segment ends, above its synced mark, with bytes that \
                         are not whole records (writes cut off by a crash, never \
                         acknowledged); they are cleared"
                    );
                } else {
                    tracing::warn!(
                        segment = %path.display(),
                        offset = end,
                        "the log's newest segment, written by a release without the synced \
                         mark, ends with bytes that are not whole records; they are taken for \
                         writes cut off by a crash and cleared (damage to synced records cannot \
                         be told from that in such a segment)"
                    );
                }
            }
            // Whatever follows the last whole record goes, so that no stale record can line
            // up behind a later one.
            segment
                .file
                .set_len(end as u64)
                .map_err(io("clearing the end of a log segment"))?;
            segment.file.preallocate(end as u64, self.segment_bytes);
            segment
                .file
                .sync_all()
                .map_err(io("syncing a log segment"))?;
            self.write_offset = end as u64;
            if header == SEGMENT_HEADER {
                // Everything up to `end` is synced now; the next sync's mark says so. The slot
                // that does not hold the mark on disk is rewritten first.
                let next_slot = match slots {
                    [MarkSlot::Valid(a), MarkSlot::Valid(b)] => usize::from(a > b),
                    [MarkSlot::Valid(_), _] => 1,
                    _ => 0,
                };
                segment.mark = Some(SyncedMark::new(
                    seq,
                    end as u64,
                    mark_on_disk.max(SEGMENT_HEADER),
                    next_slot,
                ));
            }
        }
        self.segments.push_back(segment);
        Ok(())
    }

    /// Replays one record whose body starts at `body_offset` in `segment`.
    fn replay_record(
        &mut self,
        segment: &mut Segment,
        body_offset: u64,
        body: &[u8],
    ) -> Result<(), String> {
        match body.first() {
            Some(&KIND_RUN) if body.len() > 9 => {
                let first = u64::from_be_bytes(body[1..9].try_into().unwrap_or_default());
                let run = &body[9..];
                let records = run_records(first, run).map_err(|e| e.to_string())?;
                self.truncate_from(first);
                let run_offset = body_offset + 9;
                for (index, record) in records {
                    let at = record.as_ptr() as usize - run.as_ptr() as usize;
                    let entry = decode_entry(index, record).map_err(|e| e.to_string())?;
                    self.locs.push_back(Loc {
                        seq: segment.seq,
                        offset: run_offset + at as u64,
                        len: record.len() as u32,
                        term: entry.term,
                    });
                    segment.max_index = segment.max_index.max(index);
                }
                Ok(())
            }
            Some(&KIND_RESET) if body.len() == 17 => {
                let index = u64::from_be_bytes(body[1..9].try_into().unwrap_or_default());
                self.start_after(index);
                segment.max_index = segment.max_index.max(index);
                Ok(())
            }
            Some(kind) => Err(format!("unknown record kind {kind} or bad length")),
            None => Err("empty record".into()),
        }
    }

    /// Drops every entry with index >= `first` from memory. A `first` past the end after a gap
    /// starts the log over at `first` (what came before is at or below a snapshot point, or the
    /// caller's recovery finds the gap).
    fn truncate_from(&mut self, first: Index) {
        let next = self.base + self.locs.len() as u64;
        if first <= self.base || first > next {
            self.locs.clear();
            self.base = first;
        } else {
            self.locs.truncate((first - self.base) as usize);
        }
    }

    /// Forgets every entry: the log is empty and its next entry is `index + 1`.
    fn start_after(&mut self, index: Index) {
        self.locs.clear();
        self.base = index + 1;
    }

    /// Index of the first entry held, if any.
    pub(crate) fn first_index(&self) -> Option<Index> {
        (!self.locs.is_empty()).then_some(self.base)
    }

    /// Index of the last entry held, if any.
    pub(crate) fn last_index(&self) -> Option<Index> {
        (!self.locs.is_empty()).then(|| self.base + self.locs.len() as u64 - 1)
    }

    pub(crate) fn term(&self, index: Index) -> Option<Term> {
        let at = index.checked_sub(self.base)?;
        self.locs.get(at as usize).map(|loc| loc.term)
    }

    /// Forgets, in memory only, every entry at or below `upto` (the files keep them until
    /// [`SegmentLog::remove_segments_through`]).
    pub(crate) fn forget_through(&mut self, upto: Index) {
        if upto < self.base {
            return;
        }
        let drop = ((upto - self.base + 1) as usize).min(self.locs.len());
        self.locs.drain(..drop);
        self.base = upto + 1;
    }

    /// Writes a run record: every entry from `entries[0].index` on is replaced by `entries`.
    /// The caller has checked that they are contiguous and where they may start.
    pub(crate) fn append(&mut self, entries: &[Entry]) -> Result<(), StorageError> {
        let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
            return Ok(());
        };
        let mut buf = std::mem::take(&mut self.buf);
        let mut spans = std::mem::take(&mut self.spans);
        buf.clear();
        spans.clear();
        buf.extend_from_slice(&[0; FRAME]);
        buf.push(KIND_RUN);
        buf.extend_from_slice(&first.index.to_be_bytes());
        buf.push(RUN_VERSION);
        for entry in entries {
            let at = buf.len();
            push_run_entry(&mut buf, entry);
            spans.push((at + 4, buf.len() - at - 4, entry.term));
        }
        let written = self.write_record(&mut buf, last.index);
        self.buf = buf;
        if let Ok((seq, offset)) = written {
            self.truncate_from(first.index);
            self.locs.extend(spans.iter().map(|&(at, len, term)| Loc {
                seq,
                offset: offset + at as u64,
                len: len as u32,
                term,
            }));
        }
        self.spans = spans;
        written.map(|_| ())
    }

    /// Writes a reset record: the log is empty and its next entry is `index + 1`.
    pub(crate) fn reset(&mut self, index: Index, term: Term) -> Result<(), StorageError> {
        let mut buf = vec![0; FRAME];
        buf.push(KIND_RESET);
        buf.extend_from_slice(&index.to_be_bytes());
        buf.extend_from_slice(&term.to_be_bytes());
        self.write_record(&mut buf, index)?;
        self.start_after(index);
        Ok(())
    }

    /// The segment written to.
    fn current(&self) -> Result<&Segment, StorageError> {
        self.segments.back().ok_or_else(|| StorageError::Io {
            action: "writing the log",
            source: std::io::Error::other("no open segment"),
        })
    }

    /// Frames `buf` (whose first [`FRAME`] bytes are reserved), rolls to a new segment if it
    /// does not fit, and writes it; `max_index` is the highest index the record names. Returns
    /// the segment and offset the record went to.
    fn write_record(
        &mut self,
        buf: &mut [u8],
        max_index: Index,
    ) -> Result<(u64, u64), StorageError> {
        let len = (buf.len() - FRAME) as u32;
        let crc = crc32fast::hash(&buf[FRAME..]);
        buf[..4].copy_from_slice(&len.to_be_bytes());
        buf[4..FRAME].copy_from_slice(&crc.to_be_bytes());
        let header = self.current()?.header;
        if self.write_offset > header && self.write_offset + buf.len() as u64 > self.segment_bytes {
            self.roll()?;
        }
        let offset = self.write_offset;
        let segment = self.current()?;
        segment
            .file
            .write_all_at(buf, offset)
            .map_err(io("appending to the log"))?;
        let seq = segment.seq;
        if let Some(segment) = self.segments.back_mut() {
            segment.max_index = segment.max_index.max(max_index);
        }
        self.write_offset += buf.len() as u64;
        self.unsynced = true;
        Ok((seq, offset))
    }

    /// Seals the current segment (synced, so that only the newest can end in a torn write)
    /// and starts the next.
    fn roll(&mut self) -> Result<(), StorageError> {
        let current = self.current()?;
        current
            .file
            .sync_data()
            .map_err(io("syncing a full log segment"))?;
        let next = current.seq + 1;
        self.create_segment(next)
    }

    /// Entries in `[lo, hi)` that the log holds, checksums verified.
    pub(crate) fn read(&self, lo: Index, hi: Index) -> Result<Vec<Entry>, StorageError> {
        let mut out = Vec::new();
        let lo = lo.max(self.base);
        let Some(first_seq) = self.segments.front().map(|s| s.seq) else {
            return Ok(out);
        };
        let mut record = Vec::new();
        for index in lo..hi {
            let Some(loc) = self.locs.get((index - self.base) as usize) else {
                break;
            };
            let segment = loc
                .seq
                .checked_sub(first_seq)
                .and_then(|at| self.segments.get(at as usize))
                .filter(|s| s.seq == loc.seq)
                .ok_or_else(|| StorageError::Unavailable {
                    index,
                    last_index: self.last_index().unwrap_or(0),
                })?;
            record.resize(loc.len as usize, 0);
            segment
                .file
                .read_exact_at(&mut record, loc.offset)
                .map_err(io("reading the log"))?;
            out.push(decode_entry(index, &record)?);
        }
        Ok(out)
    }

    /// Makes everything written durable: the newest segment's data, and the directory when a
    /// segment was created.
    pub(crate) fn sync(&mut self) -> Result<(), StorageError> {
        self.take_sync_job().run()
    }

    /// What [`SegmentLog::sync`] would do, handed to another thread: a handle of the newest
    /// segment when it holds unsynced data, and the directory when a segment was created or
    /// removed. The log counts as synced from here on; the caller must not take what was
    /// written as durable before the returned job has run.
    pub(crate) fn take_sync_job(&mut self) -> SegmentSync {
        let mut job = SegmentSync::default();
        if std::mem::take(&mut self.unsynced) {
            if let Some(segment) = self.segments.back() {
                job.file = Some(Arc::clone(&segment.file));
                job.mark = segment
                    .mark
                    .as_ref()
                    .map(|mark| (Arc::clone(mark), self.write_offset));
            }
        }
        if std::mem::take(&mut self.dir_unsynced) {
            job.dir = Some((Arc::clone(&self.fs), self.dir.clone()));
        }
        job
    }

    /// Deletes the oldest segments, except the newest, while every entry in them is at or
    /// below `durable_point`, a snapshot point that is already durable.
    pub(crate) fn remove_segments_through(
        &mut self,
        durable_point: Index,
    ) -> Result<usize, StorageError> {
        let mut removed = 0;
        while self.segments.len() > 1 {
            let Some(oldest) = self.segments.front() else {
                break;
            };
            if oldest.max_index > durable_point {
                break;
            }
            let path = self.path(oldest.seq);
            self.fs
                .remove_file(&path)
                .map_err(io("removing a compacted log segment"))?;
            self.segments.pop_front();
            removed += 1;
        }
        if removed > 0 {
            self.dir_unsynced = true;
        }
        Ok(removed)
    }

    /// Number of segment files.
    pub(crate) fn segment_count(&self) -> usize {
        self.segments.len()
    }
}
