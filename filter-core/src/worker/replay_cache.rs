//! The replay cache: completed records this worker has seen, answered without a callout.
//!
//! A completed record never changes until its retention expiry (the state API only deletes it
//! then, or an operator does), so once the state API has told this worker the stored response
//! (in a `completed` claim answer, or by accepting this worker's own `complete`), a replay can
//! be answered from memory. An entry lives until the record's expiry as the state API computed
//! it with the database clock (`expires_in_ms`), and never longer than `replay_cache_ttl_ms`, so
//! that an operator's change is seen within that time. Bounded by the bytes it holds, least
//! recently used first out.
//!
//! A response whose complete this worker is still sending ([`super::writes`]) is kept as a
//! *pending* entry: the client has that answer, so a retry on this worker gets the same one
//! instead of a claim. It gets the record's expiry once stored, and goes if the complete does.
//!
//! One cache per worker VM. Proxy-wasm shared data would be seen by every worker, but it has no
//! delete nor size bound, and every read copies the value out of the host; a per-worker cache
//! is bounded exactly and costs a map lookup. The price: each worker learns a key once.

use super::ids::{Id, IdMap, Key};
use contract::fingerprint::Fingerprint;
use std::collections::VecDeque;

/// Memory an entry costs besides its strings and body (map nodes, `Vec` headers, bookkeeping).
pub const ENTRY_OVERHEAD: usize = 160;

/// A completed record as replayed: the fingerprint it was made with and the stored response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    pub fingerprint: Fingerprint,
    pub status: u16,
    /// As stored (allowlisted, lower-case names).
    pub headers: Vec<(String, String)>,
    /// Empty when not replayable.
    pub body: Vec<u8>,
    pub replayable: bool,
    /// When the record expires, by the worker's clock: counted from when the claim was sent
    /// (before the state API measured the expiry), or for a handed-over write from its answer's
    /// arrival (later by that answer's transit, which the header's rounding down to seconds
    /// mostly absorbs). `Idempotency-Key-Expires-In` on replays from memory; `None` until its
    /// expiry is known.
    pub expires_at_ms: Option<u64>,
}

impl Completed {
    /// The same outcome stored without its body (it cannot be replayed).
    pub fn not_replayable(&self) -> Self {
        Self {
            body: Vec::new(),
            replayable: false,
            ..self.clone()
        }
    }

    /// What the entry holds in memory, roughly (the budget counts this).
    pub fn size(&self) -> usize {
        ENTRY_OVERHEAD
            + self.fingerprint.hex.len()
            + self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len() + 48)
                .sum::<usize>()
    }
}

#[derive(Debug)]
struct Entry {
    value: Completed,
    /// When the entry was filled (ms, the filter's clock); a clock seen going back drops it.
    since_ms: u64,
    /// Answered from memory until then (exclusive).
    until_ms: u64,
    /// Position in the use order.
    used: u64,
    size: usize,
    /// Not stored yet: no expiry until [`ReplayCache::settle`].
    pending: bool,
}

/// A bounded LRU of completed records with per-entry expiry. Time is passed in (ms); nothing
/// here reads a clock.
#[derive(Debug)]
pub struct ReplayCache {
    max_bytes: usize,
    ttl_ms: u64,
    bytes: usize,
    uses: u64,
    entries: IdMap<Entry>,
    /// Use order, least recent first: (id, `used` at that use). An item is stale when its entry
    /// was used again since (or is gone); stale items are skipped, and dropped when they
    /// outnumber the entries.
    order: VecDeque<(Id, u64)>,
}

impl Default for ReplayCache {
    /// Disabled.
    fn default() -> Self {
        Self::new(0, 0)
    }
}

impl ReplayCache {
    /// `max_bytes` or `ttl_ms` 0: disabled (nothing is kept).
    pub fn new(max_bytes: u64, ttl_ms: u64) -> Self {
        Self {
            max_bytes: usize::try_from(max_bytes).unwrap_or(usize::MAX),
            ttl_ms,
            bytes: 0,
            uses: 0,
            entries: IdMap::default(),
            order: VecDeque::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.max_bytes > 0 && self.ttl_ms > 0
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held, as counted against `max_bytes`.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Records a use of `id`: its new position in the use order.
    fn touch(&mut self, id: Id) -> u64 {
        self.uses += 1;
        self.order.push_back((id, self.uses));
        self.uses
    }

    /// Drops stale use-order items once they outnumber the entries (after the entry's `used`
    /// is up to date).
    fn compact(&mut self) {
        if self.order.len() > 2 * self.entries.len() + 64 {
            let entries = &self.entries;
            self.order
                .retain(|(id, used)| entries.get(&Key(*id)).is_some_and(|e| e.used == *used));
        }
    }

    pub fn remove(&mut self, id: &Id) -> bool {
        match self.entries.remove(&Key(*id)) {
            Some(e) => {
                self.bytes -= e.size;
                true
            }
            None => false,
        }
    }

    /// Keeps a completed record. `since_ms`: when the state API was asked (the expiry it
    /// answered counts from no earlier than that); `expires_in_ms`: its answer. An entry larger
    /// than the whole budget is not kept; others make room by evicting the least recently used.
    pub fn insert(&mut self, id: Id, value: Completed, since_ms: u64, expires_in_ms: u64) {
        let ttl = expires_in_ms.min(self.ttl_ms);
        self.put(id, value, since_ms, since_ms.saturating_add(ttl), false);
    }

    /// Keeps a response whose complete is still being retried, until [`Self::settle`] or
    /// [`Self::remove`]. `false`: not kept (disabled, or larger than the budget).
    pub fn insert_pending(&mut self, id: Id, value: Completed) -> bool {
        self.put(id, value, 0, u64::MAX, true)
    }

    /// The complete of a pending entry was stored: from now on it lives like any other entry.
    pub fn settle(&mut self, id: &Id, now_ms: u64, expires_in_ms: u64) {
        let ttl = expires_in_ms.min(self.ttl_ms);
        match self.entries.get_mut(&Key(*id)) {
            Some(e) if e.pending && ttl > 0 => {
                e.pending = false;
                e.since_ms = now_ms;
                e.until_ms = now_ms.saturating_add(ttl);
                e.value.expires_at_ms = Some(now_ms.saturating_add(expires_in_ms));
            }
            Some(e) if e.pending => {
                self.remove(id);
            }
            _ => {}
        }
    }

    fn put(
        &mut self,
        id: Id,
        value: Completed,
        since_ms: u64,
        until_ms: u64,
        pending: bool,
    ) -> bool {
        self.remove(&id);
        let size = value.size();
        if !self.enabled() || until_ms <= since_ms || size > self.max_bytes {
            return false;
        }
        while self.bytes + size > self.max_bytes {
            let Some((oldest, used)) = self.order.pop_front() else {
                break;
            };
            if self
                .entries
                .get(&Key(oldest))
                .is_some_and(|e| e.used == used)
            {
                self.remove(&oldest);
            }
        }
        if self.bytes + size > self.max_bytes {
            return false;
        }
        let used = self.touch(id);
        self.bytes += size;
        self.entries.insert(
            Key(id),
            Entry {
                value,
                since_ms,
                until_ms,
                used,
                size,
                pending,
            },
        );
        self.compact();
        true
    }

    /// The record, if known and not expired at `now_ms`; an expired one is dropped.
    pub fn get(&mut self, id: &Id, now_ms: u64) -> Option<&Completed> {
        let (since, until) = {
            let e = self.entries.get(&Key(*id))?;
            (e.since_ms, e.until_ms)
        };
        if now_ms >= until || now_ms < since {
            self.remove(id);
            return None;
        }
        let used = self.touch(*id);
        if let Some(e) = self.entries.get_mut(&Key(*id)) {
            e.used = used;
        }
        self.compact();
        self.entries.get(&Key(*id)).map(|e| &e.value)
    }

    /// Drops every entry expired at `now_ms`; how many.
    pub fn purge_expired(&mut self, now_ms: u64) -> usize {
        let before = self.entries.len();
        let mut freed = 0;
        self.entries.retain(|_, e| {
            let keep = now_ms < e.until_ms && now_ms >= e.since_ms;
            if !keep {
                freed += e.size;
            }
            keep
        });
        self.bytes -= freed;
        before - self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::worker::ids::id;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn rec(body_len: usize) -> Completed {
        Completed {
            fingerprint: Fingerprint {
                alg: "sha256-jcs-v2".into(),
                hex: "ab".repeat(32),
            },
            status: 201,
            headers: vec![("location".into(), "/c/1".into())],
            body: vec![7; body_len],
            replayable: true,
            expires_at_ms: None,
        }
    }

    #[test]
    fn hits_until_the_earlier_of_expiry_and_ttl() {
        let mut c = ReplayCache::new(1 << 20, 60_000);
        let a = id("a", "s", "e");
        c.insert(a, rec(10), 1_000, 5_000);
        assert_eq!(c.get(&a, 1_000).map(|r| r.status), Some(201));
        assert!(c.get(&a, 5_999).is_some());
        assert!(
            c.get(&a, 6_000).is_none(),
            "the record's expiry is never passed"
        );
        assert!(c.is_empty(), "an expired entry is dropped on lookup");
        // A long expiry is capped by the TTL.
        c.insert(a, rec(10), 1_000, 86_400_000);
        assert!(c.get(&a, 60_999).is_some());
        assert!(c.get(&a, 61_000).is_none());
        // The clock going back drops the entry rather than extending it.
        c.insert(a, rec(10), 10_000, 86_400_000);
        assert!(c.get(&a, 9_999).is_none());
        // Expired at once: not kept.
        c.insert(a, rec(10), 1_000, 0);
        assert!(c.is_empty());
    }

    #[test]
    fn bounded_by_bytes_least_recently_used_first() {
        let one = rec(1_000).size();
        let mut c = ReplayCache::new(3 * one as u64, 60_000);
        let (a, b, d, e) = (
            id("a", "s", "e"),
            id("b", "s", "e"),
            id("d", "s", "e"),
            id("e", "s", "e"),
        );
        c.insert(a, rec(1_000), 0, 60_000);
        c.insert(b, rec(1_000), 0, 60_000);
        c.insert(d, rec(1_000), 0, 60_000);
        assert_eq!((c.len(), c.bytes()), (3, 3 * one));
        assert!(c.get(&a, 1).is_some()); // a is now the most recent; b the least
        c.insert(e, rec(1_000), 0, 60_000);
        assert_eq!(c.len(), 3);
        assert!(c.get(&b, 2).is_none(), "the least recently used goes first");
        assert!(c.get(&a, 2).is_some() && c.get(&d, 2).is_some() && c.get(&e, 2).is_some());
        // Larger than the whole budget: not kept, nothing evicted for it.
        c.insert(b, rec(4 * one), 0, 60_000);
        assert_eq!(c.len(), 3);
        assert!(c.get(&b, 3).is_none());
        // Replacing an entry does not count it twice.
        c.insert(a, rec(1_000), 0, 60_000);
        assert_eq!((c.len(), c.bytes()), (3, 3 * one));
        assert!(c.bytes() <= 3 * one);
    }

    #[test]
    fn the_use_order_stays_bounded_and_correct_under_many_hits() {
        let one = rec(10).size();
        let mut c = ReplayCache::new(2 * one as u64, 60_000);
        let (a, b, d) = (id("a", "s", "e"), id("b", "s", "e"), id("d", "s", "e"));
        c.insert(a, rec(10), 0, 60_000);
        c.insert(b, rec(10), 0, 60_000);
        for _ in 0..10_000 {
            assert!(c.get(&b, 1).is_some());
        }
        assert!(c.order.len() <= 2 * c.len() + 65, "{}", c.order.len());
        // a was used least recently, however often b was.
        c.insert(d, rec(10), 0, 60_000);
        assert!(c.get(&a, 1).is_none());
        assert!(c.get(&b, 1).is_some() && c.get(&d, 1).is_some());
    }

    #[test]
    fn pending_entries_wait_for_their_complete() {
        let mut c = ReplayCache::new(1 << 20, 60_000);
        let a = id("a", "s", "e");
        assert!(c.insert_pending(a, rec(10)));
        // No expiry while the complete is retried, and no purge.
        assert!(c.get(&a, 10_000_000).is_some());
        assert_eq!(c.purge_expired(u64::MAX - 1), 0);
        // Stored: the record's expiry (capped by the TTL) from then on.
        c.settle(&a, 20_000_000, 5_000);
        assert!(c.get(&a, 20_004_999).is_some());
        assert!(c.get(&a, 20_005_000).is_none());
        // Settling a normal entry changes nothing; an expiry of 0 drops a pending one.
        c.insert(a, rec(10), 0, 1_000);
        c.settle(&a, 0, 60_000);
        assert!(c.get(&a, 1_000).is_none());
        assert!(c.insert_pending(a, rec(10)));
        c.settle(&a, 5, 0);
        assert!(c.is_empty());
        // Disabled or too large: not kept.
        assert!(!ReplayCache::default().insert_pending(a, rec(10)));
        assert!(!ReplayCache::new(100, 60_000).insert_pending(a, rec(10)));
    }

    #[test]
    fn disabled_keeps_nothing_and_purge_drops_expired() {
        for mut off in [
            ReplayCache::new(0, 60_000),
            ReplayCache::new(1 << 20, 0),
            ReplayCache::default(),
        ] {
            assert!(!off.enabled());
            off.insert(id("a", "s", "e"), rec(1), 0, 60_000);
            assert!(off.is_empty());
        }
        let mut c = ReplayCache::new(1 << 20, 60_000);
        c.insert(id("a", "s", "e"), rec(1), 0, 1_000);
        c.insert(id("b", "s", "e"), rec(1), 0, 9_000);
        assert_eq!(c.purge_expired(5_000), 1);
        assert_eq!(c.len(), 1);
        assert_eq!(c.bytes(), rec(1).size());
        assert_eq!(c.purge_expired(9_000), 1);
        assert_eq!((c.len(), c.bytes()), (0, 0));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::*;
        use proptest::prelude::*;
        use std::collections::HashMap as Model;

        #[derive(Debug, Clone)]
        enum Op {
            Insert(u8, u16, u16),
            Pending(u8, u16),
            Settle(u8, u16),
            Get(u8),
            Remove(u8),
            Purge,
            Advance(u16),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0..8u8, 0..3_000u16, 0..2_000u16).prop_map(|(k, b, e)| Op::Insert(k, b, e)),
                (0..8u8, 0..3_000u16).prop_map(|(k, b)| Op::Pending(k, b)),
                (0..8u8, 0..2_000u16).prop_map(|(k, e)| Op::Settle(k, e)),
                (0..8u8).prop_map(Op::Get),
                (0..8u8).prop_map(Op::Remove),
                Just(Op::Purge),
                (0..1_500u16).prop_map(Op::Advance),
            ]
        }

        proptest! {
            #[test]
            fn budget_expiry_and_use_order_always_hold(ops in prop::collection::vec(op(), 0..300)) {
                const MAX: usize = 6_000;
                const TTL: u64 = 1_000;
                let mut c = ReplayCache::new(MAX as u64, TTL);
                let mut now = 10_000u64;
                // The latest deadline each key may be answered until (None: must not be).
                let mut until: Model<u8, Option<u64>> = Model::new();
                let key = |k: u8| id(&k.to_string(), "s", "e");
                for op in ops {
                    match op {
                        Op::Insert(k, body, exp) => {
                            c.insert(key(k), rec(usize::from(body)), now, u64::from(exp));
                            until.insert(k, Some(now + u64::from(exp).min(TTL)));
                        }
                        Op::Pending(k, body) => {
                            c.insert_pending(key(k), rec(usize::from(body)));
                            until.insert(k, Some(u64::MAX));
                        }
                        Op::Settle(k, exp) => {
                            let was_pending = c.entries.get(&Key(key(k))).is_some_and(|e| e.pending);
                            c.settle(&key(k), now, u64::from(exp));
                            if was_pending {
                                until.insert(k, Some(now + u64::from(exp).min(TTL)));
                            }
                        }
                        Op::Get(k) => {
                            if c.get(&key(k), now).is_some() {
                                let deadline = until.get(&k).copied().flatten();
                                prop_assert!(deadline.is_some_and(|d| now < d), "answered past its deadline");
                            }
                        }
                        Op::Remove(k) => {
                            c.remove(&key(k));
                            until.insert(k, None);
                        }
                        Op::Purge => {
                            c.purge_expired(now);
                        }
                        Op::Advance(ms) => now += u64::from(ms),
                    }
                    let sum: usize = c.entries.values().map(|e| e.size).sum();
                    prop_assert_eq!(c.bytes(), sum);
                    prop_assert!(c.bytes() <= MAX);
                    for (k, e) in &c.entries {
                        prop_assert!(c.order.contains(&(k.0, e.used)), "an entry lost its place in the use order");
                    }
                }
            }
        }
    }
}
