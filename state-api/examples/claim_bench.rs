//! Claim + complete throughput of the state API, at 1 and 16 concurrent clients (by default).
//!
//! Against a running API:
//!     cargo run --release -p state-api --example claim_bench -- --url http://127.0.0.1:8081 --token "$STATE_API_TOKEN"
//! Self-hosted (a throwaway Postgres cluster and the API in this process):
//!     cargo run --release -p state-api --example claim_bench
//!
//! Each client loops: claim a fresh key, complete it with a small response. Then the same
//! for duplicates: claims of one key held in progress (the 409 path) and of a completed key
//! (the replay path). One line per run, plus `--json` for machines.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use contract::state_env;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use contract::wire::{
    ClaimRequest, ClaimResponse, CompleteRequest, StoredResponse, CLAIM_PATH, COMPLETE_PATH,
};

#[derive(Parser, Debug)]
struct Args {
    /// Base URL of a running state API; without it, one is started here on a throwaway cluster.
    #[arg(long)]
    url: Option<String>,
    /// Its bearer token.
    #[arg(long, env = state_env::STATE_API_TOKEN, default_value = "bench-token")]
    token: String,
    /// Concurrency levels to run.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    clients: Vec<usize>,
    /// Seconds per run.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Also measure duplicate claims (in-progress and completed keys).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    duplicates: bool,
    /// Print JSON lines instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    ClaimComplete,
    FreshClaim,
    InProgressDuplicate,
    CompletedDuplicate,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::ClaimComplete => "claim+complete",
            Self::FreshClaim => "claim(new key) only",
            Self::InProgressDuplicate => "duplicate(in_progress)",
            Self::CompletedDuplicate => "duplicate(completed)",
        }
    }
}

struct Target {
    base: String,
    token: String,
    client: reqwest::Client,
}

static RUN: AtomicU64 = AtomicU64::new(0);

fn claim_req(key: String) -> ClaimRequest {
    ClaimRequest {
        key,
        subject: "bench".into(),
        endpoint: "POST /checkout".into(),
        fingerprint: "ab".repeat(32),
        fingerprint_alg: "sha256-jcs-v2".into(),
        lease_ms: Some(60_000),
        on_unknown: Default::default(),
        namespace: String::new(),
        retention_s: None,
        wait_ms: None,
        nonce: None,
    }
}

async fn claim(t: &Target, key: &str) -> ClaimResponse {
    let r = t
        .client
        .post(format!("{}{CLAIM_PATH}", t.base))
        .bearer_auth(&t.token)
        .json(&claim_req(key.into()))
        .send()
        .await;
    let r = r.unwrap_or_else(|e| panic!("claim: {e}"));
    assert_eq!(r.status(), 200, "claim answered {}", r.status());
    ClaimResponse::read(&r.bytes().await.unwrap()).unwrap()
}

async fn complete(t: &Target, key: &str, token: i64) {
    let body = CompleteRequest {
        namespace: String::new(),
        key: key.into(),
        subject: "bench".into(),
        endpoint: "POST /checkout".into(),
        token,
        response: StoredResponse::new(
            201,
            vec![("content-type".into(), "application/json".into())],
            br#"{"id":"ch_123","status":"succeeded","amount":9990}"#,
            true,
        ),
    };
    let r = t
        .client
        .post(format!("{}{COMPLETE_PATH}", t.base))
        .bearer_auth(&t.token)
        .json(&body)
        .send()
        .await;
    let r = r.unwrap_or_else(|e| panic!("complete: {e}"));
    assert_eq!(r.status(), 200, "complete answered {}", r.status());
}

/// One operation of `mode`; returns its latency.
async fn one(t: &Target, mode: Mode, run: u64, client: usize, i: u64) -> Duration {
    let start = Instant::now();
    match mode {
        Mode::ClaimComplete => {
            let key = format!("bench-{run}-{client}-{i}");
            match claim(t, &key).await {
                ClaimResponse::Claimed { token, .. } => complete(t, &key, token).await,
                other => panic!("fresh key not claimed: {other:?}"),
            }
        }
        Mode::FreshClaim => {
            let r = claim(t, &format!("bench-{run}-{client}-{i}")).await;
            assert!(matches!(r, ClaimResponse::Claimed { .. }), "{r:?}");
        }
        Mode::InProgressDuplicate => {
            let r = claim(t, &format!("bench-{run}-held")).await;
            assert!(matches!(r, ClaimResponse::InProgress { .. }), "{r:?}");
        }
        Mode::CompletedDuplicate => {
            let r = claim(t, &format!("bench-{run}-done")).await;
            assert!(matches!(r, ClaimResponse::Completed { .. }), "{r:?}");
        }
    }
    start.elapsed()
}

async fn bench(t: Arc<Target>, mode: Mode, clients: usize, secs: u64) -> (f64, Vec<Duration>) {
    let run = RUN.fetch_add(1, Ordering::Relaxed) * 1_000_000 + u64::from(std::process::id());
    // Set up the keys the duplicate modes hit.
    if let ClaimResponse::Claimed { .. } = claim(&t, &format!("bench-{run}-held")).await {}
    if let ClaimResponse::Claimed { token, .. } = claim(&t, &format!("bench-{run}-done")).await {
        complete(&t, &format!("bench-{run}-done"), token).await;
    }
    // Warm up connections.
    let warm: Vec<_> = (0..clients)
        .map(|c| {
            let t = t.clone();
            tokio::spawn(async move {
                for i in 0..20 {
                    one(&t, mode, run, c, 1_000_000_000 + i).await;
                }
            })
        })
        .collect();
    for w in warm {
        w.await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let t = t.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut i = 0;
                while Instant::now() < deadline {
                    lat.push(one(&t, mode, run, c, i).await);
                    i += 1;
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let elapsed = start.elapsed().as_secs_f64();
    all.sort();
    (all.len() as f64 / elapsed, all)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // Keeps the self-hosted cluster and server alive for the run.
    let mut _hosted = None;
    let (base, token) = match &args.url {
        Some(u) => (u.trim_end_matches('/').to_owned(), args.token.clone()),
        None => {
            let cluster = test_support::postgres::TempCluster::start_private()
                .unwrap_or_else(|e| panic!("{e}"));
            let db = cluster
                .create_database("bench")
                .unwrap_or_else(|e| panic!("{e}"));
            let config = state_api::Config::try_parse_from([
                "state-api",
                "--database-url",
                &db,
                "--api-token",
                &args.token,
                "--key-secret",
                "bench-key-secret-0123456789",
            ])
            .unwrap_or_else(|e| panic!("{e}"));
            let state = state_api::AppState::new(config).unwrap_or_else(|e| panic!("{e}"));
            state_api::migrate(&state, Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = format!("http://{}", listener.local_addr().unwrap());
            tokio::spawn(state_api::serve(listener, state, std::future::pending()));
            _hosted = Some(cluster);
            eprintln!("self-hosted: state API {base} on a throwaway Postgres (fsync=on, synchronous_commit=on)");
            (base, args.token.clone())
        }
    };
    let t = Arc::new(Target {
        base,
        token,
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .build()
            .unwrap(),
    });

    let mut modes = vec![Mode::ClaimComplete];
    if args.duplicates {
        modes.extend([
            Mode::FreshClaim,
            Mode::InProgressDuplicate,
            Mode::CompletedDuplicate,
        ]);
    }
    for mode in modes {
        for &clients in &args.clients {
            let (rate, lat) = bench(t.clone(), mode, clients, args.seconds).await;
            let (p50, p99, max) = (pct(&lat, 0.50), pct(&lat, 0.99), pct(&lat, 1.0));
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"mode": mode.name(), "clients": clients, "ops": lat.len(), "ops_per_s": rate,
                                       "p50_ms": p50, "p99_ms": p99, "max_ms": max})
                );
            } else {
                println!(
                    "{:<24} clients={clients:<3} ops={:<7} {rate:>8.0}/s  p50 {p50:.2} ms  p99 {p99:.2} ms  max {max:.2} ms",
                    mode.name(),
                    lat.len()
                );
            }
        }
    }
}
