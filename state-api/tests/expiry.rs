//! Issue 34, path 1: a record's expiry counts from its outcome or its owner's last sign of
//! life, never from the claim. A record in progress never becomes a new key by age alone.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use contract::wire::{ClaimRequest, ClaimResponse, OnUnknown};
use serde_json::json;
use sqlx::Row as _;
use std::time::Duration;

/// A route keeping records 1 s whose upstream works longer than that: the owner heartbeats
/// past the retention, then misses one lease (a state API or Postgres pause). The next claim
/// must find the key unknown (held), never new: a new key there is a second execution.
#[tokio::test]
async fn an_owner_still_running_past_its_retention_keeps_its_key() {
    let api = Api::start(&["--purge-interval-s", "0"]).await;
    let claim = ClaimRequest {
        retention_s: Some(1),
        ..claim_req("long-runner", "alice", &fp(1), Some(1_000))
    };
    let token = token_of(&api.claim_with(&claim).await);
    let beat = json!({"key": "long-runner", "subject": "alice", "endpoint": ENDPOINT,
                      "token": token, "lease_ms": 1_000});
    // 2.4 s of heartbeats: past the claim's expiry (claim + lease + retention = 2 s).
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, body, _) = api.post("/v1/heartbeat", &beat).await;
        assert_eq!(status, 200, "{body}");
    }
    // The purge leaves a record in progress alone, however old.
    api.state
        .store()
        .purge_expired(10, Duration::from_secs(5), 1_000)
        .await
        .unwrap();
    // One lease without a heartbeat.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let again = api.claim_with(&claim).await;
    assert_eq!(
        again,
        ClaimResponse::Unknown,
        "the running owner's key was handed out again"
    );
    // Where the route re-executes unknown outcomes, it is taken over with a larger token
    // (the lease guard passed: the database has served all along), never as a new key.
    let take_over = ClaimRequest {
        on_unknown: OnUnknown::TakeOver,
        ..claim.clone()
    };
    match api.claim_with(&take_over).await {
        ClaimResponse::Claimed {
            token: newer,
            reclaimed,
            ..
        } => {
            assert!(reclaimed, "an earlier attempt's outcome is unknown");
            assert!(newer > token);
        }
        other => panic!("{other:?}"),
    }
    api.shutdown().await;
}

/// The purge marks an in-progress record past its expiry whose owner has been silent for a
/// lease (nobody knows whether it ran) instead of deleting it; it deletes it once the unknown
/// horizon (`--unknown-retention-s`, here 2 s; never less than the retention) has passed since
/// the mark, not a mere retention later (issue 46, finding 8).
#[tokio::test]
async fn the_purge_marks_an_abandoned_claim_unknown_before_it_deletes_it() {
    let api = Api::start(&[
        "--purge-interval-s",
        "0",
        "--retention-s",
        "1",
        "--unknown-retention-s",
        "2",
    ])
    .await;
    let claim = ClaimRequest {
        retention_s: Some(1),
        ..claim_req("abandoned", "alice", &fp(2), Some(1_000))
    };
    token_of(&api.claim_with(&claim).await);
    // Past claim + lease + retention.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let store = api.state.store();
    let pass = store
        .purge_expired(10, Duration::from_secs(5), 1_000)
        .await
        .unwrap();
    assert_eq!(pass.rows, 1, "{pass:?}");
    assert_eq!(api.claim_with(&claim).await, ClaimResponse::Unknown);
    // Within the unknown horizon of the mark the unknown outcome is held, past the record's
    // retention too; after it, it goes.
    let pass = store
        .purge_expired(10, Duration::from_secs(5), 1_000)
        .await
        .unwrap();
    assert_eq!(pass.rows, 0, "{pass:?}");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let pass = store
        .purge_expired(10, Duration::from_secs(5), 1_000)
        .await
        .unwrap();
    assert_eq!(pass.rows, 0, "deleted a retention after the mark: {pass:?}");
    assert_eq!(api.claim_with(&claim).await, ClaimResponse::Unknown);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let pass = store
        .purge_expired(10, Duration::from_secs(5), 1_000)
        .await
        .unwrap();
    assert_eq!(pass.rows, 1, "{pass:?}");
    assert!(matches!(
        api.claim_with(&claim).await,
        ClaimResponse::Claimed {
            reclaimed: false,
            ..
        }
    ));
    api.shutdown().await;
}

/// The purge finds due records through the expiry index: its condition on `expires_at` is the
/// index's bound, so a batch reads what is due, not the table. With `clock_timestamp()`
/// (volatile) it was only a filter: every pass ends with a short batch, and that batch fetched
/// every record to test it (570 ms at 1 M rows, past the statement timeout at 50 M;
/// bench/NOTES.md, twenty-second round). Measured on rows not due: none may be read.
#[tokio::test]
async fn the_purge_reads_only_what_is_due_through_the_expiry_index() {
    let api = Api::start(&["--purge-interval-s", "0"]).await;
    // 40 completed records, none due (a day's retention).
    for i in 0..40 {
        let claim = claim_req(&format!("not-due-{i}"), "alice", &fp(1), None);
        let token = token_of(&api.claim_with(&claim).await);
        let (status, body, _) = api
            .post(
                contract::wire::COMPLETE_PATH,
                &complete_body(&format!("not-due-{i}"), token, &ok_response()),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let mut conn = api.state.store().pool().acquire().await.unwrap();
    sqlx::raw_sql(&format!(
        "PREPARE purge_batch(bigint, bigint, bigint) AS {}",
        state_api::store::PURGE_BATCH_SQL
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    let plan: Vec<String> =
        sqlx::raw_sql("EXPLAIN (ANALYZE, COSTS OFF) EXECUTE purge_batch(500, 1000, 2000)")
            .fetch_all(&mut *conn)
            .await
            .unwrap()
            .iter()
            .map(|row| row.get::<String, _>(0))
            .collect();
    let plan = plan.join("\n");
    // The pool's close waits for every connection to come back.
    drop(conn);
    assert!(
        plan.contains("Index Cond: (expires_at < statement_timestamp())"),
        "the expiry is not the index's bound:\n{plan}"
    );
    assert!(
        !plan.contains("Rows Removed by Filter"),
        "the purge read records that are not due:\n{plan}"
    );
    api.shutdown().await;
}

/// The nonces' rows (issue 46, finding 2: every claim of a new key writes one) are purged ten
/// minutes after they were noted, in batches found through the index on `noted_at`: rows not
/// due are not read.
#[tokio::test]
async fn the_nonces_rows_are_purged_through_their_index_after_ten_minutes() {
    let api = Api::start(&["--purge-interval-s", "0"]).await;
    let pool = api.state.store().pool().clone();
    for i in 0..40 {
        let claim = ClaimRequest {
            nonce: Some(format!("w1.{i}")),
            ..claim_req(&format!("nonce-{i}"), "alice", &fp(1), None)
        };
        token_of(&api.claim_with(&claim).await);
    }
    // Three of them noted eleven minutes ago.
    sqlx::query(
        "UPDATE idempotency_nonces SET noted_at = clock_timestamp() - interval '11 minutes'
         WHERE nonce IN ('w1.0', 'w1.1', 'w1.2')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let kinds: Vec<String> = sqlx::query_scalar("SELECT DISTINCT kind FROM idempotency_nonces")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(kinds, ["claimed"]);
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(&format!(
        "PREPARE purge_nonces(bigint) AS {}",
        state_api::store::PURGE_NONCES_SQL
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    let plan: Vec<String> = sqlx::raw_sql("EXPLAIN (ANALYZE, COSTS OFF) EXECUTE purge_nonces(2)")
        .fetch_all(&mut *conn)
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<String, _>(0))
        .collect();
    let plan = plan.join("\n");
    drop(conn);
    assert!(
        plan.contains("idempotency_nonces_noted_at")
            && plan.contains(
                "Index Cond: (noted_at < (statement_timestamp() - '00:10:00'::interval))"
            ),
        "the purge of nonces does not use their index:\n{plan}"
    );
    assert!(
        !plan.contains("Rows Removed by Filter"),
        "the purge read nonces that are not due:\n{plan}"
    );
    // An abandon's row is kept an hour (the claim it stops may arrive that late): one noted
    // eleven minutes ago stays, one noted sixty-one minutes ago goes.
    sqlx::query(
        "INSERT INTO idempotency_nonces (nonce, scope_hash, kind, noted_at) VALUES
         ('gone.recent', '\\x00'::bytea, 'abandoned', clock_timestamp() - interval '11 minutes'),
         ('gone.old', '\\x00'::bytea, 'abandoned', clock_timestamp() - interval '61 minutes')",
    )
    .execute(&pool)
    .await
    .unwrap();
    // (EXPLAIN ANALYZE ran it: two went.) The pass takes the rest and leaves the recent ones.
    api.state
        .store()
        .purge_expired(500, Duration::from_secs(2), 1_000)
        .await
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_nonces")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 38);
    let kept: Vec<String> =
        sqlx::query_scalar("SELECT nonce FROM idempotency_nonces WHERE kind = 'abandoned'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(kept, ["gone.recent"]);
    api.shutdown().await;
}
