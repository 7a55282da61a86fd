//! Generates the message types, server and client of `wasmplane.model.v1` from the proto.

fn main() -> std::io::Result<()> {
    tonic_prost_build::configure()
        // Deterministic label order: equal services encode to equal bytes.
        .btree_map(".")
        .compile_protos(&["proto/wasmplane/model/v1/model.proto"], &["proto"])
}
