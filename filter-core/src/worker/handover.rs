//! The writes the worker took over from its streams (completes, releases, abandons): kept,
//! sent when due, retried, and settled when answered.

use super::batch::{BatchedWrite, Writer, BATCH_WRITE_BYTES};
use super::registry::{self, HeldClaim};
use super::replay_cache::Completed;
use super::writes::{PendingWrite, WriteAnswer, WriteDone, WriteVerdict};
use super::{ids, Purpose, Worker};
use crate::effect::{Effect, Level, Owner};
use crate::metrics::Metric;
use contract::wire::{ABANDON_PATH, COMPLETE_PATH, RELEASE_PATH, UNKNOWN_PATH};

impl Worker {
    /// Gives back the record of a claim whose answer never came (`/v1/abandon`): sent and
    /// retried like a handed-over write, under a negative token of its own.
    pub(super) fn abandon(
        &mut self,
        req: contract::wire::AbandonRequest,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        self.abandons += 1;
        effects.push(Effect::Count(Metric::ClaimsAbandoned));
        let claim = HeldClaim {
            key: req.key.clone(),
            subject: req.subject.clone(),
            endpoint: req.endpoint.clone(),
            token: -self.abandons,
        };
        let write = PendingWrite {
            claim,
            path: ABANDON_PATH,
            payload: crate::effect::to_json(&req),
            fallback: None,
            untried: true,
        };
        self.hand_over(write, None, now_ms, effects);
    }

    /// The worker takes a write over: the claim's lease stays alive while it waits, and the
    /// response is answered to retries on this worker from memory. When it cannot be kept, the
    /// heartbeat stops and the key stays in progress until its lease runs out.
    pub(super) fn hand_over(
        &mut self,
        write: PendingWrite,
        record: Option<Box<Completed>>,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        let claim = write.claim.clone();
        if self.registry.is_fenced(claim.token) {
            // A heartbeat already found a newer claim owning the key: this write can only be
            // fenced out, and the response it carries is not the key's outcome (it may be the
            // upstream refusing this stale token), so retries must not be answered with it.
            self.registry.remove(claim.token);
            effects.push(Effect::Log(
                Level::Warn,
                format!(
                    "{} for {} not sent: a newer claim owns the key (token {})",
                    write.path, claim.endpoint, claim.token
                ),
            ));
            return;
        }
        let untried = write.untried;
        let write_path = write.path;
        let keeps_lease = write.keeps_lease();
        match self.writes.add(write, now_ms) {
            Ok(()) => {
                if keeps_lease && !self.registry.contains(claim.token) {
                    // The stream ended before: keep the lease alive all the same.
                    let terms = registry::Terms {
                        lease_ms: self.cfg.lease_ms,
                        heartbeat_ms: self.cfg.heartbeat_ms,
                    };
                    self.registry
                        .register(claim.clone(), self.cfg.lease_ms, terms, now_ms);
                }
                if let Some(rec) = record {
                    if self.answerable(&rec) {
                        let id = ids::id(&claim.key, &claim.subject, &claim.endpoint);
                        self.replays.insert_pending(id, *rec);
                        self.wake_waiters(id, now_ms, effects);
                    }
                }
                if untried && !self.wake_pending {
                    if self.batching && write_path == COMPLETE_PATH && self.lane_on_its_way() > 0
                    {
                        // It goes with the batch the lane's answer wakes the worker for.
                        self.handed_await_lane = true;
                    } else {
                        self.wake_pending = true;
                        effects.push(Effect::Wake);
                    }
                }
            }
            Err(why) if !keeps_lease => effects.push(Effect::Log(
                Level::Warn,
                format!(
                    "the unknown outcome of {} is not sent ({why}); the state API finds it unknown when its lease runs out",
                    claim.endpoint
                ),
            )),
            Err(why) => {
                self.registry.remove(claim.token);
                effects.push(Effect::Count(Metric::CompleteGaveUp));
                effects.push(Effect::Log(
                    Level::Error,
                    format!(
                        "complete for {} given up ({why}); the key stays in progress until its lease runs out",
                        claim.endpoint
                    ),
                ));
            }
        }
    }

    /// The answer to a handed-over write: its own callout's, or its item of a `/v1/writes`.
    pub(super) fn write_answered(
        &mut self,
        token: i64,
        answer: WriteAnswer,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        let WriteAnswer {
            verdict,
            expires_in_ms,
            why,
        } = answer;
        let falls_back = matches!(verdict, WriteVerdict::Refused(_))
            .then(|| self.writes.fallback_of(token))
            .flatten();
        if let Some(claim) = falls_back {
            // Its status alone is stored instead: the response is not replayed from here either.
            self.replays
                .remove(&ids::id(&claim.key, &claim.subject, &claim.endpoint));
            effects.push(Effect::Count(Metric::CompleteRefused));
            effects.push(Effect::Log(
                Level::Warn,
                format!(
                    "complete for {} refused ({}); storing its status alone, not replayable (token {token})",
                    claim.endpoint, why
                ),
            ));
        }
        match self.writes.answered(token, verdict, now_ms) {
            None if verdict == WriteVerdict::Failed => {
                effects.push(Effect::Count(Metric::StateApiErrors));
                effects.push(Effect::Log(
                    Level::Debug,
                    format!("complete retry failed: {why}"),
                ));
            }
            None => {}
            Some(done) => self.write_done(done, expires_in_ms, now_ms, effects),
        }
    }

    /// A handed-over write is over: its heartbeat stops, its pending memory entry becomes a
    /// normal one (stored, with the record's expiry) or goes.
    pub(super) fn write_done(
        &mut self,
        done: WriteDone,
        expires_in_ms: Option<u64>,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        let claim = done.claim();
        let token = claim.token;
        self.registry.remove(token);
        let id = ids::id(&claim.key, &claim.subject, &claim.endpoint);
        match (&done, expires_in_ms) {
            (WriteDone::Stored { .. }, Some(expires_in_ms)) => {
                self.replays.settle(&id, now_ms, expires_in_ms)
            }
            _ => {
                self.replays.remove(&id);
            }
        }
        match done {
            WriteDone::Stored {
                claim,
                path,
                attempts,
                untried,
            } => {
                match path {
                    RELEASE_PATH => effects.push(Effect::Count(Metric::Released)),
                    ABANDON_PATH => {}
                    COMPLETE_PATH => effects.push(Effect::Count(Metric::Completed)),
                    _ => {}
                }
                // An untried write stored at its first attempt is the normal case.
                let retries = attempts.saturating_sub(u32::from(untried));
                if retries > 0 {
                    effects.push(Effect::Log(
                        Level::Info,
                        format!(
                            "complete for {} stored after {retries} retries (token {token})",
                            claim.endpoint
                        ),
                    ));
                }
            }
            WriteDone::FencedOut { claim } => {
                effects.push(Effect::Count(Metric::FencedOut));
                effects.push(Effect::Log(
                    Level::Warn,
                    format!(
                        "complete for {} refused, a newer claim owns the key (token {token})",
                        claim.endpoint
                    ),
                ));
            }
            WriteDone::GaveUp {
                claim,
                attempts,
                why,
                path,
            } if path == UNKNOWN_PATH => {
                effects.push(Effect::Count(Metric::StateApiErrors));
                effects.push(Effect::Log(
                    Level::Warn,
                    format!(
                        "the unknown outcome of {} was not stored after {attempts} attempts ({why}; token {token}); the state API finds it unknown when its lease runs out",
                        claim.endpoint
                    ),
                ));
            }
            WriteDone::GaveUp {
                claim,
                attempts,
                why,
                ..
            } => {
                effects.push(Effect::Count(Metric::StateApiErrors));
                effects.push(Effect::Count(Metric::CompleteGaveUp));
                effects.push(Effect::Log(
                    Level::Error,
                    format!(
                        "complete for {} given up after {attempts} retries ({why}; token {token}); the key stays in progress until its lease runs out",
                        claim.endpoint
                    ),
                ));
            }
        }
    }

    /// Sends the writes that are due (within [`MAX_IN_FLIGHT`](super::writes::MAX_IN_FLIGHT)) and settles the ones
    /// given up.
    pub(super) fn send_writes(&mut self, now_ms: u64, effects: &mut Vec<Effect>) {
        if self.writes.is_empty() {
            return;
        }
        let due = self.writes.due(now_ms);
        for done in due.gave_up {
            self.write_done(done, None, now_ms, effects);
        }
        for send in due.send {
            if !send.first {
                effects.push(Effect::Count(Metric::CompleteRetries));
            }
            if self.batching
                && send.path == COMPLETE_PATH
                && send.payload.len() <= BATCH_WRITE_BYTES
            {
                // Goes in the `/v1/writes` that `send_batches` makes next.
                let by = Writer::Worker(send.token);
                self.complete_queue.push(BatchedWrite {
                    by,
                    body: send.payload,
                });
                continue;
            }
            self.dispatch_state_api(
                Owner::Worker,
                Purpose::Write(send.token),
                send.path,
                send.payload,
                effects,
            );
        }
    }
}
