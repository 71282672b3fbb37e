//! Races: many claims of one key at once. In its own test binary so that the timing it
//! observes is not disturbed by the other API tests running in parallel.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use contract::wire::{ClaimResponse, CLAIM_PATH, COMPLETE_PATH};
use serde_json::json;
use sqlx::Connection as _;
use state_api::store::NewClaim;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundred_concurrent_claims_give_one_owner_and_duplicates_never_wait_on_a_lock() {
    let api = Api::start(&[]).await;
    let key = "race-100";
    // Warm the connection pool and the HTTP clients so the measurement is about the claim.
    // (concurrently, so that all 16 pooled connections exist and have prepared the statements)
    for round in 0..3 {
        let warm: Vec<_> = (0..32)
            .map(|i| {
                let (client, url) = (api.client.clone(), api.url(CLAIM_PATH));
                let body = serde_json::to_value(claim_req(
                    &format!("warm-{round}-{i}"),
                    "alice",
                    &fp(1),
                    None,
                ))
                .unwrap();
                tokio::spawn(async move {
                    client
                        .post(url)
                        .bearer_auth(TOKEN)
                        .json(&body)
                        .send()
                        .await
                        .unwrap()
                })
            })
            .collect();
        for w in warm {
            assert_eq!(w.await.unwrap().status(), 200);
        }
    }
    // The claims above share few statements (group commit), so warm every pooled connection
    // with the single-row claim too: the duplicates below run it.
    let warm: Vec<_> = (0..32)
        .map(|i| {
            let store = api.state.store().clone();
            let scope = api
                .state
                .scoper()
                .hash(&format!("warm-single-{i}"), "alice", ENDPOINT);
            tokio::spawn(async move {
                let fingerprint = state_rules::fingerprint::Keyed::new(ALG, &fp(1), b"race", None);
                let claim = NewClaim {
                    scope,
                    subject: "alice",
                    endpoint: ENDPOINT,
                    fingerprint_alg: ALG,
                    fingerprint: &fingerprint,
                    lease_ms: 60_000,
                    retention_ms: 60_000,
                    take_over_unknown: false,
                    namespace: "",
                    nonce: None,
                    previous: None,
                };
                store.claim(&claim).await.unwrap()
            })
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }
    // ... and open the 100 HTTP connections beforehand.
    let warm: Vec<_> = (0..100)
        .map(|_| {
            let (client, url) = (api.client.clone(), api.url("/healthz"));
            tokio::spawn(
                async move { client.get(url).send().await.unwrap().bytes().await.unwrap() },
            )
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }

    let mut tasks = Vec::new();
    for _ in 0..100 {
        tasks.push(api.spawn_claim(&claim_req(key, "alice", &fp(1), Some(60_000))));
    }
    let mut claimed = Vec::new();
    let mut in_progress = Vec::new();
    for t in tasks {
        let (answer, took) = t.await.unwrap();
        match answer {
            ClaimResponse::Claimed {
                token, reclaimed, ..
            } => {
                assert!(!reclaimed);
                claimed.push(token);
            }
            ClaimResponse::InProgress {
                retry_after_s,
                lease_remaining_ms,
                waited_ms: None,
            } => {
                // The winner never completes in this test: these answers did not wait for it.
                assert!(
                    (1..=2).contains(&retry_after_s),
                    "retry_after_s {retry_after_s}"
                );
                assert!(lease_remaining_ms > 50_000 && lease_remaining_ms <= 60_000);
                in_progress.push(took);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(claimed.len(), 1, "exactly one owner");
    assert_eq!(in_progress.len(), 99);
    in_progress.sort();
    let p50 = in_progress[49];
    let p99 = in_progress[98];
    // For the reader only: how long an answer takes depends on the machine, so the proof that
    // duplicates do not wait is the locked row below, not a time.
    eprintln!("100 concurrent claims: duplicates answered p50 {p50:?}, p99 {p99:?}");

    // The claim is committed: a second connection sees it while the owner has not completed.
    let mut conn = sqlx::PgConnection::connect(&api.db_url).await.unwrap();
    let scope = api.state.scoper().hash(key, "alice", ENDPOINT);

    // Duplicates never wait on a lock: while another transaction holds the owner's row
    // (`FOR UPDATE`, as an operator's action or a complete does), every duplicate is still answered
    // `in_progress`. Had a claim waited on that row it could not answer before the lock is
    // released, which happens only after all the answers are in (or fail by lock_timeout).
    let mut holder = sqlx::PgConnection::connect(&api.db_url).await.unwrap();
    let mut held = sqlx::Connection::begin(&mut holder).await.unwrap();
    let locked: i64 = sqlx::query_scalar(
        "SELECT fencing_token FROM idempotency_records WHERE scope_hash = $1 FOR UPDATE",
    )
    .bind(&scope[..])
    .fetch_one(&mut *held)
    .await
    .unwrap();
    assert_eq!(locked, claimed[0]);
    let tasks: Vec<_> = (0..20)
        .map(|_| api.spawn_claim(&claim_req(key, "alice", &fp(1), Some(60_000))))
        .collect();
    for t in tasks {
        let (answer, _) = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("a duplicate waited for the locked row")
            .unwrap();
        assert!(
            matches!(
                answer,
                ClaimResponse::InProgress {
                    waited_ms: None,
                    ..
                }
            ),
            "{answer:?}"
        );
    }
    held.rollback().await.unwrap();
    let (state, token): (String, i64) = sqlx::query_as(
        "SELECT state, fencing_token FROM idempotency_records WHERE scope_hash = $1",
    )
    .bind(&scope[..])
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((state.as_str(), token), ("in_progress", claimed[0]));
    // The raw key is nowhere in the row.
    let raw: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_records WHERE position($1::bytea in convert_to(row(idempotency_records.*)::text, 'UTF8')) > 0",
    )
    .bind(key.as_bytes())
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(raw, 0);

    // After completion every duplicate gets the stored response.
    let (status, body, _) = api
        .post(
            COMPLETE_PATH,
            &complete_body(key, claimed[0], &ok_response()),
        )
        .await;
    assert_eq!((status, &body["state"]), (200, &json!("completed")));
    assert!(
        matches!(api.claim(key, &fp(1), None).await, ClaimResponse::Completed { response, expires_in_ms: Some(_), .. } if response == ok_response())
    );

    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_claims_total{outcome=\"in_progress\"}"),
        119.0
    );
    assert_eq!(
        metric(&m, "state_api_claims_total{outcome=\"completed\"}"),
        1.0
    );
    assert!(
        metric(
            &m,
            "state_api_request_duration_seconds_count{route=\"claim\"}"
        ) >= 137.0
    );

    // For comparison, the same burst on the completed key (replays: no lock could be involved).
    let mut replays = Vec::new();
    let tasks: Vec<_> = (0..99)
        .map(|_| api.spawn_claim(&claim_req(key, "alice", &fp(1), None)))
        .collect();
    for t in tasks {
        let (answer, took) = t.await.unwrap();
        assert!(
            matches!(answer, ClaimResponse::Completed { .. }),
            "{answer:?}"
        );
        replays.push(took);
    }
    replays.sort();
    eprintln!(
        "for comparison, 99 concurrent replays of the completed key: p50 {:?}, p99 {:?}",
        replays[49], replays[98]
    );
    api.shutdown().await;
}
