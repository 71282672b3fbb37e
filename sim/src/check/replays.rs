//! Invariants 2 and 3: every replay a client gets is an answer the upstream produced for that
//! scope and that very request, byte for byte; and what `Preference-Applied` may say.

use crate::state_api::Scope;
use crate::upstream::{Produced, Sent};
use crate::world::{ClientView, World};

/// Whether a replay is this response, byte for byte.
pub(super) fn replays(view: &ClientView, p: &Produced) -> bool {
    if view.status != Some(p.status) || view.body != p.body {
        return false;
    }
    if view.header("content-encoding") != p.header("content-encoding") {
        return false;
    }
    view.headers
        .iter()
        // The edge's own headers: the replay marker, the wait it applied, the key's horizon.
        .filter(|(n, _)| {
            n != "idempotent-replayed"
                && n != "preference-applied"
                && n != "idempotency-key-expires-in"
        })
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
    if let Some((first_after, answer)) = w.ev.resolved.get(&scope) {
        let theirs = st.client.status == Some(answer.status) && st.client.body == answer.body;
        if theirs {
            return found;
        }
        if s >= *first_after {
            found.push(format!(
                "2: stream {s} got a replay ({:?}, {} body bytes) of {scope:?} after an operator resolved it, not the operator's answer",
                st.client.status,
                st.client.body.len(),
            ));
            return found;
        }
    }
    let decided_before_a_grant = w.ev.resolved_before.get(&scope).is_some_and(|answers| {
        answers.iter().any(|(opened, answer)| {
            s < *opened && st.client.status == Some(answer.status) && st.client.body == answer.body
        })
    });
    if decided_before_a_grant {
        return found;
    }
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
