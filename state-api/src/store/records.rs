//! Reading one record: whether it exists (a lookup during a rotation of the key secret) and
//! the operator's view of it.

use contract::wire::RecordState;

use super::{Store, StoreError};
use crate::scope::ScopeHash;

/// The operator's view of one record (no body).
#[derive(Debug, Clone)]
pub struct RecordRow {
    pub state: RecordState,
    pub subject: String,
    pub endpoint: String,
    pub fingerprint_alg: String,
    pub fencing_token: i64,
    pub lease_remaining_ms: i64,
    pub age_ms: i64,
    pub completed_age_ms: Option<i64>,
    pub response_status: Option<i32>,
    pub response_replayable: Option<bool>,
    pub expires_in_ms: i64,
    /// In progress or unknown: since its owner was last heard from.
    pub owner_seen_ms_ago: Option<i64>,
    pub lease_ms: i64,
}

impl Store {
    /// Whether a record lives at `scope` (a lookup during a rotation of the key secret).
    pub async fn exists(&self, scope: &ScopeHash) -> Result<bool, StoreError> {
        Ok(self
            .on_conn(async |conn| {
                sqlx::query_scalar!(
                    "SELECT 1 AS one FROM idempotency_records WHERE scope_hash = $1",
                    &scope[..]
                )
                .fetch_optional(conn)
                .await
            })
            .await?
            .is_some())
    }

    /// The record of a key at `current`, or during a rotation of the key secret at `previous`,
    /// and the address it was found at. One statement reads both addresses, so a record that
    /// a write moves from the previous address to the current one meanwhile is found at one of
    /// them (two reads, a lookup then the read, could miss it at both and say it is absent: a
    /// client told so might take a new key for a request that ran).
    pub async fn record(
        &self,
        current: &ScopeHash,
        previous: Option<&ScopeHash>,
    ) -> Result<Option<(ScopeHash, RecordRow)>, StoreError> {
        let previous = previous.unwrap_or(current);
        let Some(r) = self.on_conn(async |conn| sqlx::query!(r#"
    SELECT r.scope_hash, r.state, r.subject, r.endpoint, r.fingerprint_alg, r.fencing_token,
        CASE WHEN r.state = 'in_progress'
             THEN GREATEST(0, CEIL(EXTRACT(EPOCH FROM (r.lease_expires_at - c.now)) * 1000))::bigint
             ELSE 0 END AS "lease_remaining_ms!",
        GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (c.now - r.created_at)) * 1000))::bigint AS "age_ms!",
        -- GREATEST ignores NULLs: keep NULL for records not completed.
        CASE WHEN r.completed_at IS NOT NULL
             THEN GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (c.now - r.completed_at)) * 1000))::bigint
             END AS completed_age_ms,
        r.response_status, r.response_replayable,
        GREATEST(0, CEIL(EXTRACT(EPOCH FROM (r.expires_at - c.now)) * 1000))::bigint AS "expires_in_ms!",
        CASE WHEN r.state <> 'completed'
             THEN GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (c.now - COALESCE(r.owner_seen_at, r.lease_expires_at - r.lease_ms * interval '1 millisecond'))) * 1000))::bigint
             END AS owner_seen_ms_ago,
        r.lease_ms
    FROM idempotency_records r CROSS JOIN LATERAL (SELECT clock_timestamp() AS now) c
    WHERE r.scope_hash IN ($1, $2)
    ORDER BY r.scope_hash = $1 DESC
    LIMIT 1"#, &current[..], &previous[..])
            .fetch_optional(conn).await)
            .await?
        else {
            return Ok(None);
        };
        let at = if r.scope_hash[..] == previous[..] {
            *previous
        } else {
            *current
        };
        Ok(Some((
            at,
            RecordRow {
                state: r
                    .state
                    .parse()
                    .map_err(|_| StoreError::Corrupt("record state"))?,
                subject: r.subject,
                endpoint: r.endpoint,
                fingerprint_alg: r.fingerprint_alg,
                fencing_token: r.fencing_token,
                lease_remaining_ms: r.lease_remaining_ms,
                age_ms: r.age_ms,
                completed_age_ms: r.completed_age_ms,
                response_status: r.response_status,
                response_replayable: r.response_replayable,
                expires_in_ms: r.expires_in_ms,
                owner_seen_ms_ago: r.owner_seen_ms_ago,
                lease_ms: r.lease_ms,
            },
        )))
    }
}
