//! Checks the module Envoy loads: `target/wasm32-wasip1/release/filter.wasm` (build it first with
//! `cargo build -p filter --release --target wasm32-wasip1`). It must import only the proxy-wasm
//! ABI (`env.proxy_*`) and WASI preview 1 (`wasi_snapshot_preview1.*`): a `__wbindgen_*` or any
//! other import makes Envoy refuse the module. Skipped when the module is not built, unless
//! `FILTER_WASM_REQUIRED=1`; `FILTER_WASM=<path>` checks another file.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

fn module() -> Option<Vec<u8>> {
    let path = std::env::var_os("FILTER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/wasm32-wasip1/release/filter.wasm")
        });
    match std::fs::read(&path) {
        Ok(bytes) => Some(bytes),
        Err(e) if std::env::var("FILTER_WASM_REQUIRED").as_deref() != Ok("1") => {
            eprintln!("skipped: {} not readable ({e}); build it with `cargo build -p filter --release --target wasm32-wasip1`", path.display());
            None
        }
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

#[test]
fn imports_only_proxy_wasm_and_wasi() {
    let Some(bytes) = module() else { return };
    let mut imports = Vec::new();
    let mut exports = Vec::new();
    for payload in wasmparser::Parser::new(0).parse_all(&bytes) {
        match payload.unwrap() {
            wasmparser::Payload::ImportSection(reader) => {
                for imp in reader.into_imports() {
                    let imp = imp.unwrap();
                    imports.push(format!("{}.{}", imp.module, imp.name));
                }
            }
            wasmparser::Payload::ExportSection(reader) => {
                for exp in reader {
                    exports.push(exp.unwrap().name.to_owned());
                }
            }
            _ => {}
        }
    }
    assert!(!imports.is_empty());
    let bad: Vec<_> = imports
        .iter()
        .filter(|i| !(i.starts_with("env.proxy_") || i.starts_with("wasi_snapshot_preview1.")))
        .collect();
    assert!(bad.is_empty(), "imports Envoy does not provide: {bad:?}");
    for needed in [
        "_initialize",
        "proxy_on_context_create",
        "proxy_on_request_headers",
        "proxy_on_http_call_response",
        "proxy_on_tick",
        "proxy_abi_version_0_2_1",
    ] {
        assert!(
            exports.iter().any(|e| e == needed),
            "missing export {needed}: {exports:?}"
        );
    }
    assert!(
        !exports.iter().any(|e| e == "_start"),
        "a command module (_start) instead of a reactor"
    );
    eprintln!("{} bytes, {} imports", bytes.len(), imports.len());
}

#[test]
fn stays_small() {
    let Some(bytes) = module() else { return };
    // Loaded (and compiled by V8) into every worker: the budget is 360 KiB (it is about 351
    // KiB; it went over 300 KiB with issue 34's fixes and over 350 KiB with issue 48's answers
    // for clients; docs/filter.md, Module size, says what takes the space). Raise deliberately
    // if it must grow.
    assert!(
        bytes.len() <= 360 * 1024,
        "filter.wasm is {} bytes, over 360 KiB",
        bytes.len()
    );
}
