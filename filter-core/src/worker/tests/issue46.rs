//! Issue 46's findings in the worker: a grant whose answer came a lease late, a reconcile
//! answer about another subject or key, local replies left for a wake that never came.

use super::*;
use crate::host::{self, Current, Host, REPLIES_PER_CALLBACK};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

// ---------------------------------------------------------------------------------------------
// Finding 7 (Fix::TickDrain): deferred local replies go at a tick as well as at a wake.

/// A root context whose wakes are lost (the glue's shared-queue enqueue failed): it counts
/// them and never delivers one.
struct LostWakes {
    w: Worker,
    now: u64,
    replied: Vec<StreamId>,
    wakes: usize,
}

impl Host for LostWakes {
    fn current(&self) -> Current {
        Current::Root
    }
    fn with_worker<T>(&mut self, f: impl FnOnce(&mut Worker, u64) -> T) -> Option<T> {
        Some(f(&mut self.w, self.now))
    }
    fn reply(&mut self, stream: StreamId, _reply: LocalReply) {
        self.replied.push(stream);
    }
    fn set_request_header(&mut self, _: StreamId, _: &'static str, _: String) {}
    fn remove_request_header(&mut self, _: StreamId, _: &'static str) {}
    fn resume_request(&mut self, _: StreamId) {}
    fn resume_response(&mut self, _: StreamId) {}
    fn dispatch(&mut self, _: Dispatch) -> Result<(), String> {
        Ok(())
    }
    fn misplaced_callout(&mut self, _: &Dispatch) {}
    fn wake(&mut self) {
        self.wakes += 1;
    }
    fn count(&mut self, _: Metric) {}
    fn log(&mut self, _: Level, _: String) {}
}

#[test]
fn replies_deferred_past_a_callback_s_bound_go_at_the_next_tick_when_the_wake_is_lost() {
    let t = Harness::new(CONFIG);
    let mut host = LostWakes {
        w: t.w,
        now: t.now,
        replied: Vec::new(),
        wakes: 0,
    };
    let reply = LocalReply::problem(contract::ProblemKind::Internal, "x");
    let all: Vec<StreamId> = (1..=40).collect();
    let effects = all
        .iter()
        .map(|&stream| Effect::Reply {
            stream,
            reply: reply.clone(),
        })
        .collect();
    // One root callback answers 40 streams (a crowd of waiters, say): the bound's worth go,
    // the rest wait for a wake, which is lost.
    host::perform(&mut host, Verdict::Continue, effects);
    assert_eq!(host.replied.len(), REPLIES_PER_CALLBACK);
    assert_eq!(host.wakes, 1);
    assert_eq!(host.w.next_due(), Some(0), "the next tick has work");
    // Each tick sends the next ones, in order, at most the bound, and asks for a wake again.
    for tick in 1..=3 {
        host.now += host.w.tick_period_ms();
        let before = host.replied.len();
        let effects = host.w.on_tick(host.now);
        host::perform(&mut host, Verdict::Continue, effects);
        assert!(
            host.replied.len() - before <= REPLIES_PER_CALLBACK,
            "tick {tick}: at most the bound"
        );
    }
    assert_eq!(host.replied, all, "every reply went, in order, without a wake");
    assert_eq!(host.wakes, 2, "a wake asked for each callback that left replies");
    assert_eq!(host.w.next_due(), None, "nothing left for a tick");
}

// ---------------------------------------------------------------------------------------------
// Finding 6 (Fix::ReconcileScope): an `executed` answer names this request's subject and key.

#[test]
fn an_executed_answer_about_another_subject_or_key_is_not_stored() {
    // The fingerprint does not cover the subject, and the key is only the reconcile path's last
    // segment: an upstream that found the attempt by endpoint and fingerprint alone (another
    // customer's identical charge under the same key, say) answered with a token, endpoint and
    // fingerprint that all matched, and that charge's response was stored and replayed.
    let ours = fingerprint_of("/checkout");
    let endpoint = "POST /checkout";
    let body = b"{\"id\":9}";
    let named = |subject: Option<&str>, key: Option<&str>| {
        let mut extra = vec![
            (FENCING_TOKEN_HEADER, "5"),
            (ENDPOINT_HEADER, endpoint),
            (FINGERPRINT_HEADER, ours.as_str()),
        ];
        if let Some(s) = subject {
            extra.push((SUBJECT_HEADER, s));
        }
        if let Some(k) = key {
            extra.push(("idempotency-key", k));
        }
        reconcile_answer(201, OUTCOME_EXECUTED, &extra, body)
    };
    for (label, answer_) in [
        ("another subject", named(Some("user-2"), Some("k1"))),
        ("another key", named(Some("user-1"), Some("k2"))),
        ("no subject echoed", named(None, Some("k1"))),
        ("no key echoed", named(Some("user-1"), None)),
        ("neither echoed (an older upstream)", named(None, None)),
    ] {
        let mut t = Harness::new(RECONCILING);
        let (s, step) = t.taken_over("/checkout", 77);
        let d = step.reconcile();
        let step = t.answer(&d, answer_);
        assert!(
            step.dispatches(COMPLETE_PATH).is_empty(),
            "{label}: not stored: {step:?}"
        );
        assert!(
            step.effects.iter().any(|e| matches!(
                e,
                Effect::Log(Level::Warn, line) if line.contains("not stored")
                    && !line.contains("k1")
                    && !line.contains("k2")
            )),
            "{label}: a warning says why, without a key: {step:?}"
        );
        let unavailable = (503, "/problems/reconcile-unavailable");
        t.answered_and_marked_unknown(s, &step, unavailable, Metric::ReconcileFailed, label);
    }
    // Named in full, subject and key included: stored and replayed.
    let mut t = Harness::new(RECONCILING);
    let (_, step) = t.taken_over("/checkout", 77);
    let d = step.reconcile();
    let step = t.answer(&d, named(Some("user-1"), Some("k1")));
    assert_eq!(step.complete().token, 77);
    assert_eq!(step.counts(), vec![Metric::ReconcileExecuted]);
}
