//! Curve 2, steady state under the purge: `make soak`'s load (new keys paced at a constant rate,
//! replays and 409s beside them, the table and memory read every few seconds) for 30 minutes
//! with a one-minute retention, so that the purge deletes as many records as the load adds. The
//! table's and the indexes' sizes must level off: within 10 % over the last half of the run
//! (highest against lowest reading); and the new keys' p99 of the last five minutes within 1.2x
//! of the first five after levelling (the first five minutes fill the table and let autovacuum
//! find its rhythm, so minutes 6 to 10 against 26 to 30). Dead tuples are plotted.
//!
//! SCALE_STEADY_RATE (new keys/s, default 1,000: the low end of a day of keys at 1,000-2,000 a
//! second), SCALE_STEADY_MINUTES (30); quick: 6 "minutes" of 20 s at 200/s, retention 20 s.

use serde::Serialize;

use super::{at_most, fig, ratio, table, CurveOutput, Goal, Quiet, Settings};
use crate::env_u64;
use crate::soak;

#[derive(Debug, Clone, Serialize)]
struct Window {
    from_minute: usize,
    to_minute: usize,
}

#[derive(Debug, Clone, Serialize)]
struct SizeSpread {
    figure: &'static str,
    lowest_mib: f64,
    highest_mib: f64,
    /// highest / lowest - 1 over the last half of the run.
    spread: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Steady {
    rate: f64,
    minutes: usize,
    minute_s: u64,
    retention_s: u64,
    levelling: Window,
    first: Window,
    last: Window,
    first_p99_ms: f64,
    last_p99_ms: f64,
    p99_ratio: f64,
    last_half: Window,
    sizes: Vec<SizeSpread>,
    dead_tuples_peak_last_half: u64,
    failures: u64,
    failure_kinds: std::collections::BTreeMap<String, u64>,
    /// Per minute: new keys/s, p50, p99, rows, sizes, dead tuples (peak), autovacuums, purged.
    by_minute: serde_json::Value,
    /// Every reading (sizes, dead tuples, memory) for the plot.
    samples: serde_json::Value,
}

/// p99 of the new keys answered in minutes `w` (1-based, inclusive).
fn p99_of(latencies: &[Vec<u32>], w: &Window) -> f64 {
    let mut all: Vec<u32> = latencies
        .iter()
        .skip(w.from_minute - 1)
        .take(w.to_minute + 1 - w.from_minute)
        .flatten()
        .copied()
        .collect();
    all.sort_unstable();
    crate::load::percentile(&all, 99.0) / 1000.0
}

/// The windows of a run of `m` minutes: levelling, first and last sixth, last half (30: 1-5,
/// 6-10, 26-30, 16-30).
fn windows(m: usize) -> (Window, Window, Window, Window) {
    let sixth = (m / 6).max(1);
    let w = |from_minute: usize, to_minute: usize| Window {
        from_minute,
        to_minute,
    };
    (
        w(1, sixth),
        w(sixth + 1, (2 * sixth).min(m)),
        w(m + 1 - sixth, m),
        w(m / 2 + 1, m),
    )
}

pub fn run(settings: &Settings) -> Result<CurveOutput, String> {
    let (minutes, minute_s, sample_s, rate, retention_s) = if settings.quick {
        (6, 20, 5, env_u64("SCALE_STEADY_RATE", 200), 20)
    } else {
        (
            env_u64("SCALE_STEADY_MINUTES", 30).max(6),
            60,
            5,
            env_u64("SCALE_STEADY_RATE", 1_000),
            60,
        )
    };
    let quiet = Quiet::start();
    let soaked = soak::measure(soak::Settings::steady(
        minutes,
        minute_s,
        sample_s,
        rate,
        retention_s,
    ))?;
    let r = &soaked.report;
    let m = r.minutes.len();
    let (levelling, first, last, last_half) = windows(m);
    let first_p99_ms = p99_of(&soaked.latencies_us, &first);
    let last_p99_ms = p99_of(&soaked.latencies_us, &last);
    let half: Vec<&soak::MinuteRow> = r.minutes.iter().skip(last_half.from_minute - 1).collect();
    // Every reading of the last half, not only the minutes' ends.
    let from_s = (last_half.from_minute - 1) as f64 * minute_s as f64;
    let readings: Vec<&soak::Sample> = r.samples.iter().filter(|s| s.t_s > from_s).collect();
    let spread = |figure: &'static str, value: fn(&soak::Sample) -> u64| {
        let v: Vec<f64> = readings
            .iter()
            .map(|s| value(s) as f64 / 1_048_576.0)
            .collect();
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        SizeSpread {
            figure,
            lowest_mib: lo,
            highest_mib: hi,
            spread: ratio(hi, lo) - 1.0,
        }
    };
    let sizes = vec![
        spread("table", |s| s.table_bytes),
        spread("indexes", |s| s.index_bytes),
        spread("total", |s| s.total_bytes),
    ];
    let mut quiet = quiet;
    for mr in &r.minutes {
        quiet.note(mr.steal_cores, mr.other_cores);
    }
    let curve = Steady {
        rate: r.rate,
        minutes: m,
        minute_s,
        retention_s,
        levelling,
        first,
        last,
        first_p99_ms,
        last_p99_ms,
        p99_ratio: ratio(last_p99_ms, first_p99_ms),
        last_half,
        sizes,
        dead_tuples_peak_last_half: half.iter().map(|x| x.dead_tuples_peak).max().unwrap_or(0),
        failures: r.failures,
        failure_kinds: r.failure_kinds.clone(),
        by_minute: serde_json::to_value(&r.minutes).map_err(|e| e.to_string())?,
        samples: serde_json::to_value(&r.samples).map_err(|e| e.to_string())?,
    };
    let goals = goals(&curve);
    Ok(CurveOutput {
        name: "steady",
        markdown: markdown(&curve, &r.minutes),
        json: serde_json::to_value(&curve).map_err(|e| e.to_string())?,
        goals,
        quiet: quiet.end(),
    })
}

fn goals(c: &Steady) -> Vec<Goal> {
    let flat = c.sizes.iter().all(|s| at_most(s.spread, 0.10));
    let sizes = c
        .sizes
        .iter()
        .map(|s| {
            format!(
                "{} {}-{} MiB ({:+.1} %)",
                s.figure,
                fig(s.lowest_mib, 1),
                fig(s.highest_mib, 1),
                s.spread * 100.0
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    vec![
        Goal::new(
            "steady",
            format!(
                "table and index sizes over the last half (minutes {}-{})",
                c.last_half.from_minute, c.last_half.to_minute
            ),
            "highest within 10 % of lowest",
            sizes,
            Some(flat),
        ),
        Goal::new(
            "steady",
            format!(
                "new-key p99, minutes {}-{} against {}-{} (after levelling)",
                c.last.from_minute, c.last.to_minute, c.first.from_minute, c.first.to_minute
            ),
            "<= 1.2x",
            format!(
                "{}x ({} against {} ms)",
                fig(c.p99_ratio, 2),
                fig(c.last_p99_ms, 2),
                fig(c.first_p99_ms, 2)
            ),
            Some(at_most(c.p99_ratio, 1.2)),
        ),
        Goal::new(
            "steady",
            "every answer as expected",
            "0 failures",
            format!("{} failures", c.failures),
            Some(c.failures == 0),
        ),
    ]
}

fn markdown(c: &Steady, minutes: &[soak::MinuteRow]) -> String {
    let rows: Vec<Vec<String>> = minutes
        .iter()
        .map(|m| {
            vec![
                m.minute.to_string(),
                fig(m.new_per_s, 0),
                fig(m.p50_ms, 2),
                fig(m.p99_ms, 2),
                m.rows.to_string(),
                fig(m.table_bytes as f64 / 1_048_576.0, 1),
                fig(m.index_bytes as f64 / 1_048_576.0, 1),
                m.dead_tuples_peak.to_string(),
                m.autovacuums.to_string(),
                m.purged_rows.to_string(),
                m.failures.to_string(),
                fig(m.steal_cores, 2),
            ]
        })
        .collect();
    format!(
        "### 2. Steady state under the purge\n\n{} minutes of {} s: new keys at {:.0}/s (paced), replays and 409s beside them (as `make soak`), records kept {} s and purged every 5 s. Sizes and dead tuples read every 5 s; the verdict takes the highest and lowest reading of the last half. Minutes {}-{} fill the table and let autovacuum settle.\n\n{}",
        c.minutes,
        c.minute_s,
        c.rate,
        c.retention_s,
        c.levelling.from_minute,
        c.levelling.to_minute,
        table(
            &[
                "minute", "new/s", "p50 ms", "p99 ms", "rows", "table MiB", "index MiB",
                "dead (peak)", "autovac", "purged", "failed", "steal"
            ],
            &rows,
            true
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_windows_of_half_an_hour_and_of_a_quick_run() {
        let (lev, first, last, half) = windows(30);
        assert_eq!((lev.from_minute, lev.to_minute), (1, 5));
        assert_eq!((first.from_minute, first.to_minute), (6, 10));
        assert_eq!((last.from_minute, last.to_minute), (26, 30));
        assert_eq!((half.from_minute, half.to_minute), (16, 30));
        let (_, first, last, half) = windows(6);
        assert_eq!((first.from_minute, first.to_minute), (2, 2));
        assert_eq!((last.from_minute, last.to_minute), (6, 6));
        assert_eq!(half.from_minute, 4);
    }

    #[test]
    fn p99_pools_the_minutes_of_a_window() {
        let lat = vec![vec![1_000; 10], vec![2_000; 100], vec![9_000; 1]];
        let w = Window {
            from_minute: 2,
            to_minute: 3,
        };
        assert_eq!(p99_of(&lat, &w), 2.0);
    }
}
