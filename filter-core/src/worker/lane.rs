//! The batching lane: claims and held responses' completes queued while another is on its
//! way, sent together as the worker's `/v1/writes`, and that callout's answers handed to their
//! streams (see the worker's module comment).

use super::batch::{Batch, BatchedWrite, Writer, BATCH_WRITE_BYTES};
use super::registry::HeldClaim;
use super::writes::{PendingWrite, WriteAnswer};
use super::{Purpose, Worker};
use crate::effect::{CallId, CalloutResult, Effect, Level, Owner, Step, StreamId};
use crate::flow::ClaimAnswer;
use crate::metrics::Metric;
use contract::wire::{
    BatchResponse, ClaimRequest, CLAIM_PATH, COMPLETE_PATH, RELEASE_PATH, WRITES_PATH,
};

impl Worker {
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

    pub(super) fn take_batch(&mut self, id: CallId) -> Option<Batch> {
        let i = self.batches.iter().position(|(b, _)| *b == id)?;
        Some(self.batches.swap_remove(i).1)
    }

    /// Writes of this worker on their way in the batching lane (a claim that waits at the
    /// state API for a running key does not count: it may take seconds).
    pub(super) fn lane_on_its_way(&self) -> usize {
        self.calls
            .values()
            .filter(|p| p.in_lane())
            .count()
            .saturating_sub(self.waiting.len())
    }

    /// A claim or held complete made now queues: the lane has a write on its way, or others
    /// queued before it.
    pub(super) fn lane_behind(&self) -> bool {
        self.lane_on_its_way() > 0 || self.queued()
    }

    pub(super) fn queued(&self) -> bool {
        !self.claim_queue.is_empty() || !self.complete_queue.is_empty()
    }

    /// Asks for a wake when claims or completes are queued, or a handed-over complete waits
    /// for the lane, and nothing in the lane is on its way any more (batches go from the root
    /// context).
    pub(super) fn wake_for_batches(&mut self, effects: &mut Vec<Effect>) {
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
    pub(super) fn send_batches(&mut self, effects: &mut Vec<Effect>) {
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
    pub(super) fn batch_answered(
        &mut self,
        id: CallId,
        result: CalloutResult,
        now_ms: u64,
    ) -> Step {
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
                    let turn = flow.on_claim(&self.cfg, answer, now_ms);
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
    pub(super) fn release_unused(
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
