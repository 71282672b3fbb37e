//! Configuration from flags and environment variables.

use contract::state_env;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

/// Shortest and longest lease a caller may ask for (shared with the filter).
pub use contract::limits::{MAX_LEASE_MS, MIN_LEASE_MS};

/// Longest retention: keeps `now + retention` inside Postgres' timestamp range.
pub const MAX_RETENTION_S: u64 = 10 * 365 * 86_400;

/// How long a record marked unknown is kept by default (`--unknown-retention-s`): 7 days.
pub const DEFAULT_UNKNOWN_RETENTION_S: u64 = 7 * 86_400;

/// The largest group-commit batch accepted (requests per statement).
pub const MAX_BATCH: usize = 1_000;

/// The shortest accepted key secret, in bytes.
pub const MIN_KEY_SECRET_LEN: usize = 16;

/// A secret string (tokens, the key secret, the database URL): never printed by `Debug`,
/// zeroed when dropped, read only through `ExposeSecret::expose_secret`.
pub use secrecy::{ExposeSecret, SecretString as Secret};

/// The idempotency state API.
///
/// Two processes that share one database must be given the same `--key-secret`: records are
/// addressed by an HMAC of (key, subject, endpoint) under that secret.
#[derive(Debug, Clone, Parser)]
#[command(name = "state-api", version, about)]
pub struct Config {
    /// Postgres URL, e.g. postgres://user@127.0.0.1:5432/idem
    #[arg(long, env = state_env::DATABASE_URL, hide_env_values = true)]
    pub database_url: Secret,

    /// Address to listen on.
    #[arg(long = "listen", env = state_env::LISTEN_ADDR, default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// Bearer token every /v1 call must present.
    #[arg(long, env = state_env::STATE_API_TOKEN, hide_env_values = true)]
    pub api_token: Secret,

    /// Secret for the HMAC that addresses records (at least 16 bytes).
    #[arg(long, env = state_env::IDEM_KEY_SECRET, hide_env_values = true)]
    pub key_secret: Option<Secret>,

    /// During a rotation of the key secret: the secret records were addressed with before.
    /// A record is looked up under both (the previous one first when it holds the key); new
    /// records use `--key-secret`. Drop it once the longest retention, the unknown horizon and a
    /// lease have passed since the rotation (docs/state-api.md, "Rotating the key secret").
    #[arg(long, env = state_env::IDEM_PREVIOUS_KEY_SECRET, hide_env_values = true)]
    pub previous_key_secret: Option<Secret>,

    /// The AES-256 storage key (32 bytes, standard base64: `openssl rand -base64 32`) that
    /// seals every stored response's headers and body before they are written. Without one,
    /// responses are stored in clear (a warning at start).
    #[arg(long, env = state_env::STATE_API_STORAGE_KEY, hide_env_values = true)]
    pub storage_key: Option<Secret>,

    /// A file holding the storage key instead (base64, surrounding whitespace ignored).
    #[arg(
        long,
        env = state_env::STATE_API_STORAGE_KEY_FILE,
        conflicts_with = "storage_key"
    )]
    pub storage_key_file: Option<std::path::PathBuf>,

    /// During a rotation of the storage key: the key records were sealed with before. It only
    /// opens them; new records are sealed with `--storage-key`. Drop it once the longest
    /// retention has passed since the rotation.
    #[arg(long, env = state_env::STATE_API_PREVIOUS_STORAGE_KEY, hide_env_values = true)]
    pub previous_storage_key: Option<Secret>,

    /// Maximum database connections in the pool.
    #[arg(long, env = state_env::STATE_API_POOL_SIZE, default_value_t = 16)]
    pub pool_size: u32,

    /// How long a request waits for a pool connection before answering 503.
    #[arg(long, env = state_env::STATE_API_ACQUIRE_TIMEOUT_MS, default_value_t = 2_000)]
    pub acquire_timeout_ms: u64,

    /// Check a pooled connection that has been idle for `--pool-ping-idle-ms` before using it
    /// (`false`: never; after a Postgres restart each stale connection then fails one request with 503).
    #[arg(long, env = state_env::STATE_API_POOL_PING, default_value_t = true, action = clap::ArgAction::Set)]
    pub pool_ping: bool,

    /// Idle time after which a pooled connection is pinged before use (0: before every use).
    #[arg(long, env = state_env::STATE_API_POOL_PING_IDLE_MS, default_value_t = 1_000)]
    pub pool_ping_idle_ms: u64,

    /// Server-side statement timeout on every connection.
    #[arg(long, env = state_env::STATE_API_STATEMENT_TIMEOUT_MS, default_value_t = 5_000)]
    pub statement_timeout_ms: u64,

    /// A database round trip unanswered after this long is taken for a dead link (a partition:
    /// no reset, no FIN): the request answers 503 and the connection is closed and replaced,
    /// instead of waiting for TCP to retransmit, seconds after the link heals. Keep it above
    /// the slowest statement you expect (every one is a lookup by key) and below the lease.
    #[arg(long, env = state_env::STATE_API_DB_STALL_MS, default_value_t = 3_000,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub db_stall_ms: u64,

    /// Lease of a claim when the caller does not ask for one (clamped to 1 s .. 10 min).
    #[arg(long, env = state_env::STATE_API_LEASE_MS, default_value_t = 30_000)]
    pub lease_ms: u64,

    /// How long a record is kept (completed: from completion; in progress: from the claim),
    /// unless its claim asks for another retention.
    #[arg(long, env = state_env::STATE_API_RETENTION_S, default_value_t = 86_400)]
    pub retention_s: u64,

    /// How long a record whose outcome is unknown is kept from when it was marked so (by its
    /// owner, a claim or the purge), answering `unknown` meanwhile: a retry of an unknown
    /// outcome is exactly the one that may run an effect twice, so it never becomes a new key
    /// after a mere retention (issue 46, finding 8). At least `--retention-s` (a smaller value
    /// is refused); by default 7 days, or `--retention-s` when that is longer. A record whose
    /// claim asked for a longer retention keeps that.
    #[arg(long, env = state_env::STATE_API_UNKNOWN_RETENTION_S)]
    pub unknown_retention_s: Option<u64>,

    /// The longest retention a claim may ask for (a longer one is cut to this, and the answer
    /// says so).
    #[arg(long, env = state_env::STATE_API_MAX_RETENTION_S, default_value_t = 30 * 86_400)]
    pub max_retention_s: u64,

    /// The longest a claim may wait for a running key's outcome (`Prefer: wait`); 0: never.
    #[arg(long, env = state_env::STATE_API_MAX_WAIT_MS, default_value_t = 30_000)]
    pub max_wait_ms: u64,

    /// Claims waiting at once in this process; more are answered at once (counted).
    #[arg(long, env = state_env::STATE_API_MAX_WAITERS, default_value_t = 256)]
    pub max_waiters: usize,

    /// How often a waiting claim looks again for a write made by another state API process
    /// (writes of this process wake it at once).
    #[arg(long, env = state_env::STATE_API_WAIT_POLL_MS, default_value_t = 250,
          value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub wait_poll_ms: u64,

    /// Bearer token of the admin API (/v1/admin/*); none: the admin API answers 401. Never the
    /// filter's token (refused at start).
    #[arg(long, env = state_env::STATE_API_ADMIN_TOKEN, hide_env_values = true)]
    pub admin_token: Option<Secret>,

    /// Upper bound of the Retry-After hint given with `in_progress`.
    #[arg(long, env = state_env::STATE_API_RETRY_AFTER_CAP_S, default_value_t = 2)]
    pub retry_after_cap_s: u32,

    /// Largest stored response body, in bytes (larger: 413, the filter stores it as not replayable).
    #[arg(long, env = state_env::STATE_API_MAX_BODY_BYTES, default_value_t = 1_048_576)]
    pub max_body_bytes: usize,

    /// Seconds between purges of expired records (0 disables the purge).
    #[arg(long, env = state_env::STATE_API_PURGE_INTERVAL_S, default_value_t = 10)]
    pub purge_interval_s: u64,

    /// The longest one purge pass works (ms); with a backlog left, the next follows after a
    /// pause as long.
    #[arg(long, env = state_env::STATE_API_PURGE_PASS_MS, default_value_t = 2_000)]
    pub purge_pass_ms: u64,

    /// Rows deleted per purge statement (growing up to 16 times that while a backlog lasts).
    #[arg(long, env = state_env::STATE_API_PURGE_BATCH, default_value_t = 500)]
    pub purge_batch: u32,

    /// Group commit: most claims (or completes) that share one statement and one commit
    /// (1: no batching, every request runs its own statements).
    #[arg(long, env = state_env::STATE_API_BATCH_MAX, default_value_t = 64)]
    pub batch_max: usize,

    /// Group commit: statements running at once (requests running alone, and the one batch)
    /// before requests queue to share a statement; each holds a pool connection.
    #[arg(long, env = state_env::STATE_API_BATCH_IN_FLIGHT, default_value_t = 4)]
    pub batch_in_flight: usize,

    /// Group commit: most bytes of stored responses (bodies and headers) in one batch; a larger
    /// complete runs on its own.
    #[arg(long, env = state_env::STATE_API_BATCH_MAX_BYTES, default_value_t = 1_048_576)]
    pub batch_max_bytes: usize,

    /// Group commit: most requests queued for a batch (count); more are answered 503 at once.
    #[arg(long, env = state_env::STATE_API_BATCH_MAX_QUEUED, default_value_t = 1024)]
    pub batch_max_queued: usize,

    /// Group commit: most bytes of stored responses queued, or running alone because they are
    /// over `--batch-max-bytes`; more are answered 503 at once.
    #[arg(long, env = state_env::STATE_API_BATCH_MAX_QUEUED_BYTES, default_value_t = 64 * 1_048_576)]
    pub batch_max_queued_bytes: usize,

    /// The longest a claim or complete is worked on for its caller (ms): the caller's own
    /// timeout (the `idempotency-caller-timeout-ms` header the filter sends) when shorter. A job
    /// past it is dropped before it reaches Postgres, and answered 503.
    #[arg(long, env = state_env::STATE_API_MAX_REQUEST_MS, default_value_t = 35_000)]
    pub max_request_ms: u64,

    /// Threads that run requests (0: tokio's default, `TOKIO_WORKER_THREADS` or one per CPU). One by default: the state API waits on
    /// Postgres far more than it computes (about 50 µs of CPU per new key under load), and with
    /// two threads each request woke both (the idle one to look for work), which cost a new key
    /// 15 % of its latency at low load (bench/NOTES.md, sixteenth round). Raise it when one
    /// state API serves enough Envoys to keep a core busy.
    #[arg(long, env = state_env::STATE_API_WORKER_THREADS, default_value_t = 1)]
    pub worker_threads: usize,

    /// HTTPS on `--listen` (`--tls-cert`, `--tls-key`, `--tls-client-ca`); plain HTTP without.
    #[command(flatten)]
    pub tls: crate::tls::TlsArgs,

    /// Apply the migrations and exit.
    #[arg(long)]
    pub migrate_only: bool,

    /// Log as JSON lines instead of text.
    #[arg(long, env = state_env::STATE_API_LOG_JSON)]
    pub log_json: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error(
        "no key secret: pass --key-secret or set IDEM_KEY_SECRET (at least {MIN_KEY_SECRET_LEN} bytes; \
         every state API process sharing the database must use the same one)"
    )]
    MissingKeySecret,
    #[error("the key secret must be at least {MIN_KEY_SECRET_LEN} bytes long")]
    ShortKeySecret,
    #[error("--previous-key-secret is the same as --key-secret: a rotation needs a new secret")]
    SamePreviousKeySecret,
    #[error("the API token must not be empty")]
    EmptyApiToken,
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error(
        "--retention-s, --max-retention-s and --unknown-retention-s must be at most {MAX_RETENTION_S} (ten years)"
    )]
    RetentionTooLong,
    #[error(
        "--unknown-retention-s ({unknown} s) must be at least --retention-s ({retention} s): \
         an unknown outcome is kept at least as long as a completed one"
    )]
    UnknownRetentionTooShort { unknown: u64, retention: u64 },
    #[error("--max-wait-ms must be at most {} ms", contract::limits::MAX_WAIT_MS)]
    WaitTooLong,
    #[error("the admin token must be at least 16 characters and differ from --api-token")]
    WeakAdminToken,
    #[error("--batch-max must be at most {MAX_BATCH}")]
    BatchTooLarge,
    #[error(
        "--max-body-bytes must be at most {} (what filters may be configured to send)",
        contract::limits::MAX_STORED_BODY_BYTES
    )]
    BodyLimitTooLarge,
}

impl Config {
    /// Checks what clap cannot and returns the key secret.
    pub fn validate(&self) -> Result<&Secret, ConfigError> {
        let secret = self
            .key_secret
            .as_ref()
            .ok_or(ConfigError::MissingKeySecret)?;
        if secret.expose_secret().len() < MIN_KEY_SECRET_LEN {
            return Err(ConfigError::ShortKeySecret);
        }
        if let Some(previous) = &self.previous_key_secret {
            if previous.expose_secret().len() < MIN_KEY_SECRET_LEN {
                return Err(ConfigError::ShortKeySecret);
            }
            if previous.expose_secret() == secret.expose_secret() {
                return Err(ConfigError::SamePreviousKeySecret);
            }
        }
        if self.api_token.expose_secret().is_empty() {
            return Err(ConfigError::EmptyApiToken);
        }
        for (name, v) in [
            ("--pool-size", u64::from(self.pool_size)),
            ("--acquire-timeout-ms", self.acquire_timeout_ms),
            ("--retention-s", self.retention_s),
            ("--retry-after-cap-s", u64::from(self.retry_after_cap_s)),
            ("--purge-batch", u64::from(self.purge_batch)),
            ("--purge-pass-ms", self.purge_pass_ms),
            ("--batch-max", self.batch_max as u64),
            ("--batch-in-flight", self.batch_in_flight as u64),
            ("--batch-max-bytes", self.batch_max_bytes as u64),
            ("--batch-max-queued", self.batch_max_queued as u64),
            (
                "--batch-max-queued-bytes",
                self.batch_max_queued_bytes as u64,
            ),
            ("--max-request-ms", self.max_request_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.retention_s > MAX_RETENTION_S
            || self.max_retention_s > MAX_RETENTION_S
            || self.unknown_retention_s.unwrap_or(0) > MAX_RETENTION_S
        {
            return Err(ConfigError::RetentionTooLong);
        }
        if let Some(unknown) = self.unknown_retention_s {
            if unknown < self.retention_s {
                return Err(ConfigError::UnknownRetentionTooShort {
                    unknown,
                    retention: self.retention_s,
                });
            }
        }
        if self.max_wait_ms > contract::limits::MAX_WAIT_MS {
            return Err(ConfigError::WaitTooLong);
        }
        if let Some(admin) = &self.admin_token {
            if admin.expose_secret().len() < 16
                || admin.expose_secret() == self.api_token.expose_secret()
            {
                return Err(ConfigError::WeakAdminToken);
            }
        }
        if self.batch_max > MAX_BATCH {
            return Err(ConfigError::BatchTooLarge);
        }
        if self.max_body_bytes as u64 > contract::limits::MAX_STORED_BODY_BYTES {
            return Err(ConfigError::BodyLimitTooLarge);
        }
        Ok(secret)
    }

    /// The lease to grant: the caller's wish or the default, clamped.
    pub fn lease_for(&self, requested_ms: Option<u64>) -> u64 {
        requested_ms
            .unwrap_or(self.lease_ms)
            .clamp(MIN_LEASE_MS, MAX_LEASE_MS)
    }

    pub fn retention_ms(&self) -> i64 {
        i64::try_from(self.retention_s.saturating_mul(1000)).unwrap_or(i64::MAX)
    }

    /// How long a record marked unknown is kept from the mark (ms): `--unknown-retention-s`,
    /// else 7 days or `--retention-s` when that is longer.
    pub fn unknown_retention_ms(&self) -> i64 {
        let s = self
            .unknown_retention_s
            .unwrap_or(DEFAULT_UNKNOWN_RETENTION_S.max(self.retention_s));
        i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX)
    }

    /// The retention a claim gets (seconds): what it asks for, or the default, at most the
    /// maximum (a default over the maximum stays: the operator chose both).
    pub fn retention_for(&self, requested_s: Option<u64>) -> u64 {
        match requested_s {
            Some(r) => r.clamp(1, self.max_retention_s.max(1)),
            None => self.retention_s,
        }
    }

    /// How long a claim waits for a running key: what it asks, at most the maximum.
    pub fn wait_for(&self, requested_ms: Option<u64>) -> u64 {
        requested_ms.unwrap_or(0).min(self.max_wait_ms)
    }

    pub fn batch_limits(&self) -> crate::batch::BatchLimits {
        crate::batch::BatchLimits {
            max_items: self.batch_max,
            in_flight: self.batch_in_flight,
            max_bytes: self.batch_max_bytes,
            max_queued: self.batch_max_queued,
            max_queued_bytes: self.batch_max_queued_bytes,
        }
    }

    /// How long a request is worked on: the caller's timeout less a margin (a twentieth of it,
    /// at least 50 ms: so that the state API gives up first and knows that any later answer
    /// goes nowhere), at most `--max-request-ms`.
    pub fn request_budget(&self, caller_timeout_ms: Option<u64>) -> Duration {
        let ms = caller_timeout_ms.map_or(self.max_request_ms, |t| {
            let margin = (t / 20).max(50);
            t.saturating_sub(margin).max(1).min(self.max_request_ms)
        });
        Duration::from_millis(ms)
    }

    pub fn acquire_timeout(&self) -> Duration {
        Duration::from_millis(self.acquire_timeout_ms)
    }

    pub fn db_stall(&self) -> Duration {
        Duration::from_millis(self.db_stall_ms)
    }

    /// The HTTP body limit: a maximal stored body in base64 plus room for the JSON around it.
    pub fn http_body_limit(&self) -> usize {
        self.max_body_bytes
            .div_ceil(3)
            .saturating_mul(4)
            .saturating_add(64 * 1024)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Config {
        let mut all = vec![
            "state-api",
            "--database-url",
            "postgres://x@127.0.0.1/x",
            "--api-token",
            "t",
        ];
        all.extend_from_slice(args);
        Config::try_parse_from(all).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn refuses_to_start_without_a_key_secret() {
        let c = parse(&[]);
        // The environment of the test runner might carry one.
        if std::env::var_os(state_env::IDEM_KEY_SECRET).is_none() {
            assert_eq!(c.validate().err(), Some(ConfigError::MissingKeySecret));
        }
        assert_eq!(
            parse(&["--key-secret", "short"]).validate().err(),
            Some(ConfigError::ShortKeySecret)
        );
        assert!(parse(&["--key-secret", "0123456789abcdef"])
            .validate()
            .is_ok());
    }

    #[test]
    fn leases_are_clamped() {
        let c = parse(&[]);
        assert_eq!(c.lease_for(None), 30_000);
        assert_eq!(c.lease_for(Some(1)), MIN_LEASE_MS);
        assert_eq!(c.lease_for(Some(u64::MAX)), MAX_LEASE_MS);
    }

    #[test]
    fn secrets_are_not_printed() {
        let c = parse(&["--key-secret", "0123456789abcdef"]);
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("0123456789abcdef") && !dbg.contains("postgres://"));
    }

    #[test]
    fn batching_is_on_by_default_and_bounded() {
        let ok = |c: Config| c.validate().map(|_| ()).err();
        let c = parse(&["--key-secret", "0123456789abcdef"]);
        assert_eq!((c.batch_max, c.batch_in_flight), (64, 4));
        assert_eq!(c.batch_limits().max_bytes, 1_048_576);
        assert_eq!(
            ok(parse(&[
                "--key-secret",
                "0123456789abcdef",
                "--batch-max",
                "0"
            ])),
            Some(ConfigError::Zero("--batch-max"))
        );
        assert_eq!(
            ok(parse(&[
                "--key-secret",
                "0123456789abcdef",
                "--batch-in-flight",
                "0"
            ])),
            Some(ConfigError::Zero("--batch-in-flight"))
        );
        assert_eq!(
            ok(parse(&[
                "--key-secret",
                "0123456789abcdef",
                "--batch-max",
                "1001"
            ])),
            Some(ConfigError::BatchTooLarge)
        );
        assert_eq!(
            ok(parse(&[
                "--key-secret",
                "0123456789abcdef",
                "--batch-max",
                "1"
            ])),
            None
        );
    }

    #[test]
    fn unknown_outcomes_are_kept_7_days_and_never_less_than_the_retention() {
        let secret = ["--key-secret", "0123456789abcdef"];
        let with = |args: &[&str]| parse(&[&secret[..], args].concat());
        assert_eq!(with(&[]).unknown_retention_ms(), 604_800_000);
        // A default retention longer than 7 days: unknown outcomes are kept that long too.
        let long = with(&["--retention-s", "2592000"]);
        assert_eq!(long.validate().err(), None);
        assert_eq!(long.unknown_retention_ms(), 2_592_000_000);
        let set = with(&["--retention-s", "60", "--unknown-retention-s", "120"]);
        assert_eq!(set.validate().err(), None);
        assert_eq!(set.unknown_retention_ms(), 120_000);
        let short = with(&["--retention-s", "86400", "--unknown-retention-s", "3600"]);
        let err = short.validate().err();
        assert_eq!(
            err,
            Some(ConfigError::UnknownRetentionTooShort {
                unknown: 3_600,
                retention: 86_400
            })
        );
        let text = err.unwrap().to_string();
        assert!(
            text.contains(
                "--unknown-retention-s (3600 s) must be at least --retention-s (86400 s)"
            ),
            "{text}"
        );
        assert_eq!(
            with(&["--unknown-retention-s", "0"]).validate().err(),
            Some(ConfigError::UnknownRetentionTooShort {
                unknown: 0,
                retention: 86_400
            })
        );
        assert_eq!(
            with(&["--unknown-retention-s", "999999999999"])
                .validate()
                .err(),
            Some(ConfigError::RetentionTooLong)
        );
    }

    #[test]
    fn one_worker_thread_by_default() {
        assert_eq!(parse(&[]).worker_threads, 1);
        assert_eq!(parse(&["--worker-threads", "0"]).worker_threads, 0);
    }

    #[test]
    fn body_limit_fits_base64_of_the_max_body() {
        let c = parse(&[]);
        assert!(c.http_body_limit() > c.max_body_bytes * 4 / 3 + 1000);
    }

    #[test]
    fn the_variables_it_reads_are_the_ones_the_contract_lists() {
        use clap::CommandFactory as _;
        let mut read: Vec<String> = Config::command()
            .get_arguments()
            .filter_map(|a| a.get_env())
            .map(|e| e.to_string_lossy().into_owned())
            .collect();
        read.sort_unstable();
        let mut listed: Vec<String> = state_env::ALL.iter().map(|n| (*n).to_owned()).collect();
        listed.sort_unstable();
        assert_eq!(
            read, listed,
            "contract::state_env::ALL and the flags' variables differ"
        );
    }
}
