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
//! request's attempts. One rule more holds per record address (endpoint, subject and key: the
//! edge's record of the key): a token lower than one already seen at the address is refused,
//! whatever its body. Every token of an address comes from its record, whose tokens only grow
//! (a new owner, a reuse, an operator's release and the next claim), so a lower one is an
//! earlier owner's late orphan (issue 46: an operator released a record whose Envoy had died
//! with its request on the wire; another body under the key ran with token 2, then the orphan
//! arrived with token 1 and would have run too).
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

/// A record address: a request's scope without its fingerprint.
type Address = (String, String, String);

fn address_of(scope: &Scope) -> Address {
    (
        scope.endpoint.clone(),
        scope.subject.clone(),
        scope.key.clone(),
    )
}

/// What the record holds of one record address.
#[derive(Debug, Default)]
struct AtAddress {
    /// The highest token seen at the address (an attempt let start, a reconcile's fence).
    highest: i64,
    /// Requests of the address in the record: forgotten with the last of them.
    requests: usize,
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
    by_address: HashMap<Address, AtAddress>,
    /// Requests in the order of their latest attempt or reconcile (each with its
    /// [`OfRequest::touched`]): the least recent is forgotten first.
    order: VecDeque<(Scope, u64)>,
    touches: u64,
    max_requests: usize,
    forgotten: Forgotten,
    /// Whether a lower token at the record address is refused (the default); off, the record
    /// keeps the per-request rules only: what the simulation's model checker uses to show the
    /// edge's own fixes hold without this help from the upstream.
    address_fence: bool,
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
            by_address: HashMap::new(),
            order: VecDeque::new(),
            touches: 0,
            max_requests: max_requests.max(1),
            forgotten: Forgotten::default(),
            address_fence: true,
        }
    }

    /// The same record keeping the per-request rules only (no fence at the record address):
    /// an upstream that follows the contract as it stood before issue 46.
    pub fn without_address_fence(mut self) -> Self {
        self.address_fence = false;
        self
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
        if !self.by_scope.contains_key(&scope) {
            self.by_address
                .entry(address_of(&scope))
                .or_default()
                .requests += 1;
        }
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
            // The address's highest token goes into what the record forgot with its last
            // request.
            let address = address_of(&scope);
            let mut address_highest = 0;
            if let Some(at) = self.by_address.get_mut(&address) {
                at.requests = at.requests.saturating_sub(1);
                if at.requests == 0 {
                    address_highest = at.highest;
                    self.by_address.remove(&address);
                }
            }
            let tokens = ids
                .iter()
                .filter_map(|id| self.by_id.remove(id))
                .filter_map(|a| a.fencing_token);
            self.forgotten.requests += 1;
            self.forgotten.highest_token = tokens
                .chain([fence, address_highest, self.forgotten.highest_token])
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
        let at_address = self
            .by_address
            .get(&address_of(scope))
            .filter(|_| self.address_fence)
            .map_or(0, |at| at.highest);
        let seen = self.highest_seen(scope, except).max(at_address);
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
        let address = address_of(&scope);
        let of = self.touch(scope);
        of.attempts.push(id);
        of.partial |= forgotten_refusal.is_some();
        if let (Some(t), false) = (token, matches!(started, Started::Refused(_))) {
            self.raise_address(address, t);
        }
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
        let address = address_of(&scope);
        let of = self.touch(scope);
        of.fence = of.fence.max(token);
        self.raise_address(address, token);
        self.forget_over_limit();
        Reconciled::NotExecuted
    }

    /// The address has seen `token` (after [`Attempts::touch`] recorded its request).
    fn raise_address(&mut self, address: Address, token: i64) {
        let at = self.by_address.entry(address).or_default();
        at.highest = at.highest.max(token);
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
mod tests;
