# RaftLock container image: lock-node, data-store and lockctl on a slim Debian, as a non-root user.
#
#   docker build -t raftlock/raftlock:0.1.0 .
#
# The base images are build arguments. They default to the public images; on a machine without
# a registry, scripts/make-base-images.sh makes local ones and scripts/build-image.sh passes them.
ARG BUILD_IMAGE=docker.io/library/rust:1-slim-bookworm
ARG RUNTIME_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
ENV CARGO_TERM_COLOR=never \
    CARGO_INCREMENTAL=0
# Dependencies first, in their own layer: built against stub sources, so that a change to the
# project's own code does not rebuild them.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
RUN mkdir -p src/bin/lockctl src/bin/raftlock-bench \
 && touch src/lib.rs \
 && for bin in src/bin/lock-node.rs src/bin/data-store.rs src/bin/raftlock-sim.rs \
               src/bin/lockctl/main.rs src/bin/raftlock-bench/main.rs; do \
      echo 'fn main() {}' > "$bin"; \
    done \
 && cargo build --release --locked --bin lock-node --bin data-store --bin lockctl \
 && rm -rf src target/release/.fingerprint/raftlock-* target/release/deps/raftlock-* \
           target/release/deps/libraftlock-* target/release/lock-node target/release/data-store \
           target/release/lockctl
COPY src ./src
# Line tables stay in the binaries (a panic names file and line); compressed, they take a third
# of the room.
RUN cargo build --release --locked --bin lock-node --bin data-store --bin lockctl \
 && mkdir -p /out \
 && for bin in lock-node data-store lockctl; do \
      objcopy --compress-debug-sections=zlib "target/release/$bin" "/out/$bin"; \
    done

FROM ${RUNTIME_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="RaftLock" \
      org.opencontainers.image.description="A distributed lock service: FIFO locks with leases and fencing tokens on Raft" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 raftlock \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/raftlock --shell /usr/sbin/nologin raftlock \
 && mkdir -p /var/lib/raftlock \
 && chown 10001:10001 /var/lib/raftlock
COPY --from=build /out/ /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/raftlock
ENV RAFTLOCK_DATA_DIR=/var/lib/raftlock/data \
    RAFTLOCK_DATASTORE_FILE=/var/lib/raftlock/data-store/writes.log
# 8080 peers (Raft), 50050 clients (WebSocket, gRPC, HTTP), 8000 the data store.
EXPOSE 8080 50050 8000
# Without arguments: a one-node cluster, for trying it out (`docker run -p 50050:50050 ...`). Its
# peer port stays on loopback: a node listening for peers beyond it needs a cluster token.
CMD ["lock-node", "--node-id", "1", "--bootstrap", "--peer-listen", "127.0.0.1:8080"]
