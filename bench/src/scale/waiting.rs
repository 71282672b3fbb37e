//! Curve 6, waiting retries: 1,000 and 10,000 retries (quick: 100 and 1,000) wait with
//! `Prefer: wait=60` on a few running keys (4, each held by a slow request through the same
//! Envoy), each on a connection of its own, through one filter Envoy (one worker, its
//! `max_waiters` at its most, 10,000) and one state API (`STATE_API_MAX_WAITERS` 20,000). While
//! they wait: Envoy's and the state API's resident memory and CPU per waiter. When the slow
//! requests end: the time from each key's completion (its slow request's answer, which comes
//! after its outcome is stored) to its last waiter's replay. Every waiter must get the replay,
//! or be refused with 503 + Retry-After by the state API's bounded queue (the answer past
//! saturation that curve 5 asks for; how long after sending is reported: a burst of 10,000
//! queues in the load generator and Envoy's one worker before any of them is refused); up to
//! that bound (1,024 queued claims), every one the replay.
//!
//! SCALE_WAITING_LEVELS (waiters, comma-separated). A level needs its waiters and 2,000 open
//! files in one process (Envoy holds a connection a waiter; the claims are HTTP/2 streams); one
//! this process's limit cannot hold is reported not measured, with the limit, and the others
//! are measured.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use contract::state_env;
use serde::Serialize;
use test_support::stack::{Stack, StackOptions};

use super::{fig, memory_mib, table, CurveOutput, Goal, Quiet, Settings};
use crate::load::Conn;
use crate::{addr, checkout_req, procfs, Snapshot};

const KEYS: usize = 4;
const WAIT_S: u64 = 60;
/// The state API's `--batch-max-queued` in this curve's stack (its default): claims queued past
/// it are refused at once.
const STATE_API_QUEUE_BOUND: usize = 1_024;
/// The answer a refused waiter gets.
const REFUSED: &str = "503 + Retry-After";

#[derive(Debug, Clone, Serialize)]
struct Point {
    waiters: usize,
    /// Waiters whose request was in (answered or still waiting) when the window began.
    connected_s: f64,
    envoy_rss_before_mib: f64,
    envoy_rss_waiting_mib: f64,
    state_api_rss_before_mib: f64,
    state_api_rss_waiting_mib: f64,
    envoy_kib_per_waiter: f64,
    state_api_kib_per_waiter: f64,
    /// Thousandths of a core per waiter while they wait, by process.
    cpu_per_waiter: BTreeMap<String, f64>,
    /// Claim callouts the state API answered per waiter and second while they waited.
    claims_per_waiter_s: f64,
    /// From a key's completion to its last waiter's replay (the worst key), and the median
    /// over every waiter.
    last_replay_after_ms: f64,
    median_replay_after_ms: f64,
    answers: BTreeMap<String, u64>,
    /// p99 of the refused waiters' time from sending to their 503 (NaN: none refused).
    refused_p99_ms: f64,
    slow_statuses: Vec<String>,
    steal_cores: f64,
}

#[derive(Debug, Clone, Serialize)]
struct WaitingCurve {
    points: Vec<Point>,
    /// Levels not measured, with why (the open files a level needs).
    skipped: Vec<(usize, String)>,
}

/// Open files a level of `waiters` needs in one process: a waiter is a connection in the load
/// generator and one in Envoy from the client; its claim is a stream on one of Envoy's HTTP/2
/// connections to the state API (200 streams each), which the 2,000 to spare cover.
fn open_files_needed(waiters: usize) -> u64 {
    waiters as u64 + 2_000
}

/// The levels: SCALE_WAITING_LEVELS (comma-separated), or 1,000 and 10,000 (quick: 100, 1,000).
fn levels(settings: &Settings) -> Vec<usize> {
    let levels: Vec<usize> = settings.levels("SCALE_WAITING_LEVELS", "1000,10000", "100,1000");
    levels.into_iter().filter(|n| *n > 0).collect()
}

/// What one request got: its key's index, the kind of answer, when, and how long after it was
/// sent.
#[derive(Debug, Clone)]
struct Answer {
    key: usize,
    kind: String,
    at: Instant,
    took_ms: f64,
}

type Answers = Arc<Mutex<Vec<Answer>>>;

fn measure(
    rt: &tokio::runtime::Runtime,
    stack: &Stack,
    waiters: usize,
    window: Duration,
    quick: bool,
) -> Result<Point, String> {
    let envoy = addr(stack.envoy.params.listen_port);
    let find =
        |port: u16| procfs::pid_listening_on(port).ok_or(format!("nothing listens on :{port}"));
    let (envoy_pid, api_pid) = (
        find(stack.envoy.params.listen_port)?,
        find(stack.state_api.port)?,
    );
    let procs = crate::Procs {
        named: vec![("envoy", envoy_pid), ("state-api", api_pid)],
        postgres: procfs::pid_listening_on(stack.postgres.port()),
    };
    let run = format!("scale-wait-{waiters}-{}", std::process::id());
    let keys: Vec<String> = (0..KEYS).map(|k| format!("{run}-{k}")).collect();
    // Time to connect every waiter, then the window, then the slow requests end.
    let connect = Duration::from_secs(if quick { 3 } else { 2 + waiters as u64 / 1_000 });
    let hold = connect + window + Duration::from_secs(2);
    let (envoy_before, _) = memory_mib(envoy_pid);
    let (api_before, _) = memory_mib(api_pid);
    let answers: Answers = Arc::new(Mutex::new(Vec::new()));
    let slow_done: Answers = Arc::new(Mutex::new(Vec::new()));
    let tck = procfs::clk_tck();
    let port = stack.state_api.port;
    let (a, b, envoy_waiting, api_waiting, started) = rt.block_on(async {
        let slow = hold_keys(envoy, &keys, hold, &slow_done);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        let tasks = spawn_waiters(envoy, &keys, waiters, &answers).await;
        tokio::time::sleep_until((started + connect).into()).await;
        let p = procs.clone();
        let a = tokio::task::spawn_blocking(move || Snapshot::take(&p, port))
            .await
            .map_err(|e| e.to_string())?;
        tokio::time::sleep(window).await;
        let p = procs.clone();
        let b = tokio::task::spawn_blocking(move || Snapshot::take(&p, port))
            .await
            .map_err(|e| e.to_string())?;
        let (envoy_waiting, _) = memory_mib(envoy_pid);
        let (api_waiting, _) = memory_mib(api_pid);
        for t in slow {
            let _ = tokio::time::timeout(hold + Duration::from_secs(30), t).await;
        }
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(WAIT_S + 30), t).await;
        }
        Ok::<_, String>((a, b, envoy_waiting, api_waiting, started))
    })?;
    let cpu = crate::cpu_between(&a, &b, tck);
    let cpu_per_waiter = cpu.thousandths_each(waiters);
    let done: BTreeMap<usize, Instant> = slow_done
        .lock()
        .map(|d| d.iter().map(|a| (a.key, a.at)).collect())
        .unwrap_or_default();
    let slow_statuses: Vec<String> = slow_done
        .lock()
        .map(|d| d.iter().map(|a| a.kind.clone()).collect())
        .unwrap_or_default();
    let got = answers.lock().map(|a| a.clone()).unwrap_or_default();
    let replays = ReplayTimes::of(&got, &done);
    let claims = cpu.state_api_requests.get("claim").copied().unwrap_or(0.0);
    let point = Point {
        waiters,
        connected_s: connect.as_secs_f64(),
        envoy_rss_before_mib: envoy_before,
        envoy_rss_waiting_mib: envoy_waiting,
        state_api_rss_before_mib: api_before,
        state_api_rss_waiting_mib: api_waiting,
        envoy_kib_per_waiter: (envoy_waiting - envoy_before) * 1024.0 / waiters as f64,
        state_api_kib_per_waiter: (api_waiting - api_before) * 1024.0 / waiters as f64,
        cpu_per_waiter,
        claims_per_waiter_s: claims / waiters as f64 / cpu.window_s.max(1e-9),
        last_replay_after_ms: replays.last_ms,
        median_replay_after_ms: replays.median_ms,
        answers: replays.by_kind,
        refused_p99_ms: replays.refused_p99_ms,
        slow_statuses,
        steal_cores: cpu.steal_cores,
    };
    let _ = started;
    super::print_refusal_sources(&stack.envoy, port);
    eprintln!(
        "  {:>6} waiters: Envoy {:.0} -> {:.0} MiB ({:.1} KiB each), state API {:.0} -> {:.0} MiB ({:.1} KiB each); CPU per waiter {:?}; {:.3} claim answers/waiter/s; last replay {:.0} ms after its key completed (median {:.0}); answers {:?}; slow {:?}",
        waiters, point.envoy_rss_before_mib, point.envoy_rss_waiting_mib, point.envoy_kib_per_waiter,
        point.state_api_rss_before_mib, point.state_api_rss_waiting_mib, point.state_api_kib_per_waiter,
        point.cpu_per_waiter, point.claims_per_waiter_s, point.last_replay_after_ms, point.median_replay_after_ms,
        point.answers, point.slow_statuses
    );
    Ok(point)
}

/// The slow requests, one per key: each holds its key for `hold`.
fn hold_keys(
    envoy: std::net::SocketAddr,
    keys: &[String],
    hold: Duration,
    slow_done: &Answers,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut slow = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        let req = checkout_req(key).header("x-demo-delay-ms", &hold.as_millis().to_string());
        let done = slow_done.clone();
        slow.push(tokio::spawn(async move {
            let sent = Instant::now();
            let status = match async { Conn::open(envoy).await?.send(&req).await }.await {
                Ok(a) => a.status.to_string(),
                Err(e) => format!("transport: {}", crate::load::short(&e)),
            };
            if let Ok(mut d) = done.lock() {
                d.push(Answer::now(k, status, sent));
            }
        }));
    }
    slow
}

/// `waiters` retries with `Prefer: wait`, spread over the keys, each on its own connection.
async fn spawn_waiters(
    envoy: std::net::SocketAddr,
    keys: &[String],
    waiters: usize,
    answers: &Answers,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::with_capacity(waiters);
    for w in 0..waiters {
        let k = w % KEYS;
        let req = checkout_req(&keys[k]).header("prefer", &format!("wait={WAIT_S}"));
        let answers = answers.clone();
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let kind = match async { Conn::open(envoy).await?.send(&req).await }.await {
                Ok(a) if a.status == 201 && a.headers.contains_key("idempotent-replayed") => {
                    "replay".to_owned()
                }
                Ok(a) if a.status == 503 && a.headers.contains_key("retry-after") => {
                    REFUSED.to_owned()
                }
                Ok(a) => format!("status {}", a.status),
                Err(e) => format!("transport: {}", crate::load::short(&e)),
            };
            if let Ok(mut s) = answers.lock() {
                s.push(Answer::now(k, kind, sent));
            }
        }));
        // Connections opened at a pace the single-threaded generator keeps.
        if w % 200 == 199 {
            tokio::task::yield_now().await;
        }
    }
    tasks
}

impl Answer {
    fn now(key: usize, kind: String, sent: Instant) -> Self {
        let at = Instant::now();
        Self {
            key,
            kind,
            at,
            took_ms: at.duration_since(sent).as_secs_f64() * 1000.0,
        }
    }
}

/// The waiters' answers by kind, when the replays came after their key completed, and how
/// fast the refusals came.
struct ReplayTimes {
    by_kind: BTreeMap<String, u64>,
    /// The worst key's last replay after its completion.
    last_ms: f64,
    /// Over every replayed waiter.
    median_ms: f64,
    refused_p99_ms: f64,
}

impl ReplayTimes {
    fn of(got: &[Answer], done: &BTreeMap<usize, Instant>) -> Self {
        let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
        let mut after_ms: Vec<f64> = Vec::new();
        let mut last_by_key: BTreeMap<usize, f64> = BTreeMap::new();
        let mut refused_ms: Vec<f64> = Vec::new();
        for a in got {
            let (k, kind, t) = (&a.key, &a.kind, &a.at);
            *by_kind.entry(kind.clone()).or_default() += 1;
            if kind == REFUSED {
                refused_ms.push(a.took_ms);
            }
            if let (true, Some(end)) = (kind == "replay", done.get(k)) {
                // Signed: a waiter may be answered before the slow request's own answer arrives.
                let ms = if *t >= *end {
                    t.duration_since(*end).as_secs_f64() * 1000.0
                } else {
                    -(end.duration_since(*t).as_secs_f64() * 1000.0)
                };
                after_ms.push(ms);
                let e = last_by_key.entry(*k).or_insert(f64::MIN);
                *e = e.max(ms);
            }
        }
        after_ms.sort_by(f64::total_cmp);
        refused_ms.sort_by(f64::total_cmp);
        Self {
            refused_p99_ms: crate::load::percentile(&refused_ms, 99.0),
            by_kind,
            last_ms: last_by_key.values().copied().fold(f64::NAN, f64::max),
            median_ms: after_ms
                .get(after_ms.len() / 2)
                .copied()
                .unwrap_or(f64::NAN),
        }
    }
}

pub fn run(settings: &Settings) -> Result<CurveOutput, String> {
    let mut quiet = Quiet::start();
    // A level this process's open-files limit cannot hold is reported, not measured.
    let mut counts = Vec::new();
    let mut skipped = Vec::new();
    for n in levels(settings) {
        match super::need_open_files(open_files_needed(n), "this level") {
            Ok(()) => counts.push(n),
            Err(why) => {
                eprintln!("  {n} waiters: not measured: {why}");
                skipped.push((n, why));
            }
        }
    }
    let most = counts.iter().copied().max().unwrap_or(0) as u64;
    let stack = Stack::start(StackOptions {
        state_api_env: vec![
            (
                state_env::STATE_API_MAX_WAITERS.into(),
                (2 * most).max(256).to_string(),
            ),
            (
                state_env::STATE_API_MAX_WAIT_MS.into(),
                (WAIT_S * 1000).to_string(),
            ),
            // Set, not assumed: the goals count against this bound.
            (
                state_env::STATE_API_BATCH_MAX_QUEUED.into(),
                STATE_API_QUEUE_BOUND.to_string(),
            ),
        ],
        tweak: Some(test_support::envoy::Tweak::new(|cfg| {
            cfg.filter.max_waiters = filter_core::config::MAX_WAITERS;
            for r in &mut cfg.routes {
                r.max_wait_s = WAIT_S;
            }
        })),
        ..StackOptions::default()
    })?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let window = settings.secs(5, 3);
    let mut points = Vec::new();
    for &n in &counts {
        let p = measure(&rt, &stack, n, window, settings.quick)?;
        quiet.note(p.steal_cores, 0.0);
        points.push(p);
    }
    drop(stack);
    let curve = WaitingCurve { points, skipped };
    Ok(CurveOutput {
        name: "waiting",
        goals: goals(&curve),
        markdown: markdown(&curve),
        json: serde_json::to_value(&curve).map_err(|e| e.to_string())?,
        quiet: quiet.end(),
    })
}

fn goals(c: &WaitingCurve) -> Vec<Goal> {
    let mut goals = Vec::new();
    for p in &c.points {
        let count = |k: &str| p.answers.get(k).copied().unwrap_or(0) as usize;
        let (replays, refused) = (count("replay"), count(REFUSED));
        let other: Vec<String> = p
            .answers
            .iter()
            .filter(|(k, _)| *k != "replay" && *k != REFUSED)
            .map(|(k, v)| format!("{v} x {k}"))
            .collect();
        goals.push(Goal::new(
            "waiting",
            format!("{} waiters on {KEYS} running keys: the replay when the key completes, or {REFUSED} (the state API's bounded queue); nothing else", p.waiters),
            format!("{} answers of the two", p.waiters),
            format!(
                "{replays} replays (the last {} ms after its key completed), {refused} refused{}{}",
                fig(p.last_replay_after_ms, 0),
                if refused > 0 { format!(" (p99 {} ms from sending, the burst's own queue included)", fig(p.refused_p99_ms, 0)) } else { String::new() },
                if other.is_empty() { String::new() } else { format!(", {}", other.join(", ")) },
            ),
            Some(other.is_empty()),
        ));
        if p.waiters <= STATE_API_QUEUE_BOUND {
            goals.push(Goal::new(
                "waiting",
                format!("{} waiters (within the state API's queue bound, {STATE_API_QUEUE_BOUND}): every one gets the replay", p.waiters),
                format!("{} replays", p.waiters),
                format!("{replays} replays"),
                Some(replays == p.waiters),
            ));
        }
    }
    goals.extend(c.skipped.iter().map(|(n, why)| {
        Goal::new(
            "waiting",
            format!("{n} waiters on {KEYS} running keys: the replay, or {REFUSED}"),
            format!("{n} answers of the two"),
            format!("not measured: {why}"),
            None,
        )
    }));
    goals
}

fn markdown(c: &WaitingCurve) -> String {
    let rows: Vec<Vec<String>> = c
        .points
        .iter()
        .map(|p| {
            let cpu = |k: &str| fig(p.cpu_per_waiter.get(k).copied().unwrap_or(f64::NAN), 3);
            vec![
                p.waiters.to_string(),
                format!(
                    "{} -> {}",
                    fig(p.envoy_rss_before_mib, 0),
                    fig(p.envoy_rss_waiting_mib, 0)
                ),
                fig(p.envoy_kib_per_waiter, 1),
                format!(
                    "{} -> {}",
                    fig(p.state_api_rss_before_mib, 0),
                    fig(p.state_api_rss_waiting_mib, 0)
                ),
                fig(p.state_api_kib_per_waiter, 1),
                cpu("envoy"),
                cpu("state-api"),
                cpu("postgres"),
                fig(p.claims_per_waiter_s, 3),
                fig(p.median_replay_after_ms, 0),
                fig(p.last_replay_after_ms, 0),
                p.answers
                    .iter()
                    .map(|(k, v)| format!("{v} {k}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                fig(p.refused_p99_ms, 1),
                fig(p.steal_cores, 2),
            ]
        })
        .collect();
    format!(
        "### 6. Waiting retries\n\n{}Retries with `Prefer: wait={WAIT_S}` on {KEYS} keys held by slow requests, one connection each, through one filter Envoy (one worker). Memory: resident, before the waiters and while they wait. CPU: thousandths of a core per waiter while they wait. Claim answers per waiter per second while they wait: 0 means no waiter asked again (each holds its one claim open while the state API looks at the record for it; those looks are in the state API's and Postgres's CPU). Replay: ms from a key's completion (its slow request's answer) to its waiters' replays (median over every waiter; the last of the worst key). A waiter refused by the state API's bounded queue (1,024 claims) gets 503 + Retry-After; refused p99: ms from sending to that answer (the burst's own queue in the load generator and Envoy's one worker included).\n\n{}",
        c.skipped
            .iter()
            .map(|(n, why)| format!("{n} waiters: not measured ({why}).\n\n"))
            .collect::<String>(),
        table(
            &["waiters", "Envoy MiB", "Envoy KiB/waiter", "state API MiB", "state API KiB/waiter", "Envoy", "state API", "Postgres", "claim answers/waiter/s", "replay median ms", "last replay ms", "answers", "refused p99 ms", "steal"],
            &rows,
            true
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_of_nothing_is_not_a_number() {
        assert!(crate::scale::ratio(1.0, 0.0).is_nan());
    }

    fn point(waiters: usize, answers: &[(&str, u64)], refused_p99_ms: f64) -> Point {
        Point {
            waiters,
            connected_s: 1.0,
            envoy_rss_before_mib: 0.0,
            envoy_rss_waiting_mib: 0.0,
            state_api_rss_before_mib: 0.0,
            state_api_rss_waiting_mib: 0.0,
            envoy_kib_per_waiter: 0.0,
            state_api_kib_per_waiter: 0.0,
            cpu_per_waiter: BTreeMap::new(),
            claims_per_waiter_s: 0.0,
            last_replay_after_ms: 10.0,
            median_replay_after_ms: 5.0,
            answers: answers.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            refused_p99_ms,
            slow_statuses: Vec::new(),
            steal_cores: 0.0,
        }
    }

    /// Past the state API's queue bound a 503 + Retry-After is a right answer; within it, or
    /// any other answer, is not.
    #[test]
    fn a_waiter_gets_the_replay_or_a_fast_refusal_and_within_the_queue_bound_the_replay() {
        let verdicts = |points: Vec<Point>| -> Vec<Option<bool>> {
            goals(&WaitingCurve {
                points,
                skipped: Vec::new(),
            })
            .iter()
            .map(|g| g.pass)
            .collect()
        };
        assert_eq!(
            verdicts(vec![point(1_000, &[("replay", 1_000)], f64::NAN)]),
            [Some(true), Some(true)]
        );
        assert_eq!(
            verdicts(vec![point(1_000, &[("replay", 990), (REFUSED, 10)], 3.0)]),
            [Some(true), Some(false)]
        );
        assert_eq!(
            verdicts(vec![point(
                10_000,
                &[("replay", 6_000), (REFUSED, 4_000)],
                30.0
            )]),
            [Some(true)]
        );
        assert_eq!(
            verdicts(vec![point(
                10_000,
                &[("replay", 9_999), ("status 503", 1)],
                f64::NAN
            )]),
            [Some(false)]
        );
    }

    #[test]
    fn the_refusals_p99_is_over_the_refused_answers_only() {
        let t0 = Instant::now();
        let mut got: Vec<Answer> = (0..100)
            .map(|i| Answer {
                key: 0,
                kind: REFUSED.into(),
                at: t0,
                took_ms: f64::from(i + 1),
            })
            .collect();
        got.push(Answer {
            key: 0,
            kind: "replay".into(),
            at: t0,
            took_ms: 60_000.0,
        });
        let r = ReplayTimes::of(&got, &BTreeMap::new());
        assert_eq!(r.refused_p99_ms, 99.0);
        assert_eq!(r.by_kind[REFUSED], 100);
    }
}
