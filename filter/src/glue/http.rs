//! The HTTP context of one stream: reads what the worker needs from the host and carries out
//! what it returns.

use super::abi::{self, Level};
use super::{callout_result, perform, take_pending, Current, Shared};
use contract::ProblemKind;
use filter_core::flow::{RequestHead, ResponseHead, Verdict};
use filter_core::reply::LocalReply;
use filter_core::worker::{CallId, Step, StreamId};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::rc::Rc;

pub(crate) struct Http {
    id: StreamId,
    shared: Rc<Shared>,
    /// This stream's callouts on their way (Envoy token, the worker's id).
    pending: Vec<(u32, CallId)>,
}

fn action(v: Verdict) -> Action {
    match v {
        Verdict::Continue => Action::Continue,
        Verdict::Pause => Action::Pause,
    }
}

/// Exactly `n` bytes of a buffer, or `None`. Envoy has no buffer for an empty body, so no
/// bytes are read for `n` 0.
fn read(buffer: u32, n: usize, what: &str) -> Option<Vec<u8>> {
    if n == 0 {
        return Some(Vec::new());
    }
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

fn now() -> u64 {
    super::clock_ms()
}

impl Http {
    pub(crate) fn new(id: StreamId, shared: Rc<Shared>) -> Self {
        Self {
            id,
            shared,
            pending: Vec::new(),
        }
    }

    /// Carries out a step of this stream; `Continue` when the worker is not configured.
    fn perform(&mut self, step: Option<Step>, current: Current) -> Action {
        match step {
            Some(step) => action(perform(
                &self.shared,
                current,
                step.verdict,
                step.effects,
                &mut self.pending,
            )),
            None => Action::Continue,
        }
    }

    fn metadata_subject(&self) -> Option<String> {
        let path = self.shared.metadata_path.borrow();
        let path = path.as_ref()?;
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
        let Some(id) = take_pending(&mut self.pending, token_id) else {
            abi::log(
                Level::Warn,
                &format!("idempotency: unexpected callout answer {token_id}"),
            );
            return;
        };
        let result = callout_result(num_headers, body_size);
        let now = now();
        let step = self
            .shared
            .with_worker(|w| w.on_callout_answer(id, result, now));
        self.perform(step, Current::Stream(self.id));
    }

    fn on_done(&mut self) -> bool {
        let (id, now) = (self.id, now());
        if let Some(effects) = self.shared.with_worker(|w| w.on_stream_done(id, now)) {
            perform(
                &self.shared,
                Current::Stream(id),
                Verdict::Continue,
                effects,
                &mut self.pending,
            );
        }
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers = match abi::get_headers(abi::MAP_REQUEST_HEADERS) {
            Ok(h) => h,
            Err(e) => {
                abi::log(
                    Level::Error,
                    &format!("idempotency: reading the request headers failed: {e}"),
                );
                let r = LocalReply::problem(
                    ProblemKind::Internal,
                    "the request headers could not be read",
                );
                if let Err(e) =
                    abi::send_response(u32::from(r.status), r.reason, &r.headers, &r.body)
                {
                    abi::log(
                        Level::Error,
                        &format!("idempotency: sending a reply failed: {e}"),
                    );
                }
                return Action::Pause;
            }
        };
        let subject = self.metadata_subject();
        let (id, now) = (self.id, now());
        let step = self.shared.with_worker(|w| {
            w.on_request_headers(
                id,
                RequestHead {
                    headers: &headers,
                    metadata_subject: subject.as_deref(),
                },
                end_of_stream,
                now,
            )
        });
        self.perform(step, Current::Request(id))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (id, now) = (self.id, now());
        let step = self.shared.with_worker(|w| {
            w.on_request_body(
                id,
                body_size,
                end_of_stream,
                &mut |n| read(abi::BUFFER_REQUEST_BODY, n, "reading the request body"),
                now,
            )
        });
        self.perform(step, Current::Request(id))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let (id, now) = (self.id, now());
        let step = self.shared.with_worker(|w| {
            w.on_request_trailers(
                id,
                &mut |n| read(abi::BUFFER_REQUEST_BODY, n, "reading the request body"),
                now,
            )
        });
        self.perform(step, Current::Request(id))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let id = self.id;
        if self.shared.with_worker(|w| w.awaits_response(id)) != Some(true) {
            // Passthrough, fail-open, and our own local replies: untouched.
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
        let now = now();
        let step = self.shared.with_worker(|w| {
            w.on_response_headers(
                id,
                ResponseHead {
                    headers: &headers,
                    details: &details,
                    flags,
                },
                end_of_stream,
                now,
            )
        });
        self.perform(step, Current::Response(id))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (id, now) = (self.id, now());
        let step = self.shared.with_worker(|w| {
            w.on_response_body(
                id,
                body_size,
                end_of_stream,
                &mut |n| read(abi::BUFFER_RESPONSE_BODY, n, "reading the response body"),
                now,
            )
        });
        self.perform(step, Current::Response(id))
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        let (id, now) = (self.id, now());
        let step = self.shared.with_worker(|w| {
            w.on_response_trailers(
                id,
                &mut |n| read(abi::BUFFER_RESPONSE_BODY, n, "reading the response body"),
                now,
            )
        });
        self.perform(step, Current::Response(id))
    }
}
