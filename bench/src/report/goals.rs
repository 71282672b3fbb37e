//! The goals a run is held to: ratios and CPU per request measured in the run itself (they
//! hold on any machine), memory and size, the purge's capacity, the seeds' design, no errors.

use super::{f, find, total_errors, Goal, Inputs, Ratio};

pub(super) fn goals(i: &Inputs, ratios: &[Ratio]) -> Vec<Goal> {
    let mut goals = cost_goals(i, ratios);
    goals.extend(purge_goal(i));
    goals.extend(seed_goals(i));
    goals.push(answers_goal(i));
    goals
}

/// Ratios and CPU per request measured in this run, memory and the module's size.
fn cost_goals(i: &Inputs, ratios: &[Ratio]) -> Vec<Goal> {
    let ratio = |s: &str, c: usize| {
        ratios
            .iter()
            .find(|r| r.scenario == s && r.connections == c)
    };
    let mut goals = Vec::new();
    let mut goal =
        |g: &str, target: &str, measured: Option<f64>, unit: &str, pass: fn(f64) -> bool| {
            goals.push(Goal {
                goal: g.into(),
                target: target.into(),
                measured: measured
                    .map(|m| format!("{}{unit}", f(m, if unit.is_empty() { 2 } else { 3 })))
                    .unwrap_or_else(|| "not measured".into()),
                pass: measured.is_some_and(pass),
            });
        };
    // Goals as ratios and CPU per request measured in this run: they hold on any machine.
    let per_request = |scenario: &str, c: usize, process: Option<&str>| {
        find(&i.results, scenario, c).and_then(|r| {
            let cores = match process {
                Some(p) => r.cpu.processes.get(p).copied()?,
                None => r.cpu.machine_cores - r.cpu.other_cores,
            };
            (r.rate > 0.0).then(|| cores / r.rate * 1e6)
        })
    };
    let over = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    let pg = |c: usize| i.pgbench.iter().find(|p| p.clients == c);
    goal(
        "CPU per new key at 16 connections, every process, vs a plain request's",
        "<= 5.0x",
        over(per_request("new", 16, None), per_request("plain", 16, None)),
        "",
        |v| v <= 5.0,
    );
    goal(
        "Envoy's CPU per new key at 16 connections vs plain Envoy's per request",
        "<= 3.0x",
        over(
            per_request("new", 16, Some("envoy")),
            per_request("plain", 16, Some("envoy-plain")),
        ),
        "",
        |v| v <= 3.0,
    );
    goal(
        "Postgres's CPU per new key at 16 connections vs one pgbench INSERT's",
        "<= 1.0x",
        over(
            per_request("new", 16, Some("postgres")),
            pg(16).and_then(|p| p.postgres_cpu_us_per_tx),
        ),
        "",
        |v| v <= 1.0,
    );
    goal(
        "added p50 of a new key at 1 connection vs pgbench's single-INSERT p50",
        "<= 3.5x",
        over(
            ratio("new", 1).map(|r| r.added_p50_ms),
            pg(1).map(|p| p.p50_ms),
        ),
        "",
        |v| v <= 3.5,
    );
    // Round one's 3 ms was 2.8x plain Envoy's p99 of that run; a 409 is answered from the
    // worker's memory, so it should cost no more than twice a proxied request's tail.
    goal(
        "in-flight duplicate 409 p99 at 16 connections vs plain Envoy's p99",
        "<= 2.0x",
        over(
            find(&i.results, "inflight", 16).map(|r| r.p99_ms),
            find(&i.results, "plain", 16).map(|r| r.p99_ms),
        ),
        "",
        |v| v <= 2.0,
    );
    goal(
        "replay throughput at 16 connections vs plain Envoy",
        ">= 1.00",
        ratio("replay", 16).map(|r| r.rate_ratio),
        "",
        |v| v >= 1.0,
    );
    goal(
        "state API claim+complete/s vs pgbench INSERT/s at 16 clients",
        ">= 0.60",
        ratio("state_api", 16).map(|r| r.rate_ratio),
        "",
        |v| v >= 0.60,
    );
    goal(
        "state API memory under load (VmHWM)",
        "<= 50 MiB",
        i.memory.get("state-api").map(|m| m.hwm_kib as f64 / 1024.0),
        " MiB",
        |v| v <= 50.0,
    );
    goal(
        // Issue 38 raised the budget from 300 KiB, for correctness rather than bytes; issue 48
        // to 360 KiB, for the answers clients act on (docs/filter.md, Module size).
        "filter .wasm size",
        "<= 360 KiB",
        Some(i.wasm_bytes as f64 / 1024.0),
        " KiB",
        |v| v <= 360.0,
    );
    goals
}

/// The purge's capacity against the highest new-key rate of the run.
fn purge_goal(i: &Inputs) -> Option<Goal> {
    i.purge.as_ref().map(|p| Goal {
        goal: "purge capacity vs the highest new-key rate of the run".into(),
        target: ">= 3.0x".into(),
        measured: format!(
            "{:.1}x ({:.0} rows/s against {:.0} new keys/s, {})",
            p.ratio, p.rows_per_s, p.highest_new_keys_per_s, p.highest_new_keys_scenario
        ),
        pass: p.ratio >= 3.0,
    })
}

/// Against the seeds' in-app design in the same run: ahead on throughput, p50 and p99.
fn seed_goals(i: &Inputs) -> Vec<Goal> {
    let mut goals = Vec::new();
    for (ours, theirs, c, what) in [
        ("new", "seed_new", 1, "new keys"),
        ("new", "seed_new", 16, "new keys"),
        ("inflight", "seed_inflight", 1, "in-flight duplicates"),
        ("inflight", "seed_inflight", 16, "in-flight duplicates"),
    ] {
        let (Some(a), Some(b)) = (find(&i.results, ours, c), find(&i.results, theirs, c)) else {
            continue;
        };
        let (rate, p50, p99) = (a.rate / b.rate, a.p50_ms / b.p50_ms, a.p99_ms / b.p99_ms);
        goals.push(Goal {
            goal: format!("{what} at {c} connection(s) vs the seeds' in-app design: req/s, p50, p99"),
            target: "req/s >= 1.0x, p50 and p99 <= 1.0x".into(),
            measured: format!(
                "{rate:.2}x req/s ({:.0} vs {:.0}), p50 {p50:.2}x ({:.3} vs {:.3} ms), p99 {p99:.2}x ({:.3} vs {:.3} ms)",
                a.rate, b.rate, a.p50_ms, b.p50_ms, a.p99_ms, b.p99_ms
            ),
            pass: rate >= 1.0 && p50 <= 1.0 && p99 <= 1.0,
        });
    }
    goals
}

/// Every answer as expected, the slow holders' included.
fn answers_goal(i: &Inputs) -> Goal {
    let total_errors = total_errors(i);
    let slow_ok = i.slow_statuses.iter().all(|s| s == "201");
    Goal {
        goal: "every answer as expected (no errors; the slow holders got 201)".into(),
        target: "0 errors".into(),
        measured: format!(
            "{total_errors} errors; slow holders: {}",
            i.slow_statuses.join(", ")
        ),
        pass: total_errors == 0 && slow_ok,
    }
}
