//! `wasm-oci`: the filter module as an OCI image layout and archive, with its digests
//! (`make oci`; see the library's documentation for the two variants).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// The archive's file name in the output folder.
const ARCHIVE: &str = "idempotency-filter.oci.tar";
const SCHEMA: &str = "plugin-config.schema.json";
const KONG_META: &str = "idempotency.meta.json";

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
    /// The plugin configuration's JSON Schema (`edge schema`): shipped beside the images (as
    /// it is, and as Kong's `idempotency.meta.json`) and named in DIGESTS. Not in the images:
    /// the oci variant takes exactly two layers, and the compat one a layer of `plugin.wasm`.
    #[arg(long)]
    schema: Option<PathBuf>,
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

/// The schema beside the images, and its DIGESTS line.
fn ship_schema(schema: &std::path::Path, out: &std::path::Path) -> Result<String, String> {
    let text =
        std::fs::read(schema).map_err(|e| format!("cannot read {}: {e}", schema.display()))?;
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| format!("{} is not JSON: {e}", schema.display()))?;
    let write = |name: &str, bytes: &[u8]| {
        let path = out.join(name);
        std::fs::write(&path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    if schema != out.join(SCHEMA) {
        write(SCHEMA, &text)?;
    }
    // Kong reads a filter's schema from `<filter>.meta.json` beside `<filter>.wasm`.
    let meta = serde_json::json!({ "config_schema": value });
    write(KONG_META, meta.to_string().as_bytes())?;
    Ok(format!(
        "schema  {}  {SCHEMA} (the plugin configuration's JSON Schema, draft 4; {KONG_META} holds it for Kong)\n",
        oci::digest_of(&text)
    ))
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
    let mut digests = images.digests_text(ARCHIVE, &archive);
    if let Some(schema) = &args.schema {
        digests.push_str(&ship_schema(schema, &args.out)?);
    }
    let digests_path = args.out.join("DIGESTS");
    std::fs::write(&digests_path, &digests)
        .map_err(|e| format!("cannot write {}: {e}", digests_path.display()))?;
    Ok(digests)
}
