//! Issue 19, in transit: the stack with TLS on every hop, through the real Envoy with the real
//! filter, the real state API and a real Postgres. Envoy -> state API is mutual TLS (Envoy
//! verifies the state API's certificate against the test CA and presents its own client
//! certificate, which the state API verifies); state API -> Postgres is `sslmode=verify-full`
//! on a cluster that accepts TLS connections only. Every certificate is made by the test
//! (`e2e::tls::TestPki`, rcgen).
//!
//! The usual answers hold over TLS (201, replay, 409, 422); a state API whose certificate is
//! from another CA or expired is refused by Envoy (the client gets the filter's 503, nothing is
//! forwarded, the key is not burnt); a client certificate from another CA, none at all, or
//! plaintext are refused by the state API's port.

use std::sync::Arc;
use std::time::Duration;

use e2e::client::unique_key;
use e2e::process::Signal;
use e2e::services::ServiceTestExt as _;
use e2e::stack::{run_dir, Stack, StackOptions};
use e2e::testkit::*;
use e2e::tls::{https_get, plaintext_get, CertFiles, TestPki};
use libtest_mimic::Arguments;

static SHARED: SharedStack = SharedStack::new(start_tls_stack);

fn start_tls_stack() -> Result<Stack, String> {
    let pki = TestPki::generate(&run_dir("tls-pki")?.join("pki"))?;
    Stack::start(StackOptions {
        tls: Some(Arc::new(pki)),
        ..StackOptions::default()
    })
}

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        SHARED.trial(
            "over_tls_a_first_request_runs_and_its_retry_is_replayed",
            first_request_runs_and_retry_is_replayed,
        ),
        SHARED.trial(
            "over_tls_a_duplicate_during_a_slow_request_gets_409",
            duplicate_during_a_slow_request_gets_409,
        ),
        SHARED.trial(
            "over_tls_a_retry_that_waits_gets_the_replay_over_http2",
            retry_that_waits_gets_the_replay_over_http2,
        ),
        SHARED.trial(
            "over_tls_the_same_key_with_another_body_gets_422",
            same_key_other_body_gets_422,
        ),
        SHARED.trial(
            "the_state_api_reaches_postgres_over_verified_tls_only",
            state_api_reaches_postgres_over_verified_tls_only,
        ),
        SHARED.trial(
            "the_state_api_port_answers_mutual_tls_only",
            state_api_port_answers_mutual_tls_only,
        ),
        SHARED.trial(
            "a_renewed_certificate_is_served_after_sighup",
            renewed_certificate_is_served_after_sighup,
        ),
        SHARED.trial(
            "envoy_refuses_a_state_api_certificate_from_another_ca",
            |s| async move {
                let pki = pki(&s);
                envoy_refuses_the_state_api_serving(s, pki.foreign_server, "foreign-ca").await
            },
        ),
        SHARED.trial(
            "envoy_refuses_an_expired_state_api_certificate",
            |s| async move {
                let pki = pki(&s);
                envoy_refuses_the_state_api_serving(s, pki.expired_server, "expired").await
            },
        ),
    ];
    // Stops the shared stack's processes before exiting (statics are never dropped).
    SHARED.run(&args, trials)
}

fn pki(stack: &Stack) -> TestPki {
    match &stack.options.tls {
        Some(p) => (**p).clone(),
        None => panic!("the TLS tests run on a stack with tls"),
    }
}

async fn first_request_runs_and_retry_is_replayed(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("tls-replay");
    let body = charge_body(4_990);
    let first = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(first.status, 201, "{}\n{}", first.describe(), stack.logs());
    assert!(!replayed(&first));
    let retry = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(retry.status, 201, "{}", retry.describe());
    assert!(replayed(&retry), "{}", retry.describe());
    assert_eq!(retry.body, first.body, "the replay is byte for byte");
    assert_eq!(executions(&stack, &key).await.len(), 1, "one charge");
}

async fn duplicate_during_a_slow_request_gets_409(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("tls-slow");
    let body = charge_body(12_000);
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(2_000));
    tokio::time::sleep(Duration::from_millis(600)).await;
    let duplicate = c.send(checkout(&key, "alice", &body)).await;
    assert_problem(&duplicate, 409, "request-in-progress", &stack);
    assert!(duplicate.header("retry-after").is_some());
    let first = slow.await.unwrap_or_else(|e| panic!("slow request: {e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    assert_eq!(executions(&stack, &key).await.len(), 1, "one charge");
}

/// A waiting claim goes to the state API's HTTP/2 cluster: over mutual TLS that is ALPN `h2`
/// on the state API's rustls listener, beside the HTTP/1.1 of every other call.
async fn retry_that_waits_gets_the_replay_over_http2(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("tls-wait");
    let body = charge_body(3_300);
    let h2_before = stack
        .envoy
        .counter("cluster.state_api_wait.upstream_rq_total");
    let slow = send_in_background(&c, checkout(&key, "alice", &body).delay_ms(1_500));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let retry = c
        .send(checkout(&key, "alice", &body).header("prefer", "wait=5"))
        .await;
    let first = slow.await.unwrap_or_else(|e| panic!("slow request: {e}"));
    assert_eq!(first.status, 201, "{}", first.describe());
    assert!(
        retry.status == 201 && replayed(&retry),
        "the waiting retry gets the replay: {}\n{}",
        retry.describe(),
        stack.logs()
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(executions(&stack, &key).await.len(), 1, "one charge");
    let envoy = &stack.envoy;
    // At least this one: the suite's other tests run beside it on the same Envoy.
    assert!(envoy.counter("cluster.state_api_wait.upstream_rq_total") > h2_before);
    assert!(envoy.counter("cluster.state_api_wait.upstream_cx_http2_total") >= 1);
    assert!(envoy.counter("cluster.state_api_wait.ssl.handshake") >= 1);
}

async fn same_key_other_body_gets_422(stack: Arc<Stack>) {
    let c = client(&stack);
    let key = unique_key("tls-reuse");
    let first = c.send(checkout(&key, "alice", &charge_body(100))).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    let changed = c.send(checkout(&key, "alice", &charge_body(101))).await;
    assert_problem(&changed, 422, "idempotency-key-reused", &stack);
    assert_eq!(executions(&stack, &key).await.len(), 1);
}

async fn state_api_reaches_postgres_over_verified_tls_only(stack: Arc<Stack>) {
    assert!(
        stack.database_url.contains("sslmode=verify-full"),
        "{}",
        stack.database_url
    );
    // The pool connects lazily: make sure it has connections, then ask Postgres about them.
    let c = client(&stack);
    let a = c
        .send(checkout(&unique_key("tls-pg"), "alice", &charge_body(5)))
        .await;
    assert_eq!(a.status, 201, "{}", a.describe());
    let sessions = stack
        .postgres
        .psql(
            "postgres",
            "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) \
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name = 'state-api'",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let (tls, plain) = sessions.split_once('|').unwrap_or(("0", "?"));
    assert!(
        tls.parse::<u32>().is_ok_and(|n| n > 0) && plain == "0",
        "state API sessions with TLS | without: {sessions}"
    );

    let pki = pki(&stack);
    let with_url = |url: String| match stack.start_extra_state_api_on(&url) {
        Ok(mut s) => {
            s.kill();
            Err("started".to_owned())
        }
        Err(e) => Ok(e),
    };
    let base = stack.database_url.split('?').next().unwrap_or_default();
    // verify-full verifies: a CA that did not sign Postgres's certificate is refused.
    let wrong_ca = with_url(format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        pki.other_ca.display()
    ));
    assert!(
        wrong_ca
            .as_ref()
            .is_ok_and(|e| e.contains("exited during start-up")
                && e.contains("invalid peer certificate: UnknownIssuer")),
        "a state API trusting another CA must not reach Postgres: {wrong_ca:?}"
    );
    // And Postgres takes TLS connections only.
    let plain = with_url(format!("{base}?sslmode=disable"));
    assert!(
        plain
            .as_ref()
            .is_ok_and(|e| e.contains("exited during start-up") && e.contains("no encryption")),
        "a plaintext connection to Postgres must be refused: {plain:?}"
    );
}

async fn state_api_port_answers_mutual_tls_only(stack: Arc<Stack>) {
    let pki = pki(&stack);
    let port = stack.state_api.port;
    let ok = https_get(port, "/healthz", &pki.ca, Some(&pki.client)).await;
    assert!(
        ok.as_ref().is_ok_and(|a| a.starts_with("HTTP/1.1 200")),
        "with Envoy's client certificate: {ok:?}\n{}",
        stack.state_api.log_tail()
    );
    // The bearer token stays a second factor: a client certificate alone reads no record.
    let records = https_get(
        port,
        &format!(
            "{}?key=k&subject=alice&endpoint=POST%20/checkout",
            contract::wire::RECORDS_PATH
        ),
        &pki.ca,
        Some(&pki.client),
    )
    .await;
    assert!(
        records
            .as_ref()
            .is_ok_and(|a| a.starts_with("HTTP/1.1 401")),
        "no token: {records:?}"
    );
    for (what, cert) in [
        (
            "a client certificate from another CA",
            Some(&pki.foreign_client),
        ),
        ("no client certificate", None::<&CertFiles>),
    ] {
        let refused = https_get(port, "/healthz", &pki.ca, cert).await;
        assert!(refused.is_err(), "{what} must be refused: {refused:?}");
        eprintln!("{what}: {}", refused.err().unwrap_or_default());
    }
    let plain = plaintext_get(port, "/healthz")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !plain.starts_with(b"HTTP/"),
        "plaintext HTTP on the TLS port got an HTTP answer: {:?}",
        String::from_utf8_lossy(&plain)
    );
    let log = stack.state_api.log();
    assert!(
        log.contains("TLS handshake refused"),
        "the refusals are logged:\n{}",
        stack.state_api.log_tail()
    );
}

/// A second state API on the same database serving `served`, and an Envoy configured as the
/// stack's (trusting the test CA) in front of it: Envoy must refuse the handshake, so the client
/// gets the filter's 503, the checkout sees nothing, and the key is still free afterwards.
async fn envoy_refuses_the_state_api_serving(stack: Arc<Stack>, served: CertFiles, name: &str) {
    let mut impostor = stack
        .start_extra_state_api_tls(&pki(&stack), &served)
        .unwrap_or_else(|e| panic!("{e}"));
    let envoy = stack
        .start_extra_envoy(impostor.port, &format!("envoy-{name}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let c = e2e::client::Client::new(&envoy.url(""));
    let key = unique_key(&format!("tls-{name}"));
    let body = charge_body(700);
    let answer = c.send(checkout(&key, "alice", &body)).await;
    assert_problem(&answer, 503, "idempotency-state-unavailable", &stack);
    assert!(
        executions(&stack, &key).await.is_empty() && attempts(&stack, &key).await.is_empty(),
        "nothing may reach the checkout"
    );
    let ssl = envoy.counters("^cluster\\.state_api\\.ssl\\.");
    eprintln!("{name}: Envoy's TLS counters for the state API: {ssl:?}");
    let refused = ssl
        .get("cluster.state_api.ssl.fail_verify_error")
        .copied()
        .unwrap_or(0);
    assert!(
        refused > 0,
        "Envoy's state_api cluster counted no failed certificate verification\n{}",
        envoy.log_tail()
    );
    // The claim never reached a state API: the stack's Envoy runs the key once, now.
    let later = client(&stack).send(checkout(&key, "alice", &body)).await;
    assert_eq!(later.status, 201, "{}", later.describe());
    assert!(!replayed(&later));
    assert_eq!(executions(&stack, &key).await.len(), 1);
    assert!(
        impostor.log().contains("TLS handshake refused"),
        "the impostor saw Envoy abort the handshake:\n{}",
        impostor.log_tail()
    );
    impostor.kill();
}

/// A state API started with an expired certificate serves the renewed one once its files are
/// replaced and it gets SIGHUP, without a restart.
async fn renewed_certificate_is_served_after_sighup(stack: Arc<Stack>) {
    let pki = pki(&stack);
    let dir = stack.dir.join("renewed");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let files = CertFiles {
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
    };
    let copy = |from: &CertFiles| {
        std::fs::copy(&from.cert, &files.cert).unwrap_or_else(|e| panic!("{e}"));
        std::fs::copy(&from.key, &files.key).unwrap_or_else(|e| panic!("{e}"));
    };
    copy(&pki.expired_server);
    let mut api = stack
        .start_extra_state_api_tls(&pki, &files)
        .unwrap_or_else(|e| panic!("{e}"));
    let before = https_get(api.port, "/healthz", &pki.ca, Some(&pki.client)).await;
    assert!(
        before
            .as_ref()
            .is_err_and(|e| e.contains("certificate expired")),
        "the expired certificate is refused: {before:?}"
    );
    // A reload that fails (a half-written key) keeps what is served, and the process.
    std::fs::write(&files.key, "not a key\n").unwrap_or_else(|e| panic!("{e}"));
    api.signal(Signal::HUP).unwrap_or_else(|e| panic!("{e}"));
    wait_for_log(&mut api, "TLS reload failed").await;
    let kept = https_get(api.port, "/healthz", &pki.ca, Some(&pki.client)).await;
    assert!(
        kept.as_ref()
            .is_err_and(|e| e.contains("certificate expired")),
        "the certificate in use stays after a failed reload: {kept:?}"
    );
    copy(&pki.server);
    api.signal(Signal::HUP).unwrap_or_else(|e| panic!("{e}"));
    wait_for_log(&mut api, "TLS certificate, key and client CA reloaded").await;
    let after = https_get(api.port, "/healthz", &pki.ca, Some(&pki.client)).await;
    assert!(
        after.as_ref().is_ok_and(|a| a.starts_with("HTTP/1.1 200")),
        "the renewed certificate is served: {after:?}\n{}",
        api.log_tail()
    );
    api.kill();
}

/// Waits (at most 5 s) until the service's log says `line`, the service still running.
async fn wait_for_log(service: &mut e2e::services::Service, line: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !service.log().contains(line) {
        assert!(
            std::time::Instant::now() < deadline && service.is_running(),
            "no {line:?} in the log:\n{}",
            service.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
