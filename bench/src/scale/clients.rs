//! Curve 5, clients: 1, 16, 64 and 256 connections (quick: 1, 16, 64) of new keys and of
//! replays through one filter Envoy (one worker). Every answer is classed: 201 (new), 201
//! replayed, 409 + Retry-After, 503 + Retry-After (refused: a bounded queue, the state API's or
//! the filter's); anything else is an error (a timeout, a 5xx without Retry-After, a broken
//! connection). Per class: answers per second, p50 and p99. After each level of new keys, the
//! records still in progress are counted: a claim committed for a caller that was answered
//! 503 must not keep its key (nothing was forwarded). Goals at 256 connections: no answer
//! outside the four classes, p99 of the 503s under 50 ms, new keys at least 0.9x of their
//! 16-connection rate, and no key left held.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use test_support::stack::{Stack, StackOptions};

use super::{fig, ratio, table, CurveOutput, Goal, Quiet, Settings};
use crate::load::{Answer, Conn, OpFn, Outcome};
use crate::{addr, checkout_req, new_key};

/// Answers of the window: (when, class, µs).
type Seen = Arc<Mutex<Vec<(Instant, &'static str, u32)>>>;

#[derive(Debug, Clone, Serialize)]
struct ClassFigures {
    per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    count: u64,
}

#[derive(Debug, Clone, Serialize)]
struct Point {
    kind: &'static str,
    connections: usize,
    /// created, replayed, 409, 503.
    classes: BTreeMap<&'static str, ClassFigures>,
    all_p50_ms: f64,
    all_p99_ms: f64,
    errors: BTreeMap<String, u64>,
    error_count: u64,
    /// Records left in progress a few seconds after the level (new keys only).
    left_in_progress: Option<u64>,
    cpu_us_per_answer: f64,
    steal_cores: f64,
}

#[derive(Debug, Clone, Serialize)]
struct ClientsCurve {
    points: Vec<Point>,
}

/// The class of an answer, or what is wrong with it.
fn class(a: &Answer) -> Result<&'static str, String> {
    let retry_after = a.headers.contains_key("retry-after");
    let replayed = a
        .headers
        .get("idempotent-replayed")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    match (a.status, retry_after) {
        (201, _) if replayed => Ok("replayed"),
        (201, _) => Ok("created"),
        (409, true) => Ok("409"),
        (503, true) => Ok("503"),
        (s, false) if s == 409 || s == 503 => Err(format!("{s} without Retry-After")),
        (s, _) => Err(format!("status {s}")),
    }
}

/// Sends what `request` makes for the operation, and records its class and latency.
fn classified(
    seen: Seen,
    request: Arc<dyn Fn(usize, u64) -> crate::load::Req + Send + Sync>,
) -> OpFn {
    Arc::new(move |conn: &mut Conn, client: usize, seq: u64| {
        let req = request(client, seq);
        let seen = seen.clone();
        Box::pin(async move {
            let t0 = Instant::now();
            let a = conn.send(&req).await?;
            let us = u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX);
            Ok(match class(&a) {
                Ok(c) => {
                    if let Ok(mut s) = seen.lock() {
                        s.push((t0, c, us));
                    }
                    Outcome::Ok
                }
                Err(wrong) => Outcome::Wrong(wrong),
            })
        })
    })
}

fn figures(mut lat: Vec<u32>, window_s: f64) -> ClassFigures {
    lat.sort_unstable();
    ClassFigures {
        per_s: lat.len() as f64 / window_s.max(1e-9),
        p50_ms: crate::load::percentile(&lat, 50.0) / 1000.0,
        p99_ms: crate::load::percentile(&lat, 99.0) / 1000.0,
        count: lat.len() as u64,
    }
}

pub fn run(settings: &Settings) -> Result<CurveOutput, String> {
    let mut quiet = Quiet::start();
    let levels: &[usize] = if settings.quick {
        &[1, 16, 64]
    } else {
        &[1, 16, 64, 256]
    };
    super::need_open_files(4 * 256 + 1_000, "the clients curve")?;
    let stack = Stack::start(StackOptions::default())?;
    let envoy = addr(stack.envoy.params.listen_port);
    let bench = super::bench_on(
        &stack,
        &[
            ("envoy", stack.envoy.params.listen_port),
            ("state-api", stack.state_api.port),
            ("checkout", stack.checkout.port),
        ],
        settings.secs(2, 1),
        settings.secs(8, 3),
        Duration::ZERO,
    )?;
    let run_id = format!("scale-clients-{}", std::process::id());
    let replay_keys: Arc<Vec<String>> =
        Arc::new((0..100).map(|i| format!("{run_id}-replay-{i}")).collect());
    super::create_keys(&bench.rt, envoy, &replay_keys, "setting up replay keys")?;
    let mut points = Vec::new();
    for kind in ["new", "replay"] {
        for &c in levels {
            let seen: Seen = Arc::new(Mutex::new(Vec::new()));
            let prefix = format!("{run_id}-{kind}-{c}");
            let keys = replay_keys.clone();
            let request: Arc<dyn Fn(usize, u64) -> crate::load::Req + Send + Sync> =
                if kind == "new" {
                    Arc::new(move |client, seq| checkout_req(&new_key(&prefix, client, seq)))
                } else {
                    Arc::new(move |client, seq| {
                        checkout_req(&keys[(client * 7 + seq as usize) % keys.len()])
                    })
                };
            bench.settle();
            let from = Instant::now() + bench.warmup;
            let (r, cpu) = bench.measure_once(envoy, c, classified(seen.clone(), request));
            quiet.saw(&cpu);
            let window_s = r.elapsed.as_secs_f64();
            let mut by_class: BTreeMap<&'static str, Vec<u32>> = BTreeMap::new();
            let mut all = Vec::new();
            for (t, class, us) in seen.lock().map(|s| s.clone()).unwrap_or_default() {
                if t >= from {
                    by_class.entry(class).or_default().push(us);
                    all.push(us);
                }
            }
            all.sort_unstable();
            let left_in_progress = if kind == "new" {
                // A claim committed for a caller answered 503 is released (or abandoned) within
                // moments; a lease is 30 s.
                std::thread::sleep(Duration::from_secs(3));
                stack
                    .postgres
                    .psql(
                        stack.database_name(),
                        "SELECT count(*) FROM idempotency_records WHERE state = 'in_progress'",
                    )
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
            } else {
                None
            };
            let answers = all.len() as f64 / window_s.max(1e-9);
            let point = Point {
                kind: if kind == "new" { "new keys" } else { "replays" },
                connections: c,
                classes: by_class
                    .into_iter()
                    .map(|(k, v)| (k, figures(v, window_s)))
                    .collect(),
                all_p50_ms: crate::load::percentile(&all, 50.0) / 1000.0,
                all_p99_ms: crate::load::percentile(&all, 99.0) / 1000.0,
                error_count: r.error_count(),
                errors: r.errors.clone(),
                left_in_progress,
                cpu_us_per_answer: ratio(cpu.machine_cores * 1e6, answers),
                steal_cores: cpu.steal_cores,
            };
            eprintln!(
                "  {:<9} c={:<4} {} p50 {:.2} p99 {:.2} ms, errors {}{}",
                point.kind,
                c,
                point
                    .classes
                    .iter()
                    .map(|(k, f)| format!("{k} {:.0}/s (p99 {:.2} ms)", f.per_s, f.p99_ms))
                    .collect::<Vec<_>>()
                    .join(", "),
                point.all_p50_ms,
                point.all_p99_ms,
                point.error_count,
                point
                    .left_in_progress
                    .map(|n| format!(", {n} left in progress"))
                    .unwrap_or_default()
            );
            points.push(point);
        }
    }
    drop(bench);
    drop(stack);
    let curve = ClientsCurve { points };
    Ok(CurveOutput {
        name: "clients",
        goals: goals(&curve, *levels.last().unwrap_or(&256)),
        markdown: markdown(&curve),
        json: serde_json::to_value(&curve).map_err(|e| e.to_string())?,
        quiet: quiet.end(),
    })
}

fn goals(c: &ClientsCurve, most: usize) -> Vec<Goal> {
    let at = |kind: &str, n: usize| {
        c.points
            .iter()
            .find(|p| p.kind == kind && p.connections == n)
    };
    let mut goals = Vec::new();
    let top: Vec<&Point> = c.points.iter().filter(|p| p.connections == most).collect();
    let wrong: u64 = top.iter().map(|p| p.error_count).sum();
    let kinds: Vec<String> = top
        .iter()
        .flat_map(|p| p.errors.iter().map(|(k, v)| format!("{v} x {k}")))
        .collect();
    goals.push(Goal::new(
        "clients",
        format!("answers at {most} connections (new keys and replays)"),
        "only 201, replay, 409 and 503 + Retry-After",
        if kinds.is_empty() {
            "0 other".to_owned()
        } else {
            kinds.join(", ")
        },
        Some(wrong == 0),
    ));
    let refused: Vec<&ClassFigures> = top.iter().filter_map(|p| p.classes.get("503")).collect();
    let p99_503 = refused.iter().map(|f| f.p99_ms).fold(f64::NAN, f64::max);
    goals.push(Goal::new(
        "clients",
        format!("p99 of the 503s at {most} connections"),
        "< 50 ms",
        if refused.is_empty() {
            "no 503 (nothing refused)".to_owned()
        } else {
            format!(
                "{} ms ({} refused)",
                fig(p99_503, 2),
                refused.iter().map(|f| f.count).sum::<u64>()
            )
        },
        Some(refused.is_empty() || p99_503 < 50.0),
    ));
    let rate = |p: Option<&Point>| {
        p.and_then(|p| p.classes.get("created"))
            .map_or(0.0, |f| f.per_s)
    };
    let (peak, last) = (rate(at("new keys", 16)), rate(at("new keys", most)));
    let held = ratio(last, peak);
    goals.push(Goal::new(
        "clients",
        format!("new keys at {most} connections against 16"),
        ">= 0.9x",
        format!(
            "{}x ({} against {} new keys/s)",
            fig(held, 2),
            fig(last, 0),
            fig(peak, 0)
        ),
        Some(held.is_finite() && held >= 0.9),
    ));
    let left: u64 = c
        .points
        .iter()
        .filter_map(|p| p.left_in_progress)
        .max()
        .unwrap_or(0);
    goals.push(Goal::new(
        "clients",
        "keys left in progress after a level (a commit whose caller got 503 or timed out)",
        "0",
        left.to_string(),
        Some(left == 0),
    ));
    goals
}

fn markdown(c: &ClientsCurve) -> String {
    let cell = |p: &Point, k: &str| {
        p.classes.get(k).map_or("-".to_owned(), |f| {
            format!(
                "{} ({} / {})",
                fig(f.per_s, 0),
                fig(f.p50_ms, 2),
                fig(f.p99_ms, 2)
            )
        })
    };
    let rows: Vec<Vec<String>> = c
        .points
        .iter()
        .map(|p| {
            vec![
                p.kind.to_owned(),
                p.connections.to_string(),
                cell(p, "created"),
                cell(p, "replayed"),
                cell(p, "409"),
                cell(p, "503"),
                fig(p.all_p50_ms, 2),
                fig(p.all_p99_ms, 2),
                p.error_count.to_string(),
                p.left_in_progress.map_or("-".into(), |n| n.to_string()),
                fig(p.cpu_us_per_answer, 0),
                fig(p.steal_cores, 2),
            ]
        })
        .collect();
    format!(
        "### 5. Clients\n\nNew keys and replays through one filter Envoy (one worker) at each number of connections. Per class of answer: per second (p50 / p99 ms). Errors: any other answer (a timeout, a 5xx without Retry-After, a broken connection). `left`: records still in progress 3 s after a level of new keys. CPU: every process, µs per answer.\n\n{}",
        table(
            &["load", "conns", "201", "201 replayed", "409", "503 + Retry-After", "p50 ms", "p99 ms", "errors", "left", "CPU µs", "steal"],
            &rows,
            true
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use hyper::header::{HeaderMap, HeaderValue};

    fn answer(status: u16, headers: &[(&'static str, &'static str)]) -> Answer {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(*k, HeaderValue::from_static(v));
        }
        Answer {
            status,
            headers: h,
            body: Bytes::new(),
        }
    }

    #[test]
    fn only_the_four_answers_are_correct() {
        assert_eq!(class(&answer(201, &[])), Ok("created"));
        assert_eq!(
            class(&answer(201, &[("idempotent-replayed", "true")])),
            Ok("replayed")
        );
        assert_eq!(class(&answer(409, &[("retry-after", "1")])), Ok("409"));
        assert_eq!(class(&answer(503, &[("retry-after", "1")])), Ok("503"));
        assert!(class(&answer(503, &[])).is_err());
        assert!(class(&answer(504, &[("retry-after", "1")])).is_err());
        assert!(class(&answer(500, &[])).is_err());
    }
}
