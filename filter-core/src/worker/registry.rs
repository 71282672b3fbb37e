//! The claims this worker holds, whose leases it extends on each tick (heartbeats): registered
//! when a claim is won, removed when its outcome is stored, its key released, or its stream
//! ends without an outcome. A claim whose write was handed over to the worker
//! ([`super::writes`]) stays registered until the write is done.
//!
//! Claims are addressed by their fencing token: unique per claim, whichever stream holds it.

use contract::wire::HeartbeatRequest;

/// A claim this worker holds: the record it owns and the token that proves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldClaim {
    pub key: String,
    pub subject: String,
    pub endpoint: String,
    pub token: i64,
}

#[derive(Debug)]
struct Entry {
    claim: HeldClaim,
    /// The lease the state API granted last.
    lease_ms: u64,
    /// What the claim's route asks for, and how often it is heartbeaten at most.
    terms: Terms,
    /// When the lease was last set (claim or heartbeat sent), in ms since the epoch.
    last_ms: u64,
    /// A heartbeat for it is awaiting its answer.
    pending: bool,
    /// Its last heartbeat failed (no answer, a 5xx): sent again at the next tick, not a whole
    /// interval later, so that one lost heartbeat never costs the lease.
    retry: bool,
    /// A heartbeat found a newer claim owning the key: no more heartbeats, and whatever the
    /// claim's stream hands over later can only be fenced out (`Registry::fence`).
    fenced: bool,
    /// A heartbeat found the record marked unknown under this token: its lease cannot be
    /// extended any more (no more heartbeats), but the claim still owns it, and its outcome is
    /// still stored (`Registry::lease_ended`).
    ended: bool,
}

/// The lease a claim's route asks for and its heartbeat interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
}

/// How often a claim's lease is extended: every `heartbeat_ms` (its route's), or every half of
/// the lease the state API granted when that is shorter (so one lost heartbeat never lets it
/// run out).
pub fn heartbeat_interval(heartbeat_ms: u64, lease_ms: u64) -> u64 {
    heartbeat_ms.min(lease_ms / 2)
}

/// A plain list: a worker holds a few hundred claims at most, and a map type would cost the
/// module more code than the scans cost time.
#[derive(Debug, Default)]
pub struct Registry {
    entries: Vec<Entry>,
}

impl Registry {
    fn find(&mut self, token: i64) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|e| e.claim.token == token)
    }

    /// Registers the claim (again: its lease of `lease_ms` was just granted), last heard of at
    /// `heard_ms`: when its claim was sent, for a new grant (its lease counts from the commit,
    /// which came after). Registered again, it keeps a later sign of life (a heartbeat since).
    pub fn register(&mut self, claim: HeldClaim, lease_ms: u64, terms: Terms, heard_ms: u64) {
        let token = claim.token;
        let entry = Entry {
            claim,
            lease_ms,
            terms,
            last_ms: heard_ms,
            pending: false,
            retry: false,
            fenced: false,
            ended: false,
        };
        match self.find(token) {
            // Once fenced, always fenced: no grant makes the token the newest again; and a mark
            // is never undone.
            Some(e) => {
                let (fenced, ended, last_ms) = (e.fenced, e.ended, e.last_ms);
                *e = entry;
                e.fenced = fenced;
                e.ended = ended;
                e.last_ms = e.last_ms.max(last_ms);
            }
            None => self.entries.push(entry),
        }
    }

    pub fn remove(&mut self, token: i64) {
        self.entries.retain(|e| e.claim.token != token);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The tokens of the claims it heartbeats (fenced ones aside).
    pub fn tokens(&self) -> Vec<i64> {
        self.entries
            .iter()
            .filter(|e| !e.fenced)
            .map(|e| e.claim.token)
            .collect()
    }

    pub fn contains(&self, token: i64) -> bool {
        self.entries.iter().any(|e| e.claim.token == token)
    }

    /// A heartbeat of `token` was fenced out while its stream still runs: the entry stays,
    /// without heartbeats, until the stream ends, so that what it hands over then is known to
    /// be a late owner's.
    pub fn fence(&mut self, token: i64) {
        if let Some(e) = self.find(token) {
            e.fenced = true;
            e.pending = false;
        }
    }

    /// A heartbeat of `token` found its record marked unknown: no more heartbeats for it.
    pub fn lease_ended(&mut self, token: i64) {
        if let Some(e) = self.find(token) {
            e.ended = true;
            e.pending = false;
        }
    }

    pub fn is_fenced(&self, token: i64) -> bool {
        self.entries
            .iter()
            .any(|e| e.claim.token == token && e.fenced)
    }

    /// Ticking every `tick_ms`, a heartbeat goes `tick_ms` before its [`heartbeat_interval`]
    /// so the gap never exceeds it.
    fn threshold(e: &Entry, tick_ms: u64) -> u64 {
        heartbeat_interval(e.terms.heartbeat_ms, e.lease_ms).saturating_sub(tick_ms)
    }

    /// Heartbeats to send now (each asking for its route's lease), for claims with no
    /// heartbeat on its way. They are marked as sent.
    pub fn due(&mut self, now_ms: u64, tick_ms: u64, namespace: &str) -> Vec<HeartbeatRequest> {
        let mut out = Vec::new();
        for e in self.entries.iter_mut() {
            if !e.pending
                && !e.fenced
                && !e.ended
                && (e.retry || now_ms.saturating_sub(e.last_ms) >= Self::threshold(e, tick_ms))
            {
                e.pending = true;
                e.retry = false;
                e.last_ms = now_ms;
                out.push(HeartbeatRequest {
                    namespace: namespace.to_owned(),
                    key: e.claim.key.clone(),
                    subject: e.claim.subject.clone(),
                    endpoint: e.claim.endpoint.clone(),
                    token: e.claim.token,
                    lease_ms: Some(e.terms.lease_ms),
                });
            }
        }
        out
    }

    /// How long a heartbeat of `token` may go unanswered: until the next one would be due, so
    /// that one which neither fails nor answers (a state API stalled, a callout timeout longer
    /// than the lease) fails in time to be sent again before the lease runs out.
    pub fn answer_within(&self, token: i64, tick_ms: u64) -> Option<u64> {
        self.entries
            .iter()
            .find(|e| e.claim.token == token)
            .map(|e| Self::threshold(e, tick_ms).max(tick_ms))
    }

    /// When the next heartbeat comes due ([`Registry::due`]); `None` while none can.
    pub fn next_due(&self, tick_ms: u64) -> Option<u64> {
        self.entries
            .iter()
            .filter(|e| !e.pending && !e.fenced && !e.ended)
            .map(|e| {
                if e.retry {
                    0
                } else {
                    e.last_ms.saturating_add(Self::threshold(e, tick_ms))
                }
            })
            .min()
    }

    /// The terms of the claim holding `token`.
    pub fn terms(&self, token: i64) -> Option<Terms> {
        self.entries
            .iter()
            .find(|e| e.claim.token == token)
            .map(|e| e.terms)
    }

    /// A heartbeat was answered with the lease granted.
    pub fn granted(&mut self, token: i64, lease_ms: u64) {
        if let Some(e) = self.find(token) {
            e.lease_ms = lease_ms;
        }
    }

    /// The heartbeat for `token` was answered: it may be sent again.
    pub fn answered(&mut self, token: i64) {
        if let Some(e) = self.find(token) {
            e.pending = false;
        }
    }

    /// The heartbeat for `token` failed: it goes again at the next tick.
    pub fn failed(&mut self, token: i64) {
        if let Some(e) = self.find(token) {
            e.pending = false;
            e.retry = true;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const TERMS: Terms = Terms {
        lease_ms: 30_000,
        heartbeat_ms: 10_000,
    };

    fn claim(token: i64) -> HeldClaim {
        HeldClaim {
            key: "k".into(),
            subject: "s".into(),
            endpoint: "POST /checkout".into(),
            token,
        }
    }

    #[test]
    fn heartbeats_come_due_and_are_not_doubled() {
        let mut r = Registry::default();
        r.register(claim(1), 30_000, TERMS, 1_000);
        r.register(claim(2), 30_000, TERMS, 5_000);
        // heartbeat 10s, tick 2.5s: due once 7.5s have passed.
        assert!(r.due(8_000, 2_500, "").is_empty());
        let due = r.due(8_500, 2_500, "");
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].token, 1);
        assert_eq!(due[0].lease_ms, Some(30_000));
        // Still pending: not sent again, even much later.
        assert!(r.due(20_000, 2_500, "").iter().all(|hb| hb.token != 1));
        r.answered(1);
        assert_eq!(r.due(28_500, 2_500, "").len(), 1); // 2 was already sent at 20s: pending
        r.remove(1);
        r.remove(2);
        assert!(r.is_empty());
        r.answered(2); // no-op
    }

    #[test]
    fn a_shorter_lease_granted_brings_heartbeats_forward() {
        let mut r = Registry::default();
        // Asked for 30 s, granted 4 s: a heartbeat every 2 s (minus a tick), not every 10 s.
        r.register(claim(1), 4_000, TERMS, 0);
        assert_eq!(r.next_due(500), Some(1_500));
        assert!(r.due(1_499, 500, "").is_empty());
        assert_eq!(r.due(1_500, 500, "").len(), 1);
        r.answered(1);
        r.granted(1, 30_000);
        assert_eq!(r.next_due(500), Some(1_500 + 9_500));
    }

    #[test]
    fn registered_again_a_claim_keeps_its_latest_sign_of_life() {
        let mut r = Registry::default();
        // Registered as heard of when its claim was sent (0), then heartbeaten at 7.5 s; a
        // reconcile's forward registers it again with the claim's sending time.
        r.register(claim(1), 30_000, TERMS, 0);
        assert_eq!(r.due(7_500, 2_500, "").len(), 1);
        r.answered(1);
        r.register(claim(1), 30_000, TERMS, 0);
        assert_eq!(
            r.next_due(2_500),
            Some(15_000),
            "from the heartbeat, not the claim"
        );
    }

    #[test]
    fn each_claim_follows_its_own_route_terms() {
        let mut r = Registry::default();
        let short = Terms {
            lease_ms: 4_000,
            heartbeat_ms: 1_000,
        };
        r.register(claim(1), 30_000, TERMS, 0);
        r.register(claim(2), 4_000, short, 0);
        assert_eq!(r.next_due(250), Some(750), "the short route's claim first");
        let due = r.due(750, 250, "");
        assert_eq!(due.len(), 1);
        assert_eq!((due[0].token, due[0].lease_ms), (2, Some(4_000)));
        assert_eq!(r.terms(2), Some(short));
        assert_eq!(r.due(9_750, 250, "")[0].lease_ms, Some(30_000));
    }
}
