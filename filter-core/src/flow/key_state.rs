//! Asking about a key instead of sending the request again (issue 48): `GET <key_state_path>
//! ?method=POST&path=/checkout` with the `Idempotency-Key` and the caller's credentials. The
//! filter reads the record of (key, the caller's subject, that endpoint) from the state API
//! (`GET /v1/records`, never its body) and answers with the members a problem document carries
//! (`key_state`, `retry_same_key`, `new_key_safe`), what it completed with and how long it is
//! kept. Nothing is forwarded, nothing is claimed: the key stays as it was.

use super::request::{subject_of, RequestHead};
use super::{Call, Flow, State, Turn};
use crate::config::{Config, OnUnknown};
use crate::effect::{CalloutResult, Level};
use crate::headers::{expires_in, EXPIRES_HEADER};
use crate::key::{self, parse_key_header};
use crate::metrics::Metric;
use crate::reply::{self, LocalReply};
use crate::route_table::RouteTable;
use contract::json::{self, Fields, Value};
use contract::wire::{NO_RECORD_HEADER, NO_RECORD_VALUE, RECORDS_PATH};
use contract::ProblemKind;

/// What the answer says of a key, in the problem documents' words.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KeyStateAnswer {
    /// `in_progress`, `completed`, `unknown`, `expired` (kept past its retention, not yet
    /// purged: the edge no longer protects it), or `absent` (no record: never used, released,
    /// or expired and purged).
    pub key_state: &'static str,
    /// Whether the same request with the same key can succeed later: it gets the stored
    /// answer, runs once, or is reconciled; `false` where it would be held or refused.
    pub retry_same_key: bool,
    /// Never true here: only a key that could not be used says a new one is safe.
    pub new_key_safe: bool,
    /// The endpoint asked about.
    pub endpoint: String,
    /// The status the request completed with, when it completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Whether its response is stored to replay, when it completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replayable: Option<bool>,
    /// Seconds the record is still kept, when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_in_s: Option<u64>,
}

/// The `method` and `path` query parameters (percent-decoded).
fn endpoint_of(query: &str) -> Option<(String, String)> {
    let mut method = None;
    let mut path = None;
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        match name.as_ref() {
            "method" => method = Some(value.into_owned()),
            "path" => path = Some(value.into_owned()),
            _ => {}
        }
    }
    Some((method?.to_ascii_uppercase(), path?))
}

impl Flow {
    /// A `GET` on the key state path: checked as a protected request is (subject, key), then the
    /// state API asked.
    pub(super) fn ask_key_state(
        &mut self,
        cfg: &Config,
        routes: &RouteTable,
        head: &RequestHead<'_>,
        query: &str,
        end_of_stream: bool,
    ) -> Turn {
        if !end_of_stream {
            // Answered at its headers: a body would be left for Envoy to forward.
            return self.reply(
                None,
                LocalReply::problem(
                    ProblemKind::BadRequest,
                    "a question about a key has no body",
                ),
            );
        }
        let Some(subject) = subject_of(cfg, head) else {
            return self.reply(
                Some(Metric::Unauthenticated401),
                LocalReply::problem(
                    ProblemKind::Unauthenticated,
                    "asking about a key needs the same credentials as the request",
                ),
            );
        };
        let key = match parse_key_header(&head.values(key::HEADER)) {
            Ok(Some(k)) => k,
            Ok(None) => {
                return self.reply(
                    Some(Metric::BadKey400),
                    LocalReply::problem(
                        ProblemKind::MissingKey,
                        "asking about a key needs its Idempotency-Key header",
                    ),
                )
            }
            Err(e) => {
                return self.reply(
                    Some(Metric::BadKey400),
                    LocalReply::problem(ProblemKind::InvalidKey, e.to_string()),
                )
            }
        };
        let Some((method, path)) = endpoint_of(query) else {
            return self.reply(
                None,
                LocalReply::problem(
                    ProblemKind::BadRequest,
                    "name the request asked about: ?method=POST&path=/checkout",
                ),
            );
        };
        let Some(route) = routes.find(&method, &path) else {
            return self.reply(
                None,
                LocalReply::problem(
                    ProblemKind::BadRequest,
                    format!("{method} {path} is not a protected endpoint"),
                ),
            );
        };
        let endpoint = format!("{method} {path}");
        if !contract::limits::valid_field(&endpoint) {
            // Control characters, or longer than a record holds: no record has it.
            return self.reply(
                None,
                LocalReply::problem(
                    ProblemKind::BadRequest,
                    "the path asked about is not one a protected request can have",
                ),
            );
        }
        if endpoint.len() > contract::limits::MAX_FIELD_LEN {
            return self.endpoint_too_long();
        }
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("namespace", &cfg.namespace)
            .append_pair("key", &key)
            .append_pair("subject", &subject)
            .append_pair("endpoint", &endpoint)
            .finish();
        self.state = State::AskingAboutKey { route, endpoint };
        Turn::pause().with(Call::KeyState {
            path: format!("{RECORDS_PATH}?{query}"),
        })
    }

    /// The state API's read of the record: the answer.
    pub fn on_key_state_answer(&mut self, cfg: &Config, answer: CalloutResult) -> Turn {
        let State::AskingAboutKey { route, endpoint } = self.take() else {
            return Turn::cont().with(Flow::log(
                Level::Warn,
                "key state answer in an unexpected state".into(),
            ));
        };
        let read = match &answer {
            CalloutResult::Response {
                status: 200, body, ..
            } => json::parse(body)
                .ok()
                .filter(|v| state_of(fields_of(v)).is_some()),
            // No record, said so by the state API itself; any other 404 is an outage.
            CalloutResult::Response { status: 404, .. }
                if answer
                    .header(NO_RECORD_HEADER)
                    .is_some_and(|v| v.trim() == NO_RECORD_VALUE) =>
            {
                Some(Value::Null)
            }
            CalloutResult::Response { status: 404, .. } => None,
            CalloutResult::Response { status, .. } if (400..500).contains(status) => {
                // The question was refused (a contract error, not an outage).
                let log = Flow::log(
                    Level::Error,
                    format!(
                        "the state API refused a key question about {endpoint} with HTTP {status}"
                    ),
                );
                return self
                    .reply(
                        None,
                        LocalReply::problem(
                            ProblemKind::Internal,
                            "the idempotency store refused the question",
                        ),
                    )
                    .with(log);
            }
            _ => None,
        };
        let Some(record) = read else {
            let log = Flow::log(
                Level::Warn,
                format!(
                    "asking the state API about a key of {endpoint} failed: {}",
                    answer.describe()
                ),
            );
            return self
                .reply(Some(Metric::StateApiErrors), reply::state_unavailable())
                .with(log);
        };
        let held = cfg
            .routes
            .get(route)
            .is_none_or(|r| r.on_unknown == OnUnknown::Hold);
        let said = key_state_of(&record, endpoint, held);
        let mut r = LocalReply {
            status: 200,
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("cache-control".into(), "no-store".into()),
            ],
            body: serde_json::to_vec(&said).unwrap_or_default(),
            reason: "idempotency_key_state",
        };
        if let Some(s) = said.expires_in_s {
            r = r.with_header(EXPIRES_HEADER, expires_in(s.saturating_mul(1_000)));
        }
        self.reply(None, r)
    }
}

/// The members of the record the state API read (`None`: no record). Read with the module's
/// own JSON reader: serde_json's `Value` deserializer took 20,525 bytes of the module. It reads
/// integers only: a float member added to the record view would make every answer 503 (the
/// test below writes each kind of record with the state API's own type).
fn fields_of(record: &Value) -> Option<Fields<'_>> {
    Fields::of(record, "the record").ok()
}

/// The record's `state` (`None`: no record, or none a string).
fn state_of(fields: Option<Fields<'_>>) -> Option<&str> {
    fields.and_then(|f| f.opt_str("state").ok().flatten())
}

/// The answer for the record the state API read (`Null`: none), on a route that holds
/// (`held`) or settles its unknown outcomes.
fn key_state_of(record: &Value, endpoint: String, held: bool) -> KeyStateAnswer {
    let fields = fields_of(record);
    let u64_of = |name: &str| fields.and_then(|f| f.opt_u64(name).ok().flatten());
    let state = state_of(fields);
    let replayable = fields.and_then(|f| f.opt_bool("replayable").ok().flatten());
    let expired = u64_of("expires_in_ms") == Some(0);
    let lease_over = u64_of("lease_remaining_ms") == Some(0);
    let (key_state, retry_same_key) = match state {
        None => ("absent", true),
        // A claim takes such a record as new: a retry would run it again. Never one in
        // progress: past its retention, a claim (or the purge) marks it unknown instead.
        Some(s) if expired && s != "in_progress" => ("expired", false),
        // Its owner is no longer heard from: the next claim marks it unknown.
        Some("in_progress") if lease_over => ("unknown", !held),
        Some("in_progress") => ("in_progress", true),
        // A replay, or 409 outcome-not-replayable: it will not run again.
        Some("completed") => ("completed", replayable == Some(true)),
        // Held until an operator resolves it, or reconciled / re-run by the route.
        Some(_) => ("unknown", !held),
    };
    let completed = key_state == "completed";
    KeyStateAnswer {
        key_state,
        retry_same_key,
        new_key_safe: false,
        endpoint,
        status: u64_of("response_status")
            .filter(|_| completed)
            .and_then(|s| u16::try_from(s).ok()),
        replayable: replayable.filter(|_| completed),
        expires_in_s: state.and(u64_of("expires_in_ms")).map(|ms| ms / 1_000),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn json(document: &str) -> Value {
        json::parse(document.as_bytes()).unwrap()
    }

    #[test]
    fn the_query_names_the_endpoint_percent_decoded() {
        assert_eq!(
            endpoint_of("method=post&path=%2Fcheckout"),
            Some(("POST".into(), "/checkout".into()))
        );
        assert_eq!(endpoint_of("path=/checkout"), None);
        assert_eq!(endpoint_of(""), None);
    }

    #[test]
    fn each_record_state_says_what_a_retry_gets() {
        let e = || "POST /checkout".to_owned();
        let absent = key_state_of(&Value::Null, e(), true);
        assert_eq!((absent.key_state, absent.retry_same_key), ("absent", true));
        assert_eq!(absent.expires_in_s, None);
        let done = json(
            r#"{"state": "completed", "response_status": 201, "replayable": true, "expires_in_ms": 86399999}"#,
        );
        let done = key_state_of(&done, e(), true);
        assert_eq!(
            (
                done.key_state,
                done.retry_same_key,
                done.status,
                done.expires_in_s
            ),
            ("completed", true, Some(201), Some(86_399))
        );
        let lost = json(
            r#"{"state": "completed", "response_status": 201, "replayable": false, "expires_in_ms": 5}"#,
        );
        assert!(!key_state_of(&lost, e(), true).retry_same_key);
        let unknown = json(r#"{"state": "unknown", "expires_in_ms": 1000}"#);
        assert!(!key_state_of(&unknown, e(), true).retry_same_key, "held");
        assert!(
            key_state_of(&unknown, e(), false).retry_same_key,
            "reconciled"
        );
        let running =
            json(r#"{"state": "in_progress", "expires_in_ms": 1000, "lease_remaining_ms": 500}"#);
        let running = key_state_of(&running, e(), true);
        assert_eq!((running.key_state, running.status), ("in_progress", None));
        assert!(!running.new_key_safe);
        // Its owner gone (lease over): what the next claim makes of it.
        let lapsed =
            json(r#"{"state": "in_progress", "expires_in_ms": 1000, "lease_remaining_ms": 0}"#);
        let lapsed = key_state_of(&lapsed, e(), true);
        assert_eq!(
            (lapsed.key_state, lapsed.retry_same_key),
            ("unknown", false)
        );
        // In progress past its retention with its owner gone: unknown, not expired (the
        // state API never takes an in-progress record as expired).
        let stale =
            json(r#"{"state": "in_progress", "expires_in_ms": 0, "lease_remaining_ms": 0}"#);
        assert_eq!(key_state_of(&stale, e(), true).key_state, "unknown");
        let stale =
            json(r#"{"state": "in_progress", "expires_in_ms": 0, "lease_remaining_ms": 9}"#);
        assert_eq!(key_state_of(&stale, e(), true).key_state, "in_progress");
        // Past its retention, not yet purged: a retry would run it again.
        let expired = json(
            r#"{"state": "completed", "response_status": 201, "replayable": true, "expires_in_ms": 0}"#,
        );
        let expired = key_state_of(&expired, e(), true);
        assert_eq!(
            (expired.key_state, expired.retry_same_key),
            ("expired", false)
        );
    }

    /// Every kind of record as the state API writes it (its own type, serde, nulls and all)
    /// reads as it means: the reader and the record view cannot drift apart unseen.
    #[test]
    fn records_as_the_state_api_writes_them() {
        use contract::wire::{RecordState, RecordView};
        let view = |state, status: Option<u16>, replayable, lease_remaining_ms, owner_seen| {
            let v = RecordView {
                state,
                subject: "user-\"1\"\u{e9}".into(),
                endpoint: "POST /checkout".into(),
                fingerprint_alg: "sha256-canonical-json-v1".into(),
                token: i64::MIN,
                lease_remaining_ms,
                age_ms: u64::MAX,
                completed_age_ms: status.map(|_| 7),
                response_status: status,
                replayable,
                expires_in_ms: 86_400_000,
                owner_seen_ms_ago: owner_seen,
                lease_ms: 30_000,
            };
            json::parse(&serde_json::to_vec(&v).unwrap()).unwrap()
        };
        let e = || "POST /checkout".to_owned();
        let running = key_state_of(
            &view(RecordState::InProgress, None, None, 500, Some(3)),
            e(),
            true,
        );
        assert_eq!(
            (running.key_state, running.retry_same_key, running.status),
            ("in_progress", true, None)
        );
        assert_eq!(running.replayable, None);
        let done = key_state_of(
            &view(RecordState::Completed, Some(201), Some(true), 0, None),
            e(),
            true,
        );
        assert_eq!(
            (
                done.key_state,
                done.retry_same_key,
                done.status,
                done.replayable
            ),
            ("completed", true, Some(201), Some(true))
        );
        assert_eq!(done.expires_in_s, Some(86_400));
        let unknown = key_state_of(
            &view(RecordState::Unknown, None, None, 0, Some(40_000)),
            e(),
            true,
        );
        assert_eq!(
            (unknown.key_state, unknown.retry_same_key),
            ("unknown", false)
        );
    }
}
