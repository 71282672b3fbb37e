//! The idempotency filter's logic (see `docs/filter.md`), with no host calls and no dependency
//! on proxy-wasm: the glue in `filter/` only turns host callbacks into calls of
//! [`worker::Worker`] and its [`worker::Effect`]s into host calls. Tested natively, in wasm
//! (wasm-bindgen-test in Node.js) and by the deterministic simulation in `sim/`.
//!
//! * [`worker`]: one Envoy worker's state machine: the streams' flows, heartbeats, handed-over
//!   writes, and its memory of completed and running keys;
//! * [`flow`]: one request's state machine, one module per phase;
//! * [`host`]: how the worker's effects become host actions (the glue and the simulation each
//!   implement its [`host::Host`] and share its [`host::perform`]);
//! * [`config`], [`key`], [`headers`], [`reply`], [`outcome`], [`metrics`]: the rules they use;
//!   [`route_table`]: the routes as a trie per method (a request's route in the length of its path);
//!   [`hostmap`]: the proxy-wasm header map encoding.

pub mod config;
pub mod effect;
pub mod flow;
pub mod headers;
pub mod host;
pub mod hostmap;
pub mod key;
pub mod metrics;
pub mod outcome;
pub mod reply;
pub mod route_table;
pub mod worker;
