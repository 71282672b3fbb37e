//! The open routes of operations: `/healthz`, `/readyz` (the database takes writes) and `/metrics`.

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use contract::ProblemKind;

use crate::metrics;
use crate::store::Readiness;
use crate::AppState;

use super::error::ApiError;

#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    summary = r#"Alive (no database access, no token)"#,
    responses(
        (status = 200, description = r#"ok"#, content_type = "text/plain")
    )
)]
pub(crate) async fn healthz() -> &'static str {
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
pub(crate) async fn readyz(State(state): State<AppState>) -> Result<String, ApiError> {
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
    description = r#"state_api_claims_total{outcome}, state_api_reclaims_total, state_api_fenced_out_total{op}, state_api_writes_total{op}, state_api_purged_rows_total, state_api_errors_total{kind}, state_api_request_duration_seconds{route} (histogram), state_api_db_pool_connections{state}, state_api_db_pool_max_connections, state_api_db_connections_given_up_total."#,
    responses(
        (status = 200, description = r#"metrics"#, content_type = "text/plain")
    )
)]
pub(crate) async fn metrics_text(State(state): State<AppState>) -> Response {
    let (size, idle) = state.store().connections();
    let gauges = metrics::PoolGauges {
        size,
        idle,
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
