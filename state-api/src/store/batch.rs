//! The group commit's statement: the claims and completes of many requests in one statement
//! and one commit, each answered as the single path would answer it.

use sqlx::types::Json;
use sqlx::{FromRow as _, Row as _};

use contract::wire::{ClaimResponse, StoredResponse};

use super::claim::{claim_cols, claim_nonce, decide, ClaimRow, Step};
use super::{ms, NewClaim, Store, StoreError};
use crate::scope::ScopeHash;
use crate::sealing::Sealed;

/// Until the retention expiry of the row (database clock, rounded down so that a cache that
/// trusts it never outlives the record).
macro_rules! expires_in_ms {
    () => {
        "GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000))::bigint"
    };
}

/// Claims and completes of many requests (distinct scope hashes) in one statement and one
/// commit: `CLAIM_SQL` and `COMPLETE_SQL` over arrays, with the same conditions.
///
/// Claims ($1..$8): existing rows are read first and only the missing keys are INSERTed (in
/// scope-hash order, so two such statements, even from two processes, take their locks in the
/// same order); one row per claim that was inserted or found, none for a claim that lost a race
/// with a concurrent inserter. Completes ($9..$15): the fenced UPDATE; one row per complete that
/// matched. Each row carries its kind and the 1-based index `idx` of its input. No scope is in
/// both halves (the batcher sees to it), so neither half depends on the other's writes.
const WRITE_BATCH_SQL: &str = concat!(
    "WITH input AS (
        SELECT * FROM unnest($1::bytea[], $2::text[], $3::text[], $4::text[], $5::text[],
                             $6::bigint[], $7::bigint[], $8::text[], $17::text[], $18::bytea[],
                             $19::bigint[])
            WITH ORDINALITY AS t(scope_hash, subject, endpoint, fingerprint_alg, fingerprint,
                                 lease_ms, retention_ms, namespace, claim_nonce, previous,
                                 fingerprint_key_id, idx)
    ),
    existing AS (
        SELECT i.idx, r.* FROM input i JOIN idempotency_records r ON r.scope_hash = i.scope_hash
        UNION ALL
        SELECT i.idx, r.* FROM input i JOIN idempotency_records r ON r.scope_hash = i.previous
        WHERE NOT EXISTS (SELECT 1 FROM idempotency_records c WHERE c.scope_hash = i.scope_hash)
    ),
    nonce AS (",
    // One row per nonce (a nonce twice in one call would update its row twice: an error).
    claim_nonce!(
        "DISTINCT ON (i.claim_nonce) i.claim_nonce, i.scope_hash",
        "FROM input i WHERE i.claim_nonce IS NOT NULL AND NOT EXISTS (SELECT 1 FROM existing e WHERE e.idx = i.idx)
        ORDER BY i.claim_nonce"
    ),
    "),
    ins AS (
        INSERT INTO idempotency_records
            (scope_hash, subject, endpoint, fingerprint_alg, fingerprint, state, fencing_token,
             lease_ms, lease_expires_at, created_at, expires_at, namespace, retention_ms,
             claim_nonce, owner_seen_at, fingerprint_key_id)
        SELECT i.scope_hash, i.subject, i.endpoint, i.fingerprint_alg, i.fingerprint, 'in_progress',
               nextval('idempotency_fencing_token_seq'), i.lease_ms,
               clock_timestamp() + i.lease_ms * interval '1 millisecond',
               clock_timestamp(),
               clock_timestamp() + (i.lease_ms + i.retention_ms) * interval '1 millisecond',
               i.namespace, i.retention_ms, i.claim_nonce, clock_timestamp(), i.fingerprint_key_id
        FROM input i
        WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.idx = i.idx)
          AND (i.claim_nonce IS NULL OR i.claim_nonce IN (SELECT n.nonce FROM nonce n))
        ORDER BY i.scope_hash
        ON CONFLICT (scope_hash) DO NOTHING
        RETURNING *
    ),
    done AS (
        UPDATE idempotency_records r
        SET state = 'completed',
            response_status = i.status, response_headers = i.headers, response_body = i.body,
            response_replayable = i.replayable, response_key_id = i.key_id,
            completed_at = clock_timestamp(),
            expires_at = GREATEST(r.expires_at, clock_timestamp()
                + COALESCE(r.retention_ms, i.retention_ms) * interval '1 millisecond')
        FROM unnest($9::bytea[], $10::bigint[], $11::int[], $12::jsonb[], $13::bytea[],
                    $14::bool[], $15::bigint[], $16::bigint[])
            WITH ORDINALITY AS i(scope_hash, token, status, headers, body, replayable,
                                 retention_ms, key_id, idx)
        WHERE r.scope_hash = i.scope_hash AND r.fencing_token = i.token
          AND r.state IN ('in_progress', 'unknown')
        RETURNING i.idx, ",
    expires_in_ms!(),
    " AS expires_in_ms
    )
    SELECT 'claim' AS kind, i.idx, true AS inserted, ",
    claim_cols!(),
    " FROM ins r JOIN input i ON i.scope_hash = r.scope_hash
        CROSS JOIN LATERAL (SELECT clock_timestamp() AS now) c
    UNION ALL
    SELECT 'claim', r.idx, false, ",
    claim_cols!(),
    " FROM existing r CROSS JOIN LATERAL (SELECT clock_timestamp() AS now) c
    UNION ALL
    SELECT 'complete', d.idx, NULL, NULL::text, NULL::bigint, NULL::text, NULL::text, NULL::bigint,
        NULL::bigint,
        NULL::bool, NULL::bool, d.expires_in_ms, NULL::int, NULL::jsonb, NULL::bytea, NULL::bool,
        NULL::bigint, NULL::bytea
    FROM done d"
);

/// What one claim of a batch statement came to.
#[derive(Debug)]
pub enum BatchedClaim {
    /// Answered from the committed statement, as the single path would.
    Answered(ClaimResponse),
    /// To be run on the single path (`Store::claim`): it lost a race with a concurrent inserter,
    /// or its lease or retention ran out (reclaim, take-over).
    SinglePath,
    /// The row it found is inconsistent (the single path would fail the same way).
    Failed(StoreError),
}

/// One complete of a batch.
#[derive(Debug, Clone, Copy)]
pub struct CompleteItem<'a> {
    pub scope: &'a ScopeHash,
    pub token: i64,
    pub response: &'a StoredResponse,
    pub retention_ms: i64,
}

/// What a batch statement came to, in the order of its inputs.
#[derive(Debug)]
pub struct BatchAnswers {
    pub claims: Vec<BatchedClaim>,
    /// `Some(expires_in_ms)`: completed. `None`: the UPDATE matched nothing; then
    /// `Store::complete_unmatched()` tells which case it is, as on the single path.
    pub completes: Vec<Option<u64>>,
}

impl Store {
    /// Claims and completes many requests (distinct scope hashes) with one statement and one
    /// commit. A batch of one should use `claim()` or `complete()`.
    pub async fn write_many(
        &self,
        claims: &[NewClaim<'_>],
        completes: &[CompleteItem<'_>],
    ) -> Result<BatchAnswers, StoreError> {
        let n = claims.len();
        let mut scopes = Vec::with_capacity(n);
        let mut subjects = Vec::with_capacity(n);
        let mut endpoints = Vec::with_capacity(n);
        let mut algs = Vec::with_capacity(n);
        let mut fingerprints = Vec::with_capacity(n);
        let mut leases = Vec::with_capacity(n);
        let mut retentions = Vec::with_capacity(n);
        let mut namespaces = Vec::with_capacity(n);
        let mut nonces = Vec::with_capacity(n);
        let mut previous = Vec::with_capacity(n);
        let mut key_ids_of_fingerprints = Vec::with_capacity(n);
        for c in claims {
            scopes.push(&c.scope[..]);
            subjects.push(c.subject);
            endpoints.push(c.endpoint);
            algs.push(c.fingerprint_alg);
            fingerprints.push(c.fingerprint.stored.as_str());
            key_ids_of_fingerprints.push(c.fingerprint.key_id);
            leases.push(i64::try_from(c.lease_ms).unwrap_or(i64::MAX));
            retentions.push(c.retention_ms);
            namespaces.push(c.namespace);
            nonces.push(c.nonce);
            previous.push(c.previous.as_ref().map(|p| &p[..]));
        }
        let m = completes.len();
        let mut c_scopes = Vec::with_capacity(m);
        let mut tokens = Vec::with_capacity(m);
        let mut statuses = Vec::with_capacity(m);
        let mut headers = Vec::with_capacity(m);
        let mut bodies = Vec::with_capacity(m);
        let mut replayables = Vec::with_capacity(m);
        let mut c_retentions = Vec::with_capacity(m);
        let mut key_ids = Vec::with_capacity(m);
        let sealed: Vec<Sealed> = completes
            .iter()
            .map(|it| self.sealer.seal(&it.scope[..], it.token, it.response))
            .collect();
        for (it, sealed) in completes.iter().zip(&sealed) {
            c_scopes.push(&it.scope[..]);
            tokens.push(it.token);
            statuses.push(i32::from(it.response.status));
            headers.push(Json(&sealed.headers));
            bodies.push(&sealed.body[..]);
            replayables.push(it.response.replayable);
            c_retentions.push(it.retention_ms);
            key_ids.push(sealed.key_id);
        }
        let rows = self
            .on_conn(async |conn| {
                sqlx::query(WRITE_BATCH_SQL)
                    .bind(scopes)
                    .bind(subjects)
                    .bind(endpoints)
                    .bind(algs)
                    .bind(fingerprints)
                    .bind(leases)
                    .bind(retentions)
                    .bind(namespaces)
                    .bind(c_scopes)
                    .bind(tokens)
                    .bind(statuses)
                    .bind(headers)
                    .bind(bodies)
                    .bind(replayables)
                    .bind(c_retentions)
                    .bind(key_ids)
                    .bind(nonces)
                    .bind(previous)
                    .bind(key_ids_of_fingerprints)
                    .fetch_all(conn)
                    .await
            })
            .await?;
        self.answers(rows, claims, m).await
    }

    /// The statement's rows, each answered as the single path would answer it, in the order of
    /// the inputs; a fingerprint found under the previous key is re-keyed on the way.
    async fn answers(
        &self,
        rows: Vec<sqlx::postgres::PgRow>,
        claims: &[NewClaim<'_>],
        completes: usize,
    ) -> Result<BatchAnswers, StoreError> {
        let (n, m) = (claims.len(), completes);
        let mut found: Vec<Option<ClaimRow>> = std::iter::repeat_with(|| None).take(n).collect();
        let mut done: Vec<Option<u64>> = vec![None; m];
        let slot = |idx: i64, len: usize| {
            usize::try_from(idx)
                .ok()
                .and_then(|i| i.checked_sub(1))
                .filter(|i| *i < len)
                .ok_or(StoreError::Corrupt("batch row without its input"))
        };
        for row in rows {
            let idx: i64 = row.try_get("idx")?;
            if row.try_get::<&str, _>("kind")? == "claim" {
                found[slot(idx, n)?] = Some(ClaimRow::from_row(&row)?);
            } else {
                done[slot(idx, m)?] = Some(ms(row.try_get("expires_in_ms")?));
            }
        }
        let mut rekeys = Vec::new();
        let claims = found
            .into_iter()
            .zip(claims)
            .map(|(row, c)| match row {
                // Committed by a concurrent inserter after our snapshot.
                None => BatchedClaim::SinglePath,
                Some(row) => match (row.rekey(c), decide(row, c, &self.sealer)) {
                    (rekey, Ok(Step::Answer(outcome))) => {
                        rekeys.extend(rekey.map(|r| (r, c.fingerprint)));
                        BatchedClaim::Answered(outcome)
                    }
                    (_, Ok(Step::Update(_))) => BatchedClaim::SinglePath,
                    (_, Err(e)) => BatchedClaim::Failed(e),
                },
            })
            .collect();
        for (r, fingerprint) in rekeys {
            self.rekey_fingerprint(&r, fingerprint).await;
        }
        Ok(BatchAnswers {
            claims,
            completes: done,
        })
    }
}
