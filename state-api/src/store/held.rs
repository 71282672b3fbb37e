//! The connections the store uses, held between uses by this process instead of being given
//! back to sqlx's pool, and every use bounded by the stall limit.
//!
//! Why held: sqlx pings every connection given back to its pool before it keeps it. A ping
//! caught on a dead link (a partition loses bytes without a reset or a FIN) kept its slot
//! until TCP delivered it, seconds after the link healed, out of reach of any limit of ours;
//! and each use paid that extra round trip. A held connection goes back to a list of ours, with
//! no ping; sqlx still opens connections (its options, `after_connect`) and counts them.
//!
//! Why bounded: a round trip still unanswered after the stall limit is taken for a dead link.
//! TCP would deliver the answer only at its retransmission pace (0.2, 0.4, 0.8, ... s apart, so
//! up to about the cut's length after the heal) while the pool stayed full of connections
//! waiting for it. So the connection is closed at once and taken out of the pool (a new one
//! replaces it), and the caller gets [`StoreError::Stalled`] (503). Whether a write it carried
//! committed is unknown, as for any connection lost mid-statement.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Connection, Postgres};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::{Store, StoreError};

/// When a database round trip is taken for a dead link (`--db-stall-ms`), and the count of the
/// connections given up on that account.
#[derive(Debug, Clone)]
pub struct StallLimit {
    pub after: Duration,
    /// `state_api_db_connections_given_up_total`.
    pub given_up: Counter,
}

/// Connections sqlx's pool keeps beyond the store's for the operator's actions, the
/// migrations and the tests, which use the pool itself.
pub const POOL_SLOTS_BEYOND_THE_STORE: u32 = 2;

/// The store's connections: at most `uses` in use at once, the idle ones with when they were
/// last used.
pub(super) struct Held {
    uses: Semaphore,
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
    acquire_timeout: Duration,
    /// Ping an idle connection before use when it has been idle at least this long.
    ping_when_idle: Option<Duration>,
    stall: StallLimit,
    /// Set at shutdown: a connection coming back from a use is closed, not kept (the pool's
    /// close waits for every connection it counts).
    closed: AtomicBool,
}

impl Held {
    pub(super) fn new(
        uses: u32,
        acquire_timeout: Duration,
        ping_when_idle: Option<Duration>,
        stall: StallLimit,
    ) -> Arc<Self> {
        Arc::new(Self {
            uses: Semaphore::new(uses as usize),
            idle: Mutex::new(Vec::new()),
            acquire_timeout,
            ping_when_idle,
            stall,
            closed: AtomicBool::new(false),
        })
    }

    fn idle(&self) -> MutexGuard<'_, Vec<(PoolConnection<Postgres>, Instant)>> {
        // A panic while holding the list leaves it as it was: usable.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn idle_count(&self) -> usize {
        self.idle().len()
    }

    /// Closes the idle connections, and from now on every one that comes back from a use (at
    /// shutdown, before the pool closes).
    pub(super) fn drain(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let idle = std::mem::take(&mut *self.idle());
        for (conn, _) in idle {
            give_up(conn);
        }
    }

    /// Keeps a connection that came back from a use for the next one (closes it at shutdown).
    fn keep(&self, conn: PoolConnection<Postgres>) {
        let mut idle = self.idle();
        if self.closed.load(Ordering::SeqCst) {
            drop(idle);
            give_up(conn);
        } else {
            idle.push((conn, Instant::now()));
        }
    }

    /// Gives a connection up: its socket closed at once (a goodbye would wait on a dead link)
    /// and its slot in the pool freed for a new one.
    fn stalled(&self, conn: PoolConnection<Postgres>) -> StoreError {
        give_up(conn);
        self.stall.given_up.inc();
        tracing::warn!(
            stall_limit_ms = self.stall.after.as_millis() as u64,
            "a database round trip went unanswered: its connection was given up"
        );
        StoreError::Stalled
    }

    /// An idle connection of ours, pinged first when it has been idle long (one that does not
    /// answer is given up, the next tried), or a new one from the pool.
    async fn take(&self, pool: &PgPool) -> Result<PoolConnection<Postgres>, StoreError> {
        loop {
            let Some((mut conn, since)) = self.idle().pop() else {
                return Ok(pool.acquire().await?);
            };
            let stale = self.ping_when_idle.is_some_and(|p| since.elapsed() >= p);
            if !stale {
                return Ok(conn);
            }
            match tokio::time::timeout(self.stall.after, conn.ping()).await {
                Ok(Ok(())) => return Ok(conn),
                // Broken (a restarted server): closed; the next one is tried.
                Ok(Err(_)) => give_up(conn),
                Err(_) => {
                    let _ = self.stalled(conn);
                }
            }
        }
    }
}

/// Closes `conn` without a word to the server and frees its slot in the pool.
fn give_up(conn: PoolConnection<Postgres>) {
    drop(conn.detach());
}

/// An error after which the connection can be used again: the server answered it (a
/// constraint, a timeout it enforced, a row missing), as opposed to a broken connection.
fn connection_survives(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Database(_)
            | sqlx::Error::RowNotFound
            | sqlx::Error::ColumnDecode { .. }
            | sqlx::Error::ColumnNotFound(_)
            | sqlx::Error::ColumnIndexOutOfBounds { .. }
            | sqlx::Error::TypeNotFound { .. }
            | sqlx::Error::Decode(_)
    )
}

impl Store {
    /// Runs `query` on one of the store's connections, within the stall limit (see the module
    /// documentation), and keeps the connection for the next use unless it broke or stalled.
    pub(super) async fn on_conn<T>(
        &self,
        query: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        let held = &self.held;
        let deadline = Instant::now() + held.acquire_timeout;
        let Ok(Ok(_use)) = tokio::time::timeout_at(deadline, held.uses.acquire()).await else {
            return Err(sqlx::Error::PoolTimedOut.into());
        };
        let mut conn = match tokio::time::timeout_at(deadline, held.take(&self.pool)).await {
            Ok(taken) => taken?,
            Err(_) => return Err(sqlx::Error::PoolTimedOut.into()),
        };
        let answered = tokio::time::timeout(held.stall.after, query(&mut conn)).await;
        match answered {
            Ok(Ok(v)) => {
                held.keep(conn);
                Ok(v)
            }
            Ok(Err(e)) => {
                if connection_survives(&e) {
                    held.keep(conn);
                } else {
                    give_up(conn);
                }
                Err(e.into())
            }
            Err(_) => Err(held.stalled(conn)),
        }
    }
}
