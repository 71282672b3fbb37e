//! What an owner writes to its record, fenced by its token: heartbeats, its outcome, an
//! unknown mark, a release.

use crate::record::{Clock, Record};
use contract::wire::RecordState;

/// What a heartbeat did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Beat {
    /// The lease (and the record's expiry with it) is extended.
    Extended,
    /// The record is marked unknown under this owner's token: a mark outranks every heartbeat
    /// sent before it, so nothing is extended; the owner may still store its outcome.
    LeaseEnded,
    /// Another token owns the record, or it is completed or gone.
    FencedOut,
}

/// Extends the lease of the owner holding `token`, and its record's expiry with it, while its
/// record is in progress.
pub fn heartbeat<R>(slot: &mut Option<Record<R>>, token: i64, lease_ms: u64, clock: Clock) -> Beat {
    match slot.as_mut() {
        Some(r) if r.token == token && r.state == RecordState::InProgress => {
            r.seen(lease_ms, clock.now);
            Beat::Extended
        }
        Some(r) if r.token == token && r.state == RecordState::Unknown => {
            if crate::undo::undone(crate::undo::Fix::HeartbeatRevival) {
                r.state = RecordState::InProgress;
                r.seen(lease_ms, clock.now);
                return Beat::Extended;
            }
            Beat::LeaseEnded
        }
        _ => Beat::FencedOut,
    }
}

/// What a complete did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Stored; the record is kept this long.
    Done { expires_in_ms: u64 },
    /// The same owner completed before (a retried complete): nothing changed.
    AlreadyDone { expires_in_ms: u64 },
    /// Not this owner's record to complete: a newer owner took over, or it is gone.
    FencedOut,
}

/// Stores the response of the owner holding `token`. The record is kept at least its
/// retention (its claim's, else `default_retention_ms`) after the outcome; one completed within
/// its lease keeps the claim's expiry.
pub fn complete<R>(
    slot: &mut Option<Record<R>>,
    token: i64,
    response: R,
    default_retention_ms: u64,
    clock: Clock,
) -> Completion {
    match slot.as_mut() {
        Some(r) if r.token == token && r.open() => {
            let retention = if r.retention_ms > 0 {
                r.retention_ms
            } else {
                default_retention_ms
            };
            r.state = RecordState::Completed;
            r.response = Some(response);
            r.expires_at = r.expires_at.max(clock.now.saturating_add(retention));
            Completion::Done {
                expires_in_ms: r.expires_in_ms(clock.now),
            }
        }
        Some(r) if r.token == token && r.state == RecordState::Completed => {
            Completion::AlreadyDone {
                expires_in_ms: r.expires_in_ms(clock.now),
            }
        }
        _ => Completion::FencedOut,
    }
}

/// What an owner's unknown mark did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marked {
    /// The record is unknown now; its lease ends at once.
    Unknown,
    /// This owner completed it already: that stands.
    AlreadyCompleted,
    FencedOut,
}

/// The owner holding `token` lost sight of its forwarded request (`/v1/unknown`).
pub fn owner_unknown<R>(slot: &mut Option<Record<R>>, token: i64, clock: Clock) -> Marked {
    match slot.as_mut() {
        Some(r) if r.token == token && r.open() => {
            r.mark_unknown(clock.now);
            r.owner_seen = clock.now;
            Marked::Unknown
        }
        Some(r) if r.token == token && r.state == RecordState::Completed => {
            Marked::AlreadyCompleted
        }
        _ => Marked::FencedOut,
    }
}

/// Gives the key back (the owner holding `token` certainly did not reach the upstream):
/// deleted, unless an earlier attempt's outcome is unknown (this owner took it over), then
/// unknown again. `false`: fenced out.
pub fn release<R>(slot: &mut Option<Record<R>>, token: i64, clock: Clock) -> bool {
    match slot.as_mut() {
        Some(r) if r.token == token && r.open() && r.unknown_before => {
            r.mark_unknown(clock.now);
            r.owner_seen = clock.now;
            true
        }
        Some(r) if r.token == token && r.open() => {
            *slot = None;
            true
        }
        _ => false,
    }
}

/// What an abandon did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// The record the claim made is gone: the key is free.
    Deleted,
    /// The claim had taken over an earlier attempt whose outcome is unknown: unknown again.
    Unknown,
    /// No open record of that claim attempt (not committed yet, answered after all and moved
    /// on, or another claim's now): nothing changed here; the caller leaves a tombstone for the
    /// nonce, so that the attempt, if it arrives later, never commits
    /// ([`crate::ClaimTerms::abandoned`]).
    Nothing,
}

/// The claim attempt named `nonce` never reached its caller, so nothing was forwarded under
/// it: its record is given back as a release would give it back. Only an open record that
/// this very attempt made or took over matches (a later claim's nonce replaces it).
pub fn abandon<R>(slot: &mut Option<Record<R>>, nonce: &str, clock: Clock) -> Abandoned {
    match slot.as_mut() {
        Some(r)
            if r.open()
                && r.claim_nonce.as_deref() == Some(nonce)
                && !crate::undo::undone(crate::undo::Fix::Abandon) =>
        {
            if r.unknown_before {
                r.mark_unknown(clock.now);
                r.claim_nonce = None;
                Abandoned::Unknown
            } else {
                *slot = None;
                Abandoned::Deleted
            }
        }
        _ => Abandoned::Nothing,
    }
}
