//! The idempotency filter: a proxy-wasm HTTP filter for Envoy that answers duplicate requests
//! at the edge (see `docs/filter.md`).
//!
//! Everything that decides is plain Rust without host calls, tested natively and in wasm:
//! [`config`], [`key`], [`headers`], [`outcome`], [`heartbeat`], [`retry`], [`cache`], [`metrics`] and the
//! per-request state machine [`flow`]. The proxy-wasm glue in `glue/` only performs what the
//! flow asks for; it is compiled for `wasm32-wasip1` (the module Envoy loads) only.

pub mod answers;
pub mod cache;
pub mod config;
pub mod flow;
pub mod headers;
pub mod heartbeat;
pub mod hostmap;
pub mod json;
pub mod key;
pub mod metrics;
pub mod outcome;
pub mod retry;

#[cfg(all(target_arch = "wasm32", target_os = "wasi"))]
mod glue;
