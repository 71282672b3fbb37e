//! The software bill of materials of what ships (CycloneDX 1.5, JSON), written by `make oci`
//! beside the images as `sbom.cdx.json`: the filter module and the two images that carry it
//! (their digests), and the state API and edge binaries the Docker image carries, each with the
//! crates it is built from (name, version, package URL, licence, and the registry's SHA-256
//! from Cargo.lock).
//!
//! An artifact's crates are what `cargo tree -p <package> --target <target> -e
//! normal,no-proc-macro` lists: its package's own feature resolution (as `cargo build -p` makes
//! it), normal dependencies only, procedural macros left out (build and dev dependencies and
//! macros run in the compiler and never end in it; cargo-auditable records a binary's crates the
//! same way). `cargo metadata` says each one's licence and source. `make oci`'s test checks the
//! list against cargo's unit graph of the artifact's build, both ways. Nothing depends on the time or the machine:
//! the serial number is derived from the content, no timestamp is written.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// A shipped artifact: its file name, the workspace package it is built from, and for which
/// target (`host` for the machine's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Artifact {
    pub name: &'static str,
    pub package: &'static str,
    pub target: Target,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The filter module.
    Wasm,
    /// The binaries of the Docker image, built for the machine that builds it.
    Host,
}

impl Target {
    pub fn triple(self, host: &str) -> String {
        match self {
            Self::Wasm => "wasm32-wasip1".to_owned(),
            Self::Host => host.to_owned(),
        }
    }
}

/// What ships: the module in the OCI images, the binaries in the Docker image (Dockerfile's
/// `edge` and `state-api` targets). The demo checkout and idemctl are not shipped.
pub const ARTIFACTS: [Artifact; 3] = [
    Artifact {
        name: "filter.wasm",
        package: "filter",
        target: Target::Wasm,
    },
    Artifact {
        name: "state-api",
        package: "state-api",
        target: Target::Host,
    },
    Artifact {
        name: "edge",
        package: "edge",
        target: Target::Host,
    },
];

/// The images `make oci` writes, by tag, and their manifest digests.
#[derive(Debug, Clone)]
pub struct ImageDigest {
    pub tag: String,
    pub digest: String,
}

/// Why a bill of materials cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SbomError {
    #[error("cargo metadata has no package {0}")]
    NoPackage(String),
    #[error("cargo metadata is not as expected: {0}")]
    Metadata(String),
}

/// One crate of the lock file, as the bill names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Crate {
    pub name: String,
    pub version: String,
    /// Whether it comes from a registry (crates.io): false for the workspace's own crates.
    pub registry: bool,
    pub license: Option<String>,
}

impl Crate {
    pub fn purl(&self) -> String {
        format!("pkg:cargo/{}@{}", self.name, self.version)
    }
}

/// The (name, version) pairs of `cargo tree --prefix none --format {p}` output: a line is
/// `name vX.Y.Z`, then ` (path)` for a workspace crate or ` (*)` for one listed before.
pub fn parse_tree(text: &str) -> BTreeSet<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next()?;
            let version = words.next()?.strip_prefix('v')?;
            Some((name.to_owned(), version.to_owned()))
        })
        .collect()
}

/// The crates named by `listed`, as `cargo metadata` (of the whole workspace) describes them:
/// licence, and whether crates.io's or the workspace's own.
pub fn describe(
    metadata: &Value,
    listed: &BTreeSet<(String, String)>,
) -> Result<BTreeSet<Crate>, SbomError> {
    let packages = metadata["packages"]
        .as_array()
        .ok_or_else(|| SbomError::Metadata("no `packages`".into()))?;
    let members: BTreeSet<&str> = metadata["workspace_members"]
        .as_array()
        .map(|m| m.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    listed
        .iter()
        .map(|(name, version)| {
            let p = packages
                .iter()
                .find(|p| p["name"] == name.as_str() && p["version"] == version.as_str())
                .ok_or_else(|| SbomError::NoPackage(format!("{name} {version}")))?;
            let member = p["id"].as_str().is_some_and(|id| members.contains(id));
            Ok(Crate {
                name: name.clone(),
                version: version.clone(),
                registry: !member && !p["source"].is_null(),
                license: p["license"].as_str().map(spdx_expression),
            })
        })
        .collect()
}

/// Old manifests write `MIT/Apache-2.0`; SPDX says `MIT OR Apache-2.0`.
fn spdx_expression(license: &str) -> String {
    license
        .split('/')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" OR ")
}

/// The registry's SHA-256 of each (name, version) in Cargo.lock.
pub fn lock_checksums(lock: &str) -> Result<BTreeMap<(String, String), String>, String> {
    #[derive(serde::Deserialize)]
    struct Lock {
        #[serde(default)]
        package: Vec<Locked>,
    }
    #[derive(serde::Deserialize)]
    struct Locked {
        name: String,
        version: String,
        checksum: Option<String>,
    }
    let lock: Lock = toml::from_str(lock).map_err(|e| format!("Cargo.lock: {e}"))?;
    Ok(lock
        .package
        .into_iter()
        .filter_map(|p| Some(((p.name, p.version), p.checksum?)))
        .collect())
}

/// What the bill is made of.
pub struct Inputs<'a> {
    /// The workspace's version (the metadata component's).
    pub version: &'a str,
    pub module_digest: &'a str,
    pub images: &'a [ImageDigest],
    /// Each artifact and its crates.
    pub artifacts: Vec<(Artifact, String, BTreeSet<Crate>)>,
    pub checksums: &'a BTreeMap<(String, String), String>,
}

const IMAGE_NAME: &str = "idempotency-filter";

fn artifact_ref(a: &Artifact) -> String {
    format!("artifact:{}", a.name)
}

/// The bill as CycloneDX 1.5 JSON.
pub fn bom(inputs: &Inputs<'_>) -> Value {
    let sha = |digest: &str| json!([{ "alg": "SHA-256", "content": digest.trim_start_matches("sha256:") }]);
    let mut components = Vec::new();
    let mut dependencies = Vec::new();
    let module = ARTIFACTS[0];
    for image in inputs.images {
        let r = format!("oci:{IMAGE_NAME}:{}", image.tag);
        components.push(json!({
            "type": "container",
            "bom-ref": r,
            "name": IMAGE_NAME,
            "version": image.tag,
            "description": format!("the filter module as an OCI image, variant `{}` (make oci)", image.tag),
            "hashes": sha(&image.digest),
            "properties": [{ "name": "oci:manifest-digest", "value": image.digest }],
        }));
        dependencies.push(json!({ "ref": r, "dependsOn": [artifact_ref(&module)] }));
    }
    let mut crates: BTreeSet<&Crate> = BTreeSet::new();
    for (artifact, triple, used) in &inputs.artifacts {
        let mut c = json!({
            "type": "application",
            "bom-ref": artifact_ref(artifact),
            "name": artifact.name,
            "version": inputs.version,
            "properties": [
                { "name": "cargo:package", "value": artifact.package },
                { "name": "cargo:target", "value": triple },
            ],
        });
        if *artifact == module {
            c["hashes"] = sha(inputs.module_digest);
        }
        components.push(c);
        let refs: Vec<String> = used.iter().map(Crate::purl).collect();
        dependencies.push(json!({ "ref": artifact_ref(artifact), "dependsOn": refs }));
        crates.extend(used);
    }
    for c in crates {
        let mut component = json!({
            "type": "library",
            "bom-ref": c.purl(),
            "name": c.name,
            "version": c.version,
            "purl": c.purl(),
            "scope": "required",
        });
        if let Some(license) = &c.license {
            component["licenses"] = json!([{ "expression": license }]);
        }
        if let Some(sum) = inputs.checksums.get(&(c.name.clone(), c.version.clone())) {
            component["hashes"] = json!([{ "alg": "SHA-256", "content": sum }]);
        }
        if !c.registry {
            component["properties"] =
                json!([{ "name": "cargo:workspace-member", "value": "true" }]);
        }
        components.push(component);
    }
    let mut bom = json!({
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": {
            "component": {
                "type": "application",
                "bom-ref": "edge-idempotency",
                "name": "edge-idempotency",
                "version": inputs.version,
                "description": "an idempotency layer at the edge: a proxy-wasm filter in Envoy and its state API",
            },
            "tools": { "components": [{ "type": "application", "name": "wasm-oci", "version": inputs.version }] },
        },
        "components": components,
        "dependencies": dependencies,
    });
    // The serial number names this content: the same inputs give the same bytes.
    let digest = Sha256::digest(bom.to_string().as_bytes());
    bom["serialNumber"] = json!(format!("urn:uuid:{}", uuid_of(&digest)));
    bom
}

/// A version-8 (custom) UUID from the first 16 bytes of `digest`.
fn uuid_of(digest: &[u8]) -> String {
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn metadata() -> Value {
        let pkg = |id: &str, name: &str, source: Option<&str>, license: Option<&str>| json!({ "id": id, "name": name, "version": "1.0.0", "source": source, "license": license });
        let reg = Some("registry+https://github.com/rust-lang/crates.io-index");
        json!({
            "packages": [
                pkg("app-id", "app", None, Some("Apache-2.0")),
                pkg("a-id", "a", reg, Some("MIT/Apache-2.0")),
                pkg("b-id", "b", reg, None),
            ],
            "workspace_members": ["app-id"],
        })
    }

    fn listed(names: &[&str]) -> BTreeSet<(String, String)> {
        names
            .iter()
            .map(|n| ((*n).to_owned(), "1.0.0".to_owned()))
            .collect()
    }

    #[test]
    fn cargo_tree_lines_give_names_and_versions() {
        let tree = "app v1.0.0 (/src/app)\na v1.0.0\nb v1.0.0\na v1.0.0 (*)\n\n";
        assert_eq!(parse_tree(tree), listed(&["app", "a", "b"]));
    }

    #[test]
    fn each_listed_crate_is_described_by_the_metadata() {
        let crates = describe(&metadata(), &listed(&["app", "a", "b"])).unwrap();
        let a = crates.iter().find(|c| c.name == "a").unwrap();
        assert_eq!(a.license.as_deref(), Some("MIT OR Apache-2.0"));
        assert!(a.registry);
        assert!(!crates.iter().find(|c| c.name == "app").unwrap().registry);
        assert_eq!(
            describe(&metadata(), &listed(&["z"])),
            Err(SbomError::NoPackage("z 1.0.0".into())),
            "a crate the metadata does not know is an error, not a gap"
        );
    }

    #[test]
    fn the_bill_names_images_artifacts_and_crates_and_is_the_same_for_the_same_inputs() {
        let used = describe(&metadata(), &listed(&["app", "a", "b"])).unwrap();
        let checksums = BTreeMap::from([(("a".to_owned(), "1.0.0".to_owned()), "ab".repeat(32))]);
        let images = [ImageDigest {
            tag: "compat".into(),
            digest: format!("sha256:{}", "cd".repeat(32)),
        }];
        let inputs = Inputs {
            version: "0.1.0",
            module_digest: "sha256:00",
            images: &images,
            artifacts: vec![(ARTIFACTS[0], "wasm32-wasip1".into(), used)],
            checksums: &checksums,
        };
        let bom = bom(&inputs);
        assert_eq!(bom, super::bom(&inputs), "reproducible");
        let components = bom["components"].as_array().unwrap();
        let image = &components[0];
        assert_eq!(image["type"], "container");
        assert_eq!(image["hashes"][0]["content"], "cd".repeat(32));
        let a = components.iter().find(|c| c["name"] == "a").unwrap();
        assert_eq!(a["purl"], "pkg:cargo/a@1.0.0");
        assert_eq!(a["hashes"][0]["content"], "ab".repeat(32));
        let deps = bom["dependencies"].as_array().unwrap();
        assert_eq!(deps[0]["dependsOn"], json!(["artifact:filter.wasm"]));
        assert_eq!(
            deps[1]["dependsOn"],
            json!([
                "pkg:cargo/a@1.0.0",
                "pkg:cargo/app@1.0.0",
                "pkg:cargo/b@1.0.0"
            ])
        );
        let serial = bom["serialNumber"].as_str().unwrap();
        assert!(
            serial.starts_with("urn:uuid:") && serial.len() == 45,
            "{serial}"
        );
    }

    #[test]
    fn lock_checksums_are_read_for_registry_crates_only() {
        let lock = "version = 4\n\n[[package]]\nname = \"app\"\nversion = \"1.0.0\"\n\n[[package]]\nname = \"a\"\nversion = \"1.0.0\"\nsource = \"registry+https://github.com/rust-lang/crates.io-index\"\nchecksum = \"ff\"\n";
        let sums = lock_checksums(lock).unwrap();
        assert_eq!(sums.len(), 1);
        assert_eq!(sums[&("a".to_owned(), "1.0.0".to_owned())], "ff");
    }
}
