#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! What issue 15 added to the state API, against a real Postgres: namespaces, retention per
//! claim, claims that wait for a running key, and the admin API with its audit trail.

mod common;

use contract::state_env;
use std::time::Duration;

use common::*;
use contract::admin::{
    AdminAction, ADMIN_PURGE_PATH, ADMIN_RECORDS_PATH, ADMIN_RECORD_PATH, ADMIN_RELEASE_PATH,
    ADMIN_RESOLVE_PATH,
};
use contract::wire::{ClaimRequest, ClaimResponse, StoredResponse, COMPLETE_PATH, RELEASE_PATH};
use serde_json::{json, Value};

const ADMIN: &str = "admin-token-0123456789";

fn in_ns(ns: &str, key: &str) -> ClaimRequest {
    ClaimRequest {
        namespace: ns.into(),
        ..claim_req(key, "alice", &fp(1), Some(60_000))
    }
}

fn complete_in(ns: &str, key: &str, token: i64, body: &[u8]) -> Value {
    json!({
        "namespace": ns, "key": key, "subject": "alice", "endpoint": ENDPOINT, "token": token,
        "response": StoredResponse::new(201, vec![("content-type".into(), "application/json".into())], body, true),
    })
}

#[tokio::test]
async fn namespaces_keep_the_same_key_apart() {
    let api = Api::start(&[]).await;
    let a = token_of(&api.claim_with(&in_ns("tenant-a", "shared")).await);
    // The same key, subject and endpoint in another namespace (and in none) is another record.
    let b = api.claim_with(&in_ns("tenant-b", "shared")).await;
    assert!(
        matches!(
            b,
            ClaimResponse::Claimed {
                reclaimed: false,
                ..
            }
        ),
        "{b:?}"
    );
    let none = api.claim_with(&in_ns("", "shared")).await;
    assert!(matches!(none, ClaimResponse::Claimed { .. }), "{none:?}");
    let (s, _, _) = api
        .post(
            COMPLETE_PATH,
            &complete_in("tenant-a", "shared", a, b"{\"a\":1}"),
        )
        .await;
    assert_eq!(s, 200);
    assert!(matches!(
        api.claim_with(&in_ns("tenant-a", "shared")).await,
        ClaimResponse::Completed { .. }
    ));
    assert!(matches!(
        api.claim_with(&in_ns("tenant-b", "shared")).await,
        ClaimResponse::InProgress { .. }
    ));
    // A token of one namespace writes nothing in another.
    let (s, _, _) = api
        .post(COMPLETE_PATH, &complete_in("tenant-b", "shared", a, b"{}"))
        .await;
    assert_eq!(s, 409);
    let (s, body, _) = api
        .post(
            "/v1/claim",
            &serde_json::to_value(in_ns("Bad Namespace", "k")).unwrap(),
        )
        .await;
    assert_eq!(
        (s, body["type"].as_str()),
        (400, Some("/problems/bad-request")),
        "{body}"
    );
}

#[tokio::test]
async fn retention_is_the_claims_capped_by_the_maximum_and_kept_at_completion() {
    let api = Api::start(&["--retention-s", "86400", "--max-retention-s", "3600"]).await;
    let ask = |key: &str, retention_s: Option<u64>| ClaimRequest {
        retention_s,
        ..claim_req(key, "alice", &fp(1), Some(60_000))
    };
    let short = api.claim_with(&ask("short", Some(120))).await;
    let ClaimResponse::Claimed {
        token, retention_s, ..
    } = short
    else {
        panic!("{short:?}")
    };
    assert_eq!(retention_s, Some(120), "as asked");
    let capped = api.claim_with(&ask("capped", Some(999_999))).await;
    assert!(
        matches!(
            capped,
            ClaimResponse::Claimed {
                retention_s: Some(3600),
                ..
            }
        ),
        "{capped:?}"
    );
    let default = api.claim_with(&ask("default", None)).await;
    assert!(
        matches!(
            default,
            ClaimResponse::Claimed {
                retention_s: Some(86_400),
                ..
            }
        ),
        "{default:?}"
    );
    // The record's own retention applies again when it completes, and operators see it.
    let (s, b, _) = api
        .post(COMPLETE_PATH, &complete_in("", "short", token, b"{}"))
        .await;
    assert_eq!(s, 200, "{b}");
    // (completed within its 60 s lease: kept until claimed + lease + retention)
    let expires = b["expires_in_ms"].as_u64().unwrap();
    assert!(expires <= 180_000 && expires > 170_000, "{b}");
    let (_, view) = api.record("short", "alice").await;
    assert!(view["expires_in_ms"].as_u64().unwrap() <= 180_000, "{view}");
}

#[tokio::test]
async fn a_waiting_claim_gets_the_outcome_once_the_first_request_completes() {
    // No poll within the waits below: a waiter that gets an outcome was woken by the write.
    let api = Api::start(&["--wait-poll-ms", "60000"]).await;
    let owner = token_of(&api.claim("waited", &fp(2), Some(60_000)).await);
    let wait = |ms: u64| ClaimRequest {
        wait_ms: Some(ms),
        ..claim_req("waited", "alice", &fp(2), Some(60_000))
    };
    let waiter = api.spawn_claim(&wait(10_000));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (s, _, _) = api
        .post(
            COMPLETE_PATH,
            &complete_in("", "waited", owner, b"{\"done\":true}"),
        )
        .await;
    assert_eq!(s, 200);
    let (answer, took) = waiter.await.unwrap();
    let ClaimResponse::Completed { response, .. } = answer else {
        panic!("{answer:?}")
    };
    assert_eq!(response.body, b"{\"done\":true}");
    // Woken by the complete of this process: its next poll is a minute away, its deadline 10 s.
    assert!(took >= Duration::from_millis(400) && took < Duration::from_secs(10));
    assert!(
        metric(
            &api.metrics().await,
            "state_api_waits_total{end=\"settled\"}"
        ) >= 1.0
    );

    // Still running at the deadline: in progress, after the wait.
    let _ = token_of(&api.claim("slow", &fp(3), Some(60_000)).await);
    let (answer, took) = api
        .spawn_claim(&ClaimRequest {
            wait_ms: Some(700),
            ..claim_req("slow", "alice", &fp(3), None)
        })
        .await
        .unwrap();
    assert!(
        matches!(answer, ClaimResponse::InProgress { .. }),
        "{answer:?}"
    );
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_millis(2_000),
        "{took:?}"
    );
    assert!(
        metric(
            &api.metrics().await,
            "state_api_waits_total{end=\"timed_out\"}"
        ) >= 1.0
    );

    // A release lets the waiter claim the key itself.
    let owner = token_of(&api.claim("released", &fp(4), Some(60_000)).await);
    let waiter = api.spawn_claim(&ClaimRequest {
        wait_ms: Some(5_000),
        ..claim_req("released", "alice", &fp(4), None)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    api.post(RELEASE_PATH, &fenced_body("released", owner))
        .await;
    let (answer, _) = waiter.await.unwrap();
    assert!(
        matches!(answer, ClaimResponse::Claimed { .. }),
        "{answer:?}"
    );
}

#[tokio::test]
async fn waiters_are_bounded_per_process() {
    let api = Api::start(&["--max-waiters", "2"]).await;
    let _ = token_of(&api.claim("crowd", &fp(5), Some(60_000)).await);
    let w = || ClaimRequest {
        wait_ms: Some(1_500),
        ..claim_req("crowd", "alice", &fp(5), None)
    };
    let a = api.spawn_claim(&w());
    let b = api.spawn_claim(&w());
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The third is answered at once, not after the wait.
    let (third, took) = api.spawn_claim(&w()).await.unwrap();
    assert!(matches!(third, ClaimResponse::InProgress { .. }));
    // At once: the two admitted waiters are still waiting (1.5 s) when it is answered.
    assert!(
        !a.is_finished() && !b.is_finished(),
        "refused after {took:?}"
    );
    assert_eq!(
        metric(
            &api.metrics().await,
            "state_api_waits_total{end=\"refused\"}"
        ),
        1.0
    );
    let (_, ta) = a.await.unwrap();
    let (_, tb) = b.await.unwrap();
    assert!(ta >= Duration::from_millis(1_400) && tb >= Duration::from_millis(1_400));
}

// ---------------------------------------------------------------------------------------------
// The admin API

async fn admin_post(api: &Api, token: Option<&str>, path: &str, body: &Value) -> (u16, Value) {
    let mut r = api.client.post(api.url(path)).json(body);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().await.unwrap();
    let checked = checked(api, "post", path, r).await;
    if (200..300).contains(&checked.0) {
        api.contract()
            .await
            .check_accepted_request("post", path, body);
    }
    checked
}

/// Status and JSON body, the answer checked against the served OpenAPI document.
async fn checked(api: &Api, method: &str, path: &str, r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let media = r
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = r.json().await.unwrap_or(Value::Null);
    api.contract()
        .await
        .check_answer(method, path, status, &media, &body);
    (status, body)
}

async fn admin_get(api: &Api, path: &str) -> (u16, Value) {
    let r = api
        .client
        .get(api.url(path))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    checked(api, "get", path, r).await
}

fn action(key: &str, reason: &str) -> AdminAction {
    AdminAction {
        namespace: String::new(),
        key: key.into(),
        subject: "alice".into(),
        endpoint: ENDPOINT.into(),
        reason: reason.into(),
        actor: "oncall-ana".into(),
        force: false,
        response: None,
    }
}

fn record_query(key: &str) -> String {
    format!(
        "{ADMIN_RECORD_PATH}?key={}&subject=alice&endpoint={}",
        enc(key),
        enc(ENDPOINT)
    )
}

async fn audit_rows(api: &Api) -> Vec<(String, String, String, bool)> {
    let pool = api.state.store().pool();
    sqlx::query_as::<_, (String, String, String, bool)>(
        "SELECT actor, action, reason, forced FROM idempotency_audit ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn admin_refusals_wrong_token_filter_token_unknown_record_live_lease() {
    let api = Api::start(&["--admin-token", ADMIN]).await;
    let body = serde_json::to_value(action("nothing-here", "checking")).unwrap();
    assert_eq!(
        admin_post(&api, None, ADMIN_RELEASE_PATH, &body).await.0,
        401
    );
    assert_eq!(
        admin_post(
            &api,
            Some("wrong-token-xxxxxxxx"),
            ADMIN_RELEASE_PATH,
            &body
        )
        .await
        .0,
        401
    );
    let (s, b) = admin_post(&api, Some(TOKEN), ADMIN_RELEASE_PATH, &body).await;
    assert_eq!(
        (s, b["type"].as_str()),
        (403, Some("/problems/forbidden")),
        "the filter's token: {b}"
    );
    let (s, b) = admin_post(&api, Some(ADMIN), ADMIN_RELEASE_PATH, &body).await;
    assert_eq!(
        (s, b["type"].as_str()),
        (404, Some("/problems/not-found")),
        "{b}"
    );
    // A reason is required.
    let (s, _) = admin_post(
        &api,
        Some(ADMIN),
        ADMIN_RELEASE_PATH,
        &serde_json::to_value(action("x", " ")).unwrap(),
    )
    .await;
    assert_eq!(s, 400);
    // The admin token does not work on the filter's routes either.
    let r = api
        .client
        .post(api.url("/v1/claim"))
        .bearer_auth(ADMIN)
        .json(&claim_req("k", "alice", &fp(1), None))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    // A live lease: 409 unless forced, and the forced release is audited as such.
    let _ = token_of(&api.claim("live", &fp(6), Some(60_000)).await);
    let live = serde_json::to_value(action("live", "customer asked")).unwrap();
    let (s, b) = admin_post(&api, Some(ADMIN), ADMIN_RELEASE_PATH, &live).await;
    assert_eq!(
        (s, b["type"].as_str()),
        (409, Some("/problems/lease-live")),
        "{b}"
    );
    let (s, b) = admin_post(&api, Some(ADMIN), ADMIN_PURGE_PATH, &live).await;
    assert_eq!(s, 409, "purge too: {b}");
    let forced = serde_json::to_value(AdminAction {
        force: true,
        ..action("live", "the checkout was restarted")
    })
    .unwrap();
    let (s, b) = admin_post(&api, Some(ADMIN), ADMIN_RELEASE_PATH, &forced).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["before"]["state"], "in_progress");
    assert!(b["after"].is_null());
    assert_eq!(
        audit_rows(&api).await,
        [(
            "oncall-ana".into(),
            "release".into(),
            "the checkout was restarted".into(),
            true
        )]
    );
    // Without an admin token configured the admin API is off.
    let off = Api::start(&[]).await;
    let (s, b) = admin_post(&off, Some(ADMIN), ADMIN_RELEASE_PATH, &body).await;
    assert_eq!(s, 401);
    assert!(
        b["detail"]
            .as_str()
            .unwrap()
            .contains(state_env::STATE_API_ADMIN_TOKEN),
        "{b}"
    );
}

#[tokio::test]
async fn operators_release_resolve_and_purge_with_an_audit_row_each() {
    let api = Api::start(&["--admin-token", ADMIN]).await;
    // An unknown outcome, resolved with what the PSP says happened: a replay from then on.
    let owner = token_of(&api.claim("held", &fp(7), Some(1_000)).await);
    api.post("/v1/unknown", &fenced_body("held", owner)).await;
    // Its owner was heard from a moment ago (its mark): an action waits a lease (issue 34,
    // path 8; `an_unknown_record_whose_owner_was_just_heard_from_needs_force`).
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let resolve = AdminAction {
        response: Some(StoredResponse::new(
            201,
            vec![("content-type".into(), "application/json".into())],
            b"{\"id\":\"ch_1\"}",
            true,
        )),
        ..action("held", "charged per PSP dashboard")
    };
    let (s, b) = admin_post(
        &api,
        Some(ADMIN),
        ADMIN_RESOLVE_PATH,
        &serde_json::to_value(&resolve).unwrap(),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        (b["before"]["state"].as_str(), b["after"]["state"].as_str()),
        (Some("unknown"), Some("completed"))
    );
    let ClaimResponse::Completed { response, .. } = api.claim("held", &fp(7), None).await else {
        panic!("a replay")
    };
    assert_eq!(response.body, b"{\"id\":\"ch_1\"}");
    // Resolving it again needs force.
    let (s, b) = admin_post(
        &api,
        Some(ADMIN),
        ADMIN_RESOLVE_PATH,
        &serde_json::to_value(&resolve).unwrap(),
    )
    .await;
    assert_eq!(
        (s, b["type"].as_str()),
        (409, Some("/problems/already-completed"))
    );
    // Shown with its audit trail, without its body unless asked.
    let (s, shown) = admin_get(&api, &record_query("held")).await;
    assert_eq!(s, 200, "{shown}");
    assert_eq!(shown["record"]["state"], "completed");
    assert!(shown.get("body_base64").is_none());
    assert_eq!(shown["audit"][0]["action"], "resolve");
    assert_eq!(shown["audit"][0]["reason"], "charged per PSP dashboard");
    assert_eq!(shown["audit"][0]["actor"], "oncall-ana");
    let (_, with_body) = admin_get(&api, &format!("{}&body=true", record_query("held"))).await;
    assert_eq!(with_body["body_base64"], "eyJpZCI6ImNoXzEifQ==");

    // Listed by state and age.
    let _ = token_of(&api.claim("stuck", &fp(8), Some(1_000)).await);
    let (s, listed) = admin_get(&api, &format!("{ADMIN_RECORDS_PATH}?state=in_progress")).await;
    assert_eq!(s, 200);
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["state"] == "in_progress" && r["subject"] == "alice"),
        "{listed}"
    );
    let (_, none) = admin_get(
        &api,
        &format!("{ADMIN_RECORDS_PATH}?state=in_progress&older_than_s=3600"),
    )
    .await;
    assert_eq!(none.as_array().map(Vec::len), Some(0));

    // Released once its lease ran out: the key may run again.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (s, _) = admin_post(
        &api,
        Some(ADMIN),
        ADMIN_RELEASE_PATH,
        &serde_json::to_value(action("stuck", "client confirmed nothing ran")).unwrap(),
    )
    .await;
    assert_eq!(s, 200);
    assert!(matches!(
        api.claim("stuck", &fp(8), None).await,
        ClaimResponse::Claimed {
            reclaimed: false,
            ..
        }
    ));

    // Purged: gone, the audit trail stays.
    let (s, _) = admin_post(
        &api,
        Some(ADMIN),
        ADMIN_PURGE_PATH,
        &serde_json::to_value(action("held", "GDPR erasure request")).unwrap(),
    )
    .await;
    assert_eq!(s, 200);
    let (s, shown) = admin_get(&api, &record_query("held")).await;
    assert_eq!(s, 200);
    assert!(shown["record"].is_null());
    assert_eq!(shown["audit"].as_array().map(Vec::len), Some(2));
    let actions: Vec<String> = audit_rows(&api).await.into_iter().map(|r| r.1).collect();
    assert_eq!(actions, ["resolve", "release", "purge"]);
    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_admin_actions_total{action=\"purge\"}"),
        1.0
    );

    // The audit table is append-only, even for the database user.
    let pool = api.state.store().pool();
    let e = sqlx::query("DELETE FROM idempotency_audit")
        .execute(pool)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("append-only"), "{e}");
    let e = sqlx::query("UPDATE idempotency_audit SET reason = 'x'")
        .execute(pool)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("append-only"), "{e}");
}

/// Issue 34, path 8: an `unknown` record whose owner was heard from within a lease (it marked
/// its outcome unknown a moment ago: its request may still be running upstream) is not
/// released or purged without `force`; its last sign of life is shown with the record; a lease
/// later, it is.
#[tokio::test]
async fn an_unknown_record_whose_owner_was_just_heard_from_needs_force() {
    let api = Api::start(&["--admin-token", ADMIN]).await;
    let token = token_of(&api.claim("heard", &fp(7), Some(1_000)).await);
    let (s, _, _) = api.post("/v1/unknown", &fenced_body("heard", token)).await;
    assert_eq!(s, 200);
    let (s, shown) = admin_get(&api, &record_query("heard")).await;
    assert_eq!(s, 200);
    assert_eq!(shown["record"]["state"], "unknown");
    let seen = shown["record"]["owner_seen_ms_ago"].as_u64();
    assert!(seen.is_some_and(|ms| ms < 1_000), "{shown}");
    assert_eq!(shown["record"]["lease_ms"], 1_000);
    for path in [ADMIN_RELEASE_PATH, ADMIN_PURGE_PATH] {
        let body = serde_json::to_value(action("heard", "looks stuck")).unwrap();
        let (s, b) = admin_post(&api, Some(ADMIN), path, &body).await;
        assert_eq!(
            (s, b["type"].as_str()),
            (409, Some("/problems/lease-live")),
            "{path}: the owner was heard from within its lease: {b}"
        );
    }
    // A lease later, without force.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let body = serde_json::to_value(action("heard", "checked with the PSP")).unwrap();
    let (s, b) = admin_post(&api, Some(ADMIN), ADMIN_RELEASE_PATH, &body).await;
    assert_eq!(s, 200, "{b}");
}
