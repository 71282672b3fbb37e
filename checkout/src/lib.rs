//! The demo checkout upstream: what the idempotency layer protects.
//!
//! It records every execution in an in-memory ledger (`GET /charges`), so the tests and the
//! demo can count how many times a payment really ran. It does not deduplicate calls that carry
//! no fencing token (the edge does), but it behaves like a careful payment service towards the
//! edge ([`attempts`]): it records each attempt with its request (endpoint, subject, key and
//! fingerprint, as the edge forwards them) and its fencing token before executing, refuses a
//! token lower than one already seen for the request or already used, answers a later attempt
//! of a request that executed with that execution's response (never a second charge), and
//! answers the reconcile endpoint (`GET /checkout/attempts/{key}`, `GET /refunds/attempts/{key}`:
//! either answers about the request its headers name) that tells the edge what became of a
//! request whose outcome it never saw.

pub mod attempts;
pub mod stripe;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use attempts::{Attempts, Committed, Produced, Reconciled, Refusal, Scope, Started};
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

/// The card number that is always declined (Stripe's test card for a generic decline).
pub const DECLINED_CARD: &str = "4000000000000002";
/// Longest processing delay a request may ask for, so a stray header cannot pin a task forever.
const MAX_DELAY_MS: u64 = 120_000;

/// One execution of `POST /checkout`, `POST /refunds` or a subscription change
/// (`PUT`, `PATCH`, `DELETE /subscriptions/{id}`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LedgerEntry {
    pub id: u64,
    /// `charge`, `refund`, `subscription.put`, `subscription.patch` or `subscription.delete`.
    pub kind: String,
    /// `succeeded`, `declined`, `failed` (asked to fail with x-demo-fail), `invalid` (unparseable body)
    /// or `reset` (asked to drop the connection with x-demo-reset; status 0: nothing was sent).
    pub outcome: String,
    pub status: u16,
    pub amount: Option<serde_json::Value>,
    /// The authenticated subject Envoy forwarded (x-jwt-sub).
    pub subject: Option<String>,
    /// The forwarded Idempotency-Key header, verbatim.
    pub idempotency_key: Option<String>,
    pub fencing_token: Option<String>,
    /// SHA-256 of the body exactly as received, hex; lets tests prove no byte was lost.
    pub body_sha256: String,
    pub body_len: usize,
}

/// The ledger and the record of attempts, each bounded: a demo left running for days keeps
/// the last `max_requests` charges and requests (`CHECKOUT_MAX_REQUESTS`), not every one.
pub struct Ledger {
    next_id: AtomicU64,
    entries: Mutex<Charges>,
    attempts: Mutex<Attempts>,
}

/// The last executions, oldest first, and how many older ones were dropped.
#[derive(Default)]
struct Charges {
    kept: std::collections::VecDeque<LedgerEntry>,
    max: usize,
    forgotten: u64,
}

impl Default for Ledger {
    fn default() -> Self {
        Self::with_limit(attempts::DEFAULT_MAX_REQUESTS)
    }
}

impl Ledger {
    /// Keeps the last `max_requests` executions and requests (at least one).
    pub fn with_limit(max_requests: usize) -> Self {
        Self {
            next_id: AtomicU64::new(0),
            entries: Mutex::new(Charges {
                max: max_requests.max(1),
                ..Charges::default()
            }),
            attempts: Mutex::new(Attempts::with_limit(max_requests)),
        }
    }

    fn record(&self, mut entry: LedgerEntry) -> LedgerEntry {
        entry.id = self.next_id.fetch_add(1, Ordering::SeqCst) + 1;
        if let Ok(mut charges) = self.entries.lock() {
            charges.kept.push_back(entry.clone());
            while charges.kept.len() > charges.max {
                charges.kept.pop_front();
                charges.forgotten += 1;
            }
        }
        entry
    }

    /// The executions kept, oldest first.
    pub fn entries(&self) -> Vec<LedgerEntry> {
        self.entries
            .lock()
            .map(|c| c.kept.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Executions dropped from the ledger to keep it bounded.
    pub fn forgotten_entries(&self) -> u64 {
        self.entries.lock().map(|c| c.forgotten).unwrap_or(0)
    }

    fn attempts<T>(&self, f: impl FnOnce(&mut Attempts) -> T) -> Option<T> {
        self.attempts.lock().ok().map(|mut a| f(&mut a))
    }
}

/// An attempt on its way: if its handler is dropped before the commit (the caller left and
/// the execution was not detached), it is recorded as abandoned: nothing ran.
struct AttemptGuard {
    ledger: Arc<Ledger>,
    id: u64,
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        self.ledger.attempts(|a| a.abandoned(self.id));
    }
}

pub fn app(ledger: Arc<Ledger>) -> Router {
    Router::new()
        .route("/checkout", post(checkout))
        .route("/refunds", post(refund))
        .route("/charges", get(list_charges))
        .route("/attempts", get(list_attempts))
        .route("/checkout/attempts/{key}", get(reconcile))
        .route("/refunds/attempts/{key}", get(reconcile))
        .route(
            "/subscriptions/{id}",
            put(subscription).patch(subscription).delete(subscription),
        )
        .route("/subscriptions/attempts/{key}", get(reconcile))
        .route("/v1/charges", post(stripe_charge))
        .route("/v1/charges/attempts/{key}", get(reconcile))
        .route("/v1/refunds", post(stripe_refund))
        .route("/v1/refunds/attempts/{key}", get(reconcile))
        .route("/echo", post(echo))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(ledger)
}

/// What a route executes: its ledger kind, its endpoint (as the edge names it), whether an
/// empty body is a request (a DELETE carries none) and the shape of its bodies.
#[derive(Debug, Clone)]
struct Operation {
    kind: &'static str,
    endpoint: String,
    body_optional: bool,
    shape: Shape,
}

/// The bodies a route reads and answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// JSON in, the demo's JSON out.
    Demo,
    /// Form-encoded in, Stripe's charge and error objects out ([`stripe`]).
    Stripe,
}

impl Operation {
    fn new(kind: &'static str, endpoint: String) -> Self {
        Self {
            kind,
            endpoint,
            body_optional: false,
            shape: Shape::Demo,
        }
    }
}

async fn checkout(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, body: Bytes) -> Response {
    let op = Operation::new("charge", "POST /checkout".into());
    run(ledger, op, headers, body).await
}

async fn refund(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, body: Bytes) -> Response {
    let op = Operation::new("refund", "POST /refunds".into());
    run(ledger, op, headers, body).await
}

/// `POST /v1/charges`: a Stripe-shaped charge ([`stripe`]); its test hooks come as metadata.
async fn stripe_charge(
    State(ledger): State<Arc<Ledger>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    stripe_run(ledger, "charge", "POST /v1/charges", headers, body).await
}

/// `POST /v1/refunds`: a Stripe-shaped refund of `charge`.
async fn stripe_refund(
    State(ledger): State<Arc<Ledger>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    stripe_run(ledger, "refund", "POST /v1/refunds", headers, body).await
}

async fn stripe_run(
    ledger: Arc<Ledger>,
    kind: &'static str,
    endpoint: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let op = Operation {
        shape: Shape::Stripe,
        ..Operation::new(kind, endpoint.into())
    };
    let headers = stripe::with_hooks(headers, &stripe::params(&body));
    run(ledger, op, headers, body).await
}

/// `PUT`, `PATCH` or `DELETE /subscriptions/{id}`: replaces, changes or cancels a subscription
/// (writes keyed as Stripe's v2 API keys them), recorded in the ledger as `subscription.put`,
/// `subscription.patch` or `subscription.delete`. A DELETE needs no body.
async fn subscription(
    State(ledger): State<Arc<Ledger>>,
    method: Method,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let kind = match method {
        Method::PUT => "subscription.put",
        Method::PATCH => "subscription.patch",
        _ => "subscription.delete",
    };
    let op = Operation {
        body_optional: method == Method::DELETE,
        ..Operation::new(kind, format!("{method} /subscriptions/{id}"))
    };
    run(ledger, op, headers, body).await
}

/// Test hooks for the fault suite, on top of `execute`:
/// * `x-demo-detach: 1` runs the execution in its own task, so it finishes (and is recorded)
///   even when the caller's connection goes away meanwhile (an orphaned upstream call, as when
///   the Envoy in front dies). Without it, a dropped connection cancels a delayed execution.
/// * `x-demo-reset: 1` executes (recorded with outcome `reset`), then drops the connection
///   without answering: the charge ran, but no response ever leaves.
/// * and the shapes of the answer, in [`shape`]: `x-demo-reset-body`, `x-demo-gzip`,
///   `x-demo-empty-chunked`, `x-demo-location-bytes`, `x-demo-status`.
async fn run(ledger: Arc<Ledger>, op: Operation, headers: HeaderMap, body: Bytes) -> Response {
    let detach = header(&headers, "x-demo-detach").as_deref() == Some("1");
    let reset = header(&headers, "x-demo-reset").as_deref() == Some("1");
    let response = if detach {
        let task = tokio::spawn(async move { attempt(ledger, &op, &headers, &body, reset).await });
        match task.await {
            Ok(r) => r,
            Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    } else {
        attempt(ledger, &op, &headers, &body, reset).await
    };
    if reset {
        // Unwinding out of the handler ends the connection's task: hyper drops the socket
        // without writing a response. `resume_unwind` skips the panic hook (no log noise).
        std::panic::resume_unwind(Box::new("x-demo-reset: connection dropped on purpose"));
    }
    response
}

/// `POST /echo` (a test hook): the request headers the checkout received, executing nothing.
async fn echo(headers: HeaderMap) -> Json<serde_json::Value> {
    let pairs: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    Json(serde_json::json!({ "headers": pairs }))
}

#[derive(Deserialize)]
struct ChargesQuery {
    key: Option<String>,
    subject: Option<String>,
}

/// `GET /charges`: the executions kept (the last `CHECKOUT_MAX_REQUESTS`), filtered by key and
/// subject; `x-charges-forgotten` says how many older ones were dropped.
async fn list_charges(
    State(ledger): State<Arc<Ledger>>,
    Query(q): Query<ChargesQuery>,
) -> Response {
    let entries: Vec<LedgerEntry> = ledger
        .entries()
        .into_iter()
        .filter(|e| {
            q.key
                .as_deref()
                .is_none_or(|k| e.idempotency_key.as_deref() == Some(k))
        })
        .filter(|e| {
            q.subject
                .as_deref()
                .is_none_or(|s| e.subject.as_deref() == Some(s))
        })
        .collect();
    let mut r = Json(entries).into_response();
    r.headers_mut().insert(
        "x-charges-forgotten",
        HeaderValue::from(ledger.forgotten_entries()),
    );
    r
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Finds the card number in `{"card": "..."}` or `{"card": {"number": "..."}}`.
fn card_number(body: &serde_json::Value) -> Option<&str> {
    match body.get("card") {
        Some(serde_json::Value::String(s)) => Some(s),
        Some(card) => card.get("number").and_then(|n| n.as_str()),
        None => None,
    }
}

/// One attempt: recorded before it runs when it carries a key, then, after its processing
/// delay, committed in one decision ([`Attempts::commit`]): executed, or refused (a stale or
/// reused fencing token, 409), or answered with the response its request's execution produced
/// when another attempt executed it (the same status, headers and body; nothing charged).
async fn attempt(
    ledger: Arc<Ledger>,
    op: &Operation,
    headers: &HeaderMap,
    body: &[u8],
    reset: bool,
) -> Response {
    let kind = op.kind;
    let delay = Duration::from_millis(
        header(headers, "x-demo-delay-ms")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            .min(MAX_DELAY_MS),
    );
    let token = header(headers, FENCING_TOKEN_HEADER).and_then(|v| v.parse::<i64>().ok());
    let guard = match header(headers, "idempotency-key") {
        None => None,
        Some(key) => {
            // The request as the edge names it (its endpoint survives a path rewrite).
            let scope = Scope {
                endpoint: header(headers, ENDPOINT_HEADER).unwrap_or_else(|| op.endpoint.clone()),
                subject: header(headers, "x-jwt-sub").unwrap_or_default(),
                key,
                fingerprint: header(headers, FINGERPRINT_HEADER),
            };
            let started = ledger.attempts(|a| a.start(kind, scope, token, delay));
            let Some((id, started)) = started else {
                return StatusCode::INTERNAL_SERVER_ERROR.into_response();
            };
            let guard = AttemptGuard {
                ledger: Arc::clone(&ledger),
                id,
            };
            match started {
                Started::Run => Some(guard),
                Started::AlreadyExecuted(p) => return already_executed(p),
                Started::Refused(r) => return refused(token, r),
            }
        }
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let read = BodyRead::of(op, body);
    let run = || {
        let (entry, produced) = execute(&ledger, op, headers, &read, reset);
        (entry.id, finish(headers, produced))
    };
    let produced = match &guard {
        None => run().1,
        Some(g) => match ledger.attempts(|a| a.commit(g.id, run)) {
            Some(Committed::Ran(p)) => p,
            Some(Committed::AlreadyExecuted(p)) => return already_executed(p),
            Some(Committed::Refused(r)) => return refused(token, r),
            None => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        },
    };
    transport(headers, produced)
}

/// The response the request's execution produced, for a later attempt of it: nothing ran.
fn already_executed(p: Produced) -> Response {
    tracing::info!(status = p.status, "answered with the request's execution");
    transport(&HeaderMap::new(), p)
}

/// 409: a fencing token lower than one this checkout has seen for the request, or one already
/// used by another attempt of the request. Nothing ran.
fn refused(token: Option<i64>, refusal: Refusal) -> Response {
    tracing::warn!(?token, ?refusal, "refused: a stale or reused fencing token");
    match refusal {
        Refusal::Stale { seen } => problem(
            StatusCode::CONFLICT,
            "stale-fencing-token",
            &format!(
                "fencing token {} is lower than {seen}, already seen for this request; nothing was charged",
                token.unwrap_or(0)
            ),
        ),
        Refusal::Reused { token } => problem(
            StatusCode::CONFLICT,
            "fencing-token-reused",
            &format!(
                "fencing token {token} was already used by another attempt of this request; nothing was charged"
            ),
        ),
    }
}

fn problem(status: StatusCode, kind: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("/problems/{kind}"),
        "title": kind.replace('-', " "),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut r = (status, Json(body)).into_response();
    r.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    r
}

/// The header the filter sends the fencing token in.
const FENCING_TOKEN_HEADER: &str = "idempotency-fencing-token";
/// The reconcile contract's answer header, the subject it is asked with, and the request as
/// the edge names it: forwarded with every attempt, asked about, echoed by `executed` (see the
/// edge's `contract::wire`).
const OUTCOME_HEADER: &str = "idempotency-outcome";
const SUBJECT_HEADER: &str = "idempotency-subject";
const ENDPOINT_HEADER: &str = "idempotency-endpoint";
const FINGERPRINT_HEADER: &str = "idempotency-fingerprint";
/// The key, echoed by `executed` as it was asked about (the path's last segment).
const KEY_HEADER: &str = "idempotency-key";

/// The reconcile endpoint: what became of the request its headers name (subject, endpoint,
/// fingerprint) under `key`, asked with the new owner's fencing token. `executed` answers with
/// the response the attempt produced and names that attempt: its token, and the request it
/// belongs to, its endpoint, fingerprint, subject and key (the edge stores the answer only when
/// all of them are its request's: the fingerprint does not cover the subject).
async fn reconcile(
    State(ledger): State<Arc<Ledger>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    let (Some(subject), Some(token), Some(endpoint), Some(fingerprint)) = (
        header(&headers, SUBJECT_HEADER),
        header(&headers, FENCING_TOKEN_HEADER).and_then(|v| v.parse::<i64>().ok()),
        header(&headers, ENDPOINT_HEADER),
        header(&headers, FINGERPRINT_HEADER),
    ) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "bad-reconcile",
            "a reconcile needs the idempotency-subject, idempotency-fencing-token, idempotency-endpoint and idempotency-fingerprint headers",
        );
    };
    let scope = Scope {
        endpoint,
        subject,
        key,
        fingerprint: Some(fingerprint),
    };
    let said = ledger.attempts(|a| a.reconcile(scope.clone(), token));
    let mut r = match said {
        Some(Reconciled::Executed { token, produced }) => {
            let mut r = transport(&HeaderMap::new(), produced);
            let named = [
                (OUTCOME_HEADER, "executed".to_owned()),
                (FENCING_TOKEN_HEADER, token.to_string()),
                (ENDPOINT_HEADER, scope.endpoint),
                (FINGERPRINT_HEADER, scope.fingerprint.unwrap_or_default()),
                (SUBJECT_HEADER, scope.subject),
                (KEY_HEADER, scope.key),
            ];
            for (name, value) in named {
                if let Ok(v) = HeaderValue::from_str(&value) {
                    r.headers_mut().insert(name, v);
                }
            }
            return r;
        }
        Some(Reconciled::Running { retry_after }) => {
            let mut r = problem(
                StatusCode::CONFLICT,
                "attempt-running",
                "an attempt of this request is still running",
            );
            let secs = retry_after.as_secs_f64().ceil().clamp(1.0, 120.0) as u64;
            r.headers_mut()
                .insert("retry-after", HeaderValue::from(secs));
            r.headers_mut()
                .insert(OUTCOME_HEADER, HeaderValue::from_static("running"));
            r
        }
        Some(Reconciled::NotExecuted) => {
            let mut r = problem(
                StatusCode::NOT_FOUND,
                "not-executed",
                "no attempt of this request ran; its attempts with a lower fencing token are refused from now on",
            );
            r.headers_mut()
                .insert(OUTCOME_HEADER, HeaderValue::from_static("not-executed"));
            r
        }
        Some(Reconciled::Stale) => problem(
            StatusCode::CONFLICT,
            "stale-fencing-token",
            "an attempt of this request has a fencing token at least as large",
        ),
        // No outcome header: the edge answers 503 and keeps the key for an operator.
        Some(Reconciled::CannotTell) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "attempts-forgotten",
            "this request is not in the checkout's record of attempts, which has forgotten older requests (CHECKOUT_MAX_REQUESTS): it cannot tell whether it ran",
        ),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    r.headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-store"));
    r
}

/// `GET /attempts`: every attempt the checkout recorded (running, executed, fenced, abandoned).
async fn list_attempts(State(ledger): State<Arc<Ledger>>) -> Json<Vec<attempts::Attempt>> {
    Json(ledger.attempts(|a| a.list()).unwrap_or_default())
}

/// What an execution reads of its request's body, worked out before the attempt's decision is
/// taken under the record's lock, which every request of the checkout takes: parsing and
/// hashing a large body there would hold up the small requests behind it.
struct BodyRead {
    /// The charge as the execution judges it; `None`: invalid.
    parsed: Option<serde_json::Value>,
    /// A Stripe-shaped request's parameters (`Null` for the demo's JSON).
    params: serde_json::Value,
    sha256: String,
    len: usize,
}

impl BodyRead {
    fn of(op: &Operation, body: &[u8]) -> Self {
        let params = match op.shape {
            Shape::Stripe => stripe::params(body),
            Shape::Demo => serde_json::Value::Null,
        };
        let parsed = match op.shape {
            Shape::Stripe => Some(params.clone()).filter(|p| stripe::judge(op.kind, p).0),
            Shape::Demo if body.is_empty() && op.body_optional => Some(serde_json::json!({})),
            Shape::Demo => serde_json::from_slice(body).ok(),
        };
        Self {
            parsed,
            params,
            sha256: sha256_hex(body),
            len: body.len(),
        }
    }
}

/// Executes the charge (refund, subscription change): the ledger entry and the response it
/// produced.
fn execute(
    ledger: &Ledger,
    op: &Operation,
    headers: &HeaderMap,
    read: &BodyRead,
    reset: bool,
) -> (LedgerEntry, Produced) {
    let kind = op.kind;
    let parsed = &read.parsed;
    let declined = |v: &serde_json::Value| match op.shape {
        Shape::Stripe => stripe::judge(kind, v).1,
        Shape::Demo => card_number(v) == Some(DECLINED_CARD),
    };
    let forced_failure = header(headers, "x-demo-fail").and_then(|v| v.parse::<u16>().ok());
    let (status, outcome) = match (parsed, forced_failure) {
        (_, Some(code)) if (500..600).contains(&code) => (code, "failed"),
        (None, _) => (400, "invalid"),
        (Some(v), _) if declined(v) => (402, "declined"),
        // Stripe answers a created charge with 200.
        (Some(_), _) if op.shape == Shape::Stripe => (200, "succeeded"),
        (Some(_), _) => (201, "succeeded"),
    };
    // A reset drops the connection after the charge: it ran, nothing was sent (status 0 in the
    // ledger); its attempt keeps the response it produced.
    let entry = ledger.record(LedgerEntry {
        id: 0,
        kind: kind.to_owned(),
        outcome: if reset { "reset" } else { outcome }.to_owned(),
        status: if reset { 0 } else { status },
        amount: parsed.as_ref().and_then(|v| v.get("amount").cloned()),
        subject: header(headers, "x-jwt-sub"),
        idempotency_key: header(headers, "idempotency-key"),
        fencing_token: header(headers, "idempotency-fencing-token"),
        body_sha256: read.sha256.clone(),
        body_len: read.len,
    });
    tracing::info!(id = entry.id, kind, outcome, status, reset, "executed");

    let body = match (op.shape, outcome) {
        (Shape::Stripe, _) => stripe::body(kind, outcome, entry.id, &read.params),
        (_, "succeeded") => {
            serde_json::json!({ "id": entry.id, "kind": kind, "status": "succeeded", "amount": entry.amount })
        }
        (_, "declined") => serde_json::json!({ "error": "card_declined" }),
        (_, "invalid") => serde_json::json!({ "error": "invalid_json" }),
        _ => serde_json::json!({ "error": "internal_error" }),
    };
    let mut h: Vec<(String, String)> = vec![("content-type".into(), "application/json".into())];
    if outcome == "succeeded" && op.shape == Shape::Demo {
        let location = match kind {
            "refund" => format!("/refunds/{}", entry.id),
            "charge" => format!("/charges/{}", entry.id),
            // The subscription's own address: its endpoint's path.
            _ => op
                .endpoint
                .split_once(' ')
                .map_or_else(String::new, |(_, path)| path.to_owned()),
        };
        // x-demo-location-bytes: a Location that long (a 3-D Secure redirect, say).
        let padding = header(headers, "x-demo-location-bytes")
            .and_then(|v| v.parse::<usize>().ok())
            .map(|n| format!("?return={}", "r".repeat(n.min(MAX_LOCATION_BYTES))))
            .unwrap_or_default();
        h.push(("location".into(), format!("{location}{padding}")));
        h.push(("etag".into(), format!("\"{}-{}\"", kind, entry.id)));
    }
    // Headers that must never be replayed to another request: a cookie and a per-request id.
    h.push((
        "set-cookie".into(),
        format!("demo_session={}; Path=/; HttpOnly", entry.id),
    ));
    h.push(("x-request-id".into(), format!("req-{}", entry.id)));
    let produced = Produced {
        status,
        headers: h,
        body: serde_json::to_vec(&body).unwrap_or_default(),
    };
    (entry, produced)
}

/// The most padding `x-demo-response-bytes` adds.
const MAX_PADDING_BYTES: usize = 4 << 20;

/// The longest Location `x-demo-location-bytes` makes.
const MAX_LOCATION_BYTES: usize = 65_536;

/// The response as produced, for tests of what is stored and replayed:
/// * `x-demo-status: N` answers with status N (any three digits) instead;
/// * `x-demo-gzip: 1` sends the body gzip-compressed (`content-encoding: gzip`, `vary`);
/// * `x-demo-response-bytes: N` pads a JSON body with a member `padding` of N bytes (at most
///   [`MAX_PADDING_BYTES`]): a response larger than a proxy's connection buffer.
fn finish(headers: &HeaderMap, mut p: Produced) -> Produced {
    if let Some(code) = header(headers, "x-demo-status")
        .and_then(|v| v.parse::<u16>().ok())
        .filter(|c| StatusCode::from_u16(*c).is_ok())
    {
        p.status = code;
    }
    let padding = header(headers, "x-demo-response-bytes").and_then(|v| v.parse::<usize>().ok());
    if let Some(n) = padding {
        if let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice(&p.body) {
            m.insert(
                "padding".into(),
                "p".repeat(n.min(MAX_PADDING_BYTES)).into(),
            );
            p.body = serde_json::to_vec(&m).unwrap_or_default();
        }
    }
    if header(headers, "x-demo-gzip").as_deref() == Some("1") {
        use flate2::write::GzEncoder;
        use std::io::Write as _;
        let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::default());
        if let Ok(compressed) = gz.write_all(&p.body).and_then(|()| gz.finish()) {
            p.body = compressed;
            p.headers.push(("content-encoding".into(), "gzip".into()));
            p.headers.push(("vary".into(), "accept-encoding".into()));
        }
    }
    p
}

/// How the response travels, for tests of how a response reaches Envoy:
/// * `x-demo-empty-chunked: 1` sends no body, chunked: the headers, then an empty last chunk;
/// * `x-demo-reset-body: 1` sends the headers and half of the body, then drops the connection.
fn transport(headers: &HeaderMap, p: Produced) -> Response {
    use axum::body::Body;
    use futures::stream;
    let mut response = Response::new(Body::empty());
    *response.status_mut() =
        StatusCode::from_u16(p.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (n, v) in &p.headers {
        if let (Ok(n), Ok(v)) = (
            axum::http::HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            response.headers_mut().append(n, v);
        }
    }
    let (parts, _) = response.into_parts();
    let mut parts = parts;
    let bytes = Bytes::from(p.body);
    let flag = |name: &str| header(headers, name).as_deref() == Some("1");
    if flag("x-demo-empty-chunked") {
        let empty = stream::iter(Vec::<Result<Bytes, std::io::Error>>::new());
        return Response::from_parts(parts, Body::from_stream(empty));
    }
    if flag("x-demo-reset-body") {
        // The headers and half the body go out, then an error: hyper drops the connection.
        use futures::StreamExt as _;
        let half = bytes.slice(..bytes.len() / 2);
        let first = stream::once(async move { Ok::<Bytes, std::io::Error>(half) });
        let broken = stream::once(async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Err(std::io::Error::other(
                "x-demo-reset-body: reset in the body on purpose",
            ))
        });
        parts
            .headers
            .insert("content-length", HeaderValue::from(bytes.len()));
        return Response::from_parts(parts, Body::from_stream(first.chain(broken)));
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// Hex SHA-256 of a body (as received, or as produced).
pub(crate) fn sha256_hex(data: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests;
