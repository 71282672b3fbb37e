//! The state API's HTTP side, one file a job: the error answer (`error`), what a request
//! carries before its handler runs (`extract`: the JSON body, the bearer token, the log line,
//! the caller's deadline), the checks of its fields (`validate`), and the handlers by resource:
//! claims (`claims`), the owner's writes that carry a request on (`writes`) or let it go
//! (`release`), the operator's read (`records`) and the open routes of operations (`health`).
//! The routes themselves are one table in [`crate::router`].

pub mod claims;
pub mod error;
pub mod extract;
pub mod health;
pub mod records;
pub mod release;
pub mod validate;
pub mod writes;
