//! What happened in one scenario of the partition tests, and the checks it must pass (issue 35).
//!
//! The history holds every client request (when it was sent, through which Envoy, and what came
//! back: an answer, nothing before the client gave up, or no HTTP answer at all) and every
//! fault (a cut, a heal, a slowed link), on one clock. After the scenario it is joined with
//! what the checkout really did (its attempts ledger: each attempt's fencing token, whether it
//! executed, the status and SHA-256 of the response it produced, by the wall clock) and
//! checked per key:
//!
//! 1. at most one execution (on a `reexecute` route, a later execution only with a larger
//!    fencing token, in commit order: the checkout refused the earlier token from then on);
//! 2. every replay is an execution's response byte for byte (status and body);
//! 3. no replay for a key that never executed;
//! 4. no completed outcome lost: a key whose client got the upstream's answer replays it after
//!    healing, through every Envoy;
//! 5. no key whose request was never forwarded stays unusable longer than one lease after
//!    healing (counted from when new keys are served again); once an attempt of it reaches the
//!    checkout, the key is in use and a retry meeting that attempt is not a refusal.
//!
//! A violation names its key and time; [`History::window`] prints what happened around it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::client::Answer;

/// Milliseconds since the history began.
pub type Ms = u64;

/// What part of a scenario a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// The storm: clients with one key each, retrying until they get its outcome.
    Storm,
    /// A new key every few hundred ms through each Envoy: how long new keys are refused.
    Probe,
    /// After healing: every key asked once more, through every Envoy.
    Verify,
}

/// What an answer was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// The upstream's own answer (not a replay).
    Executed,
    /// A stored response replayed (`Idempotent-Replayed: true`).
    Replay,
    /// 409 `request-in-progress`.
    InProgress,
    /// 409 `outcome-unknown` (a held route).
    OutcomeUnknown,
    /// The checkout's own 409 `stale-fencing-token`: a late attempt refused upstream.
    StaleToken,
    /// 503 `idempotency-state-unavailable`.
    StateUnavailable,
    /// 503 `reconcile-unavailable`.
    ReconcileUnavailable,
    /// Envoy's own answer for the upstream (a timeout, a failed connection).
    EnvoyLocal,
    /// The client gave up waiting.
    GaveUp,
    /// No HTTP answer (connection refused or reset).
    NoAnswer,
    Other,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replay => "replay",
            Self::InProgress => "in_progress_409",
            Self::OutcomeUnknown => "outcome_unknown_409",
            Self::StaleToken => "stale_token_409",
            Self::StateUnavailable => "state_unavailable_503",
            Self::ReconcileUnavailable => "reconcile_unavailable_503",
            Self::EnvoyLocal => "envoy_local",
            Self::GaveUp => "gave_up",
            Self::NoAnswer => "no_answer",
            Self::Other => "other",
        }
    }

    /// The key's outcome, seen by its client: the story ends.
    pub fn is_outcome(self) -> bool {
        matches!(self, Self::Executed | Self::Replay)
    }

    /// What an answer from Envoy is.
    pub fn of(a: &Answer) -> Self {
        let replayed = a.header("idempotent-replayed").as_deref() == Some("true");
        let problem = a.problem_type().unwrap_or_default();
        let is = |slug: &str| problem.ends_with(&format!("/{slug}"));
        match a.status {
            _ if replayed => Self::Replay,
            409 if is("request-in-progress") => Self::InProgress,
            409 if is("outcome-unknown") => Self::OutcomeUnknown,
            409 if is("stale-fencing-token") => Self::StaleToken,
            503 if is("idempotency-state-unavailable") => Self::StateUnavailable,
            503 if is("reconcile-unavailable") => Self::ReconcileUnavailable,
            // Envoy's own replies are plain text (the checkout's answers are JSON).
            502..=504 if a.header("content-type").as_deref() == Some("text/plain") => {
                Self::EnvoyLocal
            }
            200..=299 | 402 => Self::Executed,
            _ => Self::Other,
        }
    }
}

/// One client request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub key: String,
    pub endpoint: String,
    pub envoy: usize,
    pub phase: Phase,
    pub sent: Ms,
    pub ended: Ms,
    pub kind: Kind,
    /// The answer's status and the SHA-256 (hex) of its body; none without an answer.
    pub status: Option<u16>,
    pub body_sha256: Option<String>,
}

/// A fault or a heal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub at: Ms,
    pub what: String,
    /// True for a heal (the network as it was), false for a cut or a slowed link.
    pub heal: bool,
    /// The Envoy whose link to the upstream this cuts: a request it forwarded meanwhile may be
    /// lost on the way (forwarded, yet never seen by the checkout).
    pub upstream_of: Option<usize>,
}

/// One attempt the checkout recorded (`GET /attempts`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub key: String,
    pub token: Option<i64>,
    /// `running`, `executed`, `fenced` or `abandoned`.
    pub state: String,
    /// The ledger id of its execution: the order of commits.
    pub charge_id: Option<u64>,
    pub started: Ms,
    pub ended: Option<Ms>,
    pub response_status: Option<u16>,
    pub response_sha256: Option<String>,
}

/// What a route does with an unknown outcome (the checks differ for `reexecute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Hold,
    Reconcile,
    Reexecute,
}

/// The clock and the record of one scenario.
pub struct History {
    origin: Instant,
    origin_unix_ms: u64,
    inner: Mutex<(Vec<Request>, Vec<Fault>)>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl History {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
            origin_unix_ms: unix_ms(),
            inner: Mutex::new((Vec::new(), Vec::new())),
        }
    }

    pub fn now(&self) -> Ms {
        self.origin.elapsed().as_millis() as Ms
    }

    /// A wall-clock time (Unix ms, the checkout's) on this history's clock.
    pub fn from_unix_ms(&self, unix: u64) -> Ms {
        unix.saturating_sub(self.origin_unix_ms)
    }

    /// Records a request that was sent at `sent` and ended now, with `answer` (`Ok(None)`: the
    /// client gave up; `Err`: no HTTP answer).
    pub fn request(
        &self,
        key: &str,
        endpoint: &str,
        envoy: usize,
        phase: Phase,
        sent: Ms,
        answer: &Result<Option<Answer>, String>,
    ) -> Kind {
        let (kind, status, body_sha256) = match answer {
            Ok(Some(a)) => (
                Kind::of(a),
                Some(a.status),
                Some(crate::testkit::sha256_hex(&a.body)),
            ),
            Ok(None) => (Kind::GaveUp, None, None),
            Err(_) => (Kind::NoAnswer, None, None),
        };
        let r = Request {
            key: key.to_owned(),
            endpoint: endpoint.to_owned(),
            envoy,
            phase,
            sent,
            ended: self.now(),
            kind,
            status,
            body_sha256,
        };
        self.lock().0.push(r);
        kind
    }

    /// Records a fault (or a heal) now; says it on stderr.
    pub fn fault(&self, what: &str, heal: bool, upstream_of: Option<usize>) -> Ms {
        let at = self.now();
        eprintln!(
            "  [{:>6} ms] {} {what}",
            at,
            if heal { "heal" } else { "FAULT" }
        );
        self.lock().1.push(Fault {
            at,
            what: what.to_owned(),
            heal,
            upstream_of,
        });
        at
    }

    pub fn requests(&self) -> Vec<Request> {
        self.lock().0.clone()
    }

    pub fn faults(&self) -> Vec<Fault> {
        self.lock().1.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<Request>, Vec<Fault>)> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The checkout's attempts (`GET /attempts`, JSON) of this history's keys.
    pub fn attempts_from(&self, listed: &serde_json::Value) -> Vec<Attempt> {
        let keys: BTreeSet<String> = self.requests().into_iter().map(|r| r.key).collect();
        listed
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| {
                let key = a["idempotency_key"].as_str()?;
                keys.contains(key).then(|| Attempt {
                    key: key.to_owned(),
                    token: a["fencing_token"].as_i64(),
                    state: a["state"].as_str().unwrap_or("?").to_owned(),
                    charge_id: a["charge_id"].as_u64(),
                    started: self.from_unix_ms(a["started_unix_ms"].as_u64().unwrap_or(0)),
                    ended: a["ended_unix_ms"].as_u64().map(|t| self.from_unix_ms(t)),
                    response_status: a["response_status"].as_u64().map(|s| s as u16),
                    response_sha256: a["response_sha256"].as_str().map(str::to_owned),
                })
            })
            .collect()
    }

    /// The whole history, one line per event in time order (faults, requests, the checkout's
    /// attempts), for a run kept to read later.
    pub fn dump(&self, attempts: &[Attempt]) -> String {
        let mut lines: Vec<(Ms, String)> = Vec::new();
        for f in self.faults() {
            let kind = if f.heal { "heal " } else { "FAULT" };
            lines.push((f.at, format!("{kind} {}", f.what)));
        }
        for r in self.requests() {
            lines.push((
                r.sent,
                format!(
                    "{} {} via envoy{} ({:?}) -> {} after {} ms",
                    r.key,
                    r.endpoint,
                    r.envoy + 1,
                    r.phase,
                    r.kind.name(),
                    r.ended - r.sent
                ),
            ));
        }
        for a in attempts {
            lines.push((
                a.started,
                format!(
                    "{} checkout attempt token {:?}: {} at {:?} ms",
                    a.key, a.token, a.state, a.ended
                ),
            ));
        }
        lines.sort();
        lines
            .into_iter()
            .map(|(t, l)| format!("{t:>7} {l}\n"))
            .collect()
    }

    /// Everything around `at` (± `span`): every fault, `key`'s requests and attempts, and what
    /// the other requests got meanwhile.
    pub fn window(&self, key: &str, at: Ms, span: Ms, attempts: &[Attempt]) -> String {
        let (from, to) = (at.saturating_sub(span), at + span);
        let mut lines: Vec<(Ms, String)> = Vec::new();
        for f in self.faults() {
            lines.push((
                f.at,
                format!("{} {}", if f.heal { "heal " } else { "FAULT" }, f.what),
            ));
        }
        let mut others: BTreeMap<&'static str, usize> = BTreeMap::new();
        let mut own_outside = 0;
        let requests = self.requests();
        // Its first requests too: where a key got stuck is often long before it is caught.
        let first: Vec<Ms> = requests
            .iter()
            .filter(|r| r.key == key)
            .map(|r| r.sent)
            .take(4)
            .collect();
        for r in &requests {
            let inside = r.sent <= to && r.ended >= from;
            if r.key == key && (inside || first.contains(&r.sent)) {
                lines.push((
                    r.sent,
                    format!(
                        "request via envoy{} ({:?}) -> {} after {} ms{}",
                        r.envoy + 1,
                        r.phase,
                        r.kind.name(),
                        r.ended - r.sent,
                        r.status.map(|s| format!(" [{s}]")).unwrap_or_default()
                    ),
                ));
            } else if r.key == key {
                own_outside += 1;
            } else if inside {
                *others.entry(r.kind.name()).or_insert(0) += 1;
            }
        }
        for a in attempts.iter().filter(|a| a.key == key) {
            lines.push((
                a.started,
                format!(
                    "checkout attempt token {:?} started, {} at {}",
                    a.token,
                    a.state,
                    a.ended.map_or("-".to_owned(), |t| format!("{t} ms"))
                ),
            ));
        }
        lines.sort();
        let mut out = format!(
            "history of {key} from {from} to {to} ms (every fault; its first requests and those in \
             the window, {own_outside} more outside it; its attempts):\n"
        );
        for (t, line) in lines {
            let mark = if (from..=to).contains(&t) { ">" } else { " " };
            let _ = writeln!(out, "  {mark}{t:>7} ms  {line}");
        }
        let _ = writeln!(
            out,
            "  other requests within {from}..{to} ms: {}",
            others
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        out
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One broken promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub key: String,
    pub at: Ms,
    pub what: String,
}

/// The checks' figures for one scenario, and what broke.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    pub requests: usize,
    pub keys: usize,
    pub executions: usize,
    pub double_executions: usize,
    pub lost_outcomes: usize,
    pub bad_replays: usize,
    pub replays_without_execution: usize,
    pub unusable_keys: usize,
    /// Answers the contract does not list (a 500, a 422 to the same body, ...).
    pub unexpected_answers: usize,
    /// Keys whose outcome no client saw and that are held unknown (allowed: the edge cannot
    /// know what became of them).
    pub held_unknown: usize,
    pub answers: BTreeMap<&'static str, usize>,
    /// For each fault and heal: how long new keys were refused through each Envoy after it.
    pub refused_after: Vec<(String, Vec<Option<Ms>>)>,
    pub violations: Vec<Violation>,
}

/// What the checker needs besides the history.
pub struct CheckInput<'a> {
    pub attempts: &'a [Attempt],
    pub policies: &'a BTreeMap<String, Policy>,
    pub lease_ms: Ms,
    /// When the network was whole again (the last heal).
    pub healed_at: Ms,
    pub envoys: usize,
    /// Extra time a key may take after a lease past healing: a request's round trip and the
    /// retry pacing of the client.
    pub tolerance_ms: Ms,
}

impl Verdict {
    /// Runs every check on `history`.
    pub fn check(history: &History, input: &CheckInput<'_>) -> Self {
        let requests = history.requests();
        let faults = history.faults();
        let mut v = Verdict {
            requests: requests.len(),
            ..Self::default()
        };
        for r in &requests {
            *v.answers.entry(r.kind.name()).or_insert(0) += 1;
        }
        v.refused_after = refused_after(&requests, &faults, input.envoys);
        let served_again = served_again_at(&requests, input.healed_at);

        let mut by_key: BTreeMap<&str, Vec<&Request>> = BTreeMap::new();
        for r in &requests {
            by_key.entry(r.key.as_str()).or_default().push(r);
        }
        let mut attempts_of: BTreeMap<&str, Vec<&Attempt>> = BTreeMap::new();
        for a in input.attempts {
            attempts_of.entry(a.key.as_str()).or_default().push(a);
        }
        v.keys = by_key.len();
        for (key, reqs) in &by_key {
            let policy = input
                .policies
                .get(&reqs[0].endpoint)
                .copied()
                .unwrap_or(Policy::Hold);
            let attempts = attempts_of.get(key).cloned().unwrap_or_default();
            v.check_key(key, reqs, &attempts, policy, &faults, input, served_again);
        }
        v
    }

    #[allow(clippy::too_many_arguments)]
    fn check_key(
        &mut self,
        key: &str,
        reqs: &[&Request],
        attempts: &[&Attempt],
        policy: Policy,
        faults: &[Fault],
        input: &CheckInput<'_>,
        served_again: Ms,
    ) {
        let violation = |v: &mut Self, at: Ms, what: String| {
            v.violations.push(Violation {
                key: key.to_owned(),
                at,
                what,
            })
        };
        let mut executed: Vec<&Attempt> = attempts
            .iter()
            .copied()
            .filter(|a| a.state == "executed")
            .collect();
        executed.sort_by_key(|a| a.charge_id);
        self.executions += executed.len();

        // 1. At most one execution; on reexecute routes, tokens rising in commit order.
        let double = match policy {
            Policy::Reexecute => executed
                .windows(2)
                .any(|w| w[1].token.unwrap_or(0) <= w[0].token.unwrap_or(0)),
            Policy::Hold | Policy::Reconcile => executed.len() > 1,
        };
        if double {
            self.double_executions += 1;
            let at = executed.get(1).and_then(|a| a.ended).unwrap_or(0);
            violation(
                self,
                at,
                format!(
                    "executed {} times (tokens {:?}, {policy:?} route)",
                    executed.len(),
                    executed.iter().map(|a| a.token).collect::<Vec<_>>()
                ),
            );
        }

        // 2 and 3. Every upstream answer and replay is an execution's response.
        let is_execution = |status: Option<u16>, sha: &Option<String>| {
            executed
                .iter()
                .any(|a| a.response_status == status && a.response_sha256 == *sha)
        };
        for r in reqs.iter().filter(|r| r.kind.is_outcome()) {
            if executed.is_empty() {
                if r.kind == Kind::Replay {
                    self.replays_without_execution += 1;
                }
                violation(
                    self,
                    r.ended,
                    format!(
                        "{} through envoy{} but the checkout never executed this key",
                        r.kind.name(),
                        r.envoy + 1
                    ),
                );
            } else if !is_execution(r.status, &r.body_sha256) {
                self.bad_replays += 1;
                violation(
                    self,
                    r.ended,
                    format!(
                        "{} through envoy{} is not the execution's response byte for byte \
                         (status {:?}, body sha256 {:?})",
                        r.kind.name(),
                        r.envoy + 1,
                        r.status,
                        r.body_sha256
                    ),
                );
            }
        }

        for r in reqs.iter().filter(|r| r.kind == Kind::Other) {
            self.unexpected_answers += 1;
            violation(
                self,
                r.ended,
                format!(
                    "an answer the contract does not list: status {:?} through envoy{}",
                    r.status,
                    r.envoy + 1
                ),
            );
        }

        // 4. A key whose client got the upstream's answer replays it after healing, through
        // every Envoy (the last verification answer of each).
        let saw_outcome = reqs
            .iter()
            .any(|r| r.phase != Phase::Verify && r.kind.is_outcome());
        if saw_outcome {
            for envoy in 0..input.envoys {
                let last = reqs
                    .iter()
                    .filter(|r| r.phase == Phase::Verify && r.envoy == envoy)
                    .max_by_key(|r| r.sent);
                match last {
                    Some(r) if r.kind == Kind::Replay => {}
                    Some(r) => {
                        self.lost_outcomes += 1;
                        violation(
                            self,
                            r.ended,
                            format!(
                                "its client got the outcome, yet after healing envoy{} answers {}",
                                envoy + 1,
                                r.kind.name()
                            ),
                        );
                    }
                    None => {
                        self.lost_outcomes += 1;
                        violation(
                            self,
                            input.healed_at,
                            format!("never asked again through envoy{} after healing", envoy + 1),
                        );
                    }
                }
            }
        }

        // 5. Never forwarded before the heal (no attempt reached the checkout, and none could
        // have been lost on a cut link to it): usable within a lease once new keys are served.
        let forwarded_before_heal = attempts.iter().any(|a| a.started < input.healed_at);
        let maybe_lost_upstream = reqs.iter().any(|r| {
            faults
                .iter()
                .any(|f| f.upstream_of == Some(r.envoy) && cut_overlaps(faults, f, r.sent, r.ended))
        });
        if !forwarded_before_heal && !maybe_lost_upstream {
            let since = served_again.max(input.healed_at);
            let limit = since + input.lease_ms + input.tolerance_ms;
            // Once an attempt reaches the checkout the key is in use: a refusal after that is
            // a retry meeting its running attempt (409 in progress), not a key held unusable.
            let first_forwarded = attempts.iter().map(|a| a.started).min();
            let refused_late = reqs
                .iter()
                .filter(|r| !r.kind.is_outcome() && r.sent > limit)
                .filter(|r| first_forwarded.is_none_or(|at| r.sent < at))
                .min_by_key(|r| r.sent);
            let served = first_forwarded.is_some() || reqs.iter().any(|r| r.kind.is_outcome());
            if refused_late.is_some() || !served {
                self.unusable_keys += 1;
                let last = reqs.iter().max_by_key(|r| r.sent);
                let (at, answer) = match refused_late.or(last) {
                    Some(r) => (r.sent, r.kind.name()),
                    None => (limit, "-"),
                };
                violation(
                    self,
                    at,
                    format!(
                        "never forwarded before the heal, yet refused ({answer}) at {at} ms, more than \
                         a lease ({} ms) after new keys were served again at {since} ms{}",
                        input.lease_ms,
                        if served { "" } else { "; never served" }
                    ),
                );
            }
        }
        let last = reqs.iter().max_by_key(|r| r.sent);
        if !saw_outcome && last.is_some_and(|r| r.kind == Kind::OutcomeUnknown) {
            self.held_unknown += 1;
        }
    }

    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The figures, as docs/RELIABILITY.md quotes them.
    pub fn figures(&self) -> serde_json::Value {
        serde_json::json!({
            "requests": self.requests, "keys": self.keys, "executions": self.executions,
            "double_executions": self.double_executions, "lost_outcomes": self.lost_outcomes,
            "bad_replays": self.bad_replays, "replays_without_execution": self.replays_without_execution,
            "unusable_keys": self.unusable_keys, "unexpected_answers": self.unexpected_answers,
            "held_unknown": self.held_unknown,
            "answers": self.answers,
            "new_keys_refused_ms": self.refused_after.iter().map(|(what, per)| {
                serde_json::json!({"after": what, "per_envoy": per})
            }).collect::<Vec<_>>(),
        })
    }

    /// A few lines for the test's output.
    pub fn summary(&self) -> String {
        let mut out = format!(
            "requests {}, keys {}, executions {}, double executions {}, lost outcomes {}, \
             bad replays {}, replays without execution {}, keys unusable {}, unexpected answers {}, \
             held unknown {}\n  answers: {}\n",
            self.requests,
            self.keys,
            self.executions,
            self.double_executions,
            self.lost_outcomes,
            self.bad_replays,
            self.replays_without_execution,
            self.unusable_keys,
            self.unexpected_answers,
            self.held_unknown,
            self.answers
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (what, per) in &self.refused_after {
            let per: Vec<String> = per
                .iter()
                .enumerate()
                .map(|(i, ms)| match ms {
                    Some(ms) => format!("envoy{} {ms} ms", i + 1),
                    None => format!("envoy{} until the end", i + 1),
                })
                .collect();
            let _ = writeln!(out, "  new keys refused after {what}: {}", per.join(", "));
        }
        out
    }
}

/// Whether the cut `f` was in force at some time in `from..=to` (until its heal, the next heal
/// that names the same thing, or for ever).
fn cut_overlaps(faults: &[Fault], f: &Fault, from: Ms, to: Ms) -> bool {
    if f.heal {
        return false;
    }
    let healed = faults
        .iter()
        .filter(|h| h.heal && h.at >= f.at && (h.what == f.what || h.what == "everything"))
        .map(|h| h.at)
        .min()
        .unwrap_or(Ms::MAX);
    f.at <= to && healed >= from
}

/// The first moment after `healed_at` a probe's new key was executed through any Envoy.
fn served_again_at(requests: &[Request], healed_at: Ms) -> Ms {
    requests
        .iter()
        .filter(|r| r.phase == Phase::Probe && r.sent >= healed_at && r.kind == Kind::Executed)
        .map(|r| r.ended)
        .min()
        .unwrap_or(healed_at)
}

/// For each fault and heal: per Envoy, from it to the first probe sent after it that executed
/// (however many faults came meanwhile; None: none executed before the probes stopped).
fn refused_after(
    requests: &[Request],
    faults: &[Fault],
    envoys: usize,
) -> Vec<(String, Vec<Option<Ms>>)> {
    faults
        .iter()
        .map(|f| {
            let per = (0..envoys)
                .map(|e| {
                    requests
                        .iter()
                        .filter(|r| {
                            r.phase == Phase::Probe
                                && r.envoy == e
                                && r.sent >= f.at
                                && r.kind == Kind::Executed
                        })
                        .map(|r| r.ended - f.at)
                        .min()
                })
                .collect();
            let kind = if f.heal { "heal" } else { "fault" };
            (format!("{kind} {} ({} ms)", f.what, f.at), per)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(
        key: &str,
        envoy: usize,
        phase: Phase,
        at: Ms,
        kind: Kind,
        sha: Option<&str>,
    ) -> Request {
        Request {
            key: key.into(),
            endpoint: "/checkout".into(),
            envoy,
            phase,
            sent: at,
            ended: at + 5,
            kind,
            status: sha.map(|_| 201),
            body_sha256: sha.map(str::to_owned),
        }
    }

    fn executed(key: &str, token: i64, charge: u64, sha: &str) -> Attempt {
        Attempt {
            key: key.into(),
            token: Some(token),
            state: "executed".into(),
            charge_id: Some(charge),
            started: 10,
            ended: Some(20),
            response_status: Some(201),
            response_sha256: Some(sha.into()),
        }
    }

    fn check(h: &History, attempts: &[Attempt], policy: Policy, healed_at: Ms) -> Verdict {
        let policies = BTreeMap::from([("/checkout".to_owned(), policy)]);
        Verdict::check(
            h,
            &CheckInput {
                attempts,
                policies: &policies,
                lease_ms: 3_000,
                healed_at,
                envoys: 2,
                tolerance_ms: 1_000,
            },
        )
    }

    fn history(requests: Vec<Request>) -> History {
        let h = History::new();
        h.lock().0.extend(requests);
        h
    }

    /// A key executed once, its outcome seen, replayed through both Envoys after healing.
    fn good(key: &str) -> Vec<Request> {
        vec![
            req(key, 0, Phase::Storm, 0, Kind::Executed, Some("aa")),
            req(key, 0, Phase::Verify, 9_000, Kind::Replay, Some("aa")),
            req(key, 1, Phase::Verify, 9_010, Kind::Replay, Some("aa")),
        ]
    }

    #[test]
    fn a_clean_history_passes() {
        let h = history(good("k"));
        let v = check(&h, &[executed("k", 1, 1, "aa")], Policy::Reconcile, 5_000);
        assert!(v.passed(), "{:?}", v.violations);
        assert_eq!((v.executions, v.keys), (1, 1));
    }

    #[test]
    fn a_second_execution_is_caught_but_a_larger_token_later_is_allowed_on_reexecute() {
        let h = history(good("k"));
        let twice = [executed("k", 1, 1, "aa"), executed("k", 2, 2, "bb")];
        let v = check(&h, &twice, Policy::Reconcile, 5_000);
        assert_eq!(v.double_executions, 1);
        let v = check(&h, &twice, Policy::Reexecute, 5_000);
        assert_eq!(v.double_executions, 0, "{:?}", v.violations);
        let backwards = [executed("k", 2, 1, "aa"), executed("k", 1, 2, "bb")];
        assert_eq!(
            check(&h, &backwards, Policy::Reexecute, 5_000).double_executions,
            1
        );
    }

    #[test]
    fn a_replay_that_is_not_the_execution_or_without_one_is_caught() {
        let mut reqs = good("k");
        reqs.push(req("k", 1, Phase::Storm, 100, Kind::Replay, Some("zz")));
        let h = history(reqs);
        assert_eq!(
            check(&h, &[executed("k", 1, 1, "aa")], Policy::Reconcile, 5_000).bad_replays,
            1
        );
        let v = check(&h, &[], Policy::Reconcile, 5_000);
        assert_eq!(v.replays_without_execution, 3);
    }

    #[test]
    fn an_outcome_seen_and_not_replayed_after_healing_is_lost() {
        let mut reqs = good("k");
        reqs.pop();
        reqs.push(req("k", 1, Phase::Verify, 9_010, Kind::InProgress, None));
        let h = history(reqs);
        let v = check(&h, &[executed("k", 1, 1, "aa")], Policy::Reconcile, 5_000);
        assert_eq!(v.lost_outcomes, 1, "{:?}", v.violations);
    }

    #[test]
    fn a_key_never_forwarded_and_held_past_a_lease_after_healing_is_unusable() {
        let held = vec![
            req("k", 0, Phase::Storm, 0, Kind::StateUnavailable, None),
            req("k", 1, Phase::Verify, 9_500, Kind::OutcomeUnknown, None),
        ];
        let v = check(&history(held), &[], Policy::Hold, 5_000);
        assert_eq!(v.unusable_keys, 1, "{:?}", v.violations);
        // Served within a lease of the heal: fine.
        let served = vec![
            req("k", 0, Phase::Storm, 0, Kind::StateUnavailable, None),
            req("k", 1, Phase::Storm, 7_000, Kind::Executed, Some("aa")),
            req("k", 0, Phase::Verify, 9_000, Kind::Replay, Some("aa")),
            req("k", 1, Phase::Verify, 9_000, Kind::Replay, Some("aa")),
        ];
        let mut late = executed("k", 1, 1, "aa");
        late.started = 7_000;
        let v = check(&history(served), &[late], Policy::Hold, 5_000);
        assert!(v.passed(), "{:?}", v.violations);
    }

    /// Seen once in CI (partition scenario 1): the key's first attempt reached a slow checkout
    /// after the heal, within a lease; its retries met it running (409) past the lease. The key
    /// was usable: the refusals were about its own running attempt.
    #[test]
    fn a_key_forwarded_within_a_lease_and_refused_while_it_runs_is_usable() {
        let reqs = vec![
            req("k", 0, Phase::Storm, 0, Kind::StateUnavailable, None),
            req("k", 0, Phase::Storm, 8_500, Kind::GaveUp, None),
            req("k", 1, Phase::Storm, 9_500, Kind::InProgress, None),
            req("k", 0, Phase::Storm, 12_000, Kind::InProgress, None),
            req("k", 0, Phase::Verify, 16_000, Kind::Replay, Some("aa")),
            req("k", 1, Phase::Verify, 16_000, Kind::Replay, Some("aa")),
        ];
        let mut slow = executed("k", 1, 1, "aa");
        (slow.started, slow.ended) = (8_500, Some(15_000));
        let v = check(&history(reqs.clone()), &[slow.clone()], Policy::Hold, 5_000);
        assert!(v.passed(), "{:?}", v.violations);
        // Forwarded only after refusals past the lease: those refusals still count.
        (slow.started, slow.ended) = (11_000, Some(15_000));
        let v = check(&history(reqs), &[slow], Policy::Hold, 5_000);
        assert_eq!(v.unusable_keys, 1, "{:?}", v.violations);
    }

    #[test]
    fn a_key_sent_while_its_envoys_upstream_link_was_cut_may_have_been_forwarded() {
        let h = history(vec![
            req("k", 0, Phase::Storm, 1_000, Kind::GaveUp, None),
            req("k", 1, Phase::Verify, 9_500, Kind::OutcomeUnknown, None),
        ]);
        h.lock().1.extend([
            Fault {
                at: 500,
                what: "envoy1<->checkout".into(),
                heal: false,
                upstream_of: Some(0),
            },
            Fault {
                at: 5_000,
                what: "envoy1<->checkout".into(),
                heal: true,
                upstream_of: Some(0),
            },
        ]);
        let v = check(&h, &[], Policy::Hold, 5_000);
        assert_eq!(v.unusable_keys, 0, "{:?}", v.violations);
        assert_eq!(v.held_unknown, 1);
    }

    #[test]
    fn the_window_shows_every_fault_the_keys_first_requests_and_those_around_the_time() {
        let mut reqs: Vec<Request> = (0..20)
            .map(|i| {
                req(
                    "k",
                    i % 2,
                    Phase::Storm,
                    1_000 * i as Ms,
                    Kind::OutcomeUnknown,
                    None,
                )
            })
            .collect();
        reqs.push(req(
            "other",
            0,
            Phase::Storm,
            15_000,
            Kind::Executed,
            Some("a"),
        ));
        let h = history(reqs);
        h.lock().1.push(Fault {
            at: 500,
            what: "a<->b".into(),
            heal: false,
            upstream_of: None,
        });
        let w = h.window("k", 15_000, 2_000, &[executed("k", 1, 1, "aa")]);
        assert!(w.contains("FAULT a<->b"), "{w}");
        assert_eq!(w.matches("request via").count(), 4 + 5, "{w}");
        assert!(w.contains("11 more outside it"), "{w}");
        assert!(w.contains("executed 1"), "{w}");
        assert!(w.contains("checkout attempt token Some(1)"), "{w}");
    }

    #[test]
    fn new_keys_refused_is_measured_from_each_fault_per_envoy() {
        let h = history(vec![
            req("p1", 0, Phase::Probe, 1_100, Kind::StateUnavailable, None),
            req("p2", 1, Phase::Probe, 1_100, Kind::Executed, Some("a")),
            req("p3", 0, Phase::Probe, 2_500, Kind::Executed, Some("b")),
        ]);
        h.lock().1.push(Fault {
            at: 1_000,
            what: "x".into(),
            heal: false,
            upstream_of: None,
        });
        let v = check(&h, &[], Policy::Reconcile, 0);
        assert_eq!(v.refused_after[0].1, vec![Some(1_505), Some(105)]);
    }
}
