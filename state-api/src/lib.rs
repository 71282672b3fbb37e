//! The idempotency state API: the single source of truth for every Idempotency-Key.
//!
//! One record per (key, subject, endpoint) in Postgres, addressed by an HMAC of the three.
//! A claim is committed before it is answered; a duplicate is answered at once from the
//! committed row (never by waiting on the first request); writes of an owner are fenced by a
//! token from one sequence. See `docs/state-api.md` and `GET /openapi.json`.

pub mod admin;
pub mod batch;
pub mod config;
pub mod http;
pub mod metrics;
pub mod openapi;
pub mod router;
pub mod scope;
pub mod sealing;
pub mod store;
pub mod tls;
pub mod waiters;

use secrecy::ExposeSecret as _;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::Config;
pub use router::app;

use crate::batch::Batcher;
use crate::metrics::Metrics;
use crate::scope::Scoper;
use crate::store::{PoolSettings, StallLimit, Store};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("configuration: {0}")]
    Config(#[from] config::ConfigError),
    #[error("DATABASE_URL: {0}")]
    DatabaseUrl(sqlx::Error),
    #[error("key secret: {0}")]
    KeySecret(String),
    #[error("storage key: {0}")]
    StorageKey(#[from] sealing::KeyError),
    #[error("--previous-storage-key is the same as the storage key: a rotation needs a new key")]
    SamePreviousStorageKey,
    #[error("store: {0}")]
    Store(#[from] store::StoreError),
    #[error("listen: {0}")]
    Io(#[from] std::io::Error),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
}

struct Inner {
    config: Config,
    store: Store,
    batcher: Batcher,
    scoper: Scoper,
    metrics: Arc<Metrics>,
    token_digest: [u8; 32],
    /// `None`: no admin token configured (the admin API answers 401).
    admin_digest: Option<[u8; 32]>,
    waiters: waiters::Waiters,
}

/// The storage keys: the current one (from the flag or its file) and, during a rotation, the
/// previous one.
fn sealer(config: &Config) -> Result<sealing::Sealer, StartError> {
    let current = match (&config.storage_key, &config.storage_key_file) {
        (Some(k), _) => Some(sealing::StorageKey::from_base64(k.expose_secret())?),
        (None, Some(path)) => Some(sealing::StorageKey::from_file(path)?),
        (None, None) => None,
    };
    let previous = config
        .previous_storage_key
        .as_ref()
        .map(|k| sealing::StorageKey::from_base64(k.expose_secret()))
        .transpose()?;
    if let (Some(c), Some(p)) = (&current, &previous) {
        if c.id() == p.id() {
            return Err(StartError::SamePreviousStorageKey);
        }
    }
    if current.is_none() {
        tracing::warn!("no storage key (--storage-key): stored responses are kept in clear");
    }
    Ok(sealing::Sealer::new(current, previous))
}

/// Everything a request needs, cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

impl AppState {
    /// Validates the configuration and builds a lazily connecting pool: nothing touches the
    /// database yet.
    pub fn new(config: Config) -> Result<Self, StartError> {
        let secret = config.validate()?;
        let mut scoper = Scoper::new(secret.expose_secret().as_bytes())
            .map_err(|e| StartError::KeySecret(e.to_string()))?;
        if let Some(previous) = &config.previous_key_secret {
            scoper = scoper
                .with_previous(previous.expose_secret().as_bytes())
                .map_err(|e| StartError::KeySecret(e.to_string()))?;
        }
        let pool_settings = PoolSettings {
            max_connections: config.pool_size,
            acquire_timeout: config.acquire_timeout(),
            statement_timeout_ms: config.statement_timeout_ms,
            ping_when_idle: config
                .pool_ping
                .then(|| Duration::from_millis(config.pool_ping_idle_ms)),
        };
        let pool = store::pool(config.database_url.expose_secret(), &pool_settings)
            .map_err(StartError::DatabaseUrl)?;
        let token_digest = token_digest(config.api_token.expose_secret());
        let admin_digest = config
            .admin_token
            .as_ref()
            .map(|t| crate::token_digest(t.expose_secret()));
        let waiters = waiters::Waiters::new(
            config.max_waiters,
            std::time::Duration::from_millis(config.wait_poll_ms),
        );
        let metrics = Arc::new(Metrics::default());
        let store = Store::new(
            pool,
            &pool_settings,
            Arc::new(sealer(&config)?),
            StallLimit {
                after: config.db_stall(),
                given_up: metrics.db_connections_given_up(),
            },
            config.unknown_retention_ms(),
        );
        let batcher = Batcher::new(store.clone(), metrics.clone(), config.batch_limits());
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                store,
                batcher,
                scoper,
                metrics,
                token_digest,
                admin_digest,
                waiters,
            }),
        })
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }
    pub fn store(&self) -> &Store {
        &self.inner.store
    }
    /// The group commit of claims and completes (`Store` underneath).
    pub fn batcher(&self) -> &Batcher {
        &self.inner.batcher
    }
    pub fn scoper(&self) -> &Scoper {
        &self.inner.scoper
    }
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }
    pub(crate) fn token_digest(&self) -> &[u8; 32] {
        &self.inner.token_digest
    }
    pub(crate) fn admin_digest(&self) -> Option<&[u8; 32]> {
        self.inner.admin_digest.as_ref()
    }
    pub fn waiters(&self) -> &waiters::Waiters {
        &self.inner.waiters
    }
}

pub(crate) fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Applies the migrations, retrying for up to `wait` while the database is not reachable
/// yet (it may be starting next to us).
pub async fn migrate(state: &AppState, wait: Duration) -> Result<(), StartError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match state.store().migrate().await {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() < deadline && is_connect_error(&e) => {
                tracing::warn!(error = %e, "database not reachable yet, retrying the migrations");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn is_connect_error(e: &store::StoreError) -> bool {
    let inner = match e {
        store::StoreError::Migrate(sqlx::migrate::MigrateError::Execute(inner)) => inner,
        store::StoreError::Db(inner) => inner,
        _ => return false,
    };
    match inner {
        // A certificate Postgres presents that does not verify (sslmode=verify-full) comes as
        // InvalidData: it will not fix itself by waiting.
        sqlx::Error::Io(io) => io.kind() != std::io::ErrorKind::InvalidData,
        sqlx::Error::PoolTimedOut => true,
        // 57P03: the database system is starting up.
        sqlx::Error::Database(db) => db.code().as_deref() == Some("57P03"),
        _ => false,
    }
}

/// Deletes expired records every `--purge-interval-s`, until `shutdown` turns true. A pass
/// works at most `--purge-pass-ms`; when its time ran out with a backlog left, the next pass
/// follows after a pause as long as the pass (at most half the database's time for the purge),
/// so retention keeps up with any new-key rate the database can insert, without the purge
/// ever holding it for long.
pub fn spawn_purge(
    state: AppState,
    mut shutdown: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let every = state.config().purge_interval_s;
    if every == 0 {
        return None;
    }
    Some(tokio::spawn(async move {
        let budget = Duration::from_millis(state.config().purge_pass_ms);
        let mut pause = Duration::from_secs(every);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = shutdown.changed() => return,
            }
            let started = tokio::time::Instant::now();
            pause = Duration::from_secs(every);
            match state
                .store()
                .purge_expired(
                    state.config().purge_batch,
                    budget,
                    state.config().retention_ms(),
                )
                .await
            {
                Ok(pass) => {
                    state.metrics().purge_pass(&pass);
                    if pass.rows > 0 {
                        tracing::info!(
                            rows = pass.rows,
                            statements = pass.statements,
                            backlog = pass.backlog,
                            "purged expired records"
                        );
                    }
                    if pass.backlog {
                        pause = started.elapsed().min(pause);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "purge failed; will retry"),
            }
        }
    }))
}

/// Beats the database's pulse every [`store::PULSE_EVERY`] until `shutdown` turns true: while
/// no state API gets through for a second, the lease guard counts the database as just come
/// back, so an owner cut off from it by an outage (a frozen Postgres, a cut link) gets a whole
/// lease to be heard before its lease counts as run out (issue 34, path 2).
pub fn spawn_pulse(
    state: AppState,
    mut shutdown: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(store::PULSE_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = shutdown.changed() => return,
            }
            match state.store().pulse().await {
                Ok(()) => failing = false,
                // Once per outage: the claims and writes report theirs.
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "the database's pulse failed; retrying");
                }
                Err(_) => {}
            }
        }
    })
}

/// Serves the API on `listener` until `shutdown` completes, then drains in-flight requests
/// (and the group commit's queues), stops the purge and closes the pool.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    serve_on(listener, state, shutdown).await
}

/// [`serve`] on any listener: a [`TcpListener`] (plain HTTP) or a [`tls::TlsListener`] (HTTPS).
pub async fn serve_on<L>(
    listener: L,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let (stop_tx, stop_rx) = watch::channel(false);
    let pulse = spawn_pulse(state.clone(), stop_rx.clone());
    let purge = spawn_purge(state.clone(), stop_rx);
    let result = axum::serve(listener, app(state.clone()))
        .with_graceful_shutdown(shutdown)
        .await;
    state.batcher().close().await;
    let _ = stop_tx.send(true);
    if let Some(p) = purge {
        let _ = p.await;
    }
    let _ = pulse.await;
    state.store().close().await;
    result.map_err(StartError::Io)
}

/// Completes on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    tracing::info!("shutdown signal received, draining");
}
