//! The state API on its own database of a real Postgres, called in process through its router
//! (`Router` + `tower::ServiceExt::oneshot`: [`Api::post`], [`Api::get`]) and served on a free
//! port for the cases that need a socket (`client`, `url`: a connection cut, a raw body)
//! (one throwaway cluster per test binary, see `test_support::postgres`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser as _;
use contract::wire::{ClaimRequest, ClaimResponse, OnUnknown, StoredResponse, CLAIM_PATH};
use serde_json::{json, Value};
use state_api::{AppState, Config};
use tokio::sync::oneshot;

/// An HTTP answer of the state API as it came.
pub struct RawAnswer {
    pub status: u16,
    pub retry_after: Option<reqwest::header::HeaderValue>,
    pub body: Value,
    /// From sending the request to the whole answer.
    pub took: Duration,
}

pub const TOKEN: &str = "test-token-0123456789";
pub const SECRET: &str = "test-key-secret-0123456789";
pub const ENDPOINT: &str = "POST /checkout";
pub const ALG: &str = "sha256-jcs-v2";

pub fn fp(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

/// The served OpenAPI document, as a checker: every answer the tests get through [`Api::post`]
/// and [`Api::get`] must be a status the document lists for its route, with a body its schema
/// accepts, and every request the state API accepted (2xx) must fit the request schema. So
/// the whole suite checks that the document says what the handlers do.
pub struct Contract {
    doc: Value,
    validators: Mutex<HashMap<String, Arc<jsonschema::Validator>>>,
}

impl Contract {
    pub fn new(doc: Value) -> Self {
        Self {
            doc,
            validators: Mutex::new(HashMap::new()),
        }
    }

    pub fn doc(&self) -> &Value {
        &self.doc
    }

    /// A validator for the schema at `pointer` in the document (its `$ref`s resolved in it).
    pub fn validator(&self, pointer: &str) -> Arc<jsonschema::Validator> {
        let mut cache = self.validators.lock().unwrap();
        cache
            .entry(pointer.to_owned())
            .or_insert_with(|| {
                let schema = self
                    .doc
                    .pointer(pointer)
                    .unwrap_or_else(|| panic!("openapi.json has nothing at {pointer}"));
                let root = json!({
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "components": self.doc["components"],
                    "allOf": [schema],
                });
                Arc::new(
                    jsonschema::draft202012::new(&root)
                        .unwrap_or_else(|e| panic!("schema at {pointer} does not compile: {e}")),
                )
            })
            .clone()
    }

    fn operation(&self, method: &str, path_and_query: &str) -> String {
        let path = path_and_query.split('?').next().unwrap_or_default();
        let escaped = path.replace('~', "~0").replace('/', "~1");
        format!("/paths/{escaped}/{method}")
    }

    /// The answer fits the document: its status is listed, its JSON body fits the schema.
    pub fn check_answer(
        &self,
        method: &str,
        path: &str,
        status: u16,
        content_type: &str,
        body: &Value,
    ) {
        let op = self.operation(method, path);
        if self.doc.pointer(&op).is_none() {
            // Only the fallbacks answer for what the document does not list: a problem.
            assert!(
                matches!(status, 404 | 405),
                "{method} {path} answered {status} but is not in openapi.json"
            );
            let v = self.validator("/components/schemas/Problem");
            assert!(
                v.is_valid(body),
                "{method} {path} {status}: not a problem: {body}"
            );
            return;
        }
        let response = format!("{op}/responses/{status}");
        let listed = self.doc.pointer(&response).unwrap_or_else(|| {
            panic!("{method} {path} answered {status}, which openapi.json does not list")
        });
        let media = content_type.split(';').next().unwrap_or_default().trim();
        let Some(content) = listed.get("content").and_then(|c| c.get(media)) else {
            panic!("{method} {path} {status}: content type {media} is not in openapi.json");
        };
        if content.get("schema").is_some() {
            let media_escaped = media.replace('/', "~1");
            let v = self.validator(&format!("{response}/content/{media_escaped}/schema"));
            let errors: Vec<String> = v
                .iter_errors(body)
                .map(|e| format!("{e} at {}", e.instance_path))
                .collect();
            assert!(
                errors.is_empty(),
                "{method} {path} {status}: the answer does not fit openapi.json: {errors:?}\n{body}"
            );
        }
    }

    /// A request the state API accepted fits the document's request schema.
    pub fn check_accepted_request(&self, method: &str, path: &str, body: &Value) {
        let op = self.operation(method, path);
        let pointer = format!("{op}/requestBody/content/application~1json/schema");
        if self.doc.pointer(&pointer).is_none() {
            return;
        }
        let v = self.validator(&pointer);
        let errors: Vec<String> = v
            .iter_errors(body)
            .map(|e| format!("{e} at {}", e.instance_path))
            .collect();
        assert!(
            errors.is_empty(),
            "{method} {path}: the state API accepted a request openapi.json refuses: {errors:?}\n{body}"
        );
    }
}

/// The document served by the first state API of this test binary (they all serve the same).
static CONTRACT: tokio::sync::OnceCell<Contract> = tokio::sync::OnceCell::const_new();

pub struct Api {
    pub base: String,
    pub client: reqwest::Client,
    /// The same routes, called in process by [`Api::post`] and [`Api::get`].
    pub router: axum::Router,
    pub state: AppState,
    pub db_url: String,
    /// A database of the shared cluster to drop afterwards when that is a DATABASE_URL server
    /// (a throwaway cluster is removed whole).
    drop_db: Option<String>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

/// The tests' storage key (32 bytes 0..31): every suite stores its responses sealed.
pub const STORAGE_KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
/// Not a state API flag: `config` leaves the storage key out (responses kept in clear).
pub const IN_CLEAR: &str = "--in-clear";

/// A config for `db_url` with the test token, key secret and storage key, the purge off, and
/// `args` on top.
pub fn config(db_url: &str, args: &[&str]) -> Config {
    let mut all = vec!["state-api", "--database-url", db_url, "--api-token", TOKEN];
    if !args.contains(&"--key-secret") {
        all.extend_from_slice(&["--key-secret", SECRET]);
    }
    if !args.contains(&"--storage-key") && !args.contains(&IN_CLEAR) {
        all.extend_from_slice(&["--storage-key", STORAGE_KEY]);
    }
    let args: Vec<&str> = args.iter().copied().filter(|a| *a != IN_CLEAR).collect();
    let args = &args[..];
    if !args.contains(&"--purge-interval-s") {
        all.extend_from_slice(&["--purge-interval-s", "0"]);
    }
    all.extend_from_slice(args);
    Config::try_parse_from(all).unwrap_or_else(|e| panic!("{e}"))
}

impl Api {
    /// A fresh database on the shared cluster, migrated, and the API serving it.
    pub async fn start(args: &[&str]) -> Self {
        let cluster = test_support::postgres::shared()
            .unwrap_or_else(|e| panic!("no Postgres for the tests: {e}"));
        let db_url = cluster
            .fresh_database("state_api")
            .unwrap_or_else(|e| panic!("{e}"));
        let mut api = Self::start_on(&db_url, args).await;
        if cluster.is_external() {
            api.drop_db = db_url.rsplit('/').next().map(str::to_owned);
        }
        api
    }

    pub async fn start_on(db_url: &str, args: &[&str]) -> Self {
        let state = AppState::new(config(db_url, args)).unwrap_or_else(|e| panic!("{e}"));
        state_api::migrate(&state, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let s = state.clone();
        let server = tokio::spawn(async move {
            state_api::serve(listener, s, async move {
                let _ = rx.await;
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        });
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .build()
            .unwrap();
        Self {
            base,
            client,
            router: state_api::app(state.clone()),
            state,
            db_url: db_url.to_owned(),
            drop_db: None,
            stop: Some(tx),
            server: Some(server),
        }
    }

    pub async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(s) = self.server.take() {
            let _ = s.await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// One request through the router in this process, with no socket (the handlers,
    /// extractors and layers as served; `client` and `url` are there for what needs one).
    pub async fn call(
        &self,
        request: axum::http::Request<axum::body::Body>,
    ) -> (u16, reqwest::header::HeaderMap, axum::body::Bytes) {
        use tower::ServiceExt as _;
        let r = self.router.clone().oneshot(request).await.unwrap();
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let bytes = axum::body::to_bytes(r.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, headers, bytes)
    }

    /// POST with the right token, in process; status and JSON body (Null when not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value, reqwest::header::HeaderMap) {
        let request = axum::http::Request::post(path)
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.to_string()))
            .unwrap();
        let (status, headers, bytes) = self.call(request).await;
        let answer = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let c = self.contract().await;
        c.check_answer("post", path, status, content_type(&headers), &answer);
        if (200..300).contains(&status) {
            c.check_accepted_request("post", path, body);
        }
        (status, answer, headers)
    }

    /// One `/v1/completes` call of `completes` (bodies as for `/v1/complete`), which must
    /// answer 200; each item's status, in order.
    pub async fn complete_all(&self, completes: &[Value]) -> Vec<u64> {
        let (status, body, _) = self
            .post(
                contract::wire::COMPLETES_PATH,
                &json!({ "completes": completes }),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        body["answers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["status"].as_u64().unwrap())
            .collect()
    }

    /// The served document, checking every answer of [`Api::post`] and [`Api::get`].
    pub async fn contract(&self) -> &'static Contract {
        CONTRACT
            .get_or_init(|| async {
                let request = axum::http::Request::get("/openapi.json")
                    .body(axum::body::Body::empty())
                    .unwrap();
                let (status, _, bytes) = self.call(request).await;
                assert_eq!(status, 200);
                Contract::new(serde_json::from_slice(&bytes).unwrap())
            })
            .await
    }

    /// GET with the right token, in process.
    pub async fn get(&self, path_and_query: &str) -> (u16, Value) {
        let request = axum::http::Request::get(path_and_query)
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(axum::body::Body::empty())
            .unwrap();
        let (status, headers, bytes) = self.call(request).await;
        let answer = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        self.contract().await.check_answer(
            "get",
            path_and_query,
            status,
            content_type(&headers),
            &answer,
        );
        (status, answer)
    }

    pub async fn claim_with(&self, req: &ClaimRequest) -> ClaimResponse {
        let (status, body, _) = self
            .post(CLAIM_PATH, &serde_json::to_value(req).unwrap())
            .await;
        assert_eq!(status, 200, "claim answered {status}: {body}");
        ClaimResponse::read(body.to_string().as_bytes()).unwrap()
    }

    /// The claim over HTTP on a task of its own (for concurrent claims): its answer (it must be
    /// 200) and how long it took.
    pub fn spawn_claim(
        &self,
        req: &ClaimRequest,
    ) -> tokio::task::JoinHandle<(ClaimResponse, Duration)> {
        let raw = self.spawn_claim_raw(req);
        tokio::spawn(async move {
            let answer = raw.await.unwrap();
            assert_eq!(answer.status, 200);
            let claim = ClaimResponse::read(answer.body.to_string().as_bytes()).unwrap();
            (claim, answer.took)
        })
    }

    /// The claim over HTTP on a task of its own, whatever it answers.
    pub fn spawn_claim_raw(&self, req: &ClaimRequest) -> tokio::task::JoinHandle<RawAnswer> {
        self.spawn_post(CLAIM_PATH, serde_json::to_value(req).unwrap())
    }

    /// A `/v1` call over HTTP on a task of its own, whatever it answers.
    pub fn spawn_post(&self, path: &str, body: Value) -> tokio::task::JoinHandle<RawAnswer> {
        let (client, url) = (self.client.clone(), self.url(path));
        tokio::spawn(async move {
            let start = std::time::Instant::now();
            let r = client
                .post(url)
                .bearer_auth(TOKEN)
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry_after = r.headers().get("retry-after").cloned();
            let body: Value = r.json().await.unwrap();
            RawAnswer {
                status,
                retry_after,
                body,
                took: start.elapsed(),
            }
        })
    }

    pub async fn claim(
        &self,
        key: &str,
        fingerprint: &str,
        lease_ms: Option<u64>,
    ) -> ClaimResponse {
        self.claim_with(&claim_req(key, "alice", fingerprint, lease_ms))
            .await
    }

    /// A key claimed with a 1 s lease that runs out (its outcome unknown), then taken over by
    /// a second claim that asks to: (the stale owner's token, the new owner's token).
    pub async fn claim_then_reclaim(&self, key: &str, fingerprint: &str) -> (i64, i64) {
        let stale = token_of(&self.claim(key, fingerprint, Some(1_000)).await);
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let take_over = ClaimRequest {
            on_unknown: OnUnknown::TakeOver,
            ..claim_req(key, "alice", fingerprint, Some(60_000))
        };
        match self.claim_with(&take_over).await {
            ClaimResponse::Claimed {
                token,
                reclaimed: true,
                ..
            } => (stale, token),
            other => panic!("expected a reclaim, got {other:?}"),
        }
    }

    pub async fn record(&self, key: &str, subject: &str) -> (u16, Value) {
        self.get(&format!(
            "/v1/records?key={}&subject={}&endpoint={}",
            enc(key),
            enc(subject),
            enc(ENDPOINT)
        ))
        .await
    }

    pub async fn metrics(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

fn content_type(headers: &reqwest::header::HeaderMap) -> &str {
    headers
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

impl Drop for Api {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let (Some(db), Ok(cluster)) = (self.drop_db.take(), test_support::postgres::shared()) {
            let _ = cluster.drop_database(&db);
        }
    }
}

pub fn claim_req(
    key: &str,
    subject: &str,
    fingerprint: &str,
    lease_ms: Option<u64>,
) -> ClaimRequest {
    ClaimRequest {
        key: key.into(),
        subject: subject.into(),
        endpoint: ENDPOINT.into(),
        fingerprint: fingerprint.into(),
        fingerprint_alg: ALG.into(),
        lease_ms,
        on_unknown: Default::default(),
        namespace: String::new(),
        retention_s: None,
        wait_ms: None,
        nonce: None,
    }
}

/// Minimal percent-encoding for query values.
pub fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Value of the metric line starting with `prefix` (e.g. `state_api_claims_total{outcome="claimed"}`).
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(prefix)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("metric {prefix} missing in:\n{text}"))
}

pub fn token_of(c: &ClaimResponse) -> i64 {
    match c {
        ClaimResponse::Claimed { token, .. } => *token,
        other => panic!("expected claimed, got {other:?}"),
    }
}

pub fn complete_body(key: &str, token: i64, response: &StoredResponse) -> Value {
    json!({"key": key, "subject": "alice", "endpoint": ENDPOINT, "token": token, "response": response})
}

pub fn fenced_body(key: &str, token: i64) -> Value {
    json!({"key": key, "subject": "alice", "endpoint": ENDPOINT, "token": token})
}

pub fn ok_response() -> StoredResponse {
    StoredResponse::new(
        201,
        vec![("content-type".into(), "application/json".into())],
        br#"{"id":"ch_1"}"#,
        true,
    )
}

pub fn assert_problem(status: u16, body: &Value, want_status: u16, slug: &str) {
    assert_eq!(status, want_status, "body: {body}");
    assert_eq!(body["type"], format!("/problems/{slug}"), "body: {body}");
    assert_eq!(body["status"], want_status);
    assert!(
        body["title"].is_string() && body["detail"].is_string(),
        "body: {body}"
    );
}
