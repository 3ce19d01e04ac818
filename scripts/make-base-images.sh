#!/usr/bin/env bash
# Makes the two base images the Dockerfile needs, on a machine that cannot pull from a registry.
#
#   scripts/make-base-images.sh            # builds both if missing
#   scripts/make-base-images.sh --force    # rebuilds both
#   scripts/make-base-images.sh --runtime-only [--force]   # only the runtime image (enough for
#                                          # scripts/build-image.sh --from-binaries)
#
# Images made (the Dockerfile's build arguments name them):
#   raftlock-base/debian:bookworm-slim   a minimal Debian 12 (debootstrap --variant=minbase)
#                                        with ca-certificates; the runtime stage
#   raftlock-base/rust:bookworm          the same plus gcc, libc6-dev and this machine's Rust
#                                        toolchain (rustc --print sysroot); the build stage
#
# Where images can be pulled, none of this is needed: the Dockerfile's defaults are the public
# `debian:bookworm-slim` and `rust:1-slim-bookworm` images.
#
# Needs root (debootstrap), Docker, and a reachable Debian mirror (DEBIAN_MIRROR, default
# http://deb.debian.org/debian). The machine's CA bundle is copied into both images so that tools
# inside them trust what the host trusts (some networks inspect TLS with their own CA).
set -euo pipefail

FORCE=0
RUNTIME_ONLY=0
for arg in "$@"; do
  case $arg in
    --force) FORCE=1 ;;
    --runtime-only) RUNTIME_ONLY=1 ;;
    *) echo "usage: scripts/make-base-images.sh [--force] [--runtime-only]" >&2; exit 2 ;;
  esac
done
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
RUNTIME_TAG=raftlock-base/debian:bookworm-slim
BUILD_TAG=raftlock-base/rust:bookworm
WORK="${TMPDIR:-/tmp}/raftlock-base-images"

have() { docker image inspect "$1" >/dev/null 2>&1; }

SUDO=""
[ "$(id -u)" != 0 ] && SUDO="sudo"
if ! command -v debootstrap >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends debootstrap
fi

# Imports a root filesystem directory as an image with a sane default environment.
import_rootfs() {
  local dir="$1" tag="$2"
  shift 2
  $SUDO tar -C "$dir" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/sh"]' \
    "$@" - "$tag" >/dev/null
  echo "made $tag"
}

# Trims a debootstrapped tree to what a container needs.
trim_rootfs() {
  local dir="$1"
  $SUDO rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* \
    "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* \
    "$dir"/usr/share/locale/* "$dir"/var/log/*.log
  $SUDO cp /etc/ssl/certs/ca-certificates.crt "$dir"/etc/ssl/certs/ca-certificates.crt
}

if [ "$FORCE" = 1 ] || ! have "$RUNTIME_TAG"; then
  dir="$WORK/runtime"
  $SUDO rm -rf "$dir"
  mkdir -p "$dir"
  echo "debootstrap $SUITE (runtime) from $MIRROR"
  $SUDO debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$dir" "$MIRROR" >/dev/null
  trim_rootfs "$dir"
  import_rootfs "$dir" "$RUNTIME_TAG"
  $SUDO rm -rf "$dir"
fi

if [ "$RUNTIME_ONLY" = 0 ] && { [ "$FORCE" = 1 ] || ! have "$BUILD_TAG"; }; then
  dir="$WORK/build"
  $SUDO rm -rf "$dir"
  mkdir -p "$dir"
  echo "debootstrap $SUITE (build) from $MIRROR"
  $SUDO debootstrap --variant=minbase --include=ca-certificates,gcc,libc6-dev "$SUITE" "$dir" "$MIRROR" >/dev/null
  trim_rootfs "$dir"
  sysroot="$(rustc --print sysroot)"
  echo "copying the Rust toolchain from $sysroot"
  $SUDO mkdir -p "$dir/usr/local/rust"
  # Binaries and libraries only: no documentation or sources.
  $SUDO cp -a "$sysroot/bin" "$sysroot/lib" "$dir/usr/local/rust/"
  $SUDO rm -rf "$dir/usr/local/rust/lib/rustlib/src" "$dir/usr/local/rust/lib/rustlib/etc"
  import_rootfs "$dir" "$BUILD_TAG" --change 'ENV CARGO_HOME=/usr/local/cargo'
  $SUDO rm -rf "$dir"
fi
