//! The invariants, checked after every step (and at each execution and answer):
//!
//! 1. the upstream executes each (key, subject, endpoint) at most once, unless the state API
//!    released the key (the upstream was certainly not reached, or the route releases 5xx) or
//!    the route re-executes unknown outcomes and the state API handed the key over as one, and
//!    then only with a strictly larger fencing token: an expired lease alone never lets a
//!    request run again; a request forwarded without a claim is allowed only where the route
//!    fails open *and* the state API could not be used; no request reaches the upstream with a
//!    fencing token the state API did not issue for its scope;
//! 2. every replay equals an outcome the upstream (or Envoy's router for it) really produced
//!    for that scope, byte for byte: status, replayed headers, body, content encoding;
//! 3. no answer crosses subjects or endpoints, and a changed request never gets a replay;
//! 4. no panic, and the worker's memory stays within the configured bounds;
//!
//! and once the schedule is drained (no faults, every lease run out): a request whose client
//! received the upstream's whole answer gets that answer back when it is retried (on a route
//! that holds unknown outcomes, 409 `outcome-unknown` if its outcome was never stored).

use crate::state_api::Scope;
use crate::upstream::{Produced, Sent};
use crate::world::{ClientView, World};
use contract::wire::FENCING_TOKEN_HEADER;

/// A request reaches the upstream (`stream` is its attempt).
pub fn execution(w: &mut World, scope: &Scope, token: Option<i64>, stream: usize) {
    // A route that re-executes unknown outcomes runs a key again once it was handed over so.
    let reexecutes = w
        .cfg
        .route("POST", scope.2.trim_start_matches("POST "))
        .is_some_and(|r| r.on_unknown == filter_core::config::OnUnknown::Reexecute);
    let earlier: Vec<(Option<i64>, usize)> = w
        .upstream
        .of_scope(scope)
        .map(|e| (e.token, e.stream))
        .collect();
    match token {
        None => {
            if w.streams[stream].claim_refused {
                w.violations.push(format!(
                    "1: stream {stream} forwarded without protection although the state API answered (it refused the claim)"
                ));
            }
        }
        Some(t) => {
            if w.api.issued.get(&t) != Some(scope) {
                w.violations.push(format!(
                    "1: stream {stream} reached the upstream with fencing token {t}, which the state API never issued for this scope"
                ));
            }
            let handed_over = reexecutes && w.api.took_over_unknown.get(&t) == Some(scope);
            for (prior, prior_stream) in earlier {
                let Some(prior) = prior else { continue };
                if t <= prior {
                    w.violations.push(format!(
                        "1: stream {stream} executed {scope:?} again with token {t}, not larger than the earlier {prior}"
                    ));
                } else if !w.released.contains(&prior) && !handed_over {
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
                    w.violations.push(format!(
                        "1: stream {stream} executed {scope:?} a second time (token {t}; the earlier execution with token {prior} was never released; its client got {earlier_client}{open})"
                    ));
                }
            }
        }
    }
}

/// An unprotected request reaches the upstream.
pub fn unprotected(w: &mut World, headers: &[(String, String)], stream: usize) {
    if headers.iter().any(|(n, _)| n == FENCING_TOKEN_HEADER) {
        w.violations.push(format!(
            "1: stream {stream} reached the upstream with a client-sent fencing token"
        ));
    }
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
pub fn answered(w: &mut World, s: usize) {
    let st = w.streams[s].clone();
    if let Some(applied) = st.client.header("preference-applied") {
        // Route max_wait_s is the default 10 s.
        let asked = w.ops[st.op].wait_s.min(10);
        let answer = st.client.status;
        if asked == 0
            || applied != format!("wait={asked}")
            || !(st.client.replayed() || answer == Some(409))
        {
            w.violations.push(format!(
                "stream {s} got Preference-Applied: {applied} with {answer:?} (asked to wait {asked} s)"
            ));
        }
    }
    if !st.client.replayed() {
        return;
    }
    let scope = w.ops[st.op].scope();
    let matching: Vec<Sent> = w
        .upstream
        .of_scope(&scope)
        .filter(|e| replays(&st.client, &e.plan.response))
        .map(|e| e.request.clone())
        .collect();
    if matching.is_empty() {
        let elsewhere = w
            .upstream
            .executions
            .iter()
            .any(|e| e.scope != scope && replays(&st.client, &e.plan.response));
        w.violations.push(format!(
            "{}: stream {s} got a replay ({:?}, {} body bytes, content-encoding {:?}) that no execution of {scope:?} produced",
            if elsewhere { "3" } else { "2" },
            st.client.status,
            st.client.body.len(),
            st.client.header("content-encoding"),
        ));
        return;
    }
    if !matching.iter().any(|r| r.same_as(&st.request)) {
        w.violations.push(format!(
            "3: stream {s} sent another request under the same key ({} {:?}) and got the replay of the first",
            String::from_utf8_lossy(&st.request.body),
            st.request.content_type
        ));
    }
}

/// After every step: the worker's memory within its bounds.
pub fn after_step(w: &mut World) {
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
            w.violations
                .push(format!("4: worker {i} holds too much: {}", over.join(", ")));
        }
    }
}

/// Once drained: a retry of every operation whose client got the upstream's whole answer to
/// the very request the retry sends.
pub fn final_answers(w: &mut World) {
    for op in 0..w.ops.len() {
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
        let Some(delivered) = delivered else {
            // Still run the retry: it must not execute a second time (checked at execution).
            let _ = w.final_retry(op);
            if !w.violations.is_empty() {
                return;
            }
            continue;
        };
        if release_route && delivered.status >= 500 {
            continue;
        }
        let Some(view) = w.final_retry(op) else {
            continue;
        };
        if !w.violations.is_empty() {
            return;
        }
        let reexecuted = w.upstream.of_scope(&scope).any(|e| {
            e.token
                .is_some_and(|t| w.api.took_over_unknown.contains_key(&t))
        });
        if route == Some(filter_core::config::OnUnknown::Reexecute) && reexecuted {
            // The route chose to run it again: the later execution's answer is the outcome.
            continue;
        }
        if unknown {
            use filter_core::config::OnUnknown;
            let held = view.status == Some(409)
                && crate::world::problem_type(&view.body)
                    == contract::ProblemKind::OutcomeUnknown.type_uri();
            match route {
                // The answer was delivered but never stored: held, or run again by choice.
                Some(OnUnknown::Hold) if held => continue,
                Some(OnUnknown::Reexecute) => continue,
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
        let refused = w.refused_completes.contains(&scope);
        let replay_ok = view.replayed() && replays(&view, &delivered);
        let ok = match (replayable, refused) {
            (true, false) => replay_ok,
            (true, true) => replay_ok || view.status == Some(409),
            (false, _) => view.status == Some(409),
        };
        if !ok {
            w.violations.push(format!(
                "eventual: the client of {scope:?} received {} ({} body bytes{}), but its retry after the drain got {:?} {}",
                delivered.status,
                delivered.body.len(),
                if replayable { "" } else { ", not replayable" },
                view.status,
                String::from_utf8_lossy(&view.body).chars().take(160).collect::<String>()
            ));
            return;
        }
    }
}
