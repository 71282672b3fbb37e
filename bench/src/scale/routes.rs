//! Curve 4, routes: 1, 100 and 1,000 protected routes in one configuration (half exact paths,
//! half prefixes; `POST /checkout` last, so a first-match scan walks every other one), each in a
//! filter Envoy of its own on one stack (its jwt_authn then has as many rules). Per request,
//! Envoy's CPU at 16 connections for a matched request (a replay of a completed key: the
//! worker answers it from memory, so Envoy's share is the whole request) and an unmatched one
//! (`POST /echo`, passed through to the checkout). Goal: 1,000 routes within 1.1x of one, both.
//! Beside it, the filter's matcher alone (`RouteTable::find`, natively): ns per lookup. The
//! three Envoys run side by side and are measured in turn, five rounds (SCALE_ROUTES_ROUNDS;
//! quick: one); each figure is the median of its rounds, and each ratio the median of the
//! rounds' own ratios (1,000 routes against one measured a minute apart, so that the drift
//! between minutes cancels).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use edge::config::{KeyPolicy, Match, OnUnknown, Route};
use serde::Serialize;
use test_support::envoy::Envoy;
use test_support::stack::{Stack, StackOptions};

use super::{at_most, fig, ratio, table, CurveOutput, Goal, Quiet, Settings};
use crate::load::{Conn, OpFn, Outcome, Req};
use crate::{addr, alice, op_replay, plain_params, procfs};

const CONNECTIONS: usize = 16;
const COUNTS: [usize; 3] = [1, 100, 1000];
/// The A/B measured beside the counts: 1,000 routes in the filter, and jwt_authn's one RE2
/// pattern cut to the last route's, so that it and the 1,000-route Envoy differ in that
/// pattern only (bench/NOTES.md, twentieth round, named it the one part that still grows).
const ONE_ROUTE_PATTERN: &str = "jwt_authn's pattern of one route";

#[derive(Debug, Clone, Serialize)]
struct Point {
    routes: usize,
    /// What this Envoy changes beside its routes ([`ONE_ROUTE_PATTERN`]); `None`: nothing.
    variant: Option<String>,
    /// Envoy's µs of CPU per request, and the rate.
    matched_envoy_us: f64,
    matched_per_s: f64,
    unmatched_envoy_us: f64,
    unmatched_per_s: f64,
    errors: u64,
    /// The filter's matcher alone, natively: ns per lookup of the last route and of a path
    /// no route has.
    matcher_matched_ns: f64,
    matcher_unmatched_ns: f64,
    steal_cores: f64,
    /// Envoy's µs per request in each round, in order.
    matched_rounds_us: Vec<f64>,
    unmatched_rounds_us: Vec<f64>,
}

/// Rounds of every count's measurement (quick: 1); each figure is the median over them.
const ROUNDS: u64 = 5;

/// One count's measurements, a value a round.
#[derive(Default)]
struct Samples {
    matched_us: Vec<f64>,
    matched_per_s: Vec<f64>,
    unmatched_us: Vec<f64>,
    unmatched_per_s: Vec<f64>,
    errors: u64,
    steal_cores: f64,
}

/// The median (the lower middle of an even count); NaN for none.
fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(f64::NAN)
}

/// The median of `a[r] / b[r]` over the rounds both have.
fn paired_ratio(a: &[f64], b: &[f64]) -> f64 {
    let ratios: Vec<f64> = a.iter().zip(b).map(|(x, y)| ratio(*x, *y)).collect();
    median(&ratios)
}

/// Envoy's µs of CPU per request at `rate` requests a second.
fn envoy_us(cpu: &crate::CpuUse, rate: f64) -> f64 {
    ratio(
        cpu.processes.get("envoy").copied().unwrap_or(0.0) * 1e6,
        rate,
    )
}

#[derive(Debug, Clone, Serialize)]
struct RoutesCurve {
    points: Vec<Point>,
}

/// `n` routes: `n - 1` made up (even ones exact, odd ones prefixes), then `last`.
pub fn routes(n: usize, last: &Route) -> Vec<Route> {
    let mut out: Vec<Route> = (0..n.saturating_sub(1))
        .map(|j| {
            let matcher = if j % 2 == 0 {
                Match::Path(format!("/api/v1/orders-{j}/pay"))
            } else {
                Match::Prefix(format!("/api/v2/tenant-{j}/"))
            };
            let mut r = Route::new("POST", matcher, KeyPolicy::Required);
            r.on_unknown = OnUnknown::Hold;
            r
        })
        .collect();
    out.push(last.clone());
    out
}

/// `yaml` with its one jwt_authn RE2 pattern (the POST routes') matching `/checkout` alone.
fn with_one_route_pattern(yaml: &str) -> Result<String, String> {
    let mut replaced = 0;
    let lines: Vec<String> = yaml
        .lines()
        .map(|l| match l.find("regex: ") {
            Some(at) => {
                replaced += 1;
                format!("{}regex: \"(?s:/checkout)\"", &l[..at])
            }
            None => l.to_owned(),
        })
        .collect();
    if replaced != 1 {
        return Err(format!(
            "the routes A/B: {replaced} RE2 patterns in the rendered configuration, not one"
        ));
    }
    Ok(lines.join("\n"))
}

/// `POST /echo` (no route has it): the checkout echoes the headers, 200.
fn op_unmatched() -> OpFn {
    let req = Req::post("/echo", Bytes::from_static(br#"{"ping":1}"#))
        .header("authorization", &format!("Bearer {}", alice()))
        .header("content-type", "application/json");
    Arc::new(move |conn: &mut Conn, _client: usize, _seq: u64| {
        let req = req.clone();
        Box::pin(async move {
            let a = conn.send(&req).await?;
            Ok(if a.status == 200 {
                Outcome::Ok
            } else {
                Outcome::Wrong(format!("status {}", a.status))
            })
        })
    })
}

/// The filter's matcher with the same routes (its JSON, as the edge renders it): ns per lookup.
fn matcher_ns(n: usize, min: Duration) -> Result<(f64, f64), String> {
    let mut routes: Vec<serde_json::Value> = (0..n.saturating_sub(1))
        .map(|j| {
            if j % 2 == 0 {
                serde_json::json!({"method": "POST", "path": format!("/api/v1/orders-{j}/pay"), "key": "required"})
            } else {
                serde_json::json!({"method": "POST", "prefix": format!("/api/v2/tenant-{j}/"), "key": "required"})
            }
        })
        .collect();
    routes.push(serde_json::json!({"method": "POST", "path": "/checkout", "key": "required"}));
    let doc = serde_json::json!({
        "state_api": {"cluster": "c", "authority": "a", "token": "t"},
        "subject": {"header": "x-jwt-sub"},
        "routes": routes,
    });
    let cfg = filter_core::config::Config::parse(doc.to_string().as_bytes())
        .map_err(|e| e.to_string())?;
    // What the worker looks a request's route up in (the configuration's own scan is the
    // specification it answers to).
    let table = filter_core::route_table::RouteTable::of(&cfg);
    let per = |path: &str, expect: Option<usize>| -> Result<f64, String> {
        let found = table.find("POST", path);
        if found != cfg.route_index("POST", path) {
            return Err(format!("the route table and the scan disagree on {path}"));
        }
        if found != expect {
            return Err(format!(
                "the matcher found {found:?} for {path}, not {expect:?}"
            ));
        }
        let started = Instant::now();
        let mut calls = 0u64;
        while calls < 1000 || started.elapsed() < min {
            for _ in 0..100 {
                std::hint::black_box(table.find("POST", std::hint::black_box(path)));
            }
            calls += 100;
        }
        Ok(started.elapsed().as_secs_f64() * 1e9 / calls as f64)
    };
    Ok((per("/checkout", Some(n - 1))?, per("/echo", None)?))
}

pub fn run(settings: &Settings) -> Result<CurveOutput, String> {
    let mut quiet = Quiet::start();
    let stack = Stack::start(StackOptions::default())?;
    let mut bench = super::bench_on(
        &stack,
        &[],
        settings.secs(2, 1),
        settings.secs(8, 3),
        settings.secs(120, 0),
    )?;
    let run_id = format!("scale-routes-{}", std::process::id());
    // Every count's Envoy up at once, then the counts measured in turn, round after round: one
    // window a point was noisier here than the 10 % the goal looks for (bench/NOTES.md,
    // twentieth round), and interleaving keeps a slow minute from landing on one count only.
    let mut levels = Vec::new();
    let variants = COUNTS
        .iter()
        .map(|&n| (n, None))
        .chain([(1000, Some(ONE_ROUTE_PATTERN))]);
    for (n, variant) in variants {
        let mut p = plain_params(&stack);
        p.tweak = Some(test_support::envoy::Tweak::new(move |cfg| {
            let checkout = cfg
                .routes
                .iter()
                .find(|r| r.matcher == Match::Path("/checkout".into()))
                .cloned();
            if let Some(last) = checkout {
                cfg.routes = routes(n, &last);
            }
        }));
        let envoy = match variant {
            None => Envoy::start(p, &stack.dir, &format!("envoy-routes-{n}"))?,
            Some(_) => {
                let yaml = with_one_route_pattern(&p.render()?)?;
                Envoy::start_with_yaml(yaml, p, &stack.dir, &format!("envoy-routes-{n}-ab"))?
            }
        };
        let target = addr(envoy.params.listen_port);
        let tag = if variant.is_some() { "ab" } else { "" };
        let keys: Arc<Vec<String>> =
            Arc::new((0..100).map(|i| format!("{run_id}-{n}{tag}-{i}")).collect());
        super::create_keys(&bench.rt, target, &keys, &format!("routes {n}: setting up"))?;
        let pid = procfs::pid_listening_on(envoy.params.listen_port).ok_or("no Envoy")?;
        levels.push((n, variant, envoy, target, keys, pid, Samples::default()));
    }
    let rounds = if settings.quick {
        1
    } else {
        crate::env_u64("SCALE_ROUTES_ROUNDS", ROUNDS).max(1)
    };
    for round in 1..=rounds {
        for (n, variant, _, target, keys, pid, samples) in levels.iter_mut() {
            bench.procs.named = vec![("envoy", *pid)];
            let (m, mcpu, _) = bench.measure(*target, CONNECTIONS, &op_replay(keys.clone()));
            let (u, ucpu, _) = bench.measure(*target, CONNECTIONS, &op_unmatched());
            quiet.saw(&mcpu);
            quiet.saw(&ucpu);
            let (matched_us, unmatched_us) = (envoy_us(&mcpu, m.rate()), envoy_us(&ucpu, u.rate()));
            samples.matched_us.push(matched_us);
            samples.matched_per_s.push(m.rate());
            samples.unmatched_us.push(unmatched_us);
            samples.unmatched_per_s.push(u.rate());
            samples.errors += m.error_count() + u.error_count();
            samples.steal_cores = samples
                .steal_cores
                .max(mcpu.steal_cores.max(ucpu.steal_cores));
            eprintln!(
                "  round {round}: {:>5} routes{}: matched {:>6.1} µs Envoy/request ({:.0}/s), unmatched {:>6.1} µs ({:.0}/s)",
                n,
                variant.map(|v| format!(" ({v})")).unwrap_or_default(),
                matched_us,
                m.rate(),
                unmatched_us,
                u.rate(),
            );
        }
    }
    let mut points = Vec::new();
    for (n, variant, envoy, _, _, _, samples) in levels {
        drop(envoy);
        let (matcher_matched_ns, matcher_unmatched_ns) = matcher_ns(
            n,
            Duration::from_millis(if settings.quick { 50 } else { 300 }),
        )?;
        let point = Point {
            routes: n,
            variant: variant.map(str::to_owned),
            matched_envoy_us: median(&samples.matched_us),
            matched_per_s: median(&samples.matched_per_s),
            unmatched_envoy_us: median(&samples.unmatched_us),
            unmatched_per_s: median(&samples.unmatched_per_s),
            errors: samples.errors,
            matcher_matched_ns,
            matcher_unmatched_ns,
            steal_cores: samples.steal_cores,
            matched_rounds_us: samples.matched_us.clone(),
            unmatched_rounds_us: samples.unmatched_us.clone(),
        };
        eprintln!(
            "  {:>5} routes (median of {rounds}): matched {:>6.1} µs Envoy/request, unmatched {:>6.1} µs; matcher {:.0} / {:.0} ns; {} errors",
            n,
            point.matched_envoy_us,
            point.unmatched_envoy_us,
            point.matcher_matched_ns,
            point.matcher_unmatched_ns,
            point.errors
        );
        points.push(point);
    }
    drop(bench);
    drop(stack);
    let curve = RoutesCurve { points };
    Ok(CurveOutput {
        name: "routes",
        goals: goals(&curve),
        markdown: markdown(&curve),
        json: serde_json::to_value(&curve).map_err(|e| e.to_string())?,
        quiet: quiet.end(),
    })
}

fn goals(c: &RoutesCurve) -> Vec<Goal> {
    let plain = |n: usize| {
        c.points
            .iter()
            .find(|p| p.routes == n && p.variant.is_none())
    };
    let (one, most) = (plain(1), plain(1000));
    let (Some(one), Some(most)) = (one, most) else {
        return vec![Goal::new(
            "routes",
            "1,000 routes against one",
            "<= 1.1x",
            "not measured",
            None,
        )];
    };
    let matched = paired_ratio(&most.matched_rounds_us, &one.matched_rounds_us);
    let unmatched = paired_ratio(&most.unmatched_rounds_us, &one.unmatched_rounds_us);
    let errors: u64 = c.points.iter().map(|p| p.errors).sum();
    vec![
        Goal::new(
            "routes",
            "Envoy's CPU per matched request (a replay), 1,000 routes against one",
            "<= 1.1x",
            format!(
                "{}x, the median of the rounds' ratios (medians {} against {} µs)",
                fig(matched, 2),
                fig(most.matched_envoy_us, 1),
                fig(one.matched_envoy_us, 1)
            ),
            Some(at_most(matched, 1.1)),
        ),
        Goal::new(
            "routes",
            "Envoy's CPU per unmatched request, 1,000 routes against one",
            "<= 1.1x",
            format!(
                "{}x, the median of the rounds' ratios (medians {} against {} µs)",
                fig(unmatched, 2),
                fig(most.unmatched_envoy_us, 1),
                fig(one.unmatched_envoy_us, 1)
            ),
            Some(at_most(unmatched, 1.1)),
        ),
        Goal::new(
            "routes",
            "every answer as expected",
            "0 errors",
            format!("{errors} errors"),
            Some(errors == 0),
        ),
    ]
}

/// The A/B's line: each 1,000-route Envoy against one route's, both ways, by the rounds' ratios.
fn ab_line(c: &RoutesCurve) -> String {
    let find = |n: usize, v: Option<&str>| {
        c.points
            .iter()
            .find(|p| p.routes == n && p.variant.as_deref() == v)
    };
    let (Some(one), Some(whole), Some(cut)) = (
        find(1, None),
        find(1000, None),
        find(1000, Some(ONE_ROUTE_PATTERN)),
    ) else {
        return String::new();
    };
    let against_one = |p: &Point| {
        format!(
            "matched {}x, unmatched {}x",
            fig(
                paired_ratio(&p.matched_rounds_us, &one.matched_rounds_us),
                2
            ),
            fig(
                paired_ratio(&p.unmatched_rounds_us, &one.unmatched_rounds_us),
                2
            )
        )
    };
    format!(
        "\n\nThe A/B, 1,000 routes against one route, each the median of the rounds' own ratios: with jwt_authn's pattern of every route {}; with {ONE_ROUTE_PATTERN} {}.",
        against_one(whole),
        against_one(cut)
    )
}

fn markdown(c: &RoutesCurve) -> String {
    let rows: Vec<Vec<String>> = c
        .points
        .iter()
        .map(|p| {
            vec![
                match &p.variant {
                    Some(v) => format!("{} ({v})", p.routes),
                    None => p.routes.to_string(),
                },
                fig(p.matched_envoy_us, 1),
                fig(p.matched_per_s, 0),
                fig(p.unmatched_envoy_us, 1),
                fig(p.unmatched_per_s, 0),
                fig(p.matcher_matched_ns, 0),
                fig(p.matcher_unmatched_ns, 0),
                p.errors.to_string(),
                fig(p.steal_cores, 2),
            ]
        })
        .collect();
    format!(
        "### 4. Routes

Protected routes in one configuration (half exact, half prefixes, `POST /checkout` last), each count in a filter Envoy of its own (its jwt_authn with as many rules), {CONNECTIONS} connections. Envoy's µs of CPU per request: matched (a replay of a completed key, answered from the worker's memory) and unmatched (`POST /echo`, passed through). The filter's matcher alone, natively: ns per lookup. Each figure is the median of {} interleaved rounds.{}

{}",
        c.points.first().map_or(0, |p| p.matched_rounds_us.len()),
        ab_line(c),
        table(
            &["routes", "matched µs", "matched/s", "unmatched µs", "unmatched/s", "matcher ns (last route)", "matcher ns (no route)", "errors", "steal"],
            &rows,
            true
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_rounds_is_the_middle_one() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0]), 1.0);
        assert!(median(&[]).is_nan());
    }

    /// A slow minute that lands on both counts of a round cancels in its ratio (the second
    /// round here); one that lands on one count only is one round's ratio out of the median
    /// (the third), where the ratio of the medians would read 0.61x.
    #[test]
    fn the_ratio_is_the_median_of_each_rounds_own() {
        let most = [110.0, 220.0, 121.0];
        let one = [100.0, 200.0, 200.0];
        assert!((paired_ratio(&most, &one) - 1.1).abs() < 1e-9);
        assert!((paired_ratio(&[105.0, 210.0], &[100.0, 200.0]) - 1.05).abs() < 1e-9);
        assert!(paired_ratio(&[], &[]).is_nan());
    }

    #[test]
    fn the_ab_cuts_the_one_pattern_to_the_last_route() {
        let yaml = "rules:\n  - match:\n      safe_regex:\n        regex: \"(?s:/a|/b.*)\"\n      headers: []";
        let cut = with_one_route_pattern(yaml).unwrap();
        assert!(
            cut.contains("        regex: \"(?s:/checkout)\"\n      headers"),
            "{cut}"
        );
        assert!(!cut.contains("/a|"));
        assert!(with_one_route_pattern("rules: []").is_err());
    }

    #[test]
    fn the_made_up_routes_come_first_and_alternate() {
        let last = Route::new("POST", Match::Path("/checkout".into()), KeyPolicy::Required);
        let r = routes(4, &last);
        assert_eq!(r.len(), 4);
        assert_eq!(r[0].matcher, Match::Path("/api/v1/orders-0/pay".into()));
        assert_eq!(r[1].matcher, Match::Prefix("/api/v2/tenant-1/".into()));
        assert_eq!(r[3].matcher, Match::Path("/checkout".into()));
        assert_eq!(routes(1, &last).len(), 1);
    }

    #[test]
    fn the_matcher_finds_the_last_route_and_no_other() {
        let (matched, unmatched) =
            matcher_ns(100, Duration::from_millis(1)).unwrap_or((f64::NAN, f64::NAN));
        assert!(matched > 0.0 && unmatched > 0.0, "{matched} {unmatched}");
    }
}
