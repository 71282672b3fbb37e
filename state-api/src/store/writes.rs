//! The owners' writes, each fenced by the token of its claim: heartbeat, complete, release,
//! outcome unknown; and the abandon of a claim whose answer never arrived (by its nonce).

use sqlx::types::Json;

use contract::wire::StoredResponse;
use state_rules::writes::{Abandoned, Beat};

use super::{ms, Store, StoreError};
use crate::scope::ScopeHash;

/// What a complete did. `expires_in_ms`: until the record's retention expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteResult {
    Done {
        expires_in_ms: u64,
    },
    /// The same owner completed before (a retried complete): nothing changed.
    AlreadyDone {
        expires_in_ms: u64,
    },
    /// No record with this token in progress: a newer owner took over, or it is gone.
    FencedOut,
}

impl Store {
    /// Extends the lease of the owner holding `token` while its record is in progress, and the
    /// record's expiry to a retention (its own, else `retention_ms`) past the new lease
    /// ([`state_rules::writes::heartbeat`]). A record marked unknown stays so: a mark outranks
    /// every heartbeat sent before it.
    pub async fn heartbeat(
        &self,
        scope: &ScopeHash,
        current: &ScopeHash,
        token: i64,
        lease_ms: u64,
        retention_ms: i64,
    ) -> Result<Beat, StoreError> {
        let lease = i64::try_from(lease_ms).unwrap_or(i64::MAX);
        let row = self.on_conn(async |conn| sqlx::query_scalar!(
            "UPDATE idempotency_records
    SET lease_ms = $3, owner_seen_at = clock_timestamp(), scope_hash = CASE WHEN scope_hash <> $5 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $5) THEN $5 ELSE scope_hash END,
        lease_expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond',
        expires_at = GREATEST(expires_at, clock_timestamp()
            + ($3::bigint + COALESCE(retention_ms, $4::bigint)) * interval '1 millisecond')
    WHERE scope_hash IN ($1, $5) AND fencing_token = $2 AND state = 'in_progress'
    RETURNING fencing_token",
            &scope[..],
            token,
            lease,
            retention_ms,
            &current[..]
        )
        .fetch_optional(conn).await)
        .await?;
        if row.is_some() {
            return Ok(Beat::Extended);
        }
        let marked = self
            .on_conn(async |conn| {
                sqlx::query_scalar!(
                    "SELECT 1 AS one FROM idempotency_records
    WHERE scope_hash IN ($1, $3) AND fencing_token = $2 AND state = 'unknown'",
                    &scope[..],
                    token,
                    &current[..]
                )
                .fetch_optional(conn)
                .await
            })
            .await?;
        Ok(if marked.is_some() {
            Beat::LeaseEnded
        } else {
            Beat::FencedOut
        })
    }

    /// Stores the response of the owner holding `token`.
    pub async fn complete(
        &self,
        scope: &ScopeHash,
        token: i64,
        response: &StoredResponse,
        retention_ms: i64,
    ) -> Result<WriteResult, StoreError> {
        let sealed = self.sealer.seal(&scope[..], token, response);
        let done = self.on_conn(async |conn| sqlx::query_scalar!(
            r#"UPDATE idempotency_records
            SET state = 'completed',
                response_status = $3, response_headers = $4, response_body = $5,
                response_replayable = $6, response_key_id = $8,
                completed_at = clock_timestamp(),
                -- The record's own retention (its claim's), else this process's default;
                -- within the lease the claim's expiry stands (see CLAIM_SQL).
                expires_at = GREATEST(expires_at, clock_timestamp()
                    + COALESCE(retention_ms, $7::bigint) * interval '1 millisecond')
            WHERE scope_hash = $1 AND fencing_token = $2 AND state IN ('in_progress', 'unknown')
            RETURNING GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000))::bigint AS "expires_in_ms!""#,
            &scope[..],
            token,
            i32::from(response.status),
            Json(&sealed.headers) as _,
            &sealed.body[..],
            response.replayable,
            retention_ms,
            sealed.key_id
        )
        .fetch_optional(conn).await)
        .await?;
        match done {
            Some(expires_in_ms) => Ok(WriteResult::Done {
                expires_in_ms: ms(expires_in_ms),
            }),
            None => self.complete_unmatched(scope, scope, token).await,
        }
    }

    /// Moves the open record of the owner holding `token` from `at` (the previous key secret's
    /// address) to `current`, unless a record is there already: what every write does in its
    /// own statement, done first for a complete, whose response is sealed under the address it
    /// is stored at. Returns where the record holding `token` is now: `current` when moved, or
    /// when another write of the same claim (a heartbeat) moved it after `at` was looked up
    /// (seed 439267646771); `at` when it stays; `None`: no record holds `token`. A record once
    /// at `current` never moves back, and a key has one record, so the address holds until the
    /// complete's own statement.
    pub async fn move_to_current(
        &self,
        at: &ScopeHash,
        current: &ScopeHash,
        token: i64,
    ) -> Result<Option<ScopeHash>, StoreError> {
        let moved = self
            .on_conn(async |conn| {
                sqlx::query_scalar!(
                    "UPDATE idempotency_records SET scope_hash = $2
            WHERE scope_hash = $1 AND fencing_token = $3 AND state IN ('in_progress', 'unknown')
              AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $2)
            RETURNING fencing_token",
                    &at[..],
                    &current[..],
                    token
                )
                .fetch_optional(conn)
                .await
            })
            .await?;
        if moved.is_some() {
            return Ok(Some(*current));
        }
        // Not moved: where the record holding the token is. A statement of its own, so that its
        // snapshot sees a move that committed while the UPDATE above waited for its row (one
        // statement's snapshot would still show the record at `at`).
        let found = self
            .on_conn(async |conn| {
                sqlx::query_scalar!(
                    "SELECT scope_hash FROM idempotency_records
            WHERE scope_hash IN ($1, $2) AND fencing_token = $3",
                    &at[..],
                    &current[..],
                    token
                )
                .fetch_optional(conn)
                .await
            })
            .await?;
        Ok(found.map(|bytes| {
            if bytes[..] == current[..] {
                *current
            } else {
                *at
            }
        }))
    }

    /// After a complete whose UPDATE matched no row: a retried complete of the same owner (its
    /// first answer was lost) is not a conflict; anything else is fenced out. The record is
    /// looked for at `scope` and at `current` (the same address but during a rotation).
    pub async fn complete_unmatched(
        &self,
        scope: &ScopeHash,
        current: &ScopeHash,
        token: i64,
    ) -> Result<WriteResult, StoreError> {
        // A retried complete of the same owner (its first answer was lost): the record as stored.
        let same_owner_done = self.on_conn(async |conn| sqlx::query_scalar!(
            r#"SELECT GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000))::bigint AS "expires_in_ms!"
            FROM idempotency_records
            WHERE scope_hash IN ($1, $3) AND fencing_token = $2 AND state = 'completed'"#,
            &scope[..],
            token,
            &current[..]
        )
        .fetch_optional(conn).await)
        .await?;
        Ok(match same_owner_done {
            Some(expires_in_ms) => WriteResult::AlreadyDone {
                expires_in_ms: ms(expires_in_ms),
            },
            None => WriteResult::FencedOut,
        })
    }

    /// The owner holding `token` lost sight of its request: the record is unknown. `None`:
    /// fenced out; `Some(false)`: it was completed by this owner already.
    pub async fn owner_unknown(
        &self,
        scope: &ScopeHash,
        current: &ScopeHash,
        token: i64,
        retention_ms: i64,
    ) -> Result<Option<bool>, StoreError> {
        // The owner lost sight of its forwarded request (`/v1/unknown`), fenced by its token. The
        // lease ends now: nothing heartbeats it any more; it is kept the unknown horizon ($5, at
        // least its retention) from the mark (issue 46, finding 8).
        let marked = self.on_conn(async |conn| sqlx::query_scalar!(
            "UPDATE idempotency_records
    SET state = 'unknown', owner_seen_at = clock_timestamp(), scope_hash = CASE WHEN scope_hash <> $4 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $4) THEN $4 ELSE scope_hash END,
        lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
        expires_at = GREATEST(expires_at, clock_timestamp()
            + GREATEST(COALESCE(retention_ms, $3::bigint), $5::bigint) * interval '1 millisecond')
    WHERE scope_hash IN ($1, $4) AND fencing_token = $2 AND state IN ('in_progress', 'unknown')
    RETURNING fencing_token",
            &scope[..],
            token,
            retention_ms,
            &current[..],
            self.unknown_retention_ms
        )
        .fetch_optional(conn).await)
        .await?;
        if marked.is_some() {
            return Ok(Some(true));
        }
        Ok(
            match self.complete_unmatched(scope, current, token).await? {
                WriteResult::AlreadyDone { .. } => Some(false),
                _ => None,
            },
        )
    }

    /// Deletes the in-progress record of the owner holding `token`. `false`: fenced out.
    pub async fn release(
        &self,
        scope: &ScopeHash,
        current: &ScopeHash,
        token: i64,
        retention_ms: i64,
    ) -> Result<bool, StoreError> {
        // Gives the key back: deleted, unless an earlier attempt's outcome is unknown (this owner took
        // it over): then it is unknown again, since only this owner's attempt certainly did not run,
        // and kept the unknown horizon ($5) from now.
        let row = self.on_conn(async |conn| sqlx::query_scalar!(
            r#"WITH kept AS (
        UPDATE idempotency_records
        SET state = 'unknown', lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
            owner_seen_at = clock_timestamp(), scope_hash = CASE WHEN scope_hash <> $4 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $4) THEN $4 ELSE scope_hash END,
            expires_at = GREATEST(expires_at, clock_timestamp()
                + GREATEST(COALESCE(retention_ms, $3::bigint), $5::bigint) * interval '1 millisecond')
        WHERE scope_hash IN ($1, $4) AND fencing_token = $2 AND state IN ('in_progress', 'unknown')
          AND unknown_before
        RETURNING fencing_token
    ), freed AS (
        DELETE FROM idempotency_records
        WHERE scope_hash IN ($1, $4) AND fencing_token = $2 AND state IN ('in_progress', 'unknown')
          AND NOT unknown_before
        RETURNING fencing_token
    )
    SELECT fencing_token AS "fencing_token!" FROM kept
    UNION ALL SELECT fencing_token FROM freed"#,
            &scope[..],
            token,
            retention_ms,
            &current[..],
            self.unknown_retention_ms
        )
        .fetch_optional(conn).await)
        .await?;
        Ok(row.is_some())
    }

    /// Gives back the record that the claim attempt named `nonce` made or took over, its answer
    /// never having reached the filter ([`state_rules::writes::abandon`]): deleted, or unknown
    /// again (kept the unknown horizon) where it was taken over from an earlier attempt whose
    /// outcome is unknown. The
    /// nonce's row is marked abandoned first, in the same transaction, so that the attempt, if
    /// it has not got here yet (behind a slow database), never commits.
    ///
    /// Two statements in one transaction (issue 46, finding 2): the first takes the nonce's row
    /// (waiting, through the unique index, for a claim of that nonce still in flight to commit
    /// or roll back: `claim_nonce!`); the second, with a snapshot taken after that, finds the
    /// record such a claim committed and gives it back. One statement could not: a record
    /// committed during it is not in its snapshot. The record is looked for at both of its
    /// addresses during a rotation of the key secret: a claim that took it over may have moved
    /// it to the current secret's after the abandon located it.
    pub async fn abandon(
        &self,
        scope: &ScopeHash,
        current: &ScopeHash,
        nonce: &str,
        retention_ms: i64,
    ) -> Result<Abandoned, StoreError> {
        let row = self.on_conn(async |conn| {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            // The second statement must see what committed while the first waited: a snapshot
            // per statement, whatever the server's default isolation.
            sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                .execute(&mut *tx)
                .await?;
            sqlx::query!(
                "INSERT INTO idempotency_nonces AS n (nonce, scope_hash, kind)
        VALUES ($1, $2, 'abandoned')
        ON CONFLICT (nonce) DO UPDATE SET kind = 'abandoned', noted_at = clock_timestamp()",
                nonce,
                &scope[..]
            )
            .execute(&mut *tx)
            .await?;
            let row = sqlx::query_scalar!(
            r#"WITH kept AS (
        UPDATE idempotency_records
        SET state = 'unknown', claim_nonce = NULL, scope_hash = CASE WHEN scope_hash <> $4 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $4) THEN $4 ELSE scope_hash END,
            lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
            expires_at = GREATEST(expires_at, clock_timestamp()
                + GREATEST(COALESCE(retention_ms, $3::bigint), $5::bigint) * interval '1 millisecond')
        WHERE scope_hash IN ($1, $4) AND claim_nonce = $2 AND state IN ('in_progress', 'unknown')
          AND unknown_before
        RETURNING 'unknown'::text AS became
    ), freed AS (
        DELETE FROM idempotency_records
        WHERE scope_hash IN ($1, $4) AND claim_nonce = $2 AND state IN ('in_progress', 'unknown')
          AND NOT unknown_before
        RETURNING 'deleted'::text AS became
    )
    SELECT became AS "became!" FROM kept UNION ALL SELECT became FROM freed"#,
                &scope[..],
                nonce,
                retention_ms,
                &current[..],
                self.unknown_retention_ms
            )
            .fetch_optional(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(row)
        })
        .await?;
        Ok(match row.as_deref() {
            Some("unknown") => Abandoned::Unknown,
            Some(_) => Abandoned::Deleted,
            None => Abandoned::Nothing,
        })
    }
}
