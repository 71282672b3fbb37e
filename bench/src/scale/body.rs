//! Curve 3, body size. (a) The fingerprint's cost per MiB, JSON (canonicalized, `sha256-jcs-v2`)
//! and opaque (`sha256-raw-v2`), from 100 bytes to the 1 MiB limit, against the physical floor
//! measured in the same run: SHA-256 of the same bytes. The filter's own code
//! (`contract::fingerprint`, the function the filter calls) in the `fingerprint-probe` crate,
//! measured twice by the same loop: in V8, where the filter runs it (the crate's wasm32-wasip1
//! release build, as the filter's module is built, run by Node.js: `node` must be on PATH), and
//! natively in this process. The two ratios differ: natively `sha2` uses the CPU's SHA
//! instructions (SHA-NI) when it has them, which wasm has not (on this machine native SHA-256
//! is four times V8's, and the native JSON ratio twice the V8 one); and natively, from 512 KiB
//! on, each call also faults its working memory in again, as glibc gives the freed top of its
//! heap back to the system after each fingerprint, while the module's memory only grows. Goals
//! at 1 MiB, on the V8 figures (what the filter pays): JSON within 4x of SHA-256, opaque within
//! 1.2x; the native ratios are printed for information.
//!
//! (b) Envoy's memory with many large bodies in flight: 500 concurrent 1 MiB requests with
//! distinct keys (quick: 100), through the filter with its default `max_buffered_bytes`
//! (`edge render`: half of `[limits] memory_budget_mib` a worker, 40 MiB) and through a second
//! filter Envoy with it at 1 GiB (where only Envoy's memory bounded the buffering before). Each request holds all of its body but the last byte in
//! flight until every one has come that far (`held_body`), so the bodies are held at once, and
//! Envoy is measured then. Every answer must be 201 or 503 + Retry-After (the
//! bound), no 503's request may reach the checkout, and each refused key, sent again
//! afterwards (as a client would, again while refused with 503 + Retry-After), must run once
//! (201, not a replay): nothing lost. Goal: Envoy's resident memory grows by at most the bound
//! and, for each connection, what Envoy reads from it before it stops reading (the listener's
//! `per_connection_buffer_limit_bytes`, `edge::render::CONNECTION_READ_BYTES`), and a quarter:
//! a request refused at its headers keeps its connection, and what its client sends is read
//! and dropped that much at a time.
//!
//! Settings: SCALE_BODY_PARTS, the parts to run, `cost` (a), `burst` (b) or both (the default,
//! `cost,burst`): `SCALE_CURVES=body SCALE_BODY_PARTS=cost` measures the fingerprint alone, in
//! seconds and without a stack; SCALE_BODY_REQUESTS, the burst's requests.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use fingerprint_probe::{Cost, MIB, SIZES};
use serde::Serialize;

use super::burst::{self, Burst};
use super::{at_most, fig, ratio, table, CurveOutput, Goal, Quiet, Settings};
use crate::procfs;

/// The parts of the curve SCALE_BODY_PARTS may name.
const PARTS: [&str; 2] = ["cost", "burst"];

#[derive(Debug, Clone, Serialize)]
struct CostAt {
    bytes: usize,
    /// µs per call.
    json_us: f64,
    opaque_us: f64,
    sha256_us: f64,
    json_mib_per_s: f64,
    opaque_mib_per_s: f64,
    sha256_mib_per_s: f64,
    json_x: f64,
    opaque_x: f64,
}

impl From<&Cost> for CostAt {
    fn from(c: &Cost) -> Self {
        let mib_s = |us: f64| c.bytes as f64 / MIB as f64 / (us / 1e6);
        Self {
            bytes: c.bytes,
            json_us: c.json_us,
            opaque_us: c.opaque_us,
            sha256_us: c.sha256_us,
            json_mib_per_s: mib_s(c.json_us),
            opaque_mib_per_s: mib_s(c.opaque_us),
            sha256_mib_per_s: mib_s(c.sha256_us),
            json_x: ratio(c.json_us, c.sha256_us),
            opaque_x: ratio(c.opaque_us, c.sha256_us),
        }
    }
}

/// Part (a): the same loop in V8 and natively.
#[derive(Debug, Clone, Serialize)]
struct Costs {
    /// What ran the module: `node --version`.
    v8_engine: String,
    /// In V8, where the filter runs the fingerprint: the goals are judged on these.
    v8: Vec<CostAt>,
    /// Whether the native SHA-256 used the CPU's SHA instructions (SHA-NI on x86_64).
    native_sha_instructions: bool,
    /// Natively, in this process: for information.
    native: Vec<CostAt>,
}

#[derive(Debug, Clone, Serialize)]
struct BodyCurve {
    /// The parts that ran (SCALE_BODY_PARTS).
    parts: Vec<String>,
    costs: Option<Costs>,
    bursts: Vec<Burst>,
}

/// SCALE_BODY_PARTS: the parts to run, all by default.
fn parts_from_env() -> Result<Vec<String>, String> {
    parse_parts(std::env::var("SCALE_BODY_PARTS").ok().as_deref())
}

fn parse_parts(setting: Option<&str>) -> Result<Vec<String>, String> {
    let parts: Vec<String> = match setting {
        Some(v) if !v.trim().is_empty() => v.split(',').map(|s| s.trim().to_owned()).collect(),
        _ => PARTS.iter().map(|s| (*s).to_owned()).collect(),
    };
    match parts.iter().find(|p| !PARTS.contains(&p.as_str())) {
        Some(unknown) => Err(format!(
            "SCALE_BODY_PARTS: no part {unknown:?} of the body curve (its parts: {})",
            PARTS.join(", ")
        )),
        None => Ok(parts),
    }
}

/// Whether this process's SHA-256 (`sha2`) runs on the CPU's SHA instructions: the features
/// `sha2` itself asks the CPU for before it takes that path.
fn native_sha_instructions() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("sha")
            && std::arch::is_x86_feature_detected!("sse2")
            && std::arch::is_x86_feature_detected!("ssse3")
            && std::arch::is_x86_feature_detected!("sse4.1")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("sha2")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// `node` on PATH, or why not and how to get it.
fn node() -> Result<PathBuf, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("node"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "the body curve measures the fingerprint in V8 (the engine Envoy runs the filter in) \
             with Node.js, and `node` is not on PATH: install Node.js 20 (`make test`'s wasm \
             tests need it too; Debian: apt-get install nodejs from NodeSource or nodejs.org), \
             or leave the cost part out: SCALE_BODY_PARTS=burst"
                .to_owned()
        })
}

/// The probe module `make bench-scale` builds.
fn probe_module() -> Result<PathBuf, String> {
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| test_support::process::workspace_root().join("target"));
    let module = target.join("wasm32-wasip1/release/fingerprint-probe.wasm");
    if module.is_file() {
        Ok(module)
    } else {
        Err(format!(
            "the fingerprint probe {} is not built: `make bench-scale` builds it (cargo build \
             --locked --release -p fingerprint-probe --target wasm32-wasip1)",
            module.display()
        ))
    }
}

/// The cost at every size in V8: the probe module under Node.js, each figure over `min`.
fn v8_costs(min: Duration) -> Result<(String, Vec<Cost>), String> {
    let node = node()?;
    let module = probe_module()?;
    let runner = test_support::process::workspace_root().join("bench/fingerprint-probe/run.mjs");
    let version = Command::new(&node)
        .arg("--version")
        .output()
        .map_err(|e| format!("{} --version: {e}", node.display()))?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_owned();
    let out = Command::new(&node)
        // Node's "WASI is an experimental feature" warning.
        .arg("--no-warnings")
        .arg(&runner)
        .arg(&module)
        .arg(min.as_millis().to_string())
        .output()
        .map_err(|e| format!("{} {}: {e}", node.display(), runner.display()))?;
    if !out.status.success() {
        return Err(format!(
            "the fingerprint probe in Node.js {version} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let costs = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            serde_json::from_str::<Cost>(line)
                .map_err(|e| format!("the fingerprint probe's line {line:?}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let sizes: Vec<usize> = costs.iter().map(|c| c.bytes).collect();
    if sizes != SIZES {
        return Err(format!(
            "the fingerprint probe measured the sizes {sizes:?}, not {SIZES:?}"
        ));
    }
    Ok((format!("node {version}"), costs))
}

fn costs(min: Duration) -> Result<Costs, String> {
    let (v8_engine, v8) = v8_costs(min)?;
    let native = fingerprint_probe::measure_all(min).map_err(|e| e.to_string())?;
    Ok(Costs {
        v8_engine,
        v8: v8.iter().map(CostAt::from).collect(),
        native_sha_instructions: native_sha_instructions(),
        native: native.iter().map(CostAt::from).collect(),
    })
}

/// Runs `f`, noting in `quiet` the other work and steal meanwhile: the machine's busy CPU that
/// was neither this process's (with the Node.js it ran and reaped) nor interrupts.
fn noting_other_work<T>(quiet: &mut Quiet, f: impl FnOnce() -> T) -> T {
    let me = std::process::id();
    let snapshot = || {
        (
            Instant::now(),
            procfs::machine_ticks(),
            procfs::irq_ticks(),
            procfs::steal_ticks(),
            procfs::cpu_ticks(me, true),
        )
    };
    let (t0, (busy0, total0), irq0, steal0, ours0) = snapshot();
    let out = f();
    let (t1, (busy1, total1), irq1, steal1, ours1) = snapshot();
    // The machine's ticks are summed over its CPUs.
    let cpus = procfs::cpu_count() as f64;
    let machine = |a: u64, b: u64| {
        b.saturating_sub(a) as f64 / total1.saturating_sub(total0).max(1) as f64 * cpus
    };
    let ours = ours1.saturating_sub(ours0) as f64
        / procfs::clk_tck()
        / t1.duration_since(t0).as_secs_f64().max(1e-9);
    quiet.note(
        machine(steal0, steal1),
        (machine(busy0, busy1) - machine(irq0, irq1) - ours).max(0.0),
    );
    out
}

fn print_costs(engine: &str, costs: &[CostAt]) {
    eprintln!("  {engine}:");
    for c in costs {
        eprintln!(
            "  {:>8} bytes: JSON {:>9.1} µs ({:>5.2}x SHA-256), opaque {:>8.1} µs ({:.2}x), SHA-256 {:>8.1} µs",
            c.bytes, c.json_us, c.json_x, c.opaque_us, c.opaque_x, c.sha256_us
        );
    }
}

pub fn run(settings: &Settings) -> Result<CurveOutput, String> {
    let parts = parts_from_env()?;
    let mut quiet = Quiet::start();
    let costs = if parts.iter().any(|p| p == "cost") {
        let min = Duration::from_millis(if settings.quick { 100 } else { 500 });
        eprintln!("  fingerprint cost per size, in V8 (Node.js) and natively ...");
        let costs = noting_other_work(&mut quiet, || costs(min))?;
        print_costs(&format!("in V8 ({})", costs.v8_engine), &costs.v8);
        print_costs(
            &format!(
                "natively (SHA-256 {} the CPU's SHA instructions)",
                if costs.native_sha_instructions {
                    "on"
                } else {
                    "without"
                }
            ),
            &costs.native,
        );
        Some(costs)
    } else {
        None
    };
    let bursts = if parts.iter().any(|p| p == "burst") {
        burst::bursts(settings)?
    } else {
        Vec::new()
    };
    let curve = BodyCurve {
        parts,
        costs,
        bursts,
    };
    Ok(CurveOutput {
        name: "body",
        goals: goals(&curve),
        markdown: markdown(&curve),
        json: serde_json::to_value(&curve).map_err(|e| e.to_string())?,
        quiet: quiet.end(),
    })
}

/// The native SHA-256 as the goals and tables name it.
fn native_floor(costs: &Costs) -> &'static str {
    if costs.native_sha_instructions {
        "SHA-256 on the CPU's SHA instructions (SHA-NI)"
    } else {
        "SHA-256 without SHA instructions"
    }
}

fn cost_goals(costs: &Costs) -> Vec<Goal> {
    let at_mib = |list: &[CostAt]| list.iter().find(|x| x.bytes == MIB).cloned();
    let (Some(v8), native) = (at_mib(&costs.v8), at_mib(&costs.native)) else {
        return Vec::new();
    };
    // A fingerprint's goal: its time (`us`) and ratio (`x`) in V8, the native ratio beside.
    let goal = |what: &str, limit: f64, us: fn(&CostAt) -> f64, x: fn(&CostAt) -> f64| {
        let natively = native.as_ref().map_or("n/a".to_owned(), |n| {
            format!("{}x, {}", fig(x(n), 2), native_floor(costs))
        });
        Goal::new(
            "body",
            format!("{what} at 1 MiB in V8 against the module's SHA-256 of the same bytes"),
            format!("<= {limit}x"),
            format!(
                "{}x ({} against {} µs; natively {natively})",
                fig(x(&v8), 2),
                fig(us(&v8), 0),
                fig(v8.sha256_us, 0),
            ),
            Some(at_most(x(&v8), limit)),
        )
    };
    vec![
        goal(
            "JSON fingerprint (canonical form)",
            4.0,
            |c| c.json_us,
            |c| c.json_x,
        ),
        goal("opaque fingerprint", 1.2, |c| c.opaque_us, |c| c.opaque_x),
    ]
}

fn goals(c: &BodyCurve) -> Vec<Goal> {
    let mut goals = c.costs.as_ref().map(cost_goals).unwrap_or_default();
    if let Some(b) = c.bursts.iter().find(|b| b.envoy == "bounded") {
        // What Envoy may hold: the filter's bound, and for every connection what Envoy reads
        // from it before it stops reading (the listener's limit), and a quarter.
        let per_connection_mib = edge::render::CONNECTION_READ_BYTES as f64 / MIB as f64;
        let allowed = (b.max_buffered_mib + b.requests as f64 * per_connection_mib) * 1.25;
        let wide = c.bursts.iter().find(|w| w.envoy == "wide");
        goals.push(Goal::new(
            "body",
            format!("{} concurrent 1 MiB requests ({} held at once): Envoy's memory growth with max_buffered_bytes {} MiB", b.requests, b.held_at_once, fig(b.max_buffered_mib, 0)),
            format!(
                "<= {} MiB (the bound, {} KiB read a connection, and a quarter)",
                fig(allowed, 0),
                edge::render::CONNECTION_READ_BYTES / 1024
            ),
            format!(
                "+{} MiB ({} with the bound at 1 GiB)",
                fig(b.growth_mib, 0),
                wide.map_or("n/a".into(), |w| format!("+{} MiB, {} held", fig(w.growth_mib, 0), w.held_at_once)),
            ),
            Some(at_most(b.growth_mib, allowed)),
        ));
        let wrong = b.other.values().sum::<u64>() + b.refused_without_retry_after;
        goals.push(Goal::new(
            "body",
            "over the bound: 503 + Retry-After, nothing forwarded, nothing lost",
            "only 201 and 503 + Retry-After; no 503 forwarded; each refused key runs once when sent again; each 201 charged once",
            format!(
                "{} x 201, {} x 503 ({} edge-buffers-full), {} other; {} forwarded; again: {} of {} x 201; {} not charged once",
                b.created, b.refused_503, b.buffers_full_503, wrong, b.refused_but_forwarded, b.retried_created, b.refused_503, b.created_not_charged_once
            ),
            Some(
                wrong == 0
                    && b.refused_but_forwarded == 0
                    && b.retried_created == b.refused_503
                    && b.retried_other.is_empty()
                    && b.created_not_charged_once == 0,
            ),
        ));
    }
    goals
}

/// The cost table of one engine.
fn cost_table(costs: &[CostAt]) -> String {
    let rows: Vec<Vec<String>> = costs
        .iter()
        .map(|x| {
            vec![
                x.bytes.to_string(),
                fig(x.json_us, 1),
                fig(x.opaque_us, 1),
                fig(x.sha256_us, 1),
                fig(x.json_mib_per_s, 0),
                fig(x.opaque_mib_per_s, 0),
                fig(x.sha256_mib_per_s, 0),
                fig(x.json_x, 2),
                fig(x.opaque_x, 2),
            ]
        })
        .collect();
    table(
        &[
            "bytes",
            "JSON µs",
            "opaque µs",
            "SHA-256 µs",
            "JSON MiB/s",
            "opaque MiB/s",
            "SHA-256 MiB/s",
            "JSON x",
            "opaque x",
        ],
        &rows,
        true,
    )
}

fn markdown(c: &BodyCurve) -> String {
    let mut out = String::from("### 3. Body size\n\n");
    match &c.costs {
        Some(costs) => {
            out += &format!(
                "The fingerprint (the filter's `contract::fingerprint`) per request body, JSON (canonical form, `sha256-jcs-v2`) and opaque (`sha256-raw-v2`), against SHA-256 of the same bytes by the same code; µs per call and MiB/s. In V8, where the filter runs it (the `fingerprint-probe` module, wasm32-wasip1 release build, in {}): the goals are judged on these.\n\n{}\nThe same natively, for information: {}, which wasm does not have, so the native ratios are not the filter's.\n\n{}\n",
                costs.v8_engine,
                cost_table(&costs.v8),
                native_floor(costs),
                cost_table(&costs.native)
            );
        }
        None => {
            out += "The fingerprint's cost was not measured in this run (SCALE_BODY_PARTS).\n\n"
        }
    }
    if !c.parts.iter().any(|p| p == "burst") {
        out += "The bursts of 1 MiB bodies were not sent in this run (SCALE_BODY_PARTS).\n";
        return out;
    }
    let burst_rows: Vec<Vec<String>> = c
        .bursts
        .iter()
        .map(|b| {
            vec![
                b.envoy.clone(),
                fig(b.max_buffered_mib, 0),
                b.requests.to_string(),
                b.held_at_once.to_string(),
                b.created.to_string(),
                format!("{} ({} buffers full)", b.refused_503, b.buffers_full_503),
                (b.other.values().sum::<u64>() + b.refused_without_retry_after).to_string(),
                b.refused_but_forwarded.to_string(),
                format!("{} of {}", b.retried_created, b.refused_503),
                fig(b.rss_before_mib, 0),
                fig(b.rss_held_mib, 0),
                fig(b.hwm_after_mib, 0),
                fig(b.growth_mib, 0),
                fig(b.seconds, 1),
            ]
        })
        .collect();
    out += &format!(
        "Many large bodies in flight: concurrent 1 MiB JSON requests with distinct keys through the filter with its default `max_buffered_bytes` and through a second filter Envoy with it at 1 GiB. Each request sends all of its body but the last byte and holds it until every request has come that far or was answered (held at once); Envoy's resident memory before, while they are held, and its high-water mark after; the refused keys sent again afterwards (again after a second while refused with 503 + Retry-After, three times at most).\n\n{}",
        table(
            &["Envoy", "max_buffered MiB", "requests", "held at once", "201", "503 + Retry-After", "other", "503 forwarded", "refused, again: 201", "RSS before MiB", "RSS held MiB", "HWM after MiB", "growth MiB", "seconds"],
            &burst_rows,
            true
        )
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn the_parts_are_both_unless_named_and_an_unknown_one_is_refused() {
        let both = Ok(vec!["cost".to_owned(), "burst".to_owned()]);
        assert_eq!(parse_parts(None), both);
        assert_eq!(parse_parts(Some(" ")), both);
        assert_eq!(parse_parts(Some(" cost ")), Ok(vec!["cost".to_owned()]));
        let refused = parse_parts(Some("cost,costs"));
        assert!(
            refused.as_ref().is_err_and(|e| e.contains("\"costs\"")),
            "{refused:?}"
        );
    }

    #[test]
    fn a_burst_answer_is_classed_by_status_and_retry_after() {
        let mut headers = hyper::header::HeaderMap::new();
        let a = |status, headers: &hyper::header::HeaderMap| crate::load::Answer {
            status,
            headers: headers.clone(),
            body: Bytes::new(),
        };
        assert_eq!(burst::class(&a(503, &headers)), "503 without Retry-After");
        headers.insert("retry-after", hyper::header::HeaderValue::from_static("1"));
        assert_eq!(burst::class(&a(503, &headers)), "503 (no problem type)");
        let bound = crate::load::Answer {
            body: Bytes::from_static(br#"{"type":"/problems/edge-buffers-full"}"#),
            ..a(503, &headers)
        };
        assert_eq!(burst::class(&bound), "503 edge-buffers-full");
        assert_eq!(burst::class(&a(201, &headers)), "201");
        assert_eq!(burst::class(&a(504, &headers)), "status 504");
    }
}
