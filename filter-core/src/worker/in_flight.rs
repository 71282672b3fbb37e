//! Keys the state API has just reported `in_progress` (owned by a request elsewhere): for a
//! short time, a crowd of retries of that running request gets its 409 from memory instead of
//! one callout each.
//!
//! It only ever errs towards a 409 and a retry, never towards a second execution: an entry
//! lives at most `in_flight_cache_ms` and never past the lease the state API reported (so a key
//! whose owner died is decided by the state API as soon as it would be without this memory), a
//! request with another fingerprint still asks the state API (a released key may have been
//! claimed again with another body), and a completed record or this worker's own claim of the
//! key replaces the entry.

use super::ids::{Id, IdMap, Key};
use contract::fingerprint::Fingerprint;

/// Most in-progress keys remembered at once; beyond that new ones are not kept (each is a few
/// hundred bytes; the 409s they save are for crowds, which are few keys).
pub const MAX_KEYS: usize = 4096;

/// A key reported in progress, for the request with this fingerprint.
#[derive(Debug)]
struct Running {
    fingerprint: Fingerprint,
    retry_after_s: u32,
    since_ms: u64,
    until_ms: u64,
}

impl Running {
    fn live_at(&self, now_ms: u64) -> bool {
        now_ms < self.until_ms && now_ms >= self.since_ms
    }
}

#[derive(Debug, Default)]
pub struct InFlightMemory {
    keys: IdMap<Running>,
}

impl InFlightMemory {
    /// Remembers that `id` is in progress elsewhere, as told to a request with `fingerprint`:
    /// from `since_ms` (when the state API was asked) for `for_ms`. Not kept for no time, or
    /// when [`MAX_KEYS`] live keys are held already.
    pub fn hold(
        &mut self,
        id: Id,
        fingerprint: &Fingerprint,
        retry_after_s: u32,
        since_ms: u64,
        for_ms: u64,
    ) -> bool {
        if for_ms == 0 {
            return false;
        }
        if self.keys.len() >= MAX_KEYS && !self.keys.contains_key(&Key(id)) {
            self.keys.retain(|_, r| r.live_at(since_ms));
            if self.keys.len() >= MAX_KEYS {
                return false;
            }
        }
        self.keys.insert(
            Key(id),
            Running {
                fingerprint: fingerprint.clone(),
                retry_after_s,
                since_ms,
                until_ms: since_ms.saturating_add(for_ms),
            },
        );
        true
    }

    /// The Retry-After (seconds) to answer a request with `fingerprint` from memory: the key is
    /// held, live at `now_ms`, and was reported in progress for this very fingerprint.
    pub fn retry_after(&mut self, id: &Id, fingerprint: &Fingerprint, now_ms: u64) -> Option<u32> {
        let r = self.keys.get(&Key(*id))?;
        if !r.live_at(now_ms) {
            self.keys.remove(&Key(*id));
            return None;
        }
        (r.fingerprint == *fingerprint).then_some(r.retry_after_s)
    }

    /// Forgets the key (this worker now owns it, it completed, or it was released).
    pub fn forget(&mut self, id: &Id) {
        self.keys.remove(&Key(*id));
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Drops every entry that is not live at `now_ms`.
    pub fn purge_expired(&mut self, now_ms: u64) {
        self.keys.retain(|_, r| r.live_at(now_ms));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::worker::ids::id;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn fp(alg: &'static str, hex: &str) -> Fingerprint {
        Fingerprint {
            alg: alg.into(),
            hex: hex.repeat(32),
        }
    }

    #[test]
    fn answers_409_for_the_same_request_until_the_deadline() {
        let mut m = InFlightMemory::default();
        let a = id("a", "s", "e");
        let same = fp("sha256-jcs-v2", "ab");
        assert!(m.hold(a, &same, 2, 1_000, 500));
        assert_eq!(m.retry_after(&a, &same, 1_000), Some(2));
        assert_eq!(m.retry_after(&a, &same, 1_499), Some(2));
        // Another body, or another algorithm: ask the state API (the key may have been
        // released and claimed again with that body).
        assert_eq!(m.retry_after(&a, &fp("sha256-jcs-v2", "cd"), 1_100), None);
        assert_eq!(m.retry_after(&a, &fp("sha256-raw-v2", "ab"), 1_100), None);
        // Never past the deadline (the lease the state API reported, or the configured
        // limit), and a clock seen going back drops the entry.
        assert_eq!(m.retry_after(&a, &same, 1_500), None);
        assert!(m.is_empty());
        assert!(m.hold(a, &same, 1, 1_000, 500));
        assert_eq!(m.retry_after(&a, &same, 999), None);
        // Forgotten when this worker owns the key, it completed, or it was released.
        assert!(m.hold(a, &same, 1, 1_000, 500));
        m.forget(&a);
        assert_eq!(m.retry_after(&a, &same, 1_100), None);
        // For no time: nothing kept.
        assert!(!m.hold(a, &same, 1, 1_000, 0));
    }

    #[test]
    fn bounded_and_purged() {
        let mut m = InFlightMemory::default();
        let f = fp("a", "ab");
        for i in 0..MAX_KEYS {
            assert!(m.hold(id(&i.to_string(), "s", "e"), &f, 1, 0, 100));
        }
        // Full of live entries: a new key is not kept, a known one is refreshed.
        assert!(!m.hold(id("new", "s", "e"), &f, 1, 50, 100));
        assert!(m.hold(id("0", "s", "e"), &f, 1, 50, 100));
        // Once the others have expired, they make room.
        assert!(m.hold(id("new", "s", "e"), &f, 1, 120, 100));
        assert_eq!(m.len(), 2);
        m.purge_expired(10_000);
        assert!(m.is_empty());
    }
}
