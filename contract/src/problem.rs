//! RFC 9457 problem documents: every answer the filter or the state API makes itself.

use serde::{Deserialize, Serialize};

pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Every kind of problem this project answers with. The `type` URI is relative
/// (`/problems/<slug>`); each has its page at `docs/problems/<slug>/index.md`, which the docs
/// site serves at that URI (`edge docs` fails while one is missing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    /// A protected route requires a key and none was sent.
    MissingKey,
    /// The Idempotency-Key header is malformed (empty, too long, a list, sent twice, ...).
    InvalidKey,
    /// A JSON object in the body has the same member twice: two parsers could read it differently.
    DuplicateJsonMember,
    /// Any other malformed request (state API: bad field values).
    BadRequest,
    /// No authenticated subject (filter), or a wrong bearer token (state API).
    Unauthenticated,
    /// Request body or stored response body over the configured limit.
    PayloadTooLarge,
    /// The method and path of a protected request are longer than a record can hold.
    EndpointTooLong,
    /// The key is held by a request that is still running.
    InProgress,
    /// The key was used before with a different request.
    KeyReuseMismatch,
    /// The first request completed but its response was too large to keep: it will not run again.
    OutcomeNotReplayable,
    /// The first request was forwarded and its outcome never seen: held until resolved.
    OutcomeUnknown,
    /// The upstream could not tell what became of an earlier attempt: nothing was forwarded.
    ReconcileUnavailable,
    /// A write by an owner whose lease was taken over by a newer claim.
    FencedOut,
    /// A heartbeat of an owner whose record is marked unknown (by itself, a claim that found
    /// its lease run out, or the purge): a mark outranks every heartbeat sent before it. The
    /// owner's outcome is still accepted (`complete` with its token).
    LeaseEnded,
    /// The record asked for does not exist.
    NotFound,
    /// The route exists, not with this method (state API).
    MethodNotAllowed,
    /// The caller is known but may not do this (the filter's token on the admin API).
    Forbidden,
    /// An operator action on a record whose owner's lease is still live (`force` overrides).
    LeaseLive,
    /// An operator resolve of a record that is already completed (`force` overrides).
    AlreadyCompleted,
    /// The state API (or its database) cannot be reached: nothing was forwarded.
    StateUnavailable,
    /// The edge holds as many request bodies as it may (the filter's `max_buffered_bytes`):
    /// nothing was forwarded or claimed.
    BuffersFull,
    /// An unexpected failure inside the state API.
    Internal,
}

impl ProblemKind {
    /// The kinds the edge answers its clients with (each says what a client can do about it:
    /// [`Self::retry_same_key`], [`Self::new_key_safe`]); the others are the state API's own.
    pub const EDGE: [ProblemKind; 15] = [
        Self::MissingKey,
        Self::InvalidKey,
        Self::DuplicateJsonMember,
        Self::BadRequest,
        Self::Unauthenticated,
        Self::PayloadTooLarge,
        Self::EndpointTooLong,
        Self::InProgress,
        Self::KeyReuseMismatch,
        Self::OutcomeNotReplayable,
        Self::OutcomeUnknown,
        Self::ReconcileUnavailable,
        Self::StateUnavailable,
        Self::BuffersFull,
        Self::Internal,
    ];

    pub const fn status(self) -> u16 {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::DuplicateJsonMember | Self::BadRequest => {
                400
            }
            Self::Unauthenticated => 401,
            Self::Forbidden => 403,
            Self::NotFound => 404,
            Self::MethodNotAllowed => 405,
            Self::InProgress
            | Self::FencedOut
            | Self::LeaseEnded
            | Self::OutcomeNotReplayable
            | Self::OutcomeUnknown
            | Self::LeaseLive
            | Self::AlreadyCompleted => 409,
            Self::PayloadTooLarge => 413,
            Self::EndpointTooLong => 414,
            Self::KeyReuseMismatch => 422,
            Self::Internal => 500,
            Self::StateUnavailable | Self::ReconcileUnavailable | Self::BuffersFull => 503,
        }
    }

    pub const fn slug(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-idempotency-key",
            Self::InvalidKey => "invalid-idempotency-key",
            Self::DuplicateJsonMember => "duplicate-json-member",
            Self::BadRequest => "bad-request",
            Self::Unauthenticated => "unauthenticated",
            Self::PayloadTooLarge => "payload-too-large",
            Self::EndpointTooLong => "endpoint-too-long",
            Self::InProgress => "request-in-progress",
            Self::KeyReuseMismatch => "idempotency-key-reused",
            Self::OutcomeNotReplayable => "outcome-not-replayable",
            Self::OutcomeUnknown => "outcome-unknown",
            Self::ReconcileUnavailable => "reconcile-unavailable",
            Self::FencedOut => "fenced-out",
            Self::LeaseEnded => "lease-ended",
            Self::NotFound => "not-found",
            Self::MethodNotAllowed => "method-not-allowed",
            Self::Forbidden => "forbidden",
            Self::LeaseLive => "lease-live",
            Self::AlreadyCompleted => "already-completed",
            Self::StateUnavailable => "idempotency-state-unavailable",
            Self::BuffersFull => "edge-buffers-full",
            Self::Internal => "internal-error",
        }
    }

    pub const fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "An Idempotency-Key header is required",
            Self::InvalidKey => "The Idempotency-Key header is invalid",
            Self::DuplicateJsonMember => "The JSON body has a duplicate member",
            Self::BadRequest => "The request is invalid",
            Self::Unauthenticated => "Authentication is required",
            Self::PayloadTooLarge => "The payload is too large",
            Self::EndpointTooLong => "The request path is too long to protect",
            Self::InProgress => "A request with this key is still being processed",
            Self::KeyReuseMismatch => "The key was already used for a different request",
            Self::OutcomeNotReplayable => {
                "The request completed but its response cannot be replayed"
            }
            Self::OutcomeUnknown => "The outcome of the request with this key is unknown",
            Self::ReconcileUnavailable => {
                "The outcome of an earlier attempt with this key could not be checked"
            }
            Self::FencedOut => "The claim was taken over by a newer owner",
            Self::LeaseEnded => {
                "The claim's outcome was marked unknown: its lease cannot be extended"
            }
            Self::NotFound => "No such record",
            Self::MethodNotAllowed => "Method not allowed on this route",
            Self::Forbidden => "This credential may not do that",
            Self::LeaseLive => "The record's owner still holds a live lease",
            Self::AlreadyCompleted => "The record is already completed",
            Self::StateUnavailable => "Idempotency state is unavailable",
            Self::BuffersFull => "The edge holds as many request bodies as it may",
            Self::Internal => "Internal error",
        }
    }

    /// What a client can do about this answer (the edge's answers only; `None` for the state
    /// API's own, which only the filter reads, and for the edge's 500, whose causes differ, so
    /// the SDK's own rule applies): whether the same request with the same key can succeed
    /// later (`x-should-retry`, `Stripe-Should-Retry`). A retry under the same key never runs
    /// twice at this edge.
    pub const fn retry_same_key(self) -> Option<bool> {
        match self {
            // Once the first request ends, or the store or the edge can take it: retry.
            Self::InProgress
            | Self::StateUnavailable
            | Self::ReconcileUnavailable
            | Self::BuffersFull => Some(true),
            // The same request under the same key gets the same answer.
            Self::MissingKey
            | Self::InvalidKey
            | Self::DuplicateJsonMember
            | Self::BadRequest
            | Self::Unauthenticated
            | Self::PayloadTooLarge
            | Self::EndpointTooLong
            | Self::KeyReuseMismatch
            | Self::OutcomeNotReplayable
            | Self::OutcomeUnknown => Some(false),
            Self::Internal
            | Self::FencedOut
            | Self::LeaseEnded
            | Self::NotFound
            | Self::MethodNotAllowed
            | Self::Forbidden
            | Self::LeaseLive
            | Self::AlreadyCompleted => None,
        }
    }

    /// Whether sending the request again under a *new* key cannot run it twice: true only
    /// where the request never had a usable key (missing or malformed), so nothing can have
    /// run under it. Any other refusal says nothing of an earlier attempt under the same key
    /// (a 401 after the token expired, a 413 or 422 after the body changed between retries),
    /// so a new key may run that attempt's operation again: false.
    pub const fn new_key_safe(self) -> Option<bool> {
        match self {
            Self::MissingKey | Self::InvalidKey => Some(true),
            Self::DuplicateJsonMember
            | Self::BadRequest
            | Self::Unauthenticated
            | Self::PayloadTooLarge
            | Self::EndpointTooLong
            | Self::KeyReuseMismatch
            | Self::InProgress
            | Self::OutcomeUnknown
            | Self::OutcomeNotReplayable
            | Self::ReconcileUnavailable
            | Self::StateUnavailable
            | Self::BuffersFull
            | Self::Internal => Some(false),
            Self::FencedOut
            | Self::LeaseEnded
            | Self::NotFound
            | Self::MethodNotAllowed
            | Self::Forbidden
            | Self::LeaseLive
            | Self::AlreadyCompleted => None,
        }
    }

    /// The key's state as the answer knows it (`key_state`): `in_progress`, `unknown`,
    /// `completed`, `mismatch`; `None` where the answer does not know it.
    pub const fn key_state(self) -> Option<&'static str> {
        match self {
            Self::InProgress => Some("in_progress"),
            Self::OutcomeUnknown | Self::ReconcileUnavailable => Some("unknown"),
            Self::OutcomeNotReplayable => Some("completed"),
            Self::KeyReuseMismatch => Some("mismatch"),
            _ => None,
        }
    }

    /// What a client should do next, in words (the end of the Stripe-shaped `error.message`
    /// an SDK raises): follows from [`Self::retry_same_key`] and [`Self::new_key_safe`].
    pub const fn advice(self) -> &'static str {
        match self {
            Self::InProgress => {
                "Retry with the same key after Retry-After: this edge will not run it twice."
            }
            Self::StateUnavailable | Self::ReconcileUnavailable | Self::BuffersFull => {
                "Nothing was forwarded: retry with the same key after Retry-After."
            }
            Self::MissingKey | Self::InvalidKey => {
                "Nothing ran: send it again with a valid Idempotency-Key, the same one as any \
                 earlier attempt of this operation."
            }
            Self::OutcomeUnknown => {
                "Retrying will not help until it is resolved, and a new key may charge twice: \
                 ask the service's support about this Idempotency-Key."
            }
            Self::OutcomeNotReplayable => {
                "It ran once and will not run again: look up its result instead of retrying."
            }
            Self::KeyReuseMismatch => {
                "Send the original request to get its result; a different request needs its own key, \
                 once you know the first did not do what this one asks."
            }
            Self::DuplicateJsonMember
            | Self::BadRequest
            | Self::Unauthenticated
            | Self::PayloadTooLarge
            | Self::EndpointTooLong => {
                "This request was refused as sent: fix it before sending it again; \
                 an earlier attempt under this key, if any, stands."
            }
            Self::Internal => {
                "The edge failed; a retry with the same key is not run twice at this edge."
            }
            Self::FencedOut
            | Self::LeaseEnded
            | Self::NotFound
            | Self::MethodNotAllowed
            | Self::Forbidden
            | Self::LeaseLive
            | Self::AlreadyCompleted => "",
        }
    }

    /// The `type` of the Stripe-shaped `error` member (Stripe's SDKs pick the exception from
    /// it and the status): `idempotency_error` for what the key's state decides, `api_error`
    /// for the edge's 5xx, `invalid_request_error` for the rest.
    pub const fn stripe_error_type(self) -> &'static str {
        match self {
            Self::InProgress
            | Self::KeyReuseMismatch
            | Self::OutcomeNotReplayable
            | Self::OutcomeUnknown => "idempotency_error",
            Self::StateUnavailable
            | Self::ReconcileUnavailable
            | Self::BuffersFull
            | Self::Internal => "api_error",
            _ => "invalid_request_error",
        }
    }

    pub fn type_uri(self) -> String {
        format!("/problems/{}", self.slug())
    }

    /// Whether a problem document (as received) is of this kind: its `type` member's value
    /// appears in it, quoted. No JSON reader needed (the filter checks answers this way).
    pub fn names(self, document: &[u8]) -> bool {
        let wanted = format!("\"/problems/{}\"", self.slug());
        document
            .windows(wanted.len())
            .any(|w| w == wanted.as_bytes())
    }
}

/// The problem document itself: RFC 9457's members, and on the edge's answers to clients
/// (`Problem::for_client`) three extension members a client can act on (issue 48).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Problem {
    #[serde(rename = "type")]
    pub type_uri: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// The key's state as this answer knows it: `in_progress`, `unknown`, `completed`,
    /// `mismatch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_state: Option<String>,
    /// Whether the same request under the same key can succeed later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_same_key: Option<bool>,
    /// Whether the request sent under a new key cannot run twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_key_safe: Option<bool>,
    /// The same answer in the shape Stripe's SDKs read (`{"error": {"type", "code",
    /// "message"}}`): without it they raise "Invalid response object from API" and drop the
    /// edge's words.
    /// Boxed: only the edge's answers carry it, and the state API's errors stay small.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Box<ClientError>>,
}

/// The `error` member of an edge's problem document: Stripe's error object's members.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClientError {
    /// `idempotency_error`, `api_error` or `invalid_request_error`.
    #[serde(rename = "type")]
    pub error_type: String,
    /// The problem's slug with underscores (`outcome_unknown`).
    pub code: String,
    /// The title, the detail and what to do next, in one sentence an SDK shows as it is.
    pub message: String,
}

impl ClientError {
    fn new(kind: ProblemKind, detail: &str) -> Self {
        let advice = kind.advice();
        let message = if advice.is_empty() {
            format!("{}: {detail}.", kind.title())
        } else {
            format!("{}: {detail}. {advice}", kind.title())
        };
        Self {
            error_type: kind.stripe_error_type().to_owned(),
            code: kind.slug().replace('-', "_"),
            message,
        }
    }
}

impl Problem {
    /// A document with RFC 9457's members only (the state API's answers to the filter).
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            type_uri: kind.type_uri(),
            title: kind.title().to_owned(),
            status: kind.status(),
            detail: detail.into(),
            key_state: None,
            retry_same_key: None,
            new_key_safe: None,
            error: None,
        }
    }

    /// A document for a client of the edge: with what it can do about it.
    pub fn for_client(kind: ProblemKind, detail: impl Into<String>) -> Self {
        let detail = detail.into();
        Self {
            key_state: kind.key_state().map(str::to_owned),
            retry_same_key: kind.retry_same_key(),
            new_key_safe: kind.new_key_safe(),
            error: Some(Box::new(ClientError::new(kind, &detail))),
            ..Self::new(kind, detail)
        }
    }

    /// Serialized document. Serializing strings, a number and booleans cannot fail; the fallback
    /// keeps the filter free of `unwrap`.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_names_its_own_kind_only() {
        let doc = Problem::new(ProblemKind::LeaseEnded, "marked").to_json();
        assert!(ProblemKind::LeaseEnded.names(&doc));
        assert!(!ProblemKind::FencedOut.names(&doc));
        assert!(!ProblemKind::LeaseEnded.names(b"{}"));
    }

    #[test]
    fn problem_document_has_rfc9457_members() {
        let p = Problem::new(ProblemKind::InProgress, "retry later");
        let v: serde_json::Value = serde_json::from_slice(&p.to_json()).unwrap_or_default();
        assert_eq!(v["type"], "/problems/request-in-progress");
        assert_eq!(v["status"], 409);
        assert_eq!(v["title"], ProblemKind::InProgress.title());
        assert_eq!(v["detail"], "retry later");
        assert!(
            v.get("retry_same_key").is_none(),
            "the state API's documents keep RFC 9457's members only"
        );
    }

    #[test]
    fn every_kind_the_edge_answers_with_says_what_a_client_can_do() {
        use ProblemKind::*;
        for kind in ProblemKind::EDGE {
            // The edge's 500 leaves the SDK's own rule (its causes differ).
            assert_eq!(
                kind.retry_same_key().is_none(),
                kind == Internal,
                "{kind:?}"
            );
            assert!(kind.new_key_safe().is_some(), "{kind:?}");
            // Never both: a retry that may help means something under the key may run.
            assert!(
                !(kind.retry_same_key() == Some(true) && kind.new_key_safe() == Some(true)),
                "{kind:?}"
            );
        }
        // 5xx and an in-flight 409 are retried; a held unknown outcome is not.
        assert_eq!(OutcomeUnknown.retry_same_key(), Some(false));
        assert_eq!(OutcomeUnknown.new_key_safe(), Some(false));
        // A refusal of this attempt says nothing of an earlier one under the key.
        for kind in [
            Unauthenticated,
            PayloadTooLarge,
            KeyReuseMismatch,
            BadRequest,
        ] {
            assert_eq!(kind.new_key_safe(), Some(false), "{kind:?}");
        }
    }

    #[test]
    fn an_edge_document_carries_the_error_member_stripe_sdks_raise() {
        for kind in ProblemKind::EDGE {
            let doc = Problem::for_client(kind, "the detail").to_json();
            let v: serde_json::Value = serde_json::from_slice(&doc).unwrap_or_default();
            let error = &v["error"];
            assert_eq!(error["type"], kind.stripe_error_type(), "{kind:?}");
            assert_eq!(error["code"], kind.slug().replace('-', "_"), "{kind:?}");
            let message = error["message"].as_str().unwrap_or_default();
            assert!(message.contains("the detail"), "{message}");
            assert!(message.starts_with(kind.title()), "{message}");
            assert!(
                !kind.advice().is_empty() && message.ends_with(kind.advice()),
                "{message}"
            );
        }
        let unknown = Problem::for_client(ProblemKind::OutcomeUnknown, "held");
        let message = unknown.error.map(|e| e.message).unwrap_or_default();
        assert!(
            message.contains("unknown") && message.contains("support"),
            "{message}"
        );
        // The state API's own documents keep RFC 9457's members only.
        assert!(Problem::new(ProblemKind::OutcomeUnknown, "held")
            .error
            .is_none());
    }
}
