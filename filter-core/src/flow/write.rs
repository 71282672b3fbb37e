//! Storing the outcome: the answers to the stream's complete or release, and what is left to
//! do when the stream ends first. Once the request went upstream, every path ends in a stored
//! outcome, a released key (the upstream certainly never saw it), or a key that stays held:
//! never in a key free to run again.

use super::mark_unknown;
use super::response::cut_short;
use super::{completed_reply, Call, Claimed, Flow, Note, Out, State, Turn, Write, WRITE_ATTEMPTS};
use crate::config::Config;
use crate::effect::{CalloutResult, Effect, Level};
use crate::metrics::Metric;
use crate::reply::{self, LocalReply};
use crate::worker::writes::{PendingWrite, WriteAnswer, WriteVerdict};
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
        self.on_write(cfg, WriteAnswer::of(&answer))
    }

    /// A write's answer, from its own callout or from a batch's.
    pub fn on_write(&mut self, cfg: &Config, answer: WriteAnswer) -> Turn {
        let State::Writing(claimed, write) = self.take() else {
            return Turn::cont().with(Flow::log(
                Level::Warn,
                "write answer in an unexpected state".into(),
            ));
        };
        let WriteAnswer {
            verdict,
            expires_in_ms,
            why,
        } = answer;
        match verdict {
            WriteVerdict::Stored => self.write_stored(cfg, claimed, write, expires_in_ms),
            WriteVerdict::FencedOut => self.write_fenced_out(claimed, write, &why),
            WriteVerdict::Refused(_) => self.write_refused(cfg, claimed, write, &why),
            WriteVerdict::Failed => self.write_failed(cfg, claimed, write, &why),
        }
    }

    /// The write is stored: the key's outcome is known, and a reconciled one is the client's
    /// answer.
    fn write_stored(
        &mut self,
        cfg: &Config,
        claimed: Claimed,
        write: Write,
        expires_in_ms: Option<u64>,
    ) -> Turn {
        let ok_metric = match &write {
            Write::Complete { .. } => Metric::Completed,
            Write::Release { .. } => Metric::Released,
        };
        let token = claimed.token;
        // Duplicates told "in progress" while this request ran are not any more.
        let id = claimed.req.req.id();
        let mut t = Turn::cont()
            .with(Effect::Count(ok_metric))
            .with(Note::ForgetRunning(id));
        let Write::Complete {
            mut record, reply, ..
        } = write
        else {
            return self.done(t, token);
        };
        if let Some(expires_in_ms) = expires_in_ms {
            // Counted from when the request was claimed: earlier than the write, never later.
            record.expires_at_ms = Some(claimed.req.sent_ms.saturating_add(expires_in_ms));
        }
        let answer = reply.then(|| completed_reply(cfg, &record, expires_in_ms));
        if let Some(expires_in_ms) = expires_in_ms {
            t.push(Note::Remember {
                id,
                record,
                since_ms: claimed.req.sent_ms,
                expires_in_ms,
            });
        }
        match answer {
            None => self.done(t, token),
            Some(answer) => self.answer_reconciled(t.with(Note::Unregister(token)), answer),
        }
    }

    /// A newer claim owns the key: this write is refused for good.
    fn write_fenced_out(&mut self, claimed: Claimed, write: Write, why: &str) -> Turn {
        let what = write_name(&write);
        let token = claimed.token;
        let log = Flow::log(
            Level::Warn,
            format!(
                "{what} for {} refused, a newer claim owns the key (token {token}): {why}",
                claimed.endpoint()
            ),
        );
        let t = Turn::cont()
            .with(Effect::Count(Metric::FencedOut))
            .with(log);
        if write.replies() {
            // A newer claim reconciles the key now: this retry is told to wait.
            let t = t.with(Note::Unregister(token));
            return self.answer_reconciled(t, Err("fenced out".into()));
        }
        self.done(t, token)
    }

    /// The state API refuses the write: a complete with a fallback stores its status alone;
    /// anything else is given up.
    fn write_refused(&mut self, cfg: &Config, claimed: Claimed, write: Write, why: &str) -> Turn {
        let token = claimed.token;
        if let Write::Complete {
            fallback: Some(minimal),
            record,
            reply,
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
                    reply,
                },
            );
            return t;
        }
        let t = Turn::pause().with(Effect::Count(Metric::StateApiErrors));
        self.give_up_logged(cfg, t, &claimed, write, &format!("refused ({why})"))
    }

    /// The write failed: once more from the stream, then handed over to the worker (or given
    /// up where the route does not retry completes).
    fn write_failed(&mut self, cfg: &Config, claimed: Claimed, write: Write, why: &str) -> Turn {
        let what = write_name(&write);
        let token = claimed.token;
        // Failed: once more from the stream, then handed over to the worker.
        let mut t = Turn::pause().with(Effect::Count(Metric::StateApiErrors));
        let write = match write {
            Write::Complete {
                body,
                fallback,
                attempts,
                record,
                reply,
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
                    reply,
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
                let answer = write.replies().then(|| write.record_reply(cfg));
                t.push(hand_over(&claimed, write));
                return match answer {
                    // The worker keeps the claim's lease while it stores the outcome.
                    Some(answer) => self.answer_reconciled(t, answer),
                    None => t.with(self.effect(|stream| Effect::ResumeResponse { stream })),
                };
            }
            write => {
                return self.give_up_logged(cfg, t, &claimed, write, &format!("failed ({why})"));
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

    /// A write that will not be stored, counted and logged with why (`refused (...)`), then
    /// given up.
    fn give_up_logged(
        &mut self,
        cfg: &Config,
        mut t: Turn,
        claimed: &Claimed,
        write: Write,
        failure: &str,
    ) -> Turn {
        if matches!(write, Write::Complete { .. }) {
            t.push(Effect::Count(Metric::CompleteGaveUp));
        }
        t.push(Flow::log(
            Level::Error,
            format!(
                "{} for {} {failure}; {UNSTORED}",
                write_name(&write),
                claimed.endpoint()
            ),
        ));
        self.give_up(cfg, t, claimed.token, write)
    }

    /// A write that will not be stored: the heartbeat stops. A reconciled outcome is still
    /// the client's answer (the upstream said so); the record stays the claim's until its
    /// lease runs out, and then unknown again.
    fn give_up(&mut self, cfg: &Config, t: Turn, token: i64, write: Write) -> Turn {
        if write.replies() {
            let answer = write.record_reply(cfg);
            return self.answer_reconciled(t.with(Note::Unregister(token)), answer);
        }
        self.done(t, token)
    }

    /// The end of a reconciliation that found the outcome: the client gets it (a replay), or
    /// 409 when it cannot be given. There is no upstream response to let go.
    fn answer_reconciled(
        &mut self,
        mut t: Turn,
        answer: Result<(Metric, LocalReply), String>,
    ) -> Turn {
        let (metric, reply) = match answer {
            Ok((metric, reply)) => (Some(metric), reply),
            Err(why) => {
                t.push(Flow::log(
                    Level::Warn,
                    format!("the reconciled outcome cannot be replayed ({why})"),
                ));
                (Some(Metric::InProgress409), reply::in_progress(1))
            }
        };
        let mut r = self.reply(metric, reply);
        r.outs.splice(0..0, t.outs);
        r
    }

    /// The stream is over (`on_done`; Envoy cancels its callouts). A write on its way, or the
    /// status and headers of a response cut short in its body, are handed over to the worker,
    /// so the outcome is stored all the same. Before any response the upstream may have acted:
    /// the heartbeat stops and the record is marked unknown.
    pub fn on_stream_done(&mut self, cfg: &Config) -> Turn {
        match self.take() {
            State::Claiming(f) => {
                // Its claim's answer will never come (Envoy cancels the callout): nothing was
                // forwarded, so a claim the state API committed meanwhile is given back.
                let log = Flow::log(
                    Level::Info,
                    format!(
                        "stream of {} ended while claiming; a claim made for it is given back",
                        f.req.endpoint
                    ),
                );
                match super::claim::abandon_of(&f) {
                    Some(note) => Turn::cont().with(log).with(note),
                    None => Turn::cont().with(log),
                }
            }
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
            State::Upstream(c) => {
                // Forwarded, and no answer seen: what the upstream did is unknown, and the state
                // API is told so at once (a retry must not run it again without proof).
                let log =
                    c.unknown_log(Level::Warn, "the stream ended before the upstream answered");
                Turn::cont()
                    .with(Effect::Count(Metric::OutcomeUnknown))
                    .with(log)
                    .with(Note::Unregister(c.token))
                    .with(mark_unknown(&c))
            }
            State::Reconciling(c) => Turn::cont()
                .with(Note::Unregister(c.token))
                .with(mark_unknown(&c)),
            State::Capturing(c, _) | State::Writing(c, _) => Turn::cont()
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

impl Write {
    /// Its outcome is the client's answer once stored (a reconciled one).
    fn replies(&self) -> bool {
        matches!(self, Write::Complete { reply: true, .. })
    }

    /// The replay of the outcome it stores (not stored yet: its expiry is not known).
    fn record_reply(&self, cfg: &Config) -> Result<(Metric, LocalReply), String> {
        match self {
            Write::Complete { record, .. } => completed_reply(cfg, record, None),
            Write::Release { .. } => Err("a release has no outcome".into()),
        }
    }
}

/// A write's name, for logs.
fn write_name(write: &Write) -> &'static str {
    match write {
        Write::Complete { .. } => "complete",
        Write::Release { .. } => "release",
    }
}

/// What a log line adds of a write that will not be stored (refused, or its stream gone):
/// the simulation reads it to know which keys a given-up write leaves held.
pub const UNSTORED: &str =
    "the key stays held until its lease runs out, and then its outcome is unknown";

fn ended_before_outcome(c: &Claimed) -> Out {
    Flow::log(
        Level::Warn,
        format!(
            "stream of {} ended before its outcome was stored (token {}); {UNSTORED}",
            c.endpoint(),
            c.token
        ),
    )
}
