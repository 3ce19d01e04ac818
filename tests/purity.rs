//! Rules on how the code is built, read off its sources. The consensus core (`src/raft`), the lock
//! state machine (`src/lock`) and the node (`src/node`) must stay pure: no async runtime, no clock,
//! no network, no filesystem, no storage engine and no unseeded randomness. And the modules of
//! `src/server` use each other in layers, never in a circle.

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

/// The modules of `src/server` (its files and directories) that each one uses, read off its
/// `crate::server::…` and `super::…` paths (`super::super::…` in a directory module's files).
/// Test modules are left out: a test may reach anything.
fn server_module_uses(root: &Path) -> std::collections::BTreeMap<String, Vec<String>> {
    let modules: std::collections::BTreeSet<String> = std::fs::read_dir(root)
        .expect("src/server")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let stem = name.strip_suffix(".rs").unwrap_or(&name).to_string();
            (stem != "mod" && (e.path().is_dir() || name.ends_with(".rs"))).then_some(stem)
        })
        .collect();
    let mut uses = std::collections::BTreeMap::new();
    for module in &modules {
        let mut files = Vec::new();
        let dir = root.join(module);
        if dir.is_dir() {
            rust_files(&dir, &mut files);
        } else {
            files.push(root.join(format!("{module}.rs")));
        }
        let mut used = std::collections::BTreeSet::new();
        for file in files {
            let name = file.file_name().unwrap().to_string_lossy().to_string();
            if name == "tests.rs" || name == "stream_kinds.rs" {
                continue;
            }
            let source = std::fs::read_to_string(&file).expect("source");
            let source = source
                .split("#[cfg(test)]\nmod tests {")
                .next()
                .unwrap_or("");
            // Comments may name any module (the layer picture does).
            let source: String = code_lines(source)
                .map(|(_, code)| format!("{code}\n"))
                .collect();
            // `super::` is `src/server` in its own files and in a directory module's `mod.rs`.
            let parent = if file.parent() == Some(root) || name == "mod.rs" {
                "super::"
            } else {
                "super::super::"
            };
            for prefix in ["crate::server::", parent] {
                for (at, _) in source.match_indices(prefix) {
                    let rest = &source[at + prefix.len()..];
                    // `super::x` or `super::{x, y::z}`
                    let names: Vec<&str> = match rest.strip_prefix('{') {
                        Some(group) => group
                            .split('}')
                            .next()
                            .unwrap_or("")
                            .split(',')
                            .map(|item| item.trim().split("::").next().unwrap_or(""))
                            .collect(),
                        None => vec![rest
                            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                            .next()
                            .unwrap_or("")],
                    };
                    for used_module in names {
                        if used_module != module && modules.contains(used_module) {
                            used.insert(used_module.to_string());
                        }
                    }
                }
            }
        }
        uses.insert(module.clone(), used.into_iter().collect());
    }
    uses
}

/// A circle of modules that use each other, if there is one.
fn circle(uses: &std::collections::BTreeMap<String, Vec<String>>) -> Option<Vec<String>> {
    fn visit(
        module: &str,
        uses: &std::collections::BTreeMap<String, Vec<String>>,
        done: &mut std::collections::BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == module) {
            let mut found = path[at..].to_vec();
            found.push(module.to_string());
            return Some(found);
        }
        if !done.insert(module.to_string()) {
            return None;
        }
        path.push(module.to_string());
        for next in uses.get(module).into_iter().flatten() {
            if let Some(found) = visit(next, uses, done, path) {
                return Some(found);
            }
        }
        path.pop();
        None
    }
    let mut done = std::collections::BTreeSet::new();
    uses.keys()
        .find_map(|module| visit(module, uses, &mut done, &mut Vec::new()))
}

/// No two modules of `src/server` use each other, directly or around a circle: the front ends
/// (WebSocket, gRPC, HTTP) use the shared request execution, which uses the driver and the
/// transports, which use TLS and sockets — never the other way (src/server/mod.rs draws it).
#[test]
fn server_modules_form_no_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/server");
    let uses = server_module_uses(&root);
    assert!(uses.len() > 20, "src/server read wrongly: {uses:?}");
    assert!(
        uses["ws"].contains(&"exec".to_string()),
        "the WebSocket front end's use of exec was not seen: {uses:?}"
    );
    if let Some(found) = circle(&uses) {
        panic!(
            "modules of src/server use each other in a circle: {}",
            found.join(" -> ")
        );
    }
    // The check itself finds a circle when there is one.
    let mut broken = uses.clone();
    broken.get_mut("tls").unwrap().push("ws".into());
    assert!(
        circle(&broken).is_some(),
        "a circle through tls -> ws went unseen"
    );
}
