//! The model upstream (the checkout): it executes a request on the first byte it receives and
//! may keep working after its caller left. Each execution is kept with the request it ran and
//! the response it produced, so the invariants can compare what clients were told against what
//! really happened.

use crate::state_api::Scope;

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
}

#[derive(Debug, Default, Clone)]
pub struct Upstream {
    pub executions: Vec<Execution>,
}

impl Upstream {
    pub fn of_scope<'a>(&'a self, scope: &'a Scope) -> impl Iterator<Item = &'a Execution> + 'a {
        self.executions.iter().filter(move |e| &e.scope == scope)
    }
}
