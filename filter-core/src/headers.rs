//! Which upstream response headers are stored and replayed.

/// Replayed by default: they describe the result, not the exchange. The body is stored as it
/// came (compressed, if it was), so its `content-encoding` goes with it, and `vary` says what
/// the encoding depended on.
pub const REPLAYED: &[&str] = &[
    "content-type",
    "content-encoding",
    "vary",
    "location",
    "etag",
    "link",
    "content-location",
    "cache-control",
];

/// Header on every replayed response.
pub const REPLAYED_MARKER: (&str, &str) = ("idempotent-replayed", "true");

/// The key's horizon (issue 48; the IETF draft's open issues #35 and #49 ask for one): on the
/// first answer and on every replay, the seconds for which the edge still remembers the key at
/// least. A retry within them is answered from this key's record (its replay, 409, or what
/// its route does with an unknown outcome); after them the key may be new again. Not a promise
/// where the edge does not hold the key: a route that fails open during an outage, or an
/// operator's release or purge (a worker's memory may still replay for `replay_cache_ttl_ms`).
/// The filter sets it only where it knows the record's retention; an upstream should not send
/// it (it passes where the filter sets none). Seconds from now rather than a date, as `max-age`, a cookie's
/// `Max-Age` and the HTTP API working group's own RateLimit fields (`t`) carry a reset: the
/// client's clock is not the edge's, and a delta needs no agreement between them. Named for
/// the key, not the response, so that no cache reads it as the response's freshness. Always a
/// lower bound: rounded down, and counted from earlier than the record's expiry runs from.
pub const EXPIRES_HEADER: &str = "idempotency-key-expires-in";

/// The header's value for `ms` left: whole seconds, rounded down.
pub fn expires_in(ms: u64) -> String {
    (ms / 1_000).to_string()
}

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
        EXPIRES_HEADER,
        contract::wire::FENCING_TOKEN_HEADER,
        contract::wire::OUTCOME_HEADER,
        contract::wire::SUBJECT_HEADER,
        contract::wire::ENDPOINT_HEADER,
        contract::wire::FINGERPRINT_HEADER,
        "retry-after",
        // The edge's retry hints (issue 48) say what to do about the edge's own answer; an
        // upstream's, replayed for ever, would tell every later retry the same.
        "x-should-retry",
        "stripe-should-retry",
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

/// Set on a request the filter forwards under a claim: Envoy's router sends it once, whatever
/// the route's (or virtual host's) `retry_policy` says. The router takes this header's value
/// over the policy's `num_retries` (`RetryStateImpl`, "The max retries header takes precedence
/// if set"), for the 5xx, reset, connect-failure, refused-stream, retriable-status-code and
/// HTTP/3 early-data retries alike, and a hedge on a per-try timeout is a retry like the others
/// (`shouldHedgeRetryPerTryTimeout`): with none left the first attempt runs on alone.
pub const ROUTER_NO_RETRIES: (&str, &str) = ("x-envoy-max-retries", "0");

/// Removed from a request the filter forwards under a claim: the other request headers by which
/// Envoy's router retries, hedges or cuts a try short (docs/filter.md, *Router retries below
/// the filter*). Envoy's connection manager strips them from a client it does not trust, not
/// from one it does (an internal address, a mesh's sidecar); whoever set them, a protected
/// request's retries are the route's to refuse, not the caller's to ask for. Without them the
/// route decides whether a per-try timeout hedges or resets, and either way nothing is sent
/// again ([`ROUTER_NO_RETRIES`]).
pub const ROUTER_RETRY_HEADERS: &[&str] = &[
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-upstream-rq-per-try-timeout-ms",
];

fn replayed(name: &str, extra: &[String]) -> bool {
    (REPLAYED.contains(&name) || extra.iter().any(|e| e == name)) && !never_replayed(name)
}

/// The headers kept from an upstream response: allowlisted (built-in + `extra`), names
/// lower-case, order and repeats kept, each one the state API stores
/// ([`contract::limits`]: a value with CR, LF or NUL is never kept, since Envoy writes a local
/// reply's values as they are). `complete` is false when a header that would be replayed could
/// not be kept (too long, or too many): a replay without it would not be the response, so the
/// outcome is stored as not replayable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    pub headers: Vec<(String, String)>,
    pub complete: bool,
}

pub fn stored(headers: &[(String, String)], extra: &[String]) -> Kept {
    let mut kept = Kept {
        headers: Vec::new(),
        complete: true,
    };
    for (name, value) in headers {
        let name = name.to_ascii_lowercase();
        if !replayed(&name, extra) {
            continue;
        }
        if contract::limits::storable_header_name(&name)
            && contract::limits::storable_header_value(value)
            && kept.headers.len() < contract::limits::MAX_HEADERS
        {
            kept.headers.push((name, value.clone()));
        } else {
            kept.complete = false;
        }
    }
    kept
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
            ("content-encoding", "gzip"),
            ("vary", "accept-encoding"),
            ("x-envoy-upstream-service-time", "3"),
        ]);
        assert_eq!(
            stored(&upstream, &[]).headers,
            h(&[
                ("content-type", "application/json"),
                ("location", "/charges/1"),
                ("etag", "\"v1\""),
                ("link", "</a>; rel=a"),
                ("link", "</b>; rel=b"),
                ("content-encoding", "gzip"),
                ("vary", "accept-encoding"),
            ])
        );
        assert!(stored(&upstream, &[]).complete);
        let with_extra = stored(
            &upstream,
            &["x-charge-id".to_owned(), "set-cookie".to_owned()],
        )
        .headers;
        assert!(with_extra.contains(&("x-charge-id".to_owned(), "ch_1".to_owned())));
        assert!(!with_extra.iter().any(|(n, _)| n == "set-cookie"));
    }

    #[test]
    fn a_replayed_header_that_cannot_be_kept_makes_the_outcome_not_replayable() {
        let long = "l".repeat(contract::limits::MAX_HEADER_VALUE_LEN + 1);
        let k = stored(&h(&[("location", &long), ("etag", "e")]), &[]);
        assert_eq!((k.headers, k.complete), (h(&[("etag", "e")]), false));
        let k = stored(&h(&[("location", "/x\r\nset-cookie: a=1")]), &[]);
        assert!(k.headers.is_empty() && !k.complete);
        // Headers that are not replayed do not count.
        let k = stored(&h(&[("x-other", &long), ("set-cookie", "\n")]), &[]);
        assert!(k.headers.is_empty() && k.complete);
        let many: Vec<(String, String)> = (0..=contract::limits::MAX_HEADERS)
            .map(|i| ("link".to_owned(), format!("<{i}>")))
            .collect();
        let k = stored(&many, &[]);
        assert_eq!(k.headers.len(), contract::limits::MAX_HEADERS);
        assert!(!k.complete);
    }
}
