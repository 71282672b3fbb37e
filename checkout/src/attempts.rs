//! The checkout's own record of attempts, as a careful payment service keeps one: every request
//! that carries an `Idempotency-Key` is recorded *before* it starts executing, with the request
//! it belongs to (its [`Scope`]: the endpoint, the subject, the key and the request's
//! fingerprint, as the edge forwards them) and its fencing token, and the reconcile endpoint
//! reads it to tell the edge what became of a request: `executed` (with the response it
//! produced, naming the attempt by its token), `running`, or `not-executed`, which also
//! promises to refuse every attempt of that request with a lower token from then on.
//!
//! Every rule holds per request, never per key alone: two requests under one key (another
//! path of a prefix route, or another body once the edge reused the key's record past its
//! retention) are two requests, each executed once, neither ever answered with the other's
//! outcome. The edge's tokens for one request all come from its record, so they order that
//! request's attempts; another request's tokens say nothing about it.
//!
//! Fencing tokens *order* attempts; they do not deduplicate them. So, for an attempt that
//! carries a token:
//! * a token lower than one already seen for the request is refused (at the start and again at
//!   the commit): a late orphan cannot charge after a newer attempt;
//! * a token already used by another attempt of the request is refused: the same attempt twice;
//! * once an attempt of the request has executed, every later one gets **that execution's
//!   response**, at the start or at the commit, and nothing runs again: a `reexecute` route's
//!   new attempt after the first one charged is answered, not charged;
//! * the commit is one decision under the lock, so two attempts of a request never both charge.
//!
//! An execution that failed (a 5xx: the demo's `x-demo-fail`) had no effect: it does not count
//! as the request's execution, and a later token runs (what `on_5xx: "release"` relies on).
//! Attempts without a token (callers other than the edge) are recorded but neither refused nor
//! deduplicated: the edge dedupes those.
//!
//! The record is bounded: it keeps the last `max_requests` requests (by their latest attempt
//! or reconcile) and forgets older finished ones, as a payment service's idempotency records
//! expire. What it forgot it cannot vouch for, so it never answers as if it had not happened:
//! an attempt of a request it does not know with a token no larger than the largest it forgot
//! is refused (stale), and the reconcile of a request it does not know, once it has forgotten
//! any, says it cannot tell (the edge answers 503 and keeps the key) rather than
//! `not-executed`. The first rule relies on the edge's tokens coming from one sequence
//! (`idempotency_fencing_token_seq`): a new request's token is larger than every token issued
//! before it, so only an attempt that waited while `max_requests` other requests came and went
//! can be refused by it.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// The request an attempt belongs to, as the edge names it in the headers it forwards.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    /// `POST /checkout` (`idempotency-endpoint`; the checkout's own route without it).
    pub endpoint: String,
    pub subject: String,
    pub key: String,
    /// `idempotency-fingerprint`: opaque, compared for equality only; `None` without one.
    pub fingerprint: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptState {
    /// Started, not committed yet.
    Running,
    /// Committed: the charge (or refund) happened; its response is kept.
    Executed,
    /// Refused: its fencing token was lower than one seen for the request, or already used by
    /// another attempt of the request. Nothing ran.
    Fenced,
    /// Its request had already executed: it got that execution's response. Nothing ran.
    Replayed,
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
    /// `charge` (`/checkout`) or `refund` (`/refunds`).
    pub kind: &'static str,
    pub endpoint: String,
    pub subject: String,
    pub idempotency_key: String,
    pub fingerprint: Option<String>,
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

/// What the reconcile endpoint says of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reconciled {
    /// The response the latest executed attempt of the request (with a lower token: `token`)
    /// produced.
    Executed { token: i64, produced: Produced },
    /// An attempt with a lower token is still at work; ask again after this long.
    Running { retry_after: Duration },
    /// Nothing ran; attempts with a token lower than the one asked with are refused from now on.
    NotExecuted,
    /// The asker's token is not larger than an attempt's: it is stale itself.
    Stale,
    /// The request is not in the record, which has forgotten older requests: it may have been
    /// one of them.
    CannotTell,
}

#[derive(Debug, Default)]
struct OfRequest {
    /// Attempts with a token lower than this are refused.
    fence: i64,
    attempts: Vec<u64>,
    /// Its latest entry in [`Attempts::order`]: older entries of it there are stale.
    touched: u64,
    /// First seen as an attempt refused for what the record forgot: it may be a forgotten
    /// request, whose history the record no longer holds.
    partial: bool,
}

/// Requests the record keeps by default (`CHECKOUT_MAX_REQUESTS`): about 120 MiB at most.
pub const DEFAULT_MAX_REQUESTS: usize = 100_000;

/// What the record has forgotten.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Forgotten {
    pub requests: u64,
    /// The largest fencing token of a forgotten attempt (0: none carried one).
    pub highest_token: i64,
}

#[derive(Debug)]
pub struct Attempts {
    next_id: u64,
    by_id: HashMap<u64, Attempt>,
    by_scope: HashMap<Scope, OfRequest>,
    /// Requests in the order of their latest attempt or reconcile (each with its
    /// [`OfRequest::touched`]): the least recent is forgotten first.
    order: VecDeque<(Scope, u64)>,
    touches: u64,
    max_requests: usize,
    forgotten: Forgotten,
}

impl Default for Attempts {
    fn default() -> Self {
        Self::with_limit(DEFAULT_MAX_REQUESTS)
    }
}

/// Why an attempt may not run. Nothing ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its token is lower than `seen`, already seen for the request.
    Stale { seen: i64 },
    /// Another attempt of the request already carried this token.
    Reused { token: i64 },
}

/// What an attempt is told when it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Started {
    /// It may run (and is asked again at its commit).
    Run,
    /// Its request already executed: that execution's response. Nothing runs.
    AlreadyExecuted(Produced),
    Refused(Refusal),
}

/// What became of an attempt at its commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Committed {
    /// It executed now: the response it produced.
    Ran(Produced),
    /// Another attempt of the request executed meanwhile: that execution's response. Nothing
    /// ran.
    AlreadyExecuted(Produced),
    Refused(Refusal),
}

impl Attempts {
    /// A record that keeps at most `max_requests` requests (at least one).
    pub fn with_limit(max_requests: usize) -> Self {
        Self {
            next_id: 0,
            by_id: HashMap::new(),
            by_scope: HashMap::new(),
            order: VecDeque::new(),
            touches: 0,
            max_requests: max_requests.max(1),
            forgotten: Forgotten::default(),
        }
    }

    pub fn forgotten(&self) -> Forgotten {
        self.forgotten
    }

    /// Requests in the record.
    pub fn requests(&self) -> usize {
        self.by_scope.len()
    }

    /// An attempt of a request the record does not know may belong to one it forgot: refused
    /// when its token is no larger than every token it forgot.
    fn forgotten_refusal(&self, scope: &Scope, token: i64) -> Option<Refusal> {
        let seen = self.forgotten.highest_token;
        (seen > 0 && token <= seen && !self.by_scope.contains_key(scope))
            .then_some(Refusal::Stale { seen })
    }

    /// The request `scope` (recorded if new) as the most recent one, for the order in which
    /// requests are forgotten.
    fn touch(&mut self, scope: Scope) -> &mut OfRequest {
        self.touches += 1;
        self.order.push_back((scope.clone(), self.touches));
        let of = self.by_scope.entry(scope).or_default();
        of.touched = self.touches;
        of
    }

    /// Forgets the least recent requests while there are more than `max_requests`. A request
    /// with a running attempt is kept (moved behind the others) until it ends.
    fn forget_over_limit(&mut self) {
        let mut running_seen = 0;
        while self.by_scope.len() > self.max_requests && running_seen < self.order.len() {
            let Some((scope, touched)) = self.order.pop_front() else {
                return;
            };
            if self.by_scope.get(&scope).map(|of| of.touched) != Some(touched) {
                continue; // touched again since: a later entry stands for it
            }
            let ids = self
                .by_scope
                .get(&scope)
                .map(|of| of.attempts.clone())
                .unwrap_or_default();
            let running = ids.iter().any(|id| {
                self.by_id
                    .get(id)
                    .is_some_and(|a| a.state == AttemptState::Running)
            });
            if running {
                running_seen += 1;
                self.order.push_back((scope, touched));
                continue;
            }
            let fence = self.by_scope.remove(&scope).map_or(0, |of| of.fence);
            let tokens = ids
                .iter()
                .filter_map(|id| self.by_id.remove(id))
                .filter_map(|a| a.fencing_token);
            self.forgotten.requests += 1;
            self.forgotten.highest_token = tokens
                .chain([fence, self.forgotten.highest_token])
                .max()
                .unwrap_or(0);
        }
    }

    fn of_request(&self, scope: &Scope) -> impl Iterator<Item = &Attempt> {
        self.by_scope
            .get(scope)
            .into_iter()
            .flat_map(|of| of.attempts.iter())
            .filter_map(|id| self.by_id.get(id))
    }

    fn highest_seen(&self, scope: &Scope, except: Option<u64>) -> i64 {
        let fence = self.by_scope.get(scope).map_or(0, |of| of.fence);
        self.of_request(scope)
            .filter(|a| Some(a.id) != except)
            .filter(|a| a.state != AttemptState::Fenced)
            .filter_map(|a| a.fencing_token)
            .chain([fence])
            .max()
            .unwrap_or(0)
    }

    /// The response of the request's execution, if one had an effect (a 5xx did not).
    fn execution(&self, scope: &Scope, except: Option<u64>) -> Option<Produced> {
        self.of_request(scope)
            .filter(|a| Some(a.id) != except && a.state == AttemptState::Executed)
            .filter_map(|a| a.response.as_ref())
            .find(|r| r.status < 500)
            .cloned()
    }

    /// Whether `token` is refused for `scope` (ignoring attempt `except`).
    fn refusal(&self, scope: &Scope, token: i64, except: Option<u64>) -> Option<Refusal> {
        let seen = self.highest_seen(scope, except);
        if token < seen {
            return Some(Refusal::Stale { seen });
        }
        let reused = self.of_request(scope).any(|a| {
            Some(a.id) != except
                && a.state != AttemptState::Fenced
                && a.fencing_token == Some(token)
        });
        reused.then_some(Refusal::Reused { token })
    }

    /// Records an attempt of `kind` before it executes, and says whether it may run: refused
    /// (recorded as fenced), answered with its request's execution (recorded as replayed), or
    /// run.
    pub fn start(
        &mut self,
        kind: &'static str,
        scope: Scope,
        token: Option<i64>,
        expected: Duration,
    ) -> (u64, Started) {
        let forgotten_refusal = token.and_then(|t| self.forgotten_refusal(&scope, t));
        let started = match token {
            None => Started::Run,
            Some(t) => match self.refusal(&scope, t, None).or(forgotten_refusal) {
                Some(r) => Started::Refused(r),
                None => match self.execution(&scope, None) {
                    Some(p) => Started::AlreadyExecuted(p),
                    None => Started::Run,
                },
            },
        };
        self.next_id += 1;
        let id = self.next_id;
        let now = Instant::now();
        self.by_id.insert(
            id,
            Attempt {
                id,
                kind,
                endpoint: scope.endpoint.clone(),
                subject: scope.subject.clone(),
                idempotency_key: scope.key.clone(),
                fingerprint: scope.fingerprint.clone(),
                fencing_token: token,
                state: match started {
                    Started::Run => AttemptState::Running,
                    Started::AlreadyExecuted(_) => AttemptState::Replayed,
                    Started::Refused(_) => AttemptState::Fenced,
                },
                charge_id: None,
                started_unix_ms: unix_ms(),
                ended_unix_ms: (!matches!(started, Started::Run)).then(unix_ms),
                response_status: None,
                response_sha256: None,
                response: None,
                started: now,
                due: now + expected,
            },
        );
        let of = self.touch(scope);
        of.attempts.push(id);
        of.partial |= forgotten_refusal.is_some();
        self.forget_over_limit();
        (id, started)
    }

    /// The commit of a running attempt, decided and done in one step: refused if a larger token
    /// was seen meanwhile (fenced), answered with its request's execution if another attempt
    /// executed meanwhile (replayed), or executed now by `execute` (its ledger entry's id and
    /// the response it produced), while no other attempt can commit.
    pub fn commit(&mut self, id: u64, execute: impl FnOnce() -> (u64, Produced)) -> Committed {
        let decided = self.by_id.get(&id).and_then(|a| {
            let token = a.fencing_token?;
            let scope = a.scope();
            if let Some(r) = self.refusal(&scope, token, Some(id)) {
                return Some((AttemptState::Fenced, Committed::Refused(r)));
            }
            let p = self.execution(&scope, Some(id))?;
            Some((AttemptState::Replayed, Committed::AlreadyExecuted(p)))
        });
        if let Some((state, committed)) = decided {
            if let Some(a) = self.by_id.get_mut(&id) {
                a.state = state;
                a.ended_unix_ms = Some(unix_ms());
            }
            return committed;
        }
        let (charge_id, produced) = execute();
        if let Some(a) = self.by_id.get_mut(&id) {
            a.state = AttemptState::Executed;
            a.charge_id = Some(charge_id);
            a.ended_unix_ms = Some(unix_ms());
            a.response_status = Some(produced.status);
            a.response_sha256 = Some(crate::sha256_hex(&produced.body));
            a.response = Some(produced.clone());
        }
        Committed::Ran(produced)
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

    /// The reconcile endpoint, asked about the request `scope` with the new owner's `token`:
    /// only that request's attempts count.
    pub fn reconcile(&mut self, scope: Scope, token: i64) -> Reconciled {
        let now = Instant::now();
        if self.forgotten.requests > 0 && self.by_scope.get(&scope).is_none_or(|of| of.partial) {
            return Reconciled::CannotTell;
        }
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
        // An execution is named by its token: one without (not the edge's) cannot be.
        let executed = attempts
            .iter()
            .filter(|a| a.state == AttemptState::Executed)
            .filter_map(|a| Some((a.fencing_token?, a.response.as_ref()?)))
            .max_by_key(|(t, _)| *t);
        if let Some((token, produced)) = executed {
            return Reconciled::Executed {
                token,
                produced: produced.clone(),
            };
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
        let of = self.touch(scope);
        of.fence = of.fence.max(token);
        self.forget_over_limit();
        Reconciled::NotExecuted
    }

    /// Every attempt, oldest first.
    pub fn list(&self) -> Vec<Attempt> {
        let mut all: Vec<Attempt> = self.by_id.values().cloned().collect();
        all.sort_by_key(|a| (a.started, a.id));
        all
    }
}

impl Attempt {
    /// The request it belongs to.
    fn scope(&self) -> Scope {
        Scope {
            endpoint: self.endpoint.clone(),
            subject: self.subject.clone(),
            key: self.idempotency_key.clone(),
            fingerprint: self.fingerprint.clone(),
        }
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
        request(key, "POST /checkout", "fp-1")
    }

    fn request(key: &str, endpoint: &str, fingerprint: &str) -> Scope {
        Scope {
            endpoint: endpoint.into(),
            subject: "alice".into(),
            key: key.into(),
            fingerprint: Some(fingerprint.into()),
        }
    }

    fn executed(token: i64, p: Produced) -> Reconciled {
        Reconciled::Executed { token, produced: p }
    }

    fn produced(id: u64) -> Produced {
        Produced {
            status: 201,
            headers: vec![("location".into(), format!("/charges/{id}"))],
            body: format!("{{\"id\":{id}}}").into_bytes(),
        }
    }

    /// Commits `id`, counting the executions it runs.
    fn commit(a: &mut Attempts, id: u64, charges: &mut u64) -> Committed {
        a.commit(id, || {
            *charges += 1;
            (*charges, produced(*charges))
        })
    }

    fn states(a: &Attempts) -> Vec<AttemptState> {
        a.list().iter().map(|x| x.state).collect()
    }

    #[test]
    fn a_running_attempt_is_reported_running_and_still_commits() {
        let mut a = Attempts::default();
        let mut charges = 0;
        let (id, ok) = a.start("charge", scope("k"), Some(5), Duration::from_secs(40));
        assert_eq!(ok, Started::Run);
        match a.reconcile(scope("k"), 9) {
            Reconciled::Running { retry_after } => assert!(retry_after > Duration::from_secs(30)),
            other => panic!("{other:?}"),
        }
        // Asking does not fence it: only `not-executed` promises that.
        assert_eq!(
            commit(&mut a, id, &mut charges),
            Committed::Ran(produced(1))
        );
        assert_eq!(a.reconcile(scope("k"), 10), executed(5, produced(1)));
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
        let (_, late) = a.start("charge", scope("k"), Some(5), Duration::ZERO);
        assert_eq!(late, Started::Refused(Refusal::Stale { seen: 9 }));
        let (_, new) = a.start("charge", scope("k"), Some(9), Duration::ZERO);
        assert_eq!(new, Started::Run, "the token that asked runs");
        assert!(a.list().iter().any(|x| x.state == AttemptState::Fenced));
    }

    #[test]
    fn a_lower_token_cannot_commit_after_a_larger_one_started() {
        let mut a = Attempts::default();
        let mut charges = 0;
        let (old, _) = a.start("charge", scope("k"), Some(3), Duration::ZERO);
        let (new, _) = a.start("charge", scope("k"), Some(4), Duration::ZERO);
        assert_eq!(
            commit(&mut a, new, &mut charges),
            Committed::Ran(produced(1))
        );
        assert_eq!(
            commit(&mut a, old, &mut charges),
            Committed::Refused(Refusal::Stale { seen: 4 })
        );
        assert_eq!(charges, 1);
    }

    #[test]
    fn an_abandoned_attempt_did_not_run_and_a_stale_asker_is_told_so() {
        let mut a = Attempts::default();
        let (id, _) = a.start("charge", scope("k"), Some(3), Duration::ZERO);
        a.abandoned(id);
        assert_eq!(a.reconcile(scope("k"), 2), Reconciled::Stale);
        assert_eq!(a.reconcile(scope("k"), 4), Reconciled::NotExecuted);
        assert_eq!(a.reconcile(scope("other"), 1), Reconciled::NotExecuted);
    }

    // The contract a `reexecute` route needs (docs/RELIABILITY.md): attempts are ordered by
    // their tokens, and a request executes once.

    #[test]
    fn a_later_token_after_an_execution_gets_its_response_and_charges_nothing() {
        let mut a = Attempts::default();
        let mut charges = 0;
        let (first, _) = a.start("charge", scope("k"), Some(1), Duration::ZERO);
        assert_eq!(
            commit(&mut a, first, &mut charges),
            Committed::Ran(produced(1))
        );
        let (_, again) = a.start("charge", scope("k"), Some(2), Duration::ZERO);
        assert_eq!(again, Started::AlreadyExecuted(produced(1)));
        assert_eq!(charges, 1);
        assert_eq!(states(&a), [AttemptState::Executed, AttemptState::Replayed]);
        // Its token counts: a lower one is stale from now on; the reconcile still reports the
        // one execution.
        let (_, late) = a.start("charge", scope("k"), Some(1), Duration::ZERO);
        assert_eq!(late, Started::Refused(Refusal::Stale { seen: 2 }));
        assert_eq!(a.reconcile(scope("k"), 3), executed(1, produced(1)));
    }

    #[test]
    fn an_attempt_whose_key_executed_while_it_ran_gets_that_response_at_its_commit() {
        // Between tokened attempts the larger token's start already fences the smaller one; a
        // caller without a token can still execute the key while a tokened attempt runs.
        let mut a = Attempts::default();
        let mut charges = 0;
        let (tokened, started) = a.start("charge", scope("k"), Some(7), Duration::ZERO);
        assert_eq!(started, Started::Run);
        let (direct, _) = a.start("charge", scope("k"), None, Duration::ZERO);
        assert_eq!(
            commit(&mut a, direct, &mut charges),
            Committed::Ran(produced(1))
        );
        assert_eq!(
            commit(&mut a, tokened, &mut charges),
            Committed::AlreadyExecuted(produced(1))
        );
        assert_eq!(charges, 1);
    }

    #[test]
    fn the_same_token_twice_is_refused_before_and_after_the_execution() {
        let mut a = Attempts::default();
        let mut charges = 0;
        let (first, _) = a.start("charge", scope("k"), Some(5), Duration::ZERO);
        let (_, twice) = a.start("charge", scope("k"), Some(5), Duration::ZERO);
        assert_eq!(twice, Started::Refused(Refusal::Reused { token: 5 }));
        assert_eq!(
            commit(&mut a, first, &mut charges),
            Committed::Ran(produced(1))
        );
        let (_, after) = a.start("charge", scope("k"), Some(5), Duration::ZERO);
        assert_eq!(after, Started::Refused(Refusal::Reused { token: 5 }));
        // Also once its first attempt was abandoned (its caller left before the commit).
        let (gone, _) = a.start("charge", scope("j"), Some(8), Duration::ZERO);
        a.abandoned(gone);
        let (_, again) = a.start("charge", scope("j"), Some(8), Duration::ZERO);
        assert_eq!(again, Started::Refused(Refusal::Reused { token: 8 }));
        assert_eq!(charges, 1);
    }

    #[test]
    fn a_failed_execution_had_no_effect_and_a_later_token_runs() {
        let mut a = Attempts::default();
        let (first, _) = a.start("charge", scope("k"), Some(1), Duration::ZERO);
        let failed = Produced {
            status: 503,
            headers: Vec::new(),
            body: Vec::new(),
        };
        assert_eq!(
            a.commit(first, || (1, failed.clone())),
            Committed::Ran(failed.clone())
        );
        let (second, started) = a.start("charge", scope("k"), Some(2), Duration::ZERO);
        assert_eq!(started, Started::Run);
        assert_eq!(
            a.commit(second, || (2, produced(2))),
            Committed::Ran(produced(2))
        );
    }

    #[test]
    fn attempts_without_a_token_are_neither_refused_nor_deduplicated() {
        let mut a = Attempts::default();
        let mut charges = 0;
        for _ in 0..2 {
            let (id, started) = a.start("charge", scope("k"), None, Duration::ZERO);
            assert_eq!(started, Started::Run);
            assert!(matches!(
                commit(&mut a, id, &mut charges),
                Committed::Ran(_)
            ));
        }
        assert_eq!(charges, 2, "the edge dedupes callers that send no token");
    }

    // Issue 34 path 11: every rule holds per request (endpoint, subject, key, fingerprint).

    #[test]
    fn another_request_under_the_key_runs_and_each_gets_its_own_execution() {
        let mut a = Attempts::default();
        let mut charges = 0;
        let first = request("k", "POST /checkout", "fp-700");
        let (id, _) = a.start("charge", first.clone(), Some(1), Duration::ZERO);
        assert_eq!(
            commit(&mut a, id, &mut charges),
            Committed::Ran(produced(1))
        );
        // Another body under the key (the edge reused its record past its retention).
        let other = request("k", "POST /checkout", "fp-900");
        let (id, started) = a.start("charge", other.clone(), Some(2), Duration::ZERO);
        assert_eq!(started, Started::Run, "not the first request's execution");
        assert_eq!(
            commit(&mut a, id, &mut charges),
            Committed::Ran(produced(2))
        );
        // A refund under the key (another path of a prefix route): its own request too.
        let refund = request("k", "POST /refunds", "fp-700");
        let (_, started) = a.start("refund", refund, Some(3), Duration::ZERO);
        assert_eq!(started, Started::Run);
        // Each request again: its own execution.
        let (_, again) = a.start("charge", first, Some(4), Duration::ZERO);
        assert_eq!(again, Started::AlreadyExecuted(produced(1)));
        let (_, again) = a.start("charge", other, Some(5), Duration::ZERO);
        assert_eq!(again, Started::AlreadyExecuted(produced(2)));
        assert_eq!(charges, 2);
    }

    #[test]
    fn the_reconcile_answers_about_the_asked_request_only_and_names_its_attempt() {
        let mut a = Attempts::default();
        let mut charges = 0;
        let first = request("k", "POST /checkout", "fp-700");
        let (id, _) = a.start("charge", first.clone(), Some(3), Duration::ZERO);
        commit(&mut a, id, &mut charges);
        assert_eq!(
            a.reconcile(request("k", "POST /checkout", "fp-900"), 8),
            Reconciled::NotExecuted,
            "another body's request never ran"
        );
        assert_eq!(
            a.reconcile(request("k", "POST /refunds", "fp-700"), 9),
            Reconciled::NotExecuted,
            "another endpoint's request never ran"
        );
        assert_eq!(a.reconcile(first.clone(), 10), executed(3, produced(1)));
        // The fence it raised is the asked request's: the first request's attempts are not
        // refused by another request's reconcile.
        let (_, late) = a.start(
            "charge",
            request("k", "POST /checkout", "fp-900"),
            Some(7),
            Duration::ZERO,
        );
        assert_eq!(late, Started::Refused(Refusal::Stale { seen: 8 }));
        let (_, replayed) = a.start("charge", first, Some(4), Duration::ZERO);
        assert_eq!(replayed, Started::AlreadyExecuted(produced(1)));
    }

    #[test]
    fn an_execution_without_a_token_is_not_named_by_the_reconcile() {
        let mut a = Attempts::default();
        let mut charges = 0;
        let (id, _) = a.start("charge", scope("k"), None, Duration::ZERO);
        commit(&mut a, id, &mut charges);
        assert_eq!(a.reconcile(scope("k"), 4), Reconciled::NotExecuted);
        // The request then runs with token 4 and gets that execution (nothing charged again).
        let (_, started) = a.start("charge", scope("k"), Some(4), Duration::ZERO);
        assert_eq!(started, Started::AlreadyExecuted(produced(1)));
    }

    #[test]
    fn the_record_is_bounded_and_never_vouches_for_what_it_forgot() {
        let mut a = Attempts::with_limit(2);
        let mut charges = 0;
        for (key, token) in [("k1", 10), ("k2", 20), ("k3", 30)] {
            let (id, started) = a.start("charge", scope(key), Some(token), Duration::ZERO);
            assert_eq!(started, Started::Run);
            assert!(matches!(
                commit(&mut a, id, &mut charges),
                Committed::Ran(_)
            ));
        }
        assert_eq!(a.requests(), 2, "the oldest request was forgotten");
        assert_eq!(
            a.forgotten(),
            Forgotten {
                requests: 1,
                highest_token: 10
            }
        );
        // k1's late orphan (a token no larger than one forgotten) is refused, not run again.
        let (_, late) = a.start("charge", scope("k1"), Some(9), Duration::ZERO);
        assert_eq!(late, Started::Refused(Refusal::Stale { seen: 10 }));
        // Asked about k1 (after that refusal too), the record cannot tell; about a kept
        // request, it still can.
        assert_eq!(a.reconcile(scope("k1"), 99), Reconciled::CannotTell);
        assert!(matches!(
            a.reconcile(scope("k3"), 99),
            Reconciled::Executed { token: 30, .. }
        ));
        // A new request (a larger token) runs.
        let (_, fresh) = a.start("charge", scope("k4"), Some(40), Duration::ZERO);
        assert_eq!(fresh, Started::Run);
    }

    #[test]
    fn the_least_recent_request_is_forgotten_first() {
        let mut a = Attempts::with_limit(2);
        let mut charges = 0;
        for (key, token) in [("k1", 1), ("k2", 2), ("k1", 3)] {
            let (id, _) = a.start("charge", scope(key), Some(token), Duration::ZERO);
            commit(&mut a, id, &mut charges);
        }
        // k1 was attempted again after k2: k2 goes first.
        a.start("charge", scope("k3"), Some(4), Duration::ZERO);
        assert_eq!(a.reconcile(scope("k2"), 9), Reconciled::CannotTell);
        assert!(matches!(
            a.reconcile(scope("k1"), 9),
            Reconciled::Executed { token: 1, .. }
        ));
        assert_eq!(a.forgotten().highest_token, 2);
    }

    #[test]
    fn a_running_attempt_is_not_forgotten() {
        let mut a = Attempts::with_limit(1);
        let mut charges = 0;
        let (running, _) = a.start("charge", scope("k1"), Some(1), Duration::from_secs(5));
        let (id2, _) = a.start("charge", scope("k2"), Some(2), Duration::ZERO);
        assert_eq!(a.requests(), 2, "k1 runs: nothing may be forgotten yet");
        assert!(matches!(
            commit(&mut a, id2, &mut charges),
            Committed::Ran(_)
        ));
        assert!(matches!(
            commit(&mut a, running, &mut charges),
            Committed::Ran(_)
        ));
        a.start("charge", scope("k3"), Some(3), Duration::ZERO);
        assert_eq!(a.requests(), 1);
        assert_eq!(a.forgotten().requests, 2);
    }
}
