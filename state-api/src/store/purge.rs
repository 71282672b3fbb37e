//! The purge of expired records, in batches bounded by time.

use std::time::Duration;

use super::{Store, StoreError};

/// What one pass of the purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgePass {
    pub rows: u64,
    pub statements: u32,
    /// Its time ran out with expired rows left: the next pass follows soon.
    pub backlog: bool,
}

/// How far the purge's batches grow over `--purge-batch` while a backlog lasts.
pub const PURGE_BATCH_GROWTH: u32 = 16;
/// A purge statement faster than this lets the next one grow.
const PURGE_FAST_STATEMENT: Duration = Duration::from_millis(50);

/// One batch of the purge: `$1` rows at most, `$2` the retention (ms) of a record without its
/// own, `$3` how long a record marked unknown is kept (`--unknown-retention-s`, ms).
///
/// Due rows are found through the expiry index, whose condition must be one Postgres can take as
/// the index's bound: `statement_timestamp()` (stable within the statement), not
/// `clock_timestamp()` (volatile, so only a filter). With the latter the scan read the index in
/// order and fetched every row to test it, and a batch that came back short (every pass ends
/// with one) read the whole table: 570 ms at 1 M rows, past the 5-s statement timeout long
/// before 50 M (bench/NOTES.md, twenty-second round). The statement's start is a little earlier
/// than the clock, so it finds no row that is not due. `FOR UPDATE SKIP LOCKED` re-checks the
/// condition on a row a concurrent write just renewed (its new expiry is past the statement's
/// start), and skips rows being written right now. The CASE fixes the order: the lease guard's
/// function is asked only of an in-progress row past its lease.
///
/// A row it marks unknown is kept the unknown horizon from now (at least its retention): an
/// unknown outcome is due only then, so until then a claim answers it `unknown` and no pass
/// deletes it (issue 46, finding 8).
pub const PURGE_BATCH_SQL: &str = r#"WITH due AS (
        SELECT scope_hash, state FROM idempotency_records
        WHERE expires_at < statement_timestamp()
          AND CASE WHEN state <> 'in_progress' THEN true
                   WHEN lease_expires_at > clock_timestamp() THEN false
                   ELSE idempotency_serving_since() <= clock_timestamp() - lease_ms * interval '1 millisecond'
              END
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM idempotency_records r USING due d
        WHERE r.scope_hash = d.scope_hash AND d.state <> 'in_progress'
        RETURNING 1
    ), marked AS (
        UPDATE idempotency_records r
        SET state = 'unknown',
            lease_expires_at = LEAST(r.lease_expires_at, clock_timestamp()),
            expires_at = GREATEST(r.expires_at, clock_timestamp()
                + GREATEST(COALESCE(r.retention_ms, $2::bigint), $3::bigint) * interval '1 millisecond')
        FROM due d
        WHERE r.scope_hash = d.scope_hash AND d.state = 'in_progress'
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone) + (SELECT count(*) FROM marked)"#;

/// One batch of the purge of the nonces' rows (`idempotency_nonces`): `$1` rows at most of
/// those noted more than ten minutes ago, found through the index on `noted_at` (bounded by
/// `statement_timestamp()`, as for the records). A claim's row is needed only while an abandon
/// of it could still come: seconds. An abandon's row is kept an hour: the claim it stops may
/// still arrive long after its connection was given up at the stall limit, as the kernel goes
/// on retransmitting the statement's bytes for up to about 15 minutes (Linux's `tcp_retries2`
/// default) and a partition may heal within that. Abandons are rare (an answer lost), so the
/// few rows the index finds and the condition keeps cost nothing.
pub const PURGE_NONCES_SQL: &str = "DELETE FROM idempotency_nonces WHERE nonce IN (
        SELECT nonce FROM idempotency_nonces
        WHERE noted_at < statement_timestamp() - interval '10 minutes'
          AND (kind = 'claimed' OR noted_at < statement_timestamp() - interval '1 hour')
        ORDER BY noted_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED)";

impl Store {
    /// One batch of the nonces' purge ([`PURGE_NONCES_SQL`]): how many rows went.
    pub async fn purge_nonces(&self, batch: u32) -> Result<u64, StoreError> {
        let done = self
            .on_conn(async |conn| {
                sqlx::query(PURGE_NONCES_SQL)
                    .bind(i64::from(batch))
                    .execute(conn)
                    .await
            })
            .await?;
        Ok(done.rows_affected())
    }

    /// One batch of the purge ([`state_rules::purge::purge`]): expired records with an outcome
    /// are deleted; an in-progress one past its expiry whose owner has been silent for a whole
    /// lease (the lease guard) is marked unknown instead and kept the unknown horizon (or its
    /// retention, `retention_ms` unless it has its own, when longer), since nobody knows
    /// whether it ran. Returns how many of each.
    pub async fn purge_batch(&self, batch: u32, retention_ms: i64) -> Result<u64, StoreError> {
        let rows: i64 = self
            .on_conn(async |conn| {
                sqlx::query_scalar(PURGE_BATCH_SQL)
                    .bind(i64::from(batch))
                    .bind(retention_ms)
                    .bind(self.unknown_retention_ms)
                    .fetch_one(conn)
                    .await
            })
            .await?;
        Ok(u64::try_from(rows).unwrap_or(0))
    }

    /// One pass of the purge: batches until one comes back short (the backlog is gone) or
    /// `budget` is spent (the work per pass is bounded by time, not rows). While batches come
    /// back full and fast, they grow (up to [`PURGE_BATCH_GROWTH`] times `batch`): a backlog is
    /// deleted with fewer statements; a slow one shrinks them again.
    pub async fn purge_expired(
        &self,
        batch: u32,
        budget: Duration,
        retention_ms: i64,
    ) -> Result<PurgePass, StoreError> {
        let started = tokio::time::Instant::now();
        let max = batch.saturating_mul(PURGE_BATCH_GROWTH);
        // The nonces' rows (every claim of a new key writes one) outlive any claim or abandon
        // that could still arrive by minutes; deleted in batches too, within the same budget.
        loop {
            let n = self.purge_nonces(max.max(1)).await?;
            if n < u64::from(max.max(1)) || started.elapsed() >= budget {
                break;
            }
            tokio::task::yield_now().await;
        }
        let mut size = batch.max(1);
        let mut pass = PurgePass::default();
        loop {
            let t = tokio::time::Instant::now();
            let n = self.purge_batch(size, retention_ms).await?;
            pass.rows += n;
            pass.statements += 1;
            if n < u64::from(size) {
                return Ok(pass);
            }
            if started.elapsed() >= budget {
                pass.backlog = true;
                return Ok(pass);
            }
            size = if t.elapsed() < PURGE_FAST_STATEMENT {
                size.saturating_mul(2).min(max)
            } else {
                (size / 2).max(batch)
            };
            tokio::task::yield_now().await;
        }
    }
}
