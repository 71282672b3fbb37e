//! Paths to a second execution that only the real parts show (issue 34), through the real
//! Envoy, state API, Postgres and checkout:
//!
//! * path 2: Postgres crash recovery in place, held longer than the lease, must not let a
//!   `reexecute` route take over from an owner that is alive;
//! * path 3: Envoy's own answer after the request was forwarded (an HCM timeout's 408) is not
//!   the upstream's: it must be an unknown outcome, never stored and replayed;
//! * path 7: a `reexecute` route's new attempt, after the first one charged, gets the first
//!   one's result from the reference checkout, never a second charge;
//! * path 11: a reconcile answer is about *this* request (key, subject, endpoint, fingerprint):
//!   another request under the same key (a retention reuse with another body, a prefix route's
//!   other path) never has its outcome replayed for it; the new request runs once.

use std::time::{Duration, Instant};

use e2e::client::{unique_key, Answer, Client, Request};
use e2e::crash_recovery::{crash_and_hold_recovery, process_state};
use e2e::envoy::{Envoy, Tweak};
use e2e::faults::record_figures;
use e2e::stack::{Stack, StackOptions};
use e2e::testkit::*;
use edge::config::{Match, OnUnknown};
use libtest_mimic::{Arguments, Trial};

const SUITE: &str = "second_execution";

/// POST /checkout re-executes unknown outcomes (it reconciles in the demo).
fn reexecuting() -> Tweak {
    Tweak::new(|c| {
        let route = &mut c.routes[0];
        route.on_unknown = OnUnknown::Reexecute;
        route.reconcile = None;
    })
}

fn main() {
    let args = Arguments::from_args();
    let trials: Vec<Trial> = vec![
        own(
            "crash_recovery_in_place_held_past_the_lease_lets_no_reexecute_route_take_over_a_live_owner",
            StackOptions {
                lease_ms: LEASE_MS,
                heartbeat_ms: LEASE_MS / 2,
                tweak: Some(reexecuting()),
                ..StackOptions::default()
            },
            crash_recovery_in_place,
        ),
        own(
            "envoy_s_own_answer_after_forwarding_is_an_unknown_outcome_never_a_stored_one",
            StackOptions::default(),
            envoys_own_answer_after_forwarding,
        ),
        own(
            "a_reexecuted_attempt_after_the_first_one_charged_gets_its_result_not_a_second_charge",
            StackOptions {
                tweak: Some(reexecuting()),
                ..StackOptions::default()
            },
            reexecuted_after_a_charge,
        ),
        own(
            "a_retention_reuse_with_another_body_runs_once_and_replays_its_own_outcome_never_the_first_s",
            StackOptions {
                // The record's expiry is its claim + lease + retention: a short lease, a 1 s
                // retention.
                lease_ms: REUSE_LEASE_MS,
                heartbeat_ms: REUSE_LEASE_MS / 3,
                tweak: Some(Tweak::new(|c| c.routes[0].retention_s = Some(1))),
                ..StackOptions::default()
            },
            retention_reuse_with_another_body,
        ),
        own(
            "a_prefix_route_s_other_path_under_the_same_key_runs_once_and_replays_its_own_outcome",
            StackOptions {
                // One reconciling route over every POST: /checkout and /refunds under one key
                // share its reconcile endpoint, /checkout/attempts/{key}.
                tweak: Some(Tweak::new(|c| {
                    c.routes.truncate(1);
                    c.routes[0].matcher = Match::Prefix("/".into());
                })),
                ..StackOptions::default()
            },
            prefix_route_other_path,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Sends `req()` again while it is answered 409 (the key in progress), for at most `limit`.
async fn past_409(c: &Client, limit: Duration, req: impl Fn() -> Request) -> Answer {
    let asked = Instant::now();
    loop {
        let a = c.send(req()).await;
        if a.status != 409 || asked.elapsed() > limit {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Path 2: crash recovery in place

/// The lease of this test's stack (heartbeats every half of it).
const LEASE_MS: u64 = 8_000;
/// Clients retrying through another Envoy at once.
const RETRIERS: u64 = 8;
/// How long the startup process is held: longer than the lease.
const HOLD: Duration = Duration::from_millis(LEASE_MS + 2_000);
/// How long the owner's upstream call runs: through the crash, the hold and the replay.
const OWNER_RUNS_MS: u64 = 30_000;

async fn crash_recovery_in_place(stack: Stack) {
    let postmaster = stack.postgres.postmaster_pid().unwrap_or_else(|| {
        panic!(
            "this test crashes its own Postgres: it needs a private cluster (unset DATABASE_URL)"
        )
    });
    let db = stack.database_name().to_owned();
    let psql = |sql: &str| {
        stack
            .postgres
            .psql(&db, sql)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    };
    // No checkpoint from here on, so that the crash recovery replays all the WAL written below
    // and lasts long enough to be caught.
    psql("ALTER SYSTEM SET checkpoint_timeout = '1h'");
    psql("ALTER SYSTEM SET max_wal_size = '16GB'");
    psql("SELECT pg_reload_conf()");
    psql("CHECKPOINT");
    let wal_before = psql("SELECT pg_current_wal_lsn()");
    let filled = Instant::now();
    psql(
        "CREATE TABLE wal_filler AS \
         SELECT g, repeat(md5(g::text), 8) AS pad FROM generate_series(1, 600000) g",
    );
    let wal_mb: f64 = psql(&format!(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{wal_before}') / 1048576.0"
    ))
    .parse()
    .unwrap_or(0.0);
    let fill_ms = filled.elapsed().as_millis() as u64;

    // The edge the client retries through (started now: an Envoy takes a second or two).
    let other = stack
        .start_extra_envoy(stack.state_api.port, "envoy-retries")
        .unwrap_or_else(|e| panic!("{e}"));
    // The owner: a checkout that runs through the crash; its Envoy heartbeats every 4 s.
    let key = unique_key("crash-in-place");
    let body = charge_body(3400);
    let again = || checkout(&key, "alice", &body);
    let owner = send_in_background(&client(&stack), again().delay_ms(OWNER_RUNS_MS));
    let waited = Instant::now();
    while record_state(&stack, &key, "POST /checkout").await != "in_progress" {
        assert!(
            waited.elapsed() < Duration::from_secs(5),
            "the owner never claimed\n{}",
            stack.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(attempt_states(&stack, &key).await, ["running"]);

    // A state API backend dies; the postmaster reinitialises in place; the replay is held
    // longer than the lease.
    let start_time = psql("SELECT pg_postmaster_start_time()");
    let mut held = blocking(|| crash_and_hold_recovery(postmaster, &db))
        .unwrap_or_else(|e| panic!("{e}\n{}", stack.logs()));
    let stopped = process_state(held.startup_pid);
    // Another edge's retries, from several clients at once, every 20 ms each from before the
    // replay goes on: a claim is always on its way when the database serves again, so one
    // reaches it before the owner's next heartbeat (every 4 s). Each client keeps its first
    // answer other than 503: what the state API decided once the database served again.
    let retriers: Vec<_> = (0..RETRIERS)
        .map(|i| {
            let (c, key, body) = (Client::new(&other.url("")), key.clone(), body.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i * 20)).await;
                let begun = Instant::now();
                let mut refused = 0u32;
                while begun.elapsed() < Duration::from_secs(60) {
                    let a = c.send(checkout(&key, "alice", &body)).await;
                    if a.status != 503 {
                        return (Some((Instant::now(), a)), refused);
                    }
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                (None, refused)
            })
        })
        .collect();
    tokio::time::sleep(HOLD).await;
    let held_for = held.release().unwrap_or_else(|e| panic!("{e}"));
    let released = Instant::now();
    let mut answers = Vec::new();
    let mut refused_503 = 0u32;
    for r in retriers {
        let (answer, refused) = r.await.unwrap_or_else(|e| panic!("{e}"));
        refused_503 += refused;
        answers
            .push(answer.unwrap_or_else(|| panic!("still 503 a minute later\n{}", stack.logs())));
    }
    answers.sort_by_key(|(at, _)| *at);
    let serving_after = answers
        .first()
        .map(|(at, _)| at.saturating_duration_since(released))
        .unwrap_or_default();
    let answers: Vec<Answer> = answers.into_iter().map(|(_, a)| a).collect();
    let kinds: Vec<&str> = answers.iter().map(classify).collect();
    assert_eq!(
        psql("SELECT pg_postmaster_start_time()"),
        start_time,
        "recovered in place: the postmaster did not restart"
    );
    let forwarded_while_owner_ran = attempt_states(&stack, &key).await;
    let owner_answer = owner.await.unwrap_or_else(|e| panic!("{e}"));
    let later = past_409(&Client::new(&other.url("")), Duration::from_secs(10), again).await;
    let charges = executions(&stack, &key).await;
    let all_attempts = attempt_states(&stack, &key).await;
    record_figures(
        SUITE,
        "crash_recovery_in_place",
        serde_json::json!({
            "lease_ms": LEASE_MS, "wal_replayed_mb": wal_mb.round(), "wal_written_ms": fill_ms,
            "startup_caught_after_ms": held.caught_after.as_millis() as u64,
            "startup_title": held.startup_title, "startup_state_when_held": stopped.map(String::from),
            "held_ms": held_for.as_millis() as u64,
            "first_answer_elsewhere_ms_after_release": serving_after.as_millis() as u64,
            "retries_503": refused_503, "answers_elsewhere": kinds,
            "fenced_out_at_the_owner": stack.envoy.filter_counter("fenced_out"),
            "attempts_while_owner_ran": forwarded_while_owner_ran, "attempts": all_attempts,
            "owner_answer": owner_answer.status, "later_retry": classify(&later),
            "charges": charges.len(),
        }),
    );
    assert_eq!(stopped, Some('T'), "the startup process was stopped");
    assert!(
        held_for > Duration::from_millis(LEASE_MS),
        "held {held_for:?}"
    );
    assert!(
        answers
            .iter()
            .all(|a| is_problem(a, 409, "request-in-progress")),
        "a retry after the crash recovery took over from the live owner: {kinds:?}\n\
         attempts at the checkout while the owner ran: {forwarded_while_owner_ran:?}\n{}",
        stack.logs()
    );
    assert_eq!(
        stack.envoy.filter_counter("fenced_out"),
        0,
        "the owner was fenced out: its key was taken over while it ran"
    );
    assert_eq!(
        forwarded_while_owner_ran,
        ["running"],
        "nothing but the owner reached the checkout while it ran"
    );
    assert_eq!(owner_answer.status, 201, "{}", owner_answer.describe());
    assert!(
        replayed(&later) && later.body == owner_answer.body,
        "after the owner finished, its outcome as a replay: {}",
        later.describe()
    );
    assert_eq!(charges.len(), 1, "{charges:?}");
    assert_eq!(all_attempts, ["executed"]);
}

// ---------------------------------------------------------------------------------------------
// Path 3: Envoy's own answers after the request left

/// Waits until the checkout has charged `key` (a detached execution finishing on its own).
async fn wait_charged(stack: &Stack, key: &str, limit: Duration) -> Vec<serde_json::Value> {
    let waited = Instant::now();
    loop {
        let charges = executions(stack, key).await;
        if !charges.is_empty() || waited.elapsed() > limit {
            return charges;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `yaml` with `lines` inserted at the indentation of its line `anchor` (compared trimmed),
/// right after it or right before it, and without the lines at that indentation that start
/// with `drop`.
fn edit_yaml(yaml: &str, anchor: &str, lines: &str, after: bool, drop: Option<&str>) -> String {
    let anchor = yaml
        .lines()
        .find(|l| l.trim() == anchor)
        .unwrap_or_else(|| panic!("no `{anchor}` in the rendered configuration"));
    let indent = &anchor[..anchor.len() - anchor.trim_start().len()];
    let insert = |out: &mut String| {
        for l in lines.lines() {
            out.push_str(indent);
            out.push_str(l);
            out.push('\n');
        }
    };
    let mut out = String::new();
    // A dropped option's own lines (a map such as `common_http_protocol_options`) go with it.
    let mut dropping = false;
    for line in yaml.lines() {
        if dropping
            && line
                .strip_prefix(indent)
                .is_some_and(|rest| rest.starts_with(' '))
        {
            continue;
        }
        dropping = drop.is_some_and(|d| {
            line.strip_prefix(indent)
                .is_some_and(|rest| rest.starts_with(d))
        });
        if dropping {
            continue;
        }
        if line == anchor && !after {
            insert(&mut out);
        }
        out.push_str(line);
        out.push('\n');
        if line == anchor && after {
            insert(&mut out);
        }
    }
    out
}

/// The rendered configuration with `option` (YAML lines) in the HTTP connection manager,
/// replacing what the rendering set for the same name (and its lines): a team's own Envoy with
/// its own timeouts.
fn with_hcm_option(yaml: &str, name: &str, option: &str) -> String {
    edit_yaml(
        yaml,
        "stat_prefix: edge",
        option,
        true,
        Some(&format!("{name}:")),
    )
}

/// The rendered configuration with `filter` (a YAML list item) in the HTTP filters right
/// before the router, that is after the idempotency filter.
fn with_filter_before_router(yaml: &str, filter: &str) -> String {
    edit_yaml(
        yaml,
        "- name: envoy.filters.http.router",
        filter,
        false,
        None,
    )
}

/// A local reply by Envoy after the idempotency filter let the request on: a timeout of the
/// connection manager while the checkout runs, or another filter's answer.
struct EnvoysOwnAnswer {
    name: &'static str,
    edit: fn(&str) -> String,
    /// What the first request carries to be answered by Envoy (the checkout's delay, a fault).
    first: fn(Request) -> Request,
    /// Whether the checkout runs the first request (and charges) or never sees it.
    reaches_the_checkout: bool,
}

async fn envoys_own_answer_after_forwarding(stack: Stack) {
    let cases = [
        EnvoysOwnAnswer {
            name: "stream_idle_timeout",
            edit: |y| with_hcm_option(y, "stream_idle_timeout", "stream_idle_timeout: 1s"),
            // The checkout charges at 2.5 s whether or not its caller is still there.
            first: |r| r.delay_ms(2_500).header("x-demo-detach", "1"),
            reaches_the_checkout: true,
        },
        EnvoysOwnAnswer {
            name: "max_stream_duration",
            edit: |y| {
                with_hcm_option(
                    y,
                    "common_http_protocol_options",
                    "common_http_protocol_options:\n  max_stream_duration: 1s",
                )
            },
            first: |r| r.delay_ms(2_500).header("x-demo-detach", "1"),
            reaches_the_checkout: true,
        },
        EnvoysOwnAnswer {
            // A team's own Envoy with a filter after ours that answers itself (here Envoy's
            // fault filter, asked by a header): a 4xx that no upstream said.
            name: "fault_filter_abort_429",
            edit: |y| {
                with_filter_before_router(
                    y,
                    "- name: envoy.filters.http.fault\n  typed_config:\n    \"@type\": \
                     type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault\n    \
                     abort:\n      header_abort: {}\n      percentage:\n        numerator: 100",
                )
            },
            first: |r| r.header("x-envoy-fault-abort-request", "429"),
            reaches_the_checkout: false,
        },
    ];
    let mut figures = serde_json::Map::new();
    for case in cases {
        let name = case.name;
        let params =
            Stack::envoy_params_for(&stack.options, stack.state_api.port, stack.checkout.port)
                .unwrap_or_else(|e| panic!("{e}"));
        let yaml = (case.edit)(&params.render().unwrap_or_else(|e| panic!("{e}")));
        let envoy = Envoy::start_with_yaml(yaml, params, &stack.dir, &format!("envoy-{name}"))
            .unwrap_or_else(|e| panic!("{e}"));
        let c = Client::new(&envoy.url(""));
        let key = unique_key(name);
        let body = charge_body(4080);
        let again = || checkout(&key, "alice", &body);
        let first = c.send((case.first)(again())).await;
        assert!(
            first.status != 201 && !replayed(&first),
            "{name}: Envoy answers itself, before the checkout: {}\n{}",
            first.describe(),
            envoy.log_tail()
        );
        let charged = if case.reaches_the_checkout {
            wait_charged(&stack, &key, Duration::from_secs(10)).await
        } else {
            executions(&stack, &key).await
        };
        // The retry: what the checkout itself said (reconciled: it ran), or one run now (it
        // never ran); never Envoy's answer replayed.
        let retry = past_409(&c, Duration::from_secs(10), again).await;
        let charges = executions(&stack, &key).await;
        figures.insert(
            name.into(),
            serde_json::json!({"first": first.status, "first_body": first.text(), "charged_by_the_first": charged.len(),
                   "retry": retry.status, "retry_replayed": replayed(&retry), "charges": charges.len(),
                   "outcome_unknown": envoy.filter_counter("outcome_unknown"),
                   "reconcile_executed": envoy.filter_counter("reconcile_executed"),
                   "reconcile_not_executed": envoy.filter_counter("reconcile_not_executed")}),
        );
        assert!(
            !(replayed(&retry) && retry.status == first.status),
            "{name}: Envoy's own {} was stored and replayed as if the checkout had answered it \
             (the checkout charged {} time(s) for the key): {}",
            first.status,
            charges.len(),
            retry.describe()
        );
        assert_eq!(
            retry.status,
            201,
            "{name}: {}\n{}",
            retry.describe(),
            envoy.log_tail()
        );
        assert_eq!(
            replayed(&retry),
            case.reaches_the_checkout,
            "{name}: the first run's outcome as a replay, or one run now: {}",
            retry.describe()
        );
        assert_eq!(charges.len(), 1, "{name}: {charges:?}");
        assert_eq!(retry.json()["id"], charges[0]["id"], "{name}");
        assert_eq!(envoy.filter_counter("outcome_unknown"), 1, "{name}");
    }
    record_figures(
        SUITE,
        "envoys_own_answer",
        serde_json::Value::Object(figures),
    );
}

// ---------------------------------------------------------------------------------------------
// Path 7: `reexecute` orders attempts; the upstream must deduplicate them

async fn reexecuted_after_a_charge(stack: Stack) {
    let key = unique_key("reexecuted-after-charge");
    let body = charge_body(1250);
    let again = || checkout(&key, "alice", &body);
    // The first attempt charges at 1.5 s, after its client left at 0.5 s: unknown to the edge.
    let impatient = Client::impatient(&stack.envoy.url(""), Duration::from_millis(500));
    let first = impatient
        .try_send(again().delay_ms(1_500).header("x-demo-detach", "1"))
        .await;
    assert!(first.is_err(), "{:?}", first.map(|a| a.describe()));
    let charges = wait_charged(&stack, &key, Duration::from_secs(10)).await;
    assert_eq!(charges.len(), 1, "the first attempt charged: {charges:?}");
    assert_eq!(
        record_state(&stack, &key, "POST /checkout").await,
        "unknown"
    );
    // The retry re-executes with a larger token: the checkout must answer with what the first
    // attempt produced, and charge nothing.
    let c = client(&stack);
    let retry = c.send(again()).await;
    let after = executions(&stack, &key).await;
    let states = attempt_states(&stack, &key).await;
    record_figures(
        SUITE,
        "reexecuted_after_a_charge",
        serde_json::json!({"retry": retry.status, "charges": after.len(), "attempts": states,
               "reexecuted": stack.envoy.filter_counter("reexecuted")}),
    );
    assert!(stack.envoy.filter_counter("reexecuted") >= 1);
    assert_eq!(
        after.len(),
        1,
        "the re-executed attempt charged a second time: {after:?}\nattempts: {states:?}"
    );
    assert_eq!(retry.status, 201, "{}", retry.describe());
    assert_eq!(
        retry.json()["id"],
        charges[0]["id"],
        "the first attempt's result: {}",
        retry.describe()
    );
    assert_eq!(states, ["executed", "replayed"]);
    let replay = c.send(again()).await;
    assert!(
        replayed(&replay) && replay.body == retry.body,
        "{}",
        replay.describe()
    );
}

// ---------------------------------------------------------------------------------------------
// Path 11: reconcile answers tied to the request

/// The lease of the retention reuse test's stack.
const REUSE_LEASE_MS: u64 = 3_000;

/// The first attempt of `req`, by a client that leaves after 1 s while the checkout takes 3 s
/// (not detached: the checkout drops the attempt when Envoy hangs up, nothing ran). Its outcome
/// is unknown to the edge. An answer (there should be none) must not be `not_this`'s.
async fn abandoned_first_attempt(stack: &Stack, req: Request, not_this: &Answer, what: &str) {
    let impatient = Client::impatient(&stack.envoy.url(""), Duration::from_secs(1));
    if let Ok(a) = impatient.try_send(req.delay_ms(3_000)).await {
        assert_ne!(
            (a.status, a.json()["id"].clone()),
            (not_this.status, not_this.json()["id"].clone()),
            "{what} got the earlier request's outcome: {}\n{}",
            a.describe(),
            stack.logs()
        );
        panic!(
            "{what}: the client left before the checkout answered, yet got {}",
            a.describe()
        );
    }
}

/// The request `again()` once its earlier attempt's outcome is unknown: it reconciles, runs
/// once, and the retry after it is a replay of that; never `earlier`'s outcome. Returns its
/// answer.
async fn runs_once_with_its_own_outcome(
    stack: &Stack,
    again: impl Fn() -> Request,
    earlier: &Answer,
    what: &str,
) -> Answer {
    let c = client(stack);
    let ran = past_409(&c, Duration::from_secs(10), &again).await;
    assert!(
        !(replayed(&ran) && ran.body == earlier.body),
        "{what} got the earlier request's outcome replayed (the reconcile answer described \
         another request): {}\n{}",
        ran.describe(),
        stack.logs()
    );
    assert_eq!(
        ran.status,
        201,
        "{what}: {}\n{}",
        ran.describe(),
        stack.logs()
    );
    assert_ne!(ran.json()["id"], earlier.json()["id"], "{}", ran.describe());
    assert!(stack.envoy.filter_counter("reconcile_not_executed") >= 1);
    let replay = c.send(again()).await;
    assert!(
        replayed(&replay) && replay.body == ran.body,
        "{what}: its own outcome replayed: {}",
        replay.describe()
    );
    ran
}

async fn retention_reuse_with_another_body(stack: Stack) {
    // The simulation's seed 129, through the real parts: a key's record past its retention is
    // reused by another request (another body); that request's first attempt is unknown, and
    // its retry reconciles.
    let key = unique_key("retention-reuse");
    let c = client(&stack);
    let first = c.send(checkout(&key, "alice", &charge_body(700))).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    // Past the record's expiry (claim + lease + 1 s retention), and the worker's memory of it.
    tokio::time::sleep(Duration::from_millis(REUSE_LEASE_MS + 2_500)).await;
    let body = charge_body(900);
    let again = || checkout(&key, "alice", &body);
    abandoned_first_attempt(&stack, again(), &first, "another body under the reused key").await;
    let ran =
        runs_once_with_its_own_outcome(&stack, again, &first, "another body under the reused key")
            .await;
    let charges = executions(&stack, &key).await;
    let amounts: Vec<_> = charges.iter().map(|e| e["amount"].clone()).collect();
    let states = attempt_states(&stack, &key).await;
    record_figures(
        SUITE,
        "retention_reuse_with_another_body",
        serde_json::json!({"first": first.status, "reused": ran.status, "amounts": amounts,
               "attempts": states, "reconcile_not_executed": stack.envoy.filter_counter("reconcile_not_executed")}),
    );
    assert_eq!(
        amounts,
        [serde_json::json!(700), serde_json::json!(900)],
        "each request charged once: {charges:?}"
    );
    assert_eq!(states, ["executed", "abandoned", "executed"]);
}

async fn prefix_route_other_path(stack: Stack) {
    // A charge and a refund under one key, on one reconciling route: the refund's first attempt
    // is unknown, and its retry asks the route's reconcile endpoint about the refund.
    let key = unique_key("prefix-other-path");
    let c = client(&stack);
    let charge = c.send(checkout(&key, "alice", &charge_body(700))).await;
    assert_eq!(charge.status, 201, "{}", charge.describe());
    let body = serde_json::json!({"amount": 300, "charge": charge.json()["id"]});
    let again = || refund(&key, "alice", &body);
    abandoned_first_attempt(&stack, again(), &charge, "the refund").await;
    let ran = runs_once_with_its_own_outcome(&stack, again, &charge, "the refund").await;
    assert_eq!(ran.json()["kind"], "refund", "{}", ran.describe());
    let done = executions(&stack, &key).await;
    let kinds: Vec<_> = done.iter().map(|e| e["kind"].clone()).collect();
    let states = attempt_states(&stack, &key).await;
    record_figures(
        SUITE,
        "prefix_route_other_path",
        serde_json::json!({"charge": charge.status, "refund": ran.status, "executions": kinds,
               "attempts": states, "reconcile_not_executed": stack.envoy.filter_counter("reconcile_not_executed")}),
    );
    assert_eq!(kinds, ["charge", "refund"], "one each: {done:?}");
    assert_eq!(states, ["executed", "abandoned", "executed"]);
}
