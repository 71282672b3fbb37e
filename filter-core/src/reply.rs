//! The responses the filter sends itself (Envoy local replies): problem documents, and the
//! replay of a stored outcome.

use crate::headers::{stored, REPLAYED_MARKER};
use contract::{Problem, ProblemKind, PROBLEM_CONTENT_TYPE};

/// The headers that tell an SDK whether to retry an answer, each obeyed before the SDK's own
/// rules: the Stainless-generated SDKs' (openai-python, anthropic-sdk-python) and Stripe's.
pub const RETRY_HINT_HEADERS: [&str; 2] = ["x-should-retry", "stripe-should-retry"];

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
    /// An `application/problem+json` answer with `cache-control: no-store`, and the retry
    /// hints the SDKs obey before their own rules (`x-should-retry` for the Stainless SDKs,
    /// `Stripe-Should-Retry` for Stripe's): they retry 409 and every 5xx blindly otherwise.
    pub fn problem(kind: ProblemKind, detail: impl Into<String>) -> Self {
        let mut headers = vec![
            ("content-type".into(), PROBLEM_CONTENT_TYPE.into()),
            ("cache-control".into(), "no-store".into()),
        ];
        if let Some(retry) = kind.retry_same_key() {
            for name in RETRY_HINT_HEADERS {
                headers.push((name.into(), retry.to_string()));
            }
        }
        Self {
            status: kind.status(),
            headers,
            body: Problem::for_client(kind, detail).to_json(),
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
        let mut headers = stored(stored_headers, extra).headers;
        headers.push((REPLAYED_MARKER.0.into(), REPLAYED_MARKER.1.into()));
        Self {
            status,
            headers,
            body,
            reason: "idempotent_replay",
        }
    }
}

/// The answer to a retry of a request that completed: its replay, or the problem of an outcome
/// that was stored without its body. `Err`: a stored status that no HTTP response can carry.
pub fn for_completed(
    status: u16,
    headers: &[(String, String)],
    body: &[u8],
    replayable: bool,
    extra: &[String],
) -> Result<LocalReply, String> {
    if !replayable {
        let mut r = LocalReply::problem(
            ProblemKind::OutcomeNotReplayable,
            format!("the request completed with status {status} but its response was too large to keep; it will not run again"),
        );
        if let Some((_, loc)) = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("location"))
        {
            r = r.with_header("location", loc.clone());
        }
        return Ok(r);
    }
    if !(100..=999).contains(&status) {
        return Err(format!("stored status {status} is not an HTTP status"));
    }
    Ok(LocalReply::replay(status, headers, extra, body.to_vec()))
}

/// 409: the key is held by a request still running.
pub fn in_progress(retry_after_s: u32) -> LocalReply {
    LocalReply::problem(
        ProblemKind::InProgress,
        "a request with this key is still being processed; retry later",
    )
    .with_header("retry-after", retry_after_s.max(1).to_string())
}

/// 422: the key was used for another request.
pub fn mismatch(endpoint: &str) -> LocalReply {
    LocalReply::problem(
        ProblemKind::KeyReuseMismatch,
        format!("this Idempotency-Key was used with a different request to {endpoint}"),
    )
}

/// 503: the state API cannot be used, nothing was forwarded.
pub fn state_unavailable() -> LocalReply {
    LocalReply::problem(
        ProblemKind::StateUnavailable,
        "the idempotency store is unavailable; nothing was forwarded, retry later",
    )
    .with_header("retry-after", "1")
}

/// 503: the worker holds as many request body bytes as it may (`max_buffered_bytes`); nothing
/// was forwarded or claimed.
pub fn buffers_full() -> LocalReply {
    LocalReply::problem(
        ProblemKind::BuffersFull,
        "the edge holds as many request bodies as it may; nothing was forwarded, retry later",
    )
    .with_header("retry-after", "1")
}

/// 503: the worker's bound is full but the part kept for callers who hold little, and this
/// request would take its subject over what one caller may hold there (`RESERVE_PER_SUBJECT`,
/// this body included); nothing was forwarded or claimed.
pub fn reserve_buffers_full() -> LocalReply {
    LocalReply::problem(
        ProblemKind::BuffersFull,
        "the edge holds nearly as many request bodies as it may, and what is left is kept for small requests of callers who hold little; nothing was forwarded, retry later",
    )
    .with_header("retry-after", "1")
}

/// 503: this subject's requests hold as many request body bytes as one subject may on the
/// worker (`max_buffered_bytes_per_subject`); nothing was forwarded or claimed.
pub fn subject_buffers_full() -> LocalReply {
    LocalReply::problem(
        ProblemKind::BuffersFull,
        "your requests hold as many request bodies at the edge as one caller may; nothing was forwarded, retry once one has been answered",
    )
    .with_header("retry-after", "1")
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
                ("x-should-retry", "true"),
                ("stripe-should-retry", "true"),
                ("retry-after", "2")
            ])
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["type"], "/problems/request-in-progress");
        assert_eq!(v["detail"], "wait");
        assert_eq!(v["key_state"], "in_progress");
        assert_eq!(v["retry_same_key"], true);
        assert_eq!(v["new_key_safe"], false);
    }

    /// Issue 48: each answer tells the SDKs whether to retry (they retry 409 and every 5xx
    /// blindly otherwise), and its document what the client can do.
    #[test]
    fn every_answer_of_the_edge_says_whether_a_retry_can_help() {
        let hint = |r: &LocalReply| {
            let x = r.headers.iter().find(|(n, _)| n == "x-should-retry");
            let s = r.headers.iter().find(|(n, _)| n == "stripe-should-retry");
            assert_eq!(x.map(|h| &h.1), s.map(|h| &h.1), "{r:?}");
            x.map(|h| h.1.clone())
        };
        let doc = |r: &LocalReply| serde_json::from_slice::<serde_json::Value>(&r.body).unwrap();
        // Retry: the key is busy, or the edge or its store could not take the request.
        for r in [in_progress(2), state_unavailable(), buffers_full()] {
            assert_eq!(hint(&r).as_deref(), Some("true"), "{r:?}");
            assert!(r.headers.iter().any(|(n, _)| n == "retry-after"), "{r:?}");
            assert_eq!(doc(&r)["retry_same_key"], true);
            assert_eq!(doc(&r)["new_key_safe"], false);
        }
        // Do not: the same request with the same key gets the same answer.
        let unknown = LocalReply::problem(ProblemKind::OutcomeUnknown, "held");
        assert_eq!(hint(&unknown).as_deref(), Some("false"));
        assert_eq!(doc(&unknown)["key_state"], "unknown");
        assert_eq!(
            doc(&unknown)["new_key_safe"],
            false,
            "it may have run: a new key could run it twice"
        );
        let reused = mismatch("POST /checkout");
        assert_eq!(reused.status, 422);
        assert_eq!(hint(&reused).as_deref(), Some("false"));
        assert_eq!(doc(&reused)["key_state"], "mismatch");
        assert_eq!(
            doc(&reused)["new_key_safe"],
            false,
            "the body may have drifted between retries of a request that ran"
        );
        let missing = LocalReply::problem(ProblemKind::MissingKey, "no key");
        assert_eq!(hint(&missing).as_deref(), Some("false"));
        assert_eq!(doc(&missing)["new_key_safe"], true);
        assert!(doc(&missing).get("key_state").is_none());
        // The edge's 500: no hint, the SDK's own rule applies.
        let internal = LocalReply::problem(ProblemKind::Internal, "refused");
        assert_eq!(hint(&internal), None);
        assert!(doc(&internal).get("retry_same_key").is_none());
        // An upstream's hint is never stored for replay, even when allowed by name.
        for name in RETRY_HINT_HEADERS {
            assert!(crate::headers::never_replayed(name), "{name}");
        }
        let done = for_completed(201, &[], b"", false, &[]).unwrap();
        assert_eq!(hint(&done).as_deref(), Some("false"));
        assert_eq!(doc(&done)["key_state"], "completed");
        // A replay is the upstream's answer: no hint of the edge's.
        let replay = for_completed(201, &[], b"{}", true, &[]).unwrap();
        assert_eq!(hint(&replay), None);
    }
}
