//! The simulation in `make test`: the regression seeds (each once found a defect), then
//! `SIM_SCHEDULES` random schedules (100,000 by default).

use std::time::Duration;

fn main() {
    let params = sim::Params::default();
    let regressions = include_str!("../regressions.txt");
    let mut failed = false;
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
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let report = sim::driver::run_many(start, count, None::<Duration>, threads, params);
    println!("{}", report.summary());
    if let Some(f) = &report.failure {
        println!("{}", f.render());
        failed = true;
    }
    if failed {
        std::process::exit(1);
    }
    println!("test result: ok. {} passed; 0 failed", report.schedules);
}
