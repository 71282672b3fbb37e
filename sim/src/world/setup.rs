//! What a schedule runs with: its parameters drawn per run (including the dangerous ends), the
//! filter's configuration they make, and the clients' operations.

use super::clients::Op;
use super::faults::Faults;
use super::{Invariants, World, UPSTREAM_CLUSTER};
use crate::choice::Choices;
use crate::state_api::{StateApiConfig, UNKNOWN_RETENTION_MS};

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
    /// The route carries a `retry_policy` (5xx, reset, connect failure; one retry), as
    /// Istio's default route does: the router sends a forwarded request again unless the
    /// filter forbade it (`x-envoy-max-retries: 0`).
    pub route_retries: bool,
    /// The HTTP connection manager's timeouts (Envoy answers 408 when one runs out before the
    /// response): `stream_idle_timeout`, `request_timeout`, `max_stream_duration`.
    pub idle_timeout_ms: u64,
    pub request_timeout_ms: Option<u64>,
    pub max_stream_duration_ms: Option<u64>,
    pub max_stored_body_bytes: usize,
    pub complete_retry_ms: u64,
    /// The most local replies one callback of a worker sends (Envoy's host: 16); the rest wait
    /// for the worker's next wake or tick. 1 lets a few streams reach the deferral.
    pub replies_per_callback: usize,
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
            // (Derived, not drawn, so that every earlier seed keeps its schedule: a twelfth of
            // the runs, none of the regression seeds', which keep running what they found.)
            // Buffering bounds a few of these bodies fill, so that a subject's share and the
            // worker's bound refuse some (503 edge-buffers-full).
            tight_buffers: retention_s == Some(5) && complete_retry_ms == 30_000,
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
        // How long an unknown outcome is kept: the state API's week, or (derived, not drawn, so
        // that every earlier seed keeps its schedule) a horizon short enough to pass in a run.
        let unknown_retention_ms = match retention_s {
            Some(1) => 4_000,
            Some(60) => 180_000,
            _ => UNKNOWN_RETENTION_MS,
        };
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
            // (Derived, not drawn, so that every earlier seed keeps its schedule: the runs with
            // the short route timeout.)
            route_retries: route_timeout_ms == 10_000,
            idle_timeout_ms: *c.pick(&[300_000, 300_000, 15_000, 2_000]),
            request_timeout_ms: *c.pick(&[None, None, Some(20_000)]),
            max_stream_duration_ms: *c.pick(&[None, None, Some(8_000)]),
            max_stored_body_bytes: max_stored,
            complete_retry_ms,
            // (Derived, not drawn, so that every earlier seed keeps its setup: the runs whose
            // workers hold many waiters, the ones that answer several streams in one callback.)
            replies_per_callback: if max_waiters == 64 {
                1
            } else {
                filter_core::host::REPLIES_PER_CALLBACK
            },
            state_api: StateApiConfig {
                default_lease_ms: 30_000,
                max_lease_ms: if lease_ms == 4_000 {
                    1_500
                } else {
                    crate::state_api::MAX_LEASE_MS
                },
                retention_ms,
                max_retention_ms: retention_ms,
                unknown_retention_ms,
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
    /// Requests of at most [`TIGHT_MAX_BODY`] bytes, a worker's buffering bound of
    /// [`TIGHT_BOUND`] (a subject's share: the largest body): two of the schedules' bodies fill
    /// a share, three the bound.
    pub tight_buffers: bool,
}

/// The largest request body in a run with tight buffers (the schedules' bodies are at most
/// about 50 bytes), and the worker's buffering bound there.
pub const TIGHT_MAX_BODY: u64 = 64;
pub const TIGHT_BOUND: u64 = 80;

impl FilterParams {
    /// The filter's plugin configuration (JSON).
    pub fn config(&self) -> String {
        let retention = match self.retention_s {
            Some(r) => format!(r#", "retention_s": {r}"#),
            None => String::new(),
        };
        let (max_body, buffers) = if self.tight_buffers {
            (
                TIGHT_MAX_BODY,
                format!(r#""max_buffered_bytes": {TIGHT_BOUND},"#),
            )
        } else {
            (4096, String::new())
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
  "max_request_body_bytes": {max_body},{buffers}
  "max_stored_body_bytes": {max_stored},
  "lease_ms": {lease_ms},
  "heartbeat_ms": {heartbeat_ms},
  "replay_cache_bytes": {cache_bytes},
  "complete_retry_bytes": 4096,
  "complete_retry_ms": {complete_retry_ms},
  "complete_in_background": {background},
  "max_waiters": {max_waiters}
}}"#,
            callout_timeout_ms = self.callout_timeout_ms,
            reconcile_timeout_ms = self.reconcile_timeout_ms,
            max_stored = self.max_stored,
            lease_ms = self.lease_ms,
            heartbeat_ms = self.heartbeat_ms,
            cache_bytes = if self.cache { 8192 } else { 0 },
            complete_retry_ms = self.complete_retry_ms,
            background = self.background,
            max_waiters = self.max_waiters,
        )
    }
}

const SUBJECTS: [&str; 2] = ["alice", "bob"];

fn long_path() -> String {
    format!("/pay/{}", "p".repeat(1100))
}

impl World {
    pub fn new(mut c: Choices, kinds: Faults, invariants: &'static dyn Invariants) -> Self {
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
        Self::build(c, setup, ops, kinds, invariants)
    }

    /// The dangerous ends of the run's parameters it was drawn with.
    pub(crate) fn reach_setup(&mut self) {
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
}
