//! The requests the batcher holds (owned claims and completes, with their callers' deadlines)
//! and the limits it groups them by.

use tokio::time::Instant;

use contract::wire::StoredResponse;

use crate::scope::ScopeHash;
use crate::store::{CompleteItem, NewClaim};

/// How requests are grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most requests per statement; 1 turns batching off (every request runs its own statements).
    pub max_items: usize,
    /// Statements running at once before requests queue for a batch: requests running the
    /// single-row statements inline, and the runner's batch (each holds a pool connection).
    pub in_flight: usize,
    /// Most bytes of stored responses (bodies and headers) per batch; a larger complete runs
    /// alone on the single path.
    pub max_bytes: usize,
    /// Most requests waiting in the queue.
    pub max_queued: usize,
    /// Most bytes of stored responses waiting in the queue or running alone (oversize).
    pub max_queued_bytes: usize,
}

/// A claim as the batcher holds it (owned).
#[derive(Debug, Clone)]
pub struct ClaimJob {
    pub scope: ScopeHash,
    pub subject: String,
    pub endpoint: String,
    pub fingerprint_alg: String,
    /// The request's fingerprint, keyed as records store it.
    pub fingerprint: state_rules::fingerprint::Keyed,
    pub lease_ms: u64,
    pub retention_ms: i64,
    pub take_over_unknown: bool,
    pub namespace: String,
    /// The claim attempt's nonce (`/v1/abandon`).
    pub nonce: Option<String>,
    /// During a rotation of the key secret: the key's address under the previous one (the
    /// claim's statement looks under both at once).
    pub previous: Option<ScopeHash>,
    /// When its caller stops waiting for the answer.
    pub deadline: Instant,
}

impl ClaimJob {
    pub(super) fn as_new(&self) -> NewClaim<'_> {
        NewClaim {
            scope: self.scope,
            subject: &self.subject,
            endpoint: &self.endpoint,
            fingerprint_alg: &self.fingerprint_alg,
            fingerprint: &self.fingerprint,
            lease_ms: self.lease_ms,
            retention_ms: self.retention_ms,
            take_over_unknown: self.take_over_unknown,
            namespace: &self.namespace,
            nonce: self.nonce.as_deref(),
            previous: self.previous,
        }
    }
}

/// A complete as the batcher holds it (owned).
#[derive(Debug, Clone)]
pub struct CompleteJob {
    pub scope: ScopeHash,
    pub token: i64,
    pub response: StoredResponse,
    pub retention_ms: i64,
    /// When its caller stops waiting for the answer.
    pub deadline: Instant,
}

impl CompleteJob {
    pub(super) fn as_item(&self) -> CompleteItem<'_> {
        CompleteItem {
            scope: &self.scope,
            token: self.token,
            response: &self.response,
            retention_ms: self.retention_ms,
        }
    }
}

/// Bytes a stored response adds to a batch.
pub(super) fn response_bytes(r: &StoredResponse) -> usize {
    r.headers.iter().fold(r.body.len(), |n, (k, v)| {
        n.saturating_add(k.len() + v.len())
    })
}
