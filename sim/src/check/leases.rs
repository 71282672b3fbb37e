//! Invariants 5 and 6: a mark is never undone by an older heartbeat; a live owner's lease does
//! not lapse, nor its write get given up, for a reason not its own (one failed heartbeat, a
//! clock step, a database back from an outage).

use crate::state_api::Scope;
use crate::world::{Outage, World};
use filter_core::worker::CalloutResult;

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
