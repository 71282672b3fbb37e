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
    let cluster = edge::postgres::shared().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster.fresh_database("rotation").unwrap();

    let before = Api::start_on(&db, &["--key-secret", OLD]).await;
    let done = token_of(&before.claim("done", &fp(1), None).await);
    let (status, body, _) = before
        .post(COMPLETE_PATH, &complete_body("done", done, &ok_response()))
        .await;
    assert_eq!(status, 200, "{body}");
    let running = token_of(&before.claim("running", &fp(1), Some(60_000)).await);
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
    let hits = metric(
        &rotating.metrics().await,
        "state_api_previous_key_secret_hits_total",
    );
    assert!(hits >= 5.0, "{hits}");
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
