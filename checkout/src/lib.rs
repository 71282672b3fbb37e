//! The demo checkout upstream: what the idempotency layer protects.
//!
//! It records every execution in an in-memory ledger, so the tests and the demo can count how
//! many times a payment really ran. It deliberately does NOT deduplicate anything itself.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

/// The card number that is always declined (Stripe's test card for a generic decline).
pub const DECLINED_CARD: &str = "4000000000000002";
/// Longest processing delay a request may ask for, so a stray header cannot pin a task forever.
const MAX_DELAY_MS: u64 = 120_000;

/// One execution of `POST /checkout` or `POST /refunds`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LedgerEntry {
    pub id: u64,
    /// `charge` or `refund`.
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

#[derive(Default)]
pub struct Ledger {
    next_id: AtomicU64,
    entries: Mutex<Vec<LedgerEntry>>,
}

impl Ledger {
    fn record(&self, mut entry: LedgerEntry) -> LedgerEntry {
        entry.id = self.next_id.fetch_add(1, Ordering::SeqCst) + 1;
        if let Ok(mut entries) = self.entries.lock() {
            entries.push(entry.clone());
        }
        entry
    }

    pub fn entries(&self) -> Vec<LedgerEntry> {
        self.entries.lock().map(|e| e.clone()).unwrap_or_default()
    }
}

pub fn app(ledger: Arc<Ledger>) -> Router {
    Router::new()
        .route("/checkout", post(checkout))
        .route("/refunds", post(refund))
        .route("/charges", get(list_charges))
        .route("/echo", post(echo))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(ledger)
}

async fn checkout(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, body: Bytes) -> Response {
    run(ledger, "charge", headers, body).await
}

async fn refund(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, body: Bytes) -> Response {
    run(ledger, "refund", headers, body).await
}

/// Test hooks for the fault suite, on top of `execute`:
/// * `x-demo-detach: 1` runs the execution in its own task, so it finishes (and is recorded)
///   even when the caller's connection goes away meanwhile (an orphaned upstream call, as when
///   the Envoy in front dies). Without it, a dropped connection cancels a delayed execution.
/// * `x-demo-reset: 1` executes (recorded with outcome `reset`), then drops the connection
///   without answering: the charge ran, but no response ever leaves.
/// * and the shapes of the answer, in [`shape`]: `x-demo-reset-body`, `x-demo-gzip`,
///   `x-demo-empty-chunked`, `x-demo-location-bytes`, `x-demo-status`.
async fn run(ledger: Arc<Ledger>, kind: &'static str, headers: HeaderMap, body: Bytes) -> Response {
    let detach = header(&headers, "x-demo-detach").as_deref() == Some("1");
    let reset = header(&headers, "x-demo-reset").as_deref() == Some("1");
    let response = if detach {
        let task =
            tokio::spawn(async move { execute(&ledger, kind, &headers, &body, reset).await });
        match task.await {
            Ok(r) => r,
            Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    } else {
        execute(&ledger, kind, &headers, &body, reset).await
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

async fn list_charges(
    State(ledger): State<Arc<Ledger>>,
    Query(q): Query<ChargesQuery>,
) -> Json<Vec<LedgerEntry>> {
    let entries = ledger
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
    Json(entries)
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

async fn execute(
    ledger: &Ledger,
    kind: &str,
    headers: &HeaderMap,
    body: &[u8],
    reset: bool,
) -> Response {
    let delay_ms = header(headers, "x-demo-delay-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    if delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(delay_ms.min(MAX_DELAY_MS))).await;
    }
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let forced_failure = header(headers, "x-demo-fail").and_then(|v| v.parse::<u16>().ok());
    let (status, outcome) = match (&parsed, forced_failure) {
        _ if reset => (0, "reset"),
        (_, Some(code)) if (500..600).contains(&code) => (code, "failed"),
        (None, _) => (400, "invalid"),
        (Some(v), _) if card_number(v) == Some(DECLINED_CARD) => (402, "declined"),
        (Some(_), _) => (201, "succeeded"),
    };
    let entry = ledger.record(LedgerEntry {
        id: 0,
        kind: kind.to_owned(),
        outcome: outcome.to_owned(),
        status,
        amount: parsed.as_ref().and_then(|v| v.get("amount").cloned()),
        subject: header(headers, "x-jwt-sub"),
        idempotency_key: header(headers, "idempotency-key"),
        fencing_token: header(headers, "idempotency-fencing-token"),
        body_sha256: sha256_hex(body),
        body_len: body.len(),
    });
    tracing::info!(id = entry.id, kind, outcome, status, "executed");

    let status_code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match outcome {
        "succeeded" => {
            serde_json::json!({ "id": entry.id, "kind": kind, "status": "succeeded", "amount": entry.amount })
        }
        "declined" => serde_json::json!({ "error": "card_declined" }),
        "invalid" => serde_json::json!({ "error": "invalid_json" }),
        _ => serde_json::json!({ "error": "internal_error" }),
    };
    let mut response = (status_code, Json(body)).into_response();
    let h = response.headers_mut();
    if outcome == "succeeded" {
        let path = if kind == "refund" {
            "refunds"
        } else {
            "charges"
        };
        // x-demo-location-bytes: a Location that long (a 3-D Secure redirect, say).
        let padding = header(headers, "x-demo-location-bytes")
            .and_then(|v| v.parse::<usize>().ok())
            .map(|n| format!("?return={}", "r".repeat(n.min(MAX_LOCATION_BYTES))))
            .unwrap_or_default();
        if let Ok(v) = HeaderValue::from_str(&format!("/{path}/{}{padding}", entry.id)) {
            h.insert("location", v);
        }
        if let Ok(v) = HeaderValue::from_str(&format!("\"{}-{}\"", kind, entry.id)) {
            h.insert("etag", v);
        }
    }
    // Headers that must never be replayed to another request: a cookie and a per-request id.
    if let Ok(v) = HeaderValue::from_str(&format!("demo_session={}; Path=/; HttpOnly", entry.id)) {
        h.insert("set-cookie", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("req-{}", entry.id)) {
        h.insert("x-request-id", v);
    }
    shape(headers, response).await
}

/// The longest Location `x-demo-location-bytes` makes.
const MAX_LOCATION_BYTES: usize = 65_536;

/// The shape of the answer, for tests of how a response reaches Envoy:
/// * `x-demo-status: N` answers with status N (any three digits) instead;
/// * `x-demo-gzip: 1` sends the body gzip-compressed (`content-encoding: gzip`, `vary`);
/// * `x-demo-empty-chunked: 1` sends no body, chunked: the headers, then an empty last chunk;
/// * `x-demo-reset-body: 1` sends the headers and half of the body, then drops the connection.
async fn shape(headers: &HeaderMap, response: Response) -> Response {
    use axum::body::Body;
    use futures::stream;
    let (mut parts, body) = response.into_parts();
    if let Some(code) = header(headers, "x-demo-status")
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
    {
        parts.status = code;
    }
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let flag = |name: &str| header(headers, name).as_deref() == Some("1");
    if flag("x-demo-empty-chunked") {
        parts.headers.remove(axum::http::header::CONTENT_LENGTH);
        let empty = stream::iter(Vec::<Result<Bytes, std::io::Error>>::new());
        return Response::from_parts(parts, Body::from_stream(empty));
    }
    let bytes = if flag("x-demo-gzip") {
        use flate2::write::GzEncoder;
        use std::io::Write as _;
        let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::default());
        let compressed = gz.write_all(&bytes).and_then(|()| gz.finish());
        let Ok(compressed) = compressed else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        parts
            .headers
            .insert("content-encoding", HeaderValue::from_static("gzip"));
        parts
            .headers
            .insert("vary", HeaderValue::from_static("accept-encoding"));
        Bytes::from(compressed)
    } else {
        bytes
    };
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
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

/// Hex SHA-256 of the body as received.
fn sha256_hex(data: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
