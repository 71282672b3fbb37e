//! A stream's calls routed: answered from the worker's memory, taken over by the worker,
//! queued in the batching lane, or made as callouts; and the callouts to the state API.

use super::batch::{BatchedClaim, BatchedWrite, Writer, BATCH_WRITE_BYTES};
use super::writes::PendingWrite;
use super::{ids, Purpose, Waiter, Worker};
use crate::effect::{CallId, Dispatch, Effect, Level, Owner, StreamId};
use crate::flow::{Call, Flow, Remembered, Turn};
use crate::metrics::Metric;
use contract::fingerprint::Fingerprint;
use contract::wire::{ClaimRequest, CLAIM_PATH, COMPLETE_PATH, RELEASE_PATH};

/// A callout's request, before it has an id and an owner.
pub(super) struct Outgoing {
    cluster: String,
    /// Pseudo-headers included.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    timeout_ms: u64,
}

impl Worker {
    /// Routes a stream's call: answered from memory, taken over, or dispatched on the stream.
    pub(super) fn call(
        &mut self,
        flow: &mut Flow,
        call: Call,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) -> Option<Turn> {
        let stream = flow.stream();
        match call {
            Call::Claim {
                request,
                id,
                fingerprint,
            } => {
                let waits = request.wait_ms.is_some();
                if let Some(remembered) = self.remembered(&id, &fingerprint, waits, now_ms) {
                    return Some(flow.on_remembered(&self.cfg, remembered, now_ms));
                }
                self.watch_churn(&request, id, now_ms, effects);
                self.send_claim(flow, request, id, effects);
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
                self.send_held_complete(stream, body, effects);
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
            Call::KeyState { path } => {
                let mut call =
                    self.state_api_call_within(&path, Vec::new(), self.cfg.state_api.timeout_ms);
                for (name, value) in &mut call.headers {
                    if name == ":method" {
                        *value = "GET".into();
                    }
                }
                call.headers.retain(|(name, _)| name != "content-type");
                self.dispatch(
                    self.owner_of(stream),
                    Purpose::KeyState(stream),
                    call,
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

    /// What this worker's memory answers a claim with, if anything: the completed record, or
    /// 409 while the key runs elsewhere (never to a retry that asks to wait).
    fn remembered(
        &mut self,
        id: &ids::Id,
        fingerprint: &Fingerprint,
        waits: bool,
        now_ms: u64,
    ) -> Option<Remembered> {
        if self.replays.enabled() {
            if let Some(rec) = self.replays.get(id, now_ms) {
                let rec = rec.clone();
                return Some(Remembered::Completed(rec));
            }
            // A retry that asks to wait is not answered 409 from memory.
            if let Some(retry_after_s) = (!waits)
                .then(|| self.in_flight.retry_after(id, fingerprint, now_ms))
                .flatten()
            {
                return Some(Remembered::Running { retry_after_s });
            }
        }
        None
    }

    /// Counts key churn: this request came under another key within the window (a client
    /// minting a key per retry: each would run). Observed only; the claim goes as it is. The
    /// log names both records by their address, never by their keys.
    fn watch_churn(
        &mut self,
        request: &ClaimRequest,
        id: ids::Id,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) {
        let Some(churn) = self.churn.note(
            &request.subject,
            &request.endpoint,
            &request.fingerprint,
            id,
            now_ms,
        ) else {
            return;
        };
        effects.push(Effect::Count(Metric::KeyChurn));
        effects.push(Effect::Log(
            Level::Info,
            format!(
                "key churn: subject {} sent the same request to {} under a new key (record {}), {} ms after another key (record {}): a client that makes a new key for each retry runs it again each time",
                request.subject,
                request.endpoint,
                super::churn::record_ref(&id),
                churn.ms_ago,
                super::churn::record_ref(&churn.earlier)
            ),
        ));
    }

    /// Sends a stream's claim with the next nonce: queued in the lane when it is behind, else
    /// as the stream's callout (one that waits for a running key is counted among the
    /// waiters, or sent without its wait when they are at `max_waiters`).
    fn send_claim(
        &mut self,
        flow: &mut Flow,
        mut request: Box<ClaimRequest>,
        id: ids::Id,
        effects: &mut Vec<Effect>,
    ) {
        let stream = flow.stream();
        let waits = request.wait_ms.is_some();
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
            return;
        }
        let body = crate::effect::to_json(&*request);
        let call = self.state_api_call(CLAIM_PATH, body, wait_ms);
        let call_id = self.dispatch(self.owner_of(stream), Purpose::Claim(stream), call, effects);
        if wait_ms > 0 {
            self.waiting.push(Waiter {
                stream,
                id,
                call: call_id,
            });
        }
    }

    /// Sends the complete of a held response: queued in the lane when it is behind (and it
    /// fits a batch), else as the stream's callout.
    fn send_held_complete(&mut self, stream: StreamId, body: Vec<u8>, effects: &mut Vec<Effect>) {
        if self.batching && self.lane_behind() && body.len() <= BATCH_WRITE_BYTES {
            let by = Writer::Stream(stream);
            self.complete_queue.push(BatchedWrite { by, body });
            return;
        }
        self.dispatch_state_api(
            self.owner_of(stream),
            Purpose::StreamWrite(stream),
            COMPLETE_PATH,
            body,
            effects,
        );
    }

    /// Who makes a stream's callout: the stream, or the worker when the stream is handled from
    /// the root context (Envoy answers a callout to the context that made it).
    pub(super) fn owner_of(&self, stream: StreamId) -> Owner {
        if self.in_root {
            Owner::Worker
        } else {
            Owner::Stream(stream)
        }
    }

    /// Makes a callout and remembers what it is for.
    pub(super) fn dispatch(
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

    pub(super) fn dispatch_state_api(
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

    /// A call to the state API; one that may wait there `wait_ms` has that much more time, and
    /// goes to the cluster for waiting claims when there is one.
    pub(super) fn state_api_call(&self, path: &str, body: Vec<u8>, wait_ms: u64) -> Outgoing {
        let api = &self.cfg.state_api;
        let timeout_ms = api.timeout_ms.saturating_add(wait_ms);
        let mut call = self.state_api_call_within(path, body, timeout_ms);
        if let (true, Some(wait_cluster)) = (wait_ms > 0, &api.wait_cluster) {
            call.cluster = wait_cluster.clone();
        }
        call
    }

    /// A call to the state API given up after `timeout_ms` (the caller-timeout header says so,
    /// so the state API drops a job its caller no longer waits for).
    pub(super) fn state_api_call_within(
        &self,
        path: &str,
        body: Vec<u8>,
        timeout_ms: u64,
    ) -> Outgoing {
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
}
