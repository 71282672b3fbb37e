//! The state API through a Postgres crash: it answers 503 quickly while the database is
//! down, recovers without a restart, and the claims it acknowledged survived the crash.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use contract::wire::{ClaimResponse, CLAIM_PATH};
use stack::postgres::TempCluster;

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

    cluster.kill_postmaster().unwrap();
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
