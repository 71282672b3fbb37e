//! Issue 34, path 12: a request's fingerprint is stored keyed (HMAC under a key derived from
//! the key secret), never as its plain SHA-256: where few bodies are possible, a copy of the
//! table would confirm a guess. Records stored plain before keep matching, and are re-keyed
//! when a claim reads them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use contract::wire::ClaimResponse;

async fn stored(api: &Api, key: &str) -> (String, Option<i64>) {
    let scope = api.state.scoper().hash(key, "alice", ENDPOINT);
    sqlx::query_as(
        "SELECT fingerprint, fingerprint_key_id FROM idempotency_records WHERE scope_hash = $1",
    )
    .bind(&scope[..])
    .fetch_one(api.state.store().pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_fingerprint_is_stored_keyed_and_a_plain_one_from_before_still_matches() {
    let api = Api::start(&[]).await;
    token_of(&api.claim("keyed", &fp(1), Some(60_000)).await);
    let (value, key_id) = stored(&api, "keyed").await;
    assert_ne!(value, fp(1), "the plain SHA-256 is in the table");
    assert_eq!(value.len(), 64);
    assert!(key_id.is_some());
    assert!(matches!(
        api.claim("keyed", &fp(1), None).await,
        ClaimResponse::InProgress { .. }
    ));
    assert_eq!(
        api.claim("keyed", &fp(2), None).await,
        ClaimResponse::Mismatch
    );

    // A record stored before keying: its plain fingerprint and no key.
    let token = token_of(&api.claim("older", &fp(3), Some(60_000)).await);
    let scope = api.state.scoper().hash("older", "alice", ENDPOINT);
    sqlx::query("UPDATE idempotency_records SET fingerprint = $2, fingerprint_key_id = NULL WHERE scope_hash = $1")
        .bind(&scope[..])
        .bind(fp(3))
        .execute(api.state.store().pool())
        .await
        .unwrap();
    assert_eq!(
        api.claim("older", &fp(4), None).await,
        ClaimResponse::Mismatch
    );
    assert!(matches!(
        api.claim("older", &fp(3), None).await,
        ClaimResponse::InProgress { .. }
    ));
    let (value, key_id) = stored(&api, "older").await;
    assert!(
        key_id.is_some() && value != fp(3),
        "re-keyed as it was read"
    );
    assert!(matches!(
        api.claim("older", &fp(3), None).await,
        ClaimResponse::InProgress { .. }
    ));
    let _ = token;
    api.shutdown().await;
}
