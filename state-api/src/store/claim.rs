//! Claims: the read-or-insert statement, the decision on the row it returns
//! ([`state_rules::decide`]), and the compare-and-set updates that carry the decision out.

use sqlx::types::Json;

use contract::wire::{ClaimResponse, RecordState};
use state_rules::fingerprint::Keyed;
use state_rules::Decision;

use super::{ms, Store, StoreError};
use crate::scope::ScopeHash;
use crate::sealing::{Sealed, Sealer};

/// How often a claim re-decides after losing a race (a concurrent reclaim, purge or
/// take-over changed the row between our read and our write).
const CLAIM_ATTEMPTS: usize = 4;

/// The request of a claim, already validated.
#[derive(Debug, Clone)]
pub struct NewClaim<'a> {
    pub scope: ScopeHash,
    pub subject: &'a str,
    pub endpoint: &'a str,
    pub fingerprint_alg: &'a str,
    /// Keyed as records store it (compared with a stored one by [`Keyed::matches`]).
    pub fingerprint: &'a Keyed,
    pub lease_ms: u64,
    pub retention_ms: i64,
    /// Take an unknown record over (`true`), or answer `Unknown`.
    pub take_over_unknown: bool,
    /// Kept with the record (it is part of `scope` already).
    pub namespace: &'a str,
    /// The claim attempt's nonce, kept with a record it makes or takes over (`/v1/abandon`).
    pub nonce: Option<&'a str>,
    /// During a rotation of the key secret: the key's address under the previous one.
    pub previous: Option<ScopeHash>,
}

/// One row as the claim sees it, with durations computed by the database at read time.
#[derive(Debug, sqlx::FromRow)]
pub(super) struct ClaimRow {
    inserted: bool,
    #[sqlx(try_from = "String")]
    state: RecordState,
    fencing_token: i64,
    fingerprint_alg: String,
    fingerprint: String,
    /// The key it was stored under (none: a plain one, from before keying).
    fingerprint_key_id: Option<i64>,
    lease_remaining_ms: i64,
    lease_expired: bool,
    /// Past retention (and, for in_progress, past its lease): the key counts as new.
    retention_expired: bool,
    /// Until the retention expiry, rounded down (0 once past it).
    expires_in_ms: i64,
    response_status: Option<i32>,
    response_headers: Option<Json<Vec<(String, String)>>>,
    response_body: Option<Vec<u8>>,
    response_replayable: Option<bool>,
    response_key_id: Option<i64>,
    /// Where the row lives: the key's current address, or its previous one during a rotation.
    address: Vec<u8>,
}

/// The columns of `ClaimRow`, for a row `r` read at time `c.now`.
///
/// A lease counts as run out only once the database server has been the primary for a whole
/// lease (the row's own `lease_ms`; `idempotency_serving_since()`: the later of the postmaster's
/// start and the first sight of its timeline, so a promoted standby counts from its promotion):
/// after an outage or a failover longer than the lease, a live owner gets that long to heartbeat
/// (or store its outcome) before another edge's retry may reclaim its key and run the effect
/// again. Only an `in_progress` row past its lease asks the function (in a CASE, which fixes
/// the order): called for every claim of an older completed record, it made each replay of a
/// key older than its lease take about 100 ms in the statement (measured; `make bench`).
macro_rules! claim_cols {
    () => {
        "r.state, r.fencing_token, r.fingerprint_alg, r.fingerprint, r.fingerprint_key_id, \
         GREATEST(0, CEIL(EXTRACT(EPOCH FROM (r.lease_expires_at - c.now)) * 1000))::bigint AS lease_remaining_ms, \
         CASE WHEN r.state <> 'in_progress' OR r.lease_expires_at > c.now THEN false \
              ELSE idempotency_serving_since() <= c.now - r.lease_ms * interval '1 millisecond' \
         END AS lease_expired, \
         (r.expires_at <= c.now AND r.state <> 'in_progress') AS retention_expired, \
         GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (r.expires_at - c.now)) * 1000))::bigint AS expires_in_ms, \
         r.response_status, r.response_headers, r.response_body, r.response_replayable, \
         r.response_key_id, r.scope_hash AS address"
    };
}
pub(super) use claim_cols;

/// The record of a claim's key: at its address under the current key secret, or, during a
/// rotation, under the previous one while there is none under the current (`$1` current, `$2`
/// previous or NULL). Read in one statement with the insert, so that the lookup and the claim
/// are one decision: a record under the previous secret deleted meanwhile cannot let two claims
/// be granted, one under each secret, since claims only ever insert under the current one.
macro_rules! record_of_key {
    ($current:literal, $previous:literal) => {
        concat!(
            "SELECT * FROM idempotency_records WHERE scope_hash = ",
            $current,
            " UNION ALL SELECT * FROM idempotency_records WHERE scope_hash = ",
            $previous,
            " AND NOT EXISTS (SELECT 1 FROM idempotency_records c WHERE c.scope_hash = ",
            $current,
            ")"
        )
    };
}

/// The claim attempt's nonce row, taken (`SELECT $columns` (nonce, scope hash), `$rest`):
/// returns the nonce where it is the claim's, nothing where the nonce was abandoned.
/// Every statement that inserts or takes over a record under a nonce writes that record only
/// if this came back, in the same statement, so the two commit together (issue 46, finding 2).
/// A concurrent abandon of the nonce (`Store::abandon`) writes the same row: the unique index
/// makes the later writer wait for the earlier one's commit, and `ON CONFLICT DO UPDATE` then
/// sees the committed row whatever the statement's snapshot: an abandon committed first makes
/// this return nothing (the claim writes nothing); a claim committed first is found by the
/// abandon, which then gives its record back. A row of the claim's own (a retried attempt, a
/// waiting claim's later look) comes back again.
macro_rules! claim_nonce {
    ($columns:literal, $rest:literal) => {
        concat!(
            "INSERT INTO idempotency_nonces AS n (nonce, scope_hash, kind) SELECT ",
            $columns,
            ", 'claimed' ",
            $rest,
            " ON CONFLICT (nonce) DO UPDATE SET kind = 'claimed' WHERE n.kind = 'claimed'
            RETURNING n.nonce"
        )
    };
}
pub(super) use claim_nonce;

/// A claim's expiry is `created + lease + retention`, and a complete sets
/// `GREATEST(expiry, now + retention)`: a record is kept at least its retention after it completes,
/// and one completed within its lease (nearly all) keeps the claim's expiry, so the complete
/// changes no indexed column and is a HOT update (the row's page has room: fillfactor 80) that
/// writes neither index again (migration `20261205000000_hot_completes.sql`).
///
/// Read-or-insert in one round trip. The existing row is read first, so a duplicate or a replay
/// never attempts the INSERT (no transaction id, no WAL flush, no fencing token burnt); a new key
/// is INSERTed and committed before the answer. Two concurrent first claims both see no row:
/// one inserts, the other's `ON CONFLICT DO NOTHING` returns nothing and the statement yields no
/// row, and `claim()` reads again with a fresh snapshot.
///
/// A claim with a nonce takes its nonce's row first ([`claim_nonce!`]) and inserts only if it
/// got it: it cannot commit beside that nonce's abandon (issue 46, finding 2).
const CLAIM_SQL: &str = concat!(
    "WITH existing AS (",
    record_of_key!("$1", "$10"),
    "),
    nonce AS (",
    claim_nonce!(
        "$9, $1",
        "WHERE $9::text IS NOT NULL AND NOT EXISTS (SELECT 1 FROM existing)"
    ),
    "),
    ins AS (
        INSERT INTO idempotency_records
            (scope_hash, subject, endpoint, fingerprint_alg, fingerprint, state, fencing_token,
             lease_ms, lease_expires_at, created_at, expires_at, namespace, retention_ms,
             claim_nonce, owner_seen_at, fingerprint_key_id)
        SELECT $1, $2, $3, $4, $5, 'in_progress', nextval('idempotency_fencing_token_seq'), $6,
               clock_timestamp() + $6::bigint * interval '1 millisecond',
               clock_timestamp(),
               clock_timestamp() + ($6::bigint + $7::bigint) * interval '1 millisecond',
               $8, $7, $9, clock_timestamp(), $11
        WHERE NOT EXISTS (SELECT 1 FROM existing)
          AND ($9::text IS NULL OR EXISTS (SELECT 1 FROM nonce))
        ON CONFLICT (scope_hash) DO NOTHING
        RETURNING *
    )
    SELECT true AS inserted, ",
    claim_cols!(),
    " FROM ins r CROSS JOIN LATERAL (SELECT clock_timestamp() AS now) c
    UNION ALL
    SELECT false AS inserted, ",
    claim_cols!(),
    " FROM existing r CROSS JOIN LATERAL (SELECT clock_timestamp() AS now) c"
);

/// A plain read with a fresh snapshot: under READ COMMITTED the claim's second branch uses
/// the statement's snapshot and can miss a row committed by a concurrent inserter that the
/// INSERT waited for.
const READ_SQL: &str = concat!(
    "SELECT false AS inserted, ",
    claim_cols!(),
    " FROM (",
    record_of_key!("$1", "$2"),
    ") r CROSS JOIN LATERAL (SELECT clock_timestamp() AS now) c"
);

/// A record whose fingerprint matched under a key other than the current one (the previous
/// key secret's, or none: a plain one from before keying): re-keyed as the claim reads it.
pub(super) struct Rekey {
    address: Vec<u8>,
    /// The key's current address: a write of the record's owner may move it there meanwhile.
    current: Vec<u8>,
    token: i64,
    old: String,
}

impl ClaimRow {
    /// The re-keying this row needs for `claim`, if its fingerprint matched under another key.
    pub(super) fn rekey(&self, claim: &NewClaim<'_>) -> Option<Rekey> {
        let stale = self.fingerprint_key_id != Some(claim.fingerprint.key_id)
            && self.fingerprint_alg == claim.fingerprint_alg
            && claim
                .fingerprint
                .matches(&self.fingerprint, self.fingerprint_key_id);
        stale.then(|| Rekey {
            address: self.address.clone(),
            current: claim.scope.to_vec(),
            token: self.fencing_token,
            old: self.fingerprint.clone(),
        })
    }

    /// What the claim's decision reads of the row ([`state_rules::Facts`]).
    fn facts(&self, claim: &NewClaim<'_>) -> state_rules::Facts {
        state_rules::Facts {
            inserted: self.inserted,
            state: self.state,
            token: self.fencing_token,
            same_fingerprint: self.fingerprint_alg == claim.fingerprint_alg
                && claim
                    .fingerprint
                    .matches(&self.fingerprint, self.fingerprint_key_id),
            lease_remaining_ms: ms(self.lease_remaining_ms),
            lease_expired: self.lease_expired,
            retention_expired: self.retention_expired,
        }
    }

    /// The stored response of a completed row, opened.
    fn replay(self, sealer: &Sealer) -> Result<ClaimResponse, StoreError> {
        let (Some(status), Some(Json(headers)), Some(body), Some(replayable)) = (
            self.response_status,
            self.response_headers,
            self.response_body,
            self.response_replayable,
        ) else {
            return Err(StoreError::Corrupt("completed record without a response"));
        };
        let status = u16::try_from(status).map_err(|_| StoreError::Corrupt("response status"))?;
        let stored = Sealed::read(self.response_key_id, headers, body);
        // Sealed under the address it was stored at.
        let response = sealer.open(
            &self.address,
            self.fencing_token,
            status,
            replayable,
            stored,
        )?;
        Ok(ClaimResponse::completed(response, ms(self.expires_in_ms)))
    }
}

/// What the claim does next after reading a row: answer, or one of the compare-and-set
/// updates of [`Decision`] (the rule is [`state_rules::decide`]; the store carries it out).
pub(super) fn decide(
    row: ClaimRow,
    claim: &NewClaim<'_>,
    sealer: &Sealer,
) -> Result<Step, StoreError> {
    let decision = state_rules::decide(&row.facts(claim), claim.take_over_unknown);
    Ok(match decision {
        Decision::Claimed { token } => {
            Step::Answer(ClaimResponse::claimed(token, claim.lease_ms, false))
        }
        Decision::Mismatch => Step::Answer(ClaimResponse::Mismatch),
        Decision::Replay => Step::Answer(row.replay(sealer)?),
        Decision::InProgress { lease_remaining_ms } => {
            Step::Answer(ClaimResponse::in_progress(lease_remaining_ms))
        }
        Decision::Unknown => Step::Answer(ClaimResponse::Unknown),
        update => Step::Update(update),
    })
}

/// The claim's next step: an answer, or an update to carry out.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    Answer(ClaimResponse),
    /// `Reclaim`, `MarkUnknown` or `TakeOver`.
    Update(Decision),
}

/// What carrying a decision out came to.
#[derive(Debug)]
enum Carried {
    /// The compare-and-set won: the record is the claim's, under a new token.
    Won { token: i64, reclaimed: bool },
    /// The record's outcome is now unknown (a claim that holds unknown outcomes).
    MarkedUnknown,
    /// Another writer changed the row first.
    Lost,
}

impl Carried {
    fn won(token: Option<i64>, reclaimed: bool) -> Self {
        token.map_or(Self::Lost, |token| Self::Won { token, reclaimed })
    }
}

impl Store {
    /// Claims the key, or tells why not. One round trip when the key is new, in progress,
    /// completed or mismatched; a reclaim or take-over adds one compare-and-set UPDATE.
    pub async fn claim(&self, c: &NewClaim<'_>) -> Result<ClaimResponse, StoreError> {
        let lease = i64::try_from(c.lease_ms).unwrap_or(i64::MAX);
        // A row read after losing a race, to decide on without inserting again.
        let mut pending: Option<ClaimRow> = None;
        for _ in 0..CLAIM_ATTEMPTS {
            let row = match pending.take() {
                Some(r) => Some(r),
                None => self.insert_or_read(c, lease).await?,
            };
            // Still nothing: purged or released meanwhile, so insert again; unless this claim
            // attempt was abandoned before it got here (its insert is suppressed).
            let Some(row) = row else {
                if self.abandoned(c).await? {
                    return Err(StoreError::CallerGone);
                }
                continue;
            };
            // The compare-and-sets write the row where it is, and move it to the current
            // secret's address (a record found under the previous one, during a rotation),
            // unless a record is there already: `scope_hash = CASE WHEN scope_hash <> current
            // AND NOT EXISTS (a row at current) THEN current ELSE scope_hash END`, as every
            // owner's write does (a complete moves the record first: `move_to_current`).
            let address = row.address.clone();
            let rekey = row.rekey(c);
            let outcome = match decide(row, c, &self.sealer)? {
                Step::Answer(outcome) => {
                    if let Some(r) = rekey {
                        self.rekey_fingerprint(&r, c.fingerprint).await;
                    }
                    return Ok(outcome);
                }
                Step::Update(decision) => self.carry_out(c, &address, decision, lease).await?,
            };
            match outcome {
                Carried::Won { token, reclaimed } => {
                    return Ok(ClaimResponse::claimed(token, c.lease_ms, reclaimed))
                }
                Carried::MarkedUnknown => return Ok(ClaimResponse::Unknown),
                Carried::Lost => {}
            }
            if self.abandoned(c).await? {
                return Err(StoreError::CallerGone);
            }
            // Lost the compare-and-set: decide again on the row as it is now (the winner's).
            pending = self.read(c).await?;
        }
        Err(StoreError::Contention)
    }

    /// Inserts the claim's record, or reads the one that is there (also a record committed by a
    /// concurrent inserter after this statement's snapshot).
    async fn insert_or_read(
        &self,
        c: &NewClaim<'_>,
        lease: i64,
    ) -> Result<Option<ClaimRow>, StoreError> {
        let inserted_or_found = self
            .on_conn(async |conn| {
                sqlx::query_as::<_, ClaimRow>(CLAIM_SQL)
                    .bind(&c.scope[..])
                    .bind(c.subject)
                    .bind(c.endpoint)
                    .bind(c.fingerprint_alg)
                    .bind(&c.fingerprint.stored)
                    .bind(lease)
                    .bind(c.retention_ms)
                    .bind(c.namespace)
                    .bind(c.nonce)
                    .bind(c.previous.as_ref().map(|p| &p[..]))
                    .bind(c.fingerprint.key_id)
                    .fetch_optional(conn)
                    .await
            })
            .await?;
        match inserted_or_found {
            Some(r) => Ok(Some(r)),
            // Committed by a concurrent inserter after our snapshot: read anew.
            None => self.read(c).await,
        }
    }

    /// Carries a decision out on the row at `address`: a compare-and-set on the observed token,
    /// with the database clock, so of N concurrent claims exactly one wins.
    async fn carry_out(
        &self,
        c: &NewClaim<'_>,
        address: &[u8],
        decision: Decision,
        lease: i64,
    ) -> Result<Carried, StoreError> {
        match decision {
            Decision::Reclaim { observed } => {
                // Takes over a record whose outcome is unknown (marked so, or an in_progress one whose lease
                // ran out) for a claim that asked to: compare-and-set on the observed token, with the database
                // clock, so of N concurrent takers exactly one matches, and it gets a new, larger token.
                // The nonce's row first, as in `claim_nonce!` (a macro cannot feed `query!`).
                let won = self.on_conn(async |conn| sqlx::query_scalar!(
                    "WITH nonce AS (
                        INSERT INTO idempotency_nonces AS n (nonce, scope_hash, kind)
                        SELECT $5, $6, 'claimed' WHERE $5::text IS NOT NULL
                        ON CONFLICT (nonce) DO UPDATE SET kind = 'claimed' WHERE n.kind = 'claimed'
                        RETURNING n.nonce
                    )
                    UPDATE idempotency_records
                        SET state = 'in_progress', unknown_before = true, claim_nonce = $5,
                            owner_seen_at = clock_timestamp(),
                            scope_hash = CASE WHEN scope_hash <> $6 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $6) THEN $6 ELSE scope_hash END,
                            fencing_token = nextval('idempotency_fencing_token_seq'),
                            lease_ms = $3,
                            lease_expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond',
                            expires_at = GREATEST(expires_at, clock_timestamp()
                                + ($3::bigint + COALESCE(retention_ms, $4::bigint)) * interval '1 millisecond')
                        WHERE scope_hash = $1 AND fencing_token = $2
                          AND (state = 'unknown' OR (state = 'in_progress'
                            AND lease_expires_at <= clock_timestamp()
                            AND idempotency_serving_since()
                                <= clock_timestamp() - lease_ms * interval '1 millisecond'))
                          AND ($5::text IS NULL OR EXISTS (SELECT 1 FROM nonce))
                        RETURNING fencing_token",
                    address,
                    observed,
                    lease,
                    c.retention_ms,
                    c.nonce,
                    &c.scope[..]
                )
                .fetch_optional(conn).await)
                .await?;
                Ok(Carried::won(won, true))
            }
            Decision::TakeOver {
                observed,
                was_in_progress,
            } => {
                // Reuses a record past its retention as if it were new (compare-and-set on the observed token).
                let won = self.on_conn(async |conn| sqlx::query_scalar!(
                    "WITH nonce AS (
        INSERT INTO idempotency_nonces AS n (nonce, scope_hash, kind)
        SELECT $10, $11, 'claimed' WHERE $10::text IS NOT NULL
        ON CONFLICT (nonce) DO UPDATE SET kind = 'claimed' WHERE n.kind = 'claimed'
        RETURNING n.nonce
    )
    UPDATE idempotency_records
    SET subject = $3, endpoint = $4, fingerprint_alg = $5, fingerprint = $6, fingerprint_key_id = $12,
        state = 'in_progress', unknown_before = false,
        fencing_token = nextval('idempotency_fencing_token_seq'),
        lease_ms = $7,
        lease_expires_at = clock_timestamp() + $7::bigint * interval '1 millisecond',
        created_at = clock_timestamp(),
        completed_at = NULL,
        expires_at = clock_timestamp() + ($7::bigint + $8::bigint) * interval '1 millisecond',
        retention_ms = $8, namespace = $9, claim_nonce = $10, owner_seen_at = clock_timestamp(),
        scope_hash = CASE WHEN scope_hash <> $11 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $11) THEN $11 ELSE scope_hash END,
        response_status = NULL, response_headers = NULL, response_body = NULL,
        response_replayable = NULL, response_key_id = NULL
    WHERE scope_hash = $1 AND fencing_token = $2
      AND expires_at <= clock_timestamp() AND state <> 'in_progress'
      AND ($10::text IS NULL OR EXISTS (SELECT 1 FROM nonce))
    RETURNING fencing_token",
                    address,
                    observed,
                    c.subject,
                    c.endpoint,
                    c.fingerprint_alg,
                    &c.fingerprint.stored,
                    lease,
                    c.retention_ms,
                    c.namespace,
                    c.nonce,
                    &c.scope[..],
                    c.fingerprint.key_id
                )
                .fetch_optional(conn).await)
                .await?;
                Ok(Carried::won(won, was_in_progress))
            }
            Decision::MarkUnknown { observed } => {
                // An in_progress record whose lease ran out is unknown: marks it so (compare-and-set on the
                // observed token) for a claim that holds unknown outcomes, kept the unknown horizon ($5).
                let marked = self.on_conn(async |conn| sqlx::query_scalar!(
                    "UPDATE idempotency_records SET state = 'unknown',
                            scope_hash = CASE WHEN scope_hash <> $4 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $4) THEN $4 ELSE scope_hash END,
                            lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
                            expires_at = GREATEST(expires_at, clock_timestamp()
                                + GREATEST(COALESCE(retention_ms, $3::bigint), $5::bigint) * interval '1 millisecond')
                        WHERE scope_hash = $1 AND fencing_token = $2 AND state = 'in_progress'
                          AND lease_expires_at <= clock_timestamp()
                          AND idempotency_serving_since()
                              <= clock_timestamp() - lease_ms * interval '1 millisecond'
                        RETURNING fencing_token",
                    address,
                    observed,
                    c.retention_ms,
                    &c.scope[..],
                    self.unknown_retention_ms
                )
                .fetch_optional(conn).await)
                .await?;
                Ok(match marked {
                    Some(_) => Carried::MarkedUnknown,
                    None => Carried::Lost,
                })
            }
            Decision::Claimed { .. } => Err(StoreError::Corrupt(
                "a claim decided as inserted that did not insert",
            )),
            _ => Err(StoreError::Corrupt(
                "a claim decision the store cannot carry out",
            )),
        }
    }

    /// Stores a matched fingerprint keyed under the current key (fenced by the record's token and
    /// its old value), so that a record outlives the previous key secret and records from
    /// before keying stop being plain. Best effort: a failure leaves it matching as it was.
    pub(super) async fn rekey_fingerprint(&self, r: &Rekey, fingerprint: &Keyed) {
        let done = self
            .on_conn(async |conn| {
                sqlx::query!(
                    "UPDATE idempotency_records SET fingerprint = $4, fingerprint_key_id = $5
            WHERE scope_hash IN ($1, $6) AND fencing_token = $2 AND fingerprint = $3",
                    &r.address[..],
                    r.token,
                    r.old,
                    fingerprint.stored,
                    fingerprint.key_id,
                    &r.current[..]
                )
                .execute(conn)
                .await
            })
            .await;
        if let Err(e) = done {
            tracing::warn!(error = %e, "a fingerprint could not be re-keyed; it is re-keyed at its next claim");
        }
    }

    async fn read(&self, c: &NewClaim<'_>) -> Result<Option<ClaimRow>, StoreError> {
        self.on_conn(async |conn| {
            sqlx::query_as::<_, ClaimRow>(READ_SQL)
                .bind(&c.scope[..])
                .bind(c.previous.as_ref().map(|p| &p[..]))
                .fetch_optional(conn)
                .await
        })
        .await
    }

    /// Whether the claim attempt `c` was abandoned by its filter before it got here.
    async fn abandoned(&self, c: &NewClaim<'_>) -> Result<bool, StoreError> {
        let Some(nonce) = c.nonce else {
            return Ok(false);
        };
        Ok(self
            .on_conn(async |conn| {
                sqlx::query_scalar!(
                    "SELECT 1 AS one FROM idempotency_nonces WHERE nonce = $1 AND kind = 'abandoned'",
                    nonce
                )
                .fetch_optional(conn)
                .await
            })
            .await?
            .is_some())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// The decision with responses in clear (sealing has its own tests).
    fn decide(row: ClaimRow, claim: &NewClaim<'_>) -> Result<Step, StoreError> {
        super::decide(row, claim, &Sealer::default())
    }

    fn claim() -> NewClaim<'static> {
        NewClaim {
            scope: [0; 32],
            subject: "alice",
            endpoint: "POST /checkout",
            fingerprint_alg: "sha256-jcs-v2",
            // A record keyed before (none here) or plain: the rows below store "aa" plainly.
            fingerprint: Box::leak(Box::new(Keyed {
                plain: "aa".into(),
                stored: "keyed-aa".into(),
                key_id: 1,
                previous: None,
            })),
            lease_ms: 30_000,
            retention_ms: 1000,
            take_over_unknown: false,
            namespace: "",
            nonce: None,
            previous: None,
        }
    }

    fn row(state: &str) -> ClaimRow {
        ClaimRow {
            inserted: false,
            state: state.parse().unwrap(),
            fencing_token: 7,
            fingerprint_alg: "sha256-jcs-v2".into(),
            fingerprint: "aa".into(),
            fingerprint_key_id: None,
            lease_remaining_ms: 500,
            lease_expired: false,
            retention_expired: false,
            expires_in_ms: 86_400_000,
            response_status: (state == "completed").then_some(201),
            response_headers: (state == "completed").then(|| Json(vec![("a".into(), "b".into())])),
            response_body: (state == "completed").then(|| vec![1, 2]),
            response_replayable: (state == "completed").then_some(true),
            response_key_id: None,
            address: vec![0; 32],
        }
    }

    #[test]
    fn decisions() {
        let c = claim();
        assert_eq!(
            decide(
                ClaimRow {
                    inserted: true,
                    ..row("in_progress")
                },
                &c
            )
            .unwrap(),
            Step::Answer(ClaimResponse::claimed(7, 30_000, false))
        );
        assert_eq!(
            decide(row("in_progress"), &c).unwrap(),
            Step::Answer(ClaimResponse::in_progress(500))
        );
        assert_eq!(
            decide(
                ClaimRow {
                    lease_expired: true,
                    ..row("in_progress")
                },
                &c
            )
            .unwrap(),
            Step::Update(Decision::MarkUnknown { observed: 7 }),
            "a lease run out is an unknown outcome, held"
        );
        let take_over = NewClaim {
            take_over_unknown: true,
            ..claim()
        };
        assert_eq!(
            decide(
                ClaimRow {
                    lease_expired: true,
                    ..row("in_progress")
                },
                &take_over
            )
            .unwrap(),
            Step::Update(Decision::Reclaim { observed: 7 })
        );
        assert_eq!(
            decide(row("unknown"), &c).unwrap(),
            Step::Answer(ClaimResponse::Unknown)
        );
        assert_eq!(
            decide(row("unknown"), &take_over).unwrap(),
            Step::Update(Decision::Reclaim { observed: 7 })
        );
        // A changed request is a mismatch first, whatever the state.
        assert_eq!(
            decide(
                ClaimRow {
                    fingerprint: "bb".into(),
                    ..row("unknown")
                },
                &take_over
            )
            .unwrap(),
            Step::Answer(ClaimResponse::Mismatch)
        );
        for state in ["in_progress", "completed"] {
            let mismatch = ClaimRow {
                fingerprint: "bb".into(),
                ..row(state)
            };
            assert_eq!(
                decide(mismatch, &c).unwrap(),
                Step::Answer(ClaimResponse::Mismatch)
            );
            let other_alg = ClaimRow {
                fingerprint_alg: "sha256-raw-v2".into(),
                ..row(state)
            };
            assert_eq!(
                decide(other_alg, &c).unwrap(),
                Step::Answer(ClaimResponse::Mismatch)
            );
        }
        assert!(matches!(
            decide(row("completed"), &c).unwrap(),
            Step::Answer(ClaimResponse::Completed {
                expires_in_ms: Some(86_400_000),
                ..
            })
        ));
        // An expired key is new, whatever its fingerprint.
        let expired = ClaimRow {
            retention_expired: true,
            fingerprint: "bb".into(),
            ..row("completed")
        };
        assert_eq!(
            decide(expired, &c).unwrap(),
            Step::Update(Decision::TakeOver {
                observed: 7,
                was_in_progress: false
            })
        );
        // Any other state cannot come out of the database: the row does not decode.
        assert!("weird".parse::<RecordState>().is_err());
    }
}
