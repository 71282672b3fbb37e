//! The state API's Prometheus metrics, on `prometheus-client`: a fixed set of counters,
//! gauges and histograms, rendered in the OpenMetrics text format at `GET /metrics`.
//!
//! Every label value is known at compile time (no label can carry a key or a subject), and
//! each labelled series is resolved once, at start: counting a request takes no lock and no
//! lookup.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use contract::wire::ClaimResponse;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The fenced writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOp {
    Heartbeat,
    Complete,
    Release,
    /// An owner marked its record's outcome unknown.
    Unknown,
    /// A claim whose answer never reached the filter was given back.
    Abandon,
}

impl WriteOp {
    const ALL: [Self; 5] = [
        Self::Heartbeat,
        Self::Complete,
        Self::Release,
        Self::Unknown,
        Self::Abandon,
    ];
    pub fn label(self) -> &'static str {
        match self {
            Self::Heartbeat => "heartbeat",
            Self::Complete => "complete",
            Self::Release => "release",
            Self::Unknown => "unknown",
            Self::Abandon => "abandon",
        }
    }
}

/// How a waiting claim (`Prefer: wait`) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    /// The record settled (completed, released, unknown) while it waited.
    Settled,
    /// Still in progress at the deadline.
    TimedOut,
    /// As many claims waited already: answered at once.
    Refused,
    /// A look failed in a way that may have committed a claim (a stall, a broken connection,
    /// a failed batch): answered 503, so that the filter gives the claim back by its nonce.
    Failed,
}

impl WaitEnd {
    const ALL: [Self; 4] = [Self::Settled, Self::TimedOut, Self::Refused, Self::Failed];
    pub fn label(self) -> &'static str {
        match self {
            Self::Settled => "settled",
            Self::TimedOut => "timed_out",
            Self::Refused => "refused",
            Self::Failed => "failed",
        }
    }
}

/// Operator actions of the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminOp {
    Release,
    Resolve,
    Purge,
}

impl AdminOp {
    const ALL: [Self; 3] = [Self::Release, Self::Resolve, Self::Purge];
    pub fn label(self) -> &'static str {
        match self {
            Self::Release => "release",
            Self::Resolve => "resolve",
            Self::Purge => "purge",
        }
    }
}

/// Routes measured by the latency histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Claim,
    Claims,
    Heartbeat,
    Complete,
    Completes,
    Writes,
    Release,
    Unknown,
    Abandon,
    Records,
    Other,
}

impl Route {
    const ALL: [Self; 11] = [
        Self::Claim,
        Self::Claims,
        Self::Heartbeat,
        Self::Complete,
        Self::Completes,
        Self::Writes,
        Self::Release,
        Self::Unknown,
        Self::Abandon,
        Self::Records,
        Self::Other,
    ];
    pub fn label(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Claims => "claims",
            Self::Heartbeat => "heartbeat",
            Self::Complete => "complete",
            Self::Completes => "completes",
            Self::Writes => "writes",
            Self::Release => "release",
            Self::Unknown => "unknown",
            Self::Abandon => "abandon",
            Self::Records => "records",
            Self::Other => "other",
        }
    }
    pub fn from_path(path: &str) -> Self {
        match path {
            contract::wire::CLAIM_PATH => Self::Claim,
            contract::wire::CLAIMS_PATH => Self::Claims,
            contract::wire::COMPLETES_PATH => Self::Completes,
            contract::wire::WRITES_PATH => Self::Writes,
            contract::wire::HEARTBEAT_PATH => Self::Heartbeat,
            contract::wire::COMPLETE_PATH => Self::Complete,
            contract::wire::RELEASE_PATH => Self::Release,
            contract::wire::UNKNOWN_PATH => Self::Unknown,
            contract::wire::ABANDON_PATH => Self::Abandon,
            contract::wire::RECORDS_PATH => Self::Records,
            _ => Self::Other,
        }
    }
}

/// The requests the group commit batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchOp {
    Claim,
    Complete,
}

impl BatchOp {
    const ALL: [Self; 2] = [Self::Claim, Self::Complete];
    pub fn label(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Complete => "complete",
        }
    }
}

/// Why a request of the group commit ran the single-row statements instead of a batch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinglePathReason {
    /// Its scope was already in the batch being taken, or in a running one.
    Duplicate,
    /// A complete over the batch byte cap.
    Oversize,
    /// The batch statement did not settle it (a claim that lost a race or found an expired
    /// lease or retention; a complete that matched no in-progress record of its token).
    AfterBatch,
}

impl SinglePathReason {
    const ALL: [Self; 3] = [Self::Duplicate, Self::Oversize, Self::AfterBatch];
    pub fn label(self) -> &'static str {
        match self {
            Self::Duplicate => "duplicate",
            Self::Oversize => "oversize",
            Self::AfterBatch => "after_batch",
        }
    }
}

/// Why a claim or complete was answered 503 without reaching Postgres.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// The group commit's queue was at its bound (count or bytes).
    QueueFull,
    /// Its caller's time ran out while it waited (queued, or for a pool connection).
    Deadline,
}

impl Shed {
    const ALL: [Self; 2] = [Self::QueueFull, Self::Deadline];
    pub fn label(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::Deadline => "deadline",
        }
    }
}

/// Upper bounds of the batch size histogram (requests per statement).
const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Upper bounds in seconds: the interesting range is 0.2 ms .. 100 ms.
const LATENCY_BUCKETS: [f64; 12] = [
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
];

/// One label per series: `(name, value)`.
type Labels = [(&'static str, &'static str); 1];

/// A labelled family whose series are all created up front, each kept as its own handle.
fn counters<const N: usize>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    label: &'static str,
    values: [&'static str; N],
) -> [Counter; N] {
    let family = Family::<Labels, Counter>::default();
    registry.register(name, help, family.clone());
    values.map(|v| family.get_or_create(&[(label, v)]).clone())
}

fn counter(registry: &mut Registry, name: &str, help: &str) -> Counter {
    let c = Counter::default();
    registry.register(name, help, c.clone());
    c
}

/// The counters, histograms and gauges, and the registry that renders them.
pub struct Metrics {
    registry: Registry,
    claims: [Counter; ClaimResponse::LABELS.len()],
    reclaims: Counter,
    fenced_out: [Counter; WriteOp::ALL.len()],
    writes: [Counter; WriteOp::ALL.len()],
    waits: [Counter; WaitEnd::ALL.len()],
    admin: [Counter; AdminOp::ALL.len()],
    purged_rows: Counter,
    /// Passes that cleared the backlog, passes whose time ran out first.
    purge_passes: [Counter; 2],
    shed: [Counter; Shed::ALL.len()],
    released_for_gone: Counter,
    previous_secret_hits: Counter,
    unopenable: Counter,
    /// unavailable (503), internal (500)
    errors: [Counter; 2],
    latency: [Histogram; Route::ALL.len()],
    batch_sizes: Histogram,
    /// The histogram keeps its count and sum to itself: the tests read them from here.
    batch_statements: AtomicU64,
    batch_requests: AtomicU64,
    batch_single: [[Counter; SinglePathReason::ALL.len()]; BatchOp::ALL.len()],
    pool_connections: [Gauge; 2],
    pool_max: Gauge,
    db_given_up: Counter,
}

/// The pool's state at scrape time.
#[derive(Debug, Clone, Copy)]
pub struct PoolGauges {
    pub size: u32,
    pub idle: u32,
    pub max: u32,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let claims = counters(
            &mut r,
            "state_api_claims",
            "Claims answered, by outcome (reclaimed: took over an expired lease)",
            "outcome",
            ClaimResponse::LABELS,
        );
        let reclaims = counter(
            &mut r,
            "state_api_reclaims",
            "Claims that took over an in-progress record whose lease had run out",
        );
        let fenced_out = counters(
            &mut r,
            "state_api_fenced_out",
            "Writes refused because a newer claim owns the record",
            "op",
            WriteOp::ALL.map(WriteOp::label),
        );
        let writes = counters(
            &mut r,
            "state_api_writes",
            "Fenced writes that succeeded",
            "op",
            WriteOp::ALL.map(WriteOp::label),
        );
        let waits = counters(
            &mut r,
            "state_api_waits",
            "Claims that waited for a running key (Prefer: wait), by how the wait ended",
            "end",
            WaitEnd::ALL.map(WaitEnd::label),
        );
        let admin = counters(
            &mut r,
            "state_api_admin_actions",
            "Operator actions of the admin API (each one audited)",
            "action",
            AdminOp::ALL.map(AdminOp::label),
        );
        let purged_rows = counter(
            &mut r,
            "state_api_purged_rows",
            "Expired records deleted by the purge",
        );
        let purge_passes = counters(
            &mut r,
            "state_api_purge_passes",
            "Passes of the purge: cleared (no expired rows left) or backlog (its time ran out first: the next pass follows soon)",
            "end",
            ["cleared", "backlog"],
        );
        let shed = counters(
            &mut r,
            "state_api_shed",
            "Claims and completes answered 503 without reaching Postgres: the group commit's queue was full, or the caller's time ran out",
            "reason",
            Shed::ALL.map(Shed::label),
        );
        let released_for_gone = counter(
            &mut r,
            "state_api_released_for_gone_callers",
            "Claims committed after their caller had given up (a slow or paused Postgres), released at once: nothing was forwarded with them",
        );
        let previous_secret_hits = counter(
            &mut r,
            "state_api_previous_key_secret_hits",
            "Requests whose record was found under --previous-key-secret (a rotation of the key secret)",
        );
        let unopenable = counter(
            &mut r,
            "state_api_unopenable_responses",
            "Stored responses that did not open under the storage keys (tampered, moved between records, or sealed under a key this process lacks): answered 500, never replayed",
        );
        let errors = counters(
            &mut r,
            "state_api_errors",
            "Requests answered with 503 (database unavailable) or 500",
            "kind",
            ["unavailable", "internal"],
        );
        let latency_family =
            Family::<Labels, Histogram>::new_with_constructor(|| Histogram::new(LATENCY_BUCKETS));
        r.register(
            "state_api_request_duration_seconds",
            "Time to answer a request, by route",
            latency_family.clone(),
        );
        let latency = Route::ALL.map(|route| {
            latency_family
                .get_or_create(&[("route", route.label())])
                .clone()
        });
        let batch_sizes = Histogram::new(BATCH_BUCKETS);
        r.register(
            "state_api_batch_size",
            "Requests (claims and completes) per statement of the group commit (1: the single-row statements)",
            batch_sizes.clone(),
        );
        let single_family = Family::<[(&'static str, &'static str); 2], Counter>::default();
        r.register(
            "state_api_batch_single_path",
            "Requests of the group commit run on the single-row statements instead, by op and reason",
            single_family.clone(),
        );
        let batch_single = BatchOp::ALL.map(|op| {
            SinglePathReason::ALL.map(|why| {
                single_family
                    .get_or_create(&[("op", op.label()), ("reason", why.label())])
                    .clone()
            })
        });
        let pool_family = Family::<Labels, Gauge>::default();
        r.register(
            "state_api_db_pool_connections",
            "Database connections, by state",
            pool_family.clone(),
        );
        let pool_connections =
            ["idle", "in_use"].map(|s| pool_family.get_or_create(&[("state", s)]).clone());
        let pool_max = Gauge::default();
        r.register(
            "state_api_db_pool_max_connections",
            "The pool's maximum size",
            pool_max.clone(),
        );
        let db_given_up = Counter::default();
        r.register(
            "state_api_db_connections_given_up",
            "Database connections closed because a round trip went unanswered past --db-stall-ms (a dead link)",
            db_given_up.clone(),
        );
        Self {
            registry: r,
            claims,
            reclaims,
            fenced_out,
            writes,
            waits,
            admin,
            purged_rows,
            purge_passes,
            shed,
            released_for_gone,
            previous_secret_hits,
            unopenable,
            errors,
            latency,
            batch_sizes,
            batch_statements: AtomicU64::new(0),
            batch_requests: AtomicU64::new(0),
            batch_single,
            pool_connections,
            pool_max,
            db_given_up,
        }
    }
}

fn get(c: &Counter) -> u64 {
    c.get()
}

impl Metrics {
    pub fn claim(&self, answer: &ClaimResponse) {
        let label = answer.label();
        if let Some(i) = ClaimResponse::LABELS.iter().position(|l| *l == label) {
            self.claims[i].inc();
        }
        if matches!(
            answer,
            ClaimResponse::Claimed {
                reclaimed: true,
                ..
            }
        ) {
            self.reclaims.inc();
        }
    }
    pub fn fenced_out(&self, op: WriteOp) {
        self.fenced_out[op as usize].inc();
    }
    pub fn write_ok(&self, op: WriteOp) {
        self.writes[op as usize].inc();
    }
    pub fn wait(&self, end: WaitEnd) {
        self.waits[end as usize].inc();
    }
    pub fn waits_total(&self, end: WaitEnd) -> u64 {
        get(&self.waits[end as usize])
    }
    pub fn admin(&self, op: AdminOp) {
        self.admin[op as usize].inc();
    }
    pub fn purge_pass(&self, pass: &crate::store::PurgePass) {
        self.purged_rows.inc_by(pass.rows);
        self.purge_passes[usize::from(pass.backlog)].inc();
    }
    pub fn db_unavailable(&self) {
        self.errors[0].inc();
    }
    pub fn internal_error(&self) {
        self.errors[1].inc();
    }
    /// A request answered 503 without reaching Postgres: the queue was full, or its caller's
    /// time ran out first.
    pub fn shed(&self, why: Shed) {
        self.shed[why as usize].inc();
    }
    pub fn shed_total(&self, why: Shed) -> u64 {
        get(&self.shed[why as usize])
    }
    /// A claim committed after its caller had given up, released again.
    pub fn released_for_gone_caller(&self) {
        self.released_for_gone.inc();
    }
    pub fn released_for_gone_total(&self) -> u64 {
        get(&self.released_for_gone)
    }
    /// A record found under the previous key secret (a rotation still has work to do).
    pub fn previous_secret_hit(&self) {
        self.previous_secret_hits.inc();
    }
    /// Counts `e` when it is a stored response that did not open.
    pub fn count_unopenable(&self, e: &crate::store::StoreError) {
        if e.is_unopenable() {
            self.unopenable.inc();
        }
    }
    pub fn unopenable_total(&self) -> u64 {
        get(&self.unopenable)
    }
    pub fn observe(&self, route: Route, d: Duration) {
        self.latency[route as usize].observe(d.as_secs_f64());
    }
    /// A statement (or, for 1, the single-row statements) run for `n` requests by the group commit.
    pub fn batch_size(&self, n: usize) {
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        self.batch_sizes.observe(n as f64);
        self.batch_statements.fetch_add(1, Relaxed);
        self.batch_requests.fetch_add(n, Relaxed);
    }
    pub fn batch_single_path(&self, op: BatchOp, why: SinglePathReason) {
        self.batch_single[op as usize][why as usize].inc();
    }
    /// (statements, requests) of the group commit.
    pub fn batch_totals(&self) -> (u64, u64) {
        (
            self.batch_statements.load(Relaxed),
            self.batch_requests.load(Relaxed),
        )
    }
    pub fn fenced_out_total(&self, op: WriteOp) -> u64 {
        get(&self.fenced_out[op as usize])
    }
    pub fn purged_total(&self) -> u64 {
        get(&self.purged_rows)
    }

    /// The counter of connections the store gives up (it counts them itself).
    pub fn db_connections_given_up(&self) -> Counter {
        self.db_given_up.clone()
    }

    /// The OpenMetrics text format, with the pool's state at this moment.
    pub fn render(&self, pool: PoolGauges) -> String {
        let [idle, in_use] = &self.pool_connections;
        idle.set(i64::from(pool.idle));
        in_use.set(i64::from(pool.size.saturating_sub(pool.idle)));
        self.pool_max.set(i64::from(pool.max));
        let mut out = String::with_capacity(8192);
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_cumulative_buckets() {
        let m = Metrics::default();
        m.claim(&ClaimResponse::claimed(1, 1000, false));
        m.claim(&ClaimResponse::claimed(2, 1000, false));
        m.claim(&ClaimResponse::claimed(3, 1000, true));
        m.fenced_out(WriteOp::Complete);
        m.observe(Route::Claim, Duration::from_micros(700));
        let text = m.render(PoolGauges {
            size: 3,
            idle: 1,
            max: 16,
        });
        for line in [
            "state_api_claims_total{outcome=\"claimed\"} 2\n",
            "state_api_claims_total{outcome=\"reclaimed\"} 1\n",
            "state_api_claims_total{outcome=\"mismatch\"} 0\n",
            "state_api_reclaims_total 1\n",
            "state_api_fenced_out_total{op=\"complete\"} 1\n",
            "state_api_request_duration_seconds_bucket{le=\"0.0005\",route=\"claim\"} 0\n",
            "state_api_request_duration_seconds_bucket{le=\"0.001\",route=\"claim\"} 1\n",
            "state_api_request_duration_seconds_bucket{le=\"+Inf\",route=\"claim\"} 1\n",
            "state_api_request_duration_seconds_count{route=\"claim\"} 1\n",
            "state_api_db_pool_connections{state=\"in_use\"} 2\n",
            "state_api_db_pool_max_connections 16\n",
            "# EOF\n",
        ] {
            assert!(text.contains(line), "{line} missing in:\n{text}");
        }
    }

    #[test]
    fn batch_sizes_are_a_cumulative_histogram() {
        let m = Metrics::default();
        for n in [1, 1, 3, 64, 300] {
            m.batch_size(n);
        }
        m.batch_single_path(BatchOp::Complete, SinglePathReason::AfterBatch);
        assert_eq!(m.batch_totals(), (5, 369));
        let text = m.render(PoolGauges {
            size: 0,
            idle: 0,
            max: 16,
        });
        for line in [
            "state_api_batch_size_bucket{le=\"1.0\"} 2\n",
            "state_api_batch_size_bucket{le=\"2.0\"} 2\n",
            "state_api_batch_size_bucket{le=\"4.0\"} 3\n",
            "state_api_batch_size_bucket{le=\"64.0\"} 4\n",
            "state_api_batch_size_bucket{le=\"256.0\"} 4\n",
            "state_api_batch_size_bucket{le=\"+Inf\"} 5\n",
            "state_api_batch_size_sum 369.0\n",
            "state_api_batch_size_count 5\n",
            "state_api_batch_single_path_total{op=\"complete\",reason=\"after_batch\"} 1\n",
            "state_api_batch_single_path_total{op=\"claim\",reason=\"duplicate\"} 0\n",
        ] {
            assert!(text.contains(line), "{line} missing in:\n{text}");
        }
    }
}
