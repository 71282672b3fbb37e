//! The checkout's own record of attempts, as a careful payment service keeps one: every request
//! that carries an `Idempotency-Key` is recorded (key, subject, fencing token) *before* it
//! starts executing, a charge whose token is lower than one already seen for its key is refused
//! (at the start and again at the commit), and the reconcile endpoint reads it to tell the edge
//! what became of a key: `executed` (with the response it produced), `running`, or
//! `not-executed`, which also promises to refuse every attempt with a lower token from then on.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// `charge` (`/checkout`) or `refund` (`/refunds`), the subject, the key.
pub type Scope = (&'static str, String, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptState {
    /// Started, not committed yet.
    Running,
    /// Committed: the charge (or refund) happened; its response is kept.
    Executed,
    /// Refused: its fencing token was lower than one seen for the key. Nothing ran.
    Fenced,
    /// Its caller went away before the commit (the handler was dropped). Nothing ran.
    Abandoned,
}

/// The response an execution produced, as the reconcile endpoint gives it back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Produced {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    #[serde(skip)]
    pub body: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Attempt {
    pub id: u64,
    pub kind: &'static str,
    pub subject: String,
    pub idempotency_key: String,
    pub fencing_token: Option<i64>,
    pub state: AttemptState,
    /// The ledger entry of an executed attempt.
    pub charge_id: Option<u64>,
    /// When it started and when it ended (executed, fenced or abandoned), by the wall clock
    /// (Unix ms): a test's history of what ran when.
    pub started_unix_ms: u64,
    pub ended_unix_ms: Option<u64>,
    /// The status and SHA-256 (hex) of the body of the response an executed attempt produced,
    /// to check a replay against byte for byte.
    pub response_status: Option<u16>,
    pub response_sha256: Option<String>,
    #[serde(skip)]
    pub response: Option<Produced>,
    #[serde(skip)]
    started: Instant,
    /// When a running attempt expects to commit (its processing delay).
    #[serde(skip)]
    due: Instant,
}

/// What the reconcile endpoint says of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reconciled {
    /// The response of the latest executed attempt with a lower token.
    Executed(Produced),
    /// An attempt with a lower token is still at work; ask again after this long.
    Running { retry_after: Duration },
    /// Nothing ran; attempts with a token lower than the one asked with are refused from now on.
    NotExecuted,
    /// The asker's token is not larger than an attempt's: it is stale itself.
    Stale,
}

#[derive(Debug, Default)]
struct OfKey {
    /// Attempts with a token lower than this are refused.
    fence: i64,
    attempts: Vec<u64>,
}

#[derive(Debug, Default)]
pub struct Attempts {
    next_id: u64,
    by_id: HashMap<u64, Attempt>,
    by_scope: HashMap<Scope, OfKey>,
}

/// Why an attempt may not start or commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaleToken {
    pub seen: i64,
}

impl Attempts {
    fn highest_seen(&self, scope: &Scope, except: Option<u64>) -> i64 {
        let Some(of) = self.by_scope.get(scope) else {
            return 0;
        };
        of.attempts
            .iter()
            .filter(|id| Some(**id) != except)
            .filter_map(|id| self.by_id.get(id))
            .filter(|a| a.state != AttemptState::Fenced)
            .filter_map(|a| a.fencing_token)
            .chain([of.fence])
            .max()
            .unwrap_or(0)
    }

    /// Records an attempt before it executes. `Err`: its token is lower than one seen for the
    /// key (it is recorded as fenced, and must not run).
    pub fn start(
        &mut self,
        scope: Scope,
        token: Option<i64>,
        expected: Duration,
    ) -> (u64, Result<(), StaleToken>) {
        let seen = self.highest_seen(&scope, None);
        let verdict = match token {
            Some(t) if t < seen => Err(StaleToken { seen }),
            _ => Ok(()),
        };
        self.next_id += 1;
        let id = self.next_id;
        let now = Instant::now();
        self.by_id.insert(
            id,
            Attempt {
                id,
                kind: scope.0,
                subject: scope.1.clone(),
                idempotency_key: scope.2.clone(),
                fencing_token: token,
                state: if verdict.is_ok() {
                    AttemptState::Running
                } else {
                    AttemptState::Fenced
                },
                charge_id: None,
                started_unix_ms: unix_ms(),
                ended_unix_ms: verdict.is_err().then(unix_ms),
                response_status: None,
                response_sha256: None,
                response: None,
                started: now,
                due: now + expected,
            },
        );
        self.by_scope.entry(scope).or_default().attempts.push(id);
        (id, verdict)
    }

    /// Whether a running attempt may commit now (no larger token was seen meanwhile); if not, it
    /// is fenced.
    pub fn may_commit(&mut self, id: u64) -> Result<(), StaleToken> {
        let Some(a) = self.by_id.get(&id) else {
            return Ok(());
        };
        let scope = (a.kind, a.subject.clone(), a.idempotency_key.clone());
        let seen = self.highest_seen(&scope, Some(id));
        match self.by_id.get_mut(&id) {
            Some(a) if a.fencing_token.is_some_and(|t| t < seen) => {
                a.state = AttemptState::Fenced;
                a.ended_unix_ms = Some(unix_ms());
                Err(StaleToken { seen })
            }
            _ => Ok(()),
        }
    }

    /// The attempt committed: its charge and the response it produced.
    pub fn executed(&mut self, id: u64, charge_id: u64, response: Produced) {
        if let Some(a) = self.by_id.get_mut(&id) {
            a.state = AttemptState::Executed;
            a.charge_id = Some(charge_id);
            a.ended_unix_ms = Some(unix_ms());
            a.response_status = Some(response.status);
            a.response_sha256 = Some(crate::sha256_hex(&response.body));
            a.response = Some(response);
        }
    }

    /// Its caller went away before it committed.
    pub fn abandoned(&mut self, id: u64) {
        if let Some(a) = self.by_id.get_mut(&id) {
            if a.state == AttemptState::Running {
                a.state = AttemptState::Abandoned;
                a.ended_unix_ms = Some(unix_ms());
            }
        }
    }

    /// The reconcile endpoint, asked with the new owner's `token`.
    pub fn reconcile(&mut self, scope: Scope, token: i64) -> Reconciled {
        let now = Instant::now();
        let of = self.by_scope.get(&scope);
        let attempts: Vec<&Attempt> = of
            .map(|o| {
                o.attempts
                    .iter()
                    .filter_map(|id| self.by_id.get(id))
                    .collect()
            })
            .unwrap_or_default();
        if attempts
            .iter()
            .any(|a| a.state != AttemptState::Fenced && a.fencing_token.is_some_and(|t| t >= token))
        {
            return Reconciled::Stale;
        }
        if let Some(done) = attempts
            .iter()
            .filter(|a| a.state == AttemptState::Executed)
            .max_by_key(|a| (a.fencing_token, a.id))
        {
            if let Some(r) = &done.response {
                return Reconciled::Executed(r.clone());
            }
        }
        if let Some(running) = attempts
            .iter()
            .filter(|a| a.state == AttemptState::Running)
            .max_by_key(|a| a.due)
        {
            let left = running.due.saturating_duration_since(now);
            return Reconciled::Running {
                retry_after: left.max(Duration::from_secs(1)),
            };
        }
        let of = self.by_scope.entry(scope).or_default();
        of.fence = of.fence.max(token);
        Reconciled::NotExecuted
    }

    /// Every attempt, oldest first.
    pub fn list(&self) -> Vec<Attempt> {
        let mut all: Vec<Attempt> = self.by_id.values().cloned().collect();
        all.sort_by_key(|a| (a.started, a.id));
        all
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(key: &str) -> Scope {
        ("charge", "alice".into(), key.into())
    }

    fn produced() -> Produced {
        Produced {
            status: 201,
            headers: vec![("location".into(), "/charges/1".into())],
            body: b"{\"id\":1}".to_vec(),
        }
    }

    #[test]
    fn a_running_attempt_is_reported_running_and_still_commits() {
        let mut a = Attempts::default();
        let (id, ok) = a.start(scope("k"), Some(5), Duration::from_secs(40));
        assert!(ok.is_ok());
        match a.reconcile(scope("k"), 9) {
            Reconciled::Running { retry_after } => assert!(retry_after > Duration::from_secs(30)),
            other => panic!("{other:?}"),
        }
        // Asking does not fence it: only `not-executed` promises that.
        assert!(a.may_commit(id).is_ok());
        a.executed(id, 1, produced());
        assert_eq!(
            a.reconcile(scope("k"), 10),
            Reconciled::Executed(produced())
        );
        let listed = &a.list()[0];
        assert_eq!(listed.response_status, Some(201));
        assert_eq!(
            listed.response_sha256.as_deref(),
            Some(crate::sha256_hex(b"{\"id\":1}").as_str())
        );
        assert!(listed.ended_unix_ms >= Some(listed.started_unix_ms));
    }

    #[test]
    fn not_executed_fences_every_lower_token() {
        let mut a = Attempts::default();
        assert_eq!(a.reconcile(scope("k"), 9), Reconciled::NotExecuted);
        let (_, late) = a.start(scope("k"), Some(5), Duration::ZERO);
        assert_eq!(late, Err(StaleToken { seen: 9 }));
        let (_, new) = a.start(scope("k"), Some(9), Duration::ZERO);
        assert!(new.is_ok(), "the token that asked runs");
        assert!(a.list().iter().any(|x| x.state == AttemptState::Fenced));
    }

    #[test]
    fn a_lower_token_cannot_commit_after_a_larger_one_started() {
        let mut a = Attempts::default();
        let (old, _) = a.start(scope("k"), Some(3), Duration::ZERO);
        let (new, _) = a.start(scope("k"), Some(4), Duration::ZERO);
        assert!(a.may_commit(new).is_ok());
        assert_eq!(a.may_commit(old), Err(StaleToken { seen: 4 }));
    }

    #[test]
    fn an_abandoned_attempt_did_not_run_and_a_stale_asker_is_told_so() {
        let mut a = Attempts::default();
        let (id, _) = a.start(scope("k"), Some(3), Duration::ZERO);
        a.abandoned(id);
        assert_eq!(a.reconcile(scope("k"), 2), Reconciled::Stale);
        assert_eq!(a.reconcile(scope("k"), 4), Reconciled::NotExecuted);
        assert_eq!(a.reconcile(scope("other"), 1), Reconciled::NotExecuted);
    }
}
