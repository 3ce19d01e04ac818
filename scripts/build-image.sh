#!/usr/bin/env bash
# Builds the RaftLock image from the Dockerfile on a machine that cannot pull base images: makes
# local base images first (scripts/make-base-images.sh) and passes them as build arguments.
#
#   scripts/build-image.sh [TAG]        # default TAG: raftlock/raftlock:<version from Cargo.toml>
#
# Where the public images can be pulled, plain `docker build -t raftlock/raftlock:TAG .` does the
# same with the Dockerfile's defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
tag="${1:-raftlock/raftlock:$version}"
scripts/make-base-images.sh
revision="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "building $tag (revision $revision)"
docker build \
  --build-arg BUILD_IMAGE=raftlock-base/rust:bookworm \
  --build-arg RUNTIME_IMAGE=raftlock-base/debian:bookworm-slim \
  --build-arg VERSION="$version" \
  --build-arg REVISION="$revision" \
  -t "$tag" .
docker image ls "$tag"
