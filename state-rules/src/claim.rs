//! A claim: read the record (or insert one), then decide.

use crate::record::{Clock, Fingerprint, Record};
use contract::wire::RecordState;

/// What a claim asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimTerms {
    pub fingerprint: Fingerprint,
    pub lease_ms: u64,
    pub retention_ms: u64,
    /// How long an unknown outcome is kept ([`Record::unknown_retention_ms`]).
    pub unknown_retention_ms: u64,
    /// Take an unknown outcome over (a new, larger token), or answer `Unknown`.
    pub take_over_unknown: bool,
    /// The claim attempt's nonce (kept with a record it makes or takes over).
    pub nonce: Option<String>,
    /// Its filter abandoned this attempt before it got here (the abandon left a tombstone for
    /// its nonce): it never inserts or takes a record over.
    pub abandoned: bool,
}

/// What the claim statement reads of the row it found or inserted (the store's `ClaimRow`,
/// its durations computed by the database).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    /// This claim inserted the row.
    pub inserted: bool,
    pub state: RecordState,
    pub token: i64,
    /// The stored fingerprint is the claim's (algorithm and value).
    pub same_fingerprint: bool,
    pub lease_remaining_ms: u64,
    /// See [`Record::lease_expired`].
    pub lease_expired: bool,
    /// See [`Record::retention_expired`].
    pub retention_expired: bool,
}

impl Facts {
    /// The facts of an existing record for a claim at `clock` (what the store's `claim_cols!`
    /// computes in SQL).
    pub fn of<R>(record: &Record<R>, claim: &ClaimTerms, clock: Clock) -> Self {
        Self {
            inserted: false,
            state: record.state,
            token: record.token,
            same_fingerprint: record.fingerprint == claim.fingerprint,
            lease_remaining_ms: record.lease_remaining_ms(clock.now),
            lease_expired: record.lease_expired(clock),
            retention_expired: record.retention_expired(clock),
        }
    }
}

/// What the claim does next. Order matters: an expired key is new; otherwise the fingerprint
/// is compared first, for every state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The claim inserted the record: it owns the key.
    Claimed {
        token: i64,
    },
    Mismatch,
    /// Replay the stored response.
    Replay,
    /// Its owner's lease is live: 409 with this long left (at least 1 ms).
    InProgress {
        lease_remaining_ms: u64,
    },
    /// Its outcome is unknown and held.
    Unknown,
    /// Take the unknown outcome over (the claim asked to): compare-and-set on `observed`.
    Reclaim {
        observed: i64,
    },
    /// Mark an in-progress record whose lease ran out as unknown, then answer `Unknown`.
    MarkUnknown {
        observed: i64,
    },
    /// Reuse a record past its retention as if it were new (it has an outcome: stored, or
    /// unknown).
    TakeOver {
        observed: i64,
        /// Its outcome was never stored: the new owner's claim says `reclaimed`.
        was_in_progress: bool,
    },
}

/// The decision on the row a claim read.
pub fn decide(f: &Facts, take_over_unknown: bool) -> Decision {
    if f.inserted {
        return Decision::Claimed { token: f.token };
    }
    if f.retention_expired {
        return Decision::TakeOver {
            observed: f.token,
            was_in_progress: f.state != RecordState::Completed,
        };
    }
    if !f.same_fingerprint {
        return Decision::Mismatch;
    }
    match f.state {
        RecordState::Completed => Decision::Replay,
        RecordState::InProgress if !f.lease_expired => Decision::InProgress {
            lease_remaining_ms: f.lease_remaining_ms.max(1),
        },
        // Its lease ran out without an outcome: nobody knows whether it ran.
        RecordState::InProgress | RecordState::Unknown if take_over_unknown => {
            Decision::Reclaim { observed: f.token }
        }
        RecordState::InProgress => Decision::MarkUnknown { observed: f.token },
        RecordState::Unknown => Decision::Unknown,
    }
}

/// What a claim comes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome<R> {
    /// The caller owns the key under `token`; `reclaimed`: an earlier attempt's outcome is
    /// unknown (taken over from it).
    Claimed {
        token: i64,
        reclaimed: bool,
    },
    InProgress {
        lease_remaining_ms: u64,
    },
    Completed {
        response: R,
        expires_in_ms: u64,
    },
    Mismatch,
    Unknown,
    /// A completed record without a response: the store answers 500 and changes nothing.
    Corrupt,
    /// The attempt was abandoned before it got here: nothing is written (its caller is gone).
    Abandoned,
}

/// The whole claim on the record at its address (`slot`): read-or-insert, decide, and the
/// compare-and-set the decision asks for (which, with nothing running concurrently, always
/// matches). `next_token` draws the next fencing token from the one sequence.
pub fn claim<R: Clone>(
    slot: &mut Option<Record<R>>,
    terms: &ClaimTerms,
    clock: Clock,
    next_token: &mut dyn FnMut() -> i64,
) -> ClaimOutcome<R> {
    let Some(record) = slot.as_mut() else {
        if terms.abandoned {
            return ClaimOutcome::Abandoned;
        }
        let token = next_token();
        *slot = Some(Record::claimed(
            terms.fingerprint.clone(),
            token,
            terms.lease_ms,
            terms.retention_ms,
            terms.unknown_retention_ms,
            terms.nonce.clone(),
            clock.now,
        ));
        return ClaimOutcome::Claimed {
            token,
            reclaimed: false,
        };
    };
    match decide(&Facts::of(record, terms, clock), terms.take_over_unknown) {
        Decision::Claimed { token } => ClaimOutcome::Claimed {
            token,
            reclaimed: false,
        },
        Decision::Mismatch => ClaimOutcome::Mismatch,
        Decision::Replay => match &record.response {
            Some(response) => ClaimOutcome::Completed {
                response: response.clone(),
                expires_in_ms: record.expires_in_ms(clock.now),
            },
            None => ClaimOutcome::Corrupt,
        },
        Decision::InProgress { lease_remaining_ms } => {
            ClaimOutcome::InProgress { lease_remaining_ms }
        }
        Decision::Unknown => ClaimOutcome::Unknown,
        Decision::Reclaim { .. } | Decision::TakeOver { .. } if terms.abandoned => {
            ClaimOutcome::Abandoned
        }
        Decision::Reclaim { .. } => {
            let token = next_token();
            record.state = RecordState::InProgress;
            record.unknown_before = true;
            record.token = token;
            record.claim_nonce = terms.nonce.clone();
            record.seen(terms.lease_ms, clock.now);
            ClaimOutcome::Claimed {
                token,
                reclaimed: true,
            }
        }
        Decision::MarkUnknown { .. } => {
            record.mark_unknown(clock.now);
            ClaimOutcome::Unknown
        }
        Decision::TakeOver {
            was_in_progress, ..
        } => {
            let token = next_token();
            *record = Record::claimed(
                terms.fingerprint.clone(),
                token,
                terms.lease_ms,
                terms.retention_ms,
                terms.unknown_retention_ms,
                terms.nonce.clone(),
                clock.now,
            );
            ClaimOutcome::Claimed {
                token,
                reclaimed: was_in_progress,
            }
        }
    }
}
