//! Issue 46, finding 1: a waiting claim (`Prefer: wait`) whose look commits a claim but loses
//! its answer (the stall limit gives the connection up while the statement still commits) must
//! not wait on: it would wait on its own record, answer `in_progress` at its deadline, and the
//! key would be held for nobody (then `unknown` for its retention). It ends the wait with 503,
//! and the filter gives the claim back by its nonce (`/v1/abandon`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use contract::wire::{ClaimRequest, ClaimResponse};
use serde_json::json;

fn named(key: &str, nonce: &str, wait_ms: Option<u64>) -> ClaimRequest {
    ClaimRequest {
        nonce: Some(nonce.into()),
        wait_ms,
        ..claim_req(key, "alice", &fp(1), Some(60_000))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_claim_whose_look_may_have_committed_ends_its_wait_with_503() {
    // The stall limit at its lowest; no poll within the test: the waiter looks only when woken.
    let api = Api::start(&["--db-stall-ms", "100", "--wait-poll-ms", "60000"]).await;
    let pool = api.state.store().pool().clone();
    token_of(&api.claim_with(&named("waited", "owner.1", None)).await);
    let waiter = api.spawn_claim_raw(&named("waited", "waiter.1", Some(5_000)));
    // The waiter has its first answer (in progress) and waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished());

    // The owner's record goes without waking the waiter (no write of this process), and
    // another transaction holds an uncommitted insert of the same key: the waiter's next look
    // sees no record, and its INSERT waits for that transaction, past the stall limit.
    sqlx::query("CREATE TABLE held_row AS SELECT * FROM idempotency_records")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM idempotency_records")
        .execute(&pool)
        .await
        .unwrap();
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO idempotency_records SELECT * FROM held_row")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let scope: Vec<u8> = sqlx::query_scalar("SELECT scope_hash FROM held_row")
        .fetch_one(&pool)
        .await
        .unwrap();
    api.state.waiters().settled(&scope.try_into().unwrap());
    // The look stalls (100 ms) and its connection is given up; its statement still waits in
    // Postgres, and commits once the blocker rolls back.
    tokio::time::sleep(Duration::from_millis(600)).await;
    blocker.rollback().await.unwrap();
    let mut committed = false;
    for _ in 0..50 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_records WHERE claim_nonce = 'waiter.1'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if n == 1 {
            committed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        committed,
        "the look's claim committed after its connection was given up"
    );

    let answer = waiter.await.unwrap();
    assert_eq!(
        answer.status, 503,
        "a look that may have committed ends the wait (the filter gives the claim back by its \
         nonce), not in progress at the deadline on its own record: {} after {:?}",
        answer.body, answer.took
    );
    assert!(answer.took < Duration::from_secs(4), "{:?}", answer.took);
    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_waits_total{end=\"failed\"}"),
        1.0,
        "{m}"
    );
    // What the filter does on that 503: the claim given back by its nonce, the key free.
    let (status, body, _) = api
        .post(
            "/v1/abandon",
            &json!({"key": "waited", "subject": "alice", "endpoint": ENDPOINT, "nonce": "waiter.1"}),
        )
        .await;
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("released")),
        "{body}"
    );
    assert!(matches!(
        api.claim_with(&named("waited", "waiter.2", None)).await,
        ClaimResponse::Claimed {
            reclaimed: false,
            ..
        }
    ));
    api.shutdown().await;
}

/// A look that certainly wrote nothing (the group commit's queue full, the pool busy past its
/// acquire timeout) does not end the wait: the waiter looks again and gets the outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_that_never_reached_the_database_lets_the_claim_wait_on() {
    let api = Api::start(&[
        "--wait-poll-ms",
        "200",
        "--pool-size",
        "1",
        "--acquire-timeout-ms",
        "100",
    ])
    .await;
    let pool = api.state.store().pool().clone();
    let owner = token_of(&api.claim_with(&named("busy", "owner.1", None)).await);
    let waiter = api.spawn_claim_raw(&named("busy", "waiter.1", Some(5_000)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The store's one connection held by a slow statement: the waiter's looks time out on the
    // acquire (nothing sent), a few times over.
    let store = api.state.store().clone();
    let scope: Vec<u8> = sqlx::query_scalar("SELECT scope_hash FROM idempotency_records")
        .fetch_one(&pool)
        .await
        .unwrap();
    let scope: [u8; 32] = scope.try_into().unwrap();
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_records FOR UPDATE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let hog = tokio::spawn(async move {
        // A heartbeat behind the row lock: it holds the store's connection meanwhile.
        store
            .heartbeat(&scope, &scope, owner, 60_000, 60_000)
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    lock.rollback().await.unwrap();
    hog.await.unwrap();
    // The owner completes; the waiter gets the replay.
    let (s, b, _) = api
        .post(
            contract::wire::COMPLETE_PATH,
            &complete_body("busy", owner, &ok_response()),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let answer = waiter.await.unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body["outcome"], "completed", "{}", answer.body);
    api.shutdown().await;
}
