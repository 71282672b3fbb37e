//! Parts that misbehave on purpose, for the fault and hostile-input suites, all on loopback:
//!
//! * [`DelayProxy`]: a TCP proxy put in front of a service (the state API) that can pass
//!   traffic, hold every answer back for a while, swallow requests, stall (forward nothing,
//!   close nothing), or hang up at once; the mode can be switched while it runs. On loopback,
//!   or on a host of the partition tests (a slow or black-holed link there).
//! * [`FakeStateApi`]: an HTTP server that speaks just enough of the state API's contract to be
//!   pointed at by an Envoy, and answers each claim in a way chosen by the claimed key's prefix
//!   (garbage, wrong JSON, 500, an unknown outcome, ...), so cases can run side by side.
//! * [`raw_request`]: sends bytes as they are (control characters in headers, obs-text, bare
//!   LF) where an HTTP client library would refuse to.
//!
//! Each runs on a thread of its own with its own Tokio runtime, so it outlives the runtime of
//! the test that uses it, and stops when dropped. Every wait is bounded.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest any fake part holds a connection or a request, so nothing can pin a test forever.
const MAX_HOLD: Duration = Duration::from_secs(60);

/// A server thread with its own runtime, stopped on drop.
pub(crate) struct Background {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Background {
    /// Binds 127.0.0.1:0 and runs `serve(listener)` until dropped.
    pub(crate) fn spawn<F, Fut>(name: &str, serve: F) -> Result<(Self, u16), String>
    where
        F: FnOnce(TcpListener) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        Self::spawn_on(name, None, SocketAddr::from(([127, 0, 0, 1], 0)), serve)
    }

    /// Binds `bind` inside network namespace `netns` (the caller's when `None`) and runs
    /// `serve(listener)` there until dropped: the connections it opens are on that host too.
    pub(crate) fn spawn_on<F, Fut>(
        name: &str,
        netns: Option<String>,
        bind: SocketAddr,
        serve: F,
    ) -> Result<(Self, u16), String>
    where
        F: FnOnce(TcpListener) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (bound_tx, bound_rx) = std::sync::mpsc::channel::<Result<u16, String>>();
        let label = name.to_owned();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let bound = (|| {
                    if let Some(ns) = &netns {
                        crate::netns::enter_netns(ns).map_err(|e| e.to_string())?;
                    }
                    let l = std::net::TcpListener::bind(bind)
                        .map_err(|e| format!("{label}: cannot bind {bind}: {e}"))?;
                    l.set_nonblocking(true).map_err(|e| e.to_string())?;
                    let port = l.local_addr().map_err(|e| e.to_string())?.port();
                    Ok((l, port))
                })();
                let std_listener = match bound {
                    Ok((l, port)) => {
                        let _ = bound_tx.send(Ok(port));
                        l
                    }
                    Err(e) => {
                        let _ = bound_tx.send(Err(e));
                        return;
                    }
                };
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, async move {
                    let Ok(listener) = TcpListener::from_std(std_listener) else {
                        return;
                    };
                    tokio::select! {
                        _ = serve(listener) => {}
                        _ = stop_rx => {}
                    }
                });
                // Dropping the runtime cancels every connection task.
            })
            .map_err(|e| format!("{name}: cannot spawn its thread: {e}"))?;
        let background = Self {
            stop: Some(stop_tx),
            thread: Some(thread),
        };
        let port = bound_rx
            .recv()
            .map_err(|_| format!("{name}: its thread ended before binding"))??;
        Ok((background, port))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Delay proxy

/// What a [`DelayProxy`] does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward both ways untouched.
    Pass,
    /// Forward requests at once, but hold every chunk of the answer back this long (the service
    /// does its work in time; its answer comes late).
    DelayAnswers(Duration),
    /// Read and drop everything either way: nothing is forwarded nor answered.
    Blackhole,
    /// Forward nothing and close nothing: bytes wait, unread, until the mode changes (a
    /// black-holed link: no reset, no FIN; what was sent arrives once it is healed, as TCP
    /// retransmits it). New connections are accepted and wait too.
    Stall,
    /// Close connections (new ones at once, pooled ones at their next chunk).
    HangUp,
    /// Answer every new connection's request with [`GARBAGE_ANSWER`] itself, then close: a
    /// service that answers, but not what was asked (pooled connections pass on).
    Garbage,
}

/// What [`ProxyMode::Garbage`] answers: an HTML page with a nonsensical reconcile header.
pub const GARBAGE_ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\nidempotency-outcome: perhaps\r\ncontent-length: 14\r\nconnection: close\r\n\r\n<html></html>\n";

/// A TCP proxy to `target` whose behaviour can be switched at any time. The mode is read when
/// a connection is accepted and again for every chunk either way, so a switch also applies to
/// connections Envoy already holds in its pool.
pub struct DelayProxy {
    pub port: u16,
    pub target: u16,
    mode: Arc<Mutex<ProxyMode>>,
    /// Chunks of answers held back by [`ProxyMode::DelayAnswers`] so far.
    delayed: Arc<std::sync::atomic::AtomicU64>,
    _bg: Background,
}

impl DelayProxy {
    /// On loopback, to 127.0.0.1:`target`; a connection lives at most twice [`MAX_HOLD`].
    pub fn start(target: u16, mode: ProxyMode) -> Result<Self, String> {
        Self::relay(
            None,
            SocketAddr::from(([127, 0, 0, 1], 0)),
            SocketAddr::from(([127, 0, 0, 1], target)),
            mode,
            MAX_HOLD * 2,
        )
    }

    /// Listening on `bind` inside network namespace `netns` (a host of the partition tests),
    /// to `target` as seen from there. Connections live as long as their ends keep them (a
    /// relay on a link for a whole suite: Envoy's pooled connections must not be cut by it).
    pub fn start_on(
        netns: Option<String>,
        bind: SocketAddr,
        target: SocketAddr,
        mode: ProxyMode,
    ) -> Result<Self, String> {
        Self::relay(netns, bind, target, mode, Duration::from_secs(24 * 3600))
    }

    fn relay(
        netns: Option<String>,
        bind: SocketAddr,
        target: SocketAddr,
        mode: ProxyMode,
        life: Duration,
    ) -> Result<Self, String> {
        let shared = Arc::new(Mutex::new(mode));
        let delayed = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let m = Arc::clone(&shared);
        let d = Arc::clone(&delayed);
        let (bg, port) =
            Background::spawn_on("delay-proxy", netns, bind, move |listener| async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    let (m, d) = (Arc::clone(&m), Arc::clone(&d));
                    tokio::task::spawn_local(async move {
                        let _ = tokio::time::timeout(life, proxy_connection(client, target, m, d))
                            .await;
                    });
                }
            })?;
        Ok(Self {
            port,
            target: target.port(),
            mode: shared,
            delayed,
            _bg: bg,
        })
    }

    /// How many chunks of answers were held back so far (the proof that a delay is in force).
    pub fn delayed_chunks(&self) -> u64 {
        self.delayed.load(Ordering::Relaxed)
    }

    pub fn set_mode(&self, mode: ProxyMode) {
        if let Ok(mut m) = self.mode.lock() {
            *m = mode;
        }
    }

    pub fn mode(&self) -> ProxyMode {
        self.mode.lock().map(|m| *m).unwrap_or(ProxyMode::Pass)
    }
}

fn read_mode(m: &Mutex<ProxyMode>) -> ProxyMode {
    m.lock().map(|m| *m).unwrap_or(ProxyMode::Pass)
}

/// Waits while the proxy stalls.
async fn while_stalled(mode: &Mutex<ProxyMode>) {
    while read_mode(mode) == ProxyMode::Stall {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn proxy_connection(
    mut client: TcpStream,
    target: SocketAddr,
    mode: Arc<Mutex<ProxyMode>>,
    delayed: Arc<std::sync::atomic::AtomicU64>,
) {
    while_stalled(&mode).await;
    match read_mode(&mode) {
        ProxyMode::HangUp => return,
        ProxyMode::Garbage => {
            let mut buf = [0u8; 8192];
            let _ = tokio::time::timeout(Duration::from_secs(2), client.read(&mut buf)).await;
            let _ = client.write_all(GARBAGE_ANSWER).await;
            let _ = client.shutdown().await;
            return;
        }
        ProxyMode::Blackhole => {
            let mut buf = [0u8; 8192];
            let _ = tokio::time::timeout(MAX_HOLD, async {
                while matches!(client.read(&mut buf).await, Ok(n) if n > 0) {}
            })
            .await;
            return;
        }
        _ => {}
    }
    let Ok(upstream) = TcpStream::connect(target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    // Each direction returns true when it hung up on purpose: then both sockets are dropped.
    let up_mode = Arc::clone(&mode);
    let up = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            while_stalled(&up_mode).await;
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            while_stalled(&up_mode).await;
            match read_mode(&up_mode) {
                ProxyMode::HangUp => return true,
                ProxyMode::Blackhole => continue,
                _ => {}
            }
            if uw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = uw.shutdown().await;
        false
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            while_stalled(&mode).await;
            let n = match ur.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            while_stalled(&mode).await;
            match read_mode(&mode) {
                ProxyMode::DelayAnswers(d) => {
                    delayed.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(d.min(MAX_HOLD)).await;
                }
                ProxyMode::HangUp => return true,
                ProxyMode::Blackhole => continue,
                ProxyMode::Pass | ProxyMode::Garbage | ProxyMode::Stall => {}
            }
            if cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = cw.shutdown().await;
        false
    };
    tokio::pin!(up);
    tokio::pin!(down);
    tokio::select! {
        hung = &mut up => if !hung { down.await; },
        hung = &mut down => if !hung { up.await; },
    }
}

// ---------------------------------------------------------------------------------------------
// Fake state API

/// How the fake state API answers a claim, chosen by the key's prefix `fake-<behaviour>-`.
/// Heartbeat, complete and release are always answered correctly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeClaim {
    /// A correct `claimed` answer: the request goes upstream (the VM is alive and well).
    Ok,
    /// Bytes that are not HTTP, then a close.
    Garbage,
    /// 200 with JSON of another shape.
    WrongJson,
    /// 200 with a body that is not JSON.
    NotJson,
    /// 200 with an empty body.
    Empty,
    /// 500 with a problem document.
    ServerError,
    /// 401 (as if the filter's token were wrong).
    Unauthorized,
    /// 200 `{"outcome":"maybe"}`.
    UnknownOutcome,
    /// `claimed` with a field of the wrong type.
    WrongType,
    /// `claimed` with an extra field (the contract refuses unknown fields).
    ExtraField,
    /// `completed` whose stored body is not base64.
    BadBase64,
    /// `completed` with status 1000.
    BadStatus,
    /// `completed` carrying headers that must never be replayed (set-cookie, hop-by-hop, ids).
    ReplayForbiddenHeaders,
    /// `completed` with a header value carrying CR LF and a second header.
    ReplayHeaderInjection,
    /// `in_progress` with `retry_after_s: 0`.
    InProgressZero,
    /// Never answers (the filter's callout timeout must fire).
    Hang,
    /// Closes the connection without answering.
    Close,
    /// 200 with 8 MiB of JSON whitespace around a valid answer.
    Huge,
}

impl FakeClaim {
    pub const ALL: [FakeClaim; 18] = [
        Self::Ok,
        Self::Garbage,
        Self::WrongJson,
        Self::NotJson,
        Self::Empty,
        Self::ServerError,
        Self::Unauthorized,
        Self::UnknownOutcome,
        Self::WrongType,
        Self::ExtraField,
        Self::BadBase64,
        Self::BadStatus,
        Self::ReplayForbiddenHeaders,
        Self::ReplayHeaderInjection,
        Self::InProgressZero,
        Self::Hang,
        Self::Close,
        Self::Huge,
    ];

    pub fn slug(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Garbage => "garbage",
            Self::WrongJson => "wrongjson",
            Self::NotJson => "notjson",
            Self::Empty => "empty",
            Self::ServerError => "status500",
            Self::Unauthorized => "status401",
            Self::UnknownOutcome => "unknownoutcome",
            Self::WrongType => "wrongtype",
            Self::ExtraField => "extrafield",
            Self::BadBase64 => "badbase64",
            Self::BadStatus => "badstatus",
            Self::ReplayForbiddenHeaders => "forbiddenheaders",
            Self::ReplayHeaderInjection => "headerinjection",
            Self::InProgressZero => "inprogresszero",
            Self::Hang => "hang",
            Self::Close => "close",
            Self::Huge => "huge",
        }
    }

    /// A fresh key that makes the fake answer this way.
    pub fn key(self) -> String {
        crate::client::unique_key(&format!("fake-{}", self.slug()))
    }

    fn of_key(key: &str) -> Self {
        let rest = key.strip_prefix("fake-").unwrap_or("");
        Self::ALL
            .into_iter()
            .find(|b| rest.starts_with(&format!("{}-", b.slug())))
            .unwrap_or(Self::Ok)
    }
}

/// One request the fake state API received: its path and the key in its body.
#[derive(Debug, Clone)]
pub struct FakeCall {
    pub path: String,
    pub key: String,
    pub authorization: Option<String>,
}

/// A loopback HTTP/1.1 server that plays a (misbehaving) state API.
pub struct FakeStateApi {
    pub port: u16,
    calls: Arc<Mutex<Vec<FakeCall>>>,
    _bg: Background,
}

impl FakeStateApi {
    pub fn start() -> Result<Self, String> {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let c = Arc::clone(&calls);
        let tokens = Arc::new(AtomicI64::new(1_000_000));
        let (bg, port) = Background::spawn("fake-state-api", move |listener| async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    continue;
                };
                let c = Arc::clone(&c);
                let t = Arc::clone(&tokens);
                tokio::task::spawn_local(async move {
                    let _ = tokio::time::timeout(MAX_HOLD * 2, fake_connection(conn, c, t)).await;
                });
            }
        })?;
        Ok(Self {
            port,
            calls,
            _bg: bg,
        })
    }

    /// Every call received so far for `key`.
    /// How many calls reached `path`.
    pub fn calls_to(&self, path: &str) -> usize {
        self.calls
            .lock()
            .map(|c| c.iter().filter(|x| x.path == path).count())
            .unwrap_or(0)
    }

    pub fn calls_for(&self, key: &str) -> Vec<FakeCall> {
        self.calls
            .lock()
            .map(|c| c.iter().filter(|x| x.key == key).cloned().collect())
            .unwrap_or_default()
    }
}

/// Reads one HTTP/1.1 request (head and a Content-Length body); None when the peer is gone.
async fn read_request(
    conn: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> Option<(String, Vec<(String, String)>, Vec<u8>)> {
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > 1 << 20 {
            return None;
        }
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let path = lines.next()?.split_whitespace().nth(1)?.to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let body_start = head_end + 4;
    while buf.len() < body_start + len {
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[body_start..body_start + len].to_vec();
    buf.drain(..body_start + len);
    Some((path, headers, body))
}

fn http_answer(status: u16, content_type: &str, body: &[u8]) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        401 => "Unauthorized",
        500 => "Internal Server Error",
        _ => "Whatever",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

fn json_ok(v: serde_json::Value) -> Vec<u8> {
    http_answer(200, "application/json", v.to_string().as_bytes())
}

async fn fake_connection(
    mut conn: TcpStream,
    calls: Arc<Mutex<Vec<FakeCall>>>,
    tokens: Arc<AtomicI64>,
) {
    use serde_json::json;
    let mut buf = Vec::new();
    while let Some((path, headers, body)) = read_request(&mut conn, &mut buf).await {
        let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let key = parsed
            .get("key")
            .and_then(|k| k.as_str())
            .unwrap_or("")
            .to_owned();
        let authorization = headers
            .iter()
            .find(|(k, _)| k == "authorization")
            .map(|(_, v)| v.clone());
        if let Ok(mut c) = calls.lock() {
            c.push(FakeCall {
                path: path.clone(),
                key: key.clone(),
                authorization,
            });
        }
        let answer = if path != contract::wire::CLAIM_PATH {
            match path.as_str() {
                contract::wire::COMPLETE_PATH => json_ok(json!({"state": "completed"})),
                contract::wire::RELEASE_PATH => json_ok(json!({"state": "released"})),
                contract::wire::HEARTBEAT_PATH | contract::wire::UNKNOWN_PATH => {
                    json_ok(json!({"lease_ms": 30_000}))
                }
                // Like a state API older than the batch calls (`/v1/writes`).
                _ => http_answer(404, contract::PROBLEM_CONTENT_TYPE, br#"{"type":"/problems/not-found","title":"Not found","status":404,"detail":"no such route"}"#),
            }
        } else {
            let stored = |status: u16, headers: serde_json::Value, body_base64: &str| {
                json_ok(
                    json!({"outcome": "completed", "response": {"status": status, "headers": headers, "body_base64": body_base64, "replayable": true}}),
                )
            };
            match FakeClaim::of_key(&key) {
                FakeClaim::Ok => json_ok(
                    json!({"outcome": "claimed", "token": tokens.fetch_add(1, Ordering::SeqCst), "lease_ms": 30_000, "reclaimed": false}),
                ),
                FakeClaim::Garbage => {
                    let _ = conn.write_all(b"\x00\x01\x02 this is not HTTP at all \xff\xfe\r\n\r\n").await;
                    return;
                }
                FakeClaim::WrongJson => json_ok(json!({"hello": "world"})),
                FakeClaim::NotJson => http_answer(200, "application/json", b"<html>claimed</html>"),
                FakeClaim::Empty => http_answer(200, "application/json", b""),
                FakeClaim::ServerError => http_answer(500, contract::PROBLEM_CONTENT_TYPE, br#"{"type":"/problems/internal-error","title":"boom","status":500,"detail":"boom"}"#),
                FakeClaim::Unauthorized => http_answer(401, contract::PROBLEM_CONTENT_TYPE, br#"{"type":"/problems/unauthenticated","title":"no","status":401,"detail":"no"}"#),
                FakeClaim::UnknownOutcome => json_ok(json!({"outcome": "maybe"})),
                FakeClaim::WrongType => json_ok(json!({"outcome": "claimed", "token": "seven", "lease_ms": 30_000, "reclaimed": false})),
                FakeClaim::ExtraField => json_ok(json!({"outcome": "claimed", "token": 7, "lease_ms": 30_000, "reclaimed": false, "admin": true})),
                FakeClaim::BadBase64 => stored(201, json!([["content-type", "application/json"]]), "!!!not base64!!!"),
                FakeClaim::BadStatus => stored(1000, json!([]), "e30="),
                FakeClaim::ReplayForbiddenHeaders => stored(
                    201,
                    json!([
                        ["content-type", "application/json"],
                        ["set-cookie", "stolen_session=1"],
                        ["x-request-id", "someone-elses"],
                        ["connection", "close"],
                        ["transfer-encoding", "chunked"],
                        ["content-length", "9999"],
                        ["location", "/charges/fake"]
                    ]),
                    "eyJmYWtlIjp0cnVlfQ==",
                ),
                FakeClaim::ReplayHeaderInjection => {
                    stored(201, json!([["content-type", "application/json"], ["location", "/x\r\nset-cookie: injected=1"]]), "e30=")
                }
                FakeClaim::InProgressZero => json_ok(json!({"outcome": "in_progress", "retry_after_s": 0, "lease_remaining_ms": 0})),
                FakeClaim::Hang => {
                    tokio::time::sleep(MAX_HOLD).await;
                    return;
                }
                FakeClaim::Close => return,
                FakeClaim::Huge => {
                    let mut body = vec![b' '; 8 << 20];
                    body.extend_from_slice(br#"{"outcome":"mismatch"}"#);
                    http_answer(200, "application/json", &body)
                }
            }
        };
        if conn.write_all(&answer).await.is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Raw HTTP/1.1

/// The status and the raw text of an answer to [`raw_request`].
#[derive(Debug, Clone)]
pub struct RawAnswer {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl RawAnswer {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head
            .split("\r\n")
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_owned())
    }
}

/// Sends `request` (bytes as they are; it should carry `Connection: close`) to 127.0.0.1:`port`
/// and reads the answer until the peer closes or `timeout`. Status 0: no answer at all.
pub async fn raw_request(
    port: u16,
    request: &[u8],
    timeout: Duration,
) -> Result<RawAnswer, String> {
    let run = async {
        let mut s = TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], port)))
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(request).await.map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&chunk[..n]),
            }
            // A complete Content-Length answer: stop without waiting for the close.
            if let Some(i) = out.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&out[..i]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok());
                if len.is_some_and(|len| out.len() >= i + 4 + len) {
                    break;
                }
            }
        }
        Ok::<_, String>(out)
    };
    let out = tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| format!("no complete answer within {timeout:?}"))??;
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(out.len());
    let head = String::from_utf8_lossy(&out[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = out.get(split + 4..).map(<[u8]>::to_vec).unwrap_or_default();
    Ok(RawAnswer { status, head, body })
}

// ---------------------------------------------------------------------------------------------
// Small helpers shared by the fault and hostile-input suites

/// Every execution the checkout recorded (its whole ledger), read from the checkout directly.
pub async fn ledger(checkout_base: &str) -> Vec<serde_json::Value> {
    let c = crate::client::Client::new(checkout_base);
    c.send(crate::client::Request::get("/charges"))
        .await
        .json()
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// How many executions each key has in `ledger`.
pub fn executions_per_key(
    ledger: &[serde_json::Value],
) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for e in ledger {
        if let Some(k) = e["idempotency_key"].as_str() {
            *m.entry(k.to_owned()).or_insert(0) += 1;
        }
    }
    m
}

/// A small deterministic PRNG (xorshift64*), seeded from the clock unless `FAULT_SEED` is set;
/// the seed is printed so a run can be repeated.
pub struct Rng(u64);

impl Rng {
    /// A generator that repeats the sequence of `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn from_env(label: &str) -> Self {
        let seed = std::env::var("FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(7)
            });
        eprintln!("{label}: FAULT_SEED={seed}");
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Appends one line of measured figures (JSON) to `<target>/fault-figures.jsonl`, and prints it:
/// docs/RELIABILITY.md quotes these.
pub fn record_figures(suite: &str, test: &str, figures: serde_json::Value) {
    use std::io::Write as _;
    let line = serde_json::json!({"suite": suite, "test": test, "figures": figures}).to_string();
    eprintln!("FIGURES {line}");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| crate::process::workspace_root().join("target"));
    let _ = std::fs::create_dir_all(&target);
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(target.join("fault-figures.jsonl"))
    {
        let _ = writeln!(f, "{line}");
    }
}
