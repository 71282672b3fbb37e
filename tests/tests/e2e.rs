//! End-to-end tests through the real Envoy with the real filter, state API, Postgres and checkout.
//!
//! Most tests share one stack (started on first use, stopped at the end) and stay apart by using
//! unique keys. Tests that kill a part start a stack of their own.

use std::sync::Arc;
use std::time::Duration;

use e2e::client::{unique_key, Client, Request};
use e2e::services::ServiceTestExt as _;
use e2e::stack::{mint_token, token, Stack, StackOptions};
use e2e::testkit::*;
use libtest_mimic::Arguments;
use serde_json::json;
use sha2::Digest as _;

static SHARED: SharedStack = SharedStack::new(default_stack);

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        SHARED.trial(
            "first_request_executes_and_retry_replays",
            first_request_executes_and_retry_replays,
        ),
        SHARED.trial(
            "the_first_answer_and_every_replay_say_when_the_key_expires",
            the_first_answer_and_every_replay_say_when_the_key_expires,
        ),
        SHARED.trial(
            "a_client_asks_what_became_of_its_key_without_sending_it_again",
            a_client_asks_what_became_of_its_key,
        ),
        SHARED.trial(
            "duplicates_during_a_slow_request_get_409_at_once",
            duplicates_during_a_slow_request_get_409_at_once,
        ),
        SHARED.trial(
            "key_order_and_whitespace_do_not_matter_nested_change_is_422",
            key_order_and_whitespace_do_not_matter_nested_change_is_422,
        ),
        SHARED.trial(
            "subjects_and_endpoints_are_isolated",
            subjects_and_endpoints_are_isolated,
        ),
        SHARED.trial(
            "forged_subject_header_changes_nothing",
            forged_subject_header_changes_nothing,
        ),
        SHARED.trial("bad_keys_get_400_problems", bad_keys_get_400_problems),
        SHARED.trial(
            "missing_or_bad_tokens_get_401",
            missing_or_bad_tokens_get_401,
        ),
        SHARED.trial(
            "bodies_over_the_limit_get_413_and_at_the_limit_pass",
            bodies_over_the_limit_get_413_and_at_the_limit_pass,
        ),
        SHARED.trial(
            "declined_card_is_replayed_not_rerun",
            declined_card_is_replayed_not_rerun,
        ),
        SHARED.trial("multi_chunk_bodies_reach_the_upstream_whole_http1", |s| {
            multi_chunk_bodies_arrive_whole(s, false)
        }),
        SHARED.trial("multi_chunk_bodies_reach_the_upstream_whole_http2", |s| {
            multi_chunk_bodies_arrive_whole(s, true)
        }),
        SHARED.trial(
            "hostile_bodies_do_not_kill_the_filter",
            hostile_bodies_do_not_kill_the_filter,
        ),
        SHARED.trial(
            "unprotected_routes_pass_through",
            unprotected_routes_pass_through,
        ),
        SHARED.trial(
            "put_patch_and_a_bodiless_delete_are_protected_as_post_is",
            put_patch_and_a_bodiless_delete_are_protected_as_post_is,
        ),
        SHARED.trial(
            "a_new_key_for_the_same_request_is_counted_as_key_churn",
            a_new_key_for_the_same_request_is_counted_as_key_churn,
        ),
        own(
            // A stack of its own: its jwt_authn cache counters count this test's requests only.
            "a_cached_token_is_refused_once_it_expires",
            StackOptions::default(),
            a_cached_token_is_refused_once_it_expires,
        ),
        own(
            "dead_state_api_gives_503_and_no_upstream_call",
            StackOptions::default(),
            dead_state_api_gives_503_and_no_upstream_call,
        ),
        own(
            "key_of_a_killed_envoy_is_409_until_its_lease_ends_then_reconciled",
            // Long enough that Envoy's restart on a loaded machine ends well inside the lease.
            StackOptions {
                lease_ms: 8_000,
                heartbeat_ms: 1_000,
                ..StackOptions::default()
            },
            key_of_a_killed_envoy_is_409_until_its_lease_ends,
        ),
        own(
            "heartbeats_keep_a_slow_request_from_being_reclaimed",
            StackOptions {
                lease_ms: 2_000,
                heartbeat_ms: 500,
                ..StackOptions::default()
            },
            heartbeats_keep_a_slow_request_from_being_reclaimed,
        ),
        own(
            "replay_cache_keeps_422_and_isolation_and_answers_while_the_state_api_is_down",
            StackOptions::default(),
            replay_cache_answers_cached_keys_only,
        ),
        own(
            "complete_in_background_answers_first_and_the_worker_stores_right_after",
            // Two Envoy workers, each waking its own root context; a tick (every 7.5 s here) is
            // too late for the test, so a wake that reached the wrong worker would show.
            StackOptions {
                complete_in_background: true,
                envoy_workers: 2,
                lease_ms: 60_000,
                heartbeat_ms: 30_000,
                ..StackOptions::default()
            },
            complete_in_background_answers_first_and_stores_right_after,
        ),
        own(
            // One Envoy worker: every claim and complete queues behind the one on its way.
            "concurrent_new_keys_go_in_batches_and_each_is_charged_once",
            StackOptions::default(),
            concurrent_new_keys_go_in_batches_and_each_is_charged_once,
        ),
    ];
    // Stops the shared stack's processes before exiting (statics are never dropped).
    SHARED.run(&args, trials)
}

// ---------------------------------------------------------------------------------------------
// Shared-stack tests

/// `Idempotency-Key-Expires-In` (issue 48): the seconds the key is still kept, on the first
/// answer (the retention the state API applies, 24 h by default) and on every replay (what is
/// left of the stored record's); none on the edge's own problems.
async fn the_first_answer_and_every_replay_say_when_the_key_expires(stack: Arc<Stack>) {
    const RETENTION_S: u64 = 86_400;
    let c = client(&stack);
    let key = unique_key("expires");
    let body = charge_body(1234);
    let seconds = |a: &e2e::client::Answer| -> u64 {
        let value = a
            .header("idempotency-key-expires-in")
            .unwrap_or_else(|| panic!("no Idempotency-Key-Expires-In: {}", a.describe()));
        value.parse().unwrap_or_else(|e| panic!("{value:?}: {e}"))
    };
    let first = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    assert_eq!(seconds(&first), RETENTION_S, "{}", first.describe());
    let started = std::time::Instant::now();
    for _ in 0..2 {
        let retry = c.send(checkout(&key, "alice", &body)).await;
        assert_eq!(retry.header("idempotent-replayed").as_deref(), Some("true"));
        let left = seconds(&retry);
        // Never less than the first answer said, less the time since (and a second's
        // rounding); at most the retention and the lease (the record's expiry is never moved
        // earlier than its claim's, lease included).
        let since = started.elapsed().as_secs() + 2;
        assert!(
            left + since >= RETENTION_S && left <= RETENTION_S + 30,
            "a replay {since} s later says {left} s"
        );
    }
    // The edge's own answer about the key (another body: 422) has none.
    let other = c.send(checkout(&key, "alice", &charge_body(999))).await;
    assert_eq!(other.status, 422, "{}", other.describe());
    assert_eq!(other.header("idempotency-key-expires-in"), None);
}

/// The key state path (issue 48, `GET /idempotency/key-state?method=..&path=..` in the demo):
/// what became of a key for the caller's subject, through Envoy, without sending the payment
/// again; nothing reaches the checkout and nothing is claimed.
async fn a_client_asks_what_became_of_its_key(stack: Arc<Stack>) {
    let c = client(&stack);
    let ask = |key: &str, who: Option<&str>, query: &str| {
        let mut r = Request::get(&format!("/idempotency/key-state?{query}"));
        if !key.is_empty() {
            r = r.key(key);
        }
        if let Some(who) = who {
            r = r.token(&token(who));
        }
        r
    };
    let on_checkout = "method=POST&path=%2Fcheckout";
    let said = |a: &e2e::client::Answer| -> serde_json::Value {
        assert_eq!(a.status, 200, "{}", a.describe());
        serde_json::from_slice(&a.body).unwrap_or_else(|e| panic!("{}: {e}", a.describe()))
    };
    let key = unique_key("ask");
    // Never used: absent.
    let a = said(&c.send(ask(&key, Some("alice"), on_checkout)).await);
    assert_eq!(a["key_state"], "absent", "{a}");
    // While it runs: in progress.
    let slow = send_in_background(
        &c,
        checkout(&key, "alice", &charge_body(700)).delay_ms(2_000),
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    let a = said(&c.send(ask(&key, Some("alice"), on_checkout)).await);
    assert_eq!(
        (a["key_state"].as_str(), a["retry_same_key"].as_bool()),
        (Some("in_progress"), Some(true)),
        "{a}"
    );
    let first = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    // Once it completed: its status, replayable, how long the key is kept.
    let answer = c.send(ask(&key, Some("alice"), on_checkout)).await;
    let a = said(&answer);
    assert_eq!(a["key_state"], "completed", "{a}");
    assert_eq!(a["status"], 201, "{a}");
    assert_eq!(a["replayable"], true, "{a}");
    assert_eq!(a["retry_same_key"], true, "{a}");
    assert_eq!(a["new_key_safe"], false, "{a}");
    assert!(
        a["expires_in_s"].as_u64().is_some_and(|s| s > 86_000),
        "{a}"
    );
    assert!(answer.header("idempotency-key-expires-in").is_some());
    // Scoped by the caller: bob asking about alice's key learns nothing.
    let a = said(&c.send(ask(&key, Some("bob"), on_checkout)).await);
    assert_eq!(a["key_state"], "absent", "{a}");
    // A forged subject header changes nothing: Envoy removes it before jwt_authn sets its own.
    let forged = ask(&key, Some("bob"), on_checkout).header("x-jwt-sub", "alice");
    let a = said(&c.send(forged).await);
    assert_eq!(a["key_state"], "absent", "{a}");
    let forged_without_token = ask(&key, None, on_checkout).header("x-jwt-sub", "alice");
    let refused = c.send(forged_without_token).await;
    assert_eq!(refused.status, 401, "{}", refused.describe());
    // Bad questions: no token, no key, an endpoint that is not protected.
    let no_token = c.send(ask(&key, None, on_checkout)).await;
    assert_eq!(no_token.status, 401, "{}", no_token.describe());
    let no_key = c.send(ask("", Some("alice"), on_checkout)).await;
    assert_problem(&no_key, 400, "missing-idempotency-key", &stack);
    let elsewhere = c
        .send(ask(&key, Some("alice"), "method=POST&path=%2Fnowhere"))
        .await;
    assert_problem(&elsewhere, 400, "bad-request", &stack);
    // Asking ran nothing and claimed nothing: one execution, and the key replays as before.
    assert_eq!(executions(&stack, &key).await.len(), 1);
    let retry = c.send(checkout(&key, "alice", &charge_body(700))).await;
    assert_eq!(retry.header("idempotent-replayed").as_deref(), Some("true"));
}

async fn first_request_executes_and_retry_replays(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("replay");
    let body = charge_body(4990);
    let first = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(first.status, 201, "{}\n{}", first.describe(), stack.logs());
    assert!(first
        .header("location")
        .is_some_and(|l| l.starts_with("/charges/")));
    assert!(
        first.header("set-cookie").is_some(),
        "the checkout sets a cookie on the first answer"
    );
    assert_eq!(first.header("idempotent-replayed"), None);

    for _ in 0..2 {
        let retry = c.send(checkout(&key, "alice", &body)).await;
        assert_eq!(retry.status, first.status);
        assert_eq!(
            retry.body, first.body,
            "replayed body must be byte-identical"
        );
        for h in ["content-type", "location", "etag"] {
            assert_eq!(
                retry.header(h),
                first.header(h),
                "header {h} must be replayed"
            );
        }
        assert_eq!(retry.header("idempotent-replayed").as_deref(), Some("true"));
        // Never replayed: another caller's cookie, a per-request id.
        assert_eq!(retry.header("set-cookie"), None, "{}", retry.describe());
        assert_eq!(retry.header("x-request-id"), None, "{}", retry.describe());
    }
    let ran = executions(&stack, &key).await;
    assert_eq!(ran.len(), 1, "one execution for one key: {ran:?}");
    assert_eq!(ran[0]["subject"], "alice");
    assert_eq!(
        ran[0]["idempotency_key"],
        key.as_str(),
        "the key is forwarded upstream"
    );
    assert!(
        ran[0]["fencing_token"]
            .as_str()
            .is_some_and(|t| t.parse::<i64>().is_ok_and(|n| n > 0)),
        "{ran:?}"
    );
}

/// Issue 48: a client that makes a new key for each retry (the classic bug) is seen at the
/// edge: the same request under another key within the window is counted and logged, each key
/// named by its record's address (keys are never logged). It is observed only: each key runs
/// (the edge cannot tell an intended second charge from a churned retry).
async fn a_new_key_for_the_same_request_is_counted_as_key_churn(stack: Arc<Stack>) {
    let c = client(&stack);
    let (first_key, second_key) = (unique_key("churn-a"), unique_key("churn-b"));
    // How the filter names a record in its log: the first 8 bytes of SHA-256 over its framed
    // scope (filter-core's worker ids).
    let record = |key: &str| {
        let mut h = sha2::Sha256::new();
        contract::scope::frame(&mut h, key, "alice", "POST /checkout");
        h.finalize()
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    // A body no other test sends: its churn is this test's alone.
    let mut body = charge_body(7301);
    body["description"] = json!(unique_key("churn-body"));
    let before = stack.envoy.filter_counter("key_churn");
    let first = c.send(checkout(&first_key, "alice", &body)).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    // The client's own retry, same key: a replay, not churn.
    let retry = c.send(checkout(&first_key, "alice", &body)).await;
    assert!(replayed(&retry), "{}", retry.describe());
    // The same request under a new key: counted, logged with both records, and run.
    let churned = c.send(checkout(&second_key, "alice", &body)).await;
    assert_eq!(churned.status, 201, "{}", churned.describe());
    assert!(!replayed(&churned));
    let counted = stack.envoy.filter_counter("key_churn");
    assert!(counted > before, "key_churn {before} -> {counted}");
    let log = stack.envoy.log();
    let (new, old) = (record(&second_key), record(&first_key));
    let found = log
        .lines()
        .find(|l| l.contains("key churn") && l.contains(&format!("(record {new})")))
        .unwrap_or_else(|| {
            panic!(
                "no key churn line for record {new}:\n{}",
                stack.envoy.log_tail()
            )
        });
    assert!(found.contains(&format!("(record {old})")), "{found}");
    assert!(
        !log.contains(&first_key) && !log.contains(&second_key),
        "keys are never logged"
    );
    for key in [&first_key, &second_key] {
        assert_eq!(executions(&stack, key).await.len(), 1, "{key}");
    }
}

async fn duplicates_during_a_slow_request_get_409_at_once(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("slow");
    let body = charge_body(12_000);
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(4_000));
    // Let the first request claim the key (it is then upstream for 4 s).
    tokio::time::sleep(Duration::from_millis(800)).await;
    let duplicates =
        futures::future::join_all((0..20).map(|_| c.send(checkout(&key, "alice", &body)))).await;
    let mut slowest = Duration::ZERO;
    for d in &duplicates {
        assert_problem(d, 409, "request-in-progress", &stack);
        let retry_after: u64 = d
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(
            (1..=30).contains(&retry_after),
            "Retry-After must be a few seconds: {}",
            d.describe()
        );
        slowest = slowest.max(d.elapsed);
    }
    // They are answered while the first is still running (4 s), not after it.
    assert!(
        !slow.is_finished(),
        "a 409 took {slowest:?}: duplicates must not wait for the first request"
    );
    eprintln!("20 concurrent duplicates answered 409, slowest in {slowest:?}");
    // Retries right after an "in progress" answer get their 409 from the worker's memory
    // (in_flight_cache_ms, 500 by default), the same answer without a callout.
    let from_memory = || stack.envoy.filter_counter("in_flight_cache_hits");
    let before = from_memory();
    for _ in 0..10 {
        let d = c.send(checkout(&key, "alice", &body)).await;
        assert_problem(&d, 409, "request-in-progress", &stack);
        assert!(d.header("retry-after").is_some(), "{}", d.describe());
    }
    assert!(
        from_memory() > before,
        "ten back-to-back retries, none answered from memory"
    );
    let first = slow
        .await
        .unwrap_or_else(|e| panic!("slow request task: {e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    assert_eq!(
        executions(&stack, &key).await.len(),
        1,
        "twenty-one requests, one charge"
    );
    let after = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(after.status, 201);
    assert_eq!(after.header("idempotent-replayed").as_deref(), Some("true"));
}

async fn key_order_and_whitespace_do_not_matter_nested_change_is_422(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("canon");
    let original = br#"{"amount":100,"currency":"BRL","card":{"number":"4242424242424242","exp":"12/30"},"items":[{"sku":"a","qty":1,"meta":{"gift":false}}]}"#;
    let reordered = b"{ \"items\" : [ { \"meta\": {\"gift\" : false}, \"qty\":1, \"sku\":\"a\" } ],\n  \"card\": {\"exp\":\"12/30\", \"number\":\"4242424242424242\"}, \"currency\":\"BRL\", \"amount\": 100 }";
    // Differs only in a nested member that is not a top-level key: the seed's fingerprint missed this.
    let nested_change = br#"{"amount":100,"currency":"BRL","card":{"number":"4242424242424242","exp":"12/30"},"items":[{"sku":"a","qty":1,"meta":{"gift":true}}]}"#;
    let send = |b: &'static [u8]| {
        c.send(
            Request::post("/checkout")
                .token(&token("alice"))
                .key(&key)
                .header("content-type", "application/json")
                .body(b.to_vec()),
        )
    };
    let first = send(original).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    let same = send(reordered).await;
    assert_eq!(same.status, 201, "{}", same.describe());
    assert_eq!(
        same.header("idempotent-replayed").as_deref(),
        Some("true"),
        "key order and whitespace must not matter"
    );
    let changed = send(nested_change).await;
    assert_problem(&changed, 422, "idempotency-key-reused", &stack);
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn subjects_and_endpoints_are_isolated(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("scope");
    let body = charge_body(700);
    let alice = c.send(checkout(&key, "alice", &body)).await;
    let bob = c.send(checkout(&key, "bob", &body)).await;
    let refunded = c.send(refund(&key, "alice", &body)).await;
    for a in [&alice, &bob, &refunded] {
        assert_eq!(a.status, 201, "{}", a.describe());
        assert_eq!(
            a.header("idempotent-replayed"),
            None,
            "no replay may cross subjects or endpoints"
        );
    }
    assert_ne!(alice.body, bob.body);
    let ran = executions(&stack, &key).await;
    assert_eq!(ran.len(), 3, "{ran:?}");
    let mut who: Vec<(String, String)> = ran
        .iter()
        .map(|e| (e["subject"].to_string(), e["kind"].to_string()))
        .collect();
    who.sort();
    assert_eq!(
        who,
        vec![
            ("\"alice\"".into(), "\"charge\"".into()),
            ("\"alice\"".into(), "\"refund\"".into()),
            ("\"bob\"".into(), "\"charge\"".into())
        ]
    );
}

async fn forged_subject_header_changes_nothing(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("forged");
    let body = charge_body(500);
    // bob executes first; alice then sends the same key claiming to be bob.
    assert_eq!(c.send(checkout(&key, "bob", &body)).await.status, 201);
    let forged = c
        .send(
            checkout(&key, "alice", &body)
                .header("x-jwt-sub", "bob")
                .header("x-jwt-sub", "bob"),
        )
        .await;
    assert_eq!(forged.status, 201, "{}", forged.describe());
    assert_eq!(
        forged.header("idempotent-replayed"),
        None,
        "alice must not see bob's stored response"
    );
    let ran = executions(&stack, &key).await;
    assert_eq!(ran.len(), 2);
    assert!(
        ran.iter().any(|e| e["subject"] == "alice"),
        "the upstream sees the verified subject: {ran:?}"
    );
    // No token at all, only a forged subject header: refused before the filter.
    let anonymous = c
        .send(
            Request::post("/checkout")
                .key(&key)
                .header("x-jwt-sub", "bob")
                .json(&body),
        )
        .await;
    assert_eq!(anonymous.status, 401);
}

async fn bad_keys_get_400_problems(stack: Arc<Stack>) {
    let c = client(&stack);
    let body = charge_body(1);
    let alice = token("alice");
    let base = || Request::post("/checkout").token(&alice).json(&body);
    let cases: Vec<(&str, Request, &str)> = vec![
        ("missing", base(), "missing-idempotency-key"),
        ("empty", base().key(""), "invalid-idempotency-key"),
        (
            "too long",
            base().key(&"k".repeat(256)),
            "invalid-idempotency-key",
        ),
        ("a list", base().key("a, b"), "invalid-idempotency-key"),
        (
            "sent twice",
            base().key("twice-a").key("twice-b"),
            "invalid-idempotency-key",
        ),
        (
            "quote inside quotes",
            base().key("\"ab\"c\""),
            "invalid-idempotency-key",
        ),
        ("space", base().key("a b"), "invalid-idempotency-key"),
        (
            "empty sf-string",
            base().key("\"\""),
            "invalid-idempotency-key",
        ),
    ];
    for (what, req, problem) in cases {
        let answer = c.send(req).await;
        assert_eq!(answer.status, 400, "{what}: {}", answer.describe());
        assert_problem(&answer, 400, problem, &stack);
    }
    // An sf-string and the same bare token are the same key.
    let key = unique_key("sf");
    let quoted = c.send(base().key(&format!("\"{key}\""))).await;
    assert_eq!(quoted.status, 201, "{}", quoted.describe());
    let bare = c.send(base().key(&key)).await;
    assert_eq!(
        bare.header("idempotent-replayed").as_deref(),
        Some("true"),
        "{}",
        bare.describe()
    );
}

async fn missing_or_bad_tokens_get_401(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("authn");
    let body = charge_body(1);
    for name in ["expired", "wrong_key", "wrong_issuer", "tampered"] {
        let answer = c.send(checkout(&key, name, &body)).await;
        assert_eq!(answer.status, 401, "token {name}: {}", answer.describe());
    }
    // jwt_authn answers a valid token minted for another audience with 403 (known, not allowed).
    let other_audience = c.send(checkout(&key, "wrong_audience", &body)).await;
    assert_eq!(other_audience.status, 403, "{}", other_audience.describe());
    assert_eq!(
        c.send(Request::post("/checkout").key(&key).json(&body))
            .await
            .status,
        401
    );
    assert!(executions(&stack, &key).await.is_empty());
}

/// jwt_authn keeps verified tokens in its cache (`jwt_cache_config` in envoy.yaml.tmpl); a cached
/// token must still be refused once it has expired. Envoy allows 60 s of clock skew, in its cache
/// as in a full verification, so the token here expired 55 s ago: accepted and cached at first,
/// refused from the moment its expiry is 61 s past, before the filter or the checkout sees it.
async fn a_cached_token_is_refused_once_it_expires(stack: Stack) {
    const SKEW_S: u64 = 60;
    let unix_now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default()
    };
    let exp = unix_now() - (SKEW_S - 5);
    let token = mint_token("dave", exp);
    let c = client(&stack);
    let key = unique_key("jwt-cache");
    let body = charge_body(7);
    let send = || {
        c.send(
            Request::post("/checkout")
                .token(&token)
                .key(&key)
                .json(&body),
        )
    };
    let hits = || stack.envoy.counter("http.edge.jwt_authn.jwt_cache_hit");

    let first = send().await;
    assert_eq!(
        first.status,
        201,
        "a token {}s past its expiry is inside the skew: {}",
        unix_now() - exp,
        first.describe()
    );
    let hits_before = hits();
    let again = send().await;
    assert!(replayed(&again), "{}", again.describe());
    assert_eq!(
        hits(),
        hits_before + 1,
        "the retry's token came from the cache"
    );

    while unix_now() <= exp + SKEW_S + 1 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let late = send().await;
    assert_eq!(
        late.status,
        401,
        "a cached token {}s past its expiry: {}",
        unix_now() - exp,
        late.describe()
    );
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn bodies_over_the_limit_get_413_and_at_the_limit_pass(stack: Arc<Stack>) {
    let c = client(&stack);
    let limit = 1_048_576usize;
    let exactly = |n: usize| {
        let head = br#"{"amount":1,"pad":""#;
        let tail = br#""}"#;
        let mut b = head.to_vec();
        b.resize(n - tail.len(), b'x');
        b.extend_from_slice(tail);
        b
    };
    let key = unique_key("limit");
    let at_limit = c
        .send(
            Request::post("/checkout")
                .token(&token("alice"))
                .key(&key)
                .header("content-type", "application/json")
                .body(exactly(limit)),
        )
        .await;
    assert_eq!(
        at_limit.status,
        201,
        "a body of exactly the limit passes: {}",
        at_limit.describe()
    );
    let ran = executions(&stack, &key).await;
    assert_eq!(ran[0]["body_len"], limit);

    let key = unique_key("over");
    let over = c
        .send(
            Request::post("/checkout")
                .token(&token("alice"))
                .key(&key)
                .header("content-type", "application/json")
                .body(exactly(limit + 1)),
        )
        .await;
    assert_problem(&over, 413, "payload-too-large", &stack);
    // Chunked (no Content-Length): the filter counts while buffering.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = exactly(limit + 1)
        .chunks(64 * 1024)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let chunked = c
        .send(
            Request::post("/checkout")
                .token(&token("alice"))
                .key(&key)
                .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks))),
        )
        .await;
    assert_problem(&chunked, 413, "payload-too-large", &stack);
    assert!(executions(&stack, &key).await.is_empty());
}

async fn declined_card_is_replayed_not_rerun(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("declined");
    // The demo checkout always declines this card.
    let body = json!({"amount": 990, "card": {"number": "4000000000000002"}});
    let first = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(first.status, 402, "{}", first.describe());
    assert_eq!(first.json(), json!({"error": "card_declined"}));
    let retry = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(retry.status, 402);
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("idempotent-replayed").as_deref(), Some("true"));
    assert_eq!(
        executions(&stack, &key).await.len(),
        1,
        "a declined card is a result, not a reason to run again"
    );
}

async fn multi_chunk_bodies_arrive_whole(stack: Arc<Stack>, http2: bool) {
    let c = if http2 {
        Client::http2(&stack.envoy.url(""))
    } else {
        client(&stack)
    };
    for size in [64 * 1024 + 17, 700 * 1024] {
        let key = unique_key(if http2 { "h2-chunks" } else { "h1-chunks" });
        // Valid JSON with varied bytes, sent in uneven chunks without a Content-Length.
        let mut body = br#"{"amount":1,"pad":""#.to_vec();
        body.extend(
            (0..size).map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[(i * 7 + i / 13) % 36]),
        );
        body.extend_from_slice(br#""}"#);
        let expected = sha256_hex(&body);
        let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
            body.chunks(16 * 1024 + 3).map(|c| Ok(c.to_vec())).collect();
        let answer = c
            .send(
                Request::post("/checkout")
                    .token(&token("alice"))
                    .key(&key)
                    .header("content-type", "application/json")
                    .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks))),
            )
            .await;
        assert_eq!(
            answer.status,
            201,
            "{}\n{}",
            answer.describe(),
            stack.logs()
        );
        let ran = executions(&stack, &key).await;
        assert_eq!(ran.len(), 1);
        assert_eq!(
            ran[0]["body_len"],
            body.len(),
            "bytes lost between the client and the upstream"
        );
        assert_eq!(
            ran[0]["body_sha256"],
            expected.as_str(),
            "the upstream must receive the exact body"
        );
        assert_eq!(ran[0]["idempotency_key"], key.as_str());
    }
}

async fn hostile_bodies_do_not_kill_the_filter(stack: Arc<Stack>) {
    let c = client(&stack);
    let deep_array = "[".repeat(100_000) + &"]".repeat(100_000);
    let deep_object = "{\"a\":".repeat(100_000) + "1" + &"}".repeat(100_000);
    let hostile: Vec<(&str, Vec<u8>, &[u16])> = vec![
        (
            "duplicate member",
            br#"{"amount":1,"amount":2}"#.to_vec(),
            &[400],
        ),
        (
            "nested duplicate member",
            br#"{"a":{"b":1,"b":1}}"#.to_vec(),
            &[400],
        ),
        ("100,000-deep array", deep_array.into_bytes(), &[201, 400]),
        ("100,000-deep object", deep_object.into_bytes(), &[201, 400]),
        ("invalid JSON", b"{\"amount\": 1,".to_vec(), &[400]),
        (
            "invalid UTF-8",
            b"{\"amount\": \"\xff\xfe\"}".to_vec(),
            &[400],
        ),
        (
            "lone surrogate",
            br#"{"amount": "\ud800"}"#.to_vec(),
            &[201, 400],
        ),
        (
            "huge number",
            format!("{{\"amount\": 1{}}}", "0".repeat(5000)).into_bytes(),
            &[201, 400],
        ),
        (
            "huge exponent",
            br#"{"amount": 1e999999999999999999}"#.to_vec(),
            &[201, 400],
        ),
        ("NUL bytes", b"\0\0\0\0".to_vec(), &[400]),
        ("empty", Vec::new(), &[400]),
    ];
    for (what, body, allowed) in hostile {
        let key = unique_key("hostile");
        let answer = c
            .send(
                Request::post("/checkout")
                    .token(&token("alice"))
                    .key(&key)
                    .header("content-type", "application/json")
                    .body(body),
            )
            .await;
        assert!(
            allowed.contains(&answer.status),
            "{what}: {}",
            answer.describe()
        );
        // A normal request still works after each one: the Wasm VM is alive.
        let ok = c
            .send(checkout(
                &unique_key("after-hostile"),
                "alice",
                &charge_body(1),
            ))
            .await;
        assert_eq!(
            ok.status,
            201,
            "after {what}: {}\n{}",
            ok.describe(),
            stack.envoy.log_tail()
        );
    }
}

async fn unprotected_routes_pass_through(stack: Arc<Stack>) {
    let c = client(&stack);
    let list = c
        .send(Request::get("/charges").token(&token("alice")))
        .await;
    assert_eq!(list.status, 200, "{}", list.describe());
    assert!(list.json().is_array());
    // Not a protected route: passed through untouched, with or without a token.
    let bare = c.send(Request::get("/charges")).await;
    assert_eq!(bare.status, 200, "{}", bare.describe());
    assert_eq!(bare.body, list.body);
}

/// Issue 48: the demo's `PUT`, `PATCH` and `DELETE /subscriptions/{id}` routes (the methods
/// Stripe's v2 API keys) get the answers `POST /checkout` gets: one execution, replays, 422 for
/// another request under the key (a DELETE's query is part of the request), 409 while the
/// first runs. A DELETE carries no body at all: the filter claims it from its headers.
async fn put_patch_and_a_bodiless_delete_are_protected_as_post_is(stack: Arc<Stack>) {
    use reqwest::Method;
    let c = client(&stack);
    let subscription = unique_key("sub");
    let path = format!("/subscriptions/{subscription}");
    let write = |method: Method, key: &str, body: Option<serde_json::Value>| {
        let r = Request::with_method(method, &path)
            .token(&token("alice"))
            .key(key);
        match body {
            Some(b) => r.json(&b),
            None => r,
        }
    };
    let cases = [
        (Method::PUT, Some(json!({"plan": "gold", "quantity": 2}))),
        (Method::PATCH, Some(json!({"quantity": 3}))),
        (Method::DELETE, None),
    ];
    for (method, body) in cases {
        let key = unique_key(&format!("sub-{}", method.as_str().to_ascii_lowercase()));
        let first = c.send(write(method.clone(), &key, body.clone())).await;
        assert_eq!(first.status, 201, "{method}: {}", first.describe());
        assert!(!replayed(&first));
        assert_eq!(first.header("location").as_deref(), Some(path.as_str()));
        let retry = c.send(write(method.clone(), &key, body.clone())).await;
        assert!(replayed(&retry), "{method}: {}", retry.describe());
        assert_eq!(
            retry.body, first.body,
            "{method}: the replay is byte-identical"
        );
        // Another request under the same key: another body, or for the DELETE another query.
        let other = match &body {
            Some(_) => write(method.clone(), &key, Some(json!({"plan": "bronze"}))),
            None => write(method.clone(), &key, None).path(&format!("{path}?prorate=true")),
        };
        let mismatch = c.send(other).await;
        assert_problem(&mismatch, 422, "idempotency-key-reused", &stack);
        let ran = executions(&stack, &key).await;
        assert_eq!(ran.len(), 1, "{method}: one execution for one key: {ran:?}");
        let kind = format!("subscription.{}", method.as_str().to_ascii_lowercase());
        assert_eq!(ran[0]["kind"], kind.as_str(), "{ran:?}");
        assert_eq!(ran[0]["subject"], "alice");
    }
    // A duplicate of a DELETE still running: 409 at once, and one execution.
    let key = unique_key("sub-delete-slow");
    let slow = send_in_background(&c, write(Method::DELETE, &key, None).delay_ms(3_000));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let duplicate = c.send(write(Method::DELETE, &key, None)).await;
    assert_problem(&duplicate, 409, "request-in-progress", &stack);
    let first = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    let after = c.send(write(Method::DELETE, &key, None)).await;
    assert!(replayed(&after), "{}", after.describe());
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Tests with a stack of their own

async fn dead_state_api_gives_503_and_no_upstream_call(mut stack: Stack) {
    let c = client(&stack);
    let key = unique_key("dead-api");
    let body = charge_body(300);
    stack.state_api.kill();
    let answer = c.send(checkout(&key, "alice", &body)).await;
    assert_problem(&answer, 503, "idempotency-state-unavailable", &stack);
    assert!(
        answer.header("retry-after").is_some(),
        "{}",
        answer.describe()
    );
    assert!(
        executions(&stack, &key).await.is_empty(),
        "fail closed: nothing may reach the upstream"
    );
    stack.restart_state_api().unwrap_or_else(|e| panic!("{e}"));
    let after = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(
        after.status,
        201,
        "a 503 must not burn the key: {}",
        after.describe()
    );
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn key_of_a_killed_envoy_is_409_until_its_lease_ends(mut stack: Stack) {
    let lease = Duration::from_millis(stack.options.lease_ms);
    let key = unique_key("orphan");
    let body = charge_body(800);
    let sent_at = std::time::Instant::now();
    let orphan = {
        let c = client(&stack);
        let req = checkout(&key, "alice", &body).delay_ms(2_000);
        tokio::spawn(async move { c.try_send(req).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    stack.envoy.kill();
    let _ = orphan.await;
    stack.restart_envoy().unwrap_or_else(|e| panic!("{e}"));
    let c = client(&stack);
    let during = c.send(checkout(&key, "alice", &body)).await;
    assert!(
        sent_at.elapsed() < lease,
        "Envoy took too long to restart for this test to mean anything"
    );
    assert_problem(&during, 409, "request-in-progress", &stack);
    // No heartbeat extends the dead Envoy's lease: poll until it runs out. Then the outcome is
    // unknown and the retry asks the checkout, which never charged (its handler was dropped
    // with Envoy's connection): the retry runs, once, with a larger token.
    let mut after = None;
    while sent_at.elapsed() < lease * 4 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let a = c.send(checkout(&key, "alice", &body)).await;
        if a.status != 409 {
            after = Some(a);
            break;
        }
        assert_problem(&a, 409, "request-in-progress", &stack);
    }
    let after = after.unwrap_or_else(|| panic!("never reconciled\n{}", stack.logs()));
    assert!(
        sent_at.elapsed() >= lease,
        "answered after {:?}, before the lease ({lease:?}) ran out",
        sent_at.elapsed()
    );
    assert_eq!(after.status, 201, "{}\n{}", after.describe(), stack.logs());
    assert!(!replayed(&after), "it ran now: {}", after.describe());
    let ran = executions(&stack, &key).await;
    assert_eq!(ran.len(), 1, "one charge: {ran:?}");
    let of_key = attempts(&stack, &key).await;
    let states: Vec<&str> = of_key.iter().filter_map(|a| a["state"].as_str()).collect();
    assert_eq!(states, ["abandoned", "executed"], "{of_key:?}");
    let tokens: Vec<i64> = of_key
        .iter()
        .filter_map(|a| a["fencing_token"].as_i64())
        .collect();
    assert!(
        tokens.len() == 2 && tokens[0] < tokens[1],
        "the retry carries a larger fencing token: {tokens:?}"
    );
}

async fn heartbeats_keep_a_slow_request_from_being_reclaimed(stack: Stack) {
    let c = client(&stack);
    let key = unique_key("heartbeat");
    let body = charge_body(900);
    // The request stays upstream for 3x the lease; heartbeats must keep the claim alive.
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(6_000));
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let dup = c.send(checkout(&key, "alice", &body)).await;
        assert_problem(&dup, 409, "request-in-progress", &stack);
    }
    let first = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    assert_eq!(
        executions(&stack, &key).await.len(),
        1,
        "a live owner must never be reclaimed"
    );
}

/// The filter answers replays of completed records from its worker's cache (a completed record
/// never changes until its retention expiry). A cached replay still checks the fingerprint (422)
/// and the scope (subject, endpoint); while the state API is down, exactly the cached keys are
/// still answered (intended: their answer cannot change), every other key gets 503.
async fn replay_cache_answers_cached_keys_only(mut stack: Stack) {
    let c = client(&stack);
    let hits = |s: &Stack| s.envoy.filter_counter("replay_cache_hits");
    let key = unique_key("cache");
    let body = charge_body(4321);
    let first = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(first.status, 201, "{}\n{}", first.describe(), stack.logs());
    assert_eq!(hits(&stack), 0);
    // The filter's own complete filled the cache: the retry needs no callout.
    let retry = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(
        (retry.status, &retry.body),
        (201, &first.body),
        "{}",
        retry.describe()
    );
    assert_eq!(retry.header("idempotent-replayed").as_deref(), Some("true"));
    assert_eq!(hits(&stack), 1, "the replay came from the cache");
    let changed = c.send(checkout(&key, "alice", &charge_body(4322))).await;
    assert_problem(&changed, 422, "idempotency-key-reused", &stack);
    assert_eq!(hits(&stack), 2, "the 422 came from the cache too");
    // The same key for another subject or another endpoint is another record.
    let bob = c.send(checkout(&key, "bob", &body)).await;
    let refunded = c.send(refund(&key, "alice", &body)).await;
    for a in [&bob, &refunded] {
        assert_eq!(a.status, 201, "{}", a.describe());
        assert_eq!(
            a.header("idempotent-replayed"),
            None,
            "a cached record must not answer another scope"
        );
    }
    assert_eq!(executions(&stack, &key).await.len(), 3);

    // A key completed through another Envoy is in that Envoy's cache only.
    let other = stack
        .start_extra_envoy(stack.state_api.port, "envoy-other")
        .unwrap_or_else(|e| panic!("{e}"));
    let c2 = Client::new(&other.url(""));
    let elsewhere = unique_key("cache-elsewhere");
    assert_eq!(
        c2.send(checkout(&elsewhere, "alice", &body)).await.status,
        201
    );

    stack.state_api.kill();
    let cached = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(
        (cached.status, &cached.body),
        (201, &first.body),
        "cached keys replay without the state API: {}",
        cached.describe()
    );
    assert_eq!(
        cached.header("idempotent-replayed").as_deref(),
        Some("true")
    );
    assert_problem(
        &c.send(checkout(&key, "alice", &charge_body(4322))).await,
        422,
        "idempotency-key-reused",
        &stack,
    );
    let bob_again = c.send(checkout(&key, "bob", &body)).await;
    assert_eq!(
        (bob_again.status, &bob_again.body),
        (201, &bob.body),
        "bob gets his own record, never alice's"
    );
    let not_cached = c.send(checkout(&elsewhere, "alice", &body)).await;
    assert_problem(&not_cached, 503, "idempotency-state-unavailable", &stack);
    let new_key = c
        .send(checkout(&unique_key("cache-new"), "alice", &body))
        .await;
    assert_problem(&new_key, 503, "idempotency-state-unavailable", &stack);
    let there = c2.send(checkout(&elsewhere, "alice", &body)).await;
    assert_eq!(
        there.header("idempotent-replayed").as_deref(),
        Some("true"),
        "{}",
        there.describe()
    );
    assert_eq!(executions(&stack, &key).await.len(), 3, "nothing ran again");
    assert_eq!(executions(&stack, &elsewhere).await.len(), 1);
}

/// `complete_in_background`: the response goes on before its outcome is stored, and the worker
/// stores it at once. Retries on the same connection (worker) get the replay from its memory
/// meanwhile; another Envoy gets 409 until the outcome is stored, then the replay; nothing runs
/// twice.
async fn complete_in_background_answers_first_and_stores_right_after(stack: Stack) {
    const KEYS: usize = 20;
    let counter = |name: &str| stack.envoy.filter_counter(name);
    let body = charge_body(2500);
    let keys: Vec<String> = (0..KEYS).map(|_| unique_key("background")).collect();
    // Connections each worker accepted; the harness's readiness probes are in the first reading.
    let per_worker = || {
        stack
            .envoy
            .counters("^listener\\..*\\.worker_[0-9]\\.downstream_cx_total$")
    };
    let before = per_worker();
    let mut firsts = Vec::new();
    for key in &keys {
        // A connection of its own, so the keys spread over both workers. HTTP/2: every request
        // of this key rides that one connection, so the retries reach the same worker (an
        // HTTP/1 pool may open a second connection, which can land on the other worker).
        let c = Client::http2(&stack.envoy.url(""));
        let first = c.send(checkout(key, "alice", &body)).await;
        assert_eq!(first.status, 201, "{}\n{}", first.describe(), stack.logs());
        assert_eq!(first.header("idempotent-replayed"), None);
        // At once, on the same Envoy: its memory (or the stored record) replays it.
        let again = c.send(checkout(key, "alice", &body)).await;
        assert_eq!(
            (again.status, &again.body),
            (201, &first.body),
            "{}",
            again.describe()
        );
        assert!(replayed(&again), "{}", again.describe());
        assert_problem(
            &c.send(checkout(key, "alice", &charge_body(2501))).await,
            422,
            "idempotency-key-reused",
            &stack,
        );
        firsts.push(first);
    }
    // Each worker stores its completes at once, not at its next tick (7.5 s away at most).
    let answered = std::time::Instant::now();
    while counter("completed") < KEYS as u64 && answered.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        counter("completed"),
        KEYS as u64,
        "completes were not sent within 2 s of the last response\n{}",
        stack.logs()
    );
    let after = per_worker();
    assert!(
        before.len() == 2
            && after.len() == 2
            && after
                .iter()
                .all(|(worker, n)| before.get(worker).is_some_and(|b| b < n)),
        "both workers must have taken the keys' connections: {before:?} before, {after:?} after"
    );
    // Only the keys' connections ever speak HTTP/2.
    assert_eq!(
        stack.envoy.counter("http.edge.downstream_cx_http2_total"),
        KEYS as u64,
        "one connection per key, so each retry reached the worker of its first request"
    );

    // Another Envoy has no memory of these keys: it asks the state API, which must have the
    // stored outcome (or, for a moment, the key in progress: 409).
    let other = stack
        .start_extra_envoy(stack.state_api.port, "envoy-other")
        .unwrap_or_else(|e| panic!("{e}"));
    let c2 = Client::new(&other.url(""));
    for (key, first) in keys.iter().zip(&firsts) {
        let started = std::time::Instant::now();
        let elsewhere = loop {
            let a = c2.send(checkout(key, "alice", &body)).await;
            if a.status != 409 || started.elapsed() > Duration::from_secs(5) {
                break a;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            replayed(&elsewhere) && elsewhere.body == first.body,
            "{key} through another Envoy: {}\n{}",
            elsewhere.describe(),
            stack.logs()
        );
        assert_eq!(executions(&stack, key).await.len(), 1, "{key} ran twice");
    }
    assert_eq!(
        counter("completed"),
        KEYS as u64,
        "each stored once, by its worker"
    );
    assert_eq!(
        counter("complete_retries"),
        0,
        "no first attempt counts as a retry"
    );
    assert_eq!(counter("complete_gave_up"), 0);
    assert_eq!(
        counter("complete_held"),
        0,
        "the workers had room for every complete"
    );
    // The streams woke the worker through its shared queue (else the completes wait for a tick).
    let log = std::fs::read_to_string(&stack.envoy.log_path).unwrap_or_default();
    assert!(
        log.contains("responses go on before their outcome is stored")
            && !log.contains("no shared queue")
            && !log.contains("cannot wake the worker"),
        "{}",
        stack.logs()
    );
}

/// Concurrent new keys on one Envoy worker, each sent twice at once: the claims and completes
/// that queue behind the one on its way go as `/v1/writes` callouts of the
/// worker (answered to their streams from the root context), and every key runs once: one 201,
/// its twin a 409 or the replay, and every retry afterwards the replay.
async fn concurrent_new_keys_go_in_batches_and_each_is_charged_once(stack: Stack) {
    let c = client(&stack);
    let keys: Vec<String> = (0..48).map(|i| unique_key(&format!("batch-{i}"))).collect();
    let body = charge_body(1_500);
    let sends = keys.iter().flat_map(|k| {
        [
            checkout(k, "alice", &body).delay_ms(200),
            checkout(k, "alice", &body).delay_ms(200),
        ]
    });
    let answers = futures::future::join_all(sends.map(|r| c.send(r))).await;
    for (twins, key) in answers.chunks(2).zip(&keys) {
        let ran: Vec<_> = twins
            .iter()
            .filter(|a| a.status == 201 && a.header("idempotent-replayed").is_none())
            .collect();
        assert_eq!(
            ran.len(),
            1,
            "{key}: {:?}",
            twins.iter().map(|a| a.describe()).collect::<Vec<_>>()
        );
        for a in twins {
            assert!(a.status == 201 || a.status == 409, "{}", a.describe());
        }
        assert_eq!(executions(&stack, key).await.len(), 1, "{key}: one charge");
    }
    let counter = |name: &str| stack.envoy.filter_counter(name);
    let (claims, completes) = (counter("claims_batched"), counter("completes_batched"));
    eprintln!(
        "96 requests: {claims} claims in {} /v1/writes, {completes} completes in {} /v1/writes",
        counter("claim_batches"),
        counter("complete_batches")
    );
    assert!(
        counter("claim_batches") > 0 && claims > 0,
        "no claim was batched"
    );
    assert!(
        counter("complete_batches") > 0 && completes > 0,
        "no complete was batched"
    );
    assert_eq!(counter("claimed_for_ended_stream"), 0);
    for key in &keys {
        let again = c.send(checkout(key, "alice", &body)).await;
        assert_eq!(again.status, 201, "{}", again.describe());
        assert_eq!(again.header("idempotent-replayed").as_deref(), Some("true"));
        assert_eq!(
            executions(&stack, key).await.len(),
            1,
            "{key}: still one charge"
        );
    }
}
