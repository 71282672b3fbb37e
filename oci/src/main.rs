//! `wasm-oci`: the filter module as an OCI image layout and archive, with its digests
//! (`make oci`; see the library's documentation for the two variants).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// The archive's file name in the output folder.
const ARCHIVE: &str = "idempotency-filter.oci.tar";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "The filter module as an OCI image (compat and oci variants)"
)]
struct Args {
    /// The module.
    #[arg(long, default_value = "target/wasm32-wasip1/release/filter.wasm")]
    wasm: PathBuf,
    /// Where `layout/` (the OCI image layout, tags `compat` and `oci`), the archive of it
    /// and `DIGESTS` go.
    #[arg(long, default_value = "target/oci")]
    out: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match write(&args) {
        Ok(digests) => {
            print!("{digests}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("wasm-oci: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write(args: &Args) -> Result<String, String> {
    let module = std::fs::read(&args.wasm).map_err(|e| {
        format!(
            "cannot read {}: {e} (make build-filter builds it)",
            args.wasm.display()
        )
    })?;
    let images = oci::build(&module, env!("CARGO_PKG_VERSION")).map_err(|e| e.to_string())?;
    images
        .write_layout(&args.out.join("layout"))
        .map_err(|e| e.to_string())?;
    let archive = images.archive().map_err(|e| e.to_string())?;
    let archive_path = args.out.join(ARCHIVE);
    std::fs::write(&archive_path, &archive)
        .map_err(|e| format!("cannot write {}: {e}", archive_path.display()))?;
    let digests = images.digests_text(ARCHIVE, &archive);
    let digests_path = args.out.join("DIGESTS");
    std::fs::write(&digests_path, &digests)
        .map_err(|e| format!("cannot write {}: {e}", digests_path.display()))?;
    Ok(digests)
}
