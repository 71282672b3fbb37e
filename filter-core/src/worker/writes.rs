//! Writes the worker sends and retries itself, after the stream that made them has let its
//! response go (or has ended): completes, and later every write a stream could not finish.
//!
//! A stream hands a write over when `/v1/complete` keeps failing while the response is held
//! (the state API or Postgres briefly down), when it ends while its write is on the way (Envoy
//! cancels a stream's callouts with it), or at once with `complete_in_background` (*untried*).
//! The worker keeps the claim's lease alive meanwhile (it stays in the heartbeat registry) and
//! sends the write from its tick with a growing delay, until it is stored, fenced out (a newer
//! claim owns the key), refused for good (a 4xx other than 408/409/429), or `complete_retry_ms`
//! has passed since the handover.
//!
//! Memory is bounded by the total payload bytes (`complete_retry_bytes`): a write that would go
//! over it is refused at once. At most [`MAX_IN_FLIGHT`] are on their way at a time, oldest
//! first, and when one is stored the others are sent at the next tick (the state API is back).
//! The worker sends the due completes of this list in its batches when batching is on (see
//! the worker's module docs); what this list decides (when, how often, when to give up) is the
//! same either way.

use super::registry::HeldClaim;
use crate::effect::CalloutResult;
use contract::wire::{WriteItem, WriteResponse};

/// Writes on their way at once (per worker).
pub const MAX_IN_FLIGHT: usize = 32;
/// First delay after the handover of a write the stream tried already, doubled after each
/// failure up to [`MAX_DELAY_MS`].
pub const FIRST_DELAY_MS: u64 = 250;
pub const MAX_DELAY_MS: u64 = 8_000;

/// A write handed over by a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingWrite {
    pub claim: HeldClaim,
    /// The state API path (`/v1/complete`).
    pub path: &'static str,
    /// The JSON body.
    pub payload: Vec<u8>,
    /// What to send instead if the state API refuses `payload` (a complete's status alone).
    pub fallback: Option<Vec<u8>>,
    /// Not tried yet (`complete_in_background`): sent at once, and its first attempt is not a
    /// retry. `false`: the stream tried it already; the first retry waits [`FIRST_DELAY_MS`].
    pub untried: bool,
}

impl PendingWrite {
    /// A release or an unknown mark of `claim` (fenced by its token), not tried yet.
    pub fn fenced(claim: HeldClaim, namespace: &str, path: &'static str) -> Self {
        let payload = fenced_body(&claim, namespace);
        Self {
            claim,
            path,
            payload,
            fallback: None,
            untried: true,
        }
    }

    /// A complete or release keeps the claim's lease alive until it is stored; marking an
    /// outcome unknown does not (the record is unknown either way once the lease runs out),
    /// nor does an abandon (its claim holds no lease this worker knows of).
    pub fn keeps_lease(&self) -> bool {
        self.path != contract::wire::UNKNOWN_PATH && self.path != contract::wire::ABANDON_PATH
    }
}

/// The body of a release or an unknown mark (`/v1/release`, `/v1/unknown`).
pub fn fenced_body(claim: &HeldClaim, namespace: &str) -> Vec<u8> {
    crate::effect::to_json(&contract::wire::ReleaseRequest {
        key: claim.key.clone(),
        subject: claim.subject.clone(),
        endpoint: claim.endpoint.clone(),
        namespace: namespace.to_owned(),
        token: claim.token,
    })
}

/// What the state API made of one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteVerdict {
    /// 2xx with a readable answer.
    Stored,
    /// 409: a newer claim owns the key.
    FencedOut,
    /// Another 4xx (except 408 and 429): sending it again cannot help.
    Refused(u16),
    /// No answer, a 5xx, 408, 429 or an unreadable answer: try again later.
    Failed,
}

impl WriteVerdict {
    /// The verdict on a write's callout, and the stored record's expiry when the answer
    /// carried one.
    pub fn of(result: &CalloutResult) -> (Self, Option<u64>) {
        match result {
            CalloutResult::Response { status, body, .. } if (200..300).contains(status) => {
                match WriteResponse::read(body) {
                    Ok(w) => (Self::Stored, w.expires_in_ms),
                    Err(_) => (Self::Failed, None),
                }
            }
            CalloutResult::Response { status: 409, .. } => (Self::FencedOut, None),
            CalloutResult::Response { status, .. }
                if (400..500).contains(status) && *status != 408 && *status != 429 =>
            {
                (Self::Refused(*status), None)
            }
            _ => (Self::Failed, None),
        }
    }
}

/// A write's answer as a stream reads it: the same from `/v1/complete` and from an item of
/// `/v1/completes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteAnswer {
    pub verdict: WriteVerdict,
    /// The stored record's expiry, when the answer carried one.
    pub expires_in_ms: Option<u64>,
    /// For logs.
    pub why: String,
}

impl WriteAnswer {
    pub fn of(result: &CalloutResult) -> Self {
        let (verdict, expires_in_ms) = WriteVerdict::of(result);
        Self {
            verdict,
            expires_in_ms,
            why: result.describe(),
        }
    }

    /// One item of a batch's answer: as the answer to a write's own callout with that status.
    pub fn of_item(item: WriteItem) -> Self {
        match item.answer {
            Ok(w) if (200..300).contains(&item.status) => Self {
                verdict: WriteVerdict::Stored,
                expires_in_ms: w.expires_in_ms,
                why: String::new(),
            },
            answer => Self::of(&CalloutResult::answer(
                item.status,
                answer.err().map(|e| e.0).unwrap_or_default().into_bytes(),
            )),
        }
    }
}

/// How a handed-over write ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteDone {
    Stored {
        claim: HeldClaim,
        path: &'static str,
        attempts: u32,
        /// Handed over untried: one attempt is the normal case.
        untried: bool,
    },
    FencedOut {
        claim: HeldClaim,
    },
    /// Given up: the key stays in progress until its lease runs out.
    GaveUp {
        claim: HeldClaim,
        path: &'static str,
        attempts: u32,
        why: String,
    },
}

impl WriteDone {
    pub fn claim(&self) -> &HeldClaim {
        match self {
            WriteDone::Stored { claim, .. }
            | WriteDone::FencedOut { claim }
            | WriteDone::GaveUp { claim, .. } => claim,
        }
    }
}

/// One write to send now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Send {
    pub token: i64,
    pub path: &'static str,
    pub payload: Vec<u8>,
    /// Its first attempt (an untried write), not a retry.
    pub first: bool,
}

/// What a tick does: writes to send now, and writes given up.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Due {
    pub send: Vec<Send>,
    pub gave_up: Vec<WriteDone>,
}

#[derive(Debug)]
struct Entry {
    pending: PendingWrite,
    since_ms: u64,
    next_ms: u64,
    attempts: u32,
    in_flight: bool,
}

/// The worker's pending writes, oldest first (a plain list, like the heartbeat registry).
#[derive(Debug, Default)]
pub struct PendingWrites {
    max_bytes: usize,
    max_ms: u64,
    bytes: usize,
    entries: Vec<Entry>,
}

fn delay(attempts: u32) -> u64 {
    FIRST_DELAY_MS
        .saturating_mul(1u64 << attempts.min(16))
        .min(MAX_DELAY_MS)
}

impl PendingWrites {
    /// `max_ms` 0 or `max_bytes` 0: disabled (every handover is refused).
    pub fn new(max_bytes: u64, max_ms: u64) -> Self {
        Self {
            max_bytes: usize::try_from(max_bytes).unwrap_or(usize::MAX),
            max_ms,
            bytes: 0,
            entries: Vec::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.max_bytes > 0 && self.max_ms > 0
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The tokens of the claims whose writes are pending, with when each was handed over.
    pub fn tokens(&self) -> Vec<(i64, u64)> {
        self.entries
            .iter()
            .map(|e| (e.pending.claim.token, e.since_ms))
            .collect()
    }

    pub fn contains(&self, token: i64) -> bool {
        self.entries.iter().any(|e| e.pending.claim.token == token)
    }

    fn find(&mut self, token: i64) -> Option<&mut Entry> {
        self.entries
            .iter_mut()
            .find(|e| e.pending.claim.token == token)
    }

    /// Whether a write of `size` payload bytes would be taken over now.
    pub fn can_take(&self, size: usize) -> bool {
        self.enabled() && self.bytes.saturating_add(size) <= self.max_bytes
    }

    /// Takes a write over; `Err(why)` when it cannot be kept.
    pub fn add(&mut self, pending: PendingWrite, now_ms: u64) -> Result<(), String> {
        if !self.enabled() {
            return Err("complete retries are disabled".into());
        }
        let size = pending.payload.len();
        if !self.can_take(size) {
            return Err(format!(
                "{} bytes of completes are already waiting (complete_retry_bytes {})",
                self.bytes, self.max_bytes
            ));
        }
        self.take(pending.claim.token);
        self.bytes += size;
        let next_ms = if pending.untried {
            now_ms
        } else {
            now_ms.saturating_add(FIRST_DELAY_MS)
        };
        self.entries.push(Entry {
            pending,
            since_ms: now_ms,
            next_ms,
            attempts: 0,
            in_flight: false,
        });
        Ok(())
    }

    fn take(&mut self, token: i64) -> Option<Entry> {
        let i = self
            .entries
            .iter()
            .position(|e| e.pending.claim.token == token)?;
        let e = self.entries.remove(i);
        self.bytes -= e.pending.payload.len();
        Some(e)
    }

    /// The claim of a write that has a fallback (what a refusal sends instead).
    pub fn fallback_of(&self, token: i64) -> Option<HeldClaim> {
        self.entries
            .iter()
            .find(|e| e.pending.claim.token == token && e.pending.fallback.is_some())
            .map(|e| e.pending.claim.clone())
    }

    /// Forgets a write (its claim was fenced out by a heartbeat).
    pub fn remove(&mut self, token: i64) -> Option<HeldClaim> {
        self.take(token).map(|e| e.pending.claim)
    }

    /// When the next write comes due or is given up ([`PendingWrites::due`]); `None` while
    /// every one is on its way.
    pub fn next_due(&self) -> Option<u64> {
        self.entries
            .iter()
            .filter(|e| !e.in_flight)
            .map(|e| e.next_ms.min(e.since_ms.saturating_add(self.max_ms)))
            .min()
    }

    /// Whether an untried write waits to be sent (a wake is worth it).
    pub fn has_untried(&self) -> bool {
        self.entries
            .iter()
            .any(|e| e.pending.untried && e.attempts == 0 && !e.in_flight)
    }

    /// At a tick: the writes to send now, marked as on their way, and the ones given up
    /// because `complete_retry_ms` has passed.
    pub fn due(&mut self, now_ms: u64) -> Due {
        let expired: Vec<i64> = self
            .entries
            .iter()
            .filter(|e| !e.in_flight && now_ms.saturating_sub(e.since_ms) >= self.max_ms)
            .map(|e| e.pending.claim.token)
            .collect();
        let mut gave_up = Vec::new();
        for token in expired {
            if let Some(e) = self.take(token) {
                gave_up.push(WriteDone::GaveUp {
                    path: e.pending.path,
                    claim: e.pending.claim,
                    attempts: e.attempts,
                    why: format!("still failing after {} ms", self.max_ms),
                });
            }
        }
        let mut room =
            MAX_IN_FLIGHT.saturating_sub(self.entries.iter().filter(|e| e.in_flight).count());
        let mut send = Vec::new();
        for e in self.entries.iter_mut() {
            if room == 0 {
                break;
            }
            if !e.in_flight && e.next_ms <= now_ms {
                send.push(Send {
                    token: e.pending.claim.token,
                    path: e.pending.path,
                    payload: e.pending.payload.clone(),
                    first: e.pending.untried && e.attempts == 0,
                });
                e.in_flight = true;
                e.attempts += 1;
                room -= 1;
            }
        }
        Due { send, gave_up }
    }

    /// An attempt could not be sent or was answered. `None`: it stays, to be sent again; a
    /// refused write with a fallback is sent again at once as its fallback.
    pub fn answered(
        &mut self,
        token: i64,
        verdict: WriteVerdict,
        now_ms: u64,
    ) -> Option<WriteDone> {
        let e = self.find(token)?;
        e.in_flight = false;
        if let (WriteVerdict::Refused(_), Some(fallback)) = (verdict, e.pending.fallback.take()) {
            let before = e.pending.payload.len();
            e.pending.payload = fallback;
            e.next_ms = now_ms;
            let after = e.pending.payload.len();
            self.bytes = self.bytes - before + after;
            return None;
        }
        match verdict {
            WriteVerdict::Failed => {
                e.next_ms = now_ms.saturating_add(delay(e.attempts));
                None
            }
            WriteVerdict::Stored => {
                let e = self.take(token)?;
                // The state API is back: the others need not wait out their delays.
                for other in self.entries.iter_mut() {
                    other.next_ms = other.next_ms.min(now_ms);
                }
                Some(WriteDone::Stored {
                    untried: e.pending.untried,
                    path: e.pending.path,
                    claim: e.pending.claim,
                    attempts: e.attempts,
                })
            }
            WriteVerdict::FencedOut => {
                let e = self.take(token)?;
                Some(WriteDone::FencedOut {
                    claim: e.pending.claim,
                })
            }
            WriteVerdict::Refused(status) => {
                let e = self.take(token)?;
                Some(WriteDone::GaveUp {
                    path: e.pending.path,
                    claim: e.pending.claim,
                    attempts: e.attempts,
                    why: format!("refused with HTTP {status}"),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn pending(token: i64, len: usize) -> PendingWrite {
        PendingWrite {
            claim: HeldClaim {
                key: "k".into(),
                subject: "s".into(),
                endpoint: "POST /checkout".into(),
                token,
            },
            path: "/v1/complete",
            payload: vec![b'x'; len],
            fallback: None,
            untried: false,
        }
    }

    fn untried(token: i64, len: usize) -> PendingWrite {
        PendingWrite {
            untried: true,
            ..pending(token, len)
        }
    }

    fn tokens(due: &Due) -> Vec<i64> {
        due.send.iter().map(|s| s.token).collect()
    }

    #[test]
    fn retried_with_growing_delays_until_stored() {
        let mut r = PendingWrites::new(1 << 20, 600_000);
        r.add(pending(5, 100), 1_000).unwrap();
        assert!(r.due(1_100).send.is_empty(), "not before the first delay");
        let Due { send, gave_up } = r.due(1_250);
        assert_eq!(
            send,
            vec![Send {
                token: 5,
                path: "/v1/complete",
                payload: vec![b'x'; 100],
                first: false,
            }],
            "the stream tried it already: a retry"
        );
        assert!(gave_up.is_empty());
        assert!(r.due(5_000).send.is_empty(), "not twice while on its way");
        assert_eq!(
            (1..=6).map(delay).collect::<Vec<_>>(),
            vec![500, 1_000, 2_000, 4_000, 8_000, 8_000]
        );
        let mut now = 5_000;
        for attempts in 1..=12 {
            assert_eq!(r.answered(5, WriteVerdict::Failed, now), None);
            assert!(r.due(now + delay(attempts) - 1).send.is_empty());
            now += delay(attempts);
            assert_eq!(r.due(now).send.len(), 1);
        }
        assert_eq!(
            r.answered(5, WriteVerdict::Stored, now),
            Some(WriteDone::Stored {
                claim: pending(5, 0).claim,
                path: "/v1/complete",
                attempts: 13,
                untried: false,
            })
        );
        assert!(r.is_empty());
        assert_eq!(r.bytes(), 0);
        assert_eq!(
            r.answered(5, WriteVerdict::Stored, 20_000),
            None,
            "late answers are ignored"
        );
    }

    #[test]
    fn given_up_after_the_bound_or_when_refused_and_fenced_out_is_final() {
        let mut r = PendingWrites::new(1 << 20, 600_000);
        r.add(pending(1, 10), 0).unwrap();
        r.add(pending(2, 10), 0).unwrap();
        r.add(pending(3, 10), 0).unwrap();
        assert_eq!(r.due(300).send.len(), 3);
        assert_eq!(
            r.answered(2, WriteVerdict::FencedOut, 400),
            Some(WriteDone::FencedOut {
                claim: pending(2, 0).claim
            })
        );
        assert!(
            matches!(r.answered(3, WriteVerdict::Refused(413), 400), Some(WriteDone::GaveUp { ref why, .. }) if why.contains("413"))
        );
        r.answered(1, WriteVerdict::Failed, 400);
        // An entry on its way is not given up under it; once answered, the bound applies.
        let Due { send, gave_up, .. } = r.due(600_000);
        assert!(send.is_empty());
        assert_eq!(gave_up.len(), 1);
        assert!(
            matches!(&gave_up[0], WriteDone::GaveUp { attempts: 1, claim, .. } if claim.token == 1)
        );
        assert!(r.is_empty());
    }

    #[test]
    fn memory_is_bounded_and_retries_in_flight_are_capped() {
        let mut r = PendingWrites::new(1_000, 600_000);
        r.add(pending(1, 600), 0).unwrap();
        assert!(r
            .add(pending(2, 500), 0)
            .unwrap_err()
            .contains("complete_retry_bytes"));
        r.add(pending(2, 400), 0).unwrap();
        assert_eq!(r.bytes(), 1_000);
        assert!(PendingWrites::new(0, 1).add(pending(1, 1), 0).is_err());
        assert!(PendingWrites::new(1, 0).add(pending(1, 1), 0).is_err());

        let mut r = PendingWrites::new(1 << 20, 600_000);
        for t in 0..(MAX_IN_FLIGHT as i64 + 8) {
            r.add(pending(t, 1), 0).unwrap();
        }
        let due = r.due(1_000);
        assert_eq!(due.send.len(), MAX_IN_FLIGHT);
        assert_eq!(tokens(&due)[0], 0, "oldest first");
        assert!(
            r.due(1_000).send.is_empty(),
            "no room until answers come back"
        );
        r.answered(0, WriteVerdict::Failed, 1_000);
        r.answered(1, WriteVerdict::Stored, 1_000);
        // Two freed slots, oldest first: 0 (hurried, since 1 was stored) and 32.
        assert_eq!(tokens(&r.due(1_000)), vec![0, 32]);
    }

    #[test]
    fn a_stored_retry_hurries_the_others() {
        let mut r = PendingWrites::new(1 << 20, 600_000);
        r.add(pending(1, 1), 0).unwrap();
        r.add(pending(2, 1), 0).unwrap();
        r.due(250);
        r.answered(1, WriteVerdict::Failed, 300);
        r.answered(2, WriteVerdict::Failed, 300);
        r.due(800);
        r.answered(2, WriteVerdict::Failed, 800); // 2 now waits 1 s
        r.answered(1, WriteVerdict::Stored, 900);
        assert_eq!(tokens(&r.due(900)), vec![2]);
    }

    #[test]
    fn an_untried_write_is_sent_at_once_and_retried_like_the_others() {
        let mut r = PendingWrites::new(1 << 20, 600_000);
        r.add(untried(7, 10), 1_000).unwrap();
        r.add(pending(8, 10), 1_000).unwrap();
        assert!(r.has_untried());
        let due = r.due(1_000);
        assert_eq!(tokens(&due), vec![7], "no delay, and only it");
        assert!(due.send[0].first);
        assert!(!r.has_untried());
        // A failed first attempt waits like a retry; its next attempt is one.
        assert_eq!(r.answered(7, WriteVerdict::Failed, 1_001), None);
        assert!(!tokens(&r.due(1_001 + delay(1) - 1)).contains(&7));
        let due = r.due(1_001 + delay(1));
        let seven = due.send.iter().find(|s| s.token == 7).unwrap();
        assert!(!seven.first);
        assert_eq!(
            r.answered(7, WriteVerdict::Stored, 3_000),
            Some(WriteDone::Stored {
                claim: untried(7, 0).claim,
                path: "/v1/complete",
                attempts: 2,
                untried: true,
            })
        );
        // Room is checked before the stream lets its response go.
        let mut r = PendingWrites::new(100, 600_000);
        assert!(r.can_take(100));
        r.add(untried(1, 60), 0).unwrap();
        assert!(r.can_take(40) && !r.can_take(41));
        assert!(!PendingWrites::new(0, 600_000).can_take(0));
    }

    #[test]
    fn answers_are_judged() {
        let r = |status: u16, body: &[u8]| CalloutResult::answer(status, body.to_vec());
        assert_eq!(
            WriteVerdict::of(&r(200, br#"{"state":"completed","expires_in_ms":5}"#)),
            (WriteVerdict::Stored, Some(5))
        );
        assert_eq!(
            WriteVerdict::of(&r(200, b"not json")),
            (WriteVerdict::Failed, None)
        );
        assert_eq!(WriteVerdict::of(&r(409, b"")).0, WriteVerdict::FencedOut);
        for s in [400, 401, 413, 422] {
            assert_eq!(WriteVerdict::of(&r(s, b"")).0, WriteVerdict::Refused(s));
        }
        for s in [408, 429, 500, 503, 302] {
            assert_eq!(WriteVerdict::of(&r(s, b"")).0, WriteVerdict::Failed, "{s}");
        }
        assert_eq!(
            WriteVerdict::of(&CalloutResult::Failed("reset".into())).0,
            WriteVerdict::Failed
        );
    }

    #[test]
    fn a_refused_write_with_a_fallback_is_sent_again_as_it() {
        let mut r = PendingWrites::new(1 << 20, 600_000);
        r.add(
            PendingWrite {
                fallback: Some(vec![b'm'; 3]),
                ..pending(4, 50)
            },
            0,
        )
        .unwrap();
        assert_eq!(r.bytes(), 50);
        r.due(250);
        assert_eq!(r.answered(4, WriteVerdict::Refused(413), 300), None);
        assert_eq!(r.bytes(), 3, "the memory follows the payload");
        let due = r.due(300);
        assert_eq!(due.send[0].payload, vec![b'm'; 3], "at once");
        // Refused again: no fallback left, given up.
        assert!(matches!(
            r.answered(4, WriteVerdict::Refused(400), 301),
            Some(WriteDone::GaveUp { .. })
        ));
        assert_eq!(r.bytes(), 0);
    }
}
