//! Requests whose bodies are held in flight together: each sends its headers and all of its
//! body but the last byte, then waits until every request of the burst has come that far (or was
//! answered already), and only then sends the last byte. The filter buffers a protected body
//! whole before it claims, so at that moment Envoy holds every body the filter admitted: what
//! `max_buffered_bytes` must bound, measured while it is held.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::Request;
use tokio::sync::watch;

use crate::load::{handshake, read_answer, Answer, Req};

/// The burst's shared state: how many requests have handed the client library all of their
/// body but the last byte, how many were answered, and the signal that lets every last byte go.
#[derive(Clone)]
pub(super) struct Gate {
    handed: Arc<AtomicUsize>,
    answered: Arc<AtomicUsize>,
    open: watch::Sender<bool>,
}

impl Gate {
    pub(super) fn new() -> Self {
        Self {
            handed: Arc::new(AtomicUsize::new(0)),
            answered: Arc::new(AtomicUsize::new(0)),
            open: watch::Sender::new(false),
        }
    }

    /// Waits (at most `limit`) until each of the `n` requests has handed over its held body or
    /// was answered, and then until Envoy (`envoy_counts`: its requests in progress and the bytes
    /// it has read, from its admin stats) has every request not answered in progress and has
    /// read nothing more for 300 ms: the bodies are in Envoy, not in this program's or the
    /// kernel's buffers. Says how many requests Envoy held then.
    pub(super) async fn all_held(
        &self,
        n: usize,
        limit: Duration,
        envoy_counts: impl Fn() -> Option<(u64, u64)>,
    ) -> u64 {
        let t0 = Instant::now();
        let mut last_read = None;
        let mut still_since = Instant::now();
        let mut active = 0;
        while t0.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let answered = self.answered.load(Relaxed);
            if self.handed.load(Relaxed) + answered < n {
                continue;
            }
            let Some((in_progress, read)) = envoy_counts() else {
                continue;
            };
            active = in_progress;
            if last_read != Some(read) {
                last_read = Some(read);
                still_since = Instant::now();
            } else if in_progress as usize + answered >= n
                && still_since.elapsed() >= Duration::from_millis(300)
            {
                break;
            }
        }
        active
    }

    pub(super) fn open(&self) {
        self.open.send_replace(true);
    }
}

/// A body of two frames: all but the last byte at once, the last byte once the gate opens.
struct HeldBody {
    head: Option<Bytes>,
    tail: Option<Bytes>,
    /// Counted once, when the head has been taken and the body is asked for more.
    handed: Option<Arc<AtomicUsize>>,
    opened: Pin<Box<dyn Future<Output = ()> + Send>>,
    len: u64,
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Some(handed) = self.handed.take() {
            handed.fetch_add(1, Relaxed);
        }
        if self.tail.is_none() {
            return Poll::Ready(None);
        }
        match self.opened.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(self.tail.take().map(|t| Ok(Frame::data(t)))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.tail.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.len)
    }
}

/// Sends `req` on a connection of its own with its body held at the gate.
pub(super) async fn send(addr: SocketAddr, req: &Req, gate: &Gate) -> Result<Answer, String> {
    let answer = send_held(addr, req, gate).await;
    gate.answered.fetch_add(1, Relaxed);
    answer
}

async fn send_held(addr: SocketAddr, req: &Req, gate: &Gate) -> Result<Answer, String> {
    let mut sender = handshake(addr).await?;
    let split = req.body.len().saturating_sub(1);
    let mut open = gate.open.subscribe();
    let body = HeldBody {
        head: Some(req.body.slice(..split)),
        tail: Some(req.body.slice(split..)),
        handed: Some(Arc::clone(&gate.handed)),
        opened: Box::pin(async move {
            let _ = open.wait_for(|o| *o).await;
        }),
        len: req.body.len() as u64,
    };
    let mut builder = Request::builder()
        .method(req.method.clone())
        .uri(&req.path)
        .header("host", addr.to_string())
        .header("content-length", req.body.len().to_string());
    for (k, v) in &req.headers {
        builder = builder.header(k, v);
    }
    let request = builder.body(body).map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("send: {e}"))?;
    read_answer(response).await
}
