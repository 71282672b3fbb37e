//! The state API's routes in one table: `/v1/*` (the filter's calls and the operator's read)
//! behind the bearer token, the admin API behind its own, and the open routes of operations;
//! the answers to an unknown route or method; the layers every request passes through.

use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use contract::wire::{
    ABANDON_PATH, CLAIMS_PATH, CLAIM_PATH, COMPLETES_PATH, COMPLETE_PATH, HEARTBEAT_PATH,
    RECORDS_PATH, RELEASE_PATH, UNKNOWN_PATH, WRITES_PATH,
};
use contract::ProblemKind;

use crate::http::claims::{claim, claims};
use crate::http::error::ApiError;
use crate::http::extract::{observe, require_token};
use crate::http::health::{healthz, metrics_text, readyz};
use crate::http::records::record;
use crate::http::release::{abandon, outcome_unknown, release};
use crate::http::writes::{complete, completes, heartbeat, writes};
use crate::AppState;

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
        .route("/openapi.json", get(crate::openapi::openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
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
