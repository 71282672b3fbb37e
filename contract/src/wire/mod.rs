//! JSON bodies exchanged between the filter and the state API (`/v1/...`).
//!
//! Every request names the record by (key, subject, endpoint). Every call carries
//! `Authorization: Bearer <token>`. Errors come back as `application/problem+json`.
//! The state API serves the same contract as OpenAPI at `GET /openapi.json`.

use crate::json;
use serde::{Deserialize, Serialize};

/// `POST /v1/claim`: claim the key for one execution, or learn why not.
pub const CLAIM_PATH: &str = "/v1/claim";
/// `POST /v1/claims`: several claims in one call (a worker's claims that queued while its
/// previous claim was on its way); each is answered as `/v1/claim` would answer it alone.
pub const CLAIMS_PATH: &str = "/v1/claims";
/// `POST /v1/completes`: several completes in one call (a worker's held responses that queued
/// while its previous complete was on its way); each is answered as `/v1/complete` would.
pub const COMPLETES_PATH: &str = "/v1/completes";
/// `POST /v1/writes`: claims and completes in one call (what queued on a worker while its
/// previous write was on its way); each is answered as `/v1/claim` or `/v1/complete` would.
pub const WRITES_PATH: &str = "/v1/writes";
/// Most claims (or completes) in one `/v1/claims` (or `/v1/completes`) call, and of each in
/// one `/v1/writes`.
pub const MAX_BATCH_CLAIMS: usize = 128;
/// `POST /v1/heartbeat`: extend the lease of an in-flight claim (fenced).
pub const HEARTBEAT_PATH: &str = "/v1/heartbeat";
/// `POST /v1/complete`: store the upstream's response (fenced).
pub const COMPLETE_PATH: &str = "/v1/complete";
/// `POST /v1/release`: give the key back when the upstream was certainly never reached (fenced).
pub const RELEASE_PATH: &str = "/v1/release";
/// `POST /v1/unknown`: the owner lost sight of its request after forwarding it (fenced): the
/// outcome is unknown, and no retry may run it again without proof of what became of it.
pub const UNKNOWN_PATH: &str = "/v1/unknown";
/// `POST /v1/abandon`: a claim whose answer never reached the filter (the callout timed out,
/// was cancelled with its stream, or its answer could not be read), named by the nonce it was
/// sent with: nothing was forwarded under it, so the record it made is given back (deleted, or
/// unknown again where an earlier attempt's outcome is unknown). Not fenced by a token: the
/// filter never learnt it.
pub const ABANDON_PATH: &str = "/v1/abandon";
/// `GET /v1/records?key=..&subject=..&endpoint=..`: operator read of one record (no bodies).
pub const RECORDS_PATH: &str = "/v1/records";
/// The header, and its value, that the state API's `404` to a [`RECORDS_PATH`] read carries
/// when there is no record for the key: the filter says `absent` to a client only on it. Any
/// other 404 (a proxy's, a route the state API does not have) is an outage: a client told
/// `absent` may take a new key for a request that ran.
pub const NO_RECORD_HEADER: &str = "idempotency-record";
pub const NO_RECORD_VALUE: &str = "absent";

/// The header the filter sends with every call to the state API: how long (ms) it waits for
/// the answer. The state API gives up a little before that (its own cap applies too): a job
/// whose caller gave up is dropped before it reaches Postgres, and a claim committed for a
/// caller that is gone is released.
pub const CALLER_TIMEOUT_HEADER: &str = "idempotency-caller-timeout-ms";

/// The name of the header carrying the fencing token to the upstream.
pub const FENCING_TOKEN_HEADER: &str = "idempotency-fencing-token";

/// The reconcile contract (an upstream's endpoint that tells what became of a request: the
/// key, [`SUBJECT_HEADER`], [`ENDPOINT_HEADER`] and [`FINGERPRINT_HEADER`], asked by the filter
/// on `on_unknown: reconcile` routes): the header of its answer that says so, one of
/// [`OUTCOME_EXECUTED`], [`OUTCOME_RUNNING`], [`OUTCOME_NOT_EXECUTED`].
pub const OUTCOME_HEADER: &str = "idempotency-outcome";
/// The answer *is* the outcome an earlier attempt of the request produced (status, headers,
/// body), and names that attempt: its token in [`FENCING_TOKEN_HEADER`] (lower than the one
/// asked with), the [`ENDPOINT_HEADER`] and [`FINGERPRINT_HEADER`] it was recorded with. The
/// filter stores nothing else.
pub const OUTCOME_EXECUTED: &str = "executed";
/// The earlier attempt is still at work (`Retry-After` says when to ask again).
pub const OUTCOME_RUNNING: &str = "running";
/// It never ran, and from now on the upstream refuses it (its fencing token is smaller than
/// the one the reconcile request carried).
pub const OUTCOME_NOT_EXECUTED: &str = "not-executed";
/// The subject, sent to the reconcile endpoint beside the key and the new fencing token.
pub const SUBJECT_HEADER: &str = "idempotency-subject";
/// The protected operation as the filter names it (`POST /checkout`: the record's endpoint),
/// sent with every request forwarded under a claim and with the reconcile request; an
/// `executed` answer echoes the one its attempt was recorded with.
pub const ENDPOINT_HEADER: &str = "idempotency-endpoint";
/// The request's fingerprint (lower-case hex, the value the state API compares: it covers
/// the method, path, query, media type and body), sent and echoed like [`ENDPOINT_HEADER`].
/// An upstream records it with the attempt and compares it for equality only.
pub const FINGERPRINT_HEADER: &str = "idempotency-fingerprint";
/// The headers the filter sets on a request it forwards under a claim (the upstream acts on
/// them): a client's copies are removed from every request, protected or not.
pub const FORWARDED_HEADERS: [&str; 3] =
    [FENCING_TOKEN_HEADER, ENDPOINT_HEADER, FINGERPRINT_HEADER];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    pub key: String,
    /// The authenticated subject (never taken from the body or a client header).
    pub subject: String,
    /// The protected operation, e.g. `POST /checkout`.
    pub endpoint: String,
    /// Lower-case hex SHA-256 (64 characters).
    pub fingerprint: String,
    /// How the fingerprint was made, e.g. `sha256-jcs-v2`; compared together with it.
    pub fingerprint_alg: String,
    /// Lease length for this claim; the state API's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// What to do with a record whose outcome is unknown (forwarded, never stored; or its
    /// lease ran out): answer `unknown`, or take it over with a new token.
    #[serde(default, skip_serializing_if = "OnUnknown::is_hold")]
    pub on_unknown: OnUnknown,
    /// The deployment the record belongs to: part of its scope (`""`: none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// How long the record is kept; the state API's default when absent, its maximum at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_s: Option<u64>,
    /// When the key is in progress, wait up to this long for its outcome before answering
    /// (`Prefer: wait`); the state API's maximum at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    /// This claim attempt's own name (1 to [`MAX_NONCE_LEN`] visible ASCII characters, unique
    /// per attempt): kept with the record it makes or takes over, so that the filter can give
    /// it back by [`ABANDON_PATH`] when the answer never reached it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonce: Option<String>,
}

/// Longest claim nonce.
pub const MAX_NONCE_LEN: usize = 64;

/// Whether a claim nonce is well formed.
pub fn valid_nonce(nonce: &str) -> bool {
    !nonce.is_empty()
        && nonce.len() <= MAX_NONCE_LEN
        && nonce.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

/// `POST /v1/abandon`: the claim attempt named `nonce` for this key never reached its caller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AbandonRequest {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub nonce: String,
}

/// `POST /v1/claims`: claims that do not wait (`wait_ms` is refused in a batch: one waiting
/// claim would hold every other answer back).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ClaimBatchRequest {
    /// 1 to [`MAX_BATCH_CLAIMS`].
    pub claims: Vec<ClaimRequest>,
}

/// `POST /v1/completes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CompleteBatchRequest {
    /// 1 to [`MAX_BATCH_CLAIMS`].
    pub completes: Vec<CompleteRequest>,
}

/// `POST /v1/writes`: claims that do not wait and completes, at least one in all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WriteBatchRequest {
    /// 0 to [`MAX_BATCH_CLAIMS`].
    #[serde(default)]
    pub claims: Vec<ClaimRequest>,
    /// 0 to [`MAX_BATCH_CLAIMS`].
    #[serde(default)]
    pub completes: Vec<CompleteRequest>,
}

/// The answer to `POST /v1/claims`, `/v1/completes` or `/v1/writes`: one item per request, in
/// order (for `/v1/writes`, the claims' then the completes').
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BatchResponse {
    pub answers: Vec<BatchItem>,
}

/// One request's answer in a batch: the status the single call would have answered it with,
/// and its document (the claim or write answer for a 2xx, the problem document otherwise).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BatchItem {
    pub status: u16,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub answer: serde_json::Value,
}

/// One item of a batch answer, as the filter reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item<T> {
    pub status: u16,
    /// A 2xx: the answer, read; otherwise the problem's `detail` (or why it is unreadable).
    pub answer: Result<T, AnswerError>,
}

pub type ClaimItem = Item<ClaimResponse>;
pub type WriteItem = Item<WriteResponse>;

/// A claim's choice for a record whose outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnUnknown {
    /// Answer [`ClaimResponse::Unknown`]: the caller holds the key (409) until an operator or
    /// the owner resolves it.
    #[default]
    Hold,
    /// Take the record over with a new, larger token (`claimed`, `reclaimed: true`): the caller
    /// reconciles with the upstream, or runs the request again where the route allows it.
    TakeOver,
}

impl OnUnknown {
    pub fn is_hold(&self) -> bool {
        *self == Self::Hold
    }
}

/// Answers are written with serde and read with [`ClaimResponse::read`] (and its siblings), the
/// one reader of each answer, used by the filter and the tests alike. Readers are tolerant:
/// members added later are ignored, so the state API can gain answer fields without breaking
/// filters built earlier. Requests are strict (`deny_unknown_fields`): the state API reads them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ClaimResponse {
    /// This caller owns the key: run the effect, then complete or release with `token`.
    Claimed {
        /// Fencing token: strictly larger than any earlier token for any key.
        token: i64,
        /// The lease granted (the one asked for, clamped to the state API's bounds).
        lease_ms: u64,
        /// True when this claim took over a record whose outcome was unknown (forwarded and
        /// never stored, or its lease ran out): the caller must not run the request again
        /// without proof of what became of it (reconcile), unless its route re-executes.
        reclaimed: bool,
        /// The largest response body this state API stores (a larger one is completed as not
        /// replayable). Absent from state APIs older than this field.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_body_bytes: Option<u64>,
        /// How long the record is kept, as applied (the request's, capped by the maximum).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retention_s: Option<u64>,
    },
    /// Another owner holds a live lease: answer 409 at once.
    InProgress {
        retry_after_s: u32,
        lease_remaining_ms: u64,
        /// The claim asked to wait and waited this long before the key was still in progress
        /// (absent: it did not wait, because it did not ask or the state API's waiters were
        /// at their bound).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        waited_ms: Option<u64>,
    },
    /// The first request finished: replay this.
    Completed {
        response: StoredResponse,
        /// Milliseconds until the record's retention expiry, by the database clock. A completed
        /// record never changes before then, so the filter may answer replays from memory until
        /// then. Absent from state APIs older than this field (the filter then does not cache).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_in_ms: Option<u64>,
        /// The claim found the key in progress and waited this long for it to complete.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        waited_ms: Option<u64>,
    },
    /// The key was used with a different request fingerprint: answer 422.
    Mismatch,
    /// The request was forwarded and its outcome never stored (its owner lost sight of it, or
    /// its lease ran out): nobody knows whether it ran. Held until resolved.
    Unknown,
}

/// The upstream response as stored and replayed: the one stored-response type of the filter,
/// the state API and its store. On the wire the body is standard base64 (`body_base64`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StoredResponse {
    #[cfg_attr(feature = "openapi", schema(minimum = 100, maximum = 999))]
    pub status: u16,
    /// Allowlisted headers in the order received, names lower-case, multi-value kept as-is.
    #[cfg_attr(feature = "openapi", schema(schema_with = header_pairs))]
    pub headers: Vec<(String, String)>,
    /// The body bytes (standard base64 on the wire); empty when not replayable.
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = Byte))]
    #[serde(
        default,
        rename = "body_base64",
        serialize_with = "base64_body::serialize",
        deserialize_with = "base64_body::deserialize"
    )]
    pub body: Vec<u8>,
    /// False when the body was too large to keep: retries get a problem, never a re-run.
    pub replayable: bool,
}

impl StoredResponse {
    /// A response as the filter captured it; the body is kept only when replayable.
    pub fn new(status: u16, headers: Vec<(String, String)>, body: &[u8], replayable: bool) -> Self {
        Self {
            status,
            headers,
            body: if replayable {
                body.to_vec()
            } else {
                Vec::new()
            },
            replayable,
        }
    }
}

/// `[[name, value], ...]`: each pair exactly two strings.
#[cfg(feature = "openapi")]
fn header_pairs() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
    let pair = ArrayBuilder::new()
        .items(ObjectBuilder::new().schema_type(Type::String))
        .min_items(Some(2))
        .max_items(Some(2));
    ArrayBuilder::new()
        .items(pair)
        .description(Some(
            "Allowlisted headers in the order received: [name, value] pairs, names lower-case.",
        ))
        .build()
}

/// `body_base64`: the body bytes as standard base64 on the wire.
mod base64_body {
    use base64::Engine as _;
    use serde::{Deserialize as _, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(body: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(body))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = std::borrow::Cow::<'de, str>::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text.as_bytes())
            .map_err(|_| serde::de::Error::custom("`body_base64` is not standard base64"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub token: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HeartbeatResponse {
    pub lease_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CompleteRequest {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub token: i64,
    pub response: StoredResponse,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub token: i64,
}

/// `POST /v1/unknown` names the owner's record the same way as a release.
pub type UnknownRequest = ReleaseRequest;

/// A record's state, as stored and as shown to operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    /// Claimed, its request running (or its lease run out, not yet looked at).
    InProgress,
    /// Its outcome is stored.
    Completed,
    /// Forwarded, and its outcome never seen.
    Unknown,
}

impl RecordState {
    pub const ALL: [Self; 3] = [Self::InProgress, Self::Completed, Self::Unknown];

    /// The name in the database and on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Unknown => "unknown",
        }
    }
}

/// A state name that is none of [`RecordState`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown record state `{0}`")]
pub struct UnknownRecordState(pub String);

impl std::str::FromStr for RecordState {
    type Err = UnknownRecordState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| UnknownRecordState(s.to_owned()))
    }
}

impl TryFrom<String> for RecordState {
    type Error = UnknownRecordState;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// What a complete, release or unknown mark left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum WriteState {
    Completed,
    /// The record is gone: the key is free.
    Released,
    Unknown,
}

/// Answer to complete and release: what the record is now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WriteResponse {
    pub state: WriteState,
    /// For `completed`: milliseconds until the record's retention expiry, by the database
    /// clock (absent for `released`, and from state APIs older than this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<u64>,
}

impl WriteResponse {
    pub fn completed(expires_in_ms: u64) -> Self {
        Self {
            state: WriteState::Completed,
            expires_in_ms: Some(expires_in_ms),
        }
    }

    pub fn released() -> Self {
        Self {
            state: WriteState::Released,
            expires_in_ms: None,
        }
    }

    pub fn unknown() -> Self {
        Self {
            state: WriteState::Unknown,
            expires_in_ms: None,
        }
    }
}

/// Operator view of one record: never the stored body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RecordView {
    pub state: RecordState,
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
    /// In progress or unknown: milliseconds since its owner was last heard from (its claim, a
    /// heartbeat, its own unknown mark). Within `lease_ms` of it its request may still run, and
    /// an operator's action needs `force`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_seen_ms_ago: Option<u64>,
    /// The owner's lease (what "within a lease" counts).
    #[serde(default)]
    pub lease_ms: u64,
}

/// Why an answer could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AnswerError(pub String);

impl From<json::Error> for AnswerError {
    fn from(e: json::Error) -> Self {
        Self(e.to_string())
    }
}

impl From<String> for AnswerError {
    fn from(e: String) -> Self {
        Self(e)
    }
}

mod read;

#[cfg(test)]
mod tests;
