//! The key state path (issue 48): a client asks what became of its key; the filter reads the
//! record from the state API and answers, forwarding and claiming nothing.

use super::*;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn config() -> String {
    with(r#""key_state_path": "/idempotency/key-state","#)
}

fn ask(t: &mut Harness, query: &str, extra: &[(&str, &str)]) -> Seen {
    let s = t.stream();
    let mut hs = vec![
        (":method", "GET"),
        (":path", query),
        ("x-jwt-sub", "user-1"),
    ];
    hs.extend_from_slice(extra);
    t.headers(s, &h(&hs), true)
}

const ASK: &str = "/idempotency/key-state?method=POST&path=%2Fcheckout";

/// The step's read of a record (its path has a query).
fn records_calls(step: &Seen) -> Vec<Dispatch> {
    step.effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dispatch(d)
                if d.header(":path")
                    .is_some_and(|p| p.starts_with(contract::wire::RECORDS_PATH)) =>
            {
                Some(d.clone())
            }
            _ => None,
        })
        .collect()
}

fn records_call(step: &Seen) -> Dispatch {
    let all = records_calls(step);
    assert_eq!(all.len(), 1, "{step:?}");
    all[0].clone()
}

fn body_of(r: &LocalReply) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap()
}

#[test]
fn a_completed_key_is_read_from_the_state_api_for_the_callers_subject() {
    let mut t = Harness::new(&config());
    let step = ask(&mut t, ASK, &[("idempotency-key", "k&1")]);
    assert_eq!(step.verdict, Verdict::Pause);
    assert!(!step.claims(), "nothing is claimed");
    let d = records_call(&step);
    assert_eq!(d.header(":method"), Some("GET"));
    assert_eq!(
        d.header(":path"),
        Some("/v1/records?namespace=&key=k%261&subject=user-1&endpoint=POST+%2Fcheckout")
    );
    assert_eq!(d.owner, Owner::Stream(t.next_stream));
    let record = serde_json::json!({
        "state": "completed", "subject": "user-1", "endpoint": "POST /checkout",
        "fingerprint_alg": "sha256-jcs-v2", "token": 3, "lease_remaining_ms": 0, "age_ms": 10,
        "completed_age_ms": 5, "response_status": 201, "replayable": true,
        "expires_in_ms": 7_200_500, "lease_ms": 30_000,
    });
    let step = t.answer(&d, answer(&record));
    let r = step.reply();
    assert_eq!(r.status, 200);
    assert_eq!(header(r, "idempotency-key-expires-in"), Some("7200"));
    assert_eq!(header(r, "cache-control"), Some("no-store"));
    assert_eq!(
        body_of(r),
        serde_json::json!({"key_state": "completed", "retry_same_key": true, "new_key_safe": false,
            "endpoint": "POST /checkout", "status": 201, "replayable": true, "expires_in_s": 7200})
    );
}

#[test]
fn no_record_is_absent_and_a_state_api_failure_is_503() {
    let mut t = Harness::new(&config());
    let step = ask(&mut t, ASK, &[("idempotency-key", "k")]);
    let d = records_call(&step);
    let no_record = CalloutResult::Response {
        status: 404,
        headers: vec![(
            contract::wire::NO_RECORD_HEADER.into(),
            contract::wire::NO_RECORD_VALUE.into(),
        )],
        body: br#"{"type":"/problems/not-found"}"#.to_vec(),
    };
    let step = t.answer(&d, no_record);
    let said = body_of(step.reply());
    assert_eq!(
        (said["key_state"].as_str(), said["retry_same_key"].as_bool()),
        (Some("absent"), Some(true))
    );
    assert_eq!(header(step.reply(), "idempotency-key-expires-in"), None);

    // A 404 the state API did not mark (a proxy's, a route it does not have) is not "no
    // record": a client told absent may take a new key for a request that ran. 503.
    let step = ask(&mut t, ASK, &[("idempotency-key", "k")]);
    let d = records_call(&step);
    let step = t.answer(&d, status(404, br#"{"type":"/problems/not-found"}"#));
    assert_eq!(step.reply().status, 503);
    assert_eq!(
        problem_type(step.reply()),
        "/problems/idempotency-state-unavailable"
    );

    let step = ask(&mut t, ASK, &[("idempotency-key", "k")]);
    let d = records_call(&step);
    let step = t.answer(&d, CalloutResult::Failed("reset".into()));
    assert_eq!(step.reply().status, 503);
    assert_eq!(
        problem_type(step.reply()),
        "/problems/idempotency-state-unavailable"
    );

    // A record the module's reader cannot take (a float, a member twice) is never read as
    // absent: 503, as an outage.
    for unreadable in [
        br#"{"state":"completed","expires_in_ms":1.5}"#.as_slice(),
        br#"{"state":"completed","state":"in_progress"}"#,
    ] {
        let step = ask(&mut t, ASK, &[("idempotency-key", "k")]);
        let d = records_call(&step);
        let step = t.answer(&d, status(200, unreadable));
        assert_eq!(
            step.reply().status,
            503,
            "{:?}",
            String::from_utf8_lossy(unreadable)
        );
    }
}

#[test]
fn bad_questions_are_answered_at_once_without_a_callout() {
    let mut t = Harness::new(&config());
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], u16, &'a str);
    let cases: [Case; 4] = [
        (ASK, &[], 400, "/problems/missing-idempotency-key"),
        (
            "/idempotency/key-state?path=/checkout",
            &[("idempotency-key", "k")],
            400,
            "/problems/bad-request",
        ),
        (
            "/idempotency/key-state?method=POST&path=/nowhere",
            &[("idempotency-key", "k")],
            400,
            "/problems/bad-request",
        ),
        (
            ASK,
            &[("idempotency-key", "")],
            400,
            "/problems/invalid-idempotency-key",
        ),
    ];
    for (path, extra, code, kind) in cases {
        let step = ask(&mut t, path, extra);
        assert!(records_calls(&step).is_empty(), "{path}");
        assert_eq!(
            (step.reply().status, problem_type(step.reply()).as_str()),
            (code, kind),
            "{path}"
        );
    }
    // No subject: 401.
    let s = t.stream();
    let step = t.headers(
        s,
        &h(&[(":method", "GET"), (":path", ASK), ("idempotency-key", "k")]),
        true,
    );
    assert_eq!(step.reply().status, 401);
}

#[test]
fn without_the_option_the_path_is_not_the_filters() {
    let mut t = Harness::new(CONFIG);
    let step = ask(&mut t, ASK, &[("idempotency-key", "k")]);
    assert_eq!((step.verdict, step.effects.len()), (Verdict::Continue, 0));
}

#[test]
fn a_key_state_path_that_a_get_route_matches_is_refused() {
    let cfg = with(r#""key_state_path": "/carts/state","#).replace(
        r#"{"method": "POST", "prefix": "/carts/", "key": "optional"}"#,
        r#"{"method": "GET", "prefix": "/carts/", "key": "optional"}"#,
    );
    let e = crate::config::Config::parse(cfg.as_bytes()).unwrap_err();
    assert!(e.to_string().contains("key_state_path"), "{e}");
}

#[test]
fn a_question_with_a_body_or_a_control_character_is_refused_at_its_headers() {
    let mut t = Harness::new(&config());
    // A body would be left for Envoy to forward: refused at the headers.
    let s = t.stream();
    let hs = h(&[
        (":method", "GET"),
        (":path", ASK),
        ("x-jwt-sub", "user-1"),
        ("idempotency-key", "k"),
    ]);
    let step = t.headers(s, &hs, false);
    assert!(records_calls(&step).is_empty());
    assert_eq!(step.reply().status, 400);
    // A newline in the path asked about: 400, not a state API error.
    let step = ask(
        &mut t,
        "/idempotency/key-state?method=POST&path=%2Fcarts%2Fa%0Ab",
        &[("idempotency-key", "k")],
    );
    assert!(records_calls(&step).is_empty());
    assert_eq!(step.reply().status, 400);
    // The state API refusing the question (4xx) is not an outage: 500, not 503.
    let step = ask(&mut t, ASK, &[("idempotency-key", "k")]);
    let d = records_call(&step);
    let step = t.answer(&d, status(400, b"{}"));
    assert_eq!(step.reply().status, 500);
}
