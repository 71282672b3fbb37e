//! `make demo`: the whole stack on its public addresses, until Ctrl-C or SIGTERM.
//!
//! Envoy 127.0.0.1:10000 (admin :9901), state API :8081, checkout :8082, Postgres :54329
//! (a private cluster under .demo/, or DATABASE_URL). A part that dies is reported and restarted.

use std::time::Duration;

use stack::envoy::{filter_wasm, Envoy, EnvoyParams};
use stack::postgres::TempCluster;
use stack::process::workspace_root;
use stack::services::{start_checkout, start_state_api, Service, StateApiSettings};

const ENVOY_PORT: u16 = 10000;
const ADMIN_PORT: u16 = 9901;
const STATE_API_PORT: u16 = 8081;
const CHECKOUT_PORT: u16 = 8082;
const POSTGRES_PORT: u16 = 54329;
/// Demo-only secrets; a real deployment passes its own.
const DEMO_API_TOKEN: &str = "demo-filter-token";
const DEMO_KEY_SECRET: &str = "demo-key-secret-change-me";

struct Demo {
    dir: std::path::PathBuf,
    database_url: String,
    _postgres: Option<TempCluster>,
    state_api: Service,
    checkout: Service,
    envoy: Envoy,
}

impl Demo {
    fn state_api_settings(&self) -> StateApiSettings {
        settings(&self.database_url)
    }
}

fn settings(database_url: &str) -> StateApiSettings {
    StateApiSettings {
        port: STATE_API_PORT,
        database_url: database_url.to_owned(),
        api_token: DEMO_API_TOKEN.into(),
        key_secret: DEMO_KEY_SECRET.into(),
        extra_env: Vec::new(),
    }
}

fn envoy_params() -> Result<EnvoyParams, String> {
    Ok(EnvoyParams {
        listen_address: "127.0.0.1".into(),
        listen_port: ENVOY_PORT,
        admin_address: "127.0.0.1".into(),
        admin_port: ADMIN_PORT,
        checkout_host: "127.0.0.1".into(),
        checkout_port: CHECKOUT_PORT,
        state_api_host: "127.0.0.1".into(),
        state_api_port: STATE_API_PORT,
        state_api_token: DEMO_API_TOKEN.into(),
        state_api_timeout_ms: 1_000,
        lease_ms: 30_000,
        heartbeat_ms: 10_000,
        complete_in_background: false,
        workers: 1,
        filter_wasm: filter_wasm()?.display().to_string(),
        jwks_path: workspace_root()
            .join("envoy/demo-jwks.json")
            .display()
            .to_string(),
        extra_routes: Vec::new(),
        extra_clusters: Vec::new(),
    })
}

fn start() -> Result<Demo, String> {
    let dir = workspace_root().join(".demo");
    std::fs::create_dir_all(dir.join("logs")).map_err(|e| e.to_string())?;
    let (postgres, database_url) = match std::env::var("DATABASE_URL") {
        Ok(url) => (None, url),
        Err(_) => {
            let cluster = TempCluster::start_at(&dir.join("postgres"), POSTGRES_PORT)?;
            let url = cluster.url();
            (Some(cluster), url)
        }
    };
    let logs = dir.join("logs");
    let state_api = start_state_api(&settings(&database_url), &logs)?;
    let checkout = start_checkout(CHECKOUT_PORT, &logs)?;
    let envoy = Envoy::start(envoy_params()?, &logs, "envoy")?;
    Ok(Demo {
        dir,
        database_url,
        _postgres: postgres,
        state_api,
        checkout,
        envoy,
    })
}

fn print_ready(demo: &Demo) {
    let root = workspace_root();
    let tokens = root.join("envoy/demo-tokens.json");
    println!(
        r#"
ready: Envoy http://127.0.0.1:{ENVOY_PORT} (admin :{ADMIN_PORT}) -> filter -> checkout :{CHECKOUT_PORT}; state API :{STATE_API_PORT}; Postgres {db}
logs: {logs}

Try it (another terminal, from {root}):

  TOKEN=$(sed -n 's/.*"alice": "\(.*\)".*/\1/p' {tokens})
  BODY='{{"amount":4990,"currency":"BRL","card":{{"number":"4242424242424242","exp":"12/30"}}}}'

  # 1. the first request runs: 201 Created
  curl -si http://127.0.0.1:{ENVOY_PORT}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-1' -H 'content-type: application/json' -d "$BODY"

  # 2. the impatient second click: the first request takes 8 s, the retry gets 409 + Retry-After at once
  curl -s http://127.0.0.1:{ENVOY_PORT}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-2' -H 'x-demo-delay-ms: 8000' -H 'content-type: application/json' -d "$BODY" >/dev/null &
  sleep 1; curl -si http://127.0.0.1:{ENVOY_PORT}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-2' -H 'content-type: application/json' -d "$BODY"

  # 3. the retry after completion is replayed (Idempotent-Replayed: true), the checkout is not called
  curl -si http://127.0.0.1:{ENVOY_PORT}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-1' -H 'content-type: application/json' -d "$BODY"

  # 4. the same key with a different body: 422
  curl -si http://127.0.0.1:{ENVOY_PORT}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-1' -H 'content-type: application/json' -d '{{"amount":9990,"currency":"BRL","card":{{"number":"4242424242424242","exp":"12/30"}}}}'

  # 5. the seeds' story: a 20 s checkout that keeps going when the app gives up after 2 s; the
  #    retries get 409 while it runs (the edge asks the checkout), then the real outcome, replayed
  curl -s -m 2 http://127.0.0.1:{ENVOY_PORT}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-3' -H 'x-demo-delay-ms: 20000' -H 'x-demo-detach: 1' -H 'content-type: application/json' -d "$BODY"
  for i in $(seq 10); do sleep 3; curl -s -o /dev/null -w '%{{http_code}} ' http://127.0.0.1:{ENVOY_PORT}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-3' -H 'content-type: application/json' -d "$BODY"; done; echo

  # what the checkout really executed: one charge per key; and every attempt it saw, with its
  # fencing token (running, executed, fenced, abandoned)
  curl -s http://127.0.0.1:{ENVOY_PORT}/charges -H "authorization: Bearer $TOKEN"
  curl -s http://127.0.0.1:{CHECKOUT_PORT}/attempts

Ctrl-C stops everything."#,
        db = demo.database_url.split('@').next_back().unwrap_or_default(),
        logs = demo.dir.join("logs").display(),
        root = root.display(),
        tokens = tokens.display(),
    );
}

/// Restarts any part that died, saying which.
fn supervise(demo: &mut Demo) {
    let logs = demo.dir.join("logs");
    if !demo.state_api.is_running() {
        eprintln!(
            "state API died (log: {}); restarting it",
            demo.state_api.log_path.display()
        );
        match start_state_api(&demo.state_api_settings(), &logs) {
            Ok(s) => demo.state_api = s,
            Err(e) => eprintln!("state API restart failed, will retry: {e}"),
        }
    }
    if !demo.checkout.is_running() {
        eprintln!(
            "checkout died (log: {}); restarting it (its in-memory ledger starts empty)",
            demo.checkout.log_path.display()
        );
        match start_checkout(CHECKOUT_PORT, &logs) {
            Ok(s) => demo.checkout = s,
            Err(e) => eprintln!("checkout restart failed, will retry: {e}"),
        }
    }
    if !demo.envoy.is_running() {
        eprintln!(
            "Envoy died (log: {}); restarting it",
            demo.envoy.log_path.display()
        );
        match envoy_params().and_then(|p| Envoy::start(p, &logs, "envoy")) {
            Ok(e) => demo.envoy = e,
            Err(e) => eprintln!("Envoy restart failed, will retry: {e}"),
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    std::env::set_var(
        "STACK_PROFILE",
        std::env::var("STACK_PROFILE").unwrap_or_else(|_| "release".into()),
    );
    let mut demo = match start() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("demo failed to start: {e}");
            std::process::exit(1);
        }
    };
    print_ready(&demo);
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cannot listen for SIGTERM: {e}");
            std::process::exit(1);
        }
    };
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = tokio::time::sleep(Duration::from_secs(1)) => supervise(&mut demo),
        }
    }
    eprintln!("stopping the demo");
    drop(demo);
}
