//! Scenario tests of the per-request state machine (natively and in wasm).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use contract::wire::{HeartbeatRequest, StoredResponse, WriteResponse};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CONFIG: &str = r#"{
  "state_api": {"cluster": "state_api", "authority": "state-api", "token": "t", "timeout_ms": 1000},
  "subject": {"header": "x-jwt-sub"},
  "routes": [
    {"method": "POST", "path": "/checkout", "key": "required"},
    {"method": "POST", "path": "/refunds", "key": "required", "on_5xx": "release", "on_state_unavailable": "fail_open"},
    {"method": "POST", "prefix": "/carts/", "key": "optional"}
  ],
  "max_request_body_bytes": 100,
  "max_stored_body_bytes": 10,
  "replay_extra_headers": ["x-charge-id"]
}"#;

fn flow() -> Flow {
    Flow::new(Rc::new(Config::parse(CONFIG.as_bytes()).unwrap()))
}

fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect()
}

fn req_headers(path: &str, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v = h(&[
        (":method", "POST"),
        (":path", path),
        (":authority", "shop"),
        ("x-jwt-sub", "user-1"),
    ]);
    v.extend(h(extra));
    v
}

fn head(headers: &[(String, String)]) -> RequestHead<'_> {
    RequestHead {
        headers,
        metadata_subject: None,
    }
}

fn reply_of(step: &Step) -> &LocalReply {
    step.effects
        .iter()
        .find_map(|e| match e {
            Effect::Reply(r) => Some(r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no reply in {step:?}"))
}

fn problem_type(r: &LocalReply) -> String {
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    v["type"].as_str().unwrap().to_owned()
}

fn header<'a>(r: &'a LocalReply, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

fn counts(step: &Step) -> Vec<Metric> {
    step.effects
        .iter()
        .filter_map(|e| match e {
            Effect::Count(m) => Some(*m),
            _ => None,
        })
        .collect()
}

fn claim_payload(step: &Step) -> ClaimRequest {
    let body = step
        .effects
        .iter()
        .find_map(|e| match e {
            Effect::DispatchClaim(b) => Some(b.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no claim in {step:?}"));
    serde_json::from_slice(&body).unwrap()
}

fn answer<T: serde::Serialize>(v: &T) -> Callout {
    Callout::Answer {
        status: 200,
        body: serde_json::to_vec(v).unwrap(),
    }
}

/// Drives a flow to the point where the request was claimed and resumed.
fn claimed_flow(path: &str, body: &[u8]) -> (Flow, ClaimRequest) {
    claim_in(flow(), path, body)
}

fn claim_in(mut f: Flow, path: &str, body: &[u8]) -> (Flow, ClaimRequest) {
    let hs = req_headers(
        path,
        &[
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
        ],
    );
    assert_eq!(
        f.on_request_headers(head(&hs), false).verdict,
        Verdict::Pause
    );
    let step = f.on_request_body(body.len(), true, |n| Some(body[..n].to_vec()));
    assert_eq!(step.verdict, Verdict::Pause);
    let claim = claim_payload(&step);
    let step = f.on_claim_answer(answer(&ClaimResponse::Claimed {
        token: 42,
        lease_ms: 30_000,
        reclaimed: false,
    }));
    assert!(step.effects.contains(&Effect::ResumeRequest));
    assert!(f.awaits_response());
    (f, claim)
}

#[test]
fn unprotected_routes_and_methods_pass_untouched() {
    let mut f = flow();
    let hs = h(&[(":method", "GET"), (":path", "/checkout")]);
    assert_eq!(f.on_request_headers(head(&hs), true), Step::cont());
    assert!(f.is_passthrough());
    assert_eq!(
        f.on_request_body(10, true, |_| panic!("no read")),
        Step::cont()
    );
    assert_eq!(
        f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, false),
        Step::cont()
    );

    let mut f = flow();
    let hs = req_headers("/other", &[("idempotency-key", "k")]);
    assert_eq!(f.on_request_headers(head(&hs), false), Step::cont());
    // Exact path match ignores the query but not a longer path.
    let mut f = flow();
    let hs = req_headers("/checkout/1", &[]);
    assert_eq!(f.on_request_headers(head(&hs), false), Step::cont());
}

#[test]
fn optional_route_without_key_passes_but_loses_a_forged_fencing_token() {
    let mut f = flow();
    let hs = req_headers("/carts/9?x=1", &[("idempotency-fencing-token", "999")]);
    let step = f.on_request_headers(head(&hs), false);
    assert_eq!(step.verdict, Verdict::Continue);
    assert_eq!(
        step.effects,
        vec![Effect::RemoveRequestHeader(FENCING_TOKEN_HEADER)]
    );
    // With a key the optional route is protected.
    let mut f = flow();
    let hs = req_headers("/carts/9", &[("idempotency-key", "k")]);
    assert_eq!(
        f.on_request_headers(head(&hs), false).verdict,
        Verdict::Pause
    );
}

#[test]
fn missing_or_bad_key_is_400() {
    let mut f = flow();
    let step = f.on_request_headers(head(&req_headers("/checkout", &[])), false);
    let r = reply_of(&step);
    assert_eq!(r.status, 400);
    assert_eq!(problem_type(r), "/problems/missing-idempotency-key");
    assert_eq!(header(r, "content-type"), Some("application/problem+json"));
    assert_eq!(header(r, "cache-control"), Some("no-store"));
    assert_eq!(counts(&step), vec![Metric::BadKey400]);
    assert!(f.replied());
    // Response callbacks after our own reply leave it alone (C-6).
    assert_eq!(
        f.on_response_headers(&h(&[(":status", "400")]), "", 0, false),
        Step::cont()
    );
    assert_eq!(
        f.on_response_body(10, true, |_| panic!("must not read our own reply")),
        Step::cont()
    );

    for bad in [
        vec![("idempotency-key", "a,b")],
        vec![("idempotency-key", "a"), ("idempotency-key", "a")],
        vec![("idempotency-key", "")],
    ] {
        let mut f = flow();
        let step = f.on_request_headers(head(&req_headers("/checkout", &bad)), false);
        let r = reply_of(&step);
        assert_eq!(
            (r.status, problem_type(r).as_str()),
            (400, "/problems/invalid-idempotency-key"),
            "{bad:?}"
        );
    }
}

#[test]
fn no_subject_is_401() {
    for hs in [
        h(&[
            (":method", "POST"),
            (":path", "/checkout"),
            ("idempotency-key", "k"),
        ]),
        h(&[
            (":method", "POST"),
            (":path", "/checkout"),
            ("idempotency-key", "k"),
            ("x-jwt-sub", ""),
        ]),
        h(&[
            (":method", "POST"),
            (":path", "/checkout"),
            ("idempotency-key", "k"),
            ("x-jwt-sub", "a"),
            ("x-jwt-sub", "b"),
        ]),
    ] {
        let mut f = flow();
        let step = f.on_request_headers(head(&hs), false);
        assert_eq!(reply_of(&step).status, 401);
        assert_eq!(counts(&step), vec![Metric::Unauthenticated401]);
    }
}

#[test]
fn subject_from_metadata() {
    let cfg = CONFIG.replace(
        r#""subject": {"header": "x-jwt-sub"}"#,
        r#""subject": {"metadata": ["envoy.filters.http.jwt_authn", "jwt_payload", "sub"]}"#,
    );
    let cfg = Rc::new(Config::parse(cfg.as_bytes()).unwrap());
    let hs = req_headers("/checkout", &[("idempotency-key", "k")]);
    // The header is ignored: only the metadata counts.
    let mut f = Flow::new(Rc::clone(&cfg));
    assert_eq!(reply_of(&f.on_request_headers(head(&hs), true)).status, 401);
    let mut f = Flow::new(cfg);
    let step = f.on_request_headers(
        RequestHead {
            headers: &hs,
            metadata_subject: Some("meta-user"),
        },
        true,
    );
    assert_eq!(claim_payload(&step).subject, "meta-user");
}

#[test]
fn too_large_is_413_from_content_length_or_while_buffering() {
    let mut f = flow();
    let step = f.on_request_headers(
        head(&req_headers(
            "/checkout",
            &[("idempotency-key", "k"), ("content-length", "101")],
        )),
        false,
    );
    assert_eq!(reply_of(&step).status, 413);
    assert_eq!(counts(&step), vec![Metric::TooLarge413]);

    let mut f = flow();
    let step = f.on_request_headers(
        head(&req_headers("/checkout", &[("idempotency-key", "k")])),
        false,
    );
    assert_eq!(step, Step::pause());
    assert_eq!(
        f.on_request_body(60, false, |_| panic!("not yet")),
        Step::pause()
    );
    let step = f.on_request_body(101, false, |_| panic!("never"));
    assert_eq!(reply_of(&step).status, 413);
    assert!(f.replied());
}

#[test]
fn claim_carries_key_subject_endpoint_and_canonical_fingerprint() {
    let (_, a) = claimed_flow("/checkout?b=2", br#"{"amount":1,"card":{"n":"4111"}}"#);
    assert_eq!(a.key, "k1");
    assert_eq!(a.subject, "user-1");
    assert_eq!(a.endpoint, "POST /checkout");
    assert_eq!(a.fingerprint_alg, "sha256-jcs-v1");
    assert_eq!(a.lease_ms, Some(30_000));
    let (_, b) = claimed_flow(
        "/checkout?b=2",
        b"{ \"card\": {\"n\": \"4111\"}, \"amount\": 1.0 }",
    );
    assert_eq!(a.fingerprint, b.fingerprint);
    let (_, c) = claimed_flow("/checkout?b=3", br#"{"amount":1,"card":{"n":"4111"}}"#);
    assert_ne!(a.fingerprint, c.fingerprint);
    // A quoted key is the same key, and it is forwarded in bare form with the fencing token.
    let mut f = flow();
    let hs = req_headers("/checkout", &[("idempotency-key", "\"k1\"")]);
    let step = f.on_request_headers(head(&hs), true);
    assert_eq!(claim_payload(&step).key, "k1");
    let step = f.on_claim_answer(answer(&ClaimResponse::Claimed {
        token: 7,
        lease_ms: 30_000,
        reclaimed: true,
    }));
    assert!(step
        .effects
        .contains(&Effect::SetRequestHeader("idempotency-key", "k1".into())));
    assert!(step
        .effects
        .contains(&Effect::SetRequestHeader(FENCING_TOKEN_HEADER, "7".into())));
    assert!(step.effects.contains(&Effect::Register(InFlight {
        key: "k1".into(),
        subject: "user-1".into(),
        endpoint: "POST /checkout".into(),
        token: 7
    })));
    assert_eq!(counts(&step), vec![Metric::Claimed]);
    assert_eq!(step.effects.last(), Some(&Effect::ResumeRequest));
}

#[test]
fn duplicate_json_members_are_400() {
    let mut f = flow();
    let hs = req_headers(
        "/checkout",
        &[
            ("idempotency-key", "k"),
            ("content-type", "application/json"),
        ],
    );
    f.on_request_headers(head(&hs), false);
    let body = br#"{"amount":1,"amount":1000}"#;
    let step = f.on_request_body(body.len(), true, |_| Some(body.to_vec()));
    let r = reply_of(&step);
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (400, "/problems/duplicate-json-member")
    );
    assert_eq!(counts(&step), vec![Metric::BadBody400]);
}

#[test]
fn trailers_end_the_body() {
    let mut f = flow();
    let hs = req_headers("/checkout", &[("idempotency-key", "k")]);
    f.on_request_headers(head(&hs), false);
    assert_eq!(
        f.on_request_body(3, false, |_| panic!("not yet")),
        Step::pause()
    );
    let step = f.on_request_trailers(|n| {
        assert_eq!(n, 3);
        Some(b"abc".to_vec())
    });
    assert_eq!(claim_payload(&step).fingerprint_alg, "sha256-raw-v1");
}

#[test]
fn unreadable_body_is_answered() {
    let mut f = flow();
    let hs = req_headers("/checkout", &[("idempotency-key", "k")]);
    f.on_request_headers(head(&hs), false);
    let step = f.on_request_body(3, true, |_| None);
    assert_eq!(reply_of(&step).status, 500);
}

#[test]
fn in_progress_is_409_with_retry_after() {
    let mut f = flow();
    f.on_request_headers(
        head(&req_headers("/checkout", &[("idempotency-key", "k")])),
        true,
    );
    let step = f.on_claim_answer(answer(&ClaimResponse::InProgress {
        retry_after_s: 0,
        lease_remaining_ms: 10,
    }));
    let r = reply_of(&step);
    assert_eq!((r.status, header(r, "retry-after")), (409, Some("1")));
    assert_eq!(problem_type(r), "/problems/request-in-progress");
    assert_eq!(counts(&step), vec![Metric::InProgress409]);
}

#[test]
fn mismatch_is_422() {
    let mut f = flow();
    f.on_request_headers(
        head(&req_headers("/checkout", &[("idempotency-key", "k")])),
        true,
    );
    let step = f.on_claim_answer(answer(&ClaimResponse::Mismatch));
    let r = reply_of(&step);
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (422, "/problems/idempotency-key-reused")
    );
    assert_eq!(counts(&step), vec![Metric::Mismatch422]);
}

#[test]
fn completed_is_replayed_with_allowlisted_headers() {
    let mut f = flow();
    f.on_request_headers(
        head(&req_headers("/checkout", &[("idempotency-key", "k")])),
        true,
    );
    let stored = StoredResponse::new(
        201,
        h(&[
            ("content-type", "application/json"),
            ("location", "/c/1"),
            ("set-cookie", "s=1"),
            ("x-charge-id", "ch_1"),
        ]),
        b"{\"id\":1}",
        true,
    );
    let step = f.on_claim_answer(answer(&ClaimResponse::Completed {
        response: stored,
        expires_in_ms: None,
    }));
    let r = reply_of(&step);
    assert_eq!(r.status, 201);
    assert_eq!(r.body, b"{\"id\":1}");
    assert_eq!(
        r.headers,
        h(&[
            ("content-type", "application/json"),
            ("location", "/c/1"),
            ("x-charge-id", "ch_1"),
            ("idempotent-replayed", "true")
        ])
    );
    assert_eq!(counts(&step), vec![Metric::Replayed]);
    assert!(f.replied());
}

#[test]
fn completed_but_not_replayable_is_409_with_location() {
    let mut f = flow();
    f.on_request_headers(
        head(&req_headers("/checkout", &[("idempotency-key", "k")])),
        true,
    );
    let stored = StoredResponse::new(201, h(&[("location", "/c/1")]), b"", false);
    let step = f.on_claim_answer(answer(&ClaimResponse::Completed {
        response: stored,
        expires_in_ms: None,
    }));
    let r = reply_of(&step);
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (409, "/problems/outcome-not-replayable")
    );
    assert_eq!(header(r, "location"), Some("/c/1"));
    assert_eq!(header(r, "retry-after"), None);
    assert_eq!(counts(&step), vec![Metric::NotReplayable]);
}

#[test]
fn state_api_trouble_fails_closed_with_503() {
    for bad in [
        Callout::Failed("reset".into()),
        Callout::Answer {
            status: 500,
            body: b"oops".to_vec(),
        },
        Callout::Answer {
            status: 401,
            body: b"{}".to_vec(),
        },
        Callout::Answer {
            status: 200,
            body: b"{\"outcome\":\"maybe\"}".to_vec(),
        },
        Callout::Answer {
            status: 200,
            body: serde_json::to_vec(&ClaimResponse::Completed {
                response: StoredResponse {
                    status: 200,
                    headers: vec![],
                    body_base64: "!!".into(),
                    replayable: true,
                },
                expires_in_ms: None,
            })
            .unwrap(),
        },
    ] {
        let mut f = flow();
        f.on_request_headers(
            head(&req_headers("/checkout", &[("idempotency-key", "k")])),
            true,
        );
        let step = f.on_claim_answer(bad.clone());
        let r = reply_of(&step);
        assert_eq!(
            (r.status, header(r, "retry-after")),
            (503, Some("1")),
            "{bad:?}"
        );
        assert_eq!(problem_type(r), "/problems/idempotency-state-unavailable");
        assert_eq!(counts(&step), vec![Metric::StateApiErrors]);
        assert!(!step.effects.contains(&Effect::ResumeRequest));
    }
}

#[test]
fn fail_open_route_forwards_and_counts() {
    let mut f = flow();
    let hs = req_headers(
        "/refunds",
        &[("idempotency-key", "k"), ("idempotency-fencing-token", "1")],
    );
    f.on_request_headers(head(&hs), true);
    let step = f.on_claim_answer(Callout::Failed("unreachable".into()));
    assert_eq!(
        counts(&step),
        vec![Metric::StateApiErrors, Metric::FailedOpen]
    );
    assert!(step
        .effects
        .contains(&Effect::RemoveRequestHeader(FENCING_TOKEN_HEADER)));
    assert_eq!(step.effects.last(), Some(&Effect::ResumeRequest));
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::Reply(_))));
    // The response is not captured.
    assert_eq!(
        f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true),
        Step::cont()
    );
}

fn complete_payload(step: &Step) -> CompleteRequest {
    let body = step
        .effects
        .iter()
        .find_map(|e| match e {
            Effect::DispatchComplete(b) => Some(b.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no complete in {step:?}"));
    serde_json::from_slice(&body).unwrap()
}

fn written() -> Callout {
    answer(&WriteResponse::completed(86_400_000))
}

#[test]
fn upstream_response_is_captured_and_completed_holding_the_last_chunk() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    let resp = h(&[
        (":status", "201"),
        ("content-type", "application/json"),
        ("set-cookie", "a"),
        ("location", "/c/1"),
    ]);
    assert_eq!(
        f.on_response_headers(&resp, "via_upstream", 0, false),
        Step::cont()
    );
    // Every chunk is held (cumulative sizes), the whole body is read once at the end.
    assert_eq!(
        f.on_response_body(5, false, |_| panic!("not before the end")),
        Step::pause()
    );
    assert_eq!(
        f.on_response_body(8, false, |_| panic!("not before the end")),
        Step::pause()
    );
    let step = f.on_response_body(8, true, |n| {
        assert_eq!(n, 8);
        Some(b"{\"id\":1}".to_vec())
    });
    assert_eq!(
        step.verdict,
        Verdict::Pause,
        "the response is held until the store answers"
    );
    let c = complete_payload(&step);
    assert_eq!(
        (
            c.key.as_str(),
            c.subject.as_str(),
            c.endpoint.as_str(),
            c.token
        ),
        ("k1", "user-1", "POST /checkout", 42)
    );
    assert_eq!(c.response.status, 201);
    assert!(c.response.replayable);
    assert_eq!(c.response.body().unwrap(), b"{\"id\":1}");
    assert_eq!(
        c.response.headers,
        h(&[("content-type", "application/json"), ("location", "/c/1")])
    );
    // Anything arriving meanwhile is held too.
    assert_eq!(f.on_response_trailers(|_| panic!("no read")), Step::pause());
    let step = f.on_write_answer(written());
    assert_eq!(counts(&step), vec![Metric::Completed]);
    assert_eq!(
        step.effects[step.effects.len() - 2..],
        [Effect::Unregister(42), Effect::ResumeResponse]
    );
}

#[test]
fn headers_only_response_completes_at_once() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    let step = f.on_response_headers(&h(&[(":status", "204")]), "via_upstream", 0, true);
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(complete_payload(&step).response.status, 204);
}

#[test]
fn response_trailers_end_the_capture() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, false);
    assert_eq!(
        f.on_response_body(2, false, |_| panic!("later")),
        Step::pause()
    );
    let step = f.on_response_trailers(|n| Some(b"ok".get(..n).unwrap().to_vec()));
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(complete_payload(&step).response.body().unwrap(), b"ok");
}

#[test]
fn too_large_response_is_stored_without_body_and_not_replayable() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    f.on_response_headers(
        &h(&[(":status", "201"), ("location", "/c/9")]),
        "via_upstream",
        0,
        false,
    );
    assert_eq!(
        f.on_response_body(8, false, |_| panic!("not yet")),
        Step::pause()
    );
    // Over the limit (10): stored at once without a body while the response is held...
    let step = f.on_response_body(16, false, |_| panic!("no need to read past the limit"));
    assert_eq!(step.verdict, Verdict::Pause);
    let c = complete_payload(&step);
    assert!(!c.response.replayable);
    assert_eq!(c.response.status, 201);
    assert_eq!(c.response.body_base64, "");
    assert_eq!(c.response.headers, h(&[("location", "/c/9")]));
    assert_eq!(counts(&step), vec![Metric::StoredWithoutBody]);
    let step = f.on_write_answer(written());
    assert_eq!(step.effects.last(), Some(&Effect::ResumeResponse));
    // ...then the rest streams on untouched.
    assert_eq!(
        f.on_response_body(4096, false, |_| panic!("no read")),
        Step::cont()
    );
    assert_eq!(
        f.on_response_body(0, true, |_| panic!("no read")),
        Step::cont()
    );
}

#[test]
fn unreadable_response_body_is_stored_as_not_replayable() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, false);
    let step = f.on_response_body(3, true, |_| None);
    assert!(!complete_payload(&step).response.replayable);
}

#[test]
fn never_reached_upstream_releases_the_key() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    let step = f.on_response_headers(&h(&[(":status", "503")]), "no_healthy_upstream", 0x2, false);
    assert_eq!(step.verdict, Verdict::Pause);
    let payload = step
        .effects
        .iter()
        .find_map(|e| match e {
            Effect::DispatchRelease(b) => Some(b.clone()),
            _ => None,
        })
        .unwrap();
    let r: ReleaseRequest = serde_json::from_slice(&payload).unwrap();
    assert_eq!((r.key.as_str(), r.token), ("k1", 42));
    assert_eq!(
        f.on_response_body(19, true, |_| panic!("not captured")),
        Step::pause()
    );
    let step = f.on_write_answer(answer(&WriteResponse::released()));
    assert_eq!(counts(&step), vec![Metric::Released]);
    assert_eq!(step.effects.last(), Some(&Effect::ResumeResponse));
}

#[test]
fn five_hundreds_are_stored_or_released_per_route() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    let step = f.on_response_headers(&h(&[(":status", "502")]), "via_upstream", 0, true);
    assert_eq!(complete_payload(&step).response.status, 502);

    let (mut f, _) = claimed_flow("/refunds", b"{}");
    let step = f.on_response_headers(&h(&[(":status", "502")]), "via_upstream", 0, true);
    assert!(step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::DispatchRelease(_))));
}

fn handoff_of(step: &Step) -> &PendingComplete {
    step.effects
        .iter()
        .find_map(|e| match e {
            Effect::Handoff(p) => Some(p),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no handoff in {step:?}"))
}

#[test]
fn failed_complete_is_retried_once_then_handed_to_the_worker_and_the_response_goes_on() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    let step = f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true);
    let first = complete_payload(&step);
    let step = f.on_write_answer(Callout::Failed("timeout".into()));
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(complete_payload(&step), first);
    assert_eq!(counts(&step), vec![Metric::StateApiErrors]);
    assert!(!step.effects.contains(&Effect::ResumeResponse));
    let step = f.on_write_answer(Callout::Answer {
        status: 503,
        body: vec![],
    });
    assert_eq!(counts(&step), vec![Metric::StateApiErrors]);
    // The claim stays registered (its lease is kept alive) and the worker gets the payload.
    assert!(!step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::Unregister(_))));
    let p = handoff_of(&step);
    assert_eq!(
        (
            p.claim.token,
            p.claim.key.as_str(),
            p.claim.endpoint.as_str()
        ),
        (42, "k1", "POST /checkout")
    );
    let handed: CompleteRequest = serde_json::from_slice(&p.payload).unwrap();
    assert_eq!(handed, first);
    assert_eq!(step.effects.last(), Some(&Effect::ResumeResponse));
    assert_eq!(f.state_name(), "finished");
}

fn background_flow() -> Flow {
    let cfg = CONFIG.replace(
        r#""max_request_body_bytes": 100,"#,
        r#""max_request_body_bytes": 100, "complete_in_background": true,"#,
    );
    Flow::new(Rc::new(Config::parse(cfg.as_bytes()).unwrap()))
}

#[test]
fn in_background_the_response_goes_on_and_the_worker_gets_the_untried_complete() {
    let (mut f, claim) = claim_in(background_flow(), "/checkout", b"{}");
    let step = f.on_response_headers(
        &h(&[(":status", "201"), ("content-type", "application/json")]),
        "via_upstream",
        0,
        false,
    );
    assert_eq!(step, Step::cont());
    assert_eq!(
        f.on_response_body(4, false, |_| panic!("not yet")),
        Step::pause()
    );
    let step = f.on_response_body(9, true, |n| Some(b"{\"id\":\"c\"}"[..n].to_vec()));
    // Nothing is sent from the stream: the glue asks the worker first.
    assert_eq!(step.verdict, Verdict::Pause);
    let Some(Effect::OfferComplete(bytes)) = step.effects.last() else {
        panic!("no offer in {step:?}");
    };
    assert!(!step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::DispatchComplete(_))));

    let step = f.complete_in_background(true);
    assert_eq!(step.verdict, Verdict::Continue);
    let p = handoff_of(&step);
    assert!(p.background);
    assert_eq!(p.payload.len(), *bytes);
    let handed: CompleteRequest = serde_json::from_slice(&p.payload).unwrap();
    assert_eq!(
        (handed.key.as_str(), handed.token, handed.response.status),
        (claim.key.as_str(), 42, 201)
    );
    assert_eq!(step.effects.last(), Some(&Effect::ResumeResponse));
    // The claim stays registered: the worker keeps its lease alive until it is stored.
    assert!(!step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::Unregister(_))));
    assert_eq!(f.state_name(), "finished");
    assert_eq!(f.on_stream_done(), Step::cont());
}

#[test]
fn in_background_a_full_worker_means_the_stream_stores_and_holds_as_usual() {
    let (mut f, _) = claim_in(background_flow(), "/checkout", b"{}");
    let step = f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true);
    assert!(matches!(
        step.effects.last(),
        Some(Effect::OfferComplete(_))
    ));
    let step = f.complete_in_background(false);
    assert_eq!(step.verdict, Verdict::Pause);
    assert_eq!(counts(&step), vec![Metric::CompleteHeld]);
    assert_eq!(complete_payload(&step).response.status, 200);
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::Handoff(_))));
    let step = f.on_write_answer(written());
    assert_eq!(counts(&step), vec![Metric::Completed]);
    assert_eq!(
        step.effects[step.effects.len() - 2..],
        [Effect::Unregister(42), Effect::ResumeResponse]
    );
    // An answer out of turn changes nothing.
    assert_eq!(f.complete_in_background(true).verdict, Verdict::Continue);
    assert_eq!(f.state_name(), "finished");
}

#[test]
fn in_background_releases_are_still_held() {
    let (mut f, _) = claim_in(background_flow(), "/checkout", b"{}");
    let step = f.on_response_headers(&h(&[(":status", "503")]), "no_healthy_upstream", 0x2, true);
    assert!(step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::DispatchRelease(_))));
    assert!(!step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::OfferComplete(_))));
}

#[test]
fn without_retries_a_failed_complete_is_given_up_after_one_retry() {
    let cfg = CONFIG.replace(
        r#""max_request_body_bytes": 100,"#,
        r#""max_request_body_bytes": 100, "complete_retry_ms": 0,"#,
    );
    let cfg = Rc::new(Config::parse(cfg.as_bytes()).unwrap());
    let (mut f, _) = claim_in(Flow::new(Rc::clone(&cfg)), "/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true);
    f.on_write_answer(Callout::Failed("timeout".into()));
    let step = f.on_write_answer(Callout::Failed("timeout".into()));
    assert_eq!(
        counts(&step),
        vec![Metric::StateApiErrors, Metric::CompleteGaveUp]
    );
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::Handoff(_))));
    assert_eq!(
        step.effects[step.effects.len() - 2..],
        [Effect::Unregister(42), Effect::ResumeResponse]
    );
    // The stream ending during a complete: the heartbeat stops, nothing is handed over.
    let (mut f, _) = claim_in(Flow::new(cfg), "/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true);
    let step = f.on_stream_done();
    assert!(step.effects.contains(&Effect::Unregister(42)));
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::Handoff(_))));
}

#[test]
fn a_refused_complete_is_not_retried() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true);
    let step = f.on_write_answer(Callout::Answer {
        status: 413,
        body: b"{}".to_vec(),
    });
    assert_eq!(
        counts(&step),
        vec![Metric::StateApiErrors, Metric::CompleteGaveUp]
    );
    assert!(!step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::Handoff(_) | Effect::DispatchComplete(_))));
    assert_eq!(step.effects.last(), Some(&Effect::ResumeResponse));
}

#[test]
fn failed_release_is_retried_once_then_given_up() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "503")]), "no_healthy_upstream", 0x2, true);
    let step = f.on_write_answer(Callout::Failed("reset".into()));
    assert!(step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::DispatchRelease(_))));
    let step = f.on_write_answer(Callout::Failed("reset".into()));
    assert_eq!(counts(&step), vec![Metric::StateApiErrors]);
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::Handoff(_))));
    assert_eq!(
        step.effects[step.effects.len() - 2..],
        [Effect::Unregister(42), Effect::ResumeResponse]
    );
}

#[test]
fn stream_ending_while_completing_hands_the_complete_to_the_worker() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    let step = f.on_response_headers(&h(&[(":status", "201")]), "via_upstream", 0, true);
    let payload = complete_payload(&step);
    let step = f.on_stream_done();
    let p = handoff_of(&step);
    assert_eq!(p.claim.token, 42);
    assert_eq!(
        serde_json::from_slice::<CompleteRequest>(&p.payload).unwrap(),
        payload
    );
    assert!(!step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::Unregister(_))));
    // Before the response was complete there is nothing to store: the heartbeat stops.
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "201")]), "via_upstream", 0, false);
    let step = f.on_stream_done();
    assert!(step.effects.contains(&Effect::Unregister(42)));
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::Handoff(_))));
}

#[test]
fn fenced_out_write_is_counted_and_the_response_goes_on() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true);
    let step = f.on_write_answer(Callout::Answer {
        status: 409,
        body: b"{\"type\":\"/problems/fenced-out\"}".to_vec(),
    });
    assert_eq!(counts(&step), vec![Metric::FencedOut]);
    assert_eq!(step.effects.last(), Some(&Effect::ResumeResponse));
}

#[test]
fn client_gone_stops_the_heartbeat_and_leaves_the_lease() {
    let (mut f, _) = claimed_flow("/checkout", b"{}");
    let step = f.on_stream_done();
    assert!(step.effects.contains(&Effect::Unregister(42)));
    assert!(!step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::DispatchRelease(_) | Effect::DispatchComplete(_))));
    assert_eq!(f.state_name(), "finished");
    // Late answers are ignored.
    assert_eq!(f.on_write_answer(written()).effects.len(), 1);
}

#[test]
fn heartbeat_payload_shape() {
    // The registry builds heartbeat requests from what the flow registers.
    let mut reg = crate::heartbeat::Registry::default();
    reg.register(
        5,
        InFlight {
            key: "k".into(),
            subject: "s".into(),
            endpoint: "POST /checkout".into(),
            token: 5,
        },
        0,
    );
    let due = reg.due(10_000, 10_000, 2_500, 30_000);
    assert_eq!(
        due,
        vec![HeartbeatRequest {
            key: "k".into(),
            subject: "s".into(),
            endpoint: "POST /checkout".into(),
            token: 5,
            lease_ms: Some(30_000)
        }]
    );
}

// ---------------------------------------------------------------------------------------------
// The worker's replay cache

struct Worker {
    cfg: Rc<Config>,
    cache: Rc<RefCell<ReplayCache>>,
    now: Rc<std::cell::Cell<u64>>,
}

impl Worker {
    fn new(config: &str) -> Self {
        let cfg = Rc::new(Config::parse(config.as_bytes()).unwrap());
        let cache = ReplayCache::new(cfg.replay_cache_bytes, cfg.replay_cache_ttl_ms);
        Self {
            cfg,
            cache: Rc::new(RefCell::new(cache)),
            now: Rc::new(std::cell::Cell::new(1_000_000)),
        }
    }

    fn flow(&self) -> Flow {
        let now = Rc::clone(&self.now);
        Flow::with_cache(
            Rc::clone(&self.cfg),
            Rc::clone(&self.cache),
            Rc::new(move || now.get()),
        )
    }

    fn advance(&self, ms: u64) {
        self.now.set(self.now.get() + ms);
    }

    /// A request through headers and body: the step that ends the body.
    fn send(&self, f: &mut Flow, path: &str, who: &str, body: &[u8]) -> Step {
        let hs = h(&[
            (":method", "POST"),
            (":path", path),
            ("x-jwt-sub", who),
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
        ]);
        assert_eq!(
            f.on_request_headers(head(&hs), false).verdict,
            Verdict::Pause
        );
        f.on_request_body(body.len(), true, |n| Some(body[..n].to_vec()))
    }
}

fn claims(step: &Step) -> bool {
    step.effects
        .iter()
        .any(|e| matches!(e, Effect::DispatchClaim(_)))
}

fn stored_201() -> StoredResponse {
    StoredResponse::new(
        201,
        h(&[
            ("content-type", "application/json"),
            ("location", "/c/1"),
            ("x-charge-id", "ch_1"),
        ]),
        b"{\"id\":1}",
        true,
    )
}

#[test]
fn a_completed_claim_fills_the_cache_and_replays_need_no_callout() {
    let w = Worker::new(CONFIG);
    let body = br#"{"amount":1}"#;
    let mut f = w.flow();
    let step = w.send(&mut f, "/checkout", "user-1", body);
    assert!(claims(&step), "nothing cached yet: {step:?}");
    w.advance(5);
    let step = f.on_claim_answer(answer(&ClaimResponse::Completed {
        response: stored_201(),
        expires_in_ms: Some(86_400_000),
    }));
    assert_eq!(counts(&step), vec![Metric::Replayed]);
    let from_api = reply_of(&step).clone();
    assert_eq!(w.cache.borrow().len(), 1);

    // The same request again: the same answer, from memory, at the end of the body.
    let mut f = w.flow();
    let step = w.send(&mut f, "/checkout", "user-1", br#"{ "amount" : 1.0 }"#);
    assert!(!claims(&step));
    assert_eq!(reply_of(&step), &from_api);
    assert_eq!(
        counts(&step),
        vec![Metric::Replayed, Metric::ReplayCacheHits]
    );
    assert!(f.replied());
    assert_eq!(
        f.on_response_headers(&h(&[(":status", "201")]), "", 0, false),
        Step::cont(),
        "our own replay is never captured"
    );

    // Another body under the same key: 422, still without a callout.
    let mut f = w.flow();
    let step = w.send(&mut f, "/checkout", "user-1", br#"{"amount":2}"#);
    assert!(!claims(&step));
    let r = reply_of(&step);
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (422, "/problems/idempotency-key-reused")
    );
    assert_eq!(
        counts(&step),
        vec![Metric::Mismatch422, Metric::ReplayCacheHits]
    );

    // Another subject or another endpoint is another record: claimed at the state API.
    let mut f = w.flow();
    assert!(claims(&w.send(&mut f, "/checkout", "user-2", body)));
    let mut f = w.flow();
    assert!(claims(&w.send(&mut f, "/refunds", "user-1", body)));

    // The TTL (60 s by default) bounds a long retention: after it, the state API is asked.
    w.advance(59_990);
    let mut f = w.flow();
    assert!(!claims(&w.send(&mut f, "/checkout", "user-1", body)));
    w.advance(10);
    let mut f = w.flow();
    assert!(claims(&w.send(&mut f, "/checkout", "user-1", body)));
    assert!(w.cache.borrow().is_empty(), "the expired entry was dropped");
}

#[test]
fn the_cache_never_outlives_the_record() {
    let w = Worker::new(CONFIG);
    let mut f = w.flow();
    w.send(&mut f, "/checkout", "user-1", b"{}");
    let claimed_at = w.now.get();
    // The answer takes 300 ms; the expiry counts from when the claim was sent.
    w.advance(300);
    f.on_claim_answer(answer(&ClaimResponse::Completed {
        response: stored_201(),
        expires_in_ms: Some(2_000),
    }));
    w.now.set(claimed_at + 1_999);
    let mut f = w.flow();
    assert!(!claims(&w.send(&mut f, "/checkout", "user-1", b"{}")));
    w.now.set(claimed_at + 2_000);
    let mut f = w.flow();
    assert!(claims(&w.send(&mut f, "/checkout", "user-1", b"{}")));
}

#[test]
fn without_an_expiry_nothing_is_cached() {
    // An older state API: replays work, each one asks the state API.
    let w = Worker::new(CONFIG);
    for _ in 0..2 {
        let mut f = w.flow();
        assert!(claims(&w.send(&mut f, "/checkout", "user-1", b"{}")));
        let step = f.on_claim_answer(answer(&ClaimResponse::Completed {
            response: stored_201(),
            expires_in_ms: None,
        }));
        assert_eq!(counts(&step), vec![Metric::Replayed]);
    }
    assert!(w.cache.borrow().is_empty());
    // Turned off in the configuration: the same.
    let off = CONFIG.replace(
        r#""max_request_body_bytes": 100,"#,
        r#""max_request_body_bytes": 100, "replay_cache_bytes": 0,"#,
    );
    let w = Worker::new(&off);
    for _ in 0..2 {
        let mut f = w.flow();
        assert!(claims(&w.send(&mut f, "/checkout", "user-1", b"{}")));
        f.on_claim_answer(answer(&ClaimResponse::Completed {
            response: stored_201(),
            expires_in_ms: Some(86_400_000),
        }));
    }
    assert!(w.cache.borrow().is_empty());
}

#[test]
fn an_own_complete_fills_the_cache_with_what_a_state_api_replay_would_give() {
    let w = Worker::new(CONFIG);
    let (mut f, _) = claim_in(w.flow(), "/checkout", b"{}");
    let upstream = h(&[
        (":status", "201"),
        ("content-type", "application/json"),
        ("location", "/c/1"),
        ("set-cookie", "s=1"),
        ("x-charge-id", "ch_1"),
    ]);
    f.on_response_headers(&upstream, "via_upstream", 0, false);
    let step = f.on_response_body(8, true, |_| Some(b"{\"id\":1}".to_vec()));
    let stored = complete_payload(&step).response;
    assert!(
        w.cache.borrow().is_empty(),
        "not before the state API stored it"
    );
    let step = f.on_write_answer(answer(&WriteResponse::completed(30_000)));
    assert_eq!(counts(&step), vec![Metric::Completed]);
    assert_eq!(w.cache.borrow().len(), 1);

    // The retry of the same request (same key, subject, endpoint and body)...
    let mut f = w.flow();
    let hs = req_headers(
        "/checkout",
        &[
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
        ],
    );
    f.on_request_headers(head(&hs), false);
    let cached = f.on_request_body(2, true, |_| Some(b"{}".to_vec()));
    assert!(!claims(&cached));
    assert_eq!(
        counts(&cached),
        vec![Metric::Replayed, Metric::ReplayCacheHits]
    );
    // ...gets exactly what a replay through the state API gives.
    let mut g = flow();
    g.on_request_headers(head(&hs), false);
    g.on_request_body(2, true, |_| Some(b"{}".to_vec()));
    let via_api = g.on_claim_answer(answer(&ClaimResponse::Completed {
        response: stored,
        expires_in_ms: Some(30_000),
    }));
    assert_eq!(reply_of(&cached), reply_of(&via_api));
    assert_eq!(header(reply_of(&cached), "set-cookie"), None);

    // The record's expiry (30 s) is shorter than the TTL: it is the bound.
    w.advance(30_000);
    let mut f = w.flow();
    assert!(claims(&w.send(&mut f, "/checkout", "user-1", b"{}")));
}

#[test]
fn not_replayable_outcomes_are_cached_as_409() {
    let w = Worker::new(CONFIG);
    let (mut f, _) = claim_in(w.flow(), "/checkout", b"{}");
    f.on_response_headers(
        &h(&[(":status", "201"), ("location", "/c/9")]),
        "via_upstream",
        0,
        false,
    );
    let step = f.on_response_body(16, false, |_| panic!("over the limit"));
    assert!(!complete_payload(&step).response.replayable);
    f.on_write_answer(answer(&WriteResponse::completed(86_400_000)));
    let mut f = w.flow();
    let hs = req_headers(
        "/checkout",
        &[
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
        ],
    );
    f.on_request_headers(head(&hs), false);
    let step = f.on_request_body(2, true, |_| Some(b"{}".to_vec()));
    assert!(!claims(&step));
    let r = reply_of(&step);
    assert_eq!(
        (r.status, problem_type(r).as_str()),
        (409, "/problems/outcome-not-replayable")
    );
    assert_eq!(header(r, "location"), Some("/c/9"));
    assert_eq!(
        counts(&step),
        vec![Metric::NotReplayable, Metric::ReplayCacheHits]
    );
}

#[test]
fn a_complete_answer_without_expiry_or_a_failed_one_caches_nothing() {
    let w = Worker::new(CONFIG);
    let (mut f, _) = claim_in(w.flow(), "/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true);
    f.on_write_answer(written_without_expiry());
    assert!(w.cache.borrow().is_empty());
    let (mut f, _) = claim_in(w.flow(), "/checkout", b"{}");
    f.on_response_headers(&h(&[(":status", "200")]), "via_upstream", 0, true);
    f.on_write_answer(Callout::Failed("reset".into()));
    f.on_write_answer(Callout::Failed("reset".into()));
    assert!(
        w.cache.borrow().is_empty(),
        "a handed-over complete is not cached"
    );
}

fn written_without_expiry() -> Callout {
    Callout::Answer {
        status: 200,
        body: br#"{"state":"completed"}"#.to_vec(),
    }
}

#[test]
fn a_handed_over_complete_answers_retries_on_this_worker_while_it_waits() {
    let w = Worker::new(CONFIG);
    let (mut f, _) = claim_in(w.flow(), "/checkout", b"{}");
    f.on_response_headers(
        &h(&[(":status", "201"), ("location", "/c/1")]),
        "via_upstream",
        0,
        false,
    );
    f.on_response_body(2, true, |_| Some(b"ok".to_vec()));
    f.on_write_answer(Callout::Failed("reset".into()));
    let step = f.on_write_answer(Callout::Failed("reset".into()));
    let p = handoff_of(&step).clone();
    assert!(p.fill.is_some(), "the response goes with the complete");
    // What the glue does with it.
    let mut registry = crate::heartbeat::Registry::default();
    let mut retries = retry::Retries::new(1 << 20, 600_000);
    retry::hand_over(
        &mut registry,
        &mut retries,
        &mut w.cache.borrow_mut(),
        p,
        w.now.get(),
    )
    .unwrap();
    // The state API is still down: a retry of the request is answered from memory, a changed
    // one gets 422; either would otherwise be a claim that fails (503).
    w.advance(3_600_000);
    let mut f = w.flow();
    let step = w.send(&mut f, "/checkout", "user-1", b"{}");
    assert!(!claims(&step));
    let r = reply_of(&step);
    assert_eq!((r.status, r.body.as_slice()), (201, b"ok".as_slice()));
    assert_eq!(header(r, "idempotent-replayed"), Some("true"));
    let mut f = w.flow();
    assert_eq!(
        reply_of(&w.send(&mut f, "/checkout", "user-1", b"[]")).status,
        422
    );
}

// ---------------------------------------------------------------------------------------------
// In-progress keys answered from memory

#[test]
fn a_reported_in_progress_key_is_answered_409_from_memory_for_a_short_time() {
    let w = Worker::new(CONFIG);
    let body = br#"{"amount":1}"#;
    let mut f = w.flow();
    assert!(claims(&w.send(&mut f, "/checkout", "user-1", body)));
    let step = f.on_claim_answer(answer(&ClaimResponse::InProgress {
        retry_after_s: 2,
        lease_remaining_ms: 29_000,
    }));
    let from_api = reply_of(&step).clone();
    assert_eq!(counts(&step), vec![Metric::InProgress409]);

    // The same request (member order and whitespace aside) again: the same 409 without a
    // callout, until in_flight_cache_ms (500 by default) has passed since the claim was sent.
    w.advance(499);
    let mut f = w.flow();
    let step = w.send(&mut f, "/checkout", "user-1", br#"{ "amount" : 1 }"#);
    assert!(!claims(&step), "{step:?}");
    assert_eq!(reply_of(&step), &from_api);
    assert_eq!(header(reply_of(&step), "retry-after"), Some("2"));
    assert_eq!(
        counts(&step),
        vec![Metric::InProgress409, Metric::InFlightCacheHits]
    );
    assert!(f.replied());

    // Another body asks the state API (the key may have been released and claimed again with
    // it, so a 422 from memory could be wrong); so does another subject.
    let mut f = w.flow();
    assert!(claims(&w.send(
        &mut f,
        "/checkout",
        "user-1",
        br#"{"amount":2}"#
    )));
    let mut f = w.flow();
    assert!(claims(&w.send(&mut f, "/checkout", "user-2", body)));

    // After in_flight_cache_ms: the state API again.
    w.advance(1);
    let mut f = w.flow();
    assert!(claims(&w.send(&mut f, "/checkout", "user-1", body)));
}

#[test]
fn a_409_from_memory_never_outlives_the_reported_lease() {
    let w = Worker::new(CONFIG);
    let body = br#"{"amount":1}"#;
    let mut f = w.flow();
    w.send(&mut f, "/checkout", "user-1", body);
    // The owner's lease runs out in 40 ms: after that the key must be reclaimable at once.
    f.on_claim_answer(answer(&ClaimResponse::InProgress {
        retry_after_s: 1,
        lease_remaining_ms: 40,
    }));
    w.advance(39);
    let mut f = w.flow();
    assert!(!claims(&w.send(&mut f, "/checkout", "user-1", body)));
    w.advance(1);
    let mut f = w.flow();
    let step = w.send(&mut f, "/checkout", "user-1", body);
    assert!(claims(&step), "the lease has run out: {step:?}");
    // This worker reclaims it: what it remembered is gone, and its own request's completion
    // replaces it with the stored response.
    let step = f.on_claim_answer(answer(&ClaimResponse::Claimed {
        token: 9,
        lease_ms: 30_000,
        reclaimed: true,
    }));
    assert!(step.effects.contains(&Effect::ResumeRequest));
    assert_eq!(w.cache.borrow_mut().running_len(), 0);
}

#[test]
fn a_key_completed_or_released_here_is_no_longer_answered_409_from_memory() {
    for release in [false, true] {
        let w = Worker::new(CONFIG);
        let body = br#"{"amount":1}"#;
        // The first request claims the key on this worker...
        let mut owner = w.flow();
        w.send(&mut owner, "/checkout", "user-1", body);
        owner.on_claim_answer(answer(&ClaimResponse::Claimed {
            token: 7,
            lease_ms: 30_000,
            reclaimed: false,
        }));
        // ... a retry meanwhile is told "in progress" by the state API ...
        let mut dup = w.flow();
        w.send(&mut dup, "/checkout", "user-1", body);
        dup.on_claim_answer(answer(&ClaimResponse::InProgress {
            retry_after_s: 2,
            lease_remaining_ms: 30_000,
        }));
        assert_eq!(w.cache.borrow_mut().running_len(), 1);
        // ... and then the first one is stored (or its key given back).
        let step = if release {
            owner.on_response_headers(&h(&[(":status", "503")]), "no_healthy_upstream", 0x2, true)
        } else {
            owner.on_response_headers(&h(&[(":status", "201")]), "via_upstream", 0, true)
        };
        assert!(
            step.effects
                .iter()
                .any(|e| matches!(e, Effect::DispatchComplete(_) | Effect::DispatchRelease(_))),
            "{step:?}"
        );
        owner.on_write_answer(if release {
            answer(&WriteResponse::released())
        } else {
            written()
        });
        assert_eq!(w.cache.borrow_mut().running_len(), 0, "release: {release}");
        let mut f = w.flow();
        let step = w.send(&mut f, "/checkout", "user-1", body);
        if release {
            assert!(claims(&step), "a released key is claimed anew: {step:?}");
        } else {
            assert!(!claims(&step));
            assert_eq!(
                counts(&step),
                vec![Metric::Replayed, Metric::ReplayCacheHits]
            );
        }
    }
}

#[test]
fn without_the_replay_cache_or_with_in_flight_cache_ms_0_every_duplicate_asks() {
    for patch in [r#""replay_cache_bytes": 0,"#, r#""in_flight_cache_ms": 0,"#] {
        let config = CONFIG.replacen(
            "\"max_request_body_bytes\"",
            &format!("{patch} \"max_request_body_bytes\""),
            1,
        );
        let w = Worker::new(&config);
        let body = br#"{"amount":1}"#;
        let mut f = w.flow();
        w.send(&mut f, "/checkout", "user-1", body);
        f.on_claim_answer(answer(&ClaimResponse::InProgress {
            retry_after_s: 2,
            lease_remaining_ms: 30_000,
        }));
        let mut f = w.flow();
        assert!(
            claims(&w.send(&mut f, "/checkout", "user-1", body)),
            "{patch}"
        );
    }
}
