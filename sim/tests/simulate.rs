//! The simulation in `make test`: the regression seeds (each once found a defect), then
//! `SIM_SCHEDULES` random schedules (100,000 by default), which must reach every event of
//! `MUST_REACH` and visit every dangerous region of `sim::REGIONS`.

use std::time::Duration;

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
];

fn main() {
    let params = sim::Params::default();
    let regressions = include_str!("../regressions.txt");
    let mut failed = false;
    // Violations the fixes of issue 34 remove are counted, not failures, until each lands.
    let awaiting = sim::awaiting_fix();
    let mut awaited = 0;
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
        let p = sim::Params { faults, ..params };
        let o = sim::run_seed(seed, p);
        if let Some(v) = &o.violation {
            if awaiting.iter().any(|a| v.contains(a.as_str())) {
                awaited += 1;
                continue;
            }
            failed = true;
            let f = sim::driver::Failure {
                seed,
                faults,
                original_trace_len: o.trace.len(),
                shrunk: sim::shrink(&o, p, 2_000),
            };
            println!(
                "regression seed {seed} ({line}) fails again: {v}\n{}",
                f.render()
            );
        }
    }
    let count = std::env::var("SIM_SCHEDULES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000u64);
    let start = std::env::var("SIM_START")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000u64);
    if awaited > 0 {
        println!("{awaited} regression seeds broke an invariant awaiting a fix of issue 34");
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let report =
        sim::driver::run_many_ignoring(start, count, None::<Duration>, threads, params, &awaiting);
    println!("{}", report.summary());
    println!("reached:\n{}", report.coverage());
    println!("dangerous regions visited:\n{}", report.regions());
    if !report.ignored_by.is_empty() {
        println!("{}", sim::awaiting_report(&report));
    }
    if let Some(f) = &report.failure {
        println!("{}", f.render());
        failed = true;
    }
    // The schedules must still reach the interleavings and regions they are for: a change
    // that made the model or the faults lose one would pass every invariant without testing it.
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
    if report.failure.is_none() && count >= 100_000 && !missed.is_empty() {
        println!("the schedules no longer reach: {missed:?}");
        failed = true;
    }
    if failed {
        std::process::exit(1);
    }
    println!("test result: ok. {} passed; 0 failed", report.schedules);
}
