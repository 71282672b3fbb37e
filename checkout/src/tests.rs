//! The reference upstream contract over HTTP, as the edge calls it.
use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The checkout on a free loopback port.
async fn serve() -> (std::net::SocketAddr, Arc<Ledger>) {
    let ledger = Arc::new(Ledger::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = app(Arc::clone(&ledger));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, ledger)
}

/// An HTTP/1.1 exchange: the status, the headers (names lower-case) and the body.
async fn exchange(
    addr: std::net::SocketAddr,
    head: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    let mut request = format!("{head} HTTP/1.1\r\nhost: checkout\r\nconnection: close\r\n");
    for (n, v) in headers {
        request.push_str(&format!("{n}: {v}\r\n"));
    }
    request.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, body.to_owned())
}

fn named<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

const CHARGE: &str = r#"{"amount":700,"card":{"number":"4242424242424242"}}"#;

/// `POST /checkout` with `key` and `token` as the edge forwards it: the status and body.
async fn charge(addr: std::net::SocketAddr, key: &str, token: i64) -> (u16, String) {
    let (status, _, body) = charge_of(addr, key, token, "fp-700", CHARGE).await;
    (status, body)
}

/// `POST /checkout` of `body` as the edge forwards it, with its fingerprint (opaque to the
/// checkout: the edge's value).
async fn charge_of(
    addr: std::net::SocketAddr,
    key: &str,
    token: i64,
    fingerprint: &str,
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    let token = token.to_string();
    let headers = [
        ("idempotency-key", key),
        ("idempotency-fencing-token", token.as_str()),
        ("idempotency-endpoint", "POST /checkout"),
        ("idempotency-fingerprint", fingerprint),
        ("x-jwt-sub", "alice"),
        ("content-type", "application/json"),
    ];
    exchange(addr, "POST /checkout", &headers, body).await
}

/// The reconcile request the edge sends about alice's request (`endpoint`, `fingerprint`)
/// with `key`, asked with the new owner's `token`.
async fn reconcile_of(
    addr: std::net::SocketAddr,
    key: &str,
    token: i64,
    endpoint: &str,
    fingerprint: &str,
) -> (u16, Vec<(String, String)>, String) {
    let token = token.to_string();
    let headers = [
        ("idempotency-key", key),
        ("idempotency-fencing-token", token.as_str()),
        ("idempotency-subject", "alice"),
        ("idempotency-endpoint", endpoint),
        ("idempotency-fingerprint", fingerprint),
    ];
    exchange(addr, &format!("GET /checkout/attempts/{key}"), &headers, "").await
}

#[tokio::test]
async fn a_later_token_gets_the_execution_s_response_and_the_same_token_twice_is_refused() {
    let (addr, ledger) = serve().await;
    let (first, charged) = charge(addr, "k1", 1).await;
    assert_eq!(first, 201, "{charged}");
    // A re-executed attempt (a larger token) after the charge: the same answer, no charge.
    let (again, answered) = charge(addr, "k1", 2).await;
    assert_eq!((again, &answered), (201, &charged));
    // The same token twice: refused, nothing charged.
    let (twice, refusal) = charge(addr, "k1", 2).await;
    assert_eq!(twice, 409, "{refusal}");
    assert!(refusal.contains("fencing-token-reused"), "{refusal}");
    // A lower token: stale.
    let (late, stale) = charge(addr, "k1", 1).await;
    assert_eq!(late, 409);
    assert!(stale.contains("stale-fencing-token"), "{stale}");
    assert_eq!(ledger.entries().len(), 1, "one charge for the key");
    let states: Vec<_> = ledger
        .attempts(|a| a.list())
        .unwrap_or_default()
        .iter()
        .map(|a| a.state)
        .collect();
    use attempts::AttemptState::*;
    assert_eq!(states, [Executed, Replayed, Fenced, Fenced]);
}

// Issue 34 path 11: attempts are of a request (key, subject, endpoint, fingerprint), not of
// a key alone.

#[tokio::test]
async fn another_body_under_the_same_key_runs_and_is_never_answered_with_the_first_s_execution() {
    // A retention reuse: the edge forwards another request under a key whose record was
    // past its retention, with a larger token.
    let (addr, ledger) = serve().await;
    let (first, _, charged) = charge_of(addr, "k1", 1, "fp-700", CHARGE).await;
    assert_eq!(first, 201, "{charged}");
    let other = r#"{"amount":900,"card":{"number":"4242424242424242"}}"#;
    let (status, _, answered) = charge_of(addr, "k1", 2, "fp-900", other).await;
    assert_eq!(status, 201, "{answered}");
    assert_ne!(
        answered, charged,
        "the other request ran, it did not get the first one's response"
    );
    assert_eq!(ledger.entries().len(), 2, "one charge per request");
    // The first request again (a larger token): its own execution, nothing charged.
    let (again, _, replayed) = charge_of(addr, "k1", 3, "fp-700", CHARGE).await;
    assert_eq!((again, &replayed), (201, &charged));
    assert_eq!(ledger.entries().len(), 2);
}

#[tokio::test]
async fn the_reconcile_endpoint_answers_about_the_asked_request_and_names_its_attempt() {
    let (addr, _ledger) = serve().await;
    let (first, _, charged) = charge_of(addr, "k1", 1, "fp-700", CHARGE).await;
    assert_eq!(first, 201, "{charged}");
    // Another body under the key (a retention reuse): it never ran.
    let (status, headers, body) = reconcile_of(addr, "k1", 5, "POST /checkout", "fp-900").await;
    assert_eq!(
        (status, named(&headers, "idempotency-outcome")),
        (404, Some("not-executed")),
        "another request's execution is not this one's: {body}"
    );
    // Another endpoint under the key (a prefix route's other path): it never ran either.
    let (status, headers, body) = reconcile_of(addr, "k1", 6, "POST /refunds", "fp-700").await;
    assert_eq!(
        (status, named(&headers, "idempotency-outcome")),
        (404, Some("not-executed")),
        "{body}"
    );
    // The request itself: its execution, naming the attempt (token 1) it describes and the
    // request it belongs to.
    let (status, headers, body) = reconcile_of(addr, "k1", 7, "POST /checkout", "fp-700").await;
    assert_eq!((status, &body), (201, &charged));
    for (name, value) in [
        ("idempotency-outcome", "executed"),
        ("idempotency-fencing-token", "1"),
        ("idempotency-endpoint", "POST /checkout"),
        ("idempotency-fingerprint", "fp-700"),
        // Issue 46, finding 6: and whose request it was, since the fingerprint does not cover
        // the subject.
        ("idempotency-subject", "alice"),
        ("idempotency-key", "k1"),
    ] {
        assert_eq!(named(&headers, name), Some(value), "{name}: {headers:?}");
    }
    // Without the endpoint or the fingerprint there is no telling which request is meant.
    let (status, _, body) = exchange(
        addr,
        "GET /checkout/attempts/k1",
        &[
            ("idempotency-fencing-token", "8"),
            ("idempotency-subject", "alice"),
        ],
        "",
    )
    .await;
    assert_eq!(status, 400, "{body}");
}

#[tokio::test]
async fn subscriptions_take_put_patch_and_a_bodiless_delete_each_executed_once_per_attempt_token() {
    let (addr, ledger) = serve().await;
    let change = |method: &'static str, token: &'static str, body: &'static str| {
        let endpoint = format!("{method} /subscriptions/sub_1");
        async move {
            let headers = [
                ("idempotency-key", "k-sub"),
                ("idempotency-fencing-token", token),
                ("idempotency-endpoint", endpoint.as_str()),
                ("idempotency-fingerprint", "fp"),
                ("x-jwt-sub", "alice"),
            ];
            exchange(addr, &endpoint, &headers, body).await
        }
    };
    let (put, put_headers, put_body) = change("PUT", "1", r#"{"plan":"gold"}"#).await;
    assert_eq!(put, 201, "{put_body}");
    assert_eq!(
        named(&put_headers, "location"),
        Some("/subscriptions/sub_1")
    );
    let (patch, _, patch_body) = change("PATCH", "1", r#"{"plan":"silver"}"#).await;
    assert_eq!(patch, 201, "{patch_body}");
    // A DELETE carries no body: that is a request, not an unparseable one.
    let (delete, _, delete_body) = change("DELETE", "1", "").await;
    assert_eq!(delete, 201, "{delete_body}");
    // The same attempt of the DELETE again (a larger token): its execution's answer, no second.
    let (again, _, again_body) = change("DELETE", "2", "").await;
    assert_eq!((again, &again_body), (201, &delete_body));
    let kinds: Vec<_> = ledger.entries().iter().map(|e| e.kind.clone()).collect();
    assert_eq!(
        kinds,
        [
            "subscription.put",
            "subscription.patch",
            "subscription.delete"
        ]
    );
    // A PUT still needs a body it can read.
    let headers = [("idempotency-key", "k-empty"), ("x-jwt-sub", "alice")];
    let (empty_put, _, _) = exchange(addr, "PUT /subscriptions/sub_2", &headers, "").await;
    assert_eq!(empty_put, 400);
}
