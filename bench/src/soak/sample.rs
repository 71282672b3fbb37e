//! What is read every few seconds: the table's size and dead tuples, the processes' memory,
//! the purge's counters and the CPU ticks.

use serde::Serialize;
use test_support::stack::Stack;

use super::*;

#[derive(Debug, Clone, Serialize, Default)]
pub(crate) struct Sample {
    pub(crate) t_s: f64,
    pub(crate) rows: u64,
    pub(crate) table_bytes: u64,
    pub(crate) index_bytes: u64,
    pub(crate) total_bytes: u64,
    pub(crate) dead_tuples: u64,
    pub(crate) live_tuples: u64,
    pub(crate) autovacuums: u64,
    pub(crate) state_api_rss_kib: u64,
    pub(crate) envoy_rss_kib: u64,
    pub(crate) purged_rows: u64,
    pub(crate) purge_passes: u64,
    pub(crate) purge_backlog_passes: u64,
    /// New-key latency over the interval that ends with this reading.
    pub(crate) new_p50_ms: Option<f64>,
    pub(crate) new_p99_ms: Option<f64>,
    /// CPU ticks: the machine's busy and total (all CPUs), its interrupts, and ours (the stack's
    /// processes, Postgres' backends and this program).
    pub(crate) busy_ticks: u64,
    pub(crate) total_ticks: u64,
    pub(crate) irq_ticks: u64,
    /// The hypervisor's steal (all CPUs).
    pub(crate) steal_ticks: u64,
    pub(crate) our_ticks: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
}

pub(super) const TABLE_SQL: &str = "SELECT (SELECT count(*) FROM idempotency_records), \
    pg_relation_size('idempotency_records'), pg_indexes_size('idempotency_records'), \
    pg_total_relation_size('idempotency_records'), n_dead_tup, n_live_tup, autovacuum_count \
    FROM pg_stat_user_tables WHERE relname = 'idempotency_records'";

pub(super) struct Watched<'a> {
    stack: &'a Stack,
    state_api_pid: u32,
    envoy_pid: u32,
    checkout_pid: u32,
    postgres_pid: Option<u32>,
}

impl<'a> Watched<'a> {
    /// The stack's processes, found by the ports they listen on.
    pub(super) fn of(stack: &'a Stack) -> Result<Self, String> {
        let find = |port: u16, what: &str| {
            procfs::pid_listening_on(port)
                .ok_or_else(|| format!("no process listens on :{port} ({what})"))
        };
        Ok(Self {
            stack,
            state_api_pid: find(stack.state_api.port, "state-api")?,
            envoy_pid: find(stack.envoy.params.listen_port, "envoy")?,
            checkout_pid: find(stack.checkout.port, "checkout")?,
            postgres_pid: procfs::pid_listening_on(stack.postgres.port()),
        })
    }
}

impl Watched<'_> {
    pub(super) fn sample(&self, t_s: f64) -> Sample {
        let metrics = test_support::envoy::http_get_blocking(self.stack.state_api.port, "/metrics")
            .unwrap_or_default();
        let metric = |name: &str| purge::metric(&metrics, name).map_or(0, |v| v as u64);
        let mut s = Sample {
            t_s,
            state_api_rss_kib: procfs::status_kib(self.state_api_pid, "VmRSS").unwrap_or(0),
            envoy_rss_kib: procfs::status_kib(self.envoy_pid, "VmRSS").unwrap_or(0),
            purged_rows: metric("state_api_purged_rows_total"),
            purge_passes: metric("state_api_purge_passes_total{end=\"cleared\"}")
                + metric("state_api_purge_passes_total{end=\"backlog\"}"),
            purge_backlog_passes: metric("state_api_purge_passes_total{end=\"backlog\"}"),
            ..Sample::default()
        };
        (s.busy_ticks, s.total_ticks) = procfs::machine_ticks();
        s.irq_ticks = procfs::irq_ticks();
        s.steal_ticks = procfs::steal_ticks();
        s.our_ticks = [self.state_api_pid, self.envoy_pid, self.checkout_pid]
            .into_iter()
            .map(|pid| procfs::cpu_ticks(pid, false))
            .chain(self.postgres_pid.map(procfs::tree_ticks))
            .sum::<u64>()
            + procfs::cpu_ticks(std::process::id(), true);
        let table = self
            .stack
            .postgres
            .psql(self.stack.database_name(), TABLE_SQL)
            .and_then(|out| {
                let v: Vec<u64> = out
                    .trim()
                    .split('|')
                    .filter_map(|x| x.parse().ok())
                    .collect();
                if v.len() == 7 {
                    Ok(v)
                } else {
                    Err(format!("unexpected answer {out:?}"))
                }
            });
        match table {
            Ok(v) => {
                (s.rows, s.table_bytes, s.index_bytes, s.total_bytes) = (v[0], v[1], v[2], v[3]);
                (s.dead_tuples, s.live_tuples, s.autovacuums) = (v[4], v[5], v[6]);
            }
            Err(e) => s.error = Some(format!("table figures: {}", load::short(&e))),
        }
        if s.state_api_rss_kib == 0 || s.envoy_rss_kib == 0 {
            s.error = Some("a process is gone (no VmRSS)".into());
        }
        s
    }
}
