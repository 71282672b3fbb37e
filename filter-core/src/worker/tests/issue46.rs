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
    fn set_response_header(&mut self, _: StreamId, _: &'static str, _: String) {}
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
    assert_eq!(
        host.replied, all,
        "every reply went, in order, without a wake"
    );
    assert_eq!(
        host.wakes, 2,
        "a wake asked for each callback that left replies"
    );
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

// ---------------------------------------------------------------------------------------------
// Seed 89644 (Fix::LateGrant): a grant's lease counts from when its claim was sent.

/// A grant of `token` with a lease of `lease_ms`.
fn granted(token: i64, lease_ms: u64) -> CalloutResult {
    answer(&ClaimResponse::Claimed {
        token,
        lease_ms,
        reclaimed: false,
        max_body_bytes: None,
        retention_s: None,
    })
}

impl Harness {
    /// A claim of `k1` to `/checkout` sent now, answered `late_ms` later with a grant of token
    /// 1 and a 30 s lease: the stream and the step of the answer.
    fn granted_after(&mut self, late_ms: u64) -> (StreamId, Seen) {
        let (s, step) = self.keyed("k1", "/checkout", b"{}");
        self.advance(late_ms);
        let step = self.answer_claim(&step, granted(1, 30_000));
        (s, step)
    }

    /// A grant given back: 503 with Retry-After, nothing forwarded, and (at the wake it asks
    /// for) the record released by its token.
    fn given_back(&mut self, s: StreamId, step: &Seen, label: &str) {
        let r = step.reply();
        assert_eq!(
            (r.status, problem_type(r).as_str()),
            (503, "/problems/idempotency-state-unavailable"),
            "{label}"
        );
        assert!(header(r, "retry-after").is_some(), "{label}");
        assert_eq!(
            header(r, "content-type"),
            Some("application/problem+json"),
            "{label}"
        );
        assert!(!step.resumes_request(), "{label}: nothing forwarded");
        assert!(
            !step.effects.iter().any(|e| matches!(
                e,
                Effect::SetRequestHeader { name, .. } if *name == FENCING_TOKEN_HEADER
            )),
            "{label}: no token set"
        );
        assert!(!step.counts().contains(&Metric::Claimed), "{label}");
        assert!(step.effects.contains(&Effect::Wake), "{label}");
        assert!(
            step.effects.iter().any(|e| matches!(
                e,
                Effect::Log(Level::Warn, line) if line.contains("late") && !line.contains("k1")
            )),
            "{label}: a warning says why, without the key: {step:?}"
        );
        self.done(s);
        let wake: Seen = self.w.on_wake(self.now).into();
        let release: ReleaseRequest =
            serde_json::from_slice(&wake.dispatch(RELEASE_PATH).body).unwrap();
        assert_eq!(release.token, 1, "{label}: released by its token");
    }
}

#[test]
fn a_grant_whose_answer_comes_a_lease_after_its_claim_was_sent_is_given_back() {
    // Seed 89644: token 1 committed at once, its answer came a lease (2 s) later; meanwhile
    // nobody heartbeated it, an operator released the silent record, token 2 ran, and then
    // token 1 was forwarded and ran too.
    let mut t = Harness::new(CONFIG);
    let (s, step) = t.granted_after(30_000);
    t.given_back(s, &step, "a lease late");
    let mut t = Harness::new(CONFIG);
    let (s, step) = t.granted_after(45_000);
    t.given_back(s, &step, "more than a lease late");
}

#[test]
fn a_grant_with_less_than_a_heartbeat_interval_of_its_lease_left_is_given_back() {
    // Lease 30 s, heartbeat 10 s: a grant answered 20 s after its claim was sent still has the
    // 10 s a claim has when its first heartbeat is due; answered later, its first heartbeat
    // could not land in time.
    let mut t = Harness::new(CONFIG);
    let (s, step) = t.granted_after(20_001);
    t.given_back(s, &step, "less than an interval left");
    let mut t = Harness::new(CONFIG);
    let (s, step) = t.granted_after(20_000);
    assert!(step.resumes_request(), "an interval left: forwarded");
    assert!(t.w.awaits_response(s));
    // Its lease counts from the claim's sending, so its first heartbeat is due at once.
    assert!(t.w.next_due().is_some_and(|d| d <= t.now), "due now");
    let hb: HeartbeatRequest =
        serde_json::from_slice(&t.tick().dispatch(HEARTBEAT_PATH).body).unwrap();
    assert_eq!(hb.token, 1);
}

#[test]
fn the_first_heartbeat_is_due_a_heartbeat_interval_after_the_claim_was_sent() {
    // Heartbeat 10 s, ticks every 2.5 s: a heartbeat goes 7.5 s after the last sign of life,
    // which for a new grant is its claim's sending, not its answer's arrival.
    let mut t = Harness::new(CONFIG);
    let sent = t.now;
    let (s, step) = t.granted_after(5_000);
    assert!(step.resumes_request());
    assert!(t.w.awaits_response(s));
    assert_eq!(t.w.next_due(), Some(sent + 7_500));
}

#[test]
fn a_batched_grant_answered_a_lease_late_is_given_back() {
    let mut t = Harness::new(&CONFIG.replacen("\"batch_max\": 1,", "\"batch_max\": 32,", 1));
    // The first claim goes alone; the second queues behind it.
    let (a, first) = t.keyed("k0", "/checkout", b"{}");
    let own = first.dispatch(CLAIM_PATH).clone();
    let (b, queued) = t.keyed("k1", "/checkout", b"{}");
    assert!(!queued.claims(), "queued");
    t.advance(30_000);
    let step = t.answer(&own, granted(7, 30_000));
    assert!(!step.resumes_request(), "the first is late too");
    assert_eq!(step.reply().status, 503);
    t.done(a);
    let wake: Seen = t.w.on_wake(t.now).into();
    let batch = wake.dispatch(contract::wire::WRITES_PATH).clone();
    let item = contract::wire::BatchItem {
        status: 200,
        answer: serde_json::to_value(ClaimResponse::Claimed {
            token: 1,
            lease_ms: 30_000,
            reclaimed: false,
            max_body_bytes: None,
            retention_s: None,
        })
        .unwrap(),
    };
    let step = t.answer(
        &batch,
        answer(&contract::wire::BatchResponse {
            answers: vec![item],
        }),
    );
    t.given_back(b, &step, "batched");
}
