//! What `edge run` starts and supervises, as processes of this machine: child processes that die
//! with their owner ([`process`]), the embedded Postgres cluster ([`postgres`]) or, with `--ha`,
//! Patroni with HAProxy ([`ha`]) in a data folder the server's user can reach ([`data_home`]),
//! and the state API ([`services`]). The test harness (crate `test-support`) builds on the same
//! parts; what only tests use lives there, not here.

pub mod data_home;
pub mod ha;
pub mod net;
pub mod postgres;
pub mod process;
pub mod services;
