//! The state API's record rules, free of SQL and of time sources: each rule takes one record
//! (or none) and a [`Clock`] and returns what becomes of the record and what the caller is told.
//!
//! The state API (`state-api/src/store/`) carries these rules out in SQL, one statement per
//! rule, and calls the claim's [`claim::decide`] on the row it read; `state-api/tests/rules.rs`
//! runs every rule here and its statement on the same records and compares them. The
//! simulation's state API model and the model checker call the rules directly, so that what
//! they check is the store's own decision, not a restatement of it.

pub mod claim;
pub mod fingerprint;
pub mod operator;
pub mod purge;
pub mod record;
pub mod rotation;
pub mod undo;
pub mod writes;

pub use claim::{claim, decide, ClaimOutcome, ClaimTerms, Decision, Facts};
pub use contract::wire::RecordState;
pub use record::{Clock, Fingerprint, Record};
