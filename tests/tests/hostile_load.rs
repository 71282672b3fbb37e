//! Hostile load at the edge (issue 49): what many clients that never finish can make Envoy
//! hold, through the real stack and the configuration `edge render` writes (`[limits]`).
//!
//! Each attack runs while a legitimate client sends new keys, and asserts:
//! - Envoy's resident memory over the attack's start stays within the budget the test names;
//! - the legitimate new keys are all served, their p99 within [`P99_BOUND`] (100 ms), or where
//!   this 2-core machine cannot, within a bound the constant's comment justifies (the burst);
//!   during the burst, the held bodies fill the filter's bound but its reserve, in which a
//!   caller who holds little still fits;
//! - nothing the checkout ran was charged twice;
//! - no attacked key is left unusable: sent again whole, it gets 201 once.
//!
//! Sizes: `make test` (and `cargo test -p e2e --test hostile_load`) runs the CI size;
//! `HOSTILE_LOAD_SIZE=full` (`make test-hostile-load SIZE=full`) the issue's: 500 x 1 MiB held
//! bodies either way, 2,000 / 10,000 idle connections, 200 / 1,000 slow-body clients, 50 / 200
//! slow-header clients, a header flood of 5 / 20 s from 32 / 64 connections, an HTTP/2 rapid
//! reset of 5 / 20 s from 8 / 16 connections, an HTTP/2 control-frame flood (PING, SETTINGS,
//! WINDOW_UPDATE) of 5 / 20 s from 24 / 96 clients, 200 / 1,000 HTTP/2 clients that never
//! read their answer (a window of 0), and a flood of empty DATA, PRIORITY and CONTINUATION
//! frames on an open request of 5 / 20 s from 24 / 96 clients. The stack's client
//! timeouts are shortened (`[limits]`: headers 2 s, whole request 5 s, idle 3 s, an unread
//! answer 15 / 40 s) so that the slow clients are cut within the test's time; the memory limits
//! are the defaults.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::client::{unique_key, Client};
use e2e::envoy::Tweak;
use e2e::services::ServiceTestExt as _;
use e2e::stack::{mint_token, token, Stack, StackOptions};
use e2e::testkit::{charge_body, checkout, SharedStack};
use libtest_mimic::Arguments;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: usize = 1 << 20;

/// The legitimate clients' p99 during an attack: issue 49 asks 100 ms, and the slow clients and
/// the header flood stay well within it here (22 and 36 ms at most, measured).
const P99_BOUND: Duration = Duration::from_millis(100);

/// The legitimate keys' p99 during the burst: when the held bodies are released, the one
/// Envoy worker fingerprints all of them (35 of 1 MiB, about 7 ms each in V8) and forwards the
/// 35 MiB in the turns of its loop that serve the legitimate key too, while this process
/// writes 500 MiB on the same two cores. Measured since the checkout hashes its bodies
/// optimised and outside its lock (2026-12-08): p99 196-330 ms, of which the checkout 3-21 ms
/// (before: 440-574 ms of 451-584; with the bodies sent as text/plain, hashed raw, the same key
/// had waited 171-195 ms: the forwarding is the larger part; docs/RELIABILITY.md, Hostile load).
const BURST_P99_BOUND: Duration = Duration::from_millis(1_000);
/// The checkout's share of a legitimate key's time during the burst (`x-envoy-upstream-
/// service-time`): 3-21 ms measured, 440-574 ms while it hashed bodies under its lock.
const BURST_UPSTREAM_P99_BOUND: Duration = Duration::from_millis(150);

/// The legitimate keys' p50 and p99 during the HTTP/2 rapid reset: Envoy's one worker starts
/// some 16,000 streams a second for the attack (half of them claimed and given back), one a
/// turn of its loop per connection (`http.max_requests_per_io_cycle`), while this process opens
/// and resets them on the same two cores. Measured: p50 30-100 ms, p99 74-275 ms; without the
/// per-turn limit p50 270-280 ms, p99 403-483 ms (docs/RELIABILITY.md, Hostile load).
const RESET_P50_BOUND: Duration = Duration::from_millis(200);
const RESET_P99_BOUND: Duration = Duration::from_millis(500);

/// What Envoy's resident memory may grow by over each attack: `[limits] memory_budget_mib`'s
/// default (issue 49: 80 MiB).
const BUDGET_MIB: f64 = 80.0;

struct Sizes {
    burst: usize,
    idle: usize,
    slow_body: usize,
    slow_headers: usize,
    flood_secs: u64,
    flood_clients: usize,
    reset_secs: u64,
    reset_connections: usize,
    control_flood_connections: usize,
    zero_window_connections: usize,
    /// `[limits] response_flush_timeout_ms`: longer than the readers that never read take to
    /// connect and hold their answers while the legitimate keys are measured (`reset_secs`).
    flush_timeout_ms: u64,
}

fn sizes() -> Sizes {
    if std::env::var("HOSTILE_LOAD_SIZE").as_deref() == Ok("full") {
        Sizes {
            burst: 500,
            idle: 10_000,
            slow_body: 1_000,
            slow_headers: 200,
            flood_secs: 20,
            flood_clients: 64,
            reset_secs: 20,
            reset_connections: 16,
            control_flood_connections: 96,
            zero_window_connections: 1_000,
            flush_timeout_ms: 40_000,
        }
    } else {
        Sizes {
            burst: 500,
            idle: 2_000,
            slow_body: 200,
            slow_headers: 50,
            flood_secs: 5,
            flood_clients: 32,
            reset_secs: 5,
            reset_connections: 8,
            control_flood_connections: 24,
            zero_window_connections: 200,
            flush_timeout_ms: 15_000,
        }
    }
}

/// The test timeouts (`[limits]`), short enough for the slow clients to be cut in the test.
const HEADERS_TIMEOUT_MS: u64 = 2_000;
const BODY_TIMEOUT_MS: u64 = 5_000;
const IDLE_TIMEOUT_MS: u64 = 3_000;

/// `HOSTILE_LOAD_BUDGET_MIB`: another `[limits] memory_budget_mib` than the default, to see the
/// overload manager act (the figures in docs/RELIABILITY.md); the goals assume the default.
fn budget_override() -> Option<u64> {
    std::env::var("HOSTILE_LOAD_BUDGET_MIB").ok()?.parse().ok()
}

/// What the overload manager and the timeouts did, as Envoy counts it (counters since start).
fn overload_counters(stack: &Stack) -> BTreeMap<String, u64> {
    stack
        .envoy
        .counters("(downstream_cx_overload_disable_keepalive|downstream_rq_overload_close|rq_overload_local_reply|reset_high_memory_stream.count|shed_load_count|downstream_cx_idle_timeout|downstream_cx_overload_reject|downstream_cx_overflow)$")
        .into_iter()
        .filter(|(k, v)| *v > 0 && !k.starts_with("http.admin") && !k.starts_with("listener.admin"))
        .collect()
}

fn start_stack() -> Result<Stack, String> {
    let s = sizes();
    let budget = budget_override();
    // The open files this process needs: every attack connection, and the legitimate ones.
    let need = (s.idle.max(s.slow_body + s.slow_headers).max(s.burst) + 1_000) as u64;
    raise_open_files(need)?;
    Stack::start(StackOptions {
        tweak: Some(Tweak::new(move |cfg| {
            cfg.limits.request_headers_timeout_ms = HEADERS_TIMEOUT_MS;
            cfg.limits.request_body_timeout_ms = BODY_TIMEOUT_MS;
            cfg.limits.idle_timeout_ms = IDLE_TIMEOUT_MS;
            cfg.limits.response_flush_timeout_ms = s.flush_timeout_ms;
            if let Some(b) = budget {
                cfg.limits.memory_budget_bytes = b << 20;
            }
        })),
        ..StackOptions::default()
    })
}

/// Raises this process's soft limit of open files to `need` (Envoy, a child, inherits it),
/// or says why it cannot.
fn raise_open_files(need: u64) -> Result<(), String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err("getrlimit(RLIMIT_NOFILE) failed".into());
    }
    if lim.rlim_cur >= need {
        return Ok(());
    }
    if lim.rlim_max < need {
        return Err(format!(
            "this suite needs {need} open files and the hard limit is {} (ulimit -Hn): raise it, \
             e.g. `ulimit -n {need}` as root, or in /etc/security/limits.conf",
            lim.rlim_max
        ));
    }
    lim.rlim_cur = need;
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(format!("setrlimit(RLIMIT_NOFILE, {need}) failed"));
    }
    Ok(())
}

static STACK: SharedStack = SharedStack::new(start_stack);

// ---------------------------------------------------------------------------------------------
// Envoy's memory

/// The pid of the Envoy whose command line names `config`.
/// The Envoy listener's address, for the attacks' raw connections.
fn envoy_addr(stack: &Stack) -> SocketAddr {
    format!("127.0.0.1:{}", stack.envoy.params.listen_port)
        .parse()
        .expect("addr")
}

fn envoy_pid(stack: &Stack) -> u32 {
    let config = stack.envoy.config_path.display().to_string();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&config) {
            return pid;
        }
    }
    panic!("no Envoy process runs {config}");
}

/// Resident memory of `pid`, MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Envoy's heap in use (its admin `/memory`, `allocated`), MiB.
fn heap_mib(stack: &Stack) -> f64 {
    stack
        .envoy
        .admin_get("/memory")
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("allocated")?.as_str()?.parse::<f64>().ok())
        .map_or(0.0, |b| b / MIB as f64)
}

/// The overload manager's heap pressure (percent of the heap bound).
fn heap_pressure(stack: &Stack) -> u64 {
    stack
        .envoy
        .counters("overload.envoy.resource_monitors.fixed_heap.pressure")
        .into_values()
        .next()
        .unwrap_or(0)
}

/// Samples Envoy's resident memory every 50 ms until stopped; the highest seen.
struct RssPeak {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<f64>,
}

impl RssPeak {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let mut peak = rss_mib(pid);
            while !s.load(Ordering::Relaxed) {
                peak = peak.max(rss_mib(pid));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            peak.max(rss_mib(pid))
        });
        Self { stop, task }
    }

    async fn stop(self) -> f64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or(0.0)
    }
}

// ---------------------------------------------------------------------------------------------
// The legitimate client

/// A legitimate client sending a new key every 20 ms (one at a time, keep-alive) until stopped,
/// on a thread and runtime of its own: the attack's thousands of tasks do not delay it here.
struct Legit {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<LegitAnswer>>,
}

impl Legit {
    fn start(stack: &Stack) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let base = stack.envoy.url("");
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let c = Client::impatient(&base, Duration::from_secs(30));
                let mut out = Vec::new();
                while !s.load(Ordering::Relaxed) {
                    let key = unique_key("legit");
                    let t = Instant::now();
                    let (status, upstream_ms) =
                        match c.try_send(checkout(&key, "alice", &charge_body(1))).await {
                            Ok(a) => (
                                a.status,
                                a.header("x-envoy-upstream-service-time")
                                    .and_then(|v| v.parse::<u64>().ok()),
                            ),
                            Err(_) => (0, None),
                        };
                    out.push(LegitAnswer {
                        key,
                        status,
                        took: t.elapsed(),
                        upstream_ms,
                    });
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                out
            })
        });
        Self { stop, thread }
    }

    /// Stops: how many were sent, p50 and p99, and those that did not get 201 (status 0: no
    /// answer).
    async fn finish(self) -> LegitFigures {
        self.stop.store(true, Ordering::Relaxed);
        let answers = tokio::task::spawn_blocking(move || self.thread.join().unwrap_or_default())
            .await
            .unwrap_or_default();
        let failed: Vec<(String, u16)> = answers
            .iter()
            .filter(|a| a.status != 201)
            .map(|a| (a.key.clone(), a.status))
            .collect();
        // The latency of the keys served (a refusal is quick, and says nothing of service).
        let served = || answers.iter().filter(|a| a.status == 201);
        let lat: Vec<Duration> = served().map(|a| a.took).collect();
        let upstream: Vec<Duration> = served()
            .filter_map(|a| a.upstream_ms.map(Duration::from_millis))
            .collect();
        LegitFigures {
            count: answers.len(),
            p50: quantile(&lat, 0.50),
            p99: quantile(&lat, 0.99),
            upstream_p99: quantile(&upstream, 0.99),
            failed,
        }
    }
}

/// One legitimate key's answer: its status (0: none), how long it took, and how much of that
/// the checkout took (`x-envoy-upstream-service-time`).
struct LegitAnswer {
    key: String,
    status: u16,
    took: Duration,
    upstream_ms: Option<u64>,
}

/// The `q` quantile of `values` (zero when there are none).
fn quantile(values: &[Duration], q: f64) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort();
    let at = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
    sorted.get(at).copied().unwrap_or_default()
}

struct LegitFigures {
    count: usize,
    p50: Duration,
    p99: Duration,
    /// The checkout's share of the served keys' time, its p99.
    upstream_p99: Duration,
    failed: Vec<(String, u16)>,
}

impl std::fmt::Display for LegitFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
        for (_, s) in &self.failed {
            *by_status.entry(*s).or_default() += 1;
        }
        write!(
            f,
            "legit {} sent, {} not 201 {by_status:?}, p50 {:?}, p99 {:?} (the checkout's p99 {:?})",
            self.count,
            self.failed.len(),
            self.p50,
            self.p99,
            self.upstream_p99
        )
    }
}

impl LegitFigures {
    /// Every legitimate key served, its p99 within `bound`.
    fn check(&self, attack: &str, bound: Duration) {
        assert!(
            self.failed.is_empty(),
            "during {attack}, legitimate new keys not served: {self}, e.g. {:?}",
            self.failed.iter().take(3).collect::<Vec<_>>()
        );
        assert!(self.count >= 5, "during {attack}, only {self}");
        assert!(
            self.p99 <= bound,
            "during {attack}: {self} (bound {bound:?})"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Raw HTTP/1.1 clients

fn request_head(key: &str, content_length: usize) -> String {
    request_head_of("alice", key, content_length)
}

/// A request's head as `who` (a demo token's subject) sends it.
fn request_head_of(who: &str, key: &str, content_length: usize) -> String {
    request_head_with(&token(who), key, content_length)
}

/// A request's head with `bearer` as its token.
fn request_head_with(bearer: &str, key: &str, content_length: usize) -> String {
    format!(
        "POST /checkout HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer {bearer}\r\ncontent-type: application/json\r\nidempotency-key: {key}\r\ncontent-length: {content_length}\r\n\r\n"
    )
}

/// A charge the checkout takes, padded with a note to exactly `size` bytes.
fn padded_body(size: usize) -> Vec<u8> {
    let head = r#"{"amount":1,"currency":"BRL","card":{"number":"4242424242424242","exp":"12/30"},"note":""#;
    let mut out = head.as_bytes().to_vec();
    out.resize(size - 2, b'n');
    out.extend_from_slice(b"\"}");
    out
}

/// An answer read off a raw connection: its status and body, and whether the connection was
/// closed after it.
#[derive(Debug, Default, Clone)]
struct RawAnswer {
    status: u16,
    body: String,
}

impl RawAnswer {
    fn problem(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v.get("type")?.as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

/// Reads one HTTP/1.1 answer (Content-Length or chunked) from `buf` + `s`; `None` on EOF or
/// error before a whole answer.
async fn read_answer(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<RawAnswer> {
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok());
    let chunked = head.contains("transfer-encoding: chunked");
    loop {
        let body = &buf[head_end..];
        let done = match length {
            Some(l) => body.len() >= l,
            None if chunked => body.ends_with(b"0\r\n\r\n"),
            None => true,
        };
        if done {
            break;
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(RawAnswer {
        status,
        body: String::from_utf8_lossy(&buf[head_end..]).into_owned(),
    })
}

/// Whether Envoy closes `s` within `wait` (EOF or reset), reading and dropping what comes.
async fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    let mut chunk = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What the checkout ran, and the attacked keys sent again

async fn charges_by_key(stack: &Stack) -> BTreeMap<String, usize> {
    let text = reqwest::get(stack.checkout.url("/charges"))
        .await
        .expect("GET /charges")
        .text()
        .await
        .unwrap_or_default();
    let entries: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap_or_default();
    let mut out = BTreeMap::new();
    for e in entries {
        if let Some(k) = e.get("idempotency_key").and_then(|k| k.as_str()) {
            *out.entry(k.to_owned()).or_default() += 1;
        }
    }
    out
}

/// Nothing charged twice, anywhere.
async fn assert_nothing_charged_twice(stack: &Stack) {
    let twice: Vec<_> = charges_by_key(stack)
        .await
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(twice.is_empty(), "charged more than once: {twice:?}");
}

/// None of `keys` ran (`what` names them in the failure).
async fn assert_none_ran(stack: &Stack, keys: &[String], what: &str) {
    let charges = charges_by_key(stack).await;
    let ran: Vec<_> = keys
        .iter()
        .filter(|k| charges.contains_key(*k))
        .take(5)
        .collect();
    assert!(ran.is_empty(), "{what} ran: {ran:?}");
}

/// Each of `keys` (none of which ran) sent again whole, as a client would (again after a second
/// while the edge answers 503 + Retry-After): 201, and one charge.
async fn assert_keys_usable(stack: &Stack, keys: &[String], body_size: usize) {
    let c = Client::new(&stack.envoy.url(""));
    let body = padded_body(body_size);
    let mut bad = Vec::new();
    for group in keys.chunks(16) {
        let mut tasks = Vec::new();
        for key in group {
            let c = c.clone();
            let body = body.clone();
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                let mut status = 0;
                for _ in 0..5 {
                    let req = checkout(&key, "alice", &serde_json::Value::Null).body(body.clone());
                    status = c.try_send(req).await.map(|a| a.status).unwrap_or(0);
                    if status != 503 && status != 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                (key, status)
            }));
        }
        for t in tasks {
            let (key, status) = t.await.expect("task");
            if status != 201 {
                bad.push((key, status));
            }
        }
    }
    let after = charges_by_key(stack).await;
    let not_once: Vec<_> = keys
        .iter()
        .filter(|k| after.get(*k).copied().unwrap_or(0) != 1)
        .take(5)
        .collect();
    assert!(
        bad.is_empty() && not_once.is_empty(),
        "attacked keys sent again whole: {} not 201 (e.g. {:?}); {} not charged exactly once (e.g. {not_once:?})",
        bad.len(),
        bad.iter().take(5).collect::<Vec<_>>(),
        not_once.len()
    );
}

fn report(attack: &str, figures: &str) {
    eprintln!("hostile-load {attack}: {figures}");
}

// ---------------------------------------------------------------------------------------------
// The attacks

/// A request refused before its body ended (body too large, key missing or invalid, no token,
/// buffers full) closes its connection: Envoy answers with `connection: close` and closes, so
/// what the client still sends is never read, let alone held (issue 49, item 2). The codec does
/// it for any answer that comes before the request is whole (HTTP/1.1).
async fn refusals_close_their_connection(stack: Arc<Stack>) {
    let target = envoy_addr(&stack);
    let before = stack
        .envoy
        .counter("http.edge.downstream_rq_response_before_rq_complete");
    let too_large = 2 * MIB;
    let key = unique_key("refused");
    let cases: Vec<(&str, String, u16)> = vec![
        ("body too large", request_head(&key, too_large), 413),
        ("key invalid", request_head(&"k".repeat(300), MIB), 400),
        (
            "key missing",
            request_head(&key, MIB).replace(&format!("idempotency-key: {key}\r\n"), ""),
            400,
        ),
        (
            "no token",
            request_head(&key, MIB)
                .replace(&format!("authorization: Bearer {}\r\n", token("alice")), ""),
            401,
        ),
    ];
    let mut figures = Vec::new();
    for (name, head, status) in &cases {
        let mut s = TcpStream::connect(target).await.expect("connect");
        s.write_all(head.as_bytes()).await.expect("headers");
        // The first 64 KiB of the body, then the client would go on.
        let _ = s.write_all(&padded_body(MIB)[..64 * 1024]).await;
        let mut buf = Vec::new();
        let a = tokio::time::timeout(Duration::from_secs(5), read_answer(&mut s, &mut buf))
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| panic!("{name}: no answer"));
        let head_text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
        let close_header = head_text.contains("\r\nconnection: close\r\n");
        let closed = closed_within(&mut s, Duration::from_secs(2)).await;
        figures.push(format!(
            "{name}: {} connection: close {close_header}, closed {closed}",
            a.status
        ));
        assert_eq!(a.status, *status, "{name}: {a:?}");
        assert!(close_header && closed, "{name}: {}", figures.join("; "));
    }
    let after = stack
        .envoy
        .counter("http.edge.downstream_rq_response_before_rq_complete");
    report(
        "refusals",
        &format!(
            "{}; downstream_rq_response_before_rq_complete +{}",
            figures.join("; "),
            after - before
        ),
    );
    assert!(after - before >= cases.len() as u64);
    // The key refused for its size, sent whole within the limit: 201, once.
    assert_keys_usable(&stack, &[key], 1_000).await;
}

/// 500 clients each send a 1 MiB body but its last byte and hold it; then finish.
async fn burst(stack: Arc<Stack>) {
    let n = sizes().burst;
    let pid = envoy_pid(&stack);
    let target = envoy_addr(&stack);
    // Warm: the VM and the pools at their working size before the idle figure.
    let c = Client::new(&stack.envoy.url(""));
    for _ in 0..20 {
        c.send(checkout(&unique_key("warm"), "alice", &charge_body(1)))
            .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_idle, heap_idle) = (rss_mib(pid), heap_mib(&stack));
    let peak = RssPeak::start(pid);
    let legit = Legit::start(&stack);
    let body = Arc::new(padded_body(MIB));
    let held = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let open = Arc::new(AtomicBool::new(false));
    let prefix = unique_key("burst");
    // Eight callers, so that together they fill the filter's whole bound but its reserve (each
    // may hold a quarter of it: `max_buffered_bytes_per_subject`).
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        + 86_400;
    let bearers: Vec<String> = (0..8)
        .map(|i| mint_token(&format!("burst-{i}"), exp))
        .collect();
    let mut tasks = Vec::new();
    for i in 0..n {
        let (body, held, gate, open) = (body.clone(), held.clone(), gate.clone(), open.clone());
        let key = format!("{prefix}-{i}");
        let head = request_head_with(&bearers[i % bearers.len()], &key, body.len());
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(target).await.ok()?;
            s.write_all(head.as_bytes()).await.ok()?;
            let mut buf = Vec::new();
            let last = body.len() - 1;
            // The body but its last byte, unless Envoy answers first (a refusal at the headers).
            let early = {
                let (mut r, mut w) = s.split();
                let mut chunk = [0u8; 4096];
                tokio::select! {
                    res = w.write_all(&body[..last]) => { res.ok()?; None }
                    got = r.read(&mut chunk) => {
                        let n = got.ok()?;
                        buf.extend_from_slice(&chunk[..n]);
                        Some(())
                    }
                }
            };
            held.fetch_add(1, Ordering::SeqCst);
            while !open.load(Ordering::SeqCst) {
                let _ = tokio::time::timeout(Duration::from_millis(200), gate.notified()).await;
            }
            // An answer already there: a refusal before the body ended.
            let mut chunk = [0u8; 4096];
            let early = match (early, s.try_read(&mut chunk)) {
                (Some(()), _) => Some(()),
                (None, Ok(n)) if n > 0 => {
                    buf.extend_from_slice(&chunk[..n]);
                    Some(())
                }
                _ => None,
            };
            let answer = if early.is_some() {
                let a = read_answer(&mut s, &mut buf).await?;
                let closed = closed_within(&mut s, Duration::from_secs(2)).await;
                (a, true, closed)
            } else {
                s.write_all(&body[last..]).await.ok()?;
                (read_answer(&mut s, &mut buf).await?, false, false)
            };
            Some((key, answer))
        }));
    }
    let t0 = Instant::now();
    while held.load(Ordering::SeqCst) < n && t0.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let held_at_once = held.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss_held, heap_held) = (rss_mib(pid), heap_mib(&stack));
    let pressure_held = heap_pressure(&stack);
    open.store(true, Ordering::SeqCst);
    gate.notify_waiters();
    let mut by_class: BTreeMap<String, usize> = BTreeMap::new();
    let mut refused_keys = Vec::new();
    let (mut early, mut closed) = (0, 0);
    for t in tasks {
        match t.await.expect("task") {
            Some((key, (a, was_early, was_closed))) => {
                early += usize::from(was_early);
                closed += usize::from(was_closed);
                let class = format!(
                    "{} {}",
                    a.status,
                    a.problem().trim_start_matches("/problems/")
                );
                if a.status != 201 {
                    refused_keys.push(key);
                }
                *by_class.entry(class).or_default() += 1;
            }
            None => *by_class.entry("transport error".into()).or_default() += 1,
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let legit = legit.finish().await;
    let peak = peak.stop().await;
    let growth = peak - rss_idle;
    report(
        "burst",
        &format!(
            "{n} x 1 MiB, {held_at_once} held at once in {seconds:.1} s; answers {by_class:?}; \
             {early} answered before their body ended, {closed} of them closed by Envoy; Envoy RSS \
             {rss_idle:.1} MiB idle, {rss_held:.1} held, peak {peak:.1} (+{growth:.1}; budget \
             {BUDGET_MIB}); heap {heap_idle:.1} -> {heap_held:.1} MiB ({pressure_held} % of the bound); {legit}"
        ),
    );
    assert!(
        by_class
            .keys()
            .all(|k| k.starts_with("201") || k.starts_with("503 edge-buffers-full")),
        "the burst got other answers than 201 and 503 edge-buffers-full: {by_class:?}"
    );
    assert!(
        growth <= BUDGET_MIB,
        "Envoy grew {growth:.1} MiB in the burst, over its budget of {BUDGET_MIB} MiB"
    );
    // The held bodies fill the filter's bound but its reserve, which a caller who holds little
    // still gets into: every legitimate key is served.
    legit.check("the burst", BURST_P99_BOUND);
    // What is left of it is the edge's: the checkout answers the legitimate key at once, though
    // it runs the 35 held charges too (it waited behind their hashes under its lock: 440-574 ms).
    assert!(
        legit.upstream_p99 <= BURST_UPSTREAM_P99_BOUND,
        "during the burst the checkout held up the legitimate keys: {legit}"
    );
    assert_nothing_charged_twice(&stack).await;
    assert_keys_usable(&stack, &refused_keys, MIB).await;
}

/// Many connections opened and left silent: Envoy closes them at the idle timeout.
async fn idle_connections(stack: Arc<Stack>) {
    let n = sizes().idle;
    let pid = envoy_pid(&stack);
    let target = envoy_addr(&stack);
    let rss_before = rss_mib(pid);
    let peak = RssPeak::start(pid);
    let legit = Legit::start(&stack);
    let t0 = Instant::now();
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        match TcpStream::connect(target).await {
            Ok(s) => conns.push(s),
            Err(e) => panic!("connection {} of {n} refused: {e}", conns.len()),
        }
    }
    let opened = t0.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_open = rss_mib(pid);
    let accepted = stack.envoy.counter("http.edge.downstream_cx_active");
    let (heap_open, pressure_open) = (heap_mib(&stack), heap_pressure(&stack));
    // All closed by Envoy within the idle timeout and a margin.
    let closing = conns.into_iter().map(|mut s| {
        tokio::spawn(async move {
            closed_within(&mut s, Duration::from_millis(IDLE_TIMEOUT_MS + 5_000)).await
        })
    });
    let mut still_open = 0;
    for t in closing.collect::<Vec<_>>() {
        still_open += usize::from(!t.await.unwrap_or(false));
    }
    let closed_after = t0.elapsed();
    let overload = overload_counters(&stack);
    let legit = legit.finish().await;
    let peak = peak.stop().await;
    let per_conn_kib = (rss_open - rss_before).max(0.0) * 1024.0 / n as f64;
    report(
        "idle",
        &format!(
            "{n} idle connections opened in {opened:?} ({accepted} active in Envoy), all closed by {closed_after:?} ({still_open} \
             left open); Envoy RSS {rss_before:.1} -> {rss_open:.1} MiB with them open ({per_conn_kib:.1} \
             KiB each), peak {peak:.1}; heap {heap_open:.1} MiB ({pressure_open} % of the bound); Envoy's counters {overload:?}; {legit}"
        ),
    );
    assert_eq!(
        still_open, 0,
        "idle connections Envoy left open past its idle timeout"
    );
    assert!(
        per_conn_kib <= 16.0,
        "an idle connection costs Envoy {per_conn_kib:.1} KiB"
    );
    assert!(
        peak - rss_before <= BUDGET_MIB,
        "Envoy grew {:.1} MiB with the idle connections, over its budget of {BUDGET_MIB} MiB",
        peak - rss_before
    );
    legit.check("the idle connections", P99_BOUND);
    assert_nothing_charged_twice(&stack).await;
}

/// Clients that send their body a byte a second, and clients that send their headers so:
/// cut with 408 before they end, no claim made, their keys usable after.
async fn slow_clients(stack: Arc<Stack>) {
    let s = sizes();
    let pid = envoy_pid(&stack);
    let target = envoy_addr(&stack);
    let request_timeout = Duration::from_millis(edge::render::request_timeout_ms(
        &stack.envoy.params.edge_config().expect("config"),
    ));
    let rss_before = rss_mib(pid);
    let peak = RssPeak::start(pid);
    let legit = Legit::start(&stack);
    let prefix = unique_key("slow");
    let body = Arc::new(padded_body(200));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..s.slow_body + s.slow_headers {
        let slow_headers = i >= s.slow_body;
        let key = format!("{prefix}-{i}");
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let mut st = TcpStream::connect(target).await.ok()?;
            let head = request_head(&key, body.len());
            let (first, trickle): (&[u8], &[u8]) = if slow_headers {
                (&head.as_bytes()[..20], &head.as_bytes()[20..])
            } else {
                st.write_all(head.as_bytes()).await.ok()?;
                (&body[..1], &body[1..])
            };
            st.write_all(first).await.ok()?;
            let mut buf = Vec::new();
            let mut next = 0;
            let answer = loop {
                let mut chunk = [0u8; 4096];
                tokio::select! {
                    got = st.read(&mut chunk) => {
                        match got {
                            Ok(0) | Err(_) => break None,
                            Ok(n) => { buf.extend_from_slice(&chunk[..n]); break Some(()) }
                        }
                    }
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {
                        if next < trickle.len() {
                            if st.write_all(&trickle[next..next + 1]).await.is_err() { break None; }
                            next += 1;
                        }
                    }
                }
            };
            let status = match answer {
                Some(()) => read_answer(&mut st, &mut buf).await.map_or(0, |a| a.status),
                None => 0,
            };
            let closed = closed_within(&mut st, Duration::from_secs(2)).await;
            Some((key, slow_headers, status, closed, started.elapsed()))
        }));
    }
    let mut by_class: BTreeMap<String, usize> = BTreeMap::new();
    let mut keys = Vec::new();
    let mut slowest = Duration::ZERO;
    for t in tasks {
        match t.await.expect("task") {
            Some((key, slow_headers, status, closed, took)) => {
                let class = format!(
                    "{} {status}{}",
                    if slow_headers { "headers" } else { "body" },
                    if closed { " closed" } else { " left open" }
                );
                *by_class.entry(class).or_default() += 1;
                slowest = slowest.max(took);
                keys.push(key);
            }
            None => *by_class.entry("transport error".into()).or_default() += 1,
        }
    }
    let legit = legit.finish().await;
    let peak = peak.stop().await;
    report(
        "slow",
        &format!(
            "{} slow-body and {} slow-header clients: {by_class:?}, the last cut after {slowest:?} \
             (request_timeout {request_timeout:?}, headers {HEADERS_TIMEOUT_MS} ms) in {:?}; Envoy \
             RSS {rss_before:.1} -> peak {peak:.1} MiB; {legit}",
            s.slow_body,
            s.slow_headers,
            t0.elapsed()
        ),
    );
    let expected = [
        ("body 408 closed".to_owned(), s.slow_body),
        ("headers 408 closed".to_owned(), s.slow_headers),
    ];
    assert_eq!(
        by_class,
        expected.into_iter().collect::<BTreeMap<_, _>>(),
        "slow clients: each cut with 408 and its connection closed"
    );
    assert!(
        slowest <= request_timeout + Duration::from_secs(5),
        "a slow client held on for {slowest:?}"
    );
    assert!(
        peak - rss_before <= BUDGET_MIB,
        "Envoy grew {:.1} MiB with the slow clients",
        peak - rss_before
    );
    legit.check("the slow clients", P99_BOUND);
    // A body never finished never claims: none ran, and each key is usable.
    let charges = charges_by_key(&stack).await;
    let ran: Vec<_> = keys.iter().filter(|k| charges.contains_key(*k)).collect();
    assert!(ran.is_empty(), "slow clients' keys that ran: {ran:?}");
    assert_keys_usable(&stack, &keys, 200).await;
}

/// `request_timeout` never fires once the client has sent its whole request, even while the
/// filter holds it before forwarding: a retry (`Prefer: wait`) of a running key whose last byte
/// comes 3 s before its `request_timeout` waits past it for the first attempt, and gets that
/// attempt's answer replayed; charged once. Envoy's documentation says the timer runs until the
/// last byte goes upstream (with this filter: after the claim, or the wait); measured on 1.40,
/// it stops when the last byte comes from the client, and `edge render` relies on it
/// (`edge::render::request_timeout_ms`).
async fn request_timeout_while_the_filter_waits(stack: Arc<Stack>) {
    let target = envoy_addr(&stack);
    let request_timeout = Duration::from_millis(edge::render::request_timeout_ms(
        &stack.envoy.params.edge_config().expect("config"),
    ));
    let key = unique_key("timeout-in-wait");
    let body = padded_body(200);
    let c = Client::new(&stack.envoy.url(""));
    // The first attempt: the checkout takes long enough for the retry to wait through its
    // request_timeout.
    let first_req = checkout(&key, "alice", &serde_json::Value::Null)
        .body(body.clone())
        .delay_ms(request_timeout.as_millis() as u64 + 6_000);
    let first = {
        let c = c.clone();
        tokio::spawn(async move { c.send(first_req).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The retry: its body but the last byte at once, the last byte 3 s before its
    // request_timeout, then it waits for the running key (about 9 s, past the timeout).
    let started = Instant::now();
    let mut s = TcpStream::connect(target).await.expect("connect");
    let head = request_head(&key, body.len()).replacen(
        "host: edge\r\n",
        "host: edge\r\nprefer: wait=10\r\n",
        1,
    );
    s.write_all(head.as_bytes()).await.expect("headers");
    s.write_all(&body[..body.len() - 1]).await.expect("body");
    tokio::time::sleep(request_timeout.saturating_sub(Duration::from_secs(3))).await;
    s.write_all(&body[body.len() - 1..])
        .await
        .expect("last byte");
    let mut buf = Vec::new();
    let retry = read_answer(&mut s, &mut buf).await.map_or(0, |a| a.status);
    let retry_took = started.elapsed();
    let first = first.await.expect("first");
    let charges = charges_by_key(&stack).await.get(&key).copied().unwrap_or(0);
    let again = c
        .send(checkout(&key, "alice", &serde_json::Value::Null).body(body.clone()))
        .await;
    report(
        "timeout-in-wait",
        &format!(
            "the retry got {retry} after {retry_took:?} (request_timeout {request_timeout:?}); the \
             first {}; charges {charges}; sent again: {} replayed {:?}",
            first.status,
            again.status,
            again.header("idempotent-replayed")
        ),
    );
    assert_eq!(
        retry, 201,
        "the retry waits past its request_timeout for the running key (no 408, no cut)"
    );
    assert!(
        retry_took > request_timeout + Duration::from_secs(2),
        "the retry's wait went past request_timeout: {retry_took:?}"
    );
    assert_eq!(
        first.status,
        201,
        "the first attempt completes: {}",
        first.describe()
    );
    assert_eq!(charges, 1, "charged once");
    assert_eq!(
        (again.status, again.header("idempotent-replayed").as_deref()),
        (201, Some("true")),
        "the key replays: {}",
        again.describe()
    );
}

/// Requests with headers at and over Envoy's limit (60 KiB), as fast as the flood's clients
/// can send them, each on a new connection.
async fn header_flood(stack: Arc<Stack>) {
    let s = sizes();
    let pid = envoy_pid(&stack);
    let target = envoy_addr(&stack);
    let rss_before = rss_mib(pid);
    let peak = RssPeak::start(pid);
    let legit = Legit::start(&stack);
    let prefix = unique_key("flood");
    let until = Instant::now() + Duration::from_secs(s.flood_secs);
    let mut tasks = Vec::new();
    for c in 0..s.flood_clients {
        let prefix = prefix.clone();
        tasks.push(tokio::spawn(async move {
            let mut out: BTreeMap<u16, usize> = BTreeMap::new();
            let mut keys = Vec::new();
            let mut i = 0;
            while Instant::now() < until {
                i += 1;
                let key = format!("{prefix}-{c}-{i}");
                // Half over the limit (100 headers of 700 bytes), half many small ones.
                let extra: String = if i % 2 == 0 {
                    (0..100)
                        .map(|h| format!("x-flood-{h}: {}\r\n", "v".repeat(700)))
                        .collect()
                } else {
                    (0..95).map(|h| format!("x-f{h}: v\r\n")).collect()
                };
                let head = request_head(&key, 2).replacen(
                    "host: edge\r\n",
                    &format!("host: edge\r\n{extra}"),
                    1,
                );
                let Ok(mut st) = TcpStream::connect(target).await else {
                    *out.entry(1).or_default() += 1;
                    continue;
                };
                if st.write_all(head.as_bytes()).await.is_err() {
                    *out.entry(2).or_default() += 1;
                    continue;
                }
                // Its body never comes: the headers are what the flood is.
                let mut buf = Vec::new();
                let status = tokio::time::timeout(
                    Duration::from_millis(300),
                    read_answer(&mut st, &mut buf),
                )
                .await
                .ok()
                .flatten()
                .map_or(0, |a| a.status);
                *out.entry(status).or_default() += 1;
                keys.push(key);
            }
            (out, keys)
        }));
    }
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    let mut keys = Vec::new();
    for t in tasks {
        let (out, k) = t.await.expect("task");
        for (s, n) in out {
            *by_status.entry(s).or_default() += n;
        }
        keys.extend(k);
    }
    let legit = legit.finish().await;
    let peak = peak.stop().await;
    report(
        "flood",
        &format!(
            "{} clients for {} s: {} requests, by status {by_status:?} (0: no answer in 300 ms, \
             the body never sent); Envoy RSS {rss_before:.1} -> peak {peak:.1} MiB; {legit}",
            s.flood_clients,
            s.flood_secs,
            keys.len()
        ),
    );
    legit.check("the header flood", P99_BOUND);
    assert!(
        peak - rss_before <= BUDGET_MIB,
        "Envoy grew {:.1} MiB in the header flood",
        peak - rss_before
    );
    assert_none_ran(&stack, &keys, "flood keys").await;
    assert_nothing_charged_twice(&stack).await;
}

/// One caller (bob) opens many requests that declare the largest body (1 MiB) and send it a
/// byte a second. Before `max_buffered_bytes_per_subject`, 40 of them held the filter's whole
/// bound until their body timeout, and every other caller's new key was refused (207 of 238,
/// `503 edge-buffers-full`). Now bob holds his share of the bound (a quarter by default): the
/// rest of his requests are refused at once, and alice's new keys are all served meanwhile.
async fn one_subject_s_slow_large_bodies(stack: Arc<Stack>) {
    let target = envoy_addr(&stack);
    let cfg = stack.envoy.params.edge_config().expect("config");
    let bound = edge::render::max_buffered_bytes(&cfg);
    let share = edge::render::max_buffered_bytes_per_subject(&cfg);
    // Enough of bob's requests to take the whole bound of every worker, and some.
    let workers = u64::from(cfg.envoy_workers.max(1));
    let clients = (bound * workers / MIB as u64 + 8) as usize;
    let refused_before = stack.envoy.filter_counter("subject_buffers_full_503");
    let legit = Legit::start(&stack);
    let prefix = unique_key("bob-slow");
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let key = format!("{prefix}-{i}");
        tasks.push(tokio::spawn(async move {
            let mut st = TcpStream::connect(target).await.ok()?;
            st.write_all(request_head_of("bob", &key, MIB).as_bytes())
                .await
                .ok()?;
            let mut buf = Vec::new();
            let answer = loop {
                let mut chunk = [0u8; 4096];
                tokio::select! {
                    got = st.read(&mut chunk) => match got {
                        Ok(0) | Err(_) => break None,
                        Ok(n) => { buf.extend_from_slice(&chunk[..n]); break Some(()) }
                    },
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {
                        if st.write_all(b" ").await.is_err() { break None; }
                    }
                }
            };
            let answer = match answer {
                Some(()) => read_answer(&mut st, &mut buf).await.unwrap_or_default(),
                None => RawAnswer::default(),
            };
            Some((key, answer))
        }));
    }
    let mut by_class: BTreeMap<String, usize> = BTreeMap::new();
    let mut keys = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            Some((key, a)) => {
                *by_class
                    .entry(format!("{} {}", a.status, a.problem()))
                    .or_default() += 1;
                keys.push(key);
            }
            None => *by_class.entry("transport error".into()).or_default() += 1,
        }
    }
    let legit = legit.finish().await;
    report(
        "one subject's slow large bodies",
        &format!(
            "{clients} x 1 MiB declared by bob, a byte a second (bound {} MiB, a subject's share {} MiB, {workers} worker(s)): {by_class:?} in {:?}; {legit}",
            bound >> 20,
            share >> 20,
            t0.elapsed()
        ),
    );
    let held = by_class
        .iter()
        .filter(|(class, _)| class.starts_with("408"))
        .map(|(_, n)| *n)
        .sum::<usize>();
    let refused = by_class
        .get("503 /problems/edge-buffers-full")
        .copied()
        .unwrap_or(0);
    assert_eq!(
        held + refused,
        clients,
        "bob's requests: each held until its body timeout (408) or refused at once: {by_class:?}"
    );
    assert!(
        held > 0 && held as u64 <= workers * share / MIB as u64,
        "bob held none, or more than his share: {held} x 1 MiB, share {share} bytes a worker"
    );
    // Refused by his share, not by a full worker.
    assert_eq!(
        stack.envoy.filter_counter("subject_buffers_full_503") - refused_before,
        refused as u64,
        "bob's refusals, as the filter counts them"
    );
    legit.check("one subject's slow large bodies", P99_BOUND);
    let charges = charges_by_key(&stack).await;
    let ran: Vec<_> = keys.iter().filter(|k| charges.contains_key(*k)).collect();
    assert!(ran.is_empty(), "bob's unfinished keys that ran: {ran:?}");
    // His share is his again once they are gone: a key of his sent whole runs once.
    let c = Client::new(&stack.envoy.url(""));
    let again = c
        .send(checkout(&keys[0], "bob", &serde_json::Value::Null).body(padded_body(MIB)))
        .await;
    assert_eq!(again.status, 201, "bob's key sent again whole");
}

/// Envoy's counters the reset attack reports: its resets and connections, and the filter's
/// claims (how many of the streams reset after a whole body were claimed and given back).
const RESET_COUNTERS: &str = "^http.edge.downstream_(rq_rx_reset|cx_http2_total|rq_too_many_premature_resets)$|^http2\\.rx_reset$|^wasmcustom.idempotency.(claimed|claimed_for_ended_stream|claims_abandoned|released|claim_batches)$";

/// The counters that moved between two readings of Envoy's counters, and by how much.
fn counters_moved(
    now: &BTreeMap<String, u64>,
    before: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    now.iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// How far the filter's counter `idempotency.<name>` moved between two readings of Envoy's
/// counters.
fn filter_moved(now: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>, name: &str) -> u64 {
    let name = format!("wasmcustom.idempotency.{name}");
    let at = |c: &BTreeMap<String, u64>| c.get(&name).copied().unwrap_or(0);
    at(now).saturating_sub(at(before))
}

/// What one HTTP/2 connection of the reset attack did.
#[derive(Default)]
struct ResetFigures {
    connections: usize,
    streams: usize,
    /// Keys whose body was sent whole before the reset, and those whose body never ended.
    whole: Vec<String>,
    unfinished: Vec<String>,
}

/// HTTP/2 streams opened and reset at once ("rapid reset", CVE-2023-44487), over h2c, as fast
/// as the attack's connections can: half reset after their headers (their body never comes),
/// half right after a whole body. A connection Envoy closes is opened again.
async fn http2_rapid_reset(stack: Arc<Stack>) {
    let s = sizes();
    let pid = envoy_pid(&stack);
    let target = envoy_addr(&stack);
    let rss_before = rss_mib(pid);
    let peak = RssPeak::start(pid);
    let counters_before = stack.envoy.counters(RESET_COUNTERS);
    let legit = Legit::start(&stack);
    let prefix = unique_key("reset");
    let bearer = token("alice");
    let body = bytes::Bytes::from(padded_body(256));
    let until = Instant::now() + Duration::from_secs(s.reset_secs);
    let mut tasks = Vec::new();
    for c in 0..s.reset_connections {
        let (prefix, bearer, body) = (prefix.clone(), bearer.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut f = ResetFigures::default();
            let mut i = 0;
            while Instant::now() < until {
                let Ok(tcp) = TcpStream::connect(target).await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let Ok((client, connection)) = h2::client::handshake(tcp).await else {
                    continue;
                };
                f.connections += 1;
                let driver = tokio::spawn(connection);
                let mut client = client;
                while Instant::now() < until {
                    // Bounded: a connection whose streams Envoy stopped taking is left.
                    client = match tokio::time::timeout_at(until.into(), client.ready()).await {
                        Ok(Ok(ready)) => ready,
                        _ => break,
                    };
                    i += 1;
                    let key = format!("{prefix}-{c}-{i}");
                    let request = http::Request::post(format!("http://edge{}", "/checkout"))
                        .header("authorization", format!("Bearer {bearer}"))
                        .header("content-type", "application/json")
                        .header("idempotency-key", &key)
                        .header("content-length", body.len().to_string())
                        .body(())
                        .expect("request");
                    let Ok((answer, mut stream)) = client.send_request(request, false) else {
                        break;
                    };
                    let whole = i % 2 == 0;
                    if whole {
                        let _ = stream.send_data(body.clone(), true);
                        f.whole.push(key);
                    } else {
                        f.unfinished.push(key);
                    }
                    stream.send_reset(h2::Reason::CANCEL);
                    drop(answer);
                    f.streams += 1;
                    // Let the connection's task write what was queued.
                    if i % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                driver.abort();
            }
            f
        }));
    }
    let mut all = ResetFigures::default();
    for t in tasks {
        let f = t.await.expect("task");
        all.connections += f.connections;
        all.streams += f.streams;
        all.whole.extend(f.whole);
        all.unfinished.extend(f.unfinished);
    }
    let legit = legit.finish().await;
    let peak = peak.stop().await;
    let counters = stack.envoy.counters(RESET_COUNTERS);
    let moved = counters_moved(&counters, &counters_before);
    report(
        "rapid-reset",
        &format!(
            "{} HTTP/2 connections for {} s: {} streams opened and reset ({} after a whole body), \
             over {} connections; Envoy's counters {moved:?}; Envoy RSS {rss_before:.1} -> peak \
             {peak:.1} MiB; {legit}",
            s.reset_connections,
            s.reset_secs,
            all.streams,
            all.whole.len(),
            all.connections
        ),
    );
    assert!(
        all.unfinished.len() >= 20 && all.whole.len() >= 20,
        "too few streams to judge: {} unfinished, {} whole",
        all.unfinished.len(),
        all.whole.len()
    );
    assert!(
        filter_moved(&counters, &counters_before, "claimed") > 0,
        "no claim at all: {moved:?}"
    );
    legit.check("the HTTP/2 rapid reset", RESET_P99_BOUND);
    assert!(
        legit.p50 <= RESET_P50_BOUND,
        "during the HTTP/2 rapid reset: {legit} (p50 bound {RESET_P50_BOUND:?})"
    );
    assert!(
        peak - rss_before <= BUDGET_MIB,
        "Envoy grew {:.1} MiB in the rapid reset",
        peak - rss_before
    );
    // A claim granted for a stream already reset is given back (stored as released).
    let given_back = |c: &BTreeMap<String, u64>| {
        (
            filter_moved(c, &counters_before, "claimed_for_ended_stream"),
            filter_moved(c, &counters_before, "released"),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut granted, mut released) = given_back(&counters);
    while released < granted && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        (granted, released) = given_back(&stack.envoy.counters(RESET_COUNTERS));
    }
    assert!(
        released >= granted,
        "claims granted for reset streams not given back: {granted} granted, {released} released"
    );
    // A body never finished never claims, and its key stays usable.
    let charges = charges_by_key(&stack).await;
    let ran: Vec<_> = all
        .unfinished
        .iter()
        .filter(|k| charges.contains_key(*k))
        .take(5)
        .collect();
    assert!(ran.is_empty(), "keys whose body never ended ran: {ran:?}");
    let sample: Vec<String> = all
        .unfinished
        .iter()
        .step_by(all.unfinished.len() / 20)
        .take(20)
        .cloned()
        .collect();
    assert_keys_usable(&stack, &sample, 256).await;
    // A stream reset after its whole body may have been claimed and even forwarded: sent again,
    // its key runs once (201, or the first run replayed) or is held as an outcome nobody saw
    // (409 outcome-unknown); never twice. Every key that reached the checkout, and a sample of
    // the others.
    let forwarded: Vec<&String> = all
        .whole
        .iter()
        .filter(|k| charges.contains_key(*k))
        .collect();
    let keys: Vec<&String> = forwarded
        .iter()
        .copied()
        .chain(all.whole.iter().step_by(all.whole.len() / 20).take(20))
        .collect();
    let c = Client::new(&stack.envoy.url(""));
    let mut again: BTreeMap<String, usize> = BTreeMap::new();
    for key in keys {
        // A claim of a reset stream may still be on its way back: wait it out.
        let mut class = String::new();
        for _ in 0..50 {
            let a = c
                .send(checkout(key, "alice", &serde_json::Value::Null).body(padded_body(256)))
                .await;
            class = format!("{} {}", a.status, a.problem_type().unwrap_or_default());
            if !class.ends_with("request-in-progress") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        *again.entry(class).or_default() += 1;
    }
    report(
        "rapid-reset",
        &format!(
            "{} of the keys reset after a whole body reached the checkout; sent again: {again:?}; \
             claims granted for reset streams {granted}, released {released}",
            forwarded.len()
        ),
    );
    assert!(
        again
            .keys()
            .all(|k| k.starts_with("201") || k.starts_with("409 /problems/outcome-unknown")),
        "keys reset after their whole body, sent again: {again:?}"
    );
    assert_nothing_charged_twice(&stack).await;
}

// ---------------------------------------------------------------------------------------------
// HTTP/2 control frames and readers that never read

/// The HTTP/2 connection preface (RFC 9113, 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// One HTTP/2 frame: its 9-byte header and payload.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The control frames a flood sends: those Envoy must answer (PING and SETTINGS, each
/// acknowledged), and one it only counts (a connection's WINDOW_UPDATE).
#[derive(Clone, Copy, Debug)]
enum ControlFrame {
    Ping,
    Settings,
    WindowUpdate,
}

impl ControlFrame {
    const ALL: [ControlFrame; 3] = [Self::Ping, Self::Settings, Self::WindowUpdate];

    fn frame(self) -> Vec<u8> {
        match self {
            Self::Ping => h2_frame(0x6, 0, 0, &[0; 8]),
            Self::Settings => h2_frame(0x4, 0, 0, &[]),
            Self::WindowUpdate => h2_frame(0x8, 0, 0, &1u32.to_be_bytes()),
        }
    }
}

/// What one flooding client did.
#[derive(Debug, Default)]
struct FloodEnd {
    /// Connections opened: one closed by Envoy while written to is opened again.
    connections: usize,
    frames: u64,
    /// Connections Envoy closed while they were being written to (its flood limits).
    closed_while_flooding: usize,
    /// Whether the connection open when the flood's time was up was closed by the end of the
    /// drain that follows (by then an idle connection's timeout has passed).
    last_closed: bool,
}

/// What a flood writes on each of its connections: an opening (given the connection's number,
/// counted from 0 for each client) and then `batch`, `frames_per_batch` frames, again and again.
struct FloodFrames {
    opening: Box<dyn Fn(usize) -> Vec<u8> + Send + Sync>,
    batch: Vec<u8>,
    frames_per_batch: u64,
}

impl FloodFrames {
    /// `frame` repeated, `per_batch` of them a write, after `opening`.
    fn repeating(
        opening: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static,
        frame: &[u8],
        per_batch: usize,
    ) -> Self {
        Self {
            opening: Box::new(opening),
            batch: frame.repeat(per_batch),
            frames_per_batch: per_batch as u64,
        }
    }

    /// `kind`'s control frames, 1,024 a batch, after the connection preface.
    fn control(kind: ControlFrame) -> Self {
        Self::repeating(|_| h2_hello(), &kind.frame(), 1_024)
    }
}

/// The client's connection preface and its (empty) SETTINGS.
fn h2_hello() -> Vec<u8> {
    let mut hello = H2_PREFACE.to_vec();
    hello.extend(h2_frame(0x4, 0, 0, &[]));
    hello
}

/// One client's flood of `frames` until `until`, never reading what Envoy answers, on a new
/// connection whenever Envoy closes one; then what Envoy sent on the last is read until it
/// closes it or `drain` has passed.
async fn flood(
    target: SocketAddr,
    frames: Arc<FloodFrames>,
    until: Instant,
    drain: Duration,
) -> FloodEnd {
    let mut end = FloodEnd::default();
    while Instant::now() < until {
        let Ok(mut s) = TcpStream::connect(target).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let opening = (frames.opening)(end.connections);
        end.connections += 1;
        // A write that blocks (Envoy stopped reading) is left when the flood's time is up:
        // the frame it cut is never finished, which Envoy can only wait for.
        let mut sent = 0;
        let writes = async {
            if s.write_all(&opening).await.is_err() {
                return true;
            }
            loop {
                if Instant::now() >= until {
                    return false;
                }
                if s.write_all(&frames.batch).await.is_err() {
                    return true;
                }
                sent += frames.frames_per_batch;
                tokio::task::yield_now().await;
            }
        };
        let closed = tokio::time::timeout_at(until.into(), writes)
            .await
            .unwrap_or(false);
        end.frames += sent;
        if closed {
            end.closed_while_flooding += 1;
            continue;
        }
        let mut sink = vec![0u8; 64 * 1024];
        let drained = tokio::time::timeout(drain, async {
            loop {
                match s.read(&mut sink).await {
                    Ok(0) | Err(_) => return true,
                    Ok(_) => {}
                }
            }
        })
        .await;
        end.last_closed = drained.unwrap_or(false);
        return end;
    }
    end.last_closed = true;
    end
}

/// What the floods share: Envoy measured around them, a legitimate client beside them, and
/// the checks every flood makes.
struct FloodAttack {
    stack: Arc<Stack>,
    rss_before: f64,
    peak: RssPeak,
    counters: &'static str,
    counters_before: BTreeMap<String, u64>,
    legit: Legit,
}

/// What a flood's clients did, by the kind of frame each sent, and Envoy's counters that moved.
struct FloodTally {
    /// (connections, frames sent, connections Envoy closed while flooding) by kind.
    by_kind: BTreeMap<String, (usize, u64, usize)>,
    /// Each client's end, in the order the clients were given.
    ends: Vec<FloodEnd>,
    moved: BTreeMap<String, u64>,
}

impl FloodAttack {
    /// Envoy's memory and its counters matching `counters` read, and the legitimate client
    /// started.
    fn start(stack: &Arc<Stack>, counters: &'static str) -> Self {
        let pid = envoy_pid(stack);
        Self {
            stack: Arc::clone(stack),
            rss_before: rss_mib(pid),
            peak: RssPeak::start(pid),
            counters,
            counters_before: stack.envoy.counters(counters),
            legit: Legit::start(stack),
        }
    }

    /// Runs `clients` (each its kind's name and its frames) for the size's `flood_secs`,
    /// reports them as `name`, and checks what every flood must leave: no flooding connection
    /// open after the drain, the legitimate keys served within [`P99_BOUND`], Envoy within its
    /// budget.
    async fn run(self, name: &str, clients: Vec<(String, FloodFrames)>) -> FloodTally {
        let s = sizes();
        let target = envoy_addr(&self.stack);
        let until = Instant::now() + Duration::from_secs(s.flood_secs);
        // An idle HTTP/2 connection is closed after the idle timeout, Envoy's drain (a first
        // GOAWAY, `drain_timeout` 5 s, the last) and its delayed close (1 s): 9 s from its last
        // stream, and a margin.
        let drain = Duration::from_millis(IDLE_TIMEOUT_MS + 5_000 + 1_000 + 3_000);
        let count = clients.len();
        let tasks: Vec<_> = clients
            .into_iter()
            .map(|(kind, frames)| {
                let flooding = flood(target, Arc::new(frames), until, drain);
                (kind, tokio::spawn(flooding))
            })
            .collect();
        let mut by_kind: BTreeMap<String, (usize, u64, usize)> = BTreeMap::new();
        let mut open = Vec::new();
        let mut ends = Vec::new();
        for (kind, t) in tasks {
            let end = t.await.expect("task");
            let e = by_kind.entry(kind.clone()).or_default();
            e.0 += end.connections;
            e.1 += end.frames;
            e.2 += end.closed_while_flooding;
            if !end.last_closed {
                open.push(kind);
            }
            ends.push(end);
        }
        let legit = self.legit.finish().await;
        let peak = self.peak.stop().await;
        let moved = counters_moved(
            &self.stack.envoy.counters(self.counters),
            &self.counters_before,
        );
        let rss_before = self.rss_before;
        report(
            name,
            &format!(
                "{count} HTTP/2 clients for {} s, by frame (connections, frames sent, \
                 connections Envoy closed while flooding) {by_kind:?}; Envoy's counters \
                 {moved:?}; Envoy RSS {rss_before:.1} -> peak {peak:.1} MiB; {legit}",
                s.flood_secs
            ),
        );
        assert!(
            open.is_empty(),
            "{name}: flooding connections still open {drain:?} after the flood: {open:?} \
             ({by_kind:?})"
        );
        legit.check(name, P99_BOUND);
        assert!(
            peak - rss_before <= BUDGET_MIB,
            "Envoy grew {:.1} MiB in the {name}",
            peak - rss_before
        );
        FloodTally {
            by_kind,
            ends,
            moved,
        }
    }
}

/// Envoy's counters the control-frame flood reports: its HTTP/2 flood protections and the
/// connections they and the idle timeout closed.
const FLOOD_COUNTERS: &str = "^http2\\.(outbound_control_flood|outbound_flood|inbound_empty_frames_flood|inbound_priority_frames_flood|inbound_window_update_frames_flood|rx_messaging_error|rx_reset|tx_reset|keepalive_timeout)$|^http.edge.downstream_cx_(idle_timeout|http2_total|protocol_error)$";

/// HTTP/2 control frames as fast as a connection can send them, and none of Envoy's answers
/// read: PINGs and SETTINGS, which Envoy must acknowledge (the acknowledgements pile up in its
/// output), and WINDOW_UPDATEs, which it only counts. No connection that sends nothing but
/// control frames may stay open past the idle timeout, nor grow Envoy past its budget, nor
/// slow the legitimate keys past [`P99_BOUND`].
async fn http2_control_frame_flood(stack: Arc<Stack>) {
    let s = sizes();
    let attack = FloodAttack::start(&stack, FLOOD_COUNTERS);
    let clients = (0..s.control_flood_connections)
        .map(|c| {
            let kind = ControlFrame::ALL[c % ControlFrame::ALL.len()];
            (format!("{kind:?}"), FloodFrames::control(kind))
        })
        .collect();
    let FloodTally { by_kind, moved, .. } = attack.run("control-frame-flood", clients).await;
    let frames: u64 = by_kind.values().map(|e| e.1).sum();
    assert!(frames >= 100_000, "too few frames to judge: {by_kind:?}");
    // Envoy's flood limits closed them, not the idle timeout alone: the limits' counters
    // moved (a close while flooding may also be the idle timeout's, on a slow machine).
    for counter in [
        "http2.outbound_control_flood",
        "http2.inbound_window_update_frames_flood",
    ] {
        assert!(
            moved.get(counter).copied().unwrap_or(0) > 0,
            "{counter} did not move: {moved:?}"
        );
    }
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541, 5.1), the prefix's other bits 0.
fn hpack_integer(value: usize, n: u32, out: &mut Vec<u8>) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(value as u8);
        return;
    }
    out.push(max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128 + 128) as u8);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A header field as an HPACK literal without indexing, its name new, neither string Huffman
/// coded (RFC 7541, 6.2.2): a block that changes no decoder state, so any number of them may
/// follow one another.
fn hpack_literal(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x00];
    for text in [name, value] {
        hpack_integer(text.len(), 7, &mut out);
        out.extend_from_slice(text.as_bytes());
    }
    out
}

/// The header block of a new key's request that announces a body of `content_length` bytes.
fn h2_request_block(key: &str, bearer: &str, content_length: usize) -> Vec<u8> {
    let authorization = format!("Bearer {bearer}");
    let length = content_length.to_string();
    [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/checkout"),
        (":authority", "edge"),
        ("authorization", authorization.as_str()),
        ("content-type", "application/json"),
        ("idempotency-key", key),
        ("content-length", length.as_str()),
    ]
    .iter()
    .flat_map(|(n, v)| hpack_literal(n, v))
    .collect()
}

/// The HTTP/2 floods that ride on a stream: a new key's request opened on stream 1 (its body
/// announced, never sent), then frames that carry nothing forward.
#[derive(Clone, Copy, Debug)]
enum StreamFlood {
    /// DATA frames of no bytes (Envoy's `max_consecutive_inbound_frames_with_empty_payload`).
    EmptyData,
    /// PRIORITY frames for the stream (`max_inbound_priority_frames_per_stream`).
    Priority,
    /// A header block never ended: HEADERS without END_HEADERS, then CONTINUATION frames each
    /// carrying one more header field (the header list's limits).
    Continuation,
}

impl StreamFlood {
    const ALL: [StreamFlood; 3] = [Self::EmptyData, Self::Priority, Self::Continuation];

    /// The body the request announces: never sent.
    const BODY_BYTES: usize = 200;

    /// The flood on connection after connection, each with a key `<prefix>-<n>`.
    fn frames(self, prefix: String, bearer: String) -> FloodFrames {
        const END_HEADERS: u8 = 0x4;
        let headers_flags = match self {
            Self::Continuation => 0,
            Self::EmptyData | Self::Priority => END_HEADERS,
        };
        let opening = move |n: usize| {
            let mut out = h2_hello();
            let block = h2_request_block(&format!("{prefix}-{n}"), &bearer, Self::BODY_BYTES);
            out.extend(h2_frame(0x1, headers_flags, 1, &block));
            out
        };
        let frame = match self {
            Self::EmptyData => h2_frame(0x0, 0, 1, &[]),
            // Stream 1 depends on stream 0, weight 16, not exclusive.
            Self::Priority => h2_frame(0x2, 0, 1, &[0, 0, 0, 0, 15]),
            Self::Continuation => h2_frame(0x9, 0, 1, &hpack_literal("x-pad", &"p".repeat(100))),
        };
        FloodFrames::repeating(opening, &frame, 256)
    }
}

/// HTTP/2 frames that ride on an open request and carry nothing forward, as fast as a
/// connection can send them, none of Envoy's answers read: DATA frames of no bytes, PRIORITY
/// frames, and CONTINUATION frames of a header block that never ends. Envoy's limits close each
/// connection; no key whose body never came runs, and each is usable after; Envoy stays within
/// its budget and the legitimate keys within [`P99_BOUND`].
async fn http2_stream_frame_flood(stack: Arc<Stack>) {
    let s = sizes();
    let attack = FloodAttack::start(&stack, "^http2\\.|^http.edge.downstream_(cx|rq)_");
    let bearer = token("alice");
    let prefixes: Vec<(StreamFlood, String)> = (0..s.control_flood_connections)
        .map(|c| {
            let kind = StreamFlood::ALL[c % StreamFlood::ALL.len()];
            (kind, unique_key(&format!("stream-flood-{c}")))
        })
        .collect();
    let clients = prefixes
        .iter()
        .map(|(kind, prefix)| {
            let frames = kind.frames(prefix.clone(), bearer.clone());
            (format!("{kind:?}"), frames)
        })
        .collect();
    let FloodTally {
        by_kind,
        ends,
        moved,
    } = attack.run("stream-frame-flood", clients).await;
    let keys: Vec<String> = prefixes
        .iter()
        .zip(&ends)
        .flat_map(|((_, prefix), end)| (0..end.connections).map(move |n| format!("{prefix}-{n}")))
        .collect();
    // Each connection closed while it flooded was closed by its flood's own limit: empty
    // frames, PRIORITY frames, the header list.
    for (kind, counter) in [
        (StreamFlood::EmptyData, "http2.inbound_empty_frames_flood"),
        (StreamFlood::Priority, "http2.inbound_priority_frames_flood"),
        (StreamFlood::Continuation, "http2.header_overflow"),
    ] {
        let closed = by_kind.get(&format!("{kind:?}")).map_or(0, |e| e.2) as u64;
        let by_limit = moved.get(counter).copied().unwrap_or(0);
        assert!(
            closed > 0 && by_limit >= closed,
            "{kind:?}: {closed} connections closed while flooding, {counter} +{by_limit}: {moved:?}"
        );
    }
    assert_none_ran(&stack, &keys, "keys whose body never came").await;
    let sample: Vec<String> = keys
        .iter()
        .step_by((keys.len() / 20).max(1))
        .cloned()
        .collect();
    assert_keys_usable(&stack, &sample, StreamFlood::BODY_BYTES).await;
}

/// The counter of streams reset because their answer waited past the flush timeout.
const FLUSH_COUNTER: &str = "^http2\\.tx_flush_timeout$";

/// HTTP/2 clients that send a whole new key and never read its answer: their stream's window
/// is 0 (SETTINGS_INITIAL_WINDOW_SIZE), so Envoy can send the answer's headers but none of its
/// body. The checkout runs each key once and the filter stores its answer all the same: sent
/// again by a client that reads, every key is replayed. Envoy's memory stays within the budget
/// and the legitimate keys within [`P99_BOUND`] while the answers wait, and each waits at most
/// `response_flush_timeout_ms` (15 s here, 40 s at the full size): then Envoy resets its
/// stream. (HTTP/2 only: an HTTP/1.1 client that does not read is bounded by the idle timeout.)
async fn http2_readers_that_never_read(stack: Arc<Stack>) {
    let s = sizes();
    let pid = envoy_pid(&stack);
    let target = envoy_addr(&stack);
    let rss_before = rss_mib(pid);
    let peak = RssPeak::start(pid);
    let flush_before = stack.envoy.counters(FLUSH_COUNTER);
    let heap_before = heap_mib(&stack);
    let prefix = unique_key("stalled");
    let bearer = token("alice");
    let body = bytes::Bytes::from(serde_json::to_vec(&charge_body(1)).expect("body"));
    let mut tasks = Vec::new();
    for c in 0..s.zero_window_connections {
        let (key, bearer, body) = (format!("{prefix}-{c}"), bearer.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let tcp = TcpStream::connect(target)
                .await
                .map_err(|e| e.to_string())?;
            let (client, connection) = h2::client::Builder::new()
                .initial_window_size(0)
                .handshake::<_, bytes::Bytes>(tcp)
                .await
                .map_err(|e| e.to_string())?;
            let driver = tokio::spawn(connection);
            let mut client = client.ready().await.map_err(|e| e.to_string())?;
            let request = http::Request::post("http://edge/checkout")
                .header("authorization", format!("Bearer {bearer}"))
                .header("content-type", "application/json")
                .header("idempotency-key", &key)
                .body(())
                .map_err(|e| e.to_string())?;
            let (answer, mut stream) = client
                .send_request(request, false)
                .map_err(|e| e.to_string())?;
            stream.send_data(body, true).map_err(|e| e.to_string())?;
            let answer = tokio::time::timeout(Duration::from_secs(30), answer)
                .await
                .map_err(|_| "no answer's headers in 30 s".to_string())?
                .map_err(|e| e.to_string())?;
            // Held, never read: its body stays in Envoy until the flush timeout resets the stream.
            Ok::<_, String>((key, answer.status().as_u16(), answer.into_body(), driver))
        }));
    }
    let mut held: Vec<(String, h2::RecvStream, tokio::task::JoinHandle<_>)> = Vec::new();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks {
        match t.await.expect("task") {
            Ok((key, status, body, driver)) => {
                *statuses.entry(status.to_string()).or_default() += 1;
                held.push((key, body, driver));
            }
            Err(e) => *statuses.entry(e).or_default() += 1,
        }
    }
    let (held_rss, held_heap) = (rss_mib(pid), heap_mib(&stack));
    // The legitimate keys while every answer waits on a client that does not read.
    let legit = Legit::start(&stack);
    tokio::time::sleep(Duration::from_secs(s.reset_secs)).await;
    let legit = legit.finish().await;
    let peak = peak.stop().await;
    // Each answer waits at most `response_flush_timeout_ms` once it is whole in Envoy: then its
    // stream is reset (Envoy's `stream_flush_timeout`), not at the stream's idle timeout.
    let flushed = |c: &BTreeMap<String, u64>| c.get("http2.tx_flush_timeout").copied().unwrap_or(0);
    let early = flushed(&stack.envoy.counters(FLUSH_COUNTER)) - flushed(&flush_before);
    assert_eq!(
        early, 0,
        "answers reset before the legitimate keys were measured: the measure is not of a \
         worker holding them (raise the size's flush_timeout_ms)"
    );
    let waited = Instant::now();
    let mut timed_out = 0;
    while waited.elapsed() < Duration::from_millis(s.flush_timeout_ms + 10_000) {
        timed_out = flushed(&stack.envoy.counters(FLUSH_COUNTER)) - flushed(&flush_before);
        if timed_out >= held.len() as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // How each answer's stream ended, all read at once (a second each at most).
    let ends = futures::future::join_all(held.iter_mut().map(|(_, body, _)| async move {
        match tokio::time::timeout(Duration::from_secs(1), body.data()).await {
            Ok(Some(Err(e))) if e.is_reset() => "reset".to_owned(),
            Ok(Some(Err(e))) => format!("error {e}"),
            Ok(Some(Ok(_))) => "data".to_owned(),
            Ok(None) => "ended".to_owned(),
            Err(_) => "still waiting".to_owned(),
        }
    }))
    .await
    .into_iter()
    .fold(BTreeMap::<String, usize>::new(), |mut by, end| {
        *by.entry(end).or_default() += 1;
        by
    });
    let (after_rss, after_heap) = (rss_mib(pid), heap_mib(&stack));
    report(
        "readers-that-never-read",
        &format!(
            "{} HTTP/2 connections with a window of 0, one new key each: answers' headers \
             {statuses:?}; Envoy RSS {rss_before:.1} -> {held_rss:.1} with the answers held, \
             peak {peak:.1} MiB, {after_rss:.1} after the flush timeout (Envoy's heap \
             {heap_before:.1} -> {held_heap:.1} -> {after_heap:.1} MiB); {legit}; the answers \
             after {:.1} s: {ends:?}, http2.tx_flush_timeout +{timed_out}",
            s.zero_window_connections,
            waited.elapsed().as_secs_f64() + s.reset_secs as f64,
        ),
    );
    assert!(
        timed_out >= held.len() as u64,
        "answers that waited past the flush timeout for a client that does not read: {ends:?} \
         (http2.tx_flush_timeout +{timed_out})"
    );
    assert_eq!(
        ends.get("reset").copied().unwrap_or(0),
        held.len(),
        "the answers nobody read, at the flush timeout: {ends:?}"
    );
    assert_eq!(
        statuses.get("201").copied().unwrap_or(0),
        s.zero_window_connections,
        "every stalled reader's key answered 201 (headers): {statuses:?}"
    );
    legit.check("answers held for readers that never read", P99_BOUND);
    assert!(
        peak - rss_before <= BUDGET_MIB,
        "Envoy grew {:.1} MiB holding answers nobody reads",
        peak - rss_before
    );
    // Each key ran once, and its answer was stored though its client never read it.
    let keys: Vec<String> = held.iter().map(|(k, _, _)| k.clone()).collect();
    let charges = charges_by_key(&stack).await;
    let not_once: Vec<_> = keys
        .iter()
        .filter(|k| charges.get(*k).copied().unwrap_or(0) != 1)
        .take(5)
        .collect();
    assert!(
        not_once.is_empty(),
        "stalled readers' keys not charged exactly once: {not_once:?}"
    );
    let c = Client::new(&stack.envoy.url(""));
    let mut again: BTreeMap<String, usize> = BTreeMap::new();
    for key in keys.iter().step_by((keys.len() / 50).max(1)) {
        let a = c.send(checkout(key, "alice", &charge_body(1))).await;
        let replayed = a.header("idempotent-replayed").unwrap_or_default();
        *again
            .entry(format!("{} replayed={replayed}", a.status))
            .or_default() += 1;
    }
    report(
        "readers-that-never-read",
        &format!("their keys sent again by a client that reads: {again:?}"),
    );
    assert!(
        again.len() == 1 && again.contains_key("201 replayed=true"),
        "stalled readers' keys sent again: {again:?}"
    );
    for (_, body, driver) in held {
        drop(body);
        driver.abort();
    }
    assert_nothing_charged_twice(&stack).await;
}

fn main() {
    let mut args = Arguments::from_args();
    // One attack at a time: each measures Envoy alone.
    args.test_threads = Some(1);
    let trials = vec![
        STACK.trial(
            "hostile_load_0_refusals_close_their_connection",
            refusals_close_their_connection,
        ),
        STACK.trial("hostile_load_1_burst_of_held_bodies", burst),
        STACK.trial("hostile_load_2_idle_connections", idle_connections),
        STACK.trial("hostile_load_3_slow_clients", slow_clients),
        STACK.trial("hostile_load_4_header_flood", header_flood),
        STACK.trial(
            "hostile_load_5_request_timeout_while_the_filter_waits",
            request_timeout_while_the_filter_waits,
        ),
        STACK.trial(
            "hostile_load_6_one_subject_s_slow_large_bodies",
            one_subject_s_slow_large_bodies,
        ),
        STACK.trial("hostile_load_7_http2_rapid_reset", http2_rapid_reset),
        STACK.trial(
            "hostile_load_8_http2_control_frame_flood",
            http2_control_frame_flood,
        ),
        STACK.trial(
            "hostile_load_9_http2_readers_that_never_read",
            http2_readers_that_never_read,
        ),
        STACK.trial(
            "hostile_load_10_http2_stream_frame_flood",
            http2_stream_frame_flood,
        ),
    ];
    STACK.run(&args, trials);
}
