//! A model of the state API: its HTTP layer restated (`state-api/src/http.rs`: validation and
//! limits, the record's address during a rotation of the key secret, the answers' shapes), and
//! its record rules not restated but called: every claim, heartbeat, complete, unknown mark,
//! release, purge and operator action is the function of `state-rules` that the store carries
//! out in SQL. Time is the database clock: the simulation's global time, with the database's
//! `serving_since` (moved by a restart, not by a crash recovery in place).
//!
//! What happens to records is also told as [`Event`]s, for the invariants and their
//! explanations (why a token was granted, who deleted a record, whose lease ran out).

use contract::wire::{
    valid_nonce, AbandonRequest, BatchItem, BatchResponse, ClaimBatchRequest, ClaimRequest,
    ClaimResponse, CompleteBatchRequest, CompleteRequest, HeartbeatRequest, HeartbeatResponse,
    OnUnknown, ReleaseRequest, StoredResponse, UnknownRequest, WriteBatchRequest, WriteResponse,
    WriteState, ABANDON_PATH, CLAIMS_PATH, CLAIM_PATH, COMPLETES_PATH, COMPLETE_PATH,
    HEARTBEAT_PATH, MAX_BATCH_CLAIMS, RELEASE_PATH, UNKNOWN_PATH, WRITES_PATH,
};
use contract::{validate_key, Problem, ProblemKind};
use state_rules::fingerprint::Keyed;
use state_rules::operator::{self, Refusal};
use state_rules::purge::Purge;
use state_rules::rotation;
use state_rules::writes::{self, Abandoned, Beat, Completion, Marked};
use state_rules::{ClaimOutcome, ClaimTerms, Clock, Fingerprint, RecordState};
use std::collections::{BTreeMap, BTreeSet};

use contract::limits::{MAX_FIELD_LEN, MAX_HEADERS, MAX_HEADER_VALUE_LEN};
pub use contract::limits::{MAX_LEASE_MS, MIN_LEASE_MS};

/// (key, subject, endpoint).
pub type Scope = (String, String, String);

/// Where a record lives: the key secret its address was made with (secrets are numbered from
/// 0, one more at each rotation) and its scope (the address is their HMAC).
pub type Address = (u32, Scope);

/// A record, its stored response in clear.
pub type Record = state_rules::Record<StoredResponse>;

#[derive(Debug, Clone)]
pub struct StateApiConfig {
    pub default_lease_ms: u64,
    /// The longest lease granted ([`MAX_LEASE_MS`]; less to model a state API that grants
    /// shorter leases than asked).
    pub max_lease_ms: u64,
    /// `--retention-s` (a claim that asks for none) and `--max-retention-s`, in ms.
    pub retention_ms: u64,
    pub max_retention_ms: u64,
    pub max_body_bytes: usize,
    /// Whether claim answers say `max_body_bytes` (state APIs older than the field do not).
    pub advertises_max_body: bool,
    pub retry_after_cap_s: u64,
    /// Claims that may wait for a running key at once (`--max-waiters`); more are answered
    /// at once.
    pub max_waiters: usize,
    /// The longest a claim waits (`--max-wait-ms`).
    pub max_wait_ms: u64,
}

/// How a claim came to own a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// No record at its address. `elsewhere`: the key secret and token of a record of the
    /// same scope under another key secret.
    New {
        secret: u32,
        elsewhere: Option<(u32, i64)>,
    },
    /// Took over an unknown outcome (or a lease run out) of `from`, as the claim asked.
    Reclaimed { from: i64 },
    /// Reused a record past its retention as a new key; `was_in_progress`: its outcome was
    /// never stored.
    RetentionReuse { from: i64, was_in_progress: bool },
}

/// Who deleted a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleter {
    /// Its owner released it (nothing was forwarded).
    Owner,
    /// Its claim's answer never reached the filter, which gave it back by the claim's nonce
    /// (nothing was forwarded).
    Abandon,
    /// The state API itself: its claim was answered to a caller already gone.
    GoneCaller,
    /// The purge (past its retention).
    Purge,
    /// An operator's release or purge (the admin API), without `force`.
    OperatorRelease,
    OperatorPurge,
}

impl Deleter {
    pub fn describe(self) -> &'static str {
        match self {
            Deleter::Owner => "its owner's release",
            Deleter::Abandon => "its owner's abandon (the claim's answer never reached it)",
            Deleter::GoneCaller => "the state API's release for a caller already gone",
            Deleter::Purge => "the purge (past its retention)",
            Deleter::OperatorRelease => "an operator's release (without force)",
            Deleter::OperatorPurge => "an operator's purge (without force)",
        }
    }
}

/// What happened to a record, as the invariants need to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Granted {
        token: i64,
        scope: Scope,
        how: Grant,
    },
    /// A claim (or the purge) found the lease of `token` run out: its outcome is unknown now,
    /// and its owner, if alive, has lost the key.
    Lapsed {
        token: i64,
        scope: Scope,
        lease_ms: u64,
        /// What found it: a claim that held it, took it over, reused it, or the purge.
        by: &'static str,
    },
    /// The owner of `token` said its outcome is unknown (`/v1/unknown`, or a release of a
    /// record taken over from an unknown outcome): a mark no older heartbeat may undo.
    OwnerMarked { token: i64, scope: Scope },
    /// A heartbeat of `token` was accepted; `revived`: the record was unknown before.
    HeartbeatAccepted { token: i64, revived: bool },
    /// A heartbeat of `token` reached its record marked unknown under that token.
    HeartbeatOnMarked { token: i64 },
    /// The owner of `token` stored its outcome.
    Completed { token: i64 },
    Deleted {
        token: i64,
        scope: Scope,
        by: Deleter,
        /// The record's state then.
        state: RecordState,
    },
}

/// The model, and every token it handed out (for the invariants).
#[derive(Debug, Clone)]
pub struct ModelStateApi {
    pub cfg: StateApiConfig,
    pub records: BTreeMap<Address, Record>,
    next_token: i64,
    /// Since when the database has served without interruption (`idempotency_serving_since()`):
    /// a restart moves it, a crash recovery in place does not.
    pub serving_since: u64,
    /// The key secret addresses are made with now, and the previous one while records under it
    /// are still looked up (a rotation).
    pub secret: u32,
    pub previous_secret: Option<u32>,
    /// Tokens handed out, with their scope.
    pub issued: BTreeMap<i64, Scope>,
    /// Tokens handed out by taking over an unknown outcome (a re-execution may follow on a
    /// route that chose so).
    pub took_over_unknown: BTreeMap<i64, Scope>,
    /// How each token was granted.
    pub grants: BTreeMap<i64, Grant>,
    /// Claim attempts abandoned before they got here (by nonce, whatever the key's address),
    /// and when: such a claim never commits (kept ten minutes).
    tombstones: BTreeMap<String, u64>,
    /// Every fingerprint a record was stored with, by scope.
    pub stored_fingerprints: BTreeSet<(Scope, String)>,
    /// What happened since the caller last took them ([`ModelStateApi::take_events`]).
    events: Vec<Event>,
}

/// The fingerprint key the state API derives from key secret `secret` (HKDF in the store).
fn fingerprint_key(secret: u32) -> Vec<u8> {
    format!("fingerprint key of secret {secret}").into_bytes()
}

/// How long the tombstone of an abandoned claim attempt is kept (the purge's 10 minutes).
const TOMBSTONE_MS: u64 = 600_000;

/// An answer: HTTP status and JSON body.
pub type Answer = (u16, Vec<u8>);

fn json<T: serde::Serialize>(status: u16, v: &T) -> Answer {
    (status, serde_json::to_vec(v).unwrap_or_default())
}

fn problem(kind: ProblemKind, detail: &str) -> Answer {
    (kind.status(), Problem::new(kind, detail).to_json())
}

fn fenced() -> Answer {
    problem(ProblemKind::FencedOut, "fenced out")
}

/// A batch's answer: each single answer's status and document, in order.
fn batch(answers: Vec<Answer>) -> Answer {
    let answers = answers
        .into_iter()
        .map(|(status, body)| BatchItem {
            status,
            answer: serde_json::from_slice(&body).unwrap_or_default(),
        })
        .collect();
    json(200, &BatchResponse { answers })
}

fn check_text(v: &str) -> bool {
    !v.is_empty() && v.len() <= MAX_FIELD_LEN && !v.chars().any(char::is_control)
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The scope a call names, validated as `scope_of` does.
fn scope(key: &str, subject: &str, endpoint: &str) -> Result<Scope, Answer> {
    if let Err(e) = validate_key(key) {
        return Err(problem(ProblemKind::InvalidKey, &e.to_string()));
    }
    if !check_text(subject) || !check_text(endpoint) {
        return Err(problem(ProblemKind::BadRequest, "bad subject or endpoint"));
    }
    Ok((key.to_owned(), subject.to_owned(), endpoint.to_owned()))
}

/// The scopes a call names, in the order of its items (a batch's claims, then its completes);
/// empty when it cannot be read.
pub fn scopes_of(path: &str, body: &[u8]) -> Vec<Scope> {
    /// What every call names its record by.
    #[derive(serde::Deserialize)]
    struct Named {
        key: String,
        subject: String,
        endpoint: String,
    }
    #[derive(serde::Deserialize)]
    struct Batch {
        #[serde(default)]
        claims: Vec<Named>,
        #[serde(default)]
        completes: Vec<Named>,
    }
    let scope = |n: Named| (n.key, n.subject, n.endpoint);
    match path {
        CLAIMS_PATH | COMPLETES_PATH | WRITES_PATH => serde_json::from_slice::<Batch>(body)
            .map(|b| b.claims.into_iter().chain(b.completes).map(scope).collect())
            .unwrap_or_default(),
        CLAIM_PATH | HEARTBEAT_PATH | COMPLETE_PATH | RELEASE_PATH | UNKNOWN_PATH
        | ABANDON_PATH => serde_json::from_slice::<Named>(body)
            .map(|n| vec![scope(n)])
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// The addresses a call's scopes were looked up at, handed out in order.
struct Looked<'a> {
    given: Option<&'a [Address]>,
    at: usize,
}

impl ModelStateApi {
    pub fn new(cfg: StateApiConfig) -> Self {
        Self {
            cfg,
            records: BTreeMap::new(),
            next_token: 0,
            serving_since: 0,
            secret: 0,
            previous_secret: None,
            issued: BTreeMap::new(),
            took_over_unknown: BTreeMap::new(),
            grants: BTreeMap::new(),
            tombstones: BTreeMap::new(),
            stored_fingerprints: BTreeSet::new(),
            events: Vec::new(),
        }
    }

    /// What happened since the last call.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    pub fn clock(&self, now: u64) -> Clock {
        Clock {
            now,
            serving_since: self.serving_since,
        }
    }

    /// The address of a scope's record as `scope_of` finds it now: during a rotation, under the
    /// previous secret when a record lives there, else under the current one.
    pub fn lookup(&self, scope: &Scope) -> Address {
        if let Some(previous) = self.previous_secret {
            let old = (previous, scope.clone());
            if self.records.contains_key(&old) {
                return old;
            }
        }
        (self.secret, scope.clone())
    }

    /// Where a claim reads the record of `scope` (`state_rules::rotation::claim_reads`): at
    /// its current address, else at its previous one; none: it inserts at the current one.
    fn claim_address(&self, scope: &Scope) -> Address {
        let current = (self.secret, scope.clone());
        let previous = self.previous_secret.map(|p| (p, scope.clone()));
        let at_previous = previous
            .as_ref()
            .is_some_and(|p| self.records.contains_key(p));
        match rotation::claim_reads(self.records.contains_key(&current), at_previous) {
            Some(rotation::Address::Previous) => previous.unwrap_or(current),
            _ => current,
        }
    }

    /// Puts a record back after a write at `at`: one found under the previous secret and
    /// written again moves to the current address, unless a record is there
    /// (`state_rules::rotation::written_to`). Returns where it is.
    fn put_back(&mut self, at: Address, slot: Option<Record>, written: bool) -> Address {
        let Some(rec) = slot else {
            return at;
        };
        let current = (self.secret, at.1.clone());
        let from = if at.0 == self.secret {
            rotation::Address::Current
        } else {
            rotation::Address::Previous
        };
        let to = if written {
            rotation::written_to(from, self.records.contains_key(&current))
        } else {
            from
        };
        let address = match to {
            rotation::Address::Current => current,
            rotation::Address::Previous => at,
        };
        self.records.insert(address.clone(), rec);
        address
    }

    /// The record of `scope` wherever it lives (under either secret), with its address.
    pub fn find(&self, scope: &Scope) -> Option<(Address, &Record)> {
        self.records
            .iter()
            .rev()
            .find(|((_, s), _)| s == scope)
            .map(|(a, r)| (a.clone(), r))
    }

    /// A write's scope, validated, and the address it was looked up at (`scope_of`).
    fn located(
        &self,
        key: &str,
        subject: &str,
        endpoint: &str,
        looked: &mut Looked<'_>,
    ) -> Result<(Scope, Address), Answer> {
        let scope = scope(key, subject, endpoint)?;
        let address = self.address(&scope, looked);
        Ok((scope, address))
    }

    fn address(&self, scope: &Scope, looked: &mut Looked<'_>) -> Address {
        let given = looked.given.and_then(|g| g.get(looked.at)).cloned();
        looked.at += 1;
        match given {
            Some(a) if a.1 == *scope => a,
            _ => self.lookup(scope),
        }
    }

    fn token(&mut self, scope: &Scope) -> i64 {
        self.next_token += 1;
        self.issued.insert(self.next_token, scope.clone());
        self.next_token
    }

    fn advertised_max_body(&self) -> Option<u64> {
        self.cfg
            .advertises_max_body
            .then_some(self.cfg.max_body_bytes as u64)
    }

    fn lease_for(&self, requested: Option<u64>) -> u64 {
        requested
            .unwrap_or(self.cfg.default_lease_ms)
            .clamp(MIN_LEASE_MS, self.cfg.max_lease_ms.max(MIN_LEASE_MS))
    }

    /// `retention_for`: what the claim asks, within the maximum; the default otherwise.
    fn retention_for(&self, requested_s: Option<u64>) -> u64 {
        match requested_s {
            Some(r) => r
                .saturating_mul(1000)
                .clamp(1000, self.cfg.max_retention_ms.max(1000)),
            None => self.cfg.retention_ms,
        }
    }

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
            take_over_unknown: r.on_unknown == OnUnknown::TakeOver,
            nonce: r.nonce.clone(),
            abandoned: r
                .nonce
                .as_ref()
                .is_some_and(|n| self.tombstones.contains_key(n)),
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

    fn delete_noted(
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

    /// A claim granted `token` to a caller that was gone when it was answered: the state API
    /// releases it at once (as a release by its owner would). Whether it did.
    pub fn release_for_gone_caller(&mut self, token: i64, now: u64) -> bool {
        let Some(scope) = self.issued.get(&token).cloned() else {
            return false;
        };
        let Some((address, _)) = self.find(&scope).filter(|(_, r)| r.token == token) else {
            return false;
        };
        let clock = self.clock(now);
        let mut slot = self.records.remove(&address);
        let state = slot.as_ref().map(|s| s.state);
        let released = writes::release(&mut slot, token, clock);
        match slot {
            Some(rec) => {
                self.put_back(address, Some(rec), released);
            }
            None if released => self.delete_noted(address, token, Deleter::GoneCaller, state),
            None => {}
        }
        released
    }

    /// The purge's pass: every record past its expiry with an outcome is deleted, and one in
    /// progress whose owner is silent (the lease guard) is marked unknown. Returns how many it
    /// deleted and marked.
    pub fn purge(&mut self, now: u64) -> (usize, usize) {
        let clock = self.clock(now);
        // Tombstones outlive any claim that could still arrive by minutes.
        self.tombstones
            .retain(|_, at| at.saturating_add(TOMBSTONE_MS) >= now);
        let addresses: Vec<Address> = self.records.keys().cloned().collect();
        let (mut deleted, mut marked) = (0, 0);
        for a in addresses {
            let mut slot = self.records.remove(&a);
            let before = slot.clone();
            let done = state_rules::purge::apply(&mut slot, clock);
            if let Some(rec) = slot {
                self.records.insert(a.clone(), rec);
            }
            let Some(r) = before else { continue };
            match done {
                Purge::Keep => {}
                Purge::MarkUnknown => {
                    marked += 1;
                    self.events.push(Event::Lapsed {
                        token: r.token,
                        scope: a.1.clone(),
                        lease_ms: r.lease_ms,
                        by: "found by the purge, which marked it unknown",
                    });
                }
                Purge::Delete => {
                    deleted += 1;
                    if r.state == RecordState::InProgress {
                        self.events.push(Event::Lapsed {
                            token: r.token,
                            scope: a.1.clone(),
                            lease_ms: r.lease_ms,
                            by: "found by the purge, which deleted the expired record",
                        });
                    }
                    self.delete_noted(a, r.token, Deleter::Purge, Some(r.state));
                }
            }
        }
        (deleted, marked)
    }

    /// An operator's release or purge of the record of `scope` through the admin API, without
    /// `force`: `Ok` with the record as it was, or why it was refused (`None`: no record).
    pub fn operator(
        &mut self,
        scope: &Scope,
        action: operator::Action,
        now: u64,
    ) -> Result<Record, Option<Refusal>> {
        let address = self.lookup(scope);
        let clock = self.clock(now);
        let Some(rec) = self.records.get(&address) else {
            return Err(None);
        };
        operator::allowed(rec, action, false, clock).map_err(Some)?;
        let rec = self.records.remove(&address).ok_or(None)?;
        if action != operator::Action::Resolve {
            let by = if action == operator::Action::Release {
                Deleter::OperatorRelease
            } else {
                Deleter::OperatorPurge
            };
            self.delete_noted(address, rec.token, by, Some(rec.state));
        }
        Ok(rec)
    }

    /// Rotates the key secret: new records are addressed with a new one, records under the
    /// current one are looked up as the previous one's (a third rotation drops the oldest).
    pub fn rotate_secret(&mut self) {
        self.previous_secret = Some(self.secret);
        self.secret += 1;
    }

    /// Drops the previous secret ("once the longest retention has passed"): records under it
    /// are no longer found.
    pub fn drop_previous_secret(&mut self) {
        self.previous_secret = None;
    }

    /// Whether the record of `scope` is held by a live lease as of `now` (a claim finds it in
    /// progress).
    pub fn running(&self, scope: &Scope, now: u64) -> bool {
        let address = self.lookup(scope);
        self.records.get(&address).is_some_and(|r| {
            r.state == RecordState::InProgress
                && !r.lease_expired(self.clock(now))
                && !r.retention_expired(self.clock(now))
        })
    }

    /// Whether the record of `scope` has an unknown outcome as of `now` (marked so, or a lease
    /// that ran out).
    pub fn outcome_unknown(&self, scope: &Scope, now: u64) -> bool {
        let address = self.lookup(scope);
        match self.records.get(&address) {
            Some(r) if r.state == RecordState::Unknown => true,
            Some(r) => r.lease_expired(self.clock(now)),
            None => false,
        }
    }
}
