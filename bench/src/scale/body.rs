//! Curve 3, body size. (a) The fingerprint's cost per MiB, JSON (canonicalized, `sha256-jcs-v2`)
//! and opaque (`sha256-raw-v2`), from 100 bytes to the 1 MiB limit, against the physical floor
//! measured in the same run: SHA-256 of the same bytes. The filter's own code
//! (`contract::fingerprint`, the function the filter calls), compiled natively here: the module
//! runs it in V8 at about the same ratio (a ratio of two loops over the same bytes). Goals at
//! 1 MiB: JSON within 4x of SHA-256, opaque within 1.2x.
//!
//! (b) Envoy's memory with many large bodies in flight: 500 concurrent 1 MiB requests with
//! distinct keys (quick: 100), through the filter with its default `max_buffered_bytes`
//! (64 MiB per worker) and through a second filter Envoy with it at 1 GiB (where only Envoy's
//! memory bounded the buffering before). Every answer must be 201 or 503 + Retry-After (the
//! bound), no 503's request may reach the checkout, and each refused key, sent again
//! afterwards, must run once (201, not a replay): nothing lost. Goal: Envoy's resident memory
//! grows by at most the bound and a quarter (Envoy's own read buffers).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use contract::fingerprint::{fingerprint_with, Selection};
use serde::Serialize;
use sha2::{Digest, Sha256};
use test_support::envoy::Envoy;
use test_support::stack::{Stack, StackOptions};

use super::{at_most, fig, memory_mib, ratio, table, CurveOutput, Goal, Quiet, Settings};
use crate::load::{Conn, Req};
use crate::{addr, alice, env_u64, plain_params, procfs};

const MIB: usize = 1024 * 1024;
const SIZES: [usize; 6] = [100, 1024, 16 * 1024, 128 * 1024, 512 * 1024, MIB];

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
    rss_before_mib: f64,
    hwm_after_mib: f64,
    growth_mib: f64,
    seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
struct BodyCurve {
    native: bool,
    costs: Vec<CostAt>,
    bursts: Vec<Burst>,
}

/// A JSON order of about `size` bytes: nested objects, arrays, strings and numbers, members in
/// no sorted order (the canonical form reorders them).
pub fn json_body(size: usize) -> Vec<u8> {
    let mut out = String::from(r#"{"currency":"EUR","amount":4990,"items":["#);
    let mut i = 0u64;
    // An item is at most about 130 bytes: stop with room for one more and the tail.
    while out.len() + 200 < size {
        if i > 0 {
            out.push(',');
        }
        out += &format!(
            r#"{{"sku":"sku-{i:06}","qty":{},"price":{}.{:02},"name":"Item {i} of the order, a line of text","tags":["x","y{}"],"gift":{}}}"#,
            i % 7 + 1,
            i % 500,
            i % 100,
            i % 13,
            i.is_multiple_of(2)
        );
        i += 1;
    }
    out += r#"],"note":""#;
    while out.len() + 2 < size {
        out.push('n');
    }
    out += "\"}";
    out.into_bytes()
}

/// `size` bytes that are not JSON (a cheap generator: the content does not matter to SHA-256).
fn opaque_body(size: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// µs per call of `f`, over at least `min` (and 3 calls).
fn time_us(min: Duration, mut f: impl FnMut()) -> f64 {
    let started = Instant::now();
    let mut calls = 0u64;
    while calls < 3 || started.elapsed() < min {
        f();
        calls += 1;
    }
    started.elapsed().as_secs_f64() * 1e6 / calls as f64
}

fn costs(min: Duration) -> Vec<CostAt> {
    SIZES
        .iter()
        .map(|&bytes| {
            let json = json_body(bytes);
            let opaque = opaque_body(bytes);
            let fp = |ct: &str, body: &[u8]| {
                std::hint::black_box(fingerprint_with(
                    "POST",
                    "/checkout",
                    "",
                    Some(ct),
                    std::hint::black_box(body),
                    &Selection::Whole,
                ))
            };
            // The canonical form must exist (else the JSON figure would be the raw one).
            let alg = fingerprint_with(
                "POST",
                "/checkout",
                "",
                Some("application/json"),
                &json,
                &Selection::Whole,
            )
            .map(|f| f.alg.to_string())
            .unwrap_or_default();
            assert_eq!(
                alg,
                contract::fingerprint::ALG_JCS,
                "the JSON body of {bytes} bytes is canonicalized"
            );
            let sha256_us = time_us(min, || {
                std::hint::black_box(Sha256::digest(std::hint::black_box(&json)));
            });
            let json_us = time_us(min, || {
                let _ = fp("application/json", &json);
            });
            let opaque_us = time_us(min, || {
                let _ = fp("application/octet-stream", &opaque);
            });
            let mib_s = |us: f64| bytes as f64 / MIB as f64 / (us / 1e6);
            CostAt {
                bytes,
                json_us,
                opaque_us,
                sha256_us,
                json_mib_per_s: mib_s(json_us),
                opaque_mib_per_s: mib_s(opaque_us),
                sha256_mib_per_s: mib_s(sha256_us),
                json_x: ratio(json_us, sha256_us),
                opaque_x: ratio(opaque_us, sha256_us),
            }
        })
        .collect()
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

/// `n` concurrent requests with 1 MiB bodies and distinct keys through `envoy`.
async fn burst(
    envoy: std::net::SocketAddr,
    prefix: &str,
    n: usize,
    body: Bytes,
) -> Vec<(String, String)> {
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        let req = Req::post("/checkout", body.clone())
            .header("authorization", &format!("Bearer {}", alice()))
            .header("content-type", "application/json")
            .header("idempotency-key", &key);
        tasks.push(tokio::spawn(async move {
            let answer = async { Conn::open(envoy).await?.send(&req).await }.await;
            let kind = match answer {
                Ok(a) => class(&a),
                Err(e) => format!("transport: {}", crate::load::short(&e)),
            };
            (key, kind)
        }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(
            t.await
                .unwrap_or_else(|e| (String::new(), format!("task: {e}"))),
        );
    }
    out
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
    let answers = rt.block_on(burst(target, &prefix, n, body.clone()));
    let seconds = t0.elapsed().as_secs_f64();
    let (_, hwm_after) = memory_mib(pid);
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
    // Nothing lost: each refused key, sent again (16 at a time), runs once.
    let retried = rt.block_on(async {
        let mut out: BTreeMap<String, u64> = BTreeMap::new();
        for group in refused.chunks(16) {
            let mut tasks = Vec::new();
            for key in group {
                let req = Req::post("/checkout", body.clone())
                    .header("authorization", &format!("Bearer {}", alice()))
                    .header("content-type", "application/json")
                    .header("idempotency-key", key);
                tasks.push(tokio::spawn(async move {
                    match async { Conn::open(target).await?.send(&req).await }.await {
                        Ok(a) => class(&a),
                        Err(e) => format!("transport: {}", crate::load::short(&e)),
                    }
                }));
            }
            for t in tasks {
                *out.entry(t.await.unwrap_or_else(|e| format!("task: {e}")))
                    .or_default() += 1;
            }
        }
        out
    });
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
        rss_before_mib: rss_before,
        hwm_after_mib: hwm_after,
        growth_mib: hwm_after - rss_before,
        seconds,
    };
    eprintln!(
        "  {n} x 1 MiB through {name} (max_buffered_bytes {:.0} MiB): {} x 201, {} x 503 ({} edge-buffers-full), other {:?}; Envoy {:.0} -> {:.0} MiB (+{:.0}); refused sent again: {} x 201, other {:?}",
        b.max_buffered_mib, b.created, b.refused_503, b.buffers_full_503, b.other, b.rss_before_mib, b.hwm_after_mib, b.growth_mib, b.retried_created, b.retried_other
    );
    Ok(b)
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

pub fn run(settings: &Settings) -> Result<CurveOutput, String> {
    let quiet = Quiet::start();
    let min = Duration::from_millis(if settings.quick { 100 } else { 500 });
    eprintln!("  fingerprint cost per size (natively) ...");
    let costs = costs(min);
    for c in &costs {
        eprintln!(
            "  {:>8} bytes: JSON {:>9.1} µs ({:>5.1}x SHA-256), opaque {:>8.1} µs ({:.2}x), SHA-256 {:>8.1} µs",
            c.bytes, c.json_us, c.json_x, c.opaque_us, c.opaque_x, c.sha256_us
        );
    }
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
    let bursts = vec![
        measure_burst(&rt, &stack, &stack.envoy, "bounded", default_bound, n)?,
        measure_burst(&rt, &stack, &wide, "wide", unbounded, n)?,
    ];
    drop(wide);
    drop(stack);
    let curve = BodyCurve {
        native: true,
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

fn goals(c: &BodyCurve) -> Vec<Goal> {
    let mut goals = Vec::new();
    if let Some(top) = c.costs.iter().find(|x| x.bytes == MIB) {
        goals.push(Goal::new(
            "body",
            "JSON fingerprint (canonical form) at 1 MiB against SHA-256 of the same bytes",
            "<= 4x",
            format!(
                "{}x ({} against {} µs)",
                fig(top.json_x, 2),
                fig(top.json_us, 0),
                fig(top.sha256_us, 0)
            ),
            Some(at_most(top.json_x, 4.0)),
        ));
        goals.push(Goal::new(
            "body",
            "opaque fingerprint at 1 MiB against SHA-256 of the same bytes",
            "<= 1.2x",
            format!(
                "{}x ({} against {} µs)",
                fig(top.opaque_x, 2),
                fig(top.opaque_us, 0),
                fig(top.sha256_us, 0)
            ),
            Some(at_most(top.opaque_x, 1.2)),
        ));
    }
    if let Some(b) = c.bursts.iter().find(|b| b.envoy == "bounded") {
        let allowed = b.max_buffered_mib * 1.25;
        goals.push(Goal::new(
            "body",
            format!("{} concurrent 1 MiB requests: Envoy's memory growth with max_buffered_bytes {} MiB", b.requests, fig(b.max_buffered_mib, 0)),
            format!("<= {} MiB (the bound and a quarter)", fig(allowed, 0)),
            format!(
                "+{} MiB ({} MiB with the bound at 1 GiB)",
                fig(b.growth_mib, 0),
                c.bursts.iter().find(|w| w.envoy == "wide").map_or("n/a".into(), |w| format!("+{}", fig(w.growth_mib, 0)))
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

fn markdown(c: &BodyCurve) -> String {
    let cost_rows: Vec<Vec<String>> = c
        .costs
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
    let burst_rows: Vec<Vec<String>> = c
        .bursts
        .iter()
        .map(|b| {
            vec![
                b.envoy.clone(),
                fig(b.max_buffered_mib, 0),
                b.requests.to_string(),
                b.created.to_string(),
                format!("{} ({} buffers full)", b.refused_503, b.buffers_full_503),
                (b.other.values().sum::<u64>() + b.refused_without_retry_after).to_string(),
                b.refused_but_forwarded.to_string(),
                format!("{} of {}", b.retried_created, b.refused_503),
                fig(b.rss_before_mib, 0),
                fig(b.hwm_after_mib, 0),
                fig(b.growth_mib, 0),
                fig(b.seconds, 1),
            ]
        })
        .collect();
    format!(
        "### 3. Body size\n\nThe fingerprint (the filter's `contract::fingerprint`, compiled natively) per request body, JSON (canonical form, `sha256-jcs-v2`) and opaque (`sha256-raw-v2`), against SHA-256 of the same bytes; µs per call and MiB/s.\n\n{}\nMany large bodies in flight: concurrent 1 MiB JSON requests with distinct keys through the filter with its default `max_buffered_bytes` and through a second filter Envoy with it at 1 GiB; Envoy's resident memory before, and its high-water mark after; the refused keys sent again afterwards.\n\n{}",
        table(
            &["bytes", "JSON µs", "opaque µs", "SHA-256 µs", "JSON MiB/s", "opaque MiB/s", "SHA-256 MiB/s", "JSON x", "opaque x"],
            &cost_rows,
            true
        ),
        table(
            &["Envoy", "max_buffered MiB", "requests", "201", "503 + Retry-After", "other", "503 forwarded", "refused, again: 201", "RSS before MiB", "HWM after MiB", "growth MiB", "seconds"],
            &burst_rows,
            true
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bodies_have_the_asked_size_and_the_json_one_is_json() {
        for size in SIZES {
            let j = json_body(size);
            assert_eq!(j.len(), size);
            assert!(
                serde_json::from_slice::<serde_json::Value>(&j).is_ok(),
                "{size}"
            );
            assert_eq!(opaque_body(size).len(), size);
        }
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
