//! Generates the gRPC code for `proto/peer.proto` and `proto/lock.proto` with a vendored `protoc`,
//! so a fresh machine needs no protobuf compiler installed.

#[cfg(not(feature = "server"))]
fn main() {}

#[cfg(feature = "server")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/peer.proto");
    println!("cargo:rerun-if-changed=proto/lock.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .bytes(".raftlock.peer.v1.Entry.command")
        .bytes(".raftlock.peer.v1.InstallSnapshot.data")
        .compile_protos(&["proto/peer.proto", "proto/lock.proto"], &["proto"])?;
    Ok(())
}
