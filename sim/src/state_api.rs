//! A model of the state API with the real one's semantics (`state-api/src/store.rs` and
//! `http.rs`): the same validation and limits, the same claim decisions (read-or-insert,
//! mismatch before state, an expired lease is an unknown outcome, held or taken over as the
//! claim asks, take-over past retention), fenced heartbeats, completes, releases and unknown
//! marks, one token sequence. Time is the database clock: the simulation's global time.

use contract::wire::{
    BatchItem, BatchResponse, ClaimBatchRequest, ClaimRequest, ClaimResponse, CompleteBatchRequest,
    CompleteRequest, HeartbeatRequest, HeartbeatResponse, OnUnknown, ReleaseRequest,
    StoredResponse, UnknownRequest, WriteBatchRequest, WriteResponse, CLAIMS_PATH, CLAIM_PATH,
    COMPLETES_PATH, COMPLETE_PATH, HEARTBEAT_PATH, MAX_BATCH_CLAIMS, RELEASE_PATH, UNKNOWN_PATH,
    WRITES_PATH,
};
use contract::{validate_key, Problem, ProblemKind};
use std::collections::BTreeMap;

use contract::limits::{MAX_FIELD_LEN, MAX_HEADERS, MAX_HEADER_VALUE_LEN};
pub use contract::limits::{MAX_LEASE_MS, MIN_LEASE_MS};

/// (key, subject, endpoint).
pub type Scope = (String, String, String);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    InProgress {
        lease_until: u64,
        lease_ms: u64,
    },
    /// Forwarded, never stored: its owner said so, or a claim found its lease run out.
    Unknown,
    Completed(StoredResponse),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub fingerprint: String,
    pub alg: String,
    pub token: i64,
    pub state: RecordState,
    pub expires_at: u64,
    /// An attempt's outcome was unknown once: a release makes it unknown again, not free.
    pub unknown_before: bool,
}

#[derive(Debug, Clone)]
pub struct StateApiConfig {
    pub default_lease_ms: u64,
    /// The longest lease granted ([`MAX_LEASE_MS`]; less to model a state API that grants
    /// shorter leases than asked).
    pub max_lease_ms: u64,
    pub retention_ms: u64,
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

/// The model, and every token it handed out (for the invariants).
#[derive(Debug, Clone)]
pub struct ModelStateApi {
    pub cfg: StateApiConfig,
    pub records: BTreeMap<Scope, Record>,
    next_token: i64,
    /// When the database last started (a lease runs out only once it has been up that long).
    pub started_at: u64,
    /// Tokens handed out, with their scope.
    pub issued: BTreeMap<i64, Scope>,
    /// Tokens handed out by taking over an unknown outcome (a re-execution may follow on a
    /// route that chose so).
    pub took_over_unknown: BTreeMap<i64, Scope>,
}

/// An answer: HTTP status and JSON body.
pub type Answer = (u16, Vec<u8>);

fn json<T: serde::Serialize>(status: u16, v: &T) -> Answer {
    (status, serde_json::to_vec(v).unwrap_or_default())
}

fn problem(kind: ProblemKind, detail: &str) -> Answer {
    (kind.status(), Problem::new(kind, detail).to_json())
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

impl ModelStateApi {
    pub fn new(cfg: StateApiConfig) -> Self {
        Self {
            cfg,
            records: BTreeMap::new(),
            next_token: 0,
            started_at: 0,
            issued: BTreeMap::new(),
            took_over_unknown: BTreeMap::new(),
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

    fn scope(key: &str, subject: &str, endpoint: &str) -> Result<Scope, Answer> {
        if let Err(e) = validate_key(key) {
            return Err(problem(ProblemKind::InvalidKey, &e.to_string()));
        }
        if !check_text(subject) || !check_text(endpoint) {
            return Err(problem(ProblemKind::BadRequest, "bad subject or endpoint"));
        }
        Ok((key.to_owned(), subject.to_owned(), endpoint.to_owned()))
    }

    /// Handles one call at time `now` (the state API and its database are up).
    pub fn handle(&mut self, path: &str, body: &[u8], now: u64) -> Answer {
        match path {
            CLAIM_PATH => match serde_json::from_slice::<ClaimRequest>(body) {
                Ok(r) => self.claim(r, now),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            CLAIMS_PATH => match serde_json::from_slice::<ClaimBatchRequest>(body) {
                Ok(b) => self.claims(b, now),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            COMPLETES_PATH => match serde_json::from_slice::<CompleteBatchRequest>(body) {
                Ok(b) => self.completes(b, now),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            WRITES_PATH => match serde_json::from_slice::<WriteBatchRequest>(body) {
                Ok(b) => self.writes(b, now),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            HEARTBEAT_PATH => match serde_json::from_slice::<HeartbeatRequest>(body) {
                Ok(r) => self.heartbeat(r, now),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            COMPLETE_PATH => match serde_json::from_slice::<CompleteRequest>(body) {
                Ok(r) => self.complete(r, now),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            RELEASE_PATH => match serde_json::from_slice::<ReleaseRequest>(body) {
                Ok(r) => self.release(r),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            UNKNOWN_PATH => match serde_json::from_slice::<UnknownRequest>(body) {
                Ok(r) => self.owner_unknown(r),
                Err(e) => problem(ProblemKind::BadRequest, &e.to_string()),
            },
            _ => problem(ProblemKind::NotFound, "no such route"),
        }
    }

    /// `/v1/claims`: each claim as `/v1/claim` would answer it, one after the other (the real
    /// one runs them together; for two claims of one scope this is one of its orders).
    fn claims(&mut self, b: ClaimBatchRequest, now: u64) -> Answer {
        if b.claims.is_empty() || b.claims.len() > MAX_BATCH_CLAIMS {
            return problem(ProblemKind::BadRequest, "claims: 1 to 128");
        }
        if b.claims.iter().any(|c| c.wait_ms.is_some_and(|w| w > 0)) {
            return problem(ProblemKind::BadRequest, "claims: wait_ms in a batch");
        }
        let answers = b.claims.into_iter().map(|r| self.claim(r, now)).collect();
        batch(answers)
    }

    /// `/v1/completes`: each complete as `/v1/complete` would store it, in order.
    fn completes(&mut self, b: CompleteBatchRequest, now: u64) -> Answer {
        if b.completes.is_empty() || b.completes.len() > MAX_BATCH_CLAIMS {
            return problem(ProblemKind::BadRequest, "completes: 1 to 128");
        }
        let answers = b
            .completes
            .into_iter()
            .map(|r| self.complete(r, now))
            .collect();
        batch(answers)
    }

    /// `/v1/writes`: its claims as `/v1/claims` answers them, then its completes in order. The
    /// real one runs them together, and a scope's second request in one call after the first:
    /// a claim of a key before a complete of the same key, as here.
    fn writes(&mut self, b: WriteBatchRequest, now: u64) -> Answer {
        let (claims, completes) = (b.claims.len(), b.completes.len());
        if claims + completes == 0 || claims > MAX_BATCH_CLAIMS || completes > MAX_BATCH_CLAIMS {
            return problem(ProblemKind::BadRequest, "writes: 1 to 128 of each");
        }
        if b.claims.iter().any(|c| c.wait_ms.is_some_and(|w| w > 0)) {
            return problem(ProblemKind::BadRequest, "claims: wait_ms in a batch");
        }
        let mut answers: Vec<Answer> = b.claims.into_iter().map(|r| self.claim(r, now)).collect();
        answers.extend(b.completes.into_iter().map(|r| self.complete(r, now)));
        batch(answers)
    }

    fn claim(&mut self, r: ClaimRequest, now: u64) -> Answer {
        let scope = match Self::scope(&r.key, &r.subject, &r.endpoint) {
            Ok(s) => s,
            Err(a) => return a,
        };
        let hex = r.fingerprint.len() == 64
            && r.fingerprint
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !hex || r.fingerprint_alg.is_empty() || r.fingerprint_alg.len() > 64 {
            return problem(ProblemKind::BadRequest, "bad fingerprint");
        }
        let lease_ms = self.lease_for(r.lease_ms);
        let retention = self.cfg.retention_ms;
        let fresh = |api: &mut Self, scope: &Scope| Record {
            fingerprint: r.fingerprint.clone(),
            alg: r.fingerprint_alg.clone(),
            token: api.token(scope),
            state: RecordState::InProgress {
                lease_until: now + lease_ms,
                lease_ms,
            },
            expires_at: now + retention,
            unknown_before: false,
        };
        let Some(rec) = self.records.get(&scope).cloned() else {
            let rec = fresh(self, &scope);
            let token = rec.token;
            self.records.insert(scope, rec);
            return json(
                200,
                &ClaimResponse::Claimed {
                    token,
                    lease_ms,
                    reclaimed: false,
                    max_body_bytes: self.advertised_max_body(),
                    retention_s: Some(self.cfg.retention_ms / 1000),
                },
            );
        };
        let lease_expired = |lease_until: u64, lease_ms: u64| {
            lease_until <= now && self.started_at + lease_ms <= now
        };
        let retention_expired = rec.expires_at <= now
            && match rec.state {
                RecordState::Completed(_) | RecordState::Unknown => true,
                RecordState::InProgress { lease_until, .. } => lease_until <= now,
            };
        if retention_expired {
            let was_in_progress = !matches!(rec.state, RecordState::Completed(_));
            let rec = fresh(self, &scope);
            let token = rec.token;
            if was_in_progress {
                self.took_over_unknown.insert(token, scope.clone());
            }
            self.records.insert(scope, rec);
            return json(
                200,
                &ClaimResponse::Claimed {
                    token,
                    lease_ms,
                    reclaimed: was_in_progress,
                    max_body_bytes: self.advertised_max_body(),
                    retention_s: Some(self.cfg.retention_ms / 1000),
                },
            );
        }
        if rec.alg != r.fingerprint_alg || rec.fingerprint != r.fingerprint {
            return json(200, &ClaimResponse::Mismatch);
        }
        match rec.state {
            RecordState::Completed(s) => json(
                200,
                &ClaimResponse::Completed {
                    response: s,
                    expires_in_ms: Some(rec.expires_at.saturating_sub(now)),
                    waited_ms: None,
                },
            ),
            RecordState::InProgress {
                lease_until,
                lease_ms: held,
            } if !lease_expired(lease_until, held) => {
                let remaining = lease_until.saturating_sub(now).max(1);
                let secs = remaining
                    .div_ceil(1000)
                    .clamp(1, self.cfg.retry_after_cap_s.max(1));
                json(
                    200,
                    &ClaimResponse::InProgress {
                        retry_after_s: u32::try_from(secs).unwrap_or(1),
                        lease_remaining_ms: remaining,
                        waited_ms: None,
                    },
                )
            }
            RecordState::InProgress { .. } | RecordState::Unknown
                if r.on_unknown != OnUnknown::TakeOver =>
            {
                // Its lease ran out without an outcome: unknown, held.
                if let Some(r) = self.records.get_mut(&scope) {
                    r.state = RecordState::Unknown;
                    r.unknown_before = true;
                }
                json(200, &ClaimResponse::Unknown)
            }
            RecordState::InProgress { .. } | RecordState::Unknown => {
                // Taken over: a new token, the rest of the record kept.
                let token = self.token(&scope);
                self.took_over_unknown.insert(token, scope.clone());
                if let Some(r) = self.records.get_mut(&scope) {
                    r.token = token;
                    r.unknown_before = true;
                    r.state = RecordState::InProgress {
                        lease_until: now + lease_ms,
                        lease_ms,
                    };
                }
                json(
                    200,
                    &ClaimResponse::Claimed {
                        token,
                        lease_ms,
                        reclaimed: true,
                        max_body_bytes: self.advertised_max_body(),
                        retention_s: Some(self.cfg.retention_ms / 1000),
                    },
                )
            }
        }
    }

    fn fenced() -> Answer {
        problem(ProblemKind::FencedOut, "fenced out")
    }

    fn heartbeat(&mut self, r: HeartbeatRequest, now: u64) -> Answer {
        let scope = match Self::scope(&r.key, &r.subject, &r.endpoint) {
            Ok(s) => s,
            Err(a) => return a,
        };
        let lease_ms = self.lease_for(r.lease_ms);
        match self.records.get_mut(&scope) {
            // The owner is alive after all: an unknown record it still holds runs again.
            Some(rec) if rec.token == r.token && rec.state.open() => {
                rec.state = RecordState::InProgress {
                    lease_until: now + lease_ms,
                    lease_ms,
                };
                json(200, &HeartbeatResponse { lease_ms })
            }
            _ => Self::fenced(),
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

    fn complete(&mut self, r: CompleteRequest, now: u64) -> Answer {
        let scope = match Self::scope(&r.key, &r.subject, &r.endpoint) {
            Ok(s) => s,
            Err(a) => return a,
        };
        if r.token <= 0 {
            return problem(ProblemKind::BadRequest, "token");
        }
        let stored = match self.stored(r.response) {
            Ok(s) => s,
            Err(a) => return a,
        };
        let retention = self.cfg.retention_ms;
        match self.records.get_mut(&scope) {
            Some(rec) if rec.token == r.token => match rec.state {
                RecordState::InProgress { .. } | RecordState::Unknown => {
                    rec.state = RecordState::Completed(stored);
                    rec.expires_at = now + retention;
                    json(200, &WriteResponse::completed(retention))
                }
                // A retried complete of the same owner: what is stored stays.
                RecordState::Completed(_) => json(
                    200,
                    &WriteResponse::completed(rec.expires_at.saturating_sub(now)),
                ),
            },
            _ => Self::fenced(),
        }
    }

    fn release(&mut self, r: ReleaseRequest) -> Answer {
        let scope = match Self::scope(&r.key, &r.subject, &r.endpoint) {
            Ok(s) => s,
            Err(a) => return a,
        };
        match self.records.get_mut(&scope) {
            // Taken over from an unknown outcome: only this attempt certainly did not run.
            Some(rec) if rec.token == r.token && rec.state.open() && rec.unknown_before => {
                rec.state = RecordState::Unknown;
                json(200, &WriteResponse::released())
            }
            Some(rec) if rec.token == r.token && rec.state.open() => {
                self.records.remove(&scope);
                json(200, &WriteResponse::released())
            }
            _ => Self::fenced(),
        }
    }

    /// The owner lost sight of its forwarded request.
    fn owner_unknown(&mut self, r: UnknownRequest) -> Answer {
        let scope = match Self::scope(&r.key, &r.subject, &r.endpoint) {
            Ok(s) => s,
            Err(a) => return a,
        };
        match self.records.get_mut(&scope) {
            Some(rec) if rec.token == r.token && rec.state.open() => {
                rec.state = RecordState::Unknown;
                rec.unknown_before = true;
                json(200, &WriteResponse::unknown())
            }
            // Completed by this owner already: that stands.
            Some(rec) if rec.token == r.token => json(
                200,
                &WriteResponse {
                    state: contract::wire::WriteState::Completed,
                    expires_in_ms: None,
                },
            ),
            _ => Self::fenced(),
        }
    }

    /// Whether the record of `scope` is held by a live lease as of `now` (a claim finds it in
    /// progress).
    pub fn running(&self, scope: &Scope, now: u64) -> bool {
        matches!(
            self.records.get(scope).map(|r| &r.state),
            Some(RecordState::InProgress { lease_until, lease_ms })
                if !(*lease_until <= now && self.started_at + lease_ms <= now)
        )
    }

    /// Whether the record of `scope` has an unknown outcome as of `now` (marked so, or a lease
    /// that ran out).
    pub fn outcome_unknown(&self, scope: &Scope, now: u64) -> bool {
        match self.records.get(scope).map(|r| &r.state) {
            Some(RecordState::Unknown) => true,
            Some(RecordState::InProgress {
                lease_until,
                lease_ms,
            }) => *lease_until <= now && self.started_at + lease_ms <= now,
            _ => false,
        }
    }
}

impl RecordState {
    /// In progress or unknown: its owner may still heartbeat, complete or release it.
    fn open(&self) -> bool {
        matches!(self, RecordState::InProgress { .. } | RecordState::Unknown)
    }
}
