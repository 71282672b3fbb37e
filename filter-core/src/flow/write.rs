//! Storing the outcome: the answers to the stream's complete or release, and what is left to
//! do when the stream ends first. Once the request went upstream, every path ends in a stored
//! outcome, a released key (the upstream certainly never saw it), or a key that stays held:
//! never in a key free to run again.

use super::response::cut_short;
use super::{Call, Claimed, Flow, Note, Out, State, Turn, Write, WRITE_ATTEMPTS};
use crate::config::Config;
use crate::metrics::Metric;
use crate::worker::writes::{PendingWrite, WriteVerdict};
use crate::worker::{CalloutResult, Effect, Level};
use contract::wire::{COMPLETE_PATH, RELEASE_PATH};

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
        let why = answer.describe();
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
                let log = Flow::log(
                    Level::Warn,
                    format!(
                        "{what} for {} refused, a newer claim owns the key (token {token}): {why}",
                        claimed.endpoint()
                    ),
                );
                return self.done(
                    Turn::cont()
                        .with(Effect::Count(Metric::FencedOut))
                        .with(log),
                    token,
                );
            }
            WriteVerdict::Refused(_) => {
                if let Write::Complete {
                    fallback: Some(minimal),
                    record,
                    ..
                } = write
                {
                    // The state API will not store this response (a limit the filter could not
                    // know): store its status alone, not replayable. Never leave the key free.
                    let log = Flow::log(
                        Level::Warn,
                        format!(
                            "complete for {} refused ({why}); storing its status alone, not replayable (token {token})",
                            claimed.endpoint()
                        ),
                    );
                    let record = Box::new(record.not_replayable());
                    let t = Turn::pause()
                        .with(Effect::Count(Metric::CompleteRefused))
                        .with(log)
                        .with(Call::Complete {
                            body: minimal.clone(),
                            fallback: None,
                            claim: claimed.held(),
                            record: record.clone(),
                            first: false,
                        });
                    self.state = State::Writing(
                        claimed,
                        Write::Complete {
                            body: minimal,
                            fallback: None,
                            attempts: 1,
                            record,
                        },
                    );
                    return t;
                }
                let mut t = Turn::pause().with(Effect::Count(Metric::StateApiErrors));
                if matches!(write, Write::Complete { .. }) {
                    t.push(Effect::Count(Metric::CompleteGaveUp));
                }
                t.push(Flow::log(
                    Level::Error,
                    format!(
                        "{what} for {} refused ({why}); the key stays in progress until its lease runs out",
                        claimed.endpoint()
                    ),
                ));
                return self.done(t, token);
            }
            WriteVerdict::Failed => {}
        }
        // Failed: once more from the stream, then handed over to the worker.
        let mut t = Turn::pause().with(Effect::Count(Metric::StateApiErrors));
        let write = match write {
            Write::Complete {
                body,
                fallback,
                attempts,
                record,
            } if attempts < WRITE_ATTEMPTS => {
                t.push(Call::Complete {
                    body: body.clone(),
                    fallback: fallback.clone(),
                    claim: claimed.held(),
                    record: record.clone(),
                    first: false,
                });
                Write::Complete {
                    body,
                    fallback,
                    attempts: attempts + 1,
                    record,
                }
            }
            Write::Release { body, attempts } if attempts < WRITE_ATTEMPTS => {
                t.push(Call::Release { body: body.clone() });
                Write::Release {
                    body,
                    attempts: attempts + 1,
                }
            }
            write if cfg.retries_completes() => {
                t.push(Flow::log(
                    Level::Warn,
                    format!(
                        "{what} for {} failed ({why}); the response goes on and this worker keeps retrying it (token {token})",
                        claimed.endpoint()
                    ),
                ));
                t.push(hand_over(&claimed, write));
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

    /// The stream is over (`on_done`; Envoy cancels its callouts). A write on its way, or the
    /// status and headers of a response cut short in its body, are handed over to the worker,
    /// so the outcome is stored all the same. Before any response the upstream may have acted:
    /// the heartbeat stops and the key stays `in_progress` until its lease runs out.
    pub fn on_stream_done(&mut self, cfg: &Config) -> Turn {
        match self.take() {
            State::Claiming(f) => Turn::cont().with(Flow::log(
                Level::Info,
                format!(
                    "stream of {} ended while claiming; any claim made runs out with its lease",
                    f.req.endpoint
                ),
            )),
            State::Writing(c, write) if cfg.retries_completes() => {
                let log = Flow::log(
                    Level::Info,
                    format!(
                        "stream of {} ended while its outcome was being stored (token {}); this worker stores it",
                        c.endpoint(),
                        c.token
                    ),
                );
                Turn::cont().with(log).with(hand_over(&c, write))
            }
            State::Capturing(c, cap) if cfg.retries_completes() => {
                let (write, _) = cut_short(&c, cap);
                let log = Flow::log(
                    Level::Warn,
                    format!(
                        "stream of {} ended in the response body (token {}); its status is stored, not replayable",
                        c.endpoint(),
                        c.token
                    ),
                );
                Turn::cont()
                    .with(Effect::Count(Metric::StoredWithoutBody))
                    .with(log)
                    .with(hand_over(&c, write))
            }
            State::Upstream(c) | State::Capturing(c, _) | State::Writing(c, _) => Turn::cont()
                .with(Note::Unregister(c.token))
                .with(ended_before_outcome(&c)),
            _ => Turn::cont(),
        }
    }
}

/// The worker takes a stream's write over (it keeps the claim's lease alive meanwhile).
fn hand_over(claimed: &Claimed, write: Write) -> Out {
    let (path, payload, fallback, record) = match write {
        Write::Complete {
            body,
            fallback,
            record,
            ..
        } => (COMPLETE_PATH, body, fallback, Some(record)),
        Write::Release { body, .. } => (RELEASE_PATH, body, None, None),
    };
    Out::Note(Note::HandOver {
        write: PendingWrite {
            claim: claimed.held(),
            path,
            payload,
            fallback,
            untried: false,
        },
        record,
    })
}

fn ended_before_outcome(c: &Claimed) -> Out {
    Flow::log(
        Level::Warn,
        format!(
            "stream of {} ended before its outcome was stored (token {}); the key stays in progress until its lease runs out",
            c.endpoint(),
            c.token
        ),
    )
}
