//! The HTTP context: reads what the flow needs from the host and performs its effects.

use super::abi::{self, HostError, Level};
use super::{callout_result, dispatch, Worker};
use crate::config::{Config, SubjectSource};
use crate::flow::{self, Callout, Effect, Flow, RequestHead, Step, Verdict};
use crate::headers::LocalReply;
use crate::metrics::Metric;
use crate::retry;
use contract::wire::{CLAIM_PATH, COMPLETE_PATH, RELEASE_PATH};
use contract::ProblemKind;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::rc::Rc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Inside a request callback: resuming the request means returning Continue.
    Request,
    /// Inside a response callback: resuming the response means returning Continue.
    Response,
    /// Inside a callout answer: resume through the host.
    Callout,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    Claim,
    Write,
}

pub(crate) struct Http {
    cfg: Option<Rc<Config>>,
    flow: Option<Flow>,
    worker: Rc<Worker>,
    pending: Option<(u32, Pending)>,
}

fn action(v: Verdict) -> Action {
    match v {
        Verdict::Continue => Action::Continue,
        Verdict::Pause => Action::Pause,
    }
}

/// Exactly `n` bytes of a buffer, or `None`.
fn read(buffer: u32, n: usize, what: &str) -> Option<Vec<u8>> {
    match abi::get_buffer(buffer, 0, n) {
        Ok(Some(b)) if b.len() == n => Some(b),
        Ok(Some(b)) => {
            abi::log(
                Level::Error,
                &format!("idempotency: {what}: asked for {n} bytes, got {}", b.len()),
            );
            None
        }
        Ok(None) => {
            abi::log(
                Level::Error,
                &format!("idempotency: {what}: no buffer ({n} bytes expected)"),
            );
            None
        }
        Err(e) => {
            abi::log(Level::Error, &format!("idempotency: {what}: {e}"));
            None
        }
    }
}

fn text(bytes: Option<Vec<u8>>) -> Option<String> {
    bytes.and_then(|b| String::from_utf8(b).ok())
}

impl Http {
    pub(crate) fn new(cfg: Option<Rc<Config>>, worker: Rc<Worker>) -> Self {
        let flow = cfg
            .clone()
            .map(|cfg| Flow::with_cache(cfg, Rc::clone(&worker.cache), Rc::clone(&worker.clock)));
        Self {
            cfg,
            flow,
            worker,
            pending: None,
        }
    }

    fn host_failed(&self, what: &str, e: HostError) {
        abi::log(Level::Error, &format!("idempotency: {what} failed: {e}"));
    }

    /// Performs the effects in order; returns the verdict for the current callback.
    fn perform(&mut self, step: Step, phase: Phase) -> Verdict {
        let mut verdict = step.verdict;
        for effect in step.effects {
            match effect {
                Effect::Reply(r) => {
                    self.reply(&r);
                    verdict = Verdict::Pause;
                }
                Effect::DispatchClaim(body) => {
                    verdict = self.dispatch(CLAIM_PATH, &body, Pending::Claim, phase, verdict)
                }
                Effect::DispatchComplete(body) => {
                    verdict = self.dispatch(COMPLETE_PATH, &body, Pending::Write, phase, verdict)
                }
                Effect::DispatchRelease(body) => {
                    verdict = self.dispatch(RELEASE_PATH, &body, Pending::Write, phase, verdict)
                }
                Effect::SetRequestHeader(name, value) => {
                    if let Err(e) = abi::replace_header(abi::MAP_REQUEST_HEADERS, name, &value) {
                        self.host_failed("setting a request header", e);
                    }
                }
                Effect::RemoveRequestHeader(name) => {
                    if let Err(e) = abi::remove_header(abi::MAP_REQUEST_HEADERS, name) {
                        self.host_failed("removing a request header", e);
                    }
                }
                Effect::ResumeRequest => {
                    if phase == Phase::Request {
                        verdict = Verdict::Continue;
                    } else if let Err(e) = abi::resume_request() {
                        self.host_failed("resuming the request", e);
                    }
                }
                Effect::ResumeResponse => {
                    if phase == Phase::Response {
                        verdict = Verdict::Continue;
                    } else if let Err(e) = abi::resume_response() {
                        self.host_failed("resuming the response", e);
                    }
                }
                Effect::Register(claim) => {
                    let now = abi::now_ms().unwrap_or(0);
                    if let Ok(mut r) = self.worker.registry.try_borrow_mut() {
                        r.register(claim.token, claim, now);
                    }
                }
                Effect::Unregister(token) => {
                    if let Ok(mut r) = self.worker.registry.try_borrow_mut() {
                        r.remove(token);
                    }
                }
                Effect::Handoff(pending) => self.hand_over(pending),
                Effect::OfferComplete(bytes) => {
                    let can_take = self
                        .worker
                        .retries
                        .try_borrow()
                        .is_ok_and(|r| r.can_take(bytes));
                    if let Some(flow) = self.flow.as_mut() {
                        let step = flow.complete_in_background(can_take);
                        verdict = self.perform(step, phase);
                    }
                }
                Effect::Count(m) => self.worker.counters.count(m),
                Effect::Log(level, msg) => {
                    let level = match level {
                        flow::Level::Debug => Level::Debug,
                        flow::Level::Info => Level::Info,
                        flow::Level::Warn => Level::Warn,
                        flow::Level::Error => Level::Error,
                    };
                    abi::log(level, &format!("idempotency: {msg}"));
                }
            }
        }
        verdict
    }

    /// The worker retries this complete from its tick, or sends it at once when it was not
    /// tried yet (see [`crate::retry`]).
    fn hand_over(&self, pending: retry::PendingComplete) {
        let now = abi::now_ms().unwrap_or(0);
        let endpoint = pending.claim.endpoint.clone();
        let background = pending.background;
        let (Ok(mut registry), Ok(mut retries), Ok(mut cache)) = (
            self.worker.registry.try_borrow_mut(),
            self.worker.retries.try_borrow_mut(),
            self.worker.cache.try_borrow_mut(),
        ) else {
            return;
        };
        match retry::hand_over(&mut registry, &mut retries, &mut cache, pending, now) {
            Ok(()) if background => self.worker.wake(),
            Ok(()) => {}
            Err(why) => {
                self.worker.counters.count(Metric::CompleteGaveUp);
                abi::log(
                    Level::Error,
                    &format!("idempotency: complete for {endpoint} given up ({why}); the key stays in progress until its lease runs out"),
                );
            }
        }
    }

    fn reply(&self, r: &LocalReply) {
        if let Err(e) = abi::send_response(u32::from(r.status), r.reason, &r.headers, &r.body) {
            self.host_failed("sending a local reply", e);
        }
    }

    /// Dispatch a callout; a failure to dispatch is the callout's answer, at once.
    fn dispatch(
        &mut self,
        path: &str,
        body: &[u8],
        kind: Pending,
        phase: Phase,
        verdict: Verdict,
    ) -> Verdict {
        let Some(cfg) = self.cfg.clone() else {
            return verdict;
        };
        match dispatch(&cfg, path, body) {
            Ok(token) => {
                self.pending = Some((token, kind));
                verdict
            }
            Err(why) => {
                let Some(flow) = self.flow.as_mut() else {
                    return verdict;
                };
                let step = match kind {
                    Pending::Claim => flow.on_claim_answer(Callout::Failed(why)),
                    Pending::Write => flow.on_write_answer(Callout::Failed(why)),
                };
                self.perform(step, phase)
            }
        }
    }

    fn metadata_subject(&self, cfg: &Config) -> Option<String> {
        let SubjectSource::Metadata(path) = &cfg.subject else {
            return None;
        };
        let mut full: Vec<&str> = vec!["metadata", "filter_metadata"];
        full.extend(path.iter().map(String::as_str));
        match abi::get_property(&full) {
            Ok(v) => text(v),
            Err(e) => {
                abi::log(
                    Level::Warn,
                    &format!("idempotency: reading the subject from metadata: {e}"),
                );
                None
            }
        }
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some((expected, kind)) = self.pending.take() else {
            abi::log(
                Level::Warn,
                &format!("idempotency: unexpected callout answer {token_id}"),
            );
            return;
        };
        if expected != token_id {
            abi::log(
                Level::Warn,
                &format!("idempotency: callout answer {token_id}, expected {expected}"),
            );
            self.pending = Some((expected, kind));
            return;
        }
        let answer = callout_result(num_headers, body_size);
        let Some(flow) = self.flow.as_mut() else {
            return;
        };
        let step = match kind {
            Pending::Claim => flow.on_claim_answer(answer),
            Pending::Write => flow.on_write_answer(answer),
        };
        self.perform(step, Phase::Callout);
    }

    fn on_done(&mut self) -> bool {
        if let Some(flow) = self.flow.as_mut() {
            let step = flow.on_stream_done();
            self.perform(step, Phase::Callout);
        }
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(cfg) = self.cfg.clone() else {
            return Action::Continue;
        };
        let headers = match abi::get_headers(abi::MAP_REQUEST_HEADERS) {
            Ok(h) => h,
            Err(e) => {
                self.host_failed("reading the request headers", e);
                self.reply(&LocalReply::problem(
                    ProblemKind::Internal,
                    "the request headers could not be read",
                ));
                return Action::Pause;
            }
        };
        let subject = self.metadata_subject(&cfg);
        let Some(flow) = self.flow.as_mut() else {
            return Action::Continue;
        };
        let step = flow.on_request_headers(
            RequestHead {
                headers: &headers,
                metadata_subject: subject.as_deref(),
            },
            end_of_stream,
        );
        action(self.perform(step, Phase::Request))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(flow) = self.flow.as_mut() else {
            return Action::Continue;
        };
        let step = flow.on_request_body(body_size, end_of_stream, |n| {
            read(abi::BUFFER_REQUEST_BODY, n, "reading the request body")
        });
        action(self.perform(step, Phase::Request))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let Some(flow) = self.flow.as_mut() else {
            return Action::Continue;
        };
        let step = flow
            .on_request_trailers(|n| read(abi::BUFFER_REQUEST_BODY, n, "reading the request body"));
        action(self.perform(step, Phase::Request))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(flow) = self.flow.as_mut() else {
            return Action::Continue;
        };
        if !flow.awaits_response() {
            // Passthrough, fail-open, and our own local replies (C-6): untouched.
            return Action::Continue;
        }
        let headers = match abi::get_headers(abi::MAP_RESPONSE_HEADERS) {
            Ok(h) => h,
            Err(e) => {
                abi::log(
                    Level::Error,
                    &format!("idempotency: reading the response headers failed: {e}"),
                );
                Vec::new()
            }
        };
        let details = match abi::get_property(&["response", "code_details"]) {
            Ok(v) => text(v).unwrap_or_default(),
            Err(_) => String::new(),
        };
        let flags = match abi::get_property(&["response", "flags"]) {
            Ok(Some(b)) => b
                .get(..8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map_or(0, u64::from_le_bytes),
            _ => 0,
        };
        let step = flow.on_response_headers(&headers, &details, flags, end_of_stream);
        action(self.perform(step, Phase::Response))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(flow) = self.flow.as_mut() else {
            return Action::Continue;
        };
        let step = flow.on_response_body(body_size, end_of_stream, |n| {
            read(abi::BUFFER_RESPONSE_BODY, n, "reading the response body")
        });
        action(self.perform(step, Phase::Response))
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        let Some(flow) = self.flow.as_mut() else {
            return Action::Continue;
        };
        let step = flow.on_response_trailers(|n| {
            read(abi::BUFFER_RESPONSE_BODY, n, "reading the response body")
        });
        action(self.perform(step, Phase::Response))
    }
}
