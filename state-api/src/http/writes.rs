//! The owner's fenced writes that carry a request on: `/v1/heartbeat`, `/v1/complete`,
//! `/v1/completes` and `/v1/writes` (a batch of claims and completes).

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use contract::wire::{
    BatchResponse, CompleteBatchRequest, CompleteRequest, HeartbeatRequest, HeartbeatResponse,
    WriteBatchRequest, WriteResponse,
};
use contract::ProblemKind;
use state_rules::writes::Beat;

use crate::batch::CompleteJob;
use crate::metrics::WriteOp;
use crate::scope::ScopeHash;
use crate::store::{StoreError, WriteResult};
use crate::AppState;

use super::claims::{finish_claims, prepare_claims, refuse_waits};
use super::error::{batch_answer, ApiError};
use super::extract::{caller_deadline, ApiJson};
use super::release::fenced_out;
use super::validate::{bad, batch_size, check_token, checked_response, located};

#[utoipa::path(
    post,
    path = "/v1/heartbeat",
    tag = "filter",
    summary = r#"Extend the lease of an in-flight claim (fenced)"#,
    description = r#"Sets the lease to now + lease_ms (database clock), and the record's expiry to a retention past it, if `token` still owns the in-progress record. An owner whose lease ran out but that was not reclaimed or marked yet is still the owner. A record marked `unknown` (by its owner, by a claim that found its lease run out, or by the purge) is never made in progress again by a heartbeat, whenever it was sent: 409 `lease-ended` (the owner's `complete` is still accepted); another token owns the record, or it is completed or gone: 409 `fenced-out`."#,
    request_body = HeartbeatRequest,
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = HeartbeatResponse)
    )
)]
pub(crate) async fn heartbeat(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<HeartbeatRequest>,
) -> Result<Json<HeartbeatResponse>, ApiError> {
    // Where the record is (during a rotation, perhaps still under the previous secret), and
    // where this write moves it (the current secret's address).
    let (scope, current) = located(&state, &req).await?;
    check_token(req.token)?;
    let lease_ms = state.config().lease_for(req.lease_ms);
    let beat = state
        .store()
        .heartbeat(
            &scope,
            &current,
            req.token,
            lease_ms,
            state.config().retention_ms(),
        )
        .await?;
    match beat {
        Beat::Extended => {
            state.metrics().write_ok(WriteOp::Heartbeat);
            Ok(Json(HeartbeatResponse { lease_ms }))
        }
        Beat::LeaseEnded => {
            state.metrics().fenced_out(WriteOp::Heartbeat);
            Err(ApiError::new(
                ProblemKind::LeaseEnded,
                "the record is marked unknown: its lease is not extended; the owner's complete is still accepted",
            ))
        }
        Beat::FencedOut => Err(fenced_out(&state, WriteOp::Heartbeat, &scope)),
    }
}

#[utoipa::path(
    post,
    path = "/v1/complete",
    tag = "filter",
    summary = r#"Store the upstream's response (fenced)"#,
    description = r#"Marks the record completed with the response; retention (--retention-s, default 24 h) starts now. A retried complete by the same token after success answers 200 and changes nothing. A response with `replayable=false` keeps status and headers, no body. Also accepted while the record is `unknown` and still holds this token (the owner was alive after all)."#,
    request_body = CompleteRequest,
    params(
        ("idempotency-caller-timeout-ms" = Option<u64>, Header, description = r#"How long (ms) the caller waits for the answer. The state API works on the request a twentieth (at least 50 ms) less than that (at most --max-request-ms) and answers 503 at that deadline; a claim committed after it is released."#)
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = WriteResponse)
    )
)]
pub(crate) async fn complete(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CompleteRequest>,
) -> Result<Json<WriteResponse>, ApiError> {
    let deadline = caller_deadline(&state, &headers);
    complete_one(&state, req, deadline).await.map(Json)
}

#[utoipa::path(
    post,
    path = "/v1/completes",
    tag = "filter",
    summary = r#"Several completes in one call (fenced)"#,
    description = r#"Each complete is stored exactly as `/v1/complete` would store it alone (together, as one group commit where they can): `answers[i]` is the status and document of `completes[i]` (a write answer for 200, a problem document otherwise, e.g. 409 fenced out). The call answers 200 once every complete is answered, 400 for an empty list or more than 128, and 401/413/503 as the single complete does. The filter sends the held responses that queued on a worker while its previous complete was on its way."#,
    request_body = CompleteBatchRequest,
    params(
        ("idempotency-caller-timeout-ms" = Option<u64>, Header, description = r#"As for `/v1/complete`, for the whole call."#)
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = BatchResponse)
    )
)]
pub(crate) async fn completes(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(batch): ApiJson<CompleteBatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    batch_size("completes", batch.completes.len())?;
    let deadline = caller_deadline(&state, &headers);
    let prepared = prepare_completes(&state, batch.completes, deadline).await;
    let jobs = prepared.iter().flatten().cloned().collect();
    let stored = state.batcher().completes(jobs).await;
    Ok(Json(batch_answer(finish_completes(
        &state, prepared, stored,
    ))))
}

/// Each complete of a batch checked, in order.
async fn prepare_completes(
    state: &AppState,
    completes: Vec<CompleteRequest>,
    deadline: tokio::time::Instant,
) -> Vec<Result<CompleteJob, ApiError>> {
    futures::future::join_all(
        completes
            .into_iter()
            .map(|req| prepare_complete(state, req, deadline)),
    )
    .await
}

/// The answers to a batch's completes, as `finish_claims` makes a batch's claim answers.
fn finish_completes(
    state: &AppState,
    prepared: Vec<Result<CompleteJob, ApiError>>,
    stored: Vec<Result<WriteResult, StoreError>>,
) -> Vec<Result<WriteResponse, ApiError>> {
    let mut stored = stored.into_iter();
    prepared
        .into_iter()
        .map(|job| {
            let job = job?;
            finish_complete(
                state,
                &job.scope,
                stored.next().unwrap_or(Err(StoreError::Unanswered)),
            )
        })
        .collect()
}

#[utoipa::path(
    post,
    path = "/v1/writes",
    tag = "filter",
    summary = r#"Claims and completes in one call"#,
    description = r#"Each claim is answered exactly as `/v1/claim` would answer it alone, and each complete stored exactly as `/v1/complete` would store it (all together, as one group commit where they can): `answers` holds the items of `claims` in order, then those of `completes`, each the status and document of the single call (a claim or write answer for 200, a problem document otherwise). The call answers 200 once every item is answered, 400 when both lists are empty, either holds more than 128 or a claim has `wait_ms`, and 401/413/503 as the single calls do. The filter sends the claims and held responses' completes that queued on a worker while its previous write was on its way."#,
    request_body = WriteBatchRequest,
    params(
        ("idempotency-caller-timeout-ms" = Option<u64>, Header, description = r#"As for `/v1/claim`, for the whole call."#)
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = BatchResponse)
    )
)]
pub(crate) async fn writes(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(batch): ApiJson<WriteBatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let most = contract::wire::MAX_BATCH_CLAIMS;
    let (claims, completes) = (batch.claims.len(), batch.completes.len());
    if claims + completes == 0 || claims > most || completes > most {
        return Err(bad(format!(
            "writes: {claims} claims and {completes} completes; a batch has at most {most} of each, and at least one item"
        )));
    }
    refuse_waits(&batch.claims)?;
    let deadline = caller_deadline(&state, &headers);
    let (claims, completes) = futures::join!(
        prepare_claims(&state, batch.claims, deadline),
        prepare_completes(&state, batch.completes, deadline)
    );
    let claim_jobs = claims.iter().flatten().map(|p| p.job.clone()).collect();
    let complete_jobs = completes.iter().flatten().cloned().collect();
    let (stored_claims, stored_completes) = state.batcher().writes(claim_jobs, complete_jobs).await;
    let mut answers = batch_answer(finish_claims(&state, claims, stored_claims).await);
    answers
        .answers
        .extend(batch_answer(finish_completes(&state, completes, stored_completes)).answers);
    Ok(Json(answers))
}

/// One complete, as `/v1/complete` stores it (`/v1/completes` runs the same two steps, with
/// the store's part of all its completes together).
async fn complete_one(
    state: &AppState,
    req: CompleteRequest,
    deadline: tokio::time::Instant,
) -> Result<WriteResponse, ApiError> {
    let job = prepare_complete(state, req, deadline).await?;
    let scope = job.scope;
    finish_complete(state, &scope, state.batcher().complete(job).await)
}

/// The complete's checks and its job for the store.
async fn prepare_complete(
    state: &AppState,
    req: CompleteRequest,
    deadline: tokio::time::Instant,
) -> Result<CompleteJob, ApiError> {
    let (at, current) = located(state, &req).await?;
    check_token(req.token)?;
    let row = checked_response(state, req.response)?;
    // A record under the previous key secret moves to the current one before its response is
    // sealed there (its address is the seal's), so that it outlives the previous secret; the
    // response is sealed where the record holding the token is, which another write of the
    // same claim may have moved since `at` was looked up.
    let scope = if at != current {
        state
            .store()
            .move_to_current(&at, &current, req.token)
            .await?
            .unwrap_or(at)
    } else {
        at
    };
    Ok(CompleteJob {
        scope,
        token: req.token,
        response: row,
        retention_ms: state.config().retention_ms(),
        deadline,
    })
}

/// The store's answer to a complete, for its caller.
fn finish_complete(
    state: &AppState,
    scope: &ScopeHash,
    result: Result<WriteResult, StoreError>,
) -> Result<WriteResponse, ApiError> {
    match result? {
        WriteResult::Done { expires_in_ms } => {
            state.metrics().write_ok(WriteOp::Complete);
            state.waiters().settled(scope);
            Ok(WriteResponse::completed(expires_in_ms))
        }
        WriteResult::AlreadyDone { expires_in_ms } => Ok(WriteResponse::completed(expires_in_ms)),
        WriteResult::FencedOut => Err(fenced_out(state, WriteOp::Complete, scope)),
    }
}
