//! `/v1/claim` and `/v1/claims`: claim a key or learn why not, waiting for an outcome when asked.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use contract::wire::{BatchResponse, ClaimBatchRequest, ClaimRequest, ClaimResponse, OnUnknown};

use crate::batch::ClaimJob;
use crate::metrics;
use crate::scope::log_label;
use crate::store::StoreError;
use crate::AppState;

use super::error::{batch_answer, ApiError};
use super::extract::{caller_deadline, ApiJson};
use super::validate::{addresses_of, bad, batch_size, check_fingerprint, check_nonce};

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
pub(crate) async fn claim(
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
pub(crate) async fn claims(
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
pub(crate) fn refuse_waits(claims: &[ClaimRequest]) -> Result<(), ApiError> {
    if claims.iter().any(|c| c.wait_ms.is_some_and(|w| w > 0)) {
        return Err(bad(
            "claims: wait_ms is not accepted in a batch (send a claim that waits alone)",
        ));
    }
    Ok(())
}

/// Each claim of a batch checked, in order.
pub(crate) async fn prepare_claims(
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
pub(crate) async fn finish_claims(
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
pub(crate) struct PreparedClaim {
    pub(crate) job: ClaimJob,
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
    let poll = state.waiters().poll();
    // Claims that began to wait together would look again together, every poll: a burst as
    // large as the crowd each time, over the group commit's queue bound. Each one's first look
    // comes at a point of its own within the poll.
    let mut next_look = first_look_within(poll);
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
        let nap = (deadline - now).min(next_look);
        next_look = poll;
        tokio::select! {
            _ = &mut woken => {}
            _ = tokio::time::sleep(nap) => {}
        }
        outcome = match state.batcher().claim(job.clone()).await {
            Ok(now_seen) => now_seen,
            // A look that certainly wrote nothing (the queue full as a crowd of waiters woke
            // at once, the pool busy past its acquire timeout, compare-and-sets all lost) does
            // not end the wait: the next look comes at the next poll or wake-up, and at the
            // deadline the last answer stands (in progress: 409 and Retry-After).
            Err(e) if look_wrote_nothing(&e) => {
                tracing::debug!(error = %e, "a waiting claim could not look again; it waits on");
                continue;
            }
            // Any other failure of a look (a stall, a broken connection, a failed batch) may
            // have committed a claim whose answer is lost: waiting on would wait on that very
            // record, answer in progress at the deadline, and leave the key held for nobody
            // (issue 46, finding 1). The wait ends with the error (503): the filter gives the
            // claim back by its nonce (`/v1/abandon`) and answers or retries. A caller gone
            // ends it too.
            Err(e) => {
                if e.is_unavailable() && !matches!(e, StoreError::CallerGone) {
                    state.metrics().wait(metrics::WaitEnd::Failed);
                    tracing::info!(error = %e, "a waiting claim's look may have committed without its answer: the wait ends with 503");
                }
                state.metrics().count_unopenable(&e);
                return Err(e.into());
            }
        };
        if !matches!(outcome, ClaimResponse::InProgress { .. }) {
            state.metrics().wait(metrics::WaitEnd::Settled);
            return Ok((outcome, Some(elapsed_ms(started))));
        }
    }
}

/// A look's error after which the claim certainly wrote nothing: it never reached Postgres
/// (the group commit's queue full; no connection within the acquire timeout, before anything
/// was sent), or it lost every compare-and-set. Before issue 46's fix every unavailable error
/// counted so (`contract::undo::Fix::WaitLook`).
fn look_wrote_nothing(e: &StoreError) -> bool {
    if contract::undo::undone(contract::undo::Fix::WaitLook) {
        return e.is_unavailable() && !matches!(e, StoreError::CallerGone);
    }
    match e {
        StoreError::Overloaded | StoreError::Contention => true,
        StoreError::Db(sqlx::Error::PoolTimedOut) => true,
        StoreError::Batch(inner) => look_wrote_nothing(inner),
        _ => false,
    }
}

/// A point within `poll`, different for each call.
fn first_look_within(poll: std::time::Duration) -> std::time::Duration {
    use std::hash::BuildHasher;
    let r = std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now());
    poll.mul_f64((r % 1_000) as f64 / 1_000.0)
}

fn elapsed_ms(since: tokio::time::Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}
