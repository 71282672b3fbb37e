//! A model of the state API: its HTTP layer restated (`state-api/src/http.rs`: validation and
//! limits, the record's address during a rotation of the key secret, the answers' shapes), and
//! its record rules not restated but called: every claim, heartbeat, complete, unknown mark,
//! release, purge and operator action is the function of `state-rules` that the store carries
//! out in SQL. Time is the database clock: the simulation's global time, with the database's
//! `serving_since` (moved by a restart, not by a crash recovery in place).
//!
//! What happens to records is also told as [`Event`]s, for the invariants and their
//! explanations (why a token was granted, who deleted a record, whose lease ran out).
//!
//! This file holds the model's types and where a record lives (its address during a rotation);
//! `http.rs` validates what a call names and shapes answers, `calls.rs` routes and carries out
//! the filter's calls, `upkeep.rs` the rest (the purge, operators, a rotation, a caller gone).

use contract::wire::StoredResponse;
use state_rules::rotation;
use state_rules::{Clock, RecordState};
use std::collections::{BTreeMap, BTreeSet};

pub use contract::limits::{MAX_LEASE_MS, MIN_LEASE_MS};
pub use http::scopes_of;

mod calls;
mod http;
mod upkeep;

/// (key, subject, endpoint).
pub type Scope = (String, String, String);

/// Where a record lives: the key secret its address was made with (secrets are numbered from
/// 0, one more at each rotation) and its scope (the address is their HMAC).
pub type Address = (u32, Scope);

/// A record, its stored response in clear.
pub type Record = state_rules::Record<StoredResponse>;

/// The state API's default `--unknown-retention-s` (7 days), in ms.
pub const UNKNOWN_RETENTION_MS: u64 = 7 * 86_400_000;

#[derive(Debug, Clone)]
pub struct StateApiConfig {
    pub default_lease_ms: u64,
    /// The longest lease granted ([`MAX_LEASE_MS`]; less to model a state API that grants
    /// shorter leases than asked).
    pub max_lease_ms: u64,
    /// `--retention-s` (a claim that asks for none) and `--max-retention-s`, in ms.
    pub retention_ms: u64,
    pub max_retention_ms: u64,
    /// `--unknown-retention-s`, in ms: how long an unknown outcome is kept once marked.
    pub unknown_retention_ms: u64,
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
    /// and when: such a claim never commits (kept an hour).
    tombstones: BTreeMap<String, u64>,
    /// While a statement sent earlier runs: whether its snapshot held a tombstone for its
    /// claim's nonce (see `Callout::snapshot_abandoned`).
    pub snapshot_abandoned: Option<bool>,
    /// Every fingerprint a record was stored with, by scope.
    pub stored_fingerprints: BTreeSet<(Scope, String)>,
    /// What happened since the caller last took them ([`ModelStateApi::take_events`]).
    events: Vec<Event>,
}

/// The fingerprint key the state API derives from key secret `secret` (HKDF in the store).
fn fingerprint_key(secret: u32) -> Vec<u8> {
    format!("fingerprint key of secret {secret}").into_bytes()
}

/// How long the tombstone of an abandoned claim attempt is kept: an hour, as the purge keeps
/// an abandon's nonce row (`PURGE_NONCES_SQL`), past any statement given up at the stall limit
/// that could still commit (`world::callouts::DETACHED_MAX_MS`).
const TOMBSTONE_MS: u64 = 3_600_000;

/// An answer: HTTP status and JSON body.
pub type Answer = (u16, Vec<u8>);

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
            snapshot_abandoned: None,
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

    /// Where an owner's write finds its record: at `looked` (where `scope_of` found it, a step
    /// before), else at the current address when the record there is the write's (`ours`:
    /// its token, or an abandon's nonce), moved there meanwhile by another write of the same
    /// claim. The store's writes match `scope_hash IN (looked, current)` with the token (seed
    /// 439267646771).
    fn write_address(&self, looked: Address, ours: impl Fn(&Record) -> bool) -> Address {
        if self.records.get(&looked).is_some_and(&ours) {
            return looked;
        }
        let current = (self.secret, looked.1.clone());
        if self.records.get(&current).is_some_and(&ours) {
            current
        } else {
            looked
        }
    }

    /// The record of `scope` wherever it lives (under either secret), with its address.
    pub fn find(&self, scope: &Scope) -> Option<(Address, &Record)> {
        self.records
            .iter()
            .rev()
            .find(|((_, s), _)| s == scope)
            .map(|(a, r)| (a.clone(), r))
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
}
