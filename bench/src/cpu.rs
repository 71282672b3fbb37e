//! Where the CPU went during a run: counters of the machine, of each process we watch and of
//! Envoy's worker threads at two moments, and the state API's own timings from its /metrics.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use crate::procfs;

/// The processes whose CPU and memory we watch.
#[derive(Debug, Clone)]
pub struct Procs {
    pub named: Vec<(&'static str, u32)>,
    pub postgres: Option<u32>,
}

/// Other work or steal above this (cores) during a run makes its figures noise: the run is
/// measured again once, and the report names the runs still above it (so does the soak, by
/// the minute).
pub const NOISY_CORES: f64 = 0.25;

/// CPU counters at one moment.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub(crate) at: Instant,
    pub(crate) machine_busy: u64,
    pub(crate) machine_total: u64,
    pub(crate) irq: u64,
    pub(crate) steal: u64,
    pub(crate) per: BTreeMap<&'static str, u64>,
    pub(crate) envoy_workers: BTreeMap<&'static str, u64>,
    pub(crate) state_api_metrics: BTreeMap<String, f64>,
}

impl Snapshot {
    pub(crate) fn take(procs: &Procs, state_api_port: u16) -> Self {
        let (machine_busy, machine_total) = procfs::machine_ticks();
        let mut per = BTreeMap::new();
        let mut envoy_workers = BTreeMap::new();
        for (name, pid) in &procs.named {
            per.insert(*name, procfs::cpu_ticks(*pid, false));
            if name.starts_with("envoy") {
                let threads = procfs::thread_ticks(*pid);
                let worker: u64 = threads
                    .iter()
                    .filter(|(k, _)| k.starts_with("wrk:"))
                    .map(|(_, v)| v)
                    .sum();
                envoy_workers.insert(*name, worker);
            }
        }
        if let Some(pg) = procs.postgres {
            per.insert("postgres", procfs::tree_ticks(pg));
        }
        per.insert("bench", procfs::cpu_ticks(std::process::id(), true));
        Self {
            at: Instant::now(),
            machine_busy,
            machine_total,
            irq: procfs::irq_ticks(),
            steal: procfs::steal_ticks(),
            per,
            envoy_workers,
            state_api_metrics: state_api_metrics(state_api_port),
        }
    }
}

/// `state_api_request_duration_seconds_{sum,count}` by route and `state_api_batch_size_{sum,count}`
/// (requests per statement of the group commit) and `state_api_purged_rows`, from /metrics.
pub(crate) fn state_api_metrics(port: u16) -> BTreeMap<String, f64> {
    let text = test_support::envoy::http_get_blocking(port, "/metrics").unwrap_or_default();
    text.lines()
        .filter(|l| {
            l.starts_with("state_api_request_duration_seconds_sum")
                || l.starts_with("state_api_request_duration_seconds_count")
                || l.starts_with("state_api_batch_size_sum")
                || l.starts_with("state_api_batch_size_count")
                || l.starts_with("state_api_purged_rows")
        })
        .filter_map(|l| {
            l.rsplit_once(' ')
                .and_then(|(k, v)| v.parse().ok().map(|v| (k.to_owned(), v)))
        })
        .collect()
}

/// Where the CPU went during a run, in cores (1.0 = one core busy for the whole window).
#[derive(Debug, Clone, Serialize, Default)]
pub struct CpuUse {
    pub window_s: f64,
    /// Busy fraction of the whole machine, in cores.
    pub machine_cores: f64,
    /// Interrupt and softirq time (loopback networking, mostly), in cores.
    pub irq_cores: f64,
    /// Per process (Postgres: postmaster and backends), in cores.
    pub processes: BTreeMap<String, f64>,
    /// Envoy worker thread(s), in cores: 1.0 means the single worker was saturated.
    pub envoy_worker_cores: BTreeMap<String, f64>,
    /// Busy time not accounted to our processes or to interrupts: other work on the machine, and
    /// on a VM the time the hypervisor gave to other guests (steal, busy in /proc/stat).
    pub other_cores: f64,
    /// The hypervisor's steal alone, in cores: part of it shows in `other_cores`, the rest was
    /// charged to whichever of our processes was running, so a run with steal costs more per
    /// request in every column.
    pub steal_cores: f64,
    /// Mean server-side time per state API request, by route, in ms (from its /metrics).
    pub state_api_mean_ms: BTreeMap<String, f64>,
    pub state_api_requests: BTreeMap<String, f64>,
    /// Claims and completes per statement written (group commit; 1.0: every request alone).
    pub state_api_requests_per_statement: Option<f64>,
    /// Differences of [`crate::Bench`]'s `window_counters` over the window (empty without them).
    #[serde(skip)]
    pub window_counters: Vec<f64>,
}

impl CpuUse {
    /// Thousandths of a core each of `n` things (waiters, say) cost during the window, for
    /// Envoy, the state API, Postgres, the bench itself and interrupts.
    pub fn thousandths_each(&self, n: usize) -> BTreeMap<String, f64> {
        let each = |cores: f64| cores * 1000.0 / n.max(1) as f64;
        let mut out: BTreeMap<String, f64> = ["envoy", "state-api", "postgres", "bench"]
            .into_iter()
            .map(|name| {
                let cores = self.processes.get(name).copied().unwrap_or(0.0);
                (name.to_owned(), each(cores))
            })
            .collect();
        out.insert("irq".into(), each(self.irq_cores));
        out
    }
}

/// How much of the machine was not ours to measure: other work or the hypervisor's steal,
/// whichever was larger (they overlap), in cores.
pub fn noise_cores(other_cores: f64, steal_cores: f64) -> f64 {
    other_cores.max(steal_cores)
}

impl CpuUse {
    pub fn noise_cores(&self) -> f64 {
        noise_cores(self.other_cores, self.steal_cores)
    }
}

pub(crate) fn cpu_between(a: &Snapshot, b: &Snapshot, tck: f64) -> CpuUse {
    let window = b.at.duration_since(a.at).as_secs_f64().max(1e-9);
    let cores = |ticks: u64| ticks as f64 / tck / window;
    let machine_total = b.machine_total.saturating_sub(a.machine_total).max(1) as f64;
    let ncpu = procfs::cpu_count() as f64;
    // The machine's ticks are summed over all CPUs.
    let machine_cores = b.machine_busy.saturating_sub(a.machine_busy) as f64 / machine_total * ncpu;
    let irq_cores = b.irq.saturating_sub(a.irq) as f64 / machine_total * ncpu;
    let steal_cores = b.steal.saturating_sub(a.steal) as f64 / machine_total * ncpu;
    let mut processes = BTreeMap::new();
    for (name, after) in &b.per {
        let before = a.per.get(name).copied().unwrap_or(*after);
        processes.insert((*name).to_owned(), cores(after.saturating_sub(before)));
    }
    let ours: f64 = processes.values().sum();
    let envoy_worker_cores = b
        .envoy_workers
        .iter()
        .map(|(k, v)| {
            (
                (*k).to_owned(),
                cores(v.saturating_sub(a.envoy_workers.get(k).copied().unwrap_or(*v))),
            )
        })
        .collect();
    let mut state_api_mean_ms = BTreeMap::new();
    let mut state_api_requests = BTreeMap::new();
    for route in ["claim", "complete", "heartbeat", "release"] {
        let sum_k = format!("state_api_request_duration_seconds_sum{{route=\"{route}\"}}");
        let cnt_k = format!("state_api_request_duration_seconds_count{{route=\"{route}\"}}");
        let d = |m: &BTreeMap<String, f64>, k: &str| m.get(k).copied().unwrap_or(0.0);
        let n = d(&b.state_api_metrics, &cnt_k) - d(&a.state_api_metrics, &cnt_k);
        if n > 0.0 {
            let s = d(&b.state_api_metrics, &sum_k) - d(&a.state_api_metrics, &sum_k);
            state_api_mean_ms.insert(route.to_owned(), s / n * 1000.0);
            state_api_requests.insert(route.to_owned(), n);
        }
    }
    let d = |m: &BTreeMap<String, f64>, k: &str| m.get(k).copied().unwrap_or(0.0);
    let statements = d(&b.state_api_metrics, "state_api_batch_size_count")
        - d(&a.state_api_metrics, "state_api_batch_size_count");
    let state_api_requests_per_statement = (statements > 0.0).then(|| {
        (d(&b.state_api_metrics, "state_api_batch_size_sum")
            - d(&a.state_api_metrics, "state_api_batch_size_sum"))
            / statements
    });
    CpuUse {
        state_api_requests_per_statement,
        window_s: window,
        machine_cores,
        irq_cores,
        other_cores: (machine_cores - irq_cores - ours).max(0.0),
        steal_cores,
        processes,
        envoy_worker_cores,
        state_api_mean_ms,
        state_api_requests,
        window_counters: Vec::new(),
    }
}
