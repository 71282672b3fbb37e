//! Issue 34, path 5: a mark outranks every heartbeat sent before it. A heartbeat of the owner
//! that arrives after its record was marked unknown (by the owner itself, or by a claim that
//! found its lease run out) is refused with `lease-ended` and revives nothing; the owner's
//! outcome is still accepted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use contract::wire::{ClaimResponse, COMPLETE_PATH};
use serde_json::json;
use std::time::Duration;

fn beat(key: &str, token: i64) -> serde_json::Value {
    json!({"key": key, "subject": "alice", "endpoint": ENDPOINT, "token": token, "lease_ms": 1_000})
}

#[tokio::test]
async fn a_heartbeat_after_the_owners_own_mark_revives_nothing() {
    let api = Api::start(&[]).await;
    let token = token_of(&api.claim("marked-by-owner", &fp(1), Some(1_000)).await);
    let (status, body, _) = api
        .post("/v1/unknown", &fenced_body("marked-by-owner", token))
        .await;
    assert_eq!(status, 200, "{body}");
    // A heartbeat sent before the mark, answered after it.
    let (status, body, _) = api
        .post("/v1/heartbeat", &beat("marked-by-owner", token))
        .await;
    assert_problem(status, &body, 409, "lease-ended");
    assert_eq!(
        api.claim("marked-by-owner", &fp(1), None).await,
        ClaimResponse::Unknown,
        "the mark was undone by an older heartbeat"
    );
    // The owner's outcome is still stored and replayed.
    let (status, body, _) = api
        .post(
            COMPLETE_PATH,
            &complete_body("marked-by-owner", token, &ok_response()),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(matches!(
        api.claim("marked-by-owner", &fp(1), None).await,
        ClaimResponse::Completed { .. }
    ));
    api.shutdown().await;
}

#[tokio::test]
async fn a_heartbeat_after_a_claim_marked_the_lease_run_out_revives_nothing() {
    let api = Api::start(&[]).await;
    let token = token_of(&api.claim("marked-by-claim", &fp(2), Some(1_000)).await);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(
        api.claim("marked-by-claim", &fp(2), None).await,
        ClaimResponse::Unknown
    );
    let (status, body, _) = api
        .post("/v1/heartbeat", &beat("marked-by-claim", token))
        .await;
    assert_problem(status, &body, 409, "lease-ended");
    let (status, record) = api.record("marked-by-claim", "alice").await;
    assert_eq!(status, 200);
    assert_eq!(record["state"], "unknown", "{record}");
    // A stranger's token is fenced out, as before.
    let (status, body, _) = api
        .post("/v1/heartbeat", &beat("marked-by-claim", token + 99))
        .await;
    assert_problem(status, &body, 409, "fenced-out");
    api.shutdown().await;
}
