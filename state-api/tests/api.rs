//! The state API's HTTP surface against a real Postgres: claims, races, fencing, replay,
//! retention, auth and bad input.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use contract::wire::{
    ClaimRequest, ClaimResponse, OnUnknown, StoredResponse, CLAIM_PATH, COMPLETE_PATH,
    HEARTBEAT_PATH, RECORDS_PATH, RELEASE_PATH, UNKNOWN_PATH,
};
use serde_json::{json, Value};

/// The stored response of a `completed` answer, which carries the record's expiry.
fn replay_of(answer: ClaimResponse) -> StoredResponse {
    match answer {
        ClaimResponse::Completed {
            response,
            expires_in_ms: Some(_),
            ..
        } => response,
        other => panic!("a completed answer with its expiry, not {other:?}"),
    }
}

#[tokio::test]
async fn a_changed_fingerprint_is_a_mismatch_in_progress_and_completed() {
    let api = Api::start(&[]).await;
    let token = token_of(&api.claim("fp-key", &fp(1), None).await);
    assert_eq!(
        api.claim("fp-key", &fp(2), None).await,
        ClaimResponse::Mismatch
    );
    // Same fingerprint made by another algorithm: also a mismatch.
    let mut other_alg = claim_req("fp-key", "alice", &fp(1), None);
    other_alg.fingerprint_alg = "sha256-raw-v2".into();
    assert_eq!(api.claim_with(&other_alg).await, ClaimResponse::Mismatch);

    api.post(
        COMPLETE_PATH,
        &complete_body("fp-key", token, &ok_response()),
    )
    .await;
    assert_eq!(
        api.claim("fp-key", &fp(2), None).await,
        ClaimResponse::Mismatch
    );
    assert!(matches!(
        api.claim("fp-key", &fp(1), None).await,
        ClaimResponse::Completed { .. }
    ));

    // The same key for another subject is another record.
    let bob = api
        .claim_with(&claim_req("fp-key", "bob", &fp(2), None))
        .await;
    assert!(matches!(bob, ClaimResponse::Claimed { .. }), "{bob:?}");
    assert!(token_of(&bob) > token, "tokens grow across keys");
    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_claims_total{outcome=\"mismatch\"}"),
        3.0
    );
}

#[tokio::test]
async fn completed_claims_replay_the_stored_bytes_and_headers_exactly() {
    let api = Api::start(&[]).await;
    let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let headers = vec![
        (
            "content-type".to_owned(),
            "application/octet-stream".to_owned(),
        ),
        ("x-multi".to_owned(), "a".to_owned()),
        ("location".to_owned(), "/charges/ch_1".to_owned()),
        ("x-multi".to_owned(), "b, c".to_owned()),
        ("etag".to_owned(), "\"v1\"".to_owned()),
    ];
    let stored = StoredResponse::new(200, headers, &body, true);
    let token = token_of(&api.claim("bytes", &fp(3), None).await);
    let (status, _, _) = api
        .post(COMPLETE_PATH, &complete_body("bytes", token, &stored))
        .await;
    assert_eq!(status, 200);
    match api.claim("bytes", &fp(3), None).await {
        ClaimResponse::Completed { response, .. } => {
            assert_eq!(response, stored);
            assert_eq!(response.body, body);
        }
        other => panic!("{other:?}"),
    }

    // A retried complete of the same owner is accepted and changes nothing.
    let other = StoredResponse::new(500, vec![], b"late", true);
    let (status, body2, _) = api
        .post(COMPLETE_PATH, &complete_body("bytes", token, &other))
        .await;
    assert_eq!((status, &body2["state"]), (200, &json!("completed")));
    assert_eq!(replay_of(api.claim("bytes", &fp(3), None).await), stored);

    // Not replayable: status and headers kept, no body.
    let t = token_of(&api.claim("big", &fp(3), None).await);
    let tomb = StoredResponse::new(
        201,
        vec![("location".into(), "/charges/2".into())],
        &[],
        false,
    );
    assert_eq!(
        api.post(COMPLETE_PATH, &complete_body("big", t, &tomb))
            .await
            .0,
        200
    );
    assert_eq!(replay_of(api.claim("big", &fp(3), None).await), tomb);
    // An empty replayable body is not the same thing as a tombstone.
    let t = token_of(&api.claim("empty", &fp(3), None).await);
    let empty = StoredResponse::new(204, vec![], &[], true);
    assert_eq!(
        api.post(COMPLETE_PATH, &complete_body("empty", t, &empty))
            .await
            .0,
        200
    );
    assert_eq!(replay_of(api.claim("empty", &fp(3), None).await), empty);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reclaim_race_among_twenty_has_one_winner() {
    let api = Api::start(&[]).await;
    let first = token_of(&api.claim("reclaim", &fp(4), Some(1_000)).await);
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let mut tasks = Vec::new();
    for _ in 0..20 {
        tasks.push(api.spawn_claim(&ClaimRequest {
            on_unknown: OnUnknown::TakeOver,
            ..claim_req("reclaim", "alice", &fp(4), Some(30_000))
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        match t.await.unwrap().0 {
            ClaimResponse::Claimed {
                token,
                reclaimed,
                lease_ms,
                ..
            } => {
                assert!(reclaimed);
                assert_eq!(lease_ms, 30_000);
                winners.push(token);
            }
            ClaimResponse::InProgress { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "one reclaimer wins");
    assert!(winners[0] > first, "the new owner has a larger token");
    let (status, view) = api.record("reclaim", "alice").await;
    assert_eq!(status, 200);
    assert_eq!(view["token"], winners[0]);
    let m = api.metrics().await;
    assert_eq!(metric(&m, "state_api_reclaims_total"), 1.0);
}

#[tokio::test]
async fn a_lease_run_out_is_an_unknown_outcome_held_until_resolved() {
    let api = Api::start(&[]).await;
    let owner = token_of(&api.claim("held", &fp(6), Some(1_000)).await);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    // Nobody knows whether it ran: never claimed again silently, by any number of retries.
    for _ in 0..3 {
        assert_eq!(
            api.claim("held", &fp(6), Some(30_000)).await,
            ClaimResponse::Unknown
        );
    }
    let (_, view) = api.record("held", "alice").await;
    assert_eq!(view["state"], "unknown");
    assert_eq!(view["token"], owner, "the owner's token still holds it");
    // A changed request is still a mismatch.
    assert_eq!(
        api.claim("held", &fp(7), None).await,
        ClaimResponse::Mismatch
    );
    // The owner was alive after all: its outcome is stored, the record is completed.
    let (s, _, _) = api
        .post(COMPLETE_PATH, &complete_body("held", owner, &ok_response()))
        .await;
    assert_eq!(s, 200);
    assert!(matches!(
        api.claim("held", &fp(6), None).await,
        ClaimResponse::Completed { .. }
    ));
    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_claims_total{outcome=\"unknown\"}"),
        3.0
    );
}

#[tokio::test]
async fn an_owner_marks_its_outcome_unknown_and_a_take_over_fences_it() {
    let api = Api::start(&[]).await;
    let owner = token_of(&api.claim("marked", &fp(8), Some(60_000)).await);
    // Its stream ended after forwarding: unknown at once, not after the lease.
    let (s, b, _) = api.post(UNKNOWN_PATH, &fenced_body("marked", owner)).await;
    assert_eq!((s, b["state"].as_str()), (200, Some("unknown")), "{b}");
    let (s, _, _) = api.post(UNKNOWN_PATH, &fenced_body("marked", owner)).await;
    assert_eq!(s, 200, "marking again is harmless");
    assert_eq!(
        api.claim("marked", &fp(8), None).await,
        ClaimResponse::Unknown
    );
    // A claim that reconciles takes it over with a larger token...
    let take = api
        .claim_with(&ClaimRequest {
            on_unknown: OnUnknown::TakeOver,
            ..claim_req("marked", "alice", &fp(8), Some(60_000))
        })
        .await;
    let ClaimResponse::Claimed {
        token: new,
        reclaimed: true,
        ..
    } = take
    else {
        panic!("expected a take-over, got {take:?}");
    };
    assert!(new > owner);
    // ...and the late owner can neither store, heartbeat nor mark anything any more.
    for path in [HEARTBEAT_PATH, UNKNOWN_PATH, RELEASE_PATH] {
        let (s, b, _) = api.post(path, &fenced_body("marked", owner)).await;
        assert_problem(s, &b, 409, "fenced-out");
    }
    let (s, b, _) = api
        .post(
            COMPLETE_PATH,
            &complete_body("marked", owner, &ok_response()),
        )
        .await;
    assert_problem(s, &b, 409, "fenced-out");
    // A mark after the owner's own complete leaves the outcome stored.
    let (s, _, _) = api
        .post(COMPLETE_PATH, &complete_body("marked", new, &ok_response()))
        .await;
    assert_eq!(s, 200);
    let (s, b, _) = api.post(UNKNOWN_PATH, &fenced_body("marked", new)).await;
    assert_eq!((s, b["state"].as_str()), (200, Some("completed")), "{b}");
    assert!(matches!(
        api.claim("marked", &fp(8), None).await,
        ClaimResponse::Completed { .. }
    ));
}

#[tokio::test]
async fn a_release_after_a_take_over_leaves_the_earlier_outcome_unknown() {
    let api = Api::start(&[]).await;
    let owner = token_of(&api.claim("gave-back", &fp(9), Some(60_000)).await);
    let (s, _, _) = api
        .post(UNKNOWN_PATH, &fenced_body("gave-back", owner))
        .await;
    assert_eq!(s, 200);
    let take_over = ClaimRequest {
        on_unknown: OnUnknown::TakeOver,
        ..claim_req("gave-back", "alice", &fp(9), Some(60_000))
    };
    let new = token_of(&api.claim_with(&take_over).await);
    // The new attempt never reached the upstream: only it is given back, the first stays unknown.
    let (s, b, _) = api.post(RELEASE_PATH, &fenced_body("gave-back", new)).await;
    assert_eq!((s, b["state"].as_str()), (200, Some("released")), "{b}");
    assert_eq!(
        api.claim("gave-back", &fp(9), None).await,
        ClaimResponse::Unknown
    );
    let (_, rec) = api.record("gave-back", "alice").await;
    assert_eq!(rec["state"], "unknown");
    // A key that never had an unknown outcome is freed by a release, as before.
    let plain = token_of(&api.claim("freed", &fp(9), Some(60_000)).await);
    api.post(RELEASE_PATH, &fenced_body("freed", plain)).await;
    assert!(matches!(
        api.claim("freed", &fp(9), None).await,
        ClaimResponse::Claimed {
            reclaimed: false,
            ..
        }
    ));
}

#[tokio::test]
async fn a_fenced_out_owner_cannot_write_and_changes_nothing() {
    let api = Api::start(&[]).await;
    let (old, new) = api.claim_then_reclaim("fence", &fp(5)).await;
    assert!(new > old);
    let (_, before) = api.record("fence", "alice").await;

    let (s, b, _) = api.post(HEARTBEAT_PATH, &fenced_body("fence", old)).await;
    assert_problem(s, &b, 409, "fenced-out");
    let (s, b, _) = api
        .post(COMPLETE_PATH, &complete_body("fence", old, &ok_response()))
        .await;
    assert_problem(s, &b, 409, "fenced-out");
    let (s, b, _) = api.post(RELEASE_PATH, &fenced_body("fence", old)).await;
    assert_problem(s, &b, 409, "fenced-out");

    let (_, after) = api.record("fence", "alice").await;
    assert_eq!(after["state"], "in_progress");
    assert_eq!(after["token"], new);
    assert_eq!(after["token"], before["token"]);
    assert!(after["lease_remaining_ms"].as_u64().unwrap() > 50_000);

    // The new owner completes; the old one still cannot overwrite it.
    let mine = StoredResponse::new(201, vec![], b"new owner", true);
    assert_eq!(
        api.post(COMPLETE_PATH, &complete_body("fence", new, &mine))
            .await
            .0,
        200
    );
    let (s, b, _) = api
        .post(COMPLETE_PATH, &complete_body("fence", old, &ok_response()))
        .await;
    assert_problem(s, &b, 409, "fenced-out");
    assert_eq!(replay_of(api.claim("fence", &fp(5), None).await), mine);
    // A heartbeat or release on a completed record is refused too.
    let (s, _, _) = api.post(HEARTBEAT_PATH, &fenced_body("fence", new)).await;
    assert_eq!(s, 409);
    let (s, _, _) = api.post(RELEASE_PATH, &fenced_body("fence", new)).await;
    assert_eq!(s, 409);

    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_fenced_out_total{op=\"complete\"}"),
        2.0
    );
    assert_eq!(
        metric(&m, "state_api_fenced_out_total{op=\"heartbeat\"}"),
        2.0
    );
    assert_eq!(
        metric(&m, "state_api_fenced_out_total{op=\"release\"}"),
        2.0
    );
}

#[tokio::test]
async fn heartbeats_extend_the_lease_even_after_it_ran_out_if_not_reclaimed() {
    let api = Api::start(&[]).await;
    let token = token_of(&api.claim("hb", &fp(6), Some(1_000)).await);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (s, b, _) = api.post(HEARTBEAT_PATH, &json!({"key": "hb", "subject": "alice", "endpoint": ENDPOINT, "token": token, "lease_ms": 20_000})).await;
    assert_eq!((s, b), (200, json!({"lease_ms": 20_000})));
    match api.claim("hb", &fp(6), None).await {
        ClaimResponse::InProgress {
            lease_remaining_ms,
            retry_after_s,
            ..
        } => {
            assert!(lease_remaining_ms > 15_000);
            assert_eq!(retry_after_s, 2, "capped by --retry-after-cap-s");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn release_frees_the_key_once() {
    let api = Api::start(&[]).await;
    let first = token_of(&api.claim("rel", &fp(7), None).await);
    let (s, b, _) = api.post(RELEASE_PATH, &fenced_body("rel", first)).await;
    assert_eq!((s, b), (200, json!({"state": "released"})));
    let (s, b, _) = api.post(RELEASE_PATH, &fenced_body("rel", first)).await;
    assert_problem(s, &b, 409, "fenced-out");
    let (s, b) = api.record("rel", "alice").await;
    assert_problem(s, &b, 404, "not-found");
    // "No record" carries the marker the filter needs to tell a client `absent`; a 404 for a
    // route the state API does not have does not.
    let marker = async |path: String| {
        let request = axum::http::Request::get(path)
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(axum::body::Body::empty())
            .unwrap();
        let (status, headers, _) = api.call(request).await;
        let mark = headers
            .get(contract::wire::NO_RECORD_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (status, mark)
    };
    assert_eq!(
        marker(format!(
            "/v1/records?key=rel&subject=alice&endpoint={}",
            enc(ENDPOINT)
        ))
        .await,
        (404, Some(contract::wire::NO_RECORD_VALUE.to_owned()))
    );
    assert_eq!(marker("/v1/no-such-route".into()).await, (404, None));
    // Free again, even for another body.
    let second = token_of(&api.claim("rel", &fp(8), None).await);
    assert!(second > first);
}

#[tokio::test]
async fn expired_records_are_new_keys_and_the_purge_deletes_them() {
    let api = Api::start(&["--retention-s", "1"]).await;
    // Leases of 1 s: each record is kept until claimed + lease + retention, 2 s.
    let t = token_of(&api.claim("ret", &fp(1), Some(1_000)).await);
    api.post(COMPLETE_PATH, &complete_body("ret", t, &ok_response()))
        .await;
    let t2 = token_of(&api.claim("gone", &fp(1), Some(1_000)).await);
    api.post(COMPLETE_PATH, &complete_body("gone", t2, &ok_response()))
        .await;
    // In progress past its retention but with a live lease: kept.
    api.claim("running", &fp(1), Some(60_000)).await;
    // In progress past both: marked unknown by the purge (nobody knows whether it ran),
    // never deleted while in progress (issue 34, path 1).
    api.claim("dead", &fp(1), Some(1_000)).await;
    tokio::time::sleep(Duration::from_millis(2_300)).await;

    // Expired: treated as new, whatever the fingerprint.
    match api.claim("ret", &fp(2), None).await {
        ClaimResponse::Claimed {
            token,
            reclaimed: false,
            ..
        } => assert!(token > t),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        api.claim("running", &fp(1), None).await,
        ClaimResponse::InProgress { .. }
    ));

    let purged = api
        .state
        .store()
        .purge_expired(1, Duration::from_secs(10), 86_400_000)
        .await
        .unwrap()
        .rows;
    assert_eq!(
        purged, 2,
        "`gone` deleted, `dead` marked, one row per batch"
    );
    assert_eq!(api.record("gone", "alice").await.0, 404);
    assert_eq!(api.record("dead", "alice").await.1["state"], "unknown");
    assert_eq!(api.record("running", "alice").await.0, 200);
    assert_eq!(api.record("ret", "alice").await.1["state"], "in_progress");
}

#[tokio::test]
async fn the_background_purge_runs_on_its_interval() {
    let api = Api::start(&[
        "--retention-s",
        "1",
        "--purge-interval-s",
        "1",
        "--purge-batch",
        "2",
    ])
    .await;
    for i in 0..5 {
        let key = format!("p{i}");
        let t = token_of(&api.claim(&key, &fp(1), Some(1_000)).await);
        api.post(COMPLETE_PATH, &complete_body(&key, t, &ok_response()))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = api.metrics().await;
        if metric(&m, "state_api_purged_rows_total") >= 5.0 {
            break;
        }
        assert!(Instant::now() < deadline, "purge did not run:\n{m}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(api.record("p4", "alice").await.0, 404);
    api.shutdown().await;
}

#[tokio::test]
async fn the_operator_read_shows_state_token_lease_and_ages() {
    let api = Api::start(&[]).await;
    let t = token_of(&api.claim("op/1", &fp(9), Some(10_000)).await);
    let (s, v) = api.record("op/1", "alice").await;
    assert_eq!(s, 200);
    assert_eq!(v["state"], "in_progress");
    assert_eq!(v["subject"], "alice");
    assert_eq!(v["endpoint"], ENDPOINT);
    assert_eq!(v["fingerprint_alg"], ALG);
    assert_eq!(v["token"], t);
    assert!(v["lease_remaining_ms"].as_u64().unwrap() <= 10_000);
    assert!(v["lease_remaining_ms"].as_u64().unwrap() > 5_000);
    assert!(v["age_ms"].as_u64().unwrap() < 5_000);
    assert_eq!(v["completed_age_ms"], Value::Null);
    assert!(v["expires_in_ms"].as_u64().unwrap() > 86_000_000);

    api.post(COMPLETE_PATH, &complete_body("op/1", t, &ok_response()))
        .await;
    let (_, v) = api.record("op/1", "alice").await;
    assert_eq!(v["state"], "completed");
    assert_eq!(v["response_status"], 201);
    assert_eq!(v["replayable"], true);
    assert_eq!(v["lease_remaining_ms"], 0);
    assert!(v["completed_age_ms"].as_u64().is_some());
    assert!(v.get("body_base64").is_none() && v.get("response").is_none());
    // A view is not a claim: the other subject has nothing.
    assert_eq!(api.record("op/1", "bob").await.0, 404);
}

#[tokio::test]
async fn every_v1_call_needs_the_bearer_token() {
    let basic_with_token = format!("Basic {TOKEN}");
    let token_with_prefix = format!("Bearer x{TOKEN}");
    let api = Api::start(&[]).await;
    let claim = serde_json::to_value(claim_req("auth", "alice", &fp(1), None)).unwrap();
    for path in [CLAIM_PATH, HEARTBEAT_PATH, COMPLETE_PATH, RELEASE_PATH] {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("Bearer "),
            Some(TOKEN),
            Some("Basic dGVzdA=="),
            Some(&basic_with_token),
            Some(&token_with_prefix),
        ] {
            let mut req = api.client.post(api.url(path)).json(&claim);
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 401, "{path} with {auth:?}");
            assert_eq!(r.headers()["content-type"], "application/problem+json");
            assert_eq!(r.headers()["www-authenticate"], "Bearer");
            let b: Value = r.json().await.unwrap();
            assert_problem(401, &b, 401, "unauthenticated");
        }
    }
    let r = api
        .client
        .get(api.url(&format!("{RECORDS_PATH}?key=auth&subject=alice&endpoint=x")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // The scheme is case-insensitive.
    let r = api
        .client
        .post(api.url(CLAIM_PATH))
        .header("authorization", format!("bearer {TOKEN}"))
        .json(&serde_json::to_value(claim_req("auth-lower", "alice", &fp(1), None)).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Nothing was claimed by the refused calls.
    assert_eq!(api.record("auth", "alice").await.0, 404);
    // Health, readiness, metrics and the contract are open.
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json"] {
        assert_eq!(
            api.client.get(api.url(path)).send().await.unwrap().status(),
            200,
            "{path}"
        );
    }
}

#[tokio::test]
async fn bad_input_is_a_problem_and_writes_nothing() {
    let api = Api::start(&["--max-body-bytes", "1024"]).await;
    let good = serde_json::to_value(claim_req("bad", "alice", &fp(1), None)).unwrap();
    let with = |field: &str, v: Value| {
        let mut b = good.clone();
        b[field] = v;
        b
    };
    let cases: Vec<(Value, u16, &str)> = vec![
        (
            with("key", json!("k".repeat(256))),
            400,
            "invalid-idempotency-key",
        ),
        (
            with("key", json!("a\u{7}b")),
            400,
            "invalid-idempotency-key",
        ),
        (with("key", json!("")), 400, "invalid-idempotency-key"),
        (
            with("key", json!("caf\u{e9}")),
            400,
            "invalid-idempotency-key",
        ),
        (
            with("fingerprint", json!(fp(1).to_uppercase().replace('1', "A"))),
            400,
            "bad-request",
        ),
        (with("fingerprint", json!(&fp(1)[..63])), 400, "bad-request"),
        (
            with("fingerprint", json!(format!("{}g", &fp(1)[..63]))),
            400,
            "bad-request",
        ),
        (with("fingerprint_alg", json!("")), 400, "bad-request"),
        (with("subject", json!("")), 400, "bad-request"),
        (with("endpoint", json!("")), 400, "bad-request"),
        (with("subject", json!("a\nb")), 400, "bad-request"),
        (with("subject", json!(7)), 400, "bad-request"),
        (with("extra", json!(true)), 400, "bad-request"),
        (with("lease_ms", json!(-1)), 400, "bad-request"),
    ];
    for (body, status, slug) in cases {
        let (s, b, h) = api.post(CLAIM_PATH, &body).await;
        assert_problem(s, &b, status, slug);
        assert_eq!(h["content-type"], "application/problem+json");
    }
    // Not JSON at all, and a body without the outcome fields.
    for raw in ["{", "not json", "", "[]"] {
        let r = api
            .client
            .post(api.url(CLAIM_PATH))
            .bearer_auth(TOKEN)
            .body(raw)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{raw:?}");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
    }
    assert_eq!(
        api.record("bad", "alice").await.0,
        404,
        "nothing was written"
    );

    // Writes: a bad token, status or header, and a body over the limit.
    let t = token_of(&api.claim("bad", &fp(1), None).await);
    let resp = |status: u16, headers: Vec<(String, String)>, body: &[u8], replayable: bool| {
        StoredResponse::new(status, headers, body, replayable)
    };
    let write_cases: Vec<(Value, u16, &str)> = vec![
        (complete_body("bad", 0, &ok_response()), 400, "bad-request"),
        (
            complete_body("bad", t, &resp(99, vec![], b"", true)),
            400,
            "bad-request",
        ),
        (
            complete_body("bad", t, &resp(1000, vec![], b"", true)),
            400,
            "bad-request",
        ),
        (
            complete_body(
                "bad",
                t,
                &resp(200, vec![("bad name".into(), "v".into())], b"", true),
            ),
            400,
            "bad-request",
        ),
        (
            complete_body(
                "bad",
                t,
                &resp(200, vec![("x".into(), "a\r\nb".into())], b"", true),
            ),
            400,
            "bad-request",
        ),
        (
            complete_body("bad", t, &resp(200, vec![], &[7u8; 1025], true)),
            413,
            "payload-too-large",
        ),
        (
            json!({"key": "bad", "subject": "alice", "endpoint": ENDPOINT, "token": t,
                   "response": {"status": 200, "headers": [], "body_base64": "!!!", "replayable": true}}),
            400,
            "bad-request",
        ),
        (
            json!({"key": "bad", "subject": "alice", "endpoint": ENDPOINT, "token": t,
                   "response": {"status": 200, "headers": [], "body_base64": "aGk=", "replayable": false}}),
            400,
            "bad-request",
        ),
    ];
    for (body, status, slug) in write_cases {
        let (s, b, _) = api.post(COMPLETE_PATH, &body).await;
        assert_problem(s, &b, status, slug);
    }
    // Over the HTTP body limit itself.
    let huge = "A".repeat(200_000);
    let body = json!({"key": "bad", "subject": "alice", "endpoint": ENDPOINT, "token": t,
                      "response": {"status": 200, "headers": [], "body_base64": huge, "replayable": true}});
    let (s, b, _) = api.post(COMPLETE_PATH, &body).await;
    assert_problem(s, &b, 413, "payload-too-large");
    let (s, b, _) = api.post(HEARTBEAT_PATH, &fenced_body("bad", -5)).await;
    assert_problem(s, &b, 400, "bad-request");
    let (s, b) = api.get(&format!("{RECORDS_PATH}?key=bad")).await;
    assert_problem(s, &b, 400, "bad-request");

    // The record is untouched by all of it; exactly the limit is fine.
    let (_, v) = api.record("bad", "alice").await;
    assert_eq!(
        (v["state"].as_str(), v["token"].as_i64()),
        (Some("in_progress"), Some(t))
    );
    let max = resp(200, vec![], &[7u8; 1024], true);
    assert_eq!(
        api.post(COMPLETE_PATH, &complete_body("bad", t, &max))
            .await
            .0,
        200
    );
    assert_eq!(replay_of(api.claim("bad", &fp(1), None).await), max);

    let (s, b) = api.get("/nope").await;
    assert_problem(s, &b, 404, "not-found");
    let (s, b) = api.get(CLAIM_PATH).await;
    assert_problem(s, &b, 405, "method-not-allowed");
}

#[tokio::test]
async fn leases_are_clamped_and_metrics_and_openapi_are_served() {
    let api = Api::start(&[]).await;
    match api.claim("clamp-lo", &fp(1), Some(1)).await {
        ClaimResponse::Claimed { lease_ms, .. } => assert_eq!(lease_ms, 1_000),
        other => panic!("{other:?}"),
    }
    match api.claim("clamp-hi", &fp(1), Some(86_400_000)).await {
        ClaimResponse::Claimed { lease_ms, .. } => assert_eq!(lease_ms, 600_000),
        other => panic!("{other:?}"),
    }
    match api.claim("default", &fp(1), None).await {
        ClaimResponse::Claimed { lease_ms, .. } => assert_eq!(lease_ms, 30_000),
        other => panic!("{other:?}"),
    }
    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_claims_total{outcome=\"claimed\"}"),
        3.0
    );
    assert!(metric(&m, "state_api_db_pool_max_connections") >= 1.0);
    assert!(m.contains("# TYPE state_api_request_duration_seconds histogram"));
}

/// The served document is a valid OpenAPI 3.1 document generated from the code, lists every
/// route, and its schemas bite: every answer of this suite is checked against them (see
/// `common::Contract`), and here they refuse what the handlers refuse.
#[tokio::test]
async fn the_served_openapi_document_is_valid_and_says_what_the_handlers_do() {
    let api = Api::start(&[]).await;
    let contract = api.contract().await;
    let doc = contract.doc();
    assert_eq!(
        doc,
        &serde_json::to_value(<state_api::openapi::ApiDoc as utoipa::OpenApi>::openapi()).unwrap(),
        "served = generated"
    );
    let spec = oas3::from_json(doc.to_string()).unwrap_or_else(|e| panic!("not OpenAPI: {e}"));
    assert_eq!(spec.openapi, "3.1.0");
    use contract::admin::*;
    for (method, path) in [
        ("post", CLAIM_PATH),
        ("post", HEARTBEAT_PATH),
        ("post", COMPLETE_PATH),
        ("post", RELEASE_PATH),
        ("post", contract::wire::UNKNOWN_PATH),
        ("get", RECORDS_PATH),
        ("get", ADMIN_RECORD_PATH),
        ("get", ADMIN_RECORDS_PATH),
        ("post", ADMIN_RELEASE_PATH),
        ("post", ADMIN_RESOLVE_PATH),
        ("post", ADMIN_PURGE_PATH),
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/openapi.json"),
    ] {
        let op = &doc["paths"][path][method];
        assert!(op.is_object(), "{method} {path} missing from openapi.json");
        if path.starts_with("/v1/") {
            assert!(op["security"].is_array(), "{method} {path} names no token");
        }
    }
    // Every schema is a valid JSON Schema 2020-12, and every $ref resolves.
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for name in schemas.keys() {
        contract.validator(&format!("/components/schemas/{name}"));
    }
    fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(m) => m.iter().for_each(|(k, v)| match (k.as_str(), v) {
                ("$ref", Value::String(r)) => out.push(r),
                _ => refs(v, out),
            }),
            Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(doc, &mut all);
    assert!(all.len() > 20);
    for r in all {
        let pointer = r.strip_prefix('#').unwrap();
        assert!(doc.pointer(pointer).is_some(), "{r} does not resolve");
    }
    let claim = &doc["components"]["schemas"]["ClaimRequest"]["properties"];
    for field in ["namespace", "retention_s", "wait_ms", "on_unknown"] {
        assert!(claim[field].is_object(), "ClaimRequest.{field} missing");
    }
    // The schemas refuse what the handlers refuse, and the checker notices a wrong answer.
    let request = contract.validator("/components/schemas/ClaimRequest");
    let mut extra = serde_json::to_value(claim_req("k", "alice", &fp(1), None)).unwrap();
    assert!(request.is_valid(&extra));
    extra["surprise"] = json!(1);
    assert!(!request.is_valid(&extra), "unknown members are refused");
    let (status, body, _) = api.post(CLAIM_PATH, &extra).await;
    assert_problem(status, &body, 400, "bad-request");
    let answer = contract.validator("/components/schemas/ClaimResponse");
    assert!(!answer.is_valid(&json!({"outcome": "claimed", "lease_ms": 1, "reclaimed": false})));
    assert!(!answer.is_valid(&json!({"outcome": "maybe"})));
    let stored = contract.validator("/components/schemas/StoredResponse");
    assert!(!stored.is_valid(&json!({"status": 200, "headers": [["a"]], "replayable": true})));
    let wrong = std::panic::catch_unwind(|| {
        contract.check_answer(
            "post",
            CLAIM_PATH,
            200,
            "application/json",
            &json!({"outcome": "in_progress", "lease_remaining_ms": 5}),
        )
    });
    assert!(
        wrong.is_err(),
        "an answer missing retry_after_s passed the check"
    );
    let unlisted = std::panic::catch_unwind(|| {
        contract.check_answer(
            "post",
            CLAIM_PATH,
            418,
            "application/problem+json",
            &json!({}),
        )
    });
    assert!(
        unlisted.is_err(),
        "a status the document does not list passed the check"
    );
}

#[tokio::test]
async fn pooled_connections_commit_durably_and_never_jit_whatever_the_database_default() {
    let cluster = test_support::postgres::shared().unwrap_or_else(|e| panic!("{e}"));
    let url = cluster.fresh_database("durable").unwrap();
    let db = url.rsplit('/').next().unwrap();
    cluster
        .psql(
            "postgres",
            &format!("ALTER DATABASE \"{db}\" SET synchronous_commit = off"),
        )
        .unwrap();
    let api = Api::start_on(&url, &[]).await;
    let pool = api.state.store().pool();
    let (sync, timeout): (String, String) = sqlx::query_as(
        "SELECT current_setting('synchronous_commit'), current_setting('statement_timeout')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((sync.as_str(), timeout.as_str()), ("on", "5s"));
    // No JIT, whatever the server's default: with `enable_seqscan = off` a query that cannot use
    // an index carries a cost above every JIT threshold and was compiled on every call.
    let jit: String = sqlx::query_scalar("SELECT current_setting('jit')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(jit, "off");
    // The lease guard's lookup of the timeline uses its primary key.
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT first_seen_at FROM idempotency_timelines
         WHERE timeline_id = (SELECT idempotency_current_timeline())",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        plan.iter().any(|l| l.contains("Index Scan"))
            && !plan.iter().any(|l| l.contains("Seq Scan")),
        "{plan:#?}"
    );
    api.shutdown().await;
    if cluster.is_external() {
        let _ = cluster.drop_database(db);
    }
}

#[tokio::test]
async fn two_processes_on_one_database_share_records_when_they_share_the_secret() {
    let a = Api::start(&[]).await;
    let b = Api::start_on(&a.db_url, &[]).await;
    let token = token_of(&a.claim("shared", &fp(1), None).await);
    assert!(matches!(
        b.claim("shared", &fp(1), None).await,
        ClaimResponse::InProgress { .. }
    ));
    assert_eq!(
        b.claim("shared", &fp(2), None).await,
        ClaimResponse::Mismatch
    );
    // The owner's complete may reach either process.
    let (s, _, _) = b
        .post(
            COMPLETE_PATH,
            &complete_body("shared", token, &ok_response()),
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(
        replay_of(a.claim("shared", &fp(1), None).await),
        ok_response()
    );
    // Another secret addresses other records: the key would run twice. Hence one secret.
    let c = Api::start_on(
        &a.db_url,
        &["--key-secret", "a-different-secret-0123456789"],
    )
    .await;
    assert!(matches!(
        c.claim("shared", &fp(1), None).await,
        ClaimResponse::Claimed { .. }
    ));
    c.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn completed_answers_carry_the_expiry_by_the_database_clock() {
    let api = Api::start(&["--retention-s", "60"]).await;
    // Not completed: no expiry in the claim answers.
    let first = api
        .post(
            CLAIM_PATH,
            &serde_json::to_value(claim_req("exp", "alice", &fp(8), Some(1_000))).unwrap(),
        )
        .await
        .1;
    assert_eq!(first["outcome"], "claimed");
    assert!(first.get("expires_in_ms").is_none(), "{first}");
    let token = first["token"].as_i64().unwrap();
    let (_, busy, _) = api
        .post(
            CLAIM_PATH,
            &serde_json::to_value(claim_req("exp", "alice", &fp(8), None)).unwrap(),
        )
        .await;
    assert_eq!(busy["outcome"], "in_progress");
    assert!(busy.get("expires_in_ms").is_none(), "{busy}");

    // complete answers how long the record is kept: within its lease (1 s), until claimed +
    // lease + retention (60 s).
    let (s, done, _) = api
        .post(COMPLETE_PATH, &complete_body("exp", token, &ok_response()))
        .await;
    assert_eq!((s, &done["state"]), (200, &json!("completed")));
    let at_complete = done["expires_in_ms"].as_u64().unwrap();
    assert!((55_000..=61_000).contains(&at_complete), "{done}");

    // A claim of the completed record: the same expiry, counted down by the database clock.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replay = api.claim("exp", &fp(8), None).await;
    let ClaimResponse::Completed {
        expires_in_ms: Some(later),
        ..
    } = replay
    else {
        panic!("{replay:?}");
    };
    assert!(later < at_complete, "{later} !< {at_complete}");
    assert!(at_complete - later >= 250, "{at_complete} - {later}");

    // A retried complete of the same owner answers the record's expiry too (not a new one).
    let (s, again, _) = api
        .post(COMPLETE_PATH, &complete_body("exp", token, &ok_response()))
        .await;
    assert_eq!(s, 200);
    let again = again["expires_in_ms"].as_u64().unwrap();
    assert!(again <= later, "{again} > {later}");

    // release: no expiry (the record is gone); a mismatch has none either.
    let t = token_of(&api.claim("exp-rel", &fp(8), None).await);
    let (s, b, _) = api.post(RELEASE_PATH, &fenced_body("exp-rel", t)).await;
    assert_eq!((s, b), (200, json!({"state": "released"})));
    let (_, mismatch, _) = api
        .post(
            CLAIM_PATH,
            &serde_json::to_value(claim_req("exp", "alice", &fp(9), None)).unwrap(),
        )
        .await;
    assert_eq!(mismatch, json!({"outcome": "mismatch"}));
}

#[tokio::test]
async fn a_complete_within_the_lease_rewrites_no_index_and_one_after_it_keeps_its_retention() {
    let api = Api::start(&["--retention-s", "60", "--purge-interval-s", "0"]).await;
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&api.db_url)
        .await
        .unwrap();
    let expiry = |key: &'static str| {
        let scope = api.state.scoper().hash(key, "alice", ENDPOINT);
        sqlx::query_scalar::<_, f64>(
            "SELECT EXTRACT(EPOCH FROM expires_at - created_at)::float8 * 1000
             FROM idempotency_records WHERE scope_hash = $1",
        )
        .bind(scope.to_vec())
    };
    // Within its lease (30 s): the claim's expiry (created + lease + retention) stands, so no
    // indexed column changes and the update is HOT (Postgres' own count says so).
    let t = token_of(&api.claim("hot", &fp(1), Some(30_000)).await);
    let at_claim = expiry("hot").fetch_one(&mut conn).await.unwrap();
    assert!((at_claim - 90_000.0).abs() < 1.0, "{at_claim}");
    let (s, done, _) = api
        .post(COMPLETE_PATH, &complete_body("hot", t, &ok_response()))
        .await;
    assert_eq!(s, 200);
    assert!(done["expires_in_ms"].as_u64().unwrap() > 85_000, "{done}");
    assert_eq!(expiry("hot").fetch_one(&mut conn).await.unwrap(), at_claim);
    let mut hot = (0, 0);
    for _ in 0..200 {
        // An idle backend reports its statistics within 10 s (PGSTAT_IDLE_INTERVAL).
        hot = sqlx::query_as::<_, (i64, i64)>(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'idempotency_records'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if hot.0 > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(hot, (1, 1), "(updates, HOT updates)");

    // After its lease (1 s) the retention counts from the completion.
    let late = token_of(&api.claim("late", &fp(1), Some(1_000)).await);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let (s, done, _) = api
        .post(COMPLETE_PATH, &complete_body("late", late, &ok_response()))
        .await;
    assert_eq!(s, 200);
    let kept = done["expires_in_ms"].as_u64().unwrap();
    assert!((59_000..=60_000).contains(&kept), "{done}");
    assert!(expiry("late").fetch_one(&mut conn).await.unwrap() > 61_400.0);
}

#[tokio::test]
async fn the_table_checks_the_states_invariants_and_leaves_field_checks_to_the_api() {
    let api = Api::start(&[]).await;
    let pool = api.state.store().pool();
    // Field checks (lengths, formats, ranges) are made by the API before any write, and
    // Postgres prepared each CHECK again per statement: only what ties the columns to the
    // state stays in the table.
    let mut checks: Vec<String> = sqlx::query_scalar(
        "SELECT conname::text FROM pg_constraint
         WHERE conrelid = 'idempotency_records'::regclass AND contype = 'c'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    checks.sort();
    assert_eq!(
        checks,
        ["completed_has_response", "idempotency_records_state_check"]
    );
    // And they hold: a record cannot be completed without its response, nor take a state
    // the state machine does not have.
    let t = token_of(&api.claim("inv", &fp(1), None).await);
    let scope = api.state.scoper().hash("inv", "alice", ENDPOINT).to_vec();
    for set in [
        "state = 'completed', completed_at = now()",
        "state = 'released'",
    ] {
        let refused = sqlx::query(&format!(
            "UPDATE idempotency_records SET {set} WHERE scope_hash = $1"
        ))
        .bind(&scope)
        .execute(pool)
        .await
        .unwrap_err();
        let code = refused.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("23514"), "{set}: {refused}");
    }
    let (s, _, _) = api
        .post(COMPLETE_PATH, &complete_body("inv", t, &ok_response()))
        .await;
    assert_eq!(s, 200);
}

#[tokio::test]
async fn the_expiry_is_zero_not_negative_once_past_retention() {
    let api = Api::start(&["--retention-s", "1", "--purge-interval-s", "0"]).await;
    // Lease 1 s, retention 1 s: kept until claimed + 2 s.
    let t = token_of(&api.claim("exp-past", &fp(8), Some(1_000)).await);
    let (s, done, _) = api
        .post(COMPLETE_PATH, &complete_body("exp-past", t, &ok_response()))
        .await;
    assert_eq!(s, 200);
    assert!(done["expires_in_ms"].as_u64().unwrap() <= 2_000, "{done}");
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    // Past retention, not yet purged: a retried complete says 0; a claim treats the key as new.
    let (s, again, _) = api
        .post(COMPLETE_PATH, &complete_body("exp-past", t, &ok_response()))
        .await;
    assert_eq!((s, &again["expires_in_ms"]), (200, &json!(0)));
    assert!(matches!(
        api.claim("exp-past", &fp(8), None).await,
        ClaimResponse::Claimed { .. }
    ));
}

/// Expired rows made in bulk, straight in the table (what a day of sustained new keys leaves).
fn expired_rows(api: &Api, n: u32) {
    let cluster = test_support::postgres::shared().unwrap();
    let db = api.db_url.rsplit('/').next().unwrap();
    cluster
        .psql(
            db,
            &format!(
                "INSERT INTO idempotency_records (scope_hash, subject, endpoint, fingerprint_alg, \
                   fingerprint, state, fencing_token, lease_expires_at, created_at, expires_at, \
                   completed_at, response_status, response_headers, response_body, response_replayable) \
                 SELECT sha256(('bulk-' || i)::bytea), 'bulk', 'POST /x', 'a', repeat('ab', 32), \
                   'completed', nextval('idempotency_fencing_token_seq'), now() - interval '2 hours', \
                   now() - interval '2 hours', now() - interval '1 minute', now() - interval '2 hours', \
                   201, '[]', '', true \
                 FROM generate_series(1, {n}) i"
            ),
        )
        .unwrap();
}

#[tokio::test]
async fn the_purge_clears_a_backlog_with_growing_batches_and_bounds_each_pass() {
    let api = Api::start(&[]).await;
    let live = token_of(&api.claim("live", &fp(1), None).await);
    expired_rows(&api, 20_000);
    // A pass with no time to spare stops after its first full batch, saying a backlog is left.
    let short = api
        .state
        .store()
        .purge_expired(100, Duration::ZERO, 86_400_000)
        .await
        .unwrap();
    assert_eq!(
        (short.rows, short.statements, short.backlog),
        (100, 1, true)
    );
    // With time: all of it, in far fewer statements than batches of 100 would take.
    let pass = api
        .state
        .store()
        .purge_expired(100, Duration::from_secs(30), 86_400_000)
        .await
        .unwrap();
    assert_eq!((pass.rows, pass.backlog), (19_900, false));
    assert!(pass.statements < 60, "{} statements", pass.statements);
    // Live records stay.
    let (status, body) = api.record("live", "alice").await;
    assert_eq!((status, body["token"].as_i64()), (200, Some(live)));
}
