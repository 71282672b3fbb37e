//! `make bench-scale` (`bench scale`, issue 38): how the cost grows as the work grows. `make
//! bench` measures one point of each curve (an empty table, small bodies, a handful of routes,
//! 1 and 16 connections); this measures the curves a growing user meets, each against its own
//! first point in the same run:
//!
//! 1. `records`: claim+complete CPU per pair and p99 through the state API with 0, 10 M, 50 M
//!    and 100 M rows in the table (as many as the disk allows, leaving 8 GiB free);
//! 2. `steady`: half an hour of new keys at a constant rate with a one-minute retention, the
//!    purge running all along: sizes, dead tuples and p99 must level off;
//! 3. `body`: the fingerprint's cost per MiB (JSON and opaque) against SHA-256 of the same
//!    bytes, and Envoy's memory with 500 concurrent 1 MiB requests (`max_buffered_bytes`);
//! 4. `routes`: Envoy's CPU per matched and unmatched request with 1, 100 and 1,000 routes;
//! 5. `clients`: 1 to 256 connections of new keys and replays: only 201, replay, 409 and 503
//!    + Retry-After, fast refusals, throughput held;
//! 6. `waiting`: 1,000 and 10,000 `Prefer: wait` retries on a few running keys: memory and CPU
//!    per waiter, and the time from the completion to the last waiter's replay.
//!
//! Each curve's goal is printed with pass/fail. Writes docs/scale.json, docs/scale.png
//! (bench/plot_scale.py) and the section of docs/BENCH.md between `<!-- scale -->` and
//! `<!-- /scale -->`; with `SCALE_QUICK=1` (`make bench-scale QUICK=1`) a short version of each
//! curve (figures that prove the machinery, not the curves) into target/scale-quick/ instead.
//!
//! Environment: SCALE_CURVES (e.g. "records,body"; default all; `none` writes the report again
//! from the scale.json there, measuring nothing), SCALE_QUICK, SCALE_OUT, and
//! the curves' own settings (see each module).

mod body;
mod burst;
mod clients;
mod held_body;
mod records;
mod report;
mod routes;
mod steady;
mod waiting;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{env_u64, procfs, wait_for_quiet};

/// The curves, in the order they run.
const CURVES: [&str; 6] = ["body", "routes", "clients", "waiting", "records", "steady"];

/// What a run of `bench scale` does.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    /// Short smoke versions of every curve.
    pub quick: bool,
    pub curves: Vec<String>,
}

impl Settings {
    fn from_env() -> Result<Self, String> {
        let quick = env_u64("SCALE_QUICK", 0) == 1;
        let curves: Vec<String> = match std::env::var("SCALE_CURVES") {
            // No curve: the report is written again from the scale.json there.
            Ok(v) if v.trim() == "none" => Vec::new(),
            Ok(v) if !v.trim().is_empty() => v.split(',').map(|s| s.trim().to_owned()).collect(),
            _ => CURVES.iter().map(|s| (*s).to_owned()).collect(),
        };
        if let Some(unknown) = curves.iter().find(|c| !CURVES.contains(&c.as_str())) {
            return Err(format!(
                "SCALE_CURVES: no curve {unknown:?} (the curves: {})",
                CURVES.join(", ")
            ));
        }
        Ok(Self { quick, curves })
    }

    pub fn wants(&self, curve: &str) -> bool {
        self.curves.iter().any(|c| c == curve)
    }

    /// The levels of a curve: `var` (comma-separated numbers) if set, else `full`, or `quick`
    /// in a quick run.
    pub fn levels<T: std::str::FromStr>(&self, var: &str, full: &str, quick: &str) -> Vec<T> {
        let default = if self.quick { quick } else { full };
        std::env::var(var)
            .unwrap_or_else(|_| default.into())
            .split(',')
            .filter_map(|v| v.trim().parse().ok())
            .collect()
    }

    /// `full` seconds, or `quick` in a quick run.
    pub fn secs(&self, full: u64, quick: u64) -> Duration {
        Duration::from_secs(if self.quick { quick } else { full })
    }
}

/// How quiet the machine was while a curve ran: the load average around it and the highest
/// steal and other work of its measured runs, in cores (figures from a noisy machine are noise).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Quiet {
    pub load_before: f64,
    pub load_after: f64,
    pub steal_cores_max: f64,
    pub other_cores_max: f64,
}

impl Quiet {
    pub fn start() -> Self {
        Self {
            load_before: procfs::loadavg().0,
            ..Self::default()
        }
    }

    /// Takes a measured run's steal and other work into account.
    pub fn saw(&mut self, cpu: &crate::CpuUse) {
        self.note(cpu.steal_cores, cpu.other_cores);
    }

    /// Takes a measured window's steal and other work (cores) into account.
    pub fn note(&mut self, steal_cores: f64, other_cores: f64) {
        self.steal_cores_max = self.steal_cores_max.max(steal_cores);
        self.other_cores_max = self.other_cores_max.max(other_cores);
    }

    pub fn end(mut self) -> Self {
        self.load_after = procfs::loadavg().0;
        self
    }

    pub fn noisy(&self) -> bool {
        crate::noise_cores(self.other_cores_max, self.steal_cores_max) > crate::NOISY_CORES
    }

    pub fn describe(&self) -> String {
        format!(
            "load average {:.2} before, {:.2} after; steal up to {:.2} cores, other work up to {:.2}{}",
            self.load_before,
            self.load_after,
            self.steal_cores_max,
            self.other_cores_max,
            if self.noisy() { " (noisy: figures are noise)" } else { "" }
        )
    }
}

/// One goal of a curve, as printed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Goal {
    pub curve: String,
    pub goal: String,
    pub target: String,
    pub measured: String,
    /// None: not measured in this run (the reason is in `measured`).
    pub pass: Option<bool>,
}

impl Goal {
    pub fn new(
        curve: &str,
        goal: impl Into<String>,
        target: impl Into<String>,
        measured: impl Into<String>,
        pass: Option<bool>,
    ) -> Self {
        Self {
            curve: curve.to_owned(),
            goal: goal.into(),
            target: target.into(),
            measured: measured.into(),
            pass,
        }
    }

    /// The goal every curve has: that it ran (`why` it did not).
    pub fn failed_to_run(curve: &str, why: &str) -> Self {
        Self::new(curve, "the curve ran", "no failure", why, Some(false))
    }

    fn verdict(&self) -> &'static str {
        match self.pass {
            Some(true) => "pass",
            Some(false) => "**FAIL**",
            None => "not measured",
        }
    }
}

/// A curve's result as the report holds it: its figures (JSON), its goals and its Markdown.
pub struct CurveOutput {
    pub name: &'static str,
    pub json: serde_json::Value,
    pub goals: Vec<Goal>,
    pub markdown: String,
    pub quiet: Quiet,
}

pub fn run() -> Result<(), String> {
    let started = Instant::now();
    if std::env::var_os("STACK_PROFILE").is_none() {
        std::env::set_var("STACK_PROFILE", "release");
    }
    let settings = Settings::from_env()?;
    let out_dir = match std::env::var("SCALE_OUT") {
        Ok(d) => PathBuf::from(d),
        Err(_) if settings.quick => {
            test_support::process::workspace_root().join("target/scale-quick")
        }
        Err(_) => test_support::process::workspace_root().join("docs"),
    };
    if !settings.curves.is_empty() {
        wait_for_quiet(Duration::from_secs(env_u64(
            "SCALE_QUIET_WAIT_SECONDS",
            if settings.quick { 5 } else { 90 },
        )));
    }
    eprintln!(
        "bench scale: curves {} ({}), writing to {}",
        settings.curves.join(", "),
        if settings.quick {
            "quick: smoke versions"
        } else {
            "full"
        },
        out_dir.display()
    );
    let mut outputs: Vec<CurveOutput> = Vec::new();
    let mut failed = BTreeMap::new();
    for curve in CURVES.iter().filter(|c| settings.wants(c)) {
        eprintln!("bench scale: curve {curve}");
        let t0 = Instant::now();
        let result = match *curve {
            "records" => records::run(&settings),
            "steady" => steady::run(&settings),
            "body" => body::run(&settings),
            "routes" => routes::run(&settings),
            "clients" => clients::run(&settings),
            "waiting" => waiting::run(&settings),
            _ => Err(format!("no curve {curve}")),
        };
        match result {
            Ok(out) => {
                eprintln!(
                    "bench scale: curve {curve} done in {:.0} s ({})",
                    t0.elapsed().as_secs_f64(),
                    out.quiet.describe()
                );
                outputs.push(out);
            }
            Err(e) => {
                eprintln!("bench scale: curve {curve} FAILED: {e}");
                failed.insert((*curve).to_owned(), e);
            }
        }
    }
    let mut goals: Vec<Goal> = outputs.iter().flat_map(|o| o.goals.clone()).collect();
    goals.extend(
        failed
            .iter()
            .map(|(curve, why)| Goal::failed_to_run(curve, why)),
    );
    println!("{}", report::goals_table(&goals, false));
    let run = report::Run {
        git: crate::report::git_state(),
        settings: settings.clone(),
        total_s: started.elapsed().as_secs_f64(),
    };
    report::write(&run, &outputs, &failed, &out_dir)?;
    let failing = goals.iter().filter(|g| g.pass == Some(false)).count();
    eprintln!(
        "bench scale: {} goals, {} pass, {} fail, {} not measured; {:.0} s in all",
        goals.len(),
        goals.iter().filter(|g| g.pass == Some(true)).count(),
        failing,
        goals.iter().filter(|g| g.pass.is_none()).count(),
        started.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} curve(s) failed to run: {}",
            failed.len(),
            failed.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    }
}

/// A table whose first two columns are names: Markdown or aligned text.
pub fn table(head: &[&str], rows: &[Vec<String>], md: bool) -> String {
    crate::table::table(head, rows, md, 2)
}

/// A figure with `digits` decimals, or "n/a".
pub fn fig(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "n/a".into()
    }
}

/// `a / b`, NaN when `b` is 0 or either is not finite.
pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 && a.is_finite() && b.is_finite() {
        a / b
    } else {
        f64::NAN
    }
}

/// Whether `v` is at most `limit` (NaN: no).
pub fn at_most(v: f64, limit: f64) -> bool {
    v.is_finite() && v <= limit
}

/// A [`crate::Bench`] on `stack` that measures the processes listening on `ports` (by name)
/// and Postgres, with runs of `warmup` and `measure`; noisy runs are repeated until `retry_for`
/// from now.
pub(crate) fn bench_on<'a>(
    stack: &'a test_support::stack::Stack,
    ports: &[(&'static str, u16)],
    warmup: Duration,
    measure: Duration,
    retry_for: Duration,
) -> Result<crate::Bench<'a>, String> {
    let named = ports
        .iter()
        .map(|&(name, port)| {
            procfs::pid_listening_on(port)
                .map(|pid| (name, pid))
                .ok_or(format!("nothing listens on :{port}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(crate::Bench {
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?,
        postgres: &stack.postgres,
        database: stack.database_name().to_owned(),
        procs: crate::Procs {
            named,
            postgres: procfs::pid_listening_on(stack.postgres.port()),
        },
        state_api_port: stack.state_api.port,
        tck: procfs::clk_tck(),
        warmup,
        measure,
        started: Instant::now(),
        retry_budget_until: Instant::now() + retry_for,
        window_counters: None,
    })
}

/// Sends `POST /checkout` once for each of `keys` through `target` (one connection), each of
/// which must be created (201): keys to replay later.
pub fn create_keys(
    rt: &tokio::runtime::Runtime,
    target: std::net::SocketAddr,
    keys: &[String],
    what: &str,
) -> Result<(), String> {
    rt.block_on(async {
        let mut conn = crate::load::Conn::open(target).await?;
        for k in keys {
            let a = conn.send(&crate::checkout_req(k)).await?;
            if a.status != 201 {
                return Err(format!("{what} {k}: status {}", a.status));
            }
        }
        Ok(())
    })
}

/// Where answers that were refusals came from, printed after a level: Envoy's own counters of reset and
/// refused streams, the filter's and its Wasm VM's complaints in Envoy's log, and the state
/// API's refusals.
pub(super) fn print_refusal_sources(envoy: &test_support::envoy::Envoy, port: u16) {
    let envoy_counters = envoy
        .admin_get("/stats?usedonly&filter=(downstream_cx_destroy|downstream_rq_[45]xx|rq_timeout|overflow|reset|wasmcustom|connect_fail|upstream_rq_5xx|with_active_rq|protocol_error)")
        .unwrap_or_else(|e| format!("(Envoy's stats: {e})"));
    for line in envoy_counters.lines().filter(|l| !l.ends_with(": 0")) {
        eprintln!("    envoy {line}");
    }
    // The filter's and its Wasm VM's complaints (a host call that failed, a trap), each kind
    // once with its count.
    let mut complaints: BTreeMap<String, u64> = BTreeMap::new();
    for line in envoy.log().lines() {
        let complaint = [
            "idempotency",
            "wasm",
            "panicked",
            "RuntimeError",
            "critical",
        ]
        .iter()
        .filter_map(|w| line.find(w))
        .min();
        if let Some(at) = complaint.filter(|_| !line.contains("filter configured")) {
            let text: String = line[at..]
                .chars()
                .filter(|c| !c.is_ascii_digit())
                .take(160)
                .collect();
            *complaints.entry(text).or_default() += 1;
        }
    }
    for (text, n) in complaints.iter().rev().take(12) {
        eprintln!("    envoy log x{n}: {text}");
    }
    let api_metrics = test_support::net::http_get_at(crate::addr(port), "/metrics")
        .unwrap_or_else(|e| format!("(the state API's metrics: {e})"));
    for line in api_metrics.lines().filter(|l| {
        (l.starts_with("state_api_errors_total")
            || l.starts_with("state_api_shed_total")
            || l.starts_with("state_api_waits_total"))
            && !l.ends_with(" 0")
    }) {
        eprintln!("    state API {line}");
    }
}

/// The VmRSS and VmHWM of a process, in MiB.
pub fn memory_mib(pid: u32) -> (f64, f64) {
    let mib = |field| procfs::status_kib(pid, field).unwrap_or(0) as f64 / 1024.0;
    (mib("VmRSS"), mib("VmHWM"))
}

/// The soft limit of open files of this process, from /proc/self/limits.
pub fn open_files_limit() -> u64 {
    std::fs::read_to_string("/proc/self/limits")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Fails with what to do when fewer than `needed` files may be open (each connection is one,
/// in the load generator, in Envoy twice, in the state API).
pub fn need_open_files(needed: u64, what: &str) -> Result<(), String> {
    let limit = open_files_limit();
    if limit < needed {
        return Err(format!(
            "{what} needs at least {needed} open files per process, the limit is {limit}: run it with `ulimit -n {}` (make bench-scale raises it to 65,536, or to the hard limit)",
            needed.next_power_of_two().max(65_536)
        ));
    }
    Ok(())
}
