//! Generates the gRPC code for `proto/peer.proto`, `proto/lock.proto` and seed 004's
//! `proto/seed004/api/lock_service.proto` (package `api`, kept verbatim) with a vendored `protoc`,
//! so a fresh machine needs no protobuf compiler installed.

#[cfg(not(feature = "server"))]
fn main() {}

#[cfg(feature = "server")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/peer.proto");
    println!("cargo:rerun-if-changed=proto/lock.proto");
    println!("cargo:rerun-if-changed=proto/seed004/api/lock_service.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .bytes(".raftlock.peer.v1.Entry.command")
        .bytes(".raftlock.peer.v1.InstallSnapshot.data")
        .compile_protos(&["proto/peer.proto", "proto/lock.proto"], &["proto"])?;
    // Seed 004's public API, served beside `raftlock.lock.v1` (src/server/grpc_seed.rs). Its own
    // include root, so the file keeps the path its clients compile it under.
    tonic_prost_build::configure()
        .build_client(false)
        .compile_protos(
            &["proto/seed004/api/lock_service.proto"],
            &["proto/seed004"],
        )?;
    Ok(())
}
