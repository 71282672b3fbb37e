//! `/v1/records`: the operator's read of one record (never its body).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use contract::wire::RecordView;
use serde::Deserialize;

use crate::store::{self, ms};
use crate::AppState;

use super::error::ApiError;
use super::validate::{addresses_of, bad, record_of};

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
pub(crate) async fn record(
    State(state): State<AppState>,
    query: Result<Query<RecordQuery>, QueryRejection>,
) -> Result<Json<RecordView>, ApiError> {
    let Query(q) = query.map_err(|e| bad(format!("query: {}", e.body_text())))?;
    let (current, previous) = addresses_of(&state, &q.namespace, &q.key, &q.subject, &q.endpoint)?;
    let (_, row) = record_of(&state, current, previous).await?;
    let Some(r) = row else {
        return Err(ApiError::no_record());
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
