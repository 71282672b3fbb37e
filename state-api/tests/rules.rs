//! The store's statements against the pure rules they carry out (`state-rules`): every kind of
//! record (state, lease live or run out, past its expiry or not, an earlier unknown outcome or
//! not), written into a real Postgres as it is, then every operation on it through the store
//! and through the rules; the answers and the records afterwards must agree. This is what lets
//! the simulation and the model checker run the rules instead of the database.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use contract::wire::{ClaimResponse, RecordState, StoredResponse};
use state_api::sealing::Sealer;
use state_api::store::{self, NewClaim, PoolSettings, Store, WriteResult};
use state_rules::writes::{self, Completion, Marked};
use state_rules::{ClaimOutcome, ClaimTerms, Clock, Fingerprint, Record};

const ALG: &str = "sha256-jcs-v2";
const LEASE_MS: u64 = 1_000;
const RETENTION_MS: u64 = 60_000;
/// How long a record marked unknown is kept (`--unknown-retention-s`): longer than the
/// retention, so that the cases tell the two apart (issue 46, finding 8).
const UNKNOWN_RETENTION_MS: u64 = 2 * RETENTION_MS;
/// How far from now the times of a record lie: far enough that the few milliseconds between
/// the rules' clock and the statement's never cross one.
const FAR_MS: i64 = 20_000;
/// The rules' "now" (the database's now maps onto it).
const NOW: u64 = 10_000_000;

fn fp(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

/// A starting record.
#[derive(Debug, Clone, Copy)]
struct Start {
    state: RecordState,
    lease_live: bool,
    expired: bool,
    unknown_before: bool,
}

fn starts() -> Vec<Start> {
    let mut all = Vec::new();
    for state in RecordState::ALL {
        for lease_live in [true, false] {
            for expired in [true, false] {
                for unknown_before in [true, false] {
                    all.push(Start {
                        state,
                        lease_live,
                        expired,
                        unknown_before,
                    });
                }
            }
        }
    }
    all
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// `abandoned`: its filter gave the attempt up before it got here (a tombstone).
    Claim {
        same_fp: bool,
        take_over: bool,
        abandoned: bool,
    },
    Heartbeat {
        own: bool,
    },
    Complete {
        own: bool,
    },
    Unknown {
        own: bool,
    },
    Release {
        own: bool,
    },
    /// Give back by the record's own nonce, or a stranger's.
    Abandon {
        own: bool,
    },
    Purge,
}

fn ops() -> Vec<Op> {
    let mut all = vec![Op::Purge];
    for own in [true, false] {
        all.extend([
            Op::Heartbeat { own },
            Op::Complete { own },
            Op::Unknown { own },
            Op::Release { own },
            Op::Abandon { own },
        ]);
    }
    for same_fp in [true, false] {
        for take_over in [true, false] {
            for abandoned in [false, true] {
                all.push(Op::Claim {
                    same_fp,
                    take_over,
                    abandoned,
                });
            }
        }
    }
    all
}

const TOKEN: i64 = 7;
/// The nonce of the claim that made the starting record, and of the claims the cases send.
const RECORD_NONCE: &str = "n-record";
const CLAIM_NONCE: &str = "n-claim";

fn offset(live: bool) -> i64 {
    if live {
        FAR_MS
    } else {
        -FAR_MS
    }
}

fn rel(ms: i64) -> u64 {
    NOW.checked_add_signed(ms).unwrap()
}

/// The record as the rules hold it.
fn record(s: Start) -> Record<u16> {
    Record {
        state: s.state,
        fingerprint: Fingerprint {
            alg: ALG.into(),
            value: fp(1),
        },
        token: TOKEN,
        lease_ms: LEASE_MS,
        lease_until: rel(offset(s.lease_live)),
        expires_at: rel(if s.expired { -5_000 } else { 2 * FAR_MS }),
        retention_ms: RETENTION_MS,
        unknown_retention_ms: UNKNOWN_RETENTION_MS,
        unknown_before: s.unknown_before,
        response: (s.state == RecordState::Completed).then_some(201),
        claim_nonce: Some(RECORD_NONCE.into()),
        // When its lease was last set.
        owner_seen: rel(offset(s.lease_live)) - LEASE_MS,
    }
}

/// What an operation answered, in words both sides can be compared by.
fn claim_answer(c: &ClaimResponse) -> String {
    match c {
        ClaimResponse::Claimed {
            token, reclaimed, ..
        } => format!(
            "claimed(new token: {}, reclaimed: {reclaimed})",
            *token != TOKEN
        ),
        ClaimResponse::InProgress { .. } => "in progress".into(),
        ClaimResponse::Completed { .. } => "completed".into(),
        ClaimResponse::Mismatch => "mismatch".into(),
        ClaimResponse::Unknown => "unknown".into(),
    }
}

fn rules_claim_answer(c: &ClaimOutcome<u16>) -> String {
    match c {
        ClaimOutcome::Claimed { token, reclaimed } => format!(
            "claimed(new token: {}, reclaimed: {reclaimed})",
            *token != TOKEN
        ),
        ClaimOutcome::InProgress { .. } => "in progress".into(),
        ClaimOutcome::Completed { .. } => "completed".into(),
        ClaimOutcome::Mismatch => "mismatch".into(),
        ClaimOutcome::Unknown => "unknown".into(),
        ClaimOutcome::Corrupt => "corrupt".into(),
        ClaimOutcome::Abandoned => "caller gone".into(),
    }
}

/// A record afterwards: its state, whether its token moved, its earlier-unknown flag, and
/// where its lease end and expiry lie against now (coarse: before, or how many seconds after).
/// A record afterwards, as the cases compare it: state, token (same or new), the earlier-unknown
/// flag, its lease end, expiry and owner's last sign of life against now, and its nonce.
struct After {
    state: RecordState,
    token: i64,
    unknown_before: bool,
    lease_ms_from_now: i64,
    expires_ms_from_now: i64,
    owner_seen_ms_from_now: i64,
    nonce: Option<String>,
}

fn shape(r: Option<After>) -> String {
    match r {
        None => "gone".into(),
        Some(After {
            state,
            token,
            unknown_before,
            lease_ms_from_now,
            expires_ms_from_now,
            owner_seen_ms_from_now,
            nonce,
        }) => {
            let when = |ms: i64| {
                if ms <= 0 {
                    "past".to_owned()
                } else {
                    format!("+{}s", (ms + 500) / 1000)
                }
            };
            let seen = match owner_seen_ms_from_now {
                ms if ms > 2_000 => "ahead",
                ms if ms >= -2_000 => "now",
                _ => "earlier",
            };
            format!(
                "{} token {} unknown_before {unknown_before} lease {} expires {} owner seen {seen} nonce {nonce:?}",
                state.as_str(),
                if token == TOKEN { "same" } else { "new" },
                when(lease_ms_from_now),
                when(expires_ms_from_now)
            )
        }
    }
}

fn rules_shape(r: &Option<Record<u16>>) -> String {
    shape(r.as_ref().map(|r| After {
        state: r.state,
        token: r.token,
        unknown_before: r.unknown_before,
        lease_ms_from_now: r.lease_until as i64 - NOW as i64,
        expires_ms_from_now: r.expires_at as i64 - NOW as i64,
        owner_seen_ms_from_now: r.owner_seen as i64 - NOW as i64,
        nonce: r.claim_nonce.clone(),
    }))
}

struct Db {
    store: Store,
    pool: sqlx::PgPool,
}

impl Db {
    async fn start() -> Self {
        let cluster = test_support::postgres::shared()
            .unwrap_or_else(|e| panic!("no Postgres for the tests: {e}"));
        let url = cluster.fresh_database("rules").unwrap();
        let settings = PoolSettings {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(10),
            statement_timeout_ms: 10_000,
            ping_when_idle: None,
        };
        let pool = store::pool(&url, &settings).unwrap();
        let store = Store::new(
            pool.clone(),
            &settings,
            std::sync::Arc::new(Sealer::new(None, None)),
            store::StallLimit {
                after: Duration::from_secs(10),
                given_up: Default::default(),
            },
            UNKNOWN_RETENTION_MS as i64,
        );
        store.migrate().await.unwrap();
        // New tokens never equal the records' own (7) or a stranger's (1,007).
        sqlx::query("SELECT setval('idempotency_fencing_token_seq', 1000000)")
            .execute(&pool)
            .await
            .unwrap();
        // The state API beats the database's pulse; without it the lease guard holds every
        // lease (the database counts as just come back).
        let beating = store.clone();
        tokio::spawn(async move {
            loop {
                let _ = beating.pulse().await;
                tokio::time::sleep(state_api::store::PULSE_EVERY).await;
            }
        });
        Self { store, pool }
    }

    /// Writes the record at `scope` as it is (times relative to the database's now).
    async fn put(&self, scope: &[u8], s: Start) {
        sqlx::query("DELETE FROM idempotency_nonces")
            .execute(&self.pool)
            .await
            .unwrap();
        sqlx::query("DELETE FROM idempotency_records")
            .execute(&self.pool)
            .await
            .unwrap();
        let completed = s.state == RecordState::Completed;
        sqlx::query(
            "INSERT INTO idempotency_records
                (scope_hash, subject, endpoint, fingerprint_alg, fingerprint, state, fencing_token,
                 lease_ms, lease_expires_at, created_at, completed_at, expires_at, namespace,
                 retention_ms, unknown_before, response_status, response_headers, response_body,
                 response_replayable, claim_nonce, owner_seen_at)
             VALUES ($1, 'alice', 'POST /checkout', $2, $3, $4, $5, $6,
                 clock_timestamp() + $7 * interval '1 millisecond',
                 clock_timestamp() - interval '1 minute',
                 CASE WHEN $10 THEN clock_timestamp() END,
                 clock_timestamp() + $8 * interval '1 millisecond',
                 '', $9, $11,
                 CASE WHEN $10 THEN 201 END, CASE WHEN $10 THEN '[]'::jsonb END,
                 CASE WHEN $10 THEN ''::bytea END, CASE WHEN $10 THEN true END, $12,
                 clock_timestamp() + $7 * interval '1 millisecond' - $6 * interval '1 millisecond')",
        )
        .bind(scope)
        .bind(ALG)
        .bind(fp(1))
        .bind(s.state.as_str())
        .bind(TOKEN)
        .bind(LEASE_MS as i64)
        .bind(offset(s.lease_live) as f64)
        .bind(if s.expired {
            -5_000f64
        } else {
            (2 * FAR_MS) as f64
        })
        .bind(RETENTION_MS as i64)
        .bind(completed)
        .bind(s.unknown_before)
        .bind(RECORD_NONCE)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn shape_of(&self, scope: &[u8]) -> String {
        type Row = (String, i64, bool, f64, f64, f64, Option<String>);
        let row: Option<Row> = sqlx::query_as(
            "SELECT state, fencing_token, unknown_before,
                (EXTRACT(EPOCH FROM (lease_expires_at - clock_timestamp())) * 1000)::float8,
                (EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000)::float8,
                (EXTRACT(EPOCH FROM (COALESCE(owner_seen_at,
                    lease_expires_at - lease_ms * interval '1 millisecond') - clock_timestamp())) * 1000)::float8,
                claim_nonce
             FROM idempotency_records WHERE scope_hash = $1",
        )
        .bind(scope)
        .fetch_optional(&self.pool)
        .await
        .unwrap();
        shape(row.map(
            |(state, token, unknown_before, lease, expires, seen, nonce)| After {
                state: state.parse().unwrap(),
                token,
                unknown_before,
                lease_ms_from_now: lease.round() as i64,
                expires_ms_from_now: expires.round() as i64,
                owner_seen_ms_from_now: seen.round() as i64,
                nonce,
            },
        ))
    }

    /// The database has served long enough for the lease guard to count a lease as run out.
    async fn served_a_lease(&self) {
        for _ in 0..100 {
            let ok: bool = sqlx::query_scalar(
                "SELECT idempotency_serving_since() <= clock_timestamp() - $1 * interval '1 millisecond'",
            )
            .bind(LEASE_MS as f64)
            .fetch_one(&self.pool)
            .await
            .unwrap();
            if ok {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the test cluster has not served a whole lease in 10 s");
    }
}

async fn run_store(db: &Db, scope: &[u8; 32], op: Op) -> String {
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: vec![],
        replayable: true,
    };
    let token = |own: bool| if own { TOKEN } else { TOKEN + 1_000 };
    match op {
        Op::Claim {
            same_fp,
            take_over,
            abandoned,
        } => {
            if abandoned {
                sqlx::query(
                    "INSERT INTO idempotency_nonces (scope_hash, nonce, kind) VALUES ($1, $2, 'abandoned')",
                )
                .bind(&scope[..])
                .bind(CLAIM_NONCE)
                .execute(&db.pool)
                .await
                .unwrap();
            }
            let f = fp(if same_fp { 1 } else { 2 });
            let c = NewClaim {
                scope: *scope,
                subject: "alice",
                endpoint: "POST /checkout",
                fingerprint_alg: ALG,
                fingerprint: &state_rules::fingerprint::Keyed {
                    plain: f.clone(),
                    stored: f.clone(),
                    key_id: 0,
                    previous: None,
                },
                lease_ms: LEASE_MS,
                retention_ms: RETENTION_MS as i64,
                take_over_unknown: take_over,
                namespace: "",
                nonce: Some(CLAIM_NONCE),
                previous: None,
            };
            match db.store.claim(&c).await {
                Ok(answer) => claim_answer(&answer),
                Err(state_api::store::StoreError::CallerGone) => "caller gone".into(),
                Err(e) => panic!("{e}"),
            }
        }
        Op::Heartbeat { own } => format!(
            "{:?}",
            db.store
                .heartbeat(scope, scope, token(own), LEASE_MS, RETENTION_MS as i64)
                .await
                .unwrap()
        ),
        Op::Complete { own } => match db
            .store
            .complete(scope, token(own), &response, RETENTION_MS as i64)
            .await
            .unwrap()
        {
            WriteResult::Done { .. } => "done".into(),
            WriteResult::AlreadyDone { .. } => "already done".into(),
            WriteResult::FencedOut => "fenced out".into(),
        },
        Op::Unknown { own } => match db
            .store
            .owner_unknown(scope, scope, token(own), RETENTION_MS as i64)
            .await
            .unwrap()
        {
            Some(true) => "marked".into(),
            Some(false) => "already completed".into(),
            None => "fenced out".into(),
        },
        Op::Release { own } => format!(
            "{}",
            db.store
                .release(scope, scope, token(own), RETENTION_MS as i64)
                .await
                .unwrap()
        ),
        Op::Abandon { own } => format!(
            "{:?}",
            db.store
                .abandon(
                    scope,
                    scope,
                    if own { RECORD_NONCE } else { "n-stranger" },
                    RETENTION_MS as i64
                )
                .await
                .unwrap()
        ),
        Op::Purge => format!(
            "purged {}",
            db.store.purge_batch(10, RETENTION_MS as i64).await.unwrap()
        ),
    }
}

fn run_rules(slot: &mut Option<Record<u16>>, op: Op) -> String {
    let clock = Clock::serving(NOW);
    let token = |own: bool| if own { TOKEN } else { TOKEN + 1_000 };
    let mut next = TOKEN + 10_000;
    match op {
        Op::Claim {
            same_fp,
            take_over,
            abandoned,
        } => {
            let terms = ClaimTerms {
                fingerprint: Fingerprint {
                    alg: ALG.into(),
                    value: fp(if same_fp { 1 } else { 2 }),
                },
                lease_ms: LEASE_MS,
                retention_ms: RETENTION_MS,
                unknown_retention_ms: UNKNOWN_RETENTION_MS,
                take_over_unknown: take_over,
                nonce: Some(CLAIM_NONCE.into()),
                abandoned,
            };
            rules_claim_answer(&state_rules::claim(slot, &terms, clock, &mut || {
                next += 1;
                next
            }))
        }
        Op::Heartbeat { own } => {
            format!("{:?}", writes::heartbeat(slot, token(own), LEASE_MS, clock))
        }
        Op::Complete { own } => {
            match writes::complete(slot, token(own), 201, RETENTION_MS, clock) {
                Completion::Done { .. } => "done".into(),
                Completion::AlreadyDone { .. } => "already done".into(),
                Completion::FencedOut => "fenced out".into(),
            }
        }
        Op::Unknown { own } => match writes::owner_unknown(slot, token(own), clock) {
            Marked::Unknown => "marked".into(),
            Marked::AlreadyCompleted => "already completed".into(),
            Marked::FencedOut => "fenced out".into(),
        },
        Op::Release { own } => format!("{}", writes::release(slot, token(own), clock)),
        Op::Abandon { own } => format!(
            "{:?}",
            writes::abandon(slot, if own { RECORD_NONCE } else { "n-stranger" }, clock)
        ),
        Op::Purge => {
            let done = state_rules::purge::apply(slot, clock);
            format!(
                "purged {}",
                u8::from(done != state_rules::purge::Purge::Keep)
            )
        }
    }
}

#[tokio::test]
async fn every_statement_does_what_its_rule_says() {
    let db = Db::start().await;
    db.served_a_lease().await;
    let scope = [9u8; 32];
    let mut disagreements = Vec::new();
    let mut cases = 0;
    for start in starts() {
        for op in ops() {
            db.put(&scope, start).await;
            let store_answer = run_store(&db, &scope, op).await;
            let store_after = db.shape_of(&scope).await;
            let mut slot = Some(record(start));
            let rules_answer = run_rules(&mut slot, op);
            let rules_after = rules_shape(&slot);
            cases += 1;
            if (store_answer.as_str(), store_after.as_str())
                != (rules_answer.as_str(), rules_after.as_str())
            {
                disagreements.push(format!(
                    "{start:?} then {op:?}:\n  store: {store_answer}; {store_after}\n  rules: {rules_answer}; {rules_after}"
                ));
            }
        }
    }
    assert!(cases >= 300, "{cases} cases");
    assert!(
        disagreements.is_empty(),
        "{} of {cases} cases disagree:\n{}",
        disagreements.len(),
        disagreements.join("\n")
    );
}
