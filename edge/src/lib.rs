//! Put the idempotency layer in front of your own API: one configuration file
//! ([`config`]), the Envoy configuration it renders ([`render`]), and `edge run`, which starts
//! and supervises Postgres (embedded, unless the file names one), the state API and Envoy.

pub mod check;
pub mod config;
pub mod data_home;
pub mod envoy;
pub mod ha;
pub mod mesh;
pub mod net;
pub mod postgres;
pub mod process;
pub mod render;
pub mod run;
pub mod services;
