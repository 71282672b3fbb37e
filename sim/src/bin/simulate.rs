//! `make simulate START=… SEEDS=… SECONDS=…`: runs schedules of the deterministic simulation
//! from a given or a random first seed, goes on past failures and counts them by invariant,
//! and reports the seeds it covered, how many it ran per second, what they reached, the lowest
//! failing seeds with their replay commands and the shrunk trace of the first.

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
    /// The first seed, or `random` (printed, so that the run can be repeated).
    #[arg(long, env = "SIM_START", default_value = "random")]
    start: String,
    /// Run this one seed and print its whole trace.
    #[arg(long, env = "SEED")]
    seed: Option<u64>,
    /// The faults schedules may inject: `all`, or names (kill, give-up, api-down, callout,
    /// skew, upstream, client, database, envoy, rotate, operator, wake) joined by `,`; `-name`
    /// removes one (`all,-kill`).
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
    /// Stop at the first failing schedule instead of going on and counting them.
    #[arg(long)]
    stop_at_first: bool,
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
    let start = match args.start.as_str() {
        "random" => {
            let s = sim::driver::random_start();
            println!("start: seed {s}, drawn at random (this run again: START={s})");
            s
        }
        n => match n.parse::<u64>() {
            Ok(s) => s,
            Err(_) => {
                eprintln!("--start: a seed or `random`, not `{n}`");
                std::process::exit(2);
            }
        },
    };
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let limit = (args.seconds > 0).then(|| Duration::from_secs(args.seconds));
    let mut ignore = args.ignore.clone();
    if args.awaiting {
        ignore.extend(sim::awaiting_fix());
    }
    let report = sim::driver::search(&sim::driver::Search {
        start,
        count: args.seeds,
        limit,
        threads,
        params: p,
        ignore: &ignore,
        keep_going: !args.stop_at_first,
        shrink_time: None,
    });
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
    if report.failed > 0 {
        println!("{}", report.failures());
    }
    // The record of the run, last, so that it is at hand.
    println!(
        "covered: {} ({} schedules), faults {}, {} failed{}",
        report.seeds(),
        report.schedules,
        sim::driver::mix_name(faults),
        report.failed,
        if args.stop_at_first && report.failed > 0 {
            " (stopped at the first)"
        } else {
            ""
        }
    );
    if report.failed > 0 {
        std::process::exit(1);
    }
}
