//! Running many schedules over a few threads (going on past failures and counting them, or
//! stopping at the first), reporting failures readably, and choosing where a run starts: a
//! random seed for `make simulate`, one derived from the commit and the date for `make test`'s
//! fresh schedules, spread over every mix of faults.

use crate::{run_seed, shrink_within, Faults, Outcome, Params};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A failing seed, its shrunk run and how long the original was.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    pub faults: Faults,
    pub original_trace_len: usize,
    pub shrunk: Outcome,
}

impl Failure {
    pub fn render(&self) -> String {
        let mut out = format!(
            "seed {} (faults {}) broke an invariant: {}\n(trace shrunk from {} to {} lines; replay it with `{}`)\n",
            self.seed,
            mix_name(self.faults),
            self.shrunk.violation.as_deref().unwrap_or("?"),
            self.original_trace_len,
            self.shrunk.trace.len(),
            replay_command(self.seed, self.faults),
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

/// How many failing seeds a report keeps (the lowest), each with its replay command.
pub const FAILING_SEEDS_KEPT: usize = 10;

/// What a run of many schedules came to.
#[derive(Debug)]
pub struct Report {
    /// The first seed; the run covered the seeds `start..start + schedules`, every one of them.
    pub start: u64,
    /// The faults its schedules could inject.
    pub faults: Faults,
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
    /// Runs that broke an invariant (not ignored).
    pub failed: u64,
    /// Those runs by the invariant they broke first ([`invariant_of`] its violation).
    pub failed_by: BTreeMap<String, u64>,
    /// The lowest failing seeds (at most [`FAILING_SEEDS_KEPT`]) and their violations.
    pub failing_seeds: Vec<(u64, String)>,
    /// The lowest failing seed, shrunk.
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

    /// The seeds the run covered, every one of them: `seeds 1000 to 1999`.
    pub fn seeds(&self) -> String {
        match self.schedules {
            0 => format!("no seed from {}", self.start),
            n => format!("seeds {} to {}", self.start, self.start + n - 1),
        }
    }

    pub fn summary(&self) -> String {
        format!(
            "simulation: {} schedules, {}, faults {} in {:.1} s ({:.0} schedules/s, {} steps, longest trace {} lines (seed {}){}){}",
            self.schedules,
            self.seeds(),
            mix_name(self.faults),
            self.elapsed.as_secs_f64(),
            self.per_second(),
            self.steps,
            self.longest_trace,
            self.longest_seed,
            if self.ignored > 0 { format!(", {} with an ignored violation", self.ignored) } else { String::new() },
            match &self.failure {
                Some(f) => format!(
                    "; {} FAILED, the first seed {} (trace shrunk from {} to {} lines)",
                    self.failed,
                    f.seed,
                    f.original_trace_len,
                    f.shrunk.trace.len()
                ),
                None => "; every invariant held".into(),
            }
        )
    }

    /// The failures: how many schedules broke each invariant, the lowest failing seeds with
    /// their replay commands, and the first one's shrunk trace. Empty when none failed.
    pub fn failures(&self) -> String {
        let Some(first) = &self.failure else {
            return String::new();
        };
        let total = self.schedules.max(1) as f64;
        let mut out = format!(
            "{} of {} schedules ({}, faults {}) broke an invariant; by the invariant each broke first:\n",
            self.failed,
            self.schedules,
            self.seeds(),
            mix_name(self.faults)
        );
        let mut by: Vec<_> = self.failed_by.iter().collect();
        by.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (kind, n) in by {
            out.push_str(&format!(
                "  {n:>8} ({:.3}%)  {kind}\n",
                *n as f64 * 100.0 / total
            ));
        }
        out.push_str(&format!(
            "the first {} failing seeds:\n",
            self.failing_seeds.len()
        ));
        for (seed, v) in &self.failing_seeds {
            out.push_str(&format!(
                "  {}   # {}\n",
                replay_command(*seed, self.faults),
                shorten(v, 140)
            ));
        }
        out.push_str("the first, shrunk:\n");
        out.push_str(&first.render());
        out
    }
}

fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

/// The command that replays one schedule with its whole trace.
pub fn replay_command(seed: u64, faults: Faults) -> String {
    format!("make simulate SEED={seed} FAULTS={}", mix_name(faults))
}

/// The invariant a violation breaks, in a few words, its numbers and the values it names left
/// out (`1: stream executed again with token`): how failures are counted.
pub fn invariant_of(violation: &str) -> String {
    let (number, rest) = violation.split_once(": ").unwrap_or(("?", violation));
    // The text outside parentheses, brackets, braces and quotes (keys, scopes, answers).
    let mut plain = String::new();
    let (mut depth, mut quoted, mut escaped) = (0usize, false, false);
    for c in rest.chars() {
        if quoted {
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (false, '"') => quoted = false,
                _ => escaped = false,
            }
            continue;
        }
        match c {
            '"' => quoted = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    // Its first words up to the first clause's end, at most six, without the numbers.
    let mut words: Vec<&str> = Vec::new();
    for w in plain.split_whitespace() {
        let word = w.trim_matches(|c: char| matches!(c, ',' | ';' | ':' | '.'));
        if !word.is_empty() && !word.chars().any(|c| c.is_ascii_digit()) {
            words.push(word);
        }
        if words.len() == 6 || w.ends_with([',', ';', ':']) {
            break;
        }
    }
    format!("{number}: {}", words.join(" "))
}

/// What to run: seeds `start..start + count` (`count` 0: no end) or until `limit`, with
/// `params`, over `threads`.
#[derive(Debug, Clone)]
pub struct Search<'a> {
    pub start: u64,
    pub count: u64,
    pub limit: Option<Duration>,
    pub threads: usize,
    pub params: Params,
    /// A run whose violation contains one of these is counted apart (in `ignored_by`), not as a
    /// failure. An entry that starts with `+` turns it around: only a violation containing it is
    /// a failure.
    pub ignore: &'a [String],
    /// Go on past failures, counting them (`make simulate`, `make test`); otherwise stop at
    /// the first.
    pub keep_going: bool,
    /// How long the lowest failure's shrinking may take (besides its 3,000 replays), if
    /// bounded.
    pub shrink_time: Option<Duration>,
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
    search(&Search {
        start,
        count,
        limit,
        threads,
        params: p,
        ignore,
        keep_going: false,
        shrink_time: None,
    })
}

/// Runs the schedules `s` asks for. Every seed taken is run to its end, so the seeds covered
/// are `start..start + schedules` whether the run ends by its count, its time limit or a
/// failure. The lowest failing seed is shrunk (within 3,000 replays and `shrink_time`).
pub fn search(s: &Search) -> Report {
    let (start, count, limit, p, ignore) = (s.start, s.count, s.limit, s.params, s.ignore);
    let began = Instant::now();
    let next = AtomicU64::new(start);
    let done = AtomicU64::new(0);
    let total_steps = AtomicU64::new(0);
    let longest: Mutex<(usize, u64)> = Mutex::new((0, start));
    let stop = AtomicBool::new(false);
    let ignored = AtomicU64::new(0);
    let ignored_by: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());
    let failed = AtomicU64::new(0);
    let failed_by: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());
    let failing_seeds: Mutex<BTreeMap<u64, String>> = Mutex::new(BTreeMap::new());
    let failure: Mutex<Option<(u64, Outcome)>> = Mutex::new(None);
    let reached: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());
    let wanted = ignore
        .iter()
        .filter_map(|i| i.strip_prefix('+'))
        .collect::<Vec<_>>();
    std::thread::scope(|scope| {
        for _ in 0..s.threads.max(1) {
            scope.spawn(|| loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                if limit.is_some_and(|l| began.elapsed() >= l) {
                    return;
                }
                if count > 0 && next.load(Ordering::Relaxed) >= start.saturating_add(count) {
                    return;
                }
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if count > 0 && seed >= start.saturating_add(count) {
                    return;
                }
                let o = run_seed(seed, p);
                done.fetch_add(1, Ordering::Relaxed);
                total_steps.fetch_add(o.steps as u64, Ordering::Relaxed);
                if let Ok(mut l) = longest.lock() {
                    if (o.trace.len(), std::cmp::Reverse(seed)) > (l.0, std::cmp::Reverse(l.1)) {
                        *l = (o.trace.len(), seed);
                    }
                }
                if let Ok(mut r) = reached.lock() {
                    for e in o.reached.keys() {
                        *r.entry(*e).or_default() += 1;
                    }
                }
                let Some(v) = &o.violation else {
                    continue;
                };
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
                failed.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut m) = failed_by.lock() {
                    *m.entry(invariant_of(v)).or_default() += 1;
                }
                if let Ok(mut m) = failing_seeds.lock() {
                    m.insert(seed, v.clone());
                    if m.len() > FAILING_SEEDS_KEPT {
                        m.pop_last();
                    }
                }
                if let Ok(mut f) = failure.lock() {
                    if f.as_ref().is_none_or(|(s, _)| seed < *s) {
                        *f = Some((seed, o));
                    }
                }
                if !s.keep_going {
                    stop.store(true, Ordering::Relaxed);
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
            shrunk: shrink_within(&o, p, 3_000, s.shrink_time),
        });
    let (longest_trace, longest_seed) = longest.into_inner().unwrap_or_default();
    Report {
        start,
        faults: p.faults,
        schedules: done.load(Ordering::Relaxed),
        elapsed: began.elapsed(),
        steps: total_steps.load(Ordering::Relaxed),
        longest_trace,
        longest_seed,
        ignored: ignored.load(Ordering::Relaxed),
        ignored_by: ignored_by.into_inner().unwrap_or_default(),
        failed: failed.load(Ordering::Relaxed),
        failed_by: failed_by.into_inner().unwrap_or_default(),
        failing_seeds: failing_seeds
            .into_inner()
            .unwrap_or_default()
            .into_iter()
            .collect(),
        failure,
        reached: reached.into_inner().unwrap_or_default(),
    }
}

/// Every kind of fault, one at a time (`Faults::parse` knows each by its name).
pub fn fault_kinds() -> Vec<Faults> {
    (0..32)
        .map(|i| 1u32 << i)
        .filter(|b| Faults::ALL.has(*b))
        .map(Faults)
        .collect()
}

/// A mix of faults as `FAULTS` takes it, in its shortest form: `all`, `all,-kill,-give-up`
/// (most kinds on), `callout,skew` (a few).
pub fn mix_name(faults: Faults) -> String {
    if faults == Faults::ALL {
        return "all".into();
    }
    let kinds = fault_kinds();
    let off: Vec<Faults> = kinds.iter().copied().filter(|k| !faults.has(k.0)).collect();
    if faults.0 != 0 && off.len() * 2 < kinds.len() {
        let mut name = "all".to_owned();
        for k in off {
            name.push_str(&format!(",-{k}"));
        }
        name
    } else {
        faults.to_string()
    }
}

/// The mixes of faults the fresh schedules of `make test` are spread over: `all`, each kind
/// alone, `all` but each kind, then `extra` (the mixes of `sim/regressions.txt`), each once.
pub fn fault_mixes(extra: &[Faults]) -> Vec<Faults> {
    let kinds = fault_kinds();
    let mut mixes = vec![Faults::ALL];
    mixes.extend(kinds.iter().copied());
    mixes.extend(kinds.iter().map(|k| Faults(Faults::ALL.0 & !k.0)));
    for f in extra {
        if f.0 != 0 && !mixes.contains(f) {
            mixes.push(*f);
        }
    }
    mixes
}

/// One block of a plan: `count` seeds from `start`, with `faults`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub faults: Faults,
    pub start: u64,
    pub count: u64,
}

/// `total` seeds from `start`, one after another, split over `mixes`: the first (`all`) takes
/// two fifths and what the others leave, the others share the rest evenly.
pub fn plan(start: u64, total: u64, mixes: &[Faults]) -> Vec<Block> {
    let Some((first, rest)) = mixes.split_first() else {
        return Vec::new();
    };
    let each = if rest.is_empty() {
        0
    } else {
        (total - total * 2 / 5) / rest.len() as u64
    };
    let mut counts = vec![total - each * rest.len() as u64];
    counts.extend(rest.iter().map(|_| each));
    let mut next = start;
    std::iter::once(first)
        .chain(rest)
        .zip(counts)
        .map(|(f, count)| {
            let b = Block {
                faults: *f,
                start: next,
                count,
            };
            next += count;
            b
        })
        .collect()
}

/// Seeds drawn for a run (random, or from the commit and date) stay below this, far from the
/// fixed blocks and with room for any run after them.
pub const DRAWN_SEEDS_BELOW: u64 = 1 << 39;

/// The first seed of `make test`'s fresh schedules: a hash of `"<commit> <date>"` (the date
/// alone without a commit), below [`DRAWN_SEEDS_BELOW`]. A new commit or a new day runs
/// other schedules; the same commit on the same day the same ones.
pub fn fresh_start(commit: Option<&str>, date: &str) -> u64 {
    let text = match commit {
        Some(c) => format!("{c} {date}"),
        None => date.to_owned(),
    };
    // FNV-1a, then SplitMix64's finaliser: stable across Rust versions and machines.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h) % DRAWN_SEEDS_BELOW
}

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A random first seed (`make simulate`'s default): the OS's randomness (std's hash keys),
/// the clock and the process id, below [`DRAWN_SEEDS_BELOW`].
pub fn random_start() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.write_u32(std::process::id());
    mix64(h.finish()) % DRAWN_SEEDS_BELOW
}

/// The UTC date of `t`, `YYYY-MM-DD`.
pub fn utc_date(t: std::time::SystemTime) -> String {
    let days = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn dates_are_utc_days() {
        assert_eq!(utc_date(UNIX_EPOCH), "1970-01-01");
        assert_eq!(
            utc_date(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29"
        );
        assert_eq!(
            utc_date(UNIX_EPOCH + Duration::from_secs(1_767_225_599)),
            "2025-12-31"
        );
    }

    #[test]
    fn the_fresh_start_is_stable_and_moves_with_the_commit_and_the_day() {
        let a = fresh_start(Some("089d2d2"), "2025-06-01");
        assert_eq!(a, fresh_start(Some("089d2d2"), "2025-06-01"));
        assert_ne!(a, fresh_start(Some("089d2d2"), "2025-06-02"));
        assert_ne!(a, fresh_start(Some("bec0972"), "2025-06-01"));
        assert!(a < DRAWN_SEEDS_BELOW && fresh_start(None, "2025-06-01") < DRAWN_SEEDS_BELOW);
        assert!(random_start() < DRAWN_SEEDS_BELOW);
    }

    #[test]
    fn mixes_name_every_kind_and_replay_through_parse() {
        let mixes = fault_mixes(&[Faults::parse("all,-kill,-give-up").unwrap()]);
        assert_eq!(mixes.len(), 1 + 12 + 12 + 1);
        assert_eq!(mix_name(mixes[0]), "all");
        assert_eq!(mix_name(mixes[1]), "kill");
        assert_eq!(mix_name(mixes[12]), "wake");
        assert_eq!(mix_name(mixes[13]), "all,-kill");
        assert_eq!(mix_name(mixes[25]), "all,-kill,-give-up");
        assert_eq!(
            mix_name(Faults::parse("callout,skew,upstream,client").unwrap()),
            "callout,skew,upstream,client"
        );
        for m in &mixes {
            assert_eq!(Faults::parse(&mix_name(*m)).unwrap(), *m);
        }
        let p = plan(100, 1_000, &mixes);
        assert_eq!(p.iter().map(|b| b.count).sum::<u64>(), 1_000);
        assert!(p[0].count >= 400 && p[1..].iter().all(|b| b.count < p[0].count));
        assert!(p.windows(2).all(|w| w[0].start + w[0].count == w[1].start));
    }

    #[test]
    fn failures_are_counted_by_invariant() {
        assert_eq!(
            invariant_of(
                r#"1: stream 0 executed ("k0", "bob", "POST /checkout") again with token 1, not larger than the earlier 2"#
            ),
            "1: stream executed again with token"
        );
        assert_eq!(
            invariant_of("6: worker 2 gave up the write of token 5 after 12 ms"),
            "6: worker gave up the write of"
        );
    }
}
