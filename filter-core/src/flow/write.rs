//! Storing the outcome: the answers to the stream's complete or release, and what is left to
//! do when the stream ends first.

use super::{Call, Claimed, Flow, Note, State, Turn, Write, WRITE_ATTEMPTS};
use crate::config::Config;
use crate::metrics::Metric;
use crate::worker::writes::{PendingWrite, WriteVerdict};
use crate::worker::{CalloutResult, Effect, Level};
use contract::wire::COMPLETE_PATH;

impl Flow {
    /// The worker took the first attempt of the complete over (`complete_in_background`): the
    /// response goes on at once, before the outcome is stored (a retry meanwhile gets 409, or
    /// the replay from this worker's memory).
    pub fn on_complete_taken(&mut self) -> Turn {
        match self.take() {
            State::Writing(_, Write::Complete { .. }) => {
                Turn::cont().with(self.effect(|stream| Effect::ResumeResponse { stream }))
            }
            other => {
                self.state = other;
                Turn::cont().with(Flow::log(
                    Level::Warn,
                    "complete taken over in an unexpected state".into(),
                ))
            }
        }
    }

    /// The answer to `/v1/complete` or `/v1/release` (or its failure).
    pub fn on_write_answer(&mut self, cfg: &Config, answer: CalloutResult) -> Turn {
        let State::Writing(claimed, write) = self.take() else {
            return Turn::cont().with(Flow::log(
                Level::Warn,
                "write answer in an unexpected state".into(),
            ));
        };
        let (what, ok_metric) = match &write {
            Write::Complete { .. } => ("complete", Metric::Completed),
            Write::Release { .. } => ("release", Metric::Released),
        };
        let token = claimed.token;
        let (verdict, expires_in_ms) = WriteVerdict::of(&answer);
        match verdict {
            WriteVerdict::Stored => {
                // Duplicates told "in progress" while this request ran are not any more.
                let id = claimed.req.req.id();
                let mut t = Turn::cont()
                    .with(Effect::Count(ok_metric))
                    .with(Note::ForgetRunning(id));
                if let (Write::Complete { record, .. }, Some(expires_in_ms)) =
                    (write, expires_in_ms)
                {
                    t.push(Note::Remember {
                        id,
                        record,
                        since_ms: claimed.req.sent_ms,
                        expires_in_ms,
                    });
                }
                return self.done(t, token);
            }
            WriteVerdict::FencedOut => {
                let body = match &answer {
                    CalloutResult::Response { body, .. } => body.as_slice(),
                    CalloutResult::Failed(_) => &[],
                };
                let log = Flow::log(
                    Level::Warn,
                    format!(
                        "{what} for {} refused, a newer claim owns the key (token {token}): {}",
                        claimed.endpoint(),
                        String::from_utf8_lossy(
                            body.get(..body.len().min(200)).unwrap_or_default()
                        )
                    ),
                );
                return self.done(
                    Turn::cont()
                        .with(Effect::Count(Metric::FencedOut))
                        .with(log),
                    token,
                );
            }
            WriteVerdict::Refused(_) | WriteVerdict::Failed => {}
        }
        let why = match &answer {
            CalloutResult::Response { status, .. } => format!("HTTP {status}"),
            CalloutResult::Failed(why) => why.clone(),
        };
        let mut t = Turn::pause().with(Effect::Count(Metric::StateApiErrors));
        let retryable = verdict == WriteVerdict::Failed;
        let write = match write {
            Write::Complete {
                body,
                attempts,
                record,
            } if retryable && attempts < WRITE_ATTEMPTS => {
                t.push(Call::Complete {
                    body: body.clone(),
                    claim: claimed.held(),
                    record: record.clone(),
                    first: false,
                });
                Write::Complete {
                    body,
                    attempts: attempts + 1,
                    record,
                }
            }
            Write::Release { body, attempts } if retryable && attempts < WRITE_ATTEMPTS => {
                t.push(Call::Release { body: body.clone() });
                Write::Release {
                    body,
                    attempts: attempts + 1,
                }
            }
            Write::Complete { body, record, .. } if retryable && cfg.retries_completes() => {
                t.push(Flow::log(
                    Level::Warn,
                    format!(
                        "complete for {} failed ({why}); the response goes on and this worker keeps retrying it (token {token})",
                        claimed.endpoint()
                    ),
                ));
                t.push(Note::HandOver {
                    write: PendingWrite {
                        claim: claimed.held(),
                        path: COMPLETE_PATH,
                        payload: body,
                        untried: false,
                    },
                    record: Some(record),
                });
                t.push(self.effect(|stream| Effect::ResumeResponse { stream }));
                return t;
            }
            write => {
                if matches!(write, Write::Complete { .. }) {
                    t.push(Effect::Count(Metric::CompleteGaveUp));
                }
                t.push(Flow::log(
                    Level::Error,
                    format!(
                        "{what} for {} failed ({why}); the key stays in progress until its lease runs out",
                        claimed.endpoint()
                    ),
                ));
                return self.done(t, token);
            }
        };
        t.outs.insert(
            1,
            Flow::log(
                Level::Warn,
                format!("{what} for {} failed ({why}); retrying", claimed.endpoint()),
            ),
        );
        self.state = State::Writing(claimed, write);
        t
    }

    /// The write is over: the heartbeat stops and the response goes on.
    fn done(&mut self, mut t: Turn, token: i64) -> Turn {
        t.push(Note::Unregister(token));
        t.push(self.effect(|stream| Effect::ResumeResponse { stream }));
        t
    }

    /// The stream is over (`on_done`). With a claim still open the heartbeat stops and the key
    /// stays `in_progress` until its lease runs out: the upstream may have executed. A complete
    /// still on its way is handed over to the worker instead (Envoy cancels the stream's
    /// callouts when it ends), so the outcome is stored all the same.
    pub fn on_stream_done(&mut self, cfg: &Config) -> Turn {
        match self.take() {
            State::Claiming(f) => Turn::cont().with(Flow::log(
                Level::Info,
                format!(
                    "stream of {} ended while claiming; any claim made runs out with its lease",
                    f.req.endpoint
                ),
            )),
            State::Writing(c, Write::Complete { body, record, .. }) if cfg.retries_completes() => {
                let log = Flow::log(
                    Level::Info,
                    format!(
                        "stream of {} ended while its outcome was being stored (token {}); this worker completes it",
                        c.endpoint(),
                        c.token
                    ),
                );
                Turn::cont().with(log).with(Note::HandOver {
                    write: PendingWrite {
                        claim: c.held(),
                        path: COMPLETE_PATH,
                        payload: body,
                        untried: false,
                    },
                    record: Some(record),
                })
            }
            State::Upstream(c) | State::Capturing(c, _) | State::Writing(c, _) => Turn::cont()
                .with(Note::Unregister(c.token))
                .with(ended_before_outcome(&c)),
            _ => Turn::cont(),
        }
    }
}

fn ended_before_outcome(c: &Claimed) -> super::Out {
    Flow::log(
        Level::Warn,
        format!(
            "stream of {} ended before its outcome was stored (token {}); the key stays in progress until its lease runs out",
            c.endpoint(),
            c.token
        ),
    )
}
