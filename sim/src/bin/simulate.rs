//! `make simulate SEEDS=… SECONDS=…`: runs schedules of the deterministic simulation, reports
//! how many it ran per second, and prints the shrunk trace of the first failing one.

use clap::Parser;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(about = "Deterministic simulation of the idempotency filter")]
struct Args {
    /// Schedules to run (seeds from --start on); 0: until --seconds have passed.
    #[arg(long, env = "SEEDS", default_value_t = 100_000)]
    seeds: u64,
    /// Stop after this many seconds (0: no limit).
    #[arg(long, env = "SECONDS", default_value_t = 0)]
    seconds: u64,
    /// The first seed.
    #[arg(long, env = "SIM_START", default_value_t = 0)]
    start: u64,
    /// Run this one seed and print its whole trace.
    #[arg(long, env = "SEED")]
    seed: Option<u64>,
    /// The faults schedules may inject: `all`, or names (kill, give-up, api-down, callout,
    /// skew, upstream, client) joined by `,`; `-name` removes one (`all,-kill`).
    #[arg(long, env = "FAULTS", default_value = "all")]
    faults: String,
    /// Random steps per schedule before it is drained.
    #[arg(long, default_value_t = sim::STEPS)]
    steps: usize,
    /// Keep searching past runs whose violation contains this text (repeatable); `+text`:
    /// stop only at a violation that contains it.
    #[arg(long)]
    ignore: Vec<String>,
    /// Go on past runs that break an invariant the fixes of issue 34 restore
    /// (`sim::AWAITING_FIX`), counting them by path.
    #[arg(long, env = "AWAITING", value_parser = clap::builder::FalseyValueParser::new())]
    awaiting: bool,
    /// Threads (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() {
    let args = Args::parse();
    let faults = match sim::Faults::parse(&args.faults) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("--faults: {e}");
            std::process::exit(2);
        }
    };
    let p = sim::Params {
        steps: args.steps,
        faults,
    };
    if let Some(seed) = args.seed {
        let o = sim::run_seed(seed, p);
        for line in &o.trace {
            println!("{line}");
        }
        match o.violation {
            Some(v) => {
                println!("seed {seed}: VIOLATION {v}");
                std::process::exit(1);
            }
            None => println!("seed {seed}: every invariant held ({} steps)", o.steps),
        }
        return;
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let limit = (args.seconds > 0).then(|| Duration::from_secs(args.seconds));
    let mut ignore = args.ignore.clone();
    if args.awaiting {
        ignore.extend(sim::awaiting_fix());
    }
    let report = sim::driver::run_many_ignoring(args.start, args.seeds, limit, threads, p, &ignore);
    println!("{}", report.summary());
    println!(
        "reached (schedules in which each happened at least once):\n{}",
        report.coverage()
    );
    println!(
        "dangerous regions visited (schedules in which each was, at least once):\n{}",
        report.regions()
    );
    if !report.ignored_by.is_empty() {
        println!("{}", sim::awaiting_report(&report));
    }
    if let Some(f) = report.failure {
        println!("{}", f.render());
        std::process::exit(1);
    }
}
