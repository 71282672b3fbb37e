//! Rotating the key secret (the HMAC that addresses records): with `--previous-key-secret`,
//! records written under the old secret are still found (replayed, completed by their owner,
//! compared for a changed body), new records use the new secret, and once the old secret is
//! dropped its records are no longer found.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use clap::Parser as _;
use common::*;
use contract::wire::{ClaimResponse, COMPLETE_PATH};

const OLD: &str = "old-key-secret-0123456789";
const NEW: &str = "new-key-secret-9876543210";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_secret_finds_the_previous_records_and_writes_new_ones_with_the_new() {
    let cluster = test_support::postgres::shared().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster.fresh_database("rotation").unwrap();

    let before = Api::start_on(&db, &["--key-secret", OLD]).await;
    let done = token_of(&before.claim("done", &fp(1), None).await);
    let (status, body, _) = before
        .post(COMPLETE_PATH, &complete_body("done", done, &ok_response()))
        .await;
    assert_eq!(status, 200, "{body}");
    let running = token_of(&before.claim("running", &fp(1), Some(60_000)).await);
    let beating = token_of(&before.claim("beating", &fp(1), Some(60_000)).await);
    before.shutdown().await;

    let rotating = Api::start_on(&db, &["--key-secret", NEW, "--previous-key-secret", OLD]).await;
    assert!(matches!(
        rotating.claim("done", &fp(1), None).await,
        ClaimResponse::Completed { .. }
    ));
    assert!(matches!(
        rotating.claim("done", &fp(2), None).await,
        ClaimResponse::Mismatch
    ));
    assert!(matches!(
        rotating.claim("running", &fp(1), None).await,
        ClaimResponse::InProgress { .. }
    ));
    // The owner of the record made before the rotation stores its outcome through it.
    let (status, body, _) = rotating
        .post(
            COMPLETE_PATH,
            &complete_body("running", running, &ok_response()),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(matches!(
        rotating.claim("running", &fp(1), None).await,
        ClaimResponse::Completed { .. }
    ));
    let fresh = token_of(&rotating.claim("fresh", &fp(1), None).await);
    let (status, _, _) = rotating
        .post(
            COMPLETE_PATH,
            &complete_body("fresh", fresh, &ok_response()),
        )
        .await;
    assert_eq!(status, 200);
    // A live record written again (a heartbeat) moves to the new secret's address (issue 34,
    // path 9), so that dropping the previous secret later orphans no live record.
    let (status, body, _) = rotating
        .post(
            "/v1/heartbeat",
            &serde_json::json!({"key": "beating", "subject": "alice", "endpoint": ENDPOINT,
                                "token": beating, "lease_ms": 60_000}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let moved = rotating.state.scoper().hash("beating", "alice", ENDPOINT);
    assert!(rotating.state.store().exists(&moved).await.unwrap());
    // A retry meanwhile re-keys its fingerprint under the new secret's key (path 12): the
    // record still matches once the previous secret is dropped.
    assert!(matches!(
        rotating.claim("beating", &fp(1), None).await,
        ClaimResponse::InProgress { .. }
    ));
    // Owners' writes look the record up under the previous secret (claims look under both in
    // their own statement, uncounted).
    let hits = metric(
        &rotating.metrics().await,
        "state_api_previous_key_secret_hits_total",
    );
    assert!(hits >= 2.0, "{hits}");
    // Nothing was copied: the old records stay where they were, the new one is at its new address.
    let new_scope = rotating.state.scoper().hash("fresh", "alice", ENDPOINT);
    assert!(rotating.state.store().exists(&new_scope).await.unwrap());
    rotating.shutdown().await;

    // The rotation is over: records of the old secret are not found any more (keep the
    // previous secret for the longest retention after a rotation).
    let after = Api::start_on(&db, &["--key-secret", NEW]).await;
    assert!(matches!(
        after.claim("fresh", &fp(1), None).await,
        ClaimResponse::Completed { .. }
    ));
    assert!(matches!(
        after.claim("done", &fp(1), None).await,
        ClaimResponse::Claimed { .. }
    ));
    assert!(
        matches!(
            after.claim("beating", &fp(1), None).await,
            ClaimResponse::InProgress { .. }
        ),
        "the moved record outlives the previous secret"
    );
    // Completed during the rotation: moved as it was completed, replayed after it.
    assert!(
        matches!(
            after.claim("running", &fp(1), None).await,
            ClaimResponse::Completed { .. }
        ),
        "a record completed under the previous secret was left behind: a new key"
    );
    after.shutdown().await;
}

#[test]
fn the_previous_secret_must_differ_and_be_long_enough() {
    let parse = |args: &[&str]| {
        let mut all = vec![
            "state-api",
            "--database-url",
            "postgres://x@127.0.0.1/x",
            "--api-token",
            TOKEN,
            "--key-secret",
            NEW,
        ];
        all.extend_from_slice(args);
        state_api::Config::try_parse_from(all).unwrap()
    };
    assert!(parse(&["--previous-key-secret", NEW]).validate().is_err());
    assert!(parse(&["--previous-key-secret", "short"])
        .validate()
        .is_err());
    assert!(parse(&["--previous-key-secret", OLD]).validate().is_ok());
}

/// Issue 34, path 9: the lookup under the previous secret and the claim are one statement, and
/// claims only ever insert under the current secret: a record under the previous secret is
/// found (and taken over there, moving it), and once it is gone a claim inserts under the new
/// address only, so no two records of one key can live under the two secrets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_statement_looks_under_both_secrets_and_inserts_under_the_current_only() {
    let cluster = test_support::postgres::shared().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster.fresh_database("rotation_race").unwrap();
    let before = Api::start_on(&db, &["--key-secret", OLD]).await;
    let old = token_of(&before.claim("k", &fp(1), Some(1_000)).await);
    before.shutdown().await;
    let rotating = Api::start_on(&db, &["--key-secret", NEW, "--previous-key-secret", OLD]).await;
    let old_scope = state_api::scope::Scoper::new(OLD.as_bytes())
        .unwrap()
        .hash("k", "alice", ENDPOINT);
    let new_scope = rotating.state.scoper().hash("k", "alice", ENDPOINT);
    // Its owner marked it unknown; a take-over finds it under the previous secret and moves it.
    let (status, body, _) = rotating.post("/v1/unknown", &fenced_body("k", old)).await;
    assert_eq!(status, 200, "{body}");
    let take_over = contract::wire::ClaimRequest {
        on_unknown: contract::wire::OnUnknown::TakeOver,
        ..claim_req("k", "alice", &fp(1), Some(60_000))
    };
    match rotating.claim_with(&take_over).await {
        ClaimResponse::Claimed {
            reclaimed, token, ..
        } => {
            assert!(reclaimed);
            assert!(token > old);
        }
        other => panic!("{other:?}"),
    }
    let store = rotating.state.store();
    assert!(
        store.exists(&new_scope).await.unwrap(),
        "moved to the new secret"
    );
    assert!(!store.exists(&old_scope).await.unwrap());
    // A second claim sees the one record, wherever its statement looks.
    assert!(matches!(
        rotating.claim("k", &fp(1), None).await,
        ClaimResponse::InProgress { .. }
    ));
    let count: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE scope_hash IN ($1, $2)")
            .bind(&old_scope[..])
            .bind(&new_scope[..])
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(count, 1);
    rotating.shutdown().await;
}
