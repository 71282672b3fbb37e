//! The response phase: what the upstream answered, and capturing it to store it before the
//! client receives it.

use super::request::to_json;
use super::{Call, Capture, Claimed, Flow, State, Turn, Write};
use crate::config::Config;
use crate::headers;
use crate::metrics::Metric;
use crate::outcome::{classify, Outcome};
use crate::worker::replay_cache::Completed;
use crate::worker::{Effect, Level};
use contract::wire::{CompleteRequest, ReleaseRequest, StoredResponse};

/// What the glue knows when response headers arrive.
#[derive(Debug, Clone, Copy)]
pub struct ResponseHead<'a> {
    pub headers: &'a [(String, String)],
    /// Envoy's `response.code_details` (empty when unavailable).
    pub details: &'a str,
    /// Envoy's `response.flags` (0 when unavailable).
    pub flags: u64,
}

impl Flow {
    /// Response headers.
    pub fn on_response_headers(
        &mut self,
        cfg: &Config,
        head: ResponseHead<'_>,
        end_of_stream: bool,
    ) -> Turn {
        if !matches!(self.state, State::Upstream(_)) {
            // Our own local replies, passthrough and fail-open streams: untouched.
            return Turn::cont();
        }
        let State::Upstream(claimed) = self.take() else {
            return Turn::cont();
        };
        let status = head
            .headers
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| v.parse::<u16>().ok())
            .unwrap_or(0);
        let on_5xx = cfg
            .routes
            .get(claimed.req.req.route)
            .map(|r| r.on_5xx)
            .unwrap_or_default();
        match classify(status, head.details, head.flags, on_5xx) {
            Outcome::Release => {
                let body = to_json(&ReleaseRequest {
                    key: claimed.req.req.key.clone(),
                    subject: claimed.req.req.subject.clone(),
                    endpoint: claimed.req.req.endpoint.clone(),
                    token: claimed.token,
                });
                let log = Flow::log(
                    Level::Info,
                    format!(
                        "releasing the key of {}: HTTP {status} ({})",
                        claimed.endpoint(),
                        head.details
                    ),
                );
                self.state = State::Writing(
                    claimed,
                    Write::Release {
                        body: body.clone(),
                        attempts: 1,
                    },
                );
                Turn::pause().with(log).with(Call::Release { body })
            }
            Outcome::Store => {
                let capture = Capture {
                    status,
                    headers: headers::stored(head.headers, &cfg.replay_extra_headers),
                    size: 0,
                };
                if end_of_stream {
                    return self.complete(claimed, capture, Some(Vec::new()));
                }
                self.state = State::Capturing(claimed, capture);
                Turn::cont()
            }
        }
    }

    /// A response body callback. While capturing, every chunk is held (`Pause`), so
    /// `body_size` is cumulative and nothing reaches the client before the outcome is stored:
    /// holding only the last chunk is not enough, because a response with a Content-Length is
    /// complete for the client as soon as its last data byte arrives, which Envoy may deliver
    /// before an empty end-of-stream frame. `read(n)` reads the first `n` buffered bytes.
    ///
    /// Once the body outgrows `max_stored_body_bytes` the outcome is known not to be
    /// replayable: it is stored at once (status and headers, no body) while the response is
    /// held, and then the response streams on untouched.
    pub fn on_response_body(
        &mut self,
        cfg: &Config,
        body_size: usize,
        end_of_stream: bool,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
    ) -> Turn {
        match &mut self.state {
            State::Capturing(_, cap) => {
                cap.size = body_size;
                let max = usize::try_from(cfg.max_stored_body_bytes).unwrap_or(usize::MAX);
                if body_size <= max && !end_of_stream {
                    return Turn::pause();
                }
                let State::Capturing(claimed, cap) = self.take() else {
                    return Turn::cont();
                };
                let body = if body_size > max {
                    None
                } else {
                    read(body_size)
                };
                self.complete(claimed, cap, body)
            }
            // Hold everything while a write is on its way.
            State::Writing(..) => Turn::pause(),
            _ => Turn::cont(),
        }
    }

    /// Response trailers: the response ended (`read` reads the buffered body).
    pub fn on_response_trailers(&mut self, read: &mut dyn FnMut(usize) -> Option<Vec<u8>>) -> Turn {
        match self.take() {
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
                Turn::pause()
            }
            other => {
                self.state = other;
                Turn::cont()
            }
        }
    }

    /// Stores the outcome; `body` is `None` when it is not kept (too large or unreadable).
    fn complete(&mut self, claimed: Claimed, cap: Capture, body: Option<Vec<u8>>) -> Turn {
        let mut t = Turn::pause();
        if body.is_none() {
            t.push(Effect::Count(Metric::StoredWithoutBody));
        }
        let replayable = body.is_some();
        let body = body.unwrap_or_default();
        let record = Box::new(Completed {
            fingerprint: claimed.req.fingerprint.clone(),
            status: cap.status,
            headers: cap.headers.clone(),
            body: body.clone(),
            replayable,
        });
        let payload = to_json(&CompleteRequest {
            key: claimed.req.req.key.clone(),
            subject: claimed.req.req.subject.clone(),
            endpoint: claimed.req.req.endpoint.clone(),
            token: claimed.token,
            response: StoredResponse::new(cap.status, cap.headers, &body, replayable),
        });
        t.push(Call::Complete {
            body: payload.clone(),
            claim: claimed.held(),
            record: record.clone(),
            first: true,
        });
        self.state = State::Writing(
            claimed,
            Write::Complete {
                body: payload,
                attempts: 1,
                record,
            },
        );
        t
    }
}
