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
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
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

mod report;
mod sample;
mod traffic;

pub(crate) use report::*;
pub(crate) use sample::*;
use traffic::*;

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
    let watched = Watched::of(&stack)?;
    eprintln!("soak: stack up; logs in {}", stack.dir.display());
    let envoy = addr(stack.envoy.params.listen_port);
    let prefix: Arc<str> = format!("s{}", std::process::id()).into();
    // Single-threaded, like the benchmark's load generator: two cores are shared by everything.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let (calibration, rate) = calibrate(&rt, envoy, &settings, &prefix);

    let start = Instant::now() + Duration::from_millis(200);
    let mut samples = vec![watched.sample(0.0)];
    let load_thread = {
        let (settings, prefix) = (settings.clone(), prefix.clone());
        std::thread::spawn(move || rt.block_on(drive(envoy, settings, rate, start, prefix)))
    };
    samples.extend(read_every_few_seconds(&watched, &settings, start));
    let (by_minute, held_keys) = load_thread.join().map_err(|_| "the load thread panicked")?;
    attach_latencies(&mut samples, &by_minute);
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
    let failure_kinds = failure_kinds(&minutes, &calibration);
    let failures: u64 = failure_kinds.values().sum();
    let report = SoakReport {
        generated_unix_s: crate::report::unix_now_s(),
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

/// The highest new-key rate, measured briefly in a closed loop, and the rate the soak sends
/// (the one asked for, or half the highest).
fn calibrate(
    rt: &tokio::runtime::Runtime,
    envoy: SocketAddr,
    settings: &Settings,
    prefix: &str,
) -> (Calibration, f64) {
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
    (calibration, rate)
}

/// The readings after the first, on the soak's clock from `start`; each minute's last is
/// printed.
fn read_every_few_seconds(
    watched: &Watched<'_>,
    settings: &Settings,
    start: Instant,
) -> Vec<Sample> {
    let mut samples = Vec::new();
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
    samples
}

/// Each reading's new-key latency over the interval it closes (reading k >= 1 closes
/// interval k - 1).
fn attach_latencies(samples: &mut [Sample], by_minute: &[MinuteLoad]) {
    let intervals = by_minute.iter().flat_map(|m| &m.lat_us);
    for (s, lat) in samples.iter_mut().skip(1).zip(intervals) {
        let mut lat = lat.clone();
        lat.sort_unstable();
        let pct = |p| (!lat.is_empty()).then(|| load::percentile(&lat, p) / 1000.0);
        (s.new_p50_ms, s.new_p99_ms) = (pct(50.0), pct(99.0));
    }
}

/// Every failure of the soak by kind, the calibration's included.
fn failure_kinds(minutes: &[MinuteRow], calibration: &Calibration) -> BTreeMap<String, u64> {
    let mut failure_kinds: BTreeMap<String, u64> = BTreeMap::new();
    for (k, v) in minutes.iter().flat_map(|m| &m.failure_kinds) {
        *failure_kinds.entry(k.clone()).or_default() += v;
    }
    for (k, v) in &calibration.errors {
        *failure_kinds
            .entry(format!("calibration: {k}"))
            .or_default() += v;
    }
    failure_kinds
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
