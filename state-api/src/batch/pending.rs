//! A queued request and where its answer goes; taking a batch off the queue; running a batch
//! as one statement and answering each request, or handing it to the single path.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::time::Instant;

use contract::wire::ClaimResponse;

use crate::metrics::{BatchOp, Metrics};
use crate::scope::ScopeHash;
use crate::store::{
    BatchAnswers, BatchedClaim, CompleteItem, NewClaim, Store, StoreError, WriteResult,
};

use super::jobs::{response_bytes, ClaimJob, CompleteJob};

pub(super) type Reply<A> = oneshot::Sender<Result<A, StoreError>>;

/// A request and where its answer goes.
pub(super) enum Pending {
    Claim(ClaimJob, Reply<ClaimResponse>),
    Complete(CompleteJob, Reply<WriteResult>),
}

/// What the batch assembly needs to know about a queued request.
pub(crate) trait Queued {
    fn scope(&self) -> &ScopeHash;
    /// Its share of `BatchLimits::max_bytes`.
    fn bytes(&self) -> usize;
}

impl Queued for Pending {
    fn scope(&self) -> &ScopeHash {
        match self {
            Self::Claim(j, _) => &j.scope,
            Self::Complete(j, _) => &j.scope,
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Self::Claim(..) => 0,
            Self::Complete(j, _) => response_bytes(&j.response),
        }
    }
}

impl Pending {
    pub(super) fn op(&self) -> BatchOp {
        match self {
            Self::Claim(..) => BatchOp::Claim,
            Self::Complete(..) => BatchOp::Complete,
        }
    }

    pub(super) fn deadline(&self) -> Instant {
        match self {
            Self::Claim(j, _) => j.deadline,
            Self::Complete(j, _) => j.deadline,
        }
    }

    /// Its caller gave up already (its answer would go nowhere).
    pub(super) fn caller_gone(&self, now: Instant) -> bool {
        now >= self.deadline()
            || match self {
                Self::Claim(_, reply) => reply.is_closed(),
                Self::Complete(_, reply) => reply.is_closed(),
            }
    }

    /// The single-row path, exactly as without batching; answers.
    pub(super) async fn run_one(self, store: &Store, metrics: &Metrics) {
        match self {
            Self::Claim(job, reply) => {
                let answer = store.claim(&job.as_new()).await;
                deliver_claim(store, metrics, &job, reply, answer).await;
            }
            Self::Complete(job, reply) => {
                let answer = store
                    .complete(&job.scope, job.token, &job.response, job.retention_ms)
                    .await;
                let _ = reply.send(answer);
            }
        }
    }

    /// What the single path does for a request the batch statement did not settle; answers.
    pub(super) async fn after_batch(self, store: &Store, metrics: &Metrics) {
        match self {
            // Lost a race with a concurrent inserter, or a lease or retention ran out: the
            // whole claim again, which reads, reclaims or takes over as it always does.
            claim @ Self::Claim(..) => claim.run_one(store, metrics).await,
            // Not this token's in-progress record: the single path's second step tells a
            // retried complete of the same owner from a fenced-out one.
            Self::Complete(job, reply) => {
                let _ = reply.send(
                    store
                        .complete_unmatched(&job.scope, &job.scope, job.token)
                        .await,
                );
            }
        }
    }

    pub(super) fn fail(self, e: &Arc<StoreError>) {
        self.answer_err(StoreError::Batch(e.clone()));
    }

    pub(super) fn answer_err(self, e: StoreError) {
        match self {
            Self::Claim(_, reply) => {
                let _ = reply.send(Err(e));
            }
            Self::Complete(_, reply) => {
                let _ = reply.send(Err(e));
            }
        }
    }
}

/// Answers a claim. An answer its caller no longer waits for (its deadline passed, or its
/// connection went) that made it the owner is released at once: the caller was answered 503,
/// so nothing was forwarded with the token, and the key must not stay in progress for a lease.
pub(super) async fn deliver_claim(
    store: &Store,
    metrics: &Metrics,
    job: &ClaimJob,
    reply: Reply<ClaimResponse>,
    answer: Result<ClaimResponse, StoreError>,
) {
    let Err(Ok(ClaimResponse::Claimed { token, .. })) = reply.send(answer) else {
        return;
    };
    // The claim was granted under the current secret's address (a claim moves the record there).
    match store
        .release(&job.scope, &job.scope, token, job.retention_ms)
        .await
    {
        Ok(_) => metrics.released_for_gone_caller(),
        // The lease runs out instead, and the record becomes unknown: held or reconciled.
        Err(e) => {
            tracing::warn!(error = %e, "a claim made for a caller that gave up could not be released")
        }
    }
}

/// Runs `batch` (two or more distinct scopes) as one statement and answers every request but
/// the ones it returns, which go on to `Pending::after_batch`.
pub(super) async fn run_batch(
    mut batch: Vec<Pending>,
    store: &Store,
    metrics: &Metrics,
) -> Vec<Pending> {
    // Scope order: the INSERT takes its locks in that order, the UPDATE walks its input so.
    batch.sort_unstable_by_key(|p| *p.scope());
    let mut claims = Vec::new();
    let mut completes = Vec::new();
    for p in batch {
        match p {
            Pending::Claim(job, reply) => claims.push((job, reply)),
            Pending::Complete(job, reply) => completes.push((job, reply)),
        }
    }
    let result = {
        let new: Vec<NewClaim<'_>> = claims.iter().map(|(j, _)| j.as_new()).collect();
        let items: Vec<CompleteItem<'_>> = completes.iter().map(|(j, _)| j.as_item()).collect();
        store.write_many(&new, &items).await
    };
    let answers = match result {
        Ok(a) => a,
        Err(e) => {
            let e = Arc::new(e);
            for (job, reply) in claims {
                Pending::Claim(job, reply).fail(&e);
            }
            for (job, reply) in completes {
                Pending::Complete(job, reply).fail(&e);
            }
            return Vec::new();
        }
    };
    let BatchAnswers {
        claims: claimed,
        completes: completed,
    } = answers;
    let mut rest = Vec::new();
    for ((job, reply), answer) in claims.into_iter().zip(claimed) {
        match answer {
            BatchedClaim::Answered(outcome) => {
                deliver_claim(store, metrics, &job, reply, Ok(outcome)).await;
            }
            BatchedClaim::Failed(e) => {
                let _ = reply.send(Err(e));
            }
            BatchedClaim::SinglePath => rest.push(Pending::Claim(job, reply)),
        }
    }
    for ((job, reply), done) in completes.into_iter().zip(completed) {
        match done {
            Some(expires_in_ms) => {
                let _ = reply.send(Ok(WriteResult::Done { expires_in_ms }));
            }
            None => rest.push(Pending::Complete(job, reply)),
        }
    }
    rest
}

/// A batch taken from a queue.
pub(crate) struct Taken<T> {
    /// For one statement: distinct scopes, in arrival order.
    pub batch: Vec<T>,
    /// Later requests for a scope of `batch`: they run on the single path once the batch has
    /// committed (so an earlier request for a key is never overtaken by a later one).
    pub followers: Vec<T>,
}

/// Takes the next batch off `queue`: requests in arrival order, at most `max_items` and
/// `max_bytes` (at least one request, whatever its size), none whose scope is in `busy` (a
/// running batch's: those stay queued, in order, for after it). The scopes taken are added to
/// `busy`.
pub(crate) fn take_batch<T: Queued>(
    queue: &mut VecDeque<T>,
    busy: &mut HashSet<ScopeHash>,
    max_items: usize,
    max_bytes: usize,
) -> Taken<T> {
    let mut batch: Vec<T> = Vec::new();
    let mut followers = Vec::new();
    let mut mine: HashSet<ScopeHash> = HashSet::new();
    let mut left = VecDeque::new();
    let mut bytes = 0usize;
    let mut full = false;
    while let Some(next) = queue.pop_front() {
        let scope = *next.scope();
        if mine.contains(&scope) {
            followers.push(next);
            continue;
        }
        if full || busy.contains(&scope) {
            left.push_back(next);
            continue;
        }
        let after = bytes.saturating_add(next.bytes());
        if batch.len() >= max_items || (!batch.is_empty() && after > max_bytes) {
            full = true;
            left.push_back(next);
            continue;
        }
        bytes = after;
        mine.insert(scope);
        batch.push(next);
    }
    *queue = left;
    busy.extend(mine);
    Taken { batch, followers }
}
