//! Group commit: concurrent claims (and completes) share one statement and one durable commit.
//!
//! Each kind of request (claim, complete) has a lane: a queue and at most `in_flight` runners.
//! A request that finds a free runner slot and an empty queue runs the single-row statements
//! itself, at once, exactly as without batching. Otherwise it queues with a oneshot for its
//! answer; a runner takes everything queued at that moment (up to `max_items`, and for completes
//! up to `max_bytes` of stored responses), runs it as one statement over arrays, and answers
//! each request. There is no timer: while one batch runs, the next one queues up.
//!
//! What this keeps from the single path:
//! - a claim is answered only after the statement that INSERTed it has committed
//!   (`synchronous_commit=on`, one autocommit statement per batch);
//! - a batch of one runs the single-row statements (`Store::claim`, `Store::complete`);
//! - any request the batch statement does not settle (a claim that lost a race with a
//!   concurrent inserter, a lease or retention that ran out, a complete whose UPDATE matched
//!   nothing) goes on to the single path, which decides as it always did;
//! - one scope hash is never twice in the statements of one lane at once: a second request for
//!   a scope that is already queued in the batch being taken, or in a batch still running, runs
//!   on the single path (so batches never wait on each other's rows and cannot deadlock);
//! - an error of a batch statement is every request's error (503 when unavailable), and every
//!   request gets exactly one answer: a runner drains the queue before it stops, and a request
//!   whose batch vanished without answering gets `StoreError::Unanswered` (503).

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::{oneshot, Notify};

use crate::metrics::{BatchOp, Metrics, SinglePathReason};
use crate::scope::ScopeHash;
use crate::store::{
    BatchedClaim, ClaimOutcome, CompleteItem, NewClaim, Store, StoreError, StoredRow, WriteResult,
};

/// How requests are grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most requests per statement; 1 turns batching off (every request runs its own statements).
    pub max_items: usize,
    /// Batches of one kind running at once (each holds a pool connection while it runs).
    pub in_flight: usize,
    /// Most bytes of stored responses (bodies and headers) per complete batch; a larger
    /// complete runs alone on the single path.
    pub max_bytes: usize,
}

/// A claim as the batcher holds it (owned).
#[derive(Debug, Clone)]
pub struct ClaimJob {
    pub scope: ScopeHash,
    pub subject: String,
    pub endpoint: String,
    pub fingerprint_alg: String,
    pub fingerprint: String,
    pub lease_ms: u64,
    pub retention_ms: i64,
}

impl ClaimJob {
    fn as_new(&self) -> NewClaim<'_> {
        NewClaim {
            scope: self.scope,
            subject: &self.subject,
            endpoint: &self.endpoint,
            fingerprint_alg: &self.fingerprint_alg,
            fingerprint: &self.fingerprint,
            lease_ms: self.lease_ms,
            retention_ms: self.retention_ms,
        }
    }
}

/// A complete as the batcher holds it (owned).
#[derive(Debug, Clone)]
pub struct CompleteJob {
    pub scope: ScopeHash,
    pub token: i64,
    pub response: StoredRow,
    pub retention_ms: i64,
}

/// Bytes a stored response adds to a complete batch.
fn response_bytes(r: &StoredRow) -> usize {
    r.headers.iter().fold(r.body.len(), |n, (k, v)| {
        n.saturating_add(k.len() + v.len())
    })
}

type Reply<A> = oneshot::Sender<Result<A, StoreError>>;

/// A queued request and where its answer goes.
struct Pending<J: Job> {
    job: J,
    reply: Reply<J::Answer>,
}

/// What the batch assembly needs to know about a queued request.
pub(crate) trait Queued {
    fn scope(&self) -> &ScopeHash;
    /// Its share of `BatchLimits::max_bytes`.
    fn bytes(&self) -> usize;
}

impl<J: Job> Queued for Pending<J> {
    fn scope(&self) -> &ScopeHash {
        self.job.scope()
    }
    fn bytes(&self) -> usize {
        self.job.bytes()
    }
}

/// One kind of request the batcher groups.
trait Job: Send + Sized + 'static {
    type Answer: Send + 'static;
    const OP: BatchOp;
    fn scope(&self) -> &ScopeHash;
    fn bytes(&self) -> usize;
    /// The single-row path, exactly as without batching.
    fn run_one(
        self,
        store: Store,
    ) -> impl Future<Output = Result<Self::Answer, StoreError>> + Send + 'static;
    /// What the single path does for a request the batch statement did not settle.
    fn after_batch(
        self,
        store: Store,
    ) -> impl Future<Output = Result<Self::Answer, StoreError>> + Send + 'static;
    /// One statement for `batch` (two or more distinct scopes). Answers every request but the
    /// ones it returns, which go on to `after_batch`.
    fn run_batch(
        batch: Vec<Pending<Self>>,
        store: &Store,
    ) -> impl Future<Output = Vec<Pending<Self>>> + Send;
}

impl Job for ClaimJob {
    type Answer = ClaimOutcome;
    const OP: BatchOp = BatchOp::Claim;

    fn scope(&self) -> &ScopeHash {
        &self.scope
    }
    fn bytes(&self) -> usize {
        0
    }
    async fn run_one(self, store: Store) -> Result<ClaimOutcome, StoreError> {
        store.claim(&self.as_new()).await
    }
    /// Lost a race with a concurrent inserter, or a lease or retention ran out: the whole claim
    /// again, which reads, reclaims or takes over as it always does.
    async fn after_batch(self, store: Store) -> Result<ClaimOutcome, StoreError> {
        self.run_one(store).await
    }
    async fn run_batch(mut batch: Vec<Pending<Self>>, store: &Store) -> Vec<Pending<Self>> {
        batch.sort_unstable_by_key(|p| p.job.scope);
        let claims: Vec<NewClaim<'_>> = batch.iter().map(|p| p.job.as_new()).collect();
        let result = store.claim_many(&claims).await;
        drop(claims);
        let answers = match result {
            Ok(answers) => answers,
            Err(e) => {
                fail_all(batch, e);
                return Vec::new();
            }
        };
        let mut rest = Vec::new();
        for (p, answer) in batch.into_iter().zip(answers) {
            match answer {
                BatchedClaim::Answered(outcome) => {
                    let _ = p.reply.send(Ok(outcome));
                }
                BatchedClaim::Failed(e) => {
                    let _ = p.reply.send(Err(e));
                }
                BatchedClaim::SinglePath => rest.push(p),
            }
        }
        rest
    }
}

impl Job for CompleteJob {
    type Answer = WriteResult;
    const OP: BatchOp = BatchOp::Complete;

    fn scope(&self) -> &ScopeHash {
        &self.scope
    }
    fn bytes(&self) -> usize {
        response_bytes(&self.response)
    }
    async fn run_one(self, store: Store) -> Result<WriteResult, StoreError> {
        store
            .complete(&self.scope, self.token, &self.response, self.retention_ms)
            .await
    }
    /// Not this token's in-progress record: the single path's second step tells a retried
    /// complete of the same owner from a fenced-out one.
    async fn after_batch(self, store: Store) -> Result<WriteResult, StoreError> {
        store.complete_unmatched(&self.scope, self.token).await
    }
    async fn run_batch(mut batch: Vec<Pending<Self>>, store: &Store) -> Vec<Pending<Self>> {
        batch.sort_unstable_by_key(|p| p.job.scope);
        let items: Vec<CompleteItem<'_>> = batch
            .iter()
            .map(|p| CompleteItem {
                scope: &p.job.scope,
                token: p.job.token,
                response: &p.job.response,
                retention_ms: p.job.retention_ms,
            })
            .collect();
        let result = store.complete_many(&items).await;
        drop(items);
        let done = match result {
            Ok(done) => done,
            Err(e) => {
                fail_all(batch, e);
                return Vec::new();
            }
        };
        let mut rest = Vec::new();
        for (p, done) in batch.into_iter().zip(done) {
            match done {
                Some(expires_in_ms) => {
                    let _ = p.reply.send(Ok(WriteResult::Done { expires_in_ms }));
                }
                None => rest.push(p),
            }
        }
        rest
    }
}

/// Gives the error of a batch statement to every request of the batch.
fn fail_all<J: Job>(batch: Vec<Pending<J>>, e: StoreError) {
    let e = Arc::new(e);
    for p in batch {
        let _ = p.reply.send(Err(StoreError::Batch(e.clone())));
    }
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

struct LaneState<J: Job> {
    queue: VecDeque<Pending<J>>,
    /// Scopes in batches taken and not finished yet.
    busy: HashSet<ScopeHash>,
    /// Runner slots in use: runners, and requests running their single path inline.
    running: usize,
    closed: bool,
}

struct Lane<J: Job> {
    store: Store,
    metrics: Arc<Metrics>,
    limits: BatchLimits,
    state: Mutex<LaneState<J>>,
    /// Signalled when `running` drops to zero.
    idle: Notify,
}

/// What a request does, decided under the lane's lock.
enum Route<J: Job> {
    /// Run the single path on the request's own task (with or without a runner slot).
    Inline(J, Option<Slot<J>>),
    /// Wait for a runner's answer (after spawning a runner, if `true`).
    Queued(oneshot::Receiver<Result<J::Answer, StoreError>>, bool),
}

impl<J: Job> Lane<J> {
    fn new(store: Store, metrics: Arc<Metrics>, limits: BatchLimits) -> Self {
        Self {
            store,
            metrics,
            limits,
            state: Mutex::new(LaneState {
                queue: VecDeque::new(),
                busy: HashSet::new(),
                running: 0,
                closed: false,
            }),
            idle: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LaneState<J>> {
        // Nothing panics while holding the lock; the state stays consistent either way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn submit(self: &Arc<Self>, job: J) -> Result<J::Answer, StoreError> {
        if job.bytes() > self.limits.max_bytes {
            self.metrics
                .batch_single_path(J::OP, SinglePathReason::Oversize);
            return job.run_one(self.store.clone()).await;
        }
        let route = {
            let mut st = self.lock();
            if st.closed {
                Route::Inline(job, None)
            } else if st.running < self.limits.in_flight && st.queue.is_empty() {
                // Nothing to group with: a batch of one, on this task, without a hop.
                st.running += 1;
                Route::Inline(job, Some(Slot::new(self.clone())))
            } else {
                let (reply, answer) = oneshot::channel();
                st.queue.push_back(Pending { job, reply });
                let spawn = st.running < self.limits.in_flight;
                if spawn {
                    st.running += 1;
                }
                Route::Queued(answer, spawn)
            }
        };
        match route {
            Route::Inline(job, slot) => {
                if slot.is_some() {
                    self.metrics.batch_size(J::OP, 1);
                }
                let answer = job.run_one(self.store.clone()).await;
                // Hands the slot on to a runner if requests queued up meanwhile.
                drop(slot);
                answer
            }
            Route::Queued(answer, spawn) => {
                if spawn {
                    tokio::spawn(run(self.clone()));
                }
                answer.await.unwrap_or(Err(StoreError::Unanswered))
            }
        }
    }

    /// Runs `p` on the single path on its own task (`after_batch`: the rest of it, after a
    /// batch statement that did not settle it).
    fn single(&self, p: Pending<J>, after_batch: bool) {
        let store = self.store.clone();
        tokio::spawn(async move {
            let answer = if after_batch {
                p.job.after_batch(store).await
            } else {
                p.job.run_one(store).await
            };
            let _ = p.reply.send(answer);
        });
    }

    /// Stops grouping (later requests run inline) and waits until the queue is drained and
    /// every runner has stopped.
    async fn close(&self) {
        loop {
            let mut idle = pin!(self.idle.notified());
            idle.as_mut().enable();
            {
                let mut st = self.lock();
                st.closed = true;
                if st.running == 0 {
                    return;
                }
            }
            idle.await;
        }
    }
}

/// A runner slot. Dropped (also on unwinding), it is handed on to a new runner when requests
/// are queued, or freed.
struct Slot<J: Job> {
    lane: Arc<Lane<J>>,
    /// Freed already (`release`).
    freed: bool,
}

impl<J: Job> Slot<J> {
    fn new(lane: Arc<Lane<J>>) -> Self {
        Self { lane, freed: false }
    }

    /// Frees the slot even though requests may be queued (a runner that found nothing it may
    /// take: the runner of the batch they wait for takes them).
    fn release(mut self) {
        let mut st = self.lane.lock();
        free_slot(&self.lane, &mut st);
        self.freed = true;
    }
}

fn free_slot<J: Job>(lane: &Lane<J>, st: &mut LaneState<J>) {
    st.running = st.running.saturating_sub(1);
    if st.running == 0 {
        lane.idle.notify_waiters();
    }
}

impl<J: Job> Drop for Slot<J> {
    fn drop(&mut self) {
        if self.freed {
            return;
        }
        let hand_on = {
            let mut st = self.lane.lock();
            if st.queue.is_empty() {
                free_slot(&self.lane, &mut st);
                false
            } else {
                true
            }
        };
        if hand_on {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(run(self.lane.clone()));
                }
                // No runtime left to run it: the queued requests' senders are dropped with
                // the lane, so each of them is answered `Unanswered`.
                Err(_) => {
                    let mut st = self.lane.lock();
                    st.queue.clear();
                    free_slot(&self.lane, &mut st);
                }
            }
        }
    }
}

/// The scopes of a running batch: taken out of `busy` when the batch is done (also on
/// unwinding, so that requests queued behind them are never stranded).
struct Busy<'a, J: Job> {
    lane: &'a Lane<J>,
    scopes: Vec<ScopeHash>,
}

impl<J: Job> Drop for Busy<'_, J> {
    fn drop(&mut self) {
        let mut st = self.lane.lock();
        for s in &self.scopes {
            st.busy.remove(s);
        }
    }
}

/// A runner: takes batches off the queue until nothing is left that it may take.
async fn run<J: Job>(lane: Arc<Lane<J>>) {
    let slot = Slot::new(lane.clone());
    loop {
        let Taken { batch, followers } = {
            let mut st = lane.lock();
            let LaneState { queue, busy, .. } = &mut *st;
            take_batch(queue, busy, lane.limits.max_items, lane.limits.max_bytes)
        };
        if batch.is_empty() {
            // Empty, or only requests for scopes of a running batch, whose runner takes them
            // when it is done.
            slot.release();
            return;
        }
        let busy = Busy {
            lane: &lane,
            scopes: batch.iter().map(|p| *p.job.scope()).collect(),
        };
        lane.metrics.batch_size(J::OP, batch.len());
        if batch.len() == 1 {
            for p in batch {
                let _ = p.reply.send(p.job.run_one(lane.store.clone()).await);
            }
        } else {
            for p in J::run_batch(batch, &lane.store).await {
                lane.metrics
                    .batch_single_path(J::OP, SinglePathReason::AfterBatch);
                lane.single(p, true);
            }
        }
        for p in followers {
            lane.metrics
                .batch_single_path(J::OP, SinglePathReason::Duplicate);
            lane.single(p, false);
        }
        drop(busy);
    }
}

struct Lanes {
    claims: Arc<Lane<ClaimJob>>,
    completes: Arc<Lane<CompleteJob>>,
}

/// The group commit of claims and completes (see the module documentation).
pub struct Batcher {
    store: Store,
    /// None: batching is off.
    lanes: Option<Lanes>,
}

impl Batcher {
    /// Spawns nothing: runners start when requests queue up.
    pub fn new(store: Store, metrics: Arc<Metrics>, limits: BatchLimits) -> Self {
        let lanes = (limits.max_items > 1).then(|| {
            let limits = BatchLimits {
                in_flight: limits.in_flight.max(1),
                ..limits
            };
            Lanes {
                claims: Arc::new(Lane::new(store.clone(), metrics.clone(), limits)),
                completes: Arc::new(Lane::new(store.clone(), metrics.clone(), limits)),
            }
        });
        Self { store, lanes }
    }

    pub fn enabled(&self) -> bool {
        self.lanes.is_some()
    }

    /// Requests waiting in the queues for a batch (claims and completes).
    pub fn queued(&self) -> usize {
        self.lanes.as_ref().map_or(0, |l| {
            l.claims.lock().queue.len() + l.completes.lock().queue.len()
        })
    }

    /// `Store::claim`, grouped with concurrent claims.
    pub async fn claim(&self, job: ClaimJob) -> Result<ClaimOutcome, StoreError> {
        match &self.lanes {
            Some(l) => l.claims.submit(job).await,
            None => self.store.claim(&job.as_new()).await,
        }
    }

    /// `Store::complete`, grouped with concurrent completes.
    pub async fn complete(&self, job: CompleteJob) -> Result<WriteResult, StoreError> {
        match &self.lanes {
            Some(l) => l.completes.submit(job).await,
            None => {
                self.store
                    .complete(&job.scope, job.token, &job.response, job.retention_ms)
                    .await
            }
        }
    }

    /// Drains: every queued request is answered, then the runners stop. Requests after this
    /// run on the single path.
    pub async fn close(&self) {
        if let Some(l) = &self.lanes {
            l.claims.close().await;
            l.completes.close().await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Eq)]
    struct Item {
        id: u32,
        scope: ScopeHash,
        bytes: usize,
    }

    impl Queued for Item {
        fn scope(&self) -> &ScopeHash {
            &self.scope
        }
        fn bytes(&self) -> usize {
            self.bytes
        }
    }

    fn item(id: u32, scope: u8, bytes: usize) -> Item {
        Item {
            id,
            scope: [scope; 32],
            bytes,
        }
    }

    fn ids(v: &[Item]) -> Vec<u32> {
        v.iter().map(|i| i.id).collect()
    }

    #[test]
    fn a_repeated_scope_follows_its_batch_and_a_busy_scope_waits() {
        let mut q: VecDeque<Item> = [
            item(1, 1, 0),
            item(2, 2, 0),
            item(3, 1, 0), // repeats 1
            item(4, 3, 0),
            item(5, 9, 0), // in a running batch
            item(6, 2, 0), // repeats 2
            item(7, 9, 0), // in a running batch
            item(8, 4, 0),
        ]
        .into();
        let mut busy = HashSet::from([[9; 32]]);
        let t = take_batch(&mut q, &mut busy, 64, usize::MAX);
        assert_eq!(ids(&t.batch), [1, 2, 4, 8]);
        assert_eq!(ids(&t.followers), [3, 6]);
        assert_eq!(q.iter().map(|i| i.id).collect::<Vec<_>>(), [5, 7]);
        assert_eq!(
            busy,
            HashSet::from([[1; 32], [2; 32], [3; 32], [4; 32], [9; 32]])
        );
        // Nothing to take while 9 runs; once it is done, 5 goes and 7 follows it.
        let t = take_batch(&mut q, &mut busy, 64, usize::MAX);
        assert!(t.batch.is_empty() && t.followers.is_empty());
        assert_eq!(q.len(), 2);
        busy.clear();
        let t = take_batch(&mut q, &mut busy, 64, usize::MAX);
        assert_eq!((ids(&t.batch), ids(&t.followers)), (vec![5], vec![7]));
        assert!(q.is_empty());
    }

    #[test]
    fn the_item_cap_leaves_the_rest_queued_in_order_but_takes_followers() {
        let mut q: VecDeque<Item> = (0..10).map(|i| item(i, i as u8, 0)).collect();
        q.push_back(item(10, 0, 0)); // repeats 0, behind the cap
        let mut busy = HashSet::new();
        let t = take_batch(&mut q, &mut busy, 4, usize::MAX);
        assert_eq!(ids(&t.batch), [0, 1, 2, 3]);
        assert_eq!(ids(&t.followers), [10]);
        assert_eq!(
            q.iter().map(|i| i.id).collect::<Vec<_>>(),
            [4, 5, 6, 7, 8, 9]
        );
    }

    #[test]
    fn the_byte_cap_stops_the_batch_but_one_item_always_goes() {
        let mut q: VecDeque<Item> = [
            item(1, 1, 400),
            item(2, 2, 500),
            item(3, 3, 200), // would make 1100 > 1000
            item(4, 4, 10),  // would fit, but does not overtake 3
        ]
        .into();
        let mut busy = HashSet::new();
        let t = take_batch(&mut q, &mut busy, 64, 1000);
        assert_eq!(ids(&t.batch), [1, 2]);
        assert_eq!(q.iter().map(|i| i.id).collect::<Vec<_>>(), [3, 4]);
        // The next batch starts with what did not fit.
        let t = take_batch(&mut q, &mut busy, 64, 1000);
        assert_eq!(ids(&t.batch), [3, 4]);
        // An item over the cap on its own still makes a batch of one.
        let mut q: VecDeque<Item> = [item(5, 5, 5000), item(6, 6, 1)].into();
        let t = take_batch(&mut q, &mut busy, 64, 1000);
        assert_eq!(ids(&t.batch), [5]);
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn an_empty_queue_gives_an_empty_batch() {
        let mut q: VecDeque<Item> = VecDeque::new();
        let t = take_batch(&mut q, &mut HashSet::new(), 64, 1000);
        assert!(t.batch.is_empty() && t.followers.is_empty());
    }

    #[test]
    fn response_bytes_count_body_and_headers() {
        let r = StoredRow {
            status: 200,
            headers: vec![("ab".into(), "cde".into())],
            body: vec![0; 10],
            replayable: true,
        };
        assert_eq!(response_bytes(&r), 15);
    }
}
