//! What users of idempotency layers ask for (issue 15), through the real Envoy, filter, state
//! API, Postgres and checkout: `Prefer: wait` instead of 409, fingerprint ignore and include
//! lists, the key from a body member, retention per route, operator actions with `idemctl` and
//! their audit rows, and namespaces that keep deployments apart on one state API.

use contract::state_env;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::client::{unique_key, Answer, Client, Request};
use e2e::envoy::{Envoy, Tweak};
use e2e::faults::record_figures;
use e2e::process::workspace_binary;
use e2e::services::ServiceTestExt as _;
use e2e::stack::{token, Stack, StackOptions, TEST_API_TOKEN};
use e2e::testkit::*;
use edge::config::{Config, Pointer, Selection};
use libtest_mimic::Arguments;
use serde_json::json;

const SUITE: &str = "features";
/// The operators' token of these stacks (never the filter's).
const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

fn pointer(p: &str) -> Pointer {
    Pointer::parse(p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

/// The demo's routes with what these tests exercise: `/checkout` waits up to 5 s, keeps its
/// records an hour and leaves a timestamp and a trace id out of its fingerprint; `/refunds`
/// takes its key from the body and fingerprints only the amount, the card and the second item.
fn features(c: &mut Config) {
    let checkout = &mut c.routes[0];
    checkout.max_wait_s = 5;
    checkout.retention_s = Some(3_600);
    checkout.fingerprint =
        Selection::Ignore(vec![pointer("/meta/sent_at"), pointer("/items/0/trace")]);
    let refunds = &mut c.routes[1];
    refunds.key_from = Some(pointer("/idempotency_key"));
    refunds.fingerprint = Selection::Include(vec![
        pointer("/amount"),
        pointer("/card/number"),
        pointer("/items/1"),
    ]);
}

fn options() -> StackOptions {
    StackOptions {
        state_api_env: vec![(state_env::STATE_API_ADMIN_TOKEN.into(), ADMIN_TOKEN.into())],
        tweak: Some(Tweak::new(features)),
        ..StackOptions::default()
    }
}

/// The shared stack: started by the first test that needs it, stopped after the last.
static SHARED: SharedStack = SharedStack::new(start_features_stack);

fn start_features_stack() -> Result<Stack, String> {
    Stack::start(options())
}

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        SHARED.trial(
            "a_retry_that_prefers_to_wait_gets_the_replay_once_the_first_finishes",
            wait_then_replay,
        ),
        SHARED.trial(
            "a_retry_still_waiting_at_its_deadline_gets_409_with_retry_after",
            wait_until_deadline,
        ),
        own(
            "waiters_over_the_workers_bound_get_409_at_once_and_are_counted",
            StackOptions {
                tweak: Some(Tweak::new(|c| {
                    features(c);
                    c.filter.max_waiters = 1;
                })),
                ..options()
            },
            worker_waiter_bound,
        ),
        own(
            "waiters_over_the_state_apis_bound_get_409_at_once_and_are_counted",
            StackOptions {
                state_api_env: vec![
                    (state_env::STATE_API_ADMIN_TOKEN.into(), ADMIN_TOKEN.into()),
                    (state_env::STATE_API_MAX_WAITERS.into(), "1".into()),
                ],
                ..options()
            },
            state_api_waiter_bound,
        ),
        SHARED.trial(
            "an_ignore_list_lets_a_timestamp_and_a_trace_id_change_nested_members_still_count",
            ignore_list,
        ),
        SHARED.trial(
            "an_include_list_covers_only_its_members_and_the_key_comes_from_the_body",
            include_list_and_key_from_body,
        ),
        SHARED.trial(
            "each_route_keeps_its_records_as_long_as_it_asks_within_the_state_apis_bound",
            retention_per_route,
        ),
        SHARED.trial(
            "an_operator_releases_a_held_unknown_outcome_and_the_audit_row_says_who_and_why",
            admin_release,
        ),
        SHARED.trial(
            "an_operator_resolves_outcomes_replayable_or_not_and_purges_a_key",
            admin_resolve_and_purge,
        ),
        SHARED.trial(
            "the_admin_api_refuses_bad_tokens_unknown_records_and_live_leases_unless_forced",
            admin_refusals,
        ),
        SHARED.trial(
            "two_deployments_with_their_own_namespace_share_a_state_api_without_meeting",
            namespaces,
        ),
    ];
    // Stops the shared stack's processes before exiting (statics are never dropped).
    SHARED.run(&args, trials)
}

/// A refund whose key is the body's `idempotency_key` (no header).
fn refund_in_body(key: &str, who: &str, body: &serde_json::Value) -> Request {
    let mut body = body.clone();
    body["idempotency_key"] = key.into();
    Request::post("/refunds").token(&token(who)).json(&body)
}

/// A sample's value in a Prometheus text exposition (0 when absent).
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

fn applied(a: &Answer) -> Option<String> {
    a.header("preference-applied")
}

// ---------------------------------------------------------------------------------------------
// Prefer: wait

async fn wait_then_replay(stack: Arc<Stack>) {
    let c = client(&stack);
    // On this Envoy (woken by its own complete) and on another one (by the state API).
    let other = stack
        .start_extra_envoy(stack.state_api.port, "envoy-waiting")
        .unwrap_or_else(|e| panic!("{e}"));
    for (name, envoy) in [("same envoy", &stack.envoy), ("another envoy", &other)] {
        let waiting = Client::new(&envoy.url(""));
        let before = envoy.filter_counter("wait_replayed");
        let h2_before = envoy.counter("cluster.state_api_wait.upstream_rq_total");
        let key = unique_key("wait");
        let body = charge_body(1200);
        let first = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(2_000));
        tokio::time::sleep(Duration::from_millis(400)).await;
        let started = Instant::now();
        let retry = waiting
            .send(checkout(&key, "alice", &body).header("prefer", "wait=5"))
            .await;
        let waited = started.elapsed();
        let first = first.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(first.status, 201, "{name}: {}", first.describe());
        assert!(
            retry.status == 201 && replayed(&retry),
            "{name}: the waiting retry gets the replay: {}\n{}",
            retry.describe(),
            stack.logs()
        );
        assert_eq!(retry.json()["id"], first.json()["id"], "{name}");
        assert_eq!(applied(&retry).as_deref(), Some("wait=5"), "{name}");
        assert!(
            waited >= Duration::from_millis(1_000) && waited < Duration::from_secs(5),
            "{name}: answered when the first finished, not at the deadline: {waited:?}"
        );
        assert_eq!(executions(&stack, &key).await.len(), 1, "{name}");
        assert_eq!(envoy.filter_counter("wait_replayed"), before + 1, "{name}");
        // The waiting claim went over the HTTP/2 cluster, and the first request's calls did
        // not: counted exactly on the Envoy this test has to itself (the shared one also carries
        // the other tests' waiting claims, which run beside this one).
        let h2_calls = envoy.counter("cluster.state_api_wait.upstream_rq_total") - h2_before;
        if name == "another envoy" {
            assert_eq!(h2_calls, 1, "{name}");
        } else {
            assert!(h2_calls >= 1, "{name}: {h2_calls}");
        }
        assert!(
            envoy.counter("cluster.state_api_wait.upstream_cx_http2_total") >= 1,
            "{name}"
        );
        record_figures(
            SUITE,
            "wait_then_replay",
            json!({"envoy": name, "waited_ms": waited.as_millis() as u64}),
        );
    }
    // Without Prefer nothing changes: 409 at once.
    let key = unique_key("no-prefer");
    let body = charge_body(1201);
    let first = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(1_500));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let dup = c.send(checkout(&key, "alice", &body)).await;
    assert_problem(&dup, 409, "request-in-progress", &stack);
    // At once: answered while the first is still running, not after it.
    assert!(!first.is_finished(), "the 409 waited for the first request");
    assert_eq!(applied(&dup), None);
    let _ = first.await;
}

async fn wait_until_deadline(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("deadline");
    let body = charge_body(1300);
    let first = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(9_000));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = stack.envoy.filter_counter("wait_timed_out");
    for (prefer, applied_as, secs) in [("wait=2", "wait=2", 2), ("wait=30", "wait=5", 5)] {
        let started = Instant::now();
        let a = c
            .send(checkout(&key, "alice", &body).header("prefer", prefer))
            .await;
        let waited = started.elapsed();
        assert_problem(&a, 409, "request-in-progress", &stack);
        assert!(a.header("retry-after").is_some(), "{}", a.describe());
        assert_eq!(
            applied(&a).as_deref(),
            Some(applied_as),
            "capped by the route's max_wait_s (5)"
        );
        assert!(
            waited >= Duration::from_secs(secs) && waited < Duration::from_secs(secs + 2),
            "{prefer}: waited {waited:?}"
        );
    }
    assert_eq!(stack.envoy.filter_counter("wait_timed_out"), before + 2);
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201);
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn worker_waiter_bound(stack: Stack) {
    // max_waiters = 1 on the (single) worker: a second waiter gets 409 at once.
    let c = client(&stack);
    let key = unique_key("bound");
    let body = charge_body(1400);
    let first = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(3_000));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let waiter = send_in_background(
        &c,
        checkout(&key, "alice", &body).header("prefer", "wait=5"),
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let started = Instant::now();
    let refused = c
        .send(checkout(&key, "alice", &body).header("prefer", "wait=5"))
        .await;
    assert_problem(&refused, 409, "request-in-progress", &stack);
    // At once: the first (3 s) and the admitted waiter are still running.
    assert!(
        !first.is_finished() && !waiter.is_finished(),
        "refused after {:?}",
        started.elapsed()
    );
    assert_eq!(applied(&refused), None, "it did not wait");
    assert_eq!(stack.envoy.filter_counter("wait_refused"), 1);
    let waiter = waiter.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(replayed(&waiter), "{}", waiter.describe());
    let _ = first.await;
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn state_api_waiter_bound(stack: Stack) {
    // STATE_API_MAX_WAITERS = 1: a waiter from a second Envoy is answered at once.
    let other = stack
        .start_extra_envoy(stack.state_api.port, "envoy-second")
        .unwrap_or_else(|e| panic!("{e}"));
    let c = client(&stack);
    let key = unique_key("api-bound");
    let body = charge_body(1500);
    let first = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(3_000));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let waiter = send_in_background(
        &c,
        checkout(&key, "alice", &body).header("prefer", "wait=5"),
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let refused = Client::new(&other.url(""))
        .send(checkout(&key, "alice", &body).header("prefer", "wait=5"))
        .await;
    assert_problem(&refused, 409, "request-in-progress", &stack);
    // Refused at once: the first (3 s) is still running.
    assert!(!first.is_finished(), "the refused waiter waited");
    assert_eq!(applied(&refused), None);
    assert_eq!(other.filter_counter("wait_refused"), 1);
    let metrics = Client::new(&stack.state_api.url(""))
        .send(Request::get("/metrics"))
        .await
        .text();
    assert_eq!(
        metric(&metrics, "state_api_waits_total{end=\"refused\"}"),
        1,
        "{metrics}"
    );
    assert!(replayed(&waiter.await.unwrap_or_else(|e| panic!("{e}"))));
    let _ = first.await;
}

// ---------------------------------------------------------------------------------------------
// What the fingerprint covers, and the key from the body

async fn ignore_list(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("ignore");
    let body = |sent_at: u64, trace: &str, sku: &str, v: u64| {
        json!({"amount": 1600, "currency": "BRL", "card": {"number": "4242424242424242"},
               "meta": {"sent_at": sent_at, "v": v},
               "items": [{"trace": trace, "sku": sku}, {"trace": "kept", "sku": "b"}]})
    };
    let first = c
        .send(checkout(&key, "alice", &body(1, "t1", "a", 1)))
        .await;
    assert_eq!(first.status, 201, "{}", first.describe());
    // A new timestamp and trace id on the retry: the same request.
    let retry = c
        .send(checkout(&key, "alice", &body(2, "t2", "a", 1)))
        .await;
    assert!(replayed(&retry), "{}", retry.describe());
    assert_eq!(retry.json()["id"], first.json()["id"]);
    // Anything else that changes, nested too, is another request under the same key.
    for (what, changed) in [
        (
            "a nested member beside an ignored one",
            body(1, "t1", "a", 2),
        ),
        ("a member of the same array item", body(1, "t1", "z", 1)),
        (
            "the trace of another item",
            json!({"amount": 1600, "currency": "BRL", "card": {"number": "4242424242424242"},
                   "meta": {"sent_at": 1, "v": 1},
                   "items": [{"trace": "t1", "sku": "a"}, {"trace": "changed", "sku": "b"}]}),
        ),
    ] {
        let a = c.send(checkout(&key, "alice", &changed)).await;
        assert_problem(&a, 422, "idempotency-key-reused", &stack);
        assert!(!replayed(&a), "{what}");
    }
    assert_eq!(executions(&stack, &key).await.len(), 1);
    // The record names its selection.
    let alg = stack
        .postgres
        .psql(
            stack.database_name(),
            "SELECT DISTINCT fingerprint_alg FROM idempotency_records WHERE endpoint = 'POST /checkout' AND fingerprint_alg LIKE '%ignore=%'",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(alg.starts_with("sha256-jcs-v2;ignore="), "{alg}");
}

async fn include_list_and_key_from_body(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("include");
    let body = |note: &str, card: &str, items: serde_json::Value| json!({"amount": 1700, "currency": "BRL", "card": {"number": card, "exp": note}, "note": note, "items": items});
    let first = c
        .send(refund_in_body(
            &key,
            "alice",
            &body("a", "4242", json!([1, 2])),
        ))
        .await;
    assert_eq!(first.status, 201, "{}", first.describe());
    // The checkout got the body's key as the Idempotency-Key it is claimed under.
    let ran = executions(&stack, &key).await;
    assert_eq!(ran.len(), 1, "{ran:?}");
    // Members outside the list change freely.
    let same = c
        .send(refund_in_body(
            &key,
            "alice",
            &body("b", "4242", json!([9, 2])),
        ))
        .await;
    assert!(replayed(&same), "{}", same.describe());
    // Members in it do not.
    for changed in [
        body("a", "0000", json!([1, 2])),
        body("a", "4242", json!([1, 3])),
    ] {
        let a = c.send(refund_in_body(&key, "alice", &changed)).await;
        assert_problem(&a, 422, "idempotency-key-reused", &stack);
    }
    // The header is not the key on this route; a body without the member is 400.
    let no_member = c
        .send(
            Request::post("/refunds")
                .token(&token("alice"))
                .key(&key)
                .json(&body("a", "4242", json!([1, 2]))),
        )
        .await;
    assert_problem(&no_member, 400, "missing-idempotency-key", &stack);
    assert!(
        no_member.text().contains("/idempotency_key"),
        "{}",
        no_member.text()
    );
    let mut bad = body("a", "4242", json!([1, 2]));
    bad["idempotency_key"] = "has spaces".into();
    let bad = c
        .send(Request::post("/refunds").token(&token("alice")).json(&bad))
        .await;
    assert_problem(&bad, 400, "invalid-idempotency-key", &stack);
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Retention

/// The retention in seconds that the newest completed record of `subject` on `endpoint` is kept
/// for: its expiry less its claim's time and lease (completed within the lease, the record keeps
/// the claim's expiry, created + lease + retention), by Postgres.
fn retention_s(stack: &Stack, endpoint: &str, subject: &str) -> Vec<i64> {
    stack
        .postgres
        .psql(
            stack.database_name(),
            &format!(
                "SELECT round(EXTRACT(EPOCH FROM expires_at - created_at) - lease_ms / 1000.0)::bigint FROM idempotency_records WHERE endpoint = '{endpoint}' AND subject = '{subject}' AND state = 'completed' ORDER BY created_at DESC LIMIT 1"
            ),
        )
        .unwrap_or_else(|e| panic!("{e}"))
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

async fn retention_per_route(stack: Arc<Stack>) {
    let c = client(&stack);
    // bob's records, so that other tests' records do not get in the way.
    let key = unique_key("retention");
    assert_eq!(
        c.send(checkout(&key, "bob", &charge_body(1800)))
            .await
            .status,
        201
    );
    let checkout_left = retention_s(&stack, "POST /checkout", "bob");
    assert!(
        checkout_left.first().is_some_and(|s| *s == 3_600),
        "POST /checkout asks for an hour: {checkout_left:?}"
    );
    let key = unique_key("retention-default");
    assert_eq!(
        c.send(refund_in_body(&key, "bob", &charge_body(1801)))
            .await
            .status,
        201
    );
    let refund_left = retention_s(&stack, "POST /refunds", "bob");
    assert!(
        refund_left.first().is_some_and(|s| *s == 86_400),
        "POST /refunds keeps the state API's default (24 h): {refund_left:?}"
    );
    // Operators see the expiry.
    let shown = idemctl(
        &stack,
        ADMIN_TOKEN,
        &[
            "show",
            "--key",
            &key,
            "--subject",
            "bob",
            "--endpoint",
            "POST /refunds",
        ],
    );
    assert!(shown.ok(), "{shown:?}");
    // (24 h after the claim's 30 s lease: just over a day from now)
    assert!(
        shown.stdout.contains("expires      in 1day 29s")
            || shown.stdout.contains("expires      in 1day 30s"),
        "{}",
        shown.stdout
    );
    record_figures(
        SUITE,
        "retention_per_route",
        json!({"checkout_retention_s": checkout_left, "refunds_retention_s": refund_left}),
    );
}

// ---------------------------------------------------------------------------------------------
// Operator actions

#[derive(Debug)]
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn ok(&self) -> bool {
        self.code == Some(0)
    }
}

/// The real `idemctl` against the stack's state API.
fn idemctl(stack: &Stack, token: &str, args: &[&str]) -> Ran {
    let bin = workspace_binary("idemctl").unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(&bin)
        .args(args)
        .env("IDEMCTL_URL", stack.state_api.url(""))
        .env("IDEMCTL_TOKEN", token)
        .env("IDEMCTL_ACTOR", "oncall-ana")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e} (make build builds it)", bin.display()));
    Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The audit rows of `endpoint` for alice, newest last: action, actor, reason, forced, the
/// state before and after.
fn audit_rows(stack: &Stack, endpoint: &str, subject: &str) -> Vec<Vec<String>> {
    stack
        .postgres
        .psql(
            stack.database_name(),
            &format!(
                "SELECT action, actor, reason, forced, COALESCE(before->>'state', '-'), COALESCE(after->>'state', '-') FROM idempotency_audit WHERE endpoint = '{endpoint}' AND subject = '{subject}' ORDER BY id"
            ),
        )
        .unwrap_or_else(|e| panic!("{e}"))
        .lines()
        .map(|l| l.split('|').map(str::to_owned).collect())
        .collect()
}

/// A refund whose client leaves before its answer: held as unknown.
async fn unknown_refund(stack: &Stack, key: &str, who: &str, amount: u64) {
    let impatient = Client::impatient(&stack.envoy.url(""), Duration::from_millis(600));
    let left = impatient
        .try_send(
            refund_in_body(key, who, &charge_body(amount))
                .delay_ms(1_500)
                .header("x-demo-detach", "1"),
        )
        .await;
    assert!(left.is_err(), "the client leaves first");
    let c = client(stack);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let a = c.send(refund_in_body(key, who, &charge_body(amount))).await;
        if is_problem(&a, 409, "outcome-unknown") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never held as unknown: {}\n{}",
            a.describe(),
            stack.logs()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn admin_release(stack: Arc<Stack>) {
    // carol has a subject of her own in these tests: her audit rows are this test's.
    let key = unique_key("release");
    unknown_refund(&stack, &key, "alice", 1900).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        executions(&stack, &key).await.len(),
        1,
        "it ran once, unseen"
    );

    let listed = idemctl(
        &stack,
        ADMIN_TOKEN,
        &["list", "--state", "unknown", "--json"],
    );
    assert!(listed.ok(), "{listed:?}");
    let rows: serde_json::Value = serde_json::from_str(&listed.stdout).unwrap_or_default();
    assert!(
        rows.as_array().is_some_and(|r| r
            .iter()
            .any(|x| x["endpoint"] == "POST /refunds" && x["state"] == "unknown")),
        "{rows}"
    );
    // A reason is required.
    let no_reason = idemctl(
        &stack,
        ADMIN_TOKEN,
        &[
            "release",
            "--key",
            &key,
            "--subject",
            "alice",
            "--endpoint",
            "POST /refunds",
        ],
    );
    assert_eq!(no_reason.code, Some(2), "{no_reason:?}");
    let release = |force: bool| {
        let mut args = vec![
            "release",
            "--key",
            &key,
            "--subject",
            "alice",
            "--endpoint",
            "POST /refunds",
            "--reason",
            "checked with the PSP: refund never reached the bank",
        ];
        if force {
            args.push("--force");
        }
        idemctl(&stack, ADMIN_TOKEN, &args)
    };
    // Its owner marked it unknown a moment ago, within its lease (30 s): its request may still
    // run upstream, so a release needs --force (issue 34, path 8).
    let refused = release(false);
    assert_eq!(refused.code, Some(4), "{refused:?}");
    assert!(
        refused.stderr.contains("within its lease"),
        "{}",
        refused.stderr
    );
    let released = release(true);
    assert!(released.ok(), "{released:?}");
    assert!(
        released
            .stdout
            .starts_with("release: unknown -> no record (audit #"),
        "{}",
        released.stdout
    );
    // The operator's word is the proof: the edge forwards the key again. The demo checkout,
    // which dedupes on the key itself (issue 34), answers with the refund it already made.
    let again = client(&stack)
        .send(refund_in_body(&key, "alice", &charge_body(1900)))
        .await;
    assert!(
        again.status == 201 && !replayed(&again),
        "{}",
        again.describe()
    );
    assert_eq!(attempt_states(&stack, &key).await, ["executed", "replayed"]);
    assert_eq!(executions(&stack, &key).await.len(), 1);
    let shown = idemctl(
        &stack,
        ADMIN_TOKEN,
        &[
            "show",
            "--key",
            &key,
            "--subject",
            "alice",
            "--endpoint",
            "POST /refunds",
            "--json",
        ],
    );
    let shown: serde_json::Value = serde_json::from_str(&shown.stdout).unwrap_or_default();
    assert_eq!(shown["record"]["state"], "completed");
    let audit = &shown["audit"];
    assert_eq!(audit[0]["action"], "release");
    assert_eq!(audit[0]["actor"], "oncall-ana");
    assert_eq!(audit[0]["before"]["state"], "unknown");
    assert!(audit[0]["after"].is_null());
    assert!(
        shown.get("body_base64").is_none(),
        "never the body by default"
    );
    // In Postgres, in the audit table.
    let scope = shown["scope"].as_str().unwrap_or_default().to_owned();
    let row = stack
        .postgres
        .psql(
            stack.database_name(),
            &format!("SELECT action, actor, reason, forced, before->>'state' FROM idempotency_audit WHERE scope_hash = '\\x{scope}'"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        row,
        "release|oncall-ana|checked with the PSP: refund never reached the bank|t|unknown"
    );
    // The audit table is append-only.
    let tamper = stack.postgres.psql(
        stack.database_name(),
        &format!("UPDATE idempotency_audit SET reason = 'x' WHERE scope_hash = '\\x{scope}'"),
    );
    assert!(tamper.is_err(), "{tamper:?}");
}

async fn admin_resolve_and_purge(stack: Arc<Stack>) {
    let c = client(&stack);
    let at = |key: &str| {
        vec![
            "--key".to_owned(),
            key.to_owned(),
            "--subject".into(),
            "alice".into(),
            "--endpoint".into(),
            "POST /refunds".into(),
        ]
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        idemctl(&stack, ADMIN_TOKEN, &args)
    };
    // Resolved with the outcome the PSP reported: retries get it as a replay.
    let key = unique_key("resolve");
    unknown_refund(&stack, &key, "alice", 2000).await;
    let mut args = vec!["resolve".to_owned()];
    args.extend(at(&key));
    args.extend(
        [
            "--status",
            "201",
            "--header",
            "content-type: application/json",
            "--body",
            r#"{"id":"re_manual","status":"succeeded"}"#,
            "--reason",
            "PSP dashboard shows re_manual",
        ]
        .map(str::to_owned),
    );
    // Within the owner's lease (it marked the outcome unknown a moment ago): --force.
    let mut forced = args.clone();
    forced.push("--force".into());
    let resolved = run(forced);
    assert!(resolved.ok(), "{resolved:?}");
    let replay = c
        .send(refund_in_body(&key, "alice", &charge_body(2000)))
        .await;
    assert!(replayed(&replay), "{}", replay.describe());
    assert_eq!(replay.status, 201);
    assert_eq!(replay.json()["id"], "re_manual");
    // A completed record is not resolved again without --force.
    let again = run(args.clone());
    assert_eq!(again.code, Some(4), "{again:?}");
    assert!(
        again.stderr.contains("already completed"),
        "{}",
        again.stderr
    );

    // Resolved as not replayable: retries learn it ran, without a body.
    let key = unique_key("resolve-nr");
    unknown_refund(&stack, &key, "alice", 2001).await;
    let mut args = vec!["resolve".to_owned()];
    args.extend(at(&key));
    args.extend(
        [
            "--status",
            "201",
            "--not-replayable",
            "--reason",
            "ran; response lost",
            "--force",
        ]
        .map(str::to_owned),
    );
    assert!(run(args).ok());
    let a = c
        .send(refund_in_body(&key, "alice", &charge_body(2001)))
        .await;
    assert_problem(&a, 409, "outcome-not-replayable", &stack);

    // Purged: the key is new again.
    let key = unique_key("purge");
    assert_eq!(
        c.send(refund_in_body(&key, "alice", &charge_body(2002)))
            .await
            .status,
        201
    );
    let mut args = vec!["purge".to_owned()];
    args.extend(at(&key));
    args.extend(["--reason", "test data"].map(str::to_owned));
    let purged = run(args);
    assert!(purged.ok(), "{purged:?}");
    assert!(
        purged.stdout.starts_with("purge: completed -> no record"),
        "{}",
        purged.stdout
    );
    // An Envoy that has not answered the key from memory runs it as new; one that has keeps
    // replaying it until its replay_cache_ttl_ms (60 s) runs out (docs/operating/idemctl.md).
    let fresh = stack
        .start_extra_envoy(stack.state_api.port, "envoy-after-purge")
        .unwrap_or_else(|e| panic!("{e}"));
    let anew = Client::new(&fresh.url(""))
        .send(refund_in_body(&key, "alice", &charge_body(2002)))
        .await;
    assert!(
        anew.status == 201 && !replayed(&anew),
        "{}",
        anew.describe()
    );
    // Forwarded again; the demo checkout dedupes on the key itself (issue 34): the same
    // refund, no second one.
    assert_eq!(attempt_states(&stack, &key).await, ["executed", "replayed"]);
    assert_eq!(executions(&stack, &key).await.len(), 1);

    // Counted per action.
    let metrics = Client::new(&stack.state_api.url(""))
        .send(Request::get("/metrics"))
        .await
        .text();
    for action in ["resolve", "purge"] {
        let name = format!("state_api_admin_actions_total{{action=\"{action}\"}}");
        assert!(metric(&metrics, &name) >= 1, "{name}: {metrics}");
    }
}

async fn admin_refusals(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("refusals");
    let at = [
        "--key",
        key.as_str(),
        "--subject",
        "alice",
        "--endpoint",
        "POST /checkout",
    ];
    let with = |cmd: &str, extra: &[&str]| -> Vec<String> {
        let mut v = vec![cmd.to_owned()];
        v.extend(at.iter().map(|s| (*s).to_owned()));
        v.extend(extra.iter().map(|s| (*s).to_owned()));
        v
    };
    let run = |token: &str, args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        idemctl(&stack, token, &args)
    };
    // No record yet: 404.
    let missing = run(ADMIN_TOKEN, with("show", &[]));
    assert_eq!(missing.code, Some(3), "{missing:?}");
    assert!(missing.stderr.contains("HTTP 404"), "{}", missing.stderr);
    // Wrong token 401, the filter's token 403, no token at all: refused before any call.
    let wrong = run("not-the-admin-token-at-all", with("show", &[]));
    assert_eq!(wrong.code, Some(5), "{wrong:?}");
    assert!(wrong.stderr.contains("HTTP 401"), "{}", wrong.stderr);
    let filters = run(TEST_API_TOKEN, with("show", &[]));
    assert_eq!(filters.code, Some(5), "{filters:?}");
    assert!(filters.stderr.contains("HTTP 403"), "{}", filters.stderr);
    let none = run("", with("show", &[]));
    assert_eq!(none.code, Some(2), "{none:?}");

    // A live lease: release refused (409) unless forced, and the forced one is audited so.
    let body = charge_body(2100);
    let first = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(3_000));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let live = run(ADMIN_TOKEN, with("release", &["--reason", "stuck?"]));
    assert_eq!(live.code, Some(4), "{live:?}");
    assert!(live.stderr.contains("live lease"), "{}", live.stderr);
    assert!(live.stderr.contains("--force"), "{}", live.stderr);
    let forced = run(
        ADMIN_TOKEN,
        with("release", &["--reason", "owner host is gone", "--force"]),
    );
    assert!(forced.ok(), "{forced:?}");
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    // Its complete is refused (the record was released under it); its response still goes on.
    assert_eq!(first.status, 201, "{}", first.describe());
    let rows = audit_rows(&stack, "POST /checkout", "alice");
    let last = rows.last().cloned().unwrap_or_default();
    assert_eq!(
        last,
        [
            "release",
            "oncall-ana",
            "owner host is gone",
            "t",
            "in_progress",
            "-"
        ],
        "{rows:?}"
    );
    // The refusals wrote nothing.
    assert_eq!(
        rows.iter().filter(|r| r[2] == "stuck?").count(),
        0,
        "{rows:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Namespaces

async fn namespaces(stack: Arc<Stack>) {
    // Two deployments on the one state API and database, each with its namespace.
    let start = |ns: &'static str| -> Envoy {
        let options = StackOptions {
            tweak: Some(Tweak::new(move |c| {
                features(c);
                c.namespace = ns.to_owned();
            })),
            ..options()
        };
        let params = Stack::envoy_params_for(&options, stack.state_api.port, stack.checkout.port)
            .unwrap_or_else(|e| panic!("{e}"));
        Envoy::start(params, &stack.dir, &format!("envoy-{ns}")).unwrap_or_else(|e| panic!("{e}"))
    };
    let a = start("tenant-a");
    let b = start("tenant-b");
    let key = unique_key("namespaced");
    let body = charge_body(2200);
    let mut ids = Vec::new();
    for envoy in [&a, &b] {
        let c = Client::new(&envoy.url(""));
        let first = c.send(checkout(&key, "alice", &body)).await;
        assert_eq!(first.status, 201, "{}", first.describe());
        assert!(
            !replayed(&first),
            "the other namespace's record is not this one's"
        );
        let retry = c.send(checkout(&key, "alice", &body)).await;
        assert!(replayed(&retry));
        assert_eq!(retry.json()["id"], first.json()["id"]);
        ids.push(first.json()["id"].clone());
    }
    // Each deployment forwarded the key once: two attempts at the one checkout, which dedupes
    // the same key and subject itself (issue 34) and answered the second with the first charge.
    assert_eq!(ids[0], ids[1]);
    assert_eq!(attempt_states(&stack, &key).await, ["executed", "replayed"]);
    // Another body under the same key is 422 in each, whatever the other holds.
    let a_other = Client::new(&a.url(""))
        .send(checkout(&key, "alice", &charge_body(1)))
        .await;
    assert_problem(&a_other, 422, "idempotency-key-reused", &stack);
    assert_eq!(
        executions(&stack, &key).await.len(),
        1,
        "forwarded by each deployment, charged once by the checkout"
    );
    let namespaces = stack
        .postgres
        .psql(
            stack.database_name(),
            "SELECT namespace FROM idempotency_records WHERE namespace LIKE 'tenant-%' ORDER BY namespace",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(namespaces, "tenant-a\ntenant-b");
    // Operators address a record by its namespace too.
    for (ns, found) in [("tenant-a", true), ("", false)] {
        let shown = idemctl(
            &stack,
            ADMIN_TOKEN,
            &[
                "show",
                "--namespace",
                ns,
                "--key",
                &key,
                "--subject",
                "alice",
                "--endpoint",
                "POST /checkout",
            ],
        );
        assert_eq!(shown.ok(), found, "{ns:?}: {shown:?}");
    }
}
