//! The purge: which records go, and which it marks unknown first.

use crate::record::{Clock, Record};
use contract::wire::RecordState;

/// What the purge does to one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purge {
    Keep,
    /// Past its expiry with an outcome: deleted.
    Delete,
    /// In progress past its expiry, its owner silent for a whole lease since the database
    /// served (the lease guard): nobody knows whether it ran, so it is marked unknown (fencing
    /// out its owner's heartbeats) and kept a retention from now, never deleted while an owner
    /// could still extend it.
    MarkUnknown,
}

pub fn purge<R>(record: &Record<R>, clock: Clock) -> Purge {
    if record.expires_at >= clock.now {
        return Purge::Keep;
    }
    match record.state {
        RecordState::Completed | RecordState::Unknown => Purge::Delete,
        // Before the fix of path 1: deleted once its lease had run out.
        RecordState::InProgress
            if crate::undo::undone(crate::undo::Fix::Retention)
                && record.lease_until <= clock.now =>
        {
            Purge::Delete
        }
        RecordState::InProgress if record.lease_expired(clock) => Purge::MarkUnknown,
        RecordState::InProgress => Purge::Keep,
    }
}

/// The purge's pass over one slot.
pub fn apply<R>(slot: &mut Option<Record<R>>, clock: Clock) -> Purge {
    let what = slot.as_ref().map_or(Purge::Keep, |r| purge(r, clock));
    match what {
        Purge::Delete => *slot = None,
        Purge::MarkUnknown => {
            if let Some(r) = slot.as_mut() {
                r.mark_unknown(clock.now);
            }
        }
        Purge::Keep => {}
    }
    what
}
