//! The owner's fenced writes that let a claim go: `/v1/release` (nothing was sent),
//! `/v1/abandon` (a claim whose answer never arrived) and `/v1/unknown` (the outcome cannot be known).

use axum::extract::State;
use axum::Json;
use contract::wire::{AbandonRequest, ReleaseRequest, UnknownRequest, WriteResponse};
use contract::ProblemKind;
use state_rules::writes::Abandoned;

use crate::metrics::WriteOp;
use crate::scope::{log_label, ScopeHash};
use crate::AppState;

use super::error::ApiError;
use super::extract::ApiJson;
use super::validate::{check_nonce, check_token, located};

#[utoipa::path(
    post,
    path = "/v1/release",
    tag = "filter",
    summary = r#"Give the key back (fenced)"#,
    description = r#"Deletes the in-progress record when the effect certainly did not start: the key is free for a retry."#,
    request_body = ReleaseRequest,
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = WriteResponse)
    )
)]
pub(crate) async fn release(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ReleaseRequest>,
) -> Result<Json<WriteResponse>, ApiError> {
    // Where the record is (during a rotation, perhaps still under the previous secret), and
    // where this write moves it (the current secret's address).
    let (scope, current) = located(&state, &req).await?;
    check_token(req.token)?;
    let ok = state
        .store()
        .release(&scope, &current, req.token, state.config().retention_ms())
        .await?;
    if !ok {
        return Err(fenced_out(&state, WriteOp::Release, &scope));
    }
    state.metrics().write_ok(WriteOp::Release);
    state.waiters().settled(&current);
    Ok(Json(WriteResponse::released()))
}

#[utoipa::path(
    post,
    path = "/v1/abandon",
    tag = "filter",
    summary = r#"Give back a claim whose answer never arrived"#,
    description = r#"The filter sent a claim with `nonce` and never read its answer (its call timed out, was cancelled with its stream, or the answer could not be read), so it forwarded nothing under it. The record that claim made or took over, if it is still in progress or unknown under that nonce, is given back as a release would: deleted (the key is free at once), or `unknown` again where the claim had taken over an earlier attempt whose outcome is unknown. A record another claim made or took over since, or one with an outcome, is left alone. Always 200: `released` (given back, or nothing to give back) or `unknown`."#,
    request_body = AbandonRequest,
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = WriteResponse)
    )
)]
pub(crate) async fn abandon(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<AbandonRequest>,
) -> Result<Json<WriteResponse>, ApiError> {
    // Where the record is (during a rotation, perhaps still under the previous secret), and
    // where this write moves it (the current secret's address).
    let (scope, current) = located(&state, &req).await?;
    check_nonce(&req.nonce)?;
    let done = state
        .store()
        .abandon(&scope, &current, &req.nonce, state.config().retention_ms())
        .await?;
    state.metrics().write_ok(WriteOp::Abandon);
    state.waiters().settled(&current);
    Ok(Json(match done {
        Abandoned::Unknown => WriteResponse::unknown(),
        Abandoned::Deleted | Abandoned::Nothing => WriteResponse::released(),
    }))
}

/// The owner lost sight of its forwarded request: the record's outcome is unknown.
#[utoipa::path(
    post,
    path = "/v1/unknown",
    tag = "filter",
    summary = r#"Say the outcome is unknown (fenced)"#,
    description = r#"The owner forwarded its request and lost sight of it before an outcome (the client left, the upstream reset or timed out before answering): the record becomes `unknown` at once, its lease ends, and no claim runs it again unless it takes it over. Marking again is harmless; after the owner's own complete it answers `completed` and changes nothing."#,
    request_body = ReleaseRequest,
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = WriteResponse)
    )
)]
pub(crate) async fn outcome_unknown(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<UnknownRequest>,
) -> Result<Json<WriteResponse>, ApiError> {
    // Where the record is (during a rotation, perhaps still under the previous secret), and
    // where this write moves it (the current secret's address).
    let (scope, current) = located(&state, &req).await?;
    check_token(req.token)?;
    let marked = state
        .store()
        .owner_unknown(&scope, &current, req.token, state.config().retention_ms())
        .await?;
    match marked {
        Some(true) => {
            state.metrics().write_ok(WriteOp::Unknown);
            state.waiters().settled(&current);
            tracing::warn!(scope = %log_label(&scope), token = req.token, endpoint = %req.endpoint, "outcome unknown: its owner lost sight of the request after forwarding it");
            Ok(Json(WriteResponse::unknown()))
        }
        // Completed by this owner already (a complete that raced the mark): that stands.
        Some(false) => Ok(Json(WriteResponse {
            state: contract::wire::WriteState::Completed,
            expires_in_ms: None,
        })),
        None => Err(fenced_out(&state, WriteOp::Unknown, &scope)),
    }
}

pub(crate) fn fenced_out(state: &AppState, op: WriteOp, scope: &ScopeHash) -> ApiError {
    state.metrics().fenced_out(op);
    tracing::warn!(scope = %log_label(scope), op = op.label(), "fenced out: a newer claim owns the record, or it is gone");
    ApiError::new(
        ProblemKind::FencedOut,
        format!(
            "{}: this token no longer owns an in-progress record for the key; nothing was written",
            op.label()
        ),
    )
}
