//! What users ask of the layer: waiting for a running key (`Prefer: wait`), choosing what the
//! fingerprint covers, the key from the body, retention per route, a namespace.

use super::*;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// The configuration with these routes instead of the default ones.
fn routes(routes: &str) -> String {
    let start = CONFIG.find("\"routes\"").unwrap();
    let end = CONFIG.find("\"max_request_body_bytes\"").unwrap();
    format!(
        "{}\"routes\": [{routes}],\n  {}",
        &CONFIG[..start],
        &CONFIG[end..]
    )
}

impl Harness {
    /// A request with key `k1` of `user-1` to `/checkout` with these extra headers, through
    /// its body.
    fn send_with(&mut self, s: StreamId, extra: &[(&str, &str)], body: &[u8]) -> Seen {
        let mut pairs = vec![
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
        ];
        pairs.extend_from_slice(extra);
        let hs = req_headers("/checkout", &pairs);
        assert_eq!(self.headers(s, &hs, false).verdict, Verdict::Pause);
        self.body(s, body)
    }

    /// A retry that asks to wait up to `wait` seconds.
    pub(super) fn waiting(&mut self, wait: &str, body: &[u8]) -> (StreamId, Seen) {
        let s = self.stream();
        let step = self.send_with(s, &[("prefer", wait)], body);
        (s, step)
    }
}

fn in_progress(waited_ms: Option<u64>) -> CalloutResult {
    answer(&ClaimResponse::InProgress {
        retry_after_s: 2,
        lease_remaining_ms: 20_000,
        waited_ms,
    })
}

fn replies_on(step: &Seen, stream: StreamId) -> Vec<&LocalReply> {
    step.effects
        .iter()
        .filter_map(|e| match e {
            Effect::Reply { stream: s, reply } if *s == stream => Some(reply),
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Prefer: wait

#[test]
fn prefer_wait_is_read_as_rfc_7240_says() {
    use crate::flow::request::prefer_wait;
    assert_eq!(prefer_wait(&["wait=5"]), Some(5));
    assert_eq!(prefer_wait(&["respond-async, WAIT = 7 ; x=1"]), Some(7));
    assert_eq!(prefer_wait(&["handling=lenient", "wait=\"3\""]), Some(3));
    assert_eq!(prefer_wait(&["wait=0"]), Some(0));
    for ignored in [
        &["wait=-1"][..],
        &["wait="],
        &["wait=1.5"],
        &["wait=9999999"],
        &["waiting=5"],
        &["return=minimal"],
        &[],
    ] {
        assert_eq!(prefer_wait(ignored), None, "{ignored:?}");
    }
}

#[test]
fn a_retry_that_prefers_to_wait_asks_the_state_api_to_wait_within_the_route_bound() {
    let cfg = routes(
        r#"{"method": "POST", "path": "/checkout", "key": "required", "max_wait_s": 4},
           {"method": "POST", "path": "/refunds", "key": "required", "max_wait_s": 0}"#,
    );
    let mut t = Harness::new(&cfg);
    for (prefer, wait_ms) in [
        (Some("wait=3"), Some(3_000)),
        (Some("wait=30"), Some(4_000)),
        (Some("wait=0"), None),
        (None, None),
    ] {
        let s = t.stream();
        let extra: Vec<(&str, &str)> = prefer.map(|p| ("prefer", p)).into_iter().collect();
        let step = t.send_with(s, &extra, b"{}");
        assert_eq!(step.claim().wait_ms, wait_ms, "{prefer:?}");
        // The callout has the state API's time and the wait.
        assert_eq!(
            step.dispatch(CLAIM_PATH).timeout_ms,
            1_000 + wait_ms.unwrap_or(0),
            "{prefer:?}"
        );
    }
    // A route with max_wait_s 0 never waits.
    let s = t.stream();
    let hs = req_headers(
        "/refunds",
        &[("idempotency-key", "k1"), ("prefer", "wait=5")],
    );
    let step = t.headers(s, &hs, true);
    assert_eq!(step.claim().wait_ms, None);
}

/// Claims that wait go to the state API's cluster for them (HTTP/2 in `edge run`'s Envoy);
/// every other call, and every call when none is configured, to `cluster`.
#[test]
fn only_claims_that_wait_go_to_the_wait_cluster() {
    let with = CONFIG.replace(
        r#""cluster": "state_api","#,
        r#""cluster": "state_api", "wait_cluster": "state_api_wait","#,
    );
    assert_ne!(with, CONFIG);
    for (cfg, waiting_cluster) in [(with.as_str(), "state_api_wait"), (CONFIG, "state_api")] {
        let mut t = Harness::new(cfg);
        let (_, step) = t.waiting("wait=3", b"{}");
        assert!(step.claim().wait_ms.is_some());
        assert_eq!(step.dispatch(CLAIM_PATH).cluster, waiting_cluster);
        let s = t.stream();
        let step = t.send_with(s, &[], b"{}");
        assert_eq!(step.claim().wait_ms, None);
        assert_eq!(step.dispatch(CLAIM_PATH).cluster, "state_api");
    }
}

#[test]
fn the_answers_after_a_wait_say_the_preference_was_applied() {
    let mut t = Harness::new(CONFIG);
    // The first request completed while the retry waited: its replay.
    let (_, step) = t.waiting("wait=5", b"{}");
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::Completed {
            response: stored_201(),
            expires_in_ms: Some(60_000),
            waited_ms: Some(1_200),
        }),
    );
    let r = step.reply();
    assert_eq!(r.status, 201);
    assert_eq!(header(r, "idempotent-replayed"), Some("true"));
    assert_eq!(header(r, "preference-applied"), Some("wait=5"));
    assert_eq!(step.counts(), vec![Metric::Replayed, Metric::WaitReplayed]);

    // Still running at the deadline: 409 as without waiting, saying it waited.
    let mut t = Harness::new(CONFIG);
    let (_, step) = t.waiting("wait=5", b"{}");
    let step = t.answer_claim(&step, in_progress(Some(5_000)));
    let r = step.reply();
    assert_eq!((r.status, header(r, "retry-after")), (409, Some("2")));
    assert_eq!(header(r, "preference-applied"), Some("wait=5"));
    assert_eq!(
        step.counts(),
        vec![Metric::InProgress409, Metric::WaitTimedOut]
    );

    // The state API's waiters were at their bound: 409 at once, not saying it waited.
    let mut t = Harness::new(CONFIG);
    let (_, step) = t.waiting("wait=5", b"{}");
    let step = t.answer_claim(&step, in_progress(None));
    let r = step.reply();
    assert_eq!(r.status, 409);
    assert_eq!(header(r, "preference-applied"), None);
    assert_eq!(
        step.counts(),
        vec![Metric::InProgress409, Metric::WaitRefused]
    );

    // A replay found at once (nothing to wait for) is an ordinary replay.
    let mut t = Harness::new(CONFIG);
    let (_, step) = t.waiting("wait=5", b"{}");
    let step = t.answer_claim(
        &step,
        answer(&ClaimResponse::Completed {
            response: stored_201(),
            expires_in_ms: Some(60_000),
            waited_ms: None,
        }),
    );
    assert_eq!(header(step.reply(), "preference-applied"), None);
    assert_eq!(step.counts(), vec![Metric::Replayed]);
}

#[test]
fn a_retry_that_waits_is_not_answered_409_from_memory() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let step = t.send(s, "/checkout", "user-1", b"{}");
    t.answer_claim(&step, in_progress(None));
    // Without Prefer: 409 from memory.
    let s = t.stream();
    assert!(!t.send(s, "/checkout", "user-1", b"{}").claims());
    // With it: the state API is asked to wait.
    let (_, step) = t.waiting("wait=2", b"{}");
    assert_eq!(step.claim().wait_ms, Some(2_000));
}

#[test]
fn waiters_over_the_worker_bound_are_answered_at_once_and_counted() {
    let mut t = Harness::new(&with(r#""max_waiters": 1,"#));
    let (_, first) = t.waiting("wait=5", b"{}");
    assert_eq!(first.claim().wait_ms, Some(5_000));
    assert_eq!(t.w.usage().waiters, 1);

    let (_, second) = t.waiting("wait=5", b"{}");
    assert_eq!(
        second.claim().wait_ms,
        None,
        "over the bound: no wait asked"
    );
    assert_eq!(second.dispatch(CLAIM_PATH).timeout_ms, 1_000);
    assert_eq!(second.counts(), vec![Metric::WaitRefused]);
    // Its 409 is an ordinary one, counted once.
    let step = t.answer_claim(&second, in_progress(None));
    assert_eq!(header(step.reply(), "preference-applied"), None);
    assert_eq!(step.counts(), vec![Metric::InProgress409]);

    // The first one's answer frees its place.
    t.answer_claim(&first, in_progress(Some(5_000)));
    assert_eq!(t.w.usage().waiters, 0);
    let (s, third) = t.waiting("wait=5", b"{}");
    assert_eq!(third.claim().wait_ms, Some(5_000));
    // So does its stream's end.
    t.done(s);
    assert_eq!(t.w.usage().waiters, 0);

    // max_waiters 0: nobody waits on this worker.
    let mut t = Harness::new(&with(r#""max_waiters": 0,"#));
    let (_, step) = t.waiting("wait=5", b"{}");
    assert_eq!(step.claim().wait_ms, None);
}

#[test]
fn a_waiter_is_answered_when_this_worker_sees_the_key_complete() {
    for background in [false, true] {
        let cfg = if background {
            with(r#""complete_in_background": true,"#)
        } else {
            CONFIG.to_owned()
        };
        let mut t = Harness::new(&cfg);
        let body = br#"{"amount":1}"#;
        let (first, _) = t.claimed("/checkout", body, 7);
        let (same, same_step) = t.waiting("wait=10", body);
        let (other, other_step) = t.waiting("wait=10", br#"{"amount":2}"#);
        assert_eq!(t.w.usage().waiters, 2);

        let step = t.response_headers(
            first,
            &h(&[(":status", "201"), ("x-charge-id", "ch_7")]),
            "via_upstream",
            0,
            true,
        );
        let step = if background {
            // The complete is handed over: the worker answers retries with it at once.
            step
        } else {
            let d = step.dispatch(COMPLETE_PATH).clone();
            t.answer(&d, written())
        };
        let replay = replies_on(&step, same);
        assert_eq!(replay.len(), 1, "background {background}: {step:?}");
        assert_eq!(replay[0].status, 201);
        assert_eq!(header(replay[0], "x-charge-id"), Some("ch_7"));
        assert_eq!(header(replay[0], "idempotent-replayed"), Some("true"));
        assert_eq!(header(replay[0], "preference-applied"), Some("wait=10"));
        // The one with another body learns its key was used for another request.
        let mismatch = replies_on(&step, other);
        assert_eq!(mismatch.len(), 1);
        assert_eq!(mismatch[0].status, 422);
        assert!(step.counts().contains(&Metric::WaitReplayed));
        assert_eq!(t.w.usage().waiters, 0);

        // Their claims' answers, when they come, are dropped.
        let late = t.answer_claim(
            &same_step,
            answer(&ClaimResponse::Completed {
                response: stored_201(),
                expires_in_ms: Some(60_000),
                waited_ms: Some(10),
            }),
        );
        assert!(!late.replied(), "{late:?}");
        let late = t.answer_claim(&other_step, answer(&ClaimResponse::Mismatch));
        assert!(!late.replied());
    }
}

#[test]
fn a_waiter_on_a_key_released_here_is_left_to_the_state_api() {
    let mut t = Harness::new(CONFIG);
    let (first, _) = t.claimed("/refunds", b"{}", 3);
    let s = t.stream();
    let hs = req_headers(
        "/refunds",
        &[
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
            ("prefer", "wait=5"),
        ],
    );
    t.headers(s, &hs, false);
    let waiting = t.body(s, b"{}");
    // A 503 on a release route gives the key back: the waiter may run it, as the state API
    // will tell it.
    let step = t.ok_response(first, "503", true);
    let d = step.dispatch(RELEASE_PATH).clone();
    let step = t.answer(&d, answer(&WriteResponse::released()));
    assert!(replies_on(&step, s).is_empty());
    assert_eq!(t.w.usage().waiters, 1);
    let step = t.answer_claim(&waiting, claimed(4));
    assert!(step.resumes_request());
}

// ---------------------------------------------------------------------------------------------
// What the fingerprint covers, and the key from the body

#[test]
fn an_ignore_list_leaves_members_out_of_the_fingerprint_and_names_itself() {
    let cfg = routes(
        r#"{"method": "POST", "path": "/checkout", "key": "required",
            "fingerprint": {"ignore": ["/meta/sent_at", "/items/0/trace"]}}"#,
    );
    let mut t = Harness::new(&cfg);
    let fp = |t: &mut Harness, body: &str| {
        let s = t.stream();
        let c = t.send(s, "/checkout", "user-1", body.as_bytes()).claim();
        (c.fingerprint, c.fingerprint_alg)
    };
    let a = fp(
        &mut t,
        r#"{"amount":1,"meta":{"sent_at":1,"v":2},"items":[{"trace":"x","sku":"a"}]}"#,
    );
    let b = fp(
        &mut t,
        r#"{"amount":1,"meta":{"sent_at":9,"v":2},"items":[{"trace":"y","sku":"a"}]}"#,
    );
    let c = fp(
        &mut t,
        r#"{"amount":1,"meta":{"v":2},"items":[{"sku":"a"}]}"#,
    );
    assert_eq!(a, b);
    assert_eq!(a, c, "an ignored member that is absent is the same request");
    assert!(a.1.starts_with("sha256-jcs-v2;ignore="), "{}", a.1);
    // A member not in the list still counts, nested ones too.
    assert_ne!(
        a,
        fp(
            &mut t,
            r#"{"amount":1,"meta":{"sent_at":1,"v":3},"items":[{"trace":"x","sku":"a"}]}"#
        )
    );
    assert_ne!(
        a,
        fp(
            &mut t,
            r#"{"amount":1,"meta":{"sent_at":1,"v":2},"items":[{"trace":"x","sku":"b"}]}"#
        )
    );

    // Without a list: the whole body, under the plain algorithm name.
    let mut t = Harness::new(CONFIG);
    let whole = fp(&mut t, r#"{"amount":1,"meta":{"sent_at":1}}"#);
    assert_eq!(whole.1, "sha256-jcs-v2");
    assert_ne!(whole, fp(&mut t, r#"{"amount":1,"meta":{"sent_at":2}}"#));
}

#[test]
fn an_include_list_covers_only_its_members() {
    let cfg = routes(
        r#"{"method": "POST", "path": "/checkout", "key": "required",
            "fingerprint": {"include": ["/amount", "/card/last4", "/items/1"]}}"#,
    );
    let mut t = Harness::new(&cfg);
    let fp = |t: &mut Harness, body: &str| {
        let s = t.stream();
        t.send(s, "/checkout", "user-1", body.as_bytes()).claim()
    };
    let a = fp(
        &mut t,
        r#"{"amount":5,"card":{"last4":"4242","exp":"1"},"items":[1,2],"note":"a"}"#,
    );
    let b = fp(
        &mut t,
        r#"{"note":"b","items":[9,2],"card":{"exp":"2","last4":"4242"},"amount":5}"#,
    );
    assert_eq!(a.fingerprint, b.fingerprint);
    assert!(a.fingerprint_alg.starts_with("sha256-jcs-v2;include="));
    let c = fp(
        &mut t,
        r#"{"amount":5,"card":{"last4":"0000"},"items":[1,2]}"#,
    );
    assert_ne!(a.fingerprint, c.fingerprint);
    let d = fp(
        &mut t,
        r#"{"amount":5,"card":{"last4":"4242"},"items":[1,3]}"#,
    );
    assert_ne!(a.fingerprint, d.fingerprint);
    // A body that is not JSON is hashed whole, as without a list.
    let s = t.stream();
    let hs = req_headers(
        "/checkout",
        &[("idempotency-key", "k1"), ("content-type", "text/plain")],
    );
    t.headers(s, &hs, false);
    let plain = t.body(s, b"amount=5").claim();
    assert_eq!(plain.fingerprint_alg, "sha256-raw-v2");
}

#[test]
fn the_key_can_come_from_a_body_member() {
    let cfg = routes(
        r#"{"method": "POST", "path": "/checkout", "key": "required", "key_from": "/idempotency_key"},
           {"method": "POST", "path": "/refunds", "key": "optional", "key_from": "/request/id"}"#,
    );
    let mut t = Harness::new(&cfg);
    let post = |t: &mut Harness, path: &str, extra: &[(&str, &str)], body: &str| {
        let s = t.stream();
        let mut pairs = vec![("content-type", "application/json")];
        pairs.extend_from_slice(extra);
        let step = t.headers(s, &req_headers(path, &pairs), false);
        assert_eq!(step.verdict, Verdict::Pause, "the key is in the body");
        t.body(s, body.as_bytes())
    };
    let step = post(
        &mut t,
        "/checkout",
        &[],
        r#"{"idempotency_key":"order-7","amount":1}"#,
    );
    let claim = step.claim();
    assert_eq!(claim.key, "order-7");
    // The header is not the key on such a route.
    let step = post(
        &mut t,
        "/checkout",
        &[("idempotency-key", "other")],
        r#"{"idempotency_key":"order-7","amount":1}"#,
    );
    assert_eq!(step.claim().key, "order-7");
    // Forwarded with the key it was claimed under.
    let step = t.answer_claim(&step, claimed(5));
    assert!(step.effects.iter().any(|e| matches!(
        e,
        Effect::SetRequestHeader { name: "idempotency-key", value, .. } if value == "order-7"
    )));

    // Missing, not a string, or not a valid key: 400, never forwarded.
    for (body, kind) in [
        (r#"{"amount":1}"#, "/problems/missing-idempotency-key"),
        (
            r#"{"idempotency_key":7}"#,
            "/problems/missing-idempotency-key",
        ),
        ("not json", "/problems/missing-idempotency-key"),
        (
            r#"{"idempotency_key":""}"#,
            "/problems/invalid-idempotency-key",
        ),
    ] {
        let step = post(&mut t, "/checkout", &[], body);
        let r = step.reply();
        assert_eq!((r.status, problem_type(r).as_str()), (400, kind), "{body}");
        assert!(!step.claims());
    }
    let spaced = r#"{"idempotency_key":"order 7"}"#;
    assert_eq!(post(&mut t, "/checkout", &[], spaced).reply().status, 400);

    // On an optional route a body without the member is not protected: it goes on as it is.
    let step = post(&mut t, "/refunds", &[], r#"{"amount":1}"#);
    assert!(!step.claims() && !step.replied());
    assert!(step.resumes_request());
    assert_eq!(t.w.flow_state(t.next_stream), Some("passthrough"));
    let step = post(&mut t, "/refunds", &[], r#"{"request":{"id":"r-1"}}"#);
    assert_eq!(step.claim().key, "r-1");
}

/// Issue 34, path 10: a client's `idempotency-fencing-token` never reaches the upstream, on a
/// `key_from` route without the key in its body (or not JSON) as on every other path.
#[test]
fn a_forged_fencing_token_is_stripped_where_an_optional_body_key_is_missing() {
    let cfg = routes(
        r#"{"method": "POST", "path": "/refunds", "key": "optional", "key_from": "/request/id"}"#,
    );
    let mut t = Harness::new(&cfg);
    for body in [r#"{"amount":1}"#, "not json"] {
        let s = t.stream();
        let headers = req_headers(
            "/refunds",
            &[
                ("content-type", "application/json"),
                ("idempotency-fencing-token", "999999"),
            ],
        );
        let first = t.headers(s, &headers, false);
        let step = t.body(s, body.as_bytes());
        assert!(step.resumes_request(), "{body}");
        let stripped = first.effects.iter().chain(&step.effects).any(|e| {
            matches!(
                e,
                Effect::RemoveRequestHeader {
                    name: "idempotency-fencing-token",
                    ..
                }
            )
        });
        assert!(stripped, "the client's fencing token went upstream: {body}");
    }
}

// ---------------------------------------------------------------------------------------------
// Retention and namespace

#[test]
fn a_route_asks_for_its_retention() {
    let cfg = routes(
        r#"{"method": "POST", "path": "/checkout", "key": "required", "retention_s": 3600},
           {"method": "POST", "path": "/refunds", "key": "required"}"#,
    );
    let mut t = Harness::new(&cfg);
    let s = t.stream();
    assert_eq!(
        t.send(s, "/checkout", "user-1", b"{}").claim().retention_s,
        Some(3_600)
    );
    let s = t.stream();
    assert_eq!(
        t.send(s, "/refunds", "user-1", b"{}").claim().retention_s,
        None,
        "the state API's default"
    );
}

#[test]
fn the_namespace_is_in_every_call_about_a_record() {
    let mut t = Harness::new(&with(r#""namespace": "shop-eu","#));
    let (s, claim) = t.claimed("/checkout", b"{}", 11);
    assert_eq!(claim.namespace, "shop-eu");
    t.advance(10_000);
    let hb = t.tick();
    let hb: HeartbeatRequest = serde_json::from_slice(&hb.dispatch(HEARTBEAT_PATH).body).unwrap();
    assert_eq!(hb.namespace, "shop-eu");
    let step = t.ok_response(s, "201", true);
    assert_eq!(step.complete().namespace, "shop-eu");

    let (s, _) = t.claimed("/refunds", b"{}", 12);
    let step = t.ok_response(s, "503", true);
    let release: ReleaseRequest =
        serde_json::from_slice(&step.dispatch(RELEASE_PATH).body).unwrap();
    assert_eq!(release.namespace, "shop-eu");

    let (s, _) = t.claimed_key("k2", "/checkout", b"{}", 13);
    // The stream ends before the upstream answers: the worker marks the outcome unknown.
    assert!(t.done(s).effects.contains(&Effect::Wake));
    let woken: Seen = t.w.on_wake(t.now).into();
    let unknown: UnknownRequest =
        serde_json::from_slice(&woken.dispatch(UNKNOWN_PATH).body).unwrap();
    assert_eq!(unknown.namespace, "shop-eu");

    // Without one: empty, the scope of a single deployment.
    let mut t = Harness::new(CONFIG);
    let (_, claim) = t.claimed("/checkout", b"{}", 1);
    assert_eq!(claim.namespace, "");
}

#[test]
fn the_configuration_refuses_what_it_cannot_honour() {
    for (route, why) in [
        (r#""fingerprint": {"ignore": ["meta"]}"#, "JSON pointer"),
        (r#""fingerprint": {"ignore": ["/items/-"]}"#, "-"),
        (r#""fingerprint": {"ignore": []}"#, "exactly one"),
        (
            r#""fingerprint": {"ignore": ["/a"], "include": ["/b"]}"#,
            "exactly one",
        ),
        (r#""fingerprint": {"only": ["/a"]}"#, "only"),
        (r#""key_from": "idempotency_key""#, "key_from"),
        (r#""max_wait_s": 61"#, "max_wait_s"),
        (r#""retention_s": 0"#, "retention_s"),
    ] {
        let cfg = routes(&format!(
            r#"{{"method": "POST", "path": "/checkout", "key": "required", {route}}}"#
        ));
        let e = Config::parse(cfg.as_bytes()).unwrap_err();
        assert!(e.to_string().contains(why), "{route}: {e}");
    }
    for (top, why) in [
        (r#""namespace": "Shop EU","#, "namespace"),
        (r#""max_waiters": 100000,"#, "max_waiters"),
    ] {
        let e = Config::parse(with(top).as_bytes()).unwrap_err();
        assert!(e.to_string().contains(why), "{top}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Issue 46, finding 3 (Fix::RouterRetries): Envoy's router sends a claimed request once

/// A request forwarded under a claim goes with `x-envoy-max-retries: 0`, which Envoy's router
/// takes over any route's retry policy, and without the headers a caller could ask the router
/// to retry, hedge or cut a try short with; all before the request is let go. A request the
/// filter does not protect keeps what it came with.
#[test]
fn a_claimed_request_goes_upstream_unretriable_by_envoys_router() {
    let mut t = Harness::new(CONFIG);
    let s = t.stream();
    let asked: Vec<(&str, &str)> = vec![
        ("x-envoy-retry-on", "5xx,reset,retriable-status-codes"),
        ("x-envoy-retry-grpc-on", "unavailable"),
        ("x-envoy-max-retries", "5"),
        ("x-envoy-retriable-status-codes", "503"),
        ("x-envoy-retriable-header-names", "x-again"),
        ("x-envoy-hedge-on-per-try-timeout", "true"),
        ("x-envoy-upstream-rq-per-try-timeout-ms", "10"),
    ];
    let step = t.send_with(s, &asked, br#"{"amount":1}"#);
    let step = t.answer_claim(&step, claimed(5));
    let at = |wanted: &Effect| {
        step.effects
            .iter()
            .position(|e| e == wanted)
            .unwrap_or_else(|| panic!("no {wanted:?} in {step:?}"))
    };
    let resumed = at(&Effect::ResumeRequest { stream: s });
    for &name in crate::headers::ROUTER_RETRY_HEADERS {
        assert!(at(&Effect::RemoveRequestHeader { stream: s, name }) < resumed);
    }
    let set = at(&Effect::SetRequestHeader {
        stream: s,
        name: "x-envoy-max-retries",
        value: "0".into(),
    });
    assert!(set < resumed);
    // Every header the client asked with is either removed or replaced.
    for (name, _) in &asked {
        assert!(
            step.effects.iter().any(|e| matches!(
                e,
                Effect::RemoveRequestHeader { name: n, .. }
                | Effect::SetRequestHeader { name: n, .. } if n == name
            )),
            "{name} went upstream as the client sent it"
        );
    }

    // Not protected (no route): untouched, the route's and the client's business.
    let s = t.stream();
    let hs = req_headers("/other", &asked);
    let step = t.headers(s, &hs, true);
    assert_eq!(step.verdict, Verdict::Continue);
    assert!(
        !step.effects.iter().any(|e| matches!(
            e,
            Effect::RemoveRequestHeader { .. } | Effect::SetRequestHeader { .. }
        )),
        "{step:?}"
    );
}
