//! `make demo`: `edge run` on the committed `examples/demo.toml`, plus the demo checkout as the
//! upstream, until Ctrl-C or SIGTERM.
//!
//! Envoy 127.0.0.1:10000 (admin :9901), state API :8081, checkout :8082, Postgres :54329
//! (embedded under .run/demo/, or DATABASE_URL). A part that dies is reported and restarted.
//! `HA=1`: Postgres is two nodes under Patroni (REST :8008/:8009, Postgres :54331/:54332, etcd
//! :2379) with a synchronous standby, and HAProxy on :54329 (data under .run/demo/ha/).

use contract::state_env;
use e2e::envoy::demo_config_path;
use e2e::process::workspace_root;
use e2e::services::{start_checkout, Service};
use edge::config::Config;
use edge::run::{Options, Running};

const CHECKOUT_PORT: u16 = 8082;

fn print_ready(running: &Running) {
    let root = workspace_root();
    let tokens = root.join("envoy/demo-tokens.json");
    let envoy_port = running.cfg.listen.port();
    println!(
        r#"{ready}

Try it (another terminal, from {root}):

  TOKEN=$(sed -n 's/.*"alice": "\(.*\)".*/\1/p' {tokens})
  BODY='{{"amount":4990,"currency":"BRL","card":{{"number":"4242424242424242","exp":"12/30"}}}}'

  # 1. the first request runs: 201 Created
  curl -si http://127.0.0.1:{envoy_port}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-1' -H 'content-type: application/json' -d "$BODY"

  # 2. the impatient second click: the first request takes 8 s, the retry gets 409 + Retry-After at once
  curl -s http://127.0.0.1:{envoy_port}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-2' -H 'x-demo-delay-ms: 8000' -H 'content-type: application/json' -d "$BODY" >/dev/null &
  sleep 1; curl -si http://127.0.0.1:{envoy_port}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-2' -H 'content-type: application/json' -d "$BODY"

  # 3. the retry after completion is replayed (Idempotent-Replayed: true), the checkout is not called
  curl -si http://127.0.0.1:{envoy_port}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-1' -H 'content-type: application/json' -d "$BODY"

  # 4. the same key with a different body: 422
  curl -si http://127.0.0.1:{envoy_port}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-1' -H 'content-type: application/json' -d '{{"amount":9990,"currency":"BRL","card":{{"number":"4242424242424242","exp":"12/30"}}}}'

  # 5. the seeds' story: a 20 s checkout that keeps going when the app gives up after 2 s; the
  #    retries get 409 while it runs (the edge asks the checkout), then the real outcome, replayed
  curl -s -m 2 http://127.0.0.1:{envoy_port}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-3' -H 'x-demo-delay-ms: 20000' -H 'x-demo-detach: 1' -H 'content-type: application/json' -d "$BODY"
  for i in $(seq 10); do sleep 3; curl -s -o /dev/null -w '%{{http_code}} ' http://127.0.0.1:{envoy_port}/checkout -H "authorization: Bearer $TOKEN" -H 'idempotency-key: order-3' -H 'content-type: application/json' -d "$BODY"; done; echo

  # what the checkout really executed: one charge per key; and every attempt it saw, with its
  # fencing token (running, executed, fenced, abandoned)
  curl -s http://127.0.0.1:{envoy_port}/charges -H "authorization: Bearer $TOKEN"
  curl -s http://127.0.0.1:{CHECKOUT_PORT}/attempts

Ctrl-C stops everything."#,
        ready = running.ready_line(),
        root = root.display(),
        tokens = tokens.display(),
    );
}

/// Restarts the checkout when it died.
fn supervise_checkout(checkout: &mut Service) -> Vec<String> {
    if checkout.is_running() {
        return Vec::new();
    }
    let mut said = vec![format!(
        "checkout died (log: {}); restarting it (its in-memory ledger starts empty)",
        checkout.log_path.display()
    )];
    match start_checkout(CHECKOUT_PORT, &workspace_root().join(".run/demo/logs")) {
        Ok(s) => *checkout = s,
        Err(e) => said.push(format!("checkout restart failed, will retry: {e}")),
    }
    said
}

fn start() -> Result<(Running, Service), String> {
    let mut cfg = Config::load(&demo_config_path()).map_err(|e| e.to_string())?;
    if let Ok(url) = std::env::var(state_env::DATABASE_URL) {
        if !url.trim().is_empty() {
            cfg.state.database_url = Some(url);
        }
    }
    let dir = workspace_root().join(".run/demo");
    std::fs::create_dir_all(dir.join("logs")).map_err(|e| e.to_string())?;
    let checkout = start_checkout(CHECKOUT_PORT, &dir.join("logs"))?;
    let wasm = edge::envoy::filter_wasm()?;
    // HA=1 make demo: Postgres under Patroni with a synchronous standby, HAProxy on :54329.
    let ha = std::env::var("HA").is_ok_and(|v| v == "1");
    let running = Running::start(cfg, Options { dir, wasm, ha }).map_err(|e| e.to_string())?;
    Ok((running, checkout))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    std::env::set_var(
        "STACK_PROFILE",
        std::env::var("STACK_PROFILE").unwrap_or_else(|_| "release".into()),
    );
    let (mut running, mut checkout) = match start() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("demo failed to start: {e}");
            std::process::exit(1);
        }
    };
    print_ready(&running);
    let result = edge::run::until_signal(&mut running, || supervise_checkout(&mut checkout)).await;
    eprintln!("stopping the demo");
    running.stop();
    checkout.terminate(std::time::Duration::from_secs(5));
    if let Err(e) = result {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
