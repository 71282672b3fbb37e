//! The invariants, checked after every step, at each execution, charge, answer and state API
//! event (`docs/simulation.md` says each in full):
//!
//! 1. the upstream executes each (key, subject, endpoint) at most once, unless the state API
//!    released the key (the upstream was certainly not reached, or the route releases 5xx), or
//!    the route re-executes unknown outcomes and the state API handed the key over as one, or
//!    the record went away legitimately (past its retention counted from its owner's last sign
//!    of life; an operator's action without force on an owner silent for a lease), and then
//!    only with a strictly larger fencing token; a request forwarded without a claim is allowed
//!    only where the route fails open *and* the state API could not be used; no request reaches
//!    the upstream with a fencing token the state API did not issue for its scope, or a client's;
//! 2. every replay is an outcome the upstream itself produced for that scope, byte for byte:
//!    never an answer Envoy made (a timeout, a reset, a 413);
//! 3. no answer crosses subjects or endpoints, and a changed request never gets a replay;
//! 4. no panic, and the worker's memory stays within the configured bounds;
//! 5. a mark is never undone by an older heartbeat: a heartbeat sent before its owner's
//!    unknown mark (or release) took effect does not make the record in progress again;
//! 6. a live owner's lease does not lapse merely because one heartbeat failed, its clock
//!    stepped, or the database came back from an outage (a crash recovery in place), and a
//!    write it took over is not given up before `complete_retry_ms` of real time;
//! 7. at most one *charge* per key by the reference upstream's rules (a later token after an
//!    executed attempt must not charge again), with the allowances of 1 but the hand-over;
//! 8. a key none of whose requests was ever forwarded is usable again within one lease (its
//!    retry after the drain is not held with 409), unless the worker that held a grant for it
//!    died with the grant open, or a worker gave a write up;
//! 9. no stored fingerprint is the plain SHA-256 of the request (a copy of the table would
//!    confirm a guess of the body);
//!
//! and once the schedule is drained (no faults, every lease run out): a request whose client
//! received the upstream's whole answer gets that answer back when it is retried (on a route
//! that holds unknown outcomes, 409 `outcome-unknown` if its outcome was never stored).
//!
//! Each reads the world ([`World`]) and returns what it finds broken; the world calls them
//! through [`Invariants`] and records what they return. This file holds the memory bound (4) and
//! the world's entry points; `executions.rs` holds 1 and 7, `replays.rs` 2 and 3, `leases.rs` 5
//! and 6, `finals.rs` what is checked once the schedule is drained.

mod executions;
mod finals;
mod leases;
mod replays;

pub use finals::{
    before_final_retry, final_answer, fingerprints_are_keyed, nobody_left_waiting, BeforeRetry,
};

use crate::state_api::Scope;
use crate::world::{Invariants, World};
use executions::{charge, execution, unprotected};
use leases::{gave_up, heartbeat_after_mark, lapse};
use replays::answered;

/// The invariants as the world calls them at each event ([`World`] is made with them).
pub struct Checks;

impl Invariants for Checks {
    fn after_step(&self, w: &World) -> Vec<String> {
        after_step(w)
    }
    fn execution(
        &self,
        w: &World,
        scope: &Scope,
        token: Option<i64>,
        stream: usize,
    ) -> Vec<String> {
        execution(w, scope, token, stream)
    }
    fn unprotected(&self, _: &World, headers: &[(String, String)], stream: usize) -> Vec<String> {
        unprotected(headers, stream)
    }
    fn charge(&self, w: &World, e: usize) -> Vec<String> {
        charge(w, e)
    }
    fn answered(&self, w: &World, s: usize) -> Vec<String> {
        answered(w, s)
    }
    fn lapse(&self, w: &World, token: i64, scope: &Scope, lease_ms: u64, by: &str) -> Vec<String> {
        lapse(w, token, scope, lease_ms, by)
    }
    fn heartbeat_after_mark(&self, w: &World, token: i64, sent: u64) -> Vec<String> {
        heartbeat_after_mark(w, token, sent)
    }
    fn gave_up(&self, w: &World, wi: usize, token: i64) -> Vec<String> {
        gave_up(w, wi, token)
    }
}

/// After every step: the worker's memory within its bounds.
pub fn after_step(w: &World) -> Vec<String> {
    let mut found = Vec::new();
    let cfg = &w.cfg;
    for (i, sw) in w.workers.iter().enumerate() {
        let Some(wk) = &sw.w else { continue };
        let u = wk.usage();
        let live_streams = w
            .streams
            .iter()
            .filter(|s| s.worker == i && s.generation == sw.generation && !s.ended)
            .count();
        let live_calls = w
            .callouts
            .iter()
            .filter(|c| c.worker == i && c.generation == sw.generation && !c.orphan)
            .count();
        let mut over = Vec::new();
        if u.write_bytes > usize::try_from(cfg.complete_retry_bytes).unwrap_or(usize::MAX) {
            over.push(format!("{} bytes of pending writes", u.write_bytes));
        }
        if u.replay_bytes > usize::try_from(cfg.replay_cache_bytes).unwrap_or(usize::MAX) {
            over.push(format!("{} bytes of replay cache", u.replay_bytes));
        }
        if u.running_keys > filter_core::worker::in_flight::MAX_KEYS {
            over.push(format!("{} running keys", u.running_keys));
        }
        if u.streams > live_streams {
            over.push(format!(
                "{} flows for {live_streams} live streams",
                u.streams
            ));
        }
        if u.callouts > live_calls {
            over.push(format!(
                "{} callouts awaited, {live_calls} on their way",
                u.callouts
            ));
        }
        if !over.is_empty() {
            found.push(format!("4: worker {i} holds too much: {}", over.join(", ")));
        }
    }
    found
}
