//! The vocabulary the filter's logic speaks to its host: streams and callouts as the worker
//! names them, what a callout answered, and the effects a stream callback or a worker event
//! returns for the glue (or the simulation) to carry out. Both the flows and the worker use
//! it; it uses neither.

use crate::metrics::Metric;
use crate::reply::LocalReply;

/// The return value of the current stream callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    Pause,
}

/// An HTTP stream (Envoy's context id of its HTTP context).
pub type StreamId = u32;

/// A callout, as the worker names it (the glue maps Envoy's tokens to these).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId(pub u64);

/// What became of a callout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutResult {
    /// Could not be dispatched, was reset or timed out before any response.
    Failed(String),
    /// The other side answered (any status).
    Response {
        status: u16,
        /// Its headers, pseudo-headers aside (read by the reconcile answer only).
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
}

impl CalloutResult {
    /// An answer without headers (the state API's, as the worker reads them).
    pub fn answer(status: u16, body: Vec<u8>) -> Self {
        Self::Response {
            status,
            headers: Vec::new(),
            body,
        }
    }

    /// A header of an answer.
    pub fn header(&self, name: &str) -> Option<&str> {
        match self {
            Self::Response { headers, .. } => headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str()),
            Self::Failed(_) => None,
        }
    }
}

impl CalloutResult {
    /// For logs: the failure, or the status and the start of the body.
    pub fn describe(&self) -> String {
        match self {
            CalloutResult::Response { status, body, .. } => format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(body.get(..body.len().min(200)).unwrap_or_default())
            ),
            CalloutResult::Failed(why) => why.clone(),
        }
    }
}

/// Who receives a callout's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The stream: made while it is handled; cancelled by Envoy when it ends.
    Stream(StreamId),
    /// The worker (root context): made only from the root context's events.
    Worker,
}

/// An HTTP callout to make (`dispatch_http_call`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    pub id: CallId,
    pub owner: Owner,
    /// The Envoy cluster.
    pub cluster: String,
    /// Pseudo-headers included.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

impl Dispatch {
    /// The value of a header (`:path`, ...).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

/// What the glue does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// `send_http_response`: the stream is answered and nothing is forwarded.
    Reply {
        stream: StreamId,
        reply: LocalReply,
    },
    /// Replace a request header (all its values).
    SetRequestHeader {
        stream: StreamId,
        name: &'static str,
        value: String,
    },
    RemoveRequestHeader {
        stream: StreamId,
        name: &'static str,
    },
    /// Replace a response header: only inside that stream's response headers callback, while
    /// they are Envoy's to send.
    SetResponseHeader {
        stream: StreamId,
        name: &'static str,
        value: String,
    },
    /// Let the request go upstream (inside that stream's request callback: return Continue).
    ResumeRequest {
        stream: StreamId,
    },
    /// Let the response go to the client (inside its response callback: return Continue).
    ResumeResponse {
        stream: StreamId,
    },
    /// Make a callout; if it cannot be dispatched, tell [`Worker::on_callout_answer`] at once.
    Dispatch(Dispatch),
    /// Wake the root context soon ([`Worker::on_wake`]): it has writes to send.
    Wake,
    Count(Metric),
    Log(Level, String),
}

/// What a stream callback returns: its verdict and the effects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub verdict: Verdict,
    pub effects: Vec<Effect>,
}

impl Step {
    pub(crate) fn cont() -> Self {
        Self {
            verdict: Verdict::Continue,
            effects: Vec::new(),
        }
    }
}

/// A callout's JSON body. The wire types always serialize; an empty body would be refused by
/// the state API rather than panic here.
pub(crate) fn to_json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}
