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

pub mod ids;
pub mod in_flight;
pub mod registry;
pub mod replay_cache;
pub mod writes;

use crate::config::Config;
use crate::flow::{
    Call, ClaimAnswer, Flow, Note, Out, Remembered, RequestHead, ResponseHead, Turn, Verdict,
};
use crate::metrics::Metric;
use contract::wire::{
    BatchResponse, ClaimRequest, HeartbeatResponse, ABANDON_PATH, CLAIM_PATH, COMPLETE_PATH,
    HEARTBEAT_PATH, RELEASE_PATH, UNKNOWN_PATH, WRITES_PATH,
};
use contract::ProblemKind;
use in_flight::InFlightMemory;
use registry::Registry;
use replay_cache::{Completed, ReplayCache};
use std::collections::HashMap;
use writes::{PendingWrites, WriteAnswer, WriteDone, WriteVerdict};

pub use crate::effect::{CallId, CalloutResult, Dispatch, Effect, Level, Owner, Step, StreamId};
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
            Purpose::Claim(s) | Purpose::StreamWrite(s) | Purpose::Reconcile(s) => Some(s),
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

/// Most bytes of claims and completes in one `/v1/writes` (a larger complete goes alone): well
/// inside the state API's request limit, which is 64 KiB over its largest stored body.
pub const BATCH_WRITE_BYTES: usize = 60 * 1024;

/// What a batch callout carries.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Batch {
    claims: Vec<BatchedClaim>,
    completes: Vec<BatchedWrite>,
}

/// A complete that waits for the worker's next `/v1/writes`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BatchedWrite {
    by: Writer,
    /// The `/v1/complete` body.
    body: Vec<u8>,
}

/// Whose complete it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    /// A held response's stream.
    Stream(StreamId),
    /// The worker's: one it took over (`complete_in_background`, a retry), by fencing token.
    Worker(i64),
}

impl BatchedWrite {
    fn stream(&self) -> Option<StreamId> {
        match self.by {
            Writer::Stream(s) => Some(s),
            Writer::Worker(_) => None,
        }
    }
}

/// A stream's claim that waits for the worker's next `/v1/writes`, or is in it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BatchedClaim {
    stream: StreamId,
    request: Box<ClaimRequest>,
}

/// A callout's request, before it has an id and an owner.
struct Outgoing {
    cluster: String,
    /// Pseudo-headers included.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    timeout_ms: u64,
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
    /// Request body bytes its streams hold before forwarding (their sum of
    /// [`Flow::held_request_bytes`]), bounded by `max_buffered_bytes`.
    held_request_bytes: u64,
    /// [`Config::max_buffered_bytes`], computed once.
    max_buffered_bytes: u64,
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
            held_request_bytes: 0,
            max_buffered_bytes: cfg.max_buffered_bytes(),
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
            held_request_bytes: self.held_request_bytes,
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
    /// write that comes due, or queued claims or completes (now). Ticks before it only drop
    /// expired memory.
    pub fn next_due(&self) -> Option<u64> {
        if !self.claim_queue.is_empty() || !self.complete_queue.is_empty() {
            // Queued claims and completes go at the next tick if no wake sends them first.
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

    /// The streams whose claims, and whose completes, a `/v1/writes` callout carries, in
    /// order (for the simulation).
    pub fn batch_streams(&self, call: CallId) -> Option<(Vec<StreamId>, Vec<StreamId>)> {
        let (_, b) = self.batches.iter().find(|(id, _)| *id == call)?;
        Some((
            b.claims.iter().map(|c| c.stream).collect(),
            b.completes
                .iter()
                .filter_map(BatchedWrite::stream)
                .collect(),
        ))
    }

    fn take_batch(&mut self, id: CallId) -> Option<Batch> {
        let i = self.batches.iter().position(|(b, _)| *b == id)?;
        Some(self.batches.swap_remove(i).1)
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
        let room = self
            .max_buffered_bytes
            .saturating_sub(self.held_request_bytes);
        let (flow, turn) = Flow::start(&self.cfg, stream, head, end_of_stream, now_ms, room);
        self.held_request_bytes += flow.held_request_bytes();
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
        event: impl FnOnce(&mut Flow, &Config, u64) -> Turn,
    ) -> Step {
        let Some(flow) = self.flows.get_mut(&stream) else {
            return Step::cont();
        };
        let held = flow.held_request_bytes();
        let others = self.held_request_bytes.saturating_sub(held);
        let room = self.max_buffered_bytes.saturating_sub(others);
        let turn = event(flow, &self.cfg, room);
        self.held_request_bytes = others + flow.held_request_bytes();
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
        let Some(mut flow) = self.flows.remove(&stream) else {
            return Vec::new();
        };
        self.held_request_bytes = self
            .held_request_bytes
            .saturating_sub(flow.held_request_bytes());
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
                Out::Note(n) => self.note(n, now_ms, &mut step.effects),
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

    /// Routes a stream's call: answered from memory, taken over, or dispatched on the stream.
    fn call(
        &mut self,
        flow: &mut Flow,
        call: Call,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) -> Option<Turn> {
        let stream = flow.stream();
        match call {
            Call::Claim {
                mut request,
                id,
                fingerprint,
            } => {
                let waits = request.wait_ms.is_some();
                if self.replays.enabled() {
                    if let Some(rec) = self.replays.get(&id, now_ms) {
                        let rec = rec.clone();
                        return Some(flow.on_remembered(&self.cfg, Remembered::Completed(rec)));
                    }
                    // A retry that asks to wait is not answered 409 from memory.
                    if let Some(retry_after_s) = (!waits)
                        .then(|| self.in_flight.retry_after(&id, &fingerprint, now_ms))
                        .flatten()
                    {
                        return Some(
                            flow.on_remembered(&self.cfg, Remembered::Running { retry_after_s }),
                        );
                    }
                }
                if waits && self.waiting.len() as u64 >= self.cfg.max_waiters {
                    request.wait_ms = None;
                    flow.wait_refused();
                    effects.push(Effect::Count(Metric::WaitRefused));
                    effects.push(Effect::Log(
                        Level::Debug,
                        format!(
                            "{} retries already wait on this worker (max_waiters): this one is answered at once",
                            self.waiting.len()
                        ),
                    ));
                }
                let nonce = self.next_nonce();
                request.nonce = Some(nonce.clone());
                flow.claim_sent(nonce);
                let wait_ms = request.wait_ms.unwrap_or(0);
                if wait_ms == 0 && self.batching && self.lane_behind() {
                    self.claim_queue.push(BatchedClaim { stream, request });
                    return None;
                }
                let body = crate::effect::to_json(&*request);
                let call = self.state_api_call(CLAIM_PATH, body, wait_ms);
                let call_id =
                    self.dispatch(self.owner_of(stream), Purpose::Claim(stream), call, effects);
                if wait_ms > 0 {
                    self.waiting.push(Waiter {
                        stream,
                        id,
                        call: call_id,
                    });
                }
                None
            }
            Call::Complete {
                body,
                fallback,
                claim,
                record,
                first,
            } => {
                if first && self.cfg.complete_in_background {
                    if self.writes.can_take(body.len()) {
                        let write = PendingWrite {
                            claim,
                            path: COMPLETE_PATH,
                            payload: body,
                            fallback,
                            untried: true,
                        };
                        self.hand_over(write, Some(record), now_ms, effects);
                        return Some(flow.on_complete_taken());
                    }
                    effects.push(Effect::Count(Metric::CompleteHeld));
                    effects.push(Effect::Log(
                        Level::Info,
                        format!(
                            "the worker's complete_retry_bytes are in use: {} is stored before its response goes on",
                            claim.endpoint
                        ),
                    ));
                }
                if self.batching && self.lane_behind() && body.len() <= BATCH_WRITE_BYTES {
                    let by = Writer::Stream(stream);
                    self.complete_queue.push(BatchedWrite { by, body });
                    return None;
                }
                self.dispatch_state_api(
                    self.owner_of(stream),
                    Purpose::StreamWrite(stream),
                    COMPLETE_PATH,
                    body,
                    effects,
                );
                None
            }
            Call::Release { body } => {
                self.dispatch_state_api(
                    self.owner_of(stream),
                    Purpose::StreamWrite(stream),
                    RELEASE_PATH,
                    body,
                    effects,
                );
                None
            }
            Call::Reconcile {
                cluster,
                headers,
                timeout_ms,
            } => {
                let call = Outgoing {
                    cluster,
                    headers,
                    body: Vec::new(),
                    timeout_ms,
                };
                self.dispatch(
                    self.owner_of(stream),
                    Purpose::Reconcile(stream),
                    call,
                    effects,
                );
                None
            }
        }
    }

    /// Who makes a stream's callout: the stream, or the worker when the stream is handled from
    /// the root context (Envoy answers a callout to the context that made it).
    fn owner_of(&self, stream: StreamId) -> Owner {
        if self.in_root {
            Owner::Worker
        } else {
            Owner::Stream(stream)
        }
    }

    /// Writes of this worker on their way in the batching lane (a claim that waits at the
    /// state API for a running key does not count: it may take seconds).
    fn lane_on_its_way(&self) -> usize {
        self.calls
            .values()
            .filter(|p| p.in_lane())
            .count()
            .saturating_sub(self.waiting.len())
    }

    /// A claim or held complete made now queues: the lane has a write on its way, or others
    /// queued before it.
    fn lane_behind(&self) -> bool {
        self.lane_on_its_way() > 0 || self.queued()
    }

    fn queued(&self) -> bool {
        !self.claim_queue.is_empty() || !self.complete_queue.is_empty()
    }

    /// Asks for a wake when claims or completes are queued, or a handed-over complete waits
    /// for the lane, and nothing in the lane is on its way any more (batches go from the root
    /// context).
    fn wake_for_batches(&mut self, effects: &mut Vec<Effect>) {
        if (self.queued() || self.handed_await_lane)
            && self.lane_on_its_way() == 0
            && !self.wake_pending
        {
            self.wake_pending = true;
            effects.push(Effect::Wake);
        }
    }

    /// Sends every queued claim and complete (root context only): as `/v1/writes` callouts
    /// of the worker, each within `batch_max` claims, `batch_max` completes and
    /// [`BATCH_WRITE_BYTES`], or one callout each once batching stopped.
    fn send_batches(&mut self, effects: &mut Vec<Effect>) {
        if !self.batching {
            for c in std::mem::take(&mut self.claim_queue) {
                let body = crate::effect::to_json(&*c.request);
                let purpose = Purpose::Claim(c.stream);
                self.dispatch_state_api(Owner::Worker, purpose, CLAIM_PATH, body, effects);
            }
            for w in std::mem::take(&mut self.complete_queue) {
                let purpose = match w.by {
                    Writer::Stream(s) => Purpose::StreamWrite(s),
                    Writer::Worker(token) => Purpose::Write(token),
                };
                self.dispatch_state_api(Owner::Worker, purpose, COMPLETE_PATH, w.body, effects);
            }
            return;
        }
        let most = usize::try_from(self.cfg.batch_max)
            .unwrap_or(usize::MAX)
            .max(1);
        while self.queued() {
            let claims: Vec<Vec<u8>> = self
                .claim_queue
                .iter()
                .take(most)
                .map(|c| crate::effect::to_json(&*c.request))
                .collect();
            let mut bytes = 0;
            let claimed = fitting(claims.iter().map(Vec::len), &mut bytes);
            let completes = self.complete_queue.iter().take(most).map(|w| w.body.len());
            let completed = fitting(completes, &mut bytes);
            let batch = Batch {
                claims: self.claim_queue.drain(..claimed).collect(),
                completes: self.complete_queue.drain(..completed).collect(),
            };
            let mut body = b"{\"claims\":[".to_vec();
            json_list(
                &mut body,
                &mut claims.iter().take(claimed).map(Vec::as_slice),
            );
            body.extend_from_slice(b"],\"completes\":[");
            json_list(
                &mut body,
                &mut batch.completes.iter().map(|w| w.body.as_slice()),
            );
            body.extend_from_slice(b"]}");
            for (n, batches, batched) in [
                (claimed, Metric::ClaimBatches, Metric::ClaimsBatched),
                (completed, Metric::CompleteBatches, Metric::CompletesBatched),
            ] {
                if n > 0 {
                    effects.push(Effect::Count(batches));
                }
                for _ in 0..n {
                    effects.push(Effect::Count(batched));
                }
            }
            let call = self.state_api_call(WRITES_PATH, body, 0);
            let lane = claimed > 0 || batch.completes.iter().any(|w| w.stream().is_some());
            let id = self.dispatch(Owner::Worker, Purpose::Batch { lane }, call, effects);
            self.batches.push((id, batch));
        }
    }

    /// The answer to a `/v1/writes`: each claim's and each complete's answer goes to its
    /// stream, as if it were the answer to its own callout. A stream that ended meanwhile
    /// and was granted its claim forwarded nothing: the key is released. One that ended with
    /// its complete on the way handed the write over to the worker already.
    fn batch_answered(&mut self, id: CallId, result: CalloutResult, now_ms: u64) -> Step {
        let mut step = Step::cont();
        let Some(Batch { claims, completes }) = self.take_batch(id) else {
            return step;
        };
        if matches!(result, CalloutResult::Response { status: 404, .. }) {
            // A state API older than batches: this worker stops batching, and what it
            // queued goes one callout each.
            self.batching = false;
            step.effects.push(Effect::Log(
                Level::Warn,
                format!("the state API has no {WRITES_PATH} (404: older): no more batches on this worker"),
            ));
            let live = claims
                .into_iter()
                .filter(|c| self.flows.contains_key(&c.stream));
            self.claim_queue.extend(live);
            self.complete_queue.extend(completes);
            self.send_batches(&mut step.effects);
            return step;
        }
        let (claim_answers, write_answers): (Vec<ClaimAnswer>, Vec<WriteAnswer>) = match &result {
            CalloutResult::Response { status, body, .. } if (200..300).contains(status) => {
                match BatchResponse::read_both(body, claims.len(), completes.len()) {
                    Ok((c, w)) => (
                        c.into_iter().map(ClaimAnswer::of_item).collect(),
                        w.into_iter().map(WriteAnswer::of_item).collect(),
                    ),
                    Err(e) => {
                        let failed = CalloutResult::Failed(format!("unreadable batch answer: {e}"));
                        every(claims.len(), completes.len(), &failed)
                    }
                }
            }
            whole => every(claims.len(), completes.len(), whole),
        };
        for (claim, answer) in claims.into_iter().zip(claim_answers) {
            match self.flows.remove(&claim.stream) {
                Some(mut flow) => {
                    let turn = flow.on_claim(&self.cfg, answer);
                    self.apply_from_root(&mut flow, turn, now_ms, &mut step.effects);
                    self.flows.insert(claim.stream, flow);
                }
                None => {
                    if let Some(token) = answer.granted_token() {
                        self.release_unused(&claim.request, token, now_ms, &mut step.effects);
                    } else if answer.unusable() {
                        // Its answer is lost and its stream gone: whatever was committed is
                        // given back.
                        if let Some(req) = abandon_request(&claim.request) {
                            self.abandon(req, now_ms, &mut step.effects);
                        }
                    }
                }
            }
        }
        for (write, answer) in completes.into_iter().zip(write_answers) {
            match write.by {
                Writer::Stream(stream) => {
                    if let Some(mut flow) = self.flows.remove(&stream) {
                        let turn = flow.on_write(&self.cfg, answer);
                        self.apply_from_root(&mut flow, turn, now_ms, &mut step.effects);
                        self.flows.insert(stream, flow);
                    }
                }
                Writer::Worker(token) => {
                    self.write_answered(token, answer, now_ms, &mut step.effects)
                }
            }
        }
        self.send_batches(&mut step.effects);
        step
    }

    /// A claim granted for a stream that is gone: nothing was forwarded, the key goes back.
    fn release_unused(
        &mut self,
        request: &ClaimRequest,
        token: i64,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        effects.push(Effect::Count(Metric::ClaimedForEndedStream));
        let claim = HeldClaim {
            key: request.key.clone(),
            subject: request.subject.clone(),
            endpoint: request.endpoint.clone(),
            token,
        };
        let write = PendingWrite::fenced(claim, &request.namespace, RELEASE_PATH);
        self.hand_over(write, None, now_ms, effects);
    }

    /// Makes a callout and remembers what it is for.
    fn dispatch(
        &mut self,
        owner: Owner,
        purpose: Purpose,
        call: Outgoing,
        effects: &mut Vec<Effect>,
    ) -> CallId {
        self.next_call += 1;
        let id = CallId(self.next_call);
        self.calls.insert(id, purpose);
        if owner == Owner::Worker {
            self.worker_calls.push(id);
        }
        effects.push(Effect::Dispatch(Dispatch {
            id,
            owner,
            cluster: call.cluster,
            headers: call.headers,
            body: call.body,
            timeout_ms: call.timeout_ms,
        }));
        id
    }

    fn note(&mut self, note: Note, now_ms: u64, effects: &mut Vec<Effect>) {
        match note {
            Note::Register {
                claim,
                lease_ms,
                terms,
            } => self.registry.register(claim, lease_ms, terms, now_ms),
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

    /// Gives back the record of a claim whose answer never came (`/v1/abandon`): sent and
    /// retried like a handed-over write, under a negative token of its own.
    fn abandon(
        &mut self,
        req: contract::wire::AbandonRequest,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        self.abandons += 1;
        effects.push(Effect::Count(Metric::ClaimsAbandoned));
        let claim = HeldClaim {
            key: req.key.clone(),
            subject: req.subject.clone(),
            endpoint: req.endpoint.clone(),
            token: -self.abandons,
        };
        let write = PendingWrite {
            claim,
            path: ABANDON_PATH,
            payload: crate::effect::to_json(&req),
            fallback: None,
            untried: true,
        };
        self.hand_over(write, None, now_ms, effects);
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
            let turn = flow.on_remembered(&self.cfg, Remembered::Woken(rec.clone()));
            let mut step = Step::cont();
            self.apply(&mut flow, turn, now_ms, &mut step);
            effects.append(&mut step.effects);
            self.flows.insert(waiter.stream, flow);
        }
    }

    /// Only records a replay can carry are kept in memory.
    fn answerable(&self, rec: &Completed) -> bool {
        crate::flow::completed_reply(&self.cfg, rec).is_ok()
    }

    /// The worker takes a write over: the claim's lease stays alive while it waits, and the
    /// response is answered to retries on this worker from memory. When it cannot be kept, the
    /// heartbeat stops and the key stays in progress until its lease runs out.
    fn hand_over(
        &mut self,
        write: PendingWrite,
        record: Option<Box<Completed>>,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        let claim = write.claim.clone();
        if self.registry.is_fenced(claim.token) {
            // A heartbeat already found a newer claim owning the key: this write can only be
            // fenced out, and the response it carries is not the key's outcome (it may be the
            // upstream refusing this stale token), so retries must not be answered with it.
            self.registry.remove(claim.token);
            effects.push(Effect::Log(
                Level::Warn,
                format!(
                    "{} for {} not sent: a newer claim owns the key (token {})",
                    write.path, claim.endpoint, claim.token
                ),
            ));
            return;
        }
        let untried = write.untried;
        let write_path = write.path;
        let keeps_lease = write.keeps_lease();
        match self.writes.add(write, now_ms) {
            Ok(()) => {
                if keeps_lease && !self.registry.contains(claim.token) {
                    // The stream ended before: keep the lease alive all the same.
                    let terms = registry::Terms {
                        lease_ms: self.cfg.lease_ms,
                        heartbeat_ms: self.cfg.heartbeat_ms,
                    };
                    self.registry
                        .register(claim.clone(), self.cfg.lease_ms, terms, now_ms);
                }
                if let Some(rec) = record {
                    if self.answerable(&rec) {
                        let id = ids::id(&claim.key, &claim.subject, &claim.endpoint);
                        self.replays.insert_pending(id, *rec);
                        self.wake_waiters(id, now_ms, effects);
                    }
                }
                if untried && !self.wake_pending {
                    if self.batching && write_path == COMPLETE_PATH && self.lane_on_its_way() > 0
                    {
                        // It goes with the batch the lane's answer wakes the worker for.
                        self.handed_await_lane = true;
                    } else {
                        self.wake_pending = true;
                        effects.push(Effect::Wake);
                    }
                }
            }
            Err(why) if !keeps_lease => effects.push(Effect::Log(
                Level::Warn,
                format!(
                    "the unknown outcome of {} is not sent ({why}); the state API finds it unknown when its lease runs out",
                    claim.endpoint
                ),
            )),
            Err(why) => {
                self.registry.remove(claim.token);
                effects.push(Effect::Count(Metric::CompleteGaveUp));
                effects.push(Effect::Log(
                    Level::Error,
                    format!(
                        "complete for {} given up ({why}); the key stays in progress until its lease runs out",
                        claim.endpoint
                    ),
                ));
            }
        }
    }

    fn dispatch_state_api(
        &mut self,
        owner: Owner,
        purpose: Purpose,
        path: &str,
        body: Vec<u8>,
        effects: &mut Vec<Effect>,
    ) {
        let call = self.state_api_call(path, body, 0);
        self.dispatch(owner, purpose, call, effects);
    }

    /// A call to the state API; one that may wait there `wait_ms` has that much more time.
    fn state_api_call(&self, path: &str, body: Vec<u8>, wait_ms: u64) -> Outgoing {
        let timeout_ms = self.cfg.state_api.timeout_ms.saturating_add(wait_ms);
        self.state_api_call_within(path, body, timeout_ms)
    }

    /// A call to the state API given up after `timeout_ms` (the caller-timeout header says so,
    /// so the state API drops a job its caller no longer waits for).
    fn state_api_call_within(&self, path: &str, body: Vec<u8>, timeout_ms: u64) -> Outgoing {
        let api = &self.cfg.state_api;
        let headers = vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
            (":authority".into(), api.authority.clone()),
            ("authorization".into(), format!("Bearer {}", api.token)),
            ("content-type".into(), "application/json".into()),
            ("accept".into(), "application/json".into()),
            // The state API drops the job once this caller has given up on it.
            (
                contract::wire::CALLER_TIMEOUT_HEADER.into(),
                timeout_ms.to_string(),
            ),
        ];
        Outgoing {
            cluster: api.cluster.clone(),
            headers,
            body,
            timeout_ms,
        }
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
            Purpose::Claim(stream) | Purpose::StreamWrite(stream) | Purpose::Reconcile(stream) => {
                let Some(flow) = self.flows.get_mut(&stream) else {
                    return Step::cont();
                };
                let turn = match purpose {
                    Purpose::Claim(_) => flow.on_claim_answer(&self.cfg, result),
                    Purpose::Reconcile(_) => flow.on_reconcile_answer(&self.cfg, result),
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

    fn heartbeat_answered(&mut self, token: i64, result: CalloutResult) -> Vec<Effect> {
        self.registry.answered(token);
        match result {
            CalloutResult::Response { status, body, .. } if (200..300).contains(&status) => {
                if let Ok(hb) = HeartbeatResponse::read(&body) {
                    self.registry.granted(token, hb.lease_ms);
                    vec![Effect::Count(Metric::Heartbeats)]
                } else {
                    vec![
                        Effect::Count(Metric::StateApiErrors),
                        Effect::Log(Level::Warn, "unreadable heartbeat answer".into()),
                    ]
                }
            }
            CalloutResult::Response {
                status: 409, body, ..
            } if ProblemKind::LeaseEnded.names(&body) => {
                // Marked unknown under this token (the lease ran out and a claim, the purge or
                // this worker marked it): nothing extends it any more, but the outcome this
                // claim may still learn is stored (a complete of its token is accepted).
                self.registry.lease_ended(token);
                vec![
                    Effect::Count(Metric::FencedOut),
                    Effect::Log(
                        Level::Warn,
                        "heartbeat refused: the record is marked unknown (its lease ran out); its outcome is still stored".into(),
                    ),
                ]
            }
            CalloutResult::Response { status: 409, .. } => {
                // A newer claim owns the key: stop extending this one, and stop completing it.
                let pending = self.writes.remove(token);
                if let Some(claim) = &pending {
                    self.registry.remove(token);
                    self.replays
                        .remove(&ids::id(&claim.key, &claim.subject, &claim.endpoint));
                } else {
                    // Its stream still runs: what it hands over later is dropped (`hand_over`).
                    self.registry.fence(token);
                }
                vec![
                    Effect::Count(Metric::FencedOut),
                    Effect::Log(
                        Level::Warn,
                        if pending.is_some() {
                            "heartbeat fenced out; a newer claim owns the key (its pending complete is dropped)".into()
                        } else {
                            "heartbeat fenced out; a newer claim owns the key".into()
                        },
                    ),
                ]
            }
            CalloutResult::Response { status, .. } => {
                self.registry.failed(token);
                vec![
                    Effect::Count(Metric::StateApiErrors),
                    Effect::Log(
                        Level::Warn,
                        format!("heartbeat answered HTTP {status}; sent again at the next tick"),
                    ),
                ]
            }
            CalloutResult::Failed(why) => {
                self.registry.failed(token);
                vec![
                    Effect::Count(Metric::StateApiErrors),
                    Effect::Log(
                        Level::Warn,
                        format!("heartbeat failed: {why}; sent again at the next tick"),
                    ),
                ]
            }
        }
    }

    /// The answer to a handed-over write: its own callout's, or its item of a `/v1/writes`.
    fn write_answered(
        &mut self,
        token: i64,
        answer: WriteAnswer,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        let WriteAnswer {
            verdict,
            expires_in_ms,
            why,
        } = answer;
        let falls_back = matches!(verdict, WriteVerdict::Refused(_))
            .then(|| self.writes.fallback_of(token))
            .flatten();
        if let Some(claim) = falls_back {
            // Its status alone is stored instead: the response is not replayed from here either.
            self.replays
                .remove(&ids::id(&claim.key, &claim.subject, &claim.endpoint));
            effects.push(Effect::Count(Metric::CompleteRefused));
            effects.push(Effect::Log(
                Level::Warn,
                format!(
                    "complete for {} refused ({}); storing its status alone, not replayable (token {token})",
                    claim.endpoint, why
                ),
            ));
        }
        match self.writes.answered(token, verdict, now_ms) {
            None if verdict == WriteVerdict::Failed => {
                effects.push(Effect::Count(Metric::StateApiErrors));
                effects.push(Effect::Log(
                    Level::Debug,
                    format!("complete retry failed: {why}"),
                ));
            }
            None => {}
            Some(done) => self.write_done(done, expires_in_ms, now_ms, effects),
        }
    }

    /// A handed-over write is over: its heartbeat stops, its pending memory entry becomes a
    /// normal one (stored, with the record's expiry) or goes.
    fn write_done(
        &mut self,
        done: WriteDone,
        expires_in_ms: Option<u64>,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        let claim = done.claim();
        let token = claim.token;
        self.registry.remove(token);
        let id = ids::id(&claim.key, &claim.subject, &claim.endpoint);
        match (&done, expires_in_ms) {
            (WriteDone::Stored { .. }, Some(expires_in_ms)) => {
                self.replays.settle(&id, now_ms, expires_in_ms)
            }
            _ => {
                self.replays.remove(&id);
            }
        }
        match done {
            WriteDone::Stored {
                claim,
                path,
                attempts,
                untried,
            } => {
                match path {
                    RELEASE_PATH => effects.push(Effect::Count(Metric::Released)),
                    ABANDON_PATH => {}
                    COMPLETE_PATH => effects.push(Effect::Count(Metric::Completed)),
                    _ => {}
                }
                // An untried write stored at its first attempt is the normal case.
                let retries = attempts.saturating_sub(u32::from(untried));
                if retries > 0 {
                    effects.push(Effect::Log(
                        Level::Info,
                        format!(
                            "complete for {} stored after {retries} retries (token {token})",
                            claim.endpoint
                        ),
                    ));
                }
            }
            WriteDone::FencedOut { claim } => {
                effects.push(Effect::Count(Metric::FencedOut));
                effects.push(Effect::Log(
                    Level::Warn,
                    format!(
                        "complete for {} refused, a newer claim owns the key (token {token})",
                        claim.endpoint
                    ),
                ));
            }
            WriteDone::GaveUp {
                claim,
                attempts,
                why,
                path,
            } if path == UNKNOWN_PATH => {
                effects.push(Effect::Count(Metric::StateApiErrors));
                effects.push(Effect::Log(
                    Level::Warn,
                    format!(
                        "the unknown outcome of {} was not stored after {attempts} attempts ({why}; token {token}); the state API finds it unknown when its lease runs out",
                        claim.endpoint
                    ),
                ));
            }
            WriteDone::GaveUp {
                claim,
                attempts,
                why,
                ..
            } => {
                effects.push(Effect::Count(Metric::StateApiErrors));
                effects.push(Effect::Count(Metric::CompleteGaveUp));
                effects.push(Effect::Log(
                    Level::Error,
                    format!(
                        "complete for {} given up after {attempts} retries ({why}; token {token}); the key stays in progress until its lease runs out",
                        claim.endpoint
                    ),
                ));
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Root context events

    /// The root context's tick: heartbeats that are due, writes that are due, expired memory.
    pub fn on_tick(&mut self, now_ms: u64) -> Vec<Effect> {
        let mut effects = Vec::new();
        self.replays.purge_expired(now_ms);
        self.in_flight.purge_expired(now_ms);
        if !self.registry.is_empty() {
            let due = self
                .registry
                .due(now_ms, self.cfg.tick_period_ms(), &self.cfg.namespace);
            for hb in due {
                let token = hb.token;
                let body = crate::effect::to_json(&hb);
                let within = self
                    .registry
                    .answer_within(token, self.cfg.tick_period_ms())
                    .unwrap_or(u64::MAX);
                let timeout_ms = self.cfg.state_api.timeout_ms.min(within);
                let call = self.state_api_call_within(HEARTBEAT_PATH, body, timeout_ms);
                self.dispatch(Owner::Worker, Purpose::Heartbeat(token), call, &mut effects);
            }
        }
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
        let mut effects = Vec::new();
        self.send_writes(now_ms, &mut effects);
        self.send_batches(&mut effects);
        effects
    }

    /// Sends the writes that are due (within [`writes::MAX_IN_FLIGHT`]) and settles the ones
    /// given up.
    fn send_writes(&mut self, now_ms: u64, effects: &mut Vec<Effect>) {
        if self.writes.is_empty() {
            return;
        }
        let due = self.writes.due(now_ms);
        for done in due.gave_up {
            self.write_done(done, None, now_ms, effects);
        }
        for send in due.send {
            if !send.first {
                effects.push(Effect::Count(Metric::CompleteRetries));
            }
            if self.batching
                && send.path == COMPLETE_PATH
                && send.payload.len() <= BATCH_WRITE_BYTES
            {
                // Goes in the `/v1/writes` that `send_batches` makes next.
                let by = Writer::Worker(send.token);
                self.complete_queue.push(BatchedWrite {
                    by,
                    body: send.payload,
                });
                continue;
            }
            self.dispatch_state_api(
                Owner::Worker,
                Purpose::Write(send.token),
                send.path,
                send.payload,
                effects,
            );
        }
    }
}

/// Appends JSON documents, separated by commas (one instance for every list: the module's size).
fn json_list(body: &mut Vec<u8>, items: &mut dyn Iterator<Item = &[u8]>) {
    for (i, item) in items.enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(item);
    }
}

/// How many of the next items (by size) fit in a batch that holds `bytes` already, within
/// [`BATCH_WRITE_BYTES`]; `bytes` grows by theirs. The first item of a batch always goes.
fn fitting(sizes: impl Iterator<Item = usize>, bytes: &mut usize) -> usize {
    let mut n = 0;
    for size in sizes {
        if *bytes > 0 && *bytes + size > BATCH_WRITE_BYTES {
            break;
        }
        *bytes += size + 1;
        n += 1;
    }
    n
}

/// The same answer for every claim and complete of a batch (its callout failed whole).
fn every(
    claims: usize,
    completes: usize,
    result: &CalloutResult,
) -> (Vec<ClaimAnswer>, Vec<WriteAnswer>) {
    (
        (0..claims).map(|_| ClaimAnswer::of(result)).collect(),
        (0..completes).map(|_| WriteAnswer::of(result)).collect(),
    )
}

#[cfg(test)]
mod tests;

/// The abandon of a claim sent with a nonce.
fn abandon_request(request: &ClaimRequest) -> Option<contract::wire::AbandonRequest> {
    Some(contract::wire::AbandonRequest {
        key: request.key.clone(),
        subject: request.subject.clone(),
        endpoint: request.endpoint.clone(),
        namespace: request.namespace.clone(),
        nonce: request.nonce.clone()?,
    })
}
