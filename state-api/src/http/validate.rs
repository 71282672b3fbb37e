//! The checks of the fields of a request (key, subject, endpoint, namespace, fingerprint,
//! token, nonce, stored response, batch size) and the record's address they lead to.

use contract::wire::{valid_nonce, StoredResponse, MAX_NONCE_LEN};
use contract::{validate_key, ProblemKind};

use crate::scope::ScopeHash;
use crate::AppState;

use super::error::ApiError;
use contract::limits::{self, MAX_ALG_LEN, MAX_FIELD_LEN, MAX_HEADERS};

pub(crate) fn bad(detail: impl Into<String>) -> ApiError {
    ApiError::new(ProblemKind::BadRequest, detail)
}

fn check_text(name: &str, v: &str) -> Result<(), ApiError> {
    if v.is_empty() {
        return Err(bad(format!("`{name}` must not be empty")));
    }
    if v.len() > MAX_FIELD_LEN {
        return Err(bad(format!(
            "`{name}` is longer than {MAX_FIELD_LEN} bytes"
        )));
    }
    if v.chars().any(char::is_control) {
        return Err(bad(format!("`{name}` must not contain control characters")));
    }
    Ok(())
}

/// Validates (key, subject, endpoint) and returns the record's address: under the key secret,
/// or, during a rotation, under the previous one when a record lives there.
/// The key's address under the current key secret and, during a rotation, under the previous
/// one (the request's fields checked first).
pub(crate) fn addresses_of(
    state: &AppState,
    namespace: &str,
    key: &str,
    subject: &str,
    endpoint: &str,
) -> Result<(ScopeHash, Option<ScopeHash>), ApiError> {
    validate_key(key).map_err(|e| ApiError::new(ProblemKind::InvalidKey, e.to_string()))?;
    check_text("subject", subject)?;
    check_text("endpoint", endpoint)?;
    if !limits::valid_namespace(namespace) {
        return Err(bad(format!(
            "`namespace` must be at most {} of a-z 0-9 . _ -",
            limits::MAX_NAMESPACE_LEN
        )));
    }
    let scoper = state.scoper();
    Ok((
        scoper.hash_in(namespace, key, subject, endpoint),
        scoper.previous_hash_in(namespace, key, subject, endpoint),
    ))
}

/// [`scope_of`], and the key's current address (where a write moves a record found under the
/// previous secret).
pub(crate) async fn located(
    state: &AppState,
    req: &impl Addressed,
) -> Result<(ScopeHash, ScopeHash), ApiError> {
    let (namespace, key, subject, endpoint) = req.address();
    let at = scope_of(state, namespace, key, subject, endpoint).await?;
    let current = state.scoper().hash_in(namespace, key, subject, endpoint);
    Ok((at, current))
}

/// An owner's write names its record by (namespace, key, subject, endpoint).
pub(crate) trait Addressed {
    fn address(&self) -> (&str, &str, &str, &str);
}

macro_rules! addressed {
    ($($request:ty),*) => {$(
        impl Addressed for $request {
            fn address(&self) -> (&str, &str, &str, &str) {
                (&self.namespace, &self.key, &self.subject, &self.endpoint)
            }
        }
    )*};
}
// (`UnknownRequest` is `ReleaseRequest`.)
addressed!(
    contract::wire::HeartbeatRequest,
    contract::wire::CompleteRequest,
    contract::wire::ReleaseRequest,
    contract::wire::AbandonRequest
);

/// The record of a key at its addresses ([`addresses_of`]), looked for at both during a
/// rotation of the key secret in one read ([`crate::store::Store::record`]), and the address it
/// lives at; `None`, and the key's current address, when there is none.
pub(crate) async fn record_of(
    state: &AppState,
    current: ScopeHash,
    previous: Option<ScopeHash>,
) -> Result<(ScopeHash, Option<crate::store::RecordRow>), ApiError> {
    match state.store().record(&current, previous.as_ref()).await? {
        Some((at, row)) => {
            if at != current {
                state.metrics().previous_secret_hit();
            }
            Ok((at, Some(row)))
        }
        None => Ok((current, None)),
    }
}

pub(crate) async fn scope_of(
    state: &AppState,
    namespace: &str,
    key: &str,
    subject: &str,
    endpoint: &str,
) -> Result<ScopeHash, ApiError> {
    let (current, previous) = addresses_of(state, namespace, key, subject, endpoint)?;
    let Some(previous) = previous else {
        return Ok(current);
    };
    let found = state.store().exists(&previous).await?;
    if found {
        state.metrics().previous_secret_hit();
        return Ok(previous);
    }
    Ok(current)
}

pub(crate) fn check_fingerprint(fingerprint: &str, alg: &str) -> Result<(), ApiError> {
    if fingerprint.len() != 64
        || !fingerprint
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(bad("`fingerprint` must be 64 lower-case hex characters"));
    }
    if alg.is_empty() || alg.len() > MAX_ALG_LEN || !alg.bytes().all(|b| (0x21..=0x7e).contains(&b))
    {
        return Err(bad(format!(
            "`fingerprint_alg` must be 1 to {MAX_ALG_LEN} visible ASCII characters"
        )));
    }
    Ok(())
}

pub(crate) fn check_token(token: i64) -> Result<(), ApiError> {
    if token <= 0 {
        return Err(bad("`token` must be a positive fencing token"));
    }
    Ok(())
}

/// Checks the response to store. Over the body limit: 413, nothing written. (The HTTP body
/// limit bounds the base64 decoded while reading the request.)
pub(crate) fn checked_response(
    state: &AppState,
    r: StoredResponse,
) -> Result<StoredResponse, ApiError> {
    if !limits::STATUS.contains(&r.status) {
        return Err(bad("`response.status` must be 100 to 999"));
    }
    if r.headers.len() > MAX_HEADERS {
        return Err(bad(format!(
            "at most {MAX_HEADERS} response headers are stored"
        )));
    }
    for (name, value) in &r.headers {
        if !limits::storable_header_name(name) {
            return Err(bad("a response header name is not a valid HTTP token"));
        }
        if !limits::storable_header_value(value) {
            return Err(bad(
                "a response header value is too long or holds CR, LF or NUL",
            ));
        }
    }
    let max = state.config().max_body_bytes;
    if r.body.len() > max {
        return Err(ApiError::new(
            ProblemKind::PayloadTooLarge,
            format!("the stored response body is over {max} bytes: complete it with replayable=false and no body"),
        ));
    }
    if !r.replayable && !r.body.is_empty() {
        return Err(bad("a response with replayable=false has no body"));
    }
    Ok(r)
}

/// A batch holds 1 to [`contract::wire::MAX_BATCH_CLAIMS`] requests.
pub(crate) fn batch_size(what: &str, n: usize) -> Result<(), ApiError> {
    let most = contract::wire::MAX_BATCH_CLAIMS;
    if n == 0 || n > most {
        return Err(bad(format!("{what}: {n}; a batch has 1 to {most}")));
    }
    Ok(())
}

pub(crate) fn check_nonce(nonce: &str) -> Result<(), ApiError> {
    if valid_nonce(nonce) {
        Ok(())
    } else {
        Err(bad(format!(
            "`nonce` must be 1 to {MAX_NONCE_LEN} visible ASCII characters"
        )))
    }
}
