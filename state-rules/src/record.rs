//! One record as the rules see it, and the database clock.

use contract::wire::RecordState;

/// The database's clock as one rule sees it, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock {
    /// Now (`clock_timestamp()`).
    pub now: u64,
    /// Since when the database has served as this primary without interruption
    /// (`idempotency_serving_since()`): a lease counts as run out only once the database has
    /// served a whole lease since then, so an owner gets that long to be heard after an outage.
    pub serving_since: u64,
}

impl Clock {
    /// A database that has served since the beginning of time.
    pub fn serving(now: u64) -> Self {
        Self {
            now,
            serving_since: 0,
        }
    }
}

/// A request's fingerprint as stored: its algorithm and value.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    pub alg: String,
    pub value: String,
}

/// One record (`idempotency_records`), its times on the database clock. `R` is the stored
/// response (sealed in the store, in clear in the models).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<R> {
    pub state: RecordState,
    pub fingerprint: Fingerprint,
    /// The fencing token of the owner (the last claim that won it).
    pub token: i64,
    /// The owner's lease, as last granted or extended.
    pub lease_ms: u64,
    pub lease_until: u64,
    /// When the record may go once it has an outcome (the purge deletes it; a claim treats it
    /// as new): a retention after its outcome or its owner's last sign of life, never less.
    pub expires_at: u64,
    /// The retention the claim asked for (a complete keeps the record this long).
    pub retention_ms: u64,
    /// How long an unknown outcome is kept once marked (the state API's
    /// `--unknown-retention-s`, at least 7 days by default): a retry of an unknown outcome is
    /// exactly the dangerous one, so it is never treated as a new key within a mere retention.
    pub unknown_retention_ms: u64,
    /// The owner took the record over from an attempt under an earlier token whose outcome is
    /// unknown (a reclaim): releasing or abandoning this owner's attempt makes the record
    /// unknown again, not free. Marks of the same owner's attempt do not set it: an owner that
    /// certainly never reached the upstream frees a key only it ever held.
    pub unknown_before: bool,
    /// The stored response (completed records only).
    pub response: Option<R>,
    /// The nonce of the claim attempt that made or took over the record: the filter gives
    /// the record back by it when that claim's answer never reached it ([`crate::writes::abandon`]).
    pub claim_nonce: Option<String>,
    /// The owner's last sign of life: its claim, a heartbeat, its own unknown mark or release
    /// (not another's mark). An operator's action needs `force` within a lease of it.
    pub owner_seen: u64,
}

impl<R> Record<R> {
    /// A claim's new record: in progress under `token` from `now`.
    pub fn claimed(
        fingerprint: Fingerprint,
        token: i64,
        lease_ms: u64,
        retention_ms: u64,
        unknown_retention_ms: u64,
        claim_nonce: Option<String>,
        now: u64,
    ) -> Self {
        Self {
            state: RecordState::InProgress,
            fingerprint,
            token,
            lease_ms,
            lease_until: now.saturating_add(lease_ms),
            // The claim's expiry: created + lease + retention (see the store's CLAIM_SQL).
            expires_at: now.saturating_add(lease_ms).saturating_add(retention_ms),
            retention_ms,
            unknown_retention_ms,
            unknown_before: false,
            response: None,
            claim_nonce,
            owner_seen: now,
        }
    }

    /// In progress or unknown: its owner may still heartbeat, complete, mark or release it.
    pub fn open(&self) -> bool {
        matches!(self.state, RecordState::InProgress | RecordState::Unknown)
    }

    /// Its lease has run out, and the database has served a whole lease since it was last
    /// unavailable (the lease guard).
    pub fn lease_expired(&self, clock: Clock) -> bool {
        self.state == RecordState::InProgress
            && self.lease_until <= clock.now
            && clock.serving_since.saturating_add(self.lease_ms) <= clock.now
    }

    /// Past its retention with an outcome (stored, or marked unknown): a claim treats the key
    /// as new. A record in progress never expires by age: its owner may still extend its lease,
    /// and its expiry moves with every sign of life ([`Record::seen`]).
    pub fn retention_expired(&self, clock: Clock) -> bool {
        if crate::undo::undone(crate::undo::Fix::Retention) {
            // Before the fix: a record in progress expired too, once its lease had run out.
            return self.expires_at <= clock.now
                && (self.state == RecordState::Completed || self.lease_until <= clock.now);
        }
        self.expires_at <= clock.now && self.state != RecordState::InProgress
    }

    /// The retention counted from `at`: the expiry moves there unless it lies later already.
    pub fn keep_from(&mut self, at: u64) {
        if crate::undo::undone(crate::undo::Fix::Retention) {
            // Before the fix: the expiry counted from the claim (or the outcome) only.
            return;
        }
        self.expires_at = self.expires_at.max(at.saturating_add(self.retention_ms));
    }

    /// A sign of life of its owner with a lease until `lease_until`: kept a retention past it.
    pub fn seen(&mut self, lease_ms: u64, now: u64) {
        self.owner_seen = now;
        self.lease_ms = lease_ms;
        self.lease_until = now.saturating_add(lease_ms);
        self.keep_from(self.lease_until);
    }

    /// Marked unknown at `now` (by its owner, by a claim, by the purge): its lease ends, and
    /// the retention counts from the mark.
    /// An unknown outcome is kept its own horizon from the mark (never less than a retention).
    pub fn mark_unknown(&mut self, now: u64) {
        self.state = RecordState::Unknown;
        self.lease_until = self.lease_until.min(now);
        self.keep_from(now);
        if !crate::undo::undone(crate::undo::Fix::UnknownHorizon) {
            self.expires_at = self
                .expires_at
                .max(now.saturating_add(self.unknown_retention_ms));
        }
    }

    /// Its owner may still be running: open, and not silent for a whole lease while the
    /// database served (the lease guard, as for [`Record::lease_expired`]): an owner cut off
    /// by an outage gets a lease after it to be heard.
    pub fn owner_recent(&self, clock: Clock) -> bool {
        let heard = if crate::undo::undone(crate::undo::Fix::OperatorServing) {
            self.owner_seen
        } else {
            self.owner_seen.max(clock.serving_since)
        };
        self.open() && heard.saturating_add(self.lease_ms) > clock.now
    }

    /// Until the lease runs out, rounded up (0 once past it).
    pub fn lease_remaining_ms(&self, now: u64) -> u64 {
        self.lease_until.saturating_sub(now)
    }

    /// Until the retention expiry, rounded down (0 once past it).
    pub fn expires_in_ms(&self, now: u64) -> u64 {
        self.expires_at.saturating_sub(now)
    }
}
