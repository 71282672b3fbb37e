//! Routes, bearer authentication, input validation and the mapping of every error to an
//! `application/problem+json` document.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use contract::wire::{
    valid_nonce, AbandonRequest, BatchItem, BatchResponse, ClaimBatchRequest, ClaimRequest,
    ClaimResponse, CompleteBatchRequest, CompleteRequest, HeartbeatRequest, HeartbeatResponse,
    OnUnknown, RecordView, ReleaseRequest, StoredResponse, UnknownRequest, WriteBatchRequest,
    WriteResponse, ABANDON_PATH, CLAIMS_PATH, CLAIM_PATH, COMPLETES_PATH, COMPLETE_PATH,
    HEARTBEAT_PATH, MAX_NONCE_LEN, RECORDS_PATH, RELEASE_PATH, UNKNOWN_PATH, WRITES_PATH,
};
use contract::{validate_key, Problem, ProblemKind, PROBLEM_CONTENT_TYPE};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use state_rules::writes::{Abandoned, Beat};
use subtle::ConstantTimeEq as _;

use crate::batch::{ClaimJob, CompleteJob};
use crate::metrics::{self, Route, WriteOp};
use crate::scope::{log_label, ScopeHash};
use crate::store::{self, Readiness, StoreError, WriteResult};
use crate::AppState;

use contract::limits::{self, MAX_ALG_LEN, MAX_FIELD_LEN, MAX_HEADERS};

/// The router: `/v1/*` behind the bearer token; health, readiness, metrics and the OpenAPI
/// document open (the API listens on loopback or a private network).
pub fn app(state: AppState) -> Router {
    let v1 = Router::new()
        .route(CLAIM_PATH, post(claim))
        .route(CLAIMS_PATH, post(claims))
        .route(HEARTBEAT_PATH, post(heartbeat))
        .route(COMPLETE_PATH, post(complete))
        .route(COMPLETES_PATH, post(completes))
        .route(WRITES_PATH, post(writes))
        .route(RELEASE_PATH, post(release))
        .route(ABANDON_PATH, post(abandon))
        .route(UNKNOWN_PATH, post(outcome_unknown))
        .route(RECORDS_PATH, get(record))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    let limit = state.config().http_body_limit();
    Router::new()
        .merge(v1)
        .merge(crate::admin::router(state.clone()))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

// ---------------------------------------------------------------------------------------------
// Errors

/// An error answer: a problem document, plus Retry-After for 503.
#[derive(Debug)]
pub struct ApiError {
    problem: Problem,
}

impl ApiError {
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            problem: Problem::new(kind, detail),
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

// ---------------------------------------------------------------------------------------------
// Extractors and middleware

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
async fn require_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
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
async fn observe(State(state): State<AppState>, req: Request, next: Next) -> Response {
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

// ---------------------------------------------------------------------------------------------
// Validation

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
async fn located(
    state: &AppState,
    namespace: &str,
    key: &str,
    subject: &str,
    endpoint: &str,
) -> Result<(ScopeHash, ScopeHash), ApiError> {
    let at = scope_of(state, namespace, key, subject, endpoint).await?;
    let current = state.scoper().hash_in(namespace, key, subject, endpoint);
    Ok((at, current))
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

fn check_fingerprint(fingerprint: &str, alg: &str) -> Result<(), ApiError> {
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

fn check_token(token: i64) -> Result<(), ApiError> {
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

pub(crate) fn ms(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Handlers

/// When the caller stops waiting: its `idempotency-caller-timeout-ms` (less a margin), at most
/// `--max-request-ms`, from now.
fn caller_deadline(state: &AppState, headers: &HeaderMap) -> tokio::time::Instant {
    let caller_ms = headers
        .get(contract::wire::CALLER_TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    tokio::time::Instant::now() + state.config().request_budget(caller_ms)
}

#[utoipa::path(
    post,
    path = "/v1/claim",
    tag = "filter",
    summary = r#"Claim a key, or learn why not"#,
    description = r#"Inserts the record (`INSERT ... ON CONFLICT DO NOTHING`, committed before the answer). On conflict the stored fingerprint is always compared (with its algorithm), for in-progress and completed records alike. Outcomes (all with status 200): `claimed` (run the effect, then complete or release with `token`; `reclaimed` when an expired lease was taken over), `in_progress` (another owner holds a live lease: the filter answers 409 with Retry-After = `retry_after_s` = clamp(ceil(remaining lease s), 1, --retry-after-cap-s)), `completed` (replay `response`), `mismatch` (the key was used with a different fingerprint: the filter answers 422). A record past its retention is treated as new."#,
    request_body = ClaimRequest,
    params(
        ("idempotency-caller-timeout-ms" = Option<u64>, Header, description = r#"How long (ms) the caller waits for the answer. The state API works on the request a twentieth (at least 50 ms) less than that (at most --max-request-ms) and answers 503 at that deadline; a claim committed after it is released."#)
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = ClaimResponse)
    )
)]
async fn claim(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ClaimRequest>,
) -> Result<Json<ClaimResponse>, ApiError> {
    let deadline = caller_deadline(&state, &headers);
    claim_one(&state, req, deadline).await.map(Json)
}

#[utoipa::path(
    post,
    path = "/v1/claims",
    tag = "filter",
    summary = r#"Several claims in one call"#,
    description = r#"Each claim is answered exactly as `/v1/claim` would answer it alone (they run together, as one group commit where they can): `answers[i]` is the status and document of `claims[i]` (a claim answer for 200, a problem document otherwise). The call itself answers 200 once every claim is answered, 400 for an empty list, more than 128 claims or a claim with `wait_ms` (a waiting claim would hold every other answer back), and 401/413/503 as the single claim does. The filter sends the claims that queued on a worker while its previous claim was on its way."#,
    request_body = ClaimBatchRequest,
    params(
        ("idempotency-caller-timeout-ms" = Option<u64>, Header, description = r#"As for `/v1/claim`, for the whole call."#)
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"OK"#, body = BatchResponse)
    )
)]
async fn claims(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(batch): ApiJson<ClaimBatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    batch_size("claims", batch.claims.len())?;
    refuse_waits(&batch.claims)?;
    let deadline = caller_deadline(&state, &headers);
    let prepared = prepare_claims(&state, batch.claims, deadline).await;
    // Those that reach the store go to it together: one statement where they fit in one.
    let jobs = prepared.iter().flatten().map(|p| p.job.clone()).collect();
    let stored = state.batcher().claims(jobs).await;
    Ok(Json(batch_answer(
        finish_claims(&state, prepared, stored).await,
    )))
}

/// A claim that waits would hold every other answer of its batch back.
fn refuse_waits(claims: &[ClaimRequest]) -> Result<(), ApiError> {
    if claims.iter().any(|c| c.wait_ms.is_some_and(|w| w > 0)) {
        return Err(bad(
            "claims: wait_ms is not accepted in a batch (send a claim that waits alone)",
        ));
    }
    Ok(())
}

/// Each claim of a batch checked, in order.
async fn prepare_claims(
    state: &AppState,
    claims: Vec<ClaimRequest>,
    deadline: tokio::time::Instant,
) -> Vec<Result<PreparedClaim, ApiError>> {
    futures::future::join_all(
        claims
            .into_iter()
            .map(|req| prepare_claim(state, req, deadline)),
    )
    .await
}

/// The answers to a batch's claims: `stored` holds the store's answers to those that passed
/// their checks, in order.
async fn finish_claims(
    state: &AppState,
    prepared: Vec<Result<PreparedClaim, ApiError>>,
    stored: Vec<Result<ClaimResponse, StoreError>>,
) -> Vec<Result<ClaimResponse, ApiError>> {
    let mut stored = stored.into_iter();
    futures::future::join_all(prepared.into_iter().map(|p| {
        let answer = p.map(|p| (stored.next().unwrap_or(Err(StoreError::Unanswered)), p));
        async {
            let (answer, p) = answer?;
            finish_claim(state, p, answer).await
        }
    }))
    .await
}

/// A claim checked and ready for the store, with what its answer needs.
struct PreparedClaim {
    job: ClaimJob,
    retention_s: u64,
    wait_ms: u64,
}

/// One claim, as `/v1/claim` runs it (`/v1/claims` runs the same two steps, with the store's
/// part of all its claims together).
async fn claim_one(
    state: &AppState,
    req: ClaimRequest,
    deadline: tokio::time::Instant,
) -> Result<ClaimResponse, ApiError> {
    let prepared = prepare_claim(state, req, deadline).await?;
    let answer = state.batcher().claim(prepared.job.clone()).await;
    finish_claim(state, prepared, answer).await
}

/// The claim's checks and its job for the store.
async fn prepare_claim(
    state: &AppState,
    req: ClaimRequest,
    deadline: tokio::time::Instant,
) -> Result<PreparedClaim, ApiError> {
    // Both addresses of the key, looked up by the claim's own statement (issue 34, path 9).
    let (scope, previous) =
        addresses_of(state, &req.namespace, &req.key, &req.subject, &req.endpoint)?;
    check_fingerprint(&req.fingerprint, &req.fingerprint_alg)?;
    if let Some(nonce) = &req.nonce {
        check_nonce(nonce)?;
    }
    let config = state.config();
    let retention_s = config.retention_for(req.retention_s);
    let job = ClaimJob {
        scope,
        subject: req.subject,
        endpoint: req.endpoint,
        fingerprint: state
            .scoper()
            .keyed_fingerprint(&req.fingerprint_alg, &req.fingerprint),
        fingerprint_alg: req.fingerprint_alg,
        lease_ms: config.lease_for(req.lease_ms),
        retention_ms: i64::try_from(retention_s.saturating_mul(1000)).unwrap_or(i64::MAX),
        take_over_unknown: req.on_unknown == OnUnknown::TakeOver,
        namespace: req.namespace,
        nonce: req.nonce,
        previous,
        deadline,
    };
    Ok(PreparedClaim {
        job,
        retention_s,
        wait_ms: config.wait_for(req.wait_ms),
    })
}

/// The store's answer to a claim, with a wait if it asked for one and this API's limits.
async fn finish_claim(
    state: &AppState,
    prepared: PreparedClaim,
    answer: Result<ClaimResponse, StoreError>,
) -> Result<ClaimResponse, ApiError> {
    let PreparedClaim {
        job,
        retention_s,
        wait_ms,
    } = prepared;
    let config = state.config();
    let scope = job.scope;
    let mut outcome = answer.inspect_err(|e| state.metrics().count_unopenable(e))?;
    let mut waited_ms = None;
    if wait_ms > 0 && matches!(outcome, ClaimResponse::InProgress { .. }) {
        (outcome, waited_ms) = wait_for_outcome(state, job, outcome, wait_ms).await?;
    }
    // The store's answer, with this API's limits and the wait it did.
    match &mut outcome {
        ClaimResponse::Claimed {
            max_body_bytes,
            retention_s: applied,
            ..
        } => {
            *max_body_bytes = Some(config.max_body_bytes as u64);
            *applied = Some(retention_s);
        }
        // Never past the lease (then the key can be reclaimed), never long for a poller.
        ClaimResponse::InProgress {
            retry_after_s,
            waited_ms: waited,
            ..
        } => {
            *retry_after_s = (*retry_after_s).clamp(1, config.retry_after_cap_s.max(1));
            *waited = waited_ms;
        }
        ClaimResponse::Completed {
            waited_ms: waited, ..
        } => *waited = waited_ms,
        ClaimResponse::Mismatch | ClaimResponse::Unknown => {}
    }
    state.metrics().claim(&outcome);
    tracing::debug!(scope = %log_label(&scope), outcome = outcome.label(), "claim");
    Ok(outcome)
}

/// The key is in progress and the claim may wait (`Prefer: wait`): it looks again when a write
/// of this process settles the record, or every `--wait-poll-ms`, until it is no
/// longer in progress or `wait_ms` have passed. Over `--max-waiters`: the first answer, at once.
/// With the outcome, how long it waited (none: it was refused a wait).
async fn wait_for_outcome(
    state: &AppState,
    job: ClaimJob,
    first: ClaimResponse,
    wait_ms: u64,
) -> Result<(ClaimResponse, Option<u64>), ApiError> {
    let Some(slot) = state.waiters().enter(job.scope) else {
        state.metrics().wait(metrics::WaitEnd::Refused);
        return Ok((first, None));
    };
    let started = tokio::time::Instant::now();
    let deadline = started + std::time::Duration::from_millis(wait_ms);
    let mut outcome = first;
    loop {
        let woken = slot.notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let now = tokio::time::Instant::now();
        if now >= deadline {
            state.metrics().wait(metrics::WaitEnd::TimedOut);
            return Ok((outcome, Some(elapsed_ms(started))));
        }
        let nap = (deadline - now).min(state.waiters().poll());
        tokio::select! {
            _ = &mut woken => {}
            _ = tokio::time::sleep(nap) => {}
        }
        outcome = state
            .batcher()
            .claim(job.clone())
            .await
            .inspect_err(|e| state.metrics().count_unopenable(e))?;
        if !matches!(outcome, ClaimResponse::InProgress { .. }) {
            state.metrics().wait(metrics::WaitEnd::Settled);
            return Ok((outcome, Some(elapsed_ms(started))));
        }
    }
}

fn elapsed_ms(since: tokio::time::Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

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
async fn heartbeat(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<HeartbeatRequest>,
) -> Result<Json<HeartbeatResponse>, ApiError> {
    // Where the record is (during a rotation, perhaps still under the previous secret), and
    // where this write moves it (the current secret's address).
    let (scope, current) = located(
        &state,
        &req.namespace,
        &req.key,
        &req.subject,
        &req.endpoint,
    )
    .await?;
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
async fn complete(
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
async fn completes(
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
async fn writes(
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

/// A batch holds 1 to [`contract::wire::MAX_BATCH_CLAIMS`] requests.
fn batch_size(what: &str, n: usize) -> Result<(), ApiError> {
    let most = contract::wire::MAX_BATCH_CLAIMS;
    if n == 0 || n > most {
        return Err(bad(format!("{what}: {n}; a batch has 1 to {most}")));
    }
    Ok(())
}

/// One answer per request, in order: the single call's status and document.
fn batch_answer<T: serde::Serialize>(answers: Vec<Result<T, ApiError>>) -> BatchResponse {
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
    let (at, current) =
        located(state, &req.namespace, &req.key, &req.subject, &req.endpoint).await?;
    check_token(req.token)?;
    let row = checked_response(state, req.response)?;
    // A record under the previous key secret moves to the current one before its response is
    // sealed there (its address is the seal's), so that it outlives the previous secret.
    let scope = if at != current
        && state
            .store()
            .move_to_current(&at, &current, req.token)
            .await?
    {
        current
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
async fn release(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ReleaseRequest>,
) -> Result<Json<WriteResponse>, ApiError> {
    // Where the record is (during a rotation, perhaps still under the previous secret), and
    // where this write moves it (the current secret's address).
    let (scope, current) = located(
        &state,
        &req.namespace,
        &req.key,
        &req.subject,
        &req.endpoint,
    )
    .await?;
    check_token(req.token)?;
    let ok = state
        .store()
        .release(&scope, &current, req.token, state.config().retention_ms())
        .await?;
    if !ok {
        return Err(fenced_out(&state, WriteOp::Release, &scope));
    }
    state.metrics().write_ok(WriteOp::Release);
    state.waiters().settled(&scope);
    Ok(Json(WriteResponse::released()))
}

fn check_nonce(nonce: &str) -> Result<(), ApiError> {
    if valid_nonce(nonce) {
        Ok(())
    } else {
        Err(bad(format!(
            "`nonce` must be 1 to {MAX_NONCE_LEN} visible ASCII characters"
        )))
    }
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
    let (scope, current) = located(
        &state,
        &req.namespace,
        &req.key,
        &req.subject,
        &req.endpoint,
    )
    .await?;
    check_nonce(&req.nonce)?;
    let done = state
        .store()
        .abandon(&scope, &current, &req.nonce, state.config().retention_ms())
        .await?;
    state.metrics().write_ok(WriteOp::Abandon);
    state.waiters().settled(&scope);
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
async fn outcome_unknown(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<UnknownRequest>,
) -> Result<Json<WriteResponse>, ApiError> {
    // Where the record is (during a rotation, perhaps still under the previous secret), and
    // where this write moves it (the current secret's address).
    let (scope, current) = located(
        &state,
        &req.namespace,
        &req.key,
        &req.subject,
        &req.endpoint,
    )
    .await?;
    check_token(req.token)?;
    let marked = state
        .store()
        .owner_unknown(&scope, &current, req.token, state.config().retention_ms())
        .await?;
    match marked {
        Some(true) => {
            state.metrics().write_ok(WriteOp::Unknown);
            state.waiters().settled(&scope);
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

fn fenced_out(state: &AppState, op: WriteOp, scope: &ScopeHash) -> ApiError {
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

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct RecordQuery {
    #[serde(default)]
    namespace: String,
    key: String,
    subject: String,
    endpoint: String,
}

#[utoipa::path(
    get,
    path = "/v1/records",
    tag = "filter",
    summary = r#"Operator read of one record (never the body)"#,
    params(
        RecordQuery
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = r#"The record"#, body = RecordView)
    )
)]
async fn record(
    State(state): State<AppState>,
    query: Result<Query<RecordQuery>, QueryRejection>,
) -> Result<Json<RecordView>, ApiError> {
    let Query(q) = query.map_err(|e| bad(format!("query: {}", e.body_text())))?;
    let scope = scope_of(&state, &q.namespace, &q.key, &q.subject, &q.endpoint).await?;
    let row = state.store().record(&scope).await?;
    let Some(r) = row else {
        return Err(ApiError::new(
            ProblemKind::NotFound,
            "no record for this key, subject and endpoint",
        ));
    };
    Ok(Json(record_view(r)))
}

/// What operators see of a record (never its body).
pub(crate) fn record_view(r: store::RecordRow) -> RecordView {
    RecordView {
        state: r.state,
        subject: r.subject,
        endpoint: r.endpoint,
        fingerprint_alg: r.fingerprint_alg,
        token: r.fencing_token,
        lease_remaining_ms: ms(r.lease_remaining_ms),
        age_ms: ms(r.age_ms),
        completed_age_ms: r.completed_age_ms.map(ms),
        response_status: r.response_status.and_then(|s| u16::try_from(s).ok()),
        replayable: r.response_replayable,
        expires_in_ms: ms(r.expires_in_ms),
        owner_seen_ms_ago: r.owner_seen_ms_ago.map(ms),
        lease_ms: ms(r.lease_ms),
    }
}

#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    summary = r#"Alive (no database access, no token)"#,
    responses(
        (status = 200, description = r#"ok"#, content_type = "text/plain")
    )
)]
async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 when the database takes writes, saying what it is (a primary, its timeline, its
/// synchronous standbys); 503 when it is unreachable or read-only (a failover under way).
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    summary = r#"The database takes writes (no token)"#,
    responses(
        (status = 200, description = r#"A primary, with its timeline and standbys: `ready: database primary, timeline 3, 1 synchronous standby(s)` (or `no standby`)."#, content_type = "text/plain")
    )
)]
async fn readyz(State(state): State<AppState>) -> Result<String, ApiError> {
    match state.store().readiness().await {
        Ok(Readiness::Primary {
            timeline,
            synchronous,
            sync_standbys,
            standbys,
        }) => {
            let replication = match (synchronous, sync_standbys) {
                (false, _) if standbys == 0 => "no standby".to_owned(),
                (false, _) => format!("{standbys} asynchronous standby(s)"),
                (true, 0) => {
                    "synchronous standby configured but none connected: commits wait".to_owned()
                }
                (true, n) => format!("{n} synchronous standby(s)"),
            };
            Ok(format!(
                "ready: database primary, timeline {timeline}, {replication}\n"
            ))
        }
        Ok(Readiness::ReadOnly) => {
            Err(ApiError::new(
                ProblemKind::StateUnavailable,
                "the database is read-only (a standby, or a failover under way); nothing can be recorded",
            ))
        }
        Err(e) => Err(e.into()),
    }
}

#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    summary = r#"Prometheus text format (no token)"#,
    description = r#"state_api_claims_total{outcome}, state_api_reclaims_total, state_api_fenced_out_total{op}, state_api_writes_total{op}, state_api_purged_rows_total, state_api_errors_total{kind}, state_api_request_duration_seconds{route} (histogram), state_api_db_pool_connections{state}, state_api_db_pool_max_connections."#,
    responses(
        (status = 200, description = r#"metrics"#, content_type = "text/plain")
    )
)]
async fn metrics_text(State(state): State<AppState>) -> Response {
    let pool = state.store().pool();
    let gauges = metrics::PoolGauges {
        size: pool.size(),
        idle: u32::try_from(pool.num_idle()).unwrap_or(u32::MAX),
        max: state.config().pool_size,
    };
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(metrics::CONTENT_TYPE),
        )],
        state.metrics().render(gauges),
    )
        .into_response()
}

#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    summary = r#"This document"#,
    responses(
        (status = 200, description = r#"OpenAPI 3.1"#, content_type = "application/json")
    )
)]
async fn openapi() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        crate::openapi::json(),
    )
        .into_response()
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        ProblemKind::MethodNotAllowed,
        "method not allowed on this route",
    )
}

async fn not_found() -> ApiError {
    ApiError::new(ProblemKind::NotFound, "no such route")
}
