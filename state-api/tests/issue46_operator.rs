//! Issue 46's operator findings in the state API against a real Postgres: the operator's guard
//! counts an owner's silence only while the database served (the lease guard, finding 4).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use contract::admin::{AdminAction, ADMIN_RELEASE_PATH};
use contract::wire::ClaimResponse;
use serde_json::Value;

const ADMIN: &str = "admin-token-0123456789";

fn action(key: &str, reason: &str) -> AdminAction {
    AdminAction {
        namespace: String::new(),
        key: key.into(),
        subject: "alice".into(),
        endpoint: ENDPOINT.into(),
        reason: reason.into(),
        actor: "oncall-ana".into(),
        force: false,
        response: None,
    }
}

async fn admin_post(api: &Api, path: &str, a: &AdminAction) -> (u16, Value) {
    let r = api
        .client
        .post(api.url(path))
        .bearer_auth(ADMIN)
        .json(a)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Finding 4: an owner silent for a whole lease, but only because the database was not
/// serving (here: a promoted standby, its timeline first seen now; `tests/crash.rs` does the
/// same for the claim's lease guard), may still be running: an operator's release without
/// force is refused until the database has served a whole lease, as a claim's reclaim is.
#[tokio::test]
async fn an_operator_release_counts_the_owners_silence_only_while_the_database_served() {
    let api = Api::start(&["--admin-token", ADMIN]).await;
    let _owner = token_of(&api.claim("cut-off", &fp(1), Some(1_000)).await);
    // One lease and more without a sign of life...
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    // ... but the database began serving just now (a failover): the owner could not be heard.
    sqlx::query("UPDATE idempotency_timelines SET first_seen_at = clock_timestamp()")
        .execute(api.state.store().pool())
        .await
        .unwrap();
    let (s, b) = admin_post(
        &api,
        ADMIN_RELEASE_PATH,
        &action("cut-off", "looks stuck after the failover"),
    )
    .await;
    assert_eq!(
        (s, b["type"].as_str()),
        (409, Some("/problems/lease-live")),
        "an owner cut off by an outage was released: {b}"
    );
    // The claim's lease guard agrees: still in progress.
    assert!(
        matches!(
            api.claim("cut-off", &fp(1), None).await,
            ClaimResponse::InProgress { .. }
        ),
        "the claim's lease guard"
    );
    // A whole lease of serving later, without force.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (s, b) = admin_post(
        &api,
        ADMIN_RELEASE_PATH,
        &action("cut-off", "silent a lease since the failover"),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    api.shutdown().await;
}
