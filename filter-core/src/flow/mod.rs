//! The per-request state machine. It sees one stream's events (request headers and body, the
//! state API's answers to its callouts, the upstream response, the end of the stream) and
//! returns what should happen: effects on its stream, callouts to make, and what the worker
//! should remember. It never calls the host and never touches the worker's memory: the worker
//! ([`crate::worker`]) routes its events to it and carries out what it returns.
//!
//! ```text
//! not protected / optional without key ──▶ Passthrough
//! headers (401/400/413 ▶ Replied)
//!   ▼
//! Buffering ──end of body──▶ Claiming ──claimed──▶ Upstream ──response headers──▶ Capturing
//!                              │ in_progress/completed/mismatch ▶ Replied            │ end of response
//!                              │ state API down ▶ Replied (503) or FailedOpen        ▼
//!                              │                                       Writing (complete/release,
//!                              │                                       response held) ──▶ Finished
//! ```
//!
//! One module per phase: [`request`] (headers, body, fingerprint), [`claim`] (the claim's
//! answer), [`response`] (the upstream's response), [`write`] (storing the outcome).

mod claim;
mod key_state;
mod reconcile;
pub(crate) mod request;
mod response;
mod write;

pub use crate::effect::Verdict;
use crate::effect::{Effect, Level, StreamId};
use crate::metrics::Metric;
use crate::reply::LocalReply;
use crate::worker::registry::HeldClaim;
use crate::worker::replay_cache::Completed;
use crate::worker::writes::PendingWrite;
use contract::fingerprint::Fingerprint;

pub(crate) use claim::completed_reply;
pub use claim::{ClaimAnswer, Remembered};
pub use request::{Full, RequestHead, Room, MAX_SUBJECT_LEN, RESERVE_PER_SUBJECT};
pub use response::ResponseHead;
pub use write::UNSTORED;

/// A callout a stream makes (the worker may answer a claim from memory instead, or take a
/// complete over).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Claim {
        /// The `/v1/claim` request (the worker sends it without its wait when its waiters are
        /// at their bound).
        request: Box<contract::wire::ClaimRequest>,
        /// The record's address in the worker's memory, and the request's fingerprint.
        id: crate::worker::ids::Id,
        fingerprint: Fingerprint,
    },
    Complete {
        body: Vec<u8>,
        /// What to store instead if the state API refuses `body`.
        fallback: Option<Vec<u8>>,
        claim: HeldClaim,
        /// The response as a replay would give it.
        record: Box<Completed>,
        /// Its first attempt: the worker may take it over (`complete_in_background`).
        first: bool,
    },
    Release {
        body: Vec<u8>,
    },
    /// Read a key's record from the state API (`GET /v1/records?...`) for the key state path.
    KeyState {
        /// The path with its query.
        path: String,
    },
    /// Ask the upstream what became of an earlier attempt (`on_unknown: reconcile`).
    Reconcile {
        cluster: String,
        /// Pseudo-headers included.
        headers: Vec<(String, String)>,
        timeout_ms: u64,
    },
}

/// What the worker keeps or forgets for a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// A claim won: extend its lease (`lease_ms`, as granted) until [`Note::Unregister`], on
    /// its route's terms.
    Register {
        claim: HeldClaim,
        lease_ms: u64,
        terms: crate::worker::registry::Terms,
    },
    Unregister(i64),
    /// The state API reported the key in progress elsewhere (answer duplicates from memory).
    HoldRunning {
        id: crate::worker::ids::Id,
        fingerprint: Fingerprint,
        retry_after_s: u32,
        since_ms: u64,
        lease_remaining_ms: u64,
    },
    /// This worker owns the key now, or it was released.
    ForgetRunning(crate::worker::ids::Id),
    /// A completed record, as the state API stored it.
    Remember {
        id: crate::worker::ids::Id,
        record: Box<Completed>,
        since_ms: u64,
        expires_in_ms: u64,
    },
    /// A claim sent with this nonce never reached its answer, and nothing was forwarded: the
    /// worker gives its record back (`/v1/abandon`, retried like a handed-over write).
    Abandon(Box<contract::wire::AbandonRequest>),
    /// The stream cannot finish this write itself: the worker sends it from now on.
    HandOver {
        write: PendingWrite,
        record: Option<Box<Completed>>,
    },
}

/// One output of the flow, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    Effect(Effect),
    Call(Call),
    Note(Note),
}

/// What a flow event returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub verdict: Verdict,
    pub outs: Vec<Out>,
}

impl Turn {
    fn cont() -> Self {
        Self {
            verdict: Verdict::Continue,
            outs: Vec::new(),
        }
    }
    fn pause() -> Self {
        Self {
            verdict: Verdict::Pause,
            outs: Vec::new(),
        }
    }
    fn with(mut self, o: impl Into<Out>) -> Self {
        self.outs.push(o.into());
        self
    }
    fn push(&mut self, o: impl Into<Out>) {
        self.outs.push(o.into());
    }
    /// Before every other output (a header set while the callback still holds the headers).
    fn push_first(&mut self, o: impl Into<Out>) {
        self.outs.insert(0, o.into());
    }
}

impl From<Effect> for Out {
    fn from(e: Effect) -> Self {
        Out::Effect(e)
    }
}
impl From<Call> for Out {
    fn from(c: Call) -> Self {
        Out::Call(c)
    }
}
impl From<Note> for Out {
    fn from(n: Note) -> Self {
        Out::Note(n)
    }
}

/// A protected request, as its headers told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub route: usize,
    pub key: String,
    pub subject: String,
    /// `"<METHOD> <path without query>"`.
    pub endpoint: String,
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: Option<String>,
    /// The deployment's namespace (part of the record's scope at the state API).
    pub namespace: String,
    /// How long the client asked to wait for a running key (`Prefer: wait`), capped by the
    /// route's `max_wait_s`; 0: answer 409 at once.
    pub wait_s: u64,
}

impl Request {
    pub fn id(&self) -> crate::worker::ids::Id {
        crate::worker::ids::id(&self.key, &self.subject, &self.endpoint)
    }
}

/// A request whose body has been read and fingerprinted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprinted {
    pub req: Request,
    pub fingerprint: Fingerprint,
    /// When the claim was sent.
    pub sent_ms: u64,
    /// The nonce the claim was sent with (set by the worker when it sends or queues it): a
    /// claim whose answer never comes back is given back by it (`/v1/abandon`).
    pub nonce: Option<String>,
}

/// A request that owns its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    pub req: Fingerprinted,
    pub token: i64,
    /// The lease the state API granted.
    pub lease_ms: u64,
    /// The largest body the state API stores, when it said.
    pub max_body: Option<u64>,
    /// How long the record is kept once completed, as the state API applies it, when it said.
    pub retention_s: Option<u64>,
}

impl Claimed {
    pub fn held(&self) -> HeldClaim {
        HeldClaim {
            key: self.req.req.key.clone(),
            subject: self.req.req.subject.clone(),
            endpoint: self.req.req.endpoint.clone(),
            token: self.token,
        }
    }
    fn endpoint(&self) -> &str {
        &self.req.req.endpoint
    }

    /// The registration of this claim for heartbeats, on its route's terms.
    fn register(&self, cfg: &crate::config::Config) -> Note {
        let route = self.req.req.route;
        Note::Register {
            claim: self.held(),
            lease_ms: self.lease_ms,
            terms: crate::worker::registry::Terms {
                lease_ms: cfg.lease_for(route),
                heartbeat_ms: cfg.heartbeat_for(route),
            },
        }
    }

    /// The log line of an unknown outcome: its subject, endpoint and token, never the key.
    fn unknown_log(&self, level: Level, what: impl std::fmt::Display) -> Out {
        Flow::log(
            level,
            format!(
                "outcome unknown: subject {}, {}, token {}: {what}",
                self.req.req.subject,
                self.endpoint(),
                self.token
            ),
        )
    }
}

/// The upstream's response, while its body is held.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Capture {
    status: u16,
    /// The headers kept to replay ([`crate::headers::stored`]).
    headers: Vec<(String, String)>,
    /// Every header that would be replayed could be kept.
    headers_complete: bool,
    /// Body bytes buffered so far (cumulative: the filter pauses every chunk).
    size: usize,
}

/// A write on its way on the stream, the response held until it is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Write {
    Complete {
        body: Vec<u8>,
        /// What to store if the state API refuses `body`: the status alone, not replayable.
        fallback: Option<Vec<u8>>,
        attempts: u8,
        record: Box<Completed>,
        /// A reconciled outcome: once stored it is the client's answer (a replay), as there is
        /// no upstream response to let go.
        reply: bool,
    },
    Release {
        body: Vec<u8>,
        attempts: u8,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Passthrough,
    Buffering {
        req: Request,
        body_size: usize,
        /// Its Content-Length (0 without one): held for it from the headers on.
        declared: usize,
    },
    Claiming(Fingerprinted),
    /// A `GET` on the key state path, waiting for the state API's read of the record.
    AskingAboutKey {
        route: usize,
        endpoint: String,
    },
    /// Holding a record whose outcome was unknown, asking the upstream about it.
    Reconciling(Claimed),
    Upstream(Claimed),
    Capturing(Claimed, Capture),
    Writing(Claimed, Write),
    FailedOpen,
    Replied,
    Finished,
}

/// How many times the stream sends a complete or release before handing it over or giving up.
const WRITE_ATTEMPTS: u8 = 2;

/// One request's state machine.
#[derive(Debug)]
pub struct Flow {
    stream: StreamId,
    state: State,
}

impl Flow {
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    fn effect(&self, e: impl FnOnce(StreamId) -> Effect) -> Out {
        Out::Effect(e(self.stream))
    }

    /// A local reply ends the flow.
    fn reply(&mut self, metric: Option<Metric>, r: LocalReply) -> Turn {
        self.state = State::Replied;
        let mut t = Turn::pause();
        if let Some(m) = metric {
            t.push(Effect::Count(m));
        }
        t.push(self.effect(|stream| Effect::Reply { stream, reply: r }));
        t
    }

    fn log(level: Level, msg: String) -> Out {
        Out::Effect(Effect::Log(level, msg))
    }

    /// The upstream response is wanted (the glue reads `response.code_details`/`flags` for it).
    pub fn awaits_response(&self) -> bool {
        matches!(self.state, State::Upstream(_))
    }

    /// A local reply was (or is being) sent: response callbacks leave it alone.
    pub fn replied(&self) -> bool {
        matches!(self.state, State::Replied)
    }

    /// Request body bytes held for this stream before it is forwarded: what it received, or
    /// what its Content-Length announced if more (the worker's `max_buffered_bytes`).
    pub fn held_request_bytes(&self) -> u64 {
        match &self.state {
            State::Buffering {
                body_size,
                declared,
                ..
            } => (*body_size).max(*declared) as u64,
            _ => 0,
        }
    }

    /// The subject whose share of the worker's buffering bound this stream's held bytes count
    /// in (while it buffers its request body).
    pub fn buffering_subject(&self) -> Option<&str> {
        match &self.state {
            State::Buffering { req, .. } => Some(&req.subject),
            _ => None,
        }
    }

    pub fn is_passthrough(&self) -> bool {
        matches!(self.state, State::Passthrough | State::FailedOpen)
    }

    pub fn state_name(&self) -> &'static str {
        match self.state {
            State::Passthrough => "passthrough",
            State::Buffering { .. } => "buffering",
            State::Claiming(_) => "claiming",
            State::AskingAboutKey { .. } => "asking_key_state",
            State::Reconciling(_) => "reconciling",
            State::Upstream(_) => "upstream",
            State::Capturing(..) => "capturing",
            State::Writing(..) => "writing",
            State::FailedOpen => "failed_open",
            State::Replied => "replied",
            State::Finished => "finished",
        }
    }

    /// Takes the state out for a transition that consumes it (the flow is `Finished` until the
    /// transition sets the next state).
    fn take(&mut self) -> State {
        std::mem::replace(&mut self.state, State::Finished)
    }
}

/// The worker tells the state API that the record's outcome is unknown (fenced by the claim's
/// token): the stream may end before a callout of its own could be answered.
pub(super) fn mark_unknown(claimed: &Claimed) -> Out {
    Out::Note(Note::HandOver {
        write: PendingWrite::fenced(
            claimed.held(),
            &claimed.req.req.namespace,
            contract::wire::UNKNOWN_PATH,
        ),
        record: None,
    })
}
