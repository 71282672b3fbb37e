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

/// Key `k` claimed by alice under the old secret (`lease_ms`), then a state API rotating to the
/// new one: it, the claim's token, and the key's previous and current addresses.
async fn claimed_then_rotated(
    database: &str,
    lease_ms: u64,
) -> (
    Api,
    i64,
    state_api::scope::ScopeHash,
    state_api::scope::ScopeHash,
) {
    let cluster = test_support::postgres::shared().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster.fresh_database(database).unwrap();
    let before = Api::start_on(&db, &["--key-secret", OLD]).await;
    let token = token_of(&before.claim("k", &fp(1), Some(lease_ms)).await);
    before.shutdown().await;
    let rotating = Api::start_on(&db, &["--key-secret", NEW, "--previous-key-secret", OLD]).await;
    let old_scope = state_api::scope::Scoper::new(OLD.as_bytes())
        .unwrap()
        .hash("k", "alice", ENDPOINT);
    let new_scope = rotating.state.scoper().hash("k", "alice", ENDPOINT);
    (rotating, token, old_scope, new_scope)
}

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
    let (rotating, old, old_scope, new_scope) = claimed_then_rotated("rotation_race", 1_000).await;
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

/// Seed 439267646771: an owner's write looks its record up (`scope_of`) under the previous
/// secret; before its statement runs, another write of the same claim (a heartbeat) rewrites
/// the record and so moves it to the current secret's address. The write still finds it there,
/// by its token: a release must not be fenced out (that left a key held unknown though
/// nothing was forwarded), nor a heartbeat, a mark or a complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_looked_up_under_the_previous_secret_finds_the_record_another_write_moved() {
    use state_rules::writes::Beat;
    let cluster = test_support::postgres::shared().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster.fresh_database("rotation_moved").unwrap();
    let keys = ["released", "beaten", "marked", "completed"];
    let before = Api::start_on(&db, &["--key-secret", OLD]).await;
    let mut tokens = Vec::new();
    for key in keys {
        tokens.push(token_of(&before.claim(key, &fp(1), Some(60_000)).await));
    }
    before.shutdown().await;

    let rotating = Api::start_on(&db, &["--key-secret", NEW, "--previous-key-secret", OLD]).await;
    let old_scoper = state_api::scope::Scoper::new(OLD.as_bytes()).unwrap();
    let store = rotating.state.store();
    let retention = rotating.state.config().retention_ms();
    let mut addresses = Vec::new();
    for (key, token) in keys.iter().zip(&tokens) {
        let old = old_scoper.hash(key, "alice", ENDPOINT);
        let new = rotating.state.scoper().hash(key, "alice", ENDPOINT);
        // The other write: a heartbeat moves the record to the current secret's address.
        let (status, body, _) = rotating
            .post(
                "/v1/heartbeat",
                &serde_json::json!({"key": key, "subject": "alice", "endpoint": ENDPOINT,
                                    "token": token, "lease_ms": 60_000}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert!(store.exists(&new).await.unwrap() && !store.exists(&old).await.unwrap());
        addresses.push((old, new));
    }
    // Each write below runs with the addresses looked up before that heartbeat: `at` the
    // previous secret's, `current` the new one's.
    let (old, new) = &addresses[0];
    assert!(
        store.release(old, new, tokens[0], retention).await.unwrap(),
        "the release was fenced out by its own claim's heartbeat"
    );
    assert!(
        !store.exists(new).await.unwrap(),
        "released: the key is free"
    );
    let (old, new) = &addresses[1];
    assert_eq!(
        store
            .heartbeat(old, new, tokens[1], 60_000, retention)
            .await
            .unwrap(),
        Beat::Extended
    );
    let (old, new) = &addresses[2];
    assert_eq!(
        store
            .owner_unknown(old, new, tokens[2], retention)
            .await
            .unwrap(),
        Some(true)
    );
    assert_eq!(
        store
            .heartbeat(old, new, tokens[2], 60_000, retention)
            .await
            .unwrap(),
        Beat::LeaseEnded,
        "marked unknown where it was moved"
    );
    // A complete seals its response where the record holding the token is now.
    let (old, new) = &addresses[3];
    let sealed_at = store.move_to_current(old, new, tokens[3]).await.unwrap();
    assert_eq!(sealed_at.as_ref(), Some(new));
    assert!(matches!(
        store
            .complete(new, tokens[3], &ok_response(), retention)
            .await
            .unwrap(),
        state_api::store::WriteResult::Done { .. }
    ));
    match rotating.claim("completed", &fp(1), None).await {
        ClaimResponse::Completed { response, .. } => assert_eq!(response, ok_response()),
        other => panic!("the completed record was not replayed: {other:?}"),
    }
    // A retried complete of the same owner, from the same stale lookup, changes nothing.
    assert!(matches!(
        store.complete_unmatched(old, new, tokens[3]).await.unwrap(),
        state_api::store::WriteResult::AlreadyDone { .. }
    ));
    rotating.shutdown().await;
}

/// The review of seed 439267646771's fix: a complete's move to the current address waits for
/// another write of the same claim that moves the record there and commits meanwhile. The
/// complete must then seal and store its response at the current address: a statement whose
/// snapshot predates that commit would still see the record at the previous one (the
/// response sealed there, the complete fenced out, the outcome lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_s_move_that_waits_for_another_write_s_move_finds_the_record_moved() {
    let (rotating, token, old, new) = claimed_then_rotated("rotation_wait", 60_000).await;
    let store = rotating.state.store().clone();
    // The other write (a heartbeat's move), not committed yet.
    let mut other = store.pool().begin().await.unwrap();
    sqlx::query("UPDATE idempotency_records SET scope_hash = $2 WHERE scope_hash = $1")
        .bind(&old[..])
        .bind(&new[..])
        .execute(&mut *other)
        .await
        .unwrap();
    let mover = tokio::spawn({
        let store = store.clone();
        async move { store.move_to_current(&old, &new, token).await.unwrap() }
    });
    // Until the move waits for the other write's row lock.
    let mut waited = false;
    for _ in 0..200 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE idempotency_records SET scope_hash%'
               AND datname = current_database()",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        if waiting > 0 {
            waited = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        waited,
        "the complete's move never waited for the other write"
    );
    other.commit().await.unwrap();
    assert_eq!(
        mover.await.unwrap(),
        Some(new),
        "sealed where the record is"
    );
    let retention = rotating.state.config().retention_ms();
    assert!(matches!(
        store
            .complete(&new, token, &ok_response(), retention)
            .await
            .unwrap(),
        state_api::store::WriteResult::Done { .. }
    ));
    match rotating.claim("k", &fp(1), None).await {
        ClaimResponse::Completed { response, .. } => assert_eq!(response, ok_response()),
        other => panic!("the completed record was not replayed: {other:?}"),
    }
    rotating.shutdown().await;
}

const ADMIN: &str = "admin-token-0123456789";

/// Key `held` claimed by alice under the old secret and marked unknown by its owner, then a
/// state API rotating to the new secret, with the admin token: the database and that API.
async fn unknown_then_rotated(database: &str) -> (String, Api) {
    let cluster = test_support::postgres::shared().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster.fresh_database(database).unwrap();
    let before = Api::start_on(&db, &["--key-secret", OLD]).await;
    let owner = token_of(&before.claim("held", &fp(1), Some(60_000)).await);
    let (status, body, _) = before
        .post("/v1/unknown", &fenced_body("held", owner))
        .await;
    assert_eq!(status, 200, "{body}");
    before.shutdown().await;
    let rotating = Api::start_on(
        &db,
        &[
            "--key-secret",
            NEW,
            "--previous-key-secret",
            OLD,
            "--admin-token",
            ADMIN,
        ],
    )
    .await;
    (db, rotating)
}

/// The same review: an operator's resolve of a record still under the previous secret moves it
/// to the current one and seals its answer there, as every write does, so that the resolved
/// answer outlives the previous secret (left behind, a retry after the drop would be a new key
/// and run again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_s_resolve_during_a_rotation_outlives_the_previous_secret() {
    let (db, rotating) = unknown_then_rotated("rotation_resolve").await;
    let resolve = serde_json::json!({
        "key": "held", "subject": "alice", "endpoint": ENDPOINT,
        "reason": "charged per PSP dashboard", "actor": "oncall-ana", "force": true,
        "response": ok_response(),
    });
    let answer = rotating
        .client
        .post(rotating.url(contract::admin::ADMIN_RESOLVE_PATH))
        .bearer_auth(ADMIN)
        .json(&resolve)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 200);
    let new = rotating.state.scoper().hash("held", "alice", ENDPOINT);
    assert!(rotating.state.store().exists(&new).await.unwrap());
    // A retry meanwhile is replayed and re-keys the fingerprint (else it answers 422 after the
    // drop: docs/not-done-yet.md).
    assert!(matches!(
        rotating.claim("held", &fp(1), None).await,
        ClaimResponse::Completed { .. }
    ));
    rotating.shutdown().await;

    let after = Api::start_on(&db, &["--key-secret", NEW]).await;
    match after.claim("held", &fp(1), None).await {
        ClaimResponse::Completed { response, .. } => assert_eq!(response, ok_response()),
        other => panic!("the resolved answer was left under the previous secret: {other:?}"),
    }
    after.shutdown().await;
}

/// An operator's purge during a rotation, of a record still under the previous secret, is
/// recorded at the current address: recorded where the record was, its audit trail was gone
/// with the previous secret (`show` answered 404 for a key an operator had purged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_s_purge_during_a_rotation_is_audited_where_it_outlives_the_previous_secret() {
    let (db, rotating) = unknown_then_rotated("rotation_purge_audit").await;
    let purge = serde_json::json!({
        "key": "held", "subject": "alice", "endpoint": ENDPOINT,
        "reason": "duplicate of an order refunded by hand", "actor": "oncall-ana", "force": true,
    });
    let answer = rotating
        .client
        .post(rotating.url(contract::admin::ADMIN_PURGE_PATH))
        .bearer_auth(ADMIN)
        .json(&purge)
        .send()
        .await
        .unwrap();
    assert_eq!(
        answer.status().as_u16(),
        200,
        "{}",
        answer.text().await.unwrap()
    );
    rotating.shutdown().await;

    let after = Api::start_on(&db, &["--key-secret", NEW, "--admin-token", ADMIN]).await;
    let shown = after
        .client
        .get(after.url(&format!(
            "{}?key=held&subject=alice&endpoint={}",
            contract::admin::ADMIN_RECORD_PATH,
            enc(ENDPOINT)
        )))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let status = shown.status().as_u16();
    let shown: serde_json::Value = shown.json().await.unwrap();
    assert_eq!(
        status, 200,
        "the purge's audit trail after the drop: {shown}"
    );
    assert!(shown["record"].is_null(), "{shown}");
    let actions: Vec<&str> = shown["audit"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["action"].as_str())
        .collect();
    assert_eq!(actions, ["purge"], "{shown}");
    after.shutdown().await;
}

/// The record read (the filter's key state path, `GET /v1/records`, and the operator's) finds a
/// record at either address during a rotation in one statement: looked up first and read
/// after, a record another write moved in between was reported absent, and a client told
/// `absent` may take a new key for a request that ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_read_finds_a_record_at_either_address_in_one_statement() {
    let (rotating, token, old_scope, new_scope) =
        claimed_then_rotated("rotation_read", 60_000).await;
    let store = rotating.state.store();
    let (at, row) = store
        .record(&new_scope, Some(&old_scope))
        .await
        .unwrap()
        .expect("found under the previous secret");
    assert_eq!(at, old_scope);
    assert_eq!(row.fencing_token, token);
    let (status, body) = rotating.record("k", "alice").await;
    assert_eq!(status, 200, "{body}");
    // A heartbeat moves it to the current address: found there, by the same read.
    let (status, body, _) = rotating
        .post(
            "/v1/heartbeat",
            &serde_json::json!({"key": "k", "subject": "alice", "endpoint": ENDPOINT,
                                "token": token, "lease_ms": 60_000}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (at, _) = store
        .record(&new_scope, Some(&old_scope))
        .await
        .unwrap()
        .expect("found at the current address");
    assert_eq!(at, new_scope);
    let (status, body) = rotating.record("k", "alice").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["token"], token, "{body}");
    // A move held uncommitted (back to the previous address here, which production never does:
    // what counts is that the read sees one version of the row): the read sees the record where
    // it was, not nowhere. The race itself (a move committed between two statements) cannot be
    // paused from outside; one statement leaves it no room.
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("UPDATE idempotency_records SET scope_hash = $1 WHERE scope_hash = $2")
        .bind(&old_scope[..])
        .bind(&new_scope[..])
        .execute(&mut *tx)
        .await
        .unwrap();
    let (at, _) = store
        .record(&new_scope, Some(&old_scope))
        .await
        .unwrap()
        .expect("found while a move is uncommitted");
    assert_eq!(at, new_scope);
    tx.commit().await.unwrap();
    let (at, _) = store
        .record(&new_scope, Some(&old_scope))
        .await
        .unwrap()
        .expect("found after the move committed");
    assert_eq!(at, old_scope);
    rotating.shutdown().await;
}
