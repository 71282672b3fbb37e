//! What the end-to-end, fault and hostile-input suites share: running an async test body, the
//! demo's requests, and checks on answers.

use std::future::Future;
use std::sync::{Arc, Mutex};

use libtest_mimic::{Failed, Trial};
use sha2::{Digest, Sha256};

use crate::client::{Answer, Client, Request};
use crate::services::ServiceTestExt as _;
use crate::stack::{token, Stack, StackOptions};

/// Runs an async test body on a runtime of its own.
pub fn block_on<F: Future<Output = ()>>(f: F) -> Result<(), Failed> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failed::from(e.to_string()))?
        .block_on(f);
    Ok(())
}

/// One stack shared by the tests of a binary: started by the first test that needs it (or why
/// it could not start, for every test after), stopped by [`SharedStack::run`] at the end.
pub struct SharedStack {
    slot: Mutex<Option<Result<Arc<Stack>, String>>>,
    start: fn() -> Result<Stack, String>,
}

impl SharedStack {
    pub const fn new(start: fn() -> Result<Stack, String>) -> Self {
        Self {
            slot: Mutex::new(None),
            start,
        }
    }

    pub fn get(&self) -> Result<Arc<Stack>, Failed> {
        let mut guard = self
            .slot
            .lock()
            .map_err(|_| Failed::from("shared stack lock poisoned"))?;
        let started = guard.get_or_insert_with(|| (self.start)().map(Arc::new));
        started.clone().map_err(Failed::from)
    }

    /// A test on the shared stack.
    pub fn trial<F, Fut>(&'static self, name: &'static str, body: F) -> Trial
    where
        F: FnOnce(Arc<Stack>) -> Fut + Send + 'static,
        Fut: Future<Output = ()>,
    {
        Trial::test(name, move || {
            let stack = self.get()?;
            block_on(body(stack))
        })
    }

    /// Runs the trials, stops the stack, exits with their conclusion.
    pub fn run(&self, args: &libtest_mimic::Arguments, trials: Vec<Trial>) -> ! {
        let conclusion = libtest_mimic::run(args, trials);
        if let Ok(mut guard) = self.slot.lock() {
            guard.take();
        }
        conclusion.exit();
    }
}

/// The demo stack, with the default options.
pub fn default_stack() -> Result<Stack, String> {
    Stack::start(StackOptions::default())
}

/// A test on a stack of its own (for tests that kill a part of it).
pub fn own<F, Fut>(name: &'static str, options: StackOptions, body: F) -> Trial
where
    F: FnOnce(Stack) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    Trial::test(name, move || {
        let stack = Stack::start(options).map_err(Failed::from)?;
        block_on(body(stack))
    })
}

/// A client of the stack's Envoy.
pub fn client(stack: &Stack) -> Client {
    Client::new(&stack.envoy.url(""))
}

/// A charge the demo checkout accepts.
pub fn charge_body(amount: u64) -> serde_json::Value {
    serde_json::json!({"amount": amount, "currency": "BRL", "card": {"number": "4242424242424242", "exp": "12/30"}})
}

/// `POST /checkout` with `key`, as the demo user `who`.
pub fn checkout(key: &str, who: &str, body: &serde_json::Value) -> Request {
    Request::post("/checkout")
        .token(&token(who))
        .key(key)
        .json(body)
}

/// `POST /refunds` with `key`, as the demo user `who`: the same key on another endpoint.
pub fn refund(key: &str, who: &str, body: &serde_json::Value) -> Request {
    Request::post("/refunds")
        .token(&token(who))
        .key(key)
        .json(body)
}

/// Sends `req` on a task of its own (a slow first request while duplicates follow).
pub fn send_in_background(c: &Client, req: Request) -> tokio::task::JoinHandle<Answer> {
    let c = c.clone();
    tokio::spawn(async move { c.send(req).await })
}

/// What the checkout executed for `key`.
pub async fn executions(stack: &Stack, key: &str) -> Vec<serde_json::Value> {
    client(stack)
        .charges_for_key(&stack.checkout.url(""), key)
        .await
}

/// The checkout's attempts for `key` (`GET /attempts`), oldest first: each with its `state`
/// (`running`, `executed`, `fenced`, `abandoned`) and `fencing_token`.
pub async fn attempts(stack: &Stack, key: &str) -> Vec<serde_json::Value> {
    let all = Client::new(&stack.checkout.url(""))
        .send(Request::get("/attempts"))
        .await
        .json();
    all.as_array()
        .map(|a| {
            a.iter()
                .filter(|x| x["idempotency_key"] == key)
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// The states of the checkout's attempts for `key`, oldest first.
pub async fn attempt_states(stack: &Stack, key: &str) -> Vec<String> {
    attempts(stack, key)
        .await
        .iter()
        .filter_map(|a| a["state"].as_str().map(str::to_owned))
        .collect()
}

/// The state of alice's record of `key` on `endpoint` at the state API (`GET /v1/records`):
/// `in_progress`, `unknown`, `completed`, or what went wrong.
pub async fn record_state(stack: &Stack, key: &str, endpoint: &str) -> String {
    let path = format!(
        "{}?key={}&subject=alice&endpoint={}",
        contract::wire::RECORDS_PATH,
        crate::client::urlencode(key),
        crate::client::urlencode(endpoint)
    );
    let a = Client::new(&stack.state_api.url(""))
        .try_send(Request::get(&path).token(crate::stack::TEST_API_TOKEN))
        .await;
    match a {
        Ok(a) if a.status == 200 => a.json()["state"].as_str().unwrap_or("?").to_owned(),
        Ok(a) => format!("HTTP {}", a.status),
        Err(e) => format!("unreachable: {e}"),
    }
}

/// True for a problem document of this status whose type ends with `type_suffix`.
pub fn is_problem(answer: &Answer, status: u16, type_suffix: &str) -> bool {
    answer.status == status
        && answer
            .problem_type()
            .is_some_and(|t| t.ends_with(type_suffix))
}

/// A problem document of this status and type, with the RFC 9457 members filled in.
pub fn assert_problem(answer: &Answer, status: u16, type_suffix: &str, stack: &Stack) {
    assert!(
        is_problem(answer, status, type_suffix),
        "expected {status} …{type_suffix}, got {}\n{}",
        answer.describe(),
        stack.logs()
    );
    let doc = answer.json();
    for member in ["type", "title", "detail"] {
        assert!(
            doc.get(member)
                .and_then(|v| v.as_str())
                .is_some_and(|s| !s.is_empty()),
            "problem without {member}: {doc}"
        );
    }
    assert_retry_hints(answer, &doc);
}

/// Issue 48: an edge's problem says whether the same request with the same key can succeed
/// later, in its document (`retry_same_key`) and in the headers the SDKs obey
/// (`x-should-retry`, `Stripe-Should-Retry`), the same in all three; and whether a new key is
/// safe (`new_key_safe`). A state API's own problem (an operator's answer) carries none.
pub fn assert_retry_hints(answer: &Answer, doc: &serde_json::Value) {
    let edge_kind = doc
        .get("type")
        .and_then(|t| t.as_str())
        .and_then(|t| t.strip_prefix("/problems/"))
        .and_then(|slug| {
            contract::ProblemKind::EDGE
                .into_iter()
                .find(|k| k.slug() == slug)
        });
    let Some(kind) = edge_kind else {
        return;
    };
    let expected = kind.retry_same_key().map(|b| b.to_string());
    for name in ["x-should-retry", "stripe-should-retry"] {
        assert_eq!(
            answer.header(name),
            expected,
            "{name} on {}: {doc}",
            kind.slug()
        );
    }
    assert_eq!(
        doc.get("retry_same_key").and_then(|v| v.as_bool()),
        kind.retry_same_key(),
        "retry_same_key: {doc}"
    );
    assert_eq!(
        doc.get("new_key_safe").and_then(|v| v.as_bool()),
        kind.new_key_safe(),
        "new_key_safe: {doc}"
    );
    assert_eq!(
        doc.get("key_state").and_then(|v| v.as_str()),
        kind.key_state(),
        "key_state: {doc}"
    );
    // Stripe's SDKs raise the message of this member (and drop the document without it).
    assert_eq!(
        doc.pointer("/error/code").and_then(|v| v.as_str()),
        Some(kind.slug().replace('-', "_").as_str()),
        "error.code: {doc}"
    );
    assert_eq!(
        doc.pointer("/error/type").and_then(|v| v.as_str()),
        Some(kind.stripe_error_type()),
        "error.type: {doc}"
    );
}

/// True when the answer is a replay of a stored response.
pub fn replayed(answer: &Answer) -> bool {
    answer.header("idempotent-replayed").as_deref() == Some("true")
}

pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a duplicate's answer is: the first execution's 201, its replay, 409 in progress (with
/// `Retry-After`), 503 state unavailable (with `Retry-After`), or `other`.
pub fn classify(a: &Answer) -> &'static str {
    match a.status {
        _ if replayed(a) => "replay",
        201 => "executed",
        409 if is_problem(a, 409, "request-in-progress") && a.header("retry-after").is_some() => {
            "in_progress_409"
        }
        503 if is_problem(a, 503, "idempotency-state-unavailable")
            && a.header("retry-after").is_some() =>
        {
            "unavailable_503"
        }
        _ => "other",
    }
}

/// The demo's smoke through `c`: a new key 201, its retry replayed, another body 422, a
/// duplicate while the first runs 409 (then the first 201). Keys start with `label`.
pub async fn smoke(c: &Client, label: &str) {
    let body = charge_body(4990);
    let key = crate::client::unique_key(label);
    let first = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    let again = c.send(checkout(&key, "alice", &body)).await;
    assert!(
        again.status == 201 && replayed(&again),
        "{}",
        again.describe()
    );
    let changed = c.send(checkout(&key, "alice", &charge_body(1))).await;
    assert!(
        is_problem(&changed, 422, "idempotency-key-reused"),
        "{}",
        changed.describe()
    );
    let slow_key = crate::client::unique_key(&format!("{label}-slow"));
    let slow = send_in_background(c, checkout(&slow_key, "alice", &body).delay_ms(2000));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let dup = c.send(checkout(&slow_key, "alice", &body)).await;
    assert!(
        is_problem(&dup, 409, "request-in-progress"),
        "{}",
        dup.describe()
    );
    let slow = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(slow.status, 201, "{}", slow.describe());
}
