//! How fast the purge deletes a backlog of expired records: a state API with a one-second
//! purge interval is started on the stack's database after `BENCH_PURGE_ROWS` expired rows were
//! inserted straight into the table, and its `state_api_purged_rows_total` is watched until
//! they are gone. The rate is rows over the time from its first pass (one interval after it
//! was ready) to the last row, so the pauses between passes (the purge takes at most half the
//! database's time while a backlog lasts) are in it. The stack's own state API purges too (every
//! 10 s): the rows deleted are both processes' (counted from before the backlog was inserted), as
//! in a deployment of two state APIs, and the figure is the deployment's.

use std::time::{Duration, Instant};

use serde::Serialize;
use stack::stack::Stack;

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

fn purged(port: u16) -> u64 {
    let text = stack::envoy::http_get_blocking(port, "/metrics").unwrap_or_default();
    metric(&text, "state_api_purged_rows_total").map_or(0, |v| v as u64)
}

pub fn measure(stack: &Stack, rows: u64) -> Result<(u64, f64), String> {
    // Before the backlog: what the stack's state API has purged already.
    let by_the_stack_before = purged(stack.state_api.port);
    stack.postgres.psql(
        stack.database_name(),
        &format!(
            "INSERT INTO idempotency_records (scope_hash, subject, endpoint, fingerprint_alg, \
               fingerprint, state, fencing_token, lease_expires_at, created_at, expires_at, \
               completed_at, response_status, response_headers, response_body, response_replayable) \
             SELECT sha256(('bench-purge-' || i)::bytea), 'bench', 'POST /checkout', 'a', \
               repeat('ab', 32), 'completed', nextval('idempotency_fencing_token_seq'), \
               now() - interval '2 hours', now() - interval '2 hours', now() - interval '1 minute', \
               now() - interval '2 hours', 201, '[]', convert_to(repeat('x', 200), 'UTF8'), true \
             FROM generate_series(1, {rows}) i"
        ),
    )?;
    stack
        .postgres
        .psql(stack.database_name(), "VACUUM ANALYZE idempotency_records")?;
    let purger = stack.start_extra_state_api_with(&[("STATE_API_PURGE_INTERVAL_S", "1")])?;
    let first_pass = Instant::now() + Duration::from_secs(1);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let done =
            purged(purger.port) + purged(stack.state_api.port).saturating_sub(by_the_stack_before);
        if done >= rows {
            let seconds = first_pass.elapsed().as_secs_f64();
            return Ok((done, seconds));
        }
        if Instant::now() > deadline {
            return Err(format!("the purge deleted {done} of {rows} rows in 300 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
