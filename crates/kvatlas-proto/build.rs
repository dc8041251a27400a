//! Generates the gRPC types and stubs from `proto/` with protox (a pure-Rust protobuf compiler:
//! no `protoc` needed) and tonic-prost-build, and writes the descriptor sets the server's
//! reflection service serves: kvatlas's own API (`kvatlas.v1`) and llm-d's indexer API
//! (`indexer.v1`), each compiled on its own so that each descriptor set holds one package.

use std::path::PathBuf;

use protox::prost::Message;

/// The APIs: (.proto file relative to the crate root, descriptor set name in `OUT_DIR`).
const APIS: &[(&str, &str)] = &[
    ("proto/kvatlas/v1/indexer.proto", "kvatlas_descriptor"),
    ("proto/indexer/v1/indexer.proto", "llmd_indexer_descriptor"),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    for (proto, descriptor) in APIS {
        println!("cargo:rerun-if-changed={proto}");
        let descriptors = protox::compile([proto], ["proto"])?;
        std::fs::write(
            out.join(format!("{descriptor}.bin")),
            descriptors.encode_to_vec(),
        )?;
        tonic_prost_build::configure()
            .codec_path("crate::codec::Codec")
            .build_server(true)
            .build_client(true)
            .compile_fds(descriptors)?;
    }
    Ok(())
}
