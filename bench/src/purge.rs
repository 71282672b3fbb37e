//! How fast the purge deletes a backlog of expired records: `BENCH_PURGE_ROWS` expired rows are
//! inserted straight into the table, a state API with a one-second purge interval is started on
//! the stack's database, and the backlog's rows still in the table are counted until none is
//! left. Every state API of the run on that database purges (the stack's own every 10 s), so
//! the figure is the deployment's, as with several replicas; the time runs from the moment the
//! backlog is in place, so the purger's start and the pauses between passes (the purge takes at
//! most half the database's time while a backlog lasts) are in it.

use contract::state_env;
use std::time::{Duration, Instant};

use serde::Serialize;
use test_support::stack::Stack;

#[derive(Debug, Clone, Serialize)]
pub struct PurgeCapacity {
    pub rows: u64,
    pub seconds: f64,
    pub rows_per_s: f64,
    /// The highest new-key rate measured in this run, and which scenario gave it.
    pub highest_new_keys_per_s: f64,
    pub highest_new_keys_scenario: String,
    pub ratio: f64,
}

/// The value of metric `name` (with its labels, e.g. `x_total{end="cleared"}`) in a /metrics text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
}

pub fn measure(stack: &Stack, rows: u64) -> Result<(u64, f64), String> {
    stack.postgres.psql(
        stack.database_name(),
        &format!(
            "INSERT INTO idempotency_records (scope_hash, subject, endpoint, fingerprint_alg, \
               fingerprint, state, fencing_token, lease_expires_at, created_at, expires_at, \
               completed_at, response_status, response_headers, response_body, response_replayable) \
             SELECT sha256(('bench-purge-' || i)::bytea), 'bench-purge', 'POST /checkout', 'a', \
               repeat('ab', 32), 'completed', nextval('idempotency_fencing_token_seq'), \
               now() - interval '2 hours', now() - interval '2 hours', now() - interval '1 minute', \
               now() - interval '2 hours', 201, '[]', convert_to(repeat('x', 200), 'UTF8'), true \
             FROM generate_series(1, {rows}) i"
        ),
    )?;
    stack
        .postgres
        .psql(stack.database_name(), "VACUUM ANALYZE idempotency_records")?;
    let started = Instant::now();
    let _purger =
        stack.start_extra_state_api_with(&[(state_env::STATE_API_PURGE_INTERVAL_S, "1")])?;
    let deadline = started + Duration::from_secs(300);
    loop {
        let left: u64 = stack
            .postgres
            .psql(
                stack.database_name(),
                "SELECT count(*) FROM idempotency_records WHERE subject = 'bench-purge'",
            )?
            .trim()
            .parse()
            .map_err(|e| format!("the count of the backlog: {e}"))?;
        if left == 0 {
            return Ok((rows, started.elapsed().as_secs_f64()));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the purge deleted {} of {rows} rows in 300 s",
                rows.saturating_sub(left)
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
