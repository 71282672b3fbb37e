//! Curve 3's part (b): many large bodies in flight at once through the filter with its default
//! `max_buffered_bytes` and through one bounded at 1 GiB (see `body.rs` for the goal), every
//! answer classed, what reached the checkout counted, and the refused keys sent again.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fingerprint_probe::{json_body, MIB};
use serde::Serialize;
use test_support::envoy::Envoy;
use test_support::stack::{Stack, StackOptions};

use super::held_body;
use super::{memory_mib, Settings};
use crate::load::{Conn, Req};
use crate::{addr, alice, env_u64, plain_params, procfs};

#[derive(Debug, Clone, Serialize)]
pub(super) struct Burst {
    pub(super) envoy: String,
    pub(super) max_buffered_mib: f64,
    pub(super) requests: usize,
    pub(super) body_bytes: usize,
    pub(super) created: u64,
    /// Every 503 + Retry-After, and those of them the bound gave (`edge-buffers-full`; the
    /// rest are the state API's, e.g. claims that timed out behind slow fingerprints).
    pub(super) refused_503: u64,
    pub(super) buffers_full_503: u64,
    pub(super) refused_without_retry_after: u64,
    pub(super) other: BTreeMap<String, u64>,
    /// Refused requests whose key nevertheless reached the checkout (must be 0).
    pub(super) refused_but_forwarded: u64,
    /// Refused keys sent again afterwards: 201 (ran once), and anything else.
    pub(super) retried_created: u64,
    pub(super) retried_other: BTreeMap<String, u64>,
    /// Charges per key of the created ones that were not exactly one.
    pub(super) created_not_charged_once: u64,
    /// Requests Envoy held in progress at once, their bodies but the last byte read, when it was
    /// measured.
    pub(super) held_at_once: u64,
    pub(super) rss_before_mib: f64,
    /// Envoy's resident memory while the bodies were held.
    pub(super) rss_held_mib: f64,
    pub(super) hwm_after_mib: f64,
    /// Resident: the high-water mark after, less before.
    pub(super) growth_mib: f64,
    pub(super) seconds: f64,
}

/// An answer's class: its status, and for a 503 whether it had Retry-After and its problem type.
pub(super) fn class(a: &crate::load::Answer) -> String {
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
    let held = gate.all_held(n, Duration::from_secs(60), counts).await;
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

/// Part (b): the bursts through the bounded Envoy and the one bounded at 1 GiB.
pub(super) fn bursts(settings: &Settings) -> Result<Vec<Burst>, String> {
    let n = env_u64(
        "SCALE_BODY_REQUESTS",
        if settings.quick { 100 } else { 500 },
    ) as usize;
    super::need_open_files(3 * n as u64 + 1_000, "the body curve")?;
    let unbounded: u64 = 1 << 30;
    // One caller sends the burst: its share of the bound is the whole bound here, so that the
    // figure is the bound's (`max_buffered_bytes_per_subject` is a quarter by default).
    let stack = Stack::start(StackOptions {
        tweak: Some(test_support::envoy::Tweak::new(|cfg| {
            cfg.filter.max_buffered_bytes_per_subject = Some(edge::render::max_buffered_bytes(cfg));
        })),
        ..StackOptions::default()
    })?;
    // The bound `edge render` gave the filter (`[limits] memory_budget_mib`'s share).
    let default_bound = edge::render::max_buffered_bytes(&stack.envoy.params.edge_config()?);
    let mut p = plain_params(&stack);
    p.tweak = Some(test_support::envoy::Tweak::new(move |cfg| {
        cfg.filter.max_buffered_bytes = Some(unbounded);
        cfg.filter.max_buffered_bytes_per_subject = Some(unbounded);
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
