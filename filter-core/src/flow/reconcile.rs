//! Reconciling: a retry took over a record whose outcome was unknown (forwarded, never stored)
//! on an `on_unknown: reconcile` route, with a new, larger fencing token. Before anything runs,
//! the upstream is asked what became of *this request* (the route's `reconcile` endpoint, with
//! the key, the subject, the new token, the endpoint and the request's fingerprint as headers:
//! the request is forwarded with the same endpoint and fingerprint, so the upstream recorded its
//! attempts by them), and tells by its `idempotency-outcome` header:
//!
//! * `executed`: the answer *is* the outcome an earlier attempt of this request produced
//!   (status, headers, body). It is stored and replayed to this client only when it names that
//!   attempt: its fencing token, lower than the new one, and the subject, key, endpoint and
//!   fingerprint it was recorded with, which must be this request's. An answer about another
//!   request (a prefix route's other path, a record reused past its retention by another body,
//!   another subject's request under the same key, which the fingerprint does not tell apart)
//!   or about no attempt in particular is not stored: 503, as below. It is not taken for
//!   `not-executed` either: only that answer promises to refuse the earlier attempts of this
//!   request from now on, which is what makes running it safe;
//! * `running`: the earlier attempt is still at work: 409 + Retry-After;
//! * `not-executed`: it never ran, and now refuses the earlier attempt (its token is smaller):
//!   the request runs, once, with the new token;
//! * anything else, or no answer: 503 + Retry-After, nothing forwarded.
//!
//! In the last three cases the record is marked unknown again (by the worker: the stream ends
//! with its answer), so the next retry asks again.

use super::response::{capture_of, outcome, stored_body_limit};
use super::{mark_unknown, Call, Claimed, Flow, Note, State, Turn, Write};
use crate::config::Config;
use crate::effect::{CalloutResult, Effect, Level};
use crate::key;
use crate::metrics::Metric;
use crate::reply::{self, LocalReply};
use contract::wire::{
    ENDPOINT_HEADER, FENCING_TOKEN_HEADER, FINGERPRINT_HEADER, OUTCOME_EXECUTED, OUTCOME_HEADER,
    OUTCOME_NOT_EXECUTED, OUTCOME_RUNNING, SUBJECT_HEADER,
};
use contract::ProblemKind;

impl Flow {
    /// Asks the route's reconcile endpoint about the key (the claim is registered: its lease is
    /// kept while the upstream answers).
    pub(super) fn reconcile(&mut self, cfg: &Config, claimed: Claimed) -> Turn {
        let Some(rc) = cfg
            .routes
            .get(claimed.req.req.route)
            .and_then(|r| r.reconcile.as_ref())
        else {
            // A reconcile route always has its endpoint (the configuration checks).
            return self.unverifiable(claimed, "no reconcile endpoint".into());
        };
        let req = &claimed.req.req;
        let mut headers = vec![
            (":method".to_owned(), rc.method.clone()),
            (":path".to_owned(), rc.path_for(&req.key)),
            (":authority".to_owned(), rc.authority.clone()),
            ("idempotency-key".to_owned(), req.key.clone()),
            (FENCING_TOKEN_HEADER.to_owned(), claimed.token.to_string()),
            (SUBJECT_HEADER.to_owned(), req.subject.clone()),
            (ENDPOINT_HEADER.to_owned(), req.endpoint.clone()),
            (
                FINGERPRINT_HEADER.to_owned(),
                claimed.req.fingerprint.hex.clone(),
            ),
        ];
        if let crate::config::SubjectSource::Header(h) = &cfg.subject {
            headers.push((h.clone(), req.subject.clone()));
        }
        let call = Call::Reconcile {
            cluster: rc.cluster.clone(),
            headers,
            timeout_ms: rc.timeout_ms,
        };
        let register = claimed.register(cfg);
        self.state = State::Reconciling(claimed);
        Turn::pause().with(register).with(call)
    }

    /// The reconcile endpoint's answer (or its failure).
    pub fn on_reconcile_answer(&mut self, cfg: &Config, answer: CalloutResult) -> Turn {
        let State::Reconciling(claimed) = self.take() else {
            return Turn::cont().with(Flow::log(
                Level::Warn,
                "reconcile answer in an unexpected state".into(),
            ));
        };
        let said = answer.header(OUTCOME_HEADER).map(str::to_ascii_lowercase);
        match (&answer, said.as_deref()) {
            (
                CalloutResult::Response {
                    status,
                    headers,
                    body,
                },
                Some(OUTCOME_EXECUTED),
            ) => {
                let attempt = match earlier_attempt_of(headers, &claimed) {
                    Ok(token) => token,
                    Err(not_this) => {
                        let why = format!("its executed answer was not stored: {not_this}");
                        return self.unverifiable(claimed, why);
                    }
                };
                // The outcome of an earlier attempt of this request, as the upstream produced
                // it: stored, then replayed to this client.
                let cap = capture_of(cfg, *status, headers, body.len());
                let limit = stored_body_limit(cfg, &claimed);
                let kept = (body.len() <= limit).then(|| body.clone());
                let (write, record) = outcome(&claimed, cap, kept);
                let Write::Complete { body, fallback, .. } = &write else {
                    return Turn::pause();
                };
                let call = Call::Complete {
                    body: body.clone(),
                    fallback: fallback.clone(),
                    claim: claimed.held(),
                    record: Box::new(record),
                    first: false,
                };
                let log = claimed.unknown_log(
                    Level::Info,
                    format!(
                        "the upstream executed it (HTTP {status}, token {attempt}); stored and replayed"
                    ),
                );
                let write = match write {
                    Write::Complete {
                        body,
                        fallback,
                        attempts,
                        record,
                        ..
                    } => Write::Complete {
                        body,
                        fallback,
                        attempts,
                        record,
                        reply: true,
                    },
                    w => w,
                };
                self.state = State::Writing(claimed, write);
                Turn::pause()
                    .with(Effect::Count(Metric::ReconcileExecuted))
                    .with(log)
                    .with(call)
            }
            (CalloutResult::Response { .. }, Some(OUTCOME_RUNNING)) => {
                let retry_after = answer
                    .header("retry-after")
                    .and_then(|v| v.trim().parse::<u32>().ok())
                    .unwrap_or(1)
                    .clamp(1, 30);
                let log = claimed.unknown_log(Level::Info, "the upstream is still running it");
                let mark = mark_unknown(&claimed);
                self.reply(
                    Some(Metric::ReconcileRunning),
                    reply::in_progress(retry_after),
                )
                .with(log)
                .with(Note::Unregister(claimed.token))
                .with(mark)
            }
            (CalloutResult::Response { .. }, Some(OUTCOME_NOT_EXECUTED)) => {
                let log =
                    claimed.unknown_log(Level::Info, "the upstream never ran it; it runs now");
                self.forward_logged(cfg, claimed, log)
                    .with(Effect::Count(Metric::ReconcileNotExecuted))
            }
            _ => {
                let why = match said {
                    Some(other) => format!("{OUTCOME_HEADER}: {other:?}"),
                    None => answer.describe(),
                };
                self.unverifiable(claimed, why)
            }
        }
    }

    /// The upstream could not tell: 503, nothing forwarded, the record unknown again.
    fn unverifiable(&mut self, claimed: Claimed, why: String) -> Turn {
        let log = claimed.unknown_log(
            Level::Warn,
            format!("the reconcile endpoint did not tell ({why}); nothing forwarded"),
        );
        let mark = mark_unknown(&claimed);
        self.reply(
            Some(Metric::ReconcileFailed),
            LocalReply::problem(
                ProblemKind::ReconcileUnavailable,
                "what became of an earlier attempt with this key could not be checked; nothing was forwarded: retry later with the same key",
            )
            .with_header("retry-after", "1"),
        )
        .with(log)
        .with(Note::Unregister(claimed.token))
        .with(mark)
    }
}

/// Why an `executed` answer is not the outcome of an earlier attempt of this request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum NotThisRequest {
    /// It does not name the attempt it describes by one fencing token.
    NoAttempt,
    /// The attempt it names is not an earlier one: its token is not lower than the claim's.
    NotEarlier { named: i64 },
    /// It was recorded for another subject (or says none): another caller's request under the
    /// key. The other subject is not logged.
    OtherSubject { echoed: bool },
    /// It was recorded under another key (or says none). Neither key is logged.
    OtherKey { echoed: bool },
    /// It was recorded under another endpoint (or says none): another request of the key.
    OtherEndpoint(Option<String>),
    /// It was recorded with another fingerprint (or says none): another body, say. The value is
    /// not logged (a fingerprint confirms a guess of the body).
    OtherFingerprint { echoed: bool },
}

impl std::fmt::Display for NotThisRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoAttempt => write!(
                f,
                "it names no attempt (one {FENCING_TOKEN_HEADER} header, a positive number)"
            ),
            Self::NotEarlier { named } => {
                write!(
                    f,
                    "the attempt it names (token {named}) is not an earlier one"
                )
            }
            Self::OtherSubject { echoed: true } => {
                write!(f, "it describes another subject's request")
            }
            Self::OtherSubject { echoed: false } => {
                write!(f, "it does not echo the {SUBJECT_HEADER}")
            }
            Self::OtherKey { echoed: true } => {
                write!(f, "it describes a request under another key")
            }
            Self::OtherKey { echoed: false } => write!(f, "it does not echo the {}", key::HEADER),
            Self::OtherEndpoint(Some(other)) => {
                write!(f, "it describes a request to another endpoint ({other})")
            }
            Self::OtherEndpoint(None) => write!(f, "it does not echo the {ENDPOINT_HEADER}"),
            Self::OtherFingerprint { echoed: true } => {
                write!(f, "it describes another request (another fingerprint)")
            }
            Self::OtherFingerprint { echoed: false } => {
                write!(f, "it does not echo the {FINGERPRINT_HEADER}")
            }
        }
    }
}

/// The one value of header `name`, if it appears exactly once.
fn single<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    let mut values = headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim());
    match (values.next(), values.next()) {
        (Some(v), None) => Some(v),
        _ => None,
    }
}

/// The token of the attempt an `executed` answer describes, when that attempt is an earlier one
/// of this very request: named by a token lower than the claim's, recorded with this request's
/// subject, key, endpoint and fingerprint (echoed by the upstream). An answer that leaves one
/// out (an upstream older than the echo of the subject and key) names no request in particular
/// and is not proof either.
fn earlier_attempt_of(
    headers: &[(String, String)],
    claimed: &Claimed,
) -> Result<i64, NotThisRequest> {
    let named = single(headers, FENCING_TOKEN_HEADER)
        .and_then(|v| v.parse::<i64>().ok())
        .filter(|t| *t > 0)
        .ok_or(NotThisRequest::NoAttempt)?;
    if named >= claimed.token {
        return Err(NotThisRequest::NotEarlier { named });
    }
    // Issue 46, finding 6: the fingerprint does not cover the subject, and the key was only the
    // reconcile path's last segment, so an upstream that looked the attempt up by endpoint and
    // fingerprint alone could answer with another caller's execution under the same key.
    if !contract::undo::undone(contract::undo::Fix::ReconcileScope) {
        let subject = single(headers, SUBJECT_HEADER);
        if subject != Some(claimed.req.req.subject.as_str()) {
            return Err(NotThisRequest::OtherSubject {
                echoed: subject.is_some(),
            });
        }
        let echoed_key = single(headers, key::HEADER);
        if echoed_key != Some(claimed.req.req.key.as_str()) {
            return Err(NotThisRequest::OtherKey {
                echoed: echoed_key.is_some(),
            });
        }
    }
    let endpoint = single(headers, ENDPOINT_HEADER);
    if endpoint != Some(claimed.req.req.endpoint.as_str()) {
        return Err(NotThisRequest::OtherEndpoint(endpoint.map(str::to_owned)));
    }
    let fingerprint = single(headers, FINGERPRINT_HEADER);
    if !fingerprint.is_some_and(|f| f.eq_ignore_ascii_case(&claimed.req.fingerprint.hex)) {
        return Err(NotThisRequest::OtherFingerprint {
            echoed: fingerprint.is_some(),
        });
    }
    Ok(named)
}
