//! Hostile input through the real stack, one case per row of `docs/hostile-input.md`, plus the
//! security checks (no secret in any log, only an HMAC of the key in the database).
//!
//! The table in the doc is generated from `CASES` below and `doc_table_matches_cases` fails when
//! they differ, so the doc cannot drift: after changing a case, run
//! `UPDATE_HOSTILE_DOC=1 cargo test -p stack --test hostile -- doc_table` to rewrite the table.
//!
//! Every case checks the final answer's status (and problem type where there is one) and how
//! many times the checkout executed for it; after every case a normal request must still work
//! (the Wasm VM is alive), through the main Envoy and, for the fake state API cases, through
//! the Envoy pointed at the fake too.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::client::{unique_key, Answer, Client, Request};
use e2e::envoy::Envoy;
use e2e::faults::{raw_request, FakeClaim, FakeStateApi, RawAnswer};
use e2e::services::ServiceTestExt as _;
use e2e::stack::{token, Stack, StackOptions, TEST_API_TOKEN, TEST_KEY_SECRET};
use e2e::testkit::*;
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::json;
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------------------------------------
// The environment shared by the cases: the stack, a fake state API and an Envoy pointed at it.

struct Env {
    stack: Stack,
    fake: FakeStateApi,
    fake_envoy: Envoy,
}

static SHARED: Mutex<Option<Result<Arc<Env>, String>>> = Mutex::new(None);

fn shared_env() -> Result<Arc<Env>, Failed> {
    let mut guard = SHARED
        .lock()
        .map_err(|_| Failed::from("shared env lock poisoned"))?;
    let started = guard.get_or_insert_with(|| {
        let stack = Stack::start(StackOptions::default())?;
        let fake = FakeStateApi::start()?;
        // The fake's answers are whole HTTP answers to one claim (a hang, a closed connection,
        // 8 MiB): each claim is its own callout to it, whatever runs beside it.
        let fake_envoy = stack.start_extra_envoy_unbatched(fake.port, "envoy-fake-state-api")?;
        Ok(Arc::new(Env {
            stack,
            fake,
            fake_envoy,
        }))
    });
    started.clone().map_err(Failed::from)
}

/// What a case saw: its final answer and how many times the checkout executed for it.
struct Got {
    status: u16,
    problem: Option<String>,
    replayed: bool,
    executions: usize,
    detail: String,
}

impl Got {
    fn from_answer(a: &Answer, executions: usize) -> Self {
        Self {
            status: a.status,
            problem: a
                .problem_type()
                .map(|t| t.rsplit('/').next().unwrap_or_default().to_owned()),
            replayed: a.header("idempotent-replayed").as_deref() == Some("true"),
            executions,
            detail: a.describe(),
        }
    }

    fn from_raw(a: &RawAnswer, executions: usize) -> Self {
        let problem = (a.header("content-type").as_deref() == Some(contract::PROBLEM_CONTENT_TYPE))
            .then(|| serde_json::from_slice::<serde_json::Value>(&a.body).ok())
            .flatten()
            .and_then(|v| {
                v["type"]
                    .as_str()
                    .map(|t| t.rsplit('/').next().unwrap_or_default().to_owned())
            });
        Self {
            status: a.status,
            problem,
            replayed: a.header("idempotent-replayed").as_deref() == Some("true"),
            executions,
            detail: format!(
                "{}\n{}",
                a.head,
                String::from_utf8_lossy(&a.body)
                    .chars()
                    .take(300)
                    .collect::<String>()
            ),
        }
    }
}

type Run = fn(Arc<Env>) -> Pin<Box<dyn Future<Output = Got>>>;

/// One row of docs/hostile-input.md.
struct Case {
    name: &'static str,
    input: &'static str,
    status: u16,
    /// The problem type's slug, when the answer is a problem document.
    problem: Option<&'static str>,
    /// Whether the answer is a replay (`Idempotent-Replayed: true`).
    replay: bool,
    answer: &'static str,
    /// Executions of the checkout for this case's key(s) or body at the end.
    runs: usize,
    run: Run,
}

macro_rules! case {
    ($name:literal, $input:literal => $status:literal $problem:expr, replay: $replay:literal, runs: $runs:literal, $answer:literal, |$env:ident| $body:expr) => {
        Case {
            name: $name,
            input: $input,
            status: $status,
            problem: $problem,
            replay: $replay,
            answer: $answer,
            runs: $runs,
            run: |$env: Arc<Env>| Box::pin(async move { $body }),
        }
    };
}

const NONE: Option<&str> = None;
const BAD_KEY: Option<&str> = Some("invalid-idempotency-key");
const UNAVAILABLE: Option<&str> = Some("idempotency-state-unavailable");
const INTERNAL: Option<&str> = Some("internal-error");
const LIMIT: usize = 1_048_576;

// ---------------------------------------------------------------------------------------------
// Request helpers

impl Env {
    fn main(&self) -> Client {
        Client::new(&self.stack.envoy.url(""))
    }

    fn via_fake(&self) -> Client {
        Client::new(&self.fake_envoy.url(""))
    }

    /// Executions recorded for `key`.
    async fn runs(&self, key: &str) -> usize {
        self.main()
            .charges_for_key(&self.stack.checkout.url(""), key)
            .await
            .len()
    }

    /// Executions recorded whose body had exactly these bytes (for keys that cannot be queried).
    async fn runs_of_body(&self, body: &[u8]) -> usize {
        let sha = sha256_hex(body);
        e2e::faults::ledger(&self.stack.checkout.url(""))
            .await
            .iter()
            .filter(|e| e["body_sha256"] == sha.as_str())
            .count()
    }

    /// Sends `req` through the main Envoy; the executions are counted for `key`.
    async fn send(&self, req: Request, key: &str) -> Got {
        let a = self.main().send(req).await;
        Got::from_answer(&a, self.runs(key).await)
    }

    /// Sends `req` through the main Envoy; the executions are counted by body.
    async fn send_body(&self, req: Request, body: &[u8]) -> Got {
        let a = self.main().send(req).await;
        Got::from_answer(&a, self.runs_of_body(body).await)
    }

    /// A POST /checkout as alice with raw header lines (name, value bytes) and body bytes.
    async fn raw(&self, path: &str, key_lines: &[&[u8]], body: &[u8]) -> Got {
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
            token("alice"),
            body.len()
        )
        .into_bytes();
        for line in key_lines {
            req.extend_from_slice(b"Idempotency-Key: ");
            req.extend_from_slice(line);
            req.extend_from_slice(b"\r\n");
        }
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(body);
        let a = raw_request(
            self.stack.envoy.params.listen_port,
            &req,
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("raw request: {e}"));
        Got::from_raw(&a, self.runs_of_body(body).await)
    }

    /// A POST /checkout through the Envoy whose state API is the fake.
    async fn fake(&self, behaviour: FakeClaim) -> (Answer, String) {
        let key = behaviour.key();
        let a = self
            .via_fake()
            .send(checkout(&key, "alice", &charge_body(3)))
            .await;
        assert!(
            !self.fake.calls_for(&key).is_empty(),
            "the fake state API was not asked"
        );
        (a, key)
    }

    async fn fake_case(&self, behaviour: FakeClaim) -> Got {
        let (a, key) = self.fake(behaviour).await;
        Got::from_answer(&a, self.runs(&key).await)
    }

    /// A direct call to the state API's /v1/claim with this Authorization header (if any).
    async fn state_api_claim(&self, authorization: Option<&str>, query: &str) -> Got {
        let body = json!({"key": unique_key("direct"), "subject": "alice", "endpoint": "POST /checkout",
                          "fingerprint": "0".repeat(64), "fingerprint_alg": "sha256-raw-v2"});
        let mut req = Request::post(&format!("{}{query}", contract::wire::CLAIM_PATH)).json(&body);
        if let Some(a) = authorization {
            req = req.header("authorization", a);
        }
        let a = Client::new(&self.stack.state_api.url("")).send(req).await;
        Got::from_answer(&a, 0)
    }
}

/// A POST /checkout as alice with a unique JSON body (returned, to count its executions) and
/// this key header value.
fn with_key(value: &str) -> (Request, Vec<u8>) {
    let body = unique_json("");
    (json_post(value, body.clone()), body)
}

/// A body that is unique (so its executions can be counted by its hash).
fn unique_json(extra: &str) -> Vec<u8> {
    format!("{{\"amount\":1,\"nonce\":\"{}\"{extra}}}", unique_key("n")).into_bytes()
}

/// Valid JSON of exactly `n` bytes.
fn json_of_len(n: usize) -> Vec<u8> {
    let head = format!(
        "{{\"amount\":1,\"nonce\":\"{}\",\"pad\":\"",
        unique_key("n")
    )
    .into_bytes();
    let mut b = head;
    b.resize(n - 2, b'x');
    b.extend_from_slice(b"\"}");
    b
}

fn chunked(body: &[u8], sizes: impl Fn(usize) -> usize) -> reqwest::Body {
    let mut chunks: Vec<Result<Vec<u8>, std::io::Error>> = Vec::new();
    let mut at = 0;
    let mut i = 0;
    while at < body.len() {
        let n = sizes(i).max(1).min(body.len() - at);
        chunks.push(Ok(body[at..at + n].to_vec()));
        at += n;
        i += 1;
    }
    reqwest::Body::wrap_stream(futures::stream::iter(chunks))
}

fn json_post(key: &str, body: Vec<u8>) -> Request {
    Request::post("/checkout")
        .token(&token("alice"))
        .key(key)
        .header("content-type", "application/json")
        .body(body)
}

/// Sends two requests with one key; the second's answer is the case's.
async fn twice(env: &Env, key: &str, first: Request, second: Request) -> Got {
    let a = env.main().send(first).await;
    assert!(a.status < 500, "first request: {}", a.describe());
    env.send(second, key).await
}

// ---------------------------------------------------------------------------------------------
// The cases

fn cases() -> Vec<Case> {
    vec![
        // --- The Idempotency-Key header ---
        case!("key-missing", "no Idempotency-Key on POST /checkout" => 400 Some("missing-idempotency-key"), replay: false, runs: 0,
            "refused by the filter", |env| { let b = unique_json(""); env.send_body(Request::post("/checkout").token(&token("alice")).header("content-type", "application/json").body(b.clone()), &b).await }),
        case!("key-empty", "`Idempotency-Key:` with an empty value" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let b = unique_json(""); env.raw("/checkout", &[b""], &b).await }),
        case!("key-255-characters", "a key of exactly 255 visible ASCII characters (the limit)" => 201 NONE, replay: false, runs: 1,
            "executed once", |env| { let k = format!("{}-", unique_key("k255")); let k = format!("{k}{}", "k".repeat(255 - k.len())); env.send(checkout(&k, "alice", &charge_body(1)), &k).await }),
        case!("key-256-characters", "a key of 256 characters" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let b = unique_json(""); env.raw("/checkout", &["k".repeat(256).as_bytes()], &b).await }),
        case!("key-8000-characters", "a key of 8,000 characters" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let b = unique_json(""); env.raw("/checkout", &["k".repeat(8000).as_bytes()], &b).await }),
        case!("key-70000-characters", "a key of 70,000 characters (over Envoy's 60 KiB header limit)" => 431 NONE, replay: false, runs: 0,
            "refused by Envoy's HTTP codec", |env| { let b = unique_json(""); env.raw("/checkout", &["k".repeat(70_000).as_bytes()], &b).await }),
        case!("key-control-character", "a key containing byte 0x01" => 400 NONE, replay: false, runs: 0,
            "refused by Envoy's HTTP codec", |env| { let b = unique_json(""); env.raw("/checkout", &[b"abc\x01def"], &b).await }),
        case!("key-nul-byte", "a key containing byte 0x00" => 400 NONE, replay: false, runs: 0,
            "refused by Envoy's HTTP codec", |env| { let b = unique_json(""); env.raw("/checkout", &[b"abc\x00def"], &b).await }),
        case!("key-delete-character", "a key containing byte 0x7F (DEL)" => 400 NONE, replay: false, runs: 0,
            "refused by Envoy's HTTP codec", |env| { let b = unique_json(""); env.raw("/checkout", &[b"abc\x7fdef"], &b).await }),
        case!("key-tab-inside", "`a<TAB>b`" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let b = unique_json(""); env.raw("/checkout", &[b"abc\tdef"], &b).await }),
        case!("key-bare-lf", "`<key><LF>injected: 1` (a bare LF inside the header line)" => 201 NONE, replay: false, runs: 1,
            "Envoy reads a bare LF as a line end: the key is `<key>`, `injected` another header; executed once", |env| { let k = unique_key("lf"); let b = unique_json(""); let g = env.raw("/checkout", &[format!("{k}\ninjected: 1").as_bytes()], &b).await; Got { executions: env.runs(&k).await, ..g } }),
        case!("key-obsolete-line-folding", "a key continued on the next line (obs-fold)" => 400 BAD_KEY, replay: false, runs: 0,
            "Envoy unfolds the line; the filter refuses the space", |env| { let b = unique_json(""); env.raw("/checkout", &[b"abc\r\n def"], &b).await }),
        case!("key-non-ascii-utf8", "`clé-ключ-鍵` in UTF-8" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let b = unique_json(""); env.raw("/checkout", &["clé-ключ-鍵".as_bytes()], &b).await }),
        case!("key-obs-text-latin1", "a key with the single byte 0xE9 (Latin-1 é)" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let b = unique_json(""); env.raw("/checkout", &[b"caf\xe9"], &b).await }),
        case!("key-space-inside", "`a b`" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let (r, b) = with_key("a b"); env.send_body(r, &b).await }),
        case!("key-comma", "`a,b` (a list)" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let (r, b) = with_key("a,b"); env.send_body(r, &b).await }),
        case!("key-list-of-strings", "`\"a\", \"b\"`" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let (r, b) = with_key("\"a\", \"b\""); env.send_body(r, &b).await }),
        case!("key-quote-inside-quotes", "`\"ab\"c\"`" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let (r, b) = with_key("\"ab\"c\""); env.send_body(r, &b).await }),
        case!("key-escaped-quote", "`\"a\\\"b\"` (an sf-string whose value holds a quote)" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter: the key may not contain a quote", |env| { let (r, b) = with_key("\"a\\\"b\""); env.send_body(r, &b).await }),
        case!("key-escaped-backslash", "`\"<unique>\\\\b\"`: an sf-string whose value holds a backslash" => 201 NONE, replay: false, runs: 1,
            "executed once; the upstream receives the unescaped key", |env| { let k = unique_key("bs"); let (r, _) = with_key(&format!("\"{k}\\\\b\"")); env.send(r, &format!("{k}\\b")).await }),
        case!("key-empty-sf-string", "`\"\"`" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let (r, b) = with_key("\"\""); env.send_body(r, &b).await }),
        case!("key-unterminated-sf-string", "`\"abc`" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let (r, b) = with_key("\"abc"); env.send_body(r, &b).await }),
        case!("key-sf-string-with-parameters", "`\"abc\";a=1`" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let (r, b) = with_key("\"abc\";a=1"); env.send_body(r, &b).await }),
        case!("key-sent-twice", "two Idempotency-Key headers with different values" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let (r, b) = with_key("twice-a"); env.send_body(r.key("twice-b"), &b).await }),
        case!("key-sent-twice-same-value", "two Idempotency-Key headers with the same value" => 400 BAD_KEY, replay: false, runs: 0,
            "refused by the filter", |env| { let k = unique_key("same"); let (r, b) = with_key(&k); env.send_body(r.key(&k), &b).await }),
        case!("key-surrounding-whitespace", "`   <key>   ` (spaces around a valid key)" => 201 NONE, replay: false, runs: 1,
            "executed once: Envoy strips the optional whitespace", |env| { let k = unique_key("ows"); let b = unique_json(""); let g = env.raw("/checkout", &[format!("   {k}   ").as_bytes()], &b).await; Got { executions: env.runs(&k).await, ..g } }),
        case!("key-sf-string-then-bare", "`\"<key>\"` then `<key>` with the same body" => 201 NONE, replay: true, runs: 1,
            "the second is a replay: both forms are the same key", |env| { let k = unique_key("sf"); twice(&env, &k, checkout(&format!("\"{k}\""), "alice", &charge_body(5)), checkout(&k, "alice", &charge_body(5))).await }),
        case!("key-case-differs", "`<key>` then the same key upper-cased" => 201 NONE, replay: false, runs: 1,
            "executed again: keys are case-sensitive", |env| { let k = unique_key("case"); let a = env.main().send(checkout(&k, "alice", &charge_body(6))).await; assert_eq!(a.status, 201); let up = k.to_uppercase(); let g = env.send(checkout(&up, "alice", &charge_body(6)), &up).await; assert_eq!(env.runs(&k).await, 1); g }),
        // --- Request bodies ---
        case!("body-over-limit", "1 MiB + 1 byte with Content-Length" => 413 Some("payload-too-large"), replay: false, runs: 0,
            "refused by the filter before buffering", |env| { let k = unique_key("over"); env.send(json_post(&k, json_of_len(LIMIT + 1)), &k).await }),
        case!("body-exactly-at-limit", "exactly 1 MiB with Content-Length" => 201 NONE, replay: false, runs: 1,
            "executed once, every byte arrives", |env| { let k = unique_key("atlimit"); let b = json_of_len(LIMIT); let g = env.send(json_post(&k, b.clone()), &k).await; assert_eq!(env.runs_of_body(&b).await, 1, "body altered"); g }),
        case!("body-over-limit-chunked", "1 MiB + 1 byte, chunked (no Content-Length)" => 413 Some("payload-too-large"), replay: false, runs: 0,
            "refused by the filter as the body grows over the limit", |env| { let k = unique_key("overch"); let b = json_of_len(LIMIT + 1); env.send(Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", "application/json").body(chunked(&b, |_| 64 * 1024)), &k).await }),
        case!("body-at-limit-chunked", "exactly 1 MiB, chunked" => 201 NONE, replay: false, runs: 1,
            "executed once, every byte arrives", |env| { let k = unique_key("atch"); let b = json_of_len(LIMIT); let g = env.send(Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", "application/json").body(chunked(&b, |_| 64 * 1024)), &k).await; assert_eq!(env.runs_of_body(&b).await, 1, "body altered"); g }),
        case!("body-uneven-chunks", "300 KiB in chunks of 1 to 9 KiB" => 201 NONE, replay: false, runs: 1,
            "executed once, the SHA-256 upstream equals the client's", |env| { let k = unique_key("uneven"); let b = json_of_len(300 * 1024); let g = env.send(Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", "application/json").body(chunked(&b, |i| 1024 * (1 + i % 9))), &k).await; assert_eq!(env.runs_of_body(&b).await, 1, "body altered"); g }),
        case!("body-one-byte-chunks", "a 600-byte JSON body sent one byte per chunk" => 201 NONE, replay: false, runs: 1,
            "executed once, the SHA-256 upstream equals the client's", |env| { let k = unique_key("bytes"); let b = json_of_len(600); let g = env.send(Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", "application/json").body(chunked(&b, |_| 1)), &k).await; assert_eq!(env.runs_of_body(&b).await, 1, "body altered"); g }),
        case!("body-chunked-replay", "the same body once chunked, once with Content-Length" => 201 NONE, replay: true, runs: 1,
            "the second is a replay: framing is not part of the request", |env| { let k = unique_key("frame"); let b = json_of_len(5000); twice(&env, &k, Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", "application/json").body(chunked(&b, |_| 333)), json_post(&k, b.clone())).await }),
        case!("body-invalid-json", "`{\"amount\": 1,` as application/json" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint); the checkout's 400 is stored like any outcome", |env| { let k = unique_key("badjson"); env.send(json_post(&k, b"{\"amount\": 1,".to_vec()), &k).await }),
        case!("body-invalid-utf8", "bytes 0xFF 0xFE inside a JSON string" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint); the checkout's 400", |env| { let k = unique_key("utf8"); env.send(json_post(&k, b"{\"amount\": \"\xff\xfe\"}".to_vec()), &k).await }),
        case!("body-duplicate-member", "`{\"amount\":1,\"amount\":2}`" => 400 Some("duplicate-json-member"), replay: false, runs: 0,
            "refused by the filter: two parsers could read it differently", |env| { let k = unique_key("dup"); env.send(json_post(&k, br#"{"amount":1,"amount":2}"#.to_vec()), &k).await }),
        case!("body-nested-duplicate-member", "`{\"a\":{\"b\":1,\"b\":1}}`" => 400 Some("duplicate-json-member"), replay: false, runs: 0,
            "refused by the filter", |env| { let k = unique_key("dupn"); env.send(json_post(&k, br#"{"amount":1,"a":{"b":1,"b":1}}"#.to_vec()), &k).await }),
        case!("body-duplicate-member-escaped", "`{\"amount\":1,\"\\u0061mount\":2}` (same name, escaped)" => 400 Some("duplicate-json-member"), replay: false, runs: 0,
            "refused by the filter: names are compared after unescaping", |env| { let k = unique_key("dupe"); env.send(json_post(&k, br#"{"amount":1,"\u0061mount":2}"#.to_vec()), &k).await }),
        case!("body-100000-deep-array", "`[[[…]]]` nested 100,000 deep" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint past depth 128); the checkout's 400", |env| { let k = unique_key("deepa"); env.send(json_post(&k, ("[".repeat(100_000) + &"]".repeat(100_000)).into_bytes()), &k).await }),
        case!("body-100000-deep-object", "`{\"a\":{\"a\":…}}` nested 100,000 deep" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint); the checkout's 400", |env| { let k = unique_key("deepo"); env.send(json_post(&k, ("{\"a\":".repeat(100_000) + "1" + &"}".repeat(100_000)).into_bytes()), &k).await }),
        case!("body-huge-integer", "an amount of 1 followed by 5,000 zeros" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint: beyond a double); the checkout's 400", |env| { let k = unique_key("hugeint"); env.send(json_post(&k, format!("{{\"amount\": 1{}}}", "0".repeat(5000)).into_bytes()), &k).await }),
        case!("body-huge-exponent", "`1e999999999999999999`" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint); the checkout's 400", |env| { let k = unique_key("hugeexp"); env.send(json_post(&k, br#"{"amount": 1e999999999999999999}"#.to_vec()), &k).await }),
        case!("body-tiny-exponent", "`1e-400` (underflows a double)" => 201 NONE, replay: false, runs: 1,
            "executed once", |env| { let k = unique_key("tinyexp"); env.send(json_post(&k, br#"{"amount": 1, "x": 1e-400}"#.to_vec()), &k).await }),
        case!("body-lone-surrogate", "`\"\\ud800\"` in a string" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint); the checkout's 400", |env| { let k = unique_key("surrogate"); env.send(json_post(&k, br#"{"amount": 1, "name": "\ud800"}"#.to_vec()), &k).await }),
        case!("body-numbers-written-differently", "`1`, then `1.0`, then `1e0` (and `10e-1`) with one key" => 201 NONE, replay: true, runs: 1,
            "replays: the same number is the same request", |env| {
                let k = unique_key("num");
                for (i, v) in ["1", "1.0", "1e0"].iter().enumerate() {
                    let a = env.main().send(json_post(&k, format!("{{\"amount\": {v}}}").into_bytes())).await;
                    assert!(a.status == 201 && (i == 0) != (a.header("idempotent-replayed").is_some()), "{v}: {}", a.describe());
                }
                env.send(json_post(&k, br#"{"amount": 10e-1}"#.to_vec()), &k).await }),
        case!("body-number-beyond-double-precision", "`9007199254740993` then `9007199254740992`" => 422 Some("idempotency-key-reused"), replay: false, runs: 1,
            "different numbers are different requests", |env| { let k = unique_key("prec"); twice(&env, &k, json_post(&k, br#"{"amount": 9007199254740993}"#.to_vec()), json_post(&k, br#"{"amount": 9007199254740992}"#.to_vec())).await }),
        case!("body-reordered-members", "the same object with members reordered and re-spaced" => 201 NONE, replay: true, runs: 1,
            "a replay: canonical JSON", |env| { let k = unique_key("order"); twice(&env, &k, json_post(&k, br#"{"amount":1,"b":{"x":1,"y":[1,2]}}"#.to_vec()), json_post(&k, b"{ \"b\" : {\"y\":[1, 2], \"x\":1},\n \"amount\" : 1 }".to_vec())).await }),
        case!("body-json-without-json-content-type", "a JSON body sent as text/plain" => 201 NONE, replay: false, runs: 1,
            "executed once (raw fingerprint)", |env| { let k = unique_key("plain"); env.send(Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", "text/plain").body(br#"{"amount":1}"#.to_vec()), &k).await }),
        case!("body-reordered-without-json-content-type", "as text/plain, then the members reordered" => 422 Some("idempotency-key-reused"), replay: false, runs: 1,
            "without a JSON type the bytes are the request", |env| { let k = unique_key("plain2"); let p = |b: &[u8]| Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", "text/plain").body(b.to_vec()); twice(&env, &k, p(br#"{"amount":1,"b":2}"#), p(br#"{"b":2,"amount":1}"#)).await }),
        case!("body-json-suffix-content-type", "`application/vnd.api+json`, then reordered" => 201 NONE, replay: true, runs: 1,
            "a replay: `+json` types are canonicalized", |env| { let k = unique_key("suffix"); let p = |b: &[u8]| Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", "application/vnd.api+json").body(b.to_vec()); twice(&env, &k, p(br#"{"amount":1,"b":2}"#), p(br#"{"b":2,"amount":1}"#)).await }),
        case!("body-content-type-with-charset", "`application/json; charset=utf-8`, then reordered without the parameter" => 201 NONE, replay: true, runs: 1,
            "a replay: parameters do not change the media type", |env| { let k = unique_key("charset"); let p = |ct: &str, b: &[u8]| Request::post("/checkout").token(&token("alice")).key(&k).header("content-type", ct).body(b.to_vec()); twice(&env, &k, p("application/json; charset=utf-8", br#"{"amount":1,"b":2}"#), p("application/json", br#"{"b":2,"amount":1}"#)).await }),
        case!("body-empty-with-json-content-type", "no body, Content-Type application/json" => 400 NONE, replay: false, runs: 1,
            "forwarded; the checkout's 400", |env| { let k = unique_key("empty"); env.send(json_post(&k, Vec::new()), &k).await }),
        case!("body-byte-order-mark", "UTF-8 BOM before a JSON object" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint); the checkout's 400", |env| { let k = unique_key("bom"); env.send(json_post(&k, b"\xef\xbb\xbf{\"amount\":1}".to_vec()), &k).await }),
        case!("body-nul-bytes", "four NUL bytes" => 400 NONE, replay: false, runs: 1,
            "forwarded (raw fingerprint); the checkout's 400", |env| { let k = unique_key("nul"); env.send(json_post(&k, vec![0; 4]), &k).await }),
        case!("body-changed-after-first", "the same key with another amount" => 422 Some("idempotency-key-reused"), replay: false, runs: 1,
            "refused: the key was used for another request", |env| { let k = unique_key("changed"); twice(&env, &k, checkout(&k, "alice", &charge_body(1)), checkout(&k, "alice", &charge_body(2))).await }),
        // --- Scope: endpoints, subjects, paths ---
        case!("same-key-other-endpoint", "a key used on /checkout, then on /refunds" => 201 NONE, replay: false, runs: 2,
            "executed on each endpoint: no replay crosses endpoints", |env| { let k = unique_key("ep"); twice(&env, &k, checkout(&k, "alice", &charge_body(1)), Request::post("/refunds").token(&token("alice")).key(&k).json(&charge_body(1))).await }),
        case!("same-key-other-subject", "a key used by bob, then by alice" => 201 NONE, replay: false, runs: 2,
            "executed for each subject: no replay crosses subjects", |env| { let k = unique_key("subj"); twice(&env, &k, checkout(&k, "bob", &charge_body(1)), checkout(&k, "alice", &charge_body(1))).await }),
        case!("forged-subject-header", "bob's key, then alice's token with `x-jwt-sub: bob` twice" => 201 NONE, replay: false, runs: 2,
            "alice's own execution: jwt_authn replaces the forged header", |env| { let k = unique_key("forge"); twice(&env, &k, checkout(&k, "bob", &charge_body(1)), checkout(&k, "alice", &charge_body(1)).header("x-jwt-sub", "bob").header("x-jwt-sub", "bob")).await }),
        case!("forged-subject-without-token", "no token, `x-jwt-sub: alice`" => 401 NONE, replay: false, runs: 0,
            "refused by jwt_authn", |env| { let k = unique_key("forge2"); env.send(Request::post("/checkout").key(&k).header("x-jwt-sub", "alice").json(&charge_body(1)), &k).await }),
        case!("query-string-changes-request", "`/checkout`, then `/checkout?coupon=1` with one key" => 422 Some("idempotency-key-reused"), replay: false, runs: 1,
            "the query is part of the fingerprint", |env| { let k = unique_key("query"); twice(&env, &k, checkout(&k, "alice", &charge_body(1)), Request { path: "/checkout?coupon=1".into(), ..checkout(&k, "alice", &charge_body(1)) }).await }),
        case!("path-upper-case", "POST /CHECKOUT" => 404 NONE, replay: false, runs: 0,
            "not a protected route (paths are case-sensitive): passed through, the checkout has no such path", |env| { let k = unique_key("upper"); env.send(Request { path: "/CHECKOUT".into(), ..checkout(&k, "alice", &charge_body(1)) }, &k).await }),
        case!("path-trailing-slash", "POST /checkout/" => 404 NONE, replay: false, runs: 0,
            "not a protected route: passed through, the checkout has no such path", |env| { let k = unique_key("slash"); env.send(Request { path: "/checkout/".into(), ..checkout(&k, "alice", &charge_body(1)) }, &k).await }),
        case!("method-get-with-key", "GET /checkout with a key" => 405 NONE, replay: false, runs: 0,
            "not a protected route: passed through, and the checkout has no GET /checkout", |env| { let k = unique_key("get"); env.send(Request::get("/checkout").token(&token("alice")).key(&k), &k).await }),
        case!("http2-retry-of-http1", "the first request over HTTP/1.1, the retry over HTTP/2" => 201 NONE, replay: true, runs: 1,
            "a replay: the protocol is not part of the request", |env| { let k = unique_key("h2"); let a = env.main().send(checkout(&k, "alice", &charge_body(9))).await; assert_eq!(a.status, 201); let b = Client::http2(&env.stack.envoy.url("")).send(checkout(&k, "alice", &charge_body(9))).await; Got::from_answer(&b, env.runs(&k).await) }),
        case!("client-fencing-token-header", "the client sends its own `idempotency-fencing-token: 999999999`" => 201 NONE, replay: false, runs: 1,
            "executed once with the state API's token, not the client's", |env| { let k = unique_key("fence"); let g = env.send(checkout(&k, "alice", &charge_body(1)).header("idempotency-fencing-token", "999999999"), &k).await; let ran = env.main().charges_for_key(&env.stack.checkout.url(""), &k).await; assert!(ran.iter().all(|e| e["fencing_token"] != "999999999"), "{ran:?}"); g }),
        // --- Tokens ---
        case!("token-missing", "no Authorization header" => 401 NONE, replay: false, runs: 0,
            "refused by jwt_authn", |env| { let k = unique_key("tok"); env.send(Request::post("/checkout").key(&k).json(&charge_body(1)), &k).await }),
        case!("token-expired", "an expired token" => 401 NONE, replay: false, runs: 0,
            "refused by jwt_authn", |env| { let k = unique_key("tok"); env.send(checkout(&k, "expired", &charge_body(1)), &k).await }),
        case!("token-badly-signed", "a token signed with another key" => 401 NONE, replay: false, runs: 0,
            "refused by jwt_authn", |env| { let k = unique_key("tok"); env.send(checkout(&k, "wrong_key", &charge_body(1)), &k).await }),
        case!("token-tampered", "a valid token with its payload changed" => 401 NONE, replay: false, runs: 0,
            "refused by jwt_authn", |env| { let k = unique_key("tok"); env.send(checkout(&k, "tampered", &charge_body(1)), &k).await }),
        case!("token-wrong-issuer", "a token from another issuer" => 401 NONE, replay: false, runs: 0,
            "refused by jwt_authn", |env| { let k = unique_key("tok"); env.send(checkout(&k, "wrong_issuer", &charge_body(1)), &k).await }),
        case!("token-wrong-audience", "a token for another audience" => 403 NONE, replay: false, runs: 0,
            "refused by jwt_authn (403: verified, not allowed)", |env| { let k = unique_key("tok"); env.send(checkout(&k, "wrong_audience", &charge_body(1)), &k).await }),
        case!("token-other-scheme", "`Authorization: Basic <alice's token>`" => 401 NONE, replay: false, runs: 0,
            "refused by jwt_authn", |env| { let k = unique_key("tok"); env.send(Request::post("/checkout").header("authorization", &format!("Basic {}", token("alice"))).key(&k).json(&charge_body(1)), &k).await }),
        case!("token-garbage", "`Authorization: Bearer x.y.z`" => 401 NONE, replay: false, runs: 0,
            "refused by jwt_authn", |env| { let k = unique_key("tok"); env.send(Request::post("/checkout").token("x.y.z").key(&k).json(&charge_body(1)), &k).await }),
        // --- The state API called directly ---
        case!("state-api-without-token", "POST /v1/claim to the state API without Authorization" => 401 Some("unauthenticated"), replay: false, runs: 0,
            "refused by the state API", |env| env.state_api_claim(None, "").await),
        case!("state-api-wrong-token", "POST /v1/claim with another bearer token" => 401 Some("unauthenticated"), replay: false, runs: 0,
            "refused by the state API", |env| env.state_api_claim(Some("Bearer not-the-token"), "").await),
        case!("state-api-token-other-scheme", "POST /v1/claim with `Basic <the token>`" => 401 Some("unauthenticated"), replay: false, runs: 0,
            "refused by the state API", |env| env.state_api_claim(Some(&format!("Basic {TEST_API_TOKEN}")), "").await),
        case!("state-api-token-in-query", "POST `/v1/claim?access_token=<the token>`" => 401 Some("unauthenticated"), replay: false, runs: 0,
            "refused by the state API", |env| env.state_api_claim(None, &format!("?access_token={TEST_API_TOKEN}")).await),
        // --- A state API that answers something else (fake state API behind an extra Envoy) ---
        case!("state-api-answers-garbage", "the claim is answered with bytes that are not HTTP" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed: nothing forwarded", |env| env.fake_case(FakeClaim::Garbage).await),
        case!("state-api-answers-wrong-json", "200 `{\"hello\":\"world\"}`" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::WrongJson).await),
        case!("state-api-answers-not-json", "200 with an HTML body" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::NotJson).await),
        case!("state-api-answers-empty", "200 with an empty body" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::Empty).await),
        case!("state-api-answers-500", "500 with a problem document" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::ServerError).await),
        case!("state-api-answers-401", "401 (as if the filter's token were wrong)" => 500 INTERNAL, replay: false, runs: 0,
            "refused, not an outage: never forwarded, not even where a route fails open", |env| env.fake_case(FakeClaim::Unauthorized).await),
        case!("state-api-unknown-outcome", "200 `{\"outcome\":\"maybe\"}`" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::UnknownOutcome).await),
        case!("state-api-wrong-field-type", "`claimed` with `\"token\": \"seven\"`" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::WrongType).await),
        case!("state-api-bad-base64", "`completed` whose body is not base64" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::BadBase64).await),
        case!("state-api-bad-status", "`completed` with status 1000" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::BadStatus).await),
        case!("state-api-replay-forbidden-headers", "`completed` with set-cookie, x-request-id, connection, transfer-encoding, a wrong content-length" => 201 NONE, replay: true, runs: 0,
            "replayed with only allowlisted headers and a correct length", |env| {
                let (a, key) = env.fake(FakeClaim::ReplayForbiddenHeaders).await;
                for h in ["set-cookie", "x-request-id", "connection", "transfer-encoding"] {
                    assert_eq!(a.header(h), None, "{h} must never be replayed: {}", a.describe());
                }
                assert_eq!(a.body, br#"{"fake":true}"#, "{}", a.describe());
                assert_eq!(a.header("location").as_deref(), Some("/charges/fake"));
                Got::from_answer(&a, env.runs(&key).await) }),
        case!("state-api-replay-header-injection", "`completed` with `location: /x<CR><LF>set-cookie: injected=1`" => 201 NONE, replay: true, runs: 0,
            "replayed without that header: nothing is injected", |env| { let (a, key) = env.fake(FakeClaim::ReplayHeaderInjection).await; assert_eq!(a.header("set-cookie"), None, "{}", a.describe()); assert_eq!(a.header("location"), None, "{}", a.describe()); Got::from_answer(&a, env.runs(&key).await) }),
        case!("state-api-in-progress-zero", "`in_progress` with `retry_after_s: 0`" => 409 Some("request-in-progress"), replay: false, runs: 0,
            "409 with `Retry-After: 1` (never 0)", |env| { let (a, key) = env.fake(FakeClaim::InProgressZero).await; assert_eq!(a.header("retry-after").as_deref(), Some("1")); Got::from_answer(&a, env.runs(&key).await) }),
        case!("state-api-never-answers", "the claim is never answered" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed at the callout timeout (1 s)", |env| { let (a, key) = env.fake(FakeClaim::Hang).await; assert!(a.elapsed < Duration::from_millis(2_500), "{:?}", a.elapsed); Got::from_answer(&a, env.runs(&key).await) }),
        case!("state-api-closes-connection", "the connection is closed without an answer" => 503 UNAVAILABLE, replay: false, runs: 0,
            "fail closed", |env| env.fake_case(FakeClaim::Close).await),
        case!("state-api-answers-8-mib", "200 with 8 MiB of whitespace around a valid `mismatch` answer" => 422 Some("idempotency-key-reused"), replay: false, runs: 0,
            "read whole: it is valid JSON", |env| env.fake_case(FakeClaim::Huge).await),
    ]
}

// ---------------------------------------------------------------------------------------------
// The doc table

const DOC: &str = "docs/hostile-input.md";
const BEGIN: &str = "<!-- cases:begin (generated from tests/tests/hostile.rs) -->";
const END: &str = "<!-- cases:end -->";

fn table(cases: &[Case]) -> String {
    let esc = |s: &str| s.replace('|', "\\|");
    let mut out = String::from(
        "| # | case | input | status | answer | checkout runs |\n|---|---|---|---|---|---|\n",
    );
    for (i, c) in cases.iter().enumerate() {
        let mut answer = String::new();
        if let Some(p) = c.problem {
            answer.push_str(&format!("problem `{p}`; "));
        }
        if c.replay {
            answer.push_str("`Idempotent-Replayed: true`; ");
        }
        answer.push_str(c.answer);
        out.push_str(&format!(
            "| {} | `{}` | {} | {} | {} | {} |\n",
            i + 1,
            c.name,
            esc(c.input),
            c.status,
            esc(&answer),
            c.runs
        ));
    }
    out
}

fn doc_table_matches_cases() -> Result<(), Failed> {
    let cases = cases();
    let path = e2e::process::workspace_root().join(DOC);
    let doc = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {DOC}: {e}"))?;
    let (Some(b), Some(e)) = (doc.find(BEGIN), doc.find(END)) else {
        return Err(format!("{DOC} lacks the markers {BEGIN} / {END}").into());
    };
    let generated = table(&cases);
    let current = doc[b + BEGIN.len()..e].trim_matches('\n');
    if std::env::var("UPDATE_HOSTILE_DOC").is_ok() {
        let updated = format!(
            "{}{BEGIN}\n{generated}{END}{}",
            &doc[..b],
            &doc[e + END.len()..]
        );
        std::fs::write(&path, updated).map_err(|e| e.to_string())?;
        return Ok(());
    }
    // Every row names a case with the same expected status, and every case has its row.
    let rows: Vec<(String, u16)> = current
        .lines()
        .skip(2)
        .filter_map(|l| {
            let cells: Vec<&str> = l.split(" | ").collect();
            Some((
                cells.get(1)?.trim_matches('`').to_owned(),
                cells.get(3)?.trim().parse().ok()?,
            ))
        })
        .collect();
    for (name, status) in &rows {
        match cases.iter().find(|c| c.name == name) {
            Some(c) if c.status == *status => {}
            Some(c) => {
                return Err(format!(
                    "{DOC}: row {name} says {status}, the test expects {}",
                    c.status
                )
                .into())
            }
            None => return Err(format!("{DOC}: row {name} has no test case").into()),
        }
    }
    if rows.len() != cases.len() || current != generated.trim_matches('\n') {
        return Err(format!("{DOC} is out of step with tests/tests/hostile.rs: run UPDATE_HOSTILE_DOC=1 cargo test -p stack --test hostile -- doc_table").into());
    }
    let mut names: Vec<&str> = cases.iter().map(|c| c.name).collect();
    names.sort_unstable();
    names.dedup();
    if names.len() != cases.len() {
        return Err("two cases share a name".into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Running a case

async fn run_case(env: Arc<Env>, c: &Case) {
    let got = (c.run)(Arc::clone(&env)).await;
    let what = format!("{}: {}", c.name, got.detail);
    assert_eq!(got.status, c.status, "status of {what}");
    assert_eq!(got.problem.as_deref(), c.problem, "problem type of {what}");
    assert_eq!(got.replayed, c.replay, "replay flag of {what}");
    assert_eq!(got.executions, c.runs, "checkout executions of {what}");
    // A normal request still works afterwards: the Wasm VM and Envoy are alive.
    let k = unique_key("after");
    let ok = env
        .main()
        .send(checkout(&k, "alice", &charge_body(1)))
        .await;
    assert_eq!(
        ok.status,
        201,
        "after {}: {}\n{}",
        c.name,
        ok.describe(),
        env.stack.logs()
    );
    if c.name.starts_with("state-api-") {
        let ok = env
            .via_fake()
            .send(checkout(&FakeClaim::Ok.key(), "alice", &charge_body(1)))
            .await;
        assert_eq!(
            ok.status,
            201,
            "after {}, through the fake state API: {}\n{}",
            c.name,
            ok.describe(),
            env.fake_envoy.log_tail()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Security checks with a stack of their own

/// Marker key, body and token values sent through every path; none may appear in any log.
async fn logs_never_contain_keys_bodies_or_tokens() {
    let stack = Stack::start(StackOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let fake = FakeStateApi::start().unwrap_or_else(|e| panic!("{e}"));
    let fake_envoy = stack
        .start_extra_envoy_unbatched(fake.port, "envoy-fake")
        .unwrap_or_else(|e| panic!("{e}"));
    let c = Client::new(&stack.envoy.url(""));
    let key = unique_key("MARKERKEY7f3a");
    let body =
        json!({"amount": 1, "note": "MARKERBODY9c1e", "card": {"number": "4242424242424242"}});
    let changed = json!({"amount": 2, "note": "MARKERBODY9c1e-changed"});
    let alice = token("alice");
    let send = |req: Request| c.send(req);
    // Executed, replayed, in progress, mismatch, bad key, bad body, no subject, too large.
    assert_eq!(send(checkout(&key, "alice", &body)).await.status, 201);
    assert_eq!(send(checkout(&key, "alice", &body)).await.status, 201);
    assert_eq!(send(checkout(&key, "alice", &changed)).await.status, 422);
    let slow_key = unique_key("MARKERKEY7f3a-slow");
    let slow = send_in_background(&c, checkout(&slow_key, "alice", &body).delay_ms(1_000));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(send(checkout(&slow_key, "alice", &body)).await.status, 409);
    let _ = slow.await;
    assert_eq!(
        send(
            Request::post("/checkout")
                .token(&alice)
                .key("MARKERKEY7f3a with space")
                .json(&body)
        )
        .await
        .status,
        400
    );
    assert_eq!(
        send(json_post(
            &unique_key("MARKERKEY7f3a-dup"),
            br#"{"note":"MARKERBODY9c1e","note":"MARKERBODY9c1e"}"#.to_vec()
        ))
        .await
        .status,
        400
    );
    assert_eq!(
        send(
            Request::post("/checkout")
                .token("MARKERTOKEN.abc.def")
                .key(&key)
                .json(&body)
        )
        .await
        .status,
        401
    );
    assert_eq!(
        send(
            checkout(&unique_key("MARKERKEY7f3a-reset"), "alice", &body)
                .header("x-demo-reset", "1")
        )
        .await
        .status,
        503
    );
    // The state API refuses a wrong token; the filter's own token is never logged either.
    let direct = Client::new(&stack.state_api.url(""))
        .send(
            Request::post(contract::wire::CLAIM_PATH)
                .header("authorization", "Bearer MARKERTOKEN-state")
                .json(&json!({"key": "MARKERKEY7f3a-direct"})),
        )
        .await;
    assert_eq!(direct.status, 401);
    // Through a misbehaving state API: the filter logs why, never what.
    let fc = Client::new(&fake_envoy.url(""));
    for b in [
        FakeClaim::ServerError,
        FakeClaim::WrongJson,
        FakeClaim::Garbage,
    ] {
        let k = format!("fake-{}-MARKERKEY7f3a-{}", b.slug(), unique_key("f"));
        assert_eq!(fc.send(checkout(&k, "alice", &body)).await.status, 503);
    }
    // The state API answers 503 while its database is down: logged without the key.
    let mut stack = stack;
    tokio::task::block_in_place(|| stack.postgres.kill_postmaster())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        send(checkout(
            &unique_key("MARKERKEY7f3a-pgdown"),
            "alice",
            &body
        ))
        .await
        .status,
        503
    );
    tokio::task::block_in_place(|| stack.postgres.restart()).unwrap_or_else(|e| panic!("{e}"));
    tokio::time::sleep(Duration::from_millis(500)).await;

    let logs = [
        ("envoy", stack.envoy.log()),
        ("envoy-fake", fake_envoy.log()),
        ("state-api", stack.state_api.log()),
        ("checkout", stack.checkout.log()),
    ];
    let jwt_signature = alice.rsplit('.').next().unwrap_or_default().to_owned();
    let secrets = [
        "MARKERKEY7f3a",
        "MARKERBODY9c1e",
        "MARKERTOKEN",
        &alice,
        &jwt_signature,
        TEST_API_TOKEN,
        TEST_KEY_SECRET,
        "4242424242424242",
    ];
    let mut total = 0;
    for (name, log) in &logs {
        assert!(
            !log.is_empty(),
            "{name} wrote no log at all: the check would prove nothing"
        );
        total += log.len();
        for s in secrets {
            if let Some(line) = log.lines().find(|l| l.contains(s)) {
                panic!(
                    "{name}'s log contains a secret ({}…): {line}",
                    &s[..s.len().min(12)]
                );
            }
        }
    }
    e2e::faults::record_figures(
        "hostile",
        "logs_never_contain_keys_bodies_or_tokens",
        json!({"log_bytes_checked": total, "markers": secrets.len()}),
    );
}

/// The table holds an HMAC of (key, subject, endpoint), never the key; the same key for another
/// subject is another record and replays nothing across.
async fn database_stores_an_hmac_not_the_key(env: Arc<Env>) {
    let c = env.main();
    let key = unique_key("MARKERKEYdb");
    assert_eq!(
        c.send(checkout(&key, "alice", &charge_body(42)))
            .await
            .status,
        201
    );
    let bob = c.send(checkout(&key, "bob", &charge_body(42))).await;
    assert!(
        bob.status == 201 && bob.header("idempotent-replayed").is_none(),
        "bob must not read alice's response: {}",
        bob.describe()
    );
    let db = env.stack.database_name();
    let dump = env
        .stack
        .postgres
        .psql(db, "SELECT r::text FROM idempotency_records r")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!dump.is_empty());
    assert!(!dump.contains("MARKERKEYdb"), "a raw key is stored: {dump}");
    let key_hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
    assert!(!dump.contains(&key_hex), "a raw key is stored (hex)");
    // The row's address is exactly HMAC-SHA256(secret, len‖key‖len‖subject‖len‖endpoint).
    for subject in ["alice", "bob"] {
        let expected = hmac_sha256(
            TEST_KEY_SECRET.as_bytes(),
            &scope_input(&key, subject, "POST /checkout"),
        );
        let found = env
            .stack
            .postgres
            .psql(db, &format!("SELECT subject || ' ' || endpoint || ' ' || state FROM idempotency_records WHERE scope_hash = '\\x{expected}'"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            found,
            format!("{subject} POST /checkout completed"),
            "no record under the HMAC for {subject}"
        );
        // Without the secret the key cannot be tested against the table.
        let unkeyed = sha256_hex(&scope_input(&key, subject, "POST /checkout"));
        let hit = env
            .stack
            .postgres
            .psql(
                db,
                &format!(
                    "SELECT count(*) FROM idempotency_records WHERE scope_hash = '\\x{unkeyed}'"
                ),
            )
            .unwrap_or_default();
        assert_eq!(hit, "0");
    }
}

fn scope_input(key: &str, subject: &str, endpoint: &str) -> Vec<u8> {
    let mut v = Vec::new();
    for part in [key, subject, endpoint] {
        v.extend_from_slice(&(part.len() as u64).to_be_bytes());
        v.extend_from_slice(part.as_bytes());
    }
    v
}

/// HMAC-SHA256 (RFC 2104) in hex, from sha2 alone.
fn hmac_sha256(secret: &[u8], data: &[u8]) -> String {
    let mut k = [0u8; 64];
    if secret.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(secret));
    } else {
        k[..secret.len()].copy_from_slice(secret);
    }
    let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(data)
        .finalize();
    let outer = Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize();
    outer.iter().map(|b| format!("{b:02x}")).collect()
}

/// A filter that batches, in front of a state API older than `/v1/writes` (the fake answers it
/// 404): the batch's claims go one callout each, nothing fails, and no batch follows.
async fn an_older_state_api_gets_each_claim_alone_after_its_404(env: Arc<Env>) {
    let envoy = env
        .stack
        .start_extra_envoy(env.fake.port, "envoy-batching-to-an-older-state-api")
        .unwrap_or_else(|e| panic!("{e}"));
    let c = Client::new(&envoy.url(""));
    let round = |name: &'static str| {
        let keys: Vec<String> = (0..24)
            .map(|i| unique_key(&format!("{name}-{i}")))
            .collect();
        keys
    };
    let send = |keys: Vec<String>| {
        let c = c.clone();
        async move {
            let sends = keys
                .iter()
                .map(|k| c.send(checkout(k, "alice", &charge_body(7)).delay_ms(100)));
            let answers = futures::future::join_all(sends).await;
            (keys, answers)
        }
    };
    let (keys, answers) = send(round("older-api")).await;
    for (k, a) in keys.iter().zip(&answers) {
        assert_eq!(a.status, 201, "{k}: {}", a.describe());
        assert_eq!(env.runs(k).await, 1, "{k}: one charge");
    }
    let batches = envoy.filter_counter("claim_batches");
    assert_eq!(
        batches, 1,
        "24 claims at once on one worker: one batch, refused"
    );
    assert_eq!(env.fake.calls_to(contract::wire::WRITES_PATH), 1);
    // From then on, each claim alone.
    let (keys, answers) = send(round("older-api-after")).await;
    for (k, a) in keys.iter().zip(&answers) {
        assert_eq!(a.status, 201, "{k}: {}", a.describe());
    }
    assert_eq!(
        envoy.filter_counter("claim_batches"),
        1,
        "no batch after the 404"
    );
    assert_eq!(envoy.filter_counter("complete_batches"), 0);
    // The whole log: the second round's lines may push the line out of the last 30.
    assert!(
        envoy.log().contains("no more batches on this worker"),
        "the worker says it stopped batching:\n{}",
        envoy.log_tail()
    );
}

fn main() {
    let args = Arguments::from_args();
    let mut trials = vec![
        Trial::test("doc_table_matches_cases", doc_table_matches_cases),
        Trial::test("security::logs_never_contain_keys_bodies_or_tokens", || {
            block_on(logs_never_contain_keys_bodies_or_tokens())
        }),
        Trial::test("security::database_stores_an_hmac_not_the_key", || {
            let env = shared_env()?;
            block_on(database_stores_an_hmac_not_the_key(env))
        }),
        Trial::test(
            "an_older_state_api_gets_each_claim_alone_after_its_404",
            || {
                let env = shared_env()?;
                block_on(an_older_state_api_gets_each_claim_alone_after_its_404(env))
            },
        ),
    ];
    for (i, c) in cases().into_iter().enumerate() {
        trials.push(Trial::test(
            format!("case::{:02}_{}", i + 1, c.name),
            move || {
                let env = shared_env()?;
                block_on(run_case(env, &c))
            },
        ));
    }
    let conclusion = libtest_mimic::run(&args, trials);
    if let Ok(mut guard) = SHARED.lock() {
        guard.take();
    }
    conclusion.exit();
}
