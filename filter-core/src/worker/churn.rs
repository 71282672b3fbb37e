//! Key churn (issue 48): the same request (subject, endpoint, fingerprint) arriving under a
//! *different* key within a window. That is the classic client bug of minting a new key for
//! each retry, and it defeats idempotency without any error. Only an edge sees both keys. Each
//! worker watches its own claims in bounded memory; the count and a log line name both keys.

use super::ids::Id;
use std::collections::{HashMap, VecDeque};

/// How long a request is remembered: a client's retries come within seconds to a minute.
pub const CHURN_WINDOW_MS: u64 = 60_000;
/// The most requests remembered per worker (about 200 bytes each: the subject, the endpoint,
/// the fingerprint and a record address). Past it, the oldest are forgotten first, so under
/// more than about 17 new requests a second per worker the window is shorter than a minute.
pub const CHURN_MAX_REQUESTS: usize = 1024;

/// The requests a worker claimed in the last window (subject, endpoint and fingerprint, framed),
/// with the record address of the key each came under (never the key itself: keys are not
/// logged).
#[derive(Debug, Default)]
pub(crate) struct ChurnWatch {
    records: HashMap<String, (Id, u64)>,
    /// Insertion order, for expiry: (request, when). A request noted again under another key
    /// has an older entry here too, recognised by its time.
    order: VecDeque<(String, u64)>,
}

/// The record address of the other key the same request came under, and how long ago.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Churn {
    pub earlier: Id,
    pub ms_ago: u64,
}

impl ChurnWatch {
    /// Notes a claim of the record `id` (key, subject, endpoint) for the request (`subject`,
    /// `endpoint`, `fingerprint`) at `now_ms`, and returns the other record the same request
    /// was claimed under within the window. A retry under its own key changes nothing.
    pub(crate) fn note(
        &mut self,
        subject: &str,
        endpoint: &str,
        fingerprint: &str,
        id: Id,
        now_ms: u64,
    ) -> Option<Churn> {
        self.expire(now_ms);
        let request = format!("{subject}\n{endpoint}\n{fingerprint}");
        let churn = match self.records.get(&request) {
            Some((earlier, _)) if *earlier == id => return None,
            Some((earlier, at)) => Some(Churn {
                earlier: *earlier,
                ms_ago: now_ms.saturating_sub(*at),
            }),
            None => None,
        };
        self.records.insert(request.clone(), (id, now_ms));
        self.order.push_back((request, now_ms));
        while self.records.len() > CHURN_MAX_REQUESTS || self.order.len() > 2 * CHURN_MAX_REQUESTS {
            let Some((oldest, at)) = self.order.pop_front() else {
                break;
            };
            self.forget(&oldest, at);
        }
        churn
    }

    /// Requests noted before the window are forgotten.
    fn expire(&mut self, now_ms: u64) {
        while let Some((_, at)) = self.order.front() {
            if now_ms.saturating_sub(*at) < CHURN_WINDOW_MS {
                break;
            }
            if let Some((request, at)) = self.order.pop_front() {
                self.forget(&request, at);
            }
        }
    }

    /// Forgets `request` if it was last noted at `at` (a later note under another key keeps it).
    fn forget(&mut self, request: &str, at: u64) {
        if self.records.get(request).is_some_and(|(_, t)| *t == at) {
            self.records.remove(request);
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.records.len()
    }
}

/// How a log names a record: the first 8 bytes of its address in the worker's memory.
pub(crate) fn record_ref(id: &Id) -> String {
    id.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn id(n: u8) -> Id {
        [n; 32]
    }

    #[test]
    fn the_same_request_under_another_key_within_the_window_is_churn() {
        let mut w = ChurnWatch::default();
        assert_eq!(w.note("alice", "POST /checkout", "f1", id(1), 1_000), None);
        // A retry with its own key: not churn.
        assert_eq!(w.note("alice", "POST /checkout", "f1", id(1), 2_000), None);
        assert_eq!(
            w.note("alice", "POST /checkout", "f1", id(2), 3_000),
            Some(Churn {
                earlier: id(1),
                ms_ago: 2_000
            })
        );
        // Another subject, endpoint or body: another request.
        assert_eq!(w.note("bob", "POST /checkout", "f1", id(3), 3_000), None);
        assert_eq!(w.note("alice", "POST /refunds", "f1", id(4), 3_000), None);
        assert_eq!(w.note("alice", "POST /checkout", "f2", id(5), 3_000), None);
        // Past the window since it came under its last key (id 2 at 3 s): forgotten.
        assert_eq!(
            w.note(
                "alice",
                "POST /checkout",
                "f1",
                id(6),
                3_000 + CHURN_WINDOW_MS
            ),
            None
        );
        assert_eq!(record_ref(&id(171)), "abababababababab");
    }

    #[test]
    fn memory_is_bounded_and_a_hot_request_does_not_push_the_others_out() {
        let mut w = ChurnWatch::default();
        for i in 0..(CHURN_MAX_REQUESTS * 3) {
            w.note("alice", "POST /checkout", &format!("f{i}"), id(1), 0);
            assert!(w.len() <= CHURN_MAX_REQUESTS);
        }
        // One request retried many times under its own key adds nothing.
        let mut w = ChurnWatch::default();
        w.note("bob", "POST /checkout", "g", id(9), 0);
        for t in 0..(CHURN_MAX_REQUESTS as u64 * 10) {
            w.note("alice", "POST /checkout", "f", id(1), t % CHURN_WINDOW_MS);
        }
        assert_eq!(w.order.len(), 2);
        assert!(w.note("bob", "POST /checkout", "g", id(8), 10).is_some());
        // Churned back and forth: the order stays bounded, and within the same millisecond
        // the live entry is kept.
        let mut w = ChurnWatch::default();
        for t in 0..(CHURN_MAX_REQUESTS as u64 * 10) {
            w.note("alice", "POST /checkout", "f", id((t % 2) as u8), t / 3);
            assert!(w.order.len() <= 2 * CHURN_MAX_REQUESTS);
        }
        assert!(w
            .note("alice", "POST /checkout", "f", id(7), 4_000)
            .is_some());
    }
}
