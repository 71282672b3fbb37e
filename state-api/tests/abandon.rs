//! Issue 34, path 4: a claim committed for a filter that never read its answer is given back
//! by the nonce it was sent with (`/v1/abandon`): nothing was forwarded under it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use contract::wire::{ClaimRequest, ClaimResponse, OnUnknown};
use serde_json::json;
use std::time::Duration;

fn named(key: &str, nonce: &str, lease_ms: Option<u64>) -> ClaimRequest {
    ClaimRequest {
        nonce: Some(nonce.into()),
        ..claim_req(key, "alice", &fp(1), lease_ms)
    }
}

fn abandon(key: &str, nonce: &str) -> serde_json::Value {
    json!({"key": key, "subject": "alice", "endpoint": ENDPOINT, "nonce": nonce})
}

#[tokio::test]
async fn a_lost_claim_is_given_back_by_its_nonce_and_only_by_it() {
    let api = Api::start(&[]).await;
    let first = token_of(&api.claim_with(&named("lost", "w1.1", None)).await);
    // A stranger's nonce changes nothing.
    let (status, body, _) = api.post("/v1/abandon", &abandon("lost", "w9.9")).await;
    assert_eq!(status, 200, "{body}");
    assert!(matches!(
        api.claim_with(&named("lost", "w1.2", None)).await,
        ClaimResponse::InProgress { .. }
    ));
    // Its own: the key is free at once, a new key (no earlier attempt ran).
    let (status, body, _) = api.post("/v1/abandon", &abandon("lost", "w1.1")).await;
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("released")),
        "{body}"
    );
    match api.claim_with(&named("lost", "w1.3", None)).await {
        ClaimResponse::Claimed {
            token, reclaimed, ..
        } => {
            assert!(!reclaimed);
            assert!(token > first);
        }
        other => panic!("{other:?}"),
    }
    // Again (a retried abandon): nothing to give back, the new claim stays.
    let (status, _, _) = api.post("/v1/abandon", &abandon("lost", "w1.1")).await;
    assert_eq!(status, 200);
    assert!(matches!(
        api.claim_with(&named("lost", "w1.4", None)).await,
        ClaimResponse::InProgress { .. }
    ));
    // A malformed nonce is refused.
    let (status, body, _) = api.post("/v1/abandon", &abandon("lost", "has space")).await;
    assert_problem(status, &body, 400, "bad-request");
    let mut bad = serde_json::to_value(named("lost2", "x", None)).unwrap();
    bad["nonce"] = json!("");
    let (status, body, _) = api.post("/v1/claim", &bad).await;
    assert_problem(status, &body, 400, "bad-request");
    api.shutdown().await;
}

#[tokio::test]
async fn a_lost_claim_marked_unknown_meanwhile_is_still_given_back() {
    let api = Api::start(&[]).await;
    token_of(&api.claim_with(&named("late", "w1.1", Some(1_000))).await);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    // Nobody heartbeated it: a claim finds its lease run out.
    assert_eq!(
        api.claim_with(&named("late", "w2.1", None)).await,
        ClaimResponse::Unknown
    );
    let (status, _, _) = api.post("/v1/abandon", &abandon("late", "w1.1")).await;
    assert_eq!(status, 200);
    assert!(matches!(
        api.claim_with(&named("late", "w2.2", None)).await,
        ClaimResponse::Claimed {
            reclaimed: false,
            ..
        }
    ));
    api.shutdown().await;
}

#[tokio::test]
async fn a_lost_take_over_leaves_the_earlier_outcome_unknown() {
    let api = Api::start(&[]).await;
    let first = token_of(&api.claim_with(&named("taken", "w1.1", None)).await);
    let (status, _, _) = api.post("/v1/unknown", &fenced_body("taken", first)).await;
    assert_eq!(status, 200);
    let take_over = ClaimRequest {
        on_unknown: OnUnknown::TakeOver,
        ..named("taken", "w2.1", None)
    };
    assert!(matches!(
        api.claim_with(&take_over).await,
        ClaimResponse::Claimed {
            reclaimed: true,
            ..
        }
    ));
    let (status, body, _) = api.post("/v1/abandon", &abandon("taken", "w2.1")).await;
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("unknown")),
        "{body}"
    );
    assert_eq!(
        api.claim_with(&named("taken", "w3.1", None)).await,
        ClaimResponse::Unknown,
        "the first attempt's outcome is still unknown"
    );
    api.shutdown().await;
}

/// The abandon overtook its claim (the claim waited behind a slow database while its filter
/// gave up): it leaves a tombstone, and the late claim attempt never commits, so the key does
/// not sit in progress for a lease and then unknown, held for nobody. Another attempt (another
/// nonce) claims the key as usual.
#[tokio::test]
async fn an_abandon_that_overtakes_its_claim_keeps_that_claim_from_committing() {
    let api = Api::start(&[]).await;
    let (status, body, _) = api.post("/v1/abandon", &abandon("early", "w5.1")).await;
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("released")),
        "{body}"
    );
    let late = serde_json::to_value(named("early", "w5.1", None)).unwrap();
    let (status, body, _) = api.post("/v1/claim", &late).await;
    assert_eq!(
        status, 503,
        "the late attempt answers as if its caller had gone: {body}"
    );
    let (status, record) = api.record("early", "alice").await;
    assert_eq!(status, 404, "nothing committed: {record}");
    assert!(matches!(
        api.claim_with(&named("early", "w5.2", None)).await,
        ClaimResponse::Claimed {
            reclaimed: false,
            ..
        }
    ));
    api.shutdown().await;
}
