//! `wasm-oci`: the filter module as an OCI image layout and archive, with its digests
//! (`make oci`; see the library's documentation for the two variants).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::Parser;

/// The archive's file name in the output folder.
const ARCHIVE: &str = "idempotency-filter.oci.tar";
const SCHEMA: &str = "plugin-config.schema.json";
const KONG_META: &str = "idempotency.meta.json";
const SBOM: &str = "sbom.cdx.json";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "The filter module as an OCI image (compat and oci variants)"
)]
struct Args {
    /// The module.
    #[arg(long, default_value = "target/wasm32-wasip1/release/filter.wasm")]
    wasm: PathBuf,
    /// Where `layout/` (the OCI image layout, tags `compat` and `oci`), the archive of it,
    /// `sbom.cdx.json` and `DIGESTS` go.
    #[arg(long, default_value = "target/oci")]
    out: PathBuf,
    /// The plugin configuration's JSON Schema (`edge schema`): shipped beside the images (as
    /// it is, and as Kong's `idempotency.meta.json`) and named in DIGESTS. Not in the images:
    /// the oci variant takes exactly two layers, and the compat one a layer of `plugin.wasm`.
    #[arg(long)]
    schema: Option<PathBuf>,
    /// A folder of the workspace whose `cargo metadata` and Cargo.lock make the SBOM
    /// (`sbom.cdx.json`).
    #[arg(long, default_value = ".")]
    workspace: PathBuf,
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
    let sbom_text = format!("{:#}\n", sbom(&images, &args.workspace)?);
    let sbom_path = args.out.join(SBOM);
    std::fs::write(&sbom_path, &sbom_text)
        .map_err(|e| format!("cannot write {}: {e}", sbom_path.display()))?;
    digests.push_str(&format!(
        "sbom    {}  {SBOM} (CycloneDX 1.5: the images, the module, the state API and edge binaries, their crates)\n",
        oci::digest_of(sbom_text.as_bytes())
    ));
    let digests_path = args.out.join("DIGESTS");
    std::fs::write(&digests_path, &digests)
        .map_err(|e| format!("cannot write {}: {e}", digests_path.display()))?;
    Ok(digests)
}

/// The bill of materials of what ships (oci::sbom): each artifact's crates from `cargo tree`
/// of its package for its target, described by `cargo metadata`, checksums from Cargo.lock.
fn sbom(images: &oci::Images, workspace: &Path) -> Result<serde_json::Value, String> {
    use oci::sbom::{self, ImageDigest, Inputs, ARTIFACTS};
    let run = |program: &str, args: &[&str]| -> Result<String, String> {
        let out = Command::new(program)
            .args(args)
            .current_dir(workspace)
            .output()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{program} {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let version_info = run("rustc", &["-vV"])?;
    let host = version_info
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .ok_or("rustc -vV names no host")?
        .to_owned();
    let metadata: serde_json::Value = serde_json::from_str(&run(
        "cargo",
        &["metadata", "--format-version", "1", "--locked"],
    )?)
    .map_err(|e| format!("cargo metadata is not JSON: {e}"))?;
    let mut artifacts = Vec::new();
    for artifact in ARTIFACTS {
        let triple = artifact.target.triple(&host);
        let tree = run(
            "cargo",
            &[
                "tree",
                "--locked",
                "-e",
                "normal,no-proc-macro",
                "--prefix",
                "none",
                "--format",
                "{p}",
                "-p",
                artifact.package,
                "--target",
                &triple,
            ],
        )?;
        let crates =
            sbom::describe(&metadata, &sbom::parse_tree(&tree)).map_err(|e| e.to_string())?;
        artifacts.push((artifact, triple, crates));
    }
    // The lock file of the workspace cargo found (from any folder inside it).
    let root = metadata["workspace_root"]
        .as_str()
        .ok_or("cargo metadata names no workspace_root")?;
    let lock_path = Path::new(root).join("Cargo.lock");
    let lock = std::fs::read_to_string(&lock_path)
        .map_err(|e| format!("cannot read {}: {e}", lock_path.display()))?;
    let checksums = sbom::lock_checksums(&lock)?;
    let tagged = [
        ImageDigest {
            tag: "compat".into(),
            digest: images.compat.manifest.digest(),
        },
        ImageDigest {
            tag: "oci".into(),
            digest: images.oci.manifest.digest(),
        },
    ];
    Ok(sbom::bom(&Inputs {
        version: env!("CARGO_PKG_VERSION"),
        module_digest: &images.module_digest,
        images: &tagged,
        artifacts,
        checksums: &checksums,
    }))
}
