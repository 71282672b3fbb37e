//! Completes that failed while the response was held: kept by the worker and retried.
//!
//! When `/v1/complete` keeps failing (the state API or Postgres briefly down when the upstream
//! answers), the response goes on to the client and the stream hands the pending complete (its
//! claim and the JSON payload with the captured response) to the worker's root context. The
//! root keeps the claim's lease alive (it stays in the heartbeat [`Registry`]) and retries the
//! complete from its tick with a growing delay, until it is stored, fenced out (a newer claim
//! owns the key), refused for good (a 4xx other than 408/409/429), or `complete_retry_ms` has
//! passed since the handover. Then the heartbeat stops; if it was not stored, the key stays
//! `in_progress` until its lease runs out, as before.
//!
//! With `complete_in_background` every complete takes this path: the stream hands it over as
//! soon as the response is captured, marked `background`, and the root sends it at once (the
//! stream wakes it through the worker's shared queue) instead of after the first delay; only
//! what follows a failed first attempt is a retry.
//!
//! Memory is bounded by the total payload bytes (`complete_retry_bytes`): a complete that would
//! go over it is given up at once. At most [`MAX_IN_FLIGHT`] retries are on their way at a time,
//! oldest first, and when one is stored the others are retried at the next tick (the state API
//! is back).

use crate::cache::{self, ReplayCache};
use crate::heartbeat::{InFlight, Registry};

/// Retry callouts on their way at once (per worker).
pub const MAX_IN_FLIGHT: usize = 32;
/// First delay after the handover, doubled after each failure up to [`MAX_DELAY_MS`].
pub const FIRST_DELAY_MS: u64 = 250;
pub const MAX_DELAY_MS: u64 = 8_000;

/// A complete handed over by a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingComplete {
    pub claim: InFlight,
    /// The `/v1/complete` JSON body.
    pub payload: Vec<u8>,
    /// The response as the replay cache keeps it (with a replay cache): answered to retries on
    /// this worker while the complete waits.
    pub fill: Option<Box<cache::Completed>>,
    /// Not tried yet (`complete_in_background`): sent at once, and its first attempt is not a
    /// retry. `false`: the stream tried it already; the first retry waits [`FIRST_DELAY_MS`].
    pub background: bool,
}

/// What one retry got back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// 2xx with a readable answer.
    Stored,
    /// 409: a newer claim owns the key.
    FencedOut,
    /// Another 4xx (except 408 and 429): retrying cannot help.
    Refused(u16),
    /// No answer, a 5xx, 408, 429 or an unreadable answer: retry later.
    Failed,
}

/// How a handed-over complete ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Done {
    Stored {
        claim: InFlight,
        attempts: u32,
        /// Handed over untried (`complete_in_background`): one attempt is the normal case.
        background: bool,
    },
    FencedOut {
        claim: InFlight,
    },
    /// Given up: the key stays in progress until its lease runs out.
    GaveUp {
        claim: InFlight,
        attempts: u32,
        why: String,
    },
}

impl Done {
    pub fn claim(&self) -> &InFlight {
        match self {
            Done::Stored { claim, .. } | Done::FencedOut { claim } | Done::GaveUp { claim, .. } => {
                claim
            }
        }
    }
}

/// What a tick does: completes to send now (token, payload), and completes given up.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Due {
    pub send: Vec<(i64, Vec<u8>)>,
    /// How many of `send` are the first attempt of a background complete (not retries).
    pub first_attempts: usize,
    pub gave_up: Vec<Done>,
}

#[derive(Debug)]
struct Entry {
    pending: PendingComplete,
    since_ms: u64,
    next_ms: u64,
    attempts: u32,
    in_flight: bool,
}

/// The worker's pending completes, oldest first (a plain list, like the heartbeat registry).
#[derive(Debug, Default)]
pub struct Retries {
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

impl Retries {
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

    pub fn contains(&self, token: i64) -> bool {
        self.entries.iter().any(|e| e.pending.claim.token == token)
    }

    fn find(&mut self, token: i64) -> Option<&mut Entry> {
        self.entries
            .iter_mut()
            .find(|e| e.pending.claim.token == token)
    }

    /// Whether a complete of `size` payload bytes would be taken over now.
    pub fn can_take(&self, size: usize) -> bool {
        self.enabled() && self.bytes.saturating_add(size) <= self.max_bytes
    }

    /// Takes a complete over; `Err(why)` when it cannot be kept.
    pub fn add(&mut self, pending: PendingComplete, now_ms: u64) -> Result<(), String> {
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
        let next_ms = if pending.background {
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

    /// Forgets a complete (its claim was fenced out by a heartbeat).
    pub fn remove(&mut self, token: i64) -> Option<InFlight> {
        self.take(token).map(|e| e.pending.claim)
    }

    /// At a tick: the completes to send now (token, payload), marked as on their way, and the
    /// ones given up because `complete_retry_ms` has passed.
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
                gave_up.push(Done::GaveUp {
                    claim: e.pending.claim,
                    attempts: e.attempts,
                    why: format!("still failing after {} ms", self.max_ms),
                });
            }
        }
        let mut room =
            MAX_IN_FLIGHT.saturating_sub(self.entries.iter().filter(|e| e.in_flight).count());
        let mut send = Vec::new();
        let mut first_attempts = 0;
        for e in self.entries.iter_mut() {
            if room == 0 {
                break;
            }
            if !e.in_flight && e.next_ms <= now_ms {
                if e.pending.background && e.attempts == 0 {
                    first_attempts += 1;
                }
                e.in_flight = true;
                e.attempts += 1;
                room -= 1;
                send.push((e.pending.claim.token, e.pending.payload.clone()));
            }
        }
        Due {
            send,
            first_attempts,
            gave_up,
        }
    }

    /// A retry could not be sent or was answered. `None`: it stays, to be retried.
    pub fn answered(&mut self, token: i64, answer: Answer, now_ms: u64) -> Option<Done> {
        let e = self.find(token)?;
        e.in_flight = false;
        match answer {
            Answer::Failed => {
                e.next_ms = now_ms.saturating_add(delay(e.attempts));
                None
            }
            Answer::Stored => {
                let e = self.take(token)?;
                // The state API is back: the others need not wait out their delays.
                for other in self.entries.iter_mut() {
                    other.next_ms = other.next_ms.min(now_ms);
                }
                Some(Done::Stored {
                    background: e.pending.background,
                    claim: e.pending.claim,
                    attempts: e.attempts,
                })
            }
            Answer::FencedOut => {
                let e = self.take(token)?;
                Some(Done::FencedOut {
                    claim: e.pending.claim,
                })
            }
            Answer::Refused(status) => {
                let e = self.take(token)?;
                Some(Done::GaveUp {
                    claim: e.pending.claim,
                    attempts: e.attempts,
                    why: format!("refused with HTTP {status}"),
                })
            }
        }
    }
}

/// Classifies the state API's answer to a complete.
pub fn classify(status: Option<u16>, readable: bool) -> Answer {
    match status {
        Some(s) if (200..300).contains(&s) && readable => Answer::Stored,
        Some(409) => Answer::FencedOut,
        Some(s) if (400..500).contains(&s) && s != 408 && s != 429 => Answer::Refused(s),
        _ => Answer::Failed,
    }
}

/// Reads the state API's answer to a complete or release (or the call's failure): how to go
/// on, and the stored record's expiry when the answer carried one.
pub fn read_answer(answer: &crate::flow::Callout) -> (Answer, Option<u64>) {
    use crate::flow::Callout;
    let (status, written) = match answer {
        Callout::Answer { status, body } if (200..300).contains(status) => {
            (Some(*status), crate::answers::write(body).ok())
        }
        Callout::Answer { status, .. } => (Some(*status), None),
        Callout::Failed(_) => (None, None),
    };
    (
        classify(status, written.is_some()),
        written.and_then(|w| w.expires_in_ms),
    )
}

/// A stream hands its complete over: the claim stays in the heartbeat registry while the
/// complete waits, and the response is answered to retries from the replay cache. `Err(why)`:
/// not kept; the heartbeat stops and the key stays in progress until its lease runs out.
pub fn hand_over(
    registry: &mut Registry,
    retries: &mut Retries,
    cache: &mut ReplayCache,
    mut pending: PendingComplete,
    now_ms: u64,
) -> Result<(), String> {
    let token = pending.claim.token;
    let claim = pending.claim.clone();
    let fill = pending.fill.take();
    match retries.add(pending, now_ms) {
        Ok(()) => {
            if !registry.contains(token) {
                // The stream ended before: keep the lease alive all the same.
                registry.register(token, claim.clone(), now_ms);
            }
            if let Some(rec) = fill {
                cache.insert_pending(cache_id(&claim), *rec);
            }
            Ok(())
        }
        Err(why) => {
            registry.remove(token);
            Err(why)
        }
    }
}

/// The replay cache's address of a claim's record.
pub fn cache_id(claim: &InFlight) -> cache::Id {
    cache::id(&claim.key, &claim.subject, &claim.endpoint)
}

/// A handed-over complete is over: its heartbeat stops, and its pending cache entry becomes a
/// normal one (stored, with the record's expiry) or goes.
pub fn finish(
    registry: &mut Registry,
    cache: &mut ReplayCache,
    done: &Done,
    expires_in_ms: Option<u64>,
    now_ms: u64,
) {
    let claim = done.claim();
    registry.remove(claim.token);
    let id = cache_id(claim);
    match (done, expires_in_ms) {
        (Done::Stored { .. }, Some(expires_in_ms)) => cache.settle(&id, now_ms, expires_in_ms),
        _ => {
            cache.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn pending(token: i64, len: usize) -> PendingComplete {
        PendingComplete {
            claim: InFlight {
                key: "k".into(),
                subject: "s".into(),
                endpoint: "POST /checkout".into(),
                token,
            },
            payload: vec![b'x'; len],
            fill: None,
            background: false,
        }
    }

    fn background(token: i64, len: usize) -> PendingComplete {
        PendingComplete {
            background: true,
            ..pending(token, len)
        }
    }

    #[test]
    fn retried_with_growing_delays_until_stored() {
        let mut r = Retries::new(1 << 20, 600_000);
        r.add(pending(5, 100), 1_000).unwrap();
        assert!(r.due(1_100).send.is_empty(), "not before the first delay");
        let Due {
            send,
            first_attempts,
            gave_up,
        } = r.due(1_250);
        assert_eq!(send, vec![(5, vec![b'x'; 100])]);
        assert_eq!(first_attempts, 0, "the stream tried it already: a retry");
        assert!(gave_up.is_empty());
        assert!(r.due(5_000).send.is_empty(), "not twice while on its way");
        assert_eq!(
            (1..=6).map(delay).collect::<Vec<_>>(),
            vec![500, 1_000, 2_000, 4_000, 8_000, 8_000]
        );
        let mut now = 5_000;
        for attempts in 1..=12 {
            assert_eq!(r.answered(5, Answer::Failed, now), None);
            assert!(r.due(now + delay(attempts) - 1).send.is_empty());
            now += delay(attempts);
            assert_eq!(r.due(now).send.len(), 1);
        }
        assert_eq!(
            r.answered(5, Answer::Stored, now),
            Some(Done::Stored {
                claim: pending(5, 0).claim,
                attempts: 13,
                background: false,
            })
        );
        assert!(r.is_empty());
        assert_eq!(r.bytes(), 0);
        assert_eq!(
            r.answered(5, Answer::Stored, 20_000),
            None,
            "late answers are ignored"
        );
    }

    #[test]
    fn given_up_after_the_bound_or_when_refused_and_fenced_out_is_final() {
        let mut r = Retries::new(1 << 20, 600_000);
        r.add(pending(1, 10), 0).unwrap();
        r.add(pending(2, 10), 0).unwrap();
        r.add(pending(3, 10), 0).unwrap();
        assert_eq!(r.due(300).send.len(), 3);
        assert_eq!(
            r.answered(2, Answer::FencedOut, 400),
            Some(Done::FencedOut {
                claim: pending(2, 0).claim
            })
        );
        assert!(
            matches!(r.answered(3, Answer::Refused(413), 400), Some(Done::GaveUp { ref why, .. }) if why.contains("413"))
        );
        r.answered(1, Answer::Failed, 400);
        // An entry on its way is not given up under it; once answered, the bound applies.
        let Due { send, gave_up, .. } = r.due(600_000);
        assert!(send.is_empty());
        assert_eq!(gave_up.len(), 1);
        assert!(matches!(&gave_up[0], Done::GaveUp { attempts: 1, claim, .. } if claim.token == 1));
        assert!(r.is_empty());
    }

    #[test]
    fn memory_is_bounded_and_retries_in_flight_are_capped() {
        let mut r = Retries::new(1_000, 600_000);
        r.add(pending(1, 600), 0).unwrap();
        assert!(r
            .add(pending(2, 500), 0)
            .unwrap_err()
            .contains("complete_retry_bytes"));
        r.add(pending(2, 400), 0).unwrap();
        assert_eq!(r.bytes(), 1_000);
        assert!(Retries::new(0, 1).add(pending(1, 1), 0).is_err());
        assert!(Retries::new(1, 0).add(pending(1, 1), 0).is_err());

        let mut r = Retries::new(1 << 20, 600_000);
        for t in 0..(MAX_IN_FLIGHT as i64 + 8) {
            r.add(pending(t, 1), 0).unwrap();
        }
        let send = r.due(1_000).send;
        assert_eq!(send.len(), MAX_IN_FLIGHT);
        assert_eq!(send[0].0, 0, "oldest first");
        assert!(
            r.due(1_000).send.is_empty(),
            "no room until answers come back"
        );
        r.answered(0, Answer::Failed, 1_000);
        r.answered(1, Answer::Stored, 1_000);
        let send = r.due(1_000).send;
        // Two freed slots, oldest first: 0 (hurried, since 1 was stored) and 32.
        assert_eq!(
            send.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
            vec![0, 32]
        );
    }

    #[test]
    fn a_stored_retry_hurries_the_others() {
        let mut r = Retries::new(1 << 20, 600_000);
        r.add(pending(1, 1), 0).unwrap();
        r.add(pending(2, 1), 0).unwrap();
        r.due(250);
        r.answered(1, Answer::Failed, 300);
        r.answered(2, Answer::Failed, 300);
        r.due(800);
        r.answered(2, Answer::Failed, 800); // 2 now waits 1 s
        r.answered(1, Answer::Stored, 900);
        assert_eq!(r.due(900).send, vec![(2, vec![b'x'])]);
    }

    #[test]
    fn a_background_complete_is_sent_at_once_and_retried_like_the_others() {
        let mut r = Retries::new(1 << 20, 600_000);
        r.add(background(7, 10), 1_000).unwrap();
        r.add(pending(8, 10), 1_000).unwrap();
        let due = r.due(1_000);
        assert_eq!(due.send, vec![(7, vec![b'x'; 10])], "no delay, and only it");
        assert_eq!(due.first_attempts, 1);
        // A failed first attempt waits like a retry; its next attempt is one.
        assert_eq!(r.answered(7, Answer::Failed, 1_001), None);
        assert!(r
            .due(1_001 + delay(1) - 1)
            .send
            .iter()
            .all(|(t, _)| *t != 7));
        let due = r.due(1_001 + delay(1));
        assert!(due.send.iter().any(|(t, _)| *t == 7));
        assert_eq!(due.first_attempts, 0);
        assert_eq!(
            r.answered(7, Answer::Stored, 3_000),
            Some(Done::Stored {
                claim: background(7, 0).claim,
                attempts: 2,
                background: true,
            })
        );
        // Room is checked before the stream lets its response go.
        let mut r = Retries::new(100, 600_000);
        assert!(r.can_take(100));
        r.add(background(1, 60), 0).unwrap();
        assert!(r.can_take(40) && !r.can_take(41));
        assert!(!Retries::new(0, 600_000).can_take(0));
    }

    #[test]
    fn answers_are_classified() {
        assert_eq!(classify(Some(200), true), Answer::Stored);
        assert_eq!(classify(Some(200), false), Answer::Failed);
        assert_eq!(classify(Some(409), false), Answer::FencedOut);
        for s in [400, 401, 413, 422] {
            assert_eq!(classify(Some(s), false), Answer::Refused(s));
        }
        for s in [Some(408), Some(429), Some(500), Some(503), Some(302), None] {
            assert_eq!(classify(s, false), Answer::Failed, "{s:?}");
        }
    }

    fn rec() -> Box<cache::Completed> {
        Box::new(cache::Completed {
            fingerprint: "ab".repeat(32),
            fingerprint_alg: "sha256-jcs-v1",
            status: 201,
            headers: vec![],
            body: b"{}".to_vec(),
            replayable: true,
        })
    }

    #[test]
    fn handing_over_keeps_the_heartbeat_and_a_pending_cache_entry_or_stops_it() {
        let mut reg = Registry::default();
        let mut r = Retries::new(100, 600_000);
        let mut cache = ReplayCache::new(1 << 20, 60_000);
        let mut p = pending(9, 10);
        p.fill = Some(rec());
        reg.register(9, p.claim.clone(), 0);
        hand_over(&mut reg, &mut r, &mut cache, p.clone(), 50).unwrap();
        assert!(reg.contains(9) && r.contains(9));
        let id = cache_id(&p.claim);
        assert!(
            cache.get(&id, 1_000_000).is_some(),
            "answered while the complete waits"
        );
        // A claim no longer registered (its stream ended) is registered again.
        hand_over(&mut reg, &mut r, &mut cache, pending(10, 10), 60).unwrap();
        assert!(reg.contains(10));
        // Refused: the heartbeat stops.
        let big = pending(11, 1_000);
        reg.register(11, big.claim.clone(), 0);
        assert!(hand_over(&mut reg, &mut r, &mut cache, big, 70).is_err());
        assert!(!reg.contains(11) && !r.contains(11));

        // Stored: the heartbeat stops, the entry lives on with the record's expiry.
        r.due(1_000);
        let done = r.answered(9, Answer::Stored, 2_000).unwrap();
        finish(&mut reg, &mut cache, &done, Some(30_000), 2_000);
        assert!(!reg.contains(9));
        assert!(cache.get(&id, 31_999).is_some());
        assert!(cache.get(&id, 32_000).is_none());
        // Given up or fenced out: the entry goes, the state API decides again.
        let mut p = pending(12, 10);
        p.fill = Some(rec());
        hand_over(&mut reg, &mut r, &mut cache, p.clone(), 0).unwrap();
        r.due(1_000);
        let done = r.answered(12, Answer::FencedOut, 1_000).unwrap();
        finish(&mut reg, &mut cache, &done, None, 1_000);
        assert!(cache.get(&cache_id(&p.claim), 1_000).is_none());
        assert!(!reg.contains(12));
    }
}
