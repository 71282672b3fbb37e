//! What the state API accepts, in one place: the state API validates with these, and the filter
//! checks its configuration and what it sends against them, so a request the filter makes is
//! never refused for a limit the filter could have known.

use std::ops::RangeInclusive;

/// Longest subject and endpoint (`"<METHOD> <path>"`), in bytes.
pub const MAX_FIELD_LEN: usize = 1024;
/// Longest fingerprint algorithm name.
pub const MAX_ALG_LEN: usize = 64;
/// Most response headers stored with an outcome.
pub const MAX_HEADERS: usize = 100;
pub const MAX_HEADER_NAME_LEN: usize = 256;
pub const MAX_HEADER_VALUE_LEN: usize = 8192;
/// Status codes stored: three digits, as HTTP/1.1 and Envoy carry them.
pub const STATUS: RangeInclusive<u16> = 100..=999;
/// Shortest and longest lease granted: a shorter one would be reclaimed while the owner is
/// still sending its first byte upstream, a longer one holds a dead owner's key too long.
pub const MIN_LEASE_MS: u64 = 1_000;
pub const MAX_LEASE_MS: u64 = 600_000;
/// The largest stored response body a state API may be configured to accept.
pub const MAX_STORED_BODY_BYTES: u64 = 16 * 1024 * 1024;
/// Longest namespace (a deployment's part of every record's scope).
pub const MAX_NAMESPACE_LEN: usize = 64;
/// The longest a claim may wait for a running key's outcome (`Prefer: wait`).
pub const MAX_WAIT_MS: u64 = 60_000;

/// A namespace: empty (none), or at most [`MAX_NAMESPACE_LEN`] of `a-z 0-9 . _ -`.
pub fn valid_namespace(ns: &str) -> bool {
    ns.len() <= MAX_NAMESPACE_LEN
        && ns
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
}

/// A header name the state API stores: an HTTP token (RFC 9110) of at most
/// [`MAX_HEADER_NAME_LEN`] bytes.
pub fn storable_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_HEADER_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A header value the state API stores: at most [`MAX_HEADER_VALUE_LEN`] bytes, no CR, LF or
/// NUL (Envoy writes a local reply's values as they are: a stored `location: /x\r\nset-cookie:
/// a=1` would reach a client as two headers).
pub fn storable_header_value(value: &str) -> bool {
    value.len() <= MAX_HEADER_VALUE_LEN && !value.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0))
}

/// A subject or endpoint the state API accepts.
pub fn valid_field(v: &str) -> bool {
    !v.is_empty() && v.len() <= MAX_FIELD_LEN && !v.chars().any(char::is_control)
}
