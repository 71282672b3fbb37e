//! The one JSON reader of the project.
//!
//! A pull parser ([`Parser`]) walks a UTF-8 document without recursion and reports each token
//! as an [`Event`]. Two readers sit on it:
//! * the request fingerprint ([`crate::fingerprint::canonicalize`]), which keeps numbers as
//!   written and needs every string decoded exactly;
//! * [`parse`], a small tree ([`Value`]) with integer-only numbers, for the documents the filter
//!   reads: its configuration and the state API's answers ([`crate::wire`]). [`Fields`] takes
//!   its objects apart with errors that name the field.
//!
//! serde_json's deserializer is not used in the filter: with the visitor code generated for
//! every type, its float parsing and the float formatting its errors pull in, it was a third
//! of the module Envoy loads. Writing JSON stays with serde_json.

mod error;
mod fields;
mod parser;
mod tree;

pub use error::{Error, ErrorKind};
pub use fields::Fields;
pub use parser::{Event, Parser};
pub use tree::{parse, Value, MAX_DEPTH};

#[cfg(test)]
mod tests;
