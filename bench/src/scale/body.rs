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
//! (64 MiB per worker) and through a second filter Envoy with it at 1 GiB (where only Envoy's
//! memory bounded the buffering before). Each request holds all of its body but the last byte in
//! flight until every one has come that far (`held_body`), so the bodies are held at once, and
//! Envoy is measured then. Every answer must be 201 or 503 + Retry-After (the
//! bound), no 503's request may reach the checkout, and each refused key, sent again
//! afterwards (as a client would, again while refused with 503 + Retry-After), must run once
//! (201, not a replay): nothing lost. Goal: Envoy's resident memory grows by at most the bound
//! and a quarter (Envoy's own read buffers).
//!
//! Settings: SCALE_BODY_PARTS, the parts to run, `cost` (a), `burst` (b) or both (the default,
//! `cost,burst`): `SCALE_CURVES=body SCALE_BODY_PARTS=cost` measures the fingerprint alone, in
//! seconds and without a stack; SCALE_BODY_REQUESTS, the burst's requests.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fingerprint_probe::{json_body, Cost, MIB, SIZES};
use serde::Serialize;
use test_support::envoy::Envoy;
use test_support::stack::{Stack, StackOptions};

use super::held_body;
use super::{at_most, fig, memory_mib, ratio, table, CurveOutput, Goal, Quiet, Settings};
use crate::load::{Conn, Req};
use crate::{addr, alice, env_u64, plain_params, procfs};

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
struct Burst {
    envoy: String,
    max_buffered_mib: f64,
    requests: usize,
    body_bytes: usize,
    created: u64,
    /// Every 503 + Retry-After, and those of them the bound gave (`edge-buffers-full`; the
    /// rest are the state API's, e.g. claims that timed out behind slow fingerprints).
    refused_503: u64,
    buffers_full_503: u64,
    refused_without_retry_after: u64,
    other: BTreeMap<String, u64>,
    /// Refused requests whose key nevertheless reached the checkout (must be 0).
    refused_but_forwarded: u64,
    /// Refused keys sent again afterwards: 201 (ran once), and anything else.
    retried_created: u64,
    retried_other: BTreeMap<String, u64>,
    /// Charges per key of the created ones that were not exactly one.
    created_not_charged_once: u64,
    /// Requests Envoy held in progress at once, their bodies but the last byte read, when it was
    /// measured.
    held_at_once: u64,
    rss_before_mib: f64,
    /// Envoy's resident memory while the bodies were held.
    rss_held_mib: f64,
    hwm_after_mib: f64,
    /// Resident: the high-water mark after, less before.
    growth_mib: f64,
    seconds: f64,
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

fn class(a: &crate::load::Answer) -> String {
    let retry_after = a.headers.contains_key("retry-after");
    match (a.status, retry_after) {
        (201, _) if a.headers.contains_key("idempotent-replayed") => "201 replayed".into(),
        (201, _) => "201".into(),
        // Which refusal: the bound (`edge-buffers-full`) or another (the state API's).
        (503, true) => {
            let problem = serde_json::from_slice::<serde_json::Value>(&a.body)
                .ok()
                .and_then(|v| v.get("type")?.as_str().map(str::to_owned))
                .unwrap_or_else(|| "(no problem type)".to_owned());
            format!("503 {}", problem.trim_start_matches("/problems/"))
        }
        (503, false) => "503 without Retry-After".into(),
        (s, _) => format!("status {s}"),
    }
}

/// What a burst's requests got, and Envoy's resident memory while their bodies were held.
struct BurstAnswers {
    /// (key, class of its answer), in the order sent.
    answers: Vec<(String, String)>,
    /// Requests Envoy held in progress at once, their bodies but the last byte read, before the
    /// last bytes went.
    held: u64,
    rss_held_mib: f64,
}

/// `n` concurrent requests with 1 MiB bodies and distinct keys through `envoy`, each body held
/// but for its last byte until all of them are in flight (`held_body`); Envoy (`pid`) is
/// measured then.
async fn burst(envoy: &Envoy, pid: u32, prefix: &str, n: usize, body: Bytes) -> BurstAnswers {
    let gate = held_body::Gate::new();
    let target = addr(envoy.params.listen_port);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        let req = Req::post("/checkout", body.clone())
            .header("authorization", &format!("Bearer {}", alice()))
            .header("content-type", "application/json")
            .header("idempotency-key", &key);
        let gate = gate.clone();
        tasks.push(tokio::spawn(async move {
            let kind = match held_body::send(target, &req, &gate).await {
                Ok(a) => class(&a),
                Err(e) => format!("transport: {}", crate::load::short(&e)),
            };
            (key, kind)
        }));
    }
    let counts = || envoy_in_progress_and_read(envoy);
    let (held, _) = gate.all_held(n, Duration::from_secs(60), counts).await;
    let (rss_held_mib, _) = memory_mib(pid);
    gate.open();
    let mut answers = Vec::with_capacity(n);
    for t in tasks {
        answers.push(
            t.await
                .unwrap_or_else(|e| (String::new(), format!("task: {e}"))),
        );
    }
    BurstAnswers {
        answers,
        held,
        rss_held_mib,
    }
}

/// Envoy's requests in progress on its listener and the bytes it has read from its clients
/// (its admin stats, the admin listener's own left out).
fn envoy_in_progress_and_read(envoy: &Envoy) -> Option<(u64, u64)> {
    let stats = envoy
        .admin_get("/stats?filter=(downstream_rq_active|downstream_cx_rx_bytes_total)$")
        .ok()?;
    let (mut active, mut read) = (0, 0);
    for line in stats.lines().filter(|l| !l.starts_with("http.admin.")) {
        let (name, value) = line.split_once(": ")?;
        let value: u64 = value.trim().parse().ok()?;
        if name.ends_with(".downstream_rq_active") {
            active += value;
        } else if name.ends_with(".downstream_cx_rx_bytes_total") {
            read += value;
        }
    }
    Some((active, read))
}

fn measure_burst(
    rt: &tokio::runtime::Runtime,
    stack: &Stack,
    envoy: &Envoy,
    name: &str,
    max_buffered: u64,
    n: usize,
) -> Result<Burst, String> {
    let pid = procfs::pid_listening_on(envoy.params.listen_port).ok_or("no Envoy")?;
    let (rss_before, _) = memory_mib(pid);
    let target = addr(envoy.params.listen_port);
    let body = Bytes::from(json_body(MIB));
    let prefix = format!("scale-body-{name}-{}", std::process::id());
    let t0 = Instant::now();
    let BurstAnswers {
        answers,
        held,
        rss_held_mib,
    } = rt.block_on(burst(envoy, pid, &prefix, n, body.clone()));
    let seconds = t0.elapsed().as_secs_f64();
    let (_, hwm_after) = memory_mib(pid);
    super::print_refusal_sources(envoy, stack.state_api.port);
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for (_, k) in &answers {
        *by_kind.entry(k.clone()).or_default() += 1;
    }
    // What reached the checkout: its ledger, by key.
    let charges = charges_by_key(stack, &prefix)?;
    let is_refusal = |k: &str| k.starts_with("503 ") && k != "503 without Retry-After";
    let refused: Vec<&String> = answers
        .iter()
        .filter(|(_, k)| is_refusal(k))
        .map(|(key, _)| key)
        .collect();
    let refused_but_forwarded = refused.iter().filter(|k| charges.contains_key(**k)).count() as u64;
    let created_not_charged_once = answers
        .iter()
        .filter(|(_, k)| k == "201")
        .filter(|(key, _)| charges.get(key).copied().unwrap_or(0) != 1)
        .count() as u64;
    // Nothing lost: each refused key, sent again, runs once.
    let retried = rt.block_on(send_again(target, &refused, &body));
    let retried_created = retried.get("201").copied().unwrap_or(0);
    let mut other = by_kind.clone();
    let created = other.remove("201").unwrap_or(0);
    let refusals: Vec<String> = other.keys().filter(|k| is_refusal(k)).cloned().collect();
    let mut refused_503 = 0;
    let mut buffers_full_503 = 0;
    for k in refusals {
        let n = other.remove(&k).unwrap_or(0);
        refused_503 += n;
        if k == "503 edge-buffers-full" {
            buffers_full_503 += n;
        }
    }
    let refused_without_retry_after = other.remove("503 without Retry-After").unwrap_or(0);
    let mut retried_other = retried;
    retried_other.remove("201");
    let b = Burst {
        envoy: name.to_owned(),
        max_buffered_mib: max_buffered as f64 / MIB as f64,
        requests: n,
        body_bytes: MIB,
        created,
        refused_503,
        buffers_full_503,
        refused_without_retry_after,
        other,
        refused_but_forwarded,
        retried_created,
        retried_other,
        created_not_charged_once,
        held_at_once: held,
        rss_before_mib: rss_before,
        rss_held_mib,
        hwm_after_mib: hwm_after,
        growth_mib: hwm_after - rss_before,
        seconds,
    };
    eprintln!(
        "  {n} x 1 MiB through {name} (max_buffered_bytes {:.0} MiB; {} held at once, Envoy {:.0} MiB then): {} x 201, {} x 503 ({} edge-buffers-full), other {:?}; Envoy {:.0} -> {:.0} MiB (+{:.0}); refused sent again: {} x 201, other {:?}",
        b.max_buffered_mib, b.held_at_once, b.rss_held_mib, b.created, b.refused_503, b.buffers_full_503, b.other, b.rss_before_mib, b.hwm_after_mib, b.growth_mib, b.retried_created, b.retried_other
    );
    Ok(b)
}

/// Each of `keys` sent again (16 at a time) as a client would: again after a second while the
/// answer is a 503 + Retry-After, three times at most. The last answer of each, by class.
async fn send_again(
    target: std::net::SocketAddr,
    keys: &[&String],
    body: &Bytes,
) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    for group in keys.chunks(16) {
        let mut tasks = Vec::new();
        for key in group {
            let req = Req::post("/checkout", body.clone())
                .header("authorization", &format!("Bearer {}", alice()))
                .header("content-type", "application/json")
                .header("idempotency-key", key);
            tasks.push(tokio::spawn(async move {
                let mut class_of_last = String::new();
                for attempt in 0..3 {
                    if attempt > 0 {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    class_of_last = match async { Conn::open(target).await?.send(&req).await }.await
                    {
                        Ok(a) => class(&a),
                        Err(e) => format!("transport: {}", crate::load::short(&e)),
                    };
                    let try_again = class_of_last.starts_with("503 ")
                        && class_of_last != "503 without Retry-After";
                    if !try_again {
                        break;
                    }
                }
                class_of_last
            }));
        }
        for t in tasks {
            *out.entry(t.await.unwrap_or_else(|e| format!("task: {e}")))
                .or_default() += 1;
        }
    }
    out
}

/// Charges in the checkout's ledger per idempotency key starting with `prefix`.
fn charges_by_key(stack: &Stack, prefix: &str) -> Result<BTreeMap<String, u64>, String> {
    let text = test_support::envoy::http_get_blocking(stack.checkout.port, "/charges")?;
    let entries: Vec<serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| format!("/charges: {e}"))?;
    let mut out = BTreeMap::new();
    for e in entries {
        if let Some(k) = e.get("idempotency_key").and_then(|k| k.as_str()) {
            if k.starts_with(prefix) {
                *out.entry(k.to_owned()).or_default() += 1;
            }
        }
    }
    Ok(out)
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

/// Part (b): the bursts through the bounded Envoy and the one bounded at 1 GiB.
fn bursts(settings: &Settings) -> Result<Vec<Burst>, String> {
    let n = env_u64(
        "SCALE_BODY_REQUESTS",
        if settings.quick { 100 } else { 500 },
    ) as usize;
    super::need_open_files(3 * n as u64 + 1_000, "the body curve")?;
    let default_bound = filter_core::config::DEFAULT_MAX_BUFFERED_BYTES;
    let unbounded: u64 = 1 << 30;
    let stack = Stack::start(StackOptions::default())?;
    let mut p = plain_params(&stack);
    p.tweak = Some(test_support::envoy::Tweak::new(move |cfg| {
        cfg.filter.max_buffered_bytes = Some(unbounded)
    }));
    let wide = Envoy::start(p, &stack.dir, "envoy-wide")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    Ok(vec![
        measure_burst(&rt, &stack, &stack.envoy, "bounded", default_bound, n)?,
        measure_burst(&rt, &stack, &wide, "wide", unbounded, n)?,
    ])
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
        bursts(settings)?
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
        let allowed = b.max_buffered_mib * 1.25;
        let wide = c.bursts.iter().find(|w| w.envoy == "wide");
        goals.push(Goal::new(
            "body",
            format!("{} concurrent 1 MiB requests ({} held at once): Envoy's memory growth with max_buffered_bytes {} MiB", b.requests, b.held_at_once, fig(b.max_buffered_mib, 0)),
            format!("<= {} MiB (the bound and a quarter)", fig(allowed, 0)),
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
        assert_eq!(class(&a(503, &headers)), "503 without Retry-After");
        headers.insert("retry-after", hyper::header::HeaderValue::from_static("1"));
        assert_eq!(class(&a(503, &headers)), "503 (no problem type)");
        let bound = crate::load::Answer {
            body: Bytes::from_static(br#"{"type":"/problems/edge-buffers-full"}"#),
            ..a(503, &headers)
        };
        assert_eq!(class(&bound), "503 edge-buffers-full");
        assert_eq!(class(&a(201, &headers)), "201");
        assert_eq!(class(&a(504, &headers)), "status 504");
    }
}
