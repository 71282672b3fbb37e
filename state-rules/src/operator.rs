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
    /// The owner was heard from within a lease (a live lease, or an unknown outcome marked a
    /// moment ago): its request may be running.
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
        || record.owner_recent(clock.now)
    {
        return Err(Refusal::LeaseLive);
    }
    if action == Action::Resolve && record.state == RecordState::Completed {
        return Err(Refusal::AlreadyCompleted);
    }
    Ok(())
}
