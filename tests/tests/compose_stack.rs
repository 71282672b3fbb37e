//! `make test-compose`: `docker compose up --build` as a new user runs it, on a Docker engine
//! of its own (not part of `make test`: it builds the images, minutes on 2 cores).
//!
//! The harness starts a private `dockerd` (e2e::docker), makes the base images the
//! Dockerfile names under those names, then runs docker-compose.yml and the Dockerfile
//! unchanged, in a copy of the working tree as a clone has it (edits during the run stay out): `docker-compose up --build`, the stack healthy, the checks of
//! `make demo` (201, 409 during a slow request, the replay, 422, the seeds' story with one
//! charge), a stop of the `edge` container that ends cleanly on SIGTERM (exit 0, Postgres shut
//! down, not recovered), the record still replayed after the restart (the volume), and
//! `docker-compose down`. The engine is stopped at the end, on failure and on Ctrl-C.
//! The demo's fixed ports (10000, 9901, 8081, 8082, 54329) must be free.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use e2e::client::{unique_key, Client, Request};
use e2e::docker::{
    last_lines, run, run_logged, snapshot_source, state_dir, BaseImages, DockerError, Dockerd,
};
use e2e::process::{send_signal, workspace_root, Signal};
use e2e::testkit::{block_on, charge_body, checkout, is_problem, replayed};
use libtest_mimic::{Arguments, Failed, Trial};

const PROJECT: &str = "edge-compose-test";
const ENVOY: &str = "http://127.0.0.1:10000";
const CHECKOUT: &str = "http://127.0.0.1:8082";
/// The demo's addresses, the compose file's too (host networking).
const DEMO_PORTS: [(u16, &str); 5] = [
    (10000, "Envoy"),
    (9901, "Envoy's admin"),
    (8081, "the state API"),
    (8082, "the checkout"),
    (54329, "Postgres"),
];

/// What an interrupt needs to take everything down from another thread.
struct Teardown {
    docker_host: String,
    dockerd_pid: u32,
}
/// The copy of the working tree docker-compose runs in (e2e::docker::snapshot_source).
static SOURCE: OnceLock<PathBuf> = OnceLock::new();
static TEARDOWN: OnceLock<Teardown> = OnceLock::new();

/// The engine, and what the trials hand on to each other.
struct Session {
    engine: Dockerd,
    up: bool,
    /// A completed key the restart test asks for again.
    kept_key: Option<(String, serde_json::Value)>,
}
static SESSION: Mutex<Option<Session>> = Mutex::new(None);

fn main() {
    let mut args = Arguments::from_args();
    // The trials are steps of one story, in this order.
    args.test_threads = Some(1);
    if args.list {
        libtest_mimic::run(&args, trials()).exit();
    }
    if let Err(e) = prepare() {
        eprintln!("make test-compose could not start: {e}");
        finish();
        std::process::exit(1);
    }
    let conclusion = libtest_mimic::run(&args, trials());
    finish();
    conclusion.exit();
}

fn trials() -> Vec<Trial> {
    vec![
        Trial::test(
            "compose_up_builds_the_dockerfile_and_the_stack_gets_healthy",
            compose_up,
        ),
        step("the_demo_answers_201_409_replay_and_422", demo_answers),
        step(
            "the_seeds_story_charges_once_and_replays_the_real_outcome",
            seeds_story,
        ),
        Trial::test(
            "a_stopped_edge_exits_cleanly_and_its_records_survive_a_restart",
            restart_edge,
        ),
        Trial::test("compose_down_removes_the_stack", compose_down),
    ]
}

/// A check against the running stack.
fn step<F>(name: &'static str, body: fn() -> F) -> Trial
where
    F: std::future::Future<Output = ()> + 'static,
{
    Trial::test(name, move || {
        require_up()?;
        block_on(body())
    })
}

/// The session, also after a failed (panicked) step held it.
fn session() -> std::sync::MutexGuard<'static, Option<Session>> {
    SESSION
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn require_up() -> Result<(), Failed> {
    let guard = session();
    match guard.as_ref() {
        Some(s) if s.up => Ok(()),
        _ => Err("the stack is not up (see the first test)".into()),
    }
}

/// The ports, the engine, the base images; and the interrupt handler.
fn prepare() -> Result<(), DockerError> {
    let taken: Vec<String> = DEMO_PORTS
        .iter()
        .filter(|(port, _)| std::net::TcpListener::bind(("127.0.0.1", *port)).is_err())
        .map(|(port, what)| format!("{port} ({what})"))
        .collect();
    if !taken.is_empty() {
        return Err(DockerError::Precondition(format!(
            "the compose stack listens on the demo's ports, and these are taken: {}; stop what \
             listens there (a `make demo`?) and run again",
            taken.join(", ")
        )));
    }
    e2e::docker::require_program("docker-compose")?;
    std::fs::create_dir_all(state_dir()).map_err(|source| DockerError::Io {
        what: state_dir().display().to_string(),
        source,
    })?;
    let _ = SOURCE.set(snapshot_source(&state_dir().join("source"))?);
    let started = Instant::now();
    let engine = Dockerd::start()?;
    eprintln!(
        "compose: dockerd ready in {:.1} s ({})",
        started.elapsed().as_secs_f64(),
        engine.host()
    );
    let _ = TEARDOWN.set(Teardown {
        docker_host: engine.host(),
        dockerd_pid: engine.pid().unwrap_or(0),
    });
    std::thread::spawn(stop_on_interrupt);
    let images = Instant::now();
    BaseImages {
        engine: &engine,
        dir: state_dir(),
    }
    .ensure_all()?;
    eprintln!(
        "compose: base images ready in {:.1} s",
        images.elapsed().as_secs_f64()
    );
    *session() = Some(Session {
        engine,
        up: false,
        kept_key: None,
    });
    Ok(())
}

/// Ctrl-C, SIGTERM or SIGHUP: the stack down, the engine stopped, exit 130.
fn stop_on_interrupt() {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) else {
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
            _ = hup.recv() => {}
        }
    });
    eprintln!("compose: interrupted; taking the stack down and stopping dockerd");
    if let Some(t) = TEARDOWN.get() {
        let _ = compose_command(&t.docker_host)
            .args(["down", "--volumes", "--timeout", "30"])
            .status();
        if send_signal(t.dockerd_pid, Signal::TERM).is_ok() {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline && process_alive(t.dockerd_pid) {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    std::process::exit(130);
}

/// Alive and not a zombie waiting to be reaped.
fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s[i + 1..].split_whitespace().next().map(str::to_owned))
        })
        .is_some_and(|state| state != "Z")
}

/// The stack down (if it is still up) and the engine stopped.
fn finish() {
    let taken = session().take();
    if let Some(mut session) = taken {
        if session.up {
            let _ = compose(&session.engine, &["down", "--volumes", "--timeout", "30"]);
        }
        session.engine.stop();
    }
}

/// `docker-compose` on the committed file, this engine, the legacy builder (the only one
/// Debian's docker.io has), a fixed project name.
fn compose_command(docker_host: &str) -> Command {
    let source = SOURCE.get().cloned().unwrap_or_else(workspace_root);
    let mut cmd = Command::new("docker-compose");
    cmd.current_dir(&source)
        .args(["--project-name", PROJECT, "--file"])
        .arg(source.join("docker-compose.yml"))
        .env("DOCKER_HOST", docker_host)
        .env("DOCKER_BUILDKIT", "0")
        .env("COMPOSE_DOCKER_CLI_BUILD", "0");
    cmd
}

fn compose(engine: &Dockerd, args: &[&str]) -> Result<String, DockerError> {
    run(compose_command(&engine.host()).args(args))
}

fn with_session<T>(f: impl FnOnce(&mut Session) -> Result<T, Failed>) -> Result<T, Failed> {
    let mut guard = session();
    let session = guard.as_mut().ok_or("no Docker engine")?;
    f(session)
}

fn log_dir() -> PathBuf {
    state_dir().join("logs")
}

fn compose_up() -> Result<(), Failed> {
    with_session(|session| {
        std::fs::create_dir_all(log_dir()).map_err(|e| e.to_string())?;
        let started = Instant::now();
        run_logged(
            compose_command(&session.engine.host()).args(["up", "--build", "--detach"]),
            &log_dir().join("compose-up.log"),
            Duration::from_secs(45 * 60),
        )
        .map_err(|e| e.to_string())?;
        eprintln!(
            "compose: docker-compose up --build took {:.0} s",
            started.elapsed().as_secs_f64()
        );
        session.up = true;
        let healthy = wait_healthy(&session.engine, Duration::from_secs(180))?;
        eprintln!("compose: edge healthy {healthy:.0} s after up (its health check)");
        Ok(())
    })
}

/// Until the `edge` container's health check says healthy and the demo's endpoints answer;
/// seconds it took.
fn wait_healthy(engine: &Dockerd, limit: Duration) -> Result<f64, Failed> {
    let started = Instant::now();
    let container = edge_container(engine)?;
    let mut last = String::new();
    while started.elapsed() < limit {
        last = run(engine.docker().args([
            "inspect",
            "--format",
            "{{.State.Status}} {{.State.Health.Status}}",
            &container,
        ]))
        .map_err(|e| e.to_string())?
        .trim()
        .to_owned();
        let answers = e2e::net::http_get_blocking(9901, "/ready").is_ok_and(|b| b.trim() == "LIVE")
            && e2e::net::http_get_blocking(8081, "/readyz").is_ok()
            && e2e::net::http_get_blocking(8082, "/healthz").is_ok();
        if last == "running healthy" && answers {
            return Ok(started.elapsed().as_secs_f64());
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let logs = compose(engine, &["logs", "--tail", "60"]).unwrap_or_default();
    Err(format!("edge was not healthy within {limit:?} (last: {last}):\n{logs}").into())
}

fn edge_container(engine: &Dockerd) -> Result<String, Failed> {
    let id = compose(engine, &["ps", "--quiet", "edge"]).map_err(|e| e.to_string())?;
    let id = id.trim().to_owned();
    if id.is_empty() {
        return Err("docker-compose ps shows no edge container".into());
    }
    Ok(id)
}

async fn demo_answers() {
    let c = Client::new(ENVOY);
    let body = charge_body(4990);

    // 1. The first request runs: 201.
    let key = unique_key("compose-order");
    let first = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(first.status, 201, "{}", first.describe());
    assert!(!replayed(&first));

    // 2. The impatient second click while the first takes 4 s: 409 + Retry-After at once.
    let slow_key = unique_key("compose-slow");
    let slow = {
        let c = c.clone();
        let req = checkout(&slow_key, "alice", &body).delay_ms(4000);
        tokio::spawn(async move { c.send(req).await })
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    let dup = c.send(checkout(&slow_key, "alice", &body)).await;
    assert!(
        is_problem(&dup, 409, "request-in-progress") && dup.header("retry-after").is_some(),
        "{}",
        dup.describe()
    );
    assert!(
        dup.elapsed < Duration::from_secs(2),
        "the 409 waited {:?}",
        dup.elapsed
    );
    let slow = slow.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(slow.status, 201, "{}", slow.describe());

    // 3. The retry after completion is replayed; the checkout is not called again.
    let again = c.send(checkout(&key, "alice", &body)).await;
    assert_eq!(again.status, 201, "{}", again.describe());
    assert!(replayed(&again), "{}", again.describe());
    assert_eq!(again.body, first.body);

    // 4. The same key with another body: 422.
    let changed = c.send(checkout(&key, "alice", &charge_body(9990))).await;
    assert!(
        is_problem(&changed, 422, "idempotency-key-reused"),
        "{}",
        changed.describe()
    );

    for k in [&key, &slow_key] {
        let charges = c.charges_for_key(CHECKOUT, k).await;
        assert_eq!(charges.len(), 1, "{k}: {charges:?}");
    }
    if let Some(s) = session().as_mut() {
        s.kept_key = Some((key, body));
    }
}

/// A slow checkout the app gives up on after 2 s (the checkout finishes it anyway); the
/// app's retries get 409 while it runs (the edge asks the checkout), then its real outcome.
async fn seeds_story() {
    let body = charge_body(12990);
    let key = unique_key("compose-seeds");
    let impatient = Client::impatient(ENVOY, Duration::from_secs(2));
    let gave_up = impatient
        .try_send(
            checkout(&key, "alice", &body)
                .delay_ms(8000)
                .header("x-demo-detach", "1"),
        )
        .await;
    assert!(
        gave_up.is_err(),
        "the first request should time out: {gave_up:?}"
    );
    let c = Client::new(ENVOY);
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    let outcome = loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let retry = c.send(checkout(&key, "alice", &body)).await;
        seen.push(retry.status);
        if replayed(&retry) {
            break retry;
        }
        assert!(
            retry.status == 409 || retry.status == 503,
            "a retry got {} (seen {seen:?})",
            retry.describe()
        );
        assert!(Instant::now() < deadline, "no replay within 40 s: {seen:?}");
    };
    assert_eq!(outcome.status, 201, "{}", outcome.describe());
    assert!(seen.contains(&409), "no 409 while it ran: {seen:?}");
    let charges = c.charges_for_key(CHECKOUT, &key).await;
    assert_eq!(charges.len(), 1, "{charges:?}");
}

fn restart_edge() -> Result<(), Failed> {
    require_up()?;
    with_session(|session| {
        let (key, body) = session
            .kept_key
            .clone()
            .ok_or("no completed key from the demo test")?;
        let container = edge_container(&session.engine)?;
        let started = Instant::now();
        compose(&session.engine, &["stop", "edge"]).map_err(|e| e.to_string())?;
        let took = started.elapsed();
        let exit = run(session.engine.docker().args([
            "inspect",
            "--format",
            "{{.State.ExitCode}}",
            &container,
        ]))
        .map_err(|e| e.to_string())?;
        eprintln!(
            "compose: docker-compose stop edge took {:.1} s, exit code {}",
            took.as_secs_f64(),
            exit.trim()
        );
        let logs =
            || compose(&session.engine, &["logs", "--tail", "40", "edge"]).unwrap_or_default();
        if exit.trim() != "0" {
            return Err(format!("edge ended with exit code {} on SIGTERM (137: killed at the end of the grace period):\n{}", exit.trim(), logs()).into());
        }
        if took > Duration::from_secs(15) {
            return Err(format!("stopping edge took {took:?}:\n{}", logs()).into());
        }
        compose(&session.engine, &["start", "edge"]).map_err(|e| e.to_string())?;
        wait_healthy(&session.engine, Duration::from_secs(120))?;
        // Postgres came back from a clean shutdown, not from crash recovery.
        let pg_log = compose(
            &session.engine,
            &[
                "exec",
                "-T",
                "edge",
                "cat",
                "/var/lib/edge/run/postgres/postgres.log",
            ],
        )
        .map_err(|e| e.to_string())?;
        let last_start = pg_log
            .lines()
            .filter(|l| l.contains("database system was"))
            .next_back()
            .unwrap_or_default()
            .to_owned();
        if !last_start.contains("database system was shut down at") {
            return Err(format!(
                "Postgres did not start from a clean shutdown: {last_start:?}\n{}",
                last_lines(&pg_log, 20)
            )
            .into());
        }
        block_on(async move {
            let c = Client::new(ENVOY);
            let again = c.send(checkout(&key, "alice", &body)).await;
            assert!(
                again.status == 201 && replayed(&again),
                "after the restart: {}",
                again.describe()
            );
            assert_eq!(c.charges_for_key(CHECKOUT, &key).await.len(), 1);
            // Whatever the checkout lists, through Envoy as the demo prints it.
            let listed = c
                .send(Request::get("/charges").token(&e2e::stack::token("alice")))
                .await;
            assert_eq!(listed.status, 200, "{}", listed.describe());
        })
    })
}

fn compose_down() -> Result<(), Failed> {
    with_session(|session| {
        compose(&session.engine, &["down", "--volumes", "--timeout", "30"])
            .map_err(|e| e.to_string())?;
        session.up = false;
        let left = run(session.engine.docker().args(["ps", "--all", "--quiet"]))
            .map_err(|e| e.to_string())?;
        if !left.trim().is_empty() {
            return Err(format!("containers left after down: {left}").into());
        }
        let volumes = run(session.engine.docker().args(["volume", "ls", "--quiet"]))
            .map_err(|e| e.to_string())?;
        if volumes.contains(PROJECT) {
            return Err(format!("volumes left after down: {volumes}").into());
        }
        Ok(())
    })
}
