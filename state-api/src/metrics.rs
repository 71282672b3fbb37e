//! A small Prometheus registry on atomics: a fixed set of counters and one histogram.
//!
//! Every label value is known at compile time, so nothing here allocates per request and no
//! label can carry a key or a subject.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Outcomes of `POST /v1/claim`, as labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOutcome {
    Claimed,
    Reclaimed,
    InProgress,
    Completed,
    Mismatch,
    Unknown,
}

impl ClaimOutcome {
    const ALL: [Self; 6] = [
        Self::Claimed,
        Self::Reclaimed,
        Self::InProgress,
        Self::Completed,
        Self::Mismatch,
        Self::Unknown,
    ];
    fn label(self) -> &'static str {
        match self {
            Self::Claimed => "claimed",
            Self::Reclaimed => "reclaimed",
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Mismatch => "mismatch",
            Self::Unknown => "unknown",
        }
    }
}

/// The fenced writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOp {
    Heartbeat,
    Complete,
    Release,
    /// An owner marked its record's outcome unknown.
    Unknown,
}

impl WriteOp {
    const ALL: [Self; 4] = [
        Self::Heartbeat,
        Self::Complete,
        Self::Release,
        Self::Unknown,
    ];
    pub fn label(self) -> &'static str {
        match self {
            Self::Heartbeat => "heartbeat",
            Self::Complete => "complete",
            Self::Release => "release",
            Self::Unknown => "unknown",
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
}

impl WaitEnd {
    const ALL: [Self; 3] = [Self::Settled, Self::TimedOut, Self::Refused];
    fn label(self) -> &'static str {
        match self {
            Self::Settled => "settled",
            Self::TimedOut => "timed_out",
            Self::Refused => "refused",
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
    Heartbeat,
    Complete,
    Release,
    Unknown,
    Records,
    Other,
}

impl Route {
    const ALL: [Self; 7] = [
        Self::Claim,
        Self::Heartbeat,
        Self::Complete,
        Self::Release,
        Self::Unknown,
        Self::Records,
        Self::Other,
    ];
    fn label(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Heartbeat => "heartbeat",
            Self::Complete => "complete",
            Self::Release => "release",
            Self::Unknown => "unknown",
            Self::Records => "records",
            Self::Other => "other",
        }
    }
    pub fn from_path(path: &str) -> Self {
        match path {
            contract::wire::CLAIM_PATH => Self::Claim,
            contract::wire::HEARTBEAT_PATH => Self::Heartbeat,
            contract::wire::COMPLETE_PATH => Self::Complete,
            contract::wire::RELEASE_PATH => Self::Release,
            contract::wire::UNKNOWN_PATH => Self::Unknown,
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
    fn label(self) -> &'static str {
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
    fn label(self) -> &'static str {
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
    fn label(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::Deadline => "deadline",
        }
    }
}

/// Upper bounds of the batch size histogram (requests per statement).
const BATCH_BUCKETS: [u64; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

#[derive(Default)]
struct SizeHistogram {
    buckets: [AtomicU64; BATCH_BUCKETS.len()],
    count: AtomicU64,
    sum: AtomicU64,
}

impl SizeHistogram {
    fn observe(&self, n: u64) {
        // Cumulative at render time: one increment per observation here.
        if let Some(i) = BATCH_BUCKETS.iter().position(|le| n <= *le) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum.fetch_add(n, Relaxed);
    }
}

/// Upper bounds in seconds: the interesting range is 0.2 ms .. 100 ms.
const BUCKETS: [f64; 12] = [
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
];

#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (i, le) in BUCKETS.iter().enumerate() {
            if secs <= *le {
                self.buckets[i].fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_micros
            .fetch_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX), Relaxed);
    }
}

#[derive(Default)]
pub struct Metrics {
    claims: [AtomicU64; ClaimOutcome::ALL.len()],
    fenced_out: [AtomicU64; WriteOp::ALL.len()],
    completes: AtomicU64,
    releases: AtomicU64,
    unknowns: AtomicU64,
    heartbeats: AtomicU64,
    purged_rows: AtomicU64,
    db_unavailable: AtomicU64,
    internal_errors: AtomicU64,
    shed: [AtomicU64; Shed::ALL.len()],
    released_for_gone: AtomicU64,
    previous_secret_hits: AtomicU64,
    latency: [Histogram; Route::ALL.len()],
    batch_sizes: SizeHistogram,
    batch_single: [[AtomicU64; SinglePathReason::ALL.len()]; BatchOp::ALL.len()],
    waits: [AtomicU64; WaitEnd::ALL.len()],
    admin: [AtomicU64; AdminOp::ALL.len()],
}

/// The pool's state at scrape time.
#[derive(Debug, Clone, Copy)]
pub struct PoolGauges {
    pub size: u32,
    pub idle: u32,
    pub max: u32,
}

impl Metrics {
    pub fn claim(&self, o: ClaimOutcome) {
        self.claims[o as usize].fetch_add(1, Relaxed);
    }
    pub fn fenced_out(&self, op: WriteOp) {
        self.fenced_out[op as usize].fetch_add(1, Relaxed);
    }
    pub fn write_ok(&self, op: WriteOp) {
        match op {
            WriteOp::Heartbeat => &self.heartbeats,
            WriteOp::Complete => &self.completes,
            WriteOp::Release => &self.releases,
            WriteOp::Unknown => &self.unknowns,
        }
        .fetch_add(1, Relaxed);
    }
    pub fn wait(&self, end: WaitEnd) {
        self.waits[end as usize].fetch_add(1, Relaxed);
    }
    pub fn waits_total(&self, end: WaitEnd) -> u64 {
        self.waits[end as usize].load(Relaxed)
    }
    pub fn admin(&self, op: AdminOp) {
        self.admin[op as usize].fetch_add(1, Relaxed);
    }
    pub fn purged(&self, rows: u64) {
        self.purged_rows.fetch_add(rows, Relaxed);
    }
    pub fn db_unavailable(&self) {
        self.db_unavailable.fetch_add(1, Relaxed);
    }
    pub fn internal_error(&self) {
        self.internal_errors.fetch_add(1, Relaxed);
    }
    /// A request answered 503 without reaching Postgres: the queue was full, or its caller's
    /// time ran out first.
    pub fn shed(&self, why: Shed) {
        self.shed[why as usize].fetch_add(1, Relaxed);
    }
    pub fn shed_total(&self, why: Shed) -> u64 {
        self.shed[why as usize].load(Relaxed)
    }
    /// A claim committed after its caller had given up, released again.
    pub fn released_for_gone_caller(&self) {
        self.released_for_gone.fetch_add(1, Relaxed);
    }
    /// A record found under the previous key secret (a rotation still has work to do).
    pub fn previous_secret_hit(&self) {
        self.previous_secret_hits.fetch_add(1, Relaxed);
    }
    pub fn released_for_gone_total(&self) -> u64 {
        self.released_for_gone.load(Relaxed)
    }
    pub fn observe(&self, route: Route, d: Duration) {
        self.latency[route as usize].observe(d);
    }
    /// A statement (or, for 1, the single-row statements) run for `n` requests by the group commit.
    pub fn batch_size(&self, n: usize) {
        self.batch_sizes
            .observe(u64::try_from(n).unwrap_or(u64::MAX));
    }
    pub fn batch_single_path(&self, op: BatchOp, why: SinglePathReason) {
        self.batch_single[op as usize][why as usize].fetch_add(1, Relaxed);
    }
    /// (statements, requests) of the group commit.
    pub fn batch_totals(&self) -> (u64, u64) {
        let h = &self.batch_sizes;
        (h.count.load(Relaxed), h.sum.load(Relaxed))
    }

    pub fn claims_total(&self, o: ClaimOutcome) -> u64 {
        self.claims[o as usize].load(Relaxed)
    }
    pub fn fenced_out_total(&self, op: WriteOp) -> u64 {
        self.fenced_out[op as usize].load(Relaxed)
    }
    pub fn purged_total(&self) -> u64 {
        self.purged_rows.load(Relaxed)
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self, pool: PoolGauges) -> String {
        let mut out = String::with_capacity(4096);
        // Writing to a String cannot fail.
        let _ = self.render_into(&mut out, pool);
        out
    }

    fn render_into(&self, out: &mut String, pool: PoolGauges) -> std::fmt::Result {
        writeln!(out, "# HELP state_api_claims_total Claims answered, by outcome (reclaimed: took over an expired lease).")?;
        writeln!(out, "# TYPE state_api_claims_total counter")?;
        for o in ClaimOutcome::ALL {
            writeln!(
                out,
                "state_api_claims_total{{outcome=\"{}\"}} {}",
                o.label(),
                self.claims_total(o)
            )?;
        }
        writeln!(out, "# HELP state_api_reclaims_total Claims that took over an in-progress record whose lease had run out.")?;
        writeln!(out, "# TYPE state_api_reclaims_total counter")?;
        writeln!(
            out,
            "state_api_reclaims_total {}",
            self.claims_total(ClaimOutcome::Reclaimed)
        )?;
        writeln!(out, "# HELP state_api_fenced_out_total Writes refused because a newer claim owns the record.")?;
        writeln!(out, "# TYPE state_api_fenced_out_total counter")?;
        for op in WriteOp::ALL {
            writeln!(
                out,
                "state_api_fenced_out_total{{op=\"{}\"}} {}",
                op.label(),
                self.fenced_out_total(op)
            )?;
        }
        writeln!(
            out,
            "# HELP state_api_writes_total Fenced writes that succeeded."
        )?;
        writeln!(out, "# TYPE state_api_writes_total counter")?;
        for (op, c) in [
            (WriteOp::Heartbeat, &self.heartbeats),
            (WriteOp::Complete, &self.completes),
            (WriteOp::Release, &self.releases),
            (WriteOp::Unknown, &self.unknowns),
        ] {
            writeln!(
                out,
                "state_api_writes_total{{op=\"{}\"}} {}",
                op.label(),
                c.load(Relaxed)
            )?;
        }
        writeln!(out, "# HELP state_api_waits_total Claims that waited for a running key (Prefer: wait), by how the wait ended.")?;
        writeln!(out, "# TYPE state_api_waits_total counter")?;
        for end in WaitEnd::ALL {
            writeln!(
                out,
                "state_api_waits_total{{end=\"{}\"}} {}",
                end.label(),
                self.waits_total(end)
            )?;
        }
        writeln!(out, "# HELP state_api_admin_actions_total Operator actions of the admin API (each one audited).")?;
        writeln!(out, "# TYPE state_api_admin_actions_total counter")?;
        for op in AdminOp::ALL {
            writeln!(
                out,
                "state_api_admin_actions_total{{action=\"{}\"}} {}",
                op.label(),
                self.admin[op as usize].load(Relaxed)
            )?;
        }
        writeln!(
            out,
            "# HELP state_api_purged_rows_total Expired records deleted by the purge."
        )?;
        writeln!(out, "# TYPE state_api_purged_rows_total counter")?;
        writeln!(out, "state_api_purged_rows_total {}", self.purged_total())?;
        writeln!(
            out,
            "# HELP state_api_shed_total Claims and completes answered 503 without reaching Postgres: the group commit's queue was full, or the caller's time ran out."
        )?;
        writeln!(out, "# TYPE state_api_shed_total counter")?;
        for why in Shed::ALL {
            writeln!(
                out,
                "state_api_shed_total{{reason=\"{}\"}} {}",
                why.label(),
                self.shed_total(why)
            )?;
        }
        writeln!(
            out,
            "# HELP state_api_released_for_gone_callers_total Claims committed after their caller had given up (a slow or paused Postgres), released at once: nothing was forwarded with them."
        )?;
        writeln!(
            out,
            "# TYPE state_api_released_for_gone_callers_total counter"
        )?;
        writeln!(
            out,
            "state_api_released_for_gone_callers_total {}",
            self.released_for_gone_total()
        )?;
        writeln!(
            out,
            "# HELP state_api_previous_key_secret_hits_total Requests whose record was found under --previous-key-secret (a rotation of the key secret)."
        )?;
        writeln!(
            out,
            "# TYPE state_api_previous_key_secret_hits_total counter"
        )?;
        writeln!(
            out,
            "state_api_previous_key_secret_hits_total {}",
            self.previous_secret_hits.load(Relaxed)
        )?;
        writeln!(out, "# HELP state_api_errors_total Requests answered with 503 (database unavailable) or 500.")?;
        writeln!(out, "# TYPE state_api_errors_total counter")?;
        writeln!(
            out,
            "state_api_errors_total{{kind=\"unavailable\"}} {}",
            self.db_unavailable.load(Relaxed)
        )?;
        writeln!(
            out,
            "state_api_errors_total{{kind=\"internal\"}} {}",
            self.internal_errors.load(Relaxed)
        )?;

        writeln!(
            out,
            "# HELP state_api_request_duration_seconds Time to answer a request, by route."
        )?;
        writeln!(out, "# TYPE state_api_request_duration_seconds histogram")?;
        for r in Route::ALL {
            let h = &self.latency[r as usize];
            for (i, le) in BUCKETS.iter().enumerate() {
                writeln!(
                    out,
                    "state_api_request_duration_seconds_bucket{{route=\"{}\",le=\"{}\"}} {}",
                    r.label(),
                    le,
                    h.buckets[i].load(Relaxed)
                )?;
            }
            let count = h.count.load(Relaxed);
            writeln!(
                out,
                "state_api_request_duration_seconds_bucket{{route=\"{}\",le=\"+Inf\"}} {count}",
                r.label()
            )?;
            let sum = h.sum_micros.load(Relaxed) as f64 / 1e6;
            writeln!(
                out,
                "state_api_request_duration_seconds_sum{{route=\"{}\"}} {sum}",
                r.label()
            )?;
            writeln!(
                out,
                "state_api_request_duration_seconds_count{{route=\"{}\"}} {count}",
                r.label()
            )?;
        }

        writeln!(out, "# HELP state_api_batch_size Requests (claims and completes) per statement of the group commit (1: the single-row statements).")?;
        writeln!(out, "# TYPE state_api_batch_size histogram")?;
        let h = &self.batch_sizes;
        let mut cumulative = 0;
        for (i, le) in BATCH_BUCKETS.iter().enumerate() {
            cumulative += h.buckets[i].load(Relaxed);
            writeln!(
                out,
                "state_api_batch_size_bucket{{le=\"{le}\"}} {cumulative}"
            )?;
        }
        let count = h.count.load(Relaxed);
        writeln!(out, "state_api_batch_size_bucket{{le=\"+Inf\"}} {count}")?;
        writeln!(out, "state_api_batch_size_sum {}", h.sum.load(Relaxed))?;
        writeln!(out, "state_api_batch_size_count {count}")?;
        writeln!(out, "# HELP state_api_batch_single_path_total Requests of the group commit run on the single-row statements instead, by op and reason.")?;
        writeln!(out, "# TYPE state_api_batch_single_path_total counter")?;
        for op in BatchOp::ALL {
            for why in SinglePathReason::ALL {
                writeln!(
                    out,
                    "state_api_batch_single_path_total{{op=\"{}\",reason=\"{}\"}} {}",
                    op.label(),
                    why.label(),
                    self.batch_single[op as usize][why as usize].load(Relaxed)
                )?;
            }
        }

        writeln!(
            out,
            "# HELP state_api_db_pool_connections Database connections, by state."
        )?;
        writeln!(out, "# TYPE state_api_db_pool_connections gauge")?;
        writeln!(
            out,
            "state_api_db_pool_connections{{state=\"idle\"}} {}",
            pool.idle
        )?;
        writeln!(
            out,
            "state_api_db_pool_connections{{state=\"in_use\"}} {}",
            pool.size.saturating_sub(pool.idle)
        )?;
        writeln!(
            out,
            "# HELP state_api_db_pool_max_connections The pool's maximum size."
        )?;
        writeln!(out, "# TYPE state_api_db_pool_max_connections gauge")?;
        writeln!(out, "state_api_db_pool_max_connections {}", pool.max)?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_cumulative_buckets() {
        let m = Metrics::default();
        m.claim(ClaimOutcome::Claimed);
        m.claim(ClaimOutcome::Claimed);
        m.fenced_out(WriteOp::Complete);
        m.observe(Route::Claim, Duration::from_micros(700));
        let text = m.render(PoolGauges {
            size: 3,
            idle: 1,
            max: 16,
        });
        assert!(text.contains("state_api_claims_total{outcome=\"claimed\"} 2\n"));
        assert!(text.contains("state_api_fenced_out_total{op=\"complete\"} 1\n"));
        assert!(text.contains(
            "state_api_request_duration_seconds_bucket{route=\"claim\",le=\"0.0005\"} 0\n"
        ));
        assert!(text.contains(
            "state_api_request_duration_seconds_bucket{route=\"claim\",le=\"0.001\"} 1\n"
        ));
        assert!(text.contains(
            "state_api_request_duration_seconds_bucket{route=\"claim\",le=\"+Inf\"} 1\n"
        ));
        assert!(text.contains("state_api_db_pool_connections{state=\"in_use\"} 2\n"));
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
            "state_api_batch_size_bucket{le=\"1\"} 2\n",
            "state_api_batch_size_bucket{le=\"2\"} 2\n",
            "state_api_batch_size_bucket{le=\"4\"} 3\n",
            "state_api_batch_size_bucket{le=\"64\"} 4\n",
            "state_api_batch_size_bucket{le=\"256\"} 4\n",
            "state_api_batch_size_bucket{le=\"+Inf\"} 5\n",
            "state_api_batch_size_sum 369\n",
            "state_api_batch_size_count 5\n",
            "state_api_batch_single_path_total{op=\"complete\",reason=\"after_batch\"} 1\n",
            "state_api_batch_single_path_total{op=\"claim\",reason=\"duplicate\"} 0\n",
        ] {
            assert!(text.contains(line), "{line} missing in:\n{text}");
        }
    }
}
