//! The request phase: is the route protected, who is the caller, which key, and the body's
//! fingerprint; then the claim.

use super::{Call, Fingerprinted, Flow, Request, State, Turn};
use crate::config::{Config, KeyPolicy, OnUnknown, Selection, SubjectSource};
use crate::effect::{Effect, Level, StreamId};
use crate::key::{self, parse_key_header};
use crate::metrics::Metric;
use crate::reply::{self, LocalReply};
use crate::route_table::RouteTable;
use contract::fingerprint::{self, FingerprintError};
use contract::wire::{ClaimRequest, FORWARDED_HEADERS};
use contract::ProblemKind;
use std::collections::HashMap;

/// Longest accepted subject (bytes): what the state API stores.
pub const MAX_SUBJECT_LEN: usize = contract::limits::MAX_FIELD_LEN;

/// What the glue knows when request headers arrive.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    /// All request headers, pseudo-headers included, as Envoy lists them (repeats kept).
    pub headers: &'a [(String, String)],
    /// The subject read from dynamic metadata (only for `subject.metadata`).
    pub metadata_subject: Option<&'a str>,
}

impl RequestHead<'_> {
    pub(crate) fn values(&self, name: &str) -> Vec<&str> {
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

fn valid_subject(s: &str) -> bool {
    contract::limits::valid_field(s)
}

/// The authenticated caller, as the configuration says where to find it; `None` when there is
/// none, or more than one, or one no record can hold.
pub(crate) fn subject_of(cfg: &Config, head: &RequestHead<'_>) -> Option<String> {
    let subject = match &cfg.subject {
        SubjectSource::Header(h) => match head.values(h).as_slice() {
            [one] => Some((*one).to_owned()),
            _ => None,
        },
        SubjectSource::Metadata(_) => head.metadata_subject.map(str::to_owned),
    };
    subject.filter(|s| valid_subject(s))
}

/// The seconds of a `Prefer: wait=N` preference (RFC 7240), the first one that parses; other
/// preferences and their parameters are ignored.
pub(crate) fn prefer_wait(values: &[&str]) -> Option<u64> {
    values
        .iter()
        .flat_map(|v| v.split(','))
        .filter_map(|pref| {
            let head = pref.split(';').next()?.trim();
            let (name, value) = head.split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("wait") {
                return None;
            }
            let value = value.trim().trim_matches('"');
            (!value.is_empty() && value.len() <= 6 && value.bytes().all(|b| b.is_ascii_digit()))
                .then(|| value.parse().ok())
                .flatten()
        })
        .next()
}

/// The request body bytes a stream may still hold before it is forwarded: its worker's room
/// (`max_buffered_bytes` less what the worker's other streams hold), and its subject's
/// (`max_buffered_bytes_per_subject` less what that subject's other streams hold), so that one
/// caller's unfinished bodies cannot take the whole bound (the worker's `Buffered` keeps both).
/// The last [`Config::buffer_reserve`] bytes of the worker's room are kept for callers who hold
/// little: a body that would reach into them is admitted only if its subject then holds at most
/// [`RESERVE_PER_SUBJECT`], so that many callers' large bodies held open together (each within
/// its share) still leave room for everyone else's ordinary requests.
pub struct Room<'a> {
    /// The worker's room, this stream's own bytes not counted.
    pub worker: u64,
    /// Of the bound, the part kept for subjects that hold little ([`Config::buffer_reserve`]).
    pub reserve: u64,
    /// [`Config::max_buffered_bytes_per_subject`].
    pub share: u64,
    /// What each subject's other streams hold.
    pub held_by_subject: &'a HashMap<String, u64>,
}

/// What one subject may hold in all when its body reaches into the worker's reserve: a few
/// ordinary payment requests (a checkout body is a few KiB), not a large one.
pub const RESERVE_PER_SUBJECT: u64 = 64 * 1024;

/// Which bound a request body would go over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// The worker's bound.
    Worker,
    /// The subject's share of it.
    Subject,
    /// The bound but its reserve, for a subject that would hold more than a little.
    Reserve,
}

impl Room<'_> {
    /// Whether `subject`'s stream may not hold `bytes` in all, and which bound it would pass.
    pub fn refuses(&self, subject: &str, bytes: u64) -> Option<Full> {
        if bytes > self.worker {
            return Some(Full::Worker);
        }
        let others = self.held_by_subject.get(subject).copied().unwrap_or(0);
        if bytes > self.share.saturating_sub(others) {
            return Some(Full::Subject);
        }
        let outside_reserve = self.worker.saturating_sub(self.reserve);
        let within_reserve_share = others.saturating_add(bytes) <= RESERVE_PER_SUBJECT;
        (bytes > outside_reserve && !within_reserve_share).then_some(Full::Reserve)
    }
}

impl Flow {
    /// `414 endpoint-too-long`: a record cannot hold a method and path over its field limit.
    pub(super) fn endpoint_too_long(&mut self) -> Turn {
        self.reply(
            Some(Metric::EndpointTooLong414),
            LocalReply::problem(
                ProblemKind::EndpointTooLong,
                format!(
                    "a protected request's method and path are limited to {} bytes",
                    contract::limits::MAX_FIELD_LEN
                ),
            ),
        )
    }

    /// A new stream's request headers. `routes`: `cfg`'s routes as its worker looks them up.
    /// `room`: the request body bytes its worker, and each subject, may still hold.
    pub fn start(
        cfg: &Config,
        routes: &RouteTable,
        stream: StreamId,
        head: RequestHead<'_>,
        end_of_stream: bool,
        now_ms: u64,
        room: &Room<'_>,
    ) -> (Self, Turn) {
        let mut flow = Self {
            stream,
            state: State::Passthrough,
        };
        let turn = flow.on_request_headers(cfg, routes, head, end_of_stream, now_ms, room);
        (flow, turn)
    }

    fn on_request_headers(
        &mut self,
        cfg: &Config,
        routes: &RouteTable,
        head: RequestHead<'_>,
        end_of_stream: bool,
        now_ms: u64,
        room: &Room<'_>,
    ) -> Turn {
        // A client's copy of a header the filter forwards (the fencing token, the endpoint, the
        // fingerprint) is never trusted, on any route and on every path (passed through,
        // refused, claimed, or left to the body): the upstream may act on it. It goes first, in
        // the headers' own callback; a claimed request gets the filter's.
        let forged: Vec<&'static str> = FORWARDED_HEADERS
            .into_iter()
            .filter(|name| head.first(name).is_some())
            .collect();
        let mut turn = self.read_request_headers(cfg, routes, head, end_of_stream, now_ms, room);
        let strips = forged
            .into_iter()
            .map(|name| self.effect(|stream| Effect::RemoveRequestHeader { stream, name }));
        turn.outs.splice(0..0, strips);
        turn
    }

    fn read_request_headers(
        &mut self,
        cfg: &Config,
        routes: &RouteTable,
        head: RequestHead<'_>,
        end_of_stream: bool,
        now_ms: u64,
        room: &Room<'_>,
    ) -> Turn {
        let method = head.first(":method").unwrap_or("").to_owned();
        let full_path = head.first(":path").unwrap_or("");
        let (path, query) = match full_path.split_once('?') {
            Some((p, q)) => (p.to_owned(), q.to_owned()),
            None => (full_path.to_owned(), String::new()),
        };
        if method == "GET" && cfg.key_state_path.as_deref() == Some(path.as_str()) {
            return self.ask_key_state(cfg, routes, &head, &query, end_of_stream);
        }
        let Some((route_idx, route)) = routes
            .find(&method, &path)
            .and_then(|i| cfg.routes.get(i).map(|r| (i, r)))
        else {
            return Turn::cont();
        };
        let key_values = head.values(key::HEADER);
        if key_values.is_empty() && route.key == KeyPolicy::Optional && route.key_from.is_none() {
            // Not protected without a key.
            return Turn::cont();
        }
        let endpoint = format!("{method} {path}");
        if endpoint.len() > contract::limits::MAX_FIELD_LEN {
            // A record cannot hold it: refused here rather than by the state API (which a
            // fail_open route would take for an outage and forward unprotected).
            return self.endpoint_too_long();
        }

        let Some(subject) = subject_of(cfg, &head) else {
            return self.reply(
                Some(Metric::Unauthenticated401),
                LocalReply::problem(
                    ProblemKind::Unauthenticated,
                    "this operation needs an authenticated caller",
                ),
            );
        };

        let key = match parse_key_header(&key_values) {
            // Read from the body once it is there.
            _ if route.key_from.is_some() => String::new(),
            Ok(Some(k)) => k,
            Ok(None) => {
                return self.reply(
                    Some(Metric::BadKey400),
                    LocalReply::problem(
                        ProblemKind::MissingKey,
                        format!("{method} {path} requires an Idempotency-Key header"),
                    ),
                )
            }
            Err(e) => {
                return self.reply(
                    Some(Metric::BadKey400),
                    LocalReply::problem(ProblemKind::InvalidKey, e.to_string()),
                )
            }
        };

        let declared = head
            .first("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if declared > cfg.max_request_body_for(route_idx) {
            return self.too_large(cfg.max_request_body_for(route_idx));
        }
        if !end_of_stream {
            if let Some(refusal) = room.refuses(&subject, declared) {
                return self.buffers_full(refusal);
            }
        }

        let req = Request {
            route: route_idx,
            key,
            subject,
            endpoint,
            method,
            path,
            query,
            content_type: head.first("content-type").map(str::to_owned),
            namespace: cfg.namespace.clone(),
            wait_s: prefer_wait(&head.values("prefer")).map_or(0, |w| w.min(route.max_wait_s)),
        };
        if end_of_stream {
            return self.fingerprint(cfg, req, &[], now_ms);
        }
        self.state = State::Buffering {
            req,
            body_size: 0,
            // At most the route's limit (checked above), so it fits.
            declared: usize::try_from(declared).unwrap_or(usize::MAX),
        };
        Turn::pause()
    }

    /// 503 + Retry-After: the worker holds as many request body bytes as it may
    /// (`max_buffered_bytes`, or all but its reserve for a subject that holds more than a
    /// little), or this subject's requests as many as one subject may
    /// (`max_buffered_bytes_per_subject`). Nothing was forwarded or claimed.
    fn buffers_full(&mut self, refusal: Full) -> Turn {
        match refusal {
            Full::Worker => self.reply(Some(Metric::BuffersFull503), reply::buffers_full()),
            Full::Subject => self.reply(
                Some(Metric::SubjectBuffersFull503),
                reply::subject_buffers_full(),
            ),
            Full::Reserve => self.reply(
                Some(Metric::ReserveBuffersFull503),
                reply::reserve_buffers_full(),
            ),
        }
    }

    fn too_large(&mut self, max: u64) -> Turn {
        self.reply(
            Some(Metric::TooLarge413),
            LocalReply::problem(
                ProblemKind::PayloadTooLarge,
                format!("the request body is limited to {max} bytes"),
            ),
        )
    }

    /// A request body callback. `body_size` is cumulative (the filter paused). `read(n)` reads
    /// the first `n` buffered bytes; it is called at most once, at the end of the body.
    /// `room`: as in [`Flow::start`], this stream's own bytes not counted.
    pub fn on_request_body(
        &mut self,
        cfg: &Config,
        body_size: usize,
        end_of_stream: bool,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        now_ms: u64,
        room: &Room<'_>,
    ) -> Turn {
        let State::Buffering {
            body_size: seen,
            req,
            declared,
        } = &mut self.state
        else {
            return Turn::cont();
        };
        *seen = body_size;
        let max = cfg.max_request_body_for(req.route);
        if body_size as u64 > max {
            return self.too_large(max);
        }
        // More than its Content-Length announced (or none was): the rest must fit too.
        if body_size > *declared {
            if let Some(refusal) = room.refuses(&req.subject, body_size as u64) {
                return self.buffers_full(refusal);
            }
        }
        if !end_of_stream {
            return Turn::pause();
        }
        self.body_done(cfg, read, now_ms)
    }

    /// Request trailers (HTTP/2): the body ended without `end_of_stream` on a body callback.
    pub fn on_request_trailers(
        &mut self,
        cfg: &Config,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        now_ms: u64,
    ) -> Turn {
        if !matches!(self.state, State::Buffering { .. }) {
            return Turn::cont();
        }
        self.body_done(cfg, read, now_ms)
    }

    fn body_done(
        &mut self,
        cfg: &Config,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        now_ms: u64,
    ) -> Turn {
        let State::Buffering { req, body_size, .. } = self.take() else {
            return Turn::cont();
        };
        let body = if body_size == 0 {
            Some(Vec::new())
        } else {
            read(body_size)
        };
        match body {
            Some(body) => self.fingerprint(cfg, req, &body, now_ms),
            None => self
                .reply(
                    None,
                    LocalReply::problem(
                        ProblemKind::Internal,
                        "the request body could not be read",
                    ),
                )
                .with(Flow::log(
                    Level::Error,
                    "could not read the buffered request body".into(),
                )),
        }
    }

    /// Fingerprints the request and asks to claim its key.
    fn fingerprint(&mut self, cfg: &Config, mut req: Request, body: &[u8], now_ms: u64) -> Turn {
        let route = cfg.routes.get(req.route);
        if let Some(pointer) = route.and_then(|r| r.key_from.as_ref()) {
            match fingerprint::string_at(body, pointer) {
                Some(k) => match contract::validate_key(&k) {
                    Ok(()) => req.key = k,
                    Err(e) => {
                        return self.reply(
                            Some(Metric::BadKey400),
                            LocalReply::problem(
                                ProblemKind::InvalidKey,
                                format!("the key in {}: {e}", pointer.as_str()),
                            ),
                        )
                    }
                },
                None if route.is_some_and(|r| r.key == KeyPolicy::Optional) => {
                    // Not protected without a key: the buffered body goes on.
                    self.state = State::Passthrough;
                    return Turn::cont()
                        .with(self.effect(|stream| Effect::ResumeRequest { stream }));
                }
                None => {
                    return self.reply(
                        Some(Metric::BadKey400),
                        LocalReply::problem(
                            ProblemKind::MissingKey,
                            format!(
                            "{} requires its idempotency key as a string at {} in the JSON body",
                            req.endpoint,
                            pointer.as_str()
                        ),
                        ),
                    )
                }
            }
        }
        let selection = route.map(|r| &r.fingerprint).unwrap_or(&Selection::Whole);
        let fingerprint = match fingerprint::fingerprint_with(
            &req.method,
            &req.path,
            &req.query,
            req.content_type.as_deref(),
            body,
            selection,
        ) {
            Ok(fp) => fp,
            Err(e @ FingerprintError::DuplicateMember(_)) => {
                return self.reply(
                    Some(Metric::BadBody400),
                    LocalReply::problem(ProblemKind::DuplicateJsonMember, e.to_string()),
                )
            }
        };
        let request = Box::new(ClaimRequest {
            key: req.key.clone(),
            subject: req.subject.clone(),
            endpoint: req.endpoint.clone(),
            fingerprint: fingerprint.hex.clone(),
            fingerprint_alg: fingerprint.alg.to_string(),
            lease_ms: Some(cfg.lease_for(req.route)),
            namespace: req.namespace.clone(),
            retention_s: route.and_then(|r| r.retention_s),
            wait_ms: (req.wait_s > 0).then_some(req.wait_s.saturating_mul(1000)),
            on_unknown: match cfg.routes.get(req.route).map(|r| r.on_unknown) {
                Some(OnUnknown::Reconcile | OnUnknown::Reexecute) => {
                    contract::wire::OnUnknown::TakeOver
                }
                _ => contract::wire::OnUnknown::Hold,
            },
            // The worker names the attempt when it sends it.
            nonce: None,
        });
        let call = Call::Claim {
            request,
            id: req.id(),
            fingerprint: fingerprint.clone(),
        };
        self.state = State::Claiming(Fingerprinted {
            req,
            fingerprint,
            sent_ms: now_ms,
            nonce: None,
        });
        Turn::pause().with(call)
    }
}
