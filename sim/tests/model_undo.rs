//! The model checker's counterexamples to the product with one fix (issues 34 and 46) undone (feature
//! `undo-fixes`), kept as regressions: each path breaks its property with the fix undone, and
//! holds every invariant with the fix in place. `make model-check UNDO=name` finds each again
//! (docs/simulation.md, "The model checker").

use sim::model::{bounds_for, Admin, Protocol, Step};
use state_rules::undo::{self, Fix};

/// Each fix, the invariant its counterexample breaks (the violation's prefix), and the path.
fn paths() -> Vec<(Fix, &'static str, Vec<Step>)> {
    use Step::*;
    vec![
        (
            Fix::Retention,
            "1:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Deliver(0),
                WaitRetention,
                Partition(0),
                Attempt { op: 1, worker: 1 },
                Purge,
                Process(0),
                Deliver(0),
            ],
        ),
        (
            Fix::Abandon,
            "8:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                WaitRetention,
                Drain,
            ],
        ),
        (
            Fix::HeartbeatRevival,
            "5:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Deliver(0),
                Tick(0),
                GiveUp(0),
                Tick(0),
                Process(0),
            ],
        ),
        (
            Fix::RotationMove,
            "1:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Deliver(0),
                Rotate,
                WaitRetention,
                DropPrevious,
                Attempt { op: 1, worker: 1 },
                Process(0),
                Deliver(0),
            ],
        ),
        // Seed 89644: a grant answered a lease late, forwarded after an operator's purge of
        // its silent record and another body's run under a new token.
        (
            Fix::LateGrant,
            "1:",
            vec![
                Attempt { op: 0, worker: 0 },
                Attempt { op: 1, worker: 1 },
                Process(1),
                WaitLease,
                Operator(Admin::Purge),
                Process(0),
                Deliver(0),
                Deliver(0),
            ],
        ),
        (
            Fix::OperatorServing,
            "1:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Deliver(0),
                Failover,
                OutageEnds,
                Operator(Admin::Release),
                Attempt { op: 1, worker: 1 },
                Process(0),
                Deliver(0),
            ],
        ),
        (
            Fix::ResolveToken,
            "2:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Deliver(0),
                Partition(0),
                Operator(Admin::Resolve),
                Answer(0),
                Process(0),
                Deliver(0),
                Attempt { op: 1, worker: 0 },
            ],
        ),
        (
            Fix::UnknownHorizon,
            "1:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Deliver(0),
                GiveUp(0),
                WaitRetention,
                Attempt { op: 1, worker: 1 },
                Process(0),
                Deliver(0),
            ],
        ),
        (
            Fix::RouterRetries,
            "1:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Deliver(0),
                RouterRetry(0),
            ],
        ),
        // Finding 6: bob's identical request executed; alice's client left while hers ran;
        // her retry's reconcile is answered with bob's execution.
        (
            Fix::ReconcileScope,
            "3:",
            vec![
                Attempt { op: 1, worker: 0 },
                Process(0),
                Deliver(0),
                Answer(0),
                Process(0),
                Deliver(0),
                Attempt { op: 0, worker: 1 },
                Process(0),
                Deliver(0),
                GiveUp(1),
                WaitLease,
                Attempt { op: 0, worker: 1 },
                Process(0),
                Deliver(0),
                Process(0),
                Deliver(0),
                Process(0),
                Deliver(0),
            ],
        ),
        (
            Fix::NonceConflict,
            "8:",
            vec![
                Attempt { op: 0, worker: 0 },
                Stall(0),
                Tick(0),
                Process(1),
                Process(0),
                Drain,
            ],
        ),
        // Finding 7: the owner's completion answers two waiters in one callback, whose bound
        // (one reply, in the model) leaves the second for a wake, which is lost; no tick sends
        // it.
        (
            Fix::TickDrain,
            "10:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Deliver(0),
                Answer(0),
                Attempt { op: 1, worker: 0 },
                Attempt { op: 2, worker: 0 },
                Process(0),
                Deliver(0),
                LoseWake(0),
                Drain,
            ],
        ),
        (
            Fix::WaitLook,
            "8:",
            vec![
                Attempt { op: 0, worker: 0 },
                Process(0),
                Attempt { op: 1, worker: 1 },
                Process(1),
                GiveUp(0),
                Deliver(0),
                Tick(0),
                Process(1),
                Stall(0),
                Drain,
            ],
        ),
    ]
}

fn main() {
    let mut failed = Vec::new();
    // One process, one fix undone at a time (the switch is global).
    let only = std::env::var("UNDO_ONLY").ok();
    for (fix, invariant, path) in paths() {
        if only.as_deref().is_some_and(|o| o != fix.name()) {
            continue;
        }
        let model = Protocol::new(bounds_for(fix));
        undo::set(Some(fix));
        let undone = model.replay(&path);
        if std::env::var("UNDO_TRACE").is_ok() {
            println!("with the fix undone:\n{}", model.render(&path));
        }
        undo::set(None);
        let fixed = model.replay(&path);
        let broke = undone.violations.iter().any(|v| v.starts_with(invariant));
        println!(
            "{fix:?} undone: {} steps, {}",
            path.len(),
            undone
                .violations
                .first()
                .map_or("no violation", String::as_str)
        );
        if std::env::var("UNDO_TRACE").is_ok() {
            println!("with the fix in place:\n{}", model.render(&path));
        }
        if !broke {
            failed.push(format!(
                "{fix:?} undone: the path no longer breaks invariant {invariant}\n{}",
                model.render(&path)
            ));
        }
        if let Some(v) = fixed.violations.first() {
            failed.push(format!(
                "{fix:?} in place: the path breaks an invariant: {v}"
            ));
        }
    }
    if !failed.is_empty() {
        eprintln!("model counterexamples FAILED:\n{}", failed.join("\n"));
        std::process::exit(1);
    }
    println!("every undone fix's counterexample breaks its property; every fix in place holds");
}
