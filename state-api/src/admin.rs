//! The admin API: on-call engineers see and resolve records without SQL. It has its own bearer
//! token (`--admin-token`): the filter's token gets 403, anything else 401. Every action is
//! written to the append-only `idempotency_audit` table in the transaction of the action, with
//! the actor, the reason (required) and the record before and after (never its body).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use contract::admin::{
    AdminAction, AdminActionResult, AdminRecord, AuditEntry, ListedRecord, ADMIN_PURGE_PATH,
    ADMIN_RECORDS_PATH, ADMIN_RECORD_PATH, ADMIN_RELEASE_PATH, ADMIN_RESOLVE_PATH,
};
use contract::wire::StoredResponse;
use contract::ProblemKind;
use serde::Deserialize;
use sqlx::types::Json as SqlJson;
use subtle::ConstantTimeEq as _;

use crate::http::error::ApiError;
use crate::http::extract::ApiJson;
use crate::http::records::record_view;
use crate::http::validate::{addresses_of, bad, checked_response, record_of, scope_of};
use crate::metrics::AdminOp;
use crate::scope::{log_label, ScopeHash};
use crate::sealing::Sealed;
use crate::store::{ms, StoreError};
use crate::AppState;

/// Longest `actor` and `reason` accepted.
const MAX_ACTOR_LEN: usize = 128;
const MAX_REASON_LEN: usize = 2_000;
/// Most records one listing returns.
const MAX_LIST: i64 = 1_000;

pub fn router(state: AppState) -> Router<AppState> {
    Router::new()
        .route(ADMIN_RECORD_PATH, get(show))
        .route(ADMIN_RECORDS_PATH, get(list))
        .route(ADMIN_RELEASE_PATH, post(release))
        .route(ADMIN_RESOLVE_PATH, post(resolve))
        .route(ADMIN_PURGE_PATH, post(purge))
        .route_layer(middleware::from_fn_with_state(state, require_admin_token))
}

/// The admin token, compared in constant time (both sides hashed): the filter's own token is
/// recognised and refused with 403, so a leaked filter token cannot act as an operator.
async fn require_admin_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| crate::token_digest(token.trim()));
    let Some(presented) = presented else {
        return unauthenticated(&state).into_response();
    };
    if let Some(admin) = state.admin_digest() {
        if bool::from(presented.ct_eq(admin)) {
            return next.run(req).await;
        }
    }
    if bool::from(presented.ct_eq(state.token_digest())) {
        return ApiError::new(
            ProblemKind::Forbidden,
            "the filter's token cannot use the admin API: use the admin token",
        )
        .into_response();
    }
    unauthenticated(&state).into_response()
}

fn unauthenticated(state: &AppState) -> ApiError {
    if state.admin_digest().is_none() {
        return ApiError::new(
            ProblemKind::Unauthenticated,
            "the admin API is off: start the state API with STATE_API_ADMIN_TOKEN",
        );
    }
    ApiError::new(
        ProblemKind::Unauthenticated,
        "a valid admin bearer token is required",
    )
}

// ---------------------------------------------------------------------------------------------
// Reading

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct RecordQuery {
    #[serde(default)]
    namespace: String,
    key: String,
    subject: String,
    endpoint: String,
    /// Include the stored body (base64) of a replayable completed record.
    #[serde(default)]
    body: bool,
}

fn hex(scope: &ScopeHash) -> String {
    scope.iter().map(|b| format!("{b:02x}")).collect()
}

/// A key's audit trail at its current address and, during a rotation of the key secret, at
/// its previous one (actions taken before the rotation are recorded there; those taken during
/// it, at the current one), in order.
async fn audit_of(
    state: &AppState,
    current: &ScopeHash,
    previous: Option<&ScopeHash>,
) -> Result<Vec<AuditEntry>, ApiError> {
    let previous = previous.unwrap_or(current);
    let rows = sqlx::query!(
        r#"SELECT id, to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS "at!",
           actor, action, reason, forced, before, after
    FROM idempotency_audit WHERE scope_hash IN ($1, $2) ORDER BY id"#,
        &current[..],
        &previous[..]
    )
    .fetch_all(state.store().pool())
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| AuditEntry {
            id: r.id,
            at: r.at,
            actor: r.actor,
            action: r.action,
            reason: r.reason,
            forced: r.forced,
            before: r.before,
            after: r.after,
        })
        .collect())
}

#[utoipa::path(
    get,
    path = "/v1/admin/record",
    tag = "admin",
    summary = r#"A record (never its body unless body=true) and its audit trail"#,
    params(
        RecordQuery
    ),
    security(("admin" = [])),
    responses(
        (status = 200, description = r#"The record and its audit trail"#, body = AdminRecord)
    )
)]
async fn show(
    State(state): State<AppState>,
    query: Result<Query<RecordQuery>, QueryRejection>,
) -> Result<Json<AdminRecord>, ApiError> {
    let Query(q) = query.map_err(|e| bad(format!("query: {}", e.body_text())))?;
    let (current, previous) = addresses_of(&state, &q.namespace, &q.key, &q.subject, &q.endpoint)?;
    let (scope, row) = record_of(&state, current, previous).await?;
    let audit = audit_of(&state, &current, previous.as_ref()).await?;
    if row.is_none() && audit.is_empty() {
        return Err(ApiError::new(
            ProblemKind::NotFound,
            "no record and no audit trail for this key, subject and endpoint",
        ));
    }
    let body_base64 = match (&row, q.body) {
        (Some(r), true) => replayable_body(&state, &scope, r.fencing_token)
            .await?
            .map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
        _ => None,
    };
    Ok(Json(AdminRecord {
        scope: hex(&scope),
        namespace: q.namespace,
        record: row.map(record_view),
        body_base64,
        audit,
    }))
}

/// The body of a replayable completed record, opened with the storage keys: the record read
/// just before (its fencing token), not another completion made since.
async fn replayable_body(
    state: &AppState,
    scope: &ScopeHash,
    token: i64,
) -> Result<Option<Vec<u8>>, ApiError> {
    let Some(r) = sqlx::query!(
        r#"SELECT fencing_token, response_status AS "status!", response_headers AS "headers!: SqlJson<Vec<(String, String)>>",
               response_body AS "body!", response_key_id
        FROM idempotency_records
        WHERE scope_hash = $1 AND fencing_token = $2 AND state = 'completed' AND response_replayable"#,
        &scope[..],
        token
    )
    .fetch_optional(state.store().pool())
    .await?
    else {
        return Ok(None);
    };
    let status = u16::try_from(r.status).map_err(|_| StoreError::Corrupt("response status"))?;
    let sealed = Sealed::read(r.response_key_id, r.headers.0, r.body);
    let opened = state
        .store()
        .sealer()
        .open(&scope[..], r.fencing_token, status, true, sealed)
        .map_err(StoreError::from)
        .inspect_err(|e| state.metrics().count_unopenable(e))?;
    Ok(Some(opened.body))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    /// `in_progress`, `unknown` or `completed`; all when absent.
    state: Option<String>,
    namespace: Option<String>,
    /// Only records created at least this long ago.
    #[serde(default)]
    older_than_s: u64,
    limit: Option<i64>,
}

#[utoipa::path(
    get,
    path = "/v1/admin/records",
    tag = "admin",
    summary = r#"Records by state and age, oldest first (no keys)"#,
    params(
        ListQuery
    ),
    security(("admin" = [])),
    responses(
        (status = 200, description = r#"The records"#, body = Vec<ListedRecord>)
    )
)]
async fn list(
    State(state): State<AppState>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<Vec<ListedRecord>>, ApiError> {
    let Query(q) = query.map_err(|e| bad(format!("query: {}", e.body_text())))?;
    if let Some(s) = &q.state {
        s.parse::<contract::wire::RecordState>()
            .map_err(|_| bad("`state` must be in_progress, unknown or completed"))?;
    }
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_LIST);
    let older = i64::try_from(q.older_than_s).unwrap_or(i64::MAX);
    let rows = sqlx::query!(
        r#"SELECT encode(r.scope_hash, 'hex') AS "scope!", r.namespace, r.subject, r.endpoint, r.state,
        r.fencing_token,
        GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (c.now - r.created_at)) * 1000))::bigint AS "age_ms!",
        CASE WHEN r.state = 'in_progress'
             THEN GREATEST(0, CEIL(EXTRACT(EPOCH FROM (r.lease_expires_at - c.now)) * 1000))::bigint
             ELSE 0 END AS "lease_remaining_ms!",
        GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (r.expires_at - c.now)) * 1000))::bigint AS "expires_in_ms!"
    FROM idempotency_records r CROSS JOIN LATERAL (SELECT clock_timestamp() AS now) c
    WHERE ($1::text IS NULL OR r.state = $1)
      AND ($2::text IS NULL OR r.namespace = $2)
      AND r.created_at <= c.now - $3::bigint * interval '1 second'
    ORDER BY r.created_at
    LIMIT $4"#,
        q.state,
        q.namespace,
        older,
        limit
    )
    .fetch_all(state.store().pool())
    .await?;
    rows.into_iter()
        .map(|r| {
            Ok(ListedRecord {
                scope: r.scope,
                namespace: r.namespace,
                subject: r.subject,
                endpoint: r.endpoint,
                state: r
                    .state
                    .parse()
                    .map_err(|_| StoreError::Corrupt("record state"))?,
                token: r.fencing_token,
                age_ms: ms(r.age_ms),
                lease_remaining_ms: ms(r.lease_remaining_ms),
                expires_in_ms: ms(r.expires_in_ms),
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()
        .map(Json)
        .map_err(ApiError::from)
}

// ---------------------------------------------------------------------------------------------
// Actions

fn check_action(a: &AdminAction) -> Result<(), ApiError> {
    let text = |name: &str, v: &str, max: usize| {
        if v.trim().is_empty() || v.len() > max || v.chars().any(char::is_control) {
            return Err(bad(format!(
                "`{name}` is required: 1 to {max} characters, no control characters"
            )));
        }
        Ok(())
    };
    text("reason", &a.reason, MAX_REASON_LEN)?;
    text("actor", &a.actor, MAX_ACTOR_LEN)
}

/// One action, in one transaction: the record locked and read, the change, the audit row.
async fn act(
    state: &AppState,
    op: AdminOp,
    mut a: AdminAction,
) -> Result<Json<AdminActionResult>, ApiError> {
    check_action(&a)?;
    let looked = scope_of(state, &a.namespace, &a.key, &a.subject, &a.endpoint).await?;
    let current = state
        .scoper()
        .hash_in(&a.namespace, &a.key, &a.subject, &a.endpoint);
    let stored = stored_response(state, op, a.response.take())?;
    let mut tx = state.store().pool().begin().await?;
    let row = sqlx::query!(
        r#"SELECT jsonb_build_object(
            'state', r.state, 'token', r.fencing_token, 'fingerprint_alg', r.fingerprint_alg,
            'lease_remaining_ms', CASE WHEN r.state = 'in_progress'
                THEN GREATEST(0, CEIL(EXTRACT(EPOCH FROM (r.lease_expires_at - clock_timestamp())) * 1000))::bigint
                ELSE 0 END,
            'response_status', r.response_status, 'replayable', r.response_replayable,
            'expires_at', to_char(r.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
        ) AS "snapshot!: SqlJson<serde_json::Value>",
        (r.state = 'in_progress' AND r.lease_expires_at > clock_timestamp()) AS "lease_live!",
        -- The owner's last sign of life (its claim, a heartbeat, its own mark) within a lease,
        -- counting its silence only while the database served (the lease guard, as a claim's
        -- reclaim and the purge count it: `idempotency_serving_since()`): an owner cut off by
        -- an outage or a failover may still be running, whatever the record's state says
        -- (issue 46, finding 4). The CASE asks the function only of an open record.
        CASE WHEN r.state = 'completed' THEN false
             ELSE GREATEST(COALESCE(r.owner_seen_at,
                    r.lease_expires_at - r.lease_ms * interval '1 millisecond'),
                    idempotency_serving_since())
                  + r.lease_ms * interval '1 millisecond' > clock_timestamp()
        END AS "owner_recent!",
        GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (clock_timestamp() - COALESCE(r.owner_seen_at,
            r.lease_expires_at - r.lease_ms * interval '1 millisecond'))) * 1000))::bigint AS "owner_seen_ms_ago!",
        CASE WHEN r.state = 'completed' THEN NULL
             ELSE GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (clock_timestamp()
                    - idempotency_serving_since())) * 1000))::bigint
        END AS "serving_ms",
        r.lease_ms,
        r.namespace, r.subject, r.endpoint, r.scope_hash
    FROM idempotency_records r WHERE r.scope_hash IN ($1, $2)
    ORDER BY r.scope_hash = $2 DESC LIMIT 1
    FOR UPDATE"#,
        &looked[..],
        &current[..]
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        return Err(ApiError::new(
            ProblemKind::NotFound,
            "no record for this key, subject and endpoint",
        ));
    };
    // Locked where it is: where it was looked up, or (during a rotation of the key secret) at
    // the current address, if an owner's write or a claim moved it there meanwhile.
    let mut scope = if row.scope_hash[..] == current[..] {
        current
    } else {
        looked
    };
    let (before, lease_live) = (row.snapshot, row.lease_live || row.owner_recent);
    let (namespace, subject, endpoint) = (row.namespace, row.subject, row.endpoint);
    refuse_unless_forced(
        op,
        &a,
        lease_live,
        &before.0,
        Silence {
            owner_seen_ms_ago: row.owner_seen_ms_ago,
            serving_ms: row.serving_ms,
            lease_ms: row.lease_ms,
        },
    )?;
    let after: Option<serde_json::Value> = match (op, stored) {
        (AdminOp::Resolve, Some(r)) => {
            let after = resolve_in(&mut tx, state, &scope, &current, &r).await?;
            // Resolved, it lives at the current address.
            scope = current;
            Some(after)
        }
        _ => {
            delete_in(&mut tx, &scope).await?;
            None
        }
    };
    let replaced = op == AdminOp::Resolve && before.0["state"] == "completed";
    let forced = a.force && (lease_live || replaced);
    // Recorded at the current address whatever the record's was: a release or purge of a
    // record still under the previous secret, recorded there, could not be found once that
    // secret is dropped.
    let audit_id = sqlx::query_scalar!(
        "INSERT INTO idempotency_audit
        (actor, action, reason, forced, scope_hash, namespace, subject, endpoint, before, after)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
    RETURNING id",
        a.actor.trim(),
        op.label(),
        a.reason.trim(),
        forced,
        &current[..],
        namespace,
        subject,
        endpoint,
        &before as _,
        after.as_ref().map(SqlJson) as _
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    state.metrics().admin(op);
    state.waiters().settled(&current);
    tracing::warn!(scope = %log_label(&scope), audit_scope = %log_label(&current), action = op.label(), audit_id, forced, actor = %a.actor.trim(), "operator action");
    Ok(Json(AdminActionResult {
        action: op.label().to_owned(),
        audit_id,
        before: Some(before.0),
        after,
    }))
}

/// The response a resolve stores (checked), and none for the other actions.
fn stored_response(
    state: &AppState,
    op: AdminOp,
    response: Option<StoredResponse>,
) -> Result<Option<StoredResponse>, ApiError> {
    match (op, response) {
        (AdminOp::Resolve, Some(r)) => Ok(Some(checked_response(state, r)?)),
        (AdminOp::Resolve, None) => Err(bad("resolve needs `response`: the outcome to store")),
        (_, Some(_)) => Err(bad("`response` is only used by resolve")),
        (_, None) => Ok(None),
    }
}

/// How long a record's owner has been silent, and the database serving (none: the record is
/// completed), against its lease.
struct Silence {
    owner_seen_ms_ago: i64,
    serving_ms: Option<i64>,
    lease_ms: i64,
}

/// An owner heard from within its lease (or not silent a whole lease while the database
/// served), or a completed record about to be resolved again: refused unless the operator
/// forces it.
fn refuse_unless_forced(
    op: AdminOp,
    a: &AdminAction,
    lease_live: bool,
    before: &serde_json::Value,
    silence: Silence,
) -> Result<(), ApiError> {
    if lease_live && !a.force {
        let Silence {
            owner_seen_ms_ago,
            serving_ms,
            lease_ms,
        } = silence;
        let detail = match serving_ms {
            Some(serving) if serving < owner_seen_ms_ago => format!(
                "the record's owner was heard from {owner_seen_ms_ago} ms ago, but the database has served only {serving} ms since it came back, less than the lease of {lease_ms} ms: the owner may not have been able to reach it and its request may still be running: wait, or pass force"
            ),
            _ => format!(
                "the record's owner was heard from {owner_seen_ms_ago} ms ago, within its lease of {lease_ms} ms: its request may still be running: wait, or pass force"
            ),
        };
        return Err(ApiError::new(ProblemKind::LeaseLive, detail));
    }
    if op == AdminOp::Resolve && before["state"] == "completed" && !a.force {
        return Err(ApiError::new(
            ProblemKind::AlreadyCompleted,
            "the record is already completed with an outcome: pass force to replace it",
        ));
    }
    Ok(())
}

/// Stores the operator's outcome on the locked record (found at `scope`, moved to `current`;
/// sealed like an owner's complete) under a new fencing token
/// ([`state_rules::operator::resolve`]) and returns the record as it is now. The new token
/// fences the owner out: if its request was still running after all, its late complete is
/// answered 409 fenced-out (nothing stored, nothing for its worker to cache and replay beside
/// the operator's outcome), not "already done" (issue 46, finding 5).
async fn resolve_in(
    conn: &mut sqlx::PgConnection,
    state: &AppState,
    scope: &ScopeHash,
    current: &ScopeHash,
    r: &StoredResponse,
) -> Result<serde_json::Value, ApiError> {
    let token =
        sqlx::query_scalar!(r#"SELECT nextval('idempotency_fencing_token_seq') AS "token!""#)
            .fetch_one(&mut *conn)
            .await?;
    // Stored at the current address, as every write moves the record there (a key has one
    // record, and this one is locked, so that address is free), so that the resolved answer
    // outlives the previous key secret; sealed under that address and the token.
    let sealed = state.store().sealer().seal(&current[..], token, r);
    sqlx::query!(
        "UPDATE idempotency_records
                SET state = 'completed', fencing_token = $8, claim_nonce = NULL, scope_hash = $9,
                    lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
                    response_status = $2, response_headers = $3, response_body = $4,
                    response_replayable = $5, response_key_id = $7,
                    completed_at = clock_timestamp(),
                    expires_at = clock_timestamp()
                        + COALESCE(retention_ms, $6::bigint) * interval '1 millisecond'
                WHERE scope_hash = $1",
        &scope[..],
        i32::from(r.status),
        SqlJson(&sealed.headers) as _,
        &sealed.body[..],
        r.replayable,
        state.config().retention_ms(),
        sealed.key_id,
        token,
        &current[..]
    )
    .execute(&mut *conn)
    .await?;
    let again = sqlx::query!(
        r#"SELECT jsonb_build_object(
                    'state', r.state, 'token', r.fencing_token, 'fingerprint_alg', r.fingerprint_alg,
                    'lease_remaining_ms', CASE WHEN r.state = 'in_progress'
                        THEN GREATEST(0, CEIL(EXTRACT(EPOCH FROM (r.lease_expires_at - clock_timestamp())) * 1000))::bigint
                        ELSE 0 END,
                    'response_status', r.response_status, 'replayable', r.response_replayable,
                    'expires_at', to_char(r.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
                ) AS "snapshot!: SqlJson<serde_json::Value>",
                (r.state = 'in_progress' AND r.lease_expires_at > clock_timestamp()) AS "lease_live!",
                r.namespace, r.subject, r.endpoint
            FROM idempotency_records r WHERE r.scope_hash = $1
            FOR UPDATE"#,
        &current[..]
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(again.snapshot.0)
}

/// Deletes the locked record (a release or a purge of one key).
async fn delete_in(conn: &mut sqlx::PgConnection, scope: &ScopeHash) -> Result<(), ApiError> {
    sqlx::query!(
        "DELETE FROM idempotency_records WHERE scope_hash = $1",
        &scope[..]
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

#[utoipa::path(
    post,
    path = "/v1/admin/release",
    tag = "admin",
    summary = r#"The key may run again: the record is deleted (audited)"#,
    request_body = AdminAction,
    security(("admin" = [])),
    responses(
        (status = 200, description = r#"Done; the audit row's id and the record before and after"#, body = AdminActionResult)
    )
)]
async fn release(
    State(state): State<AppState>,
    ApiJson(a): ApiJson<AdminAction>,
) -> Result<Json<AdminActionResult>, ApiError> {
    act(&state, AdminOp::Release, a).await
}

#[utoipa::path(
    post,
    path = "/v1/admin/resolve",
    tag = "admin",
    summary = r#"The record is completed with `response` (audited)"#,
    request_body = AdminAction,
    security(("admin" = [])),
    responses(
        (status = 200, description = r#"Done; the audit row's id and the record before and after"#, body = AdminActionResult)
    )
)]
async fn resolve(
    State(state): State<AppState>,
    ApiJson(a): ApiJson<AdminAction>,
) -> Result<Json<AdminActionResult>, ApiError> {
    act(&state, AdminOp::Resolve, a).await
}

#[utoipa::path(
    post,
    path = "/v1/admin/purge",
    tag = "admin",
    summary = r#"The record is deleted whatever its state (audited)"#,
    request_body = AdminAction,
    security(("admin" = [])),
    responses(
        (status = 200, description = r#"Done; the audit row's id and the record before and after"#, body = AdminActionResult)
    )
)]
async fn purge(
    State(state): State<AppState>,
    ApiJson(a): ApiJson<AdminAction>,
) -> Result<Json<AdminActionResult>, ApiError> {
    act(&state, AdminOp::Purge, a).await
}
