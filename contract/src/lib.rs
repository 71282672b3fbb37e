//! The contract shared by the filter (in Envoy), the state API and the tests.
//!
//! Nothing here calls a host or does I/O, so it compiles for `wasm32-wasip1` (the filter),
//! `wasm32-unknown-unknown` (the wasm-bindgen tests) and natively (state API, tests).

pub mod admin;
pub mod fingerprint;
pub mod json;
pub mod key;
pub mod limits;
pub mod problem;
pub mod scope;
pub mod state_env;
pub mod undo;
pub mod wire;

pub use key::{validate_key, KeyError, MAX_KEY_LEN};
pub use problem::{ClientError, Problem, ProblemKind, PROBLEM_CONTENT_TYPE};
