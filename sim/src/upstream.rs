//! The model upstream (the checkout): it executes a request on the first byte it receives and
//! may keep working after its caller left. Each execution is kept with the request it ran and
//! the response it produced, so the invariants can compare what clients were told against what
//! really happened. It follows the reference upstream's rules by running them: the demo
//! checkout's record of attempts (`checkout::attempts`) decides which fencing tokens it refuses
//! (at the start and at the commit), whether an execution charges, and what its reconcile
//! endpoint says of a key.

use crate::state_api::Scope;
pub use checkout::attempts::Scope as AttemptScope;
use checkout::attempts::{Attempts, Committed, Reconciled, Refusal, Started};
use contract::wire::{
    ENDPOINT_HEADER, FENCING_TOKEN_HEADER, FINGERPRINT_HEADER, OUTCOME_EXECUTED, OUTCOME_HEADER,
    OUTCOME_NOT_EXECUTED, OUTCOME_RUNNING,
};
use std::time::Duration;

/// A request as it reached the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

impl Sent {
    /// Whether two requests are the same request, judged independently of the filter's
    /// fingerprint: same method, path, query and media type, and the same body (as a JSON value
    /// when both are JSON, byte for byte otherwise).
    pub fn same_as(&self, other: &Sent) -> bool {
        let essence = |ct: &Option<String>| {
            ct.as_deref().map(|c| {
                c.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            })
        };
        if self.method != other.method
            || self.path != other.path
            || self.query != other.query
            || essence(&self.content_type) != essence(&other.content_type)
        {
            return false;
        }
        match (
            serde_json::from_slice::<serde_json::Value>(&self.body),
            serde_json::from_slice::<serde_json::Value>(&other.body),
        ) {
            (Ok(a), Ok(b)) => a == b,
            _ => self.body == other.body,
        }
    }
}

/// A response (produced by the upstream, or by Envoy's router on its behalf).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Produced {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Produced {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// How the upstream answers one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The last data chunk carries end of stream.
    WithLastChunk,
    /// An empty data frame carries end of stream after the last byte.
    EmptyFrame,
    /// Trailers end the body.
    Trailers,
    /// The connection is reset after this many body chunks.
    ResetAfter(usize),
    /// Nothing more after this many chunks: the caller waits (or gives up).
    StallAfter(usize),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Reset before any response header (the router answers 503 for it).
    pub reset_before_headers: bool,
    pub response: Produced,
    /// Body split into these chunk sizes (summing to the body's length).
    pub chunks: Vec<usize>,
    pub ending: Ending,
}

/// One execution.
#[derive(Debug, Clone)]
pub struct Execution {
    pub scope: Scope,
    /// The fencing token it was forwarded with (none: forwarded without a claim).
    pub token: Option<i64>,
    pub request: Sent,
    pub plan: Plan,
    pub at: u64,
    /// The stream it came from (its index in the world).
    pub stream: usize,
    /// Its outcome is produced (its response headers left, or it finished after its caller
    /// left); until then a reconcile hears `running`.
    pub finished: bool,
    /// The reference checkout's attempt (a request with an `Idempotency-Key`).
    pub attempt: Option<u64>,
    /// It committed with an effect: the charge happened (the reference refuses at the commit
    /// an attempt a larger token overtook, and answers one whose key executed meanwhile with
    /// that execution; a 5xx has no effect).
    pub charged: bool,
}

/// The model upstream: what it executed, and the reference checkout's record of attempts
/// (`checkout::attempts`), whose rules decide which tokens it refuses, what commits and what
/// its reconcile endpoint says.
#[derive(Debug, Default)]
pub struct Upstream {
    pub executions: Vec<Execution>,
    /// Requests it refused (a stale fencing token): nothing ran, and it answered 409 (an
    /// answer it produced, which the filter may store).
    pub refused: Vec<(Scope, Sent, Produced)>,
    pub attempts: Attempts,
    charges: u64,
}

/// What the reconcile endpoint answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcileAnswer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// The reference's kind of operation for an endpoint (its reconcile endpoint serves one kind:
/// `/checkout/attempts/{key}` the charges, `/shop/attempts/{key}` every `/shop/...` path).
pub fn kind(path: &str) -> &'static str {
    let path = path.trim_start_matches("POST ");
    match path {
        "/checkout" => "charge",
        "/refunds" => "refund",
        "/donate" => "donate",
        p if p.starts_with("/pay/") => "pay",
        p if p.starts_with("/shop/") => "shop",
        _ => "other",
    }
}

/// The 409 the reference answers for a stale fencing token: nothing ran.
pub fn stale_token() -> Produced {
    refused(Refusal::Stale { seen: 0 })
}

/// The reference's answer to an attempt it refuses (a stale or reused fencing token).
pub fn refused(r: Refusal) -> Produced {
    let kind = match r {
        Refusal::Stale { .. } => "stale-fencing-token",
        Refusal::Reused { .. } => "fencing-token-reused",
    };
    Produced {
        status: 409,
        headers: vec![("content-type".into(), "application/problem+json".into())],
        body: format!("{{\"type\":\"/problems/{kind}\"}}").into_bytes(),
    }
}

fn produced(p: checkout::attempts::Produced) -> Produced {
    Produced {
        status: p.status,
        headers: p.headers,
        body: p.body,
    }
}

/// What became of an execution at its commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// It had committed already.
    Done,
    /// It ran and charged.
    Charged,
    /// It ran with no effect (a 5xx).
    NoEffect,
    /// Nothing ran: the reference answers it otherwise (a larger token overtook it, or the
    /// key executed meanwhile).
    Answered,
}

/// A request as it reaches the upstream: the route's endpoint and subject, and what the
/// filter forwarded to name it (`idempotency-endpoint`, `idempotency-fingerprint`).
#[derive(Debug, Clone, Copy)]
pub struct RequestNamed<'a> {
    pub endpoint: &'a str,
    pub subject: &'a str,
    pub endpoint_header: Option<&'a str>,
    pub fingerprint: Option<&'a str>,
}

/// What the upstream does with a request that reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arrival {
    /// It runs.
    Runs,
    /// Nothing runs: the reference answers this (a refused token, or the response of the key's
    /// execution).
    Answered(Produced),
}

impl Upstream {
    pub fn of_scope<'a>(&'a self, scope: &'a Scope) -> impl Iterator<Item = &'a Execution> + 'a {
        self.executions.iter().filter(move |e| &e.scope == scope)
    }

    /// A request reaches the upstream: the reference records it before it runs when it
    /// carries a key, and may answer it without running it (a refused token, or a later attempt
    /// of a key that executed).
    pub fn start(
        &mut self,
        request: RequestNamed<'_>,
        key: Option<&str>,
        token: Option<i64>,
    ) -> (Option<u64>, Arrival) {
        let Some(key) = key else {
            return (None, Arrival::Runs);
        };
        let scope = AttemptScope {
            // The request as the edge names it (the route's own endpoint without one).
            endpoint: request
                .endpoint_header
                .unwrap_or(request.endpoint)
                .to_owned(),
            subject: request.subject.to_owned(),
            key: key.to_owned(),
            fingerprint: request.fingerprint.map(str::to_owned),
        };
        let (id, started) =
            self.attempts
                .start(kind(request.endpoint), scope, token, Duration::ZERO);
        let arrival = match started {
            Started::Run => Arrival::Runs,
            Started::AlreadyExecuted(p) => Arrival::Answered(produced(p)),
            Started::Refused(r) => Arrival::Answered(refused(r)),
        };
        (Some(id), arrival)
    }

    /// Execution `e` commits (its response leaves, or it finishes after its caller left), as
    /// the reference decides in one step: it runs and charges, or runs with no effect (a 5xx),
    /// or another attempt overtook it (a larger token: 409) or executed the key meanwhile (that
    /// response), and nothing is charged.
    pub fn commit(&mut self, e: usize) -> Commit {
        let Some(x) = self.executions.get(e) else {
            return Commit::Done;
        };
        if x.finished {
            return Commit::Done;
        }
        let attempt = x.attempt;
        let planned = x.plan.response.clone();
        let next_charge = self.charges + 1;
        let committed = match attempt {
            Some(id) => self.attempts.commit(id, || {
                (
                    next_charge,
                    checkout::attempts::Produced {
                        status: planned.status,
                        headers: planned.headers.clone(),
                        body: planned.body.clone(),
                    },
                )
            }),
            None => Committed::Ran(checkout::attempts::Produced {
                status: planned.status,
                headers: planned.headers.clone(),
                body: planned.body.clone(),
            }),
        };
        let x = &mut self.executions[e];
        x.finished = true;
        let answer = match committed {
            // A 5xx had no effect by the reference's rules (nothing charged; a later token runs).
            Committed::Ran(p) if p.status >= 500 => return Commit::NoEffect,
            Committed::Ran(_) => {
                x.charged = true;
                self.charges = next_charge;
                return Commit::Charged;
            }
            Committed::AlreadyExecuted(p) => produced(p),
            Committed::Refused(r) => refused(r),
        };
        x.plan.chunks = if answer.body.is_empty() {
            Vec::new()
        } else {
            vec![answer.body.len()]
        };
        x.plan.response = answer;
        x.plan.ending = Ending::WithLastChunk;
        Commit::Answered
    }

    /// The reconcile endpoint of `kind`: what became of `key` for `subject`, asked with the new
    /// owner's `token` (as the checkout's handler answers it).
    pub fn reconcile(&mut self, scope: AttemptScope, token: i64) -> ReconcileAnswer {
        let problem = |status: u16, outcome: Option<&str>| {
            let mut headers = vec![
                (
                    "content-type".to_owned(),
                    "application/problem+json".to_owned(),
                ),
                ("cache-control".to_owned(), "no-store".to_owned()),
            ];
            if let Some(o) = outcome {
                headers.push((OUTCOME_HEADER.into(), o.into()));
            }
            (status, headers)
        };
        let (status, headers, body) = match self.attempts.reconcile(scope.clone(), token) {
            // The answer names the attempt it describes: its token, endpoint and fingerprint.
            Reconciled::Executed { token, produced } => {
                let mut headers = produced.headers;
                headers.push((OUTCOME_HEADER.into(), OUTCOME_EXECUTED.into()));
                headers.push((FENCING_TOKEN_HEADER.into(), token.to_string()));
                headers.push((ENDPOINT_HEADER.into(), scope.endpoint));
                headers.push((
                    FINGERPRINT_HEADER.into(),
                    scope.fingerprint.unwrap_or_default(),
                ));
                (produced.status, headers, produced.body)
            }
            Reconciled::Running { retry_after } => {
                let (status, mut headers) = problem(409, Some(OUTCOME_RUNNING));
                let secs = retry_after.as_secs().clamp(1, 120);
                headers.push(("retry-after".into(), secs.to_string()));
                (status, headers, b"{}".to_vec())
            }
            Reconciled::NotExecuted => {
                let (status, headers) = problem(404, Some(OUTCOME_NOT_EXECUTED));
                (status, headers, b"{}".to_vec())
            }
            Reconciled::Stale => {
                let (status, headers) = problem(409, None);
                (status, headers, b"{}".to_vec())
            }
            // The reference forgot older requests (more than it keeps): it cannot tell.
            Reconciled::CannotTell => {
                let (status, headers) = problem(503, None);
                (status, headers, b"{}".to_vec())
            }
        };
        ReconcileAnswer {
            status,
            headers,
            body,
        }
    }
}
