//! A deterministic simulation of the filter (`make simulate`; a short run in `make test`).
//!
//! It drives the real [`filter_core::worker::Worker`] of several Envoy workers against a model
//! state API ([`state_api`]), a model upstream ([`upstream`]) and clients that retry, change
//! their request, give up at any point or see their Envoy die ([`world`]). A seed picks one
//! schedule; the same seed replays the same run. After every step the invariants of
//! [`check`] hold, or the run stops with the violation and a readable trace, which
//! [`shrink`] makes as short as it can. See `docs/simulation.md`.

pub mod check;
pub mod choice;
pub mod driver;
pub mod state_api;
pub mod upstream;
pub mod world;

use choice::Choices;
pub use world::Faults;
use world::World;

/// Random steps of one schedule before it is drained.
pub const STEPS: usize = 120;

/// What one run came to.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The first invariant broken, if any.
    pub violation: Option<String>,
    pub trace: Vec<String>,
    /// Every choice the run took (replaying them replays the run).
    pub choices: Vec<u32>,
    pub steps: usize,
    /// What the run reached (the filter's counters by name, the model's events).
    pub reached: std::collections::BTreeMap<&'static str, u64>,
}

impl Outcome {
    /// The violation without its numbers (stream indices, tokens, statuses, times): shrinking
    /// keeps to runs that break the invariant the same way, not just the same invariant.
    pub fn class(&self) -> Option<String> {
        self.violation
            .as_deref()
            .map(|v| v.chars().filter(|c| !c.is_ascii_digit()).collect())
    }
}

/// A schedule's parameters: the random steps before draining, and the faults it may inject.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    pub steps: usize,
    pub faults: Faults,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            steps: STEPS,
            faults: Faults::ALL,
        }
    }
}

pub fn run(choices: Choices, p: Params) -> Outcome {
    let mut w = World::new(choices, p.faults);
    w.run(p.steps);
    Outcome {
        violation: w.violations.first().cloned(),
        trace: std::mem::take(&mut w.trace),
        choices: w.c.taken.clone(),
        steps: w.steps,
        reached: std::mem::take(&mut w.reached),
    }
}

pub fn run_seed(seed: u64, p: Params) -> Outcome {
    run(Choices::seeded(seed), p)
}

pub fn replay(list: Vec<u32>, p: Params) -> Outcome {
    run(Choices::replay(list), p)
}

/// Shrinks a failing run: removes runs of choices and lowers choices while the same invariant
/// still breaks, within `budget` replays. Returns the shortest failing run found.
pub fn shrink(failing: &Outcome, p: Params, budget: usize) -> Outcome {
    let Some(class) = failing.class() else {
        return failing.clone();
    };
    let mut best = failing.clone();
    let mut tries = 0;
    let still_fails = |o: &Outcome| o.class().as_deref() == Some(class.as_str());
    let mut chunk = (best.choices.len() / 2).max(1);
    while chunk >= 1 && tries < budget {
        let mut i = 0;
        let mut improved = false;
        while i < best.choices.len() && tries < budget {
            let mut list = best.choices.clone();
            let end = (i + chunk).min(list.len());
            list.drain(i..end);
            tries += 1;
            let o = replay(list, p);
            if still_fails(&o) && o.trace.len() <= best.trace.len() {
                best = o;
                improved = true;
            } else {
                i += chunk;
            }
        }
        if !improved {
            chunk /= 2;
        }
    }
    // Lower each choice (0 is the plainest alternative of every decision).
    let mut i = 0;
    while i < best.choices.len() && tries < budget {
        if best.choices[i] > 0 {
            for v in [0, best.choices[i] / 2] {
                let mut list = best.choices.clone();
                list[i] = v;
                tries += 1;
                let o = replay(list, p);
                if still_fails(&o) && o.trace.len() <= best.trace.len() {
                    best = o;
                    break;
                }
            }
        }
        i += 1;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_the_same_run_and_its_choices_replay_it_too() {
        let p = Params::default();
        for seed in [1, 7, 14_292] {
            let a = run_seed(seed, p);
            let b = run_seed(seed, p);
            assert_eq!(a.trace, b.trace, "seed {seed}");
            assert_eq!(a.choices, b.choices);
            let again = replay(a.choices.clone(), p);
            assert_eq!(
                again.trace, a.trace,
                "the recorded choices replay seed {seed}"
            );
        }
    }

    #[test]
    fn faults_are_named_added_and_removed() {
        assert_eq!(Faults::parse("all").unwrap(), Faults::ALL);
        let f = Faults::parse("all,-kill,-give-up").unwrap();
        assert!(!f.has(Faults::KILL) && !f.has(Faults::GIVE_UP) && f.has(Faults::CALLOUT));
        assert_eq!(f.to_string(), "api-down,callout,skew,upstream,client");
        assert!(Faults::parse("kill,nonsense").is_err());
        // Without faults nothing is killed and nobody gives up.
        let o = run_seed(
            3,
            Params {
                steps: STEPS,
                faults: Faults(0),
            },
        );
        assert!(o.violation.is_none());
        assert!(!o.reached.contains_key("sim.worker_killed"));
        assert!(!o.reached.contains_key("sim.client_gave_up"));
    }
}
