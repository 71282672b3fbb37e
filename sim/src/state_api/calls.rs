//! The filter's calls, each path routed to its handler (a batch item by item), each handler the
//! function of `state-rules` the store carries out in SQL: a claim (and what it tells the
//! invariants), a heartbeat, a complete, a release, an abandon, an unknown mark.

use contract::wire::{
    valid_nonce, AbandonRequest, ClaimBatchRequest, ClaimRequest, ClaimResponse,
    CompleteBatchRequest, CompleteRequest, HeartbeatRequest, HeartbeatResponse, OnUnknown,
    ReleaseRequest, StoredResponse, UnknownRequest, WriteBatchRequest, WriteResponse, WriteState,
    ABANDON_PATH, CLAIMS_PATH, CLAIM_PATH, COMPLETES_PATH, COMPLETE_PATH, HEARTBEAT_PATH,
    MAX_BATCH_CLAIMS, RELEASE_PATH, UNKNOWN_PATH, WRITES_PATH,
};
use contract::ProblemKind;
use state_rules::fingerprint::Keyed;
use state_rules::writes::{self, Abandoned, Beat, Completion, Marked};
use state_rules::{ClaimOutcome, ClaimTerms, Clock, Fingerprint, RecordState};

use super::http::{batch, fenced, is_tchar, json, problem, scope};
use super::{
    fingerprint_key, Address, Answer, Deleter, Event, Grant, Looked, ModelStateApi, Record,
};
use contract::limits::{MAX_HEADERS, MAX_HEADER_VALUE_LEN};

impl ModelStateApi {
    /// Handles one call at time `now` (the state API and its database are up). `looked_up`:
    /// the addresses its scopes were looked up at in an earlier step (`scope_of` runs before
    /// the statement, and other calls may run in between); looked up now when absent.
    pub fn handle(
        &mut self,
        path: &str,
        body: &[u8],
        now: u64,
        looked_up: Option<&[Address]>,
    ) -> Answer {
        let mut looked = Looked {
            given: looked_up,
            at: 0,
        };
        let l = &mut looked;
        match path {
            CLAIM_PATH => match serde_json::from_slice::<ClaimRequest>(body) {
                Ok(r) => self.claim(r, now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            // Batches: each item as its single call would answer it, one after the other,
            // claims first (the real one runs them together; for two requests of one scope
            // this is one of its orders, and a scope's second request in one call comes after
            // the first there too).
            CLAIMS_PATH => match serde_json::from_slice::<ClaimBatchRequest>(body) {
                Ok(b) if b.claims.is_empty() => problem(ProblemKind::BadRequest, "no claims"),
                Ok(b) => self.batch(b.claims, Vec::new(), now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            COMPLETES_PATH => match serde_json::from_slice::<CompleteBatchRequest>(body) {
                Ok(b) if b.completes.is_empty() => problem(ProblemKind::BadRequest, "no completes"),
                Ok(b) => self.batch(Vec::new(), b.completes, now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            WRITES_PATH => match serde_json::from_slice::<WriteBatchRequest>(body) {
                Ok(b) if b.claims.is_empty() && b.completes.is_empty() => {
                    problem(ProblemKind::BadRequest, "no writes")
                }
                Ok(b) => self.batch(b.claims, b.completes, now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            HEARTBEAT_PATH => match serde_json::from_slice::<HeartbeatRequest>(body) {
                Ok(r) => self.heartbeat(r, now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            COMPLETE_PATH => match serde_json::from_slice::<CompleteRequest>(body) {
                Ok(r) => self.complete(r, now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            RELEASE_PATH => match serde_json::from_slice::<ReleaseRequest>(body) {
                Ok(r) => self.release(r, now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            UNKNOWN_PATH => match serde_json::from_slice::<UnknownRequest>(body) {
                Ok(r) => self.owner_unknown(r, now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            ABANDON_PATH => match serde_json::from_slice::<AbandonRequest>(body) {
                Ok(r) => self.abandon(r, now, l),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            _ => problem(ProblemKind::NotFound, "no such route"),
        }
    }

    /// A batch's claims and completes (at most 128 of each, no waiting claim).
    fn batch(
        &mut self,
        claims: Vec<ClaimRequest>,
        completes: Vec<CompleteRequest>,
        now: u64,
        looked: &mut Looked<'_>,
    ) -> Answer {
        if claims.len() > MAX_BATCH_CLAIMS || completes.len() > MAX_BATCH_CLAIMS {
            return problem(ProblemKind::BadRequest, "1 to 128 of each");
        }
        if claims.iter().any(|c| c.wait_ms.is_some_and(|w| w > 0)) {
            return problem(ProblemKind::BadRequest, "wait_ms in a batch");
        }
        let mut answers: Vec<Answer> = claims
            .into_iter()
            .map(|r| self.claim(r, now, looked))
            .collect();
        answers.extend(completes.into_iter().map(|r| self.complete(r, now, looked)));
        batch(answers)
    }

    fn claim(&mut self, r: ClaimRequest, now: u64, looked: &mut Looked<'_>) -> Answer {
        let scope = match scope(&r.key, &r.subject, &r.endpoint) {
            Ok(s) => s,
            Err(a) => return a,
        };
        // The claim reads the key's record at its current address, else at its previous one,
        // in the same statement as its insert (which goes to the current address only).
        looked.at += 1;
        let address = self.claim_address(&scope);
        if r.nonce.as_deref().is_some_and(|n| !valid_nonce(n)) {
            return problem(ProblemKind::BadRequest, "bad nonce");
        }
        let hex = r.fingerprint.len() == 64
            && r.fingerprint
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !hex || r.fingerprint_alg.is_empty() || r.fingerprint_alg.len() > 64 {
            return problem(ProblemKind::BadRequest, "bad fingerprint");
        }
        let retention_ms = self.retention_for(r.retention_s);
        // Stored keyed (an HMAC under a key derived from the key secret, with its id), matched
        // under the current key or the previous one (`state_rules::fingerprint`).
        let keyed = Keyed::new(
            &r.fingerprint_alg,
            &r.fingerprint,
            &fingerprint_key(self.secret),
            self.previous_secret.map(fingerprint_key).as_deref(),
        );
        let fingerprint = Fingerprint {
            alg: format!("{}#{}", r.fingerprint_alg, keyed.key_id),
            value: keyed.stored.clone(),
        };
        let terms = ClaimTerms {
            fingerprint: fingerprint.clone(),
            lease_ms: self.lease_for(r.lease_ms),
            retention_ms,
            unknown_retention_ms: self.cfg.unknown_retention_ms,
            take_over_unknown: r.on_unknown == OnUnknown::TakeOver,
            nonce: r.nonce.clone(),
            abandoned: self.abandoned_at_commit(r.nonce.as_deref()),
        };
        let clock = self.clock(now);
        let mut slot = self.records.remove(&address);
        if let Some(rec) = slot.as_mut() {
            // A match under another key (the previous one, or none: a plain one from before)
            // re-keys the record.
            let stored_under = rec
                .fingerprint
                .alg
                .rsplit_once('#')
                .and_then(|(_, id)| id.parse::<i64>().ok());
            if rec.fingerprint != fingerprint
                && keyed.matches(&rec.fingerprint.value, stored_under)
                && rec.fingerprint.alg.starts_with(&r.fingerprint_alg)
            {
                rec.fingerprint = fingerprint.clone();
            }
        }
        let before = slot.clone();
        let outcome = state_rules::claim(&mut slot, &terms, clock, &mut || self.token(&scope));
        let written = slot != before;
        let address = self.put_back(address, slot, written);
        self.note_claim(&address, before.as_ref(), &outcome, &terms, clock);
        let answer = match outcome {
            ClaimOutcome::Claimed { token, reclaimed } => {
                let mut a = ClaimResponse::claimed(token, terms.lease_ms, reclaimed);
                if let ClaimResponse::Claimed {
                    max_body_bytes,
                    retention_s,
                    ..
                } = &mut a
                {
                    *max_body_bytes = self.advertised_max_body();
                    *retention_s = Some(retention_ms / 1000);
                }
                a
            }
            ClaimOutcome::InProgress { lease_remaining_ms } => {
                let mut a = ClaimResponse::in_progress(lease_remaining_ms);
                if let ClaimResponse::InProgress { retry_after_s, .. } = &mut a {
                    let cap = u32::try_from(self.cfg.retry_after_cap_s.max(1)).unwrap_or(1);
                    *retry_after_s = (*retry_after_s).clamp(1, cap);
                }
                a
            }
            ClaimOutcome::Completed {
                response,
                expires_in_ms,
            } => ClaimResponse::completed(response, expires_in_ms),
            ClaimOutcome::Mismatch => ClaimResponse::Mismatch,
            ClaimOutcome::Unknown => ClaimResponse::Unknown,
            ClaimOutcome::Corrupt => {
                return problem(ProblemKind::Internal, "completed record without a response")
            }
            // Its filter abandoned it before it got here: nothing written, a caller gone.
            ClaimOutcome::Abandoned => {
                return problem(ProblemKind::StateUnavailable, "the claim was abandoned")
            }
        };
        json(200, &answer)
    }

    /// The events of a claim, from the record before and what it came to.
    fn note_claim(
        &mut self,
        address: &Address,
        before: Option<&Record>,
        outcome: &ClaimOutcome<StoredResponse>,
        terms: &ClaimTerms,
        clock: Clock,
    ) {
        let scope = address.1.clone();
        let lapsed =
            before.filter(|b| b.state == RecordState::InProgress && b.lease_until <= clock.now);
        match outcome {
            ClaimOutcome::Claimed { token, .. } => {
                let how = match before {
                    None => Grant::New {
                        secret: address.0,
                        // The newest record of the key under another secret, if any.
                        elsewhere: self
                            .records
                            .iter()
                            .filter(|((sec, s), _)| *s == scope && *sec != address.0)
                            .map(|((sec, _), r)| (*sec, r.token))
                            .max_by_key(|(_, token)| *token),
                    },
                    Some(b) if b.retention_expired(clock) => Grant::RetentionReuse {
                        from: b.token,
                        was_in_progress: b.state != RecordState::Completed,
                    },
                    Some(b) => Grant::Reclaimed { from: b.token },
                };
                if matches!(
                    how,
                    Grant::Reclaimed { .. }
                        | Grant::RetentionReuse {
                            was_in_progress: true,
                            ..
                        }
                ) {
                    self.took_over_unknown.insert(*token, scope.clone());
                }
                if let Some(b) = lapsed {
                    self.events.push(Event::Lapsed {
                        token: b.token,
                        scope: scope.clone(),
                        lease_ms: b.lease_ms,
                        by: match how {
                            Grant::RetentionReuse { .. } => {
                                "found by a claim that reused the expired record"
                            }
                            _ => "found by a claim that took it over",
                        },
                    });
                }
                self.grants.insert(*token, how.clone());
                self.stored_fingerprints
                    .insert((scope.clone(), terms.fingerprint.value.clone()));
                self.events.push(Event::Granted {
                    token: *token,
                    scope,
                    how,
                });
            }
            ClaimOutcome::Unknown => {
                if let Some(b) = lapsed {
                    self.events.push(Event::Lapsed {
                        token: b.token,
                        scope,
                        lease_ms: b.lease_ms,
                        by: "found by a claim that holds unknown outcomes",
                    });
                }
            }
            _ => {}
        }
    }

    fn heartbeat(&mut self, r: HeartbeatRequest, now: u64, looked: &mut Looked<'_>) -> Answer {
        let (_, address) = match self.located(&r.key, &r.subject, &r.endpoint, looked) {
            Ok(found) => found,
            Err(a) => return a,
        };
        let address = self.write_address(address, |rec| rec.token == r.token);
        let lease_ms = self.lease_for(r.lease_ms);
        let clock = self.clock(now);
        let mut slot = self.records.remove(&address);
        let was_unknown = slot
            .as_ref()
            .is_some_and(|s| s.state == RecordState::Unknown && s.token == r.token);
        let beat = writes::heartbeat(&mut slot, r.token, lease_ms, clock);
        self.put_back(address, slot, beat == Beat::Extended);
        if was_unknown {
            self.events
                .push(Event::HeartbeatOnMarked { token: r.token });
        }
        match beat {
            Beat::Extended => {
                self.events.push(Event::HeartbeatAccepted {
                    token: r.token,
                    revived: was_unknown,
                });
                json(200, &HeartbeatResponse { lease_ms })
            }
            Beat::LeaseEnded => problem(
                ProblemKind::LeaseEnded,
                "the record is marked unknown: its lease ended",
            ),
            Beat::FencedOut => fenced(),
        }
    }

    fn stored(&self, r: StoredResponse) -> Result<StoredResponse, Answer> {
        if !contract::limits::STATUS.contains(&r.status) {
            return Err(problem(ProblemKind::BadRequest, "status"));
        }
        if r.headers.len() > MAX_HEADERS {
            return Err(problem(ProblemKind::BadRequest, "too many headers"));
        }
        for (n, v) in &r.headers {
            if n.is_empty() || n.len() > 256 || !n.bytes().all(is_tchar) {
                return Err(problem(ProblemKind::BadRequest, "header name"));
            }
            if v.len() > MAX_HEADER_VALUE_LEN
                || v.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0)
            {
                return Err(problem(ProblemKind::BadRequest, "header value"));
            }
        }
        if r.body.len() > self.cfg.max_body_bytes {
            return Err(problem(ProblemKind::PayloadTooLarge, "body"));
        }
        if !r.replayable && !r.body.is_empty() {
            return Err(problem(
                ProblemKind::BadRequest,
                "not replayable with a body",
            ));
        }
        Ok(r)
    }

    fn complete(&mut self, r: CompleteRequest, now: u64, looked: &mut Looked<'_>) -> Answer {
        let (_, address) = match self.located(&r.key, &r.subject, &r.endpoint, looked) {
            Ok(found) => found,
            Err(a) => return a,
        };
        let address = self.write_address(address, |rec| rec.token == r.token);
        if r.token <= 0 {
            return problem(ProblemKind::BadRequest, "token");
        }
        let stored = match self.stored(r.response) {
            Ok(s) => s,
            Err(a) => return a,
        };
        let clock = self.clock(now);
        let mut slot = self.records.remove(&address);
        let done = writes::complete(&mut slot, r.token, stored, self.cfg.retention_ms, clock);
        self.put_back(address, slot, matches!(done, Completion::Done { .. }));
        if let Completion::Done { .. } = done {
            self.events.push(Event::Completed { token: r.token });
        }
        match done {
            Completion::Done { expires_in_ms } | Completion::AlreadyDone { expires_in_ms } => {
                json(200, &WriteResponse::completed(expires_in_ms))
            }
            Completion::FencedOut => fenced(),
        }
    }

    fn release(&mut self, r: ReleaseRequest, now: u64, looked: &mut Looked<'_>) -> Answer {
        let (scope, address) = match self.located(&r.key, &r.subject, &r.endpoint, looked) {
            Ok(found) => found,
            Err(a) => return a,
        };
        let address = self.write_address(address, |rec| rec.token == r.token);
        let clock = self.clock(now);
        let mut slot = self.records.remove(&address);
        let state = slot.as_ref().map(|s| s.state);
        let ok = writes::release(&mut slot, r.token, clock);
        match slot {
            Some(rec) => {
                if ok {
                    // Taken over from an unknown outcome: unknown again, by its owner's word.
                    self.events.push(Event::OwnerMarked {
                        token: r.token,
                        scope: scope.clone(),
                    });
                }
                self.put_back(address, Some(rec), ok);
            }
            None if ok => self.delete_noted(address, r.token, Deleter::Owner, state),
            None => {}
        }
        if ok {
            json(200, &WriteResponse::released())
        } else {
            fenced()
        }
    }

    pub(super) fn delete_noted(
        &mut self,
        address: Address,
        token: i64,
        by: Deleter,
        state: Option<RecordState>,
    ) {
        self.events.push(Event::Deleted {
            token,
            scope: address.1.clone(),
            by,
            state: state.unwrap_or(RecordState::InProgress),
        });
    }

    /// Whether a claim with `nonce` finds it abandoned. The claim and the abandon of its nonce
    /// conflict on one row per nonce (`idempotency_nonces`): the claim sees an abandon that
    /// committed before its own commit, whatever its snapshot held. (Before the fix the claim
    /// read the tombstones in the snapshot its statement took when it was sent.)
    fn abandoned_at_commit(&self, nonce: Option<&str>) -> bool {
        let now = nonce.is_some_and(|n| self.tombstones.contains_key(n));
        match self.snapshot_abandoned {
            Some(snapshot) if state_rules::undo::undone(state_rules::undo::Fix::NonceConflict) => {
                snapshot
            }
            Some(snapshot) => snapshot || now,
            None => now,
        }
    }

    /// Whether the claim in `body` names a nonce with a tombstone now.
    pub fn tombstoned(&self, body: &[u8]) -> bool {
        serde_json::from_slice::<contract::wire::ClaimRequest>(body)
            .ok()
            .and_then(|r| r.nonce)
            .is_some_and(|n| self.tombstones.contains_key(&n))
    }

    /// A claim whose answer never reached the filter, given back by its nonce (nothing was
    /// forwarded under it).
    fn abandon(&mut self, r: AbandonRequest, now: u64, looked: &mut Looked<'_>) -> Answer {
        let (_, address) = match self.located(&r.key, &r.subject, &r.endpoint, looked) {
            Ok(found) => found,
            Err(a) => return a,
        };
        if !valid_nonce(&r.nonce) {
            return problem(ProblemKind::BadRequest, "bad nonce");
        }
        let address = self.write_address(address, |rec| {
            rec.claim_nonce.as_deref() == Some(r.nonce.as_str())
        });
        let clock = self.clock(now);
        let mut slot = self.records.remove(&address);
        let before = slot.as_ref().map(|s| (s.token, s.state));
        let done = writes::abandon(&mut slot, &r.nonce, clock);
        let address = self.put_back(address, slot, done == Abandoned::Unknown);
        match (done, before) {
            (Abandoned::Deleted, Some((token, state))) => {
                self.delete_noted(address, token, Deleter::Abandon, Some(state));
                json(200, &WriteResponse::released())
            }
            (Abandoned::Unknown, _) => json(200, &WriteResponse::unknown()),
            (Abandoned::Nothing, _) => {
                // The claim may not have got here yet: it never commits when it does.
                self.tombstones.insert(r.nonce, now);
                json(200, &WriteResponse::released())
            }
            _ => json(200, &WriteResponse::released()),
        }
    }

    /// The owner lost sight of its forwarded request.
    fn owner_unknown(&mut self, r: UnknownRequest, now: u64, looked: &mut Looked<'_>) -> Answer {
        let (scope, address) = match self.located(&r.key, &r.subject, &r.endpoint, looked) {
            Ok(found) => found,
            Err(a) => return a,
        };
        let address = self.write_address(address, |rec| rec.token == r.token);
        let clock = self.clock(now);
        let mut slot = self.records.remove(&address);
        let marked = writes::owner_unknown(&mut slot, r.token, clock);
        self.put_back(address, slot, marked == Marked::Unknown);
        match marked {
            Marked::Unknown => {
                self.events.push(Event::OwnerMarked {
                    token: r.token,
                    scope,
                });
                json(200, &WriteResponse::unknown())
            }
            // Completed by this owner already: that stands.
            Marked::AlreadyCompleted => json(
                200,
                &WriteResponse {
                    state: WriteState::Completed,
                    expires_in_ms: None,
                },
            ),
            Marked::FencedOut => fenced(),
        }
    }
}
