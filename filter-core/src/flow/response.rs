//! The response phase: what the upstream answered, and capturing it to store it before the
//! client receives it.

use super::mark_unknown;
use super::{Call, Capture, Claimed, Flow, Note, State, Turn, Write};
use crate::config::Config;
use crate::effect::to_json;
use crate::effect::{Effect, Level};
use crate::headers::{self, expires_in, EXPIRES_HEADER};
use crate::metrics::Metric;
use crate::outcome::{classify, Outcome};
use crate::worker::replay_cache::Completed;
use crate::worker::writes::fenced_body;
use contract::wire::{CompleteRequest, StoredResponse};

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
                let body = fenced_body(&claimed.held(), &claimed.req.req.namespace);
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
            Outcome::Unknown => {
                // Envoy answers for an upstream that had the request (a reset, a timeout): the
                // client gets Envoy's answer, the record is marked unknown.
                let log = claimed.unknown_log(
                    Level::Warn,
                    format!("HTTP {status} from Envoy ({})", head.details),
                );
                let mark = mark_unknown(&claimed);
                self.state = State::Finished;
                Turn::cont()
                    .with(Effect::Count(Metric::OutcomeUnknown))
                    .with(log)
                    .with(Note::Unregister(claimed.token))
                    .with(mark)
            }
            Outcome::Store => {
                let capture = capture_of(cfg, status, head.headers, 0);
                // The key's horizon on the first answer: its whole retention, which runs from
                // the completion, later than now (the write may still fail; then the key is
                // held as unknown for longer still).
                let expires = claimed
                    .retention_s
                    .map(|s| expires_in(s.saturating_mul(1_000)))
                    .map(|value| {
                        self.effect(|stream| Effect::SetResponseHeader {
                            stream,
                            name: EXPIRES_HEADER,
                            value,
                        })
                    });
                let mut t = if end_of_stream {
                    self.complete(claimed, capture, Some(Vec::new()))
                } else {
                    self.state = State::Capturing(claimed, capture);
                    Turn::cont()
                };
                if let Some(set) = expires {
                    t.push_first(set);
                }
                t
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
            State::Capturing(claimed, cap) => {
                cap.size = body_size;
                let max = stored_body_limit(cfg, claimed);
                if body_size <= max && !end_of_stream {
                    return Turn::pause();
                }
                let State::Capturing(claimed, cap) = self.take() else {
                    return Turn::cont();
                };
                let body = if body_size > max {
                    None
                } else if body_size == 0 {
                    // Ended by an empty data frame: nothing to read (Envoy has no buffer then).
                    Some(Vec::new())
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
        let (write, record) = outcome(&claimed, cap, body);
        if !record.replayable {
            t.push(Effect::Count(Metric::StoredWithoutBody));
        }
        let Write::Complete { body, fallback, .. } = &write else {
            return t;
        };
        t.push(Call::Complete {
            body: body.clone(),
            fallback: fallback.clone(),
            claim: claimed.held(),
            record: Box::new(record),
            first: true,
        });
        self.state = State::Writing(claimed, write);
        t
    }
}

/// A response about to be captured: its status and the headers kept to replay.
pub(super) fn capture_of(
    cfg: &Config,
    status: u16,
    response_headers: &[(String, String)],
    size: usize,
) -> Capture {
    let kept = headers::stored(response_headers, &cfg.replay_extra_headers);
    Capture {
        status,
        headers: kept.headers,
        headers_complete: kept.complete,
        size,
    }
}

/// The largest body kept to replay: the configured one, or the state API's if it is smaller.
pub(super) fn stored_body_limit(cfg: &Config, claimed: &Claimed) -> usize {
    let max = claimed.max_body.map_or(cfg.max_stored_body_bytes, |m| {
        m.min(cfg.max_stored_body_bytes)
    });
    usize::try_from(max).unwrap_or(usize::MAX)
}

/// The write that stores a captured response, and the record a replay of it gives. Not
/// replayable (status and headers only) when the body is not kept, a header that would be
/// replayed could not be kept, or the status is not three digits (stored as 502 then).
pub(super) fn outcome(
    claimed: &Claimed,
    cap: Capture,
    body: Option<Vec<u8>>,
) -> (Write, Completed) {
    let status_ok = contract::limits::STATUS.contains(&cap.status);
    let status = if status_ok { cap.status } else { 502 };
    let body = body.filter(|_| cap.headers_complete && status_ok);
    let replayable = body.is_some();
    let body = body.unwrap_or_default();
    let payload = complete_payload(
        claimed,
        StoredResponse::new(status, cap.headers.clone(), &body, replayable),
    );
    let fallback = complete_payload(claimed, StoredResponse::new(status, Vec::new(), b"", false));
    let record = Completed {
        fingerprint: claimed.req.fingerprint.clone(),
        status,
        headers: cap.headers,
        body,
        replayable,
        expires_at_ms: None,
    };
    let write = Write::Complete {
        fallback: (fallback != payload).then_some(fallback),
        body: payload,
        attempts: 1,
        record: Box::new(record.clone()),
        reply: false,
    };
    (write, record)
}

fn complete_payload(claimed: &Claimed, response: StoredResponse) -> Vec<u8> {
    to_json(&CompleteRequest {
        namespace: claimed.req.req.namespace.clone(),
        key: claimed.req.req.key.clone(),
        subject: claimed.req.req.subject.clone(),
        endpoint: claimed.req.req.endpoint.clone(),
        token: claimed.token,
        response,
    })
}

/// What the stream stores when it ends after the response headers, before the whole body: the
/// status and headers it has, not replayable. The upstream answered; it must not run again.
pub(super) fn cut_short(claimed: &Claimed, cap: Capture) -> (Write, Completed) {
    outcome(claimed, cap, None)
}
