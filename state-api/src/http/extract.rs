//! What a request carries before a handler runs: the JSON body whose rejections are problem
//! documents, the bearer token of `/v1` (middleware), the per-request log line and latency
//! (middleware), and the caller's deadline.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use contract::ProblemKind;
use serde::de::DeserializeOwned;
use subtle::ConstantTimeEq as _;

use crate::metrics::Route;
use crate::AppState;

use super::error::ApiError;

/// JSON body whose rejections are problem documents, not axum's plain-text ones.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    ProblemKind::PayloadTooLarge,
                    "the request body is over the limit",
                )
            } else {
                ApiError::new(
                    ProblemKind::BadRequest,
                    "the request body could not be read",
                )
            }
        })?;
        serde_json::from_slice(&bytes).map(ApiJson).map_err(|e| {
            ApiError::new(ProblemKind::BadRequest, format!("malformed JSON body: {e}"))
        })
    }
}

/// Every `/v1` call must carry `Authorization: Bearer <token>`. Both sides are hashed first so
/// the constant-time comparison does not reveal the token's length either.
pub(crate) async fn require_token(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme is case-insensitive (RFC 9110).
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    let ok =
        presented.is_some_and(|t| bool::from(crate::token_digest(t).ct_eq(state.token_digest())));
    if !ok {
        return ApiError::new(
            ProblemKind::Unauthenticated,
            "a valid bearer token is required",
        )
        .into_response();
    }
    next.run(req).await
}

/// Latency histogram and one log line per request: route and status only, never the query
/// string (it carries the key on the operator read) or a body.
pub(crate) async fn observe(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let route = Route::from_path(req.uri().path());
    let method = req.method().clone();
    let resp = next.run(req).await;
    let elapsed = start.elapsed();
    state.metrics().observe(route, elapsed);
    // Every 503 and 500 of this API is a store failure (or a database that cannot write).
    match resp.status() {
        StatusCode::SERVICE_UNAVAILABLE => state.metrics().db_unavailable(),
        StatusCode::INTERNAL_SERVER_ERROR => state.metrics().internal_error(),
        _ => {}
    }
    tracing::debug!(%method, route = ?route, status = resp.status().as_u16(), micros = elapsed.as_micros() as u64, "request");
    resp
}

/// When the caller stops waiting: its `idempotency-caller-timeout-ms` (less a margin), at most
/// `--max-request-ms`, from now.
pub(crate) fn caller_deadline(state: &AppState, headers: &HeaderMap) -> tokio::time::Instant {
    let caller_ms = headers
        .get(contract::wire::CALLER_TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    tokio::time::Instant::now() + state.config().request_budget(caller_ms)
}
