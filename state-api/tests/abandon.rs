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

// ---------------------------------------------------------------------------------------------
// Issue 46, finding 2: an abandon and its claim in flight must not both commit. The claim read
// the tombstone in its statement's snapshot, and the abandon could not see the claim's
// uncommitted insert: a record in progress under a nonce nobody owns, beside a tombstone that
// protects nothing. They now conflict on one row per nonce (`idempotency_nonces`).

/// An uncommitted insert of the key's record in another transaction: a claim's INSERT of the
/// key waits for it (its statement's snapshot already taken), until `rollback`.
async fn hold_the_key(api: &Api, key: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let pool = api.state.store().pool().clone();
    // The key's address: a record made and taken away again, its row kept aside.
    token_of(
        &api.claim_with(&named(key, &format!("{key}.setup"), None))
            .await,
    );
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS held_rows AS SELECT * FROM idempotency_records WITH NO DATA",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "WITH gone AS (DELETE FROM idempotency_records WHERE claim_nonce = $1 RETURNING *)
         INSERT INTO held_rows SELECT * FROM gone",
    )
    .bind(format!("{key}.setup"))
    .execute(&pool)
    .await
    .unwrap();
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO idempotency_records SELECT * FROM held_rows WHERE claim_nonce = $1")
        .bind(format!("{key}.setup"))
        .execute(&mut *blocker)
        .await
        .unwrap();
    blocker
}

/// Neither a record open under `nonce` beside its abandon, nor the key held: the abandon and
/// its claim did not both commit.
async fn not_both(api: &Api, key: &str, nonce: &str) {
    let pool = api.state.store().pool();
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_records
         WHERE claim_nonce = $1 AND state IN ('in_progress', 'unknown')",
    )
    .bind(nonce)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        open, 0,
        "a record in progress under the abandoned nonce {nonce}: held for nobody"
    );
    assert!(
        matches!(
            api.claim_with(&named(key, &format!("{nonce}.next"), None))
                .await,
            ClaimResponse::Claimed {
                reclaimed: false,
                ..
            }
        ),
        "the key is free after the abandon"
    );
}

/// The claim's statement is under way (its INSERT waits behind another transaction) when its
/// abandon arrives; the claim commits after. The abandon waits for the claim's nonce row, then
/// gives the record back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandon_during_its_claim_s_statement_gives_the_record_back() {
    let api = Api::start(&[]).await;
    let blocker = hold_the_key(&api, "inflight").await;
    let claim = api.spawn_claim_raw(&named("inflight", "w7.1", None));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!claim.is_finished(), "the claim waits behind the blocker");
    let abandon = api.spawn_post("/v1/abandon", abandon("inflight", "w7.1"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    blocker.rollback().await.unwrap();
    let answer = abandon.await.unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    let claimed = claim.await.unwrap();
    // Committed before the abandon took its nonce: granted (its filter no longer listens).
    assert_eq!(claimed.status, 200, "{}", claimed.body);
    not_both(&api, "inflight", "w7.1").await;
    api.shutdown().await;
}

/// The abandon's transaction has taken the nonce (uncommitted) when the claim's statement
/// starts: the claim waits for it, and once it commits, writes nothing (503, as for a caller
/// gone). Through a batch statement too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_during_its_abandon_s_transaction_writes_nothing() {
    let api = Api::start(&[]).await;
    let pool = api.state.store().pool().clone();
    // What the abandon's first statement writes, held uncommitted.
    let hold = async |nonce: &str| {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO idempotency_nonces AS n (nonce, scope_hash, kind)
             VALUES ($1, '\\x00'::bytea, 'abandoned')
             ON CONFLICT (nonce) DO UPDATE SET kind = 'abandoned'",
        )
        .bind(nonce)
        .execute(&mut *tx)
        .await
        .unwrap();
        tx
    };
    // Alone.
    let abandoning = hold("w8.1").await;
    let claim = api.spawn_claim_raw(&named("racing", "w8.1", None));
    tokio::time::sleep(Duration::from_millis(300)).await;
    abandoning.commit().await.unwrap();
    let answer = claim.await.unwrap();
    assert_eq!(answer.status, 503, "{}", answer.body);
    let (status, record) = api.record("racing", "alice").await;
    assert_eq!(status, 404, "nothing committed: {record}");
    not_both(&api, "racing", "w8.1").await;
    // In a group commit's statement, beside a claim that goes through.
    let abandoning = hold("w8.2").await;
    let claims = json!({"claims": [named("batched", "w8.2", None), named("beside", "w8.3", None)]});
    let batch = api.spawn_post("/v1/claims", claims);
    tokio::time::sleep(Duration::from_millis(300)).await;
    abandoning.commit().await.unwrap();
    let RawAnswer { status, body, .. } = batch.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["answers"][0]["status"], 503, "{body}");
    assert_eq!(body["answers"][1]["status"], 200, "{body}");
    let (status, record) = api.record("batched", "alice").await;
    assert_eq!(status, 404, "nothing committed: {record}");
    not_both(&api, "batched", "w8.2").await;
    api.shutdown().await;
}
