//! A small HTTP client for talking to the stack the way a user would.

use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;

/// One answer, with how long it took.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub elapsed: Duration,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }

    pub fn header_count(&self, name: &str) -> usize {
        self.headers.get_all(name).iter().count()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `type` of a problem document, when the answer is one.
    pub fn problem_type(&self) -> Option<String> {
        if self.header("content-type").as_deref() != Some(contract::PROBLEM_CONTENT_TYPE) {
            return None;
        }
        self.json()
            .get("type")
            .and_then(|t| t.as_str())
            .map(str::to_owned)
    }

    pub fn describe(&self) -> String {
        format!(
            "{} {:?} {}",
            self.status,
            self.headers,
            self.text().chars().take(500).collect::<String>()
        )
    }
}

/// A request being built.
pub struct Request {
    pub method: reqwest::Method,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: reqwest::Body,
}

impl Request {
    pub fn post(path: &str) -> Self {
        Self {
            method: reqwest::Method::POST,
            path: path.into(),
            headers: Vec::new(),
            body: reqwest::Body::from(Vec::new()),
        }
    }

    pub fn get(path: &str) -> Self {
        Self::with_method(reqwest::Method::GET, path)
    }

    /// A request with any method (PUT, PATCH, DELETE).
    pub fn with_method(method: reqwest::Method, path: &str) -> Self {
        Self {
            method,
            ..Self::post(path)
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The same request to another path.
    pub fn path(mut self, path: &str) -> Self {
        self.path = path.into();
        self
    }

    pub fn token(self, token: &str) -> Self {
        self.header("authorization", &format!("Bearer {token}"))
    }

    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    pub fn json(self, body: &serde_json::Value) -> Self {
        self.header("content-type", "application/json")
            .body(serde_json::to_vec(body).unwrap_or_default())
    }

    pub fn body(mut self, body: impl Into<reqwest::Body>) -> Self {
        self.body = body.into();
        self
    }

    pub fn delay_ms(self, ms: u64) -> Self {
        self.header("x-demo-delay-ms", &ms.to_string())
    }
}

/// A client bound to one base URL (an Envoy listener, usually).
#[derive(Clone)]
pub struct Client {
    pub base: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(base: &str) -> Self {
        Self::with(base, reqwest::Client::builder(), Duration::from_secs(60))
    }

    /// A client that gives up on an answer after `timeout` (it drops the connection).
    pub fn impatient(base: &str, timeout: Duration) -> Self {
        Self::with(base, reqwest::Client::builder(), timeout)
    }

    /// HTTP/2 without TLS (prior knowledge), as gRPC-style clients talk to Envoy.
    pub fn http2(base: &str) -> Self {
        Self::with(
            base,
            reqwest::Client::builder().http2_prior_knowledge(),
            Duration::from_secs(60),
        )
    }

    fn with(base: &str, builder: reqwest::ClientBuilder, timeout: Duration) -> Self {
        let http = builder
            .timeout(timeout)
            .pool_max_idle_per_host(64)
            .build()
            .unwrap_or_else(|e| panic!("cannot build an HTTP client: {e}"));
        Self {
            base: base.trim_end_matches('/').to_owned(),
            http,
        }
    }

    pub async fn send(&self, req: Request) -> Answer {
        self.try_send(req)
            .await
            .unwrap_or_else(|e| panic!("request to {} failed: {e}", self.base))
    }

    pub async fn try_send(&self, req: Request) -> Result<Answer, reqwest::Error> {
        let mut builder = self
            .http
            .request(req.method, format!("{}{}", self.base, req.path));
        for (k, v) in &req.headers {
            builder = builder.header(k, v);
        }
        let started = Instant::now();
        let response = builder.body(req.body).send().await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await?.to_vec();
        Ok(Answer {
            status,
            headers,
            body,
            elapsed: started.elapsed(),
        })
    }

    /// Everything the checkout executed (`GET /charges` through Envoy, as alice).
    pub async fn charges_for_key(&self, checkout_base: &str, key: &str) -> Vec<serde_json::Value> {
        let answer = Client {
            base: checkout_base.to_owned(),
            http: self.http.clone(),
        }
        .send(Request::get(&format!("/charges?key={}", urlencode(key))))
        .await;
        answer.json().as_array().cloned().unwrap_or_default()
    }
}

/// Percent-encodes everything outside unreserved characters.
pub fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A key no other test uses.
pub fn unique_key(label: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{label}-{}-{nanos}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
}
