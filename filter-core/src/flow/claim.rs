//! The claim's answer, from the state API or from the worker's memory: forward the request
//! once, or answer the duplicate.

use super::{Claimed, Fingerprinted, Flow, Note, Out, State, Turn};
use crate::config::{Config, OnStateUnavailable, OnUnknown};
use crate::effect::{CalloutResult, Effect, Level};
use crate::headers;
use crate::key;
use crate::metrics::Metric;
use crate::reply;
use crate::reply::LocalReply;
use crate::worker::registry::heartbeat_interval;
use crate::worker::replay_cache::Completed;
use crate::worker::writes::PendingWrite;
use contract::wire::{
    ClaimItem, ClaimResponse, StoredResponse, ENDPOINT_HEADER, FENCING_TOKEN_HEADER,
    FINGERPRINT_HEADER, RELEASE_PATH,
};
use contract::ProblemKind;

/// What the worker's memory knows of a key, instead of asking the state API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remembered {
    /// A completed record (its status is one a replay can carry).
    Completed(Completed),
    /// A record this worker saw complete while the request waited for it (`Prefer: wait`).
    Woken(Completed),
    /// Reported in progress for this very request a moment ago.
    Running { retry_after_s: u32 },
}

/// A claim's answer as the flow reads it: the same from `/v1/claim` and from an item of
/// `/v1/claims`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimAnswer {
    /// A 2xx, read; or why there is no usable answer (a failure, a 5xx, 408, 429, unreadable).
    Read(Result<ClaimResponse, String>),
    /// Another 4xx: a configuration or contract error.
    Refused { status: u16, detail: String },
}

/// The start of an answer's body, for a log line.
fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(body.get(..body.len().min(200)).unwrap_or_default()).into_owned()
}

fn refuses(status: u16) -> bool {
    (400..500).contains(&status) && status != 408 && status != 429
}

impl ClaimAnswer {
    /// The answer of a claim's own callout, or of a whole batch that was not answered item
    /// by item (then every claim of it gets this one).
    pub fn of(result: &CalloutResult) -> Self {
        match result {
            CalloutResult::Response { status, body, .. } if (200..300).contains(status) => {
                Self::Read(
                    ClaimResponse::read(body).map_err(|e| format!("unreadable claim answer: {e}")),
                )
            }
            CalloutResult::Response { status, body, .. } if refuses(*status) => Self::Refused {
                status: *status,
                detail: excerpt(body),
            },
            CalloutResult::Response { status, body, .. } => Self::Read(Err(format!(
                "claim answered HTTP {status}: {}",
                excerpt(body)
            ))),
            CalloutResult::Failed(why) => Self::Read(Err(format!("claim failed: {why}"))),
        }
    }

    /// One item of a batch's answer: as the answer to a claim's own callout with that status.
    pub fn of_item(item: ClaimItem) -> Self {
        match item.answer {
            Ok(answer) if (200..300).contains(&item.status) => Self::Read(Ok(answer)),
            answer => Self::of(&CalloutResult::answer(
                item.status,
                answer.err().map(|e| e.0).unwrap_or_default().into_bytes(),
            )),
        }
    }

    /// No usable answer (a failure, a 5xx, 408, 429, unreadable): the claim may have been
    /// committed all the same.
    pub fn unusable(&self) -> bool {
        matches!(self, Self::Read(Err(_)))
    }

    /// The fencing token of a claim this answer grants.
    pub fn granted_token(&self) -> Option<i64> {
        match self {
            Self::Read(Ok(ClaimResponse::Claimed { token, .. })) => Some(*token),
            _ => None,
        }
    }
}

impl Flow {
    /// The worker answers the claim from its memory.
    pub fn on_remembered(&mut self, cfg: &Config, memory: Remembered, now_ms: u64) -> Turn {
        let State::Claiming(req) = self.take() else {
            return Turn::cont().with(Flow::log(
                Level::Warn,
                "memory answer in an unexpected state".into(),
            ));
        };
        let woken = matches!(memory, Remembered::Woken(_));
        let (metric, reply, hit) = match memory {
            Remembered::Completed(rec) | Remembered::Woken(rec)
                if rec.fingerprint != req.fingerprint =>
            {
                (
                    Metric::Mismatch422,
                    reply::mismatch(&req.req.endpoint),
                    Metric::ReplayCacheHits,
                )
            }
            Remembered::Completed(rec) | Remembered::Woken(rec) => {
                let expires_in_ms = rec.expires_at_ms.map(|at| at.saturating_sub(now_ms));
                match completed_reply(cfg, &rec, expires_in_ms) {
                    Ok((metric, reply)) if woken => {
                        (metric, waited(reply, req.req.wait_s), Metric::WaitReplayed)
                    }
                    Ok((metric, reply)) => (metric, reply, Metric::ReplayCacheHits),
                    // The worker keeps only records a replay can carry, so this does not
                    // happen; if it did, 503 (nothing forwarded) is the safe answer.
                    Err(why) => return self.unavailable(cfg, req, why),
                }
            }
            Remembered::Running { retry_after_s } => (
                Metric::InProgress409,
                reply::in_progress(retry_after_s),
                Metric::InFlightCacheHits,
            ),
        };
        self.reply(Some(metric), reply).with(Effect::Count(hit))
    }

    /// The answer to `/v1/claim` (or its failure, including a failed dispatch), arrived at
    /// `now_ms`.
    pub fn on_claim_answer(&mut self, cfg: &Config, answer: CalloutResult, now_ms: u64) -> Turn {
        self.on_claim(cfg, ClaimAnswer::of(&answer), now_ms)
    }

    /// A claim's answer, from its own callout or from a batch's, arrived at `now_ms`.
    pub fn on_claim(&mut self, cfg: &Config, answer: ClaimAnswer, now_ms: u64) -> Turn {
        let State::Claiming(req) = self.take() else {
            return Turn::cont().with(Flow::log(
                Level::Warn,
                "claim answer in an unexpected state".into(),
            ));
        };
        let parsed = match answer {
            ClaimAnswer::Read(parsed) => parsed,
            ClaimAnswer::Refused { status, detail } => return self.refused(&req, status, &detail),
        };
        match parsed {
            Err(why) => self.unavailable(cfg, req, why),
            Ok(ClaimResponse::Claimed {
                token,
                reclaimed,
                lease_ms,
                max_body_bytes,
                retention_s,
                ..
            }) => {
                let claimed = Claimed {
                    req,
                    token,
                    lease_ms,
                    max_body: max_body_bytes,
                    // A reclaimed record keeps the retention it was made with, which the claim's
                    // answer does not say: no horizon is announced for it.
                    retention_s: retention_s.filter(|_| !reclaimed),
                };
                if !contract::undo::undone(contract::undo::Fix::LateGrant) {
                    if let Some(elapsed) = too_late(cfg, &claimed, now_ms) {
                        return self.late_grant(claimed, elapsed);
                    }
                }
                self.won(cfg, claimed, reclaimed)
            }
            Ok(ClaimResponse::Unknown) => self
                .reply(
                    Some(Metric::OutcomeUnknown409),
                    LocalReply::problem(
                        ProblemKind::OutcomeUnknown,
                        "a request with this key was forwarded and its outcome is unknown; it is held until it is resolved: do not retry with a new key",
                    ),
                )
                .with(Flow::log(
                    Level::Info,
                    format!(
                        "outcome unknown: subject {}, {}: held",
                        req.req.subject, req.req.endpoint
                    ),
                )),
            Ok(ClaimResponse::InProgress {
                retry_after_s,
                lease_remaining_ms,
                waited_ms,
            }) => self.running_elsewhere(&req, retry_after_s, lease_remaining_ms, waited_ms),
            Ok(ClaimResponse::Mismatch) => self.reply(
                Some(Metric::Mismatch422),
                reply::mismatch(&req.req.endpoint),
            ),
            Ok(ClaimResponse::Completed {
                response,
                expires_in_ms,
                waited_ms,
            }) => self.already_completed(cfg, req, response, expires_in_ms, waited_ms, now_ms),
        }
    }

    /// The claim is won: forward the request, or, when it took over an earlier attempt whose
    /// outcome was unknown, do what the route says (reconcile, run again, or reuse a record
    /// past its retention).
    fn won(&mut self, cfg: &Config, claimed: Claimed, reclaimed: bool) -> Turn {
        let policy = cfg.routes.get(claimed.req.req.route).map(|r| r.on_unknown);
        match (reclaimed, policy) {
            // An earlier attempt's outcome was unknown and this claim took it over.
            (true, Some(OnUnknown::Reconcile)) => self.reconcile(cfg, claimed),
            (true, Some(OnUnknown::Reexecute)) => {
                let log = claimed.unknown_log(Level::Warn, "run again (the route re-executes)");
                self.forward_logged(cfg, claimed, log)
                    .with(Effect::Count(Metric::Reexecuted))
            }
            // A held route takes a record over only past its retention: a new request.
            (true, _) => {
                let log = claimed.unknown_log(
                    Level::Info,
                    "a record past its retention, whose outcome was never stored, is reused",
                );
                self.forward_logged(cfg, claimed, log)
            }
            (false, _) => self.forward(cfg, claimed),
        }
    }

    /// A grant whose answer came too late to hold its lease ([`too_late`]): nothing is
    /// forwarded under it, the record is given back by its token (as a claim granted for a
    /// stream that is gone: a record taken over meanwhile refuses it, one this claim had taken
    /// over is unknown again), and the client gets 503 with Retry-After. Never failing open:
    /// the key may be another claim's by now.
    fn late_grant(&mut self, claimed: Claimed, elapsed: u64) -> Turn {
        let log = Flow::log(
            Level::Warn,
            format!(
                "the claim for {} was granted (token {}, a {} ms lease) but its answer came {elapsed} ms after it was sent, too late to hold the lease; given back, nothing forwarded",
                claimed.endpoint(),
                claimed.token,
                claimed.lease_ms,
            ),
        );
        let release = Note::HandOver {
            write: PendingWrite::fenced(claimed.held(), &claimed.req.req.namespace, RELEASE_PATH),
            record: None,
        };
        self.reply(Some(Metric::StateApiErrors), reply::state_unavailable())
            .with(log)
            .with(release)
    }

    /// The key runs elsewhere: 409, remembered for a short time (a waiting retry is told
    /// whether its wait ran out or was refused).
    fn running_elsewhere(
        &mut self,
        req: &Fingerprinted,
        retry_after_s: u32,
        lease_remaining_ms: u64,
        waited_ms: Option<u64>,
    ) -> Turn {
        let hold = Note::HoldRunning {
            id: req.req.id(),
            fingerprint: req.fingerprint.clone(),
            retry_after_s,
            since_ms: req.sent_ms,
            lease_remaining_ms,
        };
        let asked = req.req.wait_s;
        let (reply, wait_metric) = match waited_ms {
            // Still running at the deadline.
            Some(_) => (
                waited(reply::in_progress(retry_after_s), asked),
                Some(Metric::WaitTimedOut),
            ),
            // The state API's waiters were at their bound.
            None if asked > 0 => (reply::in_progress(retry_after_s), Some(Metric::WaitRefused)),
            None => (reply::in_progress(retry_after_s), None),
        };
        let mut t = self.reply(Some(Metric::InProgress409), reply).with(hold);
        if let Some(m) = wait_metric {
            t.push(Effect::Count(m));
        }
        t
    }

    /// The key's outcome is stored: the replay (remembered until the record expires), or
    /// the state API's unavailability when it cannot be replayed.
    fn already_completed(
        &mut self,
        cfg: &Config,
        req: Fingerprinted,
        response: StoredResponse,
        expires_in_ms: Option<u64>,
        waited_ms: Option<u64>,
        now_ms: u64,
    ) -> Turn {
        let rec = Completed {
            fingerprint: req.fingerprint.clone(),
            status: response.status,
            headers: response.headers,
            body: response.body,
            replayable: response.replayable,
            expires_at_ms: expires_in_ms.map(|e| req.sent_ms.saturating_add(e)),
        };
        // Counted from the claim, not from its answer's arrival: never later than the record.
        let left = rec.expires_at_ms.map(|at| at.saturating_sub(now_ms));
        match completed_reply(cfg, &rec, left) {
            Ok((metric, reply)) => {
                let id = req.req.id();
                let mut t = match waited_ms {
                    Some(_) => self
                        .reply(Some(metric), waited(reply, req.req.wait_s))
                        .with(Effect::Count(Metric::WaitReplayed)),
                    None => self.reply(Some(metric), reply),
                };
                // No expiry (an older state API): nothing to bound the entry by.
                if let Some(expires_in_ms) = expires_in_ms {
                    t.push(Note::Remember {
                        id,
                        record: Box::new(rec),
                        since_ms: req.sent_ms,
                        expires_in_ms,
                    });
                }
                t
            }
            Err(why) => self.unavailable(cfg, req, why),
        }
    }

    /// The state API refused the claim (a 4xx): a configuration or contract error, not an
    /// outage, so the request is never forwarded, not even where the route fails open.
    fn refused(&mut self, req: &Fingerprinted, status: u16, detail: &str) -> Turn {
        let log = Flow::log(
            Level::Error,
            format!(
                "the state API refused the claim for {} with HTTP {status}: {detail}",
                req.req.endpoint,
            ),
        );
        self.reply(
            Some(Metric::ClaimRefused),
            LocalReply::problem(
                ProblemKind::Internal,
                format!("the idempotency store refused this request (HTTP {status}); nothing was forwarded"),
            ),
        )
        .with(Effect::Count(Metric::StateApiErrors))
        .with(log)
    }

    /// [`Flow::forward`], with the line that says why first.
    pub(super) fn forward_logged(&mut self, cfg: &Config, claimed: Claimed, log: Out) -> Turn {
        let mut t = self.forward(cfg, claimed);
        t.outs.insert(0, log);
        t
    }

    /// The key is ours: the request goes upstream with the key and the fencing token.
    pub(super) fn forward(&mut self, cfg: &Config, claimed: Claimed) -> Turn {
        let mut t = Turn::pause();
        let token = claimed.token;
        let asked = cfg.lease_for(claimed.req.req.route);
        if claimed.lease_ms < asked {
            t.push(Flow::log(
                Level::Warn,
                format!(
                    "the state API granted a {} ms lease for {} ({} ms asked): heartbeats follow the grant",
                    claimed.lease_ms,
                    claimed.endpoint(),
                    asked
                ),
            ));
        }
        let key = claimed.req.req.key.clone();
        t.push(self.effect(|stream| Effect::SetRequestHeader {
            stream,
            name: key::HEADER,
            value: key,
        }));
        t.push(self.effect(|stream| Effect::SetRequestHeader {
            stream,
            name: FENCING_TOKEN_HEADER,
            value: token.to_string(),
        }));
        // The request as the edge names it: an upstream records its attempts by it, so that a
        // reconcile (or a later attempt) is answered about this request, not another of the key.
        let endpoint = claimed.req.req.endpoint.clone();
        t.push(self.effect(|stream| Effect::SetRequestHeader {
            stream,
            name: ENDPOINT_HEADER,
            value: endpoint,
        }));
        let fingerprint = claimed.req.fingerprint.hex.clone();
        t.push(self.effect(|stream| Effect::SetRequestHeader {
            stream,
            name: FINGERPRINT_HEADER,
            value: fingerprint,
        }));
        // Sent once: Envoy's router below the filter would otherwise send it again under the
        // same claim, on a 5xx, a reset or a per-try timeout the route retries or hedges on,
        // and the upstream would run it twice with one fencing token (issue 46, finding 3).
        if !contract::undo::undone(contract::undo::Fix::RouterRetries) {
            for &name in headers::ROUTER_RETRY_HEADERS {
                t.push(self.effect(|stream| Effect::RemoveRequestHeader { stream, name }));
            }
            let (name, value) = headers::ROUTER_NO_RETRIES;
            t.push(self.effect(|stream| Effect::SetRequestHeader {
                stream,
                name,
                value: value.to_owned(),
            }));
        }
        t.push(claimed.register(cfg));
        t.push(Effect::Count(Metric::Claimed));
        t.push(Note::ForgetRunning(claimed.req.req.id()));
        t.push(self.effect(|stream| Effect::ResumeRequest { stream }));
        self.state = State::Upstream(claimed);
        t
    }

    /// The state API cannot be used: 503, or forward where the route fails open.
    fn unavailable(&mut self, cfg: &Config, req: Fingerprinted, why: String) -> Turn {
        let fail_open = cfg
            .routes
            .get(req.req.route)
            .is_some_and(|r| r.on_state_unavailable == OnStateUnavailable::FailOpen);
        let log = Flow::log(
            Level::Error,
            format!(
                "idempotency state API unusable for {}: {why}",
                req.req.endpoint
            ),
        );
        // The claim may have been committed all the same (its answer was lost on the way):
        // nothing is forwarded under it, so its record is given back by its nonce. Where the
        // route fails open the request goes on unprotected, and nothing is given back.
        let abandon = (!fail_open).then(|| abandon_of(&req)).flatten();
        if fail_open {
            self.state = State::FailedOpen;
            let mut t = Turn::pause()
                .with(Effect::Count(Metric::StateApiErrors))
                .with(log)
                .with(Effect::Count(Metric::FailedOpen));
            t.push(self.effect(|stream| Effect::RemoveRequestHeader {
                stream,
                name: FENCING_TOKEN_HEADER,
            }));
            t.push(self.effect(|stream| Effect::ResumeRequest { stream }));
            return t;
        }
        let t = self
            .reply(Some(Metric::StateApiErrors), reply::state_unavailable())
            .with(log);
        match abandon {
            Some(note) => t.with(note),
            None => t,
        }
    }
}

/// Issue 46, seed 89644: a grant's lease runs from the claim's commit, which the filter cannot
/// see but which came after the claim was sent, so the filter counts it from the sending. A
/// grant is forwarded only while at least one heartbeat interval of its lease is left
/// ([`heartbeat_interval`], the one the registry keeps),
/// which is what a claim answered at once has left when its first heartbeat is due; with less,
/// the first heartbeat could not be counted on to land before the lease runs out, and past it
/// the record may already be another claim's (its owner looked silent for a lease: an
/// operator's release, a takeover) that has run. `Some(elapsed)`: too late.
fn too_late(cfg: &Config, claimed: &Claimed, now_ms: u64) -> Option<u64> {
    let elapsed = now_ms.saturating_sub(claimed.req.sent_ms);
    let interval = heartbeat_interval(cfg.heartbeat_for(claimed.req.req.route), claimed.lease_ms);
    let left = claimed.lease_ms.saturating_sub(elapsed);
    (elapsed >= claimed.lease_ms || left < interval).then_some(elapsed)
}

/// The note that gives back a claim sent with a nonce whose answer never came.
pub(super) fn abandon_of(req: &Fingerprinted) -> Option<Note> {
    let nonce = req.nonce.clone()?;
    Some(Note::Abandon(Box::new(contract::wire::AbandonRequest {
        key: req.req.key.clone(),
        subject: req.req.subject.clone(),
        endpoint: req.req.endpoint.clone(),
        namespace: req.req.namespace.clone(),
        nonce,
    })))
}

/// An answer given after waiting for the key (RFC 7240: the preference was applied).
fn waited(reply: LocalReply, wait_s: u64) -> LocalReply {
    reply.with_header("preference-applied", format!("wait={wait_s}"))
}

impl Flow {
    /// When the claim this flow holds was sent: its lease is counted from then (the worker
    /// registers it for heartbeats as last heard of at that time).
    pub fn claim_sent_ms(&self) -> Option<u64> {
        match &self.state {
            State::Reconciling(c)
            | State::Upstream(c)
            | State::Capturing(c, _)
            | State::Writing(c, _) => Some(c.req.sent_ms),
            _ => None,
        }
    }

    /// The worker sends (or queues) this stream's claim under `nonce`.
    pub fn claim_sent(&mut self, nonce: String) {
        if let State::Claiming(req) = &mut self.state {
            req.nonce = Some(nonce);
        }
    }

    /// The worker dropped this stream's queued claim unsent: there is nothing to give back.
    pub fn claim_unsent(&mut self) {
        if let State::Claiming(req) = &mut self.state {
            req.nonce = None;
        }
    }

    /// The worker's waiters are at their bound: this claim does not wait, and its answer does
    /// not say it did.
    pub fn wait_refused(&mut self) {
        if let State::Claiming(req) = &mut self.state {
            req.req.wait_s = 0;
        }
    }
}

/// The answer to a completed record: its metric and reply, or why it cannot be used.
/// `expires_in_ms`: how long the record is kept from now, when known (`Idempotency-Key-
/// Expires-In`).
pub(crate) fn completed_reply(
    cfg: &Config,
    rec: &Completed,
    expires_in_ms: Option<u64>,
) -> Result<(Metric, crate::reply::LocalReply), String> {
    let mut r = reply::for_completed(
        rec.status,
        &rec.headers,
        &rec.body,
        rec.replayable,
        &cfg.replay_extra_headers,
    )?;
    if let Some(ms) = expires_in_ms {
        r = r.with_header(
            crate::headers::EXPIRES_HEADER,
            crate::headers::expires_in(ms),
        );
    }
    Ok((
        if rec.replayable {
            Metric::Replayed
        } else {
            Metric::NotReplayable
        },
        r,
    ))
}
