//! Issue 46, findings 4, 5 and 8, in the state API against a real Postgres: the operator's
//! guard counts an owner's silence only while the database served (the lease guard), an
//! operator's resolve takes a new fencing token (the owner's late complete is fenced out, not
//! "already done"), and an unknown outcome is kept a horizon of its own
//! (`--unknown-retention-s`), never a new key once a mere retention has passed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use contract::admin::{AdminAction, ADMIN_RELEASE_PATH, ADMIN_RESOLVE_PATH};
use contract::wire::{ClaimRequest, ClaimResponse, StoredResponse, COMPLETE_PATH};
use serde_json::Value;

const ADMIN: &str = "admin-token-0123456789";

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

async fn admin_post(api: &Api, path: &str, a: &AdminAction) -> (u16, Value) {
    let r = api
        .client
        .post(api.url(path))
        .bearer_auth(ADMIN)
        .json(a)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Finding 4: an owner silent for a whole lease, but only because the database was not
/// serving (here: a promoted standby, its timeline first seen now; `tests/crash.rs` does the
/// same for the claim's lease guard), may still be running: an operator's release without
/// force is refused until the database has served a whole lease, as a claim's reclaim is.
#[tokio::test]
async fn an_operator_release_counts_the_owners_silence_only_while_the_database_served() {
    let api = Api::start(&["--admin-token", ADMIN]).await;
    let _owner = token_of(&api.claim("cut-off", &fp(1), Some(1_000)).await);
    // One lease and more without a sign of life...
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    // ... but the database began serving just now (a failover): the owner could not be heard.
    sqlx::query("UPDATE idempotency_timelines SET first_seen_at = clock_timestamp()")
        .execute(api.state.store().pool())
        .await
        .unwrap();
    let (s, b) = admin_post(
        &api,
        ADMIN_RELEASE_PATH,
        &action("cut-off", "looks stuck after the failover"),
    )
    .await;
    assert_eq!(
        (s, b["type"].as_str()),
        (409, Some("/problems/lease-live")),
        "an owner cut off by an outage was released: {b}"
    );
    // The claim's lease guard agrees: still in progress.
    assert!(
        matches!(
            api.claim("cut-off", &fp(1), None).await,
            ClaimResponse::InProgress { .. }
        ),
        "the claim's lease guard"
    );
    // A whole lease of serving later, without force.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (s, b) = admin_post(
        &api,
        ADMIN_RELEASE_PATH,
        &action("cut-off", "silent a lease since the failover"),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    api.shutdown().await;
}

/// Finding 5: an operator's resolve gives the record a new fencing token, so the owner that
/// was still running after all is fenced out (409) when its complete arrives late, instead of
/// being told "already done" (and caching its own response beside the operator's); the
/// operator's outcome is what every retry replays.
#[tokio::test]
async fn an_operator_resolve_takes_a_new_token_and_fences_the_late_owner_out() {
    let api = Api::start(&["--admin-token", ADMIN]).await;
    let owner = token_of(&api.claim("resolved", &fp(2), Some(60_000)).await);
    let resolve = AdminAction {
        force: true,
        response: Some(StoredResponse::new(
            201,
            vec![("content-type".into(), "application/json".into())],
            b"{\"id\":\"ch_operator\"}",
            true,
        )),
        ..action("resolved", "charged per PSP dashboard")
    };
    let (s, b) = admin_post(&api, ADMIN_RESOLVE_PATH, &resolve).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["before"]["token"].as_i64(), Some(owner), "{b}");
    let after = b["after"]["token"].as_i64().unwrap();

    // The owner's late complete (its own, different response).
    let late = StoredResponse::new(
        201,
        vec![("content-type".into(), "application/json".into())],
        b"{\"id\":\"ch_owner\"}",
        true,
    );
    let (s, b, _) = api
        .post(COMPLETE_PATH, &complete_body("resolved", owner, &late))
        .await;
    assert_problem(s, &b, 409, "fenced-out");
    assert!(after > owner, "the resolve kept the owner's token");
    // Its heartbeat too.
    let (s, b, _) = api
        .post("/v1/heartbeat", &fenced_body("resolved", owner))
        .await;
    assert_problem(s, &b, 409, "fenced-out");
    // A retry replays the operator's outcome, under the new token.
    let ClaimResponse::Completed { response, .. } = api.claim("resolved", &fp(2), None).await
    else {
        panic!("a replay")
    };
    assert_eq!(response.body, b"{\"id\":\"ch_operator\"}");
    let (_, view) = api.record("resolved", "alice").await;
    assert_eq!(view["token"].as_i64(), Some(after), "{view}");
    api.shutdown().await;
}

/// Finding 8: an unknown outcome (its owner lost sight of its request) is kept for the unknown
/// horizon (`--unknown-retention-s`, 7 days by default), not the record's retention: past the
/// retention a claim still answers unknown, and the purge keeps it.
#[tokio::test]
async fn an_unknown_outcome_outlives_the_retention() {
    let api = Api::start(&[]).await;
    let claim = ClaimRequest {
        retention_s: Some(1),
        ..claim_req("unknown-long", "alice", &fp(3), Some(1_000))
    };
    let token = token_of(&api.claim_with(&claim).await);
    let (s, b, _) = api
        .post("/v1/unknown", &fenced_body("unknown-long", token))
        .await;
    assert_eq!(s, 200, "{b}");
    // Past claim + lease + retention, and a retention past the mark.
    tokio::time::sleep(Duration::from_millis(2_300)).await;
    let pass = api
        .state
        .store()
        .purge_expired(10, Duration::from_secs(5), 1_000)
        .await
        .unwrap();
    assert_eq!(
        pass.rows, 0,
        "the purge deleted an unknown outcome: {pass:?}"
    );
    let again = api.claim_with(&claim).await;
    assert_eq!(
        again,
        ClaimResponse::Unknown,
        "an unknown outcome became a new key after its retention"
    );
    // Kept about the default horizon (7 days) from the mark.
    let expires: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM (expires_at - clock_timestamp()))::float8
         FROM idempotency_records WHERE state = 'unknown'",
    )
    .fetch_one(api.state.store().pool())
    .await
    .unwrap();
    assert!(
        (604_700.0..=604_800.0).contains(&expires),
        "expires in {expires} s"
    );
    api.shutdown().await;
}

/// Finding 8, by the purge: an in-progress record past its expiry whose owner went silent is
/// marked unknown and kept the unknown horizon, not deleted a retention later.
#[tokio::test]
async fn the_purge_marks_an_abandoned_claim_unknown_for_the_unknown_horizon() {
    let api = Api::start(&[]).await;
    let claim = ClaimRequest {
        retention_s: Some(1),
        ..claim_req("silent", "alice", &fp(4), Some(1_000))
    };
    token_of(&api.claim_with(&claim).await);
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let store = api.state.store();
    let pass = store
        .purge_expired(10, Duration::from_secs(5), 1_000)
        .await
        .unwrap();
    assert_eq!(pass.rows, 1, "marked: {pass:?}");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let pass = store
        .purge_expired(10, Duration::from_secs(5), 1_000)
        .await
        .unwrap();
    assert_eq!(pass.rows, 0, "deleted a retention after the mark: {pass:?}");
    assert_eq!(api.claim_with(&claim).await, ClaimResponse::Unknown);
    api.shutdown().await;
}

/// Finding 8, by a claim: a claim that holds unknown outcomes and finds a lease run out marks
/// the record unknown for the unknown horizon.
#[tokio::test]
async fn a_claim_marks_a_run_out_lease_unknown_for_the_unknown_horizon() {
    let api = Api::start(&[]).await;
    let claim = ClaimRequest {
        retention_s: Some(1),
        ..claim_req("run-out", "alice", &fp(5), Some(1_000))
    };
    token_of(&api.claim_with(&claim).await);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(api.claim_with(&claim).await, ClaimResponse::Unknown);
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    assert_eq!(
        api.claim_with(&claim).await,
        ClaimResponse::Unknown,
        "a run-out lease became a new key a retention after the claim marked it"
    );
    api.shutdown().await;
}
