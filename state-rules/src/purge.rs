//! The purge: which records go.

use crate::record::{Clock, Record};
use contract::wire::RecordState;

/// Past its expiry, and (unless completed) past its lease: the purge deletes it.
pub fn purgeable<R>(record: &Record<R>, clock: Clock) -> bool {
    record.expires_at < clock.now
        && (record.state == RecordState::Completed || record.lease_until < clock.now)
}
