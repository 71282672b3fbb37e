//! The state API's HTTP layer restated (`state-api/src/http.rs`): the validation and limits of
//! what a call names (its scope, as `scope_of` finds it), the answers' shapes (a problem, a
//! batch).

use contract::wire::{
    BatchItem, BatchResponse, ABANDON_PATH, CLAIMS_PATH, CLAIM_PATH, COMPLETES_PATH, COMPLETE_PATH,
    HEARTBEAT_PATH, RELEASE_PATH, UNKNOWN_PATH, WRITES_PATH,
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
