//! One schedule run to its end, the invariants judging it ([`crate::check`]): the world's random
//! steps, each followed by the check after every step, then the drain, then the final retry of
//! every operation, each judged against what its client received before.

use crate::check;
use crate::world::World;

/// Runs the random part of the schedule (at most `max_steps`), then drains and checks the
/// final answers. Stops at the first violation.
pub fn run(w: &mut World, max_steps: usize) {
    w.reach_setup();
    for _ in 0..max_steps {
        if !w.step() {
            break;
        }
        w.steps += 1;
        w.check_step();
        if !w.violations.is_empty() {
            return;
        }
    }
    w.drain();
    if w.setup
        .retention_s
        .is_some_and(|r| r * 1000 < w.now - w.started_at())
    {
        w.reach("region: a retention shorter than the run");
    }
    if w.violations.is_empty() {
        final_answers(w);
    }
}

/// Once drained: the final retry of every operation, each judged as it comes back (the first
/// violation stops them), then nobody left waiting once drained (invariant 10, as the drain
/// left the streams), then invariant 9 over every request.
pub fn final_answers(w: &mut World) {
    // Taken now, reported after the final retries: a retry may answer a forgotten waiter
    // (its key's replay wakes the worker's waiters), which must not hide it.
    let waiting = check::nobody_left_waiting(w);
    for op in 0..w.ops.len() {
        let Some(before) = check::before_final_retry(w, op) else {
            continue;
        };
        let Some(view) = w.final_retry(op) else {
            continue;
        };
        if !w.violations.is_empty() {
            return;
        }
        if let Some(violation) = check::final_answer(w, &before, &view) {
            w.violations.push(violation);
            return;
        }
    }
    if !waiting.is_empty() {
        w.violations.extend(waiting);
        return;
    }
    let found = check::fingerprints_are_keyed(w);
    w.violations.extend(found);
}
