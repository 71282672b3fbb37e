//! The end-to-end harness on top of the real stack (crate `test-support`: a throwaway Postgres
//! cluster, the state API, the demo checkout and Envoy with the built filter on free loopback
//! ports): clients, faults, the stack on Patroni or on hosts of its own, a history checker, a
//! private Docker engine. Used by the end-to-end suites in `tests/tests` and `make demo`.
//!
//! Nothing here is a mock: a part that cannot be found makes the caller fail with a message
//! that says how to get it.

pub mod client;
pub mod crash_recovery;
pub mod docker;
pub mod faults;
pub mod ha;
pub mod history;
pub mod netns;
pub mod netstack;
/// The stack and the parts under it, shared with the benchmark (crate `test-support`).
pub use test_support::{envoy, net, postgres, process, services, stack, tls};
pub mod testkit;
pub mod upstream;
