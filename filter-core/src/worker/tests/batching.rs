//! Claims and held completes batched like the state API's group commit: those that queue
//! while one is on its way go as one `/v1/writes` callout of the worker, and each stream gets
//! its own answer.

use super::*;
use contract::wire::{BatchItem, BatchResponse, WRITES_PATH};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn batching(most: u64) -> Harness {
    Harness::new(&CONFIG.replacen("\"batch_max\": 1,", &format!("\"batch_max\": {most},"), 1))
}

impl Harness {
    /// A claim of `first` that goes alone, then `queued` (key, path) queued behind it; once the
    /// first is granted `token`, the queue goes as one `/v1/writes`, returned with its streams.
    fn claims_batched(
        &mut self,
        first: &str,
        queued: &[(&str, &str)],
        token: i64,
    ) -> (Vec<StreamId>, Dispatch) {
        let (_, step) = self.keyed(first, "/checkout", ONE);
        let own = step.dispatch(CLAIM_PATH).clone();
        let streams = queued
            .iter()
            .map(|(key, path)| self.keyed(key, path, ONE).0)
            .collect();
        self.answer(&own, claimed(token));
        let batch = self.wake().dispatch(WRITES_PATH).clone();
        (streams, batch)
    }

    /// Three claimed streams (tokens 1, 2, 3) answered 201: the first's complete goes alone,
    /// and once it is stored the other two go as one `/v1/writes`, returned.
    fn completes_batched(&mut self) -> (StreamId, StreamId, Dispatch) {
        let (a, _) = self.claimed_key("a", "/checkout", b"{}", 1);
        let (b, _) = self.claimed_key("b", "/checkout", b"{}", 2);
        let (c, _) = self.claimed_key("c", "/checkout", b"{}", 3);
        let own = self.own_complete(a);
        self.ok_response(b, "201", true);
        self.ok_response(c, "201", true);
        self.answer(&own, written());
        let batch = self.wake().dispatch(WRITES_PATH).clone();
        (b, c, batch)
    }

    /// `s` answered 201: its complete, on its way alone (nothing else is in the lane).
    fn own_complete(&mut self, s: StreamId) -> Dispatch {
        self.ok_response(s, "201", true)
            .dispatch(COMPLETE_PATH)
            .clone()
    }

    /// `s` answered 201 while the lane is busy: its complete queues.
    fn queued_complete(&mut self, s: StreamId) -> bool {
        self.ok_response(s, "201", true)
            .dispatches(COMPLETE_PATH)
            .is_empty()
    }

    fn wake(&mut self) -> Seen {
        self.w.on_wake(self.now).into()
    }
}

const ONE: &[u8] = br#"{"amount":1}"#;

/// The claims a `/v1/writes` carries.
fn batched(d: &Dispatch) -> Vec<ClaimRequest> {
    let v: serde_json::Value = serde_json::from_slice(&d.body).unwrap();
    serde_json::from_value(v["claims"].clone()).unwrap()
}

fn batch_answer(items: &[(u16, serde_json::Value)]) -> CalloutResult {
    let answers = items
        .iter()
        .map(|(status, answer)| BatchItem {
            status: *status,
            answer: answer.clone(),
        })
        .collect();
    answer(&BatchResponse { answers })
}

fn granted(token: i64) -> serde_json::Value {
    serde_json::to_value(ClaimResponse::Claimed {
        token,
        lease_ms: 30_000,
        reclaimed: false,
        max_body_bytes: None,
        retention_s: None,
    })
    .unwrap()
}

fn replies_to(step: &Seen, s: StreamId) -> &LocalReply {
    step.effects
        .iter()
        .find_map(|e| match e {
            Effect::Reply { stream, reply } if *stream == s => Some(reply),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no reply to stream {s} in {step:?}"))
}

fn resumes(step: &Seen, s: StreamId) -> bool {
    step.effects
        .iter()
        .any(|e| matches!(e, Effect::ResumeRequest { stream } if *stream == s))
}

#[test]
fn claims_queued_behind_one_on_its_way_go_as_one_worker_callout_and_each_stream_gets_its_answer() {
    let mut t = batching(32);
    // Alone: its own callout at once (no added wait at low load).
    let (a, first) = t.keyed("a", "/checkout", ONE);
    let own = first.dispatch(CLAIM_PATH).clone();
    assert_eq!(own.owner, Owner::Stream(a));
    // Behind it: queued, nothing sent.
    let (b, step_b) = t.keyed("b", "/checkout", ONE);
    let (c, step_c) = t.keyed("c", "/checkout", ONE);
    let (d, step_d) = t.keyed("d", "/checkout", ONE);
    for step in [&step_b, &step_c, &step_d] {
        assert_eq!(step.verdict, Verdict::Pause);
        assert!(
            step.effects
                .iter()
                .all(|e| !matches!(e, Effect::Dispatch(_))),
            "{step:?}"
        );
    }
    assert_eq!(t.w.usage().batched_claims, 3);

    // The first answered: its stream goes on, and the worker asks to be woken.
    let step = t.answer(&own, claimed(1));
    assert!(resumes(&step, a));
    assert!(step.effects.contains(&Effect::Wake), "{step:?}");
    let step = t.wake();
    let batch = step.dispatch(WRITES_PATH).clone();
    assert_eq!(batch.owner, Owner::Worker);
    let keys: Vec<String> = batched(&batch).into_iter().map(|c| c.key).collect();
    assert_eq!(keys, ["b", "c", "d"]);
    assert_eq!(t.w.batch_streams(batch.id), Some((vec![b, c, d], vec![])));
    assert_eq!(
        step.counts(),
        [
            Metric::ClaimBatches,
            Metric::ClaimsBatched,
            Metric::ClaimsBatched,
            Metric::ClaimsBatched
        ]
    );

    // Each answer reaches its stream, from the root context.
    let completed = serde_json::to_value(ClaimResponse::completed(stored_201(), 60_000)).unwrap();
    let running = serde_json::to_value(ClaimResponse::in_progress(1_500)).unwrap();
    let step = t.answer(
        &batch,
        batch_answer(&[(200, granted(2)), (200, completed), (200, running)]),
    );
    assert!(resumes(&step, b));
    assert!(step.effects.contains(&Effect::SetRequestHeader {
        stream: b,
        name: FENCING_TOKEN_HEADER,
        value: "2".into()
    }));
    assert!(t.w.awaits_response(b));
    assert_eq!(
        header(replies_to(&step, c), "idempotent-replayed"),
        Some("true")
    );
    assert_eq!(replies_to(&step, d).status, 409);
    assert!(!resumes(&step, c) && !resumes(&step, d));
    assert_eq!(t.w.usage().batched_claims, 0);
    // Nothing was left queued, so nothing more is sent.
    assert!(t.wake().effects.is_empty());
}

#[test]
fn a_claim_granted_after_its_stream_ended_is_released_and_a_queued_one_is_never_sent() {
    let mut t = batching(32);
    let (_, first) = t.keyed("a", "/checkout", ONE);
    let own = first.dispatch(CLAIM_PATH).clone();
    let (b, _) = t.keyed("b", "/checkout", ONE);
    let (c, _) = t.keyed("c", "/checkout", ONE);
    // c's client goes before anything was sent for it.
    t.done(c);
    t.answer(&own, claimed(1));
    let batch = t.wake().dispatch(WRITES_PATH).clone();
    assert_eq!(t.w.batch_streams(batch.id), Some((vec![b], vec![])));
    // b's client goes while its claim is on the way; the state API grants it all the same.
    t.done(b);
    let step = t.answer(&batch, batch_answer(&[(200, granted(7))]));
    assert!(
        step.counts().contains(&Metric::ClaimedForEndedStream),
        "{step:?}"
    );
    assert!(!step
        .effects
        .iter()
        .any(|e| matches!(e, Effect::ResumeRequest { .. } | Effect::Reply { .. })));
    // Nothing was forwarded: the worker gives the key back.
    assert!(step.effects.contains(&Effect::Wake));
    let step = t.wake();
    let release = step.dispatch(RELEASE_PATH);
    assert_eq!(release.owner, Owner::Worker);
    let r: ReleaseRequest = serde_json::from_slice(&release.body).unwrap();
    assert_eq!((r.key.as_str(), r.token), ("b", 7));
}

#[test]
fn a_batch_that_fails_whole_answers_each_claim_as_its_own_failure_would() {
    let mut t = batching(32);
    // `/refunds` fails open when the state API is unavailable.
    let (s, batch) = t.claims_batched("a", &[("b", "/checkout"), ("r", "/refunds")], 1);
    let (b, r) = (s[0], s[1]);
    let step = t.answer(&batch, CalloutResult::Failed("reset".into()));
    assert_eq!(replies_to(&step, b).status, 503);
    assert!(resumes(&step, r), "{step:?}");
    assert!(step.effects.contains(&Effect::RemoveRequestHeader {
        stream: r,
        name: FENCING_TOKEN_HEADER
    }));

    // Refused (a wrong token): never forwarded, not even where the route fails open.
    let (s, batch) = t.claims_batched("a2", &[("b2", "/checkout"), ("r2", "/refunds")], 2);
    let (b, r) = (s[0], s[1]);
    let step = t.answer(&batch, status(401, br#"{"detail":"wrong token"}"#));
    assert_eq!(replies_to(&step, b).status, 500);
    assert_eq!(replies_to(&step, r).status, 500);
    assert!(!resumes(&step, r));

    // An item refused alone is refused; the others go on.
    let (s, batch) = t.claims_batched("a3", &[("b3", "/checkout"), ("r3", "/refunds")], 3);
    let (b, r) = (s[0], s[1]);
    let problem = serde_json::json!({"status": 400, "detail": "key: too long"});
    let step = t.answer(&batch, batch_answer(&[(400, problem), (200, granted(4))]));
    assert_eq!(replies_to(&step, b).status, 500);
    assert!(resumes(&step, r));
    // An answer with the wrong number of items is no answer: 503, and /refunds fails open.
    let (s, batch) = t.claims_batched("a4", &[("b4", "/checkout"), ("r4", "/refunds")], 5);
    let (b, r) = (s[0], s[1]);
    let step = t.answer(&batch, batch_answer(&[(200, granted(6))]));
    assert_eq!(replies_to(&step, b).status, 503);
    assert!(resumes(&step, r));
}

#[test]
fn claims_that_wait_go_alone_and_batches_keep_to_their_bound() {
    let mut t = batching(2);
    let (_, first) = t.keyed("a", "/checkout", ONE);
    let own = first.dispatch(CLAIM_PATH).clone();
    // A retry that asks to wait is its own callout even behind another.
    let (_, step) = t.waiting("wait=5", ONE);
    assert!(step.claim().wait_ms.is_some());
    // It does not hold the queue back: with `a` answered, the queue goes.
    let queued: Vec<StreamId> = ["b", "c", "d"]
        .iter()
        .map(|k| t.keyed(k, "/checkout", ONE).0)
        .collect();
    t.answer(&own, claimed(1));
    let step = t.wake();
    let batches = step.dispatches(WRITES_PATH);
    assert_eq!(batches.len(), 2, "{step:?}");
    assert_eq!(
        t.w.batch_streams(batches[0].id),
        Some((queued[..2].to_vec(), vec![]))
    );
    assert_eq!(
        t.w.batch_streams(batches[1].id),
        Some((queued[2..].to_vec(), vec![]))
    );
}

#[test]
fn a_claim_queued_behind_a_callout_that_never_answers_goes_at_the_next_tick() {
    let mut t = batching(32);
    let (_, first) = t.keyed("a", "/checkout", ONE);
    assert!(first.claims());
    let (b, _) = t.keyed("b", "/checkout", ONE);
    t.advance(t.w.tick_period_ms());
    let step = t.tick();
    let batch = step.dispatch(WRITES_PATH);
    assert_eq!(t.w.batch_streams(batch.id), Some((vec![b], vec![])));
}

fn resumes_response(step: &Seen, s: StreamId) -> bool {
    step.effects
        .iter()
        .any(|e| matches!(e, Effect::ResumeResponse { stream } if *stream == s))
}

/// The completes a `/v1/writes` carries.
/// The fencing tokens of `/v1/complete` callouts, in order.
fn complete_tokens<'a>(ds: impl Iterator<Item = &'a Dispatch>) -> Vec<i64> {
    ds.map(|d| {
        serde_json::from_slice::<CompleteRequest>(&d.body)
            .unwrap()
            .token
    })
    .collect()
}

fn batched_completes(d: &Dispatch) -> Vec<CompleteRequest> {
    let v: serde_json::Value = serde_json::from_slice(&d.body).unwrap();
    serde_json::from_value(v["completes"].clone()).unwrap()
}

#[test]
fn held_completes_queued_behind_one_on_its_way_go_as_one_worker_callout() {
    let mut t = batching(32);
    let (a, _) = t.claimed_key("a", "/checkout", b"{}", 1);
    let (b, _) = t.claimed_key("b", "/checkout", b"{}", 2);
    let (c, _) = t.claimed_key("c", "/checkout", b"{}", 3);
    let own = t.own_complete(a);
    assert_eq!(own.owner, Owner::Stream(a));
    for s in [b, c] {
        let step = t.ok_response(s, "201", true);
        assert_eq!(step.verdict, Verdict::Pause, "the response is held");
        assert!(
            step.effects
                .iter()
                .all(|e| !matches!(e, Effect::Dispatch(_))),
            "{step:?}"
        );
    }
    assert_eq!(t.w.usage().batched_writes, 2);
    let step = t.answer(&own, written());
    assert!(resumes_response(&step, a));
    assert!(step.effects.contains(&Effect::Wake));
    let step = t.wake();
    let batch = step.dispatch(WRITES_PATH).clone();
    assert_eq!(batch.owner, Owner::Worker);
    let tokens: Vec<i64> = batched_completes(&batch).iter().map(|c| c.token).collect();
    assert_eq!(tokens, [2, 3]);
    assert_eq!(
        step.counts(),
        [
            Metric::CompleteBatches,
            Metric::CompletesBatched,
            Metric::CompletesBatched
        ]
    );
    // b is stored; c was fenced out (a newer claim owns its key): both responses go on.
    let fenced = serde_json::json!({"status": 409, "detail": "fenced out"});
    let stored = serde_json::to_value(WriteResponse::completed(86_400_000)).unwrap();
    let step = t.answer(&batch, batch_answer(&[(200, stored), (409, fenced)]));
    assert!(
        resumes_response(&step, b) && resumes_response(&step, c),
        "{step:?}"
    );
    let counts = step.counts();
    assert!(counts.contains(&Metric::Completed) && counts.contains(&Metric::FencedOut));
    assert_eq!(t.w.usage().batched_writes, 0);
    assert_eq!(t.w.usage().claims, 0, "every heartbeat stops");
    // b's outcome is in this worker's memory: its retry is replayed without a callout.
    let (_, retry) = t.keyed("b", "/checkout", ONE);
    assert!(!retry.claims());
}

#[test]
fn a_failed_completes_batch_is_retried_by_each_stream_and_a_stream_that_ended_is_stored_still() {
    let mut t = batching(32);
    let (b, c, batch) = t.completes_batched();
    // c's client goes while its complete is on the way: the worker takes the write over.
    t.done(c);
    let step = t.answer(&batch, CalloutResult::Failed("reset".into()));
    // b tries once more (its own retry, from the root context: the worker's callout).
    let retry = step.dispatch(COMPLETE_PATH).clone();
    assert_eq!(retry.owner, Owner::Worker);
    assert_eq!(
        serde_json::from_slice::<CompleteRequest>(&retry.body)
            .unwrap()
            .token,
        2
    );
    assert!(!resumes_response(&step, b));
    let step = t.answer(&retry, written());
    assert!(resumes_response(&step, b));
    // c's complete is sent by the worker after its first delay (in the lane, as a batch).
    t.advance(writes::FIRST_DELAY_MS);
    let step = t.tick();
    let handed = step.dispatch(WRITES_PATH);
    assert_eq!(batched_completes(handed)[0].token, 3);
}

#[test]
fn a_complete_too_large_to_batch_goes_alone() {
    let mut t = Harness::new(
        &CONFIG
            .replacen("\"batch_max\": 1,", "\"batch_max\": 32,", 1)
            .replacen(
                "\"max_stored_body_bytes\": 10",
                "\"max_stored_body_bytes\": 100000",
                1,
            ),
    );
    let (a, _) = t.claimed_key("a", "/checkout", b"{}", 1);
    let (b, _) = t.claimed_key("b", "/checkout", b"{}", 2);
    let (c, _) = t.claimed_key("c", "/checkout", b"{}", 3);
    let own = t.own_complete(a);
    // A small one queues behind it.
    assert!(t.queued_complete(b));
    // One over BATCH_WRITE_BYTES (70,000 bytes, base64 in the complete) goes at once, alone.
    let big = vec![b'x'; 70_000];
    t.ok_response(c, "200", false);
    let step = t.response_body(c, big.len(), true, &mut |n| Some(big[..n].to_vec()));
    let alone = step.dispatch(COMPLETE_PATH);
    assert!(alone.body.len() > BATCH_WRITE_BYTES);
    assert_eq!(alone.owner, Owner::Stream(c));
    assert_eq!(t.w.usage().batched_writes, 1);
    assert!(own.body.len() < BATCH_WRITE_BYTES);
}

#[test]
fn a_state_api_without_batches_gets_each_claim_and_complete_alone_from_then_on() {
    let mut t = batching(32);
    let (s, batch) = t.claims_batched("a", &[("b", "/checkout"), ("c", "/checkout")], 1);
    let (b, c) = (s[0], s[1]);
    t.done(c);
    // An older state API: 404 for /v1/writes. b's claim goes alone (c's stream is gone).
    let step = t.answer(&batch, status(404, br#"{"detail":"no route"}"#));
    let alone = step.dispatch(CLAIM_PATH).clone();
    assert_eq!(alone.owner, Owner::Worker);
    assert_eq!(
        serde_json::from_slice::<ClaimRequest>(&alone.body)
            .unwrap()
            .key,
        "b"
    );
    let step = t.answer(&alone, claimed(2));
    assert!(resumes(&step, b));
    // From now on nothing queues: a claim behind another is its own callout.
    let (_, d) = t.keyed("d", "/checkout", ONE);
    let (_, e) = t.keyed("e", "/checkout", ONE);
    assert!(d.claims() && e.claims());
    // Nor a complete behind another.
    let (x, _) = t.claimed_key("x", "/checkout", b"{}", 5);
    let (y, _) = t.claimed_key("y", "/checkout", b"{}", 6);
    assert!(!t.queued_complete(x));
    assert!(!t.queued_complete(y));
}

#[test]
fn completes_refused_as_a_batch_by_an_older_state_api_go_alone() {
    let mut t = batching(32);
    let (b, c, batch) = t.completes_batched();
    let step = t.answer(&batch, status(404, b""));
    let alone: Vec<Dispatch> = step
        .dispatches(COMPLETE_PATH)
        .into_iter()
        .cloned()
        .collect();
    assert_eq!(complete_tokens(alone.iter()), [2, 3]);
    assert!(alone.iter().all(|d| d.owner == Owner::Worker));
    assert!(resumes_response(&t.answer(&alone[0], written()), b));
    assert!(resumes_response(&t.answer(&alone[1], written()), c));
}

#[test]
fn claims_and_completes_share_one_lane_and_go_in_one_callout() {
    let mut t = batching(32);
    let (a, _) = t.claimed_key("a", "/checkout", b"{}", 1);
    let (c, _) = t.claimed_key("c", "/checkout", b"{}", 3);
    let own = t.own_complete(a);
    // A new claim queues behind the held complete on its way, and so does c's complete.
    let (b, step) = t.keyed("b", "/checkout", ONE);
    assert!(!step.claims(), "{step:?}");
    assert!(t.queued_complete(c));
    let step = t.answer(&own, written());
    assert!(resumes_response(&step, a));
    let step = t.wake();
    let batch = step.dispatch(WRITES_PATH).clone();
    assert_eq!(batch.owner, Owner::Worker);
    assert_eq!(t.w.batch_streams(batch.id), Some((vec![b], vec![c])));
    assert_eq!(batched(&batch)[0].key, "b");
    assert_eq!(batched_completes(&batch)[0].token, 3);
    assert_eq!(
        step.counts(),
        [
            Metric::ClaimBatches,
            Metric::ClaimsBatched,
            Metric::CompleteBatches,
            Metric::CompletesBatched
        ]
    );
    // The claims' answers come first, then the completes'.
    let stored = serde_json::to_value(WriteResponse::completed(86_400_000)).unwrap();
    let step = t.answer(&batch, batch_answer(&[(200, granted(4)), (200, stored)]));
    assert!(resumes(&step, b) && resumes_response(&step, c), "{step:?}");
    assert!(t.w.awaits_response(b));
    // An answer with an item short is no answer: e's claim fails (503).
    let (d, _) = t.claimed_key("d", "/checkout", b"{}", 5);
    let own = t.own_complete(d);
    let (e, _) = t.keyed("e", "/checkout", ONE);
    t.answer(&own, written());
    let batch = t.wake().dispatch(WRITES_PATH).clone();
    assert_eq!(t.w.batch_streams(batch.id), Some((vec![e], vec![])));
    let step = t.answer(&batch, batch_answer(&[]));
    assert_eq!(replies_to(&step, e).status, 503);
}

fn batching_in_background() -> Harness {
    let cfg = with(r#""complete_in_background": true,"#);
    Harness::new(&cfg.replacen("\"batch_max\": 1,", "\"batch_max\": 32,", 1))
}

#[test]
fn completes_taken_over_while_the_lane_is_busy_go_as_one_writes_when_it_answers() {
    let mut t = batching_in_background();
    let (a, _) = t.claimed_key("a", "/checkout", b"{}", 1);
    let (b, _) = t.claimed_key("b", "/checkout", b"{}", 2);
    let (c, _) = t.claimed_key("c", "/checkout", b"{}", 3);
    // d's claim is on its way: the lane is busy.
    let (d, step) = t.keyed("d", "/checkout", ONE);
    let own = step.dispatch(CLAIM_PATH).clone();
    for s in [a, b, c] {
        // Each response goes on at once; its complete waits for the lane, no wake of its own.
        let step = t.ok_response(s, "201", true);
        assert!(step.resumes_response(), "{step:?}");
        assert!(step.dispatches(COMPLETE_PATH).is_empty(), "{step:?}");
        assert!(!step.effects.contains(&Effect::Wake), "{step:?}");
    }
    let step = t.answer(&own, claimed(4));
    assert!(resumes(&step, d));
    assert!(step.effects.contains(&Effect::Wake), "{step:?}");
    let step = t.wake();
    let batch = step.dispatch(WRITES_PATH).clone();
    assert_eq!(batch.owner, Owner::Worker);
    assert!(step.dispatches(COMPLETE_PATH).is_empty(), "{step:?}");
    assert_eq!(t.w.batch_streams(batch.id), Some((vec![], vec![])));
    let tokens: Vec<i64> = batched_completes(&batch).iter().map(|c| c.token).collect();
    assert_eq!(tokens, [1, 2, 3]);
    assert_eq!(t.w.usage().batched_writes, 3);
    // a stored, b fenced out (a newer claim owns its key), c failed (sent again later).
    let stored = serde_json::to_value(WriteResponse::completed(86_400_000)).unwrap();
    let fenced = serde_json::json!({"type": "about:blank", "title": "fenced", "status": 409});
    let failed = serde_json::json!({"type": "about:blank", "title": "down", "status": 503});
    let step = t.answer(
        &batch,
        batch_answer(&[(200, stored), (409, fenced), (503, failed)]),
    );
    assert_eq!(
        step.counts(),
        [Metric::Completed, Metric::FencedOut, Metric::StateApiErrors]
    );
    // d's claim and c's still held: their leases are kept alive.
    assert_eq!(t.w.usage().claims, 2);
    assert_eq!(t.w.usage().writes, 1);
    t.now += writes::FIRST_DELAY_MS * 2;
    let retry = t.tick().dispatch(WRITES_PATH).clone();
    assert_eq!(batched_completes(&retry)[0].token, 3);
    let stored = serde_json::to_value(WriteResponse::completed(86_400_000)).unwrap();
    let step = t.answer(&retry, batch_answer(&[(200, stored)]));
    assert_eq!(step.counts(), [Metric::Completed]);
    assert_eq!(t.w.usage().claims, 1);
    // a's response is replayed from this worker's memory.
    let (_, step) = t.keyed("a", "/checkout", b"{}");
    assert!(step.replied() && !step.claims(), "{step:?}");
}

#[test]
fn a_complete_taken_over_while_the_lane_is_idle_goes_at_the_wake_and_the_next_claim_does_not_wait_for_it(
) {
    let mut t = batching_in_background();
    let (a, _) = t.claimed_key("a", "/checkout", b"{}", 1);
    let step = t.ok_response(a, "201", true);
    assert!(
        step.effects.contains(&Effect::Wake),
        "the lane is idle: {step:?}"
    );
    let batch = t.wake().dispatch(WRITES_PATH).clone();
    assert_eq!(batched_completes(&batch)[0].token, 1);
    assert_eq!(t.w.batch_streams(batch.id), Some((vec![], vec![])));
    // Its response has gone: the next client's claim goes at once, not behind it.
    let (b, step) = t.keyed("b", "/checkout", ONE);
    assert_eq!(step.dispatch(CLAIM_PATH).owner, Owner::Stream(b));
    let stored = serde_json::to_value(WriteResponse::completed(86_400_000)).unwrap();
    let step = t.answer(&batch, batch_answer(&[(200, stored)]));
    assert_eq!(step.counts(), [Metric::Completed]);
    assert!(!step.effects.contains(&Effect::Wake), "{step:?}");
}

#[test]
fn completes_taken_over_in_a_batch_an_older_state_api_refuses_go_again_one_each() {
    let mut t = batching_in_background();
    let (a, _) = t.claimed_key("a", "/checkout", b"{}", 1);
    let (b, _) = t.claimed_key("b", "/checkout", b"{}", 2);
    let (_, step) = t.keyed("d", "/checkout", ONE);
    let own = step.dispatch(CLAIM_PATH).clone();
    t.ok_response(a, "201", true);
    t.ok_response(b, "201", true);
    t.answer(&own, claimed(4));
    let batch = t.wake().dispatch(WRITES_PATH).clone();
    let step = t.answer(&batch, status(404, b"not found"));
    let again: Vec<&Dispatch> = step.dispatches(COMPLETE_PATH);
    assert_eq!(complete_tokens(again.iter().copied()), [1, 2]);
    assert!(again.iter().all(|d| d.owner == Owner::Worker));
    let (again_a, again_b) = (again[0].clone(), again[1].clone());
    assert_eq!(t.answer(&again_a, written()).counts(), [Metric::Completed]);
    assert_eq!(t.answer(&again_b, written()).counts(), [Metric::Completed]);
    // No more batches on this worker: the next complete it takes over goes alone.
    let (c, _) = t.claimed_key("c", "/checkout", b"{}", 5);
    t.ok_response(c, "201", true);
    let step = t.wake();
    assert!(step.dispatches(WRITES_PATH).is_empty(), "{step:?}");
    assert_eq!(step.dispatches(COMPLETE_PATH).len(), 1);
}
