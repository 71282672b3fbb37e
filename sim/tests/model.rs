//! The model checker in `make test`: every interleaving of the model's world (two Envoy workers,
//! one key, two clients with two retries each, and every kind of fault of `Bounds::FULL`) up to
//! `MODEL_STEPS` steps (4 by default: each step more costs about ten times the states, 5 steps
//! take 70-160 s here) on the route that reconciles unknown outcomes, the one that re-executes
//! them and the one that holds them. Every `always` property must hold, and on the first route
//! every `sometimes` property be reached. `make model-check DEPTH=n` runs deeper.

use sim::model::{Bounds, Protocol};

fn main() {
    let steps: usize = std::env::var("MODEL_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut failed = Vec::new();
    for (path, steps, must_reach) in [
        ("/checkout", steps, true),
        ("/pay/x", steps, false),
        ("/refunds", steps, false),
    ] {
        let model = Protocol::new(Bounds {
            path,
            ..Bounds::FULL
        });
        let run = model.check(steps, 2, false);
        println!("route {path}: {}", run.report(&model));
        if !run.broken().is_empty() {
            failed.push(format!(
                "{path}: a property is broken (counterexample above)"
            ));
        }
        if must_reach && !run.unreached().is_empty() {
            failed.push(format!(
                "{path}: never reached: {} (the model no longer reaches what it claims to check)",
                run.unreached().join(", ")
            ));
        }
    }
    if !failed.is_empty() {
        eprintln!("model check FAILED:\n  {}", failed.join("\n  "));
        std::process::exit(1);
    }
    println!("model check: every property held, every sometimes-property reached");
}
