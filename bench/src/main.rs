//! `make bench`: the whole stack (release builds, Envoy `--concurrency 1`) on loopback, measured
//! with one closed-loop load generator (src/load.rs), against a plain Envoy (router only) on the
//! same checkout upstream and against pgbench on the same Postgres cluster.
//!
//! Writes docs/bench.json, docs/BENCH.md and (with matplotlib in .venv) docs/bench.png.
//!
//! Environment: BENCH_SECONDS (measured seconds per run, default 8), BENCH_WARMUP_SECONDS
//! (default 2), BENCH_CONNECTIONS (default "1,16"), BENCH_OUT (default docs/).

mod bench_doc;
mod benchmark;
mod cpu;
mod fleet;
mod guard;
mod load;
mod measure;
mod ops;
mod peer;
mod pgbench;
mod procfs;
mod purge;
mod report;
mod scale;
mod soak;
mod table;
mod waiting;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use test_support::stack::Stack;

// What the soak, bench-scale and the waiting runs share with the benchmark, by the names they
// import.
pub(crate) use cpu::{
    cpu_between, noise_cores, state_api_metrics, CpuUse, Procs, Snapshot, NOISY_CORES,
};
pub(crate) use measure::{Bench, ScenarioResult, PERCENTILES};
pub(crate) use ops::{
    alice, checkout_req, claim_complete, new_key, op_claim_complete, op_created, op_inflight,
    op_replay,
};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `bench soak` (`make soak`): the long run of src/soak/; `bench scale` (`make
    // bench-scale`): the curves of src/scale/; `bench guard` (`make bench-guard`): the drift
    // guard of src/guard.rs; otherwise the benchmark.
    let what = std::env::args().nth(1).unwrap_or_default();
    let result = match what.as_str() {
        "soak" => soak::run(),
        "scale" => scale::run(),
        "guard" => guard::run(),
        _ => benchmark::run(),
    };
    if let Err(e) = result {
        let name = if what.is_empty() {
            "bench"
        } else {
            what.as_str()
        };
        eprintln!("{name} failed: {e}");
        std::process::exit(1);
    }
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Waits (at most `limit`) for a 2-second window in which other work keeps less than half a
/// core busy: figures taken while someone compiles are noise.
fn wait_for_quiet(limit: Duration) {
    let until = Instant::now() + limit;
    loop {
        let (b0, t0) = procfs::machine_ticks();
        std::thread::sleep(Duration::from_secs(2));
        let (b1, t1) = procfs::machine_ticks();
        let busy = (b1 - b0) as f64 / (t1 - t0).max(1) as f64 * procfs::cpu_count() as f64;
        if busy < 0.5 {
            eprintln!("bench: machine quiet ({busy:.2} cores busy)");
            return;
        }
        if Instant::now() > until {
            eprintln!("bench: the machine is still busy ({busy:.2} cores used by other work); measuring anyway, see \"other work\" in the report");
            return;
        }
        eprintln!("bench: waiting for a quieter machine ({busy:.2} cores busy) ...");
    }
}

fn plain_params(stack: &Stack) -> test_support::envoy::EnvoyParams {
    let mut p = stack.envoy.params.clone();
    p.listen_port = test_support::net::free_port();
    p.admin_port = test_support::net::free_port();
    p
}

/// docs/bench.png with bench/plot.py in the project's .venv (matplotlib), when available.
fn plot(json: &std::path::Path, png: &std::path::Path) {
    plot_script("plot.py", json, png);
}

/// `png` from `json` with bench/`script` in the project's .venv (matplotlib), when available.
fn plot_script(script: &str, json: &std::path::Path, png: &std::path::Path) {
    let root = test_support::process::workspace_root();
    let python = root.join(".venv/bin/python");
    let python = if python.is_file() {
        python
    } else {
        PathBuf::from("python3")
    };
    match std::process::Command::new(&python).arg(root.join("bench").join(script)).arg(json).arg(png).status() {
        Ok(s) if s.success() => eprintln!("bench: wrote {}", png.display()),
        Ok(s) => eprintln!("bench: {script} failed ({s}); is matplotlib installed? `.venv/bin/pip install matplotlib`"),
        Err(e) => eprintln!("bench: cannot run {}: {e}", python.display()),
    }
}
