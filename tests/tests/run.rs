//! `edge run` and `edge render` in front of an API that is not the demo checkout (issue 14):
//! the real `edge` binary, starting the real Postgres (embedded, or an existing one), state API
//! and Envoy, with a configuration file written the way a user writes one.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use e2e::client::{unique_key, Client, Request};
use e2e::net::free_port;
use e2e::postgres::TempCluster;
use e2e::process::{send_signal, workspace_binary, workspace_root, Signal};
use e2e::stack::token;
use e2e::testkit::{block_on, replayed};
use e2e::upstream::OwnApi;
use libtest_mimic::{Arguments, Failed, Trial};

fn main() {
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test(
            "edge_run_protects_an_api_that_is_not_the_demo_checkout",
            || block_on(protects_own_api()),
        ),
        Trial::test(
            "edge_run_uses_an_existing_postgres_from_database_url",
            || block_on(existing_postgres()),
        ),
        Trial::test("edge_run_talks_to_the_state_api_over_mutual_tls", || {
            block_on(state_api_over_mutual_tls())
        }),
        closed_folder_trial(
            "as_root_edge_run_from_a_closed_folder_keeps_postgres_data_outside_it",
            false,
        ),
        closed_folder_trial(
            "as_root_edge_run_ha_from_a_closed_folder_keeps_patroni_data_outside_it",
            true,
        ),
        Trial::test("rendered_configurations_pass_envoy_validate", || {
            rendered_configs_validate().map_err(Failed::from)
        }),
        Trial::test(
            "a_bad_file_gets_one_error_naming_its_field_and_line_and_starts_nothing",
            || bad_files_start_nothing().map_err(Failed::from),
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// A folder for one test's file, JWKS and run folder.
fn folder(label: &str) -> PathBuf {
    let dir = workspace_root().join("target/edge-runs").join(format!(
        "{label}-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    std::fs::copy(
        workspace_root().join("envoy/demo-jwks.json"),
        dir.join("jwks.json"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    dir
}

struct Ports {
    listen: u16,
    admin: u16,
    state: u16,
    postgres: u16,
}

impl Ports {
    fn free() -> Self {
        Self {
            listen: free_port(),
            admin: free_port(),
            state: free_port(),
            postgres: free_port(),
        }
    }
}

/// A user's file: an order route, a payments prefix, the demo issuer's tokens from a JWKS file.
fn own_file(p: &Ports, upstream: &str, state_extra: &str) -> String {
    format!(
        r#"listen = "127.0.0.1:{listen}"
admin = "127.0.0.1:{admin}"
upstream = "{upstream}"

[state]
listen = "127.0.0.1:{state}"
{state_extra}

[subject.jwt]
issuer = "https://demo-issuer.edge-idempotency.invalid"
audiences = ["checkout"]
jwks_file = "jwks.json"

[[route]]
method = "POST"
path = "/orders"
key = "required"

[[route]]
method = "POST"
prefix = "/payments/"
key = "required"
lease_ms = 6000
heartbeat_ms = 2000
"#,
        listen = p.listen,
        admin = p.admin,
        state = p.state,
    )
}

/// `edge run` as a child process, up to its `ready:` line.
struct EdgeRun {
    child: Child,
    ready: String,
    stderr: PathBuf,
    /// The test's own run folder, removed with the cluster data it links to (as root in a
    /// closed folder, under /var/lib/edge-postgres) once this run is over.
    run_dir: Option<PathBuf>,
}

impl EdgeRun {
    fn start(config: &Path, dir: &Path) -> Result<Self, String> {
        let mut cmd = Command::new(workspace_binary("edge")?);
        cmd.args(["run", "--config"])
            .arg(config)
            .arg("--dir")
            .arg(dir.join("run"));
        let mut run = Self::launch(cmd, dir, Duration::from_secs(90))?;
        run.run_dir = Some(dir.join("run"));
        Ok(run)
    }

    /// `cmd` (an `edge run`), its stderr in `dir/edge.stderr`, up to its `ready:` line.
    fn launch(mut cmd: Command, dir: &Path, patience: Duration) -> Result<Self, String> {
        let stderr = dir.join("edge.stderr");
        let err = std::fs::File::create(&stderr).map_err(|e| e.to_string())?;
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) if line.starts_with("ready: ") => {
                    return Ok(Self {
                        child,
                        ready: line,
                        stderr,
                        run_dir: None,
                    })
                }
                Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "edge run exited ({status}) before ready:\n{}",
                    std::fs::read_to_string(&stderr).unwrap_or_default()
                ));
            }
        }
        let _ = child.kill();
        Err(format!(
            "edge run was not ready in {} s:\n{}",
            patience.as_secs(),
            std::fs::read_to_string(&stderr).unwrap_or_default()
        ))
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// SIGTERM, and it ends by itself, cleanly.
    fn stop(mut self) -> Result<(), String> {
        send_signal(self.child.id(), Signal::TERM).map_err(|e| format!("edge run: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("edge run ended with {status}:\n{}", self.stderr()))
                };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err("edge run did not stop within 30 s of SIGTERM".into())
    }
}

impl Drop for EdgeRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.run_dir {
            let _ = edge::data_home::remove_run_folder(dir);
        }
    }
}

fn listening(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

fn order(key: &str, amount: u64) -> Request {
    Request::post("/orders")
        .token(&token("alice"))
        .key(key)
        .json(&serde_json::json!({"amount": amount, "items": [{"sku": "a", "qty": 1}]}))
}

async fn executions(api: &OwnApi, key: &str) -> u64 {
    Client::new(&api.url())
        .send(Request::get(&format!("/executions?key={key}")))
        .await
        .text()
        .trim()
        .parse()
        .unwrap_or(0)
}

async fn protects_own_api() {
    let api = OwnApi::start().unwrap_or_else(|e| panic!("{e}"));
    let dir = folder("own-api");
    let p = Ports::free();
    let config = dir.join("edge.toml");
    std::fs::write(
        &config,
        own_file(&p, &api.url(), &format!("postgres_port = {}", p.postgres)),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let edge = EdgeRun::start(&config, &dir).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        edge.ready
            .contains(&format!("http://127.0.0.1:{}", p.listen))
            && edge.ready.contains("embedded Postgres"),
        "{}",
        edge.ready
    );
    let c = Client::new(&format!("http://127.0.0.1:{}", p.listen));

    // A protected route: 201, a replay, 422 for another body; one execution.
    let key = unique_key("order");
    let first = c.send(order(&key, 10)).await;
    assert_eq!(first.status, 201, "{}\n{}", first.describe(), edge.stderr());
    assert_eq!(
        first.json()["subject"],
        "alice",
        "the verified subject reaches the API"
    );
    let again = c.send(order(&key, 10)).await;
    assert!(
        replayed(&again) && again.body == first.body,
        "{}",
        again.describe()
    );
    let other = c.send(order(&key, 11)).await;
    assert_eq!(other.status, 422, "{}", other.describe());
    assert_eq!(executions(&api, &key).await, 1);
    // 409 at once while the first still runs.
    let slow_key = unique_key("slow");
    let slow = {
        let c = c.clone();
        let req = order(&slow_key, 5).header("x-delay-ms", "1500");
        tokio::spawn(async move { c.send(req).await })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let dup = c.send(order(&slow_key, 5)).await;
    assert_eq!(dup.status, 409, "{}", dup.describe());
    assert!(dup.header("retry-after").is_some());
    assert_eq!(slow.await.map(|a| a.status).ok(), Some(201));
    assert_eq!(executions(&api, &slow_key).await, 1);
    // Without a token a protected route is refused by jwt_authn.
    let bare = c
        .send(
            Request::post("/orders")
                .key(&unique_key("bare"))
                .json(&serde_json::json!({})),
        )
        .await;
    assert_eq!(bare.status, 401, "{}", bare.describe());

    // A prefix route, with its own lease.
    let pay = unique_key("pay");
    let send_pay = || {
        Request::post("/payments/abc")
            .token(&token("bob"))
            .key(&pay)
            .json(&serde_json::json!({"amount": 3}))
    };
    let a = c.send(send_pay()).await;
    assert_eq!(a.status, 201, "{}", a.describe());
    assert_eq!(a.json()["subject"], "bob");
    assert!(replayed(&c.send(send_pay()).await));
    assert_eq!(executions(&api, &pay).await, 1);

    // Everything else passes through untouched: method, path, query, headers, body, no token
    // needed; a client-made subject header never reaches the API.
    let echo = c
        .send(
            Request {
                method: reqwest::Method::PUT,
                ..Request::post("/things/42?b=2&a=1&a=%2F")
            }
            .header("x-custom", "Value With  Spaces")
            .header("x-custom", "second")
            .header("x-jwt-sub", "mallory")
            .body(vec![7u8; 70_000]),
        )
        .await;
    assert_eq!(echo.status, 200, "{}", echo.describe());
    let e = echo.json();
    assert_eq!(e["method"], "PUT");
    assert_eq!(e["path_and_query"], "/things/42?b=2&a=1&a=%2F");
    assert_eq!(e["body_len"], 70_000);
    assert_eq!(e["body_sha256"], e2e::testkit::sha256_hex(&[7u8; 70_000]));
    let headers: Vec<(String, String)> = e["headers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p[0].as_str()?.to_owned(), p[1].as_str()?.to_owned())))
        .collect();
    let custom: Vec<&str> = headers
        .iter()
        .filter(|(n, _)| n == "x-custom")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(custom, ["Value With  Spaces", "second"], "{headers:?}");
    assert!(
        !headers.iter().any(|(n, _)| n == "x-jwt-sub"),
        "{headers:?}"
    );
    // A streamed (chunked) request body passes whole, chunk boundaries aside.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..8).map(|i| Ok(vec![i as u8; 9_000])).collect();
    let all: Vec<u8> = (0..8u8).flat_map(|i| vec![i; 9_000]).collect();
    let streamed_in = c
        .send(
            Request::post("/upload")
                .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks))),
        )
        .await;
    assert_eq!(
        streamed_in.json()["body_len"],
        72_000,
        "{}",
        streamed_in.describe()
    );
    assert_eq!(
        streamed_in.json()["body_sha256"],
        e2e::testkit::sha256_hex(&all)
    );
    assert!(streamed_in.json()["headers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|p| p[0] == "transfer-encoding" && p[1] == "chunked"));
    // A streamed (chunked) answer arrives whole.
    let streamed = c.send(Request::get("/stream?chunks=5")).await;
    assert_eq!(
        streamed.text(),
        (0..5).map(|i| format!("chunk {i}\n")).collect::<String>()
    );

    // A killed Postgres is restarted (and reaped): requests work again.
    let pid_file = dir.join("run/postgres/data/postmaster.pid");
    let pid = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|t| t.lines().next().map(str::to_owned))
        .unwrap_or_else(|| panic!("no {}", pid_file.display()));
    let pid: u32 = pid
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("postmaster.pid starts with {pid:?}: {e}"));
    send_signal(pid, Signal::KILL).unwrap_or_else(|e| panic!("the postmaster: {e}"));
    let recovered = Instant::now();
    let mut back = None;
    while recovered.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let a = c.send(order(&unique_key("after-kill"), 1)).await;
        if a.status == 201 {
            back = Some(recovered.elapsed());
            break;
        }
        assert_eq!(a.status, 503, "fail closed meanwhile: {}", a.describe());
    }
    assert!(
        back.is_some(),
        "Postgres was not restarted:\n{}",
        edge.stderr()
    );
    // The supervisor says so once its restart call has returned, which can be a moment after
    // the server already answers (it polls pg_isready every 50 ms).
    let said_at = Instant::now();
    while !edge.stderr().contains("Postgres died; restarting it")
        && said_at.elapsed() < Duration::from_secs(5)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        edge.stderr().contains("Postgres died; restarting it"),
        "{}",
        edge.stderr()
    );
    // The stored outcome survived the crash.
    assert!(replayed(&c.send(order(&key, 10)).await));

    // `edge health` (the container's health check) says so, and says it no more once stopped.
    let health = || {
        Command::new(workspace_binary("edge").unwrap_or_else(|e| panic!("{e}")))
            .args(["health", "--config"])
            .arg(&config)
            .output()
            .unwrap_or_else(|e| panic!("edge health: {e}"))
    };
    let up = health();
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );

    // SIGTERM stops everything.
    edge.stop().unwrap_or_else(|e| panic!("{e}"));
    let down = health();
    assert!(
        !down.status.success() && String::from_utf8_lossy(&down.stderr).starts_with("unhealthy: "),
        "{down:?}"
    );
    for (what, port) in [
        ("Envoy", p.listen),
        ("the admin", p.admin),
        ("the state API", p.state),
        ("Postgres", p.postgres),
    ] {
        assert!(
            !listening(port),
            "{what} still listens on {port} after SIGTERM"
        );
    }
}

/// `[state.tls]` in the file: `edge run` starts the state API on HTTPS with client
/// certificates required and Envoy's cluster verifying it and presenting its own (certificates
/// made by the test, rcgen).
async fn state_api_over_mutual_tls() {
    let api = OwnApi::start().unwrap_or_else(|e| panic!("{e}"));
    let dir = folder("state-tls");
    let pki = e2e::tls::TestPki::generate(&dir.join("pki")).unwrap_or_else(|e| panic!("{e}"));
    let p = Ports::free();
    let config = dir.join("edge.toml");
    let state_extra = format!(
        "postgres_port = {}\n\n[state.tls]\ncert_file = \"pki/server.pem\"\n\
         key_file = \"pki/server-key.pem\"\nca_file = \"pki/ca.pem\"\n\
         client_cert_file = \"pki/envoy-client.pem\"\nclient_key_file = \"pki/envoy-client-key.pem\"\n\
         client_ca_file = \"pki/ca.pem\"",
        p.postgres
    );
    std::fs::write(&config, own_file(&p, &api.url(), &state_extra))
        .unwrap_or_else(|e| panic!("{e}"));
    let edge = EdgeRun::start(&config, &dir).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        edge.ready.contains(&format!(
            "state API https://127.0.0.1:{} (mutual TLS)",
            p.state
        )),
        "{}",
        edge.ready
    );
    let c = Client::new(&format!("http://127.0.0.1:{}", p.listen));
    let key = unique_key("tls-order");
    let first = c.send(order(&key, 10)).await;
    assert_eq!(first.status, 201, "{}\n{}", first.describe(), edge.stderr());
    assert!(replayed(&c.send(order(&key, 10)).await));
    // The state API's port: HTTPS with Envoy's certificate, nothing without one.
    let ready = e2e::tls::https_get(p.state, "/readyz", &pki.ca, Some(&pki.client)).await;
    assert!(
        ready.as_ref().is_ok_and(|a| a.starts_with("HTTP/1.1 200")),
        "{ready:?}"
    );
    assert!(
        e2e::envoy::http_get_blocking(p.state, "/readyz").is_err(),
        "plain HTTP to the state API's TLS port"
    );
    assert!(e2e::tls::https_get(p.state, "/readyz", &pki.ca, None)
        .await
        .is_err());
    edge.stop().unwrap_or_else(|e| panic!("{e}"));
}

async fn existing_postgres() {
    let api = OwnApi::start().unwrap_or_else(|e| panic!("{e}"));
    let pg = TempCluster::start().unwrap_or_else(|e| panic!("{e}"));
    let url = pg
        .fresh_database("edge_run")
        .unwrap_or_else(|e| panic!("{e}"));
    let dir = folder("database-url");
    let p = Ports::free();
    let config = dir.join("edge.toml");
    std::fs::write(
        &config,
        own_file(&p, &api.url(), &format!("database_url = \"{url}\"")),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let edge = EdgeRun::start(&config, &dir).unwrap_or_else(|e| panic!("{e}"));
    assert!(!edge.ready.contains("embedded"), "{}", edge.ready);
    assert!(
        !dir.join("run/postgres").exists(),
        "no embedded cluster was made"
    );
    let c = Client::new(&format!("http://127.0.0.1:{}", p.listen));
    let key = unique_key("existing");
    assert_eq!(c.send(order(&key, 1)).await.status, 201);
    assert!(replayed(&c.send(order(&key, 1)).await));
    // The record is in that database.
    let db = url.rsplit('/').next().unwrap_or_default();
    let rows = pg
        .psql(
            db,
            "SELECT count(*) FROM idempotency_records WHERE state = 'completed'",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rows, "1");
    // Sealed at rest under the storage key edge run made and keeps in the run folder (0600).
    let sealed = pg
        .psql(
            db,
            "SELECT count(*) FROM idempotency_records WHERE response_key_id IS NOT NULL \
             AND response_headers = '[]'::jsonb",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sealed, "1", "the stored response is not sealed");
    let key_file = dir.join("run/storage-key");
    let mode = std::fs::metadata(&key_file)
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
        .unwrap_or_else(|e| panic!("{}: {e}", key_file.display()));
    assert_eq!(mode, 0o600);
    edge.stop().unwrap_or_else(|e| panic!("{e}"));
}

fn rendered_configs_validate() -> Result<(), String> {
    let edge = workspace_binary("edge")?;
    let wasm = e2e::envoy::filter_wasm()?;
    let dir = folder("render");
    // Every feature the renderer has: a remote JWKS over TLS, a reconcile service of its own
    // over TLS, per-route options; and a header subject.
    let full = format!(
        "{}\n[filter]\ncomplete_in_background = true\nreplay_extra_headers = [\"x-order-id\"]\n",
        own_file(&Ports::free(), "https://api.example:8443", "timeout_ms = 500")
            .replace("jwks_file = \"jwks.json\"", "jwks_url = \"https://issuer.example/.well-known/jwks.json\"")
            .replace(
                "path = \"/orders\"\nkey = \"required\"",
                "path = \"/orders\"\nkey = \"required\"\non_unknown = \"reconcile\"\nreconcile = { path = \"/orders/attempts/{key}\", upstream = \"https://ledger.internal\" }",
            )
    );
    let header = own_file(&Ports::free(), "http://127.0.0.1:3000", "").replace(
        "[subject.jwt]\nissuer = \"https://demo-issuer.edge-idempotency.invalid\"\naudiences = [\"checkout\"]\njwks_file = \"jwks.json\"",
        "[subject]\nheader = \"x-user-id\"",
    );
    let files = [("full.toml", full), ("header.toml", header)];
    for (name, text) in files {
        std::fs::write(dir.join(name), text).map_err(|e| e.to_string())?;
    }
    for config in [
        dir.join("full.toml"),
        dir.join("header.toml"),
        workspace_root().join("examples/own-api.toml"),
        workspace_root().join("examples/demo.toml"),
    ] {
        let out = Command::new(&edge)
            .args(["render", "--config"])
            .arg(&config)
            .arg("--wasm")
            .arg(&wasm)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "edge render {}: {}",
                config.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let yaml = String::from_utf8_lossy(&out.stdout).into_owned();
        if !yaml.contains("#   STATE_API_TOKEN=") || !yaml.contains("#   DATABASE_URL=") {
            return Err(format!("the state API's environment is missing:\n{yaml}"));
        }
        let path = dir.join(format!(
            "{}.yaml",
            config
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        std::fs::write(&path, &yaml).map_err(|e| e.to_string())?;
        edge::envoy::validate(&path)?;
    }
    Ok(())
}

fn bad_files_start_nothing() -> Result<(), String> {
    let edge = workspace_binary("edge")?;
    let dir = folder("bad");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let taken_port = taken.local_addr().map_err(|e| e.to_string())?.port();
    let p = Ports::free();
    let good = own_file(
        &p,
        "http://127.0.0.1:3000",
        &format!("postgres_port = {}", p.postgres),
    );
    let cases: Vec<(&str, String, &str, usize)> = vec![
        (
            "missing upstream",
            good.replace("upstream = \"http://127.0.0.1:3000\"\n", ""),
            "missing field `upstream`",
            1,
        ),
        (
            "path and prefix",
            good.replace("path = \"/orders\"", "path = \"/orders\"\nprefix = \"/o/\""),
            "either path or prefix, not both",
            17,
        ),
        (
            "a lease shorter than two heartbeats",
            good.replace("heartbeat_ms = 2000", "heartbeat_ms = 4000"),
            "shorter than two heartbeats",
            24,
        ),
        (
            "an unreadable JWKS",
            good.replace("jwks.json", "no-such-jwks.json"),
            "subject.jwt.jwks_file",
            12,
        ),
        (
            "a port in use",
            good.replace(
                &format!("127.0.0.1:{}\"\nadmin", p.listen),
                &format!("127.0.0.1:{taken_port}\"\nadmin"),
            ),
            "is in use",
            1,
        ),
    ];
    for (what, text, want, line) in cases {
        let config = dir.join("bad.toml");
        std::fs::write(&config, &text).map_err(|e| e.to_string())?;
        let out = Command::new(&edge)
            .args(["run", "--config"])
            .arg(&config)
            .arg("--dir")
            .arg(dir.join("run"))
            .output()
            .map_err(|e| e.to_string())?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        let first = stderr.lines().next().unwrap_or_default();
        if out.status.code() != Some(2)
            || !first.contains(want)
            || !first.starts_with(&format!("{}:{line}: ", config.display()))
        {
            return Err(format!(
                "{what}: want exit 2 and `{}:{line}: ...{want}...`, got {:?}: {stderr}",
                config.display(),
                out.status.code()
            ));
        }
        if stderr.lines().count() != 1 {
            return Err(format!("{what}: one error, got:\n{stderr}"));
        }
        for port in [p.listen, p.admin, p.state, p.postgres] {
            if listening(port) {
                return Err(format!(
                    "{what}: something listens on {port}: it started anyway"
                ));
            }
        }
        if dir.join("run/postgres").exists() {
            return Err(format!("{what}: an embedded cluster was made"));
        }
    }
    drop(taken);
    Ok(())
}

/// Issue 33. As root, the embedded cluster runs as the `postgres` user, who cannot enter a
/// folder of mode 0700 (`/root`, a private temporary folder): a clone there must still run,
/// with the cluster's data in a folder of its own outside the tree, linked from the run folder,
/// kept across runs and removed by `edge clean`. Not root: the cluster runs as this user and
/// nothing is moved, so there is nothing of this to check (the trial says so, as ignored).
fn closed_folder_trial(name: &'static str, ha: bool) -> Trial {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let trial = Trial::test(name, move || block_on(from_a_closed_folder(ha)));
    if root {
        trial
    } else {
        eprintln!("{name}: needs root (as a normal user Postgres runs as that user, in the tree); run `sudo make test`");
        trial.with_ignored_flag(true)
    }
}

async fn from_a_closed_folder(ha: bool) {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let top = std::env::temp_dir().join(format!(
        "edge-closed-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&top).unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o700))
        .unwrap_or_else(|e| panic!("{e}"));
    let project = top.join("project");
    let cloned = Command::new("git")
        .args(["clone", "--quiet", "--depth", "1"])
        .arg(format!("file://{}", workspace_root().display()))
        .arg(&project)
        .status();
    assert!(
        cloned.is_ok_and(|s| s.success()),
        "git clone of {} failed: the test clones the project it runs in (install git)",
        workspace_root().display()
    );
    std::fs::copy(
        project.join("envoy/demo-jwks.json"),
        project.join("jwks.json"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let api = OwnApi::start().unwrap_or_else(|e| panic!("{e}"));
    let p = Ports::free();
    // --ha puts etcd, Patroni and the nodes on the demo's fixed ports around postgres_port.
    let postgres_port = if ha { 54329 } else { p.postgres };
    std::fs::write(
        project.join("edge.toml"),
        own_file(&p, &api.url(), &format!("postgres_port = {postgres_port}")),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let start = || {
        let mut cmd = Command::new(workspace_binary("edge").unwrap_or_else(|e| panic!("{e}")));
        // The user's way: from the project's folder, the default run folder `.run/edge`.
        cmd.current_dir(&project)
            .args(["run", "--config", "edge.toml"]);
        if ha {
            cmd.arg("--ha");
        }
        EdgeRun::launch(
            cmd,
            &project,
            Duration::from_secs(if ha { 240 } else { 90 }),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let edge = start();
    let link = project
        .join(".run/edge")
        .join(if ha { "ha" } else { "postgres" });
    let home = std::fs::read_link(&link).unwrap_or_else(|e| {
        panic!(
            "{} should link to the cluster's folder outside the closed tree: {e}\n{}",
            link.display(),
            edge.stderr()
        )
    });
    assert!(
        home.starts_with(edge::data_home::OUTSIDE_BASE),
        "{}",
        home.display()
    );
    let postgres_uid = Command::new("id")
        .args(["-u", "postgres"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<u32>()
                .unwrap_or(0)
        })
        .unwrap_or(0);
    let meta = std::fs::metadata(&home).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        meta.uid(),
        postgres_uid,
        "{} is the server user's",
        home.display()
    );
    assert_eq!(
        std::fs::metadata(&top)
            .map(|m| m.permissions().mode() & 0o777)
            .ok(),
        Some(0o700),
        "the user's own folder keeps its mode"
    );
    assert!(
        edge.stderr().contains("is closed to uid"),
        "edge run says where the data went:\n{}",
        edge.stderr()
    );

    let c = Client::new(&format!("http://127.0.0.1:{}", p.listen));
    let key = unique_key("closed");
    let first = c.send(order(&key, 7)).await;
    assert_eq!(first.status, 201, "{}\n{}", first.describe(), edge.stderr());
    edge.stop().unwrap_or_else(|e| panic!("{e}"));

    // A second run finds its data through the link: the record is replayed.
    let edge = start();
    let again = c.send(order(&key, 7)).await;
    assert!(
        replayed(&again) && again.body == first.body,
        "{}\n{}",
        again.describe(),
        edge.stderr()
    );
    assert_eq!(executions(&api, &key).await, 1);
    edge.stop().unwrap_or_else(|e| panic!("{e}"));

    let cleaned = Command::new(workspace_binary("edge").unwrap_or_else(|e| panic!("{e}")))
        .current_dir(&project)
        .args(["clean", "--dir", ".run/edge"])
        .status();
    assert!(cleaned.is_ok_and(|s| s.success()));
    assert!(!home.exists(), "edge clean removes {}", home.display());
    assert!(!project.join(".run/edge").exists());
    let _ = std::fs::remove_dir_all(&top);
}
