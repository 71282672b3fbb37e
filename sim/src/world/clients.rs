//! The clients: each operation's attempts (the same request, or a changed one under the same
//! key), what a client saw of one, and the final retry after the drain.

use super::faults::Faults;
use super::World;
use crate::state_api::Scope;
use crate::upstream::{Produced, Sent};
use contract::wire::FENCING_TOKEN_HEADER;
use filter_core::worker::StreamId;

/// The fencing token a misbehaving client sends (the filter must strip it).
pub const CLIENT_TOKEN: i64 = 999_999;

/// One attempt: an HTTP stream on one worker.
#[derive(Debug, Clone)]
pub struct Stream {
    pub worker: usize,
    pub generation: u32,
    pub sid: StreamId,
    pub op: usize,
    pub request: Sent,
    pub headers: Vec<(String, String)>,
    /// Body chunk sizes; `trailers`: the body ends with trailers, not end of stream.
    pub chunks: Vec<usize>,
    pub trailers: bool,
    /// Request parts given to the filter: 0 none, 1 headers, then one per chunk (+1 trailers).
    pub parts_sent: usize,
    /// Bytes Envoy holds for the filter (cumulative while it pauses).
    pub req_buffered: usize,
    pub forwarded: Option<usize>,
    /// Its claim was refused (a 4xx), not failed: the state API was there.
    pub claim_refused: bool,
    // The response as Envoy holds it.
    pub resp_head: Option<Produced>,
    pub resp_head_passed: bool,
    pub resp_buffer: Vec<u8>,
    pub resp_end_seen: bool,
    pub resp_paused: bool,
    pub resp_chunks_sent: usize,
    pub router_reply: bool,
    /// The upstream refused its fencing token (nothing ran).
    pub refused_by_upstream: bool,
    /// Times Envoy's router sent the request upstream again (a route `retry_policy`).
    pub router_retries: u32,
    /// Sent upstream, not received yet.
    pub in_transit: bool,
    pub client: ClientView,
    pub ended: bool,
}

impl Stream {
    pub(super) fn body_len(&self) -> usize {
        self.chunks.iter().sum()
    }
    pub(crate) fn request_parts(&self) -> usize {
        1 + self.chunks.len() + usize::from(self.trailers)
    }
}

/// A client's operation: one key, retried until it gets an answer or runs out of attempts.
#[derive(Debug, Clone)]
pub struct Op {
    /// Its idempotency key (empty: a request on an optional route that carries none).
    pub key: String,
    /// The key is a member of its JSON body (a `key_from` route), not a header.
    pub key_in_body: bool,
    pub subject: String,
    pub path: String,
    pub body: Vec<u8>,
    pub content_type: String,
    pub attempts_left: u32,
    pub active: Option<usize>,
    pub next_at: u64,
    /// Its attempts send `Prefer: wait=N` (0: they do not).
    pub wait_s: u64,
}

impl Op {
    pub fn endpoint(&self) -> String {
        format!("POST {}", self.path.split('?').next().unwrap_or(""))
    }
    pub fn scope(&self) -> Scope {
        (self.key.clone(), self.subject.clone(), self.endpoint())
    }

    /// The request its attempts send when unchanged.
    pub fn request(&self) -> Sent {
        let (path, query) = match self.path.split_once('?') {
            Some((p, q)) => (p.to_owned(), q.to_owned()),
            None => (self.path.clone(), String::new()),
        };
        Sent {
            method: "POST".into(),
            path,
            query,
            content_type: Some(self.content_type.clone()),
            body: self.body.clone(),
        }
    }
}

/// What a client saw of one attempt.
#[derive(Debug, Clone, Default)]
pub struct ClientView {
    pub status: Option<u16>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub complete: bool,
    /// Answered by the filter itself (a problem or a replay).
    pub local: bool,
}

impl ClientView {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn replayed(&self) -> bool {
        self.local && self.header("idempotent-replayed") == Some("true")
    }
}

/// The same JSON value written in another member order and spacing.
pub(super) fn reorder(body: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(m)) => {
            let mut out = String::from("{ ");
            let members: Vec<String> = m
                .iter()
                .rev()
                .map(|(k, v)| format!("{} : {}", serde_json::Value::String(k.clone()), v))
                .collect();
            out.push_str(&members.join(" , "));
            out.push_str(" }");
            out.into_bytes()
        }
        _ => body.to_vec(),
    }
}

/// Another request: a nested value changed.
pub(super) fn changed(body: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(mut v @ serde_json::Value::Object(_)) => {
            if let Some(card) = v.get_mut("card") {
                card["number"] = "0000".into();
            } else {
                v["amount"] = 999.into();
            }
            serde_json::to_vec(&v).unwrap_or_default()
        }
        _ => b"{\"other\":true}".to_vec(),
    }
}

pub(super) fn short(path: &str) -> String {
    if path.len() > 40 {
        format!("{}…({} bytes)", &path[..20], path.len())
    } else {
        path.to_owned()
    }
}

impl World {
    pub(crate) fn new_attempt(&mut self, op: usize, worker: Option<usize>) {
        let alive: Vec<usize> = (0..self.workers.len())
            .filter(|w| self.workers[*w].w.is_some())
            .collect();
        if alive.is_empty() {
            return;
        }
        let w = match worker {
            Some(w) if self.workers[w].w.is_some() => w,
            _ => *self.c.pick(&alive),
        };
        let o = self.ops[op].clone();
        // Mostly the same request; sometimes a changed body or media type under the same key.
        let (body, content_type) = if self.fault(Faults::CLIENT) {
            match self.c.weighted(&[12, 2, 1, 1]) {
                0 => (o.body.clone(), o.content_type.clone()),
                1 => (reorder(&o.body), o.content_type.clone()),
                2 => (changed(&o.body), o.content_type.clone()),
                _ => (o.body.clone(), "text/plain".to_owned()),
            }
        } else {
            (o.body.clone(), o.content_type.clone())
        };
        let mut headers = vec![
            (":method".to_owned(), "POST".to_owned()),
            (":path".to_owned(), o.path.clone()),
            (":authority".to_owned(), "shop".to_owned()),
            ("x-jwt-sub".to_owned(), o.subject.clone()),
            ("content-type".to_owned(), content_type.clone()),
        ];
        if !o.key_in_body {
            headers.push(("idempotency-key".to_owned(), o.key.clone()));
        }
        if o.wait_s > 0 {
            headers.push(("prefer".to_owned(), format!("wait={}", o.wait_s)));
        }
        if self.fault(Faults::CLIENT) && self.c.chance(5) {
            // A client that tries to set its own fencing token.
            headers.push((FENCING_TOKEN_HEADER.to_owned(), CLIENT_TOKEN.to_string()));
            if o.key.is_empty() {
                self.reach(
                    "region: a key_from request without a key, with a client's fencing token",
                );
            }
        }
        let len = body.len();
        let chunks = self.chunks_of(len);
        let trailers = len > 0 && self.c.chance(10);
        let (path, query) = match o.path.split_once('?') {
            Some((p, q)) => (p.to_owned(), q.to_owned()),
            None => (o.path.clone(), String::new()),
        };
        let generation = self.workers[w].generation;
        self.workers[w].next_sid += 1;
        let sid = generation * 100_000 + self.workers[w].next_sid;
        let index = self.streams.len();
        self.streams.push(Stream {
            worker: w,
            generation,
            sid,
            op,
            request: Sent {
                method: "POST".into(),
                path,
                query,
                content_type: Some(content_type.clone()),
                body,
            },
            headers,
            chunks,
            trailers,
            parts_sent: 0,
            req_buffered: 0,
            forwarded: None,
            claim_refused: false,
            resp_head: None,
            resp_head_passed: false,
            resp_buffer: Vec::new(),
            resp_end_seen: false,
            resp_paused: false,
            resp_chunks_sent: 0,
            router_reply: false,
            refused_by_upstream: false,
            router_retries: 0,
            in_transit: false,
            client: ClientView::default(),
            ended: false,
        });
        self.ops[op].active = Some(index);
        self.ops[op].attempts_left = self.ops[op].attempts_left.saturating_sub(1);
        self.log(format!(
            "op {op} attempt on worker {w} (stream {index}): POST {} key={} sub={} ct={content_type} body={}",
            short(&o.path),
            o.key,
            o.subject,
            String::from_utf8_lossy(&self.streams[index].request.body)
        ));
        self.send_part(index);
    }

    /// The final retry of `op` through a worker, run to its answer without faults.
    pub fn final_retry(&mut self, op: usize) -> Option<ClientView> {
        self.ops[op].attempts_left = 1;
        self.ops[op].active = None;
        let w = self.c.below(self.workers.len() as u32) as usize;
        self.new_attempt(op, Some(w));
        let s = self.ops[op].active.or(Some(self.streams.len() - 1))?;
        for _ in 0..200 {
            if self.streams[s].client.complete || self.streams[s].ended {
                break;
            }
            if let Some(i) = self.ready_callout() {
                self.process(i);
            } else if let Some(i) = self
                .callouts
                .iter()
                .position(|c| !c.orphan && c.answer.is_some())
            {
                self.deliver(i);
            } else if self.streams[s].parts_sent < self.streams[s].request_parts() {
                self.send_part(s);
            } else if self.streams[s].in_transit {
                self.arrive(s);
            } else if self.streams[s].forwarded.is_some() && !self.streams[s].resp_end_seen {
                self.upstream_part(s);
            } else {
                self.advance(1_000);
            }
        }
        Some(self.streams[s].client.clone())
    }
}
