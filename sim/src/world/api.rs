//! The model state API at work on the world's callouts: through its outages and a rotation of
//! the key secret (a lookup, then the statement), claims that wait for their key, the
//! operators' actions, and what it did recorded as evidence for the invariants.

use super::callouts::{describe, Callout, Parked};
use super::faults::Outage;
use super::{evidence, World, UPSTREAM_CLUSTER};
use crate::state_api::{Address, Event, Scope};
use contract::wire::CLAIM_PATH;
use contract::ProblemKind;
use filter_core::worker::CalloutResult;

impl World {
    pub(super) fn process(&mut self, i: usize) {
        let c = self.callouts[i].clone();
        if c.cluster != UPSTREAM_CLUSTER && c.parked.is_none() && !c.detached && self.too_late(&c) {
            // Envoy reset it at its timeout before the state API read it (or the state API
            // dropped it at its deadline): it never runs.
            self.callouts.remove(i);
            return;
        }
        let result = if c.cluster == UPSTREAM_CLUSTER {
            self.reconcile(&c)
        } else {
            match self.outage {
                Outage::ApiDown => CalloutResult::Failed("connection refused".into()),
                Outage::Database { .. } => CalloutResult::answer(
                    503,
                    contract::Problem::new(ProblemKind::StateUnavailable, "database unavailable")
                        .to_json(),
                ),
                // Stalled: answered once the database resumes, or timed out.
                Outage::Paused => return,
                Outage::None => match self.serve(i, &c) {
                    Some(answer) => answer,
                    // Looked up (the statement runs later), or parked.
                    None => return,
                },
            }
        };
        // Heartbeats are left out of the trace unless they change something: in quiet time,
        // and the late ones nobody waits for that are refused.
        let heartbeat = c.path == contract::wire::HEARTBEAT_PATH;
        let refused = matches!(result, CalloutResult::Response { status: 409, .. });
        let routine = heartbeat && ((self.quiet && !refused) || (c.orphan && refused));
        if !routine {
            self.log(format!(
                "{} {} from worker {}{}: {}",
                if c.cluster == UPSTREAM_CLUSTER {
                    "upstream reconcile"
                } else {
                    "state API"
                },
                c.path,
                c.worker,
                if c.orphan { " (nobody waits)" } else { "" },
                describe(&result)
            ));
        }
        if c.orphan {
            // The state API answers a caller that is gone: a claim that made it the owner is
            // released at once (`batch.rs`, deliver_claim), since nothing was forwarded with it;
            // not a statement it gave up at the stall limit (nothing waits for that one).
            let granted = if c.detached {
                Vec::new()
            } else {
                self.granted_tokens(&c, &result)
            };
            for token in granted {
                if self.api.release_for_gone_caller(token, self.now) {
                    self.reach("region: the state API released a claim whose caller was gone");
                    self.log(format!(
                        "state API releases token {token}: its caller is gone ({})",
                        c.orphaned_by
                    ));
                }
            }
            self.after_api(None);
            self.callouts.remove(i);
        } else {
            self.callouts[i].parked = None;
            self.callouts[i].answer = Some(result);
        }
    }

    /// The state API, up, handles callout `i` (`c`): `None` while its answer is not ready (looked
    /// up during a rotation of the key secret, its statement to run later; or parked, waiting
    /// for its key).
    fn serve(&mut self, i: usize, c: &Callout) -> Option<CalloutResult> {
        // (Claims look and write in one statement since the fix of path 9.)
        let claim = matches!(c.path.as_str(), CLAIM_PATH | contract::wire::CLAIMS_PATH);
        if self.api.previous_secret.is_some() && c.looked_up.is_none() && !claim {
            // `scope_of` looks the record up first; the statement runs later, and
            // other calls may run in between.
            let scopes = crate::state_api::scopes_of(&c.path, &c.body);
            if !scopes.is_empty() {
                let found: Vec<Address> = scopes.iter().map(|s| self.api.lookup(s)).collect();
                let old = found.iter().filter(|a| a.0 != self.api.secret).count();
                if old > 0 {
                    self.reach("region: a record found under the previous key secret");
                }
                if !(self.quiet && c.path == contract::wire::HEARTBEAT_PATH) {
                    self.log(format!(
                        "state API {} from worker {}: looked up ({old} of {} under the previous key secret)",
                        c.path,
                        c.worker,
                        found.len()
                    ));
                }
                self.callouts[i].looked_up = Some(found);
                self.callouts[i].looked_at = self.now;
                return None;
            }
        }
        // A request works only until its caller's deadline (the filter's timeout):
        // one whose statement would run later is dropped before it reaches the
        // database, and answered 503.
        let stale = c.looked_up.is_some() && self.now > c.looked_at + self.setup.callout_timeout_ms;
        let (status, body) = if stale {
            (
                503,
                contract::Problem::new(
                    ProblemKind::StateUnavailable,
                    "the request's deadline passed",
                )
                .to_json(),
            )
        } else {
            self.api.snapshot_abandoned = c.snapshot_abandoned;
            let answer = self
                .api
                .handle(&c.path, &c.body, self.now, c.looked_up.as_deref());
            self.api.snapshot_abandoned = None;
            answer
        };
        self.after_api(Some(c));
        if c.path == contract::wire::RELEASE_PATH && status == 200 {
            if let Ok(r) = serde_json::from_slice::<contract::wire::ReleaseRequest>(&c.body) {
                self.released.insert(r.token);
            }
        }
        // None: parked, it waits for its key.
        self.waited(i, status, body)
    }

    /// Whether a call nobody waits for any more arrives too late to run: past its caller's
    /// deadline, unless the database held it meanwhile (a statement already sent runs when the
    /// database comes back).
    pub(super) fn too_late(&self, c: &Callout) -> bool {
        let deadline = c.deadline;
        if !c.orphan || self.now <= deadline || c.looked_up.is_some() {
            return false;
        }
        let held = |start: u64, end: u64| start <= deadline && end >= c.sent_at;
        let now_held = matches!(self.outage, Outage::Paused | Outage::Database { .. })
            && self.outage_since <= deadline;
        !(now_held
            || self
                .ev
                .database_outages
                .iter()
                .any(|(start, end, _)| held(*start, *end)))
    }

    /// What the state API did for callout `c`, for the invariants.
    pub(super) fn after_api(&mut self, c: Option<&Callout>) {
        for event in self.api.take_events() {
            match event {
                Event::Granted { token, scope, how } => {
                    let freed = evidence::judge_grant(self, &scope, &how);
                    // A new owner of the key: the operator's answer is no longer its outcome
                    // (only a grant of a key freed since can come after a resolve).
                    if let Some((_, answer)) = self.ev.resolved.remove(&scope) {
                        let opened = self.streams.len();
                        self.ev
                            .resolved_before
                            .entry(scope.clone())
                            .or_default()
                            .push((opened, answer));
                    }
                    if let crate::state_api::Grant::New {
                        elsewhere: Some(_), ..
                    } = how
                    {
                        // The record it could not find is as good as gone from here on.
                        self.ev.record_ended(&scope, freed.clone());
                    }
                    if let crate::state_api::Grant::RetentionReuse { from, .. } = how {
                        // The reused record ended here.
                        let mut end = freed.clone();
                        end.how = end.how.replace("as a new key past its retention: ", "");
                        end.from = Some(from);
                        self.ev.record_ended(&scope, end);
                    }
                    if !freed.legit || freed.from.is_some() {
                        self.log(format!(
                            "state API: token {token} for {scope:?} granted {}",
                            freed.how
                        ));
                    }
                    if let crate::state_api::Grant::RetentionReuse { .. } = how {
                        self.reach("region: a record reused past its retention");
                    }
                    if let Some((_, rec)) = self.api.find(&scope) {
                        self.ev.retention_of.insert(token, rec.retention_ms);
                    }
                    let secret = self.api.find(&scope).map_or(self.api.secret, |(a, _)| a.0);
                    self.ev.secret_of.insert(token, secret);
                    self.ev.freed.insert(token, freed);
                    self.ev.granted_at.insert(token, self.now);
                    self.ev.last_sign.insert(token, self.now);
                    let Some(c) = c else { continue };
                    self.ev.granted_to.insert(token, (c.worker, c.generation));
                    let alive = self.workers[c.worker].w.is_some()
                        && self.workers[c.worker].generation == c.generation;
                    if !alive {
                        // Nobody will ever hear of this grant (invariant 8 leaves it out).
                        self.ev.grant_died.insert(scope);
                    }
                }
                Event::Lapsed {
                    token,
                    scope,
                    lease_ms,
                    by,
                } => {
                    self.reach("region: a lease found run out");
                    let found = self.invariants.lapse(self, token, &scope, lease_ms, by);
                    self.found(found);
                }
                Event::OwnerMarked { token, .. } => {
                    let seq = self.next_seq();
                    self.ev.owner_marks.insert(token, seq);
                    self.ev.last_sign.insert(token, self.now);
                }
                Event::HeartbeatAccepted { token, revived } => {
                    self.ev.last_sign.insert(token, self.now);
                    if let (true, Some(c)) = (revived, c) {
                        self.log(format!(
                            "state API: a heartbeat of token {token} from worker {} (sent at {}) makes its unknown record in progress again",
                            c.worker, c.sent_at
                        ));
                        let found = self.invariants.heartbeat_after_mark(self, token, c.seq);
                        self.found(found);
                    }
                }
                Event::HeartbeatOnMarked { .. } => {
                    self.reach(
                        "region: a heartbeat reached a record its owner's token marked unknown",
                    );
                }
                Event::Completed { token } => {
                    self.ev.last_sign.insert(token, self.now);
                }
                Event::Deleted {
                    token,
                    scope,
                    by,
                    state,
                } => {
                    let end = evidence::judge_deletion(self, token, by, state);
                    self.ev.record_ended(&scope, end);
                }
            }
        }
    }

    /// The state API's purge ran: what it deleted, for the invariants.
    pub(super) fn after_purge(&mut self) {
        self.after_api(None);
    }

    /// An operator releases or purges (without force) a record whose outcome is unknown, as
    /// one would after a client's `409 outcome-unknown`.
    pub(super) fn operator_action(&mut self) {
        let clock = self.api.clock(self.now);
        let candidates: Vec<Scope> = self
            .api
            .records
            .iter()
            .filter(|(a, r)| {
                (r.state == state_rules::RecordState::Unknown
                    || (r.state == state_rules::RecordState::InProgress
                        && r.lease_until <= clock.now))
                    // (The admin API finds a record where `scope_of` looks.)
                    && self.api.lookup(&a.1) == **a
            })
            .map(|((_, s), _)| s.clone())
            .collect();
        if candidates.is_empty() {
            return;
        }
        let scope = self.c.pick(&candidates).clone();
        let open = self.api.find(&scope).is_some_and(|(_, r)| r.open());
        // (A resolve is drawn only after a purge was, so that earlier seeds keep their
        // schedules.)
        let action = if self.c.chance(50) {
            state_rules::operator::Action::Release
        } else if open && self.c.chance(50) {
            state_rules::operator::Action::Resolve
        } else {
            state_rules::operator::Action::Purge
        };
        let resolved = (action == state_rules::operator::Action::Resolve).then(|| {
            contract::wire::StoredResponse::new(
                200,
                vec![("content-type".into(), "application/json".into())],
                br#"{"resolved_by":"operator"}"#,
                true,
            )
        });
        // Whether its owner was heard from within a lease (then a careful state API refuses
        // without force: the region is visited either way).
        if let Some((_, rec)) = self.api.find(&scope) {
            let silent = self
                .now
                .saturating_sub(self.ev.last_sign.get(&rec.token).copied().unwrap_or(0));
            if silent < rec.lease_ms {
                self.reach(
                    "region: an operator acted within a lease of the owner's last sign of life",
                );
            }
        }
        match self
            .api
            .operator(&scope, action, resolved.clone(), self.now)
        {
            Ok(rec) if action == state_rules::operator::Action::Resolve => {
                if let Some(r) = resolved {
                    let answer = crate::upstream::Produced {
                        status: r.status,
                        headers: r.headers,
                        body: r.body,
                    };
                    self.ev
                        .resolved
                        .insert(scope.clone(), (self.streams.len(), answer));
                }
                self.ev.operator_scopes.insert(scope.clone());
                self.reach("region: an operator resolved an open record");
                self.log(format!(
                    "an operator resolves {scope:?} (token {}, {:?}): replays are its answer from now on",
                    rec.token, rec.state
                ));
            }
            Ok(rec) => {
                // Silence counts only while the database served: an owner cut off by an
                // outage could not be heard (the lease guard).
                let heard = self
                    .ev
                    .last_sign
                    .get(&rec.token)
                    .copied()
                    .unwrap_or(0)
                    .max(clock.serving_since);
                let silent = self.now.saturating_sub(heard);
                // A record with an outcome is the operator's to delete at any time.
                let silent = if rec.open() { silent } else { u64::MAX };
                self.ev
                    .operator_silent
                    .insert(rec.token, (silent, rec.lease_ms));
                self.ev.operator_scopes.insert(scope.clone());
                self.reach("region: an operator released or purged a record");
                self.log(format!(
                    "an operator {:?}s {scope:?} (token {}, {:?}, its owner last heard of {silent} ms ago)",
                    action, rec.token, rec.state
                ));
            }
            Err(why) => {
                if why.is_some() {
                    self.reach("region: an operator was refused without force");
                }
                self.log(format!(
                    "an operator's {action:?} of {scope:?} is refused ({why:?})"
                ));
            }
        }
        self.after_api(None);
    }

    /// A claim that asked to wait and found its key in progress waits (`None`), within the
    /// state API's bound of waiters; once parked, the answer that ends its wait says how long
    /// it waited (as `http.rs` does).
    pub(super) fn waited(&mut self, i: usize, status: u16, body: Vec<u8>) -> Option<CalloutResult> {
        use contract::wire::{ClaimRequest, ClaimResponse};
        let c = &self.callouts[i];
        let wait_ms = (c.path == CLAIM_PATH && status == 200)
            .then(|| serde_json::from_slice::<ClaimRequest>(&c.body).ok())
            .flatten()
            .and_then(|r| r.wait_ms)
            .map_or(0, |w| w.min(self.setup.state_api.max_wait_ms));
        let answer = ClaimResponse::read(&body).ok();
        let running = matches!(answer, Some(ClaimResponse::InProgress { .. }));
        let parked = c.parked;
        let waiters = self
            .callouts
            .iter()
            .filter(|c| c.parked.is_some() && !c.orphan)
            .count();
        let waited_ms = match parked {
            None if wait_ms > 0 && running && waiters < self.setup.state_api.max_waiters => {
                self.reach("sim.claim_waits");
                self.log(format!(
                    "state API {CLAIM_PATH} from worker {}: in progress, waits up to {wait_ms} ms",
                    self.callouts[i].worker
                ));
                self.callouts[i].parked = Some(Parked {
                    since: self.now,
                    until: self.now + wait_ms,
                });
                return None;
            }
            None => return Some(CalloutResult::answer(status, body)),
            Some(p) if running && self.now < p.until => return None,
            Some(p) => self.now - p.since,
        };
        self.callouts[i].parked = None;
        let answer = match answer {
            Some(ClaimResponse::InProgress {
                retry_after_s,
                lease_remaining_ms,
                ..
            }) => {
                self.reach("sim.wait_timed_out");
                ClaimResponse::InProgress {
                    retry_after_s,
                    lease_remaining_ms,
                    waited_ms: Some(waited_ms),
                }
            }
            Some(ClaimResponse::Completed {
                response,
                expires_in_ms,
                ..
            }) => {
                self.reach("sim.wait_settled");
                ClaimResponse::Completed {
                    response,
                    expires_in_ms,
                    waited_ms: Some(waited_ms),
                }
            }
            Some(other) => {
                self.reach("sim.wait_settled");
                other
            }
            None => return Some(CalloutResult::answer(status, body)),
        };
        Some(CalloutResult::answer(
            status,
            serde_json::to_vec(&answer).unwrap_or_default(),
        ))
    }

    /// Whether processing callout `i` now would answer it (a parked claim waits on while its
    /// key runs and its wait lasts).
    pub(super) fn answerable(&self, i: usize) -> bool {
        let c = &self.callouts[i];
        if self.outage == Outage::Paused && c.cluster != UPSTREAM_CLUSTER {
            return false;
        }
        let Some(p) = c.parked else { return true };
        if self.now >= p.until || self.outage != Outage::None {
            return true;
        }
        serde_json::from_slice::<contract::wire::ClaimRequest>(&c.body)
            .map(|r| !self.api.running(&(r.key, r.subject, r.endpoint), self.now))
            .unwrap_or(true)
    }

    /// The first callout the state API has to handle and can answer now.
    pub(super) fn ready_callout(&self) -> Option<usize> {
        (0..self.callouts.len()).find(|&i| self.callouts[i].answer.is_none() && self.answerable(i))
    }

    /// The key secret rotates: new records under the new one, the previous one still looked up.
    pub(super) fn rotate_secret(&mut self) {
        self.api.rotate_secret();
        self.rotated_at = Some(self.now);
        self.reach("region: the key secret rotated");
        self.log(format!(
            "the key secret rotates: new records under secret {}, records under secret {} still looked up",
            self.api.secret,
            self.api.secret - 1
        ));
    }

    /// The previous key secret is dropped: records under it are no longer found.
    pub(super) fn drop_previous_secret(&mut self) {
        self.api.drop_previous_secret();
        self.reach("region: the previous key secret dropped");
        self.log("the previous key secret is dropped: records under it are no longer found".into());
    }

    /// The state API's purge runs: expired records deleted, lapsed ones marked unknown.
    pub(super) fn purge(&mut self) {
        let (deleted, marked) = self.api.purge(self.now);
        if deleted > 0 {
            self.reach("region: the purge deleted records");
        }
        if deleted + marked > 0 {
            self.log(format!(
                "the state API's purge deletes {deleted} expired records and marks {marked} unknown"
            ));
        }
        self.after_purge();
    }
}
