//! The simulation in `make test`: the regression seeds (each once found a defect), then
//! `SIM_SCHEDULES` random schedules from a fixed seed (100,000 by default), which must reach
//! every event of `MUST_REACH` and visit every dangerous region of `sim::REGIONS`, then
//! `SIM_FRESH_SCHEDULES` fresh ones (one and a half times `SIM_SCHEDULES` by default) from a
//! seed derived from the commit and the UTC date (`SIM_FRESH_START` replays a block), spread
//! over every mix of faults, so that each commit and each day explores schedules no run has
//! seen. Every part goes on past failures and counts them; the test fails if any failed.

use sim::driver::{self, Block, Report, Search};
use std::time::{Duration, Instant};

/// The longest a failure's shrinking may take (some failures' replays are slow: one of the
/// `database` mix took a minute for its 3,000).
const SHRINK_TIME: Duration = Duration::from_secs(15);

/// Events every run of 100,000 schedules reaches (filter counters by name, model events).
const MUST_REACH: &[&str] = &[
    "idempotency.replayed",
    "idempotency.in_progress_409",
    "idempotency.mismatch_422",
    "idempotency.stored_without_body",
    "idempotency.complete_refused",
    "idempotency.claim_refused",
    "idempotency.complete_gave_up",
    "idempotency.fenced_out",
    "idempotency.released",
    "idempotency.failed_open",
    "idempotency.outcome_unknown",
    "idempotency.outcome_unknown_409",
    "idempotency.reconcile_executed",
    "idempotency.reconcile_running",
    "idempotency.reconcile_not_executed",
    "idempotency.reconcile_failed",
    "idempotency.reexecuted",
    "idempotency.wait_replayed",
    "idempotency.wait_timed_out",
    "idempotency.wait_refused",
    "idempotency.claim_batches",
    "idempotency.claimed_for_ended_stream",
    "idempotency.complete_batches",
    "sim.claim_waits",
    "sim.wait_settled",
    "sim.finished_after_caller_left",
    "sim.upstream_refused_stale_token",
    "sim.worker_killed",
    "sim.wake_lost",
];

fn main() {
    let params = sim::Params::default();
    let regressions = include_str!("../regressions.txt");
    let mut failed = false;
    // Violations the fixes of issue 34 remove are counted, not failures, until each lands.
    let awaiting = sim::awaiting_fix();
    let mut awaited = 0;
    // The mixes of faults the regression seeds were found with (the fresh block runs them too).
    let mut regression_mixes = Vec::new();
    // The replay command of each regression seed that fails again.
    let mut failing = Vec::new();
    for line in regressions.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // `<seed> <faults> # what it found`
        let mut words = line.split_whitespace();
        let Some(seed) = words.next().and_then(|s| s.parse::<u64>().ok()) else {
            continue;
        };
        let faults = match words.next().map(sim::Faults::parse) {
            Some(Ok(f)) => f,
            _ => sim::Faults::ALL,
        };
        if !regression_mixes.contains(&faults) {
            regression_mixes.push(faults);
        }
        let p = sim::Params { faults, ..params };
        let o = sim::run_seed(seed, p);
        if let Some(v) = &o.violation {
            if awaiting.iter().any(|a| v.contains(a.as_str())) {
                awaited += 1;
                continue;
            }
            failed = true;
            failing.push(format!(
                "  regression seed {seed}: {}",
                driver::replay_command(seed, faults)
            ));
            let f = sim::driver::Failure {
                seed,
                faults,
                original_trace_len: o.trace.len(),
                shrunk: sim::shrink_within(&o, p, 2_000, Some(SHRINK_TIME)),
            };
            println!(
                "regression seed {seed} ({line}) fails again: {v}\n{}",
                f.render()
            );
        }
    }
    let count = env_u64("SIM_SCHEDULES").unwrap_or(100_000);
    let start = env_u64("SIM_START").unwrap_or(1_000_000);
    if awaited > 0 {
        println!("{awaited} regression seeds broke an invariant awaiting a fix of issue 34");
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let report = driver::search(&Search {
        start,
        count,
        limit: None,
        threads,
        params,
        ignore: &awaiting,
        keep_going: true,
        shrink_time: Some(SHRINK_TIME),
    });
    println!("{}", report.summary());
    println!("reached:\n{}", report.coverage());
    println!("dangerous regions visited:\n{}", report.regions());
    if !report.ignored_by.is_empty() {
        println!("{}", sim::awaiting_report(&report));
    }
    if report.failed > 0 {
        println!("{}", report.failures());
        failed = true;
    }
    // The schedules must still reach the interleavings and regions they are for: a change
    // that made the model or the faults lose one would pass every invariant without testing it.
    // (The whole block runs, failures or not: the same code reaches the same.)
    let regions: Vec<String> = sim::REGIONS
        .iter()
        .map(|r| format!("{}{r}", sim::driver::REGION))
        .collect();
    let missed: Vec<&str> = MUST_REACH
        .iter()
        .copied()
        .chain(regions.iter().map(String::as_str))
        .filter(|e| !report.reached.contains_key(e))
        .collect();
    if count >= 100_000 && !missed.is_empty() {
        println!("the schedules no longer reach: {missed:?}");
        failing.push(format!(
            "  the fixed schedules no longer reach {} events or regions",
            missed.len()
        ));
        failed = true;
    }
    let fresh = fresh_block(count, &regression_mixes, threads, &awaiting);
    failed |= fresh.iter().any(|r| r.failed > 0);
    if failed {
        // Where to look, last: the replay command of each failing regression seed and of each
        // block's first failure.
        failing.extend(std::iter::once(&report).chain(&fresh).filter_map(|r| {
            let f = r.failure.as_ref()?;
            Some(format!(
                "  {} of {} ({}); first: {}",
                r.failed,
                r.seeds(),
                driver::mix_name(r.faults),
                driver::replay_command(f.seed, f.faults)
            ))
        }));
        println!(
            "the simulation FAILED (the details above):\n{}",
            failing.join("\n")
        );
        std::process::exit(1);
    }
    println!(
        "test result: ok. {} passed; 0 failed",
        report.schedules + fresh.iter().map(|r| r.schedules).sum::<u64>()
    );
}

/// The fresh schedules: `SIM_FRESH_SCHEDULES` seeds from a start derived from the commit and
/// the UTC date (or `SIM_FRESH_START`), split over every mix of faults (`all` the largest
/// share). Prints the plan and its replay commands before running it, each mix's failures
/// after.
fn fresh_block(
    fixed: u64,
    regression_mixes: &[sim::Faults],
    threads: usize,
    awaiting: &[String],
) -> Vec<Report> {
    let total = env_u64("SIM_FRESH_SCHEDULES").unwrap_or(fixed / 2 * 3);
    if total == 0 {
        println!("fresh schedules: none (SIM_FRESH_SCHEDULES=0)");
        return Vec::new();
    }
    let (start, from) = match env_u64("SIM_FRESH_START") {
        Some(s) => (s, "SIM_FRESH_START".to_owned()),
        None => {
            let date = driver::utc_date(std::time::SystemTime::now());
            match commit() {
                Some(c) => (
                    driver::fresh_start(Some(&c), &date),
                    format!("commit {c}, UTC date {date}"),
                ),
                None => (
                    driver::fresh_start(None, &date),
                    format!("UTC date {date}; no git commit"),
                ),
            }
        }
    };
    let plan = driver::plan(start, total, &driver::fault_mixes(regression_mixes));
    println!(
        "fresh schedules: {total} from seed {start} ({from}), over {} mixes of faults; \
         this block again: SIM_FRESH_START={start} SIM_FRESH_SCHEDULES={total}; \
         a failing seed alone: make simulate SEED=<seed> FAULTS=<mix>",
        plan.len()
    );
    for b in &plan {
        println!(
            "  {:<34} seeds {} to {}: make simulate START={} SEEDS={} FAULTS={}",
            driver::mix_name(b.faults),
            b.start,
            b.start + b.count - 1,
            b.start,
            b.count,
            driver::mix_name(b.faults)
        );
    }
    let began = Instant::now();
    let reports: Vec<Report> = plan
        .iter()
        .map(
            |&Block {
                 faults,
                 start,
                 count,
             }| {
                driver::search(&Search {
                    start,
                    count,
                    limit: None,
                    threads,
                    params: sim::Params {
                        faults,
                        ..sim::Params::default()
                    },
                    ignore: awaiting,
                    keep_going: true,
                    shrink_time: Some(SHRINK_TIME),
                })
            },
        )
        .collect();
    let schedules: u64 = reports.iter().map(|r| r.schedules).sum();
    let failed: u64 = reports.iter().map(|r| r.failed).sum();
    println!(
        "fresh schedules: {schedules} ({}) in {:.1} s, {failed} failed",
        match schedules {
            0 => "none".to_owned(),
            n => format!("seeds {start} to {}", start + n - 1),
        },
        began.elapsed().as_secs_f64()
    );
    for r in &reports {
        println!("  {}", r.summary());
    }
    for r in &reports {
        if !r.ignored_by.is_empty() {
            println!("{}", sim::awaiting_report(r));
        }
        if r.failed > 0 {
            println!("{}", r.failures());
        }
    }
    reports
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// The commit under test (`git rev-parse HEAD` in this crate's directory), if git can tell.
fn commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    let c = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !c.is_empty()).then_some(c)
}
