//! One schedule: Envoy workers running the real [`Worker`], a model state API, a model upstream
//! and clients, with a model of what Envoy does around the filter (buffering, resuming, local
//! replies, the router's own answers, cancelled callouts, a worker's death). Every decision comes
//! from [`Choices`]; after every step the invariants are checked ([`crate::check`]).

use crate::check;
use crate::choice::Choices;
use crate::state_api::{Address, Event, ModelStateApi, Scope, StateApiConfig};
use crate::upstream::{Ending, Execution, Plan, Produced, Sent, Upstream};
use contract::wire::{CLAIM_PATH, FENCING_TOKEN_HEADER, WRITES_PATH};
use contract::ProblemKind;
use filter_core::config::Config;
use filter_core::flow::{RequestHead, ResponseHead, Verdict};
use filter_core::host::{Current as HostCurrent, Host};
use filter_core::metrics::Metric;
use filter_core::outcome::flags;
use filter_core::reply::LocalReply;
use filter_core::worker::{
    CallId, CalloutResult, Dispatch, Effect, Level, Owner, StreamId, Worker,
};
use std::collections::BTreeSet;

/// The kinds of fault a schedule may inject (all by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Faults(pub u32);

impl Faults {
    pub const KILL: u32 = 1;
    pub const GIVE_UP: u32 = 2;
    pub const API_DOWN: u32 = 4;
    pub const CALLOUT: u32 = 8;
    pub const SKEW: u32 = 16;
    pub const UPSTREAM: u32 = 32;
    pub const CLIENT: u32 = 64;
    /// The database: crash recovery in place, a restart, a pause (each longer than a lease or
    /// not).
    pub const DATABASE: u32 = 128;
    /// Envoy answers a forwarded request itself (408, 413, 503, 504, a reset).
    pub const ENVOY: u32 = 256;
    /// The key secret is rotated (and the previous one dropped) mid-run.
    pub const ROTATE: u32 = 512;
    /// An operator releases or purges a record through the admin API, without force.
    pub const OPERATOR: u32 = 1024;
    pub const ALL: Faults = Faults(2047);
    const NAMES: [(&'static str, u32); 11] = [
        ("kill", Self::KILL),
        ("give-up", Self::GIVE_UP),
        ("api-down", Self::API_DOWN),
        ("callout", Self::CALLOUT),
        ("skew", Self::SKEW),
        ("upstream", Self::UPSTREAM),
        ("client", Self::CLIENT),
        ("database", Self::DATABASE),
        ("envoy", Self::ENVOY),
        ("rotate", Self::ROTATE),
        ("operator", Self::OPERATOR),
    ];

    pub fn has(self, f: u32) -> bool {
        self.0 & f != 0
    }

    /// `all`, or names joined by `,` (`kill,give-up`); a leading `-` removes (`all,-kill`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut bits = 0;
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (remove, name) = match part.strip_prefix('-') {
                Some(n) => (true, n),
                None => (false, part),
            };
            let b = if name == "all" {
                Self::ALL.0
            } else {
                Self::NAMES
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, b)| *b)
                    .ok_or_else(|| format!("unknown fault `{name}`"))?
            };
            if remove {
                bits &= !b;
            } else {
                bits |= b;
            }
        }
        Ok(Self(bits))
    }
}

impl std::fmt::Display for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Self::ALL {
            return f.write_str("all");
        }
        let names: Vec<&str> = Self::NAMES
            .iter()
            .filter(|(_, b)| self.has(*b))
            .map(|(n, _)| *n)
            .collect();
        f.write_str(&names.join(","))
    }
}

/// What one schedule runs with: every parameter is drawn here, per run, from ranges that
/// include the dangerous ends (a lease of a second, a heartbeat at half of it, callouts that
/// time out after longer than a lease, a retention shorter than the run, Envoy's own timeouts
/// shorter than the route's).
#[derive(Debug, Clone)]
pub struct Setup {
    pub filter_config: String,
    pub workers: usize,
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
    /// The filter's callouts to the state API, and to the reconcile endpoints.
    pub callout_timeout_ms: u64,
    pub reconcile_timeout_ms: u64,
    /// The protected routes' `retention_s` (none: the state API's default, a day).
    pub retention_s: Option<u64>,
    pub route_timeout_ms: u64,
    /// The HTTP connection manager's timeouts (Envoy answers 408 when one runs out before the
    /// response): `stream_idle_timeout`, `request_timeout`, `max_stream_duration`.
    pub idle_timeout_ms: u64,
    pub request_timeout_ms: Option<u64>,
    pub max_stream_duration_ms: Option<u64>,
    pub max_stored_body_bytes: usize,
    pub complete_retry_ms: u64,
    pub state_api: StateApiConfig,
    /// The kinds of fault this run may inject (the newer kinds are each in some runs only, so
    /// that the others still run long without them).
    pub kinds: Faults,
}

impl Setup {
    /// Draws a schedule's parameters.
    pub fn draw(c: &mut Choices) -> Self {
        let background = c.chance(30);
        let cache = !c.chance(20);
        let (lease_ms, heartbeat_ms) = *c.pick(&[
            (30_000u64, 10_000u64),
            (3_000, 1_000),
            (2_000, 600),
            // With a state API that grants less than asked for (1.5 s).
            (4_000, 1_000),
            // The shortest lease, heartbeats at half of it (the most the filter allows).
            (1_000, 500),
            (2_000, 1_000),
            (120_000, 60_000),
        ]);
        let callout_timeout_ms = *c.pick(&[1_000, 1_000, 100, lease_ms * 3 / 4, lease_ms * 3 / 2]);
        let reconcile_timeout_ms = *c.pick(&[1_000, lease_ms * 3 / 2]);
        let retention_s = *c.pick(&[None, None, Some(1u64), Some(5), Some(60), Some(600)]);
        let complete_retry_ms = *c.pick(&[600_000u64, 30_000]);
        let small_api_body = c.chance(20);
        let max_stored = 100usize;
        let max_waiters = *c.pick(&[0u32, 1, 64]);
        let filter_config = FilterParams {
            callout_timeout_ms,
            reconcile_timeout_ms,
            retention_s,
            complete_retry_ms,
            max_stored,
            lease_ms,
            heartbeat_ms,
            cache,
            background,
            max_waiters,
        }
        .config();
        let route_timeout_ms = *c.pick(&[60_000, 3_600_000, 3_600_000, 10_000]);
        let mut kinds = Faults::ALL.0;
        for (kind, percent) in [
            (Faults::DATABASE, 50),
            (Faults::ENVOY, 50),
            (Faults::ROTATE, 30),
            (Faults::OPERATOR, 30),
        ] {
            if !c.chance(percent) {
                kinds &= !kind;
            }
        }
        // The longest retention a record may have: the routes', or the state API's day.
        let retention_ms = retention_s.map_or(86_400_000, |r| r * 1000);
        Setup {
            filter_config,
            workers: 1 + c.below(3) as usize,
            lease_ms,
            heartbeat_ms,
            callout_timeout_ms,
            reconcile_timeout_ms,
            retention_s,
            // A long route timeout lets a request run past the longest lease.
            route_timeout_ms,
            idle_timeout_ms: *c.pick(&[300_000, 300_000, 15_000, 2_000]),
            request_timeout_ms: *c.pick(&[None, None, Some(20_000)]),
            max_stream_duration_ms: *c.pick(&[None, None, Some(8_000)]),
            max_stored_body_bytes: max_stored,
            complete_retry_ms,
            state_api: StateApiConfig {
                default_lease_ms: 30_000,
                max_lease_ms: if lease_ms == 4_000 {
                    1_500
                } else {
                    crate::state_api::MAX_LEASE_MS
                },
                retention_ms,
                max_retention_ms: retention_ms,
                max_body_bytes: if small_api_body { 48 } else { 1 << 20 },
                // An older state API does not say its limit: the filter learns it from a refusal.
                advertises_max_body: !(small_api_body && c.chance(50)),
                retry_after_cap_s: 2,
                max_waiters: *c.pick(&[0usize, 1, 8]),
                max_wait_ms: 30_000,
            },
            kinds: Faults(kinds),
        }
    }
}

/// The parameters of the simulated filter's configuration (the routes are the same in every
/// run: see [`FilterParams::config`]).
#[derive(Debug, Clone, Copy)]
pub struct FilterParams {
    pub callout_timeout_ms: u64,
    pub reconcile_timeout_ms: u64,
    pub retention_s: Option<u64>,
    pub complete_retry_ms: u64,
    pub max_stored: usize,
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
    pub cache: bool,
    pub background: bool,
    pub max_waiters: u32,
}

impl FilterParams {
    /// The filter's plugin configuration (JSON).
    pub fn config(&self) -> String {
        let FilterParams {
            callout_timeout_ms,
            reconcile_timeout_ms,
            retention_s,
            complete_retry_ms,
            max_stored,
            lease_ms,
            heartbeat_ms,
            cache,
            background,
            max_waiters,
        } = *self;
        let retention = match retention_s {
            Some(r) => format!(r#", "retention_s": {r}"#),
            None => String::new(),
        };
        format!(
            r#"{{
  "state_api": {{"cluster": "state_api", "authority": "state-api", "token": "t", "timeout_ms": {callout_timeout_ms}}},
  "subject": {{"header": "x-jwt-sub"}},
  "routes": [
    {{"method": "POST", "path": "/checkout", "key": "required", "on_unknown": "reconcile"{retention},
      "reconcile": {{"cluster": "{UPSTREAM_CLUSTER}", "authority": "shop", "path": "/checkout/attempts/{{key}}", "timeout_ms": {reconcile_timeout_ms}}}}},
    {{"method": "POST", "path": "/refunds", "key": "required", "on_5xx": "release"{retention}}},
    {{"method": "POST", "prefix": "/pay/", "key": "required", "on_state_unavailable": "fail_open", "on_unknown": "reexecute"{retention}}},
    {{"method": "POST", "prefix": "/shop/", "key": "required", "on_unknown": "reconcile"{retention},
      "reconcile": {{"cluster": "{UPSTREAM_CLUSTER}", "authority": "shop", "path": "/shop/attempts/{{key}}", "timeout_ms": {reconcile_timeout_ms}}}}},
    {{"method": "POST", "path": "/donate", "key": "optional", "key_from": "/idempotency_key", "on_unknown": "reconcile"{retention},
      "reconcile": {{"cluster": "{UPSTREAM_CLUSTER}", "authority": "shop", "path": "/donate/attempts/{{key}}", "timeout_ms": {reconcile_timeout_ms}}}}}
  ],
  "max_request_body_bytes": 4096,
  "max_stored_body_bytes": {max_stored},
  "lease_ms": {lease_ms},
  "heartbeat_ms": {heartbeat_ms},
  "replay_cache_bytes": {cache_bytes},
  "complete_retry_bytes": 4096,
  "complete_retry_ms": {complete_retry_ms},
  "complete_in_background": {background},
  "max_waiters": {max_waiters}
}}"#,
            cache_bytes = if cache { 8192 } else { 0 },
        )
    }
}

/// A client's operation: one key, retried until it gets an answer or runs out of attempts.
#[derive(Debug, Clone)]
pub struct Op {
    /// Its idempotency key (empty: a request on an optional route that carries none).
    pub key: String,
    /// The key is a member of its JSON body (a `key_from` route), not a header.
    pub key_in_body: bool,
    pub subject: String,
    pub path: String,
    pub body: Vec<u8>,
    pub content_type: String,
    pub attempts_left: u32,
    pub active: Option<usize>,
    pub next_at: u64,
    /// Its attempts send `Prefer: wait=N` (0: they do not).
    pub wait_s: u64,
}

impl Op {
    pub fn endpoint(&self) -> String {
        format!("POST {}", self.path.split('?').next().unwrap_or(""))
    }
    pub fn scope(&self) -> Scope {
        (self.key.clone(), self.subject.clone(), self.endpoint())
    }

    /// The request its attempts send when unchanged.
    pub fn request(&self) -> Sent {
        let (path, query) = match self.path.split_once('?') {
            Some((p, q)) => (p.to_owned(), q.to_owned()),
            None => (self.path.clone(), String::new()),
        };
        Sent {
            method: "POST".into(),
            path,
            query,
            content_type: Some(self.content_type.clone()),
            body: self.body.clone(),
        }
    }
}

/// What a client saw of one attempt.
#[derive(Debug, Clone, Default)]
pub struct ClientView {
    pub status: Option<u16>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub complete: bool,
    /// Answered by the filter itself (a problem or a replay).
    pub local: bool,
}

impl ClientView {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn replayed(&self) -> bool {
        self.local && self.header("idempotent-replayed") == Some("true")
    }
}

/// One attempt: an HTTP stream on one worker.
#[derive(Debug, Clone)]
pub struct Stream {
    pub worker: usize,
    pub generation: u32,
    pub sid: StreamId,
    pub op: usize,
    pub request: Sent,
    pub headers: Vec<(String, String)>,
    /// Body chunk sizes; `trailers`: the body ends with trailers, not end of stream.
    pub chunks: Vec<usize>,
    pub trailers: bool,
    /// Request parts given to the filter: 0 none, 1 headers, then one per chunk (+1 trailers).
    pub parts_sent: usize,
    /// Bytes Envoy holds for the filter (cumulative while it pauses).
    pub req_buffered: usize,
    pub forwarded: Option<usize>,
    /// Its claim was refused (a 4xx), not failed: the state API was there.
    pub claim_refused: bool,
    // The response as Envoy holds it.
    pub resp_head: Option<Produced>,
    pub resp_head_passed: bool,
    pub resp_buffer: Vec<u8>,
    pub resp_end_seen: bool,
    pub resp_paused: bool,
    pub resp_chunks_sent: usize,
    pub router_reply: bool,
    /// The upstream refused its fencing token (nothing ran).
    pub refused_by_upstream: bool,
    /// Sent upstream, not received yet.
    pub in_transit: bool,
    pub client: ClientView,
    pub ended: bool,
}

impl Stream {
    fn body_len(&self) -> usize {
        self.chunks.iter().sum()
    }
    pub(crate) fn request_parts(&self) -> usize {
        1 + self.chunks.len() + usize::from(self.trailers)
    }
}

#[derive(Debug)]
pub struct SimWorker {
    pub w: Option<Worker>,
    /// When it last ticked in quiet time (one tick per instant).
    pub ticked_at: Option<u64>,
    pub generation: u32,
    /// How far its wall clock is from the global one (skewed, and stepped either way by the
    /// `skew` fault). The worker does not read it: the glue gives the worker the host's
    /// monotonic clock (the fix of issue 34's path 6), modelled by `steady_ms`.
    pub skew_ms: i64,
    /// Where this life's monotonic clock starts: the worker's time is the global time plus it.
    pub steady_ms: u64,
    pub wake_requested: bool,
    pub next_sid: StreamId,
}

/// A callout on its way.
#[derive(Debug, Clone)]
pub struct Callout {
    pub id: CallId,
    pub worker: usize,
    pub generation: u32,
    pub owner: Owner,
    pub stream: Option<usize>,
    /// The Envoy cluster: the state API's, or the upstream's (a reconcile).
    pub cluster: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub deadline: u64,
    /// The state API's answer once it handled the call.
    pub answer: Option<CalloutResult>,
    /// Nobody waits for the answer any more (the stream ended, timed out, or the worker died).
    pub orphan: bool,
    /// Why nobody waits.
    pub orphaned_by: &'static str,
    /// A claim that waits at the state API for its running key (`Prefer: wait`).
    pub parked: Option<Parked>,
    /// When it was dispatched, in the order of the run's dispatches and writes, and the time.
    pub seq: u64,
    pub sent_at: u64,
    /// The addresses its scopes were looked up at (during a rotation of the key secret the
    /// state API looks a record up, then runs the statement: two steps).
    pub looked_up: Option<Vec<Address>>,
    /// When that lookup ran.
    pub looked_at: u64,
}

/// A claim waiting at the state API: answered when its key settles (any later processing
/// models a wakeup or a poll) or at `until` with the in-progress answer.
#[derive(Debug, Clone, Copy)]
pub struct Parked {
    pub since: u64,
    pub until: u64,
}

/// What of the state API is out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    None,
    /// The state API process: connections are refused.
    ApiDown,
    /// Its database: the state API answers 503 until it is back. `in_place`: a crash recovery
    /// in place (the postmaster reinitialises: its start time and timeline stay, so the lease
    /// guard's `serving_since` does not move); otherwise a restart (it moves).
    Database {
        in_place: bool,
    },
    /// The database is paused (stopped, or a stall): calls get no answer until it resumes.
    Paused,
}

/// Where effects are carried out (the host's [`HostCurrent`], by stream index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Current {
    Request(usize),
    Response(usize),
    Stream(usize),
    Root(usize),
}

pub struct World {
    pub c: Choices,
    pub now: u64,
    pub setup: Setup,
    pub cfg: Config,
    pub workers: Vec<SimWorker>,
    pub api: ModelStateApi,
    /// What of the state API is out, if anything (and when it started).
    pub outage: Outage,
    outage_since: u64,
    /// When the current outage ends by itself (a database back from its recovery or pause).
    outage_until: Option<u64>,
    /// Dispatches and writes in the order they happen (several happen at one instant).
    pub seq: u64,
    /// When the key secret last rotated.
    pub(crate) rotated_at: Option<u64>,
    /// What the invariants remember of the run.
    pub ev: check::Evidence,
    pub callouts: Vec<Callout>,
    pub streams: Vec<Stream>,
    pub upstream: Upstream,
    pub upstream_down: bool,
    pub ops: Vec<Op>,
    pub trace: Vec<String>,
    pub violations: Vec<String>,
    /// Tokens released by the state API: a re-execution after one is allowed.
    pub released: BTreeSet<i64>,
    /// Scopes a complete of which the state API refused (their outcome may be stored as its
    /// status alone).
    pub refused_completes: BTreeSet<Scope>,
    /// Whether faults may still be injected (off while draining).
    faults: bool,
    /// Inside a quiet tick: routine heartbeats are not traced.
    quiet: bool,
    pub kinds: Faults,
    /// A worker that cannot reach the state API (the model checker's partition): its calls
    /// fail at dispatch.
    pub partitioned: Option<usize>,
    pub steps: usize,
    /// What the run reached: the filter's counters (by name) and the model's own events.
    pub reached: std::collections::BTreeMap<&'static str, u64>,
}

const SUBJECTS: [&str; 2] = ["alice", "bob"];
/// A silence of the state API's pulse longer than this counts as an outage for the lease
/// guard (`serving_since` moves to its end).
pub const PULSE_SILENCE_MS: u64 = 1_000;
/// The global time a run starts at.
const START_MS: u64 = 1_000;
/// `response.flags` of Envoy's own timeouts (`CoreResponseFlag` bits 16 and 22), which the
/// filter's `outcome::flags` does not name.
const STREAM_IDLE_TIMEOUT: u64 = 1 << 16;
const DURATION_TIMEOUT: u64 = 1 << 22;
/// The cluster of the upstream (its reconcile endpoint is asked through it).
const UPSTREAM_CLUSTER: &str = "upstream";

fn long_path() -> String {
    format!("/pay/{}", "p".repeat(1100))
}

impl World {
    pub fn new(mut c: Choices, kinds: Faults) -> Self {
        let setup = Setup::draw(&mut c);
        let nops = 1 + c.below(3) as usize;
        let mut ops: Vec<Op> = Vec::new();
        for i in 0..nops {
            let path = match c.weighted(&[8, 2, 1, 1, 1, 1, 1, 2]) {
                0 => "/checkout".to_owned(),
                1 => "/refunds".to_owned(),
                2 => "/pay/x".to_owned(),
                3 => "/orders".to_owned(),
                4 => long_path(),
                5 => "/shop/a".to_owned(),
                6 => "/shop/b".to_owned(),
                _ => "/donate".to_owned(),
            };
            // Two operations may share a key (under other subjects or endpoints, or the same).
            let (key, subject) = match ops.last() {
                Some(prev) if c.chance(30) => (
                    prev.key.clone(),
                    if c.chance(50) {
                        prev.subject.clone()
                    } else {
                        c.pick(&SUBJECTS).to_string()
                    },
                ),
                _ => (
                    format!("k{}", c.below(2) + i as u32 * 2),
                    c.pick(&SUBJECTS).to_string(),
                ),
            };
            let (key, key_in_body, body) = if path == "/donate" {
                // The key is a member of the JSON body (`key_from`), or the body has none (an
                // optional key): then no idempotency at all.
                match c.below(4) {
                    0 => (String::new(), true, br#"{"amount":5}"#.to_vec()),
                    1 => (String::new(), true, b"amount=5".to_vec()),
                    _ => (
                        key.clone(),
                        true,
                        format!(r#"{{"idempotency_key":"{key}","amount":5}}"#).into_bytes(),
                    ),
                }
            } else {
                let body = match c.below(3) {
                    0 => br#"{"amount":100,"card":{"number":"4242"}}"#.to_vec(),
                    1 => br#"{"amount":7}"#.to_vec(),
                    _ => Vec::new(),
                };
                (key, false, body)
            };
            ops.push(Op {
                key,
                key_in_body,
                subject,
                path,
                body,
                content_type: "application/json".into(),
                attempts_left: 1 + c.below(4),
                active: None,
                next_at: 0,
                wait_s: *c.pick(&[0, 0, 1, 5, 30]),
            });
        }
        Self::build(c, setup, ops, kinds)
    }

    /// A world of `setup`'s workers and clients `ops`, with faults of `kinds` (those of `setup`
    /// among them), its further choices from `c`.
    pub fn build(c: Choices, setup: Setup, ops: Vec<Op>, kinds: Faults) -> Self {
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
            ev: check::Evidence::default(),
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

    // -----------------------------------------------------------------------------------------
    // The schedule

    /// Runs the random part of the schedule (at most `max_steps`), then drains and checks the
    /// final answers. Stops at the first violation.
    pub fn run(&mut self, max_steps: usize) {
        self.reach_setup();
        for _ in 0..max_steps {
            if !self.step() {
                break;
            }
            self.steps += 1;
            check::after_step(self);
            if !self.violations.is_empty() {
                return;
            }
        }
        self.drain();
        if self
            .setup
            .retention_s
            .is_some_and(|r| r * 1000 < self.now - START_MS)
        {
            self.reach("region: a retention shorter than the run");
        }
        if self.violations.is_empty() {
            check::final_answers(self);
        }
    }

    /// The dangerous ends of the run's parameters it was drawn with.
    fn reach_setup(&mut self) {
        let su = &self.setup;
        let mut reached = Vec::new();
        if su.lease_ms == crate::state_api::MIN_LEASE_MS {
            reached.push("region: the shortest lease (1 s)");
        }
        if su.heartbeat_ms * 2 == su.lease_ms {
            reached.push("region: heartbeats at half the lease");
        }
        if su.callout_timeout_ms > su.lease_ms {
            reached.push("region: state API callouts that time out after longer than a lease");
        }
        if su.reconcile_timeout_ms > su.lease_ms {
            reached.push("region: reconcile callouts that time out after longer than a lease");
        }
        if su.idle_timeout_ms < su.route_timeout_ms
            || su
                .max_stream_duration_ms
                .is_some_and(|t| t < su.route_timeout_ms)
        {
            reached.push("region: Envoy's own timeouts shorter than the route's");
        }
        for r in reached {
            self.reach(r);
        }
    }

    /// One random step; `false` when nothing is left to do.
    fn step(&mut self) -> bool {
        let mut actions: Vec<(u32, Action)> = Vec::new();
        for (i, op) in self.ops.iter().enumerate() {
            if op.attempts_left > 0 && op.next_at <= self.now {
                // A retry, or an impatient duplicate while an attempt is still running.
                let weight = if op.active.is_none() { 8 } else { 1 };
                actions.push((weight, Action::NewAttempt(i)));
            }
        }
        for (i, s) in self.streams.iter().enumerate() {
            if s.ended {
                continue;
            }
            if s.parts_sent < s.request_parts() && s.client.status.is_none() {
                actions.push((10, Action::SendPart(i)));
            }
            if self.fault(Faults::GIVE_UP) && !s.client.complete {
                actions.push((1, Action::GiveUp(i)));
            }
        }
        for (i, c) in self.callouts.iter().enumerate() {
            if c.answer.is_none() {
                actions.push((6, Action::Process(i)));
            } else if !c.orphan {
                actions.push((8, Action::Deliver(i)));
            }
            if self.fault(Faults::CALLOUT) && !c.orphan {
                actions.push((1, Action::FailCallout(i)));
            }
        }
        for (i, s) in self.streams.iter().enumerate() {
            if s.forwarded.is_some() && !s.ended && !s.resp_end_seen && !s.router_reply {
                actions.push((6, Action::UpstreamPart(i)));
            }
        }
        for (i, s) in self.streams.iter().enumerate() {
            if s.in_transit {
                actions.push((4, Action::Arrive(i)));
            }
        }
        for (e, x) in self.upstream.executions.iter().enumerate() {
            let caller = &self.streams[x.stream];
            if !x.finished && (caller.ended || caller.router_reply) {
                // Its caller left: it works on, and finishes in its own time.
                actions.push((2, Action::UpstreamFinish(e)));
            }
        }
        for (i, w) in self.workers.iter().enumerate() {
            if w.w.is_some() {
                actions.push((2, Action::Tick(i)));
                if w.wake_requested {
                    actions.push((4, Action::Wake(i)));
                }
                if self.fault(Faults::KILL) {
                    actions.push((1, Action::Kill(i)));
                }
            } else {
                actions.push((2, Action::Restart(i)));
            }
        }
        if self.fault(Faults::API_DOWN) && matches!(self.outage, Outage::None | Outage::ApiDown) {
            actions.push((1, Action::ToggleApi));
        }
        if self.fault(Faults::DATABASE) && self.outage == Outage::None {
            actions.push((1, Action::DatabaseOutage));
        }
        if self.fault(Faults::SKEW) {
            actions.push((1, Action::SkewClock));
        }
        if self.fault(Faults::UPSTREAM) {
            actions.push((1, Action::ToggleUpstream));
        }
        if self.fault(Faults::ENVOY) {
            for (i, s) in self.streams.iter().enumerate() {
                if s.forwarded.is_some() && !s.ended && s.resp_head.is_none() && !s.router_reply {
                    actions.push((1, Action::EnvoyReply(i)));
                }
            }
        }
        if self.fault(Faults::ROTATE) {
            // As the operator is told: the previous secret goes (by a drop, or by the next
            // rotation) once the longest retention has passed since the rotation.
            let settled = self
                .rotated_at
                .is_none_or(|t| t + self.setup.state_api.max_retention_ms <= self.now);
            if settled && self.api.secret < 2 {
                actions.push((1, Action::RotateSecret));
            }
            if settled && self.api.previous_secret.is_some() {
                actions.push((1, Action::DropPreviousSecret));
            }
        }
        if self.fault(Faults::OPERATOR) && self.outage == Outage::None {
            actions.push((1, Action::Operator));
        }
        // The state API's purge runs now and then.
        if self.outage == Outage::None {
            actions.push((1, Action::Purge));
        }
        actions.push((3, Action::Advance));
        let weights: Vec<u32> = actions.iter().map(|a| a.0).collect();
        let pick = self.c.weighted(&weights);
        let action = actions[pick].1;
        self.act(action);
        true
    }

    pub(crate) fn act(&mut self, action: Action) {
        match action {
            Action::NewAttempt(op) => self.new_attempt(op, None),
            Action::SendPart(s) => self.send_part(s),
            Action::GiveUp(s) => {
                self.reach("sim.client_gave_up");
                self.log(format!("client gives up on stream {s}"));
                self.end_stream(s, true);
            }
            Action::Process(i) => self.process(i),
            Action::Deliver(i) => self.deliver(i),
            Action::FailCallout(i) => self.fail_callout(i),
            Action::UpstreamPart(s) => self.upstream_part(s),
            Action::Arrive(s) => {
                self.log(format!("stream {s}: the request reaches the upstream"));
                self.arrive(s);
            }
            Action::UpstreamFinish(e) => {
                self.reach("sim.finished_after_caller_left");
                self.commit(e);
                self.log(format!(
                    "the execution of stream {} finishes, its caller gone",
                    self.upstream.executions[e].stream
                ));
            }
            Action::Tick(w) => self.tick(w),
            Action::Wake(w) => self.wake(w),
            Action::Kill(w) => self.kill(w),
            Action::Restart(w) => self.restart(w),
            Action::ToggleApi => {
                if self.outage == Outage::None {
                    self.start_outage(Outage::ApiDown, None);
                } else {
                    self.end_outage();
                }
            }
            Action::DatabaseOutage => {
                let kind = match self.c.weighted(&[3, 1, 2]) {
                    0 => Outage::Database { in_place: true },
                    1 => Outage::Database { in_place: false },
                    _ => Outage::Paused,
                };
                let lease = self.setup.lease_ms;
                let lasts = *self.c.pick(&[lease / 2, lease * 3 / 2, lease * 3, 40_000]);
                self.start_outage(kind, Some(lasts.max(1)));
            }
            Action::EnvoyReply(s) => self.envoy_reply(s),
            Action::RotateSecret => {
                self.api.rotate_secret();
                self.rotated_at = Some(self.now);
                self.reach("region: the key secret rotated");
                self.log(format!(
                    "the key secret rotates: new records under secret {}, records under secret {} still looked up",
                    self.api.secret,
                    self.api.secret - 1
                ));
            }
            Action::DropPreviousSecret => {
                self.api.drop_previous_secret();
                self.reach("region: the previous key secret dropped");
                self.log(
                    "the previous key secret is dropped: records under it are no longer found"
                        .into(),
                );
            }
            Action::Operator => self.operator_action(),
            Action::Purge => {
                let (deleted, marked) = self.api.purge(self.now);
                if deleted > 0 {
                    self.reach("region: the purge deleted records");
                }
                if deleted + marked > 0 {
                    self.log(format!(
                        "the state API's purge deletes {deleted} expired records and marks {marked} unknown"
                    ));
                }
                self.after_purge();
            }
            Action::ToggleUpstream => {
                self.upstream_down = !self.upstream_down;
                self.log(format!(
                    "upstream {}",
                    if self.upstream_down { "down" } else { "up" }
                ));
            }
            Action::SkewClock => {
                let w = self.c.below(self.workers.len() as u32) as usize;
                // A little skew, or the wall clock stepped (NTP, a VM resumed), either way.
                let to: i64 = match self.c.weighted(&[4, 1, 1, 1, 1]) {
                    0 => i64::from(self.c.below(300)),
                    1 => -5_000,
                    2 => -120_000,
                    3 => 5_000,
                    _ => 900_000,
                };
                let by = to - self.workers[w].skew_ms;
                self.workers[w].skew_ms = to;
                if by.abs() >= 1_000 {
                    let holds = self.workers[w].w.as_ref().is_some_and(|wk| {
                        !wk.held_tokens().is_empty() || !wk.write_tokens().is_empty()
                    });
                    if holds {
                        self.reach(if by < 0 {
                            "region: a clock stepped back while its worker held a claim"
                        } else {
                            "region: a clock stepped forward while its worker held a claim"
                        });
                    }
                    self.ev
                        .clock_steps
                        .entry(w)
                        .or_default()
                        .push((self.now, by));
                }
                self.log(format!("worker {w} clock skew {to} ms ({by:+} ms)"));
            }
            Action::Advance => {
                let ms = *self
                    .c
                    .pick(&[1u64, 10, 100, 500, 2_000, 10_000, 40_000, 700_000]);
                self.advance(ms);
            }
        }
    }

    /// Time passes: each worker ticks at its tick period whenever a tick has work (heartbeats,
    /// writes), and its callouts go and come back at once (a quiet network); callouts already
    /// on their way and requests upstream time out as they would.
    pub(crate) fn advance(&mut self, ms: u64) {
        let end = self.now + ms;
        for _ in 0..100_000 {
            let mut next = end;
            for w in 0..self.workers.len() {
                if let Some(t) = self.next_tick(w) {
                    next = next.min(t.max(self.now));
                }
            }
            for c in &self.callouts {
                if !c.orphan {
                    next = next.min(c.deadline.max(self.now));
                }
                if let Some(p) = c.parked {
                    next = next.min(p.until.max(self.now));
                }
            }
            for s in 0..self.streams.len() {
                if let Some((at, ..)) = self.envoy_deadline(s) {
                    next = next.min(at.max(self.now));
                }
            }
            if let Some(t) = self.outage_until {
                next = next.min(t.max(self.now));
            }
            self.now = next;
            self.timeouts();
            for w in 0..self.workers.len() {
                if self.next_tick(w).is_some_and(|t| t <= self.now) {
                    self.quiet_tick(w);
                }
            }
            if self.now >= end {
                return;
            }
            if !self.violations.is_empty() {
                return;
            }
        }
    }

    /// When worker `w` next ticks with work to do (global time, on its tick period).
    pub fn next_tick(&self, w: usize) -> Option<u64> {
        let sw = &self.workers[w];
        let due = sw.w.as_ref()?.next_due()?;
        let period = self.cfg.tick_period_ms().max(1);
        let due = due.saturating_sub(sw.steady_ms);
        // The host ticks on its period: the first tick at or after the work is due, and never
        // twice at one instant.
        let t = due.div_ceil(period) * period;
        Some(if t <= self.now {
            self.now
                + if sw.ticked_at == Some(self.now) {
                    period
                } else {
                    0
                }
        } else {
            t
        })
    }

    /// A tick in quiet time: the callouts it makes are answered at once (routine heartbeats
    /// are left out of the trace).
    fn quiet_tick(&mut self, w: usize) {
        self.workers[w].ticked_at = Some(self.now);
        self.quiet = true;
        let before = self.callouts.len();
        self.tick(w);
        while self.callouts.len() > before {
            let i = self.callouts.len() - 1;
            if self.callouts[i].worker != w || self.callouts[i].owner != Owner::Worker {
                break;
            }
            // Looked up, then handled (two steps during a rotation of the key secret).
            for _ in 0..2 {
                if self.callouts.get(i).is_some_and(|c| c.answer.is_none()) {
                    self.process(i);
                }
            }
            if self.callouts.get(i).is_some_and(|c| c.answer.is_some()) {
                self.deliver(i);
            } else {
                break;
            }
        }
        self.quiet = false;
    }

    /// Callouts past their deadline fail (Envoy's callout timeout); the route timeout answers
    /// 504 for requests whose upstream has not answered.
    pub(crate) fn timeouts(&mut self) {
        if self.outage_until.is_some_and(|t| t <= self.now) {
            self.end_outage();
        }
        // Waits that reach their end are answered first (the state API's own deadline).
        if self.outage != Outage::Paused {
            let due: Vec<(usize, u32, CallId)> = self
                .callouts
                .iter()
                .filter(|c| c.parked.is_some_and(|p| p.until <= self.now))
                .map(|c| (c.worker, c.generation, c.id))
                .collect();
            for (w, g, id) in due {
                if let Some(i) = self
                    .callouts
                    .iter()
                    .position(|c| (c.worker, c.generation, c.id) == (w, g, id))
                {
                    self.process(i);
                }
            }
        }
        while let Some(i) = self
            .callouts
            .iter()
            .position(|c| !c.orphan && c.deadline <= self.now)
        {
            self.fail_callout_with(i, "timeout");
        }
        for s in 0..self.streams.len() {
            if let Some((at, status, details, fl)) = self.envoy_deadline(s) {
                if at <= self.now {
                    self.router_reply(s, status, details, fl);
                }
            }
        }
    }

    /// The first of Envoy's timeouts that runs out for a forwarded request still without its
    /// response: the route's (504), or the connection manager's (408).
    fn envoy_deadline(&self, s: usize) -> Option<(u64, u16, &'static str, u64)> {
        let st = &self.streams[s];
        let e = st.forwarded?;
        if st.ended || st.resp_head.is_some() || st.router_reply {
            return None;
        }
        let at = self.upstream.executions.get(e)?.at;
        let su = &self.setup;
        [
            Some((
                su.route_timeout_ms,
                504,
                "upstream_response_timeout",
                flags::UPSTREAM_REQUEST_TIMEOUT,
            )),
            Some((
                su.idle_timeout_ms,
                408,
                "stream_idle_timeout",
                STREAM_IDLE_TIMEOUT,
            )),
            su.request_timeout_ms
                .map(|t| (t, 408, "request_overall_timeout", 0)),
            su.max_stream_duration_ms
                .map(|t| (t, 408, "max_duration_timeout", DURATION_TIMEOUT)),
        ]
        .into_iter()
        .flatten()
        .map(|(after, status, details, fl)| (at + after, status, details, fl))
        .min_by_key(|d| d.0)
    }

    // -----------------------------------------------------------------------------------------
    // Clients and requests

    pub(crate) fn new_attempt(&mut self, op: usize, worker: Option<usize>) {
        let alive: Vec<usize> = (0..self.workers.len())
            .filter(|w| self.workers[*w].w.is_some())
            .collect();
        if alive.is_empty() {
            return;
        }
        let w = match worker {
            Some(w) if self.workers[w].w.is_some() => w,
            _ => *self.c.pick(&alive),
        };
        let o = self.ops[op].clone();
        // Mostly the same request; sometimes a changed body or media type under the same key.
        let (body, content_type) = if self.fault(Faults::CLIENT) {
            match self.c.weighted(&[12, 2, 1, 1]) {
                0 => (o.body.clone(), o.content_type.clone()),
                1 => (reorder(&o.body), o.content_type.clone()),
                2 => (changed(&o.body), o.content_type.clone()),
                _ => (o.body.clone(), "text/plain".to_owned()),
            }
        } else {
            (o.body.clone(), o.content_type.clone())
        };
        let mut headers = vec![
            (":method".to_owned(), "POST".to_owned()),
            (":path".to_owned(), o.path.clone()),
            (":authority".to_owned(), "shop".to_owned()),
            ("x-jwt-sub".to_owned(), o.subject.clone()),
            ("content-type".to_owned(), content_type.clone()),
        ];
        if !o.key_in_body {
            headers.push(("idempotency-key".to_owned(), o.key.clone()));
        }
        if o.wait_s > 0 {
            headers.push(("prefer".to_owned(), format!("wait={}", o.wait_s)));
        }
        if self.fault(Faults::CLIENT) && self.c.chance(5) {
            // A client that tries to set its own fencing token.
            headers.push((
                FENCING_TOKEN_HEADER.to_owned(),
                check::CLIENT_TOKEN.to_string(),
            ));
            if o.key.is_empty() {
                self.reach(
                    "region: a key_from request without a key, with a client's fencing token",
                );
            }
        }
        let len = body.len();
        let chunks = if len == 0 {
            Vec::new()
        } else if self.c.chance(50) {
            vec![len]
        } else {
            let cut = 1 + self.c.below(len as u32) as usize % len;
            if cut >= len {
                vec![len]
            } else {
                vec![cut, len - cut]
            }
        };
        let trailers = len > 0 && self.c.chance(10);
        let (path, query) = match o.path.split_once('?') {
            Some((p, q)) => (p.to_owned(), q.to_owned()),
            None => (o.path.clone(), String::new()),
        };
        let generation = self.workers[w].generation;
        self.workers[w].next_sid += 1;
        let sid = generation * 100_000 + self.workers[w].next_sid;
        let index = self.streams.len();
        self.streams.push(Stream {
            worker: w,
            generation,
            sid,
            op,
            request: Sent {
                method: "POST".into(),
                path,
                query,
                content_type: Some(content_type.clone()),
                body,
            },
            headers,
            chunks,
            trailers,
            parts_sent: 0,
            req_buffered: 0,
            forwarded: None,
            claim_refused: false,
            resp_head: None,
            resp_head_passed: false,
            resp_buffer: Vec::new(),
            resp_end_seen: false,
            resp_paused: false,
            resp_chunks_sent: 0,
            router_reply: false,
            refused_by_upstream: false,
            in_transit: false,
            client: ClientView::default(),
            ended: false,
        });
        self.ops[op].active = Some(index);
        self.ops[op].attempts_left = self.ops[op].attempts_left.saturating_sub(1);
        self.log(format!(
            "op {op} attempt on worker {w} (stream {index}): POST {} key={} sub={} ct={content_type} body={}",
            short(&o.path),
            o.key,
            o.subject,
            String::from_utf8_lossy(&self.streams[index].request.body)
        ));
        self.send_part(index);
    }

    /// The next request part reaches the filter (headers, a body chunk, or trailers).
    pub(crate) fn send_part(&mut self, s: usize) {
        let st = self.streams[s].clone();
        let w = st.worker;
        if st.ended || self.workers[w].w.is_none() || self.workers[w].generation != st.generation {
            return;
        }
        let now = self.worker_now(w);
        let part = st.parts_sent;
        self.streams[s].parts_sent += 1;
        let forwarded = st.forwarded.is_some() || st.in_transit;
        let step = if part == 0 {
            let end = st.chunks.is_empty() && !st.trailers;
            let head = RequestHead {
                headers: &st.headers,
                metadata_subject: None,
            };
            self.call(w, |wk| wk.on_request_headers(st.sid, head, end, now))
        } else if part <= st.chunks.len() {
            let chunk = st.chunks[part - 1];
            let end = part == st.chunks.len() && !st.trailers;
            if forwarded {
                // Passed on already: the filter sees each chunk once.
                self.call(w, |wk| {
                    wk.on_request_body(st.sid, chunk, end, &mut |_| None, now)
                })
            } else {
                let size = st.req_buffered + chunk;
                self.streams[s].req_buffered = size;
                let body = st.request.body.clone();
                self.call(w, |wk| {
                    wk.on_request_body(st.sid, size, end, &mut |n| read(&body, n), now)
                })
            }
        } else if forwarded {
            // Passed on already: nothing is buffered for the filter.
            self.call(w, |wk| wk.on_request_trailers(st.sid, &mut |_| None, now))
        } else {
            let size = st.req_buffered;
            let body = st.request.body.clone();
            debug_assert_eq!(size, st.body_len());
            self.call(w, |wk| {
                wk.on_request_trailers(st.sid, &mut |n| read(&body, n), now)
            })
        };
        let Some(step) = step else { return };
        let verdict = self.perform(w, Current::Request(s), step.verdict, step.effects);
        if verdict == Verdict::Continue && !forwarded {
            self.forward(s);
        }
        self.end_if_answered(s);
    }

    /// The request goes upstream (with the headers the filter set).
    fn forward(&mut self, s: usize) {
        let st = &self.streams[s];
        if st.forwarded.is_some() || st.in_transit || st.ended || st.client.status.is_some() {
            return;
        }
        if self.upstream_down && self.c.chance(50) {
            self.log(format!("stream {s}: upstream refuses the connection"));
            self.router_reply(
                s,
                503,
                "upstream_reset_before_response_started{remote_connection_failure}",
                flags::UPSTREAM_CONNECTION_FAILURE,
            );
            return;
        }
        if self.fault(Faults::UPSTREAM) && self.c.chance(15) {
            // Sent, not yet received: it may arrive after its stream, or its Envoy, is gone.
            self.log(format!(
                "stream {s}: the request is on its way to the upstream"
            ));
            self.streams[s].in_transit = true;
            return;
        }
        self.arrive(s);
    }

    /// The request reaches the upstream, which executes it (or refuses a fenced token).
    fn arrive(&mut self, s: usize) {
        self.streams[s].in_transit = false;
        let st = &self.streams[s];
        let op = &self.ops[st.op];
        let scope = op.scope();
        let token = st
            .headers
            .iter()
            .find(|(n, _)| n == FENCING_TOKEN_HEADER)
            .and_then(|(_, v)| v.parse::<i64>().ok());
        let key_sent = st
            .headers
            .iter()
            .find(|(n, _)| n == "idempotency-key")
            .map(|(_, v)| v.clone());
        let request = st.request.clone();
        let st_headers = st.headers.clone();
        let protected = self.cfg.route_index("POST", &request.path).is_some();
        // The reference records an attempt of a key before it runs it (a careful upstream
        // knows the key, from the header or the body), and refuses a stale token.
        let key = (protected && !scope.0.is_empty()).then_some(scope.0.as_str());
        let forwarded = |name: &str| {
            st_headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let named = crate::upstream::RequestNamed {
            endpoint: &scope.2,
            subject: &scope.1,
            endpoint_header: forwarded(contract::wire::ENDPOINT_HEADER),
            fingerprint: forwarded(contract::wire::FINGERPRINT_HEADER),
        };
        let (attempt, arrival) = self.upstream.start(named, key, token);
        if let crate::upstream::Arrival::Answered(answer) = arrival {
            self.log(format!(
                "stream {s}: the upstream runs nothing for token {token:?} and answers {} {}",
                answer.status,
                problem_type(&answer.body)
            ));
            self.upstream
                .refused
                .push((scope.clone(), request.clone(), answer.clone()));
            let mut hs = vec![(":status".to_owned(), answer.status.to_string())];
            hs.extend(answer.headers.iter().cloned());
            self.streams[s].refused_by_upstream = true;
            self.reach(if problem_type(&answer.body).contains("stale") {
                "sim.upstream_refused_stale_token"
            } else {
                "sim.upstream_answered_without_running"
            });
            if self.streams[s].ended {
                return;
            }
            let end = answer.body.is_empty();
            self.response_headers(s, answer.clone(), &hs, "via_upstream", 0, end);
            if !end && !self.streams[s].ended {
                self.response_body(s, answer.body, true);
            }
            return;
        }
        let plan = self.plan_response();
        let index = self.upstream.executions.len();
        self.log(format!(
            "stream {s}: forwarded, upstream executes (token {token:?}, key {key_sent:?}); it will answer {} with {} body bytes{}",
            plan.response.status,
            plan.response.body.len(),
            match plan.ending {
                Ending::WithLastChunk => String::new(),
                ref e => format!(", {e:?}"),
            }
        ));
        if protected {
            check::execution(self, &scope, token, s);
        } else {
            let headers = self.streams[s].headers.clone();
            check::unprotected(self, &headers, s);
        }
        self.upstream.executions.push(Execution {
            scope,
            token,
            request,
            plan,
            at: self.now,
            stream: s,
            finished: false,
            attempt,
            charged: false,
        });
        self.streams[s].forwarded = Some(index);
    }

    /// Execution `e` commits at the upstream (by the reference's rules): a charge, checked.
    fn commit(&mut self, e: usize) {
        match self.upstream.commit(e) {
            crate::upstream::Commit::Charged => check::charge(self, e),
            crate::upstream::Commit::Answered => {
                let x = &self.upstream.executions[e];
                let line = format!(
                    "the execution of stream {} runs nothing at its commit: the upstream answers {} {}",
                    x.stream,
                    x.plan.response.status,
                    problem_type(&x.plan.response.body)
                );
                self.log(line);
            }
            crate::upstream::Commit::NoEffect | crate::upstream::Commit::Done => {}
        }
    }

    fn plan_response(&mut self) -> Plan {
        let faults = self.fault(Faults::UPSTREAM);
        let status = *self.c.pick(&[201u16, 201, 201, 402, 500, 503, 700]);
        let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
        if status == 201 {
            let long = faults && self.c.chance(10);
            let location = if long {
                format!("/charges/{}", "l".repeat(9_000))
            } else {
                format!("/charges/{}", self.upstream.executions.len() + 1)
            };
            headers.push(("location".to_owned(), location));
        }
        headers.push(("set-cookie".to_owned(), "session=1".to_owned()));
        let gzip = self.c.chance(10);
        if gzip {
            headers.push(("content-encoding".to_owned(), "gzip".to_owned()));
            headers.push(("vary".to_owned(), "accept-encoding".to_owned()));
        }
        let body: Vec<u8> = match self.c.weighted(&[6, 2, 1, 1]) {
            0 => format!("{{\"id\":{}}}", self.upstream.executions.len() + 1).into_bytes(),
            1 => Vec::new(),
            // Over the filter's max_stored_body_bytes: stored without its body.
            2 => vec![b'x'; self.setup.max_stored_body_bytes + 20],
            // Under the filter's limit, over a small state API's.
            _ => vec![b'y'; 70],
        };
        let body = if gzip { gzipish(&body) } else { body };
        let len = body.len();
        let chunks = if len == 0 {
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
        };
        let ending = if faults {
            match self.c.weighted(&[10, 2, 1, 1, 1]) {
                0 => Ending::WithLastChunk,
                1 => Ending::EmptyFrame,
                2 => Ending::Trailers,
                3 => Ending::ResetAfter(self.c.below(chunks.len() as u32 + 1) as usize),
                _ => Ending::StallAfter(self.c.below(chunks.len() as u32 + 1) as usize),
            }
        } else {
            Ending::WithLastChunk
        };
        Plan {
            reset_before_headers: faults && self.c.chance(5),
            response: Produced {
                status,
                headers,
                body,
            },
            chunks,
            ending,
        }
    }

    /// The upstream's next response part reaches Envoy.
    pub(crate) fn upstream_part(&mut self, s: usize) {
        let st = self.streams[s].clone();
        let Some(e) = st.forwarded else { return };
        let w = st.worker;
        if st.ended || self.workers[w].w.is_none() || self.workers[w].generation != st.generation {
            return;
        }
        if st.resp_head.is_none() && !self.upstream.executions[e].plan.reset_before_headers {
            // Its response leaves: it commits now (or answers 409 if a larger token overtook it).
            self.commit(e);
            if !self.violations.is_empty() {
                return;
            }
        }
        let plan = self.upstream.executions[e].plan.clone();
        if st.resp_head.is_none() {
            if plan.reset_before_headers {
                self.log(format!("stream {s}: upstream resets before its response"));
                self.router_reply(
                    s,
                    503,
                    "upstream_reset_before_response_started{remote_reset}",
                    flags::UPSTREAM_REMOTE_RESET,
                );
                return;
            }
            let end = plan.chunks.is_empty() && plan.ending == Ending::WithLastChunk;
            let mut hs = vec![(":status".to_owned(), plan.response.status.to_string())];
            hs.extend(plan.response.headers.iter().cloned());
            self.log(format!(
                "stream {s}: response headers {}",
                plan.response.status
            ));
            self.response_headers(s, plan.response.clone(), &hs, "via_upstream", 0, end);
            return;
        }
        let sent = st.resp_chunks_sent;
        match plan.ending {
            Ending::ResetAfter(n) if sent >= n => {
                self.log(format!("stream {s}: upstream resets in the body"));
                self.end_stream(s, false);
                return;
            }
            Ending::StallAfter(n) if sent >= n => {
                // Stalled: only the client giving up ends it. Nothing to send.
                if !self.faults {
                    self.end_stream(s, true);
                }
                return;
            }
            _ => {}
        }
        if sent < plan.chunks.len() {
            let start: usize = plan.chunks[..sent].iter().sum();
            let chunk = &plan.response.body[start..start + plan.chunks[sent]];
            let end = sent + 1 == plan.chunks.len() && plan.ending == Ending::WithLastChunk;
            self.streams[s].resp_chunks_sent += 1;
            self.response_body(s, chunk.to_vec(), end);
        } else {
            self.streams[s].resp_chunks_sent += 1;
            match plan.ending {
                Ending::Trailers => self.response_trailers(s),
                // An empty data frame, or end of stream after a headers-only answer.
                _ => self.response_body(s, Vec::new(), true),
            }
        }
    }

    /// Envoy's router answers for the upstream (reset, refused connection, timeout).
    fn router_reply(&mut self, s: usize, status: u16, details: &str, fl: u64) {
        self.streams[s].router_reply = true;
        let body = b"upstream connect error or disconnect/reset before headers".to_vec();
        let produced = Produced {
            status,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: body.clone(),
        };
        self.log(format!("stream {s}: router answers {status} ({details})"));
        if self.streams[s].forwarded.is_some() {
            let scope = self.ops[self.streams[s].op].scope();
            self.ev
                .envoy_replies
                .push((scope, produced.clone(), details.to_owned()));
            self.reach(match status {
                408 => "region: Envoy answered a forwarded request 408",
                413 => "region: Envoy answered a forwarded request 413",
                503 => "region: Envoy answered a forwarded request 503",
                504 => "region: Envoy answered a forwarded request 504",
                _ => "region: Envoy answered a forwarded request otherwise",
            });
        }
        // An execution the router answered for goes on, and finishes on its own.
        let mut hs = vec![(":status".to_owned(), status.to_string())];
        hs.extend(produced.headers.iter().cloned());
        self.response_headers(s, produced, &hs, details, fl, false);
        if !self.streams[s].ended {
            self.response_body(s, body, true);
        }
    }

    fn response_headers(
        &mut self,
        s: usize,
        produced: Produced,
        hs: &[(String, String)],
        details: &str,
        fl: u64,
        end: bool,
    ) {
        let st = self.streams[s].clone();
        let w = st.worker;
        self.streams[s].resp_head = Some(produced);
        self.streams[s].resp_end_seen = end;
        let now = self.worker_now(w);
        let wants = self.workers[w]
            .w
            .as_ref()
            .is_some_and(|wk| wk.awaits_response(st.sid));
        let verdict = if wants {
            let step = self.call(w, |wk| {
                wk.on_response_headers(
                    st.sid,
                    ResponseHead {
                        headers: hs,
                        details,
                        flags: fl,
                    },
                    end,
                    now,
                )
            });
            match step {
                Some(step) => self.perform(w, Current::Response(s), step.verdict, step.effects),
                None => Verdict::Continue,
            }
        } else {
            Verdict::Continue
        };
        self.streams[s].resp_paused = verdict == Verdict::Pause;
        if verdict == Verdict::Continue {
            self.pass_response(s);
        }
        self.end_if_answered(s);
    }

    fn response_body(&mut self, s: usize, chunk: Vec<u8>, end: bool) {
        let st = self.streams[s].clone();
        if st.ended {
            return;
        }
        let w = st.worker;
        let now = self.worker_now(w);
        self.streams[s].resp_buffer.extend_from_slice(&chunk);
        if end {
            self.streams[s].resp_end_seen = true;
        }
        let buffer = self.streams[s].resp_buffer.clone();
        let size = buffer.len();
        let step = self.call(w, |wk| {
            wk.on_response_body(st.sid, size, end, &mut |n| read(&buffer, n), now)
        });
        let verdict = match step {
            Some(step) => self.perform(w, Current::Response(s), step.verdict, step.effects),
            None => Verdict::Continue,
        };
        self.streams[s].resp_paused = verdict == Verdict::Pause;
        if verdict == Verdict::Continue {
            self.pass_response(s);
        }
        self.end_if_answered(s);
    }

    fn response_trailers(&mut self, s: usize) {
        let st = self.streams[s].clone();
        if st.ended {
            return;
        }
        let w = st.worker;
        let now = self.worker_now(w);
        self.streams[s].resp_end_seen = true;
        let buffer = st.resp_buffer.clone();
        let step = self.call(w, |wk| {
            wk.on_response_trailers(st.sid, &mut |n| read(&buffer, n), now)
        });
        let verdict = match step {
            Some(step) => self.perform(w, Current::Response(s), step.verdict, step.effects),
            None => Verdict::Continue,
        };
        self.streams[s].resp_paused = verdict == Verdict::Pause;
        if verdict == Verdict::Continue {
            self.pass_response(s);
        }
        self.end_if_answered(s);
    }

    /// What Envoy holds of the response goes to the client.
    fn pass_response(&mut self, s: usize) {
        let st = &mut self.streams[s];
        if st.client.local {
            return;
        }
        if let Some(head) = &st.resp_head {
            if !st.resp_head_passed {
                st.resp_head_passed = true;
                st.client.status = Some(head.status);
                st.client.headers = head.headers.clone();
            }
        }
        let data = std::mem::take(&mut st.resp_buffer);
        st.client.body.extend_from_slice(&data);
        if st.resp_end_seen && st.resp_head_passed {
            st.client.complete = true;
        }
    }

    /// A stream whose client has its whole answer is over (Envoy calls `on_done`).
    fn end_if_answered(&mut self, s: usize) {
        if self.streams[s].client.complete && !self.streams[s].ended {
            check::answered(self, s);
            self.end_stream(s, false);
        }
    }

    /// The stream ends: the client left (`gave_up`) or the exchange is over or broke.
    fn end_stream(&mut self, s: usize, gave_up: bool) {
        if self.streams[s].ended {
            return;
        }
        self.streams[s].ended = true;
        let st = self.streams[s].clone();
        let op = st.op;
        if self.ops[op].active == Some(s) {
            self.ops[op].active = None;
            let wait = *self.c.pick(&[0u64, 100, 1_000, 3_000, 31_000]);
            self.ops[op].next_at = self.now + wait;
        }
        if !st.client.complete {
            self.log(format!(
                "stream {s} ends before its answer{}",
                if gave_up { " (the client left)" } else { "" }
            ));
        }
        // Envoy cancels the stream's callouts; an answer already on its way back is lost.
        let answered: Vec<Callout> = self
            .callouts
            .iter()
            .filter(|c| c.stream == Some(s) && !c.orphan && c.answer.is_some())
            .cloned()
            .collect();
        for c in answered {
            if let Some(answer) = &c.answer {
                self.lost_grants(
                    &c,
                    answer,
                    "its stream ended, and Envoy cancelled the callout",
                );
            }
        }
        for c in self.callouts.iter_mut() {
            if c.stream == Some(s) && !c.orphan {
                c.orphan = true;
                c.orphaned_by = "its stream ended, and Envoy cancelled the callout";
            }
        }
        let w = st.worker;
        if self.workers[w].w.is_none() || self.workers[w].generation != st.generation {
            return;
        }
        let now = self.worker_now(w);
        if let Some(effects) = self
            .call(w, |wk| Some(wk.on_stream_done(st.sid, now)))
            .flatten()
        {
            self.perform(w, Current::Stream(s), Verdict::Continue, effects);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Callouts

    fn process(&mut self, i: usize) {
        let c = self.callouts[i].clone();
        if c.cluster != UPSTREAM_CLUSTER && c.parked.is_none() && self.too_late(&c) {
            // Envoy reset it at its timeout before the state API read it (or the state API
            // dropped it at its deadline): it never runs.
            self.callouts.remove(i);
            return;
        }
        let result = if c.cluster == UPSTREAM_CLUSTER {
            self.reconcile(&c)
        } else {
            match self.outage {
                Outage::ApiDown => CalloutResult::Failed("connection refused".into()),
                Outage::Database { .. } => CalloutResult::answer(
                    503,
                    contract::Problem::new(ProblemKind::StateUnavailable, "database unavailable")
                        .to_json(),
                ),
                // Stalled: answered once the database resumes, or timed out.
                Outage::Paused => return,
                Outage::None => {
                    // (Claims look and write in one statement since the fix of path 9.)
                    let claim = matches!(c.path.as_str(), CLAIM_PATH | contract::wire::CLAIMS_PATH);
                    if self.api.previous_secret.is_some() && c.looked_up.is_none() && !claim {
                        // `scope_of` looks the record up first; the statement runs later, and
                        // other calls may run in between.
                        let scopes = crate::state_api::scopes_of(&c.path, &c.body);
                        if !scopes.is_empty() {
                            let found: Vec<Address> =
                                scopes.iter().map(|s| self.api.lookup(s)).collect();
                            let old = found.iter().filter(|a| a.0 != self.api.secret).count();
                            if old > 0 {
                                self.reach("region: a record found under the previous key secret");
                            }
                            if !(self.quiet && c.path == contract::wire::HEARTBEAT_PATH) {
                                self.log(format!(
                                    "state API {} from worker {}: looked up ({old} of {} under the previous key secret)",
                                    c.path,
                                    c.worker,
                                    found.len()
                                ));
                            }
                            self.callouts[i].looked_up = Some(found);
                            self.callouts[i].looked_at = self.now;
                            return;
                        }
                    }
                    // A request works only until its caller's deadline (the filter's timeout):
                    // one whose statement would run later is dropped before it reaches the
                    // database, and answered 503.
                    let stale = c.looked_up.is_some()
                        && self.now > c.looked_at + self.setup.callout_timeout_ms;
                    let (status, body) = if stale {
                        (
                            503,
                            contract::Problem::new(
                                ProblemKind::StateUnavailable,
                                "the request's deadline passed",
                            )
                            .to_json(),
                        )
                    } else {
                        self.api
                            .handle(&c.path, &c.body, self.now, c.looked_up.as_deref())
                    };
                    self.after_api(Some(&c));
                    if c.path == contract::wire::RELEASE_PATH && status == 200 {
                        if let Ok(r) =
                            serde_json::from_slice::<contract::wire::ReleaseRequest>(&c.body)
                        {
                            self.released.insert(r.token);
                        }
                    }
                    match self.waited(i, status, body) {
                        Some(answer) => answer,
                        // Parked: it waits for its key.
                        None => return,
                    }
                }
            }
        };
        // Heartbeats are left out of the trace unless they change something: in quiet time,
        // and the late ones nobody waits for that are refused.
        let heartbeat = c.path == contract::wire::HEARTBEAT_PATH;
        let refused = matches!(result, CalloutResult::Response { status: 409, .. });
        let routine = heartbeat && ((self.quiet && !refused) || (c.orphan && refused));
        if !routine {
            self.log(format!(
                "{} {} from worker {}{}: {}",
                if c.cluster == UPSTREAM_CLUSTER {
                    "upstream reconcile"
                } else {
                    "state API"
                },
                c.path,
                c.worker,
                if c.orphan { " (nobody waits)" } else { "" },
                describe(&result)
            ));
        }
        if c.orphan {
            // The state API answers a caller that is gone: a claim that made it the owner is
            // released at once (`batch.rs`, deliver_claim), since nothing was forwarded with it.
            for token in self.granted_tokens(&c, &result) {
                if self.api.release_for_gone_caller(token, self.now) {
                    self.reach("region: the state API released a claim whose caller was gone");
                    self.log(format!(
                        "state API releases token {token}: its caller is gone ({})",
                        c.orphaned_by
                    ));
                }
            }
            self.after_api(None);
            self.callouts.remove(i);
        } else {
            self.callouts[i].parked = None;
            self.callouts[i].answer = Some(result);
        }
    }

    /// Whether a call nobody waits for any more arrives too late to run: past its caller's
    /// deadline, unless the database held it meanwhile (a statement already sent runs when the
    /// database comes back).
    fn too_late(&self, c: &Callout) -> bool {
        let deadline = c.deadline;
        if !c.orphan || self.now <= deadline || c.looked_up.is_some() {
            return false;
        }
        let held = |start: u64, end: u64| start <= deadline && end >= c.sent_at;
        let now_held = matches!(self.outage, Outage::Paused | Outage::Database { .. })
            && self.outage_since <= deadline;
        !(now_held
            || self
                .ev
                .database_outages
                .iter()
                .any(|(start, end, _)| held(*start, *end)))
    }

    /// The next number of the run's order of dispatches and writes.
    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// What the state API did for callout `c`, for the invariants.
    fn after_api(&mut self, c: Option<&Callout>) {
        for event in self.api.take_events() {
            match event {
                Event::Granted { token, scope, how } => {
                    let freed = check::judge_grant(self, &scope, &how);
                    if let crate::state_api::Grant::New {
                        elsewhere: Some(_), ..
                    } = how
                    {
                        // The record it could not find is as good as gone from here on.
                        self.ev.record_ended(&scope, freed.clone());
                    }
                    if let crate::state_api::Grant::RetentionReuse { from, .. } = how {
                        // The reused record ended here.
                        let mut end = freed.clone();
                        end.how = end.how.replace("as a new key past its retention: ", "");
                        end.from = Some(from);
                        self.ev.record_ended(&scope, end);
                    }
                    if !freed.legit || freed.from.is_some() {
                        self.log(format!(
                            "state API: token {token} for {scope:?} granted {}",
                            freed.how
                        ));
                    }
                    if let crate::state_api::Grant::RetentionReuse { .. } = how {
                        self.reach("region: a record reused past its retention");
                    }
                    if let Some((_, rec)) = self.api.find(&scope) {
                        self.ev.retention_of.insert(token, rec.retention_ms);
                    }
                    let secret = self.api.find(&scope).map_or(self.api.secret, |(a, _)| a.0);
                    self.ev.secret_of.insert(token, secret);
                    self.ev.freed.insert(token, freed);
                    self.ev.granted_at.insert(token, self.now);
                    self.ev.last_sign.insert(token, self.now);
                    let Some(c) = c else { continue };
                    self.ev.granted_to.insert(token, (c.worker, c.generation));
                    let alive = self.workers[c.worker].w.is_some()
                        && self.workers[c.worker].generation == c.generation;
                    if !alive {
                        // Nobody will ever hear of this grant (invariant 8 leaves it out).
                        self.ev.grant_died.insert(scope);
                    }
                }
                Event::Lapsed {
                    token,
                    scope,
                    lease_ms,
                    by,
                } => {
                    self.reach("region: a lease found run out");
                    check::lapse(self, token, &scope, lease_ms, by);
                }
                Event::OwnerMarked { token, .. } => {
                    let seq = self.next_seq();
                    self.ev.owner_marks.insert(token, seq);
                    self.ev.last_sign.insert(token, self.now);
                }
                Event::HeartbeatAccepted { token, revived } => {
                    self.ev.last_sign.insert(token, self.now);
                    if let (true, Some(c)) = (revived, c) {
                        self.log(format!(
                            "state API: a heartbeat of token {token} from worker {} (sent at {}) makes its unknown record in progress again",
                            c.worker, c.sent_at
                        ));
                        check::heartbeat_after_mark(self, token, c.seq);
                    }
                }
                Event::HeartbeatOnMarked { .. } => {
                    self.reach(
                        "region: a heartbeat reached a record its owner's token marked unknown",
                    );
                }
                Event::Completed { token } => {
                    self.ev.last_sign.insert(token, self.now);
                }
                Event::Deleted {
                    token, scope, by, ..
                } => {
                    let end = check::judge_deletion(self, token, by);
                    self.ev.record_ended(&scope, end);
                }
            }
        }
    }

    /// The state API or its database goes out (`lasts`: until it comes back by itself).
    pub(crate) fn start_outage(&mut self, kind: Outage, lasts: Option<u64>) {
        self.outage = kind;
        self.outage_since = self.now;
        self.outage_until = lasts.map(|l| self.now + l);
        self.log(match kind {
            Outage::ApiDown => "state API down".to_owned(),
            Outage::Database { in_place: true } => format!(
                "database down: a backend crashed, the postmaster reinitialises in place (for {} ms)",
                lasts.unwrap_or(0)
            ),
            Outage::Database { in_place: false } => {
                format!("database restarts (for {} ms)", lasts.unwrap_or(0))
            }
            Outage::Paused => format!("database paused (for {} ms)", lasts.unwrap_or(0)),
            Outage::None => "state API up".to_owned(),
        });
    }

    fn end_outage(&mut self) {
        let (kind, since) = (self.outage, self.outage_since);
        self.outage = Outage::None;
        self.outage_until = None;
        let lasted = self.now - since;
        let over_lease = lasted > self.setup.lease_ms;
        match kind {
            Outage::Database { in_place: false } => {
                // A restart: the postmaster's start time moves, and with it serving_since.
                self.api.serving_since = self.now;
                self.reach("region: the database restarted");
            }
            Outage::Database { in_place: true } => {
                // A crash recovery in place empties the unlogged serving marker, which the
                // first check after it fills again (migration ..._serving_since_counts_from_
                // crash_recovery): serving_since moves too.
                self.api.serving_since = self.now;
                self.reach(if over_lease {
                    "region: a crash recovery in place longer than a lease"
                } else {
                    "region: a crash recovery in place"
                });
            }
            Outage::Paused | Outage::ApiDown => {
                // The state API's pulse (a beat every 250 ms) was silent: past 1 s, the lease
                // guard counts it as an outage too (the fix of path 2 without a crash).
                if lasted > PULSE_SILENCE_MS {
                    self.api.serving_since = self.now;
                }
                if kind == Outage::Paused && over_lease {
                    self.reach("region: the database paused longer than a lease");
                }
            }
            Outage::None => {}
        }
        self.log(format!("state API back after {lasted} ms ({kind:?})"));
        check::outage_ended(self, since, kind);
    }

    /// Envoy answers a forwarded request itself before the upstream's response: one of its
    /// timeouts, a payload over its limit, a reset.
    fn envoy_reply(&mut self, s: usize) {
        let (status, details, fl) = *self.c.pick(&[
            (408u16, "stream_idle_timeout", STREAM_IDLE_TIMEOUT),
            (408, "request_overall_timeout", 0),
            (408, "max_duration_timeout", DURATION_TIMEOUT),
            (413, "request_payload_too_large", 0),
            (
                503,
                "upstream_reset_before_response_started{connection_termination}",
                flags::UPSTREAM_CONNECTION_TERMINATION,
            ),
            (
                504,
                "upstream_per_try_timeout",
                flags::UPSTREAM_REQUEST_TIMEOUT,
            ),
            (0, "reset", 0),
        ]);
        if status == 0 {
            self.reach("region: Envoy reset a forwarded stream");
            self.log(format!("stream {s}: Envoy resets the stream"));
            self.end_stream(s, false);
            return;
        }
        self.router_reply(s, status, details, fl);
    }

    /// The state API's purge ran: what it deleted, for the invariants.
    fn after_purge(&mut self) {
        self.after_api(None);
    }

    /// An operator releases or purges (without force) a record whose outcome is unknown, as
    /// one would after a client's `409 outcome-unknown`.
    fn operator_action(&mut self) {
        let clock = self.api.clock(self.now);
        let candidates: Vec<Scope> = self
            .api
            .records
            .iter()
            .filter(|(a, r)| {
                (r.state == state_rules::RecordState::Unknown
                    || (r.state == state_rules::RecordState::InProgress
                        && r.lease_until <= clock.now))
                    // (The admin API finds a record where `scope_of` looks.)
                    && self.api.lookup(&a.1) == **a
            })
            .map(|((_, s), _)| s.clone())
            .collect();
        if candidates.is_empty() {
            return;
        }
        let scope = self.c.pick(&candidates).clone();
        let action = if self.c.chance(50) {
            state_rules::operator::Action::Release
        } else {
            state_rules::operator::Action::Purge
        };
        // Whether its owner was heard from within a lease (then a careful state API refuses
        // without force: the region is visited either way).
        if let Some((_, rec)) = self.api.find(&scope) {
            let silent = self
                .now
                .saturating_sub(self.ev.last_sign.get(&rec.token).copied().unwrap_or(0));
            if silent < rec.lease_ms {
                self.reach(
                    "region: an operator acted within a lease of the owner's last sign of life",
                );
            }
        }
        match self.api.operator(&scope, action, self.now) {
            Ok(rec) => {
                let silent = self
                    .now
                    .saturating_sub(self.ev.last_sign.get(&rec.token).copied().unwrap_or(0));
                // A record with an outcome is the operator's to delete at any time.
                let silent = if rec.open() { silent } else { u64::MAX };
                self.ev
                    .operator_silent
                    .insert(rec.token, (silent, rec.lease_ms));
                self.ev.operator_scopes.insert(scope.clone());
                self.reach("region: an operator released or purged a record");
                self.log(format!(
                    "an operator {:?}s {scope:?} (token {}, {:?}, its owner last heard of {silent} ms ago)",
                    action, rec.token, rec.state
                ));
            }
            Err(why) => {
                if why.is_some() {
                    self.reach("region: an operator was refused without force");
                }
                self.log(format!(
                    "an operator's {action:?} of {scope:?} is refused ({why:?})"
                ));
            }
        }
        self.after_api(None);
    }

    /// A heartbeat (its body) failed as its owner hears it (invariant 6 counts them).
    fn heartbeat_failed(&mut self, body: &[u8], path: &str) {
        if path != contract::wire::HEARTBEAT_PATH {
            return;
        }
        if let Ok(h) = serde_json::from_slice::<contract::wire::HeartbeatRequest>(body) {
            self.ev
                .heartbeat_failures
                .entry(h.token)
                .or_default()
                .push(self.now);
        }
    }

    /// A claim answer the state API committed (a grant) that never reaches the filter: noted
    /// for invariant 8, and a region visited.
    fn lost_grants(&mut self, c: &Callout, result: &CalloutResult, how: &str) {
        let granted = self.granted_tokens(c, result);
        for token in granted {
            let Some(scope) = self.api.issued.get(&token).cloned() else {
                continue;
            };
            self.reach(match how {
                h if h.contains("cancelled") => {
                    "region: a claim answer lost after its commit (the callout cancelled)"
                }
                h if h.contains("unreadable") => {
                    "region: a claim answer lost after its commit (unreadable)"
                }
                h if h.contains("timeout") || h.contains("timed out") => {
                    "region: a claim answer lost after its commit (timed out)"
                }
                _ => "region: a claim answer lost after its commit (the callout failed)",
            });
            self.ev.lost_grants.entry(scope).or_insert_with(|| {
                format!("the state API committed its claim (token {token}), and the answer never reached the filter ({how})")
            });
        }
    }

    /// The tokens a claim call's answer grants.
    fn granted_tokens(&self, c: &Callout, result: &CalloutResult) -> Vec<i64> {
        if !matches!(
            c.path.as_str(),
            CLAIM_PATH | contract::wire::CLAIMS_PATH | WRITES_PATH
        ) {
            return Vec::new();
        }
        let CalloutResult::Response {
            status: 200, body, ..
        } = result
        else {
            return Vec::new();
        };
        if c.path == CLAIM_PATH {
            return match contract::wire::ClaimResponse::read(body) {
                Ok(contract::wire::ClaimResponse::Claimed { token, .. }) => vec![token],
                _ => Vec::new(),
            };
        }
        serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|b| {
                let answers = b.get("answers")?.as_array()?.clone();
                Some(
                    answers
                        .iter()
                        .filter_map(|a| a.get("answer")?.get("token")?.as_i64())
                        .collect(),
                )
            })
            .unwrap_or_default()
    }

    /// A claim that asked to wait and found its key in progress waits (`None`), within the
    /// state API's bound of waiters; once parked, the answer that ends its wait says how long
    /// it waited (as `http.rs` does).
    fn waited(&mut self, i: usize, status: u16, body: Vec<u8>) -> Option<CalloutResult> {
        use contract::wire::{ClaimRequest, ClaimResponse};
        let c = &self.callouts[i];
        let wait_ms = (c.path == CLAIM_PATH && status == 200)
            .then(|| serde_json::from_slice::<ClaimRequest>(&c.body).ok())
            .flatten()
            .and_then(|r| r.wait_ms)
            .map_or(0, |w| w.min(self.setup.state_api.max_wait_ms));
        let answer = ClaimResponse::read(&body).ok();
        let running = matches!(answer, Some(ClaimResponse::InProgress { .. }));
        let parked = c.parked;
        let waiters = self
            .callouts
            .iter()
            .filter(|c| c.parked.is_some() && !c.orphan)
            .count();
        let waited_ms = match parked {
            None if wait_ms > 0 && running && waiters < self.setup.state_api.max_waiters => {
                self.reach("sim.claim_waits");
                self.log(format!(
                    "state API {CLAIM_PATH} from worker {}: in progress, waits up to {wait_ms} ms",
                    self.callouts[i].worker
                ));
                self.callouts[i].parked = Some(Parked {
                    since: self.now,
                    until: self.now + wait_ms,
                });
                return None;
            }
            None => return Some(CalloutResult::answer(status, body)),
            Some(p) if running && self.now < p.until => return None,
            Some(p) => self.now - p.since,
        };
        self.callouts[i].parked = None;
        let answer = match answer {
            Some(ClaimResponse::InProgress {
                retry_after_s,
                lease_remaining_ms,
                ..
            }) => {
                self.reach("sim.wait_timed_out");
                ClaimResponse::InProgress {
                    retry_after_s,
                    lease_remaining_ms,
                    waited_ms: Some(waited_ms),
                }
            }
            Some(ClaimResponse::Completed {
                response,
                expires_in_ms,
                ..
            }) => {
                self.reach("sim.wait_settled");
                ClaimResponse::Completed {
                    response,
                    expires_in_ms,
                    waited_ms: Some(waited_ms),
                }
            }
            Some(other) => {
                self.reach("sim.wait_settled");
                other
            }
            None => return Some(CalloutResult::answer(status, body)),
        };
        Some(CalloutResult::answer(
            status,
            serde_json::to_vec(&answer).unwrap_or_default(),
        ))
    }

    /// Whether processing callout `i` now would answer it (a parked claim waits on while its
    /// key runs and its wait lasts).
    fn answerable(&self, i: usize) -> bool {
        let c = &self.callouts[i];
        if self.outage == Outage::Paused && c.cluster != UPSTREAM_CLUSTER {
            return false;
        }
        let Some(p) = c.parked else { return true };
        if self.now >= p.until || self.outage != Outage::None {
            return true;
        }
        serde_json::from_slice::<contract::wire::ClaimRequest>(&c.body)
            .map(|r| !self.api.running(&(r.key, r.subject, r.endpoint), self.now))
            .unwrap_or(true)
    }

    /// The first callout the state API has to handle and can answer now.
    fn ready_callout(&self) -> Option<usize> {
        (0..self.callouts.len()).find(|&i| self.callouts[i].answer.is_none() && self.answerable(i))
    }

    /// The upstream's reconcile endpoint (through Envoy: down, it is the router's 503).
    fn reconcile(&mut self, c: &Callout) -> CalloutResult {
        let header = |name: &str| {
            c.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let (Some(key), Some(subject), Some(token)) = (
            header("idempotency-key"),
            header(contract::wire::SUBJECT_HEADER),
            header(FENCING_TOKEN_HEADER).and_then(|t| t.parse::<i64>().ok()),
        ) else {
            self.violations.push(format!(
                "a reconcile without its key, subject or token: {:?}",
                c.headers
            ));
            return CalloutResult::Failed("bad reconcile".into());
        };
        // The reference's reconcile endpoints; the key is the path's last segment (the subject,
        // token, endpoint and fingerprint come as headers).
        let served = matches!(
            c.path.rsplit_once("/attempts/"),
            Some(("/checkout" | "/shop" | "/donate", k)) if k == key
        );
        if !served {
            self.violations
                .push(format!("a reconcile at {} for key {key}", c.path));
            return CalloutResult::Failed("bad reconcile".into());
        }
        if self.upstream_down {
            return CalloutResult::answer(503, b"upstream connect error".to_vec());
        }
        if self.fault(Faults::UPSTREAM) && self.c.chance(5) {
            // A reconcile endpoint that answers garbage.
            self.reach("sim.reconcile_garbage");
            return CalloutResult::Response {
                status: 200,
                headers: vec![(contract::wire::OUTCOME_HEADER.into(), "perhaps".into())],
                body: b"<html>".to_vec(),
            };
        }
        let (Some(endpoint), Some(fingerprint)) = (
            header(contract::wire::ENDPOINT_HEADER),
            header(contract::wire::FINGERPRINT_HEADER),
        ) else {
            // The reference refuses a reconcile that does not name its request.
            return CalloutResult::answer(400, b"{\"type\":\"/problems/bad-reconcile\"}".to_vec());
        };
        let a = self.upstream.reconcile(
            crate::upstream::AttemptScope {
                endpoint,
                subject,
                key,
                fingerprint: Some(fingerprint),
            },
            token,
        );
        if let Some(s) = c.stream {
            let scope = self.ops[self.streams[s].op].scope();
            if scope.2 != "POST /checkout" {
                self.reach("region: a reconcile on a prefix or key_from route");
            }
            self.ev.reconcile_answers.push((
                scope,
                Produced {
                    status: a.status,
                    headers: a.headers.clone(),
                    body: a.body.clone(),
                },
            ));
        }
        CalloutResult::Response {
            status: a.status,
            headers: a.headers,
            body: a.body,
        }
    }

    fn deliver(&mut self, i: usize) {
        if self.callouts[i].answer.is_none() {
            return;
        }
        let mut c = self.callouts.remove(i);
        let Some(result) = c.answer.take() else {
            return;
        };
        self.deliver_result(&c, result);
    }

    fn deliver_result(&mut self, c: &Callout, result: CalloutResult) {
        let w = c.worker;
        if self.workers[w].w.is_none() || self.workers[w].generation != c.generation {
            return;
        }
        if let Some(s) = c.stream {
            if self.streams[s].ended {
                return;
            }
            if c.path == CLAIM_PATH {
                if let CalloutResult::Response { status, .. } = &result {
                    if (400..500).contains(status) {
                        self.streams[s].claim_refused = true;
                    }
                }
            }
        }
        if c.path == WRITES_PATH {
            self.note_refused_in_batch(c, &result);
        }
        if !matches!(result, CalloutResult::Response { status: 200, .. }) {
            self.heartbeat_failed(&c.body, &c.path);
        }
        let now = self.worker_now(w);
        let id = c.id;
        let Some(step) = self
            .call(w, |wk| Some(wk.on_callout_answer(id, result, now)))
            .flatten()
        else {
            return;
        };
        let current = match c.stream {
            Some(s) => Current::Stream(s),
            None => Current::Root(w),
        };
        self.perform(w, current, step.verdict, step.effects);
        if let Some(s) = c.stream {
            self.end_if_answered(s);
        }
    }

    /// The streams of a `/v1/writes` whose claim the state API refused (a 4xx, of the whole
    /// call or of their item), as for a claim of their own.
    fn note_refused_in_batch(&mut self, c: &Callout, result: &CalloutResult) {
        let w = c.worker;
        let Some((streams, _)) = self.workers[w]
            .w
            .as_ref()
            .and_then(|wk| wk.batch_streams(c.id))
        else {
            return;
        };
        // Held responses' completes and those the worker took over, as sent.
        let completes = serde_json::from_slice::<contract::wire::WriteBatchRequest>(&c.body)
            .map_or(0, |b| b.completes.len());
        let refused: Vec<bool> = match result {
            CalloutResult::Response { status, body, .. } if (200..300).contains(status) => {
                contract::wire::BatchResponse::read_both(body, streams.len(), completes)
                    .map(|(items, _)| {
                        items
                            .iter()
                            .map(|i| (400..500).contains(&i.status))
                            .collect()
                    })
                    .unwrap_or_default()
            }
            CalloutResult::Response { status, .. } if (400..500).contains(status) => {
                vec![true; streams.len()]
            }
            _ => Vec::new(),
        };
        for (sid, refused) in streams.into_iter().zip(refused) {
            let found = self.streams.iter().position(|s| {
                s.worker == w && s.generation == self.workers[w].generation && s.sid == sid
            });
            if let (true, Some(s)) = (refused, found) {
                self.streams[s].claim_refused = true;
            }
        }
    }

    pub(crate) fn fail_callout(&mut self, i: usize) {
        let why = *self
            .c
            .pick(&["reset", "timeout", "503", "refused", "unreadable"]);
        match why {
            "refused" => self.refuse_callout(i),
            "unreadable" => self.garble_callout(i),
            _ => self.fail_callout_with(i, why),
        }
    }

    /// The answer arrives cut short (a proxy in between, a bad frame): the filter cannot read
    /// what the state API did.
    fn garble_callout(&mut self, i: usize) {
        let c = self.callouts[i].clone();
        let Some(CalloutResult::Response { status, body, .. }) = &c.answer else {
            return self.fail_callout_with(i, "reset");
        };
        if c.orphan {
            return;
        }
        self.callouts.remove(i);
        let cut = body[..body.len() / 2].to_vec();
        self.log(format!(
            "callout {} of worker {}: its answer arrives cut short",
            c.path, c.worker
        ));
        let result = CalloutResult::answer(*status, cut);
        self.lost_grants(
            &c,
            c.answer.as_ref().unwrap_or(&result),
            "its answer was unreadable",
        );
        self.deliver_result(&c, result);
    }

    /// The state API refuses a call it has not handled (a 4xx: a misconfigured token, a
    /// contract mismatch): nothing changed there, and the caller is told so.
    fn refuse_callout(&mut self, i: usize) {
        let c = self.callouts[i].clone();
        if c.orphan || c.answer.is_some() || c.cluster == UPSTREAM_CLUSTER {
            return self.fail_callout_with(i, "reset");
        }
        self.callouts.remove(i);
        self.log(format!(
            "state API refuses {} from worker {} (401)",
            c.path, c.worker
        ));
        if c.path == contract::wire::COMPLETE_PATH {
            if let Ok(r) = serde_json::from_slice::<contract::wire::CompleteRequest>(&c.body) {
                // Its status alone may be stored instead: not replayable, by design.
                self.refused_completes
                    .insert((r.key, r.subject, r.endpoint));
            }
        }
        if c.path == WRITES_PATH {
            if let Ok(b) = serde_json::from_slice::<contract::wire::WriteBatchRequest>(&c.body) {
                for r in b.completes {
                    self.refused_completes
                        .insert((r.key, r.subject, r.endpoint));
                }
            }
        }
        let problem = contract::Problem::new(ProblemKind::Unauthenticated, "refused").to_json();
        self.deliver_result(&c, CalloutResult::answer(401, problem));
    }

    /// Envoy reports the callout failed; a call not handled yet may still reach the state API
    /// later (nobody waits for its answer then).
    pub(crate) fn fail_callout_with(&mut self, i: usize, why: &str) {
        let c = self.callouts[i].clone();
        if c.orphan {
            return;
        }
        if let Some(answer) = &c.answer {
            // Handled, but the answer is lost on the way back.
            self.lost_grants(&c, answer, &format!("the callout failed: {why}"));
            self.callouts.remove(i);
        } else {
            self.callouts[i].orphan = true;
            self.callouts[i].orphaned_by = if why == "timeout" {
                "the callout timed out"
            } else {
                "the callout failed"
            };
        }
        let result = if why == "503" {
            CalloutResult::answer(503, b"upstream connect error".to_vec())
        } else {
            CalloutResult::Failed(why.to_owned())
        };
        if c.path != contract::wire::HEARTBEAT_PATH {
            // (A heartbeat's failure is counted, not traced: during an outage there is one a tick.)
            self.log(format!(
                "callout {} of worker {} fails ({why})",
                c.path, c.worker
            ));
        }
        self.deliver_result(&c, result);
    }

    // -----------------------------------------------------------------------------------------
    // Workers

    fn tick(&mut self, w: usize) {
        let now = self.worker_now(w);
        if let Some(effects) = self.call(w, |wk| Some(wk.on_tick(now))).flatten() {
            self.perform(w, Current::Root(w), Verdict::Continue, effects);
        }
    }

    fn wake(&mut self, w: usize) {
        self.workers[w].wake_requested = false;
        let now = self.worker_now(w);
        if let Some(effects) = self.call(w, |wk| Some(wk.on_wake(now))).flatten() {
            self.perform(w, Current::Root(w), Verdict::Continue, effects);
        }
    }

    /// Envoy is killed: its memory is gone, its streams vanish without `on_done`, its callouts'
    /// answers go nowhere (the calls may still reach the state API).
    fn kill(&mut self, w: usize) {
        self.reach("sim.worker_killed");
        self.log(format!("worker {w} is killed"));
        let generation = self.workers[w].generation;
        let open: Vec<Scope> = self
            .ev
            .granted_to
            .iter()
            .filter(|(_, at)| **at == (w, generation))
            .filter_map(|(t, _)| {
                let scope = self.api.issued.get(t)?;
                let (_, rec) = self.api.find(scope)?;
                (rec.token == *t && rec.open()).then(|| scope.clone())
            })
            .collect();
        self.ev.grant_died.extend(open);
        self.workers[w].w = None;
        self.workers[w].wake_requested = false;
        for s in 0..self.streams.len() {
            if self.streams[s].worker == w && !self.streams[s].ended {
                self.streams[s].ended = true;
                let op = self.streams[s].op;
                if self.ops[op].active == Some(s) {
                    self.ops[op].active = None;
                    self.ops[op].next_at = self.now;
                }
            }
        }
        for c in self.callouts.iter_mut() {
            if c.worker == w && !c.orphan {
                c.orphan = true;
                c.orphaned_by = "its worker died";
            }
        }
    }

    fn restart(&mut self, w: usize) {
        self.workers[w].generation += 1;
        self.workers[w].next_sid = 0;
        self.workers[w].steady_ms = steady_origin(w, self.workers[w].generation);
        self.workers[w].w = Some(new_worker(&self.cfg, w, self.workers[w].generation));
        self.log(format!("worker {w} starts again"));
    }

    /// Calls into a worker, catching a panic (a violation: it would kill the Wasm VM).
    fn call<T>(&mut self, w: usize, f: impl FnOnce(&mut Worker) -> T) -> Option<T> {
        let wk = self.workers[w].w.as_mut()?;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(wk))) {
            Ok(v) => Some(v),
            Err(e) => {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                self.violations.push(format!("the filter panicked: {msg}"));
                self.workers[w].w = None;
                None
            }
        }
    }

    /// Carries out effects with the glue's own rules ([`filter_core::host::perform`]), this
    /// model of Envoy as the host; returns the callback's verdict.
    fn perform(
        &mut self,
        w: usize,
        current: Current,
        verdict: Verdict,
        effects: Vec<Effect>,
    ) -> Verdict {
        let sid = |s: usize| self.streams[s].sid;
        let current = match current {
            Current::Request(s) => HostCurrent::Request(sid(s)),
            Current::Response(s) => HostCurrent::Response(sid(s)),
            Current::Stream(s) => HostCurrent::Stream(sid(s)),
            Current::Root(_) => HostCurrent::Root,
        };
        let mut envoy = Envoy {
            world: self,
            w,
            current,
        };
        filter_core::host::perform(&mut envoy, verdict, effects)
    }

    // -----------------------------------------------------------------------------------------
    // Draining

    /// No more faults: everything in flight is delivered, every worker ticks until its writes
    /// are done, leases run out.
    pub(crate) fn drain(&mut self) {
        self.faults = false;
        if self.outage != Outage::None {
            self.end_outage();
        }
        self.upstream_down = false;
        self.log("drain: no more faults".into());
        for w in 0..self.workers.len() {
            if self.workers[w].w.is_none() {
                self.restart(w);
            }
        }
        for _ in 0..400 {
            let mut busy = false;
            if let Some(i) = self.ready_callout() {
                self.process(i);
                busy = true;
            } else if let Some(i) = self
                .callouts
                .iter()
                .position(|c| !c.orphan && c.answer.is_some())
            {
                self.deliver(i);
                busy = true;
            } else if let Some(s) = (0..self.streams.len()).find(|&s| {
                let st = &self.streams[s];
                !st.ended && st.parts_sent < st.request_parts() && st.client.status.is_none()
            }) {
                self.send_part(s);
                busy = true;
            } else if let Some(s) = (0..self.streams.len()).find(|&s| self.streams[s].in_transit) {
                self.arrive(s);
                busy = true;
            } else if let Some(s) = (0..self.streams.len()).find(|&s| {
                let st = &self.streams[s];
                st.forwarded.is_some() && !st.ended && !st.resp_end_seen && !st.router_reply
            }) {
                self.upstream_part(s);
                busy = true;
            } else if let Some(op) = (0..self.ops.len())
                .find(|&o| self.ops[o].active.is_none() && self.ops[o].attempts_left > 0)
            {
                self.ops[op].next_at = self.now;
                self.new_attempt(op, None);
                busy = true;
            }
            if !self.violations.is_empty() {
                return;
            }
            if !busy {
                let pending = self.workers.iter().any(|w| {
                    w.w.as_ref().is_some_and(|wk| {
                        let u = wk.usage();
                        u.writes > 0 || u.claims > 0 || u.batched_claims + u.batched_writes > 0
                    })
                });
                if !pending {
                    break;
                }
                for w in 0..self.workers.len() {
                    if self.workers[w].wake_requested {
                        self.wake(w);
                    }
                }
                self.advance(1_000);
            }
            check::after_step(self);
        }
        // Claims still waiting for their key get their answer now: their wait ends before the
        // time skipped below.
        for c in self.callouts.iter_mut() {
            if let Some(p) = c.parked.as_mut() {
                p.until = p.until.min(self.now);
            }
        }
        self.timeouts();
        // Past every lease: a dead owner's key is decided by the state API now, and every
        // execution whose caller left has finished.
        self.now += self.setup.lease_ms + 1;
        for e in 0..self.upstream.executions.len() {
            self.commit(e);
        }
        for w in 0..self.workers.len() {
            self.workers[w].skew_ms = 0;
        }
    }

    /// The final retry of `op` through a worker, run to its answer without faults.
    pub fn final_retry(&mut self, op: usize) -> Option<ClientView> {
        self.ops[op].attempts_left = 1;
        self.ops[op].active = None;
        let w = self.c.below(self.workers.len() as u32) as usize;
        self.new_attempt(op, Some(w));
        let s = self.ops[op].active.or(Some(self.streams.len() - 1))?;
        for _ in 0..200 {
            if self.streams[s].client.complete || self.streams[s].ended {
                break;
            }
            if let Some(i) = self.ready_callout() {
                self.process(i);
            } else if let Some(i) = self
                .callouts
                .iter()
                .position(|c| !c.orphan && c.answer.is_some())
            {
                self.deliver(i);
            } else if self.streams[s].parts_sent < self.streams[s].request_parts() {
                self.send_part(s);
            } else if self.streams[s].in_transit {
                self.arrive(s);
            } else if self.streams[s].forwarded.is_some() && !self.streams[s].resp_end_seen {
                self.upstream_part(s);
            } else {
                self.advance(1_000);
            }
        }
        Some(self.streams[s].client.clone())
    }
}

/// Envoy around one callback of worker `w`: the host the shared interpreter carries the
/// worker's effects out with.
impl World {
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

struct Envoy<'a> {
    world: &'a mut World,
    w: usize,
    current: HostCurrent,
}

impl Envoy<'_> {
    /// The index of stream `sid` of this worker (its current life).
    fn stream_of(&self, sid: StreamId) -> Option<usize> {
        let world = &*self.world;
        let w = self.w;
        world.streams.iter().position(|s| {
            s.worker == w && s.generation == world.workers[w].generation && s.sid == sid
        })
    }
}

impl Host for Envoy<'_> {
    fn current(&self) -> HostCurrent {
        self.current
    }

    fn with_worker<T>(&mut self, f: impl FnOnce(&mut Worker, u64) -> T) -> Option<T> {
        let now = self.world.worker_now(self.w);
        self.world.call(self.w, |wk| f(wk, now))
    }

    fn reply(&mut self, stream: StreamId, reply: LocalReply) {
        let Some(s) = self.stream_of(stream) else {
            return;
        };
        let world = &mut *self.world;
        if world.streams[s].forwarded.is_some() && world.streams[s].resp_head_passed {
            world.violations.push(format!(
                "stream {s}: a local reply after the response began"
            ));
        }
        world.log(format!(
            "stream {s}: filter answers {} {}{}",
            reply.status,
            problem_type(&reply.body),
            if reply
                .headers
                .iter()
                .any(|(n, _)| n == "idempotent-replayed")
            {
                " (replay)"
            } else {
                ""
            }
        ));
        world.streams[s].client = ClientView {
            status: Some(reply.status),
            headers: reply.headers,
            body: reply.body,
            complete: true,
            local: true,
        };
    }

    fn set_request_header(&mut self, stream: StreamId, name: &'static str, value: String) {
        if let Some(s) = self.stream_of(stream) {
            let hs = &mut self.world.streams[s].headers;
            hs.retain(|(n, _)| n != name);
            hs.push((name.to_owned(), value));
        }
    }

    fn remove_request_header(&mut self, stream: StreamId, name: &'static str) {
        if let Some(s) = self.stream_of(stream) {
            self.world.streams[s].headers.retain(|(n, _)| n != name);
        }
    }

    fn resume_request(&mut self, stream: StreamId) {
        if let Some(s) = self.stream_of(stream) {
            self.world.forward(s);
        }
    }

    fn resume_response(&mut self, stream: StreamId) {
        if let Some(s) = self.stream_of(stream) {
            self.world.streams[s].resp_paused = false;
            self.world.pass_response(s);
            self.world.end_if_answered(s);
        }
    }

    fn dispatch(&mut self, d: Dispatch) -> Result<(), String> {
        let stream = match d.owner {
            Owner::Stream(sid) => self.stream_of(sid),
            Owner::Worker => None,
        };
        let world = &mut *self.world;
        if world.fault(Faults::CALLOUT) && world.c.chance(2) {
            world.heartbeat_failed(&d.body, d.header(":path").unwrap_or(""));
            return Err("dispatch failed".into());
        }
        if world.partitioned == Some(self.w) && d.cluster != UPSTREAM_CLUSTER {
            // Cut off from the state API (the model checker's partition).
            world.heartbeat_failed(&d.body, d.header(":path").unwrap_or(""));
            return Err("no route to the state API".into());
        }
        let path = d.header(":path").unwrap_or("").to_owned();
        let seq = world.next_seq();
        world.callouts.push(Callout {
            id: d.id,
            worker: self.w,
            generation: world.workers[self.w].generation,
            owner: d.owner,
            stream,
            cluster: d.cluster,
            path,
            headers: d.headers,
            body: d.body,
            deadline: world.now + d.timeout_ms,
            answer: None,
            orphan: false,
            orphaned_by: "",
            parked: None,
            seq,
            sent_at: world.now,
            looked_at: 0,
            looked_up: None,
        });
        Ok(())
    }

    fn misplaced_callout(&mut self, d: &Dispatch) {
        let current = self.current;
        self.world.violations.push(format!(
            "a callout of {:?} made from {current:?} (Envoy would answer it elsewhere)",
            d.owner
        ));
    }

    fn wake(&mut self) {
        self.world.workers[self.w].wake_requested = true;
    }

    fn count(&mut self, m: Metric) {
        self.world.reach(m.name());
    }

    fn log(&mut self, level: Level, msg: String) {
        if msg.contains("given up")
            || msg.contains("was not stored after")
            || msg.contains("is not sent")
        {
            // A write given up (a complete, a release, an abandon, an unknown mark): the
            // endpoint it names (its log names no key) is left out of invariant 8.
            let endpoint = msg
                .find("POST /")
                .map(|at| msg[at..].split(' ').take(2).collect::<Vec<_>>().join(" "));
            match endpoint {
                Some(e) => {
                    self.world.ev.gave_up_for.insert(e);
                }
                None => self.world.ev.gave_up_a_write = true,
            }
        }
        if let Some(token) = given_up_for_time(&msg) {
            self.world
                .reach("region: a write given up after complete_retry_ms");
            check::gave_up(self.world, self.w, token);
        }
        let world = &mut *self.world;
        let routine = msg.starts_with("heartbeat failed");
        if !routine && matches!(level, Level::Warn | Level::Error) {
            let msg: String = if msg.len() > 240 {
                format!("{}…", msg.chars().take(240).collect::<String>())
            } else {
                msg
            };
            world.log(format!("worker {} logs: {msg}", self.w));
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Action {
    NewAttempt(usize),
    SendPart(usize),
    GiveUp(usize),
    Process(usize),
    Deliver(usize),
    FailCallout(usize),
    UpstreamPart(usize),
    Arrive(usize),
    UpstreamFinish(usize),
    Tick(usize),
    Wake(usize),
    Kill(usize),
    Restart(usize),
    ToggleApi,
    DatabaseOutage,
    ToggleUpstream,
    SkewClock,
    EnvoyReply(usize),
    RotateSecret,
    DropPreviousSecret,
    Operator,
    Purge,
    Advance,
}

/// Where the monotonic clock of worker `index`'s life `generation` starts (any origin will do:
/// the worker only ever compares its own readings).
fn steady_origin(index: usize, generation: u32) -> u64 {
    5_000_000 * (index as u64 + 1) + 1_000 * u64::from(generation)
}

/// A worker VM as the glue configures it: named for its claim nonces, uniquely among the
/// workers and their restarts (the glue uses its clock at configuration and root context).
fn new_worker(cfg: &Config, index: usize, generation: u32) -> Worker {
    let mut w = Worker::new(cfg.clone());
    w.set_instance(&format!("w{index}g{generation}"));
    w
}

/// The token of a write the worker gave up because `complete_retry_ms` passed (its log line:
/// "... given up after N retries (still failing after M ms; token T) ...").
fn given_up_for_time(msg: &str) -> Option<i64> {
    if !msg.contains("still failing after") {
        return None;
    }
    let rest = &msg[msg.find("; token ")? + "; token ".len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Envoy's buffer read: `n` bytes, none for an empty buffer (as Envoy gives no buffer then).
fn read(buffer: &[u8], n: usize) -> Option<Vec<u8>> {
    if n == 0 || n > buffer.len() {
        None
    } else {
        Some(buffer[..n].to_vec())
    }
}

/// The same JSON value written in another member order and spacing.
fn reorder(body: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(m)) => {
            let mut out = String::from("{ ");
            let members: Vec<String> = m
                .iter()
                .rev()
                .map(|(k, v)| format!("{} : {}", serde_json::Value::String(k.clone()), v))
                .collect();
            out.push_str(&members.join(" , "));
            out.push_str(" }");
            out.into_bytes()
        }
        _ => body.to_vec(),
    }
}

/// Another request: a nested value changed.
fn changed(body: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(mut v @ serde_json::Value::Object(_)) => {
            if let Some(card) = v.get_mut("card") {
                card["number"] = "0000".into();
            } else {
                v["amount"] = 999.into();
            }
            serde_json::to_vec(&v).unwrap_or_default()
        }
        _ => b"{\"other\":true}".to_vec(),
    }
}

/// Bytes standing for a gzip body (only their identity matters here).
fn gzipish(body: &[u8]) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 0x08, 0x00];
    out.extend(body.iter().map(|b| b ^ 0x5a));
    out
}

fn short(path: &str) -> String {
    if path.len() > 40 {
        format!("{}…({} bytes)", &path[..20], path.len())
    } else {
        path.to_owned()
    }
}

pub fn problem_type(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_default()
}

pub fn describe(r: &CalloutResult) -> String {
    match r {
        CalloutResult::Failed(why) => format!("failed ({why})"),
        CalloutResult::Response {
            status,
            headers,
            body,
        } => {
            let outcome = headers
                .iter()
                .find(|(n, _)| n == contract::wire::OUTCOME_HEADER)
                .map(|(_, v)| format!("{}: {v} ", contract::wire::OUTCOME_HEADER))
                .unwrap_or_default();
            let text = String::from_utf8_lossy(body);
            let text: String = text.chars().take(140).collect();
            format!("{status} {outcome}{text}")
        }
    }
}
