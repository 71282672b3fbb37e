//! Invariants 1 and 7: what reaches the upstream (each key executed at most once unless it was
//! legitimately freed, and then only with a larger fencing token; no forged or foreign token)
//! and what the reference upstream charges.

use crate::state_api::Scope;
use crate::world::{World, CLIENT_TOKEN};
use contract::wire::FENCING_TOKEN_HEADER;

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
