//! The idempotency filter Envoy loads: the proxy-wasm glue around [`filter_core`]. It turns
//! host callbacks into calls of the worker's state machine and its effects into host calls,
//! and decides nothing itself (see `docs/filter.md`). Compiled for `wasm32-wasip1` only.

#[cfg(all(target_arch = "wasm32", target_os = "wasi"))]
mod glue;
