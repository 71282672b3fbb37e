//! JSON bodies exchanged between the filter and the state API (`/v1/...`).
//!
//! Every request names the record by (key, subject, endpoint). Every call carries
//! `Authorization: Bearer <token>`. Errors come back as `application/problem+json`.
//! The state API serves the same contract as OpenAPI at `GET /openapi.json`.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

/// `POST /v1/claim`: claim the key for one execution, or learn why not.
pub const CLAIM_PATH: &str = "/v1/claim";
/// `POST /v1/heartbeat`: extend the lease of an in-flight claim (fenced).
pub const HEARTBEAT_PATH: &str = "/v1/heartbeat";
/// `POST /v1/complete`: store the upstream's response (fenced).
pub const COMPLETE_PATH: &str = "/v1/complete";
/// `POST /v1/release`: give the key back when the upstream was certainly never reached (fenced).
pub const RELEASE_PATH: &str = "/v1/release";
/// `GET /v1/records?key=..&subject=..&endpoint=..`: operator read of one record (no bodies).
pub const RECORDS_PATH: &str = "/v1/records";

/// The name of the header carrying the fencing token to the upstream.
pub const FENCING_TOKEN_HEADER: &str = "idempotency-fencing-token";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    pub key: String,
    /// The authenticated subject (never taken from the body or a client header).
    pub subject: String,
    /// The protected operation, e.g. `POST /checkout`.
    pub endpoint: String,
    /// Lower-case hex SHA-256 (64 characters).
    pub fingerprint: String,
    /// How the fingerprint was made, e.g. `sha256-jcs-v1`; compared together with it.
    pub fingerprint_alg: String,
    /// Lease length for this claim; the state API's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
}

/// Answers are read tolerantly (no `deny_unknown_fields`): a reader ignores members added
/// later, so the state API can gain answer fields without breaking filters built earlier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ClaimResponse {
    /// This caller owns the key: run the effect, then complete or release with `token`.
    Claimed {
        /// Fencing token: strictly larger than any earlier token for any key.
        token: i64,
        lease_ms: u64,
        /// True when an earlier owner's lease had run out and this claim took over.
        reclaimed: bool,
    },
    /// Another owner holds a live lease: answer 409 at once.
    InProgress {
        retry_after_s: u32,
        lease_remaining_ms: u64,
    },
    /// The first request finished: replay this.
    Completed {
        response: StoredResponse,
        /// Milliseconds until the record's retention expiry, by the database clock. A completed
        /// record never changes before then, so the filter may answer replays from memory until
        /// then. Absent from state APIs older than this field (the filter then does not cache).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_in_ms: Option<u64>,
    },
    /// The key was used with a different request fingerprint: answer 422.
    Mismatch,
}

/// The upstream response as stored and replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredResponse {
    pub status: u16,
    /// Allowlisted headers in the order received, names lower-case, multi-value kept as-is.
    pub headers: Vec<(String, String)>,
    /// Standard base64 of the body bytes; empty when not replayable.
    #[serde(default)]
    pub body_base64: String,
    /// False when the body was too large to keep: retries get a problem, never a re-run.
    pub replayable: bool,
}

impl StoredResponse {
    pub fn new(status: u16, headers: Vec<(String, String)>, body: &[u8], replayable: bool) -> Self {
        let body_base64 = if replayable {
            base64::engine::general_purpose::STANDARD.encode(body)
        } else {
            String::new()
        };
        Self {
            status,
            headers,
            body_base64,
            replayable,
        }
    }

    pub fn body(&self) -> Result<Vec<u8>, base64::DecodeError> {
        base64::engine::general_purpose::STANDARD.decode(&self.body_base64)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    pub token: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    pub lease_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteRequest {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    pub token: i64,
    pub response: StoredResponse,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    pub token: i64,
}

/// Answer to complete and release: what the record is now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteResponse {
    /// `completed` or `released`.
    pub state: String,
    /// For `completed`: milliseconds until the record's retention expiry, by the database
    /// clock (absent for `released`, and from state APIs older than this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<u64>,
}

impl WriteResponse {
    pub fn completed(expires_in_ms: u64) -> Self {
        Self {
            state: "completed".into(),
            expires_in_ms: Some(expires_in_ms),
        }
    }

    pub fn released() -> Self {
        Self {
            state: "released".into(),
            expires_in_ms: None,
        }
    }
}

/// Operator view of one record: never the stored body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordView {
    /// `in_progress` or `completed`.
    pub state: String,
    pub subject: String,
    pub endpoint: String,
    pub fingerprint_alg: String,
    pub token: i64,
    /// Milliseconds left on the lease (0 when run out or completed).
    pub lease_remaining_ms: u64,
    pub age_ms: u64,
    /// Milliseconds since completion, when completed.
    #[serde(default)]
    pub completed_age_ms: Option<u64>,
    pub response_status: Option<u16>,
    pub replayable: Option<bool>,
    /// Milliseconds until the retention expiry deletes it.
    pub expires_in_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_response_is_tagged_by_outcome() {
        let json = serde_json::to_string(&ClaimResponse::InProgress {
            retry_after_s: 2,
            lease_remaining_ms: 1500,
        })
        .unwrap_or_default();
        assert_eq!(
            json,
            r#"{"outcome":"in_progress","retry_after_s":2,"lease_remaining_ms":1500}"#
        );
        let back: Result<ClaimResponse, _> = serde_json::from_str(r#"{"outcome":"mismatch"}"#);
        assert_eq!(back.ok(), Some(ClaimResponse::Mismatch));
    }

    #[test]
    fn stored_response_round_trips_body_bytes() {
        let body = [0u8, 159, 146, 150, 255];
        let stored = StoredResponse::new(
            201,
            vec![("location".into(), "/charges/1".into())],
            &body,
            true,
        );
        let json = serde_json::to_vec(&stored).unwrap_or_default();
        let back: StoredResponse =
            serde_json::from_slice(&json).unwrap_or(StoredResponse::new(0, vec![], &[], false));
        assert_eq!(back.body().ok(), Some(body.to_vec()));
        assert_eq!(back, stored);
    }

    #[test]
    fn expiry_is_optional_both_ways() {
        // An older state API's answers still parse (no expiry), and a newer one's carry it.
        let old: ClaimResponse = serde_json::from_str(
            r#"{"outcome":"completed","response":{"status":200,"headers":[],"body_base64":"","replayable":true}}"#,
        )
        .unwrap_or(ClaimResponse::Mismatch);
        assert!(
            matches!(
                old,
                ClaimResponse::Completed {
                    expires_in_ms: None,
                    ..
                }
            ),
            "{old:?}"
        );
        let new = ClaimResponse::Completed {
            response: StoredResponse::new(200, vec![], b"", true),
            expires_in_ms: Some(86_399_000),
        };
        let json = serde_json::to_string(&new).unwrap_or_default();
        assert!(json.ends_with(r#","expires_in_ms":86399000}"#), "{json}");
        assert_eq!(serde_json::from_str::<ClaimResponse>(&json).ok(), Some(new));
        let w: Option<WriteResponse> = serde_json::from_str(r#"{"state":"completed"}"#).ok();
        assert_eq!(w.and_then(|w| w.expires_in_ms), None);
        assert_eq!(
            serde_json::to_string(&WriteResponse::released()).unwrap_or_default(),
            r#"{"state":"released"}"#
        );
        assert_eq!(
            serde_json::from_str::<WriteResponse>(r#"{"state":"completed","expires_in_ms":5}"#)
                .ok(),
            Some(WriteResponse::completed(5))
        );
    }

    #[test]
    fn answers_tolerate_members_added_later() {
        let r: Result<HeartbeatResponse, _> =
            serde_json::from_str(r#"{"lease_ms":1,"future":[1]}"#);
        assert_eq!(r.ok(), Some(HeartbeatResponse { lease_ms: 1 }));
        let r: Result<ClaimResponse, _> =
            serde_json::from_str(r#"{"outcome":"mismatch","why":"x"}"#);
        assert_eq!(r.ok(), Some(ClaimResponse::Mismatch));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let r: Result<ReleaseRequest, _> = serde_json::from_str(
            r#"{"key":"k","subject":"s","endpoint":"e","token":1,"extra":true}"#,
        );
        assert!(r.is_err());
    }
}
