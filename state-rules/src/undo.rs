//! Test-only: the fixes the model checker undoes one at a time (`contract::undo`, feature
//! `undo-fixes`), re-exported for the rules that carry them.

#[cfg(feature = "undo-fixes")]
pub use contract::undo::set;
pub use contract::undo::{undone, Fix};
