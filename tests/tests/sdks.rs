//! Stripe's own SDK through the real Envoy, filter, state API, Postgres and the demo checkout's
//! Stripe-shaped routes (issue 48): what the published client finally gives its caller, with its
//! stock retry rules, when the edge answers. `POST /v1/charges` reconciles an unknown outcome
//! with the checkout; `POST /v1/refunds` holds it (examples/demo.toml).
//!
//! Each test runs with both of Stripe's SDKs, `make tools-sdks` installs them: stripe-python
//! (`tests/sdk/requirements.txt`, into `.venv`) and stripe-node (`tests/sdk/package-lock.json`,
//! into `tests/sdk/node_modules`). `tests/sdk/stripe_call.py` and `stripe_call.mjs` make the
//! calls and report each attempt the SDK made.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use e2e::process::workspace_root;
use e2e::stack::{token, Stack};
use e2e::testkit::*;
use libtest_mimic::Arguments;
use serde_json::{json, Value};

static SHARED: SharedStack = SharedStack::new(default_stack);

type Scenario = fn(Arc<Stack>, Sdk) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

fn main() {
    let args = Arguments::from_args();
    let scenarios: [(&str, Scenario); 7] = [
        (
            "a_timed_out_charge_on_a_reconcile_route_returns_the_charge_that_ran",
            |s, sdk| Box::pin(timed_out_charge_reconciled(s, sdk, 1_200)),
        ),
        (
            "a_charge_still_running_at_the_retry_is_waited_for_and_returned",
            |s, sdk| Box::pin(timed_out_charge_reconciled(s, sdk, 1_600)),
        ),
        (
            "a_timed_out_refund_on_a_hold_route_stops_after_one_retry_saying_the_outcome_is_unknown",
            |s, sdk| Box::pin(timed_out_refund_held(s, sdk)),
        ),
        (
            "a_dropped_connection_on_a_reconcile_route_returns_the_charge_that_ran",
            |s, sdk| Box::pin(dropped_connection_reconciled(s, sdk)),
        ),
        (
            "concurrent_calls_with_their_own_keys_each_charge_once",
            |s, sdk| Box::pin(concurrent_calls(s, sdk)),
        ),
        (
            "a_key_reused_with_another_amount_is_refused_once_and_not_retried",
            |s, sdk| Box::pin(reused_key(s, sdk)),
        ),
        (
            "a_declined_card_is_raised_as_a_card_error_and_replayed_not_charged_again",
            |s, sdk| Box::pin(declined_card(s, sdk)),
        ),
    ];
    let mut trials = Vec::new();
    for sdk in [Sdk::Python, Sdk::Node] {
        for (name, scenario) in scenarios {
            let name: &'static str = Box::leak(format!("{}::{name}", sdk.name()).into_boxed_str());
            trials.push(SHARED.trial(name, move |stack| scenario(stack, sdk)));
        }
    }
    SHARED.run(&args, trials)
}

/// Which of Stripe's SDKs makes the calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sdk {
    Python,
    Node,
}

impl Sdk {
    fn name(self) -> &'static str {
        match self {
            Self::Python => "stripe_python",
            Self::Node => "stripe_node",
        }
    }

    /// The command that runs its script, once checked that the SDK is installed.
    fn command(self) -> Command {
        let root = workspace_root();
        let (program, probe, script) = match self {
            Self::Python => (
                root.join(".venv/bin/python"),
                vec!["-c".to_owned(), "import stripe".to_owned()],
                root.join("tests/sdk/stripe_call.py"),
            ),
            Self::Node => (
                PathBuf::from("node"),
                vec![
                    "--input-type=module".to_owned(),
                    "-e".to_owned(),
                    "import 'stripe'".to_owned(),
                ],
                root.join("tests/sdk/stripe_call.mjs"),
            ),
        };
        let installed = Command::new(&program)
            .args(&probe)
            .current_dir(root.join("tests/sdk"))
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            installed,
            "{} is not installed: run `make tools-sdks` (stripe-python into .venv from tests/sdk/requirements.txt, stripe-node into tests/sdk/node_modules from its lock file; Node.js 20 or later)",
            self.name()
        );
        let mut command = Command::new(program);
        command.arg(script).current_dir(root.join("tests/sdk"));
        command
    }

    /// The exception each SDK raises for a v1 error: chosen by the status (402: a card
    /// error; 409, 422 and 5xx: the generic API error, whatever the error's `type`).
    fn error_class(self, status: u16) -> &'static str {
        match (self, status) {
            (Self::Python, 402) => "CardError",
            (Self::Python, _) => "APIError",
            (Self::Node, 402) => "StripeCardError",
            (Self::Node, _) => "StripeAPIError",
        }
    }
}

/// One SDK call: what it finally gave and its attempts.
#[derive(Debug)]
struct Outcome {
    object: Option<Value>,
    error: Option<Value>,
    attempts: Vec<Value>,
}

impl Outcome {
    /// The key the SDK sent (the same on every attempt).
    fn key(&self) -> String {
        let keys: Vec<&str> = self
            .attempts
            .iter()
            .filter_map(|a| a["idempotency_key"].as_str())
            .collect();
        assert!(
            keys.windows(2).all(|w| w[0] == w[1]),
            "the SDK changed its key between retries: {keys:?}"
        );
        keys.first()
            .map(|k| (*k).to_owned())
            .unwrap_or_else(|| panic!("no attempt got an answer: {self:?}"))
    }
}

/// Runs the calls concurrently in one SDK process, with the client's timeout.
async fn run_sdk(sdk: Sdk, stack: &Stack, timeout_s: f64, calls: Vec<Value>) -> Vec<Outcome> {
    let args = json!({
        "base": stack.envoy.url(""),
        "token": token("alice"),
        "timeout_s": timeout_s,
        "calls": calls,
    });
    let mut command = sdk.command();
    let out = tokio::task::spawn_blocking(move || command.arg(args.to_string()).output())
        .await
        .unwrap_or_else(|e| panic!("the SDK's task: {e}"))
        .unwrap_or_else(|e| panic!("running the SDK: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the SDK's script failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("the SDK's report {stdout:?}: {e}"));
    report["results"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|r| Outcome {
            object: r.get("object").cloned(),
            error: r.get("error").cloned(),
            attempts: r["attempts"].as_array().cloned().unwrap_or_default(),
        })
        .collect()
}

fn charge(params: Value) -> Value {
    json!({"resource": "charge", "params": params})
}

fn one(mut outcomes: Vec<Outcome>) -> Outcome {
    assert_eq!(outcomes.len(), 1, "{outcomes:?}");
    let got = outcomes.remove(0);
    // What the SDK saw, attempt by attempt (in the test's output with --nocapture).
    let seen: Vec<String> = got
        .attempts
        .iter()
        .map(|a| match (a["status"].as_u64(), a["error"].as_str()) {
            (Some(status), _) => format!("{status} (should-retry {})", a["stripe_should_retry"]),
            (None, Some(error)) => error.to_owned(),
            _ => a.to_string(),
        })
        .collect();
    println!("the SDK's attempts: {}", seen.join(", "));
    got
}

/// Waits until the checkout has executed `key` (a detached charge finishes after its caller
/// left) and returns its executions.
async fn executed(stack: &Stack, key: &str) -> Vec<Value> {
    for _ in 0..100 {
        let runs = executions(stack, key).await;
        if !runs.is_empty() {
            // A second execution would follow at once: look again a little later.
            tokio::time::sleep(Duration::from_millis(300)).await;
            return executions(stack, key).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{key} never executed")
}

/// The charge's id as the checkout's ledger numbers it (`ch_demo<n>`).
fn ledger_charge_id(run: &Value) -> String {
    format!("ch_demo{}", run["id"])
}

/// The client gives up after 1 s; the charge completes `delay_ms` after it starts. The SDK
/// retries the timeout after 0.5 s with the same key: the first attempt's outcome is unknown and
/// the route asks the checkout. At 1.2 s the charge has run by the retry: the SDK gets it. At
/// 1.6 s it is still running: the retry gets `409` with `Stripe-Should-Retry: true`, and the
/// next retry gets the charge (both within the SDKs' stock two retries).
async fn timed_out_charge_reconciled(stack: Arc<Stack>, sdk: Sdk, delay_ms: u64) {
    let got = one(run_sdk(
        sdk,
        &stack,
        1.0,
        vec![charge(json!({
            "amount": 2000, "currency": "usd", "source": "tok_visa",
            "metadata": {"order": "o-timeout", "demo_delay_ms": delay_ms.to_string()},
        }))],
    )
    .await);
    let key = got.key();
    let runs = executed(&stack, &key).await;
    assert_eq!(runs.len(), 1, "ran more than once: {runs:?}");
    assert!(
        got.attempts.first().is_some_and(|a| a["error"].is_string()),
        "the first attempt should time out: {got:?}"
    );
    let object = got
        .object
        .clone()
        .unwrap_or_else(|| panic!("the SDK raised instead of returning the charge: {got:?}"));
    assert_eq!(object["id"], ledger_charge_id(&runs[0]), "{object}");
    assert_eq!(object["amount"], 2000);
    assert!(got.attempts.len() <= 3, "{got:?}");
}

/// The same on the hold route: the retry gets `409 outcome-unknown` with
/// `Stripe-Should-Retry: false`, so the SDK stops after that one retry and raises the edge's
/// message, which says the outcome is unknown and what to do.
async fn timed_out_refund_held(stack: Arc<Stack>, sdk: Sdk) {
    let got = one(run_sdk(
        sdk,
        &stack,
        1.0,
        vec![json!({"resource": "refund", "params": {
            "charge": "ch_demo1", "amount": 500,
            "metadata": {"demo_delay_ms": "1500"},
        }})],
    )
    .await);
    let key = got.key();
    assert_eq!(got.attempts.len(), 2, "one retry, then stop: {got:?}");
    assert_eq!(got.attempts[1]["status"], 409, "{got:?}");
    assert_eq!(got.attempts[1]["stripe_should_retry"], "false", "{got:?}");
    let error = got
        .error
        .clone()
        .unwrap_or_else(|| panic!("the SDK returned instead of raising: {got:?}"));
    assert_eq!(error["class"], sdk.error_class(409), "{error}");
    assert_eq!(error["http_status"], 409, "{error}");
    assert_eq!(error["error_code"], "outcome_unknown", "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("unknown") && message.contains("new key") && message.contains("support"),
        "the message should say the outcome is unknown and what to do: {message}"
    );
    assert!(
        !message.contains("Invalid response object"),
        "the SDK could not read the edge's answer: {message}"
    );
    let runs = executed(&stack, &key).await;
    assert_eq!(runs.len(), 1, "{runs:?}");
}

/// The checkout charges, then drops the connection: Envoy answers the SDK 503, the SDK retries
/// it, the retry's reconcile finds the charge and the SDK gets it.
async fn dropped_connection_reconciled(stack: Arc<Stack>, sdk: Sdk) {
    let got = one(run_sdk(
        sdk,
        &stack,
        10.0,
        vec![charge(json!({
            "amount": 3100, "currency": "usd", "source": "tok_visa",
            "metadata": {"demo_reset": "1"},
        }))],
    )
    .await);
    let key = got.key();
    let runs = executed(&stack, &key).await;
    assert_eq!(runs.len(), 1, "{runs:?}");
    let object = got
        .object
        .clone()
        .unwrap_or_else(|| panic!("the SDK raised instead of returning the charge: {got:?}"));
    assert_eq!(object["id"], ledger_charge_id(&runs[0]), "{object}");
    assert!(got.attempts.len() >= 2, "{got:?}");
}

/// Eight charges at once, each with the SDK's own key: eight charges, each once.
async fn concurrent_calls(stack: Arc<Stack>, sdk: Sdk) {
    let calls = (0..8)
        .map(|i| charge(json!({"amount": 100 + i, "currency": "usd", "source": "tok_visa"})))
        .collect();
    let got = run_sdk(sdk, &stack, 10.0, calls).await;
    let mut ids = Vec::new();
    for (i, g) in got.iter().enumerate() {
        let object = g
            .object
            .as_ref()
            .unwrap_or_else(|| panic!("call {i} raised: {g:?}"));
        assert_eq!(object["amount"], 100 + i, "{object}");
        let runs = executions(&stack, &g.key()).await;
        assert_eq!(runs.len(), 1, "{runs:?}");
        assert_eq!(object["id"], ledger_charge_id(&runs[0]));
        ids.push(object["id"].to_string());
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 8, "{ids:?}");
}

/// The caller reuses its key for another amount: the SDK raises the edge's 422 after one
/// attempt (`Stripe-Should-Retry: false`), and only the first charge ran.
async fn reused_key(stack: Arc<Stack>, sdk: Sdk) {
    let key = e2e::client::unique_key("sdk");
    let first = one(run_sdk(
        sdk,
        &stack,
        10.0,
        vec![json!({"resource": "charge", "idempotency_key": key,
                "params": {"amount": 1000, "currency": "usd", "source": "tok_visa"}})],
    )
    .await);
    assert!(first.object.is_some(), "{first:?}");
    let second = one(run_sdk(
        sdk,
        &stack,
        10.0,
        vec![json!({"resource": "charge", "idempotency_key": key,
                "params": {"amount": 2000, "currency": "usd", "source": "tok_visa"}})],
    )
    .await);
    assert_eq!(second.attempts.len(), 1, "{second:?}");
    let error = second
        .error
        .clone()
        .unwrap_or_else(|| panic!("the reused key was accepted: {second:?}"));
    assert_eq!(error["class"], sdk.error_class(422), "{error}");
    assert_eq!(error["http_status"], 422, "{error}");
    assert_eq!(error["error_code"], "idempotency_key_reused", "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains("different request"), "{message}");
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

/// A decline is the upstream's answer: the SDK raises its `CardError`; the same call again
/// (same key) gets the stored decline replayed, and the card was tried once.
async fn declined_card(stack: Arc<Stack>, sdk: Sdk) {
    let key = e2e::client::unique_key("sdk");
    let call = json!({"resource": "charge", "idempotency_key": key,
        "params": {"amount": 700, "currency": "usd", "source": "tok_chargeDeclined"}});
    for _ in 0..2 {
        let got = one(run_sdk(sdk, &stack, 10.0, vec![call.clone()]).await);
        let error = got
            .error
            .clone()
            .unwrap_or_else(|| panic!("a declined card was accepted: {got:?}"));
        assert_eq!(error["class"], sdk.error_class(402), "{error}");
        assert_eq!(error["error_code"], "card_declined", "{error}");
        assert_eq!(got.attempts.len(), 1, "{got:?}");
    }
    assert_eq!(executions(&stack, &key).await.len(), 1);
}
