//! The model checker (`make model-check`; a bounded run in `make test`): every interleaving of a
//! small world up to a depth, not a sample of them.
//!
//! Its world is the simulation's [`World`]: the real [`filter_core::worker::Worker`] of two Envoy
//! workers, driven through the glue's interpreter (`filter_core::host::perform`), the model state
//! API calling the record rules of `state-rules`, the model upstream following the reference
//! checkout's rules. Each action is one of the simulation's own steps, taken with the plainest
//! alternative of each of its inner choices, and after each the simulation's invariants are
//! checked (`check::after_step`; after the drain, `schedule::final_answers`). stateright explores
//! the actions breadth first and recognises a world it has seen by [`World::fingerprint`].
//!
//! A state is the list of actions that leads to it (the world is rebuilt by replaying them: a
//! world holds Envoy workers, which are not cloned), with what the checker needs of the world
//! it reaches. See `docs/simulation.md`.

use crate::check;
use crate::choice::Choices;
use crate::state_api::StateApiConfig;
use crate::world::{Action, Faults, FilterParams, Op, Outage, Setup, World};
use stateright::{Checker, HasDiscoveries, Model, Property};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One step of the model: an event of the simulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Client `op` sends an attempt (its whole request) through Envoy worker `worker`.
    Attempt {
        op: usize,
        worker: usize,
    },
    /// The state API handles callout `i` (commits what it decides; the answer is on its way).
    Process(usize),
    /// Callout `i`'s answer reaches its worker.
    Deliver(usize),
    /// Callout `i`'s answer is lost after the state API committed it (the callout fails).
    LoseAnswer(usize),
    /// The state API gives callout `i`'s statement up at its stall limit: its caller is
    /// answered 503 now, and the statement (its snapshot taken now) commits at a later
    /// `Process`, nobody waiting for it.
    Stall(usize),
    /// Stream `s`'s request reaches the upstream (which executes it, or refuses its token).
    Arrive(usize),
    /// The upstream answers stream `s` (its whole response).
    Answer(usize),
    /// Envoy's router gives stream `s`'s try up (a per-try timeout, or a 5xx or reset it
    /// retries on) and sends the request upstream again, as the route's `retry_policy` says,
    /// unless the request forbids it.
    RouterRetry(usize),
    /// Execution `e` finishes after its caller left.
    Finish(usize),
    /// The client of stream `s` gives up.
    GiveUp(usize),
    /// Time runs to worker `w`'s next tick, which sends its heartbeats (and due writes); their
    /// answers come later, as separate steps.
    Tick(usize),
    /// Worker `w` cannot reach the state API for a lease (a partition): its calls fail before
    /// they get there, while it ticks on time (the other worker's calls go on).
    Partition(usize),
    /// Worker `w` wakes (it asked to).
    Wake(usize),
    /// The wake worker `w` asked for is lost (Envoy could not enqueue it).
    LoseWake(usize),
    /// A lease's time passes (workers tick on time, their callouts answered at once).
    WaitLease,
    /// A retention's time passes (likewise).
    WaitRetention,
    Kill(usize),
    Restart(usize),
    /// An operator releases, purges or resolves, without force, a record whose outcome is
    /// unknown (or whose lease ran out).
    Operator(Admin),
    /// The database restarts (a failover: `serving_since` moves when it is back, a lease later).
    Failover,
    /// Time runs to the end of the database's outage, and no further: the state API serves
    /// again before any worker's tick at that instant.
    OutageEnds,
    /// Worker `w`'s wall clock steps two minutes back.
    ClockStep(usize),
    /// The state API's purge.
    Purge,
    /// The key secret rotates.
    Rotate,
    /// The previous key secret is dropped (once the longest retention, the unknown horizon and
    /// a lease have passed: `World::previous_secret_may_go`).
    DropPrevious,
    /// Faults end, every callout is delivered, every lease runs out, every client retries once
    /// more: the invariants on final answers are checked.
    Drain,
}

/// What an operator does through the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Admin {
    Release,
    Purge,
    /// Stores an outcome the operator established.
    Resolve,
}

impl Admin {
    /// The world's draws that choose this action (`World::operator_action`: the record, then
    /// release or not, then resolve or purge).
    fn choices(self) -> Vec<u32> {
        match self {
            Admin::Release => vec![0, 99],
            Admin::Resolve => vec![0, 0, 99],
            Admin::Purge => vec![0, 0, 0],
        }
    }
}

/// Which kinds of step the model may take, and how many of the rarer ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The route's path (`/checkout` reconciles unknown outcomes, `/pay/x` re-executes them).
    pub path: &'static str,
    /// Attempts per client (the first and its retries).
    pub attempts: u32,
    pub clients: usize,
    /// Worker deaths in a run.
    pub kills: u32,
    pub lose_answers: bool,
    pub give_up: bool,
    /// A worker cut off from the state API for a lease, once in a run.
    pub partition: bool,
    /// Ticks as steps of their own (heartbeats answered later), and a lease's time passing.
    pub tick: bool,
    pub wait_lease: bool,
    pub operator: bool,
    pub failover: bool,
    pub clock_step: bool,
    pub purge: bool,
    pub rotate: bool,
    pub drain: bool,
    /// Callouts time out after one and a half leases (not one): a claim's answer may come a
    /// lease late.
    pub slow_callouts: bool,
    /// The second client sends another body under the same key (a 422, unless the key was
    /// freed between them).
    pub other_body: bool,
    /// The route carries a `retry_policy` (Envoy's router may send a forwarded request again).
    pub router_retries: bool,
    /// The state API may give a statement up at its stall limit (answer 503, commit later).
    pub stalls: bool,
    /// Claims ask to wait for a running key (`Prefer: wait=1`), and the state API lets them.
    pub waits: bool,
    /// The upstream refuses a lower token at the record address (the reference does); off,
    /// it fences per request only.
    pub address_fence: bool,
    /// The second client is another subject (bob) with the same key and body, and the
    /// upstream's reconcile answers carelessly with his execution (issue 46, finding 6).
    pub careless_upstream: bool,
    /// A callback sends one local reply, the rest wait for a wake or a tick, and a wake may be
    /// lost (issue 46, finding 7).
    pub lost_wakes: bool,
}

impl Bounds {
    /// Two clients of one key, two retries each, every kind of fault.
    pub const FULL: Bounds = Bounds {
        path: "/checkout",
        attempts: 3,
        clients: 2,
        kills: 1,
        lose_answers: true,
        give_up: true,
        partition: true,
        tick: true,
        wait_lease: true,
        operator: true,
        failover: true,
        clock_step: true,
        purge: true,
        rotate: true,
        drain: true,
        slow_callouts: false,
        other_body: false,
        router_retries: true,
        stalls: true,
        waits: false,
        address_fence: true,
        careless_upstream: false,
        lost_wakes: false,
    };
}

/// The model: its bounds (and the world every run starts from).
#[derive(Debug, Clone)]
pub struct Protocol {
    pub bounds: Bounds,
}

/// Milliseconds of the model's lease, heartbeat period and retention.
pub const LEASE_MS: u64 = 1_000;
pub const HEARTBEAT_MS: u64 = 500;
pub const RETENTION_S: u64 = 5;
/// How long the model's state API keeps an unknown outcome: past a retention, so that a
/// claim at the retention finds it still unknown (and, with the fix undone, new).
pub const UNKNOWN_RETENTION_MS: u64 = 20_000;

impl Protocol {
    pub fn new(bounds: Bounds) -> Self {
        Self { bounds }
    }

    /// The world every run starts from: two workers, `clients` clients of one key on one route,
    /// the shortest lease with heartbeats at half of it, a retention of a second.
    pub fn world(&self) -> World {
        let retention_ms = RETENTION_S * 1000;
        let callout_timeout_ms = if self.bounds.slow_callouts {
            LEASE_MS * 3 / 2
        } else {
            1_000
        };
        let setup = Setup {
            filter_config: FilterParams {
                callout_timeout_ms,
                reconcile_timeout_ms: 1_000,
                retention_s: Some(RETENTION_S),
                complete_retry_ms: 600_000,
                max_stored: 100,
                lease_ms: LEASE_MS,
                heartbeat_ms: HEARTBEAT_MS,
                cache: true,
                background: false,
                max_waiters: if self.bounds.waits { 8 } else { 0 },
                tight_buffers: false,
            }
            .config(),
            workers: 2,
            lease_ms: LEASE_MS,
            heartbeat_ms: HEARTBEAT_MS,
            callout_timeout_ms,
            reconcile_timeout_ms: 1_000,
            retention_s: Some(RETENTION_S),
            route_timeout_ms: 60_000,
            route_retries: self.bounds.router_retries,
            idle_timeout_ms: 300_000,
            request_timeout_ms: None,
            max_stream_duration_ms: None,
            max_stored_body_bytes: 100,
            complete_retry_ms: 600_000,
            replies_per_callback: if self.bounds.lost_wakes {
                1
            } else {
                filter_core::host::REPLIES_PER_CALLBACK
            },
            state_api: StateApiConfig {
                default_lease_ms: 30_000,
                max_lease_ms: crate::state_api::MAX_LEASE_MS,
                retention_ms,
                max_retention_ms: retention_ms,
                unknown_retention_ms: UNKNOWN_RETENTION_MS,
                max_body_bytes: 1 << 20,
                advertises_max_body: true,
                retry_after_cap_s: 2,
                max_waiters: if self.bounds.waits { 8 } else { 0 },
                max_wait_ms: 30_000,
            },
            kinds: Faults(0),
        };
        let ops = (0..self.bounds.clients)
            .map(|i| Op {
                key: "k1".into(),
                key_in_body: false,
                subject: if self.bounds.careless_upstream && i == 1 {
                    "bob".into()
                } else {
                    "alice".into()
                },
                path: self.bounds.path.into(),
                body: if self.bounds.other_body && i == 1 {
                    br#"{"amount":8}"#.to_vec()
                } else {
                    br#"{"amount":7}"#.to_vec()
                },
                content_type: "application/json".into(),
                attempts_left: self.bounds.attempts,
                active: None,
                next_at: 0,
                wait_s: u32::from(self.bounds.waits).into(),
            })
            .collect();
        let c = Choices::replay(Vec::new());
        let mut w = World::build(c, setup, ops, Faults(0), &check::Checks);
        w.careless_upstream = self.bounds.careless_upstream;
        if !self.bounds.address_fence {
            w.upstream.attempts = std::mem::take(&mut w.upstream.attempts).without_address_fence();
        }
        w
    }

    /// The world `steps` lead to.
    pub fn replay(&self, steps: &[Step]) -> World {
        let mut w = self.world();
        for s in steps {
            apply(&mut w, *s);
        }
        w
    }

    /// A state: the world `steps` lead to, summed up.
    fn state(&self, steps: Vec<Step>) -> State {
        let w = self.replay(&steps);
        let mut once = 0u16;
        let mut kills = 0u32;
        for s in &steps {
            match s {
                Step::Operator(_) => once |= 1,
                Step::Failover => once |= 2,
                Step::ClockStep(_) => once |= 4,
                Step::Partition(_) => once |= 8,
                Step::Kill(_) => kills += 1,
                _ => {}
            }
        }
        let mut seen = 0u8;
        if w.reached.contains_key("idempotency.replayed") {
            seen |= SEEN_REPLAY;
        }
        if w.reached.contains_key("idempotency.outcome_unknown") {
            seen |= SEEN_UNKNOWN;
        }
        if w.reached
            .keys()
            .any(|k| k.starts_with("idempotency.reconcile_"))
        {
            seen |= SEEN_RECONCILE;
        }
        if w.trace.iter().any(|l| l.contains(r#""reclaimed":true"#)) {
            seen |= SEEN_TAKEOVER;
        }
        let drained = steps.last() == Some(&Step::Drain);
        let enabled = if drained || !w.violations.is_empty() {
            Vec::new()
        } else {
            self.enabled(&w, once, kills)
        };
        State(Arc::new(Summary {
            fingerprint: w.fingerprint(),
            once,
            kills,
            drained,
            violations: w.violations.clone(),
            seen,
            enabled,
            steps,
        }))
    }

    /// The steps `w` may take next within the bounds.
    fn enabled(&self, w: &World, once: u16, kills: u32) -> Vec<Step> {
        let b = &self.bounds;
        let mut out = Vec::new();
        let alive: Vec<usize> = (0..w.workers.len())
            .filter(|i| w.workers[*i].w.is_some())
            .collect();
        // Symmetry: the clients are alike, and so are the workers (until they differ), so a
        // client (a worker) is used only once the one before it has been.
        let used = |i: usize| w.workers[i].next_sid > 0 || w.workers[i].generation > 0;
        let alive: Vec<usize> = alive
            .into_iter()
            .filter(|i| *i == 0 || used(i - 1))
            .collect();
        for (op, o) in w.ops.iter().enumerate() {
            let started = |k: usize| w.ops[k].attempts_left < b.attempts;
            if o.attempts_left > 0 && o.next_at <= w.now && (op == 0 || started(op - 1)) {
                for worker in &alive {
                    out.push(Step::Attempt {
                        op,
                        worker: *worker,
                    });
                }
            }
        }
        for (i, c) in w.callouts.iter().enumerate() {
            if b.stalls
                && c.answer.is_none()
                && !c.orphan
                && (c.parked.is_none() || b.waits)
                && c.cluster == STATE_API_CLUSTER
                && c.path != contract::wire::HEARTBEAT_PATH
            {
                out.push(Step::Stall(i));
            }
            if c.answer.is_none() {
                out.push(Step::Process(i));
            } else if !c.orphan {
                out.push(Step::Deliver(i));
                if b.lose_answers {
                    out.push(Step::LoseAnswer(i));
                }
            }
        }
        for (i, s) in w.streams.iter().enumerate() {
            if s.in_transit {
                out.push(Step::Arrive(i));
            }
            if s.forwarded.is_some() && !s.ended && !s.resp_end_seen && !s.router_reply {
                out.push(Step::Answer(i));
            }
            if b.give_up && !s.ended && !s.client.complete {
                out.push(Step::GiveUp(i));
            }
            if b.router_retries && s.forwarded.is_some() && w.router_may_retry(i) {
                out.push(Step::RouterRetry(i));
            }
        }
        for (e, x) in w.upstream.executions.iter().enumerate() {
            let caller = &w.streams[x.stream];
            if !x.finished && (caller.ended || caller.router_reply) {
                out.push(Step::Finish(e));
            }
        }
        for i in 0..w.workers.len() {
            if w.workers[i].w.is_some() {
                if b.tick && w.next_tick(i).is_some() {
                    out.push(Step::Tick(i));
                }
                if w.workers[i].wake_requested {
                    out.push(Step::Wake(i));
                    if b.lost_wakes {
                        out.push(Step::LoseWake(i));
                    }
                }
                if kills < b.kills {
                    out.push(Step::Kill(i));
                }
                if b.partition && once & 8 == 0 && w.outage == Outage::None {
                    out.push(Step::Partition(i));
                }
            } else {
                out.push(Step::Restart(i));
            }
        }
        if b.wait_lease {
            out.push(Step::WaitLease);
        }
        out.push(Step::WaitRetention);
        if b.operator && once & 1 == 0 && w.outage == Outage::None {
            for admin in [Admin::Release, Admin::Purge, Admin::Resolve] {
                out.push(Step::Operator(admin));
            }
        }
        if b.failover && once & 2 == 0 && w.outage == Outage::None {
            out.push(Step::Failover);
        }
        if b.failover && w.outage != Outage::None && w.outage_until.is_some() {
            out.push(Step::OutageEnds);
        }
        if b.clock_step && once & 4 == 0 {
            out.push(Step::ClockStep(0));
        }
        if b.purge && w.outage == Outage::None {
            out.push(Step::Purge);
        }
        if b.rotate {
            let settled = w.previous_secret_may_go();
            if settled && w.api.secret < 2 {
                out.push(Step::Rotate);
            }
            if settled && w.api.previous_secret.is_some() {
                out.push(Step::DropPrevious);
            }
        }
        if b.drain {
            out.push(Step::Drain);
        }
        out
    }
}

/// Carries out `step` on `w` (each inner choice its plainest alternative), then checks the
/// simulation's invariants.
pub fn apply(w: &mut World, step: Step) {
    w.c = Choices::replay(Vec::new());
    // (A path written by hand may name a callout, stream or execution that is not there: the
    // step does nothing then, as the checker never takes it.)
    let exists = match step {
        Step::Process(i) | Step::Deliver(i) | Step::LoseAnswer(i) | Step::Stall(i) => {
            i < w.callouts.len()
        }
        Step::Arrive(s) | Step::Answer(s) | Step::GiveUp(s) | Step::RouterRetry(s) => {
            s < w.streams.len()
        }
        Step::Finish(e) => e < w.upstream.executions.len(),
        _ => true,
    };
    if !exists {
        w.log(format!("(model step {step:?}: nothing there)"));
        return;
    }
    match step {
        Step::Attempt { op, worker } => {
            let before = w.streams.len();
            w.new_attempt(op, Some(worker));
            if w.streams.len() > before {
                let s = before;
                for _ in 0..16 {
                    let st = &w.streams[s];
                    if st.ended || st.parts_sent >= st.request_parts() || st.client.status.is_some()
                    {
                        break;
                    }
                    w.send_part(s);
                }
            }
        }
        Step::Process(i) => w.act(Action::Process(i)),
        Step::Deliver(i) => w.act(Action::Deliver(i)),
        Step::LoseAnswer(i) => w.fail_callout(i),
        Step::Stall(i) => w.fail_callout_with(i, "503"),
        Step::Arrive(s) => w.act(Action::Arrive(s)),
        Step::Answer(s) => {
            for _ in 0..16 {
                let st = &w.streams[s];
                if st.forwarded.is_none() || st.ended || st.resp_end_seen || st.router_reply {
                    break;
                }
                w.upstream_part(s);
                if !w.violations.is_empty() {
                    break;
                }
            }
        }
        Step::RouterRetry(s) => {
            w.router_retry(s, "a per-try timeout");
        }
        Step::Finish(e) => w.act(Action::UpstreamFinish(e)),
        Step::GiveUp(s) => w.act(Action::GiveUp(s)),
        Step::Tick(i) => {
            if let Some(t) = w.next_tick(i) {
                tick_at(w, i, t);
            }
        }
        Step::Partition(i) => {
            // Its calls on their way fail too (the state API never sees them).
            cut_off(w, i);
            w.partitioned = Some(i);
            w.advance(w.setup.lease_ms + 1);
            w.partitioned = None;
        }
        Step::Wake(i) => w.act(Action::Wake(i)),
        Step::LoseWake(i) => w.act(Action::LoseWake(i)),
        Step::WaitLease => w.advance(w.setup.lease_ms),
        Step::WaitRetention => w.advance(w.setup.state_api.max_retention_ms + w.setup.lease_ms),
        Step::Kill(i) => w.act(Action::Kill(i)),
        Step::Restart(i) => w.act(Action::Restart(i)),
        Step::Operator(admin) => {
            w.c = Choices::replay(admin.choices());
            w.act(Action::Operator);
        }
        Step::Failover => {
            w.start_outage(Outage::Database { in_place: false }, Some(w.setup.lease_ms))
        }
        Step::OutageEnds => {
            if let Some(t) = w.outage_until {
                if t > w.now + 1 {
                    w.advance(t - 1 - w.now);
                }
                w.now = w.now.max(t);
                w.timeouts();
            }
        }
        Step::ClockStep(i) => {
            // The worker, then the third kind of step: two minutes back.
            w.c = Choices::replay(vec![i as u32, 5]);
            w.act(Action::SkewClock);
        }
        Step::Purge => w.act(Action::Purge),
        Step::Rotate => w.act(Action::RotateSecret),
        Step::DropPrevious => w.act(Action::DropPreviousSecret),
        Step::Drain => {
            w.drain();
            if w.violations.is_empty() {
                crate::schedule::final_answers(w);
            }
            return;
        }
    }
    w.steps += 1;
    w.check_step();
}

/// Time runs to `t` (the other worker ticking on time up to just before it), and worker `i`
/// ticks then, its calls left on their way.
fn tick_at(w: &mut World, i: usize, t: u64) {
    if t > w.now + 1 {
        w.advance(t - 1 - w.now);
    }
    if let Some(t) = w.next_tick(i) {
        w.now = w.now.max(t);
        w.timeouts();
        w.workers[i].ticked_at = Some(w.now);
        w.act(Action::Tick(i));
    }
}

/// Worker `i`'s calls to the state API on their way fail without reaching it.
fn cut_off(w: &mut World, i: usize) {
    let mut at = w.callouts.len();
    while at > 0 {
        at -= 1;
        let c = &w.callouts[at];
        if c.worker == i && c.cluster == STATE_API_CLUSTER && c.answer.is_none() && !c.orphan {
            w.fail_callout_with(at, "reset");
            if w.callouts
                .get(at)
                .is_some_and(|c| c.orphan && c.answer.is_none())
            {
                w.callouts.remove(at);
            }
        }
    }
}

/// The Envoy cluster of the state API in the simulated filter's configuration.
const STATE_API_CLUSTER: &str = "state_api";

const SEEN_REPLAY: u8 = 1;
const SEEN_UNKNOWN: u8 = 2;
const SEEN_RECONCILE: u8 = 4;
const SEEN_TAKEOVER: u8 = 8;

/// What the checker keeps of a world.
#[derive(Debug)]
pub struct Summary {
    pub fingerprint: u64,
    once: u16,
    kills: u32,
    pub drained: bool,
    pub violations: Vec<String>,
    seen: u8,
    enabled: Vec<Step>,
    /// The steps that lead to it.
    pub steps: Vec<Step>,
}

/// A state of the model: two are the same when their worlds' fingerprints (and the bounded
/// steps they have left) are.
#[derive(Debug, Clone)]
pub struct State(pub Arc<Summary>);

impl Hash for State {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (
            self.0.fingerprint,
            self.0.once,
            self.0.kills,
            self.0.drained,
        )
            .hash(h);
    }
}

impl PartialEq for State {
    fn eq(&self, other: &Self) -> bool {
        (
            self.0.fingerprint,
            self.0.once,
            self.0.kills,
            self.0.drained,
        ) == (
            other.0.fingerprint,
            other.0.once,
            other.0.kills,
            other.0.drained,
        )
    }
}

impl Eq for State {}

fn broke(s: &State, invariants: &[&str]) -> bool {
    s.0.violations
        .iter()
        .any(|v| invariants.iter().any(|i| v.starts_with(i)))
}

/// The `always` properties, by the simulation's invariants they stand for.
pub const ALWAYS: &[(&str, &[&str])] = &[
    (
        "at most one execution per key (on reexecute routes a later one only with a larger token)",
        &["1:", "7:"],
    ),
    (
        "every replay is an answer the upstream gave for that key and fingerprint",
        &["2:", "3:"],
    ),
    ("a key never forwarded becomes usable again", &["8:"]),
    ("a mark is never undone by an older heartbeat", &["5:"]),
    (
        "every other invariant of the simulation",
        &["4:", "6:", "9:"],
    ),
];

impl Model for Protocol {
    type State = State;
    type Action = Step;

    fn init_states(&self) -> Vec<State> {
        vec![self.state(Vec::new())]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Step>) {
        actions.extend(state.0.enabled.iter().copied());
    }

    fn next_state(&self, last: &State, action: Step) -> Option<State> {
        let mut steps = last.0.steps.clone();
        steps.push(action);
        Some(self.state(steps))
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ALWAYS[0].0, |_, s| !broke(s, ALWAYS[0].1)),
            Property::always(ALWAYS[1].0, |_, s| !broke(s, ALWAYS[1].1)),
            Property::always(ALWAYS[2].0, |_, s| !broke(s, ALWAYS[2].1)),
            Property::always(ALWAYS[3].0, |_, s| !broke(s, ALWAYS[3].1)),
            Property::always(ALWAYS[4].0, |_, s: &State| {
                // Numbered invariants above, and the final answers' (which are not numbered).
                s.0.violations.iter().all(|v| {
                    ALWAYS[..4]
                        .iter()
                        .any(|(_, inv)| inv.iter().any(|i| v.starts_with(i)))
                })
            }),
            Property::sometimes("a replay", |_, s: &State| s.0.seen & SEEN_REPLAY != 0),
            Property::sometimes("an unknown outcome", |_, s: &State| {
                s.0.seen & SEEN_UNKNOWN != 0
            }),
            Property::sometimes("a reconcile", |_, s: &State| s.0.seen & SEEN_RECONCILE != 0),
            Property::sometimes("a takeover", |_, s: &State| s.0.seen & SEEN_TAKEOVER != 0),
        ]
    }
}

/// What a run of the checker came to.
#[derive(Debug)]
pub struct Run {
    pub states: usize,
    pub unique: usize,
    pub max_depth: usize,
    pub elapsed: Duration,
    /// Each property and its counterexample (`always`) or example (`sometimes`), if found.
    pub results: Vec<(&'static str, bool, Option<Vec<Step>>)>,
}

impl Run {
    /// The `always` properties broken, with their counterexamples.
    pub fn broken(&self) -> Vec<(&'static str, &Vec<Step>)> {
        self.results
            .iter()
            .filter(|(_, always, _)| *always)
            .filter_map(|(name, _, path)| path.as_ref().map(|p| (*name, p)))
            .collect()
    }

    /// The `sometimes` properties never reached.
    pub fn unreached(&self) -> Vec<&'static str> {
        self.results
            .iter()
            .filter(|(_, always, path)| !*always && path.is_none())
            .map(|(name, ..)| *name)
            .collect()
    }

    pub fn report(&self, model: &Protocol) -> String {
        let mut out = format!(
            "model check: {} states explored ({} distinct), runs of up to {} steps, in {:.1} s\n",
            self.states,
            self.unique,
            self.max_depth,
            self.elapsed.as_secs_f64()
        );
        for (name, always, path) in &self.results {
            let verdict = match (always, path) {
                (true, None) => "holds".to_owned(),
                (true, Some(p)) => format!("BROKEN ({} steps)", p.len()),
                (false, Some(p)) => format!("reached ({} steps)", p.len()),
                (false, None) => "NOT REACHED".to_owned(),
            };
            out.push_str(&format!(
                "  {:<9} {name}: {verdict}\n",
                if *always { "always" } else { "sometimes" }
            ));
        }
        for (name, path) in self.broken() {
            out.push_str(&format!("\ncounterexample to \"{name}\":\n"));
            out.push_str(&model.render(path));
        }
        out
    }
}

impl Protocol {
    /// A readable trace of `steps`: the model's steps, then the simulation's trace of them.
    pub fn render(&self, steps: &[Step]) -> String {
        let mut out = String::from("  steps:\n");
        for (i, s) in steps.iter().enumerate() {
            out.push_str(&format!("    {:>2}. {s:?}\n", i + 1));
        }
        let w = self.replay(steps);
        if let Some(v) = w.violations.first() {
            out.push_str(&format!("  violation: {v}\n"));
        }
        out.push_str("  trace:\n");
        for line in &w.trace {
            out.push_str(&format!("    {line}\n"));
        }
        out
    }

    /// The shortest counterexample within `max_steps` steps: [`Protocol::check`] to one more
    /// step at a time (stateright records the last counterexample of the block of states it
    /// was checking, not the shortest, so the bound is raised until one turns up). The run's
    /// time is the whole search's.
    pub fn shortest_counterexample(&self, max_steps: usize, threads: usize) -> Run {
        let began = Instant::now();
        let mut states = 0;
        let mut steps = 1;
        loop {
            let mut run = self.check(steps, threads, true);
            states += run.states;
            if !run.broken().is_empty() || steps >= max_steps {
                run.states = states;
                run.elapsed = began.elapsed();
                return run;
            }
            steps += 1;
        }
    }

    /// Explores every interleaving of up to `max_steps` steps breadth first on `threads`
    /// threads (stopping at the first broken property when `stop_at_failure`).
    pub fn check(&self, max_steps: usize, threads: usize, stop_at_failure: bool) -> Run {
        let began = Instant::now();
        let mut builder = self
            .clone()
            .checker()
            // stateright's depth counts the initial state, and checks the states short of it.
            .target_max_depth(max_steps + 2)
            .threads(threads);
        if stop_at_failure {
            builder = builder.finish_when(HasDiscoveries::AnyFailures);
        }
        let checker = builder.spawn_bfs().join();
        let discoveries = checker.discoveries();
        let results = self
            .properties()
            .iter()
            .map(|p| {
                let always = matches!(p.expectation, stateright::Expectation::Always);
                let path = discoveries
                    .get(p.name)
                    .map(|path| path.last_state().0.steps.clone());
                (p.name, always, path)
            })
            .collect();
        Run {
            states: checker.state_count(),
            unique: checker.unique_state_count(),
            // (It counts the initial state, and the states at the bound it skips.)
            max_depth: checker.max_depth().saturating_sub(2),
            elapsed: began.elapsed(),
            results,
        }
    }
}

/// A fix by the name `make model-check UNDO=…` gives it.
pub fn fix_named(name: &str) -> Result<state_rules::undo::Fix, String> {
    state_rules::undo::Fix::named(name).ok_or_else(|| {
        let names: Vec<&str> = state_rules::undo::Fix::ALL
            .iter()
            .map(|f| f.name())
            .collect();
        format!("no fix named {name} ({})", names.join(", "))
    })
}

/// Bounds under which the model checker shows a fix of issue 34 is needed: only the kinds of
/// step its counterexample takes are on (each counterexample is deeper than the full bounds
/// reach in reasonable time), everything else as in [`Bounds::FULL`].
pub fn bounds_for(fix: state_rules::undo::Fix) -> Bounds {
    use state_rules::undo::Fix;
    let quiet = Bounds {
        path: "/checkout",
        attempts: 1,
        clients: 2,
        kills: 0,
        lose_answers: false,
        give_up: false,
        partition: false,
        tick: false,
        wait_lease: false,
        operator: false,
        failover: false,
        clock_step: false,
        purge: false,
        rotate: false,
        drain: false,
        slow_callouts: false,
        other_body: false,
        router_retries: false,
        stalls: false,
        waits: false,
        address_fence: true,
        careless_upstream: false,
        lost_wakes: false,
    };
    match fix {
        // An owner that runs past its retention, cut off from the state API for a lease, and a
        // duplicate.
        // The purge deletes it (a retry is a new key then, on any route).
        Fix::Retention => Bounds {
            partition: true,
            purge: true,
            ..quiet
        },
        // A claim answer lost, the key retried after the drain, on a route that holds unknown
        // outcomes (one that reconciles asks the upstream, and goes on).
        Fix::Abandon => Bounds {
            path: "/refunds",
            clients: 1,
            lose_answers: true,
            drain: true,
            ..quiet
        },
        // A heartbeat in flight while its owner's client gives up.
        Fix::HeartbeatRevival => Bounds {
            clients: 1,
            give_up: true,
            tick: true,
            ..quiet
        },
        // The key secret rotated under a running owner, then dropped, and a duplicate.
        Fix::RotationMove => Bounds {
            rotate: true,
            ..quiet
        },
        // A claim's answer a lease late, an operator's release meanwhile, another body under
        // the same key, and an upstream that fences per request only (the reference's fence at
        // the record address would refuse the late token: the edge must not need it).
        Fix::LateGrant => Bounds {
            address_fence: false,
            wait_lease: true,
            operator: true,
            slow_callouts: true,
            other_body: true,
            ..quiet
        },
        // An owner cut off by a database outage, an operator's release as it comes back.
        Fix::OperatorServing => Bounds {
            operator: true,
            failover: true,
            ..quiet
        },
        // An operator's resolve while the owner is cut off, the owner's complete, and a
        // duplicate on its worker.
        Fix::ResolveToken => Bounds {
            clients: 2,
            partition: true,
            operator: true,
            ..quiet
        },
        // An unknown outcome (the client left while the upstream ran, on a route that holds
        // them), a retention later.
        Fix::UnknownHorizon => Bounds {
            path: "/refunds",
            give_up: true,
            ..quiet
        },
        // A route with a retry_policy: the router sends a forwarded request again.
        Fix::RouterRetries => Bounds {
            clients: 1,
            router_retries: true,
            ..quiet
        },
        // A claim's statement given up at the stall limit, its caller's abandon, then its
        // commit; the key retried after the drain.
        Fix::NonceConflict => Bounds {
            path: "/refunds",
            clients: 1,
            tick: true,
            stalls: true,
            drain: true,
            ..quiet
        },
        // A claim waiting for a running key whose owner's client gave up; its look given up at
        // the stall limit; the key retried after the drain (on a route that holds unknown
        // outcomes).
        Fix::WaitLook => Bounds {
            path: "/refunds",
            give_up: true,
            tick: true,
            stalls: true,
            waits: true,
            drain: true,
            ..quiet
        },
        // Another subject's identical request executed; this one's client left while it ran
        // (unknown, on a route that reconciles), and the upstream's reconcile answers with the
        // other subject's execution.
        Fix::ReconcileScope => Bounds {
            attempts: 2,
            give_up: true,
            careless_upstream: true,
            ..quiet
        },
        // Three clients of one key on one worker, two waiting for the first (Prefer: wait);
        // its completion answers both in one callback, whose bound is one reply: the other
        // waits for a wake, which is lost.
        Fix::TickDrain => Bounds {
            clients: 3,
            tick: true,
            waits: true,
            drain: true,
            lost_wakes: true,
            ..quiet
        },
    }
}
