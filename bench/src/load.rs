//! The one load tool of the benchmark: a closed loop of N HTTP/1.1 keep-alive connections
//! (hyper, one connection per simulated client), each sending its next request as soon as the
//! previous answer is read to the end. Every answer is checked; a wrong one is an error, counted
//! by kind, and its latency is not mixed into the percentiles.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// The first sequence number of the next client (each client counts up from it).
static NEXT_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One request to send.
#[derive(Clone, Debug)]
pub struct Req {
    pub method: Method,
    pub path: String,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

impl Req {
    pub fn post(path: &str, body: Bytes) -> Self {
        Self {
            method: Method::POST,
            path: path.to_owned(),
            headers: Vec::new(),
            body,
        }
    }

    pub fn header(mut self, name: &'static str, value: &str) -> Self {
        // Values are made by this program; a bad one is a bug here, so it panics at once.
        let v = HeaderValue::from_str(value)
            .unwrap_or_else(|e| panic!("bad header value {value:?}: {e}"));
        self.headers.push((HeaderName::from_static(name), v));
        self
    }
}

/// An answer, read to the end.
pub struct Answer {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// One keep-alive HTTP/1.1 connection.
pub struct Conn {
    addr: SocketAddr,
    sender: SendRequest<Full<Bytes>>,
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> Result<Self, String> {
        Ok(Self {
            addr,
            sender: handshake(addr).await?,
        })
    }

    pub async fn send(&mut self, req: &Req) -> Result<Answer, String> {
        self.sender
            .ready()
            .await
            .map_err(|e| format!("connection: {e}"))?;
        let mut builder = Request::builder()
            .method(req.method.clone())
            .uri(&req.path)
            .header("host", self.addr.to_string());
        for (k, v) in &req.headers {
            builder = builder.header(k, v);
        }
        let request = builder
            .body(Full::new(req.body.clone()))
            .map_err(|e| e.to_string())?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(|e| format!("send: {e}"))?;
        read_answer(response).await
    }
}

/// A new HTTP/1.1 connection to `addr` (no Nagle), its requests' bodies of type `B`.
pub async fn handshake<B>(addr: SocketAddr) -> Result<SendRequest<B>, String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// A response read to the end.
pub async fn read_answer(
    response: hyper::Response<hyper::body::Incoming>,
) -> Result<Answer, String> {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// What one operation of a scenario did.
pub enum Outcome {
    Ok,
    /// A wrong answer, with a short label for the error table.
    Wrong(String),
}

/// A scenario's operation: sends one or more requests on the connection and checks the answers.
/// Arguments: the connection, the client's index, the operation's sequence number.
pub type OpFn = Arc<
    dyn Fn(&mut Conn, usize, u64) -> futures_lite::BoxFut<'_, Result<Outcome, String>>
        + Send
        + Sync,
>;

pub mod futures_lite {
    use std::future::Future;
    use std::pin::Pin;
    pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
}

/// The result of one measured run.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    pub connections: usize,
    pub ok: u64,
    /// Errors by kind (wrong status, missing header, transport error...).
    pub errors: BTreeMap<String, u64>,
    pub elapsed: Duration,
    /// Latencies of the correct answers, microseconds, sorted.
    pub lat_us: Vec<u32>,
}

impl RunResult {
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Correct answers per second.
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Percentile `p` (0..=100) in milliseconds (nearest rank).
    pub fn pct_ms(&self, p: f64) -> f64 {
        percentile(&self.lat_us, p) / 1000.0
    }
}

/// Percentile `p` (0..=100) of `sorted` by nearest rank, in the values' own unit; NaN for none.
pub fn percentile<T: Copy + Into<f64>>(sorted: &[T], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].into()
}

/// Runs `op` in a closed loop on `connections` connections: `warmup` unrecorded, then `measure`
/// recorded. A connection that fails is counted as an error and opened again (at most 100
/// times per client, so a dead target ends the run instead of spinning).
pub async fn run(
    addr: SocketAddr,
    connections: usize,
    warmup: Duration,
    measure: Duration,
    op: OpFn,
) -> RunResult {
    let start = Instant::now();
    let record_from = start + warmup;
    let deadline = record_from + measure;
    let mut tasks = Vec::with_capacity(connections);
    for client in 0..connections {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(65_536);
            let mut errors: BTreeMap<String, u64> = BTreeMap::new();
            let mut ok = 0u64;
            let mut reconnects = 0;
            // Unique across runs and repeated runs of the process: keys made from it are never reused.
            let mut seq = NEXT_SEQ.fetch_add(1 << 32, std::sync::atomic::Ordering::Relaxed);
            'outer: while Instant::now() < deadline {
                let mut conn = match Conn::open(addr).await {
                    Ok(c) => c,
                    Err(e) => {
                        *errors.entry(format!("connect: {}", short(&e))).or_default() += 1;
                        reconnects += 1;
                        if reconnects > 100 {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                loop {
                    let t0 = Instant::now();
                    if t0 >= deadline {
                        break 'outer;
                    }
                    let outcome = op(&mut conn, client, seq).await;
                    seq += 1;
                    let recorded = t0 >= record_from;
                    match outcome {
                        Ok(Outcome::Ok) => {
                            if recorded {
                                ok += 1;
                                lat.push(
                                    u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX),
                                );
                            }
                        }
                        Ok(Outcome::Wrong(kind)) => {
                            if recorded {
                                *errors.entry(kind).or_default() += 1;
                            }
                        }
                        Err(e) => {
                            // Transport errors count whenever they happen: they also break the loop.
                            *errors
                                .entry(format!("transport: {}", short(&e)))
                                .or_default() += 1;
                            reconnects += 1;
                            if reconnects > 100 {
                                break 'outer;
                            }
                            continue 'outer;
                        }
                    }
                }
            }
            (ok, errors, lat)
        }));
    }
    let mut result = RunResult {
        connections,
        ..RunResult::default()
    };
    for t in tasks {
        match t.await {
            Ok((ok, errors, lat)) => {
                result.ok += ok;
                for (k, v) in errors {
                    *result.errors.entry(k).or_default() += v;
                }
                result.lat_us.extend(lat);
            }
            Err(e) => *result.errors.entry(format!("task: {e}")).or_default() += 1,
        }
    }
    // Every client stops at the deadline, after its last answer: the window is from the start
    // of recording to the end of the last answer.
    result.elapsed = record_from.elapsed();
    result.lat_us.sort_unstable();
    result
}

pub fn short(e: &str) -> String {
    e.chars().take(80).collect()
}
