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

use crate::state_api::Scope;
use crate::upstream::{Produced, Sent};
use crate::world::{ClientView, Invariants, Outage, World, CLIENT_TOKEN};
use contract::wire::FENCING_TOKEN_HEADER;
use filter_core::config::OnUnknown;
use filter_core::worker::CalloutResult;

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

/// A request reaches the upstream (`stream` is its attempt).
pub fn execution(w: &World, scope: &Scope, token: Option<i64>, stream: usize) -> Vec<String> {
    let mut found = Vec::new();
    let earlier: Vec<(Option<i64>, usize)> = w
        .upstream
        .of_scope(scope)
        .map(|e| (e.token, e.stream))
        .collect();
    match token {
        None => {
            if w.streams[stream].claim_refused {
                found.push(format!(
                    "1: stream {stream} forwarded without protection although the state API answered (it refused the claim)"
                ));
            }
        }
        Some(CLIENT_TOKEN) if w.api.issued.get(&CLIENT_TOKEN) != Some(scope) => {
            found.push(format!(
                "1: stream {stream} reached the upstream with a client-sent fencing token ({CLIENT_TOKEN}) on a protected route"
            ));
        }
        Some(t) => {
            if w.api.issued.get(&t) != Some(scope) {
                found.push(format!(
                    "1: stream {stream} reached the upstream with fencing token {t}, which the state API never issued for this scope"
                ));
            }
            // A route that re-executes unknown outcomes runs a key again once it was handed
            // over so.
            let handed_over =
                reexecutes(w, scope) && w.api.took_over_unknown.get(&t) == Some(scope);
            for (prior, prior_stream) in earlier {
                let Some(prior) = prior else { continue };
                if t <= prior {
                    let rotation = match (w.ev.secret_of.get(&t), w.ev.secret_of.get(&prior)) {
                        (Some(a), Some(b)) if a != b => format!(
                            " (token {t} was granted under key secret {a} while token {prior}'s record lived under key secret {b})"
                        ),
                        _ => String::new(),
                    };
                    found.push(format!(
                        "1: stream {stream} executed {scope:?} again with token {t}, not larger than the earlier {prior}{rotation}"
                    ));
                    continue;
                }
                if w.released.contains(&prior) || handed_over {
                    continue;
                }
                let Err(why) = w.ev.freed_since(scope, prior, t) else {
                    continue;
                };
                let seen = &w.streams[prior_stream].client;
                let earlier_client = match (seen.status, seen.complete) {
                    (None, _) => "nothing".to_owned(),
                    (Some(st), true) => format!("all of its {st} answer"),
                    (Some(st), false) => {
                        format!("the headers of a {st} answer, not all of its body")
                    }
                };
                let open = if w.streams[prior_stream].ended {
                    ""
                } else {
                    "; its stream is still open"
                };
                found.push(format!(
                    "1: stream {stream} executed {scope:?} a second time (token {t}; the earlier execution with token {prior} was never released; its client got {earlier_client}{open}){why}"
                ));
            }
        }
    }
    found
}

fn reexecutes(w: &World, scope: &Scope) -> bool {
    w.cfg
        .route("POST", scope.2.trim_start_matches("POST "))
        .is_some_and(|r| r.on_unknown == filter_core::config::OnUnknown::Reexecute)
}

/// Execution `e` charged (the reference upstream committed it).
pub fn charge(w: &World, e: usize) -> Vec<String> {
    let mut found = Vec::new();
    let x = &w.upstream.executions[e];
    let (scope, token) = (x.scope.clone(), x.token);
    let earlier: Vec<Option<i64>> = w
        .upstream
        .executions
        .iter()
        .enumerate()
        .filter(|(i, p)| *i != e && p.scope == scope && p.charged)
        .map(|(_, p)| p.token)
        .collect();
    for prior in earlier {
        let (Some(prior), Some(t)) = (prior, token) else {
            continue;
        };
        if w.released.contains(&prior)
            || w.ev.freed_since(&scope, prior.min(t), prior.max(t)).is_ok()
        {
            continue;
        }
        found.push(format!(
            "7: the upstream charged {scope:?} a second time (token {t}, after token {prior} charged): the reference checkout accepted a token larger than one that already executed"
        ));
    }
    found
}

/// An unprotected request reaches the upstream.
pub fn unprotected(headers: &[(String, String)], stream: usize) -> Vec<String> {
    let mut found = Vec::new();
    if headers.iter().any(|(n, _)| n == FENCING_TOKEN_HEADER) {
        found.push(format!(
            "1: stream {stream} reached the upstream with a client-sent fencing token"
        ));
    }
    found
}

/// Whether a replay is this response, byte for byte.
fn replays(view: &ClientView, p: &Produced) -> bool {
    if view.status != Some(p.status) || view.body != p.body {
        return false;
    }
    if view.header("content-encoding") != p.header("content-encoding") {
        return false;
    }
    view.headers
        .iter()
        .filter(|(n, _)| n != "idempotent-replayed" && n != "preference-applied")
        .all(|(n, v)| p.header(n) == Some(v.as_str()))
}

/// A client has its whole answer.
pub fn answered(w: &World, s: usize) -> Vec<String> {
    let mut found = Vec::new();
    let st = w.streams[s].clone();
    if let Some(applied) = st.client.header("preference-applied") {
        // Route max_wait_s is the default 10 s.
        let asked = w.ops[st.op].wait_s.min(10);
        let answer = st.client.status;
        if asked == 0
            || applied != format!("wait={asked}")
            || !(st.client.replayed() || answer == Some(409))
        {
            found.push(format!(
                "stream {s} got Preference-Applied: {applied} with {answer:?} (asked to wait {asked} s)"
            ));
        }
    }
    if !st.client.replayed() {
        return found;
    }
    let scope = w.ops[st.op].scope();
    let matching: Vec<Sent> = w
        .upstream
        .of_scope(&scope)
        .filter(|e| replays(&st.client, &e.plan.response))
        .map(|e| e.request.clone())
        .chain(
            w.upstream
                .refused
                .iter()
                .filter(|(sc, _, p)| *sc == scope && replays(&st.client, p))
                .map(|(_, r, _)| r.clone()),
        )
        .collect();
    if matching.is_empty() {
        if let Some((_, p, details)) =
            w.ev.envoy_replies
                .iter()
                .find(|(sc, p, _)| *sc == scope && replays(&st.client, p))
        {
            found.push(format!(
                "2: stream {s} got a replay of Envoy's own answer ({} {details}), not one the upstream produced",
                p.status
            ));
            return found;
        }
        let elsewhere = w
            .upstream
            .executions
            .iter()
            .any(|e| e.scope != scope && replays(&st.client, &e.plan.response));
        found.push(format!(
            "{}: stream {s} got a replay ({:?}, {} body bytes, content-encoding {:?}) that no execution of {scope:?} produced{}",
            if elsewhere { "3" } else { "2" },
            st.client.status,
            st.client.body.len(),
            st.client.header("content-encoding"),
            from_reconcile(w, &scope, &st.client),
        ));
        return found;
    }
    if !matching.iter().any(|r| r.same_as(&st.request)) {
        found.push(format!(
            "3: stream {s} sent another request under the same key ({} {:?}) and got the replay of the first{}",
            String::from_utf8_lossy(&st.request.body),
            st.request.content_type,
            from_reconcile(w, &scope, &st.client),
        ));
    }
    found
}

/// Where a wrong replay came from, when a reconcile endpoint gave it for this scope.
fn from_reconcile(w: &World, scope: &Scope, view: &ClientView) -> String {
    if w.ev
        .reconcile_answers
        .iter()
        .any(|(sc, p)| sc == scope && replays(view, p))
    {
        " (stored from the upstream's reconcile answer, which described another request)".into()
    } else {
        String::new()
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

/// A heartbeat of `token` sent at dispatch `sent` was accepted after its owner's mark: the
/// record is in progress again (invariant 5).
pub fn heartbeat_after_mark(w: &World, token: i64, sent: u64) -> Vec<String> {
    let mut found = Vec::new();
    if let Some(&marked) = w.ev.owner_marks.get(&token) {
        if sent < marked {
            found.push(format!(
                "5: a heartbeat of token {token} sent before its owner's unknown mark was answered after it and undid the mark (the record is in progress again)"
            ));
        }
    }
    found
}

/// The state API found the lease of `token` run out (invariant 6): its owner, if it lives and
/// held the grant for a whole lease, must have lost it for a reason of its own (two failed
/// heartbeats in the last lease), not for one failed heartbeat, a clock step or a database
/// that just came back.
pub fn lapse(w: &World, token: i64, scope: &Scope, lease_ms: u64, by: &str) -> Vec<String> {
    let mut found = Vec::new();
    let now = w.now;
    let owner = w.workers.iter().enumerate().find_map(|(i, sw)| {
        let wk = sw.w.as_ref()?;
        wk.held_tokens()
            .contains(&token)
            .then_some((i, sw.generation))
    });
    let Some((wi, generation)) = owner else {
        return found;
    };
    let Some(&since) = w.ev.held_since.get(&(wi, generation, token)) else {
        return found;
    };
    if since + lease_ms > now {
        // Its grant reached it less than a lease ago (a slow answer): not its heartbeats' fault.
        return found;
    }
    let window = now.saturating_sub(lease_ms);
    // A database outage that ended within the last lease (a pause counts once it is long
    // enough to be one: shorter silences are latency, left to the heartbeats' count below).
    let outage =
        w.ev.database_outages
            .iter()
            .rev()
            .find(|(start, end, kind)| {
                *end > window
                    && (*kind != Outage::Paused || end - start > crate::world::PULSE_SILENCE_MS)
            });
    if let Some(&(start, end, kind)) = outage {
        let what = match kind {
            Outage::Database { in_place: true } => {
                "a crash recovery in place (it recovered in place: serving_since did not move)"
                    .to_owned()
            }
            Outage::Paused => format!(
                "a pause of {} ms (it resumed from a pause: serving_since did not move)",
                end - start
            ),
            _ => "a restart".to_owned(),
        };
        found.push(format!(
            "6: the lease of token {token} ({scope:?}, {lease_ms} ms) lapsed ({by}) {} ms after the database came back from {what}, while its owner on worker {wi} lives",
            now - end,
        ));
        return found;
    }
    // The state API could not hear anyone for a while in the last lease: its owner's lease
    // ran out for a reason of its own.
    let api_down =
        w.outage == Outage::ApiDown || w.ev.api_outages.iter().any(|(_, end)| *end > window);
    if api_down {
        return found;
    }
    let failed =
        w.ev.heartbeat_failures
            .get(&token)
            .map_or(0, |f| f.iter().filter(|t| **t > window).count());
    let pending = w
        .callouts
        .iter()
        .filter(|c| {
            !c.orphan
                && !matches!(c.answer, Some(CalloutResult::Response { status: 200, .. }))
                && c.path == contract::wire::HEARTBEAT_PATH
                && serde_json::from_slice::<contract::wire::HeartbeatRequest>(&c.body)
                    .is_ok_and(|h| h.token == token)
        })
        .count();
    if failed + pending >= 2 {
        return found;
    }
    // Its clock's steps since a lease before the state API last heard from it.
    let heard = w.ev.last_sign.get(&token).copied().unwrap_or(0);
    let steps: Vec<String> =
        w.ev.clock_steps
            .get(&wi)
            .map(|s| {
                s.iter()
                    .filter(|(at, _)| *at + lease_ms >= heard)
                    .map(|(at, by)| format!("its wall clock stepped {by:+} ms at {at}"))
                    .collect()
            })
            .unwrap_or_default();
    let mut steps = steps;
    let skew = w.workers[wi].skew_ms;
    if skew.abs() >= 1_000 {
        steps.push(format!("its wall clock is {skew:+} ms off"));
    }
    found.push(format!(
        "6: the lease of token {token} ({scope:?}, {lease_ms} ms) lapsed ({by}) while its owner on worker {wi} lives: {} of its heartbeats failed in the last lease{}{}",
        failed + pending,
        if pending > 0 { " (one still unanswered)" } else { "" },
        if steps.is_empty() { String::new() } else { format!("; {}", steps.join(", ")) }
    ));
    found
}

/// Worker `wi` gave up a write of `token` because `complete_retry_ms` passed on its clock
/// (invariant 6: real time must have passed too).
pub fn gave_up(w: &World, wi: usize, token: i64) -> Vec<String> {
    let mut found = Vec::new();
    let generation = w.workers[wi].generation;
    let Some(&since) = w.ev.write_since.get(&(wi, generation, token)) else {
        return found;
    };
    let waited = w.now.saturating_sub(since);
    if waited < w.setup.complete_retry_ms {
        found.push(format!(
            "6: worker {wi} gave up the write of token {token} after {waited} ms of real time (complete_retry_ms is {} ms): its clock stepped",
            w.setup.complete_retry_ms
        ));
    }
    found
}

/// What the final check of an operation needs from before its final retry (the retry changes
/// the world): the upstream's answer its client received whole, and what became of its key.
pub struct BeforeRetry {
    scope: Scope,
    delivered: Option<Produced>,
    release_route: bool,
    route: Option<OnUnknown>,
    unknown: bool,
    never_forwarded: bool,
    executions_before: usize,
}

/// Once drained, before the final retry of `op`: what its check needs (none for an operation
/// without a key: no idempotency to check, its retry runs again by design).
pub fn before_final_retry(w: &World, op: usize) -> Option<BeforeRetry> {
    if w.ops[op].key.is_empty() {
        return None;
    }
    let scope = w.ops[op].scope();
    let original = w.ops[op].request();
    // The upstream's answer as a client received it whole (not a router's, not a replay).
    let delivered: Option<Produced> = w.streams.iter().find_map(|s| {
        let e = s.forwarded?;
        let exec = w.upstream.executions.get(e)?;
        (s.op == op
            && s.client.complete
            && !s.client.local
            && !s.router_reply
            && exec.token.is_some()
            && exec.request.same_as(&original)
            && s.client.status == Some(exec.plan.response.status)
            && s.client.body == exec.plan.response.body)
            .then(|| exec.plan.response.clone())
    });
    let release_route = w.ops[op].path == "/refunds";
    let route = w.cfg.route("POST", &w.ops[op].path).map(|r| r.on_unknown);
    let unknown = w.api.outcome_unknown(&scope, w.now);
    let never_forwarded = route.is_some()
        && w.upstream.of_scope(&scope).next().is_none()
        && !w
            .streams
            .iter()
            .any(|s| w.ops[s.op].scope() == scope && (s.in_transit || s.forwarded.is_some()));
    Some(BeforeRetry {
        executions_before: w.upstream.executions.len(),
        scope,
        delivered,
        release_route,
        route,
        unknown,
        never_forwarded,
    })
}

/// Once drained, the final retry of an operation got `view`: if its client got the upstream's
/// whole answer to the very request the retry sends, the retry gets it back; invariant 8 for a
/// key never forwarded. The first violation, if any.
pub fn final_answer(w: &World, before: &BeforeRetry, view: &ClientView) -> Option<String> {
    let (route, scope) = (before.route, &before.scope);
    if before.never_forwarded {
        if let Some(v) = never_forwarded_is_usable(w, scope, view).into_iter().next() {
            return Some(v);
        }
    }
    let delivered = before.delivered.as_ref()?;
    if before.release_route && delivered.status >= 500 {
        return None;
    }
    if w.upstream.executions.len() > before.executions_before
        || w.setup.state_api.max_retention_ms < w.now
        || w.ev.operator_scopes.contains(scope)
    {
        // It ran again, and the check at its execution found that legitimate (its record
        // had gone past its retention); or its record may have (the run was longer).
        return None;
    }
    // Handed over as an unknown outcome: on a route that re-executes, what the later
    // attempt got (its own execution, or the upstream's answer for the key) is the outcome.
    let reexecuted = w.api.took_over_unknown.values().any(|s| s == scope);
    if route == Some(OnUnknown::Reexecute) && reexecuted {
        // The route chose to run it again: the later execution's answer is the outcome.
        return None;
    }
    if before.unknown {
        let held = view.status == Some(409)
            && crate::world::problem_type(&view.body)
                == contract::ProblemKind::OutcomeUnknown.type_uri();
        match route {
            // The answer was delivered but never stored: held, or run again by choice.
            Some(OnUnknown::Hold) if held => return None,
            Some(OnUnknown::Reexecute) => return None,
            _ => {}
        }
    }
    let max_body = w
        .setup
        .max_stored_body_bytes
        .min(w.setup.state_api.max_body_bytes);
    let headers_kept =
        filter_core::headers::stored(&delivered.headers, &w.cfg.replay_extra_headers).complete;
    let replayable = delivered.body.len() <= max_body
        && headers_kept
        && contract::limits::STATUS.contains(&delivered.status);
    // A refused complete is stored as its status alone, unless an earlier attempt of the
    // whole one, lost on its way back, was stored first: either is the outcome.
    let refused = w.refused_completes.contains(scope);
    let replay_ok = view.replayed() && replays(view, delivered);
    let ok = match (replayable, refused) {
        (true, false) => replay_ok,
        (true, true) => replay_ok || view.status == Some(409),
        (false, _) => view.status == Some(409),
    };
    (!ok).then(|| format!(
        "eventual: the client of {scope:?} received {} ({} body bytes{}), but its retry after the drain got {:?} {}",
        delivered.status,
        delivered.body.len(),
        if replayable { "" } else { ", not replayable" },
        view.status,
        String::from_utf8_lossy(&view.body).chars().take(160).collect::<String>()
    ))
}

/// Invariant 8: nothing of `scope` was ever forwarded, so its retry after the drain (past
/// every lease) must not be held.
fn never_forwarded_is_usable(w: &World, scope: &Scope, view: &ClientView) -> Vec<String> {
    let mut found = Vec::new();
    if w.ev.gave_up_a_write
        || w.ev.gave_up_for.contains(&scope.2)
        || w.ev.grant_died.contains(scope)
    {
        return found;
    }
    let kind = crate::world::problem_type(&view.body);
    let held = view.status == Some(409)
        && (kind == contract::ProblemKind::OutcomeUnknown.type_uri()
            || kind == contract::ProblemKind::InProgress.type_uri());
    if held {
        let how =
            w.ev.lost_grants
                .get(scope)
                .map(|h| format!(": {h}"))
                .unwrap_or_default();
        found.push(format!(
            "8: nothing of {scope:?} was ever forwarded, yet its retry a lease later got 409 {kind}{how}"
        ));
    }
    found
}

/// Invariant 9: no fingerprint the state API stored is the plain SHA-256 of its request.
pub fn fingerprints_are_keyed(w: &World) -> Vec<String> {
    let mut found = Vec::new();
    for s in 0..w.streams.len() {
        let st = &w.streams[s];
        let scope = w.ops[st.op].scope();
        let r = &st.request;
        let Ok(plain) = contract::fingerprint::fingerprint(
            &r.method,
            &r.path,
            &r.query,
            r.content_type.as_deref(),
            &r.body,
        ) else {
            continue;
        };
        if w.api
            .stored_fingerprints
            .contains(&(scope.clone(), plain.hex))
        {
            found.push(format!(
                "9: the state API stored the fingerprint of {scope:?}'s request as its plain SHA-256 (a copy of the table confirms a guess of the body)"
            ));
            return found;
        }
    }
    found
}
