//! Tests of the record of attempts.

use super::*;

fn scope(key: &str) -> Scope {
    request(key, "POST /checkout", "fp-1")
}

fn request(key: &str, endpoint: &str, fingerprint: &str) -> Scope {
    Scope {
        endpoint: endpoint.into(),
        subject: "alice".into(),
        key: key.into(),
        fingerprint: Some(fingerprint.into()),
    }
}

fn executed(token: i64, p: Produced) -> Reconciled {
    Reconciled::Executed { token, produced: p }
}

fn produced(id: u64) -> Produced {
    Produced {
        status: 201,
        headers: vec![("location".into(), format!("/charges/{id}"))],
        body: format!("{{\"id\":{id}}}").into_bytes(),
    }
}

/// Commits `id`, counting the executions it runs.
fn commit(a: &mut Attempts, id: u64, charges: &mut u64) -> Committed {
    a.commit(id, || {
        *charges += 1;
        (*charges, produced(*charges))
    })
}

fn states(a: &Attempts) -> Vec<AttemptState> {
    a.list().iter().map(|x| x.state).collect()
}

#[test]
fn a_running_attempt_is_reported_running_and_still_commits() {
    let mut a = Attempts::default();
    let mut charges = 0;
    let (id, ok) = a.start("charge", scope("k"), Some(5), Duration::from_secs(40));
    assert_eq!(ok, Started::Run);
    match a.reconcile(scope("k"), 9) {
        Reconciled::Running { retry_after } => assert!(retry_after > Duration::from_secs(30)),
        other => panic!("{other:?}"),
    }
    // Asking does not fence it: only `not-executed` promises that.
    assert_eq!(
        commit(&mut a, id, &mut charges),
        Committed::Ran(produced(1))
    );
    assert_eq!(a.reconcile(scope("k"), 10), executed(5, produced(1)));
    let listed = &a.list()[0];
    assert_eq!(listed.response_status, Some(201));
    assert_eq!(
        listed.response_sha256.as_deref(),
        Some(crate::sha256_hex(b"{\"id\":1}").as_str())
    );
    assert!(listed.ended_unix_ms >= Some(listed.started_unix_ms));
}

#[test]
fn not_executed_fences_every_lower_token() {
    let mut a = Attempts::default();
    assert_eq!(a.reconcile(scope("k"), 9), Reconciled::NotExecuted);
    let (_, late) = a.start("charge", scope("k"), Some(5), Duration::ZERO);
    assert_eq!(late, Started::Refused(Refusal::Stale { seen: 9 }));
    let (_, new) = a.start("charge", scope("k"), Some(9), Duration::ZERO);
    assert_eq!(new, Started::Run, "the token that asked runs");
    assert!(a.list().iter().any(|x| x.state == AttemptState::Fenced));
}

#[test]
fn a_lower_token_cannot_commit_after_a_larger_one_started() {
    let mut a = Attempts::default();
    let mut charges = 0;
    let (old, _) = a.start("charge", scope("k"), Some(3), Duration::ZERO);
    let (new, _) = a.start("charge", scope("k"), Some(4), Duration::ZERO);
    assert_eq!(
        commit(&mut a, new, &mut charges),
        Committed::Ran(produced(1))
    );
    assert_eq!(
        commit(&mut a, old, &mut charges),
        Committed::Refused(Refusal::Stale { seen: 4 })
    );
    assert_eq!(charges, 1);
}

#[test]
fn an_abandoned_attempt_did_not_run_and_a_stale_asker_is_told_so() {
    let mut a = Attempts::default();
    let (id, _) = a.start("charge", scope("k"), Some(3), Duration::ZERO);
    a.abandoned(id);
    assert_eq!(a.reconcile(scope("k"), 2), Reconciled::Stale);
    assert_eq!(a.reconcile(scope("k"), 4), Reconciled::NotExecuted);
    assert_eq!(a.reconcile(scope("other"), 1), Reconciled::NotExecuted);
}

// The contract a `reexecute` route needs (docs/RELIABILITY.md): attempts are ordered by
// their tokens, and a request executes once.

#[test]
fn a_later_token_after_an_execution_gets_its_response_and_charges_nothing() {
    let mut a = Attempts::default();
    let mut charges = 0;
    let (first, _) = a.start("charge", scope("k"), Some(1), Duration::ZERO);
    assert_eq!(
        commit(&mut a, first, &mut charges),
        Committed::Ran(produced(1))
    );
    let (_, again) = a.start("charge", scope("k"), Some(2), Duration::ZERO);
    assert_eq!(again, Started::AlreadyExecuted(produced(1)));
    assert_eq!(charges, 1);
    assert_eq!(states(&a), [AttemptState::Executed, AttemptState::Replayed]);
    // Its token counts: a lower one is stale from now on; the reconcile still reports the
    // one execution.
    let (_, late) = a.start("charge", scope("k"), Some(1), Duration::ZERO);
    assert_eq!(late, Started::Refused(Refusal::Stale { seen: 2 }));
    assert_eq!(a.reconcile(scope("k"), 3), executed(1, produced(1)));
}

#[test]
fn an_attempt_whose_key_executed_while_it_ran_gets_that_response_at_its_commit() {
    // Between tokened attempts the larger token's start already fences the smaller one; a
    // caller without a token can still execute the key while a tokened attempt runs.
    let mut a = Attempts::default();
    let mut charges = 0;
    let (tokened, started) = a.start("charge", scope("k"), Some(7), Duration::ZERO);
    assert_eq!(started, Started::Run);
    let (direct, _) = a.start("charge", scope("k"), None, Duration::ZERO);
    assert_eq!(
        commit(&mut a, direct, &mut charges),
        Committed::Ran(produced(1))
    );
    assert_eq!(
        commit(&mut a, tokened, &mut charges),
        Committed::AlreadyExecuted(produced(1))
    );
    assert_eq!(charges, 1);
}

#[test]
fn the_same_token_twice_is_refused_before_and_after_the_execution() {
    let mut a = Attempts::default();
    let mut charges = 0;
    let (first, _) = a.start("charge", scope("k"), Some(5), Duration::ZERO);
    let (_, twice) = a.start("charge", scope("k"), Some(5), Duration::ZERO);
    assert_eq!(twice, Started::Refused(Refusal::Reused { token: 5 }));
    assert_eq!(
        commit(&mut a, first, &mut charges),
        Committed::Ran(produced(1))
    );
    let (_, after) = a.start("charge", scope("k"), Some(5), Duration::ZERO);
    assert_eq!(after, Started::Refused(Refusal::Reused { token: 5 }));
    // Also once its first attempt was abandoned (its caller left before the commit).
    let (gone, _) = a.start("charge", scope("j"), Some(8), Duration::ZERO);
    a.abandoned(gone);
    let (_, again) = a.start("charge", scope("j"), Some(8), Duration::ZERO);
    assert_eq!(again, Started::Refused(Refusal::Reused { token: 8 }));
    assert_eq!(charges, 1);
}

#[test]
fn a_failed_execution_had_no_effect_and_a_later_token_runs() {
    let mut a = Attempts::default();
    let (first, _) = a.start("charge", scope("k"), Some(1), Duration::ZERO);
    let failed = Produced {
        status: 503,
        headers: Vec::new(),
        body: Vec::new(),
    };
    assert_eq!(
        a.commit(first, || (1, failed.clone())),
        Committed::Ran(failed.clone())
    );
    let (second, started) = a.start("charge", scope("k"), Some(2), Duration::ZERO);
    assert_eq!(started, Started::Run);
    assert_eq!(
        a.commit(second, || (2, produced(2))),
        Committed::Ran(produced(2))
    );
}

#[test]
fn attempts_without_a_token_are_neither_refused_nor_deduplicated() {
    let mut a = Attempts::default();
    let mut charges = 0;
    for _ in 0..2 {
        let (id, started) = a.start("charge", scope("k"), None, Duration::ZERO);
        assert_eq!(started, Started::Run);
        assert!(matches!(
            commit(&mut a, id, &mut charges),
            Committed::Ran(_)
        ));
    }
    assert_eq!(charges, 2, "the edge dedupes callers that send no token");
}

// Issue 34 path 11: every rule holds per request (endpoint, subject, key, fingerprint).

#[test]
fn another_request_under_the_key_runs_and_each_gets_its_own_execution() {
    let mut a = Attempts::default();
    let mut charges = 0;
    let first = request("k", "POST /checkout", "fp-700");
    let (id, _) = a.start("charge", first.clone(), Some(1), Duration::ZERO);
    assert_eq!(
        commit(&mut a, id, &mut charges),
        Committed::Ran(produced(1))
    );
    // Another body under the key (the edge reused its record past its retention).
    let other = request("k", "POST /checkout", "fp-900");
    let (id, started) = a.start("charge", other.clone(), Some(2), Duration::ZERO);
    assert_eq!(started, Started::Run, "not the first request's execution");
    assert_eq!(
        commit(&mut a, id, &mut charges),
        Committed::Ran(produced(2))
    );
    // A refund under the key (another path of a prefix route): its own request too.
    let refund = request("k", "POST /refunds", "fp-700");
    let (_, started) = a.start("refund", refund, Some(3), Duration::ZERO);
    assert_eq!(started, Started::Run);
    // Each request again: its own execution.
    let (_, again) = a.start("charge", first, Some(4), Duration::ZERO);
    assert_eq!(again, Started::AlreadyExecuted(produced(1)));
    let (_, again) = a.start("charge", other, Some(5), Duration::ZERO);
    assert_eq!(again, Started::AlreadyExecuted(produced(2)));
    assert_eq!(charges, 2);
}

#[test]
fn the_reconcile_answers_about_the_asked_request_only_and_names_its_attempt() {
    let mut a = Attempts::default();
    let mut charges = 0;
    let first = request("k", "POST /checkout", "fp-700");
    let (id, _) = a.start("charge", first.clone(), Some(3), Duration::ZERO);
    commit(&mut a, id, &mut charges);
    assert_eq!(
        a.reconcile(request("k", "POST /checkout", "fp-900"), 8),
        Reconciled::NotExecuted,
        "another body's request never ran"
    );
    assert_eq!(
        a.reconcile(request("k", "POST /refunds", "fp-700"), 9),
        Reconciled::NotExecuted,
        "another endpoint's request never ran"
    );
    assert_eq!(a.reconcile(first.clone(), 10), executed(3, produced(1)));
    // The fence it raised holds at the record address (issue 46): a lower token there is an
    // earlier owner's late orphan, whichever body it carries; nothing runs for either.
    let (_, late) = a.start(
        "charge",
        request("k", "POST /checkout", "fp-900"),
        Some(7),
        Duration::ZERO,
    );
    assert_eq!(late, Started::Refused(Refusal::Stale { seen: 8 }));
    let (_, orphan) = a.start("charge", first.clone(), Some(4), Duration::ZERO);
    assert_eq!(orphan, Started::Refused(Refusal::Stale { seen: 8 }));
    // A newer attempt of the first request gets its execution.
    let (_, replayed) = a.start("charge", first, Some(11), Duration::ZERO);
    assert_eq!(replayed, Started::AlreadyExecuted(produced(1)));
    assert_eq!(charges, 1);
}

#[test]
fn an_execution_without_a_token_is_not_named_by_the_reconcile() {
    let mut a = Attempts::default();
    let mut charges = 0;
    let (id, _) = a.start("charge", scope("k"), None, Duration::ZERO);
    commit(&mut a, id, &mut charges);
    assert_eq!(a.reconcile(scope("k"), 4), Reconciled::NotExecuted);
    // The request then runs with token 4 and gets that execution (nothing charged again).
    let (_, started) = a.start("charge", scope("k"), Some(4), Duration::ZERO);
    assert_eq!(started, Started::AlreadyExecuted(produced(1)));
}

#[test]
fn the_record_is_bounded_and_never_vouches_for_what_it_forgot() {
    let mut a = Attempts::with_limit(2);
    let mut charges = 0;
    for (key, token) in [("k1", 10), ("k2", 20), ("k3", 30)] {
        let (id, started) = a.start("charge", scope(key), Some(token), Duration::ZERO);
        assert_eq!(started, Started::Run);
        assert!(matches!(
            commit(&mut a, id, &mut charges),
            Committed::Ran(_)
        ));
    }
    assert_eq!(a.requests(), 2, "the oldest request was forgotten");
    assert_eq!(
        a.forgotten(),
        Forgotten {
            requests: 1,
            highest_token: 10
        }
    );
    // k1's late orphan (a token no larger than one forgotten) is refused, not run again.
    let (_, late) = a.start("charge", scope("k1"), Some(9), Duration::ZERO);
    assert_eq!(late, Started::Refused(Refusal::Stale { seen: 10 }));
    // Asked about k1 (after that refusal too), the record cannot tell; about a kept
    // request, it still can.
    assert_eq!(a.reconcile(scope("k1"), 99), Reconciled::CannotTell);
    assert!(matches!(
        a.reconcile(scope("k3"), 99),
        Reconciled::Executed { token: 30, .. }
    ));
    // A new request (a larger token) runs.
    let (_, fresh) = a.start("charge", scope("k4"), Some(40), Duration::ZERO);
    assert_eq!(fresh, Started::Run);
}

#[test]
fn the_least_recent_request_is_forgotten_first() {
    let mut a = Attempts::with_limit(2);
    let mut charges = 0;
    for (key, token) in [("k1", 1), ("k2", 2), ("k1", 3)] {
        let (id, _) = a.start("charge", scope(key), Some(token), Duration::ZERO);
        commit(&mut a, id, &mut charges);
    }
    // k1 was attempted again after k2: k2 goes first.
    a.start("charge", scope("k3"), Some(4), Duration::ZERO);
    assert_eq!(a.reconcile(scope("k2"), 9), Reconciled::CannotTell);
    assert!(matches!(
        a.reconcile(scope("k1"), 9),
        Reconciled::Executed { token: 1, .. }
    ));
    assert_eq!(a.forgotten().highest_token, 2);
}

#[test]
fn a_running_attempt_is_not_forgotten() {
    let mut a = Attempts::with_limit(1);
    let mut charges = 0;
    let (running, _) = a.start("charge", scope("k1"), Some(1), Duration::from_secs(5));
    let (id2, _) = a.start("charge", scope("k2"), Some(2), Duration::ZERO);
    assert_eq!(a.requests(), 2, "k1 runs: nothing may be forgotten yet");
    assert!(matches!(
        commit(&mut a, id2, &mut charges),
        Committed::Ran(_)
    ));
    assert!(matches!(
        commit(&mut a, running, &mut charges),
        Committed::Ran(_)
    ));
    a.start("charge", scope("k3"), Some(3), Duration::ZERO);
    assert_eq!(a.requests(), 1);
    assert_eq!(a.forgotten().requests, 2);
}

#[test]
fn a_lower_token_at_the_same_record_address_is_refused_whatever_its_body() {
    // Issue 46: token 1's request (one body) was on the wire when its Envoy died; an operator
    // released the record, another body under the key ran with token 2; then the orphan came.
    let mut a = Attempts::default();
    let mut charges = 0;
    let (newer, ok) = a.start(
        "charge",
        request("k", "POST /checkout", "fp-b"),
        Some(2),
        Duration::ZERO,
    );
    assert_eq!(ok, Started::Run);
    assert_eq!(
        commit(&mut a, newer, &mut charges),
        Committed::Ran(produced(1))
    );
    let (_, orphan) = a.start(
        "charge",
        request("k", "POST /checkout", "fp-a"),
        Some(1),
        Duration::ZERO,
    );
    assert_eq!(orphan, Started::Refused(Refusal::Stale { seen: 2 }));
    // At the commit too: the orphan started first, the newer one of another body after it.
    let (late, ok) = a.start(
        "charge",
        request("j", "POST /checkout", "fp-a"),
        Some(3),
        Duration::ZERO,
    );
    assert_eq!(ok, Started::Run);
    let (_, ok) = a.start(
        "charge",
        request("j", "POST /checkout", "fp-b"),
        Some(4),
        Duration::ZERO,
    );
    assert_eq!(ok, Started::Run);
    assert_eq!(
        commit(&mut a, late, &mut charges),
        Committed::Refused(Refusal::Stale { seen: 4 })
    );
    // Another address (endpoint or subject) is another record: its tokens say nothing.
    let (_, ok) = a.start(
        "refund",
        request("k", "POST /refunds", "fp-a"),
        Some(1),
        Duration::ZERO,
    );
    assert_eq!(ok, Started::Run);
    assert_eq!(charges, 1);
}

#[test]
fn a_not_executed_reconcile_fences_the_whole_address() {
    let mut a = Attempts::default();
    assert_eq!(
        a.reconcile(request("k", "POST /checkout", "fp-b"), 5),
        Reconciled::NotExecuted
    );
    let (_, orphan) = a.start(
        "charge",
        request("k", "POST /checkout", "fp-a"),
        Some(3),
        Duration::ZERO,
    );
    assert_eq!(orphan, Started::Refused(Refusal::Stale { seen: 5 }));
}

#[test]
fn an_address_s_highest_token_is_forgotten_with_its_last_request_into_what_was_forgotten() {
    let mut a = Attempts::with_limit(1);
    let mut charges = 0;
    let (id, _) = a.start(
        "charge",
        request("k", "POST /checkout", "fp-b"),
        Some(7),
        Duration::ZERO,
    );
    commit(&mut a, id, &mut charges);
    let (id, _) = a.start(
        "charge",
        request("other", "POST /checkout", "fp-x"),
        Some(8),
        Duration::ZERO,
    );
    commit(&mut a, id, &mut charges);
    assert_eq!(a.requests(), 1);
    assert!(a.by_address.len() <= 1, "the forgotten address went");
    let (_, orphan) = a.start(
        "charge",
        request("k", "POST /checkout", "fp-a"),
        Some(6),
        Duration::ZERO,
    );
    assert!(matches!(orphan, Started::Refused(Refusal::Stale { .. })));
}
