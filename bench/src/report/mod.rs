//! The figures, the ratios against the baselines, the goals, as a table, JSON and markdown.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::pgbench::PgbenchResult;
use crate::ScenarioResult;

mod goals;
mod markdown;

#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    /// VmHWM: the resident-set high-water mark since the process started.
    pub hwm_kib: u64,
    pub rss_kib: u64,
}

pub struct Inputs {
    pub results: Vec<ScenarioResult>,
    pub pgbench: Vec<PgbenchResult>,
    pub memory: BTreeMap<String, Memory>,
    pub wasm_bytes: u64,
    pub slow_statuses: Vec<String>,
    pub load_before: (f64, f64, f64),
    pub load_after: (f64, f64, f64),
    pub warmup_s: u64,
    pub measure_s: u64,
    pub envoy_version: String,
    pub total_s: f64,
    pub stack_dir: String,
    pub state_api_env: Vec<(String, String)>,
    pub storage: Option<Storage>,
    pub envoy_stats: BTreeMap<String, BTreeMap<String, u64>>,
    pub waiting: Vec<crate::waiting::WaitCost>,
    pub purge: Option<crate::purge::PurgeCapacity>,
}

/// Size of the state API's table after the run.
#[derive(Debug, Clone, Serialize)]
pub struct Storage {
    pub rows: u64,
    pub total_bytes: u64,
    pub index_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Goal {
    pub goal: String,
    pub target: String,
    pub measured: String,
    pub pass: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub scenario: String,
    pub connections: usize,
    /// Requests/s relative to the baseline (plain Envoy; pgbench for the state API).
    pub rate_ratio: f64,
    /// p50 minus the baseline's p50, ms.
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    pub baseline: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub generated_unix_s: u64,
    pub method: BTreeMap<&'static str, String>,
    pub machine: BTreeMap<&'static str, String>,
    pub scenarios: Vec<ScenarioResult>,
    pub pgbench: Vec<PgbenchResult>,
    pub ratios: Vec<Ratio>,
    pub memory_kib: BTreeMap<String, Memory>,
    pub wasm_bytes: u64,
    pub slow_request_statuses: Vec<String>,
    pub goals: Vec<Goal>,
    pub all_goals_pass: bool,
    pub total_errors: u64,
    pub total_s: f64,
    pub storage: Option<Storage>,
    /// bench/NOTES.md (the analysis written by hand), appended to docs/BENCH.md.
    #[serde(skip)]
    pub notes: Option<String>,
    /// Connection and request counters of the clusters, per Envoy (keep-alive check).
    pub envoy_cluster_stats: BTreeMap<String, BTreeMap<String, u64>>,
    /// What retries that wait for a running key cost (`Prefer: wait`), and polling ones.
    pub waiting: Vec<crate::waiting::WaitCost>,
    /// How fast the purge clears a backlog, against the highest new-key rate of the run.
    pub purge: Option<crate::purge::PurgeCapacity>,
}

fn find<'a>(rs: &'a [ScenarioResult], scenario: &str, c: usize) -> Option<&'a ScenarioResult> {
    rs.iter()
        .find(|r| r.scenario == scenario && r.connections == c)
}

/// Seconds since the Unix epoch, now (0 if the clock is before it).
pub fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The commit the figures belong to, and whether the work tree had changes then.
pub fn git_state() -> String {
    let root = test_support::process::workspace_root();
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let head = run(&["rev-parse", "--short", "HEAD"]);
    let dirty = run(&[
        "status",
        "--porcelain",
        "--",
        "filter",
        "state-api",
        "contract",
        "checkout",
        "envoy",
        "tests/src",
    ]);
    if dirty.is_empty() {
        head
    } else {
        format!(
            "{head} (work tree with uncommitted changes in: {})",
            dirty
                .lines()
                .map(|l| l.get(3..).unwrap_or(l))
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

/// The ratio cell of a row without a ratio: the baseline itself, or nothing to compare with.
fn base(r: &ScenarioResult, own: &str) -> String {
    if r.scenario == "plain" {
        own.to_owned()
    } else {
        "-".to_owned()
    }
}

fn f(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "n/a".into()
    }
}

impl Report {
    pub fn build(i: Inputs) -> Self {
        let ratios = ratios(&i);
        let goals = goals::goals(&i, &ratios);
        let all_goals_pass = goals.iter().all(|g| g.pass);
        let total_errors = total_errors(&i);
        let machine = machine(&i);
        let method = method(&i);
        Self {
            generated_unix_s: unix_now_s(),
            method,
            machine,
            scenarios: i.results,
            pgbench: i.pgbench,
            ratios,
            memory_kib: i.memory,
            wasm_bytes: i.wasm_bytes,
            slow_request_statuses: i.slow_statuses,
            goals,
            all_goals_pass,
            total_errors,
            total_s: i.total_s,
            storage: i.storage,
            envoy_cluster_stats: i.envoy_stats,
            waiting: i.waiting,
            purge: i.purge,
            notes: std::fs::read_to_string(
                test_support::process::workspace_root().join("bench/NOTES.md"),
            )
            .ok(),
        }
    }

    fn rows(&self) -> Vec<[String; 8]> {
        let mut rows = Vec::new();
        let mut conns: Vec<usize> = self.scenarios.iter().map(|r| r.connections).collect();
        conns.dedup();
        conns.sort_unstable();
        conns.dedup();
        for c in conns {
            for r in self.scenarios.iter().filter(|r| r.connections == c) {
                let ratio = self
                    .ratios
                    .iter()
                    .find(|x| x.scenario == r.scenario && x.connections == c);
                rows.push([
                    r.label.clone(),
                    c.to_string(),
                    f(r.rate, 0),
                    f(r.p50_ms, 3),
                    f(r.p99_ms, 3),
                    ratio
                        .map(|x| f(x.rate_ratio, 2))
                        .unwrap_or_else(|| base(r, "1.00")),
                    ratio
                        .map(|x| format!("{:+.3}", x.added_p50_ms))
                        .unwrap_or_else(|| base(r, "0")),
                    r.error_count.to_string(),
                ]);
            }
            if let Some(p) = self.pgbench.iter().find(|p| p.clients == c) {
                rows.push([
                    "pgbench INSERT ON CONFLICT".into(),
                    c.to_string(),
                    f(p.tps, 0),
                    f(p.p50_ms, 3),
                    f(p.p99_ms, 3),
                    "(base of state API)".into(),
                    "".into(),
                    p.failed.to_string(),
                ]);
            }
        }
        rows
    }

    const HEADER: [&'static str; 8] = [
        "scenario", "conns", "req/s", "p50 ms", "p99 ms", "x plain", "+p50 ms", "errors",
    ];

    pub fn text_table(&self) -> String {
        let rows = self.rows();
        let mut widths: Vec<usize> = Self::HEADER.iter().map(|h| h.len()).collect();
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r.iter()) {
                *w = (*w).max(c.len());
            }
        }
        let mut out = String::new();
        let line = |cells: Vec<&str>, out: &mut String| {
            let parts: Vec<String> = cells
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (c, w))| {
                    if i == 0 {
                        format!("{c:<w$}")
                    } else {
                        format!("{c:>w$}")
                    }
                })
                .collect();
            let _ = writeln!(out, "{}", parts.join("  "));
        };
        line(Self::HEADER.to_vec(), &mut out);
        for r in &rows {
            line(r.iter().map(String::as_str).collect(), &mut out);
        }
        let _ = writeln!(out);
        for g in &self.goals {
            let _ = writeln!(
                out,
                "[{}] {}: {} (target {})",
                if g.pass { "PASS" } else { "FAIL" },
                g.goal,
                g.measured,
                g.target
            );
        }
        let _ = writeln!(out);
        for (name, m) in &self.memory_kib {
            let _ = writeln!(
                out,
                "memory {name}: VmHWM {:.1} MiB, VmRSS {:.1} MiB",
                m.hwm_kib as f64 / 1024.0,
                m.rss_kib as f64 / 1024.0
            );
        }
        let _ = writeln!(
            out,
            "filter.wasm: {} bytes ({:.1} KiB)",
            self.wasm_bytes,
            self.wasm_bytes as f64 / 1024.0
        );
        for t in self.tls_cost() {
            let _ = writeln!(
                out,
                "state API hop over mutual TLS, c={}: {} µs of CPU per new key against {} in plain HTTP ({:+} µs; Envoy {:+}, state API {:+})",
                t.connections,
                f(t.total_us.1, 0),
                f(t.total_us.0, 0),
                (t.total_us.1 - t.total_us.0).round(),
                (t.envoy_us.1 - t.envoy_us.0).round(),
                (t.state_api_us.1 - t.state_api_us.0).round(),
            );
        }
        let _ = writeln!(out, "machine: {:?}", self.machine);
        out
    }
}

impl Ratio {
    /// `r` against a baseline's (rate, p50, p99).
    fn of(r: &ScenarioResult, (rate, p50_ms, p99_ms): (f64, f64, f64), baseline: &str) -> Self {
        Self {
            scenario: r.scenario.clone(),
            connections: r.connections,
            rate_ratio: r.rate / rate,
            added_p50_ms: r.p50_ms - p50_ms,
            added_p99_ms: r.p99_ms - p99_ms,
            baseline: baseline.into(),
        }
    }
}

/// Each scenario's rate and latency against its baseline: the plain Envoy at the same
/// connections, or pgbench for the state API alone.
fn ratios(i: &Inputs) -> Vec<Ratio> {
    let mut ratios = Vec::new();
    for r in &i.results {
        if r.scenario == "plain" || r.scenario == "state_api_dup" {
            continue;
        }
        if r.scenario == "state_api" {
            if let Some(pg) = i.pgbench.iter().find(|p| p.clients == r.connections) {
                ratios.push(Ratio::of(
                    r,
                    (pg.tps, pg.p50_ms, pg.p99_ms),
                    "pgbench INSERT ON CONFLICT",
                ));
            }
            continue;
        }
        if let Some(p) = find(&i.results, "plain", r.connections) {
            ratios.push(Ratio::of(r, (p.rate, p.p50_ms, p.p99_ms), "plain Envoy"));
        }
    }
    ratios
}

/// Errors of every scenario and of pgbench.
fn total_errors(i: &Inputs) -> u64 {
    i.results.iter().map(|r| r.error_count).sum::<u64>()
        + i.pgbench.iter().map(|p| p.failed).sum::<u64>()
}

/// The machine the run met: its CPUs, its load, the most other work and steal in a run.
fn machine(i: &Inputs) -> BTreeMap<&'static str, String> {
    let max_other = i
        .results
        .iter()
        .map(|r| r.cpu.other_cores)
        .fold(0.0, f64::max);
    let max_steal = i
        .results
        .iter()
        .map(|r| r.cpu.steal_cores)
        .fold(0.0, f64::max);
    BTreeMap::from([
        ("cpus", crate::procfs::cpu_count().to_string()),
        (
            "load_before",
            format!(
                "{:.2} {:.2} {:.2}",
                i.load_before.0, i.load_before.1, i.load_before.2
            ),
        ),
        (
            "load_after",
            format!(
                "{:.2} {:.2} {:.2}",
                i.load_after.0, i.load_after.1, i.load_after.2
            ),
        ),
        ("max_other_work_cores_in_a_run", format!("{max_other:.2}")),
        ("max_steal_cores_in_a_run", format!("{max_steal:.2}")),
        (
            "kernel",
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_owned(),
        ),
    ])
}

/// How the run was made: the load tool, the windows, the builds and templates, the settings.
fn method(i: &Inputs) -> BTreeMap<&'static str, String> {
    BTreeMap::from([
        ("load_tool", "bench/src/load.rs: closed loop, one hyper HTTP/1.1 keep-alive connection per client, single-threaded tokio runtime; every answer checked".to_owned()),
        ("warmup_s", i.warmup_s.to_string()),
        ("measure_s", i.measure_s.to_string()),
        ("envoy", format!("{} --concurrency 1", i.envoy_version)),
        ("builds", "release (STACK_PROFILE=release), filter wasm32-wasip1 release".to_owned()),
        ("postgres", "private cluster, fsync=on, synchronous_commit=on".to_owned()),
        ("percentiles", "nearest rank over every correct answer in the window".to_owned()),
        ("stack_dir", i.stack_dir.clone()),
        ("git", git_state()),
        (
            "envoy_templates",
            format!(
                "filter: {}; jwt-only: {}; plain: envoy/envoy-plain.yaml.tmpl",
                std::env::var("BENCH_ENVOY_TEMPLATE").unwrap_or_else(|_| "examples/demo.toml, rendered by edge".into()),
                std::env::var("BENCH_JWT_TEMPLATE").unwrap_or_else(|_| "bench/envoy-jwt.yaml.tmpl".into())
            ),
        ),
        (
            "filter_wasm",
            std::env::var("FILTER_WASM").map(|p| format!("FILTER_WASM={p}")).unwrap_or_else(|_| "built from the work tree (make build-filter)".into()),
        ),
        (
            "state_api_settings",
            if i.state_api_env.is_empty() {
                "defaults (pool 16, pool ping on)".to_owned()
            } else {
                i.state_api_env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
            },
        ),
    ])
}

/// The state API process a scenario's requests reach.
fn state_api_process(scenario: &str) -> &'static str {
    if scenario == "new_tls" {
        "state-api-tls"
    } else {
        "state-api"
    }
}

/// One level of the TLS comparison: (plain, TLS) pairs.
#[derive(Debug, Clone, Serialize)]
pub struct TlsCost {
    pub connections: usize,
    pub envoy_us: (f64, f64),
    pub state_api_us: (f64, f64),
    /// Every process and interrupts, per new key.
    pub total_us: (f64, f64),
    pub rate: (f64, f64),
}

impl Report {
    /// `new` against `new_tls` at each level both ran: CPU per new key.
    pub fn tls_cost(&self) -> Vec<TlsCost> {
        let per_key = |r: &ScenarioResult| {
            let us = |cores: f64| cores / r.rate.max(1e-9) * 1e6;
            let p = |k: &str| r.cpu.processes.get(k).copied().unwrap_or(0.0);
            let envoy = p(if r.scenario == "new_tls" {
                "envoy-tls"
            } else {
                "envoy"
            });
            let api = p(state_api_process(&r.scenario));
            let total = envoy + api + p("checkout") + p("postgres") + p("bench") + r.cpu.irq_cores;
            (us(envoy), us(api), us(total), r.rate)
        };
        self.scenarios
            .iter()
            .filter(|r| r.scenario == "new")
            .filter_map(|plain| {
                let tls = self
                    .scenarios
                    .iter()
                    .find(|r| r.scenario == "new_tls" && r.connections == plain.connections)?;
                let (a, b) = (per_key(plain), per_key(tls));
                Some(TlsCost {
                    connections: plain.connections,
                    envoy_us: (a.0, b.0),
                    state_api_us: (a.1, b.1),
                    total_us: (a.2, b.2),
                    rate: (a.3, b.3),
                })
            })
            .collect()
    }
}

/// At 1 connection each step of a request waits for the one before, so its p50 is about the CPU
/// it costs, every process summed; and a process costs more per request the fewer it serves a
/// second (each one wakes it from idle). Both read from this run's 1-connection scenarios.
#[derive(Debug, Clone)]
pub struct SerialChain {
    /// (label, p50 ms, CPU ms per request, machine cores busy) of plain, new keys and the seed
    /// (alone and behind Envoy).
    rows: Vec<(String, f64, f64, f64)>,
    /// The checkout's CPU per request (µs) and requests/s: (plain run, new-key run).
    checkout: Option<((f64, f64), (f64, f64))>,
}

impl Report {
    pub fn serial_chain(&self) -> Option<SerialChain> {
        let at1 = |s: &str| {
            self.scenarios
                .iter()
                .find(|r| r.scenario == s && r.connections == 1 && r.rate > 0.0)
        };
        let cpu_ms = |r: &ScenarioResult| (r.cpu.machine_cores - r.cpu.other_cores) / r.rate * 1e3;
        let rows: Vec<_> = ["plain", "new", "seed_new", "seed_edge"]
            .into_iter()
            .filter_map(at1)
            .map(|r| (r.label.clone(), r.p50_ms, cpu_ms(r), r.cpu.machine_cores))
            .collect();
        if rows.len() < 2 {
            return None;
        }
        let checkout_us = |r: &ScenarioResult| {
            let cores = r.cpu.processes.get("checkout").copied()?;
            Some((cores / r.rate * 1e6, r.rate))
        };
        let checkout = at1("plain")
            .and_then(checkout_us)
            .zip(at1("new").and_then(checkout_us));
        Some(SerialChain { rows, checkout })
    }
}

impl SerialChain {
    fn write(&self, out: &mut String) {
        let _ = writeln!(out, "\n## One connection: a chain of wake-ups\n");
        let _ = writeln!(
            out,
            "With one connection each step waits for the one before, so a request's p50 is close to \
             the CPU it costs, every process summed (the machine about one core busy):\n"
        );
        let _ = writeln!(
            out,
            "| scenario | p50 ms | CPU ms per request | machine cores busy |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|");
        for (label, p50, cpu, cores) in &self.rows {
            let _ = writeln!(
                out,
                "| {label} | {} | {} | {} |",
                f(*p50, 3),
                f(*cpu, 3),
                f(*cores, 2)
            );
        }
        if let Some(((plain_us, plain_rate), (new_us, new_rate))) = self.checkout {
            let _ = writeln!(
                out,
                "\nAnd a process costs more per request the fewer requests it serves a second, as each \
                 one wakes it from idle: the checkout gets the same request in both runs (and in the \
                 new-key run a fencing token to check), yet costs {} µs of CPU per request in the new-key run ({} requests/s) against {} µs \
                 in the plain run ({}/s), {}x. A new key crosses 12 process boundaries (load \
                 generator, Envoy, state API, Postgres and back for the claim; the checkout; the \
                 same again for the complete) where the seeds' request crosses 6 (Node, Postgres \
                 twice), so at 1 connection its added p50 follows the wake-ups more than the two \
                 commits.",
                f(new_us, 0),
                f(new_rate, 0),
                f(plain_us, 0),
                f(plain_rate, 0),
                f(new_us / plain_us.max(1e-9), 2),
            );
        }
    }
}

/// The runs still above [`crate::NOISY_CORES`] of other work or steal, as the report names them.
fn noisy_runs<'a>(
    runs: impl IntoIterator<Item = (&'a str, usize, &'a crate::CpuUse)>,
) -> Vec<String> {
    runs.into_iter()
        .filter(|(_, _, cpu)| cpu.noise_cores() > crate::NOISY_CORES)
        .map(|(label, connections, cpu)| {
            format!(
                "{label} c={connections} (other work {:.2} cores, steal {:.2})",
                cpu.other_cores, cpu.steal_cores
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuUse;

    #[test]
    fn a_run_with_steal_or_other_work_over_the_threshold_is_named_noisy() {
        let cpu = |other_cores, steal_cores| CpuUse {
            other_cores,
            steal_cores,
            ..CpuUse::default()
        };
        let (quiet, stolen, busy) = (cpu(0.05, 0.10), cpu(0.02, 0.27), cpu(0.30, 0.0));
        let named = noisy_runs([
            ("plain Envoy", 16, &quiet),
            ("plain Envoy", 1, &stolen),
            ("new keys", 16, &busy),
        ]);
        assert_eq!(
            named,
            [
                "plain Envoy c=1 (other work 0.02 cores, steal 0.27)",
                "new keys c=16 (other work 0.30 cores, steal 0.00)",
            ]
        );
    }
}
