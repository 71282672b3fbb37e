//! Group commit against a real Postgres: claims and completes that share one statement are
//! answered as the single path would answer each, and are committed before the answer.
//!
//! To make a batch's composition deterministic, a test holds `LOCK TABLE ... IN SHARE MODE`
//! from another connection (reads go on, INSERT and UPDATE wait). With `--batch-in-flight 1`, a
//! first request takes the only runner slot and waits on the lock; everything submitted next
//! queues; releasing the lock runs the queue as one batch.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;
use contract::wire::{ClaimRequest, ClaimResponse, StoredResponse};
use sqlx::Connection as _;
use state_api::batch::{ClaimJob, CompleteJob};
use state_api::store::{StoreError, WriteResult};
use tokio::task::JoinHandle;

/// One connection holding a SHARE lock on the table until `release`.
struct TableLock(sqlx::PgConnection);

impl TableLock {
    async fn take(db_url: &str) -> Self {
        let mut c = sqlx::PgConnection::connect(db_url).await.unwrap();
        sqlx::query("BEGIN").execute(&mut c).await.unwrap();
        sqlx::query("LOCK TABLE idempotency_records IN SHARE MODE")
            .execute(&mut c)
            .await
            .unwrap();
        Self(c)
    }

    /// Waits until `n` statements wait on the lock.
    async fn wait_for_waiters(&mut self, n: i64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks
                 WHERE NOT granted AND relation = 'idempotency_records'::regclass
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .fetch_one(&mut self.0)
            .await
            .unwrap();
            if waiting >= n {
                return;
            }
            assert!(Instant::now() < deadline, "{waiting} of {n} waiters");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn release(mut self) {
        sqlx::query("ROLLBACK").execute(&mut self.0).await.unwrap();
    }
}

/// Waits until `n` requests are queued in the API's batcher.
async fn wait_queued(api: &Api, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while api.state.batcher().queued() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} queued",
            api.state.batcher().queued()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn job(api: &Api, key: &str, fingerprint: &str, lease_ms: u64) -> ClaimJob {
    ClaimJob {
        scope: api.state.scoper().hash(key, "alice", ENDPOINT),
        subject: "alice".into(),
        endpoint: ENDPOINT.into(),
        fingerprint_alg: ALG.into(),
        fingerprint: api.state.scoper().keyed_fingerprint(ALG, fingerprint),
        lease_ms,
        retention_ms: api.state.config().retention_ms(),
        take_over_unknown: true,
        namespace: String::new(),
        deadline: far(),
        nonce: None,
        previous: None,
    }
}

/// A deadline no test reaches (the deadline tests set their own).
fn far() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(120)
}

fn submit_claim(api: &Api, job: ClaimJob) -> JoinHandle<Result<ClaimResponse, StoreError>> {
    let state = api.state.clone();
    tokio::spawn(async move { state.batcher().claim(job).await })
}

fn stored(body: &[u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: body.to_vec(),
        replayable: true,
    }
}

fn submit_complete(
    api: &Api,
    key: &str,
    token: i64,
    response: StoredResponse,
) -> JoinHandle<Result<WriteResult, StoreError>> {
    let state = api.state.clone();
    let job = CompleteJob {
        scope: api.state.scoper().hash(key, "alice", ENDPOINT),
        token,
        response,
        retention_ms: api.state.config().retention_ms(),
        deadline: far(),
    };
    tokio::spawn(async move { state.batcher().complete(job).await })
}

fn claimed(o: &ClaimResponse) -> (i64, bool) {
    match o {
        ClaimResponse::Claimed {
            token, reclaimed, ..
        } => (*token, *reclaimed),
        other => panic!("expected claimed, got {other:?}"),
    }
}

/// (state, token) of the committed record, read on a connection of its own.
async fn committed(api: &Api, key: &str) -> Option<(String, i64)> {
    let mut conn = sqlx::PgConnection::connect(&api.db_url).await.unwrap();
    let scope = api.state.scoper().hash(key, "alice", ENDPOINT);
    sqlx::query_as("SELECT state, fencing_token FROM idempotency_records WHERE scope_hash = $1")
        .bind(&scope[..])
        .fetch_optional(&mut conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn distinct_first_claims_share_one_statement_and_are_all_committed() {
    let api = Api::start(&["--batch-in-flight", "1"]).await;
    let mut lock = TableLock::take(&api.db_url).await;
    let blocker = submit_claim(&api, job(&api, "blocker", &fp(1), 30_000));
    lock.wait_for_waiters(1).await;

    // Over HTTP, the whole path.
    const N: usize = 40;
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            api.spawn_claim(&claim_req(
                &format!("first-{i}"),
                "alice",
                &fp(1),
                Some(45_000),
            ))
        })
        .collect();
    wait_queued(&api, N).await;
    lock.release().await;

    claimed(&blocker.await.unwrap().unwrap());
    let mut tokens = HashSet::new();
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await.unwrap().0 {
            ClaimResponse::Claimed {
                token,
                lease_ms,
                reclaimed,
                ..
            } => {
                assert_eq!((lease_ms, reclaimed), (45_000, false));
                assert!(tokens.insert(token), "token {token} given twice");
                // Committed before the answer: another connection sees it.
                assert_eq!(
                    committed(&api, &format!("first-{i}")).await,
                    Some(("in_progress".into(), token))
                );
            }
            other => panic!("first-{i}: {other:?}"),
        }
    }
    assert_eq!(tokens.len(), N);
    // The blocker alone (the single path), then the N claims in one statement.
    assert_eq!(api.state.metrics().batch_totals(), (2, N as u64 + 1));
    let m = api.metrics().await;
    assert_eq!(metric(&m, "state_api_batch_size_bucket{le=\"32.0\"}"), 1.0);
    assert_eq!(metric(&m, "state_api_batch_size_bucket{le=\"64.0\"}"), 2.0);
    assert_eq!(
        metric(&m, "state_api_claims_total{outcome=\"claimed\"}"),
        N as f64
    );
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_of_one_key_queued_together_give_one_owner() {
    let api = Api::start(&["--batch-in-flight", "1"]).await;
    let mut lock = TableLock::take(&api.db_url).await;
    let blocker = submit_claim(&api, job(&api, "blocker", &fp(1), 30_000));
    lock.wait_for_waiters(1).await;

    // The first claim of `same` goes into the batch; the others of that key run on the single
    // path, at the same time as the batch that inserts it.
    let owner = submit_claim(&api, job(&api, "same", &fp(1), 60_000));
    wait_queued(&api, 1).await;
    let duplicates: Vec<_> = (0..20)
        .map(|_| submit_claim(&api, job(&api, "same", &fp(1), 60_000)))
        .collect();
    let other_body = submit_claim(&api, job(&api, "same", &fp(2), 60_000));
    let others: Vec<_> = (0..10)
        .map(|i| submit_claim(&api, job(&api, &format!("other-{i}"), &fp(1), 60_000)))
        .collect();
    wait_queued(&api, 32).await;
    lock.release().await;

    claimed(&blocker.await.unwrap().unwrap());
    let (token, reclaimed) = claimed(&owner.await.unwrap().unwrap());
    assert!(!reclaimed);
    for d in duplicates {
        match d.await.unwrap().unwrap() {
            ClaimResponse::InProgress {
                lease_remaining_ms, ..
            } => {
                assert!(lease_remaining_ms > 50_000 && lease_remaining_ms <= 60_000)
            }
            other => panic!("duplicate: {other:?}"),
        }
    }
    assert_eq!(
        other_body.await.unwrap().unwrap(),
        ClaimResponse::Mismatch,
        "another body for the key"
    );
    for o in others {
        claimed(&o.await.unwrap().unwrap());
    }
    assert_eq!(
        committed(&api, "same").await,
        Some(("in_progress".into(), token))
    );
    let m = api.metrics().await;
    assert_eq!(
        metric(
            &m,
            "state_api_batch_single_path_total{op=\"claim\",reason=\"duplicate\"}"
        ),
        21.0
    );
    api.shutdown().await;
}

/// Two API processes on one database, each with a batch of the same keys (in opposite orders)
/// at the same moment: one owner per key, no deadlock, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_batching_the_same_keys_give_one_owner_per_key() {
    let a = Api::start(&["--batch-in-flight", "1"]).await;
    let b = Api::start_on(&a.db_url, &["--batch-in-flight", "1"]).await;
    let mut lock = TableLock::take(&a.db_url).await;
    let blockers = [
        submit_claim(&a, job(&a, "blocker-a", &fp(1), 30_000)),
        submit_claim(&b, job(&b, "blocker-b", &fp(1), 30_000)),
    ];
    lock.wait_for_waiters(2).await;
    const N: usize = 24;
    let keys: Vec<String> = (0..N).map(|i| format!("shared-{i}")).collect();
    let from_a: Vec<_> = keys
        .iter()
        .map(|k| submit_claim(&a, job(&a, k, &fp(1), 60_000)))
        .collect();
    let from_b: Vec<_> = keys
        .iter()
        .rev()
        .map(|k| submit_claim(&b, job(&b, k, &fp(1), 60_000)))
        .collect();
    wait_queued(&a, N).await;
    wait_queued(&b, N).await;
    lock.release().await;

    for bl in blockers {
        claimed(&bl.await.unwrap().unwrap());
    }
    let mut answers_a = Vec::new();
    for t in from_a {
        answers_a.push(t.await.unwrap().unwrap());
    }
    let mut answers_b = Vec::new();
    for t in from_b {
        answers_b.push(t.await.unwrap().unwrap());
    }
    answers_b.reverse();
    for (i, (x, y)) in answers_a.iter().zip(&answers_b).enumerate() {
        let (token, loser) = match (x, y) {
            (ClaimResponse::Claimed { token, .. }, l)
            | (l, ClaimResponse::Claimed { token, .. }) => (*token, l),
            _ => panic!("shared-{i}: no owner: {x:?} / {y:?}"),
        };
        assert!(
            matches!(loser, ClaimResponse::InProgress { .. }),
            "shared-{i}: {x:?} / {y:?}"
        );
        assert_eq!(
            committed(&a, &keys[i]).await,
            Some(("in_progress".into(), token))
        );
    }
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mixed_batch_answers_each_claim_as_the_single_path_would() {
    let api = Api::start(&["--batch-in-flight", "1", "--retention-s", "2"]).await;
    // Past its retention by the time of the batch (claimed + lease 1 s + retention 2 s): taken
    // over as a new key.
    let old = token_of(&api.claim("old", &fp(1), Some(1_000)).await);
    api.post(
        contract::wire::COMPLETE_PATH,
        &complete_body("old", old, &ok_response()),
    )
    .await;
    // A lease that runs out: reclaimed.
    let expired = token_of(&api.claim("expired", &fp(1), Some(1_000)).await);
    tokio::time::sleep(Duration::from_millis(3_200)).await;
    let done = token_of(&api.claim("done", &fp(1), Some(1_000)).await);
    let (s, _, _) = api
        .post(
            contract::wire::COMPLETE_PATH,
            &complete_body("done", done, &ok_response()),
        )
        .await;
    assert_eq!(s, 200);
    let held = token_of(&api.claim("held", &fp(1), Some(60_000)).await);
    token_of(&api.claim("other", &fp(1), None).await);

    let mut lock = TableLock::take(&api.db_url).await;
    let blocker = submit_claim(&api, job(&api, "blocker", &fp(1), 30_000));
    lock.wait_for_waiters(1).await;
    let new1 = submit_claim(&api, job(&api, "new-1", &fp(1), 30_000));
    let new2 = submit_claim(&api, job(&api, "new-2", &fp(2), 30_000));
    let in_progress = submit_claim(&api, job(&api, "held", &fp(1), 30_000));
    let completed = submit_claim(&api, job(&api, "done", &fp(1), 30_000));
    let mismatch = submit_claim(&api, job(&api, "other", &fp(2), 30_000));
    let reclaim = submit_claim(&api, job(&api, "expired", &fp(1), 40_000));
    let take_over = submit_claim(&api, job(&api, "old", &fp(3), 30_000));
    wait_queued(&api, 7).await;
    lock.release().await;

    claimed(&blocker.await.unwrap().unwrap());
    assert!(!claimed(&new1.await.unwrap().unwrap()).1);
    assert!(!claimed(&new2.await.unwrap().unwrap()).1);
    match in_progress.await.unwrap().unwrap() {
        ClaimResponse::InProgress {
            lease_remaining_ms, ..
        } => {
            assert!(lease_remaining_ms > 50_000 && lease_remaining_ms <= 60_000)
        }
        other => panic!("held: {other:?}"),
    }
    match completed.await.unwrap().unwrap() {
        ClaimResponse::Completed {
            response,
            expires_in_ms,
            ..
        } => {
            assert_eq!(response, ok_response());
            // Completed within its 1 s lease: kept until claimed + lease + retention (2 s).
            assert!(expires_in_ms.is_some_and(|ms| ms <= 3_000));
        }
        other => panic!("done: {other:?}"),
    }
    assert_eq!(mismatch.await.unwrap().unwrap(), ClaimResponse::Mismatch);
    match reclaim.await.unwrap().unwrap() {
        ClaimResponse::Claimed {
            token,
            lease_ms,
            reclaimed,
            ..
        } => {
            assert!(reclaimed && token > expired);
            assert_eq!(lease_ms, 40_000);
            assert_eq!(
                committed(&api, "expired").await,
                Some(("in_progress".into(), token))
            );
        }
        other => panic!("expired: {other:?}"),
    }
    let (token, reclaimed) = claimed(&take_over.await.unwrap().unwrap());
    assert!(
        token > old && !reclaimed,
        "completed, past retention: a new key"
    );
    assert_eq!(
        committed(&api, "old").await,
        Some(("in_progress".into(), token))
    );
    assert_eq!(
        committed(&api, "held").await,
        Some(("in_progress".into(), held))
    );

    // Five claims, two completes and the blocker alone, then one statement for the seven; the
    // reclaim and the take-over went on to the single path.
    assert_eq!(api.state.metrics().batch_totals(), (9, 15));
    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_batch_size_bucket{le=\"4.0\"}") + 1.0,
        metric(&m, "state_api_batch_size_bucket{le=\"8.0\"}")
    );
    assert_eq!(
        metric(
            &m,
            "state_api_batch_single_path_total{op=\"claim\",reason=\"after_batch\"}"
        ),
        2.0
    );
    assert_eq!(metric(&m, "state_api_reclaims_total"), 0.0, "not over HTTP");
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completes_and_claims_in_one_statement_store_right_tokens_and_fence_out_wrong_ones() {
    let api = Api::start(&["--batch-in-flight", "1"]).await;
    let mut owners = Vec::new();
    for i in 0..6 {
        let key = format!("c-{i}");
        owners.push((key.clone(), token_of(&api.claim(&key, &fp(1), None).await)));
    }
    // Reclaimed: the first owner's token is fenced out.
    let (stale, fresh) = api.claim_then_reclaim("re", &fp(1)).await;
    // Completed already: the same owner's retry changes nothing.
    let twice = token_of(&api.claim("twice", &fp(1), None).await);
    let first_answer = api
        .state
        .batcher()
        .complete(CompleteJob {
            scope: api.state.scoper().hash("twice", "alice", ENDPOINT),
            token: twice,
            response: stored(b"first"),
            retention_ms: api.state.config().retention_ms(),
            deadline: far(),
        })
        .await
        .unwrap();
    assert!(matches!(first_answer, WriteResult::Done { .. }));
    let blk = token_of(&api.claim("blk", &fp(1), None).await);

    let mut lock = TableLock::take(&api.db_url).await;
    let blocker = submit_complete(&api, "blk", blk, stored(b"blk"));
    lock.wait_for_waiters(1).await;
    let rights: Vec<_> = owners
        .iter()
        .map(|(k, t)| submit_complete(&api, k, *t, stored(k.as_bytes())))
        .collect();
    wait_queued(&api, owners.len()).await;
    // A wrong token for a key whose right one is in the batch (same scope: single path), a
    // token that never existed, the reclaimed owner's old token, the completed owner's retry.
    let wrong_same_key = submit_complete(&api, "c-0", owners[0].1 + 1_000_000, stored(b"x"));
    let unknown = submit_complete(&api, "nobody", 5, stored(b"x"));
    let reclaimed_old = submit_complete(&api, "re", stale, stored(b"x"));
    let retry = submit_complete(&api, "twice", twice, stored(b"second"));
    // Claims share the statement: new keys, and a claim of c-1 queued behind its complete,
    // which runs once that has committed and replays it.
    let new_claims: Vec<_> = (0..3)
        .map(|i| submit_claim(&api, job(&api, &format!("mixed-{i}"), &fp(1), 30_000)))
        .collect();
    let claim_after_complete = submit_claim(&api, job(&api, "c-1", &fp(1), 30_000));
    wait_queued(&api, owners.len() + 8).await;
    lock.release().await;

    assert!(matches!(
        blocker.await.unwrap().unwrap(),
        WriteResult::Done { .. }
    ));
    for r in rights {
        match r.await.unwrap().unwrap() {
            WriteResult::Done { expires_in_ms } => {
                // Within the 30 s lease: claimed + lease + retention (24 h).
                assert!(expires_in_ms > 86_000_000 && expires_in_ms <= 86_430_000)
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        wrong_same_key.await.unwrap().unwrap(),
        WriteResult::FencedOut
    );
    assert_eq!(unknown.await.unwrap().unwrap(), WriteResult::FencedOut);
    assert_eq!(
        reclaimed_old.await.unwrap().unwrap(),
        WriteResult::FencedOut
    );
    assert!(matches!(
        retry.await.unwrap().unwrap(),
        WriteResult::AlreadyDone { .. }
    ));
    for c in new_claims {
        claimed(&c.await.unwrap().unwrap());
    }
    match claim_after_complete.await.unwrap().unwrap() {
        ClaimResponse::Completed { response, .. } => assert_eq!(response.body, b"c-1"),
        other => panic!("claim of c-1 after its complete: {other:?}"),
    }
    // Ten claims and a complete alone (setup), the blocker alone, then one statement for the
    // six right owners, "nobody", the stale token, the retry and the three new claims; the
    // wrong token for c-0 and the claim of c-1 followed it on the single path.
    assert_eq!(api.state.metrics().batch_totals(), (13, 24));

    // What is stored: each right owner's own response; the fenced writes changed nothing.
    for (k, _) in &owners {
        match api.claim(k, &fp(1), None).await {
            ClaimResponse::Completed { response, .. } => {
                assert_eq!(
                    response,
                    StoredResponse::new(
                        201,
                        vec![("content-type".into(), "application/json".into())],
                        k.as_bytes(),
                        true
                    )
                );
            }
            other => panic!("{k}: {other:?}"),
        }
    }
    assert_eq!(
        committed(&api, "re").await,
        Some(("in_progress".into(), fresh))
    );
    match api.claim("twice", &fp(1), None).await {
        ClaimResponse::Completed { response, .. } => {
            assert_eq!(response.body, b"first")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(committed(&api, "nobody").await, None);
    let m = api.metrics().await;
    for op in ["complete", "claim"] {
        assert_eq!(
            metric(
                &m,
                &format!("state_api_batch_single_path_total{{op=\"{op}\",reason=\"duplicate\"}}")
            ),
            1.0
        );
    }
    assert_eq!(
        metric(
            &m,
            "state_api_batch_single_path_total{op=\"complete\",reason=\"after_batch\"}"
        ),
        3.0
    );
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_batch_statement_answers_every_request_of_the_batch_with_503() {
    let api = Api::start(&["--batch-in-flight", "1", "--statement-timeout-ms", "500"]).await;
    let mut lock = TableLock::take(&api.db_url).await;
    let blocker = submit_claim(&api, job(&api, "blocker", &fp(1), 30_000));
    lock.wait_for_waiters(1).await;
    let tasks: Vec<_> = (0..5)
        .map(|i| api.spawn_claim_raw(&claim_req(&format!("late-{i}"), "alice", &fp(1), None)))
        .collect();
    wait_queued(&api, 5).await;
    // The lock stays until every answer is in: the blocker's statement and then the batch's
    // time out.
    let e = blocker.await.unwrap().unwrap_err();
    assert!(e.is_unavailable(), "{e}");
    for t in tasks {
        let answer = t.await.unwrap();
        assert_problem(
            answer.status,
            &answer.body,
            503,
            "idempotency-state-unavailable",
        );
        assert_eq!(answer.retry_after.unwrap(), "1");
    }
    lock.release().await;
    for i in 0..5 {
        assert_eq!(committed(&api, &format!("late-{i}")).await, None);
    }
    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "state_api_errors_total{kind=\"unavailable\"}"),
        5.0
    );
    assert_eq!(api.state.metrics().batch_totals(), (2, 6));
    // And the next claims go through.
    assert!(matches!(
        api.claim("late-0", &fp(1), None).await,
        ClaimResponse::Claimed { .. }
    ));
    api.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn closing_the_batcher_answers_every_queued_request() {
    let api = Api::start(&["--batch-in-flight", "1"]).await;
    let mut lock = TableLock::take(&api.db_url).await;
    let blocker = submit_claim(&api, job(&api, "blocker", &fp(1), 30_000));
    lock.wait_for_waiters(1).await;
    let queued: Vec<_> = (0..10)
        .map(|i| submit_claim(&api, job(&api, &format!("q-{i}"), &fp(1), 30_000)))
        .collect();
    wait_queued(&api, 10).await;
    let state = api.state.clone();
    let close = tokio::spawn(async move { state.batcher().close().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!close.is_finished(), "close waits for the queue");
    // After close: a request runs on its own (it waits on the lock too).
    let late = submit_claim(&api, job(&api, "late", &fp(1), 30_000));
    lock.wait_for_waiters(2).await;
    assert_eq!(api.state.batcher().queued(), 10);
    lock.release().await;

    tokio::time::timeout(Duration::from_secs(10), close)
        .await
        .unwrap()
        .unwrap();
    claimed(&blocker.await.unwrap().unwrap());
    for q in queued {
        claimed(&q.await.unwrap().unwrap());
    }
    claimed(&late.await.unwrap().unwrap());
    assert_eq!(api.state.batcher().queued(), 0);
    api.shutdown().await;
}

/// Below `--batch-in-flight` statements, requests run alone at once; only then do they queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_run_alone_until_in_flight_statements_are_running() {
    let api = Api::start(&["--batch-in-flight", "2"]).await;
    let mut lock = TableLock::take(&api.db_url).await;
    let first = submit_claim(&api, job(&api, "alone-1", &fp(1), 30_000));
    let second = submit_claim(&api, job(&api, "alone-2", &fp(1), 30_000));
    // Both wait on the lock in Postgres: neither queued.
    lock.wait_for_waiters(2).await;
    assert_eq!(api.state.batcher().queued(), 0);
    let third = submit_claim(&api, job(&api, "queued-1", &fp(1), 30_000));
    let fourth = submit_claim(&api, job(&api, "queued-2", &fp(1), 30_000));
    wait_queued(&api, 2).await;
    lock.release().await;
    for t in [first, second, third, fourth] {
        claimed(&t.await.unwrap().unwrap());
    }
    // Two statements of one, then one of two.
    assert_eq!(api.state.metrics().batch_totals(), (3, 4));
    api.shutdown().await;
}

/// `/v1/claims` answers each claim as `/v1/claim` would answer it alone, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_claims_call_answers_each_claim_as_a_claim_call_would_in_order() {
    let api = Api::start(&[]).await;
    // A completed key, for the replay and the mismatch.
    let done = token_of(
        &api.claim_with(&claim_req("done", "alice", &fp(1), None))
            .await,
    );
    let (status, _, _) = api
        .post(
            contract::wire::COMPLETE_PATH,
            &complete_body("done", done, &ok_response()),
        )
        .await;
    assert_eq!(status, 200);

    let mut bad_key = claim_req("x", "alice", &fp(1), None);
    bad_key.key = "k".repeat(300);
    let claims = vec![
        claim_req("batch-a", "alice", &fp(1), Some(45_000)),
        claim_req("batch-b", "alice", &fp(1), None),
        claim_req("batch-a", "alice", &fp(1), None),
        claim_req("done", "alice", &fp(1), None),
        claim_req("done", "alice", &fp(2), None),
        bad_key,
    ];
    let r = api
        .client
        .post(api.url(contract::wire::CLAIMS_PATH))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({ "claims": claims }))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let bytes = r.bytes().await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let items = contract::wire::BatchResponse::read_claims(&bytes, 6).unwrap();
    let answer = |i: usize| items[i].answer.clone().unwrap();
    // The same key twice in one call: one owner (either), and the other is told it runs.
    let (owner, other) = match (answer(0), answer(2)) {
        (c @ ClaimResponse::Claimed { .. }, o) | (o, c @ ClaimResponse::Claimed { .. }) => (c, o),
        both => panic!("no owner of batch-a: {both:?}"),
    };
    assert!(
        matches!(other, ClaimResponse::InProgress { .. }),
        "{other:?}"
    );
    let a = token_of(&owner);
    let b = token_of(&answer(1));
    assert_ne!(a, b);
    assert_eq!(
        committed(&api, "batch-a").await,
        Some(("in_progress".into(), a))
    );
    assert_eq!(
        committed(&api, "batch-b").await,
        Some(("in_progress".into(), b))
    );
    match answer(3) {
        ClaimResponse::Completed { response, .. } => assert_eq!(response, ok_response()),
        other => panic!("{other:?}"),
    }
    assert_eq!(answer(4), ClaimResponse::Mismatch);
    assert_eq!(items[5].status, 400);
    assert!(items[5].answer.is_err());
    // Checked against the served contract too.
    let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    api.contract().await.check_answer(
        "post",
        contract::wire::CLAIMS_PATH,
        200,
        "application/json",
        &value,
    );

    // Refused whole: empty, too many, or a claim that would wait.
    for (claims, why) in [
        (vec![], "1 to 128"),
        (vec![claim_req("c", "alice", &fp(1), None); 129], "1 to 128"),
        (
            vec![ClaimRequest {
                wait_ms: Some(1_000),
                ..claim_req("c", "alice", &fp(1), None)
            }],
            "wait_ms",
        ),
    ] {
        let (status, body, _) = api
            .post(
                contract::wire::CLAIMS_PATH,
                &serde_json::json!({ "claims": claims }),
            )
            .await;
        assert_problem(status, &body, 400, "bad-request");
        assert!(body["detail"].as_str().unwrap().contains(why), "{body}");
    }
    assert_eq!(committed(&api, "c").await, None);
    api.shutdown().await;
}

/// `/v1/completes` stores each complete as `/v1/complete` would, in order: fenced out alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_completes_call_stores_each_complete_as_a_complete_call_would_in_order() {
    let api = Api::start(&[]).await;
    let a = token_of(
        &api.claim_with(&claim_req("wa", "alice", &fp(1), None))
            .await,
    );
    let b = token_of(
        &api.claim_with(&claim_req("wb", "alice", &fp(1), None))
            .await,
    );
    let completes = serde_json::json!({ "completes": [
        complete_body("wa", a, &ok_response()),
        // A token that never owned the key: fenced out, and the others are stored all the same.
        complete_body("wb", b + 100, &ok_response()),
        complete_body("wb", b, &ok_response()),
    ]});
    let (status, body, _) = api.post(contract::wire::COMPLETES_PATH, &completes).await;
    assert_eq!(status, 200, "{body}");
    let items =
        contract::wire::BatchResponse::read_writes(&serde_json::to_vec(&body).unwrap(), 3).unwrap();
    assert!(items[0].answer.is_ok() && items[2].answer.is_ok(), "{body}");
    assert_eq!(items[1].status, 409);
    assert_eq!(body["answers"][1]["answer"]["type"], "/problems/fenced-out");
    assert_eq!(committed(&api, "wa").await, Some(("completed".into(), a)));
    assert_eq!(committed(&api, "wb").await, Some(("completed".into(), b)));
    // The same call again changes nothing and answers the same (a retried complete).
    let (status, again, _) = api.post(contract::wire::COMPLETES_PATH, &completes).await;
    assert_eq!(
        (status, again["answers"][0]["status"].clone()),
        (200, 200.into())
    );
    let (status, body, _) = api
        .post(
            contract::wire::COMPLETES_PATH,
            &serde_json::json!({ "completes": [] }),
        )
        .await;
    assert_problem(status, &body, 400, "bad-request");
    api.shutdown().await;
}

/// The claims of one `/v1/claims` call go to Postgres together: one statement for all of them,
/// where each running its single path inline (up to `--batch-in-flight` at once, as lone
/// requests do) would make a statement and a commit of each. The same for `/v1/completes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_batch_call_is_one_statement() {
    const N: usize = 8;
    let api = Api::start(&["--batch-in-flight", "4"]).await;
    let claims: Vec<_> = (0..N)
        .map(|i| claim_req(&format!("together-{i}"), "alice", &fp(1), None))
        .collect();
    let (status, body, _) = api
        .post(
            contract::wire::CLAIMS_PATH,
            &serde_json::json!({ "claims": claims }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let bytes = serde_json::to_vec(&body).unwrap();
    let items = contract::wire::BatchResponse::read_claims(&bytes, N).unwrap();
    let tokens: Vec<i64> = items
        .iter()
        .map(|item| token_of(item.answer.as_ref().unwrap()))
        .collect();
    assert_eq!(tokens.iter().collect::<HashSet<_>>().len(), N);
    assert_eq!(api.state.metrics().batch_totals(), (1, N as u64));

    let completes: Vec<_> = tokens
        .iter()
        .enumerate()
        .map(|(i, token)| complete_body(&format!("together-{i}"), *token, &ok_response()))
        .collect();
    assert_eq!(api.complete_all(&completes).await, [200; N]);
    assert_eq!(api.state.metrics().batch_totals(), (2, 2 * N as u64));
    for (i, token) in tokens.iter().enumerate() {
        let stored = committed(&api, &format!("together-{i}")).await;
        assert_eq!(stored, Some(("completed".into(), *token)));
    }
    api.shutdown().await;
}

/// One `/v1/writes` call: its claims' answers, then its completes', each as the single call
/// would give it, all in one statement; a wrong token is fenced out and the rest stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_writes_call_answers_its_claims_then_its_completes_in_one_statement() {
    const N: usize = 4;
    let api = Api::start(&["--batch-in-flight", "4"]).await;
    let running = token_of(
        &api.claim_with(&claim_req("w-running", "alice", &fp(1), None))
            .await,
    );
    let other = token_of(
        &api.claim_with(&claim_req("w-other", "alice", &fp(1), None))
            .await,
    );
    let before = api.state.metrics().batch_totals();
    let mut claims: Vec<_> = (0..N)
        .map(|i| claim_req(&format!("w-new-{i}"), "alice", &fp(1), None))
        .collect();
    let mut bad_key = claim_req("x", "alice", &fp(1), None);
    bad_key.key = "k".repeat(300);
    claims.push(bad_key);
    let batch = serde_json::json!({
        "claims": claims,
        "completes": [
            complete_body("w-other", other + 100, &ok_response()),
            complete_body("w-running", running, &ok_response()),
        ],
    });
    let (status, body, _) = api.post(contract::wire::WRITES_PATH, &batch).await;
    assert_eq!(status, 200, "{body}");
    let bytes = serde_json::to_vec(&body).unwrap();
    let (claimed, written) = contract::wire::BatchResponse::read_both(&bytes, N + 1, 2).unwrap();
    let tokens: HashSet<i64> = claimed[..N]
        .iter()
        .map(|item| token_of(item.answer.as_ref().unwrap()))
        .collect();
    assert_eq!(tokens.len(), N);
    assert_eq!(claimed[N].status, 400, "{body}");
    assert_eq!(written[0].status, 409, "{body}");
    assert_eq!(
        body["answers"][N + 1]["answer"]["type"],
        "/problems/fenced-out"
    );
    assert_eq!(written[1].status, 200, "{body}");
    assert_eq!(
        committed(&api, "w-running").await,
        Some(("completed".into(), running))
    );
    assert_eq!(
        committed(&api, "w-other").await,
        Some(("in_progress".into(), other))
    );
    // Everything that reached the store went in one statement.
    let after = api.state.metrics().batch_totals();
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, N as u64 + 2));
    // Only claims, or only completes, are a batch too; nothing at all, or a waiting claim, is not.
    let only = serde_json::json!({ "claims": [claim_req("w-only", "alice", &fp(1), None)] });
    let (status, body, _) = api.post(contract::wire::WRITES_PATH, &only).await;
    assert_eq!(
        (status, body["answers"][0]["status"].clone()),
        (200, 200.into())
    );
    let mut waits = claim_req("w-wait", "alice", &fp(1), None);
    waits.wait_ms = Some(1_000);
    for refused in [
        serde_json::json!({}),
        serde_json::json!({ "claims": [], "completes": [] }),
        serde_json::json!({ "claims": [waits] }),
    ] {
        let (status, body, _) = api.post(contract::wire::WRITES_PATH, &refused).await;
        assert_problem(status, &body, 400, "bad-request");
    }
    api.shutdown().await;
}
