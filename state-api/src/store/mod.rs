//! Every SQL statement of the state API, one file a job: the pool and what the database says
//! of itself (`pool`), claims (`claim`), the group commit's statement (`batch`), the owners'
//! fenced writes (`writes`), the operator's read (`records`) and the purge (`purge`). Each call
//! is one short autocommit transaction, so a claim is committed (durably:
//! `synchronous_commit=on`) before it is answered and no lock is held between two requests.
//! All times come from the database clock.

use std::sync::Arc;

use sqlx::postgres::PgPool;

use crate::sealing::{OpenError, Sealer};

mod batch;
mod claim;
mod held;
mod pool;
mod purge;
mod records;
mod writes;

pub use batch::{BatchAnswers, BatchedClaim, CompleteItem};
pub use claim::NewClaim;
pub use held::{StallLimit, POOL_SLOTS_BEYOND_THE_STORE};
pub use pool::{pool, PoolSettings, Readiness, PULSE_EVERY};
pub use purge::{PurgePass, PURGE_BATCH_GROWTH, PURGE_BATCH_SQL, PURGE_NONCES_SQL};
pub use records::RecordRow;
pub use writes::WriteResult;

/// The embedded migrations (`state-api/migrations`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

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
    /// A round trip to the database went unanswered past `--db-stall-ms`: its connection was
    /// given up (see `held`).
    #[error("the database did not answer in time: its connection was given up")]
    Stalled,
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
            Self::Contention
            | Self::Unanswered
            | Self::Overloaded
            | Self::CallerGone
            | Self::Stalled => true,
            Self::Batch(e) => e.is_unavailable(),
            Self::Migrate(_) | Self::Corrupt(_) | Self::Sealed(_) => false,
        }
    }
}

/// A duration from the database, never negative.
pub fn ms(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    held: Arc<held::Held>,
    sealer: Arc<Sealer>,
    /// How long a record marked unknown is kept from the mark (ms; `--unknown-retention-s`):
    /// every statement that marks one sets its expiry at least this far ahead.
    unknown_retention_ms: i64,
}

impl Store {
    /// The store over `pool` (made by [`pool`] with the same `settings`); a record marked
    /// unknown is kept `unknown_retention_ms` from the mark (at least its own retention).
    pub fn new(
        pool: PgPool,
        settings: &PoolSettings,
        sealer: Arc<Sealer>,
        stall: StallLimit,
        unknown_retention_ms: i64,
    ) -> Self {
        Self {
            pool,
            held: held::Held::new(
                settings.max_connections,
                settings.acquire_timeout,
                settings.ping_when_idle,
                stall,
            ),
            sealer,
            unknown_retention_ms,
        }
    }

    /// How long a record marked unknown is kept from the mark (ms).
    pub fn unknown_retention_ms(&self) -> i64 {
        self.unknown_retention_ms
    }

    /// Connections in the pool (the store's, in use or held idle, and the pool's own), and
    /// those idle.
    pub fn connections(&self) -> (u32, u32) {
        let idle = self.held.idle_count() + self.pool.num_idle();
        (self.pool.size(), u32::try_from(idle).unwrap_or(u32::MAX))
    }

    /// Closes every connection: the store's idle ones, then the pool (which waits for those
    /// in use).
    pub async fn close(&self) {
        self.held.drain();
        self.pool.close().await;
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
}
