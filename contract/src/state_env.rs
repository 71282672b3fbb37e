//! The state API's environment: the name of the variable each of its flags reads (`state-api
//! --help` lists them with the flags), written once for the state API (its flags read them),
//! the launchers that start it (`edge run`, the tests, the benchmark) and what they render.

use std::fmt::Display;

/// The Postgres URL (`--database-url`).
pub const DATABASE_URL: &str = "DATABASE_URL";
/// The address to listen on (`--listen`).
pub const LISTEN_ADDR: &str = "LISTEN_ADDR";
/// The bearer token of every `/v1` call (`--api-token`).
pub const STATE_API_TOKEN: &str = "STATE_API_TOKEN";
/// The secret of the HMAC that addresses records (`--key-secret`).
pub const IDEM_KEY_SECRET: &str = "IDEM_KEY_SECRET";
/// During a rotation of the key secret: the one before (`--previous-key-secret`).
pub const IDEM_PREVIOUS_KEY_SECRET: &str = "IDEM_PREVIOUS_KEY_SECRET";
/// The AES-256 key that seals stored responses (`--storage-key`).
pub const STATE_API_STORAGE_KEY: &str = "STATE_API_STORAGE_KEY";
/// A file holding the storage key (`--storage-key-file`).
pub const STATE_API_STORAGE_KEY_FILE: &str = "STATE_API_STORAGE_KEY_FILE";
/// During a rotation of the storage key: the one before (`--previous-storage-key`).
pub const STATE_API_PREVIOUS_STORAGE_KEY: &str = "STATE_API_PREVIOUS_STORAGE_KEY";
pub const STATE_API_POOL_SIZE: &str = "STATE_API_POOL_SIZE";
pub const STATE_API_ACQUIRE_TIMEOUT_MS: &str = "STATE_API_ACQUIRE_TIMEOUT_MS";
pub const STATE_API_POOL_PING: &str = "STATE_API_POOL_PING";
pub const STATE_API_POOL_PING_IDLE_MS: &str = "STATE_API_POOL_PING_IDLE_MS";
pub const STATE_API_STATEMENT_TIMEOUT_MS: &str = "STATE_API_STATEMENT_TIMEOUT_MS";
pub const STATE_API_DB_STALL_MS: &str = "STATE_API_DB_STALL_MS";
pub const STATE_API_LEASE_MS: &str = "STATE_API_LEASE_MS";
pub const STATE_API_RETENTION_S: &str = "STATE_API_RETENTION_S";
/// How long an unknown outcome is kept (`--unknown-retention-s`).
pub const STATE_API_UNKNOWN_RETENTION_S: &str = "STATE_API_UNKNOWN_RETENTION_S";
pub const STATE_API_MAX_RETENTION_S: &str = "STATE_API_MAX_RETENTION_S";
pub const STATE_API_MAX_WAIT_MS: &str = "STATE_API_MAX_WAIT_MS";
pub const STATE_API_MAX_WAITERS: &str = "STATE_API_MAX_WAITERS";
pub const STATE_API_WAIT_POLL_MS: &str = "STATE_API_WAIT_POLL_MS";
/// The bearer token of the admin API (`--admin-token`).
pub const STATE_API_ADMIN_TOKEN: &str = "STATE_API_ADMIN_TOKEN";
pub const STATE_API_RETRY_AFTER_CAP_S: &str = "STATE_API_RETRY_AFTER_CAP_S";
pub const STATE_API_MAX_BODY_BYTES: &str = "STATE_API_MAX_BODY_BYTES";
pub const STATE_API_PURGE_INTERVAL_S: &str = "STATE_API_PURGE_INTERVAL_S";
pub const STATE_API_PURGE_PASS_MS: &str = "STATE_API_PURGE_PASS_MS";
pub const STATE_API_PURGE_BATCH: &str = "STATE_API_PURGE_BATCH";
pub const STATE_API_BATCH_MAX: &str = "STATE_API_BATCH_MAX";
pub const STATE_API_BATCH_IN_FLIGHT: &str = "STATE_API_BATCH_IN_FLIGHT";
pub const STATE_API_BATCH_MAX_BYTES: &str = "STATE_API_BATCH_MAX_BYTES";
pub const STATE_API_BATCH_MAX_QUEUED: &str = "STATE_API_BATCH_MAX_QUEUED";
pub const STATE_API_BATCH_MAX_QUEUED_BYTES: &str = "STATE_API_BATCH_MAX_QUEUED_BYTES";
pub const STATE_API_MAX_REQUEST_MS: &str = "STATE_API_MAX_REQUEST_MS";
pub const STATE_API_WORKER_THREADS: &str = "STATE_API_WORKER_THREADS";
pub const STATE_API_LOG_JSON: &str = "STATE_API_LOG_JSON";
/// HTTPS: the certificate chain (`--tls-cert`).
pub const STATE_API_TLS_CERT: &str = "STATE_API_TLS_CERT";
/// HTTPS: the certificate's private key (`--tls-key`).
pub const STATE_API_TLS_KEY: &str = "STATE_API_TLS_KEY";
/// HTTPS: the CA that signs the client certificates it requires (`--tls-client-ca`).
pub const STATE_API_TLS_CLIENT_CA: &str = "STATE_API_TLS_CLIENT_CA";

/// Every variable the state API reads (its `state-api --help`; a test of the state API holds
/// this list to its flags).
pub const ALL: &[&str] = &[
    DATABASE_URL,
    LISTEN_ADDR,
    STATE_API_TOKEN,
    IDEM_KEY_SECRET,
    IDEM_PREVIOUS_KEY_SECRET,
    STATE_API_STORAGE_KEY,
    STATE_API_STORAGE_KEY_FILE,
    STATE_API_PREVIOUS_STORAGE_KEY,
    STATE_API_POOL_SIZE,
    STATE_API_ACQUIRE_TIMEOUT_MS,
    STATE_API_POOL_PING,
    STATE_API_POOL_PING_IDLE_MS,
    STATE_API_STATEMENT_TIMEOUT_MS,
    STATE_API_DB_STALL_MS,
    STATE_API_LEASE_MS,
    STATE_API_RETENTION_S,
    STATE_API_UNKNOWN_RETENTION_S,
    STATE_API_MAX_RETENTION_S,
    STATE_API_MAX_WAIT_MS,
    STATE_API_MAX_WAITERS,
    STATE_API_WAIT_POLL_MS,
    STATE_API_ADMIN_TOKEN,
    STATE_API_RETRY_AFTER_CAP_S,
    STATE_API_MAX_BODY_BYTES,
    STATE_API_PURGE_INTERVAL_S,
    STATE_API_PURGE_PASS_MS,
    STATE_API_PURGE_BATCH,
    STATE_API_BATCH_MAX,
    STATE_API_BATCH_IN_FLIGHT,
    STATE_API_BATCH_MAX_BYTES,
    STATE_API_BATCH_MAX_QUEUED,
    STATE_API_BATCH_MAX_QUEUED_BYTES,
    STATE_API_MAX_REQUEST_MS,
    STATE_API_WORKER_THREADS,
    STATE_API_LOG_JSON,
    STATE_API_TLS_CERT,
    STATE_API_TLS_KEY,
    STATE_API_TLS_CLIENT_CA,
];

/// The variables every state API needs, as [`required`] writes them.
pub const REQUIRED: [&str; 4] = [DATABASE_URL, LISTEN_ADDR, STATE_API_TOKEN, IDEM_KEY_SECRET];

/// The environment every state API needs: its database, its address, its token and its key
/// secret; a launcher adds the settings it changes.
pub fn required(
    database_url: &str,
    listen: impl Display,
    token: &str,
    key_secret: &str,
) -> Vec<(String, String)> {
    [
        database_url.to_owned(),
        listen.to_string(),
        token.to_owned(),
        key_secret.to_owned(),
    ]
    .into_iter()
    .zip(REQUIRED)
    .map(|(value, name)| (name.to_owned(), value))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_the_required_ones_are_listed() {
        let mut names = ALL.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len(), "a name is listed twice");
        assert!(REQUIRED.iter().all(|r| ALL.contains(r)));
        let env = required("postgres://x", "127.0.0.1:8081", "t", "s");
        assert_eq!(env[0], (DATABASE_URL.to_owned(), "postgres://x".to_owned()));
        assert_eq!(
            env[1],
            (LISTEN_ADDR.to_owned(), "127.0.0.1:8081".to_owned())
        );
        assert_eq!(env.len(), REQUIRED.len());
    }
}
