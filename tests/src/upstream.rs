//! A small API that is not the demo checkout, for `edge run` in front of "your own API":
//!
//! * `POST /orders`, `POST /payments/...`: executes (counted per `Idempotency-Key`), answers 201
//!   with `{"order": <n>, "key", "subject"}` after `x-delay-ms`;
//! * anything else: echoes the request as JSON (method, path with query, headers in order, the
//!   body's length and SHA-256), so a test can check it passed through untouched;
//! * `GET /stream?chunks=N`: a chunked answer of N chunks, 20 ms apart;
//! * `GET /executions?key=K`: how many times a key executed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;

use crate::faults::Background;

#[derive(Default)]
struct Ledger {
    next: u64,
    by_key: HashMap<String, u64>,
}

/// The API, on a free loopback port, until dropped.
pub struct OwnApi {
    pub port: u16,
    _bg: Background,
}

impl OwnApi {
    pub fn start() -> Result<Self, String> {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let (bg, port) = Background::spawn("own-api", move |listener| async move {
            let app = Router::new()
                .route("/executions", axum::routing::get(executions))
                .route("/stream", axum::routing::get(stream))
                .fallback(any)
                .with_state(ledger);
            let _ = axum::serve(listener, app).await;
        })?;
        Ok(Self { port, _bg: bg })
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

fn header(h: &HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

async fn any(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path();
    if method == Method::POST && (path == "/orders" || path.starts_with("/payments/")) {
        let delay = header(&headers, "x-delay-ms").parse::<u64>().unwrap_or(0);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay.min(30_000))).await;
        }
        let key = header(&headers, "idempotency-key");
        let n = {
            let Ok(mut l) = ledger.lock() else {
                return StatusCode::INTERNAL_SERVER_ERROR.into_response();
            };
            l.next += 1;
            *l.by_key.entry(key.clone()).or_default() += 1;
            l.next
        };
        let body = serde_json::json!({"order": n, "key": key, "subject": header(&headers, "x-jwt-sub"), "path": path});
        return (StatusCode::CREATED, axum::Json(body)).into_response();
    }
    let pairs: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| {
            (
                n.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let digest = {
        use sha2::{Digest, Sha256};
        Sha256::digest(&body)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    axum::Json(serde_json::json!({
        "method": method.as_str(),
        "path_and_query": uri.path_and_query().map(|p| p.as_str()).unwrap_or(""),
        "headers": pairs,
        "body_len": body.len(),
        "body_sha256": digest,
    }))
    .into_response()
}

async fn executions(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    Query(q): Query<HashMap<String, String>>,
) -> String {
    let key = q.get("key").cloned().unwrap_or_default();
    ledger
        .lock()
        .map(|l| l.by_key.get(&key).copied().unwrap_or(0))
        .unwrap_or(0)
        .to_string()
}

async fn stream(Query(q): Query<HashMap<String, String>>) -> Response {
    let n: usize = q
        .get("chunks")
        .and_then(|c| c.parse().ok())
        .unwrap_or(3)
        .min(100);
    let chunks = futures::stream::unfold(0usize, move |i| async move {
        if i >= n {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        Some((
            Ok::<Bytes, std::io::Error>(Bytes::from(format!("chunk {i}\n"))),
            i + 1,
        ))
    });
    Response::new(Body::from_stream(chunks))
}
