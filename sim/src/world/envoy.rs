//! Envoy around the filter, stream by stream: the request's parts given to the filter (buffered
//! while it pauses), forwarded; the response's parts, held or passed to the client; the router's
//! own answers; the end of a stream, which cancels its callouts.

use super::callouts::Callout;
use super::faults::Faults;
use super::{Current, World};
use crate::upstream::Produced;
use filter_core::flow::{RequestHead, ResponseHead, Verdict};
use filter_core::outcome::flags;
use filter_core::worker::Step;

/// `response.flags` of Envoy's own timeouts (`CoreResponseFlag` bits 16 and 22), which the
/// filter's `outcome::flags` does not name.
pub(super) const STREAM_IDLE_TIMEOUT: u64 = 1 << 16;
pub(super) const DURATION_TIMEOUT: u64 = 1 << 22;

/// Envoy's buffer read: `n` bytes, none for an empty buffer (as Envoy gives no buffer then).
pub(super) fn read(buffer: &[u8], n: usize) -> Option<Vec<u8>> {
    if n == 0 || n > buffer.len() {
        None
    } else {
        Some(buffer[..n].to_vec())
    }
}

impl World {
    /// The next request part reaches the filter (headers, a body chunk, or trailers).
    pub(crate) fn send_part(&mut self, s: usize) {
        let st = self.streams[s].clone();
        let w = st.worker;
        if st.ended || self.workers[w].w.is_none() || self.workers[w].generation != st.generation {
            return;
        }
        let now = self.worker_now(w);
        let part = st.parts_sent;
        self.streams[s].parts_sent += 1;
        let forwarded = st.forwarded.is_some() || st.in_transit;
        let step = if part == 0 {
            let end = st.chunks.is_empty() && !st.trailers;
            let head = RequestHead {
                headers: &st.headers,
                metadata_subject: None,
            };
            self.call(w, |wk| wk.on_request_headers(st.sid, head, end, now))
        } else if part <= st.chunks.len() {
            let chunk = st.chunks[part - 1];
            let end = part == st.chunks.len() && !st.trailers;
            if forwarded {
                // Passed on already: the filter sees each chunk once.
                self.call(w, |wk| {
                    wk.on_request_body(st.sid, chunk, end, &mut |_| None, now)
                })
            } else {
                let size = st.req_buffered + chunk;
                self.streams[s].req_buffered = size;
                let body = st.request.body.clone();
                self.call(w, |wk| {
                    wk.on_request_body(st.sid, size, end, &mut |n| read(&body, n), now)
                })
            }
        } else if forwarded {
            // Passed on already: nothing is buffered for the filter.
            self.call(w, |wk| wk.on_request_trailers(st.sid, &mut |_| None, now))
        } else {
            let size = st.req_buffered;
            let body = st.request.body.clone();
            debug_assert_eq!(size, st.body_len());
            self.call(w, |wk| {
                wk.on_request_trailers(st.sid, &mut |n| read(&body, n), now)
            })
        };
        let Some(step) = step else { return };
        let verdict = self.perform(w, Current::Request(s), step.verdict, step.effects);
        if verdict == Verdict::Continue && !forwarded {
            self.forward(s);
        }
        self.end_if_answered(s);
    }

    /// The request goes upstream (with the headers the filter set).
    pub(super) fn forward(&mut self, s: usize) {
        let st = &self.streams[s];
        if st.forwarded.is_some() || st.in_transit || st.ended || st.client.status.is_some() {
            return;
        }
        if self.upstream_down && self.c.chance(50) {
            self.log(format!("stream {s}: upstream refuses the connection"));
            if self.router_retry(s, "connect failure") {
                return;
            }
            self.router_reply(
                s,
                503,
                "upstream_reset_before_response_started{remote_connection_failure}",
                flags::UPSTREAM_CONNECTION_FAILURE,
            );
            return;
        }
        if self.fault(Faults::UPSTREAM) && self.c.chance(15) {
            // Sent, not yet received: it may arrive after its stream, or its Envoy, is gone.
            self.log(format!(
                "stream {s}: the request is on its way to the upstream"
            ));
            self.streams[s].in_transit = true;
            return;
        }
        self.arrive(s);
    }

    /// Envoy's router sends stream `s`'s request upstream again after a failed try (a 5xx,
    /// a reset, a refused connection, a per-try timeout) when the route's `retry_policy` says
    /// so and the request does not forbid it (`x-envoy-max-retries: 0`, which the filter sets
    /// on every request it forwards under a claim). The failed try's execution, if any, goes
    /// on and finishes on its own. `false`: no retry, the failure stands.
    pub(crate) fn router_retry(&mut self, s: usize, why: &str) -> bool {
        if !self.router_may_retry(s) {
            return false;
        }
        self.streams[s].router_retries += 1;
        self.streams[s].forwarded = None;
        self.streams[s].resp_chunks_sent = 0;
        let claimed = self.streams[s]
            .headers
            .iter()
            .any(|(n, _)| n == contract::wire::FENCING_TOKEN_HEADER);
        self.reach(if claimed {
            "region: Envoy's router retried a request forwarded under a claim"
        } else {
            "region: Envoy's router retried a request forwarded without a claim"
        });
        self.log(format!(
            "stream {s}: the router retries the request ({why}; the route's retry_policy)"
        ));
        self.arrive(s);
        true
    }

    /// Whether the router would send stream `s`'s request again after a failed try.
    pub fn router_may_retry(&self, s: usize) -> bool {
        let st = &self.streams[s];
        let forbidden = st
            .headers
            .iter()
            .any(|(n, v)| n.eq_ignore_ascii_case("x-envoy-max-retries") && v.trim() == "0");
        self.setup.route_retries
            && !forbidden
            && st.router_retries == 0
            && !st.ended
            && st.resp_head.is_none()
    }

    /// Envoy's router answers for the upstream (reset, refused connection, timeout).
    pub(super) fn router_reply(&mut self, s: usize, status: u16, details: &str, fl: u64) {
        self.streams[s].router_reply = true;
        let body = b"upstream connect error or disconnect/reset before headers".to_vec();
        let produced = Produced {
            status,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: body.clone(),
        };
        self.log(format!("stream {s}: router answers {status} ({details})"));
        if self.streams[s].forwarded.is_some() {
            let scope = self.ops[self.streams[s].op].scope();
            self.ev
                .envoy_replies
                .push((scope, produced.clone(), details.to_owned()));
            self.reach(match status {
                408 => "region: Envoy answered a forwarded request 408",
                413 => "region: Envoy answered a forwarded request 413",
                503 => "region: Envoy answered a forwarded request 503",
                504 => "region: Envoy answered a forwarded request 504",
                _ => "region: Envoy answered a forwarded request otherwise",
            });
        }
        // An execution the router answered for goes on, and finishes on its own.
        let mut hs = vec![(":status".to_owned(), status.to_string())];
        hs.extend(produced.headers.iter().cloned());
        self.response_headers(s, produced, &hs, details, fl, false);
        if !self.streams[s].ended {
            self.response_body(s, body, true);
        }
    }

    pub(super) fn response_headers(
        &mut self,
        s: usize,
        produced: Produced,
        hs: &[(String, String)],
        details: &str,
        fl: u64,
        end: bool,
    ) {
        let st = self.streams[s].clone();
        let w = st.worker;
        self.streams[s].resp_head = Some(produced);
        self.streams[s].resp_end_seen = end;
        let now = self.worker_now(w);
        let wants = self.workers[w]
            .w
            .as_ref()
            .is_some_and(|wk| wk.awaits_response(st.sid));
        let verdict = if wants {
            let step = self.call(w, |wk| {
                wk.on_response_headers(
                    st.sid,
                    ResponseHead {
                        headers: hs,
                        details,
                        flags: fl,
                    },
                    end,
                    now,
                )
            });
            self.response_step(w, s, step)
        } else {
            Verdict::Continue
        };
        self.on_response_verdict(s, verdict);
    }

    pub(super) fn response_body(&mut self, s: usize, chunk: Vec<u8>, end: bool) {
        let st = self.streams[s].clone();
        if st.ended {
            return;
        }
        let w = st.worker;
        let now = self.worker_now(w);
        self.streams[s].resp_buffer.extend_from_slice(&chunk);
        if end {
            self.streams[s].resp_end_seen = true;
        }
        let buffer = self.streams[s].resp_buffer.clone();
        let size = buffer.len();
        let step = self.call(w, |wk| {
            wk.on_response_body(st.sid, size, end, &mut |n| read(&buffer, n), now)
        });
        let verdict = self.response_step(w, s, step);
        self.on_response_verdict(s, verdict);
    }

    pub(super) fn response_trailers(&mut self, s: usize) {
        let st = self.streams[s].clone();
        if st.ended {
            return;
        }
        let w = st.worker;
        let now = self.worker_now(w);
        self.streams[s].resp_end_seen = true;
        let buffer = st.resp_buffer.clone();
        let step = self.call(w, |wk| {
            wk.on_response_trailers(st.sid, &mut |n| read(&buffer, n), now)
        });
        let verdict = self.response_step(w, s, step);
        self.on_response_verdict(s, verdict);
    }

    /// Carries out the filter's step on a response part (none: its worker is gone); its verdict.
    fn response_step(&mut self, w: usize, s: usize, step: Option<Step>) -> Verdict {
        match step {
            Some(step) => self.perform(w, Current::Response(s), step.verdict, step.effects),
            None => Verdict::Continue,
        }
    }

    /// Envoy holds the response while the filter pauses it, and passes on what it holds
    /// otherwise; a stream whose client has its whole answer is over.
    fn on_response_verdict(&mut self, s: usize, verdict: Verdict) {
        self.streams[s].resp_paused = verdict == Verdict::Pause;
        if verdict == Verdict::Continue {
            self.pass_response(s);
        }
        self.end_if_answered(s);
    }

    /// What Envoy holds of the response goes to the client.
    pub(super) fn pass_response(&mut self, s: usize) {
        let st = &mut self.streams[s];
        if st.client.local {
            return;
        }
        if let Some(head) = &st.resp_head {
            if !st.resp_head_passed {
                st.resp_head_passed = true;
                st.client.status = Some(head.status);
                st.client.headers = head.headers.clone();
            }
        }
        let data = std::mem::take(&mut st.resp_buffer);
        st.client.body.extend_from_slice(&data);
        if st.resp_end_seen && st.resp_head_passed {
            st.client.complete = true;
        }
    }

    /// A stream whose client has its whole answer is over (Envoy calls `on_done`).
    pub(super) fn end_if_answered(&mut self, s: usize) {
        if self.streams[s].client.complete && !self.streams[s].ended {
            let found = self.invariants.answered(self, s);
            self.found(found);
            self.end_stream(s, false);
        }
    }

    /// The stream ends: the client left (`gave_up`) or the exchange is over or broke.
    pub(super) fn end_stream(&mut self, s: usize, gave_up: bool) {
        if self.streams[s].ended {
            return;
        }
        self.streams[s].ended = true;
        let st = self.streams[s].clone();
        let op = st.op;
        if self.ops[op].active == Some(s) {
            self.ops[op].active = None;
            let wait = *self.c.pick(&[0u64, 100, 1_000, 3_000, 31_000]);
            self.ops[op].next_at = self.now + wait;
        }
        if !st.client.complete {
            self.log(format!(
                "stream {s} ends before its answer{}",
                if gave_up { " (the client left)" } else { "" }
            ));
        }
        // Envoy cancels the stream's callouts; an answer already on its way back is lost.
        let answered: Vec<Callout> = self
            .callouts
            .iter()
            .filter(|c| c.stream == Some(s) && !c.orphan && c.answer.is_some())
            .cloned()
            .collect();
        for c in answered {
            if let Some(answer) = &c.answer {
                self.lost_grants(
                    &c,
                    answer,
                    "its stream ended, and Envoy cancelled the callout",
                );
            }
        }
        for c in self.callouts.iter_mut() {
            if c.stream == Some(s) && !c.orphan {
                c.orphan = true;
                c.orphaned_by = "its stream ended, and Envoy cancelled the callout";
            }
        }
        let w = st.worker;
        if self.workers[w].w.is_none() || self.workers[w].generation != st.generation {
            return;
        }
        let now = self.worker_now(w);
        if let Some(effects) = self
            .call(w, |wk| Some(wk.on_stream_done(st.sid, now)))
            .flatten()
        {
            self.perform(w, Current::Stream(s), Verdict::Continue, effects);
        }
    }

    /// Envoy answers a forwarded request itself before the upstream's response: one of its
    /// timeouts, a payload over its limit, a reset.
    pub(super) fn envoy_reply(&mut self, s: usize) {
        let (status, details, fl) = *self.c.pick(&[
            (408u16, "stream_idle_timeout", STREAM_IDLE_TIMEOUT),
            (408, "request_overall_timeout", 0),
            (408, "max_duration_timeout", DURATION_TIMEOUT),
            (413, "request_payload_too_large", 0),
            (
                503,
                "upstream_reset_before_response_started{connection_termination}",
                flags::UPSTREAM_CONNECTION_TERMINATION,
            ),
            (
                504,
                "upstream_per_try_timeout",
                flags::UPSTREAM_REQUEST_TIMEOUT,
            ),
            (0, "reset", 0),
        ]);
        if status == 0 {
            self.reach("region: Envoy reset a forwarded stream");
            self.log(format!("stream {s}: Envoy resets the stream"));
            self.end_stream(s, false);
            return;
        }
        self.router_reply(s, status, details, fl);
    }
}
