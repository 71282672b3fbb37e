//! Reconciling: a retry took over a record whose outcome was unknown (forwarded, never stored)
//! on an `on_unknown: reconcile` route, with a new, larger fencing token. Before anything runs,
//! the upstream is asked what became of the key (the route's `reconcile` endpoint, with the key,
//! the subject and the new token as headers), and tells by its `idempotency-outcome` header:
//!
//! * `executed`: the answer *is* the outcome it produced (status, headers, body): stored, and
//!   replayed to this client;
//! * `running`: the earlier attempt is still at work: 409 + Retry-After;
//! * `not-executed`: it never ran, and now refuses the earlier attempt (its token is smaller):
//!   the request runs, once, with the new token;
//! * anything else, or no answer: 503 + Retry-After, nothing forwarded.
//!
//! In the last three cases the record is marked unknown again (by the worker: the stream ends
//! with its answer), so the next retry asks again.

use super::response::{capture_of, outcome, stored_body_limit};
use super::{Call, Claimed, Flow, Note, Out, State, Turn, Write};
use crate::config::Config;
use crate::metrics::Metric;
use crate::reply::{self, LocalReply};
use crate::worker::writes::PendingWrite;
use crate::worker::{CalloutResult, Effect, Level};
use contract::wire::{
    FENCING_TOKEN_HEADER, OUTCOME_EXECUTED, OUTCOME_HEADER, OUTCOME_NOT_EXECUTED, OUTCOME_RUNNING,
    SUBJECT_HEADER, UNKNOWN_PATH,
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
                // The upstream's outcome, as it produced it: stored, then replayed to this client.
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
                    format!("the upstream executed it (HTTP {status}); stored and replayed"),
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

/// The worker tells the state API that the record's outcome is unknown (fenced by the claim's
/// token): the stream may end before a callout of its own could be answered.
pub(super) fn mark_unknown(claimed: &Claimed) -> Out {
    Out::Note(Note::HandOver {
        write: PendingWrite::fenced(claimed.held(), &claimed.req.req.namespace, UNKNOWN_PATH),
        record: None,
    })
}
