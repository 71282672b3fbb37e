//! The pool (its connections' settings, the timeline each new one registers) and what the
//! database says of itself: readiness, the pulse.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use super::held::POOL_SLOTS_BEYOND_THE_STORE;
use super::{Store, StoreError};

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
    // The store's own uses are bounded by `max_connections` in `Held`; the pool keeps a few
    // slots beyond them for the operator's actions and the migrations. Idle connections are
    // pinged by `Held` (`ping_when_idle`): the store's stay out of this pool between uses.
    let options = PgPoolOptions::new()
        .max_connections(s.max_connections + POOL_SLOTS_BEYOND_THE_STORE)
        .acquire_timeout(s.acquire_timeout)
        .test_before_acquire(false)
        .after_connect(|conn, _| Box::pin(register_timeline(conn)));
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

/// How often each state API beats the database's pulse: four beats a second, against the
/// guard's second of silence, so a loaded machine's late beat is not an outage.
pub const PULSE_EVERY: Duration = Duration::from_millis(250);

impl Store {
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.on_conn(async |conn| sqlx::query!("SELECT 1 AS one").fetch_one(conn).await)
            .await?;
        Ok(())
    }

    /// What the database behind the pool is: a primary (its timeline, and how many synchronous
    /// standbys it has, when this user may see them), or a server that cannot take writes.
    pub async fn readiness(&self) -> Result<Readiness, StoreError> {
        let row = self.on_conn(async |conn| sqlx::query!(
            r#"SELECT pg_is_in_recovery() AS "standby!",
               CASE WHEN pg_is_in_recovery() THEN NULL ELSE idempotency_current_timeline() END AS timeline,
               (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')) AS "sync_standbys!",
               (SELECT count(*) FROM pg_stat_replication) AS "standbys!",
               current_setting('synchronous_standby_names') <> '' AS "synchronous!""#
        )
        .fetch_one(conn).await)
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

    /// One beat of the database's pulse (`idempotency_pulse()`, every [`PULSE_EVERY`] from
    /// every state API): the lease guard counts a silence of more than a second as an outage.
    pub async fn pulse(&self) -> Result<(), StoreError> {
        self.on_conn(async |conn| {
            sqlx::query!("SELECT idempotency_pulse() AS beat")
                .fetch_one(conn)
                .await
        })
        .await?;
        Ok(())
    }
}
