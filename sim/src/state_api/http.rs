//! The state API's HTTP layer restated (`state-api/src/http.rs`): each path routed to its call,
//! the validation and limits of what a call names, the answers' shapes (a problem, a batch).

use contract::wire::{
    AbandonRequest, BatchItem, BatchResponse, ClaimBatchRequest, ClaimRequest,
    CompleteBatchRequest, CompleteRequest, HeartbeatRequest, ReleaseRequest, UnknownRequest,
    WriteBatchRequest, ABANDON_PATH, CLAIMS_PATH, CLAIM_PATH, COMPLETES_PATH, COMPLETE_PATH,
    HEARTBEAT_PATH, MAX_BATCH_CLAIMS, RELEASE_PATH, UNKNOWN_PATH, WRITES_PATH,
};
use contract::{validate_key, Problem, ProblemKind};

use super::{Address, Answer, Looked, ModelStateApi, Scope};
use contract::limits::MAX_FIELD_LEN;

pub(super) fn json<T: serde::Serialize>(status: u16, v: &T) -> Answer {
    (status, serde_json::to_vec(v).unwrap_or_default())
}

pub(super) fn problem(kind: ProblemKind, detail: &str) -> Answer {
    (kind.status(), Problem::new(kind, detail).to_json())
}

pub(super) fn fenced() -> Answer {
    problem(ProblemKind::FencedOut, "fenced out")
}

/// A batch's answer: each single answer's status and document, in order.
pub(super) fn batch(answers: Vec<Answer>) -> Answer {
    let answers = answers
        .into_iter()
        .map(|(status, body)| BatchItem {
            status,
            answer: serde_json::from_slice(&body).unwrap_or_default(),
        })
        .collect();
    json(200, &BatchResponse { answers })
}

pub(super) fn check_text(v: &str) -> bool {
    !v.is_empty() && v.len() <= MAX_FIELD_LEN && !v.chars().any(char::is_control)
}

pub(super) fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The scope a call names, validated as `scope_of` does.
pub(super) fn scope(key: &str, subject: &str, endpoint: &str) -> Result<Scope, Answer> {
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
    pub(super) fn batch(
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

    /// A write's scope, validated, and the address it was looked up at (`scope_of`).
    pub(super) fn located(
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
}
