//! Stored responses sealed at rest (AES-256-GCM): the table read raw holds no response body or
//! header value in clear, a rotated storage key still replays what the previous one sealed, and
//! a response that does not open (tampered, moved to another record, sealed under a key the
//! process lacks) is a 500 problem and a counter, never a replay.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use contract::wire::{ClaimResponse, StoredResponse, CLAIM_PATH, COMPLETE_PATH};

const NEXT_KEY: &str = "ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";
const BODY_MARKER: &str = "tok_visa_4242_BODYMARKER";
const HEADER_MARKER: &str = "ch_HEADERMARKER_91";

fn marked_response() -> StoredResponse {
    StoredResponse::new(
        201,
        vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), format!("/charges/{HEADER_MARKER}")),
        ],
        format!("{{\"card\":\"{BODY_MARKER}\"}}").as_bytes(),
        true,
    )
}

async fn complete(api: &Api, key: &str) {
    let token = token_of(&api.claim(key, &fp(1), None).await);
    let (status, body, _) = api
        .post(
            COMPLETE_PATH,
            &complete_body(key, token, &marked_response()),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

async fn replayed(api: &Api, key: &str) -> StoredResponse {
    match api.claim(key, &fp(1), None).await {
        ClaimResponse::Completed { response, .. } => response,
        other => panic!("{key}: expected a replay, got {other:?}"),
    }
}

/// Everything the table holds about its responses, as text (what a stolen copy shows).
fn raw_table(db: &str) -> String {
    let cluster = test_support::postgres::shared().unwrap();
    let name = db.rsplit('/').next().unwrap();
    cluster
        .psql(
            name,
            "SELECT coalesce(response_headers::text, '') || ' ' || \
                    coalesce(encode(response_body, 'escape'), '') || ' ' || \
                    coalesce(response_key_id::text, 'clear') \
             FROM idempotency_records",
        )
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_are_sealed_and_a_rotated_key_still_replays_them() {
    let cluster = test_support::postgres::shared().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster.fresh_database("sealing").unwrap();

    // In clear without a storage key: the markers are there to find (the search works).
    let clear = Api::start_on(&db, &[IN_CLEAR]).await;
    complete(&clear, "in-clear").await;
    let raw = raw_table(&db);
    assert!(
        raw.contains(BODY_MARKER) && raw.contains(HEADER_MARKER),
        "{raw}"
    );
    clear.shutdown().await;
    cluster
        .psql(
            db.rsplit('/').next().unwrap(),
            "DELETE FROM idempotency_records",
        )
        .unwrap();

    // Sealed: neither marker anywhere, through the single path and the group commit alike.
    let first = Api::start_on(&db, &["--storage-key", STORAGE_KEY]).await;
    complete(&first, "sealed").await;
    let batched: Vec<_> = (0..8)
        .map(|i| {
            let api_key = format!("sealed-{i}");
            let req = claim_req(&api_key, "alice", &fp(1), None);
            first.spawn_claim(&req)
        })
        .collect();
    let mut bodies = Vec::new();
    for (i, claim) in batched.into_iter().enumerate() {
        let (answer, _) = claim.await.unwrap();
        bodies.push(complete_body(
            &format!("sealed-{i}"),
            token_of(&answer),
            &marked_response(),
        ));
    }
    // Completed together: the group commit's statement seals them too. One `/v1/completes`
    // call is one statement (eight concurrent `/v1/complete` calls may each run alone).
    let (statements, _) = first.state.metrics().batch_totals();
    assert_eq!(first.complete_all(&bodies).await, [200; 8]);
    let (after, requests) = first.state.metrics().batch_totals();
    assert!(
        after - statements < 8,
        "{statements} -> {after} statements for {requests}"
    );
    assert_eq!(after - statements, 1, "one statement for the one call");
    assert_eq!(replayed(&first, "sealed").await, marked_response());
    let raw = raw_table(&db);
    let sealed = cluster
        .psql(
            db.rsplit('/').next().unwrap(),
            "SELECT count(*) FROM idempotency_records WHERE response_key_id IS NOT NULL",
        )
        .unwrap();
    assert_eq!(sealed.trim(), "9");
    assert!(
        !raw.contains(BODY_MARKER) && !raw.contains(HEADER_MARKER) && !raw.contains("clear"),
        "a response is readable in the table:\n{raw}"
    );
    first.shutdown().await;

    // Rotated: the new key seals new records, the previous one still opens the old ones.
    let rotated = Api::start_on(
        &db,
        &[
            "--storage-key",
            NEXT_KEY,
            "--previous-storage-key",
            STORAGE_KEY,
        ],
    )
    .await;
    assert_eq!(replayed(&rotated, "sealed").await, marked_response());
    assert_eq!(replayed(&rotated, "sealed-3").await, marked_response());
    complete(&rotated, "after-rotation").await;
    assert_eq!(
        replayed(&rotated, "after-rotation").await,
        marked_response()
    );
    rotated.shutdown().await;

    // The previous key dropped too early: its records do not open. A 500 problem, counted,
    // and no replay of anything.
    let forgot = Api::start_on(&db, &["--storage-key", NEXT_KEY]).await;
    assert_eq!(replayed(&forgot, "after-rotation").await, marked_response());
    let claim = serde_json::to_value(claim_req("sealed", "alice", &fp(1), None)).unwrap();
    let (status, body, _) = forgot.post(CLAIM_PATH, &claim).await;
    assert_problem(status, &body, 500, "internal-error");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("cannot be opened"),
        "{body}"
    );
    assert_eq!(forgot.state.metrics().unopenable_total(), 1);
    forgot.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_or_moved_response_is_a_500_never_a_replay() {
    let api = Api::start(&[]).await;
    complete(&api, "victim").await;
    complete(&api, "other").await;
    let name = api.db_url.rsplit('/').next().unwrap().to_owned();
    let cluster = test_support::postgres::shared().unwrap();
    let scope = |key: &str| {
        let h = api.state.scoper().hash(key, "alice", ENDPOINT);
        h.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let (victim, other) = (scope("victim"), scope("other"));
    // Another record's sealed response copied over this one's: it does not open here.
    cluster
        .psql(
            &name,
            &format!(
                "UPDATE idempotency_records v SET response_body = o.response_body, \
                 response_key_id = o.response_key_id FROM idempotency_records o \
                 WHERE v.scope_hash = '\\x{victim}' AND o.scope_hash = '\\x{other}'"
            ),
        )
        .unwrap();
    let claim = serde_json::to_value(claim_req("victim", "alice", &fp(1), None)).unwrap();
    let (status, body, _) = api.post(CLAIM_PATH, &claim).await;
    assert_problem(status, &body, 500, "internal-error");
    // One byte of the other's ciphertext flipped: neither.
    cluster
        .psql(
            &name,
            &format!(
                "UPDATE idempotency_records \
                 SET response_body = set_byte(response_body, 20, get_byte(response_body, 20) # 1) \
                 WHERE scope_hash = '\\x{other}'"
            ),
        )
        .unwrap();
    let claim = serde_json::to_value(claim_req("other", "alice", &fp(1), None)).unwrap();
    let (status, body, _) = api.post(CLAIM_PATH, &claim).await;
    assert_problem(status, &body, 500, "internal-error");
    assert_eq!(api.state.metrics().unopenable_total(), 2);
    let m = api.metrics().await;
    assert_eq!(metric(&m, "state_api_unopenable_responses_total"), 2.0);
    // A status changed in clear beside the ciphertext does not open either.
    complete(&api, "status").await;
    cluster
        .psql(
            &name,
            &format!(
                "UPDATE idempotency_records SET response_status = 200 WHERE scope_hash = '\\x{}'",
                scope("status")
            ),
        )
        .unwrap();
    let claim = serde_json::to_value(claim_req("status", "alice", &fp(1), None)).unwrap();
    let (status, body, _) = api.post(CLAIM_PATH, &claim).await;
    assert_problem(status, &body, 500, "internal-error");
}
