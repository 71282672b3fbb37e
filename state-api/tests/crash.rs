//! The state API through a Postgres crash: it answers 503 quickly while the database is
//! down, recovers without a restart, and the claims it acknowledged survived the crash.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use contract::wire::{ClaimRequest, ClaimResponse, OnUnknown, CLAIM_PATH};
use test_support::postgres::TempCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_503_while_postgres_is_down_and_recovers_by_itself() {
    crash_and_recover(&[]).await;
}

/// Without the ping before use, stale connections fail once each, then the pool heals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovers_without_the_pool_ping_too() {
    crash_and_recover(&["--pool-ping", "false"]).await;
}

async fn crash_and_recover(extra: &[&str]) {
    // Its own cluster, whatever DATABASE_URL says: this test kills it.
    let mut cluster = TempCluster::start_private().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster
        .create_database("crash")
        .unwrap_or_else(|e| panic!("{e}"));
    let mut args = vec!["--acquire-timeout-ms", "500"];
    args.extend_from_slice(extra);
    let api = Api::start_on(&db, &args).await;

    let token = token_of(&api.claim("survivor", &fp(1), Some(600_000)).await);

    cluster.kill_server().unwrap();
    let start = Instant::now();
    let body = serde_json::to_value(claim_req("during", "alice", &fp(1), None)).unwrap();
    let (status, problem, headers) = api.post(CLAIM_PATH, &body).await;
    let took = start.elapsed();
    assert_eq!(status, 503, "{problem}");
    assert_eq!(problem["type"], "/problems/idempotency-state-unavailable");
    assert_eq!(headers["retry-after"], "1");
    assert!(took < Duration::from_secs(3), "503 took {took:?}");
    let ready = api.client.get(api.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);

    cluster.restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, _, _) = api.post(CLAIM_PATH, &body).await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        assert!(Instant::now() < deadline, "the API did not recover");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        api.client
            .get(api.url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    // The acknowledged claim was durable: it is still owned by its token.
    assert!(matches!(
        api.claim("survivor", &fp(1), None).await,
        ClaimResponse::InProgress { .. }
    ));
    let (_, view) = api.record("survivor", "alice").await;
    assert_eq!(view["token"], token);
    let m = api.metrics().await;
    assert!(metric(&m, "state_api_errors_total{kind=\"unavailable\"}") >= 1.0);
    api.shutdown().await;
}

/// The lease guard counts from when this primary's timeline was first seen, not from the
/// postmaster's start: a promoted standby's postmaster may have started long before it became
/// the primary. A new timeline (what a promotion makes) is simulated here by removing the row
/// of the current one; `tests/tests/ha.rs` runs the real failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_runs_out_only_a_whole_lease_after_the_primary_s_timeline_was_first_seen() {
    let api = Api::start(&[]).await;
    let pool = api.state.store().pool().clone();
    // "Promoted": the current timeline is first seen now (as the state API records it on every
    // new connection), long after the postmaster started: still a whole lease to go.
    let (stale, take_over) = held_after_serving_anew(
        &api,
        "promoted",
        "UPDATE idempotency_timelines SET first_seen_at = clock_timestamp()",
    )
    .await;
    // A timeline nobody has seen yet counts as beginning now (one transaction, one connection).
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("DELETE FROM idempotency_timelines")
        .execute(&mut *tx)
        .await
        .unwrap();
    let unseen_is_now: bool = sqlx::query_scalar("SELECT idempotency_serving_since() >= now()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert!(unseen_is_now);
    // ... and the guard recorded it, for the next check (a pool connection opened to this server
    // while it was a standby recorded nothing).
    let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_timelines")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(recorded, 1);
    tx.rollback().await.unwrap();
    // Once the owner has had a whole lease on this primary without a heartbeat, it has gone.
    reclaimed_a_lease_later(&api, &take_over, stale).await;
    // A new connection records the timeline by itself.
    sqlx::query("DELETE FROM idempotency_timelines")
        .execute(&pool)
        .await
        .unwrap();
    let fresh = state_api::store::pool(
        &api.db_url,
        &state_api::store::PoolSettings {
            max_connections: 1,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout_ms: 5_000,
            ping_when_idle: None,
        },
    )
    .unwrap();
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_timelines")
        .fetch_one(&fresh)
        .await
        .unwrap();
    assert_eq!(seen, 1);

    let ready = api.client.get(api.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let text = ready.text().await.unwrap();
    assert!(
        text.starts_with("ready: database primary, timeline ") && text.contains("no standby"),
        "{text}"
    );
    api.shutdown().await;
}

/// The lease guard counts from the last crash recovery in place too, which changes neither the
/// postmaster's start nor the timeline: the recovery empties the unlogged marker (simulated
/// here by emptying it; `tests/tests/second_execution.rs` runs the real crash recovery), and the
/// first check after it counts as the moment the server began serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_runs_out_only_a_whole_lease_after_a_crash_recovery_in_place() {
    let api = Api::start(&[]).await;
    let pool = api.state.store().pool().clone();
    // "Recovered in place": the unlogged marker is empty, as crash recovery leaves it.
    let (stale, take_over) =
        held_after_serving_anew(&api, "recovered", "DELETE FROM idempotency_serving_marker").await;
    let marked: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_serving_marker")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(marked, 1, "the first check after the recovery marks it");
    let unlogged: String = sqlx::query_scalar(
        "SELECT relpersistence::text FROM pg_class WHERE relname = 'idempotency_serving_marker'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        unlogged, "u",
        "crash recovery empties only an unlogged table"
    );
    // A whole lease after that check without a heartbeat, the owner has gone.
    reclaimed_a_lease_later(&api, &take_over, stale).await;
    api.shutdown().await;
}

/// A record of `key` whose 1 s lease ran out 0.2 s ago, then `sql` makes the server look as if
/// it began serving now (a promotion, a crash recovery): a claim that takes unknown outcomes
/// over still finds the key in progress. Its owner's token and that claim.
async fn held_after_serving_anew(api: &Api, key: &str, sql: &str) -> (i64, ClaimRequest) {
    let take_over = ClaimRequest {
        on_unknown: OnUnknown::TakeOver,
        ..claim_req(key, "alice", &fp(1), Some(60_000))
    };
    let stale = token_of(&api.claim(key, &fp(1), Some(1_000)).await);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    sqlx::query(sql)
        .execute(api.state.store().pool())
        .await
        .unwrap();
    assert!(
        matches!(
            api.claim_with(&take_over).await,
            ClaimResponse::InProgress { .. }
        ),
        "a lease ran out less than a lease after the server began serving anew ({sql})"
    );
    (stale, take_over)
}

/// Once the owner has had a whole lease more without a heartbeat, it has gone: the take-over
/// reclaims the key with a larger token.
async fn reclaimed_a_lease_later(api: &Api, take_over: &ClaimRequest, stale: i64) {
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    match api.claim_with(take_over).await {
        ClaimResponse::Claimed {
            token,
            reclaimed: true,
            ..
        } => assert!(token > stale),
        other => panic!("expected a reclaim a whole lease later, got {other:?}"),
    }
}

/// Issue 34, path 2, without a crash: a database frozen (SIGSTOP: a paused VM, a storage stall)
/// for longer than a lease keeps its start, its timeline and its crash marker, so every lease
/// that ran out meanwhile counted as run out the moment it answered again. The state APIs' pulse
/// was silent all the while: the database counts as just come back, and an owner gets a whole
/// lease to be heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_runs_out_only_a_whole_lease_after_the_database_was_frozen() {
    use test_support::process::Signal;
    let mut cluster = test_support::postgres::TempCluster::start_private().unwrap();
    let url = cluster.fresh_database("frozen").unwrap();
    let api = Api::start_on(&url, &[]).await;
    // Serving (and beating) for longer than a lease.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let take_over = ClaimRequest {
        on_unknown: OnUnknown::TakeOver,
        ..claim_req("frozen", "alice", &fp(1), Some(60_000))
    };
    let stale = token_of(&api.claim("frozen", &fp(1), Some(1_000)).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.signal_all(Signal::STOP).unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    cluster.signal_all(Signal::CONT).unwrap();
    // The owner's lease ran out during the freeze, when nobody could be heard.
    assert!(
        matches!(
            api.claim_with(&take_over).await,
            ClaimResponse::InProgress { .. }
        ),
        "a lease that ran out while the database was frozen counted at once"
    );
    reclaimed_a_lease_later(&api, &take_over, stale).await;
    api.shutdown().await;
}
