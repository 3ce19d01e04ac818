#!/usr/bin/env bash
# Builds the RaftLock image from the Dockerfile on a machine that cannot pull base images: makes
# local base images first (scripts/make-base-images.sh) and passes them as build arguments.
#
#   scripts/build-image.sh [TAG]        # default TAG: raftlock/raftlock:<version from Cargo.toml>
#   scripts/build-image.sh --from-binaries DIR [TAG]
#
# --from-binaries puts lock-node, data-store and lockctl from DIR (e.g. target/release, built
# on this machine: Debian 12, like the runtime image) into the Dockerfile's runtime stage
# instead of compiling them in its build stage: the same image layout, user, ports and command,
# without a second release build. .ci/run uses it; the release image is built from source.
#
# Where the public images can be pulled, plain `docker build -t raftlock/raftlock:TAG .` does the
# same with the Dockerfile's defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
bindir=""
if [ "${1:-}" = "--from-binaries" ]; then
  bindir=${2:?usage: scripts/build-image.sh --from-binaries DIR [TAG]}
  shift 2
fi
tag="${1:-raftlock/raftlock:$version}"
revision="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -n "$bindir" ]; then
  scripts/make-base-images.sh --runtime-only
  ctx=$(mktemp -d)
  trap 'rm -rf "$ctx"' EXIT
  mkdir "$ctx/bin"
  for bin in lock-node data-store lockctl; do
    [ -x "$bindir/$bin" ] || { echo "$bindir/$bin: no such program (build it first)" >&2; exit 1; }
    # As the Dockerfile's build stage does: debug sections compressed.
    objcopy --compress-debug-sections=zlib "$bindir/$bin" "$ctx/bin/$bin"
  done
  # The Dockerfile's runtime stage, taking the programs from the context instead of the
  # build stage.
  {
    grep '^ARG RUNTIME_IMAGE=' Dockerfile
    sed -n '/^FROM ${RUNTIME_IMAGE}$/,$p' Dockerfile \
      | sed 's|^COPY --from=build /out/ /usr/local/bin/$|COPY bin/ /usr/local/bin/|'
  } > "$ctx/Dockerfile"
  if ! grep -q '^COPY bin/ /usr/local/bin/$' "$ctx/Dockerfile"; then
    echo "the Dockerfile's runtime stage no longer copies /out/ from the build stage;" \
      "update scripts/build-image.sh --from-binaries to match it" >&2
    exit 1
  fi
  context=$ctx
  from="from $bindir "
  args=()
else
  scripts/make-base-images.sh
  context=.
  from=""
  args=(--build-arg BUILD_IMAGE=raftlock-base/rust:bookworm)
fi
echo "building $tag ${from}(revision $revision)"
docker build "${args[@]}" \
  --build-arg RUNTIME_IMAGE=raftlock-base/debian:bookworm-slim \
  --build-arg VERSION="$version" \
  --build-arg REVISION="$revision" \
  -t "$tag" "$context"
docker image ls "$tag"
