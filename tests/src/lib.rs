//! The real stack, started on free loopback ports: a throwaway Postgres cluster, the state API,
//! the demo checkout and Envoy with the built filter. Used by the end-to-end tests, the state
//! API's tests and `make demo`.
//!
//! Nothing here is a mock: a part that cannot be found makes the caller fail with a message
//! that says how to get it.

pub mod client;
pub mod crash_recovery;
pub mod docker;
pub mod envoy;
pub mod faults;
pub mod ha;
pub mod history;
pub mod netns;
pub mod netstack;
/// The runtime pieces the harness shares with `edge run`.
pub use edge::{net, postgres, process, services};
pub mod stack;
pub mod testkit;
pub mod tls;
pub mod upstream;
