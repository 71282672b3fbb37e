//! Every SQL statement of the state API. Each call is one short autocommit transaction, so a
//! claim is committed (durably: `synchronous_commit=on`) before it is answered and no lock is
//! held between two requests. All times come from the database clock.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::types::Json;
use sqlx::{FromRow as _, Row as _};

use contract::wire::{ClaimResponse, RecordState, StoredResponse};
use state_rules::fingerprint::Keyed;
use state_rules::writes::{Abandoned, Beat};
use state_rules::Decision;

use crate::scope::ScopeHash;
use crate::sealing::{OpenError, Sealed, Sealer};

/// The embedded migrations (`state-api/migrations`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// How often a claim re-decides after losing a race (a concurrent reclaim, purge or
/// take-over changed the row between our read and our write).
const CLAIM_ATTEMPTS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("the record kept changing under the claim")]
    Contention,
    #[error("stored record is inconsistent: {0}")]
    Corrupt(&'static str),
    /// A stored response that does not open (tampered, moved, or sealed under a storage key
    /// this process does not have): a 500 for that record, never a replay of something else.
    #[error("stored response: {0}")]
    Sealed(#[from] OpenError),
    /// The error of a group-commit statement, given to every request of its batch.
    #[error(transparent)]
    Batch(std::sync::Arc<StoreError>),
    /// The batch that carried the request stopped before answering it (a bug or a runtime
    /// shutting down): whether it was written is unknown, like a connection lost mid-statement.
    #[error("the request's batch ended without an answer")]
    Unanswered,
    /// The group commit's queue is full (count or bytes): answered at once, nothing written.
    #[error("too many requests queued for the database")]
    Overloaded,
    /// The caller's time ran out before the answer (the job was dropped before it reached
    /// Postgres, or its answer came too late and a claim it made was released).
    #[error("the caller's time ran out")]
    CallerGone,
}

impl StoreError {
    /// True when a stored response did not open under the storage keys.
    pub fn is_unopenable(&self) -> bool {
        match self {
            Self::Sealed(_) => true,
            Self::Batch(inner) => inner.is_unopenable(),
            _ => false,
        }
    }

    /// True when the database cannot be reached or is shutting down or overloaded: the
    /// caller answers 503 and the filter fails closed.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Db(e) => match e {
                sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::WorkerCrashed => true,
                sqlx::Error::Database(db) => {
                    let code = db.code().unwrap_or_default();
                    // 08: connection exception; 57P0x: shutdown / cannot connect now;
                    // 53: insufficient resources; 57014: statement timeout; 55P03: lock timeout;
                    // 40001/40P01: serialization failure / deadlock (retryable).
                    // 25006: read-only (a standby, or a primary being demoted in a failover);
                    // 55000: "recovery is in progress" (the WAL functions on a standby).
                    code.starts_with("08")
                        || code.starts_with("53")
                        || code.starts_with("57P")
                        || matches!(
                            code.as_ref(),
                            "57014" | "55P03" | "40001" | "40P01" | "25006" | "55000"
                        )
                }
                _ => false,
            },
            Self::Contention | Self::Unanswered | Self::Overloaded | Self::CallerGone => true,
            Self::Batch(e) => e.is_unavailable(),
            Self::Migrate(_) | Self::Corrupt(_) | Self::Sealed(_) => false,
        }
    }
}

/// Pool settings taken from the configuration.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    pub statement_timeout_ms: u64,
    /// Ping a pooled connection before use when it has been idle at least this long (None: never).
    /// A ping is one extra round trip (~40 µs here, ~30% of a duplicate claim's throughput at
    /// 16 clients when done on every use); idle connections are the ones most likely to have died
    /// with a restarted Postgres. A busy connection broken by a restart fails one request with
    /// 503, which the filter answers fail-closed (and a `complete` is retried).
    pub ping_when_idle: Option<Duration>,
}

/// A lazily connecting pool: it (re)connects on demand, so the API starts answering 503 when
/// Postgres is down and recovers by itself when it comes back.
pub fn pool(url: &str, s: &PoolSettings) -> Result<PgPool, sqlx::Error> {
    let statement_timeout = s.statement_timeout_ms.to_string();
    let opts = PgConnectOptions::from_str(url)?
        .application_name("state-api")
        // Explicit, whatever the server's default: a claim is acknowledged only after a
        // durable commit.
        .options([
            ("synchronous_commit", "on"),
            ("statement_timeout", statement_timeout.as_str()),
            // A claim never waits long on another request's lock (only on the few
            // microseconds of a concurrent single-row statement).
            ("lock_timeout", "2000"),
            ("idle_in_transaction_session_timeout", "10000"),
            // Every statement here is a lookup by primary key (the purge: by expiry), prepared
            // once per connection. One generic plan each, made at the first use: with custom
            // plans (`auto`), the group commit's UPDATE over unnest() was planned again on
            // every call (0.11 ms, 40 % of its time). And never a sequential scan: a generic
            // plan made while the table was small would otherwise scan it whole, on every call,
            // until the next ANALYZE.
            ("plan_cache_mode", "force_generic_plan"),
            ("enable_seqscan", "off"),
            // No JIT: nothing here scans enough rows to gain from it, and `enable_seqscan = off`
            // adds its disable cost (1e10) to any scan that cannot use an index, which is above
            // every JIT threshold: the lease guard's lookup of the timeline was compiled on every
            // call, 70-170 ms of Postgres CPU for each claim of an abandoned key (auto_explain).
            ("jit", "off"),
        ]);
    let mut options = PgPoolOptions::new()
        .max_connections(s.max_connections)
        .acquire_timeout(s.acquire_timeout)
        .test_before_acquire(false)
        .after_connect(|conn, _| Box::pin(register_timeline(conn)));
    if let Some(idle) = s.ping_when_idle {
        options = options.before_acquire(move |conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= idle {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        });
    }
    Ok(options.connect_lazy_with(opts))
}

/// Records when this primary's timeline was first seen (the lease guard across a failover:
/// `idempotency_serving_since()`, which also records it the first time it is asked), on every
/// new connection: after a failover, the first one to the promoted standby. A standby has
/// nothing to record (its writes answer 503, and `/readyz` says it is read-only), and before
/// the migrations have run there is nowhere to record it.
async fn register_timeline(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    let done = sqlx::query!(
        "INSERT INTO idempotency_timelines (timeline_id) VALUES (idempotency_current_timeline())
         ON CONFLICT DO NOTHING"
    )
    .execute(&mut *conn)
    .await;
    match done {
        Err(sqlx::Error::Database(db))
            if matches!(
                db.code().as_deref(),
                Some("42P01" | "42883" | "25006" | "55000")
            ) =>
        {
            Ok(())
        }
        other => other.map(drop),
    }
}

/// What `/readyz` reports of the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Primary {
        timeline: i64,
        /// `synchronous_standby_names` is set: a commit waits for a standby.
        synchronous: bool,
        sync_standbys: i64,
        standbys: i64,
    },
    /// In recovery (a standby): the pool reached a server that cannot write.
    ReadOnly,
}

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
struct ClaimRow {
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
const CLAIM_SQL: &str = concat!(
    "WITH existing AS (",
    record_of_key!("$1", "$10"),
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
          AND NOT EXISTS (SELECT 1 FROM idempotency_abandoned a WHERE a.nonce = $9)
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
          AND NOT EXISTS (SELECT 1 FROM idempotency_abandoned a WHERE a.nonce = i.claim_nonce)
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

/// What one pass of the purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgePass {
    pub rows: u64,
    pub statements: u32,
    /// Its time ran out with expired rows left: the next pass follows soon.
    pub backlog: bool,
}

/// How often each state API beats the database's pulse: four beats a second, against the
/// guard's second of silence, so a loaded machine's late beat is not an outage.
pub const PULSE_EVERY: Duration = Duration::from_millis(250);

/// How far the purge's batches grow over `--purge-batch` while a backlog lasts.
pub const PURGE_BATCH_GROWTH: u32 = 16;
/// A purge statement faster than this lets the next one grow.
const PURGE_FAST_STATEMENT: Duration = Duration::from_millis(50);

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

/// A duration from the database, never negative.
fn ms(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// A record whose fingerprint matched under a key other than the current one (the previous
/// key secret's, or none: a plain one from before keying): re-keyed as the claim reads it.
struct Rekey {
    address: Vec<u8>,
    token: i64,
    old: String,
}

impl ClaimRow {
    /// The re-keying this row needs for `claim`, if its fingerprint matched under another key.
    fn rekey(&self, claim: &NewClaim<'_>) -> Option<Rekey> {
        let stale = self.fingerprint_key_id != Some(claim.fingerprint.key_id)
            && self.fingerprint_alg == claim.fingerprint_alg
            && claim
                .fingerprint
                .matches(&self.fingerprint, self.fingerprint_key_id);
        stale.then(|| Rekey {
            address: self.address.clone(),
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
fn decide(row: ClaimRow, claim: &NewClaim<'_>, sealer: &Sealer) -> Result<Step, StoreError> {
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
enum Step {
    Answer(ClaimResponse),
    /// `Reclaim`, `MarkUnknown` or `TakeOver`.
    Update(Decision),
}

#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    sealer: Arc<Sealer>,
}

impl Store {
    pub fn new(pool: PgPool, sealer: Arc<Sealer>) -> Self {
        Self { pool, sealer }
    }

    /// The storage keys that seal and open stored responses.
    pub fn sealer(&self) -> &Sealer {
        &self.sealer
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn migrate(&self) -> Result<(), StoreError> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query!("SELECT 1 AS one")
            .fetch_one(&self.pool)
            .await?;
        Ok(())
    }

    /// What the database behind the pool is: a primary (its timeline, and how many synchronous
    /// standbys it has, when this user may see them), or a server that cannot take writes.
    pub async fn readiness(&self) -> Result<Readiness, StoreError> {
        let row = sqlx::query!(
            r#"SELECT pg_is_in_recovery() AS "standby!",
               CASE WHEN pg_is_in_recovery() THEN NULL ELSE idempotency_current_timeline() END AS timeline,
               (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')) AS "sync_standbys!",
               (SELECT count(*) FROM pg_stat_replication) AS "standbys!",
               current_setting('synchronous_standby_names') <> '' AS "synchronous!""#
        )
        .fetch_one(&self.pool)
        .await?;
        if row.standby {
            return Ok(Readiness::ReadOnly);
        }
        Ok(Readiness::Primary {
            timeline: row.timeline.unwrap_or(0),
            synchronous: row.synchronous,
            sync_standbys: row.sync_standbys,
            standbys: row.standbys,
        })
    }

    /// Claims the key, or tells why not. One round trip when the key is new, in progress,
    /// completed or mismatched; a reclaim or take-over adds one compare-and-set UPDATE.
    pub async fn claim(&self, c: &NewClaim<'_>) -> Result<ClaimResponse, StoreError> {
        let lease = i64::try_from(c.lease_ms).unwrap_or(i64::MAX);
        // A row read after losing a race, to decide on without inserting again.
        let mut pending: Option<ClaimRow> = None;
        for _ in 0..CLAIM_ATTEMPTS {
            let row = match pending.take() {
                Some(r) => Some(r),
                None => {
                    let inserted_or_found = sqlx::query_as::<_, ClaimRow>(CLAIM_SQL)
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
                        .fetch_optional(&self.pool)
                        .await?;
                    match inserted_or_found {
                        Some(r) => Some(r),
                        // Committed by a concurrent inserter after our snapshot: read anew.
                        None => self.read(c).await?,
                    }
                }
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
            let won = match decide(row, c, &self.sealer)? {
                Step::Answer(outcome) => {
                    if let Some(r) = rekey {
                        self.rekey_fingerprint(&r, c.fingerprint).await;
                    }
                    return Ok(outcome);
                }
                Step::Update(Decision::Reclaim { observed }) => {
                    // Take over a record whose outcome is unknown (marked so, or an in_progress one whose lease
                    // ran out) for a claim that asked to: compare-and-set on the observed token, with the database
                    // clock, so of N concurrent takers exactly one matches, and it gets a new, larger token.
                    sqlx::query_scalar!(
                        "UPDATE idempotency_records
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
                          AND NOT EXISTS (SELECT 1 FROM idempotency_abandoned a WHERE a.nonce = $5)
                        RETURNING fencing_token",
                        &address[..],
                        observed,
                        lease,
                        c.retention_ms,
                        c.nonce,
                        &c.scope[..]
                    )
                    .fetch_optional(&self.pool)
                    .await?
                    .map(|token| (token, true))
                }
                Step::Update(Decision::TakeOver {
                    observed,
                    was_in_progress,
                }) => {
                    // Reuse a record past its retention as if it were new (compare-and-set on the observed token).
                    sqlx::query_scalar!(
                        "UPDATE idempotency_records
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
      AND NOT EXISTS (SELECT 1 FROM idempotency_abandoned a WHERE a.nonce = $10)
    RETURNING fencing_token",
                        &address[..],
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
                    .fetch_optional(&self.pool)
                    .await?
                    .map(|token| (token, was_in_progress))
                }
                Step::Update(Decision::MarkUnknown { observed }) => {
                    // An in_progress record whose lease ran out is unknown: marked so (compare-and-set on the
                    // observed token) for a claim that holds unknown outcomes.
                    let marked = sqlx::query_scalar!(
                        "UPDATE idempotency_records SET state = 'unknown',
                            scope_hash = CASE WHEN scope_hash <> $4 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $4) THEN $4 ELSE scope_hash END,
                            lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
                            expires_at = GREATEST(expires_at, clock_timestamp()
                                + COALESCE(retention_ms, $3::bigint) * interval '1 millisecond')
                        WHERE scope_hash = $1 AND fencing_token = $2 AND state = 'in_progress'
                          AND lease_expires_at <= clock_timestamp()
                          AND idempotency_serving_since()
                              <= clock_timestamp() - lease_ms * interval '1 millisecond'
                        RETURNING fencing_token",
                        &address[..],
                        observed,
                        c.retention_ms,
                        &c.scope[..]
                    )
                    .fetch_optional(&self.pool)
                    .await?;
                    if marked.is_some() {
                        return Ok(ClaimResponse::Unknown);
                    }
                    None
                }
                Step::Update(other) => {
                    return Err(StoreError::Corrupt(match other {
                        Decision::Claimed { .. } => {
                            "a claim decided as inserted that did not insert"
                        }
                        _ => "a claim decision the store cannot carry out",
                    }))
                }
            };
            if let Some((token, reclaimed)) = won {
                return Ok(ClaimResponse::claimed(token, c.lease_ms, reclaimed));
            }
            if self.abandoned(c).await? {
                return Err(StoreError::CallerGone);
            }
            // Lost the compare-and-set: decide again on the row as it is now (the winner's).
            pending = self.read(c).await?;
        }
        Err(StoreError::Contention)
    }

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
        let rows = sqlx::query(WRITE_BATCH_SQL)
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
            .fetch_all(&self.pool)
            .await?;
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

    /// Stores a matched fingerprint keyed under the current key (fenced by the record's token and
    /// its old value), so that a record outlives the previous key secret and records from
    /// before keying stop being plain. Best effort: a failure leaves it matching as it was.
    async fn rekey_fingerprint(&self, r: &Rekey, fingerprint: &Keyed) {
        let done = sqlx::query!(
            "UPDATE idempotency_records SET fingerprint = $4, fingerprint_key_id = $5
            WHERE scope_hash = $1 AND fencing_token = $2 AND fingerprint = $3",
            &r.address[..],
            r.token,
            r.old,
            fingerprint.stored,
            fingerprint.key_id
        )
        .execute(&self.pool)
        .await;
        if let Err(e) = done {
            tracing::warn!(error = %e, "a fingerprint could not be re-keyed; it is re-keyed at its next claim");
        }
    }

    async fn read(&self, c: &NewClaim<'_>) -> Result<Option<ClaimRow>, StoreError> {
        Ok(sqlx::query_as::<_, ClaimRow>(READ_SQL)
            .bind(&c.scope[..])
            .bind(c.previous.as_ref().map(|p| &p[..]))
            .fetch_optional(&self.pool)
            .await?)
    }

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
        let row = sqlx::query_scalar!(
            "UPDATE idempotency_records
    SET lease_ms = $3, owner_seen_at = clock_timestamp(), scope_hash = CASE WHEN scope_hash <> $5 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $5) THEN $5 ELSE scope_hash END,
        lease_expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond',
        expires_at = GREATEST(expires_at, clock_timestamp()
            + ($3::bigint + COALESCE(retention_ms, $4::bigint)) * interval '1 millisecond')
    WHERE scope_hash = $1 AND fencing_token = $2 AND state = 'in_progress'
    RETURNING fencing_token",
            &scope[..],
            token,
            lease,
            retention_ms,
            &current[..]
        )
        .fetch_optional(&self.pool)
        .await?;
        if row.is_some() {
            return Ok(Beat::Extended);
        }
        let marked = sqlx::query_scalar!(
            "SELECT 1 AS one FROM idempotency_records
    WHERE scope_hash = $1 AND fencing_token = $2 AND state = 'unknown'",
            &scope[..],
            token
        )
        .fetch_optional(&self.pool)
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
        let done = sqlx::query_scalar!(
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
        .fetch_optional(&self.pool)
        .await?;
        match done {
            Some(expires_in_ms) => Ok(WriteResult::Done {
                expires_in_ms: ms(expires_in_ms),
            }),
            None => self.complete_unmatched(scope, token).await,
        }
    }

    /// Moves the open record of the owner holding `token` from `at` (the previous key secret's
    /// address) to `current`, unless a record is there already: what every write does in its
    /// own statement, done first for a complete, whose response is sealed under the address it
    /// is stored at. `false`: not moved (nothing there, or `current` is taken).
    pub async fn move_to_current(
        &self,
        at: &ScopeHash,
        current: &ScopeHash,
        token: i64,
    ) -> Result<bool, StoreError> {
        let moved = sqlx::query_scalar!(
            "UPDATE idempotency_records SET scope_hash = $2
            WHERE scope_hash = $1 AND fencing_token = $3 AND state IN ('in_progress', 'unknown')
              AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $2)
            RETURNING fencing_token",
            &at[..],
            &current[..],
            token
        )
        .fetch_optional(&self.pool)
        .await?;
        Ok(moved.is_some())
    }

    /// After a complete whose UPDATE matched no row: a retried complete of the same owner (its
    /// first answer was lost) is not a conflict; anything else is fenced out.
    pub async fn complete_unmatched(
        &self,
        scope: &ScopeHash,
        token: i64,
    ) -> Result<WriteResult, StoreError> {
        // A retried complete of the same owner (its first answer was lost): the record as stored.
        let same_owner_done = sqlx::query_scalar!(
            r#"SELECT GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000))::bigint AS "expires_in_ms!"
            FROM idempotency_records
            WHERE scope_hash = $1 AND fencing_token = $2 AND state = 'completed'"#,
            &scope[..],
            token
        )
        .fetch_optional(&self.pool)
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
        // lease ends now: nothing heartbeats it any more; the retention counts from the mark.
        let marked = sqlx::query_scalar!(
            "UPDATE idempotency_records
    SET state = 'unknown', owner_seen_at = clock_timestamp(), scope_hash = CASE WHEN scope_hash <> $4 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $4) THEN $4 ELSE scope_hash END,
        lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
        expires_at = GREATEST(expires_at, clock_timestamp()
            + COALESCE(retention_ms, $3::bigint) * interval '1 millisecond')
    WHERE scope_hash = $1 AND fencing_token = $2 AND state IN ('in_progress', 'unknown')
    RETURNING fencing_token",
            &scope[..],
            token,
            retention_ms,
            &current[..]
        )
        .fetch_optional(&self.pool)
        .await?;
        if marked.is_some() {
            return Ok(Some(true));
        }
        Ok(match self.complete_unmatched(scope, token).await? {
            WriteResult::AlreadyDone { .. } => Some(false),
            _ => None,
        })
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
        // it over): then it is unknown again, since only this owner's attempt certainly did not run.
        let row = sqlx::query_scalar!(
            r#"WITH kept AS (
        UPDATE idempotency_records
        SET state = 'unknown', lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
            owner_seen_at = clock_timestamp(), scope_hash = CASE WHEN scope_hash <> $4 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $4) THEN $4 ELSE scope_hash END,
            expires_at = GREATEST(expires_at, clock_timestamp()
                + COALESCE(retention_ms, $3::bigint) * interval '1 millisecond')
        WHERE scope_hash = $1 AND fencing_token = $2 AND state IN ('in_progress', 'unknown')
          AND unknown_before
        RETURNING fencing_token
    ), freed AS (
        DELETE FROM idempotency_records
        WHERE scope_hash = $1 AND fencing_token = $2 AND state IN ('in_progress', 'unknown')
          AND NOT unknown_before
        RETURNING fencing_token
    )
    SELECT fencing_token AS "fencing_token!" FROM kept
    UNION ALL SELECT fencing_token FROM freed"#,
            &scope[..],
            token,
            retention_ms,
            &current[..]
        )
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.is_some())
    }

    /// Whether the claim attempt `c` was abandoned by its filter before it got here.
    async fn abandoned(&self, c: &NewClaim<'_>) -> Result<bool, StoreError> {
        let Some(nonce) = c.nonce else {
            return Ok(false);
        };
        Ok(sqlx::query_scalar!(
            "SELECT 1 AS one FROM idempotency_abandoned WHERE nonce = $1",
            nonce
        )
        .fetch_optional(&self.pool)
        .await?
        .is_some())
    }

    /// Gives back the record that the claim attempt named `nonce` made or took over, its answer
    /// never having reached the filter ([`state_rules::writes::abandon`]): deleted, or unknown
    /// again where it was taken over from an earlier attempt whose outcome is unknown. Finding
    /// nothing (the claim has not got here yet, behind a slow database), it leaves a tombstone
    /// that keeps that claim attempt from ever committing.
    pub async fn abandon(
        &self,
        scope: &ScopeHash,
        current: &ScopeHash,
        nonce: &str,
        retention_ms: i64,
    ) -> Result<Abandoned, StoreError> {
        let row = sqlx::query_scalar!(
            r#"WITH kept AS (
        UPDATE idempotency_records
        SET state = 'unknown', claim_nonce = NULL, scope_hash = CASE WHEN scope_hash <> $4 AND NOT EXISTS (SELECT 1 FROM idempotency_records o WHERE o.scope_hash = $4) THEN $4 ELSE scope_hash END,
            lease_expires_at = LEAST(lease_expires_at, clock_timestamp()),
            expires_at = GREATEST(expires_at, clock_timestamp()
                + COALESCE(retention_ms, $3::bigint) * interval '1 millisecond')
        WHERE scope_hash = $1 AND claim_nonce = $2 AND state IN ('in_progress', 'unknown')
          AND unknown_before
        RETURNING 'unknown'::text AS became
    ), freed AS (
        DELETE FROM idempotency_records
        WHERE scope_hash = $1 AND claim_nonce = $2 AND state IN ('in_progress', 'unknown')
          AND NOT unknown_before
        RETURNING 'deleted'::text AS became
    ), tombstone AS (
        INSERT INTO idempotency_abandoned (scope_hash, nonce)
        SELECT $1, $2
        WHERE NOT EXISTS (SELECT 1 FROM kept) AND NOT EXISTS (SELECT 1 FROM freed)
        ON CONFLICT DO NOTHING
    )
    SELECT became AS "became!" FROM kept UNION ALL SELECT became FROM freed"#,
            &scope[..],
            nonce,
            retention_ms,
            &current[..]
        )
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row.as_deref() {
            Some("unknown") => Abandoned::Unknown,
            Some(_) => Abandoned::Deleted,
            None => Abandoned::Nothing,
        })
    }

    /// One beat of the database's pulse (`idempotency_pulse()`, every [`PULSE_EVERY`] from
    /// every state API): the lease guard counts a silence of more than a second as an outage.
    pub async fn pulse(&self) -> Result<(), StoreError> {
        sqlx::query!("SELECT idempotency_pulse() AS beat")
            .fetch_one(&self.pool)
            .await?;
        Ok(())
    }

    /// Whether a record lives at `scope` (a lookup during a rotation of the key secret).
    pub async fn exists(&self, scope: &ScopeHash) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar!(
            "SELECT 1 AS one FROM idempotency_records WHERE scope_hash = $1",
            &scope[..]
        )
        .fetch_optional(&self.pool)
        .await?
        .is_some())
    }

    pub async fn record(&self, scope: &ScopeHash) -> Result<Option<RecordRow>, StoreError> {
        let Some(r) = sqlx::query!(r#"
    SELECT r.state, r.subject, r.endpoint, r.fingerprint_alg, r.fencing_token,
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
    WHERE r.scope_hash = $1"#, &scope[..])
            .fetch_optional(&self.pool)
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(RecordRow {
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
        }))
    }

    /// One batch of the purge ([`state_rules::purge::purge`]): expired records with an outcome
    /// are deleted; an in-progress one past its expiry whose owner has been silent for a whole
    /// lease (the lease guard) is marked unknown instead and kept a retention (`retention_ms`
    /// unless it has its own), since nobody knows whether it ran. Returns how many of each.
    pub async fn purge_batch(&self, batch: u32, retention_ms: i64) -> Result<u64, StoreError> {
        // `FOR UPDATE SKIP LOCKED` re-checks the condition on a row a concurrent write just
        // renewed, and skips rows being written right now. The CASE fixes the order: the lease
        // guard's function is asked only of an in-progress row past its lease.
        let done = sqlx::query!(
            r#"WITH due AS (
        SELECT scope_hash, state FROM idempotency_records
        WHERE expires_at < clock_timestamp()
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
            expires_at = clock_timestamp() + COALESCE(r.retention_ms, $2::bigint) * interval '1 millisecond'
        FROM due d
        WHERE r.scope_hash = d.scope_hash AND d.state = 'in_progress'
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone) + (SELECT count(*) FROM marked) AS "rows!""#,
            i64::from(batch),
            retention_ms
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(done.rows).unwrap_or(0))
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
        // Tombstones of abandoned claims outlive any claim that could still arrive by minutes.
        sqlx::query!(
            "DELETE FROM idempotency_abandoned WHERE abandoned_at < clock_timestamp() - interval '10 minutes'"
        )
        .execute(&self.pool)
        .await?;
        let max = batch.saturating_mul(PURGE_BATCH_GROWTH);
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
