//! The figures, the ratios against the baselines, the goals, as a table, JSON and markdown.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::pgbench::PgbenchResult;
use crate::ScenarioResult;

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
        let mut ratios = Vec::new();
        for r in &i.results {
            if r.scenario == "plain" || r.scenario == "state_api_dup" {
                continue;
            }
            if r.scenario == "state_api" {
                if let Some(pg) = i.pgbench.iter().find(|p| p.clients == r.connections) {
                    ratios.push(Ratio {
                        scenario: r.scenario.clone(),
                        connections: r.connections,
                        rate_ratio: r.rate / pg.tps,
                        added_p50_ms: r.p50_ms - pg.p50_ms,
                        added_p99_ms: r.p99_ms - pg.p99_ms,
                        baseline: "pgbench INSERT ON CONFLICT".into(),
                    });
                }
                continue;
            }
            if let Some(p) = find(&i.results, "plain", r.connections) {
                ratios.push(Ratio {
                    scenario: r.scenario.clone(),
                    connections: r.connections,
                    rate_ratio: r.rate / p.rate,
                    added_p50_ms: r.p50_ms - p.p50_ms,
                    added_p99_ms: r.p99_ms - p.p99_ms,
                    baseline: "plain Envoy".into(),
                });
            }
        }
        let ratio = |s: &str, c: usize| {
            ratios
                .iter()
                .find(|r| r.scenario == s && r.connections == c)
        };
        let mut goals = Vec::new();
        let mut goal =
            |g: &str, target: &str, measured: Option<f64>, unit: &str, pass: fn(f64) -> bool| {
                goals.push(Goal {
                    goal: g.into(),
                    target: target.into(),
                    measured: measured
                        .map(|m| format!("{}{unit}", f(m, if unit.is_empty() { 2 } else { 3 })))
                        .unwrap_or_else(|| "not measured".into()),
                    pass: measured.is_some_and(pass),
                });
            };
        // Goals as ratios and CPU per request measured in this run: they hold on any machine.
        let per_request = |scenario: &str, c: usize, process: Option<&str>| {
            find(&i.results, scenario, c).and_then(|r| {
                let cores = match process {
                    Some(p) => r.cpu.processes.get(p).copied()?,
                    None => r.cpu.machine_cores - r.cpu.other_cores,
                };
                (r.rate > 0.0).then(|| cores / r.rate * 1e6)
            })
        };
        let over = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
        let pg = |c: usize| i.pgbench.iter().find(|p| p.clients == c);
        goal(
            "CPU per new key at 16 connections, every process, vs a plain request's",
            "<= 5.0x",
            over(per_request("new", 16, None), per_request("plain", 16, None)),
            "",
            |v| v <= 5.0,
        );
        goal(
            "Envoy's CPU per new key at 16 connections vs plain Envoy's per request",
            "<= 3.0x",
            over(
                per_request("new", 16, Some("envoy")),
                per_request("plain", 16, Some("envoy-plain")),
            ),
            "",
            |v| v <= 3.0,
        );
        goal(
            "Postgres's CPU per new key at 16 connections vs one pgbench INSERT's",
            "<= 1.0x",
            over(
                per_request("new", 16, Some("postgres")),
                pg(16).and_then(|p| p.postgres_cpu_us_per_tx),
            ),
            "",
            |v| v <= 1.0,
        );
        goal(
            "added p50 of a new key at 1 connection vs pgbench's single-INSERT p50",
            "<= 3.5x",
            over(
                ratio("new", 1).map(|r| r.added_p50_ms),
                pg(1).map(|p| p.p50_ms),
            ),
            "",
            |v| v <= 3.5,
        );
        // Round one's 3 ms was 2.8x plain Envoy's p99 of that run; a 409 is answered from the
        // worker's memory, so it should cost no more than twice a proxied request's tail.
        goal(
            "in-flight duplicate 409 p99 at 16 connections vs plain Envoy's p99",
            "<= 2.0x",
            over(
                find(&i.results, "inflight", 16).map(|r| r.p99_ms),
                find(&i.results, "plain", 16).map(|r| r.p99_ms),
            ),
            "",
            |v| v <= 2.0,
        );
        goal(
            "replay throughput at 16 connections vs plain Envoy",
            ">= 1.00",
            ratio("replay", 16).map(|r| r.rate_ratio),
            "",
            |v| v >= 1.0,
        );
        goal(
            "state API claim+complete/s vs pgbench INSERT/s at 16 clients",
            ">= 0.60",
            ratio("state_api", 16).map(|r| r.rate_ratio),
            "",
            |v| v >= 0.60,
        );
        goal(
            "state API memory under load (VmHWM)",
            "<= 50 MiB",
            i.memory.get("state-api").map(|m| m.hwm_kib as f64 / 1024.0),
            " MiB",
            |v| v <= 50.0,
        );
        goal(
            "filter .wasm size",
            "<= 300 KiB",
            Some(i.wasm_bytes as f64 / 1024.0),
            " KiB",
            |v| v <= 300.0,
        );
        if let Some(p) = &i.purge {
            goals.push(Goal {
                goal: "purge capacity vs the highest new-key rate of the run".into(),
                target: ">= 3.0x".into(),
                measured: format!(
                    "{:.1}x ({:.0} rows/s against {:.0} new keys/s, {})",
                    p.ratio, p.rows_per_s, p.highest_new_keys_per_s, p.highest_new_keys_scenario
                ),
                pass: p.ratio >= 3.0,
            });
        }
        // Against the seeds' in-app design in the same run: ahead on throughput, p50 and p99.
        for (ours, theirs, c, what) in [
            ("new", "seed_new", 1, "new keys"),
            ("new", "seed_new", 16, "new keys"),
            ("inflight", "seed_inflight", 1, "in-flight duplicates"),
            ("inflight", "seed_inflight", 16, "in-flight duplicates"),
        ] {
            let (Some(a), Some(b)) = (find(&i.results, ours, c), find(&i.results, theirs, c))
            else {
                continue;
            };
            let (rate, p50, p99) = (a.rate / b.rate, a.p50_ms / b.p50_ms, a.p99_ms / b.p99_ms);
            goals.push(Goal {
                goal: format!("{what} at {c} connection(s) vs the seeds' in-app design: req/s, p50, p99"),
                target: "req/s >= 1.0x, p50 and p99 <= 1.0x".into(),
                measured: format!(
                    "{rate:.2}x req/s ({:.0} vs {:.0}), p50 {p50:.2}x ({:.3} vs {:.3} ms), p99 {p99:.2}x ({:.3} vs {:.3} ms)",
                    a.rate, b.rate, a.p50_ms, b.p50_ms, a.p99_ms, b.p99_ms
                ),
                pass: rate >= 1.0 && p50 <= 1.0 && p99 <= 1.0,
            });
        }
        let total_errors: u64 = i.results.iter().map(|r| r.error_count).sum::<u64>()
            + i.pgbench.iter().map(|p| p.failed).sum::<u64>();
        let slow_ok = i.slow_statuses.iter().all(|s| s == "201");
        goals.push(Goal {
            goal: "every answer as expected (no errors; the slow holders got 201)".into(),
            target: "0 errors".into(),
            measured: format!(
                "{total_errors} errors; slow holders: {}",
                i.slow_statuses.join(", ")
            ),
            pass: total_errors == 0 && slow_ok,
        });
        let all_goals_pass = goals.iter().all(|g| g.pass);

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
        let machine = BTreeMap::from([
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
        ]);
        let method = BTreeMap::from([
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
        ]);
        Self {
            generated_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
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

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# Benchmark\n");
        let _ = writeln!(
            out,
            "Generated by `make bench` (bench/src/main.rs); raw figures in [bench.json](bench.json), \
             latency percentiles in [bench.png](bench.png). One run of {} s (plus {} s warm-up) per row, on loopback, \
             {} CPUs shared by the load generator, Envoy, the checkout, the state API and Postgres. \
             Before each run (and before pgbench) the records table is vacuumed and analyzed and Postgres checkpoints, so \
             that no run pays for the garbage of the runs before it.\n",
            self.method.get("measure_s").cloned().unwrap_or_default(),
            self.method.get("warmup_s").cloned().unwrap_or_default(),
            self.machine.get("cpus").cloned().unwrap_or_default(),
        );
        let _ = writeln!(out, "| {} |", Self::HEADER.join(" | "));
        let _ = writeln!(
            out,
            "|{}|",
            Self::HEADER
                .iter()
                .enumerate()
                .map(|(i, _)| if i == 0 { "---" } else { "---:" })
                .collect::<Vec<_>>()
                .join("|")
        );
        for r in self.rows() {
            let _ = writeln!(out, "| {} |", r.join(" | "));
        }
        let _ = writeln!(
            out,
            "\n`x plain`: requests/s relative to the plain Envoy (router only) at the same number of connections; \
             for the state API, relative to pgbench's raw INSERT. `+p50 ms`: the same, for the median.\n"
        );
        for r in self.ratios.iter().filter(|r| r.scenario == "state_api") {
            let _ = writeln!(
                out,
                "State API at {} client(s): each claim+complete is two commits, so in commits it runs at {} of pgbench's single-INSERT rate.\n",
                r.connections,
                f(2.0 * r.rate_ratio, 2)
            );
        }
        let _ = writeln!(out, "## Goals\n");
        let _ = writeln!(out, "| goal | target | measured | |");
        let _ = writeln!(out, "|---|---|---|---|");
        for g in &self.goals {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                g.goal,
                g.target,
                g.measured,
                if g.pass { "pass" } else { "**FAIL**" }
            );
        }
        let noisy = noisy_runs(
            self.scenarios
                .iter()
                .map(|r| (r.label.as_str(), r.connections, &r.cpu)),
        );
        if !noisy.is_empty() {
            let _ = writeln!(
                out,
                "\n**Noisy runs**, still above {} cores of other work or steal after their second attempt: {}. \
                 A goal that compares one of them with another run is not a result of this run: a baseline measured \
                 while the hypervisor took its CPU costs more per request, and flatters every ratio against it.",
                crate::NOISY_CORES,
                noisy.join("; ")
            );
        }
        let _ = writeln!(out, "\n## Memory and size\n");
        let _ = writeln!(out, "| process | VmHWM MiB | VmRSS MiB (end) |");
        let _ = writeln!(out, "|---|---:|---:|");
        for (name, m) in &self.memory_kib {
            let _ = writeln!(
                out,
                "| {name} | {:.1} | {:.1} |",
                m.hwm_kib as f64 / 1024.0,
                m.rss_kib as f64 / 1024.0
            );
        }
        let _ = writeln!(
            out,
            "\nfilter.wasm: {} bytes ({:.1} KiB).\n",
            self.wasm_bytes,
            self.wasm_bytes as f64 / 1024.0
        );
        if !self.envoy_cluster_stats.is_empty() {
            let _ = writeln!(out, "Envoy cluster counters at the end of the run (connections opened vs requests sent), and the filter's claims and completes sent in batches (`claims_batched` of `claimed`, in `claim_batches` callouts):\n");
            for (envoy, stats) in &self.envoy_cluster_stats {
                let list: Vec<String> = stats
                    .iter()
                    .filter(|(_, v)| **v > 0)
                    .map(|(k, v)| format!("`{k}` {v}"))
                    .collect();
                let _ = writeln!(out, "- {envoy}: {}", list.join(", "));
            }
            let _ = writeln!(out);
        }
        let _ = writeln!(out, "## CPU per request\n");
        let _ = writeln!(
            out,
            "Microseconds of CPU per correct answer, by process, during the measured window (from /proc; \
             irq = interrupt and softirq time, mostly loopback TCP). With 2 cores shared by everything, the \
             total bounds the throughput: 2 s of CPU per second / total. The state API columns on the right \
             are its own mean time per request, from its /metrics histogram, and how many claims and \
             completes shared one statement and commit (group commit; 1.00: each ran alone).\n"
        );
        let _ = writeln!(out, "| scenario | conns | Envoy µs | state API µs | checkout µs | Postgres µs | load gen µs | irq µs | total µs | Envoy worker busy | other work (cores) | steal (cores) | state API ms/claim | ms/complete | requests per statement |");
        let _ = writeln!(
            out,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.scenarios {
            // The Envoy a scenario goes through; none for those sent straight at the state API
            // or at the seed design.
            let envoy_name = match r.scenario.as_str() {
                "plain" => Some("envoy-plain"),
                "jwt" => Some("envoy-jwt"),
                "new_bg" => Some("envoy-bg"),
                "new_single" => Some("envoy-single"),
                "new_tls" => Some("envoy-tls"),
                "seed_edge" => Some("envoy-seed"),
                s if s.starts_with("state_api") || s.starts_with("seed_") => None,
                _ => Some("envoy"),
            };
            let state_api_name = state_api_process(&r.scenario);
            // The seed design has no state API: its Node app is in the checkout column.
            let seed = r.scenario.starts_with("seed_");
            let us = |cores: f64| cores / r.rate.max(1e-9) * 1e6;
            let p = |k: &str| r.cpu.processes.get(k).copied().unwrap_or(0.0);
            let envoy = envoy_name.map_or(0.0, p);
            let parts = [
                envoy,
                if seed { 0.0 } else { p(state_api_name) },
                p(if seed { "seed-node" } else { "checkout" }),
                p("postgres"),
                p("bench"),
                r.cpu.irq_cores,
            ];
            let total: f64 = parts.iter().sum();
            let m = |k: &str| {
                r.cpu
                    .state_api_mean_ms
                    .get(k)
                    .copied()
                    .map(|v| f(v, 3))
                    .unwrap_or_else(|| "-".into())
            };
            let worker = match envoy_name {
                None => "-".into(),
                Some(name) => r
                    .cpu
                    .envoy_worker_cores
                    .get(name)
                    .copied()
                    .map(|v| f(v, 2))
                    .unwrap_or_default(),
            };
            let cells: Vec<String> = parts.iter().map(|&c| f(us(c), 0)).collect();
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.label,
                r.connections,
                cells.join(" | "),
                f(us(total), 0),
                worker,
                f(r.cpu.other_cores, 2),
                f(r.cpu.steal_cores, 2),
                m("claim"),
                m("complete"),
                r.cpu
                    .state_api_requests_per_statement
                    .map(|v| f(v, 2))
                    .unwrap_or_else(|| "-".into()),
            );
        }
        if let Some(chain) = self.serial_chain() {
            chain.write(&mut out);
        }
        let tls_rows = self.tls_cost();
        if !tls_rows.is_empty() {
            let _ = writeln!(out, "\n## TLS on the state API hop\n");
            let _ = writeln!(
                out,
                "New keys through two filter Envoys in the same run: one calling the state API in plain \
                 HTTP (`new keys`), one calling a second state API on the same database over mutual TLS \
                 (`new_tls`: Envoy verifies the state API's certificate and presents its own, the state \
                 API verifies it). Microseconds of CPU per new key; the connections Envoy keeps to the \
                 state API are reused, so this is mostly record encryption, handshakes are rare.\n"
            );
            let _ = writeln!(out, "| conns | Envoy µs plain | Envoy µs TLS | state API µs plain | state API µs TLS | total µs plain | total µs TLS | TLS costs µs per new key | new keys/s plain | TLS |");
            let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
            for t in &tls_rows {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    t.connections,
                    f(t.envoy_us.0, 0),
                    f(t.envoy_us.1, 0),
                    f(t.state_api_us.0, 0),
                    f(t.state_api_us.1, 0),
                    f(t.total_us.0, 0),
                    f(t.total_us.1, 0),
                    f(t.total_us.1 - t.total_us.0, 0),
                    f(t.rate.0, 0),
                    f(t.rate.1, 0),
                );
            }
        }
        if !self.waiting.is_empty() {
            let _ = writeln!(out, "\n## Waiting retries\n");
            let _ = writeln!(
                out,
                "A slow request holds a key while each client keeps retrying it: `wait` sends \
                 `Prefer: wait=N` and asks again when its wait ends at the deadline (409); `poll` retries \
                 without it once a second (its `Retry-After`), answered 409 at once (from the worker's \
                 in-flight memory for 500 ms after each state API answer). Per client and second: claim \
                 callouts Envoy made, and milliseconds of CPU (thousandths of a core) by process. While \
                 it waits, the state API looks again every 250 ms (a read-only claim, no commit): that is \
                 the Postgres and state API share of `wait`.\n"
            );
            let _ = writeln!(out, "| retries | clients | wait s | claim callouts per client·s | Envoy | state API | Postgres | load gen | irq | total CPU ms per client·s |");
            let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
            for w in &self.waiting {
                let c = |k: &str| f(w.cpu_ms_per_waiter_s.get(k).copied().unwrap_or(0.0), 3);
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    w.mode,
                    w.waiters,
                    if w.mode == "wait" {
                        w.wait_s.to_string()
                    } else {
                        "-".into()
                    },
                    f(w.claims_per_waiter_s, 3),
                    c("envoy"),
                    c("state-api"),
                    c("postgres"),
                    c("bench"),
                    c("irq"),
                    f(w.total_cpu_ms_per_waiter_s, 3)
                );
            }
        }
        if let Some(p) = &self.purge {
            let _ = writeln!(out, "\n## Purge\n");
            let _ = writeln!(
                out,
                "{} expired records inserted straight into the table, then a state API with a 1 s purge \
                 interval started on it (the run's other state APIs purge the same database too): \
                 gone from the table {:.1} s after they were in place, **{:.0} rows/s**, \
                 {:.1}x the highest new-key rate of this run ({:.0}/s, {}). A pass works at most \
                 `STATE_API_PURGE_PASS_MS` (2 s); with a backlog left the next follows after a pause as \
                 long, and its batches grow from `STATE_API_PURGE_BATCH` (500) up to 16 times that while \
                 each statement stays under 50 ms.\n",
                p.rows, p.seconds, p.rows_per_s, p.ratio, p.highest_new_keys_per_s, p.highest_new_keys_scenario
            );
        }
        if let Some(notes) = &self.notes {
            let _ = writeln!(out, "\n{}", notes.trim_end());
        }
        let _ = writeln!(out, "\n## How quiet the machine was\n");
        let _ = writeln!(
            out,
            "Load average before: {}; after: {}. Largest share of the machine taken by other work during a run (busy time not taken by our \
             processes or interrupts, the hypervisor's steal included): {} cores. \
             The hypervisor's steal alone, at most: {} cores in a run; what of it is not in other work was charged to our processes \
             (a run with more than {} cores of other work or of steal is measured again once, the quieter kept).\n",
            self.machine.get("load_before").cloned().unwrap_or_default(),
            self.machine.get("load_after").cloned().unwrap_or_default(),
            self.machine.get("max_other_work_cores_in_a_run").cloned().unwrap_or_default(),
            self.machine.get("max_steal_cores_in_a_run").cloned().unwrap_or_default(),
            crate::NOISY_CORES,
        );
        let _ = writeln!(out, "## Method\n");
        let _ = writeln!(
            out,
            "Run it with `make bench` (builds the release binaries and the filter first). Knobs, as environment \
             variables: `BENCH_SECONDS` (8), `BENCH_WARMUP_SECONDS` (2), `BENCH_CONNECTIONS` (1,16), \
             `BENCH_SCENARIOS` (plain,jwt,new,new_bg,new_single,new_tls,seed_new,replay,inflight,seed_inflight,state_api_dup,state_api,waiting,pgbench,purge,seed_edge; seed_* start the seeds' Node design, which needs node and npm), \
             `BENCH_PURGE_ROWS` (300000: the purge scenario's backlog), \
             `BENCH_WAITERS` (16: clients of the waiting scenario), \
             `BENCH_STATE_API_ENV` (e.g. STATE_API_POOL_PING=false), `BENCH_QUIET_WAIT_SECONDS` (90: how long to \
             wait for a quiet machine first), `BENCH_OUT` (docs).\n"
        );
        for (k, v) in &self.method {
            if *k != "stack_dir" {
                let _ = writeln!(out, "- {k}: {v}");
            }
        }
        out
    }
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
