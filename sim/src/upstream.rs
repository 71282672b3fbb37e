//! The model upstream (the checkout): it executes a request on the first byte it receives and
//! may keep working after its caller left. Each execution is kept with the request it ran and
//! the response it produced, so the invariants can compare what clients were told against what
//! really happened. Like a careful payment service (and the demo checkout), it answers the
//! reconcile contract: what became of a key, and it refuses a request whose fencing token is
//! lower than one it promised to refuse.

use crate::state_api::Scope;
use contract::wire::{OUTCOME_EXECUTED, OUTCOME_HEADER, OUTCOME_NOT_EXECUTED, OUTCOME_RUNNING};
use std::collections::BTreeMap;

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
}

#[derive(Debug, Default, Clone)]
pub struct Upstream {
    pub executions: Vec<Execution>,
    /// Per scope, the token below which requests are refused (set by a `not-executed` answer;
    /// an execution's token refuses lower ones too).
    pub fence: BTreeMap<Scope, i64>,
}

/// What the reconcile endpoint answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcileAnswer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Upstream {
    pub fn of_scope<'a>(&'a self, scope: &'a Scope) -> impl Iterator<Item = &'a Execution> + 'a {
        self.executions.iter().filter(move |e| &e.scope == scope)
    }

    /// Whether a request of `scope` with `token` is refused: its token is lower than one the
    /// upstream has seen for the key (an execution's, or a reconcile's that promised so).
    pub fn refuses(&self, scope: &Scope, token: Option<i64>) -> bool {
        let Some(t) = token else { return false };
        let seen = self
            .of_scope(scope)
            .filter_map(|e| e.token)
            .chain(self.fence.get(scope).copied())
            .max();
        seen.is_some_and(|seen| t < seen)
    }

    /// The reconcile endpoint: what became of the key of `scope`, asked with a new `token`.
    pub fn reconcile(&mut self, scope: &Scope, token: i64) -> ReconcileAnswer {
        let protected: Vec<&Execution> = self
            .of_scope(scope)
            .filter(|e| e.token.is_some_and(|t| t < token))
            .collect();
        if let Some(done) = protected.iter().rev().find(|e| e.finished) {
            let mut headers = done.plan.response.headers.clone();
            headers.push((OUTCOME_HEADER.into(), OUTCOME_EXECUTED.into()));
            return ReconcileAnswer {
                status: done.plan.response.status,
                headers,
                body: done.plan.response.body.clone(),
            };
        }
        if !protected.is_empty() {
            return ReconcileAnswer {
                status: 409,
                headers: vec![
                    (OUTCOME_HEADER.into(), OUTCOME_RUNNING.into()),
                    ("retry-after".into(), "1".into()),
                ],
                body: Vec::new(),
            };
        }
        let fence = self.fence.entry(scope.clone()).or_insert(token);
        *fence = (*fence).max(token);
        ReconcileAnswer {
            status: 404,
            headers: vec![(OUTCOME_HEADER.into(), OUTCOME_NOT_EXECUTED.into())],
            body: Vec::new(),
        }
    }
}
