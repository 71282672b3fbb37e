//! Request fingerprints: SHA-256 over the method, the endpoint path, the query, the media type
//! and the body.
//!
//! The same key sent again with a *different* request must be refused (422), and the same
//! request sent again must be recognised even if a client library re-serialized its JSON with
//! another member order or other whitespace. So JSON bodies are hashed in a canonical form:
//!
//! * **`sha256-jcs-v2`**: the body is JSON (by `Content-Type`: `application/json` or any
//!   `+json` type) and it parses. The canonical form follows RFC 8785 (JCS): no insignificant
//!   whitespace, object members sorted by the UTF-16 code units of their names at every depth,
//!   strings re-escaped the JCS way. One deliberate difference: **numbers keep their exact
//!   decimal value**. JCS reads numbers as IEEE-754 doubles, which would make `9007199254740993`
//!   and `9007199254740992` the same amount. Here a number is reduced to its exact decimal
//!   (sign, significant digits, exponent) and printed in the ECMAScript `Number::toString`
//!   layout; that output equals JCS whenever the number as written is the shortest
//!   representation of a double (so `1`, `1.0`, `1e0` and `10e-1` are all `1`), and two
//!   different decimal values never share a form.
//! * **`sha256-raw-v2`**: everything else — other content types, a body that is not valid JSON,
//!   strings with lone surrogates (`"\ud800"`, not representable as Unicode text), numbers
//!   beyond the range of a double or with absurd exponents, and nesting deeper than
//!   [`MAX_DEPTH`]. The raw bytes are hashed: byte-identical retries still match, only the
//!   re-ordering tolerance is lost.
//!
//! A JSON object with the same member name twice is refused ([`FingerprintError::DuplicateMember`],
//! answered 400): two parsers could read it as two different requests.
//!
//! The media type is part of the request: the same bytes as `text/plain` and as
//! `application/json` (or `application/merge-patch+json`) are different requests. It counts
//! as its essence (`type/subtype`, lower-cased; parameters such as `charset` ignored), empty
//! without a `Content-Type`. (The `-v1` algorithms left it out; a record made with them does not
//! match a `-v2` fingerprint: a retry across the upgrade gets 422.)
//!
//! The hash input frames every field with its length, so no two different
//! (algorithm, method, path, query, media type, body) tuples share an input.
//!
//! The document is read with [`crate::json::Parser`], which is iterative: no input, however
//! deep, grows the call stack.

use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::fmt;

/// Fingerprint algorithm over the canonical JSON form.
pub const ALG_JCS: &str = "sha256-jcs-v2";
/// Fingerprint algorithm over the raw body bytes.
pub const ALG_RAW: &str = "sha256-raw-v2";
/// Deepest array/object nesting that is canonicalized; deeper documents are hashed raw.
pub const MAX_DEPTH: usize = 128;
/// Exponents (as written) longer than this many digits are not canonicalized.
const MAX_EXPONENT_DIGITS: usize = 9;

/// A request fingerprint and the algorithm that made it (stored and compared together).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// [`ALG_JCS`] or [`ALG_RAW`]; with a [`Selection`], `sha256-jcs-v2;ignore=…` or
    /// `…;include=…` (the selection's own hash).
    pub alg: Cow<'static, str>,
    /// Lower-case hex SHA-256, 64 characters.
    pub hex: String,
}

/// Why a request cannot be fingerprinted (it must be refused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FingerprintError {
    /// A JSON object has this member name twice.
    DuplicateMember(String),
}

impl fmt::Display for FingerprintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DuplicateMember(name) => {
                write!(
                    f,
                    "a JSON object in the body has the member {name:?} more than once"
                )
            }
        }
    }
}

impl std::error::Error for FingerprintError {}

/// Why a body could not be canonicalized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CanonError {
    /// Not valid JSON (RFC 8259), including invalid UTF-8 and unescaped control characters.
    Syntax { offset: usize },
    /// Valid JSON, but an object has this member name twice.
    DuplicateMember(String),
    /// Valid so far, but nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A `\uXXXX` escape leaves a surrogate unpaired.
    LoneSurrogate,
    /// A number overflows a double, or its exponent is absurdly long.
    NumberOutOfRange,
}

/// The essence of a media type: `type/subtype`, lower-cased, without parameters.
pub fn media_type_essence(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// True for `application/json` and any `*/*+json` media type (parameters and case ignored).
pub fn is_json_content_type(content_type: &str) -> bool {
    let essence = media_type_essence(content_type);
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    !kind.is_empty()
        && (essence == "application/json" || (subtype.ends_with("+json") && subtype.len() > 5))
}

/// Fingerprint a request. `path` excludes the query; `query` is the raw text after `?` (empty
/// when none). JSON content types are canonicalized; everything else is hashed raw.
pub fn fingerprint(
    method: &str,
    path: &str,
    query: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Fingerprint, FingerprintError> {
    fingerprint_with(method, path, query, content_type, body, &Selection::Whole)
}

/// [`fingerprint`] over what `selection` covers of a JSON body (other bodies are hashed whole,
/// as without one).
pub fn fingerprint_with(
    method: &str,
    path: &str,
    query: &str,
    content_type: Option<&str>,
    body: &[u8],
    selection: &Selection,
) -> Result<Fingerprint, FingerprintError> {
    let media = content_type.map(media_type_essence).unwrap_or_default();
    let request = [method, path, query, media.as_str()];
    if content_type.is_some_and(is_json_content_type) {
        match canonicalize_with(body, selection, None) {
            Ok((canonical, _)) => return Ok(hash(selection.alg(), request, &canonical)),
            Err(CanonError::DuplicateMember(name)) => {
                return Err(FingerprintError::DuplicateMember(name))
            }
            Err(_) => {}
        }
    }
    Ok(hash(Cow::Borrowed(ALG_RAW), request, body))
}

/// The string at `pointer` in a JSON body (a route's `key_from`); `None` when the body is not
/// JSON, or holds no string there.
pub fn string_at(body: &[u8], pointer: &Pointer) -> Option<String> {
    canonicalize_with(body, &Selection::Whole, Some(pointer))
        .ok()
        .and_then(|(_, found)| found)
}

/// A JSON pointer (RFC 6901) into a request body: `/card/number`, `/items/0`. The root (`""`)
/// and the end-of-array token `-` select nothing and are refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pointer {
    text: String,
    tokens: Vec<String>,
}

impl Pointer {
    pub fn parse(text: &str) -> Result<Self, String> {
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!(
                "`{text}` is not a JSON pointer: it starts with '/' (RFC 6901)"
            ));
        };
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                // Every '~' is an escape: ~0 for '~', ~1 for '/'.
                let c = match (c, c == '~') {
                    (_, false) => c,
                    (_, true) => match chars.next() {
                        Some('0') => '~',
                        Some('1') => '/',
                        _ => return Err(format!("`{text}`: '~' is written ~0, and '/' ~1")),
                    },
                };
                token.push(c);
            }
            if token == "-" {
                return Err(format!(
                    "`{text}`: '-' (past the end of an array) selects nothing: name an index"
                ));
            }
            tokens.push(token);
        }
        Ok(Self {
            text: text.to_owned(),
            tokens,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// What of a JSON body a fingerprint covers: all of it, all but some members, or only some.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Selection {
    #[default]
    Whole,
    /// Everything except the values at these pointers (a timestamp, a trace id).
    Ignore(Vec<Pointer>),
    /// Only the values at these pointers, in their places (missing ones are left out).
    Include(Vec<Pointer>),
}

impl Selection {
    /// The algorithm name: the selection's kind and a hash of its pointers (in any order), so
    /// that changing the list never lets an older record match.
    pub fn alg(&self) -> Cow<'static, str> {
        let (kind, pointers) = match self {
            Selection::Whole => return Cow::Borrowed(ALG_JCS),
            Selection::Ignore(p) => ("ignore", p),
            Selection::Include(p) => ("include", p),
        };
        let mut texts: Vec<&[u8]> = pointers.iter().map(|p| p.text.as_bytes()).collect();
        sort_dedup(&mut texts);
        let mut h = Sha256::new();
        crate::scope::frame_parts(&mut h, &texts);
        let digest = h.finalize();
        let mut out = format!("{ALG_JCS};{kind}=");
        for b in digest.iter().take(6) {
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0x0f)] as char);
        }
        Cow::Owned(out)
    }
}

/// SHA-256 of the framed (algorithm, method, path, query, media type, body).
fn hash(alg: Cow<'static, str>, request: [&str; 4], body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    let [method, path, query, media] = request;
    crate::scope::frame_parts(
        &mut h,
        &[
            alg.as_bytes(),
            method.as_bytes(),
            path.as_bytes(),
            query.as_bytes(),
            media.as_bytes(),
            body,
        ],
    );
    let digest = h.finalize();
    let mut hex = String::with_capacity(64);
    for b in digest.iter() {
        hex.push(HEX[usize::from(b >> 4)] as char);
        hex.push(HEX[usize::from(b & 0x0f)] as char);
    }
    Fingerprint { alg, hex }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

mod canonical;
pub use canonical::canonicalize;
#[cfg(test)]
use canonical::{canonical_number, utf16_cmp, DOUBLE_OVERFLOW};
use canonical::{canonicalize_with, sort_dedup};

#[cfg(test)]
mod tests;
