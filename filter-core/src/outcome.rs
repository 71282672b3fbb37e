//! What to do with the key once the upstream (or Envoy on its behalf) answered.
//!
//! A key may be given back (`release`) only when the upstream was **certainly never reached**:
//! then a retry cannot execute the operation twice. Envoy tells us through the stream's
//! `response.code_details` (and `response.flags`): the router's local replies for "no healthy
//! upstream", "cluster not found", "no route", an upstream circuit breaker overflow, or a reset
//! *before the connection existed* (connect refused or timed out). A real response is an
//! outcome: stored (2xx, 3xx, 4xx always; 5xx by default) or released where the route says its
//! upstream dedupes on the forwarded key (`on_5xx: "release"`). A timeout or a reset after the
//! request may have been sent is Envoy's answer, not the upstream's: the outcome is *unknown*.

use crate::config::On5xx;

/// `response.flags` bits (envoy/stream_info/stream_info.h, `CoreResponseFlag`).
pub mod flags {
    pub const NO_HEALTHY_UPSTREAM: u64 = 0x2;
    pub const UPSTREAM_REQUEST_TIMEOUT: u64 = 0x4;
    pub const UPSTREAM_REMOTE_RESET: u64 = 0x10;
    pub const UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
    pub const UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;
    pub const UPSTREAM_OVERFLOW: u64 = 0x80;
    pub const NO_ROUTE_FOUND: u64 = 0x100;
    /// Any sign that a request reached (or may have reached) an upstream.
    pub const REACHED: u64 =
        UPSTREAM_REQUEST_TIMEOUT | UPSTREAM_REMOTE_RESET | UPSTREAM_CONNECTION_TERMINATION;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Keep this response as the key's result.
    Store,
    /// Give the key back: a retry may run the operation.
    Release,
    /// Envoy answered for an upstream that was reached (a reset, a timeout): what the upstream
    /// did is unknown. The answer goes to the client; the record is marked unknown.
    Unknown,
}

/// Code details (or their reset reasons) that mean no byte of the request left Envoy.
fn never_reached(details: &str) -> bool {
    const WHOLE: &[&str] = &[
        "no_healthy_upstream",
        "cluster_not_found",
        "route_not_found",
        "maintenance_mode",
        "no_cluster_found",
    ];
    if WHOLE.contains(&details) {
        return true;
    }
    // upstream_reset_before_response_started{<reason>[|<transport failure>]}
    if let Some(inner) = details
        .strip_prefix("upstream_reset_before_response_started{")
        .and_then(|r| r.strip_suffix('}'))
    {
        let reason = inner.split('|').next().unwrap_or("");
        return matches!(
            reason,
            "connection_failure"
                | "local_connection_failure"
                | "remote_connection_failure"
                | "connection_timeout"
                | "connect_timeout"
                | "overflow"
        );
    }
    false
}

/// An answer Envoy made itself (its router's reset, timeout or overflow replies), not the
/// upstream's: its status says nothing of what the upstream did.
fn from_envoy(details: &str) -> bool {
    !details.is_empty() && details != "via_upstream"
}

/// Classify the upstream's answer. `details`/`flags` are Envoy's `response.code_details` and
/// `response.flags` (empty / 0 when unavailable).
pub fn classify(status: u16, details: &str, flags: u64, on_5xx: On5xx) -> Outcome {
    if never_reached(details) && flags & flags::REACHED == 0 {
        return Outcome::Release;
    }
    if status >= 500 && on_5xx == On5xx::Release {
        // The upstream dedupes on the forwarded key itself: running again is safe.
        return Outcome::Release;
    }
    if from_envoy(details) && status >= 500 {
        return Outcome::Unknown;
    }
    Outcome::Store
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn results_are_stored() {
        for s in [200, 201, 204, 302, 400, 402, 404, 409, 422] {
            assert_eq!(
                classify(s, "via_upstream", 0, On5xx::Release),
                Outcome::Store,
                "{s}"
            );
        }
    }

    #[test]
    fn five_hundreds_follow_the_route() {
        assert_eq!(
            classify(500, "via_upstream", 0, On5xx::Store),
            Outcome::Store
        );
        assert_eq!(
            classify(503, "via_upstream", 0, On5xx::Release),
            Outcome::Release
        );
        // Envoy's own answers after the request was sent: the upstream's outcome is unknown.
        assert_eq!(
            classify(
                504,
                "upstream_response_timeout",
                flags::UPSTREAM_REQUEST_TIMEOUT,
                On5xx::Store
            ),
            Outcome::Unknown
        );
        let after_send = "upstream_reset_before_response_started{connection_termination}";
        assert_eq!(
            classify(
                503,
                after_send,
                flags::UPSTREAM_CONNECTION_TERMINATION,
                On5xx::Store
            ),
            Outcome::Unknown
        );
        assert_eq!(
            classify(
                503,
                "upstream_reset_before_response_started{remote_reset}",
                0x10,
                On5xx::Store
            ),
            Outcome::Unknown
        );
        // Where the upstream dedupes itself, a 5xx of any kind gives the key back.
        assert_eq!(
            classify(504, "upstream_response_timeout", 0x4, On5xx::Release),
            Outcome::Release
        );
        // The upstream's own 5xx is its answer; a details-less one too.
        assert_eq!(
            classify(503, "via_upstream", 0, On5xx::Store),
            Outcome::Store
        );
        assert_eq!(classify(503, "", 0, On5xx::Store), Outcome::Store);
    }

    #[test]
    fn never_reached_is_released_whatever_the_route() {
        for d in [
            "no_healthy_upstream",
            "cluster_not_found",
            "route_not_found",
            "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}",
            "upstream_reset_before_response_started{connection_failure}",
            "upstream_reset_before_response_started{local_connection_failure}",
            "upstream_reset_before_response_started{connection_timeout}",
            "upstream_reset_before_response_started{overflow}",
        ] {
            assert_eq!(classify(503, d, flags::UPSTREAM_CONNECTION_FAILURE, On5xx::Store), Outcome::Release, "{d}");
        }
    }

    #[test]
    fn a_retry_that_reached_the_upstream_vetoes_release() {
        // Envoy retried after a connect failure; a later try was reset after sending.
        let d = "upstream_reset_before_response_started{connection_failure}";
        let f = flags::UPSTREAM_CONNECTION_FAILURE | flags::UPSTREAM_REMOTE_RESET;
        assert_eq!(classify(503, d, f, On5xx::Store), Outcome::Unknown);
    }
}
