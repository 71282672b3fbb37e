//! Unknown outcomes through the real Envoy, state API, Postgres and checkout (issue 13): a
//! request that was forwarded and whose outcome the edge never saw is never run again just
//! because a lease ran out. `POST /checkout` reconciles with the checkout
//! (`GET /checkout/attempts/{key}`), `POST /refunds` holds the key (409 `outcome-unknown`), and
//! a route that chose `reexecute` runs it again with a larger fencing token, which the checkout
//! uses to refuse the late orphan.

use std::time::{Duration, Instant};

use e2e::client::{unique_key, Answer, Client};
use e2e::envoy::{Envoy, Tweak};
use e2e::faults::{record_figures, DelayProxy, ProxyMode};
use e2e::stack::{Stack, StackOptions};
use e2e::testkit::*;
use edge::config::{Endpoint, OnUnknown, Reconcile};
use libtest_mimic::{Arguments, Trial};

const SUITE: &str = "unknown";

fn main() {
    let args = Arguments::from_args();
    let trials: Vec<Trial> = vec![
        own(
            "the_seed_story_a_45_s_checkout_retried_every_3_s_charges_once_then_replays_it",
            StackOptions::default(),
            seed_story_reconciled,
        ),
        own(
            "on_a_held_route_the_refund_runs_once_and_retries_get_409_outcome_unknown",
            StackOptions::default(),
            held_route,
        ),
        own(
            "a_reconcile_endpoint_down_slow_or_answering_garbage_is_503_nothing_forwarded_key_kept",
            // A short lease: a claim still on its way as the client left becomes unknown soon.
            StackOptions {
                lease_ms: 3_000,
                heartbeat_ms: 1_000,
                ..StackOptions::default()
            },
            broken_reconcile_endpoint,
        ),
        own(
            "a_late_orphan_with_a_stale_fencing_token_cannot_charge_after_a_re_executed_attempt",
            StackOptions {
                // POST /checkout re-executes unknown outcomes here (it reconciles in the demo).
                tweak: Some(Tweak::new(|c| {
                    let route = &mut c.routes[0];
                    route.on_unknown = OnUnknown::Reexecute;
                    route.reconcile = None;
                })),
                ..StackOptions::default()
            },
            late_orphan_is_fenced,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// The first attempt of a story: sent by a client that gives up after `patience`.
async fn give_up_after(stack: &Stack, patience: Duration, req: e2e::client::Request) {
    let impatient = Client::impatient(&stack.envoy.url(""), patience);
    let first = impatient.try_send(req).await;
    assert!(
        first.is_err(),
        "the client gives up before the answer: {:?}",
        first.map(|a| a.describe())
    );
}

/// The filter's log lines about unknown outcomes, checked never to hold the key.
fn unknown_log_lines(envoy: &Envoy, key: &str) -> Vec<String> {
    let log = std::fs::read_to_string(&envoy.log_path).unwrap_or_default();
    let lines: Vec<String> = log
        .lines()
        .filter(|l| l.contains("outcome unknown"))
        .map(str::to_owned)
        .collect();
    for l in &lines {
        assert!(!l.contains(key), "a log line holds the key: {l}");
    }
    lines
}

async fn seed_story_reconciled(stack: Stack) {
    // The seeds' story: the checkout takes 45 s, the app gives up after 2 s and retries every
    // 3 s. The checkout does not stop when its caller leaves (x-demo-detach) and charges at 45 s.
    let key = unique_key("seed-story");
    let body = charge_body(4500);
    let upstream = Duration::from_secs(45);
    let started = Instant::now();
    give_up_after(
        &stack,
        Duration::from_secs(2),
        checkout(&key, "alice", &body)
            .delay_ms(upstream.as_millis() as u64)
            .header("x-demo-detach", "1"),
    )
    .await;
    let c = client(&stack);
    let mut held = 0u32;
    let mut replay: Option<Answer> = None;
    while started.elapsed() < Duration::from_secs(90) {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let a = c.send(checkout(&key, "alice", &body)).await;
        let charges = executions(&stack, &key).await;
        assert!(
            charges.len() <= 1,
            "a second charge: {charges:?}\n{}",
            stack.logs()
        );
        if a.status == 409 {
            // The lease is long (30 s) but the outcome was marked unknown as the client left:
            // the retry asks the checkout, which says the attempt is still running.
            assert_problem(&a, 409, "request-in-progress", &stack);
            assert!(a.header("retry-after").is_some(), "{}", a.describe());
            assert!(
                started.elapsed() < upstream + Duration::from_secs(5),
                "still 409 after the checkout finished: {}",
                a.describe()
            );
            held += 1;
            continue;
        }
        replay = Some(a);
        break;
    }
    let replay = replay.unwrap_or_else(|| panic!("no outcome within 90 s\n{}", stack.logs()));
    let charges = executions(&stack, &key).await;
    assert_eq!(charges.len(), 1, "exactly one charge: {charges:?}");
    assert!(
        replay.status == 201 && replayed(&replay),
        "once the checkout has finished, the real outcome as a replay: {}",
        replay.describe()
    );
    assert_eq!(replay.json()["id"], charges[0]["id"]);
    assert!(
        started.elapsed() >= upstream,
        "not before the charge happened"
    );
    assert_eq!(attempt_states(&stack, &key).await, ["executed"]);
    // Stored: the next retry is a plain replay, without asking the checkout again.
    let reconciled = stack.envoy.filter_counter("reconcile_executed");
    let again = c.send(checkout(&key, "alice", &body)).await;
    assert!(
        replayed(&again) && again.body == replay.body,
        "{}",
        again.describe()
    );
    assert_eq!(stack.envoy.filter_counter("reconcile_executed"), reconciled);
    let counters = stack
        .envoy
        .counters("wasmcustom.idempotency.(outcome_unknown|reconcile_)");
    assert!(counters.values().sum::<u64>() > 0, "{counters:?}");
    assert!(stack.envoy.filter_counter("outcome_unknown") >= 1);
    assert!(stack.envoy.filter_counter("reconcile_running") >= 1);
    assert!(reconciled >= 1);
    let lines = unknown_log_lines(&stack.envoy, &key);
    assert!(
        lines.iter().any(|l| l.contains("subject alice")
            && l.contains("POST /checkout")
            && l.contains("token")),
        "a log line per unknown key with its subject, endpoint and token: {lines:?}"
    );
    record_figures(
        SUITE,
        "seed_story",
        serde_json::json!({"upstream_ms": upstream.as_millis() as u64, "client_gives_up_ms": 2000, "retry_every_ms": 3000,
               "retries_409": held, "replayed_after_ms": started.elapsed().as_millis() as u64, "charges": charges.len(),
               "counters": counters}),
    );
}

async fn held_route(stack: Stack) {
    let key = unique_key("held");
    let body = charge_body(700);
    let upstream = Duration::from_secs(4);
    let started = Instant::now();
    give_up_after(
        &stack,
        Duration::from_secs(1),
        refund(&key, "alice", &body)
            .delay_ms(upstream.as_millis() as u64)
            .header("x-demo-detach", "1"),
    )
    .await;
    let c = client(&stack);
    let mut answers = Vec::new();
    while started.elapsed() < upstream * 2 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let a = c.send(refund(&key, "alice", &body)).await;
        answers.push(a.problem_type().unwrap_or_else(|| a.status.to_string()));
        if a.status == 409 && is_problem(&a, 409, "outcome-unknown") {
            assert!(
                a.text().contains("new key"),
                "the detail tells the client not to retry with a new key: {}",
                a.describe()
            );
            continue;
        }
        // A claim slower than the filter's callout timeout (this suite runs four stacks on two
        // cores) is a 503 with nothing forwarded: not a run either.
        if is_problem(&a, 503, "idempotency-state-unavailable") {
            continue;
        }
        // Only the moment between the client leaving and the filter's mark may still be 409
        // in progress; never a run.
        assert_problem(&a, 409, "request-in-progress", &stack);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{}",
            a.describe()
        );
    }
    let ran = executions(&stack, &key).await;
    assert_eq!(ran.len(), 1, "the refund ran once, on its own: {ran:?}");
    assert!(
        answers
            .iter()
            .rev()
            .take(3)
            .all(|t| t.ends_with("outcome-unknown")),
        "held until resolved, also after the refund finished: {answers:?}"
    );
    assert!(stack.envoy.filter_counter("outcome_unknown_409") >= 3);
    record_figures(
        SUITE,
        "held_route",
        serde_json::json!({"answers": answers, "refunds": ran.len()}),
    );
}

/// Sends `req()` again while it is answered 409 (the key in progress), for at most 8 s.
async fn past_409(c: &Client, req: impl Fn() -> e2e::client::Request) -> Answer {
    let asked = Instant::now();
    loop {
        let a = c.send(req()).await;
        if a.status != 409 || asked.elapsed() > Duration::from_secs(8) {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn broken_reconcile_endpoint(stack: Stack) {
    // The reconcile endpoint behind a proxy the test controls: another Envoy whose guarded
    // route asks the checkout through it.
    let proxy =
        DelayProxy::start(stack.checkout.port, ProxyMode::HangUp).unwrap_or_else(|e| panic!("{e}"));
    let proxy_port = proxy.port;
    let options = StackOptions {
        // POST /checkout asks the checkout through the proxy: a reconcile endpoint of its own.
        tweak: Some(Tweak::new(move |c| {
            c.routes[0].reconcile = Some(Reconcile {
                method: "GET".into(),
                path: "/checkout/attempts/{key}".into(),
                upstream: Some(Endpoint {
                    tls: false,
                    host: "127.0.0.1".into(),
                    port: proxy_port,
                }),
                timeout_ms: 1000,
            });
        })),
        ..stack.options.clone()
    };
    let params = Stack::envoy_params_for(&options, stack.state_api.port, stack.checkout.port)
        .unwrap_or_else(|e| panic!("{e}"));
    let envoy = Envoy::start(params, &stack.dir, "envoy-guarded").unwrap_or_else(|e| panic!("{e}"));
    let guarded = |key: &str| checkout(key, "alice", &charge_body(300));
    let key = unique_key("guarded");
    // The client leaves before the checkout commits (not detached: the checkout drops it).
    let impatient = Client::impatient(&envoy.url(""), Duration::from_millis(800));
    let first = impatient.try_send(guarded(&key).delay_ms(3_000)).await;
    assert!(first.is_err(), "{:?}", first.map(|a| a.describe()));
    // Marked unknown as the client left (or, had the claim still been on its way, once its
    // lease ran out).
    let waited = Instant::now();
    while record_state(&stack, &key, "POST /checkout").await != "unknown" {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "never unknown\n{}",
            envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let c = Client::new(&envoy.url(""));
    let mut figures = serde_json::Map::new();
    for (mode, label) in [
        (ProxyMode::HangUp, "down"),
        (ProxyMode::Blackhole, "slow"),
        (ProxyMode::Garbage, "garbage"),
    ] {
        proxy.set_mode(mode);
        // A heartbeat the owner sent before its mark and the state API answered after it makes
        // the record in progress again for one lease (3 s; nothing runs meanwhile): 409 until
        // its lease is over, then the reconcile.
        let a = past_409(&c, || guarded(&key)).await;
        assert_problem(&a, 503, "reconcile-unavailable", &stack);
        assert!(
            a.header("retry-after").is_some(),
            "{label}: {}",
            a.describe()
        );
        assert!(
            a.elapsed < Duration::from_millis(2_500),
            "{label}: within the reconcile timeout: {:?}",
            a.elapsed
        );
        assert!(
            executions(&stack, &key).await.is_empty(),
            "{label}: nothing forwarded"
        );
        assert_eq!(attempt_states(&stack, &key).await, ["abandoned"], "{label}");
        figures.insert(label.into(), serde_json::json!({"answer": a.status, "answered_after_ms": a.elapsed.as_millis() as u64}));
    }
    // The endpoint is back: the key was not burnt. The checkout says nothing ran: it runs once.
    // (The 503 goes to the client before the worker's unknown mark is stored: a retry sent at
    // once, not after its Retry-After, may still find the key in progress for a moment.)
    proxy.set_mode(ProxyMode::Pass);
    let a = past_409(&c, || guarded(&key)).await;
    assert!(
        a.status == 201 && !replayed(&a),
        "{}\n{}",
        a.describe(),
        envoy.log_tail()
    );
    let retry = c.send(guarded(&key)).await;
    assert!(
        replayed(&retry) && retry.body == a.body,
        "{}",
        retry.describe()
    );
    assert_eq!(executions(&stack, &key).await.len(), 1);
    assert_eq!(
        attempt_states(&stack, &key).await,
        ["abandoned", "executed"]
    );
    assert_eq!(envoy.filter_counter("reconcile_failed"), 3);
    assert_eq!(envoy.filter_counter("reconcile_not_executed"), 1);
    record_figures(
        SUITE,
        "broken_reconcile_endpoint",
        serde_json::Value::Object(figures),
    );
}

async fn late_orphan_is_fenced(stack: Stack) {
    let key = unique_key("orphan-fenced");
    let body = charge_body(99);
    let again = || checkout(&key, "alice", &body);
    // The orphan: still running (detached) when its client leaves, so its outcome is unknown.
    give_up_after(
        &stack,
        Duration::from_secs(1),
        again().delay_ms(4_000).header("x-demo-detach", "1"),
    )
    .await;
    // The filter says so at once (not at its next tick, 2.5 s away with these settings; the
    // lease is 30 s).
    let waited = Instant::now();
    while record_state(&stack, &key, "POST /checkout").await != "unknown" {
        assert!(
            waited.elapsed() < Duration::from_secs(2),
            "not marked unknown as the client left\n{}",
            stack.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The route re-executes unknown outcomes: the retry runs now, with a larger token.
    let c = client(&stack);
    let retry = c.send(again()).await;
    assert_eq!(retry.status, 201, "{}\n{}", retry.describe(), stack.logs());
    assert!(stack.envoy.filter_counter("reexecuted") >= 1);
    // The orphan wakes up to commit with its smaller token: the checkout refuses it.
    tokio::time::sleep(Duration::from_millis(4_000)).await;
    let charges = executions(&stack, &key).await;
    assert_eq!(
        charges.len(),
        1,
        "the late orphan did not charge: {charges:?}"
    );
    let of_key = attempts(&stack, &key).await;
    let states: Vec<&str> = of_key.iter().filter_map(|a| a["state"].as_str()).collect();
    assert_eq!(states, ["fenced", "executed"], "{of_key:?}");
    let tokens: Vec<i64> = of_key
        .iter()
        .filter_map(|a| a["fencing_token"].as_i64())
        .collect();
    assert!(tokens.len() == 2 && tokens[0] < tokens[1], "{tokens:?}");
    assert_eq!(
        charges[0]["fencing_token"].as_str(),
        Some(tokens[1].to_string().as_str()),
        "the charge is the re-executed attempt's"
    );
    // Its outcome is the one stored: a retry replays it.
    let replay = c.send(again()).await;
    assert!(
        replayed(&replay) && replay.body == retry.body,
        "{}",
        replay.describe()
    );
    record_figures(
        SUITE,
        "late_orphan",
        serde_json::json!({"attempts": states, "tokens": tokens, "charges": charges.len()}),
    );
}
