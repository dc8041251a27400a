//! Generates the gRPC types and stubs from `proto/` with protox (a pure-Rust protobuf compiler:
//! no `protoc` needed) and tonic-prost-build, and writes the descriptor set the server's
//! reflection service serves.

use std::path::PathBuf;

use protox::prost::Message;

/// The .proto files, relative to the crate root.
const PROTOS: &[&str] = &["proto/kvatlas/v1/indexer.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("kvatlas_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .codec_path("crate::codec::Codec")
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
