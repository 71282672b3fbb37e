//! Which upstream response headers are stored and replayed.

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
}
