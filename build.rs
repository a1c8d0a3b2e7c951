fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc, so a fresh machine needs nothing but cargo.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("epserve_descriptor.bin"))
        .compile_protos(&["proto/epserve.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/epserve.proto");
    Ok(())
}
