//! Group commit: concurrent claims and completes share one statement and one durable commit.
//!
//! While the database keeps up, a request runs the single-row statements itself, at once,
//! exactly as without batching (up to `in_flight` such statements at a time). Once
//! `in_flight` statements are running, requests queue with a oneshot for their answer, and one
//! runner takes everything queued at that moment (up to `max_items`, and up to `max_bytes` of
//! stored responses), claims and completes alike, runs it as one statement over arrays
//! (`Store::write_many`), answers each request and takes the next batch, until the queue is
//! empty. There is no timer: while one batch runs, the next one queues up. Requests that came
//! in one call (`/v1/claims`, `/v1/completes`) skip the inline path and queue together, so
//! that one statement takes them (`Batcher::claims`, `Batcher::completes`). There is one runner
//! at a time: on two cores, one batch at a time was faster than two half as large (each
//! statement costs about as much as seven more rows in it).
//!
//! What this keeps from the single path:
//! - a claim is answered only after the statement that INSERTed it has committed
//!   (`synchronous_commit=on`, one autocommit statement per batch);
//! - a batch of one runs the single-row statements (`Store::claim`, `Store::complete`);
//! - any request the batch statement does not settle (a claim that lost a race with a
//!   concurrent inserter, a lease or retention that ran out, a complete whose UPDATE matched
//!   nothing) goes on to the single path, which decides as it always did;
//! - one scope hash is never twice in a batch: a later request for a scope of the batch being
//!   taken runs on the single path once that batch has committed (so it never overtakes the
//!   earlier one); the single-row statements hold at most one row lock, so they cannot deadlock
//!   with a batch;
//! - an error of a batch statement is every request's error (503 when unavailable), and every
//!   request gets exactly one answer: a runner drains the queue before it stops, and a request
//!   whose batch vanished without answering gets `StoreError::Unanswered` (503).
//!
//! Bounded work: the queue holds at most `max_queued` requests and `max_queued_bytes` of stored
//! responses (counting the oversize completes running alone); more are answered 503 at once.
//! Every job has its caller's deadline: it runs on a task of its own (a caller that goes away
//! does not cut a statement in the middle), the caller is answered 503 at the deadline, a job
//! still queued then is dropped before it reaches Postgres, and a claim whose answer arrives
//! after its caller left (a slow or paused Postgres) is released at once: its caller was
//! answered 503 and nothing was forwarded with it, so it must not own the key for a lease.

use std::collections::{HashSet, VecDeque};
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use contract::wire::ClaimResponse;

use crate::metrics::{Metrics, Shed, SinglePathReason};
use crate::scope::ScopeHash;
use crate::store::{Store, StoreError, WriteResult};

mod jobs;
mod pending;

pub use jobs::{BatchLimits, ClaimJob, CompleteJob};
use pending::{run_batch, Pending, Reply};
pub(crate) use pending::{take_batch, Queued, Taken};

struct LaneState {
    queue: VecDeque<Pending>,
    /// Bytes of stored responses in `queue`.
    queued_bytes: usize,
    /// Bytes of the oversize completes running alone.
    alone_bytes: usize,
    /// Scopes of the batch being run.
    busy: HashSet<ScopeHash>,
    /// Statements running: the runner's, and requests running their single path inline.
    running: usize,
    /// A runner is taking batches off the queue (there is at most one).
    runner: bool,
    closed: bool,
}

struct Lane {
    store: Store,
    metrics: Arc<Metrics>,
    limits: BatchLimits,
    state: Mutex<LaneState>,
    /// Signalled when `running` drops to zero.
    idle: Notify,
}

/// What a request does, decided under the lane's lock.
enum Route {
    /// Run the single path on the request's own task (with or without a runner slot).
    Inline(Pending, Option<Slot>),
    /// Wait for a runner's answer (after spawning a runner, if `true`).
    Queued(bool),
    /// The queue is at its bound: 503 at once.
    Full(Pending),
}

impl Lane {
    fn new(store: Store, metrics: Arc<Metrics>, limits: BatchLimits) -> Self {
        Self {
            store,
            metrics,
            limits,
            state: Mutex::new(LaneState {
                queue: VecDeque::new(),
                queued_bytes: 0,
                alone_bytes: 0,
                busy: HashSet::new(),
                running: 0,
                runner: false,
                closed: false,
            }),
            idle: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LaneState> {
        // Nothing panics while holding the lock; the state stays consistent either way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Answers `p`, inline or through a batch, or at once with 503 when the queue is full.
    async fn submit(self: &Arc<Self>, p: Pending) {
        let bytes = p.bytes();
        if bytes > self.limits.max_bytes {
            {
                let mut st = self.lock();
                if st
                    .alone_bytes
                    .saturating_add(st.queued_bytes)
                    .saturating_add(bytes)
                    > self.limits.max_queued_bytes
                {
                    drop(st);
                    self.metrics.shed(Shed::QueueFull);
                    return p.answer_err(StoreError::Overloaded);
                }
                st.alone_bytes += bytes;
            }
            self.metrics
                .batch_single_path(p.op(), SinglePathReason::Oversize);
            p.run_one(&self.store, &self.metrics).await;
            let mut st = self.lock();
            st.alone_bytes = st.alone_bytes.saturating_sub(bytes);
            return;
        }
        let route = {
            let mut st = self.lock();
            if st.closed {
                Route::Inline(p, None)
            } else if !st.runner && st.queue.is_empty() && st.running < self.limits.in_flight {
                // Nothing to group with: a batch of one, on this task, without a hop.
                st.running += 1;
                Route::Inline(p, Some(Slot::new(self.clone(), false)))
            } else if self.queue_is_full(&st, bytes) {
                Route::Full(p)
            } else {
                // Queued behind the running statements; a runner takes it with the others.
                st.queue.push_back(p);
                st.queued_bytes += bytes;
                let spawn = !st.runner && st.running < self.limits.in_flight;
                if spawn {
                    st.running += 1;
                    st.runner = true;
                }
                Route::Queued(spawn)
            }
        };
        match route {
            Route::Full(p) => {
                self.metrics.shed(Shed::QueueFull);
                p.answer_err(StoreError::Overloaded);
            }
            Route::Inline(p, slot) => {
                if slot.is_some() {
                    self.metrics.batch_size(1);
                }
                p.run_one(&self.store, &self.metrics).await;
                // Hands the slot on to a runner if requests queued up meanwhile.
                drop(slot);
            }
            Route::Queued(true) => {
                tokio::spawn(run(self.clone()));
            }
            Route::Queued(false) => {}
        }
    }

    /// The queue cannot take a request of `bytes` more.
    fn queue_is_full(&self, st: &LaneState, bytes: usize) -> bool {
        st.queue.len() >= self.limits.max_queued
            || st
                .queued_bytes
                .saturating_add(st.alone_bytes)
                .saturating_add(bytes)
                > self.limits.max_queued_bytes
    }

    /// Queues requests that arrived in one call (`/v1/claims`, `/v1/completes`) under one lock,
    /// so that a runner takes them into one statement: each running its single path inline, as
    /// `submit` lets a lone request do, would make one statement and one commit of each. Returns
    /// the ones for `submit` (the lane is closed, or a response too large for a batch).
    fn queue_together(self: &Arc<Self>, group: Vec<Pending>) -> Vec<Pending> {
        let mut for_submit = Vec::new();
        let mut refused = Vec::new();
        let spawn = {
            let mut st = self.lock();
            for p in group {
                let bytes = p.bytes();
                if st.closed || bytes > self.limits.max_bytes {
                    for_submit.push(p);
                } else if self.queue_is_full(&st, bytes) {
                    refused.push(p);
                } else {
                    st.queue.push_back(p);
                    st.queued_bytes += bytes;
                }
            }
            // Else a running statement's slot is handed on to a runner when it is done.
            let spawn = !st.runner && !st.queue.is_empty() && st.running < self.limits.in_flight;
            if spawn {
                st.running += 1;
                st.runner = true;
            }
            spawn
        };
        for p in refused {
            self.metrics.shed(Shed::QueueFull);
            p.answer_err(StoreError::Overloaded);
        }
        if spawn {
            tokio::spawn(run(self.clone()));
        }
        for_submit
    }

    /// Runs `p` on the single path on its own task (`after_batch`: the rest of it, after a
    /// batch statement that did not settle it).
    fn single(&self, p: Pending, after_batch: bool) {
        let store = self.store.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            if after_batch {
                p.after_batch(&store, &metrics).await;
            } else {
                p.run_one(&store, &metrics).await;
            }
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

/// A statement slot, of the runner or of a request running inline. Dropped (also on
/// unwinding), it is handed on to a new runner when requests are queued and none runs, or
/// freed.
struct Slot {
    lane: Arc<Lane>,
    /// The runner's slot.
    runner: bool,
    /// Freed already (`release`).
    freed: bool,
}

impl Slot {
    fn new(lane: Arc<Lane>, runner: bool) -> Self {
        Self {
            lane,
            runner,
            freed: false,
        }
    }

    /// The runner stops: frees its slot (under the lock in which it found the queue empty).
    fn release(mut self, st: &mut LaneState) {
        st.runner = false;
        free_slot(&self.lane, st);
        self.freed = true;
    }
}

fn free_slot(lane: &Lane, st: &mut LaneState) {
    st.running = st.running.saturating_sub(1);
    if st.running == 0 {
        lane.idle.notify_waiters();
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.freed {
            return;
        }
        let hand_on = {
            let mut st = self.lane.lock();
            if self.runner {
                st.runner = false;
            }
            if !st.queue.is_empty() && !st.runner {
                st.runner = true;
                true
            } else {
                free_slot(&self.lane, &mut st);
                false
            }
        };
        if hand_on {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(run(self.lane.clone()));
                }
                // No runtime left to run it: the queued requests' senders are dropped, so
                // each of them is answered `Unanswered`.
                Err(_) => {
                    let mut st = self.lane.lock();
                    st.queue.clear();
                    st.runner = false;
                    free_slot(&self.lane, &mut st);
                }
            }
        }
    }
}

/// The scopes of a running batch: taken out of `busy` when the batch is done (also on
/// unwinding, so that requests queued behind them are never stranded).
struct Busy<'a> {
    lane: &'a Lane,
    scopes: Vec<ScopeHash>,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut st = self.lane.lock();
        for s in &self.scopes {
            st.busy.remove(s);
        }
    }
}

/// The runner: takes batches off the queue until it is empty.
async fn run(lane: Arc<Lane>) {
    let slot = Slot::new(lane.clone(), true);
    loop {
        let Taken { batch, followers } = {
            let mut st = lane.lock();
            // Jobs whose caller gave up never reach Postgres (dropped: nobody waits for their
            // answer; the caller was answered, and counted, at its deadline).
            let now = Instant::now();
            st.queue.retain(|p| !p.caller_gone(now));
            let LaneState { queue, busy, .. } = &mut *st;
            let taken = take_batch(queue, busy, lane.limits.max_items, lane.limits.max_bytes);
            st.queued_bytes = st.queue.iter().map(Queued::bytes).sum();
            if taken.batch.is_empty() {
                // The only runner, so nothing is busy: the queue is empty.
                slot.release(&mut st);
                return;
            }
            taken
        };
        let busy = Busy {
            lane: &lane,
            scopes: batch.iter().map(|p| *p.scope()).collect(),
        };
        lane.metrics.batch_size(batch.len());
        if batch.len() == 1 {
            for p in batch {
                p.run_one(&lane.store, &lane.metrics).await;
            }
        } else {
            for p in run_batch(batch, &lane.store, &lane.metrics).await {
                lane.metrics
                    .batch_single_path(p.op(), SinglePathReason::AfterBatch);
                lane.single(p, true);
            }
        }
        for p in followers {
            lane.metrics
                .batch_single_path(p.op(), SinglePathReason::Duplicate);
            lane.single(p, false);
        }
        drop(busy);
    }
}

/// Where a request queued together with others gets its answer: `None` when its caller was
/// gone before it was queued.
type Wait<A> = Option<(Instant, oneshot::Receiver<Result<A, StoreError>>)>;

/// The requests of `jobs` whose callers are still there, added to `submitted`, and how each
/// job gets its answer, in order.
fn waits_for<J, A>(
    jobs: Vec<J>,
    pending: fn(J, Reply<A>) -> Pending,
    now: Instant,
    submitted: &mut Vec<Pending>,
) -> Vec<Wait<A>> {
    jobs.into_iter()
        .map(|job| {
            let (reply, answer) = oneshot::channel();
            let p = pending(job, reply);
            if p.caller_gone(now) {
                return None;
            }
            let deadline = p.deadline();
            submitted.push(p);
            Some((deadline, answer))
        })
        .collect()
}

/// The group commit of claims and completes (see the module documentation).
pub struct Batcher {
    store: Store,
    metrics: Arc<Metrics>,
    /// None: batching is off.
    lane: Option<Arc<Lane>>,
}

impl Batcher {
    /// Spawns nothing: runners start when requests queue up.
    pub fn new(store: Store, metrics: Arc<Metrics>, limits: BatchLimits) -> Self {
        let lane = (limits.max_items > 1).then(|| {
            let limits = BatchLimits {
                in_flight: limits.in_flight.max(1),
                ..limits
            };
            Arc::new(Lane::new(store.clone(), metrics.clone(), limits))
        });
        Self {
            store,
            metrics,
            lane,
        }
    }

    /// Requests waiting in the queue for a batch.
    pub fn queued(&self) -> usize {
        self.lane.as_ref().map_or(0, |l| l.lock().queue.len())
    }

    /// `Store::claim`, grouped with concurrent claims and completes, within its deadline.
    pub async fn claim(&self, job: ClaimJob) -> Result<ClaimResponse, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.answer(Pending::Claim(job, reply), answer).await
    }

    /// `Store::complete`, grouped with concurrent claims and completes, within its deadline.
    pub async fn complete(&self, job: CompleteJob) -> Result<WriteResult, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.answer(Pending::Complete(job, reply), answer).await
    }

    /// Claims that came in one call: in one statement where the batch limits allow, each
    /// answered as `claim` answers it.
    pub async fn claims(&self, jobs: Vec<ClaimJob>) -> Vec<Result<ClaimResponse, StoreError>> {
        self.answer_together(jobs, Pending::Claim).await
    }

    /// Completes that came in one call, as `claims` runs claims.
    pub async fn completes(&self, jobs: Vec<CompleteJob>) -> Vec<Result<WriteResult, StoreError>> {
        self.answer_together(jobs, Pending::Complete).await
    }

    /// Runs `p` on a task of its own (so that a caller who leaves does not cut its statement
    /// halfway) and waits for its answer until its deadline.
    async fn answer<A>(
        &self,
        p: Pending,
        answer: oneshot::Receiver<Result<A, StoreError>>,
    ) -> Result<A, StoreError> {
        let deadline = p.deadline();
        if p.caller_gone(Instant::now()) {
            self.metrics.shed(Shed::Deadline);
            return Err(StoreError::CallerGone);
        }
        self.dispatch(p);
        self.wait(deadline, answer).await
    }

    /// Claims and completes that came in one call (`/v1/writes`): queued together, as
    /// `claims` queues claims, each answered as `claim` or `complete` answers it.
    pub async fn writes(
        &self,
        claims: Vec<ClaimJob>,
        completes: Vec<CompleteJob>,
    ) -> (
        Vec<Result<ClaimResponse, StoreError>>,
        Vec<Result<WriteResult, StoreError>>,
    ) {
        let now = Instant::now();
        let mut submitted = Vec::with_capacity(claims.len() + completes.len());
        let claims = waits_for(claims, Pending::Claim, now, &mut submitted);
        let completes = waits_for(completes, Pending::Complete, now, &mut submitted);
        self.submit_together(submitted);
        futures::join!(self.wait_all(claims), self.wait_all(completes))
    }

    /// `answer` for requests that came together: queued as one group, so that one statement
    /// takes them; answers in their order.
    async fn answer_together<J, A>(
        &self,
        jobs: Vec<J>,
        pending: fn(J, Reply<A>) -> Pending,
    ) -> Vec<Result<A, StoreError>> {
        let mut submitted = Vec::with_capacity(jobs.len());
        let waits = waits_for(jobs, pending, Instant::now(), &mut submitted);
        self.submit_together(submitted);
        self.wait_all(waits).await
    }

    /// Queues requests that came together as one group (one alone goes as `answer` sends it).
    fn submit_together(&self, submitted: Vec<Pending>) {
        let alone = match &self.lane {
            Some(lane) if submitted.len() > 1 => lane.queue_together(submitted),
            _ => submitted,
        };
        for p in alone {
            self.dispatch(p);
        }
    }

    /// The answers to requests queued by `submit_together`, in order.
    async fn wait_all<A>(&self, waits: Vec<Wait<A>>) -> Vec<Result<A, StoreError>> {
        futures::future::join_all(waits.into_iter().map(|w| async move {
            match w {
                Some((deadline, answer)) => self.wait(deadline, answer).await,
                None => {
                    self.metrics.shed(Shed::Deadline);
                    Err(StoreError::CallerGone)
                }
            }
        }))
        .await
    }

    /// Hands `p` to the lane (or runs it alone when batching is off), on a task of its own.
    fn dispatch(&self, p: Pending) {
        match &self.lane {
            Some(lane) => {
                let lane = lane.clone();
                tokio::spawn(async move { lane.submit(p).await });
            }
            None => {
                let (store, metrics) = (self.store.clone(), self.metrics.clone());
                tokio::spawn(async move { p.run_one(&store, &metrics).await });
            }
        }
    }

    /// The answer to a dispatched request, or 503 (`CallerGone`) at its deadline.
    async fn wait<A>(
        &self,
        deadline: Instant,
        answer: oneshot::Receiver<Result<A, StoreError>>,
    ) -> Result<A, StoreError> {
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(answered) => answered.unwrap_or(Err(StoreError::Unanswered)),
            Err(_) => {
                self.metrics.shed(Shed::Deadline);
                Err(StoreError::CallerGone)
            }
        }
    }

    /// Drains: every queued request is answered, then the runners stop. Requests after this
    /// run on the single path.
    pub async fn close(&self) {
        if let Some(lane) = &self.lane {
            lane.close().await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::jobs::response_bytes;
    use super::*;
    use contract::wire::StoredResponse;

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
        let r = StoredResponse {
            status: 200,
            headers: vec![("ab".into(), "cde".into())],
            body: vec![0; 10],
            replayable: true,
        };
        assert_eq!(response_bytes(&r), 15);
    }
}
