//! The fault suite: breaks parts of the real stack on purpose (SIGKILL of the state API, of
//! Postgres' postmaster and of Envoy; a slow state API behind a delay proxy; an upstream that
//! resets the connection; two Envoys and two state APIs on one database) and checks the promise:
//! a retry never charges twice, and every answer is a defined one while parts are down.
//!
//! Every test starts a stack of its own and runs alone (`--test-threads 1` unless told
//! otherwise): the timing checks must not compete with another stack for the two cores.
//! Each test records what it measured in `target/fault-figures.jsonl` (see docs/RELIABILITY.md).
//!
//! Run: `make chaos`, or `cargo test -p stack --test chaos` after `make build`.
//! `FAULT_SEED=<n>` repeats the random delays of a run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use e2e::client::{unique_key, Answer, Client, Request};
use e2e::faults::{executions_per_key, ledger, record_figures, DelayProxy, ProxyMode, Rng};
use e2e::services::ServiceTestExt as _;
use e2e::stack::{Stack, StackOptions};
use e2e::testkit::*;
use libtest_mimic::Arguments;
use serde_json::json;

const SUITE: &str = "chaos";

/// A short lease, so tests that wait for one to run out stay short.
fn short_lease() -> StackOptions {
    StackOptions {
        lease_ms: 3_000,
        heartbeat_ms: 1_000,
        ..StackOptions::default()
    }
}

fn main() {
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(1);
    }
    let trials = vec![
        own(
            "duplicate_storm_200_keys_x_10_concurrent_duplicates",
            StackOptions::default(),
            duplicate_storm,
        ),
        own(
            "state_api_sigkill_under_load_503_nothing_forwarded_keys_not_burned",
            short_lease(),
            state_api_killed_under_load,
        ),
        own(
            "postgres_sigkill_during_slow_request_one_charge_then_replay",
            StackOptions::default(),
            postgres_killed_during_slow_request,
        ),
        own(
            "envoy_sigkill_during_slow_request_409_then_reconciled_one_charge",
            short_lease(),
            envoy_killed_during_slow_request,
        ),
        own(
            "slow_state_api_answers_after_the_callout_timeout",
            short_lease(),
            slow_state_api,
        ),
        own(
            "upstream_reset_is_an_unknown_outcome_reconciled_and_replayed_not_rerun",
            StackOptions::default(),
            upstream_reset,
        ),
        own(
            "two_envoys_two_state_apis_one_postgres_one_charge",
            StackOptions::default(),
            two_envoys_two_state_apis,
        ),
        // The outcome cannot be stored at once because the state API or Postgres is down as the
        // upstream answers (the gap closed by the filter's worker-side complete retries).
        own(
            "lost_complete_state_api_killed_while_upstream_runs_is_stored_later",
            short_lease(),
            |s| lost_complete_state_api_down(s, "lost_complete_state_api_down"),
        ),
        own(
            "lost_complete_in_background_state_api_killed_while_upstream_runs_is_stored_later",
            StackOptions {
                complete_in_background: true,
                ..short_lease()
            },
            |s| lost_complete_state_api_down(s, "lost_complete_in_background_state_api_down"),
        ),
        own(
            "lost_complete_postgres_down_past_the_lease_is_stored_later",
            short_lease(),
            lost_complete_postgres_down,
        ),
        // An outage longer than the lease: the lease runs out with no outcome stored, and a
        // retry through another Envoy finds it unknown and reconciles (no second charge).
        own(
            "other_envoy_retries_right_after_an_outage_longer_than_the_lease_reconciles",
            short_lease(),
            gap_other_envoy_after_long_outage,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// Polls until `key` is no longer in progress (409) and the state API answers in time (no
/// 503), up to `limit`: the last answer, and how many 409s came before it.
async fn retry_until_settled(
    c: &Client,
    req: impl Fn() -> Request,
    limit: Duration,
) -> (Answer, u32) {
    let started = Instant::now();
    let mut answers_409 = 0;
    loop {
        let a = c.send(req()).await;
        // A 503 forwarded nothing (the state API too slow to answer in time, as a loaded
        // machine makes the first claims after a restart): the key is still free, ask again.
        let unavailable = a.status == 503;
        if !(a.status == 409 || unavailable) || started.elapsed() > limit {
            return (a, answers_409);
        }
        answers_409 += u32::from(!unavailable);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs blocking harness calls (process kills and restarts) without stalling the runtime.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

// ---------------------------------------------------------------------------------------------
// Duplicate storm

async fn duplicate_storm(stack: Stack) {
    const KEYS: usize = 200;
    const DUPLICATES: usize = 10;
    let c = client(&stack);
    let mut rng = Rng::from_env("duplicate_storm");
    // Per key: an upstream delay (0-300 ms) and, per duplicate, a start delay (0-50 ms).
    let plan: Vec<(String, u64, Vec<u64>)> = (0..KEYS)
        .map(|i| {
            (
                unique_key(&format!("storm{i}")),
                rng.below(300),
                (0..DUPLICATES).map(|_| rng.below(50)).collect(),
            )
        })
        .collect();
    let started = Instant::now();
    let results: Vec<(String, Vec<Answer>)> =
        futures::StreamExt::collect(futures::StreamExt::buffer_unordered(
            futures::stream::iter(plan.iter().enumerate().map(
                |(i, (key, upstream_ms, starts))| {
                    let c = c.clone();
                    let body = charge_body(1000 + i as u64);
                    async move {
                        let answers = futures::future::join_all(starts.iter().map(|start| {
                            let c = c.clone();
                            let req = checkout(key, "alice", &body).delay_ms(*upstream_ms);
                            async move {
                                tokio::time::sleep(Duration::from_millis(*start)).await;
                                c.send(req).await
                            }
                        }))
                        .await;
                        (key.clone(), answers)
                    }
                },
            )),
            // 12 keys at a time: 120 requests in flight.
            12,
        ))
        .await;
    let storm_time = started.elapsed();

    let mut tally: BTreeMap<&str, usize> = BTreeMap::new();
    let mut slowest_409 = Duration::ZERO;
    for (key, answers) in &results {
        let first: Vec<&Answer> = answers
            .iter()
            .filter(|a| classify(a) == "executed")
            .collect();
        assert!(
            first.len() <= 1,
            "{key}: two requests executed: {:?}",
            first.iter().map(|a| a.describe()).collect::<Vec<_>>()
        );
        for a in answers {
            let kind = classify(a);
            assert!(
                kind != "other" && kind != "unavailable_503",
                "{key}: unexpected answer {}\n{}",
                a.describe(),
                stack.logs()
            );
            if kind == "replay" {
                if let Some(f) = first.first() {
                    assert_eq!(
                        a.body, f.body,
                        "{key}: a replay differs from the first answer"
                    );
                }
            }
            if kind == "in_progress_409" {
                slowest_409 = slowest_409.max(a.elapsed);
            }
            *tally.entry(kind).or_insert(0) += 1;
        }
    }
    // A retry of every key afterwards: a replay, never a second charge.
    let retries = futures::future::join_all(
        plan.iter()
            .enumerate()
            .map(|(i, (key, _, _))| c.send(checkout(key, "alice", &charge_body(1000 + i as u64)))),
    )
    .await;
    for (a, (key, _, _)) in retries.iter().zip(&plan) {
        assert!(
            a.status == 201 && replayed(a),
            "{key}: the retry after the storm must be a replay: {}",
            a.describe()
        );
    }
    let per_key = executions_per_key(&ledger(&stack.checkout.url("")).await);
    let mut double = 0;
    let mut missing = 0;
    for (key, _, _) in &plan {
        match per_key.get(key).copied().unwrap_or(0) {
            1 => {}
            0 => missing += 1,
            _ => double += 1,
        }
    }
    let requests = KEYS * DUPLICATES + KEYS;
    record_figures(
        SUITE,
        "duplicate_storm",
        json!({"keys": KEYS, "duplicates_per_key": DUPLICATES, "requests": requests, "answers": tally, "retries_replayed": KEYS,
               "charges": per_key.iter().filter(|(k, _)| k.starts_with("storm")).map(|(_, n)| n).sum::<usize>(),
               "keys_charged_twice": double, "keys_never_charged": missing,
               "storm_seconds": storm_time.as_secs_f64(), "slowest_409_ms": slowest_409.as_millis() as u64}),
    );
    assert_eq!(double, 0, "keys charged more than once");
    assert_eq!(missing, 0, "keys never charged");
    assert_eq!(
        tally.get("executed").copied().unwrap_or(0),
        KEYS,
        "one executed answer per key"
    );
}

// ---------------------------------------------------------------------------------------------
// State API SIGKILL under load

async fn state_api_killed_under_load(mut stack: Stack) {
    const KEYS: usize = 400;
    /// Keys sent before the kill; the others wait for it, so each of them must get 503.
    const KILL_AFTER: usize = 150;
    const CONCURRENCY: usize = 16;
    let c = client(&stack);
    let timeout = Duration::from_millis(stack.options.state_api_timeout_ms);
    let keys: Vec<String> = (0..KEYS)
        .map(|i| unique_key(&format!("apikill{i}")))
        .collect();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (killed_tx, killed) = tokio::sync::watch::channel(false);
    let load = {
        let c = c.clone();
        let keys = keys.clone();
        let done = std::sync::Arc::clone(&done);
        tokio::spawn(async move {
            let answers: Vec<(usize, Answer, Instant)> =
                futures::StreamExt::collect(futures::StreamExt::buffer_unordered(
                    futures::stream::iter(keys.into_iter().enumerate().map(|(i, key)| {
                        let c = c.clone();
                        let done = std::sync::Arc::clone(&done);
                        let mut killed = killed.clone();
                        async move {
                            if i >= KILL_AFTER {
                                let _ = killed.wait_for(|k| *k).await;
                            }
                            let sent = Instant::now();
                            let a = c
                                .send(checkout(&key, "alice", &charge_body(i as u64 + 1)))
                                .await;
                            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            (i, a, sent)
                        }
                    })),
                    CONCURRENCY,
                ))
                .await;
            answers
        })
    };
    // Killed under load: with the last of the keys before KILL_AFTER still on their way.
    let wait_from = Instant::now();
    while done.load(std::sync::atomic::Ordering::SeqCst) < KILL_AFTER - CONCURRENCY
        && wait_from.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    blocking(|| stack.state_api.kill());
    let killed_at = Instant::now();
    let _ = killed_tx.send(true);
    let answers = load.await.unwrap_or_else(|e| panic!("load task: {e}"));
    let ledger_while_dead = executions_per_key(&ledger(&stack.checkout.url("")).await);

    let mut tally: BTreeMap<&str, usize> = BTreeMap::new();
    let mut slowest_503 = Duration::ZERO;
    let mut refused: Vec<usize> = Vec::new();
    for (i, a, sent) in &answers {
        let kind = classify(a);
        *tally.entry(kind).or_insert(0) += 1;
        match kind {
            "executed" => assert_eq!(
                ledger_while_dead.get(&keys[*i]).copied(),
                Some(1),
                "{}: executed once",
                keys[*i]
            ),
            "unavailable_503" => {
                slowest_503 = slowest_503.max(a.elapsed);
                assert!(
                    a.elapsed <= timeout + Duration::from_millis(700),
                    "a 503 took {:?}, over the callout timeout {timeout:?}",
                    a.elapsed
                );
                assert_eq!(
                    ledger_while_dead.get(&keys[*i]),
                    None,
                    "{}: answered 503 but reached the upstream",
                    keys[*i]
                );
                refused.push(*i);
            }
            // A claim committed just before the kill whose answer was lost cannot happen here
            // (each key is sent once), so nothing else is expected.
            _ => panic!("{}: unexpected answer {}", keys[*i], a.describe()),
        }
        if *i >= KILL_AFTER {
            assert!(*sent >= killed_at, "key {i} was sent before the kill");
            assert_eq!(
                kind, "unavailable_503",
                "a request sent after the kill must get 503"
            );
        }
    }
    assert!(
        refused.len() >= KEYS - KILL_AFTER,
        "every request sent after the kill must be refused: {tally:?}"
    );
    let errors_counted = stack.envoy.filter_counter("state_api_errors");
    assert!(
        errors_counted >= refused.len() as u64,
        "each 503 is counted in state_api_errors ({errors_counted} < {})",
        refused.len()
    );

    // Restart: every refused key works (a 503 must not burn a key). A claim that committed at
    // the moment of the kill may hold its key until its lease (3 s) runs out: then 409 first.
    blocking(|| stack.restart_state_api()).unwrap_or_else(|e| panic!("{e}"));
    let mut after: BTreeMap<&str, usize> = BTreeMap::new();
    let mut held_by_lost_claim = 0;
    for i in &refused {
        let (a, n409) = retry_until_settled(
            &c,
            || checkout(&keys[*i], "alice", &charge_body(*i as u64 + 1)),
            Duration::from_secs(10),
        )
        .await;
        if n409 > 0 {
            held_by_lost_claim += 1;
        }
        assert!(
            a.status == 201 && !replayed(&a),
            "{}: after the restart the key must execute: {}",
            keys[*i],
            a.describe()
        );
        *after.entry(classify(&a)).or_insert(0) += 1;
    }
    let per_key = executions_per_key(&ledger(&stack.checkout.url("")).await);
    let double = keys
        .iter()
        .filter(|k| per_key.get(*k).copied().unwrap_or(0) > 1)
        .count();
    let never = keys
        .iter()
        .filter(|k| per_key.get(*k).copied().unwrap_or(0) == 0)
        .count();
    record_figures(
        SUITE,
        "state_api_sigkill_under_load",
        json!({"keys": KEYS, "requests": answers.len() + refused.len(), "answers_during_load": tally, "answers_after_restart": after,
               "slowest_503_ms": slowest_503.as_millis() as u64, "callout_timeout_ms": timeout.as_millis() as u64,
               "refused_keys_held_by_a_lost_claim": held_by_lost_claim, "state_api_errors_counter": errors_counted,
               "charges": per_key.iter().filter(|(k, _)| k.starts_with("apikill")).map(|(_, n)| n).sum::<usize>(),
               "keys_charged_twice": double, "keys_never_charged": never}),
    );
    assert_eq!(double, 0);
    assert_eq!(never, 0);
}

// ---------------------------------------------------------------------------------------------
// Postgres SIGKILL

async fn postgres_killed_during_slow_request(mut stack: Stack) {
    let c = client(&stack);
    let key = unique_key("pgkill");
    let body = charge_body(4242);
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(8_000));
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    blocking(|| stack.postgres.kill_postmaster()).unwrap_or_else(|e| panic!("{e}"));
    let killed_at = Instant::now();
    // While Postgres is down: a new key gets 503 (fail closed), nothing forwarded.
    let other = unique_key("pgkill-other");
    let during = c.send(checkout(&other, "alice", &body)).await;
    assert_problem(&during, 503, "idempotency-state-unavailable", &stack);
    assert!(executions(&stack, &other).await.is_empty());
    tokio::time::sleep(Duration::from_millis(500)).await;
    blocking(|| stack.postgres.restart()).unwrap_or_else(|e| panic!("{e}"));
    let pg_down = killed_at.elapsed();
    // The state API reconnects by itself: no restart of it.
    let mut recovered = None;
    while killed_at.elapsed() < Duration::from_secs(20) {
        if e2e::envoy::http_get_blocking(stack.state_api.port, "/readyz").is_ok() {
            recovered = Some(killed_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let recovered = recovered.unwrap_or_else(|| {
        panic!(
            "the state API did not reconnect to Postgres\n{}",
            stack.logs()
        )
    });
    let first = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    let retry = c.send(checkout(&key, "alice", &body)).await;
    assert!(
        retry.status == 201 && replayed(&retry),
        "the retry after recovery must be the replay: {}\n{}",
        retry.describe(),
        stack.logs()
    );
    assert_eq!(retry.body, first.body);
    let ran = executions(&stack, &key).await;
    let after = c.send(checkout(&other, "alice", &body)).await;
    assert_eq!(
        after.status,
        201,
        "the key refused while Postgres was down works now: {}",
        after.describe()
    );
    record_figures(
        SUITE,
        "postgres_sigkill_during_slow_request",
        json!({"requests": 4, "postgres_down_ms": pg_down.as_millis() as u64, "state_api_ready_again_after_ms": recovered.as_millis() as u64,
               "charges": ran.len(), "retry_replayed": true, "heartbeat_errors_counter": stack.envoy.filter_counter("state_api_errors")}),
    );
    assert_eq!(ran.len(), 1, "one charge: {ran:?}");
    assert_eq!(executions(&stack, &other).await.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Envoy SIGKILL

async fn envoy_killed_during_slow_request(mut stack: Stack) {
    let key = unique_key("envoykill");
    let body = charge_body(800);
    // Longer than the lease: the orphan is still at work when the lease runs out.
    let upstream_ms = 2 * stack.options.lease_ms;
    // x-demo-detach: the checkout finishes the orphaned execution although Envoy is gone.
    let orphan = {
        let c = client(&stack);
        let req = checkout(&key, "alice", &body)
            .delay_ms(upstream_ms)
            .header("x-demo-detach", "1");
        tokio::spawn(async move { c.try_send(req).await })
    };
    let sent_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    blocking(|| stack.envoy.kill());
    let killed_at = Instant::now();
    assert!(
        orphan.await.is_ok_and(|r| r.is_err()),
        "the client of the killed Envoy gets a connection error"
    );
    blocking(|| stack.restart_envoy()).unwrap_or_else(|e| panic!("{e}"));
    let c = client(&stack);
    let mut held = 0;
    let mut orphan_ran_at = None;
    // 409 while the lease runs, then 409 while the checkout says the attempt is running (the
    // lease ran out: the outcome is unknown and reconciled), then the orphan's own outcome.
    let last = loop {
        let a = c.send(checkout(&key, "alice", &body)).await;
        let ran = executions(&stack, &key).await;
        assert!(ran.len() <= 1, "a second charge: {ran:?}\n{}", stack.logs());
        if ran.len() == 1 && orphan_ran_at.is_none() {
            orphan_ran_at = Some(sent_at.elapsed());
        }
        // A claim slower than the callout timeout on a loaded machine is a 503 with nothing
        // forwarded: held too.
        if is_problem(&a, 503, "idempotency-state-unavailable") {
            held += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        if a.status != 409 {
            break a;
        }
        assert_problem(&a, 409, "request-in-progress", &stack);
        assert!(a.header("retry-after").is_some(), "{}", a.describe());
        held += 1;
        assert!(
            killed_at.elapsed() < Duration::from_millis(upstream_ms + 15_000),
            "never reconciled\n{}",
            stack.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let window = killed_at.elapsed();
    assert_eq!(last.status, 201, "{}\n{}", last.describe(), stack.logs());
    assert!(
        replayed(&last),
        "the orphan's outcome, reconciled: {}",
        last.describe()
    );
    let ran = executions(&stack, &key).await;
    assert_eq!(ran.len(), 1, "one charge: {ran:?}");
    assert_eq!(
        last.json()["id"],
        ran[0]["id"],
        "the replay is the orphan's own charge"
    );
    assert!(
        window >= Duration::from_millis(upstream_ms - 500),
        "answered before the orphan finished: {window:?}"
    );
    let reconciled = stack.envoy.filter_counter("reconcile_executed");
    assert!(reconciled >= 1, "reconciled with the checkout");
    record_figures(
        SUITE,
        "envoy_sigkill_during_slow_request",
        json!({"requests": held + 2, "retries_answered_409": held, "window_ms": window.as_millis() as u64,
               "lease_ms": stack.options.lease_ms, "orphan_upstream_ms": upstream_ms,
               "orphan_executed_at_ms": orphan_ran_at.map(|d| d.as_millis() as u64),
               "charges": ran.len(), "reconciled_executed": reconciled}),
    );
}

// ---------------------------------------------------------------------------------------------
// Slow state API

async fn slow_state_api(stack: Stack) {
    let timeout = Duration::from_millis(stack.options.state_api_timeout_ms);
    let proxy =
        DelayProxy::start(stack.state_api.port, ProxyMode::Pass).unwrap_or_else(|e| panic!("{e}"));
    let envoy = stack
        .start_extra_envoy(proxy.port, "envoy-slow-state-api")
        .unwrap_or_else(|e| panic!("{e}"));
    let c = Client::new(&envoy.url(""));
    let body = charge_body(555);
    let errors = || envoy.filter_counter("state_api_errors");
    let sanity = c
        .send(checkout(&unique_key("slow-ok"), "alice", &body))
        .await;
    assert_eq!(
        sanity.status,
        201,
        "through the proxy: {}\n{}",
        sanity.describe(),
        stack.logs()
    );
    let mut figures = serde_json::Map::new();

    // 1. The claim is answered after the callout timeout: 503 at the timeout, nothing forwarded.
    //    The late claim did commit; the filter, knowing it forwarded nothing, gives it back by
    //    the nonce it sent it with (issue 34, path 4): the next retry runs at once, on a route
    //    that reconciles unknown outcomes and on one that holds them alike (before, the key was
    //    held `409 in progress` for a lease, then `409 outcome-unknown` on `POST /refunds`).
    type Build = fn(&str, &str, &serde_json::Value) -> Request;
    let routes: [(&str, Build); 2] = [("checkout", checkout), ("refunds", refund)];
    let mut late = Vec::new();
    for (route, request) in routes {
        proxy.set_mode(ProxyMode::DelayAnswers(
            timeout + Duration::from_millis(1_000),
        ));
        let key = unique_key(&format!("slow-claim-{route}"));
        let errors_before = errors();
        let a = c.send(request(&key, "alice", &body)).await;
        assert_problem(&a, 503, "idempotency-state-unavailable", &stack);
        assert!(a.header("retry-after").is_some());
        assert!(
            a.elapsed >= timeout - Duration::from_millis(100)
                && a.elapsed < timeout + Duration::from_millis(700),
            "503 after {:?}",
            a.elapsed
        );
        assert!(errors() > errors_before, "counted in state_api_errors");
        proxy.set_mode(ProxyMode::Pass);
        tokio::time::sleep(Duration::from_millis(1_200)).await; // the late answer has gone by
        assert!(
            executions(&stack, &key).await.is_empty(),
            "nothing forwarded after a timed-out claim"
        );
        let (after, held) = retry_until_settled(
            &c,
            || request(&key, "alice", &body),
            Duration::from_secs(10),
        )
        .await;
        assert!(
            after.status == 201 && !replayed(&after),
            "{route}: {}",
            after.describe()
        );
        assert_eq!(
            held, 0,
            "{route}: the key was held {held} times after a claim whose answer was lost"
        );
        assert_eq!(executions(&stack, &key).await.len(), 1);
        late.push(json!({"route": route, "answer": 503, "answered_after_ms": a.elapsed.as_millis() as u64, "retries_409_before_usable": held, "charges": 1}));
    }
    assert!(
        envoy.filter_counter("claims_abandoned") >= 2,
        "given back by their nonces"
    );
    figures.insert("late_claim".into(), json!(late));

    // 2. The state API swallows the claim: 503 at the timeout; nothing committed, the key is free.
    proxy.set_mode(ProxyMode::Blackhole);
    let key = unique_key("slow-blackhole");
    let a = c.send(checkout(&key, "alice", &body)).await;
    assert_problem(&a, 503, "idempotency-state-unavailable", &stack);
    assert!(
        a.elapsed < timeout + Duration::from_millis(700),
        "503 after {:?}",
        a.elapsed
    );
    proxy.set_mode(ProxyMode::Pass);
    let after = c.send(checkout(&key, "alice", &body)).await;
    assert!(
        after.status == 201 && !replayed(&after),
        "{}",
        after.describe()
    );
    figures.insert("swallowed_claim".into(), json!({"answer": 503, "answered_after_ms": a.elapsed.as_millis() as u64, "charges": executions(&stack, &key).await.len()}));

    // 3. The state API hangs up at once: 503 at once.
    proxy.set_mode(ProxyMode::HangUp);
    let key = unique_key("slow-hangup");
    let a = c.send(checkout(&key, "alice", &body)).await;
    assert_problem(&a, 503, "idempotency-state-unavailable", &stack);
    proxy.set_mode(ProxyMode::Pass);
    let after = c.send(checkout(&key, "alice", &body)).await;
    assert!(
        after.status == 201 && !replayed(&after),
        "{}",
        after.describe()
    );
    figures.insert("hang_up".into(), json!({"answer": 503, "answered_after_ms": a.elapsed.as_millis() as u64, "charges": executions(&stack, &key).await.len()}));

    // 4. The complete is answered late (the upstream already ran): the client still gets the
    //    response; the late complete is stored all the same, so the retry is a replay.
    let key = unique_key("slow-complete");
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(800));
    tokio::time::sleep(Duration::from_millis(400)).await;
    proxy.set_mode(ProxyMode::DelayAnswers(
        timeout + Duration::from_millis(500),
    ));
    let errors_before = errors();
    let first = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    let complete_errors = errors() - errors_before;
    proxy.set_mode(ProxyMode::Pass);
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let retry = c.send(checkout(&key, "alice", &body)).await;
    let ran = executions(&stack, &key).await;
    figures.insert(
        "late_complete".into(),
        json!({"first_answer": first.status, "first_answered_after_ms": first.elapsed.as_millis() as u64, "complete_errors_counted": complete_errors,
               "retry": classify(&retry), "charges": ran.len()}),
    );
    record_figures(SUITE, "slow_state_api", serde_json::Value::Object(figures));
    assert!(complete_errors >= 1, "the timed-out complete is counted");
    assert!(
        retry.status == 201 && replayed(&retry),
        "the late complete was stored: {}",
        retry.describe()
    );
    assert_eq!(ran.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Upstream reset

async fn upstream_reset(stack: Stack) {
    let c = client(&stack);
    let key = unique_key("reset");
    let body = charge_body(31);
    let unknown_before = stack.envoy.filter_counter("outcome_unknown");
    let first = c
        .send(checkout(&key, "alice", &body).header("x-demo-reset", "1"))
        .await;
    // The charge ran, then the connection dropped: Envoy answers 503 itself. That says nothing
    // of what the checkout did: the outcome is unknown. The retry asks the checkout
    // (reconcile), which tells it ran and gives its response: stored, and replayed.
    assert_eq!(first.status, 503, "{}", first.describe());
    assert!(!replayed(&first));
    // The unknown mark goes from the worker right after Envoy's answer: a retry that beats it
    // to the state API gets 409 + Retry-After once (the lease is still live), never a run.
    let mut retry = c.send(checkout(&key, "alice", &body)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while is_problem(&retry, 409, "request-in-progress") && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = c.send(checkout(&key, "alice", &body)).await;
    }
    let ran = executions(&stack, &key).await;
    assert_eq!(ran.len(), 1, "{ran:?}");
    assert_eq!(ran[0]["outcome"], "reset");
    assert!(
        retry.status == 201 && replayed(&retry),
        "the retry replays the reconciled outcome: {}\n{}",
        retry.describe(),
        stack.logs()
    );
    assert_eq!(retry.json()["id"], ran[0]["id"], "the charge that ran");
    assert_eq!(
        stack.envoy.filter_counter("outcome_unknown"),
        unknown_before + 1,
        "Envoy's 503 is counted as an unknown outcome"
    );
    let again = c.send(checkout(&key, "alice", &body)).await;
    assert!(
        replayed(&again) && again.body == retry.body,
        "{}",
        again.describe()
    );

    // A 500 from the upstream: stored and replayed the same way.
    let key500 = unique_key("fail500");
    let first500 = c
        .send(checkout(&key500, "alice", &body).header("x-demo-fail", "500"))
        .await;
    assert_eq!(first500.status, 500);
    let retry500 = c.send(checkout(&key500, "alice", &body)).await;
    assert!(
        retry500.status == 500 && replayed(&retry500),
        "{}",
        retry500.describe()
    );
    assert_eq!(executions(&stack, &key500).await.len(), 1);
    // The Wasm VM lives on.
    let ok = c
        .send(checkout(&unique_key("after-reset"), "alice", &body))
        .await;
    assert_eq!(ok.status, 201);
    record_figures(
        SUITE,
        "upstream_reset",
        json!({"requests": 6, "reset_answer": first.status, "reset_retry": classify(&retry), "reset_charges": ran.len(),
               "fail500_retry_replayed": replayed(&retry500), "fail500_charges": 1}),
    );
}

// ---------------------------------------------------------------------------------------------
// Two Envoys, two state APIs, one Postgres

async fn two_envoys_two_state_apis(stack: Stack) {
    const KEYS: usize = 60;
    const PER_ENVOY: usize = 5;
    let api2 = stack
        .start_extra_state_api()
        .unwrap_or_else(|e| panic!("{e}"));
    let envoy2 = stack
        .start_extra_envoy(api2.port, "envoy-2")
        .unwrap_or_else(|e| panic!("{e}"));
    let c1 = client(&stack);
    let c2 = Client::new(&envoy2.url(""));
    let mut tally: BTreeMap<&str, usize> = BTreeMap::new();
    let mut executed_on: BTreeMap<&str, usize> = BTreeMap::new();
    let keys: Vec<String> = (0..KEYS).map(|i| unique_key(&format!("twin{i}"))).collect();
    for (i, key) in keys.iter().enumerate() {
        let body = charge_body(i as u64 + 7);
        // Both Envoys at the same moment (a barrier), PER_ENVOY duplicates each.
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2 * PER_ENVOY));
        let sends = (0..2 * PER_ENVOY).map(|j| {
            let c = if j % 2 == 0 { c1.clone() } else { c2.clone() };
            let req = checkout(key, "alice", &body).delay_ms(if i % 2 == 0 { 0 } else { 100 });
            let barrier = std::sync::Arc::clone(&barrier);
            async move {
                barrier.wait().await;
                (j % 2, c.send(req).await)
            }
        });
        let answers = futures::future::join_all(sends).await;
        for (which, a) in &answers {
            let kind = classify(a);
            assert!(
                matches!(kind, "executed" | "replay" | "in_progress_409"),
                "{key}: {}",
                a.describe()
            );
            *tally.entry(kind).or_insert(0) += 1;
            if kind == "executed" {
                *executed_on
                    .entry(if *which == 0 { "envoy1" } else { "envoy2" })
                    .or_insert(0) += 1;
            }
        }
    }
    let per_key = executions_per_key(&ledger(&stack.checkout.url("")).await);
    let double = keys
        .iter()
        .filter(|k| per_key.get(*k).copied().unwrap_or(0) > 1)
        .count();
    let never = keys
        .iter()
        .filter(|k| per_key.get(*k).copied().unwrap_or(0) == 0)
        .count();
    record_figures(
        SUITE,
        "two_envoys_two_state_apis",
        json!({"keys": KEYS, "requests": KEYS * 2 * PER_ENVOY, "answers": tally, "executed_on": executed_on,
               "charges": keys.iter().map(|k| per_key.get(k).copied().unwrap_or(0)).sum::<usize>(), "keys_charged_twice": double, "keys_never_charged": never}),
    );
    assert_eq!(double, 0);
    assert_eq!(never, 0);
}

// ---------------------------------------------------------------------------------------------
// A lost complete: the state API (or Postgres) is down at the moment the upstream answers. The
// client gets its 201 after the in-stream attempts fail; the worker keeps the lease alive and
// retries the complete; the outcome must end up stored, so that even after the lease a retry
// through another Envoy is a replay.

/// Polls until the record is `completed` (up to `limit`); when it was first seen so.
async fn wait_completed(stack: &Stack, key: &str, limit: Duration) -> Option<Instant> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if record_state(stack, key, "POST /checkout").await == "completed" {
            return Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// After the lease has surely run out: a retry through a new Envoy (another worker, no cache)
/// must be a replay, and the checkout must have run once.
async fn replay_elsewhere_after_the_lease(
    stack: &Stack,
    key: &str,
    body: &serde_json::Value,
) -> (Answer, usize) {
    tokio::time::sleep(Duration::from_millis(stack.options.lease_ms + 500)).await;
    let other = stack
        .start_extra_envoy(stack.state_api.port, "envoy-other")
        .unwrap_or_else(|e| panic!("{e}"));
    let a = Client::new(&other.url(""))
        .send(checkout(key, "alice", body))
        .await;
    (a, executions(stack, key).await.len())
}

/// A lost complete has been recovered: the outcome is stored, the retry on the first Envoy and
/// the one through another Envoy after the lease are replays, and the checkout ran once.
async fn assert_stored_and_replayed_once(
    stack: &Stack,
    key: &str,
    stored_after: Option<Instant>,
    retry: &Answer,
    elsewhere: &Answer,
    charges: usize,
) {
    assert!(
        stored_after.is_some(),
        "the outcome was never stored: {}\n{}",
        record_state(stack, key, "POST /checkout").await,
        stack.logs()
    );
    assert!(
        replayed(retry),
        "the retry must be a replay, got {}",
        retry.describe()
    );
    assert!(
        replayed(elsewhere),
        "after the lease, through another Envoy: {}",
        elsewhere.describe()
    );
    assert_eq!(charges, 1, "charged {charges} times for one key");
}

/// Also with `complete_in_background` (`label` names the figures): then the response went on
/// before the first attempt, which the worker makes and retries.
async fn lost_complete_state_api_down(mut stack: Stack, label: &'static str) {
    let c = client(&stack);
    let key = unique_key("lost-api");
    let body = charge_body(77);
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(1_500));
    tokio::time::sleep(Duration::from_millis(500)).await;
    blocking(|| stack.state_api.kill());
    let first = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        first.status,
        201,
        "the client gets the upstream's answer: {}",
        first.describe()
    );
    blocking(|| stack.restart_state_api()).unwrap_or_else(|e| panic!("{e}"));
    let restarted = Instant::now();
    let (retry, n409) = retry_until_settled(
        &c,
        || checkout(&key, "alice", &body),
        Duration::from_secs(10),
    )
    .await;
    let stored_after = wait_completed(&stack, &key, Duration::from_secs(30)).await;
    let (elsewhere, charges) = replay_elsewhere_after_the_lease(&stack, &key, &body).await;
    record_figures(
        SUITE,
        label,
        json!({"first_answer": first.status, "retries_409": n409, "retry": classify(&retry),
               "stored_ms_after_restart": stored_after.map(|t| t.duration_since(restarted).as_millis() as u64),
               "retry_elsewhere_after_lease": classify(&elsewhere), "charges": charges,
               "complete_retries_counter": stack.envoy.filter_counter("complete_retries"), "complete_gave_up_counter": stack.envoy.filter_counter("complete_gave_up")}),
    );
    assert_stored_and_replayed_once(&stack, &key, stored_after, &retry, &elsewhere, charges).await;
}

async fn lost_complete_postgres_down(mut stack: Stack) {
    let c = client(&stack);
    let key = unique_key("lost-pg");
    let body = charge_body(78);
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(1_500));
    tokio::time::sleep(Duration::from_millis(500)).await;
    blocking(|| stack.postgres.kill_postmaster()).unwrap_or_else(|e| panic!("{e}"));
    let first = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    // A retry on the same Envoy while Postgres is down.
    let during = c.send(checkout(&key, "alice", &body)).await;
    // Down past the lease, as a longer database outage would be.
    tokio::time::sleep(Duration::from_millis(stack.options.lease_ms)).await;
    blocking(|| stack.postgres.restart()).unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();
    while e2e::envoy::http_get_blocking(stack.state_api.port, "/readyz").is_err()
        && started.elapsed() < Duration::from_secs(20)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready = Instant::now();
    let stored_after = wait_completed(&stack, &key, Duration::from_secs(30)).await;
    let retry = c.send(checkout(&key, "alice", &body)).await;
    let (elsewhere, charges) = replay_elsewhere_after_the_lease(&stack, &key, &body).await;
    record_figures(
        SUITE,
        "lost_complete_postgres_down_past_the_lease",
        json!({"first_answer": first.status, "retry_during_outage": classify(&during), "retry": classify(&retry),
               "stored_ms_after_postgres_ready": stored_after.map(|t| t.duration_since(ready).as_millis() as u64),
               "retry_elsewhere_after_lease": classify(&elsewhere), "charges": charges,
               "complete_retries_counter": stack.envoy.filter_counter("complete_retries"), "complete_gave_up_counter": stack.envoy.filter_counter("complete_gave_up")}),
    );
    assert_stored_and_replayed_once(&stack, &key, stored_after, &retry, &elsewhere, charges).await;
}

/// The outage outlasts the lease (no heartbeat gets through), and the client keeps retrying
/// through another Envoy (every 20 ms): its first claim after Postgres is back races the first
/// worker's heartbeat and complete retry. If the claim wins, the lease has run out, the key is
/// reclaimed and the checkout runs again.
async fn gap_other_envoy_after_long_outage(mut stack: Stack) {
    let c = client(&stack);
    let other = stack
        .start_extra_envoy(stack.state_api.port, "envoy-other")
        .unwrap_or_else(|e| panic!("{e}"));
    let key = unique_key("gap-other");
    let body = charge_body(79);
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(1_500));
    tokio::time::sleep(Duration::from_millis(500)).await;
    blocking(|| stack.postgres.kill_postmaster()).unwrap_or_else(|e| panic!("{e}"));
    let first = slow.await.unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(Duration::from_millis(stack.options.lease_ms)).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let retrier = {
        let c = Client::new(&other.url(""));
        let (key, body, stop) = (key.clone(), body.clone(), std::sync::Arc::clone(&stop));
        tokio::spawn(async move {
            let mut refused = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let a = c.send(checkout(&key, "alice", &body)).await;
                if a.status != 503 {
                    return (Some(a), refused);
                }
                refused += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (None, refused)
        })
    };
    blocking(|| stack.postgres.restart()).unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();
    while e2e::envoy::http_get_blocking(stack.state_api.port, "/readyz").is_err()
        && started.elapsed() < Duration::from_secs(20)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (elsewhere, refused) = retrier.await.unwrap_or_else(|e| panic!("{e}"));
    let _ = wait_completed(&stack, &key, Duration::from_secs(20)).await;
    let charges = executions(&stack, &key).await.len();
    record_figures(
        SUITE,
        "gap_other_envoy_after_long_outage",
        json!({"first_answer": first.status, "retries_503_during_outage": refused,
               "first_retry_elsewhere_after_recovery": elsewhere.as_ref().map(classify), "charges": charges,
               "fenced_out_counter": stack.envoy.filter_counter("fenced_out")}),
    );
    let elsewhere = elsewhere.unwrap_or_else(|| panic!("no answer other than 503 after recovery"));
    assert!(
        replayed(&elsewhere) || elsewhere.status == 409,
        "a replay or 409, got {}",
        elsewhere.describe()
    );
    assert_eq!(charges, 1, "charged {charges} times for one key");
}
