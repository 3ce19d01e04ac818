//! Every fuzz target's committed corpus (fuzz/corpus/<target>/), replayed through the target's
//! body in an ordinary `cargo test`, together with deterministic mutations of each input (bit
//! flips, overwritten bytes, truncations, repeated and inserted slices). The bodies are the very
//! code the cargo-fuzz targets run (fuzz/src/bodies/), so a crash input that cargo fuzz finds
//! and that is added to the corpus becomes a regression test here. The coverage-guided search
//! itself is the long form: `scripts/fuzz.sh 600` (and the weekly fuzz workflow).

#[path = "../fuzz/src/bodies/mod.rs"]
mod bodies;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Mutations made of each corpus input.
const MUTANTS_PER_INPUT: u64 = 48;
/// The largest input given to a body, as `scripts/fuzz.sh` bounds libFuzzer's (`-max_len`).
const MAX_LEN: usize = 4096;

/// A small deterministic generator (SplitMix64): the same mutants on every run and machine.
struct Mixer(u64);

impl Mixer {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One mutant of `input`: one to four edits.
fn mutate(input: &[u8], mixer: &mut Mixer) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + mixer.below(4) {
        match mixer.below(6) {
            0 if !out.is_empty() => {
                let at = mixer.below(out.len());
                out[at] ^= 1 << mixer.below(8);
            }
            1 if !out.is_empty() => {
                let at = mixer.below(out.len());
                out[at] = [0, 1, 0x7f, 0x80, 0xff][mixer.below(5)];
            }
            2 => out.truncate(mixer.below(out.len() + 1)),
            3 if !out.is_empty() => {
                let from = mixer.below(out.len());
                let len = 1 + mixer.below((out.len() - from).min(64));
                let slice = out[from..from + len].to_vec();
                let at = mixer.below(out.len() + 1);
                out.splice(at..at, slice);
            }
            4 => {
                let at = mixer.below(out.len() + 1);
                let bytes: Vec<u8> = (0..1 + mixer.below(8))
                    .map(|_| mixer.next() as u8)
                    .collect();
                out.splice(at..at, bytes);
            }
            _ if !out.is_empty() => {
                let at = mixer.below(out.len());
                out.remove(at);
            }
            _ => out.push(mixer.next() as u8),
        }
    }
    out.truncate(MAX_LEN);
    out
}

fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

/// Runs `body` on every corpus input of `target` and on its mutants; fails naming the input
/// (and the mutant's bytes) of every panic.
fn replay(target: &str, body: fn(&[u8])) {
    let files = corpus(target);
    assert!(!files.is_empty(), "fuzz/corpus/{target} is empty");
    let mut failures = Vec::new();
    let mut runs = 0;
    for (n, path) in files.iter().enumerate() {
        let input = std::fs::read(path).expect("corpus input");
        if catch_unwind(AssertUnwindSafe(|| body(&input))).is_err() {
            failures.push(format!("{}", path.display()));
        }
        runs += 1;
        // Seeded by the target's name and the input's place, so every input has its own mutants.
        let name = target.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let mut mixer = Mixer(name ^ n as u64);
        for m in 0..MUTANTS_PER_INPUT {
            let mutant = mutate(&input, &mut mixer);
            if catch_unwind(AssertUnwindSafe(|| body(&mutant))).is_err() {
                failures.push(format!(
                    "mutant {m} of {}: {:02x?}",
                    path.display(),
                    &mutant
                ));
            }
            runs += 1;
        }
    }
    println!("{target}: {} corpus inputs, {runs} runs", files.len());
    assert!(
        failures.is_empty(),
        "{target} panicked on {} of {runs} inputs (add each to fuzz/corpus/{target}/ once fixed):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn ws_request_corpus() {
    replay("ws_request", bodies::ws_request::run);
}

#[test]
fn grpc_messages_corpus() {
    replay("grpc_messages", bodies::grpc_messages::run);
}

#[test]
fn peer_messages_corpus() {
    replay("peer_messages", bodies::peer_messages::run);
}

#[test]
fn command_apply_corpus() {
    replay("command_apply", bodies::command_apply::run);
}

#[test]
fn storage_codec_corpus() {
    replay("storage_codec", bodies::storage_codec::run);
}

#[test]
fn raft_step_corpus() {
    replay("raft_step", bodies::raft_step::run);
}

/// The mutator changes its input and stays within the bound: a replay that only ever ran the
/// corpus itself would pass here unnoticed otherwise.
#[test]
fn mutants_differ_from_their_input_and_stay_bounded() {
    let input: Vec<u8> = (0..=255).collect();
    let mut mixer = Mixer(7);
    let mutants: Vec<Vec<u8>> = (0..100).map(|_| mutate(&input, &mut mixer)).collect();
    assert!(mutants.iter().filter(|m| **m != input).count() >= 95);
    assert!(mutants.iter().all(|m| m.len() <= MAX_LEN));
    let mut again = Mixer(7);
    assert_eq!(mutate(&input, &mut again), mutants[0], "not deterministic");
}
