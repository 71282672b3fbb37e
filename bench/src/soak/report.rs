//! The report: each minute's row, the figures the verdict compares (last minute against the
//! second), and the tables of the text and of docs/BENCH.md.

use std::collections::BTreeMap;

use serde::Serialize;

use super::*;
use crate::table::table;

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
pub(super) fn cores_between(a: &Sample, b: &Sample, tck: f64) -> (f64, f64, f64) {
    let total = b.total_ticks.saturating_sub(a.total_ticks).max(1) as f64;
    let ncpu = procfs::cpu_count() as f64;
    let machine = b.busy_ticks.saturating_sub(a.busy_ticks) as f64 / total * ncpu;
    let irq = b.irq_ticks.saturating_sub(a.irq_ticks) as f64 / total * ncpu;
    let window = (b.t_s - a.t_s).max(1e-9);
    let ours = b.our_ticks.saturating_sub(a.our_ticks) as f64 / tck / window;
    let steal = b.steal_ticks.saturating_sub(a.steal_ticks) as f64 / total * ncpu;
    (machine, (machine - irq - ours).max(0.0), steal)
}

pub(super) fn minute_rows(
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
            let pct = |p: f64| load::percentile(&lat_us, p) / 1000.0;
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

pub(super) fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// A figure the verdict compares: its name, unit, value in a minute, and the floor: a change
/// up to this much (in the unit) passes even when it is more than 20 % of a small value.
pub(super) struct Figure {
    pub(super) name: &'static str,
    pub(super) unit: &'static str,
    pub(super) value: fn(&MinuteRow) -> f64,
    pub(super) floor: f64,
    /// Only a rise fails (sizes, memory, latency: a fall is the opposite of a leak); the rate
    /// and the row count must stay level both ways.
    pub(super) rise_only: bool,
}

/// The figures of the verdict and their floors: 1,000 rows or dead tuples, 1 MiB of table or
/// index, 2 MiB of RSS, 0.5 ms of p50 and 1 ms of p99, 5 new keys a second.
pub(super) fn figures() -> Vec<Figure> {
    pub(super) fn f(
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
    pub(super) fn level(figure: Figure) -> Figure {
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
    pub(super) figure: String,
    pub(super) unit: String,
    pub(super) second: f64,
    pub(super) last: f64,
    /// last - second, in the unit.
    pub(super) change: f64,
    pub(super) change_pct: f64,
    /// The largest change that passes: max(20 % of the second minute, the floor).
    pub(super) allowed: f64,
    /// Only a rise beyond `allowed` fails.
    pub(super) rise_only: bool,
    pub(super) pass: bool,
}

pub(super) fn verdict(rows: &[MinuteRow]) -> Vec<FigureVerdict> {
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

pub(super) const RULE: &str =
    "Passes when nothing failed (every answer as expected, no transport error, \
    every reading taken; the calibration's answers too) and, on each figure, the last minute is \
    within 20 % of the second one (the first warms up and purges the calibration's keys) or \
    within the figure's floor, whichever is larger: 1,000 rows or dead tuples, 1 MiB of table, \
    index or total size, 2 MiB of RSS, 0.5 ms of p50, 1 ms of p99, 5 new keys/s. The new-key \
    rate and the row count must stay level both ways; sizes, dead tuples, memory and latency \
    fail only on a rise (+), as a fall is the opposite of a leak or a slowdown. Dead tuples: the \
    highest reading of the minute (autovacuum makes them a sawtooth); the other table and memory \
    figures: the reading at the minute's end.";

impl SoakReport {
    pub(super) fn failed_figures(&self) -> Vec<&str> {
        self.verdict
            .iter()
            .filter(|v| !v.pass)
            .map(|v| v.figure.as_str())
            .collect()
    }

    pub(super) fn rows_table(&self, md: bool) -> String {
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
        table(&head, &cells, md, 1)
    }

    pub(super) fn verdict_table(&self, md: bool) -> String {
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
        table(&head, &cells, md, 1)
    }

    pub(super) fn summary(&self) -> String {
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

    pub(super) fn outcome(&self) -> String {
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

    pub(super) fn text(&self) -> String {
        format!(
            "{}\n\n{}\n{}\n{}\n",
            self.summary(),
            self.rows_table(false),
            self.verdict_table(false),
            self.outcome()
        )
    }

    pub(super) fn markdown(&self) -> String {
        format!(
            "{BEGIN}\n## Soak\n\nGenerated by `make soak` (bench/src/soak/); raw figures in [soak.json](soak.json). {}\n\n{}\n`purged`: rows deleted by the purge in the minute (state API /metrics); `autovac`: autovacuums of the table in the minute; sizes and RSS read at the minute's end; `other work`: CPU of the machine not taken by the stack, Postgres, the load generator or interrupts, in cores, the hypervisor's steal included (other work, above 0.25, makes a minute's latency noise); `steal`: the hypervisor's steal alone, whose part not in other work was charged to our processes.\n\n**{}**\n\n{}\n{}\n\n![soak](soak.png)\n{END}\n",
            self.summary(),
            self.rows_table(true),
            self.outcome(),
            self.verdict_table(true),
            RULE
        )
    }
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
