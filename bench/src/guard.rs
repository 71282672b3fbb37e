//! `make bench-guard`: a few minutes that read the figures issue 47 lost without anyone
//! noticing (new keys and replays against a plain Envoy on the same checkout, in one run) and
//! fail when one is more than [`TOLERANCE`] worse than its floor in `bench/floor.json`.
//!
//! Every figure is a ratio measured in the same window (rates, p50s and Envoy's CPU per request
//! against plain Envoy's), so it holds on a machine 2-4x faster or slower. Each round measures
//! plain Envoy before and after the filter's scenarios and uses their mean; the guard runs
//! `BENCH_GUARD_ROUNDS` rounds (5) and keeps each figure's median, so one noisy window
//! neither fails it nor hides a drift. `BENCH_GUARD_WRITE_FLOOR=1` writes the run as the new
//! floor (commit it on purpose, with the figures in the message).
//!
//! Not a test: a benchmark the developer runs before stopping whenever a change touches the
//! filter, the state API or their configuration, and whose figures go in the closing note.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use test_support::stack::{Stack, StackOptions};

use crate::cpu::CpuUse;
use crate::fleet::Fleet;
use crate::load::Conn;
use crate::measure::Bench;
use crate::ops::{checkout_req, op_created, op_replay};
use crate::{addr, env_u64, procfs, wait_for_quiet};

/// How much worse than its floor a figure may be before the guard fails (10 %; the floor file's
/// `tolerance` when it says one).
pub(crate) const TOLERANCE: f64 = 0.10;

/// Keys completed before the replay runs.
const REPLAY_KEYS: usize = 100;

/// Whether a larger figure is better (a rate ratio) or worse (a latency or CPU multiple).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Better {
    Higher,
    Lower,
}

/// One figure's floor, as committed in `bench/floor.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Floor {
    pub(crate) figure: String,
    pub(crate) better: Better,
    pub(crate) floor: f64,
    pub(crate) meaning: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FloorFile {
    /// How the floor was set: the commit, the date, the machine's plain Envoy rate.
    pub(crate) set_at: String,
    pub(crate) tolerance: f64,
    pub(crate) figures: Vec<Floor>,
}

/// What one round measured, per scenario and concurrency.
struct Round {
    plain: [Measured; 2],
    new: [Measured; 2],
    replay: [Measured; 2],
}

#[derive(Debug, Clone, Copy, Default)]
struct Measured {
    rate: f64,
    p50_ms: f64,
    /// µs of CPU per request of the Envoy it went through.
    envoy_us: f64,
}

const LEVELS: [usize; 2] = [1, 16];

/// The figures, their meaning and which way is better, computed from one round.
fn figures(r: &Round) -> Vec<(&'static str, Better, &'static str, f64)> {
    let (p1, p16) = (r.plain[0], r.plain[1]);
    let (n1, n16) = (r.new[0], r.new[1]);
    let (r1, r16) = (r.replay[0], r.replay[1]);
    vec![
        (
            "new_rate_c16",
            Better::Higher,
            "new keys per second at 16 connections / plain Envoy's",
            n16.rate / p16.rate,
        ),
        (
            "new_rate_c1",
            Better::Higher,
            "new keys per second at 1 connection / plain Envoy's",
            n1.rate / p1.rate,
        ),
        (
            "new_p50_c1",
            Better::Lower,
            "a new key's p50 at 1 connection / plain Envoy's p50",
            n1.p50_ms / p1.p50_ms,
        ),
        (
            "replay_rate_c16",
            Better::Higher,
            "replays per second at 16 connections / plain Envoy's",
            r16.rate / p16.rate,
        ),
        (
            "replay_rate_c1",
            Better::Higher,
            "replays per second at 1 connection / plain Envoy's",
            r1.rate / p1.rate,
        ),
        (
            "new_envoy_cpu_c16",
            Better::Lower,
            "Envoy's CPU per new key at 16 connections / plain Envoy's per request",
            n16.envoy_us / p16.envoy_us,
        ),
        (
            "replay_envoy_cpu_c16",
            Better::Lower,
            "Envoy's CPU per replay at 16 connections / plain Envoy's per request",
            r16.envoy_us / p16.envoy_us,
        ),
    ]
}

fn floor_path() -> PathBuf {
    test_support::process::workspace_root().join("bench/floor.json")
}

pub(crate) fn run() -> Result<(), String> {
    if std::env::var_os("STACK_PROFILE").is_none() {
        std::env::set_var("STACK_PROFILE", "release");
    }
    let rounds = env_u64("BENCH_GUARD_ROUNDS", 5).max(1) as usize;
    let write_floor = std::env::var("BENCH_GUARD_WRITE_FLOOR").is_ok_and(|v| v == "1");
    let floor: Option<FloorFile> = if write_floor {
        None
    } else {
        let path = floor_path();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Some(serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?)
    };
    wait_for_quiet(Duration::from_secs(env_u64("BENCH_QUIET_WAIT_SECONDS", 90)));
    let started = Instant::now();
    let stack = Stack::start(StackOptions::default())?;
    let fleet = Fleet::start(&stack, |_| false)?;
    let procs = fleet.procs(&stack)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let bench = Bench {
        rt,
        postgres: &stack.postgres,
        database: stack.database_name().to_owned(),
        procs,
        state_api_port: stack.state_api.port,
        tck: procfs::clk_tck(),
        warmup: Duration::from_secs(env_u64("BENCH_WARMUP_SECONDS", 1)),
        measure: Duration::from_secs(env_u64("BENCH_SECONDS", 5)),
        started,
        retry_budget_until: started + Duration::from_secs(600),
        window_counters: None,
    };
    let filter_addr = addr(fleet.filter_envoy(&stack).params.listen_port);
    let plain_addr = addr(fleet.plain.params.listen_port);
    let run_id = format!("g{}", std::process::id());
    let replay_keys: Arc<Vec<String>> = Arc::new(
        (0..REPLAY_KEYS)
            .map(|i| format!("{run_id}-replay-{i}"))
            .collect(),
    );
    bench.rt.block_on(async {
        let mut conn = Conn::open(filter_addr).await?;
        for k in replay_keys.iter() {
            let a = conn.send(&checkout_req(k)).await?;
            if a.status != 201 {
                return Err(format!("setting up replay key {k}: status {}", a.status));
            }
        }
        Ok::<(), String>(())
    })?;

    let envoy_us = |cpu: &CpuUse, process: &str, rate: f64| {
        cpu.processes
            .get(process)
            .map_or(0.0, |cores| cores / rate.max(1e-9) * 1e6)
    };
    let mut measured: Vec<Round> = Vec::new();
    let mut errors = 0u64;
    for round in 0..rounds {
        let mut r = Round {
            plain: [Measured::default(); 2],
            new: [Measured::default(); 2],
            replay: [Measured::default(); 2],
        };
        for (i, &c) in LEVELS.iter().enumerate() {
            let mut one = |target, op, process: &str| {
                let (res, cpu, _) = bench.measure(target, c, &op);
                errors += res.error_count();
                let rate = res.rate();
                Measured {
                    rate,
                    p50_ms: res.pct_ms(50.0),
                    envoy_us: envoy_us(&cpu, process, rate),
                }
            };
            let prefix = |what: &str| format!("{run_id}-{what}-{round}-{c}");
            let before = one(plain_addr, op_created(prefix("plain-a")), "envoy-plain");
            r.new[i] = one(filter_addr, op_created(prefix("new")), "envoy");
            r.replay[i] = one(filter_addr, op_replay(replay_keys.clone()), "envoy");
            let after = one(plain_addr, op_created(prefix("plain-b")), "envoy-plain");
            r.plain[i] = Measured {
                rate: (before.rate + after.rate) / 2.0,
                p50_ms: (before.p50_ms + after.p50_ms) / 2.0,
                envoy_us: (before.envoy_us + after.envoy_us) / 2.0,
            };
            eprintln!(
                "bench-guard: round {} c={c:<2} plain {:>6.0}/s p50 {:.3} ms | new {:>6.0}/s p50 {:.3} ms | replay {:>6.0}/s p50 {:.3} ms",
                round + 1,
                r.plain[i].rate,
                r.plain[i].p50_ms,
                r.new[i].rate,
                r.new[i].p50_ms,
                r.replay[i].rate,
                r.replay[i].p50_ms
            );
        }
        measured.push(r);
    }
    let per_round: Vec<_> = measured.iter().map(figures).collect();
    let mut out = Vec::new();
    let mut failed = Vec::new();
    if errors > 0 {
        failed.push(format!("{errors} wrong or failed answers during the runs"));
    }
    let mut new_floor = Vec::new();
    println!(
        "| figure | median of {rounds} | each round | floor | verdict |\n|---|---:|---|---:|---|"
    );
    for (k, (name, better, meaning, _)) in per_round[0].iter().enumerate() {
        let mut values: Vec<f64> = per_round.iter().map(|f| f[k].3).collect();
        values.sort_by(|a, b| a.total_cmp(b));
        let median = values[values.len() / 2];
        let each = values
            .iter()
            .map(|v| format!("{v:.3}"))
            .collect::<Vec<_>>()
            .join(", ");
        let (floor_v, verdict) = match floor
            .as_ref()
            .and_then(|f| f.figures.iter().find(|x| x.figure == *name))
        {
            Some(fl) => {
                let tolerance = floor.as_ref().map_or(TOLERANCE, |f| f.tolerance);
                let ok = match fl.better {
                    Better::Higher => median >= fl.floor * (1.0 - tolerance),
                    Better::Lower => median <= fl.floor * (1.0 + tolerance),
                };
                if !ok {
                    failed.push(format!(
                        "{name} ({meaning}) is {median:.3}, more than {:.0} % worse than its floor {:.3}",
                        tolerance * 100.0,
                        fl.floor
                    ));
                }
                (format!("{:.3}", fl.floor), if ok { "ok" } else { "WORSE" })
            }
            None if write_floor => ("(set now)".to_owned(), "floor"),
            None => ("none".to_owned(), "no floor"),
        };
        println!("| {name} ({meaning}) | {median:.3} | {each} | {floor_v} | {verdict} |");
        out.push(serde_json::json!({
            "figure": name, "median": median, "rounds": values, "floor": floor_v,
            "better": better, "verdict": verdict,
        }));
        new_floor.push(Floor {
            figure: (*name).to_owned(),
            better: *better,
            floor: median,
            meaning: (*meaning).to_owned(),
        });
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(test_support::process::workspace_root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let report = serde_json::json!({
        "commit": commit,
        "generated_unix_s": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        "figures": out,
        "plain_rate_c16": measured.iter().map(|r| r.plain[1].rate).collect::<Vec<_>>(),
        "failed": failed,
        "seconds": started.elapsed().as_secs(),
    });
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| test_support::process::workspace_root().join("target"));
    let last = target.join("bench-guard.json");
    std::fs::write(
        &last,
        serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("cannot write {}: {e}", last.display()))?;
    eprintln!(
        "bench-guard: {:.0} s; this run in {}",
        started.elapsed().as_secs_f64(),
        last.display()
    );
    if write_floor {
        let plain16: Vec<f64> = measured.iter().map(|r| r.plain[1].rate).collect();
        let file = FloorFile {
            set_at: format!(
                "commit {commit}, plain Envoy {:.0}/s at 16 connections on this machine",
                plain16.iter().sum::<f64>() / plain16.len() as f64
            ),
            tolerance: TOLERANCE,
            figures: new_floor,
        };
        let path = floor_path();
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&file).map_err(|e| e.to_string())? + "\n",
        )
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        eprintln!("bench-guard: wrote {} (commit it)", path.display());
    }
    drop(fleet);
    drop(stack);
    if failed.is_empty() {
        eprintln!(
            "bench-guard: every figure within {:.0} % of its floor",
            TOLERANCE * 100.0
        );
        Ok(())
    } else {
        Err(format!("\n  {}", failed.join("\n  ")))
    }
}
