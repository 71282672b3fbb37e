//! The state API's link to Postgres goes dead (bytes lost, no reset, no FIN: a partition), then
//! comes back. The connections caught on it never get their answers: TCP would deliver them
//! only at its retransmission pace, seconds after the heal (tests/tests/partitions.rs measured
//! 6.5 s), and a relay that drops bytes never does. The state API gives such a connection up
//! after `--db-stall-ms` (closed, out of the pool), so it serves again soon after the heal
//! instead of answering 503 while its pool is full of dead connections.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use contract::wire::CLAIM_PATH;
use test_support::postgres::TempCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP relay to Postgres that, while cut, reads and drops every byte either way and keeps
/// every connection open.
struct LossyRelay {
    port: u16,
    cut: Arc<AtomicBool>,
}

impl LossyRelay {
    async fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let cut_of_relay = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(client_read, server_write, cut_of_relay.clone()));
                tokio::spawn(pump(server_read, client_write, cut_of_relay.clone()));
            }
        });
        Self { port, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if cut.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A claim with the filter's caller timeout, through the router: answered (200) or refused
/// (503) within it.
async fn claim_status(router: axum::Router, key: &'static str) -> u16 {
    use tower::ServiceExt as _;
    let body = serde_json::to_value(claim_req(key, "alice", &fp(1), None)).unwrap();
    let request = axum::http::Request::post(CLAIM_PATH)
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .header("idempotency-caller-timeout-ms", "1000")
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    router.oneshot(request).await.unwrap().status().as_u16()
}

/// The statuses of claims of `keys` made at once.
async fn claims_at_once(api: &Api, keys: &[&'static str]) -> Vec<u16> {
    let mut set = tokio::task::JoinSet::new();
    for key in keys {
        set.spawn(claim_status(api.router.clone(), key));
    }
    let mut statuses = Vec::new();
    while let Some(s) = set.join_next().await {
        statuses.push(s.unwrap());
    }
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_caught_on_a_dead_link_are_given_up_and_the_api_serves_after_the_heal() {
    let cluster = TempCluster::start_private().unwrap_or_else(|e| panic!("{e}"));
    let db = cluster
        .create_database("dead_link")
        .unwrap_or_else(|e| panic!("{e}"));
    let relay = LossyRelay::start(cluster.port()).await;
    let through_relay = db.replace(
        &format!(":{}/", cluster.port()),
        &format!(":{}/", relay.port),
    );
    assert_ne!(through_relay, db, "the database URL names its port: {db}");
    let stall = Duration::from_millis(1_500);
    let api = Api::start_on(
        &through_relay,
        &[
            // One connection, used as it is (no ping before use, which would find it dead
            // and drop it at the acquire timeout): the claims during the cut send their
            // statements on it, so it is caught on the cut, and nothing but giving it up
            // makes room for a new one.
            "--pool-size",
            "1",
            "--pool-ping",
            "false",
            "--acquire-timeout-ms",
            "500",
            "--db-stall-ms",
            &stall.as_millis().to_string(),
        ],
    )
    .await;
    assert_eq!(claim_status(api.router.clone(), "before").await, 200);

    // Cut: claims on every connection of the pool lose their statements (or their answers).
    relay.set_cut(true);
    let mut during = Vec::new();
    for wave in ["a", "b", "c"] {
        let keys = ["1", "2", "3", "4"].map(|n| &*format!("during-{wave}-{n}").leak());
        during.extend(claims_at_once(&api, &keys).await);
    }
    assert!(
        during.iter().all(|s| *s == 503),
        "claims across the dead link: {during:?}"
    );

    // Healed. The pool's connections are still caught on the cut (their bytes were lost):
    // only giving them up lets new ones in.
    relay.set_cut(false);
    let healed = Instant::now();
    let served_after = loop {
        if claim_status(api.router.clone(), "after").await == 200 {
            break healed.elapsed();
        }
        assert!(
            healed.elapsed() < Duration::from_secs(20),
            "no claim served within 20 s of the heal: the pool is full of connections caught on the dead link"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("served {served_after:?} after the heal");
    assert!(
        served_after < stall + Duration::from_secs(2),
        "served {served_after:?} after the heal, with a {stall:?} stall limit"
    );
    let m = api.metrics().await;
    assert!(
        metric(&m, "state_api_db_connections_given_up_total") >= 1.0,
        "no connection was counted as given up"
    );
    api.shutdown().await;
}
