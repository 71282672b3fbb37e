//! The per-request state machine. It sees events (request headers, body, the state API's
//! answers, the upstream response) and answers with effects for the glue to perform and a
//! verdict for the current callback. It never calls the host, so it is tested natively and in
//! wasm.
//!
//! ```text
//! Start ──not protected / optional without key──▶ Passthrough
//!   │ headers (401/400/413 ▶ Replied)
//!   ▼
//! Buffering ──end of body──▶ Claiming ──claimed──▶ Upstream ──response headers──▶ Capturing
//!                              │  in_progress/completed/mismatch ▶ Replied          │ end of response
//!                              │  state API down ▶ Replied (503) or FailedOpen      ▼
//!                              │                                        Writing (complete/release,
//!                              │                                        last chunk held) ──▶ Finished
//! ```
//!
//! With the worker's replay cache ([`crate::cache`]), a request whose (key, subject, endpoint)
//! is cached as completed is answered at the end of its body, without a claim: replay, 409
//! not replayable, or 422 for another fingerprint. A complete that keeps failing is handed over
//! to the worker ([`crate::retry`]) when the response goes on, or when the stream ends first.

use crate::cache::{self, ReplayCache};
use crate::config::{Config, KeyPolicy, OnStateUnavailable, SubjectSource};
use crate::headers::{self, LocalReply};
use crate::heartbeat::InFlight;
use crate::key::{self, parse_key_header};
use crate::metrics::Metric;
use crate::outcome::{classify, Outcome};
use crate::retry::{self, PendingComplete};
use contract::fingerprint::{self, FingerprintError};
use contract::wire::{
    ClaimRequest, ClaimResponse, CompleteRequest, ReleaseRequest, StoredResponse,
    FENCING_TOKEN_HEADER,
};
use contract::ProblemKind;
use std::cell::RefCell;
use std::rc::Rc;

/// Milliseconds since the epoch (the glue reads the host's clock).
pub type Clock = Rc<dyn Fn() -> u64>;

/// Longest accepted subject (bytes).
pub const MAX_SUBJECT_LEN: usize = 1024;

/// What the glue does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// `send_http_response`; the stream is answered and nothing is forwarded.
    Reply(LocalReply),
    /// `dispatch_http_call` to `/v1/claim` with this JSON body.
    DispatchClaim(Vec<u8>),
    /// `/v1/complete`.
    DispatchComplete(Vec<u8>),
    /// `/v1/release`.
    DispatchRelease(Vec<u8>),
    /// Replace a request header (all its values).
    SetRequestHeader(&'static str, String),
    RemoveRequestHeader(&'static str),
    /// `resume_http_request` (or, inside the request callback itself, return Continue).
    ResumeRequest,
    /// `resume_http_response`.
    ResumeResponse,
    /// Add to the worker's heartbeat registry.
    Register(InFlight),
    /// Remove this token from the worker's heartbeat registry.
    Unregister(i64),
    /// Give a complete to the worker (the claim stays registered): a failed one to retry, or
    /// an untried one to send at once (`background`).
    Handoff(PendingComplete),
    /// `complete_in_background`: ask the worker whether it can take a complete of this many
    /// payload bytes, and tell [`Flow::complete_in_background`].
    OfferComplete(usize),
    Count(Metric),
    Log(Level, String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

/// The return value of the current callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    Pause,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub effects: Vec<Effect>,
    pub verdict: Verdict,
}

impl Step {
    fn cont() -> Self {
        Self {
            effects: Vec::new(),
            verdict: Verdict::Continue,
        }
    }
    fn pause() -> Self {
        Self {
            effects: Vec::new(),
            verdict: Verdict::Pause,
        }
    }
    fn with(mut self, e: Effect) -> Self {
        self.effects.push(e);
        self
    }
}

/// The answer to a callout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Callout {
    /// Could not be dispatched, was reset or timed out before any response.
    Failed(String),
    /// The state API answered (any status).
    Answer { status: u16, body: Vec<u8> },
}

/// What the glue knows when request headers arrive.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    /// All request headers, pseudo-headers included, as Envoy lists them (repeats kept).
    pub headers: &'a [(String, String)],
    /// The subject read from dynamic metadata (only for `subject.metadata`).
    pub metadata_subject: Option<&'a str>,
}

impl RequestHead<'_> {
    fn values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
    fn first(&self, name: &str) -> Option<&str> {
        self.values(name).into_iter().next()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Req {
    route: usize,
    key: String,
    subject: String,
    /// `"<METHOD> <path without query>"`.
    endpoint: String,
    method: String,
    path: String,
    query: String,
    content_type: Option<String>,
    /// Body bytes seen so far (cumulative while paused).
    body_size: usize,
    /// Set once the body is read.
    fingerprint: String,
    fingerprint_alg: &'static str,
    /// When the claim was sent (only read with a replay cache).
    sent_ms: u64,
}

impl Req {
    fn cache_id(&self) -> cache::Id {
        cache::id(&self.key, &self.subject, &self.endpoint)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Claimed {
    req: Req,
    token: i64,
}

impl Claimed {
    fn in_flight(&self) -> InFlight {
        InFlight {
            key: self.req.key.clone(),
            subject: self.req.subject.clone(),
            endpoint: self.req.endpoint.clone(),
            token: self.token,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Capture {
    status: u16,
    headers: Vec<(String, String)>,
    /// Response body bytes buffered so far (cumulative: the filter pauses every chunk).
    size: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Write {
    Complete {
        payload: Vec<u8>,
        attempts: u8,
        /// The record to cache once stored (with a replay cache).
        fill: Option<Box<cache::Completed>>,
        /// When the current attempt was sent (only read with a replay cache).
        sent_ms: u64,
    },
    Release {
        payload: Vec<u8>,
        attempts: u8,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Start,
    Passthrough,
    Buffering(Req),
    Claiming(Req),
    Upstream(Claimed),
    Capturing(Claimed, Capture),
    Writing(Claimed, Write),
    FailedOpen,
    Replied,
    Finished,
}

/// How many times a complete or release is sent before giving up.
const WRITE_ATTEMPTS: u8 = 2;

pub struct Flow {
    cfg: Rc<Config>,
    state: State,
    /// The worker's replay cache, if any.
    cache: Option<Rc<RefCell<ReplayCache>>>,
    clock: Clock,
}

fn reply(metric: Option<Metric>, r: LocalReply) -> Step {
    let mut s = Step::pause();
    if let Some(m) = metric {
        s.effects.push(Effect::Count(m));
    }
    s.effects.push(Effect::Reply(r));
    s
}

fn to_json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

/// The answer to a completed record (from the state API or the cache): the metric and reply,
/// or why it cannot be used.
fn completed_reply(
    rec: &cache::Completed,
    extra: &[String],
) -> Result<(Metric, LocalReply), String> {
    if !rec.replayable {
        let mut r = LocalReply::problem(
            ProblemKind::OutcomeNotReplayable,
            format!("the request completed with status {} but its response was too large to keep; it will not run again", rec.status),
        );
        if let Some((_, loc)) = rec
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("location"))
        {
            r = r.with_header("location", loc.clone());
        }
        return Ok((Metric::NotReplayable, r));
    }
    if !(100..=999).contains(&rec.status) {
        return Err(format!(
            "stored status {} is not an HTTP status",
            rec.status
        ));
    }
    Ok((
        Metric::Replayed,
        LocalReply::replay(rec.status, &rec.headers, extra, rec.body.clone()),
    ))
}

fn in_progress_reply(retry_after_s: u32) -> LocalReply {
    LocalReply::problem(
        ProblemKind::InProgress,
        "a request with this key is still being processed; retry later",
    )
    .with_header("retry-after", retry_after_s.max(1).to_string())
}

fn mismatch_reply(endpoint: &str) -> LocalReply {
    LocalReply::problem(
        ProblemKind::KeyReuseMismatch,
        format!("this Idempotency-Key was used with a different request to {endpoint}"),
    )
}

impl Flow {
    /// A flow without a replay cache.
    pub fn new(cfg: Rc<Config>) -> Self {
        Self {
            cfg,
            state: State::Start,
            cache: None,
            clock: Rc::new(|| 0),
        }
    }

    /// A flow that answers from, and fills, the worker's replay cache.
    pub fn with_cache(cfg: Rc<Config>, cache: Rc<RefCell<ReplayCache>>, clock: Clock) -> Self {
        Self {
            cfg,
            state: State::Start,
            cache: Some(cache),
            clock,
        }
    }

    fn caching(&self) -> bool {
        self.cache
            .as_ref()
            .is_some_and(|c| c.try_borrow().is_ok_and(|c| c.enabled()))
    }

    fn fill(&self, id: cache::Id, rec: cache::Completed, since_ms: u64, expires_in_ms: u64) {
        if let Some(Ok(mut c)) = self.cache.as_ref().map(|c| c.try_borrow_mut()) {
            c.insert(id, rec, since_ms, expires_in_ms);
        }
    }

    /// The answer from the replay cache, if the record is there.
    fn answer_from_cache(&mut self, req: &Req) -> Option<Step> {
        let cache = Rc::clone(self.cache.as_ref()?);
        let answer = {
            let mut cache = cache.try_borrow_mut().ok()?;
            if !cache.enabled() {
                return None;
            }
            let (id, now) = (req.cache_id(), (self.clock)());
            match cache.get(&id, now) {
                Some(rec)
                    if rec.fingerprint_alg != req.fingerprint_alg
                        || rec.fingerprint != req.fingerprint =>
                {
                    (
                        Metric::Mismatch422,
                        mismatch_reply(&req.endpoint),
                        Metric::ReplayCacheHits,
                    )
                }
                Some(rec) => {
                    let (metric, reply) =
                        completed_reply(rec, &self.cfg.replay_extra_headers).ok()?;
                    (metric, reply, Metric::ReplayCacheHits)
                }
                None => {
                    let retry_after_s =
                        cache.running(&id, &req.fingerprint, req.fingerprint_alg, now)?;
                    (
                        Metric::InProgress409,
                        in_progress_reply(retry_after_s),
                        Metric::InFlightCacheHits,
                    )
                }
            }
        };
        let (metric, reply, hit) = answer;
        Some(self.answer(Some(metric), reply).with(Effect::Count(hit)))
    }

    /// Remember, for a short time, that the key is in progress elsewhere (see
    /// [`ReplayCache::hold_running`]): at most `in_flight_cache_ms`, never past the lease.
    fn hold_running(&self, req: &Req, retry_after_s: u32, lease_remaining_ms: u64) {
        let for_ms = self.cfg.in_flight_cache_ms.min(lease_remaining_ms);
        if let Some(Ok(mut c)) = self.cache.as_ref().map(|c| c.try_borrow_mut()) {
            c.hold_running(
                req.cache_id(),
                &req.fingerprint,
                req.fingerprint_alg,
                retry_after_s,
                req.sent_ms,
                for_ms,
            );
        }
    }

    fn forget_running(&self, id: &cache::Id) {
        if let Some(Ok(mut c)) = self.cache.as_ref().map(|c| c.try_borrow_mut()) {
            c.forget_running(id);
        }
    }

    /// The upstream response is wanted (read `response.code_details`/`flags` for it).
    pub fn awaits_response(&self) -> bool {
        matches!(self.state, State::Upstream(_))
    }

    /// A local reply was (or is being) sent: response callbacks must leave it alone.
    pub fn replied(&self) -> bool {
        matches!(self.state, State::Replied)
    }

    pub fn is_passthrough(&self) -> bool {
        matches!(self.state, State::Passthrough | State::FailedOpen)
    }

    pub fn state_name(&self) -> &'static str {
        match self.state {
            State::Start => "start",
            State::Passthrough => "passthrough",
            State::Buffering(_) => "buffering",
            State::Claiming(_) => "claiming",
            State::Upstream(_) => "upstream",
            State::Capturing(..) => "capturing",
            State::Writing(..) => "writing",
            State::FailedOpen => "failed_open",
            State::Replied => "replied",
            State::Finished => "finished",
        }
    }

    fn answer(&mut self, metric: Option<Metric>, r: LocalReply) -> Step {
        self.state = State::Replied;
        reply(metric, r)
    }

    // -----------------------------------------------------------------------------------------
    // Request
    // -----------------------------------------------------------------------------------------

    pub fn on_request_headers(&mut self, head: RequestHead<'_>, end_of_stream: bool) -> Step {
        if !matches!(self.state, State::Start) {
            return Step::cont();
        }
        let method = head.first(":method").unwrap_or("").to_owned();
        let full_path = head.first(":path").unwrap_or("");
        let (path, query) = match full_path.split_once('?') {
            Some((p, q)) => (p.to_owned(), q.to_owned()),
            None => (full_path.to_owned(), String::new()),
        };
        let cfg = Rc::clone(&self.cfg);
        let Some(route_idx) = cfg.route_index(&method, &path) else {
            self.state = State::Passthrough;
            return Step::cont();
        };
        let Some(route) = cfg.routes.get(route_idx) else {
            self.state = State::Passthrough;
            return Step::cont();
        };
        let key_values = head.values(key::HEADER);
        if key_values.is_empty() && route.key == KeyPolicy::Optional {
            // Not protected without a key; a client copy of the fencing header is never trusted.
            self.state = State::Passthrough;
            return Step::cont().with(Effect::RemoveRequestHeader(FENCING_TOKEN_HEADER));
        }

        let subject = match &cfg.subject {
            SubjectSource::Header(h) => match head.values(h).as_slice() {
                [one] => Some((*one).to_owned()),
                _ => None,
            },
            SubjectSource::Metadata(_) => head.metadata_subject.map(str::to_owned),
        };
        let Some(subject) = subject.filter(|s| valid_subject(s)) else {
            return self.answer(
                Some(Metric::Unauthenticated401),
                LocalReply::problem(
                    ProblemKind::Unauthenticated,
                    "this operation needs an authenticated caller",
                ),
            );
        };

        let key = match parse_key_header(&key_values) {
            Ok(Some(k)) => k,
            Ok(None) => {
                return self.answer(
                    Some(Metric::BadKey400),
                    LocalReply::problem(
                        ProblemKind::MissingKey,
                        format!("{} {} requires an Idempotency-Key header", method, path),
                    ),
                )
            }
            Err(e) => {
                return self.answer(
                    Some(Metric::BadKey400),
                    LocalReply::problem(ProblemKind::InvalidKey, e.to_string()),
                )
            }
        };

        let max = cfg.max_request_body_bytes;
        if let Some(len) = head
            .first("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            if len > max {
                return self.too_large();
            }
        }

        let req = Req {
            route: route_idx,
            key,
            subject,
            endpoint: format!("{method} {path}"),
            method,
            path,
            query,
            content_type: head.first("content-type").map(str::to_owned),
            body_size: 0,
            fingerprint: String::new(),
            fingerprint_alg: "",
            sent_ms: 0,
        };
        if end_of_stream {
            return self.finish_request(req, &[]);
        }
        self.state = State::Buffering(req);
        Step::pause()
    }

    fn too_large(&mut self) -> Step {
        let max = self.cfg.max_request_body_bytes;
        self.answer(
            Some(Metric::TooLarge413),
            LocalReply::problem(
                ProblemKind::PayloadTooLarge,
                format!("the request body is limited to {max} bytes"),
            ),
        )
    }

    /// A request body callback. `body_size` is cumulative (the filter paused). `read(n)` reads
    /// the first `n` buffered bytes; it is called at most once, at the end of the body.
    pub fn on_request_body(
        &mut self,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce(usize) -> Option<Vec<u8>>,
    ) -> Step {
        let State::Buffering(req) = &mut self.state else {
            return Step::cont();
        };
        req.body_size = body_size;
        if body_size as u64 > self.cfg.max_request_body_bytes {
            return self.too_large();
        }
        if !end_of_stream {
            return Step::pause();
        }
        self.body_done(read)
    }

    /// Request trailers (HTTP/2): the body ended without `end_of_stream` on a body callback.
    pub fn on_request_trailers(&mut self, read: impl FnOnce(usize) -> Option<Vec<u8>>) -> Step {
        if !matches!(self.state, State::Buffering(_)) {
            return Step::cont();
        }
        self.body_done(read)
    }

    fn body_done(&mut self, read: impl FnOnce(usize) -> Option<Vec<u8>>) -> Step {
        let State::Buffering(req) = std::mem::replace(&mut self.state, State::Start) else {
            return Step::cont();
        };
        let body = if req.body_size == 0 {
            Some(Vec::new())
        } else {
            read(req.body_size)
        };
        match body {
            Some(body) => self.finish_request(req, &body),
            None => self
                .answer(
                    None,
                    LocalReply::problem(
                        ProblemKind::Internal,
                        "the request body could not be read",
                    ),
                )
                .with(Effect::Log(
                    Level::Error,
                    "could not read the buffered request body".into(),
                )),
        }
    }

    fn finish_request(&mut self, mut req: Req, body: &[u8]) -> Step {
        let fp = match fingerprint::fingerprint(
            &req.method,
            &req.path,
            &req.query,
            req.content_type.as_deref(),
            body,
        ) {
            Ok(fp) => fp,
            Err(e @ FingerprintError::DuplicateMember(_)) => {
                return self.answer(
                    Some(Metric::BadBody400),
                    LocalReply::problem(ProblemKind::DuplicateJsonMember, e.to_string()),
                )
            }
        };
        req.fingerprint = fp.hex;
        req.fingerprint_alg = fp.alg;
        if let Some(step) = self.answer_from_cache(&req) {
            return step;
        }
        let claim = ClaimRequest {
            key: req.key.clone(),
            subject: req.subject.clone(),
            endpoint: req.endpoint.clone(),
            fingerprint: req.fingerprint.clone(),
            fingerprint_alg: fp.alg.to_owned(),
            lease_ms: Some(self.cfg.lease_ms),
        };
        if self.caching() {
            req.sent_ms = (self.clock)();
        }
        self.state = State::Claiming(req);
        Step::pause().with(Effect::DispatchClaim(to_json(&claim)))
    }

    /// The answer to `/v1/claim` (or its failure, including a failed dispatch).
    pub fn on_claim_answer(&mut self, answer: Callout) -> Step {
        if !matches!(self.state, State::Claiming(_)) {
            return Step::cont().with(Effect::Log(
                Level::Warn,
                "claim answer in an unexpected state".into(),
            ));
        }
        let State::Claiming(req) = std::mem::replace(&mut self.state, State::Start) else {
            return Step::cont();
        };
        let parsed = match &answer {
            Callout::Answer { status, body } if (200..300).contains(status) => {
                crate::answers::claim(body).map_err(|e| format!("unreadable claim answer: {e}"))
            }
            Callout::Answer { status, body } => Err(format!(
                "claim answered HTTP {status}: {}",
                String::from_utf8_lossy(body.get(..body.len().min(200)).unwrap_or_default())
            )),
            Callout::Failed(why) => Err(format!("claim failed: {why}")),
        };
        let extra = &self.cfg.replay_extra_headers;
        match parsed {
            Err(why) => self.unavailable(req, why),
            Ok(ClaimResponse::Claimed {
                token, reclaimed, ..
            }) => {
                let mut step = Step::pause();
                if reclaimed {
                    step.effects.push(Effect::Log(
                        Level::Info,
                        format!(
                            "key of {} reclaimed after an expired lease (token {token})",
                            req.endpoint
                        ),
                    ));
                }
                step.effects.extend([
                    Effect::SetRequestHeader(key::HEADER, req.key.clone()),
                    Effect::SetRequestHeader(FENCING_TOKEN_HEADER, token.to_string()),
                    Effect::Register(InFlight {
                        key: req.key.clone(),
                        subject: req.subject.clone(),
                        endpoint: req.endpoint.clone(),
                        token,
                    }),
                    Effect::Count(Metric::Claimed),
                    Effect::ResumeRequest,
                ]);
                self.forget_running(&req.cache_id());
                self.state = State::Upstream(Claimed { req, token });
                step
            }
            Ok(ClaimResponse::InProgress {
                retry_after_s,
                lease_remaining_ms,
            }) => {
                self.hold_running(&req, retry_after_s, lease_remaining_ms);
                self.answer(
                    Some(Metric::InProgress409),
                    in_progress_reply(retry_after_s),
                )
            }
            Ok(ClaimResponse::Mismatch) => {
                self.answer(Some(Metric::Mismatch422), mismatch_reply(&req.endpoint))
            }
            Ok(ClaimResponse::Completed {
                response,
                expires_in_ms,
            }) => {
                let body = if response.replayable {
                    match response.body() {
                        Ok(b) => b,
                        Err(e) => {
                            return self.unavailable(req, format!("stored body is not base64: {e}"))
                        }
                    }
                } else {
                    Vec::new()
                };
                let rec = cache::Completed {
                    fingerprint: req.fingerprint.clone(),
                    fingerprint_alg: req.fingerprint_alg,
                    status: response.status,
                    headers: response.headers,
                    body,
                    replayable: response.replayable,
                };
                match completed_reply(&rec, extra) {
                    Ok((metric, reply)) => {
                        // No expiry (an older state API): nothing to bound the entry by.
                        if let Some(expires_in_ms) = expires_in_ms {
                            self.fill(req.cache_id(), rec, req.sent_ms, expires_in_ms);
                        }
                        self.answer(Some(metric), reply)
                    }
                    Err(why) => self.unavailable(req, why),
                }
            }
        }
    }

    /// The state API cannot be used: 503, or forward where the route fails open.
    fn unavailable(&mut self, req: Req, why: String) -> Step {
        let fail_open = self
            .cfg
            .routes
            .get(req.route)
            .is_some_and(|r| r.on_state_unavailable == OnStateUnavailable::FailOpen);
        let log = Effect::Log(
            Level::Error,
            format!("idempotency state API unusable for {}: {why}", req.endpoint),
        );
        if fail_open {
            self.state = State::FailedOpen;
            return Step::pause()
                .with(Effect::Count(Metric::StateApiErrors))
                .with(log)
                .with(Effect::Count(Metric::FailedOpen))
                .with(Effect::RemoveRequestHeader(FENCING_TOKEN_HEADER))
                .with(Effect::ResumeRequest);
        }
        self.answer(
            Some(Metric::StateApiErrors),
            LocalReply::problem(
                ProblemKind::StateUnavailable,
                "the idempotency store is unavailable; nothing was forwarded, retry later",
            )
            .with_header("retry-after", "1"),
        )
        .with(log)
    }

    // -----------------------------------------------------------------------------------------
    // Response
    // -----------------------------------------------------------------------------------------

    /// Response headers. `details`/`flags`: `response.code_details` and `response.flags`.
    pub fn on_response_headers(
        &mut self,
        headers: &[(String, String)],
        details: &str,
        flags: u64,
        end_of_stream: bool,
    ) -> Step {
        if !matches!(self.state, State::Upstream(_)) {
            // Our own local replies, passthrough and fail-open streams: untouched (C-6).
            return Step::cont();
        }
        let State::Upstream(claimed) = std::mem::replace(&mut self.state, State::Start) else {
            return Step::cont();
        };
        let status = headers
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| v.parse::<u16>().ok())
            .unwrap_or(0);
        let on_5xx = self
            .cfg
            .routes
            .get(claimed.req.route)
            .map(|r| r.on_5xx)
            .unwrap_or_default();
        match classify(status, details, flags, on_5xx) {
            Outcome::Release => {
                let payload = to_json(&ReleaseRequest {
                    key: claimed.req.key.clone(),
                    subject: claimed.req.subject.clone(),
                    endpoint: claimed.req.endpoint.clone(),
                    token: claimed.token,
                });
                let log = Effect::Log(
                    Level::Info,
                    format!(
                        "releasing the key of {}: HTTP {status} ({details})",
                        claimed.req.endpoint
                    ),
                );
                self.state = State::Writing(
                    claimed,
                    Write::Release {
                        payload: payload.clone(),
                        attempts: 1,
                    },
                );
                Step::pause()
                    .with(log)
                    .with(Effect::DispatchRelease(payload))
            }
            Outcome::Store => {
                let capture = Capture {
                    status,
                    headers: headers::stored(headers, &self.cfg.replay_extra_headers),
                    size: 0,
                };
                if end_of_stream {
                    return self.complete(claimed, capture, Some(Vec::new()));
                }
                self.state = State::Capturing(claimed, capture);
                Step::cont()
            }
        }
    }

    /// A response body callback. While capturing, every chunk is held (`Pause`), so
    /// `body_size` is cumulative and nothing reaches the client before the outcome is stored:
    /// holding only the last chunk is not enough, because a response with a Content-Length
    /// is complete for the client as soon as its last data byte arrives, which Envoy may
    /// deliver before an empty end-of-stream frame (seen with Envoy 1.40 and HTTP/1
    /// upstreams). `read(n)` reads the first `n` buffered bytes.
    ///
    /// Once the body outgrows `max_stored_body_bytes` the outcome is known not to be
    /// replayable: it is stored at once (status and headers, no body) while the response is
    /// held, and then the response streams on untouched.
    pub fn on_response_body(
        &mut self,
        body_size: usize,
        end_of_stream: bool,
        read: impl FnOnce(usize) -> Option<Vec<u8>>,
    ) -> Step {
        match &mut self.state {
            State::Capturing(_, cap) => {
                cap.size = body_size;
                let max = usize::try_from(self.cfg.max_stored_body_bytes).unwrap_or(usize::MAX);
                if body_size <= max && !end_of_stream {
                    return Step::pause();
                }
                let State::Capturing(claimed, cap) =
                    std::mem::replace(&mut self.state, State::Start)
                else {
                    return Step::cont();
                };
                let body = if body_size > max {
                    None
                } else {
                    read(body_size)
                };
                self.complete(claimed, cap, body)
            }
            // Hold everything while a write is on its way.
            State::Writing(..) => Step::pause(),
            _ => Step::cont(),
        }
    }

    /// Response trailers: the response ended (`read` reads the buffered body).
    pub fn on_response_trailers(&mut self, read: impl FnOnce(usize) -> Option<Vec<u8>>) -> Step {
        match std::mem::replace(&mut self.state, State::Start) {
            State::Capturing(claimed, cap) => {
                let body = if cap.size == 0 {
                    Some(Vec::new())
                } else {
                    read(cap.size)
                };
                self.complete(claimed, cap, body)
            }
            s @ State::Writing(..) => {
                self.state = s;
                Step::pause()
            }
            other => {
                self.state = other;
                Step::cont()
            }
        }
    }

    /// Store the outcome; `body` is `None` when it is not kept (too large or unreadable).
    fn complete(&mut self, claimed: Claimed, cap: Capture, body: Option<Vec<u8>>) -> Step {
        let mut step = Step::pause();
        if body.is_none() {
            step.effects.push(Effect::Count(Metric::StoredWithoutBody));
        }
        let replayable = body.is_some();
        let body = body.unwrap_or_default();
        let (fill, sent_ms) = if self.caching() {
            let rec = cache::Completed {
                fingerprint: claimed.req.fingerprint.clone(),
                fingerprint_alg: claimed.req.fingerprint_alg,
                status: cap.status,
                headers: cap.headers.clone(),
                body: body.clone(),
                replayable,
            };
            (Some(Box::new(rec)), (self.clock)())
        } else {
            (None, 0)
        };
        let response = StoredResponse::new(cap.status, cap.headers, &body, replayable);
        let payload = to_json(&CompleteRequest {
            key: claimed.req.key.clone(),
            subject: claimed.req.subject.clone(),
            endpoint: claimed.req.endpoint.clone(),
            token: claimed.token,
            response,
        });
        let bytes = payload.len();
        // Not sent yet (attempts 0).
        self.state = State::Writing(
            claimed,
            Write::Complete {
                payload,
                attempts: 0,
                fill,
                sent_ms,
            },
        );
        if self.cfg.complete_in_background {
            // The worker takes it, or the stream sends it itself.
            return step.with(Effect::OfferComplete(bytes));
        }
        self.send_complete(step)
    }

    /// The stream sends its complete not tried yet (first attempt) and holds the response until
    /// it is answered.
    fn send_complete(&mut self, mut step: Step) -> Step {
        if let State::Writing(
            _,
            Write::Complete {
                payload, attempts, ..
            },
        ) = &mut self.state
        {
            *attempts = 1;
            step.effects.push(Effect::DispatchComplete(payload.clone()));
        }
        step
    }

    /// The worker's answer to [`Effect::OfferComplete`]. It can take the complete: it is
    /// handed over and the response goes on at once, before the outcome is stored (a retry
    /// meanwhile gets 409, or the replay from this worker's memory). It cannot (its
    /// `complete_retry_bytes` are in use): the stream stores the outcome itself, holding the
    /// response as without `complete_in_background`.
    pub fn complete_in_background(&mut self, worker_can_take: bool) -> Step {
        let State::Writing(claimed, Write::Complete { attempts: 0, .. }) = &self.state else {
            self.state = State::Finished;
            return Step::cont().with(Effect::Log(
                Level::Warn,
                "background complete in an unexpected state".into(),
            ));
        };
        if !worker_can_take {
            let log = Effect::Log(
                Level::Info,
                format!(
                    "the worker's complete_retry_bytes are in use: {} is stored before its response goes on",
                    claimed.req.endpoint
                ),
            );
            return self.send_complete(
                Step::pause()
                    .with(Effect::Count(Metric::CompleteHeld))
                    .with(log),
            );
        }
        let State::Writing(claimed, Write::Complete { payload, fill, .. }) =
            std::mem::replace(&mut self.state, State::Finished)
        else {
            return Step::cont();
        };
        Step::cont()
            .with(Effect::Handoff(PendingComplete {
                claim: claimed.in_flight(),
                payload,
                fill,
                background: true,
            }))
            .with(Effect::ResumeResponse)
    }

    /// The answer to `/v1/complete` or `/v1/release` (or its failure).
    pub fn on_write_answer(&mut self, answer: Callout) -> Step {
        if !matches!(self.state, State::Writing(..)) {
            return Step::cont().with(Effect::Log(
                Level::Warn,
                "write answer in an unexpected state".into(),
            ));
        }
        let State::Writing(claimed, write) = std::mem::replace(&mut self.state, State::Finished)
        else {
            return Step::cont();
        };
        let (what, ok_metric) = match &write {
            Write::Complete { .. } => ("complete", Metric::Completed),
            Write::Release { .. } => ("release", Metric::Released),
        };
        let token = claimed.token;
        let done = |mut step: Step| {
            step.effects.push(Effect::Unregister(token));
            step.effects.push(Effect::ResumeResponse);
            step
        };
        let (verdict, expires_in_ms) = retry::read_answer(&answer);
        match verdict {
            retry::Answer::Stored => {
                // Duplicates told "in progress" while this request ran are not any more.
                self.forget_running(&claimed.req.cache_id());
                if let (
                    Write::Complete {
                        fill: Some(rec),
                        sent_ms,
                        ..
                    },
                    Some(expires_in_ms),
                ) = (write, expires_in_ms)
                {
                    self.fill(claimed.req.cache_id(), *rec, sent_ms, expires_in_ms);
                }
                return done(Step::cont().with(Effect::Count(ok_metric)));
            }
            retry::Answer::FencedOut => {
                let body = match &answer {
                    Callout::Answer { body, .. } => body.as_slice(),
                    Callout::Failed(_) => &[],
                };
                return done(Step::cont().with(Effect::Count(Metric::FencedOut)).with(
                    Effect::Log(
                        Level::Warn,
                        format!(
                            "{what} for {} refused, a newer claim owns the key (token {token}): {}",
                            claimed.req.endpoint,
                            String::from_utf8_lossy(
                                body.get(..body.len().min(200)).unwrap_or_default()
                            )
                        ),
                    ),
                ));
            }
            retry::Answer::Refused(_) | retry::Answer::Failed => {}
        }
        let why = match &answer {
            Callout::Answer { status, .. } => format!("HTTP {status}"),
            Callout::Failed(why) => why.clone(),
        };
        let mut step = Step::pause().with(Effect::Count(Metric::StateApiErrors));
        let retryable = verdict == retry::Answer::Failed;
        let write = match write {
            Write::Complete {
                payload,
                attempts,
                fill,
                ..
            } if retryable && attempts < WRITE_ATTEMPTS => {
                let sent_ms = if fill.is_some() { (self.clock)() } else { 0 };
                step.effects.push(Effect::DispatchComplete(payload.clone()));
                Write::Complete {
                    payload,
                    attempts: attempts + 1,
                    fill,
                    sent_ms,
                }
            }
            Write::Release { payload, attempts } if retryable && attempts < WRITE_ATTEMPTS => {
                step.effects.push(Effect::DispatchRelease(payload.clone()));
                Write::Release {
                    payload,
                    attempts: attempts + 1,
                }
            }
            Write::Complete { payload, fill, .. } if retryable && self.cfg.retries_completes() => {
                step.effects.push(Effect::Log(
                    Level::Warn,
                    format!(
                        "complete for {} failed ({why}); the response goes on and this worker keeps retrying it (token {token})",
                        claimed.req.endpoint
                    ),
                ));
                step.effects.push(Effect::Handoff(PendingComplete {
                    claim: claimed.in_flight(),
                    payload,
                    fill,
                    background: false,
                }));
                step.effects.push(Effect::ResumeResponse);
                return step;
            }
            write => {
                if matches!(write, Write::Complete { .. }) {
                    step.effects.push(Effect::Count(Metric::CompleteGaveUp));
                }
                step.effects.push(Effect::Log(
                    Level::Error,
                    format!(
                        "{what} for {} failed ({why}); the key stays in progress until its lease runs out",
                        claimed.req.endpoint
                    ),
                ));
                return done(step);
            }
        };
        step.effects.insert(
            1,
            Effect::Log(
                Level::Warn,
                format!(
                    "{what} for {} failed ({why}); retrying",
                    claimed.req.endpoint
                ),
            ),
        );
        self.state = State::Writing(claimed, write);
        step
    }

    /// The stream is over (`on_done`/`on_log`). With a claim still open the heartbeat stops and
    /// the key stays `in_progress` until its lease runs out: the upstream may have executed.
    /// A complete still on its way is handed over to the worker instead (Envoy cancels the
    /// stream's callouts when it ends), so the outcome is stored all the same.
    pub fn on_stream_done(&mut self) -> Step {
        let state = std::mem::replace(&mut self.state, State::Finished);
        match state {
            State::Claiming(req) => Step::cont().with(Effect::Log(
                Level::Info,
                format!("stream of {} ended while claiming; any claim made runs out with its lease", req.endpoint),
            )),
            State::Writing(c, Write::Complete { payload, fill, .. }) if self.cfg.retries_completes() => Step::cont()
                .with(Effect::Log(
                    Level::Info,
                    format!(
                        "stream of {} ended while its outcome was being stored (token {}); this worker completes it",
                        c.req.endpoint, c.token
                    ),
                ))
                .with(Effect::Handoff(PendingComplete {
                    claim: c.in_flight(),
                    payload,
                    fill,
                    background: false,
                })),
            State::Upstream(c) | State::Capturing(c, _) | State::Writing(c, _) => Step::cont().with(Effect::Unregister(c.token)).with(Effect::Log(
                Level::Warn,
                format!(
                    "stream of {} ended before its outcome was stored (token {}); the key stays in progress until its lease runs out",
                    c.req.endpoint, c.token
                ),
            )),
            _ => Step::cont(),
        }
    }
}

fn valid_subject(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_SUBJECT_LEN && !s.chars().any(char::is_control)
}

#[cfg(test)]
mod tests;
