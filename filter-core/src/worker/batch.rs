//! What the batching lane holds: the claims and completes that wait for the worker's next
//! `/v1/writes`, and what each one on its way carries.

use crate::effect::StreamId;
use contract::wire::ClaimRequest;

/// Most bytes of claims and completes in one `/v1/writes` (a larger complete goes alone): well
/// inside the state API's request limit, which is 64 KiB over its largest stored body.
pub const BATCH_WRITE_BYTES: usize = 60 * 1024;

/// What a batch callout carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Batch {
    pub(super) claims: Vec<BatchedClaim>,
    pub(super) completes: Vec<BatchedWrite>,
}

/// A complete that waits for the worker's next `/v1/writes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BatchedWrite {
    pub(super) by: Writer,
    /// The `/v1/complete` body.
    pub(super) body: Vec<u8>,
}

/// Whose complete it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Writer {
    /// A held response's stream.
    Stream(StreamId),
    /// The worker's: one it took over (`complete_in_background`, a retry), by fencing token.
    Worker(i64),
}

impl BatchedWrite {
    pub(super) fn stream(&self) -> Option<StreamId> {
        match self.by {
            Writer::Stream(s) => Some(s),
            Writer::Worker(_) => None,
        }
    }
}

/// A stream's claim that waits for the worker's next `/v1/writes`, or is in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BatchedClaim {
    pub(super) stream: StreamId,
    pub(super) request: Box<ClaimRequest>,
}
