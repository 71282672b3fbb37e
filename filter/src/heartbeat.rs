//! In-flight claims of one worker, shared by its root context (which extends their leases on
//! each tick) and its HTTP contexts (which register a claim when it is made and remove it when
//! the response is stored, the key released, or the stream ends).
//!
//! Root and HTTP contexts of a worker run in the same single-threaded VM, so the registry is a
//! plain `Rc<RefCell<Registry>>`.

use contract::wire::HeartbeatRequest;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlight {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    pub token: i64,
}

#[derive(Debug)]
struct Entry {
    claim: InFlight,
    /// When the lease was last set (claim or heartbeat sent), in ms since the epoch.
    last_ms: u64,
    /// A heartbeat for it is awaiting its answer.
    pending: bool,
}

#[derive(Debug, Default)]
pub struct Registry {
    /// By HTTP context id.
    entries: BTreeMap<u32, Entry>,
}

impl Registry {
    pub fn register(&mut self, context_id: u32, claim: InFlight, now_ms: u64) {
        self.entries.insert(
            context_id,
            Entry {
                claim,
                last_ms: now_ms,
                pending: false,
            },
        );
    }

    pub fn remove(&mut self, context_id: u32) {
        self.entries.remove(&context_id);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, context_id: u32) -> bool {
        self.entries.contains_key(&context_id)
    }

    /// Heartbeats to send now: every claim whose lease was last set `heartbeat_ms - tick_ms` ago
    /// or more (so that, ticking every `tick_ms`, the gap never exceeds `heartbeat_ms`), and
    /// with no heartbeat still on its way. They are marked as sent.
    pub fn due(
        &mut self,
        now_ms: u64,
        heartbeat_ms: u64,
        tick_ms: u64,
        lease_ms: u64,
    ) -> Vec<(u32, HeartbeatRequest)> {
        let threshold = heartbeat_ms.saturating_sub(tick_ms);
        let mut out = Vec::new();
        for (id, e) in self.entries.iter_mut() {
            if !e.pending && now_ms.saturating_sub(e.last_ms) >= threshold {
                e.pending = true;
                e.last_ms = now_ms;
                out.push((
                    *id,
                    HeartbeatRequest {
                        key: e.claim.key.clone(),
                        subject: e.claim.subject.clone(),
                        endpoint: e.claim.endpoint.clone(),
                        token: e.claim.token,
                        lease_ms: Some(lease_ms),
                    },
                ));
            }
        }
        out
    }

    /// The heartbeat for `context_id` was answered (or failed): it may be sent again.
    pub fn answered(&mut self, context_id: u32) {
        if let Some(e) = self.entries.get_mut(&context_id) {
            e.pending = false;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn claim(token: i64) -> InFlight {
        InFlight {
            key: "k".into(),
            subject: "s".into(),
            endpoint: "POST /checkout".into(),
            token,
        }
    }

    #[test]
    fn heartbeats_come_due_and_are_not_doubled() {
        let mut r = Registry::default();
        r.register(7, claim(1), 1_000);
        r.register(8, claim(2), 5_000);
        // heartbeat 10s, tick 2.5s: due once 7.5s have passed.
        assert!(r.due(8_000, 10_000, 2_500, 30_000).is_empty());
        let due = r.due(8_500, 10_000, 2_500, 30_000);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].0, 7);
        assert_eq!(due[0].1.token, 1);
        assert_eq!(due[0].1.lease_ms, Some(30_000));
        // Still pending: not sent again, even much later.
        assert!(r
            .due(20_000, 10_000, 2_500, 30_000)
            .iter()
            .all(|(id, _)| *id != 7));
        r.answered(7);
        assert_eq!(r.due(28_500, 10_000, 2_500, 30_000).len(), 1); // 8 was already sent at 20s: pending
        r.remove(7);
        r.remove(8);
        assert!(r.is_empty());
        r.answered(8); // no-op
    }
}
