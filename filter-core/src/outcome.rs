//! What to do with the key once the upstream (or Envoy on its behalf) answered.
//!
//! What decides is **where the answer came from**, not its status. Envoy says so in the
//! stream's `response.code_details`: `via_upstream` for the upstream's own answers, and
//! anything else for an answer Envoy made itself (its router's resets and timeouts, the
//! connection manager's timeouts, another filter's local reply).
//!
//! * The upstream's own answer is an outcome: stored (2xx, 3xx, 4xx always; 5xx by default) or
//!   released where the route says its upstream dedupes on the forwarded key
//!   (`on_5xx: "release"`).
//! * Envoy's answer when the upstream was **certainly never reached**: the key is given back
//!   (`release`), since a retry cannot execute the operation twice. Envoy tells us through
//!   `response.code_details` (and `response.flags`): the router's local replies for "no healthy
//!   upstream", "cluster not found", "no route", an upstream circuit breaker overflow, or a reset
//!   *before the connection existed* (connect refused or timed out).
//! * Every other answer of Envoy's after the request was let on (a 408, 413, 429, 503, 504, a
//!   reset, of any status) says nothing of what the upstream did, which may have executed: the
//!   outcome is *unknown*, never stored and replayed as if the upstream had said it.

use crate::config::On5xx;

/// `response.flags` bits (envoy/stream_info/stream_info.h, `CoreResponseFlag`: bit n is
/// `1 << n`).
pub mod flags {
    pub const NO_HEALTHY_UPSTREAM: u64 = 0x2;
    pub const UPSTREAM_REQUEST_TIMEOUT: u64 = 0x4;
    pub const UPSTREAM_REMOTE_RESET: u64 = 0x10;
    pub const UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
    pub const UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;
    pub const UPSTREAM_OVERFLOW: u64 = 0x80;
    pub const NO_ROUTE_FOUND: u64 = 0x100;
    pub const FAULT_INJECTED: u64 = 0x400;
    pub const STREAM_IDLE_TIMEOUT: u64 = 0x1_0000;
    pub const UPSTREAM_MAX_STREAM_DURATION_REACHED: u64 = 0x8_0000;
    pub const DURATION_TIMEOUT: u64 = 0x40_0000;
    /// Any sign that a request reached (or may have reached) an upstream.
    pub const REACHED: u64 =
        UPSTREAM_REQUEST_TIMEOUT | UPSTREAM_REMOTE_RESET | UPSTREAM_CONNECTION_TERMINATION;
}

/// `response.code_details` of an answer the upstream itself gave.
pub const VIA_UPSTREAM: &str = "via_upstream";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Keep this response as the key's result.
    Store,
    /// Give the key back: a retry may run the operation.
    Release,
    /// Envoy answered, not the upstream, after the request was let on (a reset, a timeout,
    /// another filter's local reply): what the upstream did is unknown. The answer goes to the
    /// client; the record is marked unknown.
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

/// Whether Envoy made the answer itself rather than pass on the upstream's. Without code
/// details (a host that does not provide them), only a response flag says Envoy acted.
fn from_envoy(details: &str, flags: u64) -> bool {
    if details.is_empty() {
        return flags != 0;
    }
    details != VIA_UPSTREAM
}

/// Classify the answer to a forwarded request. `details`/`flags` are Envoy's
/// `response.code_details` and `response.flags` (empty / 0 when unavailable).
pub fn classify(status: u16, details: &str, flags: u64, on_5xx: On5xx) -> Outcome {
    if never_reached(details) && flags & flags::REACHED == 0 {
        return Outcome::Release;
    }
    if status >= 500 && on_5xx == On5xx::Release {
        // The upstream dedupes on the forwarded key itself: running again is safe.
        return Outcome::Release;
    }
    if from_envoy(details, flags) {
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

    /// Envoy's own answers after the request was let on, of every status class: a connection
    /// manager's timeout (a 408 while the request is still arriving, a 504 once it was whole),
    /// the router's (upstream timeout, reset, protocol error, max stream duration), a body too
    /// large, another filter's local reply (a fault, a direct response, a redirect).
    const ENVOY_S_OWN: &[(u16, &str, u64)] = &[
        (200, "direct_response", 0),
        (302, "a_filter_s_redirect", 0),
        (408, "stream_idle_timeout", flags::STREAM_IDLE_TIMEOUT),
        (408, "max_duration_timeout", flags::DURATION_TIMEOUT),
        (408, "request_overall_timeout", 0),
        (
            408,
            "upstream_max_stream_duration_reached",
            flags::UPSTREAM_MAX_STREAM_DURATION_REACHED,
        ),
        (413, "request_payload_too_large", 0),
        (429, "fault_filter_abort", flags::FAULT_INJECTED),
        (500, "response_payload_too_large", 0),
        (
            502,
            "upstream_reset_before_response_started{protocol_error}",
            0,
        ),
        (
            503,
            "upstream_reset_before_response_started{connection_termination}",
            flags::UPSTREAM_CONNECTION_TERMINATION,
        ),
        (
            504,
            "upstream_response_timeout",
            flags::UPSTREAM_REQUEST_TIMEOUT,
        ),
        (504, "stream_idle_timeout", flags::STREAM_IDLE_TIMEOUT),
        (504, "max_duration_timeout", flags::DURATION_TIMEOUT),
    ];

    #[test]
    fn envoy_s_own_answers_after_forwarding_are_unknown_whatever_their_status() {
        for &(status, details, f) in ENVOY_S_OWN {
            assert_eq!(
                classify(status, details, f, On5xx::Store),
                Outcome::Unknown,
                "{status} {details}"
            );
            // A route whose upstream dedupes on the key gives a 5xx of any origin back; any
            // other answer of Envoy's stays unknown there too.
            let on_release = if status >= 500 {
                Outcome::Release
            } else {
                Outcome::Unknown
            };
            assert_eq!(
                classify(status, details, f, On5xx::Release),
                on_release,
                "{status} {details}"
            );
        }
    }

    #[test]
    fn the_upstream_s_own_answers_of_every_class_are_outcomes() {
        for status in [
            100, 200, 201, 204, 301, 304, 400, 408, 413, 429, 499, 500, 503, 504, 599,
        ] {
            assert_eq!(
                classify(status, VIA_UPSTREAM, 0, On5xx::Store),
                Outcome::Store,
                "{status}"
            );
            let on_release = if status >= 500 {
                Outcome::Release
            } else {
                Outcome::Store
            };
            assert_eq!(
                classify(status, VIA_UPSTREAM, 0, On5xx::Release),
                on_release,
                "{status}"
            );
        }
    }

    #[test]
    fn without_code_details_only_a_response_flag_says_envoy_answered() {
        assert_eq!(classify(408, "", 0, On5xx::Store), Outcome::Store);
        assert_eq!(
            classify(408, "", flags::STREAM_IDLE_TIMEOUT, On5xx::Store),
            Outcome::Unknown
        );
        assert_eq!(
            classify(429, "", flags::FAULT_INJECTED, On5xx::Store),
            Outcome::Unknown
        );
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
