//! Callouts on their way between a worker and the state API (or a reconcile endpoint): their
//! answers delivered, lost, cut short or refused, and the grants lost with them.

use super::{Current, World, UPSTREAM_CLUSTER};
use crate::state_api::Address;
use contract::wire::{CLAIM_PATH, WRITES_PATH};
use contract::ProblemKind;
use filter_core::worker::{CallId, CalloutResult, Owner};

/// How long a statement the state API gave up at its stall limit may still reach the database
/// and commit: the kernel retransmits its bytes for about 15 minutes (Linux's `tcp_retries2`
/// default) and then resets the connection; one that reached the database runs within its
/// statement timeout. (An abandon's nonce row outlives it: kept an hour.)
pub const DETACHED_MAX_MS: u64 = 900_000;

/// A callout on its way.
#[derive(Debug, Clone)]
pub struct Callout {
    pub id: CallId,
    pub worker: usize,
    pub generation: u32,
    pub owner: Owner,
    pub stream: Option<usize>,
    /// The Envoy cluster: the state API's, or the upstream's (a reconcile).
    pub cluster: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub deadline: u64,
    /// The state API's answer once it handled the call.
    pub answer: Option<CalloutResult>,
    /// Nobody waits for the answer any more (the stream ended, timed out, or the worker died).
    pub orphan: bool,
    /// Why nobody waits.
    pub orphaned_by: &'static str,
    /// A claim that waits at the state API for its running key (`Prefer: wait`).
    pub parked: Option<Parked>,
    /// When it was dispatched, in the order of the run's dispatches and writes, and the time.
    pub seq: u64,
    pub sent_at: u64,
    /// The addresses its scopes were looked up at (during a rotation of the key secret the
    /// state API looks a record up, then runs the statement: two steps).
    pub looked_up: Option<Vec<Address>>,
    /// When that lookup ran.
    pub looked_at: u64,
    /// The state API gave the statement up at its stall limit and answered 503, while the
    /// statement, sent to the database, still commits later with nobody waiting for it
    /// (`store/held.rs`): it is never dropped as too late, and nothing is released for it.
    pub detached: bool,
    /// When it was given up so: a statement still unsent to the database
    /// [`DETACHED_MAX_MS`] later never runs.
    pub detached_at: u64,
    /// Whether the statement's snapshot (taken when it was sent) held a tombstone for the
    /// claim's nonce (a claim reads the abandoned nonces in its snapshot).
    pub snapshot_abandoned: Option<bool>,
}

/// A claim waiting at the state API: answered when its key settles (any later processing
/// models a wakeup or a poll) or at `until` with the in-progress answer.
#[derive(Debug, Clone, Copy)]
pub struct Parked {
    pub since: u64,
    pub until: u64,
}

pub fn describe(r: &CalloutResult) -> String {
    match r {
        CalloutResult::Failed(why) => format!("failed ({why})"),
        CalloutResult::Response {
            status,
            headers,
            body,
        } => {
            let outcome = headers
                .iter()
                .find(|(n, _)| n == contract::wire::OUTCOME_HEADER)
                .map(|(_, v)| format!("{}: {v} ", contract::wire::OUTCOME_HEADER))
                .unwrap_or_default();
            let text = String::from_utf8_lossy(body);
            let text: String = text.chars().take(140).collect();
            format!("{status} {outcome}{text}")
        }
    }
}

impl World {
    /// A heartbeat (its body) failed as its owner hears it (invariant 6 counts them).
    pub(super) fn heartbeat_failed(&mut self, body: &[u8], path: &str) {
        if path != contract::wire::HEARTBEAT_PATH {
            return;
        }
        if let Ok(h) = serde_json::from_slice::<contract::wire::HeartbeatRequest>(body) {
            self.ev
                .heartbeat_failures
                .entry(h.token)
                .or_default()
                .push(self.now);
        }
    }

    /// A claim answer the state API committed (a grant) that never reaches the filter: noted
    /// for invariant 8, and a region visited.
    pub(super) fn lost_grants(&mut self, c: &Callout, result: &CalloutResult, how: &str) {
        let granted = self.granted_tokens(c, result);
        for token in granted {
            let Some(scope) = self.api.issued.get(&token).cloned() else {
                continue;
            };
            self.reach(match how {
                h if h.contains("cancelled") => {
                    "region: a claim answer lost after its commit (the callout cancelled)"
                }
                h if h.contains("unreadable") => {
                    "region: a claim answer lost after its commit (unreadable)"
                }
                h if h.contains("timeout") || h.contains("timed out") => {
                    "region: a claim answer lost after its commit (timed out)"
                }
                _ => "region: a claim answer lost after its commit (the callout failed)",
            });
            self.ev.lost_grants.entry(scope).or_insert_with(|| {
                format!("the state API committed its claim (token {token}), and the answer never reached the filter ({how})")
            });
        }
    }

    /// The tokens a claim call's answer grants.
    pub(super) fn granted_tokens(&self, c: &Callout, result: &CalloutResult) -> Vec<i64> {
        if !matches!(
            c.path.as_str(),
            CLAIM_PATH | contract::wire::CLAIMS_PATH | WRITES_PATH
        ) {
            return Vec::new();
        }
        let CalloutResult::Response {
            status: 200, body, ..
        } = result
        else {
            return Vec::new();
        };
        if c.path == CLAIM_PATH {
            return match contract::wire::ClaimResponse::read(body) {
                Ok(contract::wire::ClaimResponse::Claimed { token, .. }) => vec![token],
                _ => Vec::new(),
            };
        }
        serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|b| {
                let answers = b.get("answers")?.as_array()?.clone();
                Some(
                    answers
                        .iter()
                        .filter_map(|a| a.get("answer")?.get("token")?.as_i64())
                        .collect(),
                )
            })
            .unwrap_or_default()
    }

    pub(super) fn deliver(&mut self, i: usize) {
        if self.callouts[i].answer.is_none() {
            return;
        }
        let mut c = self.callouts.remove(i);
        let Some(result) = c.answer.take() else {
            return;
        };
        self.deliver_result(&c, result);
    }

    pub(super) fn deliver_result(&mut self, c: &Callout, result: CalloutResult) {
        let w = c.worker;
        if self.workers[w].w.is_none() || self.workers[w].generation != c.generation {
            return;
        }
        if let Some(s) = c.stream {
            if self.streams[s].ended {
                return;
            }
            if c.path == CLAIM_PATH {
                if let CalloutResult::Response { status, .. } = &result {
                    if (400..500).contains(status) {
                        self.streams[s].claim_refused = true;
                    }
                }
            }
        }
        if c.path == WRITES_PATH {
            self.note_refused_in_batch(c, &result);
        }
        if !matches!(result, CalloutResult::Response { status: 200, .. }) {
            self.heartbeat_failed(&c.body, &c.path);
        }
        let now = self.worker_now(w);
        let id = c.id;
        let Some(step) = self
            .call(w, |wk| Some(wk.on_callout_answer(id, result, now)))
            .flatten()
        else {
            return;
        };
        let current = match c.stream {
            Some(s) => Current::Stream(s),
            None => Current::Root(w),
        };
        self.perform(w, current, step.verdict, step.effects);
        if let Some(s) = c.stream {
            self.end_if_answered(s);
        }
    }

    /// The streams of a `/v1/writes` whose claim the state API refused (a 4xx, of the whole
    /// call or of their item), as for a claim of their own.
    pub(super) fn note_refused_in_batch(&mut self, c: &Callout, result: &CalloutResult) {
        let w = c.worker;
        let Some((streams, _)) = self.workers[w]
            .w
            .as_ref()
            .and_then(|wk| wk.batch_streams(c.id))
        else {
            return;
        };
        // Held responses' completes and those the worker took over, as sent.
        let completes = serde_json::from_slice::<contract::wire::WriteBatchRequest>(&c.body)
            .map_or(0, |b| b.completes.len());
        let refused: Vec<bool> = match result {
            CalloutResult::Response { status, body, .. } if (200..300).contains(status) => {
                contract::wire::BatchResponse::read_both(body, streams.len(), completes)
                    .map(|(items, _)| {
                        items
                            .iter()
                            .map(|i| (400..500).contains(&i.status))
                            .collect()
                    })
                    .unwrap_or_default()
            }
            CalloutResult::Response { status, .. } if (400..500).contains(status) => {
                vec![true; streams.len()]
            }
            _ => Vec::new(),
        };
        for (sid, refused) in streams.into_iter().zip(refused) {
            let found = self.streams.iter().position(|s| {
                s.worker == w && s.generation == self.workers[w].generation && s.sid == sid
            });
            if let (true, Some(s)) = (refused, found) {
                self.streams[s].claim_refused = true;
            }
        }
    }

    pub(crate) fn fail_callout(&mut self, i: usize) {
        let why = *self
            .c
            .pick(&["reset", "timeout", "503", "refused", "unreadable"]);
        match why {
            "refused" => self.refuse_callout(i),
            "unreadable" => self.garble_callout(i),
            _ => self.fail_callout_with(i, why),
        }
    }

    /// The answer arrives cut short (a proxy in between, a bad frame): the filter cannot read
    /// what the state API did.
    pub(super) fn garble_callout(&mut self, i: usize) {
        let c = self.callouts[i].clone();
        let Some(CalloutResult::Response { status, body, .. }) = &c.answer else {
            return self.fail_callout_with(i, "reset");
        };
        if c.orphan {
            return;
        }
        self.callouts.remove(i);
        let cut = body[..body.len() / 2].to_vec();
        self.log(format!(
            "callout {} of worker {}: its answer arrives cut short",
            c.path, c.worker
        ));
        let result = CalloutResult::answer(*status, cut);
        self.lost_grants(
            &c,
            c.answer.as_ref().unwrap_or(&result),
            "its answer was unreadable",
        );
        self.deliver_result(&c, result);
    }

    /// The state API refuses a call it has not handled (a 4xx: a misconfigured token, a
    /// contract mismatch): nothing changed there, and the caller is told so.
    pub(super) fn refuse_callout(&mut self, i: usize) {
        let c = self.callouts[i].clone();
        if c.orphan || c.answer.is_some() || c.cluster == UPSTREAM_CLUSTER {
            return self.fail_callout_with(i, "reset");
        }
        self.callouts.remove(i);
        self.log(format!(
            "state API refuses {} from worker {} (401)",
            c.path, c.worker
        ));
        if c.path == contract::wire::COMPLETE_PATH {
            if let Ok(r) = serde_json::from_slice::<contract::wire::CompleteRequest>(&c.body) {
                // Its status alone may be stored instead: not replayable, by design.
                self.refused_completes
                    .insert((r.key, r.subject, r.endpoint));
            }
        }
        if c.path == WRITES_PATH {
            if let Ok(b) = serde_json::from_slice::<contract::wire::WriteBatchRequest>(&c.body) {
                for r in b.completes {
                    self.refused_completes
                        .insert((r.key, r.subject, r.endpoint));
                }
            }
        }
        let problem = contract::Problem::new(ProblemKind::Unauthenticated, "refused").to_json();
        self.deliver_result(&c, CalloutResult::answer(401, problem));
    }

    /// Envoy reports the callout failed; a call not handled yet may still reach the state API
    /// later (nobody waits for its answer then).
    pub(crate) fn fail_callout_with(&mut self, i: usize, why: &str) {
        let c = self.callouts[i].clone();
        if c.orphan {
            return;
        }
        if let Some(answer) = &c.answer {
            // Handled, but the answer is lost on the way back.
            self.lost_grants(&c, answer, &format!("the callout failed: {why}"));
            self.callouts.remove(i);
        } else if why == "503"
            && c.cluster != UPSTREAM_CLUSTER
            && c.parked.is_some()
            && state_rules::undo::undone(state_rules::undo::Fix::WaitLook)
        {
            // Before the fix: a waiting claim's look given up at the stall limit went on
            // waiting (`continue`), its look committing meanwhile: it waits on its own record.
            let (status, body) = self.api.handle(&c.path, &c.body, self.now, None);
            self.after_api(Some(&c));
            self.log(format!(
                "state API {} from worker {}: a look given up at the stall limit commits ({status} {}); the claim waits on",
                c.path,
                c.worker,
                String::from_utf8_lossy(&body).chars().take(100).collect::<String>()
            ));
            return;
        } else if why == "503" && c.cluster != UPSTREAM_CLUSTER {
            // (A waiting claim's look given up so ends its wait with this 503.)
            self.callouts[i].parked = None;
            // The state API's stall limit: its statement was sent (its snapshot taken) and
            // commits later; the caller is answered 503 now.
            let snapshot = self.api.tombstoned(&c.body);
            let d = &mut self.callouts[i];
            d.orphan = true;
            d.orphaned_by = "the state API gave its statement up at the stall limit";
            d.detached = true;
            d.detached_at = self.now;
            d.snapshot_abandoned = Some(snapshot);
            self.reach("region: a statement committed after its caller was answered 503");
        } else {
            self.callouts[i].orphan = true;
            self.callouts[i].orphaned_by = if why == "timeout" {
                "the callout timed out"
            } else {
                "the callout failed"
            };
        }
        let result = if why == "503" {
            CalloutResult::answer(503, b"upstream connect error".to_vec())
        } else {
            CalloutResult::Failed(why.to_owned())
        };
        if c.path != contract::wire::HEARTBEAT_PATH {
            // (A heartbeat's failure is counted, not traced: during an outage there is one a tick.)
            self.log(format!(
                "callout {} of worker {} fails ({why})",
                c.path, c.worker
            ));
        }
        self.deliver_result(&c, result);
    }
}
