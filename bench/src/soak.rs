//! `make soak`: the whole stack (release builds, Envoy `--concurrency 1`) under a steady load for
//! ten minutes, with a short retention (60 s) so that the purge runs all along, to show that
//! nothing grows: the table and its indexes, the dead tuples, the state API's and Envoy's memory,
//! the latency.
//!
//! First the highest new-key rate is measured briefly (a closed loop of 16 connections, as
//! `make bench`'s "new keys"); then, for `SOAK_SECONDS`, new keys are sent at half that rate,
//! paced (each of `SOAK_CONNECTIONS` connections sends on its own clock, whatever the latency),
//! beside replays of keys completed 2 s to half a retention before, and 409s: duplicates of a
//! key held by a slow request (`x-demo-delay-ms`), whose successor takes over before it ends.
//! Every answer is checked; a wrong one or a transport error is a failure of its minute.
//!
//! Every `SOAK_SAMPLE_SECONDS` the table (rows, `pg_relation_size`, `pg_indexes_size`,
//! `pg_total_relation_size`, `n_dead_tup`, `n_live_tup`), the RSS of the state API and Envoy
//! and the state API's purge counters are read; each minute is reported with its figures at
//! its end (dead tuples: the highest sample of the minute, autovacuum makes them a sawtooth).
//!
//! It passes when nothing failed and, on each figure, the last minute is within 20 % of the
//! second (the first warms up and purges the calibration's keys), or within a small absolute
//! floor for figures too small for a percentage to mean anything (see [`figures`]).
//!
//! Writes docs/soak.json, docs/soak.png (bench/plot_soak.py) and its section of docs/BENCH.md,
//! between `<!-- soak -->` and `<!-- /soak -->`.

use contract::state_env;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use test_support::stack::{Stack, StackOptions};

use crate::load::{self, Conn, OpFn, Outcome};
use crate::{
    addr, checkout_req, env_u64, new_key, op_created, op_inflight, op_replay, plot_script, procfs,
    purge, wait_for_quiet,
};

/// The pass rule: the last minute within this fraction of the second, on each figure.
const TOLERANCE: f64 = 0.20;
/// Connections of the closed loop that measures the highest new-key rate (bench's 16).
const CALIBRATION_CONNECTIONS: usize = 16;
/// Keys a replay connection cycles through (refreshed every second).
const REPLAY_KEYS: usize = 100;
/// How long a slow request holds its key, and how often a new one takes over.
const HOLD: Duration = Duration::from_secs(60);
const RENEW: Duration = Duration::from_secs(40);
use crate::bench_doc::{splice_between, SOAK_BEGIN as BEGIN, SOAK_END as END};

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Settings {
    pub(crate) seconds: u64,
    pub(crate) minute_s: u64,
    pub(crate) minutes: usize,
    pub(crate) sample_s: f64,
    pub(crate) samples_per_minute: usize,
    /// New keys per second asked for (0: half the measured maximum).
    pub(crate) rate_asked: u64,
    pub(crate) retention_s: u64,
    pub(crate) purge_interval_s: u64,
    pub(crate) connections: usize,
    pub(crate) replay_rate: u64,
    pub(crate) inflight_rate: u64,
    pub(crate) calibrate_s: u64,
    pub(crate) hold_s: u64,
    pub(crate) renew_s: u64,
}

impl Settings {
    /// bench-scale's steady curve: `minutes` of `minute_s` seconds at `rate` new keys/s with
    /// records kept `retention_s`, readings every `sample_s`; the side loads as the soak's.
    pub(crate) fn steady(
        minutes: u64,
        minute_s: u64,
        sample_s: u64,
        rate: u64,
        retention_s: u64,
    ) -> Self {
        let per_minute = (minute_s / sample_s.max(1)).max(1);
        Self {
            seconds: minutes * minute_s,
            minute_s,
            minutes: minutes as usize,
            sample_s: minute_s as f64 / per_minute as f64,
            samples_per_minute: per_minute as usize,
            rate_asked: rate,
            retention_s,
            purge_interval_s: 5,
            connections: 32,
            replay_rate: 50,
            inflight_rate: 5,
            calibrate_s: 5,
            hold_s: HOLD.as_secs(),
            renew_s: RENEW.as_secs(),
        }
    }

    fn from_env() -> Result<Self, String> {
        let seconds = env_u64("SOAK_SECONDS", 600);
        let minute_s = env_u64("SOAK_MINUTE_SECONDS", 60).max(1);
        let minutes = (seconds / minute_s) as usize;
        if minutes < 2 {
            return Err(format!(
                "SOAK_SECONDS={seconds} makes {minutes} minute(s) of {minute_s} s: the verdict compares the second minute with the last, so at least 2 are needed"
            ));
        }
        let per_minute = (minute_s / env_u64("SOAK_SAMPLE_SECONDS", 5).max(1)).max(1);
        Ok(Self {
            seconds: minutes as u64 * minute_s,
            minute_s,
            minutes,
            sample_s: minute_s as f64 / per_minute as f64,
            samples_per_minute: per_minute as usize,
            rate_asked: env_u64("SOAK_RATE", 0),
            retention_s: env_u64("SOAK_RETENTION_SECONDS", 60).max(1),
            purge_interval_s: env_u64("SOAK_PURGE_INTERVAL_SECONDS", 5).max(1),
            connections: env_u64("SOAK_CONNECTIONS", 32).max(1) as usize,
            replay_rate: env_u64("SOAK_REPLAY_RATE", 50),
            inflight_rate: env_u64("SOAK_INFLIGHT_RATE", 5),
            calibrate_s: env_u64("SOAK_CALIBRATE_SECONDS", 10).max(1),
            hold_s: HOLD.as_secs(),
            renew_s: RENEW.as_secs(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The load

/// What the load did in one minute.
#[derive(Debug, Clone, Default)]
struct MinuteLoad {
    new_keys: u64,
    /// Latencies of the correct new-key answers, microseconds, by reading interval of the
    /// minute (`SOAK_SAMPLE_SECONDS`).
    lat_us: Vec<Vec<u32>>,
    replays: u64,
    conflicts: u64,
    failures: BTreeMap<String, u64>,
}

/// The load's counts by minute, and the new keys completed lately (the replays' keys).
struct Tally {
    start: Instant,
    minute: Duration,
    per_minute: usize,
    minutes: Vec<MinuteLoad>,
    recent: VecDeque<(Instant, String)>,
}

impl Tally {
    fn minute_at(&mut self, t: Instant) -> &mut MinuteLoad {
        let i = self.index(t).0;
        &mut self.minutes[i]
    }

    /// The minute of `t`, and its reading interval in that minute.
    fn index(&self, t: Instant) -> (usize, usize) {
        let x = t.saturating_duration_since(self.start).as_secs_f64() / self.minute.as_secs_f64();
        let i = (x as usize).min(self.minutes.len() - 1);
        let w = ((x - i as f64) * self.per_minute as f64) as usize;
        (i, w.min(self.per_minute - 1))
    }

    fn fail(&mut self, t: Instant, kind: String) {
        *self.minute_at(t).failures.entry(kind).or_default() += 1;
    }
}

type Shared = Arc<Mutex<Tally>>;
/// The operation a paced connection sends next (`None`: nothing to send yet).
type Slot = Arc<Mutex<Option<OpFn>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stream {
    New,
    Replay,
    Conflict,
}

impl Stream {
    fn label(self) -> &'static str {
        match self {
            Self::New => "new key",
            Self::Replay => "replay",
            Self::Conflict => "409",
        }
    }
}

/// `rate` per second over `connections` connections: the period of each.
fn period(rate: f64, connections: usize) -> Duration {
    Duration::from_secs_f64(connections as f64 / rate.max(1e-3))
}

/// How many connections a side stream gets: about 50 requests a second each.
fn side_connections(rate: u64) -> usize {
    rate.div_ceil(50).clamp(1, 4) as usize
}

/// One connection sending its slot's operation once per `every`, from `first` until `until`
/// (a late answer does not lower the rate: the missed ticks are sent at once).
#[allow(clippy::too_many_arguments)]
async fn paced(
    target: SocketAddr,
    stream: Stream,
    client: usize,
    first: Instant,
    every: Duration,
    until: Instant,
    slot: Slot,
    tally: Shared,
    prefix: Arc<str>,
) {
    let mut ticks = tokio::time::interval_at(first.into(), every);
    let mut conn: Option<Conn> = None;
    let mut seq = 0u64;
    loop {
        let at = ticks.tick().await.into_std();
        if at >= until {
            return;
        }
        let op = lock(&slot).clone();
        let Some(op) = op else {
            continue;
        };
        if conn.is_none() {
            match Conn::open(target).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    let kind = format!("{}: {}", stream.label(), load::short(&e));
                    lock(&tally).fail(at, kind);
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else {
            continue;
        };
        let t0 = Instant::now();
        let outcome = op(c, client, seq).await;
        let lat_us = u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX);
        let mut t = lock(&tally);
        match outcome {
            Ok(Outcome::Ok) => {
                let (i, w) = t.index(t0);
                let m = &mut t.minutes[i];
                match stream {
                    Stream::New => {
                        m.new_keys += 1;
                        m.lat_us[w].push(lat_us);
                        t.recent
                            .push_back((Instant::now(), new_key(&prefix, client, seq)));
                    }
                    Stream::Replay => m.replays += 1,
                    Stream::Conflict => m.conflicts += 1,
                }
            }
            Ok(Outcome::Wrong(kind)) => t.fail(t0, format!("{}: {kind}", stream.label())),
            Err(e) => {
                t.fail(
                    t0,
                    format!("{}: transport: {}", stream.label(), load::short(&e)),
                );
                conn = None;
            }
        }
        seq += 1;
    }
}

/// Every second, the replays' keys: up to [`REPLAY_KEYS`] of the new keys completed between
/// `min_age` and `max_age` ago (well inside the retention: older ones are forgotten).
async fn refresh_replay_keys(
    slot: Slot,
    tally: Shared,
    min_age: Duration,
    max_age: Duration,
    until: Instant,
) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        let now = every.tick().await.into_std();
        if now >= until {
            return;
        }
        let keys: Vec<String> = {
            let mut t = lock(&tally);
            while t
                .recent
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > max_age)
            {
                t.recent.pop_front();
            }
            let old_enough = t
                .recent
                .partition_point(|(at, _)| now.saturating_duration_since(*at) >= min_age);
            let n = old_enough.min(REPLAY_KEYS);
            (0..n)
                .map(|i| t.recent[i * old_enough / n].1.clone())
                .collect()
        };
        *lock(&slot) = (!keys.is_empty()).then(|| op_replay(Arc::new(keys)));
    }
}

/// Keeps a key held by a slow request until `until`: each one holds its key [`HOLD`] (at most
/// until just after `until`) and a new one takes over every [`RENEW`]. The duplicates go to
/// the newest key once a probe has seen it held. Every slow request must end 201.
async fn hold_keys(
    envoy: SocketAddr,
    prefix: Arc<str>,
    until: Instant,
    slot: Slot,
    tally: Shared,
) -> usize {
    let mut slow = Vec::new();
    while Instant::now() < until {
        let key = format!("{prefix}-held-{}", slow.len());
        let hold =
            HOLD.min(until.saturating_duration_since(Instant::now()) + Duration::from_secs(2));
        let req = checkout_req(&key).header("x-demo-delay-ms", &hold.as_millis().to_string());
        let t = tally.clone();
        slow.push(tokio::spawn(async move {
            let answer = async { Conn::open(envoy).await?.send(&req).await }.await;
            let wrong = match answer {
                Ok(a) if a.status == 201 && !a.headers.contains_key("idempotent-replayed") => {
                    return;
                }
                Ok(a) => format!("status {}", a.status),
                Err(e) => format!("transport: {}", load::short(&e)),
            };
            lock(&t).fail(Instant::now(), format!("held key's slow request: {wrong}"));
        }));
        // The slow request claims first; then a duplicate must see the key held.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let op = op_inflight(key);
        let mut held = Err("not held within 2 s".to_owned());
        if let Ok(mut probe) = Conn::open(envoy).await {
            for _ in 0..100 {
                match op(&mut probe, 0, 0).await {
                    Ok(Outcome::Ok) => {
                        held = Ok(());
                        break;
                    }
                    Ok(Outcome::Wrong(w)) => held = Err(w),
                    Err(e) => {
                        held = Err(e);
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        match held {
            Ok(()) => *lock(&slot) = Some(op),
            Err(e) => lock(&tally).fail(Instant::now(), format!("held key: {}", load::short(&e))),
        }
        let next = (Instant::now() + RENEW).min(until);
        tokio::time::sleep_until(next.into()).await;
    }
    let n = slow.len();
    for h in slow {
        let done = tokio::time::timeout(HOLD + Duration::from_secs(15), h).await;
        if !matches!(done, Ok(Ok(()))) {
            lock(&tally).fail(
                Instant::now(),
                "held key's slow request: did not end".into(),
            );
        }
    }
    n
}

/// The soak's load from `start` for `settings.seconds`: its counts by minute, and how many slow
/// requests held a key.
async fn drive(
    envoy: SocketAddr,
    settings: Settings,
    rate: f64,
    start: Instant,
    prefix: Arc<str>,
) -> (Vec<MinuteLoad>, usize) {
    let until = start + Duration::from_secs(settings.seconds);
    let tally: Shared = Arc::new(Mutex::new(Tally {
        start,
        minute: Duration::from_secs(settings.minute_s),
        per_minute: settings.samples_per_minute,
        minutes: vec![
            MinuteLoad {
                lat_us: vec![Vec::new(); settings.samples_per_minute],
                ..MinuteLoad::default()
            };
            settings.minutes
        ],
        recent: VecDeque::new(),
    }));
    let mut tasks = Vec::new();
    let mut spawn_streams = |stream: Stream, rate: f64, connections: usize, slot: Slot| {
        let every = period(rate, connections);
        for client in 0..connections {
            // Spread over one period, so the connections do not send together.
            let first = start + every.mul_f64(client as f64 / connections as f64);
            tasks.push(tokio::spawn(paced(
                envoy,
                stream,
                client,
                first,
                every,
                until,
                slot.clone(),
                tally.clone(),
                prefix.clone(),
            )));
        }
    };
    let new_slot: Slot = Arc::new(Mutex::new(Some(op_created(prefix.to_string()))));
    spawn_streams(Stream::New, rate, settings.connections, new_slot);
    let replay_slot: Slot = Arc::new(Mutex::new(None));
    let conflict_slot: Slot = Arc::new(Mutex::new(None));
    // The side loads, each on a few connections of its own.
    for (stream, side_rate, slot) in [
        (Stream::Replay, settings.replay_rate, &replay_slot),
        (Stream::Conflict, settings.inflight_rate, &conflict_slot),
    ] {
        if side_rate > 0 {
            spawn_streams(
                stream,
                side_rate as f64,
                side_connections(side_rate),
                slot.clone(),
            );
        }
    }
    let max_age = Duration::from_secs(settings.retention_s) / 2;
    let refresher = tokio::spawn(refresh_replay_keys(
        replay_slot,
        tally.clone(),
        Duration::from_secs(2).min(max_age / 2),
        max_age,
        until,
    ));
    let held = if settings.inflight_rate > 0 {
        hold_keys(envoy, prefix.clone(), until, conflict_slot, tally.clone()).await
    } else {
        0
    };
    for t in tasks {
        if let Err(e) = t.await {
            lock(&tally).fail(until, format!("task: {e}"));
        }
    }
    let _ = refresher.await;
    let minutes = std::mem::take(&mut lock(&tally).minutes);
    (minutes, held)
}

// ---------------------------------------------------------------------------------------------
// What is read every few seconds

#[derive(Debug, Clone, Serialize, Default)]
pub(crate) struct Sample {
    pub(crate) t_s: f64,
    pub(crate) rows: u64,
    pub(crate) table_bytes: u64,
    pub(crate) index_bytes: u64,
    pub(crate) total_bytes: u64,
    pub(crate) dead_tuples: u64,
    pub(crate) live_tuples: u64,
    pub(crate) autovacuums: u64,
    pub(crate) state_api_rss_kib: u64,
    pub(crate) envoy_rss_kib: u64,
    pub(crate) purged_rows: u64,
    pub(crate) purge_passes: u64,
    pub(crate) purge_backlog_passes: u64,
    /// New-key latency over the interval that ends with this reading.
    pub(crate) new_p50_ms: Option<f64>,
    pub(crate) new_p99_ms: Option<f64>,
    /// CPU ticks: the machine's busy and total (all CPUs), its interrupts, and ours (the stack's
    /// processes, Postgres' backends and this program).
    pub(crate) busy_ticks: u64,
    pub(crate) total_ticks: u64,
    pub(crate) irq_ticks: u64,
    /// The hypervisor's steal (all CPUs).
    pub(crate) steal_ticks: u64,
    pub(crate) our_ticks: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
}

const TABLE_SQL: &str = "SELECT (SELECT count(*) FROM idempotency_records), \
    pg_relation_size('idempotency_records'), pg_indexes_size('idempotency_records'), \
    pg_total_relation_size('idempotency_records'), n_dead_tup, n_live_tup, autovacuum_count \
    FROM pg_stat_user_tables WHERE relname = 'idempotency_records'";

struct Watched<'a> {
    stack: &'a Stack,
    state_api_pid: u32,
    envoy_pid: u32,
    checkout_pid: u32,
    postgres_pid: Option<u32>,
}

impl Watched<'_> {
    fn sample(&self, t_s: f64) -> Sample {
        let metrics = test_support::envoy::http_get_blocking(self.stack.state_api.port, "/metrics")
            .unwrap_or_default();
        let metric = |name: &str| purge::metric(&metrics, name).map_or(0, |v| v as u64);
        let mut s = Sample {
            t_s,
            state_api_rss_kib: procfs::status_kib(self.state_api_pid, "VmRSS").unwrap_or(0),
            envoy_rss_kib: procfs::status_kib(self.envoy_pid, "VmRSS").unwrap_or(0),
            purged_rows: metric("state_api_purged_rows_total"),
            purge_passes: metric("state_api_purge_passes_total{end=\"cleared\"}")
                + metric("state_api_purge_passes_total{end=\"backlog\"}"),
            purge_backlog_passes: metric("state_api_purge_passes_total{end=\"backlog\"}"),
            ..Sample::default()
        };
        (s.busy_ticks, s.total_ticks) = procfs::machine_ticks();
        s.irq_ticks = procfs::irq_ticks();
        s.steal_ticks = procfs::steal_ticks();
        s.our_ticks = [self.state_api_pid, self.envoy_pid, self.checkout_pid]
            .into_iter()
            .map(|pid| procfs::cpu_ticks(pid, false))
            .chain(self.postgres_pid.map(procfs::tree_ticks))
            .sum::<u64>()
            + procfs::cpu_ticks(std::process::id(), true);
        let table = self
            .stack
            .postgres
            .psql(self.stack.database_name(), TABLE_SQL)
            .and_then(|out| {
                let v: Vec<u64> = out
                    .trim()
                    .split('|')
                    .filter_map(|x| x.parse().ok())
                    .collect();
                if v.len() == 7 {
                    Ok(v)
                } else {
                    Err(format!("unexpected answer {out:?}"))
                }
            });
        match table {
            Ok(v) => {
                (s.rows, s.table_bytes, s.index_bytes, s.total_bytes) = (v[0], v[1], v[2], v[3]);
                (s.dead_tuples, s.live_tuples, s.autovacuums) = (v[4], v[5], v[6]);
            }
            Err(e) => s.error = Some(format!("table figures: {}", load::short(&e))),
        }
        if s.state_api_rss_kib == 0 || s.envoy_rss_kib == 0 {
            s.error = Some("a process is gone (no VmRSS)".into());
        }
        s
    }
}

// ---------------------------------------------------------------------------------------------
// The report

/// One minute as reported: the load's counts and the figures read at its end.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MinuteRow {
    pub(crate) minute: usize,
    pub(crate) end_s: f64,
    pub(crate) new_keys: u64,
    pub(crate) new_per_s: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
    pub(crate) replays: u64,
    pub(crate) conflicts: u64,
    pub(crate) failures: u64,
    pub(crate) failure_kinds: BTreeMap<String, u64>,
    pub(crate) rows: u64,
    pub(crate) table_bytes: u64,
    pub(crate) index_bytes: u64,
    pub(crate) total_bytes: u64,
    pub(crate) dead_tuples: u64,
    /// The highest `n_dead_tup` read during the minute.
    pub(crate) dead_tuples_peak: u64,
    pub(crate) live_tuples: u64,
    /// Autovacuums of the table during the minute.
    pub(crate) autovacuums: u64,
    pub(crate) state_api_rss_kib: u64,
    pub(crate) envoy_rss_kib: u64,
    pub(crate) purged_rows: u64,
    pub(crate) purge_passes: u64,
    pub(crate) purge_backlog_passes: u64,
    /// The machine's busy time in the minute, in cores, and the part of it that was not ours
    /// nor interrupts: other work, which makes the minute's latency noise.
    pub(crate) machine_cores: f64,
    pub(crate) other_cores: f64,
    /// The hypervisor's steal in the minute, in cores: part of it is in `other_cores`, the rest
    /// was charged to our processes.
    pub(crate) steal_cores: f64,
}

/// (machine, other work, steal) in cores between two samples.
fn cores_between(a: &Sample, b: &Sample, tck: f64) -> (f64, f64, f64) {
    let total = b.total_ticks.saturating_sub(a.total_ticks).max(1) as f64;
    let ncpu = procfs::cpu_count() as f64;
    let machine = b.busy_ticks.saturating_sub(a.busy_ticks) as f64 / total * ncpu;
    let irq = b.irq_ticks.saturating_sub(a.irq_ticks) as f64 / total * ncpu;
    let window = (b.t_s - a.t_s).max(1e-9);
    let ours = b.our_ticks.saturating_sub(a.our_ticks) as f64 / tck / window;
    let steal = b.steal_ticks.saturating_sub(a.steal_ticks) as f64 / total * ncpu;
    (machine, (machine - irq - ours).max(0.0), steal)
}

fn minute_rows(
    settings: &Settings,
    load: Vec<MinuteLoad>,
    samples: &[Sample],
    tck: f64,
) -> Vec<MinuteRow> {
    let minute_s = settings.minute_s as f64;
    load.into_iter()
        .enumerate()
        .map(|(i, mut m)| {
            let (from, to) = (i as f64 * minute_s, (i + 1) as f64 * minute_s);
            // Samples are taken at fixed times; a small tolerance for their float times.
            let inside: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.t_s > from + 1e-6 && s.t_s <= to + 1e-6)
                .collect();
            let before = samples
                .iter()
                .rev()
                .find(|s| s.t_s <= from + 1e-6)
                .cloned()
                .unwrap_or_default();
            let end = inside.last().map(|s| (*s).clone()).unwrap_or_default();
            for s in &inside {
                if let Some(e) = &s.error {
                    *m.failures.entry(format!("sample: {e}")).or_default() += 1;
                }
            }
            let mut lat_us = m.lat_us.concat();
            lat_us.sort_unstable();
            let (machine_cores, other_cores, steal_cores) = cores_between(&before, &end, tck);
            let pct = |p: f64| load::percentile_us(&lat_us, p) / 1000.0;
            MinuteRow {
                minute: i + 1,
                end_s: to,
                new_keys: m.new_keys,
                new_per_s: m.new_keys as f64 / minute_s,
                p50_ms: pct(50.0),
                p99_ms: pct(99.0),
                max_ms: pct(100.0),
                replays: m.replays,
                conflicts: m.conflicts,
                failures: m.failures.values().sum(),
                failure_kinds: m.failures,
                rows: end.rows,
                table_bytes: end.table_bytes,
                index_bytes: end.index_bytes,
                total_bytes: end.total_bytes,
                dead_tuples: end.dead_tuples,
                dead_tuples_peak: inside.iter().map(|s| s.dead_tuples).max().unwrap_or(0),
                live_tuples: end.live_tuples,
                autovacuums: end.autovacuums.saturating_sub(before.autovacuums),
                state_api_rss_kib: end.state_api_rss_kib,
                envoy_rss_kib: end.envoy_rss_kib,
                purged_rows: end.purged_rows.saturating_sub(before.purged_rows),
                purge_passes: end.purge_passes.saturating_sub(before.purge_passes),
                purge_backlog_passes: end
                    .purge_backlog_passes
                    .saturating_sub(before.purge_backlog_passes),
                machine_cores,
                other_cores,
                steal_cores,
            }
        })
        .collect()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// A figure the verdict compares: its name, unit, value in a minute, and the floor: a change
/// up to this much (in the unit) passes even when it is more than 20 % of a small value.
struct Figure {
    name: &'static str,
    unit: &'static str,
    value: fn(&MinuteRow) -> f64,
    floor: f64,
    /// Only a rise fails (sizes, memory, latency: a fall is the opposite of a leak); the rate
    /// and the row count must stay level both ways.
    rise_only: bool,
}

/// The figures of the verdict and their floors: 1,000 rows or dead tuples, 1 MiB of table or
/// index, 2 MiB of RSS, 0.5 ms of p50 and 1 ms of p99, 5 new keys a second.
fn figures() -> Vec<Figure> {
    fn f(
        name: &'static str,
        unit: &'static str,
        value: fn(&MinuteRow) -> f64,
        floor: f64,
    ) -> Figure {
        Figure {
            name,
            unit,
            value,
            floor,
            rise_only: true,
        }
    }
    fn level(figure: Figure) -> Figure {
        Figure {
            rise_only: false,
            ..figure
        }
    }
    vec![
        level(f("new-key rate", "/s", |m| m.new_per_s, 5.0)),
        level(f("rows", "rows", |m| m.rows as f64, 1000.0)),
        f("table size", "MiB", |m| mib(m.table_bytes), 1.0),
        f("index size", "MiB", |m| mib(m.index_bytes), 1.0),
        f("total size", "MiB", |m| mib(m.total_bytes), 1.0),
        f(
            "dead tuples (peak)",
            "tuples",
            |m| m.dead_tuples_peak as f64,
            1000.0,
        ),
        f(
            "state API RSS",
            "MiB",
            |m| m.state_api_rss_kib as f64 / 1024.0,
            2.0,
        ),
        f("Envoy RSS", "MiB", |m| m.envoy_rss_kib as f64 / 1024.0, 2.0),
        f("new-key p50", "ms", |m| m.p50_ms, 0.5),
        f("new-key p99", "ms", |m| m.p99_ms, 1.0),
    ]
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct FigureVerdict {
    figure: String,
    unit: String,
    second: f64,
    last: f64,
    /// last - second, in the unit.
    change: f64,
    change_pct: f64,
    /// The largest change that passes: max(20 % of the second minute, the floor).
    allowed: f64,
    /// Only a rise beyond `allowed` fails.
    rise_only: bool,
    pass: bool,
}

fn verdict(rows: &[MinuteRow]) -> Vec<FigureVerdict> {
    let (second, last) = (&rows[1], &rows[rows.len() - 1]);
    figures()
        .into_iter()
        .map(|f| {
            let (a, b) = ((f.value)(second), (f.value)(last));
            let allowed = (a.abs() * TOLERANCE).max(f.floor);
            let change = b - a;
            FigureVerdict {
                figure: f.name.into(),
                unit: f.unit.into(),
                second: a,
                last: b,
                change,
                change_pct: if a != 0.0 { change / a * 100.0 } else { 0.0 },
                allowed,
                rise_only: f.rise_only,
                // NaN (no answer in a minute) fails.
                pass: if f.rise_only {
                    change <= allowed
                } else {
                    change.abs() <= allowed
                },
            }
        })
        .collect()
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Calibration {
    pub(crate) connections: usize,
    pub(crate) seconds: u64,
    pub(crate) new_keys_per_s: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) errors: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct SoakReport {
    pub(crate) generated_unix_s: u64,
    pub(crate) git: String,
    pub(crate) settings: Settings,
    pub(crate) calibration: Calibration,
    /// New keys per second sent (half the calibration's, or SOAK_RATE).
    pub(crate) rate: f64,
    pub(crate) held_keys: usize,
    pub(crate) rule: String,
    pub(crate) minutes: Vec<MinuteRow>,
    pub(crate) verdict: Vec<FigureVerdict>,
    pub(crate) failures: u64,
    pub(crate) failure_kinds: BTreeMap<String, u64>,
    pub(crate) pass: bool,
    pub(crate) samples: Vec<Sample>,
    pub(crate) stack_dir: String,
}

const RULE: &str = "Passes when nothing failed (every answer as expected, no transport error, \
    every reading taken; the calibration's answers too) and, on each figure, the last minute is \
    within 20 % of the second one (the first warms up and purges the calibration's keys) or \
    within the figure's floor, whichever is larger: 1,000 rows or dead tuples, 1 MiB of table, \
    index or total size, 2 MiB of RSS, 0.5 ms of p50, 1 ms of p99, 5 new keys/s. The new-key \
    rate and the row count must stay level both ways; sizes, dead tuples, memory and latency \
    fail only on a rise (+), as a fall is the opposite of a leak or a slowdown. Dead tuples: the \
    highest reading of the minute (autovacuum makes them a sawtooth); the other table and memory \
    figures: the reading at the minute's end.";

impl SoakReport {
    fn failed_figures(&self) -> Vec<&str> {
        self.verdict
            .iter()
            .filter(|v| !v.pass)
            .map(|v| v.figure.as_str())
            .collect()
    }

    fn rows_table(&self, md: bool) -> String {
        let head = [
            "min",
            "new/s",
            "p50 ms",
            "p99 ms",
            "replays",
            "409s",
            "failed",
            "rows",
            "table MiB",
            "index MiB",
            "total MiB",
            "dead (peak)",
            "autovac",
            "purged",
            "state API MiB",
            "Envoy MiB",
            "other work",
            "steal",
        ];
        let cells: Vec<Vec<String>> = self
            .minutes
            .iter()
            .map(|m| {
                vec![
                    m.minute.to_string(),
                    format!("{:.0}", m.new_per_s),
                    format!("{:.3}", m.p50_ms),
                    format!("{:.3}", m.p99_ms),
                    m.replays.to_string(),
                    m.conflicts.to_string(),
                    m.failures.to_string(),
                    m.rows.to_string(),
                    format!("{:.1}", mib(m.table_bytes)),
                    format!("{:.1}", mib(m.index_bytes)),
                    format!("{:.1}", mib(m.total_bytes)),
                    m.dead_tuples_peak.to_string(),
                    m.autovacuums.to_string(),
                    m.purged_rows.to_string(),
                    format!("{:.1}", m.state_api_rss_kib as f64 / 1024.0),
                    format!("{:.1}", m.envoy_rss_kib as f64 / 1024.0),
                    format!("{:.2}", m.other_cores),
                    format!("{:.2}", m.steal_cores),
                ]
            })
            .collect();
        table(&head, &cells, md)
    }

    fn verdict_table(&self, md: bool) -> String {
        let head = [
            "figure",
            "2nd minute",
            "last minute",
            "change",
            "allowed",
            "verdict",
        ];
        let cells: Vec<Vec<String>> = self
            .verdict
            .iter()
            .map(|v| {
                vec![
                    v.figure.clone(),
                    format!("{:.2} {}", v.second, v.unit),
                    format!("{:.2} {}", v.last, v.unit),
                    format!("{:+.2} ({:+.1} %)", v.change, v.change_pct),
                    format!("{}{:.2}", if v.rise_only { "+" } else { "±" }, v.allowed),
                    if v.pass { "pass" } else { "FAIL" }.into(),
                ]
            })
            .collect();
        table(&head, &cells, md)
    }

    fn summary(&self) -> String {
        let s = &self.settings;
        let rate_from = if s.rate_asked > 0 {
            "SOAK_RATE".to_owned()
        } else {
            format!(
                "half the {:.0}/s measured first in a {} s closed loop of {} connections",
                self.calibration.new_keys_per_s,
                self.calibration.seconds,
                self.calibration.connections
            )
        };
        format!(
            "{} minutes of {} s. New keys at {:.0}/s ({rate_from}), paced on {} connections; replays at {}/s of keys completed 2 s to {} s before; 409s at {}/s on a key held by a slow request (x-demo-delay-ms, {} s, a new one every {} s: {} in all). State API retention {} s, purge every {} s; Postgres autovacuum with the table's own thresholds (1 % + 1,000 dead rows) and autovacuum_naptime 10 s; readings every {:.0} s.",
            s.minutes,
            s.minute_s,
            self.rate,
            s.connections,
            s.replay_rate,
            s.retention_s / 2,
            s.inflight_rate,
            s.hold_s,
            s.renew_s,
            self.held_keys,
            s.retention_s,
            s.purge_interval_s,
            s.sample_s
        )
    }

    fn outcome(&self) -> String {
        let failed = self.failed_figures();
        if self.pass {
            "PASS: nothing failed, and every figure of the last minute is within 20 % (or its floor) of the second's".into()
        } else {
            let mut why = Vec::new();
            if self.failures > 0 {
                let kinds: Vec<String> = self
                    .failure_kinds
                    .iter()
                    .map(|(k, v)| format!("{v} × {k}"))
                    .collect();
                why.push(format!("{} failures ({})", self.failures, kinds.join(", ")));
            }
            if !failed.is_empty() {
                why.push(format!("out of bounds: {}", failed.join(", ")));
            }
            // Latency moves with other work on the machine: say when the two minutes had some.
            let busy: Vec<String> = [&self.minutes[1], &self.minutes[self.minutes.len() - 1]]
                .iter()
                .filter(|m| crate::noise_cores(m.other_cores, m.steal_cores) > crate::NOISY_CORES)
                .map(|m| {
                    format!(
                        "minute {}: other work {:.2} cores, steal {:.2}",
                        m.minute, m.other_cores, m.steal_cores
                    )
                })
                .collect();
            if !busy.is_empty() {
                why.push(format!(
                    "other work or the hypervisor's steal during a compared minute ({})",
                    busy.join(", ")
                ));
            }
            format!("FAIL: {}", why.join("; "))
        }
    }

    fn text(&self) -> String {
        format!(
            "{}\n\n{}\n{}\n{}\n",
            self.summary(),
            self.rows_table(false),
            self.verdict_table(false),
            self.outcome()
        )
    }

    fn markdown(&self) -> String {
        format!(
            "{BEGIN}\n## Soak\n\nGenerated by `make soak` (bench/src/soak.rs); raw figures in [soak.json](soak.json). {}\n\n{}\n`purged`: rows deleted by the purge in the minute (state API /metrics); `autovac`: autovacuums of the table in the minute; sizes and RSS read at the minute's end; `other work`: CPU of the machine not taken by the stack, Postgres, the load generator or interrupts, in cores, the hypervisor's steal included (other work, above 0.25, makes a minute's latency noise); `steal`: the hypervisor's steal alone, whose part not in other work was charged to our processes.\n\n**{}**\n\n{}\n{}\n\n![soak](soak.png)\n{END}\n",
            self.summary(),
            self.rows_table(true),
            self.outcome(),
            self.verdict_table(true),
            RULE
        )
    }
}

/// A table: Markdown, or aligned text for the terminal.
fn table(head: &[&str], rows: &[Vec<String>], md: bool) -> String {
    let mut out = String::new();
    if md {
        out += &format!("| {} |\n", head.join(" | "));
        out += &format!("|---|{}\n", "---:|".repeat(head.len() - 1));
        for r in rows {
            out += &format!("| {} |\n", r.join(" | "));
        }
        return out;
    }
    let width: Vec<usize> = (0..head.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([head[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in
        std::iter::once(head.iter().map(|h| (*h).to_owned()).collect()).chain(rows.iter().cloned())
    {
        let line: Vec<String> = r
            .iter()
            .zip(&width)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect();
        out += &line.join("  ");
        out += "\n";
    }
    out
}

// ---------------------------------------------------------------------------------------------

pub fn run() -> Result<(), String> {
    if std::env::var_os("STACK_PROFILE").is_none() {
        std::env::set_var("STACK_PROFILE", "release");
    }
    let settings = Settings::from_env()?;
    let out_dir = std::env::var("SOAK_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| test_support::process::workspace_root().join("docs"));
    wait_for_quiet(Duration::from_secs(env_u64("SOAK_QUIET_WAIT_SECONDS", 30)));
    let report = measure(settings)?.report;
    println!("{}", report.text());
    write_outputs(&report, &out_dir)?;
    if report.pass {
        Ok(())
    } else {
        Err(report.outcome())
    }
}

/// A soak's figures: its report, and each minute's new-key latencies (µs, sorted), for
/// windows of several minutes.
pub(crate) struct Soaked {
    pub(crate) report: SoakReport,
    pub(crate) latencies_us: Vec<Vec<u32>>,
}

/// The soak itself: the stack, the calibration, the load and the readings.
pub(crate) fn measure(settings: Settings) -> Result<Soaked, String> {
    eprintln!(
        "soak: starting the stack (retention {} s, purge every {} s) ...",
        settings.retention_s, settings.purge_interval_s
    );
    let stack = Stack::start(StackOptions {
        state_api_env: vec![
            (
                state_env::STATE_API_RETENTION_S.into(),
                settings.retention_s.to_string(),
            ),
            (
                state_env::STATE_API_PURGE_INTERVAL_S.into(),
                settings.purge_interval_s.to_string(),
            ),
        ],
        ..StackOptions::default()
    })?;
    let find = |port: u16, what: &str| {
        procfs::pid_listening_on(port)
            .ok_or_else(|| format!("no process listens on :{port} ({what})"))
    };
    let watched = Watched {
        stack: &stack,
        state_api_pid: find(stack.state_api.port, "state-api")?,
        envoy_pid: find(stack.envoy.params.listen_port, "envoy")?,
        checkout_pid: find(stack.checkout.port, "checkout")?,
        postgres_pid: procfs::pid_listening_on(stack.postgres.port()),
    };
    eprintln!("soak: stack up; logs in {}", stack.dir.display());
    let envoy = addr(stack.envoy.params.listen_port);
    let prefix: Arc<str> = format!("s{}", std::process::id()).into();
    // Single-threaded, like the benchmark's load generator: two cores are shared by everything.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;

    let r = rt.block_on(load::run(
        envoy,
        CALIBRATION_CONNECTIONS,
        Duration::from_secs(2),
        Duration::from_secs(settings.calibrate_s),
        op_created(format!("{prefix}-max")),
    ));
    let calibration = Calibration {
        connections: CALIBRATION_CONNECTIONS,
        seconds: settings.calibrate_s,
        new_keys_per_s: r.rate(),
        p50_ms: r.pct_ms(50.0),
        p99_ms: r.pct_ms(99.0),
        errors: r.errors.clone(),
    };
    let rate = if settings.rate_asked > 0 {
        settings.rate_asked as f64
    } else {
        (calibration.new_keys_per_s / 2.0).round().max(1.0)
    };
    eprintln!(
        "soak: highest new-key rate {:.0}/s (p50 {:.3} ms, p99 {:.3} ms, {} errors); soaking at {rate:.0}/s for {} s",
        calibration.new_keys_per_s,
        calibration.p50_ms,
        calibration.p99_ms,
        r.error_count(),
        settings.seconds
    );

    let start = Instant::now() + Duration::from_millis(200);
    let mut samples = vec![watched.sample(0.0)];
    let load_thread = {
        let (settings, prefix) = (settings.clone(), prefix.clone());
        std::thread::spawn(move || rt.block_on(drive(envoy, settings, rate, start, prefix)))
    };
    let every = Duration::from_secs_f64(settings.sample_s);
    let per_minute = settings.samples_per_minute as u32;
    for k in 1..=per_minute * settings.minutes as u32 {
        std::thread::sleep((start + every * k).saturating_duration_since(Instant::now()));
        let s = watched.sample((every * k).as_secs_f64());
        if k % per_minute == 0 {
            eprintln!(
                "  minute {:>2}: {} rows, table {:.1} MiB, index {:.1} MiB, {} dead, state API {:.1} MiB, Envoy {:.1} MiB{}",
                k / per_minute,
                s.rows,
                mib(s.table_bytes),
                mib(s.index_bytes),
                s.dead_tuples,
                s.state_api_rss_kib as f64 / 1024.0,
                s.envoy_rss_kib as f64 / 1024.0,
                s.error.as_deref().map(|e| format!(" ({e})")).unwrap_or_default()
            );
        }
        samples.push(s);
    }
    let (by_minute, held_keys) = load_thread.join().map_err(|_| "the load thread panicked")?;
    // Reading k (k >= 1) closes interval k - 1.
    let intervals = by_minute.iter().flat_map(|m| &m.lat_us);
    for (s, lat) in samples.iter_mut().skip(1).zip(intervals) {
        let mut lat = lat.clone();
        lat.sort_unstable();
        let pct = |p| (!lat.is_empty()).then(|| load::percentile_us(&lat, p) / 1000.0);
        (s.new_p50_ms, s.new_p99_ms) = (pct(50.0), pct(99.0));
    }

    let latencies_us = by_minute
        .iter()
        .map(|m| {
            let mut all = m.lat_us.concat();
            all.sort_unstable();
            all
        })
        .collect();
    let minutes = minute_rows(&settings, by_minute, &samples, procfs::clk_tck());
    let verdict = verdict(&minutes);
    let mut failure_kinds: BTreeMap<String, u64> = BTreeMap::new();
    for (k, v) in minutes.iter().flat_map(|m| &m.failure_kinds) {
        *failure_kinds.entry(k.clone()).or_default() += v;
    }
    for (k, v) in &calibration.errors {
        *failure_kinds
            .entry(format!("calibration: {k}"))
            .or_default() += v;
    }
    let failures: u64 = failure_kinds.values().sum();
    let report = SoakReport {
        generated_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        git: crate::report::git_state(),
        pass: failures == 0 && verdict.iter().all(|v| v.pass),
        settings,
        calibration,
        rate,
        held_keys,
        rule: RULE.into(),
        minutes,
        verdict,
        failures,
        failure_kinds,
        samples,
        stack_dir: stack.dir.display().to_string(),
    };
    drop(stack);
    Ok(Soaked {
        report,
        latencies_us,
    })
}

fn write_outputs(report: &SoakReport, out_dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(out_dir).map_err(|e| e.to_string())?;
    let json = out_dir.join("soak.json");
    let text = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    std::fs::write(&json, text + "\n").map_err(|e| e.to_string())?;
    let md = out_dir.join("BENCH.md");
    let doc = std::fs::read_to_string(&md).unwrap_or_default();
    std::fs::write(&md, splice_between(&doc, &report.markdown(), BEGIN, END))
        .map_err(|e| e.to_string())?;
    plot_script("plot_soak.py", &json, &out_dir.join("soak.png"));
    eprintln!(
        "soak: wrote {} and its section of {}",
        json.display(),
        md.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minute(rows: u64, dead: u64, p99: f64) -> MinuteRow {
        MinuteRow {
            minute: 1,
            end_s: 60.0,
            new_keys: 60_000,
            new_per_s: 1000.0,
            p50_ms: 2.0,
            p99_ms: p99,
            max_ms: 20.0,
            replays: 0,
            conflicts: 0,
            failures: 0,
            failure_kinds: BTreeMap::new(),
            rows,
            table_bytes: 20 << 20,
            index_bytes: 4 << 20,
            total_bytes: 25 << 20,
            dead_tuples: dead,
            dead_tuples_peak: dead,
            live_tuples: rows,
            autovacuums: 1,
            state_api_rss_kib: 30_000,
            envoy_rss_kib: 60_000,
            purged_rows: 60_000,
            purge_passes: 12,
            purge_backlog_passes: 0,
            machine_cores: 1.0,
            other_cores: 0.0,
            steal_cores: 0.0,
        }
    }

    /// Whether `figure` passed in the verdict over minutes 1..=3 (the second against the last).
    fn passed(rows: &[MinuteRow], figure: &str) -> Option<bool> {
        verdict(rows)
            .iter()
            .find(|f| f.figure == figure)
            .map(|f| f.pass)
    }

    /// A first minute, a steady second one and `last`.
    fn ending_with(last: MinuteRow) -> [MinuteRow; 3] {
        [minute(1, 3, 8.0), minute(60_000, 3, 8.0), last]
    }

    #[test]
    fn verdict_uses_twenty_percent_or_the_floor() {
        let steady = ending_with(minute(70_000, 5, 8.5));
        // 60,000 -> 70,000 rows: +16.7 %.
        assert_eq!(passed(&steady, "rows"), Some(true));
        // 3 -> 5 dead tuples: within the floor of 1,000.
        assert_eq!(passed(&steady, "dead tuples (peak)"), Some(true));
        assert_eq!(passed(&steady, "new-key p99"), Some(true));
        let growing = ending_with(minute(75_000, 3, 11.0));
        assert_eq!(passed(&growing, "rows"), Some(false));
        assert_eq!(passed(&growing, "new-key p99"), Some(false));
        // Faster at the end passes; far fewer rows (the load stopped) does not.
        let settled = ending_with(minute(40_000, 3, 5.0));
        assert_eq!(passed(&settled, "new-key p99"), Some(true));
        assert_eq!(passed(&settled, "rows"), Some(false));
        // A minute without answers has no p50: it fails.
        let mut empty = minute(60_000, 3, f64::NAN);
        empty.p50_ms = f64::NAN;
        assert_eq!(passed(&ending_with(empty), "new-key p50"), Some(false));
    }
}
