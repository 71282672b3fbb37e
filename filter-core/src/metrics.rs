//! The filter's Envoy counters. Defined once per worker VM in `on_configure`
//! (`proxy_define_metric`); Envoy exports them under `wasmcustom.` (see docs/filter.md for the
//! names as they appear in `/stats/prometheus`).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// A key was claimed and the request forwarded.
    Claimed,
    /// A stored response was replayed.
    Replayed,
    /// 409: the key is held by a running request.
    InProgress409,
    /// 422: the key was used for a different request.
    Mismatch422,
    /// 400: missing or malformed Idempotency-Key header.
    BadKey400,
    /// 400: duplicate member in a JSON body.
    BadBody400,
    /// 413: request body over `max_request_body_bytes`.
    TooLarge413,
    /// 401: no authenticated subject on a protected route.
    Unauthenticated401,
    /// Any failed call to the state API (unreachable, non-2xx, unreadable answer).
    StateApiErrors,
    /// A key was given back (upstream never reached, or 5xx on a `release` route).
    Released,
    /// An upstream response was stored.
    Completed,
    /// A write or heartbeat was refused because a newer claim took the key over.
    FencedOut,
    /// The state API was unavailable and the route forwarded anyway.
    FailedOpen,
    /// A retry hit a completed key whose response was too large to keep (409).
    NotReplayable,
    /// A stored response had no body because it was over `max_stored_body_bytes`.
    StoredWithoutBody,
    /// A lease was extended by the heartbeat.
    Heartbeats,
    /// Requests answered from the worker's replay cache without a callout (replays, and the
    /// 422 / 409 not replayable answers it can give too; each also counts in its own counter).
    ReplayCacheHits,
    /// 409s answered from memory for a key the state API had just reported in progress (each
    /// also counts in `in_progress_409`).
    InFlightCacheHits,
    /// Completes retried by the worker after the response went on.
    CompleteRetries,
    /// Completes given up (retry bound, memory bound, or refused): the key stays in progress
    /// until its lease runs out.
    CompleteGaveUp,
    /// With `complete_in_background`: completes a stream stored itself, holding its response,
    /// because the worker's `complete_retry_bytes` were in use.
    CompleteHeld,
    /// 414: a protected request whose method and path are longer than a record holds.
    EndpointTooLong414,
    /// The state API refused a claim (a 4xx): answered 500, never forwarded, even where the
    /// route fails open (a configuration or contract error, not an outage).
    ClaimRefused,
    /// The state API refused a complete (a 4xx): a minimal outcome (status, not replayable) was
    /// stored instead.
    CompleteRefused,
    /// A forwarded request whose outcome the filter never saw (its stream ended first, or Envoy
    /// answered a reset or timeout for the upstream): its record was marked unknown.
    OutcomeUnknown,
    /// 409 `outcome-unknown`: a retry of a request whose outcome is unknown, on a `hold` route.
    OutcomeUnknown409,
    /// Reconciliations by what the upstream said: it executed (its outcome is stored and
    /// replayed), it is still running (409), it never ran (the request runs now), or it could
    /// not tell (503).
    ReconcileExecuted,
    ReconcileRunning,
    ReconcileNotExecuted,
    ReconcileFailed,
    /// A request whose outcome was unknown, run again on a `reexecute` route.
    Reexecuted,
    /// Retries that asked to wait (`Prefer: wait`) for a running key: answered with the
    /// replay once it finished (by the state API, or woken by this worker's own complete),
    /// still running at the deadline (409), or refused a wait over the worker's or the state
    /// API's bound of waiters (409 at once).
    WaitReplayed,
    WaitTimedOut,
    WaitRefused,
    /// `/v1/claims` callouts (claims that queued while this worker's previous claim was on
    /// its way), and the claims they carried.
    ClaimBatches,
    ClaimsBatched,
    /// `/v1/completes` callouts (held responses whose complete queued while another was on
    /// its way), and the completes they carried.
    CompleteBatches,
    CompletesBatched,
    /// A claim granted for a stream that had ended while its batch was on the way: nothing
    /// was forwarded, so the key is given back (each also counts in `released` once stored).
    ClaimedForEndedStream,
    /// A claim whose answer never came back (timed out, cancelled with its stream, unreadable)
    /// given back by its nonce (`/v1/abandon`): nothing was forwarded under it.
    ClaimsAbandoned,
    /// 503: a protected request whose body would take the worker over `max_buffered_bytes`
    /// (nothing forwarded or claimed).
    BuffersFull503,
    /// 503: a protected request whose body would take its subject's requests on the worker over
    /// `max_buffered_bytes_per_subject` (nothing forwarded or claimed): one caller holding its
    /// share, slow or unfinished bodies most often.
    SubjectBuffersFull503,
    /// 503: a protected request whose body would reach into the last part of the worker's
    /// bound kept for callers who hold little (`Config::buffer_reserve`) while its subject
    /// would then hold more than `RESERVE_PER_SUBJECT` (nothing forwarded or claimed): many
    /// callers' large bodies held at once, most often.
    ReserveBuffersFull503,
    /// Key churn: a request (subject, endpoint, fingerprint) claimed under another key than
    /// the one it came under within the last minute on this worker (a client that makes a new
    /// key for each retry).
    KeyChurn,
}

impl Metric {
    pub const ALL: [Metric; 44] = [
        Metric::Claimed,
        Metric::Replayed,
        Metric::InProgress409,
        Metric::Mismatch422,
        Metric::BadKey400,
        Metric::BadBody400,
        Metric::TooLarge413,
        Metric::Unauthenticated401,
        Metric::StateApiErrors,
        Metric::Released,
        Metric::Completed,
        Metric::FencedOut,
        Metric::FailedOpen,
        Metric::NotReplayable,
        Metric::StoredWithoutBody,
        Metric::Heartbeats,
        Metric::ReplayCacheHits,
        Metric::InFlightCacheHits,
        Metric::CompleteRetries,
        Metric::CompleteGaveUp,
        Metric::CompleteHeld,
        Metric::EndpointTooLong414,
        Metric::ClaimRefused,
        Metric::CompleteRefused,
        Metric::OutcomeUnknown,
        Metric::OutcomeUnknown409,
        Metric::ReconcileExecuted,
        Metric::ReconcileRunning,
        Metric::ReconcileNotExecuted,
        Metric::ReconcileFailed,
        Metric::Reexecuted,
        Metric::WaitReplayed,
        Metric::WaitTimedOut,
        Metric::WaitRefused,
        Metric::ClaimBatches,
        Metric::ClaimsBatched,
        Metric::CompleteBatches,
        Metric::CompletesBatched,
        Metric::ClaimedForEndedStream,
        Metric::ClaimsAbandoned,
        Metric::BuffersFull503,
        Metric::SubjectBuffersFull503,
        Metric::ReserveBuffersFull503,
        Metric::KeyChurn,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Metric::Claimed => "idempotency.claimed",
            Metric::Replayed => "idempotency.replayed",
            Metric::InProgress409 => "idempotency.in_progress_409",
            Metric::Mismatch422 => "idempotency.mismatch_422",
            Metric::BadKey400 => "idempotency.bad_key_400",
            Metric::BadBody400 => "idempotency.bad_body_400",
            Metric::TooLarge413 => "idempotency.too_large_413",
            Metric::Unauthenticated401 => "idempotency.unauthenticated_401",
            Metric::StateApiErrors => "idempotency.state_api_errors",
            Metric::Released => "idempotency.released",
            Metric::Completed => "idempotency.completed",
            Metric::FencedOut => "idempotency.fenced_out",
            Metric::FailedOpen => "idempotency.failed_open",
            Metric::NotReplayable => "idempotency.not_replayable",
            Metric::StoredWithoutBody => "idempotency.stored_without_body",
            Metric::Heartbeats => "idempotency.heartbeats",
            Metric::ReplayCacheHits => "idempotency.replay_cache_hits",
            Metric::InFlightCacheHits => "idempotency.in_flight_cache_hits",
            Metric::CompleteRetries => "idempotency.complete_retries",
            Metric::CompleteGaveUp => "idempotency.complete_gave_up",
            Metric::CompleteHeld => "idempotency.complete_held",
            Metric::EndpointTooLong414 => "idempotency.endpoint_too_long_414",
            Metric::ClaimRefused => "idempotency.claim_refused",
            Metric::CompleteRefused => "idempotency.complete_refused",
            Metric::OutcomeUnknown => "idempotency.outcome_unknown",
            Metric::OutcomeUnknown409 => "idempotency.outcome_unknown_409",
            Metric::ReconcileExecuted => "idempotency.reconcile_executed",
            Metric::ReconcileRunning => "idempotency.reconcile_running",
            Metric::ReconcileNotExecuted => "idempotency.reconcile_not_executed",
            Metric::ReconcileFailed => "idempotency.reconcile_failed",
            Metric::Reexecuted => "idempotency.reexecuted",
            Metric::WaitReplayed => "idempotency.wait_replayed",
            Metric::WaitTimedOut => "idempotency.wait_timed_out",
            Metric::WaitRefused => "idempotency.wait_refused",
            Metric::ClaimBatches => "idempotency.claim_batches",
            Metric::ClaimsBatched => "idempotency.claims_batched",
            Metric::CompleteBatches => "idempotency.complete_batches",
            Metric::CompletesBatched => "idempotency.completes_batched",
            Metric::ClaimedForEndedStream => "idempotency.claimed_for_ended_stream",
            Metric::ClaimsAbandoned => "idempotency.claims_abandoned",
            Metric::BuffersFull503 => "idempotency.buffers_full_503",
            Metric::SubjectBuffersFull503 => "idempotency.subject_buffers_full_503",
            Metric::ReserveBuffersFull503 => "idempotency.reserve_buffers_full_503",
            Metric::KeyChurn => "idempotency.key_churn",
        }
    }

    pub const fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn all_is_in_index_order_and_names_are_unique() {
        for (i, m) in Metric::ALL.iter().enumerate() {
            assert_eq!(m.index(), i);
            assert!(m.name().starts_with("idempotency."));
        }
        let mut names: Vec<_> = Metric::ALL.iter().map(|m| m.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Metric::ALL.len());
    }
}
