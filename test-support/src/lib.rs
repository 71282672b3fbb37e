//! What the tests (the state API's, the end-to-end crate `e2e`) and the benchmark start and
//! break: a throwaway Postgres or `DATABASE_URL`'s ([`postgres`]), throwaway Patroni clusters
//! ([`ha`]), the demo checkout and the faults a test injects into a running service
//! ([`services`]), the process tree ([`process`]); with the feature `stack`, the whole stack on
//! free loopback ports (Postgres, the state API, the checkout, Envoy with the filter as
//! `edge run` configures it: [`stack`], [`envoy`], [`tls`]).
//!
//! It builds on the parts `edge run` itself starts (crate `edge-runtime`); nothing here is in
//! the product. Nothing here is a mock either: a part that cannot be found makes the caller fail
//! with a message that says how to get it.

pub mod ha;
pub mod postgres;
pub mod process;
pub mod services;
/// Loopback ports: free ones, waiting for one to answer.
pub use edge_runtime::net;

#[cfg(feature = "stack")]
pub mod envoy;
#[cfg(feature = "stack")]
pub mod stack;
#[cfg(feature = "stack")]
pub mod tls;
