//! Which upstream response headers are stored and replayed, and the headers of the answers
//! the filter makes itself.

use contract::{Problem, ProblemKind, PROBLEM_CONTENT_TYPE};

/// Replayed by default: they describe the result, not the exchange.
pub const REPLAYED: &[&str] = &[
    "content-type",
    "location",
    "etag",
    "link",
    "content-location",
    "cache-control",
];

/// Header on every replayed response.
pub const REPLAYED_MARKER: (&str, &str) = ("idempotent-replayed", "true");

/// Never stored nor replayed, even when configured: cookies, dates, hop-by-hop and
/// per-request or per-hop values, and anything Envoy or the transport computes.
pub fn never_replayed(name: &str) -> bool {
    const NEVER: &[&str] = &[
        "set-cookie",
        "set-cookie2",
        "date",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "server",
        "age",
        "via",
        "alt-svc",
        "x-request-id",
        "request-id",
        "x-correlation-id",
        "x-amzn-trace-id",
        "traceparent",
        "tracestate",
        "b3",
        "idempotent-replayed",
        contract::wire::FENCING_TOKEN_HEADER,
        "retry-after",
        "www-authenticate",
        "authorization",
        "strict-transport-security",
    ];
    name.starts_with(':')
        || name.starts_with("x-envoy-")
        || name.starts_with("x-b3-")
        || name.starts_with("x-datadog-")
        || NEVER.contains(&name)
}

/// The headers kept from an upstream response: allowlisted (built-in + `extra`), names
/// lower-case, order and repeats kept. A value with CR, LF or NUL is dropped: Envoy writes a
/// local reply's header values as they are, so a stored `location: /x\r\nset-cookie: a=1`
/// would otherwise reach the client as two headers.
pub fn stored(headers: &[(String, String)], extra: &[String]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter_map(|(name, value)| {
            let name = name.to_ascii_lowercase();
            let allowed = REPLAYED.contains(&name.as_str()) || extra.contains(&name);
            let safe = !value.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0));
            (allowed && safe && !never_replayed(&name)).then(|| (name, value.clone()))
        })
        .collect()
}

/// A response the filter sends itself (Envoy local reply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Short reason for Envoy's response code details (`wasm_...` is not settable; logged).
    pub reason: &'static str,
}

impl LocalReply {
    /// An `application/problem+json` answer with `cache-control: no-store`.
    pub fn problem(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            status: kind.status(),
            headers: vec![
                ("content-type".into(), PROBLEM_CONTENT_TYPE.into()),
                ("cache-control".into(), "no-store".into()),
            ],
            body: Problem::new(kind, detail).to_json(),
            reason: kind.slug(),
        }
    }

    pub fn with_header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    /// The stored response, replayed: stored headers filtered again (the store is not
    /// trusted to have applied this filter's allowlist), plus `Idempotent-Replayed: true`.
    pub fn replay(
        status: u16,
        stored_headers: &[(String, String)],
        extra: &[String],
        body: Vec<u8>,
    ) -> Self {
        let mut headers = stored(stored_headers, extra);
        headers.push((REPLAYED_MARKER.0.into(), REPLAYED_MARKER.1.into()));
        Self {
            status,
            headers,
            body,
            reason: "idempotent_replay",
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    #[test]
    fn only_allowlisted_headers_are_stored() {
        let upstream = h(&[
            (":status", "201"),
            ("Content-Type", "application/json"),
            ("location", "/charges/1"),
            ("set-cookie", "session=1"),
            ("date", "Mon"),
            ("x-request-id", "abc"),
            ("etag", "\"v1\""),
            ("link", "</a>; rel=a"),
            ("link", "</b>; rel=b"),
            ("x-charge-id", "ch_1"),
            ("transfer-encoding", "chunked"),
            ("content-length", "12"),
            ("x-envoy-upstream-service-time", "3"),
        ]);
        assert_eq!(
            stored(&upstream, &[]),
            h(&[
                ("content-type", "application/json"),
                ("location", "/charges/1"),
                ("etag", "\"v1\""),
                ("link", "</a>; rel=a"),
                ("link", "</b>; rel=b"),
            ])
        );
        let with_extra = stored(
            &upstream,
            &["x-charge-id".to_owned(), "set-cookie".to_owned()],
        );
        assert!(with_extra.contains(&("x-charge-id".to_owned(), "ch_1".to_owned())));
        assert!(!with_extra.iter().any(|(n, _)| n == "set-cookie"));
    }

    #[test]
    fn replays_are_marked_and_filtered_again() {
        let r = LocalReply::replay(
            201,
            &h(&[("location", "/c/1"), ("set-cookie", "x")]),
            &[],
            b"{}".to_vec(),
        );
        assert_eq!(r.status, 201);
        assert_eq!(
            r.headers,
            h(&[("location", "/c/1"), ("idempotent-replayed", "true")])
        );
        assert_eq!(r.body, b"{}");
    }

    #[test]
    fn values_with_cr_lf_or_nul_are_never_replayed() {
        let r = LocalReply::replay(
            201,
            &h(&[
                ("location", "/x\r\nset-cookie: injected=1"),
                ("etag", "\"a\nb\""),
                ("link", "</a>\0"),
                ("content-type", "application/json"),
            ]),
            &[],
            b"{}".to_vec(),
        );
        assert_eq!(
            r.headers,
            h(&[
                ("content-type", "application/json"),
                ("idempotent-replayed", "true")
            ])
        );
    }

    #[test]
    fn problems_are_problem_json_and_not_stored_by_caches() {
        let r =
            LocalReply::problem(ProblemKind::InProgress, "wait").with_header("retry-after", "2");
        assert_eq!(r.status, 409);
        assert_eq!(
            r.headers,
            h(&[
                ("content-type", "application/problem+json"),
                ("cache-control", "no-store"),
                ("retry-after", "2")
            ])
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["type"], "/problems/request-in-progress");
        assert_eq!(v["detail"], "wait");
    }
}
