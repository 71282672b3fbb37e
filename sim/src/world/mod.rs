//! One schedule: Envoy workers running the real [`Worker`], a model state API, a model upstream
//! and clients, with a model of what Envoy does around the filter (buffering, resuming, local
//! replies, the router's own answers, cancelled callouts, a worker's death). Every decision comes
//! from [`Choices`]; after every step, and at each event they judge, the world is checked by
//! the [`Invariants`] it was made with (`crate::check`'s), which read it and name what they
//! find broken: the world records it and never names the checks.
//!
//! This file is the container (the world's state, and what every part of it uses); each job
//! has a file of its own.

mod api;
mod callouts;
mod clients;
mod clock;
mod envoy;
mod evidence;
mod faults;
mod forwarding;
mod host;
mod outages;
mod setup;
mod steps;
mod workers;

pub use callouts::{describe, Callout, Parked};
pub use clients::{ClientView, Op, Stream, CLIENT_TOKEN};
pub use evidence::{Evidence, Freed};
pub use faults::{Faults, Outage, PULSE_SILENCE_MS};
pub use setup::{FilterParams, Setup};
pub(crate) use steps::Action;
pub use workers::SimWorker;

use crate::choice::Choices;
use crate::state_api::{ModelStateApi, Scope};
use crate::upstream::Upstream;
use filter_core::config::Config;
use std::collections::BTreeSet;
use workers::{new_worker, steady_origin};

/// The invariants, as the world meets the events they judge: each reads the world at that moment
/// and returns the violations it finds (none: it holds), which the world records. `crate::check`
/// holds them; the world calls them through this, so that it never names the checks.
pub trait Invariants: Sync {
    /// After every step (the worker's memory within its bounds).
    fn after_step(&self, w: &World) -> Vec<String>;
    /// A request reaches the upstream on a protected route (`stream` is its attempt), before its
    /// execution is recorded.
    fn execution(&self, w: &World, scope: &Scope, token: Option<i64>, stream: usize)
        -> Vec<String>;
    /// A request reaches the upstream on an unprotected route, with these headers.
    fn unprotected(&self, w: &World, headers: &[(String, String)], stream: usize) -> Vec<String>;
    /// Execution `e` charged (the reference upstream committed it).
    fn charge(&self, w: &World, e: usize) -> Vec<String>;
    /// Stream `s`'s client has its whole answer.
    fn answered(&self, w: &World, s: usize) -> Vec<String>;
    /// The state API found the lease of `token` run out.
    fn lapse(&self, w: &World, token: i64, scope: &Scope, lease_ms: u64, by: &str) -> Vec<String>;
    /// A heartbeat of `token` sent at dispatch `sent` made its unknown record in progress again.
    fn heartbeat_after_mark(&self, w: &World, token: i64, sent: u64) -> Vec<String>;
    /// Worker `wi` gave up a write of `token` because `complete_retry_ms` passed on its clock.
    fn gave_up(&self, w: &World, wi: usize, token: i64) -> Vec<String>;
}

pub struct World {
    pub(crate) c: Choices,
    pub(crate) now: u64,
    pub(crate) setup: Setup,
    pub(crate) cfg: Config,
    pub(crate) workers: Vec<SimWorker>,
    pub(crate) api: ModelStateApi,
    /// What of the state API is out, if anything (and when it started).
    pub(crate) outage: Outage,
    outage_since: u64,
    /// When the current outage ends by itself (a database back from its recovery or pause).
    pub(crate) outage_until: Option<u64>,
    /// Dispatches and writes in the order they happen (several happen at one instant).
    pub(crate) seq: u64,
    /// When the key secret last rotated.
    pub(crate) rotated_at: Option<u64>,
    /// What the invariants remember of the run.
    pub(crate) ev: Evidence,
    /// What judges the world at each event (`crate::check`).
    invariants: &'static dyn Invariants,
    pub(crate) callouts: Vec<Callout>,
    pub(crate) streams: Vec<Stream>,
    pub(crate) upstream: Upstream,
    pub(crate) upstream_down: bool,
    pub(crate) ops: Vec<Op>,
    pub(crate) trace: Vec<String>,
    pub violations: Vec<String>,
    /// Tokens released by the state API: a re-execution after one is allowed.
    pub(crate) released: BTreeSet<i64>,
    /// Scopes a complete of which the state API refused (their outcome may be stored as its
    /// status alone).
    pub(crate) refused_completes: BTreeSet<Scope>,
    /// Whether faults may still be injected (off while draining).
    faults: bool,
    /// Inside a quiet tick: routine heartbeats are not traced.
    quiet: bool,
    pub(crate) kinds: Faults,
    /// A worker that cannot reach the state API (the model checker's partition): its calls
    /// fail at dispatch.
    pub(crate) partitioned: Option<usize>,
    /// The model checker's careless upstream: its reconcile answers with another subject's
    /// execution of an identical request whenever one exists (the simulation's does so by
    /// chance, with upstream faults).
    pub careless_upstream: bool,
    pub(crate) steps: usize,
    /// What the run reached: the filter's counters (by name) and the model's own events.
    pub(crate) reached: std::collections::BTreeMap<&'static str, u64>,
}

/// Where effects are carried out (the host's [`HostCurrent`], by stream index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Current {
    Request(usize),
    Response(usize),
    Stream(usize),
    Root(usize),
}

/// The global time a run starts at.
const START_MS: u64 = 1_000;
/// The cluster of the upstream (its reconcile endpoint is asked through it).
const UPSTREAM_CLUSTER: &str = "upstream";

impl World {
    /// A world of `setup`'s workers and clients `ops`, with faults of `kinds` (those of `setup`
    /// among them), its further choices from `c`, judged by `invariants`.
    pub fn build(
        c: Choices,
        setup: Setup,
        ops: Vec<Op>,
        kinds: Faults,
        invariants: &'static dyn Invariants,
    ) -> Self {
        let kinds = Faults(kinds.0 & setup.kinds.0);
        let cfg = match Config::parse(setup.filter_config.as_bytes()) {
            Ok(cfg) => cfg,
            Err(e) => panic!("the simulation's filter configuration is refused: {e}"),
        };
        let workers = (0..setup.workers)
            .map(|i| SimWorker {
                w: Some(new_worker(&cfg, i, 0)),
                ticked_at: None,
                generation: 0,
                skew_ms: 0,
                steady_ms: steady_origin(i, 0),
                wake_requested: false,
                next_sid: 0,
            })
            .collect();
        let api = ModelStateApi::new(setup.state_api.clone());
        Self {
            c,
            now: START_MS,
            setup,
            cfg,
            workers,
            api,
            outage: Outage::None,
            outage_since: 0,
            outage_until: None,
            seq: 0,
            rotated_at: None,
            ev: Evidence::default(),
            invariants,
            callouts: Vec::new(),
            streams: Vec::new(),
            upstream: Upstream::default(),
            upstream_down: false,
            ops,
            trace: Vec::new(),
            violations: Vec::new(),
            released: BTreeSet::new(),
            refused_completes: BTreeSet::new(),
            faults: true,
            quiet: false,
            kinds,
            partitioned: None,
            careless_upstream: false,
            steps: 0,
            reached: std::collections::BTreeMap::new(),
        }
    }

    pub(crate) fn reach(&mut self, event: &'static str) {
        *self.reached.entry(event).or_default() += 1;
    }

    fn fault(&self, kind: u32) -> bool {
        self.faults && self.kinds.has(kind)
    }

    pub fn log(&mut self, line: String) {
        self.trace.push(format!("{:>8} {line}", self.now));
    }

    /// Worker `w`'s time: the host's monotonic clock, which no wall clock step moves.
    fn worker_now(&self, w: usize) -> u64 {
        self.now + self.workers[w].steady_ms
    }

    /// The global time the run started at.
    pub fn started_at(&self) -> u64 {
        START_MS
    }

    /// Records what the invariants found broken.
    fn found(&mut self, violations: Vec<String>) {
        self.violations.extend(violations);
    }

    /// The check after every step: what each worker holds noted, then the invariants judge.
    pub fn check_step(&mut self) {
        self.note_holdings();
        let found = self.invariants.after_step(self);
        self.found(found);
    }

    /// How a body of `len` bytes arrives: whole, or cut in two at a drawn byte.
    fn chunks_of(&mut self, len: usize) -> Vec<usize> {
        if len == 0 {
            Vec::new()
        } else if self.c.chance(50) {
            vec![len]
        } else {
            let cut = (1 + self.c.below(len as u32) as usize).min(len);
            if cut >= len {
                vec![len]
            } else {
                vec![cut, len - cut]
            }
        }
    }

    /// The next number of the run's order of dispatches and writes.
    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// What the world's future depends on, as one number: every part of it but its trace, its
    /// choices and what it reached (the model checker's states: two worlds with the same
    /// fingerprint go on alike). The reference checkout's record of attempts is left out (a
    /// hash map, printed in no fixed order): the executions it decided are in.
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let workers: Vec<_> = self
            .workers
            .iter()
            .map(|w| {
                (
                    &w.w,
                    w.ticked_at,
                    w.generation,
                    w.skew_ms,
                    w.wake_requested,
                    w.next_sid,
                )
            })
            .collect();
        let text = format!(
            "{:?}",
            (
                (
                    self.now,
                    &workers,
                    &self.api,
                    self.outage,
                    self.outage_since,
                    self.outage_until
                ),
                (
                    self.seq,
                    self.rotated_at,
                    &self.ev,
                    &self.callouts,
                    &self.streams
                ),
                (
                    &self.upstream.executions,
                    &self.upstream.refused,
                    self.upstream_down
                ),
                (
                    &self.ops,
                    &self.violations,
                    &self.released,
                    &self.refused_completes
                ),
                (self.faults, self.kinds, self.partitioned),
            )
        );
        let mut h = std::collections::hash_map::DefaultHasher::new();
        text.hash(&mut h);
        h.finish()
    }
}

/// The `type` of a problem+json body (empty when it is none).
pub fn problem_type(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_default()
}
