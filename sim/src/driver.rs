//! Running many schedules over a few threads, and reporting a failure readably.

use crate::{run_seed, shrink, Outcome, Params};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The first failing seed, its shrunk run and how long the original was.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    pub faults: crate::Faults,
    pub original_trace_len: usize,
    pub shrunk: Outcome,
}

impl Failure {
    pub fn render(&self) -> String {
        let mut out = format!(
            "seed {} (faults {}) broke an invariant: {}\n(trace shrunk from {} to {} lines; replay it with `make simulate SEED={} FAULTS={}`)\n",
            self.seed,
            self.faults,
            self.shrunk.violation.as_deref().unwrap_or("?"),
            self.original_trace_len,
            self.shrunk.trace.len(),
            self.seed,
            self.faults,
        );
        for line in &self.shrunk.trace {
            out.push_str("  ");
            out.push_str(line);
            out.push('\n');
        }
        out.push_str(&format!(
            "shrunk choices (replay with sim::replay): {:?}\n",
            self.shrunk.choices
        ));
        out
    }
}

#[derive(Debug)]
pub struct Report {
    pub schedules: u64,
    pub elapsed: Duration,
    pub steps: u64,
    pub longest_trace: usize,
    /// The seed that made it.
    pub longest_seed: u64,
    /// Runs that broke an invariant the caller asked to ignore.
    pub ignored: u64,
    /// Those runs by the first ignored text their violation contains.
    pub ignored_by: BTreeMap<String, u64>,
    pub failure: Option<Failure>,
    /// In how many schedules each event happened at least once.
    pub reached: BTreeMap<&'static str, u64>,
}

/// The prefix of the model's counts of dangerous regions visited (the rest of what a run
/// reaches is the filter's counters and the model's other events).
pub const REGION: &str = "region: ";

impl Report {
    /// The events reached (dangerous regions aside), with the share of schedules that reached
    /// each.
    pub fn coverage(&self) -> String {
        self.share(false)
    }

    /// The dangerous regions visited, with the share of schedules that visited each.
    pub fn regions(&self) -> String {
        self.share(true)
    }

    fn share(&self, regions: bool) -> String {
        let total = self.schedules.max(1) as f64;
        self.reached
            .iter()
            .filter(|(e, _)| e.starts_with(REGION) == regions)
            .map(|(e, n)| {
                format!(
                    "  {:<72} {:>8} schedules ({:.2}%)",
                    e.trim_start_matches("idempotency.")
                        .trim_start_matches(REGION),
                    n,
                    *n as f64 * 100.0 / total
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn per_second(&self) -> f64 {
        self.schedules as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn summary(&self) -> String {
        format!(
            "simulation: {} schedules in {:.1} s ({:.0} schedules/s, {} steps, longest trace {} lines (seed {}){}){}",
            self.schedules,
            self.elapsed.as_secs_f64(),
            self.per_second(),
            self.steps,
            self.longest_trace,
            self.longest_seed,
            if self.ignored > 0 { format!(", {} with an ignored violation", self.ignored) } else { String::new() },
            match &self.failure {
                Some(f) => format!(
                    "; seed {} FAILED (trace shrunk from {} to {} lines)",
                    f.seed,
                    f.original_trace_len,
                    f.shrunk.trace.len()
                ),
                None => "; every invariant held".into(),
            }
        )
    }
}

/// Runs seeds `start..start+count` (or until `limit`), stopping at the first failure, which is
/// shrunk.
pub fn run_many(
    start: u64,
    count: u64,
    limit: Option<Duration>,
    threads: usize,
    p: Params,
) -> Report {
    run_many_ignoring(start, count, limit, threads, p, &[])
}

/// As [`run_many`], but a run whose violation contains one of `ignore` is counted and the
/// search goes on (to look for other defects while a known one is being fixed). An entry that
/// starts with `+` turns it around: only a violation containing it stops the search.
pub fn run_many_ignoring(
    start: u64,
    count: u64,
    limit: Option<Duration>,
    threads: usize,
    p: Params,
    ignore: &[String],
) -> Report {
    let began = Instant::now();
    let next = AtomicU64::new(start);
    let done = AtomicU64::new(0);
    let total_steps = AtomicU64::new(0);
    let longest = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let ignored = AtomicU64::new(0);
    let ignored_by: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());
    let failure: Mutex<Option<(u64, Outcome)>> = Mutex::new(None);
    let reached: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                if limit.is_some_and(|l| began.elapsed() >= l) {
                    return;
                }
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if count > 0 && seed >= start + count {
                    return;
                }
                let o = run_seed(seed, p);
                done.fetch_add(1, Ordering::Relaxed);
                total_steps.fetch_add(o.steps as u64, Ordering::Relaxed);
                // The length and the seed of the longest trace, in one word.
                longest.fetch_max(((o.trace.len() as u64) << 40) | seed, Ordering::Relaxed);
                if let Ok(mut r) = reached.lock() {
                    for e in o.reached.keys() {
                        *r.entry(*e).or_default() += 1;
                    }
                }
                if let Some(v) = &o.violation {
                    let wanted = ignore
                        .iter()
                        .filter_map(|i| i.strip_prefix('+'))
                        .collect::<Vec<_>>();
                    let skip = if wanted.is_empty() {
                        ignore.iter().any(|i| v.contains(i.as_str()))
                    } else {
                        !wanted.iter().any(|want| v.contains(want))
                    };
                    if skip {
                        ignored.fetch_add(1, Ordering::Relaxed);
                        let by = ignore
                            .iter()
                            .find(|i| v.contains(i.as_str()))
                            .cloned()
                            .unwrap_or_default();
                        if let Ok(mut m) = ignored_by.lock() {
                            *m.entry(by).or_default() += 1;
                        }
                        continue;
                    }
                    stop.store(true, Ordering::Relaxed);
                    if let Ok(mut f) = failure.lock() {
                        let first = f.as_ref().is_none_or(|(s, _)| seed < *s);
                        if first {
                            *f = Some((seed, o));
                        }
                    }
                    return;
                }
            });
        }
    });
    let failure = failure
        .into_inner()
        .ok()
        .flatten()
        .map(|(seed, o)| Failure {
            seed,
            faults: p.faults,
            original_trace_len: o.trace.len(),
            shrunk: shrink(&o, p, 3_000),
        });
    Report {
        schedules: done.load(Ordering::Relaxed),
        elapsed: began.elapsed(),
        steps: total_steps.load(Ordering::Relaxed),
        longest_trace: (longest.load(Ordering::Relaxed) >> 40) as usize,
        longest_seed: longest.load(Ordering::Relaxed) & ((1 << 40) - 1),
        ignored: ignored.load(Ordering::Relaxed),
        ignored_by: ignored_by.into_inner().unwrap_or_default(),
        failure,
        reached: reached.into_inner().unwrap_or_default(),
    }
}
