# Sourced by heap-profile.sh and alloc-profile.sh: finds heaptrack's preload library and
# interpreter (PRELOAD, INTERPRET) and builds lock-node on the system allocator (feature
# `system-allocator`: mimalloc bypasses the malloc that heaptrack replaces) into $BUILD, and
# raftlock-bench as usual.
PRELOAD=$(dirname "$(command -v heaptrack)")/../lib/heaptrack/libheaptrack_preload.so
INTERPRET=$(dirname "$(command -v heaptrack)")/../lib/heaptrack/libexec/heaptrack_interpret
[ -f "$PRELOAD" ] && [ -x "$INTERPRET" ] || { echo "heaptrack not found (apt-get install heaptrack)" >&2; exit 1; }
BUILD=target/heap-profile-build
CARGO_TARGET_DIR=$BUILD cargo build --release --bin lock-node --features system-allocator
cargo build --release --bin raftlock-bench
