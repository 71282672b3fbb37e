//! `make oci`: the OCI image of the filter that `wasm-oci` wrote (OCI_DIR, default
//! target/oci), checked the way a registry client and a mesh read it, with code of its own
//! (not the builder's): the index names both tags, every manifest, config and layer has the
//! digest and size its descriptor says, the compat layer holds `plugin.wasm`, the oci layer is
//! the module itself, both equal the built filter.wasm; `skopeo` reads the same digests from
//! the layout and the archive; the build is reproducible; and Envoy runs the module taken out
//! of each image through the end-to-end smoke (201, 409, replay, 422).

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use e2e::client::unique_key;
use e2e::process::{workspace_binary, workspace_root};
use e2e::stack::{Stack, StackOptions};
use e2e::testkit::{block_on, client};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::Value;
use sha2::{Digest, Sha256};

const COMPAT_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const WASM_CONFIG: &str = "application/vnd.module.wasm.config.v1+json";
const WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
const ARCHIVE: &str = "idempotency-filter.oci.tar";

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test(
            "index_manifests_configs_and_layers_verify_and_hold_the_module",
            verify_layout,
        ),
        Trial::test("the_archive_holds_the_same_layout", verify_archive),
        Trial::test("a_second_build_gives_the_same_bytes", reproducible),
        Trial::test("skopeo_reads_both_variants_with_the_same_digests", skopeo),
        Trial::test(
            "envoy_runs_the_module_of_each_variant_end_to_end",
            envoy_smoke,
        ),
        Trial::test("the_plugin_schema_ships_beside_the_images", schema_beside),
        Trial::test(
            "the_sbom_names_the_images_and_every_crate_each_artifact_is_built_from",
            sbom_complete,
        ),
        Trial::test(
            "edge_render_for_a_mesh_pins_the_compat_digest",
            render_pins_compat,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn oci_dir() -> PathBuf {
    std::env::var("OCI_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target/oci"))
}

fn layout() -> PathBuf {
    oci_dir().join("layout")
}

fn sha256(bytes: &[u8]) -> String {
    format!(
        "sha256:{}",
        Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

fn read(path: &Path) -> Result<Vec<u8>, Failed> {
    std::fs::read(path)
        .map_err(|e| format!("{}: {e} (run `make oci`, which writes it)", path.display()).into())
}

fn json(bytes: &[u8], what: &str) -> Result<Value, Failed> {
    serde_json::from_slice(bytes).map_err(|e| format!("{what} is not JSON: {e}").into())
}

/// The blob a descriptor names, after checking its digest and size.
fn blob(dir: &Path, descriptor: &Value) -> Result<Vec<u8>, Failed> {
    let digest = descriptor["digest"]
        .as_str()
        .ok_or("a descriptor without a digest")?;
    let hex = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| format!("{digest}: not a sha256 digest"))?;
    let bytes = read(&dir.join("blobs/sha256").join(hex))?;
    if sha256(&bytes) != digest {
        return Err(format!("blob {digest} holds content of digest {}", sha256(&bytes)).into());
    }
    if descriptor["size"].as_u64() != Some(bytes.len() as u64) {
        return Err(format!(
            "{digest}: size {} in its descriptor, {} on disk",
            descriptor["size"],
            bytes.len()
        )
        .into());
    }
    Ok(bytes)
}

/// The manifest tagged `tag` in the layout's index, checked.
fn manifest(dir: &Path, tag: &str) -> Result<(Value, Vec<u8>), Failed> {
    let index = json(&read(&dir.join("index.json"))?, "index.json")?;
    let descriptor = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .ok_or_else(|| format!("index.json has no manifest tagged {tag}"))?;
    assert_eq!(
        descriptor["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    let bytes = blob(dir, descriptor)?;
    Ok((json(&bytes, "a manifest")?, bytes))
}

/// `plugin.wasm` out of a gzipped tar layer.
fn plugin_from_tar_gz(layer: &[u8]) -> Result<Vec<u8>, Failed> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(layer));
    for entry in archive.entries().map_err(|e| e.to_string())? {
        let mut entry = entry.map_err(|e| e.to_string())?;
        let path = entry.path().map_err(|e| e.to_string())?.into_owned();
        if path == Path::new("plugin.wasm") {
            let mut module = Vec::new();
            entry.read_to_end(&mut module).map_err(|e| e.to_string())?;
            return Ok(module);
        }
    }
    Err("the compat layer has no plugin.wasm".into())
}

/// The module of each variant, from the layout at `dir`.
fn modules(dir: &Path) -> Result<BTreeMap<&'static str, Vec<u8>>, Failed> {
    let mut out = BTreeMap::new();

    let (compat, _) = manifest(dir, "compat")?;
    assert_eq!(compat["annotations"]["module.wasm.image/variant"], "compat");
    let config = json(&blob(dir, &compat["config"])?, "the compat config")?;
    let layers = compat["layers"].as_array().ok_or("compat: no layers")?;
    assert_eq!(layers.len(), 1, "compat: one layer");
    assert_eq!(layers[0]["mediaType"], COMPAT_LAYER);
    let layer = blob(dir, &layers[0])?;
    // The config's diff id is the digest of the uncompressed layer.
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(layer.as_slice())
        .read_to_end(&mut tar)
        .map_err(|e| e.to_string())?;
    assert_eq!(config["rootfs"]["diff_ids"][0], sha256(&tar));
    out.insert("compat", plugin_from_tar_gz(&layer)?);

    let (oci, _) = manifest(dir, "oci")?;
    assert_eq!(oci["config"]["mediaType"], WASM_CONFIG);
    let runtime = json(&blob(dir, &oci["config"])?, "the runtime config")?;
    assert_eq!(runtime["type"], "envoy_proxy");
    let layers = oci["layers"].as_array().ok_or("oci: no layers")?;
    // Istio and Envoy Gateway take the oci variant with exactly two layers.
    assert_eq!(layers.len(), 2, "oci: two layers");
    let wasm = layers
        .iter()
        .find(|l| l["mediaType"] == WASM_LAYER)
        .ok_or("oci: no wasm layer")?;
    for layer in layers {
        blob(dir, layer)?;
    }
    out.insert("oci", blob(dir, wasm)?);
    Ok(out)
}

fn built_module() -> Result<Vec<u8>, Failed> {
    let path = edge::envoy::filter_wasm().map_err(Failed::from)?;
    read(&path)
}

/// The `module` line of DIGESTS.
fn published(name: &str) -> Result<String, Failed> {
    let text = String::from_utf8_lossy(&read(&oci_dir().join("DIGESTS"))?).into_owned();
    text.lines()
        .find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some(name))
                .then(|| words.next().map(str::to_owned))
                .flatten()
        })
        .ok_or_else(|| format!("DIGESTS has no `{name}` line:\n{text}").into())
}

/// `plugin-config.schema.json` is what the filter's types generate (`edge schema`), Kong's
/// `idempotency.meta.json` holds it, DIGESTS names it.
fn schema_beside() -> Result<(), Failed> {
    let shipped = read(&oci_dir().join("plugin-config.schema.json"))?;
    let generated = Command::new(workspace_binary("edge").map_err(Failed::from)?)
        .arg("schema")
        .output()
        .map_err(|e| format!("edge schema: {e} (make build)"))?;
    assert_eq!(
        String::from_utf8_lossy(&shipped).trim_end(),
        String::from_utf8_lossy(&generated.stdout).trim_end()
    );
    let meta = json(&read(&oci_dir().join("idempotency.meta.json"))?, "meta")?;
    assert_eq!(meta["config_schema"], json(&shipped, "schema")?);
    assert_eq!(published("schema")?, sha256(&shipped));
    Ok(())
}

/// What `edge render --target istio|envoy-gateway` pins is the compat manifest's digest of
/// DIGESTS, for the module built here.
fn render_pins_compat() -> Result<(), Failed> {
    let compat = published("compat")?;
    let hex = compat.trim_start_matches("sha256:");
    for target in ["istio", "envoy-gateway"] {
        let out = Command::new(workspace_binary("edge").map_err(Failed::from)?)
            .args(["render", "--target", target, "--config"])
            .arg(workspace_root().join("examples/demo.toml"))
            .arg("--wasm")
            .arg(edge::envoy::filter_wasm().map_err(Failed::from)?)
            .output()
            .map_err(|e| format!("edge render: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !text.contains(&format!("sha256: {hex}")) {
            return Err(format!(
                "{target}: no `sha256: {hex}` in\n{text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
    }
    Ok(())
}

fn verify_layout() -> Result<(), Failed> {
    let dir = layout();
    let layout_file = json(&read(&dir.join("oci-layout"))?, "oci-layout")?;
    assert_eq!(layout_file["imageLayoutVersion"], "1.0.0");
    let built = built_module()?;
    for (variant, module) in modules(&dir)? {
        if module != built {
            return Err(format!("the {variant} image's module differs from filter.wasm").into());
        }
    }
    assert_eq!(published("module")?, sha256(&built));
    assert_eq!(published("compat")?, sha256(&manifest(&dir, "compat")?.1));
    assert_eq!(published("oci")?, sha256(&manifest(&dir, "oci")?.1));
    Ok(())
}

fn verify_archive() -> Result<(), Failed> {
    let archive = read(&oci_dir().join(ARCHIVE))?;
    assert_eq!(published("archive")?, sha256(&archive));
    let unpacked = tempdir("oci-archive")?;
    tar::Archive::new(archive.as_slice())
        .unpack(&unpacked)
        .map_err(|e| e.to_string())?;
    let result = (|| {
        assert_eq!(files(&unpacked)?, files(&layout())?);
        modules(&unpacked).map(drop)
    })();
    let _ = std::fs::remove_dir_all(&unpacked);
    result
}

/// Every file under `dir` by relative path, with its content.
fn files(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>, Failed> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(dir).map_err(|e| e.to_string())?;
                out.insert(rel.display().to_string(), read(&path)?);
            }
        }
    }
    Ok(out)
}

/// Issue 49: `sbom.cdx.json` (CycloneDX) names both images by the digests DIGESTS gives, the
/// module by its digest, and for each shipped artifact exactly the crates its release build
/// compiles for its target (cargo's unit graph: what is linked into it, not the procedural
/// macros and build scripts the compiler runs), each with its
/// package URL, licence and, for crates.io's, the lock file's checksum.
fn sbom_complete() -> Result<(), Failed> {
    let text = read(&oci_dir().join("sbom.cdx.json"))?;
    assert_eq!(published("sbom")?, sha256(&text), "DIGESTS names the SBOM");
    let bom = json(&text, "sbom.cdx.json")?;
    assert_eq!(bom["bomFormat"], "CycloneDX");
    assert_eq!(bom["specVersion"], "1.5");
    let components = bom["components"].as_array().cloned().unwrap_or_default();
    let property = |c: &Value, name: &str| -> Option<String> {
        c["properties"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["value"].as_str().map(str::to_owned))
    };
    for tag in ["compat", "oci"] {
        let digest = published(tag)?;
        let image = components
            .iter()
            .find(|c| c["type"] == "container" && c["version"] == tag)
            .ok_or_else(|| format!("no image `{tag}` in the SBOM"))?;
        assert_eq!(property(image, "oci:manifest-digest"), Some(digest.clone()));
        assert_eq!(
            image["hashes"][0]["content"].as_str(),
            Some(digest.trim_start_matches("sha256:"))
        );
    }
    let depends: BTreeMap<String, Vec<String>> = bom["dependencies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| {
            let on = d["dependsOn"].as_array()?.iter();
            Some((
                d["ref"].as_str()?.to_owned(),
                on.filter_map(|v| v.as_str().map(str::to_owned)).collect(),
            ))
        })
        .collect();
    let artifacts: Vec<&Value> = components
        .iter()
        .filter(|c| property(c, "cargo:package").is_some())
        .collect();
    let names: Vec<&str> = artifacts
        .iter()
        .filter_map(|a| a["name"].as_str())
        .collect();
    assert_eq!(names, ["filter.wasm", "state-api", "edge"]);
    let module = artifacts[0]["hashes"][0]["content"].as_str().unwrap_or("");
    assert_eq!(published("module")?, format!("sha256:{module}"));
    for artifact in artifacts {
        let (package, target) = (
            property(artifact, "cargo:package").unwrap_or_default(),
            property(artifact, "cargo:target").unwrap_or_default(),
        );
        let built = built_crates(&package, &target)?;
        let listed: std::collections::BTreeSet<String> = depends
            .get(artifact["bom-ref"].as_str().unwrap_or(""))
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .collect();
        assert!(
            built.len() > 10,
            "{package}: the unit graph built {built:?}"
        );
        let missing: Vec<&String> = built.difference(&listed).collect();
        let extra: Vec<&String> = listed.difference(&built).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{package} ({target}): the SBOM lacks {missing:?} and lists {extra:?}, which its build does not link"
        );
    }
    for c in components.iter().filter(|c| c["type"] == "library") {
        let workspace = property(c, "cargo:workspace-member").is_some();
        assert!(
            c["licenses"][0]["expression"].is_string(),
            "no licence for {}",
            c["purl"]
        );
        assert!(
            workspace
                || c["hashes"][0]["content"]
                    .as_str()
                    .is_some_and(|h| h.len() == 64),
            "no checksum for {}",
            c["purl"]
        );
    }
    Ok(())
}

/// The crates a release build of `package` for `target` compiles for that target (not for the
/// machine: procedural macros, build scripts), as `pkg:cargo/name@version`: cargo's unit graph
/// (`-Z unstable-options --unit-graph` on the stable toolchain with RUSTC_BOOTSTRAP=1; nothing
/// is built).
fn built_crates(package: &str, target: &str) -> Result<std::collections::BTreeSet<String>, Failed> {
    let out = Command::new("cargo")
        .args([
            "build",
            "--locked",
            "--release",
            "-p",
            package,
            "--target",
            target,
        ])
        .args(["-Z", "unstable-options", "--unit-graph"])
        .env("RUSTC_BOOTSTRAP", "1")
        .current_dir(workspace_root())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned().into());
    }
    let graph = json(&out.stdout, "cargo's unit graph")?;
    let mut crates = std::collections::BTreeSet::new();
    for unit in graph["units"].as_array().into_iter().flatten() {
        let kinds = unit["target"]["kind"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if unit["platform"] != target
            || unit["mode"] != "build"
            || kinds.iter().any(|k| k == "custom-build")
        {
            continue;
        }
        // `registry+URL#name@version`, or `path+file:///…/name#version` for a workspace crate
        // whose folder is its name (`#name@version` otherwise).
        let id = unit["pkg_id"].as_str().unwrap_or("");
        let (source, spec) = id.rsplit_once('#').unwrap_or((id, ""));
        let (name, version) = match spec.split_once('@') {
            Some((n, v)) => (n.to_owned(), v.to_owned()),
            None => (
                source.rsplit('/').next().unwrap_or("").to_owned(),
                spec.to_owned(),
            ),
        };
        crates.insert(format!("pkg:cargo/{name}@{version}"));
    }
    Ok(crates)
}

fn tempdir(label: &str) -> Result<PathBuf, Failed> {
    let dir = std::env::temp_dir().join(format!("{}-{}", unique_key(label), std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    Ok(dir)
}

fn reproducible() -> Result<(), Failed> {
    let again = tempdir("oci-again")?;
    let bin = workspace_binary("wasm-oci").map_err(Failed::from)?;
    let module = edge::envoy::filter_wasm().map_err(Failed::from)?;
    let out = Command::new(&bin)
        .arg("--wasm")
        .arg(&module)
        .arg("--schema")
        .arg(oci_dir().join("plugin-config.schema.json"))
        .arg("--out")
        .arg(&again)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let result = if !out.status.success() {
        Err(String::from_utf8_lossy(&out.stderr).into_owned().into())
    } else {
        let (first, second) = (files(&oci_dir())?, files(&again)?);
        if first == second {
            Ok(())
        } else {
            let differ: Vec<&String> = first
                .keys()
                .chain(second.keys())
                .filter(|k| first.get(*k) != second.get(*k))
                .collect();
            Err(format!("a second build differs in {differ:?}").into())
        }
    };
    let _ = std::fs::remove_dir_all(&again);
    result
}

fn skopeo_command(args: &[&str]) -> Result<Vec<u8>, Failed> {
    let out = Command::new("skopeo").args(args).output().map_err(|e| {
        format!("cannot run skopeo: {e} (apt-get install skopeo; `make oci` installs it as root)")
    })?;
    if !out.status.success() {
        return Err(format!(
            "skopeo {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(out.stdout)
}

fn skopeo() -> Result<(), Failed> {
    let dir = layout();
    let at = |tag: &str| format!("oci:{}:{tag}", dir.display());
    let archive = format!("oci-archive:{}:compat", oci_dir().join(ARCHIVE).display());
    let (_, compat) = manifest(&dir, "compat")?;
    let (oci, oci_bytes) = manifest(&dir, "oci")?;
    for source in [at("compat"), archive] {
        let inspected = json(&skopeo_command(&["inspect", &source])?, "skopeo inspect")?;
        assert_eq!(inspected["Digest"], sha256(&compat), "{source}");
        assert_eq!(inspected["Architecture"], "wasm", "{source}");
    }
    // The oci variant's config is not an image config: skopeo reads it raw.
    assert_eq!(
        skopeo_command(&["inspect", "--raw", &at("oci")])?,
        oci_bytes
    );
    let config = skopeo_command(&["inspect", "--config", "--raw", &at("oci")])?;
    assert_eq!(
        sha256(&config),
        oci["config"]["digest"].as_str().unwrap_or_default()
    );
    Ok(())
}

fn envoy_smoke() -> Result<(), Failed> {
    let dir = tempdir("oci-modules")?;
    let result = (|| {
        for (variant, module) in modules(&layout())? {
            let path = dir.join(format!("{variant}.wasm"));
            std::fs::write(&path, module).map_err(|e| e.to_string())?;
            // The stack's Envoy loads FILTER_WASM: the module taken out of this image.
            std::env::set_var("FILTER_WASM", &path);
            let stack = Stack::start(StackOptions::default()).map_err(Failed::from)?;
            block_on(smoke(stack))?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn smoke(stack: Stack) {
    e2e::testkit::smoke(&client(&stack), "oci").await;
}
