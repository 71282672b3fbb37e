//! Once the schedule is drained: the final retry of each operation gets the answer its client
//! received (the eventual invariant), a key never forwarded is usable again (8), and no stored
//! fingerprint is a plain SHA-256 (9).

use crate::state_api::Scope;
use crate::upstream::Produced;
use crate::world::{ClientView, World};
use filter_core::config::OnUnknown;

use super::replays::replays;

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

/// Invariant 10, once drained: no client is left waiting at the edge. Every stream whose
/// client is still there and sent its whole request has its whole answer (the upstream's,
/// the filter's or Envoy's): nothing is left that would ever send it the rest.
pub fn nobody_left_waiting(w: &World) -> Vec<String> {
    w.streams
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.ended && s.parts_sent >= s.request_parts() && !s.client.complete)
        .map(|(i, s)| {
            format!(
                "10: stream {i} (op {}, worker {}) still waits for {} once drained{}",
                s.op,
                s.worker,
                if s.client.status.is_some() {
                    "the rest of its answer"
                } else {
                    "an answer"
                },
                if s.forwarded.is_some() {
                    ", its request forwarded"
                } else {
                    ""
                }
            )
        })
        .collect()
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
