//! One Envoy worker's state machine: the flows of its streams, the claims whose leases it
//! extends, the writes it sends after their streams let go, and its memory of completed and
//! running keys. Every host event of the worker comes in here (from the root context and the
//! HTTP contexts alike) with the time, and goes out as [`Effect`]s for the glue to carry out;
//! nothing here calls the host. The deterministic simulation (`sim/`) drives this same type.
//!
//! Callouts have an [`Owner`]: Envoy delivers a callout's answer to the context that made it,
//! and cancels a stream's callouts when the stream ends. So a stream's claim and its held
//! complete are stream callouts, made while that stream is being handled; heartbeats and the
//! writes a stream handed over are the worker's, made only from the root context's events
//! ([`Worker::on_tick`], [`Worker::on_wake`], and the answers to the worker's own callouts).
//! When a stream hands over a write that should go at once, the worker asks to be woken
//! ([`Effect::Wake`]).
//!
//! Claims and held responses' completes are batched like the state API's group commit, with
//! no timer, in one lane: a claim (or complete) goes as its stream's own callout when no other
//! claim or held complete of this worker is on its way (no added wait at low load); otherwise
//! it queues, and when the one on its way is answered the worker is woken and sends every
//! queued claim and complete as one `/v1/writes` callout of its own (at most `batch_max` of
//! each; the tick sends what a lost wake left). A batch's answers reach their streams from the
//! root context. A stream that ended meanwhile may have been granted its claim: nothing was
//! forwarded, so the worker releases it. Claims that wait (`Prefer: wait`) are never batched.
//! Completes the worker took over (`complete_in_background`, retries) ride in the lane's
//! batches too: due ones go in the worker's next `/v1/writes`, and one handed over while the
//! lane is busy waits for that answer's wake instead of asking for its own. A batch of only
//! such completes is not in the lane (their responses have gone; no claim waits for them).
//!
//! Here: the worker's state and its host events. A stream's calls are routed in `calls.rs`,
//! the lane works in `lane.rs` (what it holds: `batch.rs`), heartbeats go in `heartbeat.rs`,
//! and the writes the worker took over are kept and retried in `handover.rs`.

mod batch;
mod buffered;
mod calls;
mod churn;
mod handover;
mod heartbeat;
pub mod ids;
pub mod in_flight;
mod lane;
pub mod registry;
pub mod replay_cache;
pub mod writes;

use crate::config::Config;
use crate::flow::{Flow, Note, Out, Remembered, RequestHead, ResponseHead, Room, Turn, Verdict};
use crate::reply::LocalReply;
use crate::route_table::RouteTable;
use in_flight::InFlightMemory;
use registry::Registry;
use replay_cache::{Completed, ReplayCache};
use std::collections::HashMap;
use writes::{PendingWrites, WriteAnswer};

pub use crate::effect::{CallId, CalloutResult, Dispatch, Effect, Level, Owner, Step, StreamId};
pub use batch::BATCH_WRITE_BYTES;
use batch::{Batch, BatchedClaim, BatchedWrite};
use buffered::Buffered;
pub use registry::HeldClaim;
pub use writes::PendingWrite;

/// What a callout was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Claim(StreamId),
    /// A complete or release the stream holds its response for.
    StreamWrite(StreamId),
    /// The stream asks the upstream what became of an unknown outcome.
    Reconcile(StreamId),
    /// The stream asks the state API about a key (the key state path).
    KeyState(StreamId),
    Heartbeat(i64),
    /// A handed-over write (by fencing token).
    Write(i64),
    /// The worker's `/v1/writes` (what it carries is in `Worker::batches`). One that carries
    /// only completes the worker took over is outside the lane: the next claim does not wait
    /// for a write whose response has gone already.
    Batch {
        lane: bool,
    },
}

impl Purpose {
    fn stream(self) -> Option<StreamId> {
        match self {
            Purpose::Claim(s)
            | Purpose::StreamWrite(s)
            | Purpose::Reconcile(s)
            | Purpose::KeyState(s) => Some(s),
            Purpose::Heartbeat(_) | Purpose::Write(_) | Purpose::Batch { .. } => None,
        }
    }

    /// In the batching lane: a stream's claim or held response's write (complete or
    /// release), or a batch.
    fn in_lane(self) -> bool {
        matches!(
            self,
            Purpose::Claim(_) | Purpose::StreamWrite(_) | Purpose::Batch { lane: true }
        )
    }
}

/// How much memory the worker holds, for the limits the configuration sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub streams: usize,
    pub callouts: usize,
    pub claims: usize,
    pub writes: usize,
    pub write_bytes: usize,
    pub replay_bytes: usize,
    pub running_keys: usize,
    /// Streams whose claim waits for a running key.
    pub waiters: usize,
    /// Request body bytes held before forwarding (`max_buffered_bytes`).
    pub held_request_bytes: u64,
    /// Claims queued for the next `/v1/writes`, and in the ones on their way.
    pub batched_claims: usize,
    /// Completes queued for the next `/v1/writes`, and in the ones on their way.
    pub batched_writes: usize,
    /// Local replies waiting for the next wake or tick ([`crate::host::REPLIES_PER_CALLBACK`]).
    pub deferred_replies: usize,
}

pub struct Worker {
    cfg: Config,
    flows: HashMap<StreamId, Flow>,
    calls: HashMap<CallId, Purpose>,
    next_call: u64,
    registry: Registry,
    writes: PendingWrites,
    replays: ReplayCache,
    in_flight: InFlightMemory,
    /// Requests claimed in the last minute, for key churn (issue 48).
    churn: churn::ChurnWatch,
    /// A wake was asked for and has not come yet: writes handed over meanwhile go with it.
    wake_pending: bool,
    /// Streams whose claim waits at the state API for a running key (`Prefer: wait`), at
    /// most `max_waiters`: answered at once when this worker sees the key complete.
    waiting: Vec<Waiter>,
    /// Claims that queued while another write was on its way, oldest first.
    claim_queue: Vec<BatchedClaim>,
    /// Held responses' completes that queued while another write was on its way, oldest
    /// first, then the completes the worker took over that are due (those are queued and sent
    /// in the same root event).
    complete_queue: Vec<BatchedWrite>,
    /// A complete was handed over untried while the lane had a write on its way: the answer
    /// to that write wakes the worker (which sends it), not a wake of its own, so completes
    /// handed over together go in one callout.
    handed_await_lane: bool,
    /// What each `/v1/writes` on its way carries, in the order sent. Few at a time, so a list.
    batches: Vec<(CallId, Batch)>,
    /// Claims and completes queue for batches (`batch_max` over 1, and the state API serves
    /// them: one older than `/v1/writes` answers 404, and batching stops).
    batching: bool,
    /// The worker's own callouts on their way (their answers come to the root context): few,
    /// so a list.
    worker_calls: Vec<CallId>,
    /// The answer to one of them is being handled: a stream it drives (a batch's claims, a
    /// reconcile a batched claim started) makes its callouts as the worker's.
    in_root: bool,
    /// This worker VM's name (set by the glue from its start time and context), the first part
    /// of every claim nonce it sends.
    instance: String,
    /// Claims sent (or queued) so far: the second part of the nonce.
    claims_sent: u64,
    /// Abandons handed over so far: each is kept under a negative token of its own, since the
    /// claim it gives back never learnt its token.
    abandons: i64,
    /// Replies past the bound of one callback, for the next wake or tick.
    deferred_replies: Vec<(StreamId, LocalReply)>,
    /// Request body bytes its streams hold before forwarding, in all and by subject.
    buffered: Buffered,
    /// `cfg`'s routes as a request's are looked up, built once (from `cfg`, so not printed).
    routes: RouteTable,
}

// Written out rather than derived: the streams and calls print in order, so the same state
// prints the same and the model checker (sim/src/model.rs) recognises it by this text. Hash
// maps stay in the module (ordered ones cost it about 10 KiB); unused there, this is stripped.
impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut flows: Vec<_> = self.flows.iter().collect();
        flows.sort_by_key(|(id, _)| **id);
        let mut calls: Vec<_> = self.calls.iter().collect();
        calls.sort_by_key(|(id, _)| **id);
        f.debug_struct("Worker")
            .field("cfg", &self.cfg)
            .field("flows", &flows)
            .field("calls", &calls)
            .field("next_call", &self.next_call)
            .field("registry", &self.registry)
            .field("writes", &self.writes)
            .field("replays", &self.replays)
            .field("in_flight", &self.in_flight)
            .field("wake_pending", &self.wake_pending)
            .field("waiting", &self.waiting)
            .field("claim_queue", &self.claim_queue)
            .field("complete_queue", &self.complete_queue)
            .field("handed_await_lane", &self.handed_await_lane)
            .field("batches", &self.batches)
            .field("batching", &self.batching)
            .field("worker_calls", &self.worker_calls)
            .field("in_root", &self.in_root)
            .field("instance", &self.instance)
            .field("claims_sent", &self.claims_sent)
            .field("abandons", &self.abandons)
            .field("deferred_replies", &self.deferred_replies)
            .finish()
    }
}

/// A stream whose claim waits for a running key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Waiter {
    stream: StreamId,
    id: ids::Id,
    /// Its claim callout (whose late answer is then dropped).
    call: CallId,
}

impl Worker {
    pub fn new(cfg: Config) -> Self {
        Self {
            writes: PendingWrites::new(cfg.complete_retry_bytes, cfg.complete_retry_ms),
            replays: ReplayCache::new(cfg.replay_cache_bytes, cfg.replay_cache_ttl_ms),
            in_flight: InFlightMemory::default(),
            churn: churn::ChurnWatch::default(),
            registry: Registry::default(),
            flows: HashMap::new(),
            calls: HashMap::new(),
            next_call: 0,
            wake_pending: false,
            waiting: Vec::new(),
            claim_queue: Vec::new(),
            batches: Vec::new(),
            complete_queue: Vec::new(),
            handed_await_lane: false,
            worker_calls: Vec::new(),
            batching: cfg.batch_max > 1,
            in_root: false,
            instance: "w".into(),
            claims_sent: 0,
            abandons: 0,
            deferred_replies: Vec::new(),
            buffered: Buffered::new(&cfg),
            routes: RouteTable::of(&cfg),
            cfg,
        }
    }

    /// Names this worker VM for its claim nonces: unique among the workers and restarts that
    /// may claim one key (the glue uses its start time and root context id), at most 40
    /// visible ASCII characters (longer is cut).
    pub fn set_instance(&mut self, instance: &str) {
        self.instance = instance
            .chars()
            .filter(|c| c.is_ascii_graphic())
            .take(40)
            .collect();
    }

    /// The nonce of the next claim this worker sends.
    fn next_nonce(&mut self) -> String {
        self.claims_sent += 1;
        format!("{}.{}", self.instance, self.claims_sent)
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// How often the root context ticks.
    pub fn tick_period_ms(&self) -> u64 {
        self.cfg.tick_period_ms()
    }

    pub fn usage(&self) -> Usage {
        Usage {
            streams: self.flows.len(),
            callouts: self.calls.len(),
            claims: self.registry.len(),
            writes: self.writes.len(),
            write_bytes: self.writes.bytes(),
            replay_bytes: self.replays.bytes(),
            running_keys: self.in_flight.len(),
            waiters: self.waiting.len(),
            held_request_bytes: self.buffered.total(),
            batched_claims: self.claim_queue.len()
                + self
                    .batches
                    .iter()
                    .map(|(_, b)| b.claims.len())
                    .sum::<usize>(),
            batched_writes: self.complete_queue.len()
                + self
                    .batches
                    .iter()
                    .map(|(_, b)| b.completes.len())
                    .sum::<usize>(),
            deferred_replies: self.deferred_replies.len(),
        }
    }

    /// The fencing tokens of the claims this worker heartbeats, and of its pending writes (for
    /// the simulation's invariants).
    pub fn held_tokens(&self) -> Vec<i64> {
        self.registry.tokens()
    }

    /// (token, since when on this worker's clock) of each pending write.
    pub fn write_tokens(&self) -> Vec<(i64, u64)> {
        self.writes.tokens()
    }

    /// The earliest time (this worker's clock) at which a tick has work: a heartbeat or a
    /// write that comes due, or queued claims, completes or deferred replies (now). Ticks
    /// before it only drop expired memory.
    pub fn next_due(&self) -> Option<u64> {
        let replies = !self.deferred_replies.is_empty()
            && !contract::undo::undone(contract::undo::Fix::TickDrain);
        if replies || !self.claim_queue.is_empty() || !self.complete_queue.is_empty() {
            // Queued claims and completes, and deferred replies, go at the next tick if no wake
            // sends them first.
            return Some(0);
        }
        let heartbeat = self.registry.next_due(self.cfg.tick_period_ms());
        match (heartbeat, self.writes.next_due()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The upstream response of `stream` is wanted (read `response.code_details` and `flags`).
    pub fn awaits_response(&self, stream: StreamId) -> bool {
        self.flows.get(&stream).is_some_and(Flow::awaits_response)
    }

    /// The state of a stream's flow, for logs and tests.
    pub fn flow_state(&self, stream: StreamId) -> Option<&'static str> {
        self.flows.get(&stream).map(Flow::state_name)
    }

    // -----------------------------------------------------------------------------------------
    // Stream events

    pub fn on_request_headers(
        &mut self,
        stream: StreamId,
        head: RequestHead<'_>,
        end_of_stream: bool,
        now_ms: u64,
    ) -> Step {
        let (flow, turn) = Flow::start(
            &self.cfg,
            &self.routes,
            stream,
            head,
            end_of_stream,
            now_ms,
            &self.buffered.room(),
        );
        self.buffered.put(&flow);
        self.flows.insert(stream, flow);
        self.run(stream, turn, now_ms)
    }

    pub fn on_request_body(
        &mut self,
        stream: StreamId,
        body_size: usize,
        end_of_stream: bool,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        now_ms: u64,
    ) -> Step {
        self.request_event(stream, now_ms, |flow, cfg, room| {
            flow.on_request_body(cfg, body_size, end_of_stream, read, now_ms, room)
        })
    }

    /// A request event of `stream` (body, trailers), with the worker's count of held request
    /// bytes kept in step with what the flow holds after it. `room` does not count the
    /// stream's own bytes.
    fn request_event(
        &mut self,
        stream: StreamId,
        now_ms: u64,
        event: impl FnOnce(&mut Flow, &Config, &Room<'_>) -> Turn,
    ) -> Step {
        let Some(flow) = self.flows.get_mut(&stream) else {
            return Step::cont();
        };
        // The stream's own bytes out while the event runs: its room is the others' leftover.
        self.buffered.take(flow);
        let turn = event(flow, &self.cfg, &self.buffered.room());
        self.buffered.put(flow);
        self.run(stream, turn, now_ms)
    }

    pub fn on_request_trailers(
        &mut self,
        stream: StreamId,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        now_ms: u64,
    ) -> Step {
        self.request_event(stream, now_ms, |flow, cfg, _| {
            flow.on_request_trailers(cfg, read, now_ms)
        })
    }

    pub fn on_response_headers(
        &mut self,
        stream: StreamId,
        head: ResponseHead<'_>,
        end_of_stream: bool,
        now_ms: u64,
    ) -> Step {
        let Some(flow) = self.flows.get_mut(&stream) else {
            return Step::cont();
        };
        let turn = flow.on_response_headers(&self.cfg, head, end_of_stream);
        self.run(stream, turn, now_ms)
    }

    pub fn on_response_body(
        &mut self,
        stream: StreamId,
        body_size: usize,
        end_of_stream: bool,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        now_ms: u64,
    ) -> Step {
        let Some(flow) = self.flows.get_mut(&stream) else {
            return Step::cont();
        };
        let turn = flow.on_response_body(&self.cfg, body_size, end_of_stream, read);
        self.run(stream, turn, now_ms)
    }

    pub fn on_response_trailers(
        &mut self,
        stream: StreamId,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        now_ms: u64,
    ) -> Step {
        let Some(flow) = self.flows.get_mut(&stream) else {
            return Step::cont();
        };
        let turn = flow.on_response_trailers(read);
        self.run(stream, turn, now_ms)
    }

    /// The stream is over (`on_done`): its callouts are cancelled by Envoy, its flow goes.
    pub fn on_stream_done(&mut self, stream: StreamId, now_ms: u64) -> Vec<Effect> {
        // A reply still waiting for a wake has nobody to go to.
        self.deferred_replies.retain(|(s, _)| *s != stream);
        let Some(mut flow) = self.flows.remove(&stream) else {
            return Vec::new();
        };
        self.buffered.take(&flow);
        self.calls.retain(|_, p| p.stream() != Some(stream));
        self.waiting.retain(|w| w.stream != stream);
        // Queued, its claim was never sent; in a batch on its way, its answer is seen to (a
        // claim granted for it is released, one whose answer is lost given back). Either way
        // the flow gives nothing back itself. A queued complete is sent all the same.
        let queued = self.claim_queue.len();
        self.claim_queue.retain(|c| c.stream != stream);
        let in_batch = self
            .batches
            .iter()
            .any(|(_, b)| b.claims.iter().any(|c| c.stream == stream));
        if queued != self.claim_queue.len() || in_batch {
            flow.claim_unsent();
        }
        let turn = flow.on_stream_done(&self.cfg);
        let mut step = Step::cont();
        self.apply(&mut flow, turn, now_ms, &mut step);
        // Its own callout, cancelled, may have been the one a queue waited for.
        self.wake_for_batches(&mut step.effects);
        step.effects
    }

    /// Runs a turn of the stream's flow (which is in `self.flows`).
    fn run(&mut self, stream: StreamId, turn: Turn, now_ms: u64) -> Step {
        let mut step = Step::cont();
        // The flow is taken out while its outputs are applied (they may call it again).
        let Some(mut flow) = self.flows.remove(&stream) else {
            return step;
        };
        self.apply(&mut flow, turn, now_ms, &mut step);
        self.flows.insert(stream, flow);
        step
    }

    /// Carries out a flow's outputs in order. A call the worker answers itself (a claim from
    /// memory, a complete it takes over) gives the flow another turn, applied in its place;
    /// the last turn's verdict is the callback's.
    fn apply(&mut self, flow: &mut Flow, turn: Turn, now_ms: u64, step: &mut Step) {
        step.verdict = turn.verdict;
        for out in turn.outs {
            match out {
                Out::Effect(e) => step.effects.push(e),
                Out::Note(n) => {
                    let sent_ms = flow.claim_sent_ms();
                    self.note(n, sent_ms, now_ms, &mut step.effects)
                }
                Out::Call(call) => {
                    if let Some(next) = self.call(flow, call, now_ms, &mut step.effects) {
                        self.apply(flow, next, now_ms, step);
                    }
                }
            }
        }
    }

    /// `apply` for a stream driven from the root context: its verdict is not the root's.
    fn apply_from_root(
        &mut self,
        flow: &mut Flow,
        turn: Turn,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        let mut one = Step::cont();
        self.apply(flow, turn, now_ms, &mut one);
        effects.append(&mut one.effects);
    }

    /// Carries out a flow's note; `sent_ms`: when the claim the flow holds was sent.
    fn note(&mut self, note: Note, sent_ms: Option<u64>, now_ms: u64, effects: &mut Vec<Effect>) {
        match note {
            Note::Register {
                claim,
                lease_ms,
                terms,
            } => {
                // Issue 46, seed 89644: the lease was granted at the claim's commit, which came
                // after it was sent and maybe long before its answer arrived: the first
                // heartbeat is due a heartbeat interval after the sending.
                let heard_ms = match sent_ms {
                    Some(sent) if !contract::undo::undone(contract::undo::Fix::LateGrant) => {
                        sent.min(now_ms)
                    }
                    _ => now_ms,
                };
                self.registry.register(claim, lease_ms, terms, heard_ms)
            }
            Note::Unregister(token) => self.registry.remove(token),
            Note::HoldRunning {
                id,
                fingerprint,
                retry_after_s,
                since_ms,
                lease_remaining_ms,
            } => {
                // Never past the lease the state API reported.
                if self.replays.enabled() {
                    let for_ms = self.cfg.in_flight_cache_ms.min(lease_remaining_ms);
                    self.in_flight
                        .hold(id, &fingerprint, retry_after_s, since_ms, for_ms);
                }
            }
            Note::ForgetRunning(id) => self.in_flight.forget(&id),
            Note::Remember {
                id,
                record,
                since_ms,
                expires_in_ms,
            } => {
                self.in_flight.forget(&id);
                if self.answerable(&record) {
                    self.replays.insert(id, *record, since_ms, expires_in_ms);
                    self.wake_waiters(id, now_ms, effects);
                }
            }
            Note::HandOver { write, record } => self.hand_over(write, record, now_ms, effects),
            Note::Abandon(req) => self.abandon(*req, now_ms, effects),
        }
    }

    /// The streams waiting for `id` get the replay this worker now holds, without waiting for
    /// the state API to tell them; their claims' answers are dropped when they come.
    fn wake_waiters(&mut self, id: ids::Id, now_ms: u64, effects: &mut Vec<Effect>) {
        if !self.waiting.iter().any(|w| w.id == id) {
            return;
        }
        let Some(rec) = self.replays.get(&id, now_ms).cloned() else {
            return;
        };
        let (woken, still): (Vec<Waiter>, Vec<Waiter>) =
            self.waiting.iter().partition(|w| w.id == id);
        self.waiting = still;
        for waiter in woken {
            self.calls.remove(&waiter.call);
            let Some(mut flow) = self.flows.remove(&waiter.stream) else {
                continue;
            };
            let turn = flow.on_remembered(&self.cfg, Remembered::Woken(rec.clone()), now_ms);
            let mut step = Step::cont();
            self.apply(&mut flow, turn, now_ms, &mut step);
            effects.append(&mut step.effects);
            self.flows.insert(waiter.stream, flow);
        }
    }

    /// Only records a replay can carry are kept in memory.
    fn answerable(&self, rec: &Completed) -> bool {
        crate::flow::completed_reply(&self.cfg, rec, None).is_ok()
    }

    // -----------------------------------------------------------------------------------------
    // Callout answers

    /// The answer to a callout (or its failure, also a failure to dispatch it).
    pub fn on_callout_answer(&mut self, id: CallId, result: CalloutResult, now_ms: u64) -> Step {
        let in_root = match self.worker_calls.iter().position(|c| *c == id) {
            Some(i) => {
                self.worker_calls.swap_remove(i);
                true
            }
            None => false,
        };
        let Some(purpose) = self.calls.remove(&id) else {
            // A waiting claim whose stream was answered when this worker saw its key complete.
            return Step {
                verdict: Verdict::Continue,
                effects: vec![Effect::Log(
                    Level::Debug,
                    format!("the answer to callout {} is no longer wanted", id.0),
                )],
            };
        };
        if let Purpose::Claim(stream) = purpose {
            self.waiting.retain(|w| w.stream != stream);
        }
        self.in_root = in_root;
        let mut step = self.answered(id, purpose, result, now_ms);
        self.in_root = false;
        if purpose.in_lane() {
            self.wake_for_batches(&mut step.effects);
        }
        step
    }

    fn answered(
        &mut self,
        id: CallId,
        purpose: Purpose,
        result: CalloutResult,
        now_ms: u64,
    ) -> Step {
        match purpose {
            Purpose::Claim(stream)
            | Purpose::StreamWrite(stream)
            | Purpose::Reconcile(stream)
            | Purpose::KeyState(stream) => {
                let Some(flow) = self.flows.get_mut(&stream) else {
                    return Step::cont();
                };
                let turn = match purpose {
                    Purpose::Claim(_) => flow.on_claim_answer(&self.cfg, result, now_ms),
                    Purpose::Reconcile(_) => flow.on_reconcile_answer(&self.cfg, result),
                    Purpose::KeyState(_) => flow.on_key_state_answer(&self.cfg, result),
                    _ => flow.on_write_answer(&self.cfg, result),
                };
                self.run(stream, turn, now_ms)
            }
            Purpose::Heartbeat(token) => Step {
                verdict: Verdict::Continue,
                effects: self.heartbeat_answered(token, result),
            },
            Purpose::Write(token) => {
                let mut effects = Vec::new();
                self.write_answered(token, WriteAnswer::of(&result), now_ms, &mut effects);
                Step {
                    verdict: Verdict::Continue,
                    effects,
                }
            }
            Purpose::Batch { .. } => self.batch_answered(id, result, now_ms),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Root context events

    /// Local replies a callback could not send ([`crate::host::REPLIES_PER_CALLBACK`]): they go,
    /// in order, at the next wake, which the host asks for, or at the next tick, whichever comes
    /// first (a wake the host could not enqueue is lost; the tick always comes).
    pub fn defer_replies(&mut self, replies: Vec<(StreamId, LocalReply)>) {
        self.deferred_replies.extend(replies);
    }

    /// The replies deferred so far, as effects: the host sends them within its bound and defers
    /// the rest again.
    fn deferred_reply_effects(&mut self) -> Vec<Effect> {
        self.deferred_replies
            .drain(..)
            .map(|(stream, reply)| Effect::Reply { stream, reply })
            .collect()
    }

    /// The root context's tick: deferred replies, heartbeats that are due, writes that are
    /// due, expired memory.
    pub fn on_tick(&mut self, now_ms: u64) -> Vec<Effect> {
        // Issue 46, finding 7: a wake lost by the host left its replies waiting until the next
        // wake, which only a later deferral or handover would ask for.
        let mut effects = if contract::undo::undone(contract::undo::Fix::TickDrain) {
            Vec::new()
        } else {
            self.deferred_reply_effects()
        };
        self.replays.purge_expired(now_ms);
        self.in_flight.purge_expired(now_ms);
        self.send_heartbeats(now_ms, &mut effects);
        self.handed_await_lane = false;
        self.send_writes(now_ms, &mut effects);
        // A wake lost by the host is made up for here, and claims and completes queued behind
        // one that takes long go now.
        self.send_batches(&mut effects);
        self.wake_pending = false;
        effects
    }

    /// The root context was woken ([`Effect::Wake`]): the writes handed over meanwhile go now.
    pub fn on_wake(&mut self, now_ms: u64) -> Vec<Effect> {
        self.wake_pending = false;
        self.handed_await_lane = false;
        let mut effects = self.deferred_reply_effects();
        self.send_writes(now_ms, &mut effects);
        self.send_batches(&mut effects);
        effects
    }
}

#[cfg(test)]
mod tests;
