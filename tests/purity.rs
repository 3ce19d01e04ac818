//! The consensus core (`src/raft`) and the lock state machine (`src/lock`) must stay pure: no
//! async runtime, no clock, no network, no filesystem, no storage engine and no unseeded
//! randomness. This test reads their sources and fails on any such import.

use std::path::{Path, PathBuf};

/// (pattern, why it is banned)
const FORBIDDEN: &[(&str, &str)] = &[
    ("tokio", "async runtime"),
    ("std::time", "wall or monotonic clock"),
    ("Instant", "monotonic clock"),
    ("SystemTime", "wall clock"),
    ("std::net", "network"),
    ("std::fs", "filesystem"),
    ("std::thread", "threads"),
    ("sled", "storage engine"),
    ("thread_rng", "unseeded randomness"),
    ("rand::rng(", "unseeded randomness"),
    ("from_entropy", "unseeded randomness"),
    ("from_os_rng", "unseeded randomness"),
    ("OsRng", "unseeded randomness"),
    ("getrandom", "unseeded randomness"),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in read.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Source with `//` comments removed, so documentation may mention what the code may not use.
fn code_lines(source: &str) -> impl Iterator<Item = (usize, &str)> {
    source.lines().enumerate().map(|(i, line)| {
        let code = match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        };
        (i + 1, code)
    })
}

fn violations_in(dir: &str) -> Vec<String> {
    violations_under(&Path::new(env!("CARGO_MANIFEST_DIR")).join(dir))
}

fn violations_under(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let mut found = Vec::new();
    for file in files {
        let source = std::fs::read_to_string(&file).expect("readable source");
        for (line_no, code) in code_lines(&source) {
            for (pattern, why) in FORBIDDEN {
                if code.contains(pattern) {
                    found.push(format!("{}:{line_no}: `{pattern}` ({why})", file.display()));
                }
            }
            // `use std::{fs, time}` style imports.
            if let Some(start) = code.find("std::{") {
                let group = &code[start..];
                for banned in ["time", "net", "fs", "thread"] {
                    if group
                        .split(|c: char| !c.is_alphanumeric() && c != '_')
                        .any(|w| w == banned)
                    {
                        found.push(format!("{}:{line_no}: `std::{{{banned}}}`", file.display()));
                    }
                }
            }
        }
    }
    found
}

#[test]
fn raft_core_is_pure() {
    let found = violations_in("src/raft");
    assert!(
        found.is_empty(),
        "src/raft must stay pure:\n{}",
        found.join("\n")
    );
}

#[test]
fn lock_state_machine_is_pure() {
    let found = violations_in("src/lock");
    assert!(
        found.is_empty(),
        "src/lock must stay pure:\n{}",
        found.join("\n")
    );
}

#[test]
fn node_logic_is_pure() {
    let found = violations_in("src/node");
    assert!(
        found.is_empty(),
        "src/node must stay pure (the simulator runs it):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_catches_an_impure_import() {
    // Guard against a checker that can never fail: feed it a file that breaks the rule.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("purity-probe/src/raft");
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(
        dir.join("bad.rs"),
        "use std::time::Instant;\nuse std::{fs, io};\n",
    )
    .expect("write probe");
    let found = violations_under(&dir);
    assert_eq!(
        found.len(),
        3,
        "Instant, std::time and std::{{fs}} must be flagged: {found:?}"
    );
}

/// The simulator and the core must run a seed the same way every time, so neither may keep state
/// in hash maps, whose iteration order changes from map to map and from process to process. (The
/// lock state machine keeps one `HashMap` for lookups only; its iteration never decides anything.)
#[test]
fn simulator_and_core_use_ordered_collections() {
    let mut files = Vec::new();
    for dir in ["src/sim", "src/raft", "src/node"] {
        rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join(dir), &mut files);
    }
    assert!(files.len() > 5, "sources not found: {files:?}");
    let mut found = Vec::new();
    for file in files {
        let source = std::fs::read_to_string(&file).expect("readable source");
        for (line_no, code) in code_lines(&source) {
            for pattern in ["HashMap", "HashSet", "RandomState"] {
                if code.contains(pattern) {
                    found.push(format!("{}:{line_no}: `{pattern}`", file.display()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "unordered collections make runs of one seed differ:\n{}",
        found.join("\n")
    );
}
