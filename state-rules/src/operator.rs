//! An operator's action on one record (the admin API, `idemctl`).

use crate::record::{Clock, Record};
use contract::wire::RecordState;

/// What an operator asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Give the key back (delete the record): the next request runs.
    Release,
    /// Store an outcome the operator established (replayed from then on).
    Resolve,
    /// Delete the record (its data must go).
    Purge,
}

/// Why an action is refused without `force`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The owner was heard from within a lease, or the database has not served a whole lease
    /// since (a live lease, an unknown outcome marked a moment ago, an owner cut off by an
    /// outage): its request may be running.
    LeaseLive,
    /// Resolve of a record that already has an outcome.
    AlreadyCompleted,
}

/// Whether the action may go ahead on `record` (`force` overrides every refusal).
pub fn allowed<R>(
    record: &Record<R>,
    action: Action,
    force: bool,
    clock: Clock,
) -> Result<(), Refusal> {
    if force {
        return Ok(());
    }
    if (record.state == RecordState::InProgress && record.lease_until > clock.now)
        || record.owner_recent(clock)
    {
        return Err(Refusal::LeaseLive);
    }
    if action == Action::Resolve && record.state == RecordState::Completed {
        return Err(Refusal::AlreadyCompleted);
    }
    Ok(())
}

/// An operator's resolve (once [`allowed`]): the record is completed with `response` under a
/// new fencing token, so that its owner, if it is still running after all, is fenced out and
/// never stores (or caches, and replays) a second outcome beside the operator's. Kept a
/// retention (its claim's, else `default_retention_ms`) from now. `false`: no record.
pub fn resolve<R>(
    slot: &mut Option<Record<R>>,
    response: R,
    default_retention_ms: u64,
    clock: Clock,
    next_token: &mut dyn FnMut() -> i64,
) -> bool {
    let Some(r) = slot.as_mut() else {
        return false;
    };
    if !crate::undo::undone(crate::undo::Fix::ResolveToken) {
        r.token = next_token();
    }
    let retention = if r.retention_ms > 0 {
        r.retention_ms
    } else {
        default_retention_ms
    };
    r.state = RecordState::Completed;
    r.response = Some(response);
    r.claim_nonce = None;
    r.lease_until = r.lease_until.min(clock.now);
    r.expires_at = clock.now.saturating_add(retention);
    true
}
