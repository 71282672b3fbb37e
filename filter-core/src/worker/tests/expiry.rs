//! The key's horizon (`Idempotency-Key-Expires-In`, issue 48): on the first answer, the
//! retention the state API applies; on every replay, what is left of the stored record's.

use super::*;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const HOUR_MS: u64 = 3_600_000;
const EXPIRES: &str = "idempotency-key-expires-in";

fn claimed_for(token: i64, retention_s: Option<u64>) -> CalloutResult {
    answer(&ClaimResponse::Claimed {
        token,
        lease_ms: 30_000,
        reclaimed: false,
        max_body_bytes: None,
        retention_s,
    })
}

fn expires_set(step: &Seen) -> Option<String> {
    step.effects.iter().find_map(|e| match e {
        Effect::SetResponseHeader { name, value, .. } if *name == EXPIRES => Some(value.clone()),
        _ => None,
    })
}

#[test]
fn seconds_are_rounded_down_and_any_expiry_is_carried() {
    use crate::headers::expires_in;
    assert_eq!(expires_in(0), "0");
    assert_eq!(
        expires_in(86_399_999),
        "86399",
        "never later than the expiry"
    );
    assert_eq!(expires_in(u64::MAX), "18446744073709551");
}

#[test]
fn the_first_answer_says_how_long_the_key_is_kept() {
    let mut t = Harness::new(CONFIG);
    let (s, step) = t.keyed("k1", "/checkout", b"{}");
    let step = t.answer_claim(&step, claimed_for(42, Some(24 * 3_600)));
    assert!(step.resumes_request());
    t.advance(5_000);
    let step = t.ok_response(s, "201", false);
    assert_eq!(expires_set(&step).as_deref(), Some("86400"), "{step:?}");
    assert_eq!(step.verdict, Verdict::Continue);
    assert!(
        matches!(step.effects.first(), Some(Effect::SetResponseHeader { stream, .. }) if *stream == s),
        "set while the callback holds the headers: {step:?}"
    );
}

#[test]
fn without_a_retention_from_the_state_api_the_first_answer_says_nothing() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    assert_eq!(expires_set(&t.ok_response(s, "201", false)), None);
}

#[test]
fn a_released_key_gets_no_horizon() {
    let mut t = Harness::new(CONFIG);
    let (s, step) = t.keyed("k1", "/refunds", b"{}");
    t.answer_claim(&step, claimed_for(42, Some(3_600)));
    // /refunds releases its key on a 5xx: it is free at once, no horizon to announce.
    assert_eq!(expires_set(&t.ok_response(s, "503", false)), None);
}

#[test]
fn a_replay_says_what_is_left_from_the_store_and_from_memory() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", b"{}");
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::Completed {
            response: stored_201(),
            expires_in_ms: Some(2 * HOUR_MS),
            waited_ms: None,
        }),
    );
    let r = step.reply();
    assert_eq!(header(r, "idempotent-replayed"), Some("true"));
    assert_eq!(header(r, EXPIRES), Some("7200"));
    // The same key again 1.5 s later: from this worker's memory, what is left, rounded down.
    t.advance(1_500);
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", b"{}");
    assert_eq!(
        step.counts(),
        vec![Metric::Replayed, Metric::ReplayCacheHits],
        "{step:?}"
    );
    assert_eq!(header(step.reply(), EXPIRES), Some("7198"));
}

#[test]
fn an_outcome_stored_by_this_worker_is_replayed_with_what_is_left() {
    let mut t = Harness::new(CONFIG);
    let (s, _) = t.claimed("/checkout", b"{}", 42);
    t.advance(300);
    t.ok_response(s, "201", false);
    let step = t.response_body(s, 2, true, &mut |_| Some(b"{}".to_vec()));
    let d = step.dispatch(COMPLETE_PATH).clone();
    // Stored with a day left; counted from the claim (300 ms before), so 1 s less.
    t.answer(&d, answer(&WriteResponse::completed(24 * HOUR_MS)));
    let (_, step) = t.keyed("k1", "/checkout", b"{}");
    let r = step.reply();
    assert_eq!(header(r, "idempotent-replayed"), Some("true"), "{step:?}");
    assert_eq!(header(r, EXPIRES), Some("86399"));
}
