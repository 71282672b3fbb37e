//! `make model-check DEPTH=n`: the model checker over every interleaving up to n steps, with
//! every fix of issue 34 (or, built with `--features undo-fixes` and given `--undo PATH`, with
//! one of them undone: then it stops at the first counterexample).

use clap::Parser;
use sim::model::{Bounds, Protocol};

#[derive(Parser)]
#[command(about = "Model-check the protocol on the real decision code (sim/src/model.rs)")]
struct Args {
    /// The most steps of a run (with --undo: the most to look for a counterexample in).
    #[arg(long, default_value_t = 6)]
    depth: usize,
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The route: /checkout (reconciles unknown outcomes), /pay/x (re-executes them) or
    /// /refunds (holds them); by default /checkout, or the route of the undone fix's bounds.
    #[arg(long)]
    path: Option<String>,
    /// Undo one fix of issue 34 (retention, abandon, heartbeat, rotation): needs the
    /// `undo-fixes` feature.
    #[arg(long)]
    undo: Option<String>,
    /// With every fix in place, the bounds under which `--undo NAME` looks (to show that they
    /// find nothing then).
    #[arg(long)]
    bounds_of: Option<String>,
}

fn main() {
    let args = Args::parse();
    let path: Option<&'static str> = match args.path.as_deref() {
        None => None,
        Some("/checkout") => Some("/checkout"),
        Some("/pay/x") => Some("/pay/x"),
        Some("/refunds") => Some("/refunds"),
        Some(other) => {
            eprintln!("model-check: unknown route {other} (/checkout, /pay/x or /refunds)");
            std::process::exit(2);
        }
    };
    let stop = match args.undo.as_deref() {
        None => false,
        Some(name) => {
            if let Err(e) = undo(name) {
                eprintln!("model-check: {e}");
                std::process::exit(2);
            }
            true
        }
    };
    let named = args.undo.as_deref().or(args.bounds_of.as_deref());
    let bounds = match named.map(sim::model::fix_named) {
        Some(Ok(fix)) => sim::model::bounds_for(fix),
        Some(Err(e)) => {
            eprintln!("model-check: {e}");
            std::process::exit(2);
        }
        None => Bounds::FULL,
    };
    let bounds = Bounds {
        path: path.unwrap_or(bounds.path),
        ..bounds
    };
    let model = Protocol::new(bounds);
    let run = if stop {
        model.shortest_counterexample(args.depth, args.threads)
    } else {
        model.check(args.depth, args.threads, false)
    };
    println!("{}", run.report(&model));
    if !stop && (!run.broken().is_empty() || !run.unreached().is_empty()) {
        std::process::exit(1);
    }
}

#[cfg(feature = "undo-fixes")]
fn undo(name: &str) -> Result<(), String> {
    let fix = sim::model::fix_named(name)?;
    state_rules::undo::set(Some(fix));
    println!("with the fix of {name} undone");
    Ok(())
}

#[cfg(not(feature = "undo-fixes"))]
fn undo(_: &str) -> Result<(), String> {
    Err("--undo needs a build with `--features undo-fixes`".into())
}
