//! What the invariants remember of a run, recorded as it happens: when each token was granted,
//! why its key was free (judged legitimate or not), how each record ended, outages, clock steps,
//! lost answers. The world writes it; `crate::check` reads it.

use super::faults::Outage;
use super::World;
use crate::state_api::{Deleter, Grant, Scope};
use crate::upstream::Produced;
use state_rules::RecordState;
use std::collections::{BTreeMap, BTreeSet};

/// What the invariants remember of a run (times are global, in ms).
#[derive(Debug, Default)]
pub struct Evidence {
    /// When each token was granted, and to which worker (index, generation) it was answered.
    pub granted_at: BTreeMap<i64, u64>,
    pub granted_to: BTreeMap<i64, (usize, u32)>,
    /// The key secret each token's record was made under.
    pub secret_of: BTreeMap<i64, u32>,
    /// The last time the state API heard from each token's owner: its grant, an accepted
    /// heartbeat, its unknown mark, its complete.
    pub last_sign: BTreeMap<i64, u64>,
    /// Why the key was free for each token granted as a new key or by a reuse: the token
    /// whose record made way, whether that was legitimate, and how (for the violation).
    pub freed: BTreeMap<i64, Freed>,
    /// When each token's owner marked its record unknown (the `seq` of the mark).
    pub owner_marks: BTreeMap<i64, u64>,
    /// When each heartbeat of a token failed, as its owner heard it.
    pub heartbeat_failures: BTreeMap<i64, Vec<u64>>,
    /// Since when each (worker, generation, token) is held (registered for heartbeats), and
    /// since when a write of it is pending.
    pub held_since: BTreeMap<(usize, u32, i64), u64>,
    pub write_since: BTreeMap<(usize, u32, i64), u64>,
    /// Database outages (crashes, restarts, pauses) and when they ended.
    pub database_outages: Vec<(u64, u64, Outage)>,
    /// When the state API process was down (connections refused).
    pub api_outages: Vec<(u64, u64)>,
    /// Clock steps of each worker: (when, by how much).
    pub clock_steps: BTreeMap<usize, Vec<(u64, i64)>>,
    /// Scopes invariant 8 leaves out: a worker died holding a grant for them.
    pub grant_died: BTreeSet<Scope>,
    /// A worker gave a write up (invariant 8 is left out for the endpoint its log names, or
    /// for the run when it names none).
    pub gave_up_a_write: bool,
    pub gave_up_for: BTreeSet<String>,
    /// Claims the state API committed whose answer never reached the filter, by scope (how).
    pub lost_grants: BTreeMap<Scope, String>,
    /// How the last record of each scope ended (deleted, or reused past its retention), and
    /// every end, in order.
    pub scope_end: BTreeMap<Scope, Freed>,
    pub ends: BTreeMap<Scope, Vec<Freed>>,
    /// For each token whose record an operator deleted: how long its owner had been silent,
    /// and its lease.
    pub operator_silent: BTreeMap<i64, (u64, u64)>,
    /// Scopes an operator released, purged or resolved (the promise starts over for them).
    pub operator_scopes: BTreeSet<Scope>,
    /// Scopes an operator resolved: the streams opened from then on (index and up) and the
    /// answer the operator stored, the only one they may be replayed.
    pub resolved: BTreeMap<Scope, (usize, Produced)>,
    /// Operator answers a later grant replaced, each with how many streams were open by then:
    /// one of those streams may still get it, its reply decided while the answer stood and
    /// delivered later (a deferred reply, sent at the next tick).
    pub resolved_before: BTreeMap<Scope, Vec<(usize, Produced)>>,
    /// The retention of each token's record, as the state API kept it.
    pub retention_of: BTreeMap<i64, u64>,
    /// Answers Envoy made itself for a scope after forwarding (status, details).
    pub envoy_replies: Vec<(Scope, Produced, String)>,
    /// Answers the reconcile endpoints gave, by the scope they were asked for.
    pub reconcile_answers: Vec<(Scope, Produced)>,
    /// The streams whose request reached the upstream under each fencing token.
    pub arrivals: BTreeMap<i64, Vec<usize>>,
}

/// Why a key was free when a token was granted, or how a record ended.
#[derive(Debug, Clone)]
pub struct Freed {
    /// The token whose record made way (none: there was none at the address).
    pub from: Option<i64>,
    pub legit: bool,
    pub how: String,
    /// When.
    pub at: u64,
}

impl Evidence {
    /// A record of `scope` ended: it is the scope's last end unless a newer record (a larger
    /// token) ended before it (an older record can outlive a newer one under another key
    /// secret).
    pub fn record_ended(&mut self, scope: &Scope, end: Freed) {
        self.ends
            .entry(scope.clone())
            .or_default()
            .push(end.clone());
        let newer = self.scope_end.get(scope).is_some_and(|e| e.from > end.from);
        if !newer {
            self.scope_end.insert(scope.clone(), end);
        }
    }

    /// Whether a re-execution (or a second charge) with `token` after the earlier one with
    /// `prior` is allowed because the key became free legitimately in between; otherwise why
    /// it was free.
    pub fn freed_since(&self, scope: &Scope, prior: i64, token: i64) -> Result<(), String> {
        // The outcome of `prior` was legitimately let go before `token` was granted: a record
        // at least as new as `prior`'s ended legitimately by then.
        let granted = self.granted_at.get(&token).copied().unwrap_or(u64::MAX);
        let ends = self.ends.get(scope).map(Vec::as_slice).unwrap_or_default();
        let since = |e: &&Freed| e.from.is_some_and(|q| q >= prior) && e.at <= granted;
        if ends.iter().filter(since).any(|e| e.legit) {
            return Ok(());
        }
        let f = self.freed.get(&token);
        if let Some(f) = f.filter(|f| !f.legit) {
            return Err(format!(": token {token} was granted {}", f.how));
        }
        if let Some(e) = ends.iter().rev().find(since) {
            return Err(format!(
                ": token {token} was granted as a new key: {}",
                e.how
            ));
        }
        match (self.secret_of.get(&prior), self.secret_of.get(&token)) {
            (Some(a), Some(b)) if a != b => Err(format!(
                ": token {token} was granted as a new key under key secret {b} while token {prior}'s record lived under key secret {a} (a rotation of the key secret)"
            )),
            _ => Err(f
                .map(|f| format!(": token {token} was granted {}", f.how))
                .unwrap_or_default()),
        }
    }
}

fn retention_of(w: &World, token: i64) -> u64 {
    w.ev.retention_of
        .get(&token)
        .copied()
        .unwrap_or(w.setup.state_api.retention_ms)
}

/// How long `token`'s record must be kept after its owner's last sign of life: its retention,
/// or, without a stored outcome (unknown), the unknown outcomes' horizon if longer.
fn kept_for(w: &World, token: i64, without_outcome: bool) -> u64 {
    let retention = retention_of(w, token);
    if without_outcome {
        retention.max(w.setup.state_api.unknown_retention_ms)
    } else {
        retention
    }
}

/// Whether the record at `address` holding `token` has its outcome stored.
fn has_outcome(w: &World, address: (u32, Scope), token: i64) -> bool {
    w.api
        .records
        .get(&address)
        .is_some_and(|r| r.token == token && r.state == RecordState::Completed)
}

/// Why the key of a claim's grant was free (the state API's [`Grant`]), judged.
pub(super) fn judge_grant(w: &World, scope: &Scope, how: &Grant) -> Freed {
    match how {
        // A record of the key lives under another key secret (it could not be found): that
        // is legitimate only once it could have gone anyway (a retention past its owner's last
        // sign of life; the unknown outcomes' horizon if longer for one without an outcome).
        Grant::New {
            elsewhere: Some((secret, token)),
            secret: mine,
        } => Freed {
            from: Some(*token),
            legit: silent_for(w, *token)
                >= kept_for(w, *token, !has_outcome(w, (*secret, scope.clone()), *token)),
            how: format!(
                "as a new key under key secret {mine} while token {token}'s record lived under key secret {secret} (a rotation of the key secret), {} ms after its owner's last sign of life",
                silent_for(w, *token)
            ),
            at: w.now,
        },
        // No record anywhere: the last one of the scope ended, legitimately or not.
        Grant::New { .. } => match w.ev.scope_end.get(scope) {
            Some(end) => Freed {
                from: end.from,
                legit: end.legit,
                how: format!("as a new key: {}", end.how),
                at: w.now,
            },
            None => Freed {
                from: None,
                legit: true,
                how: "as a new key".into(),
                at: w.now,
            },
        },
        Grant::RetentionReuse {
            from,
            was_in_progress,
        } => {
            let retention = kept_for(w, *from, *was_in_progress);
            let silent = silent_for(w, *from);
            Freed {
                from: Some(*from),
                legit: silent >= retention,
                how: format!(
                    "as a new key past its retention: token {from}'s record ({}, retention {retention} ms) was reused {silent} ms after its owner's last sign of life",
                    if *was_in_progress { "its outcome never stored" } else { "completed" },
                ),
                at: w.now,
            }
        }
        Grant::Reclaimed { from } => Freed {
            from: Some(*from),
            legit: false,
            how: format!("by taking over token {from}'s unknown outcome"),
            at: w.now,
        },
    }
}

/// How long the state API has not heard from `token`'s owner.
fn silent_for(w: &World, token: i64) -> u64 {
    w.now
        .saturating_sub(w.ev.last_sign.get(&token).copied().unwrap_or(0))
}

/// A record of `token` was deleted by `by`: whether that was legitimate, and how.
pub(super) fn judge_deletion(
    w: &World,
    token: i64,
    by: Deleter,
    state: state_rules::RecordState,
) -> Freed {
    let silent = silent_for(w, token);
    let (legit, how) = match by {
        Deleter::Owner => (true, "its owner released it".to_owned()),
        Deleter::Abandon | Deleter::GoneCaller => (true, by.describe().to_owned()),
        Deleter::Purge => {
            let retention = kept_for(w, token, state != state_rules::RecordState::Completed);
            (
                silent >= retention,
                format!(
                    "the purge deleted it past its retention ({retention} ms), {silent} ms after its owner's last sign of life"
                ),
            )
        }
        Deleter::OperatorRelease | Deleter::OperatorPurge => {
            let (silent, lease) =
                w.ev.operator_silent
                    .get(&token)
                    .copied()
                    .unwrap_or((silent, w.setup.lease_ms));
            (
                silent >= lease,
                format!(
                    "{} deleted it when its owner had been silent {silent} ms while the database served (its lease is {lease} ms)",
                    by.describe()
                ),
            )
        }
    };
    Freed {
        from: Some(token),
        legit,
        how: format!("token {token}'s record was gone ({how})"),
        at: w.now,
    }
}

/// The database outage that just ended, for invariant 6.
pub(super) fn outage_ended(w: &mut World, since: u64, outage: Outage) {
    match outage {
        Outage::Database { .. } | Outage::Paused => {
            w.ev.database_outages.push((since, w.now, outage))
        }
        Outage::ApiDown => w.ev.api_outages.push((since, w.now)),
        Outage::None => {}
    }
}

impl World {
    /// What each worker holds, noted after every step: since when each token is held
    /// (registered for heartbeats), and since when a write of it is pending.
    pub(super) fn note_holdings(&mut self) {
        let now = self.now;
        for (i, sw) in self.workers.iter().enumerate() {
            let Some(wk) = &sw.w else { continue };
            for t in wk.held_tokens() {
                self.ev
                    .held_since
                    .entry((i, sw.generation, t))
                    .or_insert(now);
            }
            for (t, since) in wk.write_tokens() {
                // Handed over at `since` on the worker's own clock.
                let at = since.saturating_sub(sw.steady_ms);
                self.ev
                    .write_since
                    .entry((i, sw.generation, t))
                    .or_insert(at);
            }
        }
    }
}
