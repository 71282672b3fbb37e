//! Put the idempotency layer in front of your own API: one configuration file
//! ([`config`]), the Envoy configuration it renders ([`render`]), and `edge run`, which starts
//! and supervises Postgres (embedded, unless the file names one), the state API and Envoy.

pub mod check;
pub mod config;
pub mod docs;
pub mod envoy;
mod jwt_rules;
pub mod mesh;
pub mod render;
pub mod run;
mod yaml;

/// The parts `edge run` starts and supervises (crate `edge-runtime`), under their old paths.
pub use edge_runtime::{data_home, ha, net, process, services};

/// The embedded cluster (crate `edge-runtime`); `TempCluster` is its old name, which `edge
/// with-postgres` (main.rs) still uses.
pub mod postgres {
    pub use edge_runtime::postgres::Cluster as TempCluster;
    pub use edge_runtime::postgres::*;
}
