//! What the upstream answers and how it reaches the filter, through the real Envoy: every
//! shape of answer is stored and replayed faithfully, or stored as not replayable, and never
//! leaves the key free to run again (the defects the simulation found, issue 12).

use contract::state_env;
use std::sync::Arc;

use e2e::client::{unique_key, Request};
use e2e::envoy::{Envoy, Tweak};
use e2e::stack::{token, Stack, StackOptions};
use e2e::testkit::*;
use edge::config::{KeyPolicy, Match, OnStateUnavailable, Route};
use libtest_mimic::{Arguments, Trial};

static SHARED: SharedStack = SharedStack::new(default_stack);

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        SHARED.trial(
            "a_response_cut_in_its_body_is_stored_not_replayable_and_never_runs_again",
            cut_in_its_body,
        ),
        SHARED.trial(
            "a_location_too_long_to_store_makes_the_outcome_not_replayable",
            location_too_long,
        ),
        SHARED.trial(
            "a_gzip_response_is_replayed_with_its_encoding",
            gzip_is_replayed_with_its_encoding,
        ),
        SHARED.trial(
            "an_empty_body_ended_by_an_empty_chunk_is_replayed",
            empty_chunked_body_is_replayed,
        ),
        SHARED.trial(
            "a_status_outside_100_599_is_stored_and_replayed",
            three_digit_status,
        ),
        SHARED.trial(
            "the_same_bytes_as_another_media_type_are_another_request",
            media_type_is_part_of_the_request,
        ),
        SHARED.trial(
            "a_client_sent_fencing_token_endpoint_or_fingerprint_never_reaches_the_upstream",
            forged_forwarded_headers_are_removed,
        ),
        own(
            "a_refused_claim_is_500_and_an_endpoint_too_long_is_414_even_where_the_route_fails_open",
            StackOptions {
                // The filter presents another token than the state API expects: every claim
                // is refused (401), a configuration error and not an outage.
                state_api_env: vec![(state_env::STATE_API_TOKEN.into(), "another-token".into())],
                // A protected prefix route that fails open (everything else passes through).
                tweak: Some(Tweak::new(|c| {
                    let mut pay = Route::new(
                        "POST",
                        Match::Prefix("/pay/".into()),
                        KeyPolicy::Required,
                    );
                    pay.on_state_unavailable = OnStateUnavailable::FailOpen;
                    c.routes.push(pay);
                })),
                ..StackOptions::default()
            },
            refused_and_too_long,
        ),
        own(
            "a_state_api_that_stores_smaller_bodies_than_the_filter_gets_them_not_replayable",
            StackOptions {
                state_api_env: vec![(state_env::STATE_API_MAX_BODY_BYTES.into(), "16".into())],
                ..StackOptions::default()
            },
            small_state_api_body_limit,
        ),
        Trial::test(
            "envoy_refuses_a_lease_the_state_api_would_not_grant",
            || block_on(lease_over_the_maximum_is_refused()),
        ),
    ];
    SHARED.run(&args, trials)
}

fn hooked(key: &str, hook: &str, value: &str) -> Request {
    checkout(key, "alice", &charge_body(1234)).header(hook, value)
}

async fn cut_in_its_body(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("cut");
    // The checkout executes, sends its headers and half the body, then drops the connection.
    let first = c.try_send(hooked(&key, "x-demo-reset-body", "1")).await;
    match &first {
        Ok(a) => assert!(
            a.status == 201 && a.body.len() < 60,
            "the client sees the headers then a broken body: {}",
            a.describe()
        ),
        Err(e) => eprintln!("the first answer broke off as expected: {e}"),
    }
    // The filter stored what it knew (status and headers), not replayable: a retry, now or
    // after any lease, is told so, and the checkout never runs again.
    for _ in 0..2 {
        let retry = c.send(checkout(&key, "alice", &charge_body(1234))).await;
        assert_problem(&retry, 409, "outcome-not-replayable", &stack);
        assert!(
            retry
                .header("location")
                .is_some_and(|l| l.starts_with("/charges/")),
            "the stored Location is given: {}",
            retry.describe()
        );
    }
    assert_eq!(executions(&stack, &key).await.len(), 1, "one charge");
}

async fn location_too_long(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("long-location");
    // Over the 8,192 bytes a stored header value may have (a long 3-D Secure redirect).
    let first = c.send(hooked(&key, "x-demo-location-bytes", "9000")).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    assert!(first.header("location").is_some_and(|l| l.len() > 9000));
    // A replay without its Location would not be the response: not replayable, never re-run.
    let retry = c.send(checkout(&key, "alice", &charge_body(1234))).await;
    assert_problem(&retry, 409, "outcome-not-replayable", &stack);
    assert_eq!(retry.header("location"), None, "{}", retry.describe());
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Read as _;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .unwrap_or_else(|e| panic!("not gzip: {e}"));
    out
}

async fn gzip_is_replayed_with_its_encoding(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("gzip");
    let req = || hooked(&key, "x-demo-gzip", "1").header("accept-encoding", "gzip");
    let first = c.send(req()).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    assert_eq!(first.header("content-encoding").as_deref(), Some("gzip"));
    let json: serde_json::Value = serde_json::from_slice(&gunzip(&first.body))
        .unwrap_or_else(|e| panic!("the first answer is gzip JSON: {e}"));
    assert_eq!(json["status"], "succeeded");
    let retry = c.send(req()).await;
    assert!(replayed(&retry), "{}", retry.describe());
    // The same bytes with the same encoding: the client can read its replay.
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("content-encoding").as_deref(), Some("gzip"));
    assert_eq!(retry.header("vary").as_deref(), Some("accept-encoding"));
    assert_eq!(gunzip(&retry.body), gunzip(&first.body));
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn empty_chunked_body_is_replayed(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("empty-chunk");
    let first = c.send(hooked(&key, "x-demo-empty-chunked", "1")).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    assert!(first.body.is_empty());
    // Stored as replayable (the empty end-of-stream frame has nothing to read), not 409.
    let retry = c.send(checkout(&key, "alice", &charge_body(1234))).await;
    assert_eq!(retry.status, 201, "{}\n{}", retry.describe(), stack.logs());
    assert!(replayed(&retry));
    assert!(retry.body.is_empty());
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn three_digit_status(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("status-799");
    let first = c.send(hooked(&key, "x-demo-status", "799")).await;
    let retry = c.send(checkout(&key, "alice", &charge_body(1234))).await;
    if first.status == 799 {
        // Envoy passes it on: stored (any three digits are) and replayed, never re-run.
        assert_eq!(retry.status, 799, "{}\n{}", retry.describe(), stack.logs());
        assert!(replayed(&retry));
    } else {
        // Envoy refused the upstream's answer itself: whatever it answered is the outcome.
        assert_eq!(retry.status, first.status, "{}", retry.describe());
    }
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn media_type_is_part_of_the_request(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("media");
    let body = b"amount=1200".to_vec();
    let send = |ct: &str| {
        Request::post("/checkout")
            .token(&token("alice"))
            .key(&key)
            .header("content-type", ct)
            .body(body.clone())
    };
    let first = c.send(send("text/plain")).await;
    assert_eq!(
        first.status,
        400,
        "the checkout wants JSON: {}",
        first.describe()
    );
    // The same bytes as another media type: another request under the same key.
    let other = c.send(send("application/x-www-form-urlencoded")).await;
    assert_problem(&other, 422, "idempotency-key-reused", &stack);
    // The same media type (its parameters aside) is the same request.
    let same = c.send(send("text/plain; charset=utf-8")).await;
    assert!(replayed(&same), "{}", same.describe());
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn forged_forwarded_headers_are_removed(stack: Arc<Stack>) {
    let c = client(&stack);
    // An unprotected route: the request passes, but neither the client's fencing token, endpoint
    // or fingerprint (the upstream records its attempts by them) nor a subject header it made
    // up (only a verified token sets that, on any route).
    let echoed = c
        .send(
            Request::post("/echo")
                .token(&token("alice"))
                .header("idempotency-fencing-token", "999999999")
                .header("idempotency-endpoint", "POST /checkout")
                .header("idempotency-fingerprint", "00")
                .header("x-jwt-sub", "mallory")
                .header("x-kept", "yes")
                .body(b"x".to_vec()),
        )
        .await;
    assert_eq!(echoed.status, 200, "{}", echoed.describe());
    let headers = echoed.json()["headers"].clone();
    let names: Vec<String> = headers
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p[0].as_str().map(str::to_owned))
        .collect();
    assert!(names.contains(&"x-kept".to_owned()), "{names:?}");
    assert!(!names.contains(&"x-jwt-sub".to_owned()), "{names:?}");
    for forwarded in contract::wire::FORWARDED_HEADERS {
        assert!(
            !names.iter().any(|n| n == forwarded),
            "the upstream may act on {forwarded}: only the filter's may reach it: {names:?}"
        );
    }
}

async fn refused_and_too_long(stack: Stack) {
    let c = client(&stack);
    let upstream_requests = || stack.envoy.counter("cluster.checkout.upstream_rq_total");
    let before = upstream_requests();
    // A path too long for a record: 414 at the edge, before any claim.
    let long = format!("/pay/{}", "p".repeat(1100));
    let a = c
        .send(
            Request::post(&long)
                .token(&token("alice"))
                .key(&unique_key("long"))
                .json(&charge_body(1)),
        )
        .await;
    assert_problem(&a, 414, "endpoint-too-long", &stack);
    // A claim the state API refuses (here a wrong bearer token): 500, not a 503 to retry, and
    // never forwarded, though the route fails open when the state API is down.
    let refused = c
        .send(
            Request::post("/pay/now")
                .token(&token("alice"))
                .key(&unique_key("refused"))
                .json(&charge_body(1)),
        )
        .await;
    assert_problem(&refused, 500, "internal-error", &stack);
    assert_eq!(
        stack.envoy.filter_counter("claim_refused"),
        1,
        "{}",
        stack.logs()
    );
    let checkout = c
        .send(checkout(&unique_key("refused"), "alice", &charge_body(1)))
        .await;
    assert_problem(&checkout, 500, "internal-error", &stack);
    assert_eq!(upstream_requests(), before, "nothing was forwarded");
}

async fn small_state_api_body_limit(stack: Stack) {
    let c = client(&stack);
    let key = unique_key("small-limit");
    // The checkout's answer is about 80 bytes; this state API stores 16 (the filter allows
    // 1 MiB): the claim's answer says so, and the outcome is stored without its body.
    let first = c.send(checkout(&key, "alice", &charge_body(4321))).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    assert!(first.body.len() > 16);
    let retry = c.send(checkout(&key, "alice", &charge_body(4321))).await;
    assert_problem(&retry, 409, "outcome-not-replayable", &stack);
    assert_eq!(executions(&stack, &key).await.len(), 1);
    assert_eq!(stack.envoy.filter_counter("complete_gave_up"), 0);
}

async fn lease_over_the_maximum_is_refused() {
    let dir = e2e::stack::run_dir("lease-refused").unwrap_or_else(|e| panic!("{e}"));
    let stack_params = Stack::envoy_params_for(
        &StackOptions {
            lease_ms: 900_000,
            heartbeat_ms: 10_000,
            ..StackOptions::default()
        },
        e2e::net::free_port(),
        e2e::net::free_port(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let started = Envoy::start(stack_params, &dir, "envoy");
    let Err(why) = started else {
        panic!("Envoy started with a lease of 900 s");
    };
    assert!(
        why.contains("lease_ms must be 1000 to 600000"),
        "the log names the field: {why}"
    );
}
