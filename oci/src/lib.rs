//! The filter module as an OCI image, in the two layouts Istio's `WasmPlugin` and Envoy
//! Gateway's `EnvoyExtensionPolicy` pull (the "Wasm Image Specification", compat and oci
//! variants), reproducibly: the same module gives the same bytes and so the same digests.
//!
//! - *compat*: an ordinary OCI image, config `application/vnd.oci.image.config.v1+json`, one
//!   `application/vnd.oci.image.layer.v1.tar+gzip` layer holding `plugin.wasm`, and the
//!   manifest annotation `module.wasm.image/variant=compat`. Any registry takes it.
//! - *oci*: config `application/vnd.module.wasm.config.v1+json` (the runtime config: Envoy,
//!   the proxy-wasm ABI, the root id) and the raw module as an
//!   `application/vnd.module.wasm.content.layer.v1+wasm` layer. Istio and Envoy Gateway take
//!   this variant only with exactly two layers, so the runtime config is also the first layer
//!   (as the specification's example lists it).
//!
//! Both go into one OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/`), tagged
//! `compat` and `oci` (`org.opencontainers.image.ref.name`), and into a tar archive of that
//! layout (`oci-archive:` for skopeo). Nothing depends on the time or the machine: fixed
//! tar headers (mode, owner 0, mtime 0), gzip without a time or name, entries sorted, JSON
//! with sorted keys.

use std::path::Path;

use sha2::{Digest, Sha256};

pub mod sbom;

pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const IMAGE_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const TAR_GZIP_LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.module.wasm.config.v1+json";
pub const WASM_LAYER_MEDIA_TYPE: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
pub const VARIANT_ANNOTATION: &str = "module.wasm.image/variant";
pub const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";
pub const TITLE_ANNOTATION: &str = "org.opencontainers.image.title";
/// The file the compat layer holds (the name Istio and Envoy Gateway look for).
pub const PLUGIN_FILE: &str = "plugin.wasm";
/// The proxy-wasm ABI the module exports (proxy-wasm 0.2's `proxy_abi_version_0_2_1`).
pub const ABI_VERSION: &str = "proxy_abi_version_0_2_1";
/// The root id `edge render` gives the filter.
pub const ROOT_ID: &str = "idempotency";

#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0} is not a WebAssembly module (no \\0asm header)")]
    NotWasm(String),
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> OciError + '_ {
    move |source| OciError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// `sha256:<hex>` of `bytes`.
pub fn digest_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A content-addressed blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub media_type: &'static str,
    pub bytes: Vec<u8>,
}

impl Blob {
    fn new(media_type: &'static str, bytes: Vec<u8>) -> Self {
        Self { media_type, bytes }
    }

    pub fn digest(&self) -> String {
        digest_of(&self.bytes)
    }

    /// Its OCI descriptor, with `annotations` when there are any.
    fn descriptor(&self, annotations: &[(&str, &str)]) -> serde_json::Value {
        let mut d = serde_json::json!({
            "mediaType": self.media_type,
            "digest": self.digest(),
            "size": self.bytes.len(),
        });
        if !annotations.is_empty() {
            d["annotations"] = annotations_object(annotations);
        }
        d
    }
}

fn annotations_object(pairs: &[(&str, &str)]) -> serde_json::Value {
    serde_json::Value::Object(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
            .collect(),
    )
}

/// JSON bytes as they go into a blob: compact, keys sorted (serde_json's map is ordered).
fn json_bytes(value: &serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// One variant: its manifest and the blobs it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// `compat` or `oci`: the tag in the layout.
    pub tag: &'static str,
    pub manifest: Blob,
    /// The config and the layers (a blob listed twice is kept once).
    pub blobs: Vec<Blob>,
}

/// Both variants of one module, and its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Images {
    /// `sha256:<hex>` of the module itself.
    pub module_digest: String,
    pub compat: Image,
    pub oci: Image,
    /// `index.json` of the layout.
    pub index: Vec<u8>,
}

/// Builds both variants of `module`; `version` goes into the manifests' annotations.
pub fn build(module: &[u8], version: &str) -> Result<Images, OciError> {
    if !module.starts_with(b"\0asm") {
        return Err(OciError::NotWasm(PLUGIN_FILE.to_owned()));
    }
    let compat = compat_image(module, version)?;
    let oci = oci_image(module, version);
    let manifests: Vec<serde_json::Value> = [&compat, &oci]
        .iter()
        .map(|image| {
            image
                .manifest
                .descriptor(&[(REF_NAME_ANNOTATION, image.tag)])
        })
        .collect();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": manifests,
    });
    Ok(Images {
        module_digest: digest_of(module),
        compat,
        oci,
        index: json_bytes(&index),
    })
}

fn manifest(
    config: &Blob,
    layers: &[(&Blob, &[(&str, &str)])],
    annotations: &[(&str, &str)],
) -> Blob {
    let layers: Vec<serde_json::Value> =
        layers.iter().map(|(blob, a)| blob.descriptor(a)).collect();
    let value = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": config.descriptor(&[]),
        "layers": layers,
        "annotations": annotations_object(annotations),
    });
    Blob::new(MANIFEST_MEDIA_TYPE, json_bytes(&value))
}

/// One `plugin.wasm` in a gzipped tar, and an image config naming its uncompressed digest.
fn compat_image(module: &[u8], version: &str) -> Result<Image, OciError> {
    let tar = single_file_tar(PLUGIN_FILE, module)?;
    let layer = Blob::new(TAR_GZIP_LAYER_MEDIA_TYPE, gzip(&tar)?);
    let config = Blob::new(
        IMAGE_CONFIG_MEDIA_TYPE,
        json_bytes(&serde_json::json!({
            "architecture": "wasm",
            "os": "wasip1",
            "config": {},
            "rootfs": { "type": "layers", "diff_ids": [digest_of(&tar)] },
        })),
    );
    let manifest = manifest(
        &config,
        &[(&layer, &[])],
        &[
            (VARIANT_ANNOTATION, "compat"),
            (TITLE_ANNOTATION, PLUGIN_FILE),
            ("org.opencontainers.image.version", version),
        ],
    );
    Ok(Image {
        tag: "compat",
        manifest,
        blobs: vec![config, layer],
    })
}

/// The runtime config and the raw module.
fn oci_image(module: &[u8], version: &str) -> Image {
    let config = Blob::new(
        WASM_CONFIG_MEDIA_TYPE,
        json_bytes(&serde_json::json!({
            "type": "envoy_proxy",
            "abiVersions": [ABI_VERSION],
            "config": { "rootIds": [ROOT_ID] },
        })),
    );
    let layer = Blob::new(WASM_LAYER_MEDIA_TYPE, module.to_vec());
    let manifest = manifest(
        &config,
        &[
            (&config, &[(TITLE_ANNOTATION, "runtime-config.json")]),
            (&layer, &[(TITLE_ANNOTATION, PLUGIN_FILE)]),
        ],
        &[
            (VARIANT_ANNOTATION, "oci"),
            ("org.opencontainers.image.version", version),
        ],
    );
    Image {
        tag: "oci",
        manifest,
        blobs: vec![config, layer],
    }
}

/// A tar header that says nothing of the machine or the time.
fn fixed_header(path: &str, size: u64, directory: bool) -> Result<tar::Header, OciError> {
    let mut h = tar::Header::new_ustar();
    h.set_path(path).map_err(|source| OciError::Io {
        path: path.to_owned(),
        source,
    })?;
    h.set_size(size);
    h.set_mode(if directory { 0o755 } else { 0o644 });
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_entry_type(if directory {
        tar::EntryType::Directory
    } else {
        tar::EntryType::Regular
    });
    h.set_cksum();
    Ok(h)
}

fn single_file_tar(name: &str, content: &[u8]) -> Result<Vec<u8>, OciError> {
    tar_of(&[Entry::File(name.to_owned(), content)])
}

enum Entry<'a> {
    Directory(String),
    File(String, &'a [u8]),
}

fn tar_of(entries: &[Entry<'_>]) -> Result<Vec<u8>, OciError> {
    let to_err = |source| OciError::Io {
        path: "tar".into(),
        source,
    };
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        match entry {
            Entry::Directory(path) => builder
                .append(&fixed_header(path, 0, true)?, std::io::empty())
                .map_err(to_err)?,
            Entry::File(path, content) => builder
                .append(&fixed_header(path, content.len() as u64, false)?, *content)
                .map_err(to_err)?,
        }
    }
    builder.into_inner().map_err(to_err)
}

/// gzip without a time or file name, at the best compression (flate2's pinned version makes
/// the same bytes for the same input).
fn gzip(data: &[u8]) -> Result<Vec<u8>, OciError> {
    use std::io::Write as _;
    let to_err = |source| OciError::Io {
        path: "gzip".into(),
        source,
    };
    let mut encoder = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), flate2::Compression::best());
    encoder.write_all(data).map_err(to_err)?;
    encoder.finish().map_err(to_err)
}

impl Images {
    /// Every file of the layout, path and content, sorted by path.
    pub fn layout_files(&self) -> Vec<(String, Vec<u8>)> {
        let mut files = std::collections::BTreeMap::new();
        files.insert(
            "oci-layout".to_owned(),
            json_bytes(&serde_json::json!({ "imageLayoutVersion": "1.0.0" })),
        );
        files.insert("index.json".to_owned(), self.index.clone());
        for image in [&self.compat, &self.oci] {
            for blob in std::iter::once(&image.manifest).chain(&image.blobs) {
                let hex = blob.digest().trim_start_matches("sha256:").to_owned();
                files.insert(format!("blobs/sha256/{hex}"), blob.bytes.clone());
            }
        }
        files.into_iter().collect()
    }

    /// Writes the OCI image layout into `dir` (emptied first).
    pub fn write_layout(&self, dir: &Path) -> Result<(), OciError> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(io_at(dir))?;
        }
        for (path, bytes) in self.layout_files() {
            let file = dir.join(&path);
            if let Some(parent) = file.parent() {
                std::fs::create_dir_all(parent).map_err(io_at(parent))?;
            }
            std::fs::write(&file, bytes).map_err(io_at(&file))?;
        }
        Ok(())
    }

    /// The layout as one tar archive (`skopeo copy oci-archive:FILE:compat docker://…`).
    pub fn archive(&self) -> Result<Vec<u8>, OciError> {
        let files = self.layout_files();
        let mut entries = vec![
            Entry::Directory("blobs/".into()),
            Entry::Directory("blobs/sha256/".into()),
        ];
        entries.extend(
            files
                .iter()
                .map(|(path, bytes)| Entry::File(path.clone(), bytes.as_slice())),
        );
        tar_of(&entries)
    }

    /// What to pin, one line each (`make oci` prints it and keeps it as `DIGESTS`).
    pub fn digests_text(&self, archive_name: &str, archive: &[u8]) -> String {
        let hex = |d: &str| d.trim_start_matches("sha256:").to_owned();
        format!(
            "# The filter module and its OCI images (make oci). The same source gives the same digests.\n\
             module  {module}  filter.wasm (plugin.wasm in both images): the sha256 of file:// and http(s):// URLs\n\
             compat  {compat}  manifest of tag `compat`: WasmPlugin `sha256: {compat_hex}` or url oci://REGISTRY/REPO@{compat}\n\
             oci     {oci}  manifest of tag `oci`: the same for the oci variant\n\
             archive {archive_digest}  {archive_name} (the layout as one tar: skopeo copy oci-archive:{archive_name}:compat docker://REGISTRY/REPO:TAG)\n",
            module = self.module_digest,
            compat = self.compat.manifest.digest(),
            compat_hex = hex(&self.compat.manifest.digest()),
            oci = self.oci.manifest.digest(),
            archive_digest = digest_of(archive),
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const MODULE: &[u8] = b"\0asm\x01\0\0\0";

    #[test]
    fn the_same_module_gives_the_same_bytes() {
        let a = build(MODULE, "0.1.0").unwrap();
        let b = build(MODULE, "0.1.0").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.archive().unwrap(), b.archive().unwrap());
        let other = build(b"\0asm\x01\0\0\0\0", "0.1.0").unwrap();
        assert_ne!(a.compat.manifest.digest(), other.compat.manifest.digest());
    }

    #[test]
    fn a_file_that_is_not_wasm_is_refused() {
        assert!(matches!(build(b"ELF", "0"), Err(OciError::NotWasm(_))));
    }

    #[test]
    fn the_oci_variant_has_exactly_two_layers_and_the_wasm_config() {
        let images = build(MODULE, "0.1.0").unwrap();
        let m: serde_json::Value = serde_json::from_slice(&images.oci.manifest.bytes).unwrap();
        assert_eq!(m["config"]["mediaType"], WASM_CONFIG_MEDIA_TYPE);
        assert_eq!(m["layers"].as_array().unwrap().len(), 2);
        assert_eq!(m["layers"][1]["mediaType"], WASM_LAYER_MEDIA_TYPE);
        let c: serde_json::Value = serde_json::from_slice(&images.compat.manifest.bytes).unwrap();
        assert_eq!(c["annotations"][VARIANT_ANNOTATION], "compat");
        assert_eq!(c["layers"][0]["mediaType"], TAR_GZIP_LAYER_MEDIA_TYPE);
    }
}
