//! The error answer of every route: [`ApiError`], an `application/problem+json` document
//! (503s with Retry-After), made from store failures here; and a batch's answer, each item its
//! value or its problem.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use contract::wire::{BatchItem, BatchResponse};
use contract::{Problem, ProblemKind, PROBLEM_CONTENT_TYPE};

use crate::store::StoreError;

/// An error answer: a problem document, plus Retry-After for 503.
#[derive(Debug)]
pub struct ApiError {
    problem: Problem,
    /// A `404` of the record read that means "no record" (its marker header, which the
    /// filter needs to tell a client `absent`).
    no_record: bool,
}

impl ApiError {
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            problem: Problem::new(kind, detail),
            no_record: false,
        }
    }

    /// The record read's `404`: no record for this key ([`contract::wire::NO_RECORD_HEADER`]).
    pub fn no_record() -> Self {
        Self {
            no_record: true,
            ..Self::new(
                ProblemKind::NotFound,
                "no record for this key, subject and endpoint",
            )
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, self.problem.to_json()).into_response();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if status == StatusCode::UNAUTHORIZED {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.no_record {
            h.insert(
                contract::wire::NO_RECORD_HEADER,
                HeaderValue::from_static(contract::wire::NO_RECORD_VALUE),
            );
        }
        resp
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::from(e).into()
    }
}

/// A store failure is a 503 (database unreachable, read-only, overloaded, the caller's time
/// ran out) or a 500, logged here; the `observe` layer counts both. The detail never carries
/// the database's message.
impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        if e.is_unopenable() {
            tracing::error!(error = %e, "stored response does not open");
            Self::new(
                ProblemKind::Internal,
                "the stored response for this key cannot be opened with this state API's storage keys; nothing was replayed",
            )
        } else if e.is_unavailable() {
            tracing::warn!(error = %e, "database unavailable");
            Self::new(
                ProblemKind::StateUnavailable,
                "the idempotency store cannot be reached; nothing was recorded",
            )
        } else {
            tracing::error!(error = %e, "store failure");
            Self::new(
                ProblemKind::Internal,
                "unexpected failure in the idempotency store",
            )
        }
    }
}

/// One answer per request, in order: the single call's status and document.
pub(crate) fn batch_answer<T: serde::Serialize>(
    answers: Vec<Result<T, ApiError>>,
) -> BatchResponse {
    let answers = answers
        .into_iter()
        .map(|answer| match answer {
            Ok(doc) => BatchItem {
                status: 200,
                answer: serde_json::to_value(doc).unwrap_or_default(),
            },
            Err(e) => BatchItem {
                status: e.problem.status,
                answer: serde_json::to_value(&e.problem).unwrap_or_default(),
            },
        })
        .collect();
    BatchResponse { answers }
}
